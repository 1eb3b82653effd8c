//! Organising conversations and presets, in a real headless Chromium against a real `smolchat
//! serve`: pin, archive, a folder and tags from the organise dialog, the sidebar's views
//! filtering by each, a system-prompt preset saved and applied, an admin's shared preset seen by
//! everyone; and isolation: another owner's folders, presets and conversations answer 404.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::browser_client::Browser;
use common::chromium::*;
use common::server::Server;
use fantoccini::Client;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// Makes a conversation titled `title` through the JSON API from the page; returns its id.
async fn new_conversation(c: &Client, title: &str) -> String {
    let made = c
        .execute_async(
            "const done = arguments[arguments.length - 1]; \
             fetch('/api/conversations', {method: 'POST', credentials: 'same-origin', \
               headers: {'content-type': 'application/json', 'x-csrf-token': document.body.dataset.csrf}, \
               body: JSON.stringify({title: arguments[0]})}) \
             .then(r => r.json().then(j => done(j.id || JSON.stringify(j)))) \
             .catch(e => done(String(e)));",
            vec![json!(title)],
        )
        .await
        .expect("create");
    made.as_str().unwrap_or_default().to_string()
}

/// The titles the sidebar lists (pinned group first), as shown.
const LISTED: &str = "return [...document.querySelectorAll('#conv-list a.conv .conv-title')].map(t => t.textContent.trim())";

async fn choose_view(c: &Client, value: &str) {
    js(
        c,
        &format!(
            "const s = document.getElementById('conv-view'); s.value = {}; \
             s.dispatchEvent(new Event('change', {{bubbles: true}})); return s.value",
            json!(value)
        ),
    )
    .await;
}

async fn wait_listed(c: &Client, what: &str, want: &[&str]) {
    let want: Vec<Value> = want.iter().map(|t| json!(t)).collect();
    wait_js(c, LISTED, what, |v| v.as_array() == Some(&want)).await;
}

fn add_admin(database_url: &str, name: &str, password: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_smolchat"))
        .current_dir(common::crate_root())
        .args(["user", "add", name, "--admin", "--password-stdin"])
        .arg("--database-url")
        .arg(database_url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn smolchat user add");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{password}\n").as_bytes())
        .expect("password");
    let out = child.wait_with_output().expect("user add");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn folders_pins_archive_tags_and_presets_in_a_real_browser() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[]).await;
    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("alice"), DESKTOP).await;
    c.goto(&server.base).await.expect("open");
    let alpha = new_conversation(&c, "Alpha").await;
    let beta = new_conversation(&c, "Beta").await;
    let gamma = new_conversation(&c, "Gamma").await;
    assert!(!alpha.is_empty() && !beta.is_empty() && !gamma.is_empty());

    // Alpha: pinned, in a new folder "Work", tagged.
    c.goto(&format!("{}/c/{alpha}", server.base))
        .await
        .expect("open alpha");
    wait_listed(&c, "three conversations", &["Gamma", "Beta", "Alpha"]).await;
    click(&c, "#organise-btn").await;
    wait_js(
        &c,
        "return document.getElementById('organise-dialog').open",
        "the organise dialog",
        |v| v == &json!(true),
    )
    .await;
    js(&c, "document.getElementById('org-pinned').checked = true").await;
    fill(&c, "#org-new-folder", "Work").await;
    fill(&c, "#org-tags", "Rust, databases").await;
    click(&c, "#organise-save").await;
    // Saving a new folder and tags reloads the page: the pinned group, the views.
    wait_js(
        &c,
        "return [...document.querySelectorAll('#conv-list .pinned-list .conv-title')].map(t => t.textContent.trim())",
        "Alpha pinned above the rest",
        |v| v == &json!(["Alpha"]),
    )
    .await;
    let views = js(
        &c,
        "return [...document.querySelectorAll('#conv-view option')].map(o => o.textContent.trim())",
    )
    .await;
    assert_eq!(
        views,
        json!([
            "All chats",
            "Folder: Work (1)",
            "#databases (1)",
            "#rust (1)",
            "Archived"
        ]),
        "{views}"
    );
    wait_listed(&c, "pinned first", &["Alpha", "Gamma", "Beta"]).await;
    screenshot(&c, "organise-sidebar").await;

    // Beta: archived; it leaves the list and shows under Archived.
    c.goto(&format!("{}/c/{beta}", server.base))
        .await
        .expect("open beta");
    click(&c, "#organise-btn").await;
    js(&c, "document.getElementById('org-archived').checked = true").await;
    click(&c, "#organise-save").await;
    wait_listed(&c, "Beta archived", &["Alpha", "Gamma"]).await;

    // The views: a folder, a tag, the archive, and back.
    let work = js(
        &c,
        "return [...document.querySelectorAll('#conv-view option')].find(o => o.textContent.includes('Work')).value",
    )
    .await;
    choose_view(&c, work.as_str().unwrap_or_default()).await;
    wait_listed(&c, "the Work folder", &["Alpha"]).await;
    choose_view(&c, "tag:rust").await;
    wait_listed(&c, "the rust tag", &["Alpha"]).await;
    choose_view(&c, "archived").await;
    wait_listed(&c, "the archive", &["Beta"]).await;
    choose_view(&c, "").await;
    wait_listed(&c, "all again", &["Alpha", "Gamma"]).await;

    // A preset: Gamma's system prompt saved as one, applied in Alpha, saved with Alpha's
    // settings.
    c.goto(&format!("{}/c/{gamma}", server.base))
        .await
        .expect("open gamma");
    click(&c, "#settings-btn").await;
    fill(
        &c,
        "#settings textarea[name=system_prompt]",
        "You answer like a pirate.",
    )
    .await;
    fill(&c, "#preset-name", "Pirate").await;
    click(&c, "#preset-save").await;
    wait_js(
        &c,
        "return [...document.querySelectorAll('#preset-select option')].map(o => o.textContent)",
        "the new preset",
        |v| v.as_array().is_some_and(|a| a.contains(&json!("Pirate"))),
    )
    .await;
    c.goto(&format!("{}/c/{alpha}", server.base))
        .await
        .expect("open alpha");
    click(&c, "#settings-btn").await;
    js(
        &c,
        "const s = document.getElementById('preset-select'); \
         s.value = [...s.options].find(o => o.textContent === 'Pirate').value; \
         s.dispatchEvent(new Event('change', {bubbles: true}));",
    )
    .await;
    let filled = js(
        &c,
        "return document.querySelector('#settings textarea[name=system_prompt]').value",
    )
    .await;
    assert_eq!(filled, json!("You answer like a pirate."));
    click(&c, "#settings button[type=submit]").await;
    wait_js(
        &c,
        "return document.getElementById('settings-status').textContent",
        "saved settings",
        |v| v == &json!("Saved"),
    )
    .await;

    // What the page stored, read through the API with Alice's own cookie.
    let cookie = c.get_all_cookies().await.expect("cookies");
    let jar: Vec<String> = cookie
        .iter()
        .map(|k| format!("{}={}", k.name(), k.value()))
        .collect();
    let csrf = js(&c, "return document.body.dataset.csrf").await;
    let detail = reqwest::Client::new()
        .get(format!("{}/api/conversations/{alpha}", server.base))
        .header("cookie", jar.join("; "))
        .header("x-csrf-token", csrf.as_str().unwrap_or_default())
        .send()
        .await
        .expect("get alpha");
    let detail: Value = detail.json().await.expect("json");
    assert_eq!(
        detail["settings"]["system_prompt"],
        json!("You answer like a pirate.")
    );
    assert_eq!(detail["organisation"]["pinned"], json!(true));
    assert_eq!(detail["organisation"]["tags"], json!(["databases", "rust"]));
    let folder = detail["organisation"]["folder_id"]
        .as_str()
        .expect("a folder")
        .to_string();
    let presets: Value = reqwest::Client::new()
        .get(format!("{}/api/presets", server.base))
        .header("cookie", jar.join("; "))
        .send()
        .await
        .expect("presets")
        .json()
        .await
        .expect("json");
    let pirate = presets["presets"][0]["id"]
        .as_str()
        .expect("the preset")
        .to_string();

    // Isolation: another owner gets 404 for Alice's conversation, folder and preset, sees
    // none of them listed, and cannot make a shared preset.
    let mut other = Browser::at(&server, 2, "/").await;
    for (method, path, body) in [
        (
            Method::PATCH,
            format!("/api/conversations/{alpha}"),
            json!({"pinned": false}),
        ),
        (
            Method::PATCH,
            format!("/api/folders/{folder}"),
            json!({"name": "Mine"}),
        ),
        (
            Method::DELETE,
            format!("/api/folders/{folder}"),
            json!(null),
        ),
        (
            Method::PATCH,
            format!("/api/presets/{pirate}"),
            json!({"name": "Mine", "system_prompt": "x"}),
        ),
        (
            Method::DELETE,
            format!("/api/presets/{pirate}"),
            json!(null),
        ),
    ] {
        let body = (!body.is_null()).then_some(&body);
        let a = other.json(method.clone(), &path, body).await;
        assert_eq!(
            a.status,
            StatusCode::NOT_FOUND,
            "{method} {path}: {}",
            a.text
        );
    }
    // Filing one's own conversation in another owner's folder is refused the same way.
    let mine = other
        .json(Method::POST, "/api/conversations", Some(&json!({})))
        .await;
    let mine: Value = serde_json::from_str(&mine.text).expect("created");
    let a = other
        .json(
            Method::PATCH,
            &format!(
                "/api/conversations/{}",
                mine["id"].as_str().unwrap_or_default()
            ),
            Some(&json!({"folder_id": folder})),
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text);
    let theirs = other.json(Method::GET, "/api/folders", None).await;
    assert_eq!(theirs.text, r#"{"folders":[]}"#);
    let theirs = other.json(Method::GET, "/api/presets", None).await;
    assert_eq!(theirs.text, r#"{"presets":[]}"#);
    let theirs = other
        .json(Method::GET, "/api/conversations/tags", None)
        .await;
    assert_eq!(theirs.text, r#"{"tags":[]}"#);
    let listed = other
        .get(&format!("/conversations?view=folder:{folder}"))
        .await;
    assert!(listed.text.contains("Nothing here."), "{}", listed.text);
    let shared = other
        .json(
            Method::POST,
            "/api/presets",
            Some(&json!({"name": "Everyone", "system_prompt": "Be kind.", "shared": true})),
        )
        .await;
    assert_eq!(shared.status, StatusCode::FORBIDDEN, "{}", shared.text);

    // An admin's shared preset: offered to Alice (and everyone), changed only by admins.
    add_admin(&server.database_url, "root", "root's password!");
    let mut admin = Browser::at(&server, 3, "/signin").await;
    let f = format!(
        "name=root&password={}",
        common::server::form_encode("root's password!")
    );
    assert_eq!(
        admin.post_form("/signin", &f).await.status,
        StatusCode::NO_CONTENT
    );
    admin.get("/").await;
    let made = admin
        .json(
            Method::POST,
            "/api/presets",
            Some(&json!({"name": "House style", "system_prompt": "Be brief and kind.", "shared": true})),
        )
        .await;
    assert_eq!(made.status, StatusCode::CREATED, "{}", made.text);
    let house: Value = serde_json::from_str(&made.text).expect("preset");
    c.refresh().await.expect("reload");
    let offered = js(
        &c,
        "return [...document.querySelectorAll('#preset-select option')].map(o => o.textContent)",
    )
    .await;
    assert_eq!(
        offered,
        json!(["Choose a preset…", "House style (shared)", "Pirate"]),
        "{offered}"
    );
    let a = other
        .json(
            Method::DELETE,
            &format!("/api/presets/{}", house["id"].as_str().unwrap_or_default()),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.text);
}
