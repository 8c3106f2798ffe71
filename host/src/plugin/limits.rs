//! What a plugin may use: per call, per request, of the shared instance pool, and of each host
//! import.

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What one plugin instance may use.
#[derive(Debug, Clone, Copy)]
pub struct PluginLimits {
    /// Fuel (roughly, wasm instructions) per call.
    pub fuel_per_call: u64,
    /// Linear memory, bytes.
    pub memory_bytes: usize,
    /// Wall time per call.
    pub call_timeout: Duration,
    /// Wall time of all of one request's calls together (every choice's instance included).
    pub request_time: Duration,
    /// Fuel for `init`, the set-up step (reading the vocabulary, compiling rules), which the
    /// server runs once per configuration where it can ([`super::snapshot`]).
    pub init_fuel: u64,
    /// Wall time for `init`.
    pub init_timeout: Duration,
}

impl Default for PluginLimits {
    fn default() -> Self {
        Self {
            fuel_per_call: 50_000_000,
            memory_bytes: 64 << 20,
            call_timeout: Duration::from_millis(200),
            request_time: Duration::from_secs(10),
            init_fuel: 500_000_000,
            init_timeout: Duration::from_secs(2),
        }
    }
}

/// The plugin time one request has left: every instance of the request (one per choice) draws
/// on the same one, so `n` choices or many tokens cannot multiply it.
#[derive(Debug)]
pub struct RequestTime {
    limit: Duration,
    spent: Mutex<Duration>,
}

impl RequestTime {
    /// A request's budget of `limit`.
    pub fn new(limit: Duration) -> Arc<Self> {
        Arc::new(Self {
            limit,
            spent: Mutex::new(Duration::ZERO),
        })
    }

    /// What is left.
    pub fn left(&self) -> Duration {
        let spent = *self.spent.lock().unwrap_or_else(|p| p.into_inner());
        self.limit.saturating_sub(spent)
    }

    /// Time the calls took so far.
    pub fn spent(&self) -> Duration {
        *self.spent.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn spend(&self, d: Duration) {
        let mut s = self.spent.lock().unwrap_or_else(|p| p.into_inner());
        *s = s.saturating_add(d);
    }
}

/// What one component may take of the shared instance pool: what one plugin needs, so that no
/// component can hold the slots of many. The pool checks them when a component is compiled or
/// loaded, and a component over any of them is refused ([`PluginFailure::OverLimits`](super::PluginFailure::OverLimits)), the
/// message naming the limit.
#[derive(Debug, Clone, Copy)]
pub struct ComponentLimits {
    /// Linear memories.
    pub memories: u32,
    /// Tables.
    pub tables: u32,
    /// Core module instances.
    pub core_instances: u32,
    /// Elements of one table.
    pub table_elements: usize,
}

impl ComponentLimits {
    /// What Rust and C components built for `wasm32-wasip2` need, with room to spare: one memory
    /// (two for a component that adapts a preview-1 module), a few tables and the handful of
    /// core instances `wit-component` makes for shims.
    pub const DEFAULT: Self = Self {
        memories: 2,
        tables: 4,
        core_instances: 8,
        table_elements: 100_000,
    };
}

/// A host import's input over its limit (the call fails with [`PluginFailure::HostLimit`](super::PluginFailure::HostLimit)).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct HostLimit(pub String);
