//! Quantized matrix multiplication: `out[t][n] = Σ_k W[n][k] · x[t][k]`.
//!
//! Weights are repacked once at load time into [`QMatrix`]: rows are grouped in tiles of
//! [`ROW_TILE`] (16), and within a tile each 32-element block is stored so that one 512-bit load
//! holds four consecutive elements of all 16 rows. Activations are quantized per 32-element block
//! to 8 bits ([`QActs`]), so each block's dot product is an integer sum that AVX-512 VNNI computes
//! with `vpdpbusd` for 16 rows at a time, with no horizontal reductions:
//!
//! * Q4_1 (and Q4_0, converted exactly at load): `d_w·d_x·Σ q_w q_x + m_w·(d_x Σ q_x)`.
//! * Q8_0: `d_w·d_x·Σ q_w q_x`, computed as `Σ (q_x+128) q_w − 128 Σ q_w` because `vpdpbusd` takes
//!   one unsigned operand.
//! * F32/F16/BF16 weights stay in f32 and use a plain float dot product with unquantized inputs.
//!
//! [`QMatrix::matmul`] picks the AVX-512 VNNI kernel at run time when the CPU has it and otherwise
//! runs the scalar kernel, which reads the same layout and is the reference the SIMD path is tested
//! against. Work is split over row tiles across the rayon pool.

use half::f16;
use rayon::prelude::*;

use crate::quant::{GgmlType, QK, dequantize};

/// Rows per tile of a repacked matrix.
pub const ROW_TILE: usize = 16;
const Q4_TILE_BLOCK_BYTES: usize = 256 + 32 + 32; // nibbles, d (f16), m (f16)
const Q8_TILE_BLOCK_BYTES: usize = 512 + 64 + 64; // weights, d (f32), correction (f32)

/// 64-byte aligned storage, so tile loads never split cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

#[derive(Clone)]
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

#[derive(Clone)]
enum Packed {
    Q4(AlignedBytes),
    Q8(AlignedBytes),
    F32(Vec<f32>),
}

/// A weight matrix of `rows × cols`, repacked for the matmul kernels.
#[derive(Clone)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    packed: Packed,
}

/// Errors building a [`QMatrix`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MatrixError {
    /// The column count is zero, or (for block-quantized rows) not a multiple of the 32-element
    /// block.
    #[error("matrix row length {cols} is not a positive multiple of {QK}, as quantized rows need")]
    BadCols {
        /// Columns given.
        cols: usize,
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
    /// (e.g. Q, K and V projections), so one call computes all of them.
    pub fn concat(parts: &[(GgmlType, usize, &[u8])], cols: usize) -> Result<Self, MatrixError> {
        // Float rows may have any length; block-quantized rows are whole blocks.
        let blocked = parts.iter().any(|p| p.0.block_elems() > 1);
        if cols == 0 || (blocked && !cols.is_multiple_of(QK)) {
            return Err(MatrixError::BadCols { cols });
        }
        for &(ty, rows, data) in parts {
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
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let all_q4 = parts.iter().all(|p| matches!(p.0, GgmlType::Q4_0 | GgmlType::Q4_1));
        let all_q8 = parts.iter().all(|p| p.0 == GgmlType::Q8_0);
        // Row `r` of the stacked matrix, as (type, bytes of that row).
        let row_of = |mut r: usize| -> (GgmlType, &[u8]) {
            for &(ty, n, data) in parts {
                if r < n {
                    let rb = ty.bytes_for(cols as u64).unwrap_or(0) as usize;
                    return (ty, &data[r * rb..(r + 1) * rb]);
                }
                r -= n;
            }
            unreachable!("row index within the stacked row count")
        };
        let packed = if all_q4 {
            Packed::Q4(pack_q4(rows, cols, row_of))
        } else if all_q8 {
            Packed::Q8(pack_q8(rows, cols, row_of))
        } else {
            let mut w = vec![0f32; rows * cols];
            for (r, out) in w.chunks_exact_mut(cols).enumerate() {
                let (ty, bytes) = row_of(r);
                dequantize(ty, bytes, out);
            }
            Packed::F32(w)
        };
        Ok(Self { rows, cols, packed })
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether this matrix multiplies the f32 inputs (float weights) rather than the quantized
    /// ones: [`QActs`] must then keep its inputs.
    pub fn needs_inputs(&self) -> bool {
        matches!(self.packed, Packed::F32(_))
    }

    /// Bytes of weight storage.
    pub fn storage_bytes(&self) -> usize {
        match &self.packed {
            Packed::Q4(b) | Packed::Q8(b) => b.len,
            Packed::F32(w) => w.len() * 4,
        }
    }

    /// `out[t·rows + n] = Σ_k W[n][k] · x[t][k]` for every token `t` of `x`.
    ///
    /// # Panics
    /// If `x.cols() != self.cols()` or `out.len() != x.tokens() * self.rows()`.
    pub fn matmul(&self, x: &QActs, out: &mut [f32]) {
        self.matmul_with(x, out, Kernel::best())
    }

    /// As [`matmul`](Self::matmul) with an explicit kernel choice (tests and benches).
    pub fn matmul_with(&self, x: &QActs, out: &mut [f32], kernel: Kernel) {
        assert_eq!(x.cols, self.cols, "activation width");
        assert_eq!(out.len(), x.tokens * self.rows, "output size");
        assert!(
            !self.needs_inputs() || x.x.len() == x.tokens * x.cols,
            "a float matrix needs activations that kept their inputs (QActs::drop_inputs(false))"
        );
        let tiles = self.rows.div_ceil(ROW_TILE);
        let nb = self.cols / QK;
        let out_ptr = SendPtr(out.as_mut_ptr());
        let rows = self.rows;
        // Chunks of tiles per task: enough tasks to balance, few enough to keep overhead low.
        let per_task = tiles.div_ceil(rayon::current_num_threads() * 4).max(1);
        let n_tasks = tiles.div_ceil(per_task);
        let run = |task: usize| {
            let t0 = task * per_task;
            let t1 = (t0 + per_task).min(tiles);
            let mut tile_out = [0f32; ROW_TILE * TOKEN_TILE];
            for tile in t0..t1 {
                let mut tok = 0;
                while tok < x.tokens {
                    let nt = (x.tokens - tok).min(TOKEN_TILE);
                    match (&self.packed, kernel) {
                        (Packed::Q4(b), Kernel::Avx512Vnni) => {
                            // SAFETY: `Kernel::Avx512Vnni` is only constructed after runtime
                            // detection of avx512f, avx512bw and avx512vnni (see `Kernel::best`).
                            unsafe { avx512::q4_tile(b.as_slice(), tile, nb, x, tok, nt, &mut tile_out) }
                        }
                        (Packed::Q4(b), Kernel::Avx2) => {
                            // SAFETY: `Kernel::Avx2` is only constructed after runtime detection of
                            // avx2, fma and f16c (see `Kernel::best`).
                            unsafe { avx2::q4_tile(b.as_slice(), tile, nb, x, tok, nt, &mut tile_out) }
                        }
                        (Packed::Q4(b), Kernel::Scalar) => {
                            scalar_q4_tile(b.as_slice(), tile, nb, x, tok, nt, &mut tile_out)
                        }
                        (Packed::Q8(b), Kernel::Avx512Vnni) => {
                            // SAFETY: as above.
                            unsafe { avx512::q8_tile(b.as_slice(), tile, nb, x, tok, nt, &mut tile_out) }
                        }
                        (Packed::Q8(b), Kernel::Avx2) => {
                            // SAFETY: as above.
                            unsafe { avx2::q8_tile(b.as_slice(), tile, nb, x, tok, nt, &mut tile_out) }
                        }
                        (Packed::Q8(b), Kernel::Scalar) => {
                            scalar_q8_tile(b.as_slice(), tile, nb, x, tok, nt, &mut tile_out)
                        }
                        (Packed::F32(w), _) => f32_tile(w, self.cols, rows, tile, x, tok, nt, &mut tile_out),
                    }
                    let r0 = tile * ROW_TILE;
                    let nr = (rows - r0).min(ROW_TILE);
                    for t in 0..nt {
                        // SAFETY: this task alone writes rows r0..r0+nr of every token; the ranges
                        // `(tok+t)·rows + r0 .. +nr` of distinct tiles are disjoint and in bounds
                        // (asserted `out.len() == tokens·rows` above).
                        unsafe {
                            let dst = out_ptr.get().add((tok + t) * rows + r0);
                            std::ptr::copy_nonoverlapping(tile_out.as_ptr().add(t * ROW_TILE), dst, nr);
                        }
                    }
                    tok += nt;
                }
            }
        };
        if n_tasks == 1 {
            run(0);
        } else {
            (0..n_tasks).into_par_iter().for_each(run);
        }
    }
}

/// Tokens processed together against one loaded weight tile.
const TOKEN_TILE: usize = 4;

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

fn pack_q4<'a>(rows: usize, cols: usize, row_of: impl Fn(usize) -> (GgmlType, &'a [u8])) -> AlignedBytes {
    let nb = cols / QK;
    let tiles = rows.div_ceil(ROW_TILE);
    let mut buf = AlignedBytes::zeroed(tiles * nb * Q4_TILE_BLOCK_BYTES);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (ty, bytes) = row_of(r);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        let bb = ty.block_bytes();
        for b in 0..nb {
            let blk = &bytes[b * bb..(b + 1) * bb];
            let (d, m, qs) = match ty {
                GgmlType::Q4_1 => {
                    let d = f16::from_le_bytes([blk[0], blk[1]]);
                    let m = f16::from_le_bytes([blk[2], blk[3]]);
                    (d, m, &blk[4..20])
                }
                // Q4_0 is `d·(q−8)` = `d·q + (−8d)`: a Q4_1 block with minimum −8d, exactly
                // (scaling an f16 by a power of two is exact short of overflow).
                _ => {
                    let d = f16::from_le_bytes([blk[0], blk[1]]);
                    (d, f16::from_f32(-8.0 * d.to_f32()), &blk[2..18])
                }
            };
            let base = (tile * nb + b) * Q4_TILE_BLOCK_BYTES;
            for g in 0..4 {
                let at = base + g * 64 + lane * 4;
                out[at..at + 4].copy_from_slice(&qs[g * 4..g * 4 + 4]);
            }
            out[base + 256 + lane * 2..][..2].copy_from_slice(&d.to_le_bytes());
            out[base + 288 + lane * 2..][..2].copy_from_slice(&m.to_le_bytes());
        }
    }
    buf
}

fn pack_q8<'a>(rows: usize, cols: usize, row_of: impl Fn(usize) -> (GgmlType, &'a [u8])) -> AlignedBytes {
    let nb = cols / QK;
    let tiles = rows.div_ceil(ROW_TILE);
    let mut buf = AlignedBytes::zeroed(tiles * nb * Q8_TILE_BLOCK_BYTES);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (_, bytes) = row_of(r);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        for b in 0..nb {
            let blk = &bytes[b * 34..(b + 1) * 34];
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let qs = &blk[2..34];
            let sum: i32 = qs.iter().map(|&q| q as i8 as i32).sum();
            let base = (tile * nb + b) * Q8_TILE_BLOCK_BYTES;
            for g in 0..8 {
                let at = base + g * 64 + lane * 4;
                out[at..at + 4].copy_from_slice(&qs[g * 4..g * 4 + 4]);
            }
            out[base + 512 + lane * 4..][..4].copy_from_slice(&d.to_le_bytes());
            out[base + 576 + lane * 4..][..4].copy_from_slice(&(-128.0 * d * sum as f32).to_le_bytes());
        }
    }
    buf
}

/// Activations quantized per 32-element block to signed 8 bits, with the f32 originals kept for
/// float-weight matrices (unless [`drop_inputs`](Self::drop_inputs) says none will need them).
#[derive(Debug, Clone, Default)]
pub struct QActs {
    tokens: usize,
    cols: usize,
    /// Block scales, `tokens × cols/32`.
    d: Vec<f32>,
    /// `d · Σ q` per block.
    s: Vec<f32>,
    /// Quantized values, `tokens × cols`.
    q: Vec<i8>,
    /// The inputs, `tokens × cols`, unless `drop_inputs`.
    x: Vec<f32>,
    drop_inputs: bool,
}

impl QActs {
    /// An empty buffer; [`quantize`](Self::quantize) fills it, reusing its allocations.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether to skip keeping a copy of the f32 inputs: right when every matrix these
    /// activations meet is quantized (see [`QMatrix::needs_inputs`]); a float matrix then panics.
    pub fn drop_inputs(&mut self, drop: bool) {
        self.drop_inputs = drop;
        if drop {
            self.x = Vec::new();
        }
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Quantizes `x` (`tokens × cols`, row-major) as llama.cpp's Q8_1: `d = max|x|/127`,
    /// `q = round(x/d)`. Rows are split over the rayon pool when there are many. Rows that are
    /// not whole blocks (`cols` not a multiple of 32) only float matrices can meet: they are
    /// kept as they are, not quantized.
    ///
    /// # Panics
    /// If `cols` is 0 or `x.len()` is not a multiple of `cols`, or if rows that are not whole
    /// blocks come with [`drop_inputs`](Self::drop_inputs) set.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.quantize_with(x, cols, true)
    }

    fn quantize_with(&mut self, x: &[f32], cols: usize, simd: bool) {
        assert!(cols > 0 && x.len().is_multiple_of(cols), "activation shape");
        self.tokens = x.len() / cols;
        self.cols = cols;
        if !cols.is_multiple_of(QK) {
            assert!(
                !self.drop_inputs,
                "rows of {cols} meet only float matrices, which need the inputs"
            );
            self.d.clear();
            self.s.clear();
            self.q.clear();
            self.x.clear();
            self.x.extend_from_slice(x);
            return;
        }
        let nblocks = x.len() / QK;
        self.d.resize(nblocks, 0.0);
        self.s.resize(nblocks, 0.0);
        self.q.resize(x.len(), 0);
        self.x.clear();
        if !self.drop_inputs {
            self.x.extend_from_slice(x);
        }
        /// Fewest rows worth a parallel task.
        const MIN_ROWS: usize = 32;
        let per = self.tokens.div_ceil(2 * rayon::current_num_threads()).max(MIN_ROWS);
        let bpr = cols / QK;
        let run = |(((x, q), d), s): BlockChunk<'_>| {
            #[cfg(target_arch = "x86_64")]
            if simd && crate::ops::has_avx2() {
                // SAFETY: avx2 was detected at run time; the chunks hold the same blocks.
                unsafe { quantize_blocks_avx2(x, q, d, s) };
                return;
            }
            quantize_blocks(x, q, d, s);
        };
        if self.tokens < 2 * MIN_ROWS {
            run((((x, &mut self.q[..]), &mut self.d[..]), &mut self.s[..]));
        } else {
            x.par_chunks(per * cols)
                .zip(self.q.par_chunks_mut(per * cols))
                .zip(self.d.par_chunks_mut(per * bpr))
                .zip(self.s.par_chunks_mut(per * bpr))
                .for_each(run);
        }
    }
}

/// One chunk of rows to quantize: inputs, and their quantized values, scales and scaled sums.
type BlockChunk<'a> = (((&'a [f32], &'a mut [i8]), &'a mut [f32]), &'a mut [f32]);

/// Quantizes the blocks of `x` into `q` with scales `d` and scaled sums `s`.
fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        let mut sum = 0i32;
        for (qi, &v) in q[b * QK..(b + 1) * QK].iter_mut().zip(xs) {
            let r = (v * id).round() as i32;
            *qi = r as i8;
            sum += r;
        }
        // llama.cpp stores both as f16; so do we, to compute what it computes.
        d[b] = f16::from_f32(db).to_f32();
        s[b] = f16::from_f32(db * sum as f32).to_f32();
    }
}

/// [`quantize_blocks`] with AVX2. Rounds half to even where the scalar loop rounds half away
/// from zero, as llama.cpp's own AVX2 quantizer does.
///
/// # Safety
/// The CPU must support avx2; `q` holds `x.len()` bytes, `d` and `s` one float per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(q.len() == x.len() && d.len() * QK == x.len() && s.len() == d.len());
    let sign = _mm256_set1_ps(-0.0);
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        // SAFETY (pointer accesses): `xs` is QK floats; `q` holds QK bytes per block.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(xs.as_ptr().add(8 * k)));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
            let db = amax / 127.0;
            let id = _mm256_set1_ps(if db > 0.0 { 1.0 / db } else { 0.0 });
            let i: [__m256i; 4] = std::array::from_fn(|k| _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id)));
            let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            let s4 = _mm_hadd_epi32(s4, s4);
            let total = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
            // Pack to bytes in order: packs interleave 128-bit lanes, a permute restores them.
            let w01 = _mm256_packs_epi32(i[0], i[1]);
            let w23 = _mm256_packs_epi32(i[2], i[3]);
            let bytes =
                _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr().add(b * QK).cast(), bytes);
            d[b] = f16::from_f32(db).to_f32();
            s[b] = f16::from_f32(db * total as f32).to_f32();
        }
    }
}

fn scalar_q4_tile(
    p: &[u8],
    tile: usize,
    nb: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    out: &mut [f32; ROW_TILE * TOKEN_TILE],
) {
    out.fill(0.0);
    for b in 0..nb {
        let base = (tile * nb + b) * Q4_TILE_BLOCK_BYTES;
        for lane in 0..ROW_TILE {
            let d = f16::from_le_bytes([p[base + 256 + lane * 2], p[base + 257 + lane * 2]]).to_f32();
            let m = f16::from_le_bytes([p[base + 288 + lane * 2], p[base + 289 + lane * 2]]).to_f32();
            for t in 0..nt {
                let xb = (tok + t) * nb + b;
                let xq = &x.q[xb * QK..(xb + 1) * QK];
                let mut isum = 0i32;
                for g in 0..4 {
                    for j in 0..4 {
                        let byte = p[base + g * 64 + lane * 4 + j];
                        isum += (byte & 0x0f) as i32 * xq[g * 4 + j] as i32;
                        isum += (byte >> 4) as i32 * xq[16 + g * 4 + j] as i32;
                    }
                }
                out[t * ROW_TILE + lane] += isum as f32 * (d * x.d[xb]) + m * x.s[xb];
            }
        }
    }
}

fn scalar_q8_tile(
    p: &[u8],
    tile: usize,
    nb: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    out: &mut [f32; ROW_TILE * TOKEN_TILE],
) {
    out.fill(0.0);
    for b in 0..nb {
        let base = (tile * nb + b) * Q8_TILE_BLOCK_BYTES;
        for lane in 0..ROW_TILE {
            let f = |at: usize| f32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]);
            let d = f(base + 512 + lane * 4);
            for t in 0..nt {
                let xb = (tok + t) * nb + b;
                let xq = &x.q[xb * QK..(xb + 1) * QK];
                let mut isum = 0i32;
                for g in 0..8 {
                    for j in 0..4 {
                        isum += (p[base + g * 64 + lane * 4 + j] as i8) as i32 * xq[g * 4 + j] as i32;
                    }
                }
                out[t * ROW_TILE + lane] += isum as f32 * (d * x.d[xb]);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn f32_tile(
    w: &[f32],
    cols: usize,
    rows: usize,
    tile: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    out: &mut [f32; ROW_TILE * TOKEN_TILE],
) {
    out.fill(0.0);
    for lane in 0..ROW_TILE {
        let r = tile * ROW_TILE + lane;
        if r >= rows {
            break;
        }
        let wr = &w[r * cols..(r + 1) * cols];
        for t in 0..nt {
            let xr = &x.x[(tok + t) * cols..(tok + t + 1) * cols];
            out[t * ROW_TILE + lane] = crate::ops::dot(wr, xr);
        }
    }
}

/// Calls `$f::<NT>` with the token count as a constant, so the kernels' per-token accumulators
/// are fixed-size arrays the compiler keeps in registers (a runtime count leaves them in memory,
/// one store and reload per block).
#[cfg(target_arch = "x86_64")]
macro_rules! by_tokens {
    ($nt:expr, $f:ident($($arg:expr),*)) => {
        match $nt {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            _ => $f::<TOKEN_TILE>($($arg),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
// Token indices also address activation blocks and output rows, not just `acc`.
#[allow(clippy::needless_range_loop)]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// One Q4 row tile against up to four tokens.
    ///
    /// # Safety
    /// The CPU must support avx512f, avx512bw and avx512vnni; `p` must hold the packed tile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn q4_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        assert!(
            (tile * nb + nb) * Q4_TILE_BLOCK_BYTES <= p.len() && (tok + nt) * nb * QK <= x.q.len() && nt <= TOKEN_TILE
        );
        // SAFETY: bounds asserted above; the CPU features are this function's own contract.
        unsafe { by_tokens!(nt, q4_tokens(p, tile, nb, x, tok, out)) }
    }

    /// [`q4_tile`] for exactly `NT` tokens.
    ///
    /// # Safety
    /// As [`q4_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q4_tokens<const NT: usize>(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); NT];
        let xq = x.q.as_ptr();
        for b in 0..nb {
            // SAFETY (all pointer reads below): bounds checked by the caller; each block is
            // Q4_TILE_BLOCK_BYTES inside `p`, each activation block QK bytes inside `x.q`.
            unsafe {
                let base = p.as_ptr().add((tile * nb + b) * Q4_TILE_BLOCK_BYTES);
                let mut lo = [_mm512_setzero_si512(); 4];
                let mut hi = [_mm512_setzero_si512(); 4];
                for g in 0..4 {
                    let v = _mm512_loadu_si512(base.add(g * 64).cast());
                    lo[g] = _mm512_and_si512(v, mask);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(256).cast()));
                let mw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(288).cast()));
                for t in 0..NT {
                    let xb = (tok + t) * nb + b;
                    let xp = xq.add(xb * QK).cast::<i32>();
                    let mut s = _mm512_setzero_si512();
                    for g in 0..4 {
                        s = _mm512_dpbusd_epi32(s, lo[g], _mm512_set1_epi32(xp.add(g).read_unaligned()));
                        s = _mm512_dpbusd_epi32(s, hi[g], _mm512_set1_epi32(xp.add(4 + g).read_unaligned()));
                    }
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*x.d.get_unchecked(xb)));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[t]);
                    acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*x.s.get_unchecked(xb)), acc[t]);
                }
            }
        }
        for t in 0..NT {
            // SAFETY: `out` holds TOKEN_TILE·ROW_TILE floats and t < NT ≤ TOKEN_TILE.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE), acc[t]) };
        }
    }

    /// One Q8 row tile against up to four tokens.
    ///
    /// # Safety
    /// As [`q4_tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn q8_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        assert!(
            (tile * nb + nb) * Q8_TILE_BLOCK_BYTES <= p.len() && (tok + nt) * nb * QK <= x.q.len() && nt <= TOKEN_TILE
        );
        // SAFETY: bounds asserted above; the CPU features are this function's own contract.
        unsafe { by_tokens!(nt, q8_tokens(p, tile, nb, x, tok, out)) }
    }

    /// [`q8_tile`] for exactly `NT` tokens.
    ///
    /// # Safety
    /// As [`q8_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q8_tokens<const NT: usize>(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); NT];
        let xq = x.q.as_ptr();
        for b in 0..nb {
            // SAFETY: as in `q4_tokens`.
            unsafe {
                let base = p.as_ptr().add((tile * nb + b) * Q8_TILE_BLOCK_BYTES);
                let mut w = [_mm512_setzero_si512(); 8];
                for (g, wg) in w.iter_mut().enumerate() {
                    *wg = _mm512_loadu_si512(base.add(g * 64).cast());
                }
                let dw = _mm512_loadu_ps(base.add(512).cast());
                let corr = _mm512_loadu_ps(base.add(576).cast());
                for t in 0..NT {
                    let xb = (tok + t) * nb + b;
                    let xp = xq.add(xb * QK).cast::<i32>();
                    let mut s = _mm512_setzero_si512();
                    for (g, &wg) in w.iter().enumerate() {
                        // q_x + 128 as unsigned: flip the sign bit.
                        let xu = _mm512_xor_si512(_mm512_set1_epi32(xp.add(g).read_unaligned()), flip);
                        s = _mm512_dpbusd_epi32(s, xu, wg);
                    }
                    let dx = _mm512_set1_ps(*x.d.get_unchecked(xb));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[t]);
                    acc[t] = _mm512_fmadd_ps(corr, dx, acc[t]);
                }
            }
        }
        for t in 0..NT {
            // SAFETY: as in `q4_tokens`.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE), acc[t]) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Token indices also address activation blocks and output rows, not just `acc`.
#[allow(clippy::needless_range_loop)]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Widens pairwise i16 sums (from `vpmaddubsw`) to i32 sums of each 32-bit lane.
    macro_rules! widen {
        ($s16:expr) => {
            _mm256_madd_epi16($s16, _mm256_set1_epi16(1))
        };
    }

    /// One Q4 row tile against up to four tokens, eight rows (one half tile) at a time.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q4_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        assert!(
            (tile * nb + nb) * Q4_TILE_BLOCK_BYTES <= p.len() && (tok + nt) * nb * QK <= x.q.len() && nt <= TOKEN_TILE
        );
        // SAFETY: bounds asserted above; the CPU features are this function's own contract.
        unsafe { by_tokens!(nt, q4_tokens(p, tile, nb, x, tok, out)) }
    }

    /// [`q4_tile`] for exactly `NT` tokens. Each 64-byte group of nibbles is unpacked once and
    /// used for every token before the next is loaded, so only the `2·NT` accumulators and one
    /// group's two registers are live (sixteen ymm registers hold all of it for `NT` = 4).
    ///
    /// # Safety
    /// As [`q4_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_tokens<const NT: usize>(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        let mask = _mm256_set1_epi8(0x0f);
        let xq = x.q.as_ptr();
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); NT];
            for b in 0..nb {
                // SAFETY (all pointer reads below): bounds checked by the caller; each block is
                // Q4_TILE_BLOCK_BYTES inside `p`, each activation block QK bytes inside `x.q`.
                unsafe {
                    let base = p.as_ptr().add((tile * nb + b) * Q4_TILE_BLOCK_BYTES);
                    let xp: [*const i32; NT] = std::array::from_fn(|t| xq.add(((tok + t) * nb + b) * QK).cast());
                    // Eight pair sums of at most 2·15·127 each per lane: at most 30 480, no overflow.
                    let mut s16 = [_mm256_setzero_si256(); NT];
                    for g in 0..4 {
                        let v = _mm256_loadu_si256(base.add(g * 64 + half * 32).cast());
                        let lo = _mm256_and_si256(v, mask);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                        for t in 0..NT {
                            let xl = _mm256_set1_epi32(xp[t].add(g).read_unaligned());
                            let xh = _mm256_set1_epi32(xp[t].add(4 + g).read_unaligned());
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(lo, xl));
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(hi, xh));
                        }
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(256 + half * 16).cast()));
                    let mw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(288 + half * 16).cast()));
                    for t in 0..NT {
                        let xb = (tok + t) * nb + b;
                        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(xb)));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen!(s16[t])), scale, acc[t]);
                        acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*x.s.get_unchecked(xb)), acc[t]);
                    }
                }
            }
            for t in 0..NT {
                // SAFETY: `out` holds TOKEN_TILE·ROW_TILE floats; t < NT ≤ TOKEN_TILE, half < 2.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE + half * 8), acc[t]) };
            }
        }
    }

    /// One Q8 row tile against up to four tokens, eight rows at a time. Signed × signed products
    /// use `|w| · sign(x, w)`: `|w|` ≤ 128 is exact as an unsigned byte (even for w = −128), and
    /// the pair sums (at most 2·128·127) fit i16.
    ///
    /// # Safety
    /// As [`q4_tile`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q8_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        assert!(
            (tile * nb + nb) * Q8_TILE_BLOCK_BYTES <= p.len() && (tok + nt) * nb * QK <= x.q.len() && nt <= TOKEN_TILE
        );
        // SAFETY: bounds asserted above; the CPU features are this function's own contract.
        unsafe { by_tokens!(nt, q8_tokens(p, tile, nb, x, tok, out)) }
    }

    /// [`q8_tile`] for exactly `NT` tokens, one 64-byte weight group at a time (as `q4_tokens`).
    ///
    /// # Safety
    /// As [`q8_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_tokens<const NT: usize>(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        let xq = x.q.as_ptr();
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); NT];
            for b in 0..nb {
                // SAFETY: as in `q4_tokens`.
                unsafe {
                    let base = p.as_ptr().add((tile * nb + b) * Q8_TILE_BLOCK_BYTES);
                    let xp: [*const i32; NT] = std::array::from_fn(|t| xq.add(((tok + t) * nb + b) * QK).cast());
                    let mut s = [_mm256_setzero_si256(); NT];
                    for g in 0..8 {
                        let w = _mm256_loadu_si256(base.add(g * 64 + half * 32).cast());
                        let wabs = _mm256_abs_epi8(w);
                        for t in 0..NT {
                            let xv = _mm256_set1_epi32(xp[t].add(g).read_unaligned());
                            let prod = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w));
                            s[t] = _mm256_add_epi32(s[t], widen!(prod));
                        }
                    }
                    let dw = _mm256_loadu_ps(base.add(512 + half * 32).cast());
                    for t in 0..NT {
                        let dx = _mm256_set1_ps(*x.d.get_unchecked((tok + t) * nb + b));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), _mm256_mul_ps(dw, dx), acc[t]);
                    }
                }
            }
            for t in 0..NT {
                // SAFETY: as in `q4_tokens`.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE + half * 8), acc[t]) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    pub(super) use super::avx512::{q4_tile, q8_tile};
}

#[cfg(not(target_arch = "x86_64"))]
mod avx512 {
    use super::*;
    pub(super) unsafe fn q4_tile(
        _: &[u8],
        _: usize,
        _: usize,
        _: &QActs,
        _: usize,
        _: usize,
        _: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        unreachable!("Kernel::Avx512Vnni is never selected off x86_64")
    }
    pub(super) unsafe fn q8_tile(
        _: &[u8],
        _: usize,
        _: usize,
        _: &QActs,
        _: usize,
        _: usize,
        _: &mut [f32; ROW_TILE * TOKEN_TILE],
    ) {
        unreachable!("Kernel::Avx512Vnni is never selected off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Random ggml-format blocks for `rows × cols` of `ty`.
    fn random_weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let n = ty.bytes_for((rows * cols) as u64).unwrap() as usize;
        let mut v: Vec<u8> = (0..n).map(|_| next() as u8).collect();
        // Keep f16 scales finite and modest.
        let bb = ty.block_bytes();
        if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
            for blk in v.chunks_exact_mut(bb) {
                let d = f16::from_f32((next() % 1000) as f32 / 50_000.0 + 0.001);
                blk[0..2].copy_from_slice(&d.to_le_bytes());
                if ty == GgmlType::Q4_1 {
                    let m = f16::from_f32(-((next() % 1000) as f32) / 10_000.0);
                    blk[2..4].copy_from_slice(&m.to_le_bytes());
                }
            }
        } else if ty == GgmlType::F32 {
            for c in v.chunks_exact_mut(4) {
                c.copy_from_slice(&(((next() % 2000) as f32 - 1000.0) / 1000.0).to_le_bytes());
            }
        } else {
            for c in v.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(((next() % 2000) as f32 - 1000.0) / 1000.0).to_le_bytes());
            }
        }
        v
    }

    fn reference(ty: GgmlType, rows: usize, cols: usize, w: &[u8], x: &[f32]) -> Vec<f32> {
        let mut wf = vec![0f32; rows * cols];
        dequantize(ty, w, &mut wf);
        let tokens = x.len() / cols;
        let mut out = vec![0f32; tokens * rows];
        for t in 0..tokens {
            for r in 0..rows {
                out[t * rows + r] = (0..cols)
                    .map(|k| wf[r * cols + k] as f64 * x[t * cols + k] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    fn check(ty: GgmlType, rows: usize, cols: usize, tokens: usize, seed: u64) {
        let w = random_weights(ty, rows, cols, seed);
        let m = QMatrix::from_ggml(ty, rows, cols, &w).unwrap();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 7919 + seed as usize) % 201) as f32 / 100.0 - 1.0)
            .collect();
        let mut qa = QActs::new();
        qa.quantize(&x, cols);
        let want = reference(ty, rows, cols, &w, &x);
        let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
        let mut scalar = vec![0f32; tokens * rows];
        m.matmul_with(&qa, &mut scalar, Kernel::Scalar);
        for (i, (a, b)) in scalar.iter().zip(&want).enumerate() {
            // 8-bit activations: error well under 2% of the output scale.
            assert!((a - b).abs() <= 0.02 * scale, "{ty} scalar[{i}] = {a}, reference {b}");
        }
        for k in Kernel::available() {
            let mut simd = vec![0f32; tokens * rows];
            m.matmul_with(&qa, &mut simd, k);
            for (i, (a, b)) in simd.iter().zip(&scalar).enumerate() {
                assert!((a - b).abs() <= 1e-4 * scale, "{ty} {k:?}[{i}] = {a}, scalar {b}");
            }
        }
    }

    #[test]
    fn every_type_matches_the_dequantized_reference() {
        for ty in [
            GgmlType::Q4_1,
            GgmlType::Q4_0,
            GgmlType::Q8_0,
            GgmlType::F16,
            GgmlType::F32,
            GgmlType::BF16,
        ] {
            check(ty, 48, 96, 5, 1);
            check(ty, 17, 32, 1, 2); // a partial row tile
        }
        // Float rows of any length, on every kernel (the activations stay unquantized).
        for ty in [GgmlType::F16, GgmlType::F32, GgmlType::BF16] {
            for cols in [1, 7, 172] {
                check(ty, 9, cols, 3, 4);
            }
        }
    }

    #[test]
    fn simd_quantization_equals_scalar() {
        // 150 rows: enough to be split over the pool in uneven chunks.
        let x: Vec<f32> = (0..96 * 150)
            .map(|i| ((i * 7919) % 1999) as f32 / 313.0 - 3.1)
            .collect();
        let (mut a, mut b) = (QActs::new(), QActs::new());
        a.quantize_with(&x, 96, true);
        b.quantize_with(&x, 96, false);
        assert_eq!((&a.q, &a.d, &a.s), (&b.q, &b.d, &b.s));
        // Row by row (never split) gives the same blocks.
        for (r, row) in x.chunks_exact(96).enumerate() {
            b.quantize_with(row, 96, true);
            assert_eq!(
                (&a.q[r * 96..][..96], &a.d[r * 3..][..3]),
                (&b.q[..], &b.d[..]),
                "row {r}"
            );
        }
        let zeros = vec![0f32; 64];
        a.quantize_with(&zeros, 32, true);
        assert!(a.q.iter().all(|&q| q == 0) && a.d.iter().all(|&d| d == 0.0));
    }

    #[test]
    fn stacked_matrices_equal_their_parts() {
        let a = random_weights(GgmlType::Q4_1, 32, 64, 3);
        let b = random_weights(GgmlType::Q4_1, 16, 64, 4);
        let m = QMatrix::concat(&[(GgmlType::Q4_1, 32, &a), (GgmlType::Q4_1, 16, &b)], 64).unwrap();
        let ma = QMatrix::from_ggml(GgmlType::Q4_1, 32, 64, &a).unwrap();
        let mb = QMatrix::from_ggml(GgmlType::Q4_1, 16, 64, &b).unwrap();
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut qa = QActs::new();
        qa.quantize(&x, 64);
        let (mut o, mut oa, mut ob) = (vec![0f32; 48], vec![0f32; 32], vec![0f32; 16]);
        m.matmul(&qa, &mut o);
        ma.matmul(&qa, &mut oa);
        mb.matmul(&qa, &mut ob);
        assert_eq!(&o[..32], &oa[..]);
        assert_eq!(&o[32..], &ob[..]);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert_eq!(
            QMatrix::from_ggml(GgmlType::Q4_1, 2, 33, &[]).err(),
            Some(MatrixError::BadCols { cols: 33 })
        );
        assert_eq!(
            QMatrix::from_ggml(GgmlType::F32, 2, 0, &[]).err(),
            Some(MatrixError::BadCols { cols: 0 })
        );
        // Quantized rows stacked with float ones are still whole blocks.
        let f = random_weights(GgmlType::F32, 1, 40, 1);
        let q = random_weights(GgmlType::Q8_0, 1, 32, 1);
        assert_eq!(
            QMatrix::concat(&[(GgmlType::F32, 1, &f), (GgmlType::Q8_0, 1, &q)], 40).err(),
            Some(MatrixError::BadCols { cols: 40 })
        );
        assert!(matches!(
            QMatrix::from_ggml(GgmlType::Q4_1, 2, 32, &[0; 10]),
            Err(MatrixError::BadSize { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn simd_equals_scalar_on_random_shapes(rows in 1usize..70, blocks in 1usize..6, tokens in 1usize..10, seed in 0u64..1000) {
            check(GgmlType::Q4_1, rows, blocks * QK, tokens, seed);
            check(GgmlType::Q8_0, rows, blocks * QK, tokens, seed);
        }
    }
}
