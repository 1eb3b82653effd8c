//! Quotas that hold across replicas: three `smolchat serve` replicas on one PostgreSQL
//! database, and a flood of `/v1/chat/completions` requests spread over the three by hand
//! (round robin). The tokens are counted in the database, so the flood stops at the one limit,
//! not three times it: per minute (`limits.tokens_per_minute_per_user`), per day per API key
//! and per day per account. Each 429 names the quota and when it resets; the account page shows
//! what was used and what is left.
//!
//! Skipped (with the reason printed) where no PostgreSQL server can be had; `make test` starts
//! one.

mod common;

use std::path::Path;
use std::time::Duration;

use common::browser_client::Browser;
use common::server::Server;
use reqwest::StatusCode;
use serde_json::{json, Value};

const COOKIE_SECRET: &str =
    "quotas-test-cookie-secret-0123456789abcdef0123456789abcdef0123456789abcdef";

async fn replicas(dir: &Path, limits: &[(&str, &str)]) -> Option<Vec<Server>> {
    let url = common::pg::fresh_database().await?;
    let mut env = vec![
        ("SMOLCHAT_SERVER__COOKIE_SECRET", COOKIE_SECRET),
        ("SMOLCHAT_AUTH__INITIAL_ADMIN", "root"),
        ("SMOLCHAT_AUTH__INITIAL_ADMIN_PASSWORD", "root's password"),
        ("SMOLCHAT_MODEL__THREADS", "1"),
        ("SMOLCHAT_REPLICA__AFFINITY", "false"),
    ];
    env.extend_from_slice(limits);
    let mut servers = Vec::new();
    for i in 0..3 {
        let sub = dir.join(format!("replica-{i}"));
        std::fs::create_dir_all(&sub).expect("replica dir");
        servers.push(Server::start_on(&sub, &url, &env).await);
    }
    Some(servers)
}

/// Signs `root` in on `server` and makes a personal API key named `name`.
async fn key(browser: &mut Browser, name: &str) -> String {
    let made = browser
        .post_form("/account/keys", &format!("name={name}"))
        .await;
    assert_eq!(made.status, StatusCode::OK, "{}", made.text);
    made.text
        .split("id=\"new-key-value\">")
        .nth(1)
        .and_then(|r| r.split('<').next())
        .expect("the new key is shown")
        .to_string()
}

async fn root(server: &Server) -> Browser {
    let mut b = Browser::at(server, 2, "/signin").await;
    let signed = b
        .post_form("/signin", "name=root&password=root%27s+password")
        .await;
    assert_eq!(signed.status, StatusCode::NO_CONTENT, "{}", signed.text);
    b.get("/account").await;
    b
}

struct Outcome {
    status: StatusCode,
    tokens: u64,
    retry_after: Option<u64>,
    body: Value,
}

async fn ask(server: &Server, key: &str, n: usize) -> Outcome {
    let res = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .bearer_auth(key)
        .json(&json!({
            // A different prompt each time, so no request is served from another's cache.
            "messages": [{"role": "user", "content": format!("Request {n}: name a colour and a fruit.")}],
            "max_tokens": 12,
            "temperature": 0,
        }))
        .send()
        .await
        .expect("request");
    let status = res.status();
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let body: Value = res.json().await.unwrap_or(Value::Null);
    let usage = &body["usage"];
    let tokens = usage["prompt_tokens"].as_u64().unwrap_or(0)
        - usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
        + usage["completion_tokens"].as_u64().unwrap_or(0);
    Outcome {
        status,
        tokens,
        retry_after,
        body,
    }
}

/// Floods the three replicas in turn with `key` until one refuses: the tokens accepted before
/// and the refusal. Requests are sent one after another, each after the last one's usage was
/// counted (the count is written as a request ends; a moment is left for it).
async fn flood(servers: &[Server], key: &str, first: usize, most: usize) -> (u64, usize, Outcome) {
    let mut accepted = 0;
    for n in 0..most {
        let server = &servers[n % servers.len()];
        let out = ask(server, key, first + n).await;
        if out.status == StatusCode::TOO_MANY_REQUESTS {
            return (accepted, n, out);
        }
        assert_eq!(out.status, StatusCode::OK, "{}", out.body);
        accepted += out.tokens;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    panic!("{most} requests over three replicas and none was refused ({accepted} tokens)");
}

/// Waits until at least `margin` seconds are left in this UTC minute, so a per-minute flood
/// does not straddle two windows.
async fn early_in_a_minute(margin: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let left = 60 - now % 60;
    if left < margin {
        tokio::time::sleep(Duration::from_secs(left + 1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_minute_quota_holds_across_three_replicas() {
    let dir = tempfile::tempdir().expect("tempdir");
    const LIMIT: u64 = 150;
    let Some(servers) = replicas(
        dir.path(),
        &[("SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER", "150")],
    )
    .await
    else {
        return;
    };
    let mut root = root(&servers[0]).await;
    let key = key(&mut root, "flood").await;
    early_in_a_minute(40).await;
    let (accepted, requests, refused) = flood(&servers, &key, 0, 30).await;
    let message = refused.body["error"]["message"]
        .as_str()
        .unwrap_or_default();
    println!(
        "per minute: {accepted} tokens in {requests} requests over 3 replicas, then: {message}"
    );
    // Stopped at the one limit: at or past it, by less than one request's worth …
    assert!(accepted >= LIMIT, "refused at {accepted} tokens: {message}");
    let per_request = accepted / requests as u64;
    assert!(
        accepted < LIMIT + per_request + 1,
        "{accepted} tokens in {requests} requests"
    );
    // … while no replica alone had seen the limit (so three in-memory limits would have let
    // three times as much through).
    assert!(
        accepted.div_ceil(3) + per_request < LIMIT,
        "the test's requests are too large to tell: {accepted} tokens in {requests}"
    );
    assert!(
        message.contains("per-minute quota is used up")
            && message.contains("across all replicas")
            && message.contains("limits.tokens_per_minute_per_user"),
        "{}",
        refused.body
    );
    let wait = refused.retry_after.expect("Retry-After");
    assert!((1..=60).contains(&wait), "{wait}");
    // Every replica refuses now, not only the one that noticed.
    for server in &servers {
        let again = ask(server, &key, 1000).await;
        assert_eq!(
            again.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{}",
            again.body
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daily_quotas_per_key_and_per_account_hold_across_three_replicas() {
    let dir = tempfile::tempdir().expect("tempdir");
    const KEY_LIMIT: u64 = 120;
    const USER_LIMIT: u64 = 300;
    let Some(servers) = replicas(
        dir.path(),
        &[
            ("SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER", "0"),
            ("SMOLCHAT_LIMITS__TOKENS_PER_DAY_PER_KEY", "120"),
            ("SMOLCHAT_LIMITS__TOKENS_PER_DAY_PER_USER", "300"),
        ],
    )
    .await
    else {
        return;
    };
    let mut root = root(&servers[1]).await;
    let first = key(&mut root, "first").await;
    let second = key(&mut root, "second").await;

    // The first key stops at its own daily quota …
    let (by_first, _, refused) = flood(&servers, &first, 0, 30).await;
    let message = refused.body["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(by_first >= KEY_LIMIT, "{by_first}: {message}");
    assert!(
        message.contains("daily API key quota is used up")
            && message.contains("limits.tokens_per_day_per_key")
            && message.contains("00:00:00 UTC"),
        "{}",
        refused.body
    );
    assert!(refused.retry_after.is_some_and(|s| s <= 86_400));
    // … the second key of the same account goes on, until the account's daily quota.
    let (by_second, _, refused) = flood(&servers, &second, 100, 40).await;
    let message = refused.body["error"]["message"]
        .as_str()
        .unwrap_or_default();
    let total = by_first + by_second;
    println!("per day: key 1 stopped at {by_first} tokens, the account at {total}: {message}");
    assert!(total >= USER_LIMIT, "{total}: {message}");
    assert!(total < USER_LIMIT + KEY_LIMIT, "{total}");
    assert!(
        message.contains("your daily quota is used up")
            && message.contains("limits.tokens_per_day_per_user"),
        "{}",
        refused.body
    );
    // The account page (on another replica) shows the day's use and nothing left.
    let page = root.get("/account").await;
    assert_eq!(page.status, StatusCode::OK);
    let row = page
        .text
        .split("data-quota=\"daily\">")
        .nth(1)
        .and_then(|r| r.split("</tr>").next())
        .expect("the daily row")
        .to_string();
    assert!(
        row.contains(&format!("<td>{total}</td>")),
        "{row} (total {total})"
    );
    assert!(row.contains("<td>300</td><td>0</td>"), "{row}");
}
