//! Serving: what turns one model into a shared service. The batcher (the scheduler's state
//! machine: fair admission by user, token budgets, KV-aware planning), the scheduler actor that
//! feeds it, the model worker thread that owns the engine and every KV cache, and the one model
//! loader. Requests and events are plain Rust types; nothing here knows SQL or HTTP.

pub mod batcher;
pub mod load;
pub mod model;
pub mod scheduler;
pub mod speculate;
pub mod spill;
pub mod types;
pub mod warm;
pub mod window;

pub use load::{LoadError, LoadOptions, LoadedModel};
pub use scheduler::{SchedulerActor, SchedulerConfig};
pub use speculate::SpecConfig;
pub use types::*;
