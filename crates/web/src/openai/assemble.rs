//! From generated text to OpenAI response pieces. An assembler is fed the text of each token as
//! it arrives and returns the `choices[0]` objects to stream for it; at the end it gives the
//! final streamed choice (with `finish_reason`) and the whole non-streamed choice. Both endpoints
//! build streamed and non-streamed responses from the same assembler, so the two agree by
//! construction. No I/O here: tests drive assemblers with scripted text deltas.

use serde_json::{json, Value};

use super::request::python_json;
use smolchat_service::completions::StopReason;
use smolchat_text::splitter::{SplitEvent, Splitter, ToolCall, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

pub trait Assembler: Unpin + Send + 'static {
    /// The `object` of a streamed chunk.
    const CHUNK_OBJECT: &'static str;
    /// The `object` of a whole response.
    const OBJECT: &'static str;

    /// Choices to stream before any text (chat: the `role` delta).
    fn start(&mut self) -> Vec<Value>;
    /// Choices to stream for the next piece of generated text.
    fn push(&mut self, text: &str) -> Vec<Value>;
    /// Flushes what was held back; the last choice carries `finish_reason`.
    fn finish(&mut self, reason: &StopReason) -> Vec<Value>;
    /// The whole choice of a non-streamed response (call after [`Assembler::finish`]).
    fn choice(&self) -> Value;
}

/// OpenAI's `finish_reason` for how generation ended.
pub fn finish_reason(reason: &StopReason, made_tool_calls: bool) -> &'static str {
    match reason {
        StopReason::EndOfGeneration | StopReason::StopString(_) if made_tool_calls => "tool_calls",
        StopReason::EndOfGeneration | StopReason::StopString(_) | StopReason::Cancelled => "stop",
        StopReason::Length | StopReason::TimeLimit => "length",
        StopReason::Error(_) => "error",
    }
}

/// A tool call as returned to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct CallOut {
    pub id: String,
    pub name: String,
    /// JSON-encoded, as OpenAI sends them.
    pub arguments: String,
}

fn call_id() -> String {
    let hex = uuid::Uuid::now_v7().simple().to_string();
    // The random tail: ids of calls made in the same millisecond still differ.
    format!("call_{}", &hex[hex.len() - 24..])
}

/// Chat completions: splits reasoning, answer and tool calls.
pub struct ChatAssembler {
    splitter: Splitter,
    parse_tool_calls: bool,
    content: String,
    reasoning: String,
    calls: Vec<CallOut>,
    finish_reason: &'static str,
}

impl ChatAssembler {
    /// `starts_in_reasoning`: the prompt ends inside an open think block. `parse_tool_calls`:
    /// the request offered tools (otherwise tool-call markup stays in the content).
    pub fn new(starts_in_reasoning: bool, parse_tool_calls: bool) -> Self {
        Self {
            splitter: Splitter::new(starts_in_reasoning),
            parse_tool_calls,
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            finish_reason: "stop",
        }
    }

    fn choice_delta(delta: Value) -> Value {
        json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})
    }

    /// Turns split events into streamed deltas, keeping the totals for the whole response.
    fn deltas(&mut self, events: Vec<SplitEvent>) -> Vec<Value> {
        let mut out = Vec::new();
        for event in events {
            match event {
                SplitEvent::Reasoning(t) => {
                    self.reasoning.push_str(&t);
                    out.push(json!({"reasoning_content": t}));
                }
                SplitEvent::Answer(t) => {
                    self.content.push_str(&t);
                    out.push(json!({"content": t}));
                }
                SplitEvent::ToolCall(call) if self.parse_tool_calls => {
                    let index = self.calls.len();
                    let call = CallOut {
                        id: call_id(),
                        arguments: match &call.arguments {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        },
                        name: call.name,
                    };
                    // As OpenAI streams a call: id, type and name first with empty arguments,
                    // then the arguments.
                    out.push(
                        json!({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}]}),
                    );
                    out.push(json!({"tool_calls": [{"index": index,
                        "function": {"arguments": call.arguments}}]}));
                    self.calls.push(call);
                }
                // Without tools offered (or a call that does not parse), the markup is text.
                SplitEvent::ToolCall(ToolCall { name, arguments }) => {
                    let body = python_json(&json!({"name": name, "arguments": arguments}));
                    let t = self.markup(&format!("\n{body}\n"));
                    out.push(json!({"content": t}));
                }
                SplitEvent::InvalidToolCall { raw, error } => {
                    tracing::debug!(%error, "the model wrote an invalid tool call; returned as text");
                    let t = self.markup(&raw);
                    out.push(json!({"content": t}));
                }
            }
        }
        out.into_iter().map(Self::choice_delta).collect()
    }

    fn markup(&mut self, body: &str) -> String {
        let sep = if self.content.is_empty() { "" } else { "\n" };
        let t = format!("{sep}{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}");
        self.content.push_str(&t);
        t
    }

    pub fn content(&self) -> &str {
        &self.content
    }

    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    pub fn calls(&self) -> &[CallOut] {
        &self.calls
    }
}

impl Assembler for ChatAssembler {
    const CHUNK_OBJECT: &'static str = "chat.completion.chunk";
    const OBJECT: &'static str = "chat.completion";

    fn start(&mut self) -> Vec<Value> {
        vec![Self::choice_delta(
            json!({"role": "assistant", "content": ""}),
        )]
    }

    fn push(&mut self, text: &str) -> Vec<Value> {
        let events = self.splitter.push(text);
        self.deltas(events)
    }

    fn finish(&mut self, reason: &StopReason) -> Vec<Value> {
        let events = self.splitter.finish();
        let mut out = self.deltas(events);
        self.finish_reason = finish_reason(reason, !self.calls.is_empty());
        out.push(json!({"index": 0, "delta": {}, "logprobs": null,
            "finish_reason": self.finish_reason}));
        out
    }

    fn choice(&self) -> Value {
        let mut message = json!({
            "role": "assistant",
            // OpenAI: null content when the reply is only tool calls.
            "content": if self.content.is_empty() && !self.calls.is_empty() {
                Value::Null
            } else {
                Value::String(self.content.clone())
            },
        });
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = Value::String(self.reasoning.clone());
        }
        if !self.calls.is_empty() {
            message["tool_calls"] = self
                .calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
        }
        json!({"index": 0, "message": message, "logprobs": null,
            "finish_reason": self.finish_reason})
    }
}

/// Text completions: the generated text as is.
pub struct TextAssembler {
    text: String,
    finish_reason: &'static str,
}

impl TextAssembler {
    pub fn new() -> Self {
        Self {
            text: String::new(),
            finish_reason: "stop",
        }
    }

    fn choice_text(text: &str, finish: Option<&str>) -> Value {
        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
    }
}

impl Default for TextAssembler {
    fn default() -> Self {
        Self::new()
    }
}

impl Assembler for TextAssembler {
    const CHUNK_OBJECT: &'static str = "text_completion";
    const OBJECT: &'static str = "text_completion";

    fn start(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn push(&mut self, text: &str) -> Vec<Value> {
        self.text.push_str(text);
        vec![Self::choice_text(text, None)]
    }

    fn finish(&mut self, reason: &StopReason) -> Vec<Value> {
        self.finish_reason = finish_reason(reason, false);
        vec![Self::choice_text("", Some(self.finish_reason))]
    }

    fn choice(&self) -> Value {
        Self::choice_text(&self.text, Some(self.finish_reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds scripted text deltas; returns every streamed choice and the non-streamed choice.
    fn script(
        deltas: &[&str],
        reason: StopReason,
        starts_in_reasoning: bool,
        tools: bool,
    ) -> (Vec<Value>, Value) {
        let mut a = ChatAssembler::new(starts_in_reasoning, tools);
        let mut streamed = a.start();
        for d in deltas {
            streamed.extend(a.push(d));
        }
        streamed.extend(a.finish(&reason));
        (streamed, a.choice())
    }

    /// Accumulates streamed choices the way OpenAI's client libraries do, into a message.
    fn accumulate(streamed: &[Value]) -> (Value, Option<String>) {
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut calls: Vec<Value> = Vec::new();
        let mut finish = None;
        for c in streamed {
            let d = &c["delta"];
            if let Some(t) = d["content"].as_str() {
                content.push_str(t);
            }
            if let Some(t) = d["reasoning_content"].as_str() {
                reasoning.push_str(t);
            }
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                let i = tc["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    calls.push(json!({"id": tc["id"], "type": "function",
                        "function": {"name": tc["function"]["name"], "arguments": ""}}));
                }
                let args = tc["function"]["arguments"].as_str().unwrap_or("");
                let prev = calls[i]["function"]["arguments"]
                    .as_str()
                    .unwrap()
                    .to_string();
                calls[i]["function"]["arguments"] = Value::String(prev + args);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
        let mut m = json!({"role": "assistant",
            "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(content) }});
        if !reasoning.is_empty() {
            m["reasoning_content"] = Value::String(reasoning);
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        (m, finish)
    }

    fn assert_stream_matches(streamed: &[Value], whole: &Value) {
        let (message, finish) = accumulate(streamed);
        assert_eq!(message, whole["message"], "streamed: {streamed:#?}");
        assert_eq!(finish.as_deref(), whole["finish_reason"].as_str());
    }

    #[test]
    fn plain_answer() {
        let (s, whole) = script(
            &["Hel", "lo", " world"],
            StopReason::EndOfGeneration,
            false,
            false,
        );
        assert_eq!(whole["message"]["content"], "Hello world");
        assert_eq!(whole["finish_reason"], "stop");
        assert!(whole["message"].get("reasoning_content").is_none());
        assert_eq!(s[0]["delta"]["role"], "assistant");
        assert_stream_matches(&s, &whole);
        let (_, whole) = script(&["a"], StopReason::Length, false, false);
        assert_eq!(whole["finish_reason"], "length");
    }

    #[test]
    fn think_becomes_reasoning_content() {
        let deltas = [
            "<th",
            "ink>\nLet me",
            " think.",
            "\n</thi",
            "nk>\n\nThe answer",
            " is 4.",
        ];
        let (s, whole) = script(&deltas, StopReason::EndOfGeneration, false, false);
        assert_eq!(whole["message"]["reasoning_content"], "Let me think.");
        assert_eq!(whole["message"]["content"], "The answer is 4.");
        assert_stream_matches(&s, &whole);
        // A prompt that opened the think block: the output starts as reasoning.
        let (s, whole) = script(
            &["hmm", "</think>", "ok"],
            StopReason::EndOfGeneration,
            true,
            false,
        );
        assert_eq!(whole["message"]["reasoning_content"], "hmm");
        assert_eq!(whole["message"]["content"], "ok");
        assert_stream_matches(&s, &whole);
    }

    #[test]
    fn tool_calls_in_fragments() {
        let deltas = [
            "<think>I need the weather.</think>\n",
            "Let me check.\n<tool",
            "_call>\n{\"name\": \"get_",
            "weather\", \"argu",
            "ments\": {\"city\": \"Par",
            "is\"}}\n</tool_",
            "call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
        ];
        let (s, whole) = script(&deltas, StopReason::EndOfGeneration, false, true);
        let m = &whole["message"];
        assert_eq!(whole["finish_reason"], "tool_calls");
        assert_eq!(m["reasoning_content"], "I need the weather.");
        assert_eq!(m["content"], "Let me check.");
        let calls = m["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        assert_eq!(calls[1]["function"]["name"], "get_time");
        assert_eq!(calls[1]["function"]["arguments"], "{}");
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        // Streamed: a header delta (id, type, name, empty arguments), then the arguments.
        let tool_deltas: Vec<&Value> = s
            .iter()
            .filter_map(|c| c["delta"].get("tool_calls"))
            .collect();
        assert_eq!(tool_deltas.len(), 4);
        assert_eq!(tool_deltas[0][0]["function"]["arguments"], "");
        assert_eq!(tool_deltas[0][0]["id"], calls[0]["id"]);
        assert!(tool_deltas[1][0].get("id").is_none());
        assert_stream_matches(&s, &whole);

        // Only a call: content is null.
        let (s, whole) = script(
            &["<tool_call>{\"name\": \"f\"}</tool_call>"],
            StopReason::EndOfGeneration,
            false,
            true,
        );
        assert_eq!(whole["message"]["content"], Value::Null);
        assert_stream_matches(&s, &whole);
        // A call cut off by the token limit still parses if complete, but the reason is length.
        let (_, whole) = script(
            &["<tool_call>{\"name\": \"f\", \"arguments\": {}}"],
            StopReason::Length,
            false,
            true,
        );
        assert_eq!(whole["finish_reason"], "length");
        assert_eq!(whole["message"]["tool_calls"][0]["function"]["name"], "f");
    }

    #[test]
    fn tool_markup_without_tools_stays_text() {
        let (s, whole) = script(
            &["Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"],
            StopReason::EndOfGeneration,
            false,
            false,
        );
        assert_eq!(whole["finish_reason"], "stop");
        assert!(whole["message"].get("tool_calls").is_none());
        assert_eq!(
            whole["message"]["content"],
            "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"
        );
        assert_stream_matches(&s, &whole);
        // Invalid call bodies stay text even with tools offered.
        let (s, whole) = script(
            &["<tool_call>not json</tool_call>"],
            StopReason::EndOfGeneration,
            false,
            true,
        );
        assert_eq!(
            whole["message"]["content"],
            "<tool_call>not json</tool_call>"
        );
        assert_eq!(whole["finish_reason"], "stop");
        assert_stream_matches(&s, &whole);
    }

    #[test]
    fn text_completion() {
        let mut a = TextAssembler::new();
        let mut s = a.start();
        for d in ["Once", " upon", " a time"] {
            s.extend(a.push(d));
        }
        s.extend(a.finish(&StopReason::StopString("\n".into())));
        let text: String = s.iter().map(|c| c["text"].as_str().unwrap()).collect();
        assert_eq!(text, "Once upon a time");
        assert_eq!(a.choice()["text"], "Once upon a time");
        assert_eq!(a.choice()["finish_reason"], "stop");
        assert_eq!(s.last().unwrap()["finish_reason"], "stop");
    }
}
