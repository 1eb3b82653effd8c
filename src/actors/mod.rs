//! The actor system: a session actor per conversation, the scheduler actor that batches every
//! session's work, and the model worker thread that owns the engine and the KV caches.
//! Messages are plain Rust types; nothing here knows HTTP.

pub mod batcher;
pub mod cluster;
pub mod completions;
pub mod conversations;
pub mod model;
pub mod scheduler;
pub mod session;
pub mod settings;
pub mod text;
pub mod types;

pub use conversations::{ConversationError, Conversations};
pub use scheduler::{SchedulerActor, SchedulerConfig};
pub use session::{SessionActor, SessionConfig, SessionShared, Sessions};
pub use types::*;
