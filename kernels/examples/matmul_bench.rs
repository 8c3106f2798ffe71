//! Matmul kernel throughput on SmolLM2-135M's layer shapes: for each kernel this CPU has, the
//! multiply-accumulates per second of a prefill-sized batch (512 tokens) and of single-token
//! decode, on the whole rayon pool. Weights are random Q4_1 blocks, or random values of the
//! float type named (F16, BF16, F32); the figures depend only on the shapes and the type.
//!
//! `cargo run --release -p warden-kernels --example matmul_bench [-- F16]`

use std::time::Instant;

use warden_kernels::matmul::{Kernel, QActs, QMatrix};
use warden_kernels::quant::GgmlType;

/// (rows, cols) of one layer's matmuls: QKV, output projection, gate+up, down.
const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];

fn random_q4_1(rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    };
    let blocks = rows * cols / 32;
    let mut out = Vec::with_capacity(blocks * 20);
    for _ in 0..blocks {
        out.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        out.extend_from_slice(&half::f16::from_f32(-0.08).to_le_bytes());
        out.extend((0..16).map(|_| next() as u8));
    }
    out
}

/// Random values in [−1, 1) of a float type, in its file layout.
fn random_float(ty: GgmlType, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    (0..rows * cols)
        .flat_map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let v = (*seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            match ty {
                GgmlType::F32 => v.to_le_bytes().to_vec(),
                GgmlType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                _ => half::f16::from_f32(v).to_le_bytes().to_vec(),
            }
        })
        .collect()
}

fn main() {
    let ty = match std::env::args().nth(1).as_deref() {
        None | Some("Q4_1") => GgmlType::Q4_1,
        Some("F16") => GgmlType::F16,
        Some("BF16") => GgmlType::BF16,
        Some("F32") => GgmlType::F32,
        Some(other) => {
            eprintln!("matmul_bench: unknown type {other} (Q4_1, F16, BF16 or F32)");
            std::process::exit(2);
        }
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mats: Vec<QMatrix> = SHAPES
        .iter()
        .map(|&(r, c)| {
            let w = match ty {
                GgmlType::Q4_1 => random_q4_1(r, c, &mut seed),
                _ => random_float(ty, r, c, &mut seed),
            };
            QMatrix::from_ggml(ty, r, c, &w).expect("valid shape")
        })
        .collect();
    println!("type: {ty}");
    let macs_per_token: usize = SHAPES.iter().map(|(r, c)| r * c).sum();
    println!("threads: {}", rayon::current_num_threads());
    for tokens in [512usize, 1] {
        let acts: Vec<QActs> = SHAPES
            .iter()
            .map(|&(_, c)| {
                let x: Vec<f32> = (0..tokens * c)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut a = QActs::new();
                a.quantize(&x, c);
                a
            })
            .collect();
        let mut outs: Vec<Vec<f32>> = SHAPES.iter().map(|&(r, _)| vec![0f32; r * tokens]).collect();
        let reps = if tokens == 1 { 2000 } else { 8 };
        for kernel in Kernel::available() {
            if kernel == Kernel::Scalar && tokens > 1 {
                continue;
            }
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t0 = Instant::now();
                rayon::scope(|_| {
                    for _ in 0..reps {
                        for ((m, a), o) in mats.iter().zip(&acts).zip(outs.iter_mut()) {
                            m.matmul_with(a, o, kernel);
                        }
                    }
                });
                best = best.min(t0.elapsed().as_secs_f64());
            }
            let gmacs = (macs_per_token * tokens * reps) as f64 / best / 1e9;
            println!(
                "tokens {tokens:>3}  {kernel:?}: {gmacs:.1} GMAC/s ({:.0} layer-passes/s)",
                (tokens * reps) as f64 / best
            );
        }
    }
}
