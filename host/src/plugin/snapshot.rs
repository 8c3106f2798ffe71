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
/// be, the upload limit). `init` refusing the configuration, or failing, is an error, as it
/// would be for a request.
pub async fn pre_initialise(
    bytes: &[u8],
    config: &str,
    limits: PluginLimits,
    tokenizer: Arc<Tokenizer>,
    max_bytes: usize,
    compile: impl AsyncFn(Vec<u8>) -> Result<Plugin, PluginFailure>,
) -> Result<Snapshot, PluginFailure> {
    let mut wizer = Wizer::new();
    wizer.init_func("init").keep_init_func(true);
    // Wizer panics on a few shapes it does not support; those are components it cannot
    // rewrite, not a reason to take the server down.
    let instrumented = std::panic::catch_unwind(|| wizer.instrument_component(bytes));
    let (cx, instrumented) = match instrumented {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            return Ok(Snapshot::Kept(format!(
                "the component cannot be pre-initialised: {e:#}"
            )));
        }
        Err(_) => return Ok(Snapshot::Kept("the component cannot be pre-initialised".into())),
    };
    let probe = compile(instrumented).await?;
    if probe.world() != "0.2.0" {
        return Ok(Snapshot::Kept(format!("world {} has no init", probe.world())));
    }
    let time = RequestTime::new(limits.request_time);
    let mut instance = probe.instantiate(limits, tokenizer, 0, time, config).await?;
    if instance.store.data().holds_resources() {
        return Ok(Snapshot::Kept(
            "init kept a host resource (a WASI stream or pollable, say) that a snapshot cannot carry".into(),
        ));
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
            return Ok(Snapshot::Kept(format!(
                "the component cannot be pre-initialised: {e:#}"
            )));
        }
        Err(()) => return Ok(Snapshot::Kept("the component cannot be pre-initialised".into())),
    };
    if rewritten.len() > max_bytes {
        return Ok(Snapshot::Kept(format!(
            "the initialised component is {} bytes, more than the {max_bytes} a component may be",
            rewritten.len()
        )));
    }
    let mut plugin = compile(rewritten).await?;
    plugin.init = super::Init::Done(config.into());
    Ok(Snapshot::Taken(plugin))
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
