//! Shared helpers for the crate's tests: the real default model, loaded once, and the llama.cpp
//! oracle fixture.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use serde::Deserialize;

use crate::engine::text::Detokenizer;
use crate::model::Model;

/// The default model's path in this checkout.
pub fn model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate::DEFAULT_MODEL)
}

/// The default model, loaded once per test binary. Fails (never skips) when it is missing.
pub fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let p = model_path();
            if !p.exists() {
                panic!("model missing at {}: run scripts/fetch-model.sh", p.display());
            }
            Arc::new(Model::load(&p).unwrap_or_else(|e| panic!("loading {}: {e}", p.display())))
        })
        .clone()
}

/// The default model's tokenizer, loaded once per test binary.
pub fn tokenizer() -> Arc<crate::tokenizer::Tokenizer> {
    static TOK: OnceLock<Arc<crate::tokenizer::Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let p = model_path();
        let g = crate::gguf::Gguf::open(&p).unwrap_or_else(|e| panic!("model missing at {}: {e}", p.display()));
        Arc::new(crate::tokenizer::Tokenizer::from_gguf(&g).expect("tokenizer"))
    })
    .clone()
}

/// Gemma 3 270M Q4_K_M (fetched beside the default model by `scripts/fetch-model.sh`) and its
/// tokenizer, loaded once per test binary. Fails (never skips) when the file is missing.
pub fn gemma() -> (Arc<Model>, Arc<crate::tokenizer::Tokenizer>) {
    static GEMMA: OnceLock<(Arc<Model>, Arc<crate::tokenizer::Tokenizer>)> = OnceLock::new();
    GEMMA
        .get_or_init(|| {
            let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(crate::GEMMA_MODEL);
            if !p.exists() {
                panic!("model missing at {}: run scripts/fetch-model.sh", p.display());
            }
            let g = crate::gguf::Gguf::open(&p).unwrap_or_else(|e| panic!("opening {}: {e}", p.display()));
            let model = Model::from_gguf(&g).unwrap_or_else(|e| panic!("loading {}: {e}", p.display()));
            let tok = crate::tokenizer::Tokenizer::from_gguf(&g).expect("gemma's tokenizer");
            (Arc::new(model), Arc::new(tok))
        })
        .clone()
}

/// One prompt of a llama.cpp oracle (`scripts/oracle.py`).
#[derive(Debug, Deserialize)]
pub struct OraclePrompt {
    /// A chat prompt's messages (the prompt is what llama.cpp's template engine made of them).
    pub messages: Option<Vec<crate::chat::ChatMessage>>,
    /// The prompt text (special tokens written out).
    pub prompt: String,
    /// llama.cpp's tokenization of it, BOS first where the model wants one.
    pub prompt_tokens: Vec<u32>,
    /// Each greedy position: llama.cpp's token and its top five `(id, logprob)`.
    pub steps: Vec<OracleStep>,
}

/// One generated position of an oracle.
#[derive(Debug, Deserialize)]
pub struct OracleStep {
    /// The token llama.cpp chose.
    pub id: u32,
    /// Its five most likely tokens and their log-probabilities, most likely first.
    pub top5: Vec<(u32, f32)>,
}

/// An oracle's prompts, by name.
pub type Oracle = std::collections::BTreeMap<String, OraclePrompt>;

fn parse_oracle(text: &str) -> Oracle {
    #[derive(Deserialize)]
    struct File {
        prompts: Oracle,
    }
    serde_json::from_str::<File>(text)
        .expect("the oracle fixture parses")
        .prompts
}

/// The Gemma oracle: llama.cpp with its default (flash) attention, and with flash attention off.
pub fn gemma_oracle() -> (Oracle, Oracle) {
    (
        parse_oracle(include_str!("../tests/fixtures/gemma3-270m-q4_k_m-greedy.json")),
        parse_oracle(include_str!("../tests/fixtures/gemma3-270m-q4_k_m-greedy-fa-off.json")),
    )
}

/// The F32 reference for the SmolLM2 oracle: the same weights, dequantized, with an F32 KV
/// cache and flash attention off, fed the oracle's tokens.
pub fn smollm_reference() -> Oracle {
    parse_oracle(include_str!("../tests/fixtures/smollm2-q4_1-steps-reference.json"))
}

/// The SmolLM2 Q4_1 oracle (raw and chat prompts), likewise.
pub fn smollm_oracle() -> (Oracle, Oracle) {
    (
        parse_oracle(include_str!("../tests/fixtures/smollm2-q4_1-steps.json")),
        parse_oracle(include_str!("../tests/fixtures/smollm2-q4_1-steps-fa-off.json")),
    )
}

/// The logits after `prompt` and after each of `then` fed one at a time (teacher forcing): one
/// row per token of `then`, the first for the position right after the prompt.
pub fn teacher_forced(m: &Model, prompt: &[u32], then: &[u32]) -> Vec<Vec<f32>> {
    feed(m, prompt, then.len(), |k, _| then[k])
}

/// `n` greedy tokens after `prompt`, each fed back in turn.
pub fn greedy(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut got = Vec::with_capacity(n);
    feed(m, prompt, n, |_, logits| {
        let t = crate::engine::sampling::argmax(logits);
        got.push(t);
        t
    });
    got
}

/// `n` positions after `prompt`: the logits of each, and the token `next` picks from them
/// (given its index) fed in turn.
fn feed(m: &Model, prompt: &[u32], n: usize, mut next: impl FnMut(usize, &[f32]) -> u32) -> Vec<Vec<f32>> {
    use crate::kv::{KvPool, SeqId};
    use crate::model::{Forward, Scratch, StepSeq};
    let total = prompt.len() + n;
    let mut pool = KvPool::new(m.config().attn_shape(16), m.config().n_layers, 64 << 20).expect("pool");
    pool.open(SeqId(1), tenant(1), pool.pages_for(total), &[])
        .expect("open");
    let (mut pos, mut feed) = (0, prompt.to_vec());
    let mut scratch = Scratch::default();
    let mut rows = Vec::with_capacity(n);
    for k in 0..n {
        pool.ensure(SeqId(1), pos + feed.len()).expect("ensure");
        pool.commit_slots(SeqId(1), pos + feed.len()).expect("commit");
        let step = [StepSeq {
            seq: SeqId(1),
            tokens: &feed,
            pos0: pos,
            want_logits: true,
            prompt: k == 0,
        }];
        let logits = m
            .forward(&mut pool, &step, warden_kernels::tag::TagCheck::Enforce, &mut scratch)
            .remove(0)
            .expect("no error")
            .expect("logits");
        pos += feed.len();
        feed = vec![next(k, &logits)];
        rows.push(logits);
    }
    rows
}

/// A detokenizer that needs no vocabulary: token `id` reads as `<id>`, and SmolLM2's
/// end-of-generation ids end generation.
pub struct IdDetok;

impl Detokenizer for IdDetok {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        format!("<{id}>").into_bytes()
    }
    fn is_eog(&self, id: u32) -> bool {
        [0, 2, 4].contains(&id)
    }
}

/// Tenant `n` (tests number their tenants from 1).
pub fn tenant(n: u64) -> crate::tenant::TenantId {
    crate::tenant::TenantId::new(n).expect("test tenants are numbered from 1")
}

/// Opens the store in `dir` again after a handle to it was dropped. sled's background flusher
/// holds the file lock until its next wake-up, so an immediate reopen in the same process can
/// find it still locked; this waits (up to 5 s) for the lock to go.
pub fn reopen_store(dir: &std::path::Path) -> crate::serve::store::Store {
    use crate::serve::store::{Store, StoreError};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match Store::open(dir) {
            Err(StoreError::Locked(_)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r.expect("the store reopens"),
        }
    }
}

/// Feeds `text`'s tokens to a constraint: whether each was allowed.
pub fn constraint_allows(
    c: &mut crate::engine::constraint::Constraint,
    tk: &crate::tokenizer::Tokenizer,
    text: &str,
) -> bool {
    let ids: Vec<u32> = tk
        .encode(text, false)
        .into_iter()
        .filter(|&t| Some(t) != tk.bos_id())
        .collect();
    let mut logits = vec![0f32; tk.vocab_size()];
    for id in ids {
        logits.fill(0.0);
        if c.apply(&mut logits).is_err() || logits[id as usize] == f32::NEG_INFINITY {
            return false;
        }
        if c.accept(id).is_err() {
            return false;
        }
    }
    true
}

/// Whether a constraint, after what it has accepted, allows the end of generation.
pub fn constraint_allows_end(c: &mut crate::engine::constraint::Constraint, tk: &crate::tokenizer::Tokenizer) -> bool {
    let mut logits = vec![0f32; tk.vocab_size()];
    let end = tk.eot_id().or(tk.eos_id()).expect("an end token");
    c.apply(&mut logits).is_ok() && logits[end as usize] != f32::NEG_INFINITY
}

/// Runs `f` with this thread's log events captured (text lines, every level): what it returns,
/// and what was logged.
pub fn capture_logs<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let out = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || out.clone())
        .finish();
    let r = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    (r, text)
}
