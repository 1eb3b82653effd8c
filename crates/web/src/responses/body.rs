//! A `POST /v1/responses` body, read as types and turned into the one typed chat request:
//! `instructions` and `input` (text, or message, `function_call` and `function_call_output`
//! items) as messages, function `tools`, `tool_choice`, `text.format`, `reasoning.effort`,
//! sampling and `max_output_tokens`. Unknown fields are refused, as OpenAI refuses them.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::openai::body::{
    CallBody, ChatBody, GenerationBody, JsonSchemaFormat, MessageBody, ResponseFormat, ToolChoice,
};
use crate::typed::{self, Arguments, Count, Integer, Number};

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct ResponsesBody {
    model: Option<String>,
    stream: Option<bool>,
    temperature: Option<Number>,
    top_p: Option<Number>,
    user: Option<String>,
    seed: Option<Integer>,
    top_logprobs: Option<Count>,
    max_output_tokens: Option<Count>,
    instructions: Option<TextParts>,
    input: Option<Input>,
    tools: Option<Vec<ToolIn>>,
    tool_choice: Option<ToolChoiceIn>,
    text: Option<TextConfig>,
    reasoning: Option<ReasoningIn>,
    previous_response_id: Option<String>,
    store: Option<bool>,
    conversation: Option<Value>,
}

/// Every top-level field [`ResponsesBody`] reads, and those accepted without effect: one tier,
/// no truncation, no background runs.
const KNOWN_FIELDS: &[&str] = &[
    "model",
    "stream",
    "temperature",
    "top_p",
    "user",
    "seed",
    "top_logprobs",
    "max_output_tokens",
    "instructions",
    "input",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "previous_response_id",
    "store",
    "conversation",
    "metadata",
    "parallel_tool_calls",
    "truncation",
    "service_tier",
    "include",
    "background",
    "prompt_cache_key",
    "safety_identifier",
];

/// `input`: a string (one user message) or an array of items.
#[derive(Debug)]
enum Input {
    Text(String),
    Items(Vec<Item>),
}

/// One `input` item; which fields matter depends on `type` (a message when it has none).
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct Item {
    #[serde(rename = "type")]
    kind: Option<String>,
    role: Option<String>,
    content: Option<TextParts>,
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<Arguments>,
    output: Option<Value>,
}

/// A message's content (or `instructions`): a string, or an array of text parts.
#[derive(Debug)]
enum TextParts {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct Part {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
}

/// A string or an array of `T`, as a visitor: `input` and content both take either.
struct TextOrSeq<T>(std::marker::PhantomData<T>, &'static str);

impl<'de, T: Deserialize<'de>> Visitor<'de> for TextOrSeq<T> {
    type Value = Result<String, Vec<T>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.1)
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Ok(s.to_string()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<T>()? {
            items.push(item);
        }
        Ok(Err(items))
    }
}

impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = TextOrSeq(std::marker::PhantomData, "a string or an array of items");
        Ok(match d.deserialize_any(v)? {
            Ok(s) => Input::Text(s),
            Err(items) => Input::Items(items),
        })
    }
}

impl<'de> Deserialize<'de> for TextParts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = TextOrSeq(
            std::marker::PhantomData,
            "a string or an array of text parts",
        );
        Ok(match d.deserialize_any(v)? {
            Ok(s) => TextParts::Text(s),
            Err(parts) => TextParts::Parts(parts),
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct ToolIn {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
    description: Option<String>,
    parameters: Option<Value>,
}

/// `tool_choice`: `auto`, `none`, `required`, or `{"type": "function", "name"}`.
#[derive(Debug)]
enum ToolChoiceIn {
    Mode(String),
    Object {
        kind: Option<String>,
        name: Option<String>,
    },
}

impl<'de> Deserialize<'de> for ToolChoiceIn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Named {
            #[serde(rename = "type")]
            kind: Option<String>,
            name: Option<String>,
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ToolChoiceIn;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("auto, none, required or {\"type\": \"function\", \"name\": …}")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ToolChoiceIn, E> {
                Ok(ToolChoiceIn::Mode(s.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ToolChoiceIn, A::Error> {
                let n = Named::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(ToolChoiceIn::Object {
                    kind: n.kind,
                    name: n.name,
                })
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct TextConfig {
    format: Option<FormatIn>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct FormatIn {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
    schema: Option<Value>,
    strict: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct ReasoningIn {
    effort: Option<String>,
}

/// A Responses request as the one typed chat request, with what `create` needs besides.
#[derive(Debug)]
pub(super) struct ResponsesRequest {
    pub generation: GenerationBody,
    /// Its `messages` are `instructions` then `input`; earlier turns go between them.
    pub chat: ChatBody,
    /// Whether the first message is the `instructions`.
    pub has_instructions: bool,
    /// `input` as messages (stored with the response).
    pub input: Vec<MessageBody>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
}

fn text_of(content: Option<TextParts>, field: &str) -> Result<String, ApiError> {
    match content {
        None => Err(ApiError::invalid(
            field,
            format!("`{field}` is required: a string or an array of text parts"),
        )),
        Some(TextParts::Text(s)) => Ok(s),
        Some(TextParts::Parts(parts)) => {
            let mut text = Vec::new();
            for (i, part) in parts.into_iter().enumerate() {
                match (part.kind.as_deref(), part.text) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push(t),
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
            Ok(text.join("\n"))
        }
    }
}

/// `input` as chat messages; a turn's calls join the assistant message before them.
fn input_messages(input: Option<Input>) -> Result<Vec<MessageBody>, ApiError> {
    let items = match input {
        None => return Err(ApiError::invalid("input", "`input` is required")),
        Some(Input::Text(s)) => return Ok(vec![MessageBody::text("user", s)]),
        Some(Input::Items(items)) => items,
    };
    let mut out: Vec<MessageBody> = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        match item.kind.as_deref().unwrap_or("message") {
            "message" => {
                let role = match item.role.as_deref() {
                    Some("developer") => "system",
                    Some(r @ ("user" | "assistant" | "system")) => r,
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{at}.role"),
                            "`role` must be user, assistant, system or developer",
                        ))
                    }
                };
                let content = text_of(item.content, &format!("{at}.content"))?;
                out.push(MessageBody::text(role, content));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (item.call_id, item.name) else {
                    return Err(ApiError::invalid(
                        &at,
                        "a function_call item needs `call_id` and `name`",
                    ));
                };
                let arguments = item.arguments.map_or_else(|| "{}".into(), |a| a.0);
                let call = CallBody::new(Some(call_id), &name, arguments);
                match out.last_mut() {
                    Some(last) if last.role.as_deref() == Some("assistant") => {
                        last.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => out.push(MessageBody {
                        tool_calls: Some(vec![call]),
                        ..MessageBody::text("assistant", "")
                    }),
                }
            }
            "function_call_output" => {
                let Some(call_id) = item.call_id else {
                    return Err(ApiError::invalid(
                        &at,
                        "a function_call_output item needs `call_id`",
                    ));
                };
                let output = match item.output {
                    Some(Value::String(s)) => s,
                    Some(other) => other.to_string(),
                    None => "null".to_string(),
                };
                out.push(MessageBody {
                    tool_call_id: Some(call_id),
                    ..MessageBody::text("tool", output)
                });
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

/// The request as the one typed chat request, or why it cannot be served.
pub(super) fn translate(body: &Value) -> Result<ResponsesRequest, ApiError> {
    if let Value::Object(obj) = body {
        typed::refuse_unknown(obj, "", KNOWN_FIELDS, "field")?;
    }
    let b: ResponsesBody = typed::read(body, "")?;
    if b.conversation.is_some() {
        return Err(ApiError::invalid(
            "conversation",
            "`conversation` objects are not supported; chain responses with \
             `previous_response_id`",
        ));
    }
    let mut messages = Vec::new();
    let has_instructions = b.instructions.is_some();
    if let Some(instructions) = b.instructions {
        messages.push(MessageBody::text(
            "system",
            text_of(Some(instructions), "instructions")?,
        ));
    }
    let input = input_messages(b.input)?;
    messages.extend(input.iter().cloned());
    let tools = b
        .tools
        .map(|tools| {
            tools
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    if t.kind.as_deref() != Some("function") {
                        return Err(ApiError::invalid(
                            format!("tools[{i}].type"),
                            "only function tools are supported",
                        ));
                    }
                    Ok(json!({"type": "function", "function": {
                        "name": t.name, "description": t.description,
                        "parameters": t.parameters.unwrap_or_else(|| json!({"type": "object"})),
                    }}))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let tool_choice = match b.tool_choice {
        None => None,
        Some(ToolChoiceIn::Mode(mode)) => Some(ToolChoice::Mode(mode)),
        Some(ToolChoiceIn::Object { kind, name }) if kind.as_deref() == Some("function") => {
            Some(ToolChoice::Named(name))
        }
        Some(ToolChoiceIn::Object { .. }) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be auto, none, required or {\"type\": \"function\", \
                 \"name\": …}",
            ))
        }
    };
    let response_format = match b.text.and_then(|t| t.format) {
        None => None,
        Some(f) => match f.kind.as_deref() {
            Some("text") => None,
            Some("json_object") => Some(ResponseFormat {
                kind: Some("json_object".into()),
                json_schema: None,
            }),
            Some("json_schema") => Some(ResponseFormat {
                kind: Some("json_schema".into()),
                json_schema: Some(JsonSchemaFormat {
                    strict: f.strict,
                    name: f.name,
                    schema: f.schema,
                }),
            }),
            _ => {
                return Err(ApiError::invalid(
                    "text.format",
                    "`text.format.type` must be text, json_object or json_schema",
                ))
            }
        },
    };
    // No reasoning effort levels here: any effort turns thinking on, "minimal" and "none" off.
    let chat_template_kwargs = b.reasoning.and_then(|r| r.effort).map(|effort| {
        let think = effort != "minimal" && effort != "none";
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(think));
        kwargs
    });
    Ok(ResponsesRequest {
        generation: GenerationBody {
            model: b.model,
            stream: b.stream,
            temperature: b.temperature,
            top_p: b.top_p,
            user: b.user,
            seed: b.seed,
            top_logprobs: b.top_logprobs,
            max_tokens: b.max_output_tokens,
            ..GenerationBody::default()
        },
        chat: ChatBody {
            messages: Some(messages),
            tools,
            tool_choice,
            response_format,
            chat_template_kwargs,
            ..ChatBody::default()
        },
        has_instructions,
        input,
        previous_response_id: b.previous_response_id,
        store: b.store,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_translate_into_the_one_request() {
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
        let m = t.chat.messages.clone().expect("messages");
        assert_eq!(m[0], MessageBody::text("system", "Be brief."));
        assert_eq!(m[1], MessageBody::text("user", "Hi"));
        assert_eq!(
            m[2].tool_calls,
            Some(vec![CallBody::new(
                Some("c1".into()),
                "f",
                "{\"a\":1}".into()
            )])
        );
        assert_eq!(
            m[3],
            MessageBody {
                tool_call_id: Some("c1".into()),
                ..MessageBody::text("tool", "3")
            }
        );
        assert_eq!(m[4].role.as_deref(), Some("system"));
        assert_eq!(t.input.len(), 4);
        assert!(t.has_instructions);
        assert_eq!(t.generation.max_tokens, Some(Count(20)));
        let tools = t.chat.tools.clone().unwrap_or_default();
        assert_eq!(tools[0]["function"]["name"], json!("f"));
        let format = t.chat.response_format.clone().expect("format");
        assert_eq!(format.kind.as_deref(), Some("json_schema"));
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
            refused(json!({"input": "x", "previous_response_id": 5})),
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
        assert_eq!(
            refused(
                json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]})
            ),
            Some("input[0].content[0].text".into())
        );
    }
}
