//! A prefill or decode node: a model, an engine thread with its KV pool, and a listener for the
//! router and for other nodes (loopback peers only, or mutual TLS).
//!
//! A decode node serves one request per router connection: it admits and opens it (a refusal
//! ends it there, before any transfer), asks the named prefill node for the prompt's KV on a
//! connection of its own, feeds each frame to the engine thread (which verifies and writes it,
//! answering the acknowledgement), and streams the tokens back. A prefill node computes the
//! prompt and sends its KV on the connection it was asked on, keeping its pages until the final
//! acknowledgement. Either connection's end ends the request through the engine's retirement
//! path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use super::link::{self, CallError, Dispatch, Ended, Incoming, KvCall, KvReply, Msg, Packet, Transport, WriteHalf};
use super::{Disagreement, NodeInfo};
use crate::config::Role;
use crate::config::ServeConfig;
use crate::engine::constraint::{Constraint, ConstraintError};
use crate::engine::request::{AbortReason, Outcome, RejectReason, RequestId, Usage};
use crate::grammar::{Format, GrammarLimits, Grammars, TenantGrammars};
use crate::kv::KvPool;
use crate::loaded::LoadedModel;
use crate::metrics::Metrics;
use crate::plugin::KvAccessError;
use crate::runner::{
    EndFlag, EngineHandle, Job, KvQuery, LocalEngine, Opening, PrefillJob, SeqSlot, StartupError, Update,
    outcome_label, start_engine,
};
use crate::tenant::TenantId;
use crate::transfer::MAX_PAGES_PER_BATCH;
use crate::transfer::wire::Frame;

/// Largest frame a node reads where only acknowledgements and aborts belong.
const ANSWER_FRAME_LIMIT: usize = 64 << 10;

/// How long a decode node waits for the next frame of a transfer (the prompt may queue on the
/// prefill node first) before it fails the request.
const TRANSFER_IDLE: Duration = Duration::from_secs(120);

struct Node {
    info: NodeInfo,
    /// The model's vocabulary for output constraints, which a dispatch carries as their source:
    /// compiled per tenant, as on the router.
    grammars: Arc<TenantGrammars>,
    metrics: Arc<Metrics>,
    engine: LocalEngine,
    /// Bytes of one full page's K and V: the unit of a batch's size limit.
    page_bytes: usize,
    queue: usize,
    /// How its connections are taken and made: plain on loopback, or mutual TLS.
    transport: Transport,
    /// Where it listens (set once bound), for messages that name it.
    addr: std::sync::OnceLock<std::net::SocketAddr>,
    /// Connections refused: counted, and logged at most once a second.
    refusals: Refusals,
}

/// A node's line for one request, written when its connection's work ends (target
/// `warden::cluster::request`): the request id the router gave it (the same as in the router's
/// access line), the tenant by id, how it ended, and its time on this node. No text.
struct RequestLine {
    role: Role,
    request_id: String,
    tenant: TenantId,
    started: Instant,
    outcome: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl RequestLine {
    fn new(role: Role, d: &Dispatch) -> Self {
        Self {
            role,
            request_id: d.req.request_id.clone(),
            tenant: d.req.owner,
            started: Instant::now(),
            outcome: "peer_closed",
            prompt_tokens: d.req.prompt.len(),
            completion_tokens: 0,
        }
    }
}

impl Drop for RequestLine {
    fn drop(&mut self) {
        tracing::info!(
            target: "warden::cluster::request",
            role = %self.role,
            request_id = %self.request_id,
            tenant = %self.tenant,
            outcome = self.outcome,
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.completion_tokens,
            duration_ms = self.started.elapsed().as_secs_f64() * 1e3,
            "request"
        );
    }
}

/// Handshakes a node runs at once, and of them from one peer address; connections past either
/// are dropped.
const MAX_HANDSHAKES: usize = 64;
const MAX_HANDSHAKES_PER_PEER: usize = 8;

/// Refused connections: each counted in `warden_cluster_refused_connections_total`, and logged
/// at most once a second (with how many went unlogged), so a port scan or a flood of foreign
/// peers cannot flood the log.
struct Refusals {
    metrics: Arc<Metrics>,
    last: std::sync::Mutex<(Option<Instant>, u64)>,
}

impl Refusals {
    fn note(&self, peer: std::net::SocketAddr, why: &std::io::Error) {
        self.metrics.cluster_refused();
        let mut g = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let (last, unlogged) = &mut *g;
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            *unlogged += 1;
            return;
        }
        tracing::warn!(target: "warden::cluster", %peer, unlogged = *unlogged, "refused a connection: {why}");
        *last = Some(Instant::now());
        *unlogged = 0;
    }
}

/// Runs a prefill or decode node until SIGTERM or SIGINT.
pub fn serve_node(cfg: ServeConfig, role: Role) -> Result<(), StartupError> {
    let mut served = cfg.served();
    if served.len() != 1 {
        return Err(StartupError::Config(format!(
            "a {role} node serves one model, and this configuration names {} ([[models]]): give each model its own nodes; the router serves them all",
            served.len()
        )));
    }
    let served = served.remove(0);
    // The cluster's certificates before the model: a bad file fails in a moment.
    let transport = Transport::new(&cfg.cluster).map_err(|e| StartupError::Config(format!("cluster TLS: {e}")))?;
    let loaded = LoadedModel::open(&served.path)?;
    let engine = start_engine(&cfg, &served, &loaded)?;
    let digest =
        super::file_digest(&served.path).map_err(StartupError::io(format!("reading {}", served.path.display())))?;
    let limits = engine.limits();
    let info = NodeInfo {
        role,
        model: served.name.clone(),
        digest,
        page_size: cfg.kv.page_size,
        max_context: limits.max_context,
        vocab: limits.vocab,
        pool_tokens: limits.pool_tokens,
        pages: engine.kv_counters().pages_total,
        pinnable_pages: engine.pinnable_pages(),
    };
    let page_bytes = KvPool::page_bytes(engine.pool().shape(), engine.pool().n_layers());
    let limits = GrammarLimits {
        max_schema_bytes: cfg.limits.max_schema_bytes,
        compile_ms: cfg.limits.schema_compile_ms,
        memory_bytes: cfg.limits.schema_compile_mib << 20,
    };
    let grammars = Arc::new(Grammars::new(loaded.tokenizer.clone(), limits));
    if role == Role::Decode {
        // The vocabulary's token trie, off the start path.
        let warm = grammars.clone();
        std::thread::spawn(move || warm.warm());
    }
    // This binary checks formats in child processes.
    let exe = std::env::current_exe().map_err(StartupError::io("finding the warden binary"))?;
    let grammars = Arc::new(TenantGrammars::new(
        grammars,
        &exe,
        cfg.limits.schema_compiles,
        cfg.limits.schema_cache_mib << 20,
    ));
    let metrics = Arc::new(Metrics::default());
    let handle = LocalEngine::start(engine, served.limits.queue, metrics.model(&served.name))
        .map_err(StartupError::io("starting the engine thread"))?;
    let refusals_metrics = metrics.clone();
    let node = Arc::new(Node {
        info,
        grammars,
        metrics,
        engine: handle,
        page_bytes,
        transport,
        addr: std::sync::OnceLock::new(),
        refusals: Refusals {
            metrics: refusals_metrics,
            last: std::sync::Mutex::new((None, 0)),
        },
        queue: served.limits.queue,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("warden-node")
        .build()
        .map_err(StartupError::io("starting the node's runtime"))?;
    rt.block_on(run(node, cfg))
}

async fn run(node: Arc<Node>, cfg: ServeConfig) -> Result<(), StartupError> {
    let listener = TcpListener::bind(cfg.cluster.listen)
        .await
        .map_err(StartupError::io(format!(
            "listening on {} (cluster.listen)",
            cfg.cluster.listen
        )))?;
    let addr = listener
        .local_addr()
        .map_err(StartupError::io("the listening socket's address"))?;
    let _ = node.addr.set(addr);
    // Probes and metrics over HTTP, where configured: ready while the engine runs and until
    // shutdown begins.
    let shutting_down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(at) = cfg.cluster.ops_listen {
        let (n, down) = (node.clone(), shutting_down.clone());
        let ready = Box::new(move || n.engine.is_alive() && !down.load(std::sync::atomic::Ordering::SeqCst));
        let n = node.clone();
        let alive = Box::new(move || n.engine.is_alive());
        let ops = Arc::new(super::ops::Ops::new(&cfg, node.metrics.clone(), alive, ready)?);
        let listener = super::ops::bind(at).await?;
        let bound = listener
            .local_addr()
            .map_err(StartupError::io("the operations socket's address"))?;
        tracing::info!("{} node: probes and metrics on http://{bound}", node.info.role);
        tokio::spawn(super::ops::serve(listener, ops));
    }
    tracing::info!(
        "{} node serving {} on {addr} (pool: {} pages of {} tokens, max context {}; {})",
        node.info.role,
        node.info.model,
        node.info.pages,
        node.info.page_size,
        node.info.max_context,
        if node.transport.is_mutual_tls() {
            "mutual TLS"
        } else {
            "plain TCP, loopback only"
        }
    );
    tokio::spawn(crate::heap::trim_periodically());
    let signal = crate::net::shutdown_signal();
    tokio::pin!(signal);
    // Open connections are bounded (each request holds one or two), and so are handshakes in
    // progress, which anyone who reaches the port can start: past that, a new one is dropped.
    let open = Arc::new(tokio::sync::Semaphore::new(cfg.limits.max_connections));
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    let per_peer = crate::net::PerPeer::new(MAX_HANDSHAKES_PER_PEER);
    loop {
        let permit = tokio::select! {
            p = open.clone().acquire_owned() => p,
            _ = signal.as_mut() => break,
        };
        let Ok(permit) = permit else { break };
        let Some((tcp, peer)) = crate::net::accept(&listener, signal.as_mut()).await else {
            break;
        };
        let (node, handshakes, per_peer) = (node.clone(), handshakes.clone(), per_peer.clone());
        tokio::spawn(async move {
            let _open = permit;
            let halves = match (handshakes.try_acquire(), per_peer.try_take(peer.ip())) {
                (Ok(_shaking), Some(_slot)) => node.transport.accept(tcp, peer).await,
                (Err(_), _) => Err(std::io::Error::other("too many handshakes in progress")),
                (_, None) => Err(std::io::Error::other(
                    "too many handshakes in progress from this address",
                )),
            };
            match halves {
                Ok((r, w)) => connection(node, r, w).await,
                // Mutual TLS: a peer the cluster's CA did not certify for the cluster is refused
                // here, before anything it sent is read. Plain: loopback peers only.
                Err(e) => node.refusals.note(peer, &e),
            }
        });
    }
    shutting_down.store(true, std::sync::atomic::Ordering::SeqCst);
    tracing::info!(
        "shutting down: finishing in-flight requests (up to {} s)",
        cfg.timeouts.shutdown_s
    );
    drop(listener);
    node.engine
        .shutdown(Instant::now() + Duration::from_secs(cfg.timeouts.shutdown_s))
        .await;
    tracing::info!("stopped");
    Ok(())
}

/// The next message, or `None` for anything else (the peer closed, sent a frame, or broke
/// the framing).
async fn next_msg(rx: &mut Incoming) -> Option<Msg> {
    match rx.recv().await {
        Some(Ok(Packet::Msg(m))) => Some(m),
        _ => None,
    }
}

async fn refuse(w: &mut WriteHalf, message: String) {
    let _ = link::send(w, &Msg::Error { message }).await;
}

async fn connection(node: Arc<Node>, r: link::ReadHalf, mut w: WriteHalf) {
    let mut rx = link::reader(r, ANSWER_FRAME_LIMIT);
    let hello = tokio::time::timeout(node.transport.peer_timeout(), next_msg(&mut rx));
    match hello.await.ok().flatten() {
        Some(Msg::Hello { version }) if version == link::VERSION => {}
        Some(Msg::Hello { version }) => {
            return refuse(
                &mut w,
                format!("protocol version {version}; this node speaks {}", link::VERSION),
            )
            .await;
        }
        _ => return refuse(&mut w, "a connection opens with hello".into()).await,
    }
    let first = tokio::time::timeout(node.transport.peer_timeout(), next_msg(&mut rx));
    let Some(m) = first.await.ok().flatten() else {
        return;
    };
    let role = node.info.role;
    // A node whose engine stopped takes no work: the router's probe takes it out.
    if !node.engine.is_alive() {
        return refuse(&mut w, "this node's engine has stopped".into()).await;
    }
    let answer = match (role, m) {
        (_, Msg::Describe) => Msg::Info(node.info.clone()),
        (_, Msg::Metrics) => Msg::MetricsText {
            text: node.metrics.render(),
        },
        (Role::Decode, Msg::Generate(d)) => return decode(&node, *d, rx, w).await,
        (Role::Prefill, Msg::Prefill(d)) => return prefill(&node, *d, rx, w).await,
        (
            _,
            Msg::Tenant {
                owner,
                settings,
                generation,
            },
        ) => {
            node.engine.set_tenant(owner, settings, generation).await;
            Msg::Applied { error: None }
        }
        (Role::Prefill, Msg::PublicPrefixes { prefixes }) => Msg::Applied {
            error: node
                .engine
                .set_public_prefixes(prefixes)
                .await
                .err()
                .map(|e| e.to_string()),
        },
        (_, Msg::Forget { owner }) => {
            node.engine.forget_tenant(owner).await;
            node.grammars.forget(owner);
            Msg::Applied { error: None }
        }
        (role, m) => {
            let kind = serde_json::to_value(&m)
                .ok()
                .and_then(|v| v.get("type").and_then(|t| t.as_str().map(String::from)))
                .unwrap_or_default();
            return refuse(&mut w, format!("a {role} node does not take {kind}")).await;
        }
    };
    let _ = link::send(&mut w, &answer).await;
}

/// How a request ended, as the router is told.
fn ended(outcome: &Outcome) -> Ended {
    match outcome {
        Outcome::Finished(f) => Ended::Finished(*f),
        Outcome::Aborted(AbortReason::Cancelled) => Ended::Cancelled,
        Outcome::Aborted(AbortReason::Shutdown) => Ended::Shutdown,
        Outcome::Aborted(AbortReason::Transfer(why)) => Ended::Transfer(why.clone()),
        // The router makes the same error of the reason alone.
        Outcome::Aborted(r @ AbortReason::Constraint(ConstraintError::Failed(why))) => Ended::Failed {
            code: r.code().to_string(),
            message: why.clone(),
        },
        Outcome::Aborted(r) => Ended::Failed {
            code: r.code().to_string(),
            message: r.client_message(),
        },
    }
}

/// The prefill connection of a decode request, while its transfer runs.
struct Upstream {
    rx: Incoming,
    w: WriteHalf,
    /// The prefill node's name for the sequence (from `Begin`), for the frames sent back.
    seq: u64,
}

async fn next_upstream(up: &mut Option<Upstream>) -> Option<Result<Packet, link::LinkError>> {
    match up {
        Some(u) => u.rx.recv().await,
        None => std::future::pending().await,
    }
}

/// A decode node's request: admit and open it, fetch its prompt's KV, stream its tokens.
async fn decode(node: &Node, d: Dispatch, mut router: Incoming, mut w: WriteHalf) {
    let mut line = RequestLine::new(Role::Decode, &d);
    if let Err(why) = agrees(node, &d) {
        line.outcome = "refused";
        return refuse(&mut w, why.to_string()).await;
    }
    let owner = d.req.owner;
    // What crosses the link is checked again, against this node's model and pool.
    let mut req = match d.req.clone().validate(&node.engine.admission()) {
        Ok(req) => req,
        Err(rej) => {
            line.outcome = "rejected";
            let _ = link::send(&mut w, &Msg::Rejected { reason: rej.reason }).await;
            return;
        }
    };
    // Its output constraint, compiled against this node's vocabulary as the router compiled it.
    if d.format != Format::Text {
        match compile(node, owner, &d.format).await {
            Ok(c) => req = req.with_constraint(Some(c)),
            Err(e) => {
                line.outcome = "constraint_failed";
                let done = Msg::Done {
                    ended: ended(&Outcome::Aborted(AbortReason::Constraint(e))),
                    text: String::new(),
                    usage: Usage::default(),
                };
                let _ = link::send(&mut w, &done).await;
                return;
            }
        }
    }
    // Its plugin's verdicts arrive from the router, each before its next token is computed.
    let steer = d.steer.clone().map(|s| Arc::new(s.start()));
    if let Some(s) = &steer {
        req = req.with_steer(s.clone());
    }
    let (tx, mut updates) = mpsc::unbounded_channel();
    let stop = Arc::new(EndFlag::default());
    let job = Job {
        req,
        format: d.format.clone(),
        tenant: owner.to_string(),
        index: 0,
        tx,
        stop: stop.clone(),
        slot: Arc::new(SeqSlot::default()),
        settings: d.settings,
        policy_generation: d.generation,
        grant: None,
    };
    let (admitted, answer) = oneshot::channel();
    let (ready, mut opened) = oneshot::channel();
    if node.engine.open(job, Opening { admitted, ready }).is_err() {
        line.outcome = "queue_full";
        let reason = RejectReason::QueueFull { limit: node.queue };
        let _ = link::send(&mut w, &Msg::Rejected { reason }).await;
        return;
    }
    let id = match answer.await {
        Ok(Ok(id)) => id,
        Ok(Err(rej)) => {
            line.outcome = "rejected";
            let _ = link::send(&mut w, &Msg::Rejected { reason: rej.reason }).await;
            return;
        }
        Err(_) => {
            line.outcome = "shutting_down";
            let done = Msg::Done {
                ended: Ended::Shutdown,
                text: String::new(),
                usage: Usage::default(),
            };
            let _ = link::send(&mut w, &done).await;
            return;
        }
    };
    if link::send(&mut w, &Msg::Opened { id }).await.is_err() {
        return;
    }
    // The prefill node is asked once this node's pages are open: a full pool holds the request
    // in the queue here, not as computed KV on the prefill node.
    let mut up: Option<Upstream> = None;
    let mut waiting = true;
    let (kv_tx, mut kv_rx) = mpsc::unbounded_channel::<(u64, KvReply)>();
    let idle = tokio::time::sleep(TRANSFER_IDLE);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            r = &mut opened, if waiting => {
                waiting = false;
                // Without a sender, the request ended first; its Done is on the way.
                if r.is_ok() {
                    match ask_prefill(node, &d).await {
                        Ok(u) => {
                            idle.as_mut().reset(tokio::time::Instant::now() + TRANSFER_IDLE);
                            up = Some(u);
                        }
                        Err(e) => node.engine.transfer_failed(id, unreachable_prefill(e)).await,
                    }
                }
            }
            () = &mut idle, if up.is_some() => {
                up = None;
                let why = format!("no transfer frame from the prefill node in {} s", TRANSFER_IDLE.as_secs());
                node.engine.transfer_failed(id, why).await;
            }
            p = next_upstream(&mut up) => {
                idle.as_mut().reset(tokio::time::Instant::now() + TRANSFER_IDLE);
                let Some(u) = up.as_mut() else { continue };
                let failed = match p {
                    Some(Ok(Packet::Frame(f))) => {
                        if let Frame::Begin { seq, .. } = f {
                            u.seq = seq;
                        }
                        match node.engine.transfer_frame(id, f).await {
                            Ok(None) => None,
                            Ok(Some(r)) => {
                                let sent = link::send_frame(&mut u.w, &r.ack).await;
                                if r.complete {
                                    // The prefill node lets its pages go on this Ack.
                                    up = None;
                                }
                                sent.err().map(|e| format!("answering the prefill node: {e}"))
                            }
                            Err(why) => {
                                let reason = why.to_string();
                                let _ = link::send_frame(&mut u.w, &Frame::Abort { seq: u.seq, reason }).await;
                                up = None;
                                None
                            }
                        }
                    }
                    Some(Ok(Packet::Msg(Msg::Error { message }))) => Some(format!("the prefill node refused: {message}")),
                    Some(Ok(Packet::Msg(_))) => Some("the prefill node sent a message where a frame was due".into()),
                    Some(Err(e)) => Some(format!("from the prefill node: {e}")),
                    None => Some("the prefill node closed the connection before the transfer ended".into()),
                };
                if let Some(why) = failed {
                    up = None;
                    node.engine.transfer_failed(id, why).await;
                }
            }
            p = router.recv() => match p {
                Some(Ok(Packet::Msg(Msg::End { stop: s }))) => {
                    if s { stop.stop() } else { stop.cancel() }
                }
                Some(Ok(Packet::Msg(Msg::Kv { call, query }))) => ask_kv(node, id, owner, call, query, kv_tx.clone()),
                Some(Ok(Packet::Msg(Msg::Verdict { next }))) => match &steer {
                    Some(s) => s.answer(next),
                    None => return refuse(&mut w, "a verdict for a request that is not steered".into()).await,
                },
                // The router went away (its client did) or broke the protocol: returning drops
                // the request's channel, and the engine cancels it.
                _ => return,
            },
            u = updates.recv() => {
                let msg = match u {
                    Some((_, Update::Token { text, token, logprobs })) => {
                        if link::send(&mut w, &Msg::Token { token, text, logprobs }).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Some((_, Update::Done { outcome, text, usage })) => {
                        line.outcome = outcome_label(&outcome);
                        (line.prompt_tokens, line.completion_tokens) = (usage.prompt_tokens, usage.completion_tokens);
                        Msg::Done { ended: ended(&outcome), text, usage }
                    }
                    Some((_, Update::Rejected(r))) => {
                        line.outcome = "rejected";
                        Msg::Rejected { reason: r.reason }
                    }
                    Some((_, Update::Failed(e))) => {
                        line.outcome = e.code();
                        Msg::Done {
                            ended: Ended::Failed { code: e.code().into(), message: e.to_string() },
                            text: String::new(),
                            usage: Usage::default(),
                        }
                    }
                    Some((_, Update::ShuttingDown)) | None => {
                        line.outcome = "shutting_down";
                        Msg::Done {
                            ended: Ended::Shutdown,
                            text: String::new(),
                            usage: Usage::default(),
                        }
                    }
                };
                let _ = link::send(&mut w, &msg).await;
                return;
            }
            Some((call, answer)) = kv_rx.recv() => {
                if link::send(&mut w, &Msg::KvAnswer { call, answer }).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Compiles a dispatch's output `format` for its tenant `owner` (as the router does: in the
/// tenant's turn, checked in a child process within the configured time and memory, kept for
/// the tenant's next request; the vocabulary's trie, built once, is not counted): the
/// constraint, or why not.
async fn compile(node: &Node, owner: TenantId, format: &Format) -> Result<Constraint, ConstraintError> {
    let warm = node.grammars.grammars().clone();
    let _ = tokio::task::spawn_blocking(move || warm.warm()).await;
    let why = match node.grammars.compile(owner, format).await {
        Ok(Some(c)) => return Ok(c),
        Ok(None) => "the output format constrains nothing".to_string(),
        Err(e) => format!("compiling the output format on the decode node: {e}"),
    };
    Err(ConstraintError::Failed(why))
}

/// Why a decode node's request could not reach its prefill node, as the request ends with it.
fn unreachable_prefill(e: CallError) -> String {
    match e {
        CallError::Connect { addr, cause } => format!("connecting to the prefill node {addr}: {cause}"),
        CallError::Write { addr, cause } => format!("writing to the prefill node {addr}: {cause}"),
        e => format!("the prefill node: {e}"),
    }
}

/// Asks the dispatch's prefill node for the prompt's KV.
async fn ask_prefill(node: &Node, d: &Dispatch) -> Result<Upstream, CallError> {
    let (r, w) = node
        .transport
        .open(&d.prefill, &Msg::Prefill(Box::new(d.clone())))
        .await?;
    // A batch holds at most `pages_per_batch` pages: anything larger is refused unread.
    let pages = d.limits.pages_per_batch.clamp(1, MAX_PAGES_PER_BATCH);
    let limit = pages * (node.page_bytes + 64) + 1024;
    Ok(Upstream {
        rx: link::reader(r, limit),
        w,
        seq: 0,
    })
}

/// Answers a plugin's KV question about the connection's own request `id` of `owner`.
fn ask_kv(
    node: &Node,
    id: RequestId,
    owner: TenantId,
    call: u64,
    query: KvCall,
    out: mpsc::UnboundedSender<(u64, KvReply)>,
) {
    let engine = node.engine.clone();
    tokio::spawn(async move {
        let answer = match query {
            KvCall::Pages => {
                let (reply, rx) = oneshot::channel();
                let asked = engine.ask(KvQuery::Pages { id, owner, reply });
                let pages = if asked { rx.await.ok().flatten() } else { None };
                KvReply::Pages(pages)
            }
            KvCall::Info(page) => {
                let (reply, rx) = oneshot::channel();
                let r = if engine.ask(KvQuery::Info { owner, page, reply }) {
                    rx.await.unwrap_or(Err(KvAccessError::Stopped))
                } else {
                    Err(KvAccessError::Busy)
                };
                KvReply::Info(r)
            }
            KvCall::Pin(tokens) => {
                let (reply, rx) = oneshot::channel();
                let r = if engine.ask(KvQuery::Pin {
                    id,
                    owner,
                    tokens,
                    reply,
                }) {
                    rx.await.unwrap_or(Err(KvAccessError::Stopped))
                } else {
                    Err(KvAccessError::Busy)
                };
                KvReply::Count(r)
            }
            KvCall::Unpin => {
                let (reply, rx) = oneshot::channel();
                let r = if engine.ask(KvQuery::Unpin { id, owner, reply }) {
                    rx.await.unwrap_or(Err(KvAccessError::Stopped))
                } else {
                    Err(KvAccessError::Busy)
                };
                KvReply::Count(r)
            }
        };
        let _ = out.send((call, answer));
    });
}

/// Whether this node serves what the request's cluster agreed on (a node restarted with another
/// model, page size or context refuses work until the router's probe takes it out).
fn agrees(node: &Node, d: &Dispatch) -> Result<(), Disagreement> {
    let addr = node
        .addr
        .get()
        .copied()
        .unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    d.agreed.check(&node.info, &addr)
}

/// A prefill node's request: compute the prompt and send its KV on this connection, until the
/// decode node's final acknowledgement (or its going away) lets the pages go.
async fn prefill(node: &Node, d: Dispatch, mut decode: Incoming, mut w: WriteHalf) {
    let mut line = RequestLine::new(Role::Prefill, &d);
    let refused = |reason: String| Frame::Abort { seq: 0, reason };
    if let Err(why) = agrees(node, &d) {
        line.outcome = "refused";
        let _ = link::send_frame(&mut w, &refused(why.to_string())).await;
        return;
    }
    let (frames_tx, mut frames) = mpsc::unbounded_channel();
    let mut limits = d.limits;
    limits.pages_per_batch = limits.pages_per_batch.clamp(1, MAX_PAGES_PER_BATCH);
    let req = match d.req.validate(&node.engine.admission()) {
        Ok(req) => req,
        Err(rej) => {
            line.outcome = "rejected";
            let why = format!("the prefill node refused the request: {}", rej.reason);
            let _ = link::send_frame(&mut w, &refused(why)).await;
            return;
        }
    };
    let job = PrefillJob {
        req,
        settings: d.settings,
        policy_generation: d.generation,
        limits,
        frames: frames_tx,
    };
    #[cfg(feature = "transfer-faults")]
    let mut fault = super::faults::Injector::new(d.fault);
    let (admitted, answer) = oneshot::channel();
    if node.engine.prefill(job, admitted).is_err() {
        line.outcome = "queue_full";
        let _ = link::send_frame(&mut w, &refused("the prefill node's queue is full".into())).await;
        return;
    }
    let id = match answer.await {
        Ok(Ok(id)) => id,
        Ok(Err(rej)) => {
            let why = format!("the prefill node refused the request: {}", rej.reason);
            let _ = link::send_frame(&mut w, &refused(why)).await;
            return;
        }
        Err(_) => {
            line.outcome = "shutting_down";
            let _ = link::send_frame(&mut w, &refused("the prefill node is shutting down".into())).await;
            return;
        }
    };
    loop {
        tokio::select! {
            f = frames.recv() => match f {
                Some(f) => {
                    #[cfg(feature = "transfer-faults")]
                    let sent = fault.send(&mut w, f).await;
                    #[cfg(not(feature = "transfer-faults"))]
                    let sent = link::send_frame(&mut w, &f).await;
                    if sent.is_err() {
                        return;
                    }
                }
                // The engine is done with the transfer: acknowledged, or failed (its Abort sent).
                None => {
                    // Acknowledged or failed: warden_transfers_total{outcome} says which.
                    line.outcome = "transfer_ended";
                    return;
                }
            },
            p = decode.recv() => match p {
                Some(Ok(Packet::Frame(f))) => node.engine.transfer_answer(id, f).await,
                // The decode node went away: returning closes the frames channel, and the
                // engine ends the request and lets its pages go.
                _ => return,
            },
        }
    }
}
