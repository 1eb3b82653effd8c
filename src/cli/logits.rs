//! `smolchat logits --model F --tokens 1,2,3 --out F.npy`

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::engine::{LogitsMode, SeqStep};

#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// The GGUF model (default: the embedded SmolLM2-135M-Instruct).
    #[arg(long, env = "SMOLCHAT_MODEL")]
    pub model: Option<PathBuf>,
    /// Comma-separated token ids, fed in one prefill at positions 0..n.
    #[arg(long)]
    pub tokens: String,
    /// Output file: float32 [n_tokens, vocab] in NumPy .npy format.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &LogitsArgs) -> Result<()> {
    let tokens = super::parse_ids(&args.tokens)?;
    anyhow::ensure!(!tokens.is_empty(), "--tokens is empty: give ids like 1,2,3");
    let path = super::model_path(args.model.as_deref())?;
    let (mut engine, _) = super::load_engine(&path)?;
    let vocab = engine.model().config.vocab_size;
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
    write_npy_f32(&args.out, &[tokens.len(), vocab], &logits)?;
    tracing::info!(path = %args.out.display(), rows = tokens.len(), vocab, "wrote logits");
    Ok(())
}

/// Writes a little-endian float32 C-order .npy file (format version 1.0).
pub fn write_npy_f32(path: &std::path::Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    // Magic (6) + version (2) + header length (2) + header + '\n' is padded to a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}
