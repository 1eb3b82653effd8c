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

    pub async fn create_conversation(
        &self,
        owner: &str,
        settings: &ConversationSettings,
    ) -> Result<Conversation, StoreError> {
        self.create_conversation_with_id(Uuid::now_v7(), owner, settings)
            .await
    }

    /// [`Store::create_conversation`] under a given new id (a UUIDv7 the caller picked, e.g. one
    /// the replica router sends to this replica).
    pub async fn create_conversation_with_id(
        &self,
        id: Uuid,
        owner: &str,
        settings: &ConversationSettings,
    ) -> Result<Conversation, StoreError> {
        settings.validate().map_err(StoreError::InvalidSettings)?;
        let settings_json = encode_json("settings", settings)?;
        let now = now_micros();
        let row: ConversationRow = sqlx::query_as(concat!(
            "INSERT INTO conversations (id, owner, title, settings, created_at, updated_at) \
             VALUES ($1, $2, '', $3, $4, $4) RETURNING ",
            conversation_columns!()
        ))
        .bind(id.to_string())
        .bind(owner)
        .bind(settings_json)
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        let conversation = row.into_conversation()?;
        tracing::debug!(conversation = %conversation.id, owner, "conversation created");
        Ok(conversation)
    }

    pub async fn get_conversation(&self, id: Uuid) -> Result<Option<Conversation>, StoreError> {
        let row: Option<ConversationRow> = sqlx::query_as(concat!(
            "SELECT ",
            conversation_columns!(),
            " FROM conversations WHERE id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.map(ConversationRow::into_conversation).transpose()
    }

    /// All of `owner`'s conversations, most recently active first, page after page of
    /// [`Store::list_conversations_page`] (tools and tests; the web layer shows one page).
    pub async fn list_conversations(
        &self,
        owner: &str,
        search: Option<&str>,
    ) -> Result<Vec<ConversationSummary>, StoreError> {
        let filter = ListFilter {
            search: search.map(str::to_string),
            ..ListFilter::default()
        };
        let mut all = Vec::new();
        let mut page = PageRequest {
            limit: MAX_PAGE,
            before: None,
        };
        loop {
            let got = self.list_conversations_page(owner, &filter, &page).await?;
            all.extend(got.items);
            match got.next {
                Some(next) => page.before = Some(next),
                None => return Ok(all),
            }
        }
    }

    /// One page of `owner`'s conversations, most recently active first: at most `page.limit`
    /// of them after `page.before` (keyset pagination on `(updated_at, id)`, so a page never
    /// repeats or skips a conversation however many are added meanwhile), with the cursor of
    /// the next page when there is one. `search` keeps those whose title or any message contains
    /// it, ignoring case; a blank `search` is no filter. The needle is plain text: `%`, `_` and
    /// quotes match themselves.
    ///
    /// Messages are searched through the trigram index of migration 0005 (SQLite FTS5, pg_trgm),
    /// which finds substrings of [`SEARCH_INDEX_MIN_CHARS`] or more characters; shorter search
    /// text matches titles only, since it would need a scan of every message.
    ///
    /// The rest of `filter` keeps archived or unarchived, pinned or unpinned conversations, those
    /// in one folder, or those with one tag.
    pub async fn list_conversations_page(
        &self,
        owner: &str,
        filter: &ListFilter,
        page: &PageRequest,
    ) -> Result<ListPage, StoreError> {
        let search = filter
            .search
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty());
        let limit = page.limit.clamp(1, MAX_PAGE);
        let (before_at, before_id) = cursor_binds(page.before.as_ref());
        // The message half of the search, bound as $6: an FTS5 phrase (SQLite) or an ILIKE
        // pattern (PostgreSQL); NULL when the needle is too short for the index.
        let indexed = search.filter(|s| s.chars().count() >= SEARCH_INDEX_MIN_CHARS);
        let message_needle = indexed.map(|s| match self.backend {
            Backend::Sqlite => format!("\"{}\"", s.replace('"', "\"\"")),
            Backend::Postgres => format!("%{}%", like_escape(s)),
        });
        macro_rules! page_query {
            ($find:literal, $messages:literal) => {
                concat!(
                    "SELECT ",
                    summary_columns!(),
                    " FROM conversations c WHERE c.owner = $1 AND ($2 IS NULL \
                       OR ",
                    $find,
                    "(lower(c.title), lower($2)) > 0 \
                       OR ($6 IS NOT NULL AND c.id IN (",
                    $messages,
                    "))) \
                       AND ($3 IS NULL OR c.updated_at < $3 OR (c.updated_at = $3 AND c.id < $4)) \
                       AND ($7 IS NULL OR c.archived = $7) AND ($8 IS NULL OR c.pinned = $8) \
                       AND ($9 IS NULL OR c.folder_id = $9) \
                       AND ($10 IS NULL OR EXISTS (SELECT 1 FROM conversation_tags t \
                            WHERE t.conversation_id = c.id AND t.tag = $10)) \
                     ORDER BY c.updated_at DESC, c.id DESC LIMIT $5"
                )
            };
        }
        let query = match self.backend {
            Backend::Sqlite => page_query!(
                "instr",
                "SELECT m.conversation_id FROM messages m WHERE m.rowid IN \
                 (SELECT rowid FROM messages_fts WHERE messages_fts MATCH $6)"
            ),
            Backend::Postgres => page_query!(
                "strpos",
                "SELECT m.conversation_id FROM messages m WHERE m.content ILIKE $6"
            ),
        };
        let rows: Vec<SummaryRow> = sqlx::query_as(query)
            .bind(owner)
            .bind(search)
            .bind(before_at)
            .bind(before_id)
            .bind((limit + 1) as i64)
            .bind(message_needle)
            .bind(filter.archived.map(i64::from))
            .bind(filter.pinned.map(i64::from))
            .bind(filter.folder.map(|f| f.to_string()))
            .bind(filter.tag.as_deref())
            .fetch_all(&self.pool)
            .await?;
        into_page(rows, limit)
    }

    /// One page of every owner's conversations, most recently active first (the admin page);
    /// keyset pagination as in [`Store::list_conversations_page`].
    pub async fn list_all_conversations_page(
        &self,
        page: &PageRequest,
    ) -> Result<ListPage, StoreError> {
        let limit = page.limit.clamp(1, MAX_PAGE);
        let (before_at, before_id) = cursor_binds(page.before.as_ref());
        let rows: Vec<SummaryRow> = sqlx::query_as(concat!(
            "SELECT ",
            summary_columns!(),
            " FROM conversations c \
             WHERE ($1 IS NULL OR c.updated_at < $1 OR (c.updated_at = $1 AND c.id < $2)) \
             ORDER BY c.updated_at DESC, c.id DESC LIMIT $3"
        ))
        .bind(before_at)
        .bind(before_id)
        .bind((limit + 1) as i64)
        .fetch_all(&self.pool)
        .await?;
        into_page(rows, limit)
    }

    /// Bytes of text `owner` keeps stored: every message's content, reasoning and raw text.
    pub async fn stored_text_bytes(&self, owner: &str) -> Result<u64, StoreError> {
        let query = match self.backend {
            Backend::Sqlite => {
                "SELECT CAST(COALESCE(SUM(length(CAST(m.content AS BLOB)) \
                   + COALESCE(length(CAST(m.reasoning AS BLOB)), 0) \
                   + COALESCE(length(CAST(m.raw AS BLOB)), 0)), 0) AS BIGINT) \
                 FROM messages m JOIN conversations c ON c.id = m.conversation_id \
                 WHERE c.owner = $1"
            }
            Backend::Postgres => {
                "SELECT CAST(COALESCE(SUM(octet_length(m.content) \
                   + COALESCE(octet_length(m.reasoning), 0) \
                   + COALESCE(octet_length(m.raw), 0)), 0) AS BIGINT) \
                 FROM messages m JOIN conversations c ON c.id = m.conversation_id \
                 WHERE c.owner = $1"
            }
        };
        let n: i64 = sqlx::query_scalar(query)
            .bind(owner)
            .fetch_one(&self.pool)
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// How many conversations `owner` has stored.
    pub async fn count_conversations(&self, owner: &str) -> Result<i64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM conversations WHERE owner = $1")
            .bind(owner)
            .fetch_one(&self.pool)
            .await?;
        Ok(n)
    }

    /// Stores an imported conversation for `owner` in one transaction: a new conversation (new
    /// id, created now) with `title` and `settings`, and `messages` in their order with new ids
    /// and everything else as given. Nothing is stored if any row fails. The caller has
    /// validated the content; a `streaming` message is refused here (no reply is running for
    /// it).
    pub async fn import_conversation(
        &self,
        owner: &str,
        title: &str,
        settings: &ConversationSettings,
        messages: &[ImportedMessage],
    ) -> Result<Conversation, StoreError> {
        let rows = StoredRow::linear(messages.len(), |_| true);
        self.insert_conversation(Uuid::now_v7(), owner, title, settings, messages, &rows)
            .await
    }

    /// Stores a whole conversation under `id` in one transaction, as
    /// [`Store::import_conversation`] does, with each message's id, `imported` flag (`false`: the
    /// model wrote it) and parent given in `rows`; the conversation shows the branch of the
    /// last row that is a leaf of it ([`StoredRow::current`]), else of the last message. The
    /// Responses API stores each response this way, an export of version 2 imports this way.
    pub async fn insert_conversation(
        &self,
        id: Uuid,
        owner: &str,
        title: &str,
        settings: &ConversationSettings,
        messages: &[ImportedMessage],
        rows: &[StoredRow],
    ) -> Result<Conversation, StoreError> {
        if rows.len() != messages.len() {
            return Err(StoreError::RowsMismatch {
                messages: messages.len(),
                rows: rows.len(),
            });
        }
        if let Some((i, _)) = rows
            .iter()
            .enumerate()
            .find(|(i, r)| r.parent.is_some_and(|p| p >= *i))
        {
            return Err(StoreError::BadTree(format!(
                "message {i} follows a message that is not before it"
            )));
        }
        settings.validate().map_err(StoreError::InvalidSettings)?;
        if messages
            .iter()
            .any(|m| m.status == MessageStatus::Streaming)
        {
            return Err(StoreError::InvalidStatus(MessageStatus::Streaming.as_str()));
        }
        let settings_json = encode_json("settings", settings)?;
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        let row: ConversationRow = sqlx::query_as(concat!(
            "INSERT INTO conversations (id, owner, title, settings, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $5) RETURNING ",
            conversation_columns!()
        ))
        .bind(id.to_string())
        .bind(owner)
        .bind(title)
        .bind(settings_json)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        for (i, m) in messages.iter().enumerate() {
            let timings = m
                .timings
                .as_ref()
                .map(|t| encode_json("timings", &t.sanitized()))
                .transpose()?;
            sqlx::query(
                "INSERT INTO messages (id, conversation_id, position, role, content, reasoning, \
                 raw, status, error, prompt_tokens, completion_tokens, cached_tokens, timings, \
                 created_at, imported, parent_id) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)",
            )
            .bind(rows[i].id.to_string())
            .bind(id.to_string())
            .bind(i as i64 + 1)
            .bind(m.role.as_str())
            .bind(&m.content)
            .bind(m.reasoning.as_deref())
            .bind(m.raw.as_deref())
            .bind(m.status.as_str())
            .bind(m.error.as_deref())
            .bind(m.prompt_tokens)
            .bind(m.completion_tokens)
            .bind(m.cached_tokens)
            .bind(timings)
            .bind(m.created_at.timestamp_micros())
            .bind(i64::from(rows[i].imported))
            .bind(rows[i].parent.map(|p| rows[p].id.to_string()))
            .execute(&mut *tx)
            .await?;
            for f in &m.files {
                sqlx::query(
                    "INSERT INTO files (id, conversation_id, message_id, owner, name, kind, \
                     media_type, size_bytes, text, tokens, created_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                )
                .bind(Uuid::now_v7().to_string())
                .bind(id.to_string())
                .bind(rows[i].id.to_string())
                .bind(owner)
                .bind(&f.name)
                .bind(&f.kind)
                .bind(&f.media_type)
                .bind(f.size_bytes)
                .bind(&f.text)
                .bind(f.tokens)
                .bind(m.created_at.timestamp_micros())
                .execute(&mut *tx)
                .await?;
            }
        }
        let leaf = rows
            .iter()
            .rposition(|r| r.current)
            .or_else(|| rows.len().checked_sub(1));
        if let Some(leaf) = leaf {
            set_leaf(&mut tx, id, rows[leaf].id).await?;
        }
        tx.commit().await?;
        let conversation = row.into_conversation()?;
        tracing::debug!(conversation = %conversation.id, owner, messages = messages.len(), "conversation stored whole");
        Ok(conversation)
    }

    /// Every conversation of every owner, most recently active first, page after page of
    /// [`Store::list_all_conversations_page`] (tools and tests).
    pub async fn list_all_conversations(&self) -> Result<Vec<ConversationSummary>, StoreError> {
        let mut all = Vec::new();
        let mut page = PageRequest {
            limit: MAX_PAGE,
            before: None,
        };
        loop {
            let got = self.list_all_conversations_page(&page).await?;
            all.extend(got.items);
            match got.next {
                Some(next) => page.before = Some(next),
                None => return Ok(all),
            }
        }
    }

    /// Sets the title as given (the caller trims and limits it). `false` when there is no such
    /// conversation.
    pub async fn rename_conversation(&self, id: Uuid, title: &str) -> Result<bool, StoreError> {
        let result =
            sqlx::query("UPDATE conversations SET title = $1, updated_at = $2 WHERE id = $3")
                .bind(title)
                .bind(now_micros())
                .bind(id.to_string())
                .execute(&self.pool)
                .await?;
        Ok(result.rows_affected() > 0)
    }

    /// Replaces the settings. `false` when there is no such conversation.
    pub async fn update_settings(
        &self,
        id: Uuid,
        settings: &ConversationSettings,
    ) -> Result<bool, StoreError> {
        settings.validate().map_err(StoreError::InvalidSettings)?;
        let settings_json = encode_json("settings", settings)?;
        let result =
            sqlx::query("UPDATE conversations SET settings = $1, updated_at = $2 WHERE id = $3")
                .bind(settings_json)
                .bind(now_micros())
                .bind(id.to_string())
                .execute(&self.pool)
                .await?;
        Ok(result.rows_affected() > 0)
    }

    /// Deletes the conversation and (ON DELETE CASCADE) its messages. `false` when there is no
    /// such conversation.
    pub async fn delete_conversation(&self, id: Uuid) -> Result<bool, StoreError> {
        let result = sqlx::query("DELETE FROM conversations WHERE id = $1")
            .bind(id.to_string())
            .execute(&self.pool)
            .await?;
        let deleted = result.rows_affected() > 0;
        if deleted {
            tracing::debug!(conversation = %id, "conversation deleted");
        }
        Ok(deleted)
    }

    /// The messages of a conversation in order (empty for an unknown conversation).
    pub async fn messages(&self, conversation: Uuid) -> Result<Vec<Message>, StoreError> {
        let rows: Vec<MessageRow> = sqlx::query_as(concat!(
            "SELECT ",
            message_columns!(),
            " FROM messages WHERE conversation_id = $1 ORDER BY position"
        ))
        .bind(conversation.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(MessageRow::into_message).collect()
    }

    pub async fn get_message(&self, id: Uuid) -> Result<Option<Message>, StoreError> {
        let row: Option<MessageRow> = sqlx::query_as(concat!(
            "SELECT ",
            message_columns!(),
            " FROM messages WHERE id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.map(MessageRow::into_message).transpose()
    }

    /// Commits the user's message (durably, before returning) and bumps `updated_at`. When the
    /// conversation has no title yet, derives one from this message ([`derive_title`]).
    /// [`StoreError::ConversationNotFound`] when the conversation does not exist.
    pub async fn insert_user_message(
        &self,
        conversation: Uuid,
        content: &str,
    ) -> Result<Message, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, Some(content)).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        let leaf = current_leaf(&mut tx, conversation).await?;
        let row = insert_message(
            &mut tx,
            conversation,
            leaf,
            Role::User,
            content,
            MessageStatus::Complete,
            now,
            None,
        )
        .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// Inserts an assistant message with status `streaming` and empty content: the reply being
    /// generated. [`StoreError::ConversationNotFound`] when the conversation does not exist.
    pub async fn start_assistant_message(&self, conversation: Uuid) -> Result<Message, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, None).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        let leaf = current_leaf(&mut tx, conversation).await?;
        let row = insert_message(
            &mut tx,
            conversation,
            leaf,
            Role::Assistant,
            "",
            MessageStatus::Streaming,
            now,
            self.replica_id(),
        )
        .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// A new reply being generated for the user message `to` (regenerate): a sibling of the
    /// replies it has, which are kept. It becomes what the conversation shows.
    /// [`StoreError::MessageNotFound`] when `to` is not a user message of the conversation.
    pub async fn insert_reply(&self, conversation: Uuid, to: Uuid) -> Result<Message, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, None).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        if let Err(e) = parent_of(&mut tx, conversation, to, Role::User).await {
            tx.rollback().await?;
            return Err(e);
        }
        let row = insert_message(
            &mut tx,
            conversation,
            Some(to),
            Role::Assistant,
            "",
            MessageStatus::Streaming,
            now,
            self.replica_id(),
        )
        .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// The branch a conversation shows: the path from its first message to its current leaf,
    /// in order (every message of an older database, whose conversations are one branch).
    pub async fn branch(&self, conversation: Uuid) -> Result<Vec<Message>, StoreError> {
        Ok(self.messages_and_branch(conversation).await?.1)
    }

    /// Every message of a conversation (all branches, in insertion order) and the branch it
    /// shows ([`Store::branch`]), read once.
    pub async fn messages_and_branch(
        &self,
        conversation: Uuid,
    ) -> Result<(Vec<Message>, Vec<Message>), StoreError> {
        let all = self.messages(conversation).await?;
        let leaf: Option<Option<String>> =
            sqlx::query_scalar("SELECT current_leaf FROM conversations WHERE id = $1")
                .bind(conversation.to_string())
                .fetch_optional(&self.pool)
                .await?;
        let leaf = leaf
            .flatten()
            .and_then(|l| Uuid::parse_str(&l).ok())
            .or_else(|| all.last().map(|m| m.id));
        let branch = path_to(&all, leaf);
        Ok((all, branch))
    }

    /// Shows the branch through `message`: down to the newest message written after it (where
    /// the conversation was last continued from there, so switching back to a version returns
    /// to where one left it). Returns that leaf. [`StoreError::MessageNotFound`] when the
    /// message is not of the conversation.
    pub async fn select_branch(
        &self,
        conversation: Uuid,
        message: Uuid,
    ) -> Result<Uuid, StoreError> {
        let all = self.messages(conversation).await?;
        if !all.iter().any(|m| m.id == message) {
            return Err(StoreError::MessageNotFound(message));
        }
        // Messages come in insertion order, so a parent is always before its children: one
        // pass collects the subtree, and its last member is the newest (a leaf: anything after
        // it in the subtree would be its child, and newer).
        let mut subtree = std::collections::HashSet::from([message]);
        let mut leaf = message;
        for m in &all {
            if m.parent_id.is_some_and(|p| subtree.contains(&p)) {
                subtree.insert(m.id);
                leaf = m.id;
            }
        }
        let mut tx = WriteTx::begin(self).await?;
        set_leaf(&mut tx, conversation, leaf).await?;
        tx.commit().await?;
        Ok(leaf)
    }

    /// Stores a reply's final state (content, reasoning, raw text, status, error, token counts,
    /// timings) and bumps the conversation's `updated_at`. The status must not be `streaming`.
    /// [`StoreError::MessageNotFound`] when `id` is not an assistant message.
    pub async fn finish_assistant_message(
        &self,
        id: Uuid,
        reply: &FinishedReply,
    ) -> Result<Message, StoreError> {
        if reply.status == MessageStatus::Streaming {
            return Err(StoreError::InvalidStatus(reply.status.as_str()));
        }
        let timings = encode_json("timings", &reply.timings.sanitized())?;
        let mut tx = WriteTx::begin(self).await?;
        let row: Option<MessageRow> = sqlx::query_as(concat!(
            "UPDATE messages SET content = $1, reasoning = $2, raw = $3, status = $4, error = $5, \
             prompt_tokens = $6, completion_tokens = $7, cached_tokens = $8, timings = $9 \
             WHERE id = $10 AND role = 'assistant' RETURNING ",
            message_columns!()
        ))
        .bind(&reply.content)
        .bind(reply.reasoning.as_deref())
        .bind(&reply.raw)
        .bind(reply.status.as_str())
        .bind(reply.error.as_deref())
        .bind(reply.prompt_tokens)
        .bind(reply.completion_tokens)
        .bind(reply.cached_tokens)
        .bind(timings)
        .bind(id.to_string())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            tx.rollback().await?;
            return Err(StoreError::MessageNotFound(id));
        };
        sqlx::query("UPDATE conversations SET updated_at = $1 WHERE id = $2")
            .bind(now_micros())
            .bind(&row.conversation_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// Stores one exchange in a single transaction: the user message and the assistant reply
    /// that starts `streaming` for it. It continues the branch shown, or with `editing` it is
    /// a new version of that user message (a sibling of it, which is kept: a new branch from
    /// the same point). A failure at any point changes nothing.
    /// [`StoreError::ConversationNotFound`] for an unknown conversation,
    /// [`StoreError::MessageNotFound`] when `editing` is not a user message of it.
    ///
    /// `attachments` gives the user message its prompt text and files (see [`Attachments`]); a
    /// file that is not a pending file of this conversation fails it all
    /// ([`StoreError::FileNotFound`]).
    pub async fn insert_exchange(
        &self,
        conversation: Uuid,
        content: &str,
        editing: Option<Uuid>,
        attachments: &Attachments,
    ) -> Result<(Message, Message), StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, Some(content)).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        let parent = match editing {
            Some(from) => match parent_of(&mut tx, conversation, from, Role::User).await {
                Ok(p) => p,
                Err(e) => {
                    tx.rollback().await?;
                    return Err(e);
                }
            },
            None => current_leaf(&mut tx, conversation).await?,
        };
        let user = insert_message(
            &mut tx,
            conversation,
            parent,
            Role::User,
            content,
            MessageStatus::Complete,
            now,
            None,
        )
        .await?;
        let user_id = parse_uuid("messages", &user.id, &user.id)?;
        let user = if attachments.is_empty() {
            user
        } else {
            if let Err(e) = files::attach(&mut tx, conversation, user_id, attachments).await {
                tx.rollback().await?;
                return Err(e);
            }
            MessageRow {
                raw: attachments.raw.clone().or(user.raw),
                ..user
            }
        };
        let assistant = insert_message(
            &mut tx,
            conversation,
            Some(user_id),
            Role::Assistant,
            "",
            MessageStatus::Streaming,
            now,
            self.replica_id(),
        )
        .await?;
        tx.commit().await?;
        Ok((user.into_message()?, assistant.into_message()?))
    }

    /// Saves the text generated so far of a reply that is still `streaming`, so a crash keeps it
    /// (start-up marks it `interrupted` with this text). Returns whether a row was updated.
    pub async fn save_partial_reply(
        &self,
        id: Uuid,
        content: &str,
        reasoning: Option<&str>,
        raw: &str,
    ) -> Result<bool, StoreError> {
        let updated = sqlx::query(
            "UPDATE messages SET content = $1, reasoning = $2, raw = $3 \
             WHERE id = $4 AND role = 'assistant' AND status = 'streaming'",
        )
        .bind(content)
        .bind(reasoning)
        .bind(raw)
        .bind(id.to_string())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(updated > 0)
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

/// Makes `leaf` the message a conversation shows (its branch ends there).
async fn set_leaf(tx: &mut WriteTx, conversation: Uuid, leaf: Uuid) -> Result<(), StoreError> {
    sqlx::query("UPDATE conversations SET current_leaf = $1 WHERE id = $2")
        .bind(leaf.to_string())
        .bind(conversation.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The message a conversation shows, read inside a write transaction.
async fn current_leaf(tx: &mut WriteTx, conversation: Uuid) -> Result<Option<Uuid>, StoreError> {
    let leaf: Option<Option<String>> =
        sqlx::query_scalar("SELECT current_leaf FROM conversations WHERE id = $1")
            .bind(conversation.to_string())
            .fetch_optional(&mut **tx)
            .await?;
    leaf.flatten()
        .map(|l| parse_uuid("conversations", &conversation.to_string(), &l))
        .transpose()
}

/// A message of `conversation` with `role`, read inside a write transaction: its parent.
/// `MessageNotFound` when there is none.
async fn parent_of(
    tx: &mut WriteTx,
    conversation: Uuid,
    message: Uuid,
    role: Role,
) -> Result<Option<Uuid>, StoreError> {
    let row: Option<Option<String>> = sqlx::query_scalar(
        "SELECT parent_id FROM messages WHERE id = $1 AND conversation_id = $2 AND role = $3",
    )
    .bind(message.to_string())
    .bind(conversation.to_string())
    .bind(role.as_str())
    .fetch_optional(&mut **tx)
    .await?;
    match row {
        None => Err(StoreError::MessageNotFound(message)),
        Some(parent) => parent
            .map(|p| parse_uuid("messages", &message.to_string(), &p))
            .transpose(),
    }
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

#[allow(clippy::too_many_arguments)]
async fn insert_message(
    tx: &mut WriteTx,
    conversation: Uuid,
    parent: Option<Uuid>,
    role: Role,
    content: &str,
    status: MessageStatus,
    created_at: i64,
    replica: Option<Uuid>,
) -> Result<MessageRow, StoreError> {
    let inserted: Result<MessageRow, sqlx::Error> = sqlx::query_as(concat!(
        "INSERT INTO messages (id, conversation_id, position, role, content, status, created_at, \
         replica_id, parent_id) \
         SELECT $1, $2, COALESCE(MAX(position), 0) + 1, $3, $4, $5, $6, $7, $8 \
         FROM messages WHERE conversation_id = $2 RETURNING ",
        message_columns!()
    ))
    .bind(Uuid::now_v7().to_string())
    .bind(conversation.to_string())
    .bind(role.as_str())
    .bind(content)
    .bind(status.as_str())
    .bind(created_at)
    .bind(
        (status == MessageStatus::Streaming)
            .then_some(replica)
            .flatten()
            .map(|r| r.to_string()),
    )
    .bind(parent.map(|p| p.to_string()))
    .fetch_one(&mut **tx)
    .await;
    match inserted {
        Ok(row) => {
            // The new message is what the conversation shows now.
            let id = parse_uuid("messages", &row.id, &row.id)?;
            set_leaf(tx, conversation, id).await?;
            Ok(row)
        }
        // `messages_one_streaming`: another reply of this conversation is streaming (on any
        // replica).
        Err(sqlx::Error::Database(e))
            if status == MessageStatus::Streaming && e.is_unique_violation() =>
        {
            Err(StoreError::ReplyInProgress(conversation))
        }
        Err(e) => Err(e.into()),
    }
}

/// The `(updated_at, id)` bind values of a cursor (both NULL for the first page).
fn cursor_binds(cursor: Option<&Cursor>) -> (Option<i64>, Option<String>) {
    match cursor {
        Some(c) => (Some(c.updated_at_micros), Some(c.id.to_string())),
        None => (None, None),
    }
}

/// Rows of a page query fetched with `limit + 1`: the first `limit`, and the next page's cursor
/// when the extra row shows there is more.
fn into_page(rows: Vec<SummaryRow>, limit: usize) -> Result<ListPage, StoreError> {
    let more = rows.len() > limit;
    let items: Vec<ConversationSummary> = rows
        .into_iter()
        .take(limit)
        .map(SummaryRow::into_summary)
        .collect::<Result<_, _>>()?;
    let next = if more {
        items.last().map(|c| Cursor {
            updated_at_micros: c.updated_at.timestamp_micros(),
            id: c.id,
        })
    } else {
        None
    };
    Ok(ListPage { items, next })
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

#[derive(sqlx::FromRow)]
struct ConversationRow {
    id: String,
    owner: String,
    title: String,
    settings: String,
    created_at: i64,
    updated_at: i64,
}

impl ConversationRow {
    fn into_conversation(self) -> Result<Conversation, StoreError> {
        const T: &str = "conversations";
        let settings = serde_json::from_str(&self.settings)
            .map_err(|e| corrupt(T, &self.id, format!("bad settings JSON: {e}")))?;
        Ok(Conversation {
            id: parse_uuid(T, &self.id, &self.id)?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            updated_at: parse_time(T, &self.id, self.updated_at)?,
            owner: self.owner,
            title: self.title,
            settings,
        })
    }
}

#[derive(sqlx::FromRow)]
struct SummaryRow {
    id: String,
    owner: String,
    title: String,
    message_count: i64,
    created_at: i64,
    updated_at: i64,
    pinned: i64,
    archived: i64,
    folder_id: Option<String>,
}

impl SummaryRow {
    fn into_summary(self) -> Result<ConversationSummary, StoreError> {
        const T: &str = "conversations";
        Ok(ConversationSummary {
            id: parse_uuid(T, &self.id, &self.id)?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            updated_at: parse_time(T, &self.id, self.updated_at)?,
            folder_id: self
                .folder_id
                .map(|f| parse_uuid(T, &self.id, &f))
                .transpose()?,
            pinned: self.pinned != 0,
            archived: self.archived != 0,
            owner: self.owner,
            title: self.title,
            message_count: self.message_count,
        })
    }
}

#[derive(sqlx::FromRow)]
struct MessageRow {
    id: String,
    conversation_id: String,
    position: i64,
    role: String,
    content: String,
    reasoning: Option<String>,
    raw: Option<String>,
    status: String,
    error: Option<String>,
    prompt_tokens: Option<i64>,
    completion_tokens: Option<i64>,
    cached_tokens: Option<i64>,
    timings: Option<String>,
    created_at: i64,
    imported: i64,
    parent_id: Option<String>,
}

impl MessageRow {
    fn into_message(self) -> Result<Message, StoreError> {
        const T: &str = "messages";
        let timings = self
            .timings
            .as_deref()
            .map(serde_json::from_str::<Timings>)
            .transpose()
            .map_err(|e| corrupt(T, &self.id, format!("bad timings JSON: {e}")))?;
        Ok(Message {
            id: parse_uuid(T, &self.id, &self.id)?,
            conversation_id: parse_uuid(T, &self.id, &self.conversation_id)?,
            position: self.position,
            role: self
                .role
                .parse()
                .map_err(|e: String| corrupt(T, &self.id, e))?,
            status: self
                .status
                .parse()
                .map_err(|e: String| corrupt(T, &self.id, e))?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            content: self.content,
            reasoning: self.reasoning,
            raw: self.raw,
            error: self.error,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: self.cached_tokens,
            timings,
            imported: self.imported != 0,
            parent_id: self
                .parent_id
                .as_deref()
                .map(|p| parse_uuid(T, &self.id, p))
                .transpose()?,
        })
    }
}

/// The path from the root to `leaf` through `parent_id`s, in order (empty without a leaf).
pub fn path_to(all: &[Message], leaf: Option<Uuid>) -> Vec<Message> {
    let by_id: std::collections::HashMap<Uuid, &Message> = all.iter().map(|m| (m.id, m)).collect();
    let mut path = Vec::new();
    let mut at = leaf.and_then(|l| by_id.get(&l).copied());
    // Bounded by the number of messages, whatever the rows say.
    while let Some(m) = at.filter(|_| path.len() < all.len()) {
        path.push(m.clone());
        at = m.parent_id.and_then(|p| by_id.get(&p).copied());
    }
    path.reverse();
    path
}

/// How [`Store::insert_conversation`] stores one message: its id, whether it was imported, the
/// index of the message it follows (an earlier one; `None`: a first message), and whether it
/// is the leaf the conversation shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredRow {
    pub id: Uuid,
    pub imported: bool,
    pub parent: Option<usize>,
    pub current: bool,
}

impl StoredRow {
    /// `n` messages in one branch, each following the one before, new ids, the last shown.
    pub fn linear(n: usize, imported: impl Fn(usize) -> bool) -> Vec<StoredRow> {
        (0..n)
            .map(|i| StoredRow {
                id: Uuid::now_v7(),
                imported: imported(i),
                parent: i.checked_sub(1),
                current: i + 1 == n,
            })
            .collect()
    }
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
