//! Who is asking: every browser gets an owner id in a signed cookie on first contact, and a
//! conversation is visible only to its owner.
//!
//! The owner id is a random UUID, stored as `Owner::as_str` in `conversations.owner`. It names an
//! *identity*, not a browser: password accounts (a later issue) will each carry one owner id and
//! logging in will set this same cookie to the account's id (after re-owning the anonymous
//! browser's conversations to it, if the user wants to keep them). Nothing else in the store
//! needs to change for that.
//!
//! The cookie is signed (HMAC) with a key from `server.cookie_secret`, so a client cannot pick
//! someone else's id. Without a configured secret the platform generates one on first start and
//! keeps it beside the database (`secrets.rs`), so owners survive restarts; only an in-memory
//! database gets a key per start.

use std::future::{ready, Ready};

use actix_web::body::MessageBody;
use actix_web::cookie::time::Duration as CookieDuration;
use actix_web::cookie::{Cookie, CookieJar, Key, SameSite};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest};
use uuid::Uuid;

use super::error::WebError;
use super::AppState;

pub const COOKIE_NAME: &str = "smolchat_owner";

/// The caller's owner id (set by [`owner_cookie`] on every request of the scopes it wraps).
///
/// Today every owner is a guest (a browser's cookie); accounts (issue 9) set `guest: false` and
/// `admin` from the account's role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    id: String,
    admin: bool,
    guest: bool,
    address: Option<std::net::IpAddr>,
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
        }
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
    pub fn caller(&self) -> crate::actors::Caller {
        crate::actors::Caller {
            owner: self.id.clone(),
            admin: self.admin,
            guest: self.guest,
            address: self.address,
        }
    }
}

/// The cookie key: the configured secret (at least 64 bytes), or a random one.
pub fn cookie_key(secret: Option<&str>) -> Result<Key, String> {
    match secret {
        Some(s) => Key::try_from(s.as_bytes()).map_err(|_| {
            format!(
                "server.cookie_secret is {} bytes; it must be at least 64",
                s.len()
            )
        }),
        None => {
            tracing::info!(
                "server.cookie_secret is not set and the database is in memory: owner cookies are signed with a random key, so browsers lose their conversations when the server restarts"
            );
            Key::try_generate().ok_or_else(|| "no randomness to make a cookie key".to_string())
        }
    }
}

/// The owner id a request's cookie proves, if it carries a valid one.
fn verified_owner(
    req: &ServiceRequest,
    key: &Key,
    address: Option<std::net::IpAddr>,
) -> Option<Owner> {
    let cookie = req.cookie(COOKIE_NAME)?;
    let jar = CookieJar::new();
    let verified = jar.signed(key).verify(cookie)?;
    // Only ids this server minted verify, but parsing keeps the stored owner column clean even
    // if a key ever leaked.
    let id = Uuid::parse_str(verified.value()).ok()?;
    Some(Owner::guest(id.to_string(), address))
}

/// Middleware: attaches the caller's [`Owner`] to the request, minting one (and setting its
/// cookie on the response) when the request has no valid cookie.
pub async fn owner_cookie(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let Some(state) = req.app_data::<web::Data<AppState>>().cloned() else {
        return Err(WebError::Internal("application state missing".into()).into());
    };
    let address = req.peer_addr().map(|a| a.ip());
    let (owner, minted) = match verified_owner(&req, &state.cookie_key, address) {
        Some(owner) => (owner, false),
        None => (Owner::new_random(address), true),
    };
    let secure = req.connection_info().scheme() == "https";
    req.extensions_mut().insert(owner.clone());
    let mut res = next.call(req).await?;
    if minted {
        let mut jar = CookieJar::new();
        jar.signed_mut(&state.cookie_key).add(
            Cookie::build(COOKIE_NAME, owner.id.clone())
                .path("/")
                .http_only(true)
                .same_site(SameSite::Lax)
                .secure(secure)
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
    Ok(res)
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
