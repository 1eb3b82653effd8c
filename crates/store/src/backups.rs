//! Backups of a PostgreSQL database (`pg_dump`'s custom format) and restores of either kind of
//! backup (`smolchat restore`); the SQLite backup itself is [`crate::backup`]. The PostgreSQL
//! client tools are run as programs (`SMOLCHAT_PG_DUMP` / `SMOLCHAT_PG_RESTORE` name others):
//! the password of the URL goes to them in `PGPASSWORD`, never on their command line.

use std::path::Path;
use std::process::Command;
use std::str::FromStr;

use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use super::{BackupReport, Store, StoreError};

/// `dest` as a new file in an existing folder (a backup never overwrites); its path as text.
pub(crate) fn check_new_file(dest: &Path) -> Result<&str, StoreError> {
    let target = |reason: &str| StoreError::BackupTarget {
        path: dest.to_path_buf(),
        reason: reason.to_string(),
    };
    if dest.exists() {
        return Err(target(
            "already exists; name a new file (a backup never overwrites)",
        ));
    }
    match dest.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => {
            return Err(target("its folder does not exist"));
        }
        _ => {}
    }
    dest.to_str()
        .ok_or_else(|| target("the path is not valid UTF-8"))
}

/// `url` without its password, and the password (for `PGPASSWORD`).
fn split_password(url: &str) -> Result<(String, Option<String>), StoreError> {
    let mut parsed = url::Url::parse(url).map_err(|e| StoreError::Url {
        url: url.to_string(),
        reason: e.to_string(),
    })?;
    let password = parsed.password().map(percent_decode);
    let _ = parsed.set_password(None);
    Ok((parsed.to_string(), password))
}

/// `%XX` escapes decoded (a URL's password; `+` stays `+`).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Runs a PostgreSQL client tool with `args`, the connection's password in its environment.
async fn run_tool(
    env_name: &str,
    default: &str,
    args: Vec<String>,
    password: Option<String>,
) -> Result<String, StoreError> {
    let tool = std::env::var(env_name).unwrap_or_else(|_| default.to_string());
    let shown = tool.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(&tool);
        cmd.args(&args);
        if let Some(p) = password {
            cmd.env("PGPASSWORD", p);
        }
        cmd.output()
    })
    .await
    .map_err(|e| StoreError::BackupTool {
        tool: shown.clone(),
        reason: e.to_string(),
    })?
    .map_err(|e| StoreError::BackupTool {
        tool: shown.clone(),
        reason: format!(
            "cannot run it ({e}); install the PostgreSQL client tools (apt-get install \
             postgresql-client) or name the program in {env_name}"
        ),
    })?;
    if !out.status.success() {
        return Err(StoreError::BackupTool {
            tool: shown,
            reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

/// Conversations and messages in the database at `url`.
async fn counts(url: &str) -> Result<(i64, i64), StoreError> {
    let store = Store::open(url).await?;
    let pool = &store.pool;
    let conversations: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM conversations")
        .fetch_one(pool)
        .await?;
    let messages: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM messages")
        .fetch_one(pool)
        .await?;
    store.close().await;
    Ok((conversations, messages))
}

/// `pg_dump --format=custom` of `url` into `dest`, checked by listing it with `pg_restore`.
/// One snapshot of the live database (pg_dump's transaction); the counts reported are read
/// just after it.
pub(crate) async fn pg_backup(url: &str, dest: &Path) -> Result<BackupReport, StoreError> {
    let (url_no_password, password) = split_password(url)?;
    let dest_text = check_new_file(dest)?.to_string();
    run_tool(
        "SMOLCHAT_PG_DUMP",
        "pg_dump",
        vec![
            "--format=custom".into(),
            "--no-owner".into(),
            "--no-privileges".into(),
            format!("--file={dest_text}"),
            format!("--dbname={url_no_password}"),
        ],
        password,
    )
    .await?;
    let listing = run_tool(
        "SMOLCHAT_PG_RESTORE",
        "pg_restore",
        vec!["--list".into(), dest_text.clone()],
        None,
    )
    .await?;
    for table in ["conversations", "messages", "users"] {
        if !listing.contains(&format!("TABLE DATA public {table} ")) {
            return Err(StoreError::BackupDamaged {
                path: dest.to_path_buf(),
                findings: format!("the archive holds no data of the {table} table"),
            });
        }
    }
    let (conversations, messages) = counts(url).await?;
    Ok(BackupReport {
        bytes: std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0),
        conversations,
        messages,
    })
}

/// Puts the backup `src` in place as the database at `url`, which must not hold one yet: for
/// `sqlite:` a new file (the backup is checked with `PRAGMA integrity_check`, then copied), for
/// `postgres://` an empty database (`createdb` it first; `pg_restore` fills it). The restored
/// database is then opened (migrating it if the backup is older) and counted.
pub async fn restore(src: &Path, url: &str) -> Result<BackupReport, StoreError> {
    let source = |reason: String| StoreError::BackupTarget {
        path: src.to_path_buf(),
        reason,
    };
    if !src.is_file() {
        return Err(source("there is no such backup file".into()));
    }
    let src_text = src
        .to_str()
        .ok_or_else(|| source("the path is not valid UTF-8".into()))?
        .to_string();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let (url_no_password, password) = split_password(url)?;
        {
            let pool = sqlx::AnyPool::connect(url)
                .await
                .map_err(|source| StoreError::Open {
                    url: url.to_string(),
                    source,
                })?;
            let tables: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = 'public'",
            )
            .fetch_one(&pool)
            .await?;
            pool.close().await;
            if tables > 0 {
                return Err(StoreError::Url {
                    url: url.to_string(),
                    reason: format!(
                        "the database already has {tables} tables; restore into a new, empty \
                         database (createdb) and point database.url at it"
                    ),
                });
            }
        }
        run_tool(
            "SMOLCHAT_PG_RESTORE",
            "pg_restore",
            vec![
                "--no-owner".into(),
                "--no-privileges".into(),
                "--exit-on-error".into(),
                "--single-transaction".into(),
                format!("--dbname={url_no_password}"),
                src_text,
            ],
            password,
        )
        .await?;
    } else {
        let options = SqliteConnectOptions::from_str(url).map_err(|e| StoreError::Url {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        let target = options.get_filename().to_path_buf();
        if target.exists() {
            return Err(StoreError::Url {
                url: url.to_string(),
                reason: "the database file already exists; restore to a new file (stop the \
                         server, move the old file away) and point database.url at it"
                    .into(),
            });
        }
        let copy = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(SqliteConnectOptions::new().filename(src).read_only(true))
            .await
            .map_err(|e| source(format!("not a SQLite database: {e}")))?;
        let findings: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
            .fetch_all(&copy)
            .await
            .map_err(|e| source(format!("not a SQLite database: {e}")))?;
        copy.close().await;
        if findings != ["ok"] {
            return Err(StoreError::BackupDamaged {
                path: src.to_path_buf(),
                findings: findings.join("; "),
            });
        }
        if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Url {
                url: url.to_string(),
                reason: format!("cannot make its folder: {e}"),
            })?;
        }
        std::fs::copy(src, &target).map_err(|e| StoreError::Url {
            url: url.to_string(),
            reason: format!("cannot write the file: {e}"),
        })?;
    }
    let (conversations, messages) = counts(url).await?;
    Ok(BackupReport {
        bytes: std::fs::metadata(src).map(|m| m.len()).unwrap_or(0),
        conversations,
        messages,
    })
}

#[cfg(test)]
mod tests {
    use super::split_password;

    #[test]
    fn the_password_leaves_the_url() {
        let (url, password) =
            split_password("postgres://smol:p%40ss%20w+rd@db.example:5433/chat?sslmode=require")
                .unwrap();
        assert_eq!(url, "postgres://smol@db.example:5433/chat?sslmode=require");
        assert_eq!(password.as_deref(), Some("p@ss w+rd"));
        let (url, password) = split_password("postgres://localhost/chat").unwrap();
        assert_eq!(
            (url.as_str(), password),
            ("postgres://localhost/chat", None)
        );
    }
}
