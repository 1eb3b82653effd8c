//! Headless Chromium over WebDriver (fantoccini) for the browser tests: the driver process,
//! browsers with their own profiles, and small script helpers. Chromium missing is a failure,
//! not a skip: run `scripts/install-test-deps.sh` (or `make test`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
pub const WAIT: Duration = Duration::from_secs(90);

/// `chromedriver --port=…`, killed on drop with the Chromium processes it started.
pub struct Driver {
    child: Child,
    pub url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        super::group::kill_group(&mut self.child);
    }
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

pub async fn start_driver(dir: &Path) -> Driver {
    for tool in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            Path::new(tool).exists(),
            "{tool} is missing: the browser tests need Debian's `chromium` and `chromium-driver`. \
             Run `sudo scripts/install-test-deps.sh` (make test does) and try again."
        );
    }
    // A port picked free can be taken before chromedriver binds it: then it exits, and the
    // start is retried on another port.
    let mut last = String::new();
    for _ in 0..3 {
        let port = free_port();
        let log_path = dir.join("chromedriver.log");
        let log = std::fs::File::create(&log_path).expect("log");
        let child = super::group::own_group(&mut Command::new(CHROMEDRIVER))
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start chromedriver");
        let mut driver = Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(_)) = driver.child.try_wait() {
                break;
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return driver;
            }
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last = std::fs::read_to_string(&log_path).unwrap_or_default();
    }
    panic!("chromedriver exited three times:\n{last}");
}

/// One browser (its own Chromium and profile, so its own cookies).
pub async fn browser(driver: &Driver, profile: &Path, opts: BrowserOpts) -> Client {
    std::fs::create_dir_all(profile).expect("profile dir");
    let mut args = vec![
        "--headless".to_string(),
        "--no-sandbox".into(),
        "--disable-gpu".into(),
        "--disable-dev-shm-usage".into(),
        "--disable-background-networking".into(),
        "--disable-component-update".into(),
        "--no-first-run".into(),
        "--disable-sync".into(),
        "--disable-quic".into(),
        "--hide-scrollbars".into(),
        format!("--user-data-dir={}", profile.display()),
        format!("--window-size={},{}", opts.width, opts.height),
    ];
    if opts.dark {
        args.push("--force-dark-mode".into());
        args.push("--blink-settings=preferredColorScheme=0".into());
    } else {
        args.push("--blink-settings=preferredColorScheme=1".into());
    }
    let mut chrome = json!({ "binary": CHROMIUM, "args": args });
    if opts.phone {
        chrome["mobileEmulation"] = json!({
            "deviceMetrics": { "width": opts.width, "height": opts.height, "pixelRatio": 2.0, "touch": true },
            "userAgent": "Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/156.0 Mobile Safari/537.36"
        });
    }
    let mut caps = serde_json::Map::new();
    caps.insert("goog:chromeOptions".into(), chrome);
    caps.insert("unhandledPromptBehavior".into(), json!("ignore"));
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("start a Chromium session")
}

#[derive(Clone, Copy)]
pub struct BrowserOpts {
    pub width: u32,
    pub height: u32,
    pub dark: bool,
    pub phone: bool,
}

pub const DESKTOP: BrowserOpts = BrowserOpts {
    width: 1280,
    height: 800,
    dark: false,
    phone: false,
};

pub async fn js(c: &Client, script: &str) -> Value {
    c.execute(script, vec![])
        .await
        .unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
}

/// Polls `script` (which returns a value) until `ok` holds; panics with `what` after [`WAIT`].
pub async fn wait_js(c: &Client, script: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let v = js(c, script).await;
        if ok(&v) {
            return v;
        }
        if Instant::now() > deadline {
            let body = js(c, "return document.body.innerText").await;
            let error = js(c, "return document.body.dataset.lastError || ''").await;
            panic!("timed out waiting for {what}; last value {v}\nlast error shown: {error}\n--- page text ---\n{body}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Types into the field `css` once it is there (after clearing it).
pub async fn fill(c: &Client, css: &str, text: &str) {
    let field = c
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css}: {e}"));
    field.clear().await.expect("clear");
    field.send_keys(text).await.expect("type");
}

/// Waits until the page's path is `path`.
pub async fn wait_path(c: &Client, path: &str) {
    wait_js(c, "return location.pathname", path, |v| v == &json!(path)).await;
}

/// Clicks the element `css` from script (a WebDriver click can be intercepted while the
/// message list scrolls), after the script returns (so a dialog it opens does not fail it).
pub async fn click(c: &Client, css: &str) {
    let found = js(
        c,
        &format!(
            "const e = document.querySelector({}); if (e) setTimeout(() => e.click(), 0); return !!e",
            json!(css)
        ),
    )
    .await;
    if found != json!(true) {
        let url = c
            .current_url()
            .await
            .map(|u| u.to_string())
            .unwrap_or_default();
        let body = js(c, "return document.body.innerText").await;
        panic!("no element {css} on {url}\n{body}");
    }
}

/// Types `text` in the composer and presses Enter.
pub async fn send(c: &Client, text: &str) {
    let input = c
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#input"))
        .await
        .expect("composer");
    input.send_keys(text).await.expect("type");
    input.send_keys("\u{E007}").await.expect("Enter");
}

pub const STREAM_LEN: &str = "const s = document.querySelector('.msg.assistant.streaming .md'); \
     return s ? s.textContent.length : -1;";
/// The text length of the last assistant message, finished or not (-1 when there is none).
const LAST_REPLY_LEN: &str = "const m = document.querySelectorAll('.msg.assistant .md'); \
     return m.length ? m[m.length - 1].textContent.length : -1;";
pub const IDLE: &str = "return document.querySelector('.msg.assistant.streaming') === null \
     && document.getElementById('stop-btn').hidden && document.querySelectorAll('.msg.assistant').length";

/// Waits for the reply to stream (text growing over several looks) and to finish; returns the
/// lengths seen (one, the final one, when the reply finished between two looks).
pub async fn watch_stream(c: &Client) -> Vec<i64> {
    let mut seen: Vec<i64> = Vec::new();
    let deadline = Instant::now() + WAIT;
    loop {
        let n = js(c, STREAM_LEN).await.as_i64().unwrap_or(-1);
        if n > 0 && seen.last() != Some(&n) {
            seen.push(n);
        }
        let done = js(
            c,
            "return document.querySelector('.msg.assistant.streaming') === null && \
             document.querySelectorAll('.msg.assistant .stats').length > 0 && \
             document.getElementById('stop-btn').hidden",
        )
        .await;
        if done == json!(true) && seen.is_empty() {
            // A short reply can stream and finish between two looks (a fast decode): then the
            // finished reply's text is the one length seen. A sampled reply may also be empty
            // (the model ends at once): it finished all the same, with length 0.
            let last = js(c, LAST_REPLY_LEN).await.as_i64().unwrap_or(-1);
            if last >= 0 {
                eprintln!("the reply ({last} characters) finished between two looks");
                seen.push(last);
            }
        }
        if done == json!(true) && !seen.is_empty() {
            return seen;
        }
        if Instant::now() >= deadline {
            let last = js(
                c,
                "const m = document.querySelectorAll('.msg.assistant'); \
                 return m.length ? m[m.length - 1].outerHTML.slice(0, 1500) : 'no assistant message';",
            )
            .await;
            panic!("the reply did not finish; lengths {seen:?}; the last reply: {last}");
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
}

pub async fn screenshot(c: &Client, name: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/screenshots");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    // Let transitions and fonts settle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let png = c.screenshot().await.expect("screenshot");
    std::fs::write(dir.join(format!("{name}.png")), png).expect("write screenshot");
}

pub async fn conversation_id(c: &Client) -> String {
    let url = c.current_url().await.expect("url");
    url.path()
        .strip_prefix("/c/")
        .unwrap_or_else(|| panic!("not a conversation page: {url}"))
        .to_string()
}

/// A JSON API call from the page (its cookie and CSRF token); `[status, body]`.
pub async fn fetch(c: &Client, method: &str, path: &str, body: Option<Value>) -> (u64, Value) {
    let got = c
        .execute_async(
            "const [method, path, body] = arguments; const done = arguments[arguments.length - 1]; \
             const init = {method, credentials: 'same-origin', headers: {'x-csrf-token': document.body.dataset.csrf}}; \
             if (body !== null) { init.headers['content-type'] = 'application/json'; init.body = JSON.stringify(body); } \
             fetch(path, init).then(r => r.text().then(t => done([r.status, t]))).catch(e => done([0, String(e)]));",
            vec![json!(method), json!(path), body.unwrap_or(Value::Null)],
        )
        .await
        .expect("fetch");
    let status = got[0].as_u64().unwrap_or(0);
    let text = got[1].as_str().unwrap_or_default();
    (status, serde_json::from_str(text).unwrap_or(json!(text)))
}
