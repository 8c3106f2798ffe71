//! Compute kernels for Warden, behind one [`Backend`] trait.
//!
//! * [`quant`]: the ggml block formats and their scalar dequantization.
//! * [`matmul`]: weights repacked for AVX-512 VNNI, 8-bit activations, a scalar reference.
//! * [`ops`]: RMSNorm, RoPE, SwiGLU, softmax.
//! * [`attention`]: paged attention that checks each page's tag before reading it.
//!
//! The crate has no async and no I/O; all parallelism goes through the rayon pool, whose size the
//! binary sets (one thread per core by default).
#![deny(missing_docs)]

pub use backend::{Backend, CpuBackend};

pub mod attention;
pub mod backend;
pub mod matmul;
pub mod ops;
pub mod quant;
pub mod tag;
