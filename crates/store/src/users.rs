//! Accounts (`users`, `api_keys`, `invites`, `api_usage`; migration 0003).
//!
//! Like `sessions.rs`, the store deals only in hashes: argon2id PHC strings for passwords and
//! SHA-256 ids for API keys and invite codes, computed by `smolchat_auth`. It never sees a password,
//! a key or a code.

use std::collections::HashMap;
use std::str::FromStr;

use chrono::{DateTime, Utc};

use super::{corrupt, now_micros, parse_time, Backend, SessionRecord, Store, StoreError, WriteTx};

/// `last_seen_at` / `last_used_at` are only rewritten when older than this, so a busy client
/// does not turn every request into a committed (fsynced) write.
const SEEN_RESOLUTION_MICROS: i64 = 60 * 1_000_000;

/// What an account may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UserRole {
    User,
    /// Sees `/admin` after signing in.
    Admin,
}

impl UserRole {
    pub fn as_str(self) -> &'static str {
        match self {
            UserRole::User => "user",
            UserRole::Admin => "admin",
        }
    }
}

impl FromStr for UserRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "user" => Ok(UserRole::User),
            "admin" => Ok(UserRole::Admin),
            other => Err(format!("unknown role {other:?}")),
        }
    }
}

/// One row of `users`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    /// A UUID; also the owner id of the account's conversations.
    pub id: String,
    pub name: String,
    /// argon2id PHC string.
    pub password_hash: String,
    pub role: UserRole,
    pub disabled_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub last_seen_at: Option<DateTime<Utc>>,
    /// An administrator reset the password: the next sign-in must choose a new one first.
    pub must_change_password: bool,
}

impl User {
    pub fn is_admin(&self) -> bool {
        self.role == UserRole::Admin
    }
    pub fn is_disabled(&self) -> bool {
        self.disabled_at.is_some()
    }
}

/// A user with what the admin page shows about them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserOverview {
    pub user: User,
    pub conversations: i64,
    /// Prompt + completion tokens of the replies in their conversations, plus their `/v1` usage.
    pub tokens: i64,
    /// Sessions neither revoked nor expired.
    pub active_sessions: i64,
}

/// One row of `api_keys` (the key itself is never stored).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKeyRecord {
    /// SHA-256 (hex) of the key.
    pub id: String,
    pub user_id: String,
    pub name: String,
    pub prefix: String,
    pub created_at: DateTime<Utc>,
    pub last_used_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// `/v1` usage of one owner.
/// An invite link not yet used (its code is never stored, only the code's SHA-256 `id`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InviteRecord {
    pub id: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApiUsage {
    pub requests: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

/// A new account to store; see [`Store::create_user`].
#[derive(Clone, Debug)]
pub struct NewUser<'a> {
    pub id: &'a str,
    pub name: &'a str,
    pub password_hash: &'a str,
    pub role: UserRole,
    /// The SHA-256 of the invite code to consume, when sign-up needs one.
    pub invite: Option<&'a str>,
    /// A guest owner id whose conversations move into the new account.
    pub adopt_from: Option<&'a str>,
}

/// What [`Store::delete_user`] removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeletedUser {
    pub conversations: i64,
    pub api_keys: i64,
    pub sessions: i64,
}

/// What [`Store::create_user`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CreatedUser {
    Created {
        user: User,
        /// Conversations moved from `adopt_from`.
        adopted: u64,
    },
    /// Another account has this name (case-insensitively); nothing changed.
    NameTaken,
    /// The invite is unknown, used or expired; nothing changed.
    InviteInvalid,
}

macro_rules! user_columns {
    () => {
        "id, name, password_hash, role, disabled_at, created_at, last_seen_at, password_reset_at"
    };
}
macro_rules! user_columns_u {
    () => {
        "u.id, u.name, u.password_hash, u.role, u.disabled_at, u.created_at, u.last_seen_at, u.password_reset_at"
    };
}
macro_rules! key_columns {
    () => {
        "id, user_id, name, prefix, created_at, last_used_at, revoked_at"
    };
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

/// A token count column, NULL as 0 and capped at [`super::MAX_TOKEN_COUNT`] (portable SQL: no
/// `MIN`/`LEAST` difference between the backends).
macro_rules! capped {
    ($column:literal) => {
        concat!(
            "(CASE WHEN COALESCE(",
            $column,
            ", 0) > 2147483647 THEN 2147483647 ELSE COALESCE(",
            $column,
            ", 0) END)"
        )
    };
}

impl Store {
    /// The model an account's new conversations start on, if it chose one.
    pub async fn default_model(&self, user: &str) -> Result<Option<String>, StoreError> {
        let row: Option<(Option<String>,)> =
            sqlx::query_as("SELECT default_model FROM user_preferences WHERE user_id = $1")
                .bind(user)
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.and_then(|(m,)| m))
    }

    /// Sets (or, with `None`, clears) the model an account's new conversations start on.
    pub async fn set_default_model(
        &self,
        user: &str,
        model: Option<&str>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO user_preferences (user_id, default_model) VALUES ($1, $2) \
             ON CONFLICT (user_id) DO UPDATE SET default_model = excluded.default_model",
        )
        .bind(user)
        .bind(model)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Creates an account in one transaction: consumes the invite (when given), inserts the user
    /// and moves `adopt_from`'s conversations to it. Refusals change nothing.
    pub async fn create_user(&self, new: &NewUser<'_>) -> Result<CreatedUser, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if let Some(invite) = new.invite {
            let used = sqlx::query(
                "UPDATE invites SET used_at = $1 \
                 WHERE id = $2 AND used_at IS NULL AND expires_at > $1",
            )
            .bind(now)
            .bind(invite)
            .execute(&mut *tx)
            .await?;
            if used.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(CreatedUser::InviteInvalid);
            }
        }
        let inserted: Result<UserRow, sqlx::Error> = sqlx::query_as(concat!(
            "INSERT INTO users (id, name, password_hash, role, created_at) \
             VALUES ($1, $2, $3, $4, $5) RETURNING ",
            user_columns!()
        ))
        .bind(new.id)
        .bind(new.name)
        .bind(new.password_hash)
        .bind(new.role.as_str())
        .bind(now)
        .fetch_one(&mut *tx)
        .await;
        let row = match inserted {
            Ok(row) => row,
            Err(e) if is_unique_violation(&e) => {
                tx.rollback().await?;
                return Ok(CreatedUser::NameTaken);
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(invite) = new.invite {
            sqlx::query("UPDATE invites SET used_by = $1 WHERE id = $2")
                .bind(new.id)
                .bind(invite)
                .execute(&mut *tx)
                .await?;
        }
        let adopted = match new.adopt_from {
            Some(from) => reown(&mut tx, from, new.id).await?,
            None => 0,
        };
        tx.commit().await?;
        Ok(CreatedUser::Created {
            user: row.into_user()?,
            adopted,
        })
    }

    /// Moves every conversation of owner `from` to owner `to` in one transaction; returns how
    /// many moved.
    pub async fn reown_conversations(&self, from: &str, to: &str) -> Result<u64, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        let n = reown(&mut tx, from, to).await?;
        tx.commit().await?;
        Ok(n)
    }

    pub async fn count_users(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar("SELECT COUNT(*) FROM users")
            .fetch_one(&self.pool)
            .await?)
    }

    /// The account called `name` (ASCII case ignored).
    pub async fn user_by_name(&self, name: &str) -> Result<Option<User>, StoreError> {
        let row: Option<UserRow> = sqlx::query_as(concat!(
            "SELECT ",
            user_columns!(),
            " FROM users WHERE lower(name) = lower($1)"
        ))
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        row.map(UserRow::into_user).transpose()
    }

    /// Deletes account `id` and everything it owns, in one transaction: its conversations
    /// (their messages, shares, files and tags with them), folders, presets, API keys, sessions
    /// and usage counts. `None` when there is no such account; else what went.
    pub async fn delete_user(&self, id: &str) -> Result<Option<DeletedUser>, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        let found: Option<(String,)> = sqlx::query_as("SELECT id FROM users WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        if found.is_none() {
            tx.rollback().await?;
            return Ok(None);
        }
        let count = |table: &'static str, column: &'static str| {
            format!("SELECT CAST(COUNT(*) AS BIGINT) FROM {table} WHERE {column} = $1")
        };
        let mut counts = [0i64; 3];
        for (n, (table, column)) in [
            ("conversations", "owner"),
            ("api_keys", "user_id"),
            ("sessions", "subject"),
        ]
        .into_iter()
        .enumerate()
        {
            // The table and column names are the constants above.
            let (c,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(count(table, column)))
                .bind(id)
                .fetch_one(&mut *tx)
                .await?;
            counts[n] = c;
        }
        for statement in [
            "DELETE FROM conversations WHERE owner = $1",
            "DELETE FROM folders WHERE owner = $1",
            "DELETE FROM presets WHERE owner = $1",
            "DELETE FROM sessions WHERE kind = 'user' AND subject = $1",
            "DELETE FROM api_usage WHERE owner = $1",
            "DELETE FROM user_identities WHERE user_id = $1",
            "DELETE FROM user_preferences WHERE user_id = $1",
            // Everything counted under the user, their keys and their conversation creations.
            "DELETE FROM usage_counters WHERE subject = 'user:' || $1",
            "DELETE FROM usage_counters WHERE subject = 'conv:owner:' || $1",
            "DELETE FROM usage_counters WHERE subject IN \
               (SELECT 'key:' || id FROM api_keys WHERE user_id = $1)",
            "DELETE FROM api_keys WHERE user_id = $1",
            "DELETE FROM users WHERE id = $1",
        ] {
            sqlx::query(statement).bind(id).execute(&mut *tx).await?;
        }
        sqlx::query(
            "INSERT INTO deleted_users (id, deleted_at) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
        )
        .bind(id)
        .bind(now_micros())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(DeletedUser {
            conversations: counts[0],
            api_keys: counts[1],
            sessions: counts[2],
        }))
    }

    /// Sets account `id`'s role; false when there is no such account.
    pub async fn set_user_role(&self, id: &str, role: UserRole) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE users SET role = $1 WHERE id = $2")
            .bind(role.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    pub async fn user_by_id(&self, id: &str) -> Result<Option<User>, StoreError> {
        let row: Option<UserRow> = sqlx::query_as(concat!(
            "SELECT ",
            user_columns!(),
            " FROM users WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(UserRow::into_user).transpose()
    }

    /// Accounts by name, `limit` from `offset`, with their counts for the admin page. Each
    /// token count enters the sums capped at [`super::MAX_TOKEN_COUNT`], so no stored value
    /// (rows imported before imports were bounded included) can overflow a sum into an error.
    pub async fn list_users(
        &self,
        limit: i64,
        offset: i64,
    ) -> Result<Vec<UserOverview>, StoreError> {
        let rows: Vec<OverviewRow> = sqlx::query_as(concat!(
            "SELECT ",
            user_columns_u!(),
            ", (SELECT COUNT(*) FROM conversations c WHERE c.owner = u.id) AS conversations, \
             CAST((SELECT COALESCE(SUM(",
            capped!("m.prompt_tokens"),
            " + ",
            capped!("m.completion_tokens"),
            "), 0) \
                FROM messages m JOIN conversations c ON c.id = m.conversation_id \
               WHERE c.owner = u.id) AS BIGINT) \
             + COALESCE((SELECT ",
            capped!("a.prompt_tokens"),
            " + ",
            capped!("a.completion_tokens"),
            " FROM api_usage a WHERE a.owner = u.id), 0) AS tokens, \
             (SELECT COUNT(*) FROM sessions s WHERE s.kind = 'user' AND s.subject = u.id \
                 AND s.revoked_at IS NULL AND s.expires_at > $3) AS active_sessions \
             FROM users u ORDER BY lower(u.name), u.id LIMIT $1 OFFSET $2"
        ))
        .bind(limit)
        .bind(offset)
        .bind(now_micros())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                Ok(UserOverview {
                    user: r.user.into_user()?,
                    conversations: r.conversations,
                    tokens: r.tokens,
                    active_sessions: r.active_sessions,
                })
            })
            .collect()
    }

    /// Names of the accounts among `ids` (owner ids of conversations); guests are absent.
    pub async fn user_names(&self, ids: &[String]) -> Result<HashMap<String, String>, StoreError> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let list = serde_json::to_string(ids).map_err(|source| StoreError::Encode {
            what: "ids",
            source,
        })?;
        let rows: Vec<(String, String)> = sqlx::query_as(match self.backend {
            Backend::Sqlite => {
                "SELECT id, name FROM users WHERE id IN (SELECT value FROM json_each($1))"
            }
            Backend::Postgres => {
                "SELECT id, name FROM users WHERE id IN \
                 (SELECT json_array_elements_text(CAST($1 AS json)))"
            }
        })
        .bind(list)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().collect())
    }

    /// Replaces the password hash and revokes every session of the account in the same
    /// transaction. `false` when there is no such user.
    pub async fn set_password(&self, id: &str, password_hash: &str) -> Result<bool, StoreError> {
        self.replace_password(id, password_hash, false).await
    }

    /// [`Store::set_password`], and when `must_change` the account's next sign-in must choose a
    /// new password before anything else (an administrator's reset); otherwise that demand ends.
    pub async fn replace_password(
        &self,
        id: &str,
        password_hash: &str,
        must_change: bool,
    ) -> Result<bool, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        let changed = sqlx::query(
            "UPDATE users SET password_hash = $1, password_reset_at = $3 WHERE id = $2",
        )
        .bind(password_hash)
        .bind(id)
        .bind(must_change.then_some(now))
        .execute(&mut *tx)
        .await?
        .rows_affected()
            > 0;
        revoke_user_sessions(&mut tx, id, now).await?;
        tx.commit().await?;
        Ok(changed)
    }

    /// Disables (revoking every session too) or enables an account. `false` when there is no
    /// such user.
    pub async fn set_disabled(&self, id: &str, disabled: bool) -> Result<bool, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        let changed = sqlx::query(
            "UPDATE users SET disabled_at = CASE WHEN $1 THEN COALESCE(disabled_at, $2) END \
             WHERE id = $3",
        )
        .bind(disabled)
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            > 0;
        if disabled {
            revoke_user_sessions(&mut tx, id, now).await?;
        }
        tx.commit().await?;
        Ok(changed)
    }

    /// Records that the account was used now (coarsely; best-effort for the caller).
    pub async fn touch_user(&self, id: &str) -> Result<(), StoreError> {
        let now = now_micros();
        sqlx::query(
            "UPDATE users SET last_seen_at = $1 \
             WHERE id = $2 AND (last_seen_at IS NULL OR last_seen_at <= $1 - $3)",
        )
        .bind(now)
        .bind(id)
        .bind(SEEN_RESOLUTION_MICROS)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The live user session `id` (not revoked, not expired) with its account, when the account
    /// is not disabled. The caller compares the session's fingerprint with the account's
    /// current password fingerprint.
    pub async fn user_session(
        &self,
        id: &str,
    ) -> Result<Option<(SessionRecord, User)>, StoreError> {
        let now = now_micros();
        let Some(session) = self.valid_session_any(id, now).await? else {
            return Ok(None);
        };
        let Some(user) = self.user_by_id(&session.subject).await? else {
            return Ok(None);
        };
        if user.is_disabled() {
            return Ok(None);
        }
        Ok(Some((session, user)))
    }

    /// A user session that is neither revoked nor expired, whatever its fingerprint.
    async fn valid_session_any(
        &self,
        id: &str,
        now: i64,
    ) -> Result<Option<SessionRecord>, StoreError> {
        let session = self.get_session(id).await?;
        Ok(session.filter(|s| {
            s.kind == super::SessionKind::User
                && s.revoked_at.is_none()
                && s.expires_at.timestamp_micros() > now
        }))
    }

    pub async fn create_api_key(
        &self,
        id: &str,
        user_id: &str,
        name: &str,
        prefix: &str,
    ) -> Result<ApiKeyRecord, StoreError> {
        let row: KeyRow = sqlx::query_as(concat!(
            "INSERT INTO api_keys (id, user_id, name, prefix, created_at) \
             VALUES ($1, $2, $3, $4, $5) RETURNING ",
            key_columns!()
        ))
        .bind(id)
        .bind(user_id)
        .bind(name)
        .bind(prefix)
        .bind(now_micros())
        .fetch_one(&self.pool)
        .await?;
        row.into_key()
    }

    /// The account of the API key `id` when the key is not revoked and the account not
    /// disabled; marks the key used (coarsely, and without a write when it was used recently).
    pub async fn api_key_user(&self, id: &str) -> Result<Option<User>, StoreError> {
        let now = now_micros();
        let row: Option<KeyUserRow> = sqlx::query_as(concat!(
            "SELECT ",
            user_columns_u!(),
            ", k.last_used_at AS key_last_used_at \
             FROM api_keys k JOIN users u ON u.id = k.user_id \
             WHERE k.id = $1 AND k.revoked_at IS NULL AND u.disabled_at IS NULL"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let recent = row
            .key_last_used_at
            .is_some_and(|t| now.saturating_sub(t) < SEEN_RESOLUTION_MICROS);
        if !recent {
            // Informational: a database that cannot take the write must not refuse a valid key.
            if let Err(e) = sqlx::query("UPDATE api_keys SET last_used_at = $1 WHERE id = $2")
                .bind(now)
                .bind(id)
                .execute(&self.pool)
                .await
            {
                tracing::warn!("cannot record an API key's last use: {e}");
            }
        }
        row.user.into_user().map(Some)
    }

    /// How many keys of the account are not revoked.
    pub async fn count_live_api_keys(&self, user_id: &str) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM api_keys WHERE user_id = $1 AND revoked_at IS NULL",
        )
        .bind(user_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// The account's keys, newest first (revoked ones included).
    pub async fn list_api_keys(&self, user_id: &str) -> Result<Vec<ApiKeyRecord>, StoreError> {
        let rows: Vec<KeyRow> = sqlx::query_as(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE user_id = $1 ORDER BY created_at DESC"
        ))
        .bind(user_id)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(KeyRow::into_key).collect()
    }

    /// Revokes every live key of `user_id`; how many.
    pub async fn revoke_all_api_keys(&self, user_id: &str) -> Result<u64, StoreError> {
        let r = sqlx::query(
            "UPDATE api_keys SET revoked_at = $1 WHERE user_id = $2 AND revoked_at IS NULL",
        )
        .bind(now_micros())
        .bind(user_id)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    /// Revokes `user_id`'s key `id`; `false` when it is not theirs or already revoked.
    pub async fn revoke_api_key(&self, user_id: &str, id: &str) -> Result<bool, StoreError> {
        let r = sqlx::query(
            "UPDATE api_keys SET revoked_at = $1 \
             WHERE id = $2 AND user_id = $3 AND revoked_at IS NULL",
        )
        .bind(now_micros())
        .bind(id)
        .bind(user_id)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    /// The account linked to an OpenID Connect provider's `(issuer, subject)`, if any.
    pub async fn user_by_identity(
        &self,
        issuer: &str,
        subject: &str,
    ) -> Result<Option<User>, StoreError> {
        let row: Option<UserRow> = sqlx::query_as(concat!(
            "SELECT ",
            user_columns_u!(),
            " FROM user_identities i JOIN users u ON u.id = i.user_id \
             WHERE i.issuer = $1 AND i.subject = $2"
        ))
        .bind(issuer)
        .bind(subject)
        .fetch_optional(&self.pool)
        .await?;
        row.map(UserRow::into_user).transpose()
    }

    /// Whether any identity (of a provider, or the trusted proxy's header) is linked to account
    /// `user_id`.
    pub async fn has_identities(&self, user_id: &str) -> Result<bool, StoreError> {
        let found: Option<(String,)> =
            sqlx::query_as("SELECT issuer FROM user_identities WHERE user_id = $1 LIMIT 1")
                .bind(user_id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(found.is_some())
    }

    /// Links account `user_id` to the provider's `(issuer, subject)`; `false` when that pair is
    /// already linked (to this account or another).
    pub async fn link_identity(
        &self,
        user_id: &str,
        issuer: &str,
        subject: &str,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "INSERT INTO user_identities (issuer, subject, user_id, created_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (issuer, subject) DO NOTHING",
        )
        .bind(issuer)
        .bind(subject)
        .bind(user_id)
        .bind(now_micros())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Invites neither used nor expired, newest first.
    pub async fn live_invites(&self) -> Result<Vec<InviteRecord>, StoreError> {
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT id, created_at, expires_at FROM invites \
             WHERE used_at IS NULL AND expires_at > $1 ORDER BY created_at DESC LIMIT 200",
        )
        .bind(now_micros())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(id, created, expires)| {
                Ok(InviteRecord {
                    created_at: parse_time("invites", &id, created)?,
                    expires_at: parse_time("invites", &id, expires)?,
                    id,
                })
            })
            .collect()
    }

    /// Ends invite `id` before it is used (it expires now); `false` when it was already used,
    /// expired or unknown.
    pub async fn revoke_invite(&self, id: &str) -> Result<bool, StoreError> {
        let now = now_micros();
        let done = sqlx::query(
            "UPDATE invites SET expires_at = $1 WHERE id = $2 AND used_at IS NULL AND expires_at > $1",
        )
        .bind(now)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Stores an invite (`id` = SHA-256 of the code) valid for `ttl`.
    pub async fn create_invite(&self, id: &str, ttl: chrono::Duration) -> Result<(), StoreError> {
        let now = now_micros();
        sqlx::query("INSERT INTO invites (id, created_at, expires_at) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(now)
            .bind(now.saturating_add(ttl.num_microseconds().unwrap_or(i64::MAX)))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Adds one finished `/v1` request to `owner`'s usage.
    pub async fn add_api_usage(
        &self,
        owner: &str,
        prompt_tokens: i64,
        completion_tokens: i64,
    ) -> Result<(), StoreError> {
        // An account's row goes with the account: a request that finishes after the delete
        // writes nothing (the account's tombstone says so).
        let written = sqlx::query(
            "INSERT INTO api_usage (owner, requests, prompt_tokens, completion_tokens, last_at) \
             SELECT $1, 1, $2, $3, $4 \
             WHERE NOT EXISTS (SELECT 1 FROM deleted_users WHERE id = $1) \
             ON CONFLICT (owner) DO UPDATE SET requests = api_usage.requests + 1, \
               prompt_tokens = api_usage.prompt_tokens + excluded.prompt_tokens, \
               completion_tokens = api_usage.completion_tokens + excluded.completion_tokens, \
               last_at = excluded.last_at",
        )
        .bind(owner)
        .bind(prompt_tokens)
        .bind(completion_tokens)
        .bind(now_micros())
        .execute(&self.pool)
        .await?;
        if written.rows_affected() == 0 {
            return Err(StoreError::OwnerGone(format!("account {owner}")));
        }
        Ok(())
    }

    pub async fn api_usage(&self, owner: &str) -> Result<ApiUsage, StoreError> {
        let row: Option<(i64, i64, i64)> = sqlx::query_as(
            "SELECT requests, prompt_tokens, completion_tokens FROM api_usage WHERE owner = $1",
        )
        .bind(owner)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map_or(ApiUsage::default(), |(r, p, c)| ApiUsage {
            requests: r,
            prompt_tokens: p,
            completion_tokens: c,
        }))
    }
}

async fn reown(tx: &mut WriteTx, from: &str, to: &str) -> Result<u64, StoreError> {
    super::organise::reown_organisation(tx, from, to).await?;
    let r = sqlx::query("UPDATE conversations SET owner = $1 WHERE owner = $2")
        .bind(to)
        .bind(from)
        .execute(&mut **tx)
        .await?;
    Ok(r.rows_affected())
}

async fn revoke_user_sessions(tx: &mut WriteTx, id: &str, now: i64) -> Result<u64, StoreError> {
    let r = sqlx::query(
        "UPDATE sessions SET revoked_at = $1 \
         WHERE kind = 'user' AND subject = $2 AND revoked_at IS NULL",
    )
    .bind(now)
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(r.rows_affected())
}

#[derive(sqlx::FromRow)]
struct UserRow {
    id: String,
    name: String,
    password_hash: String,
    role: String,
    disabled_at: Option<i64>,
    created_at: i64,
    last_seen_at: Option<i64>,
    password_reset_at: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct KeyUserRow {
    #[sqlx(flatten)]
    user: UserRow,
    key_last_used_at: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct OverviewRow {
    #[sqlx(flatten)]
    user: UserRow,
    conversations: i64,
    tokens: i64,
    active_sessions: i64,
}

impl UserRow {
    fn into_user(self) -> Result<User, StoreError> {
        const T: &str = "users";
        let time = |micros| parse_time(T, &self.id, micros);
        Ok(User {
            role: self
                .role
                .parse()
                .map_err(|e: String| corrupt(T, &self.id, e))?,
            disabled_at: self.disabled_at.map(time).transpose()?,
            created_at: time(self.created_at)?,
            last_seen_at: self.last_seen_at.map(time).transpose()?,
            must_change_password: self.password_reset_at.is_some(),
            name: self.name,
            password_hash: self.password_hash,
            id: self.id,
        })
    }
}

#[derive(sqlx::FromRow)]
struct KeyRow {
    id: String,
    user_id: String,
    name: String,
    prefix: String,
    created_at: i64,
    last_used_at: Option<i64>,
    revoked_at: Option<i64>,
}

impl KeyRow {
    fn into_key(self) -> Result<ApiKeyRecord, StoreError> {
        const T: &str = "api_keys";
        let time = |micros| parse_time(T, &self.id, micros);
        Ok(ApiKeyRecord {
            created_at: time(self.created_at)?,
            last_used_at: self.last_used_at.map(time).transpose()?,
            revoked_at: self.revoked_at.map(time).transpose()?,
            user_id: self.user_id,
            name: self.name,
            prefix: self.prefix,
            id: self.id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConversationSettings, SessionKind};

    const HASH: &str = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdA$aGFzaA";

    fn hex64(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    async fn store() -> Store {
        Store::open("sqlite::memory:").await.unwrap()
    }

    fn new_user<'a>(id: &'a str, name: &'a str) -> NewUser<'a> {
        NewUser {
            id,
            name,
            password_hash: HASH,
            role: UserRole::User,
            invite: None,
            adopt_from: None,
        }
    }

    async fn create(s: &Store, n: &NewUser<'_>) -> User {
        match s.create_user(n).await.unwrap() {
            CreatedUser::Created { user, .. } => user,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn names_are_unique_without_regard_to_case() {
        let s = store().await;
        let alice = create(&s, &new_user("u1", "Alice")).await;
        assert_eq!(alice.role, UserRole::User);
        assert_eq!(
            s.create_user(&new_user("u2", "alice")).await.unwrap(),
            CreatedUser::NameTaken
        );
        assert_eq!(s.user_by_name("ALICE").await.unwrap().unwrap().id, "u1");
        assert_eq!(s.count_users().await.unwrap(), 1);
        assert!(s.user_by_id("u2").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn invites_are_single_use_and_expire() {
        let s = store().await;
        s.create_invite(&hex64('a'), chrono::Duration::hours(1))
            .await
            .unwrap();
        s.create_invite(&hex64('b'), chrono::Duration::zero())
            .await
            .unwrap();
        let a = hex64('a');
        let b = hex64('b');
        let with = |id, name, inv| NewUser {
            invite: Some(inv),
            ..new_user(id, name)
        };
        assert_eq!(
            s.create_user(&with("u0", "x", &b)).await.unwrap(),
            CreatedUser::InviteInvalid,
            "expired"
        );
        create(&s, &with("u1", "one", &a)).await;
        assert_eq!(
            s.create_user(&with("u2", "two", &a)).await.unwrap(),
            CreatedUser::InviteInvalid,
            "used"
        );
        // A name clash gives the invite back (the transaction rolled back).
        s.create_invite(&hex64('c'), chrono::Duration::hours(1))
            .await
            .unwrap();
        let c = hex64('c');
        assert_eq!(
            s.create_user(&with("u3", "ONE", &c)).await.unwrap(),
            CreatedUser::NameTaken
        );
        create(&s, &with("u4", "four", &c)).await;
    }

    #[tokio::test]
    async fn sign_up_adopts_the_guests_conversations() {
        let s = store().await;
        let settings = ConversationSettings::default();
        s.create_conversation("guest-1", &settings).await.unwrap();
        s.create_conversation("guest-1", &settings).await.unwrap();
        let filed = s.create_conversation("guest-2", &settings).await.unwrap();
        let guest_folder = s.create_folder("guest-2", "Work").await.unwrap();
        s.organise(
            "guest-2",
            filed.id,
            &crate::OrganisationPatch {
                folder: Some(Some(guest_folder.id)),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        s.create_preset(Some("guest-2"), "Terse", "Be brief.")
            .await
            .unwrap();
        let n = NewUser {
            adopt_from: Some("guest-1"),
            ..new_user("u1", "a")
        };
        match s.create_user(&n).await.unwrap() {
            CreatedUser::Created { adopted, .. } => assert_eq!(adopted, 2),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.list_conversations("u1", None).await.unwrap().len(), 2);
        assert!(s
            .list_conversations("guest-1", None)
            .await
            .unwrap()
            .is_empty());
        // u1 already has a folder and a preset of those names: the guest's folder merges into
        // theirs, the guest's preset keeps its prompt under a new name.
        let theirs = s.create_folder("u1", "Work").await.unwrap();
        s.create_preset(Some("u1"), "Terse", "One line.")
            .await
            .unwrap();
        assert_eq!(s.reown_conversations("guest-2", "u1").await.unwrap(), 1);
        assert_eq!(s.list_conversations("u1", None).await.unwrap().len(), 3);
        assert_eq!(
            s.organisation(filed.id).await.unwrap().unwrap().folder_id,
            Some(theirs.id)
        );
        assert_eq!(s.folders("u1").await.unwrap().len(), 1);
        assert!(s.folders("guest-2").await.unwrap().is_empty());
        let presets: Vec<String> = s
            .presets("u1")
            .await
            .unwrap()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(presets, vec!["Terse".to_string(), "Terse (2)".to_string()]);
        let names = s
            .user_names(&["u1".into(), "guest-2".into()])
            .await
            .unwrap();
        assert_eq!(names.len(), 1);
        assert_eq!(names["u1"], "a");
    }

    #[tokio::test]
    async fn password_change_and_disabling_revoke_sessions() {
        let s = store().await;
        create(&s, &new_user("u1", "a")).await;
        let ttl = chrono::Duration::hours(1);
        s.create_session(&hex64('1'), SessionKind::User, "u1", "fp", ttl)
            .await
            .unwrap();
        assert!(s.user_session(&hex64('1')).await.unwrap().is_some());
        assert!(s.set_password("u1", HASH).await.unwrap());
        assert!(s.user_session(&hex64('1')).await.unwrap().is_none());

        s.create_session(&hex64('2'), SessionKind::User, "u1", "fp", ttl)
            .await
            .unwrap();
        s.create_api_key(&hex64('k'), "u1", "laptop", "sk-smol-abcd")
            .await
            .unwrap();
        assert!(s.api_key_user(&hex64('k')).await.unwrap().is_some());
        assert!(s.set_disabled("u1", true).await.unwrap());
        assert!(s.user_session(&hex64('2')).await.unwrap().is_none());
        assert!(s.api_key_user(&hex64('k')).await.unwrap().is_none());
        assert!(s.user_by_id("u1").await.unwrap().unwrap().is_disabled());
        assert!(s.set_disabled("u1", false).await.unwrap());
        assert!(s.api_key_user(&hex64('k')).await.unwrap().is_some());
        // Sessions revoked by disabling stay revoked.
        assert!(s.user_session(&hex64('2')).await.unwrap().is_none());
        assert!(!s.set_disabled("nobody", true).await.unwrap());
    }

    #[tokio::test]
    async fn keys_revoke_only_for_their_owner_and_usage_adds_up() {
        let s = store().await;
        create(&s, &new_user("u1", "a")).await;
        create(&s, &new_user("u2", "b")).await;
        s.create_api_key(&hex64('k'), "u1", "k", "sk-smol-abcd")
            .await
            .unwrap();
        assert!(!s.revoke_api_key("u2", &hex64('k')).await.unwrap());
        assert_eq!(s.list_api_keys("u1").await.unwrap().len(), 1);
        assert!(s.list_api_keys("u2").await.unwrap().is_empty());
        assert!(s.revoke_api_key("u1", &hex64('k')).await.unwrap());
        assert!(s.api_key_user(&hex64('k')).await.unwrap().is_none());
        assert!(s.list_api_keys("u1").await.unwrap()[0].revoked_at.is_some());

        s.add_api_usage("u1", 10, 5).await.unwrap();
        s.add_api_usage("u1", 1, 2).await.unwrap();
        assert_eq!(
            s.api_usage("u1").await.unwrap(),
            ApiUsage {
                requests: 2,
                prompt_tokens: 11,
                completion_tokens: 7
            }
        );
        let conv = s
            .create_conversation("u1", &ConversationSettings::default())
            .await
            .unwrap();
        s.insert_user_message(conv.id, "hi").await.unwrap();
        let list = s.list_users(50, 0).await.unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].user.name, "a");
        assert_eq!(list[0].conversations, 1);
        assert_eq!(list[0].tokens, 18);
        assert_eq!(s.list_users(1, 1).await.unwrap()[0].user.name, "b");
    }
}
