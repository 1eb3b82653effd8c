//! Knowledge (issue 53) against the real `smolchat serve` binary and the real SmolLM2 file: a
//! collection of documents indexed in the background (chunked, embedded, keyword-indexed), and
//! searched by keywords, by vectors and by both fused. The retrieval evaluation
//! (`tests/data/knowledge/questions.json` over snapshots of two of the project's documents)
//! reports recall@5 of each and asserts that the fusion keeps its recall; collections are their
//! owners' until an admin shares them; deletes leave no chunk behind; an indexing cut off by a
//! kill goes on after the restart. On SQLite and on PostgreSQL.

mod common;

use std::time::{Duration, Instant};

use common::browser_client::Browser;
use common::server::{eventually, form_encode, Server};
use reqwest::StatusCode;
use serde_json::{json, Value};

const ADMIN_PASSWORD: &str = "root's password";

fn accounts_env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("SMOLCHAT_AUTH__INITIAL_ADMIN", "root"),
        ("SMOLCHAT_AUTH__INITIAL_ADMIN_PASSWORD", ADMIN_PASSWORD),
    ]
}

/// A browser signed up (or in) as `name`.
async fn account(server: &Server, last: u8, name: &str, password: &str, up: bool) -> Browser {
    let mut b = Browser::at(server, last, "/").await;
    let path = if up { "/signup" } else { "/signin" };
    b.get(path).await;
    let form = format!(
        "name={}&password={}{}",
        form_encode(name),
        form_encode(password),
        if up { "&invite=" } else { "" }
    );
    let a = b.post_form(path, &form).await;
    assert_eq!(
        a.status,
        StatusCode::NO_CONTENT,
        "{path} {name}: {}",
        a.text
    );
    b.get("/").await;
    b
}

async fn json_of(
    b: &mut Browser,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let a = b.json(method, path, body.as_ref()).await;
    (
        a.status,
        serde_json::from_str(&a.text).unwrap_or(Value::String(a.text)),
    )
}

async fn upload(
    b: &mut Browser,
    collection: &str,
    name: &str,
    bytes: Vec<u8>,
) -> (StatusCode, Value) {
    let a = b
        .upload(
            &format!(
                "/api/knowledge/{collection}/documents?name={}",
                form_encode(name)
            ),
            bytes,
        )
        .await;
    (
        a.status,
        serde_json::from_str(&a.text).unwrap_or(Value::String(a.text)),
    )
}

/// Waits until every document of `collection` has ended its indexing; their states.
async fn indexed(b: &mut Browser, collection: &str, limit: Duration) -> Vec<Value> {
    let started = Instant::now();
    loop {
        let (status, body) = json_of(
            b,
            reqwest::Method::GET,
            &format!("/api/knowledge/{collection}"),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let docs = body["documents"].as_array().cloned().unwrap_or_default();
        if !docs.is_empty()
            && docs
                .iter()
                .all(|d| d["status"] == "ready" || d["status"] == "failed")
        {
            return docs;
        }
        assert!(
            started.elapsed() < limit,
            "indexing did not end in {limit:?}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn search(
    b: &mut Browser,
    collections: &[&str],
    query: &str,
    mode: &str,
) -> (StatusCode, Value) {
    json_of(
        b,
        reqwest::Method::POST,
        "/api/knowledge/search",
        Some(json!({"collections": collections, "query": query, "k": 5, "mode": mode})),
    )
    .await
}

fn squash(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hybrid_retrieval_keeps_its_recall_on_the_evaluation_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Other settings can be evaluated: `SMOLTEST_KNOWLEDGE__KEY=value` runs the server with
    // `SMOLCHAT_KNOWLEDGE__KEY=value`.
    let extra: Vec<(String, String)> = std::env::vars()
        .filter_map(|(k, v)| {
            k.strip_prefix("SMOLTEST_KNOWLEDGE__")
                .map(|rest| (format!("SMOLCHAT_KNOWLEDGE__{rest}"), v))
        })
        .collect();
    let mut env = accounts_env();
    env.extend(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let server = Server::start(dir.path(), &env).await;
    let mut alice = account(&server, 1, "alice", "alice's password", true).await;
    let (status, c) = json_of(
        &mut alice,
        reqwest::Method::POST,
        "/api/knowledge",
        Some(json!({"name": "Project docs"})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{c}");
    let id = c["id"].as_str().expect("id").to_string();
    let data = common::crate_root().join("tests/data/knowledge");
    for name in ["install.md", "reliability.md"] {
        let bytes = std::fs::read(data.join(name)).expect("document");
        let (status, doc) = upload(&mut alice, &id, name, bytes).await;
        assert_eq!(status, StatusCode::CREATED, "{doc}");
        assert!(["pending", "indexing", "ready"].contains(&doc["status"].as_str().unwrap_or("")));
    }
    let started = Instant::now();
    let docs = indexed(&mut alice, &id, Duration::from_secs(600)).await;
    let indexing_s = started.elapsed().as_secs_f64();
    for d in &docs {
        assert_eq!(d["status"], "ready", "{d}");
        assert_eq!(d["chunks"], d["embedded"], "{d}");
    }

    let questions: Value = serde_json::from_str(
        &std::fs::read_to_string(data.join("questions.json")).expect("questions"),
    )
    .expect("questions json");
    let questions = questions["questions"]
        .as_array()
        .expect("questions")
        .clone();
    let mut found = std::collections::BTreeMap::new();
    for mode in ["keyword", "vector", "hybrid"] {
        let mut hits = 0;
        for q in &questions {
            let (status, body) =
                search(&mut alice, &[&id], q["q"].as_str().expect("q"), mode).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let passages = body["passages"].as_array().expect("passages");
            assert!(passages.len() <= 5);
            let answer = squash(q["answer"].as_str().expect("answer"));
            if passages
                .iter()
                .any(|p| squash(p["text"].as_str().unwrap_or("")).contains(&answer))
            {
                hits += 1;
            }
        }
        found.insert(mode, hits);
    }
    let n = questions.len();
    let recall = |m: &str| found[m] as f64 / n as f64;
    eprintln!(
        "recall@5 over {n} questions: keyword {:.3}, vector {:.3}, hybrid {:.3} (indexing {indexing_s:.1} s; {} passages)",
        recall("keyword"),
        recall("vector"),
        recall("hybrid"),
        docs.iter().map(|d| d["chunks"].as_i64().unwrap_or(0)).sum::<i64>()
    );
    let report = json!({
        "questions": n,
        "recall_at_5": {"keyword": recall("keyword"), "vector": recall("vector"), "hybrid": recall("hybrid")},
        "indexing_s": indexing_s,
    });
    let _ = std::fs::write(
        common::crate_root().join("target/knowledge-eval.json"),
        report.to_string(),
    );
    // What holds with SmolLM2-135M as the embedder (the default configuration): its vectors
    // find little on their own (0.36), the keywords nearly everything on this set (1.0), and
    // the fusion (vectors at half weight) keeps most of it (0.89 when measured; the floor
    // leaves room for other CPUs' rounding). Hybrid ≥ keyword needs a real embedding model.
    assert!(recall("keyword") >= 0.95, "{found:?}");
    assert!(recall("hybrid") >= recall("vector"), "{found:?}");
    assert!(
        recall("hybrid") >= 0.8,
        "hybrid retrieval lost its recall: {found:?}"
    );
}
