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

/// One prompt of the Gemma oracle (`scripts/gemma-oracle.py`).
#[derive(Debug, Deserialize)]
pub struct GemmaPrompt {
    /// The prompt text (special tokens written out).
    pub prompt: String,
    /// llama.cpp's tokenization of it, BOS first.
    pub prompt_tokens: Vec<u32>,
    /// Each greedy position: llama.cpp's token and its top five `(id, logprob)`.
    pub steps: Vec<GemmaStep>,
}

/// One generated position of the Gemma oracle.
#[derive(Debug, Deserialize)]
pub struct GemmaStep {
    /// The token llama.cpp chose.
    pub id: u32,
    /// Its five most likely tokens and their log-probabilities, most likely first.
    pub top5: Vec<(u32, f32)>,
}

/// The Gemma oracle's prompts, by name: llama.cpp with its default (flash) attention, and with
/// flash attention off.
pub fn gemma_oracle() -> (
    std::collections::BTreeMap<String, GemmaPrompt>,
    std::collections::BTreeMap<String, GemmaPrompt>,
) {
    #[derive(Deserialize)]
    struct File {
        prompts: std::collections::BTreeMap<String, GemmaPrompt>,
    }
    let parse = |text: &str| -> std::collections::BTreeMap<String, GemmaPrompt> {
        serde_json::from_str::<File>(text)
            .expect("the Gemma oracle fixture parses")
            .prompts
    };
    (
        parse(include_str!("../tests/fixtures/gemma3-270m-q4_k_m-greedy.json")),
        parse(include_str!("../tests/fixtures/gemma3-270m-q4_k_m-greedy-fa-off.json")),
    )
}

/// The logits after `prompt` and after each of `then` fed one at a time (teacher forcing): one
/// row per token of `then`, the first for the position right after the prompt.
pub fn teacher_forced(m: &Model, prompt: &[u32], then: &[u32]) -> Vec<Vec<f32>> {
    use crate::kv::{KvPool, SeqId};
    use crate::model::{Forward, Scratch, StepSeq};
    let n = prompt.len() + then.len();
    let mut pool = KvPool::new(m.config().attn_shape(16), m.config().n_layers, 64 << 20).expect("pool");
    pool.open(SeqId(1), tenant(1), pool.pages_for(n), &[]).expect("open");
    let (mut pos, mut feed) = (0, prompt.to_vec());
    let mut scratch = Scratch::default();
    let mut rows = Vec::with_capacity(then.len());
    for &next in then {
        pool.ensure(SeqId(1), pos + feed.len()).expect("ensure");
        pool.commit_slots(SeqId(1), pos + feed.len()).expect("commit");
        let step = [StepSeq {
            seq: SeqId(1),
            tokens: &feed,
            pos0: pos,
            want_logits: true,
        }];
        let logits = m
            .forward(&mut pool, &step, warden_kernels::tag::TagCheck::Enforce, &mut scratch)
            .remove(0)
            .expect("no error")
            .expect("logits");
        rows.push(logits);
        pos += feed.len();
        feed = vec![next];
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

/// One prompt of the llama.cpp oracle.
#[derive(Debug, Deserialize)]
pub struct OraclePrompt {
    /// The prompt text.
    pub prompt: String,
    /// llama.cpp's tokenization of it.
    pub prompt_tokens: Vec<u32>,
    /// llama.cpp's greedy continuation.
    pub generated_tokens: Vec<u32>,
    /// The five highest logits at the first generated position.
    pub first_position_top5: Vec<OracleLogit>,
}

/// A logit in the oracle.
#[derive(Debug, Deserialize)]
pub struct OracleLogit {
    /// Token id.
    pub id: u32,
    /// Raw logit.
    pub logit: f32,
}

#[derive(Deserialize)]
struct Oracle {
    end_of_generation_ids: Vec<u32>,
    prompts: std::collections::BTreeMap<String, OraclePrompt>,
}

/// The oracle's prompts and its end-of-generation ids.
pub fn oracle() -> (Vec<OraclePrompt>, Vec<u32>) {
    let o: Oracle = serde_json::from_str(include_str!("../tests/fixtures/smollm2-q4_1-greedy.json"))
        .expect("the oracle fixture parses");
    (o.prompts.into_values().collect(), o.end_of_generation_ids)
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
