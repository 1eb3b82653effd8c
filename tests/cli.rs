//! The `smolchat` binary, run as a user would.

mod common;

use std::process::Command;

use common::*;

fn smolchat() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_smolchat"));
    c.current_dir(crate_root()).arg("--threads").arg("2");
    c
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run smolchat");
    assert!(
        out.status.success(),
        "smolchat failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

#[test]
fn logits_command_writes_npy_that_matches_llama_cpp() {
    let meta = read_json(&reference("smollm3-tiny-q8_0-tokens.json"));
    let tokens = ids(&meta["token_ids"]);
    let list: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("logits.npy");
    run_ok(
        smolchat()
            .arg("logits")
            .arg("--model")
            .arg(reference("smollm3-tiny-q8_0.gguf"))
            .arg("--tokens")
            .arg(list.join(","))
            .arg("--out")
            .arg(&out),
    );
    let (shape, got) = read_npy(&out);
    let (eshape, expected) = read_npy(&reference("smollm3-tiny-q8_0-logits-fa-off-kvf32.npy"));
    assert_eq!(shape, eshape);
    let worst = got
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 0.03, "max |diff| {worst}");
}

#[test]
fn tokenize_command_matches_llama_cpp() {
    let data = read_json(&reference("smollm2-tokenize.json"));
    for case in data["cases"].as_array().expect("cases").iter().take(6) {
        let mut cmd = smolchat();
        cmd.arg("tokenize");
        if case["parse_special"].as_bool() == Some(true) {
            cmd.arg("--special");
        }
        let text = case["text"].as_str().expect("text");
        let stdout = run_ok(cmd.arg("--").arg(text));
        let got: Vec<u32> = serde_json::from_str(stdout.trim()).expect("json ids");
        assert_eq!(got, ids(&case["ids"]), "{text:?}");
    }
}

#[test]
fn inspect_command_reports_nope_layers_and_kv_bytes() {
    let stdout = run_ok(
        smolchat()
            .arg("inspect")
            .arg("--json")
            .arg(reference("smollm3-tiny-q8_0.gguf")),
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(v["model"]["architecture"], "smollm3");
    assert_eq!(v["model"]["nope_layers"], serde_json::json!([3, 7]));
    // 2 (K and V) x 8 layers x 2 KV heads x 32 dims x 4 bytes
    assert_eq!(v["model"]["kv_bytes_per_token_f32"], 2 * 8 * 2 * 32 * 4);
    // Per KV type, and the tokens the default 2 GiB holds in whole blocks of 16 positions.
    let kv = &v["model"]["kv_cache"];
    for (t, row_bytes) in [("f32", 32 * 4), ("f16", 32 * 2), ("q8_0", 34)] {
        let per_token = 2 * 8 * 2 * row_bytes;
        assert_eq!(kv[t]["bytes_per_token"], per_token, "{t}");
        let tokens = (2048usize << 20) / (16 * per_token) * 16;
        assert_eq!(kv[t]["tokens_in_default_budget"], tokens, "{t}");
    }
    assert!(v["metadata"]["tokenizer.ggml.tokens"]
        .as_str()
        .expect("summary")
        .contains("array of 49152"));
}

#[test]
fn generate_raw_greedy_matches_llama_cpp_start() {
    let data = read_json(&reference("smollm2-greedy.json"));
    let case = &data["results"][0];
    let prompt = case["prompt"].as_str().expect("prompt");
    let stdout = run_ok(
        smolchat()
            .args([
                "generate",
                "--raw",
                "--temperature",
                "0",
                "--max-tokens",
                "4",
            ])
            .arg("--ignore-eos")
            .arg(prompt),
    );
    // The first four greedy tokens of llama.cpp (free-running greedy text drifts later at
    // near-ties, see the reference README).
    let tokens = ids(&case["gen_ids"]);
    let gen_text = case["gen_text"].as_str().expect("text");
    assert_eq!(tokens.len(), 48);
    let expected_prefix = " Paris.\n\n";
    assert!(gen_text.starts_with(expected_prefix));
    assert_eq!(stdout, format!("{expected_prefix}\n"));
}

#[test]
fn chat_template_generate_streams_an_answer() {
    let stdout = run_ok(smolchat().args([
        "generate",
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "What is 2 + 2?",
    ]));
    assert!(!stdout.trim().is_empty());
    assert!(!stdout.contains("<|im_start|>"), "{stdout:?}");
}

#[test]
fn missing_model_is_a_clear_error() {
    let out = smolchat()
        .args(["generate", "--model", "/nonexistent/model.gguf", "hi"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");

    let dir = tempfile::tempdir().expect("tempdir");
    let bogus = dir.path().join("bogus.gguf");
    std::fs::write(&bogus, b"not a model").expect("write");
    let out = smolchat()
        .args(["generate", "--model"])
        .arg(&bogus)
        .arg("hi")
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a GGUF file"), "{err}");
}

#[test]
fn bench_command_reports_json() {
    let stdout = run_ok(smolchat().args([
        "bench",
        "--prompt-tokens",
        "32",
        "--gen-tokens",
        "4",
        "--batch",
        "2",
    ]));
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    for key in ["load_s", "peak_rss_bytes", "weight_bytes"] {
        assert!(v[key].as_f64().expect(key) > 0.0, "{key}");
    }
    assert!(v["prefill"]["tokens_per_s"].as_f64().expect("prefill") > 0.0);
    assert!(v["decode"]["tokens_per_s"].as_f64().expect("decode") > 0.0);
    assert_eq!(v["batched_decode"]["sequences"], 2);
    // Warm medians as llama-bench gives them: 5 timed runs each (by default), decode from an
    // empty context beside decode after the prompt, the batched prompts llama-batched-bench's 32.
    assert_eq!(v["repeat"], 5);
    for figure in ["prefill", "decode", "decode_depth0"] {
        let runs = v[figure]["runs_tokens_per_s"].as_array().expect(figure);
        assert_eq!(runs.len(), 5, "{figure}");
        let mut sorted: Vec<f64> = runs.iter().filter_map(|r| r.as_f64()).collect();
        sorted.sort_by(f64::total_cmp);
        assert_eq!(
            v[figure]["tokens_per_s"].as_f64(),
            Some(sorted[2]),
            "{figure}: the median"
        );
    }
    assert_eq!(v["decode"]["depth"], 34);
    assert_eq!(v["decode_depth0"]["depth"], 3);
    assert_eq!(v["batched_decode"]["prompt_tokens"], 32);
}

/// `bench --synthetic` builds its model (on the compute pool) and loads it through the same
/// loader; `tiny` is the small shape for this smoke test.
/// `bench --profile-decode-at`: one decode step at the depth asked for (after the warm-up steps
/// that capture and replay a decode graph on a GPU), inside the profiler range, and nothing
/// else; a depth past the context is refused with what to change.
#[test]
fn bench_profiles_one_decode_step_at_a_depth() {
    let stdout =
        run_ok(smolchat().args(["bench", "--synthetic", "tiny", "--profile-decode-at", "12"]));
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(v["depth"], 12 + 4);
    assert!(v["seconds"].as_f64().expect("seconds") > 0.0);
    assert!(v.get("decode").is_none(), "no benchmark runs: {v}");
    let o = smolchat()
        .args([
            "bench",
            "--synthetic",
            "tiny",
            "--profile-decode-at",
            "100000000",
        ])
        .output()
        .expect("runs");
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("exceed the model's context"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn bench_measures_a_synthetic_model() {
    let stdout = run_ok(smolchat().args([
        "bench",
        "--synthetic",
        "tiny",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
        "--batch",
        "2",
    ]));
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(v["model"], "synthetic:tiny");
    assert_eq!(v["architecture"], "smollm3");
    assert_eq!(v["threads"], 2);
    assert!(v["decode"]["tokens_per_s"].as_f64().expect("decode") > 0.0);
}

/// `--device` and `model.device` go through one parser; a device this build cannot compute on is
/// refused at start-up with the reason, never silently replaced by the CPU.
#[test]
fn device_errors_are_clear() {
    let stderr_of = |cmd: &mut Command| {
        let out = cmd.output().expect("run smolchat");
        assert!(!out.status.success(), "smolchat succeeded: {cmd:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let model = reference("smollm3-tiny-q8_0.gguf");
    let err = stderr_of(smolchat().args(["generate", "--device", "cuda:x", "hi"]));
    assert!(
        err.contains("device `cuda:x`: expected auto, cpu, cuda or cuda:N"),
        "{err}"
    );
    let err = stderr_of(
        smolchat()
            .args(["generate", "--raw", "--device", "cuda", "--model"])
            .arg(&model)
            .arg("hi"),
    );
    assert!(err.contains("device `cuda:0` is not available"), "{err}");
    let err = stderr_of(
        smolchat()
            .args([
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--device",
                "cuda:1",
                "--model",
            ])
            .arg(&model),
    );
    assert!(
        err.contains("model.device `cuda:1` is not available"),
        "{err}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("smolchat.toml");
    std::fs::write(&config, "[model]\ndevice = \"metal\"\n").expect("write");
    let err = stderr_of(smolchat().args(["serve", "--config"]).arg(&config));
    assert!(
        err.contains("device `metal`: Metal is not supported") && err.contains("model.device"),
        "{err}"
    );
}

/// Every command that loads a model reads the configuration `serve` reads: `SMOLCHAT_SECTION__KEY`
/// variables and `--config` reach `tokenize` and `generate` too, while single names (a flag's
/// variable, the build's `SMOLCHAT_CUDA_ROOT`) are not configuration and fail nothing; a
/// one-underscore typo is named in a warning.
#[test]
fn model_commands_read_the_configuration_serve_reads() {
    /// Whether the command succeeded, and its stderr.
    fn run(cmd: &mut Command) -> (bool, String) {
        let out = cmd.output().expect("run smolchat");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
    let model = smollm2_path();
    let (ok, stderr) = run(smolchat()
        .args(["tokenize", "hello", "--model"])
        .arg(&model)
        .env("SMOLCHAT_CUDA_ROOT", "/nonexistent")
        .env("SMOLCHAT_API_KEY", "not-a-config-key")
        .env("SMOLCHAT_SERVER_BIND", "127.0.0.1:1"));
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("SMOLCHAT_SERVER_BIND is not read")
            && stderr.contains("SMOLCHAT_SERVER__BIND"),
        "{stderr}"
    );

    let (ok, stderr) = run(smolchat()
        .args(["generate", "--raw", "--max-tokens", "1", "hi", "--model"])
        .arg(&model)
        .env("SMOLCHAT_MODEL__KV_TYPE", "q9"));
    assert!(!ok, "a bad model.kv_type must fail generate too");
    assert!(stderr.contains("KV cache type `q9`"), "{stderr}");

    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("smolchat.toml");
    std::fs::write(
        &config,
        "[model]\ntokenizer = \"/nonexistent/tokenizer.json\"\n",
    )
    .expect("write");
    let (ok, stderr) = run(smolchat()
        .args(["tokenize", "hello", "--config"])
        .arg(&config)
        .arg("--model")
        .arg(&model));
    assert!(!ok, "the configured tokenizer must be the one used");
    assert!(stderr.contains("/nonexistent/tokenizer.json"), "{stderr}");
}

/// `smolchat bench --speculative`: the three workloads decoded with drafts off and on, the same
/// tokens both ways, the drafts counted; then the ten-question chat series three ways.
#[test]
fn bench_speculative_decodes_the_workloads_the_same_both_ways() {
    let model = common::smollm2_path();
    // Drafts whatever lookup finds, as configured: the measured break-even of a debug build
    // (slow host work per position) could leave a workload undrafted.
    let out = run_ok(
        smolchat()
            .env("SMOLCHAT_SCHEDULER__DRAFT_BREAK_EVEN", "0")
            .args([
                "bench",
                "--speculative",
                "--gen-tokens",
                "24",
                "--model",
                model.to_str().expect("path"),
                "--replay-shape",
                "tiny",
            ]),
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let rows = v["speculative"].as_array().expect("rows");
    // Each workload's steps replayed on another shape: as many tokens both ways, as many steps
    // and drafts as the real run verified.
    let replay = v["replay"]["workloads"].as_array().expect("replay");
    assert_eq!(replay.len(), 3, "{v}");
    for (r, real) in replay.iter().zip(rows) {
        assert_eq!(r["workload"], real["workload"], "{r}");
        assert_eq!(r["drafted"], real["drafted"], "{r} {real}");
        assert_eq!(r["accepted"], real["accepted"], "{r} {real}");
        assert!(r["tokens"].as_u64().unwrap_or(0) >= 23, "{r}");
        assert!(r["ratio"].as_f64().unwrap_or(0.0) > 0.0, "{r}");
    }
    let names: Vec<&str> = rows.iter().filter_map(|r| r["workload"].as_str()).collect();
    assert_eq!(names, ["rewrite", "document", "chat"]);
    for r in rows {
        assert_eq!(r["same_tokens"], true, "{r}");
        assert_eq!(r["tokens"], 24, "{r}");
        assert!(
            r["decode_tokens_per_s_off"].as_f64().unwrap_or(0.0) > 0.0,
            "{r}"
        );
    }
    let drafted: u64 = rows.iter().filter_map(|r| r["drafted"].as_u64()).sum();
    assert!(drafted > 0, "{v}");
    // The chat series: off, prompt lookup alone, and with the n-gram cache; the same tokens.
    let series = &v["chat_series"];
    assert_eq!(series["same_tokens"], true, "{series}");
    let runs: Vec<&str> = series["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter_map(|r| r["drafts"].as_str())
        .collect();
    assert_eq!(runs, ["off", "lookup", "lookup+ngram_cache"]);
    assert_eq!(series["runs"][0]["drafted"], 0, "{series}");
    assert_eq!(series["runs"][0]["decode_tokens"], 10 * 23, "{series}");
}
