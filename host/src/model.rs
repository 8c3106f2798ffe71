//! A llama-architecture model loaded from GGUF, and its batched forward pass over the KV pool.
//!
//! [`Model::load`] validates the hyperparameters against the tensor shapes, repacks the weights for
//! the kernels (Q, K and V stacked into one matrix, gate and up into another) and keeps the rest.
//! [`Model::forward`] runs one engine step: any mix of sequences, each with some new tokens at its
//! next positions (a prefill chunk or one decode token), flattened into one activation matrix so
//! every matmul is one call for the whole batch. Each sequence's K/V go to its own pages and its
//! attention reads them through its page table with tag checks; a sequence whose check fails gets
//! its violation and no logits, and the others in the batch are unaffected.

use std::collections::HashSet;
use std::path::Path;

use warden_kernels::attention::{AttnSeq, AttnShape};
use warden_kernels::matmul::{ActNeeds, QActs, QMatrix};
use warden_kernels::ops::Rope;
use warden_kernels::quant::{GgmlType, dequantize};
use warden_kernels::tag::{IsolationViolation, Owner, TagCheck};
use warden_kernels::{Backend, CpuBackend};

use crate::gguf::{Gguf, GgufError, Value};
use crate::kv::{KvError, KvPool, SeqId};

/// Errors loading a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is not valid GGUF.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// Valid GGUF that is not a model Warden can run.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A tensor whose shape or type does not fit the hyperparameters.
    #[error("tensor {name:?}: {why}")]
    BadTensor {
        /// Tensor.
        name: String,
        /// What is wrong.
        why: String,
    },
}

/// Llama hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Embedding width.
    pub dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Feed-forward width.
    pub ffn_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Trained context length.
    pub context_length: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Dimensions RoPE rotates.
    pub rope_dim: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// Whether the output projection reuses the token embedding.
    pub tied_embeddings: bool,
}

/// The `llama.*` metadata keys [`LlamaConfig::from_gguf`] reads.
const LLAMA_KEYS: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "vocab_size",
];

/// Refuses a `llama.*` key that changes the computation and that this loader does not implement
/// (rope scaling, sliding windows, soft-capping, experts, other head widths...): running the file
/// without it would compute something else than the file describes. Keys that only restate what
/// the loader does anyway are accepted.
fn check_llama_keys(g: &Gguf, head_dim: usize) -> Result<(), ModelError> {
    for (key, v) in g.metadata() {
        let Some(rest) = key.strip_prefix("llama.") else {
            continue;
        };
        let restates = match rest {
            _ if LLAMA_KEYS.contains(&rest) => true,
            // Linear scaling by a factor of 1 is none; any other factor is refused below, on its
            // own key, whatever the type says (llama.cpp applies a factor when no type is given).
            "rope.scaling.type" => matches!(v, Value::String(t) if t == "none" || t == "linear"),
            "rope.scaling.factor" => matches!(v.as_f64(), Some(f) if f == 0.0 || f == 1.0),
            // Read only by the scaling types refused above.
            "rope.scaling.original_context_length" => true,
            "attention.key_length" | "attention.value_length" => v.as_u64() == Some(head_dim as u64),
            "expert_count" | "expert_used_count" => v.as_u64() == Some(0),
            _ => false,
        };
        if !restates {
            return Err(ModelError::Unsupported(format!(
                "metadata key {key:?} (a {}) changes the computation, and Warden's llama does not implement it",
                v.type_name()
            )));
        }
    }
    Ok(())
}

impl LlamaConfig {
    fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "architecture {arch:?} (supported: llama)"
            )));
        }
        let u = |k: &str| -> Result<usize, ModelError> {
            let v = g.get_u64(&format!("llama.{k}"))?;
            if v == 0 || v > 1 << 24 {
                return Err(ModelError::Unsupported(format!("llama.{k} = {v}")));
            }
            Ok(v as usize)
        };
        let dim = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = match g.get("llama.attention.head_count_kv") {
            Some(_) => u("attention.head_count_kv")?,
            None => n_heads,
        };
        if !dim.is_multiple_of(n_heads) || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(ModelError::Unsupported(format!(
                "embedding {dim} with {n_heads} heads and {n_kv_heads} KV heads"
            )));
        }
        let head_dim = dim / n_heads;
        let rope_dim = match g.get("llama.rope.dimension_count") {
            Some(_) => u("rope.dimension_count")?,
            None => head_dim,
        };
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(ModelError::Unsupported(format!(
                "rope dimension {rope_dim} for heads of {head_dim}"
            )));
        }
        check_llama_keys(g, head_dim)?;
        let (embd, _) = g.tensor_data("token_embd.weight")?;
        let vocab = match g.get("llama.vocab_size") {
            Some(_) => u("vocab_size")?,
            None => embd.dims.get(1).copied().unwrap_or(0) as usize,
        };
        let f = |k: &str, default: f64| -> Result<f32, ModelError> {
            match g.get(k) {
                None => Ok(default as f32),
                Some(_) => {
                    let v = g.get_f64(k)?;
                    if !(v.is_finite() && v > 0.0) {
                        return Err(ModelError::Unsupported(format!("{k} = {v}")));
                    }
                    Ok(v as f32)
                }
            }
        };
        Ok(Self {
            n_layers: u("block_count")?,
            dim,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: u("feed_forward_length")?,
            vocab,
            context_length: u("context_length")?,
            rope_base: f("llama.rope.freq_base", 10000.0)?,
            rope_dim,
            norm_eps: f("llama.attention.layer_norm_rms_epsilon", 1e-5)?,
            tied_embeddings: g.tensor("output.weight").is_none(),
        })
    }

    /// The attention shape for a KV pool with pages of `page_size`.
    pub fn attn_shape(&self, page_size: usize) -> AttnShape {
        AttnShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            page_size,
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wqkv: QMatrix,
    wo: QMatrix,
    ffn_norm: Vec<f32>,
    w_gate_up: QMatrix,
    w_down: QMatrix,
}

/// A loaded model.
pub struct Model {
    cfg: LlamaConfig,
    embd_type: GgmlType,
    embd: Vec<u8>,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    output: QMatrix,
    /// The forms of the activations the matrices read (every matrix meets the same buffer).
    act_needs: ActNeeds,
    rope: Rope,
    backend: Box<dyn Backend>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("cfg", &self.cfg)
            .field("backend", &self.backend.name())
            .finish()
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone)]
pub struct StepSeq<'a> {
    /// Its id in the KV pool (the pool knows its owner and pages).
    pub seq: SeqId,
    /// New tokens, at positions `pos0..pos0 + tokens.len()`.
    pub tokens: &'a [u32],
    /// Position of the first new token.
    pub pos0: usize,
    /// Whether to compute logits for the last new token.
    pub want_logits: bool,
}

/// What the engine needs of a model: its shape, and a step's forward pass over the KV pool.
/// [`Model`] is the real one; the engine's own tests drive a stand-in, so that scheduling is
/// tested without loading weights.
pub trait Forward: Send + Sync {
    /// The hyperparameters.
    fn config(&self) -> &LlamaConfig;

    /// Runs one step. Returns, per sequence, its logits (when asked for) or the error that fails
    /// it. Token ids must be below the vocabulary size (the engine validates them at admission).
    fn forward(
        &self,
        pool: &mut KvPool,
        seqs: &[StepSeq<'_>],
        check: TagCheck,
        s: &mut Scratch,
    ) -> Vec<Result<Option<Vec<f32>>, StepError>>;
}

impl Forward for Model {
    fn config(&self) -> &LlamaConfig {
        Model::config(self)
    }

    fn forward(
        &self,
        pool: &mut KvPool,
        seqs: &[StepSeq<'_>],
        check: TagCheck,
        s: &mut Scratch,
    ) -> Vec<Result<Option<Vec<f32>>, StepError>> {
        // The whole step runs on a worker of the thread pool: the kernels' parallel loops then
        // split work between workers that are already awake, instead of each of the ~150 calls
        // of a step waking sleeping threads from outside the pool and blocking until they finish.
        rayon::scope(|_| self.forward_in_pool(pool, seqs, check, s))
    }
}

/// Errors of one sequence in a step.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StepError {
    /// A tag check refused a read or write: the sequence must fail.
    #[error(transparent)]
    Isolation(#[from] IsolationViolation),
    /// The pool refused (no such sequence, pages not allocated).
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// Reusable buffers for [`Model::forward`].
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    hidden: Vec<f32>,
    acts: QActs,
}

fn norm_weights(g: &Gguf, name: &str, dim: usize) -> Result<Vec<f32>, ModelError> {
    let (t, data) = g.tensor_data(name)?;
    if t.elems() != dim as u64 {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("has {} elements, expected {dim}", t.elems()),
        });
    }
    let mut out = vec![0f32; dim];
    dequantize(t.ty, data, &mut out);
    Ok(out)
}

fn matrix_part<'a>(
    g: &'a Gguf,
    name: &str,
    cols: usize,
    rows: usize,
) -> Result<(GgmlType, usize, &'a [u8]), ModelError> {
    let (t, data) = g.tensor_data(name)?;
    if t.dims.len() != 2 || t.dims[0] != cols as u64 || t.dims[1] != rows as u64 {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("shape {:?}, expected [{cols}, {rows}]", t.dims),
        });
    }
    Ok((t.ty, rows, data))
}

fn matrix(g: &Gguf, names: &[(&str, usize)], cols: usize) -> Result<QMatrix, ModelError> {
    let parts = names
        .iter()
        .map(|&(n, rows)| matrix_part(g, n, cols, rows))
        .collect::<Result<Vec<_>, _>>()?;
    QMatrix::concat(&parts, cols).map_err(|e| ModelError::BadTensor {
        name: names[0].0.into(),
        why: e.to_string(),
    })
}

/// Llama 3.1-style rope frequency factors, one per rotated pair (see
/// [`Rope::with_freq_factors`]).
const ROPE_FREQS: &str = "rope_freqs.weight";

/// Each block's tensors, as `blk.{l}.{name}.weight`.
const BLOCK_TENSORS: &[&str] = &[
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

/// Refuses a file carrying a tensor the forward pass would not read (attention biases, q/k
/// norms, a block past `block_count`...): ignoring it would compute something else than the file
/// describes.
fn check_tensors(g: &Gguf, cfg: &LlamaConfig) -> Result<(), ModelError> {
    let mut read: HashSet<String> = ["token_embd.weight", "output_norm.weight", "output.weight", ROPE_FREQS]
        .into_iter()
        .map(String::from)
        .collect();
    for l in 0..cfg.n_layers {
        read.extend(BLOCK_TENSORS.iter().map(|t| format!("blk.{l}.{t}.weight")));
    }
    match g.tensors().iter().find(|t| !read.contains(&t.name)) {
        Some(t) => Err(ModelError::BadTensor {
            name: t.name.clone(),
            why: "is not part of the llama architecture as Warden runs it; running without it would compute something else than the file describes".into(),
        }),
        None => Ok(()),
    }
}

impl Model {
    /// Loads a llama-architecture GGUF model from `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_gguf(&Gguf::open(path)?)
    }

    /// Builds the model from a parsed GGUF file.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf(g)?;
        check_tensors(g, &cfg)?;
        let (dim, kvd, ffn) = (cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: norm_weights(g, &n("attn_norm"), dim)?,
                wqkv: matrix(g, &[(&n("attn_q"), dim), (&n("attn_k"), kvd), (&n("attn_v"), kvd)], dim)?,
                wo: matrix(g, &[(&n("attn_output"), dim)], dim)?,
                ffn_norm: norm_weights(g, &n("ffn_norm"), dim)?,
                w_gate_up: matrix(g, &[(&n("ffn_gate"), ffn), (&n("ffn_up"), ffn)], dim)?,
                w_down: matrix(g, &[(&n("ffn_down"), dim)], ffn)?,
            });
        }
        let (embd_ty, _, embd) = matrix_part(g, "token_embd.weight", dim, cfg.vocab)?;
        let out_name = if cfg.tied_embeddings {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let output = matrix(g, &[(out_name, cfg.vocab)], dim)?;
        let act_needs = layers.iter().fold(output.needs(), |n, l| {
            n | l.wqkv.needs() | l.wo.needs() | l.w_gate_up.needs() | l.w_down.needs()
        });
        let rope = match g.tensor(ROPE_FREQS) {
            None => Rope::new(cfg.head_dim, cfg.rope_dim, cfg.rope_base),
            Some(_) => {
                let factors = norm_weights(g, ROPE_FREQS, cfg.rope_dim / 2)?;
                if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                    return Err(ModelError::BadTensor {
                        name: ROPE_FREQS.into(),
                        why: format!("has factor {f}; rope frequency factors are positive"),
                    });
                }
                Rope::with_freq_factors(cfg.head_dim, cfg.rope_dim, cfg.rope_base, &factors)
            }
        };
        Ok(Self {
            rope,
            output,
            act_needs,
            output_norm: norm_weights(g, "output_norm.weight", dim)?,
            embd_type: embd_ty,
            embd: embd.to_vec(),
            layers,
            cfg,
            backend: Box::new(CpuBackend),
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    fn embed(&self, be: &dyn Backend, token: u32, out: &mut [f32]) {
        let row_bytes = self.embd_type.bytes_for(self.cfg.dim as u64).unwrap_or(0) as usize;
        let t = token as usize;
        be.dequantize_row(self.embd_type, &self.embd[t * row_bytes..(t + 1) * row_bytes], out);
    }

    fn forward_in_pool(
        &self,
        pool: &mut KvPool,
        seqs: &[StepSeq<'_>],
        check: TagCheck,
        s: &mut Scratch,
    ) -> Vec<Result<Option<Vec<f32>>, StepError>> {
        let c = &self.cfg;
        let (dim, kvd, ffn) = (c.dim, c.n_kv_heads * c.head_dim, c.ffn_dim);
        let qkv_w = dim + 2 * kvd;
        let total: usize = seqs.iter().map(|q| q.tokens.len()).sum();
        let mut results: Vec<Result<(), StepError>> = vec![Ok(()); seqs.len()];
        let mut positions = Vec::with_capacity(total);
        let mut tables = Vec::with_capacity(seqs.len());
        for (i, sq) in seqs.iter().enumerate() {
            positions.extend((0..sq.tokens.len()).map(|j| (sq.pos0 + j) as u32));
            match pool.table(sq.seq) {
                Ok((owner, t)) => tables.push((owner, t.to_vec())),
                Err(e) => {
                    results[i] = Err(e.into());
                    tables.push((Owner::NONE, Vec::new()));
                }
            }
        }
        let be = &*self.backend;
        s.x.resize(total * dim, 0.0);
        for (row, &tok) in seqs.iter().flat_map(|q| q.tokens).enumerate() {
            let (x, embd) = (&mut s.x, self);
            embd.embed(be, tok.min(c.vocab as u32 - 1), &mut x[row * dim..(row + 1) * dim]);
        }
        let rope = be.rope_table(&self.rope, &positions);
        s.acts.set_needs(self.act_needs);
        let shape = c.attn_shape(pool.shape().page_size);
        s.xn.resize(total * dim, 0.0);
        s.qkv.resize(total * qkv_w, 0.0);
        s.q.resize(total * dim, 0.0);
        s.attn.resize(total * dim, 0.0);
        s.proj.resize(total * dim, 0.0);
        s.gate_up.resize(total * 2 * ffn, 0.0);
        s.hidden.resize(total * ffn, 0.0);
        for (li, layer) in self.layers.iter().enumerate() {
            be.rms_norm(&s.x, &layer.attn_norm, c.norm_eps, &mut s.xn);
            be.quantize(&mut s.acts, &s.xn, dim);
            be.matmul(&layer.wqkv, &s.acts, &mut s.qkv);
            for r in 0..total {
                s.q[r * dim..(r + 1) * dim].copy_from_slice(&s.qkv[r * qkv_w..r * qkv_w + dim]);
            }
            be.rope(&rope, &mut s.q, dim, 0, dim);
            // K is rotated in place inside the stacked rows.
            be.rope(&rope, &mut s.qkv, qkv_w, dim, kvd);
            // Write each sequence's new K/V into its own pages (tag-checked).
            let mut row = 0;
            for (i, sq) in seqs.iter().enumerate() {
                let (owner, table) = &tables[i];
                for j in 0..sq.tokens.len() {
                    if results[i].is_ok() {
                        let base = (row + j) * qkv_w + dim;
                        let (k, v) = s.qkv[base..base + 2 * kvd].split_at(kvd);
                        if let Err(e) = pool.write(li, *owner, table, sq.pos0 + j, k, v) {
                            results[i] = Err(e.into());
                        }
                    }
                }
                row += sq.tokens.len();
            }
            let attn_seqs: Vec<AttnSeq<'_>> = seqs
                .iter()
                .zip(&tables)
                .map(|(sq, (owner, t))| AttnSeq {
                    owner: *owner,
                    pages: t,
                    pos0: sq.pos0,
                    n_new: sq.tokens.len(),
                })
                .collect();
            let r = be.attention(
                pool.layer(li),
                pool.tags(),
                &shape,
                &attn_seqs,
                &s.q,
                &mut s.attn,
                check,
            );
            for (i, ri) in r.into_iter().enumerate() {
                if let (Ok(()), Err(v)) = (&results[i], ri) {
                    pool.record_violation();
                    results[i] = Err(v.into());
                }
            }
            be.quantize(&mut s.acts, &s.attn, dim);
            be.matmul(&layer.wo, &s.acts, &mut s.proj);
            be.add_assign(&mut s.x, &s.proj);
            be.rms_norm(&s.x, &layer.ffn_norm, c.norm_eps, &mut s.xn);
            be.quantize(&mut s.acts, &s.xn, dim);
            be.matmul(&layer.w_gate_up, &s.acts, &mut s.gate_up);
            be.swiglu(&s.gate_up, ffn, &mut s.hidden);
            be.quantize(&mut s.acts, &s.hidden, ffn);
            be.matmul(&layer.w_down, &s.acts, &mut s.proj);
            be.add_assign(&mut s.x, &s.proj);
        }
        // Logits for the last token of each sequence that wants them and has not failed.
        let mut rows = Vec::new();
        let mut end = 0;
        for (i, sq) in seqs.iter().enumerate() {
            end += sq.tokens.len();
            if sq.want_logits && results[i].is_ok() && !sq.tokens.is_empty() {
                rows.push((i, end - 1));
            }
        }
        let mut logits_of: Vec<Option<Vec<f32>>> = vec![None; seqs.len()];
        if !rows.is_empty() {
            let mut last = vec![0f32; rows.len() * dim];
            for (k, &(_, r)) in rows.iter().enumerate() {
                last[k * dim..(k + 1) * dim].copy_from_slice(&s.x[r * dim..(r + 1) * dim]);
            }
            let mut normed = vec![0f32; last.len()];
            be.rms_norm(&last, &self.output_norm, c.norm_eps, &mut normed);
            be.quantize(&mut s.acts, &normed, dim);
            let mut logits = vec![0f32; rows.len() * c.vocab];
            be.matmul(&self.output, &s.acts, &mut logits);
            for (k, &(i, _)) in rows.iter().enumerate() {
                logits_of[i] = Some(logits[k * c.vocab..(k + 1) * c.vocab].to_vec());
            }
        }
        results.into_iter().zip(logits_of).map(|(r, l)| r.map(|()| l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::engine::request::{GenerateRequest, Outcome};
    use crate::engine::{Engine, EngineConfig, Event};
    use crate::gguf::writer::GgufWriter;
    use crate::testutil::{IdDetok, tenant};

    /// A llama of one block `dim` wide (2 heads, one KV head) with a feed-forward of `ffn`,
    /// weights drawn from `seed`: each matrix of the type `ty` names for it (norms are F32), or,
    /// with `dequantized`, the same values written as F32. `extra` adds keys or tensors.
    fn llama_of(
        dim: u64,
        ffn: u64,
        seed: u64,
        ty: &dyn Fn(&str) -> GgmlType,
        dequantized: bool,
        extra: impl FnOnce(GgufWriter) -> GgufWriter,
    ) -> Result<Model, ModelError> {
        let (kvd, vocab) = (dim / 2, 32u64);
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 40
        };
        let mut w = GgufWriter::default()
            .kv("general.architecture", Value::String("llama".into()))
            .kv("llama.block_count", Value::U32(1))
            .kv("llama.context_length", Value::U32(64))
            .kv("llama.embedding_length", Value::U32(dim as u32))
            .kv("llama.feed_forward_length", Value::U32(ffn as u32))
            .kv("llama.attention.head_count", Value::U32(2))
            .kv("llama.attention.head_count_kv", Value::U32(1));
        let shapes: [(&str, Vec<u64>); 12] = [
            ("token_embd.weight", vec![dim, vocab]),
            ("output_norm.weight", vec![dim]),
            ("blk.0.attn_norm.weight", vec![dim]),
            ("blk.0.attn_q.weight", vec![dim, dim]),
            ("blk.0.attn_k.weight", vec![dim, kvd]),
            ("blk.0.attn_v.weight", vec![dim, kvd]),
            ("blk.0.attn_output.weight", vec![dim, dim]),
            ("blk.0.ffn_norm.weight", vec![dim]),
            ("blk.0.ffn_gate.weight", vec![dim, ffn]),
            ("blk.0.ffn_up.weight", vec![dim, ffn]),
            ("blk.0.ffn_down.weight", vec![ffn, dim]),
            ("output.weight", vec![dim, vocab]),
        ];
        for (name, dims) in shapes {
            let n = dims.iter().product::<u64>() as usize;
            let t = if dims.len() == 1 { GgmlType::F32 } else { ty(name) };
            let mut data: Vec<u8> = if t == GgmlType::F32 {
                (0..n)
                    .flat_map(|_| ((next() % 2001) as f32 / 1000.0 - 1.0).to_le_bytes())
                    .collect()
            } else {
                (0..t.bytes_for(n as u64).expect("whole blocks"))
                    .map(|_| next() as u8)
                    .collect()
            };
            // Finite, modest f16 scales where each block keeps them.
            let scales: &[usize] = match t {
                GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
                GgmlType::Q6_K => &[208],
                GgmlType::Q5_0 => &[0],
                _ => &[],
            };
            if !scales.is_empty() {
                for block in data.chunks_exact_mut(t.block_bytes()) {
                    for &at in scales {
                        let v = half::f16::from_f32(((next() % 2001) as f32 / 1000.0 - 1.0) * 0.05);
                        block[at..at + 2].copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
            w = if dequantized && t != GgmlType::F32 {
                let mut f = vec![0f32; n];
                dequantize(t, &data, &mut f);
                w.tensor(name, &dims, 0, f.iter().flat_map(|v| v.to_le_bytes()).collect())
            } else {
                w.tensor(name, &dims, t.id(), data)
            };
        }
        let g = Gguf::from_bytes(extra(w).build())?;
        Model::from_gguf(&g)
    }

    fn llama(dim: u64, ffn: u64, seed: u64, extra: impl FnOnce(GgufWriter) -> GgufWriter) -> Result<Model, ModelError> {
        llama_of(dim, ffn, seed, &|_| GgmlType::F32, false, extra)
    }

    fn tiny(extra: impl FnOnce(GgufWriter) -> GgufWriter) -> Result<Model, ModelError> {
        llama(32, 64, 1, extra)
    }

    fn refusal(extra: impl FnOnce(GgufWriter) -> GgufWriter) -> String {
        match tiny(extra) {
            Ok(_) => panic!("a half-understood file loaded"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_file_is_understood_whole_or_refused_naming_what_is_not() {
        tiny(|w| w).expect("the plain llama loads");
        // Keys that restate what the loader does anyway.
        tiny(|w| {
            w.kv("llama.rope.scaling.type", Value::String("none".into()))
                .kv("llama.rope.scaling.factor", Value::F32(1.0))
                .kv("llama.attention.key_length", Value::U32(16))
                .kv("llama.expert_count", Value::U32(0))
        })
        .expect("neutral keys load");
        // A Llama 3.1 file's rope frequency factors are read (one per rotated pair of the heads
        // of 16), and refused when they cannot be.
        let ones: Vec<u8> = [1f32; 8].iter().flat_map(|f| f.to_le_bytes()).collect();
        tiny(|w| w.tensor("rope_freqs.weight", &[8], 0, ones)).expect("rope factors load");
        let e = refusal(|w| w.tensor("rope_freqs.weight", &[4], 0, vec![0; 16]));
        assert!(e.contains("\"rope_freqs.weight\"") && e.contains("expected 8"), "{e}");
        let e = refusal(|w| w.tensor("rope_freqs.weight", &[8], 0, vec![0; 32]));
        assert!(e.contains("factors are positive"), "{e}");
        // Tensors of other architectures: attention biases, q/k norms, a block past block_count.
        for t in [
            "blk.0.attn_q.bias",
            "blk.0.attn_q_norm.weight",
            "blk.1.attn_norm.weight",
        ] {
            let e = refusal(|w| w.tensor(t, &[32], 0, vec![0; 128]));
            assert!(
                e.contains(&format!("{t:?}")) && e.contains("not part of the llama"),
                "{e}"
            );
        }
        // Keys that change the computation.
        for (key, v) in [
            ("llama.rope.scaling.type", Value::String("llama3".into())),
            ("llama.rope.scaling.factor", Value::F32(8.0)),
            ("llama.attention.sliding_window", Value::U32(4096)),
            ("llama.attn_logit_softcapping", Value::F32(50.0)),
            ("llama.expert_count", Value::U32(8)),
            ("llama.attention.key_length", Value::U32(32)),
        ] {
            let e = refusal(|w| w.kv(key, v));
            assert!(
                e.contains(&format!("{key:?}")) && e.contains("changes the computation"),
                "{e}"
            );
        }
    }

    fn engine(model: Model) -> Engine {
        let model = Arc::new(model);
        let mut cfg = EngineConfig::for_model(&model);
        cfg.kv_memory_bytes = 1 << 20;
        cfg.step_target = None;
        Engine::new(model, Arc::new(IdDetok), cfg).expect("engine starts")
    }

    /// Greedy tokens (6 each) for `prompts` submitted together, checking every logprob is a number.
    fn run(e: &mut Engine, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
        let ids: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut r = GenerateRequest::greedy(tenant(1), p.clone(), 6);
                r.ignore_eos = true;
                r.logprobs = Some(2);
                e.submit(r.validate(&e.limits()).expect("valid")).expect("admitted")
            })
            .collect();
        let mut out = vec![Vec::new(); ids.len()];
        while e.has_work() {
            for ev in e.step() {
                match ev {
                    Event::Token {
                        id, token, logprobs, ..
                    } => {
                        let lp = logprobs.expect("asked for");
                        assert!(
                            lp.logprob.is_finite() && lp.top.iter().all(|(_, l)| l.is_finite()),
                            "logits are numbers: {lp:?}"
                        );
                        out[ids.iter().position(|&i| i == id).expect("ours")].push(token)
                    }
                    Event::Done { outcome, .. } => {
                        assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}")
                    }
                    _ => {}
                }
            }
        }
        out
    }

    /// Float rows of any length (llama.cpp runs them): a model 48 wide (heads of 24) with a
    /// feed-forward of 40 generates, and a prompt's logits do not depend on what else shares
    /// its step.
    #[test]
    fn float_weights_of_any_width_run() {
        let mut e = engine(llama(48, 40, 7, |w| w).expect("a 48-wide F32 llama loads"));
        let alone = run(&mut e, &[vec![5, 9, 11, 3]]);
        assert_eq!(alone[0].len(), 6);
        assert!(
            alone[0].iter().any(|&t| t != alone[0][0]),
            "not one token over and over: {alone:?}"
        );
        assert!(alone[0].iter().all(|&t| t < 32));
        let together = run(&mut e, &[vec![7, 8], vec![5, 9, 11, 3], vec![1; 20]]);
        assert_eq!(together[1], alone[0], "batched as alone");
    }

    /// A file mixing block types per tensor, as every `_K_M` file does (Q4_K, Q6_K for some
    /// matrices, a Q5_0 embedding), loads and computes exactly what the same values stored as
    /// F32 compute.
    #[test]
    fn a_file_mixing_k_quants_computes_what_its_values_do() {
        let mix = |name: &str| match name {
            "token_embd.weight" => GgmlType::Q5_0,
            "blk.0.attn_v.weight" | "blk.0.ffn_down.weight" | "output.weight" => GgmlType::Q6_K,
            _ => GgmlType::Q4_K,
        };
        let quantized = llama_of(256, 256, 3, &mix, false, |w| w).expect("a Q4_K_M-style file loads");
        let twin = llama_of(256, 256, 3, &mix, true, |w| w).expect("its F32 twin loads");
        let prompts = [vec![5, 9, 11, 3], vec![1; 12]];
        let (a, b) = (run(&mut engine(quantized), &prompts), run(&mut engine(twin), &prompts));
        assert_eq!(a, b);
        assert!(a[0].iter().any(|&t| t != a[0][0]), "not one token over and over: {a:?}");
    }

    /// Rope frequency factors (a Llama 3.1-style `rope_freqs.weight`) reach the rotation:
    /// factors of 1 change nothing, others change what the model computes.
    #[test]
    fn rope_frequency_factors_are_applied() {
        let factors = |f: f32| -> Vec<u8> { [f; 8].iter().flat_map(|f| f.to_le_bytes()).collect() };
        let prompts = [vec![5, 9, 11, 3, 7, 1, 12, 20]];
        let plain = run(&mut engine(tiny(|w| w).expect("loads")), &prompts);
        let ones = tiny(|w| w.tensor("rope_freqs.weight", &[8], 0, factors(1.0))).expect("loads");
        assert_eq!(run(&mut engine(ones), &prompts), plain);
        let scaled = tiny(|w| w.tensor("rope_freqs.weight", &[8], 0, factors(1e4))).expect("loads");
        let (mut a, mut b) = (engine(tiny(|w| w).expect("loads")), engine(scaled));
        let logits = |e: &mut Engine| -> Vec<f32> {
            let mut r = GenerateRequest::greedy(tenant(1), prompts[0].clone(), 1);
            r.logprobs = Some(5);
            e.submit(r.validate(&e.limits()).expect("valid")).expect("admitted");
            let mut top = Vec::new();
            while e.has_work() {
                for ev in e.step() {
                    if let Event::Token { logprobs: Some(lp), .. } = ev {
                        top = lp.top.iter().map(|&(_, l)| l).collect();
                    }
                }
            }
            top
        };
        assert_ne!(logits(&mut a), logits(&mut b), "the factors changed the rotation");
    }
}
