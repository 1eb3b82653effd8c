//! `POST /v1/embeddings` (OpenAI's shape): each input's final hidden states pooled (mean by
//! default, `"pooling": "last"` for the last position) and L2-normalized, computed by the
//! engine through the one completions service, so inputs batch with everyone's replies under
//! the same fair sharing, per-user limits and API keys. Ollama's `/api/embed` and
//! `/api/embeddings` (in `ollama.rs`) call [`embed`] too.
//!
//! What the model cannot do is refused, never approximated: `dimensions` other than the
//! model's own (its vectors are not trained to be shortened), encodings other than `float` and
//! `base64`.

use actix_web::{web, HttpRequest, HttpResponse};
use base64::Engine as _;
use serde_json::{json, Value};

use super::json::JsonBody;
use super::openai;
use super::openai::body::PromptItem;
use super::typed::{self, Count};
use super::v1;
use super::{AppState, WebError};
use crate::error::ApiError;
use serde::Deserialize;
use smolchat_service::completions::{
    EmbedError, EmbeddingRequest, Embeddings, Pooling, SubmitError, MAX_EMBEDDING_INPUTS,
};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/v1/embeddings")
            .wrap(actix_web::middleware::from_fn(v1::require_api_key))
            .wrap(super::api_headers())
            .route(web::post().to(create))
            .default_service(web::to(openai::method_not_allowed)),
    );
}

/// One input to embed: text (tokenized as `/v1/completions` prompts are) or token ids.
#[derive(Debug, Clone)]
pub(crate) enum Input {
    Text(String),
    Tokens(Vec<u32>),
}

/// OpenAI's `input`: a string, an array of strings, an array of token ids or an array of arrays
/// of token ids.
#[derive(Debug, Clone)]
pub(crate) struct Inputs(pub Vec<Input>);

impl<'de> Deserialize<'de> for Inputs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, SeqAccess, Visitor};
        const SHAPES: &str = "a string, an array of strings, an array of token ids or an array of \
                              arrays of token ids";
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Inputs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(SHAPES)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Inputs, E> {
                Ok(Inputs(vec![Input::Text(s.to_string())]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Inputs, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    items.push(item);
                }
                if !items.is_empty() && items.iter().all(|i| matches!(i, PromptItem::Token(_))) {
                    let ids = items
                        .into_iter()
                        .filter_map(|i| match i {
                            PromptItem::Token(id) => Some(id),
                            _ => None,
                        })
                        .collect();
                    return Ok(Inputs(vec![Input::Tokens(ids)]));
                }
                items
                    .into_iter()
                    .map(|i| match i {
                        PromptItem::Text(s) => Ok(Input::Text(s)),
                        PromptItem::Tokens(ids) => Ok(Input::Tokens(ids)),
                        PromptItem::Token(_) => {
                            Err(de::Error::custom(format!("must be {SHAPES}, not a mix")))
                        }
                    })
                    .collect::<Result<_, _>>()
                    .map(Inputs)
            }
        }
        d.deserialize_any(V)
    }
}

/// The inputs of one request, checked: at least one, at most [`MAX_EMBEDDING_INPUTS`]. `field`
/// names them in errors.
pub(crate) fn checked_inputs(
    inputs: Option<Vec<Input>>,
    field: &str,
) -> Result<Vec<Input>, ApiError> {
    let Some(inputs) = inputs else {
        return Err(ApiError::invalid(field, format!("`{field}` is required")));
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid(
            field,
            format!("`{field}` is empty: give at least one input"),
        ));
    }
    if inputs.len() > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            field,
            EmbedError::TooMany {
                count: inputs.len(),
            }
            .to_string(),
        ));
    }
    Ok(inputs)
}

/// Embeds `inputs` for the API caller: tokenized off the event loop, each checked against the
/// vocabulary and the context window (cut to fit it when `truncate`), then computed through the
/// one completions service. `field` names the inputs in errors.
pub(crate) async fn embed(
    state: &web::Data<AppState>,
    http: &HttpRequest,
    model: &std::sync::Arc<smolchat_service::models::ServedModel>,
    inputs: Vec<Input>,
    pooling: Pooling,
    truncate: bool,
    field: &str,
) -> Result<Embeddings, ApiError> {
    if !state.ready.load(std::sync::atomic::Ordering::Acquire) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let m = std::sync::Arc::clone(model);
    let tokenized = web::block(move || {
        inputs
            .into_iter()
            .map(|input| match input {
                Input::Text(text) => v1::encode(&m, &text),
                Input::Tokens(ids) => Ok(ids),
            })
            .collect::<Result<Vec<Vec<u32>>, ApiError>>()
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??;
    let vocab = model.info().vocab_size;
    // The prompt must leave the window one position, as every request's must.
    let window = model.info().context_window;
    let mut prompts = Vec::with_capacity(tokenized.len());
    for (i, mut ids) in tokenized.into_iter().enumerate() {
        let at = format!("{field}[{i}]");
        if ids.is_empty() {
            return Err(ApiError::invalid(
                at.clone(),
                format!("`{at}` is empty: there is nothing to embed"),
            ));
        }
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                at,
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        if ids.len() >= window {
            if !truncate {
                return Err(ApiError::context_exceeded(ids.len(), window, &at));
            }
            ids.truncate(window - 1);
        }
        prompts.push(ids);
    }
    let user = v1::client_identity(http);
    let request = EmbeddingRequest {
        inputs: prompts,
        pooling,
        user: Some(user.clone()),
        cache_salt: v1::cache_salt_of(http, ""),
        usage_owner: Some(user),
        background: false,
    };
    model
        .completions()
        .embed(request)
        .await
        .map_err(|e| embed_error(e, field))
}

fn embed_error(e: EmbedError, field: &str) -> ApiError {
    match e {
        EmbedError::Refused {
            index,
            error:
                SubmitError::ContextOverflow {
                    prompt_tokens,
                    window,
                },
        } => ApiError::context_exceeded(prompt_tokens, window, &format!("{field}[{index}]")),
        EmbedError::Refused {
            index,
            error: error @ SubmitError::ExceedsKvCache { .. },
        } => ApiError::invalid(format!("{field}[{index}]"), error.to_string()),
        EmbedError::Refused { error, .. } => ApiError::from(error),
        EmbedError::Empty | EmbedError::TooMany { .. } => ApiError::invalid(field, e.to_string()),
        EmbedError::Failed { failure, .. } => v1::generation_failed(&failure),
    }
}

/// How a vector is written in the answer (`encoding_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Encoding {
    Float,
    /// Little-endian f32 bytes, base64 (what the `openai` client asks for by default).
    Base64,
}

fn encoded(vector: &[f32], encoding: Encoding) -> Value {
    match encoding {
        Encoding::Float => json!(vector),
        Encoding::Base64 => {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

/// The pooling a request names (`pooling`, this server's extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum PoolingIn {
    Mean,
    Last,
}

impl From<PoolingIn> for Pooling {
    fn from(p: PoolingIn) -> Pooling {
        match p {
            PoolingIn::Mean => Pooling::Mean,
            PoolingIn::Last => Pooling::Last,
        }
    }
}

/// Refuses `dimensions` other than the model's own (`field` names it).
pub(crate) fn check_dimensions(
    dimensions: Option<Count>,
    hidden: usize,
    field: &str,
) -> Result<(), ApiError> {
    match dimensions {
        None => Ok(()),
        Some(Count(n)) if n == hidden => Ok(()),
        Some(_) => Err(ApiError::unsupported(
            field,
            format!(
                "`{field}` cannot shorten this model's embeddings: they have {hidden} dimensions \
                 and the model was not trained for shorter ones; leave `{field}` out"
            ),
        )),
    }
}

/// A `POST /v1/embeddings` body.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an object")]
struct EmbeddingsBody {
    model: Option<String>,
    encoding_format: Option<Encoding>,
    dimensions: Option<Count>,
    pooling: Option<PoolingIn>,
    input: Option<Inputs>,
}

async fn create(
    http: HttpRequest,
    state: web::Data<AppState>,
    body: Result<JsonBody<Value>, WebError>,
) -> Result<HttpResponse, ApiError> {
    let JsonBody(body) = body?;
    let p = &state.platform;
    let body: EmbeddingsBody = typed::read(&body, "")?;
    let model = body.model;
    let served = v1::resolve_model(p, model.as_deref().unwrap_or("")).await?;
    let encoding = body.encoding_format.unwrap_or(Encoding::Float);
    check_dimensions(body.dimensions, served.info().hidden_size, "dimensions")?;
    let pooling = body.pooling.map_or(Pooling::Mean, Pooling::from);
    let inputs = checked_inputs(body.input.map(|Inputs(i)| i), "input")?;
    let result = embed(&state, &http, &served, inputs, pooling, false, "input").await?;
    let data: Vec<Value> = result
        .vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            json!({
                "object": "embedding",
                "index": index,
                "embedding": encoded(v, encoding),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "data": data,
        "model": model.filter(|m| !m.is_empty()).unwrap_or_else(|| served.id().to_string()),
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "total_tokens": result.prompt_tokens,
        },
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_come_in_four_shapes_and_anything_else_is_refused() {
        let kinds = |v: Value| {
            let body = json!({ "input": v });
            typed::read::<EmbeddingsBody>(&body, "")
                .and_then(|b| checked_inputs(b.input.map(|Inputs(i)| i), "input"))
                .map(|inputs| {
                    inputs
                        .iter()
                        .map(|i| match i {
                            Input::Text(t) => format!("text:{t}"),
                            Input::Tokens(ids) => format!("ids:{ids:?}"),
                        })
                        .collect::<Vec<_>>()
                })
        };
        assert_eq!(kinds(json!("hi")), Ok(vec!["text:hi".to_string()]));
        assert_eq!(
            kinds(json!(["a", "b"])),
            Ok(vec!["text:a".to_string(), "text:b".to_string()])
        );
        assert_eq!(kinds(json!([1, 2])), Ok(vec!["ids:[1, 2]".to_string()]));
        assert_eq!(
            kinds(json!([[1], [2, 3]])),
            Ok(vec!["ids:[1]".to_string(), "ids:[2, 3]".to_string()])
        );
        for (bad, param) in [
            (json!([]), "input"),
            (json!(3), "input"),
            (json!({"a": 1}), "input"),
            (json!([1, "x"]), "input"),
            (json!([[-1]]), "input[0][0]"),
            (json!(null), "input"),
        ] {
            let e = kinds(bad.clone()).expect_err("refused");
            assert_eq!(e.status.as_u16(), 400, "{bad}");
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {e:?}");
        }
        let many = Value::Array(vec![json!("x"); MAX_EMBEDDING_INPUTS + 1]);
        assert!(kinds(many)
            .expect_err("too many")
            .message
            .contains("split them"));
    }

    #[test]
    fn dimensions_other_than_the_models_are_refused_and_base64_is_little_endian_f32() {
        assert!(check_dimensions(None, 576, "dimensions").is_ok());
        assert!(check_dimensions(Some(Count(576)), 576, "dimensions").is_ok());
        let e = check_dimensions(Some(Count(256)), 576, "dimensions").expect_err("refused");
        assert_eq!(e.code, Some("unsupported_parameter"));
        assert!(e.message.contains("576 dimensions"), "{}", e.message);
        let e = typed::read::<EmbeddingsBody>(&json!({"dimensions": "x"}), "").expect_err("type");
        assert_eq!(e.param.as_deref(), Some("dimensions"));
        let b64 = encoded(&[1.0, -2.5], Encoding::Base64);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64.as_str().unwrap_or_default())
            .unwrap_or_default();
        assert_eq!(
            bytes,
            [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat()
        );
        let pooling = |v: Value| {
            typed::read::<EmbeddingsBody>(&json!({ "pooling": v }), "").map(|b| b.pooling)
        };
        assert_eq!(pooling(json!("last")), Ok(Some(PoolingIn::Last)));
        assert_eq!(
            pooling(json!("cls")).expect_err("cls").param.as_deref(),
            Some("pooling")
        );
    }
}
