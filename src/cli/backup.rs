//! `smolchat backup PATH`: a consistent copy of the (possibly live) database, checked after
//! writing (SQLite: a file copy; PostgreSQL: `pg_dump`'s custom format). `smolchat restore
//! PATH --database-url URL` puts one in place as a new database (docs/INSTALL.md).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use smolchat_service::config::Config;

#[derive(Args, Debug)]
pub struct BackupArgs {
    /// The new file to write (it must not exist yet).
    pub path: PathBuf,
    /// A TOML configuration file (layered over config/default.toml), for database.url.
    #[arg(long, env = "SMOLCHAT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Database URL to back up (default: database.url from the configuration).
    #[arg(long)]
    pub database_url: Option<String>,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// The backup file (`smolchat backup` wrote it).
    pub path: PathBuf,
    /// A TOML configuration file (layered over config/default.toml), for database.url.
    #[arg(long, env = "SMOLCHAT_CONFIG")]
    pub config: Option<PathBuf>,
    /// The database to create from it: a SQLite file that does not exist yet, or an empty
    /// PostgreSQL database (default: database.url from the configuration).
    #[arg(long)]
    pub database_url: Option<String>,
}

/// `--database-url`, else `database.url` of the configuration.
fn database_url(config: Option<&std::path::Path>, database_url: Option<&str>) -> Result<String> {
    Ok(match database_url {
        Some(url) => url.to_string(),
        None => Config::load(config)?.database.url,
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn restore(args: &RestoreArgs) -> Result<()> {
    let url = database_url(args.config.as_deref(), args.database_url.as_deref())?;
    let report = runtime()?
        .block_on(smolchat_store::restore(&args.path, &url))
        .with_context(|| format!("restoring {} into {url}", args.path.display()))?;
    println!(
        "{}",
        serde_json::json!({
            "restored": args.path.display().to_string(),
            "conversations": report.conversations,
            "messages": report.messages,
        })
    );
    Ok(())
}

pub fn run(args: &BackupArgs) -> Result<()> {
    let url = database_url(args.config.as_deref(), args.database_url.as_deref())?;
    let report = runtime()?
        .block_on(smolchat_store::backup(&url, &args.path))
        .with_context(|| format!("backing up {url}"))?;
    println!(
        "{}",
        serde_json::json!({
            "path": args.path.display().to_string(),
            "bytes": report.bytes,
            "conversations": report.conversations,
            "messages": report.messages,
            "checked": true,
        })
    );
    Ok(())
}
