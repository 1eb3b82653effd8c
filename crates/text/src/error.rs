//! The text layer's one error type: tokenizer, chat template and sampling problems, each saying
//! what was wrong and, where it can, how to fix it.

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("sampling: {0}")]
    Sampling(String),
    /// A grammar or schema for constrained decoding that cannot be compiled or followed.
    #[error("constraint: {0}")]
    Constraint(String),
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    BadToken { id: u32, vocab: usize },
    #[error(transparent)]
    Gguf(#[from] smolchat_gguf::GgufError),
}

pub type Result<T, E = TextError> = std::result::Result<T, E>;
