//! The inference engine: GGUF loading, the model, KV caches, tokenizer, chat template and sampling.
//! Only this module knows candle; it knows nothing of actors or HTTP.

pub mod error;

pub use error::{EngineError, Result};
pub(crate) mod aligned;
pub(crate) mod attention;
pub mod config;
pub mod device;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod quant;
pub mod step;

pub use config::{Architecture, ModelConfig};
pub use kv::{KvOptions, KvType};
pub use model::{LogitsMode, Model};
pub use step::{Engine, EngineStats, SeqId, SeqStep};
pub mod generation;
pub mod guard;
pub mod npy;
pub mod sampling;
pub mod splitter;
pub mod synthetic;
pub mod template;
#[cfg(test)]
pub(crate) mod test_log;
pub mod tokenizer;
