//! `StoreError`, the one error type of the persistence layer.

use std::path::PathBuf;

use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid database URL {url:?}: {reason} (expected e.g. \"sqlite://data/smolchat.db\", \"sqlite::memory:\" or \"postgres://user:password@host/database\")")]
    Url { url: String, reason: String },

    #[error("cannot create the database directory {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot open the database {url:?}: {source}")]
    Open {
        url: String,
        #[source]
        source: sqlx::Error,
    },

    #[error("cannot apply the database migrations: {0} (is the database from a newer smolchat?)")]
    Migrate(#[from] sqlx::migrate::MigrateError),

    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),

    #[error("conversation {0} does not exist")]
    ConversationNotFound(Uuid),

    /// Usage for an account or key that was deleted (a request that finished just after the
    /// delete): nothing is written for it.
    #[error("{0} no longer exists; its usage is not recorded")]
    OwnerGone(String),

    /// Another reply of the conversation is still `streaming` (perhaps on another replica).
    #[error("a reply is already being generated in conversation {0}")]
    ReplyInProgress(Uuid),

    #[error("there is no assistant message {0}")]
    MessageNotFound(Uuid),

    /// The owner already has a folder or preset by that name.
    #[error("there is already a {what} named {name:?}; choose another name")]
    NameTaken { what: &'static str, name: String },

    #[error("file {0} is not a file waiting in this conversation")]
    FileNotFound(Uuid),

    #[error("folder {0} does not exist")]
    FolderNotFound(Uuid),

    #[error("the messages do not form a tree: {0}")]
    BadTree(String),

    #[error("{messages} messages to store but {rows} ids and flags for them")]
    RowsMismatch { messages: usize, rows: usize },

    #[error("invalid conversation settings: {0}")]
    InvalidSettings(String),

    #[error(
        "a finished reply cannot have status `{0}`; use complete, stopped, interrupted or error"
    )]
    InvalidStatus(&'static str),

    /// A row the store cannot read back: written by something else, or a damaged file.
    #[error("corrupt {table} row {id:?}: {detail}")]
    Corrupt {
        table: &'static str,
        id: String,
        detail: String,
    },

    /// `pg_dump` or `pg_restore` could not run, or failed.
    #[error("{tool}: {reason}")]
    BackupTool { tool: String, reason: String },

    #[error("backup target {}: {reason}", path.display())]
    BackupTarget { path: PathBuf, reason: String },

    #[error("the backup {} failed its integrity check: {findings}", path.display())]
    BackupDamaged { path: PathBuf, findings: String },

    #[error("cannot encode {what} as JSON: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl StoreError {
    /// The database cannot be written or reached right now for a reason outside the request:
    /// the disk is full, the file or its file system is read-only, another process held the
    /// write lock past the busy timeout, an I/O error. Nothing was stored; the same request may
    /// succeed once the fault is gone, so callers answer "try again later" rather than "bug".
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Database(e) | StoreError::Open { source: e, .. } => sqlx_unavailable(e),
            _ => false,
        }
    }
}

fn sqlx_unavailable(e: &sqlx::Error) -> bool {
    // SQLite's primary result codes (the low byte of an extended code).
    const SQLITE_BUSY: i64 = 5;
    const SQLITE_LOCKED: i64 = 6;
    const SQLITE_READONLY: i64 = 8;
    const SQLITE_IOERR: i64 = 10;
    const SQLITE_FULL: i64 = 13;
    const SQLITE_CANTOPEN: i64 = 14;
    match e {
        sqlx::Error::Database(db)
            if db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some() =>
        {
            // SQLSTATE classes: 08 connection exception, 53 insufficient resources (disk full,
            // out of memory, too many connections), 57P operator intervention (shutdown,
            // starting up), 25006 read-only transaction (a standby), 40001/40P01 serialization
            // failure and deadlock (retryable).
            db.code().is_some_and(|c| {
                c.starts_with("08")
                    || c.starts_with("53")
                    || c.starts_with("57P")
                    || c == "25006"
                    || c == "40001"
                    || c == "40P01"
            })
        }
        sqlx::Error::Database(db) => {
            db.code()
                .and_then(|c| c.parse::<i64>().ok())
                .is_some_and(|c| {
                    matches!(
                        c & 0xff,
                        SQLITE_BUSY
                            | SQLITE_LOCKED
                            | SQLITE_READONLY
                            | SQLITE_IOERR
                            | SQLITE_FULL
                            | SQLITE_CANTOPEN
                    )
                })
        }
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        _ => false,
    }
}
