//! MCP servers an admin connects (`[[tools.mcp]]` of smolchat's configuration), through the official Rust SDK (`rmcp`,
//! client side): a command whose stdio speaks MCP, or a Streamable HTTP URL. Each is connected
//! in the background at start (a server that fails to start, or is slow to, never holds up the
//! server or a reply), its tools listed, and offered to the model as `<server>__<tool>` with the
//! server's own schema. A server that fails, hangs or stops is shown as such (the admin page,
//! `/ops/tools`), its calls answer `error: …`, and it is connected again at most every
//! [`RECONNECT_EVERY`] when a call needs it.
//!
//! What a server sends is bounded where it reaches us: tools whose schema is over
//! [`MAX_SCHEMA_BYTES`] are left out (listed as skipped, with why), at most [`MAX_TOOLS`] tools
//! a server, descriptions cut to [`MAX_DESCRIPTION_CHARS`]; a result's text is cut by the
//! tools' rules (smolchat's `Tools::call`). The child's stderr is kept (its last lines, for
//! the admin page) and never logged: a server may echo what the model sent it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::model::{CallToolRequestParams, ContentBlock};
use rmcp::service::{Peer, RoleClient, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::ServiceExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The most bytes of JSON one tool's argument schema may take (it is printed into every
/// prompt that offers the tool).
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// The most tools taken from one server.
pub const MAX_TOOLS: usize = 64;
/// A tool's description is cut to this many characters.
pub const MAX_DESCRIPTION_CHARS: usize = 1000;
/// A failed server is connected again at most this often (when a call needs it).
pub const RECONNECT_EVERY: Duration = Duration::from_secs(15);
/// Lines of a stdio server's stderr kept for the admin page.
const STDERR_LINES: usize = 20;

/// Who a server's tools are offered to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OfferTo {
    #[default]
    Everyone,
    Admins,
}

/// `[[tools.mcp]]`: one MCP server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpServerConfig {
    /// The server's name: its tools are offered as `<name>__<tool>` (letters, digits, `_`, `-`).
    pub name: String,
    /// stdio: the command to start (and `args`, `env`); its working folder is the server's.
    pub command: Option<String>,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// Streamable HTTP: the endpoint's URL (`http://`), and headers sent with every request.
    pub url: Option<String>,
    pub headers: BTreeMap<String, String>,
    /// Whose conversations may offer its tools.
    pub offer_to: OfferTo,
    /// Whether every call of its tools waits for the user's Allow.
    pub require_approval: bool,
    /// How long connecting and listing its tools may take, in seconds.
    pub start_timeout_s: u64,
    /// A call's time limit for this server's tools, in seconds (`tools.timeout_s` when left
    /// out).
    pub timeout_s: Option<u64>,
}

impl Default for McpServerConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            command: None,
            args: Vec::new(),
            env: BTreeMap::new(),
            url: None,
            headers: BTreeMap::new(),
            offer_to: OfferTo::Everyone,
            require_approval: true,
            start_timeout_s: 30,
            timeout_s: None,
        }
    }
}

impl McpServerConfig {
    /// The one check of a server's settings; the error names the key (`tools.mcp[i].…`).
    pub fn check(&self, at: &str) -> Result<(), String> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 32
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            && !self.name.contains("__");
        if !name_ok {
            return Err(format!(
                "{at}.name {:?} must be 1 to 32 letters, digits, `_` or `-` (no `__`): its tools \
                 are offered as <name>__<tool>",
                self.name
            ));
        }
        match (&self.command, &self.url) {
            (Some(c), None) if !c.trim().is_empty() => {}
            (None, Some(u)) => {
                if !u.starts_with("http://") {
                    return Err(format!(
                        "{at}.url {u:?} must be an http:// URL (smolchat's MCP client speaks \
                         plain HTTP: keep the server on a private network, or behind a local \
                         TLS proxy)"
                    ));
                }
                for (k, v) in &self.headers {
                    if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err()
                        || reqwest::header::HeaderValue::from_str(v).is_err()
                    {
                        return Err(format!("{at}.headers: {k:?} is not a valid header"));
                    }
                }
            }
            _ => {
                return Err(format!(
                    "{at} needs either `command` (a stdio server) or `url` (Streamable HTTP), \
                     not both"
                ))
            }
        }
        if self.start_timeout_s == 0 || self.timeout_s == Some(0) {
            return Err(format!(
                "{at}.start_timeout_s and {at}.timeout_s must be at least 1"
            ));
        }
        Ok(())
    }
}

/// A tool of an MCP server, as offered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct McpTool {
    /// As the model calls it: `<server>__<tool>`.
    pub name: String,
    /// As the server names it.
    pub tool: String,
    pub description: String,
    /// Its arguments' JSON Schema.
    pub schema: Value,
}

/// Where a server stands, for the admin page and `/ops/tools`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct McpStatus {
    pub name: String,
    /// `stdio: <command>` or `http: <url>`.
    pub transport: String,
    /// `starting`, `ready` or `failed`.
    pub state: &'static str,
    pub error: Option<String>,
    pub tools: Vec<McpTool>,
    /// Tools left out, each with why.
    pub skipped: Vec<String>,
    pub offer_to: OfferTo,
    pub require_approval: bool,
    /// The last lines the server wrote to stderr (stdio).
    pub stderr: Vec<String>,
}

/// Why a call of a server's tool gave no result (its text is what the model reads).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum McpError {
    #[error("the MCP server {0} is not connected: {1}")]
    Unavailable(String, String),
    #[error("the MCP server answered with an error: {0}")]
    Tool(String),
    #[error("the MCP server failed: {0}")]
    Protocol(String),
}

type Client = RunningService<RoleClient, ()>;

struct Live {
    state: &'static str,
    error: Option<String>,
    tools: Vec<McpTool>,
    skipped: Vec<String>,
    peer: Option<Peer<RoleClient>>,
    /// Held so the connection (and the child) lives; dropped to end it.
    client: Option<Client>,
    last_attempt: Option<Instant>,
}

/// One configured server and its connection.
pub struct McpServer {
    cfg: McpServerConfig,
    live: Mutex<Live>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// One connect at a time.
    connecting: tokio::sync::Mutex<()>,
}

impl McpServer {
    fn new(cfg: McpServerConfig) -> Self {
        Self {
            cfg,
            live: Mutex::new(Live {
                state: "starting",
                error: None,
                tools: Vec::new(),
                skipped: Vec::new(),
                peer: None,
                client: None,
                last_attempt: None,
            }),
            stderr: Arc::new(Mutex::new(VecDeque::new())),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    pub fn config(&self) -> &McpServerConfig {
        &self.cfg
    }

    pub fn status(&self) -> McpStatus {
        let live = self.live();
        McpStatus {
            name: self.cfg.name.clone(),
            transport: match (&self.cfg.command, &self.cfg.url) {
                (Some(c), _) => format!("stdio: {c}"),
                (_, Some(u)) => format!("http: {u}"),
                _ => String::new(),
            },
            state: live.state,
            error: live.error.clone(),
            tools: live.tools.clone(),
            skipped: live.skipped.clone(),
            offer_to: self.cfg.offer_to,
            require_approval: self.cfg.require_approval,
            stderr: self
                .stderr
                .lock()
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default(),
        }
    }

    /// The tools offered now (none unless connected).
    pub fn tools(&self) -> Vec<McpTool> {
        self.live().tools.clone()
    }

    /// Connects (again), lists its tools; the outcome is the server's state.
    pub async fn connect(&self) {
        let _one = self.connecting.lock().await;
        {
            let mut live = self.live();
            live.last_attempt = Some(Instant::now());
            live.state = "starting";
            live.client = None;
            live.peer = None;
        }
        let limit = Duration::from_secs(self.cfg.start_timeout_s.max(1));
        let outcome = match tokio::time::timeout(limit, self.open()).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "it did not connect and list its tools within {} s",
                limit.as_secs()
            )),
        };
        let mut live = self.live();
        match outcome {
            Ok((client, tools, skipped)) => {
                tracing::info!(server = %self.cfg.name, tools = tools.len(), skipped = skipped.len(), "MCP server connected");
                live.state = "ready";
                live.error = None;
                live.tools = tools;
                live.skipped = skipped;
                live.peer = Some(client.peer().clone());
                live.client = Some(client);
            }
            Err(e) => {
                tracing::warn!(server = %self.cfg.name, "MCP server unavailable: {e}");
                live.state = "failed";
                live.error = Some(e);
            }
        }
    }

    async fn open(&self) -> Result<(Client, Vec<McpTool>, Vec<String>), String> {
        let client = match (&self.cfg.command, &self.cfg.url) {
            (Some(command), _) => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(&self.cfg.args).envs(&self.cfg.env);
                let (transport, stderr) = TokioChildProcess::builder(cmd)
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("cannot start {command:?}: {e}"))?;
                if let Some(stderr) = stderr {
                    self.keep_stderr(stderr);
                }
                ().serve(transport)
                    .await
                    .map_err(|e| format!("the MCP handshake failed: {e}"))?
            }
            (None, Some(url)) => {
                let mut headers = reqwest::header::HeaderMap::new();
                for (k, v) in &self.cfg.headers {
                    if let (Ok(k), Ok(v)) = (
                        reqwest::header::HeaderName::from_bytes(k.as_bytes()),
                        reqwest::header::HeaderValue::from_str(v),
                    ) {
                        headers.insert(k, v);
                    }
                }
                let http = reqwest::Client::builder()
                    .default_headers(headers)
                    .build()
                    .map_err(|e| format!("cannot make an HTTP client: {e}"))?;
                let config = rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(url.as_str());
                let transport = StreamableHttpClientTransport::with_client(http, config);
                ().serve(transport)
                    .await
                    .map_err(|e| format!("the MCP handshake with {url} failed: {e}"))?
            }
            (None, None) => return Err("neither a command nor a URL is configured".into()),
        };
        let listed = client
            .list_all_tools()
            .await
            .map_err(|e| format!("listing its tools failed: {e}"))?;
        let (mut tools, mut skipped) = (Vec::new(), Vec::new());
        for t in listed {
            let schema = Value::Object((*t.input_schema).clone());
            let bytes = serde_json::to_string(&schema).map_or(usize::MAX, |s| s.len());
            let exposed = format!("{}__{}", self.cfg.name, t.name);
            if bytes > MAX_SCHEMA_BYTES {
                skipped.push(format!(
                    "{}: its schema takes {bytes} bytes, over the limit of {MAX_SCHEMA_BYTES}",
                    t.name
                ));
            } else if tools.len() >= MAX_TOOLS {
                skipped.push(format!(
                    "{}: over the limit of {MAX_TOOLS} tools a server",
                    t.name
                ));
            } else if !t
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
            {
                skipped.push(format!(
                    "{:?}: a tool name must be letters, digits, `_`, `-` or `.`",
                    t.name
                ));
            } else {
                let description: String = t
                    .description
                    .as_deref()
                    .unwrap_or("")
                    .chars()
                    .take(MAX_DESCRIPTION_CHARS)
                    .collect();
                tools.push(McpTool {
                    name: exposed,
                    tool: t.name.to_string(),
                    description,
                    schema,
                });
            }
        }
        Ok((client, tools, skipped))
    }

    /// Reads the child's stderr into the last [`STDERR_LINES`] lines (never the log).
    fn keep_stderr(&self, stderr: tokio::process::ChildStderr) {
        use tokio::io::AsyncBufReadExt;
        let kept = Arc::clone(&self.stderr);
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let line: String = line.chars().take(500).collect();
                if let Ok(mut k) = kept.lock() {
                    if k.len() >= STDERR_LINES {
                        k.pop_front();
                    }
                    k.push_back(line);
                }
            }
        });
    }

    /// Calls `tool` (the server's name for it) with `arguments`; the text of its result.
    pub async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
    ) -> Result<String, McpError> {
        let peer = self.peer_or_reconnect().await?;
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
        let result = match peer.call_tool(params).await {
            Ok(r) => r,
            Err(e) => {
                let closed = matches!(e, rmcp::ServiceError::TransportClosed);
                if closed {
                    let mut live = self.live();
                    live.state = "failed";
                    live.error = Some("the server's connection closed (it stopped?)".into());
                    live.peer = None;
                    live.client = None;
                }
                return Err(McpError::Protocol(e.to_string()));
            }
        };
        let text = result_text(&result.content, result.structured_content.as_ref());
        if result.is_error == Some(true) {
            return Err(McpError::Tool(text));
        }
        Ok(text)
    }

    async fn peer_or_reconnect(&self) -> Result<Peer<RoleClient>, McpError> {
        let (peer, due) = {
            let live = self.live();
            let due = live.state == "failed"
                && live
                    .last_attempt
                    .is_none_or(|t| t.elapsed() >= RECONNECT_EVERY);
            (live.peer.clone(), due)
        };
        if let Some(peer) = peer {
            return Ok(peer);
        }
        if due {
            self.connect().await;
        }
        let live = self.live();
        live.peer.clone().ok_or_else(|| {
            McpError::Unavailable(
                self.cfg.name.clone(),
                live.error
                    .clone()
                    .unwrap_or_else(|| "it is still starting".into()),
            )
        })
    }

    /// Ends the connection (the child process with it).
    pub async fn close(&self) {
        let client = {
            let mut live = self.live();
            live.peer = None;
            live.client.take()
        };
        if let Some(client) = client {
            let _ = client.cancel().await;
        }
    }
}

/// A result's content as the text the model reads: text blocks as they are, anything else
/// named (an image, a resource), the structured content when there is no text.
fn result_text(content: &[ContentBlock], structured: Option<&Value>) -> String {
    let mut parts: Vec<String> = Vec::new();
    for block in content {
        match block {
            ContentBlock::Text(t) => parts.push(t.text.clone()),
            ContentBlock::Image(i) => parts.push(format!("[an image, {}]", i.mime_type)),
            ContentBlock::Audio(a) => parts.push(format!("[audio, {}]", a.mime_type)),
            ContentBlock::Resource(_) => parts.push("[an embedded resource]".into()),
            ContentBlock::ResourceLink(r) => parts.push(format!("[a resource: {}]", r.uri)),
            _ => parts.push("[content of a kind smolchat does not read]".into()),
        }
    }
    if parts.is_empty() {
        if let Some(v) = structured {
            return v.to_string();
        }
    }
    parts.join("\n")
}

/// Every configured MCP server.
#[derive(Default)]
pub struct McpServers {
    servers: Vec<Arc<McpServer>>,
}

impl McpServers {
    pub fn new(configs: &[McpServerConfig]) -> Self {
        Self {
            servers: configs
                .iter()
                .cloned()
                .map(|c| Arc::new(McpServer::new(c)))
                .collect(),
        }
    }

    /// Connects every server in the background (needs a Tokio runtime).
    pub fn start(&self) {
        for s in &self.servers {
            let s = Arc::clone(s);
            tokio::spawn(async move { s.connect().await });
        }
    }

    pub fn servers(&self) -> &[Arc<McpServer>] {
        &self.servers
    }

    /// The server a tool name (`<server>__<tool>`) belongs to, and the tool's own name.
    pub fn route<'a>(&self, name: &'a str) -> Option<(&Arc<McpServer>, &'a str)> {
        let (server, tool) = name.split_once("__")?;
        let s = self.servers.iter().find(|s| s.name() == server)?;
        Some((s, tool))
    }

    pub async fn close(&self) {
        for s in &self.servers {
            s.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_needs_a_name_and_one_way_to_reach_it() {
        let ok = McpServerConfig {
            name: "files".into(),
            command: Some("node".into()),
            ..McpServerConfig::default()
        };
        assert!(ok.check("tools.mcp[0]").is_ok());
        for (bad, needle) in [
            (
                McpServerConfig {
                    name: "a__b".into(),
                    ..ok.clone()
                },
                "no `__`",
            ),
            (
                McpServerConfig {
                    url: Some("http://x/mcp".into()),
                    ..ok.clone()
                },
                "not both",
            ),
            (
                McpServerConfig {
                    command: None,
                    url: Some("https://x/mcp".into()),
                    ..ok.clone()
                },
                "http://",
            ),
        ] {
            let e = bad.check("tools.mcp[0]").unwrap_err();
            assert!(e.contains(needle) && e.contains("tools.mcp[0]"), "{e}");
        }
        let servers = McpServers::new(&[ok]);
        assert_eq!(
            servers
                .route("files__read_file")
                .map(|(s, t)| (s.name(), t)),
            Some(("files", "read_file"))
        );
        assert!(servers.route("other__x").is_none());
        assert!(servers.route("calculator").is_none());
    }

    #[test]
    fn results_are_text_and_other_content_is_named() {
        let text = ContentBlock::text("hello");
        assert_eq!(result_text(&[text.clone(), text], None), "hello\nhello");
        assert_eq!(
            result_text(&[], Some(&serde_json::json!({"sum": 3}))),
            r#"{"sum":3}"#
        );
    }
}
