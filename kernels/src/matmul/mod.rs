//! Quantized matrix multiplication: `out[t][n] = Σ_k W[n][k] · x[t][k]`.
//!
//! Weights are repacked once at load time into [`QMatrix`]: rows are grouped in tiles of
//! [`ROW_TILE`] (16), and within a tile each block is stored so that one 512-bit load holds four
//! consecutive elements of all 16 rows. Activations are quantized to 8 bits ([`QActs`]), so each
//! block's dot product is an integer sum that AVX-512 VNNI computes with `vpdpbusd` for 16 rows
//! at a time, with no horizontal reductions. The formats (one module each):
//!
//! * [`block`]: 32-element blocks against per-32 activations (llama.cpp's Q8_1): Q4_0, Q4_1,
//!   Q5_0 and Q5_1 as nibbles (and fifth bits), Q8_0 as bytes, each in its file's bits per
//!   value, each computed with llama.cpp's formula.
//! * [`kquant`]: the K-quants' 256-element super-blocks against per-256 activations (llama.cpp's
//!   Q8_K): integer sums per sub-block, times the sub-block's integer scale, summed over the
//!   super-block before one float multiply, as llama.cpp computes them.
//! * [`float`]: F32/F16/BF16 weights in the file's width, against the unquantized inputs.
//!
//! A matrix may stack parts of different types (a `_K_M` file's Q, K and V projections often
//! differ): each run of parts of one format is a segment with its own packing.
//!
//! [`QMatrix::matmul`] picks the AVX-512 VNNI kernel at run time when the CPU has it, else AVX2,
//! else the scalar kernel, which reads the same layout and is the reference the SIMD paths are
//! tested against. Work is split over row tiles across the rayon pool.

use rayon::prelude::*;

use crate::quant::{GgmlType, QK};

/// Calls `$f::<NT>` (after any other constants given in brackets) with the token count as a
/// constant, so the kernels' per-token accumulators are fixed-size arrays the compiler keeps in
/// registers (a runtime count leaves them in memory, one store and reload per block).
#[cfg(target_arch = "x86_64")]
macro_rules! by_tokens {
    ($nt:expr, $f:ident[$($g:expr),*]($($arg:expr),*)) => {
        match $nt {
            1 => $f::<$($g,)* 1>($($arg),*),
            2 => $f::<$($g,)* 2>($($arg),*),
            3 => $f::<$($g,)* 3>($($arg),*),
            _ => $f::<$($g,)* TOKEN_TILE>($($arg),*),
        }
    };
    ($nt:expr, $f:ident($($arg:expr),*)) => {
        by_tokens!($nt, $f[]($($arg),*))
    };
}

mod acts;
mod block;
mod float;
mod kquant;
#[cfg(test)]
mod tests;

pub use acts::{ActNeeds, QActs};

/// Rows per tile of a repacked matrix.
pub const ROW_TILE: usize = 16;

/// Tokens processed together against one loaded weight tile.
const TOKEN_TILE: usize = 4;

/// One tile's output: `ROW_TILE` rows for each of up to `TOKEN_TILE` tokens.
type TileOut = [f32; ROW_TILE * TOKEN_TILE];

/// 64-byte aligned storage, so tile loads never split cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

#[derive(Clone, Default)]
struct AlignedBytes {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBytes {
    fn zeroed(len: usize) -> Self {
        Self {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `Line` is `repr(C)` plain bytes with no padding, so the lines are `len`
        // (≤ 64 · lines.len()) initialised, contiguous bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and the borrow of `self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// How a run of rows is packed.
#[derive(Clone)]
enum Packed {
    /// 32-element blocks of 4- or 5-bit values (Q4_0, Q4_1, Q5_0, Q5_1).
    Nibble(block::NibbleFormat, AlignedBytes),
    /// 32-element blocks of signed bytes (Q8_0).
    Q8(AlignedBytes),
    /// K-quant super-blocks.
    K(kquant::Format, AlignedBytes),
    /// Float weights in the file's width.
    Float(float::FloatFormat, AlignedBytes),
}

/// Which packing a type's rows take; parts of one kind share a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Nibble(GgmlType),
    Q8,
    K(GgmlType),
    Float(GgmlType),
}

impl Kind {
    fn of(ty: GgmlType) -> Kind {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => Kind::Nibble(ty),
            GgmlType::Q8_0 => Kind::Q8,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => Kind::K(ty),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Kind::Float(ty),
        }
    }
}

/// A run of stacked rows packed one way.
#[derive(Clone)]
struct Segment {
    /// First row of the matrix it holds.
    row0: usize,
    rows: usize,
    packed: Packed,
}

impl Segment {
    fn tiles(&self) -> usize {
        self.rows.div_ceil(ROW_TILE)
    }

    fn needs(&self) -> ActNeeds {
        let mut n = ActNeeds::NONE;
        match self.packed {
            Packed::Nibble(..) | Packed::Q8(_) => n.blocks = true,
            Packed::K(..) => n.superblocks = true,
            Packed::Float(..) => n.inputs = true,
        }
        n
    }

    /// One row tile of this segment against tokens `tok..tok + nt` of `x`.
    #[allow(clippy::too_many_arguments)]
    fn tile(&self, cols: usize, tile: usize, x: &QActs, tok: usize, nt: usize, kernel: Kernel, out: &mut TileOut) {
        let nb = cols / QK;
        match (&self.packed, kernel) {
            (Packed::Nibble(f, b), Kernel::Avx512Vnni) => {
                // SAFETY: `Kernel::Avx512Vnni` is only constructed after runtime detection of
                // avx512f, avx512bw and avx512vnni (see `Kernel::best`).
                unsafe { block::avx512::nibble_tile(*f, b.as_slice(), tile, nb, x, tok, nt, out) }
            }
            (Packed::Nibble(f, b), Kernel::Avx2) => {
                // SAFETY: `Kernel::Avx2` is only constructed after runtime detection of avx2, fma
                // and f16c (see `Kernel::best`).
                unsafe { block::avx2::nibble_tile(*f, b.as_slice(), tile, nb, x, tok, nt, out) }
            }
            (Packed::Nibble(f, b), Kernel::Scalar) => {
                block::scalar_nibble_tile(*f, b.as_slice(), tile, nb, x, tok, nt, out)
            }
            (Packed::Q8(b), Kernel::Avx512Vnni) => {
                // SAFETY: as above.
                unsafe { block::avx512::q8_tile(b.as_slice(), tile, nb, x, tok, nt, out) }
            }
            (Packed::Q8(b), Kernel::Avx2) => {
                // SAFETY: as above.
                unsafe { block::avx2::q8_tile(b.as_slice(), tile, nb, x, tok, nt, out) }
            }
            (Packed::Q8(b), Kernel::Scalar) => block::scalar_q8_tile(b.as_slice(), tile, nb, x, tok, nt, out),
            (Packed::K(f, b), Kernel::Avx512Vnni) => {
                // SAFETY: as above.
                unsafe { kquant::avx512::tile(*f, b.as_slice(), tile, cols, x, tok, nt, out) }
            }
            (Packed::K(f, b), Kernel::Avx2) => {
                // SAFETY: as above.
                unsafe { kquant::avx2::tile(*f, b.as_slice(), tile, cols, x, tok, nt, out) }
            }
            (Packed::K(f, b), Kernel::Scalar) => kquant::scalar_tile(*f, b.as_slice(), tile, cols, x, tok, nt, out),
            (Packed::Float(f, b), _) => float_tile(*f, b.as_slice(), cols, tile, x, tok, nt, kernel, out),
        }
    }
}

/// One float row tile (of bytes `p` in format `f`) against tokens `tok..tok + nt`.
#[allow(clippy::too_many_arguments)]
fn float_tile(
    f: float::FloatFormat,
    p: &[u8],
    cols: usize,
    tile: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    kernel: Kernel,
    out: &mut TileOut,
) {
    match kernel {
        // SAFETY: `Kernel::Avx512Vnni` is only constructed after runtime detection of avx512f,
        // avx512bw and avx512vnni (see `Kernel::best`).
        Kernel::Avx512Vnni => unsafe { float::avx512::tile(f, p, tile, cols, x, tok, nt, out) },
        // SAFETY: `Kernel::Avx2` is only constructed after runtime detection of avx2, fma and
        // f16c (see `Kernel::best`).
        Kernel::Avx2 => unsafe { float::avx2::tile(f, p, tile, cols, x, tok, nt, out) },
        Kernel::Scalar => float::scalar_tile(f, p, tile, cols, x, tok, nt, out),
    }
}

/// Tokens from which a 16-bit float tile is widened to f32 once ([`float::widen_tile`]) rather
/// than converted again for every [`TOKEN_TILE`] tokens (widening costs about one pass of the
/// conversions). The kernel is bound by its multiply-adds, so what this saves is small: on
/// `matmul_bench` it stayed within a noisy machine's spread.
const WIDEN_FROM_TOKENS: usize = 3 * TOKEN_TILE;

/// A weight matrix of `rows × cols`, repacked for the matmul kernels.
#[derive(Clone)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    segments: Vec<Segment>,
    /// The first row that reads the residual half of fine activations (see
    /// [`with_fine_rows`](Self::with_fine_rows)); 0: every row.
    fine_from: usize,
}

/// Errors building a [`QMatrix`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MatrixError {
    /// The column count is zero, or not a whole number of the blocks of a quantized part (32
    /// elements, 256 for the K-quants).
    #[error("matrix row length {cols} is not a positive multiple of {block}, as {ty} rows need")]
    BadCols {
        /// Columns given.
        cols: usize,
        /// The type whose blocks it must be made of.
        ty: GgmlType,
        /// That type's block.
        block: usize,
    },
    /// The byte slice is not the size the type and shape need.
    #[error("matrix {rows}x{cols} of {ty} needs {need} bytes, got {got}")]
    BadSize {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Type.
        ty: GgmlType,
        /// Bytes needed.
        need: usize,
        /// Bytes given.
        got: usize,
    },
}

impl QMatrix {
    /// Repacks `rows` rows of `cols` elements of type `ty` (ggml layout: row-major, `cols` is the
    /// row length) from `data`.
    pub fn from_ggml(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<Self, MatrixError> {
        Self::concat(&[(ty, rows, data)], cols)
    }

    /// Repacks several matrices with the same row length into one, their rows stacked in order
    /// (e.g. Q, K and V projections), so one call computes all of them. The parts may be of
    /// different types.
    pub fn concat(parts: &[(GgmlType, usize, &[u8])], cols: usize) -> Result<Self, MatrixError> {
        for &(ty, rows, data) in parts {
            // Float rows may have any length; block-quantized rows are whole blocks.
            if cols == 0 || !cols.is_multiple_of(ty.block_elems()) {
                return Err(MatrixError::BadCols {
                    cols,
                    ty,
                    block: ty.block_elems(),
                });
            }
            let need = ty.bytes_for((rows * cols) as u64).unwrap_or(u64::MAX) as usize;
            if data.len() != need {
                return Err(MatrixError::BadSize {
                    rows,
                    cols,
                    ty,
                    need,
                    got: data.len(),
                });
            }
        }
        let mut segments = Vec::new();
        let mut row0 = 0;
        for run in parts.chunk_by(|a, b| Kind::of(a.0) == Kind::of(b.0)) {
            let rows: usize = run.iter().map(|p| p.1).sum();
            // Row `r` of the run, as (type, bytes of that row).
            let row_of = |mut r: usize| -> (GgmlType, &[u8]) {
                for &(ty, n, data) in run {
                    if r < n {
                        let rb = ty.bytes_for(cols as u64).unwrap_or(0) as usize;
                        return (ty, &data[r * rb..(r + 1) * rb]);
                    }
                    r -= n;
                }
                unreachable!("row index within the run's row count")
            };
            let packed = match Kind::of(run[0].0) {
                Kind::Nibble(ty) => {
                    let f = block::NibbleFormat::of(ty).expect("a nibble type");
                    Packed::Nibble(f, block::pack_nibbles(f, rows, cols, row_of))
                }
                Kind::Q8 => Packed::Q8(block::pack_q8(rows, cols, row_of)),
                Kind::K(ty) => {
                    let f = kquant::Format::of(ty);
                    Packed::K(f, kquant::pack(f, rows, cols, row_of))
                }
                Kind::Float(ty) => {
                    let f = float::FloatFormat::of(ty).expect("a float type");
                    Packed::Float(f, float::pack(f, rows, cols, row_of))
                }
            };
            segments.push(Segment { row0, rows, packed });
            row0 += rows;
        }
        Ok(Self {
            rows: row0,
            cols,
            segments,
            fine_from: 0,
        })
    }

    /// Makes only rows `from..` (whole row tiles, so from the start of the tile holding `from`)
    /// read the residual half of fine activations ([`QActs::quantize_fine`]): the rows before
    /// get 8-bit inputs and cost no more than with plain activations. A stacked Q/K/V matrix
    /// gives V its fine inputs this way, where they matter most for the cost.
    pub fn with_fine_rows(mut self, from: usize) -> Self {
        self.fine_from = from.min(self.rows);
        self
    }

    /// The first row whose tile reads the residual half: the start of the tile holding
    /// `fine_from` (the matrix's row count when no row does).
    fn fine_start(&self) -> usize {
        self.segments
            .iter()
            .find(|seg| self.fine_from < seg.row0 + seg.rows)
            .map(|seg| seg.row0 + (self.fine_from - seg.row0) / ROW_TILE * ROW_TILE)
            .unwrap_or(self.rows)
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The forms of the activations this matrix reads ([`QActs::set_needs`]).
    pub fn needs(&self) -> ActNeeds {
        self.segments.iter().fold(ActNeeds::NONE, |n, s| n | s.needs())
    }

    /// Bytes of weight storage.
    pub fn storage_bytes(&self) -> usize {
        self.segments
            .iter()
            .map(|s| match &s.packed {
                Packed::Nibble(_, b) | Packed::Q8(b) | Packed::K(_, b) | Packed::Float(_, b) => b.len,
            })
            .sum()
    }

    /// `out[t·rows + n] = Σ_k W[n][k] · x[t][k]` for every token `t` of `x`.
    ///
    /// # Panics
    /// If `x.cols() != self.cols()`, `out.len() != x.tokens() * self.rows()`, or `x` lacks a
    /// form this matrix needs.
    pub fn matmul(&self, x: &QActs, out: &mut [f32]) {
        self.matmul_with(x, out, Kernel::best())
    }

    /// As [`matmul`](Self::matmul) with an explicit kernel choice (tests and benches).
    pub fn matmul_with(&self, x: &QActs, out: &mut [f32], kernel: Kernel) {
        if !x.fine {
            return self.matmul_rows(x, out, kernel, self.rows);
        }
        // The first half's products plus the residuals' (see `QActs::quantize_fine`), in a
        // buffer this thread keeps (every element is written before it is read). It is taken
        // out while in use: a worker waiting inside this matmul may run another step's (another
        // model's engine shares the pool), which then finds none and makes its own.
        thread_local! {
            static BOTH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
        }
        assert_eq!(out.len(), x.tokens() * self.rows, "output size");
        let mut both = BOTH.take();
        both.resize(2 * out.len(), 0.0);
        let from = self.fine_start();
        self.matmul_rows(x, &mut both, kernel, from);
        let (coarse, residual) = both.split_at(out.len());
        for ((o, c), r) in out
            .chunks_exact_mut(self.rows)
            .zip(coarse.chunks_exact(self.rows))
            .zip(residual.chunks_exact(self.rows))
        {
            o[..from].copy_from_slice(&c[..from]);
            for ((o, &c), &r) in o[from..].iter_mut().zip(&c[from..]).zip(&r[from..]) {
                *o = c + r;
            }
        }
        BOTH.set(both);
    }

    /// One output row per row of `x` (both halves of fine activations), but for tiles before
    /// row `fine_from`, which compute the first half only (rows `0..tokens/2`; the rest of
    /// their part of `out` is left as it was).
    fn matmul_rows(&self, x: &QActs, out: &mut [f32], kernel: Kernel, fine_from: usize) {
        x.check(self.cols, self.needs());
        assert_eq!(out.len(), x.tokens * self.rows, "output size");
        // Every (segment, tile) pair, in row order.
        let tiles: Vec<(usize, usize)> = self
            .segments
            .iter()
            .enumerate()
            .flat_map(|(s, seg)| (0..seg.tiles()).map(move |t| (s, t)))
            .collect();
        let out_ptr = SendPtr(out.as_mut_ptr());
        let rows = self.rows;
        // Chunks of tiles per task: enough tasks to balance, few enough to keep overhead low.
        let per_task = tiles.len().div_ceil(rayon::current_num_threads() * 4).max(1);
        let run = |chunk: &[(usize, usize)]| {
            thread_local! {
                /// A widened 16-bit float tile, taken out while in use (as `BOTH` in `matmul_with`).
                static WIDE: std::cell::Cell<AlignedBytes> = std::cell::Cell::default();
            }
            let mut wide = WIDE.take();
            let mut tile_out = [0f32; ROW_TILE * TOKEN_TILE];
            for &(s, tile) in chunk {
                let seg = &self.segments[s];
                let r0 = seg.row0 + tile * ROW_TILE;
                let nr = (seg.rows - tile * ROW_TILE).min(ROW_TILE);
                let tokens = if x.fine && r0 < fine_from {
                    x.tokens / 2
                } else {
                    x.tokens
                };
                let widened = match &seg.packed {
                    Packed::Float(f, b) if *f != float::FloatFormat::F32 && tokens >= WIDEN_FROM_TOKENS => {
                        float::widen_tile(*f, b.as_slice(), tile, self.cols, &mut wide);
                        true
                    }
                    _ => false,
                };
                let mut tok = 0;
                while tok < tokens {
                    let nt = (tokens - tok).min(TOKEN_TILE);
                    if widened {
                        let f32s = float::FloatFormat::F32;
                        float_tile(f32s, wide.as_slice(), self.cols, 0, x, tok, nt, kernel, &mut tile_out);
                    } else {
                        seg.tile(self.cols, tile, x, tok, nt, kernel, &mut tile_out);
                    }
                    for t in 0..nt {
                        // SAFETY: this task alone writes rows r0..r0+nr of every token; the
                        // ranges `(tok+t)·rows + r0 .. +nr` of distinct tiles are disjoint and in
                        // bounds (asserted `out.len() == tokens·rows` above; r0 + nr ≤ rows).
                        unsafe {
                            let dst = out_ptr.get().add((tok + t) * rows + r0);
                            std::ptr::copy_nonoverlapping(tile_out.as_ptr().add(t * ROW_TILE), dst, nr);
                        }
                    }
                    tok += nt;
                }
            }
            WIDE.set(wide);
        };
        if tiles.len() <= per_task {
            run(&tiles);
        } else {
            tiles.par_chunks(per_task).for_each(run);
        }
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to write disjoint ranges of one output slice from rayon tasks (see `matmul`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Which matmul implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable scalar code (the reference).
    Scalar,
    /// AVX2 with FMA and F16C: `vpmaddubsw` + `vpmaddwd` in place of `vpdpbusd`.
    Avx2,
    /// AVX-512 with VNNI `vpdpbusd`.
    Avx512Vnni,
}

impl Kernel {
    /// Every kernel this CPU supports, the reference first.
    pub fn available() -> Vec<Kernel> {
        let mut v = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                v.push(Kernel::Avx2);
            }
            if Kernel::best() == Kernel::Avx512Vnni {
                v.push(Kernel::Avx512Vnni);
            }
        }
        v
    }

    /// The fastest kernel this CPU supports.
    pub fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vnni")
            {
                return Kernel::Avx512Vnni;
            }
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }
}
