//! The types every kernel and the matrix-product driver share: a kernel's signature, the choice
//! of kernel for a format and instruction set, and the unpacked fast path. Kept apart from the
//! driver ([`super::gemm`]) so the kernels depend on these types and the driver on the kernels,
//! never the other way round.

use super::act::Acts;
use super::scalar::FloatOrder;

/// Computes the sixteen rows of one packed group against tokens `t0..t0 + nt` of `acts`, writing
/// row `l` of token `t0 + t` to `out.add(t * stride + l)`.
///
/// # Safety
/// `g` is a whole packed group of the format the kernel was chosen for, with `acts.nblk` blocks
/// and activations of the matching kind; `t0 + nt <= acts.n_tokens`; `out.add(t * stride + l)`
/// is valid for writes for all `t < nt`, `l < 16`, and nothing else accesses those floats during
/// the call. The CPU supports the kernel's instruction set.
pub type Kernel =
    unsafe fn(g: &[u8], acts: &Acts, t0: usize, nt: usize, out: *mut f32, stride: usize);

/// A kernel, the number of tokens it wants per call (its register tile), and the float order of
/// its Q4_1 and Q8_0 products: the scalar kernel in that order is its bit-for-bit reference.
#[derive(Clone, Copy)]
pub struct KernelChoice {
    pub kernel: Kernel,
    pub tile: usize,
    pub order: FloatOrder,
    /// A faster path for products of many tokens, where a group's weights are reused by every
    /// token tile: each cache-sized chunk of groups is unpacked once into a scratch buffer (same
    /// integers and scales, so the same result bit for bit) and the tiles run on that.
    pub unpacked: Option<Unpacked>,
}

/// See [`KernelChoice::unpacked`].
#[derive(Clone, Copy)]
pub struct Unpacked {
    /// Bytes of one unpacked block of sixteen rows.
    pub block_bytes: usize,
    /// Unpacks a whole packed group of `nblk` blocks into `out` (`nblk * block_bytes` long).
    ///
    /// # Safety
    /// `g` is a packed group of the kernel's format with `nblk` blocks; the CPU supports the
    /// kernel's instruction set.
    pub unpack: unsafe fn(g: &[u8], nblk: usize, out: &mut [u8]),
    /// A [`Kernel`] whose `g` is an unpacked group.
    pub kernel: Kernel,
}

/// How many K-quant (Q4_K, Q6_K) super-blocks ahead of its loads a tile of `tokens` tokens
/// prefetches its weights, on every SIMD path: 3 (7–10 KB) for one token's tile (decode, which
/// prefetches into L2: with that hint 3 beat 2 and 4 on Zen 4, AVX-512 medians 14.9, 14.7 and
/// 13.7 tok/s, AVX2 by 5.5% over 2 inside one process, docs/BENCHMARKS.md), 2 for tiles of
/// several tokens, as measured before.
pub const fn kq_prefetch_blocks(tokens: usize) -> usize {
    if tokens == 1 {
        3
    } else {
        2
    }
}
