//! A browser-like HTTP client for page tests: keeps cookies by name, picks up the page's CSRF
//! token, sends from a chosen loopback address (127.0.0.N, which Linux routes to a server on
//! 127.0.0.1) and does not follow redirects.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use reqwest::header::{HeaderMap, CONTENT_TYPE, COOKIE, RETRY_AFTER, SET_COOKIE};
use reqwest::StatusCode;

use super::server::Server;

/// One browser: its cookies (owner and admin), the page's CSRF token, a client address.
pub struct Browser {
    pub http: reqwest::Client,
    pub base: String,
    pub cookies: BTreeMap<String, String>,
    pub csrf: Option<String>,
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Answer {
    pub fn set_cookies(&self) -> Vec<String> {
        self.headers
            .get_all(SET_COOKIE)
            .iter()
            .map(|v| v.to_str().expect("cookie").to_string())
            .collect()
    }

    pub fn retry_after(&self) -> Option<u64> {
        self.headers.get(RETRY_AFTER)?.to_str().ok()?.parse().ok()
    }
}

impl Browser {
    /// A client whose connections come from `127.0.0.{last}`, after a GET of `first` (a page
    /// that embeds a CSRF token).
    pub async fn at(server: &Server, last: u8, first: &str) -> Browser {
        Browser::at_base(&server.base, Ipv4Addr::new(127, 0, 0, last), first).await
    }

    /// [`Browser::at`] `/admin`, then signed in there with the admin token `token`.
    pub async fn admin(server: &Server, last: u8, token: &str) -> Browser {
        let mut b = Browser::at(server, last, "/admin").await;
        let login = b
            .call(
                reqwest::Method::POST,
                "/admin/login",
                Some(&format!("token={token}")),
                &[],
            )
            .await;
        assert_eq!(login.status, StatusCode::NO_CONTENT, "{}", login.text);
        b.get("/admin").await;
        b
    }

    /// A client of the server (or proxy) at `base` whose connections come from `address` (a
    /// loopback address), after a GET of `first`.
    pub async fn at_base(base: &str, address: Ipv4Addr, first: &str) -> Browser {
        let mut c = Browser {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .local_address(IpAddr::V4(address))
                // Shorter than the server's keep-alive (see `server::Client::new`).
                .pool_idle_timeout(std::time::Duration::from_secs(2))
                .build()
                .expect("client"),
            base: base.to_string(),
            cookies: BTreeMap::new(),
            csrf: None,
        };
        // The page gives an owner cookie and its CSRF token.
        let page = c.call(reqwest::Method::GET, first, None, &[]).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.text);
        assert!(c.csrf.is_some(), "the page embeds a CSRF token");
        c
    }

    pub async fn call(
        &mut self,
        method: reqwest::Method,
        path: &str,
        form: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut req = self.request(method, path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(form) = form {
            req = req
                .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(form.to_string());
        }
        self.finish(req).await
    }

    /// A JSON request (the `/api` routes), with this client's cookies and CSRF token.
    pub async fn json(
        &mut self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Answer {
        let mut req = self.request(method, path);
        if let Some(body) = body {
            req = req
                .header(CONTENT_TYPE, "application/json")
                .body(body.to_string());
        }
        self.finish(req).await
    }

    /// Makes a personal API key named `name` on `/account` (signed in) and returns it, as the
    /// page shows it once.
    pub async fn new_api_key(&mut self, name: &str) -> String {
        let made = self
            .post_form("/account/keys", &format!("name={name}"))
            .await;
        made.text
            .split("id=\"new-key-value\">")
            .nth(1)
            .and_then(|r| r.split('<').next())
            .unwrap_or_else(|| panic!("the new key is shown: {}", made.text))
            .to_string()
    }

    /// This client's cookies as one `Cookie` header value (for another client of the same
    /// account, such as [`super::server::Client::with_cookie`]).
    pub fn cookie_header(&self) -> String {
        self.cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// A POST of `bytes` as the body (an upload), with this client's cookies and CSRF token.
    pub async fn upload(&mut self, path: &str, bytes: Vec<u8>) -> Answer {
        let req = self
            .request(reqwest::Method::POST, path)
            .header(CONTENT_TYPE, "application/octet-stream")
            .body(bytes);
        self.finish(req).await
    }

    /// A request with this client's cookies and CSRF token.
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if !self.cookies.is_empty() {
            let jar: Vec<String> = self
                .cookies
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            req = req.header(COOKIE, jar.join("; "));
        }
        if let Some(t) = &self.csrf {
            req = req.header("X-CSRF-Token", t);
        }
        req
    }

    async fn finish(&mut self, req: reqwest::RequestBuilder) -> Answer {
        let res = req.send().await.expect("request");
        let status = res.status();
        let headers = res.headers().clone();
        let text = res.text().await.expect("body");
        let answer = Answer {
            status,
            headers,
            text,
        };
        for c in answer.set_cookies() {
            let pair = c.split(';').next().unwrap_or_default();
            if let Some((k, v)) = pair.split_once('=') {
                if v.is_empty() {
                    self.cookies.remove(k);
                } else {
                    self.cookies.insert(k.to_string(), v.to_string());
                }
            }
        }
        if let Some(start) = answer.text.find("data-csrf=\"") {
            let rest = &answer.text[start + "data-csrf=\"".len()..];
            if let Some(end) = rest.find('"') {
                self.csrf = Some(rest[..end].to_string());
            }
        }
        answer
    }

    /// A form POST (the fields already encoded).
    pub async fn post_form(&mut self, path: &str, form: &str) -> Answer {
        self.call(reqwest::Method::POST, path, Some(form), &[])
            .await
    }

    pub async fn get(&mut self, path: &str) -> Answer {
        self.call(reqwest::Method::GET, path, None, &[]).await
    }
}
