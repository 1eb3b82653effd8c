//! The web layer's errors, in one place: [`WebError`], every refusal the HTTP surface makes,
//! answered as `{"error": {"message": "...", "type": "..."}}` with a status code that says who is
//! at fault; and its two other faces, one per kind of client: [`PageError`] (the same refusals
//! shown as an HTML page, with the CSRF and admin refusals) and [`ApiError`] (OpenAI's error
//! shape, for `/v1`). The services' errors become these here and nowhere else.

mod openai;
mod page;
pub mod reshape;

pub use openai::ApiError;
pub use page::PageError;

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use smolchat_service::completions::SubmitError;
use smolchat_service::session::STORAGE_UNAVAILABLE;
use smolchat_service::ConversationError;

/// Seconds a client is asked to wait before retrying after a storage fault.
const STORAGE_RETRY_AFTER_S: u64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum WebError {
    /// The request is well-formed HTTP but its content is wrong (bad field, empty message, ...).
    #[error("{0}")]
    BadRequest(String),
    /// The body is not the JSON the endpoint takes.
    #[error("{0}")]
    InvalidJson(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    UriTooLong(String),
    /// `Host` names a host this server does not answer for (`server.allowed_hosts`).
    #[error("{0}")]
    MisdirectedHost(String),
    /// The body did not arrive in time.
    #[error("{0}")]
    RequestTimeout(String),
    /// Who the caller is could not be established (a sign-in proxy named a user this server
    /// cannot take).
    #[error("{0}")]
    Unauthorized(String),
    /// Allowed to others, not to this caller (admin-only settings).
    #[error("{0}")]
    Forbidden(String),
    /// Unknown ids and other owners' conversations alike (so ids cannot be probed).
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    Conflict(String),
    /// The prompt does not fit the model's context window.
    #[error("{0}")]
    ContextOverflow(String),
    /// The admission queue is full; the client should retry after `retry_after_s`.
    #[error("{message}")]
    Overloaded { message: String, retry_after_s: u64 },
    /// This user (or conversation) holds as much as one may: queued requests, open event
    /// streams. The client should retry after `retry_after_s`.
    #[error("{message}")]
    TooManyRequests { message: String, retry_after_s: u64 },
    /// The platform cannot serve right now (an actor is gone, the server is shutting down).
    #[error("{0}")]
    Unavailable(String),
    /// The store cannot be written right now (disk full, read-only, locked); nothing was saved
    /// and the client may retry.
    #[error("{0}")]
    StorageUnavailable(String),
    /// A fault on our side; the detail is logged, the client gets a short message.
    #[error("{0}")]
    Internal(String),
}

impl WebError {
    /// The `type` field of the JSON body: a stable, machine-readable category.
    pub fn kind(&self) -> &'static str {
        match self {
            WebError::BadRequest(_) => "invalid_request",
            WebError::InvalidJson(_) => "invalid_json",
            WebError::UnsupportedMediaType(_) => "unsupported_media_type",
            WebError::PayloadTooLarge(_) => "payload_too_large",
            WebError::UriTooLong(_) => "uri_too_long",
            WebError::MisdirectedHost(_) => "misdirected_request",
            WebError::RequestTimeout(_) => "request_timeout",
            WebError::Unauthorized(_) => "unauthorized",
            WebError::Forbidden(_) => "forbidden",
            WebError::NotFound(_) => "not_found",
            WebError::MethodNotAllowed(_) => "method_not_allowed",
            WebError::Conflict(_) => "conflict",
            WebError::ContextOverflow(_) => "context_overflow",
            WebError::Overloaded { .. } => "overloaded",
            WebError::TooManyRequests { .. } => "rate_limited",
            WebError::Unavailable(_) => "unavailable",
            WebError::StorageUnavailable(_) => "storage_unavailable",
            WebError::Internal(_) => "internal_error",
        }
    }

    pub fn conversation_not_found() -> Self {
        WebError::NotFound("conversation not found".into())
    }
}

impl ResponseError for WebError {
    fn status_code(&self) -> StatusCode {
        match self {
            WebError::BadRequest(_) | WebError::InvalidJson(_) | WebError::ContextOverflow(_) => {
                StatusCode::BAD_REQUEST
            }
            WebError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            WebError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            WebError::UriTooLong(_) => StatusCode::URI_TOO_LONG,
            WebError::MisdirectedHost(_) => StatusCode::MISDIRECTED_REQUEST,
            WebError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            WebError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            WebError::Forbidden(_) => StatusCode::FORBIDDEN,
            WebError::NotFound(_) => StatusCode::NOT_FOUND,
            WebError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            WebError::Conflict(_) => StatusCode::CONFLICT,
            WebError::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            WebError::Overloaded { .. }
            | WebError::Unavailable(_)
            | WebError::StorageUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            WebError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let status = self.status_code();
        let message = match self {
            // The detail may name files or SQL; it is in the log, not in the response.
            WebError::Internal(detail) => {
                tracing::error!(error = %detail, "request failed");
                "internal server error; see the server log".to_string()
            }
            other => {
                if status.is_server_error() {
                    tracing::warn!(status = status.as_u16(), error = %other, "request refused");
                } else {
                    tracing::debug!(status = status.as_u16(), error = %other, "request refused");
                }
                other.to_string()
            }
        };
        let mut response = HttpResponse::build(status);
        // An error body is JSON and about this request only: never sniffed as something else,
        // never cached.
        response.insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"));
        response.insert_header((header::CACHE_CONTROL, "no-store"));
        let retry_after_s = match self {
            WebError::Overloaded { retry_after_s, .. }
            | WebError::TooManyRequests { retry_after_s, .. } => Some((*retry_after_s).max(1)),
            WebError::StorageUnavailable(_) => Some(STORAGE_RETRY_AFTER_S),
            _ => None,
        };
        if let Some(s) = retry_after_s {
            response.insert_header((header::RETRY_AFTER, HeaderValue::from(s)));
        }
        response.json(json!({
            "error": { "message": message, "type": self.kind() }
        }))
    }
}

/// The knowledge service's refusals: as the conversation service's of the same kind.
impl From<smolchat_service::knowledge::KnowledgeError> for WebError {
    fn from(e: smolchat_service::knowledge::KnowledgeError) -> Self {
        ConversationError::from(e).into()
    }
}

/// The conversation service's refusals, one status code each.
impl From<ConversationError> for WebError {
    fn from(e: ConversationError) -> Self {
        match e {
            ConversationError::NotFound => WebError::conversation_not_found(),
            ConversationError::NoSuch(m) => WebError::NotFound(m),
            ConversationError::Invalid { message, .. } => WebError::BadRequest(message),
            ConversationError::TooLarge(m) => WebError::PayloadTooLarge(m),
            ConversationError::Forbidden(m) => WebError::Forbidden(m),
            ConversationError::Busy(m) => WebError::Conflict(m),
            ConversationError::ContextOverflow(m) => WebError::ContextOverflow(m),
            ConversationError::UserLimit {
                message,
                retry_after_s,
            } => WebError::TooManyRequests {
                message,
                retry_after_s,
            },
            ConversationError::Overloaded {
                message,
                retry_after_s,
            } => WebError::Overloaded {
                message,
                retry_after_s,
            },
            ConversationError::StorageUnavailable(m) => WebError::StorageUnavailable(m),
            ConversationError::Unavailable(m) => WebError::Unavailable(m),
            ConversationError::Internal(m) => WebError::Internal(m),
        }
    }
}

/// The sign-in layer's errors met outside a sign-in (looking up a session or a key): storage
/// faults are a 503 "try again", anything else a fault on our side.
impl From<smolchat_auth::AuthError> for WebError {
    fn from(e: smolchat_auth::AuthError) -> Self {
        if e.is_storage_unavailable() {
            tracing::warn!(error = %e, "storage unavailable");
            WebError::StorageUnavailable(STORAGE_UNAVAILABLE.to_string())
        } else {
            WebError::Internal(e.to_string())
        }
    }
}

impl From<SubmitError> for WebError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Overloaded { retry_after_s, .. } => WebError::Overloaded {
                message: e.to_string(),
                retry_after_s,
            },
            SubmitError::UserLimit { retry_after_s, .. }
            | SubmitError::TokenLimit { retry_after_s, .. }
            | SubmitError::GroupTokenLimit { retry_after_s, .. }
            | SubmitError::Quota { retry_after_s, .. } => WebError::TooManyRequests {
                message: e.to_string(),
                retry_after_s,
            },
            SubmitError::ContextOverflow { .. } | SubmitError::ExceedsKvCache { .. } => {
                WebError::ContextOverflow(e.to_string())
            }
            SubmitError::Invalid(_) => WebError::BadRequest(e.to_string()),
            SubmitError::Unavailable(_) => WebError::Unavailable(e.to_string()),
        }
    }
}

impl From<actix::MailboxError> for WebError {
    fn from(e: actix::MailboxError) -> Self {
        WebError::Unavailable(format!(
            "the conversation's session is not available ({e}); retry"
        ))
    }
}
