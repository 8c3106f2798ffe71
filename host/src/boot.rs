//! Role selection: what `warden serve --role …` starts. Prefill and decode nodes are
//! [`crate::cluster::node`]; `all` runs the API in front of this process's engine thread, and
//! `router` runs it in front of the cluster's nodes ([`crate::cluster::router`]).

use std::sync::Arc;

use crate::cluster::router::{ConnectError, Router, RouterEngine};
use crate::config::{Role, ServeConfig};
use crate::loaded::{LoadError, LoadedModel, ModelText};
use crate::metrics::Metrics;
use crate::runner::{EngineHandle, LocalEngine, StartError, StartupError, start_engine};
use crate::serve::{ModelParts, Parts, ServeError, runtime};

/// Why `warden serve` could not start, or stopped on an error.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The model, the engine or a step on the way (on any role).
    #[error(transparent)]
    Startup(#[from] StartupError),
    /// A router could not form its cluster.
    #[error(transparent)]
    Router(#[from] ConnectError),
    /// The API server failed.
    #[error(transparent)]
    Serve(#[from] ServeError),
}

impl From<LoadError> for BootError {
    fn from(e: LoadError) -> Self {
        StartupError::from(e).into()
    }
}

impl From<StartError> for BootError {
    fn from(e: StartError) -> Self {
        StartupError::from(e).into()
    }
}

/// Options from the command line.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Serve plain HTTP instead of HTTPS.
    pub insecure_http: bool,
    /// What this process is: everything, or one role of a disaggregated cluster.
    pub role: Role,
}

/// Runs the server (or, for `--role prefill|decode`, a node) until SIGTERM or SIGINT, then
/// shuts down gracefully.
pub fn serve(cfg: ServeConfig, opts: ServeOptions) -> Result<(), BootError> {
    // The compute pool, before anything computes.
    if cfg.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .thread_name(|i| format!("warden-compute-{i}"))
            .build_global()
            .map_err(|e| StartupError::io("starting the compute pool")(std::io::Error::other(e)))?;
    }
    tracing::info!("compute pool: {} threads", rayon::current_num_threads());
    if matches!(opts.role, Role::Prefill | Role::Decode) {
        return Ok(crate::cluster::node::serve_node(cfg, opts.role)?);
    }
    std::fs::create_dir_all(&cfg.data_dir).map_err(StartupError::io(format!("creating {}", cfg.data_dir.display())))?;
    // The models and their engines first: a bad model or pool setting fails before any state
    // changes.
    let served = cfg.served();
    let rt = runtime().map_err(StartupError::io("starting the server's runtime"))?;
    let metrics = Arc::new(Metrics::default());
    // Each model's tokenizer and template, and its engine: its own thread and pool, or (on a
    // router) the cluster's nodes that serve it, once they agree. A router reads the file's
    // tokenizer, template and digest, and never its weights.
    let mut texts = Vec::with_capacity(served.len());
    let engines: Vec<Arc<dyn EngineHandle>> = match opts.role {
        Role::Router => {
            let mut wanted = Vec::with_capacity(served.len());
            for s in &served {
                texts.push(ModelText::open(&s.path)?);
                let digest = crate::cluster::file_digest(&s.path)
                    .map_err(StartupError::io(format!("reading {}", s.path.display())))?;
                wanted.push((s.name.clone(), digest));
            }
            let routers = rt.block_on(Router::connect(&cfg.cluster, &wanted, metrics.clone()))?;
            routers
                .into_iter()
                .map(|r| Arc::new(RouterEngine(Arc::new(r))) as Arc<dyn EngineHandle>)
                .collect()
        }
        _ => {
            let mut engines: Vec<Arc<dyn EngineHandle>> = Vec::with_capacity(served.len());
            for s in &served {
                let loaded = LoadedModel::open(&s.path)?;
                texts.push(loaded.text());
                let engine = start_engine(&cfg, s, &loaded)?;
                let local = LocalEngine::start(engine, s.limits.queue, metrics.model(&s.name)).map_err(
                    StartupError::io(format!("starting the engine thread of model {}", s.name)),
                )?;
                engines.push(Arc::new(local));
            }
            engines
        }
    };
    let models = served
        .into_iter()
        .zip(texts)
        .zip(engines)
        .map(|((served, text), engine)| ModelParts { served, text, engine })
        .collect();
    let parts = Parts { models, rt, metrics };
    Ok(crate::serve::serve(cfg, opts.insecure_http, parts)?)
}
