//! The tools on the admin page (the MCP servers: state, tools with their schemas, what was
//! skipped, the last lines of a stdio server's stderr) and under `/ops/tools` for scripts:
//! `GET` lists them, `POST /ops/tools/call` `{"name", "arguments"}` runs one once (the admin
//! token as the bearer).

use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::{json, Value};
use smolchat_service::mcp::{McpStatus, OfferTo};

use super::models::ops_caller;
use super::*;

/// An MCP server's block on the admin page.
pub struct McpServerView {
    pub name: String,
    pub transport: String,
    pub state: &'static str,
    pub error: String,
    pub offer_to: &'static str,
    pub approval: bool,
    pub tools: Vec<McpToolView>,
    pub skipped: String,
    pub stderr: String,
}

pub struct McpToolView {
    pub name: String,
    pub description: String,
    /// The arguments' schema, indented.
    pub schema: String,
}

impl McpServerView {
    pub fn of(s: &McpStatus) -> Self {
        McpServerView {
            name: s.name.clone(),
            transport: s.transport.clone(),
            state: s.state,
            error: s.error.clone().unwrap_or_default(),
            offer_to: match s.offer_to {
                OfferTo::Everyone => "everyone",
                OfferTo::Admins => "admins",
            },
            approval: s.require_approval,
            tools: s
                .tools
                .iter()
                .map(|t| McpToolView {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    schema: serde_json::to_string_pretty(&t.schema).unwrap_or_default(),
                })
                .collect(),
            skipped: s.skipped.join("; "),
            stderr: s.stderr.join("\n"),
        }
    }
}

/// `GET /ops/tools`: the tools offered to admins now and every MCP server's state.
pub async fn ops_list(
    state: web::Data<AppState>,
    req: HttpRequest,
) -> Result<HttpResponse, WebError> {
    let by = ops_caller(&state, &req)?;
    let service = state.platform.conversations();
    let tools: Vec<Value> = service
        .tools(&by)
        .into_iter()
        .map(|(name, description)| json!({"name": name, "description": description}))
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "tools": tools,
        "mcp": service.tool_servers(),
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TryTool {
    name: String,
    #[serde(default)]
    arguments: Value,
}

/// `POST /ops/tools/call` `{"name", "arguments"}`: runs a tool once, under the rules of every
/// call (time limit, size cap); its result as the model would read it.
pub async fn ops_call(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: crate::json::JsonBody<TryTool>,
) -> Result<HttpResponse, WebError> {
    let by = ops_caller(&state, &req)?;
    let t = body.0;
    let r = state
        .platform
        .conversations()
        .try_tool(&by, &t.name, &t.arguments)
        .await;
    Ok(HttpResponse::Ok().json(json!({
        "text": r.text,
        "error": r.error,
        "truncated": r.truncated,
        "duration_ms": r.duration.as_secs_f64() * 1e3,
    })))
}
