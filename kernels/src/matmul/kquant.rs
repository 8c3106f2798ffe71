//! K-quant super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) against per-256 activations (llama.cpp's
//! Q8_K).
//!
//! Every K type is repacked from [`KBlock`]'s single form — element `i` of sub-block `j` is
//! `(d·sc[j])·(q[i] − off) − dmin·m[j]` — so one kernel per instruction set serves all five, its
//! shape fixed by a few constants ([`Format`]). For one row and one super-block it computes, as
//! llama.cpp's `ggml_vec_dot_qX_K_q8_K` do:
//!
//! ```text
//! isum = Σ_j sc[j] · (Σ_{i∈j} q[i]·x[i] − off·Σ_{i∈j} x[i])      (integers)
//! msum = Σ_j m[j] · Σ_{i∈j} x[i]                                  (integers)
//! out += (d·d_x)·isum − (dmin·d_x)·msum
//! ```
//!
//! Tile layout for 16 rows and one super-block, at byte offsets [`Format`] computes:
//! * values, 32 elements (a chunk) at a time: as nibbles (Q2_K, Q3_K, Q4_K; 256 bytes a chunk,
//!   byte `g·64 + lane·4 + j` holding element `4g + j` low and `16 + 4g + j` high) or as bytes
//!   (Q5_K, Q6_K; 512 bytes a chunk, byte `g·64 + lane·4 + j` is element `4g + j`); either way a
//!   chunk unpacks to eight operands, operand `k` holding elements `4k..4k+4` of every row;
//! * scales: one signed byte per row per sub-block, sub-block-major (16 bytes each);
//! * minimums (Q2_K, Q4_K, Q5_K): one i16 per row per sub-block, in pairs of sub-blocks (64 bytes
//!   a pair, lane `r` holding both of row `r`'s), as `vpdpwssd` reads them;
//! * `d`, then (with minimums) `dmin`: 16 f32 each.
//!
//! Every sum fits i32: a sub-block's `|Σ q·x − off·Σx|` is at most 32·31·127 (Q5_K) or
//! 16·63·127 + 32·16·127 (Q6_K), under 2^18; times a scale of at most 128, over 16 sub-blocks,
//! under 2^29.

use super::{AlignedBytes, QActs, ROW_TILE, TOKEN_TILE, TileOut};
use crate::quant::{GgmlType, KBlock, QK_K};

/// How one K type is packed and computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Format {
    /// Values stored as nibbles (at most 4 bits) rather than bytes.
    nibbles: bool,
    /// Elements per sub-block: 16 or 32.
    sub: usize,
    /// Whether the type has minimums.
    mins: bool,
    /// Offset subtracted from every value.
    off: i32,
}

impl Format {
    /// The format of K type `ty`.
    ///
    /// # Panics
    /// If `ty` is not a K-quant type.
    pub(super) fn of(ty: GgmlType) -> Format {
        let (nibbles, sub, mins, off) = match ty {
            GgmlType::Q2_K => (true, 16, true, 0),
            GgmlType::Q3_K => (true, 16, false, 4),
            GgmlType::Q4_K => (true, 32, true, 0),
            GgmlType::Q5_K => (false, 32, true, 0),
            GgmlType::Q6_K => (false, 16, false, 32),
            _ => panic!("{ty} is not a K-quant type"),
        };
        Format {
            nibbles,
            sub,
            mins,
            off,
        }
    }

    fn nsub(self) -> usize {
        QK_K / self.sub
    }

    fn chunk_bytes(self) -> usize {
        if self.nibbles { 256 } else { 512 }
    }

    fn scales_at(self) -> usize {
        8 * self.chunk_bytes()
    }

    fn mins_at(self) -> usize {
        self.scales_at() + self.nsub() * 16
    }

    fn d_at(self) -> usize {
        self.mins_at() + if self.mins { self.nsub() * 32 } else { 0 }
    }

    fn dmin_at(self) -> usize {
        self.d_at() + 64
    }

    /// Bytes per tile per super-block (a multiple of 64).
    fn tile_bytes(self) -> usize {
        self.d_at() + if self.mins { 128 } else { 64 }
    }
}

/// Packs the `rows` K-quant rows that `row_of` gives, all of `f`'s type.
pub(super) fn pack<'a>(
    f: Format,
    rows: usize,
    cols: usize,
    row_of: impl Fn(usize) -> (GgmlType, &'a [u8]),
) -> AlignedBytes {
    let nsb = cols / QK_K;
    let tb = f.tile_bytes();
    let mut buf = AlignedBytes::zeroed(rows.div_ceil(ROW_TILE) * nsb * tb);
    let out = buf.as_mut_slice();
    for r in 0..rows {
        let (ty, bytes) = row_of(r);
        let (tile, lane) = (r / ROW_TILE, r % ROW_TILE);
        let bb = ty.block_bytes();
        for sb in 0..nsb {
            let k = KBlock::unpack(ty, &bytes[sb * bb..(sb + 1) * bb]);
            debug_assert_eq!(k.sub, f.sub);
            let base = (tile * nsb + sb) * tb;
            for c in 0..8 {
                let (q, at) = (&k.q[32 * c..32 * c + 32], base + c * f.chunk_bytes());
                // Nibbles: 4 groups, each byte two elements 16 apart; bytes: 8 groups.
                let groups = if f.nibbles { 4 } else { 8 };
                for g in 0..groups {
                    for j in 0..4 {
                        let high = if f.nibbles { q[16 + 4 * g + j] << 4 } else { 0 };
                        out[at + g * 64 + lane * 4 + j] = q[4 * g + j] | high;
                    }
                }
            }
            for j in 0..f.nsub() {
                out[base + f.scales_at() + j * 16 + lane] = k.sc[j] as u8;
                if f.mins {
                    let at = base + f.mins_at() + (j / 2) * 64 + lane * 4 + (j % 2) * 2;
                    out[at..at + 2].copy_from_slice(&(k.m[j] as i16).to_le_bytes());
                }
            }
            out[base + f.d_at() + lane * 4..][..4].copy_from_slice(&k.d.to_le_bytes());
            if f.mins {
                out[base + f.dmin_at() + lane * 4..][..4].copy_from_slice(&k.dmin.to_le_bytes());
            }
        }
    }
    buf
}

/// Activation sums over sub-block `j` of super-block `xs`, for `f`'s sub-block size.
fn bsum(f: Format, x: &QActs, xs: usize, j: usize) -> i32 {
    if f.sub == 16 {
        x.kbs16[xs * 16 + j] as i32
    } else {
        x.kbs32[xs * 8 + j] as i32
    }
}

fn check_bounds(f: Format, p: &[u8], tile: usize, cols: usize, x: &QActs, tok: usize, nt: usize) {
    let nsb = cols / QK_K;
    assert!(
        (tile * nsb + nsb) * f.tile_bytes() <= p.len()
            && (tok + nt) * cols <= x.kq.len()
            && (tok + nt) * nsb * 16 <= x.kbs16.len()
            && (tok + nt) * nsb * 8 <= x.kbs32.len()
            && (tok + nt) * nsb <= x.kd.len()
            && nt <= TOKEN_TILE
    );
}

/// The scalar reference for one K tile: reads the packed layout element by element.
#[allow(clippy::too_many_arguments)]
pub(super) fn scalar_tile(
    f: Format,
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
    let nsb = cols / QK_K;
    let f32_at = |at: usize| f32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]);
    for sb in 0..nsb {
        let base = (tile * nsb + sb) * f.tile_bytes();
        let value = |lane: usize, i: usize| -> i32 {
            let (c, w) = (i / 32, i % 32);
            let at = base + c * f.chunk_bytes();
            if f.nibbles {
                let byte = p[at + ((w % 16) / 4) * 64 + lane * 4 + w % 4];
                (if w < 16 { byte & 0x0f } else { byte >> 4 }) as i32
            } else {
                p[at + (w / 4) * 64 + lane * 4 + w % 4] as i32
            }
        };
        for lane in 0..ROW_TILE {
            for t in 0..nt {
                let xs = (tok + t) * nsb + sb;
                let xq = &x.kq[xs * QK_K..(xs + 1) * QK_K];
                let (mut isum, mut msum) = (0i32, 0i32);
                for j in 0..f.nsub() {
                    let mut dot: i32 = (j * f.sub..(j + 1) * f.sub)
                        .map(|i| value(lane, i) * xq[i] as i32)
                        .sum();
                    dot -= f.off * bsum(f, x, xs, j);
                    isum += p[base + f.scales_at() + j * 16 + lane] as i8 as i32 * dot;
                    if f.mins {
                        let at = base + f.mins_at() + (j / 2) * 64 + lane * 4 + (j % 2) * 2;
                        msum += i16::from_le_bytes([p[at], p[at + 1]]) as i32 * bsum(f, x, xs, j);
                    }
                }
                let dx = x.kd[xs];
                let mut v = isum as f32 * (f32_at(base + f.d_at() + lane * 4) * dx);
                if f.mins {
                    v -= msum as f32 * (f32_at(base + f.dmin_at() + lane * 4) * dx);
                }
                out[t * ROW_TILE + lane] += v;
            }
        }
    }
}

/// Calls `$f::<NIBBLES, SUB, MINS, OFF, NT>` for format `$fmt`: each K type's shape becomes
/// constants, so its loops unroll and its unused branches vanish.
#[cfg(target_arch = "x86_64")]
macro_rules! by_format {
    ($fmt:expr, $nt:expr, $f:ident($($arg:expr),*)) => {
        match ($fmt.nibbles, $fmt.sub, $fmt.mins, $fmt.off) {
            (true, 16, true, 0) => by_tokens!($nt, $f[true, 16, true, 0]($($arg),*)),
            (true, 16, false, 4) => by_tokens!($nt, $f[true, 16, false, 4]($($arg),*)),
            (true, 32, true, 0) => by_tokens!($nt, $f[true, 32, true, 0]($($arg),*)),
            (false, 32, true, 0) => by_tokens!($nt, $f[false, 32, true, 0]($($arg),*)),
            (false, 16, false, 32) => by_tokens!($nt, $f[false, 16, false, 32]($($arg),*)),
            other => unreachable!("no K format {other:?}"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
// Token indices also address activation blocks and output rows, not just the accumulators.
#[allow(clippy::needless_range_loop)]
pub(super) mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// One K row tile against up to four tokens.
    ///
    /// # Safety
    /// The CPU must support avx512f, avx512bw and avx512vnni.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(in crate::matmul) unsafe fn tile(
        f: Format,
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
        unsafe { by_format!(f, nt, tokens(f, p, tile, cols / QK_K, x, tok, out)) }
    }

    /// [`tile`] for one format and exactly `NT` tokens. A chunk's eight operands are unpacked
    /// once and used for every token; each token keeps an integer sum for the super-block.
    ///
    /// # Safety
    /// As [`tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tokens<const NIB: bool, const SUB: usize, const MINS: bool, const OFF: i32, const NT: usize>(
        f: Format,
        p: &[u8],
        tile: usize,
        nsb: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); NT];
        let tb = f.tile_bytes();
        let chunk = if NIB { 256 } else { 512 };
        for sb in 0..nsb {
            // SAFETY (all pointer reads below): bounds checked by the caller; the tile block is
            // `tb` bytes inside `p`, each token's super-block QK_K values inside `x.kq`, its 16
            // and 8 sums inside `x.kbs16` and `x.kbs32`.
            unsafe {
                let base = p.as_ptr().add((tile * nsb + sb) * tb);
                let xs: [usize; NT] = std::array::from_fn(|t| (tok + t) * nsb + sb);
                let xp: [*const i32; NT] = std::array::from_fn(|t| x.kq.as_ptr().add(xs[t] * QK_K).cast());
                let mut isum = [_mm512_setzero_si512(); NT];
                for c in 0..8 {
                    let at = base.add(c * chunk);
                    let mut w = [_mm512_setzero_si512(); 8];
                    for g in 0..4 {
                        if NIB {
                            let v = _mm512_loadu_si512(at.add(g * 64).cast());
                            w[g] = _mm512_and_si512(v, mask);
                            w[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                        } else {
                            w[g] = _mm512_loadu_si512(at.add(g * 64).cast());
                            w[4 + g] = _mm512_loadu_si512(at.add(256 + g * 64).cast());
                        }
                    }
                    // Sub-blocks in this chunk: one of 32, or two of 16 (operands 0..4, 4..8).
                    for h in 0..32 / SUB {
                        let j = c * (32 / SUB) + h;
                        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(base.add(f.scales_at() + j * 16).cast()));
                        let ops = SUB / 4;
                        for t in 0..NT {
                            let mut dot = _mm512_setzero_si512();
                            for k in 0..ops {
                                let xv = _mm512_set1_epi32(xp[t].add(c * 8 + h * ops + k).read_unaligned());
                                dot = _mm512_dpbusd_epi32(dot, w[h * ops + k], xv);
                            }
                            if OFF != 0 {
                                let bs = *x.kbs16.get_unchecked(xs[t] * 16 + j) as i32;
                                dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(OFF * bs));
                            }
                            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dot, sc));
                        }
                    }
                }
                let dw = _mm512_loadu_ps(base.add(f.d_at()).cast());
                for t in 0..NT {
                    let dx = _mm512_set1_ps(*x.kd.get_unchecked(xs[t]));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dw, dx), acc[t]);
                }
                if MINS {
                    let dmin = _mm512_loadu_ps(base.add(f.dmin_at()).cast());
                    let pairs = QK_K / SUB / 2;
                    for t in 0..NT {
                        // Each i32 is two adjacent i16 sums, matching a lane's pair of minimums.
                        let bs: *const i32 = if SUB == 16 {
                            x.kbs16.as_ptr().add(xs[t] * 16).cast()
                        } else {
                            x.kbs32.as_ptr().add(xs[t] * 8).cast()
                        };
                        let mut msum = _mm512_setzero_si512();
                        for pp in 0..pairs {
                            let m = _mm512_loadu_si512(base.add(f.mins_at() + pp * 64).cast());
                            msum = _mm512_dpwssd_epi32(msum, m, _mm512_set1_epi32(bs.add(pp).read_unaligned()));
                        }
                        let dx = _mm512_set1_ps(*x.kd.get_unchecked(xs[t]));
                        acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), acc[t]);
                    }
                }
            }
        }
        for t in 0..NT {
            // SAFETY: `out` holds TOKEN_TILE·ROW_TILE floats and t < NT ≤ TOKEN_TILE.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * ROW_TILE), acc[t]) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Token indices also address activation blocks and output rows, not just the accumulators.
#[allow(clippy::needless_range_loop)]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// One K row tile against up to four tokens, eight rows (half a tile) at a time.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::matmul) unsafe fn tile(
        f: Format,
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
        unsafe { by_format!(f, nt, tokens(f, p, tile, cols / QK_K, x, tok, out)) }
    }

    /// [`tile`] for one format and exactly `NT` tokens. `vpmaddubsw` pair sums (at most
    /// 2·63·127 = 16 002) are added two at a time in i16 (at most 32 004) before `vpmaddwd`
    /// widens them.
    ///
    /// # Safety
    /// As [`tile`], with its bounds checked for `nt == NT`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tokens<const NIB: bool, const SUB: usize, const MINS: bool, const OFF: i32, const NT: usize>(
        f: Format,
        p: &[u8],
        tile: usize,
        nsb: usize,
        x: &QActs,
        tok: usize,
        out: &mut TileOut,
    ) {
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let tb = f.tile_bytes();
        let chunk = if NIB { 256 } else { 512 };
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); NT];
            for sb in 0..nsb {
                // SAFETY: as in the AVX-512 kernel; each load reads this half's 32 bytes of a
                // 64-byte group.
                unsafe {
                    let base = p.as_ptr().add((tile * nsb + sb) * tb);
                    let xs: [usize; NT] = std::array::from_fn(|t| (tok + t) * nsb + sb);
                    let xp: [*const i32; NT] = std::array::from_fn(|t| x.kq.as_ptr().add(xs[t] * QK_K).cast());
                    let mut isum = [_mm256_setzero_si256(); NT];
                    for c in 0..8 {
                        let at = base.add(c * chunk + half * 32);
                        let mut w = [_mm256_setzero_si256(); 8];
                        for g in 0..4 {
                            if NIB {
                                let v = _mm256_loadu_si256(at.add(g * 64).cast());
                                w[g] = _mm256_and_si256(v, mask);
                                w[4 + g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                            } else {
                                w[g] = _mm256_loadu_si256(at.add(g * 64).cast());
                                w[4 + g] = _mm256_loadu_si256(at.add(256 + g * 64).cast());
                            }
                        }
                        for h in 0..32 / SUB {
                            let j = c * (32 / SUB) + h;
                            let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                base.add(f.scales_at() + j * 16 + half * 8).cast(),
                            ));
                            let ops = SUB / 4;
                            for t in 0..NT {
                                let mut dot = _mm256_setzero_si256();
                                for k in (0..ops).step_by(2) {
                                    let x0 = _mm256_set1_epi32(xp[t].add(c * 8 + h * ops + k).read_unaligned());
                                    let x1 = _mm256_set1_epi32(xp[t].add(c * 8 + h * ops + k + 1).read_unaligned());
                                    let s16 = _mm256_add_epi16(
                                        _mm256_maddubs_epi16(w[h * ops + k], x0),
                                        _mm256_maddubs_epi16(w[h * ops + k + 1], x1),
                                    );
                                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(s16, ones));
                                }
                                if OFF != 0 {
                                    let bs = *x.kbs16.get_unchecked(xs[t] * 16 + j) as i32;
                                    dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(OFF * bs));
                                }
                                isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot, sc));
                            }
                        }
                    }
                    let dw = _mm256_loadu_ps(base.add(f.d_at() + half * 32).cast());
                    for t in 0..NT {
                        let dx = _mm256_set1_ps(*x.kd.get_unchecked(xs[t]));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(dw, dx), acc[t]);
                    }
                    if MINS {
                        let dmin = _mm256_loadu_ps(base.add(f.dmin_at() + half * 32).cast());
                        let pairs = QK_K / SUB / 2;
                        for t in 0..NT {
                            let bs: *const i32 = if SUB == 16 {
                                x.kbs16.as_ptr().add(xs[t] * 16).cast()
                            } else {
                                x.kbs32.as_ptr().add(xs[t] * 8).cast()
                            };
                            let mut msum = _mm256_setzero_si256();
                            for pp in 0..pairs {
                                let m = _mm256_loadu_si256(base.add(f.mins_at() + pp * 64 + half * 32).cast());
                                let b = _mm256_set1_epi32(bs.add(pp).read_unaligned());
                                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, b));
                            }
                            let dx = _mm256_set1_ps(*x.kd.get_unchecked(xs[t]));
                            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[t]);
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
        _: Format,
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
