//! Conversations as documents: the lossless export format (JSON, and Markdown to read), and
//! import, which checks a document whole (its tree, its sizes, the caller's quotas) and stores it
//! in one transaction.

use super::*;

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
pub(super) fn bounded_messages<'de, D>(d: D) -> std::result::Result<Vec<ExportedMessage>, D::Error>
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
    /// A reply's tool calls, in order, each with its result. (An import keeps the reply's text
    /// only: the calls are shown in the export, not brought back.)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ExportedToolCall>,
}

/// A tool call of an exported reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedToolCall {
    pub name: String,
    /// As the model wrote them (JSON text).
    pub arguments: String,
    /// done, error, denied or interrupted (or awaiting_approval / running for a reply exported
    /// while it ran).
    pub status: String,
    #[serde(default)]
    pub result: Option<String>,
    /// Bytes of the reply's `content` before the call.
    #[serde(default)]
    pub content_offset: i64,
    #[serde(default)]
    pub duration_ms: Option<f64>,
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

pub(super) fn rfc3339(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// How long imported bytes count against their address.
pub(super) const IMPORT_WINDOW: Duration = Duration::from_secs(3600);

/// Addresses whose imports are remembered at most (bounded memory).
pub(super) const IMPORT_KEYS: usize = 100_000;

/// Characters of prompt text an imported conversation may hold per token of the model's context
/// window: more than any tokenizer packs into one token, so whatever could be continued within
/// the window imports, and nothing many times larger does.
pub(super) const IMPORT_CHARS_PER_CONTEXT_TOKEN: usize = 16;

/// An export as readable Markdown: the title, the system prompt, then `## User` /
/// `## Assistant` sections, reasoning folded in a `<details>` block.
/// A tool call in a Markdown export: a folded block with its arguments and result as code (a
/// fence longer than any backtick run inside, so nothing the tool wrote can end it).
fn tool_call_markdown(call: &ExportedToolCall) -> String {
    let fence = |text: &str| {
        let longest = text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
        "`".repeat(longest.max(2) + 1)
    };
    let result = call.result.as_deref().unwrap_or("");
    let (fa, fr) = (fence(&call.arguments), fence(result));
    format!(
        "<details>\n<summary>Tool call: {} ({})</summary>\n\n{fa}json\n{}\n{fa}\n\n{fr}\n{}\n{fr}\n\n</details>\n\n",
        call.name.replace(['<', '>'], ""),
        call.status,
        call.arguments,
        result
    )
}

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
        let mut at = 0;
        for call in &m.tool_calls {
            let cut = smolchat_store::offset_in(&m.content, call.content_offset, at);
            let before = m.content[at..cut].trim();
            if !before.is_empty() {
                out.push_str(before);
                out.push_str("\n\n");
            }
            out.push_str(&tool_call_markdown(call));
            at = cut;
        }
        out.push_str(m.content[at..].trim());
        out.push_str("\n\n");
        if !matches!(m.status, MessageStatus::Complete) {
            out.push_str(&format!("*({})*\n\n", m.status.as_str()));
        }
    }
    out
}

impl Conversations {
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
        let mut steps_of = self.store.tool_steps_of(c.id).await?;
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
                    tool_calls: steps_of
                        .remove(&m.id)
                        .unwrap_or_default()
                        .into_iter()
                        .map(|s| ExportedToolCall {
                            status: s.status.as_str().to_string(),
                            name: s.name,
                            arguments: s.arguments,
                            result: s.result,
                            content_offset: s.content_offset,
                            duration_ms: s.duration_ms,
                        })
                        .collect(),
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
    pub(super) async fn check_import_quotas(&self, caller: &Caller, bytes: u64) -> Result<()> {
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
    pub(super) fn import_files(
        i: usize,
        m: &ExportedMessage,
        max: usize,
    ) -> Result<Vec<ImportedFile>> {
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
    pub(super) fn import_tree(doc: &ExportedConversation) -> Result<Vec<StoredRow>> {
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
}
