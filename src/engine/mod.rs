//! The inference engine: GGUF loading, the model, KV caches, tokenizer, chat template and sampling.
//! Only this module knows candle; it knows nothing of actors or HTTP.

pub mod error;

pub use error::{EngineError, Result};
pub mod gguf;
pub mod quant;
