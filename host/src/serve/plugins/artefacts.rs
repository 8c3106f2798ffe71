//! Compiled plugins on disk, so a restart does not recompile every tenant's plugins.
//!
//! An artefact is machine code that wasmtime runs without verifying it, so a file is loaded only
//! if Warden wrote it: each file starts with an HMAC-SHA256, under a secret kept in the state
//! store, of its name's parts (tenant, component SHA-256, engine compatibility) and its contents.
//! A file that was altered, copied from another tenant's name, written by another process or by
//! another engine version fails the check (or wasmtime's own version check) and is recompiled.
//!
//! A plugin's pre-initialised compile (its `init` run once with a configuration) is kept the
//! same way, under `snapshots/<tenant>/<plugin>/`, its MAC covering the plugin's name, version
//! and configuration as well; only the latest one of each plugin is kept.

use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::plugin::{Plugin, Runtime};
use crate::tenant::TenantId;

const MAC_LEN: usize = 32;

/// The cache directory and its key.
pub struct Artefacts {
    dir: PathBuf,
    key: [u8; 32],
    compatibility: String,
}

/// HMAC-SHA256 of `parts`, each length-prefixed so no two part lists give the same input.
fn hmac(key: &[u8; 32], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
    for p in parts {
        m.update(&(p.len() as u64).to_be_bytes());
        m.update(p);
    }
    m
}

impl Artefacts {
    /// A cache in `dir` (created), authenticated with `key`, for `runtime`'s engine.
    pub fn new(dir: &Path, key: [u8; 32], runtime: &Runtime) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.into(),
            key,
            compatibility: runtime.compatibility(),
        })
    }

    fn path(&self, tenant: TenantId, sha256: &str) -> PathBuf {
        self.dir
            .join(format!("{:016x}-{sha256}-{}.cwasm", tenant.get(), self.compatibility))
    }

    fn mac(&self, tenant: TenantId, sha256: &str, body: &[u8]) -> Hmac<Sha256> {
        hmac(
            &self.key,
            &[
                &tenant.get().to_be_bytes(),
                sha256.as_bytes(),
                self.compatibility.as_bytes(),
                body,
            ],
        )
    }

    /// The cached compile of `tenant`'s version `sha256`, if there is one that Warden wrote.
    pub fn load(&self, runtime: &Runtime, tenant: TenantId, sha256: &str) -> Option<Plugin> {
        let mac = |body: &[u8]| self.mac(tenant, sha256, body);
        load_file(runtime, &self.path(tenant, sha256), mac)
    }

    /// Writes `plugin`'s compile for `tenant`'s version `sha256` (atomically; errors are
    /// ignored: the cache only saves time).
    pub fn save(&self, tenant: TenantId, sha256: &str, plugin: &Plugin) {
        let Ok(body) = plugin.artefact() else { return };
        let mac = self.mac(tenant, sha256, &body);
        save_file(&self.path(tenant, sha256), mac, &body);
    }

    /// Drops the cached compile of a version.
    pub fn remove(&self, tenant: TenantId, sha256: &str) {
        let _ = std::fs::remove_file(self.path(tenant, sha256));
    }

    /// Where plugin `name`'s pre-initialised compiles are: one directory per plugin, holding
    /// the one for its active version and configuration.
    fn snapshot_dir(&self, tenant: TenantId, name: &str) -> PathBuf {
        self.dir
            .join("snapshots")
            .join(format!("{:016x}", tenant.get()))
            .join(name)
    }

    fn snapshot_path(&self, tenant: TenantId, name: &str, version: &str, made: &str) -> PathBuf {
        self.snapshot_dir(tenant, name)
            .join(format!("{version}-{}-{}.cwasm", digest(made), self.compatibility))
    }

    fn snapshot_mac(&self, tenant: TenantId, name: &str, version: &str, made: &str, body: &[u8]) -> Hmac<Sha256> {
        hmac(
            &self.key,
            &[
                b"snapshot",
                &tenant.get().to_be_bytes(),
                name.as_bytes(),
                version.as_bytes(),
                made.as_bytes(),
                self.compatibility.as_bytes(),
                body,
            ],
        )
    }

    /// The cached compile of plugin `name`'s `version` pre-initialised as `config` says (the
    /// configuration, and whatever else the state depends on), if there is one that Warden
    /// wrote (as the component it is: the caller marks it).
    pub fn load_snapshot(
        &self,
        runtime: &Runtime,
        tenant: TenantId,
        name: &str,
        version: &str,
        made: &str,
    ) -> Option<Plugin> {
        let mac = |body: &[u8]| self.snapshot_mac(tenant, name, version, made, body);
        load_file(runtime, &self.snapshot_path(tenant, name, version, made), mac)
    }

    /// Writes plugin `name`'s `version` pre-initialised as `made` says, and drops the plugin's
    /// others: at most one per plugin stays on disk.
    pub fn save_snapshot(&self, tenant: TenantId, name: &str, version: &str, made: &str, plugin: &Plugin) {
        let Ok(body) = plugin.artefact() else { return };
        let dir = self.snapshot_dir(tenant, name);
        if std::fs::create_dir_all(&dir).is_err() {
            return;
        }
        let path = self.snapshot_path(tenant, name, version, made);
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.path() != path {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        save_file(&path, self.snapshot_mac(tenant, name, version, made, &body), &body);
    }

    /// Drops plugin `name`'s pre-initialised compiles.
    pub fn remove_snapshots(&self, tenant: TenantId, name: &str) {
        let _ = std::fs::remove_dir_all(self.snapshot_dir(tenant, name));
    }

    /// Drops every compile of `tenant`'s plugins (the tenant was deleted).
    pub fn remove_tenant(&self, tenant: TenantId) {
        let _ = std::fs::remove_dir_all(self.dir.join("snapshots").join(format!("{:016x}", tenant.get())));
        let prefix = format!("{:016x}-", tenant.get());
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

/// SHA-256 of `made`, as hex: a snapshot file's name says what it was made from.
fn digest(made: &str) -> String {
    use sha2::Digest;
    Sha256::digest(made.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Loads the artefact at `path` if its MAC (`mac` of the body) is right.
fn load_file(runtime: &Runtime, path: &Path, mac: impl Fn(&[u8]) -> Hmac<Sha256>) -> Option<Plugin> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.len() < MAC_LEN {
        return None;
    }
    let (tag, body) = bytes.split_at(MAC_LEN);
    // Compared in constant time.
    mac(body).verify_slice(tag).ok()?;
    // SAFETY: the MAC proves this process's store wrote these exact bytes with
    // `Plugin::artefact` for this engine compatibility, under this name.
    unsafe { runtime.load_artefact(body) }.ok()
}

/// Writes `mac`'s tag and `body` to `path`, atomically.
fn save_file(path: &Path, mac: Hmac<Sha256>, body: &[u8]) {
    let mut out = mac.finalize().into_bytes().to_vec();
    out.extend_from_slice(body);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if crate::serve::tls::write_private(&tmp, &out).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(key: &[u8; 32], parts: &[&[u8]]) -> Vec<u8> {
        hmac(key, parts).finalize().into_bytes().to_vec()
    }

    #[test]
    fn the_mac_depends_on_key_and_on_how_the_parts_are_split() {
        let k = [7u8; 32];
        assert_ne!(tag(&k, &[b"ab", b"c"]), tag(&k, &[b"a", b"bc"]));
        assert_ne!(tag(&k, &[b"x"]), tag(&[8u8; 32], &[b"x"]));
        assert_eq!(tag(&k, &[b"x"]), tag(&k, &[b"x"]));
        assert!(hmac(&k, &[b"x"]).verify_slice(&tag(&k, &[b"x"])).is_ok());
        assert!(hmac(&k, &[b"x"]).verify_slice(&tag(&k, &[b"y"])).is_err());
    }

    #[test]
    fn it_is_hmac_sha256_of_the_length_prefixed_parts() {
        // RFC 4231 test case 2's key and data, as one part: HMAC-SHA256 over its 8-byte length
        // and the data, checked against the `sha2` crate's SHA-256 computed by hand.
        use sha2::Digest;
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(b"Jefe");
        let data = b"what do ya want for nothing?";
        let mut msg = (data.len() as u64).to_be_bytes().to_vec();
        msg.extend_from_slice(data);
        let (mut ipad, mut opad) = ([0x36u8; 64], [0x5cu8; 64]);
        for (i, k) in key.iter().enumerate() {
            ipad[i] ^= k;
            opad[i] ^= k;
        }
        let inner = Sha256::new().chain_update(ipad).chain_update(&msg).finalize();
        let outer = Sha256::new().chain_update(opad).chain_update(inner).finalize();
        assert_eq!(tag(&key, &[data]), outer.to_vec());
    }
}
