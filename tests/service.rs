//! The conversation service through every interface, end to end against the real server:
//! isolation between owners (pages, JSON API, event streams), regenerate and edit refused for
//! any reason losing nothing, per-user limits (429 + Retry-After while other users are served),
//! a cookie-less flood bounded per address, pagination, export and import, `ignore_eos` for
//! admins only and the same verdict for the same setting on every interface.

mod common;

use std::time::Duration;

use common::server::{form_encode, Client, Reply, Server};
use reqwest::header::{CONTENT_TYPE, COOKIE};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use smolchat_store::{PageRequest, Store};

const LONG_PROMPT: &str =
    "Write a very long, detailed story about a knight's journey across many kingdoms.";

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// A page request as a browser of `client` makes it: its cookie, its CSRF token, a form body.
async fn page(
    client: &Client,
    csrf: &str,
    method: Method,
    path: &str,
    form: &[(&str, &str)],
) -> Reply {
    let http = reqwest::Client::new();
    let mut req = http
        .request(method, format!("{}{path}", client.base))
        .header("X-CSRF-Token", csrf)
        .timeout(Duration::from_secs(60));
    if let Some(cookie) = client.cookie() {
        req = req.header(COOKIE, cookie);
    }
    if !form.is_empty() {
        let body = form
            .iter()
            .map(|(k, v)| format!("{}={}", form_encode(k), form_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        req = req
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(body);
    }
    Reply::read(req.send().await.expect("request"))
        .await
        .expect("body")
}

/// A `/v1` request with an optional bearer key.
async fn v1(server: &Server, key: Option<&str>, body: &Value) -> Reply {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .timeout(Duration::from_secs(120))
        .json(body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    Reply::read(req.send().await.expect("request"))
        .await
        .expect("body")
}

/// What a conversation looks like from its owner's side, without what changes by itself.
async fn snapshot(c: &Client, id: &str) -> Value {
    let v = c.conversation(id).await;
    json!({
        "title": v["title"],
        "settings": v["settings"],
        "updated_at": v["updated_at"],
        "messages": v["messages"],
    })
}

/// The user/assistant contents of a conversation, in order.
async fn contents(c: &Client, id: &str) -> Vec<(String, String, String)> {
    c.messages(id)
        .await
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap_or("").to_string(),
                m["role"].as_str().unwrap_or("").to_string(),
                m["content"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// `{field: value}`.
fn object(field: &str, value: Value) -> Value {
    let mut map = serde_json::Map::new();
    map.insert(field.to_string(), value);
    Value::Object(map)
}

/// Undoes the HTML escaping of a template's text.
fn unescape(text: &str) -> String {
    text.replace("&#96;", "`")
        .replace("&#39;", "'")
        .replace("&#34;", "\"")
        .replace("&quot;", "\"")
        .replace("&#60;", "<")
        .replace("&#62;", ">")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&#38;", "&")
        .replace("&amp;", "&")
}

#[track_caller]
fn assert_retry_after(r: &Reply) {
    let v = r
        .headers
        .get("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After: {}", r.text));
    let s: u64 = v.to_str().unwrap().parse().expect("seconds");
    assert!((1..=60).contains(&s), "Retry-After {s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_owners_conversation_is_not_found_through_every_route() {
    let dir = tempdir();
    let server = Server::start(dir.path(), &[]).await;
    let alice = server.client();
    let bob = server.client();
    let id = bob
        .create(json!({"temperature": 0, "max_tokens": 4, "title": "Bob's", "thinking": false}))
        .await;
    let turn = bob.chat(&id, "Hello there").await;
    let mid = turn.message()["id"].as_str().unwrap().to_string();
    let before = snapshot(&bob, &id).await;
    let csrf = alice.csrf_token().await;
    let guessed = uuid::Uuid::now_v7().to_string();

    for target in [id.as_str(), guessed.as_str()] {
        let api = format!("/api/conversations/{target}");
        let replies = vec![
            ("api get", alice.get(&api).await),
            (
                "api patch title",
                alice
                    .send_json(Method::PATCH, &api, &json!({"title": "mine"}))
                    .await,
            ),
            (
                "api patch settings",
                alice
                    .send_json(Method::PATCH, &api, &json!({"temperature": 1.5}))
                    .await,
            ),
            (
                "api send",
                alice
                    .post(&format!("{api}/messages"), &json!({"content": "hi"}))
                    .await,
            ),
            (
                "api stop",
                alice.post(&format!("{api}/stop"), &json!({})).await,
            ),
            (
                "api regenerate",
                alice.post(&format!("{api}/regenerate"), &json!({})).await,
            ),
            (
                "api edit",
                alice
                    .post(&format!("{api}/edit"), &json!({"content": "x"}))
                    .await,
            ),
            ("api export", alice.get(&format!("{api}/export")).await),
            (
                "api export md",
                alice.get(&format!("{api}/export?format=md")).await,
            ),
            ("api events", alice.get(&format!("{api}/events")).await),
            (
                "api delete",
                alice.call(Method::DELETE, &api, None, None).await,
            ),
        ];
        for (what, r) in replies {
            assert_eq!(
                r.status,
                StatusCode::NOT_FOUND,
                "{what} {target}: {}",
                r.text
            );
            assert_eq!(
                r.json["error"]["message"], "conversation not found",
                "{what}"
            );
        }
        let c = format!("/c/{target}");
        let pages = vec![
            ("page get", page(&alice, &csrf, Method::GET, &c, &[]).await),
            (
                "page message",
                page(&alice, &csrf, Method::GET, &format!("{c}/m/{mid}"), &[]).await,
            ),
            (
                "page send",
                page(
                    &alice,
                    &csrf,
                    Method::POST,
                    &format!("{c}/messages"),
                    &[("content", "hi")],
                )
                .await,
            ),
            (
                "page stop",
                page(&alice, &csrf, Method::POST, &format!("{c}/stop"), &[]).await,
            ),
            (
                "page regenerate",
                page(&alice, &csrf, Method::POST, &format!("{c}/regenerate"), &[]).await,
            ),
            (
                "page edit",
                page(
                    &alice,
                    &csrf,
                    Method::POST,
                    &format!("{c}/edit"),
                    &[("content", "x")],
                )
                .await,
            ),
            (
                "page rename",
                page(
                    &alice,
                    &csrf,
                    Method::POST,
                    &format!("{c}/rename"),
                    &[("title", "x")],
                )
                .await,
            ),
            (
                "page settings",
                page(
                    &alice,
                    &csrf,
                    Method::POST,
                    &format!("{c}/settings"),
                    &[("temperature", "1"), ("top_p", "0.5"), ("max_tokens", "9")],
                )
                .await,
            ),
            (
                "page thinking",
                page(
                    &alice,
                    &csrf,
                    Method::POST,
                    &format!("{c}/thinking"),
                    &[("thinking", "on")],
                )
                .await,
            ),
            (
                "page export json",
                page(&alice, &csrf, Method::GET, &format!("{c}/export.json"), &[]).await,
            ),
            (
                "page export md",
                page(&alice, &csrf, Method::GET, &format!("{c}/export.md"), &[]).await,
            ),
            (
                "page delete",
                page(&alice, &csrf, Method::DELETE, &c, &[]).await,
            ),
        ];
        for (what, r) in pages {
            assert_eq!(
                r.status,
                StatusCode::NOT_FOUND,
                "{what} {target}: {}",
                r.text
            );
            assert!(!r.text.contains("Hello there"), "{what} leaked content");
        }
    }
    // Nothing of Bob's changed, and Alice's list does not show it.
    assert_eq!(snapshot(&bob, &id).await, before);
    let list = alice.get("/api/conversations").await;
    assert_eq!(
        list.json["conversations"].as_array().unwrap().len(),
        0,
        "{}",
        list.text
    );
    let sidebar = page(&alice, &csrf, Method::GET, "/conversations", &[]).await;
    assert!(!sidebar.text.contains(&id), "{}", sidebar.text);
    // Bob still reaches it.
    assert_eq!(
        bob.get(&format!("/api/conversations/{id}/export"))
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_regenerate_and_edit_lose_nothing() {
    let dir = tempdir();
    const KEY: &str = "sk-admin-test-key";
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_LIMITS__CONTEXT", "384"),
            ("SMOLCHAT_SCHEDULER__MAX_RUNNING", "1"),
            ("SMOLCHAT_SCHEDULER__QUEUE_SIZE", "1"),
            ("SMOLCHAT_SCHEDULER__MAX_QUEUED_PER_USER", "0"),
            ("SMOLCHAT_SCHEDULER__MAX_RUNNING_PER_USER", "0"),
            ("SMOLCHAT_SERVER__API_KEY", KEY),
        ],
    )
    .await;
    let c = server.client();
    let csrf = c.csrf_token().await;
    let id = c
        .create(json!({"temperature": 0, "max_tokens": 8, "thinking": false}))
        .await;
    c.chat(&id, "Name a colour.").await;
    let before = contents(&c, &id).await;
    assert_eq!(before.len(), 2);

    // Context overflow: an edit whose prompt does not fit the 384-token window.
    let long = "word ".repeat(600);
    let r = c
        .post(
            &format!("/api/conversations/{id}/edit"),
            &json!({"content": long}),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text);
    assert_eq!(r.json["error"]["type"], "context_overflow", "{}", r.text);
    let r = page(
        &c,
        &csrf,
        Method::POST,
        &format!("/c/{id}/edit"),
        &[("content", &long)],
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text);
    assert_eq!(
        contents(&c, &id).await,
        before,
        "an overflowing edit changed nothing"
    );

    // A send racing them: while its reply runs, regenerate and edit are refused (409).
    let racing = c
        .create(json!({"temperature": 0, "max_tokens": 300, "thinking": false}))
        .await;
    let mut events = c.events(&racing).await;
    let r = c.send(&racing, LONG_PROMPT).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
    let sent = contents(&c, &racing).await;
    for r in [
        c.post(
            &format!("/api/conversations/{racing}/regenerate"),
            &json!({}),
        )
        .await,
        c.post(
            &format!("/api/conversations/{racing}/edit"),
            &json!({"content": "changed"}),
        )
        .await,
        page(
            &c,
            &csrf,
            Method::POST,
            &format!("/c/{racing}/regenerate"),
            &[],
        )
        .await,
    ] {
        assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text);
    }
    c.post(&format!("/api/conversations/{racing}/stop"), &json!({}))
        .await;
    events.until("done").await;
    let after: Vec<_> = contents(&c, &racing).await;
    assert_eq!(after.len(), sent.len());
    assert_eq!(
        after.iter().map(|(i, r, _)| (i, r)).collect::<Vec<_>>(),
        sent.iter().map(|(i, r, _)| (i, r)).collect::<Vec<_>>(),
        "the racing send's exchange is intact"
    );
    assert_eq!(after[after.len() - 2].2, LONG_PROMPT);

    // A full queue: an endless admin request runs, another waits in the only queue place.
    let endless = |p: &str| {
        json!({"messages": [{"role": "user", "content": p}], "max_tokens": 4000,
               "ignore_eos": true, "stream": true})
    };
    let http = reqwest::Client::new();
    let open = |body: Value| {
        let req = http
            .post(format!("{}/v1/chat/completions", server.base))
            .bearer_auth(KEY)
            .json(&body);
        async move { req.send().await.expect("stream") }
    };
    let a = open(endless("Count to a million.")).await;
    assert_eq!(a.status(), StatusCode::OK);
    let mut a_body = a.bytes_stream();
    use futures_util::StreamExt;
    a_body.next().await;
    let b = open(endless("Count to a billion.")).await;
    assert_eq!(b.status(), StatusCode::OK);
    let full = common::server::eventually(Duration::from_secs(10), || async {
        let m = c.metrics().await;
        (common::server::metric(&m, "smolchat_queue_depth") == Some(1.0)).then_some(())
    })
    .await;
    assert!(full.is_some(), "the queue did not fill");
    for r in [
        c.post(&format!("/api/conversations/{id}/regenerate"), &json!({}))
            .await,
        c.post(
            &format!("/api/conversations/{id}/edit"),
            &json!({"content": "Name a fruit."}),
        )
        .await,
        page(&c, &csrf, Method::POST, &format!("/c/{id}/regenerate"), &[]).await,
    ] {
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text);
        assert!(r.headers.get("retry-after").is_some(), "{}", r.text);
    }
    assert_eq!(
        contents(&c, &id).await,
        before,
        "refusals under a full queue changed nothing"
    );
    drop(a_body);
    drop(b);

    // Once there is room, regenerate works and replaces the exchange.
    let accepted = common::server::eventually(Duration::from_secs(30), || async {
        let r = c
            .post(&format!("/api/conversations/{id}/regenerate"), &json!({}))
            .await;
        (r.status == StatusCode::ACCEPTED).then_some(r)
    })
    .await
    .expect("regenerate accepted once the queue drained");
    assert_eq!(accepted.json["user_message"]["content"], "Name a colour.");
    let now = contents(&c, &id).await;
    assert_eq!(now.len(), 2);
    assert_eq!(now[0].0, before[0].0, "the same question");
    assert_ne!(now[1].0, before[1].0, "a new reply shown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_user_limits_answer_429_while_others_are_served() {
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER", "24"),
            ("SMOLCHAT_LIMITS__MAX_CONVERSATIONS_PER_USER", "3"),
            ("SMOLCHAT_SCHEDULER__MAX_QUEUED_PER_USER", "2"),
            ("SMOLCHAT_SCHEDULER__MAX_RUNNING_PER_USER", "1"),
        ],
    )
    .await;
    let flooder = server.client();
    let other = server.client();
    let id = flooder
        .create(json!({"temperature": 0, "max_tokens": 40, "thinking": false}))
        .await;

    // The flooder's replies use up its tokens for the minute; then its sends get 429.
    let mut limited = None;
    for _ in 0..6 {
        let mut events = flooder.events(&id).await;
        let r = flooder.send(&id, LONG_PROMPT).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            limited = Some(r);
            break;
        }
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
        events.until("done").await;
    }
    let r = limited.expect("the flooder was never limited");
    assert_retry_after(&r);
    assert!(
        r.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens"),
        "{}",
        r.text
    );
    // Regenerate refused by the limit loses nothing.
    let before = contents(&flooder, &id).await;
    let r = flooder
        .post(&format!("/api/conversations/{id}/regenerate"), &json!({}))
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text);
    assert_eq!(contents(&flooder, &id).await, before);

    // /v1 clients are limited the same way, keyed by who they are (here: the address) …
    let mut v1_limited = None;
    for _ in 0..6 {
        let r = v1(
            &server,
            None,
            &json!({"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 40}),
        )
        .await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            v1_limited = Some(r);
            break;
        }
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    }
    let r = v1_limited.expect("the /v1 client was never limited");
    assert_retry_after(&r);
    assert_eq!(r.json["error"]["code"], "rate_limit_exceeded", "{}", r.text);

    // … while another user's reply still starts at once.
    let theirs = other
        .create(json!({"temperature": 0, "max_tokens": 4, "thinking": false}))
        .await;
    let turn = other.chat(&theirs, "Hello").await;
    assert_eq!(turn.message()["status"], "complete");

    // Stored conversations per user: the fourth is refused with a clear message, until one goes.
    flooder.create(json!({})).await;
    let third = flooder.create(json!({})).await;
    let r = flooder.post("/api/conversations", &json!({})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text);
    assert!(
        r.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("delete"),
        "{}",
        r.text
    );
    assert_retry_after(&r);
    let gone = flooder
        .call(
            Method::DELETE,
            &format!("/api/conversations/{third}"),
            None,
            None,
        )
        .await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT);
    flooder.create(json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cookieless_flood_cannot_create_unbounded_conversations() {
    let dir = tempdir();
    let mut server = Server::start(
        dir.path(),
        &[("SMOLCHAT_LIMITS__CONVERSATIONS_PER_MINUTE", "5")],
    )
    .await;
    let mut created = 0;
    let mut refused = 0;
    for _ in 0..40 {
        // A new client each time: no cookie, so every request is a brand-new guest owner.
        let fresh = Client::new(&server.base);
        let r = fresh.post("/api/conversations", &json!({})).await;
        match r.status {
            StatusCode::CREATED => created += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_retry_after(&r);
                refused += 1;
            }
            other => panic!("{other}: {}", r.text),
        }
    }
    assert_eq!(
        created, 5,
        "one address gets conversations_per_minute at most"
    );
    assert_eq!(refused, 35);
    server.kill();
    let store = Store::open(&server.database_url).await.expect("store");
    let all = store
        .list_all_conversations_page(&PageRequest {
            limit: 200,
            before: None,
        })
        .await
        .expect("list");
    assert_eq!(all.items.len(), 5, "nothing beyond the bound was stored");
    let owners: std::collections::HashSet<_> = all.items.iter().map(|c| c.owner.clone()).collect();
    assert_eq!(owners.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_paginate_in_the_api_the_sidebar_and_the_admin_table() {
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_LIMITS__CONVERSATIONS_PER_MINUTE", "0"),
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", "admin-token-for-tests"),
        ],
    )
    .await;
    let c = server.client();
    let mut ids = Vec::new();
    for i in 0..55 {
        ids.push(c.create(json!({"title": format!("chat {i}")})).await);
    }
    ids.reverse(); // most recent first
    let mut seen = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let path = match &next {
            Some(n) => format!("/api/conversations?limit=20&before={n}"),
            None => "/api/conversations?limit=20".to_string(),
        };
        let r = c.get(&path).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        let page = r.json["conversations"].as_array().unwrap();
        assert!(page.len() <= 20);
        seen.extend(page.iter().map(|v| v["id"].as_str().unwrap().to_string()));
        match r.json["next"].as_str() {
            Some(n) => next = Some(n.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, ids, "every conversation once, newest first");
    for bad in ["limit=0", "limit=1000", "before=nonsense"] {
        let r = c.get(&format!("/api/conversations?{bad}")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {}", r.text);
    }

    // The sidebar: the first 50 and a "More" button that fetches the rest.
    let home = c.get("/").await;
    assert_eq!(
        home.text.matches("class=\"conv").count() - home.text.matches("class=\"conv-").count(),
        50
    );
    assert!(
        home.text.contains("id=\"more-conversations\""),
        "no More button"
    );
    let start = home.text.find("\"before\": \"").expect("cursor") + "\"before\": \"".len();
    let cursor = &home.text[start..start + home.text[start..].find('"').unwrap()];
    let more = c.get(&format!("/conversations?before={cursor}")).await;
    assert_eq!(more.status, StatusCode::OK, "{}", more.text);
    for id in &ids[50..] {
        assert!(more.text.contains(id.as_str()), "page 2 lacks {id}");
    }
    assert!(
        !more.text.contains("more-conversations"),
        "the last page has no More"
    );

    // The admin table is one page at a time too.
    let http = reqwest::Client::new();
    let csrf = c.csrf_token().await;
    let login = http
        .post(format!("{}/admin/login", server.base))
        .header(COOKIE, c.cookie().unwrap())
        .header("X-CSRF-Token", &csrf)
        .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body("token=admin-token-for-tests")
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), StatusCode::NO_CONTENT);
    let session = login.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let live = http
        .get(format!("{}/admin/live", server.base))
        .header(COOKIE, session)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(live.matches("<tr data-id=").count(), 50, "one page of rows");
    assert!(live.contains("id=\"older\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_then_import_round_trips_and_bad_imports_are_refused() {
    let dir = tempdir();
    let server = Server::start(dir.path(), &[("SMOLCHAT_LIMITS__MAX_IMPORT_MESSAGES", "6")]).await;
    let c = server.client();
    let id = c
        .create(
            json!({"temperature": 0, "max_tokens": 24, "title": "Colours",
                       "system_prompt": "Answer briefly."}),
        )
        .await;
    c.chat(&id, "Name a colour.").await;
    c.chat(&id, "And another one?").await;
    // Organised: in a folder, pinned, tagged (exported by the folder's name).
    let folder = c.post("/api/folders", &json!({"name": "Palette"})).await;
    assert_eq!(folder.status, StatusCode::CREATED, "{}", folder.text);
    let r = c
        .send_json(
            Method::PATCH,
            &format!("/api/conversations/{id}"),
            &json!({"folder_id": folder.json["id"], "pinned": true, "tags": ["Art", "colour"]}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);

    let r = c.get(&format!("/api/conversations/{id}/export")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.headers["content-disposition"]
        .to_str()
        .unwrap()
        .starts_with("attachment; filename=\"Colours.json\""));
    let doc = r.json.clone();
    assert_eq!(doc["format"], "smolchat.conversation");
    assert_eq!(doc["version"], 2);
    let messages = doc["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 4);
    for (i, m) in messages.iter().enumerate() {
        for field in ["role", "content", "status", "created_at"] {
            assert!(!m[field].is_null(), "{field} missing: {m}");
        }
        // The tree, by names inside the document (no server id leaves it).
        assert_eq!(m["id"], format!("m{}", i + 1));
        let parent = if i == 0 {
            Value::Null
        } else {
            json!(format!("m{i}"))
        };
        assert_eq!(m.get("parent").cloned().unwrap_or(Value::Null), parent);
    }
    assert_eq!(doc["current"], "m4");
    assert!(messages[1]["raw"].is_string() && messages[1]["completion_tokens"].is_number());
    assert!(messages[1]["timings"].is_object());
    assert_eq!(
        doc["organisation"],
        json!({"pinned": true, "archived": false, "folder": "Palette", "tags": ["art", "colour"]})
    );

    // Import it (as another owner), export again: identical but for the conversation's times.
    let other = server.client();
    let r = other.post("/api/conversations/import", &doc).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    let new_id = r.json["id"].as_str().unwrap().to_string();
    assert_ne!(new_id, id, "import never reuses an id");
    let again = other
        .get(&format!("/api/conversations/{new_id}/export"))
        .await
        .json;
    let strip = |mut v: Value| {
        v.as_object_mut().unwrap().remove("created_at");
        v.as_object_mut().unwrap().remove("updated_at");
        v
    };
    assert_eq!(strip(again), strip(doc.clone()));
    // The original owner's conversation is untouched, and the import is only the importer's.
    assert_eq!(
        c.get(&format!("/api/conversations/{new_id}")).await.status,
        StatusCode::NOT_FOUND
    );
    // The importer got a folder of that name, with the conversation in it.
    let theirs = other.get("/api/folders").await.json;
    assert_eq!(theirs["folders"][0]["name"], "Palette");
    assert_eq!(theirs["folders"][0]["conversations"], 1);
    // The imported conversation goes on like any other.
    other.chat(&new_id, "One more?").await;

    // Markdown, through the page route.
    let csrf = c.csrf_token().await;
    let md = page(&c, &csrf, Method::GET, &format!("/c/{id}/export.md"), &[]).await;
    assert_eq!(md.status, StatusCode::OK);
    assert!(md.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/markdown"));
    assert!(md.text.starts_with("# Colours\n"), "{}", md.text);
    assert!(md.text.contains("> Answer briefly."));
    assert!(md.text.contains("## User\n\nName a colour."));
    assert!(md.text.contains("## Assistant"));
    let json_page = page(&c, &csrf, Method::GET, &format!("/c/{id}/export.json"), &[]).await;
    assert_eq!(json_page.json, doc);

    // Bad documents are refused with what is wrong, and store nothing.
    let count = || async {
        other.get("/api/conversations").await.json["conversations"]
            .as_array()
            .unwrap()
            .len()
    };
    let stored = count().await;
    let with = |f: &dyn Fn(&mut Value)| {
        let mut d = doc.clone();
        f(&mut d);
        d
    };
    let cases: Vec<(Value, StatusCode, &str)> = vec![
        (
            with(&|d| d["format"] = json!("other")),
            StatusCode::BAD_REQUEST,
            "format",
        ),
        (
            with(&|d| d["version"] = json!(3)),
            StatusCode::BAD_REQUEST,
            "version",
        ),
        (
            with(&|d| d["messages"][1]["parent"] = json!("m9")),
            StatusCode::BAD_REQUEST,
            "not the `id` of an earlier message",
        ),
        (
            with(&|d| d["messages"][1]["id"] = json!("m1")),
            StatusCode::BAD_REQUEST,
            "used twice",
        ),
        (
            with(&|d| d["current"] = json!("nowhere")),
            StatusCode::BAD_REQUEST,
            "current",
        ),
        (
            with(&|d| d["messages"][0]["role"] = json!("system")),
            StatusCode::BAD_REQUEST,
            "role",
        ),
        (
            with(&|d| d["messages"][0]["role"] = json!("wizard")),
            StatusCode::BAD_REQUEST,
            "wizard",
        ),
        (
            with(&|d| d["messages"][0]["content"] = json!("a\u{0}b")),
            StatusCode::BAD_REQUEST,
            "NUL",
        ),
        (
            with(&|d| d["messages"][0]["created_at"] = json!("yesterday")),
            StatusCode::BAD_REQUEST,
            "created_at",
        ),
        (
            with(&|d| d["settings"]["top_p"] = json!(0)),
            StatusCode::BAD_REQUEST,
            "top_p",
        ),
        (
            with(&|d| d["settings"]["ignore_eos"] = json!(true)),
            StatusCode::FORBIDDEN,
            "ignore_eos",
        ),
        (
            with(&|d| d["title"] = json!("t".repeat(201))),
            StatusCode::BAD_REQUEST,
            "title",
        ),
        (
            with(&|d| d["surprise"] = json!(1)),
            StatusCode::BAD_REQUEST,
            "surprise",
        ),
        (
            with(&|d| {
                let m = d["messages"].as_array().unwrap().clone();
                d["messages"] = json!([m.clone(), m].concat());
            }),
            StatusCode::PAYLOAD_TOO_LARGE,
            "at most 6",
        ),
    ];
    for (body, status, needle) in cases {
        let r = other.post("/api/conversations/import", &body).await;
        assert_eq!(r.status, status, "{needle}: {}", r.text);
        assert!(r.text.contains(needle), "{needle}: {}", r.text);
    }
    assert_eq!(count().await, stored, "refused imports stored nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_setting_gets_the_same_verdict_everywhere_and_ignore_eos_is_for_admins() {
    let dir = tempdir();
    let server = Server::start(dir.path(), &[]).await;
    let c = server.client();
    let id = c.create(json!({})).await;
    let csrf = c.csrf_token().await;
    let settings_page = |top_p: &'static str, temperature: &'static str| {
        let c = c.clone();
        let csrf = csrf.clone();
        let id = id.clone();
        async move {
            page(
                &c,
                &csrf,
                Method::POST,
                &format!("/c/{id}/settings"),
                &[
                    ("temperature", temperature),
                    ("top_p", top_p),
                    ("max_tokens", "10"),
                ],
            )
            .await
        }
    };
    let alert = |html: &str| {
        let start = html.find("class=\"alert\"").expect("alert");
        let text = &html[start..];
        let text = &text[text.find('>').unwrap() + 1..];
        text[..text.find('<').unwrap()].trim().to_string()
    };
    for (field, value, form) in [
        ("top_p", json!(0), ("0", "0.5")),
        ("temperature", json!(2.5), ("0.9", "2.5")),
    ] {
        let page_r = settings_page(form.0, form.1).await;
        assert_eq!(page_r.status, StatusCode::BAD_REQUEST, "{}", page_r.text);
        let api_r = c
            .send_json(
                Method::PATCH,
                &format!("/api/conversations/{id}"),
                &object(field, value.clone()),
            )
            .await;
        assert_eq!(api_r.status, StatusCode::BAD_REQUEST, "{}", api_r.text);
        let v1_r = v1(&server, None, &{
            let mut body = object(field, value.clone());
            body["messages"] = json!([{"role": "user", "content": "hi"}]);
            body
        })
        .await;
        assert_eq!(v1_r.status, StatusCode::BAD_REQUEST, "{}", v1_r.text);
        assert_eq!(v1_r.json["error"]["param"], field);
        let message = api_r.json["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains(field), "{message}");
        assert_eq!(unescape(&alert(&page_r.text)), message);
        assert_eq!(v1_r.json["error"]["message"].as_str().unwrap(), message);
    }

    // ignore_eos: refused for guests on the JSON API (create and patch) and on /v1 without the
    // global key.
    let r = c
        .post("/api/conversations", &json!({"ignore_eos": true}))
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.text);
    assert!(r.json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("admin"));
    let r = c
        .send_json(
            Method::PATCH,
            &format!("/api/conversations/{id}"),
            &json!({"ignore_eos": true}),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.text);
    let r = v1(
        &server,
        None,
        &json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true, "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.text);
    assert_eq!(r.json["error"]["param"], "ignore_eos");
    let v1_message = r.json["error"]["message"].as_str().unwrap().to_string();
    let r = page(
        &c,
        &csrf,
        Method::POST,
        &format!("/c/{id}/settings"),
        &[
            ("temperature", "0.5"),
            ("top_p", "0.9"),
            ("max_tokens", "10"),
            ("ignore_eos", "on"),
        ],
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.text);
    assert_eq!(
        unescape(&alert(&r.text)),
        v1_message,
        "the same words everywhere"
    );
    assert_eq!(c.conversation(&id).await["settings"]["ignore_eos"], false);
    assert_eq!(
        c.conversation(&id).await["settings"]["max_tokens"],
        1024,
        "nothing saved"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_api_key_may_ignore_eos() {
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[("SMOLCHAT_SERVER__API_KEY", "sk-root-global-key")],
    )
    .await;
    let r = v1(
        &server,
        Some("sk-root-global-key"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true,
                "max_tokens": 12, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json["usage"]["completion_tokens"], 12, "{}", r.text);
}
