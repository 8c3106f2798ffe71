//! The host side of a plugin instance: its WASI context (with nothing behind it), its memory
//! limiter, and the world's imports (`kv`, `tokenizer`, `log`).
//!
//! What a guest makes the host do is charged to it (invariant 8). Every import has an input
//! limit, checked before the work, and costs fuel in proportion to that work, from the same
//! per-call budget as the guest's own instructions: `tokenizer` and `log` debit the store's fuel
//! directly (they are defined on the linker with the store in hand, see [`link_charged`]);
//! `kv` calls run as the generated bindings' methods and leave their cost as a debt that the
//! next epoch tick (which traps once the debt passes the fuel left) or the end of the call
//! settles. Tokenizer work runs on the blocking pool, raced against the call's deadline, so no
//! guest holds an async worker. WASI's clocks are frozen and its sleeps return at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand010::SeedableRng;
use wasmtime::component::{Linker, Resource, ResourceTable};
use wasmtime::{StoreContextMut, Trap};
use wasmtime_wasi::p2::{DynPollable, Pollable};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::access::{KvAccess, KvAccessError, KvPage, Sequence};
use super::bindings::v1::warden::plugin::{kv, log, types};
use super::bindings::v2::warden::plugin0_2_0::{types as types2, vocabulary};
use super::limits::{HostLimit, PluginLimits};
use super::stdio::GuestOutput;
use crate::kv::PageHandle;
use crate::tokenizer::Tokenizer;

/// Most log lines one instance may write; further lines are dropped.
const MAX_LOG_LINES: usize = 64;
/// Longest log line kept, bytes.
const MAX_LOG_LINE: usize = 1024;

/// Longest text one `tokenizer.encode` call takes: a client's request body at the default limit.
pub const MAX_ENCODE_BYTES: usize = 1 << 20;
/// Most bytes one WASI `get-random-bytes` call takes (more fails the call).
const MAX_RANDOM_BYTES: u64 = 64 << 10;
/// Most tokens one `tokenizer.decode` call takes.
pub const MAX_DECODE_TOKENS: usize = 256 << 10;

/// What every host call costs in fuel, whatever it does (about a microsecond of guest code).
pub const FUEL_PER_HOST_CALL: u64 = 2_000;
/// Fuel per byte `tokenizer.encode` takes: encoding runs at about 2 MB/s here, so a byte costs
/// about what 500 wasm instructions cost.
pub const FUEL_PER_ENCODED_BYTE: u64 = 500;
/// Fuel per token `tokenizer.decode` takes.
pub const FUEL_PER_DECODED_TOKEN: u64 = 200;
/// Fuel per byte a `log` line carries.
pub const FUEL_PER_LOGGED_BYTE: u64 = 20;
/// Fuel per page handle `sequence.pages` mints.
pub const FUEL_PER_PAGE: u64 = 500;

/// Most resource handles one instance may hold at once (each `pages` call mints one per page).
const MAX_HANDLES: usize = 4096;

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

/// A clock that never moves: the guest can neither read the time nor time anything. Its sleeps
/// return at once (see [`link_frozen_sleeps`]): a guest can never wait on the host's time.
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
    /// What the guest prints, for its log.
    stdout: GuestOutput,
    stderr: GuestOutput,
    /// Lines logged over the instance's life (the cap counts these).
    logged: usize,
    /// When the call in progress must end.
    deadline: Instant,
    /// The request's KV, once the serving path attaches it.
    kv: Option<Arc<dyn KvAccess>>,
    /// Live resource handles.
    handles: usize,
    /// Fuel the `kv` calls cost that the store's fuel does not show yet.
    debt: u64,
    /// The epoch each page allocation seen by this instance shows the guest: numbered from 1 in
    /// the order the guest first saw them, so it says nothing of the physical page's history
    /// (other tenants' use of it included).
    epochs: HashMap<PageHandle, u32>,
}

impl PluginHost {
    pub(super) fn new(limits: PluginLimits, tokenizer: Arc<Tokenizer>, seed: u64) -> Self {
        let stdout = GuestOutput::new(MAX_LOG_LINES, MAX_LOG_LINE);
        let stderr = GuestOutput::new(MAX_LOG_LINES, MAX_LOG_LINE);
        let wasi = WasiCtxBuilder::new()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .secure_random(rand010::rngs::StdRng::seed_from_u64(seed))
            .insecure_random(rand010::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15))
            .insecure_random_seed(u128::from(seed))
            // Random bytes are made on the host, in one call: 64 KiB at most (wasmtime's default
            // is 64 MiB), so a guest cannot have the host fill and copy megabytes at once.
            .max_random_size(MAX_RANDOM_BYTES)
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
            stdout,
            stderr,
            logged: 0,
            deadline: Instant::now(),
            kv: None,
            handles: 0,
            debt: 0,
            epochs: HashMap::new(),
        }
    }

    /// Fuel owed by host calls, taken (the caller debits or counts it).
    pub(super) fn take_debt(&mut self) -> u64 {
        std::mem::take(&mut self.debt)
    }

    pub(super) fn debt(&self) -> u64 {
        self.debt
    }

    /// The epoch the guest sees for `page`: relative to this instance, never the pool's.
    fn relative_epoch(&mut self, page: PageHandle) -> u32 {
        let next = self.epochs.len() as u32 + 1;
        *self.epochs.entry(page).or_insert(next)
    }

    pub(super) fn attach_kv(&mut self, kv: Arc<dyn KvAccess>) {
        self.kv = Some(kv);
    }

    fn mint<T: Send + 'static>(&mut self, v: T) -> Result<Resource<T>, KvAccessError> {
        if self.handles >= MAX_HANDLES {
            return Err(KvAccessError::TooManyHandles(MAX_HANDLES));
        }
        let r = self.table.push(v).map_err(|_| KvAccessError::TableFull)?;
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

    /// Whether the host holds a resource for the guest (a WASI stream, a pollable, a KV
    /// handle): state outside the guest's memory that a snapshot of it cannot carry.
    pub(super) fn holds_resources(&self) -> bool {
        !self.table.is_empty()
    }

    pub(super) fn hit_memory_limit(&self) -> bool {
        self.limiter.hit
    }

    /// The lines logged since the last take: `log` calls', then what the guest printed on
    /// stdout and stderr (its panic messages among them), each as `stdout: ` or `stderr: ` lines
    /// under the same caps.
    pub(super) fn take_logs(&mut self) -> Vec<String> {
        for line in self.stdout.take() {
            self.line("stdout", &line);
        }
        for line in self.stderr.take() {
            self.line("stderr", &line);
        }
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

impl types2::Host for PluginHost {}

/// Most tokens one `vocabulary.token-bytes` call returns.
pub const MAX_VOCABULARY_TOKENS: u32 = 4096;

impl vocabulary::Host for PluginHost {
    fn size(&mut self) -> u32 {
        self.debt += FUEL_PER_HOST_CALL;
        u32::try_from(self.tokenizer.vocab_size()).unwrap_or(u32::MAX)
    }

    fn token_bytes(&mut self, first: u32, count: u32) -> Vec<Vec<u8>> {
        let size = u32::try_from(self.tokenizer.vocab_size()).unwrap_or(u32::MAX);
        let end = first.saturating_add(count.min(MAX_VOCABULARY_TOKENS)).min(size);
        let ids = first.min(end)..end;
        self.debt += FUEL_PER_HOST_CALL + FUEL_PER_DECODED_TOKEN * u64::from(end - first.min(end));
        ids.map(|id| self.tokenizer.token_bytes(id)).collect()
    }
}

impl kv::Host for PluginHost {
    fn current(&mut self) -> Option<Resource<Sequence>> {
        self.debt += FUEL_PER_HOST_CALL;
        // Before admission (during preprocess) there is no sequence to show.
        if !self.kv.as_ref().is_some_and(|k| k.started()) {
            return None;
        }
        self.mint(Sequence).ok()
    }
}

impl kv::HostKvPage for PluginHost {
    async fn info(&mut self, page: Resource<KvPage>) -> Result<kv::PageInfo, String> {
        self.debt += FUEL_PER_HOST_CALL;
        // Only handles this store minted resolve; wasmtime refuses a forged or stale index
        // before this runs.
        let handle = self.table.get(&page).map_err(|_| KvAccessError::NoSuchHandle)?.handle;
        let kv = self.kv.clone().ok_or(KvAccessError::NoSuchHandle)?;
        let info = tokio::time::timeout(self.budget(), kv.info(handle))
            .await
            .map_err(|_| KvAccessError::TimedOut)??;
        Ok(kv::PageInfo {
            written: info.written,
            epoch: self.relative_epoch(handle),
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
        self.debt += FUEL_PER_HOST_CALL;
        self.table.get(&seq).map_err(|_| KvAccessError::NoSuchHandle)?;
        let kv = self.kv.clone().ok_or(KvAccessError::NoSuchHandle)?;
        let handles = tokio::time::timeout(self.budget(), kv.pages())
            .await
            .map_err(|_| KvAccessError::TimedOut)?
            .ok_or(KvAccessError::NoPages)?;
        self.debt += FUEL_PER_PAGE * handles.len() as u64;
        let mut out = Vec::with_capacity(handles.len());
        for handle in handles {
            out.push(self.mint(KvPage { handle })?);
        }
        Ok(out)
    }

    async fn pin_prefix(&mut self, seq: Resource<Sequence>, tokens: u32) -> Result<u32, String> {
        self.debt += FUEL_PER_HOST_CALL;
        self.table.get(&seq).map_err(|_| KvAccessError::NoSuchHandle)?;
        let kv = self.kv.clone().ok_or(KvAccessError::NoSuchHandle)?;
        let pinned = tokio::time::timeout(self.budget(), kv.pin(tokens as usize))
            .await
            .map_err(|_| KvAccessError::TimedOut)??;
        Ok(u32::try_from(pinned).unwrap_or(u32::MAX))
    }

    async fn unpin_prefix(&mut self, seq: Resource<Sequence>) -> Result<u32, String> {
        self.debt += FUEL_PER_HOST_CALL;
        self.table.get(&seq).map_err(|_| KvAccessError::NoSuchHandle)?;
        let kv = self.kv.clone().ok_or(KvAccessError::NoSuchHandle)?;
        let pages = tokio::time::timeout(self.budget(), kv.unpin())
            .await
            .map_err(|_| KvAccessError::TimedOut)??;
        Ok(u32::try_from(pages).unwrap_or(u32::MAX))
    }

    fn drop(&mut self, seq: Resource<Sequence>) -> wasmtime::Result<()> {
        self.table.delete(seq)?;
        self.handles = self.handles.saturating_sub(1);
        Ok(())
    }
}

/// Debits `cost` (and any debt the `kv` calls left) from the store's fuel before the work it
/// pays for; a call that cannot pay ends as out of fuel, its work not done.
fn charge(store: &mut StoreContextMut<'_, PluginHost>, cost: u64) -> wasmtime::Result<()> {
    let owed = cost.saturating_add(store.data_mut().take_debt());
    let left = store.get_fuel()?;
    if owed > left {
        store.set_fuel(0)?;
        return Err(wasmtime::Error::new(Trap::OutOfFuel));
    }
    store.set_fuel(left - owed)
}

/// Runs `work` on the blocking pool, so no async worker waits on it, raced against the call's
/// deadline: past it the guest's call ends as timed out (the work, bounded by the import's input
/// limit, finishes on its own and is dropped).
async fn off_runtime<R: Send + 'static>(
    deadline: Instant,
    work: impl FnOnce() -> R + Send + 'static,
) -> wasmtime::Result<R> {
    match tokio::time::timeout_at(deadline.into(), tokio::task::spawn_blocking(work)).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(wasmtime::Error::msg(format!("the host's tokenizer task failed: {e}"))),
        Err(_) => Err(wasmtime::Error::new(Trap::Interrupt)),
    }
}

fn over(what: &str, got: usize, limit: usize) -> wasmtime::Error {
    wasmtime::Error::new(HostLimit(format!("{what} of {got} is over the limit of {limit}")))
}

/// Defines the `tokenizer` and `log` imports, which charge the store's fuel for their work.
pub(super) fn link_charged(linker: &mut Linker<PluginHost>) -> wasmtime::Result<()> {
    let mut tk = linker.instance("warden:plugin/tokenizer@0.1.0")?;
    tk.func_wrap_async(
        "encode",
        |mut store: StoreContextMut<'_, PluginHost>, (text,): (String,)| {
            Box::new(async move {
                if text.len() > MAX_ENCODE_BYTES {
                    return Err(over("tokenizer.encode: a text", text.len(), MAX_ENCODE_BYTES));
                }
                charge(
                    &mut store,
                    FUEL_PER_HOST_CALL + FUEL_PER_ENCODED_BYTE * text.len() as u64,
                )?;
                let (tk, deadline) = (store.data().tokenizer.clone(), store.data().deadline);
                Ok((off_runtime(deadline, move || tk.encode(&text, false)).await?,))
            })
        },
    )?;
    tk.func_wrap_async(
        "decode",
        |mut store: StoreContextMut<'_, PluginHost>, (ids,): (Vec<u32>,)| {
            Box::new(async move {
                if ids.len() > MAX_DECODE_TOKENS {
                    return Err(over("tokenizer.decode: a list", ids.len(), MAX_DECODE_TOKENS));
                }
                charge(
                    &mut store,
                    FUEL_PER_HOST_CALL + FUEL_PER_DECODED_TOKEN * ids.len() as u64,
                )?;
                let (tk, deadline) = (store.data().tokenizer.clone(), store.data().deadline);
                Ok((off_runtime(deadline, move || tk.decode(&ids)).await?,))
            })
        },
    )?;
    let mut lg = linker.instance("warden:plugin/log@0.1.0")?;
    lg.func_wrap(
        "log",
        |mut store: StoreContextMut<'_, PluginHost>, (level, message): (log::Level, String)| {
            let kept = message.len().min(MAX_LOG_LINE) as u64;
            charge(&mut store, FUEL_PER_HOST_CALL + FUEL_PER_LOGGED_BYTE * kept)?;
            store.data_mut().log(level, &message);
            Ok(())
        },
    )?;
    Ok(())
}

/// A sleep on the frozen clock: ready at once.
struct Ready;

#[async_trait::async_trait]
impl Pollable for Ready {
    async fn ready(&mut self) {}
}

fn ready(table: &mut ResourceTable) -> wasmtime::Result<Resource<DynPollable>> {
    let r = table.push(Ready)?;
    wasmtime_wasi::p2::subscribe(table, r)
}

/// Replaces WASI's monotonic-clock subscriptions (which sleep on the host's real clock) with
/// ones that are ready at once: the clock is frozen, so no guest can tell, and none can hold
/// its call (or an instance slot) by sleeping. Needs the linker to allow shadowing.
pub(super) fn link_frozen_sleeps(linker: &mut Linker<PluginHost>) -> wasmtime::Result<()> {
    // Both take a time (a duration or an instant) that the frozen clock makes moot.
    fn ready_now(mut store: StoreContextMut<'_, PluginHost>, _: (u64,)) -> wasmtime::Result<(Resource<DynPollable>,)> {
        Ok((ready(&mut store.data_mut().table)?,))
    }
    let mut clock = linker.instance("wasi:clocks/monotonic-clock@0.2.12")?;
    clock.func_wrap("subscribe-duration", ready_now)?;
    clock.func_wrap("subscribe-instant", ready_now)?;
    Ok(())
}

impl PluginHost {
    fn log(&mut self, level: log::Level, message: &str) {
        self.line(&format!("{level:?}").to_lowercase(), message);
    }

    /// One line of the log, `label: message`, under the caps.
    fn line(&mut self, label: &str, message: &str) {
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
        let mut line = format!("{label}: ");
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
