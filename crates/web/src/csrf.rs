//! CSRF protection for the pages: every state-changing request (anything but GET/HEAD/OPTIONS)
//! under the page routes must carry `X-CSRF-Token`, a per-owner token the page embeds.
//!
//! The token is an HMAC, under the cookie key, of the guest's owner id or of the account and its
//! session's stored id ([`Owner::csrf_subject`]), computed with the cookie crate's signing under a
//! name of its own so it never equals the owner cookie's signature. It needs no server-side
//! storage, survives reloads and tabs, and a page on another site cannot read it (the cookies
//! are HttpOnly and the token only appears inside our own pages). Bound to the session, it
//! changes when the account signs out, signs in again or changes its password: a token read
//! once is no good after that. HTMX sends it from
//! `hx-headers` on `<body>`; `static/chat.js` sends it with `fetch`. A header, not a form field,
//! because a cross-site `<form>` cannot set headers at all.

use actix_web::body::{EitherBody, MessageBody};
use actix_web::cookie::{Cookie, CookieJar, Key};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage};

use super::error::PageError;
use super::owner::Owner;
use super::AppState;

pub const HEADER: &str = "X-CSRF-Token";
/// The name the HMAC is bound to (the cookie crate signs name and value together).
const PURPOSE: &str = "smolchat_csrf";

/// The CSRF token of `subject` ([`Owner::csrf_subject`]) under `key`.
pub fn token_for(key: &Key, owner_id: &str) -> String {
    let mut jar = CookieJar::new();
    jar.signed_mut(key)
        .add(Cookie::new(PURPOSE, owner_id.to_string()));
    // A signed value is `base64(mac) + value`; the mac alone is the token.
    jar.get(PURPOSE)
        .and_then(|c| {
            let v = c.value();
            v.get(..v.len().saturating_sub(owner_id.len()))
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// Compares without an early exit, so timing does not tell how much of a guess was right.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    // `subtle` compares slices of different lengths as unequal (the length is not secret).
    bool::from(subtle::ConstantTimeEq::ct_eq(a, b))
}

/// Middleware (inside [`super::owner::owner_cookie`]): 403 for an unsafe method without the
/// owner's token.
pub async fn require_token(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe {
        let state = req.app_data::<web::Data<AppState>>().cloned();
        let owner = req.extensions().get::<Owner>().cloned();
        let valid = match (state, owner) {
            (Some(state), Some(owner)) => {
                let expected = token_for(&state.cookie_key, &owner.csrf_subject());
                // An empty expectation (which cannot happen) must not let an empty header in.
                !expected.is_empty()
                    && req
                        .headers()
                        .get(HEADER)
                        .is_some_and(|v| constant_time_eq(v.as_bytes(), expected.as_bytes()))
            }
            _ => false,
        };
        if !valid {
            // Debug, bounded: a flood of refusals must not flood the log (the counter counts).
            metrics::counter!("smolchat_csrf_refusals_total").increment(1);
            tracing::debug!(method = %req.method(), path = %short(req.path()), "request without a valid CSRF token refused");
            let response = PageError::Forbidden(
                "this request lacks a valid CSRF token; reload the page and try again".into(),
            )
            .response();
            return Ok(req.into_response(response).map_into_right_body());
        }
    }
    Ok(next.call(req).await?.map_into_left_body())
}

/// Middleware for the JSON API under `/api` (inside the owner cookie). API clients that are not
/// browsers send no CSRF token, so a missing token is accepted there, but a browser's cross-site
/// request is refused by the headers browsers always send: `Sec-Fetch-Site` other than
/// `same-origin`/`none`, or an `Origin` that is not this host. A token, when sent, must be right.
pub async fn check_api_origin(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe {
        if let Some(reason) = api_refusal(&req) {
            metrics::counter!("smolchat_csrf_refusals_total").increment(1);
            tracing::debug!(method = %req.method(), path = %short(req.path()), reason, "cross-site API request refused");
            // The API's error shape (see `error.rs`).
            let response = actix_web::HttpResponse::Forbidden().json(serde_json::json!({
                "error": {
                    "message": format!("cross-site request refused ({reason})"),
                    "type": "forbidden",
                }
            }));
            return Ok(req.into_response(response).map_into_right_body());
        }
    }
    Ok(next.call(req).await?.map_into_left_body())
}

/// At most the first 100 characters of a client-chosen path, for a log line.
fn short(path: &str) -> String {
    let mut out: String = path.chars().take(100).collect();
    if out.len() < path.len() {
        out.push('…');
    }
    out
}

fn api_refusal(req: &ServiceRequest) -> Option<&'static str> {
    if let Some(sent) = req.headers().get(HEADER) {
        let state = req.app_data::<web::Data<AppState>>()?;
        let owner = req.extensions().get::<Owner>().cloned()?;
        let expected = token_for(&state.cookie_key, &owner.csrf_subject());
        return (expected.is_empty() || !constant_time_eq(sent.as_bytes(), expected.as_bytes()))
            .then_some("wrong CSRF token");
    }
    if let Some(site) = req.headers().get("sec-fetch-site") {
        if !matches!(site.as_bytes(), b"same-origin" | b"none") {
            return Some("Sec-Fetch-Site is not same-origin");
        }
    }
    if let Some(origin) = req.headers().get(actix_web::http::header::ORIGIN) {
        // The Host the client asked for (never X-Forwarded-Host, which a client could write).
        let host = req
            .headers()
            .get(actix_web::http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("")
            .to_string();
        let origin_host = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://").map(|(_, h)| h.to_string()));
        if origin_host.as_deref() != Some(host.as_str()) {
            return Some("Origin is another site");
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_depends_on_owner_and_key() {
        let key = Key::generate();
        let a = "0b5c1d36-7f59-4a61-9b5e-2f4f1c7d9e01";
        let b = "0b5c1d36-7f59-4a61-9b5e-2f4f1c7d9e02";
        let ta = token_for(&key, a);
        assert!(ta.len() >= 40, "{ta}");
        assert_eq!(ta, token_for(&key, a));
        assert_ne!(ta, token_for(&key, b));
        assert_ne!(ta, token_for(&Key::generate(), a));
        assert!(!ta.contains(a));
    }

    #[test]
    fn constant_time_eq_compares() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
