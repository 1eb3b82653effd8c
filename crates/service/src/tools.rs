//! Tools the model may call (issue 52), the built-in ones first: a calculator (exact arithmetic
//! with `fend-core`: rationals, big integers, units), the current date and time in a time zone
//! (`chrono-tz`), and search over the caller's own conversations. Each is on by a setting
//! (`[tools]`). Every call runs under the one set of rules here, whichever tool: its arguments
//! checked against what the tool takes, a time limit, and its result cut to
//! `tools.max_result_chars` with a note saying so. A failing tool is an answer the model reads
//! ("error: …"), never a failed reply.
//!
//! The loop that runs them inside a chat reply lives in the session actor
//! ([`crate::session`]); it calls [`Tools::call`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use smolchat_store::Store;

use crate::mcp::{McpServerConfig, McpServers, OfferTo};

/// A tool as the model is told of it: OpenAI's function shape (`{"type": "function",
/// "function": {name, description, parameters}}`), which the chat templates read.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// A JSON Schema of its arguments.
    pub parameters: Value,
}

impl ToolSpec {
    pub fn to_openai(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }
}

/// A built-in tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    Calculator,
    CurrentTime,
    SearchConversations,
}

/// The longest expression the calculator takes, in characters.
const MAX_EXPRESSION_CHARS: usize = 1_000;
/// Conversations a search returns at most.
const MAX_SEARCH_RESULTS: usize = 10;

impl Builtin {
    pub const ALL: [Builtin; 3] = [
        Builtin::Calculator,
        Builtin::CurrentTime,
        Builtin::SearchConversations,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Builtin::Calculator => "calculator",
            Builtin::CurrentTime => "current_time",
            Builtin::SearchConversations => "search_conversations",
        }
    }

    pub fn spec(self) -> ToolSpec {
        match self {
            Builtin::Calculator => ToolSpec {
                name: self.name().into(),
                description: "Evaluates an arithmetic expression exactly (fractions, big \
                              integers, powers, roots, percentages, unit conversions such as \
                              `10 kg to lb`). Use it for any arithmetic."
                    .into(),
                parameters: json!({
                    "type": "object",
                    "properties": {"expression": {"type": "string", "maxLength": 500, "description": "e.g. (3 + 4) * 5 / 7"}},
                    "required": ["expression"],
                    "additionalProperties": false,
                }),
            },
            Builtin::CurrentTime => ToolSpec {
                name: self.name().into(),
                description: "The current date, weekday and time in a time zone.".into(),
                parameters: json!({
                    "type": "object",
                    "properties": {"timezone": {"type": "string", "maxLength": 64, "description": "An IANA zone such as Europe/Paris; UTC when left out"}},
                    "additionalProperties": false,
                }),
            },
            Builtin::SearchConversations => ToolSpec {
                name: self.name().into(),
                description: "Searches the user's own earlier conversations by title and \
                              message text; returns their titles, dates and ids."
                    .into(),
                parameters: json!({
                    "type": "object",
                    "properties": {"query": {"type": "string", "minLength": 3, "maxLength": 200, "description": "at least 3 characters"}},
                    "required": ["query"],
                    "additionalProperties": false,
                }),
            },
        }
    }
}

/// Why a call gave no result (the model is told, as the call's result).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolError {
    #[error("there is no tool {0:?} here")]
    Unknown(String),
    #[error("bad arguments: {0}")]
    Arguments(String),
    #[error("{0}")]
    Failed(String),
    #[error("it took longer than its limit of {0} s")]
    TimedOut(u64),
}

/// Why a `/v1` caller may not have the server-side tools it asked for.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiToolsRefused {
    #[error(
        "server-side tools are off on this server; an admin turns them on with `[tools] api = true`"
    )]
    Off,
    #[error(
        "server-side tools run for an account: send the request with an API key \
         (`Authorization: Bearer …`)"
    )]
    NoAccount,
    #[error("`server_tools` names no tool; the tools offered to this key are: {offered}")]
    Empty { offered: String },
    #[error("`server_tools` names {0:?} twice")]
    Twice(String),
    #[error(
        "`server_tools`: {0:?} needs a user's Allow before every call, which only the chat asks \
         for; it is not offered through the API"
    )]
    NeedsApproval(String),
    #[error(
        "`server_tools`: {name:?} is not a tool offered to this key; the tools offered to it are: \
         {offered}"
    )]
    NotOffered { name: String, offered: String },
}

/// A call's result as the model reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolResult {
    pub text: String,
    /// Cut to `tools.max_result_chars` (the text ends with a note saying so).
    pub truncated: bool,
    pub error: bool,
    pub duration: Duration,
}

/// What a call may see of who made it: the store, the owner whose data it may read, and
/// whether they are an admin (some servers' tools are for admins only).
pub struct ToolContext<'a> {
    pub store: &'a Store,
    pub owner: &'a str,
    pub admin: bool,
}

/// The tools offered and the rules every call runs under: the built-in ones and the MCP
/// servers' ([`crate::mcp`]).
#[derive(Clone)]
pub struct Tools {
    cfg: ToolsConfig,
    mcp: Arc<McpServers>,
}

impl std::fmt::Debug for Tools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tools").field("cfg", &self.cfg).finish()
    }
}

impl Tools {
    pub fn new(cfg: ToolsConfig) -> Self {
        let mcp = Arc::new(McpServers::new(&cfg.mcp));
        Self { cfg, mcp }
    }

    /// Connects the MCP servers in the background (needs a Tokio runtime).
    pub fn start(&self) {
        self.mcp.start();
    }

    /// The MCP servers, for the admin page and `/ops/tools`.
    pub fn mcp(&self) -> &McpServers {
        &self.mcp
    }

    /// Whether a name is one of the configured MCP servers' (`<server>__<tool>`), connected or
    /// not.
    fn is_mcp_name(&self, name: &str) -> bool {
        self.mcp.route(name).is_some()
    }

    /// The built-in tools that are on.
    pub fn enabled(&self) -> Vec<Builtin> {
        Builtin::ALL
            .into_iter()
            .filter(|t| match t {
                Builtin::Calculator => self.cfg.calculator,
                Builtin::CurrentTime => self.cfg.current_time,
                Builtin::SearchConversations => self.cfg.search_conversations,
            })
            .collect()
    }

    /// The specs of the tools offered to everyone (`admin`: to admins) now: the built-in
    /// ones that are on, then the connected MCP servers'.
    pub fn specs_for(&self, admin: bool) -> Vec<ToolSpec> {
        let mut specs: Vec<ToolSpec> = self.enabled().into_iter().map(Builtin::spec).collect();
        for s in self.mcp.servers() {
            if s.config().offer_to == OfferTo::Admins && !admin {
                continue;
            }
            specs.extend(s.tools().into_iter().map(|t| ToolSpec {
                name: t.name,
                description: t.description,
                parameters: t.schema,
            }));
        }
        specs
    }

    /// The specs of the tools offered to everyone now.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.specs_for(false)
    }

    /// The specs of `names` offered now (to an admin with `admin`), in the order given (a name
    /// no longer on, or of a server not connected, is left out: a conversation keeps its
    /// choice when a tool goes away).
    pub fn offered(&self, names: &[String], admin: bool) -> Vec<ToolSpec> {
        let on = self.specs_for(admin);
        names
            .iter()
            .filter_map(|n| on.iter().find(|s| s.name == *n).cloned())
            .collect()
    }

    /// Whether any tool is for admins only (then who the owner is matters).
    pub fn has_admin_only(&self) -> bool {
        self.mcp
            .servers()
            .iter()
            .any(|s| s.config().offer_to == OfferTo::Admins)
    }

    /// Whether every call of `name` waits for the user's Allow: named in
    /// `tools.require_approval`, or a tool of a server that asks for it.
    pub fn needs_approval(&self, name: &str) -> bool {
        self.cfg.require_approval.iter().any(|n| n == name)
            || self
                .mcp
                .route(name)
                .is_some_and(|(s, _)| s.config().require_approval)
    }

    /// The tools `names` as a `/v1` caller asked for them (`server_tools`), `admin`: whether the
    /// key's account is an admin. Each must be on and offered to that account, and run without
    /// a user's Allow (an API call has nobody to ask); `tools.api` must be on. The error says
    /// what to change.
    pub fn for_api(&self, names: &[String], admin: bool) -> Result<Vec<ToolSpec>, ApiToolsRefused> {
        if !self.cfg.api {
            return Err(ApiToolsRefused::Off);
        }
        let offered: Vec<ToolSpec> = self
            .specs_for(admin)
            .into_iter()
            .filter(|s| !self.needs_approval(&s.name))
            .collect();
        let list = || {
            if offered.is_empty() {
                "none".to_string()
            } else {
                offered
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        if names.is_empty() {
            return Err(ApiToolsRefused::Empty { offered: list() });
        }
        let mut specs: Vec<ToolSpec> = Vec::with_capacity(names.len());
        for name in names {
            if specs.iter().any(|s| s.name == *name) {
                return Err(ApiToolsRefused::Twice(name.clone()));
            }
            match offered.iter().find(|s| s.name == *name) {
                Some(spec) => specs.push(spec.clone()),
                None if self.needs_approval(name) => {
                    return Err(ApiToolsRefused::NeedsApproval(name.clone()))
                }
                None => {
                    return Err(ApiToolsRefused::NotOffered {
                        name: name.clone(),
                        offered: list(),
                    })
                }
            }
        }
        Ok(specs)
    }

    /// The tools a `/v1` caller may ask for (`admin`: its key's account is an admin); none when
    /// `tools.api` is off.
    pub fn api_specs(&self, admin: bool) -> Vec<ToolSpec> {
        if !self.cfg.api {
            return Vec::new();
        }
        self.specs_for(admin)
            .into_iter()
            .filter(|s| !self.needs_approval(&s.name))
            .collect()
    }

    /// The most rounds of calls one reply may make.
    pub fn max_rounds(&self) -> usize {
        self.cfg.max_rounds.max(1)
    }

    /// Checks a conversation's choice of tools: every name a tool that is on, `tool_choice`
    /// `required`, `auto` or one of the chosen tools. The error says what to change.
    pub fn check_choice(&self, names: &[String], choice: Option<&str>) -> Result<(), String> {
        // Every tool offered to someone (the built-in ones are in it once).
        let on: Vec<String> = self.specs_for(true).into_iter().map(|s| s.name).collect();
        // A tool of a configured server that is not connected right now is accepted: it is
        // offered once the server is back.
        if let Some(unknown) = names
            .iter()
            .find(|n| !on.contains(n) && !self.is_mcp_name(n))
        {
            return Err(format!(
                "`tools`: {unknown:?} is not a tool offered here; the tools are: {}",
                if on.is_empty() {
                    "none".to_string()
                } else {
                    on.join(", ")
                }
            ));
        }
        match choice {
            None | Some("auto") => Ok(()),
            Some(_) if names.is_empty() => Err(
                "`tool_choice` needs `tools`: choose the tools the model may call first".into(),
            ),
            Some("required") => Ok(()),
            Some(name) if names.iter().any(|n| n == name) => Ok(()),
            Some(other) => Err(format!(
                "`tool_choice` must be auto, required or one of the chosen tools ({}), not {other:?}",
                names.join(", ")
            )),
        }
    }

    /// Runs tool `name` with `arguments` (a JSON object, or its text as the model wrote it)
    /// under the time limit, its result cut to the size limit. Never fails: a tool that
    /// cannot answer gives an error result the model reads.
    pub async fn call(&self, ctx: &ToolContext<'_>, name: &str, arguments: &Value) -> ToolResult {
        let started = Instant::now();
        let limit = Duration::from_secs(self.cfg.timeout_s.max(1));
        let builtin = self.enabled().into_iter().find(|t| t.name() == name);
        let outcome = match (builtin, self.mcp.route(name), parse_arguments(arguments)) {
            (None, None, _) => Err(ToolError::Unknown(name.to_string())),
            (_, _, Err(e)) => Err(e),
            (Some(tool), _, Ok(args)) => {
                match tokio::time::timeout(limit, run(tool, ctx, &args, limit)).await {
                    Ok(r) => r,
                    Err(_) => Err(ToolError::TimedOut(limit.as_secs())),
                }
            }
            (None, Some((server, _)), Ok(_))
                if server.config().offer_to == OfferTo::Admins && !ctx.admin =>
            {
                Err(ToolError::Unknown(name.to_string()))
            }
            (None, Some((server, tool)), Ok(args)) => {
                // A server that hangs or is slow to (re)connect ends the call here, never the
                // reply.
                let limit = server
                    .config()
                    .timeout_s
                    .map_or(limit, |s| Duration::from_secs(s.max(1)));
                match tokio::time::timeout(limit, server.call(tool, args)).await {
                    Ok(Ok(text)) => Ok(text),
                    Ok(Err(e)) => Err(ToolError::Failed(e.to_string())),
                    Err(_) => Err(ToolError::TimedOut(limit.as_secs())),
                }
            }
        };
        let duration = started.elapsed();
        let (text, error) = match outcome {
            Ok(text) => (text, false),
            Err(e) => (format!("error: {e}"), true),
        };
        metrics::counter!("smolchat_tool_calls_total", "tool" => name.to_string()).increment(1);
        if error {
            metrics::counter!("smolchat_tool_errors_total", "tool" => name.to_string())
                .increment(1);
        }
        metrics::histogram!("smolchat_tool_seconds", "tool" => name.to_string())
            .record(duration.as_secs_f64());
        let (text, truncated) = cut(&text, self.cfg.max_result_chars);
        ToolResult {
            text,
            truncated,
            error,
            duration,
        }
    }
}

/// The arguments as an object: models write them as JSON text or as an object.
fn parse_arguments(arguments: &Value) -> Result<serde_json::Map<String, Value>, ToolError> {
    let value = match arguments {
        Value::String(s) if s.trim().is_empty() => Value::Object(Default::default()),
        Value::String(s) => {
            serde_json::from_str(s).map_err(|e| ToolError::Arguments(format!("not JSON ({e})")))?
        }
        Value::Null => Value::Object(Default::default()),
        other => other.clone(),
    };
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ToolError::Arguments(format!(
            "expected an object of named arguments, got {other}"
        ))),
    }
}

fn string_arg<'a>(
    args: &'a serde_json::Map<String, Value>,
    name: &str,
) -> Result<Option<&'a str>, ToolError> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(ToolError::Arguments(format!(
            "`{name}` must be a string, got {other}"
        ))),
    }
}

async fn run(
    tool: Builtin,
    ctx: &ToolContext<'_>,
    args: &serde_json::Map<String, Value>,
    limit: Duration,
) -> Result<String, ToolError> {
    match tool {
        Builtin::Calculator => {
            let expression = string_arg(args, "expression")?
                .ok_or_else(|| ToolError::Arguments("`expression` is required".into()))?
                .to_string();
            calculate(expression, limit).await
        }
        Builtin::CurrentTime => current_time(string_arg(args, "timezone")?, chrono::Utc::now()),
        Builtin::SearchConversations => {
            let query = string_arg(args, "query")?
                .ok_or_else(|| ToolError::Arguments("`query` is required".into()))?;
            search(ctx, query).await
        }
    }
}

/// Stops `fend-core` when its time is up (a `10^10^10` would otherwise run on).
struct Deadline(Instant, Arc<AtomicBool>);

impl fend_core::Interrupt for Deadline {
    fn should_interrupt(&self) -> bool {
        self.1.load(Ordering::Relaxed) || Instant::now() >= self.0
    }
}

/// Evaluates `expression` exactly on a blocking thread, interrupted at `limit`.
async fn calculate(expression: String, limit: Duration) -> Result<String, ToolError> {
    let chars = expression.chars().count();
    if chars > MAX_EXPRESSION_CHARS {
        return Err(ToolError::Arguments(format!(
            "the expression has {chars} characters; the limit is {MAX_EXPRESSION_CHARS}"
        )));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Deadline(Instant::now() + limit, Arc::clone(&stop));
    let task = tokio::task::spawn_blocking(move || {
        let mut context = fend_core::Context::new();
        fend_core::evaluate_with_interrupt(&expression, &mut context, &deadline)
            .map(|r| r.get_main_result().to_string())
    });
    // Dropped early (the call's own timeout): the interrupt stops the thread too.
    let _guard = StopOnDrop(stop);
    match task.await {
        Ok(Ok(result)) if result.is_empty() => {
            Err(ToolError::Failed("the expression has no value".into()))
        }
        Ok(Ok(result)) => Ok(result),
        Ok(Err(e)) if e.to_string().contains("interrupt") => {
            Err(ToolError::TimedOut(limit.as_secs()))
        }
        Ok(Err(e)) => Err(ToolError::Failed(format!("cannot evaluate it: {e}"))),
        Err(e) => Err(ToolError::Failed(format!("the calculator failed: {e}"))),
    }
}

struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The date, weekday and time at `now` in `zone` (UTC when none).
fn current_time(
    zone: Option<&str>,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<String, ToolError> {
    let name = zone
        .map(str::trim)
        .filter(|z| !z.is_empty())
        .unwrap_or("UTC");
    let tz: chrono_tz::Tz = name.parse().map_err(|_| {
        ToolError::Arguments(format!(
            "unknown time zone {name:?}: give an IANA name such as Europe/Paris or America/New_York"
        ))
    })?;
    let local = now.with_timezone(&tz);
    Ok(format!(
        "{} ({}), {} {}",
        local.format("%Y-%m-%d"),
        local.format("%A"),
        local.format("%H:%M:%S"),
        name
    ))
}

/// The caller's conversations matching `query`, newest first.
async fn search(ctx: &ToolContext<'_>, query: &str) -> Result<String, ToolError> {
    let query = query.trim();
    if query.chars().count() < 3 {
        return Err(ToolError::Arguments(
            "`query` needs at least 3 characters".into(),
        ));
    }
    let filter = smolchat_store::ListFilter {
        search: Some(query.to_string()),
        ..Default::default()
    };
    let page = smolchat_store::PageRequest {
        limit: MAX_SEARCH_RESULTS,
        before: None,
    };
    let found = ctx
        .store
        .list_conversations_page(ctx.owner, &filter, &page)
        .await
        .map_err(|e| ToolError::Failed(e.to_string()))?;
    if found.items.is_empty() {
        return Ok(format!("no conversation matches {query:?}"));
    }
    Ok(found
        .items
        .iter()
        .map(|c| {
            format!(
                "- {} ({}, {} messages, id {})",
                if c.title.is_empty() {
                    "untitled"
                } else {
                    &c.title
                },
                c.updated_at.format("%Y-%m-%d"),
                c.message_count,
                c.id
            )
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

/// `text` within `max` characters; longer, cut there with a note saying how much was left out.
fn cut(text: &str, max: usize) -> (String, bool) {
    let chars = text.chars().count();
    if chars <= max {
        return (text.to_string(), false);
    }
    let kept: String = text.chars().take(max).collect();
    (
        format!("{kept}\n[… cut: the result had {chars} characters; the limit is {max}]"),
        true,
    )
}

/// `[tools]`: which built-in tools are offered and the limits every call runs under.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {
    /// `calculator`: exact arithmetic.
    pub calculator: bool,
    /// `current_time`: the date and time in a time zone.
    pub current_time: bool,
    /// `search_conversations`: the caller's own conversations by title or text.
    pub search_conversations: bool,
    /// A call's longest result, in characters (longer ones are cut, with a note).
    pub max_result_chars: usize,
    /// A call's time limit, in seconds.
    pub timeout_s: u64,
    /// The most rounds of tool calls one reply may make; the reply ends after the last one's
    /// results are shown.
    pub max_rounds: usize,
    /// The tools whose every call waits for the user's Allow (tool names; an MCP server's
    /// as `<server>__<tool>`, or all of a server's with its `require_approval`).
    pub require_approval: Vec<String>,
    /// `[[tools.mcp]]`: MCP servers whose tools are offered ([`crate::mcp`]).
    pub mcp: Vec<McpServerConfig>,
    /// Whether `/v1/chat/completions` callers may ask the server to run these tools for them
    /// (`server_tools`, an extension): off unless set. Each caller is offered what its key's
    /// account is offered in the chat, less the tools that need a user's Allow.
    pub api: bool,
}

impl ToolsConfig {
    /// The one check of `[tools]`; the error names the key.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=32).contains(&self.max_rounds) {
            return Err(format!(
                "tools.max_rounds must be between 1 and 32, not {}",
                self.max_rounds
            ));
        }
        if self.max_result_chars == 0 || self.timeout_s == 0 {
            return Err("tools.max_result_chars and tools.timeout_s must be at least 1".into());
        }
        let mut names: Vec<&str> = Vec::new();
        for (i, s) in self.mcp.iter().enumerate() {
            s.check(&format!("tools.mcp[{i}]"))?;
            if names.contains(&s.name.as_str()) {
                return Err(format!(
                    "tools.mcp[{i}].name {:?} is taken by another server",
                    s.name
                ));
            }
            names.push(&s.name);
        }
        let known = |n: &str| {
            Builtin::ALL.iter().any(|b| b.name() == n)
                || n.split_once("__").is_some_and(|(s, _)| names.contains(&s))
        };
        if let Some(unknown) = self.require_approval.iter().find(|n| !known(n)) {
            return Err(format!(
                "tools.require_approval names {unknown:?}, which is not a tool; the tools are {} \
                 and <server>__<tool> of the MCP servers configured",
                Builtin::ALL.map(|b| b.name()).join(", ")
            ));
        }
        Ok(())
    }
}

impl Default for ToolsConfig {
    fn default() -> Self {
        Self {
            calculator: true,
            current_time: true,
            search_conversations: true,
            max_result_chars: 8_000,
            timeout_s: 10,
            max_rounds: 4,
            require_approval: Vec::new(),
            mcp: Vec::new(),
            api: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_calculator_is_exact_and_says_what_is_wrong() {
        let limit = Duration::from_secs(5);
        assert_eq!(calculate("1/3 + 1/6".into(), limit).await, Ok("0.5".into()));
        assert_eq!(
            calculate("2^100".into(), limit).await,
            Ok("1267650600228229401496703205376".into())
        );
        assert_eq!(calculate("(3+4)*5/7".into(), limit).await, Ok("5".into()));
        let bad = calculate("1 +".into(), limit).await.unwrap_err();
        assert!(
            matches!(bad, ToolError::Failed(ref m) if m.contains("cannot evaluate")),
            "{bad}"
        );
        let long = calculate("1+".repeat(600), limit).await.unwrap_err();
        assert!(matches!(long, ToolError::Arguments(_)), "{long}");
    }

    #[tokio::test]
    async fn a_calculation_that_runs_on_is_stopped_at_its_limit() {
        let started = Instant::now();
        let r = calculate("10^10^10^10".into(), Duration::from_millis(300)).await;
        assert!(
            matches!(r, Err(ToolError::TimedOut(_)) | Err(ToolError::Failed(_))),
            "{r:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn the_time_is_told_in_the_zone_asked() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-29T23:30:00Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        assert_eq!(
            current_time(Some("Europe/Paris"), now),
            Ok("2026-11-30 (Monday), 00:30:00 Europe/Paris".into())
        );
        assert_eq!(
            current_time(None, now),
            Ok("2026-11-29 (Sunday), 23:30:00 UTC".into())
        );
        assert!(matches!(
            current_time(Some("Mars/Olympus"), now),
            Err(ToolError::Arguments(_))
        ));
    }

    #[test]
    fn arguments_come_as_text_or_objects_and_results_are_cut_with_a_note() {
        assert_eq!(
            parse_arguments(&json!("{\"expression\": \"1+1\"}")).unwrap()["expression"],
            "1+1"
        );
        assert!(parse_arguments(&json!({"query": "x"})).is_ok());
        assert!(parse_arguments(&json!("[1, 2]")).is_err());
        assert!(parse_arguments(&json!("{nope")).is_err());
        let (text, cut_) = cut(&"é".repeat(20), 8);
        assert!(
            cut_ && text.starts_with("éééééééé\n[… cut: the result had 20 characters"),
            "{text}"
        );
        assert_eq!(cut("short", 8), ("short".into(), false));
    }

    #[test]
    fn only_the_tools_that_are_on_are_offered() {
        let tools = Tools::new(ToolsConfig {
            search_conversations: false,
            ..ToolsConfig::default()
        });
        let names: Vec<String> = tools.specs().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["calculator", "current_time"]);
        let spec = Builtin::Calculator.spec().to_openai();
        assert_eq!(spec["function"]["parameters"]["required"][0], "expression");
        // A conversation's choice: names of tools that are on, and a choice among them.
        let chosen = vec!["calculator".to_string()];
        assert!(tools.check_choice(&chosen, None).is_ok());
        assert!(tools.check_choice(&chosen, Some("required")).is_ok());
        assert!(tools.check_choice(&chosen, Some("calculator")).is_ok());
        let off = tools
            .check_choice(&["search_conversations".to_string()], None)
            .unwrap_err();
        assert!(off.contains("calculator, current_time"), "{off}");
        assert!(tools.check_choice(&[], Some("required")).is_err());
        assert!(tools
            .check_choice(&chosen, Some("current_time"))
            .unwrap_err()
            .contains("one of the chosen tools"));
        assert_eq!(
            tools
                .offered(
                    &["current_time".into(), "search_conversations".into()],
                    false
                )
                .iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>(),
            ["current_time"]
        );
    }

    #[test]
    fn api_callers_get_the_tools_offered_to_their_account_that_need_no_allow() {
        let names = |v: &[&str]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let off = Tools::new(ToolsConfig::default());
        assert_eq!(
            off.for_api(&names(&["calculator"]), true),
            Err(ApiToolsRefused::Off)
        );
        assert!(off.api_specs(true).is_empty());
        let tools = Tools::new(ToolsConfig {
            api: true,
            search_conversations: false,
            require_approval: names(&["current_time"]),
            ..ToolsConfig::default()
        });
        let got = tools.for_api(&names(&["calculator"]), false).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].name, "calculator");
        assert_eq!(
            tools.for_api(&names(&["current_time"]), false),
            Err(ApiToolsRefused::NeedsApproval("current_time".into()))
        );
        let missing = tools
            .for_api(&names(&["search_conversations"]), false)
            .unwrap_err();
        assert_eq!(
            missing.to_string(),
            "`server_tools`: \"search_conversations\" is not a tool offered to this key; the \
             tools offered to it are: calculator"
        );
        assert!(matches!(
            tools.for_api(&[], false),
            Err(ApiToolsRefused::Empty { .. })
        ));
        assert_eq!(
            tools.for_api(&names(&["calculator", "calculator"]), false),
            Err(ApiToolsRefused::Twice("calculator".into()))
        );
        let listed: Vec<String> = tools.api_specs(false).into_iter().map(|s| s.name).collect();
        assert_eq!(listed, ["calculator"]);
    }
}
