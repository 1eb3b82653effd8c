//! Warm before send, in a real headless Chromium against a real `smolchat serve` with the real
//! SmolLM2 model (issue 50 §3): the chat page sends the settled part of a message while it is
//! typed, the server computes its prompt into the conversation's KV cache in spare steps, and the
//! send computes only the tail. Typing never takes a step from another user's running reply.
//!
//! What is asserted is what cannot flake: how many of the sent prompt's tokens were computed
//! while typing (the reply's stored timings and its stats line), and that no draft token was
//! computed while another reply ran (`smolchat_warm_tokens_total`). The times to first token
//! and the other reply's tokens/s are printed beside a baseline, as measurements.

mod common;

use std::time::{Duration, Instant};

use common::chromium::*;
use common::server::{metric, Server};
use fantoccini::{Client, Locator};
use reqwest::StatusCode;
use serde_json::{json, Value};

const ADMIN_TOKEN: &str = "warm-test-admin-token";

/// About 400 tokens of prose (SmolLM2's tokenizer), typed in pieces.
fn long_message() -> String {
    let sentences = [
        "The harbour was quiet before dawn, and the fishing boats rocked against their ropes.",
        "A keeper climbed the spiral stairs of the lighthouse to trim the wick one last time.",
        "Gulls circled the breakwater, waiting for the first catch to come in from the grey sea.",
        "In the village, the baker lit his ovens and the smell of bread drifted down the lanes.",
        "Children would soon run to the school on the hill, their boots loud on the cobbles.",
        "Old sailors sat on the bench by the chandlery and argued about the coming weather.",
    ];
    let mut text = String::new();
    for i in 0..18 {
        text.push_str(sentences[i % sentences.len()]);
        text.push(' ');
    }
    text.push_str("Please summarise this scene in one sentence.");
    text
}

const SHORT: &str = "Name three colours that you can see in a sunset over the sea.";

/// The last assistant message of conversation `id`, as stored.
async fn last_reply(c: &Client, id: &str) -> Value {
    let (status, conv) = fetch(c, "GET", &format!("/api/conversations/{id}"), None).await;
    assert_eq!(status, 200, "{conv}");
    conv["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "assistant").cloned())
        .expect("an assistant message")
}

/// Types `text` into the composer in pieces of a few words, `pause` apart (a person typing).
async fn type_slowly(c: &Client, text: &str, pause: Duration) {
    let input = c.find(Locator::Css("#input")).await.expect("composer");
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    for piece in words.chunks(6) {
        input.send_keys(&piece.concat()).await.expect("type");
        tokio::time::sleep(pause).await;
    }
}

async fn press_enter(c: &Client) {
    c.find(Locator::Css("#input"))
        .await
        .expect("composer")
        .send_keys("\u{E007}")
        .await
        .expect("Enter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_typed_slowly_is_warmed_and_typing_never_slows_another_reply() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "8"),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "0"),
        ],
    )
    .await;
    let driver = start_driver(dir.path()).await;
    let alice = browser(&driver, &dir.path().join("alice"), DESKTOP).await;
    alice.goto(&server.base).await.expect("open");
    // The conversation is made first and its page opened before anything streams (a reply
    // already running when its page loads is another test's subject).
    let (status, created) = fetch(&alice, "POST", "/api/conversations", Some(json!({}))).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("id").to_string();
    alice
        .goto(&format!("{}/c/{id}", server.base))
        .await
        .expect("open the conversation");
    send(&alice, "Hello there.").await;
    wait_js(&alice, IDLE, "the first reply", |v| v == &json!(1)).await;
    let warm_flag = js(
        &alice,
        "return document.getElementById('composer').dataset.warmDrafts",
    )
    .await;
    assert_eq!(warm_flag, json!("1"), "the page sends drafts");

    // 1. A short message: the baseline time to first token.
    send(&alice, SHORT).await;
    wait_js(&alice, IDLE, "the short message's reply", |v| {
        v == &json!(2)
    })
    .await;
    let short = last_reply(&alice, &id).await;
    let short_ttft = short["timings"]["ttft_ms"].as_f64().unwrap_or(0.0);

    // 2. A 400-token message typed over several seconds, then sent at once.
    let long = long_message();
    let typing = Instant::now();
    type_slowly(&alice, &long, Duration::from_millis(120)).await;
    let typed_for = typing.elapsed();
    let draft = wait_js(
        &alice,
        "return document.body.dataset.lastDraft || ''",
        "a draft offered",
        |v| v.as_str().is_some_and(|s| s.contains("offered")),
    )
    .await;
    press_enter(&alice).await;
    wait_js(&alice, IDLE, "the long message's reply", |v| v == &json!(3)).await;
    let reply = last_reply(&alice, &id).await;
    let prompt = reply["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = reply["cached_tokens"].as_u64().unwrap_or(0);
    let warmed = reply["timings"]["warmed_tokens"].as_u64().unwrap_or(0);
    let long_ttft = reply["timings"]["ttft_ms"].as_f64().unwrap_or(0.0);
    eprintln!(
        "typed {} chars in {:.1} s (last draft {draft}); prompt {prompt}, cached {cached}, warmed \
         while typing {warmed}; time to first token {long_ttft:.0} ms against {short_ttft:.0} ms for \
         the short message ({:.2}x)",
        long.len(),
        typed_for.as_secs_f64(),
        long_ttft / short_ttft.max(1e-3)
    );
    // The message alone is about 400 tokens: most of it was computed while it was typed, and
    // what was left for the send is its last moments of typing and the template's tail.
    assert!(warmed >= 300, "only {warmed} tokens warmed of {prompt}");
    assert!(
        prompt - cached <= 64,
        "{} tokens computed after send",
        prompt - cached
    );
    let stats = js(
        &alice,
        "const s = document.querySelectorAll('.msg.assistant .stats'); return s[s.length - 1].textContent",
    )
    .await;
    assert!(
        stats.as_str().is_some_and(|s| s.contains("while typing")),
        "{stats}"
    );

    // 3. Another user's reply runs while Alice types: no draft token is computed while it
    // runs (her draft waits), then hers is. Bob's reply is the same greedy reply as without
    // her drafts, and its tokens/s are measured beside a reply during which she typed the same
    // way with drafts off (Chromium shares this machine's cores: typing itself costs).
    let bob = server.client();
    let count = "Count from 1 to 200, separated by commas.";
    let warm_tokens = || async {
        metric(
            &server.client().metrics().await,
            "smolchat_warm_tokens_total",
        )
        .unwrap_or(0.0)
    };
    let mut turns = Vec::new();
    let mut warm_before = 0.0;
    for drafts in [false, true] {
        js(
            &alice,
            &format!(
                "document.getElementById('composer').dataset.warmDrafts = '{}'; \
                 document.getElementById('input').value = ''; delete document.body.dataset.lastDraft",
                if drafts { "1" } else { "0" }
            ),
        )
        .await;
        let conv = bob.create_greedy(300).await;
        let mut events = bob.events(&conv).await;
        let r = bob.send(&conv, count).await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
        loop {
            let e = events.next().await.expect("bob's events");
            if e.event == "answer" {
                break;
            }
        }
        // Bob's reply is generating: Alice types until it is done.
        let before = warm_tokens().await;
        if drafts {
            warm_before = before;
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let typist = tokio::spawn({
            let (alice, stop, text) = (alice.clone(), std::sync::Arc::clone(&stop), long.clone());
            async move {
                let input = alice.find(Locator::Css("#input")).await.expect("composer");
                let words: Vec<&str> = text.split_inclusive(' ').collect();
                for piece in words.chunks(4).cycle() {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    input.send_keys(&piece.concat()).await.expect("type");
                    tokio::time::sleep(Duration::from_millis(60)).await;
                }
            }
        });
        if drafts {
            wait_js(
                &alice,
                "return document.body.dataset.lastDraft || ''",
                "a draft offered while the other reply runs",
                |v| v.as_str().is_some_and(|s| s.contains("offered")),
            )
            .await;
            let during = warm_tokens().await;
            let bob_running = bob
                .messages(&conv)
                .await
                .last()
                .is_some_and(|m| m["status"] == "streaming");
            assert!(bob_running, "bob's reply ended too soon to tell");
            assert_eq!(
                during, before,
                "draft tokens were computed while another reply ran"
            );
        }
        let seen = events.until("done").await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        typist.await.expect("typing");
        turns.push(common::server::turn_from(r.json, Instant::now(), seen));
    }
    let rate = |t: &common::server::Turn| {
        t.done["message"]["timings"]["tokens_per_s"]
            .as_f64()
            .unwrap_or(0.0)
    };
    eprintln!(
        "bob's reply while Alice typed: {:.1} tokens/s with her drafts warmed, {:.1} tokens/s \
         with drafts off ({:.3}x)",
        rate(&turns[1]),
        rate(&turns[0]),
        rate(&turns[1]) / rate(&turns[0]).max(1e-9)
    );
    assert_eq!(turns[1].raw(), turns[0].raw(), "the same greedy reply");
    // Once Bob's reply is done, Alice's draft is computed.
    let computed = common::server::eventually(Duration::from_secs(30), || async {
        let now = warm_tokens().await;
        (now > warm_before).then_some(now)
    })
    .await;
    assert!(
        computed.is_some(),
        "the draft was never computed after the reply"
    );

    // 4. The JSON API: a draft is answered with what was done; bad input says what is wrong.
    let api = server.client();
    let conv = api.create_greedy(8).await;
    let r = api
        .post(
            &format!("/api/conversations/{conv}/draft"),
            &json!({ "content": "What should I plant in a small garden in early spring?" }),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    assert_eq!(r.json["outcome"], json!("offered"), "{}", r.text);
    assert!(
        r.json["prompt_tokens"].as_u64().unwrap_or(0) > 10,
        "{}",
        r.text
    );
    let again = api
        .post(
            &format!("/api/conversations/{conv}/draft"),
            &json!({ "content": "What should I plant in a small garden in early spring?" }),
        )
        .await;
    assert_eq!(again.json["outcome"], json!("skipped"), "{}", again.text);
    let bad = api
        .post(
            &format!("/api/conversations/{conv}/draft"),
            &json!({ "content": "a\u{0}b" }),
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text);
    assert!(bad.text.contains("not text"), "{}", bad.text);
    // Someone else's conversation is not found.
    let other = server.client();
    let r = other
        .post(
            &format!("/api/conversations/{conv}/draft"),
            &json!({ "content": "hello there, this is not mine" }),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.text);
    // `/metrics` counts what drafts saved.
    let metrics = server.client().metrics().await;
    assert!(
        metric(&metrics, "smolchat_warm_reused_tokens_total").unwrap_or(0.0) >= 300.0,
        "{metrics}"
    );
}
