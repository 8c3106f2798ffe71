//! The [`Backend`] trait: the operations a llama forward pass needs, and the CPU implementation.
//!
//! The forward pass reaches compute only through this trait (its buffers are host slices; the
//! pass itself only moves rows between them), so that a second backend (CUDA through cudarc,
//! behind the `cuda` feature) slots in by implementing it. Every backend's attention checks page tags
//! exactly as [`crate::tag::check_pages`] does (invariant 2).

use crate::attention::{AttnKind, AttnSeq, AttnShape, KvLayer};
use crate::matmul::{QActs, QMatrix};
use crate::ops::{Rope, RopeTable};
use crate::quant::GgmlType;
use crate::tag::{IsolationViolation, PageTag, TagCheck};

/// Compute operations of a llama block.
pub trait Backend: Send + Sync {
    /// A short name for logs and benchmarks, e.g. `cpu-avx512vnni`.
    fn name(&self) -> String;
    /// Row `out` of a `ty` matrix whose row is `data` (an embedding lookup).
    fn dequantize_row(&self, ty: GgmlType, data: &[u8], out: &mut [f32]);
    /// Quantizes `x`, rows of `cols`, into `acts` for the matmuls that follow.
    fn quantize(&self, acts: &mut QActs, x: &[f32], cols: usize);
    /// As [`quantize`](Self::quantize), with 8-bit residuals as well: as good as 16-bit
    /// activations for the matmuls that read them, at twice their multiply-adds (see
    /// [`QActs::quantize_fine`]).
    fn quantize_fine(&self, acts: &mut QActs, x: &[f32], cols: usize);
    /// `out[t·rows + n] = Σ_k W[n][k] · x[t][k]`.
    fn matmul(&self, w: &QMatrix, x: &QActs, out: &mut [f32]);
    /// `x += y` (the residual stream).
    fn add_assign(&self, x: &mut [f32], y: &[f32]);
    /// `rope`'s rotations at `positions`, for [`rope`](Self::rope).
    fn rope_table(&self, rope: &Rope, positions: &[u32]) -> RopeTable;
    /// Row-wise RMSNorm with weight `w`.
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]);
    /// Rotary embedding of the heads in `offset..offset+width` of each row of `x` (rows `stride`
    /// apart), at the positions of `table`'s rows (see [`RopeTable::apply`]).
    fn rope(&self, table: &RopeTable, x: &mut [f32], stride: usize, offset: usize, width: usize);
    /// `silu(gate) · up` for rows of `[gate | up]`.
    fn swiglu(&self, gate_up: &[f32], width: usize, out: &mut [f32]);
    /// `gelu(gate) · up` for rows of `[gate | up]` (see [`crate::ops::geglu`]).
    fn geglu(&self, gate_up: &[f32], width: usize, out: &mut [f32]);
    /// Tag-checked causal paged attention (see [`crate::attention::paged_attention`]).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        kv: KvLayer<'_>,
        tags: &[PageTag],
        shape: &AttnShape,
        kind: &AttnKind,
        seqs: &[AttnSeq<'_>],
        q: &[f32],
        out: &mut [f32],
        check: TagCheck,
    ) -> Vec<Result<(), IsolationViolation>>;
}

/// The CPU backend: AVX-512 VNNI matmuls when the CPU has them, scalar code otherwise; work is
/// spread over the rayon pool.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        match crate::matmul::Kernel::best() {
            crate::matmul::Kernel::Avx512Vnni => "cpu-avx512vnni".into(),
            crate::matmul::Kernel::Avx2 => "cpu-avx2".into(),
            crate::matmul::Kernel::Scalar => "cpu-scalar".into(),
        }
    }

    fn dequantize_row(&self, ty: GgmlType, data: &[u8], out: &mut [f32]) {
        crate::quant::dequantize(ty, data, out)
    }

    fn quantize(&self, acts: &mut QActs, x: &[f32], cols: usize) {
        acts.quantize(x, cols)
    }

    fn quantize_fine(&self, acts: &mut QActs, x: &[f32], cols: usize) {
        acts.quantize_fine(x, cols)
    }

    fn matmul(&self, w: &QMatrix, x: &QActs, out: &mut [f32]) {
        w.matmul(x, out)
    }

    fn add_assign(&self, x: &mut [f32], y: &[f32]) {
        crate::ops::add_assign(x, y)
    }

    fn rope_table(&self, rope: &Rope, positions: &[u32]) -> RopeTable {
        rope.table(positions)
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        crate::ops::rms_norm(x, w, eps, out)
    }

    fn rope(&self, table: &RopeTable, x: &mut [f32], stride: usize, offset: usize, width: usize) {
        table.apply(x, stride, offset, width)
    }

    fn swiglu(&self, gate_up: &[f32], width: usize, out: &mut [f32]) {
        crate::ops::swiglu(gate_up, width, out)
    }

    fn geglu(&self, gate_up: &[f32], width: usize, out: &mut [f32]) {
        crate::ops::geglu(gate_up, width, out)
    }

    fn attention(
        &self,
        kv: KvLayer<'_>,
        tags: &[PageTag],
        shape: &AttnShape,
        kind: &AttnKind,
        seqs: &[AttnSeq<'_>],
        q: &[f32],
        out: &mut [f32],
        check: TagCheck,
    ) -> Vec<Result<(), IsolationViolation>> {
        crate::attention::paged_attention(kv, tags, shape, kind, seqs, q, out, check)
    }
}
