//! Accounts in the browser: sign-in, sign-up, sign-out and the account page. Everything about
//! passwords, sessions and keys lives in [`smolchat_auth::accounts`]; this module moves the session
//! cookie and renders.
//!
//! | route | |
//! |---|---|
//! | `GET /signin`, `POST /signin` (form `name`, `password`) | wrong → 401; throttled → 429 + `Retry-After`; right → session cookie + `HX-Redirect: /` |
//! | `GET /signup[?invite=CODE]`, `POST /signup` (form `name`, `password`, `invite`) | creates the account under `auth.signup`, moves the guest's conversations into it, signs in |
//! | `POST /signout` | revokes the session server-side and drops the cookie |
//! | `GET /account` | password change, personal API keys, sign out everywhere |
//! | `POST /account/password`, `/account/keys`, `/account/keys/{id}/revoke`, `/account/signout-all`, `/account/default-model` (form `model`) | actions |
//!
//! The session cookie `smolchat_session` holds a random token (the database keeps its SHA-256):
//! HttpOnly, SameSite=Lax (a link from elsewhere arrives signed in; cross-site POSTs carry no
//! CSRF token anyway), `Path=/`, Secure when the request came over HTTPS, Max-Age = the
//! session's lifetime. All routes sit inside the owner middleware and the CSRF check.

use std::net::IpAddr;

use actix_web::cookie::time::Duration as CookieDuration;
use actix_web::cookie::{Cookie, SameSite};
use actix_web::http::StatusCode;
use actix_web::middleware::from_fn;
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::client::Client;
use super::csrf;
use super::error::PageError;
use super::error::WebError;
use super::html::{html, read_form};
use super::owner::{self, Owner, SESSION_COOKIE};
use super::AppState;
use smolchat_auth::SignupMode;
use smolchat_auth::{AuthError, LockedBy, NewSession};
use smolchat_service::audit::AuthEvent;
use smolchat_service::records::{ApiKeyRecord, User};

/// Registers the account routes (one block, called from [`super::routes`]).
pub fn routes(cfg: &mut web::ServiceConfig) {
    for (path, get, post) in [
        (
            "/signin",
            Some(web::get().to(signin_page)),
            Some(web::post().to(signin)),
        ),
        (
            "/signup",
            Some(web::get().to(signup_page)),
            Some(web::post().to(signup)),
        ),
        ("/signout", None, Some(web::post().to(signout))),
        ("/account", Some(web::get().to(account_page)), None),
        ("/account/password", None, Some(web::post().to(password))),
        (
            "/account/default-model",
            None,
            Some(web::post().to(default_model)),
        ),
        ("/account/keys", None, Some(web::post().to(create_key))),
        (
            "/account/keys/{id}/revoke",
            None,
            Some(web::post().to(revoke_key)),
        ),
        (
            "/account/signout-all",
            None,
            Some(web::post().to(signout_all)),
        ),
    ] {
        let mut resource = web::resource(path)
            .wrap(from_fn(csrf::require_token))
            .wrap(from_fn(owner::owner_cookie));
        if let Some(route) = get {
            resource = resource.route(route);
        }
        if let Some(route) = post {
            resource = resource.route(route);
        }
        cfg.service(resource);
    }
}

#[derive(Template)]
#[template(path = "signin.html")]
struct SigninPage {
    csrf: String,
    signup_open: bool,
    password_login: bool,
    /// "Sign in with {label}" when OpenID Connect is configured.
    oidc_label: Option<String>,
}

#[derive(Template)]
#[template(path = "signup.html")]
struct SignupPage {
    csrf: String,
    closed: bool,
    needs_invite: bool,
    invite: String,
    guest_has_chats: bool,
}

pub struct KeyView {
    pub id: String,
    pub name: String,
    pub prefix: String,
    pub created: String,
    pub last_used: String,
    pub revoked: bool,
}

#[derive(Template)]
#[template(path = "account.html")]
struct AccountPage {
    csrf: String,
    name: String,
    admin: bool,
    keys: Vec<KeyView>,
    new_key: String,
    /// Tokens used and left per quota window (counted on every replica).
    usage: Vec<UsageView>,
    /// An administrator reset the password: a new one must be chosen first.
    must_change_password: bool,
    /// The models new conversations may start on (shown when there is more than one), and the
    /// account's choice.
    models: Vec<String>,
    default_model: String,
}

pub struct UsageView {
    pub what: &'static str,
    pub used: i64,
    /// "no limit" or the limit.
    pub limit: String,
    /// "—" or what is left.
    pub left: String,
    pub resets: String,
}

async fn usage_of(state: &AppState, user: &User) -> Vec<UsageView> {
    state
        .platform
        .completions()
        .quotas()
        .of_account(&user.id)
        .await
        .into_iter()
        .map(|q| UsageView {
            what: q.what,
            used: q.used,
            limit: if q.limit == 0 {
                "no limit".into()
            } else {
                q.limit.to_string()
            },
            left: if q.limit == 0 {
                "—".into()
            } else {
                (q.limit as i64).saturating_sub(q.used).max(0).to_string()
            },
            resets: q.resets_at.format("%Y-%m-%d %H:%M UTC").to_string(),
        })
        .collect()
}

#[derive(Template)]
#[template(path = "account_keys.html")]
struct KeysFragment {
    keys: Vec<KeyView>,
    new_key: String,
}

fn when(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M").to_string()
}

fn key_view(k: &ApiKeyRecord) -> KeyView {
    KeyView {
        id: k.id.clone(),
        name: if k.name.is_empty() {
            "(unnamed)".into()
        } else {
            k.name.clone()
        },
        prefix: k.prefix.clone(),
        created: when(k.created_at),
        last_used: k.last_used_at.map_or_else(|| "never".into(), when),
        revoked: k.revoked_at.is_some(),
    }
}

/// The sign-in layer's refusals as page errors (clear messages; 429 with `Retry-After`).
pub fn refusal(e: AuthError) -> PageError {
    match e {
        AuthError::Throttled(lockout) => {
            let who = match lockout.by {
                LockedBy::Address => "from your address",
                LockedBy::Subject => "for this account",
            };
            let wait = lockout.retry_after_s();
            WebError::TooManyRequests {
                message: format!(
                    "too many wrong passwords {who}: sign-in is locked for {wait} more seconds, \
                     and no password is checked until then"
                ),
                retry_after_s: wait,
            }
            .into()
        }
        AuthError::TooManySignups(lockout) => WebError::TooManyRequests {
            message: e.to_string(),
            retry_after_s: lockout.retry_after_s(),
        }
        .into(),
        AuthError::WrongCredentials => {
            PageError::Unauthorized("wrong name or password (or the account is disabled)".into())
        }
        AuthError::TooManyKeys(_) => WebError::Conflict(e.to_string()).into(),
        AuthError::Disabled | AuthError::SignupClosed | AuthError::KeyRefused => {
            PageError::Forbidden(e.to_string())
        }
        AuthError::BadName(_)
        | AuthError::BadPassword(_)
        | AuthError::InviteInvalid
        | AuthError::NoSuchUser(_) => WebError::BadRequest(e.to_string()).into(),
        AuthError::NameTaken => WebError::Conflict(e.to_string()).into(),
        AuthError::Store(_) => WebError::from(e).into(),
        AuthError::Hash(detail) | AuthError::Config(detail) => WebError::Internal(detail).into(),
        AuthError::PasswordLoginOff(_) => PageError::Forbidden(e.to_string()),
        AuthError::Oidc(o) => {
            use smolchat_auth::OidcError;
            let message = format!("Sign-in failed: {o}");
            match o {
                _ if o.is_provider_failure() => WebError::Unavailable(message).into(),
                OidcError::NotAllowed { .. } => PageError::Forbidden(message),
                OidcError::StateMissing | OidcError::StateMismatch | OidcError::NoName(_) => {
                    WebError::BadRequest(message).into()
                }
                _ => PageError::Unauthorized(message),
            }
        }
    }
}

/// The client's address (the TCP peer, or what a trusted proxy says: see [`super::client`]).
pub(crate) fn client(req: &HttpRequest) -> IpAddr {
    Client::of(req).address
}

/// The session cookie for `session`.
pub(crate) fn session_cookie(req: &HttpRequest, session: NewSession) -> Cookie<'static> {
    let max_age = i64::try_from(session.lifetime.as_secs()).unwrap_or(i64::MAX);
    super::cookies::build(SESSION_COOKIE, session.token, Client::of(req).https, "/")
        .same_site(SameSite::Lax)
        .max_age(CookieDuration::seconds(max_age))
        .finish()
}

pub(crate) fn removal(req: &HttpRequest, name: &'static str) -> Cookie<'static> {
    super::cookies::removal(name, Client::of(req).https, "/")
}

/// The request's account session cookie, under its name for the connection.
fn session_cookie_of(req: &HttpRequest) -> Option<Cookie<'static>> {
    req.cookie(&super::cookies::name(SESSION_COOKIE, Client::of(req).https))
}

/// Revokes the session the request's cookie stands for, if any (rotation and sign-out).
pub(crate) async fn revoke_current(state: &AppState, req: &HttpRequest) {
    if let Some(old) = session_cookie_of(req) {
        if let Err(e) = state.platform.accounts().sign_out(old.value()).await {
            tracing::warn!("cannot revoke the replaced session: {e}");
        }
    }
}

/// The signed-in account, or a redirect to `/signin` for guests.
async fn account_of(state: &AppState, owner: &Owner) -> Result<Option<User>, PageError> {
    if owner.is_guest() {
        return Ok(None);
    }
    Ok(state
        .platform
        .accounts()
        .user(owner.as_str())
        .await
        .map_err(WebError::from)?)
}

fn to_signin() -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header(("Location", "/signin"))
        .insert_header(("HX-Redirect", "/signin"))
        .finish()
}

/// `GET /signin`
pub async fn signin_page(
    state: web::Data<AppState>,
    owner: Owner,
) -> Result<HttpResponse, PageError> {
    html(&SigninPage {
        csrf: csrf::token_for(&state.cookie_key, &owner.csrf_subject()),
        signup_open: state.platform.accounts().signup_mode() != SignupMode::Closed,
        password_login: state.platform.accounts().password_login(),
        oidc_label: state
            .platform
            .accounts()
            .oidc()
            .map(|o| o.config().label.clone()),
    })
}

#[derive(Deserialize)]
pub struct SigninForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    password: String,
}

/// `POST /signin`
pub async fn signin(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let form: SigninForm = read_form(&state, &req, payload).await?;
    let peer = client(&req);
    let signed = match state
        .platform
        .accounts()
        .sign_in(&form.name, &form.password, peer)
        .await
    {
        Ok(s) => s,
        Err(e) => {
            let outcome = match &e {
                AuthError::Throttled(_) => "throttled",
                AuthError::WrongCredentials => {
                    // The name, never the password.
                    tracing::warn!(peer = %peer, "sign-in with a wrong name or password");
                    "wrong"
                }
                AuthError::Disabled => "disabled",
                _ => "error",
            };
            metrics::counter!("smolchat_user_logins_total", "outcome" => outcome).increment(1);
            if outcome != "error" {
                state
                    .platform
                    .audit()
                    .auth(
                        AuthEvent::SignInFailed { why: outcome },
                        form.name.trim(),
                        Some(peer),
                    )
                    .await;
            }
            return Err(refusal(e));
        }
    };
    metrics::counter!("smolchat_user_logins_total", "outcome" => "ok").increment(1);
    state
        .platform
        .audit()
        .auth(AuthEvent::SignIn, &signed.user.name, Some(peer))
        .await;
    // Rotation: the browser's previous session (if any) ends with the new one's start.
    revoke_current(&state, &req).await;
    tracing::info!(user = %signed.user.id, peer = %peer, "signed in");
    Ok(HttpResponse::build(StatusCode::NO_CONTENT)
        .insert_header(("HX-Redirect", "/"))
        .cookie(session_cookie(&req, signed.session))
        .finish())
}

#[derive(Deserialize)]
pub struct SignupQuery {
    #[serde(default)]
    invite: String,
}

/// `GET /signup`
pub async fn signup_page(
    state: web::Data<AppState>,
    owner: Owner,
    query: web::Query<SignupQuery>,
) -> Result<HttpResponse, PageError> {
    let mode = state.platform.accounts().signup_mode();
    let guest_has_chats = owner.is_guest()
        && state
            .platform
            .conversations()
            .count(&owner.caller())
            .await?
            > 0;
    html(&SignupPage {
        csrf: csrf::token_for(&state.cookie_key, &owner.csrf_subject()),
        closed: mode == SignupMode::Closed,
        needs_invite: mode == SignupMode::Invite,
        invite: query.invite.chars().take(128).collect(),
        guest_has_chats,
    })
}

#[derive(Deserialize)]
pub struct SignupForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    invite: String,
}

/// `POST /signup`
pub async fn signup(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let form: SignupForm = read_form(&state, &req, payload).await?;
    // Only a guest's conversations move: a signed-in user making a second account keeps theirs.
    let adopt = owner.is_guest().then(|| owner.as_str());
    let signed = state
        .platform
        .accounts()
        .sign_up(
            form.name.trim(),
            &form.password,
            Some(form.invite.as_str()),
            adopt,
            client(&req),
        )
        .await
        .map_err(refusal)?;
    revoke_current(&state, &req).await;
    tracing::info!(user = %signed.user.id, adopted = signed.adopted, "signed up");
    state
        .platform
        .audit()
        .auth(AuthEvent::SignUp, &signed.user.name, Some(client(&req)))
        .await;
    Ok(HttpResponse::build(StatusCode::NO_CONTENT)
        .insert_header(("HX-Redirect", "/"))
        .cookie(session_cookie(&req, signed.session))
        // The guest identity is used up: its conversations now belong to the account, and
        // after sign-out the browser starts as a new guest.
        .cookie(removal(&req, owner::COOKIE_NAME))
        .finish())
}

/// `POST /signout`
pub async fn signout(
    state: web::Data<AppState>,
    req: HttpRequest,
) -> Result<HttpResponse, PageError> {
    if let Some(cookie) = session_cookie_of(&req) {
        let who = state
            .platform
            .accounts()
            .session(cookie.value())
            .await
            .ok()
            .flatten();
        // Server-side first: the cookie may have been copied elsewhere.
        if state
            .platform
            .accounts()
            .sign_out(cookie.value())
            .await
            .map_err(refusal)?
        {
            tracing::info!("signed out");
            if let Some(user) = who {
                state
                    .platform
                    .audit()
                    .auth(AuthEvent::SignOut, &user.name, Some(client(&req)))
                    .await;
            }
        }
    }
    Ok(HttpResponse::NoContent()
        .cookie(removal(&req, SESSION_COOKIE))
        .insert_header(("HX-Redirect", "/"))
        .finish())
}

async fn keys_of(state: &AppState, user: &User) -> Result<Vec<KeyView>, PageError> {
    Ok(state
        .platform
        .accounts()
        .api_keys(user)
        .await
        .map_err(refusal)?
        .iter()
        .map(key_view)
        .collect())
}

/// `GET /account`
pub async fn account_page(
    state: web::Data<AppState>,
    owner: Owner,
) -> Result<HttpResponse, PageError> {
    let Some(user) = account_of(&state, &owner).await? else {
        return Ok(to_signin());
    };
    let service = state.platform.conversations();
    html(&AccountPage {
        csrf: csrf::token_for(&state.cookie_key, &owner.csrf_subject()),
        admin: user.is_admin(),
        keys: keys_of(&state, &user).await?,
        usage: usage_of(&state, &user).await,
        must_change_password: user.must_change_password,
        name: user.name,
        new_key: String::new(),
        models: service.models().into_iter().map(|m| m.id).collect(),
        default_model: service.default_model_for(&owner.caller()).await,
    })
}

fn signed_in_only() -> PageError {
    PageError::Unauthorized("sign in first".into())
}

#[derive(Deserialize)]
pub struct PasswordForm {
    #[serde(default)]
    current: String,
    #[serde(default)]
    new: String,
}

/// `POST /account/password`: every session of the account ends; this browser gets a new one.
pub async fn password(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let form: PasswordForm = read_form(&state, &req, payload).await?;
    let user = account_of(&state, &owner)
        .await?
        .ok_or_else(signed_in_only)?;
    let session = state
        .platform
        .accounts()
        .change_password(&user, &form.current, &form.new, client(&req))
        .await
        .map_err(refusal)?;
    state
        .platform
        .audit()
        .auth(AuthEvent::PasswordChanged, &user.name, Some(client(&req)))
        .await;
    let mut res = html(&Status {
        text: "Password changed; every other session is signed out.",
    })?;
    res.add_cookie(&session_cookie(&req, session))
        .map_err(|e| WebError::Internal(format!("cookie: {e}")))?;
    Ok(res)
}

#[derive(Template)]
#[template(source = "<span class=\"ok\">{{ text }}</span>", ext = "html")]
struct Status {
    text: &'static str,
}

#[derive(Deserialize)]
pub struct DefaultModelForm {
    #[serde(default)]
    model: String,
}

/// `POST /account/default-model`: the model this account's new conversations start on.
pub async fn default_model(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let form: DefaultModelForm = read_form(&state, &req, payload).await?;
    account_of(&state, &owner)
        .await?
        .ok_or_else(signed_in_only)?;
    let chosen = state
        .platform
        .conversations()
        .set_default_model(&owner.caller(), &form.model)
        .await?;
    html(&ModelStatus {
        text: format!("New chats start on {chosen}."),
    })
}

#[derive(Template)]
#[template(source = "<span class=\"ok\">{{ text }}</span>", ext = "html")]
struct ModelStatus {
    text: String,
}

#[derive(Deserialize)]
pub struct KeyForm {
    #[serde(default)]
    name: String,
}

/// `POST /account/keys`: the new key is in this answer and nowhere else.
pub async fn create_key(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let form: KeyForm = read_form(&state, &req, payload).await?;
    let user = account_of(&state, &owner)
        .await?
        .ok_or_else(signed_in_only)?;
    let key = state
        .platform
        .accounts()
        .create_api_key(&user, &form.name)
        .await
        .map_err(refusal)?;
    tracing::info!(user = %user.id, key = %key.record.prefix, "API key created");
    state
        .platform
        .audit()
        .auth(
            AuthEvent::KeyCreated {
                prefix: key.record.prefix.clone(),
            },
            &user.name,
            Some(client(&req)),
        )
        .await;
    html(&KeysFragment {
        keys: keys_of(&state, &user).await?,
        new_key: key.key,
    })
}

/// `POST /account/keys/{id}/revoke`
pub async fn revoke_key(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let user = account_of(&state, &owner)
        .await?
        .ok_or_else(signed_in_only)?;
    if !state
        .platform
        .accounts()
        .revoke_api_key(&user, &path)
        .await
        .map_err(refusal)?
    {
        return Err(WebError::NotFound("no such live key of yours".into()).into());
    }
    tracing::info!(user = %user.id, "API key revoked");
    state
        .platform
        .audit()
        .auth(
            AuthEvent::KeyRevoked {
                id: path.to_string(),
            },
            &user.name,
            Some(client(&req)),
        )
        .await;
    html(&KeysFragment {
        keys: keys_of(&state, &user).await?,
        new_key: String::new(),
    })
}

/// `POST /account/signout-all`
pub async fn signout_all(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
) -> Result<HttpResponse, PageError> {
    let user = account_of(&state, &owner)
        .await?
        .ok_or_else(signed_in_only)?;
    let n = state
        .platform
        .accounts()
        .revoke_sessions(&user.id)
        .await
        .map_err(refusal)?;
    tracing::info!(user = %user.id, sessions = n, "signed out everywhere");
    Ok(HttpResponse::NoContent()
        .cookie(removal(&req, SESSION_COOKIE))
        .insert_header(("HX-Redirect", "/signin"))
        .finish())
}
