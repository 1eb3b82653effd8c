//! Three `smolchat serve` replicas on one PostgreSQL database, behind nginx (round robin, as a
//! load balancer that knows nothing of conversations would route): many users' turns through
//! JSON + SSE lose nothing; a viewer that reconnects to another replica mid-reply receives the
//! rest of it; stop and delete work from any replica; a replica killed mid-reply has its reply
//! marked interrupted while the others' replies finish, and its users continue elsewhere.
//!
//! Skipped (with the reason printed) where no PostgreSQL server or nginx can be had; `make test`
//! installs and starts both.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::server::{Client, Server, SseStream, EVENT_TIMEOUT};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// Shared by every replica: a cookie signed by one is valid on the others.
const COOKIE_SECRET: &str =
    "replicas-test-cookie-secret-0123456789abcdef0123456789abcdef0123456789abcdef";
/// Short heartbeats and lease, so a killed replica is noticed within seconds.
const ADMIN_TOKEN: &str = "replicas-admin-token";
const HEARTBEAT_MS: &str = "500";
const LEASE_MS: &str = "3000";

/// Three replicas on a fresh PostgreSQL database; `None` when PostgreSQL or nginx is missing.
async fn cluster(dir: &Path, affinity: bool) -> Option<(String, Vec<Server>)> {
    if common::nginx::missing() {
        return None;
    }
    let url = common::pg::fresh_database().await?;
    let affinity = affinity.to_string();
    // Each replica's KV spill tier is its own folder (named after the replica) in this one.
    let spill = dir.join("kv-spill").display().to_string();
    let env = [
        ("SMOLCHAT_SCHEDULER__KV_SPILL_DIR", spill.as_str()),
        ("SMOLCHAT_SERVER__COOKIE_SECRET", COOKIE_SECRET),
        ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
        ("SMOLCHAT_REPLICA__HEARTBEAT_MS", HEARTBEAT_MS),
        ("SMOLCHAT_REPLICA__LEASE_MS", LEASE_MS),
        ("SMOLCHAT_REPLICA__AFFINITY", affinity.as_str()),
        ("SMOLCHAT_MODEL__THREADS", "1"),
        // Many users share one address (the proxy) here.
        ("SMOLCHAT_LIMITS__CONVERSATIONS_PER_MINUTE", "0"),
        ("SMOLCHAT_LIMITS__MAX_STREAMS_PER_USER", "1024"),
        ("SMOLCHAT_SCHEDULER__QUEUE_SIZE", "256"),
    ];
    let mut servers = Vec::new();
    for i in 0..3 {
        let sub = dir.join(format!("replica-{i}"));
        std::fs::create_dir_all(&sub).expect("replica dir");
        servers.push(Server::start_on(&sub, &url, &env).await);
    }
    // Every replica sees all three alive before the test routes anything.
    let probe = servers[0].client();
    let seen = common::server::eventually(Duration::from_secs(20), || {
        let probe = &probe;
        async move {
            let text = probe.metrics().await;
            (common::server::metric(&text, "smolchat_live_replicas") == Some(3.0)).then_some(())
        }
    })
    .await;
    assert!(seen.is_some(), "the replicas did not see each other");
    Some((url, servers))
}

/// One user's conversation through the proxy: `turns` turns, each answered in full; returns
/// (prompt tokens, cached tokens) of each turn's reply.
async fn converse(base: &str, user: usize, turns: usize) -> Vec<(u64, u64)> {
    let client = Client::new(base);
    let id = client.create_greedy(12).await;
    let mut out = Vec::new();
    let mut previous = Vec::new();
    for turn in 0..turns {
        let mut events = client.events(&id).await;
        let r = client
            .send(&id, &format!("User {user}, turn {turn}: name a colour."))
            .await;
        if r.status != StatusCode::ACCEPTED {
            let messages = client.messages(&id).await;
            panic!(
                "user {user} turn {turn}: {} {}\nprevious turn's events: {previous:?}\nmessages: {messages:?}",
                r.status, r.json
            );
        }
        let got = events.until("done").await;
        previous = got
            .iter()
            .map(|e| {
                format!(
                    "{} {}",
                    e.event,
                    e.data
                        .get("assistant_message_id")
                        .or(e.data.get("message").and_then(|m| m.get("id")))
                        .cloned()
                        .unwrap_or_default()
                )
            })
            .collect();
        let done = got.last().expect("a done event");
        let summary = &done.data["summary"];
        assert_eq!(done.data["message"]["status"], "complete", "{}", done.data);
        out.push((
            summary["prompt_tokens"].as_u64().unwrap_or(0),
            summary["cached_tokens"].as_u64().unwrap_or(0),
        ));
    }
    let messages = client.messages(&id).await;
    assert_eq!(messages.len(), 2 * turns, "user {user}: {messages:?}");
    for m in &messages {
        assert_eq!(m["status"], "complete", "user {user}: {m}");
    }
    out
}

/// Users × turns through the proxy; the share of turns 2.. whose prompt came from a warm cache.
async fn load(base: &str, users: usize, turns: usize) -> f64 {
    let tasks: Vec<_> = (0..users)
        .map(|u| {
            let base = base.to_string();
            tokio::spawn(async move { converse(&base, u, turns).await })
        })
        .collect();
    let (mut prompt, mut cached) = (0u64, 0u64);
    for t in tasks {
        for (p, c) in t.await.expect("a user task").into_iter().skip(1) {
            prompt += p;
            cached += c;
        }
    }
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_behind_a_proxy_lose_nothing_and_keep_caches_warm() {
    let dir = tempfile::tempdir().unwrap();
    let Some((url, servers)) = cluster(dir.path(), true).await else {
        return;
    };
    let proxy = common::nginx::start(dir.path(), &servers.iter().collect::<Vec<_>>()).await;
    let started = Instant::now();
    let warm = load(&proxy.base, 64, 3).await;
    eprintln!(
        "64 users x 3 turns through nginx over 3 replicas with affinity: {:.1} s, {:.0}% of \
         later turns' prompt tokens from a warm cache",
        started.elapsed().as_secs_f64(),
        warm * 100.0
    );
    // Every later turn met its conversation's cache: only the new user message (and the reply
    // before it) was computed.
    assert!(warm > 0.5, "warm-cache share with affinity: {warm}");

    // Turns were forwarded to their replicas (nginx spread them evenly).
    let mut forwarded = 0.0;
    for s in &servers {
        let text = s.client().metrics().await;
        forwarded += common::server::metric(
            &text,
            "smolchat_forwarded_turns_total{outcome=\"forwarded\"}",
        )
        .unwrap_or(0.0);
    }
    assert!(forwarded > 0.0, "no turn was forwarded");

    // The admin page (on any replica) lists the three replicas, live, with their load, and
    // which replica holds each conversation's cache.
    let mut admin = common::browser_client::Browser::at(&servers[1], 1, "/admin").await;
    let login = admin
        .call(
            reqwest::Method::POST,
            "/admin/login",
            Some(&format!("token={ADMIN_TOKEN}")),
            &[],
        )
        .await;
    assert!(
        login.status.is_success() || login.status.is_redirection(),
        "{}",
        login.status
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let live = loop {
        let page = admin.get("/admin/live").await;
        if page.text.matches("class=\"replica-live\"").count() == 3 {
            break page.text;
        }
        assert!(
            Instant::now() < deadline,
            "the admin page did not list three live replicas: {}",
            page.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(live.contains("id=\"replicas\""), "{live}");
    assert!(live.contains("(this page)"), "{live}");
    for s in &servers {
        assert!(
            live.contains(&format!(":{}</code>", s.port)),
            "replica {} missing",
            s.port
        );
    }
    // The conversations table's replica column: `<td><code>NAME</code></td>` (the replicas
    // table puts more after a name).
    assert!(
        servers.iter().any(|s| {
            let name = replica_name(&live, s.port);
            !name.is_empty() && live.contains(&format!("<td><code>{name}</code></td>"))
        }),
        "no conversation shows the replica holding its cache"
    );

    // Nothing lost, from the database's point of view too.
    let store = smolchat_store::Store::open_beside_server(&url)
        .await
        .unwrap();
    let all = store.list_all_conversations().await.unwrap();
    assert_eq!(all.len(), 64);
    assert!(all.iter().all(|c| c.message_count == 6));
    drop(proxy);
}

/// Reads events until `n` answer events arrived; returns their text.
async fn answer_text(stream: &mut SseStream, n: usize) -> String {
    let mut text = String::new();
    let mut seen = 0;
    while seen < n {
        let ev = tokio::time::timeout(EVENT_TIMEOUT, stream.next())
            .await
            .expect("an event in time")
            .expect("the stream went on");
        if ev.event == "answer" {
            text.push_str(ev.data["text"].as_str().unwrap_or(""));
            seen += 1;
        }
        assert_ne!(
            ev.event, "done",
            "the reply ended before the test could follow it"
        );
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replies_follow_the_user_across_replicas_and_survive_a_killed_one() {
    let dir = tempfile::tempdir().unwrap();
    let Some((_url, mut servers)) = cluster(dir.path(), true).await else {
        return;
    };
    let story = "Tell me a very long story about a lighthouse keeper, with many details.";

    // 1. A viewer that reconnects to another replica mid-reply receives the rest of it.
    let (a, b) = (&servers[0], &servers[1]);
    let alice = a.client();
    let id = alice
        .create(json!({"temperature": 0, "max_tokens": 300}))
        .await;
    let mut on_a = alice.events(&id).await;
    let r = alice.send(&id, story).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.json);
    let seen_on_a = answer_text(&mut on_a, 5).await;
    drop(on_a); // the page reloads…
    let alice_on_b = Client::with_cookie(&b.base, alice.cookie()); // …and lands on b
    let mut on_b = alice_on_b.events(&id).await;
    let got = on_b.until("done").await;
    let relayed: String = got
        .iter()
        .filter(|e| e.event == "answer")
        .map(|e| e.data["text"].as_str().unwrap_or("").to_string())
        .collect();
    let done = got.last().expect("done");
    let stored = done.data["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert_eq!(done.data["message"]["status"], "complete", "{}", done.data);
    assert!(stored.starts_with(&seen_on_a), "{seen_on_a:?} / {stored:?}");
    assert_eq!(
        relayed, stored,
        "b's viewer got the whole reply, no gap, no repeat"
    );

    // 1b. A page form turn (CSRF header, as the page's script sends it) posted to b for a's
    //     conversation is forwarded to a and answered there (202), the reply generated on a.
    let csrf = alice_on_b.csrf_token().await;
    let mut on_a = alice.events(&id).await;
    let form = format!("content={}", common::server::form_encode("And then?"));
    let page = reqwest::Client::new()
        .post(format!("{}/c/{id}/messages", b.base))
        .header("cookie", alice.cookie().unwrap_or_default())
        .header("x-csrf-token", csrf)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form)
        .send()
        .await
        .expect("page post");
    let status = page.status();
    let text = page.text().await.unwrap_or_default();
    assert_eq!(status, StatusCode::ACCEPTED, "{text}");
    let got = on_a.until("done").await;
    assert_eq!(got.last().unwrap().data["message"]["status"], "complete");
    assert_eq!(alice.messages(&id).await.len(), 4);
    let forwarded = common::server::metric(
        &b.client().metrics().await,
        "smolchat_forwarded_turns_total{outcome=\"forwarded\"}",
    );
    assert!(
        forwarded.unwrap_or(0.0) >= 1.0,
        "b did not forward the page turn"
    );

    // 2. Stop from another replica: the reply generated on a ends as stopped.
    let id2 = alice
        .create(json!({"temperature": 0, "max_tokens": 300}))
        .await;
    let mut watch = alice.events(&id2).await;
    assert_eq!(alice.send(&id2, story).await.status, StatusCode::ACCEPTED);
    answer_text(&mut watch, 3).await;
    let stop = alice_on_b
        .post(&format!("/api/conversations/{id2}/stop"), &json!({}))
        .await;
    assert!(stop.status.is_success(), "{} {}", stop.status, stop.json);
    let got = watch.until("done").await;
    assert_eq!(got.last().unwrap().data["message"]["status"], "stopped");

    // 3. Delete from another replica while a generates: gone everywhere, a's reply ends.
    let id3 = alice
        .create(json!({"temperature": 0, "max_tokens": 300}))
        .await;
    let mut watch = alice.events(&id3).await;
    assert_eq!(alice.send(&id3, story).await.status, StatusCode::ACCEPTED);
    answer_text(&mut watch, 3).await;
    let del = alice_on_b
        .send_json(
            reqwest::Method::DELETE,
            &format!("/api/conversations/{id3}"),
            &json!({}),
        )
        .await;
    assert!(del.status.is_success(), "{} {}", del.status, del.json);
    assert_eq!(
        alice.get(&format!("/api/conversations/{id3}")).await.status,
        StatusCode::NOT_FOUND
    );
    let ended = tokio::time::timeout(EVENT_TIMEOUT, async {
        while watch.next().await.is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "a's stream did not end after the delete");

    // 4. SIGKILL of one replica mid-reply: its reply is marked interrupted, the others'
    //    replies finish, and its user continues on another replica after a cache rebuild.
    let mut runs = Vec::new();
    for s in &servers {
        let c = s.client();
        let id = c.create(json!({"temperature": 0, "max_tokens": 300})).await;
        let mut events = c.events(&id).await;
        assert_eq!(c.send(&id, story).await.status, StatusCode::ACCEPTED);
        answer_text(&mut events, 3).await;
        runs.push((c, id, events));
    }
    // Wait until a partial save (every second) of the reply about to be cut is in the store,
    // as another replica reads it.
    let (victim_client, victim_id) = (runs[2].0.clone(), runs[2].1.clone());
    let reader = Client::with_cookie(&servers[0].base, victim_client.cookie());
    let saved = common::server::eventually(Duration::from_secs(30), || {
        let (reader, victim_id) = (&reader, &victim_id);
        async move {
            let messages = reader.messages(victim_id).await;
            let last = messages.last()?;
            (last["status"] == "streaming" && !last["content"].as_str()?.is_empty()).then_some(())
        }
    })
    .await;
    assert!(saved.is_some(), "no partial save within 30 s (hang guard)");
    servers[2].kill();
    runs.pop();
    for (_, _, events) in runs.iter_mut() {
        let got = events.until("done").await;
        assert_eq!(got.last().unwrap().data["message"]["status"], "complete");
    }
    let survivor = Client::with_cookie(&servers[0].base, victim_client.cookie());
    let interrupted = common::server::eventually(Duration::from_secs(20), || {
        let survivor = &survivor;
        let victim_id = &victim_id;
        async move {
            let messages = survivor.messages(victim_id).await;
            (messages.last()?["status"] == "interrupted").then_some(messages)
        }
    })
    .await
    .expect("the killed replica's reply was not marked interrupted");
    let partial = interrupted.last().unwrap()["content"]
        .as_str()
        .unwrap_or("");
    assert!(!partial.is_empty(), "the partial reply was kept");
    // The user goes on, on a live replica (whichever now owns the conversation).
    let mut events = survivor.events(&victim_id).await;
    let r = survivor.send(&victim_id, "Go on, briefly.").await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.json);
    let got = events.until("done").await;
    let done = &got.last().unwrap().data;
    assert_eq!(done["message"]["status"], "complete", "{done}");
    assert_eq!(survivor.messages(&victim_id).await.len(), 4);
    // The KV tier is per replica: the new owner has nothing of the conversation, in memory or
    // on disk, so it computes the prompt (nothing restored from anywhere).
    assert_eq!(done["summary"]["cached_tokens"], json!(0), "{done}");
    assert_eq!(done["summary"]["restored_tokens"], json!(0), "{done}");
    let mut folders: Vec<String> = std::fs::read_dir(dir.path().join("kv-spill"))
        .expect("the spill folder")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    folders.dedup();
    assert_eq!(
        folders.len(),
        3,
        "one spill folder per replica: {folders:?}"
    );
    let _: Value = done.clone();
}

/// The warm-cache benchmark of docs/BENCHMARKS.md ("Replicas"): the same load through nginx
/// (round robin) with smolchat's affinity on, then off (each replica answers what it
/// receives, as with a random load balancer). Run with `make bench-replicas`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark (two full three-replica runs): make bench-replicas"]
async fn warm_cache_share_with_affinity_and_with_random_routing() {
    let users: usize = std::env::var("SMOLTEST_BENCH_USERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let turns: usize = std::env::var("SMOLTEST_BENCH_TURNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut shares = Vec::new();
    for affinity in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let Some((_url, servers)) = cluster(dir.path(), affinity).await else {
            return;
        };
        let proxy = common::nginx::start(dir.path(), &servers.iter().collect::<Vec<_>>()).await;
        let started = Instant::now();
        let share = load(&proxy.base, users, turns).await;
        println!(
            "affinity={affinity}: {users} users x {turns} turns in {:.1} s; {:.1}% of the prompt \
             tokens of turns 2..{turns} came from a warm cache",
            started.elapsed().as_secs_f64(),
            share * 100.0
        );
        shares.push(share);
    }
    assert!(
        shares[0] > shares[1],
        "affinity {} vs random {}",
        shares[0],
        shares[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reflects_the_database() {
    let Some(url) = common::pg::fresh_database().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("SMOLCHAT_SERVER__COOKIE_SECRET", COOKIE_SECRET),
        ("SMOLCHAT_MODEL__THREADS", "1"),
    ];
    let server = Server::start_on(dir.path(), &url, &env).await;
    let c = server.client();
    let r = c.get("/readyz").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["database"], "postgres");

    // Cut the database off: no new connections, the open ones ended.
    let (base, name) = url.rsplit_once('/').unwrap();
    let admin = format!("{base}/postgres");
    let run = |sql: String| {
        let admin = admin.clone();
        async move {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&admin).await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&mut conn)
                .await
                .unwrap();
        }
    };
    run(format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false")).await;
    run(format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
    ))
    .await;
    let down = common::server::eventually(Duration::from_secs(20), || {
        let c = &c;
        async move {
            let r = c.get("/readyz").await;
            (r.status == StatusCode::SERVICE_UNAVAILABLE).then_some(r)
        }
    })
    .await
    .expect("/readyz stayed 200 without a database");
    let message = down.json["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("database"), "{message}");

    run(format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true")).await;
    let up = common::server::eventually(Duration::from_secs(30), || {
        let c = &c;
        async move { (c.get("/readyz").await.status == StatusCode::OK).then_some(()) }
    })
    .await;
    assert!(up.is_some(), "/readyz did not recover with the database");
}

/// The name the admin page shows for the replica on `port` (the default name is
/// `hostname:port`).
fn replica_name(page: &str, port: u16) -> String {
    let tail = format!(":{port}</code>");
    page.find(&tail)
        .and_then(|end| {
            let start = page[..end].rfind("<code>")? + "<code>".len();
            Some(format!("{}:{port}", &page[start..end]))
        })
        .unwrap_or_default()
}

/// Issue 21, findings 8 and 13: between replicas only what is signed with the shared secret is
/// believed. A forwarding header written by an outside client no longer keeps a turn from its
/// replica (the turn is forwarded as usual); a forwarded turn's body is read under the body
/// timeout (a declared body that never comes gets 408, as everywhere else); and a bus message
/// without the secret's signature (any role that can `NOTIFY` the channel could send one) is
/// ignored, while a signed one is acted on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forwarding_and_the_bus_believe_only_what_is_signed() {
    let Some(url) = common::pg::fresh_database().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [
        ("SMOLCHAT_SERVER__COOKIE_SECRET", COOKIE_SECRET),
        ("SMOLCHAT_REPLICA__HEARTBEAT_MS", HEARTBEAT_MS),
        ("SMOLCHAT_REPLICA__LEASE_MS", LEASE_MS),
        ("SMOLCHAT_MODEL__THREADS", "1"),
        ("SMOLCHAT_LIMITS__BODY_TIMEOUT_S", "2"),
    ];
    let mut servers = Vec::new();
    for i in 0..2 {
        let sub = dir.path().join(format!("replica-{i}"));
        std::fs::create_dir_all(&sub).expect("replica dir");
        servers.push(Server::start_on(&sub, &url, &env).await);
    }
    let (a, b) = (&servers[0], &servers[1]);
    for s in [a, b] {
        let probe = s.client();
        let seen = common::server::eventually(Duration::from_secs(20), || {
            let probe = &probe;
            async move {
                let text = probe.metrics().await;
                (common::server::metric(&text, "smolchat_live_replicas") == Some(2.0)).then_some(())
            }
        })
        .await;
        assert!(seen.is_some(), "the replicas did not see each other");
    }
    // A conversation that `b` owns (a replica creates ids it owns), used through `a`.
    let user = Client::new(&b.base);
    let id = user
        .create(json!({"temperature": 0, "max_tokens": 3}))
        .await;
    let via_a = Client::with_cookie(&a.base, user.cookie());
    let forwarded = || async {
        let text = via_a.metrics().await;
        common::server::metric(
            &text,
            "smolchat_forwarded_turns_total{outcome=\"forwarded\"}",
        )
        .unwrap_or(0.0)
    };

    // A turn to `a` carrying a forwarding header nobody signed: forwarded to `b` all the same.
    let before = forwarded().await;
    let r = reqwest::Client::new()
        .post(format!("{}/api/conversations/{id}/messages", a.base))
        .header(reqwest::header::COOKIE, user.cookie().expect("cookie"))
        .header("x-smolchat-forwarded-by", b.pid().to_string())
        .json(&json!({"content": "Hello"}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    assert_eq!(
        forwarded().await,
        before + 1.0,
        "the forged header kept the turn here"
    );
    wait_idle(&user, &id).await;

    // A forwarded turn whose declared body never arrives: 408 after the body timeout (2 s), not
    // a connection held for ever. The deadline is the hang guard.
    let mut raw = tokio::net::TcpStream::connect(format!("127.0.0.1:{}", a.port))
        .await
        .expect("connect");
    let head = format!(
        "POST /api/conversations/{id}/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: {}\r\n\
         Content-Type: application/json\r\nContent-Length: 4000000\r\n\r\n",
        user.cookie().expect("cookie")
    );
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    raw.write_all(head.as_bytes()).await.expect("write");
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(30), raw.read(&mut answer))
        .await
        .expect("no answer within 30 s to a body that never came (hang guard)")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    // The bus. A viewer on `a` of the conversation `b` generates in.
    let mut viewer = via_a.events(&id).await;
    let payload = json!({"c": id, "from": uuid::Uuid::now_v7(), "k": "deleted"}).to_string();
    let mut pg = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("connect to the database");
    // Unsigned, as a role on the database could send it: ignored.
    sqlx::query("SELECT pg_notify('smolchat_cluster', $1)")
        .bind(&payload)
        .execute(&mut pg)
        .await
        .expect("notify");
    // A turn committed after it: notifications arrive in commit order, so the viewer's session
    // had the unsigned message before this reply's events, and still follows the reply.
    let sent = user.send(&id, "Again").await;
    assert_eq!(sent.status, StatusCode::ACCEPTED, "{}", sent.text);
    viewer.until("done").await;
    let text = via_a.metrics().await;
    assert!(
        common::server::metric(&text, "smolchat_bus_forgeries_total").unwrap_or(0.0) >= 1.0,
        "the unsigned message was not counted"
    );
    // Signed with the shared secret, the same message is believed: the session there ends,
    // and with it the viewer's stream.
    let mac =
        smolchat_auth::secret::fingerprint(COOKIE_SECRET.as_bytes(), "smolchat-bus-v1", &payload);
    sqlx::query("SELECT pg_notify('smolchat_cluster', $1)")
        .bind(format!("{mac}.{payload}"))
        .execute(&mut pg)
        .await
        .expect("notify");
    loop {
        match viewer.next().await {
            None => break,
            Some(ev) => assert_ne!(ev.event, "error", "{ev:?}"),
        }
    }
}

/// Waits until the conversation's reply is no longer running.
async fn wait_idle(c: &Client, id: &str) {
    let done = common::server::eventually(Duration::from_secs(120), || async {
        let v = c.conversation(id).await;
        (!v["replying"].as_bool().unwrap_or(false)).then_some(())
    })
    .await;
    assert!(
        done.is_some(),
        "the reply did not finish (hang guard: 120 s)"
    );
}
