//! `/admin`: every conversation of every owner and the engine, live, for whoever holds the
//! configured `server.admin_token`.
//!
//! | route | |
//! |---|---|
//! | `GET /admin` | the dashboard; the login form without a session; a "disabled" page (404) without a token |
//! | `POST /admin/login` (form `token`) | wrong token → 401; throttled → 429 + `Retry-After`; right → session cookie + `HX-Redirect` |
//! | `POST /admin/logout` | revokes the session server-side and drops the cookie |
//! | `GET /admin/live?before=` | the tables (fragment; 50 conversations a page), polled by HTMX every 2 s |
//! | `POST /admin/c/{id}/stop`, `/evict`; `DELETE /admin/c/{id}` | actions |
//! | `POST /admin/models/{id}/{load,unload,default}` | a model's actions |
//! | `GET /ops/models`; `POST /ops/models/{id}/load`, `/unload`, `/default` | the same for the command line, the admin token as bearer |
//! | `GET /ops/tools`; `POST /ops/tools/call` | the tools and MCP servers; one call of a tool (admin token as bearer) |
//!
//! Sign-in, sessions and throttling live in [`smolchat_auth::admin`]; this module only moves
//! cookies and renders. The session cookie carries a random token (the database keeps its
//! hash) and is HttpOnly, SameSite=Strict, limited to `/admin`, Secure when the request came over
//! HTTPS, and expires with the session (`auth.admin_session_s`). Sign-out, expiry and a changed
//! admin token end the session for every copy of the cookie. The admin routes sit in the same
//! scope as the pages, so their unsafe methods need the CSRF token too.

use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::csrf;
use super::error::{PageError, WebError};
use super::html::{html, with_security_headers};
use super::owner::Owner;
use super::AppState;

mod audit;
mod live;
mod models;
pub(crate) use models::ops_caller;
mod session;
mod tools;
mod users;

pub use audit::{audit, audit_export, AuditPage, AuditQuery, AuditRow};
use live::live_view;
pub use live::{delete, evict, live, stop, AdminRow, EngineView, LiveView, ReplicaView};
pub use models::{action as model_action, ops_action, ops_list, ModelRowView};
use session::logged_in;
pub use session::{login, logout, LoginForm};
pub use tools::{ops_call as ops_tool_call, ops_list as ops_tools, McpServerView};
use users::users_view;
pub use users::{
    create_invite, create_user, delete_user, reset_password, revoke_invite, user_action,
    user_usage, ConfirmForm, InviteForm, NewUserForm, UserRowView, UsersView,
};

#[derive(Template)]
#[template(path = "admin_disabled.html")]
struct DisabledPage {
    csrf: String,
}

#[derive(Template)]
#[template(path = "admin_login.html")]
struct LoginPage {
    csrf: String,
}

/// `?before=` (the conversations table's cursor) and `?page=` (the users table's page, from 1).
#[derive(Deserialize)]
pub struct PageQuery {
    #[serde(default)]
    before: String,
    #[serde(default = "first_page")]
    page: i64,
}

fn first_page() -> i64 {
    1
}

#[derive(Template)]
#[template(path = "admin.html")]
struct AdminPage {
    csrf: String,
    live: LiveView,
    users: UsersView,
    /// The signed-in admin account's name; empty for an admin-token session.
    account: String,
    /// The per-user limits and sign-up rules in force, as (setting, value, meaning).
    limits: Vec<(&'static str, String, &'static str)>,
    /// Invite links not yet used: (id, made, expires).
    invites: Vec<(String, String, String)>,
}

/// The configured per-user limits and sign-up rules, for the admin page: an operator who sees a
/// user refused with 429 can tell which limit it was without reading the config file.
fn limits_view(
    config: &smolchat_service::config::Config,
) -> Vec<(&'static str, String, &'static str)> {
    let or_none = |n: u64| {
        if n == 0 {
            "no limit".to_string()
        } else {
            n.to_string()
        }
    };
    let l = &config.limits;
    let s = &config.scheduler;
    vec![
        (
            "scheduler.max_running_per_user",
            or_none(s.max_running_per_user as u64),
            "replies generated at once per user",
        ),
        (
            "scheduler.max_queued_per_user",
            or_none(s.max_queued_per_user as u64),
            "requests waiting per user (more: 429)",
        ),
        (
            "limits.tokens_per_minute_per_user",
            or_none(l.tokens_per_minute_per_user),
            "generated tokens per user per minute (more: 429)",
        ),
        (
            "limits.tokens_per_day_per_user",
            or_none(l.tokens_per_day_per_user),
            "tokens per account per UTC day, all replicas together (more: 429)",
        ),
        (
            "limits.tokens_per_month_per_user",
            or_none(l.tokens_per_month_per_user),
            "tokens per account per calendar month (more: 429)",
        ),
        (
            "limits.tokens_per_day_per_key",
            or_none(l.tokens_per_day_per_key),
            "tokens per personal API key per UTC day (more: 429)",
        ),
        (
            "limits.tokens_per_month_per_key",
            or_none(l.tokens_per_month_per_key),
            "tokens per personal API key per calendar month (more: 429)",
        ),
        (
            "limits.conversations_per_minute",
            or_none(u64::from(l.conversations_per_minute)),
            "new conversations per user, and per address for guests (more: 429)",
        ),
        (
            "limits.max_conversations_per_user",
            or_none(l.max_conversations_per_user),
            "conversations stored per user (more: 429)",
        ),
        (
            "limits.max_streams_per_user",
            or_none(l.max_streams_per_user as u64),
            "open event streams per user (more: 429)",
        ),
        (
            "scheduler.queue_size",
            s.queue_size.to_string(),
            "requests waiting in all (more: 503)",
        ),
        (
            "auth.signup",
            format!("{:?}", config.auth.signup).to_lowercase(),
            "who may create an account",
        ),
        (
            "auth.guests",
            config.auth.guests.to_string(),
            "whether people may chat without an account",
        ),
    ]
}

/// `GET /admin?before=`
pub async fn page(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    query: web::Query<PageQuery>,
) -> Result<HttpResponse, PageError> {
    let csrf = csrf::token_for(&state.cookie_key, &owner.csrf_subject());
    if owner.is_admin() {
        return dashboard(&state, csrf, &owner, &query).await;
    }
    let Some(admin) = state.platform.admin_auth() else {
        let body = DisabledPage { csrf }
            .render()
            .map_err(|e| WebError::Internal(format!("template: {e}")))?;
        let mut res = HttpResponse::NotFound();
        with_security_headers(&mut res);
        return Ok(res.content_type("text/html; charset=utf-8").body(body));
    };
    if !logged_in(admin, &req).await? {
        return html(&LoginPage { csrf });
    }
    dashboard(&state, csrf, &owner, &query).await
}

async fn dashboard(
    state: &AppState,
    csrf: String,
    owner: &Owner,
    query: &PageQuery,
) -> Result<HttpResponse, PageError> {
    html(&AdminPage {
        csrf,
        live: live_view(state, &query.before).await?,
        users: users_view(state, query.page).await?,
        limits: limits_view(state.platform.config()),
        account: owner.name().unwrap_or_default().to_string(),
        invites: state
            .platform
            .admin()
            .invites()
            .await?
            .into_iter()
            .map(|i| {
                (
                    i.id,
                    i.created_at.format("%Y-%m-%d %H:%M UTC").to_string(),
                    i.expires_at.format("%Y-%m-%d %H:%M UTC").to_string(),
                )
            })
            .collect(),
    })
}
