//! The admin-token session: signing in and out (the cookie moves here, the rules live in
//! `smolchat_auth::admin`) and the check every admin handler makes first.

use actix_web::cookie::time::Duration as CookieDuration;
use actix_web::cookie::SameSite;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;

use crate::client::Client;
use crate::cookies::ADMIN as SESSION_COOKIE;
use crate::error::{PageError, WebError};
use crate::html::read_form;
use crate::owner::Owner;
use crate::AppState;
use smolchat_auth::{AdminAuth, AuthError, LockedBy};
use smolchat_service::audit::AuthEvent;

const COOKIE_PATH: &str = "/admin";

/// The admin service, or 404 when no admin token is configured.
fn admin_of(state: &AppState) -> Result<&AdminAuth, PageError> {
    state
        .platform
        .admin_auth()
        .ok_or_else(|| WebError::NotFound("the admin page is disabled".into()).into())
}

/// The sign-in layer's refusals as page errors.
fn refusal(e: AuthError) -> PageError {
    match e {
        AuthError::Throttled(lockout) => {
            let who = match lockout.by {
                LockedBy::Address => "from your address",
                LockedBy::Subject => "from all addresses together",
            };
            let wait = lockout.retry_after_s();
            WebError::TooManyRequests {
                message: format!(
                    "too many wrong admin tokens {who}: admin login is locked for {wait} more \
                     seconds, and no token is checked until then"
                ),
                retry_after_s: wait,
            }
            .into()
        }
        AuthError::WrongCredentials => PageError::Unauthorized("wrong admin token".into()),
        other => WebError::from(other).into(),
    }
}

/// The request's admin session cookie, under its name for the connection.
fn admin_cookie(req: &HttpRequest) -> Option<actix_web::cookie::Cookie<'static>> {
    req.cookie(&crate::cookies::name(SESSION_COOKIE, Client::of(req).https))
}

/// Whether the request carries the cookie of a valid admin session.
pub(super) async fn logged_in(admin: &AdminAuth, req: &HttpRequest) -> Result<bool, PageError> {
    let Some(cookie) = admin_cookie(req) else {
        return Ok(false);
    };
    Ok(admin
        .session(cookie.value())
        .await
        .map_err(refusal)?
        .is_some())
}

/// Refuses a request that is neither from an account with the admin role nor from a valid
/// admin-token session: 404 when no token is configured (the page is disabled for everyone
/// else), 401 otherwise.
///
/// Returns who acts, for the audit log: the admin account, or `admin` for a token session.
pub(super) async fn require_admin(
    state: &AppState,
    owner: &Owner,
    req: &HttpRequest,
) -> Result<smolchat_service::Caller, PageError> {
    if owner.is_admin() {
        return Ok(owner.caller());
    }
    let admin = admin_of(state)?;
    if !logged_in(admin, req).await? {
        return Err(PageError::Unauthorized(
            "log in at /admin with the admin token, or sign in with an admin account".into(),
        ));
    }
    Ok(smolchat_service::Caller {
        owner: "admin".into(),
        admin: true,
        guest: false,
        ..owner.caller()
    })
}

#[derive(Deserialize)]
pub struct LoginForm {
    #[serde(default)]
    token: String,
}

/// `POST /admin/login`
pub async fn login(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let admin = admin_of(&state)?;
    let form: LoginForm = read_form(&state, &req, payload).await?;
    // The TCP peer, or what a trusted proxy says (never a header an untrusted client wrote).
    let client = Client::of(&req).address;
    let session = match admin.login(&form.token, client).await {
        Ok(session) => session,
        Err(e) => {
            let outcome = match &e {
                AuthError::Throttled(l) => {
                    // Debug, not warn: a flood would otherwise write a line per request; the
                    // metric counts them, and the failures that caused the lockout were warned.
                    tracing::debug!(peer = %client, retry_after_s = l.retry_after_s(), "admin login refused: throttled");
                    "throttled"
                }
                AuthError::WrongCredentials => {
                    tracing::warn!(peer = %client, "admin login with a wrong token");
                    "wrong"
                }
                _ => "error",
            };
            metrics::counter!("smolchat_admin_logins_total", "outcome" => outcome).increment(1);
            if outcome != "error" {
                state
                    .platform
                    .audit()
                    .auth(
                        AuthEvent::AdminTokenSignInFailed { why: outcome },
                        "admin",
                        Some(client),
                    )
                    .await;
            }
            return Err(refusal(e));
        }
    };
    metrics::counter!("smolchat_admin_logins_total", "outcome" => "ok").increment(1);
    state
        .platform
        .audit()
        .auth(AuthEvent::AdminTokenSignIn, "admin", Some(client))
        .await;
    // Signing in again replaces the browser's previous session rather than leaving it alive
    // beside the new one.
    if let Some(old) = admin_cookie(&req) {
        if let Err(e) = admin.logout(old.value()).await {
            tracing::warn!("cannot revoke the replaced admin session: {e}");
        }
    }
    let max_age = i64::try_from(session.lifetime.as_secs()).unwrap_or(i64::MAX);
    let cookie = crate::cookies::build(
        SESSION_COOKIE,
        session.token,
        Client::of(&req).https,
        COOKIE_PATH,
    )
    .same_site(SameSite::Strict)
    .max_age(CookieDuration::seconds(max_age))
    .finish();
    tracing::info!(peer = %client, "admin logged in");
    Ok(HttpResponse::build(StatusCode::NO_CONTENT)
        .insert_header(("HX-Redirect", "/admin"))
        .cookie(cookie)
        .finish())
}

/// `POST /admin/logout`
pub async fn logout(
    state: web::Data<AppState>,
    req: HttpRequest,
) -> Result<HttpResponse, PageError> {
    let admin = admin_of(&state)?;
    if let Some(cookie) = admin_cookie(&req) {
        // Server-side first: the cookie may have been copied elsewhere.
        if admin.logout(cookie.value()).await.map_err(refusal)? {
            tracing::info!("admin logged out");
        }
    }
    let gone = crate::cookies::removal(SESSION_COOKIE, Client::of(&req).https, COOKIE_PATH);
    Ok(HttpResponse::NoContent()
        .cookie(gone)
        .insert_header(("HX-Redirect", "/admin"))
        .finish())
}
