//! MCP servers in the chat, end to end: the real `smolchat serve` binary with real MCP servers
//! from the npm registry (`@modelcontextprotocol/server-everything` over stdio and over
//! Streamable HTTP, `@modelcontextprotocol/server-filesystem` on a temporary folder; installed
//! by `scripts/install-test-deps.sh` into tests/mcp), and a hostile one (tests/mcp/hostile.js):
//! their tools are listed with their schemas, calls get the servers' real results (the
//! filesystem server refuses a path outside its folder, and that refusal is the result), a
//! reply that calls one goes on with the result, and a server that hangs, crashes, writes a
//! malformed frame, returns 100 MB or has a 1 MB schema never breaks a reply.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::browser_client::Browser;
use common::server::{eventually, Client, Server};
use reqwest::StatusCode;
use serde_json::{json, Value};

const ADMIN_TOKEN: &str = "mcp-test-admin-token";

fn mcp_dir() -> PathBuf {
    common::crate_root().join("tests/mcp")
}

fn package(name: &str) -> PathBuf {
    let p = mcp_dir()
        .join("node_modules/@modelcontextprotocol")
        .join(name);
    assert!(
        p.is_dir(),
        "{} is missing: run scripts/install-test-deps.sh (npm ci in tests/mcp)",
        p.display()
    );
    p
}

/// `server-everything` over Streamable HTTP on a free port, killed on drop.
struct HttpServer {
    child: Child,
    port: u16,
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn everything_over_http() -> HttpServer {
    let port = common::server::free_port();
    let child = Command::new("node")
        .arg(package("server-everything").join("dist/index.js"))
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start server-everything over HTTP");
    let up = eventually(Duration::from_secs(30), || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    assert!(up.is_some(), "server-everything did not listen on {port}");
    HttpServer { child, port }
}

/// `POST /ops/tools/call` as the admin.
async fn try_tool(server: &Server, name: &str, arguments: Value) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{}/ops/tools/call", server.base))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"name": name, "arguments": arguments}))
        .send()
        .await
        .expect("call");
    assert_eq!(r.status(), StatusCode::OK);
    r.json().await.expect("json")
}

async fn ops_tools(server: &Server) -> Value {
    reqwest::Client::new()
        .get(format!("{}/ops/tools", server.base))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("ops/tools")
        .json()
        .await
        .expect("json")
}

/// Waits until every MCP server has left `starting`; their statuses by name.
async fn settled(server: &Server) -> Value {
    eventually(Duration::from_secs(90), || async {
        let v = ops_tools(server).await;
        let all = v["mcp"].as_array()?;
        all.iter().all(|s| s["state"] != "starting").then(|| {
            Value::Object(
                all.iter()
                    .map(|s| (s["name"].as_str().unwrap_or("").to_string(), s.clone()))
                    .collect(),
            )
        })
    })
    .await
    .expect("the MCP servers connect or fail within 90 s")
}

fn tool_names(status: &Value) -> Vec<String> {
    status["tools"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| t["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn entry(name: &str, command: &Path, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "{{name = {name:?}, command = \"node\", args = [{:?}, {}], require_approval = false}}",
        command.display().to_string(),
        args.join(", ")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn real_mcp_servers_list_their_tools_and_answer_a_reply() {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = dir.path().join("shared");
    std::fs::create_dir_all(&files).expect("folder");
    std::fs::write(files.join("notes.txt"), "smolchat was here").expect("a file");
    std::fs::write(dir.path().join("secret.txt"), "not for the model").expect("a secret");
    let http = everything_over_http().await;
    let everything = package("server-everything").join("dist/index.js");
    let filesystem = package("server-filesystem").join("dist/index.js");
    let servers = format!(
        "[{}, {}, {{name = \"web\", url = \"http://127.0.0.1:{}/mcp\", require_approval = false}}]",
        entry("everything", &everything, &["stdio"]),
        entry("fs", &filesystem, &[files.to_str().expect("path")]),
        http.port
    );
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_TOOLS__MCP", servers.as_str()),
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
        ],
    )
    .await;
    let status = settled(&server).await;
    for name in ["everything", "fs", "web"] {
        assert_eq!(status[name]["state"], "ready", "{name}: {}", status[name]);
    }
    let everything_tools = tool_names(&status["everything"]);
    assert!(
        everything_tools.contains(&"everything__echo".to_string())
            && everything_tools.contains(&"everything__get-sum".to_string()),
        "{everything_tools:?}"
    );
    assert!(tool_names(&status["web"]).contains(&"web__echo".to_string()));
    assert!(tool_names(&status["fs"]).contains(&"fs__read_text_file".to_string()));
    // Listed with their schemas.
    let sum = status["everything"]["tools"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == "everything__get-sum"))
        .expect("get-sum");
    assert!(sum["schema"]["properties"]["a"].is_object(), "{sum}");

    // Real results, over stdio and over HTTP.
    let r = try_tool(&server, "everything__get-sum", json!({"a": 2, "b": 40})).await;
    assert_eq!(r["text"], "The sum of 2 and 40 is 42.", "{r}");
    let r = try_tool(&server, "web__echo", json!({"message": "over HTTP"})).await;
    assert_eq!(r["text"], "Echo: over HTTP", "{r}");
    let notes = files.join("notes.txt");
    let r = try_tool(&server, "fs__read_text_file", json!({"path": notes})).await;
    assert_eq!(r["error"], false, "{r}");
    assert!(
        r["text"]
            .as_str()
            .unwrap_or("")
            .contains("smolchat was here"),
        "{r}"
    );
    // Escaping the folder is refused by the server, and its refusal is the result.
    for escape in [
        dir.path().join("secret.txt").display().to_string(),
        format!("{}/../secret.txt", files.display()),
        "/etc/passwd".to_string(),
    ] {
        let r = try_tool(&server, "fs__read_text_file", json!({"path": escape})).await;
        assert_eq!(r["error"], true, "{escape}: {r}");
        let text = r["text"].as_str().unwrap_or("");
        assert!(text.contains("Access denied"), "{escape}: {text}");
        assert!(!text.contains("not for the model"), "{text}");
    }

    // A reply that calls one (forced: the model would not) gets the real result and goes on.
    let client = server.client();
    let id = client
        .create(json!({
            "temperature": 0, "max_tokens": 96,
            "tools": ["everything__get-sum"], "tool_choice": "everything__get-sum",
        }))
        .await;
    let turn = client.chat(&id, "Add two numbers for me.").await;
    assert_eq!(
        turn.done["message"]["status"], "complete",
        "{:?}",
        turn.events
    );
    let ended = turn
        .events
        .iter()
        .filter(|e| e.event == "tool_step")
        .map(|e| e.data["step"].clone())
        .find(|s| s["status"] != "running")
        .unwrap_or_else(|| panic!("an ended call: {:?}", turn.events));
    let args: Value =
        serde_json::from_str(ended["arguments"].as_str().expect("arguments")).expect("JSON");
    let (a, b) = (
        args["a"].as_f64().expect("a"),
        args["b"].as_f64().expect("b"),
    );
    assert_eq!(ended["status"], "done", "{ended}");
    let result = ended["result"].as_str().expect("result");
    assert!(
        result.starts_with("The sum of ") && result.ends_with(&format!("is {}.", a + b)),
        "{result} for {args}"
    );
    assert!(turn.events.iter().any(|e| e.event == "continuing"));

    // The admin page shows the servers, their tools and schemas.
    let mut admin = Browser::admin(&server, 3, ADMIN_TOKEN).await;
    let live = admin.get("/admin/live").await;
    assert!(
        live.text.contains("data-server=\"everything\""),
        "{}",
        live.text
    );
    assert!(live.text.contains("everything__get-sum"));
    assert!(
        live.text.contains("&quot;properties&quot;") || live.text.contains("&#34;properties&#34;")
    );
    let _keep = Client::new(&server.base);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_mcp_servers_end_a_step_never_a_reply() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hostile = mcp_dir().join("hostile.js");
    // The same server twice: `slow` with a short limit for the calls that never end.
    let servers = format!(
        "[{}, {}, {{name = \"missing\", command = \"/nonexistent/mcp-server\"}}]",
        entry("hostile", &hostile, &[]),
        entry("slow", &hostile, &[]).replace('}', ", timeout_s = 3}"),
    );
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_TOOLS__MCP", servers.as_str()),
            ("SMOLCHAT_TOOLS__MAX_RESULT_CHARS", "2000"),
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
        ],
    )
    .await;
    let status = settled(&server).await;
    // A server that cannot start is shown failed, with why; the others are unaffected.
    assert_eq!(
        status["missing"]["state"], "failed",
        "{}",
        status["missing"]
    );
    assert!(status["missing"]["error"]
        .as_str()
        .unwrap_or("")
        .contains("cannot start"));
    assert_eq!(status["hostile"]["state"], "ready", "{}", status["hostile"]);
    // The 1 MB schema is left out, saying why.
    let names = tool_names(&status["hostile"]);
    assert!(
        !names.iter().any(|n| n.contains("huge_schema")),
        "{names:?}"
    );
    let skipped = status["hostile"]["skipped"].to_string();
    assert!(
        skipped.contains("huge_schema") && skipped.contains("bytes"),
        "{skipped}"
    );

    // Each bad answer is an error result (or a cut one), never a failure of the call.
    let r = try_tool(&server, "hostile__fails", json!({})).await;
    assert_eq!(r["error"], true);
    assert!(
        r["text"]
            .as_str()
            .unwrap_or("")
            .contains("it went wrong on purpose"),
        "{r}"
    );
    // 100 MB in one frame: the SDK drops a frame over 16 MiB unread (memory stays bounded), so
    // the call ends at its time limit.
    let r = try_tool(&server, "slow__big", json!({})).await;
    assert_eq!(
        r["error"],
        true,
        "{}",
        &r.to_string()[..200.min(r.to_string().len())]
    );
    assert!(r["text"].as_str().unwrap_or("").contains("limit"), "{r}");
    let r = try_tool(&server, "slow__hang", json!({})).await;
    assert_eq!(r["error"], true);
    assert!(
        r["text"].as_str().unwrap_or("").contains("limit of 3 s"),
        "{r}"
    );
    let r = try_tool(&server, "slow__garbage", json!({})).await;
    assert_eq!(r["error"], true, "{r}");
    let r = try_tool(&server, "hostile__hello", json!({})).await;
    assert_eq!(r["text"], "hello from the hostile server", "{r}");
    let r = try_tool(&server, "missing__anything", json!({})).await;
    assert_eq!(r["error"], true);
    assert!(
        r["text"].as_str().unwrap_or("").contains("not connected"),
        "{r}"
    );

    // A reply whose call hangs: that step ends with the time limit, the reply goes on.
    let client = server.client();
    let id = client
        .create(json!({
            "temperature": 0, "max_tokens": 48,
            "tools": ["slow__hang"], "tool_choice": "slow__hang",
        }))
        .await;
    let turn = client.chat(&id, "Go.").await;
    assert_eq!(
        turn.done["message"]["status"], "complete",
        "{:?}",
        turn.events
    );
    let ended = turn
        .events
        .iter()
        .filter(|e| e.event == "tool_step")
        .map(|e| e.data["step"].clone())
        .find(|s| s["status"] != "running")
        .expect("an ended call");
    assert_eq!(ended["status"], "error");
    assert!(
        ended["result"].as_str().unwrap_or("").contains("limit"),
        "{ended}"
    );

    // A crash ends the server: shown failed; the call is an error result.
    let r = try_tool(&server, "hostile__crash", json!({})).await;
    assert_eq!(r["error"], true, "{r}");
    let failed = eventually(Duration::from_secs(10), || async {
        let v = ops_tools(&server).await;
        let s = v["mcp"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == "hostile")?
            .clone();
        (s["state"] == "failed").then_some(s)
    })
    .await;
    assert!(failed.is_some(), "the crashed server is shown failed");
    // The log holds none of what the server wrote or returned.
    let log = std::fs::read_to_string(&server.log).unwrap_or_default();
    assert!(!log.contains("it went wrong on purpose"));
    assert!(!log.contains("xxxxxxxxxxxxxxxx"));
}
