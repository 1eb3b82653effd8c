//! Speculative decoding through the server, with the real SmolLM2: the same greedy replies with
//! `scheduler.speculative` on (the default) and off (a reply that copies a given text, where prompt lookup
//! finds drafts, and free chat), the drafts counted in `/metrics`, and the admin page's tile.

mod common;

use common::browser_client::Browser;
use common::server::{metric, Server};
use serde_json::{json, Value};

const CODE: &str = "def add(a, b):\n    return a + b\n\n\ndef mean(values):\n    total = 0\n    for v in values:\n        total = add(total, v)\n    return total / len(values)\n";

async fn greedy(server: &Server, prompt: &str) -> String {
    let res = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 96,
            "temperature": 0,
        }))
        .send()
        .await
        .expect("request");
    assert!(res.status().is_success(), "{}", res.status());
    let v: Value = res.json().await.expect("json");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_are_the_same_with_speculation_and_drafts_are_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let off_dir = dir.path().join("off");
    std::fs::create_dir_all(&off_dir).expect("dir");
    let off = Server::start(&off_dir, &[("SMOLCHAT_SCHEDULER__SPECULATIVE", "false")]).await;
    let on_dir = dir.path().join("on");
    std::fs::create_dir_all(&on_dir).expect("dir");
    let on = Server::start(
        &on_dir,
        &[
            ("SMOLCHAT_SCHEDULER__SPECULATIVE", "true"),
            // Draft whatever lookup finds: the measured break-even depends on this machine's
            // timing (and a debug build's host work per position), and this test needs drafts.
            ("SMOLCHAT_SCHEDULER__DRAFT_BREAK_EVEN", "0"),
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", "speculation-admin-token"),
        ],
    )
    .await;
    let rewrite = format!(
        "Rewrite this Python code with `add` renamed to `plus`, changing nothing else:\n\n```python\n{CODE}```"
    );
    for prompt in [rewrite.as_str(), "Tell me about the sea in two sentences."] {
        let a = greedy(&off, prompt).await;
        let b = greedy(&on, prompt).await;
        assert_eq!(a, b, "the same greedy reply for {prompt:?}");
    }
    let metrics = on.client().metrics().await;
    let drafted = metric(&metrics, "smolchat_spec_drafted_tokens_total").unwrap_or(0.0);
    let accepted = metric(&metrics, "smolchat_spec_accepted_tokens_total").unwrap_or(0.0);
    println!("drafted {drafted}, accepted {accepted}");
    assert!(drafted > 0.0 && accepted > 0.0, "{metrics}");
    let plain = off.client().metrics().await;
    assert_eq!(
        metric(&plain, "smolchat_spec_drafted_tokens_total").unwrap_or(0.0),
        0.0,
        "off means off"
    );
    // The admin page's speculation tile.
    let mut admin = Browser::admin(&on, 3, "speculation-admin-token").await;
    let live = admin.get("/admin/live").await;
    assert_eq!(live.status, reqwest::StatusCode::OK, "{}", live.text);
    assert!(live.text.contains("id=\"speculation\""), "{}", live.text);
    assert!(
        live.text.contains("tokens per verifying step"),
        "{}",
        live.text
    );
    // The measured step cost that decides where drafts pay, on the tile and in /metrics.
    assert!(live.text.contains("a position costs"), "{}", live.text);
    let per_position = metric(&metrics, "smolchat_step_position_seconds").unwrap_or(0.0);
    let fixed = metric(&metrics, "smolchat_step_fixed_seconds").unwrap_or(0.0);
    // (Their split is noisy on a shared machine; that they are measured and exported is what
    // this checks.)
    assert!(
        per_position > 0.0 && fixed >= 0.0,
        "a position {per_position} s, fixed {fixed} s"
    );

    // Per conversation: a conversation's turn that copies shows its acceptance in its row.
    let c = on.client();
    let id = c
        .create(json!({"temperature": 0, "max_tokens": 96, "thinking": false}))
        .await;
    c.chat(&id, &rewrite).await;
    let live = admin.get("/admin/live").await;
    let row = live
        .text
        .split(&format!("data-id=\"{id}\""))
        .nth(1)
        .and_then(|r| r.split("</tr>").next())
        .unwrap_or_default()
        .to_string();
    let drafts = row
        .split("class=\"drafts\">")
        .nth(1)
        .and_then(|r| r.split('<').next())
        .unwrap_or_default();
    println!("the conversation's row: {drafts}");
    assert!(
        drafts.contains("% · ") && drafts.contains("tok/step"),
        "{row}"
    );
    // The reply itself keeps its own counts: in the API's timings and under it on the page.
    let messages = c.messages(&id).await;
    let timings = &messages[1]["timings"];
    let (drafted, accepted) = (
        timings["drafted_tokens"].as_u64().unwrap_or(0),
        timings["accepted_tokens"].as_u64().unwrap_or(0),
    );
    assert!(
        drafted > 0 && accepted > 0 && accepted <= drafted,
        "{timings}"
    );
    let page = c.get(&format!("/c/{id}")).await;
    assert!(
        page.text
            .contains(&format!("{accepted} of {drafted} drafts accepted")),
        "{}",
        page.text
    );
}
