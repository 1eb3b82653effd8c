//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod browser_client;
pub mod chromium;
pub mod group;
pub mod nginx;
pub mod pdf;
pub mod pg;
pub mod server;

use std::path::{Path, PathBuf};
use std::process::Command;

use smolchat_engine::{Engine, KvOptions, KvType, LogitsMode, Model, SeqStep};
use smolchat_gguf::GgufSource;

pub fn crate_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `tests/data/<name>`: llama.cpp's reference outputs kept in the repository (see its README).
pub fn reference(name: &str) -> PathBuf {
    crate_root().join("tests/data").join(name)
}

/// The embedded default model, fetched by `scripts/fetch-model.sh`.
pub fn smollm2_path() -> PathBuf {
    let p = crate_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run ./scripts/fetch-model.sh",
        p.display()
    );
    p
}

pub fn load_engine(path: &std::path::Path) -> Engine {
    let mut src = GgufSource::open(path).expect("open gguf");
    let model = Model::load(&mut src, &mut |_, _| {}).expect("load model");
    Engine::new(model)
}

/// Loads a model with its KV cache stored as `kv_type` (default budget).
pub fn load_engine_kv(path: &std::path::Path, kv_type: KvType) -> Engine {
    let mut src = GgufSource::open(path).expect("open gguf");
    let model = Model::load(&mut src, &mut |_, _| {}).expect("load model");
    Engine::with_kv(
        model,
        KvOptions {
            kv_type,
            ..KvOptions::default()
        },
    )
    .expect("engine")
}

/// The CPU engine on `src`, the yardstick the other tiers are held to.
pub fn cpu_engine(mut src: GgufSource) -> Engine {
    let model = Model::load(&mut src, &mut |_, _| {}).expect("model");
    Engine::with_kv(model, KvOptions::default()).expect("engine")
}

/// The logits of every position of `tokens`, prefilled at once in a fresh sequence.
pub fn all_logits(engine: &mut Engine, tokens: &[u32]) -> Vec<f32> {
    let seq = engine.create_sequence();
    let out = engine
        .step(&[SeqStep {
            seq,
            tokens,
            logits: LogitsMode::All,
        }])
        .expect("step");
    engine.free_sequence(seq);
    out.into_iter().next().flatten().expect("logits")
}

/// `n` greedy tokens after `prompt`, prefilled in chunks of `chunks` (then the rest at once).
pub fn greedy(engine: &mut Engine, prompt: &[u32], chunks: &[usize], n: usize) -> Vec<u32> {
    let seq = engine.create_sequence();
    let mut at = 0;
    let mut last = Vec::new();
    for &size in chunks.iter().chain(std::iter::repeat(&prompt.len())) {
        if at >= prompt.len() {
            break;
        }
        let end = (at + size).min(prompt.len());
        let out = engine
            .step(&[SeqStep {
                seq,
                tokens: &prompt[at..end],
                logits: LogitsMode::Last,
            }])
            .expect("prefill");
        last = out.into_iter().next().flatten().expect("logits");
        at = end;
    }
    let mut tokens = Vec::new();
    for _ in 0..n {
        let t = argmax(&last) as u32;
        tokens.push(t);
        let out = engine
            .step(&[SeqStep {
                seq,
                tokens: &[t],
                logits: LogitsMode::Last,
            }])
            .expect("decode");
        last = out.into_iter().next().flatten().expect("logits");
    }
    engine.free_sequence(seq);
    tokens
}

/// The largest difference between two rows of logits of one length.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("json")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Reads a float32 .npy file into (shape, data).
pub fn read_npy(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    let t = candle_core::Tensor::read_npy(path).expect("read npy");
    let shape = t.dims().to_vec();
    let data = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("f32 npy");
    (shape, data)
}

pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// `target/openai-venv` with the official `openai`, `ollama` and `anthropic` packages; created (and the
/// packages installed from PyPI) only when importing them does not already work there.
pub fn openai_venv() -> PathBuf {
    let venv = crate_root().join("target/openai-venv");
    let python = venv.join("bin/python");
    let works = |python: &Path| {
        Command::new(python)
            .args(["-c", "import openai, ollama, anthropic, jsonschema"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !works(&python) {
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("run python3 -m venv");
        assert!(status.success(), "python3 -m venv failed");
        let status = Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "openai",
                "ollama",
                "anthropic",
                "jsonschema",
            ])
            .status()
            .expect("run pip");
        assert!(
            status.success(),
            "pip install openai ollama anthropic failed"
        );
        assert!(
            works(&python),
            "openai, ollama or anthropic still not importable"
        );
    }
    python
}
