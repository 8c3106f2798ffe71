//! Activations as the matmul kernels read them: per-32 blocks (llama.cpp's Q8_1) for the block
//! formats, per-256 super-blocks (llama.cpp's Q8_K) for the K-quants, and the f32 inputs
//! themselves for float weights. Each form is made only when a matrix it meets needs it.

use half::f16;
use rayon::prelude::*;

use crate::quant::{QK, QK_K};

/// Which forms of the activations the matrices they meet read (see [`super::QMatrix::needs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActNeeds {
    /// The f32 inputs (float weights).
    pub inputs: bool,
    /// Per-32 blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights).
    pub blocks: bool,
    /// Per-256 super-blocks (K-quant weights).
    pub superblocks: bool,
}

impl ActNeeds {
    /// Every form.
    pub const ALL: ActNeeds = ActNeeds {
        inputs: true,
        blocks: true,
        superblocks: true,
    };
    /// No form.
    pub const NONE: ActNeeds = ActNeeds {
        inputs: false,
        blocks: false,
        superblocks: false,
    };
}

impl std::ops::BitOr for ActNeeds {
    type Output = ActNeeds;
    fn bitor(self, o: ActNeeds) -> ActNeeds {
        ActNeeds {
            inputs: self.inputs || o.inputs,
            blocks: self.blocks || o.blocks,
            superblocks: self.superblocks || o.superblocks,
        }
    }
}

/// Activations quantized for the kernels, in the forms [`set_needs`](Self::set_needs) asks for
/// (all of them unless told otherwise).
#[derive(Debug, Clone)]
pub struct QActs {
    /// Rows the kernels read: the tokens, or twice as many after
    /// [`quantize_fine`](Self::quantize_fine).
    pub(super) tokens: usize,
    /// Whether the rows after the first half are the residuals of the first (see
    /// [`quantize_fine`](Self::quantize_fine)).
    pub(super) fine: bool,
    pub(super) cols: usize,
    needs: ActNeeds,
    /// Forms the last [`quantize`](Self::quantize) made.
    pub(super) has: ActNeeds,
    /// Block scales, `tokens × cols/32`.
    pub(super) d: Vec<f32>,
    /// `d · Σ q` per block.
    pub(super) s: Vec<f32>,
    /// `Σ q` per block.
    pub(super) bs: Vec<i16>,
    /// Quantized values, `tokens × cols`.
    pub(super) q: Vec<i8>,
    /// The inputs, `tokens × cols`.
    pub(super) x: Vec<f32>,
    /// Super-block scales, `tokens × cols/256`.
    pub(super) kd: Vec<f32>,
    /// Super-block values, `tokens × cols`.
    pub(super) kq: Vec<i8>,
    /// Sums of each 16 super-block values, 16 per super-block.
    pub(super) kbs16: Vec<i16>,
    /// Sums of each 32 super-block values, 8 per super-block.
    pub(super) kbs32: Vec<i16>,
    /// Scratch for [`quantize_fine`](Self::quantize_fine): the residuals and their quantization.
    residual: Option<Box<(Vec<f32>, QActs)>>,
}

impl Default for QActs {
    fn default() -> Self {
        Self {
            tokens: 0,
            fine: false,
            cols: 0,
            needs: ActNeeds::ALL,
            has: ActNeeds::NONE,
            d: Vec::new(),
            s: Vec::new(),
            bs: Vec::new(),
            q: Vec::new(),
            x: Vec::new(),
            kd: Vec::new(),
            kq: Vec::new(),
            kbs16: Vec::new(),
            kbs32: Vec::new(),
            residual: None,
        }
    }
}

/// Fewest rows worth a parallel task.
const MIN_ROWS: usize = 32;

impl QActs {
    /// An empty buffer; [`quantize`](Self::quantize) fills it, reusing its allocations.
    pub fn new() -> Self {
        Self::default()
    }

    /// Which forms to make: the union of what every matrix these activations meet needs. A
    /// matrix given activations without its form panics.
    pub fn set_needs(&mut self, needs: ActNeeds) {
        self.needs = needs;
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        if self.fine { self.tokens / 2 } else { self.tokens }
    }

    /// As [`quantize`](Self::quantize), then each quantized form's residual, `x` less what its
    /// 8-bit values and scale give back, quantized the same way as as many rows again. A matmul
    /// adds the two halves' results, so its inputs are as good as 16-bit ones (the residual's
    /// own rounding is 1/254 of the first): llama.cpp's 8-bit activations are what most of its
    /// distance from full-precision logits comes from. It doubles the multiply-adds of the rows
    /// that read the residuals (see [`QMatrix::with_fine_rows`](super::QMatrix::with_fine_rows)),
    /// not the weights they load. The inputs form gets zero rows: float matrices read the inputs
    /// themselves.
    ///
    /// # Panics
    /// As [`quantize`](Self::quantize).
    pub fn quantize_fine(&mut self, x: &[f32], cols: usize) {
        self.quantize_fine_with(x, cols, true)
    }

    pub(super) fn quantize_fine_with(&mut self, x: &[f32], cols: usize, simd: bool) {
        self.quantize_with(x, cols, simd);
        let mut res = self.residual.take().unwrap_or_default();
        let (r, acts) = &mut *res;
        r.resize(x.len(), 0.0);
        if self.has.blocks {
            residual(x, &self.d, &self.q, QK, r);
            acts.set_needs(ActNeeds {
                blocks: true,
                ..ActNeeds::NONE
            });
            acts.quantize_with(r, cols, simd);
            self.d.extend_from_slice(&acts.d);
            self.s.extend_from_slice(&acts.s);
            self.bs.extend_from_slice(&acts.bs);
            self.q.extend_from_slice(&acts.q);
        }
        if self.has.superblocks {
            residual(x, &self.kd, &self.kq, QK_K, r);
            acts.set_needs(ActNeeds {
                superblocks: true,
                ..ActNeeds::NONE
            });
            acts.quantize_with(r, cols, simd);
            self.kd.extend_from_slice(&acts.kd);
            self.kq.extend_from_slice(&acts.kq);
            self.kbs16.extend_from_slice(&acts.kbs16);
            self.kbs32.extend_from_slice(&acts.kbs32);
        }
        if self.has.inputs {
            self.x.resize(2 * x.len(), 0.0);
        }
        self.residual = Some(res);
        self.tokens *= 2;
        self.fine = true;
    }

    /// Quantizes `x` (`tokens × cols`, row-major) into the forms needed:
    /// * per-32 blocks as llama.cpp's Q8_1: `d = max|x|/127`, `q = round(x/d)`;
    /// * per-256 super-blocks as llama.cpp's Q8_K: `q = min(127, round(−127·x/max))` where
    ///   `max` is the value of largest magnitude, `d = 1/(−127/max)`, with the sums of each 16
    ///   and 32 values;
    /// * the inputs, kept as they are.
    ///
    /// A form whose blocks do not divide `cols` is not made: no matrix of that form can have
    /// rows of that length. Rows are split over the rayon pool when there are many.
    ///
    /// # Panics
    /// If `cols` is 0 or `x.len()` is not a multiple of `cols`.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.quantize_with(x, cols, true)
    }

    pub(super) fn quantize_with(&mut self, x: &[f32], cols: usize, simd: bool) {
        assert!(cols > 0 && x.len().is_multiple_of(cols), "activation shape");
        self.tokens = x.len() / cols;
        self.fine = false;
        self.cols = cols;
        self.has = ActNeeds {
            inputs: self.needs.inputs,
            blocks: self.needs.blocks && cols.is_multiple_of(QK),
            superblocks: self.needs.superblocks && cols.is_multiple_of(QK_K),
        };
        self.x.clear();
        if self.has.inputs {
            self.x.extend_from_slice(x);
        }
        let per = self.tokens.div_ceil(2 * rayon::current_num_threads()).max(MIN_ROWS);
        if self.has.blocks {
            let nblocks = x.len() / QK;
            self.d.resize(nblocks, 0.0);
            self.s.resize(nblocks, 0.0);
            self.bs.resize(nblocks, 0);
            self.q.resize(x.len(), 0);
            let bpr = cols / QK;
            let run = |((((x, q), d), s), bs): BlockChunk<'_>| {
                #[cfg(target_arch = "x86_64")]
                if simd && crate::ops::has_avx2() {
                    // SAFETY: avx2 was detected at run time; the chunks hold the same blocks.
                    unsafe { quantize_blocks_avx2(x, q, d, s, bs) };
                    return;
                }
                quantize_blocks(x, q, d, s, bs);
            };
            if self.tokens < 2 * MIN_ROWS {
                run((
                    (((x, &mut self.q[..]), &mut self.d[..]), &mut self.s[..]),
                    &mut self.bs[..],
                ));
            } else {
                x.par_chunks(per * cols)
                    .zip(self.q.par_chunks_mut(per * cols))
                    .zip(self.d.par_chunks_mut(per * bpr))
                    .zip(self.s.par_chunks_mut(per * bpr))
                    .zip(self.bs.par_chunks_mut(per * bpr))
                    .for_each(run);
            }
        }
        if self.has.superblocks {
            let nsb = x.len() / QK_K;
            self.kd.resize(nsb, 0.0);
            self.kq.resize(x.len(), 0);
            self.kbs16.resize(nsb * 16, 0);
            self.kbs32.resize(nsb * 8, 0);
            let spr = cols / QK_K;
            let run = |((((x, q), d), b16), b32): SuperChunk<'_>| {
                #[cfg(target_arch = "x86_64")]
                if simd && crate::ops::has_avx2() {
                    // SAFETY: avx2 was detected at run time; the chunks hold the same blocks.
                    unsafe { quantize_superblocks_avx2(x, q, d, b16, b32) };
                    return;
                }
                quantize_superblocks(x, q, d, b16, b32)
            };
            if self.tokens < 2 * MIN_ROWS {
                run((
                    (((x, &mut self.kq[..]), &mut self.kd[..]), &mut self.kbs16[..]),
                    &mut self.kbs32[..],
                ));
            } else {
                x.par_chunks(per * cols)
                    .zip(self.kq.par_chunks_mut(per * cols))
                    .zip(self.kd.par_chunks_mut(per * spr))
                    .zip(self.kbs16.par_chunks_mut(per * spr * 16))
                    .zip(self.kbs32.par_chunks_mut(per * spr * 8))
                    .for_each(run);
            }
        }
    }

    /// Whether the last quantization made `form`'s data for `cols`-wide rows; the kernels
    /// assert it.
    pub(super) fn check(&self, cols: usize, form: ActNeeds) {
        assert_eq!(self.cols, cols, "activation width");
        assert!(
            (!form.inputs || self.has.inputs)
                && (!form.blocks || self.has.blocks)
                && (!form.superblocks || self.has.superblocks),
            "activations quantized without a form a matrix needs ({form:?}; made {:?})",
            self.has
        );
    }
}

/// `r = x −` what the `block`-wide blocks of values `q` with scales `d` give back.
fn residual(x: &[f32], d: &[f32], q: &[i8], block: usize, r: &mut [f32]) {
    for (((rs, xs), qs), &d) in r
        .chunks_exact_mut(block)
        .zip(x.chunks_exact(block))
        .zip(q.chunks_exact(block))
        .zip(d)
    {
        for ((ri, &xi), &qi) in rs.iter_mut().zip(xs).zip(qs) {
            *ri = xi - d * qi as f32;
        }
    }
}

/// One chunk of rows to quantize to super-blocks: inputs, values, scales, and sums of 16 and 32.
type SuperChunk<'a> = (
    (((&'a [f32], &'a mut [i8]), &'a mut [f32]), &'a mut [i16]),
    &'a mut [i16],
);

/// Quantizes the super-blocks of `x` as llama.cpp's `quantize_row_q8_K_ref` does, rounding half
/// to even as its `nearest_int` does.
fn quantize_superblocks(x: &[f32], q: &mut [i8], d: &mut [f32], bs16: &mut [i16], bs32: &mut [i16]) {
    for (b, xs) in x.chunks_exact(QK_K).enumerate() {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xs {
            if v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        let qs = &mut q[b * QK_K..(b + 1) * QK_K];
        if amax == 0.0 {
            d[b] = 0.0;
            qs.fill(0);
        } else {
            let iscale = -127.0 / max;
            for (qi, &v) in qs.iter_mut().zip(xs) {
                *qi = ((iscale * v).round_ties_even() as i32).min(127) as i8;
            }
            d[b] = 1.0 / iscale;
        }
        for (j, g) in qs.chunks_exact(16).enumerate() {
            bs16[b * 16 + j] = g.iter().map(|&v| v as i16).sum();
        }
        for j in 0..8 {
            bs32[b * 8 + j] = bs16[b * 16 + 2 * j] + bs16[b * 16 + 2 * j + 1];
        }
    }
}

/// [`quantize_superblocks`] with AVX2: the same values bit for bit (`vcvtps2dq` rounds half to
/// even under the default rounding mode, as `nearest_int` does).
///
/// # Safety
/// The CPU must support avx2; `q` holds `x.len()` bytes, `d` one float per super-block, `bs16`
/// and `bs32` 16 and 8 sums per super-block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_superblocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], bs16: &mut [i16], bs32: &mut [i16]) {
    use std::arch::x86_64::*;
    assert!(q.len() == x.len() && d.len() * QK_K == x.len() && bs16.len() == 16 * d.len() && bs32.len() == 8 * d.len());
    let sign = _mm256_set1_ps(-0.0);
    for (b, xs) in x.chunks_exact(QK_K).enumerate() {
        // SAFETY (pointer accesses): `xs` is QK_K floats; `q` holds QK_K bytes per super-block.
        unsafe {
            let v: [__m256; 32] = std::array::from_fn(|k| _mm256_loadu_ps(xs.as_ptr().add(8 * k)));
            let mut m = _mm256_setzero_ps();
            for vk in &v {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vk));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
            let qs = &mut q[b * QK_K..(b + 1) * QK_K];
            if amax == 0.0 {
                d[b] = 0.0;
                qs.fill(0);
                bs16[b * 16..(b + 1) * 16].fill(0);
                bs32[b * 8..(b + 1) * 8].fill(0);
                continue;
            }
            // The first value of that magnitude carries the sign, as the scalar loop's strict
            // comparison keeps the first.
            let first = xs.iter().position(|v| v.abs() == amax).unwrap_or(0);
            let iscale = -127.0 / xs[first];
            let is = _mm256_set1_ps(iscale);
            let cap = _mm256_set1_epi32(127);
            for k in 0..8 {
                let i: [__m256i; 4] =
                    std::array::from_fn(|j| _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[4 * k + j], is)), cap));
                // Sums of each 16 (two vectors of 8).
                for h in 0..2 {
                    let s = _mm256_add_epi32(i[2 * h], i[2 * h + 1]);
                    let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                    let s4 = _mm_hadd_epi32(s4, s4);
                    bs16[b * 16 + 2 * k + h] = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4)) as i16;
                }
                let w01 = _mm256_packs_epi32(i[0], i[1]);
                let w23 = _mm256_packs_epi32(i[2], i[3]);
                let bytes = _mm256_permutevar8x32_epi32(
                    _mm256_packs_epi16(w01, w23),
                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
                );
                _mm256_storeu_si256(qs.as_mut_ptr().add(32 * k).cast(), bytes);
            }
            for j in 0..8 {
                bs32[b * 8 + j] = bs16[b * 16 + 2 * j] + bs16[b * 16 + 2 * j + 1];
            }
            d[b] = 1.0 / iscale;
        }
    }
}

/// One chunk of rows to quantize: inputs, and their quantized values, scales, scaled sums and
/// sums.
type BlockChunk<'a> = (
    (((&'a [f32], &'a mut [i8]), &'a mut [f32]), &'a mut [f32]),
    &'a mut [i16],
);

/// Quantizes the blocks of `x` into `q` with scales `d`, scaled sums `s` and sums `bs`.
fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], bs: &mut [i16]) {
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        // 127/max, not 1/d: the multiplier llama.cpp's x86 quantizer uses (they differ in the last bit).
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (qi, &v) in q[b * QK..(b + 1) * QK].iter_mut().zip(xs) {
            let r = (v * id).round() as i32;
            *qi = r as i8;
            sum += r;
        }
        // llama.cpp stores both as f16. The scale stays so (the values were rounded against
        // the exact one; the kernels' sums use the stored one); the scaled sum is that scale
        // times the sum exactly, not rounded again, so a minimum's term carries no error of its own.
        d[b] = f16::from_f32(db).to_f32();
        s[b] = d[b] * sum as f32;
        bs[b] = sum as i16;
    }
}

/// [`quantize_blocks`] with AVX2. Rounds half to even where the scalar loop rounds half away
/// from zero, as llama.cpp's own AVX2 quantizer does.
///
/// # Safety
/// The CPU must support avx2; `q` holds `x.len()` bytes, `d` and `s` one float per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], bs: &mut [i16]) {
    use std::arch::x86_64::*;
    assert!(q.len() == x.len() && d.len() * QK == x.len() && s.len() == d.len() && bs.len() == d.len());
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
            let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
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
            s[b] = d[b] * total as f32;
            bs[b] = total as i16;
        }
    }
}
