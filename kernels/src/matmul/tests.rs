use super::*;
use crate::quant::{QK_K, dequantize};
use half::f16;
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
    // Where each block type keeps its f16 scale and (if any) minimum scale.
    let scales: Option<(usize, Option<usize>)> = match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q5_0 => Some((0, None)),
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => Some((0, Some(2))),
        GgmlType::Q2_K => Some((80, Some(82))),
        GgmlType::Q3_K => Some((108, None)),
        GgmlType::Q6_K => Some((208, None)),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
    };
    if let Some((d_at, m_at)) = scales {
        // K-quant scales multiply 6-bit sub-block scales: keep their products modest too.
        let k = if ty.block_elems() == QK_K { 30.0 } else { 1.0 };
        for blk in v.chunks_exact_mut(bb) {
            let d = f16::from_f32(((next() % 1000) as f32 / 50_000.0 + 0.001) / k);
            blk[d_at..d_at + 2].copy_from_slice(&d.to_le_bytes());
            if let Some(m_at) = m_at {
                let m = f16::from_f32(-((next() % 1000) as f32) / 10_000.0 / k);
                blk[m_at..m_at + 2].copy_from_slice(&m.to_le_bytes());
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

/// How far each output may be from [`reference`] when the activations are rounded to 8 bits per
/// block (32 values, or 256 against K-quant weights; float weights take them unrounded): each
/// value moves by at most half a step, `amax/254`, so an output moves by at most
/// `Σ_k |w_k|·amax(block of k)/254`, plus f32 summation slack.
fn rounding_bound(ty: GgmlType, rows: usize, cols: usize, w: &[u8], x: &[f32]) -> Vec<f32> {
    let mut wf = vec![0f32; rows * cols];
    dequantize(ty, w, &mut wf);
    let tokens = x.len() / cols;
    let block = if ty.block_elems() == QK_K { QK_K } else { QK };
    let rounded = !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    let mut out = vec![0f32; tokens * rows];
    for t in 0..tokens {
        let xt = &x[t * cols..(t + 1) * cols];
        let amax: Vec<f64> = xt
            .chunks(block)
            .map(|b| b.iter().fold(0f64, |a, &v| a.max(v.abs() as f64)))
            .map(|a| if rounded { a } else { 0.0 })
            .collect();
        for r in 0..rows {
            let wr = &wf[r * cols..(r + 1) * cols];
            let step: f64 = (0..cols).map(|k| wr[k].abs() as f64 * amax[k / block] / 254.0).sum();
            let size: f64 = (0..cols).map(|k| (wr[k] as f64 * xt[k] as f64).abs()).sum();
            out[t * rows + r] = (step * 1.001 + size * 1e-5 + 1e-6) as f32;
        }
    }
    out
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
    let bound = rounding_bound(ty, rows, cols, &w, &x);
    let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
    let mut scalar = vec![0f32; tokens * rows];
    m.matmul_with(&qa, &mut scalar, Kernel::Scalar);
    for (i, (a, b)) in scalar.iter().zip(&want).enumerate() {
        // Only the activations' rounding to 8 bits separates the two.
        assert!(
            (a - b).abs() <= bound[i],
            "{ty} scalar[{i}] = {a}, reference {b}, bound {}",
            bound[i]
        );
    }
    for k in Kernel::available() {
        let mut simd = vec![0f32; tokens * rows];
        m.matmul_with(&qa, &mut simd, k);
        for (i, (a, b)) in simd.iter().zip(&scalar).enumerate() {
            assert!((a - b).abs() <= 1e-4 * scale, "{ty} {k:?}[{i}] = {a}, scalar {b}");
        }
    }
}

/// Every block type but the K-quants.
const BLOCK_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_1,
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
];

const K_TYPES: [GgmlType; 5] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

#[test]
fn every_type_matches_the_dequantized_reference() {
    for ty in BLOCK_TYPES
        .into_iter()
        .chain([GgmlType::F16, GgmlType::F32, GgmlType::BF16])
    {
        check(ty, 48, 96, 5, 1);
        check(ty, 17, 32, 1, 2); // a partial row tile
    }
    for ty in K_TYPES {
        check(ty, 48, 512, 5, 1);
        check(ty, 17, 256, 1, 2);
    }
    // Float rows of any length, on every kernel (the activations stay unquantized).
    for ty in [GgmlType::F16, GgmlType::F32, GgmlType::BF16] {
        for cols in [1, 7, 172] {
            check(ty, 9, cols, 3, 4);
        }
    }
}

/// A prompt's 16-bit float tiles are widened to f32 once for all its tokens: the products and
/// their order are those of the token-by-token path, so every kernel gives the same bits both
/// ways (and the widened tiles are each tile's own: rows past the first tile, any row length).
#[test]
fn widened_float_tiles_give_the_bits_of_the_unwidened() {
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let (rows, cols, tokens) = (40, 172, WIDEN_FROM_TOKENS + 5);
        let w = random_weights(ty, rows, cols, 9);
        let m = QMatrix::from_ggml(ty, rows, cols, &w).unwrap();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 7919) % 201) as f32 / 100.0 - 1.0)
            .collect();
        for k in Kernel::available() {
            let mut qa = QActs::new();
            qa.quantize(&x, cols);
            let mut all = vec![0f32; tokens * rows];
            m.matmul_with(&qa, &mut all, k);
            for t in 0..tokens {
                let mut one = QActs::new();
                one.quantize(&x[t * cols..(t + 1) * cols], cols);
                let mut o = vec![0f32; rows];
                m.matmul_with(&one, &mut o, k);
                assert_eq!(&all[t * rows..(t + 1) * rows], &o[..], "{ty} {k:?} token {t}");
            }
        }
    }
}

/// The K kernels compute llama.cpp's sums exactly: against the dequantized weights times the
/// dequantized Q8_K activations (each value `d_x·q_x`), summed in f64, every kernel is within
/// float rounding (1e-5 of the output scale); a mistake in a scale, minimum, offset or value
/// layout is off by far more. Rows of two and three super-blocks, and 1 to 6 tokens (a whole
/// token tile and a partial one).
#[test]
fn k_kernels_compute_the_q8_k_dot_product() {
    for (n, ty) in K_TYPES.into_iter().enumerate() {
        for (rows, cols, tokens) in [(33, 512, 6), (16, 768, 1)] {
            // Each activation as the kernels see it: its super-block's scale times its value.
            exact(ty, rows, cols, tokens, 10 + n as u64, |qa, i| {
                qa.kd[i / QK_K] * qa.kq[i] as f32
            });
        }
    }
}

/// So do the block kernels without minimums (Q4_0 and Q5_0 subtract their offset as an
/// integer, Q8_0 takes its bias back off as one): against the dequantized weights times the
/// dequantized per-32 activations, within float rounding, on every kernel.
#[test]
fn offset_block_kernels_compute_the_q8_0_dot_product() {
    for (n, ty) in [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0].into_iter().enumerate() {
        exact(ty, 33, 96, 6, 20 + n as u64, |qa, i| qa.d[i / QK] * qa.q[i] as f32);
    }
}

/// `ty`'s matmul on every kernel against the dequantized weights times the activations as
/// `act(quantized, i)` gives them back, summed in f64: within 1e-5 of the output scale.
fn exact(ty: GgmlType, rows: usize, cols: usize, tokens: usize, seed: u64, act: impl Fn(&QActs, usize) -> f32) {
    let w = random_weights(ty, rows, cols, seed);
    let m = QMatrix::from_ggml(ty, rows, cols, &w).unwrap();
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| ((i * 7919 + seed as usize) % 211) as f32 / 50.0 - 2.1)
        .collect();
    let mut qa = QActs::new();
    qa.quantize(&x, cols);
    let xd: Vec<f32> = (0..tokens * cols).map(|i| act(&qa, i)).collect();
    let want = reference(ty, rows, cols, &w, &xd);
    let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
    for k in Kernel::available() {
        let mut got = vec![0f32; tokens * rows];
        m.matmul_with(&qa, &mut got, k);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-5 * scale, "{ty} {k:?}[{i}] = {a}, want {b}");
        }
    }
}

/// And those with minimums (Q4_1, Q5_1) compute llama.cpp's `d_w·d_x·Σ q_w q_x + m_w·s_x`, with
/// `s_x = d_x·Σ q_x` (llama.cpp rounds it to f16 as well; Warden keeps it exact), within float
/// rounding.
#[test]
fn min_block_kernels_compute_the_q8_1_dot_product() {
    for (n, ty) in [GgmlType::Q4_1, GgmlType::Q5_1].into_iter().enumerate() {
        let (rows, cols, tokens) = (33, 96, 6);
        let w = random_weights(ty, rows, cols, 30 + n as u64);
        let m = QMatrix::from_ggml(ty, rows, cols, &w).unwrap();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 7919 + n) % 211) as f32 / 50.0 - 2.1)
            .collect();
        let mut qa = QActs::new();
        qa.quantize(&x, cols);
        let (nb, bb) = (cols / QK, ty.block_bytes());
        let mut want = vec![0f32; tokens * rows];
        for t in 0..tokens {
            for r in 0..rows {
                let mut acc = 0f64;
                for b in 0..nb {
                    let blk = &w[(r * nb + b) * bb..][..bb];
                    let mut deq = [0f32; QK];
                    dequantize(ty, blk, &mut deq);
                    let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32() as f64;
                    let mw = f16::from_le_bytes([blk[2], blk[3]]).to_f32() as f64;
                    let xb = t * nb + b;
                    for (i, &v) in deq.iter().enumerate() {
                        // The value's quantum count: (v − m) / d, an integer.
                        let q = ((v as f64 - mw) / d).round();
                        acc += d * q * qa.d[xb] as f64 * qa.q[xb * QK + i] as f64;
                    }
                    acc += mw * qa.s[xb] as f64;
                }
                want[t * rows + r] = acc as f32;
            }
        }
        let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
        for k in Kernel::available() {
            let mut got = vec![0f32; tokens * rows];
            m.matmul_with(&qa, &mut got, k);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= 1e-5 * scale, "{ty} {k:?}[{i}] = {a}, want {b}");
            }
        }
    }
}

/// Fine activations (8-bit values plus their 8-bit residuals) give every quantized type's
/// matmul, on every kernel, what 16-bit inputs would: within 2e-4 of the output scale of the
/// dequantized weights times the exact inputs, where plain 8-bit ones are off by up to 2%, and
/// at least 30 times closer overall. A mixed stack (blocks and super-blocks in one matrix) too.
#[test]
fn fine_activations_are_as_good_as_16_bit_ones() {
    let cases = BLOCK_TYPES
        .into_iter()
        .map(|ty| (ty, 64))
        .chain(K_TYPES.into_iter().map(|ty| (ty, 512)));
    for (n, (ty, cols)) in cases.enumerate() {
        let (rows, tokens) = (40, 3);
        let w = random_weights(ty, rows, cols, 50 + n as u64);
        let m = QMatrix::from_ggml(ty, rows, cols, &w).unwrap();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| (((i * 7919 + n * 31) % 1013) as f32 / 400.0 - 1.3).powi(3))
            .collect();
        let want = reference(ty, rows, cols, &w, &x);
        let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
        let (mut coarse, mut fine) = (QActs::new(), QActs::new());
        coarse.quantize(&x, cols);
        fine.quantize_fine(&x, cols);
        assert_eq!(fine.tokens(), tokens);
        let err = |qa: &QActs, k: Kernel| {
            let mut got = vec![0f32; tokens * rows];
            m.matmul_with(qa, &mut got, k);
            got.iter().zip(&want).map(|(a, b)| (a - b).abs()).collect::<Vec<f32>>()
        };
        let total = |e: &[f32]| e.iter().sum::<f32>();
        for k in Kernel::available() {
            let (ec, ef) = (err(&coarse, k), err(&fine, k));
            let worst = ef.iter().fold(0f32, |a, &v| a.max(v));
            assert!(worst <= 2e-4 * scale, "{ty} {k:?}: fine error {worst}, scale {scale}");
            assert!(
                total(&ef) * 30.0 < total(&ec),
                "{ty} {k:?}: fine {} against 8-bit {}",
                total(&ef),
                total(&ec)
            );
        }
    }
    // Only the rows from a given one on (whole tiles) read the residuals; the others are
    // exactly what plain 8-bit activations give.
    let (ty, rows, cols, tokens) = (GgmlType::Q5_0, 40, 64, 3);
    let w = random_weights(ty, rows, cols, 80);
    let m = QMatrix::from_ggml(ty, rows, cols, &w).unwrap().with_fine_rows(24);
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| ((i * 53) % 89) as f32 / 30.0 - 1.4)
        .collect();
    let want = reference(ty, rows, cols, &w, &x);
    let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
    let (mut coarse, mut fine) = (QActs::new(), QActs::new());
    coarse.quantize(&x, cols);
    fine.quantize_fine(&x, cols);
    for k in Kernel::available() {
        let (mut c, mut f) = (vec![0f32; tokens * rows], vec![0f32; tokens * rows]);
        m.matmul_with(&coarse, &mut c, k);
        m.matmul_with(&fine, &mut f, k);
        for t in 0..tokens {
            for r in 0..rows {
                let i = t * rows + r;
                if r < 16 {
                    assert_eq!(f[i], c[i], "{k:?} row {r}: before the fine tile");
                } else {
                    assert!(
                        (f[i] - want[i]).abs() <= 2e-4 * scale,
                        "{k:?} row {r}: {} against {}",
                        f[i],
                        want[i]
                    );
                }
            }
        }
    }
    // A stack of a block part and a super-block part reads each form's own residuals.
    let (cols, tokens) = (512, 2);
    let (wa, wb) = (
        random_weights(GgmlType::Q5_0, 8, cols, 90),
        random_weights(GgmlType::Q4_K, 16, cols, 91),
    );
    let m = QMatrix::concat(&[(GgmlType::Q5_0, 8, &wa), (GgmlType::Q4_K, 16, &wb)], cols).unwrap();
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| ((i * 37) % 97) as f32 / 40.0 - 1.2)
        .collect();
    let mut fine = QActs::new();
    fine.quantize_fine(&x, cols);
    let mut got = vec![0f32; tokens * 24];
    m.matmul(&fine, &mut got);
    let (ra, rb) = (
        reference(GgmlType::Q5_0, 8, cols, &wa, &x),
        reference(GgmlType::Q4_K, 16, cols, &wb, &x),
    );
    for t in 0..tokens {
        let want: Vec<f32> = ra[t * 8..(t + 1) * 8]
            .iter()
            .chain(&rb[t * 16..(t + 1) * 16])
            .copied()
            .collect();
        let scale = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
        for (a, b) in got[t * 24..(t + 1) * 24].iter().zip(&want) {
            assert!((a - b).abs() <= 2e-4 * scale, "stacked: {a} against {b}");
        }
    }
}

/// Activations as llama.cpp's `quantize_row_q8_K_ref` makes them: the value of largest
/// magnitude maps to −127 (its sign flipped into the scale), halves round to even, and the sums
/// of each 16 and 32 values come along.
#[test]
fn superblock_activations_are_q8_k() {
    let mut x: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin()).collect();
    // The first super-block's largest magnitude is −127, so its scale is exactly 1 and the
    // halves below are exact halves: they round to even.
    x[5] = -127.0;
    (x[6], x[7], x[8], x[9]) = (0.5, 1.5, 2.5, -1.5);
    x[300] = 4.0; // the second's is positive: its values are negated, its scale negative
    let mut qa = QActs::new();
    qa.quantize(&x, 512);
    assert_eq!((qa.kd[0], qa.kq[5]), (1.0, -127));
    assert_eq!((qa.kq[6], qa.kq[7], qa.kq[8], qa.kq[9]), (0, 2, 2, -2));
    assert_eq!((qa.kd[1], qa.kq[300]), (1.0 / (-127.0f32 / 4.0), -127));
    for j in 0..32 {
        let sum16: i32 = qa.kq[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
        assert_eq!(qa.kbs16[j] as i32, sum16);
    }
    for j in 0..16 {
        assert_eq!(qa.kbs32[j], qa.kbs16[2 * j] + qa.kbs16[2 * j + 1]);
    }
    // A row of zeros has scale 0 and values 0.
    qa.quantize(&[0.0; 256], 256);
    assert_eq!((qa.kd[0], qa.kq.iter().all(|&q| q == 0)), (0.0, true));
}

/// Activations made without a form a matrix needs are refused, not read stale.
#[test]
#[should_panic(expected = "without a form")]
fn a_matrix_refuses_activations_without_its_form() {
    let w = random_weights(GgmlType::Q4_K, 16, 256, 1);
    let m = QMatrix::from_ggml(GgmlType::Q4_K, 16, 256, &w).unwrap();
    let mut qa = QActs::new();
    qa.set_needs(ActNeeds {
        superblocks: false,
        ..ActNeeds::ALL
    });
    qa.quantize(&[0.5; 256], 256);
    m.matmul(&qa, &mut [0.0; 16]);
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
    assert_eq!((&a.q, &a.d, &a.s, &a.bs), (&b.q, &b.d, &b.s, &b.bs));
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

    // Super-blocks likewise, bit for bit: 150 rows of two, with exact halves (ties round to
    // even), a magnitude tie of opposite signs (the first decides), and an all-zero one.
    let mut x: Vec<f32> = (0..512 * 150)
        .map(|i| ((i * 7919) % 1999) as f32 / 313.0 - 3.1)
        .collect();
    x[..256]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i % 9) as f32 * 0.5 - 2.0);
    x[3] = -127.0;
    x[9] = 127.0;
    x[512..768].fill(0.0);
    a.quantize_with(&x, 512, true);
    b.quantize_with(&x, 512, false);
    assert_eq!((&a.kq, &a.kd, &a.kbs16, &a.kbs32), (&b.kq, &b.kd, &b.kbs16, &b.kbs32));
    assert_eq!((a.kd[0], a.kd[2]), (1.0, 0.0));
}

/// A `_K_M` file's stacked projections mix types (Q4_K, Q6_K, and Q5_0 or Q8_0 where rows are
/// not whole super-blocks): each run of one format packs as its own segment, and the stack
/// computes what its parts do, on every kernel.
#[test]
fn stacked_parts_of_different_types_equal_their_parts() {
    let cols = 256;
    let types = [
        (GgmlType::Q4_K, 20),
        (GgmlType::Q4_K, 12),
        (GgmlType::Q6_K, 9),
        (GgmlType::Q5_0, 16),
        (GgmlType::Q8_0, 5),
        (GgmlType::F16, 3),
    ];
    let data: Vec<Vec<u8>> = types
        .iter()
        .enumerate()
        .map(|(i, &(ty, rows))| random_weights(ty, rows, cols, 40 + i as u64))
        .collect();
    let parts: Vec<(GgmlType, usize, &[u8])> = types.iter().zip(&data).map(|(&(ty, r), d)| (ty, r, &d[..])).collect();
    let m = QMatrix::concat(&parts, cols).unwrap();
    // Q4_K + Q4_K, Q6_K, Q5_0, Q8_0, F16.
    assert_eq!(m.segments.len(), 5);
    let x: Vec<f32> = (0..3 * cols).map(|i| (i as f32 * 0.21).cos()).collect();
    let mut qa = QActs::new();
    qa.quantize(&x, cols);
    for k in Kernel::available() {
        let mut all = vec![0f32; 3 * m.rows()];
        m.matmul_with(&qa, &mut all, k);
        let mut row0 = 0;
        for &(ty, rows, d) in &parts {
            let one = QMatrix::from_ggml(ty, rows, cols, d).unwrap();
            let mut o = vec![0f32; 3 * rows];
            one.matmul_with(&qa, &mut o, k);
            for t in 0..3 {
                assert_eq!(
                    &all[t * m.rows() + row0..][..rows],
                    &o[t * rows..][..rows],
                    "{ty} {k:?}"
                );
            }
            row0 += rows;
        }
    }
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
        Some(MatrixError::BadCols {
            cols: 33,
            ty: GgmlType::Q4_1,
            block: 32
        })
    );
    assert_eq!(
        QMatrix::from_ggml(GgmlType::F32, 2, 0, &[]).err(),
        Some(MatrixError::BadCols {
            cols: 0,
            ty: GgmlType::F32,
            block: 1
        })
    );
    // Quantized rows stacked with float ones are still whole blocks.
    let f = random_weights(GgmlType::F32, 1, 40, 1);
    let q = random_weights(GgmlType::Q8_0, 1, 32, 1);
    assert_eq!(
        QMatrix::concat(&[(GgmlType::F32, 1, &f), (GgmlType::Q8_0, 1, &q)], 40).err(),
        Some(MatrixError::BadCols {
            cols: 40,
            ty: GgmlType::Q8_0,
            block: 32
        })
    );
    // K-quant rows are whole 256-element super-blocks.
    assert_eq!(
        QMatrix::from_ggml(GgmlType::Q4_K, 1, 288, &[]).err(),
        Some(MatrixError::BadCols {
            cols: 288,
            ty: GgmlType::Q4_K,
            block: 256
        })
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
        check(GgmlType::Q5_1, rows, blocks * QK, tokens, seed);
    }
}
