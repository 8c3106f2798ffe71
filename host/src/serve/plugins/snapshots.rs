//! Pre-initialised plugins in the server: for each tenant's plugin, its active version with its
//! configuration, `init` run once ([`crate::plugin::snapshot`]), so requests start from `init`'s
//! state instead of running it.
//!
//! A snapshot is built in the background, never on a request's path: until it is ready, and
//! for a plugin that cannot be pre-initialised, requests run `init` themselves, as before.
//!
//! What a build costs, and who pays:
//! - one build runs at a time in the whole server, on the blocking pool (capturing and rewriting
//!   up to an instance's memory is CPU and memory the request threads never wait on); tenants
//!   take turns, each with at most one job waiting per plugin (the latest asked for replaces an
//!   earlier one);
//! - `init` runs under the tenant's limits in one of the tenant's own instances (waiting for one
//!   while its requests hold them all), never one another tenant needs;
//! - its two compiles take the tenant's turns at the server's compiler and are charged to its
//!   compile budget, as its uploads' are ([`Compiles`]); a tenant in debt gets no build;
//! - each build queued counts as one of the tenant's uploads (the caller charges it).
//!
//! One snapshot per plugin is kept, in memory (at most [`KEPT`] plugins' at once; the rest are
//! read back from disk) and on disk ([`Artefacts::save_snapshot`]), made for the served model's
//! vocabulary and the tenant's memory limit; the outcome of a build, and why a plugin cannot be
//! pre-initialised, go to the tenant's plugin log. Deleting a plugin or its tenant drops its
//! snapshot, and a build that was under way then is thrown away.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

use super::artefacts::Artefacts;
use super::compiles::{CompileRefused, Compiles};
use super::logs::{Source, TenantLogs};
use super::shares::Shares;
use crate::fair::{FairCache, Turns};
use crate::plugin::snapshot::{Snapshot, pre_initialise};
use crate::plugin::{Plugin, PluginFailure, PluginLimits};
use crate::serve::store::Store;
use crate::tenant::TenantId;
use crate::tokenizer::Tokenizer;

/// How long a build waits for one of its tenant's instances: `SHARE_TRIES` times `SHARE_WAIT`.
const SHARE_TRIES: usize = 100;
const SHARE_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Plugins whose snapshot (or the knowledge that there is none) is kept in memory; past it, the
/// tenant keeping the most gives up its least recently used.
pub const KEPT: usize = 256;

/// A plugin: its tenant and name.
type PluginKey = (TenantId, String);

/// What a snapshot is made of: version, configuration, and the memory limit `init` ran under
/// (a snapshot starts with the memory `init` grew to, so it suits that limit or a larger one).
#[derive(Clone, PartialEq, Eq)]
struct Made {
    version: String,
    config: String,
    memory_bytes: usize,
}

/// What is known of one plugin's snapshot.
#[derive(Clone)]
struct Entry {
    made: Made,
    /// The pre-initialised component, or none when it cannot be made.
    plugin: Option<Plugin>,
}

/// Where a build finds the component.
pub enum Component {
    /// Its bytes, in hand.
    Bytes(Vec<u8>),
    /// In the store, read when the build runs (not while it waits, nor for a build not
    /// queued).
    Stored(Store),
}

/// One build: plugin `name` of `tenant` at `version` (its `component`) with `config`.
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
    pub component: Component,
    /// What `init` may use: the tenant's.
    pub limits: PluginLimits,
    /// The tenant's share of plugin instances (`init` runs in one of them).
    pub share: usize,
    /// The tenant's compile budget, seconds per minute.
    pub compile_seconds: u64,
}

impl Job {
    fn made(&self) -> Made {
        Made {
            version: self.version.clone(),
            config: self.config.clone(),
            memory_bytes: self.limits.memory_bytes,
        }
    }
}

/// A build and the generation of its plugin when it was asked for.
struct Queued {
    job: Job,
    generation: u64,
}

/// A tenant's builds: the plugin whose build is under way, and the next for each plugin.
struct Queue {
    running: (String, Made),
    next: VecDeque<Queued>,
}

/// How many times each plugin, and each tenant, was deleted.
#[derive(Default)]
struct Generations {
    plugins: HashMap<PluginKey, u64>,
    tenants: HashMap<TenantId, u64>,
}

/// The server's pre-initialised plugins.
pub struct Snapshots {
    shares: Shares,
    compiles: Arc<Compiles>,
    artefacts: Arc<Artefacts>,
    logs: Arc<TenantLogs>,
    tokenizer: Arc<Tokenizer>,
    /// The vocabulary's SHA-256 (hex): what a snapshot's state may have been computed from.
    vocabulary: OnceLock<String>,
    /// The largest component a snapshot may be (the upload limit).
    max_bytes: usize,
    /// What is known of each plugin's snapshot, by tenant and name.
    entries: Mutex<FairCache<String, Entry>>,
    /// Bumped when a plugin (or its tenant) is deleted, so a build under way for it then is
    /// thrown away.
    generations: Mutex<Generations>,
    /// Tenants with a build under way or waiting.
    building: Mutex<HashMap<TenantId, Queue>>,
    /// One build at a time, server-wide, the tenants taking turns.
    turns: Turns,
}

/// Removes a tenant's queue when its builder ends, however it ends.
struct Finished<'a>(&'a Snapshots, TenantId);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.building().remove(&self.1);
    }
}

impl Snapshots {
    /// Snapshots built in the tenants' `shares` of instances, compiled through `compiles`, kept
    /// in `artefacts`, reported in `logs`.
    pub fn new(
        shares: Shares,
        compiles: Arc<Compiles>,
        artefacts: Arc<Artefacts>,
        logs: Arc<TenantLogs>,
        tokenizer: Arc<Tokenizer>,
        max_bytes: usize,
    ) -> Self {
        Self {
            shares,
            compiles,
            artefacts,
            logs,
            tokenizer,
            vocabulary: OnceLock::new(),
            max_bytes,
            entries: Mutex::new(FairCache::new(KEPT)),
            generations: Mutex::new(Generations::default()),
            building: Mutex::new(HashMap::new()),
            turns: Turns::new(1, 1),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, FairCache<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn building(&self) -> std::sync::MutexGuard<'_, HashMap<TenantId, Queue>> {
        self.building.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn generations(&self) -> std::sync::MutexGuard<'_, Generations> {
        self.generations.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes whenever the plugin or its tenant is deleted (both only grow).
    fn generation(&self, key: &PluginKey) -> u64 {
        let g = self.generations();
        g.plugins.get(key).copied().unwrap_or(0) + g.tenants.get(&key.0).copied().unwrap_or(0)
    }

    /// The served vocabulary's digest, worked out once.
    fn vocabulary(&self) -> &str {
        self.vocabulary.get_or_init(|| {
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            for id in 0..self.tokenizer.vocab_size() as u32 {
                let b = self.tokenizer.token_bytes(id);
                h.update((b.len() as u64).to_le_bytes());
                h.update(&b);
            }
            h.finalize().iter().map(|b| format!("{b:02x}")).collect()
        })
    }

    /// What the disk cache names a snapshot by, beside the plugin's name and version.
    fn disk_key(&self, made: &Made) -> String {
        format!("{}\n{}\n{}", self.vocabulary(), made.memory_bytes, made.config)
    }

    /// Keeps `entry` for plugin `key`: at most [`KEPT`] in all, the tenant holding the most
    /// giving up its least recently used (the rest stay on disk).
    fn insert(&self, entries: &mut FairCache<String, Entry>, key: PluginKey, entry: Entry) {
        entries.insert(key.0, key.1, entry, 1);
    }

    /// Plugin `name` of `tenant` at `version` pre-initialised with `config` under `limits`, if
    /// it is ready (in memory, or on disk from an earlier run).
    pub fn get(
        &self,
        tenant: TenantId,
        name: &str,
        version: &str,
        config: &str,
        limits: &PluginLimits,
    ) -> Option<Plugin> {
        let made = Made {
            version: version.into(),
            config: config.into(),
            memory_bytes: limits.memory_bytes,
        };
        let key = (tenant, name.to_string());
        if let Some(e) = self.entries().get(tenant, &key.1)
            && e.made == made
        {
            return e.plugin;
        }
        let plugin = self
            .artefacts
            .load_snapshot(
                self.compiles.compiler().runtime(),
                tenant,
                name,
                version,
                &self.disk_key(&made),
            )?
            .into_pre_initialised(config);
        let entry = Entry {
            made,
            plugin: Some(plugin.clone()),
        };
        self.insert(&mut self.entries(), key, entry);
        Some(plugin)
    }

    /// Whether a build for plugin `name` at `version` with `config` under `limits` would be
    /// queued now: nothing is known of it, and it is neither under way nor waiting (a cheap look
    /// before reading the component; [`start`](Self::start) checks again).
    pub fn wanted(&self, tenant: TenantId, name: &str, version: &str, config: &str, limits: &PluginLimits) -> bool {
        let made = Made {
            version: version.into(),
            config: config.into(),
            memory_bytes: limits.memory_bytes,
        };
        !self.known_or_queued(&self.building(), tenant, name, &made)
    }

    /// Whether plugin `name`'s snapshot `made` is known (ready, or known not to work), under
    /// way, or waiting. Takes the `building` lock's guard: that lock is always taken before
    /// the entries'.
    fn known_or_queued(&self, building: &HashMap<TenantId, Queue>, tenant: TenantId, name: &str, made: &Made) -> bool {
        if self
            .entries()
            .get(tenant, &name.to_string())
            .is_some_and(|e| e.made == *made)
        {
            return true;
        }
        building.get(&tenant).is_some_and(|q| {
            (q.running.0 == name && q.running.1 == *made)
                || q.next.iter().any(|n| n.job.name == name && n.job.made() == *made)
        })
    }

    /// Queues `job` unless its snapshot is known (ready, or known not to work) or already under
    /// way or waiting, and once `charge` (the tenant's upload budget) allows it; starts the
    /// tenant's builder if it has none. Returns whether it was queued.
    pub fn start(self: &Arc<Self>, job: Job, charge: impl FnOnce() -> bool) -> bool {
        let key = (job.tenant, job.name.clone());
        let made = job.made();
        let tenant = job.tenant;
        let mut building = self.building();
        if self.known_or_queued(&building, tenant, &job.name, &made) {
            return false;
        }
        if !charge() {
            return false;
        }
        let queued = Queued {
            generation: self.generation(&key),
            job,
        };
        if let Some(q) = building.get_mut(&tenant) {
            // At most one waiting per plugin: the latest.
            q.next.retain(|n| n.job.name != queued.job.name);
            q.next.push_back(queued);
            return true;
        }
        building.insert(
            tenant,
            Queue {
                running: (queued.job.name.clone(), made),
                next: VecDeque::new(),
            },
        );
        drop(building);
        let this = self.clone();
        let runtime = tokio::runtime::Handle::current();
        // On the blocking pool: capturing and rewriting an instance's memory is seconds of CPU
        // at worst, which must not hold a thread that serves requests.
        tokio::task::spawn_blocking(move || runtime.block_on(this.builder(tenant, queued)));
        true
    }

    /// Runs tenant `tenant`'s builds, `first` and then each that waits, one at a time.
    async fn builder(&self, tenant: TenantId, first: Queued) {
        let _done = Finished(self, tenant);
        let mut next = Some(first);
        while let Some(q) = next.take() {
            {
                let _turn = self.turns.take(tenant).await;
                self.build(&q).await;
            }
            let mut building = self.building();
            if let Some(queue) = building.get_mut(&tenant)
                && let Some(n) = queue.next.pop_front()
            {
                queue.running = (n.job.name.clone(), n.job.made());
                next = Some(n);
            }
        }
    }

    async fn build(&self, q: &Queued) {
        let job = &q.job;
        let key = (job.tenant, job.name.clone());
        if q.generation != self.generation(&key) {
            return;
        }
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
        let bytes = match &job.component {
            Component::Bytes(b) => b.clone(),
            Component::Stored(store) => match store.plugins().blob(job.tenant, &job.version) {
                Ok(Some(b)) => b.to_vec(),
                // Deleted meanwhile: nothing to build.
                Ok(None) | Err(_) => return,
            },
        };
        let compile = |b: Vec<u8>| {
            let compiles = self.compiles.clone();
            let (tenant, seconds) = (job.tenant, job.compile_seconds);
            async move {
                compiles.compile(tenant, seconds, &b).await.map_err(|e| match e {
                    CompileRefused::Budget { retry_after, .. } => PluginFailure::CompileBudget(retry_after),
                    CompileRefused::Failed(f) => f,
                })
            }
        };
        let r = pre_initialise(
            &bytes,
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
                let line = "info: pre-initialised with the current configuration: requests start from init's state";
                (Some(p), [logs, vec![line.to_string()]].concat())
            }
            Ok((Snapshot::Kept(why), logs)) => {
                let line = format!("info: init runs on every request: {why}");
                (None, [logs, vec![line]].concat())
            }
            // Worth another try later (a full pool, a loaded machine): nothing is recorded,
            // so a later request asks again.
            Err(
                e @ (PluginFailure::Busy
                | PluginFailure::Timeout(_)
                | PluginFailure::RequestTime(_)
                | PluginFailure::CompileTimeout(_)
                | PluginFailure::CompileBudget(_)
                | PluginFailure::CompileMemory(_)),
            ) => {
                let line = format!("warn: pre-initialising failed for now ({}): {e}", e.code());
                self.log(job, vec![line]);
                return;
            }
            Err(e) => (
                None,
                vec![format!(
                    "warn: pre-initialising failed ({}): {e}; init runs on every request",
                    e.code()
                )],
            ),
        };
        lines.truncate(64);
        {
            let mut entries = self.entries();
            // Deleted meanwhile: the plugin's snapshot must not come back.
            if q.generation != self.generation(&key) {
                return;
            }
            if let Some(p) = &plugin {
                let disk = self.disk_key(&job.made());
                self.artefacts
                    .save_snapshot(job.tenant, &job.name, &job.version, &disk, p);
            }
            let entry = Entry {
                made: job.made(),
                plugin,
            };
            self.insert(&mut entries, key, entry);
        }
        self.log(job, lines);
    }

    fn log(&self, job: &Job, lines: Vec<String>) {
        let src = Source {
            tenant: job.tenant,
            plugin: &job.name,
            version: &job.version,
            request: "init",
        };
        self.logs.write(&src, lines);
    }

    /// Drops plugin `name`'s snapshot and any build waiting for it (the plugin was deleted), or
    /// only if it is of `version` (that version was).
    pub fn forget(&self, tenant: TenantId, name: &str, version: Option<&str>) {
        let key = (tenant, name.to_string());
        let mut entries = self.entries();
        if let Some(v) = version {
            if entries.get(tenant, &key.1).is_some_and(|e| e.made.version == v) {
                entries.remove(tenant, &key.1);
                self.artefacts.remove_snapshots(tenant, name);
            }
            return;
        }
        *self.generations().plugins.entry(key.clone()).or_insert(0) += 1;
        entries.remove(tenant, &key.1);
        self.artefacts.remove_snapshots(tenant, name);
        drop(entries);
        if let Some(q) = self.building().get_mut(&tenant) {
            q.next.retain(|n| n.job.name != name);
        }
    }

    /// Drops every snapshot of `tenant`'s plugins and the builds waiting for them (the tenant
    /// was deleted).
    pub fn forget_tenant(&self, tenant: TenantId) {
        let mut entries = self.entries();
        *self.generations().tenants.entry(tenant).or_insert(0) += 1;
        entries.forget(tenant);
        drop(entries);
        if let Some(q) = self.building().get_mut(&tenant) {
            q.next.clear();
        }
    }
}
