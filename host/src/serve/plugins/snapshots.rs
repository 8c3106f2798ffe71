//! Pre-initialised plugins in the server: for each tenant's plugin, its active version with its
//! configuration, `init` run once ([`crate::plugin::snapshot`]), so requests start from `init`'s
//! state instead of running it.
//!
//! A snapshot is built in the background, never on a request's path: until it is ready, and
//! for a plugin that cannot be pre-initialised, requests run `init` themselves, as before. A
//! tenant builds one snapshot at a time, and at most one more waits (the latest asked for
//! replaces an earlier one waiting); each build is charged to the tenant: its `init` runs under
//! the tenant's limits in one of the tenant's own plugin instances (waiting for one while its
//! requests hold them all), its two compiles go through the server's bounded compiler, and the
//! caller counts it as one of the tenant's uploads. One snapshot per plugin is kept, in memory and on disk
//! ([`Artefacts::save_snapshot`]); the outcome of a build, and why a plugin cannot be
//! pre-initialised, go to the tenant's plugin log.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::artefacts::Artefacts;
use super::logs::{Source, TenantLogs};
use super::shares::Shares;
use crate::plugin::compile::Compiler;
use crate::plugin::snapshot::{Snapshot, pre_initialise};
use crate::plugin::{Plugin, PluginLimits};
use crate::tenant::TenantId;
use crate::tokenizer::Tokenizer;

/// How long a build waits for one of its tenant's instances: `SHARE_TRIES` times `SHARE_WAIT`.
const SHARE_TRIES: usize = 600;
const SHARE_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// What is known of one plugin's (version, configuration).
struct Entry {
    version: String,
    config: String,
    /// The pre-initialised component, or none when it cannot be made.
    plugin: Option<Plugin>,
}

/// One build: plugin `name` of `tenant` at `version` (its component `bytes`) with `config`.
pub struct Job {
    /// The tenant.
    pub tenant: TenantId,
    /// The plugin's name.
    pub name: String,
    /// The version (SHA-256).
    pub version: String,
    /// The configuration `init` gets.
    pub config: String,
    /// The component.
    pub bytes: Vec<u8>,
    /// What `init` may use: the tenant's.
    pub limits: PluginLimits,
    /// The tenant's share of plugin instances (`init` runs in one of them).
    pub share: usize,
}

/// Which snapshot a build makes: plugin, version, configuration.
type Key = (String, String, String);

impl Job {
    fn key(&self) -> Key {
        (self.name.clone(), self.version.clone(), self.config.clone())
    }
}

/// A tenant's builds: the one under way, and the next.
struct Queue {
    running: Key,
    next: Option<Job>,
}

/// The server's pre-initialised plugins.
pub struct Snapshots {
    shares: Shares,
    compiler: Arc<Compiler>,
    artefacts: Arc<Artefacts>,
    logs: Arc<TenantLogs>,
    tokenizer: Arc<Tokenizer>,
    /// The largest component a snapshot may be (the upload limit).
    max_bytes: usize,
    entries: Mutex<HashMap<(TenantId, String), Entry>>,
    /// Tenants with a build under way.
    building: Mutex<HashMap<TenantId, Queue>>,
}

impl Snapshots {
    /// Snapshots built in the tenants' `shares` of instances, compiled with `compiler`, kept in
    /// `artefacts`, reported in `logs`.
    pub fn new(
        shares: Shares,
        compiler: Arc<Compiler>,
        artefacts: Arc<Artefacts>,
        logs: Arc<TenantLogs>,
        tokenizer: Arc<Tokenizer>,
        max_bytes: usize,
    ) -> Self {
        Self {
            shares,
            compiler,
            artefacts,
            logs,
            tokenizer,
            max_bytes,
            entries: Mutex::new(HashMap::new()),
            building: Mutex::new(HashMap::new()),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<(TenantId, String), Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Plugin `name` of `tenant` at `version` pre-initialised with `config`, if it is ready (in
    /// memory, or on disk from an earlier run).
    pub fn get(&self, tenant: TenantId, name: &str, version: &str, config: &str) -> Option<Plugin> {
        if let Some(e) = self.entries().get(&(tenant, name.to_string()))
            && e.version == version
            && e.config == config
        {
            return e.plugin.clone();
        }
        let plugin = self
            .artefacts
            .load_snapshot(self.compiler.runtime(), tenant, name, version, config)?
            .into_pre_initialised(config);
        self.entries().insert(
            (tenant, name.to_string()),
            Entry {
                version: version.into(),
                config: config.into(),
                plugin: Some(plugin.clone()),
            },
        );
        Some(plugin)
    }

    fn building(&self) -> std::sync::MutexGuard<'_, HashMap<TenantId, Queue>> {
        self.building.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a build for (`version`, `config`) of plugin `name` is worth starting: nothing is
    /// known of it (ready, or known not to work), and it is neither under way nor waiting.
    pub fn wanted(&self, tenant: TenantId, name: &str, version: &str, config: &str) -> bool {
        let known = self
            .entries()
            .get(&(tenant, name.to_string()))
            .is_some_and(|e| e.version == version && e.config == config);
        let key = (name.to_string(), version.to_string(), config.to_string());
        let queued = self
            .building()
            .get(&tenant)
            .is_some_and(|q| q.running == key || q.next.as_ref().is_some_and(|j| j.key() == key));
        !known && !queued
    }

    /// Starts `job` in the background, or, while its tenant has a build under way, makes it
    /// the one that runs next.
    pub fn start(self: &Arc<Self>, job: Job) {
        let tenant = job.tenant;
        {
            let mut building = self.building();
            if let Some(q) = building.get_mut(&tenant) {
                q.next = Some(job);
                return;
            }
            building.insert(
                tenant,
                Queue {
                    running: job.key(),
                    next: None,
                },
            );
        }
        let this = self.clone();
        tokio::spawn(async move {
            let mut job = job;
            loop {
                this.build(&job).await;
                let mut building = this.building();
                let Some(q) = building.get_mut(&tenant) else { break };
                match q.next.take() {
                    Some(next) => {
                        q.running = next.key();
                        job = next;
                    }
                    None => {
                        building.remove(&tenant);
                        break;
                    }
                }
            }
        });
    }

    async fn build(&self, job: &Job) {
        // `init` runs in one of the tenant's instances, as a request's would: never one another
        // tenant needs. Its requests give theirs back as they end; if they do not for this long,
        // the build is dropped (a later request asks again).
        let slot = async {
            for _ in 0..SHARE_TRIES {
                match self.shares.take(job.tenant, job.share, 1) {
                    Ok(s) => return Some(s),
                    Err(_) => tokio::time::sleep(SHARE_WAIT).await,
                }
            }
            None
        };
        let compile = |b: Vec<u8>| {
            let compiler = self.compiler.clone();
            async move { compiler.compile(&b).await }
        };
        let r = pre_initialise(
            &job.bytes,
            &job.config,
            job.limits,
            self.tokenizer.clone(),
            self.max_bytes,
            compile,
            slot,
        )
        .await;
        let (plugin, mut lines) = match r {
            Ok((Snapshot::Taken(p), logs)) => {
                self.artefacts
                    .save_snapshot(job.tenant, &job.name, &job.version, &job.config, &p);
                let line = "info: pre-initialised with the current configuration: requests start from init's state"
                    .to_string();
                (Some(p), [logs, vec![line]].concat())
            }
            Ok((Snapshot::Kept(why), logs)) => {
                let line = format!("info: init runs on every request: {why}");
                (None, [logs, vec![line]].concat())
            }
            // A full pool is worth another try later; anything else would fail the same way.
            Err(crate::plugin::PluginFailure::Busy) => return,
            Err(e) => (
                None,
                vec![format!(
                    "warn: pre-initialising failed ({}): {e}; init runs on every request",
                    e.code()
                )],
            ),
        };
        lines.truncate(64);
        self.entries().insert(
            (job.tenant, job.name.clone()),
            Entry {
                version: job.version.clone(),
                config: job.config.clone(),
                plugin,
            },
        );
        let src = Source {
            tenant: job.tenant,
            plugin: &job.name,
            version: &job.version,
            request: "init",
        };
        self.logs.write(&src, lines);
    }

    /// Drops plugin `name`'s snapshot (the plugin was deleted), or only if it is of `version`.
    pub fn forget(&self, tenant: TenantId, name: &str, version: Option<&str>) {
        let mut entries = self.entries();
        let key = (tenant, name.to_string());
        if version.is_none_or(|v| entries.get(&key).is_some_and(|e| e.version == v)) {
            entries.remove(&key);
            self.artefacts.remove_snapshots(tenant, name);
        }
    }
}
