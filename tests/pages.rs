//! The HTML pages' routes against a real `smolchat serve` (the real default model): CSRF, ids,
//! owners, oversize input, escaping, and the admin page's login.

mod common;

use std::collections::BTreeMap;

use common::server::{csrf_of, form_encode, Server};
use reqwest::header::{CONTENT_TYPE, COOKIE, SET_COOKIE};
use reqwest::{Method, StatusCode};

/// A browser-like client: keeps every cookie the server sets and the page's CSRF token.
struct Browser {
    http: reqwest::Client,
    base: String,
    cookies: BTreeMap<String, String>,
    csrf: Option<String>,
}

struct Page {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    text: String,
}

impl Browser {
    fn new(base: &str) -> Browser {
        Browser {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("client"),
            base: base.to_string(),
            cookies: BTreeMap::new(),
            csrf: None,
        }
    }

    async fn request(
        &mut self,
        method: Method,
        path: &str,
        form: Option<&[(&str, &str)]>,
        csrf: bool,
    ) -> Page {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if !self.cookies.is_empty() {
            let jar: Vec<String> = self
                .cookies
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            req = req.header(COOKIE, jar.join("; "));
        }
        if csrf {
            if let Some(t) = &self.csrf {
                req = req.header("X-CSRF-Token", t);
            }
        }
        if let Some(form) = form {
            let body: String = form
                .iter()
                .map(|(k, v)| format!("{}={}", form_encode(k), form_encode(v)))
                .collect::<Vec<_>>()
                .join("&");
            req = req
                .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(body);
        }
        let res = req.send().await.expect("request");
        for c in res.headers().get_all(SET_COOKIE) {
            let c = c.to_str().expect("cookie");
            let pair = c.split(';').next().unwrap_or_default();
            if let Some((k, v)) = pair.split_once('=') {
                if v.is_empty() {
                    self.cookies.remove(k);
                } else {
                    self.cookies.insert(k.to_string(), v.to_string());
                }
            }
        }
        let status = res.status();
        let headers = res.headers().clone();
        let text = res.text().await.expect("body");
        if let Some(token) = csrf_of(&text) {
            self.csrf = Some(token);
        }
        Page {
            status,
            headers,
            text,
        }
    }

    async fn get(&mut self, path: &str) -> Page {
        self.request(Method::GET, path, None, true).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Page {
        self.request(Method::POST, path, Some(form), true).await
    }

    /// Creates a conversation (without a message) and returns its id.
    async fn new_conversation(&mut self) -> String {
        let page = self.post("/c", &[]).await;
        assert_eq!(page.status, StatusCode::CREATED, "{}", page.text);
        let to = page.headers["HX-Redirect"]
            .to_str()
            .expect("redirect")
            .to_string();
        to.strip_prefix("/c/").expect("/c/{id}").to_string()
    }
}

#[tokio::test]
async fn page_routes_refuse_bad_requests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_LIMITS__MAX_MESSAGE_CHARS", "100")]).await;
    let mut alice = Browser::new(&server.base);

    // The page sets the owner cookie and embeds a CSRF token; it has a strict CSP.
    let home = alice.get("/").await;
    assert_eq!(home.status, StatusCode::OK);
    assert!(alice.cookies.contains_key("smolchat_owner"));
    assert!(alice.csrf.as_deref().is_some_and(|t| t.len() >= 40));
    let csp = home.headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(home.text.contains("/static/vendor/htmx-2.0.11.min.js"));
    for asset in [
        "/static/app.css",
        "/static/chat.js",
        "/static/vendor/htmx-2.0.11.min.js",
    ] {
        assert_eq!(alice.get(asset).await.status, StatusCode::OK, "{asset}");
    }
    assert_eq!(
        alice.get("/static/nope.js").await.status,
        StatusCode::NOT_FOUND
    );

    let id = alice.new_conversation().await;

    // Missing or wrong CSRF token → 403 on every state-changing route.
    let unsafe_routes: Vec<(Method, String)> = vec![
        (Method::POST, "/c".into()),
        (Method::POST, format!("/c/{id}/messages")),
        (Method::POST, format!("/c/{id}/stop")),
        (Method::POST, format!("/c/{id}/regenerate")),
        (Method::POST, format!("/c/{id}/edit")),
        (Method::POST, format!("/c/{id}/rename")),
        (Method::POST, format!("/c/{id}/settings")),
        (Method::POST, format!("/c/{id}/thinking")),
        (Method::DELETE, format!("/c/{id}")),
        (Method::POST, "/admin/login".into()),
    ];
    for (method, path) in &unsafe_routes {
        let page = alice
            .request(method.clone(), path, Some(&[("content", "hi")]), false)
            .await;
        assert_eq!(
            page.status,
            StatusCode::FORBIDDEN,
            "{method} {path}: {}",
            page.text
        );
        assert!(page.text.contains("CSRF"), "{}", page.text);
        let good = alice.csrf.take();
        alice.csrf = Some("AAAA".into());
        let page = alice
            .request(method.clone(), path, Some(&[("content", "hi")]), true)
            .await;
        assert_eq!(
            page.status,
            StatusCode::FORBIDDEN,
            "{method} {path} with a wrong token"
        );
        alice.csrf = good;
    }
    // Another browser's token is not this browser's.
    let mut bob = Browser::new(&server.base);
    bob.get("/").await;
    let bobs_token = bob.csrf.clone();
    let alices = alice.csrf.replace(bobs_token.expect("token"));
    assert_eq!(alice.post("/c", &[]).await.status, StatusCode::FORBIDDEN);
    alice.csrf = alices;

    // The JSON API: no token is fine for non-browser clients, but a browser's cross-site
    // request (Sec-Fetch-Site, Origin) or a wrong token is refused.
    let api = format!("{}/api/conversations", server.base);
    let cookie = format!("smolchat_owner={}", alice.cookies["smolchat_owner"]);
    let http = reqwest::Client::new();
    let api_post = |headers: &[(&str, &str)]| {
        let mut req = http
            .post(&api)
            .header(COOKIE, &cookie)
            .header(CONTENT_TYPE, "application/json")
            .body("{}");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send()
    };
    let token = alice.csrf.clone().expect("token");
    let host = server.base.trim_start_matches("http://").to_string();
    let same_origin = format!("http://{host}");
    for (headers, want) in [
        (vec![], StatusCode::CREATED),
        (vec![("X-CSRF-Token", token.as_str())], StatusCode::CREATED),
        (
            vec![
                ("Sec-Fetch-Site", "same-origin"),
                ("Origin", same_origin.as_str()),
            ],
            StatusCode::CREATED,
        ),
        (vec![("X-CSRF-Token", "nope")], StatusCode::FORBIDDEN),
        (
            vec![("Sec-Fetch-Site", "cross-site")],
            StatusCode::FORBIDDEN,
        ),
        (vec![("Sec-Fetch-Site", "same-site")], StatusCode::FORBIDDEN),
        (
            vec![("Origin", "http://evil.example")],
            StatusCode::FORBIDDEN,
        ),
    ] {
        let res = api_post(&headers).await.expect("api");
        assert_eq!(res.status(), want, "{headers:?}");
        if want == StatusCode::FORBIDDEN {
            let body: serde_json::Value = res.json().await.expect("json");
            assert_eq!(body["error"]["type"], "forbidden");
        }
    }

    // Bad ids → 400; unknown ids and other owners' conversations → 404.
    assert_eq!(
        alice.get("/c/not-a-uuid").await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        alice
            .post("/c/not-a-uuid/messages", &[("content", "x")])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    let unknown = "0190a5c4-1f2e-7c3d-9a8b-123456789abc";
    assert_eq!(
        alice.get(&format!("/c/{unknown}")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        alice.get(&format!("/c/{id}/m/not-a-uuid")).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        alice.get(&format!("/c/{id}/m/{unknown}")).await.status,
        StatusCode::NOT_FOUND
    );
    for (method, path) in &unsafe_routes[1..9] {
        let page = bob
            .request(
                method.clone(),
                path,
                Some(&[("content", "x"), ("title", "x")]),
                true,
            )
            .await;
        assert_eq!(
            page.status,
            StatusCode::NOT_FOUND,
            "bob: {method} {path}: {}",
            page.text
        );
    }
    let page = bob.get(&format!("/c/{id}")).await;
    assert_eq!(page.status, StatusCode::NOT_FOUND);
    assert!(
        page.text.contains("conversation not found"),
        "{}",
        page.text
    );
    let bobs_list = bob.get("/conversations").await;
    assert!(!bobs_list.text.contains(&id));
    assert!(alice.get("/conversations").await.text.contains(&id));

    // Oversize and invalid input.
    let long = "x".repeat(101);
    let page = alice
        .post(&format!("/c/{id}/messages"), &[("content", &long)])
        .await;
    assert_eq!(page.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", page.text);
    assert!(page.text.contains("limit is 100"), "{}", page.text);
    assert_eq!(
        alice.post("/c", &[("content", &long)]).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    let huge = "y".repeat(2 << 20);
    assert_eq!(
        alice
            .post(&format!("/c/{id}/messages"), &[("content", &huge)])
            .await
            .status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(
        alice
            .post(&format!("/c/{id}/messages"), &[("content", "  ")])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        alice
            .post(&format!("/c/{id}/rename"), &[("title", &"t".repeat(201))])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        alice.post(&format!("/c/{id}/rename"), &[]).await.status,
        StatusCode::BAD_REQUEST
    );
    let settings = |t: &'static str, p: &'static str, m: &'static str| {
        [
            ("system_prompt", ""),
            ("temperature", t),
            ("top_p", p),
            ("max_tokens", m),
        ]
    };
    for (t, p, m) in [
        ("-1", "0.9", "10"),
        ("0.5", "0", "10"),
        ("0.5", "1.5", "10"),
        ("0.5", "0.9", "0"),
        ("0.5", "0.9", "999999"),
        ("abc", "0.9", "10"),
    ] {
        let page = alice
            .post(&format!("/c/{id}/settings"), &settings(t, p, m))
            .await;
        assert_eq!(
            page.status,
            StatusCode::BAD_REQUEST,
            "{t} {p} {m}: {}",
            page.text
        );
    }
    let prompt = "p".repeat(101);
    let page = alice
        .post(
            &format!("/c/{id}/settings"),
            &[
                ("system_prompt", &prompt),
                ("temperature", "0.5"),
                ("top_p", "0.9"),
                ("max_tokens", "10"),
            ],
        )
        .await;
    assert_eq!(page.status, StatusCode::PAYLOAD_TOO_LARGE);
    let page = alice
        .post(&format!("/c/{id}/settings"), &settings("0.3", "0.8", "12"))
        .await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.text);
    // Regenerate/edit with nothing sent yet.
    assert_eq!(
        alice.post(&format!("/c/{id}/regenerate"), &[]).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        alice
            .post(&format!("/c/{id}/edit"), &[("content", "new")])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        alice
            .get(&format!("/conversations?q={}", "q".repeat(201)))
            .await
            .status,
        StatusCode::BAD_REQUEST
    );

    // A title with markup is shown as text.
    let xss = "<img src=x onerror=alert(1)>";
    assert_eq!(
        alice
            .post(&format!("/c/{id}/rename"), &[("title", xss)])
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    let page = alice.get(&format!("/c/{id}")).await;
    assert!(!page.text.contains(xss), "unescaped title");
    assert!(
        page.text.contains("&#60;img src=x onerror=alert(1)&#62;"),
        "{}",
        page.text
            .lines()
            .filter(|l| l.contains("onerror"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Delete, then it is gone.
    let page = alice
        .request(Method::DELETE, &format!("/c/{id}"), None, true)
        .await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.headers["HX-Redirect"], "/");
    assert_eq!(
        alice.get(&format!("/c/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        alice
            .request(Method::DELETE, &format!("/c/{id}"), None, true)
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    // No admin token configured: a clear "disabled" page, and its routes refuse.
    let page = alice.get("/admin").await;
    assert_eq!(page.status, StatusCode::NOT_FOUND);
    assert!(page.text.contains("Admin is disabled"), "{}", page.text);
    assert_eq!(
        alice.post("/admin/login", &[("token", "x")]).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(alice.get("/admin/live").await.status, StatusCode::NOT_FOUND);
}

/// The conversation's messages through the JSON API (same cookies), once no reply is running.
async fn settled_messages(b: &mut Browser, id: &str) -> Vec<serde_json::Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let page = b.get(&format!("/api/conversations/{id}")).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.text);
        let v: serde_json::Value = serde_json::from_str(&page.text).expect("json");
        let messages = v["messages"].as_array().expect("messages").clone();
        if messages.iter().all(|m| m["status"] != "streaming") {
            return messages;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a reply never finished"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

fn ids(messages: &[serde_json::Value]) -> Vec<String> {
    messages.iter().map(|m| m["id"].to_string()).collect()
}

/// Regenerate and edit replace the last exchange only once the new request is accepted: refused
/// for a context overflow or because a reply is running, they change nothing.
#[tokio::test]
async fn refused_regenerate_and_edit_lose_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_LIMITS__CONTEXT", "256")]).await;
    let mut alice = Browser::new(&server.base);
    alice.get("/").await;
    let id = alice.new_conversation().await;
    let settings = [
        ("system_prompt", "Be brief."),
        ("temperature", "0"),
        ("top_p", "0.9"),
        ("max_tokens", "6"),
    ];
    let page = alice.post(&format!("/c/{id}/settings"), &settings).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.text);
    for text in ["Hi!", "Name a colour."] {
        let page = alice
            .post(&format!("/c/{id}/messages"), &[("content", text)])
            .await;
        assert_eq!(page.status, StatusCode::ACCEPTED, "{}", page.text);
        settled_messages(&mut alice, &id).await;
    }
    let before = settled_messages(&mut alice, &id).await;
    assert_eq!(before.len(), 4);

    // An edit whose prompt overflows the context is refused and the exchange stays.
    let long = "word ".repeat(300);
    let page = alice
        .post(&format!("/c/{id}/edit"), &[("content", &long)])
        .await;
    assert_eq!(page.status, StatusCode::BAD_REQUEST, "{}", page.text);
    assert!(page.text.contains("context"), "{}", page.text);
    assert_eq!(ids(&settled_messages(&mut alice, &id).await), ids(&before));

    // While a reply runs, regenerate and edit are refused and nothing is deleted.
    let page = alice
        .post(
            &format!("/c/{id}/settings"),
            &[
                ("system_prompt", "Be brief."),
                ("temperature", "0"),
                ("top_p", "0.9"),
                ("max_tokens", "64"),
            ],
        )
        .await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.text);
    let page = alice
        .post(
            &format!("/c/{id}/messages"),
            &[("content", "Count to twenty.")],
        )
        .await;
    assert_eq!(page.status, StatusCode::ACCEPTED, "{}", page.text);
    let racing = alice.post(&format!("/c/{id}/regenerate"), &[]).await;
    assert_eq!(racing.status, StatusCode::CONFLICT, "{}", racing.text);
    let racing = alice
        .post(&format!("/c/{id}/edit"), &[("content", "Count to ten.")])
        .await;
    assert_eq!(racing.status, StatusCode::CONFLICT, "{}", racing.text);
    let after_race = settled_messages(&mut alice, &id).await;
    assert_eq!(after_race.len(), 6);
    assert_eq!(ids(&after_race[..4]), ids(&before));
    assert_eq!(after_race[4]["content"], "Count to twenty.");

    // An accepted regenerate answers the same question again: a new reply is shown, the old
    // one kept as its other version.
    let page = alice.post(&format!("/c/{id}/regenerate"), &[]).await;
    assert_eq!(page.status, StatusCode::ACCEPTED, "{}", page.text);
    let regenerated = settled_messages(&mut alice, &id).await;
    assert_eq!(regenerated.len(), 6);
    assert_eq!(ids(&regenerated[..4]), ids(&before));
    assert_eq!(
        regenerated[4]["id"], after_race[4]["id"],
        "the same question"
    );
    assert_ne!(regenerated[5]["id"], after_race[5]["id"]);
    let page = alice.get(&format!("/c/{id}")).await;
    assert!(
        page.text.contains("2/2"),
        "the reply shows its two versions"
    );
}

#[tokio::test]
async fn messages_render_escaped_and_sanitized() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SAMPLING__MAX_TOKENS", "4"),
            ("SMOLCHAT_SAMPLING__THINKING", "false"),
        ],
    )
    .await;
    let mut b = Browser::new(&server.base);
    b.get("/").await;
    let payload = "<script>alert(1)</script> [x](javascript:alert(2)) <img src=x onerror=alert(3)>";
    let page = b.post("/c", &[("content", payload)]).await;
    assert_eq!(page.status, StatusCode::CREATED, "{}", page.text);
    let to = page.headers["HX-Redirect"].to_str().unwrap().to_string();
    // Wait for the (4-token) reply to be stored complete (not only "not replying": between the
    // end of generation and the final save the row is still `streaming`).
    let mut text = String::new();
    for _ in 0..600 {
        text = b.get(&to).await.text;
        if text.contains("class=\"msg assistant status-complete") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(text.contains("class=\"msg assistant"), "{text}");
    assert!(!text.contains("<script>alert"), "unescaped user message");
    assert!(!text.contains("<img src=x"), "unescaped user message");
    assert!(text.contains("&#60;script&#62;alert(1)&#60;/script&#62;"));
    // The stats line under the reply.
    let stats = text
        .split("class=\"stats\">")
        .nth(1)
        .and_then(|s| s.split('<').next())
        .unwrap_or("");
    assert!(
        stats.contains(" tokens") && stats.contains("prompt "),
        "stats {stats:?}"
    );
    let used = text
        .split("id=\"ctx-used\">")
        .nth(1)
        .and_then(|s| s.split('<').next())
        .unwrap_or("0");
    assert!(used.parse::<u32>().unwrap_or(0) > 4, "context usage {used}");
}

#[tokio::test]
async fn admin_login_and_actions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let token = "s3cret-admin-token";
    let server = Server::start(dir.path(), &[("SMOLCHAT_SERVER__ADMIN_TOKEN", token)]).await;
    let mut user = Browser::new(&server.base);
    user.get("/").await;
    let id = user.new_conversation().await;

    let mut admin = Browser::new(&server.base);
    let login = admin.get("/admin").await;
    assert_eq!(login.status, StatusCode::OK);
    assert!(login.text.contains("Admin token"), "{}", login.text);
    assert!(!login.text.contains(&id), "the login page shows no data");
    // Without a session, the data and actions are refused.
    assert_eq!(
        admin.get("/admin/live").await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        admin.post(&format!("/admin/c/{id}/stop"), &[]).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        admin
            .post(&format!("/admin/c/{id}/evict"), &[])
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        admin
            .request(Method::DELETE, &format!("/admin/c/{id}"), None, true)
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    // Wrong tokens.
    for wrong in ["", "s3cret", "s3cret-admin-token-", "S3CRET-ADMIN-TOKEN"] {
        let page = admin.post("/admin/login", &[("token", wrong)]).await;
        assert_eq!(page.status, StatusCode::UNAUTHORIZED, "{wrong:?}");
        assert!(page.text.contains("wrong admin token"));
        assert!(!admin.cookies.contains_key("smolchat_admin"));
    }
    // A forged session cookie.
    admin
        .cookies
        .insert("smolchat_admin".into(), "admin-v1".into());
    assert_eq!(
        admin.get("/admin/live").await.status,
        StatusCode::UNAUTHORIZED
    );
    admin.cookies.remove("smolchat_admin");

    let page = admin.post("/admin/login", &[("token", token)]).await;
    assert_eq!(page.status, StatusCode::NO_CONTENT);
    let set = page
        .headers
        .get_all(SET_COOKIE)
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        set.contains("smolchat_admin=") && set.contains("HttpOnly"),
        "{set}"
    );
    let dash = admin.get("/admin").await;
    assert_eq!(dash.status, StatusCode::OK);
    assert!(
        dash.text.contains(&id),
        "the dashboard lists the user's conversation"
    );
    assert!(dash.text.contains("KV cache"));
    assert!(admin.get("/admin/live").await.text.contains(&id));
    // Actions: bad ids, then the real ones.
    assert_eq!(
        admin.post("/admin/c/nope/stop", &[]).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        admin.post(&format!("/admin/c/{id}/stop"), &[]).await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        admin
            .post(&format!("/admin/c/{id}/evict"), &[])
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    // Actions need the CSRF token too.
    let page = admin
        .request(Method::DELETE, &format!("/admin/c/{id}"), None, false)
        .await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    let page = admin
        .request(Method::DELETE, &format!("/admin/c/{id}"), None, true)
        .await;
    assert_eq!(page.status, StatusCode::NO_CONTENT);
    assert_eq!(
        user.get(&format!("/c/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        admin
            .request(Method::DELETE, &format!("/admin/c/{id}"), None, true)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    // The user's owner cookie does not open the admin page.
    assert_eq!(
        user.get("/admin/live").await.status,
        StatusCode::UNAUTHORIZED
    );
}
