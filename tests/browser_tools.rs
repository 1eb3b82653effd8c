//! Tools in the chat in a real headless Chromium against a real `smolchat serve` (the real
//! SmolLM2 file; every call of the built-in tools needs the user's approval here, and every
//! reply's first step must call one): a call waits with Allow and Deny; the page reloaded
//! mid-loop shows it still waiting and the loop goes on when allowed; a denied call is shown
//! denied and the reply goes on; Stop while a call waits ends the reply. Each call renders as a
//! block in the finished reply, where it was made.

mod common;

use common::chromium::*;
use common::server::Server;
use serde_json::{json, Value};

const WAITING: &str =
    "const b = document.querySelector('.tool-step.status-awaiting_approval .tool-allow'); \
     return b !== null && !b.disabled;";

/// The finished replies' tool blocks' statuses, in order.
const BLOCKS: &str =
    "return [...document.querySelectorAll('.msg.assistant:not(.streaming) .tool-step')] \
     .map(b => [...b.classList].find(c => c.startsWith('status-')));";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_and_deny_calls_reload_mid_loop_and_stop_while_one_waits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[(
            "SMOLCHAT_TOOLS__REQUIRE_APPROVAL",
            "[\"calculator\", \"current_time\"]",
        )],
    )
    .await;
    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("profile"), DESKTOP).await;
    c.goto(&server.base).await.expect("open");
    let (status, created) = fetch(
        &c,
        "POST",
        "/api/conversations",
        Some(json!({
            "temperature": 0,
            "max_tokens": 96,
            "tools": ["calculator", "current_time"],
            "tool_choice": "required",
        })),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("id").to_string();
    c.goto(&format!("{}/c/{id}", server.base))
        .await
        .expect("open the conversation");
    // The settings show the tools chosen and the first step.
    assert_eq!(
        js(
            &c,
            "return [...document.querySelectorAll('.tools-field input[type=checkbox]')] \
             .map(i => [i.name, i.checked])"
        )
        .await,
        json!([
            ["tool:calculator", true],
            ["tool:current_time", true],
            ["tool:search_conversations", false]
        ])
    );

    // A call waits with its buttons; reloaded meanwhile, the page shows it waiting still.
    send(&c, "What is 6 times 7?").await;
    wait_js(&c, WAITING, "a call waiting for approval", |v| {
        v == &json!(true)
    })
    .await;
    c.refresh().await.expect("reload");
    wait_js(&c, WAITING, "the call still waiting after a reload", |v| {
        v == &json!(true)
    })
    .await;
    click(&c, ".tool-step.status-awaiting_approval .tool-allow").await;
    wait_js(&c, IDLE, "the first reply", |v| v == &json!(1)).await;
    let first = js(&c, BLOCKS).await;
    let first = first.as_array().expect("blocks");
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(
        first[0] == "status-done" || first[0] == "status-error",
        "an allowed call ran: {first:?}"
    );

    // Denied: shown denied, and the reply goes on.
    send(&c, "And what time is it?").await;
    wait_js(&c, WAITING, "the second call", |v| v == &json!(true)).await;
    click(&c, ".tool-step.status-awaiting_approval .tool-deny").await;
    wait_js(&c, IDLE, "the second reply", |v| v == &json!(2)).await;
    let blocks = js(&c, BLOCKS).await;
    assert_eq!(blocks[1], json!("status-denied"), "{blocks}");
    let conv: Value = fetch(&c, "GET", &format!("/api/conversations/{id}"), None)
        .await
        .1;
    let replies: Vec<&Value> = conv["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "assistant")
        .collect();
    assert_eq!(replies[1]["status"], "complete", "{conv}");

    // Stop while a call waits: the reply ends stopped, the call with it.
    send(&c, "What is 2 plus 2?").await;
    wait_js(&c, WAITING, "the third call", |v| v == &json!(true)).await;
    click(&c, "#stop-btn").await;
    wait_js(&c, IDLE, "the stopped reply", |v| v == &json!(3)).await;
    let conv: Value = fetch(&c, "GET", &format!("/api/conversations/{id}"), None)
        .await
        .1;
    let last = conv["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(last["status"], "stopped", "{conv}");
    let blocks = js(&c, BLOCKS).await;
    assert_eq!(blocks[2], json!("status-error"), "{blocks}");
    screenshot(&c, "tools").await;
}
