//! Warden's scalar dequantizer against an independent one: `tests/fixtures/dequant.txt` holds
//! random blocks of Q5_0, Q5_1 and every K-quant with the values the `gguf` Python package's
//! `gguf.quants.dequantize` gives them (made by `scripts/dequant-vectors.py`). They must agree
//! bit for bit: both compute each value with the same few f32 operations in the same order
//! (`scale · q − min`), so any difference is a layout mistake, not rounding.

use warden_kernels::quant::{GgmlType, dequantize};

fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn every_block_type_dequantizes_as_the_gguf_package_does() {
    let text = include_str!("fixtures/dequant.txt");
    let mut lines = text.lines();
    let mut seen = Vec::new();
    while let Some(head) = lines.next() {
        let f: Vec<&str> = head.split(' ').collect();
        assert_eq!((f.len(), f[0]), (4, "TYPE"), "a type line: {head}");
        let id: u32 = f[2].parse().expect("type id");
        let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("{} (id {id}) is a type Warden reads", f[1]));
        assert_eq!(ty.to_string(), f[1]);
        let bytes = hex_bytes(lines.next().expect("bytes"));
        let want: Vec<f32> = lines
            .next()
            .expect("values")
            .split(' ')
            .map(|b| f32::from_bits(u32::from_str_radix(b, 16).expect("bits")))
            .collect();
        let blocks: usize = f[3].parse().expect("block count");
        assert_eq!(bytes.len(), blocks * ty.block_bytes(), "{ty}: bytes");
        assert_eq!(want.len(), blocks * ty.block_elems(), "{ty}: values");
        let mut got = vec![0f32; want.len()];
        dequantize(ty, &bytes, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits(),
                "{ty} value {i} (block {}, element {}): Warden {g}, gguf {w}",
                i / ty.block_elems(),
                i % ty.block_elems()
            );
        }
        seen.push(ty);
    }
    assert_eq!(seen.len(), 7, "every type of the fixture: {seen:?}");
}
