//! `smolchat model list|load|unload|default`: the models of a running server, through its
//! `/ops/models` routes with the admin token (`server.admin_token`, from the configuration file
//! or `SMOLCHAT_SERVER__ADMIN_TOKEN`) as the bearer. A load waits until the model is loaded.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;

use super::ops::{encode, OpsClient};

#[derive(Args, Debug)]
pub struct ModelArgs {
    #[command(subcommand)]
    pub action: ModelAction,
    /// A TOML configuration file (layered over config/default.toml), for server.bind and
    /// server.admin_token.
    #[arg(long, env = "SMOLCHAT_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// The server's address (default: http://<server.bind>).
    #[arg(long, global = true)]
    pub url: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum ModelAction {
    /// Every configured model: loaded or not, memory, device, queue, tokens/s.
    List,
    /// Load a model now (waits until it is loaded; makes room within models.memory_budget_mib).
    Load { id: String },
    /// Unload an idle model (refused for the main model and while it has requests).
    Unload { id: String },
    /// Make a model the default for new conversations and requests naming none (until the
    /// server restarts).
    Default { id: String },
}

pub fn run(args: &ModelArgs) -> Result<()> {
    let ops = OpsClient::new(args.config.as_deref(), args.url.as_deref(), "model")?;
    let call = |method: &str, path: &str| ops.call(method, path, None, None);
    let id_path = |id: &str, action: &str| format!("/ops/models/{}/{action}", encode(id));
    let answer = match &args.action {
        ModelAction::List => call("GET", "/ops/models")?,
        ModelAction::Load { id } => call("POST", &id_path(id, "load"))?,
        ModelAction::Unload { id } => call("POST", &id_path(id, "unload"))?,
        ModelAction::Default { id } => call("POST", &id_path(id, "default"))?,
    };
    match &args.action {
        ModelAction::List => {
            println!(
                "{:<32} {:<11} {:>10} {:<14} {:>6} {:>7} {:>8}",
                "MODEL", "STATE", "MEMORY", "DEVICE", "QUEUE", "RUNNING", "TOK/S"
            );
            for m in answer["models"].as_array().into_iter().flatten() {
                let mut name = m["id"].as_str().unwrap_or("?").to_string();
                if m["default"] == Value::Bool(true) {
                    name.push_str(" *");
                }
                let num = |v: &Value| v.as_u64().map_or("-".into(), |n| n.to_string());
                println!(
                    "{:<32} {:<11} {:>10} {:<14} {:>6} {:>7} {:>8}",
                    name,
                    m["state"].as_str().unwrap_or("?"),
                    format!("{} MiB", m["memory_bytes"].as_u64().unwrap_or(0) >> 20),
                    m["device"].as_str().unwrap_or("-"),
                    num(&m["queued"]),
                    num(&m["running"]),
                    m["tokens_per_s"]
                        .as_f64()
                        .map_or("-".into(), |t| format!("{t:.1}")),
                );
            }
            println!("(* the default model)");
        }
        _ => println!(
            "{}: {}",
            answer["model"]["id"].as_str().unwrap_or("?"),
            answer["outcome"].as_str().unwrap_or("?")
        ),
    }
    Ok(())
}
