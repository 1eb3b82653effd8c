//! The chat and admin pages in a real headless Chromium (Debian `chromium` + `chromium-driver`,
//! installed by `scripts/install-test-deps.sh`), driven over WebDriver with fantoccini, against a
//! real `smolchat serve` with the real default model.
//!
//! One test, in steps, so the model loads once: stream a reply, reload and find it restored,
//! stop a reply, rejoin a streaming reply after a reload, two browsers at once that never see each
//! other's conversations, an XSS payload shown as text, and the admin page (wrong token refused,
//! both browsers' conversations listed and updated live). Screenshots go to
//! `target/screenshots/` (copies are committed under `docs/screenshots/`).
//!
//! Chromium missing is a failure, not a skip: run `scripts/install-test-deps.sh` (or `make test`).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::chromium::*;
use common::server::Server;
use fantoccini::{Client, Locator};
use serde_json::json;

const ADMIN_TOKEN: &str = "browser-test-admin-token";

/// A second browser showing the same owner's page (cookies copied over WebDriver).
async fn same_owner(
    driver: &Driver,
    from: &Client,
    profile: &Path,
    opts: BrowserOpts,
    url: &str,
) -> Client {
    let c = browser(driver, profile, opts).await;
    let base = url.split("/c/").next().unwrap_or(url);
    c.goto(&format!("{base}/static/favicon.svg"))
        .await
        .expect("goto");
    for cookie in from.get_all_cookies().await.expect("cookies") {
        c.add_cookie(cookie).await.expect("add cookie");
    }
    c.goto(url).await.expect("goto");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_admin_in_a_real_browser() {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "160"),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "0.7"),
        ],
    )
    .await;
    let base = server.base.clone();
    let driver = start_driver(dir.path()).await;
    let alice = browser(&driver, &dir.path().join("alice"), DESKTOP).await;

    // 1. Send a message from the empty page and watch the reply stream in.
    alice.goto(&base).await.expect("open");
    let light = js(
        &alice,
        "return matchMedia('(prefers-color-scheme: dark)').matches",
    )
    .await;
    assert_eq!(light, json!(false));
    send(&alice, "Write a short poem about the sea.").await;
    wait_js(
        &alice,
        "return location.pathname",
        "the conversation page",
        |v| v.as_str().is_some_and(|p| p.starts_with("/c/")),
    )
    .await;
    let alice_url = alice.current_url().await.expect("url").to_string();
    let alice_conv = conversation_id(&alice).await;
    let lengths = watch_stream(&alice).await;
    assert!(
        lengths.len() >= 3,
        "the text should grow token by token: {lengths:?}"
    );
    let user_text = js(
        &alice,
        "return document.querySelector('.msg.user .text').textContent",
    )
    .await;
    assert_eq!(user_text, json!("Write a short poem about the sea."));
    let stats = js(
        &alice,
        "return document.querySelector('.msg.assistant .stats').textContent",
    )
    .await;
    assert!(
        stats
            .as_str()
            .is_some_and(|s| s.contains("tokens") && s.contains("tok/s")),
        "{stats}"
    );
    let ctx = js(
        &alice,
        "return Number(document.getElementById('ctx-used').textContent)",
    )
    .await;
    assert!(ctx.as_f64().unwrap_or(0.0) > 10.0, "context usage {ctx}");
    let answer = js(
        &alice,
        "return document.querySelector('.msg.assistant .md').innerText",
    )
    .await;
    let answer = answer.as_str().unwrap_or_default().to_string();
    assert!(!answer.trim().is_empty());
    screenshot(&alice, "chat-light-desktop").await;

    // 2. Reload: the conversation is restored.
    alice.refresh().await.expect("reload");
    let restored = wait_js(
        &alice,
        "return [document.querySelectorAll('.msg.user').length, document.querySelectorAll('.msg.assistant').length, document.querySelector('.msg.assistant .md').innerText]",
        "the restored conversation",
        |v| v[0] == json!(1) && v[1] == json!(1),
    )
    .await;
    assert_eq!(
        restored[2].as_str().unwrap_or_default().trim(),
        answer.trim()
    );
    let in_sidebar = js(
        &alice,
        &format!("return !!document.querySelector('#conv-list a[data-id=\"{alice_conv}\"]')"),
    )
    .await;
    assert_eq!(in_sidebar, json!(true));

    // 3. Stop a reply: the server stops it and stores it as stopped.
    send(
        &alice,
        "Tell me a very long story about a dragon who learns to bake bread.",
    )
    .await;
    wait_js(&alice, STREAM_LEN, "streaming text", |v| {
        v.as_i64().unwrap_or(-1) > 0
    })
    .await;
    alice
        .find(Locator::Css("#stop-btn"))
        .await
        .expect("stop")
        .click()
        .await
        .expect("click stop");
    wait_js(&alice, IDLE, "the stopped reply", |v| v == &json!(2)).await;
    let last_stats = wait_js(
        &alice,
        "const s = document.querySelectorAll('.msg.assistant .stats'); return s.length ? s[s.length-1].textContent : ''",
        "stats of the stopped reply",
        |v| v.as_str().is_some_and(|s| !s.is_empty()),
    )
    .await;
    assert!(
        last_stats.as_str().unwrap_or_default().contains("stopped"),
        "{last_stats}"
    );

    // 4. Reload while a reply streams: the page joins it live (replay, then live tokens).
    send(&alice, "List five facts about the moon.").await;
    wait_js(&alice, STREAM_LEN, "streaming text", |v| {
        v.as_i64().unwrap_or(-1) > 0
    })
    .await;
    alice.refresh().await.expect("reload mid-reply");
    let rejoined = watch_stream(&alice).await;
    assert!(
        !rejoined.is_empty(),
        "the reloaded page showed the streaming reply"
    );
    wait_js(&alice, IDLE, "three replies", |v| v == &json!(3)).await;

    // Regenerate the last reply, then edit-and-resend the last message: still three exchanges.
    let last_id =
        "const a = document.querySelectorAll('.msg.assistant'); return a[a.length-1].dataset.id";
    let before = js(&alice, last_id).await;
    click(
        &alice,
        ".messages.idle > .msg.assistant:last-child .regen-btn",
    )
    .await;
    wait_js(
        &alice,
        &format!("{IDLE} && Array.from(document.querySelectorAll('.msg.assistant')).pop().dataset.id !== {before}"),
        "a regenerated reply",
        |v| v == &json!(true),
    )
    .await;
    wait_js(&alice, IDLE, "three replies after regenerate", |v| {
        v == &json!(3)
    })
    .await;
    click(
        &alice,
        ".messages.idle > .msg.user:nth-last-child(2) .edit-btn",
    )
    .await;
    let editing = js(&alice, "return [document.getElementById('input').value, document.getElementById('editing').hidden]").await;
    assert_eq!(editing, json!(["List five facts about the moon.", false]));
    let input = alice.find(Locator::Css("#input")).await.expect("input");
    input.clear().await.expect("clear");
    send(&alice, "List two facts about Mars.").await;
    wait_js(
        &alice,
        "const u = document.querySelectorAll('.msg.user'); return [u.length, u[u.length-1].querySelector('.text').textContent]",
        "the edited message",
        |v| v == &json!([3, "List two facts about Mars."]),
    )
    .await;
    wait_js(&alice, IDLE, "three replies after the edit", |v| {
        v == &json!(3)
    })
    .await;

    // Search the sidebar (title and content), and save settings from the panel.
    let search = alice
        .find(Locator::Css("input.search"))
        .await
        .expect("search box");
    search.send_keys("zzzz-no-match").await.expect("type");
    wait_js(
        &alice,
        "return document.querySelectorAll('#conv-list a.conv').length",
        "an empty search result",
        |v| v == &json!(0),
    )
    .await;
    search.clear().await.expect("clear");
    search.send_keys("Mars").await.expect("type");
    wait_js(
        &alice,
        "return document.querySelectorAll('#conv-list a.conv').length",
        "a content match",
        |v| v == &json!(1),
    )
    .await;
    click(&alice, "#settings-btn").await;
    let temp = alice
        .find(Locator::Css("#settings input[name=temperature]"))
        .await
        .expect("temperature");
    temp.clear().await.expect("clear");
    temp.send_keys("0.4").await.expect("type");
    click(&alice, "#settings button[type=submit]").await;
    wait_js(
        &alice,
        "return document.getElementById('settings-status').textContent",
        "saved settings",
        |v| v == &json!("Saved"),
    )
    .await;
    click(&alice, "#settings-btn").await;

    // 5. A second browser: an XSS payload is text, and the two never see each other's chats.
    let bob = browser(&driver, &dir.path().join("bob"), DESKTOP).await;
    bob.goto(&base).await.expect("open");
    let payload = "<img src=x onerror=\"document.body.dataset.pwned='img'\"><script>document.body.dataset.pwned='script'</script> [link](javascript:document.body.dataset.pwned='link') <b>bold?</b>";
    send(&bob, payload).await;
    wait_js(
        &bob,
        "return location.pathname",
        "bob's conversation",
        |v| v.as_str().is_some_and(|p| p.starts_with("/c/")),
    )
    .await;
    let bob_conv = conversation_id(&bob).await;
    // Both chat at once.
    send(&alice, "Say hello in French.").await;
    let (a, b) = tokio::join!(watch_stream(&alice), watch_stream(&bob));
    assert!(!a.is_empty() && !b.is_empty());
    let shown = js(
        &bob,
        "return document.querySelector('.msg.user .text').textContent",
    )
    .await;
    assert_eq!(shown, json!(payload), "the payload is shown as typed");
    let injected = js(
        &bob,
        "return [document.body.dataset.pwned || null, document.querySelectorAll('.messages img, .messages script, .messages b, .messages a[href^=\"javascript\"]').length, document.querySelectorAll('#conv-list img').length]",
    )
    .await;
    assert_eq!(
        injected,
        json!([null, 0, 0]),
        "markup from a message became elements"
    );
    assert!(bob.get_alert_text().await.is_err(), "an alert opened");
    let alice_list = js(
        &alice,
        "return document.getElementById('conv-list').innerHTML",
    )
    .await;
    let bob_list = js(
        &bob,
        "return document.getElementById('conv-list').innerHTML",
    )
    .await;
    assert!(!alice_list.as_str().unwrap_or_default().contains(&bob_conv));
    assert!(!bob_list.as_str().unwrap_or_default().contains(&alice_conv));
    assert!(bob_list.as_str().unwrap_or_default().contains(&bob_conv));
    bob.goto(&alice_url).await.expect("open alice's url");
    let title = js(&bob, "return document.body.innerText").await;
    assert!(
        title
            .as_str()
            .is_some_and(|t| t.contains("404") && t.contains("conversation not found")),
        "{title}"
    );
    assert_eq!(
        js(&bob, "return document.querySelectorAll('.msg').length").await,
        json!(0)
    );

    // Bob deletes his conversation (after confirming) and lands on an empty page.
    bob.goto(&format!("{base}/c/{bob_conv}"))
        .await
        .expect("open");
    click(&bob, "#delete-btn").await;
    let deadline = Instant::now() + WAIT;
    let confirm = loop {
        match bob.get_alert_text().await {
            Ok(text) => break text,
            Err(e) => assert!(Instant::now() < deadline, "no confirmation dialog: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(confirm.contains("Delete this conversation"), "{confirm}");
    bob.accept_alert().await.expect("confirm");
    wait_js(
        &bob,
        "return [location.pathname, document.querySelectorAll('#conv-list a.conv').length]",
        "the deletion",
        |v| v == &json!(["/", 0]),
    )
    .await;
    send(&bob, "Hi!").await;
    wait_js(
        &bob,
        "return location.pathname",
        "bob's new conversation",
        |v| v.as_str().is_some_and(|p| p.starts_with("/c/")),
    )
    .await;
    let bob_conv = conversation_id(&bob).await;
    watch_stream(&bob).await;

    // Export and import from the page: the ⤓ link downloads the JSON; "Import…" sends a file
    // back and opens the new copy, with the same messages.
    let href = js(
        &bob,
        "return document.getElementById('export-json').getAttribute('href')",
    )
    .await;
    assert_eq!(href, json!(format!("/c/{bob_conv}/export.json")));
    let exported = js(
        &bob,
        "return fetch(document.getElementById('export-json').href).then(r => r.text())",
    )
    .await;
    let exported = exported.as_str().expect("export text").to_string();
    let doc: serde_json::Value = serde_json::from_str(&exported).expect("export is JSON");
    assert_eq!(doc["format"], "smolchat.conversation");
    let file = dir.path().join("bob-export.json");
    std::fs::write(&file, &exported).expect("write export");
    js(
        &bob,
        "document.getElementById('import-file').hidden = false; return 1",
    )
    .await;
    bob.find(Locator::Css("#import-file"))
        .await
        .expect("import input")
        .send_keys(&file.display().to_string())
        .await
        .expect("choose file");
    let moved = wait_js(
        &bob,
        "return [location.pathname, document.querySelectorAll('.msg').length]",
        "the imported conversation",
        |v| {
            v[0].as_str()
                .is_some_and(|p| p.starts_with("/c/") && !p.ends_with(bob_conv.as_str()))
        },
    )
    .await;
    assert_eq!(
        moved[1].as_u64(),
        doc["messages"].as_array().map(|m| m.len() as u64),
        "the copy has every message"
    );
    // Back to the original for what follows.
    bob.goto(&format!("{base}/c/{bob_conv}"))
        .await
        .expect("open");

    // 6. Admin: a wrong token is refused; the right one shows both browsers' conversations live.
    let admin = browser(&driver, &dir.path().join("admin"), DESKTOP).await;
    admin.goto(&format!("{base}/admin")).await.expect("admin");
    let token = admin
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#admin-token"))
        .await
        .expect("login form");
    token.send_keys("not-the-token").await.expect("type");
    admin
        .find(Locator::Css("#login-btn"))
        .await
        .expect("login")
        .click()
        .await
        .expect("click");
    wait_js(
        &admin,
        "const t = document.querySelector('.toast'); return t ? t.textContent : ''",
        "the refusal",
        |v| v.as_str().is_some_and(|s| s.contains("wrong admin token")),
    )
    .await;
    assert_eq!(
        js(&admin, "return !!document.getElementById('sessions')").await,
        json!(false)
    );
    let token = admin
        .find(Locator::Css("#admin-token"))
        .await
        .expect("login form");
    token.clear().await.expect("clear");
    token.send_keys(ADMIN_TOKEN).await.expect("type");
    admin
        .find(Locator::Css("#login-btn"))
        .await
        .expect("login")
        .click()
        .await
        .expect("click");
    let rows_js = format!(
        "const a = document.querySelector('#sessions tr[data-id=\"{alice_conv}\"]'); const b = document.querySelector('#sessions tr[data-id=\"{bob_conv}\"]'); \
         return [!!a, !!b, a ? a.querySelector('.pill').textContent : '', a ? Number(a.children[2].textContent) : 0]"
    );
    let rows = wait_js(
        &admin,
        &rows_js,
        "both conversations on the admin page",
        |v| v[0] == json!(true) && v[1] == json!(true),
    )
    .await;
    let count_before = rows[3].as_i64().unwrap_or(0);
    // The engine tiles say where the model computes.
    assert_eq!(
        js(
            &admin,
            "return [document.getElementById('device').textContent, document.getElementById('tier').textContent]"
        )
        .await,
        json!(["cpu", "cpu tier"])
    );
    // Live: a new message from alice shows up without reloading the admin page.
    send(&alice, "Name three colors.").await;
    wait_js(
        &admin,
        &rows_js,
        "alice's new message on the admin page",
        |v| v[3].as_i64().unwrap_or(0) > count_before,
    )
    .await;
    // (The reply may be over by now: only its end is awaited.)
    wait_js(&alice, IDLE, "alice's fifth reply", |v| v == &json!(5)).await;
    wait_js(&admin, &rows_js, "alice's state back to idle", |v| {
        v[2] == json!("idle")
    })
    .await;
    let engine = js(&admin, "return document.getElementById('engine').innerText").await;
    assert!(
        engine
            .as_str()
            .is_some_and(|t| t.contains("tokens/s") && t.contains("KV")),
        "{engine}"
    );
    screenshot(&admin, "admin").await;

    // 7. Screenshots of alice's conversation: dark desktop, light and dark phone.
    let dark = BrowserOpts {
        dark: true,
        ..DESKTOP
    };
    let phone = BrowserOpts {
        width: 390,
        height: 844,
        dark: false,
        phone: true,
    };
    let phone_dark = BrowserOpts {
        dark: true,
        ..phone
    };
    for (name, opts) in [
        ("chat-dark-desktop", dark),
        ("chat-light-phone", phone),
        ("chat-dark-phone", phone_dark),
    ] {
        let c = same_owner(&driver, &alice, &dir.path().join(name), opts, &alice_url).await;
        wait_js(
            &c,
            "return document.querySelectorAll('.msg.assistant').length",
            "alice's conversation",
            |v| v.as_i64().unwrap_or(0) >= 4,
        )
        .await;
        let is_dark = js(
            &c,
            "return matchMedia('(prefers-color-scheme: dark)').matches",
        )
        .await;
        assert_eq!(is_dark, json!(opts.dark), "{name}");
        if opts.phone {
            // The sidebar is a drawer at phone width; the page does not scroll sideways.
            let fits = js(
                &c,
                "return [innerWidth, document.documentElement.scrollWidth <= innerWidth]",
            )
            .await;
            assert_eq!(fits, json!([390, true]), "{name}");
        }
        screenshot(&c, name).await;
        c.close().await.expect("close");
    }
    // The phone drawer opens.
    let c = same_owner(
        &driver,
        &alice,
        &dir.path().join("drawer"),
        phone,
        &alice_url,
    )
    .await;
    c.find(Locator::Css("#menu-btn"))
        .await
        .expect("menu")
        .click()
        .await
        .expect("open drawer");
    wait_js(
        &c,
        "return document.getElementById('app').classList.contains('nav-open')",
        "the drawer",
        |v| v == &json!(true),
    )
    .await;
    screenshot(&c, "chat-light-phone-sidebar").await;
    c.close().await.expect("close");

    for c in [alice, bob, admin] {
        c.close().await.expect("close");
    }
    eprintln!("browser test took {:.1} s", started.elapsed().as_secs_f64());
}

/// Whether a live process's command line mentions `needle` (zombies have none).
fn a_process_mentions(needle: &str) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains(needle))
            .unwrap_or(false)
    })
}

/// Dropping the driver stops the Chromium it started, even when the WebDriver session was never
/// closed (a test that panicked): chromedriver runs in a process group of its own and the whole
/// group is killed (`common::group`). Before, every `make test` left about a hundred Chromium
/// processes running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_driver_stops_its_chromium() {
    let dir = tempfile::tempdir().expect("tempdir");
    let driver = start_driver(dir.path()).await;
    let profile = dir.path().join("profile-that-must-not-outlive-the-driver");
    let client = browser(&driver, &profile, DESKTOP).await;
    let marker = profile.display().to_string();
    assert!(
        a_process_mentions(&marker),
        "Chromium did not start with {marker}"
    );
    drop(client);
    drop(driver);
    let deadline = Instant::now() + Duration::from_secs(15);
    while a_process_mentions(&marker) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !a_process_mentions(&marker),
        "Chromium outlived its driver (profile {marker})"
    );
}
