//! Structured output: a request's `response_format` compiled, against one model's vocabulary,
//! into a [`Constraint`] the engine applies when it samples (llguidance, the library vLLM,
//! SGLang and llama.cpp use).
//!
//! Each model gets a [`Grammars`]: its vocabulary as llguidance's token trie (every token's
//! bytes; control tokens marked so that no grammar can produce them as text), built on first
//! use, and a parser factory whose limits bound every compile and every mask. JSON is generated
//! compactly (no free whitespace), so a model cannot spend its tokens on spaces.
//!
//! A tenant's format is compiled through [`TenantGrammars`], as work the tenant pays for
//! (invariant 8), never as a cost shared by everyone:
//! - a schema larger than [`GrammarLimits::max_schema_bytes`], or with a keyword whose cost its
//!   size does not bound ([`bounds`]), is refused before anything is compiled;
//! - compiles take turns, fairly across tenants and one at a time per tenant
//!   ([`crate::fair::Turns`]): a tenant's compiles wait behind each other, not in front of
//!   others';
//! - each is first compiled in a child process ([`check`]) that is killed when its time
//!   ([`GrammarLimits::compile_ms`]) or memory ([`GrammarLimits::memory_bytes`]) runs out, so a
//!   compile that would not end stops and gives its memory back; only a format the child
//!   compiled within them is compiled in the server;
//! - a tenant's identical formats are compiled once: the result (a refusal too) is kept per
//!   tenant within a memory budget, evicted fairly ([`crate::fair::FairCache`]).

pub mod bounds;
pub mod check;
mod error;
mod format;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use error::GrammarError;
pub(crate) use format::compact;
pub use format::{Format, GrammarLimits};
use format::{parser_limits, top_level};
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::engine::constraint::Constraint;
use crate::fair::{FairCache, Turns};
use crate::tenant::TenantId;
use crate::tokenizer::Tokenizer;

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

    /// Compiles `format` in this thread (never [`Format::Text`], which constrains nothing:
    /// `None`), within llguidance's fuel limits but no time or memory limit: for formats the
    /// server trusts (an operator's benchmark schema, a plugin test run locally) or has checked
    /// ([`TenantGrammars`] compiles a tenant's). CPU-bound: call it off the async runtime.
    pub fn compile(&self, format: &Format) -> Result<Option<Constraint>, GrammarError> {
        let Some(grammar) = top_level(format, self.limits.max_schema_bytes)? else {
            return Ok(None);
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

/// How long a compile's refusal for want of time or memory is kept: the same format may fit on
/// a less loaded machine later.
const RETRY_AFTER_LIMIT: Duration = Duration::from_secs(60);

/// A kept compile: the constraint at the start of the output, or why there is none.
#[derive(Clone)]
struct Kept {
    at: Instant,
    result: Result<Constraint, GrammarError>,
}

impl Kept {
    /// Whether it still answers for its format.
    fn fresh(&self) -> bool {
        match &self.result {
            Err(GrammarError::TimedOut { .. } | GrammarError::TooMuchMemory { .. }) => {
                self.at.elapsed() < RETRY_AFTER_LIMIT
            }
            _ => true,
        }
    }
}

/// One model's formats as tenants' requests compile them: checked in a child process first,
/// taking turns, kept per tenant (see the module's documentation).
pub struct TenantGrammars {
    grammars: Arc<Grammars>,
    /// The server's binary, which checks formats as `warden check-grammar`.
    exe: PathBuf,
    turns: Turns,
    kept: Mutex<FairCache<[u8; 32], Kept>>,
}

impl TenantGrammars {
    /// Compiles into `grammars`' vocabulary, checking with `exe` (the server's binary), at most
    /// `compiles` at once over all tenants, keeping up to `kept_bytes` of compiled formats.
    pub fn new(grammars: Arc<Grammars>, exe: &Path, compiles: usize, kept_bytes: usize) -> Self {
        Self {
            grammars,
            exe: exe.to_path_buf(),
            turns: Turns::new(compiles, 1),
            kept: Mutex::new(FairCache::new(kept_bytes)),
        }
    }

    /// The model's compiler.
    pub fn grammars(&self) -> &Arc<Grammars> {
        &self.grammars
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, FairCache<[u8; 32], Kept>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lookup(&self, tenant: TenantId, key: &[u8; 32]) -> Option<Result<Constraint, GrammarError>> {
        let mut kept = self.kept();
        match kept.get(tenant, key) {
            Some(k) if k.fresh() => Some(k.result),
            Some(_) => {
                kept.remove(tenant, key);
                None
            }
            None => None,
        }
    }

    /// Compiles `format` for a request of `tenant` (`None` for [`Format::Text`]): from what the
    /// tenant compiled before, else in its turn, checked in a child process and then compiled
    /// here. Every refusal names what was wrong.
    pub async fn compile(&self, tenant: TenantId, format: &Format) -> Result<Option<Constraint>, GrammarError> {
        let limits = self.grammars.limits;
        if top_level(format, limits.max_schema_bytes)?.is_none() {
            return Ok(None);
        }
        let text = serde_json::to_vec(format).map_err(|e| GrammarError::Unavailable(e.to_string()))?;
        let key: [u8; 32] = {
            use sha2::Digest;
            sha2::Sha256::digest(&text).into()
        };
        if let Some(r) = self.lookup(tenant, &key) {
            return r.map(Some);
        }
        let turn = self.turns.take(tenant).await;
        // Another of the tenant's requests may have compiled it while this one waited.
        if let Some(r) = self.lookup(tenant, &key) {
            return r.map(Some);
        }
        let result = match check::in_child(&self.exe, format, limits).await {
            Ok(grew) => {
                let (grammars, format) = (self.grammars.clone(), format.clone());
                // Within the bounds the child kept to: compiled here, on the blocking pool,
                // still in the tenant's turn.
                let here = tokio::task::spawn_blocking(move || {
                    let c = grammars.compile(&format);
                    drop(turn);
                    c
                })
                .await
                .unwrap_or_else(|e| Err(GrammarError::Unavailable(format!("the compile failed: {e}"))));
                here.and_then(|c| c.ok_or_else(|| GrammarError::Unavailable("nothing to compile".into())))
                    .map(|c| (c, grew))
            }
            Err(e) => Err(e),
        };
        let (result, weight) = match result {
            Ok((c, grew)) => (Ok(c), grew as usize + text.len()),
            Err(e) => (Err(e), text.len()),
        };
        if !matches!(result, Err(GrammarError::Unavailable(_))) {
            let kept = Kept {
                at: Instant::now(),
                result: result.clone(),
            };
            self.kept().insert(tenant, key, kept, weight.max(4096));
        }
        result.map(Some)
    }

    /// Forgets what `tenant` compiled (it was deleted).
    pub fn forget(&self, tenant: TenantId) {
        self.kept().forget(tenant);
    }
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
    *f.limits_mut() = parser_limits();
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::constraint_allows as allows;
    use serde_json::json;

    fn grammars() -> Grammars {
        Grammars::new(
            crate::testutil::tokenizer(),
            GrammarLimits {
                max_schema_bytes: 4096,
                compile_ms: 2000,
                memory_bytes: 256 << 20,
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
