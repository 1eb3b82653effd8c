//! `smolchat generate`: one prompt, streamed to stdout. Also the shared single-sequence decode loop
//! used by `chat`.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;

use smolchat_engine::{Engine, Logits, LogitsMode, SeqId, SeqStep};
use smolchat_serving::load::LoadedModel;
use smolchat_text::generation::{FinishReason, Generation};
use smolchat_text::prompt::PromptBuilder;
use smolchat_text::sampling::SamplingParams;
use smolchat_text::template::{ChatMessage, RenderOptions};

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop before this string (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            seed: self.seed,
            max_new_tokens: self.max_tokens,
            stop_strings: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            ..SamplingParams::default()
        }
    }
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// Feed PROMPT as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// A system prompt (chat template mode).
    #[arg(long)]
    pub system: Option<String>,
    /// Turn thinking off (`enable_thinking = false`, SmolLM3's `/no_think`).
    #[arg(long)]
    pub no_think: bool,
    #[command(flatten)]
    pub device: super::DeviceArg,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The prompt.
    pub prompt: String,
}

/// Renders a conversation with the file's template and tokenizes it (the template's special
/// tokens parsed, the messages' text kept as text).
pub fn chat_prompt(
    loaded: &LoadedModel,
    messages: &[ChatMessage],
    enable_thinking: Option<bool>,
) -> Result<Vec<u32>> {
    let template = loaded.template.as_ref().map_err(|e| {
        anyhow::anyhow!(
            "this model has no usable chat template ({e}); use --raw to feed the prompt without one"
        )
    })?;
    let mut opts = RenderOptions::new(chrono::Local::now().date_naive());
    opts.enable_thinking = enable_thinking;
    let prompt = PromptBuilder::new(template, &loaded.tokenizer).build(messages, &opts)?;
    tracing::debug!(prompt = %prompt.text, "rendered prompt");
    Ok(prompt.tokens)
}

/// Result of one streamed generation.
pub struct Streamed {
    pub prompt_tokens: usize,
    pub reused_tokens: usize,
    pub generated: Vec<u32>,
    pub finish: Option<FinishReason>,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// Runs `prompt` on `seq`, reusing the longest cached prefix, and streams text to `on_text`.
pub fn stream(
    engine: &mut Engine,
    seq: SeqId,
    prompt: &[u32],
    mut generation: Generation,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Streamed> {
    let window = engine.config().context_length;
    anyhow::ensure!(
        prompt.len() < window,
        "the prompt has {} tokens but the context window is {window}",
        prompt.len()
    );
    let reuse = engine.reuse_prefix(seq, prompt)?;
    let t = Instant::now();
    let mut logits = Logits::new();
    engine.step_into(
        &[SeqStep {
            seq,
            tokens: &prompt[reuse..],
            logits: LogitsMode::Last,
        }],
        &mut logits,
    )?;
    let prefill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    loop {
        let cached = engine.cached_tokens(seq)?.len();
        let row = logits.last_row_mut(0).context("no logits")?;
        let outcome = generation.next_token_within(row, cached, window)?;
        if !outcome.text.is_empty() {
            on_text(&outcome.text)?;
        }
        if outcome.finished.is_some() {
            break;
        }
        engine.step_into(
            &[SeqStep {
                seq,
                tokens: &[outcome.token],
                logits: LogitsMode::Last,
            }],
            &mut logits,
        )?;
    }
    Ok(Streamed {
        prompt_tokens: prompt.len(),
        reused_tokens: reuse,
        generated: generation.generated().to_vec(),
        finish: generation.finished().cloned(),
        prefill_s,
        decode_s: t.elapsed().as_secs_f64(),
    })
}

pub fn run(args: &GenerateArgs, globals: &super::Globals) -> Result<()> {
    let mut loaded = args.model.load(args.device, globals)?;
    let prompt = if args.raw {
        loaded.tokenizer.encode_prompt(&args.prompt)?
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::system(s));
        }
        messages.push(ChatMessage::user(&args.prompt));
        chat_prompt(&loaded, &messages, args.no_think.then_some(false))?
    };
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let params = args.sampling.params();
    params.validate()?;
    let generation = Generation::new(&loaded.tokenizer, params, &prompt)?;
    let seq = loaded.engine.create_sequence();
    let mut stdout = std::io::stdout().lock();
    let result = stream(&mut loaded.engine, seq, &prompt, generation, &mut |text| {
        stdout.write_all(text.as_bytes())?;
        stdout.flush()?;
        Ok(())
    })?;
    writeln!(stdout)?;
    tracing::info!(
        prompt_tokens = result.prompt_tokens,
        generated = result.generated.len(),
        prefill_tok_s = result.prompt_tokens as f64 / result.prefill_s,
        decode_tok_s = result.generated.len() as f64 / result.decode_s,
        finish = ?result.finish,
        "done"
    );
    Ok(())
}
