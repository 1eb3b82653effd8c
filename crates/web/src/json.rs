//! JSON request bodies. actix-web's own `Json` extractor answers bad bodies in plain text and
//! cannot take an optional body, so the API reads bodies itself: the size limit is enforced while
//! reading (413 before the whole body is buffered), the content type must be JSON (415), the bytes
//! must be UTF-8 and the JSON must match the endpoint's type exactly, unknown fields included
//! (400). Every refusal is a [`WebError`], so it has the API's JSON error shape.

use std::future::Future;
use std::pin::Pin;

use actix_web::dev::Payload;
use actix_web::http::header;
use actix_web::web::{Bytes, BytesMut};
use actix_web::{FromRequest, HttpRequest};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use super::error::WebError;

/// The largest JSON body accepted, in bytes (app data; a default applies when it is missing).
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

impl Default for BodyLimit {
    fn default() -> Self {
        BodyLimit(1 << 20)
    }
}

/// A required JSON body.
pub struct JsonBody<T>(pub T);

/// A JSON body that may be left out entirely (no bytes at all, or only whitespace).
pub struct OptionalJsonBody<T>(pub Option<T>);

type BodyFuture<T> = Pin<Box<dyn Future<Output = Result<T, WebError>>>>;

impl<T: DeserializeOwned + 'static> FromRequest for JsonBody<T> {
    type Error = WebError;
    type Future = BodyFuture<Self>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let read = read_json::<T>(req.clone(), payload.take());
        Box::pin(async move {
            match read.await? {
                Some(value) => Ok(JsonBody(value)),
                None => Err(WebError::InvalidJson(
                    "this endpoint needs a JSON body (Content-Type: application/json)".into(),
                )),
            }
        })
    }
}

impl<T: DeserializeOwned + 'static> FromRequest for OptionalJsonBody<T> {
    type Error = WebError;
    type Future = BodyFuture<Self>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let read = read_json::<T>(req.clone(), payload.take());
        Box::pin(async move { Ok(OptionalJsonBody(read.await?)) })
    }
}

/// Whether the request says its body is JSON (`application/json` or any `…+json`).
fn content_type_is_json(req: &HttpRequest) -> Option<bool> {
    let value = req.headers().get(header::CONTENT_TYPE)?;
    let Ok(text) = value.to_str() else {
        return Some(false);
    };
    let essence = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    Some(essence == "application/json" || essence.ends_with("+json"))
}

/// How long a request body may take to arrive (app data; a default applies when it is missing).
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout(pub std::time::Duration);

impl Default for BodyTimeout {
    fn default() -> Self {
        BodyTimeout(std::time::Duration::from_secs(30))
    }
}

/// Runs a body read under the body timeout, so a client trickling its body cannot hold a
/// connection and a buffer for ever.
pub async fn within_body_timeout(
    req: &HttpRequest,
    read: impl Future<Output = Result<(), WebError>>,
) -> Result<(), WebError> {
    let limit = req.app_data::<BodyTimeout>().copied().unwrap_or_default().0;
    match actix_web::rt::time::timeout(limit, read).await {
        Ok(done) => done,
        Err(_) => Err(WebError::RequestTimeout(format!(
            "the request body did not arrive within {} s",
            limit.as_secs()
        ))),
    }
}

/// Reads and parses the body; `None` when there is no body at all.
async fn read_json<T: DeserializeOwned>(
    req: HttpRequest,
    payload: Payload,
) -> Result<Option<T>, WebError> {
    match read_json_text(&req, payload).await? {
        Some(text) => serde_json::from_str(&text).map(Some).map_err(json_error),
        None => Ok(None),
    }
}

/// Reads a JSON body as text, with every check [`JsonBody`] makes before parsing: the size limit
/// (while reading), the content type, UTF-8, the body timeout. `None` when there is no body at
/// all. For bodies parsed elsewhere (off the event loop, or with limits of their own).
pub async fn read_json_text(
    req: &HttpRequest,
    payload: Payload,
) -> Result<Option<String>, WebError> {
    let limit = req.app_data::<BodyLimit>().copied().unwrap_or_default().0;
    let too_large =
        || WebError::PayloadTooLarge(format!("the request body is larger than {limit} bytes"));
    // A declared size over the limit is refused first, then a declared non-JSON type, both
    // before reading anything.
    if declared_length(req).is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let is_json = content_type_is_json(req);
    if is_json == Some(false) {
        return Err(WebError::UnsupportedMediaType(
            "the request body must be JSON (Content-Type: application/json)".into(),
        ));
    }
    let body = read_bytes(req, payload, limit, too_large).await?;
    let text = String::from_utf8(body).map_err(|e| {
        WebError::InvalidJson(format!(
            "the request body is not valid UTF-8 (bad byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })?;
    if text.trim().is_empty() {
        return Ok(None);
    }
    if is_json.is_none() {
        return Err(WebError::UnsupportedMediaType(
            "the request body must be JSON (Content-Type: application/json)".into(),
        ));
    }
    Ok(Some(text))
}

/// Reads a raw body of at most `limit` bytes (an upload, or a JSON body), under the body timeout; a longer
/// body (declared or read) is `too_large`, refused before it is all read.
pub async fn read_bytes(
    req: &HttpRequest,
    mut payload: Payload,
    limit: usize,
    too_large: impl Fn() -> WebError,
) -> Result<Vec<u8>, WebError> {
    let declared = declared_length(req);
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    // Sized once from the declared length (bounded by the limit), so a large body is not
    // copied again and again as the buffer doubles.
    let mut body = BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
    let read = async {
        while let Some(chunk) = payload.next().await {
            let chunk: Bytes = chunk.map_err(|e| {
                WebError::BadRequest(format!("the request body could not be read: {e}"))
            })?;
            if body.len() + chunk.len() > limit {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(())
    };
    within_body_timeout(req, read).await?;
    // Into a `Vec` without a copy: the buffer has one owner.
    Ok(Vec::from(body))
}

/// The body size the request declares (`Content-Length`), if any.
fn declared_length(req: &HttpRequest) -> Option<usize> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
}

/// A JSON parse error as the client's fault, saying what was wrong.
pub fn json_error(e: serde_json::Error) -> WebError {
    let what = if e.is_data() {
        "the JSON body does not fit this endpoint"
    } else {
        "the request body is not valid JSON"
    };
    // serde_json's words for a lone UTF-16 surrogate (`"\ud800"`) do not say what is wrong.
    let hint = if e.to_string().contains("hex escape") || e.to_string().contains("surrogate") {
        " (a \\uD800-\\uDFFF escape must be one half of a surrogate pair, followed by the \
         other half; a lone surrogate is not a character)"
    } else {
        ""
    };
    WebError::InvalidJson(format!("{what}: {e}{hint}"))
}
