//! Pages everyone can use, in a real headless Chromium against a real `smolchat serve`: times in
//! the browser's zone, keyboard shortcuts (help overlay, focus, search, stop, regenerate, the
//! sidebar), finished replies announced in a live region, a copy button on every message, an
//! accessible name on every control of the chat page, and the web app manifest with its icons.

mod common;

use common::chromium::*;
use common::server::Server;
use fantoccini::{Client, Locator};
use serde_json::json;

/// Presses `keys` (WebDriver key codes: Ctrl U+E009, Shift U+E008, Escape U+E00C; U+E000
/// releases the modifiers) in the element `css`.
async fn press(c: &Client, css: &str, keys: &str) {
    c.find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css}: {e}"))
        .send_keys(keys)
        .await
        .unwrap_or_else(|e| panic!("keys in {css}: {e}"));
}

const CTRL: &str = "\u{E009}";
const SHIFT: &str = "\u{E008}";
const ESC: &str = "\u{E00C}";
const RELEASE: &str = "\u{E000}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn times_shortcuts_announcements_and_labels_in_a_real_browser() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "200"),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "0.7"),
        ],
    )
    .await;
    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("a"), DESKTOP).await;
    c.goto(&server.base).await.expect("open");
    send(&c, "Say hello in one word.").await;
    wait_js(
        &c,
        "return location.pathname",
        "the conversation page",
        |v| v.as_str().is_some_and(|p| p.starts_with("/c/")),
    )
    .await;
    wait_js(&c, IDLE, "the reply", |v| v == &json!(1)).await;

    // The sidebar's time, in the browser's zone (the server wrote UTC and said so).
    let time = js(
        &c,
        "const t = document.querySelector('#conv-list time'); const d = new Date(t.getAttribute('datetime')); \
         return [t.textContent, d.toLocaleString(undefined, {month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit'})]",
    )
    .await;
    assert_eq!(time[0], time[1], "local time");
    assert!(!time[0].as_str().unwrap_or("").contains("UTC"));

    // The finished reply was announced.
    let said = wait_js(
        &c,
        "return document.getElementById('announcer').textContent",
        "the announcement",
        |v| v.as_str().is_some_and(|t| t.starts_with("Reply: ")),
    )
    .await;
    let reply = js(
        &c,
        "return document.querySelector('.msg.assistant .md').innerText.trim()",
    )
    .await;
    assert!(
        said.as_str().unwrap_or("").contains(
            reply
                .as_str()
                .unwrap_or("")
                .chars()
                .take(20)
                .collect::<String>()
                .as_str()
        ),
        "{said} / {reply}"
    );

    // Every control has an accessible name.
    let unnamed = js(
        &c,
        "return Array.from(document.querySelectorAll('button, a, input, textarea, select')) \
           .filter(e => e.offsetParent !== null || e.closest('dialog')) \
           .filter(e => !(e.getAttribute('aria-label') || e.textContent.trim() || (e.labels && e.labels.length) \
              || e.getAttribute('aria-labelledby') || e.getAttribute('placeholder'))) \
           .map(e => e.outerHTML.slice(0, 120))",
    )
    .await;
    assert_eq!(unnamed, json!([]), "controls without a name");

    // Installable: a manifest with the icons a phone asks for, every one served as a PNG.
    let app = js(
        &c,
        "const href = document.querySelector('link[rel=manifest]').href;          const get = (u) => { const x = new XMLHttpRequest(); x.open('GET', u, false); x.send();            return [x.status, x.getResponseHeader('Content-Type'), x.responseText]; };          const [status, type, text] = get(href); const m = JSON.parse(text);          return [status, type, m.display, m.start_url,            m.icons.filter(i => i.type === 'image/png').map(i => [i.sizes, get(i.src)[0], get(i.src)[1]])]",
    )
    .await;
    assert_eq!(
        app,
        json!([
            200,
            "application/manifest+json",
            "standalone",
            "/",
            [
                ["192x192", 200, "image/png"],
                ["512x512", 200, "image/png"],
                ["512x512", 200, "image/png"]
            ]
        ])
    );

    // A copy button on every message (and on code blocks).
    let copies = js(
        &c,
        "return [document.querySelectorAll('.msg').length, document.querySelectorAll('.msg .msg-copy-btn').length]",
    )
    .await;
    assert_eq!(copies[0], copies[1], "one copy button per message");
    click(&c, ".msg.assistant .msg-copy-btn").await;
    wait_js(
        &c,
        "return document.querySelector('.msg.assistant .msg-copy-btn').textContent",
        "the reply copied",
        |v| v == &json!("Copied"),
    )
    .await;

    // Ctrl+/ opens the shortcut list; Escape closes it.
    press(&c, "#input", &format!("{CTRL}/{RELEASE}")).await;
    wait_js(
        &c,
        "return document.getElementById('shortcuts').open",
        "the shortcut list",
        |v| v == &json!(true),
    )
    .await;
    screenshot(&c, "shortcuts").await;
    press(&c, "#shortcuts-close", ESC).await;
    wait_js(
        &c,
        "return document.getElementById('shortcuts').open",
        "the list closed",
        |v| v == &json!(false),
    )
    .await;

    // Ctrl+K: search; Shift+Esc: back to the message box.
    press(&c, "#input", &format!("{CTRL}k{RELEASE}")).await;
    wait_js(
        &c,
        "return document.activeElement.id",
        "search focused",
        |v| v == &json!("search"),
    )
    .await;
    press(&c, "#search", &format!("{SHIFT}{ESC}{RELEASE}")).await;
    wait_js(
        &c,
        "return document.activeElement.id",
        "the message box focused",
        |v| v == &json!("input"),
    )
    .await;

    // Ctrl+Shift+S hides and shows the sidebar.
    press(&c, "#input", &format!("{CTRL}{SHIFT}s{RELEASE}")).await;
    let hidden = js(
        &c,
        "return document.body.classList.contains('sidebar-hidden')",
    )
    .await;
    assert_eq!(hidden, json!(true));
    press(&c, "#input", &format!("{CTRL}{SHIFT}s{RELEASE}")).await;
    let hidden = js(
        &c,
        "return document.body.classList.contains('sidebar-hidden')",
    )
    .await;
    assert_eq!(hidden, json!(false));

    // Ctrl+Shift+Y regenerates the last reply: a second version.
    press(&c, "#input", &format!("{CTRL}{SHIFT}y{RELEASE}")).await;
    wait_js(
        &c,
        "const e = document.querySelector('.msg.assistant:last-child .ver-count'); \
         return document.getElementById('stop-btn').hidden && e ? e.textContent : null",
        "a regenerated version",
        |v| v == &json!("2/2"),
    )
    .await;

    // Escape stops a reply being written. A sampled reply can end by itself before the key
    // lands (the model wrote six tokens once): then another long prompt, a few times at most.
    let mut stopped = false;
    for (n, prompt) in [
        "Tell me a long story about a lighthouse keeper and the sea.",
        "Write a long essay about the history of bread, with many details.",
        "List one hundred animals, one per line.",
        "Describe every planet of the solar system at length.",
    ]
    .iter()
    .enumerate()
    {
        send(&c, prompt).await;
        wait_js(&c, STREAM_LEN, "streaming text", |v| {
            v.as_i64().unwrap_or(-1) > 0
        })
        .await;
        press(&c, "#input", ESC).await;
        wait_js(&c, IDLE, "the reply to end", |v| v == &json!(n as i64 + 2)).await;
        let stats = wait_js(
            &c,
            "const s = document.querySelectorAll('.msg.assistant .stats'); return s.length ? s[s.length-1].textContent : ''",
            "the reply's stats",
            |v| v.as_str().is_some_and(|s| !s.is_empty()),
        )
        .await;
        if stats.as_str().unwrap_or("").contains("stopped") {
            stopped = true;
            break;
        }
    }
    assert!(stopped, "Escape stopped none of the replies");
}
