//! The host side of a plugin instance: its WASI context (with nothing behind it), its memory
//! limiter, and the world's imports (`kv`, `tokenizer`, `log`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand010::SeedableRng;
use wasmtime::component::{Resource, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::PluginLimits;
use super::bindings::warden::plugin::{kv, log, tokenizer, types};
use crate::kv::PageInfo;
use crate::tokenizer::Tokenizer;
use warden_kernels::attention::PageEntry;

/// Most log lines one instance may write; further lines are dropped.
const MAX_LOG_LINES: usize = 64;
/// Longest log line kept, bytes.
const MAX_LOG_LINE: usize = 1024;

/// A KV page handle, minted by the host for the request's own sequence: the page and the epoch
/// it had then. Every call re-checks both against the page's tag.
pub struct KvPage {
    entry: PageEntry,
}

/// The request's sequence handle.
pub struct Sequence;

/// Most resource handles one instance may hold at once (each `pages` call mints one per page).
const MAX_HANDLES: usize = 4096;

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// How an instance reaches its own request's KV. The server implements it over the engine
/// thread, which answers with the pool's tag checks; the instance never sees an address.
pub trait KvAccess: Send + Sync + 'static {
    /// Whether the request has been admitted (so it has a sequence to show).
    fn started(&self) -> bool;
    /// The request's page table, if it is open.
    fn pages(&self) -> BoxFuture<Option<Vec<PageEntry>>>;
    /// What the request's tenant may learn of `entry`, after the tag check.
    fn info(&self, entry: PageEntry) -> BoxFuture<Result<PageInfo, String>>;
    /// Pins the request's first `tokens` tokens in its tenant's prefix cache; the tokens pinned.
    fn pin(&self, tokens: usize) -> BoxFuture<Result<usize, String>>;
    /// Unpins the pinned prefixes within the request's cached prefix; the pages unpinned.
    fn unpin(&self) -> BoxFuture<Result<usize, String>>;
}

/// Caps memory growth, remembering that it did so the failure can be named.
struct Limiter {
    memory_bytes: usize,
    hit: bool,
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// A clock that never moves: the guest can neither read the time nor time anything.
struct Frozen;

impl wasmtime_wasi::HostWallClock for Frozen {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for Frozen {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// The state a plugin's store holds.
pub struct PluginHost {
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: Limiter,
    tokenizer: Arc<Tokenizer>,
    logs: Vec<String>,
    /// Lines logged over the instance's life (the cap counts these).
    logged: usize,
    /// When the call in progress must end.
    deadline: Instant,
    /// The request's KV, once the serving path attaches it.
    kv: Option<Arc<dyn KvAccess>>,
    /// Live resource handles.
    handles: usize,
}

impl PluginHost {
    pub(super) fn new(limits: PluginLimits, tokenizer: Arc<Tokenizer>, seed: u64) -> Self {
        let wasi = WasiCtxBuilder::new()
            .secure_random(rand010::rngs::StdRng::seed_from_u64(seed))
            .insecure_random(rand010::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15))
            .insecure_random_seed(u128::from(seed))
            .wall_clock(Frozen)
            .monotonic_clock(Frozen)
            .build();
        Self {
            wasi,
            table: ResourceTable::new(),
            limiter: Limiter {
                memory_bytes: limits.memory_bytes,
                hit: false,
            },
            tokenizer,
            logs: Vec::new(),
            logged: 0,
            deadline: Instant::now(),
            kv: None,
            handles: 0,
        }
    }

    pub(super) fn attach_kv(&mut self, kv: Arc<dyn KvAccess>) {
        self.kv = Some(kv);
    }

    fn mint<T: Send + 'static>(&mut self, v: T) -> Result<Resource<T>, String> {
        if self.handles >= MAX_HANDLES {
            return Err(format!("more than {MAX_HANDLES} live handles; drop some first"));
        }
        let r = self.table.push(v).map_err(|e| e.to_string())?;
        self.handles += 1;
        Ok(r)
    }

    /// Time left in the call in progress.
    fn budget(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    pub(super) fn deadline(&self) -> Instant {
        self.deadline
    }

    pub(super) fn set_deadline(&mut self, at: Instant) {
        self.deadline = at;
    }

    pub(super) fn limiter(&mut self) -> &mut dyn wasmtime::ResourceLimiter {
        &mut self.limiter
    }

    pub(super) fn hit_memory_limit(&self) -> bool {
        self.limiter.hit
    }

    pub(super) fn take_logs(&mut self) -> Vec<String> {
        std::mem::take(&mut self.logs)
    }
}

impl WasiView for PluginHost {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for PluginHost {}

impl kv::Host for PluginHost {
    fn current(&mut self) -> Option<Resource<Sequence>> {
        // Before admission (during preprocess) there is no sequence to show.
        if !self.kv.as_ref().is_some_and(|k| k.started()) {
            return None;
        }
        self.mint(Sequence).ok()
    }
}

fn no_such_handle() -> String {
    "no such handle".into()
}

fn timed_out() -> String {
    "the engine did not answer within the call's time limit".into()
}

impl kv::HostKvPage for PluginHost {
    async fn info(&mut self, page: Resource<KvPage>) -> Result<kv::PageInfo, String> {
        // Only handles this store minted resolve; wasmtime refuses a forged or stale index
        // before this runs.
        let entry = self.table.get(&page).map_err(|_| no_such_handle())?.entry;
        let kv = self.kv.clone().ok_or_else(no_such_handle)?;
        let info = tokio::time::timeout(self.budget(), kv.info(entry))
            .await
            .map_err(|_| timed_out())??;
        Ok(kv::PageInfo {
            written: info.written,
            epoch: info.epoch,
            checksum: info.checksum,
        })
    }

    fn drop(&mut self, page: Resource<KvPage>) -> wasmtime::Result<()> {
        self.table.delete(page)?;
        self.handles = self.handles.saturating_sub(1);
        Ok(())
    }
}

impl kv::HostSequence for PluginHost {
    async fn pages(&mut self, seq: Resource<Sequence>) -> Result<Vec<Resource<KvPage>>, String> {
        self.table.get(&seq).map_err(|_| no_such_handle())?;
        let kv = self.kv.clone().ok_or_else(no_such_handle)?;
        let entries = tokio::time::timeout(self.budget(), kv.pages())
            .await
            .map_err(|_| timed_out())?
            .ok_or_else(|| "the sequence holds no KV pages now (it has ended)".to_string())?;
        let mut out = Vec::with_capacity(entries.len());
        for entry in entries {
            out.push(self.mint(KvPage { entry })?);
        }
        Ok(out)
    }

    async fn pin_prefix(&mut self, seq: Resource<Sequence>, tokens: u32) -> Result<u32, String> {
        self.table.get(&seq).map_err(|_| no_such_handle())?;
        let kv = self.kv.clone().ok_or_else(no_such_handle)?;
        let pinned = tokio::time::timeout(self.budget(), kv.pin(tokens as usize))
            .await
            .map_err(|_| timed_out())??;
        Ok(u32::try_from(pinned).unwrap_or(u32::MAX))
    }

    async fn unpin_prefix(&mut self, seq: Resource<Sequence>) -> Result<u32, String> {
        self.table.get(&seq).map_err(|_| no_such_handle())?;
        let kv = self.kv.clone().ok_or_else(no_such_handle)?;
        let pages = tokio::time::timeout(self.budget(), kv.unpin())
            .await
            .map_err(|_| timed_out())??;
        Ok(u32::try_from(pages).unwrap_or(u32::MAX))
    }

    fn drop(&mut self, seq: Resource<Sequence>) -> wasmtime::Result<()> {
        self.table.delete(seq)?;
        self.handles = self.handles.saturating_sub(1);
        Ok(())
    }
}

impl tokenizer::Host for PluginHost {
    fn encode(&mut self, text: String) -> Vec<u32> {
        self.tokenizer.encode(&text, false)
    }

    fn decode(&mut self, tokens: Vec<u32>) -> String {
        self.tokenizer.decode(&tokens)
    }
}

impl log::Host for PluginHost {
    fn log(&mut self, level: log::Level, message: String) {
        self.logged += 1;
        if self.logged > MAX_LOG_LINES {
            if self.logged == MAX_LOG_LINES + 1 {
                self.logs.push(format!(
                    "warn: (more than {MAX_LOG_LINES} lines in one request; the rest dropped)"
                ));
            }
            return;
        }
        let mut end = message.len().min(MAX_LOG_LINE);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        // One line per call: control characters are escaped, so a plugin cannot forge lines.
        let mut line = format!("{}: ", format!("{level:?}").to_lowercase());
        for c in message[..end].chars() {
            if c.is_control() {
                line.extend(c.escape_default());
            } else {
                line.push(c);
            }
        }
        self.logs.push(line);
    }
}
