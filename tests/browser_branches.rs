//! Message versions and branches in a real headless Chromium against a real `smolchat serve`
//! with the default model: regenerate twice, switch between the three replies with ‹ ›,
//! continue from the second; edit the first message of a four-message conversation, switch back
//! to the original branch. Nothing is lost, and each branch's next reply is built from that
//! branch only: its prompt has exactly the token count `/v1/chat/completions` gives for the
//! branch's messages (the same prompt builder), never the other branches' text.

mod common;

use common::chromium::*;
use common::server::Server;
use fantoccini::Client;
use serde_json::{json, Value};

/// The conversation as the JSON API answers it, fetched by the page (its owner cookie).
async fn conversation(c: &Client, id: &str) -> Value {
    js(
        c,
        &format!(
            "const x = new XMLHttpRequest(); x.open('GET', '/api/conversations/{id}', false); \
             x.send(); return JSON.parse(x.responseText)"
        ),
    )
    .await
}

/// `[role, content]` of the branch shown.
fn shown(conv: &Value) -> Vec<(String, String)> {
    conv["messages"]
        .as_array()
        .map(|ms| {
            ms.iter()
                .map(|m| {
                    (
                        m["role"].as_str().unwrap_or("").to_string(),
                        m["content"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The version arrows' text on the message at `css` once the page is idle (after a reload).
async fn version_of(c: &Client, css: &str, want: &str) {
    let script = format!(
        "const e = document.querySelector({}); \
         return document.getElementById('stop-btn').hidden && e ? e.textContent : null",
        json!(format!("{css} .ver-count"))
    );
    wait_js(c, &script, &format!("version {want} on {css}"), |v| {
        v == &json!(want)
    })
    .await;
}

/// The prompt tokens `/v1/chat/completions` counts for `messages` (user and assistant turns,
/// each assistant turn as the model wrote it).
async fn v1_prompt_tokens(server: &Server, messages: &[Value]) -> u64 {
    let body: Vec<Value> = messages
        .iter()
        .map(|m| {
            let text = m["raw"].as_str().or(m["content"].as_str()).unwrap_or("");
            json!({"role": m["role"], "content": text})
        })
        .collect();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"messages": body, "max_tokens": 1, "temperature": 0}))
        .send()
        .await
        .expect("v1");
    let v: Value = r.json().await.expect("json");
    v["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage: {v}"))
}

/// The last reply of the branch shown was prompted with exactly the branch before it.
async fn built_from_the_branch(server: &Server, conv: &Value) {
    let messages = conv["messages"].as_array().cloned().unwrap_or_default();
    let (reply, before) = messages.split_last().expect("a reply");
    let expected = v1_prompt_tokens(server, before).await;
    assert_eq!(
        reply["prompt_tokens"].as_u64(),
        Some(expected),
        "the reply's prompt is the branch shown: {}",
        serde_json::to_string_pretty(&shown(conv)).unwrap_or_default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_and_branches_in_a_real_browser() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "20"),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "1.0"),
        ],
    )
    .await;
    let driver = start_driver(dir.path()).await;
    let alice = browser(&driver, &dir.path().join("alice"), DESKTOP).await;
    alice.goto(&server.base).await.expect("open");
    send(&alice, "Name a fruit.").await;
    wait_js(
        &alice,
        "return location.pathname",
        "the conversation page",
        |v| v.as_str().is_some_and(|p| p.starts_with("/c/")),
    )
    .await;
    let id = conversation_id(&alice).await;
    wait_js(&alice, IDLE, "the first reply", |v| v == &json!(1)).await;
    let first = conversation(&alice, &id).await;
    let first_reply = first["messages"][1]["id"].clone();

    // Regenerate twice: three versions of the reply, the newest shown.
    for n in ["2/2", "3/3"] {
        click(
            &alice,
            ".messages.idle > .msg.assistant:last-child .regen-btn",
        )
        .await;
        version_of(&alice, ".msg.assistant:last-child", n).await;
    }
    let three = conversation(&alice, &id).await;
    assert_eq!(three["messages"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        three["versions"][1],
        json!({"index": 3, "count": 3,
        "previous": three["versions"][1]["previous"], "next": null})
    );
    let third_reply = three["messages"][1]["id"].clone();

    // Switch between them: ‹ ‹ (the first), › (the second).
    let prev = ".msg.assistant:last-child .ver-btn[aria-label='Previous version']";
    let next = ".msg.assistant:last-child .ver-btn[aria-label='Next version']";
    click(&alice, prev).await;
    version_of(&alice, ".msg.assistant:last-child", "2/3").await;
    click(&alice, prev).await;
    version_of(&alice, ".msg.assistant:last-child", "1/3").await;
    assert_eq!(
        conversation(&alice, &id).await["messages"][1]["id"],
        first_reply
    );
    click(&alice, next).await;
    version_of(&alice, ".msg.assistant:last-child", "2/3").await;
    let second = conversation(&alice, &id).await;
    let second_reply = second["messages"][1].clone();
    assert!(second_reply["id"] != first_reply && second_reply["id"] != third_reply);
    // By id: the reply's text is rendered Markdown, which need not equal its stored source.
    let on_page = js(
        &alice,
        "return document.querySelector('.msg.assistant:last-child').dataset.id",
    )
    .await;
    assert_eq!(
        on_page, second_reply["id"],
        "the page shows the second version"
    );

    // Continue from the second: the next reply is built from [question, second version, new
    // question] only.
    send(&alice, "And a vegetable?").await;
    wait_js(&alice, IDLE, "the reply after the second version", |v| {
        v == &json!(2)
    })
    .await;
    let continued = conversation(&alice, &id).await;
    let roles: Vec<String> = shown(&continued).into_iter().map(|(r, _)| r).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert_eq!(continued["messages"][1]["id"], second_reply["id"]);
    built_from_the_branch(&server, &continued).await;
    let original = shown(&continued);

    // Edit the first message of the four: a new branch from the root.
    click(&alice, ".msg.user .edit-btn").await;
    let editing = js(&alice, "return document.getElementById('input').value").await;
    assert_eq!(editing, json!("Name a fruit."));
    let input = alice
        .find(fantoccini::Locator::Css("#input"))
        .await
        .expect("input");
    input.clear().await.expect("clear");
    send(&alice, "Name a colour.").await;
    version_of(&alice, ".msg.user", "2/2").await;
    wait_js(&alice, IDLE, "the edited branch's reply", |v| {
        v == &json!(1)
    })
    .await;
    let edited = conversation(&alice, &id).await;
    assert_eq!(shown(&edited)[0], ("user".into(), "Name a colour.".into()));
    assert_eq!(shown(&edited).len(), 2);
    built_from_the_branch(&server, &edited).await;

    // Back to the original branch: all four messages, as they were.
    click(&alice, ".msg.user .ver-btn[aria-label='Previous version']").await;
    version_of(&alice, ".msg.user", "1/2").await;
    let back = conversation(&alice, &id).await;
    assert_eq!(
        shown(&back),
        original,
        "nothing of the original branch was lost"
    );
    let texts = js(
        &alice,
        "return Array.from(document.querySelectorAll('.msg.user .text')).map(e => e.textContent)",
    )
    .await;
    assert_eq!(texts, json!(["Name a fruit.", "And a vegetable?"]));
    // And it goes on from there: built from the original branch only.
    send(&alice, "Thanks!").await;
    wait_js(&alice, IDLE, "the original branch's next reply", |v| {
        v == &json!(3)
    })
    .await;
    built_from_the_branch(&server, &conversation(&alice, &id).await).await;
    screenshot(&alice, "versions").await;

    // Another owner reaches none of it.
    let bob = browser(&driver, &dir.path().join("bob"), DESKTOP).await;
    bob.goto(&server.base).await.expect("open");
    let status = js(
        &bob,
        &format!(
            "const x = new XMLHttpRequest(); x.open('POST', '/api/conversations/{id}/select', false); \
             x.setRequestHeader('Content-Type', 'application/json'); \
             x.send(JSON.stringify({{message_id: {}}})); return x.status",
            second_reply["id"]
        ),
    )
    .await;
    assert_eq!(status, json!(404));
}

/// A share link: made from the chat page, opened in a fresh browser without an account, it
/// shows exactly the snapshot (not what is written later), is never indexed and sends no
/// referrer; revoked, it answers 404; nothing else of its owner is reachable from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_links_in_a_real_browser() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "16"),
            ("SMOLCHAT_AUTH__GUESTS", "true"),
        ],
    )
    .await;
    let driver = start_driver(dir.path()).await;
    let alice = browser(&driver, &dir.path().join("alice"), DESKTOP).await;
    alice.goto(&server.base).await.expect("open");
    // Another conversation of hers, which the link must not lead to.
    send(&alice, "A private note.").await;
    wait_js(&alice, IDLE, "the private reply", |v| v == &json!(1)).await;
    let private = conversation_id(&alice).await;
    alice.goto(&server.base).await.expect("new chat");
    send(&alice, "Tell me a recipe.").await;
    wait_js(
        &alice,
        "return location.pathname",
        "the conversation page",
        |v| {
            v.as_str()
                .is_some_and(|p| p.starts_with("/c/") && !p.contains(&private))
        },
    )
    .await;
    wait_js(&alice, IDLE, "the reply", |v| v == &json!(1)).await;
    let id = conversation_id(&alice).await;
    let snapshot = shown(&conversation(&alice, &id).await);

    click(&alice, "#share-btn").await;
    let url = wait_js(
        &alice,
        "const d = document.getElementById('share-dialog'); \
         return d.open ? document.getElementById('share-url').value : ''",
        "the share link",
        |v| v.as_str().is_some_and(|u| u.contains("/s/")),
    )
    .await;
    let url = url.as_str().unwrap_or_default().to_string();
    screenshot(&alice, "share-dialog").await;
    click(&alice, "#share-close").await;
    // Written after sharing: not in the snapshot.
    send(&alice, "And a dessert?").await;
    wait_js(&alice, IDLE, "the later reply", |v| v == &json!(2)).await;

    // A fresh browser, no cookie, no account.
    let carol = browser(&driver, &dir.path().join("carol"), DESKTOP).await;
    carol.goto(&url).await.expect("open the link");
    let page = js(
        &carol,
        "return [document.querySelector('h1').textContent, \
         Array.from(document.querySelectorAll('.msg')).map(m => [m.classList.contains('user') ? 'user' : 'assistant', \
           (m.querySelector('.text') || m.querySelector('.md')).innerText.trim()])]",
    )
    .await;
    assert_eq!(page[0], json!("Tell me a recipe."));
    // The replies are rendered Markdown (`**Oat**` shows as a bold "Oat"), so they are compared
    // by their words.
    let expected: Vec<Value> = snapshot.iter().map(|(r, c)| json!([r, words(c)])).collect();
    let shown: Vec<Value> = page[1]
        .as_array()
        .map(|msgs| {
            msgs.iter()
                .map(|m| json!([m[0], words(m[1].as_str().unwrap_or_default())]))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(shown, expected, "exactly the snapshot");
    let html = carol.source().await.expect("source");
    assert!(
        !html.contains(&id) && !html.contains(&private),
        "no conversation id on the page"
    );
    assert!(html.contains("noindex"));
    let cookies = carol.get_all_cookies().await.expect("cookies");
    assert!(
        cookies.is_empty(),
        "a share page sets no cookie: {cookies:?}"
    );
    screenshot(&carol, "share-page").await;
    let http = reqwest::Client::new();
    let r = http.get(&url).send().await.expect("get");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-robots-tag"], "noindex, nofollow");
    assert_eq!(r.headers()["referrer-policy"], "no-referrer");
    // Nothing else of hers from there: her conversations and the share list are 404 to carol.
    for path in [
        format!("/c/{private}"),
        format!("/c/{id}"),
        format!("/api/conversations/{id}/shares"),
    ] {
        let status = js(
            &carol,
            &format!(
                "const x = new XMLHttpRequest(); x.open('GET', '{path}', false); x.send(); return x.status"
            ),
        )
        .await;
        assert_eq!(status, json!(404), "{path}");
    }

    // Revoked from the chat page: the link is 404 from then on.
    click(&alice, "#share-btn").await;
    wait_js(
        &alice,
        "return document.getElementById('share-dialog').open",
        "a second link",
        |v| v == &json!(true),
    )
    .await;
    let second = js(&alice, "return document.getElementById('share-url').value").await;
    click(&alice, "#share-revoke").await;
    wait_js(
        &alice,
        "return document.getElementById('share-url').value",
        "the revoked link",
        |v| v == &json!("(revoked)"),
    )
    .await;
    let r = http
        .get(second.as_str().unwrap_or_default())
        .send()
        .await
        .expect("get");
    assert_eq!(r.status(), 404, "a revoked link");
    // The first link is still live until it is revoked too (through the JSON API).
    assert_eq!(http.get(&url).send().await.expect("get").status(), 200);
    let shares = conversation_shares(&alice, &id).await;
    let live: Vec<&Value> = shares
        .iter()
        .filter(|s| s["revoked"] == json!(false))
        .collect();
    assert_eq!((shares.len(), live.len()), (2, 1));
    let status = js(
        &alice,
        &format!(
            "const x = new XMLHttpRequest(); x.open('DELETE', '/api/conversations/{id}/shares/{}', false); \
             x.send(); return x.status",
            live[0]["id"].as_str().unwrap_or_default()
        ),
    )
    .await;
    assert_eq!(status, json!(204));
    assert_eq!(http.get(&url).send().await.expect("get").status(), 404);
    carol.refresh().await.expect("reload");
    let text = js(&carol, "return document.body.innerText").await;
    assert!(
        text.as_str()
            .unwrap_or_default()
            .contains("no such share link"),
        "{text}"
    );
    // A made-up token is 404 alike.
    let r = http
        .get(format!("{}/s/{}", server.base, "a".repeat(64)))
        .send()
        .await
        .expect("get");
    assert_eq!(r.status(), 404);
}

async fn conversation_shares(c: &Client, id: &str) -> Vec<Value> {
    js(
        c,
        &format!(
            "const x = new XMLHttpRequest(); x.open('GET', '/api/conversations/{id}/shares', false); \
             x.send(); return JSON.parse(x.responseText).shares"
        ),
    )
    .await
    .as_array()
    .cloned()
    .unwrap_or_default()
}

/// The words of a text, letters only: what a message's Markdown source and its rendering share
/// (emphasis, headings and list markers are gone from the rendered text).
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphabetic())
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}
