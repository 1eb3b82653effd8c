//! The audit log: the filtered, paged table and its CSV and JSON exports.

use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::session::require_admin;
use crate::csrf;
use crate::error::{PageError, WebError};
use crate::html::html;
use crate::owner::Owner;
use crate::AppState;
use smolchat_service::records::AuditFilter;

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
            .map(|(k, v)| format!("{k}={}", crate::html::url_encode(v)))
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
