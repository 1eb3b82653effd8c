//! Synthetic models: what they write is what llama.cpp would write, and it reads back intact.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{gguf_file, QStorage, QTensor};
use candle_core::{Device, Tensor};
use smolchat_engine::synthetic::{
    self, q4km_more_bits, rename_architecture, write_source_as_gguf, SyntheticModel, SyntheticSpec,
    TypeMix, WeightFill,
};
use smolchat_engine::{Architecture, Engine, EngineError, ModelConfig, SeqStep};
use smolchat_engine::{LogitsMode, Model};
use smolchat_gguf::{GgmlDType, GgufError, GgufSource, Value};

fn mixes() -> Vec<TypeMix> {
    vec![
        TypeMix::Uniform(GgmlDType::F32),
        TypeMix::Uniform(GgmlDType::Q8_0),
        TypeMix::Uniform(GgmlDType::Q4K),
        TypeMix::Q4KM,
    ]
}

fn u(src: &GgufSource, key: &str) -> usize {
    src.usize(key).unwrap()
}

/// All tensor bytes of a source, by name (drains a memory-backed source).
fn all_bytes(src: &mut GgufSource) -> HashMap<String, Vec<u8>> {
    let names: Vec<String> = src.tensors.keys().cloned().collect();
    names
        .into_iter()
        .map(|n| {
            let t = src.take_tensor(&n).unwrap();
            (n, t.data.as_slice().to_vec())
        })
        .collect()
}

fn check_reopened(spec: &SyntheticSpec, path: &Path) {
    let mut src = GgufSource::open(path).unwrap();
    let a = &spec.arch;
    assert_eq!(src.string("general.architecture").unwrap(), a);
    assert!(src.string("general.name").unwrap().contains(a));
    assert_eq!(u(&src, &format!("{a}.block_count")), spec.n_layers);
    assert_eq!(u(&src, &format!("{a}.embedding_length")), spec.hidden);
    assert_eq!(u(&src, &format!("{a}.feed_forward_length")), spec.ffn);
    assert_eq!(u(&src, &format!("{a}.attention.head_count")), spec.n_heads);
    assert_eq!(
        u(&src, &format!("{a}.attention.head_count_kv")),
        spec.n_kv_heads
    );
    assert_eq!(u(&src, &format!("{a}.context_length")), spec.context_length);
    assert_eq!(u(&src, &format!("{a}.vocab_size")), spec.vocab_size);
    assert_eq!(
        u(&src, &format!("{a}.rope.dimension_count")),
        spec.hidden / spec.n_heads
    );
    assert_eq!(
        src.f32(&format!("{a}.rope.freq_base")).unwrap(),
        spec.rope_theta
    );
    assert_eq!(
        src.f32(&format!("{a}.attention.layer_norm_rms_epsilon"))
            .unwrap(),
        spec.rms_eps
    );

    let plan = spec.tensor_plan().unwrap();
    let per_layer = 9;
    let expected_count = 2 + usize::from(!spec.tied_embeddings) + per_layer * spec.n_layers;
    assert_eq!(plan.len(), expected_count);
    assert_eq!(src.tensors.len(), expected_count);
    let (h, hd, f, v) = (
        spec.hidden,
        spec.hidden / spec.n_heads,
        spec.ffn,
        spec.vocab_size,
    );
    let expected_dims = |name: &str| -> Vec<usize> {
        let kind = name.trim_end_matches(".weight").rsplit('.').next().unwrap();
        match kind {
            "token_embd" | "output" => vec![v, h],
            "output_norm" | "attn_norm" | "ffn_norm" => vec![h],
            "attn_q" => vec![spec.n_heads * hd, h],
            "attn_k" | "attn_v" => vec![spec.n_kv_heads * hd, h],
            "attn_output" => vec![h, spec.n_heads * hd],
            "ffn_gate" | "ffn_up" => vec![f, h],
            "ffn_down" => vec![h, f],
            other => panic!("unexpected tensor kind {other}"),
        }
    };
    for p in &plan {
        let e = src
            .tensors
            .get(&p.name)
            .unwrap_or_else(|| panic!("{} missing", p.name));
        assert_eq!(e.dims, expected_dims(&p.name), "{}", p.name);
        assert_eq!(e.dims, p.dims, "{}", p.name);
        assert_eq!(e.dtype, p.dtype, "{}", p.name);
        assert_eq!(e.n_bytes, p.n_bytes(), "{}", p.name);
        let norm = p.name.ends_with("_norm.weight");
        match spec.type_mix {
            _ if norm => assert_eq!(e.dtype, GgmlDType::F32),
            TypeMix::Uniform(t) => assert_eq!(e.dtype, t, "{}", p.name),
            TypeMix::Q4KM => assert!(
                matches!(e.dtype, GgmlDType::Q4K | GgmlDType::Q6K),
                "{}",
                p.name
            ),
        }
    }
    for i in 0..spec.n_layers {
        for s in [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            assert!(src.tensors.contains_key(&format!("blk.{i}.{s}.weight")));
        }
    }
    assert_eq!(
        src.tensors.contains_key("output.weight"),
        !spec.tied_embeddings
    );

    // The file holds exactly the bytes of the in-memory build.
    let from_file = all_bytes(&mut src);
    let mut mem = synthetic::build(spec).unwrap();
    assert_eq!(from_file, all_bytes(&mut mem));

    // candle's own reader agrees on the directory.
    let mut f = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(content.tensor_infos.len(), expected_count);
    for p in &plan {
        let info = &content.tensor_infos[&p.name];
        assert_eq!(info.shape.dims(), p.dims.as_slice());
        assert_eq!(info.ggml_dtype, p.dtype);
    }
    assert_eq!(
        content.metadata["general.architecture"]
            .to_string()
            .unwrap(),
        a
    );
}

#[test]
fn tiny_files_reopen_with_llama_cpp_names_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "smollm3"] {
        for mix in mixes() {
            for tied in [true, false] {
                let spec = SyntheticSpec {
                    tied_embeddings: tied,
                    ..SyntheticSpec::tiny(arch).with_type_mix(mix)
                };
                let path = dir.path().join(format!("{arch}-{mix:?}-{tied}.gguf"));
                synthetic::write_gguf(&spec, &path).unwrap();
                check_reopened(&spec, &path);
            }
        }
    }
}

#[test]
fn engine_config_reads_synthetic_metadata() {
    let src = synthetic::build(&SyntheticSpec::tiny("smollm3")).unwrap();
    let c = ModelConfig::from_gguf(&src).unwrap();
    assert_eq!(c.arch, Architecture::SmolLm3);
    assert_eq!((c.n_layers, c.hidden, c.ffn), (4, 256, 512));
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 2, 64));
    assert_eq!(c.vocab_size, 512);
    assert_eq!(c.uses_rope, vec![true, true, true, false]);
    let src = synthetic::build(&SyntheticSpec::tiny("llama")).unwrap();
    assert_eq!(
        ModelConfig::from_gguf(&src).unwrap().arch,
        Architecture::Llama
    );
}

#[test]
fn same_seed_same_bytes_and_arch_does_not_change_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Q4KM);
    let (a, b, c) = (
        dir.path().join("a.gguf"),
        dir.path().join("b.gguf"),
        dir.path().join("c.gguf"),
    );
    synthetic::write_gguf(&spec, &a).unwrap();
    synthetic::write_gguf(&spec, &b).unwrap();
    synthetic::write_gguf(&spec.clone().with_seed(spec.seed + 1), &c).unwrap();
    let (a, b, c) = (
        std::fs::read(a).unwrap(),
        std::fs::read(b).unwrap(),
        std::fs::read(c).unwrap(),
    );
    assert_eq!(a, b);
    assert_eq!(a.len(), c.len());
    assert_ne!(a, c);

    // The same spec under another architecture name: identical tensors.
    let smol = all_bytes(&mut synthetic::build(&spec).unwrap());
    let llama = all_bytes(&mut synthetic::build(&spec.clone().with_arch("llama")).unwrap());
    assert_eq!(smol, llama);
    // And no two tensors of one model are the same bytes (each has its own seed).
    let distinct: std::collections::HashSet<&Vec<u8>> = smol
        .iter()
        .filter(|(n, _)| !n.ends_with("_norm.weight") || n.starts_with("blk.0"))
        .map(|(_, v)| v)
        .collect();
    assert_eq!(
        distinct.len(),
        smol.iter()
            .filter(|(n, _)| !n.ends_with("_norm.weight") || n.starts_with("blk.0"))
            .count()
    );
}

#[test]
fn quantized_builds_are_quantizations_of_the_f32_build() {
    let f32_spec = SyntheticSpec::tiny("llama");
    let name = "blk.1.ffn_up.weight";
    for t in [GgmlDType::Q8_0, GgmlDType::Q4K] {
        let raw = synthetic::build(&f32_spec)
            .unwrap()
            .take_tensor(name)
            .unwrap();
        let floats: Vec<f32> = raw
            .data
            .as_slice()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let tensor = Tensor::from_vec(floats, (512, 256), &Device::Cpu).unwrap();
        let expected = QTensor::quantize(&tensor, t).unwrap();
        let mut q = synthetic::build(&f32_spec.clone().with_type_mix(TypeMix::Uniform(t))).unwrap();
        assert_eq!(
            q.take_tensor(name).unwrap().data.as_slice(),
            &*expected.data().unwrap()
        );
    }
}

#[test]
fn q4km_more_bits_matches_llama_cpp() {
    let picked: Vec<usize> = (0..36).filter(|&i| q4km_more_bits(i, 36)).collect();
    assert_eq!(picked.len(), 18);
    assert_eq!(
        picked,
        vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
    );
    let tiny: Vec<usize> = (0..4).filter(|&i| q4km_more_bits(i, 4)).collect();
    assert_eq!(tiny, vec![2, 3]);
    // Untied: the output matrix is Q6_K and the input embedding Q4_K, as llama.cpp does.
    let spec = SyntheticSpec {
        tied_embeddings: false,
        ..SyntheticSpec::tiny("llama").with_type_mix(TypeMix::Q4KM)
    };
    assert_eq!(spec.dtype_for("output.weight"), GgmlDType::Q6K);
    assert_eq!(spec.dtype_for("token_embd.weight"), GgmlDType::Q4K);
    assert_eq!(spec.dtype_for("blk.0.attn_q.weight"), GgmlDType::Q4K);
    assert_eq!(spec.dtype_for("blk.3.attn_v.weight"), GgmlDType::Q6K);
    assert_eq!(spec.dtype_for("blk.1.ffn_down.weight"), GgmlDType::Q4K);
    assert_eq!(spec.dtype_for("blk.1.ffn_norm.weight"), GgmlDType::F32);
    let tied = SyntheticSpec::tiny("llama").with_type_mix(TypeMix::Q4KM);
    assert_eq!(tied.dtype_for("token_embd.weight"), GgmlDType::Q6K);
}

fn dequantize(dtype: GgmlDType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, dtype).unwrap();
    let q = QTensor::new(storage, (rows, cols)).unwrap();
    q.dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn random_blocks_dequantize_to_plausible_weights() {
    let types = [
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];
    for t in types {
        for fill in [WeightFill::RandomBlocks, WeightFill::Quantize] {
            let spec = SyntheticSpec {
                fill,
                ..SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Uniform(t))
            };
            let mut src = synthetic::build(&spec).unwrap();
            // ffn_down: [256, 512], so the target standard deviation is 1/sqrt(512).
            let raw = src.take_tensor("blk.0.ffn_down.weight").unwrap();
            let w = dequantize(t, 256, 512, raw.data.as_slice());
            assert!(w.iter().all(|x| x.is_finite()), "{t:?} {fill:?}");
            let (mean, std) = mean_std(&w);
            let target = 1.0 / 512f64.sqrt();
            assert!(
                std > 0.5 * target && std < 2.0 * target,
                "{t:?} {fill:?}: std {std} vs {target}"
            );
            assert!(mean.abs() < 0.1 * target, "{t:?} {fill:?}: mean {mean}");
            let norm = src.take_tensor("blk.0.attn_norm.weight").unwrap();
            let n = dequantize(GgmlDType::F32, 1, 256, norm.data.as_slice());
            assert!(n.iter().all(|x| (0.85..=1.15).contains(x)));
        }
    }
}

fn forward_logits(src: &mut GgufSource, tokens: &[u32]) -> Vec<f32> {
    let mut engine = Engine::new(Model::load(src, &mut |_, _| {}).unwrap());
    let seq = engine.create_sequence();
    let out = engine
        .step(&[SeqStep {
            seq,
            tokens,
            logits: LogitsMode::All,
        }])
        .unwrap();
    out.into_iter().next().flatten().unwrap()
}

#[test]
fn tiny_models_run_to_finite_logits() {
    let tokens = [1u32, 7, 300, 42, 511, 0, 9, 9];
    for arch in ["llama", "smollm3"] {
        for (mix, fill) in [
            (TypeMix::Uniform(GgmlDType::F32), WeightFill::Quantize),
            (TypeMix::Uniform(GgmlDType::Q8_0), WeightFill::Quantize),
            (TypeMix::Q4KM, WeightFill::Quantize),
            (TypeMix::Q4KM, WeightFill::RandomBlocks),
            (TypeMix::Uniform(GgmlDType::Q4_0), WeightFill::RandomBlocks),
        ] {
            let spec = SyntheticSpec {
                fill,
                ..SyntheticSpec::tiny(arch).with_type_mix(mix)
            };
            let logits = forward_logits(&mut synthetic::build(&spec).unwrap(), &tokens);
            assert_eq!(logits.len(), tokens.len() * spec.vocab_size);
            assert!(logits.iter().all(|x| x.is_finite()), "{arch} {mix:?}");
            let (_, std) = mean_std(&logits);
            // Logits of a useful size: neither collapsed nor exploding.
            assert!(std > 0.05 && std < 50.0, "{arch} {mix:?}: logit std {std}");
        }
    }
}

#[test]
fn invalid_specs_are_clear_errors() {
    // K-quant blocks of 256 do not fit rows of 64.
    let spec = SyntheticSpec {
        hidden: 64,
        ..SyntheticSpec::tiny("llama").with_type_mix(TypeMix::Uniform(GgmlDType::Q4K))
    };
    match synthetic::build(&spec) {
        Err(EngineError::Gguf(GgufError::BadKey { key, detail })) => {
            assert_eq!(key, "llama.embedding_length");
            assert!(detail.contains("256"), "{detail}");
        }
        other => panic!("{:?}", other.err()),
    }
    // But F32 at hidden 64 is fine.
    let spec = SyntheticSpec {
        hidden: 64,
        ffn: 128,
        ..SyntheticSpec::tiny("llama")
    };
    synthetic::build(&spec).unwrap();
    let spec = SyntheticSpec {
        n_kv_heads: 3,
        ..SyntheticSpec::tiny("llama")
    };
    assert!(matches!(
        synthetic::build(&spec),
        Err(EngineError::Gguf(GgufError::BadKey { .. }))
    ));
    let spec = SyntheticSpec {
        n_layers: 0,
        ..SyntheticSpec::tiny("llama")
    };
    assert!(synthetic::build(&spec).is_err());
    // Another architecture name is written as given, for testing the loader's refusal.
    let src = synthetic::build(&SyntheticSpec::tiny("qwen2")).unwrap();
    assert!(matches!(
        ModelConfig::from_gguf(&src),
        Err(EngineError::UnsupportedArchitecture(a)) if a == "qwen2"
    ));
}

fn fake_tokenizer_source(n: usize) -> GgufSource {
    let mut meta = HashMap::new();
    meta.insert(
        "general.architecture".to_string(),
        Value::String("llama".into()),
    );
    meta.insert(
        "tokenizer.ggml.model".to_string(),
        Value::String("gpt2".into()),
    );
    meta.insert(
        "tokenizer.ggml.tokens".to_string(),
        Value::Array((0..n).map(|i| Value::String(format!("t{i}"))).collect()),
    );
    meta.insert("tokenizer.ggml.eos_token_id".to_string(), Value::U32(2));
    meta.insert("llama.vocab_size".to_string(), Value::U32(n as u32));
    GgufSource::in_memory(meta, Vec::new())
}

#[test]
fn tokenizer_metadata_is_copied_and_sets_the_vocabulary() {
    let spec = SyntheticSpec::tiny("smollm3")
        .with_tokenizer_from(&fake_tokenizer_source(300))
        .unwrap();
    assert_eq!(spec.vocab_size, 300);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tok.gguf");
    synthetic::write_gguf(&spec, &path).unwrap();
    let src = GgufSource::open(&path).unwrap();
    assert_eq!(src.tensors["token_embd.weight"].dims, vec![300, 256]);
    assert_eq!(src.usize("smollm3.vocab_size").unwrap(), 300);
    assert_eq!(src.string("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(src.usize("tokenizer.ggml.eos_token_id").unwrap(), 2);
    match src.get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) => assert_eq!(t.len(), 300),
        other => panic!("{other:?}"),
    }
    // Only tokenizer keys are copied.
    assert!(src.get("llama.vocab_size").is_none());
    // The Debug output stays short.
    assert!(format!("{spec:?}").len() < 2000);
    // A source without a vocabulary is refused.
    let empty = GgufSource::in_memory(HashMap::new(), Vec::new());
    assert!(matches!(
        SyntheticSpec::tiny("llama").with_tokenizer_from(&empty),
        Err(EngineError::Gguf(GgufError::MissingKey(_)))
    ));
}

#[test]
fn smollm2_tokenizer_gives_vocab_49152() {
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        model.exists(),
        "{} is missing: run ./scripts/fetch-model.sh (models) or check tests/data",
        model.display()
    );
    let real = GgufSource::open(&model).unwrap();
    let spec = SyntheticSpec::tiny("smollm3")
        .with_tokenizer_from(&real)
        .unwrap();
    assert_eq!(spec.vocab_size, 49152);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("smol-tok.gguf");
    synthetic::write_gguf(&spec, &path).unwrap();
    let src = GgufSource::open(&path).unwrap();
    assert_eq!(src.tensors["token_embd.weight"].dims, vec![49152, 256]);
    for (k, v) in real
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
    {
        assert_eq!(format!("{:?}", src.get(k)), format!("{:?}", Some(v)), "{k}");
    }
}

#[test]
fn renaming_the_architecture_and_rewriting_a_source() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Q4KM);
    let smol_path = dir.path().join("smol.gguf");
    synthetic::write_gguf(&spec, &smol_path).unwrap();

    // In memory, without a file.
    let mut src = synthetic::build(&spec).unwrap();
    rename_architecture(&mut src.metadata, "llama");
    assert_eq!(src.string("general.architecture").unwrap(), "llama");
    assert!(src.metadata.keys().all(|k| !k.starts_with("smollm3.")));
    assert_eq!(src.usize("llama.block_count").unwrap(), 4);
    assert_eq!(
        ModelConfig::from_gguf(&src).unwrap().uses_rope,
        vec![true; 4]
    );

    // A file re-labelled and re-written: same tensors, llama metadata.
    let mut file_src = GgufSource::open(&smol_path).unwrap();
    rename_architecture(&mut file_src.metadata, "llama");
    let llama_path = dir.path().join("llama.gguf");
    write_source_as_gguf(&mut file_src, &llama_path).unwrap();
    let mut llama = GgufSource::open(&llama_path).unwrap();
    assert_eq!(llama.string("general.architecture").unwrap(), "llama");
    assert_eq!(llama.usize("llama.embedding_length").unwrap(), 256);
    let mut smol = GgufSource::open(&smol_path).unwrap();
    assert_eq!(all_bytes(&mut llama), all_bytes(&mut smol));

    // The writer of a spec-less source matches the spec's own writer byte for byte once the
    // metadata is the same (rewriting the rewritten file is a fixed point).
    let again = dir.path().join("again.gguf");
    write_source_as_gguf(&mut GgufSource::open(&llama_path).unwrap(), &again).unwrap();
    assert_eq!(
        std::fs::read(&again).unwrap(),
        std::fs::read(&llama_path).unwrap()
    );

    // SyntheticModel relabels the same way.
    let mut m = SyntheticModel::generate(&spec).unwrap();
    m.set_architecture("llama");
    let src = m.into_source();
    assert_eq!(src.string("general.architecture").unwrap(), "llama");
    assert!(src.metadata.keys().all(|k| !k.starts_with("smollm3.")));
}

/// SmolLM3-3B shape with the Q4_K_M mix, built in memory from random blocks.
#[test]
fn smollm3_3b_preset_has_the_real_shapes_and_mix() {
    let spec = SyntheticSpec::smollm3_3b();
    let start = std::time::Instant::now();
    let model = SyntheticModel::generate(&spec).unwrap();
    let elapsed = start.elapsed();
    let total = model.total_bytes();
    eprintln!(
        "smollm3_3b: {} tensors, {:.3} GB, built in {elapsed:?}",
        model.tensors.len(),
        total as f64 / 1e9
    );
    // llama.cpp's SmolLM3-3B Q4_K_M is 1.92 GB of tensor data.
    assert!(
        (1.85e9..1.95e9).contains(&(total as f64)),
        "{total} bytes of weights"
    );
    let by_name: HashMap<&str, &smolchat_gguf::RawTensor> =
        model.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    assert_eq!(by_name.len(), 2 + 36 * 9);
    assert!(!by_name.contains_key("output.weight"));
    let emb = by_name["token_embd.weight"];
    assert_eq!(emb.dims, vec![128_256, 2048]);
    assert_eq!(emb.dtype, GgmlDType::Q6K);
    assert_eq!(by_name["blk.0.attn_q.weight"].dims, vec![2048, 2048]);
    assert_eq!(by_name["blk.0.attn_k.weight"].dims, vec![512, 2048]);
    assert_eq!(by_name["blk.0.attn_v.weight"].dims, vec![512, 2048]);
    assert_eq!(by_name["blk.0.attn_output.weight"].dims, vec![2048, 2048]);
    assert_eq!(by_name["blk.0.ffn_gate.weight"].dims, vec![11_008, 2048]);
    assert_eq!(by_name["blk.0.ffn_down.weight"].dims, vec![2048, 11_008]);
    let count = |suffix: &str, t: GgmlDType| {
        model
            .tensors
            .iter()
            .filter(|x| x.name.ends_with(suffix) && x.dtype == t)
            .count()
    };
    assert_eq!(count(".attn_v.weight", GgmlDType::Q6K), 18);
    assert_eq!(count(".attn_v.weight", GgmlDType::Q4K), 18);
    assert_eq!(count(".ffn_down.weight", GgmlDType::Q6K), 18);
    assert_eq!(count(".ffn_down.weight", GgmlDType::Q4K), 18);
    for s in [".attn_q.weight", ".attn_k.weight", ".attn_output.weight"] {
        assert_eq!(count(s, GgmlDType::Q4K), 36, "{s}");
    }
    assert_eq!(count(".ffn_gate.weight", GgmlDType::Q4K), 36);
    assert_eq!(count(".ffn_up.weight", GgmlDType::Q4K), 36);
    assert_eq!(count("_norm.weight", GgmlDType::F32), 73);
    let meta: HashMap<&str, &Value> = model
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    assert!(matches!(meta["smollm3.rope.freq_base"], Value::F32(x) if *x == 5e6));
    assert!(matches!(meta["smollm3.context_length"], Value::U32(65_536)));
    assert!(matches!(
        meta["smollm3.rope.dimension_count"],
        Value::U32(128)
    ));
    // Spot-check a few rows of each block type: finite and of the intended size.
    for (name, cols) in [
        ("token_embd.weight", 2048usize),
        ("blk.5.ffn_down.weight", 11_008),
        ("blk.6.ffn_down.weight", 11_008),
    ] {
        let t = by_name[name];
        let rows = 8;
        let bytes = rows * cols / 256 * t.dtype.type_size();
        let w = dequantize(t.dtype, rows, cols, &t.data.as_slice()[..bytes]);
        assert!(w.iter().all(|x| x.is_finite()));
        let (_, std) = mean_std(&w);
        let target = 1.0 / (cols as f64).sqrt();
        assert!(std > 0.5 * target && std < 2.0 * target, "{name}: {std}");
    }
    let mut src = model.into_source();
    let c = ModelConfig::from_gguf(&src).unwrap();
    assert_eq!((c.n_layers, c.head_dim, c.vocab_size), (36, 128, 128_256));

    // The random blocks are tame enough for a forward pass to stay finite through 36 layers.
    // (In this test rather than its own so the test binary never holds two 1.9 GB models.)
    let start = std::time::Instant::now();
    let logits = forward_logits(&mut src, &[1, 500, 128_000]);
    eprintln!(
        "smollm3_3b: load + 3-token forward in {:?}",
        start.elapsed()
    );
    assert_eq!(logits.len(), 3 * 128_256);
    assert!(logits.iter().all(|x| x.is_finite()));
    let (_, std) = mean_std(&logits);
    assert!(std > 0.05 && std < 50.0, "logit std {std}");
}

/// A shape larger than a real model's vocabulary takes that model's tokenizer padded with unused
/// tokens: real text tokenizes as in the real model (prompts of realistic lengths, not a token
/// a byte), the shape's vocabulary is kept, and a tokenizer larger than the shape is refused.
#[test]
fn a_larger_shape_takes_a_real_tokenizer_padded() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let real = GgufSource::open(&root.join("tests/data/smollm3-tiny-q8_0.gguf")).expect("open");
    let real_tokens = smolchat_text::tokenizer::Tokenizer::from_gguf(&real).expect("real");
    let mut spec = SyntheticSpec::tiny("smollm3");
    spec.vocab_size = 50_000;
    let spec = spec.with_tokenizer_padded_from(&real).expect("padded");
    assert_eq!(spec.vocab_size, 50_000);
    let src = synthetic::build(&spec).expect("build");
    assert_eq!(
        ModelConfig::from_gguf(&src).expect("config").vocab_size,
        50_000
    );
    let tokens = smolchat_text::tokenizer::Tokenizer::from_gguf(&src).expect("tokenizer");
    let text = "The lighthouse keeper climbed the stairs every evening at dusk.";
    let ids = tokens.encode(text, false).expect("encode");
    assert_eq!(ids, real_tokens.encode(text, false).expect("encode"));
    assert!(
        ids.len() * 3 < text.len(),
        "{} tokens for {} bytes",
        ids.len(),
        text.len()
    );
    assert!(ids.iter().all(|&id| id < 49_152), "{ids:?}");
    assert_eq!(tokens.decode(&ids), text);
    match src.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(all)) => {
            assert_eq!(all.len(), 50_000);
            let last = match all.last() {
                Some(Value::String(t)) => t.as_str(),
                _ => "",
            };
            assert_eq!(last, "<|synthetic_49999|>");
        }
        other => panic!("tokens: {other:?}"),
    }
    let mut small = SyntheticSpec::tiny("smollm3");
    small.vocab_size = 1_000;
    assert!(small.with_tokenizer_padded_from(&real).is_err());
}
