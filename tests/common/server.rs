//! Starts the real `smolchat serve` binary for HTTP tests and talks to it: a process per server on
//! a free 127.0.0.1 port with its own database, killed when dropped; a small HTTP client that
//! carries the owner cookie; and a line-based SSE reader.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use reqwest::header::{HeaderMap, CONTENT_TYPE, COOKIE, SET_COOKIE};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// How long a server may take to load the model and answer `/readyz`.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for one SSE event (a slow step on a loaded 2-core machine is well below this).
pub const EVENT_TIMEOUT: Duration = Duration::from_secs(60);

/// A running `smolchat serve` child process. Killed (SIGKILL) on drop.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    pub base: String,
    pub database_url: String,
    pub log: PathBuf,
}

impl Server {
    /// Starts a server whose database is `dir/db.sqlite` (so a restart on the same `dir` finds
    /// the same data), with `env` added to a clean `SMOLCHAT_*` environment, and waits until
    /// `/readyz` answers 200.
    pub async fn start(dir: &Path, env: &[(&str, &str)]) -> Server {
        let database_url = format!("sqlite://{}", dir.join("db.sqlite").display());
        Server::start_on(dir, &database_url, env).await
    }

    /// Starts a server on `database_url` (e.g. a PostgreSQL database shared with other
    /// replicas), its log in `dir`.
    pub async fn start_on(dir: &Path, database_url: &str, env: &[(&str, &str)]) -> Server {
        Server::start_for_port(dir, database_url, |_| {
            env.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .await
    }

    /// [`Server::start_on`] with settings that depend on the port it will listen on (a URL of
    /// the server itself, such as an OpenID Connect redirect URL).
    pub async fn start_for_port(
        dir: &Path,
        database_url: &str,
        env_for: impl Fn(u16) -> Vec<(String, String)>,
    ) -> Server {
        let database_url = database_url.to_string();
        let mut last_log = String::new();
        // A port picked free can be taken by someone else before the server binds it; retry.
        for attempt in 0..3 {
            let port = free_port();
            let log = dir.join(format!("server-{port}.log"));
            let env_owned = env_for(port);
            let env: Vec<(&str, &str)> = env_owned
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let child = spawn(port, &database_url, &log, &env);
            let mut server = Server {
                child: Some(child),
                port,
                base: format!("http://127.0.0.1:{port}"),
                database_url: database_url.clone(),
                log,
            };
            match server.wait_ready().await {
                Ok(()) => return server,
                Err(reason) => {
                    last_log = server.log_text();
                    server.kill();
                    let port_taken = last_log.contains("in use");
                    if !port_taken || attempt == 2 {
                        panic!("smolchat serve did not become ready: {reason}\n--- log ---\n{last_log}");
                    }
                }
            }
        }
        panic!("smolchat serve did not start\n{last_log}");
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let http = reqwest::Client::new();
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!("the process exited with {status}"));
                }
            }
            // Ready when this process says it listens and the port answers: a port picked free
            // can be bound by another test's server first, whose /readyz would answer for it.
            let listening = format!("is listening on http://127.0.0.1:{}", self.port);
            if self.log_text().contains(&listening) {
                let url = format!("{}/readyz", self.base);
                if let Ok(r) = http.get(&url).timeout(Duration::from_secs(2)).send().await {
                    if r.status() == StatusCode::OK {
                        return Ok(());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!("no 200 from /readyz within {START_TIMEOUT:?}"))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGKILL: the process gets no chance to clean up (a crash).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits up to `limit` for the process to exit (SIGKILL after that).
    pub fn terminate(&mut self, limit: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    pub fn client(&self) -> Client {
        Client::new(&self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        // A failing test shows what the server said.
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("--- {} (last lines) ---", self.log.display());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

fn spawn(port: u16, database_url: &str, log: &Path, env: &[(&str, &str)]) -> Child {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let model = super::smollm2_path();
    let log_file = std::fs::File::create(log).expect("create server log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_smolchat"));
    cmd.current_dir(&root)
        .arg("serve")
        .arg("--bind")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--database-url")
        .arg(database_url)
        .arg("--model")
        .arg(&model)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file);
    // The test decides the configuration, not whoever runs it.
    for (key, _) in std::env::vars() {
        if key.starts_with("SMOLCHAT_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("SMOLCHAT_LOG", "info,actix_server=warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn smolchat serve")
}

/// One SSE message.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub event: String,
    pub data: Value,
    pub at: Instant,
}

/// Reads SSE messages from a streaming response (comments and `retry:` lines are skipped).
pub struct SseStream {
    body: std::pin::Pin<
        Box<dyn futures_util::Stream<Item = reqwest::Result<actix_web::web::Bytes>> + Send>,
    >,
    buffer: Vec<u8>,
}

impl SseStream {
    fn new(response: reqwest::Response) -> Self {
        SseStream {
            body: Box::pin(response.bytes_stream()),
            buffer: Vec::new(),
        }
    }

    /// The next message, `None` when the stream ends; panics after `EVENT_TIMEOUT`.
    pub async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(end) = find(&self.buffer, b"\n\n") {
                let block: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let text = String::from_utf8(block).expect("SSE block is UTF-8");
                if let Some(ev) = parse_block(&text) {
                    return Some(ev);
                }
                continue;
            }
            let chunk = tokio::time::timeout(EVENT_TIMEOUT, self.body.next())
                .await
                .unwrap_or_else(|_| panic!("no SSE event within {EVENT_TIMEOUT:?}"));
            match chunk {
                Some(Ok(bytes)) => self.buffer.extend_from_slice(&bytes),
                Some(Err(e)) => panic!("SSE stream failed: {e}"),
                None => return None,
            }
        }
    }

    /// Reads until an event named `name`; returns every event read, that one last.
    pub async fn until(&mut self, name: &str) -> Vec<SseEvent> {
        let mut seen = Vec::new();
        loop {
            let ev = self
                .next()
                .await
                .unwrap_or_else(|| panic!("the SSE stream ended before `{name}`: {seen:?}"));
            let stop = ev.event == name || ev.event == "error";
            seen.push(ev);
            if stop {
                assert_eq!(
                    seen.last().map(|e| e.event.as_str()),
                    Some(name),
                    "unexpected error event: {seen:?}"
                );
                return seen;
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn parse_block(text: &str) -> Option<SseEvent> {
    let mut event = String::from("message");
    let mut data: Vec<&str> = Vec::new();
    for line in text.lines() {
        if line.starts_with(':') || line.is_empty() {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = value.to_string(),
            "data" => data.push(value),
            _ => {}
        }
    }
    if data.is_empty() {
        return None;
    }
    let data = serde_json::from_str(&data.join("\n")).expect("SSE data is JSON");
    Some(SseEvent {
        event,
        data,
        at: Instant::now(),
    })
}

/// One finished reply as a client saw it.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The 202 body of the send.
    pub accepted: Value,
    pub events: Vec<SseEvent>,
    /// The `done` event's data: `message` (stored) and `summary`.
    pub done: Value,
    pub sent_at: Instant,
    /// When the first reasoning/answer text arrived (`None` for an empty reply).
    pub first_text_at: Option<Instant>,
    pub done_at: Instant,
}

impl Turn {
    pub fn message(&self) -> &Value {
        &self.done["message"]
    }

    /// The exact generated text, as stored.
    pub fn raw(&self) -> String {
        self.message()["raw"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// An HTTP client that keeps the owner cookie the server sets (one client = one browser).
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    pub base: String,
    cookie: Arc<Mutex<Option<String>>>,
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub json: Value,
    pub text: String,
}

impl Reply {
    /// Reads a whole response (the body as text, and as JSON when it is JSON).
    pub async fn read(resp: reqwest::Response) -> Result<Reply, reqwest::Error> {
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await?;
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Ok(Reply {
            status,
            headers,
            json,
            text,
        })
    }
}

/// `application/x-www-form-urlencoded` encoding of one value.
pub fn form_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The token in `data-csrf="..."` of a page.
pub fn csrf_of(html: &str) -> Option<String> {
    let start = html.find("data-csrf=\"")? + "data-csrf=\"".len();
    let end = html[start..].find('"')? + start;
    Some(html[start..end].to_string())
}

impl Client {
    pub fn new(base: &str) -> Client {
        Client {
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(4)
                // Shorter than the server's keep-alive (`server.keep_alive_s`, 5 s): a pooled
                // connection the server is closing at the moment it is reused fails the request
                // with `IncompleteMessage` (hyperium/hyper#2136; seen once in tests/load.rs).
                .pool_idle_timeout(Duration::from_secs(2))
                .build()
                .expect("http client"),
            base: base.to_string(),
            cookie: Arc::new(Mutex::new(None)),
        }
    }

    pub fn cookie(&self) -> Option<String> {
        self.cookie.lock().unwrap().clone()
    }

    /// Another client (a browser) carrying the same cookie.
    pub fn with_cookie(base: &str, cookie: Option<String>) -> Client {
        let c = Client::new(base);
        *c.cookie.lock().unwrap() = cookie;
        c
    }

    /// Sends a request with raw body bytes and an optional content type.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .timeout(Duration::from_secs(60));
        if let Some(cookie) = self.cookie() {
            req = req.header(COOKIE, cookie);
        }
        if let Some(ct) = content_type {
            req = req.header(CONTENT_TYPE, ct);
        }
        if let Some(body) = body {
            req = req.body(body);
        }
        let resp = req.send().await.expect("request");
        self.keep_cookie(&resp);
        resp
    }

    /// Like [`Client::call`], but a connection failure (a server that is down) is an `Err`
    /// instead of a panic.
    pub async fn try_post(&self, path: &str, body: &Value) -> Result<Reply, reqwest::Error> {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .timeout(Duration::from_secs(30))
            .json(body);
        if let Some(cookie) = self.cookie() {
            req = req.header(COOKIE, cookie);
        }
        let resp = req.send().await?;
        self.keep_cookie(&resp);
        Reply::read(resp).await
    }

    /// The CSRF token the chat page embeds for this client's owner cookie.
    pub async fn csrf_token(&self) -> String {
        let page = self.get("/").await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.text);
        csrf_of(&page.text).expect("the page embeds a CSRF token")
    }

    fn keep_cookie(&self, resp: &reqwest::Response) {
        if let Some(set) = resp.headers().get(SET_COOKIE) {
            let pair = set
                .to_str()
                .expect("cookie")
                .split(';')
                .next()
                .unwrap_or("")
                .to_string();
            *self.cookie.lock().unwrap() = Some(pair);
        }
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Reply {
        let resp = self.raw(method, path, content_type, body).await;
        Reply::read(resp).await.expect("body")
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.call(Method::GET, path, None, None).await
    }

    pub async fn send_json(&self, method: Method, path: &str, body: &Value) -> Reply {
        let bytes = serde_json::to_vec(body).expect("json");
        self.call(method, path, Some("application/json"), Some(bytes))
            .await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        self.send_json(Method::POST, path, body).await
    }

    /// Creates a conversation with these settings; returns its id.
    pub async fn create(&self, settings: Value) -> String {
        let r = self.post("/api/conversations", &settings).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
        r.json["id"].as_str().expect("id").to_string()
    }

    /// A greedy conversation with short replies.
    pub async fn create_greedy(&self, max_tokens: usize) -> String {
        self.create(json!({ "temperature": 0, "max_tokens": max_tokens }))
            .await
    }

    pub async fn conversation(&self, id: &str) -> Value {
        let r = self.get(&format!("/api/conversations/{id}")).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        r.json
    }

    pub async fn messages(&self, id: &str) -> Vec<Value> {
        self.conversation(id).await["messages"]
            .as_array()
            .expect("messages")
            .clone()
    }

    /// Opens the conversation's event stream (subscribed once this returns).
    pub async fn events(&self, id: &str) -> SseStream {
        self.events_with(id, "").await
    }

    /// The conversation's event stream with a query (`?after=…`).
    pub async fn events_with(&self, id: &str, query: &str) -> SseStream {
        let resp = self
            .raw_stream(&format!("/api/conversations/{id}/events{query}"))
            .await;
        assert_eq!(resp.status(), StatusCode::OK);
        SseStream::new(resp)
    }

    async fn raw_stream(&self, path: &str) -> reqwest::Response {
        // No overall timeout: the stream is long-lived (reads are bounded by `EVENT_TIMEOUT`).
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(cookie) = self.cookie() {
            req = req.header(COOKIE, cookie);
        }
        req.send().await.expect("events request")
    }

    pub async fn send(&self, id: &str, content: &str) -> Reply {
        self.post(
            &format!("/api/conversations/{id}/messages"),
            &json!({ "content": content }),
        )
        .await
    }

    /// Subscribes, sends `content` and reads the reply's events until `done`.
    pub async fn chat(&self, id: &str, content: &str) -> Turn {
        let mut events = self.events(id).await;
        let sent_at = Instant::now();
        let r = self.send(id, content).await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text);
        let seen = events.until("done").await;
        turn_from(r.json, sent_at, seen)
    }

    pub async fn metrics(&self) -> String {
        let r = self.get("/metrics").await;
        assert_eq!(r.status, StatusCode::OK);
        r.text
    }
}

pub fn turn_from(accepted: Value, sent_at: Instant, events: Vec<SseEvent>) -> Turn {
    let first_text_at = events
        .iter()
        .find(|e| e.event == "answer" || e.event == "reasoning")
        .map(|e| e.at);
    let last = events.last().expect("events");
    Turn {
        accepted,
        done: last.data.clone(),
        sent_at,
        first_text_at,
        done_at: last.at,
        events,
    }
}

/// The value of an unlabelled metric line (`name value`), if present.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Polls `check` every 50 ms until it returns `Some`, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
