//! The model's hyper-parameters, read from GGUF metadata. Nothing here is hard-coded except the
//! SmolLM3 NoPE interval, which no GGUF key carries (llama.cpp and transformers hard-code it too).

use super::error::{EngineError, Result};
use smolchat_gguf::GgufSource;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    SmolLm3,
}

impl Architecture {
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::SmolLm3 => "smollm3",
        }
    }
}

/// SmolLM3 leaves out RoPE on every fourth layer: layer `i` uses RoPE iff `(i + 1) % 4 != 0`.
pub const SMOLLM3_NOPE_INTERVAL: usize = 4;

/// YaRN context extension (as in llama.cpp's `ggml_rope_yarn`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnScaling {
    /// Context extension factor (SmolLM3: 2, from 64k to 128k).
    pub factor: f32,
    /// The context the model was trained on.
    pub original_context: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// Extra scale on the attention logits' magnitude; 1.0 unless the file says otherwise.
    pub attn_factor: f32,
}

impl YarnScaling {
    pub fn new(factor: f32, original_context: usize) -> Self {
        Self {
            factor,
            original_context,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub name: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates (normally all of them).
    pub rope_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
    /// `uses_rope[i]` is false on NoPE layers.
    pub uses_rope: Vec<bool>,
    pub yarn: Option<YarnScaling>,
}

impl ModelConfig {
    /// Turns on YaRN context extension (when the file does not already ask for it): RoPE
    /// frequencies are rescaled for `factor` times the original context, and the usable context
    /// grows by that factor.
    pub fn apply_yarn(&mut self, factor: f32, original_context: Option<usize>) {
        let original = original_context.unwrap_or(self.context_length);
        self.yarn = Some(YarnScaling::new(factor, original));
        self.context_length = (original as f32 * factor) as usize;
    }

    pub fn from_gguf(src: &GgufSource) -> Result<Self> {
        let arch_name = src.string("general.architecture")?;
        let arch = match arch_name {
            "llama" => Architecture::Llama,
            "smollm3" => Architecture::SmolLm3,
            other => return Err(EngineError::UnsupportedArchitecture(other.to_string())),
        };
        let k = |suffix: &str| format!("{arch_name}.{suffix}");
        let n_layers = src.usize(&k("block_count"))?;
        // Every layer has its tensors in the file, so a hostile block count cannot make the
        // loader reserve room for billions of layers (found by tests/fuzz.rs).
        let last_layer = format!("blk.{}.attn_norm.weight", n_layers.saturating_sub(1));
        if n_layers == 0 || !src.tensors.contains_key(&last_layer) {
            return Err(EngineError::from(smolchat_gguf::GgufError::BadKey {
                key: k("block_count"),
                detail: format!(
                    "{n_layers} layers, but the file has no `{last_layer}` tensor for the last of them"
                ),
            }));
        }
        let hidden = src.usize(&k("embedding_length"))?;
        let ffn = src.usize(&k("feed_forward_length"))?;
        let n_heads = src.usize(&k("attention.head_count"))?;
        let n_kv_heads = src
            .opt_usize(&k("attention.head_count_kv"))?
            .unwrap_or(n_heads);
        let bad = |key: String, detail: String| {
            EngineError::from(smolchat_gguf::GgufError::BadKey { key, detail })
        };
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(bad(
                k("attention.head_count_kv"),
                format!("{n_kv_heads} KV heads do not divide {n_heads} query heads"),
            ));
        }
        let head_dim = match src.opt_usize(&k("attention.key_length"))? {
            Some(d) => d,
            None => {
                if hidden % n_heads != 0 {
                    return Err(bad(
                        k("attention.head_count"),
                        format!("{n_heads} heads do not divide the embedding length {hidden}"),
                    ));
                }
                hidden / n_heads
            }
        };
        let rope_dim = src
            .opt_usize(&k("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(bad(
                k("rope.dimension_count"),
                format!("{rope_dim} must be even and at most the head dimension {head_dim}"),
            ));
        }
        let rope_theta = src.opt_f32(&k("rope.freq_base"))?.unwrap_or(10_000.0);
        let rms_eps = src.f32(&k("attention.layer_norm_rms_epsilon"))?;
        let context_length = src.usize(&k("context_length"))?;
        let vocab_size = match src.opt_usize(&k("vocab_size"))? {
            Some(v) => v,
            None => src
                .tensors
                .get("token_embd.weight")
                .and_then(|t| t.dims.first().copied())
                .ok_or_else(|| {
                    EngineError::from(smolchat_gguf::GgufError::MissingTensor(
                        "token_embd.weight".into(),
                    ))
                })?,
        };
        let uses_rope = (0..n_layers)
            .map(|i| match arch {
                Architecture::Llama => true,
                Architecture::SmolLm3 => (i + 1) % SMOLLM3_NOPE_INTERVAL != 0,
            })
            .collect();
        let yarn = match src.opt_string(&k("rope.scaling.type")) {
            Some("yarn") => {
                let factor = src.f32(&k("rope.scaling.factor"))?;
                let original = src
                    .opt_usize(&k("rope.scaling.original_context_length"))?
                    .unwrap_or(context_length);
                let mut y = YarnScaling::new(factor, original);
                if let Some(a) = src.opt_f32(&k("rope.scaling.attn_factor"))? {
                    y.attn_factor = a;
                }
                Some(y)
            }
            None | Some("none") => None,
            Some(other) => {
                return Err(bad(
                    k("rope.scaling.type"),
                    format!("rope scaling `{other}` is not supported (only `yarn`)"),
                ))
            }
        };
        Ok(Self {
            arch,
            name: src
                .opt_string("general.name")
                .unwrap_or(arch_name)
                .to_string(),
            n_layers,
            hidden,
            ffn,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            rope_theta,
            rms_eps,
            context_length,
            vocab_size,
            uses_rope,
            yarn,
        })
    }

    /// KV-cache bytes per token at f32 (both K and V, every layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }
}
