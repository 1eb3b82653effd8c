//! A `POST /v1/messages` body, read as types and turned into the one typed chat request: the
//! system prompt, text blocks, `tool_use`/`tool_result` blocks, tools, `tool_choice`,
//! `stop_sequences`, sampling, `thinking` and `output_config.format`. Unknown fields are refused,
//! as Anthropic's server refuses them; images and documents are refused by name.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::openai::body::{CallBody, ChatBody, GenerationBody, MessageBody, ToolChoice};
use crate::typed::{self, Count, Number, Schema, Strings};

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
pub(super) fn translate(body: &Value) -> Result<(GenerationBody, ChatBody), ApiError> {
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
}
