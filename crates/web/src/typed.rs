//! Reading JSON request bodies into typed structs (serde's derive), with refusals that name the
//! field. Every API dialect declares its body as structs of these field types and reads it with
//! [`read`]: serde_path_to_error keeps the path (`messages[2].content`), which becomes the
//! error's `param` and leads its message. The field types here take what clients really send
//! (`100.0` for an integer, a string or an array for `stop`) and say in words what they wanted.
//!
//! Bodies are read from a `serde_json::Value` (already parsed, within the body limit), not from
//! the bytes, so one dialect may look at its keys first (Anthropic and Ollama refuse unknown
//! ones) and the OpenAI routes read the same body as their shared and their own fields.

use std::fmt;

use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// What kind of JSON value `v` is, in words.
pub fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `param` joined onto `prefix` (`messages[2]` + `content`).
pub fn join(prefix: &str, param: &str) -> String {
    match (prefix.is_empty(), param.is_empty()) {
        (true, _) => param.to_string(),
        (_, true) => prefix.to_string(),
        _ if param.starts_with('[') => format!("{prefix}{param}"),
        _ => format!("{prefix}.{param}"),
    }
}

/// Reads `value` (found at `at` in the request; empty for the body itself) as a `T`. A body that
/// is not an object, a field of the wrong type or out of its type's range is a 400 whose `param`
/// is the field's path.
pub fn read<T: DeserializeOwned>(value: &Value, at: &str) -> Result<T, ApiError> {
    if at.is_empty() && !value.is_object() {
        return Err(ApiError::bad_body(format!(
            "the request body must be a JSON object, not {}",
            kind_of(value)
        )));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let param = join(at, if path == "." { "" } else { &path });
        let what = e.into_inner();
        if param.is_empty() {
            ApiError::bad_body(format!("the request body: {what}"))
        } else {
            ApiError::invalid(&param, format!("`{param}`: {what}"))
        }
    })
}

/// The keys of an object that are not in `known`, refused by name: for the dialects whose own
/// servers refuse unknown fields (Anthropic, Ollama's messages and options).
pub fn refuse_unknown(
    obj: &Map<String, Value>,
    at: &str,
    known: &[&str],
    what: &str,
) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(key) => Err(ApiError::invalid(
            join(at, key),
            format!("unknown {what} `{key}`"),
        )),
    }
}

/// A finite number; integers are numbers too.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Number(pub f32);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Number;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<Number, E> {
                let narrow = x as f32;
                if narrow.is_finite() {
                    Ok(Number(narrow))
                } else {
                    Err(E::custom(format!("must be a finite number, not {x}")))
                }
            }
            fn visit_i64<E: de::Error>(self, x: i64) -> Result<Number, E> {
                Ok(Number(x as f32))
            }
            fn visit_u64<E: de::Error>(self, x: u64) -> Result<Number, E> {
                Ok(Number(x as f32))
            }
        }
        d.deserialize_any(V)
    }
}

/// An integer; a float with no fraction (`100.0`) counts, as Python clients may send it. Values
/// past `i64::MAX` saturate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Integer(pub i64);

impl<'de> Deserialize<'de> for Integer {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Integer;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, x: i64) -> Result<Integer, E> {
                Ok(Integer(x))
            }
            fn visit_u64<E: de::Error>(self, x: u64) -> Result<Integer, E> {
                Ok(Integer(i64::try_from(x).unwrap_or(i64::MAX)))
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<Integer, E> {
                if x.fract() == 0.0 && x.abs() < 9.0e15 {
                    Ok(Integer(x as i64))
                } else {
                    Err(E::custom(format!("must be an integer, not {x}")))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A non-negative integer (a count of tokens, choices, alternatives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count(pub usize);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Integer(i) = Integer::deserialize(d)?;
        usize::try_from(i)
            .map(Count)
            .map_err(|_| de::Error::custom(format!("must be >= 0, got {i}")))
    }
}

/// A string, or an array of strings (`stop`, `stop_sequences`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Strings(pub Vec<String>);

impl<'de> Deserialize<'de> for Strings {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Strings;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Strings, E> {
                Ok(Strings(vec![s.to_string()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strings, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(Strings(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// A JSON object, kept as it came (a JSON Schema, a tool's parameters); with `from_string`
/// semantics where a field also takes the object written as a JSON string (llama-server's
/// `json_schema`).
#[derive(Debug, Clone, PartialEq)]
pub struct Object(pub Map<String, Value>);

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Object;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object, A::Error> {
                Map::deserialize(de::value::MapAccessDeserializer::new(map)).map(Object)
            }
        }
        d.deserialize_map(V)
    }
}

/// A JSON Schema: an object, or one written as a JSON string (llama-server and vLLM take both).
#[derive(Debug, Clone, PartialEq)]
pub struct Schema(pub Value);

impl<'de> Deserialize<'de> for Schema {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Schema;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON Schema object")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Schema, E> {
                match serde_json::from_str::<Value>(s) {
                    Ok(schema @ Value::Object(_)) => Ok(Schema(schema)),
                    _ => Err(E::custom(
                        "must be a JSON Schema object (a string must hold one as JSON)",
                    )),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Schema, A::Error> {
                Map::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|m| Schema(Value::Object(m)))
            }
        }
        d.deserialize_any(V)
    }
}

/// A tool call's arguments: a JSON-encoded string, as OpenAI sends them, or the object itself
/// (what Ollama and some clients send), kept as the encoded string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Arguments(pub String);

impl<'de> Deserialize<'de> for Arguments {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Arguments;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string (the arguments as JSON) or an object")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Arguments, E> {
                Ok(Arguments(s.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Arguments, A::Error> {
                Map::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|m| Arguments(Value::Object(m).to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    struct Body {
        n: Option<Count>,
        t: Option<Number>,
        stop: Option<Strings>,
        inner: Option<Inner>,
        list: Option<Vec<Inner>>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(expecting = "an object")]
    struct Inner {
        flag: Option<bool>,
    }

    #[test]
    fn errors_name_the_path() {
        let e = read::<Body>(&json!({"n": -1}), "").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        assert!(e.message.contains("must be >= 0, got -1"), "{e:?}");
        let e = read::<Body>(&json!({"n": 1.5}), "").unwrap_err();
        assert!(e.message.contains("must be an integer"), "{e:?}");
        let e = read::<Body>(&json!({"t": "hot"}), "").unwrap_err();
        assert_eq!(
            e.message,
            "`t`: invalid type: string \"hot\", expected a number"
        );
        let e = read::<Body>(&json!({"stop": ["a", 3]}), "").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop[1]"));
        let e = read::<Body>(&json!({"list": [{}, {"flag": "no"}]}), "").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("list[1].flag"));
        let e = read::<Body>(&json!({"inner": 5}), "").unwrap_err();
        assert!(e.message.contains("expected an object"), "{e:?}");
        let e = read::<Inner>(&json!({"flag": 1}), "messages[3]").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[3].flag"));
        let e = read::<Body>(&json!([1]), "").unwrap_err();
        assert_eq!(e.param, None);
        assert!(e.message.contains("not an array"), "{e:?}");
    }

    #[test]
    fn what_clients_send_is_taken() {
        let b = read::<Body>(
            &json!({"n": 100.0, "t": 1, "stop": "END", "inner": null, "list": [{"flag": true}]}),
            "",
        )
        .unwrap();
        assert_eq!(b.list.unwrap()[0].flag, Some(true));
        assert_eq!(b.n, Some(Count(100)));
        assert_eq!(b.t, Some(Number(1.0)));
        assert_eq!(b.stop, Some(Strings(vec!["END".into()])));
        assert!(b.inner.is_none());
        let s: Schema = read(&json!("{\"type\": \"object\"}"), "json_schema").unwrap();
        assert_eq!(s.0, json!({"type": "object"}));
        assert!(read::<Schema>(&json!("[1]"), "json_schema").is_err());
        let a: Arguments = read(&json!({"city": "Paris"}), "arguments").unwrap();
        assert_eq!(a.0, "{\"city\":\"Paris\"}");
        assert_eq!(join("a", "[2]"), "a[2]");
        assert_eq!(join("", "b"), "b");
    }
}
