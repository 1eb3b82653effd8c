//! The hostile-input catalogue: one table of requests a careless or malicious client sends to
//! every interface (JSON API, pages, event streams, `/v1`, admin, static files, operations), each
//! with the one status a correct server gives. Every case must get exactly that status with a
//! body that says what was wrong (never an empty body, never a 5xx), and the server must still be
//! healthy and have logged no panic afterwards. Configuration files get the same treatment as
//! start-up errors. (GGUF files: `tests/bad_files.rs` and the fuzzing in `tests/fuzz.rs`;
//! typed control tokens, cache probing and slow bodies: `tests/hostile.rs`.)
//!
//! Ids that are not UUIDs get 400 naming the expected form; well-formed ids of conversations that
//! do not exist or belong to someone else get 404 alike, so ids cannot be probed.
//!
//! Unknown fields: the JSON API refuses them. `/v1` accepts and ignores the fields OpenAI's own
//! clients and common front ends send routinely (`user`, `metadata`, `store`, `service_tier`,
//! `parallel_tool_calls`, `stream_options`, …), because refusing those would break the official
//! client libraries; values it cannot honour (`n` > 1, unknown roles, bad `logit_bias`) are
//! refused.

mod common;

use std::process::Command;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, COOKIE};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use common::server::Server;

const API_KEY: &str = "sk-catalogue-api-key";
const ADMIN_TOKEN: &str = "catalogue-admin-token";
const METRICS_TOKEN: &str = "catalogue-metrics-token";

/// Whose cookie a request carries.
#[derive(Clone, Copy, PartialEq)]
enum Who {
    /// The owner of `{mine}` (with a valid CSRF token for page routes).
    Me,
    /// No cookie at all.
    Nobody,
}

struct Case {
    name: String,
    method: Method,
    /// `{mine}` and `{theirs}` are replaced by a conversation of ours and one of another owner.
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Option<Vec<u8>>,
    who: Who,
    csrf: bool,
    expect: u16,
}

fn case(name: &str, method: Method, path: &str, expect: u16) -> Case {
    Case {
        name: name.to_string(),
        method,
        path: path.to_string(),
        headers: Vec::new(),
        body: None,
        who: Who::Me,
        csrf: true,
        expect,
    }
}

impl Case {
    fn json(mut self, body: &str) -> Case {
        self.headers
            .push(("content-type", "application/json".into()));
        self.body = Some(body.as_bytes().to_vec());
        self
    }
    fn json_value(self, v: Value) -> Case {
        let text = v.to_string();
        self.json(&text)
    }
    fn form(mut self, body: &str) -> Case {
        self.headers
            .push(("content-type", "application/x-www-form-urlencoded".into()));
        self.body = Some(body.as_bytes().to_vec());
        self
    }
    fn raw(mut self, content_type: &str, body: Vec<u8>) -> Case {
        if !content_type.is_empty() {
            self.headers.push(("content-type", content_type.into()));
        }
        self.body = Some(body);
        self
    }
    fn header(mut self, name: &'static str, value: &str) -> Case {
        self.headers.push((name, value.to_string()));
        self
    }
    /// The same request, expecting another status.
    fn tap(mut self, status: u16) -> Case {
        self.expect = status;
        self
    }
    fn strip_auth(mut self) -> Case {
        self.headers.retain(|(n, _)| *n != "authorization");
        self
    }
    fn bearer(self, key: &str) -> Case {
        self.header("authorization", &format!("Bearer {key}"))
    }
    fn nobody(mut self) -> Case {
        self.who = Who::Nobody;
        self
    }
    fn no_csrf(mut self) -> Case {
        self.csrf = false;
        self
    }
}

fn chat(body: Value) -> Case {
    case("", Method::POST, "/v1/chat/completions", 400)
        .bearer(API_KEY)
        .json_value(body)
}

fn msgs() -> Value {
    json!([{"role": "user", "content": "Hi"}])
}

fn catalogue() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |name: &str, c: Case| {
        let mut c = c;
        c.name = name.to_string();
        cases.push(c);
    };
    use Method as M;

    // ---- JSON API: bodies ----
    let create = || case("", M::POST, "/api/conversations", 400);
    add("api create: malformed JSON", create().json("{"));
    add("api create: array instead of object", create().json("[]"));
    add(
        "api create: string temperature",
        create().json(r#"{"temperature":"hot"}"#),
    );
    add(
        "api create: negative temperature",
        create().json(r#"{"temperature":-1}"#),
    );
    add(
        "api create: temperature beyond f64",
        create().json(r#"{"temperature":1e999}"#),
    );
    add("api create: top_p 0", create().json(r#"{"top_p":0}"#));
    add(
        "api create: top_p above 1",
        create().json(r#"{"top_p":1.5}"#),
    );
    add(
        "api create: max_tokens 0",
        create().json(r#"{"max_tokens":0}"#),
    );
    add(
        "api create: negative max_tokens",
        create().json(r#"{"max_tokens":-5}"#),
    );
    add(
        "api create: fractional max_tokens",
        create().json(r#"{"max_tokens":1.5}"#),
    );
    add(
        "api create: unknown field",
        create().json(r#"{"temprature":0.5}"#),
    );
    add(
        "api create: numeric system prompt",
        create().json(r#"{"system_prompt":5}"#),
    );
    add(
        "api create: NUL in system prompt",
        create().json(r#"{"system_prompt":"a\u0000b"}"#),
    );
    add(
        "api create: lone surrogate",
        create().json(r#"{"system_prompt":"\ud800"}"#),
    );
    add(
        "api create: invalid UTF-8",
        create().raw(
            "application/json",
            b"{\"system_prompt\":\"\xff\xfe\"}".to_vec(),
        ),
    );
    add(
        "api create: text/plain body",
        create().raw("text/plain", b"{}".to_vec()).tap(415),
    );
    add(
        "api create: no content type",
        create().raw("", b"{}".to_vec()).tap(415),
    );
    add(
        "api create: 2 MB body",
        create()
            .json(&format!(
                "{{\"system_prompt\":\"{}\"}}",
                "a".repeat(2 << 20)
            ))
            .tap(413),
    );
    add(
        "api create: nested depth bomb",
        create().json(&format!("{}{}", "[".repeat(10_000), "]".repeat(10_000))),
    );
    let send = || case("", M::POST, "/api/conversations/{mine}/messages", 400);
    add("api send: no content", send().json("{}"));
    add("api send: empty content", send().json(r#"{"content":""}"#));
    add(
        "api send: whitespace content",
        send().json(r#"{"content":"  \n "}"#),
    );
    add("api send: numeric content", send().json(r#"{"content":5}"#));
    add("api send: null content", send().json(r#"{"content":null}"#));
    add(
        "api send: NUL in content",
        send().json(r#"{"content":"a\u0000b"}"#),
    );
    add(
        "api send: unknown field",
        send().json(r#"{"content":"hi","role":"system"}"#),
    );
    add(
        "api send: content over the limit",
        send()
            .json_value(json!({"content": "x".repeat(40_000)}))
            .tap(413),
    );
    let patch = || case("", M::PATCH, "/api/conversations/{mine}", 400);
    add("api patch: numeric title", patch().json(r#"{"title":5}"#));
    add(
        "api patch: NaN temperature",
        patch().json(r#"{"temperature":"NaN"}"#),
    );
    add(
        "api patch: unknown field",
        patch().json(r#"{"owner":"someone-else"}"#),
    );
    add("api patch: malformed JSON", patch().json(r#"{"title":"#));
    add(
        "api patch: system prompt that cannot fit",
        patch().json_value(json!({"system_prompt": "word ".repeat(6000)})),
    );

    // ---- JSON API: ids, owners, methods ----
    add(
        "api get: other owner's conversation",
        case("", M::GET, "/api/conversations/{theirs}", 404),
    );
    add(
        "api patch: other owner's conversation",
        case("", M::PATCH, "/api/conversations/{theirs}", 404).json(r#"{"title":"x"}"#),
    );
    add(
        "api delete: other owner's conversation",
        case("", M::DELETE, "/api/conversations/{theirs}", 404),
    );
    add(
        "api send: other owner's conversation",
        case("", M::POST, "/api/conversations/{theirs}/messages", 404).json(r#"{"content":"hi"}"#),
    );
    add(
        "api stop: other owner's conversation",
        case("", M::POST, "/api/conversations/{theirs}/stop", 404),
    );
    add(
        "sse: other owner's conversation",
        case("", M::GET, "/api/conversations/{theirs}/events", 404),
    );
    add(
        "sse: unknown id",
        case(
            "",
            M::GET,
            "/api/conversations/01a20000-0000-7000-8000-000000000000/events",
            404,
        ),
    );
    add(
        "sse: not an id",
        case("", M::GET, "/api/conversations/nope/events", 400),
    );
    add(
        "sse: after that is not a message id",
        case(
            "",
            M::GET,
            "/api/conversations/{mine}/events?after=nope",
            400,
        ),
    );
    add(
        "sse: after a message of no conversation of ours",
        case(
            "",
            M::GET,
            "/api/conversations/{mine}/events?after=01a20000-0000-7000-8000-000000000000",
            400,
        ),
    );
    // ---- Files: hostile documents (each read by the sandboxed reader, refused with 400) ----
    let upload = |name: &str, bytes: Vec<u8>| {
        case(
            "",
            M::POST,
            &format!("/api/conversations/{{mine}}/files?name={name}"),
            400,
        )
        .raw("application/octet-stream", bytes)
    };
    add(
        "api files: a PDF whose form draws itself",
        upload("loop.pdf", common::pdf::self_drawing_form()),
    );
    add(
        "api files: a PDF of arrays nested 200,000 deep",
        upload("nested.pdf", common::pdf::nested_arrays(200_000)),
    );
    add(
        "api files: a PDF that inflates to 8 MiB of text",
        upload("bomb.pdf", common::pdf::inflating(8 << 20)),
    );
    add(
        "api files: a truncated PDF",
        upload("cut.pdf", common::pdf::text("cut short")[..120].to_vec()),
    );
    add(
        "api files: a name with a right-to-left override",
        upload("report%E2%80%AEfdp.txt", b"hello".to_vec()),
    );
    let file_part = |name: &str, bytes: &[u8]| {
        use base64::Engine as _;
        chat(json!({"messages": [{"role": "user", "content": [
            {"type": "file", "file": {"filename": name,
                "file_data": base64::engine::general_purpose::STANDARD.encode(bytes)}},
            {"type": "text", "text": "Summarise"}]}]}))
    };
    add(
        "v1 files: a PDF whose form draws itself",
        file_part("loop.pdf", &common::pdf::self_drawing_form()),
    );
    add(
        "v1 files: a PDF of arrays nested 200,000 deep",
        file_part("nested.pdf", &common::pdf::nested_arrays(200_000)),
    );
    add(
        "api get: not an id",
        case("", M::GET, "/api/conversations/not-a-uuid", 400),
    );
    add(
        "api get: encoded traversal",
        case("", M::GET, "/api/conversations/..%2f..%2fetc%2fpasswd", 400),
    );
    add(
        "api get: forged cookie",
        case("", M::GET, "/api/conversations/{mine}", 404)
            .header("cookie", "smolchat_owner=forged-value")
            .nobody(),
    );
    add("api: unknown route", case("", M::GET, "/api/nope", 404));
    add(
        "api: PUT on the collection",
        case("", M::PUT, "/api/conversations", 405),
    );
    add(
        "api: DELETE on the collection",
        case("", M::DELETE, "/api/conversations", 405),
    );
    add(
        "api: GET on messages",
        case("", M::GET, "/api/conversations/{mine}/messages", 405),
    );
    add(
        "api list: 201-character query",
        case(
            "",
            M::GET,
            &format!("/api/conversations?q={}", "q".repeat(201)),
            400,
        ),
    );
    add(
        "api: cross-site Origin",
        create()
            .json("{}")
            .header("origin", "http://evil.example")
            .no_csrf()
            .tap(403),
    );
    add(
        "api: Sec-Fetch-Site cross-site",
        create()
            .json("{}")
            .header("sec-fetch-site", "cross-site")
            .no_csrf()
            .tap(403),
    );

    // ---- Pages ----
    add(
        "page send: no CSRF token",
        case("", M::POST, "/c/{mine}/messages", 403)
            .form("content=hi")
            .no_csrf(),
    );
    add(
        "page send: wrong CSRF token",
        case("", M::POST, "/c/{mine}/messages", 403)
            .form("content=hi")
            .header("x-csrf-token", "AAAA")
            .no_csrf(),
    );
    add(
        "page send: JSON instead of a form",
        case("", M::POST, "/c/{mine}/messages", 415).json(r#"{"content":"hi"}"#),
    );
    add(
        "page send: empty content",
        case("", M::POST, "/c/{mine}/messages", 400).form("content="),
    );
    add(
        "page send: missing field",
        case("", M::POST, "/c/{mine}/messages", 400).form("text=hi"),
    );
    add(
        "page send: field given twice",
        case("", M::POST, "/c/{mine}/messages", 400).form("content=a&content=b"),
    );
    add(
        "page send: other owner's conversation",
        case("", M::POST, "/c/{theirs}/messages", 404).form("content=hi"),
    );
    add(
        "page settings: max_tokens -1",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=0.5&top_p=0.9&max_tokens=-1"),
    );
    add(
        "page settings: temperature abc",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=abc&top_p=0.9&max_tokens=10"),
    );
    add(
        "page settings: top_p 0",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=0.5&top_p=0&max_tokens=10"),
    );
    add(
        "page settings: top_p 2",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=0.5&top_p=2&max_tokens=10"),
    );
    add(
        "page settings: negative temperature",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=&temperature=-1&top_p=0.9&max_tokens=10"),
    );
    add(
        "page settings: NUL in system prompt",
        case("", M::POST, "/c/{mine}/settings", 400)
            .form("system_prompt=a%00b&temperature=0.5&top_p=0.9&max_tokens=10"),
    );
    add(
        "page edit: nothing to edit yet",
        case("", M::POST, "/c/{mine}/edit", 400).form("content=new"),
    );
    add(
        "page regenerate: nothing to regenerate",
        case("", M::POST, "/c/{mine}/regenerate", 400).form(""),
    );
    add(
        "page send: content over the limit",
        case("", M::POST, "/c/{mine}/messages", 413)
            .form(&format!("content={}", "x".repeat(40_000))),
    );
    add(
        "page rename: other owner's conversation",
        case("", M::POST, "/c/{theirs}/rename", 404).form("title=x"),
    );
    add(
        "page thinking: junk value",
        case("", M::POST, "/c/{mine}/thinking", 400).form("thinking=maybe"),
    );
    add(
        "page: other owner's conversation",
        case("", M::GET, "/c/{theirs}", 404),
    );
    add("page: not an id", case("", M::GET, "/c/not-a-uuid", 400));
    add(
        "page: delete other owner's",
        case("", M::DELETE, "/c/{theirs}", 404),
    );
    add(
        "page: message not an id",
        case("", M::GET, "/c/{mine}/m/not-a-uuid", 400),
    );
    // ---- versions and share links ----
    add(
        "page select: other owner's conversation",
        case("", M::POST, "/c/{theirs}/select", 404)
            .form("message=0190a6f4-0000-7000-8000-000000000001"),
    );
    add(
        "page select: not a message id",
        case("", M::POST, "/c/{mine}/select", 400).form("message=junk"),
    );
    add(
        "page select: a message of no conversation of ours",
        case("", M::POST, "/c/{mine}/select", 404)
            .form("message=0190a6f4-0000-7000-8000-000000000001"),
    );
    add(
        "api select: other owner's",
        case("", M::POST, "/api/conversations/{theirs}/select", 404)
            .json(r#"{"message_id":"0190a6f4-0000-7000-8000-000000000001"}"#),
    );
    add(
        "api select: not a uuid",
        case("", M::POST, "/api/conversations/{mine}/select", 400).json(r#"{"message_id":"x"}"#),
    );
    add(
        "api edit: an unknown field",
        case("", M::POST, "/api/conversations/{mine}/edit", 400)
            .json(r#"{"content":"x","messageid":"y"}"#),
    );
    add(
        "api tools decide: nothing waits for a decision",
        case("", M::POST, "/api/conversations/{mine}/tools/decide", 409)
            .json(r#"{"message_id":"0190f5c2-7d5e-7000-8000-000000000000","step":0,"allow":true}"#),
    );
    add(
        "api tools decide: other owner's conversation",
        case("", M::POST, "/api/conversations/{theirs}/tools/decide", 404)
            .json(r#"{"message_id":"0190f5c2-7d5e-7000-8000-000000000000","step":0,"allow":true}"#),
    );
    add(
        "api tools decide: allow is not a boolean",
        case("", M::POST, "/api/conversations/{mine}/tools/decide", 400).json(
            r#"{"message_id":"0190f5c2-7d5e-7000-8000-000000000000","step":0,"allow":"yes"}"#,
        ),
    );
    add(
        "page tools decide: neither allow nor deny",
        case("", M::POST, "/c/{mine}/tools/decide", 400)
            .form("message=0190f5c2-7d5e-7000-8000-000000000000&step=0&decision=maybe"),
    );
    add(
        "page tools decide: step not a number",
        case("", M::POST, "/c/{mine}/tools/decide", 400)
            .form("message=0190f5c2-7d5e-7000-8000-000000000000&step=one&decision=allow"),
    );
    add(
        "api patch: a tool that is not one",
        case("", M::PATCH, "/api/conversations/{mine}", 400).json(r#"{"tools":["rm -rf"]}"#),
    );
    add(
        "api patch: tool_choice among no tools",
        case("", M::PATCH, "/api/conversations/{mine}", 400)
            .json(r#"{"tools":[],"tool_choice":"calculator"}"#),
    );
    add(
        "api regenerate: message_id not a uuid",
        case(
            "",
            M::POST,
            "/api/conversations/{mine}/regenerate?message_id=x",
            400,
        )
        .json("{}"),
    );
    add(
        "page share: other owner's conversation",
        case("", M::POST, "/c/{theirs}/share", 404).form(""),
    );
    add(
        "page share: nothing to share yet",
        case("", M::POST, "/c/{mine}/share", 400).form(""),
    );
    add(
        "api shares: other owner's",
        case("", M::GET, "/api/conversations/{theirs}/shares", 404),
    );
    add(
        "api shares: make one of other owner's",
        case("", M::POST, "/api/conversations/{theirs}/shares", 404).json("{}"),
    );
    add(
        "api shares: revoke, not a uuid",
        case("", M::DELETE, "/api/conversations/{mine}/shares/x", 400),
    );
    add(
        "api shares: revoke one that is none",
        case(
            "",
            M::DELETE,
            "/api/conversations/{mine}/shares/0190a6f4-0000-7000-8000-000000000001",
            404,
        ),
    );
    add(
        "share page: a made-up token",
        case("", M::GET, &format!("/s/{}", "a".repeat(64)), 404),
    );
    add("share page: junk", case("", M::GET, "/s/%00%ff..", 404));
    add(
        "share page: POST",
        case("", M::POST, &format!("/s/{}", "a".repeat(64)), 405),
    );
    add(
        "page list: 201-character query",
        case(
            "",
            M::GET,
            &format!("/conversations?q={}", "q".repeat(201)),
            400,
        ),
    );
    add("page: PUT /", case("", M::PUT, "/", 405));
    add(
        "static: traversal",
        case("", M::GET, "/static/../../Cargo.toml", 404),
    );
    add(
        "static: encoded traversal",
        case("", M::GET, "/static/%2e%2e/%2e%2e/Cargo.toml", 404),
    );
    add(
        "static: unknown file",
        case("", M::GET, "/static/nope.js", 404),
    );

    // ---- /v1 ----
    add(
        "v1: no key",
        chat(json!({"messages": msgs()})).tap(401).strip_auth(),
    );
    add(
        "v1: wrong key",
        case("", M::POST, "/v1/chat/completions", 401)
            .bearer("sk-wrong")
            .json_value(json!({"messages": msgs()})),
    );
    add(
        "v1: malformed JSON",
        case("", M::POST, "/v1/chat/completions", 400)
            .bearer(API_KEY)
            .json("{\"messages\":"),
    );
    add("v1: messages missing", chat(json!({})));
    add("v1: messages empty", chat(json!({"messages": []})));
    add("v1: messages not an array", chat(json!({"messages": "hi"})));
    add(
        "v1: unknown role",
        chat(json!({"messages": [{"role": "wizard", "content": "hi"}]})),
    );
    add(
        "v1: numeric content",
        chat(json!({"messages": [{"role": "user", "content": 5}]})),
    );
    add(
        "v1: NUL in content",
        chat(json!({"messages": [{"role": "user", "content": "a\u{0}b"}]})),
    );
    add(
        "v1: string temperature",
        chat(json!({"messages": msgs(), "temperature": "hot"})),
    );
    add(
        "v1: negative temperature",
        chat(json!({"messages": msgs(), "temperature": -1})),
    );
    add(
        "v1: max_tokens 0",
        chat(json!({"messages": msgs(), "max_tokens": 0})),
    );
    add(
        "v1: negative max_tokens",
        chat(json!({"messages": msgs(), "max_tokens": -1})),
    );
    add("v1: n = 9", chat(json!({"messages": msgs(), "n": 9})));
    add("v1: n = 0", chat(json!({"messages": msgs(), "n": 0})));
    add(
        "v1: non-numeric logit_bias key",
        chat(json!({"messages": msgs(), "logit_bias": {"abc": 1}})),
    );
    add(
        "v1: non-numeric logit_bias value",
        chat(json!({"messages": msgs(), "logit_bias": {"5": "x"}})),
    );
    add(
        "v1: tools not an array",
        chat(json!({"messages": msgs(), "tools": "all"})),
    );
    add(
        "v1: 200 tools",
        chat(
            json!({"messages": msgs(), "tools": (0..200).map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": {}}})).collect::<Vec<_>>()}),
        ),
    );
    add(
        "v1: stop not a string",
        chat(json!({"messages": msgs(), "stop": 5})),
    );
    add(
        "v1: top_p above 1",
        chat(json!({"messages": msgs(), "top_p": 3})),
    );
    add(
        "v1: stream not a bool",
        chat(json!({"messages": msgs(), "stream": "yes"})),
    );
    add(
        "v1: context overflow",
        chat(json!({"messages": [{"role": "user", "content": "word ".repeat(12_000)}]})),
    );
    add(
        "v1: unknown model",
        chat(json!({"messages": msgs(), "model": "gpt-9"})).tap(404),
    );
    add(
        "v1: response_format of an unknown type",
        chat(json!({"messages": msgs(), "response_format": {"type": "yaml"}})),
    );
    add(
        "v1: a json_schema without its schema object",
        chat(json!({"messages": msgs(),
            "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}})),
    );
    add(
        "v1: a schema that is not a schema",
        chat(json!({"messages": msgs(),
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}})),
    );
    let mut recursive = json!({"$ref": "#/$defs/a"});
    recursive["$defs"] = json!({"a": {"$ref": "#/$defs/a"}});
    add(
        "v1: a schema that refers to itself forever",
        chat(json!({"messages": msgs(),
            "response_format": {"type": "json_schema", "json_schema": {"schema": recursive}}})),
    );
    add(
        "v1: a Lark grammar that does not parse",
        chat(json!({"messages": msgs(), "guided_grammar": "start: ((("})),
    );
    add(
        "v1: a regex that does not parse",
        chat(json!({"messages": msgs(), "guided_regex": "(["})),
    );
    add(
        "v1: a Lark grammar that can never end",
        chat(json!({"messages": msgs(), "guided_grammar": "start: x\nx: \"ab\" x"})),
    );
    add(
        "v1: a GBNF grammar that can never end",
        chat(json!({"messages": msgs(), "grammar": "root ::= x\nx ::= \"ab\" x"})),
    );
    add(
        "v1: two grammar fields",
        chat(json!({"messages": msgs(), "guided_regex": "a+", "json_schema": {"type": "object"}})),
    );
    add(
        "v1: a GBNF grammar with an unclosed literal",
        chat(json!({"messages": msgs(), "grammar": "root ::= \"a"})),
    );
    add(
        "v1: a GBNF grammar without root",
        chat(json!({"messages": msgs(), "grammar": "expr ::= \"a\""})),
    );
    add(
        "v1: a GBNF grammar whose rule refers to nothing",
        chat(json!({"messages": msgs(), "grammar": "root ::= nowhere"})),
    );
    add(
        "v1: text/plain body",
        case("", M::POST, "/v1/chat/completions", 415)
            .bearer(API_KEY)
            .raw("text/plain", b"{}".to_vec()),
    );
    // Chat requests may carry a file of `limits.max_file_mib` (10) as base64 beside their
    // text, so their body limit is past 13 MB (16 MB is over it); a body without a file part
    // keeps the limit of every other JSON body (2 MB is over it).
    add(
        "v1: 16 MB body",
        case("", M::POST, "/v1/chat/completions", 413)
            .bearer(API_KEY)
            .json(&format!(
                "{{\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
                "a".repeat(16 << 20)
            )),
    );
    add(
        "v1: 2 MB of text",
        case("", M::POST, "/v1/chat/completions", 413)
            .bearer(API_KEY)
            .json(&format!(
                "{{\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
                "a".repeat(2 << 20)
            )),
    );
    add(
        "v1: a file part with file_id",
        case("", M::POST, "/v1/chat/completions", 400).bearer(API_KEY).json(
            r#"{"messages":[{"role":"user","content":[{"type":"file","file":{"file_id":"file-1"}}]}]}"#,
        ),
    );
    add(
        "v1: a file part that is not base64",
        case("", M::POST, "/v1/chat/completions", 400).bearer(API_KEY).json(
            r#"{"messages":[{"role":"user","content":[{"type":"file","file":{"filename":"a.txt","file_data":"%%%"}}]}]}"#,
        ),
    );
    add(
        "v1: an executable file part",
        case("", M::POST, "/v1/chat/completions", 400).bearer(API_KEY).json(
            r#"{"messages":[{"role":"user","content":[{"type":"file","file":{"filename":"a.txt","file_data":"f0VMRgIBAQ=="}}]}]}"#,
        ),
    );
    add(
        "v1: a file part in a system message",
        case("", M::POST, "/v1/chat/completions", 400).bearer(API_KEY).json(
            r#"{"messages":[{"role":"system","content":[{"type":"file","file":{"filename":"a.txt","file_data":"aGk="}}]}]}"#,
        ),
    );
    add(
        "v1: GET on chat completions",
        case("", M::GET, "/v1/chat/completions", 405).bearer(API_KEY),
    );
    add(
        "v1 completions: prompt missing",
        case("", M::POST, "/v1/completions", 400)
            .bearer(API_KEY)
            .json("{}"),
    );
    add(
        "v1 completions: numeric prompt",
        case("", M::POST, "/v1/completions", 400)
            .bearer(API_KEY)
            .json(r#"{"prompt":5}"#),
    );
    add(
        "v1 models: unknown id",
        case("", M::GET, "/v1/models/nope", 404).bearer(API_KEY),
    );
    add(
        "v1 models: a file path",
        case("", M::GET, "/v1/models/%2Fetc%2Fpasswd", 404).bearer(API_KEY),
    );

    // ---- Admin (no session) ----
    add(
        "admin login: wrong token",
        case("", M::POST, "/admin/login", 401).form("token=wrong"),
    );
    add(
        "admin login: no CSRF token",
        case("", M::POST, "/admin/login", 403)
            .form(&format!("token={ADMIN_TOKEN}"))
            .no_csrf(),
    );
    add(
        "admin live: no session",
        case("", M::GET, "/admin/live", 401),
    );
    add(
        "admin stop: no session",
        case("", M::POST, "/admin/c/{mine}/stop", 401).form(""),
    );
    add(
        "admin evict: no session",
        case("", M::POST, "/admin/c/{mine}/evict", 401).form(""),
    );
    add(
        "admin delete: no session",
        case("", M::DELETE, "/admin/c/{mine}", 401),
    );
    add(
        "admin: forged session cookie",
        case("", M::GET, "/admin/live", 401)
            .header("cookie", "smolchat_admin=admin-v1")
            .nobody(),
    );

    // ---- Operations, protocol ----
    add("metrics: no token", case("", M::GET, "/metrics", 401));
    add(
        "metrics: wrong token",
        case("", M::GET, "/metrics", 401).bearer("scrape-wrong"),
    );
    add(
        "metrics: the API key is not the metrics token",
        case("", M::GET, "/metrics", 401).bearer(API_KEY),
    );
    add("ops: POST /healthz", case("", M::POST, "/healthz", 405));
    add(
        "http: 20 KB URL",
        case("", M::GET, &format!("/c/{}", "a".repeat(20_000)), 414),
    );
    // ---- issue 21: imports, cross-site requests, content types, forged headers, hosts ----
    let import = || case("", M::POST, "/api/conversations/import", 400);
    let doc = |messages: Value| {
        json!({"format": "smolchat.conversation", "version": 1, "title": "t",
               "settings": {}, "messages": messages})
    };
    let user = json!({"role": "user", "content": "hi", "status": "complete",
                      "created_at": "2026-01-01T00:00:00Z"});
    let reply = |extra: Value| {
        let mut m = json!({"role": "assistant", "content": "ok", "status": "complete",
                           "created_at": "2026-01-01T00:00:01Z"});
        if let (Some(m), Some(extra)) = (m.as_object_mut(), extra.as_object()) {
            m.extend(extra.clone());
        }
        m
    };
    add(
        "import: prompt_tokens 6e18",
        import().json_value(doc(json!([
            user,
            reply(json!({"prompt_tokens": 6_000_000_000_000_000_000i64}))
        ]))),
    );
    add(
        "import: completion_tokens past the bound",
        import().json_value(doc(json!([
            user,
            reply(json!({"completion_tokens": 2_147_483_648i64}))
        ]))),
    );
    add(
        "import: cached_tokens beyond 64 bits",
        import().json(&doc(json!([user, reply(json!({}))])).to_string().replace(
            "\"content\":\"ok\"",
            "\"content\":\"ok\",\"cached_tokens\":100000000000000000000",
        )),
    );
    add(
        "import: negative prompt_tokens",
        import().json_value(doc(json!([user, reply(json!({"prompt_tokens": -1}))]))),
    );
    add(
        "import: more messages than allowed",
        import()
            .json_value(doc(Value::Array(vec![user.clone(); 51])))
            .tap(413),
    );
    add(
        "import: more text than the context window holds",
        import()
            .json_value(doc(json!([
                user,
                reply(json!({"content": "x".repeat(30_000)})),
                user,
                reply(json!({"content": "y".repeat(30_000)})),
                user,
                reply(json!({"content": "z".repeat(30_000)})),
            ])))
            .tap(413),
    );
    add(
        "import: NUL in a reply",
        import().json_value(doc(json!([user, reply(json!({"content": "a\u{0}b"}))]))),
    );
    add(
        "import: a system message",
        import().json_value(doc(
            json!([{"role": "system", "content": "x", "status": "complete",
                                        "created_at": "2026-01-01T00:00:00Z"}]),
        )),
    );
    add(
        "import: a streaming user message",
        import().json_value(doc(
            json!([{"role": "user", "content": "x", "status": "streaming",
                                        "created_at": "2026-01-01T00:00:00Z"}]),
        )),
    );
    add(
        "import: messages not an array",
        import().json_value(doc(json!({"role": "user"}))),
    );
    add(
        "import: no body",
        import().raw("application/json", Vec::new()),
    );
    add(
        "import: text/plain",
        import().raw("text/plain", b"{}".to_vec()).tap(415),
    );
    add(
        "import: another format",
        import().json_value(json!({"format": "chatgpt", "version": 1, "title": "t",
                                   "settings": {}, "messages": []})),
    );
    add(
        "import: a bad time",
        import().json_value(doc(
            json!([{"role": "user", "content": "x", "status": "complete",
                                        "created_at": "yesterday"}]),
        )),
    );
    // Cross-site requests on every state-changing route of the JSON API (no CSRF token, as a
    // page elsewhere sends them) and of the pages (no token can be sent cross-site).
    for (method, path, body) in [
        (M::POST, "/api/conversations", "{}"),
        (M::PATCH, "/api/conversations/{mine}", r#"{"title":"x"}"#),
        (M::DELETE, "/api/conversations/{mine}", ""),
        (
            M::POST,
            "/api/conversations/{mine}/messages",
            r#"{"content":"hi"}"#,
        ),
        (M::POST, "/api/conversations/{mine}/stop", ""),
        (M::POST, "/api/conversations/{mine}/regenerate", ""),
        (
            M::POST,
            "/api/conversations/{mine}/edit",
            r#"{"content":"hi"}"#,
        ),
        (M::POST, "/api/conversations/import", "{}"),
    ] {
        add(
            &format!("cross-site: {method} {path}"),
            case("", method, path, 403)
                .no_csrf()
                .json(body)
                .header("origin", "https://evil.example")
                .header("sec-fetch-site", "cross-site"),
        );
    }
    for (method, path, body) in [
        (M::POST, "/c", ""),
        (M::DELETE, "/c/{mine}", ""),
        (M::POST, "/c/{mine}/rename", "title=x"),
        (M::POST, "/c/{mine}/settings", "temperature=1"),
        (M::POST, "/c/{mine}/thinking", "thinking=false"),
        (M::POST, "/c/{mine}/stop", ""),
        (M::POST, "/signout", ""),
        (M::POST, "/account/keys", "name=x"),
        (M::POST, "/account/password", "current=a&new=b"),
        (M::POST, "/admin/logout", ""),
    ] {
        add(
            &format!("cross-site page: {method} {path}"),
            case("", method, path, 403)
                .no_csrf()
                .form(body)
                .header("origin", "https://evil.example")
                .header("sec-fetch-site", "cross-site"),
        );
    }
    // A name far past any account name: refused like any wrong name (the audit row it leaves
    // is cut to an account name's length: tests/audit.rs).
    let huge_name = format!("name={}&password=guess", "n".repeat(204_800));
    add(
        "signin: a 200 KB name",
        case("", M::POST, "/signin", 401).form(&huge_name),
    );
    add("api patch: a form body", patch().form("title=x").tap(415));
    add(
        "api edit: text/plain",
        case("", M::POST, "/api/conversations/{mine}/edit", 415)
            .raw("text/plain", b"{\"content\":\"x\"}".to_vec()),
    );
    add(
        "page rename: a JSON body",
        case("", M::POST, "/c/{mine}/rename", 415).json(r#"{"title":"x"}"#),
    );
    // A forwarding header no replica signed: ignored, the request is answered here as usual.
    add(
        "forged forward: another owner's conversation",
        case("", M::POST, "/api/conversations/{theirs}/messages", 404)
            .json(r#"{"content":"hi"}"#)
            .header(
                "x-smolchat-forwarded-by",
                "0190a6f4-0000-7000-8000-000000000009",
            ),
    );
    add(
        "forged forward: a bad body still refused here",
        send()
            .json(r#"{"content":""}"#)
            .header("x-smolchat-forwarded-by", "v1;x;203.0.113.1;1;0;00"),
    );
    add(
        "forged forwarded-for: not a proxy of ours",
        send()
            .json(r#"{"content":5}"#)
            .header("x-forwarded-for", "203.0.113.1"),
    );
    // Unknown bearers on /v1 (a key is configured).
    add(
        "v1: an unknown personal key",
        chat(json!({"messages": msgs()}))
            .strip_auth()
            .bearer(&format!("sk-smol-{}", "0".repeat(64)))
            .tap(401),
    );
    add(
        "v1: a made-up bearer",
        case("", M::GET, "/v1/models", 401).bearer("made-up-key"),
    );
    add(
        "v1: basic auth instead of a bearer",
        case("", M::GET, "/v1/models", 401).header("authorization", "Basic dXNlcjpwYXNz"),
    );
    // Bad `before` cursors and limits.
    add(
        "api list: a before that is no cursor",
        case("", M::GET, "/api/conversations?before=garbage", 400),
    );
    add(
        "api list: a before with a huge time",
        case("", M::GET, "/api/conversations?before=99999999999999999999999_0190a6f4-0000-7000-8000-000000000001", 400),
    );
    add(
        "api list: limit 0",
        case("", M::GET, "/api/conversations?limit=0", 400),
    );
    add(
        "api list: limit 201",
        case("", M::GET, "/api/conversations?limit=201", 400),
    );
    add(
        "page list: a before that is no cursor",
        case("", M::GET, "/conversations?before=%00", 400),
    );
    // ---- the Responses API ----
    let responses = |body: Value| {
        case("", M::POST, "/v1/responses", 400)
            .bearer(API_KEY)
            .json_value(body)
    };
    add(
        "responses: no key",
        responses(json!({"input": "hi"})).tap(401).strip_auth(),
    );
    add("responses: input missing", responses(json!({})));
    add("responses: input a number", responses(json!({"input": 3})));
    add(
        "responses: previous_response_id",
        responses(json!({"input": "hi", "previous_response_id": "resp_1"})),
    );
    add(
        "responses: an image part",
        responses(json!({"input": [{"role": "user",
            "content": [{"type": "input_image", "image_url": "http://x"}]}]})),
    );
    add(
        "responses: an unknown item type",
        responses(json!({"input": [{"type": "computer_call"}]})),
    );
    add(
        "responses: a function_call without call_id",
        responses(json!({"input": [{"type": "function_call", "name": "f"}]})),
    );
    add(
        "responses: a hosted tool",
        responses(json!({"input": "hi", "tools": [{"type": "web_search"}]})),
    );
    add(
        "responses: a text format of an unknown type",
        responses(json!({"input": "hi", "text": {"format": {"type": "yaml"}}})),
    );
    add(
        "responses: a schema that allows nothing",
        responses(
            json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
            "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}),
        ),
    );
    add(
        "responses: unknown field",
        responses(json!({"input": "hi", "warp": 9})),
    );
    add(
        "responses: GET",
        case("", M::GET, "/v1/responses", 405).bearer(API_KEY),
    );
    let unknown = "resp_0190a6f4000070008000000000000001";
    add(
        "responses: previous_response_id unknown",
        responses(json!({"input": "hi", "previous_response_id": unknown})).tap(404),
    );
    add(
        "responses: previous_response_id not a string",
        responses(json!({"input": "hi", "previous_response_id": 7})),
    );
    add(
        "responses: store not a boolean",
        responses(json!({"input": "hi", "store": "yes"})),
    );
    add(
        "responses: retrieve an id that is none",
        case("", M::GET, "/v1/responses/abc", 400).bearer(API_KEY),
    );
    add(
        "responses: retrieve an unknown response",
        case("", M::GET, &format!("/v1/responses/{unknown}"), 404).bearer(API_KEY),
    );
    add(
        "responses: delete an unknown response",
        case("", M::DELETE, &format!("/v1/responses/{unknown}"), 404).bearer(API_KEY),
    );
    add(
        "responses: retrieve without a key",
        case("", M::GET, &format!("/v1/responses/{unknown}"), 401),
    );
    add(
        "responses: PUT a response",
        case("", M::PUT, &format!("/v1/responses/{unknown}"), 405).bearer(API_KEY),
    );

    // ---- embeddings ----
    let embeddings = |body: Value, status: u16| {
        case("", M::POST, "/v1/embeddings", status)
            .bearer(API_KEY)
            .json_value(body)
    };
    add(
        "embeddings: no key",
        embeddings(json!({"input": "hi"}), 401).strip_auth(),
    );
    add("embeddings: input missing", embeddings(json!({}), 400));
    add(
        "embeddings: input empty",
        embeddings(json!({"input": []}), 400),
    );
    add(
        "embeddings: an empty string",
        embeddings(json!({"input": [""]}), 400),
    );
    add(
        "embeddings: input an object",
        embeddings(json!({"input": {"a": 1}}), 400),
    );
    add(
        "embeddings: mixed array",
        embeddings(json!({"input": ["a", 1]}), 400),
    );
    add(
        "embeddings: a negative token id",
        embeddings(json!({"input": [[-1]]}), 400),
    );
    add(
        "embeddings: a token id beyond the vocabulary",
        embeddings(json!({"input": [49152]}), 400),
    );
    add(
        "embeddings: 257 inputs",
        embeddings(json!({"input": vec!["x"; 257]}), 400),
    );
    add(
        "embeddings: longer than the context window",
        embeddings(json!({"input": "word ".repeat(9000)}), 400),
    );
    add(
        "embeddings: dimensions",
        embeddings(json!({"input": "hi", "dimensions": 8}), 400),
    );
    add(
        "embeddings: an unknown encoding",
        embeddings(json!({"input": "hi", "encoding_format": "int8"}), 400),
    );
    add(
        "embeddings: an unknown pooling",
        embeddings(json!({"input": "hi", "pooling": "cls"}), 400),
    );
    add(
        "embeddings: another model",
        embeddings(json!({"input": "hi", "model": "gpt-4"}), 404),
    );
    add("embeddings: not an object", embeddings(json!("hi"), 400));
    add(
        "embeddings: GET",
        case("", M::GET, "/v1/embeddings", 405).bearer(API_KEY),
    );

    // ---- the Anthropic Messages API (`{"type": "error", "error": {…}}` answers) ----
    let messages = |body: Value, status: u16| {
        case("", M::POST, "/v1/messages", status)
            .header("x-api-key", API_KEY)
            .json_value(body)
    };
    let hi = || json!([{"role": "user", "content": "Hi"}]);
    add(
        "anthropic: no key",
        case("", M::POST, "/v1/messages", 401)
            .json_value(json!({"max_tokens": 4, "messages": hi()})),
    );
    add(
        "anthropic: wrong key",
        case("", M::POST, "/v1/messages", 401)
            .header("x-api-key", "sk-wrong")
            .json_value(json!({"max_tokens": 4, "messages": hi()})),
    );
    add(
        "anthropic: malformed JSON",
        case("", M::POST, "/v1/messages", 400)
            .header("x-api-key", API_KEY)
            .json("{\"messages\":"),
    );
    add("anthropic: not an object", messages(json!("hi"), 400));
    add(
        "anthropic: max_tokens missing",
        messages(json!({"messages": hi()}), 400),
    );
    add(
        "anthropic: max_tokens 0",
        messages(json!({"max_tokens": 0, "messages": hi()}), 400),
    );
    add(
        "anthropic: messages missing",
        messages(json!({"max_tokens": 4}), 400),
    );
    add(
        "anthropic: a system role in messages",
        messages(
            json!({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}),
            400,
        ),
    );
    for (name, block) in [
        (
            "an image block",
            json!({"type": "image", "source": {"type": "base64", "data": "aGk="}}),
        ),
        ("an unknown block", json!({"type": "hologram"})),
        ("a block without a type", json!({"text": "x"})),
        ("a text block without text", json!({"type": "text"})),
        (
            "a tool_result without its id",
            json!({"type": "tool_result", "content": "x"}),
        ),
        (
            "a tool_use in a user message",
            json!({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
        ),
    ] {
        add(
            &format!("anthropic: {name}"),
            messages(
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}),
                400,
            ),
        );
    }
    add(
        "anthropic: tool_choice naming a tool not offered",
        messages(
            json!({"max_tokens": 4, "messages": hi(), "tool_choice": {"type": "tool", "name": "g"},
                "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
            400,
        ),
    );
    add(
        "anthropic: tool_choice any without tools",
        messages(
            json!({"max_tokens": 4, "messages": hi(), "tool_choice": {"type": "any"}}),
            400,
        ),
    );
    let mut deep = json!({"type": "string"});
    for _ in 0..500 {
        deep = json!({"type": "object", "properties": {"a": deep}});
    }
    add(
        "anthropic: a deeply nested tool schema",
        messages(
            json!({"max_tokens": 4, "messages": hi(), "tools": [{"name": "f", "input_schema": deep}]}),
            400,
        ),
    );
    add(
        "anthropic: thinking of an unknown type",
        messages(
            json!({"max_tokens": 4, "messages": hi(), "thinking": {"type": "maybe"}}),
            400,
        ),
    );
    add(
        "anthropic: an output format of an unknown type",
        messages(
            json!({"max_tokens": 4, "messages": hi(),
                "output_config": {"format": {"type": "xml"}}}),
            400,
        ),
    );
    add(
        "anthropic: an output schema that cannot be followed",
        messages(
            json!({"max_tokens": 4, "messages": hi(),
                "output_config": {"format": {"type": "json_schema",
                    "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}),
            400,
        ),
    );
    add(
        "anthropic: unknown field",
        messages(json!({"max_tokens": 4, "messages": hi(), "warp": 9}), 400),
    );
    add(
        "anthropic: 17 stop sequences",
        messages(
            json!({"max_tokens": 4, "messages": hi(),
                "stop_sequences": (0..17).map(|i| format!("s{i}")).collect::<Vec<_>>()}),
            400,
        ),
    );
    add(
        "anthropic: unknown model",
        messages(
            json!({"model": "claude-9", "max_tokens": 4, "messages": hi()}),
            404,
        ),
    );
    add(
        "anthropic: text/plain body",
        case("", M::POST, "/v1/messages", 415)
            .header("x-api-key", API_KEY)
            .raw("text/plain", b"{}".to_vec()),
    );
    add(
        "anthropic: 2 MB body",
        case("", M::POST, "/v1/messages", 413)
            .header("x-api-key", API_KEY)
            .json(&format!(
                "{{\"max_tokens\":4,\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
                "a".repeat(2 << 20)
            )),
    );
    add(
        "anthropic: GET on messages",
        case("", M::GET, "/v1/messages", 405).header("x-api-key", API_KEY),
    );
    // ---- the Ollama API (`{"error": "…"}` answers) ----
    let ollama = |path: &str, body: Value, status: u16| {
        case("", M::POST, path, status)
            .bearer(API_KEY)
            .json_value(body)
    };
    add(
        "ollama: no key",
        ollama("/api/chat", json!({"messages": msgs()}), 401).strip_auth(),
    );
    add(
        "ollama: wrong key",
        case("", M::GET, "/api/tags", 401).bearer("sk-wrong"),
    );
    add(
        "ollama embed: input missing",
        ollama("/api/embed", json!({}), 400),
    );
    add(
        "ollama embed: input a number",
        ollama("/api/embed", json!({"input": 3}), 400),
    );
    add(
        "ollama embed: token ids",
        ollama("/api/embed", json!({"input": [1, 2]}), 400),
    );
    add(
        "ollama embed: too long, not truncated",
        ollama(
            "/api/embed",
            json!({"input": "word ".repeat(9000), "truncate": false}),
            400,
        ),
    );
    add(
        "ollama embed: truncate not a boolean",
        ollama("/api/embed", json!({"input": "hi", "truncate": "yes"}), 400),
    );
    add(
        "ollama embed: another model",
        ollama("/api/embed", json!({"input": "hi", "model": "llama3"}), 404),
    );
    add(
        "ollama embeddings: prompt missing",
        ollama("/api/embeddings", json!({}), 400),
    );
    add(
        "ollama embeddings: prompt not a string",
        ollama("/api/embeddings", json!({"prompt": ["a"]}), 400),
    );
    add(
        "ollama: malformed JSON",
        case("", M::POST, "/api/chat", 400)
            .bearer(API_KEY)
            .json("{\"messages\":"),
    );
    add(
        "ollama: not an object",
        ollama("/api/chat", json!([1, 2]), 400),
    );
    add(
        "ollama: messages missing",
        ollama("/api/chat", json!({}), 400),
    );
    add(
        "ollama: messages not an array",
        ollama("/api/chat", json!({"messages": "hi"}), 400),
    );
    add(
        "ollama: unknown message field",
        ollama(
            "/api/chat",
            json!({"messages": [{"role": "user", "content": "x", "mood": 1}]}),
            400,
        ),
    );
    add(
        "ollama: images",
        ollama(
            "/api/chat",
            json!({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
            400,
        ),
    );
    add(
        "ollama: unknown model",
        ollama(
            "/api/chat",
            json!({"model": "llama9", "messages": msgs()}),
            404,
        ),
    );
    add(
        "ollama: format of the wrong type",
        ollama("/api/chat", json!({"messages": msgs(), "format": 42}), 400),
    );
    add(
        "ollama: a format schema with a dangling $ref",
        ollama(
            "/api/chat",
            json!({"messages": msgs(),
                "format": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}),
            400,
        ),
    );
    let huge: serde_json::Map<String, Value> = (0..9_000)
        .map(|i| (format!("field_{i}"), json!({"type": "string"})))
        .collect();
    add(
        "ollama: a format schema over the size limit",
        ollama(
            "/api/chat",
            json!({"messages": msgs(), "format": {"type": "object", "properties": huge}}),
            400,
        ),
    );
    add(
        "ollama: unknown option",
        ollama(
            "/api/chat",
            json!({"messages": msgs(), "options": {"warp": 9}}),
            400,
        ),
    );
    add(
        "ollama: mirostat",
        ollama(
            "/api/chat",
            json!({"messages": msgs(), "options": {"mirostat": 2}}),
            400,
        ),
    );
    add(
        "ollama: num_predict 0",
        ollama(
            "/api/chat",
            json!({"messages": msgs(), "options": {"num_predict": 0}}),
            400,
        ),
    );
    add(
        "ollama: options not an object",
        ollama("/api/chat", json!({"messages": msgs(), "options": 3}), 400),
    );
    add(
        "ollama: temperature out of range",
        ollama(
            "/api/chat",
            json!({"messages": msgs(), "options": {"temperature": 1e9}}),
            400,
        ),
    );
    add(
        "ollama: stream not a boolean",
        ollama(
            "/api/chat",
            json!({"messages": msgs(), "stream": "yes"}),
            400,
        ),
    );
    add(
        "ollama: think not a boolean",
        ollama(
            "/api/chat",
            json!({"messages": msgs(), "think": "maybe"}),
            400,
        ),
    );
    add(
        "ollama: text/plain body",
        case("", M::POST, "/api/chat", 415)
            .bearer(API_KEY)
            .raw("text/plain", b"{}".to_vec()),
    );
    add(
        "ollama: 2 MB body",
        case("", M::POST, "/api/generate", 413)
            .bearer(API_KEY)
            .json(&format!("{{\"prompt\":\"{}\"}}", "a".repeat(2 << 20))),
    );
    add(
        "ollama: GET on chat",
        case("", M::GET, "/api/chat", 405).bearer(API_KEY),
    );
    add(
        "ollama: POST on tags",
        case("", M::POST, "/api/tags", 405).bearer(API_KEY),
    );
    for (field, value) in [
        ("suffix", json!("}")),
        ("template", json!("{{ .Prompt }}")),
        ("context", json!([1, 2, 3])),
        ("images", json!(["aGk="])),
        ("prompt", json!(42)),
        ("raw", json!("yes")),
    ] {
        add(
            &format!("ollama generate: {field}"),
            ollama("/api/generate", json!({"prompt": "hi", field: value}), 400),
        );
    }
    add(
        "ollama generate: raw with a system prompt",
        ollama(
            "/api/generate",
            json!({"prompt": "hi", "raw": true, "system": "be brief"}),
            400,
        ),
    );
    add(
        "ollama show: unknown model",
        ollama("/api/show", json!({"model": "llama9"}), 404),
    );
    add(
        "ollama show: model not a string",
        ollama("/api/show", json!({"model": 7}), 400),
    );
    // Hosts this server does not answer for (DNS rebinding).
    for path in ["/v1/models", "/api/conversations", "/metrics", "/admin"] {
        add(
            &format!("host: {path} for another name"),
            case("", M::GET, path, 421)
                .bearer(API_KEY)
                .header("host", "rebind.attacker.example"),
        );
    }
    cases
}

/// The Ollama API's routes (their refusals are `{"error": "…"}`).
const OLLAMA_ROUTES: [&str; 8] = [
    "/api/chat",
    "/api/embed",
    "/api/embeddings",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/api/ps",
];

/// Sends every case to `server` and returns the problems: a status other than the expected
/// one, a 5xx, no message, JSON without `error.message`, or a JSON error without
/// `X-Content-Type-Options: nosniff`; answers of the JSON APIs must also say
/// `Cache-Control: no-store`.
async fn run_cases(
    server: &Server,
    me: &common::server::Client,
    token: &str,
    mine: &str,
    theirs: &str,
    cases: &[Case],
) -> Vec<String> {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let mut failures = Vec::new();
    for c in cases {
        let path = c.path.replace("{mine}", mine).replace("{theirs}", theirs);
        let mut headers = HeaderMap::new();
        if c.who == Who::Me {
            if let Some(cookie) = me.cookie() {
                headers.insert(COOKIE, HeaderValue::from_str(&cookie).expect("cookie"));
            }
            if c.csrf {
                headers.insert("x-csrf-token", HeaderValue::from_str(token).expect("token"));
            }
        }
        for (name, value) in &c.headers {
            let name = HeaderName::from_static(name);
            match HeaderValue::from_str(value) {
                Ok(v) => {
                    headers.insert(name, v);
                }
                Err(e) => panic!("{}: bad header value: {e}", c.name),
            }
        }
        let mut req = http
            .request(c.method.clone(), format!("{}{path}", server.base))
            .headers(headers)
            .timeout(std::time::Duration::from_secs(60));
        if let Some(body) = &c.body {
            req = req.body(body.clone());
        }
        let (status, answer_headers, text) = match req.send().await {
            Ok(resp) => {
                let status = resp.status();
                let headers = resp.headers().clone();
                (status, headers, resp.text().await.unwrap_or_default())
            }
            Err(e) => {
                failures.push(format!("{}: no answer ({e})", c.name));
                continue;
            }
        };
        let header = |name| {
            answer_headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        let content_type = header(CONTENT_TYPE.as_str());
        let is_json = content_type.starts_with("application/json");
        let api = path.starts_with("/api/") || path.starts_with("/v1/");
        // The Ollama API answers `{"error": "…"}`, every other JSON API `{"error": {"message"}}`.
        let ollama = OLLAMA_ROUTES.iter().any(|r| path == *r);
        let parsed = serde_json::from_str::<Value>(&text).ok();
        let message = parsed
            .as_ref()
            .and_then(|v| {
                v["error"]["message"]
                    .as_str()
                    .or(if ollama { v["error"].as_str() } else { None })
                    .map(str::to_string)
            })
            .unwrap_or_else(|| text.clone());
        let redirect = status.is_redirection();
        let problems: Vec<&str> = [
            (status.as_u16() != c.expect, "unexpected status"),
            (status.is_server_error(), "a 5xx"),
            (message.trim().is_empty() && !redirect, "no message"),
            (
                is_json && !ollama && !text.contains("\"message\""),
                "JSON without error.message",
            ),
            (
                is_json && ollama && !parsed.as_ref().is_some_and(|v| v["error"].is_string()),
                "an Ollama answer without a string `error`",
            ),
            (
                is_json
                    && path == "/v1/messages"
                    && !parsed
                        .as_ref()
                        .is_some_and(|v| v["type"] == "error" && v["error"]["type"].is_string()),
                "an Anthropic answer without `type: error` and `error.type`",
            ),
            (
                is_json && header("x-content-type-options") != "nosniff",
                "JSON without X-Content-Type-Options: nosniff",
            ),
            (
                is_json && api && header("cache-control") != "no-store",
                "an API answer without Cache-Control: no-store",
            ),
        ]
        .into_iter()
        .filter_map(|(bad, what)| bad.then_some(what))
        .collect();
        if !problems.is_empty() {
            let shown: String = message.chars().take(160).collect();
            failures.push(format!(
                "{}: {} (got {}, want {}): {shown}",
                c.name,
                problems.join(", "),
                status.as_u16(),
                c.expect
            ));
        }
    }
    failures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hostile_request_gets_a_clear_refusal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [
        ("SMOLCHAT_SERVER__API_KEY", API_KEY),
        ("SMOLCHAT_SERVER__ADMIN_TOKEN", ADMIN_TOKEN),
        ("SMOLCHAT_SERVER__METRICS_TOKEN", METRICS_TOKEN),
        ("SMOLCHAT_LIMITS__CONTEXT", "4096"),
        ("SMOLCHAT_LIMITS__MAX_IMPORT_MESSAGES", "50"),
        // Many wrong keys and tokens come from this one address on purpose.
        ("SMOLCHAT_AUTH__LOGIN_FREE_FAILURES_PER_ADDRESS", "1000"),
        ("SMOLCHAT_AUTH__LOGIN_FREE_FAILURES_PER_ACCOUNT", "1000"),
    ];
    let server = Server::start(dir.path(), &env).await;
    let me = server.client();
    let mine = me.create(json!({"temperature": 0, "max_tokens": 4})).await;
    let theirs = server.client().create(json!({})).await;
    let token = me.csrf_token().await;
    let http = reqwest::Client::new();
    // What is stored before: nothing the catalogue sends may add to it.
    let store = smolchat_store::Store::open_beside_server(&server.database_url)
        .await
        .expect("open the server's store");
    let stored_before = stored(&store).await;

    let cases = catalogue();
    let failures = run_cases(&server, &me, &token, &mine, &theirs, &cases).await;
    // The scraper with the token gets the metrics.
    let scrape = http
        .get(format!("{}/metrics", server.base))
        .bearer_auth(METRICS_TOKEN)
        .send()
        .await
        .expect("scrape");
    assert_eq!(scrape.status(), StatusCode::OK);
    assert!(scrape
        .text()
        .await
        .unwrap_or_default()
        .contains("smolchat_"));
    // Still healthy, and nothing panicked on the way.
    assert_eq!(me.get("/healthz").await.status, StatusCode::OK);
    let log = server.log_text();
    assert!(!log.contains("panicked"), "the server panicked:\n{log}");
    eprintln!(
        "{} hostile requests, {} refused as expected",
        cases.len(),
        cases.len() - failures.len()
    );
    assert!(
        cases.len() >= 140,
        "the catalogue shrank to {}",
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(
        stored(&store).await,
        stored_before,
        "a refused request changed what is stored"
    );
}

/// Conversations, messages, users and API keys stored now, with every conversation's title,
/// settings and number of files (a refused rename or settings change must leave them as they were).
async fn stored(store: &smolchat_store::Store) -> (usize, usize, Vec<String>) {
    let all = store.list_all_conversations().await.expect("list");
    let mut messages = 0;
    let mut described = Vec::new();
    for c in &all {
        messages += store.messages(c.id).await.expect("messages").len();
        let full = store
            .get_conversation(c.id)
            .await
            .expect("get")
            .expect("exists");
        // Files too: a refused upload stores none.
        let files = store.files_of(c.id).await.expect("files").len();
        described.push(format!(
            "{} {} {} files {files}",
            full.id,
            full.title,
            serde_json::to_string(&full.settings).expect("settings")
        ));
    }
    described.sort();
    (all.len(), messages, described)
}

/// With `auth.guests = false` no spelling of a path reaches a guest's data: percent-encoded
/// letters in the scope (`/%61pi`), in the page routes (`/%63`), doubled slashes, `/v1` without
/// a key or with a made-up one, HTMX requests. Every one is refused as its plain path is, and
/// nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_guests_off_no_spelling_of_a_path_gets_in() {
    use Method as M;
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), &[("SMOLCHAT_AUTH__GUESTS", "false")]).await;
    let me = server.client();
    let id = "0190a6f4-0000-7000-8000-000000000001";
    let msg = r#"{"content":"hi"}"#;
    let mut cases = Vec::new();
    let mut add = |name: &str, c: Case| {
        let mut c = c.nobody();
        c.name = name.to_string();
        cases.push(c);
    };
    for (name, path) in [
        ("plain", "/api/conversations"),
        ("%61pi", "/%61pi/conversations"),
        ("ap%69", "/ap%69/conversations"),
        ("%41PI", "/%61%70%69/conversations"),
        ("doubled slash", "/api//conversations"),
    ] {
        add(
            &format!("guests off: POST {name} create"),
            case("", M::POST, path, 401).json("{}"),
        );
        add(
            &format!("guests off: GET {name} list"),
            case("", M::GET, path, 401),
        );
    }
    add(
        "guests off: encoded import",
        case("", M::POST, "/%61pi/conversations/import", 401).json("{}"),
    );
    add(
        "guests off: encoded send",
        case(
            "",
            M::POST,
            &format!("/%61pi/conversations/{id}/messages"),
            401,
        )
        .json(msg),
    );
    add(
        "guests off: encoded events",
        case(
            "",
            M::GET,
            &format!("/%61pi/conversations/{id}/events"),
            401,
        ),
    );
    add(
        "guests off: encoded conversations page",
        case("", M::GET, "/%63onversations", 303),
    );
    add(
        "guests off: encoded chat page",
        case("", M::GET, &format!("/%63/{id}"), 303),
    );
    add(
        "guests off: encoded page send",
        case("", M::POST, &format!("/%63/{id}/messages"), 303).form("content=hi"),
    );
    add(
        "guests off: encoded page create (HTMX)",
        case("", M::POST, "/%63", 401)
            .header("hx-request", "true")
            .form(""),
    );
    add("guests off: encoded index", case("", M::GET, "/%2F", 404));
    add(
        "guests off: /v1 without a key",
        chat(json!({"messages": msgs()})).strip_auth().tap(401),
    );
    add(
        "guests off: /v1 with a made-up key",
        chat(json!({"messages": msgs()}))
            .strip_auth()
            .bearer("sk-anything")
            .tap(401),
    );
    add(
        "guests off: encoded /v1",
        case("", M::POST, "/%76%31/chat/completions", 401).json_value(json!({"messages": msgs()})),
    );
    add(
        "guests off: /v1 models without a key",
        case("", M::GET, "/v1/models", 401),
    );
    let store = smolchat_store::Store::open_beside_server(&server.database_url)
        .await
        .expect("open the server's store");
    let failures = run_cases(&server, &me, "", "", "", &cases).await;
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(stored(&store).await.0, 0, "nothing was stored");
    // Sign-in stays reachable however it is spelled.
    assert_eq!(me.get("/%73ignin").await.status, StatusCode::OK);
}

/// Bad configuration files stop the server at start-up with a message naming the setting.
#[test]
fn bad_configuration_files_are_clear_start_up_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: [(&str, &str, &[&str]); 10] = [
        (
            "unknown key",
            "[server]\nbindd = \"127.0.0.1:0\"\n",
            &["bindd"],
        ),
        (
            "unknown section",
            "[serverr]\nbind = \"127.0.0.1:0\"\n",
            &["serverr"],
        ),
        (
            "wrong type",
            "[scheduler]\nmax_running = \"many\"\n",
            &["max_running"],
        ),
        (
            "negative number",
            "[scheduler]\nqueue_size = -1\n",
            &["queue_size"],
        ),
        (
            "zero running",
            "[scheduler]\nmax_running = 0\n",
            &["max_running"],
        ),
        (
            "bad device",
            "[model]\ndevice = \"tpu\"\n",
            &["device", "tpu"],
        ),
        ("not TOML", "this is [not toml\n", &["TOML", "line"]),
        (
            "short cookie secret",
            "[server]\ncookie_secret = \"short\"\n",
            &["cookie_secret", "64"],
        ),
        (
            "approval for a tool that is not one",
            "[tools]\nrequire_approval = [\"shell\"]\n",
            &["tools.require_approval", "shell", "calculator"],
        ),
        (
            "no rounds of tools",
            "[tools]\nmax_rounds = 0\n",
            &["tools.max_rounds"],
        ),
    ];
    for (name, text, needles) in cases {
        let file = dir.path().join(format!("{}.toml", name.replace(' ', "_")));
        std::fs::write(&file, text).expect("write config");
        let out = Command::new(env!("CARGO_BIN_EXE_smolchat"))
            .args([
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--database-url",
                "sqlite::memory:",
                "--config",
            ])
            .arg(&file)
            .env_remove("SMOLCHAT_CONFIG")
            .output()
            .expect("run smolchat");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: started anyway");
        for needle in needles {
            assert!(
                stderr.contains(needle),
                "{name}: {needle:?} not in {stderr}"
            );
        }
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
    let missing = Command::new(env!("CARGO_BIN_EXE_smolchat"))
        .args(["serve", "--config", "/nonexistent/smolchat.toml"])
        .output()
        .expect("run smolchat");
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && stderr.contains("does not exist"),
        "{stderr}"
    );
}

/// Event streams are bounded per user over all their conversations, not only per conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_are_bounded_per_user() {
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [("SMOLCHAT_LIMITS__MAX_STREAMS_PER_USER", "2")];
    let server = Server::start(dir.path(), &env).await;
    let me = server.client();
    let mut open = Vec::new();
    for _ in 0..2 {
        let id = me.create(json!({})).await;
        open.push(me.events(&id).await);
    }
    let third = me.create(json!({})).await;
    let r = me.get(&format!("/api/conversations/{third}/events")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text);
    assert!(r.headers.get("retry-after").is_some());
    let message = r.json["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("limit per user is 2"), "{message}");
    // Another user is not affected.
    let other = server.client();
    let id = other.create(json!({})).await;
    let _stream = other.events(&id).await;
    drop(open);
}

/// A slowloris client (a request head trickled a byte at a time) is cut off after
/// `limits.request_head_timeout_s`, and a header block beyond actix-http's 128 KiB bound is
/// refused, so neither holds a connection or memory without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_oversized_request_heads_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [
        ("SMOLCHAT_LIMITS__REQUEST_HEAD_TIMEOUT_S", "2"),
        ("SMOLCHAT_LIMITS__KEEP_ALIVE_S", "1"),
    ];
    let server = Server::start(dir.path(), &env).await;
    let addr = server.base.trim_start_matches("http://").to_string();

    // Slowloris: one byte of the head every 500 ms; the server must close the connection (or
    // answer 408) long before the 30 bytes are through.
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let started = std::time::Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut_off = false;
    let mut sent = 0usize;
    for byte in head.iter() {
        sent += 1;
        if stream.write_all(&[*byte]).await.is_err() {
            cut_off = true;
            break;
        }
        let mut buf = [0u8; 256];
        match tokio::time::timeout(std::time::Duration::from_millis(500), stream.read(&mut buf))
            .await
        {
            Ok(Ok(0)) | Ok(Err(_)) => {
                cut_off = true;
                break;
            }
            Ok(Ok(n)) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                assert!(
                    text.contains("408"),
                    "unexpected answer to a slow head: {text}"
                );
                cut_off = true;
                break;
            }
            Err(_) => {}
        }
    }
    let held = started.elapsed();
    assert!(cut_off, "a head trickled for {held:?} was never cut off");
    eprintln!("slow request head cut off after {held:?}, {sent} bytes (limit 2 s)");
    // One byte per 500 ms: the 2 s limit allows about 4 before the cut-off; 8 (twice the limit)
    // is the margin for a loaded machine. A server applying no limit, or a longer one (actix's
    // default is 5 s), lets 10 or more through.
    assert!(
        sent <= 8,
        "{sent} bytes of a trickled head went through before the cut-off (limit 2 s = ~4 bytes)"
    );

    // actix-http buffers a request head up to 128 KiB (and 96 headers), then refuses it: 200 KiB
    // of headers is refused, not buffered.
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let big = format!(
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {}\r\n\r\n",
        "b".repeat(200 << 10)
    );
    let _ = stream.write_all(big.as_bytes()).await;
    let mut answer = Vec::new();
    // Hang guard: 10 s. Silence is not a refusal: the server must answer 431/400 or close the
    // connection (EOF, or a reset while we were still writing).
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_end(&mut answer),
    )
    .await
    .expect("an oversized head got neither an answer nor a closed connection within 10 s");
    let text = String::from_utf8_lossy(&answer);
    let closed = answer.is_empty()
        && match &read {
            Ok(_) => true,
            Err(e) => matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
        };
    assert!(
        text.starts_with("HTTP/1.1 431") || text.starts_with("HTTP/1.1 400") || closed,
        "an oversized head was not refused: {:?} {}",
        read,
        text.lines().next().unwrap_or("")
    );
    assert!(!text.starts_with("HTTP/1.1 200"));
    // The server still answers ordinary requests.
    assert_eq!(server.client().get("/healthz").await.status, StatusCode::OK);

    // `limits.keep_alive_s` (1 s here): a kept-alive connection that stays idle is closed by the
    // server. After one answered request the next read ends (EOF) instead of waiting for ever.
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("write");
    let mut buf = vec![0u8; 4096];
    let n = stream.read(&mut buf).await.expect("read the answer");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // Hang guard: 20 s. The property: the server closes the idle connection (0 bytes, EOF).
    let idle_since = std::time::Instant::now();
    let closed = tokio::time::timeout(std::time::Duration::from_secs(20), stream.read(&mut buf))
        .await
        .expect("an idle kept-alive connection was not closed within 20 s");
    assert!(
        matches!(closed, Ok(0)) || closed.is_err(),
        "the idle connection sent more: {closed:?}"
    );
    eprintln!(
        "idle keep-alive connection closed after {:?} (limit 1 s)",
        idle_since.elapsed()
    );
}

/// Behind a trusted proxy (here: the test, from 127.0.0.1 with a forwarding header), what the
/// proxy's user header may name: a value the server cannot use is 401, a disabled account 403,
/// each with a message and nothing made; neither is a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_header_names_get_their_own_refusals() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(
        dir.path(),
        &[
            ("SMOLCHAT_SERVER__TRUSTED_PROXIES", "[\"127.0.0.1\"]"),
            ("SMOLCHAT_AUTH__TRUSTED_USER_HEADER", "X-Remote-User"),
        ],
    )
    .await;
    let http = reqwest::Client::new();
    let as_user = |name: String| {
        http.get(format!("{}/api/conversations", server.base))
            .header("x-forwarded-for", "10.1.2.3")
            .header("x-remote-user", name)
            .send()
    };
    let r = as_user("carol@example.com".into()).await.expect("request");
    assert_eq!(r.status(), StatusCode::OK);
    let store = smolchat_store::Store::open_beside_server(&server.database_url)
        .await
        .expect("store");
    let carol = store
        .user_by_name("carol")
        .await
        .expect("read")
        .expect("carol was made");
    store.set_disabled(&carol.id, true).await.expect("disable");
    let before = store.count_users().await.expect("count");
    for (name, status, needle) in [
        ("carol@example.com".to_string(), 403, "disabled"),
        ("x".repeat(300), 401, "1 to 256 characters"),
    ] {
        let r = as_user(name.clone()).await.expect("request");
        assert_eq!(r.status().as_u16(), status, "{name}");
        let body: Value = r.json().await.expect("json");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{name}: {message}");
    }
    assert_eq!(
        store.count_users().await.expect("count"),
        before,
        "nothing made"
    );
    assert!(!server.log_text().contains("request failed"), "no 500");
}
