//! Random-weight models of the architectures the engine runs, for tests and benchmarks.
//!
//! A [`SyntheticSpec`] describes a model's shape and weight types; [`build`] makes it in memory as a
//! [`GgufSource`](smolchat_gguf::GgufSource) and [`write_gguf`] writes it as a GGUF file with
//! llama.cpp's tensor names and metadata keys, so the loader cannot tell it from a converted model.
//!
//! Every tensor is generated from its own seed, derived from the spec's seed and the tensor's
//! name only. So the same spec under another architecture name (`llama` instead of `smollm3`) has
//! byte-identical tensors, and with [`WeightFill::Quantize`] the same spec at another type is the
//! quantization of the same float weights (an `F32` build is the exact original of a `Q8_0` one).
//!
//! Two ways to fill matrices:
//! - [`WeightFill::Quantize`]: draw f32 values, then quantize them with candle. Faithful and
//!   cheap for small models.
//! - [`WeightFill::RandomBlocks`]: write random quantized blocks directly (random quants, small
//!   random scales). Quantizing three billion floats would take minutes and ~12 GB; this builds the
//!   SmolLM3-3B shape in seconds in about the memory of the quantized weights (~1.9 GB).
//!
//! Either way a matrix's weights have standard deviation about `1/sqrt(columns)`, so each matrix
//! product roughly keeps the size of its input and a forward pass stays finite; norm weights are
//! near 1.

use super::error::{EngineError, Result};
use crate::weights::{Dims, Matrix, Norm, EMBEDDING};
use smolchat_gguf::{GgmlDType, Value};

mod model;
mod vocab;
mod weights;
mod writer;

pub use model::{
    build, rename_architecture, requantize_as_gguf, write_gguf, write_source_as_gguf,
    SyntheticModel,
};
pub use vocab::TokenizerMetadata;

/// Which GGML type each tensor gets. Norm weights are always F32, as llama.cpp keeps them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeMix {
    /// Every 2-D matrix (embeddings included) in one type.
    Uniform(GgmlDType),
    /// llama.cpp's Q4_K_M: most matrices Q4_K; Q6_K for the output matrix (the token embedding
    /// when the embeddings are tied, else `output.weight`), and for `attn_v` and `ffn_down` in the
    /// layers llama.cpp's `use_more_bits` picks (see [`q4km_more_bits`]).
    Q4KM,
}

/// How matrix weights are produced; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFill {
    Quantize,
    RandomBlocks,
}

/// The shape and types of a synthetic model.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    /// `general.architecture`: `llama` or `smollm3` for models the engine runs; any other name
    /// is written as given (to test the loader's refusal).
    pub arch: String,
    pub vocab_size: usize,
    /// `embedding_length`.
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// `feed_forward_length`.
    pub ffn: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    /// No `output.weight`: the output projection reuses `token_embd.weight`.
    pub tied_embeddings: bool,
    pub seed: u64,
    pub type_mix: TypeMix,
    pub fill: WeightFill,
    /// Copied into the metadata when not empty; see [`SyntheticSpec::with_tokenizer_from`].
    pub tokenizer: TokenizerMetadata,
}

impl SyntheticSpec {
    /// A model small enough to build in milliseconds: vocab 512, hidden 256, 4 layers (layer 3 is
    /// NoPE under `smollm3`), 4 heads of 64, 2 KV heads, FFN 512, tied embeddings, all F32.
    /// Hidden and FFN are multiples of 256 so every type, K-quants included, fits the rows.
    pub fn tiny(arch: &str) -> Self {
        Self {
            arch: arch.to_string(),
            vocab_size: 512,
            hidden: 256,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            ffn: 512,
            rope_theta: 10_000.0,
            rms_eps: 1e-5,
            context_length: 2048,
            tied_embeddings: true,
            seed: 0x5eed,
            type_mix: TypeMix::Uniform(GgmlDType::F32),
            fill: WeightFill::Quantize,
            tokenizer: TokenizerMetadata::default(),
        }
    }

    /// The SmolLM3-3B shape with llama.cpp's Q4_K_M mix: 36 layers, hidden 2048, FFN 11008, 16
    /// heads of 128, 4 KV heads, vocab 128256, rope theta 5e6, eps 1e-6, context 65536, tied
    /// embeddings. Filled with random blocks: about 1.9 GB, built in seconds.
    pub fn smollm3_3b() -> Self {
        Self {
            arch: "smollm3".to_string(),
            vocab_size: 128_256,
            hidden: 2048,
            n_layers: 36,
            n_heads: 16,
            n_kv_heads: 4,
            ffn: 11_008,
            rope_theta: 5_000_000.0,
            rms_eps: 1e-6,
            context_length: 65_536,
            tied_embeddings: true,
            seed: 0x3b,
            type_mix: TypeMix::Q4KM,
            fill: WeightFill::RandomBlocks,
            tokenizer: TokenizerMetadata::default(),
        }
    }

    pub fn with_arch(mut self, arch: &str) -> Self {
        self.arch = arch.to_string();
        self
    }

    pub fn with_type_mix(mut self, type_mix: TypeMix) -> Self {
        self.type_mix = type_mix;
        self
    }

    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads.max(1)
    }

    /// The type llama.cpp's mix gives tensor `name` (a norm is F32 whatever the mix).
    pub fn dtype_for(&self, name: &str) -> GgmlDType {
        if name.ends_with("_norm.weight") {
            return GgmlDType::F32;
        }
        match self.type_mix {
            TypeMix::Uniform(t) => t,
            TypeMix::Q4KM => {
                let is_output = name == "output.weight"
                    || (self.tied_embeddings && name == "token_embd.weight");
                let more_bits = layer_of(name).is_some_and(|i| {
                    (name.ends_with(".attn_v.weight") || name.ends_with(".ffn_down.weight"))
                        && q4km_more_bits(i, self.n_layers)
                });
                if is_output || more_bits {
                    GgmlDType::Q6K
                } else {
                    GgmlDType::Q4K
                }
            }
        }
    }

    /// Every tensor of the model, in the order llama.cpp writes them, with shapes and types.
    /// Errors on a shape the engine could not run or a type whose blocks do not fit the rows.
    pub fn tensor_plan(&self) -> Result<Vec<TensorPlan>> {
        self.validate()?;
        let (h, hd, f) = (self.hidden, self.head_dim(), self.ffn);
        // The names and shapes the loader reads (`weights`), in llama.cpp's writing order.
        let dims = Dims {
            vocab: self.vocab_size,
            hidden: h,
            q_dim: self.n_heads * hd,
            kv_dim: self.n_kv_heads * hd,
            ffn: f,
        };
        let matrix = |m: Matrix| {
            let (rows, cols) = m.shape_in(dims);
            (m.gguf_name(), vec![rows, cols])
        };
        let norm = |n: Norm| (n.gguf_name(), vec![h]);
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            (EMBEDDING.into(), vec![self.vocab_size, h]),
            norm(Norm::Output),
        ];
        if !self.tied_embeddings {
            shapes.push(matrix(Matrix::Head));
        }
        for i in 0..self.n_layers {
            shapes.push(norm(Norm::Attn(i)));
            shapes.extend([Matrix::Q(i), Matrix::K(i), Matrix::V(i), Matrix::O(i)].map(matrix));
            shapes.push(norm(Norm::Ffn(i)));
            shapes.extend([Matrix::Gate(i), Matrix::Up(i), Matrix::Down(i)].map(matrix));
        }
        shapes
            .into_iter()
            .map(|(name, dims)| {
                let dtype = self.dtype_for(&name);
                let cols = dims.last().copied().unwrap_or(0);
                if !cols.is_multiple_of(dtype.block_size()) {
                    let key = if cols == f && cols != h {
                        "feed_forward_length"
                    } else {
                        "embedding_length"
                    };
                    return Err(EngineError::from(smolchat_gguf::GgufError::BadKey {
                        key: format!("{}.{key}", self.arch),
                        detail: format!(
                            "tensor `{name}` would have {cols} columns, not a multiple of the \
                             {} values in a {dtype:?} block; pick a multiple of {} or another type",
                            dtype.block_size(),
                            dtype.block_size()
                        ),
                    }));
                }
                Ok(TensorPlan { name, dims, dtype })
            })
            .collect()
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, detail: String| {
            Err(EngineError::from(smolchat_gguf::GgufError::BadKey {
                key: format!("{}.{key}", self.arch),
                detail,
            }))
        };
        if self.arch.is_empty() || self.arch.contains('.') {
            return Err(EngineError::from(smolchat_gguf::GgufError::BadKey {
                key: "general.architecture".to_string(),
                detail: format!("`{}` is not a usable architecture name", self.arch),
            }));
        }
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("embedding_length", self.hidden),
            ("block_count", self.n_layers),
            ("attention.head_count", self.n_heads),
            ("attention.head_count_kv", self.n_kv_heads),
            ("feed_forward_length", self.ffn),
            ("context_length", self.context_length),
        ] {
            if v == 0 {
                return bad(key, "must be at least 1".to_string());
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(
                "attention.head_count_kv",
                format!(
                    "{} KV heads do not divide {} query heads",
                    self.n_kv_heads, self.n_heads
                ),
            );
        }
        if !self.hidden.is_multiple_of(self.n_heads) || !self.head_dim().is_multiple_of(2) {
            return bad(
                "attention.head_count",
                format!(
                    "{} heads must divide the embedding length {} into even head sizes",
                    self.n_heads, self.hidden
                ),
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad("rope.freq_base", format!("{} is not > 0", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(
                "attention.layer_norm_rms_epsilon",
                format!("{} is not > 0", self.rms_eps),
            );
        }
        Ok(())
    }

    /// The GGUF metadata, in the order llama.cpp writes it.
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let a = &self.arch;
        let u = |v: usize| Value::U32(v as u32);
        let mut m = vec![
            ("general.architecture".to_string(), Value::String(a.clone())),
            ("general.type".to_string(), Value::String("model".into())),
            (
                "general.name".to_string(),
                Value::String(format!(
                    "synthetic-{a}-{}L-{}h-seed{}",
                    self.n_layers, self.hidden, self.seed
                )),
            ),
            (format!("{a}.context_length"), u(self.context_length)),
            (format!("{a}.embedding_length"), u(self.hidden)),
            (format!("{a}.block_count"), u(self.n_layers)),
            (format!("{a}.feed_forward_length"), u(self.ffn)),
            (format!("{a}.attention.head_count"), u(self.n_heads)),
            (format!("{a}.attention.head_count_kv"), u(self.n_kv_heads)),
            (format!("{a}.rope.freq_base"), Value::F32(self.rope_theta)),
            (
                format!("{a}.attention.layer_norm_rms_epsilon"),
                Value::F32(self.rms_eps),
            ),
            (format!("{a}.vocab_size"), u(self.vocab_size)),
            (format!("{a}.rope.dimension_count"), u(self.head_dim())),
        ];
        m.extend(self.tokenizer.0.iter().cloned());
        m.push(("general.quantization_version".to_string(), Value::U32(2)));
        m.push((
            "general.file_type".to_string(),
            Value::U32(self.file_type()),
        ));
        m
    }

    /// llama.cpp's `llama_ftype` for the mix (informational; the loader reads each tensor's type).
    fn file_type(&self) -> u32 {
        match self.type_mix {
            TypeMix::Q4KM => 15,
            TypeMix::Uniform(t) => match t {
                GgmlDType::F32 => 0,
                GgmlDType::F16 => 1,
                GgmlDType::Q4_0 => 2,
                GgmlDType::Q4_1 => 3,
                GgmlDType::Q8_0 => 7,
                GgmlDType::Q5_0 => 8,
                GgmlDType::Q5_1 => 9,
                GgmlDType::Q2K => 10,
                GgmlDType::Q3K => 11,
                GgmlDType::Q4K => 14,
                GgmlDType::Q5K => 16,
                GgmlDType::Q6K => 18,
                GgmlDType::BF16 => 32,
                // No llama.cpp file type is made of these; "guessed" is llama.cpp's own value for
                // a file whose type it cannot name.
                GgmlDType::Q8_1 | GgmlDType::Q8K => 1024,
            },
        }
    }
}

/// llama.cpp's `use_more_bits(i, n)`: the first and last eighth of the layers and every third
/// layer in between get the larger type in Q4_K_M (18 of 36 layers for SmolLM3-3B).
pub fn q4km_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The layer number of a `blk.{i}.…` tensor name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// One tensor of a [`SyntheticSpec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPlan {
    pub name: String,
    /// Row-major, `[rows = out, cols = in]`, as
    /// [`RawTensor::dims`](smolchat_gguf::RawTensor::dims).
    pub dims: Vec<usize>,
    pub dtype: GgmlDType,
}

impl TensorPlan {
    pub fn n_bytes(&self) -> usize {
        let elems: usize = self.dims.iter().product();
        elems / self.dtype.block_size() * self.dtype.type_size()
    }
}
