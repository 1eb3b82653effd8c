//! The seeds' engine: candle-transformers' own quantized models on the same GGUF file —
//! `quantized_llama` for architecture `llama` (SmolLM2) and `smol::quantized_smollm3` for
//! `smollm3` (its NoPE layers included). The project's first documents built on it; it stays as
//! an independent implementation to check ours against (`tests/seed_engine.rs`) and as a row of
//! `smolchat bench`, so how far ahead of it we are is a measured figure.
//!
//! It is not a tier the server runs: one sequence at a time, its own KV cache, no paging, no
//! batching. Two deliberate differences make its logits agree with ours only loosely: the
//! SmolLM3 model re-quantizes its LM head to Q8_0 from the dequantized embeddings, and both keep
//! their KV cache in f32 where ours is f16 by default.

use std::io::Write;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama;
use candle_transformers::models::smol::quantized_smollm3::QuantizedModelForCausalLM;

use crate::error::{EngineError, Result};

/// candle-transformers' model for a file's architecture.
pub enum SeedModel {
    Llama(quantized_llama::ModelWeights),
    SmolLm3(QuantizedModelForCausalLM),
}

impl SeedModel {
    /// Loads the model of the GGUF file at `path` on the CPU.
    pub fn load(path: &Path) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| {
            EngineError::Gguf(smolchat_gguf::GgufError::Io {
                path: path.to_path_buf(),
                source: e,
            })
        })?;
        let content = gguf_file::Content::read(&mut file)?;
        let arch = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        match arch.as_str() {
            "llama" => Ok(SeedModel::Llama(quantized_llama::ModelWeights::from_gguf(
                content,
                &mut file,
                &Device::Cpu,
            )?)),
            "smollm3" => {
                drop(file);
                // Its loader prints progress on stdout, which is `smolchat bench`'s JSON: sent
                // to stderr while it runs.
                let model = with_stdout_on_stderr(|| {
                    QuantizedModelForCausalLM::from_gguf(path, &Device::Cpu, false)
                })?;
                Ok(SeedModel::SmolLm3(model))
            }
            other => Err(EngineError::UnsupportedArchitecture(other.to_string())),
        }
    }

    /// Feeds `tokens` at positions `past..` of its one sequence (`past` 0 starts it anew) and
    /// returns the logits of the last of them.
    pub fn forward(&mut self, tokens: &[u32], past: usize) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidStep("no tokens to feed".into()));
        }
        let input = Tensor::new(tokens, &Device::Cpu)?.unsqueeze(0)?;
        let logits = match self {
            SeedModel::Llama(m) => m.forward(&input, past)?,
            SeedModel::SmolLm3(m) => {
                if past == 0 {
                    m.clear_kv_cache();
                }
                m.forward(&input, past)?
            }
        };
        Ok(logits.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// Runs `f` with the process's standard output pointed at standard error.
fn with_stdout_on_stderr<T>(f: impl FnOnce() -> T) -> T {
    let _ = std::io::stdout().flush();
    // SAFETY: dup/dup2/close on the process's own descriptors 1 and 2; a failure leaves stdout
    // as it was.
    let saved = unsafe { libc::dup(1) };
    let moved = saved >= 0 && unsafe { libc::dup2(2, 1) } >= 0;
    let out = f();
    let _ = std::io::stdout().flush();
    if moved {
        // SAFETY: as above; `saved` is the descriptor dup returned.
        unsafe {
            libc::dup2(saved, 1);
        }
    }
    if saved >= 0 {
        // SAFETY: as above.
        unsafe {
            libc::close(saved);
        }
    }
    out
}
