//! Sampler and stop-string behaviour.

use smolchat_text::sampling::{Sampler, SamplingParams, StopMatcher, StopTokens};
use smolchat_text::TextError;

fn params(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: Some(1),
        ..SamplingParams::default()
    }
}

fn sampler(p: SamplingParams) -> Sampler {
    Sampler::new(p).unwrap()
}

/// A deterministic pseudo-random row of logits (an LCG, so the test needs no RNG of its own).
fn random_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for i in 0..l.len() {
        if l[i] > l[best] {
            best = i;
        }
    }
    best as u32
}

fn draw_sequence(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = sampler(p);
    (0..n)
        .map(|_| s.sample(&mut logits.to_vec(), &[]).unwrap())
        .collect()
}

#[test]
fn defaults_are_llama_server_like_and_valid() {
    let p = SamplingParams::default();
    assert_eq!(p.temperature, 0.8);
    assert_eq!(p.top_k, 40);
    assert_eq!(p.top_p, 0.95);
    assert_eq!(p.min_p, 0.05);
    assert_eq!(p.repetition_penalty, 1.0);
    assert_eq!(p.penalty_last_n, 64);
    assert_eq!(p.max_new_tokens, 512);
    p.validate().unwrap();
    SamplingParams::greedy().validate().unwrap();
}

#[test]
fn validate_names_the_bad_field() {
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                temperature: -0.1,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: -0.5,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            "repetition_penalty",
        ),
        (
            SamplingParams {
                presence_penalty: f32::INFINITY,
                ..Default::default()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..Default::default()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                max_new_tokens: 0,
                ..Default::default()
            },
            "max_new_tokens",
        ),
        (
            SamplingParams {
                stop_strings: vec!["ok".into(), String::new()],
                ..Default::default()
            },
            "stop string",
        ),
    ];
    for (p, field) in cases {
        match p.validate() {
            Err(TextError::Sampling(msg)) => assert!(msg.contains(field), "{msg}"),
            other => panic!("{field}: expected a sampling error, got {other:?}"),
        }
        assert!(Sampler::new(p).is_err());
    }
}

#[test]
fn params_deserialize_with_defaults() {
    let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.2, "seed": 7}"#).unwrap();
    assert_eq!(p.temperature, 0.2);
    assert_eq!(p.seed, Some(7));
    assert_eq!(p.top_k, 40);
    let back: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
}

#[test]
fn greedy_is_argmax() {
    for seed in 0..20 {
        let logits = random_logits(1000, seed);
        let mut s = sampler(SamplingParams::greedy());
        assert_eq!(s.sample(&mut logits.clone(), &[]).unwrap(), argmax(&logits));
    }
    // Ties go to the lowest id.
    let mut s = sampler(SamplingParams::greedy());
    assert_eq!(s.sample(&mut [1.0, 3.0, 3.0, 2.0], &[]).unwrap(), 1);
}

#[test]
fn temperature_zero_ignores_the_seed() {
    let logits = random_logits(5000, 3);
    let a = draw_sequence(
        SamplingParams {
            seed: Some(1),
            ..params(0.0)
        },
        &logits,
        20,
    );
    let b = draw_sequence(
        SamplingParams {
            seed: Some(999),
            ..params(0.0)
        },
        &logits,
        20,
    );
    let c = draw_sequence(
        SamplingParams {
            seed: None,
            ..params(0.0)
        },
        &logits,
        20,
    );
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert!(a.iter().all(|&t| t == argmax(&logits)));
}

#[test]
fn same_seed_same_sequence_different_seed_differs() {
    // Flat-ish logits so draws vary from token to token.
    let logits: Vec<f32> = random_logits(32_000, 5).iter().map(|x| x * 0.1).collect();
    for p in [params(1.0), SamplingParams::default()] {
        let a = draw_sequence(
            SamplingParams {
                seed: Some(42),
                ..p.clone()
            },
            &logits,
            64,
        );
        let b = draw_sequence(
            SamplingParams {
                seed: Some(42),
                ..p.clone()
            },
            &logits,
            64,
        );
        let c = draw_sequence(
            SamplingParams {
                seed: Some(43),
                ..p.clone()
            },
            &logits,
            64,
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 5, "draws should vary: {a:?}");
    }
}

#[test]
fn top_k_one_is_greedy() {
    for seed in 0..10 {
        let logits = random_logits(2000, seed);
        let p = SamplingParams {
            top_k: 1,
            seed: Some(seed),
            ..params(5.0)
        };
        assert!(draw_sequence(p, &logits, 10)
            .iter()
            .all(|&t| t == argmax(&logits)));
    }
}

#[test]
fn top_k_keeps_only_the_k_best() {
    let logits: Vec<f32> = (0..1000).map(|i| (i % 100) as f32 * 0.01).collect();
    // The best value, 0.99, appears 10 times (ids 99, 199, ..., 999); top-5 breaks the tie
    // towards the lowest ids.
    let p = SamplingParams {
        top_k: 5,
        ..params(10.0)
    };
    let drawn = draw_sequence(p, &logits, 500);
    let allowed = [99, 199, 299, 399, 499];
    assert!(drawn.iter().all(|t| allowed.contains(t)), "{drawn:?}");
    for a in allowed {
        assert!(drawn.contains(&a));
    }
}

#[test]
fn tiny_top_p_is_argmax() {
    for seed in 0..10 {
        let logits = random_logits(50_000, seed);
        let p = SamplingParams {
            top_p: 1e-6,
            seed: Some(seed),
            ..params(1.5)
        };
        assert!(draw_sequence(p, &logits, 10)
            .iter()
            .all(|&t| t == argmax(&logits)));
    }
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_the_mass() {
    // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8).
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let p = SamplingParams {
        top_p: 0.7,
        ..params(1.0)
    };
    let drawn = draw_sequence(p, &logits, 2000);
    assert!(drawn.iter().all(|&t| t < 2));
    assert!(drawn.contains(&0) && drawn.contains(&1));
    // On a large flat vocabulary (every weight in one bucket) the cut must still be exact: 60%
    // of a uniform 100k vocabulary is ids 0..60000 (ties go to the lowest ids).
    let flat = vec![0.0f32; 100_000];
    let p = SamplingParams {
        top_p: 0.6,
        ..params(1.0)
    };
    let drawn = draw_sequence(p, &flat, 300);
    let max = *drawn.iter().max().unwrap();
    assert!(max < 60_001, "{max}");
    assert!(max > 50_000, "{max}");
}

#[test]
fn top_p_on_a_large_vocabulary_matches_a_full_sort() {
    for (seed, top_p, temperature) in [(1u64, 0.5f32, 1.0f32), (2, 0.9, 0.7), (3, 0.99, 1.3)] {
        let logits = random_logits(60_000, seed);
        // Reference: sort everything, keep the prefix whose mass first reaches top_p.
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut w: Vec<(f64, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| ((((l - max) / temperature) as f64).exp(), i as u32))
            .collect();
        let z: f64 = w.iter().map(|x| x.0).sum();
        w.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut acc = 0.0;
        let n_keep = w
            .iter()
            .position(|x| {
                acc += x.0 / z;
                acc >= top_p as f64
            })
            .unwrap()
            + 1;
        let rank: std::collections::HashMap<u32, usize> =
            w.iter().enumerate().map(|(r, x)| (x.1, r)).collect();
        let p = SamplingParams {
            top_p,
            seed: Some(seed),
            ..params(temperature)
        };
        let drawn = draw_sequence(p, &logits, 1000);
        let worst = drawn.iter().map(|t| rank[t]).max().unwrap();
        assert!(worst < n_keep, "drew rank {worst}, keep {n_keep}");
        // The tail of the kept set is reachable (the cut is not too early either).
        assert!(worst * 10 > n_keep * 9, "worst rank {worst} of {n_keep}");
    }
}

#[test]
fn min_p_filters_relative_to_the_best() {
    // Probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.25 keeps p >= 0.125: {0, 1, 2}.
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let p = SamplingParams {
        min_p: 0.25,
        ..params(1.0)
    };
    let drawn = draw_sequence(p, &logits, 5000);
    assert!(!drawn.contains(&3));
    for t in 0..3 {
        assert!(drawn.contains(&t));
    }
    // min_p 0.7 keeps only the best.
    let p = SamplingParams {
        min_p: 0.7,
        ..params(1.0)
    };
    assert!(draw_sequence(p, &logits, 500).iter().all(|&t| t == 0));
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let p = SamplingParams {
        repetition_penalty: 1.25,
        ..SamplingParams::greedy()
    };
    let mut s = sampler(p);
    let mut logits = vec![2.0, 1.9, -1.0, -1.1];
    // Token 0 is penalised: 2.0 / 1.25 = 1.6 < 1.9.
    assert_eq!(s.sample(&mut logits, &[0]).unwrap(), 1);
    assert_eq!(logits, vec![1.6, 1.9, -1.0, -1.1]);
    // Negative logits move away from zero: -1.0 * 1.25 = -1.25 < -1.1.
    let mut logits = vec![-1.0, -1.1];
    assert_eq!(s.sample(&mut logits, &[0, 0, 0]).unwrap(), 1);
    assert_eq!(logits, vec![-1.25, -1.1]);
}

#[test]
fn presence_and_frequency_penalties_subtract() {
    let p = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..SamplingParams::greedy()
    };
    let mut s = sampler(p);
    // Token 0 seen 3 times: 5.0 - 0.5 - 3 * 0.25 = 3.75; token 1 once: 4.0 - 0.75 = 3.25.
    let mut logits = vec![5.0, 4.0, 3.8];
    assert_eq!(s.sample(&mut logits, &[0, 1, 0, 0]).unwrap(), 2);
    assert_eq!(logits, vec![3.75, 3.25, 3.8]);
    // Presence alone does not grow with the count.
    let mut s = sampler(SamplingParams {
        presence_penalty: 1.0,
        ..SamplingParams::greedy()
    });
    let mut logits = vec![5.0, 4.5];
    assert_eq!(s.sample(&mut logits, &[0, 0, 0, 0, 0, 0]).unwrap(), 1);
    assert_eq!(logits, vec![4.0, 4.5]);
}

#[test]
fn penalties_only_look_at_the_last_n_tokens() {
    let p = SamplingParams {
        repetition_penalty: 2.0,
        penalty_last_n: 2,
        ..SamplingParams::greedy()
    };
    let mut s = sampler(p);
    let mut logits = vec![2.0, 1.5, 1.0];
    // Token 0 is outside the window of the last 2 tokens.
    assert_eq!(s.sample(&mut logits, &[0, 2, 2]).unwrap(), 0);
    assert_eq!(logits, vec![2.0, 1.5, 0.5]);
    // penalty_last_n = 0 turns penalties off.
    let mut s = sampler(SamplingParams {
        repetition_penalty: 2.0,
        penalty_last_n: 0,
        ..SamplingParams::greedy()
    });
    let mut logits = vec![2.0, 1.5];
    assert_eq!(s.sample(&mut logits, &[0]).unwrap(), 0);
    assert_eq!(logits, vec![2.0, 1.5]);
}

#[test]
fn recent_token_outside_the_vocabulary_is_an_error() {
    let mut s = sampler(SamplingParams {
        repetition_penalty: 1.1,
        ..SamplingParams::greedy()
    });
    match s.sample(&mut [1.0, 2.0], &[5]) {
        Err(TextError::BadToken { id: 5, vocab: 2 }) => {}
        other => panic!("{other:?}"),
    }
}

/// Draws `n` tokens and checks each frequency is within `tol` of the expected probability.
fn check_frequencies(p: SamplingParams, logits: &[f32], expected: &[f64], n: usize, tol: f64) {
    let mut counts = vec![0usize; logits.len()];
    let mut s = sampler(p);
    for _ in 0..n {
        counts[s.sample(&mut logits.to_vec(), &[]).unwrap() as usize] += 1;
    }
    for (i, (&c, &e)) in counts.iter().zip(expected).enumerate() {
        let f = c as f64 / n as f64;
        assert!((f - e).abs() < tol, "token {i}: {f} vs {e} ({counts:?})");
    }
}

#[test]
fn temperature_sampling_matches_the_softmax() {
    let probs = [0.5f64, 0.3, 0.15, 0.05];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
    // 20k draws: the standard error of a frequency is at most 0.0036, so 2% is > 5 sigma.
    check_frequencies(params(1.0), &logits, &probs, 20_000, 0.02);
    // Temperature 2 flattens: p_i^(1/2), renormalised.
    let flat: Vec<f64> = probs.iter().map(|p| p.sqrt()).collect();
    let z: f64 = flat.iter().sum();
    let flat: Vec<f64> = flat.iter().map(|p| p / z).collect();
    check_frequencies(
        SamplingParams {
            seed: Some(7),
            ..params(2.0)
        },
        &logits,
        &flat,
        20_000,
        0.02,
    );
    // Temperature 0.5 sharpens: p_i^2, renormalised.
    let sharp: Vec<f64> = probs.iter().map(|p| p * p).collect();
    let z: f64 = sharp.iter().sum();
    let sharp: Vec<f64> = sharp.iter().map(|p| p / z).collect();
    check_frequencies(
        SamplingParams {
            seed: Some(9),
            ..params(0.5)
        },
        &logits,
        &sharp,
        20_000,
        0.02,
    );
}

#[test]
fn nan_and_infinite_logits_do_not_panic() {
    for p in [
        SamplingParams::greedy(),
        params(1.0),
        SamplingParams::default(),
    ] {
        let mut s = sampler(p);
        // NaN is never chosen.
        let mut logits = vec![f32::NAN, 1.0, f32::NAN, 0.5];
        for _ in 0..50 {
            let t = s.sample(&mut logits.clone(), &[]).unwrap();
            assert!(t == 1 || t == 3, "{t}");
        }
        s.sample(&mut logits, &[]).unwrap();
        assert!(logits[0] == f32::NEG_INFINITY && logits[2] == f32::NEG_INFINITY);
        // +inf dominates without overflowing into NaN.
        let mut logits = vec![0.0, f32::INFINITY, 3.0, f32::NEG_INFINITY];
        assert_eq!(s.sample(&mut logits, &[]).unwrap(), 1);
        // Huge finite logits of both signs stay finite in the softmax.
        let mut logits = vec![f32::MAX, -f32::MAX, f32::MAX / 2.0];
        assert_eq!(s.sample(&mut logits, &[]).unwrap(), 0);
        // Nothing usable: a clear error.
        for bad in [vec![f32::NAN; 8], vec![f32::NEG_INFINITY; 8], vec![]] {
            match s.sample(&mut bad.clone(), &[]) {
                Err(TextError::Sampling(msg)) => assert!(!msg.is_empty()),
                other => panic!("{other:?}"),
            }
        }
    }
}

/// A 128k vocabulary through the default chain samples (deterministically for a seed). Its speed
/// is printed, not asserted (speed is measured by benchmarks); the bound below is a hang guard
/// against a pathological chain (seconds per token), not the property.
#[test]
fn large_vocabulary_sampling_works() {
    let logits = random_logits(128_256, 11);
    let mut s = sampler(SamplingParams {
        top_k: 0,
        min_p: 0.0,
        seed: Some(3),
        ..SamplingParams::default()
    });
    let mut again = sampler(SamplingParams {
        top_k: 0,
        min_p: 0.0,
        seed: Some(3),
        ..SamplingParams::default()
    });
    let start = std::time::Instant::now();
    for _ in 0..200 {
        let a = s.sample(&mut logits.clone(), &[1, 2, 3]).unwrap();
        let b = again.sample(&mut logits.clone(), &[1, 2, 3]).unwrap();
        assert_eq!(a, b, "the same seed samples the same token");
        assert!((a as usize) < 128_256);
    }
    let per_token = start.elapsed() / 400;
    eprintln!("128k vocabulary, top-p 0.95 on near-flat logits: {per_token:?} per token");
    // Hang guard only.
    assert!(per_token.as_secs() < 1, "{per_token:?} per token");
}

#[test]
fn stop_tokens() {
    let mut st = StopTokens::new([2, 49152]);
    st.insert(2);
    assert_eq!(st.ids(), &[2, 49152]);
    assert!(st.is_stop_token(2) && st.is_stop_token(49152));
    assert!(!st.is_stop_token(3));
    assert!(StopTokens::default().is_empty());
}

/// Feeds `pieces` and returns (everything emitted, stop string hit).
fn run_matcher(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
    let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    let mut m = StopMatcher::new(&stops);
    let mut out = String::new();
    for p in pieces {
        let o = m.push(p);
        out.push_str(&o.emit);
        if o.stopped() {
            assert!(m.is_stopped());
            // Nothing more comes out after a stop.
            assert_eq!(m.push("more").emit, "");
            assert_eq!(m.finish(), "");
            return (out, o.stopped_by);
        }
    }
    out.push_str(&m.finish());
    (out, None)
}

#[test]
fn stop_matcher_at_every_split_point() {
    let text = "Hello wörld, the answer is 42.\nUser: thanks";
    let stops = ["\nUser:", "never"];
    let expected = "Hello wörld, the answer is 42.";
    let boundaries: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &i in &boundaries {
        let (out, hit) = run_matcher(&stops, &[&text[..i], &text[i..]]);
        assert_eq!(out, expected, "split at {i}");
        assert_eq!(hit.as_deref(), Some("\nUser:"));
        for &j in boundaries.iter().filter(|&&j| j >= i) {
            let (out, hit) = run_matcher(&stops, &[&text[..i], &text[i..j], &text[j..]]);
            assert_eq!(out, expected, "split at {i}, {j}");
            assert_eq!(hit.as_deref(), Some("\nUser:"));
        }
    }
    // One character at a time.
    let chars: Vec<String> = text.chars().map(|c| c.to_string()).collect();
    let pieces: Vec<&str> = chars.iter().map(|s| s.as_str()).collect();
    assert_eq!(run_matcher(&stops, &pieces).0, expected);
}

#[test]
fn stop_matcher_holds_only_possible_prefixes() {
    let stops = vec!["<stop>".to_string()];
    let mut m = StopMatcher::new(&stops);
    assert_eq!(m.push("abc<").emit, "abc");
    assert_eq!(m.push("st").emit, "");
    // "<stx" cannot become "<stop>": all of it is released.
    assert_eq!(m.push("x").emit, "<stx");
    assert_eq!(m.push("a <sto").emit, "a ");
    // Generation ended without completing the stop string: the held text is released.
    assert_eq!(m.finish(), "<sto");
}

#[test]
fn stop_matcher_earliest_stop_wins_and_no_stops_passes_through() {
    let (out, hit) = run_matcher(&["world", "lo w"], &["hel", "lo world"]);
    assert_eq!(out, "hel");
    assert_eq!(hit.as_deref(), Some("lo w"));
    // A stop string inside a single piece.
    let (out, hit) = run_matcher(&["END"], &["abcENDdef"]);
    assert_eq!((out.as_str(), hit.as_deref()), ("abc", Some("END")));
    // A stop string at the very start.
    let (out, hit) = run_matcher(&["END"], &["E", "ND"]);
    assert_eq!((out.as_str(), hit.as_deref()), ("", Some("END")));
    let (out, hit) = run_matcher(&[], &["a", "b"]);
    assert_eq!((out.as_str(), hit), ("ab", None));
    // Empty stop strings are ignored.
    let (out, hit) = run_matcher(&[""], &["a", "b"]);
    assert_eq!((out.as_str(), hit), ("ab", None));
    // Overlapping prefixes: "aab" stop within "aaab".
    let (out, hit) = run_matcher(&["aab"], &["a", "a", "a", "b", "c"]);
    assert_eq!((out.as_str(), hit.as_deref()), ("a", Some("aab")));
}

#[test]
fn logprobs_are_a_log_softmax_of_the_raw_logits() {
    use smolchat_text::sampling::logprobs_of;
    let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
    let lp = logprobs_of(&logits, 4, 3);
    let total: f64 = logits
        .iter()
        .enumerate()
        .map(|(i, _)| f64::from(logprobs_of(&logits, i as u32, 0).logprob).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-6, "{total}");
    assert_eq!(lp.token, 4);
    assert!(
        (lp.logprob - (-2.0 - (1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp()).ln() as f32)).abs()
            < 1e-5
    );
    // Most likely first, ties by the lowest id; NaN is impossible.
    assert_eq!(
        lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![1, 3, 0]
    );
    assert_eq!(logprobs_of(&logits, 2, 0).logprob, f32::NEG_INFINITY);
    // More alternatives than tokens: all of them.
    assert_eq!(logprobs_of(&logits, 0, 20).top.len(), 5);
}

#[test]
fn top_logprobs_over_twenty_are_refused() {
    let p = SamplingParams {
        logprobs: Some(21),
        ..SamplingParams::default()
    };
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("top_logprobs"), "{e}");
}
