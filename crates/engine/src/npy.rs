//! Writing float32 arrays as NumPy `.npy` files (for `smolchat logits`), through candle's writer.

use std::path::Path;

use candle_core::{Device, Tensor};

use super::error::Result;

/// Writes `data` (row-major, `rows × cols`) as a float32 `.npy` file.
pub fn write_f32(path: &Path, rows: usize, cols: usize, data: Vec<f32>) -> Result<()> {
    Tensor::from_vec(data, (rows, cols), &Device::Cpu)?.write_npy(path)?;
    Ok(())
}
