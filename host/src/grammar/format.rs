//! What a request asks its output to be ([`Format`]), the bounds of compiling it
//! ([`GrammarLimits`]), and its translation into llguidance's grammar within them: the same in
//! the server and in the child process that checks a tenant's format first.

use llguidance::api::{ParserLimits, TopLevelGrammar};
use serde_json::{Value, json};

use super::bounds;
use super::error::GrammarError;

/// What a request asks its output to be. It crosses a cluster's link as the router checked it:
/// the decode node compiles it again against its own vocabulary (the same file's).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", content = "source", rename_all = "snake_case")]
pub enum Format {
    /// Any text.
    #[default]
    Text,
    /// A JSON object.
    JsonObject,
    /// JSON that a schema accepts.
    JsonSchema(Value),
    /// Text a Lark grammar (llguidance's dialect, with `%json` schemas) accepts: the server's
    /// own grammars, such as the one that makes a request's tool calls hold.
    Grammar(String),
}

/// Bounds on compiling a request's format.
#[derive(Debug, Clone, Copy)]
pub struct GrammarLimits {
    /// Largest schema, in bytes of JSON.
    pub max_schema_bytes: usize,
    /// Longest a compile may take, in milliseconds.
    pub compile_ms: u64,
    /// Most memory a compile may take (its child's heap), in bytes.
    pub memory_bytes: u64,
}

/// `format` as llguidance's grammar (`None` for [`Format::Text`]), if it is within
/// `max_schema_bytes` and [`bounds`].
pub(crate) fn top_level(format: &Format, max_schema_bytes: usize) -> Result<Option<TopLevelGrammar>, GrammarError> {
    let limit = max_schema_bytes;
    Ok(Some(match format {
        Format::Text => return Ok(None),
        Format::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
        Format::JsonSchema(s) => {
            let size = serde_json::to_vec(s).map(|v| v.len()).unwrap_or(usize::MAX);
            if size > limit {
                return Err(GrammarError::TooLarge {
                    what: "schema",
                    size,
                    limit,
                });
            }
            bounds::check(s)?;
            TopLevelGrammar::from_json_schema(compact(s.clone()))
        }
        Format::Grammar(g) => {
            if g.len() > limit {
                return Err(GrammarError::TooLarge {
                    what: "grammar",
                    size: g.len(),
                    limit,
                });
            }
            TopLevelGrammar::from_lark(g.clone())
        }
    }))
}

/// The parser limits every compile and every mask runs under: llguidance's defaults, with
/// errors that name the grammar's problem, never the tokens so far.
pub(crate) fn parser_limits() -> ParserLimits {
    ParserLimits {
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// `schema` with compact JSON (no whitespace between items) unless it sets its own layout.
pub(crate) fn compact(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}
