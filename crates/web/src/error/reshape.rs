//! Other APIs' error shapes over [`ApiError`]: the Ollama and Anthropic routes answer their own
//! clients' shapes, while what is refused, with which status and message, is decided once (by
//! `ApiError`). [`reshape`] re-shapes refusals made before a handler runs (the API key check
//! answers in OpenAI's shape); handlers return their API's wrapper error directly.

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{header, StatusCode};
use actix_web::middleware::Next;
use actix_web::{HttpResponse, ResponseError};
use serde_json::Value;

use super::ApiError;

/// Builds an API's error body from the refusal's status, message and OpenAI error `type`.
pub type Shape = fn(StatusCode, &str, &str) -> Value;

/// `error`'s status and `Retry-After`/`WWW-Authenticate`, with `shape`'s body.
pub fn respond(error: &ApiError, shape: Shape) -> HttpResponse {
    reshaped(
        &error.error_response(),
        shape(error.status, &error.message, error.kind),
    )
}

fn reshaped(response: &HttpResponse, body: Value) -> HttpResponse {
    let mut out = HttpResponse::build(response.status());
    for name in [header::RETRY_AFTER, header::WWW_AUTHENTICATE] {
        if let Some(v) = response.headers().get(&name) {
            out.insert_header((name, v.clone()));
        }
    }
    out.insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"));
    out.insert_header((header::CACHE_CONTROL, "no-store"));
    out.json(body)
}

/// Middleware body: runs the request, and when the answer is an OpenAI-shaped JSON refusal,
/// answers `shape`'s body instead (same status and retry headers).
pub async fn reshape(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
    shape: Shape,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let http = req.request().clone();
    let res = match next.call(req).await {
        Ok(res) => res.map_into_boxed_body(),
        Err(e) => ServiceResponse::new(http, e.error_response()),
    };
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || !is_json {
        return Ok(res);
    }
    let (http, response) = res.into_parts();
    let head = response.head().clone();
    let bytes = actix_web::body::to_bytes(response.into_body())
        .await
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let Some(error) = body["error"].as_object() else {
        // Already in the API's own shape (a handler's error).
        let mut same = HttpResponse::build(status);
        for (name, value) in head.headers.iter() {
            same.insert_header((name.clone(), value.clone()));
        }
        return Ok(ServiceResponse::new(http, same.body(bytes)));
    };
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("the request was refused");
    let kind = error
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("invalid_request_error");
    let mut rebuilt = HttpResponse::build(status);
    for (name, value) in head.headers.iter() {
        if name != header::CONTENT_LENGTH && name != header::CONTENT_TYPE {
            rebuilt.insert_header((name.clone(), value.clone()));
        }
    }
    Ok(ServiceResponse::new(
        http,
        rebuilt.json(shape(status, message, kind)),
    ))
}
