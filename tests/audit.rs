//! The audit log against a real `smolchat serve`: an account's sign-up, a failed and a good
//! sign-in, a password change, a key made and revoked, a conversation exported and deleted, and
//! an admin (token session) deleting another conversation — each is one entry with its actor,
//! action, target and client address; the admin page filters it and exports it as CSV and JSON;
//! nobody else reads it.

mod common;

use common::browser_client::Browser;
use common::server::{form_encode, Server};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const ADMIN_TOKEN: &str = "audit-test-admin-token";

fn form(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| format!("{k}={}", form_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

async fn new_conversation(b: &mut Browser) -> String {
    let made = b
        .json(
            Method::POST,
            "/api/conversations",
            Some(&json!({"title": "t"})),
        )
        .await;
    assert_eq!(made.status, StatusCode::CREATED, "{}", made.text);
    let v: Value = serde_json::from_str(&made.text).expect("json");
    v["id"].as_str().expect("id").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_are_recorded_with_actor_target_and_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN)]).await;

    // Carol, from 127.0.0.2.
    let mut carol = Browser::at(&server, 2, "/signup").await;
    let up = carol
        .post_form(
            "/signup",
            &form(&[("name", "carol"), ("password", "carol's password")]),
        )
        .await;
    assert_eq!(up.status, StatusCode::NO_CONTENT, "{}", up.text);
    // A new session has a new CSRF token: the page gives it.
    carol.get("/").await;
    assert_eq!(
        carol.post_form("/signout", "").await.status,
        StatusCode::NO_CONTENT
    );
    carol.get("/signin").await;
    let wrong = carol
        .post_form(
            "/signin",
            &form(&[("name", "carol"), ("password", "not it at all")]),
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{}", wrong.text);
    let good = carol
        .post_form(
            "/signin",
            &form(&[("name", "carol"), ("password", "carol's password")]),
        )
        .await;
    assert_eq!(good.status, StatusCode::NO_CONTENT, "{}", good.text);
    carol.get("/").await;
    let changed = carol
        .post_form(
            "/account/password",
            &form(&[
                ("current", "carol's password"),
                ("new", "carol's new password"),
            ]),
        )
        .await;
    assert_eq!(changed.status, StatusCode::OK, "{}", changed.text);
    carol.get("/").await;
    let key = carol
        .post_form("/account/keys", &form(&[("name", "laptop")]))
        .await;
    assert_eq!(key.status, StatusCode::OK, "{}", key.text);
    let key_id = carol
        .get("/account")
        .await
        .text
        .split("/account/keys/")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .expect("a revoke button")
        .to_string();
    let revoked = carol
        .post_form(&format!("/account/keys/{key_id}/revoke"), "")
        .await;
    assert_eq!(revoked.status, StatusCode::OK);
    let exported = new_conversation(&mut carol).await;
    let r = carol
        .json(
            Method::GET,
            &format!("/api/conversations/{exported}/export"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = carol
        .json(
            Method::DELETE,
            &format!("/api/conversations/{exported}"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let doomed = new_conversation(&mut carol).await;

    // Carol cannot read the log.
    assert_ne!(carol.get("/admin/audit").await.status, StatusCode::OK);
    assert_ne!(carol.get("/admin/audit.json").await.status, StatusCode::OK);

    // The admin, from 127.0.0.3 with the admin token, deletes one of carol's conversations.
    let mut admin = Browser::admin(&server, 3, ADMIN_TOKEN).await;
    let deleted = admin
        .call(Method::DELETE, &format!("/admin/c/{doomed}"), None, &[])
        .await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT, "{}", deleted.text);

    // Roles, and deleting carol with everything she owns (confirmed by her name).
    let page = admin.get("/admin").await.text;
    let row = page
        .split("data-user=\"carol\"")
        .nth(1)
        .expect("carol's row");
    let carol_id = row
        .split("/admin/users/")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .expect("carol's id")
        .to_string();
    for action in ["make-admin", "make-user"] {
        let r = admin
            .call(
                Method::POST,
                &format!("/admin/users/{carol_id}/{action}"),
                None,
                &[],
            )
            .await;
        assert_eq!(r.status, StatusCode::NO_CONTENT, "{action}: {}", r.text);
    }
    let wrong = admin
        .call(
            Method::POST,
            &format!("/admin/users/{carol_id}/delete"),
            None,
            &[("HX-Prompt", "caro")],
        )
        .await;
    assert_eq!(wrong.status, StatusCode::BAD_REQUEST, "{}", wrong.text);
    assert!(
        wrong.text.contains("confirm with their name"),
        "{}",
        wrong.text
    );
    let kept = new_conversation(&mut carol).await;
    let gone = admin
        .call(
            Method::POST,
            &format!("/admin/users/{carol_id}/delete"),
            None,
            &[("HX-Prompt", "carol")],
        )
        .await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT, "{}", gone.text);
    // Her session is over, her conversation and her account are gone.
    let r = carol
        .json(Method::GET, &format!("/api/conversations/{kept}"), None)
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(!admin
        .get("/admin")
        .await
        .text
        .contains("data-user=\"carol\""));
    carol.get("/signin").await;
    let again = carol
        .post_form(
            "/signin",
            &form(&[("name", "carol"), ("password", "carol's new password")]),
        )
        .await;
    assert_eq!(again.status, StatusCode::UNAUTHORIZED, "{}", again.text);

    let log = admin.get("/admin/audit.json").await;
    assert_eq!(log.status, StatusCode::OK, "{}", log.text);
    let log: Value = serde_json::from_str(&log.text).expect("json");
    let entries = log["entries"].as_array().cloned().unwrap_or_default();
    let has = |actor: &str, action: &str, target: &str, address: &str| {
        entries.iter().any(|e| {
            e["actor"] == actor
                && e["action"] == action
                && e["target"].as_str().is_some_and(|t| t.starts_with(target))
                && e["address"] == address
        })
    };
    let c2 = "127.0.0.2";
    for (actor, action, target, address) in [
        ("user:carol", "auth.sign_up", "user:carol", c2),
        ("user:carol", "auth.sign_out", "user:carol", c2),
        ("anonymous", "auth.sign_in_failed", "user:carol", c2),
        ("user:carol", "auth.sign_in", "user:carol", c2),
        ("user:carol", "auth.password_changed", "user:carol", c2),
        ("user:carol", "auth.key_created", "key:", c2),
        (
            "user:carol",
            "auth.key_revoked",
            &format!("key:{key_id}"),
            c2,
        ),
        (
            "user:carol",
            "conversation.export",
            &format!("conversation:{exported}"),
            c2,
        ),
        (
            "user:carol",
            "conversation.delete",
            &format!("conversation:{exported}"),
            c2,
        ),
        (
            "admin",
            "admin.delete_conversation",
            &format!("conversation:{doomed}"),
            "127.0.0.3",
        ),
        ("admin", "admin.role_changed", "user:carol", "127.0.0.3"),
        ("admin", "admin.delete_user", "user:carol", "127.0.0.3"),
    ] {
        assert!(
            has(actor, action, target, address),
            "no {action} by {actor} on {target} from {address}:\n{}",
            serde_json::to_string_pretty(&entries).unwrap_or_default()
        );
    }
    // Newest first, the failed sign-in says why and never holds the password.
    assert_eq!(
        entries[0]["action"], "auth.sign_in_failed",
        "the last attempt, newest first"
    );
    let deleted = entries
        .iter()
        .find(|e| e["action"] == "admin.delete_user")
        .expect("the deletion");
    assert_eq!(
        deleted["detail"], "1 conversations, 1 API keys, 3 sessions",
        "{deleted}"
    );
    assert!(!entries
        .iter()
        .any(|e| e.to_string().contains("not it at all")));
    let failed = entries
        .iter()
        .find(|e| e["action"] == "auth.sign_in_failed")
        .expect("the failure");
    assert_eq!(failed["detail"], "wrong");

    // Filters, the page and the CSV.
    let only = admin.get("/admin/audit.json?action=auth.sign_in").await;
    let only: Value = serde_json::from_str(&only.text).expect("json");
    let actions: Vec<&str> = only["entries"]
        .as_array()
        .map(|a| a.iter().filter_map(|e| e["action"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(actions, vec!["auth.sign_in"], "{only}");
    let by_text = admin.get(&format!("/admin/audit.json?q={doomed}")).await;
    assert!(by_text.text.contains("admin.delete_conversation"));
    assert!(!by_text.text.contains("auth.sign_up"), "{}", by_text.text);
    let page = admin.get("/admin/audit?actor=user%3Acarol").await;
    assert_eq!(page.status, StatusCode::OK);
    // (Every action is also an option of the filter's menu: rows show theirs in <code>.)
    assert!(
        page.text.contains("<code>auth.key_revoked</code>"),
        "{}",
        page.text
    );
    assert!(!page.text.contains("<code>admin.delete_conversation</code>"));
    let csv = admin.get("/admin/audit.csv").await;
    assert_eq!(csv.status, StatusCode::OK);
    assert!(csv.headers["content-type"]
        .to_str()
        .unwrap_or("")
        .starts_with("text/csv"));
    assert!(csv
        .text
        .starts_with("time,actor,action,target,address,detail\r\n"));
    assert!(
        csv.text.contains("\"admin\",\"admin.delete_conversation\""),
        "{}",
        csv.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_creates_users_and_invite_links_in_the_page() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
            ("SMOLCHAT_AUTH__SIGNUP", "invite"),
        ],
    )
    .await;
    let mut admin = Browser::admin(&server, 3, ADMIN_TOKEN).await;

    // A user made by the admin signs in; a weak password is refused, saying why.
    let weak = admin
        .post_form(
            "/admin/users",
            &form(&[("name", "erin"), ("password", "short")]),
        )
        .await;
    assert_eq!(weak.status, StatusCode::BAD_REQUEST, "{}", weak.text);
    assert!(weak.text.contains("password"), "{}", weak.text);
    let made = admin
        .post_form(
            "/admin/users",
            &form(&[
                ("name", "erin"),
                ("password", "erin's password"),
                ("admin", "on"),
            ]),
        )
        .await;
    assert_eq!(made.status, StatusCode::NO_CONTENT, "{}", made.text);
    let page = admin.get("/admin").await.text;
    assert!(page.contains("data-user=\"erin\""), "listed");
    let mut erin = Browser::at(&server, 4, "/signin").await;
    let signed = erin
        .post_form(
            "/signin",
            &form(&[("name", "erin"), ("password", "erin's password")]),
        )
        .await;
    assert_eq!(signed.status, StatusCode::NO_CONTENT, "{}", signed.text);
    assert_eq!(
        erin.get("/admin").await.status,
        StatusCode::OK,
        "made an admin"
    );

    // An invite link, shown once; the invited person signs up through it, once.
    let invite = admin.post_form("/admin/invites", "days=7").await;
    assert_eq!(invite.status, StatusCode::OK, "{}", invite.text);
    let link = invite
        .text
        .split("value=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .expect("the link")
        .replace("&#x3d;", "=")
        .replace("&#61;", "=");
    assert!(link.contains("/signup?invite="), "{link}");
    let code = link.split("invite=").nth(1).expect("code").to_string();
    let mut fred = Browser::at(&server, 5, &format!("/signup?invite={code}")).await;
    let up = fred
        .post_form(
            "/signup",
            &form(&[
                ("name", "fred"),
                ("password", "fred's password"),
                ("invite", &code),
            ]),
        )
        .await;
    assert_eq!(up.status, StatusCode::NO_CONTENT, "{}", up.text);
    let mut gina = Browser::at(&server, 6, "/signup").await;
    let again = gina
        .post_form(
            "/signup",
            &form(&[
                ("name", "gina"),
                ("password", "gina's password"),
                ("invite", &code),
            ]),
        )
        .await;
    assert_eq!(
        again.status,
        StatusCode::BAD_REQUEST,
        "single use: {}",
        again.text
    );

    let log = admin.get("/admin/audit.json").await;
    let log: Value = serde_json::from_str(&log.text).expect("json");
    let entries = log["entries"].as_array().cloned().unwrap_or_default();
    for (actor, action, target) in [
        ("admin", "admin.create_user", "user:erin"),
        ("admin", "admin.create_invite", ""),
        ("user:fred", "auth.sign_up", "user:fred"),
    ] {
        assert!(
            entries
                .iter()
                .any(|e| e["actor"] == actor && e["action"] == action && e["target"] == target),
            "{actor} {action} {target}: {entries:?}"
        );
    }
}

/// What an anonymous client sends cannot grow the audit log by more than a short row per
/// request it is allowed: a 204,800-character name is cut to an account name's length, and once
/// the address is throttled, one row a minute says so instead of one per request. Admin-token
/// sign-ins, wrong and right, are recorded too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sign_ins_are_bounded_in_the_log_and_admin_token_sign_ins_recorded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN)]).await;
    let huge = "n".repeat(204_800);
    let mut mallory = Browser::at(&server, 7, "/signin").await;
    let mut statuses = Vec::new();
    for _ in 0..30 {
        let r = mallory
            .post_form("/signin", &form(&[("name", &huge), ("password", "guess")]))
            .await;
        statuses.push(r.status);
    }
    assert!(
        statuses.contains(&StatusCode::TOO_MANY_REQUESTS),
        "the address was throttled: {statuses:?}"
    );
    let wrong = statuses
        .iter()
        .filter(|s| **s == StatusCode::UNAUTHORIZED)
        .count();
    // Admin token: a wrong one, then the right one.
    let mut admin = Browser::at(&server, 8, "/admin").await;
    let bad = admin
        .call(
            Method::POST,
            "/admin/login",
            Some("token=not-the-token"),
            &[],
        )
        .await;
    assert_eq!(bad.status, StatusCode::UNAUTHORIZED, "{}", bad.text);
    let mut admin = Browser::admin(&server, 8, ADMIN_TOKEN).await;

    let csv = admin.get("/admin/audit.json").await;
    assert_eq!(csv.status, StatusCode::OK, "{}", csv.text);
    let entries: Value = serde_json::from_str(&csv.text).expect("json");
    let entries = entries["entries"].as_array().expect("entries").clone();
    let failed: Vec<&Value> = entries
        .iter()
        .filter(|e| e["action"] == "auth.sign_in_failed")
        .collect();
    let throttled = failed
        .iter()
        .filter(|e| e["detail"].as_str().unwrap_or("").starts_with("throttled"))
        .count();
    assert_eq!(throttled, 1, "one throttled row a minute: {failed:#?}");
    assert_eq!(failed.len(), wrong + 1, "{failed:#?}");
    for e in &entries {
        for field in ["actor", "action", "target", "address", "detail"] {
            let n = e[field].as_str().unwrap_or("").chars().count();
            assert!(n <= 300, "{field} of {n} characters: {e}");
        }
    }
    let target = failed[0]["target"].as_str().unwrap_or("");
    assert!(
        target.starts_with("user:nnnn") && target.ends_with('…') && target.chars().count() <= 80,
        "{target}"
    );
    let admin_rows: Vec<(&str, &str)> = entries
        .iter()
        .filter(|e| {
            e["action"]
                .as_str()
                .unwrap_or("")
                .starts_with("auth.admin_sign_in")
        })
        .map(|e| {
            (
                e["action"].as_str().unwrap_or(""),
                e["address"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert!(
        admin_rows.contains(&("auth.admin_sign_in_failed", "127.0.0.8"))
            && admin_rows.contains(&("auth.admin_sign_in", "127.0.0.8")),
        "{admin_rows:?}"
    );
}
