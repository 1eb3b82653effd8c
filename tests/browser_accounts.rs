//! Accounts in a real headless Chromium against a real `smolchat serve` with the default model
//! and an on-disk database (no `cookie_secret` configured): a guest chats and signs up (the
//! conversation moves into the account), signs out and in again; a second browser signs in and
//! sees and continues the conversation; after a server restart the first browser is still signed
//! in with its conversations.
//!
//! Chromium missing is a failure, not a skip: run `scripts/install-test-deps.sh` (or `make test`).

mod common;

use common::chromium::*;
use common::server::Server;
use fantoccini::Client;
use serde_json::json;

const ENV: &[(&str, &str)] = &[
    ("SMOLCHAT_SAMPLING__MAX_TOKENS", "24"),
    ("SMOLCHAT_SAMPLING__TEMPERATURE", "0.7"),
    ("SMOLCHAT_AUTH__INITIAL_ADMIN", "root"),
    ("SMOLCHAT_AUTH__INITIAL_ADMIN_PASSWORD", "root's password"),
];

/// The name in the sidebar's account box, or "" for a guest.
async fn signed_in_as(c: &Client) -> String {
    let v = wait_js(
        c,
        "const b = document.getElementById('account-box'); return b ? b.innerText : null",
        "the account box",
        |v| v.is_string(),
    )
    .await;
    let text = v.as_str().unwrap_or_default();
    if text.starts_with("Guest") {
        String::new()
    } else {
        text.split(" · ").next().unwrap_or_default().to_string()
    }
}

async fn lists(c: &Client, conv: &str) -> bool {
    js(
        c,
        &format!("return document.querySelector('#conv-list a[data-id=\"{conv}\"]') !== null"),
    )
    .await
        == json!(true)
}

async fn sign_in(c: &Client, base: &str, name: &str, password: &str) {
    c.goto(&format!("{base}/signin"))
        .await
        .expect("signin page");
    fill(c, "#signin-name", name).await;
    fill(c, "#signin-password", password).await;
    click(c, "#signin-btn").await;
    wait_path(c, "/").await;
    assert_eq!(signed_in_as(c).await, name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accounts_in_a_real_browser() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut server = Server::start(dir.path(), ENV).await;
    let base = server.base.clone();
    let driver = start_driver(dir.path()).await;
    let first = browser(&driver, &dir.path().join("first"), DESKTOP).await;

    // A guest chats.
    first.goto(&base).await.expect("open");
    assert_eq!(signed_in_as(&first).await, "");
    send(&first, "Say hello to the sea.").await;
    wait_js(
        &first,
        "return location.pathname",
        "the conversation page",
        |v| v.as_str().is_some_and(|p| p.starts_with("/c/")),
    )
    .await;
    let conv = conversation_id(&first).await;
    watch_stream(&first).await;

    // Sign-up moves the guest's conversation into the account.
    first.goto(&format!("{base}/signup")).await.expect("signup");
    let note = js(&first, "return document.body.innerText").await;
    assert!(
        note.as_str()
            .is_some_and(|t| t.contains("move into the new account")),
        "{note}"
    );
    fill(&first, "#signup-name", "ann").await;
    fill(&first, "#signup-password", "ann's password").await;
    click(&first, "#signup-btn").await;
    wait_path(&first, "/").await;
    assert_eq!(signed_in_as(&first).await, "ann");
    assert!(lists(&first, &conv).await, "the guest's conversation moved");
    screenshot(&first, "accounts-signed-in").await;

    // Sign-out: a guest again, without the account's conversation.
    click(&first, "#signout-link").await;
    wait_js(
        &first,
        "return document.getElementById('signin-link') !== null",
        "the guest's sign-in link",
        |v| v == &json!(true),
    )
    .await;
    assert!(!lists(&first, &conv).await);
    // A wrong password is refused with a message.
    first.goto(&format!("{base}/signin")).await.expect("signin");
    fill(&first, "#signin-name", "ann").await;
    fill(&first, "#signin-password", "not the password").await;
    click(&first, "#signin-btn").await;
    wait_js(
        &first,
        "return document.body.dataset.lastError || ''",
        "the refusal",
        |v| {
            v.as_str()
                .is_some_and(|t| t.contains("wrong name or password"))
        },
    )
    .await;
    sign_in(&first, &base, "ann", "ann's password").await;
    assert!(lists(&first, &conv).await);

    // A second browser signs in, sees the conversation and continues it.
    let second = browser(&driver, &dir.path().join("second"), DESKTOP).await;
    sign_in(&second, &base, "ann", "ann's password").await;
    assert!(lists(&second, &conv).await);
    second
        .goto(&format!("{base}/c/{conv}"))
        .await
        .expect("open the conversation");
    let before = js(
        &second,
        "return document.querySelectorAll('.msg.assistant').length",
    )
    .await;
    assert_eq!(before, json!(1));
    send(&second, "And now to the wind.").await;
    watch_stream(&second).await;
    let after = js(
        &second,
        "return document.querySelectorAll('.msg.assistant').length",
    )
    .await;
    assert_eq!(after, json!(2));

    // A restart (no secret configured: the generated one is on disk): the first browser is
    // still signed in and finds the whole conversation. Cookies do not depend on the port.
    server.kill();
    drop(server);
    server = Server::start(dir.path(), ENV).await;
    let base = server.base.clone();
    first.goto(&base).await.expect("open after the restart");
    assert_eq!(signed_in_as(&first).await, "ann");
    assert!(lists(&first, &conv).await);
    first
        .goto(&format!("{base}/c/{conv}"))
        .await
        .expect("open the conversation");
    let users = js(
        &first,
        "return document.querySelectorAll('.msg.user').length",
    )
    .await;
    assert_eq!(users, json!(2), "both turns survived");

    // The admin account sees ann in the users table and her conversation under her name.
    second
        .goto(&format!("{base}/signin"))
        .await
        .expect("signin");
    sign_in(&second, &base, "root", "root's password").await;
    second.goto(&format!("{base}/admin")).await.expect("admin");
    let row = wait_js(
        &second,
        "const r = document.querySelector('#users tr[data-user=\"ann\"]'); \
         return r ? r.innerText : null",
        "ann's row",
        |v| v.is_string(),
    )
    .await;
    assert!(row.as_str().is_some_and(|r| r.contains("user")), "{row}");
    let owner = js(
        &second,
        &format!(
            "const r = document.querySelector('#sessions tr[data-id=\"{conv}\"]'); \
             return r ? r.innerText : ''"
        ),
    )
    .await;
    assert!(owner.as_str().is_some_and(|r| r.contains("ann")), "{owner}");
    screenshot(&second, "admin-users").await;

    first.close().await.expect("close");
    second.close().await.expect("close");
}
