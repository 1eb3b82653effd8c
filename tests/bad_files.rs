//! Every way a model file can be wrong gives its own error, never a panic.

mod common;

use std::io::Write;
use std::path::Path;

use smolchat_engine::synthetic::{SyntheticModel, SyntheticSpec, TypeMix};
use smolchat_engine::{EngineError, Model};
use smolchat_gguf::{GgmlDType, GgufError, GgufSource, Value};

fn load(path: &Path) -> Result<Model, EngineError> {
    let mut src = GgufSource::open(path)?;
    Model::load(&mut src, &mut |_, _| {})
}

fn tiny() -> SyntheticModel {
    SyntheticModel::generate(
        &SyntheticSpec::tiny("llama").with_type_mix(TypeMix::Uniform(GgmlDType::Q8_0)),
    )
    .expect("generate")
}

#[test]
fn not_a_gguf_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, bytes) in [
        ("text.gguf", &b"hello, this is not a model"[..]),
        ("empty.gguf", &b""[..]),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).expect("write");
        match load(&p) {
            Err(e @ EngineError::Gguf(GgufError::NotGguf { .. })) => {
                assert!(e.to_string().contains(name), "message names the file: {e}")
            }
            Err(e) => panic!("{name}: wrong error {e}"),
            Ok(_) => panic!("{name}: loaded"),
        }
    }
    let missing = dir.path().join("nope.gguf");
    assert!(matches!(
        load(&missing),
        Err(EngineError::Gguf(GgufError::Io { .. }))
    ));
}

#[test]
fn truncated_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let full = dir.path().join("full.gguf");
    tiny().write_gguf(&full).expect("write");
    let bytes = std::fs::read(&full).expect("read");
    // Cut inside the header, and inside the tensor data.
    for cut in [20usize, 200, bytes.len() / 2, bytes.len() - 1] {
        let p = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).expect("write");
        match load(&p) {
            Err(e @ EngineError::Gguf(GgufError::Corrupt { .. })) => {
                assert!(e.to_string().contains("truncated or corrupt"), "{e}")
            }
            Err(e) => panic!("cut at {cut}: wrong error {e}"),
            Ok(_) => panic!("cut at {cut}: loaded"),
        }
    }
}

#[test]
fn unsupported_architecture() {
    let mut m = tiny();
    m.set_architecture("qwen2");
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("qwen.gguf");
    m.write_gguf(&p).expect("write");
    match load(&p) {
        Err(EngineError::UnsupportedArchitecture(a)) => assert_eq!(a, "qwen2"),
        other => panic!("wrong result: {:?}", other.err()),
    }
}

#[test]
fn missing_tensor_and_missing_key() {
    let mut m = tiny();
    m.tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    match Model::load(&mut m.into_source(), &mut |_, _| {}) {
        Err(EngineError::Gguf(GgufError::MissingTensor(n))) => assert_eq!(n, "blk.1.ffn_up.weight"),
        other => panic!("wrong result: {:?}", other.err()),
    }
    let mut m = tiny();
    m.metadata.retain(|(k, _)| k != "llama.block_count");
    match Model::load(&mut m.into_source(), &mut |_, _| {}) {
        Err(e @ EngineError::Gguf(GgufError::MissingKey(_))) => {
            assert!(e.to_string().contains("llama.block_count"), "{e}")
        }
        other => panic!("wrong result: {:?}", other.err()),
    }
    // A block count the file's tensors do not back is refused before anything is reserved for
    // it (a fuzzed file claiming billions of layers used to abort on the allocation).
    for count in [0u32, 5, u32::MAX] {
        let mut m = tiny();
        for (k, v) in m.metadata.iter_mut() {
            if k == "llama.block_count" {
                *v = Value::U32(count);
            }
        }
        match Model::load(&mut m.into_source(), &mut |_, _| {}) {
            Err(e @ EngineError::Gguf(GgufError::BadKey { .. })) => {
                assert!(e.to_string().contains("llama.block_count"), "{e}")
            }
            other => panic!("block_count {count}: wrong result: {:?}", other.err()),
        }
    }
    // A key of the wrong type names the key too.
    let mut m = tiny();
    for (k, v) in m.metadata.iter_mut() {
        if k == "llama.embedding_length" {
            *v = Value::String("wide".into());
        }
    }
    match Model::load(&mut m.into_source(), &mut |_, _| {}) {
        Err(e @ EngineError::Gguf(GgufError::BadKey { .. })) => {
            assert!(e.to_string().contains("llama.embedding_length"), "{e}")
        }
        other => panic!("wrong result: {:?}", other.err()),
    }
}

#[test]
fn wrong_tensor_shape() {
    let mut m = tiny();
    // Swap rows/cols of a non-square matrix so the byte count still matches.
    for t in m.tensors.iter_mut() {
        if t.name == "blk.0.ffn_up.weight" {
            t.dims = vec![t.dims[1], t.dims[0]];
        }
    }
    match Model::load(&mut m.into_source(), &mut |_, _| {}) {
        Err(e @ EngineError::BadShape { .. }) => assert!(e.to_string().contains("ffn_up"), "{e}"),
        other => panic!("wrong result: {:?}", other.err()),
    }
}

/// A hand-written GGUF v3 with one tensor of type IQ2_XXS (id 16), which we cannot run.
#[test]
fn unsupported_tensor_type() {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // tensors
    b.extend_from_slice(&1u64.to_le_bytes()); // metadata keys
    let key = b"general.architecture";
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(key);
    b.extend_from_slice(&8u32.to_le_bytes()); // string
    b.extend_from_slice(&5u64.to_le_bytes());
    b.extend_from_slice(b"llama");
    let name = b"token_embd.weight";
    b.extend_from_slice(&(name.len() as u64).to_le_bytes());
    b.extend_from_slice(name);
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&256u64.to_le_bytes());
    b.extend_from_slice(&4u64.to_le_bytes());
    b.extend_from_slice(&16u32.to_le_bytes()); // IQ2_XXS
    b.extend_from_slice(&0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend(std::iter::repeat_n(0u8, 4096));
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("iq2.gguf");
    std::fs::File::create(&p)
        .and_then(|mut f| f.write_all(&b))
        .expect("write");
    match GgufSource::open(&p) {
        Err(e @ GgufError::UnsupportedTensorType { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("token_embd.weight") && msg.contains("IQ2_XXS"),
                "{msg}"
            );
        }
        other => panic!("wrong result: {:?}", other.err()),
    }
}

#[test]
fn the_real_default_model_inspects_cleanly() {
    let src = GgufSource::open(&common::smollm2_path()).expect("open");
    assert_eq!(src.tensors.len(), 272);
    assert_eq!(src.string("general.architecture").expect("arch"), "llama");
}
