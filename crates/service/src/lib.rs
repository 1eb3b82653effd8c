//! The services every interface calls: conversations (ownership, limits, checks, the session
//! actor per conversation), completions (every prompt any interface runs), the cluster of
//! replicas, the one settings check, the typed configuration, and the [`platform::Platform`] that
//! wires them. Every rule is written once, here; nothing here knows HTTP.

pub mod admin;
pub mod audit;
pub mod caller;
pub mod chores;
pub mod cluster;
pub mod completions;
pub mod config;
pub mod conversations;
pub mod documents;
pub mod files;
pub mod knowledge;
pub mod models;
pub mod platform;
pub mod quotas;
pub mod records;
pub mod reply;
pub mod secrets;
pub mod session;
pub mod settings;
pub mod tools;
pub mod validation;

pub use caller::Caller;
pub use conversations::{ConversationError, Conversations};
pub use session::{SessionActor, SessionConfig, SessionShared, Sessions};

/// MCP servers' tools ([`smolchat_mcp`]), as the tools and the admin page name them.
pub use smolchat_mcp as mcp;
