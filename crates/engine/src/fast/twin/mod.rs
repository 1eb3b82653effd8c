//! The Rust twins of the fast tier's GPU kernels: the same algorithms over byte-identical
//! layouts ([`crate::fast::layout`]). Each states its contract with its kernel: integer parts
//! (quantized values, integer dot products, indices) bit-exact, float parts within a stated
//! tolerance (the kernels reduce in other orders). The CPU runner executes plans with them.

pub mod attention;
pub mod f16mm;
pub mod flash;
pub mod matvec;
pub mod mmvq;
pub mod norm;
pub mod q8_1;
pub mod rope;
pub mod sample;
