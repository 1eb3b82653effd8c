//! OpenAI's Responses API (`POST /v1/responses`), which newer SDKs and coding agents use.
//!
//! A request is translated into the chat request shape and parsed by the one parser
//! (`openai::request`): `instructions`, `input` as text or items (messages with text parts,
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
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::web::{self};
use actix_web::{HttpRequest, HttpResponse};
use futures_util::Stream;
use serde_json::{json, Map, Value};

use super::json::JsonBody;
use super::openai::{self, Assembler, CallOut, ChatAssembler};
use super::v1;
use super::{AppState, WebError};
use crate::error::ApiError;
use actix_web_lab::sse;
use smolchat_service::completions::{Completion, GenEvent, GenSummary, StopReason};
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
fn history_messages(messages: &[Message]) -> Vec<Value> {
    let mut out = Vec::with_capacity(messages.len());
    let mut open_calls: VecDeque<String> = VecDeque::new();
    for m in messages {
        match m.role {
            Role::System => out.push(json!({"role": "system", "content": m.content})),
            Role::User => out.push(json!({"role": "user", "content": m.content})),
            Role::Tool => {
                let mut msg = json!({"role": "tool", "content": m.content});
                if let Some(id) = open_calls.pop_front() {
                    msg["tool_call_id"] = json!(id);
                }
                out.push(msg);
            }
            Role::Assistant => {
                let calls = stored_calls(m);
                open_calls = calls.iter().map(|c| c.id.clone()).collect();
                let mut msg = json!({"role": "assistant", "content": m.content});
                if !calls.is_empty() {
                    msg["tool_calls"] = calls
                        .iter()
                        .map(|c| {
                            json!({"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}})
                        })
                        .collect();
                }
                out.push(msg);
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
fn input_message(m: &Value) -> ImportedMessage {
    let role = match m["role"].as_str() {
        Some("system") => Role::System,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        _ => Role::User,
    };
    let content = m["content"].as_str().unwrap_or_default().to_string();
    let raw = m["tool_calls"].as_array().map(|calls| {
        let mut raw = content.clone();
        for c in calls {
            let arguments = c["function"]["arguments"]
                .as_str()
                .and_then(|a| serde_json::from_str::<Value>(a).ok())
                .unwrap_or_else(|| json!({}));
            raw.push_str(&format!(
                "{}{}{}",
                smolchat_text::splitter::TOOL_CALL_OPEN,
                json!({"name": c["function"]["name"], "arguments": arguments}),
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

fn text_of(content: &Value, field: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(t);
                    }
                    (Some(kind @ ("input_image" | "input_file" | "input_audio")), _) => {
                        return Err(ApiError::invalid(
                            format!("{field}[{i}]"),
                            format!(
                                "{kind} parts are not supported: the served model reads text only"
                            ),
                        ))
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{field}[{i}]"),
                            "a content part must be {\"type\": \"input_text\", \"text\": …}",
                        ))
                    }
                }
            }
            Ok(text)
        }
        other => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a string or an array of text parts, got {other}"),
        )),
    }
}

/// `input` as chat messages.
fn translate_input(input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    match input {
        None => Err(ApiError::invalid("input", "`input` is required")),
        Some(Value::String(s)) => Ok(vec![json!({"role": "user", "content": s})]),
        Some(Value::Array(items)) => {
            let mut out: Vec<Value> = Vec::new();
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let kind = item["type"].as_str().unwrap_or("message");
                match kind {
                    "message" => {
                        let role = match item["role"].as_str() {
                            Some("developer") => "system",
                            Some(r @ ("user" | "assistant" | "system")) => r,
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("{at}.role"),
                                    "`role` must be user, assistant, system or developer",
                                ))
                            }
                        };
                        let content = text_of(&item["content"], &format!("{at}.content"))?;
                        out.push(json!({"role": role, "content": content}));
                    }
                    "function_call" => {
                        let (Some(call_id), Some(name)) =
                            (item["call_id"].as_str(), item["name"].as_str())
                        else {
                            return Err(ApiError::invalid(
                                &at,
                                "a function_call item needs `call_id` and `name`",
                            ));
                        };
                        let call = json!({"id": call_id, "type": "function", "function": {
                            "name": name,
                            "arguments": item["arguments"].as_str().unwrap_or("{}"),
                        }});
                        // Calls of one turn join the assistant message before them.
                        match out.last_mut() {
                            Some(last) if last["role"] == "assistant" => {
                                if !last["tool_calls"].is_array() {
                                    last["tool_calls"] = json!([]);
                                }
                                if let Some(calls) = last["tool_calls"].as_array_mut() {
                                    calls.push(call);
                                }
                            }
                            _ => out.push(
                                json!({"role": "assistant", "content": "", "tool_calls": [call]}),
                            ),
                        }
                    }
                    "function_call_output" => {
                        let Some(call_id) = item["call_id"].as_str() else {
                            return Err(ApiError::invalid(
                                &at,
                                "a function_call_output item needs `call_id`",
                            ));
                        };
                        let output = match &item["output"] {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        out.push(
                            json!({"role": "tool", "tool_call_id": call_id, "content": output}),
                        );
                    }
                    // A past reply's reasoning is not replayed.
                    "reasoning" => {}
                    other => {
                        return Err(ApiError::invalid(
                            &at,
                            format!("input items of type `{other}` are not supported"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(other) => Err(ApiError::invalid(
            "input",
            format!("`input` must be a string or an array of items, got {other}"),
        )),
    }
}

/// The request in the chat shape.
fn translate(body: &Value) -> Result<Value, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_body("the request body must be a JSON object"));
    };
    let mut out = Map::new();
    for (key, value) in obj {
        match key.as_str() {
            "model" | "stream" | "temperature" | "top_p" | "user" | "seed" | "top_logprobs" => {
                out.insert(key.clone(), value.clone());
            }
            "max_output_tokens" => {
                out.insert("max_tokens".into(), value.clone());
            }
            // Read by `create`.
            "instructions"
            | "input"
            | "tools"
            | "tool_choice"
            | "text"
            | "reasoning"
            | "previous_response_id" => {}
            "store" if !value.is_null() && !value.is_boolean() => {
                return Err(ApiError::invalid("store", "`store` must be true or false"))
            }
            "conversation" if !value.is_null() => {
                return Err(ApiError::invalid(
                    key,
                    "`conversation` objects are not supported; chain responses with \
                     `previous_response_id`",
                ))
            }
            // Accepted without effect: one tier, no truncation, no background runs.
            "store"
            | "metadata"
            | "parallel_tool_calls"
            | "truncation"
            | "service_tier"
            | "include"
            | "background"
            | "conversation"
            | "prompt_cache_key"
            | "safety_identifier" => {}
            other => return Err(ApiError::invalid(other, format!("unknown field `{other}`"))),
        }
    }
    let mut messages = Vec::new();
    if let Some(instructions) = obj.get("instructions").filter(|v| !v.is_null()) {
        messages.push(json!({"role": "system", "content": text_of(instructions, "instructions")?}));
    }
    messages.extend(translate_input(obj.get("input"))?);
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = obj.get("tools").and_then(Value::as_array) {
        let mut chat_tools = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            if t["type"].as_str() != Some("function") {
                return Err(ApiError::invalid(
                    format!("tools[{i}].type"),
                    "only function tools are supported",
                ));
            }
            chat_tools.push(json!({"type": "function", "function": {
                "name": t["name"], "description": t["description"],
                "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"})),
            }}));
        }
        out.insert("tools".into(), Value::Array(chat_tools));
    }
    match obj.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            out.insert("tool_choice".into(), json!(s));
        }
        Some(c) if c["type"] == "function" => {
            out.insert(
                "tool_choice".into(),
                json!({"type": "function", "function": {"name": c["name"]}}),
            );
        }
        Some(_) => return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` must be auto, none, required or {\"type\": \"function\", \"name\": …}",
        )),
    }
    if let Some(format) = obj
        .get("text")
        .map(|t| &t["format"])
        .filter(|f| !f.is_null())
    {
        match format["type"].as_str() {
            Some("text") => {}
            Some("json_object") => {
                out.insert("response_format".into(), json!({"type": "json_object"}));
            }
            Some("json_schema") => {
                out.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": {
                        "name": format["name"], "schema": format["schema"], "strict": format["strict"],
                    }}),
                );
            }
            _ => {
                return Err(ApiError::invalid(
                    "text.format",
                    "`text.format.type` must be text, json_object or json_schema",
                ))
            }
        }
    }
    if let Some(effort) = obj
        .get("reasoning")
        .map(|r| &r["effort"])
        .filter(|e| !e.is_null())
    {
        // No reasoning effort levels here: any effort turns thinking on, "minimal" off.
        let think = effort.as_str() != Some("minimal") && effort.as_str() != Some("none");
        out.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": think}),
        );
    }
    Ok(Value::Object(out))
}

async fn create(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, ApiError> {
    let JsonBody(body) = body?;
    let mut translated = translate(&body)?;
    // Earlier turns of a stored response go after the instructions (which are not carried
    // over, as in OpenAI's API) and before this request's input.
    let history = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(stored(&state, &http, id, "previous_response_id").await?),
        Some(_) => {
            return Err(ApiError::invalid(
                "previous_response_id",
                "`previous_response_id` must be a string",
            ))
        }
    };
    let past = history
        .as_ref()
        .map(|(_, _, m)| history_messages(m))
        .unwrap_or_default();
    let instructions = usize::from(body.get("instructions").is_some_and(|v| !v.is_null()));
    if let Some(messages) = translated["messages"].as_array_mut() {
        messages.splice(instructions..instructions, past);
    }
    let req = v1::checked_chat(&state, &http, &translated, Some("text.format"))?;
    // Stored unless `"store": false`, for callers with a lasting identity (an API key).
    let owner = v1::api_owner(&http).filter(|_| body["store"].as_bool() != Some(false));
    if let Some(owner) = &owner {
        state
            .platform
            .conversations()
            .check_response_room(owner)
            .await
            .map_err(|e| ApiError::from(WebError::from(e)))?;
    }
    let model = v1::model_name(&state.platform, &req.common);
    let parse_tool_calls = req.parse_tool_calls();
    let prompt = v1::build_chat_prompt(&state, &http, &req).await?;
    let assembler = ChatAssembler::new(prompt.starts_in_reasoning, parse_tool_calls);
    let stream = req.common.stream;
    let max_output_tokens = req.common.max_tokens;
    let salt = v1::cache_salt(&http, &req.common);
    let user = v1::api_user(&http);
    let completion = v1::submit(&state, req.common, salt, user, prompt.tokens, "input").await?;
    let conversation = state.platform.conversations().new_response_id();
    let message = Uuid::now_v7();
    let keep = owner.map(|owner| {
        let mut turns: Vec<(ImportedMessage, bool)> = Vec::new();
        if let Some((_, _, earlier)) = &history {
            turns.extend(earlier.iter().map(|m| (copied(m), m.imported)));
        }
        let input = translate_input(body.get("input")).unwrap_or_default();
        turns.extend(input.iter().map(|m| (input_message(m), true)));
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
        let mut s = ResponseStream {
            completion,
            assembler,
            base,
            out: VecDeque::new(),
            sequence: 0,
            text: None,
            done: false,
            raw: String::new(),
            keep,
            saving: None,
            last: None,
        };
        let created = s.base.response("in_progress", Vec::new(), None);
        s.event("response.created", json!({"response": created}));
        s.event("response.in_progress", json!({"response": created}));
        return Ok(v1::stream::sse_response(&http, s));
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

/// The streamed response: the Responses event sequence. Dropping it (the client went away)
/// cancels the request through its [`Completion`].
struct ResponseStream {
    completion: Completion,
    assembler: ChatAssembler,
    base: ResponseHeader,
    out: VecDeque<sse::Event>,
    sequence: u64,
    /// The output index of the open message item and its text so far.
    text: Option<(usize, String)>,
    done: bool,
    /// Everything generated, as the model wrote it (stored with the reply).
    raw: String,
    /// Where the response is stored, when it is.
    keep: Option<ResponseToStore>,
    /// The store's write, run before the last event goes out (so the client can chain on the
    /// response as soon as it has it).
    saving: Option<Pin<Box<dyn Future<Output = ()>>>>,
    /// The last event, held until the write is done.
    last: Option<sse::Event>,
}

impl ResponseStream {
    fn event(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.out.push_back(v1::stream::event(Some(kind), data));
    }

    /// Output items emitted so far (the reasoning item counts once it is whole).
    fn items_so_far(&self) -> usize {
        self.text.as_ref().map_or(0, |(i, _)| *i + 1)
    }

    fn open_message(&mut self) -> usize {
        if let Some((index, _)) = &self.text {
            return *index;
        }
        let index = usize::from(!self.assembler.reasoning().is_empty());
        let item = self.base.message_item("", "in_progress");
        self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        self.event(
            "response.content_part.added",
            json!({"item_id": self.base.message_id(), "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
        );
        self.text = Some((index, String::new()));
        index
    }

    fn text_delta(&mut self, t: &str) {
        let index = self.open_message();
        if let Some((_, text)) = self.text.as_mut() {
            text.push_str(t);
        }
        self.event(
            "response.output_text.delta",
            json!({"item_id": self.base.message_id(), "output_index": index, "content_index": 0,
                "delta": t}),
        );
    }

    fn finish(&mut self, summary: &GenSummary) {
        let output = self.base.output(&self.assembler);
        // The reasoning item, whole (it is not streamed as deltas).
        if !self.assembler.reasoning().is_empty() {
            let item = self.base.reasoning_item(self.assembler.reasoning());
            self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            );
        }
        if self.text.is_none() && self.assembler.calls().is_empty() {
            self.open_message();
        }
        if let Some((index, text)) = self.text.clone() {
            let id = self.base.message_id();
            self.event(
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            );
            self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []}}),
            );
            let item = self.base.message_item(&text, "completed");
            self.event(
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
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item["id"], "output_index": index,
                    "arguments": item["arguments"]}),
            );
            self.event(
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
        self.event(kind, json!({"response": response}));
        if let Some(keep) = self.keep.take() {
            let reply = reply_message(&self.assembler, &self.raw, summary);
            self.last = self.out.pop_back();
            self.saving = Some(Box::pin(keep.save(reply)));
        }
    }

    fn on_event(&mut self, event: GenEvent) {
        match event {
            GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
            GenEvent::Token { text, .. } => {
                if text.is_empty() {
                    return;
                }
                self.raw.push_str(&text);
                let choices = self.assembler.push(&text);
                for c in choices {
                    if let Some(t) = c["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
                        let t = t.to_string();
                        self.text_delta(&t);
                    }
                }
            }
            GenEvent::Finished(summary) => {
                if let StopReason::Error(e) = &summary.reason {
                    let err = v1::generation_failed(e);
                    self.event(
                        "error",
                        json!({"code": err.code, "message": err.message, "param": err.param}),
                    );
                } else {
                    let choices = self.assembler.finish(&summary.reason);
                    for c in choices {
                        if let Some(t) = c["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
                            let t = t.to_string();
                            self.text_delta(&t);
                        }
                    }
                    self.finish(&summary);
                }
                v1::log_finished(self.completion.id(), &summary);
                self.done = true;
            }
        }
    }
}

impl v1::stream::AnswerStream for ResponseStream {
    type Item = sse::Event;

    fn completion(&mut self) -> &mut Completion {
        &mut self.completion
    }

    fn queued(&mut self) -> &mut VecDeque<sse::Event> {
        &mut self.out
    }

    fn ended(&self) -> bool {
        self.done
    }

    fn on_event(&mut self, event: GenEvent) {
        Self::on_event(self, event)
    }

    fn on_worker_gone(&mut self) {
        self.event(
            "error",
            json!({"code": "server_error", "param": null, "message": v1::WORKER_GONE}),
        );
        self.done = true;
    }
}

impl Stream for ResponseStream {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(saving) = this.saving.as_mut() {
            // The events before the last go out while the response is being stored.
            if let Some(bytes) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(bytes)));
            }
            match saving.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) => {
                    this.saving = None;
                    this.out.extend(this.last.take());
                }
            }
        }
        v1::stream::poll_events(this, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_translate_into_chat_messages() {
        let t = translate(&json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 20,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "3"},
                {"role": "developer", "content": "Use tools."},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        }))
        .expect("translate");
        let m = &t["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1], json!({"role": "user", "content": "Hi"}));
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], json!("f"));
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "3"})
        );
        assert_eq!(m[4]["role"], json!("system"));
        assert_eq!(t["max_tokens"], json!(20));
        assert_eq!(t["tools"][0]["function"]["name"], json!("f"));
        assert_eq!(t["response_format"]["type"], json!("json_schema"));
    }

    #[test]
    fn what_is_not_supported_is_named() {
        let refused = |body: Value| translate(&body).err().and_then(|e| e.param);
        assert_eq!(
            refused(json!({"input": "x", "conversation": "conv_1"})),
            Some("conversation".into())
        );
        assert_eq!(
            refused(json!({"input": "x", "store": "yes"})),
            Some("store".into())
        );
        assert_eq!(
            refused(json!({"input": "x", "previous_response_id": "r"})),
            None
        );
        assert_eq!(
            refused(json!({"input": [{"type": "input_image_call"}]})),
            Some("input[0]".into())
        );
        assert_eq!(refused(json!({})), Some("input".into()));
        assert_eq!(
            refused(json!({"input": "x", "warp": 1})),
            Some("warp".into())
        );
        assert_eq!(
            refused(json!({"input": "x", "tools": [{"type": "web_search"}]})),
            Some("tools[0].type".into())
        );
    }

    /// A stored reply's calls come back with the ids it was answered with, and the tool results
    /// after it answer them in order; the input's own calls are stored as the model's markup.
    #[test]
    fn stored_turns_read_back_as_chat_messages_with_stable_call_ids() {
        let input = translate_input(Some(&json!([
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\":\"Rome\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "c2", "output": "25 C"},
        ])))
        .expect("input");
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
            json!({"role": "user", "content": "Weather in Paris and Rome?"})
        );
        let calls = back[1]["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(calls.len(), 2);
        let first = call_id(Uuid::from_u128(2), 0);
        assert_eq!(calls[0]["id"], json!(first));
        assert_eq!(calls[0]["function"]["name"], json!("weather"));
        let args: Value =
            serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap_or(""))
                .unwrap_or_default();
        assert_eq!(args, json!({"city": "Rome"}));
        assert_eq!(back[2]["tool_call_id"], json!(first));
        assert_eq!(
            back[3]["tool_call_id"],
            json!(call_id(Uuid::from_u128(2), 1))
        );
        assert_eq!(back[3]["content"], json!("25 C"));
        assert_eq!(
            parse_response_id(&response_id(Uuid::from_u128(7))),
            Some(Uuid::from_u128(7))
        );
        assert_eq!(parse_response_id("resp_xyz"), None);
    }
}
