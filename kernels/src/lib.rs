//! Compute kernels for Warden, behind one [`Backend`] trait.
#![deny(missing_docs)]

pub mod quant;
