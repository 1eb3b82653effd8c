//! The inference engine: the model on a backend (the CPU one today, in [`cpu`]), the paged KV
//! cache's block allocator, and the multi-sequence step API ([`Engine`]). It knows nothing of
//! tokens as text, actors, SQL or HTTP; with `smolchat-gguf` it is the only code that knows candle.

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
pub mod backend;
pub mod config;
pub mod cpu;
pub mod device;
pub mod fast;
pub mod kv;
pub mod load;
pub mod logits;
pub mod npy;
pub mod reference;
pub mod rope;
pub mod seed;
pub mod selfcheck;
pub mod step;
pub mod synthetic;
#[cfg(test)]
pub(crate) mod test_log;
pub mod weights;

pub use backend::{Backend, StepLimits};
pub use config::{Architecture, ModelConfig};
pub use cpu::model::Model;
pub use cpu::CpuBackend;
pub use kv::{KvOptions, KvType};
pub use load::{CpuOptions, EngineOptions, Yarn};
pub use logits::{DeviceSampling, Logits, LogitsMode, SampleRow, NO_TOKEN};
pub use step::{Engine, EngineStats, KvSnapshot, SeqId, SeqStep};
