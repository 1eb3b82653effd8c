//! The OpenAI-compatible API end to end, on the real `smolchat serve` binary with the default
//! SmolLM2 model: the official `openai` Python client against it (installed into a virtual
//! environment under `target/`), concurrent API streams beside browser sessions, errors and
//! limits, a full queue and a client that disconnects mid-stream. Replies are greedy so they can
//! be compared exactly. (Tool calling and reasoning are unit-tested with scripted token streams
//! in `src/web/openai/assemble.rs`; SmolLM2 writes neither.)
//!
//! The tests take turns (one server at a time), so timings are not distorted by each other on a
//! small machine.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::server::{eventually, metric, turn_from, Client, Server};
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{json, Value};

static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const KEY: &str = "sk-smolchat-test";

const PROMPTS: [&str; 4] = [
    "Write a short story about a dragon who learns to fly.",
    "Explain how photosynthesis works in simple terms.",
    "Describe the city of Paris to a tourist.",
    "List some tips for staying healthy.",
];

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// A raw API call with an optional bearer key.
async fn api(server: &Server, key: Option<&str>, path: &str, body: Option<&Value>) -> Reply {
    let http = reqwest::Client::new();
    let url = format!("{}{path}", server.base);
    let mut req = match body {
        Some(b) => http.post(&url).json(b),
        None => http.get(&url),
    };
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("request");
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let text = resp.text().await.expect("body");
    Reply {
        status,
        json: serde_json::from_str(&text).unwrap_or(Value::Null),
        text,
        retry_after,
    }
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    json: Value,
    text: String,
    retry_after: Option<String>,
}

/// Asserts an error in OpenAI's shape: status, `type`, `code`, `param`, a message.
#[track_caller]
fn assert_api_error(r: &Reply, status: StatusCode, code: Option<&str>, param: Option<&str>) {
    assert_eq!(r.status, status, "{}", r.text);
    let e = &r.json["error"];
    let obj = e
        .as_object()
        .unwrap_or_else(|| panic!("not an error: {}", r.text));
    for key in ["message", "type", "param", "code"] {
        assert!(obj.contains_key(key), "error lacks {key}: {}", r.text);
    }
    assert!(
        !e["message"].as_str().unwrap_or("").is_empty(),
        "{}",
        r.text
    );
    assert_eq!(e["code"].as_str(), code, "{}", r.text);
    assert_eq!(e["param"].as_str(), param, "{}", r.text);
}

/// An open `data:` event stream of the API.
struct ApiStream {
    body: std::pin::Pin<
        Box<dyn futures_util::Stream<Item = reqwest::Result<actix_web::web::Bytes>> + Send>,
    >,
    buffer: Vec<u8>,
}

impl ApiStream {
    /// Opens a stream presenting `key` as the bearer key.
    async fn open_as(server: &Server, key: Option<&str>, path: &str, body: &Value) -> ApiStream {
        let mut req = reqwest::Client::new()
            .post(format!("{}{path}", server.base))
            .json(body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.expect("stream request");
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        ApiStream {
            body: Box::pin(resp.bytes_stream()),
            buffer: Vec::new(),
        }
    }

    /// The next `data:` payload (`None` after `[DONE]` or at the end).
    async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let text = String::from_utf8(block).expect("utf-8");
                // A comment (the server's keep-alive) is no event: SSE clients skip it.
                if text.starts_with(':') {
                    continue;
                }
                let data = text.trim().strip_prefix("data: ").expect("a data event");
                if data == "[DONE]" {
                    return None;
                }
                return Some(serde_json::from_str(data).expect("JSON chunk"));
            }
            let chunk = tokio::time::timeout(Duration::from_secs(60), self.body.next())
                .await
                .expect("a chunk within 60 s");
            match chunk {
                Some(Ok(b)) => self.buffer.extend_from_slice(&b),
                Some(Err(e)) => panic!("stream failed: {e}"),
                None => return None,
            }
        }
    }

    /// Reads to the end: (content, finish_reason, chunks).
    async fn read_all(mut self) -> (String, String, Vec<Value>) {
        let mut content = String::new();
        let mut finish = String::new();
        let mut chunks = Vec::new();
        while let Some(chunk) = self.next().await {
            assert!(chunk.get("error").is_none(), "error chunk: {chunk}");
            if let Some(choice) = chunk["choices"].get(0) {
                content.push_str(
                    choice["delta"]["content"]
                        .as_str()
                        .or(choice["text"].as_str())
                        .unwrap_or(""),
                );
                if let Some(f) = choice["finish_reason"].as_str() {
                    finish = f.to_string();
                }
            }
            chunks.push(chunk);
        }
        (content, finish, chunks)
    }

    /// Reads until a chunk with non-empty text arrives.
    async fn first_text(&mut self) -> String {
        loop {
            let chunk = self.next().await.expect("the stream ended before any text");
            let text = chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("");
            if !text.is_empty() {
                return text.to_string();
            }
        }
    }
}

/// The system prompt of the concurrency test's API requests and browser conversations alike, so
/// their prompts are the same whatever the configured default system prompt is.
const SYSTEM: &str = "You are a helpful assistant.";

/// A greedy chat request with [`SYSTEM`].
fn system_chat(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    let mut body = chat_body(prompt, max_tokens, stream);
    body["messages"] = json!([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": prompt},
    ]);
    body
}

fn chat_body(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// Runs one of the official-client scripts against a server started with the API key, passing
/// `env`; the script prints `N passed, M failed` and exits non-zero when a check failed.
async fn run_client_script(script: &str, env: &[(&str, String)]) {
    let _turn = TURN.lock().await;
    let python = common::openai_venv();
    let dir = tempdir();
    let server = Server::start(dir.path(), &[("SMOLCHAT_SERVER__API_KEY", KEY)]).await;
    let t = Instant::now();
    let mut cmd = Command::new(python);
    cmd.arg(common::crate_root().join("tests").join(script))
        .env("SMOLCHAT_API_KEY", KEY);
    for (k, v) in env {
        cmd.env(k, v.replace("{base}", &server.base));
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run tests/{script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}\n{stderr}\n(script took {:?})", t.elapsed());
    assert!(out.status.success(), "tests/{script} failed");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_python_client() {
    run_client_script(
        "openai_client.py",
        &[
            ("SMOLCHAT_BASE_URL", "{base}/v1".to_string()),
            ("SMOLCHAT_BIN", env!("CARGO_BIN_EXE_smolchat").to_string()),
            (
                "SMOLCHAT_MODEL_PATH",
                common::smollm2_path().display().to_string(),
            ),
        ],
    )
    .await;
}

/// The Ollama API on the server's port, driven by the official `ollama` Python client: list,
/// show, ps, chat and generate whole and streamed, refusals in Ollama's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_ollama_python_client() {
    run_client_script(
        "ollama_client.py",
        &[("SMOLCHAT_HOST", "{base}".to_string())],
    )
    .await;
}

/// `/v1/messages`, driven by the official `anthropic` Python client: create and stream, stop
/// sequences, tools and tool results, thinking, both key headers, refusals as its exceptions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_anthropic_python_client() {
    run_client_script(
        "anthropic_client.py",
        &[("SMOLCHAT_HOST", "{base}".to_string())],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_api_streams_and_two_browser_sessions_match_solo_runs() {
    const MAX: usize = 24;
    let _turn = TURN.lock().await;
    let dir = tempdir();
    let server = Server::start(dir.path(), &[]).await;

    // Each prompt alone, not streamed.
    let mut solo = Vec::new();
    for p in PROMPTS {
        let r = api(
            &server,
            None,
            "/v1/chat/completions",
            Some(&system_chat(p, MAX, false)),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        let content = r.json["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(!content.is_empty(), "empty reply to {p}");
        solo.push(content);
    }

    // Two browser sessions, subscribed before anything is sent.
    let browser = server.client();
    let mut conversations = Vec::new();
    for _ in 0..2 {
        let id = browser
            .create(json!({"temperature": 0, "max_tokens": MAX, "system_prompt": SYSTEM}))
            .await;
        let events = browser.events(&id).await;
        conversations.push((id, events));
    }

    // Eight API streams (each prompt twice) and the two browser replies, all at once.
    let t = Instant::now();
    let api_tasks = (0..8).map(|i| {
        let base = server.base.clone();
        let prompt = PROMPTS[i % PROMPTS.len()];
        tokio::spawn(async move {
            let s = ApiStream::open_at(&base, &system_chat(prompt, MAX, true)).await;
            s.read_all().await
        })
    });
    let browser_tasks = conversations
        .into_iter()
        .enumerate()
        .map(|(i, (id, mut events))| {
            let c = Client::with_cookie(&browser.base, browser.cookie());
            tokio::spawn(async move {
                let sent = Instant::now();
                let r = c.send(&id, PROMPTS[i]).await;
                assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
                turn_from(r.json, sent, events.until("done").await)
            })
        });
    let (api_results, browser_results) = futures_util::join!(
        futures_util::future::join_all(api_tasks),
        futures_util::future::join_all(browser_tasks)
    );
    eprintln!("10 concurrent replies took {:?}", t.elapsed());
    for (i, r) in api_results.into_iter().enumerate() {
        let (content, finish, chunks) = r.expect("API task");
        assert_eq!(
            content,
            solo[i % PROMPTS.len()],
            "API stream {i} differs from its solo run"
        );
        assert!(finish == "stop" || finish == "length", "{finish}");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    }
    for (i, r) in browser_results.into_iter().enumerate() {
        let turn = r.expect("browser task");
        assert_eq!(turn.message()["status"], "complete", "{:?}", turn.done);
        assert_eq!(
            turn.raw(),
            solo[i],
            "browser session {i} differs from its solo run"
        );
    }
}

impl ApiStream {
    async fn open_at(base: &str, body: &Value) -> ApiStream {
        let resp = reqwest::Client::new()
            .post(format!("{base}/v1/chat/completions"))
            .json(body)
            .send()
            .await
            .expect("stream request");
        assert_eq!(resp.status(), StatusCode::OK);
        ApiStream {
            body: Box::pin(resp.bytes_stream()),
            buffer: Vec::new(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_limits_and_the_completions_endpoint() {
    let _turn = TURN.lock().await;
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__API_KEY", KEY),
            ("SMOLCHAT_LIMITS__CONTEXT", "64"),
            ("SMOLCHAT_LIMITS__MAX_MESSAGE_CHARS", "100"),
            ("SMOLCHAT_MODEL__ALIASES", "[\"gpt-4o-mini\", \"llama3\"]"),
        ],
    )
    .await;
    let key = Some(KEY);
    let chat = "/v1/chat/completions";

    // The key: missing, wrong, right.
    let r = api(&server, None, "/v1/models", None).await;
    assert_api_error(&r, StatusCode::UNAUTHORIZED, Some("invalid_api_key"), None);
    let r = api(
        &server,
        Some("sk-wrong"),
        chat,
        Some(&chat_body("Hi", 4, false)),
    )
    .await;
    assert_api_error(&r, StatusCode::UNAUTHORIZED, Some("invalid_api_key"), None);
    let r = api(&server, key, "/v1/models", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let model = r.json["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(r.json["data"][0]["context_length"], 64);

    // The aliases are listed after the model, each naming it.
    let listed: Vec<&str> = r.json["data"]
        .as_array()
        .map(|d| d.iter().filter_map(|m| m["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(listed, [model.as_str(), "gpt-4o-mini", "llama3"]);
    assert_eq!(r.json["data"][1]["alias_of"], json!(model));
    let r = api(&server, key, "/v1/models/llama3", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json["alias_of"], json!(model));

    // Model names: the id, the file name and the aliases are served, here and on Ollama's and
    // Anthropic's routes; anything else is 404.
    for name in [
        model.clone(),
        format!("{model}.gguf"),
        "gpt-4o-mini".into(),
        "llama3".into(),
    ] {
        let mut body = chat_body("Hi", 2, false);
        body["model"] = json!(name);
        let r = api(&server, key, chat, Some(&body)).await;
        assert_eq!(r.status, StatusCode::OK, "{name}: {}", r.text);
    }
    let r = api(
        &server,
        key,
        "/v1/messages",
        Some(&json!({"model": "llama3", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = api(
        &server,
        key,
        "/v1/messages",
        Some(&json!({"model": "claude-3-5-haiku", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.text);
    let mut body = chat_body("Hi", 2, false);
    body["model"] = json!("gpt-4o");
    let r = api(&server, key, chat, Some(&body)).await;
    assert_api_error(
        &r,
        StatusCode::NOT_FOUND,
        Some("model_not_found"),
        Some("model"),
    );
    let r = api(&server, key, "/v1/models/gpt-4o", None).await;
    assert_api_error(
        &r,
        StatusCode::NOT_FOUND,
        Some("model_not_found"),
        Some("model"),
    );
    let r = api(&server, key, "/v1/nope", None).await;
    assert_api_error(&r, StatusCode::NOT_FOUND, Some("not_found"), None);

    // Invalid requests say which field and why.
    let mut body = chat_body("Hi", 2, false);
    body["n"] = json!(9);
    let r = api(&server, key, chat, Some(&body)).await;
    assert_api_error(&r, StatusCode::BAD_REQUEST, None, Some("n"));
    for (field, value) in [
        ("temperature", json!("warm")),
        ("max_tokens", json!(-5)),
        ("stop", json!({"a": 1})),
        ("messages", json!("hello")),
    ] {
        let mut body = chat_body("Hi", 2, false);
        body[field] = value;
        let r = api(&server, key, chat, Some(&body)).await;
        assert_api_error(&r, StatusCode::BAD_REQUEST, None, Some(field));
        assert!(
            r.json["error"]["message"].as_str().unwrap().contains(field),
            "{}",
            r.text
        );
    }
    let r = api(&server, key, chat, Some(&json!([1, 2]))).await;
    assert_api_error(&r, StatusCode::BAD_REQUEST, None, None);

    // Too large a body: 413.
    let huge = chat_body(&"x".repeat(200_000), 2, false);
    let r = api(&server, key, chat, Some(&huge)).await;
    assert_api_error(
        &r,
        StatusCode::PAYLOAD_TOO_LARGE,
        Some("request_too_large"),
        None,
    );

    // Beyond the 64-token context: context_length_exceeded with both numbers.
    let long = "Tell me everything about the history of every country in the world, ".repeat(6);
    let r = api(&server, key, chat, Some(&chat_body(&long, 4, false))).await;
    assert_api_error(
        &r,
        StatusCode::BAD_REQUEST,
        Some("context_length_exceeded"),
        Some("messages"),
    );
    let message = r.json["error"]["message"].as_str().unwrap();
    assert!(message.contains("64 tokens"), "{message}");
    let r = api(
        &server,
        key,
        "/v1/completions",
        Some(&json!({"prompt": long, "max_tokens": 4})),
    )
    .await;
    assert_api_error(
        &r,
        StatusCode::BAD_REQUEST,
        Some("context_length_exceeded"),
        Some("prompt"),
    );

    // Embeddings of a text beyond the window: refused on /v1 and with Ollama's
    // `"truncate": false`; cut to the window by Ollama's default.
    let r = api(
        &server,
        key,
        "/v1/embeddings",
        Some(&json!({"input": long})),
    )
    .await;
    assert_api_error(
        &r,
        StatusCode::BAD_REQUEST,
        Some("context_length_exceeded"),
        Some("input[0]"),
    );
    let r = api(
        &server,
        key,
        "/api/embed",
        Some(&json!({"input": long, "truncate": false})),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text);
    assert!(
        r.json["error"].as_str().unwrap_or("").contains("64 tokens"),
        "{}",
        r.text
    );
    let r = api(&server, key, "/api/embed", Some(&json!({"input": long}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.json["prompt_eval_count"], 63,
        "cut to the window less one"
    );
    assert_eq!(r.json["embeddings"][0].as_array().map(Vec::len), Some(576));

    // Completions: streamed and whole agree; the default is 16 new tokens at most.
    let body = json!({"prompt": "Once upon a time", "temperature": 0, "max_tokens": 12});
    let r = api(&server, key, "/v1/completions", Some(&body)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json["object"], "text_completion");
    let whole = r.json["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!whole.is_empty());
    let usage = &r.json["usage"];
    assert_eq!(usage["prompt_tokens"], 4, "{usage}");
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 12);
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .bearer_auth(KEY)
        .json(&stream_body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let s = ApiStream {
        body: Box::pin(resp.bytes_stream()),
        buffer: Vec::new(),
    };
    let (text, finish, _) = s.read_all().await;
    assert_eq!(text, whole);
    assert_eq!(
        finish,
        r.json["choices"][0]["finish_reason"].as_str().unwrap()
    );
    let r = api(
        &server,
        key,
        "/v1/completions",
        Some(&json!({"prompt": "Once upon a time", "temperature": 0})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.json["usage"]["completion_tokens"].as_u64().unwrap() <= 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_refuses_and_a_disconnect_frees_the_slot() {
    const QUEUE_KEY: &str = "sk-queue-admin-key";
    let _turn = TURN.lock().await;
    let dir = tempdir();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SCHEDULER__MAX_RUNNING", "1"),
            ("SMOLCHAT_SCHEDULER__QUEUE_SIZE", "1"),
            // `ignore_eos` is for admins: the global key is one.
            ("SMOLCHAT_SERVER__API_KEY", QUEUE_KEY),
        ],
    )
    .await;
    let c = server.client();
    // Replies that never end by themselves: only a disconnect stops them early.
    let endless = |prompt: &str| {
        json!({
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4000, "ignore_eos": true, "stream": true,
        })
    };
    let running = || async {
        let m = c.metrics().await;
        (
            metric(&m, "smolchat_running_sequences").unwrap_or(-1.0),
            metric(&m, "smolchat_queue_depth").unwrap_or(-1.0),
        )
    };

    // A takes the only slot, B waits in the only queue place.
    let mut a = ApiStream::open_as(
        &server,
        Some(QUEUE_KEY),
        "/v1/chat/completions",
        &endless(PROMPTS[0]),
    )
    .await;
    a.first_text().await;
    let b = ApiStream::open_as(
        &server,
        Some(QUEUE_KEY),
        "/v1/chat/completions",
        &endless(PROMPTS[1]),
    )
    .await;
    // The gauges are published after each step, so they may lag a step behind.
    let both = eventually(Duration::from_secs(5), || async {
        (running().await == (1.0, 1.0)).then_some(())
    })
    .await;
    assert!(both.is_some(), "A runs and B waits: {:?}", running().await);

    // C is refused at once with Retry-After.
    let r = api(
        &server,
        Some(QUEUE_KEY),
        "/v1/chat/completions",
        Some(&chat_body("Hi", 4, false)),
    )
    .await;
    assert_api_error(
        &r,
        StatusCode::SERVICE_UNAVAILABLE,
        Some("overloaded"),
        None,
    );
    let retry: u64 = r.retry_after.expect("Retry-After").parse().unwrap();
    assert!(retry >= 1);
    // Refused at once, not after waiting for room: A (thousands of tokens to go) still runs and
    // B still waits now that the refusal is here.
    assert_eq!(running().await, (1.0, 1.0), "the refusal waited for room");

    // A's client goes away: B gets the slot.
    drop(a);
    let mut b = b;
    tokio::time::timeout(Duration::from_secs(20), b.first_text())
        .await
        .expect("B starts once A's client is gone");
    // B's client goes away too: nothing runs any more.
    drop(b);
    let freed = eventually(Duration::from_secs(5), || async {
        (running().await == (0.0, 0.0)).then_some(())
    })
    .await;
    assert!(
        freed.is_some(),
        "the slot is still taken: {:?}",
        running().await
    );

    // The slot serves the next request.
    let r = api(
        &server,
        Some(QUEUE_KEY),
        "/v1/chat/completions",
        Some(&chat_body("Hi", 4, false)),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(server.log_text().contains("API completion finished"));
}
