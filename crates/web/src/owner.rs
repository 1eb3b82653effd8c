//! Who is asking: every browser gets an owner id in a signed cookie on first contact, and a
//! conversation is visible only to its owner.
//!
//! The owner id is a random UUID, stored as `Owner::as_str` in `conversations.owner`. It names an
//! *identity*, not a browser: a signed-in account's owner id is its user id (the session cookie
//! `smolchat_session` wins over the guest cookie), and signing up moves the guest's
//! conversations to the new account. Nothing else in the store needs to change for that.
//!
//! The cookie is signed (HMAC) with a key from `server.cookie_secret`, so a client cannot pick
//! someone else's id. Without a configured secret the platform generates one on first start and
//! keeps it beside the database (`secrets.rs`), so owners survive restarts; only an in-memory
//! database gets a key per start.

use std::future::{ready, Ready};

use actix_web::body::{EitherBody, MessageBody};
use actix_web::cookie::time::Duration as CookieDuration;
use actix_web::cookie::{CookieJar, Key, SameSite};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest};
use uuid::Uuid;

use super::client::Client;
use super::error::WebError;
use super::AppState;

pub use super::cookies::{OWNER as COOKIE_NAME, SESSION as SESSION_COOKIE};

/// The caller's owner id (set by [`owner_cookie`] on every request of the scopes it wraps).
///
/// A valid account session makes the owner the account (`guest: false`, `admin` from its role,
/// the id is the user id); otherwise it is the guest of the browser's signed owner cookie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    id: String,
    admin: bool,
    guest: bool,
    address: Option<std::net::IpAddr>,
    /// The account's name (`None` for guests).
    name: Option<String>,
    /// The stored id of the account's session (`None` for guests): the CSRF token is bound to
    /// it, so signing out, or in again, gives a new token.
    session: Option<String>,
}

impl Owner {
    fn new_random(address: Option<std::net::IpAddr>) -> Self {
        // A random (v4) id: unlike a v7 one it says nothing about when the browser first came.
        Owner::guest(
            uuid::Builder::from_random_bytes(rand::random())
                .into_uuid()
                .to_string(),
            address,
        )
    }

    fn guest(id: String, address: Option<std::net::IpAddr>) -> Self {
        Owner {
            id,
            admin: false,
            guest: true,
            address,
            name: None,
            session: None,
        }
    }

    fn account(
        user: &smolchat_service::records::User,
        address: Option<std::net::IpAddr>,
        session: Option<String>,
    ) -> Self {
        Owner {
            id: user.id.clone(),
            admin: user.is_admin(),
            guest: false,
            address,
            name: Some(user.name.clone()),
            session,
        }
    }

    /// What this caller's CSRF token is bound to: the guest's owner id, or the account and its
    /// session (see [`super::csrf`]).
    pub fn csrf_subject(&self) -> String {
        match &self.session {
            Some(session) => format!("{}/{session}", self.id),
            None => self.id.clone(),
        }
    }

    /// The signed-in account's name; `None` for guests.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    pub fn as_str(&self) -> &str {
        &self.id
    }

    pub fn is_admin(&self) -> bool {
        self.admin
    }

    pub fn is_guest(&self) -> bool {
        self.guest
    }

    /// The caller as the layers below the web see it.
    pub fn caller(&self) -> smolchat_service::Caller {
        smolchat_service::Caller {
            owner: self.id.clone(),
            admin: self.admin,
            guest: self.guest,
            address: self.address,
        }
    }
}

/// The cookie key from `server.cookie_secret` (at least 64 bytes).
pub fn cookie_key(secret: &str) -> Result<Key, String> {
    Key::try_from(secret.as_bytes()).map_err(|_| {
        format!(
            "server.cookie_secret is {} bytes; it must be at least 64",
            secret.len()
        )
    })
}

/// The owner id a request's cookie proves, if it carries a valid one.
fn verified_owner(
    req: &ServiceRequest,
    key: &Key,
    address: Option<std::net::IpAddr>,
    https: bool,
) -> Option<Owner> {
    let cookie = req.cookie(&super::cookies::name(COOKIE_NAME, https))?;
    let jar = CookieJar::new();
    let verified = jar.signed(key).verify(cookie)?;
    // Only ids this server minted verify, but parsing keeps the stored owner column clean even
    // if a key ever leaked.
    let id = Uuid::parse_str(verified.value()).ok()?;
    Some(Owner::guest(id.to_string(), address))
}

/// The refusal of a guest where guests are off: 401 JSON under `/api`, else a redirect to
/// `/signin`: 401 with `HX-Redirect` for HTMX (a 303 would be followed inside the XHR), 303 for
/// everything else. `api` is whether the route is the JSON API's (decided by the scope, never by
/// the raw path).
fn guests_off(api: bool, htmx: bool) -> actix_web::HttpResponse {
    if htmx {
        return actix_web::HttpResponse::Unauthorized()
            .insert_header(("HX-Redirect", "/signin"))
            .content_type("text/plain; charset=utf-8")
            .body("this server has no guest access: sign in at /signin");
    }
    if api {
        return actix_web::HttpResponse::Unauthorized().json(serde_json::json!({
            "error": {
                "message": "this server has no guest access: sign in at /signin",
                "type": "unauthorized",
            }
        }));
    }
    actix_web::HttpResponse::SeeOther()
        .insert_header(("Location", "/signin"))
        .finish()
}

/// The answer to a session whose password an administrator reset, anywhere but the account
/// page: go there and choose a new one.
fn password_change_first(api: bool, htmx: bool) -> actix_web::HttpResponse {
    const WHY: &str =
        "an administrator reset your password: choose a new one at /account before going on";
    if htmx {
        return actix_web::HttpResponse::Forbidden()
            .insert_header(("HX-Redirect", "/account"))
            .content_type("text/plain; charset=utf-8")
            .body(WHY);
    }
    if api {
        return actix_web::HttpResponse::Forbidden().json(serde_json::json!({
            "error": { "message": WHY, "type": "password_change_required" }
        }));
    }
    actix_web::HttpResponse::SeeOther()
        .insert_header(("Location", "/account"))
        .finish()
}

/// Which routes a middleware instance wraps, which decides what a guest gets where guests are
/// off. The gate is chosen where the route is registered (in [`super::routes`]), so no spelling
/// of a path (percent-encoding, a doubled slash) can move a request from one to the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// Sign-in, sign-up, the account pages and `/admin` (its own sign-in): guests pass.
    Open,
    /// Chat pages: guests are redirected to `/signin` when `auth.guests = false`.
    ChatPages,
    /// The JSON API: guests get 401 when `auth.guests = false`.
    Api,
}

/// Middleware for routes any visitor may reach (sign-in, sign-up, `/admin`): attaches the
/// caller's [`Owner`] (see [`attach_owner`]).
pub async fn owner_cookie(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    attach_owner(req, next, Gate::Open).await
}

/// Middleware for the chat pages: [`owner_cookie`], and with `auth.guests = false` a guest is
/// sent to `/signin`.
pub async fn chat_owner(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    attach_owner(req, next, Gate::ChatPages).await
}

/// Middleware for the JSON API: [`owner_cookie`], and with `auth.guests = false` a guest gets
/// 401.
pub async fn api_owner(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    attach_owner(req, next, Gate::Api).await
}

/// Attaches the caller's [`Owner`] to the request: the account of a valid session cookie, else
/// the guest of the owner cookie (minting one, and setting its cookie on the response, when the
/// request has no valid cookie). A session cookie that is no longer valid (signed out
/// elsewhere, expired, password changed, account disabled) is dropped.
/// The account `auth.trusted_user_header` names, when the request carries it through a trusted
/// proxy (`server.trusted_proxies`, seen as [`Client::proxied`]). From anywhere else the header
/// is ignored, and logged: someone tried to claim a name.
async fn trusted_header_user(
    req: &ServiceRequest,
    state: &AppState,
    client: &Client,
) -> Result<Option<smolchat_service::records::User>, smolchat_auth::AuthError> {
    let auth = &state.platform.config().auth;
    let Some(header) = auth.trusted_user_header.as_deref() else {
        return Ok(None);
    };
    let Some(value) = req.headers().get(header) else {
        return Ok(None);
    };
    if !client.proxied {
        tracing::warn!(peer = %client.address, header, "a trusted user header from an address outside server.trusted_proxies was ignored");
        metrics::counter!("smolchat_untrusted_user_headers_total").increment(1);
        return Ok(None);
    }
    // Any bytes: a value that is not visible ASCII (a tab, UTF-8) is still someone's name, and
    // the account name is made from it.
    let raw = String::from_utf8_lossy(value.as_bytes());
    let name = raw.trim();
    if name.is_empty() {
        return Ok(None);
    }
    let admin = match (&auth.trusted_groups_header, &auth.trusted_admin_group) {
        (Some(groups), Some(admin_group)) => Some(
            req.headers()
                .get(groups.as_str())
                .and_then(|g| g.to_str().ok())
                .is_some_and(|g| g.split(',').any(|x| x.trim() == admin_group)),
        ),
        _ => None,
    };
    let (user, changed) = state
        .platform
        .accounts()
        .external_user(name, admin, auth.trusted_header_adopt_names)
        .await?;
    // Every request carries the header: only what changes is worth a line in the audit log.
    if let Some(what) = changed {
        state
            .platform
            .audit()
            .auth(
                smolchat_service::audit::AuthEvent::ExternalSignIn {
                    how: format!("trusted header, {what}"),
                },
                &user.name,
                Some(client.address),
            )
            .await;
    }
    Ok(Some(user))
}

async fn attach_owner(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
    gate: Gate,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let Some(state) = req.app_data::<web::Data<AppState>>().cloned() else {
        return Err(WebError::Internal("application state missing".into()).into());
    };
    let client = req
        .extensions()
        .get::<Client>()
        .copied()
        .ok_or_else(|| WebError::Internal("client middleware not installed".into()))?;
    let address = Some(client.address);
    let mut stale_session = false;
    let session_name = super::cookies::name(SESSION_COOKIE, client.https);
    // An authenticating proxy's user header comes first: behind it, it is who signed in.
    let vouched = match trusted_header_user(&req, &state, &client).await {
        Ok(user) => user,
        // The proxy vouched for someone this server will not sign in: say why, never 500.
        Err(smolchat_auth::AuthError::Disabled) => {
            return Err(WebError::Forbidden(
                "the account your sign-in proxy names is disabled on this server; ask an \
                 administrator"
                    .into(),
            )
            .into())
        }
        Err(smolchat_auth::AuthError::BadName(why)) => {
            return Err(WebError::Unauthorized(format!(
                "the user your sign-in proxy names cannot be used here: {why}"
            ))
            .into())
        }
        Err(e) => return Err(WebError::from(e).into()),
    };
    let account = match req.cookie(&session_name) {
        _ if vouched.is_some() => vouched.map(|user| (user, None)),
        Some(cookie) => match state.platform.accounts().session(cookie.value()).await {
            Ok(Some(user)) => Some((user, smolchat_auth::secret::session_id(cookie.value()))),
            Ok(None) => {
                stale_session = true;
                None
            }
            Err(e) => return Err(WebError::from(e).into()),
        },
        None => None,
    };
    // An administrator reset the password: until a new one is chosen, only the account page
    // (and signing out) is open to this session.
    if let Some((user, _)) = &account {
        let admin_page = gate == Gate::Open && req.path().starts_with("/admin");
        if user.must_change_password && (gate != Gate::Open || admin_page) {
            let htmx = req.headers().contains_key("HX-Request");
            return Ok(req
                .into_response(password_change_first(gate == Gate::Api, htmx))
                .map_into_right_body());
        }
    }
    let (owner, minted) = match account {
        Some((user, session)) => (Owner::account(&user, address, session), false),
        None => match verified_owner(&req, &state.cookie_key, address, client.https) {
            Some(owner) => (owner, false),
            None => (Owner::new_random(address), true),
        },
    };
    if owner.guest && !state.platform.config().auth.guests && gate != Gate::Open {
        let htmx = req.headers().contains_key("HX-Request");
        return Ok(req
            .into_response(guests_off(gate == Gate::Api, htmx))
            .map_into_right_body());
    }
    let secure = client.https;
    req.extensions_mut().insert(owner.clone());
    let mut res = next.call(req).await?;
    if stale_session {
        let gone = super::cookies::removal(SESSION_COOKIE, secure, "/");
        // A handler that set a new session cookie (sign-in) wins.
        let replaced = res
            .response()
            .cookies()
            .any(|c| c.name() == session_name.as_ref());
        if !replaced {
            if let Err(e) = res.response_mut().add_cookie(&gone) {
                tracing::warn!("cannot drop a stale session cookie: {e}");
            }
        }
    }
    if minted {
        let mut jar = CookieJar::new();
        jar.signed_mut(&state.cookie_key).add(
            super::cookies::build(COOKIE_NAME, owner.id.clone(), secure, "/")
                .same_site(SameSite::Lax)
                // Long-lived: losing it means losing one's conversations.
                .max_age(CookieDuration::days(400))
                .finish(),
        );
        for cookie in jar.delta() {
            if let Err(e) = res.response_mut().add_cookie(cookie) {
                tracing::warn!("cannot set the owner cookie: {e}");
            }
        }
    }
    Ok(res.map_into_left_body())
}

impl FromRequest for Owner {
    type Error = WebError;
    type Future = Ready<Result<Owner, WebError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            req.extensions()
                .get::<Owner>()
                .cloned()
                .ok_or_else(|| WebError::Internal("owner middleware not installed".into())),
        )
    }
}
