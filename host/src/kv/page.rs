//! A page as a holder or a transfer sees it: what [`KvPool::inspect`](super::KvPool::inspect)(super::KvPool::inspect)
//! tells ([`PageInfo`]), a page's content in transit ([`PageData`]), and their checksum.

use half::f16;
use xxhash_rust::xxh3::Xxh3;

/// What [`KvPool::inspect`](super::KvPool::inspect) tells a page's holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PageInfo {
    /// Token slots written.
    pub written: u32,
    /// Allocation epoch.
    pub epoch: u32,
    /// A 64-bit checksum of the written K and V (not cryptographic: it detects corruption and
    /// change, it does not authenticate).
    pub checksum: u64,
}

/// A page's content as a transfer carries it (invariant 7): the written slots' K and V of every
/// layer, layer by layer, and their checksum as [`KvPool::inspect`](super::KvPool::inspect) computes it.
#[derive(Debug, Clone, PartialEq)]
pub struct PageData {
    /// Token slots written, from slot 0.
    pub written: u32,
    /// K rows: `n_layers × written × kv_dim` values.
    pub k: Vec<f16>,
    /// V rows, laid out as `k`.
    pub v: Vec<f16>,
    /// Checksum of the written K and V.
    pub checksum: u64,
}

impl PageData {
    /// The checksum of this content, computed afresh (to compare with `checksum`).
    pub fn computed_checksum(&self, n_layers: usize) -> u64 {
        let mut sum = Checksum::default();
        let per_layer = self.k.len().checked_div(n_layers).unwrap_or(0);
        for l in 0..n_layers {
            sum.add(&self.k[l * per_layer..(l + 1) * per_layer]);
            sum.add(&self.v[l * per_layer..(l + 1) * per_layer]);
        }
        sum.finish()
    }
}

/// The checksum of a page's content: xxh3-64 over its written K and V, layer by layer, each value
/// as its two little-endian bytes (so nodes of any endianness agree).
pub(super) struct Checksum(Xxh3);

impl Default for Checksum {
    fn default() -> Self {
        Self(Xxh3::new())
    }
}

impl Checksum {
    pub(super) fn add(&mut self, xs: &[f16]) {
        const CHUNK: usize = 4096;
        let mut buf = [0u8; 2 * CHUNK];
        for chunk in xs.chunks(CHUNK) {
            let bytes = &mut buf[..2 * chunk.len()];
            for (b, x) in bytes.chunks_exact_mut(2).zip(chunk) {
                b.copy_from_slice(&x.to_bits().to_le_bytes());
            }
            self.0.update(bytes);
        }
    }

    pub(super) fn finish(&self) -> u64 {
        self.0.digest()
    }
}
