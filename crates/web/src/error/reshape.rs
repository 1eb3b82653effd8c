//! Other APIs' error shapes over [`ApiError`]: the Ollama and Anthropic routes answer their own
//! clients' shapes, while what is refused, with which status and message, is decided once (by
//! `ApiError`). Handlers return [`Shaped`] errors; [`reshape`] re-shapes refusals made before a
//! handler runs (the API key check answers in OpenAI's shape).

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{header, StatusCode};
use actix_web::middleware::Next;
use actix_web::{HttpRequest, HttpResponse, ResponseError};
use serde_json::Value;
use std::marker::PhantomData;

use super::{ApiError, WebError};

/// How an API writes its error bodies.
pub trait ErrorShape: 'static {
    /// The body of a refusal from its status, message and OpenAI error `type`.
    fn body(status: StatusCode, message: &str, kind: &str) -> Value;
}

/// A refusal decided by [`ApiError`], answered in `S`'s shape (same status and retry headers).
pub struct Shaped<S: ErrorShape>(pub ApiError, PhantomData<S>);

impl<S: ErrorShape> Shaped<S> {
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        ApiError::invalid(field, message).into()
    }
}

impl<S: ErrorShape> std::fmt::Debug for Shaped<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<S: ErrorShape> std::fmt::Display for Shaped<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.message)
    }
}

impl<S: ErrorShape> From<ApiError> for Shaped<S> {
    fn from(e: ApiError) -> Self {
        Self(e, PhantomData)
    }
}

impl<S: ErrorShape> From<WebError> for Shaped<S> {
    fn from(e: WebError) -> Self {
        ApiError::from(e).into()
    }
}

impl<S: ErrorShape> ResponseError for Shaped<S> {
    fn status_code(&self) -> StatusCode {
        self.0.status
    }

    fn error_response(&self) -> HttpResponse {
        reshaped(
            &self.0.error_response(),
            S::body(self.0.status, &self.0.message, self.0.kind),
        )
    }
}

/// The default service of an API's routes: 405 in `S`'s shape.
pub async fn method_not_allowed<S: ErrorShape>(
    req: HttpRequest,
) -> Result<HttpResponse, Shaped<S>> {
    Err(
        ApiError::method_not_allowed(format!("{} is not allowed on {}", req.method(), req.path()))
            .into(),
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

/// Middleware (`from_fn(reshape::<S>)`): runs the request, and when the answer is an
/// OpenAI-shaped JSON refusal, answers `S`'s body instead (same status and retry headers).
pub async fn reshape<S: ErrorShape>(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
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
        rebuilt.json(S::body(status, message, kind)),
    ))
}
