//! `smolchat bench --spill-formats`: the KV spill tier's file formats measured side by side on
//! one sequence's f16 KV pages (issue 50 §1): zstd (lossless, what the tier writes) at two
//! levels, and q8_0 (what halving the pages would cost), alone and under zstd. For each, the
//! bytes per 1,000 tokens and the time to encode and decode; for q8_0 also what it does to the
//! reply: the pages are quantized, dequantized and restored into a fresh sequence, and its greedy
//! continuation and first logits are compared with the lossless restore's.

use std::time::Instant;

use anyhow::{Context, Result};
use half::f16;
use serde_json::json;

use smolchat_engine::cpu::kv::{dequantize_q8_0, quantize_q8_0, BlockQ8_0};
use smolchat_engine::step::KvSnapshot;
use smolchat_engine::{Engine, Logits, LogitsMode, SeqStep};

/// Values per q8_0 block, and its bytes (an f16 scale and 32 signed bytes).
const Q8_0_VALUES: usize = 32;
const Q8_0_BYTES: usize = 34;

/// Restores `snapshot` into a new sequence and continues greedily from `next` for `gen`
/// tokens; returns the tokens and the first step's logits.
fn continue_from(
    engine: &mut Engine,
    snapshot: &KvSnapshot,
    next: u32,
    gen: usize,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let seq = engine.restore_kv(snapshot)?;
    let mut logits = Logits::new();
    let mut tokens = Vec::with_capacity(gen);
    let mut first = Vec::new();
    let mut token = next;
    for i in 0..gen {
        engine.step_into(
            &[SeqStep {
                seq,
                tokens: &[token],
                logits: LogitsMode::Last,
            }],
            &mut logits,
        )?;
        let row = logits.get(0).context("no logits")?;
        if i == 0 {
            first = row.to_vec();
        }
        token = super::argmax(row);
        tokens.push(token);
    }
    engine.free_sequence(seq);
    Ok((tokens, first))
}

fn per_1000(bytes: usize, tokens: usize) -> f64 {
    bytes as f64 * 1000.0 / tokens.max(1) as f64
}

fn ms(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e3 * 100.0).round() / 100.0
}

/// Measures the formats on `prompt`'s KV pages; prints one JSON object.
pub fn run(engine: &mut Engine, model: &str, prompt: &[u32], gen: usize) -> Result<()> {
    let mut logits = Logits::new();
    let seq = engine.create_sequence();
    engine.step_into(
        &[SeqStep {
            seq,
            tokens: prompt,
            logits: LogitsMode::Last,
        }],
        &mut logits,
    )?;
    let next = super::argmax(logits.get(0).context("no logits")?);
    let lossless = engine.save_kv(seq)?;
    engine.free_sequence(seq);
    anyhow::ensure!(
        lossless.format.contains("f16"),
        "--spill-formats measures f16 KV pages, and these are `{}`: run with model.kv_type = \
         \"f16\" (the default) on the CPU",
        lossless.format
    );
    let raw = lossless.bytes.len();
    let tokens = lossless.tokens.len();
    let mut formats = Vec::new();
    formats
        .push(json!({"format": "f16 pages (raw)", "bytes_per_1000_tokens": per_1000(raw, tokens)}));
    for level in [1, 3] {
        let t = Instant::now();
        let packed = zstd::bulk::compress(&lossless.bytes, level)?;
        let encode_ms = ms(t);
        let t = Instant::now();
        let back = zstd::bulk::decompress(&packed, raw)?;
        let decode_ms = ms(t);
        anyhow::ensure!(back == lossless.bytes, "zstd did not round-trip");
        formats.push(json!({
            "format": format!("f16 pages, zstd level {level} (lossless)"),
            "bytes_per_1000_tokens": per_1000(packed.len(), tokens),
            "of_raw": packed.len() as f64 / raw as f64,
            "encode_ms": encode_ms,
            "decode_ms": decode_ms,
        }));
    }

    // q8_0: every 32 consecutive values (one position's slice of a head: head sizes are
    // multiples of 32) as ggml's block_q8_0.
    let values: Vec<f32> = lossless
        .bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    anyhow::ensure!(
        values.len().is_multiple_of(Q8_0_VALUES),
        "the pages do not split into q8_0 blocks"
    );
    let t = Instant::now();
    let mut q8 = Vec::with_capacity(values.len() / Q8_0_VALUES * Q8_0_BYTES);
    let mut block = BlockQ8_0::default();
    for chunk in values.chunks_exact(Q8_0_VALUES) {
        quantize_q8_0(chunk, &mut block);
        q8.extend_from_slice(&block.d.to_le_bytes());
        q8.extend(block.qs.iter().map(|&q| q as u8));
    }
    let encode_ms = ms(t);
    let t = Instant::now();
    let mut bytes = Vec::with_capacity(raw);
    let mut out = [0f32; Q8_0_VALUES];
    for b in q8.chunks_exact(Q8_0_BYTES) {
        let mut qs = [0i8; Q8_0_VALUES];
        for (q, &v) in qs.iter_mut().zip(&b[2..]) {
            *q = v as i8;
        }
        let block = BlockQ8_0 {
            d: f16::from_le_bytes([b[0], b[1]]),
            qs,
        };
        dequantize_q8_0(&block, &mut out);
        bytes.extend(out.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()));
    }
    let decode_ms = ms(t);
    let q8_zstd = zstd::bulk::compress(&q8, 1)?;
    let (want, want_logits) = continue_from(engine, &lossless, next, gen)?;
    let lossy = KvSnapshot {
        tokens: lossless.tokens.clone(),
        format: lossless.format.clone(),
        bytes,
    };
    let (got, got_logits) = continue_from(engine, &lossy, next, gen)?;
    let agree = want.iter().zip(&got).take_while(|(a, b)| a == b).count();
    let max_diff = want_logits
        .iter()
        .zip(&got_logits)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    formats.push(json!({
        "format": "q8_0 pages (lossy)",
        "bytes_per_1000_tokens": per_1000(q8.len(), tokens),
        "of_raw": q8.len() as f64 / raw as f64,
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
        "greedy_tokens_equal_to_lossless": format!("{agree} of {gen}"),
        "first_logits_max_abs_diff": max_diff,
    }));
    formats.push(json!({
        "format": "q8_0 pages, zstd level 1",
        "bytes_per_1000_tokens": per_1000(q8_zstd.len(), tokens),
        "of_raw": q8_zstd.len() as f64 / raw as f64,
    }));
    let report = json!({
        "model": model,
        "prompt_tokens": tokens,
        "threads": rayon::current_num_threads(),
        "formats": formats,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
