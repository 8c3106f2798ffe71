//! What every request handler reads: the server's configuration, store, models (each with its
//! engine), plugins, metrics and quotas, built once at start.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::openai::RequestLimits;
use super::plugins::Plugins;
use super::quota::Quotas;
use super::store::Store;
use crate::chat::ChatTemplate;
use crate::config::ServeConfig;
use crate::engine::request::AdmissionLimits;
use crate::grammar::TenantGrammars;
use crate::metrics::Metrics;
use crate::runner::EngineHandle;
use crate::tokenizer::Tokenizer;

/// One model the server serves: what a request that names it uses.
pub struct Served {
    /// The id clients name.
    pub id: String,
    /// Its place in the configuration's list (public prefixes are tokenized for each model).
    pub index: usize,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat template.
    pub chat: Option<Arc<ChatTemplate>>,
    /// Its compiler of tenants' `response_format`s and tool grammars.
    pub grammars: Arc<TenantGrammars>,
    /// Its engine (its own thread and KV pool, or on a router the nodes that serve it).
    pub engine: Arc<dyn EngineHandle>,
    /// Admission limits (its engine's).
    pub admission: AdmissionLimits,
    /// Request-shape limits.
    pub request_limits: RequestLimits,
    /// Jobs its engine's queue holds.
    pub queue: usize,
}

/// Everything a request handler reads.
pub struct State {
    /// The configuration in force.
    pub cfg: ServeConfig,
    /// Tenants and keys.
    pub store: Store,
    /// The models, in the configuration's order.
    pub models: Vec<Arc<Served>>,
    /// Tenant plugins.
    pub plugins: Plugins,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Start time, seconds since the epoch.
    pub started: u64,
    /// Set once shutdown begins: new requests get 503.
    pub shutting_down: AtomicBool,
    /// Tenants' policies, their limiters and their usage.
    pub quotas: Arc<Quotas>,
}

impl State {
    /// The served model clients call `id`.
    pub fn model(&self, id: &str) -> Option<&Arc<Served>> {
        self.models.iter().find(|m| m.id == id)
    }

    /// Every model's engine.
    pub fn engines(&self) -> impl Iterator<Item = &Arc<dyn EngineHandle>> {
        self.models.iter().map(|m| &m.engine)
    }
}
