//! Activation quantization, bit for bit as ggml's x86 build does it.
//!
//! llama.cpp quantizes each activation row to the weight type's dot-product partner before a
//! matrix product; matching its rounding exactly is what keeps our logits on llama.cpp's side of
//! near-ties. The rules (ggml-cpu/arch/x86/quants.c and ggml-quants.c):
//! - Q8_0 / Q8_1 (32 values): `d = amax / 127`, `id = 127 / amax` (0 when amax is 0),
//!   `q = round_half_even(x * id)` (`_mm256_round_ps(_MM_ROUND_NEAREST)`), `d` stored as f16;
//!   Q8_1 also stores `s = f16(d * Σq)` with the f32 `d`.
//! - Q8_K (256 values, `quantize_row_q8_K_ref`): `max` is the first value of largest magnitude
//!   (sign kept), `iscale = -127 / max`, `q = min(127, nearest_int(iscale * x))` where
//!   `nearest_int` rounds half to even, `d = 1 / iscale` (f32), `bsums[j] = Σ q[16j..16j+16]`;
//!   an all-zero block has `d = 0` and zero quants.
//!
//! Two outputs exist: [`Acts`], the layout our kernels read (quants contiguous per token, scales and
//! precomputed integer corrections beside them), and candle's block structs for the types that
//! still go through candle's `vec_dot`.

use half::f16;

/// Which partner format the activations were quantized to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActKind {
    /// Q8_0, 32-value blocks, with `bias[i] = -bias_mul * Σq` over each run of `bias_group`
    /// values (32: one per block; 4: one per `vpdpbusd` lane): the kernels' correction for weights
    /// stored as unsigned `q + bias_mul`.
    Q8_0 { bias_mul: i32, bias_group: usize },
    /// Q8_1, 32-value blocks, with `s`.
    Q8_1,
    /// Q8_K, 256-value blocks.
    Q8K,
}

/// Quantized activations for `n_tokens` rows of `cols` values.
///
/// For 32-value kinds, block `b` of token `t` has index `t * nblk + b` (Q8_0's `bias` has
/// `32 / bias_group` entries per block); for Q8_K, the 256-value
/// super-block `b` has `d[t * nblk + b]`, sixteen `bias` entries (one per 16 values, `-32 * bsum`,
/// the Q6_K offset) and eight `bsum32` entries (sums of 32 values, paired for `vpdpwssd`).
pub struct Acts {
    pub kind: ActKind,
    pub n_tokens: usize,
    pub cols: usize,
    /// Blocks per token row.
    pub nblk: usize,
    /// `[t * cols + c]`.
    pub qs: Vec<i8>,
    /// Block scale as the kernels multiply it (f16-rounded for Q8_0/Q8_1, f32 for Q8_K).
    pub d: Vec<f32>,
    /// Q8_1 only: `f16(d * Σq)` widened to f32.
    pub s: Vec<f32>,
    /// Integer correction each block's accumulator starts from (see the type docs).
    pub bias: Vec<i32>,
    /// Q8_K only: Σq over each 32 values.
    pub bsum32: Vec<i16>,
}

impl Acts {
    /// Quantizes `x` (`n_tokens * cols` values; `cols` a multiple of the block size).
    pub fn quantize(kind: ActKind, x: &[f32], n_tokens: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), n_tokens * cols);
        let blk = match kind {
            ActKind::Q8K => 256,
            _ => 32,
        };
        debug_assert_eq!(cols % blk, 0);
        let nblk = cols / blk;
        let n = n_tokens * nblk;
        let mut a = Acts {
            kind,
            n_tokens,
            cols,
            nblk,
            qs: vec![0; n_tokens * cols],
            d: vec![0.0; n],
            s: if kind == ActKind::Q8_1 {
                vec![0.0; n]
            } else {
                Vec::new()
            },
            bias: vec![
                0;
                match kind {
                    ActKind::Q8K => n * 16,
                    ActKind::Q8_0 { bias_group, .. } => n_tokens * cols / bias_group,
                    ActKind::Q8_1 => 0,
                }
            ],
            bsum32: if kind == ActKind::Q8K {
                vec![0; n * 8]
            } else {
                Vec::new()
            },
        };
        match kind {
            ActKind::Q8_0 {
                bias_mul,
                bias_group,
            } => {
                debug_assert!(bias_group > 0 && 32 % bias_group == 0);
                for ((xb, qb), d) in x
                    .chunks_exact(32)
                    .zip(a.qs.chunks_exact_mut(32))
                    .zip(a.d.iter_mut())
                {
                    *d = quantize_block_32(xb, qb).0.to_f32();
                }
                for (q, bias) in a.qs.chunks_exact(bias_group).zip(a.bias.iter_mut()) {
                    *bias = -bias_mul * q.iter().map(|&v| v as i32).sum::<i32>();
                }
            }
            ActKind::Q8_1 => {
                for (((xb, qb), d), s) in x
                    .chunks_exact(32)
                    .zip(a.qs.chunks_exact_mut(32))
                    .zip(a.d.iter_mut())
                    .zip(a.s.iter_mut())
                {
                    let (dh, sum) = quantize_block_32(xb, qb);
                    *d = dh.to_f32();
                    *s = q8_1_sum(xb, sum).to_f32();
                }
            }
            ActKind::Q8K => {
                for (i, (xb, qb)) in x
                    .chunks_exact(256)
                    .zip(a.qs.chunks_exact_mut(256))
                    .enumerate()
                {
                    let mut bsums = [0i16; 16];
                    a.d[i] = quantize_block_k(xb, qb, &mut bsums);
                    for (j, &bs) in bsums.iter().enumerate() {
                        a.bias[i * 16 + j] = -32 * bs as i32;
                    }
                    for j in 0..8 {
                        a.bsum32[i * 8 + j] = bsums[2 * j] + bsums[2 * j + 1];
                    }
                }
            }
        }
        a
    }

    /// Quants of token `t`.
    pub fn row(&self, t: usize) -> &[i8] {
        &self.qs[t * self.cols..(t + 1) * self.cols]
    }
}

/// The absolute maximum, as the x86 build computes it (`max_ps` of absolute values: NaN-free
/// inputs give the same value in any order).
#[inline]
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// ggml's x86 `quantize_row_q8_0` for one block: returns the f16 scale and Σq.
#[inline]
pub fn quantize_block_32(x: &[f32], q: &mut [i8]) -> (f16, i32) {
    debug_assert_eq!((x.len(), q.len()), (32, 32));
    let amax = amax(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // |v * id| <= 127 by construction, so the cast cannot saturate.
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    (f16::from_f32(d), sum)
}

/// Q8_1's `s = f16(d * Σq)` with the f32 `d`, as ggml's x86 `quantize_row_q8_1` computes it.
#[inline]
fn q8_1_sum(x: &[f32], sum: i32) -> f16 {
    let d = amax(x) / 127.0;
    f16::from_f32(d * sum as f32)
}

/// ggml's `quantize_row_q8_K_ref` for one 256-value block: returns `d`.
pub fn quantize_block_k(x: &[f32], q: &mut [i8], bsums: &mut [i16; 16]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax == 0.0 {
        q.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (j, bs) in bsums.iter_mut().enumerate() {
        *bs = q[16 * j..16 * j + 16].iter().map(|&v| v as i16).sum();
    }
    1.0 / iscale
}

/// ggml's `nearest_int`: round half to even (the magic-number trick is exact for |v| < 2^22, and
/// the values here are at most 127 in magnitude).
#[inline]
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// Layout twins of candle's activation blocks (`repr(C)`, same fields, same order; sizes are
/// checked below), so the candle path can be fed from the ggml-faithful quantizers.
#[repr(C)]
pub struct Q8_0Block {
    pub d: f16,
    pub qs: [i8; 32],
}

#[repr(C)]
pub struct Q8_1Block {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; 32],
}

#[repr(C)]
pub struct Q8KBlock {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

const _: () = {
    use candle_core::quantized::k_quants::{BlockQ8K, BlockQ8_0, BlockQ8_1};
    use std::mem::{align_of, size_of};
    assert!(size_of::<Q8_0Block>() == size_of::<BlockQ8_0>());
    assert!(size_of::<Q8_1Block>() == size_of::<BlockQ8_1>());
    assert!(size_of::<Q8KBlock>() == size_of::<BlockQ8K>());
    assert!(align_of::<Q8_0Block>() == align_of::<BlockQ8_0>());
    assert!(align_of::<Q8_1Block>() == align_of::<BlockQ8_1>());
    assert!(align_of::<Q8KBlock>() == align_of::<BlockQ8K>());
};

pub fn quantize_q8_0_blocks(x: &[f32], out: &mut [Q8_0Block]) {
    for (xb, yb) in x.chunks_exact(32).zip(out.iter_mut()) {
        yb.d = quantize_block_32(xb, &mut yb.qs).0;
    }
}

pub fn quantize_q8_1_blocks(x: &[f32], out: &mut [Q8_1Block]) {
    for (xb, yb) in x.chunks_exact(32).zip(out.iter_mut()) {
        let (d, sum) = quantize_block_32(xb, &mut yb.qs);
        yb.d = d;
        yb.s = q8_1_sum(xb, sum);
    }
}

pub fn quantize_q8k_blocks(x: &[f32], out: &mut [Q8KBlock]) {
    for (xb, yb) in x.chunks_exact(256).zip(out.iter_mut()) {
        yb.d = quantize_block_k(xb, &mut yb.qs, &mut yb.bsums);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_rounds_half_to_even_with_127_over_amax() {
        // amax 127 makes id exactly 1, so x * id lands on the .5 ties unchanged.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 3.5;
        x[4] = 0.5;
        let mut q = [0i8; 32];
        let (d, sum) = quantize_block_32(&x, &mut q);
        assert_eq!(&q[..5], &[127, 2, -2, 4, 0]);
        assert_eq!(sum, 131);
        assert_eq!(d, f16::from_f32(1.0));
        let mut z = [0i8; 32];
        assert_eq!(quantize_block_32(&[0.0; 32], &mut z), (f16::ZERO, 0));
    }

    #[test]
    fn q8k_uses_signed_max_and_clamps_at_127() {
        let mut x = [0f32; 256];
        x[3] = -127.0; // the first value of largest magnitude: iscale = 1
        x[4] = 127.0;
        x[5] = 0.5; // rounds to 0
        x[6] = -1.5; // rounds to -2
        x[7] = 2.5; // rounds to 2
        let mut q = [0i8; 256];
        let mut bs = [0i16; 16];
        let d = quantize_block_k(&x, &mut q, &mut bs);
        assert_eq!(d, 1.0);
        assert_eq!(&q[3..8], &[-127, 127, 0, -2, 2]);
        // A negative max makes iscale positive.
        let mut y = [0f32; 256];
        y[0] = -1.0;
        y[1] = 1.0;
        let d = quantize_block_k(&y, &mut q, &mut bs);
        assert_eq!(d, 1.0 / 127.0);
        assert_eq!(&q[..2], &[-127, 127]);
        assert_eq!(bs[0], 0);
    }

    #[test]
    fn acts_bias_and_sums() {
        let x: Vec<f32> = (0..512).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        let a = Acts::quantize(ActKind::Q8K, &x, 2, 256);
        for t in 0..2 {
            let q = a.row(t);
            for j in 0..16 {
                let s: i32 = q[16 * j..16 * j + 16].iter().map(|&v| v as i32).sum();
                assert_eq!(a.bias[t * 16 + j], -32 * s);
            }
            for j in 0..8 {
                let s: i32 = q[32 * j..32 * j + 32].iter().map(|&v| v as i32).sum();
                assert_eq!(a.bsum32[t * 8 + j] as i32, s);
            }
        }
        for group in [4, 32] {
            let kind = ActKind::Q8_0 {
                bias_mul: 8,
                bias_group: group,
            };
            let a = Acts::quantize(kind, &x, 2, 256);
            for b in 0..512 / group {
                let s: i32 = a.qs[group * b..group * (b + 1)]
                    .iter()
                    .map(|&v| v as i32)
                    .sum();
                assert_eq!(a.bias[b], -8 * s);
            }
        }
    }
}
