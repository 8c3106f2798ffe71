//! Role selection: what `warden serve --role …` starts. Prefill and decode nodes are
//! [`crate::cluster::node`]; `all` runs the API in front of this process's engine thread, and
//! `router` runs it in front of the cluster's nodes ([`crate::cluster::router`]).

use std::sync::Arc;

use crate::cluster::router::{ConnectError, Router, RouterEngine};
use crate::config::{Role, ServeConfig};
use crate::loaded::{LoadError, LoadedModel};
use crate::metrics::Metrics;
use crate::runner::{EngineHandle, LocalEngine, StartError, StartupError, start_engine};
use crate::serve::{Parts, ServeError, runtime};

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
    if matches!(opts.role, Role::Prefill | Role::Decode) {
        return Ok(crate::cluster::node::serve_node(cfg, opts.role)?);
    }
    std::fs::create_dir_all(&cfg.data_dir).map_err(StartupError::io(format!("creating {}", cfg.data_dir.display())))?;
    // The model and the engine first: a bad model or pool setting fails before any state changes.
    let loaded = LoadedModel::open(&cfg.model)?;
    let rt = runtime().map_err(StartupError::io("starting the server's runtime"))?;
    let metrics = Arc::new(Metrics::default());
    // This process's engine, or (on a router) the cluster's nodes, once they agree.
    let engine: Arc<dyn EngineHandle> = match opts.role {
        Role::Router => {
            let digest = crate::cluster::file_digest(&cfg.model)
                .map_err(StartupError::io(format!("reading {}", cfg.model.display())))?;
            let router = rt.block_on(Router::connect(&cfg.cluster, &digest, metrics.clone()))?;
            Arc::new(RouterEngine(Arc::new(router)))
        }
        _ => Arc::new(
            LocalEngine::start(start_engine(&cfg, &loaded)?, cfg.limits.queue, metrics.clone())
                .map_err(StartupError::io("starting the engine thread"))?,
        ),
    };
    let parts = Parts {
        loaded,
        engine,
        rt,
        metrics,
    };
    Ok(crate::serve::serve(cfg, opts.insecure_http, parts)?)
}
