//! The engine's model on tiny random-weight GGUF files written by the tests themselves.

mod common;

use smolchat_engine::synthetic::{SyntheticModel, SyntheticSpec, TypeMix};
use smolchat_engine::{Engine, EngineError, KvOptions, KvType, LogitsMode, Model, SeqStep};
use smolchat_gguf::{AlignedBytes, GgmlDType, GgufSource, RawTensor};

fn engine_from(model: SyntheticModel) -> Engine {
    let mut src = model.into_source();
    Engine::new(Model::load(&mut src, &mut |_, _| {}).expect("load"))
}

fn engine_with(model: SyntheticModel, kv_type: KvType, budget_bytes: usize) -> Engine {
    let mut src = model.into_source();
    let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
    Engine::with_kv(
        model,
        KvOptions {
            kv_type,
            budget_bytes: Some(budget_bytes),
        },
    )
    .expect("engine")
}

/// How far two computations of the same logits may drift apart for a KV storage type when only
/// the float summation order differs (batch composition, chunking). f32 and f16 store the same
/// rows bit for bit either way; q8_0's rounding can flip by one step on a row whose K/V differ in
/// the last bit, which moves logits by up to ~1e-3 on these tiny models.
fn reorder_tolerance(kv_type: KvType) -> f32 {
    match kv_type {
        KvType::F32 | KvType::F16 => 1e-4,
        KvType::Q8_0 => 2e-3,
    }
}

fn tiny(arch: &str, mix: TypeMix) -> SyntheticModel {
    SyntheticModel::generate(&SyntheticSpec::tiny(arch).with_type_mix(mix)).expect("generate")
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 97 + seed * 31 + 7) % 512)
        .collect()
}

fn last_logits(engine: &mut Engine, toks: &[u32]) -> Vec<f32> {
    let seq = engine.create_sequence();
    let out = engine
        .step(&[SeqStep {
            seq,
            tokens: toks,
            logits: LogitsMode::Last,
        }])
        .expect("step");
    engine.free_sequence(seq);
    out.into_iter().next().flatten().expect("logits")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const MIXES: [TypeMix; 4] = [
    TypeMix::Uniform(GgmlDType::F32),
    TypeMix::Uniform(GgmlDType::Q8_0),
    TypeMix::Uniform(GgmlDType::Q4K),
    TypeMix::Q4KM,
];

#[test]
fn tiny_files_written_by_the_test_load_and_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in ["llama", "smollm3"] {
        for mix in MIXES {
            let path = dir.path().join(format!("{arch}-{mix:?}.gguf"));
            tiny(arch, mix).write_gguf(&path).expect("write");
            let mut src = GgufSource::open(&path).expect("open");
            let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
            assert_eq!(model.config.arch.gguf_name(), arch);
            let mut engine = Engine::new(model);
            let logits = last_logits(&mut engine, &tokens(9, 1));
            assert_eq!(logits.len(), 512);
            assert!(logits.iter().all(|v| v.is_finite()), "{arch} {mix:?}");
            let spread = logits.iter().cloned().fold(f32::MIN, f32::max)
                - logits.iter().cloned().fold(f32::MAX, f32::min);
            assert!(spread > 1e-3, "{arch} {mix:?}: logits are flat");
        }
    }
}

/// A sequence's logits do not depend on the other sequences in its step. Tolerance: 1e-4 absolute
/// on logits of magnitude ~1 (the kernels may tile rows differently for different batch sizes,
/// which only reorders float sums).
#[test]
fn batched_equals_alone() {
    for kv in KvType::ALL {
        for arch in ["llama", "smollm3"] {
            for mix in [TypeMix::Uniform(GgmlDType::F32), TypeMix::Q4KM] {
                batched_equals_alone_case(arch, mix, kv);
            }
        }
    }
}

fn batched_equals_alone_case(arch: &str, mix: TypeMix, kv: KvType) {
    {
        {
            let mut engine = engine_with(tiny(arch, mix), kv, 64 << 20);
            // Sequences at different positions: A has a 20-token history, B 5, C none.
            let hist_a = tokens(20, 2);
            let hist_b = tokens(5, 3);
            let chunk_a = [11u32];
            let chunk_b = tokens(7, 4);
            let chunk_c = tokens(13, 5);

            // Alone: each sequence on its own.
            let mut alone = Vec::new();
            for (hist, chunk) in [
                (&hist_a[..], &chunk_a[..]),
                (&hist_b[..], &chunk_b[..]),
                (&[][..], &chunk_c[..]),
            ] {
                let seq = engine.create_sequence();
                if !hist.is_empty() {
                    engine
                        .step(&[SeqStep {
                            seq,
                            tokens: hist,
                            logits: LogitsMode::None,
                        }])
                        .expect("hist");
                }
                let out = engine
                    .step(&[SeqStep {
                        seq,
                        tokens: chunk,
                        logits: LogitsMode::All,
                    }])
                    .expect("step");
                alone.push(out.into_iter().next().flatten().expect("logits"));
                engine.free_sequence(seq);
            }

            // Together: histories first (also batched), then one step with a decode token and two
            // prefill chunks of different lengths.
            let a = engine.create_sequence();
            let b = engine.create_sequence();
            let c = engine.create_sequence();
            engine
                .step(&[
                    SeqStep {
                        seq: a,
                        tokens: &hist_a,
                        logits: LogitsMode::None,
                    },
                    SeqStep {
                        seq: b,
                        tokens: &hist_b,
                        logits: LogitsMode::None,
                    },
                ])
                .expect("histories");
            let together = engine
                .step(&[
                    SeqStep {
                        seq: b,
                        tokens: &chunk_b,
                        logits: LogitsMode::All,
                    },
                    SeqStep {
                        seq: a,
                        tokens: &chunk_a,
                        logits: LogitsMode::All,
                    },
                    SeqStep {
                        seq: c,
                        tokens: &chunk_c,
                        logits: LogitsMode::All,
                    },
                ])
                .expect("batched step");
            let order = [1usize, 0, 2];
            for (slot, &i) in order.iter().enumerate() {
                let got = together[slot].as_ref().expect("logits");
                let d = max_abs_diff(got, &alone[i]);
                assert!(
                    d <= reorder_tolerance(kv),
                    "{arch} {mix:?} kv {kv} sequence {i}: max diff {d}"
                );
            }
        }
    }
}

/// Decoding token by token with the cache gives the logits of one full prefill; truncating the
/// cache and prefilling again gives them once more.
#[test]
fn incremental_equals_full_and_truncate_recomputes() {
    for kv in KvType::ALL {
        for arch in ["llama", "smollm3"] {
            for mix in [
                TypeMix::Uniform(GgmlDType::F32),
                TypeMix::Uniform(GgmlDType::Q8_0),
            ] {
                incremental_case(arch, mix, kv);
            }
        }
    }
}

/// A fork holds the first whole blocks of its parent without computing them: it goes on as a
/// sequence computed from scratch would, its parent's later writes (a truncation into the
/// shared blocks included) never reach it, and the shared blocks count once and are freed by
/// their last holder.
#[test]
fn forks_share_whole_blocks_and_never_see_each_others_writes() {
    for kv in KvType::ALL {
        let tol = reorder_tolerance(kv);
        let mut engine = engine_with(
            tiny("smollm3", TypeMix::Uniform(GgmlDType::Q8_0)),
            kv,
            64 << 20,
        );
        let prompt = tokens(40, 3);
        let tail = tokens(6, 5);
        let mut whole = prompt.clone();
        whole.extend(&tail);
        let expected = last_logits(&mut engine, &whole);

        let parent = engine.create_sequence();
        engine
            .step(&[SeqStep {
                seq: parent,
                tokens: &prompt,
                logits: LogitsMode::None,
            }])
            .expect("prefill");
        let used = engine.kv_free_blocks();
        let (child, held) = engine.fork(parent, 40).expect("fork");
        assert_eq!(held, 32, "whole blocks only");
        assert_eq!(engine.cached_tokens(child).expect("tokens"), &prompt[..32]);
        assert_eq!(engine.kv_free_blocks(), used, "a fork takes no block");

        // The parent moves on first, even truncating into a shared block: it lets that block
        // go rather than write into it.
        assert_eq!(engine.truncate(parent, 20).expect("truncate"), 16);
        engine
            .step(&[SeqStep {
                seq: parent,
                tokens: &tokens(30, 11),
                logits: LogitsMode::None,
            }])
            .expect("parent writes");

        let rest: Vec<u32> = whole[32..].to_vec();
        let got = engine
            .step(&[SeqStep {
                seq: child,
                tokens: &rest,
                logits: LogitsMode::Last,
            }])
            .expect("child")
            .remove(0)
            .expect("logits");
        let d = max_abs_diff(&got, &expected);
        assert!(
            d <= tol,
            "kv {kv}: the fork's logits are {d} from a full computation"
        );

        engine.free_sequence(parent);
        let again = engine
            .step(&[SeqStep {
                seq: child,
                tokens: &[7],
                logits: LogitsMode::Last,
            }])
            .expect("child alone");
        assert!(again[0].is_some());
        engine.free_sequence(child);
        assert_eq!(engine.total_kv_bytes(), 0, "every block is back");
    }
}

/// 40 tokens, so the sequence spans three KV blocks and the truncation point (10) falls inside
/// the first block and the re-prefill crosses block boundaries again.
fn incremental_case(arch: &str, mix: TypeMix, kv: KvType) {
    let tol = reorder_tolerance(kv);
    {
        {
            let mut engine = engine_with(tiny(arch, mix), kv, 64 << 20);
            let toks = tokens(40, 9);
            let seq = engine.create_sequence();
            let full = engine
                .step(&[SeqStep {
                    seq,
                    tokens: &toks,
                    logits: LogitsMode::All,
                }])
                .expect("full")
                .remove(0)
                .expect("logits");
            let vocab = full.len() / toks.len();

            let inc = engine.create_sequence();
            for (i, t) in toks.iter().enumerate() {
                let out = engine
                    .step(&[SeqStep {
                        seq: inc,
                        tokens: &[*t],
                        logits: LogitsMode::Last,
                    }])
                    .expect("decode")
                    .remove(0)
                    .expect("logits");
                let d = max_abs_diff(&out, &full[i * vocab..(i + 1) * vocab]);
                assert!(d <= tol, "{arch} {mix:?} kv {kv} position {i}: {d}");
            }
            assert_eq!(engine.cached_tokens(inc).expect("tokens"), &toks[..]);

            // Truncate to 10 and prefill the rest in one chunk.
            engine.truncate(inc, 10).expect("truncate");
            assert_eq!(engine.cached_tokens(inc).expect("tokens").len(), 10);
            let again = engine
                .step(&[SeqStep {
                    seq: inc,
                    tokens: &toks[10..],
                    logits: LogitsMode::All,
                }])
                .expect("re-prefill")
                .remove(0)
                .expect("logits");
            let d = max_abs_diff(&again, &full[10 * vocab..]);
            assert!(d <= tol, "{arch} {mix:?} kv {kv} after truncate: {d}");
        }
    }
}

fn zero_attention_output(model: &mut SyntheticModel, layers: &[usize]) {
    for t in model.tensors.iter_mut() {
        if layers
            .iter()
            .any(|l| t.name == format!("blk.{l}.attn_output.weight"))
        {
            *t = RawTensor {
                name: t.name.clone(),
                dtype: GgmlDType::F32,
                dims: t.dims.clone(),
                data: AlignedBytes::zeroed(t.dims.iter().product::<usize>() * 4),
            };
        }
    }
}

/// On a smollm3 file the NoPE layers' attention ignores positions while the RoPE layers' does not;
/// the same weights read as `llama` give different logits.
///
/// With the attention output of the RoPE layers (0, 1, 2) zeroed, the only attention left is the
/// NoPE layer 3, which without position encoding is blind to the order of earlier tokens: the last
/// position's logits for [a, b, c, d] and [b, a, c, d] are equal. Read as `llama`, layer 3 applies
/// RoPE and the order shows.
#[test]
fn nope_layers_ignore_position_and_rope_layers_do_not() {
    let order1 = [5u32, 77, 300, 42];
    let order2 = [77u32, 5, 300, 42];

    let mut nope_only = tiny("smollm3", TypeMix::Uniform(GgmlDType::F32));
    zero_attention_output(&mut nope_only, &[0, 1, 2]);
    let mut as_llama = tiny("smollm3", TypeMix::Uniform(GgmlDType::F32));
    zero_attention_output(&mut as_llama, &[0, 1, 2]);
    as_llama.set_architecture("llama");

    let mut e = engine_from(nope_only);
    let d_nope = max_abs_diff(&last_logits(&mut e, &order1), &last_logits(&mut e, &order2));
    assert!(d_nope < 1e-5, "NoPE layer depends on token order: {d_nope}");

    let mut e = engine_from(as_llama);
    let d_rope = max_abs_diff(&last_logits(&mut e, &order1), &last_logits(&mut e, &order2));
    assert!(
        d_rope > 1e-3,
        "RoPE layer is blind to token order: {d_rope}"
    );

    // Unmodified weights: smollm3 and llama readings differ (layer 3 with and without RoPE)...
    let toks = tokens(12, 4);
    let mut s = engine_from(tiny("smollm3", TypeMix::Uniform(GgmlDType::F32)));
    let mut l_model = tiny("smollm3", TypeMix::Uniform(GgmlDType::F32));
    l_model.set_architecture("llama");
    let mut l = engine_from(l_model);
    let d = max_abs_diff(&last_logits(&mut s, &toks), &last_logits(&mut l, &toks));
    assert!(d > 1e-3, "smollm3 and llama readings agree: {d}");
    // ...but not at position 0, where every rotation is the identity.
    let d0 = max_abs_diff(
        &last_logits(&mut s, &toks[..1]),
        &last_logits(&mut l, &toks[..1]),
    );
    assert!(d0 < 1e-5, "position 0 should not depend on RoPE: {d0}");
}

#[test]
fn kv_cache_bytes_are_accounted_and_freed() {
    for kv in KvType::ALL {
        let mut engine = engine_with(
            tiny("smollm3", TypeMix::Uniform(GgmlDType::Q8_0)),
            kv,
            64 << 20,
        );
        let cfg = engine.config().clone();
        // 2 bytes (K and V) × layers × KV heads × bytes per row of head_dim values.
        let row = match kv {
            KvType::F32 => cfg.head_dim * 4,
            KvType::F16 => cfg.head_dim * 2,
            KvType::Q8_0 => cfg.head_dim / 32 * 34,
        };
        let per_token = 2 * cfg.n_layers * cfg.n_kv_heads * row;
        assert_eq!(engine.kv_bytes_per_token(), per_token);
        assert_eq!(engine.kv_block_bytes(), 16 * per_token);
        assert_eq!(engine.kv_capacity_blocks(), (64 << 20) / (16 * per_token));
        let seq = engine.create_sequence();
        assert_eq!(engine.kv_bytes(seq).expect("bytes"), 0);
        engine
            .step(&[SeqStep {
                seq,
                tokens: &tokens(100, 1),
                logits: LogitsMode::None,
            }])
            .expect("step");
        // 100 positions take 7 blocks of 16.
        let bytes = engine.kv_bytes(seq).expect("bytes");
        assert_eq!(bytes, 7 * 16 * per_token, "{kv}");
        assert_eq!(engine.total_kv_bytes(), bytes);
        assert_eq!(engine.kv_resident_bytes(), bytes);
        // Truncating inside a block keeps it; whole trailing blocks go back.
        engine.truncate(seq, 33).expect("truncate");
        assert_eq!(engine.kv_bytes(seq).expect("bytes"), 3 * 16 * per_token);
        assert_eq!(engine.kv_free_blocks(), engine.kv_capacity_blocks() - 3);
        // Freed blocks keep their pages for reuse: resident memory stays at the peak.
        assert_eq!(engine.kv_resident_bytes(), 7 * 16 * per_token);
        assert!(engine.free_sequence(seq));
        assert_eq!(engine.total_kv_bytes(), 0);
        assert_eq!(engine.kv_free_blocks(), engine.kv_capacity_blocks());
    }
}

/// A step that needs more blocks than are free is refused with `KvCacheFull` and changes nothing;
/// freeing a sequence (a finished or cancelled request) makes room again.
#[test]
fn running_out_of_kv_blocks_is_a_clear_error_and_freeing_makes_room() {
    let mix = TypeMix::Uniform(GgmlDType::F32);
    let block = engine_with(tiny("llama", mix), KvType::F16, 64 << 20).kv_block_bytes();
    let mut engine = engine_with(tiny("llama", mix), KvType::F16, 4 * block);
    assert_eq!(engine.kv_capacity_blocks(), 4);
    assert_eq!(engine.kv_capacity_tokens(), 64);
    let a = engine.create_sequence();
    engine
        .step(&[SeqStep {
            seq: a,
            tokens: &tokens(40, 1),
            logits: LogitsMode::None,
        }])
        .expect("3 blocks fit");
    let b = engine.create_sequence();
    let err = engine
        .step(&[SeqStep {
            seq: b,
            tokens: &tokens(20, 2),
            logits: LogitsMode::Last,
        }])
        .expect_err("2 blocks do not fit in the 1 left");
    assert!(
        matches!(
            err,
            EngineError::KvCacheFull {
                needed_blocks: 2,
                free_blocks: 1
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("KV cache is full"), "{err}");
    // Nothing changed: b holds nothing, a still decodes (its 41st position fits block 3).
    assert_eq!(engine.kv_bytes(b).expect("bytes"), 0);
    assert!(engine.cached_tokens(b).expect("tokens").is_empty());
    assert_eq!(engine.kv_free_blocks(), 1);
    // A batch where one sequence fits but both together do not is refused as a whole.
    assert!(engine
        .step(&[
            SeqStep {
                seq: a,
                tokens: &[5],
                logits: LogitsMode::Last,
            },
            SeqStep {
                seq: b,
                tokens: &tokens(20, 2),
                logits: LogitsMode::Last,
            },
        ])
        .is_err());
    assert_eq!(engine.cached_tokens(a).expect("tokens").len(), 40);
    engine
        .step(&[SeqStep {
            seq: a,
            tokens: &[5],
            logits: LogitsMode::Last,
        }])
        .expect("decode fits");
    // Freeing a (as a cancelled request does) returns its 3 blocks.
    assert!(engine.free_sequence(a));
    assert_eq!(engine.kv_free_blocks(), 4);
    let out = engine
        .step(&[SeqStep {
            seq: b,
            tokens: &tokens(20, 2),
            logits: LogitsMode::Last,
        }])
        .expect("room after freeing");
    assert!(out[0].is_some());
}

/// The KV types a model cannot store and budgets that hold no block are refused up front.
#[test]
fn impossible_kv_options_are_refused() {
    let model = tiny("llama", TypeMix::Uniform(GgmlDType::F32));
    let mut src = model.into_source();
    let m = Model::load(&mut src, &mut |_, _| {}).expect("load");
    let err = Engine::with_kv(
        m,
        KvOptions {
            kv_type: KvType::F16,
            budget_bytes: Some(1000),
        },
    )
    .err()
    .expect("a 1000-byte budget holds no block");
    assert!(err.to_string().contains("holds no block"), "{err}");
}

#[test]
fn bad_steps_are_errors_and_leave_caches_untouched() {
    let mut engine = engine_from(tiny("llama", TypeMix::Uniform(GgmlDType::F32)));
    let seq = engine.create_sequence();
    engine
        .step(&[SeqStep {
            seq,
            tokens: &[1, 2, 3],
            logits: LogitsMode::None,
        }])
        .expect("step");
    // Out-of-vocabulary token, empty chunk, unknown sequence, duplicate sequence, overflow.
    assert!(engine
        .step(&[SeqStep {
            seq,
            tokens: &[4, 9999],
            logits: LogitsMode::Last
        }])
        .is_err());
    assert!(engine
        .step(&[SeqStep {
            seq,
            tokens: &[],
            logits: LogitsMode::Last
        }])
        .is_err());
    assert!(engine
        .step(&[SeqStep {
            seq: 12345,
            tokens: &[1],
            logits: LogitsMode::Last
        }])
        .is_err());
    assert!(engine
        .step(&[
            SeqStep {
                seq,
                tokens: &[1],
                logits: LogitsMode::Last
            },
            SeqStep {
                seq,
                tokens: &[2],
                logits: LogitsMode::Last
            },
        ])
        .is_err());
    let long = vec![1u32; 2048];
    let err = engine
        .step(&[SeqStep {
            seq,
            tokens: &long,
            logits: LogitsMode::Last,
        }])
        .expect_err("overflow");
    assert!(err.to_string().contains("context window"), "{err}");
    assert_eq!(engine.cached_tokens(seq).expect("tokens"), &[1, 2, 3]);
}

/// A sequence saved as bytes and restored into another engine of the same model holds the same
/// K/V: the next step's logits are bit for bit those of the original, for every KV type (a
/// partly used last block included). A snapshot of another format, of the wrong size or with
/// a token outside the vocabulary is refused and changes nothing.
#[test]
fn saved_kv_restores_into_another_engine_bit_for_bit() {
    for kv_type in KvType::ALL {
        let build = || {
            engine_with(
                tiny("llama", TypeMix::Uniform(GgmlDType::Q8_0)),
                kv_type,
                1 << 24,
            )
        };
        let (mut a, mut b) = (build(), build());
        let seq = a.create_sequence();
        let prompt: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % 500).collect();
        a.step(&[SeqStep {
            seq,
            tokens: &prompt,
            logits: LogitsMode::None,
        }])
        .expect("prefill");
        let snapshot = a.save_kv(seq).expect("save");
        assert_eq!(snapshot.tokens, prompt);
        assert_eq!(snapshot.format, format!("cpu-pages-{kv_type}-v1"));
        assert_eq!(snapshot.bytes.len(), 3 * a.kv_block_bytes());

        let free = b.kv_free_blocks();
        let mut wrong = snapshot.clone();
        wrong.format = "fast-arena-f16-v1".into();
        assert!(b.restore_kv(&wrong).is_err());
        let mut short = snapshot.clone();
        short.bytes.pop();
        assert!(b.restore_kv(&short).is_err());
        let mut alien = snapshot.clone();
        alien.tokens[3] = 1_000_000;
        assert!(b.restore_kv(&alien).is_err());
        assert_eq!(b.kv_free_blocks(), free, "a refused restore took blocks");

        let restored = b.restore_kv(&snapshot).expect("restore");
        assert_eq!(b.cached_tokens(restored).expect("cached"), &prompt[..]);
        let next = |e: &mut Engine, s| {
            e.step(&[SeqStep {
                seq: s,
                tokens: &[42],
                logits: LogitsMode::Last,
            }])
            .expect("decode")
            .remove(0)
            .expect("logits")
        };
        assert_eq!(next(&mut b, restored), next(&mut a, seq), "{kv_type}");
    }
}
