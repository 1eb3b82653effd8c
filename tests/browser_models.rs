//! The model picker in a real headless Chromium against a real `smolchat serve` serving three
//! models (the real SmolLM2 file, a second quantization of it written here, and the tiny SmolLM3
//! file): a new chat is made on the model picked, its replies name the model that wrote them,
//! a switch mid-conversation makes the next reply come from the new model (loaded for it), and
//! the thinking switch is shown only for a model whose template can think.

mod common;

use common::chromium::*;
use common::server::Server;
use fantoccini::Client;
use serde_json::{json, Value};

async fn conversation(c: &Client, id: &str) -> Value {
    let (status, conv) = fetch(c, "GET", &format!("/api/conversations/{id}"), None).await;
    assert_eq!(status, 200, "{conv}");
    conv
}

fn replies_models(conv: &Value) -> Vec<String> {
    conv["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["timings"]["model"].as_str().unwrap_or("?").to_string())
        .collect()
}

const ADMIN_TOKEN: &str = "models-browser-admin-token";

const THINKING_SHOWN: &str = "const s = document.getElementById('thinking-switch'); \
     return s !== null && !s.hidden && getComputedStyle(s).display !== 'none';";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pick_a_model_for_a_new_chat_then_switch_mid_conversation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let q8 = dir.path().join("smollm2-q8_0.gguf");
    let mut src = smolchat_gguf::GgufSource::open(&common::smollm2_path()).expect("open");
    smolchat_engine::synthetic::requantize_as_gguf(&mut src, &q8, smolchat_gguf::GgmlDType::Q8_0)
        .expect("write the q8_0 file");
    let tiny = common::reference("smollm3-tiny-q8_0.gguf");
    let entries = format!(
        "[{{id = \"smollm2-q8\", path = {:?}}}, {{id = \"tiny3\", path = {:?}}}, \
         {{id = \"tiny3-quiet\", path = {:?}, thinking = false}}]",
        q8.display().to_string(),
        tiny.display().to_string(),
        tiny.display().to_string()
    );
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__ENTRIES", entries.as_str()),
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "8"),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "0"),
            ("SMOLCHAT_SCHEDULER__KV_BUDGET_MIB", "16"),
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
        ],
    )
    .await;
    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("profile"), DESKTOP).await;
    c.goto(&server.base).await.expect("open");

    // The new-chat page offers every model; the default is picked, the others not loaded yet.
    let options = js(
        &c,
        "return [...document.querySelectorAll('#model-select option')].map(o => o.textContent)",
    )
    .await;
    assert_eq!(
        options,
        json!([
            "SmolLM2-135M-Instruct.Q4_1",
            "smollm2-q8 (not loaded)",
            "tiny3 (not loaded)",
            "tiny3-quiet (not loaded)"
        ])
    );
    js(
        &c,
        "document.getElementById('model-select').value = 'smollm2-q8'; return true",
    )
    .await;
    send(&c, "Hello there.").await;
    wait_js(&c, IDLE, "the first reply", |v| v == &json!(1)).await;
    let id = conversation_id(&c).await;
    let conv = conversation(&c, &id).await;
    assert_eq!(conv["settings"]["model"], "smollm2-q8", "{conv}");
    assert_eq!(replies_models(&conv), ["smollm2-q8"]);
    // The page shows the model: picked in the header, named on the reply.
    assert_eq!(
        js(&c, "return document.getElementById('model-select').value").await,
        json!("smollm2-q8")
    );
    let stats = js(
        &c,
        "return document.querySelector('.msg.assistant .stats').textContent",
    )
    .await;
    assert!(
        stats.as_str().is_some_and(|s| s.starts_with("smollm2-q8")),
        "{stats}"
    );
    // SmolLM2's template has no thinking switch: none is shown.
    assert_eq!(js(&c, THINKING_SHOWN).await, json!(false));

    // Switch to the SmolLM3 model mid-conversation and continue.
    js(
        &c,
        "const s = document.getElementById('model-select'); s.value = 'tiny3'; \
         s.dispatchEvent(new Event('change')); return true",
    )
    .await;
    wait_js(&c, THINKING_SHOWN, "the thinking switch for SmolLM3", |v| {
        v == &json!(true)
    })
    .await;
    let conv = conversation(&c, &id).await;
    assert_eq!(conv["settings"]["model"], "tiny3", "{conv}");
    send(&c, "And now?").await;
    wait_js(&c, IDLE, "the second reply", |v| v == &json!(2)).await;
    let conv = conversation(&c, &id).await;
    assert_eq!(replies_models(&conv), ["smollm2-q8", "tiny3"], "{conv}");

    // Reloaded, the page shows the conversation's model and its switch.
    c.refresh().await.expect("reload");
    wait_js(
        &c,
        "return document.getElementById('model-select').value",
        "the picker after a reload",
        |v| v == &json!("tiny3"),
    )
    .await;
    assert_eq!(js(&c, THINKING_SHOWN).await, json!(true));
    let options = js(
        &c,
        "return [...document.querySelectorAll('#model-select option')].map(o => o.textContent)",
    )
    .await;
    assert_eq!(
        options,
        json!([
            "SmolLM2-135M-Instruct.Q4_1",
            "smollm2-q8",
            "tiny3",
            "tiny3-quiet (not loaded)"
        ])
    );
    // The admin page lists the models; an admin unloads one and loads it again from there.
    let admin = browser(&driver, &dir.path().join("admin"), DESKTOP).await;
    admin
        .goto(&format!("{}/admin", server.base))
        .await
        .expect("admin");
    fill(&admin, "#admin-token", ADMIN_TOKEN).await;
    click(&admin, "#login-btn").await;
    let state_of = |id: &str| {
        format!(
            "const r = document.querySelector('#models tr[data-model=\"{id}\"]'); \
             return r ? r.children[1].querySelector('.pill').textContent : ''"
        )
    };
    wait_js(
        &admin,
        &state_of("smollm2-q8"),
        "smollm2-q8 loaded on the admin page",
        |v| v == &json!("loaded"),
    )
    .await;
    // The table is swapped every 2 s: a click can land on a row just replaced, so each button
    // is pressed again until its action shows.
    for (button, after) in [("unload", "not loaded"), ("load", "loaded")] {
        let mut shown = Value::Null;
        for _ in 0..10 {
            js(
                &admin,
                &format!(
                    "const b = document.querySelector('#models tr[data-model=\"smollm2-q8\"] \
                     button[hx-post$=\"/{button}\"]'); if (b) b.click(); return !!b"
                ),
            )
            .await;
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
            shown = js(&admin, &state_of("smollm2-q8")).await;
            if shown == json!(after) {
                break;
            }
        }
        assert_eq!(shown, json!(after), "after pressing {button}");
    }
    admin.close().await.expect("close");

    // The same SmolLM3 file configured not to think: no switch.
    js(
        &c,
        "const s = document.getElementById('model-select'); s.value = 'tiny3-quiet'; \
         s.dispatchEvent(new Event('change')); return true",
    )
    .await;
    wait_js(&c, THINKING_SHOWN, "the thinking switch hidden", |v| {
        v == &json!(false)
    })
    .await;
    c.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_model_titles_a_new_conversation_and_the_sidebar_shows_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_MODELS__TASK", "SmolLM2-135M-Instruct.Q4_1"),
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "64"),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "0"),
        ],
    )
    .await;
    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("profile"), DESKTOP).await;
    c.goto(&server.base).await.expect("open");
    send(&c, "What is the tallest mountain on Mars?").await;
    wait_js(&c, IDLE, "the first reply", |v| v == &json!(1)).await;
    let id = conversation_id(&c).await;
    // The heading and the sidebar take the title when the task model has written it.
    let title = wait_js(
        &c,
        "const h = document.getElementById('conv-title').textContent; \
         return h === 'New chat' ? '' : h",
        "the title written by the task model",
        |v| v.as_str().is_some_and(|t| !t.is_empty()),
    )
    .await;
    let title = title.as_str().unwrap_or_default().to_string();
    eprintln!("the task model's title: {title:?}");
    wait_js(
        &c,
        &format!(
            "return [...document.querySelectorAll('#conv-list a')].some(a => a.textContent.includes({}))",
            serde_json::to_string(&title).unwrap_or_default()
        ),
        "the title in the sidebar",
        |v| v == &json!(true),
    )
    .await;
    let conv = conversation(&c, &id).await;
    assert_eq!(conv["title"], title.as_str(), "{conv}");
    // The questions to ask next appear under the reply; one click sends one.
    let questions = wait_js(
        &c,
        "const f = document.getElementById('follow-ups'); \
         return f.hidden ? [] : [...f.querySelectorAll('.follow-up')].map(b => b.textContent)",
        "the suggested questions",
        |v| v.as_array().is_some_and(|a| !a.is_empty()),
    )
    .await;
    eprintln!("the task model's questions: {questions}");
    let first = questions[0].as_str().unwrap_or_default().to_string();
    // Kept: a reload shows them again.
    c.refresh().await.expect("reload");
    wait_js(
        &c,
        "const f = document.getElementById('follow-ups'); return f.hidden ? '' : f.querySelector('.follow-up').textContent",
        "the questions after a reload",
        |v| v == &json!(first),
    )
    .await;
    click(&c, "#follow-ups .follow-up").await;
    wait_js(&c, IDLE, "the second reply", |v| v == &json!(2)).await;
    let conv = conversation(&c, &id).await;
    let users: Vec<&str> = conv["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "user")
        .filter_map(|m| m["content"].as_str())
        .collect();
    assert_eq!(
        users,
        ["What is the tallest mountain on Mars?", first.as_str()]
    );
    // A second reply does not retitle it.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(conversation(&c, &id).await["title"], title.as_str());
    c.close().await.expect("close");
}
