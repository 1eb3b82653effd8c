//! The f16 matmul of wide steps, the twin of `dequantize_f16_*` + `f32_to_f16` + cuBLAS's
//! `GemmEx` (f16 operands, f32 accumulation) in the CUDA runner.
//!
//! Why: above MMVQ's 8 rows a step's matmuls ran llama.cpp's MMQ, which is compute-bound in its
//! integer tiles and the activations' quantization (a 64-sequence decode step of the 3B shape
//! took ~10 ms on an H100 against a ~0.6 ms weight-read floor, and a 512-token prefill half of
//! llama.cpp's rate). With the weights dequantized once to f16 and kept on the device (where its
//! memory allows, see the CUDA runner), those steps are cuBLAS GEMMs on the tensor cores.
//!
//! The contract with the kernels: every weight is the GGML dequantization rounded to nearest f16
//! (the kernel's `dq_*` are the embedding kernels' own, bit for bit with this twin's candle
//! dequantization), every activation rounded to nearest f16, products summed in f32. cuBLAS
//! sums in its own order (and tiles), so outputs agree within [`TOLERANCE`] of the row's scale,
//! not bit for bit.

use half::f16;

use crate::error::{EngineError, Result};

/// The largest |difference| from the kernel path, relative to the largest |value| of the output
/// (and at least 1): what f32 sums in another order may move over a few thousand terms.
pub const TOLERANCE: f32 = 1e-3;

/// `out[r][j] = Σ_c f16(x[r][c]) · w16[j][c]`: `w16` is the `[n][k]` matrix already rounded to
/// f16, `x` is `[rows][k]`, `out` `[rows][n]`.
pub fn matmul(
    w16: &[f16],
    n: usize,
    k: usize,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    if w16.len() != n * k || x.len() < rows * k || out.len() < rows * n {
        return Err(EngineError::InvalidStep(format!(
            "an f16 matmul of [{n} x {k}] weights over {rows} rows got {} weights, {} inputs and \
             room for {} outputs",
            w16.len(),
            x.len(),
            out.len()
        )));
    }
    let x16: Vec<f32> = x[..rows * k]
        .iter()
        .map(|&v| f16::from_f32(v).to_f32())
        .collect();
    let w: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
    for (r, xr) in x16.chunks_exact(k).enumerate() {
        let row = &mut out[r * n..(r + 1) * n];
        for (j, o) in row.iter_mut().enumerate() {
            *o = w[j * k..(j + 1) * k]
                .iter()
                .zip(xr)
                .map(|(a, b)| a * b)
                .sum();
        }
    }
    Ok(())
}

/// A dequantized row rounded to f16, as `dequantize_f16_*` writes it.
pub fn round_row(values: &[f32]) -> Vec<f16> {
    values.iter().map(|&v| f16::from_f32(v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the product in f64 of the same rounded operands: only the f32 sum differs.
    #[test]
    fn the_product_is_the_f16_operands_summed_in_f32() {
        let (n, k, rows) = (5, 96, 3);
        let w: Vec<f16> = (0..n * k)
            .map(|i| f16::from_f32(((i * 37 % 101) as f32 - 50.0) / 17.0))
            .collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 9.3)
            .collect();
        let mut out = vec![0f32; rows * n];
        matmul(&w, n, k, &x, rows, &mut out).expect("matmul");
        for r in 0..rows {
            for j in 0..n {
                let exact: f64 = (0..k)
                    .map(|c| f16::from_f32(x[r * k + c]).to_f64() * w[j * k + c].to_f64())
                    .sum();
                let got = out[r * n + j] as f64;
                assert!(
                    (got - exact).abs() < 1e-4 * exact.abs().max(1.0),
                    "{got} vs {exact}"
                );
            }
        }
        // The activations are rounded: a value f16 cannot hold moves the product.
        let fine = vec![1.0 + 1.0 / 4096.0; k];
        let ones = vec![f16::ONE; k];
        let mut one = [0f32];
        matmul(&ones, 1, k, &fine, 1, &mut one).expect("matmul");
        assert_eq!(one[0], k as f32, "1 + 2⁻¹² rounds to 1 in f16");
    }

    #[test]
    fn mismatched_shapes_are_an_error_not_a_panic() {
        let mut out = [0f32; 2];
        assert!(matmul(&[f16::ONE; 3], 2, 2, &[1.0; 4], 2, &mut out).is_err());
    }
}
