//! The OpenAI-compatible API under `/v1`, for programs that talk to smolchat the way they talk
//! to llama-server, vLLM or Ollama:
//!
//! | route | |
//! |---|---|
//! | `GET /v1/models`, `GET /v1/models/{id}` | the loaded model, with its context length |
//! | `POST /v1/chat/completions` | chat (stream or not), `reasoning_content`, `tools` → `tool_calls` |
//! | `POST /v1/completions` | raw prompt completion (stream or not) |
//! | `GET /v1/server_tools` | the tools this key may ask the server to run (`server_tools`, an extension: [`server_tools`]) |
//!
//! API requests are stateless: each one is rendered, tokenized and submitted straight to the
//! scheduler (no session actor, no cache key), so API and browser users are batched together.
//! Cached prefixes are reused only within one partition (the client's address, the key it
//! presents, its `user` and `cache_salt` fields): see [`crate::v1::cache_salt`].
//!
//! In chat requests the text of messages, tool schemas and `chat_template_kwargs` is always
//! tokenized as text: `<|im_end|>` inside a message is a few ordinary tokens, never the control
//! token (only the template's own markup is). A raw `/v1/completions` prompt is the client's own
//! markup, so special tokens written in it *are* parsed, as llama-server does.
//! When `server.api_key` is set, every `/v1` request needs `Authorization: Bearer <key>`: that
//! key or a user's personal key (`sk-smol-…`, made on `/account`). A personal key authenticates
//! as its account (refused at once when revoked or the account is disabled): the scheduler
//! shares fairly by account and the request's tokens are added to the account's usage.
//! Errors use OpenAI's shape (see [`error`]).
//!
//! Streams are `data: {chunk}` server-sent events ending with `data: [DONE]`. The request's event
//! receiver lives inside the response stream: a client that goes away drops the stream, which
//! cancels the request at once (and the closed channel would stop it at the next step anyway).

mod assemble;
pub mod body;
pub mod request;
mod server_tools;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use actix_web::middleware::from_fn;
use actix_web::web::{self};
use actix_web::{HttpRequest, HttpResponse};
use futures_util::Stream;
use serde_json::{json, Value};

use crate::error::ApiError;
pub use assemble::{Assembler, CallOut, ChatAssembler, TextAssembler};
use request::{GenerationOptions, PromptIn};

use super::json::JsonBody;
use super::typed;
use super::v1;
use super::v1::{
    api_user, build_chat_prompt, cache_salt, check_admin_only, check_model, checked_chat, defaults,
    encode, require_api_key, submit, ApiUser,
};
use super::{AppState, WebError};
use actix_web_lab::sse;
use smolchat_service::completions::Completion;
use smolchat_service::completions::GenSummary;
use smolchat_service::models::{ModelStatus, ServedModel};
use smolchat_text::sampling::TokenLogprobs;
use v1::stream::{EventStream, Render};

/// When the API started answering (`created` of the model object).
static STARTED: OnceLock<u64> = OnceLock::new();

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Registers the `/v1` routes (called from [`super::routes`]).
pub fn routes(cfg: &mut web::ServiceConfig, chat_limit: super::json::BodyLimit) {
    STARTED.get_or_init(unix_now);
    cfg.service(
        web::scope("/v1")
            .wrap(from_fn(require_api_key))
            .wrap(super::api_headers())
            .service(
                web::resource("/models")
                    .route(web::get().to(models))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/models/{id:.*}")
                    .route(web::get().to(model))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/chat/completions")
                    .app_data(chat_limit)
                    .route(web::post().to(chat_completions))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/completions")
                    .route(web::post().to(completions))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/server_tools")
                    .route(web::get().to(server_tools_offered))
                    .default_service(web::to(method_not_allowed)),
            )
            .default_service(web::to(not_found)),
    );
}

async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.path()
    )))
}

pub(crate) async fn method_not_allowed(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::method_not_allowed(format!(
        "{} is not allowed on {}",
        req.method(),
        req.path()
    )))
}

/// A model as `/v1/models` lists it under `id` (its own id, or one of its aliases, with
/// `alias_of` naming the model). What only loading tells (the context window, the
/// architecture) is there while it is loaded; `status` says whether it is (llama-server's
/// router mode says the same).
fn model_object(m: &ModelStatus, id: &str) -> Value {
    let mut object = json!({
        "id": id,
        "object": "model",
        "created": STARTED.get().copied().unwrap_or(0),
        "owned_by": "smolchat",
        // Anthropic's listing names the same model with these.
        "type": "model",
        "display_name": id,
        "created_at": chrono::DateTime::<chrono::Utc>::from_timestamp(
            STARTED.get().copied().unwrap_or(0) as i64,
            0,
        )
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "status": {"value": if m.state == smolchat_service::models::LoadState::Loaded { "loaded" } else { "unloaded" }},
    });
    if let Some(info) = &m.info {
        // vLLM's name and llama-server/LM Studio's name for the same number.
        object["max_model_len"] = json!(info.context_window);
        object["context_length"] = json!(info.context_window);
        object["meta"] = json!({
            "architecture": info.architecture,
            "vocab_size": info.vocab_size,
            "weight_bytes": info.weight_bytes,
        });
    }
    if id != m.id {
        object["alias_of"] = json!(m.id);
    }
    object
}

/// Every model (the default one first), each followed by the aliases an admin gave it
/// (clients that pick from the list see the names they send).
async fn models(state: web::Data<AppState>) -> HttpResponse {
    let mut listed = state.platform.models().list();
    listed.sort_by_key(|m| !m.default);
    let data: Vec<Value> = listed
        .iter()
        .flat_map(|m| {
            std::iter::once(&m.id)
                .chain(m.aliases.iter())
                .map(move |id| model_object(m, id))
        })
        .collect();
    let (first, last) = (
        data.first().map(|m| m["id"].clone()),
        data.last().map(|m| m["id"].clone()),
    );
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": data,
        // Anthropic's page fields: one page holds them all.
        "has_more": false,
        "first_id": first,
        "last_id": last,
    }))
}

async fn model(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    // Only the names `/v1/models` lists (ids and aliases): anything else is 404, so the route
    // answers nothing about names or paths beyond what the listing already says.
    let listed = state.platform.models().list();
    let found = listed
        .iter()
        .find(|m| m.id == *path || m.aliases.contains(&*path));
    match found {
        Some(m) => Ok(HttpResponse::Ok().json(model_object(m, &path))),
        None => Err(ApiError::model_not_found(
            &path,
            &listed
                .iter()
                .map(|m| format!("`{}`", m.id))
                .collect::<Vec<_>>()
                .join(", "),
        )),
    }
}

/// `GET /v1/server_tools` (an extension): the tools this key may ask the server to run
/// (`server_tools` in a chat request), in OpenAI's function shape; none when `tools.api` is off
/// or the caller has no key.
async fn server_tools_offered(http: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    let caller = v1::api_owner(&http);
    let data: Vec<Value> = state
        .platform
        .conversations()
        .api_tool_specs(caller.as_ref())
        .iter()
        .map(|s| s.to_openai())
        .collect();
    HttpResponse::Ok().json(json!({"object": "list", "data": data}))
}

async fn chat_completions(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, ApiError> {
    let JsonBody(body) = body?;
    let chat: body::ChatBody = typed::read(&body, "")?;
    let ask = request::knowledge(chat.knowledge.as_ref())?;
    let (mut req, served) =
        checked_chat(&state, &http, typed::read(&body, "")?, chat, None).await?;
    // The body limit here leaves room for a file; a request without one keeps the limit of
    // every other JSON body.
    let text_limit = super::json_limit(state.platform.config().limits.max_message_chars);
    let declared = http
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > text_limit) && req.messages.iter().all(|m| m.files.is_empty()) {
        return Err(WebError::PayloadTooLarge(format!(
            "the request body is larger than {text_limit} bytes (more is allowed only for \
             `file` content parts)"
        ))
        .into());
    }
    let sources = match ask {
        Some(ask) => Some(with_knowledge(&state, &http, &mut req, ask).await?),
        None => None,
    };
    if req.server_tools.is_some() {
        let (salt, user) = (cache_salt(&http, &req.common), api_user(&http));
        return server_tools::answer(http, state, served, req, salt, user, sources).await;
    }
    let parse_tool_calls = req.parse_tool_calls();
    let prompt = build_chat_prompt(&state, &http, &served, &req).await?;
    // Sizes only: prompts are users' words and do not belong in logs.
    tracing::debug!(
        bytes = prompt.text.len(),
        tokens = prompt.tokens.len(),
        "chat completion prompt"
    );
    let starts_in_reasoning = prompt.starts_in_reasoning;
    let prompt = prompt.tokens;
    let salt = cache_salt(&http, &req.common);
    let user = api_user(&http);
    generate(
        &http,
        state,
        &served,
        req.common,
        salt,
        user,
        prompt,
        "messages",
        sources,
        || ChatAssembler::new(starts_in_reasoning, parse_tool_calls),
    )
    .await
}

/// `knowledge` (an extension): the passages of the named collections that best answer the last
/// user message go before it, numbered for citing (the chat's one format,
/// `knowledge::with_passages`); what they were, for the answer's `sources`. Collections are
/// accounts': a caller without a key has none, and another account's is not found.
async fn with_knowledge(
    state: &AppState,
    http: &HttpRequest,
    req: &mut request::ChatRequest,
    ask: request::KnowledgeAsk,
) -> Result<Value, ApiError> {
    use smolchat_service::knowledge::{self, KnowledgeError, SearchMode};
    let Some(caller) = v1::api_owner(http) else {
        return Err(ApiError::forbidden(
            "knowledge",
            "collections belong to accounts: send the request with an API key",
        ));
    };
    let Some(at) = req.messages.iter().rposition(|m| m.role == "user") else {
        return Err(ApiError::invalid(
            "knowledge",
            "`knowledge` searches for the last user message, and there is none",
        ));
    };
    let passages = state
        .platform
        .knowledge()
        .search(
            &caller,
            &ask.collections,
            &req.messages[at].content,
            ask.k,
            SearchMode::Hybrid,
        )
        .await
        .map_err(|e| match e {
            KnowledgeError::NotFound(m) => ApiError::not_found(m),
            KnowledgeError::Invalid { field, message } => {
                ApiError::invalid(format!("knowledge.{field}"), message)
            }
            KnowledgeError::Forbidden(m) => ApiError::forbidden("knowledge", m),
            other => ApiError::from(WebError::from(other)),
        })?;
    let m = &mut req.messages[at];
    m.content = knowledge::with_passages(&passages, &m.content);
    Ok(json!(knowledge::sources_of(&passages)))
}

async fn completions(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, ApiError> {
    let JsonBody(body) = body?;
    let p = &state.platform;
    let mut req = request::parse_completion(&body, &defaults(p, body["model"].as_str()))?;
    check_admin_only(&state, &http, &req.common)?;
    let served = check_model(p, &req.common).await?;
    let prompt = match &req.prompt {
        PromptIn::Text(text) => {
            let m = Arc::clone(&served);
            let text = text.clone();
            web::block(move || encode(&m, &text))
                .await
                .map_err(|e| ApiError::internal(format!("prompt task: {e}")))??
        }
        PromptIn::Tokens(ids) => {
            let vocab = served.info().vocab_size;
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            ids.clone()
        }
    };
    req.common.max_tokens = req
        .common
        .max_tokens
        .or(Some(request::COMPLETION_DEFAULT_MAX_TOKENS));
    let salt = cache_salt(&http, &req.common);
    let user = api_user(&http);
    generate(
        &http,
        state,
        &served,
        req.common,
        salt,
        user,
        prompt,
        "prompt",
        None,
        TextAssembler::new,
    )
    .await
}

/// Metadata every response and chunk carries.
#[derive(Clone)]
struct Envelope {
    id: String,
    created: u64,
    model: String,
}

impl Envelope {
    fn new(prefix: &str, model: &str) -> Self {
        Self {
            id: format!("{prefix}-{}", uuid::Uuid::now_v7().simple()),
            created: unix_now(),
            model: model.to_string(),
        }
    }

    fn wrap(&self, object: &str, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// Checks the prompt against the context window, submits it and answers (streamed or whole).
#[allow(clippy::too_many_arguments)]
async fn generate<A: Assembler>(
    http: &HttpRequest,
    state: web::Data<AppState>,
    served: &Arc<ServedModel>,
    common: GenerationOptions,
    cache_salt: String,
    user: ApiUser,
    prompt: Vec<u32>,
    prompt_param: &str,
    sources: Option<Value>,
    assembler: impl Fn() -> A,
) -> Result<HttpResponse, ApiError> {
    let prompt_tokens = prompt.len();
    // `n` choices are `n` requests of the same prompt (choice `i` seeded with `seed + i`); if one
    // is refused, those already submitted are cancelled as they drop.
    let mut completions = Vec::with_capacity(common.n);
    for i in 0..common.n {
        let mut choice = common.clone();
        choice.params.seed = common.params.seed.map(|s| s.wrapping_add(i as u64));
        completions.push(
            submit(
                &state,
                served,
                choice,
                cache_salt.clone(),
                user.clone(),
                prompt.clone(),
                prompt_param,
            )
            .await?,
        );
    }
    let envelope = Envelope::new(
        if A::OBJECT == "text_completion" {
            "cmpl"
        } else {
            "chatcmpl"
        },
        served.id(),
    );
    tracing::debug!(
        requests = ?completions.iter().map(Completion::id).collect::<Vec<_>>(),
        prompt_tokens,
        stream = common.stream,
        "API request submitted"
    );

    if common.stream {
        let streams = completions
            .into_iter()
            .enumerate()
            .map(|(index, completion)| {
                let mut assembler = assembler();
                let mut opening = assembler.start();
                for c in &mut opening {
                    c["index"] = json!(index);
                }
                let first = (!opening.is_empty()).then(|| {
                    let mut chunk = envelope.wrap(A::CHUNK_OBJECT, opening);
                    // The passages the reply was given (`knowledge`), once, with the first chunk.
                    if let Some(s) = sources.as_ref().filter(|_| index == 0) {
                        chunk["sources"] = s.clone();
                    }
                    sse(&chunk, common.include_usage)
                });
                let render = ChoiceRender {
                    logprobs: LogprobsOut::new(&state, A::OBJECT == "chat.completion"),
                    assembler,
                    envelope: envelope.clone(),
                    include_usage: common.include_usage,
                    index,
                    summary: None,
                };
                EventStream::new(completion, render, first.into_iter().collect())
            })
            .collect();
        return Ok(v1::stream::sse_response(
            http,
            Choices {
                streams,
                envelope,
                include_usage: common.include_usage,
                finished: false,
                tail: VecDeque::new(),
            },
        ));
    }

    let results = futures_util::future::join_all(completions.into_iter().enumerate().map(
        |(index, completion)| {
            let mut logprobs = LogprobsOut::new(&state, A::OBJECT == "chat.completion");
            let assembler = assembler();
            async move {
                let mut assembler = assembler;
                let summary = v1::collect(completion, |text, lp| {
                    if let Some(lp) = lp {
                        logprobs.push(lp);
                    }
                    if !text.is_empty() {
                        assembler.push(text);
                    }
                })
                .await?;
                assembler.finish(&summary.reason);
                let mut choice = assembler.choice();
                choice["index"] = json!(index);
                if let Some(lp) = logprobs.take() {
                    choice["logprobs"] = lp;
                }
                Ok::<_, ApiError>((choice, summary))
            }
        },
    ))
    .await
    .into_iter()
    .collect::<Result<Vec<_>, _>>()?;
    let summaries: Vec<GenSummary> = results.iter().map(|(_, s)| s.clone()).collect();
    let choices = results.into_iter().map(|(c, _)| c).collect();
    let mut body = envelope.wrap(A::OBJECT, choices);
    body["usage"] = usage_of(&summaries);
    if let Some(s) = sources {
        body["sources"] = s;
    }
    Ok(HttpResponse::Ok().json(body))
}

/// Usage over the choices of one request: the prompt once, every choice's completion.
fn usage_of(summaries: &[GenSummary]) -> Value {
    let Some(first) = summaries.first() else {
        return Value::Null;
    };
    let completion: usize = summaries.iter().map(|s| s.completion_tokens).sum();
    json!({
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    })
}

/// Usage over the rounds of one reply (`server_tools`): every round's prompt and completion
/// counted, as each was processed.
fn usage_of_rounds(rounds: &[GenSummary]) -> Value {
    let prompt: usize = rounds.iter().map(|s| s.prompt_tokens).sum();
    let completion: usize = rounds.iter().map(|s| s.completion_tokens).sum();
    let cached: usize = rounds.iter().map(|s| s.cached_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// One `data:` event. With `include_usage`, every chunk has `"usage": null` as OpenAI's do.
fn sse(chunk: &Value, include_usage: bool) -> sse::Event {
    let mut chunk = chunk.clone();
    if include_usage {
        chunk["usage"] = Value::Null;
    }
    v1::stream::event(None, chunk)
}

/// The last event of every OpenAI stream.
const DONE: &str = "[DONE]";

/// The streamed response: owns the request's receiver and its cancel guard (see module docs).
/// A reply's token log-probabilities in the endpoint's shape (chat: `logprobs.content`; text
/// completions: the legacy parallel arrays), gathered as tokens arrive and handed out with the
/// chunk that carries their text.
struct LogprobsOut {
    state: web::Data<AppState>,
    chat: bool,
    pending: Vec<TokenLogprobs>,
    /// Text completions: bytes of the reply before the pending tokens (`text_offset`).
    offset: usize,
    /// Whether any token had them (the request asked).
    wanted: bool,
}

impl LogprobsOut {
    fn new(state: &web::Data<AppState>, chat: bool) -> Self {
        Self {
            state: state.clone(),
            chat,
            pending: Vec::new(),
            offset: 0,
            wanted: false,
        }
    }

    fn push(&mut self, lp: TokenLogprobs) {
        self.wanted = true;
        self.pending.push(lp);
    }

    /// The pending tokens' entry for a choice, or `None` when none were asked for.
    fn take(&mut self) -> Option<Value> {
        if !self.wanted {
            return None;
        }
        let tokenizer = self.state.platform.tokenizer();
        let piece = |id: u32| {
            let bytes = tokenizer.token_bytes(id);
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        let pending = std::mem::take(&mut self.pending);
        if self.chat {
            let content: Vec<Value> = pending
                .iter()
                .map(|lp| {
                    let (token, bytes) = piece(lp.token);
                    let top: Vec<Value> = lp
                        .top
                        .iter()
                        .map(|&(id, l)| {
                            let (token, bytes) = piece(id);
                            json!({"token": token, "logprob": l, "bytes": bytes})
                        })
                        .collect();
                    json!({"token": token, "logprob": lp.logprob, "bytes": bytes,
                        "top_logprobs": top})
                })
                .collect();
            return Some(json!({"content": content, "refusal": null}));
        }
        let (mut tokens, mut token_logprobs, mut top_logprobs, mut text_offset) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for lp in &pending {
            let (token, bytes) = piece(lp.token);
            tokens.push(json!(token));
            token_logprobs.push(json!(lp.logprob));
            let top: serde_json::Map<String, Value> = lp
                .top
                .iter()
                .map(|&(id, l)| (piece(id).0, json!(l)))
                .collect();
            top_logprobs.push(Value::Object(top));
            text_offset.push(json!(self.offset));
            self.offset += bytes.len();
        }
        Some(json!({"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": text_offset}))
    }
}

/// One choice's chunks.
struct ChoiceRender<A: Assembler> {
    /// Log-probabilities waiting for the chunk that carries their tokens' text.
    logprobs: LogprobsOut,
    assembler: A,
    envelope: Envelope,
    include_usage: bool,
    /// Its choice's `index` (a request with `n` choices streams them interleaved).
    index: usize,
    /// How it ended, for the request's usage chunk.
    summary: Option<GenSummary>,
}

impl<A: Assembler> ChoiceRender<A> {
    fn chunks(&mut self, mut choices: Vec<Value>, out: &mut VecDeque<sse::Event>) {
        if let Some(first) = choices.first_mut() {
            if let Some(lp) = self.logprobs.take() {
                first["logprobs"] = lp;
            }
        }
        for mut choice in choices {
            choice["index"] = json!(self.index);
            let chunk = self.envelope.wrap(A::CHUNK_OBJECT, vec![choice]);
            out.push_back(sse(&chunk, self.include_usage));
        }
    }
}

impl<A: Assembler> Render for ChoiceRender<A> {
    type Item = sse::Event;

    fn text(&mut self, text: &str, out: &mut VecDeque<sse::Event>) {
        let choices = self.assembler.push(text);
        self.chunks(choices, out);
    }

    fn logprobs(&mut self, logprobs: TokenLogprobs) {
        self.logprobs.push(logprobs);
    }

    fn finished(&mut self, summary: &GenSummary, out: &mut VecDeque<sse::Event>) {
        let choices = self.assembler.finish(&summary.reason);
        self.chunks(choices, out);
        self.summary = Some(summary.clone());
    }

    fn failed(&mut self, error: &ApiError, out: &mut VecDeque<sse::Event>) {
        out.push_back(v1::stream::event(None, error.body()));
    }
}

/// A request's streamed choices, interleaved as their chunks come, then the usage chunk (when
/// asked) and `[DONE]` once all have ended.
struct Choices<A: Assembler> {
    streams: Vec<EventStream<ChoiceRender<A>>>,
    envelope: Envelope,
    include_usage: bool,
    finished: bool,
    /// The usage chunk and `[DONE]`, once every choice has ended.
    tail: VecDeque<sse::Event>,
}

impl<A: Assembler> Stream for Choices<A> {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(this.tail.pop_front().map(Ok));
        }
        let mut pending = false;
        for s in &mut this.streams {
            match Pin::new(&mut *s).poll_next(cx) {
                Poll::Ready(Some(item)) => return Poll::Ready(Some(item)),
                Poll::Ready(None) => {}
                Poll::Pending => pending = true,
            }
        }
        if pending {
            return Poll::Pending;
        }
        // Every choice has ended.
        this.finished = true;
        if this.include_usage {
            let summaries: Vec<GenSummary> = this
                .streams
                .iter()
                .filter_map(|s| s.render().summary.clone())
                .collect();
            let mut last = this.envelope.wrap(A::CHUNK_OBJECT, Vec::new());
            last["usage"] = usage_of(&summaries);
            this.tail.push_back(v1::stream::event(None, last));
        }
        this.tail.push_back(v1::stream::event(None, DONE));
        Poll::Ready(this.tail.pop_front().map(Ok))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::chat_render_input;
    use request::Defaults;
    use serde_json::json;
    use smolchat_text::guard::TextGuard;
    use smolchat_text::template::prompt_ends_in_open_think;
    use smolchat_text::template::ChatTemplate;

    fn render(body: Value) -> String {
        let template = ChatTemplate::smollm3_default().unwrap();
        let defaults = Defaults {
            temperature: 0.6,
            top_p: 0.95,
            top_k: 20,
        };
        let req = request::parse_chat(&body, &defaults).unwrap();
        let date = chrono::NaiveDate::from_ymd_opt(2025, 7, 8).unwrap();
        let (messages, opts) = chat_render_input(&template, &req, date);
        template
            .render_prompt(&messages, &opts, &TextGuard::default())
            .unwrap()
            .text()
            .to_string()
    }

    fn weather_tool() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}})
    }

    #[test]
    fn tools_reach_the_smollm3_template() {
        let user = json!([{"role": "user", "content": "Weather in Paris?"}]);
        let text = render(json!({"messages": user, "tools": [weather_tool()]}));
        assert!(text.contains("<tools>"), "{text}");
        // Each tool as Python's json.dumps writes it, keys in the client's order.
        assert!(
            text.contains(
                "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \
                 \"description\": \"Current weather\", \"parameters\": {\"type\": \"object\", \
                 \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}"
            ),
            "{text}"
        );
        // tool_choice "none": the template gets no tools.
        let text =
            render(json!({"messages": user, "tools": [weather_tool()], "tool_choice": "none"}));
        assert!(!text.contains("get_weather"), "{text}");
    }

    #[test]
    fn tool_history_and_results_reach_the_template() {
        let text = render(json!({"tools": [weather_tool()], "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
        ]}));
        assert!(
            text.contains(
                "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \
                 \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>"
            ),
            "{text}"
        );
        // SmolLM3 shows tool results as a user turn.
        assert!(
            text.contains("<|im_start|>user\n18 C and sunny<|im_end|>"),
            "{text}"
        );
    }

    #[test]
    fn thinking_switches_reach_the_template() {
        let user = json!({"role": "user", "content": "Hi"});
        let text = render(json!({"messages": [user]}));
        assert!(text.contains("Reasoning Mode: /think"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        assert!(!prompt_ends_in_open_think(&text));
        let off =
            render(json!({"messages": [user], "chat_template_kwargs": {"enable_thinking": false}}));
        assert!(off.contains("Reasoning Mode: /no_think"), "{off}");
        assert!(off.ends_with("<think>\n\n</think>\n"), "{off}");
        let system = render(json!({"messages": [
            {"role": "system", "content": "Be brief. /no_think"}, user]}));
        assert!(system.contains("Reasoning Mode: /no_think"), "{system}");
        assert!(system.contains("Be brief."), "{system}");
    }
}
