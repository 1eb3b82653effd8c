//! The audit log (migration 0010): one row per thing done, added and never changed, removed
//! after the configured time. The service decides what is recorded and how it is named.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{now_micros, parse_time, Store, StoreError};

/// One thing done.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AuditEntry {
    pub id: String,
    #[serde(serialize_with = "super::types::rfc3339_pub")]
    pub at: DateTime<Utc>,
    /// Who: `user:<name>`, `admin` (the admin token), `guest:<id>`, `api-key:<prefix>`, `cli`.
    pub actor: String,
    /// What, as a dotted name: `auth.sign_in`, `admin.delete_conversation`, …
    pub action: String,
    /// To what: `user:<name>`, `conversation:<id>`, `key:<prefix>`, … (empty: nothing else).
    pub target: String,
    /// The client's address (empty when there is none: the CLI).
    pub address: String,
    /// More, in words or JSON (empty when there is nothing more).
    pub detail: String,
}

/// A new entry (the store adds its id and time).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewAuditEntry {
    pub actor: String,
    pub action: String,
    pub target: String,
    pub address: String,
    pub detail: String,
}

/// Which entries a page holds: all (fields `None`), or those matching each given field
/// (`actor`/`action` exactly, `text` anywhere in target or detail), older than `before` (an id
/// of the previous page) — newest first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuditFilter {
    pub actor: Option<String>,
    pub action: Option<String>,
    pub text: Option<String>,
    pub before: Option<String>,
}

#[derive(sqlx::FromRow)]
struct AuditRow {
    id: String,
    at: i64,
    actor: String,
    action: String,
    target: String,
    address: String,
    detail: String,
}

impl Store {
    /// Adds an entry.
    pub async fn record_audit(&self, entry: &NewAuditEntry) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO audit_log (id, at, actor, action, target, address, detail) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(Uuid::now_v7().to_string())
        .bind(now_micros())
        .bind(&entry.actor)
        .bind(&entry.action)
        .bind(&entry.target)
        .bind(&entry.address)
        .bind(&entry.detail)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Up to `limit` entries matching `filter`, newest first.
    pub async fn audit_page(
        &self,
        filter: &AuditFilter,
        limit: usize,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let text = filter
            .text
            .as_deref()
            .filter(|t| !t.is_empty())
            .map(|t| format!("%{}%", super::like_escape(&t.to_lowercase())));
        let rows: Vec<AuditRow> = sqlx::query_as(
            "SELECT id, at, actor, action, target, address, detail FROM audit_log \
             WHERE ($1 IS NULL OR actor = $1) AND ($2 IS NULL OR action = $2) \
               AND ($3 IS NULL OR lower(target) LIKE $3 ESCAPE '\\' \
                    OR lower(detail) LIKE $3 ESCAPE '\\') \
               AND ($4 IS NULL OR id < $4) \
             ORDER BY id DESC LIMIT $5",
        )
        .bind(filter.actor.as_deref().filter(|a| !a.is_empty()))
        .bind(filter.action.as_deref().filter(|a| !a.is_empty()))
        .bind(text)
        .bind(filter.before.as_deref().filter(|b| !b.is_empty()))
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                Ok(AuditEntry {
                    at: parse_time("audit_log", &r.id, r.at)?,
                    id: r.id,
                    actor: r.actor,
                    action: r.action,
                    target: r.target,
                    address: r.address,
                    detail: r.detail,
                })
            })
            .collect()
    }

    /// Removes entries older than `keep_days`; how many.
    pub async fn purge_audit(&self, keep_days: u64) -> Result<u64, StoreError> {
        let cutoff = now_micros().saturating_sub((keep_days as i64).saturating_mul(86_400_000_000));
        let done = sqlx::query("DELETE FROM audit_log WHERE at < $1")
            .bind(cutoff)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
