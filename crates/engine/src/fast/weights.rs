//! The model as the fast tier holds it, whatever runs it: every matrix as its raw GGUF blocks
//! with type and shape (uploaded as they are: the kernels read ggml's block layouts), the norm
//! vectors, and the token embedding (rows gathered by the embedding kernel).

use std::collections::HashMap;

use smolchat_gguf::{AlignedBytes, GgmlDType, GgufSource, RawTensor};

use super::plan::{Matrix, Norm};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::weights::{self, WeightSink};

/// One weight matrix: `rows` outputs of `cols` inputs, as `dtype` blocks, row after row.
pub struct RawMatrix {
    pub dtype: GgmlDType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: AlignedBytes,
}

/// Every weight of the model (see the module docs).
pub struct FastWeights {
    pub config: ModelConfig,
    /// The token embedding, `[vocab][hidden]`.
    pub embedding: RawMatrix,
    /// Every matrix but the LM head when it is tied to the embedding.
    pub matrices: HashMap<Matrix, RawMatrix>,
    pub norms: HashMap<Norm, Vec<f32>>,
}

/// Matrix types the fast tier's matmul kernels take (llama.cpp's MMVQ/MMQ set, our matvec's).
pub const MATRIX_TYPES: [GgmlDType; 10] = [
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

/// Whether the fast tier's matmul kernels take `dtype` ([`MATRIX_TYPES`]).
pub fn supported(dtype: GgmlDType) -> bool {
    MATRIX_TYPES.contains(&dtype)
}

/// Whether every matrix of `src` is of a type the fast tier runs (read from the tensor
/// directory, nothing loaded).
pub fn runs(src: &GgufSource) -> std::result::Result<(), String> {
    let mut names: Vec<&String> = src.tensors.keys().collect();
    names.sort();
    for name in names {
        let t = &src.tensors[name];
        if t.dims.len() == 2 && !supported(t.dtype) {
            return Err(format!(
                "{name} is {:?}, which the fast tier's matmul kernels do not take",
                t.dtype
            ));
        }
    }
    Ok(())
}

/// The weights as [`weights::read`] hands them over, kept as their blocks.
#[derive(Default)]
struct BlockWeights {
    embedding: Option<RawMatrix>,
    matrices: HashMap<Matrix, RawMatrix>,
    norms: HashMap<Norm, Vec<f32>>,
}

/// A matrix as the kernels take it: its blocks, of a type they run.
fn raw_matrix(raw: RawTensor) -> Result<RawMatrix> {
    if !supported(raw.dtype) {
        return Err(EngineError::from(
            smolchat_gguf::GgufError::UnsupportedTensorType {
                name: raw.name,
                dtype: format!(
                    "{:?} (the GPU fast tier runs quantized matrices only; the reference tier runs this file)",
                    raw.dtype
                ),
            },
        ));
    }
    let (rows, cols) = match raw.dims.as_slice() {
        [rows, cols] => (*rows, *cols),
        other => {
            return Err(EngineError::BadShape {
                name: raw.name,
                actual: other.to_vec(),
                expected: vec![0, 0],
            })
        }
    };
    Ok(RawMatrix {
        dtype: raw.dtype,
        rows,
        cols,
        bytes: raw.data,
    })
}

impl WeightSink for BlockWeights {
    fn embedding(&mut self, raw: RawTensor) -> Result<()> {
        self.embedding = Some(raw_matrix(raw)?);
        Ok(())
    }

    fn matrix(&mut self, which: Matrix, raw: RawTensor) -> Result<()> {
        self.matrices.insert(which, raw_matrix(raw)?);
        Ok(())
    }

    fn norm(&mut self, which: Norm, weight: Vec<f32>) -> Result<()> {
        self.norms.insert(which, weight);
        Ok(())
    }
}

impl FastWeights {
    /// Reads every weight of `src`, whose configuration (YaRN applied) is `config`
    /// ([`weights::read`]), refusing a matrix type the kernels do not take.
    pub fn load(
        src: &mut GgufSource,
        config: ModelConfig,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let mut held = BlockWeights::default();
        weights::read(src, &config, &mut held, progress)?;
        Ok(Self {
            config,
            embedding: held
                .embedding
                .ok_or_else(|| weights::missing(weights::EMBEDDING))?,
            matrices: held.matrices,
            norms: held.norms,
        })
    }

    /// `matrix`'s weights (the embedding for a tied LM head).
    pub fn matrix(&self, matrix: Matrix) -> Result<&RawMatrix> {
        match (matrix, self.matrices.get(&matrix)) {
            (_, Some(m)) => Ok(m),
            (Matrix::Head, None) => Ok(&self.embedding),
            (m, None) => Err(EngineError::InvalidStep(format!(
                "the fast tier has no weights for {m:?}"
            ))),
        }
    }

    pub fn norm(&self, norm: Norm) -> Result<&[f32]> {
        self.norms
            .get(&norm)
            .map(Vec::as_slice)
            .ok_or_else(|| EngineError::InvalidStep(format!("the fast tier has no {norm:?} norm")))
    }

    /// Bytes of weights held.
    pub fn bytes(&self) -> usize {
        self.embedding.bytes.len()
            + self.matrices.values().map(|m| m.bytes.len()).sum::<usize>()
            + self.norms.values().map(|n| n.len() * 4).sum::<usize>()
    }
}
