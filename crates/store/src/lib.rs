//! The persistence layer: conversations, messages and sign-in sessions in SQLite (WAL mode)
//! through sqlx.
//!
//! This module is the only code in smolchat that writes SQL. The schema lives in `migrations/`
//! and is applied by [`Store::open`].
//!
//! # Durability
//!
//! The database runs in WAL mode with `synchronous = FULL`. With `NORMAL`, WAL commits survive a
//! crash of the process but the last ones can be lost on power failure or an OS crash, because
//! the WAL is only synced at checkpoints. The product promise is that an acknowledged message is
//! never lost, and the store writes only a few rows per turn (the user message, the start and the
//! end of the reply, never per token), so one WAL fsync per commit costs nothing measurable next
//! to generation. Every method returns only after its transaction has committed.
//!
//! # Storage conventions
//!
//! Ids are UUIDv7 stored as lowercase hyphenated TEXT; timestamps are INTEGER microseconds since
//! the Unix epoch (UTC); settings and timings are JSON TEXT. Message order is the per-conversation
//! `position`, never a timestamp.
//!
//! # Concurrency
//!
//! Writes that touch more than one row run in `BEGIN IMMEDIATE` transactions: they take SQLite's
//! write lock up front (waiting up to the busy timeout) instead of upgrading a read transaction
//! later, which in WAL mode fails with `SQLITE_BUSY` without waiting.

mod audit;
mod backups;
mod bus;
mod error;
mod files;
mod knowledge;
mod organise;
mod replicas;
mod sessions;
mod shares;
mod types;
mod usage;
mod users;

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::any::AnyPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::AnyPool;
use sqlx::Executor;
use uuid::Uuid;

pub use audit::{AuditEntry, AuditFilter, NewAuditEntry};
pub use backups::restore;
pub use bus::{Bus, MAX_PAYLOAD as BUS_MAX_PAYLOAD};
pub use error::StoreError;
pub use files::{Attachments, FileRecord, NewFile};
pub use knowledge::{
    decode_vector, encode_vector, query_words, Chunk, Collection, Document, DocumentStatus,
    MessageSource, NewChunk, NewDocument,
};
pub use organise::{Folder, Organisation, OrganisationPatch, Preset, TagCount};
pub use replicas::{Registration, Replica, ReplicaLoad, ReplicaRecord};
pub use shares::ShareRecord;
pub use types::{
    derive_title, Conversation, ConversationSettings, ConversationSummary, Cursor, FinishedReply,
    ImportedFile, ImportedMessage, ListFilter, ListPage, Message, MessageStatus, PageRequest, Role,
    SessionKind, SessionRecord, Timings, MAX_PAGE, TITLE_MAX_CHARS,
};
pub use usage::{Period, Usage};
pub use users::{
    ApiKeyRecord, ApiUsage, CreatedUser, DeletedUser, InviteRecord, NewUser, User, UserOverview,
    UserRole,
};

/// How long a statement waits for another connection's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections to a file database. SQLite has one writer at a time anyway; more connections only
/// help concurrent readers (page loads while replies are being saved).
const MAX_CONNECTIONS: u32 = 8;
/// Connections per replica to PostgreSQL (plus one for LISTEN and one for NOTIFY). PostgreSQL's
/// default `max_connections` is 100, so ten replicas fit with room for tools.
const MAX_PG_CONNECTIONS: u32 = 8;
/// How long a request waits for a pooled connection before the store reports itself unavailable.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// The database a [`Store`] is on. Both take the same SQL except where [`Store`] says otherwise
/// (`$N` placeholders, `lower()` for case-insensitive names, `CAST(… AS BIGINT)` around sums):
/// see docs/ARCHITECTURE.md, "Store".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The embedded default: one file, one server process.
    Sqlite,
    /// Shared by several replicas (`database.url = postgres://…`).
    Postgres,
}

impl Backend {
    fn of_url(url: &str) -> Result<Backend, StoreError> {
        // sqlx strips an optional `sqlite:` prefix and takes whatever is left as a file name, so
        // any other spelling would silently become a local file path: insist on a scheme.
        if url.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else {
            Err(StoreError::Url {
                url: redact_url(url),
                reason: "the scheme must be sqlite: or postgres://".to_string(),
            })
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

/// `url` with any password replaced by `***`, for logs and error messages.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            // Cannot fail for a URL that already has a password (it has a host).
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_string(),
    }
}

/// Opens a SQLite file (or in-memory) database through sqlx's `Any` driver, with WAL,
/// `synchronous = FULL`, foreign keys and a busy timeout set on every connection.
async fn open_sqlite(url: &str) -> Result<(AnyPool, Option<std::path::PathBuf>), StoreError> {
    // Parsed once with the SQLite driver's own parser for its checks and the file name; the
    // `Any` pool below re-parses the URL (it cannot take typed options).
    let options = SqliteConnectOptions::from_str(url).map_err(|e| StoreError::Url {
        url: url.to_string(),
        reason: e.to_string(),
    })?;
    // sqlx does not expose whether the parsed URL is in-memory; these are the spellings its
    // parser maps to an in-memory database.
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    let data_dir = (!in_memory).then(|| {
        options
            .get_filename()
            .parent()
            .filter(|dir| !dir.as_os_str().is_empty())
            .map_or_else(|| Path::new(".").to_path_buf(), Path::to_path_buf)
    });
    let pool_options = if in_memory {
        // An in-memory database lives as long as one connection to it: keep exactly one,
        // forever (several would also fight over shared-cache table locks, which ignore the
        // busy timeout).
        AnyPoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
    } else {
        create_parent_dir(options.get_filename())?;
        AnyPoolOptions::new().max_connections(MAX_CONNECTIONS)
    };
    // `mode=rwc` creates a missing file; a URL that names its own mode keeps it.
    let any_url = if in_memory || url.contains("mode=") {
        url.to_string()
    } else if url.contains('?') {
        format!("{url}&mode=rwc")
    } else {
        format!("{url}?mode=rwc")
    };
    let pool = pool_options
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                conn.execute("PRAGMA busy_timeout = 10000").await?;
                conn.execute("PRAGMA foreign_keys = ON").await?;
                conn.execute("PRAGMA journal_mode = WAL").await?;
                conn.execute("PRAGMA synchronous = FULL").await?;
                Ok(())
            })
        })
        .connect(&any_url)
        .await
        .map_err(|source| StoreError::Open {
            url: url.to_string(),
            source,
        })?;
    Ok((pool, data_dir))
}

/// Opens a PostgreSQL database; the database itself must exist (`createdb`), its tables are
/// made by the migrations.
async fn open_postgres(url: &str) -> Result<AnyPool, StoreError> {
    AnyPoolOptions::new()
        .max_connections(MAX_PG_CONNECTIONS)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await
        .map_err(|source| StoreError::Open {
            url: redact_url(url),
            source,
        })
}

/// The error text of replies found `streaming` at start-up.
const INTERRUPTED_BY_RESTART: &str = "the server stopped before this reply was finished";

// Column lists as macros so `concat!` can build `&'static str` queries (sqlx only accepts
// static strings without an explicit "this is safe" wrapper, which keeps user text out of SQL).
macro_rules! conversation_columns {
    () => {
        "id, owner, title, settings, created_at, updated_at"
    };
}
macro_rules! summary_columns {
    () => {
        "c.id, c.owner, c.title, c.created_at, c.updated_at, c.pinned, c.archived, c.folder_id, \
         (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count"
    };
}
macro_rules! message_columns {
    () => {
        "id, conversation_id, position, role, content, reasoning, raw, status, error, \
         prompt_tokens, completion_tokens, cached_tokens, timings, created_at, imported, parent_id"
    };
}

// After the column macros, which they use.
mod conversations;
mod messages;
mod tool_steps;

use messages::set_leaf;
pub use messages::{path_to, StoredRow};
pub use tool_steps::{offset_in, ToolStep, ToolStepStatus, INTERRUPTED_TOOL_RESULT};

/// What [`backup`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupReport {
    pub bytes: u64,
    pub conversations: i64,
    pub messages: i64,
}

/// Writes a consistent copy of the SQLite database at `url` to the new file `dest` while the
/// database may be in use (`VACUUM INTO` reads one snapshot inside a read transaction, so writers
/// carry on and the copy holds every committed message up to that instant), then checks the copy
/// with `PRAGMA integrity_check`.
///
/// Unlike [`Store::open`] this neither migrates nor marks streaming replies interrupted: a live
/// server's replies are its own business, and the copy keeps them exactly as they were.
///
/// A `postgres://` database is backed up with `pg_dump` instead ([`restore`] reads either back).
pub async fn backup(url: &str, dest: &Path) -> Result<BackupReport, StoreError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        backups::check_new_file(dest)?;
        return backups::pg_backup(url, dest).await;
    }
    if !url.starts_with("sqlite:") || url.contains(":memory:") || url.contains("mode=memory") {
        return Err(StoreError::Url {
            url: url.to_string(),
            reason: "only a sqlite: database file or a postgres:// database can be backed up"
                .to_string(),
        });
    }
    let dest_text = backups::check_new_file(dest)?;
    let source_options = SqliteConnectOptions::from_str(url)
        .map_err(|e| StoreError::Url {
            url: url.to_string(),
            reason: e.to_string(),
        })?
        .read_only(true)
        .busy_timeout(BUSY_TIMEOUT);
    if !source_options.get_filename().exists() {
        return Err(StoreError::Url {
            url: url.to_string(),
            reason: "the database file does not exist".to_string(),
        });
    }
    let source = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(source_options)
        .await
        .map_err(|source| StoreError::Open {
            url: url.to_string(),
            source,
        })?;
    sqlx::query("VACUUM INTO $1")
        .bind(dest_text)
        .execute(&source)
        .await?;
    source.close().await;

    let copy = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(SqliteConnectOptions::new().filename(dest).read_only(true))
        .await
        .map_err(|source| StoreError::Open {
            url: dest_text.to_string(),
            source,
        })?;
    let findings: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_all(&copy)
        .await?;
    if findings != ["ok"] {
        copy.close().await;
        return Err(StoreError::BackupDamaged {
            path: dest.to_path_buf(),
            findings: findings.join("; "),
        });
    }
    let conversations: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM conversations")
        .fetch_one(&copy)
        .await?;
    let messages: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM messages")
        .fetch_one(&copy)
        .await?;
    copy.close().await;
    let bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
    Ok(BackupReport {
        bytes,
        conversations,
        messages,
    })
}

/// Handle on the database. Cloning is cheap (the pool is reference-counted inside).
#[derive(Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// As opened (it may hold a password: never log it unredacted).
    url: String,
    /// The replica this process registered as ([`Store::register_replica`]); replies it starts
    /// record it. Shared by every clone.
    replica: std::sync::Arc<std::sync::OnceLock<Uuid>>,
    interrupted_on_open: u64,
    /// The folder holding the database file (`None` for an in-memory database).
    data_dir: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.backend)
            .field("url", &redact_url(&self.url))
            .field("replica", &self.replica.get())
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens the database at `url` (e.g. `sqlite://data/smolchat.db`, `sqlite::memory:`), creating
    /// the file and its parent directory when missing; sets WAL, `synchronous = FULL`, foreign
    /// keys and a busy timeout on every connection; applies the migrations; then marks every
    /// assistant reply left `streaming` by a previous run as `interrupted`
    /// (see [`Store::interrupted_on_open`]).
    ///
    /// Only one server process may use a database file: the start-up recovery assumes nobody
    /// else is generating into it.
    pub async fn open(url: &str) -> Result<Store, StoreError> {
        Store::open_with(url, true).await
    }

    /// Opens the database like [`Store::open`] (creating and migrating it) but leaves
    /// `streaming` replies alone: for tools (`smolchat user …`) that may run beside a live
    /// server, whose replies are its own business.
    pub async fn open_beside_server(url: &str) -> Result<Store, StoreError> {
        Store::open_with(url, false).await
    }

    async fn open_with(url: &str, recover: bool) -> Result<Store, StoreError> {
        let backend = Backend::of_url(url)?;
        sqlx::any::install_default_drivers();
        let (pool, data_dir) = match backend {
            Backend::Sqlite => open_sqlite(url).await?,
            Backend::Postgres => (open_postgres(url).await?, None),
        };
        match backend {
            Backend::Sqlite => sqlx::migrate!("../../migrations/sqlite").run(&pool).await?,
            Backend::Postgres => {
                sqlx::migrate!("../../migrations/postgres")
                    .run(&pool)
                    .await?
            }
        }

        let mut store = Store {
            pool,
            backend,
            url: url.to_string(),
            replica: Default::default(),
            interrupted_on_open: 0,
            data_dir,
        };
        // With SQLite one server process owns the file, so everything left `streaming` was its
        // own. A PostgreSQL database is shared by replicas: each marks only its own replies and
        // those of replicas whose lease ran out ([`Store::register_replica`]).
        if recover && backend == Backend::Sqlite {
            store.interrupted_on_open = store.mark_streaming_interrupted().await?;
            store.mark_open_tool_steps_interrupted().await?;
        }
        if store.interrupted_on_open > 0 {
            tracing::warn!(
                count = store.interrupted_on_open,
                "replies left streaming by the previous run marked interrupted"
            );
        }
        tracing::info!(url = %redact_url(url), backend = backend.as_str(), "store opened");
        Ok(store)
    }

    /// The URL the store was opened with (the bus opens its own connections with it).
    fn url(&self) -> &str {
        &self.url
    }

    /// Which database this store is on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// A cheap round trip to the database (`/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// The folder holding the database file, where the server keeps its other state (the
    /// generated cookie secret); `None` for an in-memory database.
    pub fn data_dir(&self) -> Option<&Path> {
        self.data_dir.as_deref()
    }

    /// How many replies [`Store::open`] found left `streaming` and marked `interrupted`.
    pub fn interrupted_on_open(&self) -> u64 {
        self.interrupted_on_open
    }

    /// Marks every `streaming` assistant message `interrupted` (keeping its partial content) and
    /// returns how many there were. Run by [`Store::open`]; only call it when no reply is being
    /// generated.
    pub async fn mark_streaming_interrupted(&self) -> Result<u64, StoreError> {
        let result = sqlx::query(
            "UPDATE messages SET status = 'interrupted', error = COALESCE(error, $1) \
             WHERE status = 'streaming'",
        )
        .bind(INTERRUPTED_BY_RESTART)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected())
    }

    /// `PRAGMA integrity_check` on SQLite: "ok" for a sound database, else SQLite's findings, one
    /// a line. PostgreSQL has no such statement (it checks its own pages when data checksums are
    /// on); there this is a round trip that answers "ok" when the database answers.
    pub async fn integrity_check(&self) -> Result<String, StoreError> {
        if self.backend == Backend::Postgres {
            self.ping().await?;
            return Ok("ok".to_string());
        }
        let lines: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
            .fetch_all(&self.pool)
            .await?;
        Ok(lines.join("\n"))
    }

    /// SQLite's journal mode in effect: "wal" for a file database ("memory" for an in-memory
    /// one, which cannot use WAL); "postgres" on PostgreSQL, which has its own write-ahead log.
    pub async fn journal_mode(&self) -> Result<String, StoreError> {
        if self.backend == Backend::Postgres {
            return Ok("postgres".to_string());
        }
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&self.pool)
            .await?;
        Ok(mode)
    }

    /// Closes every connection, waiting for those in use to be returned. Later calls fail.
    pub async fn close(&self) {
        self.pool.close().await;
        tracing::info!("store closed");
    }
}

/// Appends a message after the conversation's last one. Runs inside the caller's write
/// transaction, so the `MAX(position) + 1` read and the insert cannot interleave with another
/// writer.
/// Bumps a conversation's `updated_at` and, when it has no title yet and a user message is being
/// added, names it after that message ([`derive_title`]). False when the conversation does not
/// exist.
async fn touch(
    tx: &mut WriteTx,
    conversation: Uuid,
    now: i64,
    user_message: Option<&str>,
) -> Result<bool, StoreError> {
    let touched = sqlx::query(
        "UPDATE conversations SET updated_at = $1, \
         title = CASE WHEN title = '' AND $2 IS NOT NULL THEN $2 ELSE title END WHERE id = $3",
    )
    .bind(now)
    .bind(user_message.map(derive_title))
    .bind(conversation.to_string())
    .execute(&mut **tx)
    .await?;
    Ok(touched.rows_affected() > 0)
}

/// A write transaction (`BEGIN IMMEDIATE … COMMIT`) on one pooled connection.
///
/// Managed here rather than with sqlx's `Transaction`: when a statement or the commit fails for
/// a storage fault (disk full, read-only file, I/O error), SQLite may already have rolled the
/// transaction back itself; sqlx's rollback-on-drop then fails and the connection goes back to
/// the pool still marked as inside a transaction, so every later write on it fails too (found by
/// `tests/faults.rs`). Here a transaction that did not commit closes its connection instead of
/// returning it: closing makes SQLite discard whatever was left of the transaction, and the pool
/// opens a fresh connection when it needs one, so one fault never outlives its request.
struct WriteTx {
    conn: sqlx::pool::PoolConnection<sqlx::Any>,
    /// Ended cleanly (committed or rolled back on purpose): the connection may be reused.
    committed: bool,
}

impl WriteTx {
    async fn begin(store: &Store) -> Result<WriteTx, StoreError> {
        let mut conn = store.pool.acquire().await?;
        // PostgreSQL: READ COMMITTED. Every transaction that appends messages first updates the
        // conversation's row (`touch`), whose row lock orders writers of one conversation the way
        // SQLite's single write lock orders all of them.
        let begin = match store.backend {
            Backend::Sqlite => "BEGIN IMMEDIATE",
            Backend::Postgres => "BEGIN",
        };
        if let Err(e) = sqlx::query(begin).execute(&mut *conn).await {
            conn.close_on_drop();
            return Err(e.into());
        }
        Ok(WriteTx {
            conn,
            committed: false,
        })
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        sqlx::query("COMMIT").execute(&mut *self.conn).await?;
        self.committed = true;
        Ok(())
    }

    /// Ends a transaction that changed nothing worth keeping (an unknown id) and keeps the
    /// connection: an in-memory database lives in its one connection, so that one must not be
    /// closed for an ordinary "not found".
    async fn rollback(mut self) -> Result<(), StoreError> {
        sqlx::query("ROLLBACK").execute(&mut *self.conn).await?;
        self.committed = true;
        Ok(())
    }
}

impl std::ops::Deref for WriteTx {
    type Target = sqlx::AnyConnection;
    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}

impl Drop for WriteTx {
    fn drop(&mut self) {
        if !self.committed {
            self.conn.close_on_drop();
        }
    }
}

fn create_parent_dir(file: &Path) -> Result<(), StoreError> {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.exists() => std::fs::create_dir_all(dir)
            .map_err(|source| StoreError::CreateDir {
                path: dir.to_path_buf(),
                source,
            }),
        _ => Ok(()),
    }
}

fn now_micros() -> i64 {
    Utc::now().timestamp_micros()
}

fn encode_json<T: serde::Serialize>(what: &'static str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|source| StoreError::Encode { what, source })
}

fn corrupt(table: &'static str, id: &str, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        table,
        id: id.to_string(),
        detail: detail.into(),
    }
}

fn parse_uuid(table: &'static str, row_id: &str, value: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(value).map_err(|e| corrupt(table, row_id, format!("bad id {value:?}: {e}")))
}

fn parse_time(table: &'static str, row_id: &str, micros: i64) -> Result<DateTime<Utc>, StoreError> {
    DateTime::from_timestamp_micros(micros)
        .ok_or_else(|| corrupt(table, row_id, format!("timestamp {micros} out of range")))
}

/// The largest token count a message may record (a reply's prompt, completion or cached
/// tokens): far above any context window, and low enough that summing every message of any
/// database stays inside a 64-bit integer. Imports refuse larger counts; sums cap each value
/// at it.
pub const MAX_TOKEN_COUNT: i64 = 2_147_483_647;

/// The shortest search text looked for inside messages (the trigram index's window); shorter
/// text matches conversation titles only.
pub const SEARCH_INDEX_MIN_CHARS: usize = 3;

/// `text` as a literal inside a LIKE pattern whose escape character is PostgreSQL's default
/// backslash.
fn like_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_titles_are_kept() {
        assert_eq!(derive_title("  Hello there  \nsecond line"), "Hello there");
        assert_eq!(derive_title("\n\n  \n  first real line"), "first real line");
        assert_eq!(derive_title("   \n\t"), "");
        assert_eq!(derive_title("a\t\tb   c"), "a b c");
    }

    #[test]
    fn long_titles_are_cut_on_char_boundaries() {
        let cjk = "日本語のテキスト".repeat(20);
        let title = derive_title(&cjk);
        assert!(title.ends_with('…'));
        assert_eq!(title.chars().count(), TITLE_MAX_CHARS);

        let words = "word ".repeat(40);
        let title = derive_title(&words);
        assert!(title.ends_with("word…"), "{title}");
        assert!(title.chars().count() <= TITLE_MAX_CHARS);
    }

    #[test]
    fn settings_json_round_trips_and_fills_defaults() {
        let s = ConversationSettings {
            seed: Some(u64::MAX),
            pinned_date: chrono::NaiveDate::from_ymd_opt(2025, 7, 8).unwrap(),
            ..Default::default()
        };
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"pinned_date\":\"2025-07-08\""), "{json}");
        assert_eq!(
            serde_json::from_str::<ConversationSettings>(&json).unwrap(),
            s
        );
        let partial: ConversationSettings = serde_json::from_str(r#"{"top_k": 5}"#).unwrap();
        assert_eq!(partial.top_k, 5);
        assert!(partial.thinking);
    }
}
