//! Elementwise and row-wise operations of a llama block: RMSNorm, RoPE, SwiGLU, softmax.
//!
//! The hot ones (dot products, `axpy`, `exp`) have AVX2+FMA versions chosen at run time, with the
//! portable code as the fallback and as the reference the tests compare against.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;
use rayon::prelude::*;

/// Whether the AVX2 paths may run (avx2, fma and f16c all present; checked once).
#[inline]
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the AVX-512 paths of these loops may run (avx512f on top of [`has_avx2`]; checked
/// once).
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| has_avx2() && std::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Dot product.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: avx2 and fma were detected at run time.
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable(a, b)
}

/// Portable dot product with sixteen independent accumulators.
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// # Safety
/// The CPU must support avx2 and fma; `a.len() == b.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (pointer reads): every read is below `n`, the length of both slices.
    unsafe {
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8 * k)),
                    _mm256_loadu_ps(pb.add(i + 8 * k)),
                    *a,
                );
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }
}

/// `y += a · x`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: avx2 and fma were detected at run time; lengths are equal.
        unsafe { axpy_avx2(a, x, y) };
        return;
    }
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += xi * a;
    }
}

/// # Safety
/// The CPU must support avx2 and fma; `x.len() == y.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    // SAFETY (pointer accesses): every index is below `n`, the length of both slices.
    unsafe {
        while i + 8 <= n {
            _mm256_storeu_ps(
                py.add(i),
                _mm256_fmadd_ps(_mm256_loadu_ps(px.add(i)), av, _mm256_loadu_ps(py.add(i))),
            );
            i += 8;
        }
        while i < n {
            *py.add(i) += *px.add(i) * a;
            i += 1;
        }
    }
}

/// `e^x` for eight lanes (Cephes' polynomial, within 2 ulp of `f32::exp` on [−87, 88]; below
/// −87 it returns 0, which softmax and SiLU want).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.0));
    let under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    ));
    _mm256_andnot_ps(under, _mm256_mul_ps(p, pow2))
}

/// Runs `f(first_row, rows)` over chunks of the `width`-float rows of `out`, spread over the
/// rayon pool when there are enough rows to pay for it (a prefill), inline otherwise (decode).
pub fn par_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    /// Fewest rows a parallel task gets.
    const MIN_ROWS: usize = 32;
    let rows = out.len() / width.max(1);
    let threads = rayon::current_num_threads();
    if threads == 1 || rows < 2 * MIN_ROWS {
        f(0, out);
        return;
    }
    let per = rows.div_ceil(2 * threads).max(MIN_ROWS);
    out.par_chunks_mut(per * width)
        .enumerate()
        .for_each(|(i, chunk)| f(i * per, chunk));
}

/// RMSNorm of each `w.len()`-wide row of `x` into `out`: `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(x.len() == out.len() && x.len().is_multiple_of(n));
    par_rows(out, n, |r0, out| {
        for (xr, or) in x[r0 * n..].chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            // Sum of squares in f64, as llama.cpp does.
            let ss = xr.iter().map(|&v| (v * v) as f64).sum::<f64>() / n as f64;
            let scale = (1.0 / (ss + eps as f64).sqrt()) as f32;
            for ((o, &xi), &wi) in or.iter_mut().zip(xr).zip(w) {
                *o = xi * scale * wi;
            }
        }
    });
}

/// Rotary position embedding tables for one model: `cos`/`sin` of `pos · base^(−2i/d)`, each
/// pair's angle divided by its frequency factor and multiplied by the linear scale.
///
/// Angles are computed as llama.cpp computes them (`ggml_rope_cache_init`): `pos · θⁱ` by
/// repeated f32 multiplication with `θ = base^(−2/d)`, then `/ factor`, then `· scale`. A
/// closed-form `base^(−2i/d)` differs in the last bits, growing with `i` and the position; the
/// files were trained and are checked against llama.cpp's angles.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    pairs: usize,
    theta_scale: f32,
    /// Each pair's frequency factor (1 without `rope_freqs`).
    factors: Vec<f32>,
    /// llama.cpp's `freq_scale`: 1 / the factor of linear RoPE scaling.
    scale: f32,
    neox: bool,
}

impl Rope {
    /// Tables for heads of `head_dim` (even) rotated over `rot_dim ≤ head_dim` dimensions.
    pub fn new(head_dim: usize, rot_dim: usize, base: f32) -> Self {
        assert!(rot_dim.is_multiple_of(2) && rot_dim <= head_dim);
        Self {
            head_dim,
            pairs: rot_dim / 2,
            theta_scale: base.powf(-2.0 / rot_dim as f32),
            factors: vec![1.0; rot_dim / 2],
            scale: 1.0,
            neox: false,
        }
    }

    /// Multiplies every angle by `scale` (llama.cpp's `freq_scale`: 1 / the factor of linear
    /// RoPE scaling).
    pub fn scaled(mut self, scale: f32) -> Self {
        self.scale *= scale;
        self
    }

    /// Rotates pairs `(x[i], x[i + rot_dim/2])` instead of adjacent ones: llama.cpp's NEOX
    /// RoPE, which Qwen and Gemma files expect.
    pub fn neox(mut self) -> Self {
        self.neox = true;
        self
    }

    /// As [`new`](Self::new), with each pair's angle divided by its factor: llama.cpp's rope
    /// frequency factors, which Llama 3.1-style files carry as `rope_freqs.weight` (their
    /// long-context scaling, computed at conversion).
    ///
    /// # Panics
    /// If there is not one factor per rotated pair.
    pub fn with_freq_factors(head_dim: usize, rot_dim: usize, base: f32, factors: &[f32]) -> Self {
        assert_eq!(factors.len(), rot_dim / 2, "one factor per rotated pair");
        Self {
            factors: factors.to_vec(),
            ..Self::new(head_dim, rot_dim, base)
        }
    }

    /// The cosines and sines for rows at `positions`, computed once per step and shared by every
    /// layer's queries and keys.
    pub fn table(&self, positions: &[u32]) -> RopeTable {
        let mut cs = Vec::with_capacity(positions.len() * self.pairs);
        for &pos in positions {
            let mut theta = pos as f32;
            for &ff in &self.factors {
                let (s, c) = (self.scale * (theta / ff)).sin_cos();
                cs.push([c, s]);
                theta *= self.theta_scale;
            }
        }
        RopeTable {
            head_dim: self.head_dim,
            pairs: self.pairs,
            neox: self.neox,
            cs,
        }
    }

    /// Rotates every head of every `row_width`-wide row of `x` by the angle for that row's
    /// position (see [`RopeTable::apply`]).
    pub fn apply(&self, x: &mut [f32], row_width: usize, positions: &[u32]) {
        self.table(positions).apply(x, row_width, 0, row_width)
    }
}

/// Rotation angles for one step's rows (see [`Rope::table`]).
#[derive(Debug, Clone)]
pub struct RopeTable {
    head_dim: usize,
    pairs: usize,
    neox: bool,
    /// `[cos, sin]` per row and pair.
    cs: Vec<[f32; 2]>,
}

impl RopeTable {
    /// Rows (positions) covered.
    pub fn rows(&self) -> usize {
        self.cs.len().checked_div(self.pairs).unwrap_or(0)
    }

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head in `offset..offset+width` of each
    /// row of `x` (rows `stride` apart, one per table row) — llama.cpp's "normal" RoPE, as GGUF
    /// llama models expect — or, for a [`Rope::neox`] table, pairs `(x[i], x[i + pairs])`.
    ///
    /// # Panics
    /// If `x` is not one `stride`-long row per table row, or the heads do not fit the rows.
    pub fn apply(&self, x: &mut [f32], stride: usize, offset: usize, width: usize) {
        assert!(
            x.len() == stride * self.rows() && width.is_multiple_of(self.head_dim) && offset + width <= stride,
            "rope shape"
        );
        if self.pairs == 0 {
            return;
        }
        par_rows(x, stride, |r0, rows| {
            for (r, row) in rows.chunks_exact_mut(stride).enumerate() {
                let cs = &self.cs[(r0 + r) * self.pairs..][..self.pairs];
                for head in row[offset..offset + width].chunks_exact_mut(self.head_dim) {
                    let n = self.pairs;
                    for (i, &[c, s]) in cs.iter().enumerate() {
                        let (ia, ib) = if self.neox { (i, i + n) } else { (2 * i, 2 * i + 1) };
                        let (a, b) = (head[ia], head[ib]);
                        head[ia] = a * c - b * s;
                        head[ib] = a * s + b * c;
                    }
                }
            }
        });
    }
}

/// GELU's tanh approximation, `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))`, in f32 as ggml
/// writes it.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// GELU of every f16 value, rounded to f16: the table llama.cpp's CPU backend looks GELU up in.
/// One zero entry follows the 65536, so that a 32-bit gather at any entry stays inside.
fn gelu_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| f16::from_f32(gelu_tanh(f16::from_bits(b).to_f32())))
            .chain([f16::ZERO])
            .collect()
    })
}

/// `out[i] = gelu(gate[i]) · up[i]` where each row of `gate_up` is `[gate | up]`, `width` each
/// (Gemma's GeGLU), computed as llama.cpp's CPU backend does: 0 at or below −10, the identity at
/// or above 10, and between them GELU of the gate rounded to f16, looked up in a table of f16
/// results.
pub fn geglu(gate_up: &[f32], width: usize, out: &mut [f32]) {
    geglu_with(has_avx512(), gate_up, width, out)
}

/// [`geglu`] with the AVX-512 path taken where `simd` (which the caller has detected) or not.
fn geglu_with(simd: bool, gate_up: &[f32], width: usize, out: &mut [f32]) {
    assert!(gate_up.len() == 2 * out.len() && out.len().is_multiple_of(width));
    let table = gelu_table();
    par_rows(out, width, |r0, out| {
        for (gu, o) in gate_up[r0 * 2 * width..]
            .chunks_exact(2 * width)
            .zip(out.chunks_exact_mut(width))
        {
            let (g, u) = gu.split_at(width);
            let mut done = 0;
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: avx512f was detected at run time (the caller's `simd`); `g`, `u` and
                // `o` are `width` long; the table has its padding entry.
                done = unsafe { geglu_avx512(table, g, u, o) };
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = simd;
            for ((oi, &gi), &ui) in o[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
                let gelu = if gi <= -10.0 {
                    0.0
                } else if gi >= 10.0 {
                    gi
                } else {
                    table[f16::from_f32(gi).to_bits() as usize].to_f32()
                };
                *oi = gelu * ui;
            }
        }
    });
}

/// GeGLU over the multiple-of-sixteen prefix, sixteen table entries to one gather; returns its
/// length. The same comparisons, rounding and lookups as the scalar loop, so the same bits.
///
/// # Safety
/// The CPU must support avx512f; the three slices have equal length; `table` holds the 65536
/// entries and the padding one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn geglu_avx512(table: &[f16], g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
    assert!(table.len() > usize::from(u16::MAX) + 1);
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let n = o.len() / 16 * 16;
    let (lo, hi) = (_mm512_set1_ps(-10.0), _mm512_set1_ps(10.0));
    let low16 = _mm512_set1_epi32(0xffff);
    for i in (0..n).step_by(16) {
        // SAFETY: i + 16 ≤ n ≤ the length of each slice; each gather reads the four bytes at
        // entry `idx ≤ 65535` of `table`, inside it with the padding entry.
        unsafe {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let idx = _mm512_cvtepu16_epi32(_mm512_cvtps_ph::<NEAREST>(gv));
            let pairs = _mm512_i32gather_epi32::<2>(idx, table.as_ptr().cast());
            let looked = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(pairs, low16)));
            // Below or at −10: 0; at or above 10: the gate itself (both false for NaN).
            let below = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(gv, lo);
            let above = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(gv, hi);
            let gelu = _mm512_mask_blend_ps(above, _mm512_maskz_mov_ps(!below, looked), gv);
            _mm512_storeu_ps(
                o.as_mut_ptr().add(i),
                _mm512_mul_ps(gelu, _mm512_loadu_ps(u.as_ptr().add(i))),
            );
        }
    }
    n
}

/// `out[i] = silu(gate[i]) · up[i]` where each row of `gate_up` is `[gate | up]`, `width` each.
pub fn swiglu(gate_up: &[f32], width: usize, out: &mut [f32]) {
    assert!(gate_up.len() == 2 * out.len() && out.len().is_multiple_of(width));
    par_rows(out, width, |r0, out| {
        for (gu, o) in gate_up[r0 * 2 * width..]
            .chunks_exact(2 * width)
            .zip(out.chunks_exact_mut(width))
        {
            let (g, u) = gu.split_at(width);
            let mut done = 0;
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: avx2 and fma were detected at run time; `g`, `u` and `o` are `width` long.
                done = unsafe { swiglu_avx2(g, u, o) };
            }
            for ((oi, &gi), &ui) in o[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
                *oi = gi / (1.0 + (-gi).exp()) * ui;
            }
        }
    });
}

/// SwiGLU over the multiple-of-eight prefix; returns its length.
///
/// # Safety
/// The CPU must support avx2 and fma; the three slices have equal length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
    let n = o.len() / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    for i in (0..n).step_by(8) {
        // SAFETY: i + 8 ≤ n ≤ the length of each slice.
        unsafe {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(
                o.as_mut_ptr().add(i),
                _mm256_mul_ps(silu, _mm256_loadu_ps(u.as_ptr().add(i))),
            );
        }
    }
    n
}

/// `x[i] = e^x[i]` in place, as glibc's `expf` rounds it in all but rare cases: the SIMD path
/// evaluates in f64 and rounds once to f32, which is how glibc computes `expf`. Attention uses it
/// where llama.cpp calls `expf`, so that near-ties between tokens break the same way.
pub fn exp_in_place(x: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: avx2 and fma were detected at run time.
        done = unsafe { exp_f64_avx2(x) };
    }
    for v in x[done..].iter_mut() {
        *v = v.exp();
    }
}

/// [`exp_in_place`] over the multiple-of-four prefix; returns its length.
///
/// # Safety
/// The CPU must support avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_f64_avx2(x: &mut [f32]) -> usize {
    let n = x.len() / 4 * 4;
    for i in (0..n).step_by(4) {
        // SAFETY: i + 4 ≤ n ≤ x.len().
        unsafe {
            let xs = _mm_loadu_ps(x.as_ptr().add(i));
            // Beyond these bounds expf is 0 (or a denormal softmax cannot use) and +inf.
            let xd = _mm256_min_pd(
                _mm256_max_pd(_mm256_cvtps_pd(xs), _mm256_set1_pd(-104.0)),
                _mm256_set1_pd(89.0),
            );
            let k = _mm256_round_pd(
                _mm256_mul_pd(xd, _mm256_set1_pd(std::f64::consts::LOG2_E)),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            );
            let r = _mm256_fnmadd_pd(k, _mm256_set1_pd(std::f64::consts::LN_2), xd);
            // Taylor series to r^10 on |r| ≤ ln2/2: relative error below 1e-12.
            let mut p = _mm256_set1_pd(1.0 / 3_628_800.0);
            for c in [
                1.0 / 362_880.0,
                1.0 / 40_320.0,
                1.0 / 5_040.0,
                1.0 / 720.0,
                1.0 / 120.0,
                1.0 / 24.0,
                1.0 / 6.0,
                0.5,
                1.0,
                1.0,
            ] {
                p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(c));
            }
            // 2^k through the exponent bits (k in [−151, 129]; the f64 exponent range holds it).
            let ki = _mm256_cvtpd_epi32(k);
            let bits = _mm256_slli_epi64(
                _mm256_add_epi64(_mm256_cvtepi32_epi64(ki), _mm256_set1_epi64x(1023)),
                52,
            );
            let e = _mm256_mul_pd(p, _mm256_castsi256_pd(bits));
            let out = _mm256_cvtpd_ps(e);
            let under = _mm_cmplt_ps(xs, _mm_set1_ps(-103.0));
            _mm_storeu_ps(x.as_mut_ptr().add(i), _mm_andnot_ps(under, out));
        }
    }
    n
}

/// In-place softmax of `x`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let mut sum = 0f32;
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: avx2 and fma were detected at run time.
        (done, sum) = unsafe { exp_sub_avx2(x, max) };
    }
    for v in x[done..].iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `x[i] = e^(x[i] − max)` over the multiple-of-eight prefix; returns its length and sum.
///
/// # Safety
/// The CPU must support avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sub_avx2(x: &mut [f32], max: f32) -> (usize, f32) {
    let n = x.len() / 8 * 8;
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        // SAFETY: i + 8 ≤ n ≤ x.len().
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), m));
            _mm256_storeu_ps(x.as_mut_ptr().add(i), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    (n, hsum(acc))
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len());
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_normalises() {
        let x = [3.0f32, 4.0, 0.0, 0.0];
        let mut o = [0f32; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut o);
        assert!((o[0] - 1.2).abs() < 1e-6 && (o[1] - 1.6).abs() < 1e-6);
    }

    #[test]
    fn frequency_factors_divide_each_pairs_angle() {
        let factors = [1.0, 2.0, 8.0, 0.5];
        let r = Rope::with_freq_factors(8, 8, 10_000.0, &factors);
        let t = r.table(&[0, 3, 77]);
        for (row, pos) in [0u32, 3, 77].into_iter().enumerate() {
            for (i, ff) in factors.iter().enumerate() {
                let angle = pos as f32 * 10_000f32.powf(-2.0 * i as f32 / 8.0) / ff;
                let [c, s] = t.cs[row * 4 + i];
                assert!(
                    (c - angle.cos()).abs() < 1e-5 && (s - angle.sin()).abs() < 1e-5,
                    "pos {pos} pair {i}"
                );
            }
        }
        // Factors of 1 are plain RoPE.
        let plain = Rope::new(8, 8, 10_000.0).table(&[5]);
        assert_eq!(
            Rope::with_freq_factors(8, 8, 10_000.0, &[1.0; 4]).table(&[5]).cs,
            plain.cs
        );
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let r = Rope::new(4, 4, 10000.0);
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        r.apply(&mut x, 4, &[0]);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
        r.apply(&mut x, 4, &[7]);
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 30.0).abs() < 1e-4);
        // First pair rotates by 7 radians.
        let (s, c) = 7f32.sin_cos();
        assert!((x[0] - (c - 2.0 * s)).abs() < 1e-5);
    }

    /// NEOX RoPE rotates element i with element i + rot/2 (llama.cpp's `rope_neox`), by the same
    /// angles the normal kind gives pair i.
    #[test]
    fn neox_rope_pairs_the_halves() {
        let (normal, neox) = (Rope::new(8, 6, 100.0), Rope::new(8, 6, 100.0).neox());
        let x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        normal.apply(&mut a, 8, &[5]);
        neox.apply(&mut b, 8, &[5]);
        for i in 0..3 {
            // Pair i: normal (2i, 2i+1), neox (i, i+3), from the same starting values.
            let (mut c, mut d) = (x.clone(), x.clone());
            (c[2 * i], c[2 * i + 1]) = (x[i], x[i + 3]);
            normal.apply(&mut c, 8, &[5]);
            (d[i], d[i + 3]) = (c[2 * i], c[2 * i + 1]);
            assert_eq!((b[i], b[i + 3]), (d[i], d[i + 3]), "pair {i}");
        }
        assert_eq!(&b[6..], &x[6..], "dimensions past the rotary ones stay");
        assert_ne!(a, b);
    }

    /// The AVX-512 GeGLU (where this CPU has it) gives the scalar loop's bits, over gates that
    /// cross both cut-offs, sit on them, and reach every part of the table.
    #[test]
    fn simd_geglu_equals_scalar() {
        if !has_avx512() {
            println!("no AVX-512 on this CPU: the scalar GeGLU alone runs here");
            return;
        }
        let width = 16 * 37 + 5;
        let rows = 80;
        let mut gu = Vec::with_capacity(2 * width * rows);
        for r in 0..rows {
            gu.extend((0..width).map(|i| match (r + i) % 97 {
                0 => -10.0,
                1 => 10.0,
                2 => f32::NAN,
                3 => 1e30,
                k => ((r * width + i) as f32 * 0.618).sin() * 13.0 + k as f32 * 1e-3,
            }));
            gu.extend((0..width).map(|i| ((r + 3 * i) % 11) as f32 - 5.0));
        }
        let (mut a, mut b) = (vec![0f32; width * rows], vec![0f32; width * rows]);
        geglu_with(false, &gu, width, &mut a);
        geglu_with(true, &gu, width, &mut b);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }

    #[test]
    fn geglu_is_gelu_tanh_of_the_gate_times_up() {
        let gate = [-12.0f32, -1.0, 0.0, 0.5, 3.0, 11.0];
        let mut gu = gate.to_vec();
        gu.extend_from_slice(&[2.0; 6]);
        let mut out = [0f32; 6];
        geglu(&gu, 6, &mut out);
        // tanh-GELU values (PyTorch's gelu(approximate="tanh")), to f16 precision.
        let want = [0.0f32, -0.158_808, 0.0, 0.345_714, 2.996_363, 11.0];
        for ((o, w), g) in out.iter().zip(want).zip(gate) {
            assert!(
                (o - 2.0 * w).abs() <= 2.0 * 1e-3 * w.abs().max(1e-3),
                "gelu({g}) = {}",
                o / 2.0
            );
        }
    }

    #[test]
    fn rope_table_rotates_strided_heads_like_contiguous_rows() {
        let r = Rope::new(8, 6, 10000.0);
        // 100 rows (enough to split over the pool) of [4 unrotated | two heads of 8 | 4 unrotated].
        let positions: Vec<u32> = (0..100).map(|i| (i * 37 % 91) as u32).collect();
        let mut wide: Vec<f32> = (0..100 * 24).map(|i| ((i * 13) % 29) as f32 / 7.0 - 2.0).collect();
        let mut heads: Vec<f32> = wide.chunks_exact(24).flat_map(|row| row[4..20].to_vec()).collect();
        let before = wide.clone();
        r.table(&positions).apply(&mut wide, 24, 4, 16);
        r.apply(&mut heads, 16, &positions);
        for (i, (w, b)) in wide.chunks_exact(24).zip(before.chunks_exact(24)).enumerate() {
            assert_eq!(&w[4..20], &heads[i * 16..(i + 1) * 16], "row {i}");
            assert_eq!((&w[..4], &w[20..]), (&b[..4], &b[20..]), "row {i} outside the heads");
        }
        // Pairs beyond the rotary dimensions stay as they were (row 1, at position 37).
        assert_eq!(heads[16 + 6..16 + 8], before[24 + 10..24 + 12]);
        assert_ne!(heads[16..16 + 6], before[24 + 4..24 + 10]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0f32, 2.0, 3.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6 && x[2] > x[1]);
    }

    #[test]
    fn swiglu_matches_definition() {
        let gu = [1.0f32, -2.0, 3.0, 4.0];
        let mut o = [0f32; 2];
        swiglu(&gu, 2, &mut o);
        assert!((o[0] - 3.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert!((o[1] - (-2.0 / (1.0 + 2f32.exp())) * 4.0).abs() < 1e-6);
    }

    #[test]
    fn simd_paths_match_the_portable_ones() {
        let a: Vec<f32> = (0..203).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let b: Vec<f32> = (0..203).map(|i| ((i * 53) % 97) as f32 / 40.0 - 1.2).collect();
        for n in [0, 1, 7, 8, 31, 32, 33, 64, 203] {
            let (x, y) = (&a[..n], &b[..n]);
            assert!((dot(x, y) - dot_portable(x, y)).abs() < 1e-4, "dot of {n}");
            let mut y1 = y.to_vec();
            axpy(0.7, x, &mut y1);
            for i in 0..n {
                assert!((y1[i] - (y[i] + 0.7 * x[i])).abs() < 1e-6);
            }
        }
        // exp through softmax and SwiGLU, against f32::exp, across the whole useful range.
        let xs: Vec<f32> = (0..4000).map(|i| i as f32 * 0.05 - 120.0).collect();
        let mut sm = xs.clone();
        softmax(&mut sm);
        let max = xs.iter().fold(f32::MIN, |m, &v| m.max(v));
        let total: f64 = xs.iter().map(|&v| ((v - max) as f64).exp()).sum();
        for (i, &v) in xs.iter().enumerate() {
            let want = (((v - max) as f64).exp() / total) as f32;
            assert!(
                (sm[i] - want).abs() <= 1e-6 * want.max(1e-30) + 1e-37,
                "softmax at {v}: {} vs {want}",
                sm[i]
            );
        }
        let gu: Vec<f32> = xs.iter().chain(xs.iter()).copied().collect();
        let mut o = vec![0f32; xs.len()];
        swiglu(&gu, xs.len(), &mut o);
        for (i, &g) in xs.iter().enumerate() {
            let want = g / (1.0 + (-g).exp()) * g;
            assert!(
                (o[i] - want).abs() <= 1e-5 * want.abs().max(1e-6),
                "swiglu at {g}: {} vs {want}",
                o[i]
            );
        }
    }

    #[test]
    fn exp_in_place_rounds_like_libm() {
        let xs: Vec<f32> = (0..20_000).map(|i| i as f32 * 0.0095 - 100.0).collect();
        let mut e = xs.clone();
        exp_in_place(&mut e);
        let differ = xs.iter().zip(&e).filter(|(x, e)| x.exp() != **e).count();
        // Both round an accurate result once; they disagree (by one ulp) only on results within
        // a hair of a rounding boundary.
        assert!(
            differ <= xs.len() / 1000,
            "{differ} of {} differ from f32::exp",
            xs.len()
        );
        for (x, e) in xs.iter().zip(&e) {
            assert!(
                x.exp() == *e || (x.exp() - e).abs() <= x.exp() * 1.2e-7,
                "exp({x}) = {e}, libm {}",
                x.exp()
            );
        }
    }

    #[test]
    fn dot_handles_remainders() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        assert_eq!(dot(&a, &a), (0..37).map(|i| (i * i) as f32).sum::<f32>());
    }
}
