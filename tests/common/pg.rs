//! A PostgreSQL server for the tests: `SMOLTEST_DATABASE_URL` (set by `make test`, which
//! starts a private server with scripts/test-postgres.sh), or, when unset, the same script run
//! from here. Each test gets a database of its own. (Not `SMOLCHAT_…` variables: the server
//! reads every one of those as configuration.)

use std::process::Command;
use std::sync::OnceLock;

use sqlx::Connection;

use super::crate_root;

/// The server's URL (its `postgres` database), or why there is none.
fn server() -> &'static Result<String, String> {
    static SERVER: OnceLock<Result<String, String>> = OnceLock::new();
    SERVER.get_or_init(|| {
        if let Ok(url) = std::env::var("SMOLTEST_DATABASE_URL") {
            if !url.trim().is_empty() {
                return Ok(url.trim().to_string());
            }
        }
        let out = Command::new(crate_root().join("scripts/test-postgres.sh"))
            .arg("start")
            .output()
            .map_err(|e| format!("cannot run scripts/test-postgres.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "scripts/test-postgres.sh start failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    })
}

/// A new, empty database on the test server, as a URL; `None` (with the reason printed) when
/// no PostgreSQL server can be had, so the caller skips. Under `make test` (CI) the server is
/// always there: set `SMOLTEST_REQUIRE_POSTGRES=1` to make its absence a failure instead.
pub async fn fresh_database() -> Option<String> {
    let server = match server() {
        Ok(url) => url.clone(),
        Err(why) => {
            if std::env::var("SMOLTEST_REQUIRE_POSTGRES").is_ok_and(|v| v == "1") {
                panic!("PostgreSQL is required (SMOLTEST_REQUIRE_POSTGRES=1) but: {why}");
            }
            eprintln!("skipped: no PostgreSQL server for the tests ({why})");
            return None;
        }
    };
    let name = format!("smolchat_test_{}", uuid::Uuid::now_v7().simple());
    let mut admin = sqlx::PgConnection::connect(&server)
        .await
        .unwrap_or_else(|e| panic!("connect to the test PostgreSQL at {server}: {e}"));
    // The name is made here from a UUID: nothing outside the test reaches this SQL.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("create database {name}: {e}"));
    let _ = admin.close().await;
    let base = server
        .rsplit_once('/')
        .map_or(server.as_str(), |(base, _)| base);
    Some(format!("{base}/{name}"))
}
