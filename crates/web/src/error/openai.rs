//! `ApiError`: refusals of the OpenAI-compatible API in OpenAI's error shape,
//! `{"error": {"message", "type", "param", "code"}}`, with the status code OpenAI (and
//! llama-server, vLLM) would give. Client libraries pick their exception class from the status
//! (`openai.BadRequestError` for 400, `AuthenticationError` for 401, …) and show `message`, so the
//! message says which field is wrong and why.

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::WebError;
use smolchat_service::completions::SubmitError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type` (`invalid_request_error`, `authentication_error`, …).
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable reason (`context_length_exceeded`, `model_not_found`, …).
    pub code: Option<&'static str>,
    /// Sent as `Retry-After` (overload).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400: a field has the wrong type or value. `param` names the field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).with_param(param)
    }

    /// 400 without a particular field (the body as a whole is wrong).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400: a feature smolchat does not offer (rather than silently doing something else).
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid(param, message).with_code("unsupported_parameter")
    }

    /// 403: allowed to others, not to this client (`ignore_eos` without admin rights).
    pub fn forbidden(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message).with_param(param)
    }

    /// A refusal of the one settings check, with the field it names.
    pub fn from_settings(e: smolchat_service::settings::SettingsError) -> Self {
        use smolchat_service::settings::SettingsError;
        let field = e.field();
        match e {
            SettingsError::AdminOnly { message, .. } => Self::forbidden(field, message),
            other => Self::invalid(field, other.to_string()),
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
            .with_code("invalid_api_key")
    }

    pub fn model_not_found(asked: &str, served: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{asked}` does not exist; this server serves {served}"),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            message,
        )
    }

    /// 400 `context_length_exceeded`, worded like OpenAI's, with both numbers.
    pub fn context_exceeded(prompt_tokens: usize, window: usize, param: &str) -> Self {
        Self::invalid(
            param,
            format!(
                "This model's maximum context length is {window} tokens. However, your request \
                 has {prompt_tokens} prompt tokens (at least one more is needed for the reply). \
                 Please reduce the length of the {param}."
            ),
        )
        .with_code("context_length_exceeded")
    }

    pub fn overloaded(message: impl Into<String>, retry_after_s: u64) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            .with_code("overloaded");
        e.retry_after_s = Some(retry_after_s.max(1));
        e
    }

    /// 429: this client has as much work waiting as one client may (OpenAI's
    /// `rate_limit_exceeded`, which the client libraries retry after `Retry-After`).
    pub fn rate_limited(message: impl Into<String>, retry_after_s: u64) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .with_code("rate_limit_exceeded");
        e.retry_after_s = Some(retry_after_s.max(1));
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).with_code("unavailable")
    }

    /// 500. The detail is logged; the client gets a short message.
    pub fn internal(detail: impl Into<String>) -> Self {
        let detail = detail.into();
        tracing::error!(error = %detail, "API request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal server error; see the server log",
        )
    }

    /// The JSON body (also sent as a `data:` event when a stream fails midway).
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ApiError {}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), error = %self.message, "API request refused");
        } else {
            tracing::debug!(status = self.status.as_u16(), error = %self.message, "API request refused");
        }
        let mut response = HttpResponse::build(self.status);
        // About this request only: never sniffed as another type, never cached.
        response.insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"));
        response.insert_header((header::CACHE_CONTROL, "no-store"));
        if let Some(s) = self.retry_after_s {
            response.insert_header((header::RETRY_AFTER, HeaderValue::from(s)));
        }
        response.json(self.body())
    }
}

/// Body-reading refusals of the shared JSON extractor, re-shaped.
impl From<WebError> for ApiError {
    fn from(e: WebError) -> Self {
        let status = actix_web::ResponseError::status_code(&e);
        match e {
            WebError::PayloadTooLarge(m) => {
                Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", m)
                    .with_code("request_too_large")
            }
            WebError::InvalidJson(m) | WebError::BadRequest(m) => {
                Self::bad_body(m).with_code("invalid_json")
            }
            WebError::UnsupportedMediaType(m) => {
                Self::new(status, "invalid_request_error", m).with_code("unsupported_media_type")
            }
            WebError::Overloaded {
                message,
                retry_after_s,
            } => Self::overloaded(message, retry_after_s),
            WebError::TooManyRequests {
                message,
                retry_after_s,
            } => Self::rate_limited(message, retry_after_s),
            WebError::Internal(detail) => Self::internal(detail),
            other => Self::new(status, "server_error", other.to_string()),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Overloaded { retry_after_s, .. } => {
                Self::overloaded(e.to_string(), retry_after_s)
            }
            SubmitError::ContextOverflow {
                prompt_tokens,
                window,
            } => Self::context_exceeded(prompt_tokens, window, "messages"),
            SubmitError::ExceedsKvCache { .. } => {
                Self::invalid("messages", e.to_string()).with_code("context_length_exceeded")
            }
            SubmitError::Invalid(m) => Self::bad_body(m),
            SubmitError::Unavailable(_) => Self::unavailable(e.to_string()),
            SubmitError::UserLimit { retry_after_s, .. }
            | SubmitError::TokenLimit { retry_after_s, .. }
            | SubmitError::GroupTokenLimit { retry_after_s, .. }
            | SubmitError::Quota { retry_after_s, .. } => {
                Self::rate_limited(e.to_string(), retry_after_s)
            }
        }
    }
}
