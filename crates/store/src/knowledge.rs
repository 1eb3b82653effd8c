//! Knowledge (migration 0015): collections of documents, their chunks, the chunks' embeddings
//! and the keyword index over them (FTS5 on SQLite, full text search on PostgreSQL). The
//! service decides who may see what ([`Collection::visible_to`] is the rule it reads), chunks,
//! embeds and fuses; the store keeps the rows consistent: a document's chunks are written in one
//! transaction, and deleting a document or a collection deletes what hangs from it.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{now_micros, parse_time, parse_uuid, Backend, Store, StoreError, WriteTx};

/// A collection of documents.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Collection {
    pub id: Uuid,
    pub owner: String,
    pub name: String,
    pub description: String,
    /// Shared with everyone (an admin's choice).
    pub shared: bool,
    /// Accounts an admin shared it with, besides its owner.
    pub shared_with: Vec<String>,
    #[serde(serialize_with = "super::types::rfc3339_pub")]
    pub created_at: DateTime<Utc>,
}

impl Collection {
    /// Whether `owner` may read and search it: its own, shared with everyone, or with them.
    pub fn visible_to(&self, owner: &str) -> bool {
        self.owner == owner || self.shared || self.shared_with.iter().any(|o| o == owner)
    }
}

/// Where a document's indexing stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DocumentStatus {
    /// Waiting for the indexer.
    Pending,
    /// Chunked; its chunks are being embedded.
    Indexing,
    Ready,
    /// `error` says why.
    Failed,
}

impl DocumentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DocumentStatus::Pending => "pending",
            DocumentStatus::Indexing => "indexing",
            DocumentStatus::Ready => "ready",
            DocumentStatus::Failed => "failed",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => DocumentStatus::Pending,
            "indexing" => DocumentStatus::Indexing,
            "ready" => DocumentStatus::Ready,
            "failed" => DocumentStatus::Failed,
            _ => return None,
        })
    }
}

/// A document of a collection (its text is read apart: [`Store::document_text`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Document {
    pub id: Uuid,
    pub collection_id: Uuid,
    pub owner: String,
    pub name: String,
    /// `text`, `markdown`, `code`, `csv`, `json` or `pdf`.
    pub kind: String,
    /// The uploaded file's size.
    pub size_bytes: i64,
    /// Bytes of its extracted text.
    pub text_bytes: i64,
    pub status: DocumentStatus,
    pub error: Option<String>,
    /// Its chunks, and how many of them are embedded so far.
    pub chunks: i64,
    pub embedded: i64,
    #[serde(serialize_with = "super::types::rfc3339_pub")]
    pub created_at: DateTime<Utc>,
}

/// A document to add, checked and read by the service.
#[derive(Debug, Clone)]
pub struct NewDocument<'a> {
    pub name: &'a str,
    pub kind: &'a str,
    pub size_bytes: i64,
    pub text: &'a str,
}

/// A chunk to store, cut by the service.
#[derive(Debug, Clone, PartialEq)]
pub struct NewChunk {
    pub heading: String,
    pub text: String,
    /// Its byte range in the document's text.
    pub start_byte: i64,
    pub end_byte: i64,
    pub tokens: i64,
}

/// A passage a user message was given, as the model read it (`[n]`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MessageSource {
    pub n: i64,
    pub collection_id: Uuid,
    pub document_id: Uuid,
    pub document_name: String,
    pub heading: String,
    pub text: String,
}

/// A stored chunk, with its document's name.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Chunk {
    pub id: i64,
    pub document_id: Uuid,
    pub collection_id: Uuid,
    pub document_name: String,
    pub ord: i64,
    pub heading: String,
    pub text: String,
    pub start_byte: i64,
    pub end_byte: i64,
    pub tokens: i64,
}

#[derive(sqlx::FromRow)]
struct CollectionRow {
    id: String,
    owner: String,
    name: String,
    description: String,
    shared: i64,
    created_at: i64,
}

#[derive(sqlx::FromRow)]
struct DocumentRow {
    id: String,
    collection_id: String,
    owner: String,
    name: String,
    kind: String,
    size_bytes: i64,
    text_bytes: i64,
    status: String,
    error: Option<String>,
    chunks: i64,
    embedded: i64,
    created_at: i64,
}

#[derive(sqlx::FromRow)]
struct ChunkRow {
    id: i64,
    document_id: String,
    collection_id: String,
    document_name: String,
    ord: i64,
    heading: String,
    text: String,
    start_byte: i64,
    end_byte: i64,
    tokens: i64,
}

const C: &str = "knowledge_collections";
const D: &str = "knowledge_documents";
const K: &str = "knowledge_chunks";

impl DocumentRow {
    fn into_record(self) -> Result<Document, StoreError> {
        Ok(Document {
            id: parse_uuid(D, &self.id, &self.id)?,
            collection_id: parse_uuid(D, &self.id, &self.collection_id)?,
            status: DocumentStatus::parse(&self.status).ok_or_else(|| {
                super::corrupt(D, &self.id, format!("unknown status {:?}", self.status))
            })?,
            created_at: parse_time(D, &self.id, self.created_at)?,
            owner: self.owner,
            name: self.name,
            kind: self.kind,
            size_bytes: self.size_bytes,
            text_bytes: self.text_bytes,
            error: self.error,
            chunks: self.chunks,
            embedded: self.embedded,
        })
    }
}

impl ChunkRow {
    fn into_record(self) -> Result<Chunk, StoreError> {
        let row = self.id.to_string();
        Ok(Chunk {
            id: self.id,
            document_id: parse_uuid(K, &row, &self.document_id)?,
            collection_id: parse_uuid(K, &row, &self.collection_id)?,
            document_name: self.document_name,
            ord: self.ord,
            heading: self.heading,
            text: self.text,
            start_byte: self.start_byte,
            end_byte: self.end_byte,
            tokens: self.tokens,
        })
    }
}

macro_rules! document_columns {
    () => {
        "id, collection_id, owner, name, kind, size_bytes, text_bytes, status, error, chunks, \
         embedded, created_at"
    };
}
const CHUNK_COLUMNS: &str = "c.id, c.document_id, c.collection_id, d.name AS document_name, \
     c.ord, c.heading, c.text, c.start_byte, c.end_byte, c.tokens";

/// `$first, $first+1, …` for `n` values bound in a list.
fn placeholders(first: usize, n: usize) -> String {
    (first..first + n)
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The words of a search text as the keyword index may be asked for them: letters and digits
/// only (nothing the query languages would read as an operator), at most 32 of them.
pub fn query_words(text: &str) -> Vec<String> {
    let mut words: Vec<String> = Vec::new();
    for w in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        let w = w.to_lowercase();
        if !words.contains(&w) {
            words.push(w);
        }
        if words.len() == 32 {
            break;
        }
    }
    words
}

/// Embeddings as stored: little-endian f32.
pub fn encode_vector(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A stored embedding; `None` when its length is not a whole number of f32.
pub fn decode_vector(bytes: &[u8]) -> Option<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    )
}

impl Store {
    async fn collection_from(&self, row: CollectionRow) -> Result<Collection, StoreError> {
        let shared_with: Vec<(String,)> = sqlx::query_as(
            "SELECT owner FROM knowledge_access WHERE collection_id = $1 ORDER BY owner",
        )
        .bind(&row.id)
        .fetch_all(&self.pool)
        .await?;
        Ok(Collection {
            id: parse_uuid(C, &row.id, &row.id)?,
            created_at: parse_time(C, &row.id, row.created_at)?,
            owner: row.owner,
            name: row.name,
            description: row.description,
            shared: row.shared != 0,
            shared_with: shared_with.into_iter().map(|(o,)| o).collect(),
        })
    }

    async fn collections_from(
        &self,
        rows: Vec<CollectionRow>,
    ) -> Result<Vec<Collection>, StoreError> {
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            out.push(self.collection_from(row).await?);
        }
        Ok(out)
    }

    /// Makes a collection of `owner`'s.
    pub async fn create_collection(
        &self,
        owner: &str,
        name: &str,
        description: &str,
    ) -> Result<Collection, StoreError> {
        let row: CollectionRow = sqlx::query_as(
            "INSERT INTO knowledge_collections (id, owner, name, description, shared, created_at) \
             VALUES ($1, $2, $3, $4, 0, $5) \
             RETURNING id, owner, name, description, shared, created_at",
        )
        .bind(Uuid::now_v7().to_string())
        .bind(owner)
        .bind(name)
        .bind(description)
        .bind(now_micros())
        .fetch_one(&self.pool)
        .await?;
        self.collection_from(row).await
    }

    /// Collection `id`, whoever's it is.
    pub async fn collection(&self, id: Uuid) -> Result<Option<Collection>, StoreError> {
        let row: Option<CollectionRow> = sqlx::query_as(
            "SELECT id, owner, name, description, shared, created_at \
             FROM knowledge_collections WHERE id = $1",
        )
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => Ok(Some(self.collection_from(row).await?)),
            None => Ok(None),
        }
    }

    /// The collections `owner` may read: its own, those shared with everyone and those shared
    /// with it; oldest first.
    pub async fn collections_visible_to(&self, owner: &str) -> Result<Vec<Collection>, StoreError> {
        let rows: Vec<CollectionRow> = sqlx::query_as(
            "SELECT id, owner, name, description, shared, created_at \
             FROM knowledge_collections k WHERE owner = $1 OR shared = 1 \
             OR EXISTS (SELECT 1 FROM knowledge_access a WHERE a.collection_id = k.id \
                        AND a.owner = $1) \
             ORDER BY created_at, id",
        )
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        self.collections_from(rows).await
    }

    /// Every collection (the admin's list), oldest first.
    pub async fn all_collections(&self) -> Result<Vec<Collection>, StoreError> {
        let rows: Vec<CollectionRow> = sqlx::query_as(
            "SELECT id, owner, name, description, shared, created_at \
             FROM knowledge_collections ORDER BY created_at, id",
        )
        .fetch_all(&self.pool)
        .await?;
        self.collections_from(rows).await
    }

    /// Shares collection `id` with everyone (`shared`) and with exactly `with` (accounts);
    /// false when there is no such collection.
    pub async fn share_collection(
        &self,
        id: Uuid,
        shared: bool,
        with: &[String],
    ) -> Result<bool, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        let done = sqlx::query("UPDATE knowledge_collections SET shared = $1 WHERE id = $2")
            .bind(i64::from(shared))
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        sqlx::query("DELETE FROM knowledge_access WHERE collection_id = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        for owner in with {
            sqlx::query("INSERT INTO knowledge_access (collection_id, owner) VALUES ($1, $2)")
                .bind(id.to_string())
                .bind(owner)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Deletes collection `id` with its documents and their chunks; false when there is none.
    pub async fn delete_collection(&self, id: Uuid) -> Result<bool, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        // Chunks first (SQLite's FTS triggers run per row; PostgreSQL cascades alike).
        sqlx::query("DELETE FROM knowledge_chunks WHERE collection_id = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query("DELETE FROM knowledge_collections WHERE id = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// Adds a document to `collection`, pending.
    pub async fn add_document(
        &self,
        collection: Uuid,
        owner: &str,
        doc: &NewDocument<'_>,
    ) -> Result<Document, StoreError> {
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO knowledge_documents (id, collection_id, owner, name, kind, size_bytes, \
             text, text_bytes, status, error, chunks, embedded, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', NULL, 0, 0, $9)",
        )
        .bind(id.to_string())
        .bind(collection.to_string())
        .bind(owner)
        .bind(doc.name)
        .bind(doc.kind)
        .bind(doc.size_bytes)
        .bind(doc.text)
        .bind(doc.text.len() as i64)
        .bind(now_micros())
        .execute(&self.pool)
        .await?;
        self.document(id)
            .await?
            .ok_or_else(|| super::corrupt(D, &id.to_string(), "vanished after insert"))
    }

    /// Document `id`.
    pub async fn document(&self, id: Uuid) -> Result<Option<Document>, StoreError> {
        let row: Option<DocumentRow> = sqlx::query_as(concat!(
            "SELECT ",
            document_columns!(),
            " FROM knowledge_documents WHERE id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.map(DocumentRow::into_record).transpose()
    }

    /// Document `id`'s extracted text.
    pub async fn document_text(&self, id: Uuid) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> =
            sqlx::query_as("SELECT text FROM knowledge_documents WHERE id = $1")
                .bind(id.to_string())
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|(t,)| t))
    }

    /// The documents of `collection`, oldest first.
    pub async fn documents_of(&self, collection: Uuid) -> Result<Vec<Document>, StoreError> {
        let rows: Vec<DocumentRow> = sqlx::query_as(concat!(
            "SELECT ",
            document_columns!(),
            " FROM knowledge_documents WHERE collection_id = $1 ORDER BY created_at, id"
        ))
        .bind(collection.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(DocumentRow::into_record).collect()
    }

    /// Documents whose indexing has not ended (pending, or cut off while indexing), oldest
    /// first.
    pub async fn documents_to_index(&self) -> Result<Vec<Document>, StoreError> {
        let rows: Vec<DocumentRow> = sqlx::query_as(concat!(
            "SELECT ",
            document_columns!(),
            " FROM knowledge_documents WHERE status IN ('pending', 'indexing') \
             ORDER BY created_at, id"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(DocumentRow::into_record).collect()
    }

    /// Deletes document `id` and its chunks; false when there is none.
    pub async fn delete_document(&self, id: Uuid) -> Result<bool, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        sqlx::query("DELETE FROM knowledge_chunks WHERE document_id = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query("DELETE FROM knowledge_documents WHERE id = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records document `id`'s chunks and marks it indexing, in one transaction; a document
    /// that has chunks already keeps them (indexing resumed after a crash). False when the
    /// document is gone.
    pub async fn set_document_chunks(
        &self,
        id: Uuid,
        collection: Uuid,
        chunks: &[NewChunk],
    ) -> Result<bool, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        let (have,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM knowledge_chunks WHERE document_id = $1")
                .bind(id.to_string())
                .fetch_one(&mut *tx)
                .await?;
        if have == 0 {
            for (ord, c) in chunks.iter().enumerate() {
                sqlx::query(
                    "INSERT INTO knowledge_chunks (document_id, collection_id, ord, heading, \
                     text, start_byte, end_byte, tokens, embedding) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, NULL)",
                )
                .bind(id.to_string())
                .bind(collection.to_string())
                .bind(ord as i64)
                .bind(&c.heading)
                .bind(&c.text)
                .bind(c.start_byte)
                .bind(c.end_byte)
                .bind(c.tokens)
                .execute(&mut *tx)
                .await?;
            }
        }
        let done = sqlx::query(
            "UPDATE knowledge_documents SET status = 'indexing', error = NULL, \
             chunks = (SELECT COUNT(*) FROM knowledge_chunks WHERE document_id = $1), \
             embedded = (SELECT COUNT(*) FROM knowledge_chunks WHERE document_id = $1 \
                         AND embedding IS NOT NULL) \
             WHERE id = $1",
        )
        .bind(id.to_string())
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Up to `limit` chunks of document `id` not embedded yet, in order: `(chunk id, text)`.
    pub async fn chunks_to_embed(
        &self,
        id: Uuid,
        limit: usize,
    ) -> Result<Vec<(i64, String, String)>, StoreError> {
        let rows: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT id, heading, text FROM knowledge_chunks \
             WHERE document_id = $1 AND embedding IS NULL ORDER BY ord LIMIT $2",
        )
        .bind(id.to_string())
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows)
    }

    /// Stores embeddings of chunks of document `id` and its count of embedded chunks.
    pub async fn set_chunk_embeddings(
        &self,
        id: Uuid,
        vectors: &[(i64, Vec<f32>)],
    ) -> Result<(), StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        for (chunk, v) in vectors {
            sqlx::query(
                "UPDATE knowledge_chunks SET embedding = $1 WHERE id = $2 AND document_id = $3",
            )
            .bind(encode_vector(v))
            .bind(*chunk)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(
            "UPDATE knowledge_documents SET embedded = (SELECT COUNT(*) FROM knowledge_chunks \
             WHERE document_id = $1 AND embedding IS NOT NULL) WHERE id = $1",
        )
        .bind(id.to_string())
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }

    /// Ends document `id`'s indexing: ready, or failed with `error`.
    pub async fn finish_document(&self, id: Uuid, error: Option<&str>) -> Result<(), StoreError> {
        sqlx::query("UPDATE knowledge_documents SET status = $1, error = $2 WHERE id = $3")
            .bind(if error.is_some() { "failed" } else { "ready" })
            .bind(error)
            .bind(id.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The chunks of `collections` that best match `words` by keywords (any of them, ranked:
    /// bm25 on SQLite, ts_rank_cd on PostgreSQL), best first: `(chunk id, score)`, a higher
    /// score better.
    pub async fn keyword_search(
        &self,
        collections: &[Uuid],
        words: &[String],
        limit: usize,
    ) -> Result<Vec<(i64, f64)>, StoreError> {
        if collections.is_empty() || words.is_empty() {
            return Ok(Vec::new());
        }
        let ids = placeholders(3, collections.len());
        let (sql, query) = match self.backend {
            // `CROSS JOIN` keeps the full-text match as the outer loop: left to choose, SQLite
            // walked the collection's chunks and ran the match for each (194 ms at 1,000
            // passages against 3.4 ms; `smolchat bench --knowledge-passages`).
            Backend::Sqlite => (
                format!(
                    "SELECT c.id, -bm25(knowledge_chunks_fts) AS score FROM knowledge_chunks_fts \
                     CROSS JOIN knowledge_chunks c ON c.id = knowledge_chunks_fts.rowid \
                     WHERE knowledge_chunks_fts MATCH $1 AND c.collection_id IN ({ids}) \
                     ORDER BY score DESC, c.id LIMIT $2"
                ),
                words
                    .iter()
                    .map(|w| format!("\"{w}\""))
                    .collect::<Vec<_>>()
                    .join(" OR "),
            ),
            Backend::Postgres => (
                format!(
                    "SELECT c.id, CAST(ts_rank_cd(c.words, q) AS DOUBLE PRECISION) AS score \
                     FROM knowledge_chunks c, to_tsquery('english', $1) q \
                     WHERE c.words @@ q AND c.collection_id IN ({ids}) \
                     ORDER BY score DESC, c.id LIMIT $2"
                ),
                words.join(" | "),
            ),
        };
        // Built from fixed text and numbered placeholders only: every value is bound.
        let mut q = sqlx::query_as::<_, (i64, f64)>(sqlx::AssertSqlSafe(sql))
            .bind(query)
            .bind(limit as i64);
        for c in collections {
            q = q.bind(c.to_string());
        }
        Ok(q.fetch_all(&self.pool).await?)
    }

    /// Every embedded chunk of `collection`: `(chunk id, embedding bytes)`.
    pub async fn chunk_vectors(&self, collection: Uuid) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(
            "SELECT id, embedding FROM knowledge_chunks \
             WHERE collection_id = $1 AND embedding IS NOT NULL ORDER BY id",
        )
        .bind(collection.to_string())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows)
    }

    /// Chunks `ids` with their documents' names, in the order asked (ids not found left out).
    pub async fn chunks(&self, ids: &[i64]) -> Result<Vec<Chunk>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT {CHUNK_COLUMNS} FROM knowledge_chunks c \
             JOIN knowledge_documents d ON d.id = c.document_id WHERE c.id IN ({})",
            placeholders(1, ids.len())
        );
        // Built from fixed text and numbered placeholders only: every value is bound.
        let mut q = sqlx::query_as::<_, ChunkRow>(sqlx::AssertSqlSafe(sql));
        for id in ids {
            q = q.bind(*id);
        }
        let rows = q.fetch_all(&self.pool).await?;
        let mut found: Vec<Chunk> = rows
            .into_iter()
            .map(ChunkRow::into_record)
            .collect::<Result<_, _>>()?;
        found.sort_by_key(|c| ids.iter().position(|i| *i == c.id));
        Ok(found)
    }

    /// Bytes of document text `owner` keeps in knowledge.
    pub async fn stored_knowledge_bytes(&self, owner: &str) -> Result<u64, StoreError> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(text_bytes), 0) AS BIGINT) FROM knowledge_documents \
             WHERE owner = $1",
        )
        .bind(owner)
        .fetch_one(&self.pool)
        .await?;
        Ok(n.max(0) as u64)
    }

    /// Records the passages user message `message` was given.
    pub async fn save_message_sources(
        &self,
        message: Uuid,
        sources: &[MessageSource],
    ) -> Result<(), StoreError> {
        if sources.is_empty() {
            return Ok(());
        }
        let mut tx = WriteTx::begin(self).await?;
        for src in sources {
            sqlx::query(
                "INSERT INTO message_sources (message_id, n, collection_id, document_id, \
                 document_name, heading, text) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(message.to_string())
            .bind(src.n)
            .bind(src.collection_id.to_string())
            .bind(src.document_id.to_string())
            .bind(&src.document_name)
            .bind(&src.heading)
            .bind(&src.text)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await
    }

    /// The passages the user messages of `conversation` were given, by message, in order.
    pub async fn sources_of(
        &self,
        conversation: Uuid,
    ) -> Result<std::collections::HashMap<Uuid, Vec<MessageSource>>, StoreError> {
        #[allow(clippy::type_complexity)]
        let rows: Vec<(String, i64, String, String, String, String, String)> = sqlx::query_as(
            "SELECT s.message_id, s.n, s.collection_id, s.document_id, s.document_name, \
             s.heading, s.text FROM message_sources s \
             JOIN messages m ON m.id = s.message_id WHERE m.conversation_id = $1 \
             ORDER BY s.message_id, s.n",
        )
        .bind(conversation.to_string())
        .fetch_all(&self.pool)
        .await?;
        let mut out: std::collections::HashMap<Uuid, Vec<MessageSource>> = Default::default();
        for (message, n, collection, document, document_name, heading, text) in rows {
            const T: &str = "message_sources";
            out.entry(parse_uuid(T, &message, &message)?)
                .or_default()
                .push(MessageSource {
                    n,
                    collection_id: parse_uuid(T, &message, &collection)?,
                    document_id: parse_uuid(T, &message, &document)?,
                    document_name,
                    heading,
                    text,
                });
        }
        Ok(out)
    }
}
