//! What every HTML route shares: rendering a template into a response with the security headers
//! every page gets, and reading a form body under the same limits as the JSON API. (Errors shown
//! as pages are [`crate::error::PageError`].)

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use super::error::{PageError, WebError};
use super::{json_limit, AppState};

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
    let limit = json_limit(state.platform.config().limits.max_message_chars);
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

/// `text` for a URL's query string: unreserved characters as they are, every other byte
/// percent-encoded.
pub fn url_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
