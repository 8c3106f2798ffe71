//! The host side of a plugin instance: its WASI context (with nothing behind it), its memory
//! limiter, and the world's imports (`kv`, `tokenizer`, `log`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand010::SeedableRng;
use wasmtime::component::{Resource, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::PluginLimits;
use super::bindings::warden::plugin::{kv, log, tokenizer, types};
use crate::tokenizer::Tokenizer;

/// Most log lines one instance keeps; further lines are dropped.
const MAX_LOG_LINES: usize = 64;
/// Longest log line kept, bytes.
const MAX_LOG_LINE: usize = 1024;

/// A KV page handle, minted by the host for the request's own sequence.
pub struct KvPage;

/// The request's sequence handle.
pub struct Sequence;

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
    /// When the call in progress must end.
    deadline: Instant,
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
            deadline: Instant::now(),
        }
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

    pub(super) fn logs(&self) -> &[String] {
        &self.logs
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
        // Plugins run before admission and on output text; neither has a sequence to hand out
        // until the serving path mints one for the request.
        None
    }
}

fn no_such_handle() -> String {
    "no such handle".into()
}

impl kv::HostKvPage for PluginHost {
    fn info(&mut self, page: Resource<KvPage>) -> Result<kv::PageInfo, String> {
        // Only handles this store minted resolve; a forged or stale index is refused.
        self.table.get(&page).map_err(|_| no_such_handle())?;
        Err(no_such_handle())
    }

    fn drop(&mut self, page: Resource<KvPage>) -> wasmtime::Result<()> {
        self.table.delete(page)?;
        Ok(())
    }
}

impl kv::HostSequence for PluginHost {
    fn pages(&mut self, seq: Resource<Sequence>) -> Result<Vec<Resource<KvPage>>, String> {
        self.table.get(&seq).map_err(|_| no_such_handle())?;
        Err(no_such_handle())
    }

    fn pin_prefix(&mut self, seq: Resource<Sequence>, _tokens: u32) -> Result<(), String> {
        self.table.get(&seq).map_err(|_| no_such_handle())?;
        Err(no_such_handle())
    }

    fn unpin_prefix(&mut self, seq: Resource<Sequence>) -> Result<(), String> {
        self.table.get(&seq).map_err(|_| no_such_handle())?;
        Err(no_such_handle())
    }

    fn drop(&mut self, seq: Resource<Sequence>) -> wasmtime::Result<()> {
        self.table.delete(seq)?;
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
        if self.logs.len() >= MAX_LOG_LINES {
            return;
        }
        let mut end = message.len().min(MAX_LOG_LINE);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        self.logs.push(format!("{level:?}: {}", &message[..end]));
    }
}
