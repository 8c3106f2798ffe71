//! A node's operations endpoint, on `[cluster] ops_listen` (plain HTTP/1.1, off by default), for
//! an orchestrator's probes and a metrics scraper: `GET /healthz` (its engine runs),
//! `GET /readyz` (it is not shutting down) and `GET /metrics` (its registry,
//! with the metrics token as `Authorization: Bearer`). It serves nothing else: the cluster's
//! work crosses the cluster listener only. Connections are bounded, as is the time a request's
//! head may take.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

use crate::config::ServeConfig;
use crate::metrics::Metrics;
use crate::net::Conns;
use crate::runner::StartupError;

/// Connections the endpoint serves at once, and of them from one peer address.
const MAX_CONNECTIONS: usize = 64;
const MAX_PER_PEER: usize = 4;

/// What the endpoint reads.
pub struct Ops {
    metrics: Arc<Metrics>,
    /// Whether the node's engine runs (else `/healthz` fails, and an orchestrator restarts it).
    alive: Box<dyn Fn() -> bool + Send + Sync>,
    /// Whether the node takes work (its engine runs, it is not shutting down).
    ready: Box<dyn Fn() -> bool + Send + Sync>,
    /// SHA-256 of the metrics token.
    token: [u8; 32],
}

fn sha256(b: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(b).into()
}

impl Ops {
    /// The endpoint's state, with the metrics token: `[metrics] token_file`'s, else the one kept
    /// in `data_dir/metrics-token` (made there, mode 0600, when missing).
    pub fn new(
        cfg: &ServeConfig,
        metrics: Arc<Metrics>,
        alive: Box<dyn Fn() -> bool + Send + Sync>,
        ready: Box<dyn Fn() -> bool + Send + Sync>,
    ) -> Result<Self, StartupError> {
        let token = match cfg.metrics.token().map_err(|e| StartupError::Config(e.to_string()))? {
            Some(t) => t,
            None => kept_token(&cfg.data_dir)?,
        };
        Ok(Self {
            metrics,
            alive,
            ready,
            token: sha256(token.as_bytes()),
        })
    }

    fn answer(&self, req: &Request<Incoming>) -> (StatusCode, String) {
        if req.method() != Method::GET {
            return (StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
        }
        match req.uri().path() {
            "/healthz" if (self.alive)() => (StatusCode::OK, "ok\n".into()),
            "/healthz" => (StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped\n".into()),
            "/readyz" if (self.ready)() => (StatusCode::OK, "ready\n".into()),
            "/readyz" => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".into()),
            "/metrics" => {
                let given = req
                    .headers()
                    .get(hyper::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.split_once(' '))
                    .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                    .map(|(_, t)| sha256(t.trim().as_bytes()));
                match given {
                    Some(h) if bool::from(h.ct_eq(&self.token)) => (StatusCode::OK, self.metrics.render()),
                    _ => (
                        StatusCode::UNAUTHORIZED,
                        "this endpoint needs the metrics token: send Authorization: Bearer <token>\n".into(),
                    ),
                }
            }
            _ => (StatusCode::NOT_FOUND, "not found\n".into()),
        }
    }
}

/// The node's own metrics token, in `data_dir/metrics-token`.
fn kept_token(data_dir: &Path) -> Result<String, StartupError> {
    let path = data_dir.join("metrics-token");
    if let Ok(t) = std::fs::read_to_string(&path)
        && t.trim().len() >= crate::config::MIN_METRICS_TOKEN
    {
        return Ok(t.trim().to_string());
    }
    std::fs::create_dir_all(data_dir).map_err(StartupError::io(format!("creating {}", data_dir.display())))?;
    let bytes: [u8; 32] = rand::random();
    let token = format!("wmet-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>());
    crate::pem::write_private(&path, format!("{token}\n").as_bytes())
        .map_err(StartupError::io(format!("writing {}", path.display())))?;
    Ok(token)
}

/// Serves the endpoint on `listener` until the task is dropped. A connection never waits for a
/// slot: with all taken, the oldest of the peer holding the most is closed ([`Conns`]), so a
/// probe is answered at once however many slow peers hold connections.
pub async fn serve(listener: TcpListener, ops: Arc<Ops>) {
    let conns = Conns::new(MAX_CONNECTIONS, MAX_PER_PEER);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(mut slot) = conns.admit(peer.ip()) else {
            continue;
        };
        let ops = ops.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (status, text) = ops.answer(&req);
                let mut r = Response::new(Full::new(Bytes::from(text)));
                *r.status_mut() = status;
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                async move { Ok::<_, Infallible>(r) }
            });
            let mut h1 = hyper::server::conn::http1::Builder::new();
            h1.timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(2))
                .keep_alive(false);
            let serve = tokio::time::timeout(Duration::from_secs(10), h1.serve_connection(TokioIo::new(tcp), svc));
            tokio::select! {
                _ = serve => {}
                () = slot.evicted() => {}
            }
        });
    }
}

/// Binds `addr` for the endpoint.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, StartupError> {
    TcpListener::bind(addr)
        .await
        .map_err(StartupError::io(format!("listening on {addr} (cluster.ops_listen)")))
}
