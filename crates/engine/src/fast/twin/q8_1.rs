//! Twin of `mmvq_gguf_quantize_q8_1_f32` (candle-kernels 0.11.1, `src/mmvq_gguf.cu`): f32
//! activations to Q8_1 blocks, the input the MMVQ matmuls ([`super::mmvq`]) read.
//!
//! One CUDA thread per value, one warp per block of 32:
//!
//! ```text
//! const float xi = (ix < kx) ? x[iy * kx + ix] : 0.0f;
//! float amax = fabsf(xi);
//! float sum = xi;
//! amax = warp_reduce_max_f32(amax);
//! sum = warp_reduce_sum_f32(sum);
//! const float d = amax / 127.0f;
//! const int8_t q = (amax == 0.0f) ? 0 : (int8_t)roundf(xi / d);
//! y[ib].qs[iqs] = q;
//! ... y[ib].ds = ((half)d, (half)sum);
//! ```
//!
//! `d` and every `q` are bit-exact here: a maximum does not depend on order, the kernels are built
//! without `--use_fast_math` (IEEE division), and C's `roundf` rounds half away from zero as
//! [`f32::round`] does. The sum `s` is not: the kernel adds the 32 values in a butterfly (warp
//! shuffle) order and this twin adds them left to right, so the f32 sums may differ in their last
//! bits, and `s` (that sum rounded to f16) may then differ in its last bit.

use half::f16;

use crate::fast::layout::{BlockQ8_1, QK8_1};

/// Quantizes one block of 32 values exactly as the kernel does (but for the order of the sum).
fn quantize_block(x: &[f32; QK8_1]) -> BlockQ8_1 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let sum: f32 = x.iter().sum();
    let d = amax / 127.0f32;
    let mut qs = [0i8; QK8_1];
    if amax != 0.0 {
        for (q, &v) in qs.iter_mut().zip(x) {
            // |v / d| <= 127 up to rounding, so the cast (saturating in Rust, undefined out of
            // range in C) never leaves the range where the two agree.
            *q = (v / d).round() as i8;
        }
    }
    BlockQ8_1 {
        d: f16::from_f32(d),
        s: f16::from_f32(sum),
        qs,
    }
}

/// Quantizes one row of activations to Q8_1 blocks: block `b` holds values `32 b .. 32 b + 32`,
/// and values past `x.len()` are zeros (the padding up to `out.len() × 32` the kernel writes).
///
/// Precondition: `out.len() × 32 >= x.len()`; values beyond `out`'s blocks are not read.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert!(out.len() * QK8_1 >= x.len(), "Q8_1 row too short");
    for (b, block) in out.iter_mut().enumerate() {
        let mut vals = [0.0f32; QK8_1];
        let start = (b * QK8_1).min(x.len());
        let end = ((b + 1) * QK8_1).min(x.len());
        vals[..end - start].copy_from_slice(&x[start..end]);
        *block = quantize_block(&vals);
    }
}

/// Quantizes `rows` rows of `k` values (row-major `[rows][k]` in `x`) into `rows × k_padded / 32`
/// blocks, each row padded with zeros to `k_padded` values, as `launch_mmvq_gguf_quantize_q8_1_f32`
/// does with `kx = k`, `kx_padded = k_padded`, `num_rows = rows`.
///
/// Precondition: `k_padded >= k`, `k_padded` a multiple of 32, `x.len() >= rows × k`.
pub fn quantize_rows_q8_1(x: &[f32], rows: usize, k: usize, k_padded: usize) -> Vec<BlockQ8_1> {
    debug_assert!(k_padded >= k && k_padded.is_multiple_of(QK8_1) && x.len() >= rows * k);
    let per_row = k_padded / QK8_1;
    let mut out = vec![BlockQ8_1::default(); rows * per_row];
    for (r, blocks) in out.chunks_exact_mut(per_row.max(1)).enumerate().take(rows) {
        let start = (r * k).min(x.len());
        let end = ((r + 1) * k).min(x.len());
        quantize_row_q8_1(&x[start..end], blocks);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_quantize_to_a_zero_scale() {
        let mut out = [BlockQ8_1::default(); 2];
        out[1].qs = [5; 32];
        quantize_row_q8_1(&[0.0; 64], &mut out);
        for b in &out {
            assert_eq!(b.d.to_bits(), 0);
            assert_eq!(b.s.to_bits(), 0);
            assert_eq!(b.qs, [0; 32]);
        }
    }

    #[test]
    fn amax_127_gives_unit_scale_and_rounded_values() {
        let mut x = [0.0f32; 32];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 3.3;
        }
        x[0] = -127.0;
        x[31] = 2.5; // half-way: away from zero
        x[30] = -2.5;
        x[29] = 0.5;
        x[28] = -0.5;
        x[27] = 1.49;
        let mut out = [BlockQ8_1::default()];
        quantize_row_q8_1(&x, &mut out);
        let b = out[0];
        assert_eq!(b.d.to_f32(), 1.0);
        let sum: f32 = x.iter().sum();
        assert_eq!(b.s, f16::from_f32(sum));
        assert_eq!(b.qs[0], -127);
        assert_eq!(b.qs[31], 3);
        assert_eq!(b.qs[30], -3);
        assert_eq!(b.qs[29], 1);
        assert_eq!(b.qs[28], -1);
        assert_eq!(b.qs[27], 1);
        for i in 1..27 {
            let want = ((i as f32 - 16.0) * 3.3).round() as i8;
            assert_eq!(b.qs[i], want, "{i}");
        }
    }

    #[test]
    fn scale_is_amax_over_127_and_values_reconstruct() {
        let x: Vec<f32> = (0..32)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.173)
            .collect();
        let mut out = [BlockQ8_1::default()];
        quantize_row_q8_1(&x, &mut out);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        assert_eq!(out[0].d, f16::from_f32(d));
        for (i, (&q, &v)) in out[0].qs.iter().zip(&x).enumerate() {
            assert_eq!(q, (v / d).round() as i8, "{i}");
            assert!((q as f32 * d - v).abs() <= 0.5 * d * (1.0 + 1e-6), "{i}");
        }
        assert!(out[0].qs.iter().any(|&q| q.abs() == 127));
    }

    #[test]
    fn rows_are_padded_with_zero_blocks() {
        // k = 40: block 1 of each row holds 8 values then 24 zeros; blocks 2.. are all zeros.
        let (rows, k, k_padded) = (2, 40, 512);
        let x: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let q = quantize_rows_q8_1(&x, rows, k, k_padded);
        assert_eq!(q.len(), rows * k_padded / 32);
        for r in 0..rows {
            let row = &q[r * 16..(r + 1) * 16];
            let mut first = [BlockQ8_1::default(); 2];
            quantize_row_q8_1(&x[r * k..(r + 1) * k], &mut first);
            assert_eq!(&row[..2], &first[..]);
            let mut tail = [0.0f32; 32];
            tail[..8].copy_from_slice(&x[r * k + 32..(r + 1) * k]);
            let mut want = [BlockQ8_1::default()];
            quantize_row_q8_1(&tail, &mut want);
            assert_eq!(row[1], want[0]);
            assert_eq!(&row[1].qs[8..], &[0i8; 24]);
            for b in &row[2..] {
                assert_eq!(*b, BlockQ8_1::default());
            }
        }
    }
}
