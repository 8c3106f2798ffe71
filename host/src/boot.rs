//! Role selection: what `warden serve --role …` starts. Prefill and decode nodes are
//! [`crate::cluster::node`]; `all` runs the API in front of this process's engine thread, and
//! `router` runs it in front of the cluster's nodes ([`crate::cluster::router`]).

use std::sync::Arc;

use anyhow::Context;

use crate::cluster::router::{Router, RouterEngine};
use crate::config::{Role, ServeConfig};
use crate::loaded::LoadedModel;
use crate::metrics::Metrics;
use crate::runner::{EngineHandle, LocalEngine, start_engine};
use crate::serve::{Parts, runtime};

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
pub fn serve(cfg: ServeConfig, opts: ServeOptions) -> anyhow::Result<()> {
    if matches!(opts.role, Role::Prefill | Role::Decode) {
        return crate::cluster::node::serve_node(cfg, opts.role);
    }
    std::fs::create_dir_all(&cfg.data_dir).with_context(|| format!("creating {}", cfg.data_dir.display()))?;
    // The model and the engine first: a bad model or pool setting fails before any state changes.
    let loaded = LoadedModel::open(&cfg.model)?;
    let rt = runtime()?;
    let metrics = Arc::new(Metrics::default());
    // This process's engine, or (on a router) the cluster's nodes, once they agree.
    let engine: Arc<dyn EngineHandle> = match opts.role {
        Role::Router => {
            let digest =
                crate::cluster::file_digest(&cfg.model).with_context(|| format!("reading {}", cfg.model.display()))?;
            let router = rt.block_on(Router::connect(&cfg.cluster, &digest, metrics.clone()))?;
            Arc::new(RouterEngine(Arc::new(router)))
        }
        _ => Arc::new(LocalEngine::start(
            start_engine(&cfg, &loaded)?,
            cfg.limits.queue,
            metrics.clone(),
        )?),
    };
    let parts = Parts {
        loaded,
        engine,
        rt,
        metrics,
    };
    crate::serve::serve(cfg, opts.insecure_http, parts)
}
