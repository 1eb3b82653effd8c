//! Ollama's `/api/chat` and `/api/generate` bodies, read as types and turned into the one typed
//! request: Ollama's option names (`num_predict`, `repeat_penalty`, `repeat_last_n`, …) onto its
//! fields, `format` onto its grammar, `think` onto the template's switch, messages with Ollama's
//! tool calls (object arguments) and `tool_name`. Unknown options and message fields are
//! refused by name; what cannot be honoured (images, mirostat) is refused, not ignored.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::openai::body::{CallBody, CallFunction, Content, GenerationBody, MessageBody};
use crate::typed::{self, Arguments, Count, Integer, Number, Schema, Strings};

/// What both generating routes take: the model, streaming (on unless `false`), `format`,
/// `think` and `options`. `keep_alive` is accepted: the model stays loaded for the server's
/// lifetime whatever it says.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub(super) struct CommonIn {
    pub model: Option<String>,
    stream: Option<bool>,
    format: Option<Format>,
    think: Option<bool>,
    options: Option<Value>,
}

/// `format`: `"json"` (any JSON object) or a JSON Schema; `""` is none.
#[derive(Debug)]
enum Format {
    None,
    Json,
    Schema(Value),
}

impl<'de> Deserialize<'de> for Format {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Format;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("\"json\" or a JSON Schema object")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Format, E> {
                match s {
                    "" => Ok(Format::None),
                    "json" => Ok(Format::Json),
                    other => Err(E::custom(format!(
                        "must be \"json\" or a JSON Schema object, got \"{other}\""
                    ))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Format, A::Error> {
                Map::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|m| Format::Schema(Value::Object(m)))
            }
        }
        d.deserialize_any(V)
    }
}

/// `options`, by Ollama's names.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct OptionsIn {
    temperature: Option<Number>,
    top_p: Option<Number>,
    top_k: Option<Count>,
    min_p: Option<Number>,
    seed: Option<Integer>,
    stop: Option<Strings>,
    presence_penalty: Option<Number>,
    frequency_penalty: Option<Number>,
    repeat_penalty: Option<Number>,
    num_predict: Option<Integer>,
    repeat_last_n: Option<Integer>,
    mirostat: Option<Number>,
    mirostat_tau: Option<Number>,
    mirostat_eta: Option<Number>,
    typical_p: Option<Number>,
    tfs_z: Option<Number>,
}

/// Every option [`OptionsIn`] reads, and those that only tune how Ollama itself loads and runs
/// a model: this server's model is loaded once, with its own configuration (the context window
/// included), so these change nothing.
const KNOWN_OPTIONS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "num_predict",
    "repeat_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "typical_p",
    "tfs_z",
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "num_keep",
    "use_mmap",
    "use_mlock",
    "numa",
    "low_vram",
    "f16_kv",
    "vocab_only",
    "penalize_newline",
    "logits_all",
    "embedding_only",
];

/// What an Ollama request asks beyond the one request's fields.
#[derive(Debug, Default)]
pub(super) struct Extras {
    /// `options.repeat_last_n`: the penalties' window (-1: the whole context).
    pub repeat_last_n: Option<i64>,
    /// `think`: the template's thinking switch.
    pub think: Option<bool>,
}

/// `options` onto the one request's generation fields.
fn options(value: &Value, g: &mut GenerationBody) -> Result<Extras, ApiError> {
    if let Value::Object(obj) = value {
        typed::refuse_unknown(obj, "options", KNOWN_OPTIONS, "option")?;
    }
    let o: OptionsIn = typed::read(value, "options")?;
    // Sampling this server does not do: refused unless asked for as "off".
    for (name, value, off) in [
        ("mirostat", o.mirostat, Some(0.0)),
        ("typical_p", o.typical_p, Some(1.0)),
        ("tfs_z", o.tfs_z, Some(1.0)),
        ("mirostat_tau", o.mirostat_tau, None),
        ("mirostat_eta", o.mirostat_eta, None),
    ] {
        if let Some(Number(v)) = value {
            if Some(v) != off {
                return Err(ApiError::invalid(
                    format!("options.{name}"),
                    format!(
                        "`options.{name}` is not supported by this server (it samples with \
                         temperature, top_k, top_p, min_p and the penalties); remove it"
                    ),
                ));
            }
        }
    }
    match o.num_predict {
        // -1: until the model stops; -2: fill the context. Both are the default here (the
        // reply may use the room left in the context window).
        None | Some(Integer(-1 | -2)) => {}
        Some(Integer(n)) if n > 0 => g.max_tokens = Some(Count(n as usize)),
        Some(Integer(n)) => {
            return Err(ApiError::invalid(
                "options.num_predict",
                format!("`options.num_predict` must be a positive integer, -1 or -2, got {n}"),
            ))
        }
    }
    let repeat_last_n = match o.repeat_last_n {
        None => None,
        Some(Integer(n)) if n >= -1 => Some(n),
        Some(Integer(n)) => {
            return Err(ApiError::invalid(
                "options.repeat_last_n",
                format!("`options.repeat_last_n` must be an integer >= -1, got {n}"),
            ))
        }
    };
    g.temperature = o.temperature;
    g.top_p = o.top_p;
    g.top_k = o.top_k;
    g.min_p = o.min_p;
    g.seed = o.seed;
    g.stop = o.stop;
    g.presence_penalty = o.presence_penalty;
    g.frequency_penalty = o.frequency_penalty;
    g.repeat_penalty = o.repeat_penalty;
    Ok(Extras {
        repeat_last_n,
        think: None,
    })
}

/// The fields both generating routes share, as the one request's generation fields (its model
/// left out: Ollama's model names are checked by the caller) and the extras.
pub(super) fn generation(common: CommonIn) -> Result<(GenerationBody, Extras), ApiError> {
    let mut g = GenerationBody {
        stream: Some(common.stream.unwrap_or(true)),
        // Structured outputs, through the one request's `json_schema`.
        json_schema: match common.format {
            None | Some(Format::None) => None,
            Some(Format::Json) => Some(Schema(json!({"type": "object"}))),
            Some(Format::Schema(s)) => Some(Schema(s)),
        },
        ..GenerationBody::default()
    };
    let mut extras = match &common.options {
        Some(o) => options(o, &mut g)?,
        None => Extras::default(),
    };
    extras.think = common.think;
    Ok((g, extras))
}

/// The fields of an `/api/chat` message.
const KNOWN_MESSAGE_FIELDS: &[&str] = &[
    "role",
    "content",
    "tool_call_id",
    "tool_name",
    "thinking",
    "images",
    "tool_calls",
];

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct MessageIn {
    role: Option<String>,
    content: Option<Content>,
    tool_call_id: Option<String>,
    tool_name: Option<String>,
    images: Option<Vec<Value>>,
    tool_calls: Option<Vec<CallIn>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct CallIn {
    function: Option<FunctionIn>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct FunctionIn {
    name: Option<String>,
    arguments: Option<Arguments>,
}

/// `/api/chat`'s own fields.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub(super) struct ChatIn {
    messages: Option<Vec<Value>>,
    /// OpenAI's shape already: passed on as sent.
    pub tools: Option<Vec<Value>>,
}

impl ChatIn {
    /// Ollama's messages as the one request's: `images` refused, tool calls given ids,
    /// `thinking` dropped (a past reply's reasoning is not replayed), `tool_name` as `name`.
    pub(super) fn messages(&self) -> Result<Vec<MessageBody>, ApiError> {
        let Some(messages) = &self.messages else {
            return Err(ApiError::invalid("messages", "`messages` is required"));
        };
        let mut out = Vec::with_capacity(messages.len());
        for (i, value) in messages.iter().enumerate() {
            let at = format!("messages[{i}]");
            if let Value::Object(obj) = value {
                typed::refuse_unknown(obj, &at, KNOWN_MESSAGE_FIELDS, "message field")?;
            }
            let m: MessageIn = typed::read(value, &at)?;
            if m.images.is_some_and(|images| !images.is_empty()) {
                return Err(ApiError::invalid(
                    format!("{at}.images"),
                    "images are not supported: the served model reads text only",
                ));
            }
            let tool_calls = m.tool_calls.map(|calls| {
                calls
                    .into_iter()
                    .enumerate()
                    .map(|(j, c)| {
                        let f = c.function.unwrap_or_default();
                        CallBody {
                            id: Some(format!("call_{i}_{j}")),
                            function: Some(CallFunction {
                                name: f.name,
                                arguments: Some(f.arguments.unwrap_or(Arguments("{}".into()))),
                            }),
                        }
                    })
                    .collect()
            });
            out.push(MessageBody {
                role: m.role,
                content: m.content,
                tool_call_id: m.tool_call_id,
                name: m.tool_name,
                tool_calls,
                reasoning_content: None,
            });
        }
        Ok(out)
    }
}

/// `/api/generate`'s own fields.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub(super) struct GenerateIn {
    pub prompt: Option<String>,
    pub system: Option<String>,
    pub raw: Option<bool>,
    suffix: Option<String>,
    template: Option<String>,
    context: Option<Vec<Value>>,
    images: Option<Vec<Value>>,
}

impl GenerateIn {
    /// Refuses what `/api/generate` takes and this server cannot do.
    pub(super) fn check_supported(&self) -> Result<(), ApiError> {
        let string = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());
        let list = |l: &Option<Vec<Value>>| l.as_ref().is_some_and(|l| !l.is_empty());
        for (field, what, given) in [
            (
                "suffix",
                "fill-in-the-middle `suffix`",
                string(&self.suffix),
            ),
            ("template", "a custom `template`", string(&self.template)),
            (
                "context",
                "`context` (the deprecated token history)",
                list(&self.context),
            ),
            ("images", "`images`", list(&self.images)),
        ] {
            if given {
                return Err(ApiError::invalid(
                    field,
                    format!("{what} is not supported by this server; remove it"),
                ));
            }
        }
        Ok(())
    }
}

/// A request's model: `model`, or its older spelling `name`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub(super) struct ModelIn {
    model: Option<String>,
    name: Option<String>,
}

impl ModelIn {
    /// The model named, empty when none is.
    pub(super) fn name(&self) -> &str {
        model_name(&self.model, &self.name)
    }
}

/// `model`, else `name`, else empty.
fn model_name<'a>(model: &'a Option<String>, name: &'a Option<String>) -> &'a str {
    model.as_deref().or(name.as_deref()).unwrap_or("")
}

/// `/api/embed`: `input` as a string or an array of strings, cut to the context window unless
/// `"truncate": false`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub(super) struct EmbedIn {
    model: Option<String>,
    name: Option<String>,
    pub truncate: Option<bool>,
    pub dimensions: Option<Count>,
    pub input: Option<Strings>,
}

impl EmbedIn {
    pub(super) fn model_name(&self) -> &str {
        model_name(&self.model, &self.name)
    }
}

/// `/api/embeddings`, the older form: one `prompt`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
pub(super) struct EmbeddingsIn {
    model: Option<String>,
    name: Option<String>,
    pub prompt: Option<String>,
}

impl EmbeddingsIn {
    pub(super) fn model_name(&self) -> &str {
        model_name(&self.model, &self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options_of(v: Value) -> Result<(GenerationBody, Extras), ApiError> {
        generation(typed::read(&json!({"options": v}), "")?)
    }

    #[test]
    fn options_map_onto_the_one_request_and_refuse_what_cannot_be_honoured() {
        let (g, extras) = options_of(json!({"temperature": 0.2, "num_predict": 12,
            "repeat_penalty": 1.1, "repeat_last_n": 32, "num_ctx": 4096, "stop": ["x"],
            "mirostat": 0}))
        .expect("options");
        assert_eq!(g.temperature, Some(Number(0.2)));
        assert_eq!(g.max_tokens, Some(Count(12)));
        assert_eq!(g.repeat_penalty, Some(Number(1.1)));
        assert_eq!(g.stop, Some(Strings(vec!["x".into()])));
        assert_eq!(g.stream, Some(true));
        assert_eq!(extras.repeat_last_n, Some(32));
        let (g, _) = options_of(json!({"num_predict": -1})).expect("-1");
        assert_eq!(g.max_tokens, None);
        for (bad, field) in [
            (json!({"mirostat": 2}), "options.mirostat"),
            (json!({"mirostat_eta": 0.1}), "options.mirostat_eta"),
            (json!({"num_predict": 0}), "options.num_predict"),
            (json!({"bogus": 1}), "options.bogus"),
            (json!({"repeat_last_n": -5}), "options.repeat_last_n"),
            (json!({"temperature": "hot"}), "options.temperature"),
            (json!(5), "options"),
        ] {
            let e = options_of(bad.clone())
                .err()
                .unwrap_or_else(|| panic!("{bad} accepted"));
            assert_eq!(e.param.as_deref(), Some(field), "{bad}");
        }
    }

    #[test]
    fn messages_translate_tool_calls_and_refuse_images() {
        let chat = |messages: Value| -> Result<Vec<MessageBody>, ApiError> {
            typed::read::<ChatIn>(&json!({ "messages": messages }), "")?.messages()
        };
        let m = chat(json!([
            {"role": "user", "content": "hi", "images": []},
            {"role": "assistant", "content": "", "thinking": "hmm",
             "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "3", "tool_name": "f"},
        ]))
        .expect("messages");
        let call = m[1].tool_calls.clone().unwrap_or_default();
        assert_eq!(
            call[0].function.clone().and_then(|f| f.arguments),
            Some(Arguments("{\"a\":1}".into()))
        );
        assert_eq!(m[1].reasoning_content, None);
        assert_eq!(m[2].name.as_deref(), Some("f"));
        let e = chat(json!([{"role": "user", "content": "x", "images": ["aGk="]}]))
            .expect_err("images refused");
        assert_eq!(e.param.as_deref(), Some("messages[0].images"));
        let e = chat(json!([{"role": "user", "content": "x", "mood": "good"}]))
            .expect_err("unknown field");
        assert_eq!(e.param.as_deref(), Some("messages[0].mood"));
    }
}
