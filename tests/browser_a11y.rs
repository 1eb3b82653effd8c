//! An accessibility audit with axe-core (tests/vendor, from the npm registry; see
//! scripts/vendor-frontend.sh), run in a real headless Chromium against a real `smolchat serve`
//! on the chat page (a conversation with a reply holding code and math, the settings panel
//! open), the settings (account) page, the admin page and the sign-in page, in light and dark:
//! no serious or critical violation.

mod common;

use common::chromium::*;
use common::server::Server;
use fantoccini::{Client, Locator};
use serde_json::{json, Value};

const ADMIN_TOKEN: &str = "a11y-test-admin-token";
const AXE: &str = include_str!("vendor/axe-4.14.1.min.js");

/// axe-core's serious and critical violations on the page shown, as `id: help (targets)`.
async fn audit(c: &Client) -> Vec<String> {
    js(c, &format!("{AXE}\nreturn true;")).await;
    let found = c
        .execute_async(
            "const done = arguments[arguments.length - 1]; \
             axe.run(document, {resultTypes: ['violations']}) \
               .then(r => done(r.violations.filter(v => v.impact === 'serious' || v.impact === 'critical') \
                 .map(v => v.id + ' (' + v.impact + '): ' + v.help + ' — ' + v.nodes.slice(0, 4).map(n => n.target.join(' ') + (n.failureSummary ? ' [' + n.failureSummary.replace(/\\s+/g, ' ').slice(0, 160) + ']' : '')).join('; ')))) \
               .catch(e => done(['axe failed: ' + e]));",
            vec![],
        )
        .await
        .expect("axe.run");
    found
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_else(|| vec![format!("axe returned {found}")])
}

/// A conversation whose reply holds a code block and a formula (the reply grammar fixes it).
async fn conversation_with_code_and_math(c: &Client, base: &str) -> String {
    let grammar =
        "root ::= \"Code:\\n\\n```python\\nprint(1 + 2)\\n```\\n\\nMath: $a^2 + b^2 = c^2$ done.\"";
    let made = c
        .execute_async(
            "const done = arguments[arguments.length - 1]; \
             fetch('/api/conversations', {method: 'POST', credentials: 'same-origin', \
               headers: {'content-type': 'application/json', 'x-csrf-token': document.body.dataset.csrf}, \
               body: JSON.stringify({title: 'Audit', grammar: arguments[0], max_tokens: 200})}) \
             .then(r => r.json().then(j => done(j.id || JSON.stringify(j))));",
            vec![json!(grammar)],
        )
        .await
        .expect("create");
    let id = made.as_str().unwrap_or_default().to_string();
    c.goto(&format!("{base}/c/{id}")).await.expect("open");
    send(c, "Show code and math.").await;
    wait_js(c, IDLE, "the reply", |v| v == &json!(1)).await;
    wait_js(
        c,
        "return !!document.querySelector('.msg.assistant .katex') && !!document.querySelector('.msg.assistant code.hljs')",
        "math and code rendered",
        |v| v == &json!(true),
    )
    .await;
    id
}

async fn admin_login(c: &Client, base: &str) {
    c.goto(&format!("{base}/admin")).await.expect("admin");
    let token = c
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#admin-token"))
        .await
        .expect("login form");
    token.send_keys(ADMIN_TOKEN).await.expect("type");
    click(c, "#login-btn").await;
    wait_js(
        c,
        "return !!document.getElementById('sessions')",
        "the admin page",
        |v| v == &json!(true),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_have_no_serious_accessibility_violations_light_and_dark() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "0"),
        ],
    )
    .await;
    let base = server.base.clone();
    let driver = start_driver(dir.path()).await;
    let mut report = Vec::new();
    for (theme, dark) in [("light", false), ("dark", true)] {
        let c = browser(
            &driver,
            &dir.path().join(theme),
            BrowserOpts { dark, ..DESKTOP },
        )
        .await;
        c.goto(&base).await.expect("open");
        let id = conversation_with_code_and_math(&c, &base).await;
        for (page, found) in [
            ("chat", audit(&c).await),
            ("chat, settings open", {
                click(&c, "#settings-btn").await;
                audit(&c).await
            }),
            ("chat, organise dialog", {
                c.goto(&format!("{base}/c/{id}")).await.expect("reload");
                click(&c, "#organise-btn").await;
                audit(&c).await
            }),
            ("new chat", {
                c.goto(&base).await.expect("home");
                audit(&c).await
            }),
            ("sign-in", {
                c.goto(&format!("{base}/signin")).await.expect("signin");
                audit(&c).await
            }),
            ("sign-up", {
                c.goto(&format!("{base}/signup")).await.expect("signup");
                audit(&c).await
            }),
            ("account settings", {
                // Signed up from the sign-up page (the account page needs an account).
                for (css, text) in [
                    ("#signup-name", theme),
                    ("#signup-password", "a11y password!"),
                ] {
                    let e = c.find(Locator::Css(css)).await.expect(css);
                    e.send_keys(text).await.expect("type");
                }
                click(&c, "#signup-btn").await;
                wait_js(&c, "return location.pathname", "signed up", |v| {
                    v == &json!("/")
                })
                .await;
                c.goto(&format!("{base}/account")).await.expect("account");
                wait_js(
                    &c,
                    "return !!document.querySelector('main') && location.pathname",
                    "the account page",
                    |v| v == &json!("/account"),
                )
                .await;
                audit(&c).await
            }),
            ("admin", {
                admin_login(&c, &base).await;
                audit(&c).await
            }),
        ] {
            for v in found {
                report.push(format!("{theme} / {page}: {v}"));
            }
        }
    }
    assert!(
        report.is_empty(),
        "serious or critical accessibility violations:\n{}",
        report.join("\n")
    );
}
