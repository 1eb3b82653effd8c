//! OpenAI's Responses API (`POST /v1/responses`), which newer SDKs and coding agents use.
//!
//! A request is read as its own types and becomes the one typed chat request ([`body`],
//! checked by `openai::request`): `instructions`, `input` as text or items (messages with text parts,
//! `function_call` and `function_call_output` items), function `tools`, `tool_choice`,
//! `text.format` (JSON Schema / JSON object, by constrained decoding), sampling and
//! `max_output_tokens` get the same checks, limits and fair sharing as `/v1/chat/completions`,
//! and generate through `v1::submit`. The answer is a `response` whose `output` holds a
//! `reasoning` item (the thinking split), a `message` with `output_text`, and `function_call`
//! items; streamed, it is the Responses event sequence (`response.created`, `…output_item.added`,
//! `…output_text.delta`, …, `response.completed`).
//!
//! Stored responses: unless `"store": false`, a response of a caller with a lasting identity
//! (a personal API key: its account; `server.api_key`: the owner `api:server-key`) is stored as
//! a conversation of that owner (the earlier turns, this request's input, the reply), through
//! the conversations service, before its last event is sent. Its id is `resp_` and the
//! conversation's UUID. `previous_response_id` continues one (its turns go between the new
//! `instructions` and `input`; the old instructions are not carried, as in OpenAI's API), into
//! a new conversation; `GET`/`DELETE /v1/responses/{id}` read and delete one. A reply's tool
//! calls are stored as the model wrote them and read back by the one splitter, with call ids
//! derived from the message id, so they are the same every time. Anonymous callers store
//! nothing (`"store": false` in the answer), and another owner's response is a 404 like a
//! missing one.

use std::collections::VecDeque;

use actix_web::web::{self};
use actix_web::{HttpRequest, HttpResponse};
use serde_json::{json, Map, Value};

mod body;

use super::json::JsonBody;
use super::openai::body::{CallBody, Content, MessageBody};
use super::openai::{self, Assembler, CallOut, ChatAssembler};
use super::v1;
use super::v1::stream::{EventStream, Finishing, Render};
use super::{AppState, WebError};
use crate::error::ApiError;
use actix_web_lab::sse;
use smolchat_service::completions::{GenSummary, StopReason};
use smolchat_service::records::{ImportedMessage, Message, MessageStatus, Role, StoredRow};
use smolchat_service::{Caller, ConversationError};
use uuid::Uuid;

/// Registers `/v1/responses` (before the `/v1` scope, which would take the path) behind the
/// same key check and headers as `/v1`; its errors are OpenAI's.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/v1/responses")
            .wrap(actix_web::middleware::from_fn(v1::require_api_key))
            .wrap(super::api_headers())
            .route(web::post().to(create))
            .default_service(web::to(openai::method_not_allowed)),
    )
    .service(
        web::resource("/v1/responses/{id}")
            .wrap(actix_web::middleware::from_fn(v1::require_api_key))
            .wrap(super::api_headers())
            .route(web::get().to(retrieve))
            .route(web::delete().to(delete))
            .default_service(web::to(openai::method_not_allowed)),
    );
}

/// A response's id: `resp_` and its conversation's UUID as 32 hex digits.
fn response_id(conversation: Uuid) -> String {
    format!("resp_{}", conversation.simple())
}

fn parse_response_id(id: &str) -> Option<Uuid> {
    id.strip_prefix("resp_")
        .filter(|hex| hex.len() == 32)
        .and_then(|hex| Uuid::parse_str(hex).ok())
}

/// The stored response `id` names, for the caller: 400 when it is no response id, 404 when
/// the caller has no such response (or stores none).
async fn stored(
    state: &web::Data<AppState>,
    http: &HttpRequest,
    id: &str,
    field: &str,
) -> Result<(Caller, Uuid, Vec<Message>), ApiError> {
    let uuid = parse_response_id(id).ok_or_else(|| {
        ApiError::invalid(
            field,
            format!("`{id}` is not a response id (`resp_` and 32 hex digits)"),
        )
    })?;
    let not_found = || ApiError::not_found(format!("there is no stored response `{id}`"));
    let Some(owner) = v1::api_owner(http) else {
        return Err(if field == "previous_response_id" {
            ApiError::invalid(
                field,
                "responses are stored only for callers with an API key (a personal key or \
                 server.api_key); send the earlier turns in `input`",
            )
        } else {
            not_found()
        });
    };
    match state.platform.conversations().response(&owner, uuid).await {
        Ok((_, messages)) => Ok((owner, uuid, messages)),
        Err(ConversationError::NotFound) => Err(not_found()),
        Err(e) => Err(ApiError::from(WebError::from(e))),
    }
}

/// The id of a stored message's `k`-th tool call: the same whenever the message is read.
fn call_id(message: Uuid, k: usize) -> String {
    format!("call_{}_{k}", message.simple())
}

/// A stored conversation as chat messages: assistant messages with the tool calls their raw
/// text holds (ids from [`call_id`]), tool results answering those calls in order.
fn history_messages(messages: &[Message]) -> Vec<MessageBody> {
    let mut out = Vec::with_capacity(messages.len());
    let mut open_calls: VecDeque<String> = VecDeque::new();
    for m in messages {
        match m.role {
            Role::System => out.push(MessageBody::text("system", m.content.as_str())),
            Role::User => out.push(MessageBody::text("user", m.content.as_str())),
            Role::Tool => out.push(MessageBody {
                tool_call_id: open_calls.pop_front(),
                ..MessageBody::text("tool", m.content.as_str())
            }),
            Role::Assistant => {
                let calls = stored_calls(m);
                open_calls = calls.iter().map(|c| c.id.clone()).collect();
                let calls: Vec<CallBody> = calls
                    .into_iter()
                    .map(|c| CallBody::new(Some(c.id), &c.name, c.arguments))
                    .collect();
                out.push(MessageBody {
                    tool_calls: (!calls.is_empty()).then_some(calls),
                    ..MessageBody::text("assistant", m.content.as_str())
                });
            }
        }
    }
    out
}

/// The tool calls a stored assistant message's raw text holds, parsed by the one splitter.
fn stored_calls(m: &Message) -> Vec<CallOut> {
    let Some(raw) = m.raw.as_deref() else {
        return Vec::new();
    };
    let mut a = ChatAssembler::new(false, true);
    a.push(raw);
    a.finish(&StopReason::EndOfGeneration);
    a.calls()
        .iter()
        .enumerate()
        .map(|(k, c)| CallOut {
            id: call_id(m.id, k),
            ..c.clone()
        })
        .collect()
}

/// A chat message of a request's input as a stored message (the client wrote it). An
/// assistant message's calls go into its raw text as the model's markup, so the one splitter
/// reads them back.
fn input_message(m: &MessageBody) -> ImportedMessage {
    let role = match m.role.as_deref() {
        Some("system") => Role::System,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        _ => Role::User,
    };
    let content = match &m.content {
        Some(Content::Text(s)) => s.clone(),
        _ => String::new(),
    };
    let raw = m.tool_calls.as_ref().map(|calls| {
        let mut raw = content.clone();
        for c in calls {
            let function = c.function.clone().unwrap_or_default();
            let arguments = function
                .arguments
                .and_then(|a| serde_json::from_str::<Value>(&a.0).ok())
                .unwrap_or_else(|| json!({}));
            raw.push_str(&format!(
                "{}{}{}",
                smolchat_text::splitter::TOOL_CALL_OPEN,
                json!({"name": function.name, "arguments": arguments}),
                smolchat_text::splitter::TOOL_CALL_CLOSE
            ));
        }
        raw
    });
    stored_message(role, content, None, raw)
}

fn stored_message(
    role: Role,
    content: String,
    reasoning: Option<String>,
    raw: Option<String>,
) -> ImportedMessage {
    ImportedMessage {
        role,
        content,
        reasoning,
        raw,
        status: MessageStatus::Complete,
        error: None,
        prompt_tokens: None,
        completion_tokens: None,
        cached_tokens: None,
        timings: None,
        created_at: chrono::Utc::now(),
        files: Vec::new(),
    }
}

/// What storing a response needs besides its reply: whose, under which ids, and the turns
/// before the reply (earlier responses' and this request's input).
struct ResponseToStore {
    state: web::Data<AppState>,
    owner: Caller,
    conversation: Uuid,
    message: Uuid,
    turns: Vec<(ImportedMessage, bool)>,
}

impl ResponseToStore {
    /// Stores the response with its reply; a failure is logged (the answer has been given).
    async fn save(self, reply: ImportedMessage) {
        let flags: Vec<bool> = self.turns.iter().map(|(_, imported)| *imported).collect();
        let mut messages: Vec<ImportedMessage> = self.turns.into_iter().map(|(m, _)| m).collect();
        messages.push(reply);
        // One branch; the reply (last) is the model's, under the id it was answered with.
        let mut rows =
            StoredRow::linear(messages.len(), |i| flags.get(i).copied().unwrap_or(false));
        if let Some(last) = rows.last_mut() {
            last.id = self.message;
        }
        if let Err(e) = self
            .state
            .platform
            .conversations()
            .save_response(&self.owner, self.conversation, &messages, &rows)
            .await
        {
            tracing::warn!(response = %response_id(self.conversation), "the response could not be stored: {e}");
        }
    }
}

/// The reply as a stored message.
fn reply_message(a: &ChatAssembler, raw: &str, summary: &GenSummary) -> ImportedMessage {
    let count = |n: usize| Some(i64::try_from(n).unwrap_or(i64::MAX));
    ImportedMessage {
        status: match summary.reason {
            StopReason::Length | StopReason::TimeLimit => MessageStatus::Stopped,
            _ => MessageStatus::Complete,
        },
        prompt_tokens: count(summary.prompt_tokens),
        completion_tokens: count(summary.completion_tokens),
        cached_tokens: count(summary.cached_tokens),
        ..stored_message(
            Role::Assistant,
            a.content().to_string(),
            Some(a.reasoning().to_string()).filter(|r| !r.is_empty()),
            Some(raw.to_string()),
        )
    }
}

async fn create(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, ApiError> {
    let JsonBody(body) = body?;
    let mut translated = body::translate(&body)?;
    // Earlier turns of a stored response go after the instructions (which are not carried
    // over, as in OpenAI's API) and before this request's input.
    let history = match &translated.previous_response_id {
        None => None,
        Some(id) => Some(stored(&state, &http, id, "previous_response_id").await?),
    };
    let past = history
        .as_ref()
        .map(|(_, _, m)| history_messages(m))
        .unwrap_or_default();
    let instructions = usize::from(translated.has_instructions);
    if let Some(messages) = translated.chat.messages.as_mut() {
        messages.splice(instructions..instructions, past);
    }
    let (req, served) = v1::checked_chat(
        &state,
        &http,
        translated.generation,
        translated.chat,
        Some("text.format"),
    )
    .await?;
    // Stored unless `"store": false`, for callers with a lasting identity (an API key).
    let owner = v1::api_owner(&http).filter(|_| translated.store != Some(false));
    if let Some(owner) = &owner {
        state
            .platform
            .conversations()
            .check_response_room(owner)
            .await
            .map_err(|e| ApiError::from(WebError::from(e)))?;
    }
    let model = v1::model_name(&served, &req.common);
    let parse_tool_calls = req.parse_tool_calls();
    let prompt = v1::build_chat_prompt(&state, &http, &served, &req).await?;
    let assembler = ChatAssembler::new(prompt.starts_in_reasoning, parse_tool_calls);
    let stream = req.common.stream;
    let max_output_tokens = req.common.max_tokens;
    let salt = v1::cache_salt(&http, &req.common);
    let user = v1::api_user(&http);
    let completion = v1::submit(
        &state,
        &served,
        req.common,
        salt,
        user,
        prompt.tokens,
        "input",
    )
    .await?;
    let conversation = state.platform.conversations().new_response_id();
    let message = Uuid::now_v7();
    let keep = owner.map(|owner| {
        let mut turns: Vec<(ImportedMessage, bool)> = Vec::new();
        if let Some((_, _, earlier)) = &history {
            turns.extend(earlier.iter().map(|m| (copied(m), m.imported)));
        }
        turns.extend(translated.input.iter().map(|m| (input_message(m), true)));
        ResponseToStore {
            state: state.clone(),
            owner,
            conversation,
            message,
            turns,
        }
    });
    let mut echo = echo_fields(&body, max_output_tokens);
    echo.insert("store".into(), json!(keep.is_some()));
    echo.insert(
        "previous_response_id".into(),
        history
            .as_ref()
            .map_or(Value::Null, |(_, id, _)| json!(response_id(*id))),
    );
    let base = ResponseHeader {
        id: response_id(conversation),
        message,
        created_at: openai::unix_now(),
        model,
        echo,
    };
    if stream {
        let mut render = ResponseRender {
            assembler,
            base,
            sequence: 0,
            text: None,
            raw: String::new(),
            keep,
            reply: None,
        };
        let created = render.base.response("in_progress", Vec::new(), None);
        let mut first = VecDeque::new();
        render.event(&mut first, "response.created", json!({"response": created}));
        render.event(
            &mut first,
            "response.in_progress",
            json!({"response": created}),
        );
        let stream = EventStream::new(completion, render, first.into());
        return Ok(v1::stream::sse_response(&http, stream));
    }
    let mut assembler = assembler;
    let mut raw = String::new();
    let summary = v1::collect(completion, |text, _| {
        if !text.is_empty() {
            raw.push_str(text);
            assembler.push(text);
        }
    })
    .await?;
    assembler.finish(&summary.reason);
    // Stored before it is answered, so the client can chain on it at once.
    if let Some(keep) = keep {
        keep.save(reply_message(&assembler, &raw, &summary)).await;
    }
    let output = base.output(&assembler);
    Ok(HttpResponse::Ok().json(base.response(status(&summary), output, Some(&summary))))
}

/// A stored message copied into a new conversation (its reply's status and counts kept).
fn copied(m: &Message) -> ImportedMessage {
    ImportedMessage {
        role: m.role,
        content: m.content.clone(),
        reasoning: m.reasoning.clone(),
        raw: m.raw.clone(),
        status: m.status,
        error: m.error.clone(),
        prompt_tokens: m.prompt_tokens,
        completion_tokens: m.completion_tokens,
        cached_tokens: m.cached_tokens,
        timings: m.timings.clone(),
        created_at: m.created_at,
        files: Vec::new(),
    }
}

/// `GET /v1/responses/{id}`: a stored response of the caller, as it was answered.
async fn retrieve(
    http: HttpRequest,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let (_, conversation, messages) = stored(&state, &http, &id, "id").await?;
    let Some(reply) = messages.last() else {
        return Err(ApiError::not_found(format!(
            "there is no stored response `{id}`"
        )));
    };
    let base = ResponseHeader {
        id: response_id(conversation),
        message: reply.id,
        created_at: u64::try_from(reply.created_at.timestamp()).unwrap_or(0),
        model: state.platform.model().id.clone(),
        echo: {
            let mut echo = echo_fields(&json!({}), None);
            echo.insert("store".into(), json!(true));
            echo
        },
    };
    let mut output = Vec::new();
    if let Some(r) = reply.reasoning.as_deref().filter(|r| !r.is_empty()) {
        output.push(base.reasoning_item(r));
    }
    let calls = stored_calls(reply);
    if !reply.content.is_empty() || calls.is_empty() {
        output.push(base.message_item(&reply.content, "completed"));
    }
    output.extend(calls.iter().map(call_item));
    let incomplete = reply.status == MessageStatus::Stopped;
    let mut r = base.response(
        if incomplete {
            "incomplete"
        } else {
            "completed"
        },
        output,
        None,
    );
    let n = |v: Option<i64>| v.unwrap_or(0);
    r["usage"] = json!({
        "input_tokens": n(reply.prompt_tokens),
        "input_tokens_details": {"cached_tokens": n(reply.cached_tokens)},
        "output_tokens": n(reply.completion_tokens),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n(reply.prompt_tokens) + n(reply.completion_tokens),
    });
    Ok(HttpResponse::Ok().json(r))
}

/// `DELETE /v1/responses/{id}`: deletes a stored response (its conversation).
async fn delete(
    http: HttpRequest,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let (owner, conversation, _) = stored(&state, &http, &id, "id").await?;
    state
        .platform
        .conversations()
        .delete(&owner, conversation)
        .await
        .map_err(|e| ApiError::from(WebError::from(e)))?;
    Ok(HttpResponse::Ok().json(json!({
        "id": response_id(conversation), "object": "response.deleted", "deleted": true,
    })))
}

/// What a response repeats of its request.
fn echo_fields(body: &Value, max_output_tokens: Option<usize>) -> Map<String, Value> {
    let mut m = Map::new();
    for key in [
        "instructions",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "metadata",
        "text",
    ] {
        m.insert(key.into(), body.get(key).cloned().unwrap_or(Value::Null));
    }
    if m["tools"].is_null() {
        m["tools"] = json!([]);
    }
    if m["tool_choice"].is_null() {
        m["tool_choice"] = json!("auto");
    }
    if m["metadata"].is_null() {
        m["metadata"] = json!({});
    }
    m.insert("max_output_tokens".into(), json!(max_output_tokens));
    m.insert("parallel_tool_calls".into(), json!(true));
    m.insert("truncation".into(), json!("disabled"));
    m
}

fn status(s: &GenSummary) -> &'static str {
    match s.reason {
        StopReason::Length | StopReason::TimeLimit => "incomplete",
        _ => "completed",
    }
}

/// The fields every form of this response shares.
struct ResponseHeader {
    id: String,
    /// The reply's message id (stored under it).
    message: Uuid,
    created_at: u64,
    model: String,
    echo: Map<String, Value>,
}

impl ResponseHeader {
    fn response(&self, status: &str, output: Vec<Value>, summary: Option<&GenSummary>) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": null,
            "incomplete_details": if status == "incomplete" {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
            "usage": summary.map(|s| json!({
                "input_tokens": s.prompt_tokens,
                "input_tokens_details": {"cached_tokens": s.cached_tokens},
                "output_tokens": s.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": s.prompt_tokens + s.completion_tokens,
            })),
        });
        if let Some(o) = r.as_object_mut() {
            for (k, v) in &self.echo {
                o.insert(k.clone(), v.clone());
            }
        }
        r
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.message.simple())
    }

    fn reasoning_item(&self, text: &str) -> Value {
        json!({"type": "reasoning", "id": format!("rs_{}", self.message.simple()),
            "summary": [{"type": "summary_text", "text": text}]})
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        json!({"type": "message", "id": self.message_id(), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }

    /// The reply's calls, with ids that stay the same when it is read back ([`call_id`]).
    fn calls(&self, a: &ChatAssembler) -> Vec<Value> {
        a.calls()
            .iter()
            .enumerate()
            .map(|(k, c)| {
                call_item(&CallOut {
                    id: call_id(self.message, k),
                    ..c.clone()
                })
            })
            .collect()
    }

    fn output(&self, a: &ChatAssembler) -> Vec<Value> {
        let mut output = Vec::new();
        if !a.reasoning().is_empty() {
            output.push(self.reasoning_item(a.reasoning()));
        }
        if !a.content().is_empty() || a.calls().is_empty() {
            output.push(self.message_item(a.content(), "completed"));
        }
        output.extend(self.calls(a));
        output
    }
}

fn call_item(c: &CallOut) -> Value {
    json!({"type": "function_call", "id": c.id.replacen("call_", "fc_", 1), "call_id": c.id,
        "name": c.name, "arguments": c.arguments, "status": "completed"})
}

/// The streamed response's events: the Responses event sequence.
struct ResponseRender {
    assembler: ChatAssembler,
    base: ResponseHeader,
    sequence: u64,
    /// The output index of the open message item and its text so far.
    text: Option<(usize, String)>,
    /// Everything generated, as the model wrote it (stored with the reply).
    raw: String,
    /// Where the response is stored, when it is.
    keep: Option<ResponseToStore>,
    /// The reply to store, once it has ended.
    reply: Option<ImportedMessage>,
}

type Out = VecDeque<sse::Event>;

impl ResponseRender {
    fn event(&mut self, out: &mut Out, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.push_back(v1::stream::event(Some(kind), data));
    }

    /// Output items emitted so far (the reasoning item counts once it is whole).
    fn items_so_far(&self) -> usize {
        self.text.as_ref().map_or(0, |(i, _)| *i + 1)
    }

    fn open_message(&mut self, out: &mut Out) -> usize {
        if let Some((index, _)) = &self.text {
            return *index;
        }
        let index = usize::from(!self.assembler.reasoning().is_empty());
        let item = self.base.message_item("", "in_progress");
        self.event(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        self.event(
            out,
            "response.content_part.added",
            json!({"item_id": self.base.message_id(), "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
        );
        self.text = Some((index, String::new()));
        index
    }

    fn text_delta(&mut self, out: &mut Out, t: &str) {
        let index = self.open_message(out);
        if let Some((_, text)) = self.text.as_mut() {
            text.push_str(t);
        }
        self.event(
            out,
            "response.output_text.delta",
            json!({"item_id": self.base.message_id(), "output_index": index, "content_index": 0,
                "delta": t}),
        );
    }

    fn finish(&mut self, out: &mut Out, summary: &GenSummary) {
        let output = self.base.output(&self.assembler);
        // The reasoning item, whole (it is not streamed as deltas).
        if !self.assembler.reasoning().is_empty() {
            let item = self.base.reasoning_item(self.assembler.reasoning());
            self.event(
                out,
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            self.event(
                out,
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            );
        }
        if self.text.is_none() && self.assembler.calls().is_empty() {
            self.open_message(out);
        }
        if let Some((index, text)) = self.text.clone() {
            let id = self.base.message_id();
            self.event(
                out,
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            );
            self.event(
                out,
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []}}),
            );
            let item = self.base.message_item(&text, "completed");
            self.event(
                out,
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
        }
        let first_call = self
            .items_so_far()
            .max(usize::from(!self.assembler.reasoning().is_empty()));
        let calls: Vec<Value> = self.base.calls(&self.assembler);
        for (i, item) in calls.into_iter().enumerate() {
            let index = first_call + i;
            self.event(
                out,
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            self.event(
                out,
                "response.function_call_arguments.done",
                json!({"item_id": item["id"], "output_index": index,
                    "arguments": item["arguments"]}),
            );
            self.event(
                out,
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
        }
        let status = status(summary);
        let response = self.base.response(status, output, Some(summary));
        let kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        self.event(out, kind, json!({"response": response}));
        if self.keep.is_some() {
            self.reply = Some(reply_message(&self.assembler, &self.raw, summary));
        }
    }

    /// The answer's text the assembler's choices add.
    fn deltas(&mut self, out: &mut Out, choices: Vec<Value>) {
        for c in choices {
            if let Some(t) = c["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
                let t = t.to_string();
                self.text_delta(out, &t);
            }
        }
    }
}

impl Render for ResponseRender {
    type Item = sse::Event;

    fn text(&mut self, text: &str, out: &mut Out) {
        self.raw.push_str(text);
        let choices = self.assembler.push(text);
        self.deltas(out, choices);
    }

    fn finished(&mut self, summary: &GenSummary, out: &mut Out) {
        let choices = self.assembler.finish(&summary.reason);
        self.deltas(out, choices);
        self.finish(out, summary);
    }

    fn failed(&mut self, error: &ApiError, out: &mut Out) {
        self.event(
            out,
            "error",
            json!({"code": error.code, "message": error.message, "param": error.param}),
        );
    }

    /// The store's write, run before the last event goes out (so the client can chain on the
    /// response as soon as it has it).
    fn finishing(&mut self) -> Option<Finishing> {
        let (keep, reply) = (self.keep.take()?, self.reply.take()?);
        Some(Box::pin(keep.save(reply)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored reply's calls come back with the ids it was answered with, and the tool results
    /// after it answer them in order; the input's own calls are stored as the model's markup.
    #[test]
    fn stored_turns_read_back_as_chat_messages_with_stable_call_ids() {
        let input = body::translate(&json!({"input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\":\"Rome\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "c2", "output": "25 C"},
        ]}))
        .expect("input")
        .input;
        let stored: Vec<Message> = input
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let s = input_message(m);
                Message {
                    id: Uuid::from_u128(i as u128 + 1),
                    conversation_id: Uuid::nil(),
                    position: i as i64 + 1,
                    role: s.role,
                    content: s.content,
                    reasoning: s.reasoning,
                    raw: s.raw,
                    status: s.status,
                    error: None,
                    prompt_tokens: None,
                    completion_tokens: None,
                    cached_tokens: None,
                    timings: None,
                    created_at: s.created_at,
                    imported: true,
                    parent_id: None,
                }
            })
            .collect();
        let back = history_messages(&stored);
        assert_eq!(back.len(), 4, "{back:?}");
        assert_eq!(
            back[0],
            MessageBody::text("user", "Weather in Paris and Rome?")
        );
        let calls = back[1].tool_calls.clone().unwrap_or_default();
        assert_eq!(calls.len(), 2);
        let first = call_id(Uuid::from_u128(2), 0);
        assert_eq!(calls[0].id.as_deref(), Some(first.as_str()));
        let function = |k: usize| calls[k].function.clone().unwrap_or_default();
        assert_eq!(function(0).name.as_deref(), Some("weather"));
        let args: Value =
            serde_json::from_str(&function(1).arguments.unwrap_or_default().0).unwrap_or_default();
        assert_eq!(args, json!({"city": "Rome"}));
        assert_eq!(back[2].tool_call_id.as_deref(), Some(first.as_str()));
        assert_eq!(back[3].tool_call_id, Some(call_id(Uuid::from_u128(2), 1)));
        assert_eq!(back[3].content, Some(Content::Text("25 C".into())));
        assert_eq!(
            parse_response_id(&response_id(Uuid::from_u128(7))),
            Some(Uuid::from_u128(7))
        );
        assert_eq!(parse_response_id("resp_xyz"), None);
    }
}
