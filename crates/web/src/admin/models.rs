//! The models on the admin page and their actions: load, unload, make the default. The same
//! actions answer the command line (`smolchat model list|load|unload`) under `/ops/models`,
//! where the admin token is the bearer (throttled like a sign-in).

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{json, Value};
use smolchat_service::admin::ModelRow;
use smolchat_service::models::ModelError;

use super::session::require_admin;
use super::*;

/// A model that cannot be had or changed, as a status: unknown 404, busy 409, no room or a
/// load that failed 503.
pub(crate) fn model_web_error(e: ModelError) -> WebError {
    match e {
        ModelError::NotFound { .. } => WebError::NotFound(e.to_string()),
        ModelError::Busy { .. } | ModelError::Pinned { .. } => WebError::Conflict(e.to_string()),
        ModelError::NoRoom { .. } | ModelError::Load { .. } => WebError::Unavailable(e.to_string()),
    }
}

/// A model's row on the admin page.
pub struct ModelRowView {
    pub id: String,
    /// Its aliases, comma-separated ("" for none).
    pub aliases: String,
    pub main: bool,
    pub default: bool,
    /// "loaded", "loading", "not loaded".
    pub state: &'static str,
    pub memory: String,
    /// Device and tier while loaded ("—" otherwise).
    pub device: String,
    pub queued: usize,
    pub running: usize,
    pub tokens_per_s: String,
    pub generated_tokens: u64,
    /// Loads and unloads since start, and the last load's seconds.
    pub loads: String,
    pub last_error: String,
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}

impl ModelRowView {
    pub fn of(row: &ModelRow) -> Self {
        let s = &row.status;
        let stats = row.stats.as_ref();
        ModelRowView {
            id: s.id.clone(),
            aliases: s.aliases.join(", "),
            main: s.main,
            default: s.default,
            state: s.state.as_str(),
            memory: if s.state == smolchat_service::models::LoadState::Loaded {
                mib(s.memory_bytes)
            } else {
                format!("{} file", mib(s.memory_bytes))
            },
            device: s
                .info
                .as_ref()
                .map_or_else(|| "—".into(), |i| format!("{} · {}", i.device, i.tier)),
            queued: stats.map_or(0, |t| t.queued),
            running: stats.map_or(0, |t| t.running),
            tokens_per_s: stats.map_or_else(|| "—".into(), |t| format!("{:.1}", t.tokens_per_s)),
            generated_tokens: stats.map_or(0, |t| t.generated_tokens),
            loads: format!(
                "{} / {}{}",
                s.loads,
                s.unloads,
                s.load_s.map(|t| format!(" · {t:.1} s")).unwrap_or_default()
            ),
            last_error: s.last_error.clone().unwrap_or_default(),
        }
    }
}

/// Runs a model action (`load`, `unload` or `default`) for `by`: what it did, in words. The
/// admin page and `/ops/models` both act through here.
async fn act(
    state: &AppState,
    by: &smolchat_service::Caller,
    id: &str,
    action: &str,
) -> Result<&'static str, WebError> {
    let admin = state.platform.admin();
    match action {
        "load" => admin.load_model(by, id).await.map(|()| "loaded"),
        "unload" => admin.unload_model(by, id).await.map(|unloaded| {
            if unloaded {
                "unloaded"
            } else {
                "was not loaded"
            }
        }),
        "default" => admin.set_default_model(by, id).await.map(|_| "default"),
        other => {
            return Err(WebError::NotFound(format!(
                "no action {other:?}: use load, unload or default"
            )))
        }
    }
    .map_err(model_web_error)
}

/// `POST /admin/models/{id}/{action}`: the models table's buttons (`load`, `unload`, `default`).
pub async fn action(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let (id, action) = path.into_inner();
    act(&state, &by, &id, &action).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// The admin token as a bearer, checked (and throttled) by the admin sign-in.
pub(crate) fn ops_caller(
    state: &AppState,
    req: &HttpRequest,
) -> Result<smolchat_service::Caller, WebError> {
    let Some(admin) = state.platform.admin_auth() else {
        return Err(WebError::NotFound(
            "the admin API is off: set server.admin_token".into(),
        ));
    };
    let given = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let client = crate::client::Client::of(req).address;
    admin.check_bearer(given, client).map_err(|e| match e {
        smolchat_auth::AuthError::Throttled(t) => WebError::TooManyRequests {
            message: e.to_string(),
            retry_after_s: t.retry_after_s(),
        },
        _ => WebError::Unauthorized(
            "send the admin token (server.admin_token) as `Authorization: Bearer …`".into(),
        ),
    })?;
    Ok(smolchat_service::Caller {
        owner: "admin".into(),
        admin: true,
        guest: false,
        address: Some(client),
    })
}

fn model_json(row: &ModelRow) -> Value {
    let s = &row.status;
    json!({
        "id": s.id,
        "aliases": s.aliases,
        "main": s.main,
        "default": s.default,
        "state": s.state.as_str(),
        "memory_bytes": s.memory_bytes,
        "device": s.info.as_ref().map(|i| i.device.clone()),
        "tier": s.info.as_ref().map(|i| i.tier.clone()),
        "context_window": s.info.as_ref().map(|i| i.context_window),
        "load_s": s.load_s,
        "loads": s.loads,
        "unloads": s.unloads,
        "last_error": s.last_error,
        "sha256": s.sha256,
        "queued": row.stats.as_ref().map(|t| t.queued),
        "running": row.stats.as_ref().map(|t| t.running),
        "tokens_per_s": row.stats.as_ref().map(|t| t.tokens_per_s),
        "generated_tokens": row.stats.as_ref().map(|t| t.generated_tokens),
    })
}

/// `GET /ops/models` (bearer: the admin token)
pub async fn ops_list(
    state: web::Data<AppState>,
    req: HttpRequest,
) -> Result<HttpResponse, WebError> {
    ops_caller(&state, &req)?;
    let rows = state.platform.admin().models().await;
    Ok(HttpResponse::Ok().json(json!({
        "models": rows.iter().map(model_json).collect::<Vec<_>>(),
    })))
}

/// `POST /ops/models/{id}/{action}`: `load`, `unload` or `default` (bearer: the admin token).
pub async fn ops_action(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, WebError> {
    let by = ops_caller(&state, &req)?;
    let (id, action) = path.into_inner();
    let outcome = act(&state, &by, &id, &action).await?;
    let rows = state.platform.admin().models().await;
    let found = state.platform.models().find(&id).ok();
    let row = rows.iter().find(|r| Some(&r.status.id) == found.as_ref());
    Ok(HttpResponse::Ok().json(json!({
        "outcome": outcome,
        "model": row.map(model_json),
    })))
}
