//! Float weights (F32, F16, BF16; rows of any length) against the unquantized f32 inputs.
//!
//! Weights keep the file's width (F16 and BF16 stay 2 bytes a value: decode reads half the
//! bytes an f32 copy would). Within a tile of 16 rows, column-major: element `k` of the 16 rows
//! is one 64-byte (f32) or 32-byte (16-bit) run, so one load (and, for 16-bit values, one
//! conversion) gives a column of the tile, multiplied into every token's 16 sums with a
//! broadcast of that token's input: an outer-product kernel, no horizontal sums. Each token keeps
//! four accumulators (columns `k mod 4`) so the fused multiply-adds are independent.

use half::f16;

use super::{AlignedBytes, QActs, ROW_TILE, TOKEN_TILE, TileOut};
use crate::quant::GgmlType;

/// How the values of a float matrix are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FloatFormat {
    F32,
    F16,
    BF16,
}

impl FloatFormat {
    /// The format that stores `ty` without loss.
    pub(super) fn of(ty: GgmlType) -> Option<FloatFormat> {
        match ty {
            GgmlType::F32 => Some(FloatFormat::F32),
            GgmlType::F16 => Some(FloatFormat::F16),
            GgmlType::BF16 => Some(FloatFormat::BF16),
            _ => None,
        }
    }

    fn bytes(self) -> usize {
        match self {
            FloatFormat::F32 => 4,
            FloatFormat::F16 | FloatFormat::BF16 => 2,
        }
    }
}

/// Packs the `rows` float rows that `row_of` gives (all of `f`'s type).
pub(super) fn pack<'a>(
    f: FloatFormat,
    rows: usize,
    cols: usize,
    row_of: impl Fn(usize) -> (GgmlType, &'a [u8]),
) -> AlignedBytes {
    let es = f.bytes();
    let mut buf = AlignedBytes::zeroed(rows.div_ceil(ROW_TILE) * cols * ROW_TILE * es);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (_, bytes) = row_of(r);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        for k in 0..cols {
            // Values keep their bytes: no rounding.
            let at = ((tile * cols + k) * ROW_TILE + lane) * es;
            out[at..at + es].copy_from_slice(&bytes[es * k..es * (k + 1)]);
        }
    }
    buf
}

/// Tile `tile` of 16-bit float rows (`f` is F16 or BF16) as an F32 tile of one tile's length in
/// `dst`: every value exactly, in the same column-major layout, so a kernel reading `dst` as tile
/// 0 of an F32 matrix makes the same products in the same order as on the 16-bit tile.
/// Prefill widens each tile once for all its tokens, where the kernel would otherwise convert
/// every column again for every four tokens.
pub(super) fn widen_tile(f: FloatFormat, p: &[u8], tile: usize, cols: usize, dst: &mut AlignedBytes) {
    assert!(f != FloatFormat::F32, "only 16-bit tiles are widened");
    let n = cols * ROW_TILE;
    let src = &p[tile * n * 2..(tile + 1) * n * 2];
    if dst.len != n * 4 {
        *dst = AlignedBytes::zeroed(n * 4);
    }
    let out = dst.as_mut_slice();
    match f {
        FloatFormat::F16 => {
            // A run of values at a time, converted in one call (F16C where the CPU has it).
            let mut halves = [f16::ZERO; 256];
            let mut wide = [0f32; 256];
            for (chunk, o) in src.chunks(512).zip(out.chunks_mut(1024)) {
                let m = chunk.len() / 2;
                for (h, b) in halves.iter_mut().zip(chunk.chunks_exact(2)) {
                    *h = f16::from_le_bytes([b[0], b[1]]);
                }
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&halves[..m], &mut wide[..m]);
                for (o, v) in o.chunks_exact_mut(4).zip(&wide[..m]) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        FloatFormat::BF16 | FloatFormat::F32 => {
            // A bf16 value is the high half of the f32 with the same bits.
            for (o, b) in out.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                o.copy_from_slice(&[0, 0, b[0], b[1]]);
            }
        }
    }
}

fn value(f: FloatFormat, p: &[u8], at: usize) -> f32 {
    match f {
        FloatFormat::F32 => f32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]),
        FloatFormat::F16 => f16::from_le_bytes([p[at], p[at + 1]]).to_f32(),
        FloatFormat::BF16 => half::bf16::from_le_bytes([p[at], p[at + 1]]).to_f32(),
    }
}

fn check_bounds(f: FloatFormat, p: &[u8], tile: usize, cols: usize, x: &QActs, tok: usize, nt: usize) {
    assert!((tile + 1) * cols * ROW_TILE * f.bytes() <= p.len() && (tok + nt) * cols <= x.x.len() && nt <= TOKEN_TILE);
}

/// The scalar reference for one float tile: the same four partial sums per row (columns
/// `k mod 4`) as the SIMD kernels, added in the same order.
#[allow(clippy::too_many_arguments)]
pub(super) fn scalar_tile(
    f: FloatFormat,
    p: &[u8],
    tile: usize,
    cols: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    out: &mut TileOut,
) {
    check_bounds(f, p, tile, cols, x, tok, nt);
    out.fill(0.0);
    let es = f.bytes();
    for lane in 0..ROW_TILE {
        for t in 0..nt {
            let xr = &x.x[(tok + t) * cols..(tok + t + 1) * cols];
            let mut acc = [0f32; 4];
            for (k, &xv) in xr.iter().enumerate() {
                let w = value(f, p, ((tile * cols + k) * ROW_TILE + lane) * es);
                acc[k % 4] = w.mul_add(xv, acc[k % 4]);
            }
            out[t * ROW_TILE + lane] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
    }
}

/// Calls `$f::<F, NT>` for float format `$fmt` (0: F32, 1: F16, 2: BF16).
#[cfg(target_arch = "x86_64")]
macro_rules! by_float_format {
    ($fmt:expr, $nt:expr, $f:ident($($arg:expr),*)) => {
        match $fmt {
            FloatFormat::F32 => by_tokens!($nt, $f[0]($($arg),*)),
            FloatFormat::F16 => by_tokens!($nt, $f[1]($($arg),*)),
            FloatFormat::BF16 => by_tokens!($nt, $f[2]($($arg),*)),
        }
    };
}

#[cfg(target_arch = "x86_64")]
// Token indices also address inputs and output rows, not just the accumulators.
#[allow(clippy::needless_range_loop)]
pub(super) mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// One float row tile against up to four tokens.
    ///
    /// # Safety
    /// The CPU must support avx512f (and the F16C conversions it implies).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(in crate::matmul) unsafe fn tile(
        f: FloatFormat,
        p: &[u8],
        tile: usize,
        cols: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        check_bounds(f, p, tile, cols, x, tok, nt);
        // SAFETY: bounds checked above; the CPU features are this function's own contract.
        unsafe { by_float_format!(f, nt, tokens(p, tile, cols, x, tok, out)) }
    }

    /// Column `k` of the tile at `base`, as 16 f32.
    ///
    /// # Safety
    /// `base` holds the tile's `cols` columns in format `F`; `k < cols`.
    #[inline(always)]
    unsafe fn column<const F: u8>(base: *const u8, k: usize) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            match F {
                0 => _mm512_loadu_ps(base.add(k * 64).cast()),
                1 => _mm512_cvtph_ps(_mm256_loadu_si256(base.add(k * 32).cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(base.add(k * 32).cast())),
                    16,
                )),
            }
        }
    }

    /// [`tile`] for one format and exactly `NT` tokens.
    ///
    /// # Safety
    /// As [`tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tokens<const F: u8, const NT: usize>(
        p: &[u8],
        tile: usize,
        cols: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let es = if F == 0 { 4 } else { 2 };
        let mut acc = [[_mm512_setzero_ps(); 4]; NT];
        // SAFETY (all pointer reads below): bounds checked by the caller; the tile is
        // `cols·16·es` bytes inside `p`, each token's `cols` inputs inside `x.x`.
        unsafe {
            let base = p.as_ptr().add(tile * cols * ROW_TILE * es);
            let xp: [*const f32; NT] = std::array::from_fn(|t| x.x.as_ptr().add((tok + t) * cols));
            // Four columns at a time so each accumulator's index is a constant (a computed one
            // would keep the accumulators in memory), then the last 0..3.
            let full = cols / 4 * 4;
            for k0 in (0..full).step_by(4) {
                for u in 0..4 {
                    let w = column::<F>(base, k0 + u);
                    for t in 0..NT {
                        acc[t][u] = _mm512_fmadd_ps(w, _mm512_set1_ps(*xp[t].add(k0 + u)), acc[t][u]);
                    }
                }
            }
            for u in 0..3 {
                if full + u < cols {
                    let w = column::<F>(base, full + u);
                    for t in 0..NT {
                        acc[t][u] = _mm512_fmadd_ps(w, _mm512_set1_ps(*xp[t].add(full + u)), acc[t][u]);
                    }
                }
            }
            for t in 0..NT {
                let s = _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3]));
                _mm512_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE), s);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Token indices also address inputs and output rows, not just the accumulators.
#[allow(clippy::needless_range_loop)]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// One float row tile against up to four tokens, eight rows (half a tile) at a time.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::matmul) unsafe fn tile(
        f: FloatFormat,
        p: &[u8],
        tile: usize,
        cols: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        check_bounds(f, p, tile, cols, x, tok, nt);
        // SAFETY: bounds checked above; the CPU features are this function's own contract.
        unsafe { by_float_format!(f, nt, tokens(p, tile, cols, x, tok, out)) }
    }

    /// Column `k` of the half tile at `base`, as 8 f32.
    ///
    /// # Safety
    /// As the AVX-512 `column`.
    #[inline(always)]
    unsafe fn column<const F: u8>(base: *const u8, k: usize) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            match F {
                0 => _mm256_loadu_ps(base.add(k * 64).cast()),
                1 => _mm256_cvtph_ps(_mm_loadu_si128(base.add(k * 32).cast())),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(base.add(k * 32).cast())),
                    16,
                )),
            }
        }
    }

    /// [`tile`] for one format and exactly `NT` tokens.
    ///
    /// # Safety
    /// As [`tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tokens<const F: u8, const NT: usize>(
        p: &[u8],
        tile: usize,
        cols: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let es = if F == 0 { 4 } else { 2 };
        for half in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 4]; NT];
            // SAFETY: as in the AVX-512 kernel; a half tile is the upper or lower half of each
            // column.
            unsafe {
                let base = p.as_ptr().add(tile * cols * ROW_TILE * es + half * 8 * es);
                let xp: [*const f32; NT] = std::array::from_fn(|t| x.x.as_ptr().add((tok + t) * cols));
                let full = cols / 4 * 4;
                for k0 in (0..full).step_by(4) {
                    for u in 0..4 {
                        let w = column::<F>(base, k0 + u);
                        for t in 0..NT {
                            acc[t][u] = _mm256_fmadd_ps(w, _mm256_set1_ps(*xp[t].add(k0 + u)), acc[t][u]);
                        }
                    }
                }
                for u in 0..3 {
                    if full + u < cols {
                        let w = column::<F>(base, full + u);
                        for t in 0..NT {
                            acc[t][u] = _mm256_fmadd_ps(w, _mm256_set1_ps(*xp[t].add(full + u)), acc[t][u]);
                        }
                    }
                }
                for t in 0..NT {
                    let s = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
                    _mm256_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE + half * 8), s);
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) mod avx2 {
    pub(in crate::matmul) use super::avx512::tile;
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) mod avx512 {
    use super::*;
    #[allow(clippy::too_many_arguments)]
    pub(in crate::matmul) unsafe fn tile(
        _: FloatFormat,
        _: &[u8],
        _: usize,
        _: usize,
        _: &QActs,
        _: usize,
        _: usize,
        _: &mut TileOut,
    ) {
        unreachable!("Kernel::Avx512Vnni is never selected off x86_64")
    }
}
