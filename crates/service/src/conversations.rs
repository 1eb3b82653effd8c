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
use smolchat_serving::scheduler::{Evict, SchedulerActor};
use smolchat_serving::types::SubmitError;
use smolchat_serving::window::SlidingWindow;
mod files;
mod organise;
pub use organise::{MAX_FOLDERS, MAX_PRESETS, MAX_TAGS, NAME_MAX_CHARS, TAG_MAX_CHARS};

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

/// The window `conversations_per_minute` counts over.
const CREATION_WINDOW: Duration = Duration::from_secs(60);
/// Owners and addresses the creation limiter remembers at most (bounded memory under a flood
/// of made-up owners); beyond it, keys with nothing in the window are forgotten first.
const CREATION_KEYS: usize = 100_000;

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
            SessionError::Busy => ConversationError::Busy(e.to_string()),
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
            SessionError::StoreUnavailable(message) => {
                ConversationError::StorageUnavailable(message)
            }
            SessionError::Prompt(detail) => {
                ConversationError::Internal(format!("prompt: {detail}"))
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
}

/// A new share link: the record and the token of its URL (`/s/{token}`), shown once.
#[derive(Debug, Clone, Serialize)]
pub struct NewShare {
    pub share: ShareRecord,
    pub token: String,
}

/// One message of a share's snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedMessage {
    pub role: Role,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

/// What a share link shows.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedConversation {
    pub title: String,
    pub created_at: DateTime<Utc>,
    pub messages: Vec<SharedMessage>,
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

/// A conversation as exported: lossless, and what import reads back.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExportedConversation {
    /// Always [`EXPORT_FORMAT`].
    pub format: String,
    /// Always [`EXPORT_VERSION`] when written by this server.
    pub version: u32,
    pub title: String,
    pub settings: ConversationSettings,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    /// Counted while parsing by [`ExportedConversation::from_json`]: a document with more
    /// messages than an import may hold is refused at the first one too many, before the rest
    /// is read into memory.
    #[serde(deserialize_with = "bounded_messages")]
    pub messages: Vec<ExportedMessage>,
    /// Version 2: the `id` of the message the conversation shows (its branch ends there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
    /// Version 2, optional: pinned, archived, its folder (by name) and tags. An import files
    /// the conversation in the importer's folder of that name, made when they have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub organisation: Option<ExportedOrganisation>,
}

/// How an exported conversation was organised.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportedOrganisation {
    #[serde(default)]
    pub pinned: bool,
    #[serde(default)]
    pub archived: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub folder: Option<String>,
    #[serde(default)]
    pub tags: Vec<String>,
}

/// Why an export could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ExportParseError {
    #[error("the conversation has more than {0} messages; an import may hold at most {0}")]
    TooManyMessages(usize),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

thread_local! {
    /// The message limit of the [`ExportedConversation::from_json`] running on this thread, and
    /// whether it was hit (serde's error type cannot carry that).
    static MESSAGE_LIMIT: std::cell::Cell<(usize, bool)> = const { std::cell::Cell::new((usize::MAX, false)) };
}

impl ExportedConversation {
    /// The messages of the branch shown: version 2 follows `parent` from `current` (the last
    /// message without one); version 1 is one branch.
    pub fn branch(&self) -> Vec<&ExportedMessage> {
        if self.messages.iter().all(|m| m.id.is_none()) {
            return self.messages.iter().collect();
        }
        let by_id: HashMap<&str, &ExportedMessage> = self
            .messages
            .iter()
            .filter_map(|m| Some((m.id.as_deref()?, m)))
            .collect();
        let mut at = self
            .current
            .as_deref()
            .and_then(|c| by_id.get(c).copied())
            .or_else(|| self.messages.last());
        let mut path = Vec::new();
        while let Some(m) = at.filter(|_| path.len() < self.messages.len()) {
            path.push(m);
            at = m.parent.as_deref().and_then(|p| by_id.get(p).copied());
        }
        path.reverse();
        path
    }

    /// Parses an export, refusing it at the `max_messages + 1`-th message (see `messages`).
    pub fn from_json(text: &str, max_messages: usize) -> Result<Self, ExportParseError> {
        MESSAGE_LIMIT.with(|l| l.set((max_messages, false)));
        let parsed = serde_json::from_str::<ExportedConversation>(text);
        let (_, hit) = MESSAGE_LIMIT.with(|l| l.replace((usize::MAX, false)));
        match parsed {
            Err(_) if hit => Err(ExportParseError::TooManyMessages(max_messages)),
            other => Ok(other?),
        }
    }
}

/// `messages`, counted against the limit [`ExportedConversation::from_json`] set.
fn bounded_messages<'de, D>(d: D) -> std::result::Result<Vec<ExportedMessage>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Vec<ExportedMessage>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an array of messages")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let (max, _) = MESSAGE_LIMIT.with(|l| l.get());
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(max).min(1024));
            while let Some(m) = seq.next_element::<ExportedMessage>()? {
                if out.len() >= max {
                    MESSAGE_LIMIT.with(|l| l.set((max, true)));
                    return Err(serde::de::Error::custom(format!(
                        "more than {max} messages"
                    )));
                }
                out.push(m);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded)
}

/// One message of an export. Version 2 adds the tree: `id` (a name inside the document; import
/// gives new ids) and `parent`, the `id` of an earlier message it follows (absent: a first
/// message). Version 1 has neither: each message follows the one before it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExportedMessage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    pub role: Role,
    pub content: String,
    #[serde(default)]
    pub reasoning: Option<String>,
    #[serde(default)]
    pub raw: Option<String>,
    pub status: MessageStatus,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub prompt_tokens: Option<i64>,
    #[serde(default)]
    pub completion_tokens: Option<i64>,
    #[serde(default)]
    pub cached_tokens: Option<i64>,
    #[serde(default)]
    pub timings: Option<Timings>,
    /// RFC 3339.
    pub created_at: String,
    /// A user message's files: their text as the model read it (the prompt text with them in
    /// it is `raw`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<ExportedFile>,
}

/// A file of an exported message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportedFile {
    pub name: String,
    pub kind: String,
    pub media_type: String,
    pub size_bytes: i64,
    pub tokens: i64,
    pub text: String,
}

fn rfc3339(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// How long imported bytes count against their address.
const IMPORT_WINDOW: Duration = Duration::from_secs(3600);
/// Addresses whose imports are remembered at most (bounded memory).
const IMPORT_KEYS: usize = 100_000;

/// Characters of prompt text an imported conversation may hold per token of the model's context
/// window: more than any tokenizer packs into one token, so whatever could be continued within
/// the window imports, and nothing many times larger does.
const IMPORT_CHARS_PER_CONTEXT_TOKEN: usize = 16;

/// Bytes as MiB with one decimal, for messages.
fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}

/// A client address as a limit key: the address's scope as the sign-in throttle counts it (an
/// IPv4-mapped IPv6 address is its IPv4 address, other IPv6 addresses their /64, which one host
/// usually holds whole).
fn address_key(ip: IpAddr) -> String {
    match smolchat_auth::throttle::address_scope(ip) {
        IpAddr::V4(v4) => format!("addr:{v4}"),
        IpAddr::V6(prefix) => format!("addr:{prefix}/64"),
    }
}

/// The conversation service (see the module docs). One per platform; cheap to share.
pub struct Conversations {
    store: Store,
    sessions: Arc<Sessions>,
    scheduler: Addr<SchedulerActor>,
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
    /// The longest token's bytes: a text has at least its length over this many tokens.
    longest_token_bytes: usize,
}

impl Conversations {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        sessions: Arc<Sessions>,
        scheduler: Addr<SchedulerActor>,
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
        context_window: usize,
        cfg: ConversationsConfig,
        documents: Arc<crate::documents::DocumentReader>,
    ) -> Self {
        let longest_token_bytes = (0..tokenizer.vocab_size() as u32)
            .map(|id| tokenizer.token_bytes(id).len())
            .max()
            .unwrap_or(1)
            .max(1);
        Self {
            documents,
            longest_token_bytes,
            audit: crate::audit::Audit::new(store.clone()),
            store,
            sessions,
            scheduler,
            tokenizer,
            template,
            context_window,
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

    /// The longest token of the vocabulary, in bytes: a text has at least its length over
    /// this many tokens.
    pub fn longest_token_bytes(&self) -> usize {
        self.longest_token_bytes
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

    /// Whether the caller may add one more conversation now: the stored total, then the rate
    /// (per owner, and per address for guests). Taking a place in the rate happens here, so
    /// parallel requests cannot all slip through.
    async fn admit_new_conversation(&self, caller: &Caller) -> Result<()> {
        let max = self.cfg.max_conversations_per_user;
        if max > 0 {
            let n = self.store.count_conversations(&caller.owner).await?;
            if n >= 0 && n as u64 >= max {
                return Err(ConversationError::UserLimit {
                    message: format!(
                        "you have {n} conversations, the most one user may keep ({max}); delete \
                         some to start new ones"
                    ),
                    retry_after_s: 60,
                });
            }
        }
        let per_minute = self.cfg.conversations_per_minute;
        if per_minute > 0 {
            let keys = self.limit_keys(caller);
            let taken = self
                .creations
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(&keys, 1, u64::from(per_minute), Instant::now());
            if let Err(wait) = taken {
                return Err(ConversationError::UserLimit {
                    message: format!(
                        "{} created {per_minute} conversations in the last minute, the \
                         limit; retry in {wait} s",
                        Self::who(caller)
                    ),
                    retry_after_s: wait,
                });
            }
            // The same limit over every replica on this database: counted atomically there,
            // per UTC minute. A store that cannot count lets the creation through (logged).
            let now = chrono::Utc::now();
            for key in &keys {
                match self.store.count_event(&format!("conv:{key}"), now).await {
                    Ok(n) if n > i64::from(per_minute) => {
                        let wait = u64::try_from(
                            (smolchat_store::Period::Minute.end(now) - now).num_seconds(),
                        )
                        .unwrap_or(60)
                        .max(1);
                        return Err(ConversationError::UserLimit {
                            message: format!(
                                "{} created {per_minute} conversations this minute on all \
                                 replicas together (limits.conversations_per_minute); retry in \
                                 {wait} s",
                                Self::who(caller)
                            ),
                            retry_after_s: wait,
                        });
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("cannot count a conversation across replicas: {e}"),
                }
            }
        }
        Ok(())
    }

    /// The keys a caller's rates count against: the owner, and for guests (whose owner ids
    /// cost nothing to mint) also the client address.
    fn limit_keys(&self, caller: &Caller) -> Vec<String> {
        let mut keys = vec![format!("owner:{}", caller.owner)];
        if caller.guest {
            if let Some(ip) = caller.address {
                keys.push(address_key(ip));
            }
        }
        keys
    }

    fn who(caller: &Caller) -> &'static str {
        if caller.guest {
            "you (or other guests from your address)"
        } else {
            "you"
        }
    }

    /// Creates a conversation (title, settings) and sends its first message when it has one.
    /// Everything is checked before anything is stored; a first message that is refused
    /// removes the conversation again, so a refusal leaves nothing behind.
    pub async fn create(&self, caller: &Caller, new: NewConversation) -> Result<Created> {
        let settings = new.settings.apply(self.default_settings());
        self.check_settings(caller, &settings)?;
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
        let (all, messages) = self.store.messages_and_branch(id).await?;
        let versions = Versions::of(&all, &messages);
        let replying = self.replying(id).await;
        let organisation = self.store.organisation(id).await?.unwrap_or_default();
        let files = self.store.files_of(id).await?;
        Ok(ConversationView {
            conversation,
            messages,
            versions,
            replying,
            organisation,
            files,
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
    pub async fn message(&self, caller: &Caller, id: Uuid, mid: Uuid) -> Result<(Message, bool)> {
        let c = self.owned(caller, id).await?;
        let m = self
            .store
            .get_message(mid)
            .await?
            .filter(|m| m.conversation_id == c.id)
            .ok_or(ConversationError::NotFound)?;
        Ok((m, self.replying(c.id).await))
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
        let _ = self.scheduler.send(Evict(id)).await;
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
        let settings = if patch.is_empty() {
            None
        } else {
            let s = patch.apply(c.settings.clone());
            self.check_settings(caller, &s)?;
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
        let session = self.sessions.get_or_start(c.id);
        let mut subscription = session.send(Subscribe).await?;
        if let Some(after) = after {
            // A reply in progress here is replayed from the session's buffer, and its end comes
            // live. Only when nothing is in progress can the reply asked about have ended.
            let outcome = self.outcome_of_reply(c.id, after).await?;
            if subscription.replay.is_empty() {
                subscription.replay.extend(outcome);
            }
        }
        Ok(subscription)
    }

    /// How the reply to (or of) message `after` ended, as the event that said so; `None` while
    /// it is still being written (or not yet begun).
    async fn outcome_of_reply(
        &self,
        conversation: Uuid,
        after: Uuid,
    ) -> Result<Option<ReplyEvent>> {
        let messages = self.store.messages(conversation).await?;
        let Some(asked) = messages.iter().find(|m| m.id == after) else {
            return Err(invalid(
                "after",
                format!("`after`: no message {after} in this conversation (give the id of the message you posted, or of its reply)"),
            ));
        };
        let reply = if asked.role == Role::Assistant {
            Some(asked)
        } else {
            // The newest reply to it (a regenerated reply is a newer sibling).
            messages
                .iter()
                .rev()
                .find(|m| m.parent_id == Some(after) && m.role == Role::Assistant)
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
                summary: crate::session::summary_of_stored(reply),
                message: reply.clone(),
            }),
        })
    }

    /// The caller's conversation as a lossless export document.
    pub async fn export(&self, caller: &Caller, id: Uuid) -> Result<ExportedConversation> {
        let c = self.owned(caller, id).await?;
        self.audit
            .record_by(
                caller,
                "conversation.export",
                &format!("conversation:{id}"),
                "",
            )
            .await;
        let (messages, branch) = self.store.messages_and_branch(c.id).await?;
        // Ids inside the document are its own (`m1`, `m2`, … in order), so an export imported
        // and exported again reads the same, and no internal id leaves the server.
        let name: HashMap<Uuid, String> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| (m.id, format!("m{}", i + 1)))
            .collect();
        let current = branch.last().and_then(|m| name.get(&m.id).cloned());
        let mut files_of: HashMap<Uuid, Vec<ExportedFile>> = HashMap::new();
        for f in self.store.files_of(c.id).await? {
            if let Some(m) = f.message_id {
                files_of.entry(m).or_default().push(ExportedFile {
                    name: f.name,
                    kind: f.kind,
                    media_type: f.media_type,
                    size_bytes: f.size_bytes,
                    tokens: f.tokens,
                    text: f.text,
                });
            }
        }
        let organisation = self.store.organisation(c.id).await?.unwrap_or_default();
        let folder = match organisation.folder_id {
            Some(f) => self
                .store
                .folders(&caller.owner)
                .await?
                .into_iter()
                .find(|x| x.id == f)
                .map(|x| x.name),
            None => None,
        };
        let organisation = ExportedOrganisation {
            pinned: organisation.pinned,
            archived: organisation.archived,
            folder,
            tags: organisation.tags,
        };
        Ok(ExportedConversation {
            organisation: (organisation != ExportedOrganisation::default()).then_some(organisation),
            format: EXPORT_FORMAT.to_string(),
            version: EXPORT_VERSION,
            title: c.title,
            settings: c.settings,
            created_at: Some(rfc3339(&c.created_at)),
            updated_at: Some(rfc3339(&c.updated_at)),
            current,
            messages: messages
                .into_iter()
                .map(|m| ExportedMessage {
                    files: files_of.remove(&m.id).unwrap_or_default(),
                    id: name.get(&m.id).cloned(),
                    parent: m.parent_id.and_then(|p| name.get(&p).cloned()),
                    role: m.role,
                    content: m.content,
                    reasoning: m.reasoning,
                    raw: m.raw,
                    status: m.status,
                    error: m.error,
                    prompt_tokens: m.prompt_tokens,
                    completion_tokens: m.completion_tokens,
                    cached_tokens: m.cached_tokens,
                    timings: m.timings,
                    created_at: rfc3339(&m.created_at),
                })
                .collect(),
        })
    }

    /// The byte quotas an import of `bytes` of text must fit: what the caller's address imported
    /// in the last hour (guests mint owners for free, so the address is what bounds them), then
    /// what the owner keeps stored in all. The address's bytes are taken here.
    async fn check_import_quotas(&self, caller: &Caller, bytes: u64) -> Result<()> {
        let max = self.cfg.max_stored_bytes_per_user;
        if max > 0 {
            let stored = self.store.stored_text_bytes(&caller.owner).await?;
            if stored.saturating_add(bytes) > max {
                return Err(ConversationError::TooLarge(format!(
                    "you keep {} MiB of conversations and this import adds {} MiB; the limit is \
                     {} MiB per user (limits.max_stored_mib_per_user): delete some conversations \
                     first",
                    mib(stored),
                    mib(bytes),
                    mib(max)
                )));
            }
        }
        let per_hour = self.cfg.import_bytes_per_address_per_hour;
        if per_hour > 0 {
            if let Some(ip) = caller.address {
                let mut budget = self.imports.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(wait) = budget.take(&[address_key(ip)], bytes, per_hour, Instant::now())
                {
                    return Err(ConversationError::UserLimit {
                        message: format!(
                            "your address imported close to {} MiB in the last hour, the limit \
                             (limits.import_mib_per_address_per_hour); retry in {wait} s",
                            mib(per_hour)
                        ),
                        retry_after_s: wait,
                    });
                }
            }
        }
        Ok(())
    }

    /// Imports an exported conversation as a new conversation of the caller's (new ids; the
    /// document's timestamps of the conversation are not kept). Everything is checked first:
    /// format and version, title, settings (the one check, `ignore_eos` for admins only),
    /// message count, each message's role, status, text and size; then one transaction stores
    /// it all. Counts against the creation limits like a new conversation.
    pub async fn import(&self, caller: &Caller, doc: ExportedConversation) -> Result<Conversation> {
        if doc.format != EXPORT_FORMAT {
            return Err(invalid(
                "format",
                format!(
                    "`format` must be {EXPORT_FORMAT:?} (a conversation exported from smolchat), \
                     got {:?}",
                    doc.format
                ),
            ));
        }
        if !(EXPORT_VERSION_MIN..=EXPORT_VERSION).contains(&doc.version) {
            return Err(invalid(
                "version",
                format!(
                    "`version` {} is not one this server reads (it reads \
                     {EXPORT_VERSION_MIN} to {EXPORT_VERSION})",
                    doc.version
                ),
            ));
        }
        let rows = Self::import_tree(&doc)?;
        let title = Self::clean_title(&doc.title)?;
        // Checked before anything is stored, so the import is whole or nothing.
        let organise = doc
            .organisation
            .as_ref()
            .map(organise::checked_import)
            .transpose()?;
        self.check_settings(caller, &doc.settings)?;
        let max = self.cfg.max_import_messages;
        if doc.messages.len() > max {
            return Err(ConversationError::TooLarge(format!(
                "the conversation has {} messages; an import may hold at most {max}",
                doc.messages.len()
            )));
        }
        let limit = self.cfg.max_message_chars;
        // A reply's reasoning and raw text can be longer than a typed message: the model
        // writes up to `max_new_tokens` tokens, each a few characters.
        let generated_limit = limit.max(self.cfg.settings_limits.max_new_tokens * 32);
        let mut messages = Vec::with_capacity(doc.messages.len());
        let mut prompt_chars = 0usize;
        let mut text_bytes = 0u64;
        for (i, m) in doc.messages.into_iter().enumerate() {
            let at = |what: &str| format!("messages[{i}]: {what}");
            if !matches!(m.role, Role::User | Role::Assistant) {
                return Err(invalid(
                    "messages",
                    at(&format!(
                        "role {:?} cannot be imported (only user and assistant messages)",
                        m.role.as_str()
                    )),
                ));
            }
            if m.role == Role::User && m.status != MessageStatus::Complete {
                return Err(invalid(
                    "messages",
                    at("a user message must have status \"complete\""),
                ));
            }
            let status = match m.status {
                // No reply is running for an imported message.
                MessageStatus::Streaming => MessageStatus::Interrupted,
                s => s,
            };
            let texts = [
                (
                    "content",
                    Some(&m.content),
                    if m.role == Role::User {
                        limit
                    } else {
                        generated_limit
                    },
                ),
                ("reasoning", m.reasoning.as_ref(), generated_limit),
                ("raw", m.raw.as_ref(), generated_limit),
                ("error", m.error.as_ref(), limit),
            ];
            for (field, text, max_chars) in texts {
                let Some(text) = text else { continue };
                let chars = text.chars().count();
                if chars > max_chars {
                    return Err(ConversationError::TooLarge(at(&format!(
                        "`{field}` has {chars} characters; the limit is {max_chars}"
                    ))));
                }
                if let Some(what) = crate::validation::not_text(text) {
                    return Err(invalid(
                        "messages",
                        at(&format!("`{field}` contains {what}, which is not text")),
                    ));
                }
            }
            if m.role == Role::User && m.content.trim().is_empty() {
                return Err(invalid("messages", at("a user message must not be empty")));
            }
            for (field, n) in [
                ("prompt_tokens", m.prompt_tokens),
                ("completion_tokens", m.completion_tokens),
                ("cached_tokens", m.cached_tokens),
            ] {
                if n.is_some_and(|n| n < 0) {
                    return Err(invalid(
                        "messages",
                        at(&format!("`{field}` must not be negative")),
                    ));
                }
                if let Some(n) = n.filter(|n| *n > MAX_TOKEN_COUNT) {
                    return Err(invalid(
                        "messages",
                        at(&format!(
                            "`{field}` is {n}, more than any context window holds (the limit is \
                             {MAX_TOKEN_COUNT})"
                        )),
                    ));
                }
            }
            // What a continuation would put into the prompt: the raw text (a reply as
            // generated, a user message with its files), else the content.
            prompt_chars += m.raw.as_deref().unwrap_or(&m.content).chars().count();
            let files = Self::import_files(i, &m, self.cfg.max_files_per_message)?;
            text_bytes += files.iter().map(|f| f.text.len() as u64).sum::<u64>();
            text_bytes += [Some(&m.content), m.reasoning.as_ref(), m.raw.as_ref()]
                .into_iter()
                .flatten()
                .map(|t| t.len() as u64)
                .sum::<u64>();
            let created_at = DateTime::parse_from_rfc3339(&m.created_at)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| {
                    invalid(
                        "messages",
                        at(&format!(
                            "`created_at` {:?} is not an RFC 3339 time: {e}",
                            m.created_at
                        )),
                    )
                })?;
            messages.push(ImportedMessage {
                role: m.role,
                content: m.content,
                reasoning: m.reasoning,
                raw: m.raw,
                status,
                error: m.error,
                prompt_tokens: m.prompt_tokens,
                completion_tokens: m.completion_tokens,
                cached_tokens: m.cached_tokens,
                timings: m.timings,
                created_at,
                files,
            });
        }
        let max_prompt_chars = self
            .context_window
            .saturating_mul(IMPORT_CHARS_PER_CONTEXT_TOKEN);
        if prompt_chars > max_prompt_chars {
            return Err(ConversationError::TooLarge(format!(
                "the conversation holds {prompt_chars} characters of messages; this model's \
                 {}-token context window could never continue past {max_prompt_chars}, so an \
                 import may hold at most that much (export a shorter part of it)",
                self.context_window
            )));
        }
        self.check_import_quotas(caller, text_bytes).await?;
        self.admit_new_conversation(caller).await?;
        let c = self
            .store
            .insert_conversation(
                Uuid::now_v7(),
                &caller.owner,
                &title,
                &doc.settings,
                &messages,
                &rows,
            )
            .await?;
        if let Some((patch, folder)) = organise {
            self.organise_import(caller, c.id, patch, folder.as_deref())
                .await?;
        }
        tracing::info!(conversation = %c.id, owner = %caller.owner, messages = messages.len(), "conversation imported");
        self.audit
            .record_by(
                caller,
                "conversation.import",
                &format!("conversation:{}", c.id),
                &format!("{} messages", messages.len()),
            )
            .await;
        Ok(c)
    }

    /// The checked files of message `i` of an import: user messages only, at most `max`, each
    /// named, of a kind this server reads, and text.
    fn import_files(i: usize, m: &ExportedMessage, max: usize) -> Result<Vec<ImportedFile>> {
        let at = |what: String| invalid("messages", format!("messages[{i}].files: {what}"));
        if m.files.is_empty() {
            return Ok(Vec::new());
        }
        if m.role != Role::User {
            return Err(at("only a user message carries files".into()));
        }
        if m.files.len() > max {
            return Err(at(format!(
                "{} files; a message may carry at most {max} (limits.max_files_per_message)",
                m.files.len()
            )));
        }
        m.files
            .iter()
            .map(|f| {
                let name = crate::files::check_name(&f.name).map_err(|e| at(e.to_string()))?;
                if !["text", "markdown", "code", "csv", "json", "pdf"].contains(&f.kind.as_str()) {
                    return Err(at(format!(
                        "{:?} is not a file kind (text, markdown, code, csv, json, pdf)",
                        f.kind
                    )));
                }
                if let Some(what) = crate::validation::not_text(&f.text) {
                    return Err(at(format!("{name:?} contains {what}, which is not text")));
                }
                if f.size_bytes < 0 || f.tokens < 0 {
                    return Err(at(format!(
                        "{name:?}: sizes and token counts are not negative"
                    )));
                }
                Ok(ImportedFile {
                    name,
                    kind: f.kind.clone(),
                    media_type: f.media_type.chars().take(100).collect(),
                    size_bytes: f.size_bytes,
                    text: f.text.clone(),
                    tokens: f.tokens.min(MAX_TOKEN_COUNT),
                })
            })
            .collect()
    }

    /// How an export's messages hang together: version 1, one branch; version 2, each
    /// message's `parent` names an earlier message's `id`, and `current` the message shown.
    fn import_tree(doc: &ExportedConversation) -> Result<Vec<StoredRow>> {
        let n = doc.messages.len();
        if doc.version < 2 {
            return Ok(StoredRow::linear(n, |_| true));
        }
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(n);
        let mut rows = Vec::with_capacity(n);
        for (i, m) in doc.messages.iter().enumerate() {
            let at = |what: String| invalid("messages", format!("messages[{i}]: {what}"));
            let Some(id) = m.id.as_deref() else {
                return Err(at("a version 2 message needs an `id`".into()));
            };
            let parent = match m.parent.as_deref() {
                None => None,
                Some(p) => Some(*seen.get(p).ok_or_else(|| {
                    at(format!(
                        "`parent` {p:?} is not the `id` of an earlier message"
                    ))
                })?),
            };
            if seen.insert(id, i).is_some() {
                return Err(at(format!("`id` {id:?} is used twice")));
            }
            rows.push(StoredRow {
                id: Uuid::now_v7(),
                imported: true,
                parent,
                current: false,
            });
        }
        if let Some(current) = doc.current.as_deref() {
            let i = *seen.get(current).ok_or_else(|| {
                invalid(
                    "current",
                    format!("`current` {current:?} is not the `id` of a message"),
                )
            })?;
            rows[i].current = true;
        }
        Ok(rows)
    }

    // ---- Read-only share links ----

    /// Shares the branch the caller's conversation shows: a snapshot (later messages are not
    /// in it), readable at `/s/{token}` by anyone with the link until revoked. The token is in
    /// the answer only; the store keeps its SHA-256.
    pub async fn share(&self, caller: &Caller, id: Uuid) -> Result<NewShare> {
        let c = self.owned(caller, id).await?;
        if self.replying(c.id).await {
            return Err(ConversationError::Busy(
                "a reply is being generated; share once it is done".into(),
            ));
        }
        let messages: Vec<SharedMessage> = self
            .store
            .branch(c.id)
            .await?
            .into_iter()
            .filter(|m| matches!(m.role, Role::User | Role::Assistant))
            .map(|m| SharedMessage {
                role: m.role,
                content: m.content,
                reasoning: m.reasoning.filter(|r| !r.is_empty()),
            })
            .collect();
        if messages.is_empty() {
            return Err(invalid(
                "conversation",
                "the conversation has no messages yet: there is nothing to share",
            ));
        }
        let snapshot = serde_json::to_string(&messages)
            .map_err(|e| ConversationError::Internal(format!("share snapshot: {e}")))?;
        let (token, digest) = smolchat_auth::secret::new_session();
        let title = if c.title.is_empty() {
            "Untitled conversation".to_string()
        } else {
            c.title.clone()
        };
        let share = self
            .store
            .create_share(c.id, &caller.owner, &digest, &title, &snapshot)
            .await?;
        tracing::info!(conversation = %c.id, share = %share.id, "conversation shared");
        Ok(NewShare { share, token })
    }

    /// The caller's conversation's share links, newest first (revoked ones included).
    pub async fn shares(&self, caller: &Caller, id: Uuid) -> Result<Vec<ShareRecord>> {
        let c = self.owned(caller, id).await?;
        Ok(self.store.shares_of(c.id).await?)
    }

    /// Revokes a share link of the caller's conversation: its page answers 404 from now on.
    pub async fn revoke_share(&self, caller: &Caller, id: Uuid, share: Uuid) -> Result<()> {
        let c = self.owned(caller, id).await?;
        if self.store.revoke_share(c.id, share).await? {
            tracing::info!(conversation = %c.id, %share, "share revoked");
            Ok(())
        } else {
            Err(ConversationError::NoSuch(format!(
                "share {share} is not a live share of this conversation"
            )))
        }
    }

    /// What a share link shows, for anyone holding it. `NotFound` for a token that is not a
    /// live share (never made, revoked, or its conversation deleted), however it is shaped.
    pub async fn shared(&self, token: &str) -> Result<SharedConversation> {
        let Some(digest) = smolchat_auth::secret::session_id(token) else {
            return Err(ConversationError::NotFound);
        };
        let share = self
            .store
            .live_share(&digest)
            .await?
            .ok_or(ConversationError::NotFound)?;
        let messages: Vec<SharedMessage> = serde_json::from_str(&share.snapshot)
            .map_err(|e| ConversationError::Internal(format!("share {}: {e}", share.id)))?;
        Ok(SharedConversation {
            title: share.title,
            created_at: share.created_at,
            messages,
        })
    }

    // ---- Stored responses of the Responses API: each is a conversation of its caller ----

    /// An id for a response to be stored: a conversation id this replica owns (so the chat
    /// that continues it warms the cache where it goes).
    pub fn new_response_id(&self) -> Uuid {
        self.cluster().new_conversation_id()
    }

    /// Whether the caller may keep one more stored response (a conversation each): the number
    /// of conversations one owner may keep (`limits.max_conversations_per_user`). Asked before
    /// the reply is generated, so a refusal costs no compute. (The per-minute creation rate is
    /// not applied: a program's requests are already paced by the scheduler's per-user limits.)
    pub async fn check_response_room(&self, caller: &Caller) -> Result<()> {
        let max = self.cfg.max_conversations_per_user;
        if max > 0 {
            let n = self.store.count_conversations(&caller.owner).await?;
            if n >= 0 && n as u64 >= max {
                return Err(ConversationError::UserLimit {
                    message: format!(
                        "you keep {n} conversations and stored responses, the most one user may                          ({max}); delete some, or send `\"store\": false`"
                    ),
                    retry_after_s: 60,
                });
            }
        }
        Ok(())
    }

    /// Stores a response as the caller's conversation `id`: `messages` in order (earlier turns,
    /// the request's input, the reply last), each with its id and whether the client wrote it
    /// (`true`, guarded in prompts like user text) or the model did. Refused past the caller's
    /// stored-text quota. Named after its first user message.
    pub async fn save_response(
        &self,
        caller: &Caller,
        id: Uuid,
        messages: &[ImportedMessage],
        rows: &[StoredRow],
    ) -> Result<Conversation> {
        let bytes: u64 = messages
            .iter()
            .flat_map(|m| [Some(&m.content), m.reasoning.as_ref(), m.raw.as_ref()])
            .flatten()
            .map(|t| t.len() as u64)
            .sum();
        let max = self.cfg.max_stored_bytes_per_user;
        if max > 0 {
            let stored = self.store.stored_text_bytes(&caller.owner).await?;
            if stored.saturating_add(bytes) > max {
                return Err(ConversationError::TooLarge(format!(
                    "you keep {} MiB of conversations and this response adds {} MiB; the limit \
                     is {} MiB per user (limits.max_stored_mib_per_user): delete some, or send \
                     `\"store\": false`",
                    mib(stored),
                    mib(bytes),
                    mib(max)
                )));
            }
        }
        let title = messages
            .iter()
            .find(|m| m.role == Role::User)
            .map(|m| smolchat_store::derive_title(&m.content))
            .unwrap_or_default();
        let c = self
            .store
            .insert_conversation(
                id,
                &caller.owner,
                &title,
                &self.default_settings(),
                messages,
                rows,
            )
            .await?;
        tracing::info!(conversation = %c.id, owner = %caller.owner, messages = messages.len(), "response stored");
        Ok(c)
    }

    /// A stored response of the caller: its conversation's messages, the reply last.
    /// `NotFound` when there is none, it is another owner's, or its conversation no longer
    /// ends with a reply (it was continued in the chat).
    pub async fn response(
        &self,
        caller: &Caller,
        id: Uuid,
    ) -> Result<(Conversation, Vec<Message>)> {
        let c = self.owned(caller, id).await?;
        let messages = self.store.branch(id).await?;
        match messages.last() {
            Some(m) if m.role == Role::Assistant => Ok((c, messages)),
            _ => Err(ConversationError::NotFound),
        }
    }
}

/// An export as readable Markdown: the title, the system prompt, then `## User` /
/// `## Assistant` sections, reasoning folded in a `<details>` block.
pub fn to_markdown(doc: &ExportedConversation) -> String {
    let mut out = String::new();
    let title = if doc.title.trim().is_empty() {
        "Untitled conversation"
    } else {
        doc.title.as_str()
    };
    out.push_str(&format!("# {title}\n\n"));
    if let Some(system) = doc.settings.system_prompt.as_deref() {
        out.push_str("**System prompt**\n\n");
        for line in system.lines() {
            out.push_str(&format!("> {line}\n"));
        }
        out.push('\n');
    }
    for m in doc.branch() {
        let heading = match m.role {
            Role::User => "User",
            Role::Assistant => "Assistant",
            Role::System => "System",
            Role::Tool => "Tool",
        };
        out.push_str(&format!("## {heading}\n\n"));
        if let Some(r) = m.reasoning.as_deref().filter(|r| !r.trim().is_empty()) {
            out.push_str("<details>\n<summary>Reasoning</summary>\n\n");
            out.push_str(r.trim_end());
            out.push_str("\n\n</details>\n\n");
        }
        out.push_str(m.content.trim_end());
        out.push_str("\n\n");
        if !matches!(m.status, MessageStatus::Complete) {
            out.push_str(&format!("*({})*\n\n", m.status.as_str()));
        }
    }
    out
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
