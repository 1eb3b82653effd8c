//! `smolchat inspect FILE`

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use smolchat_engine::backend::Suggested;
use smolchat_engine::kv::{BlockAllocator, KvLayout};
use smolchat_engine::{KvType, ModelConfig};
use smolchat_gguf::{summarize_value, GgufSource};

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The GGUF file.
    pub file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &InspectArgs) -> Result<()> {
    let src = GgufSource::open(&args.file)?;
    let mut by_type: BTreeMap<String, (usize, u64, u64)> = BTreeMap::new();
    let mut params = 0u64;
    for t in src.tensors.values() {
        let e = by_type.entry(format!("{:?}", t.dtype)).or_default();
        e.0 += 1;
        e.1 += t.elem_count() as u64;
        e.2 += t.n_bytes as u64;
        params += t.elem_count() as u64;
    }
    let metadata: BTreeMap<&String, String> = src
        .metadata
        .iter()
        .map(|(k, v)| (k, summarize_value(v)))
        .collect();
    let config = ModelConfig::from_gguf(&src);
    if args.json {
        let cfg = match &config {
            Ok(c) => serde_json::json!({
                "architecture": c.arch.gguf_name(),
                "layers": c.n_layers, "hidden": c.hidden, "ffn": c.ffn,
                "heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                "rope_theta": c.rope_theta, "context_length": c.context_length,
                "vocab_size": c.vocab_size,
                "nope_layers": c.uses_rope.iter().enumerate().filter(|(_, r)| !**r).map(|(i, _)| i).collect::<Vec<_>>(),
                "kv_bytes_per_token_f32": c.kv_bytes_per_token(),
                "kv_cache": kv_table(c).into_iter().map(|(t, per_token, tokens)| {
                    (t.name().to_string(), serde_json::json!({
                        "bytes_per_token": per_token,
                        "tokens_in_default_budget": tokens,
                    }))
                }).collect::<serde_json::Map<_, _>>(),
            }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        let types: BTreeMap<&String, serde_json::Value> = by_type
            .iter()
            .map(|(k, (n, el, b))| {
                (
                    k,
                    serde_json::json!({"tensors": n, "elements": el, "bytes": b}),
                )
            })
            .collect();
        let out = serde_json::json!({
            "file": args.file,
            "metadata": metadata,
            "tensor_types": types,
            "tensors": src.tensors.len(),
            "parameters": params,
            "model": cfg,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("file: {}", args.file.display());
    println!("\nmetadata:");
    for (k, v) in &metadata {
        println!("  {k} = {v}");
    }
    println!("\ntensors: {} ({} parameters)", src.tensors.len(), params);
    for (ty, (n, el, b)) in &by_type {
        println!(
            "  {ty:<6} {n:>5} tensors {el:>14} elements {:>10.1} MiB",
            *b as f64 / (1 << 20) as f64
        );
    }
    match config {
        Ok(c) => {
            let nope: Vec<usize> = c
                .uses_rope
                .iter()
                .enumerate()
                .filter(|(_, r)| !**r)
                .map(|(i, _)| i)
                .collect();
            println!(
                "\nmodel: {} ({}), {} layers, hidden {}, FFN {}, {} heads / {} KV heads × {}, context {}, vocab {}",
                c.name,
                c.arch.gguf_name(),
                c.n_layers,
                c.hidden,
                c.ffn,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                c.context_length,
                c.vocab_size
            );
            println!("NoPE layers: {nope:?}");
            println!(
                "KV cache: {} bytes per token at f32 ({:.1} KiB)",
                c.kv_bytes_per_token(),
                c.kv_bytes_per_token() as f64 / 1024.0
            );
            for (t, per_token, tokens) in kv_table(&c) {
                match tokens {
                    Some(n) => println!(
                        "  {:<5} {:>5.1} KiB per token, {n} tokens in the CPU's default {} MiB budget",
                        t.name(),
                        per_token as f64 / 1024.0,
                        Suggested::CPU.kv_budget_bytes >> 20
                    ),
                    None => println!("  {:<5} cannot store this model's rows", t.name()),
                }
            }
        }
        Err(e) => println!("\nmodel: cannot run this file: {e}"),
    }
    Ok(())
}

/// Per KV type: bytes per token and the tokens the CPU's default budget holds (from the engine's own
/// block accounting; `None` when the type cannot store this model's rows).
fn kv_table(c: &ModelConfig) -> Vec<(KvType, usize, Option<usize>)> {
    KvType::ALL
        .iter()
        .map(|&t| {
            let layout = KvLayout::new(c, t);
            let tokens = layout.check().ok().map(|_| {
                BlockAllocator::with_budget(
                    Suggested::CPU.kv_budget_bytes,
                    layout.bytes_per_block(),
                )
                .capacity_positions()
            });
            (t, layout.bytes_per_position(), tokens)
        })
        .collect()
}
