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

use actix_web::http::StatusCode;
use actix_web::middleware::from_fn;
use actix_web::web::{self};
use actix_web::{HttpRequest, HttpResponse};
use serde_json::{json, Value};

mod body;

use super::json::JsonBody;
use super::openai::{Assembler, CallOut, ChatAssembler};
use super::v1;
use super::v1::stream::{EventStream, Render};
use super::{AppState, WebError};
use crate::error::reshape;
use crate::error::ApiError;
use actix_web_lab::sse;
use smolchat_service::completions::{GenSummary, StopReason};

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

async fn messages(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, AnthropicError> {
    let JsonBody(body) = body?;
    let (generation, chat) = body::translate(&body)?;
    let (req, served) = v1::checked_chat(
        &state,
        &http,
        generation,
        chat,
        Some("output_config.format"),
    )
    .await?;
    let model = v1::model_name(&served, &req.common);
    let parse_tool_calls = req.parse_tool_calls();
    let prompt = v1::build_chat_prompt(&state, &http, &served, &req).await?;
    let mut assembler = ChatAssembler::new(prompt.starts_in_reasoning, parse_tool_calls);
    let stream = req.common.stream;
    let input_tokens = prompt.tokens.len();
    let salt = v1::cache_salt(&http, &req.common);
    let user = v1::api_user(&http);
    let completion = v1::submit(
        &state,
        &served,
        req.common,
        salt,
        user,
        prompt.tokens,
        "messages",
    )
    .await?;
    let id = format!("msg_{}", uuid::Uuid::now_v7().simple());
    if stream {
        let render = MessageRender {
            assembler,
            blocks: Blocks::default(),
        };
        let start = v1::stream::event(
            Some("message_start"),
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0},
            }}),
        );
        let stream = EventStream::new(completion, render, vec![start]);
        return Ok(v1::stream::sse_response(&http, stream));
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

/// The streamed answer's events: Anthropic's named SSE events.
struct MessageRender {
    assembler: ChatAssembler,
    blocks: Blocks,
}

type Out = VecDeque<sse::Event>;

fn event(out: &mut Out, name: &str, data: Value) {
    out.push_back(v1::stream::event(Some(name), data));
}

impl MessageRender {
    fn close_block(&mut self, out: &mut Out) {
        if self.blocks.open.take().is_some() {
            let index = self.blocks.count - 1;
            event(
                out,
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    /// Opens a block of `kind` unless one is open already.
    fn ensure_block(&mut self, kind: &'static str, out: &mut Out) -> usize {
        if self.blocks.open != Some(kind) {
            self.close_block(out);
            let index = self.blocks.count;
            let block = match kind {
                "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            event(
                out,
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            );
            self.blocks.open = Some(kind);
            self.blocks.count += 1;
        }
        self.blocks.count - 1
    }

    /// Streams what the assembler's choices add.
    fn deltas(&mut self, choices: Vec<Value>, calls_before: usize, out: &mut Out) {
        for c in choices {
            let d = &c["delta"];
            if let Some(t) = d["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
                let index = self.ensure_block("thinking", out);
                event(
                    out,
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "thinking_delta", "thinking": t}}),
                );
            }
            if let Some(t) = d["content"].as_str().filter(|t| !t.is_empty()) {
                let index = self.ensure_block("text", out);
                event(
                    out,
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": t}}),
                );
            }
        }
        let new: Vec<CallOut> = self.assembler.calls()[calls_before..].to_vec();
        for call in new {
            self.close_block(out);
            let index = self.blocks.count;
            let block = tool_use(&call);
            let input = block["input"].to_string();
            event(
                out,
                "content_block_start",
                json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": block["id"], "name": call.name,
                        "input": {}}}),
            );
            event(
                out,
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": input}}),
            );
            event(
                out,
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
            self.blocks.count += 1;
        }
    }
}

impl Render for MessageRender {
    type Item = sse::Event;

    fn text(&mut self, text: &str, out: &mut Out) {
        let before = self.assembler.calls().len();
        let choices = self.assembler.push(text);
        self.deltas(choices, before, out);
    }

    fn finished(&mut self, summary: &GenSummary, out: &mut Out) {
        let before = self.assembler.calls().len();
        let choices = self.assembler.finish(&summary.reason);
        self.deltas(choices, before, out);
        if self.blocks.count == 0 {
            // An empty reply still has its (empty) text block.
            self.ensure_block("text", out);
        }
        self.close_block(out);
        let (stop_reason, stop_sequence) = stop(summary, !self.assembler.calls().is_empty());
        event(
            out,
            "message_delta",
            json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage(summary)}),
        );
        event(out, "message_stop", json!({"type": "message_stop"}));
    }

    fn failed(&mut self, error: &ApiError, out: &mut Out) {
        event(
            out,
            "error",
            json!({"type": "error", "error": {"type": error_type(error.status, error.kind),
                "message": error.message}}),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
