//! `warden serve`'s API: HTTPS (hyper 1 + rustls, HTTP/1.1 and HTTP/2 by ALPN) in front of an
//! engine handle (this process's engine thread, or a router's cluster: [`crate::runner`]), with
//! tenants and API keys in sled.
//!
//! Modules, one concept each: [`store`] (tenants and keys), [`tls`] (certificates), [`error`]
//! (the one error type and its JSON), [`openai`] (request shapes), [`tools`] (function calling), [`stream`] (response and SSE shapes), [`quota`] and
//! [`usage`] (policies enforced, usage booked), [`plugins`] (the plugin registry and pipeline),
//! [`http`] (routing and endpoints), [`access`] (each request's access line and id), [`manage`]
//! (the CLI's offline commands) and [`client`] (the small HTTPS client the CLI uses to reach a
//! running server's admin API).

pub mod access;
pub mod client;
pub mod error;
pub mod http;
pub mod manage;
pub mod openai;
pub mod plugins;
pub mod quota;
pub mod state;
pub mod store;
pub mod stream;
pub mod tls;
pub mod tools;
pub mod usage;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

use crate::config::{ServeConfig, ServedModel};
use crate::grammar::{GrammarLimits, Grammars, TenantGrammars};
use crate::loaded::ModelText;
use crate::metrics::Metrics;
use crate::net::{accept, shutdown_signal};
use crate::policy::PolicyError;
use crate::runner::{EngineCallError, EngineHandle, StartupError};
use openai::RequestLimits;
use plugins::SetupError;
use state::{Served, State};
use store::{Store, StoreError};
use tls::TlsError;

/// Why the server could not start, or stopped on an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store (tenants, keys, plugins, usage) failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The policies do not load.
    #[error("loading the tenants' policies (see `policies` in the config)")]
    Policies(#[source] PolicyError),
    /// The policies' public prefixes could not be computed on a model.
    #[error("computing the public prefixes of the policies (public_prefixes in default.toml) on model {0}")]
    PublicPrefixes(String, #[source] EngineCallError),
    /// The plugin service could not start.
    #[error(transparent)]
    Plugins(#[from] SetupError),
    /// The TLS certificate or key could not be read or made.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A file or socket operation failed.
    #[error(transparent)]
    Io(#[from] StartupError),
    /// The configuration names a file that does not hold what it should (`[metrics]
    /// token_file`).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// `server.json` could not be written (a certificate path that is not UTF-8).
    #[error("describing the server in server.json")]
    ServerInfo(#[source] serde_json::Error),
}

/// What a running server writes to `data_dir/server.json`, so the CLI can reach its admin API
/// while it holds the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Base URL, e.g. `https://127.0.0.1:8443`.
    pub url: String,
    /// The certificate to trust (absent for plain HTTP).
    pub cert: Option<PathBuf>,
    /// The server's process id.
    pub pid: u32,
}

/// Where a data dir keeps the admin token.
pub fn admin_token_path(data_dir: &Path) -> PathBuf {
    data_dir.join("admin-token")
}

/// Where the server keeps the metrics token it made.
pub fn metrics_token_path(data_dir: &Path) -> PathBuf {
    data_dir.join("metrics-token")
}

/// Where a data dir keeps [`ServerInfo`].
pub fn server_info_path(data_dir: &Path) -> PathBuf {
    data_dir.join("server.json")
}

/// What the boot code hands the server: each model with its engine (this process's engine
/// thread or a router's cluster), the runtime the engines' tasks live on, and the metrics they
/// share.
pub struct Parts {
    /// The models, in the configuration's order.
    pub models: Vec<ModelParts>,
    /// The server's async runtime (see [`runtime`]).
    pub rt: tokio::runtime::Runtime,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
}

/// One served model, ready.
pub struct ModelParts {
    /// How the configuration serves it.
    pub served: ServedModel,
    /// Its tokenizer and chat template (a router reads no more of the file).
    pub text: ModelText,
    /// Its engine.
    pub engine: Arc<dyn EngineHandle>,
}

/// The server's async runtime: two workers for the HTTP side (the engine has its own thread).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("warden-http")
        .build()
}

/// Runs the API in front of `parts.engine` until SIGTERM or SIGINT, then shuts down gracefully.
/// `insecure_http` serves plain HTTP instead of HTTPS.
pub fn serve(cfg: ServeConfig, insecure_http: bool, parts: Parts) -> Result<(), ServeError> {
    let Parts { models, rt, metrics } = parts;
    let store = Store::open(&cfg.data_dir)?;
    admin_token(&store, &cfg.data_dir)?;
    metrics_token(&store, &cfg)?;
    // A tenant's KV policy applies in every model's pool: the smallest pool bounds it.
    let pools: Vec<(usize, usize)> = models.iter().map(|m| m.engine.pool_pages()).collect();
    let bounds = crate::policy::Bounds::of_pools(&pools, cfg.kv.page_size);
    let tokenizers: Vec<_> = models.iter().map(|m| m.text.tokenizer.clone()).collect();
    let tokenize: quota::Tokenize =
        Arc::new(move |text: &str| tokenizers.iter().map(|tk| tk.encode(text, true)).collect());
    let quotas = Arc::new(
        quota::Quotas::new(cfg.policies.clone(), bounds, tokenize, usage::UsageBook::open(&store)?)
            .map_err(ServeError::Policies)?,
    );
    let set = quotas.set();
    rt.block_on(async {
        for (i, m) in models.iter().enumerate() {
            m.engine
                .set_public_prefixes(set.public_prefixes(i))
                .await
                .map_err(|e| ServeError::PublicPrefixes(m.served.name.clone(), e))?;
        }
        Ok::<(), ServeError>(())
    })?;
    tracing::info!(
        "policies from {}: version {}",
        cfg.policies.display(),
        quotas.set().version
    );
    let plugins = plugins::Plugins::new(
        store.clone(),
        cfg.plugins.clone(),
        &cfg.data_dir,
        // An upload's smoke call runs against the first model's tokenizer; requests' calls
        // against their own model's.
        models[0].text.tokenizer.clone(),
        &plugins::compiler()?,
    )?;
    let tls = if insecure_http {
        None
    } else {
        let t = tls::setup(&cfg.tls, &cfg.data_dir)?;
        tracing::info!(
            "TLS certificate {}{} (SHA-256 {})",
            t.cert_path.display(),
            if t.generated { ", generated now" } else { "" },
            t.fingerprint
        );
        Some(t)
    };
    let listener = rt
        .block_on(TcpListener::bind(cfg.listen))
        .map_err(StartupError::io(format!("listening on {}", cfg.listen)))?;
    // Everything is in place: only now may a first start make its tenant and print its key.
    first_tenant(&store)?;
    rt.block_on(async {
        for t in store.tenants()? {
            for m in &models {
                m.engine
                    .set_tenant(t.id, set.of(&t.name).tenant_settings(), set.generation)
                    .await;
            }
        }
        Ok::<(), ServeError>(())
    })?;
    let grammar_limits = GrammarLimits {
        max_schema_bytes: cfg.limits.max_schema_bytes,
        compile_ms: cfg.limits.schema_compile_ms,
        memory_bytes: cfg.limits.schema_compile_mib << 20,
    };
    // This binary checks tenants' formats in child processes.
    let exe = plugins::compiler()?;
    let served = models
        .into_iter()
        .enumerate()
        .map(|(index, m)| {
            let grammars = Arc::new(Grammars::new(m.text.tokenizer.clone(), grammar_limits));
            // The vocabulary's token trie is built now, off the start path, rather than in the
            // first structured request's time (a router compiles each request's format too, to
            // refuse a bad one before it is dispatched).
            let warm = grammars.clone();
            std::thread::spawn(move || warm.warm());
            let grammars = Arc::new(TenantGrammars::new(
                grammars,
                &exe,
                cfg.limits.schema_compiles,
                cfg.limits.schema_cache_mib << 20,
            ));
            Arc::new(Served {
                grammars,
                admission: m.engine.admission(),
                request_limits: RequestLimits {
                    default_max_tokens: m
                        .served
                        .limits
                        .default_max_tokens
                        .unwrap_or(m.engine.admission().context()),
                    max_n: cfg.limits.max_n,
                },
                queue: m.served.limits.queue,
                id: m.served.name,
                index,
                tokenizer: m.text.tokenizer,
                chat: m.text.chat,
                engine: m.engine,
            })
        })
        .collect();
    let state = Arc::new(State {
        cfg,
        store,
        models: served,
        plugins,
        metrics,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        shutting_down: AtomicBool::new(false),
        quotas,
    });
    rt.block_on(run(state, tls, listener))
}

/// With an empty store: tenant `default` and its key (printed once).
fn first_tenant(store: &Store) -> Result<(), ServeError> {
    if store.is_new()? {
        store.create_tenant("default")?;
        let (_, key) = store.create_key("default")?;
        // On stdout for the operator, once, and never in the log (which carries no keys).
        println!("created tenant \"default\"; its API key (shown only now): {key}");
    }
    Ok(())
}

/// An admin token in `data_dir/admin-token` (mode 0600), made anew if the file is missing or
/// stale.
fn admin_token(store: &Store, data_dir: &Path) -> Result<(), ServeError> {
    let path = admin_token_path(data_dir);
    keep_token(&path, |t| store.is_admin(t), || store.new_admin_token())?;
    tracing::info!("admin token in {}", path.display());
    Ok(())
}

/// Keeps the token in `path` (mode 0600) valid: a file that is missing, or holds a token `valid`
/// refuses, gets a new one from `make`.
fn keep_token(
    path: &Path,
    valid: impl FnOnce(&str) -> Result<bool, StoreError>,
    make: impl FnOnce() -> Result<String, StoreError>,
) -> Result<(), ServeError> {
    let current = std::fs::read_to_string(path).ok().map(|s| s.trim().to_string());
    let ok = match &current {
        Some(t) => valid(t)?,
        None => false,
    };
    if !ok {
        let token = make()?;
        tls::write_private(path, format!("{token}\n").as_bytes())
            .map_err(StartupError::io(format!("writing {}", path.display())))?;
    }
    Ok(())
}

/// The metrics token: the operator's (`[metrics] token_file`), else one kept in
/// `data_dir/metrics-token` (mode 0600), made anew if that file is missing or stale.
fn metrics_token(store: &Store, cfg: &ServeConfig) -> Result<(), ServeError> {
    if let Some(token) = cfg.metrics.token()? {
        store.set_metrics_token(&token)?;
        // A token this server made before no longer opens anything: its file goes.
        let _ = std::fs::remove_file(metrics_token_path(&cfg.data_dir));
        if let Some(p) = &cfg.metrics.token_file {
            tracing::info!("metrics token from {}", p.display());
        }
        return Ok(());
    }
    let path = metrics_token_path(&cfg.data_dir);
    keep_token(&path, |t| store.is_metrics_reader(t), || store.new_metrics_token())?;
    tracing::info!("metrics token (GET /metrics only) in {}", path.display());
    Ok(())
}

/// Writes usage counters to disk every [`usage::FLUSH_EVERY`].
async fn flush_usage(state: Arc<State>) {
    loop {
        tokio::time::sleep(usage::FLUSH_EVERY).await;
        let s = state.clone();
        match tokio::task::spawn_blocking(move || s.quotas.usage.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("usage: writing counters: {e}"),
            Err(e) => tracing::error!("usage: the flush task failed: {e}"),
        }
    }
}

/// Reloads the TLS certificate and key when their files change (checked every second) and on
/// SIGHUP, for new connections; a pair that does not load is reported and the one in force
/// stays.
async fn watch_certificates(certs: Arc<tls::Certificates>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = signal(SignalKind::hangup()).ok();
    let mut last_error = String::new();
    loop {
        let tick = tokio::time::sleep(Duration::from_secs(1));
        let forced = match &mut hup {
            Some(h) => tokio::select! {
                _ = tick => false,
                _ = h.recv() => true,
            },
            None => {
                tick.await;
                false
            }
        };
        let c = certs.clone();
        let Ok(result) = tokio::task::spawn_blocking(move || c.reload(forced)).await else {
            continue;
        };
        match result {
            Ok(Some(fingerprint)) => {
                last_error.clear();
                tracing::info!("TLS certificate reloaded (SHA-256 {fingerprint}): new connections get it");
            }
            Ok(None) => {}
            Err(e) => {
                let msg = e.to_string();
                if forced || msg != last_error {
                    tracing::warn!("TLS certificate not reloaded ({msg}); the one in force stays");
                    last_error = msg;
                }
            }
        }
    }
}

/// Reloads the policies every second and on SIGHUP; a good set takes effect at once (and its
/// KV settings reach the engine), a bad one is reported and the set in force stays.
async fn watch_policies(state: Arc<State>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = signal(SignalKind::hangup()).ok();
    let mut last_error = String::new();
    loop {
        let tick = tokio::time::sleep(Duration::from_secs(1));
        match &mut hup {
            Some(h) => {
                tokio::select! {
                    _ = tick => {}
                    _ = h.recv() => {}
                }
            }
            None => tick.await,
        }
        let s = state.clone();
        let Ok(result) = tokio::task::spawn_blocking(move || s.quotas.reload()).await else {
            continue;
        };
        state
            .metrics
            .policy(&state.quotas.set().version, state.quotas.reload_failures());
        match result {
            Ok(true) => {
                last_error.clear();
                let set = state.quotas.set();
                tracing::info!("policies: version {} in force", set.version);
                let tenants = state.store.tenants().unwrap_or_default();
                for m in &state.models {
                    if let Err(e) = m.engine.set_public_prefixes(set.public_prefixes(m.index)).await {
                        tracing::warn!(
                            "policies: the public prefixes of version {} are not all cached on model {}: {e}",
                            set.version,
                            m.id
                        );
                    }
                    for t in &tenants {
                        m.engine
                            .set_tenant(t.id, set.of(&t.name).tenant_settings(), set.generation)
                            .await;
                    }
                }
            }
            Ok(false) => last_error.clear(),
            Err(e) => {
                let msg = e.to_string();
                if msg != last_error {
                    tracing::warn!(
                        "policies: refused ({msg}); version {} stays in force",
                        state.quotas.set().version
                    );
                    last_error = msg;
                }
            }
        }
    }
}

async fn run(state: Arc<State>, tls: Option<tls::TlsSetup>, listener: TcpListener) -> Result<(), ServeError> {
    let cfg = state.cfg.clone();
    let addr: SocketAddr = listener
        .local_addr()
        .map_err(StartupError::io("the listening socket's address"))?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    // Listening on every address (`0.0.0.0`, `[::]`), the server is reached here on loopback.
    let reach = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::from((Ipv4Addr::LOCALHOST, addr.port())),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::from((Ipv6Addr::LOCALHOST, addr.port())),
        _ => addr,
    };
    let info = ServerInfo {
        url: format!("{scheme}://{reach}"),
        // Absolute: the CLI reads it from wherever it runs.
        cert: tls
            .as_ref()
            .map(|t| t.cert_path.canonicalize().unwrap_or_else(|_| t.cert_path.clone())),
        pid: std::process::id(),
    };
    let info_path = server_info_path(&cfg.data_dir);
    let described = serde_json::to_vec_pretty(&info).map_err(ServeError::ServerInfo)?;
    std::fs::write(&info_path, described).map_err(StartupError::io(format!("writing {}", info_path.display())))?;
    let ids: Vec<&str> = state.models.iter().map(|m| m.id.as_str()).collect();
    tracing::info!("serving {} on {}", ids.join(", "), info.url);
    if reach != addr {
        tracing::info!("listening on every address ({addr}); this machine's CLI reaches it on {reach}");
    }
    state
        .metrics
        .policy(&state.quotas.set().version, state.quotas.reload_failures());
    tokio::spawn(flush_usage(state.clone()));
    tokio::spawn(watch_policies(state.clone()));
    if let Some(t) = &tls {
        tokio::spawn(watch_certificates(t.certificates.clone()));
    }
    tokio::spawn(crate::heap::trim_periodically());
    let acceptor = tls.map(|t| tokio_rustls::TlsAcceptor::from(t.config));
    // The protocol comes from ALPN (plain HTTP is HTTP/1.1 only), so no connection sits in
    // protocol detection, where no timeout would apply.
    let mut h1 = hyper::server::conn::http1::Builder::new();
    h1.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(cfg.timeouts.header_read_s))
        .max_buf_size(cfg.limits.header_bytes.max(8192) + 1024);
    let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs((cfg.timeouts.idle_s / 2).max(1))))
        .keep_alive_timeout(Duration::from_secs(cfg.timeouts.idle_s))
        .max_header_list_size(cfg.limits.header_bytes as u32);
    let (h1, h2) = (Arc::new(h1), Arc::new(h2));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let permits = Arc::new(tokio::sync::Semaphore::new(cfg.limits.max_connections));
    let signal = shutdown_signal();
    tokio::pin!(signal);
    loop {
        let permit = tokio::select! {
            // The semaphore is never closed: a permit always comes.
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut signal => break,
        };
        let Some((tcp, peer)) = accept(&listener, signal.as_mut()).await else {
            break;
        };
        let _ = tcp.set_nodelay(true);
        let (state, h1, h2, acceptor) = (state.clone(), h1.clone(), h2.clone(), acceptor.clone());
        let watcher = graceful.watcher();
        let handshake = Duration::from_secs(cfg.timeouts.handshake_s);
        tokio::spawn(async move {
            let _permit = permit;
            let svc = service_fn(move |req| http::handle(state.clone(), peer.ip(), req));
            match acceptor {
                Some(acceptor) => {
                    let Ok(Ok(tls)) = tokio::time::timeout(handshake, acceptor.accept(tcp)).await else {
                        return;
                    };
                    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
                        let _ = watcher.watch(h2.serve_connection(TokioIo::new(tls), svc)).await;
                    } else {
                        let _ = watcher.watch(h1.serve_connection(TokioIo::new(tls), svc)).await;
                    }
                }
                None => {
                    let _ = watcher.watch(h1.serve_connection(TokioIo::new(tcp), svc)).await;
                }
            }
        });
    }
    tracing::info!(
        "shutting down: finishing in-flight requests (up to {} s)",
        cfg.timeouts.shutdown_s
    );
    state.shutting_down.store(true, std::sync::atomic::Ordering::SeqCst);
    drop(listener);
    let deadline = Instant::now() + Duration::from_secs(cfg.timeouts.shutdown_s);
    let mut engines = tokio::task::JoinSet::new();
    for m in &state.models {
        let e = m.engine.clone();
        engines.spawn(async move { e.shutdown(deadline).await });
    }
    engines.join_all().await;
    // Streams have ended; give connections a moment to send their last bytes.
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    state.quotas.usage.flush()?;
    state.store.flush()?;
    let _ = std::fs::remove_file(server_info_path(&cfg.data_dir));
    tracing::info!("stopped");
    Ok(())
}
