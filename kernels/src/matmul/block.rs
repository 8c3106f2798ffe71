//! 32-element block formats against per-32 activations (llama.cpp's Q8_1 form).
//!
//! * Q4 (Q4_0, Q4_1 as nibbles; Q5_1 "wide", as bytes): per tile block, the values (`g·64 +
//!   lane·4 + j`: nibbles hold elements `4g + j` low and `16 + 4g + j` high, or bytes element
//!   `4g + j`), then 16 f16 scales and 16 f16 minimums. Q4_0 is `d·(q−8)` = `d·q + (−8d)`: a
//!   Q4_1 block with minimum −8d, exactly (scaling an f16 by a power of two is exact short of
//!   overflow).
//! * Q8 (Q8_0; Q5_0 as its values less 16, which fit a signed byte): per tile block, the values
//!   (byte `g·64 + lane·4 + j` is element `4g + j`), 16 f32 scales, and 16 f32 corrections
//!   `−128·d·Σq` for the kernels that bias the activations to unsigned bytes.

use half::f16;

use super::{AlignedBytes, QActs, ROW_TILE, TOKEN_TILE, TileOut};
use crate::quant::{GgmlType, Q5Block, QK};

/// Bytes of a Q4 tile block's values: nibbles, or bytes when `wide`.
const fn q4_values(wide: bool) -> usize {
    if wide { 512 } else { 256 }
}

/// Bytes of a Q4 tile block: values, then 16 f16 scales and 16 f16 minimums.
const fn q4_block_bytes(wide: bool) -> usize {
    q4_values(wide) + 32 + 32
}

/// Bytes of a Q8 tile block: values, 16 f32 scales, 16 f32 corrections.
const Q8_TILE_BLOCK_BYTES: usize = 512 + 64 + 64;

/// Packs Q4_0 and Q4_1 rows (nibbles) or, `wide`, Q5_1 rows (bytes).
pub(super) fn pack_q4<'a>(
    wide: bool,
    rows: usize,
    cols: usize,
    row_of: impl Fn(usize) -> (GgmlType, &'a [u8]),
) -> AlignedBytes {
    let nb = cols / QK;
    let tiles = rows.div_ceil(ROW_TILE);
    let bb = q4_block_bytes(wide);
    let vals = q4_values(wide);
    let mut buf = AlignedBytes::zeroed(tiles * nb * bb);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (ty, bytes) = row_of(r);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        let tb = ty.block_bytes();
        for b in 0..nb {
            let blk = &bytes[b * tb..(b + 1) * tb];
            let base = (tile * nb + b) * bb;
            let (d, m) = match ty {
                GgmlType::Q5_1 => {
                    let q5 = Q5Block::unpack(ty, blk);
                    for g in 0..8 {
                        out[base + g * 64 + lane * 4..][..4].copy_from_slice(&q5.q[g * 4..g * 4 + 4]);
                    }
                    (q5.d, q5.m.unwrap_or(f16::ZERO))
                }
                GgmlType::Q4_1 | GgmlType::Q4_0 => {
                    let d = f16::from_le_bytes([blk[0], blk[1]]);
                    let (m, qs) = if ty == GgmlType::Q4_1 {
                        (f16::from_le_bytes([blk[2], blk[3]]), &blk[4..20])
                    } else {
                        (f16::from_f32(-8.0 * d.to_f32()), &blk[2..18])
                    };
                    for g in 0..4 {
                        out[base + g * 64 + lane * 4..][..4].copy_from_slice(&qs[g * 4..g * 4 + 4]);
                    }
                    (d, m)
                }
                _ => unreachable!("only Q4_0, Q4_1 and Q5_1 rows are packed as Q4"),
            };
            out[base + vals + lane * 2..][..2].copy_from_slice(&d.to_le_bytes());
            out[base + vals + 32 + lane * 2..][..2].copy_from_slice(&m.to_le_bytes());
        }
    }
    buf
}

/// Packs Q8_0 and Q5_0 rows.
pub(super) fn pack_q8<'a>(rows: usize, cols: usize, row_of: impl Fn(usize) -> (GgmlType, &'a [u8])) -> AlignedBytes {
    let nb = cols / QK;
    let tiles = rows.div_ceil(ROW_TILE);
    let mut buf = AlignedBytes::zeroed(tiles * nb * Q8_TILE_BLOCK_BYTES);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (ty, bytes) = row_of(r);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        let tb = ty.block_bytes();
        for b in 0..nb {
            let blk = &bytes[b * tb..(b + 1) * tb];
            let (d, qs) = match ty {
                GgmlType::Q8_0 => (
                    f16::from_le_bytes([blk[0], blk[1]]),
                    std::array::from_fn(|j| blk[2 + j]),
                ),
                GgmlType::Q5_0 => {
                    let q5 = Q5Block::unpack(ty, blk);
                    (q5.d, q5.q.map(|q| (q as i8 - 16) as u8))
                }
                _ => unreachable!("only Q8_0 and Q5_0 rows are packed as Q8"),
            };
            let qs: [u8; QK] = qs;
            let d = d.to_f32();
            let sum: i32 = qs.iter().map(|&q| q as i8 as i32).sum();
            let base = (tile * nb + b) * Q8_TILE_BLOCK_BYTES;
            for g in 0..8 {
                out[base + g * 64 + lane * 4..][..4].copy_from_slice(&qs[g * 4..g * 4 + 4]);
            }
            out[base + 512 + lane * 4..][..4].copy_from_slice(&d.to_le_bytes());
            out[base + 576 + lane * 4..][..4].copy_from_slice(&(-128.0 * d * sum as f32).to_le_bytes());
        }
    }
    buf
}

/// The scalar reference for a Q4 tile.
#[allow(clippy::too_many_arguments)]
pub(super) fn scalar_q4_tile(
    wide: bool,
    p: &[u8],
    tile: usize,
    nb: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    out: &mut TileOut,
) {
    out.fill(0.0);
    let (bb, vals) = (q4_block_bytes(wide), q4_values(wide));
    for b in 0..nb {
        let base = (tile * nb + b) * bb;
        for lane in 0..ROW_TILE {
            let f = |at: usize| f16::from_le_bytes([p[at], p[at + 1]]).to_f32();
            let d = f(base + vals + lane * 2);
            let m = f(base + vals + 32 + lane * 2);
            for t in 0..nt {
                let xb = (tok + t) * nb + b;
                let xq = &x.q[xb * QK..(xb + 1) * QK];
                let mut isum = 0i32;
                if wide {
                    for g in 0..8 {
                        for j in 0..4 {
                            isum += p[base + g * 64 + lane * 4 + j] as i32 * xq[g * 4 + j] as i32;
                        }
                    }
                } else {
                    for g in 0..4 {
                        for j in 0..4 {
                            let byte = p[base + g * 64 + lane * 4 + j];
                            isum += (byte & 0x0f) as i32 * xq[g * 4 + j] as i32;
                            isum += (byte >> 4) as i32 * xq[16 + g * 4 + j] as i32;
                        }
                    }
                }
                out[t * ROW_TILE + lane] += isum as f32 * (d * x.d[xb]) + m * x.s[xb];
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

#[cfg(target_arch = "x86_64")]
// Token indices also address activation blocks and output rows, not just `acc`.
#[allow(clippy::needless_range_loop)]
pub(super) mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// One Q4 row tile against up to four tokens.
    ///
    /// # Safety
    /// The CPU must support avx512f, avx512bw and avx512vnni; `p` must hold the packed tile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    pub(in crate::matmul) unsafe fn q4_tile(
        wide: bool,
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        assert!(
            (tile * nb + nb) * q4_block_bytes(wide) <= p.len() && (tok + nt) * nb * QK <= x.q.len() && nt <= TOKEN_TILE
        );
        // SAFETY: bounds asserted above; the CPU features are this function's own contract.
        unsafe {
            if wide {
                by_tokens!(nt, q4_tokens[true](p, tile, nb, x, tok, out))
            } else {
                by_tokens!(nt, q4_tokens[false](p, tile, nb, x, tok, out))
            }
        }
    }

    /// [`q4_tile`] for exactly `NT` tokens.
    ///
    /// # Safety
    /// As [`q4_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q4_tokens<const WIDE: bool, const NT: usize>(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); NT];
        let xq = x.q.as_ptr();
        let (bb, vals) = (q4_block_bytes(WIDE), q4_values(WIDE));
        for b in 0..nb {
            // SAFETY (all pointer reads below): bounds checked by the caller; each block is
            // `bb` bytes inside `p`, each activation block QK bytes inside `x.q`.
            unsafe {
                let base = p.as_ptr().add((tile * nb + b) * bb);
                // Operand `g` holds elements 4g..4g+4 of every row.
                let mut w = [_mm512_setzero_si512(); 8];
                for g in 0..4 {
                    if WIDE {
                        w[g] = _mm512_loadu_si512(base.add(g * 64).cast());
                        w[4 + g] = _mm512_loadu_si512(base.add(256 + g * 64).cast());
                    } else {
                        let v = _mm512_loadu_si512(base.add(g * 64).cast());
                        w[g] = _mm512_and_si512(v, mask);
                        w[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(vals).cast()));
                let mw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(vals + 32).cast()));
                for t in 0..NT {
                    let xb = (tok + t) * nb + b;
                    let xp = xq.add(xb * QK).cast::<i32>();
                    let mut s = _mm512_setzero_si512();
                    for (g, &wg) in w.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, wg, _mm512_set1_epi32(xp.add(g).read_unaligned()));
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
    pub(in crate::matmul) unsafe fn q8_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
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
    unsafe fn q8_tokens<const NT: usize>(p: &[u8], tile: usize, nb: usize, x: &QActs, tok: usize, out: &mut TileOut) {
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
pub(super) mod avx2 {
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
    #[allow(clippy::too_many_arguments)]
    pub(in crate::matmul) unsafe fn q4_tile(
        wide: bool,
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
    ) {
        assert!(
            (tile * nb + nb) * q4_block_bytes(wide) <= p.len() && (tok + nt) * nb * QK <= x.q.len() && nt <= TOKEN_TILE
        );
        // SAFETY: bounds asserted above; the CPU features are this function's own contract.
        unsafe {
            if wide {
                by_tokens!(nt, q4_tokens[true](p, tile, nb, x, tok, out))
            } else {
                by_tokens!(nt, q4_tokens[false](p, tile, nb, x, tok, out))
            }
        }
    }

    /// [`q4_tile`] for exactly `NT` tokens. Each 64-byte group of nibbles is unpacked once and
    /// used for every token before the next is loaded, so only the `2·NT` accumulators and one
    /// group's two registers are live (sixteen ymm registers hold all of it for `NT` = 4).
    ///
    /// # Safety
    /// As [`q4_tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_tokens<const WIDE: bool, const NT: usize>(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let mask = _mm256_set1_epi8(0x0f);
        let xq = x.q.as_ptr();
        let (bb, vals) = (q4_block_bytes(WIDE), q4_values(WIDE));
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); NT];
            for b in 0..nb {
                // SAFETY (all pointer reads below): bounds checked by the caller; each block is
                // `bb` bytes inside `p`, each activation block QK bytes inside `x.q`.
                unsafe {
                    let base = p.as_ptr().add((tile * nb + b) * bb);
                    let xp: [*const i32; NT] = std::array::from_fn(|t| xq.add(((tok + t) * nb + b) * QK).cast());
                    // Nibbles: eight pair sums of at most 2·15·127 per lane, at most 30 480.
                    // Bytes (up to 31): pair sums reach 7 874, so they widen after each group.
                    let mut s = [_mm256_setzero_si256(); NT];
                    let mut s16 = [_mm256_setzero_si256(); NT];
                    for g in 0..4 {
                        let (lo, hi) = if WIDE {
                            (
                                _mm256_loadu_si256(base.add(g * 64 + half * 32).cast()),
                                _mm256_loadu_si256(base.add(256 + g * 64 + half * 32).cast()),
                            )
                        } else {
                            let v = _mm256_loadu_si256(base.add(g * 64 + half * 32).cast());
                            (
                                _mm256_and_si256(v, mask),
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                            )
                        };
                        for t in 0..NT {
                            let xl = _mm256_set1_epi32(xp[t].add(g).read_unaligned());
                            let xh = _mm256_set1_epi32(xp[t].add(4 + g).read_unaligned());
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(lo, xl));
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(hi, xh));
                            if WIDE {
                                s[t] = _mm256_add_epi32(s[t], widen!(s16[t]));
                                s16[t] = _mm256_setzero_si256();
                            }
                        }
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(vals + half * 16).cast()));
                    let mw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(vals + 32 + half * 16).cast()));
                    for t in 0..NT {
                        let xb = (tok + t) * nb + b;
                        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(xb)));
                        let isum = if WIDE { s[t] } else { widen!(s16[t]) };
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[t]);
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
    pub(in crate::matmul) unsafe fn q8_tile(
        p: &[u8],
        tile: usize,
        nb: usize,
        x: &QActs,
        tok: usize,
        nt: usize,
        out: &mut TileOut,
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
    unsafe fn q8_tokens<const NT: usize>(p: &[u8], tile: usize, nb: usize, x: &QActs, tok: usize, out: &mut TileOut) {
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
pub(super) mod avx2 {
    pub(in crate::matmul) use super::avx512::{q4_tile, q8_tile};
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) mod avx512 {
    use super::*;
    #[allow(clippy::too_many_arguments)]
    pub(in crate::matmul) unsafe fn q4_tile(
        _: bool,
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
