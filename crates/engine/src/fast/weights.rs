//! The model as the fast tier holds it, whatever runs it: every matrix as its raw GGUF blocks
//! with type and shape (uploaded as they are: the kernels read ggml's block layouts), the norm
//! vectors, and the token embedding (rows gathered by the embedding kernel).

use std::collections::HashMap;

use smolchat_gguf::{AlignedBytes, GgmlDType, GgufSource};

use super::plan::{matrix_shape, Matrix, Norm};
use crate::config::ModelConfig;
use crate::cpu::model::norm_vector;
use crate::error::{EngineError, Result};

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

/// Matrix types the fast tier's matmul kernels take (llama.cpp's MMVQ/MMQ set).
pub fn supported(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::Q4_0
            | GgmlDType::Q4_1
            | GgmlDType::Q5_0
            | GgmlDType::Q5_1
            | GgmlDType::Q8_0
            | GgmlDType::Q2K
            | GgmlDType::Q3K
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
    )
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

impl FastWeights {
    /// Reads every weight of `src`, whose configuration (YaRN applied) is `config`.
    pub fn load(
        src: &mut GgufSource,
        config: ModelConfig,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let total: u64 = src.tensors.values().map(|t| t.n_bytes as u64).sum();
        let mut done = 0u64;
        let mut take = |src: &mut GgufSource, name: &str, (rows, cols): (usize, usize)| {
            let raw = src.take_tensor(name)?;
            done += raw.data.len() as u64;
            progress(done, total);
            if raw.dims != [rows, cols] {
                return Err(EngineError::BadShape {
                    name: name.to_string(),
                    actual: raw.dims,
                    expected: vec![rows, cols],
                });
            }
            if !supported(raw.dtype) {
                return Err(EngineError::from(
                    smolchat_gguf::GgufError::UnsupportedTensorType {
                        name: name.to_string(),
                        dtype: format!(
                            "{:?} (the GPU fast tier runs quantized matrices only; the reference tier runs this file)",
                            raw.dtype
                        ),
                    },
                ));
            }
            Ok(RawMatrix {
                dtype: raw.dtype,
                rows,
                cols,
                bytes: raw.data,
            })
        };
        let c = &config;
        let embedding = take(src, "token_embd.weight", (c.vocab_size, c.hidden))?;
        let mut matrices = HashMap::new();
        if src.tensors.contains_key("output.weight") {
            matrices.insert(
                Matrix::Head,
                take(src, "output.weight", matrix_shape(c, Matrix::Head))?,
            );
        }
        for layer in 0..c.n_layers {
            for (m, name) in [
                (Matrix::Q(layer), "attn_q"),
                (Matrix::K(layer), "attn_k"),
                (Matrix::V(layer), "attn_v"),
                (Matrix::O(layer), "attn_output"),
                (Matrix::Gate(layer), "ffn_gate"),
                (Matrix::Up(layer), "ffn_up"),
                (Matrix::Down(layer), "ffn_down"),
            ] {
                let raw = take(
                    src,
                    &format!("blk.{layer}.{name}.weight"),
                    matrix_shape(c, m),
                )?;
                matrices.insert(m, raw);
            }
        }
        let mut norms = HashMap::new();
        for layer in 0..c.n_layers {
            norms.insert(
                Norm::Attn(layer),
                norm_vector(src, &format!("blk.{layer}.attn_norm.weight"), c.hidden)?,
            );
            norms.insert(
                Norm::Ffn(layer),
                norm_vector(src, &format!("blk.{layer}.ffn_norm.weight"), c.hidden)?,
            );
        }
        norms.insert(
            Norm::Output,
            norm_vector(src, "output_norm.weight", c.hidden)?,
        );
        progress(total, total);
        Ok(Self {
            config,
            embedding,
            matrices,
            norms,
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
