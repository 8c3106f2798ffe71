//! Tensor element formats as GGUF stores them, and scalar dequantization.
//!
//! This module owns the byte layout of every supported ggml block format: F32, F16, BF16, the
//! 32-element blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and the 256-element super-blocks of the
//! K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), as llama.cpp's `ggml-common.h` lays them out. The SIMD
//! kernels in [`crate::matmul`] repack blocks at load time; the functions here are the scalar
//! reference that the kernels are tested against (and, for the K-quants, against the `gguf`
//! Python package's dequantizer: `kernels/tests/dequant_vectors.rs`).

use half::f16;

/// A ggml tensor element type that Warden can load.
// The variants keep ggml's names (Q4_K, not Q4K): they are what files and llama.cpp call them.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of 32: one f16 scale, 32 signed 8-bit values.
    Q8_0,
    /// Blocks of 32: one f16 scale, 32 4-bit values offset by 8.
    Q4_0,
    /// Blocks of 32: f16 scale and f16 minimum, 32 unsigned 4-bit values.
    Q4_1,
    /// Blocks of 32: f16 scale, 32 5-bit values (low nibbles, then a 32-bit mask of fifth bits)
    /// offset by 16.
    Q5_0,
    /// Blocks of 32: f16 scale and f16 minimum, 32 unsigned 5-bit values.
    Q5_1,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 4-bit scales and minimums, 2-bit values.
    Q2_K,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 6-bit scales, 3-bit values (two low bits
    /// and a high-bit mask).
    Q3_K,
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit values.
    Q4_K,
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 5-bit values.
    Q5_K,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 8-bit scales, 6-bit values offset by 32.
    Q6_K,
}

/// Elements per quantization block for the block formats.
pub const QK: usize = 32;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

impl GgmlType {
    /// The type for a ggml type id, or `None` for ids Warden does not support.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2_K,
            11 => Self::Q3_K,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2_K => 10,
            Self::Q3_K => 11,
            Self::Q4_K => 12,
            Self::Q5_K => 13,
            Self::Q6_K => 14,
            Self::BF16 => 30,
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 => QK,
            Self::Q2_K | Self::Q3_K | Self::Q4_K | Self::Q5_K | Self::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q8_0 => 2 + QK,
            Self::Q4_0 => 2 + QK / 2,
            Self::Q4_1 => 4 + QK / 2,
            Self::Q5_0 => 2 + 4 + QK / 2,
            Self::Q5_1 => 4 + 4 + QK / 2,
            // scales[16], qs[64], d, dmin
            Self::Q2_K => QK_K / 16 + QK_K / 4 + 4,
            // hmask[32], qs[64], scales[12], d
            Self::Q3_K => QK_K / 8 + QK_K / 4 + 12 + 2,
            // d, dmin, scales[12], qs[128]
            Self::Q4_K => 4 + 12 + QK_K / 2,
            // d, dmin, scales[12], qh[32], qs[128]
            Self::Q5_K => 4 + 12 + QK_K / 8 + QK_K / 2,
            // ql[128], qh[64], scales[16], d
            Self::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Bytes needed for `elems` elements, or `None` when `elems` is not a whole number of blocks or
    /// the size overflows.
    pub fn bytes_for(self, elems: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !elems.is_multiple_of(be) {
            return None;
        }
        (elems / be).checked_mul(self.block_bytes() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
        })
    }
}

/// Dequantizes `out.len()` elements of type `ty` from `src` (scalar reference).
///
/// # Panics
/// If `src` is shorter than `ty.bytes_for(out.len())` or `out.len()` is not a whole number of
/// blocks; callers pass tensors the loader has already validated.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    let need = ty.bytes_for(n as u64).expect("whole blocks") as usize;
    assert!(
        src.len() >= need,
        "dequantize: {} bytes for {n} {ty} elements",
        src.len()
    );
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(ty.block_bytes())) {
                let d = f16_at(b, 0);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = d * (b[2 + j] as i8) as f32;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(ty.block_bytes())) {
                let d = f16_at(b, 0);
                for j in 0..QK / 2 {
                    let q = b[2 + j];
                    o[j] = d * ((q & 0x0f) as i32 - 8) as f32;
                    o[j + QK / 2] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(ty.block_bytes())) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..QK / 2 {
                    let q = b[4 + j];
                    o[j] = d * (q & 0x0f) as f32 + m;
                    o[j + QK / 2] = d * (q >> 4) as f32 + m;
                }
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(ty.block_bytes())) {
                let blk = Q5Block::unpack(ty, b);
                let d = blk.d.to_f32();
                for (v, &q) in o.iter_mut().zip(&blk.q) {
                    *v = match blk.m {
                        Some(m) => q as f32 * d + m.to_f32(),
                        None => (q as i32 - 16) as f32 * d,
                    };
                }
            }
        }
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(ty.block_bytes())) {
                KBlock::unpack(ty, b).dequantize(o);
            }
        }
    }
}

/// A Q5_0 or Q5_1 block with its 5-bit values gathered: element `j` is `d·(q[j] − 16)` (Q5_0)
/// or `d·q[j] + m` (Q5_1).
#[derive(Debug, Clone, Copy)]
pub struct Q5Block {
    /// Unsigned values, 0..=31, in element order.
    pub q: [u8; QK],
    /// Scale.
    pub d: f16,
    /// Minimum (Q5_1); Q5_0 has none and offsets by 16 instead.
    pub m: Option<f16>,
}

impl Q5Block {
    /// Gathers block `b` of type `ty` (Q5_0 or Q5_1): low nibbles from `qs`, fifth bits from the
    /// 32-bit mask `qh` that precedes them.
    ///
    /// # Panics
    /// If `ty` is neither, or `b` is shorter than a block.
    pub fn unpack(ty: GgmlType, b: &[u8]) -> Self {
        let (m, at) = match ty {
            GgmlType::Q5_1 => (Some(f16::from_le_bytes([b[2], b[3]])), 4),
            GgmlType::Q5_0 => (None, 2),
            _ => panic!("{ty} is not a Q5 type"),
        };
        let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let qs = &b[at + 4..at + 4 + QK / 2];
        let mut q = [0u8; QK];
        for j in 0..QK / 2 {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            q[j] = (qs[j] & 0x0f) | h0;
            q[j + QK / 2] = (qs[j] >> 4) | h1;
        }
        Self {
            q,
            d: f16::from_le_bytes([b[0], b[1]]),
            m,
        }
    }
}

/// One K-quant super-block brought to a single form for every K type: element `i` of sub-block
/// `j = i / sub` is `(d·sc[j])·(q[i] − off) − dmin·m[j]` with `q` unsigned. Q2_K, Q4_K and Q5_K
/// have minimums (`off` = 0); Q3_K and Q6_K are symmetric, their values offset by `off` (4 and
/// 32) and their minimums zero. The SIMD kernels repack this form; [`dequantize`] computes from
/// it, so the fixture test of the dequantizer checks the unpacking too.
#[derive(Debug, Clone, Copy)]
pub struct KBlock {
    /// Elements per sub-block: 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).
    pub sub: usize,
    /// Unsigned values in element order: 2 bits (Q2_K), 3 (Q3_K), 4 (Q4_K), 5 (Q5_K), 6 (Q6_K).
    pub q: [u8; QK_K],
    /// Sub-block scales (the first `QK_K / sub` are used).
    pub sc: [i8; 16],
    /// Sub-block minimums, as multiples of `dmin` (zero for the symmetric types).
    pub m: [u8; 16],
    /// Offset subtracted from every value: 0, 4 (Q3_K) or 32 (Q6_K).
    pub off: u8,
    /// Super-block scale.
    pub d: f32,
    /// Super-block scale of the minimums (zero for the symmetric types).
    pub dmin: f32,
}

impl KBlock {
    /// Unpacks super-block `b` of K-quant type `ty`.
    ///
    /// # Panics
    /// If `ty` is not a K-quant type or `b` is shorter than its block.
    pub fn unpack(ty: GgmlType, b: &[u8]) -> Self {
        let mut k = KBlock {
            sub: 16,
            q: [0; QK_K],
            sc: [0; 16],
            m: [0; 16],
            off: 0,
            d: 0.0,
            dmin: 0.0,
        };
        match ty {
            // scales[16] qs[64] d dmin: each scale byte is a 4-bit scale (low) and 4-bit minimum
            // (high); values are 2 bits, four to a byte, a 128-element half at a time.
            GgmlType::Q2_K => {
                let (scales, qs) = (&b[..16], &b[16..80]);
                (k.d, k.dmin) = (f16_at(b, 80), f16_at(b, 82));
                for (j, &s) in scales.iter().enumerate() {
                    (k.sc[j], k.m[j]) = ((s & 0x0f) as i8, s >> 4);
                }
                for (i, q) in k.q.iter_mut().enumerate() {
                    let (half, j, l) = (i / 128, (i % 128) / 32, i % 32);
                    *q = (qs[half * 32 + l] >> (2 * j)) & 3;
                }
            }
            // hmask[32] qs[64] scales[12] d: sixteen 6-bit scales packed in 12 bytes (offset by
            // 32); values are 2 low bits from `qs` and a high bit from `hmask`; minus 4 when that
            // bit is clear, so the unsigned value is `low + 4·bit` with offset 4.
            GgmlType::Q3_K => {
                let (hmask, qs, packed) = (&b[..32], &b[32..96], &b[96..108]);
                k.d = f16_at(b, 108);
                k.off = 4;
                for (i, s) in k.sc.iter_mut().enumerate() {
                    let low = if i < 8 { packed[i] & 0x0f } else { packed[i - 8] >> 4 };
                    let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
                    *s = (low | (high << 4)) as i8 - 32;
                }
                for (i, q) in k.q.iter_mut().enumerate() {
                    let (half, j, l) = (i / 128, (i % 128) / 32, i % 32);
                    let low = (qs[half * 32 + l] >> (2 * j)) & 3;
                    let high = (hmask[l] >> (4 * half + j)) & 1;
                    *q = low | (high << 2);
                }
            }
            // d dmin scales[12] (qh[32]) qs[128]: eight sub-blocks of 32, each a 6-bit scale and
            // minimum; a 64-element stretch takes the low nibbles of 32 bytes, then their high
            // nibbles; Q5_K's fifth bits come two per `qh` byte per stretch.
            GgmlType::Q4_K | GgmlType::Q5_K => {
                (k.d, k.dmin) = (f16_at(b, 0), f16_at(b, 2));
                k.sub = 32;
                let scales = &b[4..16];
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, scales);
                    (k.sc[j], k.m[j]) = (sc as i8, m);
                }
                let (qh, qs) = if ty == GgmlType::Q5_K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                for (i, q) in k.q.iter_mut().enumerate() {
                    let (stretch, hi, l) = (i / 64, (i % 64) / 32, i % 32);
                    let byte = qs[32 * stretch + l];
                    *q = if hi == 1 { byte >> 4 } else { byte & 0x0f };
                    if let Some(qh) = qh {
                        *q |= ((qh[l] >> (2 * stretch + hi)) & 1) << 4;
                    }
                }
            }
            // ql[128] qh[64] scales[16] d: values are 4 low bits from `ql` and 2 high bits from
            // `qh`, offset by 32, with a signed 8-bit scale per 16 elements; 128 at a time.
            GgmlType::Q6_K => {
                let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                k.d = f16_at(b, 208);
                k.off = 32;
                for (s, &v) in k.sc.iter_mut().zip(sc) {
                    *s = v as i8;
                }
                for (i, q) in k.q.iter_mut().enumerate() {
                    let (half, r, l) = (i / 128, (i % 128) / 32, i % 32);
                    let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                    // Stretches 0 and 1 take the low nibbles of the two 32-byte runs of `ql`,
                    // stretches 2 and 3 their high nibbles.
                    let byte = ql[l + 32 * (r % 2)];
                    let low = if r < 2 { byte & 0x0f } else { byte >> 4 };
                    *q = low | (((qh[l] >> (2 * r)) & 3) << 4);
                }
            }
            _ => panic!("{ty} is not a K-quant type"),
        }
        k
    }

    /// Writes the super-block's 256 values into `y`, each as `(d·sc)·(q − off) − dmin·m`: the
    /// operations, in the order, that llama.cpp's dequantizers use.
    pub fn dequantize(&self, y: &mut [f32]) {
        for (i, v) in y[..QK_K].iter_mut().enumerate() {
            let j = i / self.sub;
            let dl = self.d * self.sc[j] as f32;
            let q = (self.q[i] as i32 - self.off as i32) as f32;
            // For the symmetric types this subtracts 0.0, which changes no value.
            *v = dl * q - self.dmin * self.m[j] as f32;
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The `j`th 6-bit scale and minimum of a Q4_K or Q5_K super-block's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_dequantizes_low_then_high_nibbles() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x3a; // element 0 = 0xa, element 16 = 0x3
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &b, &mut out);
        assert_eq!(out[0], 0.5 * 10.0 - 1.0);
        assert_eq!(out[16], 0.5 * 3.0 - 1.0);
        assert_eq!(out[1], -1.0);
    }

    #[test]
    fn sizes_reject_partial_blocks() {
        assert_eq!(GgmlType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
