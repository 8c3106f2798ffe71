//! Tenant plugins: WebAssembly components (the `tenant-plugin` world of `wit/plugin.wit`) run
//! by wasmtime, compiled once per version, instantiated afresh for every request.
//!
//! [`Runtime`] owns the wasmtime engine (Cranelift, the pooling allocator, fuel and epoch
//! interruption) and the linker. [`Runtime::compile`] turns component bytes into a [`Plugin`]:
//! it compiles them and checks that every import is one the host provides (the world's `kv`,
//! `tokenizer` and `log`, and WASI p2 with nothing behind it), so a component that imports
//! anything else is refused at upload. [`Plugin::instantiate`] makes an [`Instance`] in a fresh
//! `Store` with the tenant's limits: no state survives from one request to the next or crosses
//! tenants. Every call runs under fuel and an epoch deadline, and memory growth is capped; a
//! trap, exhausted fuel, a timeout or the memory cap fails only that call, each with its own
//! [`PluginFailure`] code.
//!
//! The sandbox: no preopened directories, no network, clocks that never move, randomness from
//! a generator seeded by the host, stdio that goes nowhere.

mod host;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap, UpdateDeadline};

use crate::tokenizer::Tokenizer;
pub use bindings::warden::plugin::types::{
    Capabilities, Chunk, Input, Message, PluginError as GuestError, Request, Sampling, Token, TokenAction,
};
use host::PluginHost;
pub use host::{BoxFuture, KvAccess};

/// The generated bindings of the world (documented in `wit/plugin.wit`).
#[allow(missing_docs)]
mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "tenant-plugin",
        // Guest code runs as futures that yield at every epoch tick, so a busy plugin never
        // holds a runtime thread for longer than one tick. Host imports stay synchronous.
        exports: { default: async },
        // KV questions go to the engine thread and wait for its answer.
        imports: {
            "warden:plugin/kv.[method]sequence.pages": async,
            "warden:plugin/kv.[method]sequence.pin-prefix": async,
            "warden:plugin/kv.[method]sequence.unpin-prefix": async,
            "warden:plugin/kv.[method]kv-page.info": async,
        },
        with: {
            "warden:plugin/kv.kv-page": super::host::KvPage,
            "warden:plugin/kv.sequence": super::host::Sequence,
        },
    });
}

/// What one plugin instance may use.
#[derive(Debug, Clone, Copy)]
pub struct PluginLimits {
    /// Fuel (roughly, wasm instructions) per call.
    pub fuel_per_call: u64,
    /// Linear memory, bytes.
    pub memory_bytes: usize,
    /// Wall time per call.
    pub call_timeout: Duration,
}

impl Default for PluginLimits {
    fn default() -> Self {
        Self {
            fuel_per_call: 50_000_000,
            memory_bytes: 64 << 20,
            call_timeout: Duration::from_millis(200),
        }
    }
}

/// Why a plugin call, or getting a plugin at all, failed. Each has a stable code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginFailure {
    /// The plugin refused the request with its own code and message.
    #[error("the plugin refused the request ({code}): {message}")]
    Refused {
        /// The plugin's code.
        code: String,
        /// The plugin's message.
        message: String,
    },
    /// The guest trapped.
    #[error("the plugin trapped: {0}")]
    Trap(String),
    /// The call used up its fuel.
    #[error("the plugin used up its fuel ({0} units per call)")]
    FuelExhausted(u64),
    /// The call ran past its wall-time limit.
    #[error("the plugin ran past its time limit of {0:?}")]
    Timeout(Duration),
    /// The guest tried to grow its memory beyond the limit.
    #[error("the plugin tried to use more than {0} bytes of memory")]
    OutOfMemory(usize),
    /// The bytes are not a valid component, or it imports what the host does not provide.
    #[error("invalid plugin: {0}")]
    Invalid(String),
    /// Every instance slot is in use; retry later.
    #[error("every plugin instance slot is in use")]
    Busy,
}

impl PluginFailure {
    /// The stable error code clients and metrics see.
    pub fn code(&self) -> &'static str {
        match self {
            PluginFailure::Refused { .. } => "plugin_refused",
            PluginFailure::Trap(_) => "plugin_trap",
            PluginFailure::FuelExhausted(_) => "plugin_fuel_exhausted",
            PluginFailure::Timeout(_) => "plugin_timeout",
            PluginFailure::OutOfMemory(_) => "plugin_out_of_memory",
            PluginFailure::Invalid(_) => "plugin_invalid",
            PluginFailure::Busy => "plugin_busy",
        }
    }
}

/// Linear memory (and table) bytes a freed instance slot keeps mapped, reset with a memset
/// instead of returned to the kernel: a Rust guest's stack and data sit in the first MiB, so the
/// next request's first call finds them without page faults (10 µs less per request, paid
/// as a memset when the instance is dropped, after its response).
const KEEP_RESIDENT: usize = 1280 << 10;

/// How often the epoch advances: the granularity of call timeouts, and how long guest code runs
/// before it yields to the executor.
const EPOCH_TICK: Duration = Duration::from_millis(1);

/// The wasmtime engine and linker every plugin shares.
pub struct Runtime {
    engine: Engine,
    linker: Linker<PluginHost>,
    ticking: Arc<AtomicBool>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticking.store(false, Ordering::SeqCst);
    }
}

impl Runtime {
    /// An engine for up to `instances` concurrent plugin instances of at most `max_memory`
    /// bytes of linear memory each.
    pub fn new(instances: u32, max_memory: usize) -> Result<Self, PluginFailure> {
        let invalid = |e: wasmtime::Error| PluginFailure::Invalid(format!("{e:#}"));
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(instances)
            .total_core_instances(instances * 4)
            .total_memories(instances * 2)
            .total_tables(instances * 4)
            .total_stacks(instances)
            .max_memory_size(max_memory)
            .max_component_instance_size(1 << 20)
            .linear_memory_keep_resident(KEEP_RESIDENT)
            .table_keep_resident(KEEP_RESIDENT);
        let mut cfg = Config::new();
        cfg.wasm_component_model(true)
            .consume_fuel(true)
            .epoch_interruption(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
            .max_wasm_stack(512 << 10);
        let engine = Engine::new(&cfg).map_err(invalid)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(invalid)?;
        bindings::TenantPlugin::add_to_linker::<_, HasSelf<_>>(&mut linker, |h| h).map_err(invalid)?;
        let ticking = Arc::new(AtomicBool::new(true));
        let (e, t) = (engine.weak(), ticking.clone());
        std::thread::Builder::new()
            .name("warden-plugin-epoch".into())
            .spawn(move || {
                while t.load(Ordering::SeqCst) {
                    std::thread::sleep(EPOCH_TICK);
                    match e.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                }
            })
            .map_err(|e| PluginFailure::Invalid(format!("starting the epoch thread: {e}")))?;
        Ok(Self {
            engine,
            linker,
            ticking,
        })
    }

    /// Compiles `bytes` and checks that the component implements the world with nothing but
    /// the host's imports.
    pub fn compile(&self, bytes: &[u8]) -> Result<Plugin, PluginFailure> {
        let component = Component::new(&self.engine, bytes).map_err(|e| PluginFailure::Invalid(format!("{e:#}")))?;
        self.link(component)
    }

    /// What compiled artefacts must match to load into this runtime (wasmtime's version and
    /// the engine's settings), as hex: part of an artefact's cache key.
    pub fn compatibility(&self) -> String {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut h);
        format!("{:016x}", h.finish())
    }

    /// Loads a compiled artefact that [`Plugin::artefact`] produced.
    ///
    /// # Safety
    ///
    /// `artefact` must be exactly the bytes [`Plugin::artefact`] returned in a runtime of the same
    /// [`Runtime::compatibility`]: wasmtime runs the machine code in it without verifying it. The
    /// caller proves where the bytes came from (the server's cache authenticates every file it
    /// wrote with a key only it knows).
    pub unsafe fn load_artefact(&self, artefact: &[u8]) -> Result<Plugin, PluginFailure> {
        // SAFETY: the caller guarantees the bytes are an unmodified artefact of this engine's
        // configuration; wasmtime itself still checks the version and settings it records.
        let component = unsafe { Component::deserialize(&self.engine, artefact) }
            .map_err(|e| PluginFailure::Invalid(format!("{e:#}")))?;
        self.link(component)
    }

    fn link(&self, component: Component) -> Result<Plugin, PluginFailure> {
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginFailure::Invalid(format!("{e:#}")))?;
        let pre = bindings::TenantPluginPre::new(pre).map_err(|e| PluginFailure::Invalid(format!("{e:#}")))?;
        Ok(Plugin {
            pre,
            component,
            engine: self.engine.clone(),
        })
    }
}

/// A compiled plugin version, ready to instantiate.
#[derive(Clone)]
pub struct Plugin {
    pre: bindings::TenantPluginPre<PluginHost>,
    component: Component,
    engine: Engine,
}

/// One request's instance of a plugin.
pub struct Instance {
    store: Store<PluginHost>,
    bindings: bindings::TenantPlugin,
    limits: PluginLimits,
    /// Fuel burned by calls not yet taken by [`Instance::take_fuel`].
    fuel_used: u64,
}

impl Plugin {
    /// The compiled machine code, for [`Runtime::load_artefact`].
    pub fn artefact(&self) -> Result<Vec<u8>, PluginFailure> {
        self.component
            .serialize()
            .map_err(|e| PluginFailure::Invalid(format!("{e:#}")))
    }

    /// A fresh instance in its own store, with `limits`, the served model's tokenizer and
    /// randomness seeded from `seed`.
    pub async fn instantiate(
        &self,
        limits: PluginLimits,
        tokenizer: Arc<Tokenizer>,
        seed: u64,
    ) -> Result<Instance, PluginFailure> {
        let mut store = Store::new(&self.engine, PluginHost::new(limits, tokenizer, seed));
        store.limiter(|h| h.limiter());
        // At each tick: yield to the executor, or end the call once its wall time is up.
        store.epoch_deadline_callback(|s| {
            if Instant::now() >= s.data().deadline() {
                return Err(wasmtime::Error::new(Trap::Interrupt));
            }
            Ok(UpdateDeadline::Yield(1))
        });
        arm(&mut store, &limits)?;
        match self.pre.instantiate_async(&mut store).await {
            Ok(bindings) => Ok(Instance {
                store,
                bindings,
                limits,
                fuel_used: 0,
            }),
            Err(e) => Err(classify(&store, &limits, e)),
        }
    }
}

/// Refuels the store and sets its deadline for one call.
fn arm(store: &mut Store<PluginHost>, limits: &PluginLimits) -> Result<(), PluginFailure> {
    store
        .set_fuel(limits.fuel_per_call)
        .map_err(|e| PluginFailure::Invalid(format!("{e:#}")))?;
    store.data_mut().set_deadline(Instant::now() + limits.call_timeout);
    store.set_epoch_deadline(1);
    Ok(())
}

/// Which failure an error from a call is.
fn classify(store: &Store<PluginHost>, limits: &PluginLimits, e: wasmtime::Error) -> PluginFailure {
    if store.data().hit_memory_limit() {
        return PluginFailure::OutOfMemory(limits.memory_bytes);
    }
    if e.downcast_ref::<wasmtime::PoolConcurrencyLimitError>().is_some() {
        return PluginFailure::Busy;
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => PluginFailure::FuelExhausted(limits.fuel_per_call),
        Some(Trap::Interrupt) => PluginFailure::Timeout(limits.call_timeout),
        _ => PluginFailure::Trap(format!("{e:#}")),
    }
}

impl Instance {
    /// What the plugin implements beyond preprocess and postprocess.
    pub async fn capabilities(&mut self) -> Result<Capabilities, PluginFailure> {
        self.arm()?;
        let r = self.bindings.call_capabilities(&mut self.store).await;
        r.map_err(|e| classify(&self.store, &self.limits, e))
    }

    /// Runs `preprocess`.
    pub async fn preprocess(&mut self, req: &Request) -> Result<Request, PluginFailure> {
        self.arm()?;
        let r = self.bindings.call_preprocess(&mut self.store, req).await;
        r.map_err(|e| classify(&self.store, &self.limits, e))?.map_err(refused)
    }

    /// Runs `postprocess` on a chunk of output (`is_final` on the last).
    pub async fn postprocess(&mut self, text: &str, is_final: bool) -> Result<String, PluginFailure> {
        let chunk = Chunk { text: text.to_string() };
        self.arm()?;
        let r = self.bindings.call_postprocess(&mut self.store, &chunk, is_final).await;
        Ok(r.map_err(|e| classify(&self.store, &self.limits, e))?
            .map_err(refused)?
            .text)
    }

    /// Runs `on-token`.
    pub async fn on_token(&mut self, token: &Token) -> Result<TokenAction, PluginFailure> {
        self.arm()?;
        let r = self.bindings.call_on_token(&mut self.store, token).await;
        r.map_err(|e| classify(&self.store, &self.limits, e))
    }

    /// Gives the instance its request's KV: from now on `kv.current()` shows the sequence
    /// once the request is admitted.
    pub fn attach_kv(&mut self, kv: Arc<dyn KvAccess>) {
        self.store.data_mut().attach_kv(kv);
    }

    /// What the plugin logged since the last call of this, oldest first.
    pub fn take_logs(&mut self) -> Vec<String> {
        self.store.data_mut().take_logs()
    }

    /// Fuel burned since the last time this was asked (instantiation included), for the
    /// tenant's usage.
    pub fn take_fuel(&mut self) -> u64 {
        self.count_fuel();
        std::mem::take(&mut self.fuel_used)
    }

    /// Counts what the last call burned, then refills, so nothing is counted twice.
    fn count_fuel(&mut self) {
        if let Ok(left) = self.store.get_fuel() {
            self.fuel_used += self.limits.fuel_per_call.saturating_sub(left);
            let _ = self.store.set_fuel(self.limits.fuel_per_call);
        }
    }

    /// Arms the store for the next call, counting the last one's fuel first.
    fn arm(&mut self) -> Result<(), PluginFailure> {
        self.count_fuel();
        arm(&mut self.store, &self.limits)
    }
}

fn refused(e: GuestError) -> PluginFailure {
    PluginFailure::Refused {
        code: e.code,
        message: e.message,
    }
}

#[cfg(test)]
mod tests;
