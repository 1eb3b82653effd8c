//! Replies rendered while they stream, in a real headless Chromium against a real `smolchat
//! serve` with the real SmolLM2 model: highlighted code and typeset math show before the reply
//! is done, and markup the model writes (`<img onerror>`, `<script>`, `javascript:` links) never
//! becomes an element, during streaming or after.
//!
//! The reply's text is fixed by the conversation's GBNF grammar (the reply-grammar setting), so
//! the real model writes exactly the markdown under test, token by token, at its own pace.

mod common;

use common::chromium::*;
use common::server::Server;
use serde_json::{json, Value};

/// The markdown the model is made to write: a code block, a formula, hostile markup, and a long
/// tail so the checks run while the reply still streams.
fn scripted_reply() -> String {
    let mut reply = String::from(
        "Here is the code:\n\n```rust\nfn main() {\n    let answer = 42;\n    println!(\"{answer}\");\n}\n```\n\n\
         Euler says $e^{i\\pi} + 1 = 0$, and\n\n$$\\int_0^1 x\\,dx = \\frac{1}{2}$$\n\n\
         <img src=x onerror=\"document.body.dataset.pwned='img'\"> \
         <script>document.body.dataset.pwned='script'</script> \
         [click me](javascript:document.body.dataset.pwned='link')\n\n",
    );
    for i in 0..30 {
        reply.push_str(&format!("Line {i} of the tail keeps the reply streaming. "));
    }
    reply
}

/// `text` as a GBNF string literal.
fn gbnf_literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// What the page shows of the last reply: whether it still streams, highlighted code, typeset
/// math, and any trace of the hostile markup.
const LOOK: &str = "const m = [...document.querySelectorAll('.msg.assistant')].pop(); \
    if (!m) return null; \
    return { \
      streaming: m.classList.contains('streaming'), \
      highlighted: !!m.querySelector('.md pre code.hljs span[class^=\"hljs-\"]'), \
      inlineMath: !!m.querySelector('.md .math-inline .katex'), \
      displayMath: !!m.querySelector('.md .math-display .katex-display, .md .math-display .katex'), \
      img: document.querySelectorAll('.messages img').length, \
      script: m.querySelectorAll('script').length, \
      jsLink: [...document.querySelectorAll('.messages a')].filter(a => (a.getAttribute('href') || '').toLowerCase().includes('javascript')).length, \
      pwned: document.body.dataset.pwned || null, \
      text: m.querySelector('.md') ? m.querySelector('.md').textContent : '' \
    };";

fn clean(look: &Value) -> bool {
    look["img"] == json!(0)
        && look["script"] == json!(0)
        && look["jsLink"] == json!(0)
        && look["pwned"].is_null()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_and_math_render_while_streaming_and_markup_never_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_SAMPLING__MAX_TOKENS", "2000")]).await;
    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("a"), DESKTOP).await;
    c.goto(&server.base).await.expect("open");

    // A conversation whose replies must be the scripted text, made through the JSON API from
    // the page (the browser's own session and CSRF token).
    let grammar = format!("root ::= {}", gbnf_literal(&scripted_reply()));
    let created = c
        .execute_async(
            &format!(
                "const done = arguments[arguments.length - 1]; \
                 fetch('/api/conversations', {{method: 'POST', credentials: 'same-origin', \
                   headers: {{'content-type': 'application/json', 'x-csrf-token': document.body.dataset.csrf}}, \
                   body: JSON.stringify({{grammar: {}, max_tokens: 2000}})}}) \
                 .then(r => r.text().then(t => done([r.status, t]))) \
                 .catch(e => done([0, String(e)]));",
                json!(grammar)
            ),
            vec![],
        )
        .await
        .expect("create the conversation");
    assert_eq!(created[0], json!(201), "{created}");
    let id = serde_json::from_str::<Value>(created[1].as_str().unwrap_or(""))
        .ok()
        .and_then(|v| v["id"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no id in {created}"));
    c.goto(&format!("{}/c/{id}", server.base))
        .await
        .expect("open the conversation");
    // The settings panel shows the grammar.
    let shown = js(
        &c,
        "return document.querySelector('#settings textarea[name=grammar]').value",
    )
    .await;
    assert_eq!(shown, json!(grammar));
    send(&c, "Show me some code and a formula.").await;

    // While it streams: highlighted code, typeset math, nothing hostile.
    let during = wait_js(
        &c,
        &format!("return (() => {{ {LOOK} }})()"),
        "code and math while streaming",
        |v| {
            assert!(
                v.is_null() || clean(v),
                "hostile markup took effect while streaming: {v}"
            );
            v["highlighted"] == json!(true)
                && v["inlineMath"] == json!(true)
                && v["displayMath"] == json!(true)
        },
    )
    .await;
    assert_eq!(
        during["streaming"],
        json!(true),
        "the reply finished before its code and math were seen rendered: {during}"
    );
    screenshot(&c, "live-rendering").await;

    // Done: the stored reply renders the same way, and still nothing hostile ran.
    wait_js(&c, IDLE, "the reply to finish", |v| v == &json!(1)).await;
    let after = js(&c, &format!("return (() => {{ {LOOK} }})()")).await;
    assert!(clean(&after), "{after}");
    assert_eq!(after["streaming"], json!(false), "{after}");
    assert!(
        after["highlighted"] == json!(true)
            && after["inlineMath"] == json!(true)
            && after["displayMath"] == json!(true),
        "{after}"
    );
    assert!(
        after["text"]
            .as_str()
            .unwrap_or("")
            .contains("<img src=x onerror"),
        "the markup shows as text: {after}"
    );
    // The whole scripted text arrived: the last tail line is there.
    assert!(
        after["text"]
            .as_str()
            .unwrap_or("")
            .contains("Line 29 of the tail keeps the reply streaming."),
        "{after}"
    );
    // And after a reload (the page rendered by the server from the store).
    c.refresh().await.expect("reload");
    let reloaded = wait_js(
        &c,
        &format!("return (() => {{ {LOOK} }})()"),
        "the reloaded reply",
        |v| v["highlighted"] == json!(true) && v["inlineMath"] == json!(true),
    )
    .await;
    assert!(clean(&reloaded), "{reloaded}");
}
