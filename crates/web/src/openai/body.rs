//! The chat and text completion request bodies as types: the one typed request every API dialect
//! produces. OpenAI's routes read it from the client's JSON ([`crate::typed::read`]); Anthropic,
//! Ollama and Responses read their own bodies and build it in Rust. [`super::request`] then
//! checks it once, for all of them, into a [`super::request::ChatRequest`].
//!
//! Fields smolchat has no use for (`metadata`, `store`, `service_tier`, …) are not declared, so
//! serde ignores them, as llama-server does; `null` reads as absent (OpenAI's clients send it for
//! "not given"). A body is read as two structs, [`GenerationBody`] (what both endpoints share)
//! and the endpoint's own, rather than one with `#[serde(flatten)]`, which would lose the field
//! paths of the flattened part.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::typed::{Arguments, Count, Integer, Number, Object, Schema, Strings};

/// Model, streaming, sampling, stopping and output length: what chat and text completions share.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct GenerationBody {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<Integer>,
    pub logprobs: Option<Logprobs>,
    pub top_logprobs: Option<Count>,
    pub best_of: Option<Integer>,
    /// Token ids (as strings) to biases; checked, then ignored, as llama-server ignores them.
    pub logit_bias: Option<BTreeMap<String, Bias>>,
    /// OpenAI's end-user id; with `cache_salt` it separates cache partitions.
    pub user: Option<String>,
    /// vLLM's cache partition key.
    pub cache_salt: Option<String>,
    pub temperature: Option<Number>,
    pub top_p: Option<Number>,
    pub presence_penalty: Option<Number>,
    pub frequency_penalty: Option<Number>,
    // llama-server / vLLM extensions.
    pub top_k: Option<Count>,
    pub min_p: Option<Number>,
    pub repetition_penalty: Option<Number>,
    /// llama-server's spelling of `repetition_penalty`.
    pub repeat_penalty: Option<Number>,
    pub ignore_eos: Option<bool>,
    pub seed: Option<Integer>,
    pub stop: Option<Strings>,
    /// llama-server's JSON Schema field.
    pub json_schema: Option<Schema>,
    /// vLLM's guided decoding fields (`guided_grammar` in llguidance's Lark dialect).
    pub guided_json: Option<Schema>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    /// llama-server's GBNF.
    pub grammar: Option<String>,
    pub max_tokens: Option<Count>,
    /// What replaced `max_tokens` in OpenAI's API; both are accepted.
    pub max_completion_tokens: Option<Count>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `logprobs`: chat's `true`/`false`, or the legacy completions API's number of alternatives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logprobs {
    Flag(bool),
    Alternatives(usize),
}

impl<'de> Deserialize<'de> for Logprobs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Logprobs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("true, false or a number of alternatives")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<Logprobs, E> {
                Ok(Logprobs::Flag(b))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Logprobs, E> {
                Ok(Logprobs::Alternatives(
                    usize::try_from(n).unwrap_or(usize::MAX),
                ))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Logprobs, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!("must be >= 0, got {n}"))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A `logit_bias` value: a number between -100 and 100.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bias(pub f32);

impl<'de> Deserialize<'de> for Bias {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Number(b) = Number::deserialize(d)?;
        if (-100.0..=100.0).contains(&b) {
            Ok(Bias(b))
        } else {
            Err(de::Error::custom(format!(
                "must be between -100 and 100, got {b}"
            )))
        }
    }
}

/// What only `/v1/chat/completions` takes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct ChatBody {
    pub messages: Option<Vec<MessageBody>>,
    /// Kept as sent (the template prints them); each is checked as a [`ToolSpec`].
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<ToolChoice>,
    /// Accepted: constrained or not, calls come as the model writes them.
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<ResponseFormat>,
    /// `enable_thinking`, and any other variables for the template.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// An extension of `/v1/chat/completions`: knowledge collections to search for the last
    /// user message (ids, or `{"collections": [ids], "k": n}`). Read by
    /// [`super::request::knowledge`].
    pub knowledge: Option<Value>,
    /// An extension of `/v1/chat/completions`: tools the server runs for the caller (`true`:
    /// every tool offered to its key; or their names). Read by
    /// [`super::request::server_tools`].
    pub server_tools: Option<Value>,
}

/// One message of `messages`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct MessageBody {
    pub role: Option<String>,
    pub content: Option<Content>,
    pub reasoning_content: Option<String>,
    pub tool_calls: Option<Vec<CallBody>>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

impl MessageBody {
    /// A message of `role` with text `content`.
    pub fn text(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: Some(role.to_string()),
            content: Some(Content::Text(content.into())),
            ..Self::default()
        }
    }
}

/// A message's `content`: a string, or an array of parts.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    Text(String),
    Parts(Vec<PartBody>),
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of text parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Content, E> {
                Ok(Content::Text(s.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<PartBody>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// A content part: `{"type": "text", "text"}` or `{"type": "file", "file": {…}}`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct PartBody {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub text: Option<String>,
    pub file: Option<FileBody>,
}

/// A `file` part's file: `filename` and `file_data` (base64, bare or as a `data:` URL).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct FileBody {
    pub file_id: Option<String>,
    pub filename: Option<String>,
    pub file_data: Option<String>,
}

/// A tool call of an earlier assistant turn.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct CallBody {
    pub id: Option<String>,
    pub function: Option<CallFunction>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct CallFunction {
    pub name: Option<String>,
    pub arguments: Option<Arguments>,
}

impl CallBody {
    /// A call of `name` with JSON-encoded `arguments`.
    pub fn new(id: Option<String>, name: &str, arguments: String) -> Self {
        Self {
            id,
            function: Some(CallFunction {
                name: Some(name.to_string()),
                arguments: Some(Arguments(arguments)),
            }),
        }
    }
}

/// One entry of `tools`, as it is checked.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct ToolSpec {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: Option<FunctionSpec>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct FunctionSpec {
    pub name: Option<String>,
    pub description: Option<String>,
    pub parameters: Option<Object>,
}

/// `tool_choice`: `"auto"`, `"none"`, `"required"`, or `{"type": "function", "function":
/// {"name"}}` (a named function, `Named(None)` when the name is missing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Mode(String),
    Named(Option<String>),
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Named {
            function: Option<NamedFunction>,
        }
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct NamedFunction {
            name: Option<String>,
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ToolChoice;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an object")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ToolChoice, E> {
                Ok(ToolChoice::Mode(s.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ToolChoice, A::Error> {
                let named = Named::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(ToolChoice::Named(named.function.and_then(|f| f.name)))
            }
        }
        d.deserialize_any(V)
    }
}

/// `response_format`: `text`, `json_object`, or `json_schema` with its schema.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub json_schema: Option<JsonSchemaFormat>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct JsonSchemaFormat {
    /// OpenAI's `strict` asks for exactly what constrained decoding always gives.
    pub strict: Option<bool>,
    pub name: Option<String>,
    /// An object, `true` (any JSON), or absent (any JSON object).
    pub schema: Option<Value>,
}

/// What only `/v1/completions` takes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub struct CompletionBody {
    pub prompt: Option<Prompt>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
}

/// `prompt`: a string, token ids, or an array of either, of which smolchat completes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// An array of this many prompts (not one).
    Several(usize),
}

/// One element of a `prompt` array (and of `/v1/embeddings`' `input`).
pub(crate) enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

/// A token id: an integer from 0 to `u32::MAX`.
struct TokenId(u32);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Integer(i) = Integer::deserialize(d)?;
        u32::try_from(i).map(TokenId).map_err(|_| {
            de::Error::custom(format!("must be a token id (an integer >= 0), got {i}"))
        })
    }
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id or an array of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(s.to_string()))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<PromptItem, E> {
                u32::try_from(n).map(PromptItem::Token).map_err(|_| {
                    E::custom(format!("must be a token id (an integer >= 0), got {n}"))
                })
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<PromptItem, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "must be a token id (an integer >= 0), got {n}"
                    ))),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::new();
                while let Some(TokenId(id)) = seq.next_element()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of token ids, or an array of one string")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(s.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    items.push(item);
                }
                if items.is_empty() {
                    return Err(de::Error::custom("is empty"));
                }
                if items.iter().all(|i| matches!(i, PromptItem::Token(_))) {
                    let ids = items
                        .into_iter()
                        .filter_map(|i| match i {
                            PromptItem::Token(id) => Some(id),
                            _ => None,
                        })
                        .collect();
                    return Ok(Prompt::Tokens(ids));
                }
                match <[PromptItem; 1]>::try_from(items) {
                    Ok([PromptItem::Text(s)]) => Ok(Prompt::Text(s)),
                    Ok([PromptItem::Tokens(ids)]) => Ok(Prompt::Tokens(ids)),
                    Ok([PromptItem::Token(id)]) => Ok(Prompt::Tokens(vec![id])),
                    Err(items) => Ok(Prompt::Several(items.len())),
                }
            }
        }
        d.deserialize_any(V)
    }
}
