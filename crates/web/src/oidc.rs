//! OpenID Connect sign-in in the browser (`[auth.oidc]`). The flow and every check live in
//! [`smolchat_auth::oidc`]; this module moves the browser and the cookies.
//!
//! | route | |
//! |---|---|
//! | `GET /auth/oidc/login[?next=/path]` | a fresh state, nonce and PKCE verifier sealed into the `smolchat_oidc` cookie (10 minutes); 303 to the provider |
//! | `GET /auth/oidc/callback?code&state` (or `?error`) | checks and trades the code, verifies the ID token, signs the account in (made on the first sign-in), drops the cookie; 303 to `next` |
//!
//! The pending cookie is SameSite=Lax: the provider sends the browser back with a top-level
//! GET from its own site, which Lax cookies accompany. It is dropped whether the sign-in
//! succeeds or not, so a callback URL replayed later finds no sign-in to finish.

use actix_web::cookie::time::Duration as CookieDuration;
use actix_web::cookie::SameSite;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;

use super::account::{client, refusal, revoke_current, session_cookie};
use super::client::Client;
use super::error::{PageError, WebError};
use super::AppState;
use smolchat_auth::oidc::{Pending, PENDING_LIFETIME};
use smolchat_auth::{AuthError, OidcError};
use smolchat_service::audit::AuthEvent;

/// The pending sign-in's cookie.
const PENDING_COOKIE: &str = "smolchat_oidc";

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/auth/oidc/login", web::get().to(login))
        .route("/auth/oidc/callback", web::get().to(callback));
}

fn oidc(state: &AppState) -> Result<&smolchat_auth::Oidc, PageError> {
    state.platform.accounts().oidc().ok_or_else(|| {
        WebError::NotFound(
            "OpenID Connect sign-in is not configured on this server ([auth.oidc])".into(),
        )
        .into()
    })
}

#[derive(Deserialize)]
pub struct LoginQuery {
    #[serde(default)]
    next: String,
}

/// `GET /auth/oidc/login`
pub async fn login(
    state: web::Data<AppState>,
    req: HttpRequest,
    query: web::Query<LoginQuery>,
) -> Result<HttpResponse, PageError> {
    let oidc = oidc(&state)?;
    let next = if query.next.is_empty() {
        "/"
    } else {
        &query.next
    };
    let started = oidc.begin(next).await.map_err(|e| refusal(e.into()))?;
    let https = Client::of(&req).https;
    let cookie = super::cookies::build(
        PENDING_COOKIE,
        started.pending.seal(state.cookie_key.signing()),
        https,
        "/auth/oidc",
    )
    .same_site(SameSite::Lax)
    .max_age(CookieDuration::seconds(PENDING_LIFETIME.as_secs() as i64))
    .finish();
    Ok(HttpResponse::SeeOther()
        .insert_header(("Location", started.url))
        .insert_header(("Cache-Control", "no-store"))
        .cookie(cookie)
        .finish())
}

#[derive(Deserialize)]
pub struct CallbackQuery {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
}

/// `GET /auth/oidc/callback`
pub async fn callback(
    state: web::Data<AppState>,
    req: HttpRequest,
    query: web::Query<CallbackQuery>,
) -> Result<HttpResponse, PageError> {
    let oidc = oidc(&state)?;
    let https = Client::of(&req).https;
    let peer = client(&req);
    let gone = super::cookies::removal(PENDING_COOKIE, https, "/auth/oidc");
    let pending = req
        .cookie(&super::cookies::name(PENDING_COOKIE, https))
        .and_then(|c| Pending::open(state.cookie_key.signing(), c.value()));
    let outcome = async {
        if let Some(error) = &query.error {
            let why = match &query.error_description {
                Some(d) => format!("{error}: {d}"),
                None => error.clone(),
            };
            return Err(AuthError::Oidc(OidcError::ProviderRefused(why)));
        }
        let pending = pending.as_ref().ok_or(OidcError::StateMissing)?;
        let (Some(code), Some(returned)) = (&query.code, &query.state) else {
            return Err(OidcError::ProviderRefused(
                "the answer carries no authorization code".into(),
            )
            .into());
        };
        let who = oidc.finish(pending, code, returned).await?;
        let (signed, created) = state.platform.accounts().oidc_sign_in(&who).await?;
        Ok((signed, created, pending.next.clone()))
    }
    .await;
    let (signed, created, next) = match outcome {
        Ok(done) => done,
        Err(e) => {
            tracing::warn!(peer = %peer, error = %e, "OpenID Connect sign-in refused");
            metrics::counter!("smolchat_user_logins_total", "outcome" => "oidc_refused")
                .increment(1);
            state
                .platform
                .audit()
                .auth(
                    AuthEvent::SignInFailed { why: "oidc" },
                    "(identity provider)",
                    Some(peer),
                )
                .await;
            let mut res = refusal(e).response();
            let _ = res.add_cookie(&gone);
            return Ok(res);
        }
    };
    metrics::counter!("smolchat_user_logins_total", "outcome" => "ok").increment(1);
    let how = if created {
        "oidc, account made"
    } else {
        "oidc"
    };
    state
        .platform
        .audit()
        .auth(
            AuthEvent::ExternalSignIn { how: how.into() },
            &signed.user.name,
            Some(peer),
        )
        .await;
    revoke_current(&state, &req).await;
    tracing::info!(user = %signed.user.id, peer = %peer, created, "signed in through OpenID Connect");
    Ok(HttpResponse::SeeOther()
        .insert_header(("Location", next))
        .insert_header(("Cache-Control", "no-store"))
        .cookie(session_cookie(&req, signed.session))
        .cookie(gone)
        .finish())
}
