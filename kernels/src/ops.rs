//! Elementwise and row-wise operations of a llama block: RMSNorm, RoPE, SwiGLU, softmax.
//!
//! These are small next to the matmuls; they are written so LLVM vectorises them (chunked
//! accumulators, no bounds checks in inner loops) rather than with intrinsics.

/// Dot product with eight independent accumulators (vectorises to 256/512-bit FMAs).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
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

/// `y += a · x`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += xi * a;
    }
}

/// RMSNorm of each `w.len()`-wide row of `x` into `out`: `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(x.len() == out.len() && x.len().is_multiple_of(n));
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss = dot(xr, xr) as f64 / n as f64;
        let scale = (1.0 / (ss + eps as f64).sqrt()) as f32;
        for ((o, &xi), &wi) in or.iter_mut().zip(xr).zip(w) {
            *o = xi * scale * wi;
        }
    }
}

/// Rotary position embedding tables for one model: `cos`/`sin` of `pos · base^(−2i/d)`.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Tables for heads of `head_dim` (even) rotated over `rot_dim ≤ head_dim` dimensions.
    pub fn new(head_dim: usize, rot_dim: usize, base: f32) -> Self {
        assert!(rot_dim.is_multiple_of(2) && rot_dim <= head_dim);
        let inv_freq = (0..rot_dim / 2)
            .map(|i| base.powf(-2.0 * i as f32 / rot_dim as f32))
            .collect();
        Self { head_dim, inv_freq }
    }

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head of every row of `x` (llama.cpp's
    /// "normal" RoPE, as GGUF llama models expect) by the angle for that row's position.
    pub fn apply(&self, x: &mut [f32], row_width: usize, positions: &[u32]) {
        assert!(row_width.is_multiple_of(self.head_dim) && x.len() == row_width * positions.len());
        for (row, &pos) in x.chunks_exact_mut(row_width).zip(positions) {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let theta = pos as f32 * f;
                let (s, c) = theta.sin_cos();
                for head in row.chunks_exact_mut(self.head_dim) {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * c - b * s;
                    head[2 * i + 1] = a * s + b * c;
                }
            }
        }
    }
}

/// `out[i] = silu(gate[i]) · up[i]` where each row of `gate_up` is `[gate | up]`, `width` each.
pub fn swiglu(gate_up: &[f32], width: usize, out: &mut [f32]) {
    assert!(gate_up.len() == 2 * out.len() && out.len().is_multiple_of(width));
    for (gu, o) in gate_up.chunks_exact(2 * width).zip(out.chunks_exact_mut(width)) {
        let (g, u) = gu.split_at(width);
        for ((oi, &gi), &ui) in o.iter_mut().zip(g).zip(u) {
            *oi = gi / (1.0 + (-gi).exp()) * ui;
        }
    }
}

/// In-place softmax of `x`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
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
    fn dot_handles_remainders() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        assert_eq!(dot(&a, &a), (0..37).map(|i| (i * i) as f32).sum::<f32>());
    }
}
