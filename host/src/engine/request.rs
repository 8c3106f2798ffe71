//! Requests and their states: what a caller submits, what admission makes of it, and how it ends.
//!
//! A request is checked once, where it enters: [`Params::new`] holds the one set of range rules
//! (a typed [`InvalidParam`] names the field, the range and the value), and
//! [`Params::with_prompt`] checks the prompt against the model and makes a [`ValidRequest`], the
//! only type the engine accepts. [`GenerateRequest`] is the raw form (the CLI's, a benchmark's,
//! another node's message); [`GenerateRequest::validate`] runs the same two steps. A refusal is a
//! [`Rejected`] that carries its reason and can never be scheduled (invariant 1). A scheduled request ends exactly once, as
//! [`Outcome::Finished`] or [`Outcome::Aborted`]; "rejected", "aborted" and "finished" are distinct
//! and every consumer matches the one it means.

use warden_kernels::tag::IsolationViolation;

use std::sync::Arc;

use super::constraint::Constraint;
pub use super::field::{Field, InvalidParam};
use super::sampling::SamplingParams;
use super::steer::Steer;
use crate::kv::{KvError, SeqId};
use crate::tenant::TenantId;

/// A request's id within one engine (on the wire, a plain number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

impl RequestId {
    /// The pool sequence that holds this request's KV: each request has its own, numbered alike.
    pub fn seq(self) -> SeqId {
        SeqId(self.0)
    }

    /// The id after this one.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A generation request as a caller submits it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    /// The tenant (the owner in every KV tag); must be non-zero.
    pub owner: TenantId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// The client named no `max_tokens`: `max_tokens` is what the server chose (at most the rest
    /// of the context), and a sequence that outgrows what its tenant's KV budget can hold ends
    /// with `length` instead of the request being refused at admission.
    #[serde(default)]
    pub open_ended: bool,
    /// Strings that end generation (not included in the output).
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Report each sampled token's log-probability and this many of the most likely
    /// alternatives (at most [`MAX_TOP_LOGPROBS`]); `None` reports nothing.
    pub logprobs: Option<usize>,
    /// The id the request's log lines carry (its `x-request-id`), on every node that runs it;
    /// empty when it came from none.
    #[serde(default)]
    pub request_id: String,
}

/// Most alternatives a request's `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl GenerateRequest {
    /// A greedy request for `max_tokens` tokens.
    pub fn greedy(owner: TenantId, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            owner,
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            open_ended: false,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            request_id: String::new(),
        }
    }
}

/// How many tokens a request may generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxTokens {
    /// What the client asked for: a request that cannot have them all is refused.
    Given(usize),
    /// The client named none: at most this many, lowered to what the context (and the tenant's
    /// policy and quotas) leave; a sequence that outgrows its tenant's KV budget ends with
    /// `length`.
    AtMost(usize),
}

impl MaxTokens {
    /// The number.
    pub fn get(self) -> usize {
        match self {
            Self::Given(n) | Self::AtMost(n) => n,
        }
    }
}

/// Limits admission checks against.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    /// Maximum prompt plus completion tokens.
    pub max_context: usize,
    /// Vocabulary size (token ids must be below it).
    pub vocab: usize,
    /// Tokens the KV pool can ever hold for one sequence.
    pub pool_tokens: usize,
}

impl AdmissionLimits {
    /// Most prompt plus completion tokens a request may have: the context, or what the pool
    /// holds if that is less.
    pub fn context(&self) -> usize {
        self.max_context.min(self.pool_tokens)
    }
}

/// Why admission refused a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum RejectReason {
    /// No prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A token id outside the vocabulary.
    #[error("prompt token {index} is id {id}, outside the vocabulary of {vocab}")]
    InvalidToken {
        /// Position in the prompt.
        index: usize,
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// Prompt plus completion exceed the maximum context.
    #[error(
        "this model's maximum context length is {limit} tokens, but {requested} were requested ({prompt_tokens} in the prompt, {max_tokens} for the completion)"
    )]
    ContextLengthExceeded {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Completion tokens asked for.
        max_tokens: usize,
        /// Their sum.
        requested: usize,
        /// The limit.
        limit: usize,
    },
    /// A parameter out of range (from [`InvalidParam`]; this shape is what crosses the cluster
    /// link).
    #[error("invalid {field}: {message}")]
    InvalidParameter {
        /// The field.
        field: Field,
        /// What is wrong, with the value.
        message: String,
    },
    /// The waiting queue is full.
    #[error("the request queue is full ({limit} waiting); retry later")]
    QueueFull {
        /// Queue bound.
        limit: usize,
    },
    /// The owner's KV budget can never hold this request.
    #[error(
        "request needs {needed} KV pages, more than the tenant can hold ({budget}: its own cap, less what other tenants' guaranteed floors and pinned prefixes keep)"
    )]
    OverKvBudget {
        /// Pages needed.
        needed: usize,
        /// Budget.
        budget: usize,
    },
}

impl RejectReason {
    /// A stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            RejectReason::EmptyPrompt => "empty_prompt",
            RejectReason::InvalidToken { .. } => "invalid_token",
            RejectReason::ContextLengthExceeded { .. } => "context_length_exceeded",
            RejectReason::InvalidParameter { .. } => "invalid_parameter",
            RejectReason::QueueFull { .. } => "queue_full",
            RejectReason::OverKvBudget { .. } => "kv_budget_exceeded",
        }
    }
}

/// A request refused at admission. It owns the original request so the caller can report it, and
/// has no path into the scheduler.
#[derive(Debug, Clone, thiserror::Error)]
#[error("request rejected: {reason}")]
pub struct Rejected {
    /// Why.
    pub reason: RejectReason,
}

impl From<RejectReason> for Rejected {
    fn from(reason: RejectReason) -> Self {
        Self { reason }
    }
}

impl From<InvalidParam> for RejectReason {
    fn from(e: InvalidParam) -> Self {
        RejectReason::InvalidParameter {
            field: e.field,
            message: e.to_string(),
        }
    }
}

/// What a request asks the engine to generate, less its prompt and owner, with every field in
/// range: the one set of range rules, checked once where the request enters (the HTTP edge,
/// a plugin's rewrite, another node's message). Only [`Params::new`] builds one.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    sampling: SamplingParams,
    max_tokens: MaxTokens,
    stop: Vec<String>,
    ignore_eos: bool,
    logprobs: Option<usize>,
}

impl Params {
    /// Checks each field's range (see [`GenerateRequest`] for their meaning).
    pub fn new(
        sampling: SamplingParams,
        max_tokens: MaxTokens,
        stop: Vec<String>,
        ignore_eos: bool,
        logprobs: Option<usize>,
    ) -> Result<Self, InvalidParam> {
        if max_tokens.get() == 0 {
            return Err(InvalidParam::new(Field::MaxTokens, "at least 1", 0));
        }
        sampling.validate()?;
        if let Some(k) = logprobs
            && k > MAX_TOP_LOGPROBS
        {
            return Err(InvalidParam::new(
                Field::TopLogprobs,
                format!("0 to {MAX_TOP_LOGPROBS}"),
                k,
            ));
        }
        if stop.len() > MAX_STOP_STRINGS {
            return Err(InvalidParam::new(
                Field::Stop,
                format!("at most {MAX_STOP_STRINGS} strings"),
                format!("{} strings", stop.len()),
            ));
        }
        if let Some(s) = stop.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
            return Err(InvalidParam::new(
                Field::Stop,
                format!("non-empty strings of at most {MAX_STOP_BYTES} bytes"),
                format!("a string of {} bytes", s.len()),
            ));
        }
        Ok(Self {
            sampling,
            max_tokens,
            stop,
            ignore_eos,
            logprobs,
        })
    }

    /// The sampling parameters.
    pub fn sampling(&self) -> &SamplingParams {
        &self.sampling
    }

    /// Most tokens to generate.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens.get()
    }

    /// Whether the client named no `max_tokens` (see [`MaxTokens::AtMost`]).
    pub fn open_ended(&self) -> bool {
        matches!(self.max_tokens, MaxTokens::AtMost(_))
    }

    /// The same parameters with an open-ended `max_tokens` lowered to `most` (at least 1); a
    /// `max_tokens` the client gave is left as it is.
    pub fn at_most(mut self, most: usize) -> Self {
        if let MaxTokens::AtMost(n) = &mut self.max_tokens {
            *n = (*n).min(most).max(1);
        }
        self
    }

    /// The stop strings.
    pub fn stop(&self) -> &[String] {
        &self.stop
    }

    /// The log-probability alternatives asked for.
    pub fn logprobs(&self) -> Option<usize> {
        self.logprobs
    }

    /// Whether end-of-generation tokens are ignored.
    pub fn ignore_eos(&self) -> bool {
        self.ignore_eos
    }

    /// The same parameters with `seed` (a seed never makes parameters invalid).
    pub fn with_seed(mut self, seed: Option<u64>) -> Self {
        self.sampling.seed = seed;
        self
    }

    /// Checks `prompt` against the model's `limits` and makes the request `owner` submits:
    /// the only way to a [`ValidRequest`].
    pub fn with_prompt(
        self,
        owner: TenantId,
        prompt: Vec<u32>,
        limits: &AdmissionLimits,
    ) -> Result<ValidRequest, RejectReason> {
        if prompt.is_empty() {
            return Err(RejectReason::EmptyPrompt);
        }
        if let Some((index, &id)) = prompt.iter().enumerate().find(|(_, t)| **t as usize >= limits.vocab) {
            return Err(RejectReason::InvalidToken {
                index,
                id,
                vocab: limits.vocab,
            });
        }
        self.sampling.check_vocab(limits.vocab)?;
        let limit = limits.context();
        // An open-ended request gets the rest of the context, and at least one token.
        let this = self.at_most(limit.saturating_sub(prompt.len()));
        let requested = prompt.len().saturating_add(this.max_tokens());
        if requested > limit {
            return Err(RejectReason::ContextLengthExceeded {
                prompt_tokens: prompt.len(),
                max_tokens: this.max_tokens(),
                requested,
                limit,
            });
        }
        let open_ended = this.open_ended();
        let Params {
            sampling,
            max_tokens,
            stop,
            ignore_eos,
            logprobs,
        } = this;
        Ok(ValidRequest {
            req: GenerateRequest {
                owner,
                prompt,
                sampling,
                max_tokens: max_tokens.get(),
                open_ended,
                stop,
                ignore_eos,
                logprobs,
                request_id: String::new(),
            },
            constraint: None,
            steer: None,
        })
    }
}

/// A request that passed validation: the only request type the engine takes. Built only by
/// [`Params::with_prompt`] (or [`GenerateRequest::validate`], which goes through it):
///
/// ```no_run
/// # fn f(e: &mut warden::engine::Engine, owner: warden::tenant::TenantId) {
/// let req = warden::engine::request::GenerateRequest::greedy(owner, vec![1], 1);
/// let _ = e.submit(req.validate(&e.limits()).unwrap());
/// # }
/// ```
///
/// so an unchecked request cannot be written (its fields are private: error E0451, and only
/// that, every field being named with a value of its type)
///
/// ```compile_fail,E0451
/// # use warden::engine::request::{GenerateRequest, ValidRequest};
/// # fn f(owner: warden::tenant::TenantId) {
/// let req = GenerateRequest::greedy(owner, vec![1], 1);
/// let _ = ValidRequest { req, constraint: None, steer: None };
/// # }
/// ```
///
/// and the engine cannot be handed one that skipped validation (the example above without
/// `validate`: a mismatched type, E0308):
///
/// ```compile_fail,E0308
/// # fn f(e: &mut warden::engine::Engine, owner: warden::tenant::TenantId) {
/// let req = warden::engine::request::GenerateRequest::greedy(owner, vec![1], 1);
/// let _ = e.submit(req);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub(super) req: GenerateRequest,
    /// What its output must match (a compiled `response_format`); in this process only.
    pub(super) constraint: Option<Constraint>,
    /// Its tokens' verdicts, when its plugin steers it; in this process only.
    pub(super) steer: Option<Arc<Steer>>,
}

impl ValidRequest {
    /// The request.
    pub fn request(&self) -> &GenerateRequest {
        &self.req
    }

    /// The request, raw again (to send to another node, which validates it again). Its
    /// constraint and steering stay here: a cluster's router sends what they came from instead.
    pub fn into_request(self) -> GenerateRequest {
        self.req
    }

    /// The same request, its log lines naming it `id`: at most 128 of its letters, digits and
    /// `-_.:` are kept (an id from another node is not trusted to be plain).
    pub fn with_request_id(mut self, id: &str) -> Self {
        self.req.request_id = id
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || "-_.:".contains(*c))
            .take(128)
            .collect();
        self
    }

    /// The same request, its output under `constraint`.
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> Self {
        self.constraint = constraint;
        self
    }

    /// Its steering, if its plugin steers it.
    pub fn steer(&self) -> Option<&Arc<Steer>> {
        self.steer.as_ref()
    }

    /// Each token it emits waits for a verdict through `steer` before the next is computed
    /// (see [`steer`](super::steer)).
    pub fn with_steer(mut self, steer: Arc<Steer>) -> Self {
        self.steer = Some(steer);
        self
    }

    /// Choice `index` of a request with `n` choices: the same request, its seed (if it has one)
    /// moved on by `index` so that choices differ.
    pub fn choice(&self, index: usize) -> Self {
        let mut req = self.req.clone();
        req.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(index as u64));
        Self {
            req,
            constraint: self.constraint.clone(),
            steer: None,
        }
    }
}

impl GenerateRequest {
    /// Validation of a whole request, as [`Params::new`] then [`Params::with_prompt`] check it:
    /// for callers that hold a raw request (the CLI, benchmarks, another node's message).
    pub fn validate(self, limits: &AdmissionLimits) -> Result<ValidRequest, Rejected> {
        let max_tokens = if self.open_ended {
            MaxTokens::AtMost(self.max_tokens)
        } else {
            MaxTokens::Given(self.max_tokens)
        };
        let params = Params::new(self.sampling, max_tokens, self.stop, self.ignore_eos, self.logprobs)
            .map_err(RejectReason::from)?;
        Ok(params
            .with_prompt(self.owner, self.prompt, limits)?
            .with_request_id(&self.request_id))
    }
}

/// Most stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// Why a scheduled request finished normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// OpenAI's `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Why a scheduled request was aborted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AbortReason {
    /// The caller cancelled it (e.g. the client disconnected).
    #[error("cancelled")]
    Cancelled,
    /// A KV tag check failed: the request yields no further data.
    #[error("isolation violation: {0}")]
    Isolation(IsolationViolation),
    /// The KV pool refused mid-request.
    #[error("KV pool error: {0}")]
    Kv(KvError),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    Shutdown,
    /// Its prompt's KV did not arrive whole from the prefill node (invariant 7).
    #[error("KV transfer failed: {0}")]
    Transfer(String),
    /// Its output constraint allowed no next token, or failed.
    #[error("{0}")]
    Constraint(super::constraint::ConstraintError),
    /// On a router: the decode node ended it with this error (as its client would see it), or
    /// the node failed.
    #[error("{message}")]
    Node {
        /// The error's stable code.
        code: &'static str,
        /// Its message.
        message: String,
    },
}

impl AbortReason {
    /// The stable error code a client sees.
    pub fn code(&self) -> &'static str {
        match self {
            AbortReason::Cancelled => "cancelled",
            AbortReason::Shutdown => "shutting_down",
            AbortReason::Isolation(_) => "isolation_violation",
            AbortReason::Kv(_) => "kv_unavailable",
            AbortReason::Transfer(_) => "kv_transfer_failed",
            AbortReason::Constraint(super::constraint::ConstraintError::NoToken) => "constraint_allows_no_token",
            AbortReason::Constraint(super::constraint::ConstraintError::SteeredToNothing) => {
                "plugin_constraint_allows_no_token"
            }
            AbortReason::Constraint(_) => "constraint_failed",
            AbortReason::Node { code, .. } => code,
        }
    }

    /// What a client is told. An isolation violation names no page, tenant or tag.
    pub fn client_message(&self) -> String {
        match self {
            AbortReason::Cancelled => "the request was cancelled".into(),
            AbortReason::Shutdown => "the server is shutting down".into(),
            AbortReason::Isolation(_) => {
                "the request was stopped by a KV isolation check; no data from it was returned".into()
            }
            AbortReason::Kv(e) => e.to_string(),
            AbortReason::Transfer(e) => e.clone(),
            AbortReason::Constraint(e) => e.to_string(),
            AbortReason::Node { message, .. } => message.clone(),
        }
    }
}

/// How a scheduled request ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// It completed.
    Finished(FinishReason),
    /// It was stopped before completing.
    Aborted(AbortReason),
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_request_names_a_tenant_that_cannot_be_one() {
        // In process a TenantId cannot be 0 or the public owner; off the wire neither parses.
        let good = serde_json::to_value(GenerateRequest::greedy(crate::testutil::tenant(4), vec![1], 1)).unwrap();
        assert_eq!(good["owner"], 4);
        for bad in [0, u64::MAX] {
            let mut v = good.clone();
            v["owner"] = bad.into();
            let e = serde_json::from_value::<GenerateRequest>(v).unwrap_err();
            assert!(e.to_string().contains("is not a tenant id"), "{e}");
        }
    }
}
