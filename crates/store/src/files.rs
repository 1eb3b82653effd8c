//! Files in conversations (migration 0009): a file's extracted text and what the pages show of
//! it. Uploaded into a conversation a file is pending (no message) until a user message takes
//! it ([`crate::Store::insert_exchange`] with [`Attachments`]). The service checks types, sizes
//! and quotas; the store keeps every statement to the conversation (and so to its owner).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{now_micros, parse_time, parse_uuid, Store, StoreError, WriteTx};

/// One file as stored.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FileRecord {
    pub id: Uuid,
    pub conversation_id: Uuid,
    /// The user message that carries it; `None` while it waits for the next message.
    pub message_id: Option<Uuid>,
    pub name: String,
    /// `text`, `markdown`, `code`, `csv`, `json` or `pdf`.
    pub kind: String,
    pub media_type: String,
    /// The uploaded file's size.
    pub size_bytes: i64,
    /// The text the model reads (not serialized in lists: it can be long).
    #[serde(skip)]
    pub text: String,
    /// Its tokens in the prompt, the file's block included.
    pub tokens: i64,
    #[serde(serialize_with = "super::types::rfc3339_pub")]
    pub created_at: DateTime<Utc>,
}

/// A new file, checked and extracted by the service.
#[derive(Debug, Clone)]
pub struct NewFile<'a> {
    pub name: &'a str,
    pub kind: &'a str,
    pub media_type: &'a str,
    pub size_bytes: i64,
    pub text: &'a str,
    pub tokens: i64,
}

/// What a new user message carries besides its text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attachments {
    /// The message as the prompt reads it (its files placed in it); kept in `messages.raw` so
    /// every later prompt renders the same tokens.
    pub raw: Option<String>,
    /// Pending files of the conversation the message takes.
    pub pending: Vec<Uuid>,
    /// A user message whose files the new one carries too (an edit keeps the files).
    pub keep_from: Option<Uuid>,
}

impl Attachments {
    pub fn is_empty(&self) -> bool {
        *self == Attachments::default()
    }
}

macro_rules! file_columns {
    () => {
        "id, conversation_id, message_id, name, kind, media_type, size_bytes, text, tokens, \
         created_at"
    };
}

#[derive(sqlx::FromRow)]
struct FileRow {
    id: String,
    conversation_id: String,
    message_id: Option<String>,
    name: String,
    kind: String,
    media_type: String,
    size_bytes: i64,
    text: String,
    tokens: i64,
    created_at: i64,
}

impl FileRow {
    fn into_record(self) -> Result<FileRecord, StoreError> {
        const T: &str = "files";
        Ok(FileRecord {
            id: parse_uuid(T, &self.id, &self.id)?,
            conversation_id: parse_uuid(T, &self.id, &self.conversation_id)?,
            message_id: self
                .message_id
                .as_deref()
                .map(|m| parse_uuid(T, &self.id, m))
                .transpose()?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            name: self.name,
            kind: self.kind,
            media_type: self.media_type,
            size_bytes: self.size_bytes,
            text: self.text,
            tokens: self.tokens,
        })
    }
}

impl Store {
    /// Stores a pending file of `conversation` (owned by `owner`).
    pub async fn create_file(
        &self,
        conversation: Uuid,
        owner: &str,
        file: &NewFile<'_>,
    ) -> Result<FileRecord, StoreError> {
        let row: FileRow = sqlx::query_as(concat!(
            "INSERT INTO files (id, conversation_id, message_id, owner, name, kind, media_type, \
             size_bytes, text, tokens, created_at) \
             VALUES ($1, $2, NULL, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING ",
            file_columns!()
        ))
        .bind(Uuid::now_v7().to_string())
        .bind(conversation.to_string())
        .bind(owner)
        .bind(file.name)
        .bind(file.kind)
        .bind(file.media_type)
        .bind(file.size_bytes)
        .bind(file.text)
        .bind(file.tokens)
        .bind(now_micros())
        .fetch_one(&self.pool)
        .await?;
        row.into_record()
    }

    /// Every file of `conversation` (pending and attached), oldest first.
    pub async fn files_of(&self, conversation: Uuid) -> Result<Vec<FileRecord>, StoreError> {
        let rows: Vec<FileRow> = sqlx::query_as(concat!(
            "SELECT ",
            file_columns!(),
            " FROM files WHERE conversation_id = $1 ORDER BY created_at, id"
        ))
        .bind(conversation.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(FileRow::into_record).collect()
    }

    /// The files a user message carries, oldest first.
    pub async fn files_of_message(&self, message: Uuid) -> Result<Vec<FileRecord>, StoreError> {
        let rows: Vec<FileRow> = sqlx::query_as(concat!(
            "SELECT ",
            file_columns!(),
            " FROM files WHERE message_id = $1 ORDER BY created_at, id"
        ))
        .bind(message.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(FileRow::into_record).collect()
    }

    /// Deletes pending file `id` of `conversation`; false when there is no such pending file
    /// (a file a message carries stays with it).
    pub async fn delete_pending_file(
        &self,
        conversation: Uuid,
        id: Uuid,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "DELETE FROM files WHERE id = $1 AND conversation_id = $2 AND message_id IS NULL",
        )
        .bind(id.to_string())
        .bind(conversation.to_string())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Bytes of files `owner` keeps (uploaded sizes).
    pub async fn stored_file_bytes(&self, owner: &str) -> Result<u64, StoreError> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(size_bytes), 0) AS BIGINT) FROM files WHERE owner = $1",
        )
        .bind(owner)
        .fetch_one(&self.pool)
        .await?;
        Ok(n.max(0) as u64)
    }
}

/// Gives user message `message` of `conversation` what `attach` says, inside the caller's
/// transaction: its prompt text, the pending files it takes (each must be a pending file of
/// this conversation, else [`StoreError::FileNotFound`]) and copies of another message's files.
pub(crate) async fn attach(
    tx: &mut WriteTx,
    conversation: Uuid,
    message: Uuid,
    attach: &Attachments,
) -> Result<(), StoreError> {
    if let Some(raw) = &attach.raw {
        sqlx::query("UPDATE messages SET raw = $1 WHERE id = $2")
            .bind(raw)
            .bind(message.to_string())
            .execute(&mut **tx)
            .await?;
    }
    for file in &attach.pending {
        let done = sqlx::query(
            "UPDATE files SET message_id = $1 \
             WHERE id = $2 AND conversation_id = $3 AND message_id IS NULL",
        )
        .bind(message.to_string())
        .bind(file.to_string())
        .bind(conversation.to_string())
        .execute(&mut **tx)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::FileNotFound(*file));
        }
    }
    if let Some(from) = attach.keep_from {
        let rows: Vec<FileRow> = sqlx::query_as(concat!(
            "SELECT ",
            file_columns!(),
            " FROM files WHERE message_id = $1 AND conversation_id = $2 ORDER BY created_at, id"
        ))
        .bind(from.to_string())
        .bind(conversation.to_string())
        .fetch_all(&mut **tx)
        .await?;
        for row in rows {
            sqlx::query(
                "INSERT INTO files (id, conversation_id, message_id, owner, name, kind, \
                 media_type, size_bytes, text, tokens, created_at) \
                 SELECT $1, conversation_id, $2, owner, name, kind, media_type, size_bytes, text, \
                 tokens, created_at FROM files WHERE id = $3",
            )
            .bind(Uuid::now_v7().to_string())
            .bind(message.to_string())
            .bind(&row.id)
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}
