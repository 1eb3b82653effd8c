//! `smolchat tokenize --model F [--special] TEXT`: token ids as a JSON array.

use anyhow::Result;
use clap::Args;

use smolchat_gguf::GgufSource;
use smolchat_text::tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// Parse special tokens such as `<|im_start|>` as single ids.
    #[arg(long)]
    pub special: bool,
    /// Prepend BOS when the model asks for it (`tokenizer.ggml.add_bos_token`).
    #[arg(long)]
    pub add_bos: bool,
    pub text: String,
}

pub fn run(args: &TokenizeArgs, globals: &super::Globals) -> Result<()> {
    let config = args.model.config(super::DeviceArg::default(), globals)?;
    let src = GgufSource::open(config.model.existing_path()?)?;
    // The tokenizer the server would use: `model.tokenizer` when configured.
    let tokenizer = Tokenizer::load(&src, config.model.tokenizer.as_deref())?;
    let mut ids = Vec::new();
    if args.add_bos && tokenizer.add_bos() {
        ids.extend(tokenizer.bos_id());
    }
    ids.extend(tokenizer.encode(&args.text, args.special)?);
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
