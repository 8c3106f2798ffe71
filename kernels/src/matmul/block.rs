//! 32-element block formats against per-32 activations (llama.cpp's Q8_1 form: values, scale,
//! and the values' sum).
//!
//! * Nibble blocks, [`NibbleFormat`]: Q4_0, Q4_1, Q5_0, Q5_1. Per tile block: 256 bytes of low
//!   nibbles (byte `g·64 + lane·4 + j` holds element `4g + j` low and `16 + 4g + j` high); for
//!   the Q5 types 64 bytes of fifth bits, eight 64-bit masks, mask `k`'s bit `lane·4 + j` being
//!   element `4k + j`'s (an AVX-512 masked add puts them in place); 16 f16 scales; for Q4_1 and
//!   Q5_1, 16 f16 minimums. So each type takes the bytes it has in the file. Values are unsigned;
//!   Q4_0 and Q5_0 subtract their offset (8, 16) as integers, `d_w·d_x·(Σ q_w q_x − off·Σ q_x)`,
//!   and Q4_1 and Q5_1 add their minimum, `d_w·d_x·Σ q_w q_x + m_w·(d_x Σ q_x)`: llama.cpp's
//!   formulas.
//! * Q8_0: per tile block, the values biased by 128 to unsigned bytes (byte `g·64 + lane·4 + j`
//!   is element `4g + j`) and 16 f16 scales, 34 bytes per 32 values as in the file:
//!   `d_w·d_x·(Σ (q_w + 128) q_x − 128·Σ q_x)`, the offset taken off as an integer from the
//!   activations' block sum (as for Q4_0), so no per-row sum is stored.

use half::f16;

use super::{AlignedBytes, QActs, ROW_TILE, TOKEN_TILE, TileOut};
use crate::quant::{GgmlType, Q5Block, QK};

/// The shape of a nibble block type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct NibbleFormat {
    /// A fifth bit per value (Q5_0, Q5_1).
    high: bool,
    /// A minimum per block (Q4_1, Q5_1); otherwise the values are offset by `off`.
    min: bool,
    /// Offset subtracted from every value: 8 (Q4_0), 16 (Q5_0), or 0.
    off: i32,
}

impl NibbleFormat {
    /// The format of `ty`, if it is a nibble block type.
    pub(super) fn of(ty: GgmlType) -> Option<NibbleFormat> {
        let (high, min, off) = match ty {
            GgmlType::Q4_0 => (false, false, 8),
            GgmlType::Q4_1 => (false, true, 0),
            GgmlType::Q5_0 => (true, false, 16),
            GgmlType::Q5_1 => (true, true, 0),
            _ => return None,
        };
        Some(NibbleFormat { high, min, off })
    }

    fn d_at(self) -> usize {
        256 + if self.high { 64 } else { 0 }
    }

    /// Bytes per tile block.
    fn block_bytes(self) -> usize {
        self.d_at() + 32 + if self.min { 32 } else { 0 }
    }
}

/// Bytes of a Q8 tile block: biased values, 16 f16 scales.
const Q8_TILE_BLOCK_BYTES: usize = 512 + 32;

/// Where a Q8 tile block's scales start.
const Q8_D_AT: usize = 512;

/// A 32-element block's unsigned values, scale and minimum (zero for the offset types).
fn nibble_block(ty: GgmlType, b: &[u8]) -> ([u8; QK], f16, f16) {
    match ty {
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let q5 = Q5Block::unpack(ty, b);
            (q5.q, q5.d, q5.m.unwrap_or(f16::ZERO))
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (m, qs) = if ty == GgmlType::Q4_1 {
                (f16::from_le_bytes([b[2], b[3]]), &b[4..20])
            } else {
                (f16::ZERO, &b[2..18])
            };
            let q = std::array::from_fn(|i| if i < 16 { qs[i] & 0x0f } else { qs[i - 16] >> 4 });
            (q, f16::from_le_bytes([b[0], b[1]]), m)
        }
        _ => unreachable!("{ty} is not a nibble block type"),
    }
}

/// Packs rows of one nibble block type.
pub(super) fn pack_nibbles<'a>(
    f: NibbleFormat,
    rows: usize,
    cols: usize,
    row_of: impl Fn(usize) -> (GgmlType, &'a [u8]),
) -> AlignedBytes {
    let nb = cols / QK;
    let bb = f.block_bytes();
    let mut buf = AlignedBytes::zeroed(rows.div_ceil(ROW_TILE) * nb * bb);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (ty, bytes) = row_of(r);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        let tb = ty.block_bytes();
        for b in 0..nb {
            let (q, d, m) = nibble_block(ty, &bytes[b * tb..(b + 1) * tb]);
            let base = (tile * nb + b) * bb;
            for g in 0..4 {
                for j in 0..4 {
                    out[base + g * 64 + lane * 4 + j] = (q[4 * g + j] & 0x0f) | ((q[16 + 4 * g + j] & 0x0f) << 4);
                }
            }
            if f.high {
                for (i, &v) in q.iter().enumerate() {
                    let (k, j) = (i / 4, i % 4);
                    let bit = lane * 4 + j;
                    out[base + 256 + 8 * k + bit / 8] |= ((v >> 4) & 1) << (bit % 8);
                }
            }
            out[base + f.d_at() + lane * 2..][..2].copy_from_slice(&d.to_le_bytes());
            if f.min {
                out[base + f.d_at() + 32 + lane * 2..][..2].copy_from_slice(&m.to_le_bytes());
            }
        }
    }
    buf
}

/// Packs Q8_0 rows.
pub(super) fn pack_q8<'a>(rows: usize, cols: usize, row_of: impl Fn(usize) -> (GgmlType, &'a [u8])) -> AlignedBytes {
    let nb = cols / QK;
    let mut buf = AlignedBytes::zeroed(rows.div_ceil(ROW_TILE) * nb * Q8_TILE_BLOCK_BYTES);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (ty, bytes) = row_of(r);
        debug_assert_eq!(ty, GgmlType::Q8_0);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        for b in 0..nb {
            let blk = &bytes[b * 34..(b + 1) * 34];
            let base = (tile * nb + b) * Q8_TILE_BLOCK_BYTES;
            for (i, &q) in blk[2..34].iter().enumerate() {
                // Flipping the sign bit adds 128: -128..=127 becomes 0..=255.
                out[base + (i / 4) * 64 + lane * 4 + i % 4] = q ^ 0x80;
            }
            out[base + Q8_D_AT + lane * 2..][..2].copy_from_slice(&blk[0..2]);
        }
    }
    buf
}

/// The scalar reference for a nibble tile.
#[allow(clippy::too_many_arguments)]
pub(super) fn scalar_nibble_tile(
    f: NibbleFormat,
    p: &[u8],
    tile: usize,
    nb: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    out: &mut TileOut,
) {
    out.fill(0.0);
    let bb = f.block_bytes();
    let f16_at = |at: usize| f16::from_le_bytes([p[at], p[at + 1]]).to_f32();
    for b in 0..nb {
        let base = (tile * nb + b) * bb;
        for lane in 0..ROW_TILE {
            let value = |i: usize| -> i32 {
                let byte = p[base + ((i % 16) / 4) * 64 + lane * 4 + i % 4];
                let low = if i < 16 { byte & 0x0f } else { byte >> 4 };
                let bit = lane * 4 + i % 4;
                let high = if f.high {
                    (p[base + 256 + 8 * (i / 4) + bit / 8] >> (bit % 8)) & 1
                } else {
                    0
                };
                (low | (high << 4)) as i32
            };
            let d = f16_at(base + f.d_at() + lane * 2);
            for t in 0..nt {
                let xb = (tok + t) * nb + b;
                let xq = &x.q[xb * QK..(xb + 1) * QK];
                let mut isum: i32 = (0..QK).map(|i| value(i) * xq[i] as i32).sum();
                isum -= f.off * x.bs[xb] as i32;
                let mut v = isum as f32 * (d * x.d[xb]);
                if f.min {
                    v += f16_at(base + f.d_at() + 32 + lane * 2) * x.s[xb];
                }
                out[t * ROW_TILE + lane] += v;
            }
        }
    }
}

/// The scalar reference for a Q8 tile.
pub(super) fn scalar_q8_tile(p: &[u8], tile: usize, nb: usize, x: &QActs, tok: usize, nt: usize, out: &mut TileOut) {
    out.fill(0.0);
    for b in 0..nb {
        let base = (tile * nb + b) * Q8_TILE_BLOCK_BYTES;
        for lane in 0..ROW_TILE {
            let at = base + Q8_D_AT + lane * 2;
            let d = f16::from_le_bytes([p[at], p[at + 1]]).to_f32();
            for t in 0..nt {
                let xb = (tok + t) * nb + b;
                let xq = &x.q[xb * QK..(xb + 1) * QK];
                let mut isum = 0i32;
                for g in 0..8 {
                    for j in 0..4 {
                        isum += p[base + g * 64 + lane * 4 + j] as i32 * xq[g * 4 + j] as i32;
                    }
                }
                isum -= 128 * x.bs[xb] as i32;
                out[t * ROW_TILE + lane] += isum as f32 * (d * x.d[xb]);
            }
        }
    }
}

fn check_bounds(block_bytes: usize, p: &[u8], tile: usize, nb: usize, x: &QActs, tok: usize, nt: usize) {
    assert!(
        (tile * nb + nb) * block_bytes <= p.len()
            && (tok + nt) * nb * QK <= x.q.len()
            && (tok + nt) * nb <= x.bs.len().min(x.d.len()).min(x.s.len())
            && nt <= TOKEN_TILE
    );
}

/// Calls `$f::<HIGH, MIN, OFF, NT>` for nibble format `$fmt`.
#[cfg(target_arch = "x86_64")]
macro_rules! by_nibble_format {
    ($fmt:expr, $nt:expr, $f:ident($($arg:expr),*)) => {
        match ($fmt.high, $fmt.min, $fmt.off) {
            (false, false, 8) => by_tokens!($nt, $f[false, false, 8]($($arg),*)),
            (false, true, 0) => by_tokens!($nt, $f[false, true, 0]($($arg),*)),
            (true, false, 16) => by_tokens!($nt, $f[true, false, 16]($($arg),*)),
            (true, true, 0) => by_tokens!($nt, $f[true, true, 0]($($arg),*)),
            other => unreachable!("no nibble format {other:?}"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
// Token indices also address activation blocks and output rows, not just `acc`.
#[allow(clippy::needless_range_loop)]
pub(super) mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// One nibble row tile against up to four tokens.
    ///
    /// # Safety
    /// The CPU must support avx512f, avx512bw and avx512vnni.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(in crate::matmul) unsafe fn nibble_tile(
        f: NibbleFormat,
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        check_bounds(f.block_bytes(), p, tile, nb, x, tok, nt);
        // SAFETY: bounds checked above; the CPU features are this function's own contract.
        unsafe { by_nibble_format!(f, nt, nibble_tokens(f, p, tile, nb, x, tok, out)) }
    }

    /// [`nibble_tile`] for one format and exactly `NT` tokens.
    ///
    /// # Safety
    /// As [`nibble_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn nibble_tokens<const HIGH: bool, const MIN: bool, const OFF: i32, const NT: usize>(
        f: NibbleFormat,
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let mask = _mm512_set1_epi8(0x0f);
        let sixteen = _mm512_set1_epi8(16);
        let mut acc = [_mm512_setzero_ps(); NT];
        let xq = x.q.as_ptr();
        let bb = f.block_bytes();
        for b in 0..nb {
            // SAFETY (all pointer reads below): bounds checked by the caller; each block is
            // `bb` bytes inside `p`, each activation block QK bytes inside `x.q`.
            unsafe {
                let base = p.as_ptr().add((tile * nb + b) * bb);
                // Operand `k` holds elements 4k..4k+4 of every row.
                let mut w = [_mm512_setzero_si512(); 8];
                for g in 0..4 {
                    let v = _mm512_loadu_si512(base.add(g * 64).cast());
                    w[g] = _mm512_and_si512(v, mask);
                    w[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                }
                if HIGH {
                    for k in 0..8 {
                        let bits: __mmask64 = base.add(256 + 8 * k).cast::<u64>().read_unaligned();
                        w[k] = _mm512_mask_add_epi8(w[k], bits, w[k], sixteen);
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(f.d_at()).cast()));
                for t in 0..NT {
                    let xb = (tok + t) * nb + b;
                    let xp = xq.add(xb * QK).cast::<i32>();
                    let mut s = _mm512_setzero_si512();
                    for (k, &wk) in w.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, wk, _mm512_set1_epi32(xp.add(k).read_unaligned()));
                    }
                    if OFF != 0 {
                        let bs = *x.bs.get_unchecked(xb) as i32;
                        s = _mm512_sub_epi32(s, _mm512_set1_epi32(OFF * bs));
                    }
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*x.d.get_unchecked(xb)));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[t]);
                    if MIN {
                        let mw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(f.d_at() + 32).cast()));
                        acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*x.s.get_unchecked(xb)), acc[t]);
                    }
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
    /// As [`nibble_tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(in crate::matmul) unsafe fn q8_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        check_bounds(Q8_TILE_BLOCK_BYTES, p, tile, nb, x, tok, nt);
        // SAFETY: bounds checked above; the CPU features are this function's own contract.
        unsafe { by_tokens!(nt, q8_tokens(p, tile, nb, x, tok, out)) }
    }

    /// [`q8_tile`] for exactly `NT` tokens. `vpdpbusd` multiplies unsigned by signed bytes: the
    /// weights are stored biased to unsigned, and `128·Σ q_x` comes back off as an integer.
    ///
    /// # Safety
    /// As [`q8_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q8_tokens<const NT: usize>(p: &[u8], tile: usize, nb: usize, x: &QActs, tok: usize, out: &mut TileOut) {
        let mut acc = [_mm512_setzero_ps(); NT];
        let xq = x.q.as_ptr();
        for b in 0..nb {
            // SAFETY: as in `nibble_tokens`.
            unsafe {
                let base = p.as_ptr().add((tile * nb + b) * Q8_TILE_BLOCK_BYTES);
                let mut w = [_mm512_setzero_si512(); 8];
                for (g, wg) in w.iter_mut().enumerate() {
                    *wg = _mm512_loadu_si512(base.add(g * 64).cast());
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(Q8_D_AT).cast()));
                for t in 0..NT {
                    let xb = (tok + t) * nb + b;
                    let xp = xq.add(xb * QK).cast::<i32>();
                    let mut s = _mm512_setzero_si512();
                    for (g, &wg) in w.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, wg, _mm512_set1_epi32(xp.add(g).read_unaligned()));
                    }
                    let bs = *x.bs.get_unchecked(xb) as i32;
                    let s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * bs));
                    let dx = _mm512_set1_ps(*x.d.get_unchecked(xb));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[t]);
                }
            }
        }
        for t in 0..NT {
            // SAFETY: as in `nibble_tokens`.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE), acc[t]) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Token indices also address activation blocks and output rows, not just `acc`.
#[allow(clippy::needless_range_loop)]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Widens pairwise i16 sums (from `vpmaddubsw`) to i32 sums of each 32-bit lane.
    macro_rules! widen {
        ($s16:expr) => {
            _mm256_madd_epi16($s16, _mm256_set1_epi16(1))
        };
    }

    /// One nibble row tile against up to four tokens, eight rows (one half tile) at a time.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::matmul) unsafe fn nibble_tile(
        f: NibbleFormat,
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        check_bounds(f.block_bytes(), p, tile, nb, x, tok, nt);
        // SAFETY: bounds checked above; the CPU features are this function's own contract.
        unsafe { by_nibble_format!(f, nt, nibble_tokens(f, p, tile, nb, x, tok, out)) }
    }

    /// Sixteen in each byte whose bit is set in `bits` (bit `i` for byte `i`), else zero.
    ///
    /// # Safety
    /// The CPU must support avx2.
    #[target_feature(enable = "avx2")]
    unsafe fn high_bits(bits: u32) -> __m256i {
        // Byte i takes source byte i/8 (pshufb indexes within each 128-bit half, and the
        // broadcast puts the same four bytes in both), then tests its own bit.
        let v = _mm256_set1_epi32(bits as i32);
        let idx = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, idx), sel), sel);
        _mm256_and_si256(set, _mm256_set1_epi8(16))
    }

    /// [`nibble_tile`] for one format and exactly `NT` tokens. The eight pair sums per lane
    /// (`vpmaddubsw`, values up to 31) reach 2·31·127 = 7 874 each, so they widen to i32 after
    /// every two.
    ///
    /// # Safety
    /// As [`nibble_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibble_tokens<const HIGH: bool, const MIN: bool, const OFF: i32, const NT: usize>(
        f: NibbleFormat,
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let mask = _mm256_set1_epi8(0x0f);
        let xq = x.q.as_ptr();
        let bb = f.block_bytes();
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); NT];
            for b in 0..nb {
                // SAFETY (all pointer reads below): bounds checked by the caller; each block is
                // `bb` bytes inside `p`, each activation block QK bytes inside `x.q`.
                unsafe {
                    let base = p.as_ptr().add((tile * nb + b) * bb);
                    let xp: [*const i32; NT] = std::array::from_fn(|t| xq.add(((tok + t) * nb + b) * QK).cast());
                    let mut s = [_mm256_setzero_si256(); NT];
                    for g in 0..4 {
                        let v = _mm256_loadu_si256(base.add(g * 64 + half * 32).cast());
                        let mut lo = _mm256_and_si256(v, mask);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                        if HIGH {
                            // This half's lanes are bits 32·half.. of each mask.
                            let m = |k: usize| base.add(256 + 8 * k + 4 * half).cast::<u32>().read_unaligned();
                            lo = _mm256_or_si256(lo, high_bits(m(g)));
                            hi = _mm256_or_si256(hi, high_bits(m(4 + g)));
                        }
                        for t in 0..NT {
                            let xl = _mm256_set1_epi32(xp[t].add(g).read_unaligned());
                            let xh = _mm256_set1_epi32(xp[t].add(4 + g).read_unaligned());
                            let s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                            s[t] = _mm256_add_epi32(s[t], widen!(s16));
                        }
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(f.d_at() + half * 16).cast()));
                    for t in 0..NT {
                        let xb = (tok + t) * nb + b;
                        if OFF != 0 {
                            let bs = *x.bs.get_unchecked(xb) as i32;
                            s[t] = _mm256_sub_epi32(s[t], _mm256_set1_epi32(OFF * bs));
                        }
                        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(xb)));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), scale, acc[t]);
                        if MIN {
                            let mw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(f.d_at() + 32 + half * 16).cast()));
                            acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*x.s.get_unchecked(xb)), acc[t]);
                        }
                    }
                }
            }
            for t in 0..NT {
                // SAFETY: `out` holds TOKEN_TILE·ROW_TILE floats; t < NT ≤ TOKEN_TILE, half < 2.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE + half * 8), acc[t]) };
            }
        }
    }

    /// One Q8 row tile against up to four tokens, eight rows at a time. The stored bias comes
    /// off first (`vpmaddubsw` pair sums of `(q_w + 128)·q_x` could reach 2·255·127 and
    /// saturate i16); signed × signed products then use `|w| · sign(x, w)`: `|w|` ≤ 128 is exact
    /// as an unsigned byte (even for w = −128), and the pair sums (at most 2·128·127) fit i16.
    ///
    /// # Safety
    /// As [`nibble_tile`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::matmul) unsafe fn q8_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        check_bounds(Q8_TILE_BLOCK_BYTES, p, tile, nb, x, tok, nt);
        // SAFETY: bounds checked above; the CPU features are this function's own contract.
        unsafe { by_tokens!(nt, q8_tokens(p, tile, nb, x, tok, out)) }
    }

    /// [`q8_tile`] for exactly `NT` tokens, one 64-byte weight group at a time.
    ///
    /// # Safety
    /// As [`q8_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_tokens<const NT: usize>(p: &[u8], tile: usize, nb: usize, x: &QActs, tok: usize, out: &mut TileOut) {
        let xq = x.q.as_ptr();
        let flip = _mm256_set1_epi8(-128);
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); NT];
            for b in 0..nb {
                // SAFETY: as in `nibble_tokens`.
                unsafe {
                    let base = p.as_ptr().add((tile * nb + b) * Q8_TILE_BLOCK_BYTES);
                    let xp: [*const i32; NT] = std::array::from_fn(|t| xq.add(((tok + t) * nb + b) * QK).cast());
                    let mut s = [_mm256_setzero_si256(); NT];
                    for g in 0..8 {
                        let w = _mm256_xor_si256(_mm256_loadu_si256(base.add(g * 64 + half * 32).cast()), flip);
                        let wabs = _mm256_abs_epi8(w);
                        for t in 0..NT {
                            let xv = _mm256_set1_epi32(xp[t].add(g).read_unaligned());
                            let prod = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w));
                            s[t] = _mm256_add_epi32(s[t], widen!(prod));
                        }
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(Q8_D_AT + half * 16).cast()));
                    for t in 0..NT {
                        let dx = _mm256_set1_ps(*x.d.get_unchecked((tok + t) * nb + b));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), _mm256_mul_ps(dw, dx), acc[t]);
                    }
                }
            }
            for t in 0..NT {
                // SAFETY: as in `nibble_tokens`.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE + half * 8), acc[t]) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) mod avx2 {
    pub(in crate::matmul) use super::avx512::{nibble_tile, q8_tile};
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) mod avx512 {
    use super::*;
    #[allow(clippy::too_many_arguments)]
    pub(in crate::matmul) unsafe fn nibble_tile(
        _: NibbleFormat,
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
    pub(in crate::matmul) unsafe fn q8_tile(
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
