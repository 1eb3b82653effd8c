//! Server-side sessions (`sessions`, migration 0002): what a sign-in cookie stands for.
//!
//! The store deals only in session ids (the SHA-256 of the cookie token, computed by the caller)
//! and credential fingerprints; it never sees a token or a credential.

use chrono::{DateTime, Utc};

use super::{corrupt, now_micros, parse_time, SessionKind, SessionRecord, Store, StoreError};

/// `last_seen_at` is only rewritten when it is older than this, so an admin page polling every
/// two seconds does not turn every poll into a committed (fsynced) write.
const LAST_SEEN_RESOLUTION_MICROS: i64 = 60 * 1_000_000;

macro_rules! session_columns {
    () => {
        "id, kind, subject, fingerprint, created_at, expires_at, last_seen_at, revoked_at"
    };
}

impl Store {
    /// Stores a new session `id` of `subject`, made under the credential `fingerprint`, expiring
    /// `ttl` from now (a `ttl` of zero or less stores one that is already expired).
    pub async fn create_session(
        &self,
        id: &str,
        kind: SessionKind,
        subject: &str,
        fingerprint: &str,
        ttl: chrono::Duration,
    ) -> Result<SessionRecord, StoreError> {
        let now = now_micros();
        let expires = now.saturating_add(ttl.num_microseconds().unwrap_or(i64::MAX));
        let row: SessionRow = sqlx::query_as(concat!(
            "INSERT INTO sessions (id, kind, subject, fingerprint, created_at, expires_at, \
             last_seen_at) VALUES ($1, $2, $3, $4, $5, $6, $5) RETURNING ",
            session_columns!()
        ))
        .bind(id)
        .bind(kind.as_str())
        .bind(subject)
        .bind(fingerprint)
        .bind(now)
        .bind(expires)
        .fetch_one(&self.pool)
        .await?;
        row.into_record()
    }

    /// The session `id` of `kind` if it may be used now: not revoked, not expired, and made under
    /// the credential whose current fingerprint is `fingerprint`. Marks it seen.
    pub async fn valid_session(
        &self,
        id: &str,
        kind: SessionKind,
        fingerprint: &str,
    ) -> Result<Option<SessionRecord>, StoreError> {
        self.valid_session_at(id, kind, fingerprint, chrono::Utc::now())
            .await
    }

    /// [`Store::valid_session`] as of `now` (tests pass their own clock).
    pub async fn valid_session_at(
        &self,
        id: &str,
        kind: SessionKind,
        fingerprint: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<SessionRecord>, StoreError> {
        let now = now.timestamp_micros();
        // The lookup is by the SHA-256 of the token, so how long the index search takes says
        // nothing useful about the token a client sent.
        let row: Option<SessionRow> = sqlx::query_as(concat!(
            "SELECT ",
            session_columns!(),
            " FROM sessions WHERE id = $1 AND kind = $2 AND fingerprint = $3 \
              AND revoked_at IS NULL AND expires_at > $4"
        ))
        .bind(id)
        .bind(kind.as_str())
        .bind(fingerprint)
        .bind(now)
        .fetch_optional(&self.pool)
        .await?;
        let Some(mut row) = row else {
            return Ok(None);
        };
        if now.saturating_sub(row.last_seen_at) >= LAST_SEEN_RESOLUTION_MICROS {
            // Informational only: a database that cannot take the write right now (full disk,
            // locked) must not turn a valid session into a refusal.
            match sqlx::query("UPDATE sessions SET last_seen_at = $1 WHERE id = $2")
                .bind(now)
                .bind(id)
                .execute(&self.pool)
                .await
            {
                Ok(_) => row.last_seen_at = now,
                Err(e) => tracing::warn!("cannot record a session's last use: {e}"),
            }
        }
        row.into_record().map(Some)
    }

    /// The session `id` in whatever state it is (revoked, expired), or `None`.
    pub async fn get_session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let row: Option<SessionRow> = sqlx::query_as(concat!(
            "SELECT ",
            session_columns!(),
            " FROM sessions WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(SessionRow::into_record).transpose()
    }

    /// Revokes one session (sign-out). `false` when there is no such session or it was already
    /// revoked.
    pub async fn revoke_session(&self, id: &str) -> Result<bool, StoreError> {
        let result =
            sqlx::query("UPDATE sessions SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL")
                .bind(now_micros())
                .bind(id)
                .execute(&self.pool)
                .await?;
        Ok(result.rows_affected() > 0)
    }

    /// Revokes every live session of `subject` (password change, "sign out everywhere",
    /// disabling a user); returns how many were revoked.
    pub async fn revoke_sessions_of(
        &self,
        kind: SessionKind,
        subject: &str,
    ) -> Result<u64, StoreError> {
        let result = sqlx::query(
            "UPDATE sessions SET revoked_at = $1 \
             WHERE kind = $2 AND subject = $3 AND revoked_at IS NULL",
        )
        .bind(now_micros())
        .bind(kind.as_str())
        .bind(subject)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected())
    }

    /// Revokes all but the newest `keep` live sessions of `subject` (a bound on the sessions one
    /// account holds); returns how many were revoked.
    pub async fn trim_sessions_of(
        &self,
        kind: SessionKind,
        subject: &str,
        keep: usize,
    ) -> Result<u64, StoreError> {
        let now = now_micros();
        let result = sqlx::query(
            "UPDATE sessions SET revoked_at = $1 \
             WHERE kind = $2 AND subject = $3 AND revoked_at IS NULL AND expires_at > $1 \
             AND id NOT IN (SELECT id FROM sessions WHERE kind = $2 AND subject = $3 \
                 AND revoked_at IS NULL AND expires_at > $1 \
                 ORDER BY created_at DESC, id DESC LIMIT $4)",
        )
        .bind(now)
        .bind(kind.as_str())
        .bind(subject)
        .bind(i64::try_from(keep).unwrap_or(i64::MAX))
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected())
    }

    /// Deletes every expired session (revoked ones go too once they expire); returns how many.
    pub async fn purge_expired_sessions(&self) -> Result<u64, StoreError> {
        self.purge_expired_sessions_at(chrono::Utc::now()).await
    }

    /// [`Store::purge_expired_sessions`] as of `now` (tests pass their own clock).
    pub async fn purge_expired_sessions_at(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let result = sqlx::query("DELETE FROM sessions WHERE expires_at <= $1")
            .bind(now.timestamp_micros())
            .execute(&self.pool)
            .await?;
        Ok(result.rows_affected())
    }
}

#[derive(sqlx::FromRow)]
struct SessionRow {
    id: String,
    kind: String,
    subject: String,
    fingerprint: String,
    created_at: i64,
    expires_at: i64,
    last_seen_at: i64,
    revoked_at: Option<i64>,
}

impl SessionRow {
    fn into_record(self) -> Result<SessionRecord, StoreError> {
        const T: &str = "sessions";
        let time =
            |micros| -> Result<DateTime<Utc>, StoreError> { parse_time(T, &self.id, micros) };
        Ok(SessionRecord {
            kind: self
                .kind
                .parse()
                .map_err(|e: String| corrupt(T, &self.id, e))?,
            created_at: time(self.created_at)?,
            expires_at: time(self.expires_at)?,
            last_seen_at: time(self.last_seen_at)?,
            revoked_at: self.revoked_at.map(time).transpose()?,
            subject: self.subject,
            fingerprint: self.fingerprint,
            id: self.id,
        })
    }
}
