//! What the plugin registry answers (a tenant's plugins, their versions, the default) and why it
//! refuses. The HTTP API and `warden plugin` serialize these as they are; [`PluginError`] reaches
//! a client through [`crate::serve::error::ApiError`].

use serde::Serialize;

use crate::plugin::PluginFailure;
use crate::serve::store::StoreError;
use crate::serve::store::records::{PluginRecord, Version};

/// One version of a plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionView {
    /// SHA-256 of the component, hex: the version's id.
    pub version: String,
    /// Component size, bytes.
    pub size: u64,
    /// Upload time, seconds since the Unix epoch.
    pub uploaded: u64,
    /// Whether requests run this version.
    pub active: bool,
}

/// A plugin as its tenant sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PluginView {
    /// Its name.
    pub name: String,
    /// The active version, if one is.
    pub active: Option<String>,
    /// Whether it is the tenant's default plugin.
    pub default: bool,
    /// Its versions, oldest first.
    pub versions: Vec<VersionView>,
    /// Size of its configuration, bytes (the text itself stays private).
    pub config_bytes: usize,
}

impl PluginView {
    /// `rec` as its tenant sees it; `default` if it is the tenant's default.
    pub(super) fn of(rec: &PluginRecord, default: bool) -> Self {
        let view = |v: &Version| VersionView {
            version: v.sha256.clone(),
            size: v.size,
            uploaded: v.uploaded,
            active: rec.active.as_deref() == Some(v.sha256.as_str()),
        };
        Self {
            name: rec.name.clone(),
            active: rec.active.clone(),
            default,
            versions: rec.versions.iter().map(view).collect(),
            config_bytes: rec.config.len(),
        }
    }
}

/// A tenant's plugins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PluginList {
    /// Each plugin.
    pub data: Vec<PluginView>,
}

/// What an upload did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Uploaded {
    /// The plugin now.
    pub plugin: PluginView,
    /// The uploaded version's id.
    pub version: String,
    /// Whether the version is new (else the same bytes were uploaded before).
    pub new: bool,
}

/// A deleted plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Deleted {
    /// Its name.
    pub deleted: String,
    /// The versions deleted with it.
    pub versions: usize,
}

/// The tenant's default plugin after a change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DefaultPlugin {
    /// Its name, if it has one.
    pub default: Option<String>,
}

/// Why the registry refused.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The tenant has no plugin of that name.
    #[error("no plugin {0:?}")]
    NotFound(String),
    /// The plugin has no active version to run.
    #[error("plugin {0:?} has no active version; activate one")]
    Inactive(String),
    /// The plugin has no such version.
    #[error("plugin {name:?} has no version {version:?} (give its SHA-256, or at least 8 unambiguous leading digits)")]
    VersionNotFound {
        /// The plugin.
        name: String,
        /// The version asked for.
        version: String,
    },
    /// A plugin name outside the allowed form.
    #[error(
        "invalid plugin name {0:?}: use 1 to 63 characters, lowercase letters, digits, '-' and '_', starting with a letter or digit"
    )]
    BadName(String),
    /// A component over the size limit.
    #[error("the component is {got} bytes, more than the limit of {limit}")]
    ComponentTooLarge {
        /// Its size.
        got: usize,
        /// The limit.
        limit: usize,
    },
    /// A configuration over the size limit.
    #[error("the plugin config is {got} bytes, more than the limit of {limit}")]
    ConfigTooLarge {
        /// Its size.
        got: usize,
        /// The limit.
        limit: usize,
    },
    /// A configuration that is not text.
    #[error("the plugin config must be UTF-8 text: {0}")]
    ConfigNotText(std::str::Utf8Error),
    /// The tenant has as many plugins as it may.
    #[error("tenant {tenant:?} has {max} plugins, the most allowed; delete one first")]
    TooMany {
        /// The tenant's name.
        tenant: String,
        /// The limit.
        max: usize,
    },
    /// The tenant uploaded as many new versions this minute as it may.
    #[error("tenant {tenant:?} may upload {per_minute} new plugin versions a minute; retry in {retry_after} s")]
    UploadRate {
        /// The tenant's name.
        tenant: String,
        /// Its limit.
        per_minute: u64,
        /// Seconds until the next upload fits.
        retry_after: u64,
    },
    /// The tenant has spent its compile budget (uploads and pre-initialisations together).
    #[error(
        "tenant {tenant:?} may compile plugins for {seconds_per_minute} s a minute and has used that; retry in {retry_after} s"
    )]
    CompileBudget {
        /// The tenant's name.
        tenant: String,
        /// Its budget.
        seconds_per_minute: u64,
        /// Seconds until a compile fits again.
        retry_after: u64,
    },
    /// The tenant's requests hold its whole share of plugin instances.
    #[error(
        "tenant {tenant:?}'s requests hold {held} plugin instances and this one needs {needed}; its share is {share}"
    )]
    Instances {
        /// The tenant's name.
        tenant: String,
        /// Instances its requests hold.
        held: usize,
        /// Instances this request needs.
        needed: usize,
        /// Its share.
        share: usize,
    },
    /// Nothing was active before the current version.
    #[error("plugin {0:?} has no earlier active version")]
    NothingToRollBack(String),
    /// The version to delete is the active one.
    #[error("version {version} of plugin {name:?} is active; activate another first")]
    VersionActive {
        /// The plugin.
        name: String,
        /// The version.
        version: String,
    },
    /// The uploaded component is not one this server runs (it does not compile, does not
    /// implement the world, or failed its upload check).
    #[error("{0}")]
    Rejected(PluginFailure),
    /// The active version changed while a new configuration was being checked against it.
    #[error("plugin {0:?}'s active version changed while its configuration was checked; send it again")]
    Changed(String),
    /// The active version refused a new configuration in its smoke call (or failed with it).
    #[error("version {version} refused the configuration: {failure}")]
    ConfigRejected {
        /// The active version.
        version: String,
        /// What it did.
        failure: PluginFailure,
    },
    /// Running the plugin service failed (the compiler is busy, or a component is over its
    /// limits).
    #[error("{0}")]
    Failed(PluginFailure),
}
