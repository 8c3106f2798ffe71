//! The router's engine: the cluster's nodes behind [`crate::runner::EngineHandle`] ([`RouterEngine`]).
//!
//! At start it asks every configured node what it serves, and gives each of its models a
//! [`Router`] over the nodes that serve that model's file: it refuses to serve while a model has
//! no prefill or no decode node, a node serves none of its models, or the nodes of one model
//! disagree on the page size or the maximum context. Each job (one choice of an admitted
//! request) then gets a connection to a decode node, naming the prefill node for its prompt; the
//! decode node's messages become the job's updates, the job's usage is booked from its `Done`,
//! and the job's end (its client gone, its plugin's stop) reaches the node as the connection's
//! end or an `End` message. Nodes are picked round-robin.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc, oneshot, watch};

use super::NodeInfo;
use super::health::Health;
use super::link::{self, CallError, Dispatch, Ended, KvCall, KvReply, Msg, Packet, Transport};
use crate::config::Role;
use crate::config::{ClusterConfig, NodeAddr};
use crate::engine::TenantSettings;
use crate::engine::constraint::ConstraintError;
use crate::engine::request::{AbortReason, AdmissionLimits, Outcome, Rejected, Usage};
use crate::engine::steer::TokenConstraint;
use crate::kv::{PageHandle, PageInfo};
use crate::metrics::{Metrics, ModelMetrics};
use crate::plugin::KvAccessError;
use crate::runner::{
    Busy, End, EngineCallError, EngineFuture, EngineHandle, Job, KvQuery, Update, UsageMeter, outcome_label,
};
use crate::tenant::TenantId;
use crate::transfer::Limits;

/// One model's part of the cluster, as the router sees it.
pub struct Router {
    prefill: Vec<NodeAddr>,
    decode: Vec<NodeAddr>,
    /// Which of them are up.
    health: Arc<Health>,
    /// How connections to them are made.
    transport: Transport,
    next: AtomicUsize,
    limits: Limits,
    metrics: ModelMetrics,
    in_flight: AtomicUsize,
    idle: Notify,
    /// Raised when shutdown's deadline passes: jobs still running end.
    closing: watch::Sender<bool>,
    /// What every node of the model agreed on.
    agreed: NodeInfo,
    /// The smallest pool's figures.
    smallest: NodeInfo,
    /// Faults to inject, by tenant name (`transfer-faults` builds only).
    #[cfg(feature = "transfer-faults")]
    faults: HashMap<String, super::link::Fault>,
}

/// Why a router could not form its cluster.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The cluster's certificates (`[cluster] ca`, `cert`, `key`) do not load.
    #[error("cluster TLS: {0}")]
    Tls(#[from] crate::pem::TlsError),
    /// The configuration names no prefill or no decode node.
    #[error("a router needs at least one prefill and one decode node: set cluster.prefill and cluster.decode")]
    NoNodes,
    /// A node has another role than the configuration gives it.
    #[error("{addr} is configured as a {configured} node but is a {actual} node")]
    WrongRole {
        /// The node.
        addr: NodeAddr,
        /// Its role in the configuration.
        configured: Role,
        /// The role it says it has.
        actual: Role,
    },
    /// A node serves a model file that is none of the router's.
    #[error(
        "{node} serves a model file that is none of the router's (theirs: {digests}): every node serves one of the router's models"
    )]
    OtherModel {
        /// The node, described.
        node: String,
        /// The starts of the router's models' digests.
        digests: String,
    },
    /// One of the router's models has no node of a role.
    #[error(
        "no {role} node serves model {model} (sha256 {digest}): a router serves a model only when a prefill and a decode node serve its file"
    )]
    Unserved {
        /// The model's id.
        model: String,
        /// The role it lacks.
        role: Role,
        /// The start of its file's digest.
        digest: String,
    },
    /// Two nodes of one model disagree on page size or max context.
    #[error(
        "the nodes disagree: {first} but {other}; the router serves a model only when every node of it agrees on model, page size and max context"
    )]
    Disagree {
        /// The first node, described.
        first: String,
        /// The node that differs, described.
        other: String,
    },
    /// Something that is not a warden node answered.
    #[error("{0} answered Describe with something else: is it a warden node?")]
    NotANode(NodeAddr),
    /// A node did not answer in time.
    #[error("node {addr} did not answer before cluster.connect_timeout_s")]
    NoAnswer {
        /// The node.
        addr: NodeAddr,
        /// The last failure.
        #[source]
        last: CallError,
    },
}

impl Router {
    /// Asks every node in `cluster` what it serves, waiting up to `cluster.connect_timeout_s`
    /// for each, and returns one router for each of `models` (id, digest of its file), in
    /// order, over the nodes that serve that file. Refuses when a node has the wrong role or
    /// serves none of the models, when a model has no prefill or no decode node, or when one
    /// model's nodes disagree on the page size or the maximum context.
    pub async fn connect(
        cluster: &ClusterConfig,
        models: &[(String, String)],
        metrics: Arc<Metrics>,
    ) -> Result<Vec<Self>, ConnectError> {
        if cluster.prefill.is_empty() || cluster.decode.is_empty() {
            return Err(ConnectError::NoNodes);
        }
        let transport = Transport::new(cluster)?;
        let deadline = Instant::now() + Duration::from_secs(cluster.connect_timeout_s);
        let nodes = cluster
            .prefill
            .iter()
            .map(|a| (a.clone(), Role::Prefill))
            .chain(cluster.decode.iter().map(|a| (a.clone(), Role::Decode)))
            .collect::<Vec<_>>();
        let mut infos: Vec<(NodeAddr, NodeInfo)> = Vec::new();
        for (addr, role) in nodes {
            let info = describe_node(&transport, &addr, deadline).await?;
            if info.role != role {
                return Err(ConnectError::WrongRole {
                    addr,
                    configured: role,
                    actual: info.role,
                });
            }
            tracing::info!("cluster: {}", info.describe(&addr));
            if !models.iter().any(|(_, d)| *d == info.digest) {
                return Err(ConnectError::OtherModel {
                    node: info.describe(&addr),
                    digests: models
                        .iter()
                        .map(|(m, d)| format!("{m} {}", &d[..d.len().min(12)]))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
            infos.push((addr, info));
        }
        let mut routers = Vec::with_capacity(models.len());
        for (model, digest) in models {
            let mine: Vec<(NodeAddr, NodeInfo)> = infos.iter().filter(|(_, i)| i.digest == *digest).cloned().collect();
            for role in [Role::Prefill, Role::Decode] {
                if !mine.iter().any(|(_, i)| i.role == role) {
                    return Err(ConnectError::Unserved {
                        model: model.clone(),
                        role,
                        digest: digest[..digest.len().min(12)].to_string(),
                    });
                }
            }
            routers.push(Self::of_nodes(cluster, &mine, metrics.model(model), transport.clone())?);
        }
        Ok(routers)
    }

    /// The router of one model over `infos`, the nodes that serve its file (of both roles).
    fn of_nodes(
        cluster: &ClusterConfig,
        infos: &[(NodeAddr, NodeInfo)],
        metrics: ModelMetrics,
        transport: Transport,
    ) -> Result<Self, ConnectError> {
        let (first_addr, first) = infos[0].clone();
        for (addr, info) in &infos[1..] {
            if info.agreement() != first.agreement() {
                return Err(ConnectError::Disagree {
                    first: first.describe(&first_addr),
                    other: info.describe(addr),
                });
            }
        }
        let smallest = NodeInfo {
            vocab: infos.iter().map(|(_, i)| i.vocab).min().unwrap_or(0),
            pool_tokens: infos.iter().map(|(_, i)| i.pool_tokens).min().unwrap_or(0),
            pages: infos.iter().map(|(_, i)| i.pages).min().unwrap_or(0),
            pinnable_pages: infos.iter().map(|(_, i)| i.pinnable_pages).min().unwrap_or(0),
            ..first.clone()
        };
        let of_role = |role| -> Vec<NodeAddr> {
            infos
                .iter()
                .filter(|(_, i)| i.role == role)
                .map(|(a, _)| a.clone())
                .collect()
        };
        let (prefill, decode) = (of_role(Role::Prefill), of_role(Role::Decode));
        let nodes: Vec<(NodeAddr, Role)> = infos.iter().map(|(a, i)| (a.clone(), i.role)).collect();
        let health = Arc::new(Health::new(&nodes, metrics.registry().clone(), transport.clone()));
        let closing = watch::channel(false).0;
        tokio::spawn(health.clone().probe(first.agreement(), closing.subscribe()));
        Ok(Self {
            prefill,
            decode,
            health,
            transport,
            next: AtomicUsize::new(0),
            limits: cluster.transfer_limits(),
            metrics,
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            closing,
            agreed: first,
            smallest,
            #[cfg(feature = "transfer-faults")]
            faults: super::faults::from_env(),
        })
    }

    async fn run(self: Arc<Self>, job: Job) {
        struct InFlight(Arc<Router>);
        impl Drop for InFlight {
            fn drop(&mut self) {
                if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
                    self.0.idle.notify_waiters();
                }
            }
        }
        let _counted = InFlight(self.clone());
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // When every node of a role is down, try one anyway: the request fails naming it.
        let prefill = self
            .health
            .pick(Role::Prefill, n, &[])
            .unwrap_or_else(|| self.prefill[n % self.prefill.len()].clone());
        let mut closing = self.closing.subscribe();
        let submitted = Instant::now();
        let Job {
            req,
            format,
            tenant,
            index,
            tx,
            stop,
            slot,
            settings,
            policy_generation,
            mut grant,
        } = job;
        // Every ending lets the request's grant go before its answer leaves, so a client that
        // sends its next request on seeing this one end finds its quota released.
        let failed = |grant: Option<Arc<dyn UsageMeter>>, why: String| {
            drop(grant);
            slot.end();
            self.metrics.request_done(&tenant, "failed", 0, 0);
            let outcome = Outcome::Aborted(AbortReason::Node {
                code: "node_failed",
                message: why,
            });
            let _ = tx.send((
                index,
                Update::Done {
                    outcome,
                    text: String::new(),
                    usage: Usage::default(),
                },
            ));
        };
        // A steered choice's verdicts cross to the decode node in the order its plugin gives them.
        let (verdict_tx, mut verdicts) = mpsc::unbounded_channel::<Option<TokenConstraint>>();
        let steer = req.steer().map(|s| {
            s.relay(move |next| {
                let _ = verdict_tx.send(next);
            })
        });
        let dispatch = Dispatch {
            req: req.into_request(),
            format,
            steer,
            settings,
            generation: policy_generation,
            prefill,
            agreed: self.agreed.agreement(),
            limits: self.limits,
            #[cfg(feature = "transfer-faults")]
            fault: self.faults.get(&tenant).copied(),
        };
        // A decode node that cannot be reached has been sent nothing: the next one up is tried.
        let (mut tried, mut errors) = (Vec::new(), Vec::new());
        let (decode, r, mut w) = loop {
            let decode = match self.health.pick(Role::Decode, n, &tried) {
                Some(d) => d,
                None if tried.is_empty() => self.decode[n % self.decode.len()].clone(),
                None => return failed(grant.take(), errors.join("; ")),
            };
            match self.transport.connect(&decode).await {
                Ok((r, w)) => break (decode, r, w),
                Err(e) => {
                    self.health.set(&decode, false, &format!("unreachable: {e}"));
                    errors.push(format!("the decode node {decode} is unreachable: {e}"));
                    tried.push(decode);
                }
            }
        };
        if let Err(e) = link::send(&mut w, &Msg::Generate(Box::new(dispatch))).await {
            return failed(grant.take(), format!("writing to the decode node {decode}: {e}"));
        }
        let mut rx = link::reader(r, 0);
        let (kv_tx, mut kv_rx) = mpsc::unbounded_channel::<KvQuery>();
        let mut kv_tx = Some(kv_tx);
        let mut calls: HashMap<u64, Pending> = HashMap::new();
        let mut call = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        let mut end_sent = false;
        let mut last: Option<Instant> = None;
        loop {
            tokio::select! {
                p = rx.recv() => match p {
                    Some(Ok(Packet::Msg(Msg::Opened { id }))) => slot.opened(id, kv_tx.take()),
                    Some(Ok(Packet::Msg(Msg::Token { token, text, logprobs }))) => {
                        let now = Instant::now();
                        match last {
                            None => self.metrics.first_token(&tenant, now - submitted),
                            Some(t) => self.metrics.inter_token(&tenant, now - t),
                        }
                        last = Some(now);
                        let _ = tx.send((index, Update::Token { text, token, logprobs }));
                    }
                    Some(Ok(Packet::Msg(Msg::Done { ended, text, usage }))) => {
                        slot.end();
                        let outcome = outcome(ended);
                        if let Some(g) = grant.take() {
                            g.record(&usage);
                        }
                        self.metrics.ended(&tenant, submitted.elapsed());
                        self.metrics.request_done(&tenant, outcome_label(&outcome), usage.prompt_tokens, usage.completion_tokens);
                        let _ = tx.send((index, Update::Done { outcome, text, usage }));
                        return;
                    }
                    Some(Ok(Packet::Msg(Msg::Rejected { reason }))) => {
                        drop(grant.take());
                        slot.end();
                        self.metrics.rejected(&tenant, reason.code());
                        let _ = tx.send((index, Update::Rejected(Rejected { reason })));
                        return;
                    }
                    Some(Ok(Packet::Msg(Msg::KvAnswer { call, answer }))) => {
                        if let Some(p) = calls.remove(&call) {
                            p.answer(answer);
                        }
                    }
                    Some(Ok(Packet::Msg(Msg::Error { message }))) => {
                        return failed(grant.take(), format!("the decode node {decode} refused: {message}"));
                    }
                    Some(Ok(_)) => return failed(grant.take(), format!("the decode node {decode} broke the protocol")),
                    Some(Err(e)) => {
                        // A broken link (reset, or the peer timeout on a cut one): no more work
                        // goes there until a probe finds it answering again.
                        self.health.set(&decode, false, &format!("its connection broke: {e}"));
                        return failed(grant.take(), format!("from the decode node {decode}: {e}"));
                    }
                    None => return failed(grant.take(), format!("the decode node {decode} closed the connection")),
                },
                // The client went away: dropping the connection cancels the request there.
                _ = tx.closed() => return,
                _ = tick.tick(), if !end_sent => {
                    if let Some(e) = stop.get() {
                        end_sent = true;
                        if link::send(&mut w, &Msg::End { stop: e == End::Stop }).await.is_err() {
                            return failed(grant.take(), format!("writing to the decode node {decode}"));
                        }
                    }
                }
                Some(next) = verdicts.recv() => {
                    // A plugin raises its stop before it answers: the end goes first, so the node
                    // computes nothing past the stop.
                    if let Some(e) = stop.get().filter(|_| !end_sent) {
                        end_sent = true;
                        if link::send(&mut w, &Msg::End { stop: e == End::Stop }).await.is_err() {
                            return failed(grant.take(), format!("writing to the decode node {decode}"));
                        }
                    }
                    if !end_sent && link::send(&mut w, &Msg::Verdict { next }).await.is_err() {
                        return failed(grant.take(), format!("writing to the decode node {decode}"));
                    }
                }
                Some(q) = kv_rx.recv() => {
                    call += 1;
                    let (query, pending) = Pending::of(q);
                    calls.insert(call, pending);
                    if link::send(&mut w, &Msg::Kv { call, query }).await.is_err() {
                        return failed(grant.take(), format!("writing to the decode node {decode}"));
                    }
                }
                _ = closing.changed() => {
                    drop(grant.take());
                    slot.end();
                    let _ = tx.send((index, Update::ShuttingDown));
                    return;
                }
            }
        }
    }

    /// Sends `m` to every node in `nodes`, returning what went wrong.
    async fn broadcast(&self, nodes: &[NodeAddr], m: Msg) -> Vec<String> {
        let mut errors = Vec::new();
        for addr in nodes {
            match self.transport.call(addr, &m).await {
                Ok(Msg::Applied { error: None }) => {}
                Ok(Msg::Applied { error: Some(e) }) => errors.push(format!("{addr}: {e}")),
                Ok(_) => errors.push(format!("{addr}: an answer that is not one")),
                Err(e) => errors.push(e.to_string()),
            }
        }
        errors
    }

    fn all_nodes(&self) -> Vec<NodeAddr> {
        self.prefill.iter().chain(&self.decode).cloned().collect()
    }
}

/// The router as the API's engine: the cluster's nodes behind [`EngineHandle`].
#[derive(Clone)]
pub struct RouterEngine(pub Arc<Router>);

impl EngineHandle for RouterEngine {
    /// Dispatches a job; it never waits (the decode node's admission answers in its updates).
    fn submit(&self, job: Job) -> Result<(), Busy> {
        self.0.in_flight.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(self.0.clone().run(job));
        Ok(())
    }

    /// Applies a tenant's policy on every node.
    fn set_tenant(&self, owner: TenantId, settings: TenantSettings, generation: u64) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            let m = Msg::Tenant {
                owner,
                settings,
                generation,
            };
            for e in self.0.broadcast(&self.0.all_nodes(), m).await {
                tracing::warn!("cluster: applying tenant {owner}'s policy: {e}");
            }
        })
    }

    /// Makes `prefixes` the public prefixes on every prefill node (where prompts are computed).
    fn set_public_prefixes(&self, prefixes: Vec<Vec<u32>>) -> EngineFuture<'_, Result<(), EngineCallError>> {
        Box::pin(async move {
            let errors = self
                .0
                .broadcast(&self.0.prefill, Msg::PublicPrefixes { prefixes })
                .await;
            if errors.is_empty() {
                Ok(())
            } else {
                Err(EngineCallError::Nodes(errors))
            }
        })
    }

    /// Drops a deleted tenant's caches on every node.
    fn forget_tenant(&self, owner: TenantId) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            for e in self.0.broadcast(&self.0.all_nodes(), Msg::Forget { owner }).await {
                tracing::warn!("cluster: forgetting tenant {owner}: {e}");
            }
        })
    }

    /// The router takes work while it runs; each job finds out whether its nodes do.
    fn is_alive(&self) -> bool {
        true
    }

    /// Lets jobs run until `deadline`, then ends those left; resolves when all have ended.
    fn shutdown(&self, deadline: Instant) -> EngineFuture<'_, ()> {
        let r = &self.0;
        Box::pin(async move {
            let wait_idle = async {
                while r.in_flight.load(Ordering::SeqCst) > 0 {
                    let notified = r.idle.notified();
                    if r.in_flight.load(Ordering::SeqCst) == 0 {
                        break;
                    }
                    let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
                }
            };
            if tokio::time::timeout_at(deadline.into(), wait_idle).await.is_err() {
                let _ = r.closing.send(true);
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    while r.in_flight.load(Ordering::SeqCst) > 0 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
                .await;
            }
        })
    }

    /// The limits every node enforces.
    fn admission(&self) -> AdmissionLimits {
        AdmissionLimits {
            max_context: self.0.agreed.max_context,
            vocab: self.0.smallest.vocab,
            pool_tokens: self.0.smallest.pool_tokens,
        }
    }

    /// The smallest node's pool.
    fn pool_pages(&self) -> (usize, usize) {
        (self.0.smallest.pages, self.0.smallest.pinnable_pages)
    }

    /// A choice's KV questions go on its decode node's connection (its `SeqSlot` route); one
    /// without a route has no sequence to ask about.
    fn ask(&self, _q: KvQuery) -> bool {
        false
    }
}

/// Asks `addr` what it serves, retrying until `deadline` (nodes may still be loading).
async fn describe_node(transport: &Transport, addr: &NodeAddr, deadline: Instant) -> Result<NodeInfo, ConnectError> {
    let mut said = false;
    loop {
        match transport.call(addr, &Msg::Describe).await {
            Ok(Msg::Info(info)) => return Ok(info),
            Ok(_) => return Err(ConnectError::NotANode(addr.clone())),
            Err(last) => {
                if Instant::now() >= deadline {
                    return Err(ConnectError::NoAnswer {
                        addr: addr.clone(),
                        last,
                    });
                }
                if !said {
                    tracing::info!("cluster: waiting for node {addr} ({last})");
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// How a request ended, from the decode node's word.
fn outcome(e: Ended) -> Outcome {
    match e {
        Ended::Finished(f) => Outcome::Finished(f),
        Ended::Cancelled => Outcome::Aborted(AbortReason::Cancelled),
        Ended::Shutdown => Outcome::Aborted(AbortReason::Shutdown),
        Ended::Transfer(why) => Outcome::Aborted(AbortReason::Transfer(why)),
        // The output constraint's endings keep their codes and statuses.
        Ended::Failed { code, .. } if code == "constraint_allows_no_token" => {
            Outcome::Aborted(AbortReason::Constraint(ConstraintError::NoToken))
        }
        Ended::Failed { code, .. } if code == "plugin_constraint_allows_no_token" => {
            Outcome::Aborted(AbortReason::Constraint(ConstraintError::SteeredToNothing))
        }
        Ended::Failed { code, message } if code == "constraint_failed" => {
            Outcome::Aborted(AbortReason::Constraint(ConstraintError::Failed(message)))
        }
        Ended::Failed { code, message } => {
            let code = ["isolation_violation", "kv_unavailable", "cancelled", "shutting_down"]
                .into_iter()
                .find(|c| *c == code)
                .unwrap_or("node_failed");
            Outcome::Aborted(AbortReason::Node { code, message })
        }
    }
}

/// A plugin's KV question waiting for the decode node's answer.
enum Pending {
    Pages(oneshot::Sender<Option<Vec<PageHandle>>>),
    Info(oneshot::Sender<Result<PageInfo, KvAccessError>>),
    Count(oneshot::Sender<Result<usize, KvAccessError>>),
}

impl Pending {
    /// The call to send for `q` (its id and owner are the connection's own), and where its
    /// answer goes.
    fn of(q: KvQuery) -> (KvCall, Self) {
        match q {
            KvQuery::Pages { reply, .. } => (KvCall::Pages, Pending::Pages(reply)),
            KvQuery::Info { page, reply, .. } => (KvCall::Info(page), Pending::Info(reply)),
            KvQuery::Pin { tokens, reply, .. } => (KvCall::Pin(tokens), Pending::Count(reply)),
            KvQuery::Unpin { reply, .. } => (KvCall::Unpin, Pending::Count(reply)),
        }
    }

    fn answer(self, a: KvReply) {
        match (self, a) {
            (Pending::Pages(r), KvReply::Pages(p)) => {
                let _ = r.send(p);
            }
            (Pending::Info(r), KvReply::Info(i)) => {
                let _ = r.send(i);
            }
            (Pending::Count(r), KvReply::Count(c)) => {
                let _ = r.send(c);
            }
            (Pending::Pages(r), _) => {
                let _ = r.send(None);
            }
            (Pending::Info(r), _) => {
                let _ = r.send(Err(KvAccessError::Mismatched));
            }
            (Pending::Count(r), _) => {
                let _ = r.send(Err(KvAccessError::Mismatched));
            }
        }
    }
}
