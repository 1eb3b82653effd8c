//! Agreement with llama.cpp, using the outputs in tests/data (see its README).

mod common;

use common::*;
use smolchat_engine::{KvType, LogitsMode, SeqStep};

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

/// q8_0 KV cache, against two llama.cpp references.
/// - The fa-off/KV-F32 logits: within llama.cpp's own q8_0 distance to them, i.e. the largest
///   |diff| between `smollm3-tiny-q8_0-logits-kvq8.npy` (llama.cpp with `type_k = type_v = q8_0`,
///   flash attention on, see tests/data/README.md) and the fa-off/KV-F32 file, computed here from
///   the two files, with a 25% margin: rounding K/V to q8_0 may cost us what it costs llama.cpp.
/// - llama.cpp's q8_0 path itself: measured 0.0248 (llama.cpp's own distance to fa-off/KV-F32:
///   0.0259, ours 0.0245). The two engines' q8_0 logits are as far apart as each is from the
///   unrounded reference, so their rounding errors are not shared (llama.cpp's CPU flash attention
///   also quantizes Q to q8_0 for the K dot products); held to 0.03, the bound the f32 and f16
///   caches meet against their llama.cpp counterparts, about 1.2× the measured distance.
///
/// At every position the argmax is that of llama.cpp's KV-F32, KV-F16 or KV-q8_0 path (they
/// differ at near-ties).
#[test]
fn tiny_smollm3_logits_with_q8_0_kv_stay_close() {
    let meta = read_json(&reference("smollm3-tiny-q8_0-tokens.json"));
    let tokens = ids(&meta["token_ids"]);
    let (shape, expected) = read_npy(&reference("smollm3-tiny-q8_0-logits-fa-off-kvf32.npy"));
    let (shape_q8, llama_q8) = read_npy(&reference("smollm3-tiny-q8_0-logits-kvq8.npy"));
    assert_eq!(shape, shape_q8);
    let vocab = shape[1];
    let argmax_f32 = ids(&meta["argmax_fa_off_kvf32"]);
    let argmax_f16 = ids(&meta["argmax_per_position"]);
    let max_of = |d: &[f32]| d.iter().cloned().fold(0f32, f32::max);

    let llama_own = max_of(&per_position_max_diff(&llama_q8, &expected, vocab));
    // A q8_0 cache that changed nothing would make this bound meaningless; it must be a real
    // rounding error of the size the reference README describes for KV F16 (0.023).
    assert!(
        llama_own > 1e-3 && llama_own < 0.1,
        "llama.cpp's own q8_0 distance {llama_own}"
    );
    let bound = 1.25 * llama_own;

    let got = all_logits_kv(&reference("smollm3-tiny-q8_0.gguf"), &tokens, KvType::Q8_0);
    assert_eq!(got.len(), expected.len());
    let vs_f32 = per_position_max_diff(&got, &expected, vocab);
    let vs_q8 = per_position_max_diff(&got, &llama_q8, vocab);
    eprintln!(
        "q8_0 KV: llama.cpp's own distance to fa-off/KV-F32 {llama_own} (bound {bound}); ours {}; \
         ours to llama.cpp's q8_0 path {}",
        max_of(&vs_f32),
        max_of(&vs_q8)
    );
    eprintln!("q8_0 KV: ours vs fa-off/KV-F32 per position {vs_f32:?}");
    eprintln!("q8_0 KV: ours vs llama.cpp q8_0 per position {vs_q8:?}");
    for pos in 0..shape[0] {
        assert!(
            vs_f32[pos] <= bound,
            "position {pos}: max |diff| to fa-off/KV-F32 {} > {bound}",
            vs_f32[pos]
        );
        assert!(
            vs_q8[pos] <= 0.03,
            "position {pos}: max |diff| to llama.cpp's q8_0 path {}",
            vs_q8[pos]
        );
        let best = argmax(&got[pos * vocab..(pos + 1) * vocab]) as u32;
        let theirs = argmax(&llama_q8[pos * vocab..(pos + 1) * vocab]) as u32;
        assert!(
            best == argmax_f32[pos] || best == argmax_f16[pos] || best == theirs,
            "argmax at {pos}: {best}, llama.cpp {} / {} / {theirs}",
            argmax_f32[pos],
            argmax_f16[pos]
        );
    }
}

/// SmolLM2 (Q4_1): with an f32 cache the argmax equals llama.cpp's at every position. Rounding
/// K/V (f16, q8_0) may flip a near-tie, as it does inside llama.cpp (its KV-F16 path differs from
/// its KV-F32 one by up to 1.5): then llama.cpp's token must be within 0.5 of our best logit (the
/// greedy test's near-tie rule), and at most one of the 16 positions may differ. Measured: f16
/// flips position 1 (llama.cpp's gap there is 0.10, ours 0.21), q8_0 none, in llama.cpp's order
/// (the scalar path; measured when the AVX-512 path still used it: max |diff| 1.24 / 1.39 / 1.62
/// for f32 / f16 / q8_0). On the SIMD paths (Q4_1 and Q8_0 rounded per block; AVX2 and AVX-512
/// compute the same products) f16 and q8_0 flip one each, max |diff| 1.23 / 1.36 / 1.85.
#[test]
fn smollm2_argmax_matches_llama_cpp_exactly_with_f32_kv_and_but_one_near_tie_with_f16_q8_0() {
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
