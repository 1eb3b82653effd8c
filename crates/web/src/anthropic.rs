//! The Anthropic Messages API (`POST /v1/messages`), for the `anthropic` SDKs and the tools built
//! on them. The key comes as `x-api-key` (Anthropic's clients) or `Authorization: Bearer`.
//!
//! A request is translated into the OpenAI chat request shape and parsed by the one parser
//! (`openai::request`): system prompt, text blocks, `tool_use`/`tool_result` blocks, tools,
//! `stop_sequences`, sampling and `thinking` get the same checks, limits and fair sharing as
//! `/v1/chat/completions`, and generate through `v1::submit`. The answer is a `message` with
//! `thinking`, `text` and `tool_use` content blocks, streamed as Anthropic's named events
//! (`message_start`, `content_block_start`/`_delta`/`_stop`, `message_delta`, `message_stop`).
//! Refusals are `{"type": "error", "error": {"type", "message"}}`. Images, documents and forced
//! tool use (`tool_choice` `any`/`tool`, which needs constrained decoding) are refused clearly.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::http::StatusCode;
use actix_web::middleware::from_fn;
use actix_web::web::{self};
use actix_web::{HttpRequest, HttpResponse};
use futures_util::Stream;
use serde_json::{json, Map, Value};

use super::json::JsonBody;
use super::openai::{Assembler, CallOut, ChatAssembler};
use super::v1;
use super::{AppState, WebError};
use crate::error::reshape;
use crate::error::ApiError;
use actix_web_lab::sse;
use smolchat_service::completions::{Completion, GenEvent, GenSummary, StopReason};

/// Registers `/v1/messages` (before the `/v1` scope, which would take the path), behind the
/// same key check as `/v1`, with every refusal in Anthropic's shape.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/v1/messages")
            .wrap(from_fn(v1::require_api_key))
            // Outside the key check, so its refusals come in Anthropic's shape too.
            .wrap(from_fn(reshape::reshape::<Anthropic>))
            .wrap(super::api_headers())
            .route(web::post().to(messages))
            .default_service(web::to(reshape::method_not_allowed::<Anthropic>)),
    );
}

/// Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`.
pub struct Anthropic;

impl reshape::ErrorShape for Anthropic {
    fn body(status: StatusCode, message: &str, kind: &str) -> Value {
        json!({"type": "error", "error": {"type": error_type(status, kind), "message": message}})
    }
}

/// A refusal in Anthropic's shape, decided by the one [`ApiError`].
pub type AnthropicError = reshape::Shaped<Anthropic>;

/// Anthropic's error `type` for a refusal.
fn error_type(status: StatusCode, openai_kind: &str) -> &'static str {
    match status.as_u16() {
        400 | 413 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ if openai_kind == "invalid_request_error" => "invalid_request_error",
        _ => "api_error",
    }
}

/// A message's `content`: a string, or blocks of which only text counts (for `system` and
/// `tool_result`).
fn text_of(value: &Value, field: &str) -> Result<String, AnthropicError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b["type"].as_str(), b["text"].as_str()) {
                    (Some("text"), Some(t)) => {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(t);
                    }
                    (kind, _) => {
                        return Err(AnthropicError::invalid(
                            &format!("{field}[{i}]"),
                            format!(
                                "only text blocks are accepted here, got {}",
                                kind.unwrap_or("a block without a type")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        other => Err(AnthropicError::invalid(
            field,
            format!("`{field}` must be a string or an array of text blocks, got {other}"),
        )),
    }
}

/// Anthropic's messages onto OpenAI's: text blocks joined, `tool_use` blocks as the assistant's
/// `tool_calls`, `tool_result` blocks as `tool` messages, `thinking` blocks dropped (a past
/// reply's reasoning is not replayed), images and documents refused.
fn translate_messages(messages: Option<&Value>) -> Result<Vec<Value>, AnthropicError> {
    let Some(messages) = messages.and_then(Value::as_array) else {
        return Err(AnthropicError::invalid(
            "messages",
            "`messages` is required: an array of {role, content}",
        ));
    };
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m["role"].as_str() {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(AnthropicError::invalid(
                    &format!("{at}.role"),
                    "`role` must be \"user\" or \"assistant\"",
                ))
            }
        };
        let blocks = match &m["content"] {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            other => {
                return Err(AnthropicError::invalid(
                    &format!("{at}.content"),
                    format!("`content` must be a string or an array of blocks, got {other}"),
                ))
            }
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let bat = format!("{at}.content[{j}]");
            match b["type"].as_str() {
                Some("text") => {
                    let Some(t) = b["text"].as_str() else {
                        return Err(AnthropicError::invalid(&bat, "a text block needs `text`"));
                    };
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(t);
                }
                Some("thinking" | "redacted_thinking") => {}
                Some("tool_use") if role == "assistant" => {
                    let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                        return Err(AnthropicError::invalid(
                            &bat,
                            "a tool_use block needs `id` and `name`",
                        ));
                    };
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": b["input"].to_string()}}));
                }
                Some("tool_result") if role == "user" => {
                    let Some(id) = b["tool_use_id"].as_str() else {
                        return Err(AnthropicError::invalid(
                            &bat,
                            "a tool_result block needs `tool_use_id`",
                        ));
                    };
                    let content = match &b["content"] {
                        Value::Null => String::new(),
                        v => text_of(v, &format!("{bat}.content"))?,
                    };
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                Some(kind @ ("image" | "document" | "search_result")) => {
                    return Err(AnthropicError::invalid(
                        &bat,
                        format!(
                            "{kind} blocks are not supported: the served model reads text only"
                        ),
                    ))
                }
                Some(kind) => {
                    return Err(AnthropicError::invalid(
                        &bat,
                        format!("a {kind} block is not accepted in a {role} message"),
                    ))
                }
                None => {
                    return Err(AnthropicError::invalid(
                        &bat,
                        "a content block needs a `type`",
                    ))
                }
            }
        }
        if role == "assistant" {
            let mut msg = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            out.push(msg);
        } else if !text.is_empty() {
            out.push(json!({"role": "user", "content": text}));
        }
    }
    Ok(out)
}

/// The request in the OpenAI chat shape, or why it cannot be served.
fn translate(body: &Value) -> Result<Value, AnthropicError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_body("the request body must be a JSON object").into());
    };
    let mut out = Map::new();
    for (key, value) in obj {
        match key.as_str() {
            "model" | "stream" | "temperature" | "top_p" | "top_k" => {
                out.insert(key.clone(), value.clone());
            }
            "max_tokens" => {
                out.insert("max_tokens".into(), value.clone());
            }
            "stop_sequences" => {
                out.insert("stop".into(), value.clone());
            }
            "metadata" => {
                if let Some(user) = value["user_id"].as_str() {
                    out.insert("user".into(), json!(user));
                }
            }
            "system" | "messages" | "tools" | "tool_choice" | "thinking" => {}
            // Accepted and meaningless here: one tier, one place, one speed, no prompt-cache
            // pricing (prefix caching is automatic), no workspaces.
            "service_tier" | "cache_control" | "inference_geo" | "speed" | "diagnostics"
            | "user_profile_id" | "workspace_id" => {}
            "output_config" => match value.get("format") {
                None | Some(Value::Null) => {}
                // Structured outputs, through the parser's grammar field.
                Some(f) if f["type"] == "json_schema" && f["schema"].is_object() => {
                    out.insert("json_schema".into(), f["schema"].clone());
                }
                Some(_) => return Err(AnthropicError::invalid(
                    "output_config.format",
                    "`output_config.format` must be {\"type\": \"json_schema\", \"schema\": {…}}",
                )),
            },
            "container" if value.is_null() => {}
            "container" | "mcp_servers" => {
                return Err(AnthropicError::invalid(
                    key,
                    format!("`{key}` (server-side tools) is not supported by this server"),
                ))
            }
            other => {
                return Err(AnthropicError::invalid(
                    other,
                    format!("unknown field `{other}`"),
                ))
            }
        }
    }
    if !obj.contains_key("max_tokens") {
        return Err(AnthropicError::invalid(
            "max_tokens",
            "`max_tokens` is required",
        ));
    }
    let mut messages = Vec::new();
    if let Some(system) = obj.get("system") {
        let text = text_of(system, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    messages.extend(translate_messages(obj.get("messages"))?);
    out.insert("messages".into(), Value::Array(messages));
    let choice = obj.get("tool_choice");
    let openai_choice = match choice.map(|c| c["type"].as_str()) {
        None | Some(Some("auto")) => json!("auto"),
        Some(Some("none")) => json!("none"),
        // A forced call: constrained to the tools' schemas.
        Some(Some("any")) => json!("required"),
        Some(Some("tool")) => match choice.and_then(|c| c["name"].as_str()) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => {
                return Err(AnthropicError::invalid(
                    "tool_choice.name",
                    "tool_choice `tool` needs the `name` of the tool to call",
                ))
            }
        },
        Some(_) => {
            return Err(AnthropicError::invalid(
                "tool_choice",
                "`tool_choice.type` must be auto, any, tool or none",
            ))
        }
    };
    if let Some(tools) = obj.get("tools") {
        out.insert("tools".into(), translate_tools(tools)?);
    }
    out.insert("tool_choice".into(), openai_choice);
    match obj.get("thinking").map(|t| t["type"].as_str()) {
        None => {}
        Some(Some("enabled")) => {
            out.insert(
                "chat_template_kwargs".into(),
                json!({"enable_thinking": true}),
            );
        }
        Some(Some("disabled")) => {
            out.insert(
                "chat_template_kwargs".into(),
                json!({"enable_thinking": false}),
            );
        }
        Some(_) => {
            return Err(AnthropicError::invalid(
                "thinking",
                "`thinking.type` must be enabled or disabled",
            ))
        }
    }
    Ok(Value::Object(out))
}

/// Anthropic's tools (`name`, `description`, `input_schema`) as OpenAI's functions.
fn translate_tools(tools: &Value) -> Result<Value, AnthropicError> {
    let Some(tools) = tools.as_array() else {
        return Err(AnthropicError::invalid("tools", "`tools` must be an array"));
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let Some(name) = t["name"].as_str() else {
                return Err(AnthropicError::invalid(
                    &format!("tools[{i}].name"),
                    "a tool needs a `name`",
                ));
            };
            if t.get("type")
                .and_then(Value::as_str)
                .is_some_and(|k| k != "custom")
            {
                return Err(AnthropicError::invalid(
                    &format!("tools[{i}].type"),
                    "only custom tools (name, description, input_schema) are supported",
                ));
            }
            Ok(json!({"type": "function", "function": {
                "name": name,
                "description": t["description"].as_str().unwrap_or(""),
                "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
            }}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

async fn messages(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, AnthropicError> {
    let JsonBody(body) = body?;
    let translated = translate(&body)?;
    let req = v1::checked_chat(&state, &http, &translated, Some("output_config.format"))?;
    let model = v1::model_name(&state.platform, &req.common);
    let parse_tool_calls = req.parse_tool_calls();
    let prompt = v1::build_chat_prompt(&state, &http, &req).await?;
    let mut assembler = ChatAssembler::new(prompt.starts_in_reasoning, parse_tool_calls);
    let stream = req.common.stream;
    let input_tokens = prompt.tokens.len();
    let salt = v1::cache_salt(&http, &req.common);
    let user = v1::api_user(&http);
    let completion = v1::submit(&state, req.common, salt, user, prompt.tokens, "messages").await?;
    let id = format!("msg_{}", uuid::Uuid::now_v7().simple());
    if stream {
        let mut s = MessageStream {
            completion,
            assembler,
            blocks: Blocks::default(),
            out: VecDeque::new(),
            done: false,
        };
        s.event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0},
            }}),
        );
        return Ok(v1::stream::sse_response(&http, s));
    }
    let summary = v1::collect(completion, |text, _| {
        if !text.is_empty() {
            assembler.push(text);
        }
    })
    .await?;
    assembler.finish(&summary.reason);
    let mut content = Vec::new();
    if !assembler.reasoning().is_empty() {
        content
            .push(json!({"type": "thinking", "thinking": assembler.reasoning(), "signature": ""}));
    }
    if !assembler.content().is_empty() || assembler.calls().is_empty() {
        content.push(json!({"type": "text", "text": assembler.content()}));
    }
    content.extend(assembler.calls().iter().map(tool_use));
    let (stop_reason, stop_sequence) = stop(&summary, !assembler.calls().is_empty());
    Ok(HttpResponse::Ok().json(json!({
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop_reason,
        "stop_sequence": stop_sequence, "usage": usage(&summary),
    })))
}

fn tool_use(c: &CallOut) -> Value {
    let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": c.id.replacen("call_", "toolu_", 1), "name": c.name,
        "input": input})
}

/// Anthropic's `stop_reason` and `stop_sequence`.
fn stop(s: &GenSummary, made_calls: bool) -> (&'static str, Value) {
    match &s.reason {
        StopReason::StopString(seq) => ("stop_sequence", json!(seq)),
        StopReason::Length | StopReason::TimeLimit => ("max_tokens", Value::Null),
        _ if made_calls => ("tool_use", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

fn usage(s: &GenSummary) -> Value {
    json!({
        "input_tokens": s.prompt_tokens,
        "output_tokens": s.completion_tokens,
        "cache_read_input_tokens": s.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// Which content block is open in a stream, and how many have been opened.
#[derive(Default)]
struct Blocks {
    open: Option<&'static str>,
    count: usize,
}

/// The streamed answer: Anthropic's named SSE events. Dropping it (the client went away)
/// cancels the request through its [`Completion`].
struct MessageStream {
    completion: Completion,
    assembler: ChatAssembler,
    blocks: Blocks,
    out: VecDeque<sse::Event>,
    done: bool,
}

impl MessageStream {
    fn event(&mut self, name: &str, data: Value) {
        self.out.push_back(v1::stream::event(Some(name), data));
    }

    fn close_block(&mut self) {
        if self.blocks.open.take().is_some() {
            let index = self.blocks.count - 1;
            self.event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    /// Opens a block of `kind` unless one is open already.
    fn ensure_block(&mut self, kind: &'static str) -> usize {
        if self.blocks.open != Some(kind) {
            self.close_block();
            let index = self.blocks.count;
            let block = match kind {
                "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            self.event(
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            );
            self.blocks.open = Some(kind);
            self.blocks.count += 1;
        }
        self.blocks.count - 1
    }

    /// Streams what the assembler's choices add.
    fn deltas(&mut self, choices: Vec<Value>, calls_before: usize) {
        for c in choices {
            let d = &c["delta"];
            if let Some(t) = d["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
                let index = self.ensure_block("thinking");
                self.event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "thinking_delta", "thinking": t}}),
                );
            }
            if let Some(t) = d["content"].as_str().filter(|t| !t.is_empty()) {
                let index = self.ensure_block("text");
                self.event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": t}}),
                );
            }
        }
        let new: Vec<CallOut> = self.assembler.calls()[calls_before..].to_vec();
        for call in new {
            self.close_block();
            let index = self.blocks.count;
            let block = tool_use(&call);
            let input = block["input"].to_string();
            self.event(
                "content_block_start",
                json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": block["id"], "name": call.name,
                        "input": {}}}),
            );
            self.event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": input}}),
            );
            self.event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
            self.blocks.count += 1;
        }
    }

    fn on_event(&mut self, event: GenEvent) {
        match event {
            GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
            GenEvent::Token { text, .. } => {
                if text.is_empty() {
                    return;
                }
                let before = self.assembler.calls().len();
                let choices = self.assembler.push(&text);
                self.deltas(choices, before);
            }
            GenEvent::Finished(summary) => {
                if let StopReason::Error(e) = &summary.reason {
                    self.event(
                        "error",
                        json!({"type": "error", "error": {"type": "api_error",
                            "message": format!("generation failed: {e}")}}),
                    );
                } else {
                    let before = self.assembler.calls().len();
                    let choices = self.assembler.finish(&summary.reason);
                    self.deltas(choices, before);
                    if self.blocks.count == 0 {
                        // An empty reply still has its (empty) text block.
                        self.ensure_block("text");
                    }
                    self.close_block();
                    let (stop_reason, stop_sequence) =
                        stop(&summary, !self.assembler.calls().is_empty());
                    self.event(
                        "message_delta",
                        json!({"type": "message_delta",
                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": usage(&summary)}),
                    );
                    self.event("message_stop", json!({"type": "message_stop"}));
                }
                v1::log_finished(self.completion.id(), &summary);
                self.done = true;
            }
        }
    }
}

impl v1::stream::AnswerStream for MessageStream {
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
            json!({"type": "error", "error": {"type": "api_error", "message": v1::WORKER_GONE}}),
        );
        self.done = true;
    }
}

impl Stream for MessageStream {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        v1::stream::poll_events(self.get_mut(), cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_translate_into_openai_messages() {
        let t = translate(&json!({
            "model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "Calling."},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                    {"type": "text", "text": "Thanks"}]},
            ],
        }))
        .expect("translate");
        let m = &t["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!("{\"a\":1}")
        );
        assert_eq!(m[2]["content"], json!("Calling."));
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "3"})
        );
        assert_eq!(m[4], json!({"role": "user", "content": "Thanks"}));
        assert_eq!(t["stop"], json!(["END"]));
        assert_eq!(t["user"], json!("u1"));
        assert_eq!(t["chat_template_kwargs"]["enable_thinking"], json!(true));
        assert_eq!(
            t["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
    }

    #[test]
    fn what_cannot_be_served_is_named() {
        let base = || json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
        let refused = |body: Value| translate(&body).err().map(|e| e.0.param);
        let mut b = base();
        b.as_object_mut().map(|o| o.remove("max_tokens"));
        assert_eq!(refused(b), Some(Some("max_tokens".into())));
        let mut b = base();
        b["tool_choice"] = json!({"type": "tool"});
        assert_eq!(refused(b), Some(Some("tool_choice.name".into())));
        let mut b = base();
        b["messages"][0]["content"] = json!([{"type": "image", "source": {}}]);
        assert_eq!(refused(b), Some(Some("messages[0].content[0]".into())));
        let mut b = base();
        b["bogus"] = json!(1);
        assert_eq!(refused(b), Some(Some("bogus".into())));
        let mut b = base();
        b["messages"][0]["role"] = json!("system");
        assert_eq!(refused(b), Some(Some("messages[0].role".into())));
    }

    #[test]
    fn error_types_follow_the_status() {
        assert_eq!(
            error_type(StatusCode::UNAUTHORIZED, "x"),
            "authentication_error"
        );
        assert_eq!(
            error_type(StatusCode::TOO_MANY_REQUESTS, "x"),
            "rate_limit_error"
        );
        assert_eq!(error_type(StatusCode::NOT_FOUND, "x"), "not_found_error");
        assert_eq!(
            error_type(StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
            "api_error"
        );
    }
}
