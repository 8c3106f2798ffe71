//! Validation errors' vocabulary: the request fields a check can name ([`Field`]) and a
//! parameter outside its range ([`InvalidParam`]: which field, what it must be, what it was).
//! Below both the request and the sampling rules, which each check their own fields.

/// A request field, as validation errors name it (on the wire, its name in snake case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Field {
    /// `max_tokens`.
    MaxTokens,
    /// `max_completion_tokens` (the newer name of `max_tokens`).
    MaxCompletionTokens,
    /// `n`.
    N,
    /// `temperature`.
    Temperature,
    /// `top_p`.
    TopP,
    /// `top_k`.
    TopK,
    /// `min_p`.
    MinP,
    /// `repetition_penalty`.
    RepetitionPenalty,
    /// `presence_penalty`.
    PresencePenalty,
    /// `frequency_penalty`.
    FrequencyPenalty,
    /// `top_logprobs`.
    TopLogprobs,
    /// `stop`.
    Stop,
    /// `logit_bias`.
    LogitBias,
    /// `logprobs` (the legacy completions' count of alternatives).
    Logprobs,
    /// A field this build does not know (read from another node): the request as a whole.
    #[serde(other)]
    Request,
}

impl Field {
    /// The field's name in a request body.
    pub fn as_str(self) -> &'static str {
        match self {
            Field::MaxTokens => "max_tokens",
            Field::MaxCompletionTokens => "max_completion_tokens",
            Field::N => "n",
            Field::Temperature => "temperature",
            Field::TopP => "top_p",
            Field::TopK => "top_k",
            Field::MinP => "min_p",
            Field::RepetitionPenalty => "repetition_penalty",
            Field::PresencePenalty => "presence_penalty",
            Field::FrequencyPenalty => "frequency_penalty",
            Field::TopLogprobs => "top_logprobs",
            Field::Stop => "stop",
            Field::LogitBias => "logit_bias",
            Field::Logprobs => "logprobs",
            Field::Request => "request",
        }
    }
}

impl std::fmt::Display for Field {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parameter outside its range: which field, what it must be, and what it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field} must be {expected}, got {got}")]
pub struct InvalidParam {
    /// The field.
    pub field: Field,
    /// Its range or form, in words ("between 0 and 2").
    pub expected: String,
    /// The value given.
    pub got: String,
}

impl InvalidParam {
    /// `field` must be `expected`; it was `got`.
    pub fn new(field: Field, expected: impl Into<String>, got: impl std::fmt::Display) -> Self {
        Self {
            field,
            expected: expected.into(),
            got: got.to_string(),
        }
    }
}
