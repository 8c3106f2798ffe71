//! Requests and their states: what a caller submits, what admission makes of it, and how it ends.
//!
//! A [`GenerateRequest`] is raw input. [`validate`](GenerateRequest::validate) turns it into a
//! [`ValidRequest`], the only type the scheduler accepts, or a [`Rejected`] that carries its reason
//! and can never be scheduled (invariant 1). A scheduled request ends exactly once, as
//! [`Outcome::Finished`] or [`Outcome::Aborted`]; "rejected", "aborted" and "finished" are distinct
//! and every consumer matches the one it means.

use warden_kernels::tag::IsolationViolation;

use super::sampling::SamplingParams;
use crate::kv::{KvError, SeqId};

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
    pub owner: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Strings that end generation (not included in the output).
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Report each sampled token's log-probability and this many of the most likely
    /// alternatives (at most [`MAX_TOP_LOGPROBS`]); `None` reports nothing.
    pub logprobs: Option<usize>,
}

/// Most alternatives a request's `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl GenerateRequest {
    /// A greedy request for `max_tokens` tokens.
    pub fn greedy(owner: u64, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            owner,
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
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
    /// A parameter out of range.
    #[error("invalid {field}: {message}")]
    InvalidParameter {
        /// The field.
        #[serde(deserialize_with = "known_field")]
        field: FieldName,
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

/// A request field's name. (An alias, so serde reads it with [`known_field`] instead of
/// borrowing it from the input.)
pub type FieldName = &'static str;

/// The request fields [`RejectReason::InvalidParameter`] names, so one read back from another
/// node (see [`crate::cluster`]) names the same field; an unknown name reads as `request`.
const FIELDS: [&str; 9] = [
    "owner",
    "max_tokens",
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "sampling",
    "top_logprobs",
    "stop",
];

fn known_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    let name = <String as serde::Deserialize>::deserialize(d)?;
    Ok(FIELDS.into_iter().find(|f| *f == name).unwrap_or("request"))
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

/// A request that passed admission. Only [`GenerateRequest::validate`] builds one.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub(super) req: GenerateRequest,
}

impl ValidRequest {
    /// The request.
    pub fn request(&self) -> &GenerateRequest {
        &self.req
    }
}

impl GenerateRequest {
    /// Admission: checks the request against `limits` without touching any shared state.
    pub fn validate(self, limits: &AdmissionLimits) -> Result<ValidRequest, Rejected> {
        let reject = |reason| Err(Rejected { reason });
        if self.owner == 0 {
            return reject(RejectReason::InvalidParameter {
                field: "owner",
                message: "must be non-zero".into(),
            });
        }
        if self.prompt.is_empty() {
            return reject(RejectReason::EmptyPrompt);
        }
        if let Some((index, &id)) = self
            .prompt
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= limits.vocab)
        {
            return reject(RejectReason::InvalidToken {
                index,
                id,
                vocab: limits.vocab,
            });
        }
        if self.max_tokens == 0 {
            return reject(RejectReason::InvalidParameter {
                field: "max_tokens",
                message: "must be at least 1".into(),
            });
        }
        let requested = self.prompt.len().saturating_add(self.max_tokens);
        let limit = limits.max_context.min(limits.pool_tokens);
        if requested > limit {
            return reject(RejectReason::ContextLengthExceeded {
                prompt_tokens: self.prompt.len(),
                max_tokens: self.max_tokens,
                requested,
                limit,
            });
        }
        if let Err(message) = self.sampling.validate() {
            let field = message.split_whitespace().next().unwrap_or("sampling");
            let field = ["temperature", "top_p", "min_p", "repetition_penalty"]
                .into_iter()
                .find(|f| *f == field)
                .unwrap_or("sampling");
            return reject(RejectReason::InvalidParameter { field, message });
        }
        if self.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return reject(RejectReason::InvalidParameter {
                field: "top_logprobs",
                message: format!("at most {MAX_TOP_LOGPROBS} alternatives"),
            });
        }
        if self.stop.len() > MAX_STOP_STRINGS || self.stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
            return reject(RejectReason::InvalidParameter {
                field: "stop",
                message: format!("at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_BYTES} bytes"),
            });
        }
        Ok(ValidRequest { req: self })
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
