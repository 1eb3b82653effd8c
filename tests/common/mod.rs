//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod browser_client;
pub mod chromium;
pub mod group;
pub mod nginx;
pub mod pdf;
pub mod pg;
pub mod server;

use std::path::PathBuf;

use smolchat_engine::{Engine, KvOptions, KvType, Model};
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
