//! Tenant plugins: WebAssembly components (the `tenant-plugin` world of `wit/plugin.wit`) run
//! by wasmtime, compiled once per version, instantiated afresh for every request.
//!
//! [`Runtime`] owns the wasmtime engine (Cranelift, the pooling allocator, fuel and epoch
//! interruption) and the linker. [`Runtime::compile`] turns component bytes into a [`Plugin`]:
//! it compiles them and checks that every import is one the host provides (the world's `kv`,
//! `tokenizer` and `log`, and WASI p2 with nothing behind it), so a component that imports
//! anything else is refused at upload. [`Plugin::instantiate`] makes an [`Instance`] in a fresh
//! `Store` with the tenant's limits: no state survives from one request to the next or crosses
//! tenants. A 0.2.0 plugin's `init` runs in each instance, or once per configuration when the
//! component is pre-initialised ([`snapshot`]): then every instance starts from the state `init`
//! left, still fresh and its own. Every call runs under fuel and an epoch deadline, and memory growth is capped; a
//! trap, exhausted fuel, a timeout or the memory cap fails only that call, each with its own
//! [`PluginFailure`] code.
//!
//! The sandbox: no preopened directories, no network, clocks that never move (and sleeps that
//! return at once), randomness from a generator seeded by the host, stdin empty, and stdout and
//! stderr kept as lines of the tenant's plugin log (under the log's caps).
//!
//! Every bound holds whatever the guest does (invariant 8): each call is raced against its
//! deadline, so a call waiting in a host import ends on time as surely as one spinning in guest
//! code; a request's calls together share [`PluginLimits::request_time`]; host imports are
//! charged in fuel (`host`); and one component can take only what one plugin needs of the
//! shared instance pool ([`ComponentLimits`], checked at compile).

mod access;
mod bindings;
pub mod compile;
mod host;
mod limits;
pub mod snapshot;
mod stdio;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{
    AsContext, Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap, UpdateDeadline,
};

use crate::tokenizer::Tokenizer;
pub use access::{BoxFuture, KvAccess, KvAccessError};
use bindings::{v1, v2};
use host::PluginHost;
pub use host::{
    FUEL_PER_DECODED_TOKEN, FUEL_PER_ENCODED_BYTE, FUEL_PER_HOST_CALL, FUEL_PER_LOGGED_BYTE, FUEL_PER_PAGE,
    MAX_DECODE_TOKENS, MAX_ENCODE_BYTES,
};
pub use limits::{ComponentLimits, HostLimit, PluginLimits, RequestTime};
pub use v1::warden::plugin::types::{Capabilities, Chunk, Input, Message, PluginError as GuestError, Token};
pub use v2::warden::plugin0_2_0::types::{Finish, Request, Sampling, TokenAction, TokenConstraint as GuestConstraint};

/// Sampling that changes nothing (temperature 1, no truncation, penalty or bias) for
/// `max_tokens`: what the host's own calls (the smoke call, benchmarks) give a plugin.
pub fn neutral_sampling(max_tokens: u32) -> Sampling {
    Sampling {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        max_tokens,
        seed: None,
        stop: vec![],
        logit_bias: vec![],
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
    /// The request's calls together ran past the request's plugin time.
    #[error("the plugin's calls for this request ran past their time limit of {0:?} in all")]
    RequestTime(Duration),
    /// The guest passed a host import more than the import takes.
    #[error("the plugin called the host with too much: {0}")]
    HostLimit(String),
    /// The guest returned more than the host takes back.
    #[error("the plugin returned too much: {0}")]
    OutputTooLarge(String),
    /// The component needs more of the instance pool than one plugin may take.
    #[error("the component needs more than a plugin may use: {0}")]
    OverLimits(String),
    /// Compiling the component took longer than its limit.
    #[error("compiling the component took longer than the limit of {0:?}")]
    CompileTimeout(Duration),
    /// Compiling the component needed more memory than its limit (bytes).
    #[error("compiling the component needed more than the limit of {0} bytes of memory")]
    CompileMemory(u64),
    /// The guest tried to grow its memory beyond the limit.
    #[error("the plugin tried to use more than {0} bytes of memory")]
    OutOfMemory(usize),
    /// The bytes are not a valid component, or it imports what the host does not provide.
    #[error("invalid plugin: {0}")]
    Invalid(String),
    /// `on-token` returned a token constraint the host does not take (ids outside the
    /// vocabulary, too long, or a bias out of range).
    #[error("the plugin's token constraint is invalid: {0}")]
    BadConstraint(String),
    /// Every instance slot is in use; retry later.
    #[error("every plugin instance slot is in use")]
    Busy,
    /// The tenant has spent its compile budget; a compile fits again after this long.
    #[error("the tenant's plugin compile budget is spent; a compile fits again in {0:?}")]
    CompileBudget(Duration),
}

impl PluginFailure {
    /// The stable error code clients and metrics see.
    pub fn code(&self) -> &'static str {
        match self {
            PluginFailure::Refused { .. } => "plugin_refused",
            PluginFailure::Trap(_) => "plugin_trap",
            PluginFailure::FuelExhausted(_) => "plugin_fuel_exhausted",
            PluginFailure::Timeout(_) => "plugin_timeout",
            PluginFailure::RequestTime(_) => "plugin_request_time_exceeded",
            PluginFailure::HostLimit(_) => "plugin_host_call_too_large",
            PluginFailure::OutputTooLarge(_) => "plugin_output_too_large",
            PluginFailure::OverLimits(_) => "component_over_limits",
            PluginFailure::CompileTimeout(_) => "component_compile_timeout",
            PluginFailure::CompileMemory(_) => "component_compile_memory",
            PluginFailure::OutOfMemory(_) => "plugin_out_of_memory",
            PluginFailure::Invalid(_) => "plugin_invalid",
            PluginFailure::BadConstraint(_) => "plugin_constraint_invalid",
            PluginFailure::Busy => "plugin_busy",
            PluginFailure::CompileBudget(_) => "compile_budget_exceeded",
        }
    }
}

/// Linear memory (and table) bytes a freed instance slot keeps mapped, reset in place (zeroed,
/// or copied back from the component's initial image) instead of returned to the kernel: a Rust
/// guest's stack takes the first MiB, and its data and the heap `init` left come next, so the next
/// request's calls find them without page faults (about 2 µs each in `plugin_bench`: the regex
/// filter's request took 34 µs with 1.25 MiB kept, 18 µs with 2 MiB). The price is paid when the
/// instance is dropped, after its response: resetting up to this many bytes (20 to 90 µs).
const KEEP_RESIDENT: usize = 2 << 20;

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
        let setup = |e: wasmtime::Error| PluginFailure::Invalid(format!("{e:#}"));
        let limits = ComponentLimits::DEFAULT;
        let mut pool = PoolingAllocationConfig::default();
        // Every instance can have the most one component may take, so a component within its
        // limits never takes another's share of the pool.
        pool.total_component_instances(instances)
            .total_core_instances(instances * limits.core_instances)
            .total_memories(instances * limits.memories)
            .total_tables(instances * limits.tables)
            .total_stacks(instances)
            .max_core_instances_per_component(limits.core_instances)
            .max_memories_per_component(limits.memories)
            .max_tables_per_component(limits.tables)
            .max_memories_per_module(limits.memories)
            .max_tables_per_module(limits.tables)
            .table_elements(limits.table_elements)
            .max_memory_size(max_memory)
            .max_component_instance_size(1 << 20)
            .linear_memory_keep_resident(KEEP_RESIDENT)
            .table_keep_resident(KEEP_RESIDENT);
        let mut cfg = Self::config();
        cfg.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&cfg).map_err(setup)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(setup)?;
        v1::warden::plugin::types::add_to_linker::<_, HasSelf<_>>(&mut linker, |h| h).map_err(setup)?;
        v1::warden::plugin::kv::add_to_linker::<_, HasSelf<_>>(&mut linker, |h| h).map_err(setup)?;
        v2::warden::plugin0_2_0::types::add_to_linker::<_, HasSelf<_>>(&mut linker, |h| h).map_err(setup)?;
        v2::warden::plugin0_2_0::vocabulary::add_to_linker::<_, HasSelf<_>>(&mut linker, |h| h).map_err(setup)?;
        host::link_charged(&mut linker).map_err(setup)?;
        linker.allow_shadowing(true);
        host::link_frozen_sleeps(&mut linker).map_err(setup)?;
        linker.allow_shadowing(false);
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

    /// The engine settings compiled code depends on: the server's runtime and the compiler
    /// process ([`compile::precompile`]) both build on them, so the artefacts one makes the
    /// other loads.
    fn config() -> Config {
        let mut cfg = Config::new();
        cfg.wasm_component_model(true)
            .consume_fuel(true)
            .epoch_interruption(true)
            .max_wasm_stack(512 << 10);
        cfg
    }

    /// Compiles `bytes` and checks that the component implements the world with nothing but
    /// the host's imports.
    pub fn compile(&self, bytes: &[u8]) -> Result<Plugin, PluginFailure> {
        let component = Component::new(&self.engine, bytes).map_err(invalid)?;
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
        let component = unsafe { Component::deserialize(&self.engine, artefact) }.map_err(invalid)?;
        self.link(component)
    }

    fn link(&self, component: Component) -> Result<Plugin, PluginFailure> {
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginFailure::Invalid(format!("{e:#}")))?;
        let invalid = |e: wasmtime::Error| PluginFailure::Invalid(format!("{e:#}"));
        // Which world it implements is told by its exports: 0.2.0's has `init`.
        let pre = if component.get_export_index(None, "init").is_some() {
            Pre::V2(v2::TenantPluginPre::new(pre).map_err(invalid)?)
        } else {
            Pre::V1(v1::TenantPluginPre::new(pre).map_err(invalid)?)
        };
        Ok(Plugin {
            pre,
            component,
            engine: self.engine.clone(),
            init: Init::PerInstance,
        })
    }
}

/// A compiled plugin version, ready to instantiate.
#[derive(Clone)]
pub struct Plugin {
    pre: Pre,
    component: Component,
    engine: Engine,
    init: Init,
}

/// Where an instance's `init` runs.
#[derive(Clone)]
enum Init {
    /// In every instance, with the request's configuration.
    PerInstance,
    /// Already, once, with this configuration: the component starts from its state
    /// ([`snapshot`]).
    Done(Arc<str>),
}

/// A component linked against the world it implements.
#[derive(Clone)]
enum Pre {
    V1(v1::TenantPluginPre<PluginHost>),
    V2(v2::TenantPluginPre<PluginHost>),
}

/// An instance's exports, in its world's version.
enum Guest {
    V1(v1::TenantPlugin),
    V2(v2::TenantPlugin),
}

/// One request's instance of a plugin.
pub struct Instance {
    store: Store<PluginHost>,
    /// The component instance the bindings call into.
    raw: wasmtime::component::Instance,
    bindings: Guest,
    limits: PluginLimits,
    /// The request's plugin time, shared with its other instances.
    time: Arc<RequestTime>,
    /// Fuel burned by calls not yet taken by [`Instance::take_fuel`].
    fuel_used: u64,
    /// What `postprocess` was given and returned: its output is bounded by its input.
    postprocessed: OutputBound,
}

/// Bytes `postprocess` may return beyond [`POSTPROCESS_RATIO`] times what it was given, over a
/// choice's whole output (markers and notes a plugin adds to short outputs).
pub const POSTPROCESS_SLACK: usize = 4096;
/// How many times the text it was given `postprocess` may return, over a choice's whole output.
pub const POSTPROCESS_RATIO: usize = 4;
/// The most one `postprocess` call may return, bytes.
pub const POSTPROCESS_MAX_CHUNK: usize = 1 << 20;

/// What a choice's `postprocess` calls were given and returned, in bytes, and the bound on what
/// they may return.
#[derive(Debug, Default, Clone, Copy)]
pub struct OutputBound {
    given: usize,
    returned: usize,
}

impl OutputBound {
    /// Counts a call given `given` bytes that returned `returned`; fails once the call or the
    /// choice's whole output is over its bound.
    pub fn admit(&mut self, given: usize, returned: usize) -> Result<(), PluginFailure> {
        self.given = self.given.saturating_add(given);
        self.returned = self.returned.saturating_add(returned);
        if returned > POSTPROCESS_MAX_CHUNK {
            return Err(PluginFailure::OutputTooLarge(format!(
                "postprocess returned {returned} bytes in one chunk, more than the limit of {POSTPROCESS_MAX_CHUNK}"
            )));
        }
        let allowed = self
            .given
            .saturating_mul(POSTPROCESS_RATIO)
            .saturating_add(POSTPROCESS_SLACK);
        if self.returned > allowed {
            return Err(PluginFailure::OutputTooLarge(format!(
                "postprocess returned {} bytes for {} bytes of output, more than {POSTPROCESS_RATIO} times \
                 the output plus {POSTPROCESS_SLACK}",
                self.returned, self.given
            )));
        }
        Ok(())
    }
}

impl Plugin {
    /// The compiled machine code, for [`Runtime::load_artefact`].
    pub fn artefact(&self) -> Result<Vec<u8>, PluginFailure> {
        self.component
            .serialize()
            .map_err(|e| PluginFailure::Invalid(format!("{e:#}")))
    }

    /// Whether it starts from its `init`'s state, taken once ([`snapshot`]), instead of running
    /// `init` in every instance.
    pub fn pre_initialised(&self) -> bool {
        matches!(self.init, Init::Done(_))
    }

    /// Whether each instance runs `init` when it is made (a 0.2.0 plugin not pre-initialised):
    /// up to [`PluginLimits::init_fuel`] of work per instance.
    pub fn runs_init(&self) -> bool {
        matches!((&self.pre, &self.init), (Pre::V2(_), Init::PerInstance))
    }

    /// The same component, as one [`snapshot::pre_initialise`] made with `config`: its
    /// instances skip `init`. For such a component loaded back from its artefact.
    pub fn into_pre_initialised(mut self, config: &str) -> Plugin {
        self.init = Init::Done(config.into());
        self
    }

    /// Which version of the world the component implements: `"0.1.0"` or `"0.2.0"`.
    pub fn world(&self) -> &'static str {
        match self.pre {
            Pre::V1(_) => "0.1.0",
            Pre::V2(_) => "0.2.0",
        }
    }

    /// A fresh instance in its own store, with `limits`, the served model's tokenizer,
    /// randomness seeded from `seed`, and the request's plugin time `time` (instantiating
    /// spends it too), initialised with the tenant's `config` (0.2.0's `init`: its refusal is
    /// [`PluginFailure::Refused`]). A pre-initialised plugin skips `init`, and takes only the
    /// configuration it was initialised with.
    pub async fn instantiate(
        &self,
        limits: PluginLimits,
        tokenizer: Arc<Tokenizer>,
        seed: u64,
        time: Arc<RequestTime>,
        config: &str,
    ) -> Result<Instance, PluginFailure> {
        let mut store = Store::new(&self.engine, PluginHost::new(limits, tokenizer, seed));
        store.limiter(|h| h.limiter());
        // At each tick: end the call once its wall time is up, or once the fuel its host calls
        // owe passes what is left; else yield to the executor.
        store.epoch_deadline_callback(|s| {
            if Instant::now() >= s.data().deadline() {
                return Err(wasmtime::Error::new(Trap::Interrupt));
            }
            let debt = s.data().debt();
            if debt > 0 && debt >= s.as_context().get_fuel().unwrap_or(0) {
                return Err(wasmtime::Error::new(Trap::OutOfFuel));
            }
            Ok(UpdateDeadline::Yield(1))
        });
        let (deadline, cut_short) = arm(&mut store, &limits, &time)?;
        let started = Instant::now();
        if let Init::Done(c) = &self.init
            && **c != *config
        {
            return Err(PluginFailure::Invalid(
                "this plugin was pre-initialised with another configuration".into(),
            ));
        }
        let instantiated = async {
            let pre = match &self.pre {
                Pre::V1(p) => p.instance_pre(),
                Pre::V2(p) => p.instance_pre(),
            };
            let raw = pre.instantiate_async(&mut store).await?;
            let bindings = match &self.pre {
                Pre::V1(_) => Guest::V1(v1::TenantPlugin::new(&mut store, &raw)?),
                Pre::V2(_) => Guest::V2(v2::TenantPlugin::new(&mut store, &raw)?),
            };
            Ok::<_, wasmtime::Error>((raw, bindings))
        };
        let r = tokio::time::timeout_at(deadline.into(), instantiated).await;
        time.spend(started.elapsed());
        let timeout = || timeout_failure(&limits, cut_short);
        let mut instance = match r {
            Ok(Ok((raw, bindings))) => Instance {
                store,
                raw,
                bindings,
                limits,
                time,
                fuel_used: 0,
                postprocessed: OutputBound::default(),
            },
            Ok(Err(e)) => return Err(classify(&store, &limits, e, timeout)),
            Err(_) => return Err(timeout()),
        };
        if let Init::PerInstance = self.init {
            instance.init(config).await?;
        }
        Ok(instance)
    }
}

/// Refuels the store and sets its deadline for one call: its own limit, or what is left of the
/// request's time if that is less (then `true`). Fails when the request's time is spent.
fn arm(
    store: &mut Store<PluginHost>,
    limits: &PluginLimits,
    time: &RequestTime,
) -> Result<(Instant, bool), PluginFailure> {
    let left = time.left();
    if left.is_zero() {
        return Err(PluginFailure::RequestTime(limits.request_time));
    }
    store
        .set_fuel(limits.fuel_per_call)
        .map_err(|e| PluginFailure::Invalid(format!("{e:#}")))?;
    let cut_short = left < limits.call_timeout;
    let deadline = Instant::now() + left.min(limits.call_timeout);
    store.data_mut().set_deadline(deadline);
    store.set_epoch_deadline(1);
    Ok((deadline, cut_short))
}

fn timeout_failure(limits: &PluginLimits, cut_short: bool) -> PluginFailure {
    if cut_short {
        PluginFailure::RequestTime(limits.request_time)
    } else {
        PluginFailure::Timeout(limits.call_timeout)
    }
}

/// Whether wasmtime's error says the component is over the pool's per-component limits
/// ([`ComponentLimits`]).
fn over_limits(msg: &str) -> bool {
    msg.contains("in the pooling allocator") || msg.contains("pooling allocator requirements")
}

/// A component that did not compile or load: over the pool's limits, or invalid.
fn invalid(e: wasmtime::Error) -> PluginFailure {
    let msg = format!("{e:#}");
    if over_limits(&msg) {
        PluginFailure::OverLimits(msg)
    } else {
        PluginFailure::Invalid(msg)
    }
}

/// Which failure an error from a call is.
fn classify(
    store: &Store<PluginHost>,
    limits: &PluginLimits,
    e: wasmtime::Error,
    timeout: impl FnOnce() -> PluginFailure,
) -> PluginFailure {
    if store.data().hit_memory_limit() {
        return PluginFailure::OutOfMemory(limits.memory_bytes);
    }
    if e.downcast_ref::<wasmtime::PoolConcurrencyLimitError>().is_some() {
        return PluginFailure::Busy;
    }
    if let Some(h) = e.downcast_ref::<HostLimit>() {
        return PluginFailure::HostLimit(h.0.clone());
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => PluginFailure::FuelExhausted(limits.fuel_per_call),
        Some(Trap::Interrupt) => timeout(),
        _ => {
            let msg = format!("{e:#}");
            if over_limits(&msg) {
                PluginFailure::OverLimits(msg)
            } else {
                PluginFailure::Trap(msg)
            }
        }
    }
}

/// Runs one export call of an [`Instance`]: arms it, races the call against its deadline (so a
/// call waiting in a host import ends on time too), spends the request's time, and classifies a
/// failure.
macro_rules! call {
    ($self:ident, |$b:ident, $s:ident| $call:expr) => {{
        let (deadline, cut_short) = $self.arm()?;
        let started = Instant::now();
        let r = {
            let ($b, $s) = (&$self.bindings, &mut $self.store);
            tokio::time::timeout_at(deadline.into(), $call).await
        };
        $self.time.spend(started.elapsed());
        let timeout = || timeout_failure(&$self.limits, cut_short);
        match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(&$self.store, &$self.limits, e, timeout)),
            Err(_) => Err(timeout()),
        }
    }};
}

impl Instance {
    /// Which version of the world it implements.
    pub fn world(&self) -> &'static str {
        match self.bindings {
            Guest::V1(_) => "0.1.0",
            Guest::V2(_) => "0.2.0",
        }
    }

    /// Runs 0.2.0's `init` with the tenant's configuration (0.1.0 has none), under the init
    /// budget ([`PluginLimits::init_fuel`], [`PluginLimits::init_timeout`]) instead of a call's.
    async fn init(&mut self, config: &str) -> Result<(), PluginFailure> {
        if let Guest::V1(_) = self.bindings {
            return Ok(());
        }
        let calls = self.limits;
        self.count_fuel();
        self.limits.fuel_per_call = calls.init_fuel;
        self.limits.call_timeout = calls.init_timeout;
        let _ = self.store.set_fuel(calls.init_fuel);
        // In its own block, so a call that cannot start still gives the calls' budget back.
        let r = async {
            call!(self, |b, s| async move {
                match b {
                    Guest::V2(g) => g.call_init(s, config).await,
                    Guest::V1(_) => Ok(Ok(())),
                }
            })
        }
        .await;
        // Counted against the init budget it ran with, before the calls' budget returns.
        self.count_fuel();
        self.limits = calls;
        let _ = self.store.set_fuel(calls.fuel_per_call);
        r?.map_err(refused)
    }

    /// Calls `func` of exported interface `iface`, which takes nothing and returns an `R`: the
    /// accessors [`snapshot`] reads an initialised instance through.
    async fn call_accessor<R>(&mut self, iface: &str, func: &str) -> Result<R, PluginFailure>
    where
        R: wasmtime::component::Lift + Send + Sync + 'static,
    {
        let raw = self.raw;
        call!(self, |_b, s| async move {
            let missing = || wasmtime::format_err!("the component exports no {iface}#{func}");
            let i = raw.get_export_index(&mut *s, None, iface).ok_or_else(missing)?;
            let f = raw.get_export_index(&mut *s, Some(&i), func).ok_or_else(missing)?;
            let f = raw.get_typed_func::<(), (R,)>(&mut *s, f)?;
            f.call_async(&mut *s, ()).await.map(|(r,)| r)
        })
    }

    /// What the plugin implements beyond preprocess and postprocess.
    pub async fn capabilities(&mut self) -> Result<Capabilities, PluginFailure> {
        call!(self, |b, s| async move {
            match b {
                Guest::V1(g) => g.call_capabilities(s).await,
                Guest::V2(g) => g.call_capabilities(s).await,
            }
        })
    }

    /// Runs `preprocess`. A 0.1.0 plugin sees the sampling fields its world has, and the ones it
    /// cannot see stay as they were.
    pub async fn preprocess(&mut self, req: &Request) -> Result<Request, PluginFailure> {
        if let Guest::V2(_) = self.bindings {
            return call!(self, |b, s| async move {
                match b {
                    Guest::V2(g) => g.call_preprocess(s, req).await,
                    Guest::V1(_) => unreachable!("matched above"),
                }
            })?
            .map_err(refused);
        }
        let old = v1::warden::plugin::types::Request {
            input: req.input.clone(),
            sampling: v1::warden::plugin::types::Sampling {
                temperature: req.sampling.temperature,
                top_p: req.sampling.top_p,
                max_tokens: req.sampling.max_tokens,
                seed: req.sampling.seed,
                stop: req.sampling.stop.clone(),
            },
            config: req.config.clone(),
            metadata: req.metadata.clone(),
        };
        let out = call!(self, |b, s| async {
            match b {
                Guest::V1(g) => g.call_preprocess(s, &old).await,
                Guest::V2(_) => unreachable!("matched above"),
            }
        })?
        .map_err(refused)?;
        Ok(Request {
            input: out.input,
            sampling: Sampling {
                temperature: out.sampling.temperature,
                top_p: out.sampling.top_p,
                max_tokens: out.sampling.max_tokens,
                seed: out.sampling.seed,
                stop: out.sampling.stop,
                ..req.sampling.clone()
            },
            config: out.config,
            metadata: out.metadata,
            first_token: None,
        })
    }

    /// Runs `postprocess` on a chunk of output (`end` on the last: how the choice ended). What
    /// it returns is bounded: at most [`POSTPROCESS_MAX_CHUNK`] bytes a call, and over the
    /// instance's life at most [`POSTPROCESS_RATIO`] times the text it was given plus
    /// [`POSTPROCESS_SLACK`].
    pub async fn postprocess(&mut self, text: &str, end: Option<&Finish>) -> Result<String, PluginFailure> {
        let chunk = Chunk { text: text.to_string() };
        let out = call!(self, |b, s| async {
            match b {
                Guest::V1(g) => g.call_postprocess(s, &chunk, end.is_some()).await,
                Guest::V2(g) => g.call_postprocess(s, &chunk, end).await,
            }
        })?
        .map_err(refused)?
        .text;
        self.postprocessed.admit(text.len(), out.len())?;
        Ok(out)
    }

    /// Runs `on-token`.
    pub async fn on_token(&mut self, token: &Token) -> Result<TokenAction, PluginFailure> {
        call!(self, |b, s| async move {
            match b {
                Guest::V1(g) => g.call_on_token(s, token).await.map(|a| match a {
                    v1::warden::plugin::types::TokenAction::Continue => TokenAction::Continue,
                    v1::warden::plugin::types::TokenAction::Stop => TokenAction::Stop,
                }),
                Guest::V2(g) => g.call_on_token(s, token).await,
            }
        })
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

    /// Fuel burned since the last time this was asked (instantiation and host calls included),
    /// for the tenant's usage.
    pub fn take_fuel(&mut self) -> u64 {
        self.count_fuel();
        std::mem::take(&mut self.fuel_used)
    }

    /// Counts what the last call burned (its host calls' unsettled fuel too), then refills, so
    /// nothing is counted twice.
    fn count_fuel(&mut self) {
        let debt = self.store.data_mut().take_debt();
        if let Ok(left) = self.store.get_fuel() {
            self.fuel_used += self.limits.fuel_per_call.saturating_sub(left) + debt;
            let _ = self.store.set_fuel(self.limits.fuel_per_call);
        }
    }

    /// Arms the store for the next call, counting the last one's fuel first.
    fn arm(&mut self) -> Result<(Instant, bool), PluginFailure> {
        self.count_fuel();
        arm(&mut self.store, &self.limits, &self.time)
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
