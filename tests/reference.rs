//! Agreement with llama.cpp, using the outputs in tests/data (see its README).

mod common;

use common::*;
use smolchat::engine::{KvType, LogitsMode, SeqStep};

fn all_logits(path: &std::path::Path, tokens: &[u32]) -> Vec<f32> {
    all_logits_kv(path, tokens, KvType::default())
}

fn all_logits_kv(path: &std::path::Path, tokens: &[u32], kv: KvType) -> Vec<f32> {
    let mut engine = load_engine_kv(path, kv);
    let seq = engine.create_sequence();
    let out = engine
        .step(&[SeqStep {
            seq,
            tokens,
            logits: LogitsMode::All,
        }])
        .expect("step");
    out.into_iter().next().flatten().expect("logits")
}

/// Largest |difference| at each position.
fn per_position_max_diff(got: &[f32], expected: &[f32], vocab: usize) -> Vec<f32> {
    got.chunks(vocab)
        .zip(expected.chunks(vocab))
        .map(|(g, e)| {
            g.iter()
                .zip(e)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
        })
        .collect()
}

/// f32 and f16 KV caches: within 0.03 of llama.cpp's least-rounded path (fa off, KV F32) at every
/// position. The argmax must equal that path's with an f32 cache, and, with an f16 cache, that of
/// llama.cpp's own KV-F16 path (its default run, `smollm3-tiny-q8_0-logits.npy`): position 0 is a
/// near-tie that rounding K/V to f16 flips in llama.cpp exactly as here.
#[test]
fn tiny_smollm3_logits_match_llama_cpp() {
    let meta = read_json(&reference("smollm3-tiny-q8_0-tokens.json"));
    let tokens = ids(&meta["token_ids"]);
    let (shape, expected) = read_npy(&reference("smollm3-tiny-q8_0-logits-fa-off-kvf32.npy"));
    let (_, expected_f16) = read_npy(&reference("smollm3-tiny-q8_0-logits.npy"));
    let vocab = shape[1];
    for (kv, argmax_key) in [
        (KvType::F32, "argmax_fa_off_kvf32"),
        (KvType::F16, "argmax_per_position"),
    ] {
        let expected_argmax = ids(&meta[argmax_key]);
        let got = all_logits_kv(&reference("smollm3-tiny-q8_0.gguf"), &tokens, kv);
        assert_eq!(got.len(), expected.len());
        let diffs = per_position_max_diff(&got, &expected, vocab);
        for (pos, &max_diff) in diffs.iter().enumerate() {
            // The reference README: llama.cpp's own two paths differ by up to 0.023; aim for <= 0.03.
            assert!(
                max_diff <= 0.03,
                "kv {kv} position {pos}: max |diff| {max_diff}"
            );
            let g = &got[pos * vocab..(pos + 1) * vocab];
            assert_eq!(
                argmax(g) as u32,
                expected_argmax[pos],
                "kv {kv} argmax at {pos}"
            );
        }
        if kv == KvType::F16 {
            let d = per_position_max_diff(&got, &expected_f16, vocab);
            let worst = d.iter().cloned().fold(0f32, f32::max);
            assert!(
                worst <= 0.03,
                "kv f16 against llama.cpp's KV F16 path: {worst}"
            );
        }
    }
}

/// q8_0 KV cache. llama.cpp's own `-ctk q8_0 -ctv q8_0` logits are not among the reference files,
/// so the bound is ours: measured at most 0.0245 |diff| against the fa-off/KV-F32 logits (logit
/// standard deviation 0.32, llama.cpp's own KV-F16 path: 0.023); held to 0.04. At every position
/// the argmax is the one of llama.cpp's KV-F32 or KV-F16 path (they differ at two near-ties).
#[test]
fn tiny_smollm3_logits_with_q8_0_kv_stay_close() {
    let meta = read_json(&reference("smollm3-tiny-q8_0-tokens.json"));
    let tokens = ids(&meta["token_ids"]);
    let (shape, expected) = read_npy(&reference("smollm3-tiny-q8_0-logits-fa-off-kvf32.npy"));
    let vocab = shape[1];
    let argmax_f32 = ids(&meta["argmax_fa_off_kvf32"]);
    let argmax_f16 = ids(&meta["argmax_per_position"]);
    let got = all_logits_kv(&reference("smollm3-tiny-q8_0.gguf"), &tokens, KvType::Q8_0);
    let diffs = per_position_max_diff(&got, &expected, vocab);
    eprintln!("q8_0 KV: max |diff| per position {diffs:?}");
    for (pos, &max_diff) in diffs.iter().enumerate() {
        assert!(max_diff <= 0.04, "position {pos}: max |diff| {max_diff}");
        let best = argmax(&got[pos * vocab..(pos + 1) * vocab]) as u32;
        assert!(
            best == argmax_f32[pos] || best == argmax_f16[pos],
            "argmax at {pos}: {best}, llama.cpp {} / {}",
            argmax_f32[pos],
            argmax_f16[pos]
        );
    }
}

/// SmolLM2 (Q4_1): with an f32 cache the argmax equals llama.cpp's at every position. Rounding
/// K/V (f16, q8_0) may flip a near-tie, as it does inside llama.cpp (its KV-F16 path differs from
/// its KV-F32 one by up to 1.5): then llama.cpp's token must be within 0.5 of our best logit (the
/// greedy test's near-tie rule), and at most one of the 16 positions may differ. Measured: f16
/// flips position 1 (llama.cpp's gap there is 0.10, ours 0.21), q8_0 none.
#[test]
fn smollm2_argmax_matches_llama_cpp_at_every_position() {
    let meta = read_json(&reference("smollm2-135m-tokens.json"));
    let tokens = ids(&meta["token_ids"]);
    let (shape, expected) = read_npy(&reference("smollm2-135m-logits.npy"));
    let vocab = shape[1];
    for kv in KvType::ALL {
        let got = all_logits_kv(&smollm2_path(), &tokens, kv);
        let mut worst = 0f32;
        let mut flipped = 0;
        for pos in 0..tokens.len() {
            let g = &got[pos * vocab..(pos + 1) * vocab];
            let e = &expected[pos * vocab..(pos + 1) * vocab];
            worst = g
                .iter()
                .zip(e)
                .map(|(a, b)| (a - b).abs())
                .fold(worst, f32::max);
            let (ours, theirs) = (argmax(g), argmax(e));
            if ours != theirs {
                assert_ne!(kv, KvType::F32, "argmax at position {pos}");
                let gap = g[ours] - g[theirs];
                assert!(
                    gap <= 0.5,
                    "kv {kv} position {pos}: we pick {ours}, llama.cpp {theirs}, gap {gap}"
                );
                flipped += 1;
            }
        }
        eprintln!("SmolLM2 kv {kv}: max |diff| {worst}, {flipped} near-tie flips");
        assert!(flipped <= 1, "kv {kv}: {flipped} positions differ");
        // Both engines quantize activations on the fly; llama.cpp's own paths differ by up to 1.5.
        assert!(worst < 3.0, "kv {kv} max |diff| {worst}");
    }
}

/// Teacher-forced greedy continuations: at each generated position our argmax must equal
/// llama.cpp's next token, or llama.cpp's token must be within 0.5 of our best logit (a near-tie);
/// at least 90% must agree exactly.
#[test]
fn smollm2_greedy_continuations_teacher_forced() {
    let data = read_json(&reference("smollm2-greedy.json"));
    let path = smollm2_path();
    for case in data["results"].as_array().expect("results") {
        let prompt = ids(&case["prompt_ids"]);
        let gen = ids(&case["gen_ids"]);
        let mut tokens = prompt.clone();
        tokens.extend_from_slice(&gen[..gen.len() - 1]);
        let logits = all_logits(&path, &tokens);
        let vocab = logits.len() / tokens.len();
        let mut exact = 0;
        for (i, &want) in gen.iter().enumerate() {
            let row = &logits[(prompt.len() - 1 + i) * vocab..(prompt.len() + i) * vocab];
            let best = argmax(row);
            if best as u32 == want {
                exact += 1;
            } else {
                let gap = row[best] - row[want as usize];
                assert!(
                    gap <= 0.5,
                    "prompt {:?}, generated position {i}: we pick {best}, llama.cpp {want}, gap {gap}",
                    case["prompt"]
                );
            }
        }
        assert!(
            exact * 10 >= gen.len() * 9,
            "prompt {:?}: only {exact}/{} exact",
            case["prompt"],
            gen.len()
        );
    }
}
