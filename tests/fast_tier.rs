//! The fast tier's step (its operation list over the GPU's buffer layouts) run by the CPU
//! runner, whose operations are the kernels' Rust twins: against the CPU engine (teacher-forced
//! logits, greedy replies), against itself batched and alone (bit for bit: every twin is
//! row-independent; a prompt's rows take the flash twin and decode rows the split one, whatever
//! the batch), under prefix reuse, eviction and rebuild, chunked prefill, and the
//! serving worker's preemption. `make gpu-check` runs the same plans with the CUDA runner.

mod common;

use common::*;
use smolchat_engine::fast::cpu::CpuRunner;
use smolchat_engine::fast::weights::FastWeights;
use smolchat_engine::fast::FastBackend;
use smolchat_engine::synthetic::{self, SyntheticSpec, TypeMix};
use smolchat_engine::{Engine, KvOptions, LogitsMode, ModelConfig, SeqStep};
use smolchat_gguf::{GgmlDType, GgufSource};

fn fast_engine(src: GgufSource) -> Engine {
    fast_engine_with(src, false)
}

/// The fast tier on the CPU runner; with `f16`, its steps of more than 8 rows multiply f16
/// weight copies, as a GPU with room for them does.
fn fast_engine_with(mut src: GgufSource, f16: bool) -> Engine {
    let config = ModelConfig::from_gguf(&src).expect("config");
    let weights = FastWeights::load(&mut src, config, &mut |_, _| {}).expect("weights");
    Engine::on_backend(
        Box::new(FastBackend::new(
            CpuRunner::new(weights).with_f16_matmuls(f16),
        )),
        KvOptions::default(),
    )
    .expect("engine")
}

/// The f16 matmuls of wide steps (a GPU with room for the weights' f16 copies): the tiny
/// SmolLM3's prompt (more than 8 rows, so every matmul of it takes the f16 path) stays within
/// 0.05 of llama.cpp's logits with its argmax, and SmolLM2's greedy reply is the CPU engine's.
#[test]
fn f16_matmuls_of_wide_steps_match_llama_cpp_and_the_cpu_engine() {
    let path = reference("smollm3-tiny-q8_0.gguf");
    let meta = read_json(&reference("smollm3-tiny-q8_0-tokens.json"));
    let tokens = ids(&meta["token_ids"]);
    assert!(tokens.len() > 8, "the prompt must be a wide step");
    let (shape, expected) = read_npy(&reference("smollm3-tiny-q8_0-logits-fa-off-kvf32.npy"));
    let vocab = shape[1];
    let expected_argmax = ids(&meta["argmax_per_position"]);
    let got = all_logits(
        &mut fast_engine_with(GgufSource::open(&path).expect("open"), true),
        &tokens,
    );
    for (pos, (g, e)) in got.chunks(vocab).zip(expected.chunks(vocab)).enumerate() {
        assert!(
            max_abs_diff(g, e) <= 0.05,
            "position {pos}: {}",
            max_abs_diff(g, e)
        );
        assert_eq!(argmax(g) as u32, expected_argmax[pos], "argmax at {pos}");
    }
    let prompt: Vec<u32> = (0..45).map(|i| (i * 7919 + 13) % 49_000 + 100).collect();
    let want = greedy(
        &mut cpu_engine(GgufSource::open(&smollm2_path()).expect("open")),
        &prompt,
        &[prompt.len()],
        12,
    );
    let mut fast = fast_engine_with(GgufSource::open(&smollm2_path()).expect("open"), true);
    assert_eq!(greedy(&mut fast, &prompt, &[prompt.len()], 12), want);
}

/// Tiny SmolLM3 (Q8_0): within 0.05 of llama.cpp's logits and 0.03 of the CPU engine at every
/// position, llama.cpp's KV-F16 argmax.
#[test]
fn tiny_smollm3_matches_llama_cpp_and_the_cpu_engine() {
    let path = reference("smollm3-tiny-q8_0.gguf");
    let meta = read_json(&reference("smollm3-tiny-q8_0-tokens.json"));
    let tokens = ids(&meta["token_ids"]);
    let (shape, expected) = read_npy(&reference("smollm3-tiny-q8_0-logits-fa-off-kvf32.npy"));
    let vocab = shape[1];
    let expected_argmax = ids(&meta["argmax_per_position"]);
    let got = all_logits(
        &mut fast_engine(GgufSource::open(&path).expect("open")),
        &tokens,
    );
    let cpu = all_logits(
        &mut cpu_engine(GgufSource::open(&path).expect("open")),
        &tokens,
    );
    for (pos, ((g, e), c)) in got
        .chunks(vocab)
        .zip(expected.chunks(vocab))
        .zip(cpu.chunks(vocab))
        .enumerate()
    {
        assert!(
            max_abs_diff(g, e) <= 0.05,
            "position {pos}: {}",
            max_abs_diff(g, e)
        );
        assert!(
            max_abs_diff(g, c) <= 0.03,
            "position {pos}: {}",
            max_abs_diff(g, c)
        );
        assert_eq!(argmax(g) as u32, expected_argmax[pos], "argmax at {pos}");
    }
}

/// SmolLM2 (Q4_1 with a Q8_0 embedding, the real file): greedy replies equal the CPU engine's,
/// prefilled at once and in uneven chunks; the chunked run equals the whole one bit for bit.
#[test]
fn smollm2_greedy_replies_equal_the_cpu_engines() {
    let prompt: Vec<u32> = (0..45).map(|i| (i * 7919 + 13) % 49_000 + 100).collect();
    let want = greedy(
        &mut cpu_engine(GgufSource::open(&smollm2_path()).expect("open")),
        &prompt,
        &[prompt.len()],
        20,
    );
    let mut fast = fast_engine(GgufSource::open(&smollm2_path()).expect("open"));
    for chunks in [vec![prompt.len()], vec![7, 16, 1, 21]] {
        assert_eq!(
            greedy(&mut fast, &prompt, &chunks, 20),
            want,
            "chunks {chunks:?}"
        );
    }
}

/// Sequences of different lengths in one step, decode and prefill mixed, get exactly the logits
/// each gets alone, within a class of matmul kernels: steps of up to 8 rows (our matvec, where
/// decode rows and drafts live) and wider steps (MMQ, or the f16 GEMM), each of which computes
/// a row the same way whatever the other rows are; across the boundary the sums round
/// differently. A cached prefix reused, then dropped and rebuilt, gives the same logits.
#[test]
fn batched_equals_alone_and_reuse_equals_recompute_bit_for_bit() {
    let path = reference("smollm3-tiny-q8_0.gguf");
    let mut engine = fast_engine(GgufSource::open(&path).expect("open"));
    // Sequence 0 is decoded in the batch (its last token after its head); the others are
    // prompts. Up to 8 rows: alone 3, 2 and 1 rows, together 1 + 2 + 1. Wide: alone 9, 17 and
    // 33 rows, together 1 + 17 + 33.
    for (class, lengths) in [("matvec", [3usize, 2, 1]), ("wide", [9, 17, 33])] {
        let prompts: Vec<Vec<u32>> = lengths
            .iter()
            .enumerate()
            .map(|(s, &n)| {
                (0..n as u32)
                    .map(|i| (i * 31 + s as u32 * 101) % 49_000 + 7)
                    .collect()
            })
            .collect();
        // Alone as in the batch, the last row's logits alone: the last layer's FFN and the LM
        // head then run on the logit rows in the same class (at most 8 of them) both ways.
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| {
                let seq = engine.create_sequence();
                let out = engine
                    .step(&[SeqStep {
                        seq,
                        tokens: p,
                        logits: LogitsMode::Last,
                    }])
                    .expect("alone");
                engine.free_sequence(seq);
                out.into_iter().next().flatten().expect("logits")
            })
            .collect();
        let first = engine.create_sequence();
        let head = &prompts[0][..prompts[0].len() - 1];
        engine
            .step(&[SeqStep {
                seq: first,
                tokens: head,
                logits: LogitsMode::None,
            }])
            .expect("head");
        let mut seqs = vec![first];
        seqs.extend((1..prompts.len()).map(|_| engine.create_sequence()));
        let steps: Vec<SeqStep<'_>> = seqs
            .iter()
            .zip(&prompts)
            .enumerate()
            .map(|(i, (&seq, p))| SeqStep {
                seq,
                tokens: if i == 0 { &p[p.len() - 1..] } else { p },
                logits: LogitsMode::Last,
            })
            .collect();
        let together = engine.step(&steps).expect("together");
        for (i, (got, want)) in together.iter().zip(&alone).enumerate().skip(1) {
            let got = got.as_ref().expect("logits");
            assert_eq!(got, want, "{class}: sequence {i}");
        }
        for s in seqs {
            engine.free_sequence(s);
        }
        // The first sequence's last row was a decode row in the batch (the split kernel), not
        // a prompt row (the flash kernel): alone, the same way (one row: the matvec class), it
        // is the same bit for bit when the batch was of that class too, and within the two
        // classes' rounding when it was wide.
        let seq = engine.create_sequence();
        engine
            .step(&[SeqStep {
                seq,
                tokens: head,
                logits: LogitsMode::None,
            }])
            .expect("head alone");
        let decoded = engine
            .step(&[SeqStep {
                seq,
                tokens: &prompts[0][head.len()..],
                logits: LogitsMode::Last,
            }])
            .expect("last alone");
        engine.free_sequence(seq);
        let batched = together[0].as_deref().unwrap_or_default();
        let single = decoded[0].as_deref().unwrap_or_default();
        if class == "matvec" {
            assert_eq!(batched, single, "sequence 0 decoded alone and batched");
        } else {
            assert!(
                max_abs_diff(batched, single) < 0.02,
                "sequence 0 decoded alone and in a wide batch: {}",
                max_abs_diff(batched, single)
            );
        }
        // As a prompt row it is within the flash kernel's rounding of the decode row's.
        let prompt_row = &alone[0];
        assert!(
            max_abs_diff(prompt_row, batched) < 0.02,
            "{class}: {}",
            max_abs_diff(prompt_row, batched)
        );
    }
    // Prefix reuse: the second turn computes only its new tokens, and equals the whole run.
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 613) % 49_000 + 5).collect();
    let full = all_logits(&mut engine, &tokens);
    let vocab = full.len() / tokens.len();
    let seq = engine.create_sequence();
    engine
        .step(&[SeqStep {
            seq,
            tokens: &tokens[..30],
            logits: LogitsMode::None,
        }])
        .expect("first turn");
    let kept = engine.reuse_prefix(seq, &tokens).expect("reuse");
    assert_eq!(kept, 30);
    let out = engine
        .step(&[SeqStep {
            seq,
            tokens: &tokens[kept..],
            logits: LogitsMode::All,
        }])
        .expect("second turn");
    let rest = out.into_iter().next().flatten().expect("logits");
    assert_eq!(rest.as_slice(), &full[kept * vocab..]);
    engine.free_sequence(seq);
    assert_eq!(
        all_logits(&mut engine, &tokens),
        full,
        "rebuilt after eviction"
    );
}

/// A decode row over more than one attention split (512 positions): the split and merged result
/// agrees with the CPU engine's.
#[test]
fn long_context_decode_splits_agree_with_the_cpu_engine() {
    let spec = SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Uniform(GgmlDType::Q8_0));
    let prompt: Vec<u32> = (0..700u32).map(|i| (i * 37) % 500 + 1).collect();
    let mut fast = fast_engine(synthetic::build(&spec).expect("build"));
    let mut cpu = cpu_engine(synthetic::build(&spec).expect("build"));
    let mut results = Vec::new();
    for engine in [&mut fast, &mut cpu] {
        let seq = engine.create_sequence();
        engine
            .step(&[SeqStep {
                seq,
                tokens: &prompt[..699],
                logits: LogitsMode::None,
            }])
            .expect("prefill");
        let out = engine
            .step(&[SeqStep {
                seq,
                tokens: &prompt[699..],
                logits: LogitsMode::Last,
            }])
            .expect("decode");
        results.push(out.into_iter().next().flatten().expect("logits"));
    }
    let (f, c) = (&results[0], &results[1]);
    let spread =
        c.iter().cloned().fold(f32::MIN, f32::max) - c.iter().cloned().fold(f32::MAX, f32::min);
    let d = max_abs_diff(f, c);
    assert!(
        d <= 0.03 * spread,
        "decode over 700 positions: {d} (spread {spread})"
    );
}

/// The SmolLM3-3B shape at 4 layers (llama.cpp's Q4_K_M type mix): teacher-forced against the
/// CPU engine, within 3% of the logits' spread (random weights make flat logits; the K-quant
/// activations are Q8_1 blocks of 32 here, as on the GPU, and Q8_K blocks of 256 on the CPU).
#[test]
fn smollm3_3b_shape_matches_the_cpu_engine() {
    let mut spec = SyntheticSpec::smollm3_3b();
    spec.n_layers = 4;
    let tokens: Vec<u32> = (0..12u32).map(|i| (i * 6007) % 128_000 + 11).collect();
    let fast = all_logits(
        &mut fast_engine(synthetic::build(&spec).expect("build")),
        &tokens,
    );
    let cpu = all_logits(
        &mut cpu_engine(synthetic::build(&spec).expect("build")),
        &tokens,
    );
    let vocab = 128_256;
    for (pos, (f, c)) in fast.chunks(vocab).zip(cpu.chunks(vocab)).enumerate() {
        let spread =
            c.iter().cloned().fold(f32::MIN, f32::max) - c.iter().cloned().fold(f32::MAX, f32::min);
        let d = max_abs_diff(f, c);
        assert!(
            d <= 0.03 * spread.max(1.0),
            "position {pos}: {d} (spread {spread})"
        );
    }
}

/// Matrices the fast tier's kernels cannot take are refused at load with the reason.
#[test]
fn unquantized_matrices_are_refused_at_load() {
    let spec = SyntheticSpec::tiny("llama").with_type_mix(TypeMix::Uniform(GgmlDType::F32));
    let mut src = synthetic::build(&spec).expect("build");
    let config = ModelConfig::from_gguf(&src).expect("config");
    match FastWeights::load(&mut src, config, &mut |_, _| {}) {
        Ok(_) => panic!("F32 matrices loaded into the fast tier"),
        Err(e) => assert!(e.to_string().contains("quantized matrices only"), "{e}"),
    }
}

/// Decode steps replayed from (emulated) graphs: padded to a bucket, captured after a warm-up,
/// replayed while the tables change, recaptured when the block-table bucket or a buffer
/// changes, and mixed steps run as one eager pass. Every logit equals the eager run's bit for
/// bit (the twins are row-independent, so padding changes nothing), and nothing allocates inside a capture (the runner's guard would fail the
/// step).
#[test]
fn graphed_decode_equals_eager_bit_for_bit() {
    let path = reference("smollm3-tiny-q8_0.gguf");
    let engine_with = |graphs: bool| {
        let mut src = GgufSource::open(&path).expect("open");
        let config = ModelConfig::from_gguf(&src).expect("config");
        let weights = FastWeights::load(&mut src, config, &mut |_, _| {}).expect("weights");
        let runner = CpuRunner::new(weights);
        let runner = if graphs {
            runner.with_graph_emulation()
        } else {
            runner
        };
        Engine::on_backend(Box::new(FastBackend::new(runner)), KvOptions::default())
            .expect("engine")
    };
    let (mut eager, mut graphed) = (engine_with(false), engine_with(true));
    assert_eq!(eager.graph_stats(), None);
    // Five sequences: their prompts, then greedy decode together; the third finishes early,
    // a sixth joins mid-way (a mixed step), and the first grows past 256 positions (a wider
    // block-table bucket).
    let prompts: Vec<Vec<u32>> = [250usize, 3, 40, 9, 1, 60]
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..n as u32)
                .map(|i| (i * 37 + s as u32 * 211) % 49_000 + 11)
                .collect()
        })
        .collect();
    let run = |engine: &mut Engine| -> Vec<Vec<f32>> {
        let mut seqs: Vec<Option<smolchat_engine::SeqId>> = vec![None; prompts.len()];
        let mut next: Vec<u32> = vec![0; prompts.len()];
        let mut trace = Vec::new();
        for step in 0..24 {
            let mut steps = Vec::new();
            let mut owners = Vec::new();
            for (i, p) in prompts.iter().enumerate() {
                let joins = if i == 5 { 10 } else { 0 };
                let leaves = if i == 2 { 12 } else { usize::MAX };
                if step < joins || step >= leaves {
                    if step == leaves {
                        if let Some(seq) = seqs[i].take() {
                            engine.free_sequence(seq);
                        }
                    }
                    continue;
                }
                let seq = *seqs[i].get_or_insert_with(|| engine.create_sequence());
                let tokens: &[u32] = if step == joins { p } else { &next[i..i + 1] };
                steps.push(SeqStep {
                    seq,
                    tokens,
                    logits: LogitsMode::Last,
                });
                owners.push(i);
            }
            let out = engine.step(&steps).expect("step");
            for (i, logits) in owners.into_iter().zip(out) {
                let logits = logits.expect("logits");
                next[i] = argmax(&logits) as u32;
                trace.push(logits);
            }
        }
        trace
    };
    let want = run(&mut eager);
    let got = run(&mut graphed);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g == w,
            "row {i} of the trace differs: {}",
            max_abs_diff(g, w)
        );
    }
    let stats = graphed.graph_stats().expect("graph stats");
    assert!(stats.warmups >= 2, "{stats:?}");
    assert!(stats.captures >= 2, "{stats:?}");
    assert!(stats.replays >= 10, "{stats:?}");
    assert!(
        stats.replays > 2 * stats.captures,
        "graphs are replayed far more often than captured: {stats:?}"
    );
}

/// Sized for serving before the first step (the whole KV budget, the widest step's buffers),
/// the runner never reallocates what its decode graphs were captured over: decode steps, then a
/// prompt longer than the arena held and wider than any step before, then decode again, drop no
/// graph; unprepared, the same steps drop them. The logits are the same either way.
#[test]
fn prepared_for_serving_no_graph_is_dropped_while_warming_up() {
    let path = reference("smollm3-tiny-q8_0.gguf");
    let engine_with = |prepared: bool| {
        let mut src = GgufSource::open(&path).expect("open");
        let config = ModelConfig::from_gguf(&src).expect("config");
        let weights = FastWeights::load(&mut src, config, &mut |_, _| {}).expect("weights");
        let backend = FastBackend::new(CpuRunner::new(weights).with_graph_emulation());
        let block = smolchat_engine::Backend::kv_block_bytes(&backend);
        let mut engine = Engine::on_backend(
            Box::new(backend),
            KvOptions {
                budget_bytes: Some(256 * block),
                ..KvOptions::default()
            },
        )
        .expect("engine");
        if prepared {
            engine
                .prepare_for_serving(smolchat_engine::StepLimits {
                    rows: 1200,
                    sequences: 4,
                    context: 2048,
                })
                .expect("prepare");
            assert_eq!(
                engine.kv_resident_bytes(),
                engine.kv_capacity_blocks() * engine.kv_block_bytes(),
                "the whole budget is allocated up front"
            );
        }
        engine
    };
    let run = |engine: &mut Engine| -> Vec<Vec<f32>> {
        let mut trace = Vec::new();
        let a = engine.create_sequence();
        let prompt: Vec<u32> = (0..5u32).map(|i| i * 97 + 11).collect();
        let mut last = engine
            .step(&[SeqStep {
                seq: a,
                tokens: &prompt,
                logits: LogitsMode::Last,
            }])
            .expect("prompt a")
            .remove(0)
            .expect("logits");
        for _ in 0..6 {
            let token = [argmax(&last) as u32];
            last = engine
                .step(&[SeqStep {
                    seq: a,
                    tokens: &token,
                    logits: LogitsMode::Last,
                }])
                .expect("decode a")
                .remove(0)
                .expect("logits");
            trace.push(last.clone());
        }
        // Past the 64 blocks an unprepared arena starts with, and wider than any step so far.
        let b = engine.create_sequence();
        let long: Vec<u32> = (0..1100u32).map(|i| (i * 613) % 49_000 + 5).collect();
        let mut last_b = engine
            .step(&[SeqStep {
                seq: b,
                tokens: &long,
                logits: LogitsMode::Last,
            }])
            .expect("prompt b")
            .remove(0)
            .expect("logits");
        // The one-row graph again (stale, unprepared), then both sequences.
        for _ in 0..3 {
            let token = [argmax(&last) as u32];
            last = engine
                .step(&[SeqStep {
                    seq: a,
                    tokens: &token,
                    logits: LogitsMode::Last,
                }])
                .expect("decode a again")
                .remove(0)
                .expect("logits");
            trace.push(last.clone());
        }
        for _ in 0..6 {
            let (ta, tb) = ([argmax(&last) as u32], [argmax(&last_b) as u32]);
            let mut out = engine
                .step(&[
                    SeqStep {
                        seq: a,
                        tokens: &ta,
                        logits: LogitsMode::Last,
                    },
                    SeqStep {
                        seq: b,
                        tokens: &tb,
                        logits: LogitsMode::Last,
                    },
                ])
                .expect("decode both");
            last_b = out.remove(1).expect("logits");
            last = out.remove(0).expect("logits");
            trace.push(last.clone());
            trace.push(last_b.clone());
        }
        trace
    };
    let (mut cold, mut prepared) = (engine_with(false), engine_with(true));
    let want = run(&mut cold);
    let got = run(&mut prepared);
    assert!(got == want, "preparing changed the logits");
    let cold_stats = cold.graph_stats().expect("stats");
    let stats = prepared.graph_stats().expect("stats");
    assert!(
        cold_stats.invalidated > 0,
        "the unprepared run grows: {cold_stats:?}"
    );
    assert_eq!(stats.invalidated, 0, "{stats:?}");
    assert!(stats.replays >= 4, "{stats:?}");
}

/// A step launched and finished later gives what a whole step gives: drawn tokens (the fast
/// tier leaves them on the device until `finish_step`) and caches alike; meanwhile another
/// sequence may be cut back, a second launch is refused without harm, and finishing with
/// nothing in flight is an error.
#[test]
fn a_launched_step_finishes_as_a_whole_step() {
    use smolchat_engine::{DeviceSampling, Logits, SampleRow};
    let path = reference("smollm3-tiny-q8_0.gguf");
    let engine = || {
        let mut src = GgufSource::open(&path).expect("open");
        let config = ModelConfig::from_gguf(&src).expect("config");
        let weights = FastWeights::load(&mut src, config, &mut |_, _| {}).expect("weights");
        let runner = CpuRunner::new(weights).with_graph_emulation();
        Engine::on_backend(Box::new(FastBackend::new(runner)), KvOptions::default())
            .expect("engine")
    };
    let greedy = [DeviceSampling {
        row: SampleRow::GREEDY,
        penalties: Vec::new(),
    }];
    let sampling: [&[DeviceSampling]; 2] = [&greedy, &greedy];
    let prompts: [Vec<u32>; 2] = [(100..140).collect(), (700..709).collect()];
    let run = |split: bool| -> (Vec<u32>, Vec<Vec<u32>>) {
        let mut e = engine();
        let seqs = [e.create_sequence(), e.create_sequence()];
        let bystander = e.create_sequence();
        let mut out = Logits::new();
        let mut next: Vec<u32> = Vec::new();
        let mut drawn = Vec::new();
        for step in 0..6 {
            let inputs: Vec<Vec<u32>> = if step == 0 {
                prompts.to_vec()
            } else {
                next.iter().map(|&t| vec![t]).collect()
            };
            let steps: Vec<SeqStep<'_>> = seqs
                .iter()
                .zip(&inputs)
                .map(|(&seq, tokens)| SeqStep {
                    seq,
                    tokens,
                    logits: LogitsMode::Sample,
                })
                .collect();
            if split {
                e.step(&[SeqStep {
                    seq: bystander,
                    tokens: &[5, 6, 7],
                    logits: LogitsMode::None,
                }])
                .expect("bystander");
                e.launch_step(&steps, &sampling, &mut out).expect("launch");
                assert!(e.in_flight());
                assert!(
                    e.launch_step(&steps, &sampling, &mut Logits::new())
                        .is_err(),
                    "a second step launched while one is in flight"
                );
                assert_eq!(e.truncate(bystander, 1).expect("truncate"), 1);
                e.finish_step(&mut out).expect("finish");
                assert!(!e.in_flight());
                assert!(e.finish_step(&mut out).is_err(), "finished twice");
            } else {
                e.step_sampled_into(&steps, &sampling, &mut out)
                    .expect("step");
            }
            next = (0..2)
                .map(|i| out.token(i).expect("a drawn token"))
                .collect();
            drawn.extend(&next);
        }
        let cached = seqs
            .iter()
            .map(|&s| e.cached_tokens(s).expect("cached").to_vec())
            .collect();
        (drawn, cached)
    };
    assert_eq!(run(true), run(false));
}

/// The fast tier saves and restores its arena's blocks too: a restored sequence's next logits
/// are the original's bit for bit, and a CPU engine's blocks (another format) are refused.
#[test]
fn the_fast_tier_restores_saved_kv_bit_for_bit() {
    let path = reference("smollm3-tiny-q8_0.gguf");
    let open = || GgufSource::open(&path).expect("open");
    let (mut a, mut b) = (fast_engine(open()), fast_engine(open()));
    let seq = a.create_sequence();
    let prompt: Vec<u32> = (0..21).map(|i| i * 97 % 40_000 + 7).collect();
    a.step(&[SeqStep {
        seq,
        tokens: &prompt,
        logits: LogitsMode::None,
    }])
    .expect("prefill");
    let snapshot = a.save_kv(seq).expect("save");
    assert_eq!(snapshot.format, "fast-arena-f16-v1");
    let mut other = snapshot.clone();
    other.format = "cpu-pages-f16-v1".into();
    assert!(b.restore_kv(&other).is_err());
    let restored = b.restore_kv(&snapshot).expect("restore");
    let next = |e: &mut Engine, s| {
        e.step(&[SeqStep {
            seq: s,
            tokens: &[99],
            logits: LogitsMode::Last,
        }])
        .expect("decode")
        .remove(0)
        .expect("logits")
    };
    assert_eq!(next(&mut b, restored), next(&mut a, seq));
}
