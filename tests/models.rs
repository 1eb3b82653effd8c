//! Several models in one server, end to end on the real `smolchat serve` binary: the real
//! SmolLM2 file as the main model, a second quantization of it (q8_0, written here from the
//! Q4_1 file) and the tiny SmolLM3 file as `[[models.entries]]`. Each is loaded at its first
//! request; two served at once give the replies each gives alone (greedy, token for token);
//! aliases route and unknown names are 404; under a memory budget that holds one extra model,
//! requests that alternate between two load and unload them without a failed reply, and a model
//! with a running reply is never unloaded under it.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::server::{Client, Reply, Server};
use reqwest::StatusCode;
use serde_json::{json, Value};

static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The KV budget of every model in these tests, MiB (small: the budget arithmetic stays about
/// the weights).
const KV_MIB: u64 = 16;

/// SmolLM2 re-quantized to q8_0 under `dir` (a second quantization of the same model).
fn second_quantization(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let mut src = smolchat_gguf::GgufSource::open(&common::smollm2_path()).expect("open SmolLM2");
    smolchat_engine::synthetic::requantize_as_gguf(&mut src, &path, smolchat_gguf::GgmlDType::Q8_0)
        .expect("write the q8_0 file");
    path
}

fn entry(id: &str, path: &Path, aliases: &[&str]) -> String {
    let aliases: Vec<String> = aliases.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "{{id = {id:?}, path = {:?}, aliases = [{}]}}",
        path.display().to_string(),
        aliases.join(", ")
    )
}

/// A greedy chat completion on `model`: its status and body.
async fn ask(client: &Client, model: &str, prompt: &str, max_tokens: usize) -> Reply {
    client
        .post(
            "/v1/chat/completions",
            &json!({
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": max_tokens,
            }),
        )
        .await
}

fn text_of(r: &Reply) -> String {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    r.json["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn loaded(ps: &Value) -> Vec<String> {
    let mut names: Vec<String> = ps["models"]
        .as_array()
        .expect("models")
        .iter()
        .filter_map(|m| m["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn models_load_on_demand_and_each_answers_as_it_does_alone() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let q8 = second_quantization(dir.path(), "smollm2-q8_0.gguf");
    let tiny = common::reference("smollm3-tiny-q8_0.gguf");
    let entries = format!(
        "[{}, {}]",
        entry("smollm2-q8", &q8, &["gpt-4o-mini", "llama3"]),
        entry("tiny3", &tiny, &[])
    );
    let kv = KV_MIB.to_string();
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__ENTRIES", &entries),
            ("SMOLCHAT_SCHEDULER__KV_BUDGET_MIB", &kv),
        ],
    )
    .await;
    let client = server.client();
    let main = "SmolLM2-135M-Instruct.Q4_1";

    // Every configured model is listed, loaded or not, with its aliases.
    let listed = client.get("/v1/models").await;
    assert_eq!(listed.status, StatusCode::OK, "{}", listed.text);
    let ids: Vec<&str> = listed.json["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, [main, "smollm2-q8", "gpt-4o-mini", "llama3", "tiny3"]);
    assert_eq!(listed.json["data"][1]["status"]["value"], "unloaded");
    assert_eq!(listed.json["data"][2]["alias_of"], "smollm2-q8");
    let tags = client.get("/api/tags").await;
    assert_eq!(
        tags.json["models"].as_array().map(Vec::len),
        Some(3),
        "{}",
        tags.text
    );
    assert_eq!(
        loaded(&client.get("/api/ps").await.json),
        [format!("{main}:latest")]
    );

    // Alone, one after another: the first request of each entry loads it.
    let prompt = "Name three colours.";
    let alone_main = text_of(&ask(&client, main, prompt, 12).await);
    let alone_q8 = ask(&client, "smollm2-q8", prompt, 12).await;
    assert_eq!(alone_q8.json["model"], "smollm2-q8", "{}", alone_q8.text);
    let alone_q8 = text_of(&alone_q8);
    let alone_tiny = text_of(&ask(&client, "tiny3", prompt, 12).await);
    assert!(!alone_main.is_empty() && !alone_q8.is_empty());
    let listed = client.get("/v1/models").await;
    assert_eq!(listed.json["data"][1]["status"]["value"], "loaded");
    assert_eq!(
        loaded(&client.get("/api/ps").await.json),
        [
            format!("{main}:latest"),
            "smollm2-q8:latest".into(),
            "tiny3:latest".into()
        ]
    );

    // All three at once, twice: the same replies, token for token.
    for _ in 0..2 {
        let (a, b, c) = tokio::join!(
            ask(&client, main, prompt, 12),
            ask(&client, "smollm2-q8", prompt, 12),
            ask(&client, "tiny3", prompt, 12),
        );
        assert_eq!(text_of(&a), alone_main);
        assert_eq!(text_of(&b), alone_q8);
        assert_eq!(text_of(&c), alone_tiny);
    }

    // An alias is its model; the answer names the model.
    let by_alias = ask(&client, "gpt-4o-mini", prompt, 12).await;
    assert_eq!(by_alias.json["model"], "smollm2-q8");
    assert_eq!(text_of(&by_alias), alone_q8);
    // Ollama's own name for it too.
    let ollama = client
        .post(
            "/api/chat",
            &json!({
                "model": "smollm2-q8:latest",
                "messages": [{"role": "user", "content": prompt}],
                "stream": false,
                "options": {"temperature": 0, "num_predict": 12},
            }),
        )
        .await;
    assert_eq!(ollama.status, StatusCode::OK, "{}", ollama.text);
    assert_eq!(ollama.json["message"]["content"], alone_q8.as_str());

    // An unknown name is 404 model_not_found, naming what is served.
    let unknown = ask(&client, "gpt-4o", prompt, 4).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{}", unknown.text);
    assert_eq!(unknown.json["error"]["code"], "model_not_found");
    assert!(unknown.text.contains("smollm2-q8"), "{}", unknown.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_a_budget_for_one_more_model_requests_take_turns_and_no_reply_fails() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let a = second_quantization(dir.path(), "a.gguf");
    let b = dir.path().join("b.gguf");
    std::fs::copy(&a, &b).expect("copy");
    let file = |p: &Path| std::fs::metadata(p).expect("size").len();
    let (main_bytes, extra_bytes) = (file(&common::smollm2_path()), file(&a));
    let kv = KV_MIB << 20;
    // Room for the main model and one more, with slack for what loading adds to a file's size,
    // but not for two more.
    let budget_mib = (main_bytes * 6 / 5 + extra_bytes * 3 / 2 + 2 * kv) >> 20;
    let entries = format!("[{}, {}]", entry("a", &a, &[]), entry("b", &b, &[]));
    let (budget, kv_mib) = (budget_mib.to_string(), KV_MIB.to_string());
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__ENTRIES", &entries),
            ("SMOLCHAT_MODELS__MEMORY_BUDGET_MIB", &budget),
            ("SMOLCHAT_SCHEDULER__KV_BUDGET_MIB", &kv_mib),
        ],
    )
    .await;
    let client = server.client();
    let prompt = "Say hello.";
    let main = "SmolLM2-135M-Instruct.Q4_1:latest";

    // Alternating requests: each loads its model and unloads the other; none fails.
    let mut answers = Vec::new();
    for model in ["a", "b", "a", "b"] {
        answers.push(text_of(&ask(&client, model, prompt, 8).await));
        assert_eq!(
            loaded(&client.get("/api/ps").await.json),
            [main.to_string(), format!("{model}:latest")],
            "after a request for {model}"
        );
    }
    // The same file under two names: the same greedy reply every time.
    assert!(answers.iter().all(|t| *t == answers[0]), "{answers:?}");

    // A long reply on `b` holds it: a request for `a` waits for it, then loads `a`.
    let long = {
        let client = client.clone();
        tokio::spawn(
            async move { ask(&client, "b", "Write a long story about a river.", 120).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = ask(&client, "a", prompt, 8).await;
    let long = long.await.expect("join");
    assert_eq!(long.status, StatusCode::OK, "{}", long.text);
    assert_eq!(
        long.json["usage"]["completion_tokens"], 120,
        "the running reply ran to its end: {}",
        long.text
    );
    assert_eq!(text_of(&waiting), answers[0]);
    assert_eq!(
        loaded(&client.get("/api/ps").await.json),
        [main.to_string(), "a:latest".to_string()]
    );
    let log = server.log_text();
    assert!(
        log.contains("unloading the least recently used idle model"),
        "{log}"
    );
    assert!(
        log.contains("a request waits for room"),
        "the request for `a` came while `b` was replying: {log}"
    );
}

/// `smolchat model …` against the running server, with the admin token from the environment.
fn cli(server: &Server, token: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_smolchat"))
        .arg("model")
        .args(args)
        .args(["--url", &server.base])
        .env("SMOLCHAT_SERVER__ADMIN_TOKEN", token)
        .output()
        .expect("run smolchat model");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_admin_lists_loads_unloads_and_sets_the_default_from_the_command_line() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = common::reference("smollm3-tiny-q8_0.gguf");
    let entries = format!("[{}]", entry("tiny3", &tiny, &["small"]));
    let token = "models-admin-token-0123456789";
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__ENTRIES", &entries),
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", token),
        ],
    )
    .await;
    let main = "SmolLM2-135M-Instruct.Q4_1";

    let (ok, list) = cli(&server, token, &["list"]);
    assert!(ok, "{list}");
    assert!(list.contains(&format!("{main} *")), "{list}");
    assert!(
        list.lines()
            .any(|l| l.starts_with("tiny3") && l.contains("not loaded")),
        "{list}"
    );
    // A wrong token is refused, and says what to send.
    let (ok, refused) = cli(&server, "not-the-admin-token-at-all", &["list"]);
    assert!(!ok && refused.contains("401"), "{refused}");

    // Load by alias, then it is listed as loaded with its memory.
    let (ok, loaded_out) = cli(&server, token, &["load", "small"]);
    assert!(ok && loaded_out.contains("tiny3: loaded"), "{loaded_out}");
    let client = server.client();
    assert!(loaded(&client.get("/api/ps").await.json).contains(&"tiny3:latest".to_string()));
    // The file's SHA-256, recorded at its first load (hashed off the load's path).
    let expected = String::from_utf8_lossy(
        &std::process::Command::new("sha256sum")
            .arg(&tiny)
            .output()
            .expect("sha256sum")
            .stdout,
    )
    .split_whitespace()
    .next()
    .unwrap_or_default()
    .to_string();
    let recorded = common::server::eventually(Duration::from_secs(30), || async {
        let listed: Value = reqwest::Client::new()
            .get(format!("{}/ops/models", server.base))
            .bearer_auth(token)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        listed["models"]
            .as_array()?
            .iter()
            .find(|m| m["id"] == "tiny3")?["sha256"]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert_eq!(recorded.as_deref(), Some(expected.as_str()));
    // `/metrics` by model.
    let metrics = client.metrics().await;
    assert!(
        metrics.contains("smolchat_model_loaded{model=\"tiny3\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("smolchat_model_loaded{{model=\"{main}\"}} 1")),
        "{metrics}"
    );
    // The main model cannot be unloaded; an unknown one is named as unknown.
    let (ok, pinned) = cli(&server, token, &["unload", main]);
    assert!(!ok && pinned.contains("409"), "{pinned}");
    let (ok, unknown) = cli(&server, token, &["load", "nope"]);
    assert!(!ok && unknown.contains("404"), "{unknown}");

    // Made the default, it answers requests that name no model, and new conversations.
    let (ok, out) = cli(&server, token, &["default", "tiny3"]);
    assert!(ok && out.contains("tiny3: default"), "{out}");
    let r = client
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.json["model"], "tiny3", "{}", r.text);
    let id = client.create(json!({})).await;
    assert_eq!(client.conversation(&id).await["settings"]["model"], "tiny3");

    // Unloaded, it is gone from /api/ps; a request loads it again.
    cli(&server, token, &["default", main]);
    let (ok, out) = cli(&server, token, &["unload", "tiny3"]);
    assert!(ok && out.contains("tiny3: unloaded"), "{out}");
    assert_eq!(
        loaded(&client.get("/api/ps").await.json),
        [format!("{main}:latest")]
    );
    text_of(&ask(&client, "tiny3", "Hi", 2).await);
    let (_, list) = cli(&server, token, &["list"]);
    assert!(
        list.lines()
            .any(|l| l.starts_with("tiny3") && l.contains(" loaded")),
        "{list}"
    );
    let metrics = client.metrics().await;
    assert!(
        metrics.contains("smolchat_model_requests_total{model=\"tiny3\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_official_openai_anthropic_and_ollama_clients_list_and_use_every_model() {
    let _turn = TURN.lock().await;
    let python = common::openai_venv();
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = common::reference("smollm3-tiny-q8_0.gguf");
    let entries = format!("[{}]", entry("tiny3", &tiny, &[]));
    let server = Server::start(dir.path(), &[("SMOLCHAT_MODELS__ENTRIES", &entries)]).await;
    let script = common::crate_root().join("tests/models_clients.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .env("SMOLCHAT_BASE", &server.base)
        .env("SMOLCHAT_MODELS", "SmolLM2-135M-Instruct.Q4_1,tiny3")
        .output()
        .await
        .expect("run the clients");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}\n{}", server.log_text());
    assert!(text.contains("9 passed, 0 failed"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_that_is_no_model_is_refused_naming_the_file_and_what_is_wrong() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("notes.gguf");
    std::fs::write(&bad, "these are notes, not a model\n").expect("write");
    let entries = format!("[{}]", entry("broken", &bad, &[]));
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__ENTRIES", &entries),
            ("SMOLCHAT_MODEL__ANSWER_UNKNOWN_NAMES", "true"),
        ],
    )
    .await;
    let client = server.client();
    let r = ask(&client, "broken", "Hi", 2).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text);
    let message = r.json["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&bad.display().to_string()) && message.contains("not a GGUF file"),
        "{message}"
    );
    // The other models still answer, and the listing says it is not loaded.
    text_of(&ask(&client, "", "Hi", 2).await);
    let listed = client.get("/v1/models").await;
    assert_eq!(listed.json["data"][1]["status"]["value"], "unloaded");
    // With `model.answer_unknown_names`, a name no model has is answered by the default model
    // (a configured model that fails stays refused); the listing still knows only real names.
    let unknown = ask(&client, "gpt-4o", "Hi", 2).await;
    assert_eq!(
        unknown.json["model"], "SmolLM2-135M-Instruct.Q4_1",
        "{}",
        unknown.text
    );
    assert_eq!(
        client.get("/v1/models/gpt-4o").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_account_chooses_the_model_its_new_chats_start_on() {
    use common::browser_client::Browser;
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = common::reference("smollm3-tiny-q8_0.gguf");
    // Its own default sampling, which its new conversations take.
    let entries = format!(
        "[{{id = \"tiny3\", path = {:?}, aliases = [\"small\"], temperature = 0.25, top_k = 7}}]",
        tiny.display().to_string()
    );
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__ENTRIES", &entries),
            ("SMOLCHAT_AUTH__SIGNUP", "open"),
        ],
    )
    .await;
    let main = "SmolLM2-135M-Instruct.Q4_1";
    let form = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| format!("{k}={}", common::server::form_encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    };
    let mut ann = Browser::at(&server, 21, "/signup").await;
    let a = ann
        .post_form(
            "/signup",
            &form(&[("name", "ann"), ("password", "correct horse battery")]),
        )
        .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.text);
    let page = ann.get("/account").await;
    assert!(page.text.contains("id=\"default-model\""), "{}", page.text);
    // By alias; the answer names the model.
    let set = ann
        .post_form("/account/default-model", &form(&[("model", "small")]))
        .await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.text);
    assert!(
        set.text.contains("New chats start on tiny3"),
        "{}",
        set.text
    );
    let created = ann
        .json(
            reqwest::Method::POST,
            "/api/conversations",
            Some(&json!({})),
        )
        .await;
    let created: Value = serde_json::from_str(&created.text).expect("json");
    assert_eq!(created["settings"]["model"], "tiny3", "{created}");
    assert_eq!(created["settings"]["temperature"], 0.25, "{created}");
    assert_eq!(created["settings"]["top_k"], 7, "{created}");
    // A temperature the caller gives wins over the model's.
    let chosen = ann
        .json(
            reqwest::Method::POST,
            "/api/conversations",
            Some(&json!({"temperature": 0.9})),
        )
        .await;
    let chosen: Value = serde_json::from_str(&chosen.text).expect("json");
    assert_eq!(chosen["settings"]["temperature"], 0.9, "{chosen}");
    assert_eq!(chosen["settings"]["top_k"], 7, "{chosen}");
    // The new-chat page picks it; another account's does not.
    let home = ann.get("/").await;
    assert!(
        home.text.contains("<option value=\"tiny3\" selected>"),
        "{}",
        home.text
    );
    let mut bob = Browser::at(&server, 22, "/").await;
    let home = bob.get("/").await;
    assert!(
        home.text
            .contains(&format!("<option value=\"{main}\" selected>")),
        "{}",
        home.text
    );
    // A model the server does not serve is refused, naming the ones it does.
    let bad = ann
        .post_form("/account/default-model", &form(&[("model", "gpt-9")]))
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text);
    assert!(bad.text.contains("tiny3"), "{}", bad.text);
    // Empty: back to the server's default.
    let reset = ann
        .post_form("/account/default-model", &form(&[("model", "")]))
        .await;
    assert!(
        reset.text.contains(&format!("New chats start on {main}")),
        "{}",
        reset.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unloaded_models_spilled_cache_goes_with_its_deleted_conversation() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = common::reference("smollm3-tiny-q8_0.gguf");
    let entries = format!("[{}]", entry("tiny3", &tiny, &[]));
    let token = "models-spill-admin-token-0123456789";
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__ENTRIES", &entries),
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", token),
        ],
    )
    .await;
    let client = server.client();
    let id = client
        .create(json!({"model": "tiny3", "temperature": 0, "max_tokens": 4}))
        .await;
    let turn = client.chat(&id, "Hello there.").await;
    assert_eq!(turn.message()["timings"]["model"], "tiny3", "{}", turn.done);
    // Unloaded, the model writes the conversation's cache to its own spill folder.
    let (ok, out) = cli(&server, token, &["unload", "tiny3"]);
    assert!(ok, "{out}");
    let file = dir
        .path()
        .join("kv-spill")
        .join("local--tiny3")
        .join(format!("{id}.kv"));
    assert!(file.exists(), "{} is missing", file.display());
    // Deleted while its model is not loaded: the file goes too.
    let r = client
        .send_json(
            reqwest::Method::DELETE,
            &format!("/api/conversations/{id}"),
            &json!({}),
        )
        .await;
    assert!(r.status.is_success(), "{}", r.text);
    assert!(!file.exists(), "{} is still there", file.display());
}
