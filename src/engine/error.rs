//! The engine's one error type. Every message says what was wrong and, where it can, how to fix it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file (it starts with {magic:02x?}, a GGUF file starts with \"GGUF\"); point --model at a llama.cpp GGUF model")]
    NotGguf { path: PathBuf, magic: Vec<u8> },
    #[error("{path} is truncated or corrupt: {detail}; download or convert the file again")]
    Corrupt { path: PathBuf, detail: String },
    #[error("unsupported model architecture `{0}`: smolchat runs GGUF files of architecture `smollm3` or `llama`")]
    UnsupportedArchitecture(String),
    #[error("tensor `{name}` has type {dtype}, which smolchat cannot run (supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")]
    UnsupportedTensorType { name: String, dtype: String },
    #[error("the GGUF file has no tensor `{0}`")]
    MissingTensor(String),
    #[error("the GGUF file has no metadata key `{0}`")]
    MissingKey(String),
    #[error("metadata key `{key}` is invalid: {detail}")]
    BadKey { key: String, detail: String },
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    BadShape {
        name: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("sampling: {0}")]
    Sampling(String),
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    #[error(
        "sequence {seq} would need {needed} positions but the context window is {window} tokens"
    )]
    ContextOverflow {
        seq: u64,
        needed: usize,
        window: usize,
    },
    #[error("the KV cache is full: the step needs {needed_blocks} more blocks of 16 positions and {free_blocks} are free; finish or evict other conversations, or raise scheduler.kv_budget_mib")]
    KvCacheFull {
        needed_blocks: usize,
        free_blocks: usize,
    },
    #[error("KV cache: {0}")]
    KvConfig(String),
    #[error("invalid step: {0}")]
    InvalidStep(String),
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    BadToken { id: u32, vocab: usize },
    #[error("device `{value}`: {reason}")]
    BadDevice { value: String, reason: String },
    #[error("device `{0}` is not available: {1}")]
    Device(String, String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
