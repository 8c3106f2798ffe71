//! Tenant plugins in the server: upload validation, versions and activation (stored as
//! [`crate::serve::store::records`]; what the registry answers and why it refuses, in
//! [`registry`]), compiled artefacts in memory and on disk ([`artefacts`]), resolving the plugin
//! a request runs, and running its hooks on the request and its output ([`pipeline`]).
//!
//! Everything is scoped by the tenant's id: a tenant names only its own plugins, and a compiled
//! plugin is cached under (tenant, SHA-256), so even identical bytes uploaded by two tenants
//! share nothing.

pub mod artefacts;
pub mod compiles;
pub mod local;
pub mod logs;
pub mod pipeline;
pub mod registry;
pub mod scaffold;
pub mod shares;
pub mod snapshots;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::store::records::{Deployment, PluginRecord, version_of};
use super::store::{Store, StoreError, Tenant};
use crate::config::PluginsConfig;
use crate::fair::{FairCache, Turns};
use crate::plugin::compile::{CompileLimits, Compiler};
use crate::plugin::{
    Finish, Input, Message, Plugin, PluginFailure, PluginLimits, Request, RequestTime, Runtime, neutral_sampling,
};
use crate::policy::rate::{Denied, Gcra};
use crate::tenant::TenantId;
use crate::tenant::valid_tenant_name;
use crate::tokenizer::Tokenizer;
use artefacts::Artefacts;
use compiles::{CompileRefused, Compiles};
use logs::TenantLogs;
use registry::{DefaultPlugin, Deleted, PluginError, PluginList, PluginView, Uploaded};
pub use shares::Share;
use shares::Shares;
use snapshots::{Component, Job, Snapshots};

/// Compiled plugins kept in memory; beyond this, the tenant keeping the most gives up its least
/// recently used (it is read back from disk when needed).
const COMPILED_CACHE: usize = 256;
/// Activations remembered for rollback.
const HISTORY: usize = 16;
/// A tenant whose policy sets its fuel or time per call gets at most this many calls' worth for
/// `init`.
pub const INIT_CALLS: u64 = 10;

/// The plugin a request runs.
#[derive(Clone)]
pub struct Resolved {
    /// Its name.
    pub name: String,
    /// The active version.
    pub version: String,
    /// The tenant's configuration for it.
    pub config: String,
    /// Compiled, ready to instantiate: pre-initialised with `config` once that is ready.
    pub plugin: Plugin,
    /// Its tenant.
    pub tenant: TenantId,
    /// The server's turns at running `init` in a request's instance (see
    /// [`Resolved::instantiate`]).
    inits: Turns,
}

impl Resolved {
    /// A fresh instance for one request (see [`Plugin::instantiate`]). When the plugin is not
    /// pre-initialised, its `init` (up to a budget ten calls large) runs in every instance: the
    /// instance is then made in its tenant's turn at the server's `init` runs (`[plugins]
    /// init_runs` at once, fairly across tenants, one at a time per tenant), so no tenant can
    /// make the host run `init` for every request it sends at once.
    pub async fn instantiate(
        &self,
        limits: PluginLimits,
        tokenizer: Arc<Tokenizer>,
        seed: u64,
        time: Arc<RequestTime>,
    ) -> Result<crate::plugin::Instance, PluginFailure> {
        let _turn = match self.plugin.runs_init() {
            true => Some(self.inits.take(self.tenant).await),
            false => None,
        };
        self.plugin
            .instantiate(limits, tokenizer, seed, time, &self.config)
            .await
    }
}

/// Why the plugin service could not start.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The running binary, which compiles plugins and checks formats, cannot be found.
    #[error("finding the warden binary, which compiles plugins and checks formats")]
    Compiler(#[source] std::io::Error),
    /// The wasmtime runtime refused its configuration.
    #[error("starting the plugin runtime")]
    Runtime(#[source] PluginFailure),
    /// The artefact key could not be read or made.
    #[error("the plugin artefact key")]
    Key(#[source] StoreError),
    /// The compiled-artefact cache could not be created.
    #[error("creating the plugin cache {}", .0.display())]
    Cache(PathBuf, #[source] std::io::Error),
}

/// The `warden` binary running now, which compiles plugins and checks tenants' formats in child
/// processes.
pub fn compiler() -> Result<PathBuf, SetupError> {
    std::env::current_exe().map_err(SetupError::Compiler)
}

/// The server's plugin service.
pub struct Plugins {
    store: Store,
    cfg: PluginsConfig,
    artefacts: Arc<Artefacts>,
    compiled: Mutex<FairCache<String, Plugin>>,
    /// Serializes read-modify-write of records.
    write: Mutex<()>,
    tokenizer: Arc<Tokenizer>,
    logs: Arc<TenantLogs>,
    /// Plugin instances each tenant's requests hold now.
    shares: Shares,
    /// Compiles components in child processes of the `warden` binary, fairly and within each
    /// tenant's budget.
    compiles: Arc<Compiles>,
    /// Each plugin's active version initialised with its configuration.
    snapshots: Arc<Snapshots>,
    /// Each tenant's uploads of new versions (and pre-initialisations), per minute.
    uploads: Mutex<HashMap<TenantId, Gcra>>,
    /// Turns at running `init` in a request's instance.
    inits: Turns,
}

impl Plugins {
    /// The service over `store`, caching compiled artefacts in `data_dir/plugin-cache`, writing
    /// the tenants' plugin logs to `data_dir/plugin-logs`, and compiling with `compiler` (the
    /// `warden` binary, run as `warden compile-plugin` in a child process).
    pub fn new(
        store: Store,
        cfg: PluginsConfig,
        data_dir: &std::path::Path,
        tokenizer: Arc<Tokenizer>,
        compiler: &std::path::Path,
    ) -> Result<Self, SetupError> {
        let cache_dir = data_dir.join("plugin-cache");
        let runtime = Runtime::new(cfg.instances, cfg.memory_mib << 20).map_err(SetupError::Runtime)?;
        let key = store.secret("plugin-artefacts").map_err(SetupError::Key)?;
        let artefacts =
            Arc::new(Artefacts::new(&cache_dir, key, &runtime).map_err(|e| SetupError::Cache(cache_dir.clone(), e))?);
        let limits = CompileLimits {
            timeout: Duration::from_secs(cfg.compile_timeout_s),
            memory_bytes: cfg.compile_memory_mib << 20,
        };
        let compiler = Arc::new(Compiler::new(compiler, Arc::new(runtime), cfg.compiles, limits));
        let compiles = Arc::new(Compiles::new(compiler));
        let inits = Turns::new(cfg.init_runs, 1);
        let logs = Arc::new(TenantLogs::new(&data_dir.join("plugin-logs")));
        let shares = Shares::default();
        let snapshots = Arc::new(Snapshots::new(
            shares.clone(),
            compiles.clone(),
            artefacts.clone(),
            logs.clone(),
            tokenizer.clone(),
            cfg.max_component_bytes,
        ));
        Ok(Self {
            store,
            cfg,
            artefacts,
            compiled: Mutex::new(FairCache::new(COMPILED_CACHE)),
            write: Mutex::new(()),
            tokenizer,
            logs,
            shares,
            compiles,
            snapshots,
            uploads: Mutex::new(HashMap::new()),
            inits,
        })
    }

    /// What each instance may use.
    pub fn limits(&self) -> PluginLimits {
        limits_of(&self.cfg)
    }

    /// Limits for a plugin of a tenant under `policy`: its fuel, memory and time where it sets
    /// them, the server's otherwise; memory never beyond the server's (an instance slot's size).
    /// A policy's fuel or time per call caps `init`'s too, at [`INIT_CALLS`] calls' worth.
    pub fn limits_for(&self, policy: &crate::policy::Policy) -> PluginLimits {
        let mut l = self.limits();
        if let Some(f) = policy.plugin_fuel_per_call {
            l.fuel_per_call = f;
            l.init_fuel = l.init_fuel.min(f.saturating_mul(INIT_CALLS));
        }
        if let Some(m) = policy.plugin_memory_mib {
            l.memory_bytes = l.memory_bytes.min((m as usize) << 20);
        }
        if let Some(ms) = policy.plugin_call_timeout_ms {
            l.call_timeout = Duration::from_millis(ms);
            l.init_timeout = l.init_timeout.min(Duration::from_millis(ms.saturating_mul(INIT_CALLS)));
        }
        if let Some(ms) = policy.plugin_request_time_ms {
            l.request_time = Duration::from_millis(ms);
        }
        l
    }

    /// Takes `n` of tenant `t`'s plugin instances (its policy's share, else the server's
    /// `tenant_instances`) for one request, until the returned share is dropped. Over its share,
    /// the tenant's request gets 429: one tenant's requests cannot take the instances others
    /// need.
    pub fn take_instances(&self, t: &Tenant, policy: &crate::policy::Policy, n: usize) -> Result<Share, PluginError> {
        let cap = self.instance_share(policy);
        self.shares.take(t.id, cap, n).map_err(|held| PluginError::Instances {
            tenant: t.name.clone(),
            held,
            needed: n,
            share: cap,
        })
    }

    /// How many plugin instances a tenant under `policy` may hold at once: its policy's share,
    /// else the server's `tenant_instances`, never more than the whole pool.
    fn instance_share(&self, policy: &crate::policy::Policy) -> usize {
        policy
            .plugin_instances
            .unwrap_or(u64::from(self.cfg.tenant_instances))
            .min(u64::from(self.cfg.instances)) as usize
    }

    /// The largest component an upload may carry.
    pub fn max_component_bytes(&self) -> usize {
        self.cfg.max_component_bytes
    }

    /// The largest plugin configuration.
    pub fn max_config_bytes(&self) -> usize {
        self.cfg.max_config_bytes
    }

    /// The tenants' plugin logs.
    pub fn logs(&self) -> &Arc<TenantLogs> {
        &self.logs
    }

    /// The served model's tokenizer (plugins import it).
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.write.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, t: &Tenant, name: &str) -> Result<PluginRecord, PluginError> {
        self.store
            .plugins()
            .get(t.id, name)?
            .ok_or_else(|| PluginError::NotFound(name.into()))
    }

    fn is_default(&self, t: &Tenant, name: &str) -> Result<bool, PluginError> {
        Ok(self.store.plugins().default(t.id)?.as_deref() == Some(name))
    }

    fn compiled(&self) -> std::sync::MutexGuard<'_, FairCache<String, Plugin>> {
        self.compiled.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cached(&self, tenant: TenantId, sha: &str) -> Option<Plugin> {
        self.compiled().get(tenant, &sha.to_string())
    }

    fn remember(&self, tenant: TenantId, sha: &str, p: &Plugin) {
        self.compiled().insert(tenant, sha.to_string(), p.clone(), 1);
    }

    fn forget(&self, tenant: TenantId, sha: &str) {
        self.compiled().remove(tenant, &sha.to_string());
        self.artefacts.remove(tenant, sha);
    }

    /// Compiles `bytes` for `t` in a child process under the configured time and memory
    /// limits, once its turn at the compiler comes and within its compile budget (its policy's,
    /// else the server's). Refused by the compiler, the plugin fails as `failed` says.
    async fn compile(
        &self,
        t: &Tenant,
        policy: &crate::policy::Policy,
        bytes: &[u8],
        failed: fn(PluginFailure) -> PluginError,
    ) -> Result<Plugin, PluginError> {
        self.compiles
            .compile(t.id, self.compile_seconds(policy), bytes)
            .await
            .map_err(|e| refused(t, e, failed))
    }

    /// Seconds of compilation a tenant under `policy` may use per minute.
    fn compile_seconds(&self, policy: &crate::policy::Policy) -> u64 {
        policy
            .plugin_compile_seconds_per_minute
            .unwrap_or(self.cfg.compile_seconds_per_minute)
    }

    /// Queues pre-initialising plugin `name`'s `plugin` (version `version`, component `bytes`,
    /// read from the store when the build runs if not given) with `config` in the background,
    /// if it has an `init`, nothing is known or queued for it, and the tenant may: a build
    /// counts as one of its uploads (`paid`: the upload that made the version paid for it). A
    /// tenant past its uploads gets no build; its requests run `init`, and a later one asks
    /// again. Nothing here can fail what called it: a snapshot only saves time.
    #[allow(clippy::too_many_arguments)]
    fn pre_initialise(
        &self,
        t: &Tenant,
        policy: &crate::policy::Policy,
        name: &str,
        version: &str,
        config: &str,
        plugin: &Plugin,
        bytes: Option<Vec<u8>>,
        paid: bool,
    ) {
        let limits = self.limits_for(policy);
        if plugin.world() != "0.2.0" || !self.snapshots.wanted(t.id, name, version, config, &limits) {
            return;
        }
        let job = Job {
            tenant: t.id,
            name: name.into(),
            version: version.into(),
            config: config.into(),
            component: bytes.map_or_else(|| Component::Stored(self.store.clone()), Component::Bytes),
            limits,
            share: self.instance_share(policy),
            compile_seconds: self.compile_seconds(policy),
        };
        // A tenant in debt for its compiles gets no build (nor spends an upload on one).
        let afford = || {
            self.compiles.check(t.id, self.compile_seconds(policy)).is_ok()
                && (paid || self.take_upload(t, policy).is_ok())
        };
        self.snapshots.start(job, afford);
    }

    /// Takes one of tenant `t`'s uploads per minute (its policy's, else the server's), or says
    /// when it may upload again.
    fn take_upload(&self, t: &Tenant, policy: &crate::policy::Policy) -> Result<(), PluginError> {
        let per_minute = policy.plugin_uploads_per_minute.unwrap_or(self.cfg.uploads_per_minute);
        let now = std::time::Instant::now();
        let mut uploads = self.uploads.lock().unwrap_or_else(|p| p.into_inner());
        let g = uploads.entry(t.id).or_insert_with(|| Gcra::per_minute(per_minute, now));
        *g = g.with_limit(per_minute);
        g.take(1, now).map_err(|d| {
            let after = match d {
                Denied::RetryAfter(d) => d.as_secs().max(1),
                Denied::TooLarge { .. } => 60,
            };
            PluginError::UploadRate {
                tenant: t.name.clone(),
                per_minute,
                retry_after: after,
            }
        })
    }

    /// A smoke call under the configured limits: instantiate, `capabilities`, `preprocess` of a
    /// small chat request with `config`, and a final `postprocess`. A trap, exhausted fuel, a
    /// timeout or the memory cap fails it, and so does the plugin's refusal of the request
    /// (which [`upload`](Self::upload) lets pass: the version runs, with whatever configuration
    /// it is given later).
    async fn smoke(&self, p: &Plugin, config: &str) -> Result<(), PluginFailure> {
        let limits = self.limits();
        let time = RequestTime::new(limits.request_time);
        // 0.2.0's `init` runs here, with `config`.
        let mut i = p.instantiate(limits, self.tokenizer.clone(), 0, time, config).await?;
        i.capabilities().await?;
        let req = Request {
            input: Input::Chat(vec![Message {
                role: "user".into(),
                content: "Hello! This is Warden's upload check.".into(),
            }]),
            sampling: neutral_sampling(16),
            config: config.into(),
            metadata: vec![("endpoint".into(), "upload-check".into())],
            first_token: None,
        };
        // Both calls run, so a failure of either counts before a refusal.
        let pre = i.preprocess(&req).await.map(|_| ());
        ran(pre.clone())?;
        let end = Finish {
            reason: "stop".into(),
            prompt_tokens: 16,
            completion_tokens: 8,
        };
        let post = i
            .postprocess("Hello from the upload check.", Some(&end))
            .await
            .map(|_| ());
        ran(post.clone())?;
        pre.and(post)
    }

    /// Validates `bytes` (size, compiles within its bounds, implements the world with only the
    /// host's imports, a smoke call under fuel) and stores them as a version of plugin `name`;
    /// with `activate`, requests run it from now on. A new version counts against the tenant's
    /// uploads per minute under `policy`.
    pub async fn upload(
        &self,
        t: &Tenant,
        policy: &crate::policy::Policy,
        name: &str,
        bytes: Vec<u8>,
        activate: bool,
    ) -> Result<Uploaded, PluginError> {
        if !valid_tenant_name(name) {
            return Err(PluginError::BadName(name.into()));
        }
        if bytes.len() > self.cfg.max_component_bytes {
            return Err(PluginError::ComponentTooLarge {
                got: bytes.len(),
                limit: self.cfg.max_component_bytes,
            });
        }
        let existing = self.store.plugins().get(t.id, name)?;
        if existing.is_none() && self.store.plugins().list(t.id)?.len() >= self.cfg.max_per_tenant {
            return Err(PluginError::TooMany {
                tenant: t.name.clone(),
                max: self.cfg.max_per_tenant,
            });
        }
        let (version, sha) = version_of(&bytes);
        let config = existing.as_ref().map(|r| r.config.clone()).unwrap_or_default();
        let known = existing
            .as_ref()
            .is_some_and(|r| r.versions.iter().any(|v| v.sha256 == version.sha256));
        let mut compiled = None;
        if !known {
            // A tenant in debt for its compiles spends none of its uploads.
            self.compiles
                .check(t.id, self.compile_seconds(policy))
                .map_err(|e| refused(t, e, PluginError::Rejected))?;
            self.take_upload(t, policy)?;
            let plugin = self.compile(t, policy, &bytes, PluginError::Rejected).await?;
            // The smoke call holds one of the tenant's instances, as a request would.
            let share = self.take_instances(t, policy, 1)?;
            let smoked = self.smoke(&plugin, &config).await;
            drop(share);
            ran(smoked).map_err(|e| match e {
                PluginFailure::Busy | PluginFailure::OverLimits(_) => PluginError::Failed(e),
                e => PluginError::Rejected(PluginFailure::Invalid(format!("the upload check failed: {e}"))),
            })?;
            self.store.plugins().put_blob(t.id, &sha, &bytes)?;
            self.artefacts.save(t.id, &version.sha256, &plugin);
            self.remember(t.id, &version.sha256, &plugin);
            compiled = Some(plugin);
        }
        let g = self.lock();
        let current = self.store.plugins().get(t.id, name)?;
        // Checked again under the lock: another upload may have added a plugin meanwhile.
        if current.is_none() && self.store.plugins().list(t.id)?.len() >= self.cfg.max_per_tenant {
            return Err(PluginError::TooMany {
                tenant: t.name.clone(),
                max: self.cfg.max_per_tenant,
            });
        }
        let mut rec = current.unwrap_or_else(|| PluginRecord {
            name: name.into(),
            versions: vec![],
            active: None,
            history: vec![],
            config,
        });
        if !rec.versions.iter().any(|v| v.sha256 == version.sha256) {
            rec.versions.push(version.clone());
        }
        if activate {
            set_active(&mut rec, &version.sha256);
        }
        // Beyond the limit, drop the oldest version that is not active.
        while rec.versions.len() > self.cfg.max_versions {
            let Some(i) = rec
                .versions
                .iter()
                .position(|v| rec.active.as_deref() != Some(v.sha256.as_str()))
            else {
                break;
            };
            let old = rec.versions.remove(i);
            rec.history.retain(|h| h.version != old.sha256);
            self.store.plugins().remove_blob(t.id, &old.sha256)?;
            self.forget(t.id, &old.sha256);
            self.snapshots.forget(t.id, name, Some(&old.sha256));
        }
        self.store.plugins().put(t.id, &rec)?;
        drop(g);
        if activate && let Some(plugin) = &compiled {
            self.pre_initialise(t, policy, name, &version.sha256, &rec.config, plugin, Some(bytes), true);
        }
        let default = self.is_default(t, name)?;
        Ok(Uploaded {
            plugin: PluginView::of(&rec, default),
            version: version.sha256,
            new: !known,
        })
    }

    /// The tenant's plugins.
    pub fn list(&self, t: &Tenant) -> Result<PluginList, PluginError> {
        let default = self.store.plugins().default(t.id)?;
        let recs = self.store.plugins().list(t.id)?;
        Ok(PluginList {
            data: recs
                .iter()
                .map(|r| PluginView::of(r, default.as_deref() == Some(r.name.as_str())))
                .collect(),
        })
    }

    /// One plugin.
    pub fn get(&self, t: &Tenant, name: &str) -> Result<PluginView, PluginError> {
        let rec = self.record(t, name)?;
        Ok(PluginView::of(&rec, self.is_default(t, name)?))
    }

    /// Makes `version` (a SHA-256 or an unambiguous prefix of at least 8 digits) the active one.
    pub fn activate(&self, t: &Tenant, name: &str, version: &str) -> Result<PluginView, PluginError> {
        let _g = self.lock();
        let mut rec = self.record(t, name)?;
        let sha = version_id(&rec, version)?;
        set_active(&mut rec, &sha);
        self.store.plugins().put(t.id, &rec)?;
        Ok(PluginView::of(&rec, self.is_default(t, name)?))
    }

    /// Returns to what ran before the last activation or configuration: that version with the
    /// configuration it had.
    pub fn rollback(&self, t: &Tenant, name: &str) -> Result<PluginView, PluginError> {
        let _g = self.lock();
        let mut rec = self.record(t, name)?;
        let Some(prev) = rec.history.pop() else {
            return Err(PluginError::NothingToRollBack(name.into()));
        };
        rec.active = Some(prev.version);
        if let Some(config) = prev.config {
            rec.config = config;
        }
        self.store.plugins().put(t.id, &rec)?;
        Ok(PluginView::of(&rec, self.is_default(t, name)?))
    }

    /// Deletes plugin `name` and all its versions (and clears it as the default).
    pub fn delete(&self, t: &Tenant, name: &str) -> Result<Deleted, PluginError> {
        let _g = self.lock();
        let rec = self.record(t, name)?;
        self.store.plugins().remove(t.id, &rec)?;
        for v in &rec.versions {
            self.forget(t.id, &v.sha256);
        }
        self.snapshots.forget(t.id, name, None);
        Ok(Deleted {
            deleted: name.into(),
            versions: rec.versions.len(),
        })
    }

    /// Deletes one version that is not active.
    pub fn delete_version(&self, t: &Tenant, name: &str, version: &str) -> Result<PluginView, PluginError> {
        let _g = self.lock();
        let mut rec = self.record(t, name)?;
        let sha = version_id(&rec, version)?;
        if rec.active.as_deref() == Some(sha.as_str()) {
            return Err(PluginError::VersionActive {
                name: name.into(),
                version: sha,
            });
        }
        rec.versions.retain(|v| v.sha256 != sha);
        rec.history.retain(|h| h.version != sha);
        self.store.plugins().remove_blob(t.id, &sha)?;
        self.store.plugins().put(t.id, &rec)?;
        self.forget(t.id, &sha);
        self.snapshots.forget(t.id, name, Some(&sha));
        Ok(PluginView::of(&rec, self.is_default(t, name)?))
    }

    /// Sets the configuration `name`'s active version runs with (and versions activated later),
    /// once the active version has run its smoke call with it: a configuration the plugin refuses
    /// there (or that makes it trap, run out of fuel or time) is refused, naming the plugin's
    /// code and message. The one it replaces goes into the history with its version, so rollback
    /// restores both.
    /// The smoke call holds one of the tenant's plugin instances (its policy's share), as a
    /// request would, so config changes cannot take the pool from other tenants.
    pub async fn set_config(
        &self,
        t: &Tenant,
        policy: &crate::policy::Policy,
        name: &str,
        config: &[u8],
    ) -> Result<PluginView, PluginError> {
        if config.len() > self.cfg.max_config_bytes {
            return Err(PluginError::ConfigTooLarge {
                got: config.len(),
                limit: self.cfg.max_config_bytes,
            });
        }
        let config = std::str::from_utf8(config).map_err(PluginError::ConfigNotText)?;
        let rec = self.record(t, name)?;
        let mut checked = None;
        if rec.active.is_some() {
            let _share = self.take_instances(t, policy, 1)?;
            let (version, plugin) = self.active(t, policy, name).await?;
            self.smoke(&plugin, config).await.map_err(|e| match e {
                PluginFailure::Busy | PluginFailure::OverLimits(_) => PluginError::Failed(e),
                e => PluginError::ConfigRejected {
                    version: version.clone(),
                    failure: e,
                },
            })?;
            checked = Some((version, plugin));
        }
        let g = self.lock();
        let mut rec = self.record(t, name)?;
        // The version checked must still be the one that will run with it.
        if rec.active.as_deref() != checked.as_ref().map(|(v, _)| v.as_str()) {
            return Err(PluginError::Changed(name.into()));
        }
        if rec.config != config {
            if let Some(active) = rec.active.clone() {
                let old = std::mem::replace(&mut rec.config, config.into());
                remember(&mut rec, active, old);
            }
            rec.config = config.into();
        }
        self.store.plugins().put(t.id, &rec)?;
        drop(g);
        if let Some((version, plugin)) = &checked {
            self.pre_initialise(t, policy, name, version, config, plugin, None, false);
        }
        Ok(PluginView::of(&rec, self.is_default(t, name)?))
    }

    /// Drops what is kept of tenant `id`'s plugins outside the store: compiled and
    /// pre-initialised components, in memory and on disk, builds waiting, its compile budget
    /// and its plugin log files (the tenant was deleted).
    pub fn forget_tenant(&self, id: TenantId) {
        self.compiled().forget(id);
        self.snapshots.forget_tenant(id);
        self.artefacts.remove_tenant(id);
        self.compiles.forget(id);
        self.logs.forget(id);
    }

    /// Makes `name` the tenant's default plugin: requests that name none run it.
    pub fn set_default(&self, t: &Tenant, name: &str) -> Result<DefaultPlugin, PluginError> {
        let _g = self.lock();
        self.record(t, name)?;
        self.store.plugins().set_default(t.id, Some(name))?;
        Ok(DefaultPlugin {
            default: Some(name.into()),
        })
    }

    /// Stops `name` being the tenant's default plugin (if it is).
    pub fn clear_default(&self, t: &Tenant, name: &str) -> Result<DefaultPlugin, PluginError> {
        let _g = self.lock();
        self.record(t, name)?;
        if self.is_default(t, name)? {
            self.store.plugins().set_default(t.id, None)?;
        }
        Ok(DefaultPlugin {
            default: self.store.plugins().default(t.id)?,
        })
    }

    /// The plugin a request of `t` runs: the one it names, else the tenant's default, else none.
    pub fn chosen(&self, t: &Tenant, requested: Option<&str>) -> Result<Option<String>, PluginError> {
        match requested {
            Some(n) => Ok(Some(n.to_string())),
            None => Ok(self.store.plugins().default(t.id)?),
        }
    }

    /// Plugin `name` of `t`, compiled and ready to instantiate: pre-initialised with its
    /// configuration when that is ready, else as compiled (and a build of the snapshot is
    /// started, as `policy` allows).
    pub async fn resolve(
        &self,
        t: &Tenant,
        policy: &crate::policy::Policy,
        name: String,
    ) -> Result<Resolved, PluginError> {
        let rec = self.record(t, &name)?;
        let Some(version) = rec.active.clone() else {
            return Err(PluginError::Inactive(name));
        };
        let mut plugin = self.version(t, policy, &name, &version).await?;
        match self
            .snapshots
            .get(t.id, &name, &version, &rec.config, &self.limits_for(policy))
        {
            Some(p) => plugin = p,
            None => self.pre_initialise(t, policy, &name, &version, &rec.config, &plugin, None, false),
        }
        Ok(Resolved {
            name,
            version,
            config: rec.config,
            plugin,
            tenant: t.id,
            inits: self.inits.clone(),
        })
    }

    /// Plugin `name`'s active version and its compile (not pre-initialised).
    async fn active(
        &self,
        t: &Tenant,
        policy: &crate::policy::Policy,
        name: &str,
    ) -> Result<(String, Plugin), PluginError> {
        let rec = self.record(t, name)?;
        let Some(version) = rec.active else {
            return Err(PluginError::Inactive(name.into()));
        };
        let plugin = self.version(t, policy, name, &version).await?;
        Ok((version, plugin))
    }

    /// The compile of `t`'s `version` of plugin `name`: from memory, else from disk, else
    /// compiled again (as `policy` allows).
    async fn version(
        &self,
        t: &Tenant,
        policy: &crate::policy::Policy,
        name: &str,
        version: &str,
    ) -> Result<Plugin, PluginError> {
        if let Some(p) = self.cached(t.id, version) {
            return Ok(p);
        }
        let plugin = match self.artefacts.load(self.compiles.compiler().runtime(), t.id, version) {
            Some(p) => p,
            None => {
                let bytes = self
                    .store
                    .plugins()
                    .blob(t.id, version)?
                    .ok_or_else(|| StoreError::Corrupt(format!("plugin {name} {version}")))?;
                let p = self.compile(t, policy, &bytes, PluginError::Failed).await?;
                self.artefacts.save(t.id, version, &p);
                p
            }
        };
        self.remember(t.id, version, &plugin);
        Ok(plugin)
    }
}

/// What a refused compile of tenant `t`'s is to its caller: over its budget, or failed as
/// `failed` says.
fn refused(t: &Tenant, e: CompileRefused, failed: fn(PluginFailure) -> PluginError) -> PluginError {
    match e {
        CompileRefused::Budget {
            seconds_per_minute,
            retry_after,
        } => PluginError::CompileBudget {
            tenant: t.name.clone(),
            seconds_per_minute,
            retry_after: retry_after.as_secs().max(1),
        },
        CompileRefused::Failed(f) => failed(f),
    }
}

/// What each instance may use under `cfg`.
pub fn limits_of(cfg: &PluginsConfig) -> PluginLimits {
    PluginLimits {
        fuel_per_call: cfg.fuel_per_call,
        memory_bytes: cfg.memory_mib << 20,
        call_timeout: Duration::from_millis(cfg.call_timeout_ms),
        request_time: Duration::from_millis(cfg.request_time_ms),
        init_fuel: cfg.init_fuel,
        init_timeout: Duration::from_millis(cfg.init_timeout_ms),
    }
}

/// A call that ran: it returned, or the plugin refused on purpose.
fn ran<T>(r: Result<T, PluginFailure>) -> Result<(), PluginFailure> {
    match r {
        Ok(_) | Err(PluginFailure::Refused { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

fn set_active(rec: &mut PluginRecord, sha: &str) {
    if rec.active.as_deref() == Some(sha) {
        return;
    }
    if let Some(old) = rec.active.replace(sha.into()) {
        let config = rec.config.clone();
        remember(rec, old, config);
    }
}

/// Keeps `version` with the `config` it ran with as the latest deployment rollback returns to.
fn remember(rec: &mut PluginRecord, version: String, config: String) {
    rec.history.push(Deployment {
        version,
        config: Some(config),
    });
    if rec.history.len() > HISTORY {
        rec.history.remove(0);
    }
}

/// The full id of `rec`'s version `v` (an id or an unambiguous prefix).
fn version_id(rec: &PluginRecord, v: &str) -> Result<String, PluginError> {
    rec.find(v)
        .map(|x| x.sha256.clone())
        .ok_or_else(|| PluginError::VersionNotFound {
            name: rec.name.clone(),
            version: v.into(),
        })
}
