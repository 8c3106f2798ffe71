//! Float weights (F32, F16, BF16, rows of any length): dequantized to f32 at load, multiplied
//! by the unquantized inputs with the SIMD dot product of [`crate::ops::dot`].

use super::{QActs, ROW_TILE, TileOut};
use crate::quant::{GgmlType, dequantize};

/// The `rows` rows that `row_of` gives, as f32.
pub(super) fn pack<'a>(rows: usize, cols: usize, row_of: impl Fn(usize) -> (GgmlType, &'a [u8])) -> Vec<f32> {
    let mut w = vec![0f32; rows * cols];
    for (r, out) in w.chunks_exact_mut(cols).enumerate() {
        let (ty, bytes) = row_of(r);
        dequantize(ty, bytes, out);
    }
    w
}

/// One row tile of `w` (`rows × cols`) against tokens `tok..tok + nt` of `x`.
#[allow(clippy::too_many_arguments)]
pub(super) fn f32_tile(
    w: &[f32],
    cols: usize,
    rows: usize,
    tile: usize,
    x: &QActs,
    tok: usize,
    nt: usize,
    out: &mut TileOut,
) {
    out.fill(0.0);
    for lane in 0..ROW_TILE {
        let r = tile * ROW_TILE + lane;
        if r >= rows {
            break;
        }
        let wr = &w[r * cols..(r + 1) * cols];
        for t in 0..nt {
            let xr = &x.x[(tok + t) * cols..(tok + t + 1) * cols];
            out[t * ROW_TILE + lane] = crate::ops::dot(wr, xr);
        }
    }
}
