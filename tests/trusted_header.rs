//! Trusted-header sign-in behind nginx acting as the authenticating proxy (the role oauth2-proxy,
//! Authelia or authentik play): the proxy sets `X-Remote-User` (and `X-Remote-Groups`), and the
//! server, which lists the proxy in `server.trusted_proxies`, signs that user in — making the
//! account on first sight, admin while the groups say so. The same header sent straight to the
//! server from another address is ignored.

mod common;

use common::server::Server;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn get(url: &str, headers: &[(&str, &str)]) -> (StatusCode, String) {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let mut req = client.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = req.send().await.expect("request");
    let status = res.status();
    (status, res.text().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_user_header_signs_in_and_nobody_elses_does() {
    if common::nginx::missing() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__TRUSTED_PROXIES", "[\"127.0.0.1\"]"),
            ("SMOLCHAT_AUTH__TRUSTED_USER_HEADER", "X-Remote-User"),
            ("SMOLCHAT_AUTH__TRUSTED_GROUPS_HEADER", "X-Remote-Groups"),
            ("SMOLCHAT_AUTH__TRUSTED_ADMIN_GROUP", "chat-admins"),
        ],
    )
    .await;
    // The proxy authenticates (here: believes the test's X-Test-Login) and passes the user on;
    // whatever the client sent as X-Remote-User is replaced.
    let proxy = common::nginx::start_with(
        dir.path(),
        &[&server],
        "proxy_set_header X-Remote-User $http_x_test_login;\n\
         proxy_set_header X-Remote-Groups $http_x_test_groups;",
    )
    .await;
    let via = |path: &str| format!("{}{path}", proxy.base);
    let dana = [
        ("X-Test-Login", "dana"),
        ("X-Test-Groups", "staff, chat-admins"),
    ];

    // Through the proxy: dana is signed in (her account is made now), and an admin.
    let (status, account) = get(&via("/account"), &dana).await;
    assert_eq!(status, StatusCode::OK, "{account}");
    assert!(account.contains("dana"), "{account}");
    let (status, _) = get(&via("/admin"), &dana).await;
    assert_eq!(status, StatusCode::OK, "admin by group");
    let made = reqwest::Client::new()
        .post(via("/api/conversations"))
        .header("X-Test-Login", "dana")
        .json(&json!({"title": "Dana's plan"}))
        .send()
        .await
        .expect("create");
    assert_eq!(made.status(), StatusCode::CREATED);
    let (_, listed) = get(&via("/api/conversations"), &dana).await;
    let listed: Value = serde_json::from_str(&listed).expect("json");
    assert_eq!(listed["conversations"][0]["title"], "Dana's plan");

    // Out of the admin group: no longer an admin, on the next request.
    let (status, _) = get(
        &via("/admin"),
        &[("X-Test-Login", "dana"), ("X-Test-Groups", "staff")],
    )
    .await;
    assert_ne!(status, StatusCode::OK, "the role follows the groups");

    // Straight to the server from another address, the header is ignored: a guest, who sees
    // none of dana's conversations.
    let direct = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let res = direct
        .get(format!("{}/api/conversations", server.base))
        .header("X-Remote-User", "dana")
        .header("X-Remote-Groups", "chat-admins")
        .send()
        .await
        .expect("direct");
    let listed: Value = res.json().await.expect("json");
    assert_eq!(listed["conversations"], json!([]), "{listed}");
    let res = direct
        .get(format!("{}/account", server.base))
        .header("X-Remote-User", "dana")
        .send()
        .await
        .expect("direct account");
    let body = res.text().await.unwrap_or_default();
    assert!(!body.contains(">dana<"), "{body}");
    assert!(
        server
            .log_text()
            .contains("outside server.trusted_proxies was ignored"),
        "the attempt is logged"
    );

    // Through the proxy without a login: a guest too.
    let (_, listed) = get(&via("/api/conversations"), &[]).await;
    let listed: Value = serde_json::from_str(&listed).expect("json");
    assert_eq!(listed["conversations"], json!([]));
    // A password never signs the made account in (it has none).
    let mut b = common::browser_client::Browser::at(&server, 4, "/signin").await;
    let tried = b
        .post_form("/signin", "name=dana&password=%21external")
        .await;
    assert_eq!(tried.status, StatusCode::UNAUTHORIZED, "{}", tried.text);

    // The audit log has the account made by the header and the role changes (not every
    // request), with the address the proxy passed on.
    let store = smolchat_store::Store::open(&server.database_url)
        .await
        .expect("store");
    let log = store
        .audit_page(&smolchat_store::AuditFilter::default(), 200)
        .await
        .expect("audit");
    let details: Vec<&str> = log
        .iter()
        .filter(|e| e.action == "auth.sign_in" && e.actor == "user:dana")
        .map(|e| e.detail.as_str())
        .collect();
    assert!(
        details.contains(&"trusted header, account made")
            && details.contains(&"trusted header, role changed to user"),
        "{log:#?}"
    );
    // Seven requests carried the header; the account was made and its role changed three
    // times (the groups differ between them).
    assert_eq!(
        details.len(),
        4,
        "one line per change, not per request: {details:?}"
    );
    store.close().await;
}

/// What the proxy's header holds is an identity, linked to one account the way OpenID Connect
/// sign-ins are: e-mail addresses and other names a proxy sends (spaces, a tab, 65 characters,
/// markup) sign in to an account named after them, never to an existing account of that name
/// (a local password account is not taken over), and a disabled account is a 403 that says so.
/// None of them is a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_names_map_to_accounts_and_never_take_one_over() {
    if common::nginx::missing() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__TRUSTED_PROXIES", "[\"127.0.0.1\"]"),
            ("SMOLCHAT_AUTH__TRUSTED_USER_HEADER", "X-Remote-User"),
        ],
    )
    .await;
    let proxy = common::nginx::start_with(
        dir.path(),
        &[&server],
        "proxy_set_header X-Remote-User $http_x_test_login;",
    )
    .await;
    // A local password account, made directly (not through the proxy).
    let mut bob = common::browser_client::Browser::at(&server, 3, "/signup").await;
    let up = bob
        .post_form("/signup", "name=bob&password=bob%27s+password")
        .await;
    assert_eq!(up.status, StatusCode::NO_CONTENT, "{}", up.text);
    let account_of = |login: &'static str| {
        let url = format!("{}/account", proxy.base);
        async move {
            let (status, page) = get(&url, &[("X-Test-Login", login)]).await;
            (status, page)
        }
    };
    let long = "x".repeat(65);
    let long: &'static str = Box::leak(long.into_boxed_str());
    for (login, account) in [
        ("alice@example.com", "alice"),
        ("bob", "bob-2"),
        ("a b", "a_b"),
        ("tab\there", "tab_here"),
        ("<script>", "_script_"),
        (long, &long[..64]),
    ] {
        let (status, page) = account_of(login).await;
        assert_eq!(status, StatusCode::OK, "{login:?}: {page}");
        assert!(
            page.contains(account),
            "{login:?} should be signed in as {account:?}"
        );
    }
    // The same value comes back to the same account.
    let (_, page) = account_of("alice@example.com").await;
    assert!(
        page.contains("alice") && !page.contains("alice-2"),
        "{page}"
    );
    let store = smolchat_store::Store::open(&server.database_url)
        .await
        .expect("store");
    let alice = store
        .user_by_name("alice")
        .await
        .expect("read")
        .expect("alice");
    store.set_disabled(&alice.id, true).await.expect("disable");
    let (status, page) = account_of("alice@example.com").await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{page}");
    assert!(page.contains("disabled"), "{page}");
    store.close().await;
    assert!(
        !server.log_text().contains("request failed"),
        "no 500 was logged:\n{}",
        server.log_text()
    );
}
