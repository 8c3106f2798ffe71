//! What every request handler reads: the server's configuration, store, engine, plugins,
//! metrics, model and quotas, built once at start.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::openai::RequestLimits;
use super::plugins::Plugins;
use super::quota::Quotas;
use super::store::Store;
use crate::chat::ChatTemplate;
use crate::config::ServeConfig;
use crate::engine::request::AdmissionLimits;
use crate::metrics::Metrics;
use crate::runner::EngineHandle;
use crate::tokenizer::Tokenizer;

/// Everything a request handler reads.
pub struct State {
    /// The configuration in force.
    pub cfg: ServeConfig,
    /// Tenants and keys.
    pub store: Store,
    /// The engine.
    pub engine: Arc<dyn EngineHandle>,
    /// Tenant plugins.
    pub plugins: Plugins,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat template.
    pub chat: Option<Arc<ChatTemplate>>,
    /// The model id clients name.
    pub model_id: String,
    /// Admission limits (the engine's).
    pub admission: AdmissionLimits,
    /// Request-shape limits.
    pub request_limits: RequestLimits,
    /// Start time, seconds since the epoch.
    pub started: u64,
    /// Set once shutdown begins: new requests get 503.
    pub shutting_down: AtomicBool,
    /// Tenants' policies, their limiters and their usage.
    pub quotas: Arc<Quotas>,
}
