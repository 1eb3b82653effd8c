//! User management in the admin page, in a real headless Chromium: an admin creates a user and
//! an invite link, the invited person signs up through it, the admin revokes a second invite,
//! resets the newcomer's password (who must choose a new one at the next sign-in before doing
//! anything else), looks at their usage and deletes them. Every step is in the audit log with
//! the actor, the target and the address.
//!
//! Chromium missing is a failure, not a skip: run `scripts/install-test-deps.sh` (or `make test`).

mod common;

use std::time::{Duration, Instant};

use common::chromium::*;
use common::server::Server;
use fantoccini::Client;
use serde_json::{json, Value};

const ENV: &[(&str, &str)] = &[
    ("SMOLCHAT_SAMPLING__MAX_TOKENS", "8"),
    ("SMOLCHAT_AUTH__SIGNUP", "invite"),
    ("SMOLCHAT_AUTH__INITIAL_ADMIN", "root"),
    ("SMOLCHAT_AUTH__INITIAL_ADMIN_PASSWORD", "root's password"),
];

/// Waits for a dialog (confirm or prompt), checks its text, answers it.
async fn answer_dialog(c: &Client, says: &str, typed: Option<&str>) {
    let deadline = Instant::now() + WAIT;
    let text = loop {
        match c.get_alert_text().await {
            Ok(text) => break text,
            Err(e) => assert!(Instant::now() < deadline, "no dialog: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(text.contains(says), "{text}");
    if let Some(typed) = typed {
        c.send_alert_text(typed).await.expect("type in the prompt");
    }
    c.accept_alert().await.expect("accept");
}

async fn sign_in(c: &Client, base: &str, name: &str, password: &str) {
    c.goto(&format!("{base}/signin")).await.expect("signin");
    fill(c, "#signin-name", name).await;
    fill(c, "#signin-password", password).await;
    click(c, "#signin-btn").await;
}

async fn admin_row(c: &Client, name: &str) -> bool {
    js(
        c,
        &format!("return document.querySelector('tr[data-user=\"{name}\"]') !== null"),
    )
    .await
        == json!(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_manages_users_in_the_browser_and_the_log_has_every_step() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), ENV).await;
    let base = server.base.clone();
    let driver = start_driver(dir.path()).await;
    let admin = browser(&driver, &dir.path().join("admin"), DESKTOP).await;
    let frank = browser(&driver, &dir.path().join("frank"), DESKTOP).await;

    sign_in(&admin, &base, "root", "root's password").await;
    wait_path(&admin, "/").await;
    admin.goto(&format!("{base}/admin")).await.expect("admin");

    // A user made in the page.
    fill(&admin, "#new-user-name", "erin").await;
    fill(&admin, "#new-user-password", "erin's password").await;
    click(&admin, "#new-user-btn").await;
    wait_js(
        &admin,
        "return document.querySelector('tr[data-user=\"erin\"]') !== null",
        "erin's row",
        |v| v == &json!(true),
    )
    .await;

    // An invite link, shown once; frank signs up through it.
    click(&admin, "#invite-btn").await;
    let link = wait_js(
        &admin,
        "const i = document.getElementById('invite-link'); return i ? i.value : null",
        "the invite link",
        |v| v.is_string(),
    )
    .await;
    let link = link.as_str().unwrap_or_default().to_string();
    assert!(link.contains("/signup?invite="), "{link}");
    frank.goto(&link).await.expect("invite link");
    fill(&frank, "#signup-name", "frank").await;
    fill(&frank, "#signup-password", "frank's own password").await;
    click(&frank, "#signup-btn").await;
    wait_path(&frank, "/").await;
    send(&frank, "Hello!").await;
    watch_stream(&frank).await;

    // A second invite, revoked before anyone uses it.
    admin.goto(&format!("{base}/admin")).await.expect("admin");
    click(&admin, "#invite-btn").await;
    let second = wait_js(
        &admin,
        "const i = document.getElementById('invite-link'); return i ? i.value : null",
        "the second invite link",
        |v| v.is_string(),
    )
    .await;
    let second = second.as_str().unwrap_or_default().to_string();
    admin.goto(&format!("{base}/admin")).await.expect("admin");
    let live = js(
        &admin,
        "return document.querySelectorAll('#invites tr[data-invite]').length",
    )
    .await;
    assert_eq!(live, json!(1), "only the unused invite is listed");
    click(&admin, "#invites button").await;
    answer_dialog(&admin, "Revoke this invite link", None).await;
    wait_js(
        &admin,
        "return document.querySelectorAll('#invites tr[data-invite]').length",
        "the invite gone from the list",
        |v| v == &json!(0),
    )
    .await;
    let stranger = browser(&driver, &dir.path().join("stranger"), DESKTOP).await;
    stranger.goto(&second).await.expect("revoked link");
    fill(&stranger, "#signup-name", "mallory").await;
    fill(&stranger, "#signup-password", "mallory's password").await;
    click(&stranger, "#signup-btn").await;
    wait_js(
        &stranger,
        "return document.body.innerText",
        "the refusal",
        |v| v.as_str().is_some_and(|t| t.contains("invite")),
    )
    .await;
    assert_eq!(
        js(&stranger, "return location.pathname").await,
        json!("/signup")
    );

    // frank's usage over time.
    admin.goto(&format!("{base}/admin")).await.expect("admin");
    click(&admin, "tr[data-user=\"frank\"] a[href$=\"/usage\"]").await;
    let used = wait_js(
        &admin,
        "const r = document.querySelector('#usage-days tr[data-day] td:nth-child(2)'); return r ? Number(r.innerText) : null",
        "frank's usage today",
        |v| v.is_number(),
    )
    .await;
    assert!(used.as_i64().unwrap_or(0) > 0, "{used}");

    // Reset frank's password: shown once; his session ends.
    admin.goto(&format!("{base}/admin")).await.expect("admin");
    click(
        &admin,
        "tr[data-user=\"frank\"] button[hx-post$=\"/reset-password\"]",
    )
    .await;
    answer_dialog(&admin, "Reset frank's password", None).await;
    let temporary = wait_js(
        &admin,
        "const i = document.getElementById('reset-password'); return i ? i.value : null",
        "the new password",
        |v| v.is_string(),
    )
    .await;
    let temporary = temporary.as_str().unwrap_or_default().to_string();
    assert_eq!(temporary.len(), 16, "{temporary}");
    frank
        .goto(&format!("{base}/account"))
        .await
        .expect("account");
    wait_path(&frank, "/signin").await;
    // Signed in with it, only the account page opens, until he chooses his own.
    sign_in(&frank, &base, "frank", &temporary).await;
    wait_path(&frank, "/account").await;
    wait_js(
        &frank,
        "return document.getElementById('must-change') !== null",
        "the banner",
        |v| v == &json!(true),
    )
    .await;
    frank.goto(&format!("{base}/")).await.expect("home");
    wait_path(&frank, "/account").await;
    fill(&frank, "#password-form input[name=current]", &temporary).await;
    fill(
        &frank,
        "#password-form input[name=new]",
        "frank's newer password",
    )
    .await;
    click(&frank, "#password-form button[type=submit]").await;
    wait_js(
        &frank,
        "return document.getElementById('password-status').innerText",
        "the change",
        |v| v.as_str().is_some_and(|t| !t.is_empty()),
    )
    .await;
    frank.goto(&format!("{base}/")).await.expect("home");
    wait_path(&frank, "/").await;

    // Delete frank, confirmed by typing his name.
    admin.goto(&format!("{base}/admin")).await.expect("admin");
    click(
        &admin,
        "tr[data-user=\"frank\"] button[hx-post$=\"/delete\"]",
    )
    .await;
    answer_dialog(&admin, "Delete frank", Some("frank")).await;
    let deadline = Instant::now() + WAIT;
    while admin_row(&admin, "frank").await {
        assert!(Instant::now() < deadline, "frank's row is still there");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    frank
        .goto(&format!("{base}/account"))
        .await
        .expect("account");
    wait_path(&frank, "/signin").await;

    // The log, read as the page reads it.
    let log = js(
        &admin,
        "return fetch('/admin/audit.json').then(r => r.json())",
    )
    .await;
    let entries = log["entries"].as_array().cloned().unwrap_or_default();
    let has = |actor: &str, action: &str, target: &str| {
        entries.iter().any(|e: &Value| {
            e["actor"] == actor
                && e["action"] == action
                && e["target"].as_str().is_some_and(|t| t.starts_with(target))
                && e["address"] == "127.0.0.1"
        })
    };
    for (actor, action, target) in [
        ("user:root", "auth.sign_in", "user:root"),
        ("user:root", "admin.create_user", "user:erin"),
        ("user:root", "admin.create_invite", ""),
        ("user:frank", "auth.sign_up", "user:frank"),
        ("user:root", "admin.revoke_invite", "invite:"),
        ("user:root", "admin.reset_password", "user:frank"),
        ("user:frank", "auth.sign_in", "user:frank"),
        ("user:frank", "auth.password_changed", "user:frank"),
        ("user:root", "admin.delete_user", "user:frank"),
    ] {
        assert!(
            has(actor, action, target),
            "{actor} {action} {target}: {log:#}"
        );
    }
    screenshot(&admin, "admin-users").await;
    for c in [admin, frank, stranger] {
        c.close().await.expect("close");
    }
}
