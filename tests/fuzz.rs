//! Property-based fuzzing (proptest, stable toolchain) of everything that parses outside input:
//! the GGUF reader, the tokenizer's special-token splitting and streaming detokenizer, the chat
//! template renderer, the OpenAI request parser, the reasoning/tool-call splitter and the
//! markdown renderer.
//!
//! `make test` runs a bounded number of cases per property (proptest's default 256, or
//! `PROPTEST_CASES`); `make fuzz` runs many more. A failure is shrunk to a minimal input and its
//! seed saved under `tests/fuzz.proptest-regressions`, which is committed so the case is replayed
//! first on every later run: crashes found become regression tests.

mod common;

use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{json, Value};
use smolchat_engine::synthetic::SyntheticSpec;
use smolchat_engine::Model;
use smolchat_gguf::GgufSource;
use smolchat_text::splitter::{SplitEvent, Splitter};
use smolchat_text::template::{ChatMessage, ChatTemplate, RenderOptions};
use smolchat_text::tokenizer::Tokenizer;
use smolchat_web::markdown;
use smolchat_web::openai::request::{parse_chat, parse_completion, Defaults};

fn smollm2_tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let src = GgufSource::open(&common::smollm2_path()).expect("open SmolLM2");
        Tokenizer::from_gguf(&src).expect("SmolLM2 tokenizer")
    })
}

/// A small, valid GGUF file's bytes (a tiny synthetic model), the seed the GGUF mutations start
/// from so that most of them reach deep into the header instead of failing at the magic.
fn seed_gguf() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("seed.gguf");
        let mut spec = SyntheticSpec::tiny("smollm3");
        spec.vocab_size = 256;
        spec.n_layers = 1;
        smolchat_engine::synthetic::write_gguf(&spec, &path).expect("write seed gguf");
        std::fs::read(&path).expect("read seed gguf")
    })
}

/// Text built from pieces that matter to the code under test (tags, special tokens, their
/// fragments, markup, multi-byte characters, whitespace) mixed with arbitrary strings.
fn tricky_text(pieces: &'static [&'static str]) -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        3 => proptest::sample::select(pieces).prop_map(str::to_string),
        1 => any::<String>(),
        1 => "[ \t\n]{1,3}",
        1 => proptest::sample::select(&["é", "漢字", "🦀", "\u{200d}", "\u{fffd}", "\0"][..])
            .prop_map(str::to_string),
    ];
    proptest::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

const SPECIAL_PIECES: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "_end|>",
    "<|",
    "|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "user",
    "assistant",
    "\n",
    "hello",
    " world",
    "123456",
    "'s",
];

const SPLITTER_PIECES: &[&str] = &[
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<th",
    "ink>",
    "</tool",
    "_call>",
    "<",
    ">",
    "{\"name\": \"f\", \"arguments\": {\"x\": 1}}",
    "{\"name\": ",
    "not json",
    "\n\n",
    " ",
    "Answer.",
];

const MARKDOWN_PIECES: &[&str] = &[
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "[x](javascript:alert(1))",
    "[x](JaVaScRiPt:alert(1))",
    "![i](javascript:alert(1))",
    "<a href=\"javascript:alert(1)\">a</a>",
    "<iframe src=//evil>",
    "<svg onload=alert(1)>",
    "```html\n<script>x</script>\n```",
    "`code`",
    "| a | b |\n|---|---|\n| 1 | 2 |",
    "- [ ] task",
    "**bold**",
    "<style>body{}</style>",
    "&lt;script&gt;",
    "\n\n",
    "> quote",
    "<b onclick=alert(1)>b</b>",
    "[l](data:text/html;base64,PHNjcmlwdD4=)",
];

/// Every event of a finished split, as (kind, text) with adjacent text of one kind merged, so
/// splits of the same input fed in different pieces can be compared.
fn split_all(chunks: &[String], starts_in_reasoning: bool) -> Vec<(u8, String)> {
    let mut s = Splitter::new(starts_in_reasoning);
    let mut events = Vec::new();
    for c in chunks {
        events.extend(s.push(c));
    }
    events.extend(s.finish());
    let mut out: Vec<(u8, String)> = Vec::new();
    for e in events {
        let (kind, text) = match e {
            SplitEvent::Reasoning(t) => (0, t),
            SplitEvent::Answer(t) => (1, t),
            SplitEvent::ToolCall(c) => (2, format!("{}{}", c.name, c.arguments)),
            SplitEvent::InvalidToolCall { raw, .. } => (3, raw),
        };
        match out.last_mut() {
            Some((k, t)) if *k == kind && kind < 2 => t.push_str(&text),
            _ => out.push((kind, text)),
        }
    }
    out
}

/// Arbitrary JSON, biased towards the shapes the OpenAI parser looks at.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        proptest::sample::select(
            &[
                "user",
                "assistant",
                "system",
                "tool",
                "function",
                "auto",
                "none",
                "text",
                "json_object",
                "",
                "x",
            ][..]
        )
        .prop_map(|s| json!(s)),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        let key = proptest::sample::select(
            &[
                "role",
                "content",
                "messages",
                "model",
                "stream",
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "stop",
                "tools",
                "tool_choice",
                "type",
                "function",
                "name",
                "arguments",
                "parameters",
                "logit_bias",
                "seed",
                "n",
                "stream_options",
                "include_usage",
                "prompt",
                "tool_calls",
                "id",
                "text",
                "image_url",
                "response_format",
                "presence_penalty",
                "frequency_penalty",
                "min_p",
                "chat_template_kwargs",
                "enable_thinking",
                "reasoning_effort",
                "zzz",
            ][..],
        );
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::vec((key, inner), 0..6).prop_map(|kv| Value::Object(
                kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
            )),
        ]
    })
}

/// A chat request with a valid skeleton and arbitrary values inside it.
fn chat_body() -> impl Strategy<Value = Value> {
    (
        proptest::collection::vec((json_value(), json_value()), 0..4),
        proptest::collection::vec(
            (
                proptest::sample::select(
                    &[
                        "model",
                        "stream",
                        "max_tokens",
                        "temperature",
                        "top_p",
                        "stop",
                        "tools",
                        "tool_choice",
                        "logit_bias",
                        "seed",
                        "n",
                        "stream_options",
                        "response_format",
                        "min_p",
                        "top_k",
                    ][..],
                ),
                json_value(),
            ),
            0..6,
        ),
    )
        .prop_map(|(messages, extra)| {
            let mut body = serde_json::Map::new();
            body.insert(
                "messages".into(),
                Value::Array(
                    messages
                        .into_iter()
                        .map(|(role, content)| json!({"role": role, "content": content}))
                        .collect(),
                ),
            );
            for (k, v) in extra {
                body.insert(k.to_string(), v);
            }
            Value::Object(body)
        })
}

/// The attributes of one serialized tag (`a href="x" rel="y"`, as html5ever writes them: values
/// always double-quoted, quotes inside escaped), as (name, value) pairs.
fn attributes(tag: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = tag.trim_start_matches('/');
    // Skip the tag name.
    rest = rest.find(char::is_whitespace).map_or("", |i| &rest[i..]);
    loop {
        rest = rest.trim_start();
        if rest.is_empty() || rest == "/" {
            return out;
        }
        let end = rest
            .find(|c: char| c == '=' || c.is_whitespace())
            .unwrap_or(rest.len());
        let name = rest[..end].to_string();
        rest = &rest[end..];
        let mut value = String::new();
        if let Some(after) = rest.strip_prefix('=') {
            if let Some(quoted) = after.strip_prefix('"') {
                let close = quoted.find('"').unwrap_or(quoted.len());
                value = quoted[..close].to_string();
                rest = quoted.get(close + 1..).unwrap_or("");
            } else {
                let close = after.find(char::is_whitespace).unwrap_or(after.len());
                value = after[..close].to_string();
                rest = &after[close..];
            }
        }
        out.push((name, value));
    }
}

fn defaults() -> Defaults {
    Defaults {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 40,
    }
}

proptest! {
    /// Any mutation of a valid file's bytes is read or refused with an error, never a panic,
    /// an abort on a huge allocation or a hang; what is read also loads or is refused.
    #[test]
    fn gguf_reader_survives_mutated_files(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u64>(), 0u8..4), 1..6),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = seed_gguf().to_vec();
        // The header (where the parser's decisions are) is the first few KB; aim there mostly.
        let header = bytes.len().min(16 << 10);
        for (at, value, kind) in edits {
            let i = at.index(header);
            match kind {
                0 => bytes[i] = value as u8,
                1 => {
                    let end = (i + 8).min(bytes.len());
                    bytes[i..end].copy_from_slice(&value.to_le_bytes()[..end - i]);
                }
                2 => {
                    // Small counts and lengths are the interesting ones.
                    let end = (i + 8).min(bytes.len());
                    bytes[i..end].copy_from_slice(&(value % 300).to_le_bytes()[..end - i]);
                }
                _ => {
                    let end = (i + 4).min(bytes.len());
                    bytes[i..end].copy_from_slice(&(u32::MAX - (value as u32 % 4)).to_le_bytes()[..end - i]);
                }
            }
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mutated.gguf");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(mut src) = GgufSource::open(&path) {
            let _ = Tokenizer::from_gguf(&src);
            let _ = ChatTemplate::from_gguf(&src);
            let _ = Model::load(&mut src, &mut |_, _| {});
        }
    }

    /// Byte-level BPE loses nothing: decoding the ids gives back the text exactly, with or
    /// without special-token parsing; without it, no control token id ever appears.
    #[test]
    fn tokenizer_round_trips_and_keeps_specials_as_text(text in tricky_text(SPECIAL_PIECES)) {
        let t = smollm2_tokenizer();
        let plain = t.encode(&text, false).unwrap();
        prop_assert_eq!(t.decode(&plain), text.clone());
        prop_assert!(
            plain.iter().all(|&id| !t.is_special(id)),
            "special id in {:?} -> {:?}", text, plain
        );
        let special = t.encode(&text, true).unwrap();
        prop_assert_eq!(t.decode(&special), text.clone());
        // Streaming the ids one by one gives the same text as decoding them at once.
        let mut d = t.detokenizer();
        let mut streamed = String::new();
        for &id in &special {
            streamed.push_str(&d.push(id));
        }
        streamed.push_str(&d.finish());
        prop_assert_eq!(streamed, text);
    }

    /// The SmolLM3 template renders any conversation (or refuses it with a template error) and
    /// every message's text reaches the prompt.
    #[test]
    fn template_renders_arbitrary_conversations(
        messages in proptest::collection::vec(
            (proptest::sample::select(&["system", "user", "assistant", "tool", "other"][..]),
             tricky_text(SPECIAL_PIECES)),
            0..6,
        ),
        thinking in proptest::option::of(any::<bool>()),
        tools in proptest::option::of(proptest::collection::vec(json_value(), 0..3)),
    ) {
        let template = ChatTemplate::smollm3_default().unwrap();
        let msgs: Vec<ChatMessage> =
            messages.iter().map(|(r, c)| ChatMessage::new(*r, c.as_str())).collect();
        let mut opts = RenderOptions::new(chrono::NaiveDate::from_ymd_opt(2026, 11, 23).unwrap());
        opts.add_generation_prompt = true;
        opts.enable_thinking = thinking;
        opts.tools = tools;
        // What the product itself renders (at least one system, user or assistant turn, no
        // tools) must render; anything else may be refused, with a message.
        let ordinary = opts.tools.is_none()
            && !messages.is_empty()
            && messages.iter().all(|(r, _)| ["system", "user", "assistant"].contains(r));
        match template.render(&msgs, &opts) {
            Ok(rendered) => {
                for (role, content) in &messages {
                    // The system prompt's `/think` and `/no_think` flags are edited out by design.
                    if *role == "user" && !content.contains("/think") && !content.contains("/no_think") {
                        prop_assert!(rendered.contains(content.as_str()));
                    }
                }
            }
            Err(e) => {
                prop_assert!(!ordinary, "an ordinary conversation was refused: {e}");
                prop_assert!(!e.to_string().trim().is_empty());
            }
        }
    }

    /// The OpenAI parser answers any JSON with a request or a 4xx-shaped error, never a panic.
    #[test]
    fn openai_parser_takes_any_json(body in prop_oneof![json_value(), chat_body()]) {
        let d = defaults();
        if let Err(e) = parse_chat(&body, &d) {
            // A client error with a message naming what was wrong, never a 5xx.
            let status = actix_web::ResponseError::status_code(&e);
            prop_assert!(status.is_client_error(), "{status}: {e:?}");
            let body = e.body();
            let message = body["error"]["message"].as_str().unwrap_or("");
            prop_assert!(!message.trim().is_empty(), "{body}");
        }
        let _ = parse_completion(&body, &d);
    }

    /// Splitting does not depend on how the text was cut into pieces.
    #[test]
    fn splitter_is_independent_of_chunking(
        text in tricky_text(SPLITTER_PIECES),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..12),
        starts_in_reasoning in any::<bool>(),
    ) {
        let whole = split_all(std::slice::from_ref(&text), starts_in_reasoning);
        let mut at: Vec<usize> = cuts
            .iter()
            .map(|c| c.index(text.len() + 1))
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        at.sort_unstable();
        at.dedup();
        let mut chunks = Vec::new();
        let mut prev = 0;
        for i in at {
            chunks.push(text[prev..i].to_string());
            prev = i;
        }
        chunks.push(text[prev..].to_string());
        prop_assert_eq!(split_all(&chunks, starts_in_reasoning), whole);
    }

    /// Markdown from a model (or from a prompt-injected user) never yields script: outside
    /// escaped text (where `<` is `&lt;`), no tag is a script, style, frame or svg element, and no
    /// tag carries an event handler or a javascript:/data: URL.
    #[test]
    fn markdown_output_is_always_sanitized(text in tricky_text(MARKDOWN_PIECES)) {
        let html = markdown::render(&text).to_ascii_lowercase();
        for tag in html.split('<').skip(1) {
            let tag = tag.split('>').next().unwrap_or("");
            let name = tag.trim_start_matches('/').split([' ', '\t', '\n', '/']).next().unwrap_or("");
            prop_assert!(
                !["script", "style", "iframe", "svg", "object", "embed", "math"].contains(&name),
                "<{tag}> in {html}"
            );
            for (attr, value) in attributes(tag) {
                prop_assert!(!attr.starts_with("on"), "handler in <{tag}>");
                prop_assert!(
                    !value.trim_start().starts_with("javascript:") && !value.trim_start().starts_with("data:"),
                    "url in <{tag}>"
                );
            }
        }
    }
}

/// The document reader as the server runs it: this binary's `smolchat extract` in a child
/// process under its limits (a short deadline, so a case that only burns time ends quickly).
fn document_reader() -> &'static (
    tokio::runtime::Runtime,
    std::sync::Arc<smolchat_service::documents::DocumentReader>,
) {
    static READER: OnceLock<(
        tokio::runtime::Runtime,
        std::sync::Arc<smolchat_service::documents::DocumentReader>,
    )> = OnceLock::new();
    READER.get_or_init(|| {
        let limits = smolchat_service::config::LimitsConfig {
            extract_timeout_s: 3,
            ..Default::default()
        };
        let config = smolchat_service::documents::SandboxConfig::new(
            env!("CARGO_BIN_EXE_smolchat").into(),
            &limits,
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        // Tokens of at most 16 bytes: what fits is judged by bytes alone here.
        (
            rt,
            smolchat_service::documents::DocumentReader::new(config, 16),
        )
    })
}

/// A PDF from the pieces that break parsers: arrays and dictionaries nested deep, forms that
/// draw themselves (directly or through another form), streams that inflate to much more than
/// they are, a valid document cut short or with bytes changed, and noise after `%PDF-`.
fn hostile_pdf() -> impl Strategy<Value = Vec<u8>> {
    let valid = common::pdf::text("Fuzzed text");
    let len = valid.len();
    prop_oneof![
        (1usize..300_000).prop_map(common::pdf::nested_arrays),
        (1usize..50_000).prop_map(|d| {
            let mut body = "<< /A ".repeat(d).into_bytes();
            body.extend_from_slice(&b">> ".repeat(d));
            common::pdf::document(&[body])
        }),
        Just(common::pdf::self_drawing_form()),
        Just(common::pdf::one_page(
            b"/X0 Do",
            false,
            "/XObject << /X0 6 0 R >>",
            &[
                common::pdf::stream(
                    "/Type /XObject /Subtype /Form /BBox [0 0 1 1] /Resources << /XObject << /X1 7 0 R >> >>",
                    b"/X1 Do",
                ),
                common::pdf::stream(
                    "/Type /XObject /Subtype /Form /BBox [0 0 1 1] /Resources << /XObject << /X0 6 0 R >> >>",
                    b"BT (again) Tj ET /X0 Do",
                ),
            ],
        )),
        (1usize..(40 << 20)).prop_map(common::pdf::inflating),
        (0..len).prop_map(move |cut| common::pdf::text("Fuzzed text")[..cut].to_vec()),
        proptest::collection::vec((0..len, any::<u8>()), 1..8).prop_map(move |edits| {
            let mut b = common::pdf::text("Fuzzed text");
            for (at, v) in edits {
                b[at] = v;
            }
            b
        }),
        proptest::collection::vec(any::<u8>(), 0..4096)
            .prop_map(|noise| [b"%PDF-1.7\n".to_vec(), noise].concat()),
    ]
}

/// Cases of the document-reader property: each starts a process (and some run to the 3 s
/// deadline), so a twentieth of `PROPTEST_CASES` (`make fuzz`: 1,000 of 20,000), at least 48.
fn document_cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(48, |n| (n / 20).max(48))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(document_cases()))]

    /// Whatever a PDF holds, the sandboxed reader answers: its text, or a refusal that names
    /// the file and says what was wrong; never a fault of the reader itself, never a hang.
    #[test]
    fn the_document_reader_survives_hostile_pdfs(bytes in hostile_pdf()) {
        let (rt, reader) = document_reader();
        let started = std::time::Instant::now();
        let got = rt.block_on(reader.read("fuzz", "fuzz.pdf", bytes, 10 << 20, 1 << 16));
        // Hang guard, far above the reader's own 3 s deadline.
        prop_assert!(started.elapsed() < std::time::Duration::from_secs(30), "{:?}", started.elapsed());
        match got {
            Ok(read) => prop_assert!(!read.text.trim().is_empty()),
            Err(smolchat_service::documents::ReadError::File(e)) => {
                let message = e.to_string();
                prop_assert!(message.contains("fuzz.pdf"), "{}", message);
            }
            // More text than a room of 65,536 tokens holds: refused by its size alone.
            Err(smolchat_service::documents::ReadError::DoesNotFit { .. }) => {}
            Err(other) => prop_assert!(false, "the reader itself failed: {}", other),
        }
    }
}
