//! Twin of our own decode matrix-vector kernels (`matvec_<type>`, `matvec_swiglu_<type>` in
//! `cuda/kernels.cu`), which replace candle-kernels' MMVQ for steps of up to
//! [`MAX_ROWS`] activation rows.
//!
//! Why our own: MMVQ's per-row sums depend on how many rows a launch takes (its warps per block
//! change with the row count), so a decode row verifying drafts had to stay within a row class
//! (at most 4 rows for a lone conversation: 3 drafts). These kernels compute every output the
//! same way for 1 to 8 rows, and they fuse what MMVQ cannot: Q, K and V in one launch, gate, up,
//! SwiGLU and the down projection's Q8_1 quantization in one.
//!
//! The kernel: one warp per weight row. A row of `nb` weight blocks is `nb × S` units, `S =`
//! [`mmvq::slices`] (the slices of llama.cpp's `vec_dot_<type>_q8_1`, whose integer parts
//! [`mmvq::slice_ints`] states bit for bit); lane `l` takes units `l, l + 32, …` in order and, for
//! each activation row, adds the unit's value ([`slice_value`]) to its accumulator; the 32 lanes'
//! accumulators are then added in a butterfly (`__shfl_xor_sync` 16, 8, 4, 2, 1) and lane 0
//! writes the sum. Every float operation is spelled with `__fmul_rn`/`__fadd_rn`/`__fsub_rn`, so
//! the compiler contracts none into an FMA, and this twin performs the same operations in the
//! same order: **given the same Q8_1 rows, its outputs are the kernel's bit for bit** (the
//! integer parts are exact by construction; the kernels phase of `make gpu-lease` checks the
//! floats on a GPU). The Q8_1 rows themselves are [`super::q8_1`]'s, whose sums `s` may differ
//! in a last bit from the kernels' (only the legacy types Q4_0..Q5_1 read `s`).
//!
//! Row classes: an activation row's outputs do not depend on the other rows of the launch, nor
//! on their number, so every step of 1 to 8 rows computes each row alike
//! ([`crate::fast::launch::rows_computed_alike`]).

use smolchat_gguf::GgmlDType;

use super::mmvq::{check_supported, f16_at, row_bytes, slice_ints, slices};
use super::q8_1::quantize_rows_q8_1;
use crate::error::{EngineError, Result};
use crate::fast::layout::{padded_columns, BlockQ8_1, QK8_1};

/// The most activation rows one launch takes (`MATVEC_MAX_ROWS` in the kernels).
pub const MAX_ROWS: usize = 8;

/// Lanes of a warp.
const LANES: usize = 32;

/// The value of slice `s` of one weight block `b` against its Q8_1 blocks `y`, as a lane of
/// the kernel computes it (each line one rounded f32 operation, in this order):
///
/// - Q4_0: `d (sumi d8 − 4 s8)`; Q5_0: `d (sumi d8 − 8 s8)` (two slices: the −8/−16 offset is
///   applied half per slice through the block's sum `s8`);
/// - Q4_1, Q5_1: `sumi (d d8) + (m s8) / 2`;
/// - Q8_0: `sumi (d d8)`;
/// - Q2_K, Q4_K, Q5_K: `d Σ_c d8_c dot_c − dmin Σ_c d8_c min_c`, the sums left to right from 0;
/// - Q3_K, Q6_K: `d Σ_c d8_c dot_c`;
///
/// with `sumi`, `dot_c`, `min_c` the slice's integer parts converted to f32 (round to nearest).
pub fn slice_value(dtype: GgmlDType, b: &[u8], y: &[BlockQ8_1], s: usize) -> f32 {
    let p = slice_ints(dtype, b, y, s);
    let sumi = p.dot[0] as f32;
    let (d8, s8) = (y[0].d.to_f32(), y[0].s.to_f32());
    let sums = || {
        let (mut sd, mut sm) = (0.0f32, 0.0f32);
        for c in 0..p.len {
            let d8 = y[p.q8[c]].d.to_f32();
            sd += d8 * p.dot[c] as f32;
            sm += d8 * p.min[c] as f32;
        }
        (sd, sm)
    };
    match dtype {
        GgmlDType::Q4_0 => f16_at(b, 0) * (sumi * d8 - 4.0 * s8),
        GgmlDType::Q5_0 => f16_at(b, 0) * (sumi * d8 - 8.0 * s8),
        GgmlDType::Q4_1 | GgmlDType::Q5_1 => sumi * (f16_at(b, 0) * d8) + f16_at(b, 2) * s8 * 0.5,
        GgmlDType::Q8_0 => sumi * (f16_at(b, 0) * d8),
        GgmlDType::Q2K => {
            let (sd, sm) = sums();
            f16_at(b, 80) * sd - f16_at(b, 82) * sm
        }
        GgmlDType::Q4K | GgmlDType::Q5K => {
            let (sd, sm) = sums();
            f16_at(b, 0) * sd - f16_at(b, 2) * sm
        }
        GgmlDType::Q3K => f16_at(b, 108) * sums().0,
        GgmlDType::Q6K => f16_at(b, 208) * sums().0,
        _ => 0.0,
    }
}

/// The butterfly of `__shfl_xor_sync` offsets 16, 8, 4, 2, 1 (each lane adding its partner's
/// value to its own), as lane 0 ends it.
pub fn butterfly(mut lanes: [f32; LANES]) -> f32 {
    for m in [16, 8, 4, 2, 1] {
        let old = lanes;
        for (i, v) in lanes.iter_mut().enumerate() {
            *v = old[i] + old[i ^ m];
        }
    }
    lanes[0]
}

/// One output: weight row `row` (the GGUF blocks of `k` values) against one Q8_1 activation row
/// `y` (at least `k / 32` blocks), with the kernel's lanes and butterfly.
fn row_dot(dtype: GgmlDType, row: &[u8], y: &[BlockQ8_1], k: usize) -> f32 {
    let (bs, ts) = (dtype.block_size(), dtype.type_size());
    let (nb, per, s) = (k / bs, bs / QK8_1, slices(dtype));
    let mut lanes = [0.0f32; LANES];
    for unit in 0..nb * s {
        let (blk, slice) = (unit / s, unit % s);
        let b = &row[blk * ts..(blk + 1) * ts];
        lanes[unit % LANES] += slice_value(dtype, b, &y[blk * per..(blk + 1) * per], slice);
    }
    butterfly(lanes)
}

/// `out[r × n + j]` = weight row `j` of `w` (`n` rows of `k` values of `dtype`) against Q8_1
/// row `r` of `q8` (`rows` rows of [`padded_columns`]`(k) / 32` blocks, as the fast tier lays
/// them out), for `rows` ≤ [`MAX_ROWS`]: what `matvec_<type>` writes.
pub fn matvec(
    dtype: GgmlDType,
    w: &[u8],
    n: usize,
    k: usize,
    q8: &[BlockQ8_1],
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    check_supported(dtype)?;
    let rb = row_bytes(dtype, k);
    let per_row = padded_columns(k) / QK8_1;
    if rows > MAX_ROWS
        || !k.is_multiple_of(dtype.block_size())
        || w.len() != n * rb
        || q8.len() < rows * per_row
        || out.len() != rows * n
    {
        return Err(EngineError::InvalidStep(format!(
            "matvec {dtype:?} [{rows}×{k}]·[{n}×{k}]ᵀ: needs at most {MAX_ROWS} rows, k a \
             multiple of {}, {} weight bytes, {} Q8_1 blocks and {} outputs; got {}, {} and {}",
            dtype.block_size(),
            n * rb,
            rows * per_row,
            rows * n,
            w.len(),
            q8.len(),
            out.len()
        )));
    }
    for r in 0..rows {
        let y = &q8[r * per_row..(r + 1) * per_row];
        for (j, o) in out[r * n..(r + 1) * n].iter_mut().enumerate() {
            *o = row_dot(dtype, &w[j * rb..(j + 1) * rb], y, k);
        }
    }
    Ok(())
}

/// [`matvec`] over `m` f32 activation rows (`[m][k]`), quantized to Q8_1 first as the kernels
/// that write a matmul's input do ([`super::q8_1`]).
pub fn matmul(
    dtype: GgmlDType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) -> Result<()> {
    if x.len() != m * k {
        return Err(EngineError::InvalidStep(format!(
            "matvec {dtype:?}: {} inputs for {m} rows of {k}",
            x.len()
        )));
    }
    let q = quantize_rows_q8_1(x, m, k, padded_columns(k));
    matvec(dtype, w, n, k, &q, m, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::twin::mmvq;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    const TYPES: [GgmlDType; 10] = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    fn pseudo(i: usize, seed: usize) -> f32 {
        let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 10_007;
        h as f32 / 10_007.0 * 2.0 - 1.0
    }

    fn weights(dtype: GgmlDType, n: usize, k: usize) -> Vec<u8> {
        let values: Vec<f32> = (0..n * k)
            .map(|i| pseudo(i, 7) * (0.05 + (i / 16 % 9) as f32 * 0.05))
            .collect();
        let t = Tensor::from_vec(values, (n, k), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
        let q = QTensor::quantize(&t, dtype).unwrap_or_else(|e| panic!("{e}"));
        q.data().unwrap_or_else(|e| panic!("{e}")).into_owned()
    }

    /// Every type: each output within 1e-5 (relative to the sum of its terms' magnitudes) of
    /// candle's MMVQ order ([`mmvq::dot_q8_1`]), whose integer parts are the same slices'.
    #[test]
    fn outputs_agree_with_mmvq_for_every_type() {
        let (n, k, m) = (12, 512, 3);
        let x: Vec<f32> = (0..m * k).map(|i| pseudo(i, 3) * 2.0).collect();
        for dtype in TYPES {
            let w = weights(dtype, n, k);
            let mut ours = vec![0.0; m * n];
            matmul(dtype, &w, n, k, &x, m, &mut ours).unwrap_or_else(|e| panic!("{e}"));
            let mut theirs = vec![0.0; m * n];
            mmvq::matmul_q8_1(dtype, &w, n, k, &x, m, &mut theirs)
                .unwrap_or_else(|e| panic!("{e}"));
            let scale: f32 = theirs.iter().map(|v| v.abs()).sum::<f32>() / theirs.len() as f32;
            for (a, b) in ours.iter().zip(&theirs) {
                assert!(
                    (a - b).abs() <= 1e-5 * scale.max(1.0) * 4.0,
                    "{dtype:?}: {a} against MMVQ's {b}"
                );
            }
        }
    }

    /// The slices of a block cover it: summed per group they are the block's integer parts.
    #[test]
    fn the_slices_sum_to_the_blocks_integer_parts() {
        let k = 256;
        let x: Vec<f32> = (0..k).map(|i| pseudo(i, 11)).collect();
        let q = quantize_rows_q8_1(&x, 1, k, padded_columns(k));
        for dtype in TYPES {
            let w = weights(dtype, 1, k);
            let (bs, ts) = (dtype.block_size(), dtype.type_size());
            for blk in 0..k / bs {
                let b = &w[blk * ts..(blk + 1) * ts];
                let y = &q[blk * bs / QK8_1..(blk + 1) * bs / QK8_1];
                let whole = mmvq::block_int_sums(dtype, b, y).unwrap_or_else(|e| panic!("{e}"));
                let mut dot = vec![0; whole.dot.len()];
                for s in 0..slices(dtype) {
                    let p = slice_ints(dtype, b, y, s);
                    for c in 0..p.len {
                        dot[p.group[c]] += p.dot[c];
                    }
                }
                assert_eq!(dot, whole.dot, "{dtype:?}");
            }
        }
    }

    /// The butterfly adds in the kernel's order, not left to right: values chosen so that the
    /// two orders round differently.
    #[test]
    fn the_butterfly_adds_partners_sixteen_apart_first() {
        let mut lanes = [0.0f32; LANES];
        lanes[0] = 1.0e8;
        lanes[16] = -1.0e8;
        lanes[1] = 3.0;
        lanes[2] = 1.0;
        // Left to right: 1e8 + 3 rounds to 1e8 (f32 spacing 8), + 1 likewise, − 1e8 = 0.
        let sequential: f32 = lanes.iter().sum();
        assert_eq!(sequential, 0.0);
        // The butterfly cancels lanes 0 and 16 first and keeps the small values.
        assert_eq!(butterfly(lanes), 4.0);
    }

    /// A row's outputs do not depend on the other rows of the call: the kernel's row classes
    /// are one class for 1 to 8 rows.
    #[test]
    fn a_row_is_computed_alike_alone_and_among_eight() {
        let (n, k) = (5, 256);
        let x: Vec<f32> = (0..MAX_ROWS * k).map(|i| pseudo(i, 5)).collect();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
            let w = weights(dtype, n, k);
            let mut all = vec![0.0; MAX_ROWS * n];
            matmul(dtype, &w, n, k, &x, MAX_ROWS, &mut all).unwrap_or_else(|e| panic!("{e}"));
            for r in 0..MAX_ROWS {
                let mut one = vec![0.0; n];
                matmul(dtype, &w, n, k, &x[r * k..(r + 1) * k], 1, &mut one)
                    .unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(one, all[r * n..(r + 1) * n], "{dtype:?} row {r}");
            }
        }
    }

    #[test]
    fn more_rows_than_a_launch_takes_and_bad_lengths_are_errors() {
        let (n, k) = (2, 256);
        let w = weights(GgmlDType::Q4K, n, k);
        let x = vec![0.5; 9 * k];
        let mut out = vec![0.0; 9 * n];
        assert!(matmul(GgmlDType::Q4K, &w, n, k, &x, 9, &mut out).is_err());
        let mut out = vec![0.0; n];
        assert!(matmul(GgmlDType::Q4K, &w[1..], n, k, &x[..k], 1, &mut out).is_err());
        assert!(matmul(GgmlDType::F16, &w, n, k, &x[..k], 1, &mut out).is_err());
    }
}
