#![cfg(test)]
//! The model worker's tests: caches per conversation and per salt, eviction and preemption under
//! KV pressure, shared prompt prefixes, embeddings, drafts, on the CPU engine and the fast tier's
//! CPU runner. Test code only (the module is compiled for tests alone).
#![cfg(test)]

use super::*;

/// A conversation id for the tests (a fixed one per number).
fn conversation(n: u128) -> Option<Uuid> {
    Some(Uuid::from_u128(n))
}
use smolchat_engine::synthetic::{self, SyntheticSpec};
use smolchat_engine::{KvOptions, KvType, Model};
use smolchat_gguf::GgufSource;
use smolchat_text::sampling::SamplingParams;
use tokio::sync::mpsc;

fn worker() -> ModelWorker {
    worker_with_kv(None)
}

/// Registers embedding requests and steps them together, each prompt fed in chunks of at
/// most `chunk` tokens per step, beside `decoding` (a generation request id already
/// prefilled, kept decoding in the same steps); returns each vector.
fn embed_together(
    w: &mut ModelWorker,
    prompts: &[(RequestId, Vec<u32>, Pooling)],
    chunk: usize,
    decoding: Option<RequestId>,
) -> Vec<Vec<f32>> {
    let mut receivers = Vec::new();
    for (id, prompt, pooling) in prompts {
        let (tx, rx) = mpsc::unbounded_channel();
        w.active.insert(
            *id,
            Active::new(
                GenerationRequest {
                    cache_key: None,
                    user: None,
                    group: None,
                    cache_salt: None,
                    prompt: prompt.clone(),
                    params: SamplingParams::greedy(),
                    max_time: None,
                    events: tx,
                    embed: Some(*pooling),
                    warm: false,
                },
                Instant::now(),
            ),
        );
        receivers.push(rx);
    }
    let mut open: Vec<RequestId> = prompts.iter().map(|p| p.0).collect();
    for _ in 0..100 {
        if open.is_empty() {
            break;
        }
        let plan = StepPlan {
            prefill: open.iter().map(|&id| (id, chunk)).collect(),
            decode: decoding.into_iter().collect(),
            ..StepPlan::default()
        };
        let report = w.step(plan);
        open.retain(|id| !report.items.iter().any(|r| r.id == *id && r.finished));
    }
    receivers
        .into_iter()
        .map(|mut rx| {
            let mut vector = None;
            let mut finished = None;
            while let Ok(e) = rx.try_recv() {
                match e {
                    GenEvent::Embedding(v) => vector = Some(v),
                    GenEvent::Finished(s) => finished = Some(s),
                    GenEvent::Token { .. } => panic!("an embedding generates no token"),
                    GenEvent::Admitted { cached_tokens, .. } => assert_eq!(cached_tokens, 0),
                }
            }
            let summary = finished.expect("finished");
            assert_eq!(summary.reason, StopReason::EndOfGeneration);
            assert_eq!(summary.completion_tokens, 0);
            vector.expect("an embedding comes before Finished")
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// An embedding is the mean (or last) of the final hidden states the engine computes,
/// L2-normalized; the same alone, beside other embeddings and a decoding reply, and fed in
/// chunks; it leaves no cache behind and is not served from one.
#[test]
fn embeddings_pool_the_final_hidden_states_alone_batched_and_chunked() {
    let mut w = worker();
    let prompt: Vec<u32> = (200..237).collect();
    let other: Vec<u32> = (400..420).collect();

    // What the engine itself gives, pooled by hand.
    let seq = w.engine.create_sequence();
    let mut out = Logits::new();
    w.engine
        .step_into(
            &[SeqStep {
                seq,
                tokens: &prompt,
                logits: LogitsMode::Hidden,
            }],
            &mut out,
        )
        .expect("step");
    w.engine.free_sequence(seq);
    let width = out.hidden_width();
    assert_eq!(width, w.engine.config().hidden);
    let rows = out.hidden(0).expect("hidden rows");
    assert_eq!(rows.len(), prompt.len() * width);
    assert!(out.get(0).is_none(), "no logits for a hidden-state item");
    let normalize = |v: Vec<f64>| {
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter().map(|x| (x / n) as f32).collect::<Vec<f32>>()
    };
    let mean = normalize(
        (0..width)
            .map(|c| rows.chunks(width).map(|r| r[c] as f64).sum::<f64>() / prompt.len() as f64)
            .collect(),
    );
    let last = normalize(
        rows[rows.len() - width..]
            .iter()
            .map(|&x| x as f64)
            .collect(),
    );

    let alone = embed_together(&mut w, &[(1, prompt.clone(), Pooling::Mean)], 1000, None);
    assert!(
        max_diff(&alone[0], &mean) < 1e-6,
        "{}",
        max_diff(&alone[0], &mean)
    );
    let norm: f32 = alone[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "L2-normalized: {norm}");
    let caches = w.caches.len();

    // Beside a reply being decoded and another embedding, in chunks of 5.
    let reply = run(&mut w, 2, None, (300..310).collect());
    assert!(!reply.is_empty());
    let (tx, _rx) = mpsc::unbounded_channel();
    w.active.insert(
        3,
        Active::new(
            GenerationRequest {
                cache_key: None,
                user: None,
                group: None,
                cache_salt: None,
                prompt: (500..510).collect(),
                params: SamplingParams {
                    max_new_tokens: 50,
                    ignore_eos: true,
                    ..SamplingParams::greedy()
                },
                max_time: None,
                events: tx,
                embed: None,
                warm: false,
            },
            Instant::now(),
        ),
    );
    w.step(StepPlan {
        prefill: vec![(3, 1000)],
        ..StepPlan::default()
    });
    let together = embed_together(
        &mut w,
        &[
            (4, other.clone(), Pooling::Mean),
            (5, prompt.clone(), Pooling::Mean),
            (6, prompt.clone(), Pooling::Last),
        ],
        5,
        Some(3),
    );
    assert!(
        max_diff(&together[1], &alone[0]) < 1e-5,
        "{}",
        max_diff(&together[1], &alone[0])
    );
    assert!(
        max_diff(&together[2], &last) < 1e-5,
        "{}",
        max_diff(&together[2], &last)
    );
    assert!(
        max_diff(&together[0], &alone[0]) > 1e-3,
        "another text, another vector"
    );
    // The same prompt again is computed afresh (no cached prefix has hidden states), and
    // no embedding left a cache to reuse.
    let again = embed_together(&mut w, &[(7, prompt.clone(), Pooling::Mean)], 1000, None);
    assert!(max_diff(&again[0], &alone[0]) < 1e-6);
    assert!(
        w.caches.len() <= caches + 1,
        "only the reply's cache was kept"
    );
    assert!(w.caches.values().all(|slot| w.engine.contains(slot.seq)));
}

/// The GPU's fast tier (its CPU runner) gives the CPU engine's embedding, and no logits are
/// computed for it (its plan stops at the output norm).
#[test]
fn the_fast_tier_embeds_like_the_cpu_engine() {
    let (spec, tokenizer) = tiny_with_tokenizer();
    let spec = spec.with_type_mix(smolchat_engine::synthetic::TypeMix::Uniform(
        smolchat_gguf::GgmlDType::Q8_0,
    ));
    let mut src = synthetic::build(&spec).expect("build");
    let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
    let mut cpu = ModelWorker::new(Engine::new(model), Arc::new(tokenizer), 2048);
    let mut fast = fast_tier_worker(None);
    let prompts = [
        (1, (200..260).collect::<Vec<u32>>(), Pooling::Mean),
        (2, (900..911).collect(), Pooling::Last),
    ];
    let a = embed_together(&mut cpu, &prompts, 16, None);
    let b = embed_together(&mut fast, &prompts, 16, None);
    for (x, y) in a.iter().zip(&b) {
        // Unit vectors: their dot product is the cosine. The fast tier quantizes activations
        // to Q8_1 where the CPU engine uses its own tiles, and its prefill attention rounds
        // the queries and probabilities to f16 on the tensor cores (as llama.cpp's flash
        // attention does), so they agree closely, not exactly: on this random tiny model the
        // last-token prompt measured 0.99992 before the flash kernel and 0.99975 with it
        // (max difference 0.0023 and 0.0043); a wrong mask or position is far below.
        let cosine: f32 = x.iter().zip(y).map(|(p, q)| p * q).sum();
        assert!(cosine > 0.9995, "cosine {cosine}");
        assert!(max_diff(x, y) < 5e-3, "{}", max_diff(x, y));
    }
}

/// A worker on a tiny model; with `Some(n)`, an engine and budget of exactly `n` KV blocks.
fn worker_with_kv(blocks: Option<usize>) -> ModelWorker {
    let (spec, tokenizer) = tiny_with_tokenizer();
    let mut src = synthetic::build(&spec).expect("build");
    let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
    match blocks {
        None => ModelWorker::new(Engine::new(model), Arc::new(tokenizer), 2048),
        Some(n) => {
            let kv = smolchat_engine::kv::KvLayout::new(&model.config, KvType::F16);
            let budget = n * kv.bytes_per_block();
            let options = KvOptions {
                kv_type: KvType::F16,
                budget_bytes: Some(budget),
            };
            let engine = Engine::with_kv(model, options).expect("engine");
            ModelWorker::new(engine, Arc::new(tokenizer), 2048)
        }
    }
}

/// A tiny random model with SmolLM2's vocabulary, and that tokenizer.
fn tiny_with_tokenizer() -> (SyntheticSpec, Tokenizer) {
    // The repository's models/ folder, two levels above this crate.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let real = GgufSource::open(&path).expect("run ./scripts/fetch-model.sh");
    let tokenizer = Tokenizer::from_gguf(&real).expect("tokenizer");
    let spec = SyntheticSpec::tiny("llama")
        .with_tokenizer_from(&real)
        .expect("spec");
    (spec, tokenizer)
}

/// A worker over the GPU's fast tier executed by its CPU runner (the kernels' twins), on a
/// Q8_0 tiny model; with `Some(n)`, a cache of exactly `n` blocks.
fn fast_tier_worker(blocks: Option<usize>) -> ModelWorker {
    use smolchat_engine::fast::{cpu::CpuRunner, weights::FastWeights, FastBackend};
    let (spec, tokenizer) = tiny_with_tokenizer();
    let spec = spec.with_type_mix(smolchat_engine::synthetic::TypeMix::Uniform(
        smolchat_gguf::GgmlDType::Q8_0,
    ));
    let mut src = synthetic::build(&spec).expect("build");
    let config = smolchat_engine::ModelConfig::from_gguf(&src).expect("config");
    let weights = FastWeights::load(&mut src, config, &mut |_, _| {}).expect("weights");
    let backend = Box::new(FastBackend::new(
        CpuRunner::new(weights).with_graph_emulation(),
    ));
    let budget = blocks.map(|n| n * smolchat_engine::Backend::kv_block_bytes(backend.as_ref()));
    let engine = Engine::on_backend(
        backend,
        KvOptions {
            kv_type: KvType::F16,
            budget_bytes: budget,
        },
    )
    .expect("engine");
    ModelWorker::new(engine, Arc::new(tokenizer), 2048)
}

/// Runs one request to the end; returns its events.
fn run(w: &mut ModelWorker, id: RequestId, key: Option<Uuid>, prompt: Vec<u32>) -> Vec<GenEvent> {
    run_salted(w, id, key, None, prompt)
}

fn run_salted(
    w: &mut ModelWorker,
    id: RequestId,
    key: Option<Uuid>,
    salt: Option<&str>,
    prompt: Vec<u32>,
) -> Vec<GenEvent> {
    let params = SamplingParams {
        max_new_tokens: 3,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    run_with(w, id, key, salt, prompt, params)
}

/// Runs one request with `params` to its end (prefill, then decode steps) and returns its
/// events.
fn run_with(
    w: &mut ModelWorker,
    id: RequestId,
    key: Option<Uuid>,
    salt: Option<&str>,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> Vec<GenEvent> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    w.active.insert(
        id,
        Active::new(
            GenerationRequest {
                cache_key: key,
                cache_salt: salt.map(str::to_string),
                ..GenerationRequest::anonymous(prompt, params, tx)
            },
            Instant::now(),
        ),
    );
    let mut plan = StepPlan {
        prefill: vec![(id, 1000)],
        ..StepPlan::default()
    };
    // Ends by itself well before: the bound only stops a runaway test.
    for _ in 0..30 {
        let report = w.step(plan);
        if report.items.iter().any(|r| r.id == id && r.finished) {
            break;
        }
        plan = StepPlan {
            decode: vec![id],
            // Room for drafts, used only by a worker with speculation on.
            draft_budget: 8,
            ..StepPlan::default()
        };
    }
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e);
    }
    events
}

fn cached(events: &[GenEvent]) -> usize {
    events
        .iter()
        .find_map(|e| match e {
            GenEvent::Admitted { cached_tokens, .. } => Some(*cached_tokens),
            _ => None,
        })
        .expect("admitted")
}

#[test]
fn caches_are_kept_per_conversation_and_for_stateless_prefixes() {
    let mut w = worker();
    let prompt: Vec<u32> = (100..120).collect();
    let first = run(&mut w, 1, None, prompt.clone());
    assert_eq!(cached(&first), 0);
    assert!(matches!(first.last(), Some(GenEvent::Finished(s)) if s.completion_tokens == 3));

    // A stateless request resending the same conversation plus more reuses the kept prefix.
    let mut longer = prompt.clone();
    longer.extend(200..205);
    assert_eq!(cached(&run(&mut w, 2, None, longer)), 20);

    // A conversation's cache survives between its turns.
    assert_eq!(cached(&run(&mut w, 3, conversation(1), prompt.clone())), 0);
    let mut turn2 = prompt.clone();
    turn2.extend(300..304);
    assert_eq!(cached(&run(&mut w, 4, conversation(1), turn2)), 20);

    // Evicting it forces a full prefill.
    assert!(w.forget_conversation(Uuid::from_u128(1)));
    assert_eq!(cached(&run(&mut w, 5, conversation(1), prompt)), 0);
}

#[test]
fn stateless_caches_are_reused_only_within_their_salt() {
    let mut w = worker();
    let secret: Vec<u32> = (100..130).collect();
    let first = run_salted(&mut w, 1, None, Some("alice"), secret.clone());
    assert_eq!(cached(&first), 0);
    let mut probe = secret.clone();
    probe.push(7);
    // Another client (another salt, or none) shares nothing with Alice's cache.
    assert_eq!(
        cached(&run_salted(&mut w, 2, None, Some("bob"), probe.clone())),
        0
    );
    assert_eq!(cached(&run_salted(&mut w, 3, None, None, probe.clone())), 0);
    // A salt that extends Alice's as a string is still another partition.
    assert_eq!(
        cached(&run_salted(&mut w, 4, None, Some("alice/"), probe.clone())),
        0
    );
    // Alice herself reuses her prefix.
    assert_eq!(
        cached(&run_salted(&mut w, 5, None, Some("alice"), probe)),
        30
    );
}

/// With a budget of 3 KV blocks (48 positions): an idle conversation is evicted to make room
/// for another, and a prompt larger than the whole budget (the batcher refuses those at
/// submit; here the worker is driven directly) ends its request with a clear error instead of
/// crashing the worker, which keeps serving afterwards.
#[test]
fn a_full_kv_cache_evicts_idle_caches_then_refuses_with_an_error() {
    let mut w = worker_with_kv(Some(3));
    assert_eq!(w.engine.kv_capacity_blocks(), 3);
    let prompt_a: Vec<u32> = (100..120).collect(); // 20 + 3 generated: 2 blocks
    let prompt_b: Vec<u32> = (200..220).collect();
    let a = run(&mut w, 1, conversation(2), prompt_a.clone());
    assert!(matches!(a.last(), Some(GenEvent::Finished(s)) if s.reason == StopReason::Length));
    assert_eq!(w.engine.kv_free_blocks(), 1);
    let b = run(&mut w, 2, conversation(3), prompt_b.clone());
    assert!(matches!(b.last(), Some(GenEvent::Finished(s)) if s.reason == StopReason::Length));
    assert_eq!(w.evictions, 1, "a's idle cache made room for b");
    assert!(!w
        .caches
        .contains_key(&CacheKey::Conversation(Uuid::from_u128(2))));
    // b's cache survived and is reused.
    let mut b2 = prompt_b.clone();
    b2.extend(300..304);
    assert_eq!(cached(&run(&mut w, 3, conversation(3), b2)), 20);

    // 60 prompt tokens need 4 blocks: more than the whole budget.
    let huge: Vec<u32> = (0..60).collect();
    let events = run(&mut w, 4, conversation(4), huge);
    match events.last() {
        Some(GenEvent::Finished(s)) => match &s.reason {
            // The client's fault (its prompt), not the engine's.
            StopReason::Error(Failure::Request(msg)) => {
                assert!(msg.contains("does not fit the KV cache"), "{msg}")
            }
            other => panic!("expected an error, got {other:?}"),
        },
        other => panic!("expected a finished event, got {other:?}"),
    }
    assert!(w.active.is_empty());
    // The worker still serves.
    let again = run(&mut w, 5, conversation(2), prompt_a);
    assert!(matches!(again.last(), Some(GenEvent::Finished(s)) if s.completion_tokens == 3));
}

/// Drives `w` with the real batcher over `requests` (prompt, new tokens) submitted together,
/// as the scheduler does; returns each request's generated tokens, its stop reason, and how
/// many preemptions happened.
fn drive(
    w: &mut ModelWorker,
    requests: &[(Vec<u32>, usize)],
) -> (Vec<(Vec<u32>, StopReason)>, u64) {
    drive_with(w, requests, &SamplingParams::greedy())
}

/// Runs `requests` (prompt, tokens to generate) through a batcher and `w` with `params`.
fn drive_with(
    w: &mut ModelWorker,
    requests: &[(Vec<u32>, usize)],
    params: &SamplingParams,
) -> (Vec<(Vec<u32>, StopReason)>, u64) {
    let requests: Vec<(Vec<u32>, usize, Option<&str>)> = requests
        .iter()
        .map(|(p, n)| (p.clone(), *n, None))
        .collect();
    let driven = drive_all(w, &requests, params);
    let results = driven
        .results
        .into_iter()
        .map(|(tokens, reason, _)| (tokens, reason))
        .collect();
    (results, driven.preemptions)
}

/// What [`drive_all`] saw: per request its tokens, why it stopped and how many prompt
/// tokens came from a cache; the preemptions; the most KV blocks held at once.
struct Driven {
    results: Vec<(Vec<u32>, StopReason, usize)>,
    preemptions: u64,
    peak_blocks: usize,
}

/// Requests through a real batcher, each `(prompt, tokens, cache salt)` (the salt is the
/// request's user too), sampled with `params` (end of generation ignored), until every one
/// has finished.
fn drive_all(
    w: &mut ModelWorker,
    requests: &[(Vec<u32>, usize, Option<&str>)],
    params: &SamplingParams,
) -> Driven {
    let mut b = test_batcher(w);
    let mut receivers = Vec::new();
    for (prompt, n, salt) in requests {
        let id = b.submit(None, prompt.len(), None).expect("submit");
        let (tx, rx) = mpsc::unbounded_channel();
        w.active.insert(
            id,
            Active::new(
                GenerationRequest {
                    user: salt.map(str::to_string),
                    cache_salt: salt.map(str::to_string),
                    ..GenerationRequest::anonymous(
                        prompt.clone(),
                        SamplingParams {
                            max_new_tokens: *n,
                            ignore_eos: true,
                            ..params.clone()
                        },
                        tx,
                    )
                },
                Instant::now(),
            ),
        );
        receivers.push(rx);
    }
    let (mut peak_blocks, mut preemptions) = (0, 0);
    for _ in 0..10_000 {
        let Some(plan) = b.plan() else { break };
        let report = w.step(plan);
        preemptions += report.preemptions;
        peak_blocks = peak_blocks.max(w.engine.total_kv_bytes() / w.engine.kv_block_bytes());
        b.apply(&report.items);
        b.set_kv_free_blocks(report.kv_free_blocks);
    }
    let results = receivers
        .into_iter()
        .map(|mut rx| {
            let (mut tokens, mut reason, mut cached) = (Vec::new(), None, 0);
            while let Ok(e) = rx.try_recv() {
                match e {
                    GenEvent::Token { token, .. } => tokens.push(token),
                    GenEvent::Finished(s) => reason = Some(s.reason),
                    GenEvent::Admitted { cached_tokens, .. } => cached = cached_tokens,
                    GenEvent::Embedding(_) => {}
                }
            }
            (tokens, reason.expect("every request finishes"), cached)
        })
        .collect();
    Driven {
        results,
        preemptions,
        peak_blocks,
    }
}

/// [`drive_all`], greedy: the results and the most KV blocks held at once.
fn drive_shared(
    w: &mut ModelWorker,
    requests: &[(Vec<u32>, usize, Option<&str>)],
) -> (Vec<(Vec<u32>, StopReason, usize)>, usize) {
    let driven = drive_all(w, requests, &SamplingParams::greedy());
    (driven.results, driven.peak_blocks)
}

/// Three requests of one prompt from one client (a request's `n` choices) compute its
/// prefill once: the later two fork the first's whole blocks (held once), and every reply
/// is token for token the one it gets alone. Another client's identical prompt shares
/// nothing.
#[test]
fn requests_of_one_client_share_the_blocks_of_a_common_prompt() {
    shared_prompt_case(worker);
    // The GPU's fast tier (its CPU runner) reads shared blocks the same way.
    shared_prompt_case(|| fast_tier_worker(None));
}

fn shared_prompt_case(worker: impl Fn() -> ModelWorker) {
    let prompt: Vec<u32> = (1000..1100).collect();
    let alone = {
        let mut w = worker();
        drive_shared(&mut w, &[(prompt.clone(), 12, Some("a"))])
            .0
            .remove(0)
    };
    assert_eq!(alone.2, 0);
    let mut w = worker();
    let (results, peak) = drive_shared(
        &mut w,
        &[
            (prompt.clone(), 12, Some("a")),
            (prompt.clone(), 12, Some("a")),
            (prompt.clone(), 12, Some("a")),
        ],
    );
    for (i, (tokens, reason, _)) in results.iter().enumerate() {
        assert_eq!(tokens, &alone.0, "choice {i}");
        assert_eq!(*reason, StopReason::Length);
    }
    assert_eq!(results[0].2, 0);
    // 99 usable prompt positions: 96 in whole blocks.
    assert_eq!((results[1].2, results[2].2), (96, 96));
    // Alone: 112 positions = 7 blocks. Three sharing 6 prompt blocks: 6 + 3 × 2.
    assert!(peak <= 12, "{peak} blocks at the peak");

    let mut w = worker();
    let (results, _) = drive_shared(
        &mut w,
        &[
            (prompt.clone(), 12, Some("a")),
            (prompt.clone(), 12, Some("b")),
        ],
    );
    assert_eq!(
        (results[0].2, results[1].2),
        (0, 0),
        "no sharing across clients"
    );
    assert_eq!(results[1].0, alone.0);
}

/// Drives each of `requests` alone on a fresh worker from `alone`, then all of them together
/// on `pressed`: every reply completes without an error and is token for token the one it got
/// alone. Returns `pressed`, the replies and how many preemptions it made.
fn replies_hold_under_pressure(
    alone: impl Fn() -> ModelWorker,
    mut pressed: ModelWorker,
    requests: &[(Vec<u32>, usize)],
) -> (ModelWorker, Vec<(Vec<u32>, StopReason)>, u64) {
    let want: Vec<Vec<u32>> = requests
        .iter()
        .map(|req| drive(&mut alone(), std::slice::from_ref(req)).0.remove(0).0)
        .collect();
    let (got, preemptions) = drive(&mut pressed, requests);
    for (i, ((tokens, reason), want)) in got.iter().zip(&want).enumerate() {
        assert!(
            !matches!(reason, StopReason::Error(_)),
            "request {i} failed: {reason:?}"
        );
        assert_eq!(
            tokens, want,
            "request {i}: the reply changed under pressure"
        );
    }
    assert!(preemptions > 0, "the test never preempted anything");
    (pressed, got, preemptions)
}

/// Six requests that each fit a 6-block cache alone but not together: every one completes
/// (some after waiting, some after being preempted and recomputed), none with an error, and
/// each greedy reply is token for token the one it gets alone in a roomy cache.
#[test]
fn under_kv_pressure_requests_wait_or_are_preempted_and_replies_stay_the_same() {
    let requests: Vec<(Vec<u32>, usize)> = (0..6u32)
        .map(|r| ((100 + 40 * r..120 + 40 * r).collect(), 30))
        .collect();
    // 20 prompt + 30 generated = 50 positions: 4 blocks each; 6 blocks hold one at a time
    // at its end, but two fit at their start, so the second is preempted as they grow.
    let (w, replies, _) = replies_hold_under_pressure(worker, worker_with_kv(Some(6)), &requests);
    for (i, (tokens, _)) in replies.iter().enumerate() {
        assert_eq!(tokens.len(), 30, "request {i}");
    }
    assert!(w.active.is_empty());
}

/// Speculating under KV pressure: a request preempted in a step that verifies its drafts
/// recomputes only what it had accepted (its last sampled token, not the drafts), so every
/// greedy reply is still token for token the one it gets alone without speculation.
#[test]
fn preempted_drafts_are_not_recomputed_as_accepted() {
    let requests: Vec<(Vec<u32>, usize)> = mixed_prompts()
        .into_iter()
        .take(6)
        .map(|(prompt, _)| (prompt, 30))
        .collect();
    let pressed = speculative(worker_with_kv(Some(6)));
    let (w, _, _) = replies_hold_under_pressure(worker, pressed, &requests);
    assert!(w.spec_drafted > 0, "the test never drafted anything");
}

/// The same under the GPU's fast tier (its CPU runner): waits and preemptions change no reply.
#[test]
fn the_fast_tier_preempts_under_kv_pressure_and_replies_stay_the_same() {
    let requests: Vec<(Vec<u32>, usize)> = (0..4u32)
        .map(|r| ((100 + 40 * r..120 + 40 * r).collect(), 30))
        .collect();
    replies_hold_under_pressure(
        || fast_tier_worker(None),
        fast_tier_worker(Some(6)),
        &requests,
    );
}

/// The fast tier draws on its device: greedy replies equal the host's draw from the same
/// logits, a seeded reply is the same every time and another seed gives another, and
/// penalties reach the device (a strong repetition penalty changes the greedy reply).
#[test]
fn the_fast_tier_draws_tokens_on_its_device() {
    let requests: Vec<(Vec<u32>, usize)> = (0..3u32)
        .map(|r| ((100 + 40 * r..120 + 40 * r).collect(), 12))
        .collect();
    let tokens = |w: &mut ModelWorker, p: &SamplingParams| -> Vec<Vec<u32>> {
        let (got, _) = drive_with(w, &requests, p);
        got.into_iter()
            .map(|(t, reason)| {
                assert_eq!(reason, StopReason::Length, "{t:?}");
                t
            })
            .collect()
    };
    let greedy = SamplingParams::greedy();
    assert!(fast_tier_worker(None).engine.samples_on_device());
    let on_device = tokens(&mut fast_tier_worker(None), &greedy);
    let on_host = tokens(&mut fast_tier_worker(None).sample_on_host(), &greedy);
    assert_eq!(on_device, on_host);

    let seeded = |seed| SamplingParams {
        temperature: 1.2,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let a = tokens(&mut fast_tier_worker(None), &seeded(7));
    let b = tokens(&mut fast_tier_worker(None), &seeded(7));
    let c = tokens(&mut fast_tier_worker(None), &seeded(8));
    assert_eq!(a, b, "a seeded reply changed");
    assert_ne!(a, c, "two seeds drew the same replies");
    assert_ne!(a, on_device, "temperature 1.2 drew the greedy replies");

    let penalised = SamplingParams {
        repetition_penalty: 50.0,
        presence_penalty: 5.0,
        penalty_last_n: 64,
        ..SamplingParams::greedy()
    };
    let p_device = tokens(&mut fast_tier_worker(None), &penalised);
    let p_host = tokens(&mut fast_tier_worker(None).sample_on_host(), &penalised);
    assert_eq!(p_device, p_host, "penalties differ between device and host");
    assert_ne!(p_device, on_device, "the penalties changed nothing");
}

/// Log-probabilities need the logits on the host: a backend that draws on its device brings
/// them back for the requests that ask, and each output token carries its own.
#[test]
fn logprobs_come_back_from_a_backend_that_draws_on_its_device() {
    let mut w = fast_tier_worker(None);
    assert!(w.engine.samples_on_device());
    let params = SamplingParams {
        max_new_tokens: 5,
        ignore_eos: true,
        logprobs: Some(2),
        ..SamplingParams::greedy()
    };
    let events = run_with(&mut w, 7, None, None, (100..120).collect(), params);
    let mut tokens = 0;
    for e in events {
        if let GenEvent::Token {
            token, logprobs, ..
        } = e
        {
            let lp = logprobs.expect("every token has its log-probabilities");
            assert_eq!(lp.token, token);
            assert_eq!(lp.top.len(), 2);
            // Greedy: the chosen token is the most likely one.
            assert_eq!(lp.top[0].0, token);
            assert!(lp.logprob <= 0.0 && (lp.logprob - lp.top[0].1).abs() < 1e-6);
            tokens += 1;
        }
    }
    assert_eq!(tokens, 5);
}

/// Speculation on, drafting whatever a proposer finds (the break-even fixed at zero, not
/// measured from this machine's timing), in batches of up to eight too.
fn speculative(w: ModelWorker) -> ModelWorker {
    w.with_speculation(speculation())
}

fn speculation() -> SpecConfig {
    SpecConfig {
        enabled: true,
        max_batch: 8,
        fixed_break_even: Some(0.0),
        on_gpu: true,
        ..SpecConfig::default()
    }
}

/// Prompts of eight conversations, some repeating themselves (lookups find drafts there),
/// some not.
fn mixed_prompts() -> Vec<(Vec<u32>, usize)> {
    let mut prompts = Vec::new();
    for i in 0..8u32 {
        let prompt: Vec<u32> = if i % 2 == 0 {
            // A phrase said three times: what follows is likely said again.
            let phrase: Vec<u32> = (0..6).map(|t| 100 + 7 * i + t).collect();
            phrase
                .iter()
                .chain(&phrase)
                .chain(&phrase)
                .copied()
                .collect()
        } else {
            (0..20).map(|t| 300 + 13 * i + 3 * t).collect()
        };
        prompts.push((prompt, 40 + 4 * i as usize));
    }
    prompts
}

#[test]
fn drafts_come_from_the_same_users_earlier_replies_only() {
    // Prompt lookup off (no n-gram is ever looked up in the sequence's own tokens): every
    // draft comes from the user's n-gram cache.
    let mut w = worker().with_speculation(SpecConfig {
        enabled: true,
        max_ngram: 0,
        min_ngram: 0,
        fixed_break_even: Some(0.0),
        on_gpu: true,
        ..SpecConfig::default()
    });
    let prompt: Vec<u32> = (0..12).map(|t| 200 + 5 * t).collect();
    let greedy = SamplingParams::greedy();
    let reply = |w: &mut ModelWorker, user: &str| {
        let driven = drive_all(w, &[(prompt.clone(), 40, Some(user))], &greedy);
        driven.results[0].0.clone()
    };
    let plain = reply(&mut worker(), "alice");
    assert_eq!(reply(&mut w, "alice"), plain);
    assert_eq!(
        w.spec_drafted, 0,
        "nothing learned before the first reply ended"
    );
    assert_eq!(reply(&mut w, "bob"), plain);
    assert_eq!(w.spec_drafted, 0, "nothing of alice's is drafted for bob");
    assert_eq!(reply(&mut w, "alice"), plain, "the same reply with drafts");
    tracing::info!(
        "alice's second reply: {} drafted, {} accepted",
        w.spec_drafted,
        w.spec_accepted
    );
    assert!(w.spec_accepted > 0, "drafted {}", w.spec_drafted);
}

/// A reply asked for its log-probabilities is the same with drafts verified: each token
/// carries the log-probabilities of its own row of the verifying step, as plain decoding's.
#[test]
fn log_probabilities_are_the_same_with_speculation() {
    let phrase: Vec<u32> = (0..6).map(|t| 140 + 3 * t).collect();
    let prompt: Vec<u32> = phrase.iter().cycle().take(18).copied().collect();
    let params = SamplingParams {
        max_new_tokens: 24,
        ignore_eos: true,
        logprobs: Some(3),
        ..SamplingParams::greedy()
    };
    let run = |w: &mut ModelWorker| {
        let mut tokens = Vec::new();
        for e in run_with(w, 9, None, None, prompt.clone(), params.clone()) {
            if let GenEvent::Token {
                token, logprobs, ..
            } = e
            {
                let lp = logprobs.expect("every token has its log-probabilities");
                assert_eq!(lp.token, token);
                tokens.push((token, lp.logprob, lp.top));
            }
        }
        tokens
    };
    let plain = run(&mut worker());
    let mut w = speculative(worker());
    let drafted = run(&mut w);
    assert!(
        w.spec_accepted > 0,
        "drafts were accepted ({} drafted)",
        w.spec_drafted
    );
    assert_eq!(plain.len(), 24);
    assert_eq!(plain.len(), drafted.len());
    for (i, (a, b)) in plain.iter().zip(&drafted).enumerate() {
        assert_eq!(a.0, b.0, "token {i}");
        assert!((a.1 - b.1).abs() < 1e-5, "token {i}: {} vs {}", a.1, b.1);
        assert_eq!(a.2.len(), 3);
        for (x, y) in a.2.iter().zip(&b.2) {
            assert_eq!(x.0, y.0, "token {i}'s alternatives");
            assert!((x.1 - y.1).abs() < 1e-5, "token {i}: {x:?} vs {y:?}");
        }
    }
}

#[test]
fn greedy_replies_are_the_same_with_speculation_and_drafts_are_accepted() {
    let requests = mixed_prompts();
    let greedy = SamplingParams::greedy();
    let (plain, _) = drive_with(&mut worker(), &requests, &greedy);
    let mut w = speculative(worker());
    let (spec, _) = drive_with(&mut w, &requests, &greedy);
    assert_eq!(plain, spec, "the same tokens, request by request");
    tracing::info!(
        "greedy, 8 conversations: {} drafted, {} accepted",
        w.spec_drafted,
        w.spec_accepted
    );
    assert!(w.spec_drafted > 0, "drafts were verified");
    assert!(
        w.spec_accepted > 0,
        "some drafts were accepted ({} drafted)",
        w.spec_drafted
    );
    // One request alone too (the batch of one, where speculation pays most).
    let (alone, _) = drive_with(&mut worker(), &requests[..1], &greedy);
    let (alone_spec, _) = drive_with(&mut speculative(worker()), &requests[..1], &greedy);
    assert_eq!(alone, alone_spec);
}

/// A step that warmed up or captured a decode graph says nothing of what a step costs (a
/// capture takes many steps' time): only eager and replayed steps are measured.
#[test]
fn steps_that_make_decode_graphs_are_not_measured() {
    let mut w = fast_tier_worker(None);
    let prompt: Vec<u32> = (0..12).map(|t| 200 + 5 * t).collect();
    // The prompt's step, then one decode: the one-row bucket's warm-up.
    w.generate_alone(prompt.clone(), 2);
    let g = w
        .engine
        .graph_stats()
        .expect("the fast tier keeps graph statistics");
    assert_eq!((g.warmups, g.replays), (1, 0), "{g:?}");
    assert_eq!(w.step_cost.line(), None, "a warm-up step was measured");
    // Its capture, then replays: those are measured.
    w.generate_alone(prompt, 8);
    let g = w.engine.graph_stats().expect("graph statistics");
    assert!(g.captures >= 1 && g.replays >= 1, "{g:?}");
    assert!(
        w.step_cost.line().is_some(),
        "replayed steps were not measured"
    );
}

/// On a backend whose kernels compute a row alike only within a class of step sizes (the
/// GPU's: our matvec kernels, one class of 1 to 8 rows), drafts never take a step out of its
/// class: a lone conversation may verify up to 7 drafts a step (candle's MMVQ classes allowed
/// 3), a step of up to 8 sequences grows to 8 rows at most, and the replies are the ones plain
/// decoding gives.
#[test]
fn drafts_keep_a_step_within_the_rows_its_kernels_compute_alike() {
    let classes = || {
        let (spec, tokenizer) = tiny_with_tokenizer();
        let mut src = synthetic::build(&spec).expect("build");
        let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
        // The CPU backend, saying of its rows what the CUDA kernels say, and recording each
        // verifying step's (sequences, rows): only a decode verifying drafts asks for
        // every position's logits here.
        let verifying = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = verifying.clone();
        let backend = smolchat_engine::backend::Watched {
            inner: Box::new(smolchat_engine::CpuBackend::f16(model)),
            watch: Box::new(move |asked| {
                if let smolchat_engine::backend::Asked::Forward(items) = asked {
                    let all = |i: &smolchat_engine::backend::BatchItem<'_>| {
                        i.tokens.len() > 1 && matches!(i.logits, LogitsMode::All)
                    };
                    if items.iter().any(all) {
                        let rows: usize = items.iter().map(|i| i.tokens.len()).sum();
                        if let Ok(mut v) = seen.lock() {
                            v.push((items.len(), rows));
                        }
                    }
                }
            }),
            rows_alike: Some(smolchat_engine::fast::launch::rows_computed_alike),
        };
        let engine = Engine::on_backend(Box::new(backend), KvOptions::default()).expect("engine");
        (
            ModelWorker::new(engine, Arc::new(tokenizer), 2048),
            verifying,
        )
    };
    let greedy = SamplingParams::greedy();
    let requests = mixed_prompts();
    for conversations in [1, 8] {
        let requests = &requests[..conversations];
        let (plain, _) = drive_with(&mut worker(), requests, &greedy);
        let (w, verifying) = classes();
        let mut w = speculative(w);
        let (spec, _) = drive_with(&mut w, requests, &greedy);
        assert_eq!(
            plain, spec,
            "{conversations} conversations: the same replies"
        );
        let steps = verifying.lock().map(|v| v.clone()).unwrap_or_default();
        assert!(
            !steps.is_empty() && w.spec_accepted > 0,
            "{conversations} conversations: drafts verified in {} steps, {} accepted",
            steps.len(),
            w.spec_accepted
        );
        for &(sequences, rows) in &steps {
            let most = smolchat_engine::fast::launch::rows_computed_alike(sequences);
            assert!(
                sequences <= 8 && rows <= most,
                "{conversations} conversations: a step of {sequences} sequences verified \
                 drafts in {rows} rows (at most {most} keep each row's arithmetic)"
            );
        }
    }
}

#[test]
fn the_fast_tier_verifies_drafts_with_the_same_replies() {
    // The GPU's fast tier, run by its kernels' CPU twins: every position's logits of a
    // decode with drafts, and the truncation after it, give the replies plain decoding
    // gives.
    same_with_speculation(
        || fast_tier_worker(None),
        speculation(),
        &mixed_prompts(),
        &SamplingParams::greedy(),
    );
}

/// Drives `requests` on a worker from `make` with drafts off, then on (`spec`): the replies
/// must be the same and some drafts accepted. Both workers come back.
fn same_with_speculation(
    make: impl Fn() -> ModelWorker,
    spec: SpecConfig,
    requests: &[(Vec<u32>, usize)],
    params: &SamplingParams,
) -> (ModelWorker, ModelWorker) {
    let mut plain_worker = make();
    let (plain, _) = drive_with(&mut plain_worker, requests, params);
    let mut w = make().with_speculation(spec);
    let (drafted, _) = drive_with(&mut w, requests, params);
    assert_eq!(plain, drafted);
    assert!(
        w.spec_drafted > 0 && w.spec_accepted > 0,
        "{} / {}",
        w.spec_accepted,
        w.spec_drafted
    );
    (plain_worker, w)
}

#[test]
fn the_fast_tier_verifies_drafts_on_the_device_with_the_same_seeded_replies() {
    // On the fast tier (its kernels' CPU twins, graphs emulated) a decode with drafts is
    // drawn on the device row by row (LogitsMode::SampleAll) inside a decode graph: each row
    // takes the uniform plain decoding would take, and only for the tokens kept, so seeded
    // replies with a repetition penalty are the same token for token.
    // Temperature 0.2: at 0.35 this random tiny model's seeded replies (since the flash
    // prefill's f16 rounding moved its trajectories) no longer repeat their prompts' n-grams
    // enough for drafts to be accepted, and the test would check nothing.
    let params = SamplingParams {
        temperature: 0.2,
        top_k: 0,
        top_p: 1.0,
        repetition_penalty: 1.05,
        seed: Some(77),
        ..SamplingParams::greedy()
    };
    // Four conversations (two repeating themselves) keep it quick in a debug build; single-
    // token lookups too, as sampled replies repeat themselves less than greedy ones.
    let (plain_worker, w) = same_with_speculation(
        || fast_tier_worker(None),
        SpecConfig {
            min_ngram: 1,
            ..speculation()
        },
        &mixed_prompts()[..4],
        &params,
    );
    let stats = w.engine.graph_stats().unwrap_or_default();
    let plain_stats = plain_worker.engine.graph_stats().unwrap_or_default();
    // Each verifying step is one decode graph step in place of several (the engine's own
    // test checks that such a step replays a decode graph). Graphs are recaptured a few
    // times more than without drafts: a verifying step has more rows than any plain step,
    // and the runner's buffers grow to the largest step seen.
    assert!(
        stats.replays > 0
            && stats.replays + stats.captures + stats.warmups
                < plain_stats.replays + plain_stats.captures + plain_stats.warmups,
        "fewer decode graph steps with drafts: {stats:?} against {plain_stats:?}"
    );
}

#[test]
fn sampling_with_speculation_keeps_the_distribution() {
    // Many seeded draws of one repetitive prompt, with and without speculation. Drawing
    // each row from the model's own distribution and keeping a draft only when the draw
    // equals it is the rejection rule for a draft of probability 1, so the distribution is
    // the model's, and seeded replies are even the same token for token.
    let (prompt, _) = mixed_prompts()[0].clone();
    let mut plain_hist: HashMap<(usize, u32), u32> = HashMap::new();
    let mut spec_hist: HashMap<(usize, u32), u32> = HashMap::new();
    let mut same = 0;
    let mut total = 0;
    let mut w_plain = worker();
    // Single-token lookups too: sampled replies repeat themselves less than greedy ones.
    let mut w_spec = worker().with_speculation(SpecConfig {
        min_ngram: 1,
        ..speculation()
    });
    for batch in 0..20u64 {
        let params = SamplingParams {
            temperature: 0.35,
            top_k: 0,
            top_p: 1.0,
            seed: Some(1000 + batch),
            ..SamplingParams::greedy()
        };
        let requests: Vec<(Vec<u32>, usize)> = (0..8u32)
            .map(|i| {
                let mut p = prompt.clone();
                // A different last token per request, so the eight differ.
                p.push(500 + i);
                (p, 10)
            })
            .collect();
        let (a, _) = drive_with(&mut w_plain, &requests, &params);
        let (b, _) = drive_with(&mut w_spec, &requests, &params);
        for ((ta, _), (tb, _)) in a.iter().zip(&b) {
            total += 1;
            same += u32::from(ta == tb);
            for (pos, t) in ta.iter().enumerate() {
                *plain_hist.entry((pos, *t)).or_default() += 1;
            }
            for (pos, t) in tb.iter().enumerate() {
                *spec_hist.entry((pos, *t)).or_default() += 1;
            }
        }
    }
    assert!(
        w_spec.spec_drafted > 0 && w_spec.spec_accepted > 0,
        "drafts were verified ({}) and some accepted ({})",
        w_spec.spec_drafted,
        w_spec.spec_accepted
    );
    // Total variation distance per position, over the 160 draws.
    for pos in 0..10 {
        let keys: std::collections::HashSet<u32> = plain_hist
            .keys()
            .chain(spec_hist.keys())
            .filter(|k| k.0 == pos)
            .map(|k| k.1)
            .collect();
        let tv: f64 = keys
            .iter()
            .map(|t| {
                let a = f64::from(*plain_hist.get(&(pos, *t)).unwrap_or(&0));
                let b = f64::from(*spec_hist.get(&(pos, *t)).unwrap_or(&0));
                (a - b).abs()
            })
            .sum::<f64>()
            / 2.0
            / f64::from(total);
        assert!(tv < 0.1, "position {pos}: total variation {tv}");
    }
    tracing::info!(
        "sampled: {same} of {total} seeded replies equal; {} drafted, {} accepted",
        w_spec.spec_drafted,
        w_spec.spec_accepted
    );
    assert!(
        f64::from(same) / f64::from(total) > 0.95,
        "{same} of {total} seeded replies equal"
    );
}

#[test]
fn grammar_masks_computed_during_the_step_give_the_same_reply() {
    let reply = |overlap: bool| -> (String, Vec<StopReason>) {
        let mut w = fast_tier_worker(None).with_mask_overlap(overlap);
        let params = SamplingParams {
            max_new_tokens: 20,
            grammar: Some(smolchat_text::constraint::Grammar::Regex(
                "[a-z]{3,6}".into(),
            )),
            ..SamplingParams::greedy()
        };
        let mut text = String::new();
        let mut reasons = Vec::new();
        for e in run_with(&mut w, 9, None, None, (100..120).collect(), params) {
            match e {
                GenEvent::Token { text: t, .. } => text.push_str(&t),
                GenEvent::Finished(s) => reasons.push(s.reason),
                GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
            }
        }
        (text, reasons)
    };
    let (serial, serial_end) = reply(false);
    let (overlapped, overlapped_end) = reply(true);
    assert_eq!(serial, overlapped);
    assert_eq!(serial_end, vec![StopReason::EndOfGeneration]);
    assert_eq!(overlapped_end, serial_end);
    assert!(
        (3..=6).contains(&serial.len()) && serial.chars().all(|c| c.is_ascii_lowercase()),
        "{serial:?}"
    );
}

/// The worker's run loop says where a step's time goes: the forward pass within the step, and
/// the wait for the next plan after a report that left a request running (the hop through the
/// scheduler); after a report that left nothing running there is no hop to measure.
#[test]
fn step_reports_split_the_engine_from_the_host_and_measure_the_hop() {
    let w = worker();
    let (commands, rx) = std_mpsc::channel();
    let (reports_tx, reports) = std_mpsc::channel();
    let thread = std::thread::spawn(move || w.run(rx, move |r| drop(reports_tx.send(r))));
    let (tx, _events) = mpsc::unbounded_channel();
    let params = SamplingParams {
        max_new_tokens: 2,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let send = |cmd| commands.send(cmd).unwrap_or_else(|e| panic!("{e}"));
    send(WorkerCommand::Register {
        id: 1,
        request: Box::new(GenerationRequest::anonymous(vec![5, 6, 7], params, tx)),
        submitted: Instant::now(),
    });
    let recv = || {
        reports
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    send(WorkerCommand::Step(StepPlan {
        prefill: vec![(1, 3)],
        ..StepPlan::default()
    }));
    let first = recv();
    assert_eq!(first.gap_ms, None, "no step before the first");
    assert!(
        first.engine_ms > 0.0 && first.engine_ms <= first.step_ms,
        "{first:?}"
    );
    assert!(first.items.iter().any(|i| i.id == 1 && !i.finished));
    std::thread::sleep(std::time::Duration::from_millis(30));
    let decode = || {
        WorkerCommand::Step(StepPlan {
            decode: vec![1],
            ..StepPlan::default()
        })
    };
    send(decode());
    let second = recv();
    let gap = second
        .gap_ms
        .unwrap_or_else(|| panic!("no hop measured: {second:?}"));
    assert!(gap >= 30.0, "the hop was {gap} ms");
    assert!(second.items.iter().any(|i| i.id == 1 && i.finished));
    // Nothing running after it: the next step's wait is idle time, not a hop.
    send(decode());
    assert_eq!(recv().gap_ms, None);
    drop(commands);
    thread
        .join()
        .unwrap_or_else(|_| panic!("the worker panicked"));
}

/// The batcher the drive helpers plan with, as the scheduler would: 8 running, a 64-token
/// step budget, no per-user limits, `w`'s KV capacity.
fn test_batcher(w: &ModelWorker) -> super::super::batcher::Batcher {
    use super::super::batcher::{Batcher, BatcherConfig};
    Batcher::new(BatcherConfig {
        max_running: 8,
        queue_capacity: 16,
        step_token_budget: 64,
        context_window: 2048,
        max_queued_per_user: 0,
        max_running_per_user: 0,
        tokens_per_minute_per_user: 0,
        tokens_per_minute_per_group: 0,
        kv_capacity_blocks: w.kv_capacity_blocks(),
        warm: crate::warm::WarmConfig::default(),
    })
}

/// What one request of [`drive_each`] got: each token with its text, and why it stopped.
type Reply = (Vec<(u32, String)>, StopReason);

/// Requests through a real batcher, each `(prompt, params, conversation)` as given (end of
/// generation included unless its params ignore it), until every one has finished; each
/// reply, and the tokens each conversation's cache holds afterwards.
fn drive_each(
    w: &mut ModelWorker,
    requests: &[(Vec<u32>, SamplingParams, Option<Uuid>)],
) -> (Vec<Reply>, Vec<Vec<u32>>) {
    let mut b = test_batcher(w);
    let mut receivers = Vec::new();
    for (prompt, params, key) in requests {
        let id = b.submit(None, prompt.len(), None).expect("submit");
        let (tx, rx) = mpsc::unbounded_channel();
        w.active.insert(
            id,
            Active::new(
                GenerationRequest {
                    cache_key: *key,
                    ..GenerationRequest::anonymous(prompt.clone(), params.clone(), tx)
                },
                Instant::now(),
            ),
        );
        receivers.push(rx);
    }
    for _ in 0..10_000 {
        let Some(plan) = b.plan() else { break };
        let report = w.step(plan);
        b.apply(&report.items);
        b.set_kv_free_blocks(report.kv_free_blocks);
    }
    let replies = receivers
        .into_iter()
        .map(|mut rx| {
            let (mut tokens, mut reason) = (Vec::new(), None);
            while let Ok(e) = rx.try_recv() {
                match e {
                    GenEvent::Token { token, text, .. } => tokens.push((token, text)),
                    GenEvent::Finished(s) => reason = Some(s.reason),
                    GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
                }
            }
            (tokens, reason.expect("every request finishes"))
        })
        .collect();
    let caches = requests
        .iter()
        .filter_map(|r| r.2)
        .map(|key| {
            let slot = w
                .caches
                .get(&CacheKey::Conversation(key))
                .expect("the conversation's cache is kept");
            w.engine.cached_tokens(slot.seq).expect("cached").to_vec()
        })
        .collect();
    (replies, caches)
}

/// A fast-tier worker (its CPU runner) launching steady decode steps ahead, or not.
fn ahead_worker(on: bool) -> ModelWorker {
    fast_tier_worker(None).with_async_steps(on)
}

/// Steps launched one ahead of their tokens' delivery change no reply, greedy or seeded, with
/// eight requests of different lengths coming and going through the batcher (mixed steps
/// interrupt the chain; replies of every length end a step late), and leave the same caches.
#[test]
fn steps_launched_ahead_give_the_same_replies_and_caches() {
    let seeded = SamplingParams {
        temperature: 1.1,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        seed: Some(11),
        ..SamplingParams::default()
    };
    for (params, drafts) in [(SamplingParams::greedy(), true), (seeded, false)] {
        // Five of the eight conversations (three repeating themselves), of 6 to 22 tokens.
        let requests: Vec<(Vec<u32>, SamplingParams, Option<Uuid>)> = mixed_prompts()
            .into_iter()
            .take(5)
            .enumerate()
            .map(|(i, (prompt, _))| {
                let params = SamplingParams {
                    max_new_tokens: 6 + 4 * i,
                    ignore_eos: true,
                    ..params.clone()
                };
                (prompt, params, conversation(100 + i as u128))
            })
            .collect();
        let mut sync = ahead_worker(false);
        let mut ahead = ahead_worker(true);
        let expected = drive_each(&mut sync, &requests);
        let got = drive_each(&mut ahead, &requests);
        assert_eq!(sync.ahead_launched, 0);
        assert!(
            ahead.ahead_launched > 10,
            "{} launched",
            ahead.ahead_launched
        );
        assert!(ahead.ahead_voided > 0, "no reply ended a step late");
        assert_eq!(got.0, expected.0, "a reply changed");
        assert_eq!(got.1, expected.1, "a conversation's cache changed");
        assert!(!ahead.engine.in_flight() || ahead.ahead.is_some());

        // With drafting on too: a step goes ahead only where no reply would verify drafts
        // next, and replies are still the same. (The seeded replies find nothing to draft.)
        let mut both = speculative(ahead_worker(true));
        let got = drive_each(&mut both, &requests);
        assert!(
            both.ahead_launched > 0 && (both.spec_drafted > 0) == drafts,
            "{} launched ahead, {} drafted",
            both.ahead_launched,
            both.spec_drafted
        );
        assert_eq!(
            got.0, expected.0,
            "a reply changed with drafts and steps ahead"
        );
    }
}

/// The one-step-late stop rule: a reply ended by the end of generation, a stop string or its
/// token limit at every position of a short reply, beside another reply that goes on, is
/// token for token (and text for text) the reply of steps run one at a time, no token past the
/// stop is sent, and the conversation's cache holds the same tokens afterwards.
#[test]
fn a_stop_seen_a_step_late_sends_nothing_past_it() {
    const N: usize = 6;
    let prompt: Vec<u32> = (500..530).collect();
    let other: Vec<u32> = (700..716).collect();
    let open = SamplingParams {
        max_new_tokens: N,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let (reference, _) = drive_each(
        &mut ahead_worker(false),
        &[(prompt.clone(), open.clone(), None)],
    );
    let reference = &reference[0].0;
    assert_eq!(reference.len(), N);
    let beside = SamplingParams {
        max_new_tokens: N + 2,
        ..open.clone()
    };
    let compare = |sync: &mut ModelWorker, ahead: &mut ModelWorker, params: SamplingParams| {
        let requests = vec![
            (prompt.clone(), params, conversation(1)),
            (other.clone(), beside.clone(), conversation(2)),
        ];
        let expected = drive_each(sync, &requests);
        let launched = ahead.ahead_launched;
        let got = drive_each(ahead, &requests);
        assert!(ahead.ahead_launched > launched);
        assert_eq!(got, expected, "launching ahead changed a reply or a cache");
        got.0[0].clone()
    };
    // One pair of workers for every run: each run after the first also resumes the
    // conversations' caches as the last left them.
    let (mut sync, mut ahead) = (ahead_worker(false), ahead_worker(true));
    let mut stop_strings = 0;
    for k in 0..N {
        // The token limit.
        let limited = SamplingParams {
            max_new_tokens: k + 1,
            ..open.clone()
        };
        let (tokens, reason) = compare(&mut sync, &mut ahead, limited);
        assert_eq!(tokens, reference[..=k], "limit {}", k + 1);
        assert_eq!(reason, StopReason::Length);

        // A stop string: the text of token k (the reply ends where it first appears).
        let text = &reference[k].1;
        if !text.trim().is_empty() {
            stop_strings += 1;
            let stopped = SamplingParams {
                stop_strings: vec![text.clone()],
                ..open.clone()
            };
            let (tokens, reason) = compare(&mut sync, &mut ahead, stopped);
            assert!(
                matches!(reason, StopReason::StopString(_)),
                "stop string {text:?}: {reason:?}"
            );
            assert!(
                tokens.len() <= k + 1,
                "a token past the stop {text:?}: {tokens:?}"
            );
            let sent: String = tokens.iter().map(|t| t.1.as_str()).collect();
            assert!(!sent.contains(text.as_str()), "the stop string was sent");
        }

        // The end of generation: token k is made the model's end-of-generation token.
        // (The runs above ignore it, so the workers keep this tokenizer.)
        let eos = reference[k].0;
        let tokenizer = tokenizer_ending_at(eos);
        sync.tokenizer = Arc::clone(&tokenizer);
        ahead.tokenizer = tokenizer;
        let until_eos = SamplingParams {
            ignore_eos: false,
            ..open.clone()
        };
        let (tokens, reason) = compare(&mut sync, &mut ahead, until_eos);
        let first = reference.iter().position(|t| t.0 == eos).unwrap_or(k);
        assert_eq!(
            reason,
            StopReason::EndOfGeneration,
            "end of generation at {k}"
        );
        let ids: Vec<u32> = tokens.iter().map(|t| t.0).collect();
        let expected: Vec<u32> = reference[..first].iter().map(|t| t.0).collect();
        assert_eq!(ids, expected, "end of generation at {k}");
    }
    assert!(stop_strings >= N / 2, "{stop_strings} stop strings tried");
}

/// SmolLM2's tokenizer, ending generation at `eos` too (besides its own end-of-turn tokens).
fn tokenizer_ending_at(eos: u32) -> Arc<Tokenizer> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut real = GgufSource::open(&path).expect("run ./scripts/fetch-model.sh");
    real.metadata.insert(
        "tokenizer.ggml.eos_token_id".into(),
        smolchat_gguf::Value::U32(eos),
    );
    let tokenizer = Tokenizer::from_gguf(&real).expect("tokenizer");
    assert!(tokenizer.is_eog(eos));
    Arc::new(tokenizer)
}

/// A worker with `blocks` KV blocks keeping evicted and idle conversations in a spill tier in
/// `dir` (for the model identity `model`).
fn spilling_worker(blocks: usize, dir: &std::path::Path, model: &str) -> ModelWorker {
    let (tier, _) = crate::spill::SpillTier::open(dir, 1 << 30, model).expect("spill tier");
    worker_with_kv(Some(blocks)).with_spill(tier, std::time::Duration::from_secs(30))
}

/// The generated tokens of a run.
fn tokens_of(events: &[GenEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            GenEvent::Token { token, .. } => Some(*token),
            _ => None,
        })
        .collect()
}

/// A conversation evicted to make room comes back from the spill tier: its next turn computes
/// only what is new, and the reply is the one computed from nothing. An admin's eviction keeps
/// it on disk too, an idle one is written before it is evicted, a restart finds the files of
/// the same model (not another's), and deleting the conversation deletes its file.
#[test]
fn evicted_conversations_come_back_from_the_spill_tier() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = spilling_worker(3, dir.path(), "model-a");
    let prompt_a: Vec<u32> = (100..120).collect();
    let prompt_b: Vec<u32> = (200..220).collect();
    let a = run(&mut w, 1, conversation(2), prompt_a.clone());
    // B needs a's blocks: a's cache goes to the tier.
    run(&mut w, 2, conversation(3), prompt_b.clone());
    assert_eq!(w.evictions, 1);
    w.spill.as_mut().expect("tier").flush();
    let tier = w.spill.as_ref().expect("tier");
    assert!(tier.contains(Uuid::from_u128(2)) && tier.writes == 1);

    // A's next turn: its prompt, its reply, a new message.
    let mut turn2 = prompt_a.clone();
    turn2.extend(tokens_of(&a));
    turn2.extend(300..304);
    let again = run(&mut w, 3, conversation(2), turn2.clone());
    assert_eq!(
        cached(&again),
        22,
        "the first turn's 20 + 2 fed replies came back"
    );
    let fresh = run(&mut worker_with_kv(Some(3)), 9, None, turn2.clone());
    assert_eq!(tokens_of(&again), tokens_of(&fresh));
    assert_eq!(w.spill.as_ref().map(|t| t.restores), Some(1));

    // An admin's eviction writes it; a restart (another worker over the same files) restores
    // it.
    assert!(w.evict_to_disk(Uuid::from_u128(2)));
    drop(w);
    let mut w = spilling_worker(3, dir.path(), "model-a");
    let mut turn3 = turn2.clone();
    turn3.extend(400..403);
    let back = run(&mut w, 5, conversation(2), turn3.clone());
    assert!(
        cached(&back) > 20,
        "restored after a restart: {}",
        cached(&back)
    );
    let fresh = run(&mut worker_with_kv(Some(3)), 9, None, turn3);
    assert_eq!(tokens_of(&back), tokens_of(&fresh));

    // Deleting a conversation deletes its file.
    run(&mut w, 6, conversation(4), (500..510).collect());
    assert!(w.evict_to_disk(Uuid::from_u128(4)));
    w.spill.as_mut().expect("tier").flush();
    let file = |n: u128| dir.path().join(format!("{}.kv", Uuid::from_u128(n)));
    assert!(file(4).exists());
    assert!(w.forget_conversation(Uuid::from_u128(4)));
    assert!(!file(4).exists());

    // A torn file is not used: the turn computes its prompt, with the same reply.
    run(&mut w, 7, conversation(5), (600..620).collect());
    assert!(w.evict_to_disk(Uuid::from_u128(5)));
    w.spill.as_mut().expect("tier").flush();
    let mut bytes = std::fs::read(file(5)).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(file(5), bytes).expect("write");
    let torn = run(&mut w, 8, conversation(5), (600..625).collect());
    assert_eq!(cached(&torn), 0);
    let fresh = run(&mut worker_with_kv(Some(3)), 9, None, (600..625).collect());
    assert_eq!(tokens_of(&torn), tokens_of(&fresh));
    assert!(!file(5).exists());

    // Idle: written while still in memory, once.
    w.spill_idle(std::time::Duration::ZERO);
    w.spill.as_mut().expect("tier").flush();
    let writes = w.spill.as_ref().map(|t| t.writes);
    assert!(file(2).exists());
    w.spill_idle(std::time::Duration::ZERO);
    w.spill.as_mut().expect("tier").flush();
    assert_eq!(w.spill.as_ref().map(|t| t.writes), writes, "written twice");

    // Another model (or KV settings) at the next start: its files are dropped.
    drop(w);
    let other = spilling_worker(3, dir.path(), "model-b");
    assert_eq!(other.spill.as_ref().map(|t| t.files()), Some(0));
    assert!(!file(2).exists());
}

/// Spilling while a step launched ahead is still in flight (the last replies ended a step
/// before it): the step is finished and voided first, the cache is written as the reply left
/// it, and the conversation resumes from it with the same reply.
#[test]
fn a_cache_is_spilled_after_the_step_launched_ahead() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tier, _) = crate::spill::SpillTier::open(dir.path(), 1 << 30, "m").expect("tier");
    let mut w = ahead_worker(true).with_spill(tier, std::time::Duration::from_secs(30));
    let prompt: Vec<u32> = (500..530).collect();
    let params = SamplingParams {
        max_new_tokens: 6,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let (replies, caches) =
        drive_each(&mut w, &[(prompt.clone(), params.clone(), conversation(7))]);
    assert!(w.ahead_launched > 0);
    w.spill_idle(std::time::Duration::ZERO);
    assert!(!w.engine.in_flight());
    w.spill.as_mut().expect("tier").flush();
    assert!(w
        .spill
        .as_ref()
        .is_some_and(|t| t.contains(Uuid::from_u128(7))));
    // The file holds what the cache held after the reply (the voided row cut back).
    let snapshot = w
        .spill
        .as_mut()
        .and_then(|t| t.take(Uuid::from_u128(7)).expect("take"))
        .expect("a snapshot");
    assert_eq!(snapshot.tokens, caches[0]);
    assert_eq!(snapshot.tokens.len(), prompt.len() + replies[0].0.len() - 1);
}

/// The summary a request's events end with.
fn summary(events: &[GenEvent]) -> GenSummary {
    events
        .iter()
        .find_map(|e| match e {
            GenEvent::Finished(s) => Some(s.clone()),
            _ => None,
        })
        .expect("finished")
}

/// Registers a greedy request of `prompt` in `key` with the batcher and the worker, as the
/// scheduler does; returns its id and events.
fn submit_keyed(
    w: &mut ModelWorker,
    b: &mut super::super::batcher::Batcher,
    key: Option<Uuid>,
    prompt: Vec<u32>,
) -> (RequestId, mpsc::UnboundedReceiver<GenEvent>) {
    let id = b.submit(key, prompt.len(), None).expect("submit");
    let (tx, rx) = mpsc::unbounded_channel();
    let params = SamplingParams {
        max_new_tokens: 4,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    w.active.insert(
        id,
        Active::new(
            GenerationRequest {
                cache_key: key,
                ..GenerationRequest::anonymous(prompt, params, tx)
            },
            Instant::now(),
        ),
    );
    (id, rx)
}

/// Plans and runs steps until the batcher has nothing left (at most `max`); returns the plans.
fn step_until_idle(
    w: &mut ModelWorker,
    b: &mut super::super::batcher::Batcher,
    max: usize,
) -> Vec<StepPlan> {
    let mut plans = Vec::new();
    while let Some(plan) = b.plan() {
        plans.push(plan.clone());
        let report = w.step(plan);
        b.apply(&report.items);
        b.set_kv_free_blocks(report.kv_free_blocks);
        assert!(plans.len() <= max, "still busy after {max} steps");
    }
    plans
}

fn drain(rx: &mut mpsc::UnboundedReceiver<GenEvent>) -> Vec<GenEvent> {
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e);
    }
    events
}

fn draft(conversation: u128, prompt: &[u32]) -> crate::warm::Draft {
    crate::warm::Draft {
        conversation: Uuid::from_u128(conversation),
        user: Some(format!("user-{conversation}")),
        prompt: prompt.to_vec(),
    }
}

/// Warm before send: a typed draft is computed into its conversation's cache in steps with
/// nothing else (64-token chunks), generating nothing; the message sent afterwards computes
/// only its changed tail, says so in its summary, and gets the reply computed from nothing.
#[test]
fn a_typed_draft_is_warmed_in_spare_steps_and_its_send_computes_only_the_tail() {
    let mut w = worker();
    let mut b = test_batcher(&w);
    let typed: Vec<u32> = (100..250).collect();
    b.offer_draft(draft(7, &typed)).expect("offered");
    let plans = step_until_idle(&mut w, &mut b, 10);
    // 150 tokens in chunks of 64: three steps, and no token drawn.
    assert_eq!(plans.len(), 3, "{plans:?}");
    assert!(plans.iter().all(|p| p.decode.is_empty()));
    let slot = w.caches.get(&CacheKey::Conversation(Uuid::from_u128(7)));
    let cached_now = slot.and_then(|s| w.engine.cached_tokens(s.seq).ok());
    assert_eq!(cached_now, Some(&typed[..]));
    assert!(w.active.is_empty());
    let stats = b.warm_stats();
    assert_eq!((stats.started, stats.completed, stats.tokens), (1, 1, 150));

    // The message as sent: the last word changed.
    let mut sent = typed[..140].to_vec();
    sent.extend(300..306);
    let (_, mut rx) = submit_keyed(&mut w, &mut b, conversation(7), sent.clone());
    step_until_idle(&mut w, &mut b, 20);
    let events = drain(&mut rx);
    let s = summary(&events);
    assert_eq!(
        (s.cached_tokens, s.warmed_tokens, s.restored_tokens),
        (140, 140, 0)
    );
    let fresh = run(&mut worker(), 1, None, sent);
    assert_eq!(tokens_of(&events)[..3], tokens_of(&fresh)[..]);
}

/// A reply never waits behind a draft: a draft being computed when another user's request
/// arrives is cancelled in the plan that admits it, keeping what it computed, and resumes
/// when the worker is idle again; a send in the draft's own conversation takes the cache the
/// draft filled so far.
#[test]
fn a_reply_interrupts_a_draft_and_a_send_takes_what_it_computed() {
    let mut w = worker();
    let mut b = test_batcher(&w);
    let typed: Vec<u32> = (100..300).collect();
    b.offer_draft(draft(8, &typed)).expect("offered");
    let first = b.plan().expect("a draft step");
    let warm_id = first.warm_start.as_ref().map(|s| s.0).expect("started");
    let report = w.step(first);
    b.apply(&report.items);

    // Another user's request: the draft ends in the plan that admits it.
    let other: Vec<u32> = (500..520).collect();
    let (other_id, mut rx) = submit_keyed(&mut w, &mut b, conversation(9), other.clone());
    let plan = b.plan().expect("a step");
    assert_eq!(plan.cancel, vec![warm_id]);
    assert_eq!(plan.prefill.first().map(|p| p.0), Some(other_id));
    assert!(plan.prefill.iter().all(|p| p.0 != warm_id));
    let report = w.step(plan);
    b.apply(&report.items);
    let kept = |w: &ModelWorker| {
        w.caches
            .get(&CacheKey::Conversation(Uuid::from_u128(8)))
            .and_then(|s| w.engine.cached_tokens(s.seq).ok())
            .map_or(0, <[u32]>::len)
    };
    assert_eq!(kept(&w), 64, "the draft keeps its first chunk");
    // No draft work while the reply runs; then the draft resumes where it was.
    let plans = step_until_idle(&mut w, &mut b, 30);
    let reply_steps = plans
        .iter()
        .take_while(|p| p.decode.contains(&other_id))
        .count();
    assert!(plans[..reply_steps].iter().all(|p| p.prefill.is_empty()));
    assert!(plans[reply_steps..].iter().all(|p| p.decode.is_empty()));
    assert_eq!(kept(&w), 200);
    let fresh = run(&mut worker(), 1, None, other);
    assert_eq!(tokens_of(&drain(&mut rx))[..3], tokens_of(&fresh)[..]);
    assert_eq!(b.warm_stats().interrupted, 1);

    // The owner sends while a newer draft is half computed: the send takes its cache.
    let mut longer = typed.clone();
    longer.extend(600..700);
    b.offer_draft(draft(8, &longer)).expect("offered");
    let plan = b.plan().expect("a draft step");
    let report = w.step(plan);
    b.apply(&report.items);
    assert_eq!(kept(&w), 264);
    let mut sent = longer[..280].to_vec();
    sent.push(900);
    let (_, mut rx) = submit_keyed(&mut w, &mut b, conversation(8), sent.clone());
    step_until_idle(&mut w, &mut b, 30);
    let s = summary(&drain(&mut rx));
    assert_eq!(s.cached_tokens, 264);
    assert_eq!(s.warmed_tokens, 264);
    // Moot after the send: not warmed again.
    assert_eq!(b.warm_stats().waiting, 0);
    assert_eq!(kept(&w), 281 + 4 - 1);
}

/// A conversation restored from the spill tier, for every KV type: the reply equals the one
/// computed from nothing and says how many of its prompt tokens came from the tier; an edited
/// history keeps only the common prefix, and a truncated file falls back to computing, with
/// the reply unchanged either way.
#[test]
fn restored_conversations_reply_as_computed_from_nothing_for_every_kv_type() {
    for kv_type in KvType::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        let (spec, tokenizer) = tiny_with_tokenizer();
        let tokenizer = Arc::new(tokenizer);
        let make = |dir: &std::path::Path| {
            let mut src = synthetic::build(&spec).expect("build");
            let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
            let kv = smolchat_engine::kv::KvLayout::new(&model.config, kv_type);
            let options = KvOptions {
                kv_type,
                budget_bytes: Some(8 * kv.bytes_per_block()),
            };
            let engine = Engine::with_kv(model, options).expect("engine");
            let (tier, _) =
                crate::spill::SpillTier::open(dir, 1 << 30, &format!("m-{kv_type}")).expect("tier");
            ModelWorker::new(engine, Arc::clone(&tokenizer), 2048)
                .with_spill(tier, std::time::Duration::from_secs(30))
        };
        let fresh_reply = |prompt: Vec<u32>| {
            let mut w = make(tempfile::tempdir().expect("tempdir").path());
            tokens_of(&run(&mut w, 99, None, prompt))
        };
        let mut w = make(dir.path());
        let prompt: Vec<u32> = (100..140).collect();
        let first = run(&mut w, 1, conversation(2), prompt.clone());
        let mut turn2 = prompt.clone();
        turn2.extend(tokens_of(&first));
        turn2.extend(300..305);
        let warm = run(&mut w, 2, conversation(2), turn2.clone());
        assert!(w.evict_to_disk(Uuid::from_u128(2)));
        // Its page is opened: the file is read ahead off the model thread.
        w.spill.as_mut().expect("tier").flush();
        w.prefetch(Uuid::from_u128(2));
        assert_eq!(w.spill.as_ref().map(|t| t.preloads), Some(1), "{kv_type}");
        let restored = run(&mut w, 3, conversation(2), turn2.clone());
        let s = summary(&restored);
        // All but the last prompt token (computed for its logits), as on the device.
        assert_eq!(s.cached_tokens, turn2.len() - 1, "{kv_type}");
        assert_eq!(s.restored_tokens, s.cached_tokens, "{kv_type}");
        assert_eq!(tokens_of(&restored), tokens_of(&warm), "{kv_type}");
        assert_eq!(
            tokens_of(&restored),
            fresh_reply(turn2.clone()),
            "{kv_type}"
        );

        // An edited history (its 10th token changed): only the first 10 positions are kept.
        assert!(w.evict_to_disk(Uuid::from_u128(2)));
        let mut edited = turn2.clone();
        edited[10] = 777;
        let back = run(&mut w, 4, conversation(2), edited.clone());
        assert_eq!(cached(&back), 10, "{kv_type}");
        assert_eq!(tokens_of(&back), fresh_reply(edited.clone()), "{kv_type}");

        // A truncated file: computed again, same reply.
        assert!(w.evict_to_disk(Uuid::from_u128(2)));
        w.spill.as_mut().expect("tier").flush();
        let file = dir.path().join(format!("{}.kv", Uuid::from_u128(2)));
        let bytes = std::fs::read(&file).expect("read");
        std::fs::write(&file, &bytes[..bytes.len() / 2]).expect("write");
        let mut turn3 = edited;
        turn3.extend(400..403);
        let cut = run(&mut w, 5, conversation(2), turn3.clone());
        assert_eq!(cached(&cut), 0, "{kv_type}");
        assert_eq!(tokens_of(&cut), fresh_reply(turn3), "{kv_type}");
    }
}

/// 64 conversations cycling through a KV cache that holds 4: the tier stays within its byte
/// budget throughout, and each conversation that comes back replies as computed from nothing
/// whether its file was still there or had been dropped for the budget.
#[test]
fn the_spill_budget_holds_under_64_conversations_cycling_through_4() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 4 conversations of 40 tokens (3 blocks each, and one more to grow) in 16 blocks.
    let probe = spilling_worker(16, dir.path(), "m");
    let block = probe.engine.kv_block_bytes() as u64;
    drop(probe);
    // Room for about 10 files of 3 blocks (compression only makes room for more).
    let budget = 30 * block;
    let (tier, _) = crate::spill::SpillTier::open(dir.path(), budget, "m").expect("tier");
    let mut w = worker_with_kv(Some(16)).with_spill(tier, std::time::Duration::from_secs(30));
    let prompt = |c: u32| -> Vec<u32> { (0..40).map(|i| 100 + (c * 41 + i) % 2000).collect() };
    let mut fresh = worker_with_kv(Some(16));
    let mut id = 0;
    // All 64 once, then every eighth again (its file kept or dropped for the budget).
    for round in 0..2 {
        for c in (0..64u32).filter(|c| round == 0 || c % 8 == 0) {
            id += 1;
            let events = run(&mut w, id, conversation(1000 + u128::from(c)), prompt(c));
            let tier = w.spill.as_mut().expect("tier");
            tier.flush();
            assert!(
                tier.bytes() <= budget,
                "round {round}, conversation {c}: {} bytes in a budget of {budget}",
                tier.bytes()
            );
            if round == 1 {
                let from_nothing = run(&mut fresh, u64::from(c) + 1, None, prompt(c));
                assert_eq!(
                    tokens_of(&events),
                    tokens_of(&from_nothing),
                    "conversation {c}"
                );
            }
        }
    }
    let tier = w.spill.as_ref().expect("tier");
    assert!(tier.writes >= 60, "{} written", tier.writes);
    assert!(
        tier.files() >= 2 && tier.files() < 64,
        "{} files",
        tier.files()
    );
}

/// A typed draft takes only free KV blocks: with the cache full of another conversation's idle
/// cache, it ends (keeping what it computed) rather than evict that cache.
#[test]
fn a_typed_draft_never_evicts_another_conversations_cache() {
    // 8 blocks of 16 positions: the idle conversation holds 5 (70 tokens and its reply).
    let mut w = worker_with_kv(Some(8));
    let idle: Vec<u32> = (100..170).collect();
    run(&mut w, 1, conversation(1), idle);
    let held = |w: &ModelWorker, c: u128| {
        w.caches
            .get(&CacheKey::Conversation(Uuid::from_u128(c)))
            .and_then(|s| w.engine.cached_tokens(s.seq).ok())
            .map_or(0, <[u32]>::len)
    };
    assert_eq!(held(&w, 1), 72);
    let mut b = test_batcher(&w);
    b.set_kv_free_blocks(w.kv_free_for_new_work());
    let typed: Vec<u32> = (300..400).collect();
    b.offer_draft(draft(2, &typed)).expect("offered");
    step_until_idle(&mut w, &mut b, 10);
    assert_eq!(held(&w, 1), 72, "the idle conversation's cache was evicted");
    assert_eq!(w.evictions, 0);
    // The draft kept what fitted the free blocks (3 of them: 48 positions).
    assert_eq!(held(&w, 2), 48);
    assert!(w.active.is_empty());
}
