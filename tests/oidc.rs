//! OpenID Connect sign-in against a real provider: `oidc-provider` 8.8.1 from the npm registry
//! (`tests/oidc/provider.mjs`, installed by `scripts/install-test-deps.sh`), on a private port.
//!
//! - In headless Chromium: alice signs in through the provider's own login form, gets an account
//!   on the first sign-in, is an admin because the provider puts her in `chat-admins`, reaches
//!   `/admin`, signs out; signing in again finds the same account. Password sign-in is off.
//! - Without a browser (the same flow by hand, so each answer can be looked at): an ID token with
//!   a forged signature, an expired one, one for another audience, one with a wrong nonce and
//!   one from another issuer are each refused with a message saying which; a replayed code, a
//!   wrong `state` and a callback nobody started are refused; a user outside the allowed domains
//!   is refused. None of them gets a session, and the audit log holds each outcome.
//!
//! Node.js or the provider's packages missing is a failure, not a skip.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use common::browser_client::Browser;
use common::chromium::*;
use common::server::{free_port, Server};
use fantoccini::Locator;
use reqwest::StatusCode;
use serde_json::{json, Value};

const CLIENT_ID: &str = "smolchat-test";
const CLIENT_SECRET: &str = "a client secret for the tests";

/// The provider's process, stopped on drop.
struct Provider {
    child: Child,
    issuer: String,
}

impl Drop for Provider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_provider(port: u16, redirect: &str) -> Provider {
    let root = common::crate_root();
    let script = root.join("tests/oidc/provider.mjs");
    assert!(
        root.join("tests/oidc/node_modules/oidc-provider").exists(),
        "tests/oidc/node_modules is missing: run scripts/install-test-deps.sh (npm ci --prefix tests/oidc)"
    );
    let mut child = Command::new("node")
        .arg(&script)
        .args(["--port", &port.to_string()])
        .args(["--client-id", CLIENT_ID, "--client-secret", CLIENT_SECRET])
        .args(["--redirect-uri", redirect])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("node must be installed (scripts/install-test-deps.sh)");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the provider's READY line");
    let issuer = line
        .trim()
        .strip_prefix("READY ")
        .unwrap_or_else(|| panic!("the provider did not start: {line:?}"))
        .to_string();
    Provider { child, issuer }
}

/// A server signing in through `issuer` (a port chosen before the provider starts, since the
/// provider must know the server's redirect URL and the server the issuer).
async fn start_server(dir: &std::path::Path, issuer: &str) -> Server {
    let database_url = format!("sqlite://{}", dir.join("db.sqlite").display());
    let issuer = issuer.to_string();
    Server::start_for_port(dir, &database_url, move |port| {
        [
            ("SMOLCHAT_AUTH__OIDC__ISSUER", issuer.clone()),
            ("SMOLCHAT_AUTH__OIDC__CLIENT_ID", CLIENT_ID.into()),
            ("SMOLCHAT_AUTH__OIDC__CLIENT_SECRET", CLIENT_SECRET.into()),
            (
                "SMOLCHAT_AUTH__OIDC__REDIRECT_URL",
                format!("http://127.0.0.1:{port}/auth/oidc/callback"),
            ),
            (
                "SMOLCHAT_AUTH__OIDC__SCOPES",
                r#"["openid", "profile", "email", "groups"]"#.into(),
            ),
            ("SMOLCHAT_AUTH__OIDC__ADMIN_GROUP", "chat-admins".into()),
            (
                "SMOLCHAT_AUTH__OIDC__ALLOWED_DOMAINS",
                r#"["example.com"]"#.into(),
            ),
            ("SMOLCHAT_AUTH__OIDC__LABEL", "Example ID".into()),
            ("SMOLCHAT_AUTH__PASSWORD_LOGIN", "false".into()),
            (
                "SMOLCHAT_SERVER__ADMIN_TOKEN",
                "admin-token-for-tests".into(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    })
    .await
}

/// A minimal cookie jar over reqwest without redirects: the provider's cookies by name.
struct Agent {
    http: reqwest::Client,
    jar: BTreeMap<String, String>,
}

struct Hop {
    status: StatusCode,
    location: Option<String>,
    set_cookies: Vec<String>,
    body: String,
}

impl Agent {
    fn new() -> Agent {
        Agent {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("client"),
            jar: BTreeMap::new(),
        }
    }

    async fn request(&mut self, method: reqwest::Method, url: &str, form: Option<&str>) -> Hop {
        let cookies = self
            .jar
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ");
        let mut req = self.http.request(method, url);
        if !cookies.is_empty() {
            req = req.header("Cookie", cookies);
        }
        if let Some(form) = form {
            req = req
                .header("Content-Type", "application/x-www-form-urlencoded")
                .body(form.to_string());
        }
        let res = req.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
        let status = res.status();
        let location = res
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok())
            .map(|l| absolute(url, l));
        let set_cookies: Vec<String> = res
            .headers()
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_string))
            .collect();
        for c in &set_cookies {
            let pair = c.split(';').next().unwrap_or_default();
            if let Some((k, v)) = pair.split_once('=') {
                let expired = c.to_ascii_lowercase().contains("max-age=0")
                    || c.to_ascii_lowercase().contains("expires=thu, 01 jan 1970");
                if v.is_empty() || expired {
                    self.jar.remove(k.trim());
                } else {
                    self.jar.insert(k.trim().to_string(), v.to_string());
                }
            }
        }
        let body = res.text().await.unwrap_or_default();
        Hop {
            status,
            location,
            set_cookies,
            body,
        }
    }

    async fn get(&mut self, url: &str) -> Hop {
        self.request(reqwest::Method::GET, url, None).await
    }
}

fn absolute(base: &str, location: &str) -> String {
    if location.starts_with("http://") || location.starts_with("https://") {
        return location.to_string();
    }
    let origin: String = base.splitn(4, '/').take(3).collect::<Vec<_>>().join("/");
    format!("{origin}{location}")
}

/// Starts a sign-in at the server and walks the provider (logging in as `login` when it asks)
/// until the provider sends the browser back: the callback URL the server would get.
async fn to_callback(agent: &mut Agent, base: &str, login: &str) -> String {
    let start = agent.get(&format!("{base}/auth/oidc/login")).await;
    assert_eq!(start.status, StatusCode::SEE_OTHER, "{}", start.body);
    assert!(
        start
            .set_cookies
            .iter()
            .any(|c| c.starts_with("smolchat_oidc=")
                && c.contains("HttpOnly")
                && c.contains("SameSite=Lax")),
        "{:?}",
        start.set_cookies
    );
    let mut url = start.location.expect("a redirect to the provider");
    assert!(url.contains("code_challenge_method=S256"), "{url}");
    assert!(url.contains("nonce="), "{url}");
    for _ in 0..10 {
        if url.starts_with(&format!("{base}/auth/oidc/callback")) {
            return url;
        }
        let hop = agent.get(&url).await;
        if let Some(next) = hop.location {
            url = next;
            continue;
        }
        assert!(
            hop.body.contains("id=\"login\""),
            "expected the provider's login form at {url}: {} {}",
            hop.status,
            hop.body
        );
        let action = hop
            .body
            .split("action=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .expect("the login form's action");
        let posted = agent
            .request(
                reqwest::Method::POST,
                &absolute(&url, action),
                Some(&format!("login={login}&password=pw")),
            )
            .await;
        url = posted
            .location
            .unwrap_or_else(|| panic!("login refused: {}", posted.body));
    }
    panic!("the provider never sent the browser back");
}

async fn tamper(issuer: &str, mode: &str) {
    let res = reqwest::Client::new()
        .post(format!("{issuer}/__test/tamper"))
        .json(&json!({ "mode": mode }))
        .send()
        .await
        .expect("tamper");
    assert!(res.status().is_success(), "tamper {mode}: {}", res.status());
}

/// The account the server's session cookie in `agent` stands for ("" for none).
async fn who(agent: &mut Agent, base: &str) -> String {
    let page = agent.get(&format!("{base}/account")).await;
    if page.status != StatusCode::OK {
        return String::new();
    }
    // The account page's heading: `<h1><span class="logo" …>✦</span> NAME</h1>`.
    page.body
        .split("</span> ")
        .nth(1)
        .and_then(|s| s.split("</h1>").next())
        .unwrap_or_default()
        .trim()
        .to_string()
}

async fn audit(server: &Server) -> Vec<Value> {
    let mut admin = Browser::admin(server, 3, "admin-token-for-tests").await;
    let log = admin.get("/admin/audit.json").await;
    assert_eq!(log.status, StatusCode::OK, "{}", log.text);
    let v: Value = serde_json::from_str(&log.text).expect("json");
    v["entries"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_signs_in_through_the_provider_and_is_admin_by_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let provider_port = free_port();
    let issuer = format!("http://127.0.0.1:{provider_port}");
    let server = start_server(dir.path(), &issuer).await;
    let base = server.base.clone();
    let _provider = start_provider(provider_port, &format!("{base}/auth/oidc/callback"));

    let driver = start_driver(dir.path()).await;
    let c = browser(&driver, &dir.path().join("alice"), DESKTOP).await;
    c.goto(&format!("{base}/signin"))
        .await
        .expect("signin page");
    // Passwords are off: only the provider's button.
    assert_eq!(
        js(&c, "return document.getElementById('signin-form') === null").await,
        json!(true)
    );
    click(&c, "#oidc-signin").await;
    let login = c
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#login"))
        .await
        .expect("the provider's login form");
    login.send_keys("alice").await.expect("type");
    c.find(Locator::Css("#password"))
        .await
        .expect("password")
        .send_keys("pw")
        .await
        .expect("type");
    click(&c, "#signin").await;
    wait_js(
        &c,
        "return location.origin + location.pathname",
        "back home",
        |v| v == &json!(format!("{base}/")),
    )
    .await;
    let account = wait_js(
        &c,
        "const b = document.getElementById('account-box'); return b ? b.innerText : null",
        "the account box",
        |v| v.is_string(),
    )
    .await;
    assert!(
        account.as_str().unwrap_or_default().starts_with("alice"),
        "{account}"
    );
    // Admin by the provider's group.
    c.goto(&format!("{base}/admin")).await.expect("admin");
    wait_js(
        &c,
        "return document.getElementById('new-user-form') !== null",
        "the admin page's user forms",
        |v| v == &json!(true),
    )
    .await;
    screenshot(&c, "oidc-admin").await;
    // Sign out ends the local session.
    c.goto(&format!("{base}/account")).await.expect("account");
    click(&c, "#signout-btn").await;
    wait_js(&c, "return location.pathname", "home", |v| v == &json!("/")).await;
    c.goto(&format!("{base}/account")).await.expect("account");
    wait_js(&c, "return location.pathname", "the sign-in page", |v| {
        v == &json!("/signin")
    })
    .await;
    // The provider still has a session: signing in again returns at once, to the same account.
    click(&c, "#oidc-signin").await;
    wait_js(
        &c,
        "return location.origin + location.pathname",
        "back home",
        |v| v == &json!(format!("{base}/")),
    )
    .await;
    let entries = audit(&server).await;
    let sign_ins: Vec<&Value> = entries
        .iter()
        .filter(|e| e["action"] == "auth.sign_in" && e["actor"] == "user:alice")
        .collect();
    assert_eq!(sign_ins.len(), 2, "{entries:#?}");
    assert!(
        sign_ins.iter().any(|e| e["detail"] == "oidc, account made"),
        "{sign_ins:#?}"
    );
    assert!(
        entries
            .iter()
            .any(|e| e["action"] == "auth.sign_out" && e["actor"] == "user:alice"),
        "{entries:#?}"
    );
    c.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_expired_misdirected_and_replayed_sign_ins_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let provider_port = free_port();
    let issuer = format!("http://127.0.0.1:{provider_port}");
    let server = start_server(dir.path(), &issuer).await;
    let base = server.base.clone();
    let provider = start_provider(provider_port, &format!("{base}/auth/oidc/callback"));

    // A good sign-in first (bob, not an admin), kept for the replay below.
    let mut agent = Agent::new();
    let callback = to_callback(&mut agent, &base, "bob").await;
    let pending = agent
        .jar
        .get("smolchat_oidc")
        .cloned()
        .expect("pending cookie");
    let done = agent.get(&callback).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    assert_eq!(done.location.as_deref(), Some(format!("{base}/").as_str()));
    assert!(
        !agent.jar.contains_key("smolchat_oidc"),
        "the pending cookie is dropped"
    );
    assert_eq!(who(&mut agent, &base).await, "bob");
    let admin_page = agent.get(&format!("{base}/admin")).await;
    assert!(
        !admin_page.body.contains("new-user-form"),
        "bob is not in chat-admins"
    );

    // The same callback again, with the same pending cookie: the provider refuses the code.
    let mut replay = Agent::new();
    replay.jar.insert("smolchat_oidc".into(), pending);
    let again = replay.get(&callback).await;
    assert_eq!(again.status, StatusCode::UNAUTHORIZED, "{}", again.body);
    assert!(again.body.contains("already used"), "{}", again.body);
    assert!(!replay.jar.contains_key("smolchat_session"));
    // Without the pending cookie (a link replayed elsewhere): nothing to finish.
    let mut stranger = Agent::new();
    let lost = stranger.get(&callback).await;
    assert_eq!(lost.status, StatusCode::BAD_REQUEST, "{}", lost.body);
    assert!(lost.body.contains("was not started here"), "{}", lost.body);

    // Spoiled ID tokens, one per way of spoiling.
    for (mode, says) in [
        ("forged_signature", "signature does not verify"),
        ("expired", "has expired"),
        ("wrong_audience", "issued to another client"),
        ("wrong_nonce", "nonce does not match"),
        ("wrong_issuer", "another issuer"),
    ] {
        let mut agent = Agent::new();
        let callback = to_callback(&mut agent, &base, "bob").await;
        tamper(&provider.issuer, mode).await;
        let res = agent.get(&callback).await;
        assert_eq!(res.status, StatusCode::UNAUTHORIZED, "{mode}: {}", res.body);
        assert!(
            res.body.contains("The ID token was refused")
                || res.body.contains("the ID token was refused"),
            "{mode}: {}",
            res.body
        );
        assert!(
            res.body.contains(says),
            "{mode}: expected {says:?} in {}",
            res.body
        );
        assert!(
            !agent.jar.contains_key("smolchat_session"),
            "{mode}: no session"
        );
        assert_eq!(who(&mut agent, &base).await, "", "{mode}");
    }

    // The answer to another sign-in's state.
    let mut agent = Agent::new();
    let callback = to_callback(&mut agent, &base, "bob").await;
    let wrong = callback.replace("state=", "state=x");
    let res = agent.get(&wrong).await;
    assert_eq!(res.status, StatusCode::BAD_REQUEST, "{}", res.body);
    assert!(res.body.contains("state mismatch"), "{}", res.body);

    // Outside the allowed domains.
    let mut agent = Agent::new();
    let callback = to_callback(&mut agent, &base, "mallory").await;
    let res = agent.get(&callback).await;
    assert_eq!(res.status, StatusCode::FORBIDDEN, "{}", res.body);
    assert!(res.body.contains("allowed_domains"), "{}", res.body);
    assert_eq!(who(&mut agent, &base).await, "");

    // Passwords are off: the form's endpoint says where to go instead, even for a real form
    // post with its CSRF token.
    let mut form_user = Browser::at(&server, 4, "/signin").await;
    let res = form_user
        .post_form("/signin", "name=bob&password=whatever-it-is")
        .await;
    assert_eq!(res.status, StatusCode::FORBIDDEN, "{}", res.text);
    assert!(res.text.contains("sign in with Example ID"), "{}", res.text);

    // The log: one sign-in (bob's) and every refusal, from this address.
    let entries = audit(&server).await;
    let failed = entries
        .iter()
        .filter(|e| e["action"] == "auth.sign_in_failed" && e["detail"] == "oidc")
        .count();
    assert!(failed >= 9, "{failed} refusals logged: {entries:#?}");
    assert_eq!(
        entries
            .iter()
            .filter(|e| e["action"] == "auth.sign_in" && e["actor"] == "user:bob")
            .count(),
        1,
        "{entries:#?}"
    );
    assert!(
        entries
            .iter()
            .filter(|e| e["detail"] == "oidc")
            .all(|e| e["address"] == "127.0.0.1"),
        "{entries:#?}"
    );
}
