//! The GGUF layer's one error type: every way a model file can be wrong, naming the key or
//! tensor at fault and how to fix it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
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
    #[error("tensor `{name}` has type {dtype}, which smolchat cannot run (supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")]
    UnsupportedTensorType { name: String, dtype: String },
    #[error("the GGUF file has no tensor `{0}`")]
    MissingTensor(String),
    #[error("the GGUF file has no metadata key `{0}`")]
    MissingKey(String),
    #[error("metadata key `{key}` is invalid: {detail}")]
    BadKey { key: String, detail: String },
}

impl GgufError {
    /// A metadata value of the wrong type or range.
    pub fn bad_key(key: &str, detail: impl Into<String>) -> Self {
        GgufError::BadKey {
            key: key.to_string(),
            detail: detail.into(),
        }
    }
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;
