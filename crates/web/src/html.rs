//! What every HTML route shares: [`PageError`] (the web layer's error shown as an HTML page,
//! with the CSRF and admin refusals), rendering a template into a response with the security
//! headers every page gets, and reading a form body under the same limits as the JSON API.

use std::fmt;

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use askama::Template;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use super::error::WebError;
use super::{json_limit, AppState};
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

impl From<smolchat_store::StoreError> for PageError {
    fn from(e: smolchat_store::StoreError) -> Self {
        PageError::Web(e.into())
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

/// Headers every page gets. The CSP allows only our own scripts (no inline script, no eval), so
/// even markup that slipped past the sanitizer could not run.
pub fn with_security_headers(res: &mut actix_web::HttpResponseBuilder) {
    res.insert_header((
        header::CONTENT_SECURITY_POLICY,
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
         connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; \
         frame-ancestors 'none'",
    ))
    .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
    .insert_header((header::REFERRER_POLICY, "same-origin"))
    .insert_header((header::CACHE_CONTROL, "no-store"));
}

/// A rendered template as a 200 HTML response.
pub fn html<T: Template>(t: &T) -> Result<HttpResponse, PageError> {
    let body = t
        .render()
        .map_err(|e| WebError::Internal(format!("template: {e}")))?;
    let mut res = HttpResponse::Ok();
    with_security_headers(&mut res);
    Ok(res.content_type("text/html; charset=utf-8").body(body))
}

/// Reads an `application/x-www-form-urlencoded` body of at most the JSON API's limit (a
/// message at the character limit, fully percent-encoded, fits).
pub async fn read_form<T: DeserializeOwned>(
    state: &AppState,
    req: &HttpRequest,
    mut payload: web::Payload,
) -> Result<T, PageError> {
    // A form route given JSON (or anything else) would otherwise read as an empty form.
    if let Some(ct) = req.headers().get(header::CONTENT_TYPE) {
        let essence = ct
            .to_str()
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if essence != "application/x-www-form-urlencoded" {
            return Err(WebError::UnsupportedMediaType(format!(
                "this form takes application/x-www-form-urlencoded, not {essence:?}; JSON \
                 clients use the API under /api"
            ))
            .into());
        }
    }
    let limit = json_limit(state.platform.config.limits.max_message_chars);
    let mut body = web::BytesMut::new();
    let read = async {
        while let Some(chunk) = payload.next().await {
            let chunk =
                chunk.map_err(|e| WebError::BadRequest(format!("cannot read the body: {e}")))?;
            if body.len() + chunk.len() > limit {
                return Err(WebError::PayloadTooLarge(format!(
                    "the request body is larger than {limit} bytes"
                )));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(())
    };
    super::json::within_body_timeout(req, read).await?;
    let text = std::str::from_utf8(&body)
        .map_err(|_| WebError::BadRequest("the form is not UTF-8".into()))?;
    web::Query::<T>::from_query(text)
        .map(web::Query::into_inner)
        .map_err(|e| WebError::BadRequest(format!("bad form: {e}")).into())
}
