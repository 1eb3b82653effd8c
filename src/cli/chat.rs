//! `smolchat chat`: a terminal conversation with streaming. `/think` and `/no_think` switch
//! thinking, `/reset` starts over, `/exit` (or end of input) quits. The KV cache is kept between
//! turns, so each turn prefills only the tokens the previous one did not.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Result;
use clap::Args;

use super::generate::{chat_prompt, stream, SamplingArgs};
use smolchat_text::generation::Generation;
use smolchat_text::splitter::{SplitEvent, Splitter};
use smolchat_text::template::ChatMessage;

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// A system prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Start with thinking off.
    #[arg(long)]
    pub no_think: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub device: super::DeviceArg,
}

pub fn run(args: &ChatArgs, globals: &super::Globals) -> Result<()> {
    let mut loaded = args.model.load(args.device, globals)?;
    let params = args.sampling.params();
    params.validate()?;
    let seq = loaded.engine.create_sequence();
    let mut thinking = !args.no_think;
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::system(s));
    }
    let interactive = std::io::stdin().is_terminal();
    let (dim, reset) = if std::io::stdout().is_terminal() {
        ("\x1b[2m", "\x1b[0m")
    } else {
        ("", "")
    };
    let mut stdout = std::io::stdout();
    eprintln!(
        "smolchat chat: {} — /think, /no_think, /reset, /exit",
        loaded.engine.config().name
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            write!(stdout, "> ")?;
            stdout.flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let input = line.trim();
        match input {
            "" => continue,
            "/exit" | "/quit" => break,
            "/think" => {
                thinking = true;
                eprintln!("thinking on");
                continue;
            }
            "/no_think" => {
                thinking = false;
                eprintln!("thinking off");
                continue;
            }
            "/reset" => {
                messages.retain(|m| m.role == "system");
                eprintln!("conversation cleared");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::user(input));
        let prompt = chat_prompt(&loaded, &messages, Some(thinking))?;
        let generation = Generation::new(&loaded.tokenizer, params.clone(), &prompt)?;
        let mut splitter = Splitter::new(false);
        let mut raw = String::new();
        let show = |events: Vec<SplitEvent>, out: &mut std::io::Stdout| -> Result<()> {
            for ev in events {
                match ev {
                    SplitEvent::Reasoning(t) => write!(out, "{dim}{t}{reset}")?,
                    SplitEvent::Answer(t) => write!(out, "{t}")?,
                    SplitEvent::ToolCall(c) => {
                        write!(out, "[tool call {} {}]", c.name, c.arguments)?
                    }
                    SplitEvent::InvalidToolCall { raw, .. } => write!(out, "{raw}")?,
                }
            }
            out.flush()?;
            Ok(())
        };
        let result = stream(&mut loaded.engine, seq, &prompt, generation, &mut |text| {
            raw.push_str(text);
            let events = splitter.push(text);
            show(events, &mut std::io::stdout())
        })?;
        show(splitter.finish(), &mut stdout)?;
        writeln!(stdout)?;
        eprintln!(
            "{dim}[{} prompt tokens ({} cached), {} generated, {:.1} tok/s]{reset}",
            result.prompt_tokens,
            result.reused_tokens,
            result.generated.len(),
            result.generated.len() as f64 / result.decode_s.max(1e-9)
        );
        // The exact generated text goes back into the history so the next render is
        // token-identical to what the cache holds.
        messages.push(ChatMessage::generated(&raw));
    }
    Ok(())
}
