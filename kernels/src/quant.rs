//! Tensor element formats as GGUF stores them, and scalar dequantization.
//!
//! This module owns the byte layout of every supported ggml block format (F32, F16, BF16, Q8_0,
//! Q4_0, Q4_1). The SIMD kernels in [`crate::matmul`] repack these blocks at load time; the
//! functions here are the scalar reference that the kernels are tested against.

use half::f16;

/// A ggml tensor element type that Warden can load.
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
}

/// Elements per quantization block for the block formats.
pub const QK: usize = 32;

impl GgmlType {
    /// The type for a ggml type id, or `None` for ids Warden does not support.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
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
            Self::Q8_0 => 8,
            Self::BF16 => 30,
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 => QK,
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
