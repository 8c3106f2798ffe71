//! The engine: admission, continuous batching with chunked prefill, sampling and retirement.
//!
//! One progress model (as vLLM v1): each running sequence has `tokens` (prompt then output) and
//! `computed`, how many of them have KV in its pages. A step gives sequences whose tokens are all
//! computed but the last (a decode) one token and others prefill chunks: the least served
//! tenant's work leads, up to a token cap and a target duration that a cost model fitted from
//! recent steps predicts (`cost`), and the other tenants' joins while the step stays within twice
//! the lead's (see `schedule`). Tenants are charged the machine time their work took: each
//! step's time is shared by what each sequence adds to it (`cost`). Sequences join and leave
//! between any two steps; running slots and KV pages are shared fairly at admission
//! ([`Engine::admit_waiting`]). Every way a scheduled request ends —
//! finished, cancelled, failed — goes through `Engine::retire`, which closes its KV state (pages
//! return to the pool once unreferenced) and emits exactly one [`Event::Done`]. Rejected
//! requests never get here: [`Engine::submit`] returns them before anything is allocated.
//!
//! A sequence opens with pages for its tokens and the next one, and grows a page at a time as it
//! decodes ([`Engine::grow_running`]); when a page cannot be had, a sequence the scheduler favours
//! less is preempted (its pages go back, and readmitted it computes its tokens again and goes on
//! where it was), so requests need not reserve their whole `max_tokens` up front.
//!
//! Beside this file: `schedule` (step planning and admission order, pure), `cost` (the step-cost
//! model), `prefix` (the prefix cache's uses beyond admission: shared first pages, plugins' pins,
//! public prefixes), `disagg` (the prefill and decode halves of a disaggregated request),
//! `request` and `field` (validated requests and their errors), `sampling`, `constraint` (a
//! sequence's output grammar), `steer` (a sequence whose next token waits for a verdict from
//! outside, its plugin's) and `text`.

pub mod constraint;
mod cost;
mod disagg;
pub mod field;
mod prefix;
pub mod request;
pub mod sampling;
mod schedule;
pub mod steer;
pub mod text;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use warden_kernels::tag::{IsolationViolation, TagCheck};

use crate::tenant::TenantId;

use crate::kv::{KvCounters, KvError, KvPool};
use crate::model::{Forward, Model, Scratch, StepError, StepSeq};
use constraint::{Constraint, ConstraintError};
use cost::{Attention, CostModel, Work};
use request::{
    AbortReason, AdmissionLimits, FinishReason, Outcome, RejectReason, Rejected, RequestId, Usage, ValidRequest,
};
use sampling::Sampler;
use schedule::{Planner, SeqView};
use steer::Steer;
use text::{Detokenizer, TextStream};

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Maximum prompt plus completion tokens per request. Default: the model's context length.
    pub max_context: usize,
    /// Tokens per step (decode tokens plus prefill chunks). Default 512.
    pub max_batch_tokens: usize,
    /// How long a step should take. A step is not preemptible, so this bounds how long a request
    /// arriving mid-step waits for the engine, and how long running streams wait between
    /// tokens: the prefill chunks of a step are cut to what the engine's cost model, fitted from
    /// recent steps, says fits in it (as Sarathi-Serve derives its token budget from a latency
    /// target), never below [`MIN_PREFILL_TOKENS`].
    /// `max_batch_tokens` still caps every step. Default 40 ms; `None`: `max_batch_tokens` alone.
    pub step_target: Option<Duration>,
    /// Sequences running at once. Default 64.
    pub max_running: usize,
    /// Requests waiting for a slot; more are rejected. Default 1024.
    pub max_waiting: usize,
    /// Token slots per KV page. Default 16.
    pub page_size: usize,
    /// Bytes of KV memory. Default 512 MiB.
    pub kv_memory_bytes: usize,
    /// Tag checks; [`TagCheck::SkipForBenchmark`] only in `warden bench`.
    pub tag_check: TagCheck,
    /// The tenant-private prefix cache: a request adopts the KV pages of an earlier request of the
    /// same tenant that began with the same tokens. Default on.
    pub prefix_cache: bool,
    /// KV pages each tenant may pin in its prefix cache. Default 64.
    pub max_pinned_pages: usize,
}

impl EngineConfig {
    /// Defaults for `model`.
    pub fn for_model(model: &Model) -> Self {
        Self {
            max_context: model.config().context_length,
            max_batch_tokens: 512,
            step_target: Some(Duration::from_millis(40)),
            max_running: 64,
            max_waiting: 1024,
            page_size: 16,
            kv_memory_bytes: 512 << 20,
            tag_check: TagCheck::Enforce,
            prefix_cache: true,
            max_pinned_pages: 64,
        }
    }
}

/// What the engine enforces of a tenant's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TenantSettings {
    /// Its share when tenants contend for admission and for prefill tokens (at least 1).
    pub weight: u32,
    /// Pages its sequences may hold at once (`None`: no cap beyond the pool).
    pub max_pages: Option<usize>,
    /// Pages kept for it whatever other tenants do.
    pub min_pages: usize,
    /// Whether its requests reuse its own cached prefixes.
    pub prefix_cache: bool,
    /// Whether its requests may also adopt the server's public prefixes (see
    /// [`Engine::set_public_prefixes`]); only with `prefix_cache`.
    pub public_prefixes: bool,
    /// Pages its plugins may pin.
    pub max_pinned_pages: usize,
}

impl Default for TenantSettings {
    /// What a tenant without a policy of its own gets: weight 1, no cap or floor, its own prefix
    /// cache (no public prefixes), 64 pinned pages.
    fn default() -> Self {
        Self {
            weight: 1,
            max_pages: None,
            min_pages: 0,
            prefix_cache: true,
            public_prefixes: false,
            max_pinned_pages: 64,
        }
    }
}

/// What a step produced for a request.
#[derive(Debug, Clone)]
pub enum Event {
    /// A generated token and the text it completes (possibly empty while text is held back).
    Token {
        /// Request.
        id: RequestId,
        /// Token id.
        token: u32,
        /// Text now safe to emit.
        text: String,
        /// The token's log-probability and the top alternatives, when the request asked.
        logprobs: Option<TokenLogprobs>,
    },
    /// A transferred request's pages are open: its prompt's KV may arrive (see
    /// [`Engine::open_transfer`]).
    Opened {
        /// Request.
        id: RequestId,
    },
    /// A prefill-only request computed its prompt (but its last token), and its pages wait for
    /// their transfer: the last event for this id. The caller transfers them and then calls
    /// [`Engine::release_prefilled`].
    Prefilled {
        /// Request.
        id: RequestId,
        /// Positions its pages hold (the prompt but its last token).
        tokens: usize,
    },
    /// The request ended; the last event for this id.
    Done {
        /// Request.
        id: RequestId,
        /// How it ended.
        outcome: Outcome,
        /// Remaining held-back text (non-empty only for finished requests).
        text: String,
        /// Token counts.
        usage: Usage,
    },
}

/// A sampled token's log-probability under the model (before sampling's penalties and
/// temperature), with the most likely alternatives.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprobs {
    /// Log-probability of the sampled token.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// The log-softmax of `logits` at `token`, and the `k` most likely entries.
    pub fn of(logits: &[f32], token: u32, k: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        if k > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if top.len() < k || l > top[top.len() - 1].1 {
                    let at = top.partition_point(|&(_, v)| v >= l);
                    top.insert(at, (i as u32, l));
                    top.truncate(k);
                }
            }
        }
        Self {
            logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |l| l - lse),
            top: top.into_iter().map(|(i, l)| (i, l - lse)).collect(),
        }
    }
}

/// Which part of a request this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// All of it: prefill, then decode.
    Whole,
    /// A prefill node's half of a disaggregated request: compute the prompt but its last
    /// token, then hand the pages to a transfer instead of sampling.
    PrefillOnly,
    /// A decode node's half: its pages open for its prompt's KV to arrive from the prefill node,
    /// then it decodes as a whole request does.
    DecodeOnly,
}

/// How far a sequence has come: which container holds it says the rest (`waiting`,
/// `receiving`, `running`, `held`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Queued without pages.
    Queued,
    /// Its pages are open in the pool.
    Open,
}

struct Seq {
    id: RequestId,
    /// The id its log lines carry (its `x-request-id`).
    request_id: String,
    role: Role,
    phase: Phase,
    logprobs: Option<usize>,
    owner: TenantId,
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    /// Prompt tokens the prefix cache served.
    cached: usize,
    max_tokens: usize,
    /// Times it gave its pages up for others to grow into (see [`Engine::grow_running`]).
    preempted: u32,
    /// Positions it had computed when it was last preempted: it is not preempted again while it
    /// computes them again (which its tenant is charged for, as for any work done for it: a
    /// tenant preempted was the more served one, and what it costs the machine is its share).
    high_water: usize,
    ignore_eos: bool,
    sampler: Sampler,
    text: TextStream,
    /// Its tokens' verdicts, when something outside steers it (see [`steer`]).
    steer: Option<Arc<Steer>>,
    /// The step it last computed in (0: never).
    last: u64,
}

impl Seq {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The positions this sequence computes before it next samples (or, prefill-only, before
    /// its transfer): every token it has, or for a prefill node the prompt but its last token,
    /// whose logits the decode node computes.
    fn target(&self) -> usize {
        if self.role == Role::PrefillOnly {
            self.prompt_len - 1
        } else {
            self.tokens.len()
        }
    }

    /// Whether its pages are still to open for KV that arrives from a prefill node.
    fn awaits_kv(&self) -> bool {
        self.role == Role::DecodeOnly && self.phase == Phase::Queued
    }

    /// Whether computing up to `upto` ends in a token to sample.
    fn samples_at(&self, upto: usize) -> bool {
        self.role != Role::PrefillOnly && upto == self.tokens.len()
    }

    /// Whether it waits for the verdict on a token it emitted before it may go on.
    fn awaits_verdict(&self) -> bool {
        self.steer.as_ref().is_some_and(|s| s.pending())
    }

    /// Whether it ever held pages (its prompt counts as used).
    fn started(&self) -> bool {
        self.phase == Phase::Open || self.preempted > 0
    }

    /// Whether it computes again what it had computed before it was preempted.
    fn recomputing(&self) -> bool {
        self.computed < self.high_water
    }

    /// The positions its next chunk may reach: as [`target`](Self::target), but a chunk never
    /// mixes prompt and output tokens (they take different attention), which only a sequence
    /// computing its tokens again after a preemption would.
    fn chunk_target(&self) -> usize {
        if self.computed < self.prompt_len {
            self.target().min(self.prompt_len)
        } else {
            self.target()
        }
    }

    /// The attention its next tokens take (see [`chunk_target`](Self::chunk_target)).
    fn attention(&self) -> Attention {
        if self.computed < self.prompt_len {
            Attention::Prompt
        } else {
            Attention::Output
        }
    }

    /// Whether it may still need pages it does not hold.
    fn may_grow(&self, pool: &KvPool) -> bool {
        self.role != Role::PrefillOnly
            && pool
                .pages_of(self.id.seq())
                .is_ok_and(|p| p < pool.pages_for(self.prompt_len + self.max_tokens))
    }

    /// The pages it opens with: its tokens so far and the next one (within what it may ever
    /// hold). Its reservation grows as it decodes.
    fn opening_tokens(&self) -> usize {
        (self.tokens.len() + 1).min(self.prompt_len + self.max_tokens)
    }
}

/// What makes room for a sequence whose next page cannot be had (see [`Engine::victim`]).
enum Room {
    /// Preempting the running sequence at this index (perhaps the one that grows).
    Preempt(usize),
    /// Nothing: it holds all it ever may, and ends.
    Never,
}

/// The engine. Single-threaded: one caller drives [`step`](Engine::step); the kernels inside use
/// the rayon pool.
pub struct Engine {
    model: Arc<dyn Forward>,
    detok: Arc<dyn Detokenizer>,
    cfg: EngineConfig,
    pool: KvPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    next_id: RequestId,
    /// Per-tenant settings; tenants absent use the engine's, with weight 1.
    tenants: HashMap<TenantId, TenantSettings>,
    /// Machine time served per tenant, in milliseconds: each step's time shared among the
    /// sequences in it by what each adds (see [`CostModel::shares`]), divided by the tenant's
    /// weight.
    served: HashMap<TenantId, f64>,
    /// The public prefixes in force, in whole pages.
    public_prefixes: Vec<Vec<u32>>,
    /// Prefill-only sequences done computing, holding their pages until their transfer is
    /// acknowledged (or cancelled).
    held: HashMap<RequestId, Seq>,
    /// Sequences opened for a transfer, waiting for their prompt's KV to arrive.
    receiving: HashMap<RequestId, Seq>,
    /// How long steps take, fitted from the recent ones: for the step target.
    cost: CostModel,
    /// Tokens computed since the engine started (prefill and decode).
    computed: u64,
    /// Sequences preempted since the engine started.
    preemptions: u64,
    /// Steps run since the engine started.
    steps: u64,
    /// Requests the last step admitted (first gave their pages), with when: their time in the
    /// queue ends there.
    admitted: Vec<(RequestId, Instant)>,
    scratch: Scratch,
    events: Vec<Event>,
}

pub use schedule::MIN_PREFILL_TOKENS;

/// Errors creating an engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The KV pool refused the configuration (including invariant 4).
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A setting out of range.
    #[error("invalid engine setting: {0}")]
    Config(String),
}

impl Engine {
    /// An engine over `model`. Refuses to start when the KV pool cannot hold `cfg.max_context`
    /// tokens (invariant 4), naming both numbers.
    pub fn new(model: Arc<dyn Forward>, detok: Arc<dyn Detokenizer>, cfg: EngineConfig) -> Result<Self, EngineError> {
        Self::build(model, detok, cfg, true)
    }

    /// An engine that skips invariant 4's check: the configuration of the 2026 incident, for
    /// the tests that show the other checks still hold. Test builds only.
    #[cfg(test)]
    pub(crate) fn new_without_capacity_check(
        model: Arc<dyn Forward>,
        detok: Arc<dyn Detokenizer>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::build(model, detok, cfg, false)
    }

    fn build(
        model: Arc<dyn Forward>,
        detok: Arc<dyn Detokenizer>,
        cfg: EngineConfig,
        check_capacity: bool,
    ) -> Result<Self, EngineError> {
        if cfg.max_batch_tokens == 0 || cfg.max_running == 0 || cfg.max_context == 0 {
            return Err(EngineError::Config(
                "max_batch_tokens, max_running and max_context must be positive".into(),
            ));
        }
        let mc = model.config();
        let mut pool = KvPool::new(mc.attn_shape(cfg.page_size), mc.n_layers, cfg.kv_memory_bytes)?;
        if check_capacity {
            pool.check_capacity(cfg.max_context)?;
        }
        // Pins never take the room of one request of the maximum context (invariant 4 holds for
        // the pages that can be had, not only for the pool).
        pool.set_pin_ceiling(Self::pinnable(&pool, &cfg));
        Ok(Self {
            model,
            detok,
            cfg,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: RequestId(1),
            tenants: HashMap::new(),
            served: HashMap::new(),
            public_prefixes: Vec::new(),
            held: HashMap::new(),
            receiving: HashMap::new(),
            cost: CostModel::default(),
            computed: 0,
            preemptions: 0,
            steps: 0,
            admitted: Vec::new(),
            scratch: Scratch::default(),
            events: Vec::new(),
        })
    }

    /// The model.
    pub fn model(&self) -> &Arc<dyn Forward> {
        &self.model
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The KV pool's counters.
    pub fn kv_counters(&self) -> KvCounters {
        self.pool.counters()
    }

    /// Forgets tenant `owner` (it was deleted): everything it has in the prefix cache, its page
    /// cap and floor, its settings and its counter.
    pub fn forget_owner(&mut self, owner: TenantId) {
        self.pool.forget_owner(owner);
        self.pool.set_owner_budget(owner, None);
        self.pool.set_owner_floor(owner, 0);
        self.pool.set_public_access(owner, false);
        self.tenants.remove(&owner);
        self.served.remove(&owner);
    }

    /// Applies tenant `owner`'s settings: its weight, its page cap and floor in the pool, whether
    /// it reuses prefixes (turning that off drops its cache), whether it may read public
    /// prefixes, and its pin cap.
    pub fn set_tenant(&mut self, owner: TenantId, settings: TenantSettings) {
        if self.tenants.get(&owner) == Some(&settings) {
            return;
        }
        self.pool.set_owner_budget(owner, settings.max_pages);
        self.pool.set_owner_floor(owner, settings.min_pages);
        if !settings.prefix_cache {
            self.pool.forget_owner(owner);
        }
        self.pool
            .set_public_access(owner, settings.prefix_cache && settings.public_prefixes);
        self.tenants.insert(owner, settings);
    }

    /// Tenant `owner`'s virtual counter.
    fn served(&self, owner: TenantId) -> f64 {
        self.served.get(&owner).copied().unwrap_or(0.0)
    }

    /// Tenant `owner`'s weight (1 unless its policy says otherwise).
    fn weight(&self, owner: TenantId) -> f64 {
        f64::from(self.tenants.get(&owner).map_or(1, |t| t.weight.max(1)))
    }

    /// Running sequences per tenant.
    fn running_per_owner(&self) -> HashMap<TenantId, usize> {
        let mut n = HashMap::new();
        for s in &self.running {
            *n.entry(s.owner).or_insert(0) += 1;
        }
        n
    }

    /// Whether `owner` has a request waiting or running.
    fn active(&self, owner: TenantId) -> bool {
        self.waiting.iter().chain(&self.running).any(|s| s.owner == owner)
    }

    /// The KV pool (tests and the admin API set budgets through it).
    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// Admission limits in force.
    pub fn limits(&self) -> AdmissionLimits {
        AdmissionLimits {
            max_context: self.cfg.max_context,
            vocab: self.model.config().vocab,
            pool_tokens: self.pool.capacity_tokens(),
        }
    }

    /// Requests waiting plus running.
    pub fn pending(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    /// The KV pool, for reading (a transfer's sender exports from it).
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// Tokens computed since the engine started, prefill and decode.
    pub fn tokens_computed(&self) -> u64 {
        self.computed
    }

    /// Sequences preempted since the engine started: each gave its pages up for a sequence the
    /// scheduler favours to grow into, and computes its tokens again when readmitted.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Requests the last step admitted, each with when it was given its pages: the end of its
    /// time in the queue (a readmission after a preemption is not one).
    pub fn take_admitted(&mut self) -> Vec<(RequestId, Instant)> {
        std::mem::take(&mut self.admitted)
    }

    /// Requests waiting for a slot, and sequences running.
    pub fn queue_lengths(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Admits a request or rejects it. A rejected request allocates nothing and never runs.
    pub fn submit(&mut self, req: ValidRequest) -> Result<RequestId, Rejected> {
        self.admit(&req)?;
        self.enqueue(req, Role::Whole)
    }

    /// Admission of a validated request: what needs the engine's state, its tenant's KV budget
    /// (the queue's bound is [`enqueue`](Self::enqueue)'s). An open-ended request needs room for
    /// its prompt and one token; it ends with `length` where the budget stops its growth.
    fn admit(&self, valid: &ValidRequest) -> Result<(), Rejected> {
        let r = valid.request();
        let completion = if r.open_ended { 1 } else { r.max_tokens };
        let needed = self.pool.pages_for(r.prompt.len() + completion);
        // Its own cap, and what other tenants' floors and everyone's pins leave it.
        let budget = self
            .pool
            .owner_budget(r.owner)
            .unwrap_or(usize::MAX)
            .min(self.pool.pages_open_to(r.owner));
        if needed > budget {
            return Err(Rejected {
                reason: RejectReason::OverKvBudget { needed, budget },
            });
        }
        Ok(())
    }

    /// Queues a request that passed admission.
    fn enqueue(&mut self, valid: ValidRequest, role: Role) -> Result<RequestId, Rejected> {
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(Rejected {
                reason: RejectReason::QueueFull {
                    limit: self.cfg.max_waiting,
                },
            });
        }
        let ValidRequest {
            req: r,
            constraint,
            steer,
        } = valid;
        // A tenant that was idle starts at the lowest counter of the active ones (the VTC's
        // lift): idling banks no credit against tenants that kept the engine busy. On an idle
        // engine it starts at the highest counter, so what others were served while nobody
        // contended counts against no one.
        if !self.active(r.owner) {
            let active_min = self
                .waiting
                .iter()
                .chain(&self.running)
                .map(|s| self.served(s.owner))
                .fold(f64::INFINITY, f64::min);
            let lift = if active_min.is_finite() {
                active_min
            } else {
                self.served.values().copied().fold(0.0, f64::max)
            };
            let c = self.served.entry(r.owner).or_insert(0.0);
            *c = c.max(lift);
        }
        let id = self.next_id;
        self.next_id = self.next_id.next();
        self.waiting.push_back(Seq {
            id,
            request_id: r.request_id,
            role,
            phase: Phase::Queued,
            logprobs: r.logprobs,
            owner: r.owner,
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            computed: 0,
            cached: 0,
            max_tokens: r.max_tokens,
            preempted: 0,
            high_water: 0,
            ignore_eos: r.ignore_eos,
            sampler: Sampler::new(r.sampling, constraint),
            text: TextStream::new(r.stop),
            steer,
            last: 0,
        });
        Ok(id)
    }

    /// Cancels a request through the retirement path. Returns whether it was still pending.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        self.end(id, Outcome::Aborted(AbortReason::Cancelled))
    }

    /// Ends a request early as finished (`stop`), e.g. when its plugin says so; through the
    /// retirement path. Returns whether it was still pending.
    pub fn stop(&mut self, id: RequestId) -> bool {
        self.end(id, Outcome::Finished(FinishReason::Stop))
    }

    fn end(&mut self, id: RequestId, outcome: Outcome) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(i).expect("index from position");
            self.retire(seq, outcome);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.swap_remove(i);
            self.retire(seq, outcome);
            return true;
        }
        if let Some(seq) = self.receiving.remove(&id) {
            self.retire(seq, outcome);
            return true;
        }
        self.release_prefilled(id)
    }

    /// Aborts everything pending (shutdown).
    pub fn abort_all(&mut self) -> Vec<Event> {
        let held: Vec<RequestId> = self.held.keys().copied().collect();
        for id in held {
            self.release_prefilled(id);
        }
        let receiving: Vec<Seq> = self.receiving.drain().map(|(_, s)| s).collect();
        let all: Vec<Seq> = self
            .waiting
            .drain(..)
            .chain(self.running.drain(..))
            .chain(receiving)
            .collect();
        for s in all {
            self.retire(s, Outcome::Aborted(AbortReason::Shutdown));
        }
        std::mem::take(&mut self.events)
    }

    /// The one way a scheduled request ends.
    fn retire(&mut self, mut seq: Seq, outcome: Outcome) {
        if let Outcome::Aborted(AbortReason::Isolation(v)) = &outcome {
            self.report_violation(&seq, v);
        }
        if seq.phase == Phase::Open {
            // Closing cannot fail for an open sequence; its pages go back once unreferenced.
            let _ = self.pool.close(seq.id.seq());
        }
        let text = match outcome {
            Outcome::Finished(_) => seq.text.finish(),
            Outcome::Aborted(_) => String::new(),
        };
        // A request that never got a slot used nothing: it books no prompt.
        let usage = Usage {
            prompt_tokens: if seq.started() { seq.prompt_len } else { 0 },
            completion_tokens: seq.output_len(),
            cached_tokens: seq.cached,
        };
        self.events.push(Event::Done {
            id: seq.id,
            outcome,
            text,
            usage,
        });
    }

    /// Logs a refused KV read or write at ERROR (target `warden::isolation`): the tenant, the
    /// request, the page, the owner and epoch the sequence's table expected, and those the
    /// page's tag holds. Called before the sequence's pages are closed.
    fn report_violation(&self, seq: &Seq, v: &IsolationViolation) {
        let page = match *v {
            IsolationViolation::ForeignOwner { page, .. }
            | IsolationViolation::PublicPage { page }
            | IsolationViolation::StaleEpoch { page, .. }
            | IsolationViolation::UnwrittenSlots { page, .. }
            | IsolationViolation::NoSuchPage { page, .. } => Some(page),
            _ => None,
        };
        let entry = page.and_then(|p| {
            let (_, table) = self.pool.table(seq.id.seq()).ok()?;
            table.iter().find(|e| e.page == p).copied()
        });
        let tag = page.and_then(|p| self.pool.tags().get(p as usize).copied());
        let shown = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        tracing::error!(
            target: "warden::isolation",
            tenant = %seq.owner,
            request_id = %seq.request_id,
            engine_id = %seq.id,
            page = %shown(page.map(|p| p.to_string())),
            expected_owner = %seq.owner,
            expected_epoch = %shown(entry.map(|e| e.epoch.to_string())),
            found_owner = %shown(tag.map(|t| t.owner.to_string())),
            found_epoch = %shown(tag.map(|t| t.epoch.to_string())),
            violation = %v,
            "KV isolation violation: the request was stopped, and nothing it read was returned"
        );
    }

    /// Moves waiting requests into the running set while slots and KV reservations allow:
    /// across tenants the least served first (by virtual counter, see [`schedule::next_to_admit`]),
    /// within a tenant in arrival order. A request whose owner is at its KV budget, or that
    /// follows a prefill of its owner, waits without blocking the others.
    ///
    /// Running slots and KV pages are shared fairly, not first come: a request whose tenant holds
    /// less than its share (by weight) takes a slot back from the tenant holding the most
    /// ([`slot_victim`](Self::slot_victim)), and pages from the tenant holding the most pages
    /// ([`page_victim`](Self::page_victim)), preempting that tenant's sequences as a running
    /// sequence's growth does (they compute their tokens again when readmitted, and go on where
    /// they were).
    fn admit_waiting(&mut self) {
        let mut passed: HashSet<RequestId> = HashSet::new();
        // Tenants that neither find a free slot nor are owed one this pass.
        let mut no_slot: HashSet<TenantId> = HashSet::new();
        // What was admitted in this pass, per tenant (its estimated cost over its weight):
        // counted in the order at once, so one tenant does not take every free slot before a
        // step runs.
        let mut admitted: HashMap<TenantId, f64> = HashMap::new();
        // Transferred requests whose prompt's KV arrived hold their pages already: they take
        // the first free slots, so the pages they hold never wait behind a request that needs
        // more pages than are free (which would wait for them forever).
        while self.running.len() < self.cfg.max_running {
            let Some(i) = self.waiting.iter().position(|s| s.phase == Phase::Open) else {
                break;
            };
            let seq = self.waiting.remove(i).expect("index in range");
            self.running.push(seq);
        }
        while let Some(i) = self.next_to_admit(&passed, &no_slot, &admitted) {
            let s = &self.waiting[i];
            if !s.awaits_kv() && self.follows_a_prefill(s) {
                passed.insert(s.id);
                continue;
            }
            if self.running.len() >= self.cfg.max_running {
                match self.slot_victim(s.owner) {
                    // Not readmitted in this pass: what a preemption frees goes to the request
                    // it was made for (and nothing moves back and forth).
                    Some(j) => {
                        passed.insert(self.running[j].id);
                        self.preempt(j);
                    }
                    None => {
                        no_slot.insert(s.owner);
                    }
                }
                continue;
            }
            let pages = self.pool.pages_for(s.opening_tokens());
            // The last token is always computed: its logits give the next one. A transferred
            // prompt's KV all comes from the prefill node.
            let reusable = if self.prefix_cache_for(s.owner) && !s.awaits_kv() {
                &s.tokens[..s.tokens.len() - 1]
            } else {
                &[]
            };
            // A page for each running sequence that may grow: admitting does not take the pages
            // they are about to need.
            let headroom = self.running.iter().filter(|r| r.may_grow(&self.pool)).count();
            // A preempted sequence that can never have its pages again (a reload lowered its
            // tenant's cap or raised others' floors) ends with what it generated.
            let most = self
                .pool
                .owner_budget(s.owner)
                .unwrap_or(usize::MAX)
                .min(self.pool.pages_open_to(s.owner));
            if s.preempted > 0 && pages > most {
                let seq = self.waiting.remove(i).expect("index in range");
                self.retire(seq, Outcome::Finished(FinishReason::Length));
                continue;
            }
            match self.pool.open_leaving(s.id.seq(), s.owner, pages, reusable, headroom) {
                Ok(cached) => {
                    // What it will compute before it samples (its prompt, or after a preemption
                    // everything it had), counted now.
                    let computes = self.cost.estimate(Work::chunk(
                        cached,
                        s.target().saturating_sub(cached),
                        Attention::Prompt,
                        false,
                    ));
                    *admitted.entry(s.owner).or_insert(0.0) += computes / self.weight(s.owner);
                    let mut seq = self.waiting.remove(i).expect("index in range");
                    let awaited_kv = seq.awaits_kv();
                    seq.phase = Phase::Open;
                    seq.computed = cached;
                    if seq.preempted == 0 {
                        seq.cached = cached;
                        self.admitted.push((seq.id, Instant::now()));
                    }
                    if awaited_kv {
                        self.events.push(Event::Opened { id: seq.id });
                        self.receiving.insert(seq.id, seq);
                    } else {
                        self.running.push(seq);
                    }
                }
                Err(KvError::OwnerBudget { .. }) => {
                    passed.insert(s.id);
                }
                // It can never fit while other tenants' floors and the pins stand (a reload
                // raised a floor after it was submitted): it ends with its error instead of
                // waiting at the head of the queue.
                Err(e @ KvError::PoolExhausted { .. }) if pages > self.pool.pages_open_to(s.owner) => {
                    let seq = self.waiting.remove(i).expect("index in range");
                    self.retire(seq, Outcome::Aborted(AbortReason::Kv(e)));
                }
                // Refused only for other owners' guaranteed floors: the next owner may fit.
                Err(KvError::PoolExhausted { wanted, .. }) if wanted <= self.pool.available_pages() => {
                    passed.insert(s.id);
                }
                // Pages taken back from the tenant holding the most, if this one is owed them;
                // else wait for running sequences to finish and free pages.
                Err(KvError::PoolExhausted { .. }) => match self.page_victim(s.owner, pages) {
                    Some(j) => {
                        passed.insert(self.running[j].id);
                        self.preempt(j);
                    }
                    None => break,
                },
                Err(e) => {
                    let seq = self.waiting.remove(i).expect("index in range");
                    self.retire(seq, Outcome::Aborted(AbortReason::Kv(e)));
                }
            }
        }
    }

    /// The waiting request to admit next, skipping `passed` and the requests of `no_slot`'s
    /// tenants (see [`schedule::next_to_admit`]).
    fn next_to_admit(
        &self,
        passed: &HashSet<RequestId>,
        no_slot: &HashSet<TenantId>,
        admitted: &HashMap<TenantId, f64>,
    ) -> Option<usize> {
        let waiting = self
            .waiting
            .iter()
            .map(|s| (!passed.contains(&s.id) && !no_slot.contains(&s.owner)).then_some(s.owner));
        let running = self.running_per_owner();
        let counter = |o: TenantId| self.served(o) + admitted.get(&o).copied().unwrap_or(0.0);
        schedule::next_to_admit(waiting, &counter, &|o| running.get(&o).copied().unwrap_or(0))
    }

    /// The running sequence to preempt so that a request of `owner` gets a slot, when every slot
    /// is taken: of the tenants served at least as much as `owner` (by virtual counter), the one
    /// holding the most slots per weight, if it holds more per weight than `owner` would with one
    /// more (so no slot ever moves back and forth). Its sequence whose preemption loses the least
    /// goes ([`cheapest`](Self::cheapest)).
    fn slot_victim(&self, owner: TenantId) -> Option<usize> {
        let running = self.running_per_owner();
        let share = |o: TenantId, n: usize| n as f64 / self.weight(o);
        let after = share(owner, running.get(&owner).copied().unwrap_or(0) + 1);
        let (&most, &n) = running
            .iter()
            .filter(|&(&o, _)| o != owner && self.served(o) >= self.served(owner))
            .max_by(|a, b| share(*a.0, *a.1).total_cmp(&share(*b.0, *b.1)).then(a.0.cmp(b.0)))?;
        if share(most, n) <= after {
            return None;
        }
        self.cheapest(most, |_| true)
    }

    /// The running sequence to preempt so that a request of `owner` needing `pages` gets them:
    /// of the tenants served at least as much as `owner`, the one holding the most pages per
    /// weight, if it holds more per weight than `owner` would with them and keeps its guaranteed
    /// floor without the sequence. Its sequence whose preemption loses the least goes.
    fn page_victim(&self, owner: TenantId, pages: usize) -> Option<usize> {
        let share = |o: TenantId, n: usize| n as f64 / self.weight(o);
        let after = share(owner, self.pool.pages_held(owner) + pages);
        let mut holders: Vec<TenantId> = self
            .running
            .iter()
            .map(|s| s.owner)
            .filter(|&o| o != owner && self.served(o) >= self.served(owner))
            .collect();
        holders.sort();
        holders.dedup();
        let most = holders
            .into_iter()
            .map(|o| (o, self.pool.pages_held(o)))
            .max_by(|a, b| share(a.0, a.1).total_cmp(&share(b.0, b.1)).then(a.0.cmp(&b.0)))?;
        if share(most.0, most.1) <= after {
            return None;
        }
        let floor = self.pool.owner_floor(most.0);
        self.cheapest(most.0, |r| {
            let its = self.pool.pages_of(r.id.seq()).unwrap_or(0);
            its > 0 && most.1.saturating_sub(its) >= floor
        })
    }

    /// Of `owner`'s running sequences that `may` allow and that are not computing again what an
    /// earlier preemption took, the one whose preemption loses the least: the fewest positions
    /// computed, then the newest.
    fn cheapest(&self, owner: TenantId, may: impl Fn(&Seq) -> bool) -> Option<usize> {
        (0..self.running.len())
            .filter(|&j| {
                let r = &self.running[j];
                r.owner == owner && !r.recomputing() && may(r)
            })
            .min_by_key(|&j| (self.running[j].computed, std::cmp::Reverse(self.running[j].id)))
    }

    /// Gives each running sequence the pages its next positions need (a decode's next position
    /// may begin a page). The sequences the scheduler favours grow first: the least served
    /// tenant's, then the oldest. One whose page cannot be had makes room by preempting a
    /// sequence the scheduler favours less ([`victim`](Self::victim)), perhaps itself; one that
    /// holds all it ever may ends with `length`.
    fn grow_running(&mut self) {
        // Those waiting for a verdict too: it may come before the step is planned.
        let mut order: Vec<(f64, RequestId)> = self
            .running
            .iter()
            .filter(|s| {
                self.pool
                    .pages_of(s.id.seq())
                    .is_ok_and(|p| p < self.pool.pages_for(s.target()))
            })
            .map(|s| (self.served(s.owner), s.id))
            .collect();
        order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (_, id) in order {
            while let Some(i) = self.running.iter().position(|s| s.id == id) {
                let s = &self.running[i];
                let err = match self.pool.reserve_to(s.id.seq(), self.pool.pages_for(s.target())) {
                    Ok(()) => break,
                    Err(e) => e,
                };
                match self.victim(i, &err) {
                    Some(Room::Preempt(j)) => self.preempt(j),
                    Some(Room::Never) => {
                        let seq = self.running.swap_remove(i);
                        self.retire(seq, Outcome::Finished(FinishReason::Length));
                    }
                    None => {
                        let seq = self.running.swap_remove(i);
                        self.retire(seq, Outcome::Aborted(AbortReason::Kv(err)));
                    }
                }
            }
        }
    }

    /// What makes room for running sequence `i`, refused its next page with `err` (`None`: an
    /// error no preemption answers). Under its tenant's cap, only that tenant's pages help: its
    /// newest sequence goes. For the pool, the sequence the scheduler favours least among those
    /// it favours less than `i` (a more served tenant's, or a newer one of the same tenant),
    /// except one that would leave its tenant below its guaranteed floor (those pages would
    /// stay out of reach anyway), one still computing again what it lost to a preemption, and
    /// one of another tenant that holds fewer pages per weight than `i`'s (a tenant that fills
    /// the pool grows into its own pages, not into those of a tenant holding less); with none,
    /// `i` itself waits. A sequence that alone outgrows what it may hold never fits.
    fn victim(&self, i: usize, err: &KvError) -> Option<Room> {
        let s = &self.running[i];
        let owner = s.owner;
        let holds = self.pool.pages_of(s.id.seq()).unwrap_or(0);
        let key = |r: &Seq| (schedule::OrdF64(self.served(r.owner)), r.id);
        let room = match err {
            KvError::OwnerBudget { .. } => {
                let newest = (0..self.running.len())
                    .filter(|&j| self.running[j].owner == owner)
                    .max_by_key(|&j| self.running[j].id)
                    .unwrap_or(i);
                if newest == i && self.pool.pages_held(owner) <= holds {
                    Room::Never
                } else {
                    Room::Preempt(newest)
                }
            }
            KvError::PoolExhausted { .. } => {
                let above_floor = |r: &Seq| {
                    let its = self.pool.pages_of(r.id.seq()).unwrap_or(0);
                    self.pool.pages_held(r.owner).saturating_sub(its) >= self.pool.owner_floor(r.owner)
                };
                let per_weight = |o: TenantId| self.pool.pages_held(o) as f64 / self.weight(o);
                let holds_more = |r: &Seq| per_weight(r.owner) >= per_weight(owner);
                let yields = |r: &Seq| {
                    key(r) > key(s) && !r.recomputing() && (r.owner == owner || (above_floor(r) && holds_more(r)))
                };
                let least = (0..self.running.len())
                    .filter(|&j| yields(&self.running[j]))
                    .max_by_key(|&j| key(&self.running[j]));
                // Failing that, its tenant's floor still holds: a sequence whose preemption
                // would leave its tenant below its floor takes its page from whoever is above
                // theirs (the most served first), however it stands otherwise.
                let for_floor = || {
                    (0..self.running.len())
                        .filter(|&j| j != i)
                        .filter(|&j| !self.running[j].recomputing() && above_floor(&self.running[j]))
                        .max_by_key(|&j| key(&self.running[j]))
                };
                match least {
                    Some(j) => Room::Preempt(j),
                    None if self.pool.pages_for(s.target()) > self.pool.pages_open_to(owner) => Room::Never,
                    None if !above_floor(s) => Room::Preempt(for_floor().unwrap_or(i)),
                    None => Room::Preempt(i),
                }
            }
            _ => return None,
        };
        Some(room)
    }

    /// Preempts running sequence `i`: its pages go back (its whole pages stay in its tenant's
    /// prefix cache, where that is on) and it waits at the head of the queue. Readmitted, it
    /// computes its tokens again and samples on from where it was, keeping its sampler,
    /// constraint, steering and held-back text, so its output is as if it had never stopped.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.swap_remove(i);
        let _ = self.pool.close(seq.id.seq());
        seq.phase = Phase::Queued;
        seq.high_water = seq.high_water.max(seq.computed);
        seq.computed = 0;
        // A decode node computes a transferred prompt itself from now on.
        if seq.role == Role::DecodeOnly {
            seq.role = Role::Whole;
        }
        seq.preempted += 1;
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Plans a step over the running set (see [`schedule::Planner::plan`]). Returns (running
    /// index, new tokens).
    fn plan(&self) -> Vec<(usize, usize)> {
        // A sequence that waits for a verdict sits this step out.
        let ready: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].awaits_verdict())
            .collect();
        let running: Vec<SeqView> = ready
            .iter()
            .map(|&i| {
                let s = &self.running[i];
                SeqView {
                    owner: s.owner,
                    computed: s.computed,
                    target: s.chunk_target(),
                    samples: s.samples_at(s.chunk_target()),
                    attention: s.attention(),
                    last: s.last,
                }
            })
            .collect();
        let served = |o: TenantId| self.served(o);
        Planner {
            max_batch_tokens: self.cfg.max_batch_tokens,
            step_target: self.cfg.step_target,
            cost: &self.cost,
            served: &served,
        }
        .plan(&running)
        .into_iter()
        .map(|(k, n)| (ready[k], n))
        .collect()
    }

    /// Whether a running sequence waits for the verdict on its last token (its driver may wait
    /// a moment for it, so the sequence joins the next step).
    pub fn awaits_verdicts(&self) -> bool {
        self.running.iter().any(Seq::awaits_verdict)
    }

    /// Runs one step and returns its events.
    pub fn step(&mut self) -> Vec<Event> {
        // Only this step's admissions are kept: a caller that never takes them holds no more.
        self.admitted.clear();
        self.steps += 1;
        self.admit_waiting();
        self.hold_prefilled();
        self.grow_running();
        let mut ends: Vec<Option<Outcome>> = vec![None; self.running.len()];
        let mut step = Vec::new();
        for (i, n) in self.plan() {
            let s = &self.running[i];
            let upto = s.computed + n;
            match self
                .pool
                .ensure(s.id.seq(), upto)
                .and_then(|()| self.pool.commit_slots(s.id.seq(), upto))
            {
                Ok(()) => {
                    self.running[i].last = self.steps;
                    step.push((i, n));
                }
                Err(KvError::Isolation(v)) => ends[i] = Some(Outcome::Aborted(AbortReason::Isolation(v))),
                Err(e) => ends[i] = Some(Outcome::Aborted(AbortReason::Kv(e))),
            }
        }
        if !step.is_empty() {
            // Constrained sequences' next masks depend only on their tokens so far: computed
            // while the forward pass runs, on whatever worker it leaves free.
            let mut masks: Vec<(usize, Constraint)> = step
                .iter()
                .filter_map(|&(i, _)| self.running[i].sampler.take_constraint().map(|c| (i, c)))
                .collect();
            // A steered sequence's verdict on its last token holds for the token this step
            // samples.
            for &(i, n) in &step {
                let s = &mut self.running[i];
                if s.samples_at(s.computed + n)
                    && let Some(c) = s.steer.as_ref().and_then(|st| st.take())
                {
                    s.sampler.steer_next(c);
                }
            }
            let seqs: Vec<StepSeq<'_>> = step
                .iter()
                .map(|&(i, n)| {
                    let s = &self.running[i];
                    StepSeq {
                        seq: s.id.seq(),
                        tokens: &s.tokens[s.computed..s.computed + n],
                        pos0: s.computed,
                        want_logits: s.samples_at(s.computed + n),
                        prompt: s.computed < s.prompt_len,
                    }
                })
                .collect();
            // Each sequence's part of the step, with its tenant, and the whole.
            let parts: Vec<(TenantId, Work)> = step
                .iter()
                .map(|&(i, n)| {
                    let s = &self.running[i];
                    (
                        s.owner,
                        Work::chunk(s.computed, n, s.attention(), s.samples_at(s.computed + n)),
                    )
                })
                .collect();
            let work = parts.iter().fold(Work::default(), |w, &(_, p)| w.plus(p));
            let started = Instant::now();
            let (model, pool, scratch, check) = (&self.model, &mut self.pool, &mut self.scratch, self.cfg.tag_check);
            let (results, ()) = rayon::join(
                || model.forward(pool, &seqs, check, scratch),
                || masks.par_iter_mut().for_each(|(_, c)| c.prepare()),
            );
            drop(seqs);
            for (i, c) in masks {
                self.running[i].sampler.put_constraint(c);
            }
            self.computed += work.tokens as u64;
            let mut to_sample: Vec<Option<Vec<f32>>> = vec![None; self.running.len()];
            for (&(i, n), r) in step.iter().zip(results) {
                let owner = self.running[i].owner;
                let caches = self.prefix_cache_for(owner);
                let s = &mut self.running[i];
                match r {
                    Err(StepError::Isolation(v)) => ends[i] = Some(Outcome::Aborted(AbortReason::Isolation(v))),
                    Err(StepError::Kv(e)) => ends[i] = Some(Outcome::Aborted(AbortReason::Kv(e))),
                    Ok(logits) => {
                        s.computed += n;
                        to_sample[i] = logits;
                        // Offered to the cache only when the step filled a page (most decode
                        // steps fill none).
                        let ps = self.cfg.page_size;
                        if caches
                            && s.computed / ps > (s.computed - n) / ps
                            && let Err(e) = self.pool.cache_computed(s.id.seq(), &s.tokens[..s.computed])
                        {
                            ends[i] = Some(match e {
                                KvError::Isolation(v) => Outcome::Aborted(AbortReason::Isolation(v)),
                                e => Outcome::Aborted(AbortReason::Kv(e)),
                            });
                        }
                    }
                }
            }
            // Sampling is independent per sequence: spread it over the pool, then accept the
            // tokens in order.
            type Pick = Result<(u32, Option<TokenLogprobs>), ConstraintError>;
            let picks: Vec<Option<Pick>> = self
                .running
                .par_iter_mut()
                .zip(to_sample.into_par_iter())
                .map(|(s, logits)| {
                    let mut logits = logits?;
                    let raw = s.logprobs.map(|k| (logits.clone(), k));
                    let tok = s.sampler.sample(&mut logits, &s.tokens, s.prompt_len);
                    Some(tok.map(|tok| (tok, raw.map(|(raw, k)| TokenLogprobs::of(&raw, tok, k)))))
                })
                .collect();
            for (i, pick) in picks.into_iter().enumerate() {
                match pick {
                    Some(Ok((tok, lp))) => {
                        ends[i] = Self::accept(&*self.detok, &mut self.events, &mut self.running[i], tok, lp);
                    }
                    Some(Err(e)) => ends[i] = Some(Outcome::Aborted(AbortReason::Constraint(e))),
                    None => {}
                }
            }
            // The whole step, its sampling included: what a step target and a tenant leading a
            // step wait for (the logit rows' coefficient carries the sampling).
            let took = started.elapsed();
            self.cost.observe(work, took);
            // Each tenant is charged its sequences' shares of the step's time (computing again
            // what a preemption took too: it is work the machine does for the tenant).
            let works: Vec<Work> = parts.iter().map(|&(_, w)| w).collect();
            for (&(owner, _), share) in parts.iter().zip(self.cost.shares(&works, took)) {
                *self.served.entry(owner).or_insert(0.0) += share / self.weight(owner);
            }
        }
        // Retire in reverse index order, so swap_remove keeps the lower indices valid.
        for (i, end) in ends.into_iter().enumerate().rev() {
            if let Some(outcome) = end {
                let seq = self.running.swap_remove(i);
                self.retire(seq, outcome);
            }
        }
        self.hold_prefilled();
        std::mem::take(&mut self.events)
    }

    /// Appends a sampled token to a sequence and emits its text; returns how the sequence ends,
    /// if this token ends it.
    fn accept(
        detok: &dyn Detokenizer,
        events: &mut Vec<Event>,
        s: &mut Seq,
        tok: u32,
        logprobs: Option<TokenLogprobs>,
    ) -> Option<Outcome> {
        if detok.is_eog(tok) && !s.ignore_eos {
            return Some(Outcome::Finished(FinishReason::Stop));
        }
        s.tokens.push(tok);
        let (text, stopped) = s.text.push(&detok.token_bytes(tok));
        events.push(Event::Token {
            id: s.id,
            token: tok,
            text,
            logprobs,
        });
        if let Some(st) = &s.steer {
            st.emitted();
        }
        if stopped {
            Some(Outcome::Finished(FinishReason::Stop))
        } else if s.output_len() >= s.max_tokens {
            Some(Outcome::Finished(FinishReason::Length))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
