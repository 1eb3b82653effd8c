//! `smolchat bench`: load time, prefill and decode throughput, batched decode through the step API,
//! and peak RSS, as JSON on stdout. Figures are for comparing side by side on one machine.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;

use smolchat_engine::synthetic::{self, SyntheticSpec, TypeMix};
use smolchat_engine::{DeviceSampling, Engine, Logits, LogitsMode, SampleRow, SeqStep};
use smolchat_serving::load;

mod knowledge;
mod spill;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The model to measure (default: the embedded SmolLM2-135M-Instruct) and the configuration
    /// it loads with.
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// Measure a random-weight model of a known shape instead of a file: `smollm3-3b` (the
    /// SmolLM3-3B shape with llama.cpp's Q4_K_M type mix).
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated for the decode measurements.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// With --synthetic: write the model as a GGUF file (with a placeholder vocabulary, so
    /// llama.cpp can load it) and exit, to measure other engines on the same weights.
    #[arg(long, requires = "synthetic")]
    pub save_gguf: Option<PathBuf>,
    /// With --synthetic: a real model's tokenizer for it (the GGUF file's `tokenizer.*` keys),
    /// padded to the shape's vocabulary with unused tokens, so servers are driven with real
    /// text in prompts of realistic lengths (the placeholder vocabulary makes one token a
    /// byte). `tests/data/smollm3-tiny-q8_0.gguf` carries SmolLM2's tokenizer and SmolLM3's
    /// chat template.
    #[arg(long, requires = "synthetic")]
    pub tokenizer_from: Option<PathBuf>,
    /// Sequences decoding together for the batched measurement.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Prompt length of each sequence of the batched measurement (llama-batched-bench's
    /// `-npp`; 32 as in the figures llama.cpp is compared by).
    #[arg(long, default_value_t = 32)]
    pub batch_prompt_tokens: usize,
    /// Timed runs of the prefill and of each single-sequence decode, after one untimed run:
    /// the figures are their median (llama-bench's 5 repetitions, warm).
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Instead: speculative decoding's three workloads (benches/speculative_workloads.json:
    /// rewriting a file, quoting a document, free chat), each decoded greedily alone with
    /// drafts off and on, in this process; needs a real model (`--model`), since random
    /// weights copy nothing.
    #[arg(long, conflicts_with = "synthetic")]
    pub speculative: bool,
    /// With --speculative: replay each workload's steps on a random-weight model of this shape
    /// (`smollm3-3b`), drafts off and on, verifying as many drafts per step as the real model's
    /// run did and keeping as many as it accepted. The real model's acceptance at the shape's
    /// step costs: a measurement of the mechanics, not of the shape's own acceptance.
    #[arg(long, requires = "speculative")]
    pub replay_shape: Option<String>,
    /// Also measure the seeds' engine (candle-transformers' own quantized model, CPU) on the
    /// same file, prompt and threads: its prefill and decode beside ours, and our lead as a
    /// ratio (`seed_engine` in the JSON).
    #[arg(long, conflicts_with = "speculative")]
    pub seed_engine: bool,
    /// Profile one decode step instead of benchmarking: prefill DEPTH tokens (DEPTH 0: one),
    /// decode until the step is replayed from a decode graph, then decode one step inside the
    /// backend's profiler range, which Nsight Compute run with `--profile-from-start off`
    /// profiles alone (`scripts/gpu-check.sh profile`). Prints where the range was.
    #[arg(long, value_name = "DEPTH", conflicts_with_all = ["speculative", "seed_engine"])]
    pub profile_decode_at: Option<usize>,
    /// Instead: the KV spill tier's formats on one sequence of `--prompt-tokens` (zstd, the
    /// tier's lossless format, beside q8_0 pages and what they do to a greedy continuation of
    /// `--gen-tokens`); prints one JSON object.
    #[arg(long, conflicts_with_all = ["speculative", "seed_engine", "profile_decode_at"])]
    pub spill_formats: bool,
    /// Instead: what a knowledge search costs at this many passages (keyword ranking, vector
    /// scan, reading the passages found), on `--database-url` (a temporary SQLite file when
    /// none); needs no model. Prints one JSON object.
    #[arg(long, value_name = "N", conflicts_with_all = ["speculative", "seed_engine", "profile_decode_at", "spill_formats"])]
    pub knowledge_passages: Option<usize>,
    /// The store `--knowledge-passages` writes to (e.g. a fresh PostgreSQL database).
    #[arg(long, requires = "knowledge_passages")]
    pub database_url: Option<String>,
    #[command(flatten)]
    pub device: super::DeviceArg,
}

pub fn run(args: &BenchArgs, globals: &super::Globals) -> Result<()> {
    if let Some(n) = args.knowledge_passages {
        return knowledge::run(n, args.database_url.as_deref());
    }
    if args.speculative {
        return speculative(args, globals);
    }
    anyhow::ensure!(args.prompt_tokens > 0, "--prompt-tokens must be at least 1");
    anyhow::ensure!(args.gen_tokens > 0, "--gen-tokens must be at least 1");
    anyhow::ensure!(args.batch > 0, "--batch must be at least 1");
    anyhow::ensure!(args.repeat > 0, "--repeat must be at least 1");
    anyhow::ensure!(
        args.batch_prompt_tokens > 0,
        "--batch-prompt-tokens must be at least 1"
    );
    let config = args.model.config(args.device, globals)?;
    // Before anything computes (building a synthetic model runs on the pool too).
    super::init_threads(config.model.threads)?;
    let options = config.load_options();
    let load_start = Instant::now();
    // The file the seeds' engine loads: the model's own, or the synthetic shape written out.
    let mut seed_file: Option<(PathBuf, Option<tempfile::TempDir>)> = None;
    let (mut engine, model_name) = match &args.synthetic {
        Some(name) => {
            anyhow::ensure!(
                args.model.model.is_none(),
                "--synthetic measures a generated model: leave out --model (and SMOLCHAT_MODEL)"
            );
            let mut spec = synthetic_shape(name)?;
            if let Some(file) = &args.tokenizer_from {
                let src = smolchat_gguf::GgufSource::open(file)
                    .with_context(|| format!("--tokenizer-from {}", file.display()))?;
                spec = spec.with_tokenizer_padded_from(&src)?;
            }
            if let Some(path) = &args.save_gguf {
                synthetic::write_gguf(&spec, path)?;
                tracing::info!(path = %path.display(), "wrote the synthetic model");
                return Ok(());
            }
            if args.seed_engine {
                let dir = tempfile::tempdir().context("a folder for the synthetic model")?;
                let path = dir.path().join("synthetic.gguf");
                synthetic::write_gguf(&spec, &path)?;
                seed_file = Some((path, Some(dir)));
            }
            let src = synthetic::build(&spec)?;
            let loaded = super::with_progress(|p| Ok(load::load_source(src, &options, p)?))?;
            (loaded.engine, format!("synthetic:{name}"))
        }
        None => {
            let path = config.model.existing_path()?;
            if args.seed_engine {
                seed_file = Some((path.to_path_buf(), None));
            }
            let loaded = super::with_progress(|p| Ok(load::load(path, &options, p)?))?;
            (loaded.engine, path.display().to_string())
        }
    };
    let load_s = load_start.elapsed().as_secs_f64();
    let cfg = engine.config().clone();
    anyhow::ensure!(
        args.prompt_tokens.max(args.batch_prompt_tokens) + args.gen_tokens + WARM_UP_STEPS
            <= cfg.context_length,
        "--prompt-tokens (or --batch-prompt-tokens) + --gen-tokens + {WARM_UP_STEPS} (warm-up \
         steps) exceed the model's context of {}",
        cfg.context_length
    );
    let prompt = pseudo_random_tokens(args.prompt_tokens, cfg.vocab_size, 1);
    if args.spill_formats {
        return spill::run(&mut engine, &model_name, &prompt, args.gen_tokens);
    }
    if let Some(depth) = args.profile_decode_at {
        return profile_decode(&mut engine, depth, cfg.vocab_size, cfg.context_length);
    }

    // Warm figures, as llama-bench gives them: one untimed run, then `--repeat` timed runs of
    // each measurement on a fresh sequence, and their median.
    let on_device = engine.samples_on_device();
    let mut prefill_runs = Vec::with_capacity(args.repeat);
    let mut decode_runs = Vec::with_capacity(args.repeat);
    let mut depth0_runs = Vec::with_capacity(args.repeat);
    let mut verify = serde_json::Value::Null;
    let mut logits = Logits::new();
    for run in 0..=args.repeat {
        // Prefill: the whole prompt in one step, logits for the last position only; then
        // decode from that depth, greedy, drawn on the device where the backend can (as the
        // server does), so only token ids come back.
        let seq = engine.create_sequence();
        let t = Instant::now();
        engine.step_into(
            &[SeqStep {
                seq,
                tokens: &prompt,
                logits: LogitsMode::Last,
            }],
            &mut logits,
        )?;
        let prefill_s = t.elapsed().as_secs_f64();
        let next = argmax(logits.get(0).context("no logits")?);
        let (decode_s, next) = timed_decode(
            &mut engine,
            seq,
            next,
            args.gen_tokens,
            on_device,
            &mut logits,
        )?;
        if run == args.repeat {
            verify = verify_cost(&mut engine, seq, next, cfg.vocab_size)?;
        }
        engine.free_sequence(seq);
        // Decode from an empty context (llama-bench's `tg`): one token in, then the same.
        let seq = engine.create_sequence();
        let first = prompt.first().copied().unwrap_or(0);
        let next = greedy_step(&mut engine, &[seq], &[[first]], on_device, &mut logits)?[0];
        let (depth0_s, _) = timed_decode(
            &mut engine,
            seq,
            next,
            args.gen_tokens,
            on_device,
            &mut logits,
        )?;
        engine.free_sequence(seq);
        if run > 0 {
            prefill_runs.push(args.prompt_tokens as f64 / prefill_s);
            decode_runs.push(args.gen_tokens as f64 / decode_s);
            depth0_runs.push(args.gen_tokens as f64 / depth0_s);
        }
    }

    // Batched decode: N sequences with distinct prompts, then G steps of N decode tokens.
    let batched = batched_decode(
        &mut engine,
        args.batch,
        args.batch_prompt_tokens,
        args.gen_tokens,
        cfg.vocab_size,
    )?;

    let prefill_tps = median(&prefill_runs);
    let decode_tps = median(&decode_runs);
    let depth0_tps = median(&depth0_runs);
    let seed_engine = match &seed_file {
        Some((path, _)) => Some(seed_engine_row(
            path,
            &prompt,
            args.gen_tokens,
            prefill_tps,
            decode_tps,
        )?),
        None => None,
    };

    let out = json!({
        "model": model_name,
        "architecture": cfg.arch.gguf_name(),
        "threads": rayon::current_num_threads(),
        "isa": smolchat_engine::cpu::Isa::best().name(),
        "device": engine.device().to_string(),
        "tier": engine.tier().to_string(),
        "tier_note": engine.note(),
        "weight_bytes": engine.weight_bytes(),
        "kv": {
            "type": engine.kv_type().name(),
            "bytes_per_token": engine.kv_bytes_per_token(),
            "block_bytes": engine.kv_block_bytes(),
            "budget_bytes": engine.kv_capacity_blocks() * engine.kv_block_bytes(),
            "capacity_tokens": engine.kv_capacity_tokens(),
            "resident_bytes": engine.kv_resident_bytes(),
        },
        "load_s": load_s,
        "repeat": args.repeat,
        "prefill": {
            "prompt_tokens": args.prompt_tokens,
            "seconds": args.prompt_tokens as f64 / prefill_tps,
            "tokens_per_s": prefill_tps,
            "runs_tokens_per_s": prefill_runs,
        },
        "decode": {
            "tokens": args.gen_tokens,
            "depth": args.prompt_tokens + WARM_UP_STEPS,
            "seconds": args.gen_tokens as f64 / decode_tps,
            "tokens_per_s": decode_tps,
            "runs_tokens_per_s": decode_runs,
        },
        "decode_depth0": {
            "tokens": args.gen_tokens,
            "depth": 1 + WARM_UP_STEPS,
            "seconds": args.gen_tokens as f64 / depth0_tps,
            "tokens_per_s": depth0_tps,
            "runs_tokens_per_s": depth0_runs,
        },
        "seed_engine": seed_engine,
        "batched_decode": batched,
        "verify_steps": verify,
        "sampling": if engine.samples_on_device() { "device" } else { "host" },
        "graphs": engine.graph_stats(),
        "device_memory": engine.device_memory(),
        "peak_rss_bytes": super::peak_rss_bytes(),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// The seeds' engine (`smolchat_engine::seed`: candle-transformers' own quantized model, on the
/// CPU with the same thread pool) measured as ours is: the prompt in one step, two untimed
/// decode steps, then `gen_tokens` greedy ones; with our figures over its as ratios.
fn seed_engine_row(
    path: &std::path::Path,
    prompt: &[u32],
    gen_tokens: usize,
    our_prefill_tps: f64,
    our_decode_tps: f64,
) -> Result<serde_json::Value> {
    let t = Instant::now();
    let mut seed = smolchat_engine::seed::SeedModel::load(path)?;
    let load_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut next = argmax(&seed.forward(prompt, 0)?);
    let prefill_s = t.elapsed().as_secs_f64();
    let mut past = prompt.len();
    for _ in 0..2 {
        next = argmax(&seed.forward(&[next], past)?);
        past += 1;
    }
    let t = Instant::now();
    for _ in 0..gen_tokens {
        next = argmax(&seed.forward(&[next], past)?);
        past += 1;
    }
    let decode_s = t.elapsed().as_secs_f64();
    let prefill_tps = prompt.len() as f64 / prefill_s;
    let decode_tps = gen_tokens as f64 / decode_s;
    Ok(json!({
        "engine": "candle-transformers 0.11.1 (quantized_llama / smol::quantized_smollm3)",
        "device": "cpu",
        "load_s": load_s,
        "prefill": { "prompt_tokens": prompt.len(), "seconds": prefill_s, "tokens_per_s": prefill_tps },
        "decode": { "tokens": gen_tokens, "seconds": decode_s, "tokens_per_s": decode_tps },
        "ours_over_seed": {
            "prefill": our_prefill_tps / prefill_tps,
            "decode": our_decode_tps / decode_tps,
        },
    }))
}

/// A random-weight model of a known shape, with a placeholder vocabulary so it loads like any
/// file (and llama.cpp can load a saved copy); the text it would produce is meaningless.
fn synthetic_shape(name: &str) -> Result<SyntheticSpec> {
    let spec = match name {
        "smollm3-3b" => SyntheticSpec::smollm3_3b(),
        // The smallest shape with a NoPE layer, in a llama.cpp type mix: a smoke test.
        "tiny" => SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Q4KM),
        other => anyhow::bail!("unknown synthetic shape `{other}`; known: smollm3-3b, tiny"),
    };
    Ok(spec.with_placeholder_tokenizer())
}

/// A workload's speculative run, which `--replay-shape` replays step by step.
struct WorkloadTrace {
    name: String,
    prompt_len: usize,
    run: smolchat_serving::model::AloneRun,
}

/// `bench --speculative --replay-shape`: each workload's decode steps replayed on a random-weight model of `shape`,
/// drafts off then on, twice each alternately (the faster of each kept), after a prompt of the
/// workload's length.
fn replay_on_shape(
    shape: &str,
    options: &load::LoadOptions,
    traces: &[WorkloadTrace],
) -> Result<serde_json::Value> {
    let src = synthetic::build(&synthetic_shape(shape)?)?;
    let loaded = super::with_progress(|p| Ok(load::load_source(src, options, p)?))?;
    let mut engine = loaded.engine;
    let longest = traces
        .iter()
        .map(|t| t.prompt_len)
        .max()
        .unwrap_or(1)
        .max(1);
    let seq = engine.create_sequence();
    let mut logits = Logits::new();
    let prompt = pseudo_random_tokens(longest, engine.config().vocab_size, 3);
    engine.step_into(
        &[SeqStep {
            seq,
            tokens: &prompt,
            logits: LogitsMode::None,
        }],
        &mut logits,
    )?;
    let mut rows = Vec::new();
    for WorkloadTrace {
        name,
        prompt_len,
        run,
    } in traces
    {
        let verified = &run.verified;
        // The run's steps; the same with drafts cut to 2 and to 4 (what a shorter draft would
        // have kept of each); and one plain step per token of the run.
        let capped = |cap: usize| -> Vec<(usize, usize)> {
            verified
                .iter()
                .map(|&(k, a)| (k.min(cap), a.min(cap)))
                .collect()
        };
        let tokens: usize = verified.iter().map(|&(_, a)| a + 1).sum();
        let runs = [
            ("off", vec![(0, 0); tokens]),
            ("on", verified.to_vec()),
            ("on_max2", capped(2)),
            ("on_max4", capped(4)),
        ];
        // Each way twice, alternately; the faster of the two kept.
        let mut best = [f64::INFINITY; 4];
        let mut made = [0usize; 4];
        for _ in 0..2 {
            for (i, (_, steps)) in runs.iter().enumerate() {
                let (s, n) = replay_steps(&mut engine, seq, *prompt_len, steps, &mut logits)?;
                best[i] = best[i].min(s);
                made[i] = n;
            }
        }
        let speed = |i: usize| {
            if best[i] > 0.0 {
                made[i] as f64 / best[i]
            } else {
                0.0
            }
        };
        let mut row = json!({
            "workload": name,
            "prompt_tokens": prompt_len,
            "tokens": tokens,
            "steps_on": verified.len(),
            "drafted": run.drafted(),
            "accepted": run.accepted(),
            "ratio": if speed(0) > 0.0 { speed(1) / speed(0) } else { 0.0 },
        });
        for (i, (way, _)) in runs.iter().enumerate() {
            row[format!("decode_tokens_per_s_{way}")] = json!(speed(i));
        }
        rows.push(row);
    }
    Ok(json!({
        "shape": shape,
        "device": engine.device().to_string(),
        "workloads": rows,
    }))
}

/// Replays decode steps on `engine` after a cached prompt of `prompt_len` positions in `seq`
/// (left as it was): `steps` is per step (drafts verified, accepted); `(0, 0)` is a plain
/// decode step. Each step asks for what the CPU worker
/// asks for (every position's logits when it verifies drafts) and draws the rows the worker
/// draws (the accepted ones and the one after), greedily on the host; rejected positions are
/// truncated. The seconds and the tokens generated.
fn replay_steps(
    engine: &mut Engine,
    seq: u64,
    prompt_len: usize,
    steps: &[(usize, usize)],
    logits: &mut Logits,
) -> Result<(f64, usize)> {
    engine.truncate(seq, prompt_len)?;
    let vocab = engine.config().vocab_size;
    let tokens: usize = steps.iter().map(|&(_, a)| a + 1).sum();
    let mut next = 1u32;
    let t = Instant::now();
    for (i, &(k, a)) in steps.iter().enumerate() {
        let input = pseudo_random_tokens(k, vocab, 7 + i as u64);
        let input: Vec<u32> = std::iter::once(next).chain(input).collect();
        let past = engine.cached_tokens(seq)?.len();
        engine.step_into(
            &[SeqStep {
                seq,
                tokens: &input,
                logits: if k > 0 {
                    LogitsMode::All
                } else {
                    LogitsMode::Last
                },
            }],
            logits,
        )?;
        let rows = logits.get(0).context("no logits")?;
        for row in rows.chunks(vocab).take(a + 1) {
            next = argmax(row);
        }
        if k > a {
            engine.truncate(seq, past + 1 + a)?;
        }
    }
    engine.truncate(seq, prompt_len)?;
    Ok((t.elapsed().as_secs_f64(), tokens))
}

/// `--profile-decode-at`: one decode step at `depth` inside the profiler range, after
/// [`WARM_UP_STEPS`] and two more (the graph warmed up, captured, then replayed once).
fn profile_decode(engine: &mut Engine, depth: usize, vocab: usize, context: usize) -> Result<()> {
    const BEFORE: usize = WARM_UP_STEPS + 2;
    anyhow::ensure!(
        depth.max(1) + BEFORE < context,
        "--profile-decode-at {depth} and {} decode steps exceed the model's context of {context}",
        BEFORE + 1
    );
    let on_device = engine.samples_on_device();
    let mut logits = Logits::new();
    let prompt = pseudo_random_tokens(depth.max(1), vocab, 1);
    let seq = engine.create_sequence();
    engine.step_into(
        &[SeqStep {
            seq,
            tokens: &prompt,
            logits: LogitsMode::Last,
        }],
        &mut logits,
    )?;
    let mut next = argmax(logits.get(0).context("no logits")?);
    for _ in 0..BEFORE {
        next = greedy_step(engine, &[seq], &[[next]], on_device, &mut logits)?[0];
    }
    engine.profiler_range(true)?;
    let t = Instant::now();
    let step = greedy_step(engine, &[seq], &[[next]], on_device, &mut logits);
    let seconds = t.elapsed().as_secs_f64();
    engine.profiler_range(false)?;
    step?;
    engine.free_sequence(seq);
    println!(
        "{}",
        serde_json::json!({
            "profiled": "one greedy decode step of one sequence",
            "depth": depth.max(1) + BEFORE,
            "steps_before": BEFORE,
            "seconds": seconds,
        })
    );
    Ok(())
}

/// Untimed decode steps before each timed decode, as llama-bench warms up: on a GPU the first
/// one warms the decode graph's bucket up and the second captures it.
const WARM_UP_STEPS: usize = 2;

/// Decodes `gen` tokens of `seq` greedily after [`WARM_UP_STEPS`] untimed ones, from `next`:
/// the seconds the timed ones took, and the last token.
fn timed_decode(
    engine: &mut Engine,
    seq: u64,
    mut next: u32,
    gen: usize,
    on_device: bool,
    logits: &mut Logits,
) -> Result<(f64, u32)> {
    for _ in 0..WARM_UP_STEPS {
        next = greedy_step(engine, &[seq], &[[next]], on_device, logits)?[0];
    }
    let t = Instant::now();
    for _ in 0..gen {
        next = greedy_step(engine, &[seq], &[[next]], on_device, logits)?[0];
    }
    Ok((t.elapsed().as_secs_f64(), next))
}

/// The median of `runs` (the mean of the middle two for an even count).
fn median(runs: &[f64]) -> f64 {
    let mut sorted = runs.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn batched_decode(
    engine: &mut Engine,
    n: usize,
    prompt_tokens: usize,
    gen: usize,
    vocab: usize,
) -> Result<serde_json::Value> {
    let seqs: Vec<u64> = (0..n).map(|_| engine.create_sequence()).collect();
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| pseudo_random_tokens(prompt_tokens, vocab, 100 + i as u64))
        .collect();
    let steps: Vec<SeqStep<'_>> = seqs
        .iter()
        .zip(&prompts)
        .map(|(&seq, p)| SeqStep {
            seq,
            tokens: p,
            logits: LogitsMode::Last,
        })
        .collect();
    let mut logits = Logits::new();
    engine.step_into(&steps, &mut logits)?;
    let mut next: Vec<[u32; 1]> = (0..n)
        .map(|i| logits.get(i).map(|l| [argmax(l)]).context("no logits"))
        .collect::<Result<_>>()?;
    let on_device = engine.samples_on_device();
    for _ in 0..WARM_UP_STEPS {
        next = greedy_step(engine, &seqs, &next, on_device, &mut logits)?
            .into_iter()
            .map(|t| [t])
            .collect();
    }
    let t = Instant::now();
    for _ in 0..gen {
        next = greedy_step(engine, &seqs, &next, on_device, &mut logits)?
            .into_iter()
            .map(|t| [t])
            .collect();
    }
    let secs = t.elapsed().as_secs_f64();
    for s in seqs {
        engine.free_sequence(s);
    }
    Ok(json!({
        "sequences": n,
        "prompt_tokens": prompt_tokens,
        "tokens_each": gen,
        "seconds": secs,
        "aggregate_tokens_per_s": (n * gen) as f64 / secs,
        "per_sequence_tokens_per_s": gen as f64 / secs,
    }))
}

/// What speculative decoding's verification costs on this model and machine: one sequence's
/// decode step of 1, 2, 4 and 8 positions with every position's logits (as a step verifying 0,
/// 1, 3 and 7 drafts asks), each rolled back after, timed over several repetitions. The ratio
/// to one position is what a verifying step costs against the plain decode step it replaces.
fn verify_cost(
    engine: &mut Engine,
    seq: u64,
    last: u32,
    vocab: usize,
) -> Result<serde_json::Value> {
    const REPEATS: usize = 8;
    let kept = engine.cached_tokens(seq)?.len();
    let mut logits = Logits::new();
    let mut rows = Vec::new();
    let mut one = 0.0;
    for positions in [1usize, 2, 4, 8] {
        let mut tokens = vec![last];
        tokens.extend(pseudo_random_tokens(
            positions - 1,
            vocab,
            7 + positions as u64,
        ));
        let mut run = |engine: &mut Engine| -> Result<()> {
            engine.step_into(
                &[SeqStep {
                    seq,
                    tokens: &tokens,
                    logits: LogitsMode::All,
                }],
                &mut logits,
            )?;
            engine.truncate(seq, kept)?;
            Ok(())
        };
        run(engine)?; // untimed: buffers sized, caches warm
        let t = Instant::now();
        for _ in 0..REPEATS {
            run(engine)?;
        }
        let per_step = t.elapsed().as_secs_f64() / REPEATS as f64;
        if positions == 1 {
            one = per_step;
        }
        rows.push(json!({
            "positions": positions,
            "seconds_per_step": per_step,
            "ratio_to_one": if one > 0.0 { per_step / one } else { 0.0 },
        }));
    }
    Ok(serde_json::Value::Array(rows))
}

/// One greedy decode step of `seqs` fed `tokens`: the argmax drawn on the device when
/// `on_device`, else on the host from the logits brought back.
fn greedy_step(
    engine: &mut Engine,
    seqs: &[u64],
    tokens: &[[u32; 1]],
    on_device: bool,
    logits: &mut Logits,
) -> Result<Vec<u32>> {
    let greedy = DeviceSampling {
        row: SampleRow::GREEDY,
        penalties: Vec::new(),
    };
    let steps: Vec<SeqStep<'_>> = seqs
        .iter()
        .zip(tokens)
        .map(|(&seq, tok)| SeqStep {
            seq,
            tokens: tok,
            logits: if on_device {
                LogitsMode::Sample
            } else {
                LogitsMode::Last
            },
        })
        .collect();
    let sampling = vec![std::slice::from_ref(&greedy); seqs.len()];
    engine.step_sampled_into(&steps, if on_device { &sampling } else { &[] }, logits)?;
    (0..seqs.len())
        .map(|i| {
            if on_device {
                logits.token(i).context("no drawn token")
            } else {
                logits.get(i).map(argmax).context("no logits")
            }
        })
        .collect()
}

/// Deterministic token ids spread over the vocabulary (a xorshift stream).
fn pseudo_random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The workloads every speculative-decoding benchmark runs (one file, read by the scripts too).
const SPEC_WORKLOADS: &str = include_str!("../../../benches/speculative_workloads.json");

/// `smolchat bench --speculative`: each workload decoded greedily alone, drafts off then on,
/// through the model worker's own step (no scheduler, no HTTP); `--gen-tokens` new tokens. The
/// draft rule is the configuration's (`scheduler.draft_break_even`: measured unless fixed).
fn speculative(args: &BenchArgs, globals: &super::Globals) -> Result<()> {
    use smolchat_serving::model::ModelWorker;
    use smolchat_serving::SpecConfig;
    let config = args.model.config(args.device, globals)?;
    super::init_threads(config.model.threads)?;
    let options = config.load_options();
    let path = config.model.existing_path()?;
    let loaded = super::with_progress(|p| Ok(load::load(path, &options, p)?))?;
    let workloads: serde_json::Value =
        serde_json::from_str(SPEC_WORKLOADS).context("benches/speculative_workloads.json")?;
    let mut prompts = Vec::new();
    for w in workloads["workloads"].as_array().into_iter().flatten() {
        let name = w["name"].as_str().unwrap_or("?").to_string();
        let text = w["prompt"].as_str().unwrap_or_default();
        let messages = [smolchat_text::template::ChatMessage::user(text)];
        prompts.push((
            name,
            super::generate::chat_prompt(&loaded, &messages, Some(false))?,
        ));
    }
    let mut series_prompts = Vec::new();
    for text in workloads["chat_series"].as_array().into_iter().flatten() {
        let messages = [smolchat_text::template::ChatMessage::user(
            text.as_str().unwrap_or_default(),
        )];
        series_prompts.push(super::generate::chat_prompt(
            &loaded,
            &messages,
            Some(false),
        )?);
    }
    let window = loaded.engine.config().context_length;
    let s = &config.scheduler;
    let spec = SpecConfig {
        enabled: true,
        max_draft: s.draft_max,
        max_ngram: s.draft_ngram_max,
        min_ngram: s.draft_ngram_min,
        max_batch: s.draft_max_batch.max(1),
        fixed_break_even: s.draft_break_even,
        ngram_cache: s.draft_ngram_cache,
        on_gpu: true,
    };
    let device = loaded.engine.device().to_string();
    let mut worker = ModelWorker::new(loaded.engine, std::sync::Arc::new(loaded.tokenizer), window);
    let mut rows = Vec::new();
    let mut traces = Vec::new();
    for (name, prompt) in &prompts {
        // Untimed first: the prompt's prefix is then cached for both timed runs alike.
        worker.generate_alone(prompt.clone(), 4);
        let mut w = worker.with_speculation(SpecConfig {
            enabled: false,
            ..spec
        });
        let off_run = w.generate_alone(prompt.clone(), args.gen_tokens);
        w = w.with_speculation(spec);
        let on_run = w.generate_alone(prompt.clone(), args.gen_tokens);
        worker = w;
        let (off, on) = (off_run.decode_tokens_per_s(), on_run.decode_tokens_per_s());
        rows.push(json!({
            "workload": name,
            "prompt_tokens": prompt.len(),
            "tokens": off_run.tokens.len(),
            "decode_tokens_per_s_off": off,
            "decode_tokens_per_s_on": on,
            "ratio": if off > 0.0 { on / off } else { 0.0 },
            "steps_off": off_run.steps,
            "steps_on": on_run.steps,
            "drafted": on_run.drafted(),
            "accepted": on_run.accepted(),
            "same_tokens": off_run.tokens == on_run.tokens,
        }));
        traces.push(WorkloadTrace {
            name: name.clone(),
            prompt_len: prompt.len(),
            run: on_run,
        });
    }
    // The chat series: one user's distinct questions in turn, drafts off, then prompt lookup
    // alone, then with the n-gram cache of the replies before (which learns as the series goes).
    let mut series = Vec::new();
    let mut replies: Vec<Vec<Vec<u32>>> = Vec::new();
    for (name, config) in [
        (
            "off",
            SpecConfig {
                enabled: false,
                ..spec
            },
        ),
        (
            "lookup",
            SpecConfig {
                ngram_cache: false,
                ..spec
            },
        ),
        ("lookup+ngram_cache", spec),
    ] {
        let mut w = worker.with_speculation(config);
        let (mut tokens, mut seconds, mut steps) = (0usize, 0.0f64, 0usize);
        let (mut drafted, mut accepted) = (0usize, 0usize);
        let mut these = Vec::new();
        for prompt in &series_prompts {
            let run = w.generate_alone(prompt.clone(), args.gen_tokens);
            tokens += run.tokens.len().saturating_sub(1);
            seconds += run.seconds;
            steps += run.steps;
            drafted += run.drafted();
            accepted += run.accepted();
            these.push(run.tokens);
        }
        worker = w;
        replies.push(these);
        series.push(json!({
            "drafts": name,
            "questions": series_prompts.len(),
            "decode_tokens": tokens,
            "decode_tokens_per_s": if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 },
            "steps": steps,
            "drafted": drafted,
            "accepted": accepted,
        }));
    }
    let same_series = replies.windows(2).all(|w| w[0] == w[1]);
    drop(worker);
    let replay = match &args.replay_shape {
        Some(shape) => Some(replay_on_shape(shape, &options, &traces)?),
        None => None,
    };
    let out = json!({
        "model": path.display().to_string(),
        "threads": rayon::current_num_threads(),
        "device": device,
        "speculative": rows,
        "chat_series": { "runs": series, "same_tokens": same_series },
        "replay": replay,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
