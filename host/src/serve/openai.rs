//! OpenAI's wire shapes: request bodies (errors naming the field; fields the server does not
//! know ignored and listed, or refused, as [`UnknownFields`] says) and their conversion into the
//! engine's validated parameters (the error JSON is [`ApiError`]'s).

use hyper::StatusCode;
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::tools::{ToolChoiceWire, ToolDef, Tools};
use crate::chat::{ChatMessage, FunctionCall, ToolCall};
use crate::config::UnknownFields;
use crate::engine::request::{Field, InvalidParam, MAX_TOP_LOGPROBS, MaxTokens, Params};
use crate::engine::sampling::SamplingParams;
use crate::grammar::Format;

/// Deepest nesting of arrays and objects in a JSON text (strings skipped), without parsing it.
pub fn json_depth(bytes: &[u8]) -> usize {
    let (mut depth, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for &b in bytes {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// Fields both endpoints accept ([`Common`]).
pub const COMMON_FIELDS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "plugin",
];

/// Fields only `POST /v1/chat/completions` accepts.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Fields only `POST /v1/completions` accepts.
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo"];

/// Fields a chat message may have.
pub const MESSAGE_FIELDS: &[&str] = &["role", "content", "name", "tool_calls", "tool_call_id"];

/// Parses a request body as `T`, whose top-level fields are `allowed` (others refused), with
/// errors that name the field at fault.
pub fn parse_body<T: for<'de> Deserialize<'de>>(
    bytes: &[u8],
    max_depth: usize,
    allowed: &[&str],
) -> Result<T, ApiError> {
    typed(parse_object(bytes, max_depth, &[allowed])?)
}

/// Checks depth and syntax, and that the body is an object whose fields are all in one of the
/// `allowed` lists.
pub fn parse_object(bytes: &[u8], max_depth: usize, allowed: &[&[&str]]) -> Result<Value, ApiError> {
    let mut v = parse_json_object(bytes, max_depth)?;
    known_fields(&mut v, allowed, "", UnknownFields::Refuse, &mut Vec::new())?;
    Ok(v)
}

/// Checks depth and syntax, and that the body is an object.
fn parse_json_object(bytes: &[u8], max_depth: usize) -> Result<Value, ApiError> {
    if json_depth(bytes) > max_depth {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the request body nests deeper than {max_depth} levels"),
        ));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    if !value.is_object() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the request body must be a JSON object",
        ));
    }
    Ok(value)
}

/// A body whose top-level fields are `allowed` and whose messages' (if it has `messages`) are
/// [`MESSAGE_FIELDS`], others ignored or refused as `unknown` says: the body without them, and
/// the paths of those ignored.
fn parse_known(
    bytes: &[u8],
    max_depth: usize,
    allowed: &[&[&str]],
    unknown: UnknownFields,
) -> Result<(Value, Vec<String>), ApiError> {
    let mut v = parse_json_object(bytes, max_depth)?;
    let mut ignored = Vec::new();
    known_fields(&mut v, allowed, "", unknown, &mut ignored)?;
    if let Some(Value::Array(messages)) = v.get_mut("messages") {
        for (i, m) in messages.iter_mut().enumerate() {
            known_fields(m, &[MESSAGE_FIELDS], &format!("messages[{i}]."), unknown, &mut ignored)?;
        }
    }
    Ok((v, ignored))
}

/// Most ignored fields a request lists (the rest are not named).
pub const MAX_IGNORED_LISTED: usize = 16;

/// Takes the fields of object `v` that are in none of the `allowed` lists out of it and
/// records their paths (`prefix` + name) in `ignored`, or, under [`UnknownFields::Refuse`],
/// refuses the first by name. A non-object `v` is left for deserializing to refuse.
fn known_fields(
    v: &mut Value,
    allowed: &[&[&str]],
    prefix: &str,
    unknown: UnknownFields,
    ignored: &mut Vec<String>,
) -> Result<(), ApiError> {
    let Value::Object(map) = v else {
        return Ok(());
    };
    let mut strange: Vec<String> = map
        .keys()
        .filter(|k| !allowed.iter().any(|a| a.contains(&k.as_str())))
        .cloned()
        .collect();
    // By name, whatever order the body had them in.
    strange.sort();
    for k in strange {
        let path = format!("{prefix}{k}");
        if unknown == UnknownFields::Refuse {
            return Err(ApiError::field(&path, format!("unknown field {path:?}")));
        }
        map.remove(&k);
        if ignored.len() < MAX_IGNORED_LISTED {
            ignored.push(path);
        }
    }
    Ok(())
}

/// A field's path as a header value may carry it: ASCII letters, digits and
/// `_.-[]` (anything else becomes `_`), at most 64 characters.
pub fn field_label(path: &str) -> String {
    let s: String = path
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-[]".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() { "_".into() } else { s }
}

/// Deserializes `value` as `T`; errors name the path of the field at fault.
fn typed<T: for<'de> Deserialize<'de>>(value: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("invalid request body: {inner}"),
            )
        } else {
            ApiError::field(&path, format!("invalid {path}: {inner}"))
        }
    })
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// A chat message's content: a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Parts; only `{"type": "text", "text": ...}` is supported.
    Parts(Vec<Part>),
}

/// A content part.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// Must be `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: Option<String>,
}

/// A chat message.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user`, `assistant` (or `developer`, read as `system`).
    pub role: String,
    /// What it says (`null` for an empty assistant turn).
    #[serde(default)]
    pub content: Option<Content>,
    /// Speaker name (accepted, not rendered).
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant's calls of tools.
    #[serde(default)]
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// A `tool` message answers this call.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// A call in an assistant message of the history, as OpenAI returned it.
#[derive(Debug, Clone, Deserialize)]
pub struct WireToolCall {
    /// Its id.
    pub id: String,
    /// Must be `function`.
    #[serde(rename = "type", default = "function")]
    pub kind: String,
    /// The function and its arguments.
    pub function: WireFunctionCall,
}

fn function() -> String {
    "function".into()
}

/// A called function, with its arguments as a string of JSON.
#[derive(Debug, Clone, Deserialize)]
pub struct WireFunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments, JSON in a string.
    pub arguments: String,
}

/// Sampling and length fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// Model id.
    pub model: String,
    /// Stream SSE chunks.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Stream options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Completion tokens.
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Completion tokens (newer name; wins over `max_tokens`).
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// 0 to 2; default 1.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// (0, 1]; default 1.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Choices; default 1.
    #[serde(default)]
    pub n: Option<i64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// RNG seed.
    #[serde(default)]
    pub seed: Option<i64>,
    /// −2 to 2; default 0.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// −2 to 2; default 0.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) → bias in [−100, 100].
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// What the output must be: text, a JSON object, or JSON a schema accepts.
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// End-user id (accepted, unused).
    #[serde(default)]
    pub user: Option<String>,
    /// Extension: keep the k most likely tokens.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Extension: min-p sampling.
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Extension: repetition penalty (1 is none).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Extension: the tenant's plugin to run (default: the tenant's default plugin, if any).
    #[serde(default)]
    pub plugin: Option<String>,
}

/// `response_format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    /// Any text.
    Text,
    /// A JSON object.
    JsonObject,
    /// JSON its schema accepts.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    /// Its name (letters, digits, `_` and `-`, as OpenAI's).
    pub name: String,
    /// What it is for (not used in generation).
    #[serde(default)]
    pub description: Option<String>,
    /// The schema; absent, any JSON.
    #[serde(default)]
    pub schema: Option<Value>,
    /// Follow the schema exactly: output always does.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Return log-probabilities.
    pub logprobs: Option<bool>,
    /// Alternatives per token (needs `logprobs`).
    pub top_logprobs: Option<i64>,
    /// The tools it may call (checked), if any.
    pub tools: Option<Tools>,
    /// The shared fields.
    pub common: Common,
    /// Fields the server does not know that the body held, ignored (the first
    /// [`MAX_IGNORED_LISTED`]), as paths: `store`, `messages[0].refusal`.
    pub ignored: Vec<String>,
}

#[derive(Deserialize)]
struct ChatOwn {
    messages: Vec<Message>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<i64>,
    #[serde(default)]
    tools: Option<Vec<ToolDef>>,
    #[serde(default)]
    tool_choice: Option<ToolChoiceWire>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
}

impl ChatRequest {
    /// Parses a body; fields the server does not know (at the top level and in each message)
    /// are ignored or refused as `unknown` says.
    pub fn parse(bytes: &[u8], max_depth: usize, unknown: UnknownFields) -> Result<Self, ApiError> {
        let (v, ignored) = parse_known(bytes, max_depth, &[CHAT_FIELDS, COMMON_FIELDS], unknown)?;
        let own: ChatOwn = typed(v.clone())?;
        Ok(Self {
            messages: own.messages,
            logprobs: own.logprobs,
            top_logprobs: own.top_logprobs,
            tools: Tools::new(own.tools, own.tool_choice, own.parallel_tool_calls)?,
            common: typed(v)?,
            ignored,
        })
    }
}

/// A completion prompt: text or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A one-element list of text.
    TextList(Vec<String>),
    /// A one-element list of token ids.
    TokensList(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Log-probabilities of each token and of this many alternatives.
    pub logprobs: Option<i64>,
    /// Return the prompt before the completion.
    pub echo: Option<bool>,
    /// The shared fields.
    pub common: Common,
    /// Fields the server does not know that the body held, ignored (as [`ChatRequest::ignored`]).
    pub ignored: Vec<String>,
}

#[derive(Deserialize)]
struct CompletionOwn {
    prompt: Prompt,
    #[serde(default)]
    logprobs: Option<i64>,
    #[serde(default)]
    echo: Option<bool>,
}

impl CompletionRequest {
    /// Parses a body; fields the server does not know are ignored or refused as `unknown` says.
    pub fn parse(bytes: &[u8], max_depth: usize, unknown: UnknownFields) -> Result<Self, ApiError> {
        let (v, ignored) = parse_known(bytes, max_depth, &[COMPLETION_FIELDS, COMMON_FIELDS], unknown)?;
        let own: CompletionOwn = typed(v.clone())?;
        Ok(Self {
            prompt: own.prompt,
            logprobs: own.logprobs,
            echo: own.echo,
            common: typed(v)?,
            ignored,
        })
    }
}

/// How a request is answered: its choices, and whether as a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Choices.
    pub n: usize,
    /// Stream?
    pub stream: bool,
    /// Usage chunk at the end of a stream?
    pub include_usage: bool,
}

/// What both endpoints turn into before tokenizing: the body's generation fields, checked once.
#[derive(Debug, Clone)]
pub struct Plan {
    /// How it is answered.
    pub shape: Shape,
    /// What its output must be (compiled against the model once the model is known).
    pub format: Format,
    /// The tools a chat may call (shown to the model, read back from its output).
    pub tools: Option<Tools>,
    /// What to generate, for choice 0 (the others differ in seed: see
    /// [`ValidRequest::choice`](crate::engine::request::ValidRequest::choice)).
    pub params: Params,
}

/// Limits the conversion checks.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// Most completion tokens when a request names none (it gets the rest of its context, up to
    /// this).
    pub default_max_tokens: usize,
    /// Most `n`.
    pub max_n: usize,
}

/// What a request asks for, before tokenizing.
#[derive(Debug, Clone, PartialEq)]
pub enum Asked {
    /// Messages, rendered with the chat template.
    Chat(Vec<ChatMessage>),
    /// A completion prompt's text.
    Text(String),
    /// A completion prompt's token ids, given by the client: never rendered.
    Tokens(Vec<u32>),
}

impl Common {
    /// Checks the shared fields and turns them into the engine's parameters, with `logprobs`
    /// (from [`ChatRequest::logprobs`]; completions have none). The wire's integers are converted
    /// here; every range rule is [`Params::new`]'s.
    pub fn plan(&self, lim: &RequestLimits, logprobs: Option<usize>) -> Result<Plan, ApiError> {
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (None, None) => MaxTokens::AtMost(lim.default_max_tokens),
            (Some(m), _) => MaxTokens::Given(count(Field::MaxCompletionTokens, m, "at least 1")?),
            (None, Some(m)) => MaxTokens::Given(count(Field::MaxTokens, m, "at least 1")?),
        };
        let n = match self.n {
            None => 1,
            Some(n) if n >= 1 && n as usize <= lim.max_n => n as usize,
            Some(n) => return Err(InvalidParam::new(Field::N, format!("1 to {}", lim.max_n), n).into()),
        };
        let logit_bias = self.logit_bias()?;
        let top_k = match self.top_k {
            None => 0,
            Some(k) => count(Field::TopK, k, "0 or more")?,
        };
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            seed: self.seed.map(|s| s as u64),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias,
            ..SamplingParams::default()
        };
        let stop = self.stop.clone().map(Stop::into_vec).unwrap_or_default();
        let params = Params::new(sampling, max_tokens, stop, false, logprobs)?;
        let format = self.format()?;
        Ok(Plan {
            format,
            tools: None,
            shape: Shape {
                n,
                stream: self.stream.unwrap_or(false),
                include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            },
            params,
        })
    }
}

impl Common {
    /// `response_format` as the compiler takes it.
    fn format(&self) -> Result<Format, ApiError> {
        Ok(match &self.response_format {
            None | Some(ResponseFormat::Text) => Format::Text,
            Some(ResponseFormat::JsonObject) => Format::JsonObject,
            Some(ResponseFormat::JsonSchema { json_schema: s }) => {
                let name_ok = !s.name.is_empty()
                    && s.name.len() <= 64
                    && s.name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                if !name_ok {
                    return Err(ApiError::field(
                        "response_format.json_schema.name",
                        "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                    ));
                }
                match &s.schema {
                    // Any JSON, as the empty schema (so it is generated compactly too).
                    None | Some(Value::Bool(true)) => Format::JsonSchema(serde_json::json!({})),
                    Some(v @ Value::Object(_)) => Format::JsonSchema(v.clone()),
                    Some(_) => {
                        return Err(ApiError::field(
                            "response_format.json_schema.schema",
                            "response_format.json_schema.schema must be a JSON schema object",
                        ));
                    }
                }
            }
        })
    }

    /// `logit_bias` as the sampler takes it: ids in increasing order. Its ranges (and the ids
    /// against the vocabulary) are checked with the other sampling fields.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        let mut bias = Vec::with_capacity(map.len());
        for (k, &v) in map {
            let id = k
                .parse::<u32>()
                .map_err(|_| InvalidParam::new(Field::LogitBias, "keyed by token ids", format!("the key {k:?}")))?;
            bias.push((id, v));
        }
        bias.sort_by_key(|&(id, _)| id);
        Ok(bias)
    }
}

/// A count from the wire: negative numbers have no meaning here (`expected` says what does).
fn count(field: Field, v: i64, expected: &str) -> Result<usize, ApiError> {
    usize::try_from(v).map_err(|_| InvalidParam::new(field, expected, v).into())
}

impl CompletionRequest {
    /// `logprobs` as the engine takes it (`None`: no log-probabilities).
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let expected = format!("0 to {MAX_TOP_LOGPROBS}");
        match self.logprobs {
            None => Ok(None),
            Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Ok(Some(k as usize)),
            Some(k) => Err(InvalidParam::new(Field::Logprobs, expected, k).into()),
        }
    }

    /// Whether the prompt is returned before the completion. With `logprobs` it would need the
    /// prompt's own log-probabilities, which are not computed: that pair is refused.
    pub fn echo(&self) -> Result<bool, ApiError> {
        match (self.echo.unwrap_or(false), self.logprobs) {
            (true, Some(_)) => Err(ApiError::field(
                "echo",
                "echo with logprobs is not supported (the prompt's log-probabilities are not computed); ask for one or the other",
            )),
            (echo, _) => Ok(echo),
        }
    }

    /// The prompt as the edge holds it: one text or one list of token ids.
    pub fn asked(&self) -> Result<Asked, ApiError> {
        let one = |what: usize| {
            ApiError::field(
                "prompt",
                format!("prompt lists must hold exactly one prompt (got {what}); send one request per prompt"),
            )
        };
        Ok(match &self.prompt {
            Prompt::Text(s) => Asked::Text(s.clone()),
            Prompt::Tokens(ids) => Asked::Tokens(ids.clone()),
            Prompt::TextList(v) => match &v[..] {
                [s] => Asked::Text(s.clone()),
                _ => return Err(one(v.len())),
            },
            Prompt::TokensList(v) => match &v[..] {
                [ids] => Asked::Tokens(ids.clone()),
                _ => return Err(one(v.len())),
            },
        })
    }
}

/// Call `j` of message `i` of the history, its arguments parsed (templates take them as JSON).
fn history_call(i: usize, j: usize, c: &WireToolCall) -> Result<ToolCall, ApiError> {
    let at = format!("messages[{i}].tool_calls[{j}]");
    if c.kind != "function" {
        return Err(ApiError::field(
            &format!("{at}.type"),
            format!("{at}.type must be \"function\", got {:?}", c.kind),
        ));
    }
    let arguments = serde_json::from_str(&c.function.arguments).map_err(|e| {
        ApiError::field(
            &format!("{at}.function.arguments"),
            format!("{at}.function.arguments is not JSON: {e}"),
        )
    })?;
    Ok(ToolCall {
        id: c.id.clone(),
        kind: "function".into(),
        function: FunctionCall {
            name: c.function.name.clone(),
            arguments,
        },
    })
}

impl ChatRequest {
    /// The plan ([`Common::plan`]) with the request's tools: under `required` or a named
    /// function the format is theirs, and so cannot be combined with a `response_format`.
    pub fn plan(&self, lim: &RequestLimits) -> Result<Plan, ApiError> {
        let mut plan = self.common.plan(lim, self.logprobs()?)?;
        if let Some(tools) = &self.tools {
            let constrained = tools.format();
            if constrained.is_some() && plan.format != Format::Text {
                return Err(ApiError::field(
                    "response_format",
                    "response_format cannot be combined with tool_choice required or a named function (the calls' format is theirs)",
                ));
            }
            if let Some(f) = constrained {
                plan.format = f;
            }
            plan.tools = Some(tools.clone());
        }
        Ok(plan)
    }

    /// The messages as the chat template takes them (see [`chat_messages`]).
    pub fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        chat_messages(&self.messages)
    }

    /// `top_logprobs` as the engine takes it (`None`: no log-probabilities); its range is
    /// [`Params::new`]'s.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, None) => Ok(None),
            (false, Some(_)) => Err(ApiError::field("top_logprobs", "top_logprobs needs logprobs: true")),
            (true, None) => Ok(Some(0)),
            (true, Some(k)) => count(Field::TopLogprobs, k, &format!("0 to {MAX_TOP_LOGPROBS}")).map(Some),
        }
    }
}

/// Fields `POST /tokenize` accepts (vLLM's names).
pub const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
];

/// `POST /tokenize`: a prompt, or a conversation as the model's chat template renders it.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    /// The model whose tokenizer: default the server's one model, if it serves one.
    #[serde(default)]
    pub model: Option<String>,
    /// Text, as `/v1/completions` reads it.
    #[serde(default)]
    pub prompt: Option<String>,
    /// A conversation, as `/v1/chat/completions` reads it.
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    /// A prompt's BOS token, where the model adds one (default true).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// A conversation ends with the assistant's turn opened (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Each token's text too (default false).
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

impl TokenizeRequest {
    /// Parses a body: exactly one of `prompt` and `messages`.
    pub fn parse(bytes: &[u8], max_depth: usize) -> Result<Self, ApiError> {
        let r: Self = parse_body(bytes, max_depth, TOKENIZE_FIELDS)?;
        match (&r.prompt, &r.messages) {
            (Some(_), Some(_)) | (None, None) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "give either prompt (text) or messages (a conversation)",
            )),
            (None, Some(_)) if r.add_special_tokens.is_some() => Err(ApiError::field(
                "add_special_tokens",
                "add_special_tokens applies to a prompt; a conversation is tokenized as its template writes it",
            )),
            (Some(_), None) if r.add_generation_prompt.is_some() => Err(ApiError::field(
                "add_generation_prompt",
                "add_generation_prompt applies to messages",
            )),
            _ => Ok(r),
        }
    }
}

/// `POST /detokenize`: token ids back to text.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// As [`TokenizeRequest::model`].
    #[serde(default)]
    pub model: Option<String>,
    /// The ids.
    pub tokens: Vec<u32>,
}

/// Fields `POST /detokenize` accepts.
pub const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];

/// `messages` as the chat template takes them: roles checked, text parts joined, an
/// assistant's tool calls with their arguments parsed, a tool result with its call's id.
pub fn chat_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::field("messages", "messages must not be empty"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                "tool" => "tool",
                other => {
                    return Err(ApiError::field(
                        &format!("messages[{i}].role"),
                        format!("messages[{i}].role must be system, developer, user, assistant or tool, got {other:?}"),
                    ));
                }
            };
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (&p.kind[..], &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            _ => {
                                return Err(ApiError::field(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!("messages[{i}].content[{j}]: only text parts are supported"),
                                ));
                            }
                        }
                    }
                    s
                }
            };
            let tool_calls = match (&m.tool_calls, role) {
                (None, _) => None,
                (Some(calls), "assistant") => Some(
                    calls
                        .iter()
                        .enumerate()
                        .map(|(j, c)| history_call(i, j, c))
                        .collect::<Result<Vec<_>, _>>()?,
                ),
                (Some(_), _) => {
                    return Err(ApiError::field(
                        &format!("messages[{i}].tool_calls"),
                        format!("messages[{i}].tool_calls: only assistant messages carry tool calls"),
                    ));
                }
            };
            let tool_call_id = match (&m.tool_call_id, role) {
                (Some(id), "tool") => Some(id.clone()),
                (None, "tool") => {
                    return Err(ApiError::field(
                        &format!("messages[{i}].tool_call_id"),
                        format!("messages[{i}] is a tool result without the tool_call_id it answers"),
                    ));
                }
                (Some(_), _) => {
                    return Err(ApiError::field(
                        &format!("messages[{i}].tool_call_id"),
                        format!("messages[{i}].tool_call_id: only tool messages answer a call"),
                    ));
                }
                (None, _) => None,
            };
            Ok(ChatMessage {
                role: role.into(),
                content,
                tool_calls,
                tool_call_id,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim() -> RequestLimits {
        RequestLimits {
            default_max_tokens: 16,
            max_n: 4,
        }
    }

    #[test]
    fn parse_errors_name_the_field() {
        let e = ChatRequest::parse(
            br#"{"model":"m","messages":[],"temperature":"hot"}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap_err();
        assert_eq!((e.code, e.param.as_deref()), ("invalid_parameter", Some("temperature")));
        let e = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":"x","colour":1}]}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap_err();
        assert!(e.message.contains("colour"), "{e:?}");
        let e = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"user"}],"bogus":1}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("bogus"));
        let e = ChatRequest::parse(b"{\"model\":", 8, UnknownFields::Refuse).unwrap_err();
        assert_eq!(e.code, "invalid_json");
        let e = ChatRequest::parse(br#"{"model":"m"}"#, 8, UnknownFields::Refuse).unwrap_err();
        assert!(e.message.contains("messages"), "{e:?}");
        let deep = format!("{}{}", "[".repeat(40), "]".repeat(40));
        assert_eq!(
            parse_body::<Value>(deep.as_bytes(), 32, &[]).unwrap_err().code,
            "invalid_json"
        );
    }

    #[test]
    fn unknown_fields_are_ignored_and_listed_or_refused() {
        let body = br#"{"model":"m","store":true,"service_tier":"auto","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo","refusal":null,"annotations":[]}]}"#;
        let r = ChatRequest::parse(body, 8, UnknownFields::Ignore).unwrap();
        assert_eq!(
            r.ignored,
            [
                "service_tier",
                "store",
                "messages[1].annotations",
                "messages[1].refusal"
            ]
        );
        assert_eq!(r.chat_messages().unwrap().len(), 2);
        let e = ChatRequest::parse(body, 8, UnknownFields::Refuse).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("service_tier"));
        let e = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":"x","colour":1}]}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].colour"));
        // Known fields keep their checks when unknown ones are ignored.
        let e = CompletionRequest::parse(
            br#"{"model":"m","prompt":"x","extra":1,"temperature":"hot"}"#,
            8,
            UnknownFields::Ignore,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        // At most MAX_IGNORED_LISTED are listed, however many there are.
        let many: String = (0..100).map(|i| format!(r#","x{i}":1"#)).collect();
        let r = CompletionRequest::parse(
            format!(r#"{{"model":"m","prompt":"x"{many}}}"#).as_bytes(),
            8,
            UnknownFields::Ignore,
        )
        .unwrap();
        assert_eq!(r.ignored.len(), MAX_IGNORED_LISTED);
        assert_eq!(field_label("messages[3].a b\"\n"), "messages[3].a_b__");
        assert_eq!(field_label(&"é".repeat(100)).len(), 64);
    }

    #[test]
    fn sampling_fields_reach_the_engine() {
        let r = CompletionRequest::parse(
            br#"{"model":"m","prompt":"x","presence_penalty":0.5,"frequency_penalty":-1,"logit_bias":{"20":-100,"3":5.5},"logprobs":2}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap();
        let plan = r.common.plan(&lim(), r.logprobs().unwrap()).unwrap();
        let s = plan.params.sampling();
        assert_eq!((s.presence_penalty, s.frequency_penalty), (0.5, -1.0));
        assert_eq!(s.logit_bias, [(3, 5.5), (20, -100.0)]);
        assert_eq!(plan.params.logprobs(), Some(2));
        assert!(!r.echo().unwrap());
        for (body, field) in [
            (r#"{"model":"m","prompt":"x","logprobs":21}"#, "logprobs"),
            (r#"{"model":"m","prompt":"x","logprobs":-1}"#, "logprobs"),
            (r#"{"model":"m","prompt":"x","logprobs":1,"echo":true}"#, "echo"),
        ] {
            let r = CompletionRequest::parse(body.as_bytes(), 8, UnknownFields::Refuse).unwrap();
            let e = r.logprobs().and_then(|_| r.echo()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
        }
        let r =
            CompletionRequest::parse(br#"{"model":"m","prompt":"x","echo":true}"#, 8, UnknownFields::Refuse).unwrap();
        assert!(r.echo().unwrap());
    }

    #[test]
    fn response_formats_parse_and_bad_ones_name_their_field() {
        let plan = |rf: &str| {
            let body = format!(r#"{{"model":"m","prompt":"x","response_format":{rf}}}"#);
            CompletionRequest::parse(body.as_bytes(), 8, UnknownFields::Refuse)
                .and_then(|r| r.common.plan(&lim(), None))
        };
        let json = Format::JsonSchema;
        assert_eq!(plan(r#"{"type":"text"}"#).unwrap().format, Format::Text);
        assert_eq!(plan(r#"{"type":"json_object"}"#).unwrap().format, Format::JsonObject);
        let s = r#"{"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":{"type":"integer"}}}"#;
        assert_eq!(plan(s).unwrap().format, json(serde_json::json!({"type": "integer"})));
        for any in [
            r#"{"type":"json_schema","json_schema":{"name":"p"}}"#,
            r#"{"type":"json_schema","json_schema":{"name":"p","schema":true}}"#,
        ] {
            assert_eq!(plan(any).unwrap().format, json(serde_json::json!({})), "{any}");
        }
        for (rf, field) in [
            (r#"{"type":"xml"}"#, "response_format.type"),
            (
                r#"{"type":"json_schema","json_schema":{"name":"a b"}}"#,
                "response_format.json_schema.name",
            ),
            (
                r#"{"type":"json_schema","json_schema":{"name":"p","schema":3}}"#,
                "response_format.json_schema.schema",
            ),
            (r#"{"type":"json_schema"}"#, "response_format"),
        ] {
            let e = plan(rf).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{rf}: {e:?}");
        }
    }

    #[test]
    fn depth_skips_brackets_in_strings() {
        assert_eq!(json_depth(br#"{"a":"[[[[\"{{{"}"#), 1);
        assert_eq!(json_depth(br#"[[{"a":[1]}]]"#), 4);
    }

    #[test]
    fn plan_checks_ranges_by_name() {
        let c = |j: &str| {
            CompletionRequest::parse(j.as_bytes(), 8, UnknownFields::Refuse)
                .unwrap()
                .common
        };
        let p = c(r#"{"model":"m","prompt":"x","max_completion_tokens":5,"max_tokens":9,"stop":"\n","seed":3}"#)
            .plan(&lim(), None)
            .unwrap();
        assert_eq!(
            (
                p.params.max_tokens(),
                p.params.stop().to_vec(),
                p.params.sampling().seed
            ),
            (5, vec!["\n".to_string()], Some(3))
        );
        for (body, field) in [
            (r#"{"model":"m","prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"model":"m","prompt":"x","n":5}"#, "n"),
            (r#"{"model":"m","prompt":"x","temperature":3}"#, "temperature"),
            (r#"{"model":"m","prompt":"x","top_p":0}"#, "top_p"),
            (
                r#"{"model":"m","prompt":"x","presence_penalty":2.5}"#,
                "presence_penalty",
            ),
            (
                r#"{"model":"m","prompt":"x","frequency_penalty":-2.5}"#,
                "frequency_penalty",
            ),
            (r#"{"model":"m","prompt":"x","logit_bias":{"a":1}}"#, "logit_bias"),
            (r#"{"model":"m","prompt":"x","logit_bias":{"7":-101}}"#, "logit_bias"),
            (r#"{"model":"m","prompt":"x","top_k":-1}"#, "top_k"),
            (
                r#"{"model":"m","prompt":"x","max_completion_tokens":-3}"#,
                "max_completion_tokens",
            ),
            (r#"{"model":"m","prompt":"x","stop":["a",""]}"#, "stop"),
        ] {
            let e = c(body).plan(&lim(), None).unwrap_err();
            assert_eq!(
                (e.code, e.param.as_deref()),
                ("invalid_parameter", Some(field)),
                "{body}"
            );
        }
        // One set of range rules, the engine's: the message names the field, the range and the value.
        let e = c(r#"{"model":"m","prompt":"x","temperature":3}"#)
            .plan(&lim(), None)
            .unwrap_err();
        assert_eq!(e.message, "temperature must be between 0 and 2, got 3");
    }

    #[test]
    fn what_the_edge_accepts_reaches_the_engine_as_validated() {
        use crate::engine::request::AdmissionLimits;
        let limits = AdmissionLimits {
            max_context: 64,
            vocab: 100,
            pool_tokens: 1024,
        };
        let r = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.5,"top_p":0.9,"top_k":7,"seed":11,"stop":["x"],"max_tokens":5,"logprobs":true,"top_logprobs":3,"n":2}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap();
        let plan = r.common.plan(&lim(), r.logprobs().unwrap()).unwrap();
        assert_eq!(
            plan.shape,
            Shape {
                n: 2,
                stream: false,
                include_usage: false
            }
        );
        // The one validated type, built from the checked parameters and the tokenized prompt.
        let valid = plan
            .params
            .with_prompt(crate::testutil::tenant(3), vec![1, 2, 3], &limits)
            .unwrap();
        let req = valid.request();
        assert_eq!(
            (req.owner.get(), &req.prompt[..], req.max_tokens),
            (3, &[1, 2, 3][..], 5)
        );
        assert_eq!(
            (
                req.sampling.temperature,
                req.sampling.top_p,
                req.sampling.top_k,
                req.sampling.seed
            ),
            (0.5, 0.9, 7, Some(11))
        );
        assert_eq!((&req.stop[..], req.logprobs), (&["x".to_string()][..], Some(3)));
        // Choices differ in seed only.
        assert_eq!(valid.choice(1).request().sampling.seed, Some(12));
        // What needs the prompt is checked with it: the model's context and vocabulary.
        let p = || r.common.plan(&lim(), None).unwrap().params;
        assert_eq!(
            p().with_prompt(crate::testutil::tenant(3), vec![1; 60], &limits)
                .unwrap_err()
                .code(),
            "context_length_exceeded"
        );
        assert_eq!(
            p().with_prompt(crate::testutil::tenant(3), vec![100], &limits)
                .unwrap_err()
                .code(),
            "invalid_token"
        );
        assert_eq!(
            p().with_prompt(crate::testutil::tenant(3), vec![], &limits)
                .unwrap_err()
                .code(),
            "empty_prompt"
        );
    }

    #[test]
    fn chat_messages_and_logprobs() {
        let r = ChatRequest::parse(br#"{"model":"m","messages":[{"role":"developer","content":[{"type":"text","text":"be brief"}]},{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":2}"#, 8, UnknownFields::Refuse)
        .unwrap();
        let m = r.chat_messages().unwrap();
        assert_eq!((m[0].role.as_str(), m[0].content.as_str()), ("system", "be brief"));
        assert_eq!(r.logprobs().unwrap(), Some(2));
        let r = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"function","content":"x"}]}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap();
        assert_eq!(
            r.chat_messages().unwrap_err().param.as_deref(),
            Some("messages[0].role")
        );
    }

    #[test]
    fn tool_history_parses_and_bad_history_names_the_field() {
        let r = ChatRequest::parse(
            br#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required","parallel_tool_calls":false,"messages":[{"role":"user","content":"go"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}]},{"role":"tool","tool_call_id":"call_1","content":"done"}]}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap();
        assert_eq!(
            r.tools.as_ref().unwrap().choice(),
            &crate::serve::tools::ToolChoice::Required
        );
        let m = r.chat_messages().unwrap();
        let call = &m[1].tool_calls.as_ref().unwrap()[0];
        assert_eq!(
            (call.id.as_str(), call.function.arguments["a"].as_i64()),
            ("call_1", Some(1))
        );
        assert_eq!(
            (m[2].role.as_str(), m[2].tool_call_id.as_deref()),
            ("tool", Some("call_1"))
        );
        for (messages, field) in [
            (
                r#"[{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{oops"}}]}]"#,
                "messages[0].tool_calls[0].function.arguments",
            ),
            (
                r#"[{"role":"assistant","tool_calls":[{"id":"c","type":"code","function":{"name":"f","arguments":"{}"}}]}]"#,
                "messages[0].tool_calls[0].type",
            ),
            (
                r#"[{"role":"user","content":"x","tool_calls":[]}]"#,
                "messages[0].tool_calls",
            ),
            (r#"[{"role":"tool","content":"x"}]"#, "messages[0].tool_call_id"),
            (
                r#"[{"role":"user","content":"x","tool_call_id":"c"}]"#,
                "messages[0].tool_call_id",
            ),
        ] {
            let body = format!(r#"{{"model":"m","messages":{messages}}}"#);
            let r = ChatRequest::parse(body.as_bytes(), 8, UnknownFields::Refuse).unwrap();
            assert_eq!(
                r.chat_messages().unwrap_err().param.as_deref(),
                Some(field),
                "{messages}"
            );
        }
        let e = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":"{}"}}]}"#,
            8,
            UnknownFields::Refuse,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.parameters"));
    }
}
