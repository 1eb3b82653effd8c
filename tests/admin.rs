//! Admin sessions and login throttling against a real `smolchat serve`: every sign-in gets its
//! own server-side session; sign-out, expiry and a changed admin token end it for every copy of
//! the cookie; wrong tokens lock the address (and, from many addresses, the admin login) with
//! 429 + `Retry-After`, during which even the right token is refused.
//!
//! Different client addresses come from binding the client to other loopback addresses
//! (127.0.0.2, …), which Linux routes to the server on 127.0.0.1.

mod common;

use std::time::Duration;

use common::browser_client::{Answer, Browser};
use common::server::{metric, Server};
use reqwest::StatusCode;

const TOKEN: &str = "the-admin-token-0";
const ADMIN_COOKIE: &str = "smolchat_admin";

/// One browser (its cookies, the page's CSRF token) whose connections come from
/// `127.0.0.{last}`, after a visit to `/admin`.
async fn admin_client(server: &Server, last: u8) -> Browser {
    Browser::at(server, last, "/admin").await
}

trait AdminActions {
    async fn login(&mut self, token: &str) -> Answer;
    async fn login_with(&mut self, token: &str, headers: &[(&str, &str)]) -> Answer;
    async fn logout(&mut self) -> Answer;
    async fn live(&mut self) -> StatusCode;
    fn session(&self) -> Option<String>;
}

impl AdminActions for Browser {
    async fn login(&mut self, token: &str) -> Answer {
        self.login_with(token, &[]).await
    }

    async fn login_with(&mut self, token: &str, headers: &[(&str, &str)]) -> Answer {
        // Tokens here are URL-safe, so the form needs no encoding.
        let form = format!("token={token}");
        self.call(reqwest::Method::POST, "/admin/login", Some(&form), headers)
            .await
    }

    async fn logout(&mut self) -> Answer {
        self.call(reqwest::Method::POST, "/admin/logout", None, &[])
            .await
    }

    /// The status of the admin data fragment: 200 with a session, 401 without.
    async fn live(&mut self) -> StatusCode {
        self.call(reqwest::Method::GET, "/admin/live", None, &[])
            .await
            .status
    }

    fn session(&self) -> Option<String> {
        self.cookies.get(ADMIN_COOKIE).cloned()
    }
}

async fn start(dir: &std::path::Path, token: &str, extra: &[(&str, &str)]) -> Server {
    let mut env = vec![("SMOLCHAT_SERVER__ADMIN_TOKEN", token)];
    env.extend_from_slice(extra);
    Server::start(dir, &env).await
}

#[tokio::test]
async fn admin_sessions_are_server_side() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The test client's address doubles as a TLS-terminating proxy's (below).
    let server = start(
        dir.path(),
        TOKEN,
        &[("SMOLCHAT_SERVER__TRUSTED_PROXIES", "[\"127.0.0.1\"]")],
    )
    .await;

    // Two sign-ins get two different random cookies, not a shared constant.
    let mut a = admin_client(&server, 1).await;
    let page = a.login(TOKEN).await;
    assert_eq!(page.status, StatusCode::NO_CONTENT, "{}", page.text);
    let set = page.set_cookies().join("\n");
    for attribute in [
        "HttpOnly",
        "SameSite=Strict",
        "Path=/admin",
        "Max-Age=43200",
    ] {
        assert!(set.contains(attribute), "{attribute} missing: {set}");
    }
    assert!(!set.contains("Secure"), "plain HTTP: not Secure: {set}");
    let mut b = admin_client(&server, 1).await;
    assert_eq!(b.login(TOKEN).await.status, StatusCode::NO_CONTENT);
    let (ca, cb) = (a.session().expect("a's cookie"), b.session().expect("b's"));
    assert_ne!(ca, cb);
    assert_eq!(ca.len(), 64, "{ca}");
    assert!(!ca.contains(TOKEN) && !cb.contains(TOKEN));

    // Behind a trusted TLS-terminating proxy (X-Forwarded-Proto: https) the cookie is Secure,
    // named `__Host-…` and scoped to `Path=/` (which that prefix requires).
    // The browser is on HTTPS from its first page on (its owner cookie and CSRF token too).
    let mut https = admin_client(&server, 1).await;
    https.cookies.clear();
    let first = https
        .call(
            reqwest::Method::GET,
            "/admin",
            None,
            &[("X-Forwarded-Proto", "https")],
        )
        .await;
    assert!(first
        .set_cookies()
        .join("")
        .contains("__Host-smolchat_owner="));
    let page = https
        .login_with(TOKEN, &[("X-Forwarded-Proto", "https")])
        .await;
    assert_eq!(page.status, StatusCode::NO_CONTENT);
    let set = page.set_cookies().join("\n");
    assert!(
        set.contains("__Host-smolchat_admin=")
            && set.contains("Secure")
            && set.contains("Path=/")
            && !set.contains("Path=/admin"),
        "{set}"
    );
    // Signing in again replaces the browser's session: the previous cookie stops working.
    let mut tls = admin_client(&server, 1).await;
    assert_eq!(tls.login(TOKEN).await.status, StatusCode::NO_CONTENT);
    let first = tls.session().expect("tls's cookie");
    assert_eq!(tls.login(TOKEN).await.status, StatusCode::NO_CONTENT);
    let second = tls.session().expect("the new cookie");
    assert_ne!(first, second);
    assert_eq!(tls.live().await, StatusCode::OK);
    tls.cookies.insert(ADMIN_COOKIE.into(), first);
    assert_eq!(tls.live().await, StatusCode::UNAUTHORIZED);

    // A copy of a's cookie in another client works like the original…
    let mut copy = admin_client(&server, 2).await;
    copy.cookies.insert(ADMIN_COOKIE.into(), ca.clone());
    assert_eq!(copy.live().await, StatusCode::OK);
    assert_eq!(a.live().await, StatusCode::OK);
    // …until a signs out: the session is revoked server-side, so both are refused.
    let out = a.logout().await;
    assert_eq!(out.status, StatusCode::NO_CONTENT);
    assert!(a.session().is_none(), "logout drops the browser's cookie");
    assert_eq!(copy.live().await, StatusCode::UNAUTHORIZED);
    a.cookies.insert(ADMIN_COOKIE.into(), ca.clone());
    assert_eq!(a.live().await, StatusCode::UNAUTHORIZED);
    let page = copy.call(reqwest::Method::GET, "/admin", None, &[]).await;
    assert!(page.text.contains("Admin token"), "back to the login form");
    // Actions are refused with the old cookie too.
    let stop = copy
        .call(
            reqwest::Method::POST,
            "/admin/c/0190a0f0-0000-7000-8000-000000000000/stop",
            None,
            &[],
        )
        .await;
    assert_eq!(stop.status, StatusCode::UNAUTHORIZED);
    // b's session is its own and still works.
    assert_eq!(b.live().await, StatusCode::OK);

    // A restart with the same token keeps sessions (they are in the database)…
    drop(server);
    let server = start(dir.path(), TOKEN, &[]).await;
    b.base = server.base.clone();
    assert_eq!(b.live().await, StatusCode::OK);
    // …a restart with another token ends them.
    drop(server);
    let server = start(dir.path(), "a-new-admin-token", &[]).await;
    b.base = server.base.clone();
    assert_eq!(b.live().await, StatusCode::UNAUTHORIZED);
    let mut c = admin_client(&server, 1).await;
    assert_eq!(c.login(TOKEN).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        c.login("a-new-admin-token").await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(c.live().await, StatusCode::OK);
}

#[tokio::test]
async fn admin_sessions_expire() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(
        dir.path(),
        TOKEN,
        &[("SMOLCHAT_AUTH__ADMIN_SESSION_S", "3")],
    )
    .await;
    let mut a = admin_client(&server, 1).await;
    let page = a.login(TOKEN).await;
    assert_eq!(page.status, StatusCode::NO_CONTENT);
    assert!(page.set_cookies().join("\n").contains("Max-Age=3"));
    assert_eq!(a.live().await, StatusCode::OK);
    // The client keeps sending the cookie after its Max-Age: the server refuses it anyway.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert!(a.session().is_some());
    assert_eq!(a.live().await, StatusCode::UNAUTHORIZED);
    assert_eq!(a.login(TOKEN).await.status, StatusCode::NO_CONTENT);
    assert_eq!(a.live().await, StatusCode::OK);
}

#[tokio::test]
async fn wrong_admin_tokens_are_throttled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(
        dir.path(),
        TOKEN,
        &[
            ("SMOLCHAT_AUTH__LOGIN_FREE_FAILURES_PER_ADDRESS", "3"),
            ("SMOLCHAT_AUTH__LOGIN_FREE_FAILURES_PER_ACCOUNT", "6"),
            ("SMOLCHAT_AUTH__LOGIN_LOCKOUT_BASE_S", "4"),
            ("SMOLCHAT_AUTH__LOGIN_LOCKOUT_MAX_S", "60"),
        ],
    )
    .await;

    // Three wrong tokens from one address are checked (401); then that address is locked and
    // even the right token is refused with 429 + Retry-After, without a session.
    let mut a = admin_client(&server, 1).await;
    for wrong in ["nope", "the-admin", "the-admin-token-0-"] {
        let page = a.login(wrong).await;
        assert_eq!(
            page.status,
            StatusCode::UNAUTHORIZED,
            "{wrong}: {}",
            page.text
        );
        assert!(page.text.contains("wrong admin token"));
    }
    let page = a.login(TOKEN).await;
    assert_eq!(
        page.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the right token during the lockout: {}",
        page.text
    );
    let wait = page.retry_after().expect("Retry-After");
    assert!((1..=4).contains(&wait), "Retry-After {wait}");
    assert!(
        page.text
            .contains("too many wrong admin tokens from your address"),
        "{}",
        page.text
    );
    assert!(a.session().is_none());
    assert_eq!(a.live().await, StatusCode::UNAUTHORIZED);

    // Per address: another address still signs in (which also clears the admin's count).
    let mut b = admin_client(&server, 2).await;
    assert_eq!(b.login(TOKEN).await.status, StatusCode::NO_CONTENT);
    assert_eq!(a.login(TOKEN).await.status, StatusCode::TOO_MANY_REQUESTS);

    // Per account: one wrong guess from each of six addresses locks the admin login for
    // everyone, whatever the address, right token or not.
    for last in 3..=8 {
        let mut guesser = admin_client(&server, last).await;
        assert_eq!(
            guesser.login("guess").await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    let mut fresh = admin_client(&server, 9).await;
    let page = fresh.login(TOKEN).await;
    assert_eq!(page.status, StatusCode::TOO_MANY_REQUESTS, "{}", page.text);
    assert!(
        page.text.contains("from all addresses together"),
        "{}",
        page.text
    );
    let wait = page.retry_after().expect("Retry-After");
    assert!((1..=4).contains(&wait), "Retry-After {wait}");
    // Sessions made before the lockout keep working.
    assert_eq!(b.live().await, StatusCode::OK);

    // When the lockouts end, the right token is accepted again.
    tokio::time::sleep(Duration::from_millis(wait * 1000 + 300)).await;
    assert_eq!(fresh.login(TOKEN).await.status, StatusCode::NO_CONTENT);
    assert_eq!(fresh.live().await, StatusCode::OK);
    assert_eq!(a.login(TOKEN).await.status, StatusCode::NO_CONTENT);
    assert_eq!(a.live().await, StatusCode::OK);

    // The outcomes are counted for monitoring: 3 + 6 wrong, 3 throttled, 3 ok.
    let text = server.client().metrics().await;
    for (outcome, n) in [("wrong", 9.0), ("throttled", 3.0), ("ok", 3.0)] {
        let line = format!("smolchat_admin_logins_total{{outcome=\"{outcome}\"}}");
        assert_eq!(metric(&text, &line), Some(n), "{line}\n{text}");
    }
}
