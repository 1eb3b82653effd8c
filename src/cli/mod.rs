//! The `smolchat` command line: argument types and one module per subcommand.
//! This is the only library code (with `main.rs`) that prints to stdout.

pub mod backup;
pub mod bench;
pub mod chat;
pub mod generate;
pub mod inspect;
pub mod knowledge;
pub mod logits;
pub mod model;
pub mod ops;
pub mod serve;
pub mod tokenize;
pub mod user;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use smolchat_engine::cpu::{DecodePrefetch, Isa};
use smolchat_engine::device::DeviceRequest;
use smolchat_engine::KvType;
use smolchat_service::config::Config;
use smolchat_serving::load::{self, LoadedModel};

#[derive(Parser, Debug)]
#[command(
    name = "smolchat",
    version,
    about = "Multi-user chat serving SmolLM3 GGUF models"
)]
pub struct Cli {
    #[command(flatten)]
    pub globals: Globals,
    /// What to do; `serve` when left out.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Flags every command takes; each overrides its `model.*` key in the configuration.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct Globals {
    /// Threads for the model's compute (model.threads; default: all cores).
    #[arg(long, global = true, env = "SMOLCHAT_THREADS")]
    pub threads: Option<usize>,
    /// KV cache storage: f32, f16 or q8_0 (model.kv_type; default f16).
    #[arg(long, global = true)]
    pub kv_type: Option<KvType>,
    /// The best instruction set the CPU kernels may use: avx512, avxvnni, avx2 or scalar
    /// (model.isa; default: the best this CPU has; SMOLCHAT_ISA overrides both).
    #[arg(long, global = true)]
    pub isa: Option<Isa>,
    /// Decode attention's KV prefetching: eager or lazy (model.decode_prefetch; default: by the
    /// L1 data cache size; SMOLCHAT_DECODE_PREFETCH overrides both).
    #[arg(long, global = true)]
    pub decode_prefetch: Option<DecodePrefetch>,
}

impl Globals {
    /// Writes the flags that were given over `config`.
    pub fn apply(&self, config: &mut Config) {
        let m = &mut config.model;
        if let Some(t) = self.threads {
            m.threads = Some(t);
        }
        if let Some(t) = self.kv_type {
            m.kv_type = t;
        }
        if let Some(isa) = self.isa {
            m.isa = Some(isa);
        }
        if let Some(p) = self.decode_prefetch {
            m.decode_prefetch = Some(p);
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve the chat web app and its API (until SIGINT or SIGTERM).
    Serve(serve::ServeArgs),
    /// One prompt, streamed to stdout (logs go to stderr).
    Generate(generate::GenerateArgs),
    /// A terminal conversation with streaming.
    Chat(chat::ChatArgs),
    /// Text to token ids (a JSON array).
    Tokenize(tokenize::TokenizeArgs),
    /// GGUF metadata (without the huge arrays), tensor counts by type, parameters, KV bytes/token.
    Inspect(inspect::InspectArgs),
    /// Dump logits of every position for given token ids (one prefill) as float32 .npy.
    Logits(logits::LogitsArgs),
    /// Measure load, prefill, decode and batched decode throughput; JSON on stdout.
    Bench(bench::BenchArgs),
    /// Write a consistent, checked copy of the database (safe while the server runs): a SQLite
    /// file copy, or pg_dump's custom format for PostgreSQL.
    Backup(backup::BackupArgs),
    /// Put a backup in place as a new database (a new SQLite file, or an empty PostgreSQL
    /// database), with the server stopped.
    Restore(backup::RestoreArgs),
    /// Manage accounts: add, passwd, list, disable, enable.
    User(user::UserArgs),
    /// Make a single-use sign-up invite code (for `auth.signup = "invite"`).
    Invite(user::InviteArgs),
    /// The models of a running server: list, load, unload, make the default (with the admin
    /// token).
    Model(model::ModelArgs),
    /// Knowledge collections of a running server: list, create, add documents, share, remove
    /// (with the admin token).
    Knowledge(knowledge::KnowledgeArgs),
    /// Read a PDF's text from stdin, as the server's sandboxed document reader (one JSON object
    /// on stdout). The server starts it itself, under resource limits.
    #[command(hide = true)]
    Extract(ExtractArgs),
}

/// `smolchat extract`: the bounds the server passes.
#[derive(Args, Debug, Clone)]
pub struct ExtractArgs {
    /// Stop, refusing the file, when its text passes this many bytes.
    #[arg(long, default_value_t = smolchat_service::documents::MAX_TEXT_BYTES)]
    pub max_text_bytes: usize,
    /// Refuse the file when its compressed streams inflate past this many bytes.
    #[arg(long, default_value_t = smolchat_service::documents::MAX_INFLATED_BYTES)]
    pub max_inflated_bytes: usize,
}

/// `--device` for the commands that load a model outside the server (the server's own
/// `--device` does the same for `serve`).
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct DeviceArg {
    /// Where to compute: auto (a CUDA GPU when this build and the machine can use one, else the
    /// CPU), cpu, cuda or cuda:N (model.device; default auto).
    #[arg(long, value_parser = parse_device)]
    pub device: Option<DeviceRequest>,
}

/// clap's parser for device flags: the engine's one parser, its message as clap's.
pub fn parse_device(s: &str) -> std::result::Result<DeviceRequest, String> {
    s.parse()
        .map_err(|e: smolchat_engine::EngineError| e.to_string())
}

/// `--config` and `--model` for the commands that read a model outside the server: the same
/// configuration `serve` reads (tokenizer override, YaRN, KV cache, kernel choices), so a model
/// behaves the same in every command.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// A TOML configuration file (layered over config/default.toml).
    #[arg(long, env = "SMOLCHAT_CONFIG")]
    pub config: Option<PathBuf>,
    /// The GGUF model (model.path; default: the embedded SmolLM2-135M-Instruct).
    #[arg(long, env = "SMOLCHAT_MODEL")]
    pub model: Option<PathBuf>,
}

impl ModelArgs {
    /// The configuration with these flags, `device` and the global flags applied over it.
    pub fn config(&self, device: DeviceArg, globals: &Globals) -> Result<Config> {
        let mut config = Config::load(self.config.as_deref())?;
        if let Some(model) = &self.model {
            config.model.path = model.clone();
        }
        if let Some(device) = device.device {
            config.model.device = device;
        }
        globals.apply(&mut config);
        config.validate()?;
        Ok(config)
    }

    /// Loads the configured model through the engine's one loader, with a progress bar on
    /// stderr, after sizing the compute thread pool.
    pub fn load(&self, device: DeviceArg, globals: &Globals) -> Result<LoadedModel> {
        let config = self.config(device, globals)?;
        let path = config.model.existing_path()?;
        init_threads(config.model.threads)?;
        with_progress(|progress| Ok(load::load(path, &config.load_options(), progress)?))
    }
}

/// Runs a load with a progress bar on stderr that `progress(done, total)` moves.
pub fn with_progress<T>(run: impl FnOnce(&mut dyn FnMut(u64, u64)) -> Result<T>) -> Result<T> {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let out = run(&mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    out
}

/// Sets the size of the global rayon pool that the engine's kernels run on (default: all
/// cores). Call once, before the first computation.
pub fn init_threads(threads: Option<usize>) -> Result<()> {
    let n = threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    rayon::ThreadPoolBuilder::new()
        .num_threads(n.max(1))
        .build_global()
        .context("configuring the compute thread pool")?;
    Ok(())
}

/// Parses "1,2,3" into token ids.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(|p| p.trim())
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u32>()
                .with_context(|| format!("`{p}` is not a token id (expected e.g. 1,2,3)"))
        })
        .collect()
}

/// Peak resident set size of this process in bytes (Linux; 0 elsewhere).
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
