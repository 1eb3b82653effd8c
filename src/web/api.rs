//! The JSON API under `/api`: conversations, their messages, stopping a reply.
//! The reply itself streams on the events endpoint ([`super::events`]).

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use super::error::WebError;
use super::json::{JsonBody, OptionalJsonBody};
use super::owner::Owner;
use super::AppState;
use crate::actors::scheduler::Evict;
use crate::actors::session::{GetInfo, SendMessage, Shutdown, Stop};
use crate::actors::settings::{self, SettingsLimits};
use crate::config::Config;
use crate::engine::template::{ChatMessage, RenderOptions};
use crate::store::{Conversation, ConversationSettings, Message};

/// Longest conversation title, in characters.
pub const TITLE_LIMIT: usize = 200;

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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewMessage {
    pub content: String,
}

#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    pub q: Option<String>,
}

/// `GET /api/conversations/{id}`: the conversation, its messages and what is happening now.
#[derive(Debug, Serialize)]
pub struct ConversationDetail {
    #[serde(flatten)]
    pub conversation: Conversation,
    pub messages: Vec<Message>,
    /// Whether a reply is being generated right now.
    pub replying: bool,
    /// The model's context window in tokens (the page shows usage against it).
    pub context_window: usize,
}

/// The configured bounds of conversation settings.
pub fn settings_limits(config: &Config) -> SettingsLimits {
    SettingsLimits {
        max_prompt_chars: config.limits.max_message_chars,
        max_new_tokens: config.limits.max_new_tokens,
    }
}

/// New conversations start from `config.sampling`; the store's default pins today's date.
pub fn default_settings(config: &Config) -> ConversationSettings {
    let s = &config.sampling;
    ConversationSettings {
        system_prompt: s.system_prompt.clone().filter(|p| !p.trim().is_empty()),
        thinking: s.thinking,
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        max_tokens: s.max_tokens.min(config.limits.max_new_tokens),
        seed: None,
        ..ConversationSettings::default()
    }
}

/// Applies `input` to `settings`, refusing values generation could not use.
fn apply_settings(
    config: &Config,
    input: &ConversationInput,
    mut settings: ConversationSettings,
) -> Result<ConversationSettings, WebError> {
    if let Some(p) = &input.system_prompt {
        settings.system_prompt = (!p.trim().is_empty()).then(|| p.clone());
    }
    if let Some(v) = input.thinking {
        settings.thinking = v;
    }
    if let Some(v) = input.temperature {
        settings.temperature = v;
    }
    if let Some(v) = input.top_p {
        settings.top_p = v;
    }
    if let Some(v) = input.top_k {
        settings.top_k = v;
    }
    if let Some(v) = input.max_tokens {
        settings.max_tokens = v;
    }
    if input.seed.is_some() {
        settings.seed = input.seed;
    }
    if let Some(v) = input.ignore_eos {
        settings.ignore_eos = v;
    }
    settings::check(&settings, settings_limits(config))?;
    Ok(settings)
}

fn clean_title(title: &str) -> Result<String, WebError> {
    let title = title.trim();
    let chars = title.chars().count();
    if chars > TITLE_LIMIT {
        return Err(WebError::BadRequest(format!(
            "the title has {chars} characters; the limit is {TITLE_LIMIT}"
        )));
    }
    Ok(title.to_string())
}

/// Parses a conversation id from the path.
pub fn parse_id(raw: &str) -> Result<Uuid, WebError> {
    Uuid::parse_str(raw).map_err(|_| {
        WebError::BadRequest(format!(
            "{raw:?} is not a conversation id (expected a UUID such as 0190a5c4-1f2e-7c3d-9a8b-123456789abc)"
        ))
    })
}

/// Refuses settings whose system prompt leaves no room in the context window for a message and
/// a reply: every message of such a conversation would fail, so say so when it is set.
pub fn check_system_prompt_fits(
    platform: &crate::platform::Platform,
    settings: &ConversationSettings,
) -> Result<(), WebError> {
    let Some(system) = settings.system_prompt.as_deref() else {
        return Ok(());
    };
    let messages = [ChatMessage::system(system), ChatMessage::user("")];
    let mut opts = RenderOptions::new(settings.pinned_date);
    opts.enable_thinking = Some(settings.thinking);
    let tokens = platform
        .template
        .render_prompt(&messages, &opts, platform.tokenizer.text_guard())
        .and_then(|p| platform.tokenizer.encode_rendered(&p))
        .map_err(|e| {
            WebError::BadRequest(format!(
                "`system_prompt`: the chat template cannot use this system prompt: {e}"
            ))
        })?
        .len();
    let window = platform.model.context_window;
    // At least one token of message and one of reply must fit after it.
    if tokens + 2 > window {
        return Err(WebError::BadRequest(format!(
            "`system_prompt`: the system prompt takes {tokens} tokens of the model's \
             {window}-token context window, which leaves no room for a message and a reply; \
             shorten it"
        )));
    }
    Ok(())
}

/// The conversation if it exists and belongs to `owner`; otherwise 404 either way, so another
/// owner's ids cannot be told apart from unknown ones.
pub async fn owned(
    state: &AppState,
    raw_id: &str,
    owner: &Owner,
) -> Result<Conversation, WebError> {
    let id = parse_id(raw_id)?;
    match state.platform.store.get_conversation(id).await? {
        Some(c) if c.owner == owner.as_str() => Ok(c),
        _ => Err(WebError::conversation_not_found()),
    }
}

/// `POST /api/conversations`
pub async fn create(
    state: web::Data<AppState>,
    owner: Owner,
    body: OptionalJsonBody<ConversationInput>,
) -> Result<HttpResponse, WebError> {
    let input = body.0.unwrap_or_default();
    let config = &state.platform.config;
    let settings = apply_settings(config, &input, default_settings(config))?;
    check_system_prompt_fits(&state.platform, &settings)?;
    let title = input.title.as_deref().map(clean_title).transpose()?;
    let store = &state.platform.store;
    let mut conversation = store.create_conversation(owner.as_str(), &settings).await?;
    if let Some(title) = title.filter(|t| !t.is_empty()) {
        store.rename_conversation(conversation.id, &title).await?;
        conversation.title = title;
    }
    tracing::info!(conversation = %conversation.id, owner = owner.as_str(), "conversation created");
    Ok(HttpResponse::Created()
        .insert_header((
            header::LOCATION,
            format!("/api/conversations/{}", conversation.id),
        ))
        .json(conversation))
}

/// `GET /api/conversations?q=…`
pub async fn list(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
) -> Result<HttpResponse, WebError> {
    let query = web::Query::<ListQuery>::from_query(req.query_string())
        .map_err(|e| WebError::BadRequest(format!("bad query string: {e}")))?;
    // The same cap as the page's search box: a search text is a title fragment.
    if let Some(chars) = query.q.as_deref().map(|q| q.chars().count()) {
        if chars > TITLE_LIMIT {
            return Err(WebError::BadRequest(format!(
                "`q`: the search text has {chars} characters; the limit is {TITLE_LIMIT}"
            )));
        }
    }
    let conversations = state
        .platform
        .store
        .list_conversations(owner.as_str(), query.q.as_deref())
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "conversations": conversations })))
}

/// `GET /api/conversations/{id}`
pub async fn get(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    let conversation = owned(&state, &path, &owner).await?;
    let messages = state.platform.store.messages(conversation.id).await?;
    let replying = match state.platform.sessions.get(conversation.id) {
        Some(session) => session.send(GetInfo).await.is_ok_and(|i| i.replying),
        None => false,
    };
    Ok(HttpResponse::Ok().json(ConversationDetail {
        conversation,
        messages,
        replying,
        context_window: state.platform.model.context_window,
    }))
}

/// `PATCH /api/conversations/{id}`: title and/or settings (used from the next message on).
pub async fn patch(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
    body: JsonBody<ConversationInput>,
) -> Result<HttpResponse, WebError> {
    let conversation = owned(&state, &path, &owner).await?;
    let input = body.0;
    let store = &state.platform.store;
    let title = input.title.as_deref().map(clean_title).transpose()?;
    let changes_settings = input.system_prompt.is_some()
        || input.thinking.is_some()
        || input.temperature.is_some()
        || input.top_p.is_some()
        || input.top_k.is_some()
        || input.max_tokens.is_some()
        || input.seed.is_some()
        || input.ignore_eos.is_some();
    // Validate everything before writing anything.
    let settings = if changes_settings {
        let s = apply_settings(
            &state.platform.config,
            &input,
            conversation.settings.clone(),
        )?;
        check_system_prompt_fits(&state.platform, &s)?;
        Some(s)
    } else {
        None
    };
    let found = match &title {
        Some(t) => store.rename_conversation(conversation.id, t).await?,
        None => true,
    } && match &settings {
        Some(s) => store.update_settings(conversation.id, s).await?,
        None => true,
    };
    if !found {
        return Err(WebError::conversation_not_found());
    }
    let updated = store
        .get_conversation(conversation.id)
        .await?
        .ok_or_else(WebError::conversation_not_found)?;
    Ok(HttpResponse::Ok().json(updated))
}

/// `DELETE /api/conversations/{id}`: stops its session (and reply), deletes the conversation and
/// frees its KV cache.
pub async fn delete(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    let conversation = owned(&state, &path, &owner).await?;
    let id = conversation.id;
    if let Some(session) = state.platform.sessions.get(id) {
        // The session may already be stopping; then there is nothing to shut down.
        let _ = session.send(Shutdown).await;
    }
    if !state.platform.store.delete_conversation(id).await? {
        return Err(WebError::conversation_not_found());
    }
    // The worker drops the cache now, or as soon as a cancelled reply releases it.
    let _ = state.platform.scheduler.send(Evict(id.to_string())).await;
    tracing::info!(conversation = %id, "conversation deleted");
    Ok(HttpResponse::NoContent().finish())
}

/// `POST /api/conversations/{id}/messages`: stores the message and queues the reply; 202 once
/// both happened. The reply streams on `/api/conversations/{id}/events`.
pub async fn send_message(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
    body: JsonBody<NewMessage>,
) -> Result<HttpResponse, WebError> {
    let conversation = owned(&state, &path, &owner).await?;
    let session = state.platform.sessions.get_or_start(conversation.id);
    let accepted = session.send(SendMessage::new(body.0.content)).await??;
    tracing::debug!(conversation = %conversation.id, message = %accepted.user_message.id, "message accepted");
    Ok(HttpResponse::Accepted().json(json!({
        "user_message": accepted.user_message,
        "assistant_message_id": accepted.assistant_message_id,
        "events": format!("/api/conversations/{}/events", conversation.id),
    })))
}

/// `POST /api/conversations/{id}/stop`: stops the running reply (it is stored as `stopped`).
pub async fn stop(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    let conversation = owned(&state, &path, &owner).await?;
    let stopped = match state.platform.sessions.get(conversation.id) {
        Some(session) => session.send(Stop).await?,
        None => false,
    };
    Ok(HttpResponse::Ok().json(json!({ "stopped": stopped })))
}
