//! Quantized weight matrices and the matrix products the model runs on them.
//!
//! A [`QMatrix`] keeps a weight matrix in its GGML block format (it is never dequantized as a
//! whole). [`QMatrix::matmul`] computes `out[t, r] = Σ_c x[t, c] · W[r, c]` for a batch of token
//! rows: activations are quantized once to the weight type's dot-product partner (Q8_0, Q8_1 or
//! Q8_K, as llama.cpp does), then output rows are split across the rayon pool.

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0, GgmlType,
};
use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

use super::error::{EngineError, Result};
use super::gguf::{AlignedBytes, RawTensor};

/// A 2-D weight matrix `[rows (outputs), cols (inputs)]` in GGML block format.
pub struct QMatrix {
    pub name: String,
    pub dtype: GgmlDType,
    pub rows: usize,
    pub cols: usize,
    data: AlignedBytes,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QMatrix({} {:?} {}x{})",
            self.name, self.dtype, self.rows, self.cols
        )
    }
}

fn supported(dtype: GgmlDType) -> bool {
    !matches!(dtype, GgmlDType::Q8_1 | GgmlDType::Q8K | GgmlDType::BF16)
}

impl QMatrix {
    pub fn from_raw(raw: RawTensor) -> Result<Self> {
        let (rows, cols) = match raw.dims.as_slice() {
            [r, c] => (*r, *c),
            [c] => (1, *c),
            other => {
                return Err(EngineError::BadShape {
                    name: raw.name,
                    actual: other.to_vec(),
                    expected: vec![0, 0],
                })
            }
        };
        if !supported(raw.dtype) {
            return Err(EngineError::UnsupportedTensorType {
                name: raw.name,
                dtype: format!("{:?}", raw.dtype),
            });
        }
        if cols % raw.dtype.block_size() != 0 {
            return Err(EngineError::BadShape {
                name: raw.name,
                actual: vec![rows, cols],
                expected: vec![rows, cols.next_multiple_of(raw.dtype.block_size())],
            });
        }
        Ok(Self {
            name: raw.name,
            dtype: raw.dtype,
            rows,
            cols,
            data: raw.data,
        })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_size() * self.dtype.type_size()
    }

    /// Bytes held by the matrix.
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn raw_bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Dequantizes one row into `out` (`cols` floats): used for embedding lookups.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<()> {
        if row >= self.rows || out.len() != self.cols {
            return Err(EngineError::InvalidStep(format!(
                "row {row} of {} ({} rows, {} cols) into a buffer of {}",
                self.name,
                self.rows,
                self.cols,
                out.len()
            )));
        }
        let rb = self.row_bytes();
        let bytes = &self.data.as_slice()[row * rb..(row + 1) * rb];
        dispatch!(self.dtype, B => to_float_bytes::<B>(bytes, out));
        Ok(())
    }

    /// `out[t * rows + r] = Σ_c x[t * cols + c] · W[r, c]` for `t` in `0..n_tokens`.
    pub fn matmul(&self, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        debug_assert_eq!(x.len(), n_tokens * self.cols);
        debug_assert_eq!(out.len(), n_tokens * self.rows);
        dispatch!(self.dtype, B => matmul_typed::<B>(self, x, n_tokens, out));
    }
}

/// Calls `$body` with `$b` bound to the candle block type of `$dtype`.
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
            // Rejected in `from_raw`.
            GgmlDType::Q8_1 | GgmlDType::Q8K | GgmlDType::BF16 => {}
        }
    };
}
use dispatch;

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

fn to_float_bytes<B: GgmlType>(bytes: &[u8], out: &mut [f32]) {
    B::to_float(as_blocks::<B>(bytes), out);
}

/// Rows of output computed per rayon task: small enough to balance 2-16 threads, large enough
/// that task overhead stays negligible.
const ROWS_PER_TASK: usize = 16;

fn matmul_typed<B: GgmlType>(w: &QMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let cols = w.cols;
    let blocks_per_row = cols / B::BLCK_SIZE;
    let dot_blocks_per_row = cols / <B::VecDotType as GgmlType>::BLCK_SIZE;
    // Quantize each activation row once.
    let mut xq: Vec<B::VecDotType> =
        vec![<B::VecDotType as GgmlType>::zeros(); n_tokens * dot_blocks_per_row];
    for (t, chunk) in xq.chunks_mut(dot_blocks_per_row).enumerate() {
        let xr = &x[t * cols..(t + 1) * cols];
        if <B::VecDotType as GgmlType>::DTYPE == GgmlDType::Q8_1 {
            // SAFETY: same layout as candle's BlockQ8_1.
            let blocks = unsafe {
                std::slice::from_raw_parts_mut(chunk.as_mut_ptr() as *mut Q8_1Block, chunk.len())
            };
            quantize_q8_1_ggml(xr, blocks);
        } else {
            <B::VecDotType as GgmlType>::from_float(xr, chunk);
        }
    }
    let weights: &[B] = as_blocks::<B>(w.data.as_slice());
    // Compute into a row-major [rows, tokens] buffer so each task owns a contiguous slice, then
    // transpose into `out` ([tokens, rows]).
    let mut tmp = vec![0f32; w.rows * n_tokens];
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
    for r in 0..w.rows {
        for t in 0..n_tokens {
            out[t * w.rows + r] = tmp[r * n_tokens + t];
        }
    }
}

#[repr(C)]
struct Q8_1Block {
    d: f16,
    s: f16,
    qs: [i8; 32],
}

/// ggml's x86 `quantize_row_q8_1`: scale 127/amax, round half to even, `s = d * Σq`.
fn quantize_q8_1_ggml(x: &[f32], out: &mut [Q8_1Block]) {
    for (xb, yb) in x.chunks(32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in yb.qs.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        yb.d = f16::from_f32(d);
        yb.s = f16::from_f32(d * sum as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    fn quantized(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> (QMatrix, Vec<f32>) {
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let t = Tensor::from_vec(vals, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        let deq: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let bytes = q.data().unwrap();
        let m = QMatrix::from_raw(RawTensor {
            name: "w".into(),
            dtype,
            dims: vec![rows, cols],
            data: AlignedBytes::from_slice(&bytes),
        })
        .unwrap();
        (m, deq)
    }

    #[test]
    fn matmul_matches_dequantized_reference() {
        for dtype in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let (rows, cols, n) = (40, 512, 3);
            let (m, deq) = quantized(dtype, rows, cols, 7);
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            m.matmul(&x, n, &mut out);
            for t in 0..n {
                for r in 0..rows {
                    let expect: f32 = (0..cols).map(|c| x[t * cols + c] * deq[r * cols + c]).sum();
                    let got = out[t * rows + r];
                    // Activation quantization (8-bit) costs about 1% of the row norm.
                    assert!(
                        (got - expect).abs() < 0.05 * (1.0 + expect.abs()),
                        "{dtype:?} t{t} r{r}: {got} vs {expect}"
                    );
                }
            }
            let mut row = vec![0f32; cols];
            m.dequantize_row(5, &mut row).unwrap();
            assert_eq!(&row[..], &deq[5 * cols..6 * cols]);
        }
    }
}
