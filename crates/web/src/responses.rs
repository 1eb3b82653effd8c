//! OpenAI's Responses API (`POST /v1/responses`), which newer SDKs and coding agents use.
//!
//! A request is translated into the chat request shape and parsed by the one parser
//! (`openai::request`): `instructions`, `input` as text or items (messages with text parts,
//! `function_call` and `function_call_output` items), function `tools`, `tool_choice`,
//! `text.format` (JSON Schema / JSON object, by constrained decoding), sampling and
//! `max_output_tokens` get the same checks, limits and fair sharing as `/v1/chat/completions`,
//! and generate through `openai::submit`. The answer is a `response` whose `output` holds a
//! `reasoning` item (the thinking split), a `message` with `output_text`, and `function_call`
//! items; streamed, it is the Responses event sequence (`response.created`, `…output_item.added`,
//! `…output_text.delta`, …, `response.completed`).
//!
//! Not yet: `previous_response_id` and retrieving or deleting a stored response (responses are
//! not stored); such requests are refused with a message that says so.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::http::header;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use futures_util::Stream;
use serde_json::{json, Map, Value};

use super::json::JsonBody;
use super::openai::{self, Assembler, CallOut, ChatAssembler};
use super::{AppState, WebError};
use crate::error::ApiError;
use smolchat_service::completions::{Completion, GenEvent, GenSummary, StopReason};

/// Registers `/v1/responses` (before the `/v1` scope, which would take the path) behind the
/// same key check and headers as `/v1`; its errors are OpenAI's.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/v1/responses")
            .wrap(actix_web::middleware::from_fn(openai::require_api_key))
            .wrap(super::api_headers())
            .route(web::post().to(create))
            .default_service(web::to(openai::method_not_allowed)),
    );
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
            "instructions" | "input" | "tools" | "tool_choice" | "text" | "reasoning" => {}
            "previous_response_id" | "conversation" if !value.is_null() => {
                return Err(ApiError::invalid(
                    key,
                    format!(
                        "`{key}` is not supported yet (this server does not store responses); \
                         send the earlier turns in `input`"
                    ),
                ))
            }
            // Accepted without effect: responses are not stored, one tier, no truncation.
            "store"
            | "metadata"
            | "parallel_tool_calls"
            | "truncation"
            | "service_tier"
            | "include"
            | "background"
            | "previous_response_id"
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
    let translated = translate(&body)?;
    let req = openai::checked_chat(&state, &http, &translated, Some("text.format"))?;
    let model = openai::model_name(&state.platform, &req.common);
    let parse_tool_calls = req.parse_tool_calls();
    let prompt = openai::build_chat_prompt(&state, &req).await?;
    let assembler = ChatAssembler::new(prompt.starts_in_reasoning, parse_tool_calls);
    let stream = req.common.stream;
    let max_output_tokens = req.common.max_tokens;
    let salt = openai::cache_salt(&http, &req.common);
    let user = openai::client_identity(&http);
    let mut completion =
        openai::submit(&state, req.common, salt, user, prompt.tokens, "input").await?;
    let base = Base {
        id: format!("resp_{}", uuid::Uuid::now_v7().simple()),
        message_id: format!("msg_{}", uuid::Uuid::now_v7().simple()),
        created_at: openai::unix_now(),
        model,
        echo: echo_fields(&body, max_output_tokens),
    };
    if stream {
        let mut s = EventStream {
            completion,
            assembler,
            base,
            out: VecDeque::new(),
            sequence: 0,
            text: None,
            done: false,
        };
        let created = s.base.response("in_progress", Vec::new(), None);
        s.event("response.created", json!({"response": created}));
        s.event("response.in_progress", json!({"response": created}));
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header((header::CACHE_CONTROL, "no-cache"))
            .insert_header(("X-Accel-Buffering", "no"))
            .streaming(s));
    }
    let mut assembler = assembler;
    while let Some(event) = futures_util::StreamExt::next(&mut completion).await {
        match event {
            GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
            GenEvent::Token { text, .. } => {
                if !text.is_empty() {
                    assembler.push(&text);
                }
            }
            GenEvent::Finished(summary) => {
                if let StopReason::Error(e) = &summary.reason {
                    return Err(openai::generation_failed(e));
                }
                assembler.finish(&summary.reason);
                openai::log_finished(completion.id(), &summary);
                let output = base.output(&assembler);
                return Ok(HttpResponse::Ok().json(base.response(
                    status(&summary),
                    output,
                    Some(&summary),
                )));
            }
        }
    }
    Err(ApiError::unavailable(openai::WORKER_GONE))
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
struct Base {
    id: String,
    message_id: String,
    created_at: u64,
    model: String,
    echo: Map<String, Value>,
}

impl Base {
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

    fn reasoning_item(&self, text: &str) -> Value {
        json!({"type": "reasoning", "id": format!("rs_{}", &self.message_id[4..]),
            "summary": [{"type": "summary_text", "text": text}]})
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        json!({"type": "message", "id": self.message_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }

    fn output(&self, a: &ChatAssembler) -> Vec<Value> {
        let mut output = Vec::new();
        if !a.reasoning().is_empty() {
            output.push(self.reasoning_item(a.reasoning()));
        }
        if !a.content().is_empty() || a.calls().is_empty() {
            output.push(self.message_item(a.content(), "completed"));
        }
        output.extend(a.calls().iter().map(call_item));
        output
    }
}

fn call_item(c: &CallOut) -> Value {
    json!({"type": "function_call", "id": c.id.replacen("call_", "fc_", 1), "call_id": c.id,
        "name": c.name, "arguments": c.arguments, "status": "completed"})
}

/// The streamed response: the Responses event sequence. Dropping it (the client went away)
/// cancels the request through its [`Completion`].
struct EventStream {
    completion: Completion,
    assembler: ChatAssembler,
    base: Base,
    out: VecDeque<Bytes>,
    sequence: u64,
    /// The output index of the open message item and its text so far.
    text: Option<(usize, String)>,
    done: bool,
}

impl EventStream {
    fn event(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.out
            .push_back(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")));
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
            json!({"item_id": self.base.message_id, "output_index": index, "content_index": 0,
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
            json!({"item_id": self.base.message_id, "output_index": index, "content_index": 0,
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
            let id = self.base.message_id.clone();
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
        let calls: Vec<Value> = self.assembler.calls().iter().map(call_item).collect();
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
    }

    fn on_event(&mut self, event: GenEvent) {
        match event {
            GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
            GenEvent::Token { text, .. } => {
                if text.is_empty() {
                    return;
                }
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
                    let err = openai::generation_failed(e);
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
                openai::log_finished(self.completion.id(), &summary);
                self.done = true;
            }
        }
    }
}

impl openai::EventStream for EventStream {
    fn completion(&mut self) -> &mut Completion {
        &mut self.completion
    }

    fn queued(&mut self) -> &mut VecDeque<Bytes> {
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
            json!({"code": "server_error", "param": null, "message": openai::WORKER_GONE}),
        );
        self.done = true;
    }
}

impl Stream for EventStream {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        openai::poll_events(self.get_mut(), cx)
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
            refused(json!({"input": "x", "previous_response_id": "resp_1"})),
            Some("previous_response_id".into())
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
}
