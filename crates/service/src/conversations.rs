//! The conversation service: every rule about conversations, in one place below the web layer.
//!
//! The chat pages, the JSON API and the event stream all call [`Conversations`] with the
//! [`Caller`] the web layer made of the request, and only parse, call and render. Here live:
//! ownership (another owner's conversation answers [`ConversationError::NotFound`], exactly like
//! an id that does not exist, so ids cannot be probed), title and message checks, settings
//! through the one check in [`super::settings`] (with `ignore_eos` for admins only),
//! create-with-first-message, regenerate and edit-and-resend (atomic in the session actor),
//! stop, delete, export and import, and the per-user limits on creating conversations
//! (`limits.conversations_per_minute` per owner and, for guests, per client address;
//! `limits.max_conversations_per_user` stored in total).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::cluster::{Cluster, WireBody};
use super::session::{
    check_message, Accepted, GetInfo, Replacing, SendMessage, SessionError, Sessions, Shutdown,
    Stop, Subscribe, Subscription, STORAGE_UNAVAILABLE,
};
use super::settings::{self, SettingsError, SettingsLimits};
use crate::caller::Caller;
use smolchat_serving::types::SubmitError;
use smolchat_serving::window::SlidingWindow;
mod files;
pub use files::Uploaded;
mod limits;
mod organise;
mod responses;
mod shares;
mod transfer;
use limits::{address_key, CREATION_KEYS, CREATION_WINDOW};
pub use organise::{MAX_FOLDERS, MAX_PRESETS, MAX_TAGS, NAME_MAX_CHARS, TAG_MAX_CHARS};
pub use shares::{NewShare, SharedConversation, SharedMessage};
pub use transfer::{
    to_markdown, ExportParseError, ExportedConversation, ExportedFile, ExportedMessage,
    ExportedOrganisation,
};
use transfer::{IMPORT_KEYS, IMPORT_WINDOW};

use crate::reply::ReplyEvent;
use smolchat_store::{
    Conversation, ConversationSettings, FileRecord, ImportedFile, ImportedMessage, ListFilter,
    ListPage, Message, MessageStatus, Organisation, PageRequest, Role, ShareRecord, Store,
    StoreError, StoredRow, Timings, MAX_TOKEN_COUNT,
};
use smolchat_text::prompt::PromptBuilder;
use smolchat_text::template::{ChatMessage, ChatTemplate, RenderOptions};
use smolchat_text::tokenizer::Tokenizer;

/// Longest conversation title (and search text), in characters.
pub const TITLE_LIMIT: usize = 200;

/// The `format` field of an exported conversation.
pub const EXPORT_FORMAT: &str = "smolchat.conversation";
/// The `version` of the export format this server writes and reads.
pub const EXPORT_VERSION: u32 = 2;

/// The oldest export version import still reads (version 1: one branch, no ids).
pub const EXPORT_VERSION_MIN: u32 = 1;

/// Why the service refused. The web layer maps each variant to one status code.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConversationError {
    /// No such conversation, or not the caller's (indistinguishable on purpose). 404.
    #[error("conversation not found")]
    NotFound,
    /// No such thing of another kind (a user, an action); the message says what. 404.
    #[error("{0}")]
    NoSuch(String),
    /// A field is wrong; the message names it. 400.
    #[error("{message}")]
    Invalid {
        field: Option<&'static str>,
        message: String,
    },
    /// A text over its size limit. 413.
    #[error("{0}")]
    TooLarge(String),
    /// Something only admins may do. 403.
    #[error("{0}")]
    Forbidden(String),
    /// A reply is already being generated. 409.
    #[error("{0}")]
    Busy(String),
    /// The prompt does not fit the context window. 400.
    #[error("{0}")]
    ContextOverflow(String),
    /// The caller is over a per-user limit. 429 with `Retry-After`.
    #[error("{message}")]
    UserLimit { message: String, retry_after_s: u64 },
    /// The server as a whole is full. 503 with `Retry-After`.
    #[error("{message}")]
    Overloaded { message: String, retry_after_s: u64 },
    /// The store cannot be written right now; nothing was saved. 503.
    #[error("{0}")]
    StorageUnavailable(String),
    /// An actor is gone (shutting down). 503.
    #[error("{0}")]
    Unavailable(String),
    /// A fault on our side; the detail is for the log. 500.
    #[error("{0}")]
    Internal(String),
}

type Result<T, E = ConversationError> = std::result::Result<T, E>;

fn invalid(field: &'static str, message: impl Into<String>) -> ConversationError {
    ConversationError::Invalid {
        field: Some(field),
        message: message.into(),
    }
}

impl From<SessionError> for ConversationError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::EmptyMessage | SessionError::NotText(_) => {
                invalid("content", e.to_string())
            }
            SessionError::MessageTooLong { .. } => ConversationError::TooLarge(e.to_string()),
            SessionError::Busy | SessionError::ToolStepNotWaiting { .. } => {
                ConversationError::Busy(e.to_string())
            }
            SessionError::NotFound => ConversationError::NotFound,
            SessionError::NothingToResend => ConversationError::Invalid {
                field: None,
                message: e.to_string(),
            },
            SessionError::NoSuchFile(_) => invalid("files", e.to_string()),
            SessionError::Submit(s) => s.into(),
            SessionError::Store(detail) => {
                ConversationError::Internal(format!("storage: {detail}"))
            }
            SessionError::StoreUnavailable => ConversationError::StorageUnavailable(e.to_string()),
            SessionError::Prompt(_) | SessionError::PromptTask(_) => {
                ConversationError::Internal(e.to_string())
            }
            SessionError::DraftLimit(_) => ConversationError::UserLimit {
                message: e.to_string(),
                retry_after_s: 60,
            },
            SessionError::Model(m) => m.into(),
        }
    }
}

impl From<crate::models::ModelError> for ConversationError {
    fn from(e: crate::models::ModelError) -> Self {
        use crate::models::ModelError;
        match e {
            ModelError::NotFound { .. } => invalid("model", e.to_string()),
            ModelError::NoRoom { .. } | ModelError::Busy { .. } => ConversationError::Overloaded {
                message: e.to_string(),
                retry_after_s: 5,
            },
            ModelError::Load { .. } | ModelError::Pinned { .. } => {
                ConversationError::Unavailable(e.to_string())
            }
        }
    }
}

impl From<SubmitError> for ConversationError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Overloaded { retry_after_s, .. } => ConversationError::Overloaded {
                message: e.to_string(),
                retry_after_s,
            },
            SubmitError::UserLimit { retry_after_s, .. }
            | SubmitError::TokenLimit { retry_after_s, .. }
            | SubmitError::GroupTokenLimit { retry_after_s, .. }
            | SubmitError::Quota { retry_after_s, .. } => ConversationError::UserLimit {
                message: e.to_string(),
                retry_after_s,
            },
            SubmitError::ContextOverflow { .. } | SubmitError::ExceedsKvCache { .. } => {
                ConversationError::ContextOverflow(e.to_string())
            }
            SubmitError::Invalid(_) => ConversationError::Invalid {
                field: None,
                message: e.to_string(),
            },
            SubmitError::Unavailable(_) => ConversationError::Unavailable(e.to_string()),
        }
    }
}

impl From<StoreError> for ConversationError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::ConversationNotFound(_) | StoreError::MessageNotFound(_) => {
                ConversationError::NotFound
            }
            StoreError::InvalidSettings(m) => ConversationError::Invalid {
                field: None,
                message: m,
            },
            other if other.is_unavailable() => {
                tracing::warn!(error = %other, "storage unavailable");
                ConversationError::StorageUnavailable(STORAGE_UNAVAILABLE.to_string())
            }
            other => ConversationError::Internal(format!("storage: {other}")),
        }
    }
}

/// A sign-in layer error met by a service: storage faults stay 503s, the rest are faults.
pub(crate) fn from_auth(e: smolchat_auth::AuthError) -> ConversationError {
    match e {
        smolchat_auth::AuthError::Store(e) => e.into(),
        other => ConversationError::Internal(other.to_string()),
    }
}

impl From<crate::knowledge::KnowledgeError> for ConversationError {
    fn from(e: crate::knowledge::KnowledgeError) -> Self {
        use crate::knowledge::KnowledgeError as K;
        match e {
            K::NotFound(m) => ConversationError::NoSuch(m),
            K::Invalid { field, message } => ConversationError::Invalid {
                field: Some(field),
                message,
            },
            K::TooLarge(m) => ConversationError::TooLarge(m),
            K::Forbidden(m) => ConversationError::Forbidden(m),
            K::Unavailable(m) => ConversationError::Unavailable(m),
            K::Store(e) => e.into(),
            K::Read(e) => e.into(),
            K::File(e) => e.into(),
            K::Internal(m) => ConversationError::Internal(m),
        }
    }
}

impl From<SettingsError> for ConversationError {
    fn from(e: SettingsError) -> Self {
        match e {
            SettingsError::PromptTooLong { .. } => ConversationError::TooLarge(e.to_string()),
            SettingsError::Invalid { field, message } => ConversationError::Invalid {
                field: Some(field),
                message,
            },
            SettingsError::AdminOnly { message, .. } => ConversationError::Forbidden(message),
        }
    }
}

impl From<MailboxError> for ConversationError {
    fn from(e: MailboxError) -> Self {
        ConversationError::Unavailable(format!(
            "the conversation's session is not available ({e}); retry"
        ))
    }
}

/// The service's configuration (from `[limits]` and `[sampling]`).
#[derive(Debug, Clone)]
pub struct ConversationsConfig {
    pub settings_limits: SettingsLimits,
    pub max_message_chars: usize,
    /// New conversations per owner (and per guest address) per minute; 0: no limit.
    pub conversations_per_minute: u32,
    /// Conversations one owner may keep; 0: no limit.
    pub max_conversations_per_user: u64,
    pub max_import_messages: usize,
    /// Text one owner may keep stored, in bytes (imports past it are refused); 0: no limit.
    pub max_stored_bytes_per_user: u64,
    /// Imported text one client address may send per hour, in bytes; 0: no limit.
    pub import_bytes_per_address_per_hour: u64,
    /// Searches per owner (and per guest address) per minute; 0: no limit.
    pub searches_per_minute: u32,
    /// The largest attached file, in bytes.
    pub max_file_bytes: usize,
    pub max_files_per_message: usize,
    /// Attached files one owner may keep, in bytes; 0: no limit.
    pub max_file_bytes_per_user: u64,
    /// What a new conversation starts with (its `pinned_date` is set at creation).
    pub defaults: ConversationSettings,
}

/// A settings change: fields left `None` keep their value. An empty `system_prompt` removes it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettingsPatch {
    pub system_prompt: Option<String>,
    pub thinking: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub max_tokens: Option<usize>,
    pub seed: Option<u64>,
    pub ignore_eos: Option<bool>,
    /// An empty grammar removes it.
    pub grammar: Option<String>,
    /// The model the replies come from: a model's id or alias; empty: the server's default.
    /// Switching mid-conversation is allowed: the next prompt is built with the new model's
    /// template (the old model's cache stays until it is evicted).
    pub model: Option<String>,
    /// The tools the model may call (tool names; empty: none).
    pub tools: Option<Vec<String>>,
    /// `required`, a chosen tool's name, or `auto` / empty (the model decides).
    pub tool_choice: Option<String>,
    /// Knowledge collections each turn searches for passages (ids; empty: none).
    pub knowledge: Option<Vec<Uuid>>,
}

impl SettingsPatch {
    pub fn is_empty(&self) -> bool {
        *self == SettingsPatch::default()
    }

    /// `settings` with this patch applied (not yet checked).
    pub fn apply(&self, mut settings: ConversationSettings) -> ConversationSettings {
        if let Some(p) = &self.system_prompt {
            settings.system_prompt = (!p.trim().is_empty()).then(|| p.clone());
        }
        if let Some(v) = self.thinking {
            settings.thinking = v;
        }
        if let Some(v) = self.temperature {
            settings.temperature = v;
        }
        if let Some(v) = self.top_p {
            settings.top_p = v;
        }
        if let Some(v) = self.top_k {
            settings.top_k = v;
        }
        if let Some(v) = self.max_tokens {
            settings.max_tokens = v;
        }
        if self.seed.is_some() {
            settings.seed = self.seed;
        }
        if let Some(v) = self.ignore_eos {
            settings.ignore_eos = v;
        }
        if let Some(g) = &self.grammar {
            settings.grammar = (!g.trim().is_empty()).then(|| g.clone());
        }
        if let Some(m) = &self.model {
            settings.model = (!m.trim().is_empty()).then(|| m.clone());
        }
        if let Some(t) = &self.tools {
            let mut names: Vec<String> = Vec::with_capacity(t.len());
            for n in t.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
                if !names.iter().any(|m| m == n) {
                    names.push(n.to_string());
                }
            }
            settings.tools = names;
        }
        if let Some(c) = &self.tool_choice {
            let c = c.trim();
            settings.tool_choice = (!c.is_empty() && c != "auto").then(|| c.to_string());
        }
        if let Some(k) = &self.knowledge {
            let mut ids: Vec<Uuid> = Vec::with_capacity(k.len());
            for id in k {
                if !ids.contains(id) {
                    ids.push(*id);
                }
            }
            settings.knowledge = ids;
        }
        settings
    }
}

/// What a new conversation starts with.
#[derive(Debug, Clone, Default)]
pub struct NewConversation {
    pub title: Option<String>,
    pub settings: SettingsPatch,
    /// Sent as the first message once the conversation exists (blank: none).
    pub first_message: Option<String>,
}

/// A created conversation and, when it had a first message, that message's acceptance.
#[derive(Debug, Clone)]
pub struct Created {
    pub conversation: Conversation,
    pub accepted: Option<Accepted>,
}

/// A conversation with its messages and whether a reply is being generated now.
#[derive(Debug, Clone)]
pub struct ConversationView {
    pub conversation: Conversation,
    /// The branch shown, in order.
    pub messages: Vec<Message>,
    /// Per message of `messages`: its versions (it and its siblings).
    pub versions: Vec<Versions>,
    pub replying: bool,
    /// Pinned, archived, its folder and tags.
    pub organisation: Organisation,
    /// Its files: those its messages carry (`message_id`) and those waiting for the next one.
    pub files: Vec<FileRecord>,
    /// The tool calls its replies made, by reply, each in order.
    pub tool_steps: std::collections::HashMap<Uuid, Vec<smolchat_store::ToolStep>>,
    /// The passages its user messages were given (`settings.knowledge`), by message, `[n]` in
    /// order.
    pub sources: std::collections::HashMap<Uuid, Vec<smolchat_store::MessageSource>>,
}

/// Where a message stands among its versions (the messages with its parent: replies
/// regenerated for one user message, or user messages edited from one point), oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Versions {
    /// 1-based.
    pub index: usize,
    pub count: usize,
    pub previous: Option<Uuid>,
    pub next: Option<Uuid>,
}

impl Versions {
    /// For each message of `branch`, its versions among `all` (insertion order).
    pub fn of(all: &[Message], branch: &[Message]) -> Vec<Versions> {
        branch
            .iter()
            .map(|m| {
                let siblings: Vec<Uuid> = all
                    .iter()
                    .filter(|o| o.parent_id == m.parent_id)
                    .map(|o| o.id)
                    .collect();
                let at = siblings.iter().position(|&id| id == m.id).unwrap_or(0);
                Versions {
                    index: at + 1,
                    count: siblings.len().max(1),
                    previous: at.checked_sub(1).and_then(|i| siblings.get(i).copied()),
                    next: siblings.get(at + 1).copied(),
                }
            })
            .collect()
    }
}

thread_local! {
    /// The message limit of the [`ExportedConversation::from_json`] running on this thread, and
    /// whether it was hit (serde's error type cannot carry that).
    static MESSAGE_LIMIT: std::cell::Cell<(usize, bool)> = const { std::cell::Cell::new((usize::MAX, false)) };
}

/// Bytes as MiB with one decimal, for messages.
fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}

/// The conversation service (see the module docs). One per platform; cheap to share.
pub struct Conversations {
    store: Store,
    sessions: Arc<Sessions>,
    /// The models (read-ahead and eviction go to each conversation's).
    models: Arc<crate::models::Models>,
    /// The main model's text side and window: the checks of system prompts and files.
    tokenizer: Arc<Tokenizer>,
    template: Arc<ChatTemplate>,
    context_window: usize,
    cfg: ConversationsConfig,
    /// Creations per owner (and guest address) in the last minute.
    creations: Mutex<SlidingWindow<String>>,
    /// Searches per owner (and guest address) in the last minute.
    searches: Mutex<SlidingWindow<String>>,
    /// Imported bytes per client address in the last hour.
    imports: Mutex<SlidingWindow<String>>,
    audit: crate::audit::Audit,
    /// Reads attached files (a PDF in a child process), so many at once.
    documents: Arc<crate::documents::DocumentReader>,
}

impl Conversations {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        sessions: Arc<Sessions>,
        models: Arc<crate::models::Models>,
        cfg: ConversationsConfig,
        documents: Arc<crate::documents::DocumentReader>,
    ) -> Self {
        Self {
            documents,
            audit: crate::audit::Audit::new(store.clone()),
            store,
            sessions,
            tokenizer: models.main().tokenizer_arc(),
            template: models.main().template_arc(),
            context_window: models.main().info().context_window,
            models,
            cfg,
            creations: Mutex::new(SlidingWindow::new(
                CREATION_WINDOW,
                Duration::ZERO,
                CREATION_KEYS,
            )),
            searches: Mutex::new(SlidingWindow::new(
                CREATION_WINDOW,
                Duration::ZERO,
                CREATION_KEYS,
            )),
            imports: Mutex::new(SlidingWindow::new(
                IMPORT_WINDOW,
                Duration::ZERO,
                IMPORT_KEYS,
            )),
        }
    }

    pub fn config(&self) -> &ConversationsConfig {
        &self.cfg
    }

    /// The settings a new conversation gets (today's date pinned).
    pub fn default_settings(&self) -> ConversationSettings {
        ConversationSettings {
            pinned_date: chrono::Local::now().date_naive(),
            ..self.cfg.defaults.clone()
        }
    }

    /// The conversation if it exists and belongs to the caller; otherwise `NotFound` either
    /// way.
    pub async fn owned(&self, caller: &Caller, id: Uuid) -> Result<Conversation> {
        match self.store.get_conversation(id).await? {
            Some(c) if c.owner == caller.owner => Ok(c),
            _ => Err(ConversationError::NotFound),
        }
    }

    /// How many conversations the caller owns (sign-up tells a guest theirs will move).
    pub async fn count(&self, caller: &Caller) -> Result<i64> {
        Ok(self.store.count_conversations(&caller.owner).await?)
    }

    /// Whether a reply is being generated in the conversation right now.
    pub async fn replying(&self, id: Uuid) -> bool {
        let here = match self.sessions.get(id) {
            Some(session) => session.send(GetInfo).await.is_ok_and(|i| i.replying),
            None => false,
        };
        // Another replica may be generating it.
        here || (self.cluster().is_shared()
            && self
                .store
                .streaming_replica(id)
                .await
                .is_ok_and(|r| r.is_some()))
    }

    fn cluster(&self) -> &Cluster {
        &self.sessions.shared().cluster
    }

    fn clean_title(title: &str) -> Result<String> {
        let title = title.trim();
        let chars = title.chars().count();
        if chars > TITLE_LIMIT {
            return Err(invalid(
                "title",
                format!("the title has {chars} characters; the limit is {TITLE_LIMIT}"),
            ));
        }
        if let Some(what) = crate::validation::not_text(title) {
            return Err(invalid(
                "title",
                format!("the title contains {what}, which is not text; remove it"),
            ));
        }
        Ok(title.to_string())
    }

    /// Settings checked for `caller`: the one check, then whether the system prompt leaves room
    /// in the context window.
    fn check_settings(&self, caller: &Caller, s: &ConversationSettings) -> Result<()> {
        settings::check(s, self.cfg.settings_limits, caller.admin)?;
        self.check_system_prompt_fits(s)
    }

    /// The collections a patch gives a conversation: each one the caller may search. Only when
    /// the patch touches them (a collection unshared since stays chosen, and is no longer
    /// searched).
    async fn check_knowledge(&self, caller: &Caller, patch: &SettingsPatch) -> Result<()> {
        match &patch.knowledge {
            None => Ok(()),
            Some(ids) => self
                .sessions
                .shared()
                .knowledge
                .check_chosen(caller, ids)
                .await
                .map_err(ConversationError::from),
        }
    }

    /// The tools a patch chooses: tools that are on, and a `tool_choice` among them. Only when
    /// the patch touches them: a conversation keeps a tool an admin turned off since (it is
    /// simply no longer offered) without every other change being refused.
    fn check_tools(&self, patch: &SettingsPatch, s: &ConversationSettings) -> Result<()> {
        if patch.tools.is_none() && patch.tool_choice.is_none() {
            return Ok(());
        }
        let field = if patch.tools.is_some() {
            "tools"
        } else {
            "tool_choice"
        };
        self.sessions
            .shared()
            .tools
            .check_choice(&s.tools, s.tool_choice.as_deref())
            .map_err(|m| invalid(field, m))
    }

    /// The tools the caller's conversations may offer now: `(name, description)` of each.
    pub fn tools(&self, caller: &Caller) -> Vec<(String, String)> {
        self.sessions
            .shared()
            .tools
            .specs_for(caller.admin)
            .into_iter()
            .map(|t| (t.name, t.description))
            .collect()
    }

    /// The MCP servers and where each stands (the admin page, `/ops/tools`).
    pub fn tool_servers(&self) -> Vec<crate::mcp::McpStatus> {
        self.sessions
            .shared()
            .tools
            .mcp()
            .servers()
            .iter()
            .map(|s| s.status())
            .collect()
    }

    /// Runs tool `name` once as the admin would (the admin's "try it", `POST /ops/tools/call`),
    /// under the rules of every call; audited.
    pub async fn try_tool(
        &self,
        caller: &Caller,
        name: &str,
        arguments: &serde_json::Value,
    ) -> crate::tools::ToolResult {
        self.run_tool(caller, true, "admin", name, arguments).await
    }

    /// Runs tool `name` for `caller` (as an admin with `admin`) under the rules of every call,
    /// and records it in the audit log (`tool.call` on `target`).
    async fn run_tool(
        &self,
        caller: &Caller,
        admin: bool,
        target: &str,
        name: &str,
        arguments: &serde_json::Value,
    ) -> crate::tools::ToolResult {
        let ctx = crate::tools::ToolContext {
            store: &self.store,
            owner: &caller.owner,
            admin,
        };
        let result = self
            .sessions
            .shared()
            .tools
            .call(&ctx, name, arguments)
            .await;
        self.audit
            .record_by(
                caller,
                "tool.call",
                target,
                &format!(
                    "{name}: {} in {} ms",
                    if result.error { "error" } else { "done" },
                    result.duration.as_millis()
                ),
            )
            .await;
        result
    }

    /// The tools a `/v1` caller asked the server to run for it (`server_tools`): the rules are
    /// [`crate::tools::Tools::for_api`]'s, for the account of the caller's key (`None`: a caller
    /// without one, refused).
    pub fn api_tools(
        &self,
        caller: Option<&Caller>,
        names: &[String],
    ) -> Result<Vec<crate::tools::ToolSpec>> {
        use crate::tools::ApiToolsRefused;
        let tools = &self.sessions.shared().tools;
        let refused = |e: ApiToolsRefused| match e {
            ApiToolsRefused::Off | ApiToolsRefused::NoAccount => {
                ConversationError::Forbidden(e.to_string())
            }
            other => invalid("server_tools", other.to_string()),
        };
        // Off says so before anything else: whoever asks learns how to turn it on.
        let admin = match caller {
            Some(c) => c.admin,
            None if tools.api_specs(true).is_empty() => {
                return Err(refused(ApiToolsRefused::Off));
            }
            None => return Err(refused(ApiToolsRefused::NoAccount)),
        };
        tools.for_api(names, admin).map_err(refused)
    }

    /// The most rounds of tool calls one reply may make (`tools.max_rounds`), in the chat and
    /// through the API.
    pub fn max_tool_rounds(&self) -> usize {
        self.sessions.shared().tools.max_rounds()
    }

    /// The tools a `/v1` caller may ask for (`GET /v1/server_tools`); none without an account.
    pub fn api_tool_specs(&self, caller: Option<&Caller>) -> Vec<crate::tools::ToolSpec> {
        caller.map_or_else(Vec::new, |c| {
            self.sessions.shared().tools.api_specs(c.admin)
        })
    }

    /// Runs a call a `/v1` reply made of a tool the caller asked for, under the rules of every
    /// call; audited as the caller's (`tool.call` on `api`).
    pub async fn call_api_tool(
        &self,
        caller: &Caller,
        name: &str,
        arguments: &serde_json::Value,
    ) -> crate::tools::ToolResult {
        self.run_tool(caller, caller.admin, "api", name, arguments)
            .await
    }

    /// Allows or denies tool call `step` of reply `message`, which waits for the caller's
    /// decision; the reply goes on (a denial is read by the model as a refusal).
    pub async fn decide_tool(
        &self,
        caller: &Caller,
        id: Uuid,
        message: Uuid,
        step: i64,
        allow: bool,
    ) -> Result<()> {
        let c = self.owned(caller, id).await?;
        let Some(session) = self.sessions.get(c.id) else {
            return Err(SessionError::ToolStepNotWaiting { step }.into());
        };
        session
            .send(crate::session::DecideTool {
                message,
                step,
                allow,
            })
            .await??;
        let action = if allow { "tool.allow" } else { "tool.deny" };
        self.audit
            .record_by(
                caller,
                action,
                &format!("conversation:{}", c.id),
                &format!("reply {message}, call {step}"),
            )
            .await;
        Ok(())
    }

    /// `patch` with its model named by the model's id (an alias or file name becomes the id),
    /// or refused naming the models there are.
    fn with_model_id(&self, patch: &SettingsPatch) -> Result<SettingsPatch> {
        let mut patch = patch.clone();
        if let Some(name) = patch
            .model
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
        {
            patch.model = Some(self.models.find_named(name)?);
        }
        Ok(patch)
    }

    /// The models a conversation may use (for pickers): every configured model's state.
    pub fn models(&self) -> Vec<crate::models::ModelStatus> {
        self.models.list()
    }

    /// The model the caller's new conversations start on: the account's choice while the
    /// server still serves it, else the server's default.
    pub async fn default_model_for(&self, caller: &Caller) -> String {
        if !caller.guest {
            match self.store.default_model(&caller.owner).await {
                Ok(Some(m)) if self.models.list().iter().any(|s| s.id == m) => return m,
                Ok(_) => {}
                Err(e) => tracing::warn!("cannot read an account's default model: {e}"),
            }
        }
        self.models.default_id()
    }

    /// Sets the model the caller's new conversations start on (an id or alias; empty: the
    /// server's default). Accounts only: a guest has nowhere to keep it.
    pub async fn set_default_model(&self, caller: &Caller, model: &str) -> Result<String> {
        if caller.guest {
            return Err(ConversationError::Forbidden(
                "sign in to keep a default model: a guest's choice has nowhere to be kept".into(),
            ));
        }
        let patch = self.with_model_id(&SettingsPatch {
            model: Some(model.to_string()),
            ..SettingsPatch::default()
        })?;
        let chosen = patch.model.filter(|m| !m.trim().is_empty());
        self.store
            .set_default_model(&caller.owner, chosen.as_deref())
            .await?;
        Ok(chosen.unwrap_or_else(|| self.models.default_id()))
    }

    /// The questions the task model suggested after `reply` (none when it did not, or they
    /// cannot be read: they are a help, never a failure).
    pub async fn follow_ups(&self, reply: Uuid) -> Vec<String> {
        self.store.follow_ups(reply).await.unwrap_or_else(|e| {
            tracing::warn!("cannot read a reply's follow-ups: {e}");
            Vec::new()
        })
    }

    /// Whether model `id` can think (its template has a thinking switch).
    pub fn can_think(&self, id: &str) -> bool {
        self.models.can_think(id)
    }

    /// The id of the model a conversation with these settings runs on.
    pub fn model_of(&self, settings: &ConversationSettings) -> String {
        settings
            .model
            .clone()
            .filter(|m| self.models.list().iter().any(|s| s.id == *m))
            .unwrap_or_else(|| self.models.default_id())
    }

    /// Refuses settings whose system prompt leaves no room in the context window for a message
    /// and a reply: every message of such a conversation would fail, so say so when it is set.
    fn check_system_prompt_fits(&self, settings: &ConversationSettings) -> Result<()> {
        let Some(system) = settings.system_prompt.as_deref() else {
            return Ok(());
        };
        let messages = [ChatMessage::system(system), ChatMessage::user("")];
        let mut opts = RenderOptions::new(settings.pinned_date);
        opts.enable_thinking = Some(settings.thinking);
        let tokens = PromptBuilder::new(&self.template, &self.tokenizer)
            .build(&messages, &opts)
            .map_err(|e| {
                invalid(
                    "system_prompt",
                    format!(
                        "`system_prompt`: the chat template cannot use this system prompt: {e}"
                    ),
                )
            })?
            .tokens
            .len();
        let window = self.context_window;
        // At least one token of message and one of reply must fit after it.
        if tokens + 2 > window {
            return Err(invalid(
                "system_prompt",
                format!(
                    "`system_prompt`: the system prompt takes {tokens} tokens of the model's \
                     {window}-token context window, which leaves no room for a message and a \
                     reply; shorten it"
                ),
            ));
        }
        Ok(())
    }

    /// Creates a conversation (title, settings) and sends its first message when it has one.
    /// Everything is checked before anything is stored; a first message that is refused
    /// removes the conversation again, so a refusal leaves nothing behind.
    pub async fn create(&self, caller: &Caller, new: NewConversation) -> Result<Created> {
        let patch = self.with_model_id(&new.settings)?;
        let mut settings = patch.apply(self.default_settings());
        // A conversation keeps the model it started on (the caller's default, else the
        // server's), whatever the default becomes.
        if settings.model.is_none() {
            settings.model = Some(self.default_model_for(caller).await);
        }
        // The model's own default sampling, where the caller chose none.
        let (temperature, top_p, top_k) = self
            .models
            .sampling_defaults(settings.model.as_deref().unwrap_or(""));
        if patch.temperature.is_none() {
            settings.temperature = temperature;
        }
        if patch.top_p.is_none() {
            settings.top_p = top_p;
        }
        if patch.top_k.is_none() {
            settings.top_k = top_k;
        }
        self.check_settings(caller, &settings)?;
        self.check_tools(&patch, &settings)?;
        self.check_knowledge(caller, &patch).await?;
        let title = new.title.as_deref().map(Self::clean_title).transpose()?;
        let first = new.first_message.filter(|m| !m.trim().is_empty());
        if let Some(m) = &first {
            check_message(m, self.cfg.max_message_chars)?;
        }
        self.admit_new_conversation(caller).await?;
        // An id this replica owns, so the first turns warm the cache where the later ones go.
        let id = self.cluster().new_conversation_id();
        let mut conversation = self
            .store
            .create_conversation_with_id(id, &caller.owner, &settings)
            .await?;
        if let Some(title) = title.filter(|t| !t.is_empty()) {
            self.store
                .rename_conversation(conversation.id, &title)
                .await?;
            conversation.title = title;
        }
        tracing::info!(conversation = %conversation.id, owner = %caller.owner, "conversation created");
        let accepted = match first {
            None => None,
            Some(content) => match self
                .send_to(caller, conversation.id, SendMessage::new(content))
                .await
            {
                Ok(a) => Some(a),
                Err(e) => {
                    // The conversation would stay empty; remove it so the list does not fill.
                    if let Err(d) = self.remove(conversation.id).await {
                        tracing::warn!(conversation = %conversation.id, "cannot remove a conversation whose first message was refused: {d}");
                    }
                    return Err(e);
                }
            },
        };
        if accepted.is_some() {
            // The first message named it.
            if let Some(c) = self.store.get_conversation(conversation.id).await? {
                conversation = c;
            }
        }
        Ok(Created {
            conversation,
            accepted,
        })
    }

    /// The conversation with its messages.
    pub async fn get(&self, caller: &Caller, id: Uuid) -> Result<ConversationView> {
        let conversation = self.owned(caller, id).await?;
        // Opened: its next message is likely; a cache in the spill tier is read ahead.
        self.models
            .prefetch(id, conversation.settings.model.as_deref());
        let (all, messages) = self.store.messages_and_branch(id).await?;
        let versions = Versions::of(&all, &messages);
        let replying = self.replying(id).await;
        let organisation = self.store.organisation(id).await?.unwrap_or_default();
        let files = self.store.files_of(id).await?;
        let tool_steps = self.store.tool_steps_of(id).await?;
        let sources = self.store.sources_of(id).await?;
        Ok(ConversationView {
            conversation,
            messages,
            versions,
            replying,
            organisation,
            files,
            tool_steps,
            sources,
        })
    }

    /// Shows the branch through `message` (a version chosen with ‹ ›): from it down its newest
    /// replies. Refused while a reply is being generated (it continues the branch shown).
    pub async fn select(&self, caller: &Caller, id: Uuid, message: Uuid) -> Result<()> {
        let c = self.owned(caller, id).await?;
        if self.replying(c.id).await {
            return Err(ConversationError::Busy(
                "a reply is being generated; stop it or wait before switching versions".into(),
            ));
        }
        match self.store.select_branch(c.id, message).await {
            Ok(_) => Ok(()),
            Err(smolchat_store::StoreError::MessageNotFound(_)) => Err(ConversationError::NoSuch(
                format!("message {message} is not in this conversation"),
            )),
            Err(e) => Err(e.into()),
        }
    }

    /// One message of the caller's conversation, and whether a reply is running.
    pub async fn message(
        &self,
        caller: &Caller,
        id: Uuid,
        mid: Uuid,
    ) -> Result<(
        Message,
        bool,
        Vec<smolchat_store::ToolStep>,
        Vec<smolchat_store::MessageSource>,
    )> {
        let c = self.owned(caller, id).await?;
        let m = self
            .store
            .get_message(mid)
            .await?
            .filter(|m| m.conversation_id == c.id)
            .ok_or(ConversationError::NotFound)?;
        let steps = match m.role {
            Role::Assistant => self.store.tool_steps_of_reply(m.id).await?,
            _ => Vec::new(),
        };
        // A reply shows the passages its user message was given.
        let sources = match (m.role, m.parent_id) {
            (Role::Assistant, Some(parent)) => self
                .store
                .sources_of(c.id)
                .await?
                .remove(&parent)
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        Ok((m, self.replying(c.id).await, steps, sources))
    }

    /// One page of the caller's conversations, most recent first, filtered by `filter` (its
    /// search text, archive, pin, folder and tag).
    pub async fn list(
        &self,
        caller: &Caller,
        filter: &ListFilter,
        page: &PageRequest,
    ) -> Result<ListPage> {
        let search = filter.search.as_deref();
        if let Some(chars) = search.map(|q| q.chars().count()) {
            if chars > TITLE_LIMIT {
                return Err(invalid(
                    "q",
                    format!(
                        "`q`: the search text has {chars} characters; the limit is {TITLE_LIMIT}"
                    ),
                ));
            }
        }
        let searching = search.is_some_and(|q| !q.trim().is_empty());
        let per_minute = self.cfg.searches_per_minute;
        if searching && per_minute > 0 {
            let keys = self.limit_keys(caller);
            let mut limiter = self.searches.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(wait) = limiter.take(&keys, 1, u64::from(per_minute), Instant::now()) {
                return Err(ConversationError::UserLimit {
                    message: format!(
                        "{} searched {per_minute} times in the last minute, the limit; retry in \
                         {wait} s",
                        Self::who(caller)
                    ),
                    retry_after_s: wait,
                });
            }
        }
        Ok(self
            .store
            .list_conversations_page(&caller.owner, filter, page)
            .await?)
    }

    async fn send_to(&self, caller: &Caller, id: Uuid, mut msg: SendMessage) -> Result<Accepted> {
        // A guest's replies also count against their address's token quota
        // (`limits.tokens_per_minute_per_guest_address`): guest owners cost nothing to mint.
        msg.group = match (caller.guest, caller.address) {
            (true, Some(ip)) => Some(address_key(ip)),
            _ => None,
        };
        let session = self.sessions.get_or_start(id);
        Ok(session.send(msg).await??)
    }

    /// Sends a message; resolves once it is stored and the reply is queued.
    pub async fn send(&self, caller: &Caller, id: Uuid, content: String) -> Result<Accepted> {
        self.send_with_files(caller, id, content, Vec::new()).await
    }

    /// Generates the last reply again: the last user message is sent again and replaces itself
    /// and everything after it, atomically (a refusal changes nothing).
    /// A new reply to a user message of the branch shown (`message`, or the last one), beside
    /// the replies it has: they are kept as versions.
    pub async fn regenerate(
        &self,
        caller: &Caller,
        id: Uuid,
        message: Option<Uuid>,
    ) -> Result<Accepted> {
        let c = self.owned(caller, id).await?;
        tracing::info!(conversation = %c.id, "regenerating a reply: a new version");
        self.send_to(
            caller,
            c.id,
            SendMessage {
                content: None,
                replacing: message.map_or(Replacing::LastUserMessage, Replacing::Message),
                files: Vec::new(),
                group: None,
            },
        )
        .await
    }

    /// Replaces the last user message (and everything after it) with `content` and sends it,
    /// atomically (a refusal changes nothing).
    /// Sends `content` as a new version of a user message of the branch shown (`message`, or
    /// the last one): a new branch from the same point; the old one is kept.
    pub async fn edit(
        &self,
        caller: &Caller,
        id: Uuid,
        content: String,
        message: Option<Uuid>,
    ) -> Result<Accepted> {
        let c = self.owned(caller, id).await?;
        tracing::info!(conversation = %c.id, "editing a message: a new branch");
        self.send_to(
            caller,
            c.id,
            SendMessage {
                content: Some(content),
                replacing: message.map_or(Replacing::LastUserMessage, Replacing::Message),
                files: Vec::new(),
                group: None,
            },
        )
        .await
    }

    /// Stops the running reply (stored as `stopped`). Whether one was running.
    pub async fn stop(&self, caller: &Caller, id: Uuid) -> Result<bool> {
        let c = self.owned(caller, id).await?;
        self.stop_any(c.id).await
    }

    /// Stops a conversation's reply whoever owns it (the admin page).
    pub async fn stop_any(&self, id: Uuid) -> Result<bool> {
        if let Some(session) = self.sessions.get(id) {
            if session.send(Stop).await? {
                return Ok(true);
            }
        }
        // Generated on another replica: ask it over the bus.
        let cluster = self.cluster();
        if cluster.is_shared() {
            if let Some((_, Some(replica))) = self.store.streaming_replica(id).await? {
                if replica != cluster.me().id {
                    cluster.publish(id, WireBody::Stop);
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Deletes the caller's conversation: its session (and reply) stops, its KV cache goes.
    pub async fn delete(&self, caller: &Caller, id: Uuid) -> Result<()> {
        let c = self.owned(caller, id).await?;
        self.remove(c.id).await?;
        self.audit
            .record_by(
                caller,
                "conversation.delete",
                &format!("conversation:{id}"),
                "",
            )
            .await;
        Ok(())
    }

    /// Deletes a conversation whoever owns it (the admin page).
    pub async fn delete_any(&self, id: Uuid) -> Result<()> {
        self.remove(id).await
    }

    async fn remove(&self, id: Uuid) -> Result<()> {
        if let Some(session) = self.sessions.get(id) {
            // It may already be stopping; then there is nothing to shut down.
            let _ = session.send(Shutdown).await;
        }
        if !self.store.delete_conversation(id).await? {
            return Err(ConversationError::NotFound);
        }
        // Another replica may be generating in it, or have viewers on it.
        let cluster = self.cluster();
        cluster.publish(id, WireBody::Deleted);
        // The worker drops the cache now, or as soon as a cancelled reply releases it.
        self.models.evict(id, false).await;
        tracing::info!(conversation = %id, "conversation deleted");
        Ok(())
    }

    /// Renames the caller's conversation (trimmed; blank: no title).
    pub async fn rename(&self, caller: &Caller, id: Uuid, title: &str) -> Result<Conversation> {
        self.update(caller, id, Some(title), &SettingsPatch::default())
            .await
    }

    /// Changes the title and/or settings (used from the next message on). Everything is checked
    /// before anything is written.
    pub async fn update(
        &self,
        caller: &Caller,
        id: Uuid,
        title: Option<&str>,
        patch: &SettingsPatch,
    ) -> Result<Conversation> {
        let c = self.owned(caller, id).await?;
        let title = title.map(Self::clean_title).transpose()?;
        let patch = self.with_model_id(patch)?;
        let settings = if patch.is_empty() {
            None
        } else {
            let s = patch.apply(c.settings.clone());
            self.check_settings(caller, &s)?;
            self.check_tools(&patch, &s)?;
            self.check_knowledge(caller, &patch).await?;
            Some(s)
        };
        let found = match &title {
            Some(t) => self.store.rename_conversation(c.id, t).await?,
            None => true,
        } && match &settings {
            Some(s) => self.store.update_settings(c.id, s).await?,
            None => true,
        };
        if !found {
            return Err(ConversationError::NotFound);
        }
        self.store
            .get_conversation(c.id)
            .await?
            .ok_or(ConversationError::NotFound)
    }

    /// Joins the caller's conversation's live events. With `after` (a message the caller
    /// posted, or the reply the post answered with: the ids of the 202), a subscriber that
    /// comes once that reply has ended learns how it ended at once: its `done` (or `error`)
    /// is replayed from the stored row, since no live event for it will come any more.
    pub async fn subscribe(
        &self,
        caller: &Caller,
        id: Uuid,
        after: Option<Uuid>,
    ) -> Result<Subscription> {
        let c = self.owned(caller, id).await?;
        // A bad `after` is refused before anything is joined.
        let asked = match after {
            None => None,
            Some(after) => match self.store.get_message(after).await? {
                Some(m) if m.conversation_id == c.id => Some(m),
                _ => {
                    return Err(invalid(
                        "after",
                        format!(
                            "`after`: no message {after} in this conversation (give the id of \
                             the message you posted, or of its reply)"
                        ),
                    ))
                }
            },
        };
        let session = self.sessions.get_or_start(c.id);
        let mut subscription = session.send(Subscribe).await?;
        // A reply in progress here is replayed from the session's buffer, and its end comes
        // live. Only when nothing is in progress can the reply asked about have ended.
        if let (Some(asked), true) = (asked, subscription.replay.is_empty()) {
            subscription
                .replay
                .extend(self.outcome_of_reply(asked).await?);
        }
        Ok(subscription)
    }

    /// How the reply that is (or answers) message `asked` ended, as the event that said so;
    /// `None` while it is still being written (or not yet begun).
    async fn outcome_of_reply(&self, asked: Message) -> Result<Option<ReplyEvent>> {
        let reply = if asked.role == Role::Assistant {
            Some(asked)
        } else {
            // The newest reply to it (a regenerated reply is a newer sibling).
            self.store
                .messages(asked.conversation_id)
                .await?
                .into_iter()
                .rev()
                .find(|m| m.parent_id == Some(asked.id) && m.role == Role::Assistant)
        };
        let Some(reply) = reply else {
            return Ok(None);
        };
        Ok(match reply.status {
            MessageStatus::Streaming => None,
            MessageStatus::Interrupted => Some(ReplyEvent::Error {
                message: "this reply was interrupted (the server stopped while writing it); \
                          what it wrote is kept: send or regenerate"
                    .to_string(),
            }),
            _ => Some(ReplyEvent::Done {
                summary: crate::session::summary_of_stored(&reply),
                message: reply,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_addresses_share_their_64() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(address_key(a), address_key(b));
        assert_ne!(address_key(a), address_key(c));
        // An IPv4-mapped address is its IPv4 address, as the sign-in throttle counts it.
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        let v4: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!(address_key(mapped), address_key(v4));
        assert_eq!(address_key(v4), "addr:192.0.2.1");
    }

    #[test]
    fn patches_keep_what_they_leave_out() {
        let base = ConversationSettings {
            system_prompt: Some("be brief".into()),
            ..ConversationSettings::default()
        };
        let p = SettingsPatch {
            temperature: Some(0.0),
            ..SettingsPatch::default()
        };
        let s = p.apply(base.clone());
        assert_eq!(s.temperature, 0.0);
        assert_eq!(s.system_prompt, base.system_prompt);
        let s = SettingsPatch {
            system_prompt: Some("  ".into()),
            ..SettingsPatch::default()
        }
        .apply(base);
        assert_eq!(s.system_prompt, None);
        assert!(SettingsPatch::default().is_empty());
    }

    #[test]
    fn markdown_has_headings_and_folded_reasoning() {
        let doc = ExportedConversation {
            format: EXPORT_FORMAT.into(),
            version: EXPORT_VERSION,
            title: "Colours".into(),
            settings: ConversationSettings {
                system_prompt: Some("Be brief.".into()),
                ..ConversationSettings::default()
            },
            created_at: None,
            updated_at: None,
            current: Some("a".into()),
            organisation: None,
            messages: vec![
                ExportedMessage {
                    tool_calls: Vec::new(),
                    id: Some("u".into()),
                    parent: None,
                    role: Role::User,
                    content: "Name a colour.".into(),
                    reasoning: None,
                    raw: None,
                    status: MessageStatus::Complete,
                    error: None,
                    prompt_tokens: None,
                    completion_tokens: None,
                    cached_tokens: None,
                    timings: None,
                    created_at: "2025-07-08T10:00:00Z".into(),
                    files: Vec::new(),
                },
                ExportedMessage {
                    tool_calls: Vec::new(),
                    id: Some("other".into()),
                    parent: Some("u".into()),
                    role: Role::Assistant,
                    content: "Red, an older version.".into(),
                    reasoning: None,
                    raw: None,
                    status: MessageStatus::Complete,
                    error: None,
                    prompt_tokens: None,
                    completion_tokens: None,
                    cached_tokens: None,
                    timings: None,
                    created_at: "2025-07-08T10:00:01Z".into(),
                    files: Vec::new(),
                },
                ExportedMessage {
                    tool_calls: Vec::new(),
                    id: Some("a".into()),
                    parent: Some("u".into()),
                    role: Role::Assistant,
                    content: "Blue.".into(),
                    reasoning: Some("Pick one.".into()),
                    raw: Some("<think>Pick one.</think>Blue.".into()),
                    status: MessageStatus::Stopped,
                    error: None,
                    prompt_tokens: Some(10),
                    completion_tokens: Some(5),
                    cached_tokens: Some(0),
                    timings: None,
                    created_at: "2025-07-08T10:00:01Z".into(),
                    files: Vec::new(),
                },
            ],
        };
        let md = to_markdown(&doc);
        assert!(md.starts_with("# Colours\n"), "{md}");
        assert!(md.contains("> Be brief."), "{md}");
        let user = md.find("## User\n\nName a colour.").expect("user section");
        let assistant = md.find("## Assistant").expect("assistant section");
        assert!(user < assistant);
        assert!(
            md.contains("<details>\n<summary>Reasoning</summary>\n\nPick one.\n\n</details>"),
            "{md}"
        );
        assert!(md.contains("Blue.\n\n*(stopped)*"), "{md}");
        assert!(!md.contains("Red"), "only the branch shown: {md}");
        // The JSON form reads back as it was written.
        let json = serde_json::to_string(&doc).unwrap();
        assert_eq!(
            serde_json::from_str::<ExportedConversation>(&json).unwrap(),
            doc
        );
    }
}
