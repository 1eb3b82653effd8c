//! The HTTP surface end to end: each test starts the real `smolchat serve` binary with the default
//! SmolLM2 model on a free port and its own temporary database, and drives it over HTTP and SSE.
//! Replies are greedy (`temperature: 0`) so they can be compared exactly.

mod common;

use std::time::{Duration, Instant};

use common::server::{eventually, metric, turn_from, Client, Server, Turn};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const PROMPTS: [&str; 4] = [
    "Write a short story about a dragon who learns to fly.",
    "Explain how photosynthesis works in simple terms.",
    "Describe the city of Paris to a tourist.",
    "List some tips for staying healthy.",
];

/// A prompt the small model answers at length (hundreds of tokens), for replies that must still be
/// running when the test acts.
const LONG_PROMPT: &str =
    "Write a very long, detailed story about a knight's journey across many kingdoms.";

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// Asserts an API error: status, `error.type`, and a non-empty `error.message`.
#[track_caller]
fn assert_error(r: &common::server::Reply, status: StatusCode, kind: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    assert_eq!(r.json["error"]["type"], kind, "{}", r.text);
    let message = r.json["error"]["message"].as_str().unwrap_or("");
    assert!(!message.is_empty(), "no error message: {}", r.text);
}

fn status_of(message: &Value) -> &str {
    message["status"].as_str().unwrap_or("?")
}

/// Reads events until at least `n` answer/reasoning texts arrived.
async fn read_texts(events: &mut common::server::SseStream, n: usize) -> Vec<String> {
    let mut texts = Vec::new();
    while texts.len() < n {
        let ev = events.next().await.expect("stream ended early");
        match ev.event.as_str() {
            "answer" | "reasoning" => texts.push(ev.data["text"].as_str().unwrap().to_string()),
            "done" | "error" => panic!("the reply ended too early: {:?}", ev.data),
            _ => {}
        }
    }
    texts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_endpoints_and_conversation_crud() {
    let dir = tempdir();
    let server = Server::start(dir.path(), &[]).await;
    let c = server.client();

    let r = c.get("/healthz").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["status"], "ok");
    let r = c.get("/readyz").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["status"], "ready");
    assert!(c.cookie().is_none(), "ops endpoints set no cookie");

    // First contact sets the owner cookie: signed, HttpOnly, SameSite=Lax.
    let resp = c.raw(Method::POST, "/api/conversations", None, None).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let set_cookie = resp.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(set_cookie.starts_with("smolchat_owner="), "{set_cookie}");
    assert!(set_cookie.contains("HttpOnly"), "{set_cookie}");
    assert!(set_cookie.contains("SameSite=Lax"), "{set_cookie}");
    let location = resp.headers()["location"].to_str().unwrap().to_string();
    let first: Value = resp.json().await.unwrap();
    let first_id = first["id"].as_str().unwrap().to_string();
    assert_eq!(location, format!("/api/conversations/{first_id}"));
    // Defaults come from config/default.toml; the date is pinned.
    assert_eq!(first["settings"]["max_tokens"], 1024);
    assert_eq!(first["settings"]["top_k"], 40);
    assert!(first["settings"]["pinned_date"].as_str().unwrap().len() == 10);
    // Later requests keep the same owner: no new cookie.
    let r = c.get("/api/conversations").await;
    assert!(r.headers.get("set-cookie").is_none());

    let second = c
        .post(
            "/api/conversations",
            &json!({"title": "  Greetings  ", "system_prompt": "Be brief.", "temperature": 0, "max_tokens": 8}),
        )
        .await;
    assert_eq!(second.status, StatusCode::CREATED, "{}", second.text);
    let second_id = second.json["id"].as_str().unwrap().to_string();
    assert_eq!(second.json["title"], "Greetings");
    assert_eq!(second.json["settings"]["system_prompt"], "Be brief.");

    let r = c.get("/api/conversations").await;
    let list = r.json["conversations"].as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["id"], second_id.as_str(), "newest first");

    // A short reply; the conversation keeps its given title.
    let turn = c.chat(&second_id, "Say hello to the cats.").await;
    assert_eq!(status_of(turn.message()), "complete");
    assert!(turn.done["summary"]["completion_tokens"].as_u64().unwrap() <= 8);
    let detail = c.conversation(&second_id).await;
    assert_eq!(detail["title"], "Greetings");
    assert_eq!(detail["replying"], false);
    assert_eq!(detail["context_window"], 8192);
    let messages = detail["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["role"], "user");
    assert_eq!(messages[0]["content"], "Say hello to the cats.");
    assert_eq!(messages[1]["role"], "assistant");
    assert_eq!(messages[1], *turn.message());

    // Search looks at titles and messages.
    let r = c.get("/api/conversations?q=CATS").await;
    let found = r.json["conversations"].as_array().unwrap();
    assert_eq!(found.len(), 1, "{}", r.text);
    assert_eq!(found[0]["id"], second_id.as_str());
    let r = c.get("/api/conversations?q=nothing%20like%20this").await;
    assert_eq!(r.json["conversations"].as_array().unwrap().len(), 0);

    // PATCH: title and settings; an empty system prompt removes it.
    let r = c
        .send_json(
            Method::PATCH,
            &format!("/api/conversations/{second_id}"),
            &json!({"title": "Cats", "temperature": 0.5, "system_prompt": ""}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json["title"], "Cats");
    assert_eq!(r.json["settings"]["temperature"], 0.5);
    assert_eq!(r.json["settings"]["system_prompt"], Value::Null);
    assert_eq!(r.json["settings"]["max_tokens"], 8, "other settings kept");

    // Metrics after some traffic.
    let text = c.metrics().await;
    for name in [
        "smolchat_queue_depth",
        "smolchat_running_sequences",
        "smolchat_generated_tokens_total",
        "smolchat_prefilled_tokens_total",
        "smolchat_kv_bytes",
        "smolchat_kv_budget_bytes",
        "smolchat_kv_evictions",
        "smolchat_tokens_per_second",
        "smolchat_step_seconds_bucket",
        "smolchat_step_seconds_count",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    // The device and tier that compute, and no fall-back from the asked tier.
    assert!(
        text.contains(r#"smolchat_engine_info{device="cpu",tier="cpu"} 1"#),
        "{text}"
    );
    assert_eq!(metric(&text, "smolchat_engine_tier_fallback"), Some(0.0));
    assert!(metric(&text, "smolchat_generated_tokens_total").unwrap() >= 1.0);
    // The CPU's default budget, in whole blocks (one SmolLM2 block at f16: 368,640 bytes).
    let budget = metric(&text, "smolchat_kv_budget_bytes").unwrap();
    let default = (2048u64 << 20) as f64;
    assert!(
        budget <= default && budget > default - 368_640.0,
        "{budget}"
    );

    // DELETE: gone for good.
    let r = c
        .call(
            Method::DELETE,
            &format!("/api/conversations/{second_id}"),
            None,
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.text);
    let r = c.get(&format!("/api/conversations/{second_id}")).await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    let r = c.get("/api/conversations").await;
    let list = r.json["conversations"].as_array().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], first_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_and_nothing_is_stored() {
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_LIMITS__MAX_MESSAGE_CHARS", "100"),
            ("SMOLCHAT_LIMITS__CONTEXT", "64"),
        ],
    )
    .await;
    let c = server.client();
    let id = c.create_greedy(32).await;
    let messages_path = format!("/api/conversations/{id}/messages");
    let json_ct = Some("application/json");

    // Message content.
    assert_error(
        &c.send(&id, "").await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(
        &c.send(&id, "  \n\t ").await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    let r = c.send(&id, &"a".repeat(101)).await;
    assert_error(&r, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    assert!(r.text.contains("100"), "names the limit: {}", r.text);
    // 100 characters but far more than 64 tokens: the context window refuses it.
    let many_tokens: String = (0..50).map(|i| format!("{} ", i % 10)).collect();
    let r = c.send(&id, many_tokens.trim_end()).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "context_overflow");
    assert!(r.text.contains("64"), "names the window: {}", r.text);

    // Bodies.
    let post = |ct: Option<&'static str>, body: &[u8]| {
        let c = c.clone();
        let path = messages_path.clone();
        let body = body.to_vec();
        async move { c.call(Method::POST, &path, ct, Some(body)).await }
    };
    assert_error(
        &post(json_ct, b"{\"content\": \"hi\"").await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    );
    assert_error(
        &post(json_ct, b"not json").await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    );
    assert_error(
        &post(json_ct, b"{}").await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    );
    assert_error(
        &post(json_ct, b"{\"content\": 5}").await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    );
    let r = post(json_ct, b"{\"content\": \"hi\", \"role\": \"system\"}").await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_json");
    assert!(r.text.contains("unknown field"), "{}", r.text);
    let r = post(json_ct, b"{\"content\": \"caf\xc3\xa9 \xff\xfe\"}").await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_json");
    assert!(r.text.contains("UTF-8"), "{}", r.text);
    assert_error(
        &post(json_ct, b"").await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    );
    assert_error(
        &post(Some("text/plain"), b"{\"content\": \"hi\"}").await,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    );
    assert_error(
        &post(None, b"{\"content\": \"hi\"}").await,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    );
    let huge = format!("{{\"content\": \"{}\"}}", "x".repeat(300_000));
    assert_error(
        &post(json_ct, huge.as_bytes()).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    );

    // Ids: malformed, unknown, another owner's.
    let r = c.send("not-a-uuid", "hi").await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request");
    let unknown = "0190a5c4-1f2e-7c3d-9a8b-123456789abc";
    assert_error(
        &c.send(unknown, "hi").await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        &c.get(&format!("/api/conversations/{unknown}")).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let stranger = Client::new(&server.base);
    let theirs = format!("/api/conversations/{id}");
    assert_error(
        &stranger.get(&theirs).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        &stranger.send(&id, "hi").await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        &stranger.get(&format!("{theirs}/events")).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        &stranger.post(&format!("{theirs}/stop"), &json!({})).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        &stranger
            .send_json(Method::PATCH, &theirs, &json!({"title": "mine"}))
            .await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        &stranger.call(Method::DELETE, &theirs, None, None).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let r = stranger.get("/api/conversations").await;
    assert_eq!(r.json["conversations"].as_array().unwrap().len(), 0);
    // A forged cookie is not trusted: the request gets a fresh owner.
    let forged = Client::with_cookie(
        &server.base,
        Some(format!(
            "smolchat_owner={}",
            c.conversation(&id).await["owner"].as_str().unwrap()
        )),
    );
    assert_error(
        &forged.get(&theirs).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );

    // Settings.
    for bad in [
        json!({"temperature": -1}),
        json!({"temperature": "hot"}),
        json!({"top_p": 0}),
        json!({"top_p": 1.5}),
        json!({"max_tokens": 0}),
        json!({"max_tokens": 1_000_000}),
        json!({"bogus": true}),
    ] {
        let r = c.post("/api/conversations", &bad).await;
        assert!(r.status == StatusCode::BAD_REQUEST, "{bad}: {}", r.text);
        let r = c.send_json(Method::PATCH, &theirs, &bad).await;
        assert!(
            r.status == StatusCode::BAD_REQUEST,
            "PATCH {bad}: {}",
            r.text
        );
    }
    let r = c.get("/api/conversations").await;
    assert_eq!(
        r.json["conversations"].as_array().unwrap().len(),
        1,
        "no conversation was created"
    );
    assert_eq!(
        c.conversation(&id).await["settings"]["max_tokens"],
        32,
        "settings unchanged"
    );

    // Routes and methods.
    assert_error(
        &c.get("/api/nope").await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(&c.get("/nope").await, StatusCode::NOT_FOUND, "not_found");
    assert_error(
        &c.call(Method::PUT, "/api/conversations", None, None).await,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );

    // Nothing above was stored.
    assert!(c.messages(&id).await.is_empty(), "no message stored");

    // A good message still works; a second one while the reply runs is refused (busy).
    let mut events = c.events(&id).await;
    let r = c.send(&id, "Hello!").await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    assert_error(
        &c.send(&id, "And again").await,
        StatusCode::CONFLICT,
        "conflict",
    );
    let turn = turn_from(r.json, Instant::now(), events.until("done").await);
    assert_eq!(status_of(turn.message()), "complete");
    let messages = c.messages(&id).await;
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["content"], "Hello!");
    assert_eq!(status_of(&messages[1]), "complete");
}

/// Runs one reply alone in a new conversation; returns the stored raw text.
async fn alone(c: &Client, prompt: &str, max_tokens: usize) -> String {
    let id = c.create_greedy(max_tokens).await;
    let turn = c.chat(&id, prompt).await;
    assert_eq!(status_of(turn.message()), "complete");
    turn.raw()
}

/// Runs `prompts` in parallel, one conversation each.
async fn in_parallel(c: &Client, prompts: &[&str], max_tokens: usize) -> Vec<Turn> {
    let mut ids = Vec::new();
    for _ in prompts {
        ids.push(c.create_greedy(max_tokens).await);
    }
    // Subscribe everyone first, then send everything at once.
    let mut streams = Vec::new();
    for id in &ids {
        streams.push(c.events(id).await);
    }
    let tasks = ids
        .iter()
        .zip(streams)
        .zip(prompts)
        .map(|((id, mut events), prompt)| {
            let c = c.clone();
            let id = id.clone();
            let prompt = prompt.to_string();
            tokio::spawn(async move {
                let sent_at = Instant::now();
                let r = c.send(&id, &prompt).await;
                assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
                turn_from(r.json, sent_at, events.until("done").await)
            })
        });
    let mut turns = Vec::new();
    for t in futures_util::future::join_all(tasks).await {
        turns.push(t.expect("task"));
    }
    turns
}

/// Every stream produced text before any of them finished: they ran at the same time.
fn assert_overlapping(turns: &[Turn]) {
    let last_first = turns.iter().filter_map(|t| t.first_text_at).max().unwrap();
    let first_done = turns.iter().map(|t| t.done_at).min().unwrap();
    assert!(
        last_first < first_done,
        "the replies did not stream concurrently (the last one started {:?} after the first one finished)",
        last_first - first_done
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_conversations_match_alone() {
    const MAX: usize = 32;
    let dir = tempdir();
    let server = Server::start(dir.path(), &[]).await;
    let c = server.client();

    let t = Instant::now();
    let mut reference = Vec::new();
    for p in PROMPTS {
        reference.push(alone(&c, p, MAX).await);
    }
    let alone_s = t.elapsed().as_secs_f64();
    for (p, r) in PROMPTS.iter().zip(&reference) {
        assert!(!r.is_empty(), "empty reply to {p}");
    }

    let t = Instant::now();
    let two = in_parallel(&c, &PROMPTS[..2], MAX).await;
    for (i, turn) in two.iter().enumerate() {
        assert_eq!(status_of(turn.message()), "complete");
        assert_eq!(turn.raw(), reference[i], "2 in parallel, prompt {i}");
    }
    assert_overlapping(&two);
    let two_s = t.elapsed().as_secs_f64();

    // Eight at once: every prompt twice.
    let t = Instant::now();
    let prompts: Vec<&str> = (0..8).map(|i| PROMPTS[i % 4]).collect();
    let eight = in_parallel(&c, &prompts, MAX).await;
    for (i, turn) in eight.iter().enumerate() {
        assert_eq!(status_of(turn.message()), "complete");
        assert_eq!(turn.raw(), reference[i % 4], "8 in parallel, stream {i}");
    }
    assert_overlapping(&eight);
    let eight_s = t.elapsed().as_secs_f64();
    eprintln!(
        "4 alone: {alone_s:.1} s; 2 in parallel: {two_s:.1} s; 8 in parallel: {eight_s:.1} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_reuses_the_cache_and_eviction_keeps_replies_identical() {
    const MAX: usize = 24;
    let dir = tempdir();
    // The budget is the KV allocator's hard capacity: 5 MiB of f32 KV is 7 blocks of 16 positions
    // of SmolLM2 (720 KiB each), 112 tokens. One conversation's second turn (~100 tokens) fits,
    // but two conversations' first turns (~64 tokens, 4 blocks each) do not: the other
    // conversation's turn evicts the idle cache.
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SCHEDULER__KV_BUDGET_MIB", "5"),
            ("SMOLCHAT_MODEL__KV_TYPE", "f32"),
        ],
    )
    .await;
    let c = server.client();
    let first = "My name is Ann. Please remember it.";
    let second = "What is my name?";

    // Warm: two turns back to back.
    let warm = c.create_greedy(MAX).await;
    let w1 = c.chat(&warm, first).await;
    let w2 = c.chat(&warm, second).await;
    let s1 = &w1.done["summary"];
    let s2 = &w2.done["summary"];
    assert_eq!(s1["cached_tokens"], 0);
    let prompt1 = s1["prompt_tokens"].as_u64().unwrap();
    let prompt2 = s2["prompt_tokens"].as_u64().unwrap();
    let cached2 = s2["cached_tokens"].as_u64().unwrap();
    let new2 = prompt2 - cached2;
    eprintln!("turn 2: {prompt2} prompt tokens, {cached2} cached, {new2} prefilled");
    assert!(
        cached2 >= prompt1,
        "the whole first prompt is reused ({cached2} < {prompt1})"
    );
    assert!(
        new2 < 40,
        "only the new turn is prefilled, not {new2} tokens"
    );
    assert_eq!(
        w2.message()["cached_tokens"],
        cached2,
        "stored with the message"
    );
    assert_eq!(w2.done["message"]["prompt_tokens"], prompt2);

    // Evicted: same first turn, then another conversation pushes its cache out, to the KV
    // spill tier (on by default): the next turn reads it back instead of computing it.
    let evicted = c.create_greedy(MAX).await;
    let e1 = c.chat(&evicted, first).await;
    assert_eq!(e1.raw(), w1.raw());
    let other = c.create_greedy(MAX).await;
    c.chat(&other, PROMPTS[0]).await;
    let e2 = c.chat(&evicted, second).await;
    assert_eq!(
        e2.done["summary"]["cached_tokens"], cached2,
        "the evicted cache came back from the spill tier"
    );
    assert_eq!(e2.done["summary"]["prompt_tokens"], prompt2);
    assert_eq!(e2.raw(), w2.raw(), "the reply after eviction is the same");

    let text = c.metrics().await;
    assert!(
        metric(&text, "smolchat_kv_evictions").unwrap() >= 1.0,
        "{text}"
    );
    assert!(
        metric(&text, "smolchat_kv_spill_restores_total").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_and_disconnect_free_the_slot() {
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SESSION__DISCONNECT_GRACE_MS", "0"),
            ("SMOLCHAT_SCHEDULER__MAX_RUNNING", "1"),
        ],
    )
    .await;
    let c = server.client();
    let running = |c: Client| async move {
        let text = c.metrics().await;
        (metric(&text, "smolchat_running_sequences") == Some(0.0)).then_some(())
    };

    // Stop mid-reply.
    let id = c.create_greedy(2000).await;
    let mut events = c.events(&id).await;
    let r = c.send(&id, LONG_PROMPT).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    let partial = read_texts(&mut events, 5).await.concat();
    let asked = Instant::now();
    let r = c
        .post(&format!("/api/conversations/{id}/stop"), &json!({}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json["stopped"], true);
    let done = events.until("done").await.pop().unwrap();
    // The figure is printed, not asserted: what the test checks is the state (stopped early,
    // partial text kept, the slot free).
    eprintln!("stop → done in {:?}", asked.elapsed());
    let message = &done.data["message"];
    assert_eq!(status_of(message), "stopped");
    assert_eq!(done.data["summary"]["reason"]["kind"], "cancelled");
    let content = message["content"].as_str().unwrap();
    assert!(content.starts_with(&partial), "{content:?} / {partial:?}");
    assert!(message["completion_tokens"].as_u64().unwrap() < 2000);
    eventually(Duration::from_secs(2), || running(c.clone()))
        .await
        .expect("the slot is free after stop");
    let r = c
        .post(&format!("/api/conversations/{id}/stop"), &json!({}))
        .await;
    assert_eq!(r.json["stopped"], false, "nothing left to stop");

    // Client disconnect: drop the event stream mid-reply.
    let id = c.create_greedy(2000).await;
    let mut events = c.events(&id).await;
    let r = c.send(&id, LONG_PROMPT).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    read_texts(&mut events, 5).await;
    let dropped = Instant::now();
    drop(events);
    let stored = eventually(Duration::from_secs(5), || {
        let c = c.clone();
        let id = id.clone();
        async move {
            let messages = c.messages(&id).await;
            let last = messages.last()?.clone();
            (status_of(&last) != "streaming").then_some(last)
        }
    })
    .await
    .expect("the reply stops within 5 s of the disconnect");
    eprintln!("disconnect → stored in {:?}", dropped.elapsed());
    assert_eq!(status_of(&stored), "stopped");
    assert!(
        !stored["content"].as_str().unwrap().is_empty(),
        "partial text kept"
    );
    assert!(stored["completion_tokens"].as_u64().unwrap() < 2000);
    eventually(Duration::from_secs(2), || running(c.clone()))
        .await
        .expect("the slot is free after the disconnect");

    // Deleting a conversation mid-reply ends its reply and its event stream.
    let id = c.create_greedy(2000).await;
    let mut events = c.events(&id).await;
    let r = c.send(&id, LONG_PROMPT).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    read_texts(&mut events, 3).await;
    let r = c
        .call(
            Method::DELETE,
            &format!("/api/conversations/{id}"),
            None,
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.text);
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(ev) = events.next().await {
            assert!(ev.event == "answer" || ev.event == "reasoning", "{ev:?}");
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "the event stream ends when the conversation is deleted"
    );
    assert_error(
        &c.get(&format!("/api/conversations/{id}")).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    eventually(Duration::from_secs(2), || running(c.clone()))
        .await
        .expect("the slot is free after the delete");

    // With one slot, a new reply starts at once.
    let id = c.create_greedy(8).await;
    let turn = c.chat(&id, "Hi!").await;
    assert_eq!(status_of(turn.message()), "complete");
    assert!(turn.done["summary"]["queue_ms"].as_f64().unwrap() < 1000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_refuses_at_once_and_loses_nothing() {
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SCHEDULER__MAX_RUNNING", "1"),
            ("SMOLCHAT_SCHEDULER__QUEUE_SIZE", "1"),
        ],
    )
    .await;
    let c = server.client();

    // Three conversations ready to send (set up first, so that nothing slow happens between
    // the first reply taking the only slot and the sends).
    let mut ids = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let id = c.create_greedy(16).await;
        streams.push(c.events(&id).await);
        ids.push(id);
    }

    // One reply takes the only slot.
    let busy = c.create_greedy(160).await;
    let mut busy_events = c.events(&busy).await;
    let r = c.send(&busy, LONG_PROMPT).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    read_texts(&mut busy_events, 1).await;

    // The three at once: one waits in the queue, two are refused.
    let sends = ids.iter().map(|id| {
        let c = c.clone();
        let id = id.clone();
        async move {
            let r = c.send(&id, "Tell me a joke.").await;
            (r, Instant::now())
        }
    });
    let results = futures_util::future::join_all(sends).await;
    let refused_at = Instant::now();
    let mut queued = Vec::new();
    let mut refused = Vec::new();
    let mut refused_answers = Vec::new();
    for ((id, stream), (r, arrived)) in ids.into_iter().zip(streams).zip(results) {
        match r.status {
            StatusCode::ACCEPTED => queued.push((id, stream, r)),
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, "overloaded");
                let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
                assert!(retry >= 1);
                refused_answers.push(arrived);
                refused.push(id);
            }
            other => panic!("unexpected {other}: {}", r.text),
        }
    }
    // The refusals came at once: while the first reply was still running (an order, not a
    // timing: a refusal that waited for a slot would arrive after that reply's `done`).
    let busy_done = busy_events.until("done").await.pop().unwrap();
    assert!(
        busy_done.at > refused_at,
        "the first reply finished before the sends; this machine is too slow for the test"
    );
    for arrived in &refused_answers {
        assert!(
            *arrived < busy_done.at,
            "a refusal arrived only after the running reply ended (it waited for a slot)"
        );
    }
    assert_eq!(status_of(&busy_done.data["message"]), "complete");
    assert_eq!(queued.len(), 1, "one request fits the queue");
    assert_eq!(refused.len(), 2, "the others are refused");

    // The refused sends stored nothing.
    for id in &refused {
        assert!(
            c.messages(id).await.is_empty(),
            "a refused message is not stored"
        );
    }
    // The queued reply completes too.
    let (queued_id, mut stream, r) = queued.pop().unwrap();
    let turn = turn_from(r.json, refused_at, stream.until("done").await);
    assert_eq!(status_of(turn.message()), "complete");
    assert!(turn.done["summary"]["queue_ms"].as_f64().unwrap() > 0.0);
    let messages = c.messages(&queued_id).await;
    assert_eq!(messages.len(), 2);
    assert_eq!(status_of(&messages[1]), "complete");

    // Once there is room again, a refused conversation can send.
    let turn = c.chat(&refused[0], "Tell me a joke.").await;
    assert_eq!(status_of(turn.message()), "complete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_reply_loses_no_acknowledged_message() {
    let dir = tempdir();
    // The default configuration: no cookie secret is configured, so the server generates one
    // and keeps it beside the database.
    let env: [(&str, &str); 0] = [];
    let mut server = Server::start(dir.path(), &env).await;
    let c = server.client();
    let secret_file = dir.path().join("cookie_secret");
    let secret = std::fs::read_to_string(&secret_file).expect("generated cookie secret");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret_file)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "the secret must be readable by its owner only"
        );
    }

    let a = c.create_greedy(2000).await;
    let b = c.create_greedy(2000).await;
    // A finished turn, then a long reply that will be cut.
    c.send_json(
        Method::PATCH,
        &format!("/api/conversations/{a}"),
        &json!({"max_tokens": 8}),
    )
    .await;
    let t1 = c.chat(&a, "Hello!").await;
    assert_eq!(status_of(t1.message()), "complete");
    c.send_json(
        Method::PATCH,
        &format!("/api/conversations/{a}"),
        &json!({"max_tokens": 2000}),
    )
    .await;
    let mut events = c.events(&a).await;
    let ra = c.send(&a, LONG_PROMPT).await;
    assert_eq!(ra.status, StatusCode::ACCEPTED, "{}", ra.text);
    let rb = c.send(&b, PROMPTS[0]).await;
    assert_eq!(rb.status, StatusCode::ACCEPTED, "{}", rb.text);
    read_texts(&mut events, 3).await;
    // Partial replies are saved every second: wait until one is in the store, then crash.
    let saved = eventually(Duration::from_secs(30), || {
        let c = c.clone();
        let a = a.clone();
        async move {
            let messages = c.messages(&a).await;
            let last = messages.last()?.clone();
            (status_of(&last) == "streaming" && !last["content"].as_str()?.is_empty()).then_some(())
        }
    })
    .await;
    assert!(saved.is_some(), "no partial save within 30 s (hang guard)");
    server.kill();
    drop(events);

    // Restart on the same database: the kept secret still verifies the browser's cookie, so the
    // same browser keeps its conversations.
    let mut server = Server::start(dir.path(), &env).await;
    assert_eq!(std::fs::read_to_string(&secret_file).unwrap(), secret);
    let c = Client::with_cookie(&server.base, c.cookie());
    assert!(
        server.log_text().contains("marked interrupted"),
        "{}",
        server.log_text()
    );
    let messages = c.messages(&a).await;
    let summary: Vec<(&str, &str)> = messages
        .iter()
        .map(|m| (m["role"].as_str().unwrap(), status_of(m)))
        .collect();
    assert_eq!(
        summary,
        [
            ("user", "complete"),
            ("assistant", "complete"),
            ("user", "complete"),
            ("assistant", "interrupted"),
        ]
    );
    assert_eq!(messages[0]["content"], "Hello!");
    assert_eq!(messages[1], *t1.message());
    assert_eq!(messages[2]["id"], ra.json["user_message"]["id"]);
    assert_eq!(messages[2]["content"], LONG_PROMPT);
    assert_eq!(messages[3]["id"], ra.json["assistant_message_id"]);
    // The interrupted reply keeps the text generated before the crash.
    assert!(
        !messages[3]["raw"].as_str().unwrap_or("").is_empty(),
        "partial text lost: {}",
        messages[3]
    );
    let messages = c.messages(&b).await;
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["id"], rb.json["user_message"]["id"]);
    assert_eq!(status_of(&messages[1]), "interrupted");

    // The conversation goes on after the crash (its cache is rebuilt from the store).
    c.send_json(
        Method::PATCH,
        &format!("/api/conversations/{a}"),
        &json!({"max_tokens": 8}),
    )
    .await;
    let t3 = c.chat(&a, "Are you back?").await;
    assert_eq!(status_of(t3.message()), "complete");

    // A graceful stop (SIGTERM) mid-reply stores the reply as stopped and exits cleanly.
    let mut events = c.events(&b).await;
    let r = c.send(&b, LONG_PROMPT).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    read_texts(&mut events, 3).await;
    let t = Instant::now();
    // Hang guard: SIGKILL after 15 s; the property is a clean exit with the reply stored.
    let status = server.terminate(Duration::from_secs(15));
    let status = status.unwrap_or_else(|| panic!("no exit after SIGTERM\n{}", server.log_text()));
    assert!(status.success(), "{status}\n{}", server.log_text());
    eprintln!("SIGTERM → exit in {:?}", t.elapsed());
    drop(events);

    let url = server.database_url.clone();
    let rt_result = tokio::task::spawn(async move {
        let store = smolchat_store::Store::open(&url).await.expect("open store");
        let check = store.integrity_check().await.expect("integrity check");
        let id = uuid::Uuid::parse_str(r.json["assistant_message_id"].as_str().unwrap()).unwrap();
        let reply = store
            .get_message(id)
            .await
            .expect("read")
            .expect("reply stored");
        store.close().await;
        (check, reply.status.as_str().to_string(), reply.content)
    })
    .await
    .expect("store task");
    assert_eq!(rt_result.0, "ok");
    assert_eq!(
        rt_result.1, "stopped",
        "a graceful shutdown stops and stores the reply"
    );
    assert!(!rt_result.2.is_empty());
}

/// Under KV pressure (issue 23): a budget of a few blocks and more concurrent requests than fit.
/// Every reply completes (some after waiting for blocks, some after being preempted and
/// recomputed), none fails with a cache-full error, each greedy reply is the one the same
/// conversation gets with the cache to itself, and a message larger than the whole cache is
/// refused at once with a message that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_kv_pressure_every_reply_completes_and_stays_the_same() {
    const MAX: usize = 40;
    let dir = tempdir();
    // 4 MiB of f16 KV is 11 blocks of 16 positions of SmolLM2 (360 KiB each): 176 tokens. Each
    // turn (~40 prompt tokens and 40 generated) needs 5 blocks: two run at a time at most.
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SCHEDULER__KV_BUDGET_MIB", "4"),
            ("SMOLCHAT_LIMITS__CONVERSATIONS_PER_MINUTE", "0"),
        ],
    )
    .await;
    let c = server.client();
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("{} (number {i})", PROMPTS[i % PROMPTS.len()]))
        .collect();
    // Alone: one after the other, each with the cache to itself.
    let mut alone = Vec::new();
    for p in &prompts {
        let id = c.create_greedy(MAX).await;
        alone.push(c.chat(&id, p).await.raw());
    }
    // Together: eight at once.
    let mut ids = Vec::new();
    for _ in &prompts {
        ids.push(c.create_greedy(MAX).await);
    }
    let together = futures_util::future::join_all(ids.iter().zip(&prompts).map(|(id, p)| {
        let c = c.clone();
        async move { c.chat(id, p).await }
    }))
    .await;
    for (i, (turn, want)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(
            turn.message()["status"],
            "complete",
            "turn {i}: {:?}",
            turn.done
        );
        assert_eq!(
            &turn.raw(),
            want,
            "turn {i}: the reply changed under pressure"
        );
    }
    let m = c.metrics().await;
    eprintln!(
        "8 turns under a 176-token KV cache: {} preemptions",
        common::server::metric(&m, "smolchat_kv_preemptions_total").unwrap_or(0.0)
    );

    // Larger than the whole cache: refused at once, naming the cache.
    let id = c.create_greedy(MAX).await;
    let r = c.send(&id, &"Tell me about everything. ".repeat(60)).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "context_overflow");
    let message = r.json["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("KV cache holds 176"), "{message}");
}
