//! The chat pages: server-rendered askama templates, made live by HTMX (sidebar, settings,
//! rename, delete) and by `static/chat.js` (the composer and the reply stream, which arrives as
//! JSON on `/api/conversations/{id}/events` and is shown as plain text until the `done` event,
//! when the stored reply is fetched again as server-rendered, sanitized markdown).
//!
//! | route | |
//! |---|---|
//! | `GET /` | the chat page with no conversation (the first message creates one) |
//! | `POST /c` | create a conversation (form `content` optional: sent as its first message) → `HX-Redirect` |
//! | `GET /c/{id}` | the chat page of one conversation |
//! | `GET /conversations?q=&before=` | the sidebar list (fragment, one page and a "More" button), filtered by title and content |
//! | `GET /c/{id}/m/{mid}` | one message (fragment) |
//! | `POST /c/{id}/messages` | send (form `content`) → 202; the reply streams on the events API |
//! | `POST /c/{id}/stop`, `/regenerate`, `/edit` (form `content`) | reply controls |
//! | `POST /c/{id}/rename` (form `title`), `/settings` (form), `/thinking` (form `thinking`) | |
//! | `DELETE /c/{id}` | delete → `HX-Redirect: /` |
//! | `GET /c/{id}/export.json`, `/c/{id}/export.md` | download the conversation (lossless JSON, readable Markdown) |
//! | `GET /static/...` | CSS, JS and the vendored HTMX, compiled into the binary (works offline) |
//!
//! Every rule lives in [`smolchat_service::conversations`]; the handlers parse, call the service
//! with the caller ([`Owner::caller`]) and render. Every route here runs inside the owner cookie and CSRF middlewares ([`super::csrf`]); errors are
//! small HTML documents with an `.alert` element and the status code of the [`WebError`].

use actix_web::http::header;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;
use uuid::Uuid;

use super::api::{self, export_response, page_request, parse_id, parse_uuid, ExportFormat};
use super::error::PageError;
use super::error::WebError;
use super::html::{html, read_form};
use super::owner::Owner;
use super::{csrf, markdown, AppState};
use smolchat_service::conversations::{ConversationView, NewConversation, SettingsPatch, Versions};
use smolchat_service::records::{
    ConversationSummary, FileRecord, Folder, ListFilter, ListPage, Message, MessageStatus,
    Organisation, PageRequest, Preset, Role, TagCount, MAX_PAGE,
};
use smolchat_service::ConversationError;

mod actions;
mod assets;
mod share;

pub use actions::{
    create, decide_tool, delete, draft, edit, export_json, export_md, model, regenerate, rename,
    select, send, settings, stop, thinking, ContentForm, MessageForm, SelectForm, SettingsForm,
    ThinkingForm, TitleForm,
};
pub use assets::static_file;
#[cfg(test)]
use assets::STATIC_FILES;
pub use share::{revoke_share, share, shared, SharePage, SharedMessageView};

// ---------------------------------------------------------------------------------------------
// View models: plain strings and numbers, so the templates hold no logic beyond loops and ifs.

#[derive(Clone)]
pub struct ConversationItem {
    pub id: String,
    pub title: String,
    /// In UTC, said so; the page rewrites it in the browser's zone from `when_iso`.
    pub when: String,
    /// RFC 3339, for `<time datetime>`.
    pub when_iso: String,
    pub active: bool,
    pub pinned: bool,
}

fn title_or_default(title: &str) -> String {
    if title.trim().is_empty() {
        "New chat".to_string()
    } else {
        title.to_string()
    }
}

fn items(list: &[ConversationSummary], active: Option<Uuid>) -> Vec<ConversationItem> {
    list.iter()
        .map(|c| ConversationItem {
            id: c.id.to_string(),
            title: title_or_default(&c.title),
            when: c.updated_at.format("%b %d, %H:%M UTC").to_string(),
            when_iso: c
                .updated_at
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            active: Some(c.id) == active,
            pinned: c.pinned,
        })
        .collect()
}

/// A file as its chip shows it.
pub struct FileChip {
    pub id: String,
    pub name: String,
    pub kind: String,
    /// "12.3 KB"
    pub size: String,
    pub tokens: i64,
}

/// "12.3 KB": a file's size as the pages show it.
pub fn human_size(bytes: i64) -> String {
    let b = bytes.max(0) as f64;
    if b >= (1 << 20) as f64 {
        format!("{:.1} MB", b / (1 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

impl FileChip {
    pub fn of(f: &FileRecord) -> FileChip {
        let size = human_size(f.size_bytes);
        FileChip {
            id: f.id.to_string(),
            name: f.name.clone(),
            kind: f.kind.clone(),
            size,
            tokens: f.tokens,
        }
    }
}

pub struct MessageView {
    pub id: String,
    /// The files a user message carries.
    pub files: Vec<FileChip>,
    pub role: &'static str,
    /// A user message's text (escaped by the template).
    pub text: String,
    /// An assistant message's answer as sanitized HTML.
    pub html: String,
    pub reasoning: String,
    pub streaming: bool,
    pub status: &'static str,
    pub error: String,
    pub stats: String,
    /// The message it follows (a reply's user message: what regenerate answers again).
    pub parent: String,
    /// ‹ index/count › when it has other versions.
    pub versions: Option<VersionNav>,
    /// A reply's sources: the passages its user message was given (knowledge), `[n]` in order.
    pub sources: Vec<SourceView>,
}

/// One passage a reply could cite.
pub struct SourceView {
    pub n: i64,
    /// "handbook.pdf › Setup › Linux"
    pub place: String,
    pub text: String,
}

impl SourceView {
    pub fn of(s: &smolchat_service::records::MessageSource) -> SourceView {
        SourceView {
            n: s.n,
            place: if s.heading.is_empty() {
                s.document_name.clone()
            } else {
                format!("{} › {}", s.document_name, s.heading)
            },
            text: s.text.clone(),
        }
    }
}

/// `html` with each citation `[n]` of a source turned into a link to it (`#src-{id}-{n}`).
fn link_citations(html: &str, id: &str, sources: &[SourceView]) -> String {
    let mut out = html.to_string();
    for s in sources {
        let cite = format!("[{}]", s.n);
        let link = format!(
            "<a class=\"cite\" href=\"#src-{id}-{}\" data-source=\"{}\">[{}]</a>",
            s.n, s.n, s.n
        );
        out = out.replace(&cite, &link);
    }
    out
}

/// A message's place among its versions, for the ‹ › arrows (ids empty at either end).
pub struct VersionNav {
    pub index: usize,
    pub count: usize,
    pub previous: String,
    pub next: String,
}

/// The views of `messages` (user and assistant ones), their markdown rendered on a blocking
/// thread: a long history is CPU work the event loop must not wait on. `versions`, when given,
/// is per message of `messages`.
pub async fn message_views(
    messages: Vec<Message>,
    versions: Vec<Versions>,
    files: Vec<FileRecord>,
    steps: std::collections::HashMap<uuid::Uuid, Vec<smolchat_service::records::ToolStep>>,
    sources: std::collections::HashMap<uuid::Uuid, Vec<smolchat_service::records::MessageSource>>,
    replying: bool,
) -> Result<Vec<MessageView>, WebError> {
    web::block(move || {
        messages
            .iter()
            .enumerate()
            .filter(|(_, m)| matches!(m.role, Role::User | Role::Assistant))
            .map(|(i, m)| {
                let mut view = MessageView::from_message(m, replying);
                if let Some(steps) = steps.get(&m.id).filter(|_| !view.streaming) {
                    view.html = crate::tool_steps::answer_with_steps(&m.content, steps);
                }
                // A reply's sources are its user message's (or, alone, keyed by the reply).
                let given = m
                    .parent_id
                    .filter(|_| m.role == Role::Assistant)
                    .and_then(|p| sources.get(&p))
                    .or_else(|| sources.get(&m.id).filter(|_| m.role == Role::Assistant));
                if let Some(given) = given {
                    view.sources = given.iter().map(SourceView::of).collect();
                    if !view.streaming {
                        view.html = link_citations(&view.html, &view.id, &view.sources);
                    }
                }
                view.files = files
                    .iter()
                    .filter(|f| f.message_id == Some(m.id))
                    .map(FileChip::of)
                    .collect();
                view.versions = versions.get(i).filter(|v| v.count > 1).map(|v| VersionNav {
                    index: v.index,
                    count: v.count,
                    previous: v.previous.map(|p| p.to_string()).unwrap_or_default(),
                    next: v.next.map(|n| n.to_string()).unwrap_or_default(),
                });
                view
            })
            .collect()
    })
    .await
    .map_err(|e| WebError::Internal(format!("rendering messages: {e}")))
}

impl MessageView {
    pub fn from_message(m: &Message, replying: bool) -> MessageView {
        let assistant = m.role == Role::Assistant;
        let streaming = m.status == MessageStatus::Streaming && replying;
        let mut stats = Vec::new();
        if assistant && !streaming {
            if let Some(model) = m.timings.as_ref().and_then(|t| t.model.as_ref()) {
                stats.push(model.clone());
            }
            if let Some(n) = m.completion_tokens {
                stats.push(format!("{n} tokens"));
            }
            if let Some(t) = m.timings.as_ref().filter(|t| t.tokens_per_s > 0.0) {
                stats.push(format!("{:.1} tok/s", t.tokens_per_s));
            }
            if let Some(t) = m.timings.as_ref().filter(|t| t.drafted_tokens > 0) {
                // Speculative decoding: tokens that came without a step of their own.
                stats.push(format!(
                    "{} of {} drafts accepted",
                    t.accepted_tokens, t.drafted_tokens
                ));
            }
            if let Some(p) = m.prompt_tokens {
                let cached = m.cached_tokens.unwrap_or(0);
                // Where the cached part came from, when not all from the device.
                let mut from = Vec::new();
                if let Some(t) = m.timings.as_ref() {
                    if t.restored_tokens > 0 {
                        from.push(format!("{} from disk", t.restored_tokens));
                    }
                    if t.warmed_tokens > 0 {
                        from.push(format!("{} while typing", t.warmed_tokens));
                    }
                }
                if from.is_empty() {
                    stats.push(format!("prompt {p} ({cached} cached)"));
                } else {
                    stats.push(format!("prompt {p} ({cached} cached: {})", from.join(", ")));
                }
            }
            match m.status {
                MessageStatus::Stopped => stats.push("stopped".into()),
                MessageStatus::Interrupted => stats.push("interrupted".into()),
                MessageStatus::Error => stats.push("failed".into()),
                _ => {}
            }
        }
        MessageView {
            sources: Vec::new(),
            id: m.id.to_string(),
            files: Vec::new(),
            role: if assistant { "assistant" } else { "user" },
            text: m.content.clone(),
            // While streaming, the page shows the text as it arrives (chat.js replays it).
            html: if assistant && !streaming {
                markdown::render(&m.content)
            } else {
                String::new()
            },
            reasoning: m.reasoning.clone().unwrap_or_default(),
            streaming,
            status: m.status.as_str(),
            error: m.error.clone().unwrap_or_default(),
            stats: stats.join(" · "),
            parent: m.parent_id.map(|p| p.to_string()).unwrap_or_default(),
            versions: None,
        }
    }
}

pub struct SettingsView {
    pub system_prompt: String,
    pub thinking: bool,
    /// Whether the conversation's model can think (the switch is shown only then).
    pub can_think: bool,
    pub temperature: String,
    pub top_p: String,
    pub max_tokens: usize,
    pub max_tokens_limit: usize,
    pub grammar: String,
    /// The tools the conversation may offer, each with whether it does.
    pub tools: Vec<ToolOption>,
    /// `auto`, `required` or a tool's name.
    pub tool_choice: String,
    /// The knowledge collections the caller may search, each with whether this conversation
    /// does (`name` is the collection's id).
    pub collections: Vec<ToolOption>,
    /// Whether any collection is chosen (the composer's chips show then).
    pub knowledge_chosen: bool,
}

pub struct ToolOption {
    pub name: String,
    pub description: String,
    pub chosen: bool,
}

#[derive(Template)]
#[template(path = "chat.html")]
pub struct ChatPage {
    pub csrf: String,
    /// The sidebar's first page.
    pub list: ConversationList,
    /// Empty on `/` (no conversation yet).
    pub conv_id: String,
    pub title: String,
    pub messages: Vec<MessageView>,
    pub replying: bool,
    pub context_used: i64,
    pub context_window: usize,
    pub max_chars: usize,
    pub settings: SettingsView,
    /// The signed-in account's name; empty for a guest.
    pub user_name: String,
    pub is_admin: bool,
    /// The caller's folders and tags (the sidebar's view menu, the organise dialog).
    pub folders: Vec<Folder>,
    pub tags: Vec<TagCount>,
    /// The presets the caller can apply (the settings panel).
    pub presets: Vec<Preset>,
    /// The open conversation's pin, archive, folder and tags.
    pub organisation: Organisation,
    /// Its tags as the dialog's text field shows them.
    pub tags_text: String,
    /// Files uploaded and waiting for the next message (chips above the composer).
    pub pending: Vec<FileChip>,
    /// `limits.max_file_mib`, for the page's own early check.
    pub max_file_mib: u64,
    /// Whether the page sends the message being typed to be warmed (`scheduler.warm_drafts`).
    pub warm_drafts: bool,
    /// The models to pick from, and the one this conversation (or a new chat) uses.
    pub models: Vec<ModelOption>,
    pub model: String,
    /// The questions the task model suggested after the last reply.
    pub follow_ups: Vec<String>,
}

/// A model in the picker.
pub struct ModelOption {
    pub id: String,
    /// "loaded", "loading" or "not loaded" (a first reply from it waits while it loads).
    pub state: &'static str,
}

#[derive(Template)]
#[template(path = "conv_list.html")]
pub struct ConversationList {
    /// The pinned ones, above the rest (the first page of the unfiltered list only).
    pub pinned: Vec<ConversationItem>,
    pub conversations: Vec<ConversationItem>,
    /// The next page's cursor ("" on the last page): the "More" button fetches it.
    pub next: String,
    /// The open conversation ("" on `/`), kept highlighted on later pages.
    pub active: String,
    /// Later pages are appended to the first and say nothing when empty.
    pub first_page: bool,
    /// The view shown (see [`view_filter`]), kept by the "More" button.
    pub view: String,
}

impl ConversationList {
    fn of(
        pinned: &[ConversationSummary],
        page: &ListPage,
        active: Option<Uuid>,
        first_page: bool,
        view: &str,
    ) -> Self {
        ConversationList {
            pinned: items(pinned, active),
            conversations: items(&page.items, active),
            next: page.next.map(|c| c.encode()).unwrap_or_default(),
            active: active.map(|a| a.to_string()).unwrap_or_default(),
            first_page,
            view: view.to_string(),
        }
    }
}

/// The sidebar's views: `""` (every unarchived conversation, the pinned ones in a group of
/// their own above the rest unless searching), `archived`, `folder:<id>`, `tag:<tag>`. Returns
/// the list's filter and whether the pinned group is shown apart.
fn view_filter(view: &str, search: &str) -> Result<(ListFilter, bool), WebError> {
    let search = (!search.trim().is_empty()).then(|| search.to_string());
    let base = ListFilter {
        search: search.clone(),
        archived: Some(false),
        ..ListFilter::default()
    };
    Ok(match view {
        "" if search.is_none() => (
            ListFilter {
                pinned: Some(false),
                ..base
            },
            true,
        ),
        "" => (base, false),
        "archived" => (
            ListFilter {
                archived: Some(true),
                ..base
            },
            false,
        ),
        other => {
            if let Some(folder) = other.strip_prefix("folder:") {
                (
                    ListFilter {
                        folder: Some(parse_uuid(folder, "folder id")?),
                        ..base
                    },
                    false,
                )
            } else if let Some(tag) = other.strip_prefix("tag:") {
                (
                    ListFilter {
                        tag: Some(tag.trim().to_lowercase()),
                        ..base
                    },
                    false,
                )
            } else {
                return Err(WebError::BadRequest(format!(
                    "`view` {other:?} is not a list view (archived, folder:<id> or tag:<tag>)"
                )));
            }
        }
    })
}

/// One page of the sidebar for `view`, with the pinned group on its first page when shown.
async fn sidebar_page(
    state: &AppState,
    owner: &Owner,
    view: &str,
    search: &str,
    page: &PageRequest,
) -> Result<(Vec<ConversationSummary>, ListPage), WebError> {
    let service = state.platform.conversations();
    let caller = owner.caller();
    let (filter, pinned_apart) = view_filter(view, search)?;
    let pinned = if pinned_apart && page.before.is_none() {
        let all_pinned = ListFilter {
            pinned: Some(true),
            archived: Some(false),
            ..ListFilter::default()
        };
        let first = page_request(Some(MAX_PAGE), None)?;
        service.list(&caller, &all_pinned, &first).await?.items
    } else {
        Vec::new()
    };
    let list = service.list(&caller, &filter, page).await?;
    Ok((pinned, list))
}

#[derive(Template)]
#[template(path = "message.html")]
pub struct MessageFragment {
    pub m: MessageView,
}

fn csrf_token(state: &AppState, owner: &Owner) -> String {
    csrf::token_for(&state.cookie_key, &owner.csrf_subject())
}

async fn chat_page(
    state: &AppState,
    owner: &Owner,
    view: Option<ConversationView>,
) -> Result<HttpResponse, PageError> {
    let config = &state.platform.config();
    let service = &state.platform.conversations();
    let first = page_request(None, None)?;
    let (pinned, list) = sidebar_page(state, owner, "", "", &first).await?;
    let caller = owner.caller();
    let (conversation, messages, versions, replying, organisation, files, tool_steps, sources) =
        match view {
            Some(v) => (
                Some(v.conversation),
                v.messages,
                v.versions,
                v.replying,
                v.organisation,
                v.files,
                v.tool_steps,
                v.sources,
            ),
            None => (
                None,
                Vec::new(),
                Vec::new(),
                false,
                Organisation::default(),
                Vec::new(),
                Default::default(),
                Default::default(),
            ),
        };
    let folders = service.folders(&caller).await?;
    let tags = service.tags(&caller).await?;
    let presets = service.presets(&caller).await?;
    // Tokens in use: the last reply's prompt plus what it generated.
    let context_used = messages
        .iter()
        .rev()
        .find_map(|m| {
            Some(
                m.prompt_tokens?
                    .saturating_add(m.completion_tokens.unwrap_or(0)),
            )
        })
        .unwrap_or(0);
    let pending: Vec<FileChip> = files
        .iter()
        .filter(|f| f.message_id.is_none())
        .map(FileChip::of)
        .collect();
    // The last reply's suggested questions, while it is the last message.
    let last_reply = messages
        .last()
        .filter(|m| m.role == Role::Assistant && m.status == MessageStatus::Complete)
        .map(|m| m.id);
    let follow_ups = match last_reply {
        Some(id) if !replying => service.follow_ups(id).await,
        _ => Vec::new(),
    };
    let views = message_views(messages, versions, files, tool_steps, sources, replying).await?;
    let settings = conversation
        .as_ref()
        .map(|c| c.settings.clone())
        .unwrap_or_else(|| service.default_settings());
    // A conversation's own model; a new chat's is the caller's default.
    let model = match &conversation {
        Some(_) => service.model_of(&settings),
        None => service.default_model_for(&caller).await,
    };
    let models = service
        .models()
        .into_iter()
        .map(|m| ModelOption {
            id: m.id,
            state: m.state.as_str(),
        })
        .collect();
    let page = ChatPage {
        csrf: csrf_token(state, owner),
        list: ConversationList::of(
            &pinned,
            &list,
            conversation.as_ref().map(|c| c.id),
            true,
            "",
        ),
        conv_id: conversation
            .as_ref()
            .map(|c| c.id.to_string())
            .unwrap_or_default(),
        title: conversation
            .as_ref()
            .map(|c| title_or_default(&c.title))
            .unwrap_or_else(|| "New chat".into()),
        messages: views,
        replying,
        context_used,
        context_window: state.platform.model().context_window,
        max_chars: config.limits.max_message_chars,
        settings: SettingsView {
            system_prompt: settings.system_prompt.clone().unwrap_or_default(),
            thinking: settings.thinking,
            can_think: service.can_think(&model),
            temperature: format!("{}", settings.temperature),
            top_p: format!("{}", settings.top_p),
            max_tokens: settings.max_tokens,
            max_tokens_limit: config.limits.max_new_tokens,
            grammar: settings.grammar.clone().unwrap_or_default(),
            tools: service
                .tools(&caller)
                .into_iter()
                .map(|(name, description)| ToolOption {
                    chosen: settings.tools.contains(&name),
                    name,
                    description,
                })
                .collect(),
            tool_choice: settings
                .tool_choice
                .clone()
                .unwrap_or_else(|| "auto".into()),
            collections: state
                .platform
                .knowledge()
                .collections(&caller)
                .await?
                .into_iter()
                .map(|c| ToolOption {
                    chosen: settings.knowledge.contains(&c.id),
                    name: c.id.to_string(),
                    description: c.name,
                })
                .collect(),
            knowledge_chosen: !settings.knowledge.is_empty(),
        },
        user_name: owner.name().unwrap_or_default().to_string(),
        is_admin: caller.admin,
        folders,
        tags,
        presets,
        tags_text: organisation.tags.join(", "),
        organisation,
        pending,
        max_file_mib: config.limits.max_file_mib,
        warm_drafts: config.scheduler.warm_drafts,
        models,
        model,
        follow_ups,
    };
    html(&page)
}

/// `GET /`
pub async fn index(state: web::Data<AppState>, owner: Owner) -> Result<HttpResponse, PageError> {
    chat_page(&state, &owner, None).await
}

/// `GET /c/{id}`
pub async fn conversation(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let id = parse_id(&path)?;
    let view = state
        .platform
        .conversations()
        .get(&owner.caller(), id)
        .await?;
    chat_page(&state, &owner, Some(view)).await
}

#[derive(Deserialize)]
pub struct SearchQuery {
    #[serde(default)]
    q: String,
    #[serde(default)]
    active: String,
    #[serde(default)]
    before: String,
    /// See [`view_filter`].
    #[serde(default)]
    view: String,
}

/// `GET /conversations?q=&view=&before=`: one page of the sidebar list.
pub async fn list(
    state: web::Data<AppState>,
    owner: Owner,
    query: web::Query<SearchQuery>,
) -> Result<HttpResponse, PageError> {
    let page = page_request(None, Some(&query.before))?;
    let (pinned, list) = sidebar_page(&state, &owner, &query.view, &query.q, &page).await?;
    let active = Uuid::parse_str(&query.active).ok();
    html(&ConversationList::of(
        &pinned,
        &list,
        active,
        page.before.is_none(),
        &query.view,
    ))
}

/// `GET /c/{id}/m/{mid}`
pub async fn message(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, PageError> {
    let (cid, mid) = path.into_inner();
    let id = parse_id(&cid)?;
    let mid = parse_id(&mid)?;
    let (m, replying, steps, given) = state
        .platform
        .conversations()
        .message(&owner.caller(), id, mid)
        .await
        .map_err(|e| match e {
            ConversationError::NotFound => WebError::NotFound("message not found".into()),
            other => other.into(),
        })?;
    let steps = std::collections::HashMap::from([(m.id, steps)]);
    let sources = std::collections::HashMap::from([(m.id, given)]);
    let m = message_views(vec![m], Vec::new(), Vec::new(), steps, sources, replying)
        .await?
        .pop()
        .ok_or_else(|| WebError::NotFound("message not found".into()))?;
    html(&MessageFragment { m })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(role: &'static str, text: &str, html: &str, reasoning: &str) -> MessageView {
        MessageView {
            sources: Vec::new(),
            id: "m1".into(),
            files: Vec::new(),
            role,
            text: text.into(),
            html: html.into(),
            reasoning: reasoning.into(),
            streaming: false,
            status: "complete",
            error: String::new(),
            stats: "3 tokens".into(),
            parent: String::new(),
            versions: None,
        }
    }

    /// Every vendored file (static/vendor/SHA256SUMS, written by scripts/vendor-frontend.sh) is
    /// served, byte for byte what the registry's package held; and every served vendor file is
    /// listed there.
    #[test]
    fn vendored_files_are_served_as_pinned() {
        use sha2::{Digest, Sha256};
        let sums = include_str!("../../../static/vendor/SHA256SUMS");
        let mut listed = 0;
        for line in sums.lines().filter(|l| !l.trim().is_empty()) {
            let (digest, path) = line.split_once("  ").expect("sha256sum line");
            let name = format!("vendor/{}", path.trim_start_matches("./"));
            let (_, _, bytes) = STATIC_FILES
                .iter()
                .find(|(n, _, _)| *n == name)
                .unwrap_or_else(|| panic!("{name} is vendored but not served"));
            let got: String = Sha256::digest(bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(got, digest, "{name}");
            listed += 1;
        }
        let served = STATIC_FILES
            .iter()
            .filter(|(n, _, _)| n.starts_with("vendor/"))
            .count();
        assert_eq!(
            listed, served,
            "a served vendor file is missing from SHA256SUMS"
        );
    }

    #[test]
    fn assistant_fragment_shows_thinking_escaped_and_markdown_as_is() {
        let html = markdown::render("```sh\nls <dir>\n```\n");
        let out = MessageFragment {
            m: view("assistant", "", &html, "<b>hmm</b>"),
        }
        .render()
        .expect("render");
        assert!(out.contains("<details class=\"thinking\">"), "{out}");
        assert!(out.contains("&#60;b&#62;hmm&#60;/b&#62;"), "{out}");
        assert!(
            out.contains("<pre><code class=\"language-sh\">ls &lt;dir&gt;"),
            "{out}"
        );
        assert!(out.contains("regen-btn"));
        // No reasoning: the block is there (for streaming) but hidden.
        let out = MessageFragment {
            m: view("assistant", "", "<p>hi</p>", ""),
        }
        .render()
        .expect("render");
        assert!(out.contains("<details class=\"thinking\" hidden>"), "{out}");
    }

    #[test]
    fn user_fragment_escapes_text() {
        let out = MessageFragment {
            m: view("user", "<script>x</script>", "", ""),
        }
        .render()
        .expect("render");
        assert!(!out.contains("<script>"), "{out}");
        assert!(out.contains("&#60;script&#62;x&#60;/script&#62;"), "{out}");
    }
}
