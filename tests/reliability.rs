//! Reliability under crashes, in the default configuration (no cookie secret configured): writers
//! keep sending messages while the server is SIGKILLed at random moments and restarted on the
//! same data folder. Every acknowledged message must be there afterwards, in order, every reply
//! cut by a crash must be marked `interrupted` (none left `streaming`), the browsers keep their
//! conversations across restarts, and SQLite's integrity check passes.
//!
//! Bounded: `KILLS` rounds of at most ~2 s of writing each. `make soak` runs the same test with
//! more kills (`SMOLCHAT_SOAK_KILLS`).

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use reqwest::StatusCode;
use serde_json::json;

use common::server::{Client, Server};
use smolchat_store::Store;

const WRITERS: usize = 4;

fn kills() -> usize {
    std::env::var("SMOLCHAT_SOAK_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

/// What one writer (one browser, one conversation) had acknowledged.
#[derive(Default, Clone)]
struct Writer {
    cookie: Option<String>,
    conversation: Option<String>,
    /// (user message id, content) of every 202.
    acked: Vec<(String, String)>,
    /// Sends whose answer never came (the server died): each may or may not have been stored.
    unconfirmed: usize,
}

/// Sends messages until the server goes away or `stop` is set; returns the writer's state.
async fn write_until_down(
    base: String,
    mut w: Writer,
    id: usize,
    round: usize,
    stop: Arc<AtomicBool>,
) -> Writer {
    let client = Client::with_cookie(&base, w.cookie.clone());
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let conversation = match &w.conversation {
            Some(c) => c.clone(),
            None => match client
                .try_post(
                    "/api/conversations",
                    &json!({"temperature": 0, "max_tokens": 24}),
                )
                .await
            {
                Ok(r) if r.status == StatusCode::CREATED => {
                    let c = r.json["id"].as_str().expect("id").to_string();
                    w.conversation = Some(c.clone());
                    c
                }
                Ok(r) => panic!("create answered {}: {}", r.status, r.text),
                Err(_) => break,
            },
        };
        w.cookie = client.cookie();
        let content = format!("writer {id}, round {round}, message {n}: say something short");
        match client
            .try_post(
                &format!("/api/conversations/{conversation}/messages"),
                &json!({ "content": content }),
            )
            .await
        {
            Ok(r) if r.status == StatusCode::ACCEPTED => {
                let user_id = r.json["user_message"]["id"].as_str().expect("user id");
                w.acked.push((user_id.to_string(), content));
                n += 1;
            }
            // The previous reply is still running, or the queue is full: try again shortly.
            Ok(r)
                if r.status == StatusCode::CONFLICT
                    || r.status == StatusCode::SERVICE_UNAVAILABLE => {}
            Ok(r) => panic!("send answered {}: {}", r.status, r.text),
            Err(_) => {
                w.unconfirmed += 1;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kills_under_writers_lose_no_acknowledged_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let env: [(&str, &str); 0] = [];
    let kills = kills();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed_c0de);
    let mut writers = vec![Writer::default(); WRITERS];
    for round in 0..kills {
        let mut server = Server::start(dir.path(), &env).await;
        let stop = Arc::new(AtomicBool::new(false));
        let tasks: Vec<_> = writers
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, w)| {
                tokio::spawn(write_until_down(
                    server.base.clone(),
                    w,
                    i,
                    round,
                    Arc::clone(&stop),
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2000))).await;
        server.kill();
        for (slot, t) in writers.iter_mut().zip(tasks) {
            *slot = t.await.expect("writer task");
        }
    }

    // Restart once more and read everything back through the API, as the same browsers.
    let server = Server::start(dir.path(), &env).await;
    let mut acknowledged = 0;
    let mut interrupted = 0;
    let mut statuses: HashMap<String, usize> = HashMap::new();
    for (i, w) in writers.iter().enumerate() {
        let Some(conversation) = &w.conversation else {
            panic!("writer {i} never created its conversation");
        };
        let client = Client::with_cookie(&server.base, w.cookie.clone());
        let messages = client.messages(conversation).await;
        let users: Vec<(String, String)> = messages
            .iter()
            .filter(|m| m["role"] == "user")
            .map(|m| {
                (
                    m["id"].as_str().unwrap_or("").to_string(),
                    m["content"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        // Every acknowledged message is stored, in the order it was sent, with its text; the
        // only others are sends cut off by a kill before their answer arrived.
        let mut stored = users.iter();
        for acked in &w.acked {
            assert!(
                stored.any(|u| u == acked),
                "writer {i}: acknowledged message {acked:?} is missing (or out of order) in {users:?}"
            );
        }
        assert!(
            users.len() <= w.acked.len() + w.unconfirmed,
            "writer {i}: {} stored, {} acknowledged, {} unconfirmed",
            users.len(),
            w.acked.len(),
            w.unconfirmed
        );
        acknowledged += w.acked.len();
        for m in messages.iter().filter(|m| m["role"] == "assistant") {
            let status = m["status"].as_str().unwrap_or("?").to_string();
            assert_ne!(status, "streaming", "a reply was left streaming: {m}");
            if status == "interrupted" {
                interrupted += 1;
            }
            *statuses.entry(status).or_default() += 1;
        }
    }
    drop(server);
    let url = format!("sqlite://{}", dir.path().join("db.sqlite").display());
    let store = Store::open(&url).await.expect("open the database");
    assert_eq!(
        store.integrity_check().await.expect("integrity check"),
        "ok"
    );
    store.close().await;

    eprintln!(
        "{kills} SIGKILLs under {WRITERS} writers: {acknowledged} messages acknowledged, all stored; \
         replies by status {statuses:?}"
    );
    assert!(
        acknowledged >= WRITERS,
        "the writers barely wrote ({acknowledged} messages)"
    );
    assert!(
        interrupted >= 1,
        "no kill landed mid-reply: the test did not test anything"
    );
}
