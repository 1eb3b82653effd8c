//! Accounts on the admin page: the Users table, making, disabling, resetting and deleting
//! accounts, invite links, and one account's usage history.

use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::session::require_admin;
use crate::csrf;
use crate::error::{PageError, WebError};
use crate::html::{html, read_form};
use crate::owner::Owner;
use crate::AppState;
use smolchat_service::admin::{UserAction, UsersPage};

pub struct UserRowView {
    pub id: String,
    pub name: String,
    pub role: &'static str,
    pub disabled: bool,
    pub conversations: i64,
    pub tokens: i64,
    pub last_seen: String,
    pub sessions: i64,
}

pub struct UsersView {
    pub rows: Vec<UserRowView>,
    pub page: i64,
    pub prev: i64,
    pub next: i64,
}

pub(super) async fn users_view(state: &AppState, page: i64) -> Result<UsersView, PageError> {
    let UsersPage {
        users,
        page,
        has_more,
    } = state.platform.admin().users(page).await?;
    Ok(UsersView {
        rows: users
            .into_iter()
            .map(|u| UserRowView {
                role: u.user.role.as_str(),
                disabled: u.user.is_disabled(),
                conversations: u.conversations,
                tokens: u.tokens,
                last_seen: u.user.last_seen_at.map_or_else(
                    || "never".into(),
                    |t| t.format("%Y-%m-%d %H:%M").to_string(),
                ),
                sessions: u.active_sessions,
                id: u.user.id,
                name: u.user.name,
            })
            .collect(),
        page,
        prev: if page > 1 { page - 1 } else { 0 },
        next: if has_more { page + 1 } else { 0 },
    })
}

/// `POST /admin/users/{id}/{action}` with action `disable`, `enable` or `revoke` (its
/// sessions). Answers `HX-Refresh` so the table shows the new state.
pub async fn user_action(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let (id, action) = path.into_inner();
    let action: UserAction = action.parse()?;
    state.platform.admin().user_action(&by, &id, action).await?;
    Ok(HttpResponse::NoContent()
        .insert_header(("HX-Refresh", "true"))
        .finish())
}

#[derive(Deserialize)]
pub struct NewUserForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    password: String,
    /// A checkbox: present when the new account is an admin.
    admin: Option<String>,
}

/// `POST /admin/users`: makes an account (name, password, admin checkbox).
pub async fn create_user(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let form: NewUserForm = read_form(&state, &req, payload).await?;
    state
        .platform
        .admin()
        .create_user(&by, &form.name, &form.password, form.admin.is_some())
        .await?;
    Ok(HttpResponse::NoContent()
        .insert_header(("HX-Refresh", "true"))
        .finish())
}

#[derive(Deserialize)]
pub struct InviteForm {
    #[serde(default = "seven")]
    days: String,
}

fn seven() -> String {
    "7".into()
}

#[derive(Template)]
#[template(
    source = "<p class=\"ok\" role=\"status\">Invite link, valid {{ days }} days and shown only now: <input type=\"text\" readonly id=\"invite-link\" aria-label=\"Invite link\" value=\"{{ link }}\"></p>",
    ext = "html"
)]
struct InviteMade {
    days: u64,
    link: String,
}

/// `POST /admin/invites`: a single-use sign-up link, shown once.
pub async fn create_invite(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let form: InviteForm = read_form(&state, &req, payload).await?;
    let days: u64 = form.days.trim().parse().map_err(|_| {
        WebError::BadRequest(format!("`days`: {:?} is not a whole number", form.days))
    })?;
    let code = state.platform.admin().create_invite(&by, days).await?;
    let link = format!(
        "{}/signup?invite={code}",
        crate::client::public_base(&state, &req)
    );
    html(&InviteMade { days, link })
}

#[derive(Template)]
#[template(
    source = "<p class=\"ok\" role=\"status\">New password for {{ name }}, shown only now (they must choose their own at their next sign-in): <input type=\"text\" readonly id=\"reset-password\" aria-label=\"New password\" value=\"{{ password }}\"> {% if keys_revoked == 1 %}Their 1 API key was revoked.{% else if keys_revoked > 1 %}Their {{ keys_revoked }} API keys were revoked.{% else %}They had no API keys to revoke.{% endif %}</p>",
    ext = "html"
)]
struct PasswordReset {
    name: String,
    password: String,
    keys_revoked: u64,
}

/// `POST /admin/users/{id}/reset-password`: a new random password for the account, shown once
/// here; its sessions end and its next sign-in must choose a new one.
pub async fn reset_password(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let (name, reset) = state.platform.admin().reset_password(&by, &path).await?;
    html(&PasswordReset {
        name,
        password: reset.password,
        keys_revoked: reset.keys_revoked,
    })
}

/// `POST /admin/invites/{id}/revoke`: ends an invite link before it is used.
pub async fn revoke_invite(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    state.platform.admin().revoke_invite(&by, &path).await?;
    Ok(HttpResponse::NoContent()
        .insert_header(("HX-Refresh", "true"))
        .finish())
}

#[derive(Template)]
#[template(path = "admin_usage.html")]
struct UsagePage {
    csrf: String,
    name: String,
    /// (day, tokens, requests), newest first.
    days: Vec<(String, i64, i64)>,
    total: i64,
    /// The largest day's tokens, for the bars' scale.
    most: i64,
}

/// `GET /admin/users/{id}/usage`: an account's tokens and requests per day, the last 90 days.
pub async fn user_usage(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    require_admin(&state, &owner, &req).await?;
    let (user, days) = state.platform.admin().usage_history(&path, 90).await?;
    let total = days.iter().map(|d| d.1).fold(0i64, i64::saturating_add);
    let most = days.iter().map(|d| d.1).max().unwrap_or(0).max(1);
    html(&UsagePage {
        csrf: csrf::token_for(&state.cookie_key, &owner.csrf_subject()),
        name: user.name,
        days: days
            .into_iter()
            .map(|(day, tokens, requests)| (day.format("%Y-%m-%d").to_string(), tokens, requests))
            .collect(),
        total,
        most,
    })
}

/// `POST /admin/users/{id}/delete`: deletes the account and all it owns, once confirmed with
/// its name (htmx's `hx-prompt` answer in `HX-Prompt`, or a `confirm` form field).
pub async fn delete_user(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let prompted = req
        .headers()
        .get("HX-Prompt")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let confirm = match prompted {
        Some(c) => c,
        None => {
            let form: ConfirmForm = read_form(&state, &req, payload).await?;
            form.confirm
        }
    };
    state
        .platform
        .admin()
        .delete_user(&by, &path, &confirm)
        .await?;
    Ok(HttpResponse::NoContent()
        .insert_header(("HX-Refresh", "true"))
        .finish())
}

#[derive(Deserialize)]
pub struct ConfirmForm {
    #[serde(default)]
    confirm: String,
}
