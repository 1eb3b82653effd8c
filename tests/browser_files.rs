//! Files in the conversation, in a real headless Chromium against a real `smolchat serve` with
//! the real SmolLM2 model: a PDF (tests/data/files/report.pdf), a CSV and a source file attached
//! from the composer and asked about. Their text is in the prompt — the stored prompt text holds
//! it, and the reply's prompt token count equals that of the same files sent to
//! `/v1/chat/completions` as `file` parts (the one format). The chips survive a reload and an
//! export → import. A 50 MB file and executables are refused, saying why.

mod common;

use base64::Engine as _;
use common::chromium::*;
use common::server::Server;
use fantoccini::{Client, Locator};
use serde_json::{json, Value};

const CSV: &str = "city,population\nLisbon,545000\nPorto,232000\n";
const CODE: &str = "fn main() {\n    let answer = 6 * 7;\n    println!(\"{answer}\");\n}\n";

/// Chooses `paths` in the composer's file input (shown for the driver: it types into it).
async fn attach(c: &Client, paths: &[&std::path::Path]) {
    js(c, "document.getElementById('file-input').hidden = false").await;
    let joined: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    c.find(Locator::Css("#file-input"))
        .await
        .expect("file input")
        .send_keys(&joined.join("\n"))
        .await
        .expect("choose files");
}

const PENDING: &str =
    "return [...document.querySelectorAll('#pending-files .file-chip .file-name')].map(n => n.textContent)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_attached_read_into_the_prompt_kept_and_refused_saying_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "8"),
            ("SMOLCHAT_SAMPLING__TEMPERATURE", "0"),
        ],
    )
    .await;
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).expect("files dir");
    let pdf = std::fs::read(common::crate_root().join("tests/data/files/report.pdf")).expect("pdf");
    let pdf_path = files.join("report.pdf");
    std::fs::write(&pdf_path, &pdf).expect("write");
    let csv_path = files.join("cities.csv");
    std::fs::write(&csv_path, CSV).expect("write");
    let code_path = files.join("main.rs");
    std::fs::write(&code_path, CODE).expect("write");

    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("a"), DESKTOP).await;
    c.goto(&server.base).await.expect("open");

    // Attaching on a new chat makes the conversation and opens it with the chips.
    attach(&c, &[&pdf_path, &csv_path, &code_path]).await;
    wait_js(&c, PENDING, "three waiting files", |v| {
        v == &json!(["report.pdf", "cities.csv", "main.rs"])
    })
    .await;
    let id = conversation_id(&c).await;
    let kinds = js(
        &c,
        "return [...document.querySelectorAll('#pending-files .file-kind')].map(n => n.textContent)",
    )
    .await;
    assert_eq!(kinds, json!(["pdf", "csv", "code"]));
    screenshot(&c, "files-pending").await;

    let question = "What is the code word in the report?";
    send(&c, question).await;
    // The page reloads once the reply is done; the chips are then on the message.
    let chips = "return [...document.querySelectorAll('.msg.user .file-chip .file-name')].map(n => n.textContent)";
    wait_js(&c, chips, "the chips on the sent message", |v| {
        v == &json!(["report.pdf", "cities.csv", "main.rs"])
    })
    .await;
    wait_js(&c, IDLE, "the reply", |v| v == &json!(1)).await;
    assert_eq!(js(&c, PENDING).await, json!([]), "nothing waits any more");

    // The prompt text the model read holds each file, in the documented blocks.
    let (status, export) = fetch(&c, "GET", &format!("/api/conversations/{id}/export"), None).await;
    assert_eq!(status, 200, "{export}");
    let user = &export["messages"][0];
    let raw = user["raw"].as_str().unwrap_or_default();
    assert!(
        raw.starts_with("<file name=\"report.pdf\" type=\"pdf\">\n"),
        "{raw}"
    );
    assert!(raw.contains("PAPAYA-42"), "the PDF's text: {raw}");
    assert!(
        raw.contains("<file name=\"cities.csv\" type=\"csv\">\ncity,population\nLisbon,545000"),
        "{raw}"
    );
    assert!(raw.contains("let answer = 6 * 7;"), "{raw}");
    assert!(raw.ends_with(&format!("</file>\n\n{question}")), "{raw}");
    assert_eq!(
        user["content"],
        json!(question),
        "the message shows what was typed"
    );
    assert_eq!(user["files"].as_array().map(Vec::len), Some(3));

    // The same files as /v1 `file` parts give the same prompt, token for token.
    let (_, detail) = fetch(&c, "GET", &format!("/api/conversations/{id}"), None).await;
    let reply_prompt = detail["messages"][1]["prompt_tokens"]
        .as_i64()
        .expect("prompt tokens");
    let part = |name: &str, bytes: &[u8], mime: &str| {
        json!({"type": "file", "file": {"filename": name,
            "file_data": format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))}})
    };
    let v1 = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({
            "messages": [{"role": "user", "content": [
                part("report.pdf", &pdf, "application/pdf"),
                part("cities.csv", CSV.as_bytes(), "text/csv"),
                part("main.rs", CODE.as_bytes(), "text/plain"),
                {"type": "text", "text": question},
            ]}],
            "max_tokens": 1,
            "temperature": 0,
        }))
        .send()
        .await
        .expect("v1");
    let v1: Value = v1.json().await.expect("v1 json");
    assert_eq!(
        v1["usage"]["prompt_tokens"].as_i64(),
        Some(reply_prompt),
        "the conversation's prompt and /v1 with file parts: {v1}"
    );

    // A reload keeps the chips; an export imported again has them too.
    c.refresh().await.expect("reload");
    wait_js(&c, chips, "chips after a reload", |v| {
        v.as_array().map(Vec::len) == Some(3)
    })
    .await;
    let (status, imported) = fetch(
        &c,
        "POST",
        "/api/conversations/import",
        Some(export.clone()),
    )
    .await;
    assert_eq!(status, 201, "{imported}");
    let copy = imported["id"].as_str().expect("imported id").to_string();
    c.goto(&format!("{}/c/{copy}", server.base))
        .await
        .expect("open the copy");
    wait_js(&c, chips, "chips on the imported conversation", |v| {
        v == &json!(["report.pdf", "cities.csv", "main.rs"])
    })
    .await;
    let (_, again) = fetch(
        &c,
        "GET",
        &format!("/api/conversations/{copy}/export"),
        None,
    )
    .await;
    assert_eq!(
        again["messages"][0]["files"],
        export["messages"][0]["files"]
    );
    assert_eq!(again["messages"][0]["raw"], export["messages"][0]["raw"]);

    // Refusals, each saying why: a 50 MB file (the page's own check, then the server's), a
    // program (by its bytes, whatever its name), a type the server does not read.
    let huge = files.join("huge.txt");
    let f = std::fs::File::create(&huge).expect("huge");
    f.set_len(50 << 20).expect("50 MB");
    let exe = files.join("setup.exe");
    std::fs::write(&exe, b"MZ\x90\0\x03\0\0\0\x04\0").expect("exe");
    let disguised = files.join("notes.txt");
    std::fs::write(&disguised, b"\x7fELF\x02\x01\x01\0\0\0").expect("elf");
    let refusals: [(&std::path::Path, &str); 3] = [
        (&huge, "is 50.0 MB; files may be at most 10 MB"),
        (&exe, "is an executable program"),
        (&disguised, "is an executable program (an ELF binary)"),
    ];
    for (path, why) in refusals {
        js(&c, "delete document.body.dataset.lastError").await;
        attach(&c, &[path]).await;
        let shown = wait_js(
            &c,
            "return document.body.dataset.lastError || ''",
            "a refusal",
            |v| !v.as_str().unwrap_or("").is_empty(),
        )
        .await;
        assert!(
            shown.as_str().unwrap_or("").contains(why),
            "{}: {shown}",
            path.display()
        );
    }
    assert_eq!(js(&c, PENDING).await, json!([]), "nothing refused waits");
    // The server refuses the 50 MB body itself too (413), before reading it all.
    let status = c
        .execute_async(
            "const done = arguments[arguments.length - 1]; \
             fetch(location.pathname.replace('/c/', '/api/conversations/') + '/files?name=huge.txt', \
               {method: 'POST', credentials: 'same-origin', headers: {'x-csrf-token': document.body.dataset.csrf}, \
                body: new Blob([new Uint8Array(50 * 1048576)])}) \
             .then(r => r.json().then(j => done([r.status, j.error.message]))).catch(e => done([0, String(e)]));",
            vec![],
        )
        .await
        .expect("upload");
    assert_eq!(status[0], json!(413), "{status}");
    assert!(
        status[1]
            .as_str()
            .unwrap_or("")
            .contains("larger than 10 MiB"),
        "{status}"
    );
    let (status, body) = fetch(&c, "GET", &format!("/api/conversations/{copy}/files"), None).await;
    assert_eq!(status, 200);
    assert_eq!(body["files"].as_array().map(Vec::len), Some(3), "{body}");

    // Another owner (a fresh guest) reaches none of these files: 404 like a missing one.
    let stranger = reqwest::Client::new();
    let url = |path: String| format!("{}{path}", server.base);
    let (_, listed) = fetch(&c, "GET", &format!("/api/conversations/{copy}/files"), None).await;
    let one = listed["files"][0]["id"]
        .as_str()
        .expect("a file id")
        .to_string();
    for (method, path) in [
        (
            reqwest::Method::GET,
            format!("/api/conversations/{copy}/files"),
        ),
        (
            reqwest::Method::POST,
            format!("/api/conversations/{copy}/files?name=x.txt"),
        ),
        (
            reqwest::Method::DELETE,
            format!("/api/conversations/{copy}/files/{one}"),
        ),
    ] {
        let r = stranger
            .request(method.clone(), url(path.clone()))
            .body("hello")
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 404, "{method} {path}");
    }
    // Nor can a file of one conversation ride on a message of another.
    let (_, mine) = fetch(&c, "POST", "/api/conversations", Some(json!({}))).await;
    let mine = mine["id"].as_str().expect("id").to_string();
    let (status, refused) = fetch(
        &c,
        "POST",
        &format!("/api/conversations/{mine}/messages"),
        Some(json!({"content": "hi", "files": [one]})),
    )
    .await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("not waiting in this conversation"),
        "{refused}"
    );
}
