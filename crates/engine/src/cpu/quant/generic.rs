//! The generic path: candle's block types and `vec_dot`, one (row, token) dot product at a time.
//! Used for the weight types without SIMD kernels here (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, F16, F32)
//! and as the "before" baseline of the benchmark. Activations still go through the ggml-faithful
//! quantizers of [`super::act`].

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0, GgmlType,
};
use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

use super::act::{
    quantize_q8_0_blocks, quantize_q8_1_blocks, quantize_q8k_blocks, Q8KBlock, Q8_0Block, Q8_1Block,
};

/// Calls `$body` with `$b` bound to the candle block type of `$dtype` (nothing for types
/// `QMatrix::from_raw` rejects).
macro_rules! dispatch {
    ($dtype:expr, $b:ident => $body:expr) => {
        match $dtype {
            GgmlDType::F32 => {
                type $b = f32;
                $body
            }
            GgmlDType::F16 => {
                type $b = f16;
                $body
            }
            GgmlDType::Q4_0 => {
                type $b = BlockQ4_0;
                $body
            }
            GgmlDType::Q4_1 => {
                type $b = BlockQ4_1;
                $body
            }
            GgmlDType::Q5_0 => {
                type $b = BlockQ5_0;
                $body
            }
            GgmlDType::Q5_1 => {
                type $b = BlockQ5_1;
                $body
            }
            GgmlDType::Q8_0 => {
                type $b = BlockQ8_0;
                $body
            }
            GgmlDType::Q2K => {
                type $b = BlockQ2K;
                $body
            }
            GgmlDType::Q3K => {
                type $b = BlockQ3K;
                $body
            }
            GgmlDType::Q4K => {
                type $b = BlockQ4K;
                $body
            }
            GgmlDType::Q5K => {
                type $b = BlockQ5K;
                $body
            }
            GgmlDType::Q6K => {
                type $b = BlockQ6K;
                $body
            }
            GgmlDType::Q8_1 | GgmlDType::Q8K | GgmlDType::BF16 => {}
        }
    };
}

pub fn supported(dtype: GgmlDType) -> bool {
    !matches!(dtype, GgmlDType::Q8_1 | GgmlDType::Q8K | GgmlDType::BF16)
}

/// Views bytes as blocks. The buffers come from `AlignedBytes` (64-byte aligned) and rows are whole
/// blocks, so alignment holds for every block type (at most 4-byte aligned).
fn as_blocks<B: GgmlType>(bytes: &[u8]) -> &[B] {
    let size = std::mem::size_of::<B>();
    debug_assert_eq!(bytes.len() % size, 0);
    debug_assert_eq!(bytes.as_ptr() as usize % std::mem::align_of::<B>(), 0);
    // SAFETY: candle's block types are `repr(C)` plain data valid for any bit pattern, the length
    // is a whole number of blocks and the pointer is aligned (see above).
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const B, bytes.len() / size) }
}

/// Dequantizes one GGML-layout row.
pub fn to_float(dtype: GgmlDType, bytes: &[u8], out: &mut [f32]) {
    dispatch!(dtype, B => B::to_float(as_blocks::<B>(bytes), out));
}

/// `out[t * rows + r] = Σ_c x[t * cols + c] · W[r, c]` with `W` in GGML layout.
pub fn matmul(
    dtype: GgmlDType,
    data: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) {
    dispatch!(dtype, B => matmul_typed::<B>(data, rows, cols, x, n_tokens, out));
}

/// Quantizes activation rows into candle's partner blocks with the ggml-faithful quantizers.
fn quantize_partner<V: GgmlType>(x: &[f32], out: &mut [V]) {
    let n = out.len();
    // SAFETY (all three casts): the twin structs in `act` have the layout, size and alignment of
    // candle's blocks (checked at compile time there), and every bit pattern is valid for both.
    match V::DTYPE {
        GgmlDType::Q8_0 => quantize_q8_0_blocks(x, unsafe {
            std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut Q8_0Block, n)
        }),
        GgmlDType::Q8_1 => quantize_q8_1_blocks(x, unsafe {
            std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut Q8_1Block, n)
        }),
        GgmlDType::Q8K => quantize_q8k_blocks(x, unsafe {
            std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut Q8KBlock, n)
        }),
        // F32 and F16 partners: plain conversion, as ggml does.
        _ => V::from_float(x, out),
    }
}

/// Rows of output computed per rayon task: small enough to balance 2-16 threads, large enough
/// that task overhead stays negligible.
const ROWS_PER_TASK: usize = 16;

fn matmul_typed<B: GgmlType>(
    data: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) {
    let blocks_per_row = cols / B::BLCK_SIZE;
    let dot_blocks_per_row = cols / <B::VecDotType as GgmlType>::BLCK_SIZE;
    let mut xq: Vec<B::VecDotType> =
        vec![<B::VecDotType as GgmlType>::zeros(); n_tokens * dot_blocks_per_row];
    for (t, chunk) in xq.chunks_mut(dot_blocks_per_row).enumerate() {
        quantize_partner(&x[t * cols..(t + 1) * cols], chunk);
    }
    let weights: &[B] = as_blocks::<B>(data);
    // Compute into a row-major [rows, tokens] buffer so each task owns a contiguous slice, then
    // transpose into `out` ([tokens, rows]).
    let mut tmp = vec![0f32; rows * n_tokens];
    tmp.par_chunks_mut(ROWS_PER_TASK * n_tokens)
        .enumerate()
        .for_each(|(task, chunk)| {
            let r0 = task * ROWS_PER_TASK;
            for (i, row_out) in chunk.chunks_mut(n_tokens).enumerate() {
                let r = r0 + i;
                let wrow = &weights[r * blocks_per_row..(r + 1) * blocks_per_row];
                for (t, o) in row_out.iter_mut().enumerate() {
                    let xrow = &xq[t * dot_blocks_per_row..(t + 1) * dot_blocks_per_row];
                    *o = B::vec_dot(cols, wrow, xrow);
                }
            }
        });
    for r in 0..rows {
        for t in 0..n_tokens {
            out[t * rows + r] = tmp[r * n_tokens + t];
        }
    }
}
