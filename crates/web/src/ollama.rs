//! The Ollama API on the server's own port, for the desktop apps, editor plugins and scripts
//! that speak it: `POST /api/chat` and `POST /api/generate` (NDJSON streams by default, one
//! object with `"stream": false`), `GET /api/tags`, `POST /api/show`, `GET /api/version` and
//! `GET /api/ps`.
//!
//! A request is read as Ollama's own types and becomes the one typed request ([`body`],
//! checked by `openai::request`), then generated through `v1::submit`: its values get the same
//! settings check, the same limits, fair sharing and API keys as `/v1`. Only the shapes differ:
//! Ollama's option names (`num_predict`, `repeat_penalty`, `repeat_last_n`, …), its answers
//! (`message`/`response`, `done`, durations in nanoseconds) and its errors (`{"error": "…"}`).
//! What this server cannot honour (images, `format`, custom templates, a `suffix`, mirostat) is
//! refused with a message that says so, never silently ignored; options that only tune how
//! Ollama itself loads and runs a model (`num_ctx`, `num_gpu`, `num_thread`, …) are accepted
//! and have no effect, since this server's model is loaded once with its own configuration.

use std::collections::VecDeque;
use std::time::Instant;

use actix_web::http::{header, StatusCode};
use actix_web::middleware::from_fn;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde_json::{json, Map, Value};

mod body;

use body::{ChatIn, CommonIn, EmbedIn, EmbeddingsIn, Extras, GenerateIn, ModelIn};

use super::embeddings::Input;
use super::json::JsonBody;
use super::openai::body::{ChatBody, CompletionBody, GenerationBody, MessageBody, Prompt};
use super::openai::{self, request, Assembler, ChatAssembler, TextAssembler};
use super::typed::{self, Strings};
use super::v1;
use super::v1::stream::{EventStream, Render};
use super::{AppState, WebError};
use crate::error::reshape;
use crate::error::ApiError;
use smolchat_service::completions::{GenSummary, StopReason};
use smolchat_service::models::{LoadState, ModelStatus, ServedModel};
use smolchat_service::platform::Platform;
use std::sync::Arc;

/// The Ollama API version this server answers as (`/api/version`): the release whose request
/// and answer shapes these routes follow (`think`, `thinking`, `tool_calls` as objects).
pub const OLLAMA_API_VERSION: &str = "0.9.0";

/// Registers the routes (before the `/api` scope of the browser's JSON API, which would
/// otherwise take these paths).
pub fn routes(cfg: &mut web::ServiceConfig) {
    let resource = |path: &str| {
        web::resource(path)
            .wrap(from_fn(v1::require_api_key))
            // Outside the key check, so its refusals come in Ollama's shape too.
            .wrap(from_fn(reshape::reshape::<Ollama>))
            .wrap(super::api_headers())
            .default_service(web::to(reshape::method_not_allowed::<Ollama>))
    };
    cfg.service(resource("/api/chat").route(web::post().to(chat)))
        .service(resource("/api/generate").route(web::post().to(generate)))
        .service(
            resource("/api/tags")
                .route(web::get().to(tags))
                .route(web::head().to(tags)),
        )
        .service(resource("/api/show").route(web::post().to(show)))
        .service(resource("/api/embed").route(web::post().to(embed)))
        .service(resource("/api/embeddings").route(web::post().to(embeddings)))
        .service(
            resource("/api/version")
                .route(web::get().to(version))
                .route(web::head().to(version)),
        )
        .service(resource("/api/ps").route(web::get().to(ps)));
}

/// Ollama's error shape: `{"error": "…"}`, the message alone.
pub struct Ollama;

impl reshape::ErrorShape for Ollama {
    fn body(_: StatusCode, message: &str, _: &str) -> Value {
        json!({ "error": message })
    }
}

/// A refusal in Ollama's shape, decided by the one [`ApiError`].
pub type OllamaError = reshape::Shaped<Ollama>;

/// The name a model is listed under: its id with Ollama's `:latest` tag.
fn listed_name(id: &str) -> String {
    if id.contains(':') {
        id.to_string()
    } else {
        format!("{id}:latest")
    }
}

/// The model an Ollama request's `model` names: as listed (`id:latest`), or any name `/v1`
/// accepts (`Models::find`); a missing or empty name is the default model (as on `/v1`).
fn find_model(p: &Platform, name: &str) -> Result<String, OllamaError> {
    let models = p.models();
    models
        .find(name)
        .or_else(|e| {
            name.strip_suffix(":latest")
                .filter(|n| !n.is_empty())
                .map_or(Err(e), |n| models.find(n))
        })
        .map_err(|e| v1::model_error(e).into())
}

/// The model an Ollama request names, loaded when it is not (the request waits).
async fn check_model(p: &Platform, name: &str) -> Result<Arc<ServedModel>, OllamaError> {
    let id = find_model(p, name)?;
    p.models()
        .load(&id)
        .await
        .map_err(|e| v1::model_error(e).into())
}

/// The configured model `name` means, loaded or not (for `/api/show`).
fn status_of(p: &Platform, name: &str) -> Result<ModelStatus, OllamaError> {
    let id = find_model(p, name)?;
    p.models()
        .list()
        .into_iter()
        .find(|m| m.id == id)
        .ok_or_else(|| ApiError::model_not_found(name, &id).into())
}

/// RFC 3339 with Ollama's nanosecond precision.
fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

/// The quantization of most of the file's matrices, as Ollama's `details` names it.
fn quantization(m: &ModelStatus) -> String {
    let stem = std::path::Path::new(&m.path)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    // GGUF files name it last (`…-Instruct.Q4_1`); nothing is guessed when they do not.
    stem.rsplit(['.', '-'])
        .next()
        .filter(|q| {
            let q = q.to_ascii_uppercase();
            q.starts_with('Q') || q.starts_with("F16") || q.starts_with("BF16")
        })
        .map(str::to_ascii_uppercase)
        .unwrap_or_default()
}

fn details(m: &ModelStatus) -> Value {
    // The architecture is known once the file is loaded.
    let arch = m
        .info
        .as_ref()
        .map_or_else(String::new, |i| i.architecture.clone());
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch],
        "parameter_size": "",
        "quantization_level": quantization(m),
    })
}

/// A stable stand-in for Ollama's blob digest: the model's id, path and file size, hashed.
fn digest(m: &ModelStatus) -> String {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(format!("{}\n{}\n{}", m.id, m.path, file_size(m)));
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

fn modified_at(m: &ModelStatus) -> String {
    std::fs::metadata(&m.path)
        .and_then(|m| m.modified())
        .map(|t| {
            chrono::DateTime::<chrono::Utc>::from(t)
                .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
        })
        .unwrap_or_else(|_| now_rfc3339())
}

fn file_size(m: &ModelStatus) -> u64 {
    std::fs::metadata(&m.path).map_or(m.memory_bytes, |f| f.len())
}

/// Every configured model, loaded or not (the default one first).
async fn tags(state: web::Data<AppState>) -> HttpResponse {
    let mut listed = state.platform.models().list();
    listed.sort_by_key(|m| !m.default);
    let models: Vec<Value> = listed
        .iter()
        .map(|m| {
            let name = listed_name(&m.id);
            json!({
                "name": name,
                "model": name,
                "modified_at": modified_at(m),
                "size": file_size(m),
                "digest": digest(m),
                "details": details(m),
            })
        })
        .collect();
    HttpResponse::Ok().json(json!({ "models": models }))
}

/// The models loaded now, with when each would be unloaded if left idle.
async fn ps(state: web::Data<AppState>) -> HttpResponse {
    let models: Vec<Value> = state
        .platform
        .models()
        .list()
        .iter()
        .filter(|m| m.state == LoadState::Loaded)
        .map(|m| {
            let name = listed_name(&m.id);
            let on_gpu = m
                .info
                .as_ref()
                .is_some_and(|i| i.device.starts_with("cuda"));
            // Kept until unloaded (the main model, a negative keep-alive): Ollama's far-future
            // date.
            let expires_at = match m.keep_alive {
                Some(keep) => (chrono::Utc::now()
                    + chrono::Duration::from_std(keep).unwrap_or_default()
                    - chrono::Duration::milliseconds((m.idle_s.unwrap_or(0.0) * 1e3) as i64))
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                None => "2318-11-25T00:00:00Z".to_string(),
            };
            json!({
                "name": name,
                "model": name,
                "size": m.memory_bytes,
                "digest": digest(m),
                "details": details(m),
                "expires_at": expires_at,
                "size_vram": if on_gpu { m.memory_bytes } else { 0 },
                "context_length": m.info.as_ref().map_or(0, |i| i.context_window),
            })
        })
        .collect();
    HttpResponse::Ok().json(json!({ "models": models }))
}

async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "version": OLLAMA_API_VERSION,
        "smolchat": env!("CARGO_PKG_VERSION"),
    }))
}

async fn show(
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, OllamaError> {
    let JsonBody(body) = body?;
    let p = &state.platform;
    let body: ModelIn = typed::read(&body, "")?;
    let status = status_of(p, body.name())?;
    // What `show` tells (the template, the context) is the loaded file's: loaded to answer.
    let served = check_model(p, body.name()).await?;
    let m = served.info();
    let s = &p.config().sampling;
    let arch = &m.architecture;
    let mut capabilities = vec!["completion", "embedding"];
    let source = served.template().source();
    if source.contains("tools") {
        capabilities.push("tools");
    }
    if source.contains("enable_thinking") || source.contains("<think>") {
        capabilities.push("thinking");
    }
    Ok(HttpResponse::Ok().json(json!({
        "modelfile": format!("# Served by smolchat {}\nFROM {}\n", env!("CARGO_PKG_VERSION"), m.id),
        "parameters": format!("temperature {}\ntop_p {}\ntop_k {}", s.temperature, s.top_p, s.top_k),
        "template": source,
        "details": details(&status),
        "model_info": {
            "general.architecture": arch,
            format!("{arch}.context_length"): m.context_window,
            format!("{arch}.vocab_size"): m.vocab_size,
            format!("{arch}.embedding_length"): m.hidden_size,
        },
        "capabilities": capabilities,
        "modified_at": modified_at(&status),
    })))
}

/// `POST /api/embed`: `input` as a string or an array of strings, cut to the context window
/// unless `"truncate": false`; the vectors are L2-normalized, as Ollama's are.
async fn embed(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, OllamaError> {
    let start = Instant::now();
    let JsonBody(body) = body?;
    let p = &state.platform;
    let body: EmbedIn = typed::read(&body, "")?;
    let name = body.model_name().to_string();
    let served = check_model(p, &name).await?;
    crate::embeddings::check_dimensions(body.dimensions, served.info().hidden_size, "dimensions")?;
    let inputs = body
        .input
        .map(|Strings(texts)| texts.into_iter().map(Input::Text).collect());
    let inputs = crate::embeddings::checked_inputs(inputs, "input")?;
    let result = crate::embeddings::embed(
        &state,
        &http,
        &served,
        inputs,
        smolchat_service::completions::Pooling::Mean,
        body.truncate.unwrap_or(true),
        "input",
    )
    .await?;
    Ok(HttpResponse::Ok().json(json!({
        "model": if name.is_empty() { listed_name(served.id()) } else { name },
        "embeddings": result.vectors,
        "total_duration": start.elapsed().as_nanos() as u64,
        "load_duration": 0,
        "prompt_eval_count": result.prompt_tokens,
    })))
}

/// `POST /api/embeddings`, Ollama's older form: one `prompt`, one `embedding` (normalized here
/// too: this server has one kind of embedding).
async fn embeddings(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, OllamaError> {
    let JsonBody(body) = body?;
    let p = &state.platform;
    let body: EmbeddingsIn = typed::read(&body, "")?;
    let served = check_model(p, body.model_name()).await?;
    let Some(prompt) = body.prompt else {
        return Err(OllamaError::invalid("prompt", "`prompt` is required"));
    };
    let result = crate::embeddings::embed(
        &state,
        &http,
        &served,
        vec![crate::embeddings::Input::Text(prompt)],
        smolchat_service::completions::Pooling::Mean,
        true,
        "prompt",
    )
    .await?;
    let vector = result.vectors.into_iter().next().unwrap_or_default();
    Ok(HttpResponse::Ok().json(json!({ "embedding": vector })))
}

/// An Ollama chat request through the one pipeline every chat-shaped API takes
/// ([`v1::checked_chat`]: the one set of checks, the model and admin-only checks, a grammar
/// named after Ollama's `format`), then what it does not know of Ollama's options applied.
/// The model is checked by Ollama's own names (`smollm2:latest`, the listed name) and echoed as
/// the client wrote it.
async fn checked_chat(
    state: &web::Data<AppState>,
    http: &HttpRequest,
    model: Option<String>,
    mut generation: GenerationBody,
    mut chat: ChatBody,
    extras: &Extras,
) -> Result<(request::ChatRequest, Arc<ServedModel>), OllamaError> {
    // Ollama's own names (`smollm2:latest`) become the model's id for the one pipeline.
    let id = find_model(&state.platform, model.as_deref().unwrap_or(""))?;
    generation.model = Some(id);
    if let Some(think) = extras.think {
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(think));
        chat.chat_template_kwargs = Some(kwargs);
    }
    let (mut req, served) = v1::checked_chat(state, http, generation, chat, Some("format")).await?;
    req.common.model = model;
    apply_extras(&mut req.common, extras)?;
    Ok((req, served))
}

fn apply_extras(
    common: &mut request::GenerationOptions,
    extras: &Extras,
) -> Result<(), OllamaError> {
    if common.grammar_field.is_some() {
        common.grammar_field = Some("format".into());
    }
    if let Some(n) = extras.repeat_last_n {
        common.params.penalty_last_n = if n < 0 { usize::MAX } else { n as usize };
        smolchat_service::settings::check_sampling(&common.params)
            .map_err(ApiError::from_settings)?;
    }
    Ok(())
}

async fn chat(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, OllamaError> {
    let JsonBody(body) = body?;
    let common: CommonIn = typed::read(&body, "")?;
    let model = common.model.clone();
    let (generation, extras) = body::generation(common)?;
    let chat_in: ChatIn = typed::read(&body, "")?;
    let chat = ChatBody {
        messages: Some(chat_in.messages()?),
        tools: chat_in.tools,
        ..ChatBody::default()
    };
    let (req, served) = checked_chat(&state, &http, model, generation, chat, &extras).await?;
    generate_chat(http, state, served, req, AnswerShape::Chat).await
}

/// Which answer shape a chat-templated generation takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AnswerShape {
    /// `/api/chat`: `message: {role, content, thinking, tool_calls}`.
    Chat,
    /// `/api/generate`: `response` and `thinking`.
    Generate,
}

async fn generate_chat(
    http: HttpRequest,
    state: web::Data<AppState>,
    served: Arc<ServedModel>,
    req: request::ChatRequest,
    shape: AnswerShape,
) -> Result<HttpResponse, OllamaError> {
    let parse_tool_calls = req.parse_tool_calls();
    let prompt = v1::build_chat_prompt(&state, &http, &served, &req).await?;
    let assembler = Reply::Chat(ChatAssembler::new(
        prompt.starts_in_reasoning,
        parse_tool_calls,
    ));
    run(
        http,
        state,
        &served,
        req.common,
        prompt.tokens,
        "messages",
        assembler,
        shape,
    )
    .await
}

async fn generate(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, OllamaError> {
    let JsonBody(body) = body?;
    let p = &state.platform;
    let common: CommonIn = typed::read(&body, "")?;
    let model = common.model.clone().unwrap_or_default();
    // Loaded first when it is not (an empty prompt is Ollama's way to load a model).
    let served = check_model(p, &model).await?;
    let own: GenerateIn = typed::read(&body, "")?;
    own.check_supported()?;
    let prompt = own.prompt.unwrap_or_default();
    let system = own.system.unwrap_or_default();
    let (generation, extras) = body::generation(common)?;
    if prompt.is_empty() {
        // Ollama's way to load a model: answered once it is loaded.
        return Ok(HttpResponse::Ok().json(json!({
            "model": model, "created_at": now_rfc3339(), "response": "",
            "done": true, "done_reason": "load",
        })));
    }
    if own.raw == Some(true) {
        if !system.is_empty() {
            return Err(OllamaError::invalid(
                "system",
                "`system` has no place in a `raw` prompt; write it into the prompt",
            ));
        }
        let completion = CompletionBody {
            prompt: Some(Prompt::Text(prompt.clone())),
            ..CompletionBody::default()
        };
        let mut req = request::completion_request(
            generation,
            completion,
            &v1::defaults(p, Some(served.id())),
        )?;
        req.common.model = Some(model);
        apply_extras(&mut req.common, &extras)?;
        v1::check_admin_only(&state, &http, &req.common)?;
        let m = Arc::clone(&served);
        let tokens = web::block(move || v1::encode(&m, &prompt))
            .await
            .map_err(|e| ApiError::internal(format!("prompt task: {e}")))??;
        return run(
            http,
            state,
            &served,
            req.common,
            tokens,
            "prompt",
            Reply::Text(TextAssembler::new()),
            AnswerShape::Generate,
        )
        .await;
    }
    let mut messages = Vec::new();
    if !system.is_empty() {
        messages.push(MessageBody::text("system", system));
    }
    messages.push(MessageBody::text("user", prompt));
    let chat = ChatBody {
        messages: Some(messages),
        ..ChatBody::default()
    };
    let (req, served) = checked_chat(&state, &http, Some(model), generation, chat, &extras).await?;
    generate_chat(http, state, served, req, AnswerShape::Generate).await
}

/// How the generated text is split: chat (reasoning, answer, tool calls) or raw text.
enum Reply {
    Chat(ChatAssembler),
    Text(TextAssembler),
}

/// What one piece of the reply adds, in Ollama's terms.
#[derive(Default)]
struct Piece {
    content: String,
    thinking: String,
    tool_calls: Vec<Value>,
}

impl Reply {
    /// Feeds `text` (or, with `None`, the end) and returns what it adds.
    fn feed(&mut self, text: Option<&str>, reason: Option<&StopReason>) -> Piece {
        let mut piece = Piece::default();
        match self {
            Reply::Chat(a) => {
                let calls_before = a.calls().len();
                let choices = match (text, reason) {
                    (Some(t), _) => a.push(t),
                    (None, Some(r)) => a.finish(r),
                    (None, None) => Vec::new(),
                };
                for c in choices {
                    let d = &c["delta"];
                    if let Some(t) = d["content"].as_str() {
                        piece.content.push_str(t);
                    }
                    if let Some(t) = d["reasoning_content"].as_str() {
                        piece.thinking.push_str(t);
                    }
                }
                piece.tool_calls = a.calls()[calls_before..].iter().map(call_object).collect();
            }
            Reply::Text(a) => {
                let choices = match (text, reason) {
                    (Some(t), _) => a.push(t),
                    (None, Some(r)) => a.finish(r),
                    (None, None) => Vec::new(),
                };
                for c in choices {
                    if let Some(t) = c["text"].as_str() {
                        piece.content.push_str(t);
                    }
                }
            }
        }
        piece
    }

    /// The whole reply, for an answer that is not streamed.
    fn whole(&self) -> Piece {
        match self {
            Reply::Chat(a) => Piece {
                content: a.content().to_string(),
                thinking: a.reasoning().to_string(),
                tool_calls: a.calls().iter().map(call_object).collect(),
            },
            Reply::Text(a) => Piece {
                content: a.choice()["text"].as_str().unwrap_or("").to_string(),
                ..Piece::default()
            },
        }
    }
}

/// A tool call as Ollama writes it: the arguments as an object.
fn call_object(c: &openai::CallOut) -> Value {
    let arguments: Value =
        serde_json::from_str(&c.arguments).unwrap_or_else(|_| Value::String(c.arguments.clone()));
    json!({"function": {"name": c.name, "arguments": arguments}})
}

/// One line (or the whole answer) in `shape`: the piece, and when `done`, the end's fields.
fn line(shape: AnswerShape, model: &str, piece: &Piece, done: Option<(&GenSummary, u64)>) -> Value {
    let mut v = json!({"model": model, "created_at": now_rfc3339()});
    match shape {
        AnswerShape::Chat => {
            let mut message = json!({"role": "assistant", "content": piece.content});
            if !piece.thinking.is_empty() {
                message["thinking"] = json!(piece.thinking);
            }
            if !piece.tool_calls.is_empty() {
                message["tool_calls"] = json!(piece.tool_calls);
            }
            v["message"] = message;
        }
        AnswerShape::Generate => {
            v["response"] = json!(piece.content);
            if !piece.thinking.is_empty() {
                v["thinking"] = json!(piece.thinking);
            }
        }
    }
    match done {
        None => v["done"] = json!(false),
        Some((s, total_ns)) => {
            let ms = |x: f64| (x * 1e6).max(0.0) as u64;
            v["done"] = json!(true);
            v["done_reason"] = json!(match s.reason {
                StopReason::Length | StopReason::TimeLimit => "length",
                _ => "stop",
            });
            v["total_duration"] = json!(total_ns);
            v["load_duration"] = json!(0);
            v["prompt_eval_count"] = json!(s.prompt_tokens);
            v["prompt_eval_duration"] = json!(ms(s.prefill_ms));
            v["eval_count"] = json!(s.completion_tokens);
            v["eval_duration"] = json!(ms(s.generation_ms));
        }
    }
    v
}

/// Submits through the one completions path and answers in Ollama's shape.
#[allow(clippy::too_many_arguments)]
async fn run(
    http: HttpRequest,
    state: web::Data<AppState>,
    served: &Arc<ServedModel>,
    common: request::GenerationOptions,
    prompt: Vec<u32>,
    prompt_param: &str,
    mut reply: Reply,
    shape: AnswerShape,
) -> Result<HttpResponse, OllamaError> {
    let model = listed_name(served.id());
    let stream = common.stream;
    let salt = v1::cache_salt(&http, &common);
    let user = v1::api_user(&http);
    let started = Instant::now();
    let completion = v1::submit(&state, served, common, salt, user, prompt, prompt_param).await?;
    if stream {
        return Ok(HttpResponse::Ok()
            .content_type("application/x-ndjson")
            .insert_header((header::CACHE_CONTROL, "no-cache"))
            .insert_header(("X-Accel-Buffering", "no"))
            .streaming(EventStream::new(
                completion,
                LineRender {
                    reply,
                    shape,
                    model,
                    started,
                },
                Vec::new(),
            )));
    }
    let summary = v1::collect(completion, |text, _| {
        if !text.is_empty() {
            reply.feed(Some(text), None);
        }
    })
    .await?;
    reply.feed(None, Some(&summary.reason));
    let total = started.elapsed().as_nanos() as u64;
    Ok(HttpResponse::Ok().json(line(shape, &model, &reply.whole(), Some((&summary, total)))))
}

/// The streamed answer's lines: one JSON object a line, the last with `"done": true`.
struct LineRender {
    reply: Reply,
    shape: AnswerShape,
    model: String,
    started: Instant,
}

fn push_line(out: &mut VecDeque<Bytes>, v: &Value) {
    out.push_back(Bytes::from(format!("{v}\n")));
}

impl LineRender {
    /// A line for `piece`, unless it is empty.
    fn piece(&self, piece: &Piece, out: &mut VecDeque<Bytes>) {
        if !(piece.content.is_empty() && piece.thinking.is_empty() && piece.tool_calls.is_empty()) {
            push_line(out, &line(self.shape, &self.model, piece, None));
        }
    }
}

impl Render for LineRender {
    type Item = Bytes;

    fn text(&mut self, text: &str, out: &mut VecDeque<Bytes>) {
        let piece = self.reply.feed(Some(text), None);
        self.piece(&piece, out);
    }

    fn finished(&mut self, summary: &GenSummary, out: &mut VecDeque<Bytes>) {
        let piece = self.reply.feed(None, Some(&summary.reason));
        self.piece(&piece, out);
        let total = self.started.elapsed().as_nanos() as u64;
        let last = line(
            self.shape,
            &self.model,
            &Piece::default(),
            Some((summary, total)),
        );
        push_line(out, &last);
    }

    fn failed(&mut self, error: &ApiError, out: &mut VecDeque<Bytes>) {
        push_line(out, &json!({ "error": error.message }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_line_carries_the_counts() {
        let s = GenSummary {
            reason: StopReason::Length,
            prompt_tokens: 7,
            cached_tokens: 0,
            completion_tokens: 3,
            queue_ms: 0.0,
            prefill_ms: 2.0,
            ttft_ms: 2.5,
            generation_ms: 4.0,
            drafted_tokens: 0,
            accepted_tokens: 0,
            restored_tokens: 0,
            warmed_tokens: 0,
        };
        let v = line(
            AnswerShape::Chat,
            "m:latest",
            &Piece::default(),
            Some((&s, 9_000_000)),
        );
        assert_eq!(v["done"], json!(true));
        assert_eq!(v["done_reason"], json!("length"));
        assert_eq!(v["prompt_eval_count"], json!(7));
        assert_eq!(v["eval_count"], json!(3));
        assert_eq!(v["eval_duration"], json!(4_000_000));
        assert_eq!(v["message"]["role"], json!("assistant"));
        let g = line(
            AnswerShape::Generate,
            "m",
            &Piece {
                content: "hi".into(),
                thinking: "t".into(),
                tool_calls: Vec::new(),
            },
            None,
        );
        assert_eq!(
            (
                g["response"].clone(),
                g["thinking"].clone(),
                g["done"].clone()
            ),
            (json!("hi"), json!("t"), json!(false))
        );
    }
}
