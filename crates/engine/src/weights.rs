//! The model's weights as the GGUF file names them, read once for every backend. [`Matrix`] and
//! [`Norm`] name each weight by its role; their GGUF names and shapes are written here and
//! nowhere else; [`read`] takes every weight out of a file, checks its shape and hands it to
//! the backend's [`WeightSink`] as it is read (the CPU tier repacks each matrix, the reference
//! tier uploads it, the fast tier keeps its blocks), so no backend holds the whole file twice.

use std::collections::HashMap;

use smolchat_gguf::{GgmlDType, GgufSource, RawTensor};

use crate::config::ModelConfig;
use crate::cpu::quant::QMatrix;
use crate::error::{EngineError, Result};

/// The token embedding's tensor, `[vocab][hidden]`.
pub const EMBEDDING: &str = "token_embd.weight";

/// A weight matrix of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Matrix {
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// The LM head (`output.weight`, or the token embedding when tied).
    Head,
}

impl Matrix {
    /// The matrices of `layer`, in the order they are read.
    pub fn of_layer(layer: usize) -> [Matrix; 7] {
        [
            Matrix::Q(layer),
            Matrix::K(layer),
            Matrix::V(layer),
            Matrix::O(layer),
            Matrix::Gate(layer),
            Matrix::Up(layer),
            Matrix::Down(layer),
        ]
    }

    /// Its tensor's name in a GGUF file.
    pub fn gguf_name(self) -> String {
        let (layer, role) = match self {
            Matrix::Q(l) => (l, "attn_q"),
            Matrix::K(l) => (l, "attn_k"),
            Matrix::V(l) => (l, "attn_v"),
            Matrix::O(l) => (l, "attn_output"),
            Matrix::Gate(l) => (l, "ffn_gate"),
            Matrix::Up(l) => (l, "ffn_up"),
            Matrix::Down(l) => (l, "ffn_down"),
            Matrix::Head => return "output.weight".to_string(),
        };
        format!("blk.{layer}.{role}.weight")
    }

    /// `(rows, cols)`: outputs by inputs.
    pub fn shape(self, config: &ModelConfig) -> (usize, usize) {
        self.shape_in(Dims::of(config))
    }

    /// `(rows, cols)` in a model of sizes `d`.
    pub fn shape_in(self, d: Dims) -> (usize, usize) {
        match self {
            Matrix::Q(_) => (d.q_dim, d.hidden),
            Matrix::K(_) | Matrix::V(_) => (d.kv_dim, d.hidden),
            Matrix::O(_) => (d.hidden, d.q_dim),
            Matrix::Gate(_) | Matrix::Up(_) => (d.ffn, d.hidden),
            Matrix::Down(_) => (d.hidden, d.ffn),
            Matrix::Head => (d.vocab, d.hidden),
        }
    }
}

/// The sizes the weights' shapes follow from (a loaded file's config, or a model about to be
/// written: `synthetic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub vocab: usize,
    pub hidden: usize,
    /// Query heads × head size.
    pub q_dim: usize,
    /// Key/value heads × head size.
    pub kv_dim: usize,
    pub ffn: usize,
}

impl Dims {
    pub fn of(c: &ModelConfig) -> Dims {
        Dims {
            vocab: c.vocab_size,
            hidden: c.hidden,
            q_dim: c.n_heads * c.head_dim,
            kv_dim: c.n_kv_heads * c.head_dim,
            ffn: c.ffn,
        }
    }
}

/// `(rows, cols)` of `matrix` (see [`Matrix::shape`]).
pub fn matrix_shape(config: &ModelConfig, matrix: Matrix) -> (usize, usize) {
    matrix.shape(config)
}

/// A norm weight vector (`hidden` long).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Norm {
    Attn(usize),
    Ffn(usize),
    Output,
}

impl Norm {
    /// Its tensor's name in a GGUF file.
    pub fn gguf_name(self) -> String {
        match self {
            Norm::Attn(l) => format!("blk.{l}.attn_norm.weight"),
            Norm::Ffn(l) => format!("blk.{l}.ffn_norm.weight"),
            Norm::Output => "output_norm.weight".to_string(),
        }
    }
}

/// One layer's weights, as a backend keeps them (`M` a matrix, `N` a norm vector).
pub(crate) struct LayerWeights<M, N> {
    pub attn_norm: N,
    pub wq: M,
    pub wk: M,
    pub wv: M,
    pub wo: M,
    pub ffn_norm: N,
    pub w_gate: M,
    pub w_up: M,
    pub w_down: M,
}

/// Every layer's weights, taken by role out of what a [`WeightSink`] collected.
pub(crate) fn take_layers<M, N>(
    n_layers: usize,
    matrices: &mut HashMap<Matrix, M>,
    norms: &mut HashMap<Norm, N>,
) -> Result<Vec<LayerWeights<M, N>>> {
    let mut matrix = |m: Matrix| matrices.remove(&m).ok_or_else(|| missing(m));
    let mut norm = |n: Norm| norms.remove(&n).ok_or_else(|| missing(n));
    (0..n_layers)
        .map(|i| {
            Ok(LayerWeights {
                attn_norm: norm(Norm::Attn(i))?,
                wq: matrix(Matrix::Q(i))?,
                wk: matrix(Matrix::K(i))?,
                wv: matrix(Matrix::V(i))?,
                wo: matrix(Matrix::O(i))?,
                ffn_norm: norm(Norm::Ffn(i))?,
                w_gate: matrix(Matrix::Gate(i))?,
                w_up: matrix(Matrix::Up(i))?,
                w_down: matrix(Matrix::Down(i))?,
            })
        })
        .collect()
}

/// Where [`read`] puts each weight as it reads it: each backend builds its own holding.
pub trait WeightSink {
    /// The token embedding, `[vocab][hidden]`.
    fn embedding(&mut self, raw: RawTensor) -> Result<()>;
    /// A matrix, its shape checked. [`Matrix::Head`] comes only when the file has its own
    /// (otherwise the LM head is the embedding).
    fn matrix(&mut self, which: Matrix, raw: RawTensor) -> Result<()>;
    fn norm(&mut self, which: Norm, weight: Vec<f32>) -> Result<()>;
}

/// Reads every weight of `src` for `config` into `sink`: the embedding, the LM head when it is
/// not tied, each layer's matrices, then the norms; every shape checked against `config`.
/// `progress` gets the bytes read so far and in all.
pub fn read(
    src: &mut GgufSource,
    config: &ModelConfig,
    sink: &mut dyn WeightSink,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let c = config;
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
        Ok(raw)
    };
    sink.embedding(take(src, EMBEDDING, (c.vocab_size, c.hidden))?)?;
    if src.tensors.contains_key(&Matrix::Head.gguf_name()) {
        let raw = take(src, &Matrix::Head.gguf_name(), Matrix::Head.shape(c))?;
        sink.matrix(Matrix::Head, raw)?;
    }
    for layer in 0..c.n_layers {
        for m in Matrix::of_layer(layer) {
            sink.matrix(m, take(src, &m.gguf_name(), m.shape(c))?)?;
        }
    }
    for layer in 0..c.n_layers {
        for n in [Norm::Attn(layer), Norm::Ffn(layer)] {
            sink.norm(n, norm_vector(src, &n.gguf_name(), c.hidden)?)?;
        }
    }
    sink.norm(
        Norm::Output,
        norm_vector(src, &Norm::Output.gguf_name(), c.hidden)?,
    )?;
    progress(total, total);
    Ok(())
}

/// A norm weight (F32 or F16) as `len` floats.
pub(crate) fn norm_vector(src: &mut GgufSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let raw = src.take_tensor(name)?;
    if raw.dims.iter().product::<usize>() != len {
        return Err(EngineError::BadShape {
            name: name.to_string(),
            actual: raw.dims,
            expected: vec![len],
        });
    }
    match raw.dtype {
        GgmlDType::F32 | GgmlDType::F16 => {
            let m = QMatrix::from_raw(RawTensor {
                dims: vec![1, len],
                ..raw
            })?;
            let mut out = vec![0f32; len];
            m.dequantize_row(0, &mut out)?;
            Ok(out)
        }
        other => Err(EngineError::from(
            smolchat_gguf::GgufError::UnsupportedTensorType {
                name: name.to_string(),
                dtype: format!("{other:?} (norm weights must be F32 or F16)"),
            },
        )),
    }
}

/// A weight a backend's holding lacks once [`read`] is done (which never hands over fewer).
pub(crate) fn missing(what: impl std::fmt::Debug) -> EngineError {
    EngineError::InvalidStep(format!("the weights read lack {what:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_ggufs() {
        assert_eq!(Matrix::Q(3).gguf_name(), "blk.3.attn_q.weight");
        assert_eq!(Matrix::O(0).gguf_name(), "blk.0.attn_output.weight");
        assert_eq!(Matrix::Down(11).gguf_name(), "blk.11.ffn_down.weight");
        assert_eq!(Matrix::Head.gguf_name(), "output.weight");
        assert_eq!(Norm::Ffn(2).gguf_name(), "blk.2.ffn_norm.weight");
        assert_eq!(Norm::Output.gguf_name(), "output_norm.weight");
        assert_eq!(Matrix::of_layer(1).len(), 7);
    }
}
