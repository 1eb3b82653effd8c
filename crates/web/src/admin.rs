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
//!
//! Sign-in, sessions and throttling live in [`smolchat_auth::admin`]; this module only moves
//! cookies and renders. The session cookie carries a random token (the database keeps its
//! hash) and is HttpOnly, SameSite=Strict, limited to `/admin`, Secure when the request came over
//! HTTPS, and expires with the session (`auth.admin_session_s`). Sign-out, expiry and a changed
//! admin token end the session for every copy of the cookie. The admin routes sit in the same
//! scope as the pages, so their unsafe methods need the CSRF token too.

use actix_web::cookie::time::Duration as CookieDuration;
use actix_web::cookie::SameSite;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::api::{page_request, parse_id};
use super::client::Client;
use super::csrf;
use super::error::PageError;
use super::error::WebError;
use super::html::{html, read_form, with_security_headers};
use super::owner::Owner;
use super::AppState;
use smolchat_auth::{AdminAuth, AuthError, LockedBy};
use smolchat_service::admin::{LiveView as Live, UserAction, UsersPage};
use smolchat_service::audit::AuthEvent;
use smolchat_service::completions::{DeviceMemory, GraphStats, SequenceState};
use smolchat_service::records::AuditFilter;

use super::cookies::ADMIN as SESSION_COOKIE;
const COOKIE_PATH: &str = "/admin";

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

pub struct EngineView {
    /// Where and on which path the model computes (`cpu · cpu`, `cuda:0 · fast`).
    pub device: String,
    pub tier: String,
    /// Why the tier is not the one asked for, if it is not.
    pub tier_note: String,
    pub queued: usize,
    pub queue_capacity: usize,
    pub running: usize,
    pub max_running: usize,
    pub tokens_per_s: String,
    pub kv_used: String,
    pub kv_budget: String,
    pub kv_percent: String,
    pub cached_sequences: usize,
    pub evictions: u64,
    pub generated_tokens: u64,
    /// The GPU's memory (empty off a GPU): percent used, then what holds it.
    pub gpu_used_percent: String,
    pub gpu_memory: String,
    /// How decode graphs have been used (empty without graphs).
    pub graphs: String,
    /// Speculative decoding: acceptance and tokens per verifying step (empty when nothing was
    /// drafted).
    pub speculation: String,
    pub speculation_sub: String,
}

pub struct AdminRow {
    pub id: String,
    pub owner: String,
    pub title: String,
    pub message_count: i64,
    pub last_activity: String,
    pub state: &'static str,
    pub kv: String,
    pub active: bool,
    /// The replica holding the conversation's KV cache ("—": none).
    pub replica: String,
    /// Speculative decoding: acceptance and tokens per verifying step ("—": no drafts).
    pub drafts: String,
}

/// One replica on the admin page.
pub struct ReplicaView {
    pub name: String,
    pub url: String,
    /// "live", "stopped" or "dead" (no heartbeat within the lease).
    pub state: &'static str,
    /// The replica serving this page.
    pub here: bool,
    pub heartbeat: String,
    pub queued: usize,
    pub running: usize,
    pub tokens_per_s: String,
    pub kv: String,
    pub streams: usize,
    pub held_count: usize,
}

pub struct LiveView {
    pub engine: EngineView,
    /// Every replica on the database, live or gone within the hour.
    pub replicas: Vec<ReplicaView>,
    pub rows: Vec<AdminRow>,
    pub updated: String,
    /// The cursor this page starts after ("" for the newest page); the poll keeps it.
    pub before: String,
    /// The next (older) page's cursor, "" on the last page.
    pub next: String,
}

/// Conversations per admin table page: the table (and each 2-second poll of it) stays small
/// however many conversations there are.
const ADMIN_PAGE: usize = 50;

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

#[derive(Template)]
#[template(path = "admin_live.html")]
struct LiveFragment {
    live: LiveView,
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn gib(bytes: usize) -> String {
    format!("{:.1} GiB", bytes as f64 / (1024.0 * 1024.0 * 1024.0))
}

/// The GPU memory tile's value and line: percent of the card in use, and what holds it.
fn gpu_memory_view(memory: Option<DeviceMemory>) -> (String, String) {
    let Some(m) = memory.filter(|m| m.total_bytes > 0) else {
        return (String::new(), String::new());
    };
    let used = m.total_bytes.saturating_sub(m.free_bytes);
    (
        format!("{:.0}", 100.0 * used as f64 / m.total_bytes as f64),
        format!(
            "weights {} · KV {} · free {} of {}",
            gib(m.weights_bytes),
            gib(m.kv_bytes),
            gib(m.free_bytes),
            gib(m.total_bytes)
        ),
    )
}

fn graphs_view(graphs: Option<GraphStats>) -> String {
    graphs.map_or_else(String::new, |g| {
        format!(
            "{} replays · {} captures · {} invalidated",
            g.replays, g.captures, g.invalidated
        )
    })
}

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
    req.cookie(&super::cookies::name(SESSION_COOKIE, Client::of(req).https))
}

/// Whether the request carries the cookie of a valid admin session.
async fn logged_in(admin: &AdminAuth, req: &HttpRequest) -> Result<bool, PageError> {
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
async fn require_admin(
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

async fn live_view(state: &AppState, before: &str) -> Result<LiveView, PageError> {
    let page = page_request(Some(ADMIN_PAGE), Some(before))?;
    let live = state.platform.admin().live(&page).await?;
    Ok(render_live(live, &page, state.platform.model()))
}

/// The operator's live view as the page shows it.
fn render_live(
    live: Live,
    page: &smolchat_service::records::PageRequest,
    model: &smolchat_service::platform::ModelInfo,
) -> LiveView {
    let now = chrono::Utc::now();
    let replicas = live
        .replicas
        .iter()
        .map(|r| ReplicaView {
            name: r.name.clone(),
            url: r.url.clone(),
            state: if r.live {
                "live"
            } else if r.stopped_at.is_some() {
                "stopped"
            } else {
                "dead"
            },
            here: r.id == live.this_replica,
            heartbeat: format!(
                "{:.0} s ago",
                (now - r.heartbeat_at).num_milliseconds().max(0) as f64 / 1e3
            ),
            queued: r.load.queued,
            running: r.load.running,
            tokens_per_s: format!("{:.1}", r.load.tokens_per_s),
            kv: format!(
                "{} of {}",
                mib(r.load.kv_bytes),
                mib(r.load.kv_budget_bytes)
            ),
            streams: r.load.streams,
            held_count: r.load.held_count,
        })
        .collect();
    let rows = live
        .conversations
        .into_iter()
        .map(|c| AdminRow {
            id: c.summary.id.to_string(),
            kv: c.kv_bytes.map(mib).unwrap_or_else(|| "—".into()),
            drafts: c.speculation.map_or_else(
                || "—".into(),
                |(drafted, accepted, steps)| {
                    format!(
                        "{:.0}% · {:.1} tok/step",
                        100.0 * accepted as f64 / drafted.max(1) as f64,
                        (accepted + steps) as f64 / steps.max(1) as f64
                    )
                },
            ),
            replica: c.replica.unwrap_or_else(|| "—".into()),
            // The account's name, or enough of a guest's id to tell guests apart.
            owner: c.owner_name.unwrap_or_else(|| {
                format!(
                    "guest {}",
                    c.summary.owner.chars().take(8).collect::<String>()
                )
            }),
            title: if c.summary.title.is_empty() {
                "(untitled)".into()
            } else {
                c.summary.title
            },
            message_count: c.summary.message_count,
            last_activity: c.summary.updated_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            state: match c.state {
                SequenceState::Idle => "idle",
                SequenceState::Queued => "queued",
                SequenceState::Prefilling => "prefilling",
                SequenceState::Generating => "generating",
            },
            active: !matches!(c.state, SequenceState::Idle),
        })
        .collect();
    let stats = live.stats;
    let percent = if stats.kv_budget_bytes > 0 {
        100.0 * stats.kv_bytes as f64 / stats.kv_budget_bytes as f64
    } else {
        0.0
    };
    let (gpu_used_percent, gpu_memory) = gpu_memory_view(stats.device_memory);
    LiveView {
        engine: EngineView {
            device: model.device.clone(),
            tier: model.tier.clone(),
            tier_note: model.tier_note.clone().unwrap_or_default(),
            queued: stats.queued,
            queue_capacity: stats.queue_capacity,
            running: stats.running,
            max_running: stats.max_running,
            tokens_per_s: format!("{:.1}", stats.tokens_per_s),
            kv_used: mib(stats.kv_bytes),
            kv_budget: mib(stats.kv_budget_bytes),
            kv_percent: format!("{percent:.0}"),
            cached_sequences: stats.cached_sequences,
            evictions: stats.evictions,
            generated_tokens: stats.generated_tokens,
            gpu_used_percent,
            gpu_memory,
            graphs: graphs_view(stats.graphs),
            speculation: if stats.drafted_tokens > 0 {
                format!(
                    "{:.0}%",
                    100.0 * stats.accepted_draft_tokens as f64 / stats.drafted_tokens as f64
                )
            } else {
                String::new()
            },
            speculation_sub: if stats.verifying_steps > 0 {
                let mut sub = format!(
                    "accepted · {:.2} tokens per verifying step · {} drafted",
                    (stats.accepted_draft_tokens + stats.verifying_steps) as f64
                        / stats.verifying_steps as f64,
                    stats.drafted_tokens
                );
                if stats.step_position_ms > 0.0 {
                    // As the model worker measured them (`smolchat_serving::speculate::StepCost`).
                    let per = stats.step_position_ms;
                    sub.push_str(&format!(
                        " · a position costs {per:.2} ms of a {:.1} ms step (drafts pay above {:.0}% acceptance)",
                        stats.step_fixed_ms + per,
                        100.0 * stats.draft_break_even
                    ));
                }
                sub
            } else {
                String::new()
            },
        },
        replicas,
        rows,
        updated: now.format("%H:%M:%S UTC").to_string(),
        before: page.before.map(|c| c.encode()).unwrap_or_default(),
        next: live.next.map(|c| c.encode()).unwrap_or_default(),
    }
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

async fn users_view(state: &AppState, page: i64) -> Result<UsersView, PageError> {
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
        super::client::public_base(&state, &req)
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

/// `GET /admin/live?before=`
pub async fn live(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    query: web::Query<PageQuery>,
) -> Result<HttpResponse, PageError> {
    require_admin(&state, &owner, &req).await?;
    html(&LiveFragment {
        live: live_view(&state, &query.before).await?,
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
    let cookie = super::cookies::build(
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
    let gone = super::cookies::removal(SESSION_COOKIE, Client::of(&req).https, COOKIE_PATH);
    Ok(HttpResponse::NoContent()
        .cookie(gone)
        .insert_header(("HX-Redirect", "/admin"))
        .finish())
}

/// `POST /admin/c/{id}/stop`
pub async fn stop(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let id = parse_id(&path)?;
    state.platform.admin().stop(&by, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `POST /admin/c/{id}/evict`
pub async fn evict(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let id = parse_id(&path)?;
    state.platform.admin().evict(&by, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `DELETE /admin/c/{id}`
pub async fn delete(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let id = parse_id(&path)?;
    state.platform.admin().delete(&by, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `GET /admin/audit?actor=&action=&q=&before=` (and `/admin/audit.csv`, `/admin/audit.json`).
#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    #[serde(default)]
    actor: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    q: String,
    #[serde(default)]
    before: String,
}

impl AuditQuery {
    fn filter(&self) -> AuditFilter {
        let some = |s: &str| (!s.trim().is_empty()).then(|| s.trim().to_string());
        AuditFilter {
            actor: some(&self.actor),
            action: some(&self.action),
            text: some(&self.q),
            before: some(&self.before),
        }
    }

    /// The query string of this filter (without `before`), for links.
    fn filter_query(&self) -> String {
        let pairs = [
            ("actor", &self.actor),
            ("action", &self.action),
            ("q", &self.q),
        ];
        pairs
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k}={}", super::html::url_encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// One row of the audit table.
pub struct AuditRow {
    pub at: String,
    pub at_iso: String,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub address: String,
    pub detail: String,
}

#[derive(Template)]
#[template(path = "admin_audit.html")]
pub struct AuditPage {
    pub csrf: String,
    pub rows: Vec<AuditRow>,
    pub actor: String,
    pub action: String,
    pub q: String,
    /// The query string of the filter, for the export and paging links.
    pub filter: String,
    /// The id the "Older" link continues from ("" on the last page).
    pub older: String,
    pub actions: &'static [&'static str],
}

/// Entries on one page of the audit table.
const AUDIT_ROWS: usize = 50;

/// `GET /admin/audit`: the audit log, newest first, filtered by actor, action and text.
pub async fn audit(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    query: web::Query<AuditQuery>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let entries = state
        .platform
        .admin()
        .audit(&by, &query.filter(), AUDIT_ROWS + 1)
        .await?;
    let more = entries.len() > AUDIT_ROWS;
    let shown: Vec<_> = entries.into_iter().take(AUDIT_ROWS).collect();
    let older = if more {
        shown.last().map(|e| e.id.clone()).unwrap_or_default()
    } else {
        String::new()
    };
    html(&AuditPage {
        csrf: csrf::token_for(&state.cookie_key, &owner.csrf_subject()),
        rows: shown
            .into_iter()
            .map(|e| AuditRow {
                at: e.at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
                at_iso: e.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                actor: e.actor,
                action: e.action,
                target: e.target,
                address: e.address,
                detail: e.detail,
            })
            .collect(),
        actor: query.actor.clone(),
        action: query.action.clone(),
        q: query.q.clone(),
        filter: query.filter_query(),
        older,
        actions: AUDIT_ACTIONS,
    })
}

/// The actions the filter offers (see `smolchat_service::audit`).
const AUDIT_ACTIONS: &[&str] = &[
    "auth.sign_in",
    "auth.sign_in_failed",
    "auth.sign_up",
    "auth.sign_out",
    "auth.password_changed",
    "auth.key_created",
    "auth.key_revoked",
    "admin.disable_user",
    "admin.enable_user",
    "admin.revoke_sessions",
    "admin.stop",
    "admin.evict",
    "admin.delete_conversation",
    "conversation.delete",
    "conversation.import",
    "conversation.export",
];

/// `GET /admin/audit.{csv,json}`: the filtered log (up to 500 entries from `before`), as a
/// download.
pub async fn audit_export(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
    query: web::Query<AuditQuery>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let format = path.into_inner();
    if format != "csv" && format != "json" {
        return Err(WebError::NotFound(format!(
            "the audit log exports as audit.csv or audit.json, not audit.{format}"
        ))
        .into());
    }
    let entries = state
        .platform
        .admin()
        .audit(
            &by,
            &query.filter(),
            smolchat_service::audit::MAX_AUDIT_PAGE,
        )
        .await?;
    let (mime, body) = if format == "csv" {
        (
            "text/csv; charset=utf-8",
            smolchat_service::audit::to_csv(&entries),
        )
    } else {
        (
            "application/json",
            serde_json::json!({ "entries": entries }).to_string(),
        )
    };
    Ok(HttpResponse::Ok()
        .content_type(mime)
        .insert_header((
            actix_web::http::header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"smolchat-audit.{format}\""),
        ))
        .insert_header((actix_web::http::header::CACHE_CONTROL, "no-store"))
        .body(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_tiles_say_what_holds_the_memory_and_stay_empty_off_a_gpu() {
        assert_eq!(gpu_memory_view(None), (String::new(), String::new()));
        let gib = 1usize << 30;
        let (percent, line) = gpu_memory_view(Some(DeviceMemory {
            weights_bytes: 2 * gib,
            kv_bytes: 40 * gib,
            free_bytes: 20 * gib,
            total_bytes: 80 * gib,
        }));
        assert_eq!(percent, "75");
        assert_eq!(
            line,
            "weights 2.0 GiB · KV 40.0 GiB · free 20.0 GiB of 80.0 GiB"
        );
        assert_eq!(graphs_view(None), "");
        let g = GraphStats {
            warmups: 3,
            captures: 3,
            replays: 120,
            invalidated: 1,
        };
        assert_eq!(
            graphs_view(Some(g)),
            "120 replays · 3 captures · 1 invalidated"
        );
    }
}
