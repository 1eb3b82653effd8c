//! Quantized weight matrices and the matrix products the model runs on them.
//!
//! A [`QMatrix`] keeps a weight matrix quantized (it is never dequantized as a whole).
//! [`QMatrix::matmul`] computes `out[t, r] = Σ_c x[t, c] · W[r, c]` for a batch of token rows:
//! activations are quantized once to the weight type's dot-product partner (Q8_0, Q8_1 or Q8_K,
//! exactly as ggml's x86 build does, see [`act`]), then output rows are split across the rayon pool.
//!
//! Q4_0, Q4_1, Q8_0, Q4_K and Q6_K matrices are repacked at load into a row-interleaved layout
//! ([`layout`]) that SIMD kernels chosen at run time ([`Isa`]: AVX-512 VNNI, AVX-VNNI, AVX2,
//! scalar) multiply sixteen rows by several tokens at a time. The other types keep GGML's layout
//! and candle's `vec_dot` ([`generic`]).
//!
//! Q4_1 and Q8_0 products are bit-identical to llama.cpp's (same integer sums, same float order;
//! see [`scalar`]) on the scalar path. The SIMD Q4_1 and Q8_0 kernels (AVX2 and AVX-512) round once
//! per block instead ([`scalar::FloatOrder::PerBlock`]: llama.cpp's order converts and accumulates
//! every 4-value lane on its own, which binds them to the multiply ports); the logits tests hold on
//! those paths too, and the x86 SIMD paths agree with each other. The K-quant kernels have exact
//! integer parts and their own float order. Every SIMD kernel equals the scalar kernel in its float
//! order bit for bit; the AVX-512 kernels are checked on every CPU, over emulated intrinsics where
//! the CPU lacks them (`emu512`).
//!
//! Threading ([`gemm::run`]): a product splits across the rayon pool when its work or its weight
//! bytes are large enough to pay for the hand-off. Callers get the most from two threads when they
//! (a) run the whole forward pass inside the pool (`ThreadPool::install`), so each parallel region
//! costs about a microsecond instead of an injection and a wake-up, and (b) use
//! [`QMatrix::matmul_many`] for matrices that share an input (Q/K/V, gate/up).

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod emu512;
pub mod gemm;
pub mod generic;
pub mod isa;
pub mod kernel;
#[cfg(test)]
mod kernel_tests;
pub mod layout;
pub mod scalar;

use std::borrow::Cow;

use candle_core::quantized::GgmlDType;

use self::act::Acts;
pub use self::isa::Isa;
use self::layout::{Format, Packed};
use crate::error::{EngineError, Result};
use smolchat_gguf::{AlignedBytes, RawTensor};

/// How the bytes are held.
enum Storage {
    /// GGML block layout (types without SIMD kernels).
    Native(AlignedBytes),
    /// Row-interleaved layout for the SIMD kernels.
    Packed(Packed),
}

/// A 2-D weight matrix `[rows (outputs), cols (inputs)]`, quantized.
pub struct QMatrix {
    pub name: String,
    pub dtype: GgmlDType,
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
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

impl QMatrix {
    /// Takes a GGUF tensor, repacking it for the SIMD kernels when its type has them.
    pub fn from_raw(raw: RawTensor) -> Result<Self> {
        let mut m = Self::from_raw_native(raw)?;
        if let (Some(format), Storage::Native(bytes)) = (Format::from_dtype(m.dtype), &m.storage) {
            let packed = Packed::from_native(format, m.rows, m.cols, bytes.as_slice());
            m.storage = Storage::Packed(packed);
        }
        Ok(m)
    }

    /// Takes a GGUF tensor and keeps GGML's layout: products go through candle's `vec_dot`. For
    /// benchmarks and cross-checks; the model uses [`QMatrix::from_raw`].
    #[doc(hidden)]
    pub fn from_raw_native(raw: RawTensor) -> Result<Self> {
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
        if !generic::supported(raw.dtype) {
            return Err(EngineError::from(
                smolchat_gguf::GgufError::UnsupportedTensorType {
                    name: raw.name,
                    dtype: format!("{:?}", raw.dtype),
                },
            ));
        }
        if cols % raw.dtype.block_size() != 0 {
            return Err(EngineError::BadShape {
                name: raw.name,
                actual: vec![rows, cols],
                expected: vec![rows, cols.next_multiple_of(raw.dtype.block_size())],
            });
        }
        let expected = rows * (cols / raw.dtype.block_size()) * raw.dtype.type_size();
        if raw.data.len() != expected {
            return Err(EngineError::BadShape {
                name: raw.name,
                actual: vec![raw.data.len()],
                expected: vec![expected],
            });
        }
        Ok(Self {
            name: raw.name,
            dtype: raw.dtype,
            rows,
            cols,
            storage: Storage::Native(raw.data),
        })
    }

    /// Bytes of one row in GGML layout.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_size() * self.dtype.type_size()
    }

    /// Bytes held by the matrix.
    pub fn size_in_bytes(&self) -> usize {
        self.raw_bytes().len()
    }

    /// The bytes as held: GGML's layout for types without SIMD kernels, the interleaved layout of
    /// [`layout`] otherwise (see [`QMatrix::is_repacked`]; [`QMatrix::native_bytes`] gives GGML's
    /// layout always).
    pub fn raw_bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Native(b) => b.as_slice(),
            Storage::Packed(p) => p.bytes(),
        }
    }

    /// Whether the matrix was repacked for the SIMD kernels.
    pub fn is_repacked(&self) -> bool {
        matches!(self.storage, Storage::Packed(_))
    }

    /// The matrix in GGML's block layout (rebuilt when repacked).
    pub fn native_bytes(&self) -> Cow<'_, [u8]> {
        match &self.storage {
            Storage::Native(b) => Cow::Borrowed(b.as_slice()),
            Storage::Packed(p) => Cow::Owned(p.to_native()),
        }
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
        match &self.storage {
            Storage::Native(b) => {
                generic::to_float(self.dtype, &b.as_slice()[row * rb..(row + 1) * rb], out)
            }
            Storage::Packed(p) => {
                let mut native = vec![0u8; rb];
                p.native_row(row, &mut native);
                generic::to_float(self.dtype, &native, out);
            }
        }
        Ok(())
    }

    /// `out[t * rows + r] = Σ_c x[t * cols + c] · W[r, c]` for `t` in `0..n_tokens`.
    pub fn matmul(&self, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        self.matmul_isa(Isa::best(), x, n_tokens, out);
    }

    /// [`QMatrix::matmul`] with the kernels of `isa` (the scalar ones when `isa` is not available
    /// on this CPU). For tests and benchmarks.
    #[doc(hidden)]
    pub fn matmul_isa(&self, isa: Isa, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        Self::matmul_many_isa(isa, &[self], x, n_tokens, &mut [out]);
    }

    /// Several products with the same input: `outs[i][t * rows_i + r] = Σ_c x[t * cols + c] ·
    /// mats[i][r, c]` (e.g. Q, K and V, or gate and up). The input is quantized once per activation
    /// kind and every matrix runs in one parallel region, which saves a thread wake-up per matrix
    /// (a large share of a small matrix's decode time).
    pub fn matmul_many(mats: &[&QMatrix], x: &[f32], n_tokens: usize, outs: &mut [&mut [f32]]) {
        Self::matmul_many_isa(Isa::best(), mats, x, n_tokens, outs);
    }

    /// [`QMatrix::matmul_many`] with the kernels of `isa`.
    #[doc(hidden)]
    pub fn matmul_many_isa(
        isa: Isa,
        mats: &[&QMatrix],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
    ) {
        assert_eq!(mats.len(), outs.len(), "one output per matrix");
        for (m, out) in mats.iter().zip(outs.iter()) {
            assert_eq!(x.len(), n_tokens * m.cols, "{}: input size", m.name);
            assert_eq!(out.len(), n_tokens * m.rows, "{}: output size", m.name);
        }
        // Quantize once per activation kind.
        let mut acts: Vec<Acts> = Vec::new();
        for m in mats {
            if let Storage::Packed(p) = &m.storage {
                let kind = p.format.act_kind();
                if !acts.iter().any(|a| a.kind == kind) {
                    acts.push(Acts::quantize(kind, x, n_tokens, m.cols));
                }
            }
        }
        let mut jobs = Vec::with_capacity(mats.len());
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            match &m.storage {
                Storage::Native(b) => {
                    generic::matmul(m.dtype, b.as_slice(), m.rows, m.cols, x, n_tokens, out)
                }
                Storage::Packed(p) => {
                    let choice = gemm::kernel(p.format, isa)
                        .or_else(|| gemm::kernel(p.format, Isa::Scalar))
                        .unwrap_or_else(|| unreachable!("scalar kernels always exist"));
                    let kind = p.format.act_kind();
                    let Some(a) = acts.iter().find(|a| a.kind == kind) else {
                        unreachable!("quantized above for every packed matrix")
                    };
                    jobs.push(gemm::Job::new(p, choice, a, out));
                }
            }
        }
        gemm::run(&jobs);
        drop(jobs);
        for a in acts {
            a.recycle();
        }
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
