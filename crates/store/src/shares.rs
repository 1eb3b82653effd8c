//! Read-only share links (`shares`, migration 0007): a snapshot of a conversation's branch,
//! found by the SHA-256 of its link's token (computed by the caller; the store never sees a
//! token).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{now_micros, parse_time, parse_uuid, Store, StoreError};

/// One share link as its owner sees it (no token: it is shown once, when made).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ShareRecord {
    pub id: Uuid,
    pub conversation_id: Uuid,
    pub owner: String,
    pub title: String,
    /// The snapshot, as the service wrote it (JSON).
    #[serde(skip)]
    pub snapshot: String,
    #[serde(serialize_with = "super::types::rfc3339_pub")]
    pub created_at: DateTime<Utc>,
    pub revoked: bool,
}

macro_rules! share_columns {
    () => {
        "id, conversation_id, owner, title, snapshot, created_at, revoked_at"
    };
}

#[derive(sqlx::FromRow)]
struct ShareRow {
    id: String,
    conversation_id: String,
    owner: String,
    title: String,
    snapshot: String,
    created_at: i64,
    revoked_at: Option<i64>,
}

impl ShareRow {
    fn into_record(self) -> Result<ShareRecord, StoreError> {
        const T: &str = "shares";
        Ok(ShareRecord {
            id: parse_uuid(T, &self.id, &self.id)?,
            conversation_id: parse_uuid(T, &self.id, &self.conversation_id)?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            owner: self.owner,
            title: self.title,
            snapshot: self.snapshot,
            revoked: self.revoked_at.is_some(),
        })
    }
}

impl Store {
    /// Stores a share of `conversation` (of `owner`) found by `token_digest`.
    pub async fn create_share(
        &self,
        conversation: Uuid,
        owner: &str,
        token_digest: &str,
        title: &str,
        snapshot: &str,
    ) -> Result<ShareRecord, StoreError> {
        let row: ShareRow = sqlx::query_as(concat!(
            "INSERT INTO shares (id, token_digest, conversation_id, owner, title, snapshot, \
             created_at) VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING ",
            share_columns!()
        ))
        .bind(Uuid::now_v7().to_string())
        .bind(token_digest)
        .bind(conversation.to_string())
        .bind(owner)
        .bind(title)
        .bind(snapshot)
        .bind(now_micros())
        .fetch_one(&self.pool)
        .await?;
        row.into_record()
    }

    /// The share a token's digest names, unless it was revoked.
    pub async fn live_share(&self, token_digest: &str) -> Result<Option<ShareRecord>, StoreError> {
        let row: Option<ShareRow> = sqlx::query_as(concat!(
            "SELECT ",
            share_columns!(),
            " FROM shares WHERE token_digest = $1 AND revoked_at IS NULL"
        ))
        .bind(token_digest)
        .fetch_optional(&self.pool)
        .await?;
        row.map(ShareRow::into_record).transpose()
    }

    /// A conversation's shares, newest first.
    pub async fn shares_of(&self, conversation: Uuid) -> Result<Vec<ShareRecord>, StoreError> {
        let rows: Vec<ShareRow> = sqlx::query_as(concat!(
            "SELECT ",
            share_columns!(),
            " FROM shares WHERE conversation_id = $1 ORDER BY created_at DESC, id DESC"
        ))
        .bind(conversation.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(ShareRow::into_record).collect()
    }

    /// Revokes share `id` of `conversation`; false when there is no such live share.
    pub async fn revoke_share(&self, conversation: Uuid, id: Uuid) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE shares SET revoked_at = $1 \
             WHERE id = $2 AND conversation_id = $3 AND revoked_at IS NULL",
        )
        .bind(now_micros())
        .bind(id.to_string())
        .bind(conversation.to_string())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }
}
