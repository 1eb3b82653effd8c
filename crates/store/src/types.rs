//! The values the store hands out and takes in. Plain data: no SQL here.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Per-conversation generation settings, stored as one JSON column so adding a field needs no
/// migration (`#[serde(default)]` fills fields missing from older rows).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ConversationSettings {
    pub system_prompt: Option<String>,
    pub thinking: bool,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub max_tokens: usize,
    pub seed: Option<u64>,
    /// Keep generating past end-of-generation tokens (benchmarks; not shown in the UI).
    #[serde(default)]
    pub ignore_eos: bool,
    /// A GBNF grammar every reply must match (llama-server's `grammar`): for replies in a fixed
    /// shape (a form, a list, a label). `None`: free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// The date the chat template's `strftime_now` renders for this conversation, fixed at creation
    /// so a resumed conversation renders the same prompt prefix (and its cached KV stays valid).
    #[serde(with = "naive_date")]
    pub pinned_date: NaiveDate,
    /// The model the conversation's replies come from (a model's id); `None`: the server's
    /// default model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The tools the model may call in this conversation (tool names; none: no tools).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    /// `required` or a tool's name: the first step of every reply must call a tool (that one);
    /// `None`: the model decides (OpenAI's `tool_choice`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<String>,
    /// Knowledge collections whose passages each turn is given (ids; empty: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub knowledge: Vec<Uuid>,
}

impl Default for ConversationSettings {
    fn default() -> Self {
        Self {
            knowledge: Vec::new(),
            system_prompt: None,
            thinking: true,
            temperature: 0.7,
            top_p: 0.95,
            top_k: 40,
            max_tokens: 1024,
            seed: None,
            ignore_eos: false,
            grammar: None,
            model: None,
            tools: Vec::new(),
            tool_choice: None,
            // Local, not UTC: Hugging Face's `strftime_now` renders the server's local date, and a
            // user expects "today" where the server runs.
            pinned_date: chrono::Local::now().date_naive(),
        }
    }
}

impl ConversationSettings {
    /// Rejects values that could not round-trip through JSON (serde_json writes NaN as `null`,
    /// which would then fail to read back and make the conversation unreadable).
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !self.top_p.is_finite() || !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top_p must be between 0 and 1, got {}", self.top_p));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Conversation {
    pub id: Uuid,
    pub owner: String,
    /// Empty until the first user message names the conversation (or a rename does).
    pub title: String,
    pub settings: ConversationSettings,
    #[serde(serialize_with = "rfc3339")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "rfc3339")]
    pub updated_at: DateTime<Utc>,
}

/// One line of a conversation list.
#[derive(Clone, Debug, Serialize)]
pub struct ConversationSummary {
    pub id: Uuid,
    pub owner: String,
    pub title: String,
    pub message_count: i64,
    #[serde(serialize_with = "rfc3339")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "rfc3339")]
    pub updated_at: DateTime<Utc>,
    pub pinned: bool,
    pub archived: bool,
    pub folder_id: Option<Uuid>,
}

/// Which of an owner's conversations a list holds; the default is all of them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ListFilter {
    /// Title or message text (see [`crate::Store::list_conversations_page`]).
    pub search: Option<String>,
    /// Only archived (`true`) or only unarchived (`false`) ones.
    pub archived: Option<bool>,
    /// Only pinned (`true`) or only unpinned (`false`) ones.
    pub pinned: Option<bool>,
    /// Only those in this folder.
    pub folder: Option<Uuid>,
    /// Only those with this tag.
    pub tag: Option<String>,
}

/// The most conversations one page may hold.
pub const MAX_PAGE: usize = 200;

/// Where a page of a conversation list starts: after the conversation with this
/// `(updated_at, id)` (keyset pagination). Written as `<micros>_<id>` in URLs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub updated_at_micros: i64,
    pub id: Uuid,
}

impl Cursor {
    pub fn encode(&self) -> String {
        format!("{}_{}", self.updated_at_micros, self.id)
    }

    /// Parses what [`Cursor::encode`] wrote; `None` for anything else.
    pub fn decode(text: &str) -> Option<Cursor> {
        let (at, id) = text.split_once('_')?;
        Some(Cursor {
            updated_at_micros: at.parse().ok()?,
            id: Uuid::parse_str(id).ok()?,
        })
    }
}

/// Which page of a list: at most `limit` items (clamped to 1..=[`MAX_PAGE`]) after `before`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRequest {
    pub limit: usize,
    pub before: Option<Cursor>,
}

/// One page of a conversation list and the cursor of the next page, if there is one.
#[derive(Clone, Debug)]
pub struct ListPage {
    pub items: Vec<ConversationSummary>,
    pub next: Option<Cursor>,
}

/// One message of an imported conversation, everything but its ids.
#[derive(Clone, Debug)]
pub struct ImportedMessage {
    pub role: Role,
    pub content: String,
    pub reasoning: Option<String>,
    pub raw: Option<String>,
    pub status: MessageStatus,
    pub error: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub cached_tokens: Option<i64>,
    pub timings: Option<Timings>,
    pub created_at: DateTime<Utc>,
    /// The files a user message carries (checked by the service).
    pub files: Vec<ImportedFile>,
}

/// A file of an imported message.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedFile {
    pub name: String,
    pub kind: String,
    pub media_type: String,
    pub size_bytes: i64,
    pub text: String,
    pub tokens: i64,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The spelling used in the database and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "system" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            "tool" => Ok(Role::Tool),
            other => Err(format!("unknown role {other:?}")),
        }
    }
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MessageStatus {
    Complete,
    /// An assistant reply being generated right now (or, after a crash, never finished).
    Streaming,
    Stopped,
    Interrupted,
    Error,
}

impl MessageStatus {
    /// The spelling used in the database and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageStatus::Complete => "complete",
            MessageStatus::Streaming => "streaming",
            MessageStatus::Stopped => "stopped",
            MessageStatus::Interrupted => "interrupted",
            MessageStatus::Error => "error",
        }
    }
}

impl fmt::Display for MessageStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MessageStatus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "complete" => Ok(MessageStatus::Complete),
            "streaming" => Ok(MessageStatus::Streaming),
            "stopped" => Ok(MessageStatus::Stopped),
            "interrupted" => Ok(MessageStatus::Interrupted),
            "error" => Ok(MessageStatus::Error),
            other => Err(format!("unknown message status {other:?}")),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    pub id: Uuid,
    pub conversation_id: Uuid,
    /// 1, 2, 3, ... within the conversation; gaps appear after deletions, order is what counts.
    pub position: i64,
    pub role: Role,
    /// The answer text (for an assistant message, without the reasoning).
    pub content: String,
    pub reasoning: Option<String>,
    /// The exact generated text (reasoning, tags and answer) of an assistant message.
    pub raw: Option<String>,
    pub status: MessageStatus,
    pub error: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub cached_tokens: Option<i64>,
    pub timings: Option<Timings>,
    #[serde(serialize_with = "rfc3339")]
    pub created_at: DateTime<Utc>,
    /// The message came in through an import: its text (an assistant message's included) is the
    /// importer's, never the model's, so prompts guard it like user text.
    pub imported: bool,
    /// The message it follows (`None` for a first message). Siblings are versions: replies
    /// regenerated for one user message, user messages edited from one point.
    pub parent_id: Option<Uuid>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Timings {
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub ttft_ms: f64,
    pub generation_ms: f64,
    pub tokens_per_s: f64,
    /// Speculative decoding in this reply: draft tokens verified, and those the model
    /// confirmed (0 in rows written before they were counted).
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// Of the cached prompt tokens, those read back from the KV spill tier (disk or host
    /// memory) and those computed while the message was typed (0 in rows written before).
    pub restored_tokens: u64,
    pub warmed_tokens: u64,
    /// The model that wrote the reply (its id; `None` in rows written before it was kept).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl Timings {
    /// Non-finite values become 0: a rate computed over zero time is NaN or infinite, and
    /// serde_json would write it as `null`, which would not read back as a number.
    pub(crate) fn sanitized(&self) -> Timings {
        let f = |v: f64| if v.is_finite() { v } else { 0.0 };
        Timings {
            queue_ms: f(self.queue_ms),
            prefill_ms: f(self.prefill_ms),
            ttft_ms: f(self.ttft_ms),
            generation_ms: f(self.generation_ms),
            tokens_per_s: f(self.tokens_per_s),
            drafted_tokens: self.drafted_tokens,
            accepted_tokens: self.accepted_tokens,
            restored_tokens: self.restored_tokens,
            model: self.model.clone(),
            warmed_tokens: self.warmed_tokens,
        }
    }
}

/// The final state of an assistant reply, written once by `Store::finish_assistant_message`.
#[derive(Clone, Debug)]
pub struct FinishedReply {
    pub content: String,
    pub reasoning: Option<String>,
    pub raw: String,
    /// complete | stopped | interrupted | error (`streaming` is refused).
    pub status: MessageStatus,
    pub error: Option<String>,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub cached_tokens: i64,
    pub timings: Timings,
}

/// Longest title derived from a first message, in chars, ellipsis included.
pub const TITLE_MAX_CHARS: usize = 60;

/// The title a conversation gets from its first user message: the first non-blank line, trimmed,
/// whitespace runs collapsed, at most [`TITLE_MAX_CHARS`] chars (cut on a char boundary, at a word
/// break when one is near, with an ellipsis). Empty when the message has no visible text.
pub fn derive_title(content: &str) -> String {
    let line = content
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let line = line.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() <= TITLE_MAX_CHARS {
        return line;
    }
    // Leave room for the ellipsis.
    let mut cut: String = line.chars().take(TITLE_MAX_CHARS - 1).collect();
    // Prefer ending on a whole word when a space falls in the last third; text without spaces
    // (CJK, long identifiers) is cut mid-run instead.
    if let Some(space) = cut.rfind(' ') {
        if cut[..space].chars().count() >= TITLE_MAX_CHARS * 2 / 3 {
            cut.truncate(space);
        }
    }
    let mut title = cut.trim_end().to_string();
    title.push('…');
    title
}

// chrono is built without its `serde` feature; these keep the formats that feature would use
// (RFC 3339 for instants, ISO 8601 `YYYY-MM-DD` for dates).
fn rfc3339<S: serde::Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
}

/// [`rfc3339`] for the store's other record modules.
pub(crate) fn rfc3339_pub<S: serde::Serializer>(
    t: &DateTime<Utc>,
    s: S,
) -> Result<S::Ok, S::Error> {
    rfc3339(t, s)
}

mod naive_date {
    use chrono::NaiveDate;
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &NaiveDate, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&d.format("%Y-%m-%d"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<NaiveDate, D::Error> {
        let text = String::deserialize(d)?;
        NaiveDate::parse_from_str(&text, "%Y-%m-%d")
            .map_err(|e| D::Error::custom(format!("invalid date {text:?} (want YYYY-MM-DD): {e}")))
    }
}

/// What a server-side session is for. Stored as TEXT in `sessions.kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SessionKind {
    /// Signed in with `server.admin_token`.
    Admin,
    /// Signed in to an account (user sign-in; the subject is the user's id).
    User,
}

impl SessionKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionKind::Admin => "admin",
            SessionKind::User => "user",
        }
    }
}

impl FromStr for SessionKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "admin" => Ok(SessionKind::Admin),
            "user" => Ok(SessionKind::User),
            other => Err(format!("unknown session kind {other:?}")),
        }
    }
}

/// One row of `sessions`. The cookie token itself is never stored; `id` is its SHA-256 (hex).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRecord {
    pub id: String,
    pub kind: SessionKind,
    pub subject: String,
    pub fingerprint: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub last_seen_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}
