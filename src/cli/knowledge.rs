//! `smolchat knowledge list|create|add|share|remove`: knowledge collections of a running
//! server, through its `/ops/knowledge` routes with the admin token (`server.admin_token`, from
//! the configuration file or `SMOLCHAT_SERVER__ADMIN_TOKEN`) as the bearer. Collections made
//! here are the admin's (`admin`); share them to make them searchable by others. Documents are
//! read and indexed by the server exactly as uploads through the page are.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::ops::{encode, OpsClient};

#[derive(Args, Debug)]
pub struct KnowledgeArgs {
    #[command(subcommand)]
    pub action: KnowledgeAction,
    /// A TOML configuration file (layered over config/default.toml), for server.bind and
    /// server.admin_token.
    #[arg(long, env = "SMOLCHAT_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// The server's address (default: http://<server.bind>).
    #[arg(long, global = true)]
    pub url: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum KnowledgeAction {
    /// Every collection, with its documents and where their indexing stands.
    List,
    /// Make a collection (the admin's); `--everyone` shares it with every account at once.
    Create {
        name: String,
        #[arg(long)]
        description: Option<String>,
        #[arg(long)]
        everyone: bool,
    },
    /// Add files to a collection (each read and indexed by the server; `--wait` until done).
    Add {
        collection: String,
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long)]
        wait: bool,
    },
    /// Who may search a collection: `--everyone`, and/or accounts by name (exactly these).
    Share {
        collection: String,
        #[arg(long)]
        everyone: bool,
        #[arg(long, value_delimiter = ',')]
        accounts: Vec<String>,
    },
    /// Remove a document from a collection (its passages and vectors go with it).
    Remove {
        collection: String,
        document: String,
    },
}

pub fn run(args: &KnowledgeArgs) -> Result<()> {
    let ops = OpsClient::new(args.config.as_deref(), args.url.as_deref(), "knowledge")?;
    let get = |path: &str| ops.call("GET", path, None, None);
    let send = |method: &str, path: &str, body: &Value| ops.call(method, path, Some(body), None);
    match &args.action {
        KnowledgeAction::List => {
            let list = get("/ops/knowledge")?;
            for c in list["collections"].as_array().into_iter().flatten() {
                println!(
                    "{}  {}{}",
                    c["id"].as_str().unwrap_or("?"),
                    c["name"].as_str().unwrap_or("?"),
                    if c["shared"] == Value::Bool(true) {
                        " (shared with everyone)"
                    } else {
                        ""
                    }
                );
                for d in c["documents"].as_array().into_iter().flatten() {
                    println!(
                        "    {}  {:<40} {} ({}/{} passages)",
                        d["id"].as_str().unwrap_or("?"),
                        d["name"].as_str().unwrap_or("?"),
                        d["status"].as_str().unwrap_or("?"),
                        d["embedded"],
                        d["chunks"]
                    );
                }
            }
        }
        KnowledgeAction::Create {
            name,
            description,
            everyone,
        } => {
            let c = send(
                "POST",
                "/ops/knowledge",
                &json!({"name": name, "description": description.clone().unwrap_or_default()}),
            )?;
            let id = c["id"].as_str().unwrap_or("?").to_string();
            if *everyone {
                send(
                    "PUT",
                    &format!("/ops/knowledge/{id}/sharing"),
                    &json!({"everyone": true, "accounts": []}),
                )?;
            }
            println!("{id}");
        }
        KnowledgeAction::Add {
            collection,
            files,
            wait,
        } => {
            let mut added = Vec::new();
            for f in files {
                let bytes =
                    std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
                let name = f
                    .file_name()
                    .and_then(|n| n.to_str())
                    .with_context(|| format!("{} has no file name", f.display()))?;
                let doc = ops
                    .call(
                        "POST",
                        &format!(
                            "/ops/knowledge/{collection}/documents?name={}",
                            encode(name)
                        ),
                        None,
                        Some(&bytes),
                    )
                    .with_context(|| format!("adding {}", f.display()))?;
                println!("{}  {name}", doc["id"].as_str().unwrap_or("?"));
                added.push(doc["id"].as_str().unwrap_or_default().to_string());
            }
            if *wait {
                loop {
                    let c = get(&format!("/ops/knowledge/{collection}"))?;
                    let docs = c["documents"].as_array().cloned().unwrap_or_default();
                    let open = docs.iter().filter(|d| {
                        added.iter().any(|a| d["id"] == a.as_str())
                            && (d["status"] == "pending" || d["status"] == "indexing")
                    });
                    if open.count() == 0 {
                        for d in docs
                            .iter()
                            .filter(|d| added.iter().any(|a| d["id"] == a.as_str()))
                        {
                            println!(
                                "{}: {} ({} passages){}",
                                d["name"].as_str().unwrap_or("?"),
                                d["status"].as_str().unwrap_or("?"),
                                d["chunks"],
                                d["error"]
                                    .as_str()
                                    .map(|e| format!(": {e}"))
                                    .unwrap_or_default()
                            );
                        }
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(500));
                }
            }
        }
        KnowledgeAction::Share {
            collection,
            everyone,
            accounts,
        } => {
            send(
                "PUT",
                &format!("/ops/knowledge/{collection}/sharing"),
                &json!({"everyone": everyone, "accounts": accounts}),
            )?;
            println!("shared");
        }
        KnowledgeAction::Remove {
            collection,
            document,
        } => {
            ops.call(
                "DELETE",
                &format!("/ops/knowledge/{collection}/documents/{document}"),
                None,
                None,
            )?;
            println!("removed");
        }
    }
    Ok(())
}
