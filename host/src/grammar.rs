//! Structured output: a request's `response_format` compiled, against one model's vocabulary,
//! into a [`Constraint`] the engine applies when it samples (llguidance, the library vLLM,
//! SGLang and llama.cpp use).
//!
//! Each model gets a [`Grammars`]: its vocabulary as llguidance's token trie (every token's
//! bytes; control tokens marked so that no grammar can produce them as text), built on first
//! use, and a parser factory whose limits bound every compile and every mask. A schema larger
//! than [`GrammarLimits::max_schema_bytes`] is refused before anything is compiled; compiling
//! runs under llguidance's fuel limits, and the server refuses one that takes longer than
//! [`GrammarLimits::compile_ms`]. JSON is generated compactly (no free whitespace), so a model
//! cannot spend its tokens on spaces.

use std::sync::{Arc, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::engine::constraint::Constraint;
use crate::tokenizer::Tokenizer;

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
}

/// Why a format was not compiled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The schema (or the grammar made from the tools' schemas) is larger than the limit.
    #[error("the {what} is {size} bytes, more than the limit of {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// llguidance refused it (an unsupported keyword, an inconsistent schema, a limit hit).
    #[error("the schema cannot be used: {0}")]
    Invalid(String),
    /// The vocabulary could not be made into a token trie.
    #[error("structured output is unavailable for this model: {0}")]
    Unavailable(String),
}

/// One model's compiler of formats into constraints.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    factory: OnceLock<Result<ParserFactory, GrammarError>>,
    limits: GrammarLimits,
}

impl Grammars {
    /// A compiler for `tokenizer`'s vocabulary (its trie is built on first use).
    pub fn new(tokenizer: Arc<Tokenizer>, limits: GrammarLimits) -> Self {
        Self {
            tokenizer,
            factory: OnceLock::new(),
            limits,
        }
    }

    /// The limits compiles run under.
    pub fn limits(&self) -> GrammarLimits {
        self.limits
    }

    /// Builds the vocabulary's token trie now, if it is not built yet (it takes up to about a
    /// second for a large vocabulary); every compile needs it.
    pub fn warm(&self) {
        let _ = self.factory();
    }

    fn factory(&self) -> Result<&ParserFactory, GrammarError> {
        self.factory
            .get_or_init(|| build_factory(&self.tokenizer))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Compiles `format` (never [`Format::Text`], which constrains nothing: `None`). CPU-bound:
    /// call it off the async runtime.
    pub fn compile(&self, format: &Format) -> Result<Option<Constraint>, GrammarError> {
        let limit = self.limits.max_schema_bytes;
        let grammar = match format {
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
        };
        let parser = self
            .factory()?
            .create_parser(grammar)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(GrammarError::Invalid(e)),
            None => Ok(Some(Constraint::new(matcher))),
        }
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

/// llguidance's view of the vocabulary: each token's bytes; a control token (no bytes of its
/// own) as the special-token marker and its name, which grammars cannot produce as text.
fn build_factory(tk: &Tokenizer) -> Result<ParserFactory, GrammarError> {
    let n = tk.vocab_size();
    let eos = tk
        .eot_id()
        .or(tk.eos_id())
        .or(tk.eog_ids().first().copied())
        .ok_or_else(|| GrammarError::Unavailable("the vocabulary has no end-of-generation token".into()))?;
    let words: Vec<Vec<u8>> = (0..n as u32)
        .map(|id| {
            let bytes = tk.token_bytes(id);
            if !bytes.is_empty() {
                return bytes;
            }
            match tk.token_text(id) {
                Some(t) if !t.is_empty() => {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend_from_slice(t.as_bytes());
                    marked
                }
                _ => Vec::new(),
            }
        })
        .collect();
    let info = TokRxInfo::new(n as u32, eos);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
    let mut f = ParserFactory::new(
        &env,
        InferenceCapabilities::default(),
        &llguidance::earley::SlicedBiasComputer::general_slices(),
    )
    .map_err(|e| GrammarError::Unavailable(e.to_string()))?;
    f.quiet();
    // Errors name the grammar's problem, never the tokens so far.
    *f.limits_mut() = ParserLimits {
        verbose_errors: false,
        ..ParserLimits::default()
    };
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::constraint_allows as allows;

    fn grammars() -> Grammars {
        Grammars::new(
            crate::testutil::tokenizer(),
            GrammarLimits {
                max_schema_bytes: 4096,
                compile_ms: 2000,
            },
        )
    }

    #[test]
    fn a_schema_allows_its_json_and_refuses_other_text() {
        let g = grammars();
        let tk = crate::testutil::tokenizer();
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}, "required": ["city", "n"], "additionalProperties": false});
        let c = g.compile(&Format::JsonSchema(schema)).unwrap().unwrap();
        assert!(allows(&mut c.clone(), &tk, r#"{"city": "Paris", "n": 3}"#));
        assert!(!allows(&mut c.clone(), &tk, r#"{"town": "Paris"}"#));
        assert!(!allows(&mut c.clone(), &tk, "Paris"));
        let o = g.compile(&Format::JsonObject).unwrap().unwrap();
        assert!(allows(&mut o.clone(), &tk, r#"{"anything": [1, 2]}"#));
        assert!(!allows(&mut o.clone(), &tk, "[1]"));
        assert!(g.compile(&Format::Text).unwrap().is_none());
    }

    #[test]
    fn bad_and_oversized_schemas_are_refused_by_name() {
        let g = grammars();
        let e = g.compile(&Format::JsonSchema(json!({"type": "frog"}))).unwrap_err();
        assert!(matches!(e, GrammarError::Invalid(_)), "{e}");
        let big = json!({"type": "object", "description": "x".repeat(5000)});
        let e = g.compile(&Format::JsonSchema(big)).unwrap_err();
        assert!(e.to_string().contains("more than the limit of 4096"), "{e}");
    }
}
