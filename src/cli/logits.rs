//! `smolchat logits --model F --tokens 1,2,3 --out F.npy`

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use smolchat_engine::{LogitsMode, SeqStep};

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// Comma-separated token ids, fed in one prefill at positions 0..n.
    #[arg(long)]
    pub tokens: String,
    /// Output file: float32 [n_tokens, vocab] in NumPy .npy format.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: super::DeviceArg,
}

pub fn run(args: &LogitsArgs, globals: &super::Globals) -> Result<()> {
    let tokens = super::parse_ids(&args.tokens)?;
    anyhow::ensure!(!tokens.is_empty(), "--tokens is empty: give ids like 1,2,3");
    let mut engine = args.model.load(args.device, globals)?.engine;
    let vocab = engine.config().vocab_size;
    let seq = engine.create_sequence();
    let out = engine.step(&[SeqStep {
        seq,
        tokens: &tokens,
        logits: LogitsMode::All,
    }])?;
    let logits = out
        .into_iter()
        .next()
        .flatten()
        .context("the engine returned no logits")?;
    smolchat_engine::npy::write_f32(&args.out, tokens.len(), vocab, logits)
        .with_context(|| format!("writing {}", args.out.display()))?;
    tracing::info!(path = %args.out.display(), rows = tokens.len(), vocab, "wrote logits");
    Ok(())
}
