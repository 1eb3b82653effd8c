//! The inference engine: GGUF loading, the model, KV caches, tokenizer, chat template and sampling.
//! Only this module knows candle; it knows nothing of actors or HTTP.

/// Serde through `Display` and `FromStr`: a configuration value is parsed by its type's one
/// parser, and a bad value becomes a load-time error naming the key.
macro_rules! serde_via_str {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<Self, D::Error> {
                let s = <String as serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use serde_via_str;

pub mod error;

pub use error::{EngineError, Result};
pub(crate) mod aligned;
pub mod attention;
pub mod backend;
pub mod config;
pub mod device;
pub mod gguf;
pub mod kv;
pub mod load;
pub mod model;
pub mod quant;
pub mod step;

pub use backend::{Backend, CpuBackend};
pub use config::{Architecture, ModelConfig};
pub use kv::{KvOptions, KvType};
pub use load::{CpuOptions, LoadOptions, LoadedModel, Yarn};
pub use model::{LogitsMode, Model};
pub use step::{Engine, EngineStats, SeqId, SeqStep};
pub mod generation;
pub mod guard;
pub mod npy;
pub mod prompt;
pub mod sampling;
pub mod splitter;
pub mod synthetic;
pub mod template;
#[cfg(test)]
pub(crate) mod test_log;
pub mod tokenizer;
