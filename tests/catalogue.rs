//! The hostile-input catalogue: one table of requests a careless or malicious client sends to
//! every interface (JSON API, pages, event streams, `/v1`, admin, static files, operations), each
//! with the one status a correct server gives. Every case must get exactly that status with a
//! body that says what was wrong (never an empty body, never a 5xx), and the server must still be
//! healthy and have logged no panic afterwards. Configuration files get the same treatment as
//! start-up errors. (GGUF files: `tests/bad_files.rs` and the fuzzing in `tests/fuzz.rs`;
//! typed control tokens, cache probing and slow bodies: `tests/hostile.rs`.)
//!
//! Ids that are not UUIDs get 400 naming the expected form; well-formed ids of conversations that
//! do not exist or belong to someone else get 404 alike, so ids cannot be probed.
//!
//! Unknown fields: the JSON API refuses them. `/v1` accepts and ignores the fields OpenAI's own
//! clients and common front ends send routinely (`user`, `metadata`, `store`, `service_tier`,
//! `parallel_tool_calls`, `stream_options`, …), because refusing those would break the official
//! client libraries; values it cannot honour (`n` > 1, unknown roles, bad `logit_bias`) are
//! refused.

mod common;

use std::process::Command;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, COOKIE};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use common::server::Server;

const API_KEY: &str = "sk-catalogue";
const ADMIN_TOKEN: &str = "catalogue-admin-token";
const METRICS_TOKEN: &str = "catalogue-metrics-token";

/// Whose cookie a request carries.
#[derive(Clone, Copy, PartialEq)]
enum Who {
    /// The owner of `{mine}` (with a valid CSRF token for page routes).
    Me,
    /// No cookie at all.
    Nobody,
}

struct Case {
    name: String,
    method: Method,
    /// `{mine}` and `{theirs}` are replaced by a conversation of ours and one of another owner.
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Option<Vec<u8>>,
    who: Who,
    csrf: bool,
    expect: u16,
}

fn case(name: &str, method: Method, path: &str, expect: u16) -> Case {
    Case {
        name: name.to_string(),
        method,
        path: path.to_string(),
        headers: Vec::new(),
        body: None,
        who: Who::Me,
        csrf: true,
        expect,
    }
}

impl Case {
    fn json(mut self, body: &str) -> Case {
        self.headers
            .push(("content-type", "application/json".into()));
        self.body = Some(body.as_bytes().to_vec());
        self
    }
    fn json_value(self, v: Value) -> Case {
        let text = v.to_string();
        self.json(&text)
    }
    fn form(mut self, body: &str) -> Case {
        self.headers
            .push(("content-type", "application/x-www-form-urlencoded".into()));
        self.body = Some(body.as_bytes().to_vec());
        self
    }
    fn raw(mut self, content_type: &str, body: Vec<u8>) -> Case {
        if !content_type.is_empty() {
            self.headers.push(("content-type", content_type.into()));
        }
        self.body = Some(body);
        self
    }
    fn header(mut self, name: &'static str, value: &str) -> Case {
        self.headers.push((name, value.to_string()));
        self
    }
    /// The same request, expecting another status.
    fn tap(mut self, status: u16) -> Case {
        self.expect = status;
        self
    }
    fn strip_auth(mut self) -> Case {
        self.headers.retain(|(n, _)| *n != "authorization");
        self
    }
    fn bearer(self, key: &str) -> Case {
        self.header("authorization", &format!("Bearer {key}"))
    }
    fn nobody(mut self) -> Case {
        self.who = Who::Nobody;
        self
    }
    fn no_csrf(mut self) -> Case {
        self.csrf = false;
        self
    }
}

fn chat(body: Value) -> Case {
    case("", Method::POST, "/v1/chat/completions", 400)
        .bearer(API_KEY)
        .json_value(body)
}

fn msgs() -> Value {
    json!([{"role": "user", "content": "Hi"}])
}

fn catalogue() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |name: &str, c: Case| {
        let mut c = c;
        c.name = name.to_string();
        cases.push(c);
    };
    use Method as M;

    // ---- JSON API: bodies ----
    let create = || case("", M::POST, "/api/conversations", 400);
    add("api create: malformed JSON", create().json("{"));
    add("api create: array instead of object", create().json("[]"));
    add(
        "api create: string temperature",
        create().json(r#"{"temperature":"hot"}"#),
    );
    add(
        "api create: negative temperature",
        create().json(r#"{"temperature":-1}"#),
    );
    add(
        "api create: temperature beyond f64",
        create().json(r#"{"temperature":1e999}"#),
    );
    add("api create: top_p 0", create().json(r#"{"top_p":0}"#));
    add(
        "api create: top_p above 1",
        create().json(r#"{"top_p":1.5}"#),
    );
    add(
        "api create: max_tokens 0",
        create().json(r#"{"max_tokens":0}"#),
    );
    add(
        "api create: negative max_tokens",
        create().json(r#"{"max_tokens":-5}"#),
    );
    add(
        "api create: fractional max_tokens",
        create().json(r#"{"max_tokens":1.5}"#),
    );
    add(
        "api create: unknown field",
        create().json(r#"{"temprature":0.5}"#),
    );
    add(
        "api create: numeric system prompt",
        create().json(r#"{"system_prompt":5}"#),
    );
    add(
        "api create: NUL in system prompt",
        create().json(r#"{"system_prompt":"a\u0000b"}"#),
    );
    add(
        "api create: lone surrogate",
        create().json(r#"{"system_prompt":"\ud800"}"#),
    );
    add(
        "api create: invalid UTF-8",
        create().raw(
            "application/json",
            b"{\"system_prompt\":\"\xff\xfe\"}".to_vec(),
        ),
    );
    add(
        "api create: text/plain body",
        create().raw("text/plain", b"{}".to_vec()).tap(415),
    );
    add(
        "api create: no content type",
        create().raw("", b"{}".to_vec()).tap(415),
    );
    add(
        "api create: 2 MB body",
        create()
            .json(&format!(
                "{{\"system_prompt\":\"{}\"}}",
                "a".repeat(2 << 20)
            ))
            .tap(413),
    );
    add(
        "api create: nested depth bomb",
        create().json(&format!("{}{}", "[".repeat(10_000), "]".repeat(10_000))),
    );
    let send = || case("", M::POST, "/api/conversations/{mine}/messages", 400);
    add("api send: no content", send().json("{}"));
    add("api send: empty content", send().json(r#"{"content":""}"#));
    add(
        "api send: whitespace content",
        send().json(r#"{"content":"  \n "}"#),
    );
    add("api send: numeric content", send().json(r#"{"content":5}"#));
    add("api send: null content", send().json(r#"{"content":null}"#));
    add(
        "api send: NUL in content",
        send().json(r#"{"content":"a\u0000b"}"#),
    );
    add(
        "api send: unknown field",
        send().json(r#"{"content":"hi","role":"system"}"#),
    );
    add(
        "api send: content over the limit",
        send()
            .json_value(json!({"content": "x".repeat(40_000)}))
            .tap(413),
    );
    let patch = || case("", M::PATCH, "/api/conversations/{mine}", 400);
    add("api patch: numeric title", patch().json(r#"{"title":5}"#));
    add(
        "api patch: NaN temperature",
        patch().json(r#"{"temperature":"NaN"}"#),
    );
    add(
        "api patch: unknown field",
        patch().json(r#"{"owner":"someone-else"}"#),
    );
    add("api patch: malformed JSON", patch().json(r#"{"title":"#));
    add(
        "api patch: system prompt that cannot fit",
        patch().json_value(json!({"system_prompt": "word ".repeat(6000)})),
    );

    // ---- JSON API: ids, owners, methods ----
    add(
        "api get: other owner's conversation",
        case("", M::GET, "/api/conversations/{theirs}", 404),
    );
    add(
        "api patch: other owner's conversation",
        case("", M::PATCH, "/api/conversations/{theirs}", 404).json(r#"{"title":"x"}"#),
    );
    add(
        "api delete: other owner's conversation",
        case("", M::DELETE, "/api/conversations/{theirs}", 404),
    );
    add(
        "api send: other owner's conversation",
        case("", M::POST, "/api/conversations/{theirs}/messages", 404).json(r#"{"content":"hi"}"#),
    );
    add(
        "api stop: other owner's conversation",
        case("", M::POST, "/api/conversations/{theirs}/stop", 404),
    );
    add(
        "sse: other owner's conversation",
        case("", M::GET, "/api/conversations/{theirs}/events", 404),
    );
    add(
        "sse: unknown id",
        case(
            "",
            M::GET,
            "/api/conversations/01a20000-0000-7000-8000-000000000000/events",
            404,
        ),
    );
    add(
        "sse: not an id",
        case("", M::GET, "/api/conversations/nope/events", 400),
    );
    add(
        "api get: not an id",
        case("", M::GET, "/api/conversations/not-a-uuid", 400),
    );
    add(
        "api get: encoded traversal",
        case("", M::GET, "/api/conversations/..%2f..%2fetc%2fpasswd", 400),
    );
    add(
        "api get: forged cookie",
        case("", M::GET, "/api/conversations/{mine}", 404)
            .header("cookie", "smolchat_owner=forged-value")
            .nobody(),
    );
    add("api: unknown route", case("", M::GET, "/api/nope", 404));
    add(
        "api: PUT on the collection",
        case("", M::PUT, "/api/conversations", 405),
    );
    add(
        "api: DELETE on the collection",
        case("", M::DELETE, "/api/conversations", 405),
    );
    add(
        "api: GET on messages",
        case("", M::GET, "/api/conversations/{mine}/messages", 405),
    );
    add(
        "api list: 201-character query",
        case(
            "",
            M::GET,
            &format!("/api/conversations?q={}", "q".repeat(201)),
            400,
        ),
    );
    add(
        "api: cross-site Origin",
        create()
            .json("{}")
            .header("origin", "http://evil.example")
            .no_csrf()
            .tap(403),
    );
    add(
        "api: Sec-Fetch-Site cross-site",
        create()
            .json("{}")
            .header("sec-fetch-site", "cross-site")
            .no_csrf()
            .tap(403),
    );

    // ---- Pages ----
    add(
        "page send: no CSRF token",
        case("", M::POST, "/c/{mine}/messages", 403)
            .form("content=hi")
            .no_csrf(),
    );
    add(
        "page send: wrong CSRF token",
        case("", M::POST, "/c/{mine}/messages", 403)
            .form("content=hi")
            .header("x-csrf-token", "AAAA")
            .no_csrf(),
    );
    add(
        "page send: JSON instead of a form",
        case("", M::POST, "/c/{mine}/messages", 415).json(r#"{"content":"hi"}"#),
    );
    add(
        "page send: empty content",
        case("", M::POST, "/c/{mine}/messages", 400).form("content="),
    );
    add(
        "page send: missing field",
        case("", M::POST, "/c/{mine}/messages", 400).form("text=hi"),
    );
    add(
        "page send: field given twice",
        case("", M::POST, "/c/{mine}/messages", 400).form("content=a&content=b"),
    );
    add(
        "page send: other owner's conversation",
        case("", M::POST, "/c/{theirs}/messages", 404).form("content=hi"),
    );
    add(
        "page settings: max_tokens -1",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=0.5&top_p=0.9&max_tokens=-1"),
    );
    add(
        "page settings: temperature abc",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=abc&top_p=0.9&max_tokens=10"),
    );
    add(
        "page settings: top_p 0",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=0.5&top_p=0&max_tokens=10"),
    );
    add(
        "page settings: top_p 2",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=0.5&top_p=2&max_tokens=10"),
    );
    add(
        "page settings: negative temperature",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=-1&top_p=0.9&max_tokens=10"),
    );
    add(
        "page settings: NUL in system prompt",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=a%00b&temperature=0.5&top_p=0.9&max_tokens=10"),
    );
    add(
        "page edit: nothing to edit yet",
        case("", M::POST, "/c/{mine}/edit", 400).form("content=new"),
    );
    add(
        "page regenerate: nothing to regenerate",
        case("", M::POST, "/c/{mine}/regenerate", 400).form(""),
    );
    add(
        "page send: content over the limit",
        case("", M::POST, "/c/{mine}/messages", 413)
            .form(&format!("content={}", "x".repeat(40_000))),
    );
    add(
        "page rename: other owner's conversation",
        case("", M::POST, "/c/{theirs}/rename", 404).form("title=x"),
    );
    add(
        "page thinking: junk value",
        case("", M::POST, "/c/{mine}/thinking", 400).form("thinking=maybe"),
    );
    add(
        "page: other owner's conversation",
        case("", M::GET, "/c/{theirs}", 404),
    );
    add("page: not an id", case("", M::GET, "/c/not-a-uuid", 400));
    add(
        "page: delete other owner's",
        case("", M::DELETE, "/c/{theirs}", 404),
    );
    add(
        "page: message not an id",
        case("", M::GET, "/c/{mine}/m/not-a-uuid", 400),
    );
    add(
        "page list: 201-character query",
        case(
            "",
            M::GET,
            &format!("/conversations?q={}", "q".repeat(201)),
            400,
        ),
    );
    add("page: PUT /", case("", M::PUT, "/", 405));
    add(
        "static: traversal",
        case("", M::GET, "/static/../../Cargo.toml", 404),
    );
    add(
        "static: encoded traversal",
        case("", M::GET, "/static/%2e%2e/%2e%2e/Cargo.toml", 404),
    );
    add(
        "static: unknown file",
        case("", M::GET, "/static/nope.js", 404),
    );

    // ---- /v1 ----
    add(
        "v1: no key",
        chat(json!({"messages": msgs()})).tap(401).strip_auth(),
    );
    add(
        "v1: wrong key",
        case("", M::POST, "/v1/chat/completions", 401)
            .bearer("sk-wrong")
            .json_value(json!({"messages": msgs()})),
    );
    add(
        "v1: malformed JSON",
        case("", M::POST, "/v1/chat/completions", 400)
            .bearer(API_KEY)
            .json("{\"messages\":"),
    );
    add("v1: messages missing", chat(json!({})));
    add("v1: messages empty", chat(json!({"messages": []})));
    add("v1: messages not an array", chat(json!({"messages": "hi"})));
    add(
        "v1: unknown role",
        chat(json!({"messages": [{"role": "wizard", "content": "hi"}]})),
    );
    add(
        "v1: numeric content",
        chat(json!({"messages": [{"role": "user", "content": 5}]})),
    );
    add(
        "v1: NUL in content",
        chat(json!({"messages": [{"role": "user", "content": "a\u{0}b"}]})),
    );
    add(
        "v1: string temperature",
        chat(json!({"messages": msgs(), "temperature": "hot"})),
    );
    add(
        "v1: negative temperature",
        chat(json!({"messages": msgs(), "temperature": -1})),
    );
    add(
        "v1: max_tokens 0",
        chat(json!({"messages": msgs(), "max_tokens": 0})),
    );
    add(
        "v1: negative max_tokens",
        chat(json!({"messages": msgs(), "max_tokens": -1})),
    );
    add("v1: n = 2", chat(json!({"messages": msgs(), "n": 2})));
    add(
        "v1: non-numeric logit_bias key",
        chat(json!({"messages": msgs(), "logit_bias": {"abc": 1}})),
    );
    add(
        "v1: non-numeric logit_bias value",
        chat(json!({"messages": msgs(), "logit_bias": {"5": "x"}})),
    );
    add(
        "v1: tools not an array",
        chat(json!({"messages": msgs(), "tools": "all"})),
    );
    add(
        "v1: 200 tools",
        chat(
            json!({"messages": msgs(), "tools": (0..200).map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": {}}})).collect::<Vec<_>>()}),
        ),
    );
    add(
        "v1: stop not a string",
        chat(json!({"messages": msgs(), "stop": 5})),
    );
    add(
        "v1: top_p above 1",
        chat(json!({"messages": msgs(), "top_p": 3})),
    );
    add(
        "v1: stream not a bool",
        chat(json!({"messages": msgs(), "stream": "yes"})),
    );
    add(
        "v1: context overflow",
        chat(json!({"messages": [{"role": "user", "content": "word ".repeat(12_000)}]})),
    );
    add(
        "v1: unknown model",
        chat(json!({"messages": msgs(), "model": "gpt-9"})).tap(404),
    );
    add(
        "v1: text/plain body",
        case("", M::POST, "/v1/chat/completions", 415)
            .bearer(API_KEY)
            .raw("text/plain", b"{}".to_vec()),
    );
    add(
        "v1: 2 MB body",
        case("", M::POST, "/v1/chat/completions", 413)
            .bearer(API_KEY)
            .json(&format!(
                "{{\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
                "a".repeat(2 << 20)
            )),
    );
    add(
        "v1: GET on chat completions",
        case("", M::GET, "/v1/chat/completions", 405).bearer(API_KEY),
    );
    add(
        "v1 completions: prompt missing",
        case("", M::POST, "/v1/completions", 400)
            .bearer(API_KEY)
            .json("{}"),
    );
    add(
        "v1 completions: numeric prompt",
        case("", M::POST, "/v1/completions", 400)
            .bearer(API_KEY)
            .json(r#"{"prompt":5}"#),
    );
    add(
        "v1 models: unknown id",
        case("", M::GET, "/v1/models/nope", 404).bearer(API_KEY),
    );
    add(
        "v1 models: a file path",
        case("", M::GET, "/v1/models/%2Fetc%2Fpasswd", 404).bearer(API_KEY),
    );

    // ---- Admin (no session) ----
    add(
        "admin login: wrong token",
        case("", M::POST, "/admin/login", 401).form("token=wrong"),
    );
    add(
        "admin login: no CSRF token",
        case("", M::POST, "/admin/login", 403)
            .form(&format!("token={ADMIN_TOKEN}"))
            .no_csrf(),
    );
    add(
        "admin live: no session",
        case("", M::GET, "/admin/live", 401),
    );
    add(
        "admin stop: no session",
        case("", M::POST, "/admin/c/{mine}/stop", 401).form(""),
    );
    add(
        "admin evict: no session",
        case("", M::POST, "/admin/c/{mine}/evict", 401).form(""),
    );
    add(
        "admin delete: no session",
        case("", M::DELETE, "/admin/c/{mine}", 401),
    );
    add(
        "admin: forged session cookie",
        case("", M::GET, "/admin/live", 401)
            .header("cookie", "smolchat_admin=admin-v1")
            .nobody(),
    );

    // ---- Operations, protocol ----
    add("metrics: no token", case("", M::GET, "/metrics", 401));
    add(
        "metrics: wrong token",
        case("", M::GET, "/metrics", 401).bearer("scrape-wrong"),
    );
    add(
        "metrics: the API key is not the metrics token",
        case("", M::GET, "/metrics", 401).bearer(API_KEY),
    );
    add("ops: POST /healthz", case("", M::POST, "/healthz", 405));
    add(
        "http: 20 KB URL",
        case("", M::GET, &format!("/c/{}", "a".repeat(20_000)), 414),
    );
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hostile_request_gets_a_clear_refusal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [
        ("SMOLCHAT_SERVER__API_KEY", API_KEY),
        ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
        ("SMOLCHAT_SERVER__METRICS_TOKEN", METRICS_TOKEN),
        ("SMOLCHAT_LIMITS__CONTEXT", "4096"),
    ];
    let server = Server::start(dir.path(), &env).await;
    let me = server.client();
    let mine = me.create(json!({"temperature": 0, "max_tokens": 4})).await;
    let theirs = server.client().create(json!({})).await;
    let token = me.csrf_token().await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");

    let cases = catalogue();
    let mut failures = Vec::new();
    for c in &cases {
        let path = c.path.replace("{mine}", &mine).replace("{theirs}", &theirs);
        let mut headers = HeaderMap::new();
        if c.who == Who::Me {
            if let Some(cookie) = me.cookie() {
                headers.insert(COOKIE, HeaderValue::from_str(&cookie).expect("cookie"));
            }
            if c.csrf {
                headers.insert(
                    "x-csrf-token",
                    HeaderValue::from_str(&token).expect("token"),
                );
            }
        }
        for (name, value) in &c.headers {
            let name = HeaderName::from_static(name);
            match HeaderValue::from_str(value) {
                Ok(v) => {
                    headers.insert(name, v);
                }
                Err(e) => panic!("{}: bad header value: {e}", c.name),
            }
        }
        let mut req = http
            .request(c.method.clone(), format!("{}{path}", server.base))
            .headers(headers)
            .timeout(std::time::Duration::from_secs(60));
        if let Some(body) = &c.body {
            req = req.body(body.clone());
        }
        let (status, content_type, text) = match req.send().await {
            Ok(resp) => {
                let status = resp.status();
                let ct = resp
                    .headers()
                    .get(CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                (status, ct, resp.text().await.unwrap_or_default())
            }
            Err(e) => {
                failures.push(format!("{}: no answer ({e})", c.name));
                continue;
            }
        };
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| text.clone());
        let problems: Vec<&str> = [
            (status.as_u16() != c.expect, "unexpected status"),
            (status.is_server_error(), "a 5xx"),
            (message.trim().is_empty(), "no message"),
            (
                content_type.starts_with("application/json") && !text.contains("\"message\""),
                "JSON without error.message",
            ),
        ]
        .into_iter()
        .filter_map(|(bad, what)| bad.then_some(what))
        .collect();
        if !problems.is_empty() {
            let shown: String = message.chars().take(160).collect();
            failures.push(format!(
                "{}: {} (got {}, want {}): {shown}",
                c.name,
                problems.join(", "),
                status.as_u16(),
                c.expect
            ));
        }
    }
    // The scraper with the token gets the metrics.
    let scrape = http
        .get(format!("{}/metrics", server.base))
        .bearer_auth(METRICS_TOKEN)
        .send()
        .await
        .expect("scrape");
    assert_eq!(scrape.status(), StatusCode::OK);
    assert!(scrape
        .text()
        .await
        .unwrap_or_default()
        .contains("smolchat_"));
    // Still healthy, and nothing panicked on the way.
    assert_eq!(me.get("/healthz").await.status, StatusCode::OK);
    let log = server.log_text();
    assert!(!log.contains("panicked"), "the server panicked:\n{log}");
    eprintln!(
        "{} hostile requests, {} refused as expected",
        cases.len(),
        cases.len() - failures.len()
    );
    assert!(cases.len() >= 80, "the catalogue shrank to {}", cases.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Bad configuration files stop the server at start-up with a message naming the setting.
#[test]
fn bad_configuration_files_are_clear_start_up_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: [(&str, &str, &[&str]); 8] = [
        (
            "unknown key",
            "[server]\nbindd = \"127.0.0.1:0\"\n",
            &["bindd"],
        ),
        (
            "unknown section",
            "[serverr]\nbind = \"127.0.0.1:0\"\n",
            &["serverr"],
        ),
        (
            "wrong type",
            "[scheduler]\nmax_running = \"many\"\n",
            &["max_running"],
        ),
        (
            "negative number",
            "[scheduler]\nqueue_size = -1\n",
            &["queue_size"],
        ),
        (
            "zero running",
            "[scheduler]\nmax_running = 0\n",
            &["max_running"],
        ),
        (
            "bad device",
            "[model]\ndevice = \"tpu\"\n",
            &["device", "tpu"],
        ),
        ("not TOML", "this is [not toml\n", &["TOML", "line"]),
        (
            "short cookie secret",
            "[server]\ncookie_secret = \"short\"\n",
            &["cookie_secret", "64"],
        ),
    ];
    for (name, text, needles) in cases {
        let file = dir.path().join(format!("{}.toml", name.replace(' ', "_")));
        std::fs::write(&file, text).expect("write config");
        let out = Command::new(env!("CARGO_BIN_EXE_smolchat"))
            .args([
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--database-url",
                "sqlite::memory:",
                "--config",
            ])
            .arg(&file)
            .env_remove("SMOLCHAT_CONFIG")
            .output()
            .expect("run smolchat");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: started anyway");
        for needle in needles {
            assert!(
                stderr.contains(needle),
                "{name}: {needle:?} not in {stderr}"
            );
        }
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
    let missing = Command::new(env!("CARGO_BIN_EXE_smolchat"))
        .args(["serve", "--config", "/nonexistent/smolchat.toml"])
        .output()
        .expect("run smolchat");
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && stderr.contains("does not exist"),
        "{stderr}"
    );
}

/// Event streams are bounded per user over all their conversations, not only per conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_are_bounded_per_user() {
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [("SMOLCHAT_LIMITS__MAX_STREAMS_PER_USER", "2")];
    let server = Server::start(dir.path(), &env).await;
    let me = server.client();
    let mut open = Vec::new();
    for _ in 0..2 {
        let id = me.create(json!({})).await;
        open.push(me.events(&id).await);
    }
    let third = me.create(json!({})).await;
    let r = me.get(&format!("/api/conversations/{third}/events")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text);
    assert!(r.headers.get("retry-after").is_some());
    let message = r.json["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("limit per user is 2"), "{message}");
    // Another user is not affected.
    let other = server.client();
    let id = other.create(json!({})).await;
    let _stream = other.events(&id).await;
    drop(open);
}

/// A slowloris client (a request head trickled a byte at a time) is cut off after
/// `limits.request_head_timeout_s`, and a header block beyond actix-http's 128 KiB bound is
/// refused, so neither holds a connection or memory without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_oversized_request_heads_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [("SMOLCHAT_LIMITS__REQUEST_HEAD_TIMEOUT_S", "2")];
    let server = Server::start(dir.path(), &env).await;
    let addr = server.base.trim_start_matches("http://").to_string();

    // Slowloris: one byte of the head every 500 ms; the server must close the connection (or
    // answer 408) long before the 30 bytes are through.
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let started = std::time::Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut_off = false;
    for byte in head.iter() {
        if stream.write_all(&[*byte]).await.is_err() {
            cut_off = true;
            break;
        }
        let mut buf = [0u8; 256];
        match tokio::time::timeout(std::time::Duration::from_millis(500), stream.read(&mut buf))
            .await
        {
            Ok(Ok(0)) | Ok(Err(_)) => {
                cut_off = true;
                break;
            }
            Ok(Ok(n)) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                assert!(
                    text.contains("408"),
                    "unexpected answer to a slow head: {text}"
                );
                cut_off = true;
                break;
            }
            Err(_) => {}
        }
    }
    let held = started.elapsed();
    assert!(cut_off, "a head trickled for {held:?} was never cut off");
    eprintln!("slow request head cut off after {held:?} (limit 2 s)");

    // actix-http buffers a request head up to 128 KiB (and 96 headers), then refuses it: 200 KiB
    // of headers is refused, not buffered.
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let big = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "b".repeat(200 << 10)
    );
    let _ = stream.write_all(big.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_end(&mut answer),
    )
    .await;
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 431") || text.starts_with("HTTP/1.1 400") || answer.is_empty(),
        "an oversized head was served: {}",
        text.lines().next().unwrap_or("")
    );
    assert!(!text.starts_with("HTTP/1.1 200"));
    // The server still answers ordinary requests.
    assert_eq!(server.client().get("/healthz").await.status, StatusCode::OK);
}
