//! An error of a page route, shown as an HTML page (with the CSRF and admin refusals).

use std::fmt;

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use askama::Template;

use super::WebError;
use crate::html::with_security_headers;
use smolchat_service::ConversationError;

/// An error of a page route: the web layer's error, shown as HTML.
#[derive(Debug)]
pub enum PageError {
    Web(WebError),
    /// A missing or wrong CSRF token.
    Forbidden(String),
    /// Admin routes without a valid admin session or with a wrong token.
    Unauthorized(String),
}

impl fmt::Display for PageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageError::Web(e) => write!(f, "{e}"),
            PageError::Forbidden(m) | PageError::Unauthorized(m) => f.write_str(m),
        }
    }
}

impl From<WebError> for PageError {
    fn from(e: WebError) -> Self {
        PageError::Web(e)
    }
}

impl From<smolchat_service::knowledge::KnowledgeError> for PageError {
    fn from(e: smolchat_service::knowledge::KnowledgeError) -> Self {
        WebError::from(e).into()
    }
}

impl From<ConversationError> for PageError {
    fn from(e: ConversationError) -> Self {
        PageError::Web(e.into())
    }
}

impl From<actix::MailboxError> for PageError {
    fn from(e: actix::MailboxError) -> Self {
        PageError::Web(e.into())
    }
}

#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage<'a> {
    status: u16,
    reason: &'a str,
    message: &'a str,
}

impl PageError {
    pub fn status(&self) -> StatusCode {
        match self {
            PageError::Web(e) => e.status_code(),
            PageError::Forbidden(_) => StatusCode::FORBIDDEN,
            PageError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        }
    }

    /// The error as a small HTML document; HTMX and `chat.js` read its `.alert`.
    pub fn response(&self) -> HttpResponse {
        let status = self.status();
        let message = match self {
            PageError::Web(WebError::Internal(detail)) => {
                tracing::error!(error = %detail, "page request failed");
                "internal server error; see the server log".to_string()
            }
            other => {
                tracing::debug!(status = status.as_u16(), error = %other, "page request refused");
                other.to_string()
            }
        };
        let page = ErrorPage {
            status: status.as_u16(),
            reason: status.canonical_reason().unwrap_or("Error"),
            message: &message,
        };
        let body = page.render().unwrap_or_else(|e| {
            tracing::error!("cannot render the error page: {e}");
            "error".to_string()
        });
        let mut res = HttpResponse::build(status);
        if let PageError::Web(
            WebError::Overloaded { retry_after_s, .. }
            | WebError::TooManyRequests { retry_after_s, .. },
        ) = self
        {
            res.insert_header((
                header::RETRY_AFTER,
                HeaderValue::from((*retry_after_s).max(1)),
            ));
        }
        with_security_headers(&mut res);
        res.content_type("text/html; charset=utf-8").body(body)
    }
}

impl ResponseError for PageError {
    fn status_code(&self) -> StatusCode {
        self.status()
    }
    fn error_response(&self) -> HttpResponse {
        self.response()
    }
}
