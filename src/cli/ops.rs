//! The command line's client of a running server's `/ops` routes (`smolchat model`,
//! `smolchat knowledge`): its address (`--url`, or `http://<server.bind>`) and the admin token
//! (`server.admin_token`, from the configuration file or `SMOLCHAT_SERVER__ADMIN_TOKEN`) as the
//! bearer; a refusal becomes an error carrying the server's message.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use smolchat_service::config::Config;

pub struct OpsClient {
    base: String,
    auth: String,
    agent: ureq::Agent,
}

impl OpsClient {
    /// `command` names the subcommand in the error when no admin token is set.
    pub fn new(config: Option<&Path>, url: Option<&str>, command: &str) -> Result<Self> {
        let config = Config::load(config)?;
        let token = config
            .server
            .admin_token
            .clone()
            .filter(|t| !t.is_empty())
            .with_context(|| format!("server.admin_token is not set: `smolchat {command}` needs it (in the configuration file or SMOLCHAT_SERVER__ADMIN_TOKEN)"))?;
        let base = url
            .map(str::to_string)
            .unwrap_or_else(|| format!("http://{}", config.server.bind));
        Ok(Self {
            base: base.trim_end_matches('/').to_string(),
            auth: format!("Bearer {token}"),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .into(),
        })
    }

    /// `method` on `path` with a JSON body (or none), or raw `bytes` when given.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        json: Option<&Value>,
        bytes: Option<&[u8]>,
    ) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let sent = match method {
            "GET" => self
                .agent
                .get(&url)
                .header("Authorization", &self.auth)
                .call(),
            "DELETE" => self
                .agent
                .delete(&url)
                .header("Authorization", &self.auth)
                .call(),
            _ => {
                let req = match method {
                    "PUT" => self.agent.put(&url),
                    _ => self.agent.post(&url),
                }
                .header("Authorization", &self.auth);
                match (json, bytes) {
                    (_, Some(b)) => req
                        .header("Content-Type", "application/octet-stream")
                        .send(b),
                    (Some(j), None) => req
                        .header("Content-Type", "application/json")
                        .send(j.to_string()),
                    (None, None) => req.send_empty(),
                }
            }
        };
        let mut resp = sent.with_context(|| {
            format!(
                "cannot reach the server at {} (is it running? --url)",
                self.base
            )
        })?;
        let status = resp.status();
        let body = resp
            .body_mut()
            .read_to_string()
            .context("reading the server's answer")?;
        let json: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if !status.is_success() {
            let message = json["error"]["message"]
                .as_str()
                .map_or(body.clone(), str::to_string);
            bail!("{status}: {message}");
        }
        Ok(json)
    }
}

/// A text as one path segment or query value.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
