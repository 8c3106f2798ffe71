//! Plugin versions in sled: one record per (tenant, plugin name) with its versions, the active
//! one and the activation history that rollback walks back; the component bytes of each version,
//! keyed by tenant and SHA-256; and each tenant's default plugin.
//!
//! Every key starts with the tenant's id, so one tenant's records are never found under
//! another's, and deleting a tenant removes a key range.

use serde::{Deserialize, Serialize};

use super::error::{StoreError, now};
use crate::tenant::TenantId;

/// One uploaded version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    /// SHA-256 of the component bytes, hex: the version's id.
    pub sha256: String,
    /// Component size, bytes.
    pub size: u64,
    /// Upload time, seconds since the Unix epoch.
    pub uploaded: u64,
}

/// A plugin of a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginRecord {
    /// Its name.
    pub name: String,
    /// Versions, oldest first.
    pub versions: Vec<Version>,
    /// The version requests run, if any.
    pub active: Option<String>,
    /// What ran before, most recent last: what rollback returns to (the version and its
    /// configuration together).
    #[serde(deserialize_with = "deployments")]
    pub history: Vec<Deployment>,
    /// The configuration the active version is given (`request.config` in the world).
    pub config: String,
}

/// A version as it ran: the component and the configuration it was given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployment {
    /// The version's id.
    pub version: String,
    /// Its configuration then; `None` for records stored before configurations were kept with
    /// their versions (rolling back to one keeps the configuration of the moment).
    pub config: Option<String>,
}

/// A history entry as stored: a deployment, or (older records) a bare version id.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stored {
    Deployment(Deployment),
    Version(String),
}

fn deployments<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Deployment>, D::Error> {
    let stored: Vec<Stored> = Deserialize::deserialize(d)?;
    Ok(stored
        .into_iter()
        .map(|s| match s {
            Stored::Deployment(x) => x,
            Stored::Version(version) => Deployment { version, config: None },
        })
        .collect())
}

impl PluginRecord {
    /// The version whose id is `v` or starts with it (at least 8 hex digits, unambiguous).
    pub fn find(&self, v: &str) -> Option<&Version> {
        let v = v.to_ascii_lowercase();
        if v.len() < 8 {
            return None;
        }
        let mut hits = self.versions.iter().filter(|x| x.sha256.starts_with(&v));
        match (hits.next(), hits.next()) {
            (Some(x), None) => Some(x),
            _ => None,
        }
    }
}

/// The trees the records live in.
#[derive(Clone)]
pub struct Records {
    plugins: sled::Tree,
    blobs: sled::Tree,
    defaults: sled::Tree,
}

fn plugin_key(tenant: TenantId, name: &str) -> Vec<u8> {
    let mut k = tenant.get().to_be_bytes().to_vec();
    k.extend_from_slice(name.as_bytes());
    k
}

fn blob_key(tenant: TenantId, sha: &[u8; 32]) -> Vec<u8> {
    let mut k = tenant.get().to_be_bytes().to_vec();
    k.extend_from_slice(sha);
    k
}

/// Hex of a digest.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Records {
    /// The record trees of `db`.
    pub fn open(db: &sled::Db) -> Result<Self, StoreError> {
        Ok(Self {
            plugins: db.open_tree("plugins")?,
            blobs: db.open_tree("plugin_blobs")?,
            defaults: db.open_tree("plugin_defaults")?,
        })
    }

    /// Plugin `name` of `tenant`.
    pub fn get(&self, tenant: TenantId, name: &str) -> Result<Option<PluginRecord>, StoreError> {
        self.plugins
            .get(plugin_key(tenant, name))?
            .map(|b| serde_json::from_slice(&b).map_err(|_| StoreError::Corrupt(format!("plugin {name}"))))
            .transpose()
    }

    /// Writes `rec` (it replaces any record of the same name).
    pub fn put(&self, tenant: TenantId, rec: &PluginRecord) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(rec).map_err(|_| StoreError::Corrupt(format!("plugin {}", rec.name)))?;
        self.plugins.insert(plugin_key(tenant, &rec.name), bytes)?;
        self.plugins.flush()?;
        Ok(())
    }

    /// The tenant's plugins, by name.
    pub fn list(&self, tenant: TenantId) -> Result<Vec<PluginRecord>, StoreError> {
        self.plugins
            .scan_prefix(tenant.get().to_be_bytes())
            .map(|kv| {
                let (k, v) = kv?;
                serde_json::from_slice(&v).map_err(|_| StoreError::Corrupt(format!("plugin {}", hex(&k))))
            })
            .collect()
    }

    /// Removes plugin `name` and the bytes of its versions.
    pub fn remove(&self, tenant: TenantId, rec: &PluginRecord) -> Result<(), StoreError> {
        for v in &rec.versions {
            self.remove_blob(tenant, &v.sha256)?;
        }
        self.plugins.remove(plugin_key(tenant, &rec.name))?;
        if self.default(tenant)?.as_deref() == Some(rec.name.as_str()) {
            self.defaults.remove(tenant.get().to_be_bytes())?;
        }
        self.plugins.flush()?;
        Ok(())
    }

    /// Stores a version's bytes.
    pub fn put_blob(&self, tenant: TenantId, sha: &[u8; 32], bytes: &[u8]) -> Result<(), StoreError> {
        self.blobs.insert(blob_key(tenant, sha), bytes)?;
        Ok(())
    }

    /// A version's bytes.
    pub fn blob(&self, tenant: TenantId, sha256: &str) -> Result<Option<sled::IVec>, StoreError> {
        let Some(sha) = unhex(sha256) else {
            return Ok(None);
        };
        Ok(self.blobs.get(blob_key(tenant, &sha))?)
    }

    /// Drops a version's bytes.
    pub fn remove_blob(&self, tenant: TenantId, sha256: &str) -> Result<(), StoreError> {
        if let Some(sha) = unhex(sha256) {
            self.blobs.remove(blob_key(tenant, &sha))?;
        }
        Ok(())
    }

    /// The tenant's default plugin, if set.
    pub fn default(&self, tenant: TenantId) -> Result<Option<String>, StoreError> {
        Ok(self
            .defaults
            .get(tenant.get().to_be_bytes())?
            .map(|b| String::from_utf8_lossy(&b).into_owned()))
    }

    /// Sets (or with `None` clears) the tenant's default plugin.
    pub fn set_default(&self, tenant: TenantId, name: Option<&str>) -> Result<(), StoreError> {
        match name {
            Some(n) => self.defaults.insert(tenant.get().to_be_bytes(), n.as_bytes())?,
            None => self.defaults.remove(tenant.get().to_be_bytes())?,
        };
        self.defaults.flush()?;
        Ok(())
    }

    /// Removes everything of `tenant`.
    pub fn forget_tenant(&self, tenant: TenantId) -> Result<(), StoreError> {
        for tree in [&self.plugins, &self.blobs, &self.defaults] {
            for k in tree.scan_prefix(tenant.get().to_be_bytes()).keys() {
                tree.remove(k?)?;
            }
            tree.flush()?;
        }
        Ok(())
    }
}

/// A new version record for `bytes`, and its digest.
pub fn version_of(bytes: &[u8]) -> (Version, [u8; 32]) {
    use sha2::Digest;
    let sha: [u8; 32] = sha2::Sha256::digest(bytes).into();
    (
        Version {
            sha256: hex(&sha),
            size: bytes.len() as u64,
            uploaded: now(),
        },
        sha,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records stored before configurations were kept with their versions still load: their
    /// history entries are versions whose configuration was not recorded.
    #[test]
    fn old_histories_load_as_deployments_without_a_config() {
        let old = r#"{"name":"p","versions":[],"active":"b","history":["a"],"config":"x"}"#;
        let rec: PluginRecord = serde_json::from_str(old).unwrap();
        assert_eq!(
            rec.history,
            [Deployment {
                version: "a".into(),
                config: None
            }]
        );
        let again: PluginRecord = serde_json::from_slice(&serde_json::to_vec(&rec).unwrap()).unwrap();
        assert_eq!(again, rec);
        let new = r#"{"name":"p","versions":[],"active":"b","history":[{"version":"a","config":"y"}],"config":"x"}"#;
        let rec: PluginRecord = serde_json::from_str(new).unwrap();
        assert_eq!(rec.history[0].config.as_deref(), Some("y"));
    }
}
