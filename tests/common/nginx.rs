//! nginx in front of `smolchat serve` processes, as the README sets it up: round robin,
//! responses unbuffered (SSE), and the client's address and scheme passed on in
//! `X-Forwarded-For` / `X-Forwarded-Proto` (believed by a server whose
//! `server.trusted_proxies` names 127.0.0.1). Killed when dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;

use super::server::{free_port, Server};

pub struct Nginx {
    child: Child,
    pub base: String,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // The workers too: a killed master leaves them running.
        super::group::kill_group(&mut self.child);
    }
}

pub fn binary() -> Option<&'static str> {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

/// Whether nginx is missing where it is required (`SMOLTEST_REQUIRE_NGINX=1`, which `make
/// test` sets): panics then; otherwise prints the skip and returns true.
pub fn missing() -> bool {
    if binary().is_some() {
        return false;
    }
    if std::env::var("SMOLTEST_REQUIRE_NGINX").is_ok_and(|v| v == "1") {
        panic!("nginx is required (SMOLTEST_REQUIRE_NGINX=1) but not installed");
    }
    eprintln!("skipped: nginx is not installed (scripts/install-test-deps.sh installs it)");
    true
}

/// nginx on a free port of 127.0.0.1 in front of `servers`.
pub async fn start(dir: &Path, servers: &[&Server]) -> Nginx {
    start_with(dir, servers, "").await
}

/// [`start`] with more directives in the proxied location (e.g. the headers an authenticating
/// proxy sets).
pub async fn start_with(dir: &Path, servers: &[&Server], directives: &str) -> Nginx {
    let nginx = binary().expect("nginx");
    let mut last = String::new();
    // A port picked free can be taken before nginx binds it: retry.
    for _ in 0..3 {
        let port = free_port();
        let upstreams: String = servers
            .iter()
            .map(|s| format!("        server 127.0.0.1:{};\n", s.port))
            .collect();
        let conf = format!(
            "worker_processes 1;\n\
             daemon off;\n\
             pid {dir}/nginx.pid;\n\
             error_log {dir}/nginx-error.log warn;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n\
                 access_log off;\n\
                 client_body_temp_path {dir}/body;\n\
                 proxy_temp_path {dir}/proxy;\n\
                 fastcgi_temp_path {dir}/fastcgi;\n\
                 uwsgi_temp_path {dir}/uwsgi;\n\
                 scgi_temp_path {dir}/scgi;\n\
                 upstream smolchat {{\n{upstreams}    }}\n\
                 server {{\n\
                     listen 127.0.0.1:{port};\n\
                     location / {{\n\
                         proxy_pass http://smolchat;\n\
                         proxy_http_version 1.1;\n\
                         proxy_set_header Connection \"\";\n\
                         proxy_set_header Host $http_host;\n\
                         proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n\
                         proxy_set_header X-Forwarded-Proto $scheme;\n\
                         proxy_buffering off;\n\
                         proxy_read_timeout 300s;\n\
                         proxy_next_upstream error timeout;\n\
                         {directives}\n\
                     }}\n\
                 }}\n\
             }}\n",
            dir = dir.display(),
        );
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf).expect("write nginx.conf");
        let child = super::group::own_group(&mut Command::new(nginx))
            .arg("-p")
            .arg(dir)
            .arg("-c")
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nginx");
        // Owned at once, so every way out of here (a panic included) stops it.
        let mut proxy = Nginx {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = proxy.child.try_wait() {
                break;
            }
            if let Ok(r) = http.get(format!("{}/readyz", proxy.base)).send().await {
                if r.status() == StatusCode::OK {
                    return proxy;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last = std::fs::read_to_string(dir.join("nginx-error.log")).unwrap_or_default();
        if !last.contains("in use") {
            break;
        }
    }
    panic!("nginx did not start:\n{last}");
}
