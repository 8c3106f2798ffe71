//! The state store: tenants and their API keys, in sled under the data dir.
//!
//! An API key is `wdn-<id>-<secret>`: a 16-hex-digit id that finds its record, and 256 random bits
//! (base64url) of which only the SHA-256 is stored; the presented secret's hash is compared in
//! constant time. Tenant ids are never reused, so a deleted tenant's KV tags can never match a
//! later tenant's. sled admits one process at a time: [`Store::open`] reports
//! [`StoreError::Locked`] while a server holds the store.

use std::path::Path;

use base64::Engine as _;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub mod error;
pub mod records;

use crate::tenant::TenantId;
use crate::tenant::valid_tenant_name;
pub use error::StoreError;
use error::now;
use records::Records;

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    /// Its id: the owner in every KV tag it gets. Never reused.
    pub id: TenantId,
    /// Its name.
    pub name: String,
    /// Creation time, seconds since the Unix epoch.
    pub created: u64,
}

/// An API key's record (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInfo {
    /// The key's id, the part after `wdn-`.
    pub id: String,
    /// The tenant it authenticates.
    pub tenant: String,
    /// Creation time, seconds since the Unix epoch.
    pub created: u64,
    /// Whether it was revoked.
    pub revoked: bool,
}

#[derive(Serialize, Deserialize)]
struct KeyRecord {
    info: KeyInfo,
    /// SHA-256 of the secret.
    hash: [u8; 32],
}

/// The store.
#[derive(Clone)]
pub struct Store {
    db: sled::Db,
    tenants: sled::Tree,
    keys: sled::Tree,
    meta: sled::Tree,
    plugins: Records,
}

const NEXT_TENANT_ID: &[u8] = b"next_tenant_id";
const ADMIN_TOKEN_HASH: &[u8] = b"admin_token_hash";
const METRICS_TOKEN_HASH: &[u8] = b"metrics_token_hash";
const KEY_PREFIX: &str = "wdn-";
const KEY_ID_LEN: usize = 16;

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    rand::rng().fill_bytes(&mut b);
    b
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

impl Store {
    /// Opens (creating) the store in `dir/state`.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let path = dir.join("state");
        let db = sled::open(&path).map_err(|e| match e {
            sled::Error::Io(ref io) if io.to_string().contains("could not acquire lock") => {
                StoreError::Locked(path.clone())
            }
            e => StoreError::Sled(e),
        })?;
        Ok(Self {
            tenants: db.open_tree("tenants")?,
            keys: db.open_tree("keys")?,
            meta: db.open_tree("meta")?,
            plugins: Records::open(&db)?,
            db,
        })
    }

    /// A tree of its own for another part of the server (e.g. usage counters).
    pub(crate) fn tree(&self, name: &str) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(name)?)
    }

    /// Whether the store has never had a tenant (a first start).
    pub fn is_new(&self) -> Result<bool, StoreError> {
        Ok(self.meta.get(NEXT_TENANT_ID)?.is_none())
    }

    /// Creates tenant `name`.
    pub fn create_tenant(&self, name: &str) -> Result<Tenant, StoreError> {
        if !valid_tenant_name(name) {
            return Err(StoreError::BadName(name.into()));
        }
        if self.tenants.contains_key(name)? {
            return Err(StoreError::TenantExists(name.into()));
        }
        let id = self
            .meta
            .update_and_fetch(NEXT_TENANT_ID, |old| {
                let n = old
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map(u64::from_be_bytes)
                    .unwrap_or(0);
                Some((n + 1).to_be_bytes().to_vec())
            })?
            .and_then(|b| <[u8; 8]>::try_from(&b[..]).ok())
            .map(u64::from_be_bytes)
            .and_then(TenantId::new)
            .ok_or_else(|| StoreError::Corrupt("next_tenant_id".into()))?;
        let t = Tenant {
            id,
            name: name.into(),
            created: now(),
        };
        let bytes = serde_json::to_vec(&t).map_err(|_| StoreError::Corrupt(name.into()))?;
        if self
            .tenants
            .compare_and_swap(name, None as Option<&[u8]>, Some(bytes))?
            .is_err()
        {
            return Err(StoreError::TenantExists(name.into()));
        }
        self.db.flush()?;
        Ok(t)
    }

    /// Tenant `name`, if it exists.
    pub fn tenant(&self, name: &str) -> Result<Option<Tenant>, StoreError> {
        self.tenants
            .get(name)?
            .map(|b| serde_json::from_slice(&b).map_err(|_| StoreError::Corrupt(name.into())))
            .transpose()
    }

    /// All tenants, by name.
    pub fn tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.tenants
            .iter()
            .map(|kv| {
                let (k, v) = kv?;
                serde_json::from_slice(&v).map_err(|_| StoreError::Corrupt(String::from_utf8_lossy(&k).into()))
            })
            .collect()
    }

    /// Deletes tenant `name`, every key of it and its plugins; returns its id.
    pub fn delete_tenant(&self, name: &str) -> Result<TenantId, StoreError> {
        let t = self.tenant(name)?.ok_or_else(|| StoreError::NoTenant(name.into()))?;
        self.tenants.remove(name)?;
        for k in self.keys(Some(name))? {
            self.keys.remove(k.id.as_bytes())?;
        }
        self.plugins.forget_tenant(t.id)?;
        self.db.flush()?;
        Ok(t.id)
    }

    /// Creates an API key for `tenant`; returns its record and the key, which is never stored
    /// and cannot be shown again.
    pub fn create_key(&self, tenant: &str) -> Result<(KeyInfo, String), StoreError> {
        if self.tenant(tenant)?.is_none() {
            return Err(StoreError::NoTenant(tenant.into()));
        }
        let id = random_bytes::<8>()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        let secret = b64(&random_bytes::<32>());
        let info = KeyInfo {
            id: id.clone(),
            tenant: tenant.into(),
            created: now(),
            revoked: false,
        };
        let rec = KeyRecord {
            info: info.clone(),
            hash: sha256(secret.as_bytes()),
        };
        let bytes = serde_json::to_vec(&rec).map_err(|_| StoreError::Corrupt(id.clone()))?;
        self.keys.insert(id.as_bytes(), bytes)?;
        self.db.flush()?;
        Ok((info, format!("{KEY_PREFIX}{id}-{secret}")))
    }

    fn key_record(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        self.keys
            .get(id.as_bytes())?
            .map(|b| serde_json::from_slice(&b).map_err(|_| StoreError::Corrupt(id.into())))
            .transpose()
    }

    /// Revokes key `id` (the part after `wdn-`, or the whole key).
    pub fn revoke_key(&self, id: &str) -> Result<KeyInfo, StoreError> {
        let id = id.strip_prefix(KEY_PREFIX).unwrap_or(id);
        let id = id.get(..KEY_ID_LEN).unwrap_or(id);
        let mut rec = self.key_record(id)?.ok_or_else(|| StoreError::NoKey(id.into()))?;
        rec.info.revoked = true;
        let bytes = serde_json::to_vec(&rec).map_err(|_| StoreError::Corrupt(id.into()))?;
        self.keys.insert(id.as_bytes(), bytes)?;
        self.db.flush()?;
        Ok(rec.info)
    }

    /// Keys, of one tenant or all.
    pub fn keys(&self, tenant: Option<&str>) -> Result<Vec<KeyInfo>, StoreError> {
        let mut out = Vec::new();
        for kv in self.keys.iter() {
            let (k, v) = kv?;
            let rec: KeyRecord =
                serde_json::from_slice(&v).map_err(|_| StoreError::Corrupt(String::from_utf8_lossy(&k).into()))?;
            if tenant.is_none_or(|t| rec.info.tenant == t) {
                out.push(rec.info);
            }
        }
        Ok(out)
    }

    /// The tenant a presented API key authenticates, if it is well-formed, known, unrevoked and
    /// its tenant exists.
    pub fn authenticate(&self, key: &str) -> Result<Option<Tenant>, StoreError> {
        let Some(rest) = key.strip_prefix(KEY_PREFIX) else {
            return Ok(None);
        };
        let (Some(id), Some(secret)) = (rest.get(..KEY_ID_LEN), rest.get(KEY_ID_LEN + 1..)) else {
            return Ok(None);
        };
        if rest.as_bytes().get(KEY_ID_LEN) != Some(&b'-') {
            return Ok(None);
        }
        let Some(rec) = self.key_record(id)? else {
            return Ok(None);
        };
        let ok: bool = sha256(secret.as_bytes()).ct_eq(&rec.hash).into();
        if !ok || rec.info.revoked {
            return Ok(None);
        }
        self.tenant(&rec.info.tenant)
    }

    /// Makes a new admin token, stores its hash (replacing any earlier one) and returns it.
    pub fn new_admin_token(&self) -> Result<String, StoreError> {
        let token = format!("wadm-{}", b64(&random_bytes::<32>()));
        self.set_token(ADMIN_TOKEN_HASH, &token)?;
        Ok(token)
    }

    /// Whether `token` is the admin token.
    pub fn is_admin(&self, token: &str) -> Result<bool, StoreError> {
        self.token_is(ADMIN_TOKEN_HASH, token)
    }

    /// Makes a new metrics token (it reads `GET /metrics`, nothing else), stores its hash
    /// (replacing any earlier one) and returns it.
    pub fn new_metrics_token(&self) -> Result<String, StoreError> {
        let token = format!("wmet-{}", b64(&random_bytes::<32>()));
        self.set_token(METRICS_TOKEN_HASH, &token)?;
        Ok(token)
    }

    /// Makes `token` (the operator's) the metrics token.
    pub fn set_metrics_token(&self, token: &str) -> Result<(), StoreError> {
        self.set_token(METRICS_TOKEN_HASH, token)
    }

    /// Whether `token` is the metrics token.
    pub fn is_metrics_reader(&self, token: &str) -> Result<bool, StoreError> {
        self.token_is(METRICS_TOKEN_HASH, token)
    }

    fn set_token(&self, slot: &[u8], token: &str) -> Result<(), StoreError> {
        self.meta.insert(slot, &sha256(token.as_bytes())[..])?;
        self.db.flush()?;
        Ok(())
    }

    fn token_is(&self, slot: &[u8], token: &str) -> Result<bool, StoreError> {
        Ok(match self.meta.get(slot)? {
            Some(h) if h.len() == 32 => sha256(token.as_bytes()).ct_eq(&h[..]).into(),
            _ => false,
        })
    }

    /// The tenants' plugin records.
    pub fn plugins(&self) -> &Records {
        &self.plugins
    }

    /// A secret of this store, made on first use: `name` tells secrets apart.
    pub fn secret(&self, name: &str) -> Result<[u8; 32], StoreError> {
        let key = format!("secret/{name}");
        let fresh = random_bytes::<32>();
        let _ = self
            .meta
            .compare_and_swap(key.as_bytes(), None as Option<&[u8]>, Some(&fresh[..]))?;
        self.db.flush()?;
        let v = self
            .meta
            .get(key.as_bytes())?
            .ok_or_else(|| StoreError::Corrupt(key.clone()))?;
        <[u8; 32]>::try_from(&v[..]).map_err(|_| StoreError::Corrupt(key))
    }

    /// Writes everything to disk.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("warden-store-{tag}-{}-{}", std::process::id(), now()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn keys_authenticate_their_tenant_until_revoked_and_survive_reopening() {
        let dir = temp_dir("keys");
        let (key, other) = {
            let s = Store::open(&dir).unwrap();
            assert!(s.is_new().unwrap());
            let a = s.create_tenant("acme").unwrap();
            let b = s.create_tenant("beta").unwrap();
            assert!(a.id != b.id);
            let (_, key) = s.create_key("acme").unwrap();
            let (info, other) = s.create_key("beta").unwrap();
            assert_eq!(s.authenticate(&key).unwrap().unwrap().name, "acme");
            assert_eq!(s.authenticate(&other).unwrap().unwrap().id, b.id);
            s.revoke_key(&info.id).unwrap();
            assert!(s.authenticate(&other).unwrap().is_none());
            (key, other)
        };
        let s = crate::testutil::reopen_store(&dir);
        assert!(!s.is_new().unwrap());
        assert_eq!(s.authenticate(&key).unwrap().unwrap().name, "acme");
        assert!(s.authenticate(&other).unwrap().is_none(), "revoked stays revoked");
        // Wrong secrets, truncated and malformed keys.
        let mut wrong = key.clone();
        let last = wrong.pop().unwrap();
        wrong.push(if last == 'A' { 'B' } else { 'A' });
        for k in [&wrong[..], &key[..key.len() - 1], "", "wdn-", "Bearer x", &key[4..]] {
            assert!(s.authenticate(k).unwrap().is_none(), "{k:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tenant_names_are_checked_and_ids_never_reused() {
        let dir = temp_dir("tenants");
        let s = Store::open(&dir).unwrap();
        for bad in ["", "Acme", "-x", "a b", &"x".repeat(64)] {
            assert!(matches!(s.create_tenant(bad), Err(StoreError::BadName(_))), "{bad:?}");
        }
        let a = s.create_tenant("a").unwrap();
        assert!(matches!(s.create_tenant("a"), Err(StoreError::TenantExists(_))));
        let (_, key) = s.create_key("a").unwrap();
        s.delete_tenant("a").unwrap();
        assert!(
            s.authenticate(&key).unwrap().is_none(),
            "a deleted tenant's keys go with it"
        );
        assert!(matches!(s.delete_tenant("a"), Err(StoreError::NoTenant(_))));
        assert!(s.create_tenant("a").unwrap().id > a.id);
        assert!(matches!(s.create_key("nobody"), Err(StoreError::NoTenant(_))));
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_open_is_refused_as_locked() {
        let dir = temp_dir("lock");
        let _s = Store::open(&dir).unwrap();
        // sled locks the store's file (flock), so even a second handle in this process fails.
        match Store::open(&dir) {
            Err(StoreError::Locked(p)) => assert_eq!(p, dir.join("state")),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a second open succeeded"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn admin_token_checks() {
        let dir = temp_dir("admin");
        let s = Store::open(&dir).unwrap();
        assert!(!s.is_admin("anything").unwrap());
        let t = s.new_admin_token().unwrap();
        assert!(s.is_admin(&t).unwrap() && !s.is_admin(&t[1..]).unwrap());
        // The metrics token is another secret: neither opens the other's door.
        assert!(!s.is_metrics_reader(&t).unwrap());
        let m = s.new_metrics_token().unwrap();
        assert!(s.is_metrics_reader(&m).unwrap() && !s.is_admin(&m).unwrap() && !s.is_metrics_reader(&t).unwrap());
        s.set_metrics_token("an operator's own token, long enough").unwrap();
        assert!(
            s.is_metrics_reader("an operator's own token, long enough").unwrap() && !s.is_metrics_reader(&m).unwrap()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
