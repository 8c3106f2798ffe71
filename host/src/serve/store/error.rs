//! What can go wrong with the state store, and the clock its records are stamped with.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No store in the data directory a command named.
    #[error(
        "no state store in {}: `warden serve` makes it on its first start; name the server's data directory with --data-dir or its configuration with --config",
        .0.display()
    )]
    NoStore(PathBuf),
    /// Another process (a running server) holds the store.
    #[error("the state store {0} is in use by another process (a running warden serve?)")]
    Locked(PathBuf),
    /// sled failed.
    #[error("state store: {0}")]
    Sled(#[from] sled::Error),
    /// A record could not be decoded.
    #[error("state store record {0} is corrupt")]
    Corrupt(String),
    /// A tenant name is not allowed.
    #[error(
        "invalid tenant name {0:?}: use 1 to 63 characters, lowercase letters, digits, '-' and '_', starting with a letter or digit"
    )]
    BadName(String),
    /// The tenant exists.
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    /// No such tenant.
    #[error("no tenant {0:?}")]
    NoTenant(String),
    /// No such key.
    #[error("no API key with id {0:?}")]
    NoKey(String),
}

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
