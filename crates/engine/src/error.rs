//! The engine's one error type. Every message says what was wrong and, where it can, how to fix it.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("unsupported model architecture `{0}`: smolchat runs GGUF files of architecture `smollm3` or `llama`")]
    UnsupportedArchitecture(String),
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    BadShape {
        name: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
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
    /// A CUDA driver or kernel failure in the fast tier.
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error(transparent)]
    Gguf(#[from] smolchat_gguf::GgufError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
