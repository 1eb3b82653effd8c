//! `smolchat tokenize --model F [--special] TEXT`: token ids as a JSON array.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::engine::gguf::GgufSource;
use crate::engine::tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// The GGUF model (default: the embedded SmolLM2-135M-Instruct).
    #[arg(long, env = "SMOLCHAT_MODEL")]
    pub model: Option<PathBuf>,
    /// Parse special tokens such as `<|im_start|>` as single ids.
    #[arg(long)]
    pub special: bool,
    /// Prepend BOS when the model asks for it (`tokenizer.ggml.add_bos_token`).
    #[arg(long)]
    pub add_bos: bool,
    pub text: String,
}

pub fn run(args: &TokenizeArgs) -> Result<()> {
    let path = super::model_path(args.model.as_deref())?;
    let src = GgufSource::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&src)?;
    let mut ids = Vec::new();
    if args.add_bos && tokenizer.add_bos() {
        ids.extend(tokenizer.bos_id());
    }
    ids.extend(tokenizer.encode(&args.text, args.special)?);
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
