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

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
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
            let with_min = ty == GgmlType::Q5_1;
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(ty.block_bytes())) {
                let d = f16_at(b, 0);
                let (m, at) = if with_min { (f16_at(b, 2), 4) } else { (0.0, 2) };
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let qs = &b[at + 4..at + 4 + QK / 2];
                for j in 0..QK / 2 {
                    let h0 = (((qh >> j) << 4) & 0x10) as u8;
                    let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                    let (x0, x1) = ((qs[j] & 0x0f) | h0, (qs[j] >> 4) | h1);
                    if with_min {
                        o[j] = x0 as f32 * d + m;
                        o[j + QK / 2] = x1 as f32 * d + m;
                    } else {
                        o[j] = (x0 as i32 - 16) as f32 * d;
                        o[j + QK / 2] = (x1 as i32 - 16) as f32 * d;
                    }
                }
            }
        }
        GgmlType::Q2_K => for_superblocks(ty, src, out, dequantize_q2_k),
        GgmlType::Q3_K => for_superblocks(ty, src, out, dequantize_q3_k),
        GgmlType::Q4_K => for_superblocks(ty, src, out, dequantize_q4_k),
        GgmlType::Q5_K => for_superblocks(ty, src, out, dequantize_q5_k),
        GgmlType::Q6_K => for_superblocks(ty, src, out, dequantize_q6_k),
    }
}

fn for_superblocks(ty: GgmlType, src: &[u8], out: &mut [f32], f: fn(&[u8], &mut [f32])) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(ty.block_bytes())) {
        f(b, o);
    }
}

/// Q2_K: `scales[16] qs[64] d dmin`. Each scale byte is a sub-block's 4-bit scale (low) and
/// 4-bit minimum (high); values are 2 bits, four to a byte, a 128-element half at a time.
fn dequantize_q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    for (half, q) in qs.chunks_exact(32).enumerate() {
        for j in 0..4 {
            let shift = 2 * j;
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
                let at = half * 128 + j * 32 + part * 16;
                for l in 0..16 {
                    y[at + l] = dl * ((q[part * 16 + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// Q3_K: `hmask[32] qs[64] scales[12] d`. Sixteen 6-bit scales packed in 12 bytes (offset by
/// 32); values are 2 low bits from `qs` and a high bit from `hmask`, minus 4 when that bit is
/// clear.
fn dequantize_q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    let mut scales = [0i8; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 { packed[i] & 0x0f } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i8 - 32;
    }
    let mut is = 0;
    let mut m = 1u8;
    for (half, q) in qs.chunks_exact(32).enumerate() {
        for j in 0..4 {
            let shift = 2 * j;
            for part in 0..2 {
                let dl = d * scales[is] as f32;
                is += 1;
                let at = half * 128 + j * 32 + part * 16;
                for l in 0..16 {
                    let i = part * 16 + l;
                    let low = ((q[i] >> shift) & 3) as i8;
                    let v = low - if hmask[i] & m != 0 { 0 } else { 4 };
                    y[at + l] = dl * v as f32;
                }
            }
            m <<= 1;
        }
    }
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

/// Q4_K: `d dmin scales[12] qs[128]`: eight sub-blocks of 32, each a 6-bit scale and minimum;
/// a 64-element stretch takes the low nibbles of 32 bytes, then their high nibbles.
fn dequantize_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (k, q) in qs.chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            y[64 * k + l] = d1 * (q[l] & 0x0f) as f32 - m1;
            y[64 * k + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: `d dmin scales[12] qh[32] qs[128]`: as Q4_K, with a fifth bit per value from `qh`
/// (two bits of each `qh` byte per 64-element stretch).
fn dequantize_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (k, ql) in qs.chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * k), 2u8 << (2 * k));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * k + l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - m1;
            y[64 * k + 32 + l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// Q6_K: `ql[128] qh[64] scales[16] d`: values are 4 low bits from `ql` and 2 high bits from
/// `qh`, offset by 32, with a signed 8-bit scale per 16 elements; 128 elements at a time.
fn dequantize_q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for half in 0..2 {
        let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
        let y = &mut y[128 * half..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            y[l] = d * sc[is] as i8 as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
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
