//! The engine thread: owns the [`Engine`], takes jobs from a bounded queue, steps, and sends each
//! request's tokens to its own channel. On a prefill or decode node it also holds the ends of KV
//! transfers ([`ends`]), and says why a call on it gave no result ([`EngineCallError`]); on a router the "engine" is the cluster's
//! ([`crate::cluster::router`]), behind the same [`EngineHandle`].
//!
//! A job's channel is its lifeline: when the client goes away its receiver is dropped, and the
//! next loop cancels the request through the engine's retirement path, so its pages return to the
//! pool once unreferenced. Nothing here blocks on a client: sends never wait, and a request never
//! receives more messages than its `max_tokens` plus one.

pub mod ends;
mod error;

pub use error::{EngineCallError, StartError, StartupError};

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::config::{ServeConfig, ServedModel};
use crate::engine::request::{
    AbortReason, AdmissionLimits, FinishReason, Outcome, Rejected, RequestId, Usage, ValidRequest,
};
use crate::engine::{Engine, EngineConfig, Event, TenantSettings, TokenLogprobs};
use crate::grammar::Format;
use crate::kv::{KvError, KvPool, PageHandle, PageInfo};
use crate::loaded::LoadedModel;
use crate::metrics::ModelMetrics;
use crate::plugin::{BoxFuture, KvAccess, KvAccessError, PluginFailure};
use crate::tenant::TenantId;
use crate::transfer::Limits;
use crate::transfer::wire::Frame;
use ends::{Ends, Received};

/// What a request's channel receives.
#[derive(Debug)]
pub enum Update {
    /// A generated token and the text it completes (may be empty while text is held back).
    Token {
        /// The token's text now safe to send.
        text: String,
        /// Its id.
        token: u32,
        /// When asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// The last message: how it ended, remaining text, token counts.
    Done {
        /// Finished or aborted.
        outcome: Outcome,
        /// Held-back text released at the end.
        text: String,
        /// Token counts.
        usage: Usage,
    },
    /// Admission refused it; nothing ran.
    Rejected(Rejected),
    /// Its plugin failed on the output (sent by the plugin stage, never by the engine).
    Failed(PluginFailure),
    /// The server is shutting down and took no new work.
    ShuttingDown,
}

/// How the HTTP side asks the engine thread to end one choice early.
#[derive(Debug, Default)]
pub struct EndFlag(std::sync::atomic::AtomicU8);

/// How a choice was asked to end ([`EndFlag::get`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// As finished (`stop`): its plugin said so.
    Stop,
    /// As cancelled: its plugin failed.
    Cancel,
}

impl End {
    /// Its value in the flag (0 is "runs on").
    const fn code(self) -> u8 {
        match self {
            End::Stop => 1,
            End::Cancel => 2,
        }
    }
}

impl EndFlag {
    /// End it as finished (`stop`), e.g. when its plugin says so; a cancel already asked for
    /// stays.
    pub fn stop(&self) {
        let _ = self
            .0
            .compare_exchange(0, End::Stop.code(), Ordering::SeqCst, Ordering::SeqCst);
    }

    /// End it as cancelled, e.g. when its plugin failed (over a stop asked for before).
    pub fn cancel(&self) {
        self.0.store(End::Cancel.code(), Ordering::SeqCst);
    }

    /// How it was asked to end; `None` while it runs on.
    pub fn get(&self) -> Option<End> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            c if c == End::Stop.code() => Some(End::Stop),
            _ => Some(End::Cancel),
        }
    }
}

/// Where a request's usage is booked as each of its choices ends: the request's hold on its
/// tenant's quotas. Dropping the last reference lets the hold go.
pub trait UsageMeter: Send + Sync {
    /// Books one choice's token counts.
    fn record(&self, usage: &Usage);
}

/// One request for the engine.
pub struct Job {
    /// The request (its owner is the tenant's id), validated where it entered.
    pub req: ValidRequest,
    /// What `req`'s output constraint was compiled from: an engine in another process (a
    /// cluster's decode node) compiles it again.
    pub format: Format,
    /// The tenant's name, for metrics.
    pub tenant: String,
    /// Which choice of its request it is (`n` > 1 submits one job per choice).
    pub index: usize,
    /// Where its updates go, tagged with `index`; the request's choices share the channel.
    pub tx: mpsc::UnboundedSender<(usize, Update)>,
    /// Raised when the choice must end now (its plugin said stop, or failed).
    pub stop: Arc<EndFlag>,
    /// The engine's id for the request once it is admitted, and whether it has ended (its
    /// plugin's `kv` reads both).
    pub slot: Arc<SeqSlot>,
    /// The tenant's policy as the engine enforces it, applied before the job is submitted.
    pub settings: TenantSettings,
    /// The generation of the policy set `settings` came from: settings older than those the engine
    /// already has for the tenant (a reload happened meanwhile) are not applied.
    pub policy_generation: u64,
    /// The request's hold on its tenant's quotas; each choice records its usage in it.
    pub grant: Option<Arc<dyn UsageMeter>>,
}

/// A question a plugin asks about its own request's KV, answered on the engine thread between
/// steps, with the tag checks of the pool.
#[derive(Debug)]
pub enum KvQuery {
    /// The page table of request `id`, if it is `owner`'s and open.
    Pages {
        /// The request.
        id: RequestId,
        /// The asking tenant.
        owner: TenantId,
        /// Where the answer goes.
        reply: oneshot::Sender<Option<Vec<PageHandle>>>,
    },
    /// What `owner` may learn of page `page`.
    Info {
        /// The asking tenant.
        owner: TenantId,
        /// The page and the epoch the tenant was shown.
        page: PageHandle,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<PageInfo, KvAccessError>>,
    },
    /// Pin request `id`'s first `tokens` tokens in `owner`'s prefix cache.
    Pin {
        /// The request.
        id: RequestId,
        /// The asking tenant.
        owner: TenantId,
        /// Tokens to pin.
        tokens: usize,
        /// The tokens pinned.
        reply: oneshot::Sender<Result<usize, KvAccessError>>,
    },
    /// Unpin the pinned prefixes within request `id`'s cached prefix.
    Unpin {
        /// The request.
        id: RequestId,
        /// The asking tenant.
        owner: TenantId,
        /// The pages unpinned.
        reply: oneshot::Sender<Result<usize, KvAccessError>>,
    },
}

/// The prefill half of a disaggregated request, on a prefill node.
pub struct PrefillJob {
    /// The request.
    pub req: ValidRequest,
    /// Its tenant's policy as the engine enforces it.
    pub settings: TenantSettings,
    /// The policy generation `settings` came from.
    pub policy_generation: u64,
    /// The transfer's bounds.
    pub limits: Limits,
    /// Where the transfer's frames go (to the decode node); its closing ends the request.
    pub frames: mpsc::UnboundedSender<Frame>,
}

/// What admission said of a request submitted with an answer.
type Admission = oneshot::Sender<Result<RequestId, Rejected>>;

/// Where a decode node's request hears of its admission, and then of its pages opening.
pub struct Opening {
    /// Its id, or its rejection (which ends it: no transfer begins).
    pub admitted: Admission,
    /// Its pages opened: the transfer may begin.
    pub ready: oneshot::Sender<()>,
}

enum Cmd {
    Job(Box<Job>, Instant),
    /// Decode node: open the decode half of a disaggregated request.
    Open(Box<Job>, Instant, Opening),
    /// Decode node: a frame of request `id`'s incoming transfer.
    Frame(
        RequestId,
        Frame,
        oneshot::Sender<Result<Option<Received>, EngineCallError>>,
    ),
    /// Decode node: request `id`'s transfer broke off.
    TransferFailed(RequestId, String),
    /// Prefill node: compute a prompt and send its KV.
    Prefill(Box<PrefillJob>, Admission),
    /// Prefill node: the decode node's answer on request `id`'s transfer.
    Answer(RequestId, Frame),
    /// Apply a tenant's policy (weight, KV), of a policy generation.
    TenantSettings(TenantId, TenantSettings, u64),
    /// Drop a deleted tenant's prefix cache; answer once the metrics show it.
    Forget(TenantId, oneshot::Sender<()>),
    /// Make these the public prefixes; answer how that went.
    PublicPrefixes(Vec<Vec<u32>>, oneshot::Sender<Result<(), KvError>>),
    Shutdown(Instant, oneshot::Sender<()>),
    /// A steered choice got a verdict: the thread may be waiting for it.
    Wake,
}

/// How long the engine thread waits, after a step, for the verdicts its steered choices owe on
/// the tokens it just emitted, so they join the next step instead of the one after. Short
/// against a step, and the most a slow plugin can delay anyone else's next step.
const VERDICT_GRACE: Duration = Duration::from_millis(1);

/// KV questions waiting at most; beyond, a plugin's call fails (it never delays jobs, which
/// have their own queue).
const KV_QUEUE: usize = 1024;

/// A choice's place in the engine, as its plugin's `kv` sees it.
#[derive(Debug, Default)]
pub struct SeqSlot {
    id: OnceLock<RequestId>,
    ended: AtomicBool,
    /// On a router: where the choice's KV questions go (to its decode node's connection).
    remote: OnceLock<mpsc::UnboundedSender<KvQuery>>,
}

impl SeqSlot {
    /// The choice was admitted as `id` (on a router: its decode node's id), and its KV
    /// questions go to `remote` when set.
    pub(crate) fn opened(&self, id: RequestId, remote: Option<mpsc::UnboundedSender<KvQuery>>) {
        let _ = self.id.set(id);
        if let Some(r) = remote {
            let _ = self.remote.set(r);
        }
    }

    /// The choice ended: its plugin's KV questions are answered without asking.
    pub(crate) fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
    }
}

/// The queue is full: the caller answers 503.
#[derive(Debug)]
pub struct Busy;

/// The engine of `served` (one of `cfg`'s models) for `loaded`, its file; refused when its pool
/// cannot hold the maximum context it sets (invariant 4) or a setting is impossible. Without
/// `limits.max_context`, the limit is the model's trained context or, when its KV budget holds
/// less (a model trained on 32k or 128k tokens, a budget of hundreds of MiB), what the budget
/// holds: the server starts, and says so.
pub fn start_engine(cfg: &ServeConfig, served: &ServedModel, loaded: &LoadedModel) -> Result<Engine, StartError> {
    let lim = &served.limits;
    let mut ec = EngineConfig::for_model(&loaded.model);
    ec.page_size = cfg.kv.page_size;
    ec.kv_memory_bytes = served.kv_memory_bytes;
    match lim.max_context {
        Some(m) => ec.max_context = m,
        None => {
            let c = loaded.model.config();
            let per_page = KvPool::page_bytes(&c.attn_shape(ec.page_size.max(1)), c.n_layers);
            let holds = ec.kv_memory_bytes / per_page.max(1) * ec.page_size;
            if holds > 0 && holds < ec.max_context {
                tracing::info!(
                    "{}: max context {holds} tokens: what its {} MiB KV budget holds (the model was trained on {}; raise kv.memory_mib or its kv_share, or set limits.max_context, to change it)",
                    served.name,
                    ec.kv_memory_bytes >> 20,
                    ec.max_context
                );
                ec.max_context = holds;
            }
        }
    }
    ec.max_batch_tokens = lim.max_batch_tokens;
    ec.step_target = (lim.step_target_ms > 0).then(|| Duration::from_millis(lim.step_target_ms));
    ec.max_running = lim.max_running;
    ec.max_waiting = lim.queue;
    ec.prefix_cache = cfg.kv.prefix_cache;
    ec.max_pinned_pages = cfg.kv.max_pinned_pages_per_tenant;
    let (page_size, max_context, kv_mib) = (ec.page_size, ec.max_context, ec.kv_memory_bytes >> 20);
    let engine = Engine::new(loaded.model.clone(), loaded.tokenizer.clone(), ec).map_err(|source| StartError {
        model: served.name.clone(),
        source,
    })?;
    // The pool's sizing, so an operator sees what the KV budget buys before the first request.
    let pages = engine.kv_counters().pages_total;
    tracing::info!(
        "{}: KV pool of {pages} pages of {page_size} tokens ({kv_mib} MiB); max context {max_context} tokens, so {} sequences at full context fit at once",
        served.name,
        pages / max_context.div_ceil(page_size.max(1)).max(1)
    );
    Ok(engine)
}

/// A future an [`EngineHandle`] returns.
pub type EngineFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The engine as the API sees it: this process's engine thread ([`LocalEngine`]), or on a router
/// the cluster's nodes (`cluster::router`). The boot code picks one and hands it to the server.
pub trait EngineHandle: Send + Sync {
    /// Queues a job without waiting; [`Busy`] when the queue is full.
    fn submit(&self, job: Job) -> Result<(), Busy>;

    /// Applies tenant `owner`'s policy in the engine (weight, page cap and floor, prefix cache, pins).
    fn set_tenant(&self, owner: TenantId, settings: TenantSettings, generation: u64) -> EngineFuture<'_, ()>;

    /// Makes `prefixes` the public prefixes (see [`Engine::set_public_prefixes`]).
    fn set_public_prefixes(&self, prefixes: Vec<Vec<u32>>) -> EngineFuture<'_, Result<(), EngineCallError>>;

    /// Drops tenant `owner`'s prefix cache, pinned prefixes included (the tenant was deleted).
    fn forget_tenant(&self, owner: TenantId) -> EngineFuture<'_, ()>;

    /// Whether the engine can take work.
    fn is_alive(&self) -> bool;

    /// Lets in-flight requests finish until `deadline`, cancels what remains; resolves when
    /// they have ended.
    fn shutdown(&self, deadline: Instant) -> EngineFuture<'_, ()>;

    /// The limits admission applies to every request.
    fn admission(&self) -> AdmissionLimits;

    /// The pool's pages, and how many of them may be pinned (on a router: the smallest node's).
    fn pool_pages(&self) -> (usize, usize);

    /// Sends a KV question without waiting, for a choice with no route of its own (see
    /// [`SeqSlot`]); false when it cannot go (the reply channel then closes).
    fn ask(&self, q: KvQuery) -> bool;
}

/// This process's engine thread.
#[derive(Clone)]
pub struct LocalEngine {
    tx: SyncSender<Cmd>,
    kv: SyncSender<KvQuery>,
    alive: Arc<AtomicBool>,
    /// A wake-up is in the queue: verdicts add at most one, so they never fill it (jobs would
    /// then be refused as a full queue).
    waking: Arc<AtomicBool>,
    admission: AdmissionLimits,
    pool_pages: (usize, usize),
}

struct Live {
    index: usize,
    tx: mpsc::UnboundedSender<(usize, Update)>,
    stop: Arc<EndFlag>,
    slot: Arc<SeqSlot>,
    grant: Option<Arc<dyn UsageMeter>>,
    tenant: String,
    submitted: Instant,
    last: Option<Instant>,
}

impl LocalEngine {
    /// Starts the engine thread with a queue of `queue` jobs.
    pub fn start(engine: Engine, queue: usize, metrics: ModelMetrics) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel(queue);
        let (kv, kv_rx) = std::sync::mpsc::sync_channel(KV_QUEUE);
        let alive = Arc::new(AtomicBool::new(true));
        let flag = alive.clone();
        let admission = engine.limits();
        let pool_pages = (engine.kv_counters().pages_total, engine.pinnable_pages());
        let waking = Arc::new(AtomicBool::new(false));
        let woken = waking.clone();
        std::thread::Builder::new()
            .name("warden-engine".into())
            .spawn(move || {
                // Cleared however the thread ends, a panic included: /readyz then says so.
                struct Alive(Arc<AtomicBool>);
                impl Drop for Alive {
                    fn drop(&mut self) {
                        self.0.store(false, Ordering::SeqCst);
                    }
                }
                let _alive = Alive(flag);
                run(engine, rx, kv_rx, &metrics, &woken);
            })?;
        Ok(Self {
            tx,
            kv,
            alive,
            waking,
            admission,
            pool_pages,
        })
    }

    /// Decode node: opens the decode half of a disaggregated request; `opening` hears of its
    /// admission, then of its pages opening (they wait their turn in the queue).
    pub fn open(&self, job: Job, opening: Opening) -> Result<(), Busy> {
        self.try_send(Cmd::Open(Box::new(job), Instant::now(), opening))
    }

    /// Prefill node: computes a prompt (but its last token) and sends its KV through the job's
    /// frames; `admitted` answers as for [`open`](Self::open).
    pub fn prefill(&self, job: PrefillJob, admitted: Admission) -> Result<(), Busy> {
        self.try_send(Cmd::Prefill(Box::new(job), admitted))
    }

    fn try_send(&self, cmd: Cmd) -> Result<(), Busy> {
        match self.tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(Busy),
            // The answer channel closes: the caller sees the engine is gone.
            Err(TrySendError::Disconnected(_)) => Ok(()),
        }
    }

    /// Decode node: a frame of request `id`'s incoming transfer, verified and written on the
    /// engine thread; the answer to send back, or why the request failed.
    pub async fn transfer_frame(&self, id: RequestId, frame: Frame) -> Result<Option<Received>, EngineCallError> {
        self.call(|reply| Cmd::Frame(id, frame, reply))
            .await
            .unwrap_or(Err(EngineCallError::Stopped))
    }

    /// Decode node: request `id`'s transfer broke off; it ends with `why`.
    pub async fn transfer_failed(&self, id: RequestId, why: String) {
        self.send_waiting(Cmd::TransferFailed(id, why)).await;
    }

    /// Prefill node: the decode node's answer (an `Ack` or an `Abort`) on request `id`'s transfer.
    pub async fn transfer_answer(&self, id: RequestId, frame: Frame) {
        self.send_waiting(Cmd::Answer(id, frame)).await;
    }

    /// Sends the command `make` builds around a reply channel (offered until the queue takes it)
    /// and waits for the reply; `None` when the thread is gone.
    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Option<T> {
        let (reply, rx) = oneshot::channel();
        self.send_waiting(make(reply)).await;
        rx.await.ok()
    }

    /// Offers a command until the queue takes it or the thread is gone.
    async fn send_waiting(&self, mut cmd: Cmd) {
        loop {
            match self.tx.try_send(cmd) {
                Ok(()) => return,
                Err(TrySendError::Full(c)) => {
                    cmd = c;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(TrySendError::Disconnected(_)) => return,
            }
        }
    }
}

impl EngineHandle for LocalEngine {
    fn submit(&self, job: Job) -> Result<(), Busy> {
        if let Some(steer) = job.req.steer() {
            let (tx, waking) = (self.tx.clone(), self.waking.clone());
            steer.set_waker(move || {
                // One wake-up in the queue is enough; a full queue means the thread has work and
                // wakes anyway.
                if !waking.swap(true, Ordering::SeqCst) && tx.try_send(Cmd::Wake).is_err() {
                    waking.store(false, Ordering::SeqCst);
                }
            });
        }
        match self.tx.try_send(Cmd::Job(Box::new(job), Instant::now())) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(Busy),
            Err(TrySendError::Disconnected(Cmd::Job(job, _))) => {
                let _ = job.tx.send((job.index, Update::ShuttingDown));
                Ok(())
            }
            Err(TrySendError::Disconnected(_)) => Ok(()),
        }
    }

    fn set_tenant(&self, owner: TenantId, settings: TenantSettings, generation: u64) -> EngineFuture<'_, ()> {
        Box::pin(self.send_waiting(Cmd::TenantSettings(owner, settings, generation)))
    }

    /// The engine computes what is new between two steps.
    fn set_public_prefixes(&self, prefixes: Vec<Vec<u32>>) -> EngineFuture<'_, Result<(), EngineCallError>> {
        Box::pin(async move {
            match self.call(|done| Cmd::PublicPrefixes(prefixes, done)).await {
                Some(r) => r.map_err(Into::into),
                None => Err(EngineCallError::Gone),
            }
        })
    }

    fn forget_tenant(&self, owner: TenantId) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            self.call(|done| Cmd::Forget(owner, done)).await;
        })
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Stops the thread too.
    fn shutdown(&self, deadline: Instant) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            self.call(|done| Cmd::Shutdown(deadline, done)).await;
        })
    }

    fn admission(&self) -> AdmissionLimits {
        self.admission
    }

    fn pool_pages(&self) -> (usize, usize) {
        self.pool_pages
    }

    fn ask(&self, q: KvQuery) -> bool {
        self.kv.try_send(q).is_ok()
    }
}

/// A plugin's access to its own request's KV, through the engine thread (on a router, through
/// its decode node's connection).
pub struct EngineKv {
    engine: Arc<dyn EngineHandle>,
    owner: TenantId,
    slot: Arc<SeqSlot>,
}

impl EngineKv {
    /// Access for the request of tenant `owner` whose job is `slot`.
    pub fn new(engine: Arc<dyn EngineHandle>, owner: TenantId, slot: Arc<SeqSlot>) -> Self {
        Self { engine, owner, slot }
    }
}

impl EngineKv {
    /// Sends `q` on the choice's own route (on a router, its decode node's connection), else to
    /// the engine; false when it cannot go.
    fn ask(&self, q: KvQuery) -> bool {
        match self.slot.remote.get() {
            Some(remote) => remote.send(q).is_ok(),
            None => self.engine.ask(q),
        }
    }

    /// Asks the engine about this request's own sequence; `ask` builds the question from the
    /// request's id and a reply channel. An ended or not yet admitted request is answered here.
    fn ask_own<T: Send + 'static>(
        &self,
        ask: impl FnOnce(RequestId, oneshot::Sender<Result<T, KvAccessError>>) -> KvQuery,
    ) -> BoxFuture<Result<T, KvAccessError>> {
        if self.slot.ended.load(Ordering::SeqCst) {
            return Box::pin(async { Err(KvAccessError::Ended) });
        }
        let Some(&id) = self.slot.id.get() else {
            return Box::pin(async { Err(KvAccessError::NotStarted) });
        };
        let (reply, rx) = oneshot::channel();
        if !self.ask(ask(id, reply)) {
            return Box::pin(async { Err(KvAccessError::Busy) });
        }
        Box::pin(async move { rx.await.unwrap_or(Err(KvAccessError::Stopped)) })
    }
}

impl KvAccess for EngineKv {
    fn started(&self) -> bool {
        self.slot.id.get().is_some()
    }

    fn pages(&self) -> BoxFuture<Option<Vec<PageHandle>>> {
        let (reply, rx) = oneshot::channel();
        // An ended request has no pages: answered here, without the engine thread.
        let live = !self.slot.ended.load(Ordering::SeqCst);
        let asked = live
            && self.slot.id.get().is_some_and(|&id| {
                self.ask(KvQuery::Pages {
                    id,
                    owner: self.owner,
                    reply,
                })
            });
        Box::pin(async move { if asked { rx.await.ok().flatten() } else { None } })
    }

    fn info(&self, page: PageHandle) -> BoxFuture<Result<PageInfo, KvAccessError>> {
        let owner = self.owner;
        self.ask_own(|_, reply| KvQuery::Info { owner, page, reply })
    }

    fn pin(&self, tokens: usize) -> BoxFuture<Result<usize, KvAccessError>> {
        let owner = self.owner;
        self.ask_own(|id, reply| KvQuery::Pin {
            id,
            owner,
            tokens,
            reply,
        })
    }

    fn unpin(&self) -> BoxFuture<Result<usize, KvAccessError>> {
        let owner = self.owner;
        self.ask_own(|id, reply| KvQuery::Unpin { id, owner, reply })
    }
}

pub(crate) fn outcome_label(o: &Outcome) -> &'static str {
    match o {
        Outcome::Finished(FinishReason::Stop) => "stop",
        Outcome::Finished(FinishReason::Length) => "length",
        Outcome::Aborted(AbortReason::Cancelled) => "cancelled",
        Outcome::Aborted(AbortReason::Shutdown) => "shutdown",
        Outcome::Aborted(_) => "failed",
    }
}

/// The policy generation whose settings the engine has, per tenant.
#[derive(Default)]
struct Applied(HashMap<TenantId, u64>);

impl Applied {
    /// Applies `settings` unless the engine already has a newer generation's settings for `owner`.
    fn apply(&mut self, engine: &mut Engine, owner: TenantId, settings: TenantSettings, generation: u64) {
        let had = self.0.entry(owner).or_insert(0);
        if generation >= *had {
            *had = generation;
            engine.set_tenant(owner, settings);
        }
    }
}

fn outcome_message(o: &Outcome) -> String {
    match o {
        Outcome::Finished(f) => format!("finished ({})", f.as_str()),
        Outcome::Aborted(r) => r.to_string(),
    }
}

/// Submits a job (a whole request, or with `opened` the decode half of a disaggregated one,
/// whose admission is answered there) and tracks it.
#[allow(clippy::too_many_arguments)]
fn start(
    engine: &mut Engine,
    ends: &mut Ends,
    live: &mut HashMap<RequestId, Live>,
    applied: &mut Applied,
    metrics: &ModelMetrics,
    job: Box<Job>,
    submitted: Instant,
    opened: Option<Opening>,
) {
    let job = *job;
    let owner = job.req.request().owner;
    applied.apply(engine, owner, job.settings, job.policy_generation);
    let r = match opened {
        None => engine.submit(job.req),
        Some(_) => engine.open_transfer(job.req),
    };
    match r {
        Ok(id) => {
            job.slot.opened(id, None);
            live.insert(
                id,
                Live {
                    index: job.index,
                    tx: job.tx,
                    stop: job.stop,
                    slot: job.slot,
                    grant: job.grant,
                    tenant: job.tenant,
                    submitted,
                    last: None,
                },
            );
            if let Some(o) = opened {
                ends.add_receiver(id, owner, o.ready);
                let _ = o.admitted.send(Ok(id));
            }
        }
        Err(rej) => {
            metrics.rejected(&job.tenant, rej.reason.code());
            // The grant goes before the answer, as for a request that ends.
            drop(job.grant);
            match opened {
                Some(o) => {
                    let _ = o.admitted.send(Err(rej));
                }
                None => {
                    let _ = job.tx.send((job.index, Update::Rejected(rej)));
                }
            }
        }
    }
}

fn run(mut engine: Engine, rx: Receiver<Cmd>, kv: Receiver<KvQuery>, metrics: &ModelMetrics, waking: &AtomicBool) {
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let mut applied = Applied::default();
    let mut shutdown: Option<(Instant, oneshot::Sender<()>)> = None;
    let mut ends = Ends::default();
    let mut stalled = false;
    let mut grace_until = Instant::now();
    let publish = |engine: &Engine| {
        let (waiting, running) = engine.queue_lengths();
        metrics.engine_state(engine.kv_counters(), waiting, running, engine.preemptions());
    };
    publish(&engine);
    loop {
        // Block for work when there is nothing to step, and briefly when the last step could
        // do nothing (requests wait for pages that transfers or held prompts keep): then a
        // command (a frame, an acknowledgement) is what makes progress.
        // And for a moment when steered choices wait for verdicts on their last tokens.
        let mut cmds = Vec::new();
        let grace = if engine.awaits_verdicts() {
            grace_until.saturating_duration_since(Instant::now())
        } else {
            Duration::ZERO
        };
        if !engine.has_work() || stalled || !grace.is_zero() {
            let wait = if shutdown.is_some() {
                Duration::ZERO
            } else if !engine.has_work() {
                Duration::from_millis(500)
            } else if stalled {
                Duration::from_millis(2)
            } else {
                grace
            };
            match rx.recv_timeout(wait) {
                Ok(c) => cmds.push(c),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            // Within the grace, each verdict wakes the thread: wait on for the rest.
            let mut gone = false;
            while !stalled && engine.has_work() && shutdown.is_none() && engine.awaits_verdicts() {
                let left = grace_until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match rx.recv_timeout(left) {
                    Ok(c) => cmds.push(c),
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        gone = true;
                        break;
                    }
                }
            }
            if gone {
                break;
            }
        }
        cmds.extend(rx.try_iter());
        for cmd in cmds {
            match cmd {
                Cmd::Job(job, submitted) => {
                    if shutdown.is_some() {
                        let _ = job.tx.send((job.index, Update::ShuttingDown));
                        continue;
                    }
                    start(
                        &mut engine,
                        &mut ends,
                        &mut live,
                        &mut applied,
                        metrics,
                        job,
                        submitted,
                        None,
                    );
                }
                // While shutting down, the answer channel drops unanswered: the node is going.
                Cmd::Open(job, submitted, opening) => {
                    if shutdown.is_none() {
                        start(
                            &mut engine,
                            &mut ends,
                            &mut live,
                            &mut applied,
                            metrics,
                            job,
                            submitted,
                            Some(opening),
                        );
                    }
                }
                Cmd::Prefill(job, admitted) => {
                    if shutdown.is_some() {
                        continue;
                    }
                    let PrefillJob {
                        req,
                        settings,
                        policy_generation,
                        limits,
                        frames,
                    } = *job;
                    let owner = req.request().owner;
                    applied.apply(&mut engine, owner, settings, policy_generation);
                    let r = engine.submit_prefill(req);
                    if let Ok(id) = r {
                        ends.add_sender(id, owner, limits, frames);
                    }
                    let _ = admitted.send(r);
                }
                Cmd::Frame(id, frame, reply) => {
                    let _ = reply.send(ends.receive(&mut engine, id, frame));
                }
                Cmd::TransferFailed(id, why) => ends.fail_receiving(&mut engine, id, why),
                Cmd::Answer(id, frame) => ends.answer(&mut engine, id, frame),
                Cmd::TenantSettings(owner, settings, generation) => {
                    applied.apply(&mut engine, owner, settings, generation)
                }
                Cmd::Forget(owner, done) => {
                    engine.forget_owner(owner);
                    publish(&engine);
                    let _ = done.send(());
                }
                Cmd::PublicPrefixes(prefixes, done) => {
                    let _ = done.send(engine.set_public_prefixes(&prefixes));
                    publish(&engine);
                }
                Cmd::Shutdown(deadline, done) => shutdown = Some((deadline, done)),
                Cmd::Wake => waking.store(false, Ordering::SeqCst),
            }
        }
        // Plugins' questions about their own KV, between steps.
        for q in kv.try_iter() {
            match q {
                KvQuery::Pages { id, owner, reply } => {
                    let _ = reply.send(engine.kv_pages(id, owner));
                }
                KvQuery::Info { owner, page, reply } => {
                    let _ = reply.send(engine.kv_inspect(owner, page).map_err(Into::into));
                }
                KvQuery::Pin {
                    id,
                    owner,
                    tokens,
                    reply,
                } => {
                    let _ = reply.send(engine.kv_pin(id, owner, tokens).map_err(Into::into));
                }
                KvQuery::Unpin { id, owner, reply } => {
                    let _ = reply.send(engine.kv_unpin(id, owner).map_err(Into::into));
                }
            }
        }
        // Choices their plugin ended: finished or cancelled, through the same path. First, so a
        // plugin's stop counts as `stop` even when its output stage has already let go.
        let ended: Vec<(RequestId, End)> = live.iter().filter_map(|(id, l)| Some((*id, l.stop.get()?))).collect();
        for (id, e) in ended {
            let _ = match e {
                End::Stop => engine.stop(id),
                End::Cancel => engine.cancel(id),
            };
        }
        // Clients that went away: cancel through the retirement path.
        let gone: Vec<RequestId> = live
            .iter()
            .filter(|(_, l)| l.tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            engine.cancel(id);
        }
        ends.sweep(&mut engine);
        let computed = engine.tokens_computed();
        let events = match &shutdown {
            Some((deadline, _)) if Instant::now() >= *deadline => engine.abort_all(),
            _ => engine.step(),
        };
        stalled = events.is_empty() && engine.tokens_computed() == computed;
        grace_until = Instant::now() + VERDICT_GRACE;
        for f in ends.take_finished() {
            metrics.transfer_done(f.outcome, f.pages, f.bytes, f.seconds);
        }
        for (id, at) in engine.take_admitted() {
            if let Some(l) = live.get(&id) {
                metrics.queued(&l.tenant, at.saturating_duration_since(l.submitted));
            }
        }
        // The pool's state after the step is published before anyone hears what the step did.
        publish(&engine);
        for ev in events {
            match ev {
                Event::Token {
                    id,
                    token,
                    text,
                    logprobs,
                } => {
                    if let Some(l) = live.get_mut(&id) {
                        let now = Instant::now();
                        match l.last {
                            None => metrics.first_token(&l.tenant, now - l.submitted),
                            Some(t) => metrics.inter_token(&l.tenant, now - t),
                        }
                        l.last = Some(now);
                        let _ = l.tx.send((l.index, Update::Token { text, token, logprobs }));
                    }
                }
                Event::Done {
                    id,
                    outcome,
                    text,
                    usage,
                } => {
                    ends.ended(id, &outcome_message(&outcome));
                    if let Some(mut l) = live.remove(&id) {
                        l.slot.end();
                        // Booked and let go before the answer leaves: a client that sends its
                        // next request on seeing this one end finds its refund made.
                        if let Some(g) = l.grant.take() {
                            g.record(&usage);
                        }
                        metrics.ended(&l.tenant, l.submitted.elapsed());
                        metrics.request_done(
                            &l.tenant,
                            outcome_label(&outcome),
                            usage.prompt_tokens,
                            usage.completion_tokens,
                        );
                        let _ = l.tx.send((l.index, Update::Done { outcome, text, usage }));
                    }
                }
                // A prefill node's request: its transfer begins (without one, its pages go).
                Event::Prefilled { id, tokens } => ends.prefilled(&mut engine, id, tokens),
                // A decode node's request: its transfer may begin.
                Event::Opened { id } => ends.opened(id),
            }
        }
        publish(&engine);
        if shutdown.is_some() && !engine.has_work() {
            break;
        }
    }
    // Anything still queued gets its answer.
    for cmd in rx.try_iter() {
        if let Cmd::Job(job, _) = cmd {
            let _ = job.tx.send((job.index, Update::ShuttingDown));
        }
    }
    publish(&engine);
    if let Some((_, done)) = shutdown {
        let _ = done.send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unset, the context limit is what the KV budget holds when that is less than the model's
    /// trained context, and the engine starts; set, a limit the budget cannot hold is refused
    /// (invariant 4).
    #[test]
    fn an_unset_max_context_is_what_the_kv_budget_holds() {
        let loaded = LoadedModel::open(&crate::testutil::model_path()).expect("the default model");
        let trained = loaded.model.config().context_length;
        let mut cfg = ServeConfig::default();
        cfg.kv.memory_mib = 16;
        let served = &cfg.served()[0];
        let engine = start_engine(&cfg, served, &loaded).expect("starts within its budget");
        let held = engine.limits().max_context;
        assert!(held < trained, "{held} tokens of {trained}");
        let c = loaded.model.config();
        let per_page = KvPool::page_bytes(&c.attn_shape(cfg.kv.page_size), c.n_layers);
        assert_eq!(held, (16 << 20) / per_page * cfg.kv.page_size);
        cfg.limits.max_context = Some(trained);
        let Err(e) = start_engine(&cfg, &cfg.served()[0], &loaded) else {
            panic!("a set limit the pool cannot hold");
        };
        assert!(e.to_string().contains("SmolLM2-135M-Instruct.Q4_1"), "{e}");
    }
}
