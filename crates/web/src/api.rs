//! The JSON API under `/api`: conversations, their messages, stopping a reply, export and
//! import. The reply itself streams on the events endpoint ([`super::events`]). Every rule lives
//! in [`smolchat_service::conversations`]; the handlers here parse, call the service and answer.

use actix_web::http::header;
use std::future::{ready, Ready};

use actix_web::dev::Payload;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use super::error::WebError;
use super::json::{JsonBody, OptionalJsonBody};
use super::owner::Owner;
use super::AppState;
use smolchat_service::conversations::{
    to_markdown, ExportParseError, ExportedConversation, NewConversation, SettingsPatch,
};
use smolchat_service::records::{
    Conversation, ConversationSummary, Cursor, ListFilter, Message, Organisation,
    OrganisationPatch, PageRequest, MAX_PAGE,
};

pub use smolchat_service::conversations::TITLE_LIMIT;

/// Conversations per page when a client does not say (the sidebar's page too).
pub const DEFAULT_PAGE: usize = 50;

/// Conversation fields a client may set on create (`POST`) and change later (`PATCH`); fields
/// left out keep their current value (on create: the configured defaults). An empty
/// `system_prompt` removes it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConversationInput {
    pub title: Option<String>,
    pub system_prompt: Option<String>,
    pub thinking: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub max_tokens: Option<usize>,
    pub seed: Option<u64>,
    pub ignore_eos: Option<bool>,
    /// A GBNF grammar every reply must match; empty removes it.
    pub grammar: Option<String>,
    /// The model replies come from (an id or alias of `GET /v1/models`); empty: the default.
    pub model: Option<String>,
    /// The tools the model may call (names of `GET /api/tools`); `[]`: none.
    pub tools: Option<Vec<String>>,
    /// `required`, one of `tools`, or `auto` (the model decides).
    pub tool_choice: Option<String>,
    /// Knowledge collections each turn searches (ids of `GET /api/knowledge`); `[]`: none.
    pub knowledge: Option<Vec<Uuid>>,
    /// Organising (PATCH only; see [`OrganisationPatch`]): `folder_id: null` takes the
    /// conversation out of its folder; `tags` replaces the set.
    pub pinned: Option<bool>,
    pub archived: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    pub folder_id: Option<Option<Uuid>>,
    pub tags: Option<Vec<String>>,
}

/// A field that may be `null`: absent is `None`, `null` is `Some(None)`.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

impl ConversationInput {
    fn organisation(&self) -> OrganisationPatch {
        OrganisationPatch {
            pinned: self.pinned,
            archived: self.archived,
            folder: self.folder_id,
            tags: self.tags.clone(),
        }
    }

    fn patch(&self) -> SettingsPatch {
        SettingsPatch {
            system_prompt: self.system_prompt.clone(),
            thinking: self.thinking,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_tokens: self.max_tokens,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            grammar: self.grammar.clone(),
            model: self.model.clone(),
            tools: self.tools.clone(),
            tool_choice: self.tool_choice.clone(),
            knowledge: self.knowledge.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewMessage {
    pub content: String,
    /// Files waiting in the conversation (uploaded to `…/files`) the message carries.
    #[serde(default)]
    pub files: Vec<Uuid>,
}

/// `POST …/edit`: the new text, and which user message of the branch shown it is a new version
/// of (the last one when absent).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EditMessage {
    pub content: String,
    #[serde(default)]
    pub message_id: Option<Uuid>,
}

/// `POST …/tools/decide`: Allow (`allow: true`) or Deny a tool call that waits for it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolDecision {
    /// The reply that made the call.
    pub message_id: Uuid,
    pub step: i64,
    pub allow: bool,
}

/// `POST …/regenerate?message_id=`: the user message to answer again (the branch's last one
/// when absent).
#[derive(Debug, Deserialize)]
pub struct RegenerateQuery {
    pub message_id: Option<String>,
}

/// `POST …/select`: the message whose branch to show.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectMessage {
    pub message_id: Uuid,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    pub q: Option<String>,
    pub limit: Option<usize>,
    pub before: Option<String>,
    /// `false` (default): not archived; `true`: archived only; `all`: both.
    pub archived: Option<String>,
    /// `true`/`false`: only pinned / only unpinned; absent: both.
    pub pinned: Option<bool>,
    /// Only the conversations in this folder.
    pub folder: Option<String>,
    /// Only those with this tag.
    pub tag: Option<String>,
}

impl ListQuery {
    /// The list filter this query asks for.
    pub fn filter(&self) -> Result<ListFilter, WebError> {
        let archived = match self.archived.as_deref() {
            None | Some("") | Some("false") => Some(false),
            Some("true") => Some(true),
            Some("all") => None,
            Some(other) => {
                return Err(WebError::BadRequest(format!(
                    "`archived` must be true, false or all, got {other:?}"
                )))
            }
        };
        Ok(ListFilter {
            search: self.q.clone(),
            archived,
            pinned: self.pinned,
            folder: self
                .folder
                .as_deref()
                .filter(|f| !f.is_empty())
                .map(|f| parse_uuid(f, "folder id"))
                .transpose()?,
            tag: self
                .tag
                .as_deref()
                .map(|t| t.trim().to_lowercase())
                .filter(|t| !t.is_empty()),
        })
    }
}

/// A conversation and how it is organised (`PATCH` answers this).
#[derive(Debug, Serialize)]
pub struct Organised {
    #[serde(flatten)]
    pub conversation: Conversation,
    pub organisation: Organisation,
}

/// `GET /api/conversations/{id}`: the conversation, its messages and what is happening now.
#[derive(Debug, Serialize)]
pub struct ConversationDetail {
    #[serde(flatten)]
    pub conversation: Conversation,
    /// Pinned, archived, its folder and tags.
    pub organisation: Organisation,
    /// Its files (no text): `message_id` says which user message carries each; `null`: waiting
    /// for the next message.
    pub files: Vec<smolchat_service::records::FileRecord>,
    /// The branch shown, in order.
    pub messages: Vec<Message>,
    /// Per message: its versions (`index` of `count`, the `previous` and `next` ones' ids).
    pub versions: Vec<smolchat_service::conversations::Versions>,
    /// Whether a reply is being generated right now.
    pub replying: bool,
    /// The model's context window in tokens (the page shows usage against it).
    pub context_window: usize,
    /// The tool calls the replies made, by reply id, each in order.
    pub tool_steps: std::collections::HashMap<Uuid, Vec<smolchat_service::records::ToolStep>>,
    /// The passages user messages were given (knowledge), by message id, `[n]` in order.
    pub sources: std::collections::HashMap<Uuid, Vec<smolchat_service::records::MessageSource>>,
}

/// Parses a conversation id from the path.
pub fn parse_id(raw: &str) -> Result<Uuid, WebError> {
    Uuid::parse_str(raw).map_err(|_| {
        WebError::BadRequest(format!(
            "{raw:?} is not a conversation id (expected a UUID such as 0190a5c4-1f2e-7c3d-9a8b-123456789abc)"
        ))
    })
}

/// A route on one conversation: the caller ([`Owner::caller`](super::owner::Owner::caller)) and the conversation its path
/// names (`{id}`, a UUID; a malformed one is refused with the form expected). Whether the
/// conversation is the caller's is the service's to say. `E` is the route's error face: the
/// JSON API's [`WebError`], a page's `PageError`.
pub struct OnConversation<E = WebError> {
    pub caller: smolchat_service::Caller,
    pub id: Uuid,
    face: std::marker::PhantomData<E>,
}

impl<E> FromRequest for OnConversation<E>
where
    E: From<WebError> + actix_web::ResponseError + 'static,
{
    type Error = E;
    type Future = Ready<Result<Self, E>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let found = || -> Result<Self, WebError> {
            let owner = req
                .extensions()
                .get::<Owner>()
                .cloned()
                .ok_or_else(|| WebError::Internal("owner middleware not installed".into()))?;
            let id = parse_id(req.match_info().get("id").unwrap_or_default())?;
            Ok(OnConversation {
                caller: owner.caller(),
                id,
                face: std::marker::PhantomData,
            })
        };
        ready(found().map_err(E::from))
    }
}

/// A message or share id from a request field: `what` names it in the refusal.
pub fn parse_uuid(raw: &str, what: &str) -> Result<Uuid, WebError> {
    Uuid::parse_str(raw)
        .map_err(|_| WebError::BadRequest(format!("{raw:?} is not a {what} (expected a UUID)")))
}

/// An optional message id (absent or empty: none).
pub fn optional_message_id(raw: Option<&str>) -> Result<Option<Uuid>, WebError> {
    raw.filter(|m| !m.is_empty())
        .map(|m| parse_uuid(m, "message id"))
        .transpose()
}

/// A conversation as `GET` answers it.
fn detail(
    state: &AppState,
    view: smolchat_service::conversations::ConversationView,
) -> ConversationDetail {
    ConversationDetail {
        conversation: view.conversation,
        organisation: view.organisation,
        files: view.files,
        messages: view.messages,
        versions: view.versions,
        replying: view.replying,
        context_window: state.platform.model().context_window,
        tool_steps: view.tool_steps,
        sources: view.sources,
    }
}

/// The page a list request asks for: `limit` (1 to [`MAX_PAGE`], default [`DEFAULT_PAGE`])
/// after the `before` cursor a previous page returned as `next`.
pub fn page_request(limit: Option<usize>, before: Option<&str>) -> Result<PageRequest, WebError> {
    let limit = limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(WebError::BadRequest(format!(
            "`limit` must be between 1 and {MAX_PAGE}, got {limit}"
        )));
    }
    let before = match before.filter(|b| !b.is_empty()) {
        None => None,
        Some(text) => Some(Cursor::decode(text).ok_or_else(|| {
            WebError::BadRequest(format!(
                "`before` {text:?} is not a cursor; pass the `next` value of the previous page"
            ))
        })?),
    };
    Ok(PageRequest { limit, before })
}

/// `POST /api/conversations`
pub async fn create(
    state: web::Data<AppState>,
    owner: Owner,
    body: OptionalJsonBody<ConversationInput>,
) -> Result<HttpResponse, WebError> {
    let input = body.0.unwrap_or_default();
    let created = state
        .platform
        .conversations()
        .create(
            &owner.caller(),
            NewConversation {
                title: input.title.clone(),
                settings: input.patch(),
                first_message: None,
            },
        )
        .await?;
    let c = created.conversation;
    Ok(HttpResponse::Created()
        .insert_header((header::LOCATION, format!("/api/conversations/{}", c.id)))
        .json(c))
}

/// `GET /api/conversations?q=…&limit=…&before=…`: `{"conversations": [...], "next": cursor or
/// null}`; pass `next` as `before` for the following page.
pub async fn list(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
) -> Result<HttpResponse, WebError> {
    let query = web::Query::<ListQuery>::from_query(req.query_string())
        .map_err(|e| WebError::BadRequest(format!("bad query string: {e}")))?;
    let page = page_request(query.limit, query.before.as_deref())?;
    let list = state
        .platform
        .conversations()
        .list(&owner.caller(), &query.filter()?, &page)
        .await?;
    let items: Vec<ConversationSummary> = list.items;
    Ok(HttpResponse::Ok().json(json!({
        "conversations": items,
        "next": list.next.map(|c| c.encode()),
    })))
}

/// `GET /api/conversations/{id}`
pub async fn get(state: web::Data<AppState>, on: OnConversation) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let view = state.platform.conversations().get(&caller, id).await?;
    Ok(HttpResponse::Ok().json(detail(&state, view)))
}

/// `PATCH /api/conversations/{id}`: title and/or settings (used from the next message on).
pub async fn patch(
    state: web::Data<AppState>,
    on: OnConversation,
    body: JsonBody<ConversationInput>,
) -> Result<HttpResponse, WebError> {
    let input = body.0;
    let OnConversation { caller, id, .. } = on;
    let service = state.platform.conversations();
    let organise = input.organisation();
    let organisation = if organise == OrganisationPatch::default() {
        service.organisation(&caller, id).await?
    } else {
        service.organise(&caller, id, organise).await?
    };
    let updated = service
        .update(&caller, id, input.title.as_deref(), &input.patch())
        .await?;
    Ok(HttpResponse::Ok().json(Organised {
        conversation: updated,
        organisation,
    }))
}

/// `DELETE /api/conversations/{id}`: stops its session (and reply), deletes the conversation and
/// frees its KV cache.
pub async fn delete(
    state: web::Data<AppState>,
    on: OnConversation,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    state.platform.conversations().delete(&caller, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `POST /api/conversations/{id}/draft`: the message being typed (`{"content", "files"}`, as
/// for `…/messages`), warmed into the conversation's KV cache in spare steps so that its send
/// computes only what changed. 202 with `{"outcome": "offered", "prompt_tokens"}` or
/// `{"outcome": "skipped", "reason"}`; nothing is stored.
pub async fn warm_draft(
    state: web::Data<AppState>,
    on: OnConversation,
    body: JsonBody<NewMessage>,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let outcome = state
        .platform
        .conversations()
        .warm_draft(&caller, id, body.0.content, body.0.files)
        .await?;
    Ok(HttpResponse::Accepted().json(outcome))
}

/// `POST /api/conversations/{id}/messages`: stores the message and queues the reply; 202 once
/// both happened. The reply streams on `/api/conversations/{id}/events`.
pub async fn send_message(
    state: web::Data<AppState>,
    on: OnConversation,
    body: JsonBody<NewMessage>,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let accepted = state
        .platform
        .conversations()
        .send_with_files(&caller, id, body.0.content, body.0.files)
        .await?;
    Ok(HttpResponse::Accepted().json(json!({
        "user_message": accepted.user_message,
        "assistant_message_id": accepted.assistant_message_id,
        "events": format!("/api/conversations/{id}/events"),
    })))
}

/// `POST /api/conversations/{id}/regenerate[?message_id=]`: a new reply to the last user message
/// (or that one) beside the replies it has, kept as versions (202, like a send).
pub async fn regenerate(
    state: web::Data<AppState>,
    on: OnConversation,
    query: web::Query<RegenerateQuery>,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let message = optional_message_id(query.message_id.as_deref())?;
    let accepted = state
        .platform
        .conversations()
        .regenerate(&caller, id, message)
        .await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// `POST /api/conversations/{id}/tools/decide` `{"message_id", "step", "allow"}`: allows or
/// denies a tool call of the running reply that waits for the user (204).
pub async fn decide_tool(
    state: web::Data<AppState>,
    on: OnConversation,
    body: JsonBody<ToolDecision>,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let d = body.0;
    state
        .platform
        .conversations()
        .decide_tool(&caller, id, d.message_id, d.step, d.allow)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `GET /api/tools`: the tools a conversation may offer (`name`, `description`), and the rules
/// they run under.
pub async fn tools(state: web::Data<AppState>, owner: Owner) -> HttpResponse {
    let tools: Vec<_> = state
        .platform
        .conversations()
        .tools(&owner.caller())
        .into_iter()
        .map(|(name, description)| json!({"name": name, "description": description}))
        .collect();
    HttpResponse::Ok().json(json!({ "tools": tools }))
}

/// `POST /api/conversations/{id}/edit` `{"content", "message_id"?}`: sends a new version of a
/// user message of the branch shown (the last one without `message_id`): a new branch from the
/// same point, the old one kept (202, like a send).
pub async fn edit(
    state: web::Data<AppState>,
    on: OnConversation,
    body: JsonBody<EditMessage>,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let accepted = state
        .platform
        .conversations()
        .edit(&caller, id, body.0.content, body.0.message_id)
        .await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// `POST /api/conversations/{id}/select` `{"message_id"}`: shows the branch through that
/// message (a version chosen among its siblings); answers the conversation as `GET` does.
pub async fn select(
    state: web::Data<AppState>,
    on: OnConversation,
    body: JsonBody<SelectMessage>,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let conversations = state.platform.conversations();
    conversations.select(&caller, id, body.0.message_id).await?;
    let view = conversations.get(&caller, id).await?;
    Ok(HttpResponse::Ok().json(detail(&state, view)))
}

/// `POST /api/conversations/{id}/stop`: stops the running reply (it is stored as `stopped`).
pub async fn stop(
    state: web::Data<AppState>,
    on: OnConversation,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let stopped = state.platform.conversations().stop(&caller, id).await?;
    Ok(HttpResponse::Ok().json(json!({ "stopped": stopped })))
}

#[derive(Debug, Default, Deserialize)]
pub struct ExportQuery {
    pub format: Option<String>,
}

/// The export formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    Json,
    Markdown,
}

impl ExportFormat {
    pub fn parse(text: Option<&str>) -> Result<ExportFormat, WebError> {
        match text.unwrap_or("json") {
            "json" => Ok(ExportFormat::Json),
            "md" | "markdown" => Ok(ExportFormat::Markdown),
            other => Err(WebError::BadRequest(format!(
                "`format` must be json or md, got {other:?}"
            ))),
        }
    }
}

/// A file name for a download: the title's letters and digits, else "conversation".
fn file_name(title: &str, ext: &str) -> String {
    let mut name: String = title
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    name = name
        .split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    name.truncate(60);
    if name.is_empty() {
        name = "conversation".into();
    }
    format!("{name}.{ext}")
}

/// The export as a download (`Content-Disposition: attachment`).
pub fn export_response(
    doc: &ExportedConversation,
    format: ExportFormat,
) -> Result<HttpResponse, WebError> {
    let (body, content_type, ext) = match format {
        ExportFormat::Json => (
            serde_json::to_string_pretty(doc)
                .map_err(|e| WebError::Internal(format!("export: {e}")))?,
            "application/json",
            "json",
        ),
        ExportFormat::Markdown => (to_markdown(doc), "text/markdown; charset=utf-8", "md"),
    };
    Ok(HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((
            header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{}\"", file_name(&doc.title, ext)),
        ))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .body(body))
}

/// `GET /api/conversations/{id}/export?format=json|md`
pub async fn export(
    state: web::Data<AppState>,
    on: OnConversation,
    req: HttpRequest,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let query = web::Query::<ExportQuery>::from_query(req.query_string())
        .map_err(|e| WebError::BadRequest(format!("bad query string: {e}")))?;
    let format = ExportFormat::parse(query.format.as_deref())?;
    let doc = state.platform.conversations().export(&caller, id).await?;
    export_response(&doc, format)
}

/// `POST /api/conversations/import` (an exported conversation as the body) → 201 with the new
/// conversation.
pub async fn import(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, WebError> {
    let Some(text) = super::json::read_json_text(&req, payload.into_inner()).await? else {
        return Err(WebError::InvalidJson(
            "this endpoint needs a JSON body (an exported conversation)".into(),
        ));
    };
    // Parsing up to 32 MiB takes a while: on a blocking thread, not the event loop, with the
    // message count checked while parsing.
    let max = state.platform.conversations().config().max_import_messages;
    let doc = web::block(move || ExportedConversation::from_json(&text, max))
        .await
        .map_err(|e| WebError::Internal(format!("import parser: {e}")))?
        .map_err(|e| match e {
            ExportParseError::TooManyMessages(_) => WebError::PayloadTooLarge(e.to_string()),
            ExportParseError::Json(e) => super::json::json_error(e),
        })?;
    let c = state
        .platform
        .conversations()
        .import(&owner.caller(), doc)
        .await?;
    Ok(HttpResponse::Created()
        .insert_header((header::LOCATION, format!("/api/conversations/{}", c.id)))
        .json(c))
}

/// `POST /api/conversations/{id}/shares`: a read-only share link of the branch shown → 201
/// `{share, url}` (the URL's token is shown this once).
pub async fn create_share(
    state: web::Data<AppState>,
    on: OnConversation,
    req: actix_web::HttpRequest,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let made = state.platform.conversations().share(&caller, id).await?;
    Ok(HttpResponse::Created().json(serde_json::json!({
        "share": made.share,
        "url": share_url(&state, &req, &made.token),
    })))
}

/// `GET /api/conversations/{id}/shares`: its share links (no tokens), newest first.
pub async fn list_shares(
    state: web::Data<AppState>,
    on: OnConversation,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let shares = state.platform.conversations().shares(&caller, id).await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "shares": shares })))
}

/// `DELETE /api/conversations/{id}/shares/{share}`: revokes a link → 204.
pub async fn revoke_share(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, WebError> {
    let (id, share) = path.into_inner();
    let id = parse_id(&id)?;
    let share = parse_uuid(&share, "share id")?;
    state
        .platform
        .conversations()
        .revoke_share(&owner.caller(), id, share)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// The absolute URL of a share token (see [`super::client::public_base`]).
pub fn share_url(state: &AppState, req: &actix_web::HttpRequest, token: &str) -> String {
    format!("{}/s/{token}", super::client::public_base(state, req))
}
