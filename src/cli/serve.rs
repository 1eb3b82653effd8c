//! `smolchat serve`: loads the model, opens the database, starts the actors and serves the web
//! app until SIGINT or SIGTERM.
//!
//! Configuration precedence (lowest first): built-in defaults, `config/default.toml`, the file
//! given with `--config`, `SMOLCHAT_…` environment variables, then the flags below.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use smolchat_engine::device::DeviceRequest;
use smolchat_service::config::Config;
use smolchat_service::platform::{self, Platform};

#[derive(Args, Debug, Default)]
pub struct ServeArgs {
    /// A TOML configuration file (layered over config/default.toml).
    #[arg(long, env = "SMOLCHAT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on, e.g. 127.0.0.1:8080 or 0.0.0.0:8080 (server.bind).
    #[arg(long)]
    pub bind: Option<String>,
    /// The GGUF model (model.path; default: the embedded SmolLM2-135M-Instruct).
    #[arg(long, env = "SMOLCHAT_MODEL")]
    pub model: Option<PathBuf>,
    /// Database URL, e.g. sqlite://data/smolchat.db (database.url).
    #[arg(long)]
    pub database_url: Option<String>,
    /// Token that guards the admin page (server.admin_token).
    #[arg(long)]
    pub admin_token: Option<String>,
    /// Bearer key required on the OpenAI-compatible API (server.api_key).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Where the model computes: auto, cpu, cuda or cuda:N (model.device).
    #[arg(long, value_parser = super::parse_device)]
    pub device: Option<DeviceRequest>,
}

impl ServeArgs {
    /// The configuration with the flags applied over it.
    pub fn config(&self, globals: &super::Globals) -> Result<Config> {
        let mut config = Config::load(self.config.as_deref())?;
        if let Some(bind) = &self.bind {
            config.server.bind = bind.clone();
        }
        if let Some(model) = &self.model {
            config.model.path = model.clone();
        }
        if let Some(url) = &self.database_url {
            config.database.url = url.clone();
        }
        if let Some(token) = &self.admin_token {
            config.server.admin_token = Some(token.clone());
        }
        if let Some(key) = &self.api_key {
            config.server.api_key = Some(key.clone());
        }
        if let Some(device) = self.device {
            config.model.device = device;
        }
        globals.apply(&mut config);
        config.validate()?;
        Ok(config)
    }
}

pub fn run(args: &ServeArgs, globals: &super::Globals) -> Result<()> {
    let config = args.config(globals)?;
    super::init_threads(config.model.threads)?;
    smolchat_web::check_config(&config).map_err(|e| anyhow::anyhow!("configuration: {e}"))?;
    // Before anything records a metric, or those first values would be lost.
    smolchat_web::ops::install_metrics();
    tracing::info!(model = %config.model.path.display(), "loading the model");
    eprintln!("smolchat: loading {}", config.model.path.display());
    let (engine, tokenizer, template, info) = platform::load_model(&config)?;
    eprintln!(
        "smolchat: {} loaded in {:.1} s; starting the server on http://{}",
        info.id, info.load_s, config.server.bind
    );
    // Attached PDFs are read by this same binary in a child process (`smolchat extract`).
    let this = std::env::current_exe().context("finding this program for the document reader")?;
    let sandbox = smolchat_service::documents::SandboxConfig::new(this, &config.limits);
    let system = actix_web::rt::System::new();
    system.block_on(async move {
        let platform = Platform::start(config, engine, tokenizer, template, info, sandbox)
            .await
            .context("starting the platform")?;
        smolchat_web::run(platform).await.context("serving")?;
        Ok(())
    })
}
