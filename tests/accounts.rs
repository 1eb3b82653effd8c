//! User accounts against a real `smolchat serve`: sign-up (moving the guest's conversations),
//! sign-in and sign-out with server-side sessions, throttled wrong passwords, password changes,
//! disabled users, invite-only and closed sign-up, `auth.guests = false`, personal API keys on
//! `/v1`, the admin role and the users table, and the `user`/`invite` CLI.
//!
//! Different client addresses come from binding the client to other loopback addresses
//! (127.0.0.2, …), which Linux routes to the server on 127.0.0.1.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::browser_client::{Answer, Browser};
use common::server::{eventually, Server};
use reqwest::StatusCode;
use serde_json::{json, Value};

const SESSION: &str = "smolchat_session";
const OWNER: &str = "smolchat_owner";

fn form(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| format!("{k}={}", common::server::form_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

trait Account {
    async fn signup(&mut self, name: &str, password: &str) -> Answer;
    async fn signup_invited(&mut self, name: &str, password: &str, invite: &str) -> Answer;
    async fn signin(&mut self, name: &str, password: &str) -> Answer;
    async fn signout(&mut self) -> Answer;
    /// The ids of the caller's conversations (JSON API).
    async fn conversation_ids(&mut self) -> Vec<String>;
    async fn create_conversation(&mut self) -> String;
    /// Whether `/account` shows an account (200) rather than sending to `/signin` (303).
    async fn signed_in(&mut self) -> bool;
}

impl Account for Browser {
    async fn signup(&mut self, name: &str, password: &str) -> Answer {
        self.signup_invited(name, password, "").await
    }

    async fn signup_invited(&mut self, name: &str, password: &str, invite: &str) -> Answer {
        // As a browser does: the form page first (its CSRF token is the current owner's).
        self.get("/signup").await;
        let f = form(&[("name", name), ("password", password), ("invite", invite)]);
        let a = self.post_form("/signup", &f).await;
        if a.status == StatusCode::NO_CONTENT {
            // The owner changed: fetch a page for the new CSRF token.
            self.get("/").await;
        }
        a
    }

    async fn signin(&mut self, name: &str, password: &str) -> Answer {
        self.get("/signin").await;
        let f = form(&[("name", name), ("password", password)]);
        let a = self.post_form("/signin", &f).await;
        if a.status == StatusCode::NO_CONTENT {
            self.get("/").await;
        }
        a
    }

    async fn signout(&mut self) -> Answer {
        let a = self.post_form("/signout", "").await;
        self.get("/signin").await;
        a
    }

    async fn conversation_ids(&mut self) -> Vec<String> {
        let a = self.get("/api/conversations").await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        let v: Value = serde_json::from_str(&a.text).expect("json");
        v["conversations"]
            .as_array()
            .expect("conversations")
            .iter()
            .map(|c| c["id"].as_str().expect("id").to_string())
            .collect()
    }

    async fn create_conversation(&mut self) -> String {
        let a = self
            .call(reqwest::Method::POST, "/api/conversations", None, &[])
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
        let v: Value = serde_json::from_str(&a.text).expect("json");
        v["id"].as_str().expect("id").to_string()
    }

    async fn signed_in(&mut self) -> bool {
        let a = self.get("/account").await;
        match a.status {
            StatusCode::OK => true,
            StatusCode::SEE_OTHER => {
                assert_eq!(a.headers["location"], "/signin");
                false
            }
            other => panic!("/account answered {other}: {}", a.text),
        }
    }
}

#[tokio::test]
async fn sign_up_in_out_and_sessions_are_server_side() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[]).await;

    // A guest chats: one conversation under the guest cookie.
    let mut a = Browser::at(&server, 1, "/").await;
    assert!(a.cookies.contains_key(OWNER));
    assert!(a.get("/").await.text.contains("id=\"signin-link\""));
    let guest_conv = a.create_conversation().await;

    // Sign-up: a session cookie with the right attributes, the guest cookie dropped, the guest's
    // conversation now the account's.
    assert_eq!(
        a.signup("Alice", "short").await.status,
        StatusCode::BAD_REQUEST,
        "8 characters at least"
    );
    assert_eq!(
        a.signup("bad name!", "long enough").await.status,
        StatusCode::BAD_REQUEST
    );
    let up = a.signup("Alice", "correct horse").await;
    assert_eq!(up.status, StatusCode::NO_CONTENT, "{}", up.text);
    assert_eq!(up.headers["hx-redirect"], "/");
    let set = up.set_cookies().join("\n");
    for attribute in ["smolchat_session=", "HttpOnly", "SameSite=Lax", "Path=/"] {
        assert!(set.contains(attribute), "{attribute} missing: {set}");
    }
    assert!(!set.contains("Secure"), "plain HTTP: {set}");
    assert!(!set.contains("correct horse"));
    assert!(
        !a.cookies.contains_key(OWNER),
        "the guest cookie is cleared"
    );
    let page = a.get("/").await;
    assert!(
        page.text.contains("id=\"account-link\">Alice<"),
        "{}",
        page.text
    );
    assert_eq!(a.conversation_ids().await, vec![guest_conv.clone()]);
    // The name is taken, whatever its case.
    let mut other = Browser::at(&server, 2, "/").await;
    assert_eq!(
        other.signup("alice", "another password").await.status,
        StatusCode::CONFLICT
    );

    // A copy of the cookie works elsewhere…
    let cookie = a.cookies[SESSION].clone();
    assert_eq!(cookie.len(), 64);
    let mut copy = Browser::at(&server, 3, "/").await;
    copy.cookies.insert(SESSION.into(), cookie.clone());
    assert_eq!(copy.conversation_ids().await, vec![guest_conv.clone()]);
    // …until sign-out, which revokes the session server-side: the copy is a guest again and is
    // told to drop the cookie.
    let out = a.signout().await;
    assert_eq!(out.status, StatusCode::NO_CONTENT);
    assert!(!a.cookies.contains_key(SESSION));
    let refused = copy.get("/api/conversations").await;
    assert!(refused
        .set_cookies()
        .iter()
        .any(|c| c.starts_with("smolchat_session=;")));
    copy.cookies.insert(SESSION.into(), cookie);
    assert!(copy.conversation_ids().await.is_empty());
    assert!(!copy.signed_in().await);
    assert!(a.conversation_ids().await.is_empty(), "a new guest");

    // Sign-in (the name in any case) from two browsers; a password change from one signs the
    // other out and keeps the first signed in with a new session.
    let wrong = a.signin("alice", "correct horsE").await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.text.contains("wrong name or password"));
    assert_eq!(
        a.signin("ALICE", "correct horse").await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(a.conversation_ids().await, vec![guest_conv.clone()]);
    let mut b = Browser::at(&server, 4, "/").await;
    assert_eq!(
        b.signin("alice", "correct horse").await.status,
        StatusCode::NO_CONTENT
    );
    assert!(b.signed_in().await);
    let before = a.cookies[SESSION].clone();
    let changed = a
        .post_form(
            "/account/password",
            &form(&[("current", "correct horse"), ("new", "battery staple")]),
        )
        .await;
    assert_eq!(changed.status, StatusCode::OK, "{}", changed.text);
    assert_ne!(
        a.cookies[SESSION], before,
        "a fresh session for this browser"
    );
    assert!(a.signed_in().await);
    assert!(!b.signed_in().await, "the other session was revoked");
    assert_eq!(
        b.signin("alice", "correct horse").await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        b.signin("alice", "battery staple").await.status,
        StatusCode::NO_CONTENT
    );
    // `X-Forwarded-Proto` from a client that is not a trusted proxy is not believed: no Secure
    // cookie, no `__Host-` name (a trusted proxy's is: `tests/security.rs`).
    b.get("/signin").await;
    let tls = b
        .call(
            reqwest::Method::POST,
            "/signin",
            Some(&form(&[("name", "alice"), ("password", "battery staple")])),
            &[("X-Forwarded-Proto", "https")],
        )
        .await;
    assert_eq!(tls.status, StatusCode::NO_CONTENT);
    let set = tls.set_cookies().join("\n");
    assert!(
        !set.contains("Secure") && set.contains("smolchat_session="),
        "{set}"
    );
    assert!(!set.contains("__Host-"), "{set}");

    // A restart (no cookie_secret configured, database on disk) keeps everyone signed in.
    drop(server);
    let server = Server::start(dir.path(), &[]).await;
    a.base = server.base.clone();
    assert!(a.signed_in().await);
    assert_eq!(a.conversation_ids().await, vec![guest_conv]);
}

#[tokio::test]
async fn wrong_passwords_are_throttled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_AUTH__LOGIN_FREE_FAILURES_PER_ADDRESS", "3"),
            ("SMOLCHAT_AUTH__LOGIN_LOCKOUT_BASE_S", "4"),
            ("SMOLCHAT_AUTH__LOGIN_LOCKOUT_MAX_S", "60"),
        ],
    )
    .await;
    let mut owner = Browser::at(&server, 1, "/").await;
    assert_eq!(
        owner.signup("carol", "the password").await.status,
        StatusCode::NO_CONTENT
    );
    let mut guesser = Browser::at(&server, 2, "/signin").await;
    for wrong in ["guess one", "guess two", "guess three"] {
        assert_eq!(
            guesser.signin("carol", wrong).await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    // Locked: even the right password is refused, with a clear message and Retry-After.
    let locked = guesser.signin("carol", "the password").await;
    assert_eq!(
        locked.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        locked.text
    );
    let wait = locked.retry_after().expect("Retry-After");
    assert!((1..=4).contains(&wait), "Retry-After {wait}");
    assert!(
        locked.text.contains("too many wrong passwords"),
        "{}",
        locked.text
    );
    assert!(!guesser.cookies.contains_key(SESSION));
    // Unknown names count too (the address is what is locked).
    assert_eq!(
        guesser.signin("nobody", "x").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another address is not locked.
    let mut elsewhere = Browser::at(&server, 3, "/signin").await;
    assert_eq!(
        elsewhere.signin("carol", "the password").await.status,
        StatusCode::NO_CONTENT
    );
    tokio::time::sleep(Duration::from_millis(wait * 1000 + 300)).await;
    assert_eq!(
        guesser.signin("carol", "the password").await.status,
        StatusCode::NO_CONTENT
    );
}

/// The cells of the users-table row of `name` on the admin page.
fn user_row(page: &str, name: &str) -> Option<(String, Vec<String>)> {
    let start = page.find(&format!("<tr data-user=\"{name}\""))?;
    let row = &page[start..start + page[start..].find("</tr>")?];
    let id = row
        .split("/admin/users/")
        .nth(1)?
        .split('/')
        .next()?
        .to_string();
    let cells = row
        .split("<td")
        .skip(1)
        .map(|c| {
            let inner = &c[c.find('>')? + 1..];
            Some(inner[..inner.find("</td>")?].trim().to_string())
        })
        .collect::<Option<Vec<_>>>()?;
    Some((id, cells))
}

async fn v1(server: &Server, key: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .bearer_auth(key)
        .json(&json!({
            "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 3,
            "temperature": 0,
        }))
        .send()
        .await
        .expect("request")
}

#[tokio::test]
async fn keys_roles_and_disabled_users() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_AUTH__INITIAL_ADMIN", "root"),
            ("SMOLCHAT_AUTH__INITIAL_ADMIN_PASSWORD", "root password"),
            ("SMOLCHAT_SERVER__API_KEY", "the-global-api-key"),
        ],
    )
    .await;

    // A user with a personal API key.
    let mut bob = Browser::at(&server, 1, "/").await;
    assert_eq!(
        bob.signup("bob", "bob's password").await.status,
        StatusCode::NO_CONTENT
    );
    let bob_conv = bob.create_conversation().await;
    let made = bob
        .post_form("/account/keys", &form(&[("name", "laptop")]))
        .await;
    assert_eq!(made.status, StatusCode::OK, "{}", made.text);
    let key = made
        .text
        .split("id=\"new-key-value\">")
        .nth(1)
        .and_then(|r| r.split('<').next())
        .expect("the new key is shown")
        .to_string();
    assert!(key.starts_with("sk-smol-"), "{key}");
    let listed = bob.get("/account").await;
    assert!(listed.text.contains("laptop"));
    assert!(listed.text.contains("never"), "not used yet");
    assert!(
        !listed.text.contains(&key),
        "shown once, then only its prefix"
    );

    // The key works on /v1 next to the global key; a made-up one is refused.
    let r = v1(&server, &key).await;
    assert_eq!(r.status(), StatusCode::OK);
    let usage: Value = r.json().await.expect("json");
    let used = usage["usage"]["total_tokens"].as_i64().expect("usage");
    assert!(used > 0);
    assert_eq!(
        v1(&server, "the-global-api-key").await.status(),
        StatusCode::OK
    );
    let keys = bob.get("/account").await.text;
    let row = keys.split("laptop").nth(1).expect("the key's row");
    let row = &row[..row.find("</tr>").expect("row end")];
    assert!(!row.contains("never"), "last used is recorded: {row}");
    let fake = format!("sk-smol-{}", "0".repeat(64));
    assert_eq!(v1(&server, &fake).await.status(), StatusCode::UNAUTHORIZED);
    // `ignore_eos` is for admins: a user's personal key is refused it, the global key is not.
    for (bearer, want) in [
        (key.as_str(), StatusCode::FORBIDDEN),
        ("the-global-api-key", StatusCode::OK),
    ] {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", server.base))
            .bearer_auth(bearer)
            .json(&json!({
                "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 2,
                "ignore_eos": true,
            }))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), want, "ignore_eos with {bearer}");
    }

    // Non-admins get nothing from the admin routes (no admin token is configured: 404).
    for path in ["/admin", "/admin/live"] {
        let a = bob.get(path).await;
        assert!(
            [
                StatusCode::NOT_FOUND,
                StatusCode::UNAUTHORIZED,
                StatusCode::FORBIDDEN
            ]
            .contains(&a.status),
            "{path}: {}",
            a.status
        );
        assert!(!a.text.contains("data-user=") && !a.text.contains(&bob_conv));
    }

    // The configured admin signs in and sees the users table, with bob's usage attributed.
    let mut root = Browser::at(&server, 2, "/").await;
    assert_eq!(
        root.signin("root", "root password").await.status,
        StatusCode::NO_CONTENT
    );
    let (bob_id, cells) = eventually(Duration::from_secs(10), || {
        let base = root.base.clone();
        let cookies = root.cookies.clone();
        async move {
            let mut r = Browser {
                http: reqwest::Client::new(),
                base,
                cookies,
                csrf: None,
            };
            let page = r.get("/admin").await;
            assert_eq!(page.status, StatusCode::OK, "{}", page.text);
            let (id, cells) = user_row(&page.text, "bob")?;
            // Name, role, conversations, tokens, last seen, sessions.
            (cells[3].parse::<i64>().ok()? >= used).then_some((id, cells))
        }
    })
    .await
    .expect("bob's tokens on the admin page");
    assert_eq!(cells[1], "user");
    assert_eq!(cells[2], "1", "one conversation");
    assert_eq!(cells[5], "1", "one live session");
    let admin_page = root.get("/admin").await.text;
    let (root_id, _) = user_row(&admin_page, "root").expect("root's row");
    // The limits in force are on the page.
    assert!(
        admin_page.contains("id=\"limits\"")
            && admin_page.contains("limits.tokens_per_minute_per_user"),
        "limits table"
    );
    let own = root
        .post_form(&format!("/admin/users/{root_id}/disable"), "")
        .await;
    assert_eq!(
        own.status,
        StatusCode::BAD_REQUEST,
        "no locking oneself out"
    );
    // Conversations show their owner's name.
    let live = root.get("/admin/live").await;
    assert!(live.text.contains("<code>bob</code>"), "{}", live.text);
    // bob cannot act as an admin.
    let denied = bob
        .post_form(&format!("/admin/users/{bob_id}/disable"), "")
        .await;
    assert!(denied.status.is_client_error(), "{}", denied.status);
    assert!(bob.signed_in().await);

    // Disabling stops bob's session and key at once; enabling brings the key back, not the
    // revoked session.
    let off = root
        .post_form(&format!("/admin/users/{bob_id}/disable"), "")
        .await;
    assert_eq!(off.status, StatusCode::NO_CONTENT, "{}", off.text);
    assert!(!bob.signed_in().await);
    let refused = v1(&server, &key).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert!(refused.text().await.unwrap().contains("disabled"));
    // The right password of a disabled account gets the answer a wrong one gets: the page
    // must not confirm a password (it does say that a disabled account reads the same).
    let blocked = bob.signin("bob", "bob's password").await;
    assert_eq!(blocked.status, StatusCode::UNAUTHORIZED, "{}", blocked.text);
    let wrong = bob.signin("bob", "not bob's password").await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert_eq!(blocked.text, wrong.text, "the same answer either way");
    assert_eq!(
        root.post_form(&format!("/admin/users/{bob_id}/enable"), "")
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert!(!bob.signed_in().await);
    assert_eq!(v1(&server, &key).await.status(), StatusCode::OK);

    // Admin "revoke sessions" ends bob's new session.
    assert_eq!(
        bob.signin("bob", "bob's password").await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        root.post_form(&format!("/admin/users/{bob_id}/revoke"), "")
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert!(!bob.signed_in().await);

    // A revoked key is refused.
    assert_eq!(
        bob.signin("bob", "bob's password").await.status,
        StatusCode::NO_CONTENT
    );
    let page = bob.get("/account").await;
    let key_id = page
        .text
        .split("/account/keys/")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .expect("a revoke button")
        .to_string();
    let revoked = bob
        .post_form(&format!("/account/keys/{key_id}/revoke"), "")
        .await;
    assert_eq!(revoked.status, StatusCode::OK);
    assert!(revoked.text.contains("revoked"));
    assert_eq!(v1(&server, &key).await.status(), StatusCode::UNAUTHORIZED);
    // Revoking it again, or a key id that is not bob's, is 404.
    assert_eq!(
        bob.post_form(&format!("/account/keys/{key_id}/revoke"), "")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        bob.post_form(&format!("/account/keys/{}/revoke", "f".repeat(64)), "")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

fn smolchat(args: &[&str], url: &str, stdin: Option<&str>) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_smolchat"));
    cmd.current_dir(common::crate_root())
        .args(args)
        .arg("--database-url")
        .arg(url)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, _) in std::env::vars() {
        if key.starts_with("SMOLCHAT_") {
            cmd.env_remove(key);
        }
    }
    let mut child = cmd.spawn().expect("spawn smolchat");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write stdin");
    }
    let out = child.wait_with_output().expect("smolchat output");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn invite_and_closed_signup_and_the_cli() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_AUTH__SIGNUP", "invite")]).await;
    let url = server.database_url.clone();

    let mut a = Browser::at(&server, 1, "/signup").await;
    let no_code = a.signup("dana", "dana's password").await;
    assert_eq!(no_code.status, StatusCode::BAD_REQUEST);
    assert!(no_code.text.contains("invite"), "{}", no_code.text);
    let (ok, out, err) = smolchat(&["invite", "--expires-h", "1"], &url, None);
    assert!(ok, "{err}");
    let code = out.lines().next().expect("a code").to_string();
    assert!(out.contains(&format!("/signup?invite={code}")));
    let page = a.get(&format!("/signup?invite={code}")).await;
    assert!(page.text.contains(&code), "the form is prefilled");
    assert_eq!(
        a.signup_invited("dana", "dana's password", &code)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    let mut b = Browser::at(&server, 2, "/signup").await;
    assert_eq!(
        b.signup_invited("erin", "erin's password", &code)
            .await
            .status,
        StatusCode::BAD_REQUEST,
        "single use"
    );

    // The CLI: add (password on stdin), list, passwd (revokes sessions), disable.
    let (ok, _, err) = smolchat(
        &["user", "add", "frank", "--password-stdin"],
        &url,
        Some("short\n"),
    );
    assert!(!ok && err.contains("at least 8"), "{err}");
    let (ok, _, err) = smolchat(&["user", "add", "frank"], &url, None);
    assert!(!ok && err.contains("--password-stdin"), "no tty: {err}");
    let (ok, out, err) = smolchat(
        &["user", "add", "frank", "--admin", "--password-stdin"],
        &url,
        Some("frank's password\n"),
    );
    assert!(ok, "{err}");
    assert!(out.contains("frank (admin)"), "{out}");
    let (ok, out, _) = smolchat(&["user", "list"], &url, None);
    assert!(ok);
    let frank = out
        .lines()
        .find(|l| l.starts_with("frank "))
        .expect("frank listed");
    assert!(frank.contains("admin") && frank.contains(" no "), "{frank}");
    assert!(out.lines().any(|l| l.starts_with("dana ")), "{out}");

    let mut f = Browser::at(&server, 3, "/signin").await;
    assert_eq!(
        f.signin("frank", "frank's password").await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(f.get("/admin").await.status, StatusCode::OK, "admin role");
    let (ok, _, err) = smolchat(
        &["user", "passwd", "frank", "--password-stdin"],
        &url,
        Some("frank's new password\n"),
    );
    assert!(ok, "{err}");
    assert!(!f.signed_in().await, "passwd revokes the sessions");
    assert_eq!(
        f.signin("frank", "frank's new password").await.status,
        StatusCode::NO_CONTENT
    );
    let (ok, _, err) = smolchat(&["user", "disable", "frank"], &url, None);
    assert!(ok, "{err}");
    assert!(!f.signed_in().await);
    let (ok, out, _) = smolchat(&["user", "list"], &url, None);
    assert!(ok);
    assert!(out
        .lines()
        .any(|l| l.starts_with("frank ") && l.contains(" yes ")));
    let (ok, _, err) = smolchat(
        &["user", "passwd", "nobody", "--password-stdin"],
        &url,
        Some("whatever long\n"),
    );
    assert!(!ok && err.contains("nobody"), "{err}");

    // `passwd --reset`: a random password, printed once; until frank chooses his own, only
    // the account page opens to him.
    let (ok, _, err) = smolchat(&["user", "enable", "frank"], &url, None);
    assert!(ok, "{err}");
    let (ok, out, err) = smolchat(&["user", "passwd", "frank", "--reset"], &url, None);
    assert!(ok, "{err}");
    let temporary = out.lines().next().unwrap_or_default().to_string();
    assert_eq!(temporary.len(), 16, "{out}");
    assert_eq!(
        f.signin("frank", &temporary).await.status,
        StatusCode::NO_CONTENT
    );
    let api = f.get("/api/conversations").await;
    assert_eq!(api.status, StatusCode::FORBIDDEN, "{}", api.text);
    assert!(
        api.text.contains("choose a new one at /account"),
        "{}",
        api.text
    );
    let home = f.get("/").await;
    assert_eq!(home.status, StatusCode::SEE_OTHER);
    assert_eq!(home.headers["location"], "/account");
    let admin_page = f.get("/admin").await;
    assert_eq!(
        admin_page.status,
        StatusCode::SEE_OTHER,
        "not even the admin page"
    );
    assert_eq!(f.get("/account").await.status, StatusCode::OK);
    // Each CLI action is in the audit log, by the CLI.
    let store = smolchat_store::Store::open(&url).await.expect("store");
    let log = store
        .audit_page(&smolchat_store::AuditFilter::default(), 200)
        .await
        .expect("audit");
    for action in [
        "admin.create_invite",
        "admin.create_user",
        "auth.password_changed",
        "admin.disable_user",
        "admin.enable_user",
        "admin.reset_password",
    ] {
        assert!(
            log.iter()
                .any(|e| e.action == action && e.actor.starts_with("cli:")),
            "{action}: {log:#?}"
        );
    }
    store.close().await;

    // Closed: no sign-up at all, but accounts made by the CLI still sign in.
    drop(server);
    let server = Server::start(dir.path(), &[("SMOLCHAT_AUTH__SIGNUP", "closed")]).await;
    let mut c = Browser::at(&server, 4, "/signup").await;
    let closed = c.signup("gina", "gina's password").await;
    assert_eq!(closed.status, StatusCode::FORBIDDEN);
    assert!(closed.text.contains("closed"), "{}", closed.text);
    assert!(c.get("/signup").await.text.contains("Sign-up is closed"));
    assert_eq!(
        c.signin("dana", "dana's password").await.status,
        StatusCode::NO_CONTENT
    );
}

#[tokio::test]
async fn without_guests_pages_redirect_and_the_api_refuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_AUTH__GUESTS", "false")]).await;
    let mut a = Browser::at(&server, 1, "/signin").await;
    for path in [
        "/",
        "/conversations",
        "/c/0190a0f0-0000-7000-8000-000000000000",
    ] {
        let r = a.get(path).await;
        assert_eq!(r.status, StatusCode::SEE_OTHER, "{path}");
        assert_eq!(r.headers["location"], "/signin");
    }
    // HTMX requests are told where to go instead of following a redirect inside the XHR.
    let htmx = a
        .call(
            reqwest::Method::POST,
            "/c/0190a0f0-0000-7000-8000-000000000000/stop",
            None,
            &[("HX-Request", "true")],
        )
        .await;
    assert_eq!(htmx.status, StatusCode::UNAUTHORIZED);
    assert_eq!(htmx.headers["hx-redirect"], "/signin");
    let api = a.get("/api/conversations").await;
    assert_eq!(api.status, StatusCode::UNAUTHORIZED);
    let body: Value = serde_json::from_str(&api.text).expect("JSON error");
    assert!(body["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("sign in")));
    let create = a
        .call(reqwest::Method::POST, "/api/conversations", None, &[])
        .await;
    assert_eq!(create.status, StatusCode::UNAUTHORIZED);
    // Sign-up works, and then everything does.
    assert_eq!(a.get("/signup").await.status, StatusCode::OK);
    assert_eq!(
        a.signup("hank", "hank's password").await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(a.get("/").await.status, StatusCode::OK);
    a.create_conversation().await;
    assert_eq!(a.conversation_ids().await.len(), 1);
}

/// Two accounts (not two guest cookies, which `tests/service.rs` covers route by route): one
/// account's conversation is invisible and untouchable to the other through the JSON API, the
/// pages and exports, and the owner's conversation is unchanged afterwards.
#[tokio::test]
async fn accounts_are_isolated_from_each_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[]).await;
    let mut ann = Browser::at(&server, 1, "/").await;
    assert_eq!(
        ann.signup("ann", "ann's password").await.status,
        StatusCode::NO_CONTENT
    );
    let conv = ann.create_conversation().await;
    let before = ann.get(&format!("/api/conversations/{conv}")).await;
    assert_eq!(before.status, StatusCode::OK, "{}", before.text);

    let mut bob = Browser::at(&server, 2, "/").await;
    assert_eq!(
        bob.signup("bob", "bob's password").await.status,
        StatusCode::NO_CONTENT
    );
    assert!(!bob.conversation_ids().await.contains(&conv));
    use reqwest::Method;
    let tries: [(Method, String, Option<&str>); 9] = [
        (Method::GET, format!("/api/conversations/{conv}"), None),
        (
            Method::GET,
            format!("/api/conversations/{conv}/events"),
            None,
        ),
        (
            Method::GET,
            format!("/api/conversations/{conv}/export?format=json"),
            None,
        ),
        (
            Method::POST,
            format!("/api/conversations/{conv}/stop"),
            None,
        ),
        (
            Method::POST,
            format!("/api/conversations/{conv}/regenerate"),
            None,
        ),
        (Method::DELETE, format!("/api/conversations/{conv}"), None),
        (Method::GET, format!("/c/{conv}"), None),
        (Method::GET, format!("/c/{conv}/export.md"), None),
        (
            Method::POST,
            format!("/c/{conv}/rename"),
            Some("title=mine"),
        ),
    ];
    for (method, path, body) in tries {
        let r = bob.call(method.clone(), &path, body, &[]).await;
        assert_eq!(
            r.status,
            StatusCode::NOT_FOUND,
            "{method} {path}: {}",
            r.text
        );
    }
    let after = ann.get(&format!("/api/conversations/{conv}")).await;
    assert_eq!(after.status, StatusCode::OK);
    assert_eq!(after.text, before.text, "ann's conversation is unchanged");
}

/// An administrator's password reset is what one does to an account someone else may hold: its
/// personal API keys stop working with it, and the admin page says so.
#[tokio::test]
async fn a_password_reset_revokes_the_accounts_api_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_AUTH__INITIAL_ADMIN", "root"),
            ("SMOLCHAT_AUTH__INITIAL_ADMIN_PASSWORD", "root password"),
        ],
    )
    .await;
    let mut bob = Browser::at(&server, 1, "/").await;
    assert_eq!(
        bob.signup("bob", "bob's password").await.status,
        StatusCode::NO_CONTENT
    );
    let made = bob
        .post_form("/account/keys", &form(&[("name", "laptop")]))
        .await;
    let key = made
        .text
        .split("id=\"new-key-value\">")
        .nth(1)
        .and_then(|r| r.split('<').next())
        .expect("the new key is shown")
        .to_string();
    assert_eq!(v1(&server, &key).await.status(), StatusCode::OK);
    let mut root = Browser::at(&server, 2, "/").await;
    assert_eq!(
        root.signin("root", "root password").await.status,
        StatusCode::NO_CONTENT
    );
    let page = root.get("/admin").await.text;
    let (bob_id, _) = user_row(&page, "bob").expect("bob's row");
    let reset = root
        .post_form(&format!("/admin/users/{bob_id}/reset-password"), "")
        .await;
    assert_eq!(reset.status, StatusCode::OK, "{}", reset.text);
    assert!(
        reset.text.contains("Their 1 API key was revoked."),
        "{}",
        reset.text
    );
    assert_eq!(
        v1(&server, &key).await.status(),
        StatusCode::UNAUTHORIZED,
        "the key outlived the reset"
    );
}
