//! Pre-initialising a plugin: its `init` runs once per (version, configuration), and the state
//! it left becomes the initial state of the component every request instantiates, as Wizer
//! does it (`wasmtime-wizer`). A request's instance is still fresh and its own; it only starts
//! where `init` ended instead of running it again.
//!
//! [`pre_initialise`] instruments the component (each core module exports its memories and
//! globals to the host), compiles that, instantiates it under the tenant's limits and runs
//! `init` with the configuration, exactly as a request would; then it reads the memories and
//! globals back and writes them into the component as data segments and initial values, and
//! compiles the result. What it cannot capture faithfully it leaves alone, saying why
//! ([`Snapshot::Kept`]), and requests go on running `init` themselves:
//!
//! - a component Wizer cannot rewrite (it mutates tables, drops segments, has reference-typed
//!   globals);
//! - an `init` that leaves the host holding one of its resources (a WASI stream it printed to
//!   and kept, say): a handle in the captured memory would name nothing in a new instance;
//! - an initialised component larger than an upload may be.
//!
//! Running `init` costs what it costs a request (fuel, time, memory), and the two compiles go
//! through the caller's `compile` (the server's bounded compiler process).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use wasmtime::component::{Lift, WasmList};
use wasmtime_wizer::{ComponentInstanceState, Wizer};

use super::{Instance, Plugin, PluginFailure, PluginLimits, RequestTime};
use crate::tokenizer::Tokenizer;

/// What pre-initialising gave.
pub enum Snapshot {
    /// The component initialised with the configuration, compiled: its instances skip `init`.
    Taken(Plugin),
    /// `init`'s state could not be captured, for the reason given; requests run `init`.
    Kept(String),
}

/// Runs `init(config)` of component `bytes` once under `limits` and returns the component that
/// starts where it ended, compiled with `compile` (`max_bytes`: the largest component it may
/// be, the upload limit), and what `init` logged. `init` refusing the configuration, or
/// failing, is an error, as it would be for a request. The instance `init` runs in is held by
/// what `slot` gives (the caller's hold on the tenant's instances), taken only while it is
/// alive; `slot` giving nothing fails with [`PluginFailure::Busy`].
#[allow(clippy::too_many_arguments)]
pub async fn pre_initialise<C, F, S>(
    bytes: &[u8],
    config: &str,
    limits: PluginLimits,
    tokenizer: Arc<Tokenizer>,
    max_bytes: usize,
    compile: C,
    slot: impl Future<Output = Option<S>>,
) -> Result<(Snapshot, Vec<String>), PluginFailure>
where
    C: Fn(Vec<u8>) -> F,
    F: Future<Output = Result<Plugin, PluginFailure>>,
{
    let kept = |why: String| Ok((Snapshot::Kept(why), vec![]));
    let mut wizer = Wizer::new();
    wizer.init_func("init").keep_init_func(true);
    // Wizer panics on a few shapes it does not support; those are components it cannot
    // rewrite, not a reason to take the server down.
    let instrumented = std::panic::catch_unwind(|| wizer.instrument_component(bytes));
    let (cx, instrumented) = match instrumented {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            return kept(format!("the component cannot be pre-initialised: {e:#}"));
        }
        Err(_) => return kept("the component cannot be pre-initialised".into()),
    };
    let probe = compile(instrumented).await?;
    if probe.world() != "0.2.0" {
        return kept(format!("world {} has no init", probe.world()));
    }
    let Some(slot) = slot.await else {
        return Err(PluginFailure::Busy);
    };
    let time = RequestTime::new(limits.request_time);
    let mut instance = probe.instantiate(limits, tokenizer, 0, time, config).await?;
    let logs = instance.take_logs();
    let kept = |why: String| Ok((Snapshot::Kept(why), logs.clone()));
    if instance.store.data().holds_resources() {
        return kept(
            "init kept a host resource (a WASI stream it printed to, say) that a snapshot cannot carry".into(),
        );
    }
    let mut access = Access {
        instance: &mut instance,
        failed: None,
    };
    let rewritten = Unwinding(Box::pin(wizer.snapshot_component(&cx, &mut access))).await;
    if let Some(e) = access.failed {
        return Err(e);
    }
    let rewritten = match rewritten {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return kept(format!("the component cannot be pre-initialised: {e:#}"));
        }
        Err(()) => return kept("the component cannot be pre-initialised".into()),
    };
    drop(instance);
    drop(slot);
    if rewritten.len() > max_bytes {
        return kept(format!(
            "the initialised component is {} bytes, more than the {max_bytes} a component may be",
            rewritten.len()
        ));
    }
    let plugin = compile(rewritten).await?.into_pre_initialised(config);
    Ok((Snapshot::Taken(plugin), logs))
}

/// Wizer's view of the initialised instance: calls to the accessors instrumenting added, each
/// under the instance's limits like any call. The trait cannot fail, so the first failure is
/// kept (and zeros returned) for [`pre_initialise`] to report.
struct Access<'a> {
    instance: &'a mut Instance,
    failed: Option<PluginFailure>,
}

impl Access<'_> {
    async fn call<R>(&mut self, iface: &str, func: &str) -> Option<R>
    where
        R: Lift + Send + Sync + 'static,
    {
        if self.failed.is_some() {
            return None;
        }
        match self.instance.call_accessor::<R>(iface, func).await {
            Ok(r) => Some(r),
            Err(e) => {
                self.failed = Some(e);
                None
            }
        }
    }
}

impl ComponentInstanceState for Access<'_> {
    async fn call_func_ret_list_u8(&mut self, instance: &str, func: &str, contents: impl FnOnce(&[u8]) + Send) {
        match self.call::<WasmList<u8>>(instance, func).await {
            Some(list) => contents(list.as_le_slice(&self.instance.store)),
            None => contents(&[]),
        }
    }

    async fn call_func_ret_s32(&mut self, instance: &str, func: &str) -> i32 {
        self.call(instance, func).await.unwrap_or(0)
    }

    async fn call_func_ret_s64(&mut self, instance: &str, func: &str) -> i64 {
        self.call(instance, func).await.unwrap_or(0)
    }

    async fn call_func_ret_f32(&mut self, instance: &str, func: &str) -> u32 {
        self.call::<f32>(instance, func).await.map_or(0, f32::to_bits)
    }

    async fn call_func_ret_f64(&mut self, instance: &str, func: &str) -> u64 {
        self.call::<f64>(instance, func).await.map_or(0, f64::to_bits)
    }
}

/// A future whose panic is caught and returned as `Err(())`.
struct Unwinding<F>(Pin<Box<F>>);

impl<F: Future> Future for Unwinding<F> {
    type Output = Result<F::Output, ()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(Err(())),
        }
    }
}
