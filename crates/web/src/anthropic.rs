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
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::json::JsonBody;
use super::openai::body::{CallBody, ChatBody, GenerationBody, MessageBody, ToolChoice};
use super::openai::{Assembler, CallOut, ChatAssembler};
use super::typed::{self, Count, Number, Schema, Strings};
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

/// A `POST /v1/messages` body. Anthropic's server refuses fields it does not know, so this one
/// does too (see [`KNOWN_FIELDS`]).
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct MessagesBody {
    model: Option<String>,
    stream: Option<bool>,
    max_tokens: Option<Count>,
    temperature: Option<Number>,
    top_p: Option<Number>,
    top_k: Option<Count>,
    stop_sequences: Option<Strings>,
    metadata: Option<Metadata>,
    system: Option<ContentIn>,
    messages: Option<Vec<MessageIn>>,
    tools: Option<Vec<ToolIn>>,
    tool_choice: Option<ToolChoiceIn>,
    thinking: Option<ThinkingIn>,
    output_config: Option<OutputConfig>,
    container: Option<Value>,
    mcp_servers: Option<Value>,
}

/// Every top-level field [`MessagesBody`] takes, and those accepted and meaningless here: one
/// tier, one place, one speed, no prompt-cache pricing (prefix caching is automatic), no
/// workspaces.
const KNOWN_FIELDS: &[&str] = &[
    "model",
    "stream",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "metadata",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "container",
    "mcp_servers",
    "service_tier",
    "cache_control",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
];

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct Metadata {
    user_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct MessageIn {
    role: Option<String>,
    content: Option<ContentIn>,
}

/// A `content` (or `system`): a string, or an array of content blocks.
#[derive(Debug)]
enum ContentIn {
    Text(String),
    ContentIn(Vec<Block>),
}

impl<'de> Deserialize<'de> for ContentIn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = ContentIn;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or an array of content blocks")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ContentIn, E> {
                Ok(ContentIn::Text(s.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<ContentIn, A::Error> {
                let mut blocks = Vec::new();
                while let Some(b) = seq.next_element::<Block>()? {
                    blocks.push(b);
                }
                Ok(ContentIn::ContentIn(blocks))
            }
        }
        d.deserialize_any(V)
    }
}

/// One content block, of any type: which fields matter depends on `type`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct Block {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
    /// `tool_use`: the call's id, the tool's name and its input.
    id: Option<String>,
    name: Option<String>,
    input: Option<Value>,
    /// `tool_result`: the call it answers and what the tool said.
    tool_use_id: Option<String>,
    content: Option<ContentIn>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct ToolIn {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
    description: Option<String>,
    input_schema: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct ToolChoiceIn {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct ThinkingIn {
    #[serde(rename = "type")]
    kind: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct OutputConfig {
    format: Option<OutputFormat>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct OutputFormat {
    #[serde(rename = "type")]
    kind: Option<String>,
    schema: Option<Value>,
}

/// Text blocks joined by newlines (for `system` and `tool_result`, where only text counts).
fn text_of(blocks: ContentIn, field: &str) -> Result<String, ApiError> {
    match blocks {
        ContentIn::Text(s) => Ok(s),
        ContentIn::ContentIn(blocks) => {
            let mut text = Vec::new();
            for (i, b) in blocks.into_iter().enumerate() {
                match (b.kind.as_deref(), b.text) {
                    (Some("text"), Some(t)) => text.push(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            format!("{field}[{i}]"),
                            format!(
                                "only text blocks are accepted here, got {}",
                                kind.unwrap_or("a block without a type")
                            ),
                        ))
                    }
                }
            }
            Ok(text.join("\n"))
        }
    }
}

/// Anthropic's messages onto the one request's: text blocks joined, `tool_use` blocks as the
/// assistant's tool calls, `tool_result` blocks as `tool` messages, `thinking` blocks dropped (a
/// past reply's reasoning is not replayed), images and documents refused.
fn chat_messages(messages: Vec<MessageIn>) -> Result<Vec<MessageBody>, ApiError> {
    let mut out = Vec::new();
    for (i, m) in messages.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m.role.as_deref() {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    "`role` must be \"user\" or \"assistant\"",
                ))
            }
        };
        let blocks = match m.content {
            Some(ContentIn::Text(s)) => vec![Block {
                kind: Some("text".into()),
                text: Some(s),
                ..Block::default()
            }],
            Some(ContentIn::ContentIn(b)) => b,
            None => {
                return Err(ApiError::invalid(
                    format!("{at}.content"),
                    "`content` is required: a string or an array of blocks",
                ))
            }
        };
        let mut text = Vec::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.into_iter().enumerate() {
            let bat = format!("{at}.content[{j}]");
            match b.kind.as_deref() {
                Some("text") => {
                    let Some(t) = b.text else {
                        return Err(ApiError::invalid(&bat, "a text block needs `text`"));
                    };
                    text.push(t);
                }
                Some("thinking" | "redacted_thinking") => {}
                Some("tool_use") if role == "assistant" => {
                    let (Some(id), Some(name)) = (b.id, b.name) else {
                        return Err(ApiError::invalid(
                            &bat,
                            "a tool_use block needs `id` and `name`",
                        ));
                    };
                    let input = b.input.unwrap_or(Value::Null).to_string();
                    calls.push(CallBody::new(Some(id), &name, input));
                }
                Some("tool_result") if role == "user" => {
                    let Some(id) = b.tool_use_id else {
                        return Err(ApiError::invalid(
                            &bat,
                            "a tool_result block needs `tool_use_id`",
                        ));
                    };
                    let content = match b.content {
                        None => String::new(),
                        Some(c) => text_of(c, &format!("{bat}.content"))?,
                    };
                    out.push(MessageBody {
                        tool_call_id: Some(id),
                        ..MessageBody::text("tool", content)
                    });
                }
                Some(kind @ ("image" | "document" | "search_result")) => {
                    return Err(ApiError::invalid(
                        &bat,
                        format!(
                            "{kind} blocks are not supported: the served model reads text only"
                        ),
                    ))
                }
                Some(kind) => {
                    return Err(ApiError::invalid(
                        &bat,
                        format!("a {kind} block is not accepted in a {role} message"),
                    ))
                }
                None => return Err(ApiError::invalid(&bat, "a content block needs a `type`")),
            }
        }
        let text = text.join("\n");
        if role == "assistant" {
            out.push(MessageBody {
                tool_calls: (!calls.is_empty()).then_some(calls),
                ..MessageBody::text("assistant", text)
            });
        } else if !text.is_empty() {
            out.push(MessageBody::text("user", text));
        }
    }
    Ok(out)
}

/// Anthropic's tools (`name`, `description`, `input_schema`) as the one request's functions.
fn chat_tools(tools: Vec<ToolIn>) -> Result<Vec<Value>, ApiError> {
    tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let Some(name) = t.name else {
                return Err(ApiError::invalid(
                    format!("tools[{i}].name"),
                    "a tool needs a `name`",
                ));
            };
            if t.kind.as_deref().is_some_and(|k| k != "custom") {
                return Err(ApiError::invalid(
                    format!("tools[{i}].type"),
                    "only custom tools (name, description, input_schema) are supported",
                ));
            }
            Ok(json!({"type": "function", "function": {
                "name": name,
                "description": t.description.unwrap_or_default(),
                "parameters": t.input_schema.unwrap_or_else(|| json!({"type": "object"})),
            }}))
        })
        .collect()
}

/// The request as the one typed chat request, or why it cannot be served.
fn translate(body: &Value) -> Result<(GenerationBody, ChatBody), ApiError> {
    if let Value::Object(obj) = body {
        typed::refuse_unknown(obj, "", KNOWN_FIELDS, "field")?;
    }
    let b: MessagesBody = typed::read(body, "")?;
    for (key, value) in [("container", &b.container), ("mcp_servers", &b.mcp_servers)] {
        if value.is_some() {
            return Err(ApiError::invalid(
                key,
                format!("`{key}` (server-side tools) is not supported by this server"),
            ));
        }
    }
    if b.max_tokens.is_none() {
        return Err(ApiError::invalid("max_tokens", "`max_tokens` is required"));
    }
    // Structured outputs, through the one request's grammar field.
    let json_schema = match b.output_config.and_then(|c| c.format) {
        None => None,
        Some(OutputFormat {
            kind: Some(kind),
            schema: Some(schema @ Value::Object(_)),
        }) if kind == "json_schema" => Some(Schema(schema)),
        Some(_) => {
            return Err(ApiError::invalid(
                "output_config.format",
                "`output_config.format` must be {\"type\": \"json_schema\", \"schema\": {…}}",
            ))
        }
    };
    let mut messages = Vec::new();
    if let Some(system) = b.system {
        let text = text_of(system, "system")?;
        if !text.is_empty() {
            messages.push(MessageBody::text("system", text));
        }
    }
    let Some(anthropic_messages) = b.messages else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` is required: an array of {role, content}",
        ));
    };
    messages.extend(chat_messages(anthropic_messages)?);
    let tool_choice = match b.tool_choice {
        None => ToolChoice::Mode("auto".into()),
        Some(c) => match (c.kind.as_deref(), c.name) {
            (Some("auto"), _) => ToolChoice::Mode("auto".into()),
            (Some("none"), _) => ToolChoice::Mode("none".into()),
            // A forced call: constrained to the tools' schemas.
            (Some("any"), _) => ToolChoice::Mode("required".into()),
            (Some("tool"), Some(name)) => ToolChoice::Named(Some(name)),
            (Some("tool"), None) => {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    "tool_choice `tool` needs the `name` of the tool to call",
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice.type` must be auto, any, tool or none",
                ))
            }
        },
    };
    let enable_thinking = match b.thinking.map(|t| t.kind) {
        None => None,
        Some(Some(kind)) if kind == "enabled" => Some(true),
        Some(Some(kind)) if kind == "disabled" => Some(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "thinking",
                "`thinking.type` must be enabled or disabled",
            ))
        }
    };
    let generation = GenerationBody {
        model: b.model,
        stream: b.stream,
        max_tokens: b.max_tokens,
        temperature: b.temperature,
        top_p: b.top_p,
        top_k: b.top_k,
        stop: b.stop_sequences,
        user: b.metadata.and_then(|m| m.user_id),
        json_schema,
        ..GenerationBody::default()
    };
    let chat = ChatBody {
        messages: Some(messages),
        tools: b.tools.map(chat_tools).transpose()?,
        tool_choice: Some(tool_choice),
        chat_template_kwargs: enable_thinking.map(|on| {
            let mut kwargs = Map::new();
            kwargs.insert("enable_thinking".into(), Value::Bool(on));
            kwargs
        }),
        ..ChatBody::default()
    };
    Ok((generation, chat))
}

async fn messages(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, AnthropicError> {
    let JsonBody(body) = body?;
    let (generation, chat) = translate(&body)?;
    let req = v1::checked_chat(
        &state,
        &http,
        generation,
        chat,
        Some("output_config.format"),
    )?;
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
    fn blocks_translate_into_the_one_request() {
        let (g, c) = translate(&json!({
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
        let m = c.messages.clone().expect("messages");
        assert_eq!(m[0], MessageBody::text("system", "Be brief."));
        assert_eq!(
            m[2].tool_calls,
            Some(vec![CallBody::new(
                Some("toolu_1".into()),
                "f",
                "{\"a\":1}".into()
            )])
        );
        assert_eq!(
            m[2].content,
            Some(crate::openai::body::Content::Text("Calling.".into()))
        );
        assert_eq!(
            m[3],
            MessageBody {
                tool_call_id: Some("toolu_1".into()),
                ..MessageBody::text("tool", "3")
            }
        );
        assert_eq!(m[4], MessageBody::text("user", "Thanks"));
        assert_eq!(g.stop, Some(Strings(vec!["END".into()])));
        assert_eq!(g.user.as_deref(), Some("u1"));
        assert_eq!(
            c.chat_template_kwargs
                .as_ref()
                .map(|k| k["enable_thinking"].clone()),
            Some(json!(true))
        );
        assert_eq!(
            c.tools
                .as_ref()
                .map(|t| t[0]["function"]["parameters"].clone()),
            Some(json!({"type": "object"}))
        );
        // What the one request makes of it.
        let defaults = crate::openai::request::Defaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
        };
        let req = crate::openai::request::chat_request(g, c, &defaults).expect("checked");
        assert_eq!(req.messages.len(), 5);
        assert_eq!(req.enable_thinking, Some(true));
        assert_eq!(req.common.max_tokens, Some(10));
    }

    #[test]
    fn what_cannot_be_served_is_named() {
        let base = || json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
        let refused = |body: Value| translate(&body).err().map(|e| e.param);
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
        // Types are the body's own: named by Anthropic's field names.
        let mut b = base();
        b["stop_sequences"] = json!(["ok", 3]);
        assert_eq!(refused(b), Some(Some("stop_sequences[1]".into())));
        let mut b = base();
        b["messages"][0]["content"] = json!(7);
        assert_eq!(refused(b), Some(Some("messages[0].content".into())));
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
