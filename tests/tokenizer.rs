//! The tokenizer against llama.cpp's own ids for SmolLM2-135M-Instruct, plus the SmolLM3
//! (`smaug-bpe`) split rules, the tokenizer.json override and streaming detokenization.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use serde_json::Value as Json;
use smolchat_gguf::{GgufSource, Value};
use smolchat_text::tokenizer::{Detokenizer, Tokenizer};

fn model_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn reference(name: &str) -> Json {
    let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/")).join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

static SOURCE: LazyLock<GgufSource> = LazyLock::new(|| GgufSource::open(&model_path()).unwrap());
static TOK: LazyLock<Tokenizer> = LazyLock::new(|| Tokenizer::from_gguf(&SOURCE).unwrap());

/// The SmolLM2 file's metadata with some keys changed (None removes the key).
fn variant(changes: &[(&str, Option<Value>)]) -> GgufSource {
    let mut metadata = SOURCE.metadata.clone();
    for (key, value) in changes {
        match value {
            Some(v) => metadata.insert(key.to_string(), v.clone()),
            None => metadata.remove(*key),
        };
    }
    GgufSource::in_memory(metadata, vec![])
}

fn with_pre(pre: &str) -> Tokenizer {
    Tokenizer::from_gguf(&variant(&[(
        "tokenizer.ggml.pre",
        Some(Value::String(pre.to_string())),
    )]))
    .unwrap()
}

fn all_reference_cases() -> Vec<(String, bool, Vec<u32>)> {
    let r = reference("smollm2-tokenize.json");
    let mut out = Vec::new();
    for list in ["cases", "extra_cases"] {
        for case in r[list].as_array().unwrap() {
            assert_eq!(case["add_special"], Json::Bool(false));
            out.push((
                case["text"].as_str().unwrap().to_string(),
                case["parse_special"].as_bool().unwrap(),
                ids(&case["ids"]),
            ));
        }
    }
    assert!(out.len() >= 6);
    out
}

#[test]
fn llama_cpp_tokenize_cases_match_exactly() {
    for (text, parse_special, expected) in all_reference_cases() {
        let got = TOK.encode(&text, parse_special).unwrap();
        assert_eq!(got, expected, "text {text:?} parse_special={parse_special}");
        // Special tokens render as their text, so every case decodes back to its input.
        assert_eq!(TOK.decode(&got), text);
    }
}

#[test]
fn special_tokens_follow_parse_special() {
    let text = "<|im_start|>user\nHi<|im_end|>";
    let parsed = TOK.encode(text, true).unwrap();
    let plain = TOK.encode(text, false).unwrap();
    assert_eq!(parsed.first(), Some(&1));
    assert_eq!(parsed.last(), Some(&2));
    assert!(!plain.contains(&1) && !plain.contains(&2));
    // Adjacent, repeated and unknown-looking markers.
    assert_eq!(
        TOK.encode("<|im_end|><|im_end|>x<|im_start|>", true)
            .unwrap(),
        vec![2, 2, TOK.token_id("x").unwrap(), 1]
    );
    let not_special = TOK.encode("<|im_middle|>", true).unwrap();
    assert!(not_special.iter().all(|&id| !TOK.is_special(id)));
    assert_eq!(TOK.encode("", true).unwrap(), Vec::<u32>::new());
}

#[test]
fn metadata_ids_and_flags() {
    assert_eq!(TOK.vocab_size(), 49152);
    assert_eq!(TOK.bos_id(), Some(1));
    assert_eq!(TOK.eos_id(), Some(2));
    assert!(!TOK.add_bos());
    assert_eq!(TOK.token_id("<|im_start|>"), Some(1));
    assert_eq!(TOK.token_id("<|im_end|>"), Some(2));
    assert_eq!(TOK.token_id("<|endoftext|>"), Some(0));
    assert_eq!(TOK.token_id("Ġthe"), Some(260));
    assert_eq!(TOK.token_id("no such token here"), None);
    assert!(TOK.is_special(0) && TOK.is_special(16));
    assert!(!TOK.is_special(17) && !TOK.is_special(49151) && !TOK.is_special(49152));
    assert!(TOK.is_eog(2) && TOK.is_eog(0) && !TOK.is_eog(1));
    assert_eq!(TOK.token_bytes(216), b" ".to_vec());
    assert_eq!(TOK.token_bytes(198), b"\n".to_vec());
    assert_eq!(TOK.token_bytes(1), b"<|im_start|>".to_vec());
    assert_eq!(TOK.token_bytes(1_000_000), Vec::<u8>::new());
}

#[test]
fn llama_cpp_prompt_ids_and_greedy_text() {
    let r = reference("smollm2-greedy.json");
    for result in r["results"].as_array().unwrap() {
        let prompt = result["prompt"].as_str().unwrap();
        // add_special=true in llama.cpp, but this model has add_bos_token = false.
        assert_eq!(
            TOK.encode(prompt, false).unwrap(),
            ids(&result["prompt_ids"])
        );
        let gen = ids(&result["gen_ids"]);
        let text = result["gen_text"].as_str().unwrap();
        assert_eq!(TOK.decode(&gen), text);
        let mut detok = TOK.detokenizer();
        let mut streamed: String = gen.iter().map(|&id| detok.push(id)).collect();
        streamed.push_str(&detok.finish());
        assert_eq!(streamed, text);
    }

    let r = reference("smollm2-135m-tokens.json");
    assert_eq!(r["n_vocab"].as_u64(), Some(TOK.vocab_size() as u64));
    assert_eq!(
        TOK.encode(r["text"].as_str().unwrap(), false).unwrap(),
        ids(&r["token_ids"])
    );
}

fn stream(detok: &mut Detokenizer, ids: &[u32]) -> (Vec<String>, String) {
    let pieces: Vec<String> = ids.iter().map(|&id| detok.push(id)).collect();
    let tail = detok.finish();
    (pieces, tail)
}

#[test]
fn streaming_never_splits_a_character() {
    let text = "Ünïcödé — emojis 🚀🦀 and CJK 漢字, ça va? 👩‍👩‍👧 日本語のテキスト 한국어 Ελληνικά";
    let ids = TOK.encode(text, false).unwrap();
    assert_eq!(TOK.decode(&ids), text);

    let mut detok = TOK.detokenizer();
    let mut held_back = 0;
    let mut pieces = Vec::new();
    for &id in &ids {
        let piece = detok.push(id);
        if detok.pending_len() > 0 {
            held_back += 1;
        }
        assert!(!piece.contains('\u{FFFD}'), "lossy piece {piece:?}");
        pieces.push(piece);
    }
    // Some characters of this text span several tokens, so the hold-back path ran.
    assert!(held_back > 0);
    let tail = detok.finish();
    assert_eq!(tail, "");
    assert_eq!(pieces.concat(), text);
    // Every token's bytes concatenated give the same text.
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| TOK.token_bytes(id)).collect();
    assert_eq!(bytes, text.as_bytes());
}

#[test]
fn streaming_invalid_bytes_match_lossy_decode() {
    // Single-byte tokens for a lead byte of a 4-byte sequence (0xF0 is 'ð' in the byte alphabet)
    // and for ASCII, to build byte sequences that are not UTF-8.
    let lead = TOK.token_id("ð").unwrap();
    let a = TOK.token_id("a").unwrap();
    assert_eq!(TOK.token_bytes(lead), vec![0xF0]);
    for ids in [
        vec![lead],
        vec![lead, a],
        vec![a, lead, lead, a],
        vec![lead, a, lead],
    ] {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| TOK.token_bytes(id)).collect();
        let lossy = String::from_utf8_lossy(&bytes).into_owned();
        assert_eq!(TOK.decode(&ids), lossy);
        let mut detok = TOK.detokenizer();
        let (pieces, tail) = stream(&mut detok, &ids);
        assert_eq!(pieces.concat() + &tail, lossy, "ids {ids:?}");
    }
    // A held-back lead byte is not emitted until it is known to be bad.
    let mut detok = TOK.detokenizer();
    assert_eq!(detok.push(lead), "");
    assert_eq!(detok.pending_len(), 1);
    assert_eq!(detok.finish(), "\u{FFFD}");
    assert_eq!(detok.pending_len(), 0);
}

#[test]
fn smollm_splits_digits_and_follows_gpt2() {
    assert_eq!(
        TOK.pre_tokenize("12345").unwrap(),
        ["1", "2", "3", "4", "5"]
    );
    assert_eq!(
        TOK.pre_tokenize("I'M here, don't  go\n\nnow").unwrap(),
        ["I", "'", "M", " here", ",", " don", "'t", " ", " go", "\n", "\n", "now"]
    );
}

#[test]
fn smaug_bpe_uses_the_llama3_split() {
    let tok = with_pre("smaug-bpe");
    let cases: &[(&str, &[&str])] = &[
        ("12345", &["123", "45"]),
        ("abc 12345 def", &["abc", " ", "123", "45", " def"]),
        ("I'M here", &["I", "'M", " here"]),
        ("a\n\nb", &["a", "\n\n", "b"]),
        ("hello   world", &["hello", "  ", " world"]),
        ("x!!!\n\ny", &["x", "!!!\n\n", "y"]),
        ("don't", &["don", "'t"]),
        ("  trailing  ", &[" ", " trailing", "  "]),
        ("tab\tthen", &["tab", "\tthen"]),
    ];
    for (text, expected) in cases {
        assert_eq!(&tok.pre_tokenize(text).unwrap(), expected, "text {text:?}");
    }
    // The split shows in the ids too: "\n\n" is one pre-token there, two for smollm.
    let llama3 = tok.encode("a\n\nb", false).unwrap();
    let smollm = TOK.encode("a\n\nb", false).unwrap();
    assert_ne!(llama3, smollm);
    assert_eq!(tok.decode(&llama3), "a\n\nb");
    // Everything else (special tokens, round trips) still holds.
    for (text, parse_special, _) in all_reference_cases() {
        let got = tok.encode(&text, parse_special).unwrap();
        assert_eq!(tok.decode(&got), text);
    }
    assert_eq!(
        tok.encode("<|im_start|>user", true).unwrap()[0],
        1,
        "special tokens are parsed whatever the pre-tokenizer"
    );
}

#[test]
fn llama3_names_default_to_bos_and_smaug_does_not() {
    let no_add_bos = |pre: &str| {
        Tokenizer::from_gguf(&variant(&[
            ("tokenizer.ggml.pre", Some(Value::String(pre.to_string()))),
            ("tokenizer.ggml.add_bos_token", None),
        ]))
        .unwrap()
    };
    assert!(no_add_bos("llama-bpe").add_bos());
    assert!(!no_add_bos("smaug-bpe").add_bos());
    assert!(!no_add_bos("smollm").add_bos());
    // The explicit key wins.
    assert!(!with_pre("llama-bpe").add_bos());
    let llama = with_pre("llama-bpe");
    assert_eq!(llama.pre_tokenize("12345").unwrap(), ["123", "45"]);
    let text = "Hello world, 1234567 numbers";
    assert_eq!(llama.decode(&llama.encode(text, false).unwrap()), text);
}

#[test]
fn gpt2_and_missing_pre_use_plain_byte_level() {
    let missing = Tokenizer::from_gguf(&variant(&[("tokenizer.ggml.pre", None)])).unwrap();
    let gpt2 = with_pre("gpt-2");
    for tok in [&missing, &gpt2] {
        assert_eq!(tok.pre_tokenize("12345 ab").unwrap(), ["12345", " ab"]);
    }
}

#[test]
fn bad_metadata_is_a_clear_error() {
    let err = Tokenizer::from_gguf(&variant(&[(
        "tokenizer.ggml.pre",
        Some(Value::String("qwen2-ish".to_string())),
    )]))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("qwen2-ish") && err.contains("smaug-bpe"),
        "{err}"
    );

    let err = Tokenizer::from_gguf(&variant(&[(
        "tokenizer.ggml.model",
        Some(Value::String("llama".to_string())),
    )]))
    .unwrap_err()
    .to_string();
    assert!(err.contains("`llama`") && err.contains("gpt2"), "{err}");

    let err = Tokenizer::from_gguf(&variant(&[("tokenizer.ggml.tokens", None)]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.ggml.tokens"), "{err}");

    let err = Tokenizer::from_gguf(&variant(&[("tokenizer.ggml.tokens", Some(Value::U32(3)))]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.ggml.tokens"), "{err}");

    let err = Tokenizer::from_gguf(&variant(&[
        ("tokenizer.ggml.add_bos_token", Some(Value::Bool(true))),
        ("tokenizer.ggml.bos_token_id", None),
    ]))
    .unwrap_err()
    .to_string();
    assert!(err.contains("add_bos_token"), "{err}");

    // An out-of-range id is dropped, not trusted.
    let tok = Tokenizer::from_gguf(&variant(&[(
        "tokenizer.ggml.eos_token_id",
        Some(Value::U32(999_999)),
    )]))
    .unwrap();
    assert_eq!(tok.eos_id(), None);
}

/// A Hugging Face tokenizer.json equivalent to the GGUF vocabulary (SmolLM2's published one has
/// this shape), written from the GGUF metadata so the test needs no download.
fn tokenizer_json_from_gguf() -> Json {
    let strings = |key: &str| -> Vec<String> {
        match SOURCE.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => panic!("{key}: {other:?}"),
                })
                .collect(),
            other => panic!("{key}: {other:?}"),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens");
    let merges = strings("tokenizer.ggml.merges");
    let vocab: serde_json::Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), Json::from(i)))
        .collect();
    let added: Vec<Json> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| TOK.is_special(*i as u32))
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
}

#[test]
fn tokenizer_json_override_agrees_with_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, tokenizer_json_from_gguf().to_string()).unwrap();
    let tok = Tokenizer::from_json_file(&path, &SOURCE).unwrap();
    assert_eq!(tok.vocab_size(), TOK.vocab_size());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert!(!tok.add_bos());
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    for (text, parse_special, expected) in all_reference_cases() {
        assert_eq!(
            tok.encode(&text, parse_special).unwrap(),
            expected,
            "text {text:?} parse_special={parse_special}"
        );
    }
    let ids: Vec<u32> = (0..TOK.vocab_size() as u32).step_by(7).collect();
    assert_eq!(tok.decode(&ids), TOK.decode(&ids));

    // Not byte-level: refused with a reason.
    let mut json = tokenizer_json_from_gguf();
    json["decoder"] = serde_json::json!({"type": "Fuse"});
    std::fs::write(&path, json.to_string()).unwrap();
    let err = Tokenizer::from_json_file(&path, &SOURCE)
        .unwrap_err()
        .to_string();
    assert!(err.contains("byte-level"), "{err}");
    let err = Tokenizer::from_json_file(&dir.path().join("missing.json"), &SOURCE)
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.json"), "{err}");
}

#[test]
fn user_defined_tokens_are_cut_even_without_special_parsing() {
    // Make <|im_start|> user-defined (type 4) and check llama.cpp's rule: user-defined tokens are
    // single ids with or without special parsing, control tokens only with it.
    let mut types = match SOURCE.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items.clone(),
        other => panic!("{other:?}"),
    };
    types[1] = Value::I32(4);
    let tok = Tokenizer::from_gguf(&variant(&[(
        "tokenizer.ggml.token_type",
        Some(Value::Array(types)),
    )]))
    .unwrap();
    let text = "<|im_start|>user\nHi<|im_end|>";
    let plain = tok.encode(text, false).unwrap();
    assert_eq!(plain[0], 1);
    assert!(!plain.contains(&2));
    assert_eq!(tok.encode(text, true).unwrap(), [1, 4093, 198, 26843, 2]);
    assert!(tok.is_special(1));
    assert_eq!(tok.decode(&plain), text);
}

#[test]
fn many_threads_share_one_tokenizer() {
    let cases = all_reference_cases();
    let map: HashMap<(String, bool), Vec<u32>> =
        cases.into_iter().map(|(t, p, ids)| ((t, p), ids)).collect();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..20 {
                    for ((text, parse), ids) in &map {
                        assert_eq!(&TOK.encode(text, *parse).unwrap(), ids);
                    }
                }
            });
        }
    });
}
