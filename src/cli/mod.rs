//! The `smolchat` command line: argument types and one module per subcommand.
//! This is the only library code (with `main.rs`) that prints to stdout.

pub mod backup;
pub mod bench;
pub mod chat;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod serve;
pub mod tokenize;
pub mod user;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::DEFAULT_MODEL;
use crate::engine::device::{self, DeviceRequest};
use crate::engine::gguf::GgufSource;
use crate::engine::{Engine, KvOptions, KvType, Model};

#[derive(Parser, Debug)]
#[command(
    name = "smolchat",
    version,
    about = "Multi-user chat serving SmolLM3 GGUF models"
)]
pub struct Cli {
    /// Threads for the model's compute (default: all cores).
    #[arg(long, global = true, env = "SMOLCHAT_THREADS")]
    pub threads: Option<usize>,
    /// KV cache storage: f32, f16 or q8_0 (overrides `model.kv_type`; default f16).
    #[arg(long, global = true)]
    pub kv_type: Option<KvType>,
    /// What to do; `serve` when left out.
    #[command(subcommand)]
    pub command: Option<Command>,
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
    /// Write a consistent, checked copy of the database (safe while the server runs).
    Backup(backup::BackupArgs),
    /// Manage accounts: add, passwd, list, disable, enable.
    User(user::UserArgs),
    /// Make a single-use sign-up invite code (for `auth.signup = "invite"`).
    Invite(user::InviteArgs),
}

/// `--device` for the commands that load a model outside the server (the server reads
/// `model.device`, which its own `--device` overrides).
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct DeviceArg {
    /// Where to compute: auto (a CUDA GPU when this build and the machine can use one, else the
    /// CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceRequest,
}

impl DeviceArg {
    /// Chooses the device (logging the choice) or says why the requested one cannot be used.
    /// Only devices the engine has a backend for come back, so today always the CPU.
    pub fn select(&self) -> Result<device::Device> {
        Ok(device::select(self.device)?)
    }
}

/// clap's parser for device flags: the engine's one parser, its message as clap's.
pub fn parse_device(s: &str) -> std::result::Result<DeviceRequest, String> {
    s.parse()
        .map_err(|e: crate::engine::EngineError| e.to_string())
}

/// Sets the size of the global rayon pool that the engine's kernels run on.
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

/// `--kv-type`, set once at start-up (a global flag, like `--threads`).
static KV_TYPE: OnceLock<KvType> = OnceLock::new();

/// Records `--kv-type` for the subcommands.
pub fn init_kv_type(kv_type: Option<KvType>) {
    if let Some(t) = kv_type {
        // Set once from main; a second call would be a programming error and changes nothing.
        let _ = KV_TYPE.set(t);
    }
}

/// `--kv-type` when given.
pub fn kv_type_flag() -> Option<KvType> {
    KV_TYPE.get().copied()
}

/// KV options for the commands that run the model outside the server: `--kv-type` (default f16)
/// and the default 2 GiB budget.
pub fn kv_options() -> KvOptions {
    KvOptions {
        kv_type: kv_type_flag().unwrap_or_default(),
        ..KvOptions::default()
    }
}

/// Wraps a loaded model in an engine with [`kv_options`].
pub fn engine_for(model: Model) -> Result<Engine> {
    Ok(Engine::with_kv(model, kv_options())?)
}

/// Resolves `--model`, defaulting to the embedded model, with a message that says how to fix a
/// missing file.
pub fn model_path(arg: Option<&Path>) -> Result<PathBuf> {
    let path = arg
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL));
    if !path.exists() {
        if arg.is_none() {
            anyhow::bail!(
                "the default model {} is missing; run ./scripts/fetch-model.sh (or `make setup`) to fetch it, or pass --model PATH",
                path.display()
            );
        }
        anyhow::bail!("model file {} does not exist", path.display());
    }
    Ok(path)
}

/// Opens and loads a model with a progress bar on stderr.
pub fn load_engine(path: &Path, device: DeviceArg) -> Result<(Engine, f64)> {
    device.select()?;
    let start = Instant::now();
    let mut src = GgufSource::open(path)?;
    let model = load_with_progress(&mut src)?;
    Ok((engine_for(model)?, start.elapsed().as_secs_f64()))
}

pub fn load_with_progress(src: &mut GgufSource) -> Result<Model> {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let model = Model::load(src, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    Ok(model?)
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
