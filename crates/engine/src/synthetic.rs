//! Random-weight models of the architectures the engine runs, for tests and benchmarks.
//!
//! A [`SyntheticSpec`] describes a model's shape and weight types; [`build`] makes it in memory as a
//! [`GgufSource`] and [`write_gguf`] writes it as a GGUF file with llama.cpp's tensor names and
//! metadata keys, so the loader cannot tell it from a converted model.
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

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use super::error::{EngineError, Result};
use smolchat_gguf::{AlignedBytes, GgmlDType, GgufSource, RawTensor, Value};

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

/// `tokenizer.*` metadata copied from a real model. Its `Debug` output is a summary: the token
/// and merge arrays run to tens of thousands of entries.
#[derive(Clone, Default)]
pub struct TokenizerMetadata(pub Vec<(String, Value)>);

impl std::fmt::Debug for TokenizerMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&str> = self.0.iter().map(|(k, _)| k.as_str()).collect();
        write!(f, "TokenizerMetadata({keys:?})")
    }
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

    /// Copies every `tokenizer.*` key of `src` (a real model's vocabulary, merges, special
    /// tokens and chat template) and sets `vocab_size` to its token count, so the model can be
    /// driven with real text. SmolLM2's tokenizer gives a vocabulary of 49152.
    pub fn with_tokenizer_from(mut self, src: &GgufSource) -> Result<Self> {
        let tokens_key = "tokenizer.ggml.tokens";
        let n_tokens = match src.require(tokens_key)? {
            Value::Array(tokens) if !tokens.is_empty() => tokens.len(),
            _ => {
                return Err(EngineError::from(smolchat_gguf::GgufError::BadKey {
                    key: tokens_key.to_string(),
                    detail: "expected a non-empty array of token strings".to_string(),
                }))
            }
        };
        let mut keys: Vec<(String, Value)> = src
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // HashMap order is random; sorted keys keep written files byte-identical.
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        self.tokenizer = TokenizerMetadata(keys);
        self.vocab_size = n_tokens;
        Ok(self)
    }

    /// Gives the model a placeholder byte-level BPE vocabulary of `vocab_size` tokens (the 256
    /// byte tokens, then `<|synthetic_N|>` fillers; no merges) so other engines that insist on a
    /// tokenizer, such as llama.cpp, can load the file. Used to measure llama.cpp on the same
    /// synthetic weights; the text it would produce is meaningless.
    pub fn with_placeholder_tokenizer(mut self) -> Self {
        let bytes = byte_level_alphabet();
        let mut tokens: Vec<Value> = bytes.iter().map(|c| Value::String(c.to_string())).collect();
        for i in tokens.len()..self.vocab_size {
            tokens.push(Value::String(format!("<|synthetic_{i}|>")));
        }
        tokens.truncate(self.vocab_size);
        let types: Vec<Value> = (0..tokens.len())
            .map(|i| Value::I32(if i < 256 { 1 } else { 3 }))
            .collect();
        let last = self.vocab_size.saturating_sub(1) as u32;
        self.tokenizer = TokenizerMetadata(vec![
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            (
                "tokenizer.ggml.pre".into(),
                Value::String("smaug-bpe".into()),
            ),
            ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
            ("tokenizer.ggml.token_type".into(), Value::Array(types)),
            ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(last)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(last)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ]);
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
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("token_embd.weight".into(), vec![self.vocab_size, h]),
            ("output_norm.weight".into(), vec![h]),
        ];
        if !self.tied_embeddings {
            shapes.push(("output.weight".into(), vec![self.vocab_size, h]));
        }
        for i in 0..self.n_layers {
            let blk = |s: &str| format!("blk.{i}.{s}.weight");
            shapes.extend([
                (blk("attn_norm"), vec![h]),
                (blk("attn_q"), vec![self.n_heads * hd, h]),
                (blk("attn_k"), vec![self.n_kv_heads * hd, h]),
                (blk("attn_v"), vec![self.n_kv_heads * hd, h]),
                (blk("attn_output"), vec![h, self.n_heads * hd]),
                (blk("ffn_norm"), vec![h]),
                (blk("ffn_gate"), vec![f, h]),
                (blk("ffn_up"), vec![f, h]),
                (blk("ffn_down"), vec![h, f]),
            ]);
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
    /// Row-major, `[rows = out, cols = in]`, as [`RawTensor::dims`].
    pub dims: Vec<usize>,
    pub dtype: GgmlDType,
}

impl TensorPlan {
    pub fn n_bytes(&self) -> usize {
        let elems: usize = self.dims.iter().product();
        elems / self.dtype.block_size() * self.dtype.type_size()
    }
}

/// A generated model: ordered metadata and tensors, ready to become a [`GgufSource`] or a file.
pub struct SyntheticModel {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<RawTensor>,
}

impl SyntheticModel {
    pub fn generate(spec: &SyntheticSpec) -> Result<Self> {
        let plan = spec.tensor_plan()?;
        let start = std::time::Instant::now();
        let tensors = plan
            .par_iter()
            .map(|p| generate_tensor(spec, p))
            .collect::<Result<Vec<_>>>()?;
        let model = Self {
            metadata: spec.metadata(),
            tensors,
        };
        tracing::debug!(
            arch = %spec.arch,
            tensors = model.tensors.len(),
            bytes = model.total_bytes(),
            elapsed_ms = start.elapsed().as_millis() as u64,
            "generated synthetic model"
        );
        Ok(model)
    }

    /// Bytes of tensor data (what the loaded model will hold).
    pub fn total_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }

    /// Relabels the model as another architecture: `general.architecture` and every
    /// `{old}.` key. The tensors are untouched.
    pub fn set_architecture(&mut self, arch: &str) {
        let old = arch_of(self.metadata.iter().map(|(k, v)| (k.as_str(), v)));
        for (k, v) in self.metadata.iter_mut() {
            if k == "general.architecture" {
                *v = Value::String(arch.to_string());
            } else if let Some(new) = old.as_deref().and_then(|o| renamed_key(k, o, arch)) {
                *k = new;
            }
        }
    }

    pub fn into_source(self) -> GgufSource {
        GgufSource::in_memory(self.metadata.into_iter().collect(), self.tensors)
    }

    /// Writes the model as a GGUF (version 3) file.
    pub fn write_gguf(&self, path: &Path) -> Result<()> {
        let meta: Vec<(&str, &Value)> =
            self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let infos: Vec<TensorInfo> = self
            .tensors
            .iter()
            .map(|t| TensorInfo {
                name: &t.name,
                dtype: t.dtype,
                dims: &t.dims,
                n_bytes: t.data.len(),
            })
            .collect();
        write_gguf_file(path, &meta, &infos, |i, w| {
            w.write_all(self.tensors[i].data.as_slice())
                .map_err(|e| io_error(path, e))
        })
    }
}

/// Builds the model in memory.
pub fn build(spec: &SyntheticSpec) -> Result<GgufSource> {
    Ok(SyntheticModel::generate(spec)?.into_source())
}

/// Builds the model and writes it as a GGUF file.
pub fn write_gguf(spec: &SyntheticSpec, path: &Path) -> Result<()> {
    SyntheticModel::generate(spec)?.write_gguf(path)
}

/// Writes any source (edited metadata included) as a GGUF file, one tensor at a time. A
/// memory-backed source gives its tensors up in the process (that is how [`GgufSource`] hands
/// out tensor bytes), so use it once; a file-backed one is only read.
pub fn write_source_as_gguf(src: &mut GgufSource, path: &Path) -> Result<()> {
    let mut keys: Vec<&String> = src.metadata.keys().collect();
    // A stable order (general.* first, as llama.cpp writes) makes the file reproducible.
    keys.sort_by_key(|k| (!k.starts_with("general."), k.as_str()));
    let meta_owned: Vec<(String, Value)> = keys
        .into_iter()
        .filter_map(|k| src.metadata.get(k).map(|v| (k.clone(), v.clone())))
        .collect();
    let meta: Vec<(&str, &Value)> = meta_owned.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut names: Vec<String> = src.tensors.keys().cloned().collect();
    names.sort_by_key(|n| tensor_order(n));
    let entries: Vec<(String, GgmlDType, Vec<usize>, usize)> = names
        .iter()
        .filter_map(|n| {
            src.tensors
                .get(n)
                .map(|e| (n.clone(), e.dtype, e.dims.clone(), e.n_bytes))
        })
        .collect();
    let infos: Vec<TensorInfo> = entries
        .iter()
        .map(|(name, dtype, dims, n_bytes)| TensorInfo {
            name,
            dtype: *dtype,
            dims,
            n_bytes: *n_bytes,
        })
        .collect();
    write_gguf_file(path, &meta, &infos, |i, w| {
        let t = src.take_tensor(&entries[i].0)?;
        if t.data.len() != entries[i].3 {
            return Err(EngineError::InvalidStep(format!(
                "tensor `{}` holds {} bytes but its directory entry says {}",
                t.name,
                t.data.len(),
                entries[i].3
            )));
        }
        w.write_all(t.data.as_slice())
            .map_err(|e| io_error(path, e))
    })
}

/// Relabels a source's metadata as another architecture (`general.architecture` and every
/// `{old}.` key), e.g. to run smollm3 weights as llama without writing a file.
pub fn rename_architecture(metadata: &mut HashMap<String, Value>, arch: &str) {
    let old = arch_of(metadata.iter().map(|(k, v)| (k.as_str(), v)));
    if let Some(old) = old {
        let moved: Vec<String> = metadata
            .keys()
            .filter(|k| renamed_key(k, &old, arch).is_some())
            .cloned()
            .collect();
        for k in moved {
            if let (Some(v), Some(new)) = (metadata.remove(&k), renamed_key(&k, &old, arch)) {
                metadata.insert(new, v);
            }
        }
    }
    metadata.insert(
        "general.architecture".to_string(),
        Value::String(arch.to_string()),
    );
}

fn arch_of<'a>(mut meta: impl Iterator<Item = (&'a str, &'a Value)>) -> Option<String> {
    meta.find_map(|(k, v)| match (k, v) {
        ("general.architecture", Value::String(s)) => Some(s.clone()),
        _ => None,
    })
}

fn renamed_key(key: &str, old: &str, new: &str) -> Option<String> {
    let rest = key.strip_prefix(old)?.strip_prefix('.')?;
    Some(format!("{new}.{rest}"))
}

/// llama.cpp's order: embeddings and output first, then layers in numeric (not string) order.
fn tensor_order(name: &str) -> (usize, usize, String) {
    match layer_of(name) {
        Some(i) => (1, i, name.to_string()),
        None => (0, 0, name.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// Generation

/// SplitMix64: tiny, fast, and fixed forever, so a seed means the same model in every build
/// (a library RNG may change its stream between versions).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform integer in `lo..=hi`.
    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (((self.next_u64() >> 32) * u64::from(hi - lo + 1)) >> 32) as u32
    }
    fn fill_bytes(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let b = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of one tensor: from the spec's seed and the name only (FNV-1a), so neither the
/// architecture, the type nor the other tensors change it.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    mix64(seed ^ mix64(h))
}

/// Work is split into fixed-size chunks, each with its own seed, so results do not depend on the
/// number of threads.
const FLOAT_CHUNK: usize = 1 << 16;
const BLOCK_CHUNK: usize = 1 << 12;

fn chunk_rng(seed: u64, chunk: usize) -> SplitMix64 {
    SplitMix64(mix64(seed ^ mix64(chunk as u64 ^ 0x6a09_e667_f3bc_c909)))
}

fn generate_tensor(spec: &SyntheticSpec, plan: &TensorPlan) -> Result<RawTensor> {
    let seed = tensor_seed(spec.seed, &plan.name);
    let elems: usize = plan.dims.iter().product();
    let cols = plan.dims.last().copied().unwrap_or(1).max(1);
    let data = if plan.dims.len() == 1 {
        // Norm weights near 1, as trained models have them.
        f32_bytes(&random_floats(elems, seed, |r| {
            1.0 + (r.unit() - 0.5) * 0.2
        }))
    } else {
        let sigma = 1.0 / (cols as f32).sqrt();
        let half_width = sigma * 3f32.sqrt();
        let uniform = move |r: &mut SplitMix64| (r.unit() * 2.0 - 1.0) * half_width;
        match (plan.dtype, spec.fill) {
            (GgmlDType::F32, _) => f32_bytes(&random_floats(elems, seed, uniform)),
            (GgmlDType::F16, _) => {
                let v = random_floats(elems, seed, uniform);
                let mut out = AlignedBytes::zeroed(elems * 2);
                for (o, x) in out.as_mut_slice().chunks_exact_mut(2).zip(&v) {
                    o.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
                }
                out
            }
            (t, WeightFill::RandomBlocks) if block_recipe(t).is_some() => {
                random_blocks(t, elems, sigma, seed)
            }
            (t, _) => {
                let v = random_floats(elems, seed, uniform);
                let tensor = Tensor::from_vec(v, plan.dims.as_slice(), &Device::Cpu)?;
                let q = QTensor::quantize(&tensor, t)?;
                AlignedBytes::from_slice(&q.data()?)
            }
        }
    };
    Ok(RawTensor {
        name: plan.name.clone(),
        dtype: plan.dtype,
        dims: plan.dims.clone(),
        data,
    })
}

fn random_floats(n: usize, seed: u64, draw: impl Fn(&mut SplitMix64) -> f32 + Sync) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(FLOAT_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut r = chunk_rng(seed, c);
            for x in chunk.iter_mut() {
                *x = draw(&mut r);
            }
        });
    v
}

fn f32_bytes(v: &[f32]) -> AlignedBytes {
    let mut out = AlignedBytes::zeroed(v.len() * 4);
    for (o, x) in out.as_mut_slice().chunks_exact_mut(4).zip(v) {
        o.copy_from_slice(&x.to_le_bytes());
    }
    out
}

/// How to turn a block of random bytes into a plausible block of type `t`: `gain` is the standard
/// deviation of a weight per unit of the block scale `d`, given the scale pattern `fix` writes.
struct BlockRecipe {
    gain: f32,
    fix: fn(&mut [u8], f32, &mut SplitMix64),
}

fn put_f16(b: &mut [u8], at: usize, x: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
}

/// Types that store `q - offset` with a lopsided range (-8..=7 for Q4_0) would give every block
/// a mean of -d/2; a random sign on the scale, as real quantizers produce, centres them.
fn random_sign(x: f32, r: &mut SplitMix64) -> f32 {
    if r.next_u64() & 1 == 0 {
        x
    } else {
        -x
    }
}

/// Packs eight 6-bit scales and mins the way Q4_K and Q5_K store them (the inverse of
/// `get_scale_min_k4`).
fn pack_k4_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    q
}

/// Recipes for the types whose layout we write directly; other types are quantized from floats.
/// In every recipe the weights are centred on zero: where a type stores a minimum, it is set to
/// the middle of the quant range; where the quant range is lopsided, the scale's sign is random.
fn block_recipe(t: GgmlDType) -> Option<BlockRecipe> {
    Some(match t {
        // {d, qs[16]}: d * (q - 8), q in 0..16.
        GgmlDType::Q4_0 => BlockRecipe {
            gain: 4.61,
            fix: |b, d, r| put_f16(b, 0, random_sign(d, r)),
        },
        // {d, m, qs[16]}: d * q + m.
        GgmlDType::Q4_1 => BlockRecipe {
            gain: 4.61,
            fix: |b, d, _| {
                put_f16(b, 0, d);
                put_f16(b, 2, -7.5 * d);
            },
        },
        // {d, qh[4], qs[16]}: d * (q - 16), q in 0..32.
        GgmlDType::Q5_0 => BlockRecipe {
            gain: 9.23,
            fix: |b, d, r| put_f16(b, 0, random_sign(d, r)),
        },
        // {d, m, qh[4], qs[16]}: d * q + m.
        GgmlDType::Q5_1 => BlockRecipe {
            gain: 9.23,
            fix: |b, d, _| {
                put_f16(b, 0, d);
                put_f16(b, 2, -15.5 * d);
            },
        },
        // {d, qs[32] i8}: d * q.
        GgmlDType::Q8_0 => BlockRecipe {
            gain: 73.9,
            fix: |b, d, r| put_f16(b, 0, random_sign(d, r)),
        },
        // {scales[16] (scale | min << 4), qs[64], d, dmin}: d * sc * q - dmin * m, q in 0..4.
        GgmlDType::Q2K => BlockRecipe {
            gain: 9.8,
            fix: |b, d, r| {
                for s in b[..16].iter_mut() {
                    let sc = r.range(1, 15) as u8;
                    *s = sc | (sc << 4);
                }
                put_f16(b, 80, d);
                put_f16(b, 82, 1.5 * d);
            },
        },
        // {hmask[32], qs[64], scales[12], d}: d * (sc - 32) * q, q in -4..4; random 6-bit
        // scales are already centred.
        GgmlDType::Q3K => BlockRecipe {
            gain: 42.0,
            fix: |b, d, _| put_f16(b, 108, d),
        },
        // {d, dmin, scales[12], qs[128]}: d * sc * q - dmin * m, q in 0..16.
        GgmlDType::Q4K => BlockRecipe {
            gain: 54.0,
            fix: |b, d, r| {
                let sc: [u8; 8] = std::array::from_fn(|_| r.range(8, 15) as u8);
                put_f16(b, 0, d);
                put_f16(b, 2, 7.5 * d);
                b[4..16].copy_from_slice(&pack_k4_scales(sc, sc));
            },
        },
        // {d, dmin, scales[12], qh[32], qs[128]}: as Q4_K with q in 0..32.
        GgmlDType::Q5K => BlockRecipe {
            gain: 108.0,
            fix: |b, d, r| {
                let sc: [u8; 8] = std::array::from_fn(|_| r.range(8, 15) as u8);
                put_f16(b, 0, d);
                put_f16(b, 2, 15.5 * d);
                b[4..16].copy_from_slice(&pack_k4_scales(sc, sc));
            },
        },
        // {ql[128], qh[64], scales[16] i8, d}: d * sc * (q - 32), q in 0..64.
        GgmlDType::Q6K => BlockRecipe {
            gain: 188.0,
            fix: |b, d, r| {
                for s in b[192..208].iter_mut() {
                    *s = random_sign(r.range(4, 15) as f32, r) as i8 as u8;
                }
                put_f16(b, 208, d);
            },
        },
        _ => return None,
    })
}

/// Random quants with scales chosen so the weights have standard deviation about `sigma`; each
/// block's `d` varies by ±25% as real blocks' do.
fn random_blocks(t: GgmlDType, elems: usize, sigma: f32, seed: u64) -> AlignedBytes {
    let block_bytes = t.type_size();
    let n_blocks = elems / t.block_size();
    let mut out = AlignedBytes::zeroed(n_blocks * block_bytes);
    if let Some(recipe) = block_recipe(t) {
        let base = sigma / recipe.gain;
        out.as_mut_slice()
            .par_chunks_mut(BLOCK_CHUNK * block_bytes)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut r = chunk_rng(seed, c);
                r.fill_bytes(chunk);
                for block in chunk.chunks_exact_mut(block_bytes) {
                    let d = base * (0.75 + 0.5 * r.unit());
                    (recipe.fix)(block, d, &mut r);
                }
            });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Writing

struct TensorInfo<'a> {
    name: &'a str,
    dtype: GgmlDType,
    dims: &'a [usize],
    n_bytes: usize,
}

const ALIGNMENT: usize = 32;

fn io_error(path: &Path, e: std::io::Error) -> EngineError {
    EngineError::from(smolchat_gguf::GgufError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// GGUF type ids (the inverse of `gguf::dtype_from_id`).
fn dtype_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// Writes a value without its type tag. Errors (as `InvalidInput`) on an array mixing types,
/// which GGUF cannot express.
fn write_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => write_str(w, s),
        Value::Array(items) => {
            // An empty array still needs an element type; any will do.
            let elem = items.first().map(value_type_id).unwrap_or(4);
            if items.iter().any(|x| value_type_id(x) != elem) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a metadata array mixes value types",
                ));
            }
            w.write_all(&elem.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|x| write_value(w, x))
        }
    }
}

fn padding(pos: usize) -> usize {
    pos.next_multiple_of(ALIGNMENT) - pos
}

/// Writes a GGUF v3 file: header, metadata, tensor directory, then each tensor's bytes (asked of
/// `data` in directory order, so tensors can be streamed one at a time), 32-byte aligned.
fn write_gguf_file(
    path: &Path,
    metadata: &[(&str, &Value)],
    tensors: &[TensorInfo],
    mut data: impl FnMut(usize, &mut BufWriter<File>) -> Result<()>,
) -> Result<()> {
    let file = File::create(path).map_err(|e| io_error(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut header: Vec<u8> = Vec::new();
    let io = |e| io_error(path, e);
    header.extend_from_slice(b"GGUF");
    header.extend_from_slice(&3u32.to_le_bytes());
    header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        write_str(&mut header, k).map_err(io)?;
        header.extend_from_slice(&value_type_id(v).to_le_bytes());
        write_value(&mut header, v).map_err(|e| {
            EngineError::from(smolchat_gguf::GgufError::BadKey {
                key: k.to_string(),
                detail: e.to_string(),
            })
        })?;
    }
    let mut offset = 0usize;
    for t in tensors {
        write_str(&mut header, t.name).map_err(io)?;
        header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        // GGUF lists the innermost dimension first.
        for d in t.dims.iter().rev() {
            header.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        header.extend_from_slice(&dtype_id(t.dtype).to_le_bytes());
        header.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += t.n_bytes + padding(t.n_bytes);
    }
    header.resize(header.len() + padding(header.len()), 0);
    w.write_all(&header).map_err(io)?;
    let zeros = [0u8; ALIGNMENT];
    for (i, t) in tensors.iter().enumerate() {
        data(i, &mut w)?;
        w.write_all(&zeros[..padding(t.n_bytes)]).map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(())
}

/// GPT-2's byte-to-character table: the 256 characters byte-level BPE uses for raw bytes.
fn byte_level_alphabet() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<(u32, char)> = printable
        .iter()
        .filter_map(|&b| char::from_u32(b).map(|c| (b, c)))
        .collect();
    let mut extra = 0u32;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            if let Some(c) = char::from_u32(256 + extra) {
                chars.push((b, c));
            }
            extra += 1;
            printable.push(b);
        }
    }
    chars.sort_by_key(|(b, _)| *b);
    chars.into_iter().map(|(_, c)| c).collect()
}
