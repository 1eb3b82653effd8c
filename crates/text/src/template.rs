//! Chat templates: render a model's Jinja chat template exactly as Hugging Face transformers does.
//!
//! The prompt must be byte-identical to what the model was trained on, and a resumed conversation
//! must re-render to the same prefix so its cached KV stays valid. So the environment mirrors
//! transformers' `apply_chat_template`:
//! - `trim_blocks` and `lstrip_blocks` on, a single trailing newline of the template dropped;
//! - loop controls (`{% break %}`, `{% continue %}`);
//! - `{% generation %}…{% endgeneration %}` (transformers' assistant-mask extension) rewritten
//!   before parsing into an always-true `{% if %}` block, so the content renders and the tags keep
//!   the whitespace behaviour of a block tag, which is what jinja2 gives them;
//! - Python string/dict methods (`.replace`, `.rstrip`, `.items()` …) via minijinja-contrib's
//!   pycompat callback;
//! - `raise_exception(msg)` fails the render with `msg`;
//! - `strftime_now(fmt)` formats the *pinned* date of the render (the caller's
//!   [`RenderOptions::date`]), never the wall clock, so re-renders are reproducible;
//! - `tojson` behaves like transformers' override (`json.dumps` with `ensure_ascii=False`, no HTML
//!   escaping, `indent`, `separators` and `sort_keys` arguments), not like minijinja's HTML-safe one.
//!
//! Known divergence: serde_json and minijinja are built without `preserve_order`, so JSON objects
//! handed in as `serde_json::Value` (tools, tool calls, `extra`) reach the template with their keys
//! sorted, where Python would keep insertion order.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use chrono::{NaiveDate, NaiveTime};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

use super::guard::{RenderedPrompt, TextGuard};
use crate::error::{Result, TextError};
use smolchat_gguf::{GgufSource, Value as GgufValue};

/// The SmolLM3-3B chat template (Hugging Face), used when a `smollm3` GGUF carries none.
pub const SMOLLM3_TEMPLATE: &str = include_str!("assets/smollm3-chat-template.jinja");

/// A plain ChatML template (what SmolLM2 and many others use). Never applied implicitly; callers
/// may opt into it through [`ChatTemplate::chatml`] for a GGUF that has no template.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages -%}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

/// The GGUF metadata key holding the template.
const GGUF_TEMPLATE_KEY: &str = "tokenizer.chat_template";
/// The name the template is registered under inside the environment. It has no file extension,
/// so minijinja applies no auto-escaping (transformers renders without escaping too).
const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation as the template sees it.
///
/// For an assistant turn, `content` must be the model's exact generated text (think block and
/// tool-call markup included): templates such as SmolLM3's re-insert it verbatim, and only a
/// token-identical re-render lets the cached KV of the conversation be reused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    /// Passed to the template as `reasoning_content` (the name templates such as Qwen3's read);
    /// SmolLM3's template ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// OpenAI-shaped tool calls (`[{"type": "function", "function": {"name", "arguments"}}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// For a `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For a `tool` message: the name of the tool that produced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn this server's model generated, given as its exact raw text: rendered
    /// as is, so the special tokens the model wrote (`<think>`, tool-call markup) stay special
    /// and the cached KV stays reusable. Every other message, assistant turns written by a
    /// client or imported from a file included, is guarded (see `guard.rs`). Never read from
    /// outside input.
    #[serde(skip)]
    pub generated: bool,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
            generated: false,
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An assistant turn from outside (a client's history, an import): guarded like user text.
    /// For the model's own output use [`ChatMessage::generated`].
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// An assistant turn this server's model generated: its exact raw text, rendered unguarded.
    pub fn generated(raw: impl Into<String>) -> Self {
        Self {
            generated: true,
            ..Self::new("assistant", raw)
        }
    }

    pub fn tool(content: impl Into<String>) -> Self {
        Self::new("tool", content)
    }

    fn to_value(&self) -> Value {
        // Absent optional fields stay undefined (not `none`) so `is defined` tests in templates
        // behave as they do with transformers' dict messages.
        let mut pairs: Vec<(&str, Value)> = vec![
            ("role", Value::from(self.role.as_str())),
            ("content", Value::from(self.content.as_str())),
        ];
        if let Some(r) = &self.reasoning_content {
            pairs.push(("reasoning_content", Value::from(r.as_str())));
        }
        if let Some(tc) = &self.tool_calls {
            pairs.push(("tool_calls", json_to_value(tc)));
        }
        if let Some(id) = &self.tool_call_id {
            pairs.push(("tool_call_id", Value::from(id.as_str())));
        }
        if let Some(n) = &self.name {
            pairs.push(("name", Value::from(n.as_str())));
        }
        Value::from_pairs(pairs)
    }
}

/// Everything besides the messages that goes into a render.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderOptions {
    /// End the prompt with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// `enable_thinking` in the context; `None` leaves it undefined so the template's default
    /// applies (SmolLM3: thinking on unless the system prompt says `/no_think`).
    pub enable_thinking: Option<bool>,
    /// Tool JSON schemas. Passed as `tools` (the objects, as transformers passes them) and as
    /// `xml_tools` (each tool serialized like Python's `json.dumps(tool, ensure_ascii=False)`, i.e.
    /// `{"a": 1, "b": [2, 3]}`), which is what SmolLM3's template prints between `<tools>` tags.
    pub tools: Option<Vec<serde_json::Value>>,
    /// The date `strftime_now` reports. Pin it once per conversation: SmolLM3's header shows it,
    /// and a different date would change the prompt prefix and invalidate the cached KV.
    pub date: NaiveDate,
    pub bos_token: String,
    pub eos_token: String,
    /// Further context variables (e.g. `python_tools`). The typed fields above win on a clash.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl RenderOptions {
    /// Options for a prompt that asks the model to answer, with the template's default thinking
    /// mode, no tools and empty bos/eos strings.
    pub fn new(date: NaiveDate) -> Self {
        Self {
            add_generation_prompt: true,
            enable_thinking: None,
            tools: None,
            date,
            bos_token: String::new(),
            eos_token: String::new(),
            extra: serde_json::Map::new(),
        }
    }
}

/// A parsed chat template, ready to render. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Parses a Jinja chat template. A syntax error is an [`TextError::Template`] naming the line.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error("cannot configure the template syntax", &e))?;
        // The syntax must be set before the template is added: it is applied at parse time.
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson_filter);
        env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(source))
            .map_err(|e| template_error("cannot parse the chat template", &e))?;
        Ok(Self {
            env,
            source: source.to_string(),
        })
    }

    /// The SmolLM3-3B template shipped with smolchat.
    pub fn smollm3_default() -> Result<Self> {
        Self::new(SMOLLM3_TEMPLATE)
    }

    /// A plain ChatML template, for models whose GGUF carries no template (opt-in only).
    pub fn chatml() -> Result<Self> {
        Self::new(CHATML_TEMPLATE)
    }

    /// The template from the GGUF's `tokenizer.chat_template`. A `smollm3` file without one gets
    /// the SmolLM3 template; any other architecture without one is an error rather than a guessed
    /// format, because a wrong template silently degrades every answer (use
    /// [`ChatTemplate::chatml`] explicitly if ChatML is known to be right).
    pub fn from_gguf(gguf: &GgufSource) -> Result<Self> {
        match gguf.get(GGUF_TEMPLATE_KEY) {
            Some(GgufValue::String(source)) => {
                tracing::debug!(bytes = source.len(), "using the GGUF's chat template");
                return Self::new(source);
            }
            Some(other) => {
                return Err(smolchat_gguf::GgufError::bad_key(
                    GGUF_TEMPLATE_KEY,
                    format!("expected a string, found {other:?}"),
                )
                .into())
            }
            None => {}
        }
        let arch = gguf.opt_string("general.architecture").unwrap_or("");
        if arch == "smollm3" {
            tracing::info!("the GGUF has no chat template; using the built-in SmolLM3 template");
            return Self::smollm3_default();
        }
        Err(TextError::Template(format!(
            "the GGUF file (architecture `{arch}`) has no `{GGUF_TEMPLATE_KEY}`, and smolchat only \
             knows the right template for `smollm3`; use a GGUF converted with its chat template"
        )))
    }

    /// The template source as given (before the `{% generation %}` rewrite).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation.
    pub fn render(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = opts
            .extra
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect();
        ctx.insert(
            "messages".into(),
            messages.iter().map(ChatMessage::to_value).collect(),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(opts.add_generation_prompt),
        );
        if let Some(thinking) = opts.enable_thinking {
            ctx.insert("enable_thinking".into(), Value::from(thinking));
        }
        if let Some(tools) = &opts.tools {
            ctx.insert("tools".into(), tools.iter().map(json_to_value).collect());
            let xml_tools = tools
                .iter()
                .map(|t| python_json(&json_to_value(t), &PyJsonStyle::default()))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| template_error("cannot serialize a tool schema", &e))?;
            ctx.insert("xml_tools".into(), xml_tools.into_iter().collect());
        }
        ctx.insert("bos_token".into(), Value::from(opts.bos_token.as_str()));
        ctx.insert("eos_token".into(), Value::from(opts.eos_token.as_str()));
        self.render_map(ctx, opts.date)
    }

    /// Renders a conversation for the model, keeping untrusted text out of the control tokens:
    /// the content, name and call id of every message, the tool schemas and the extra template
    /// arguments pass through `guard` (the tokenizer's
    /// [`text_guard`](super::tokenizer::Tokenizer::text_guard)) first; encode the result with
    /// [`Tokenizer::encode_rendered`](super::tokenizer::Tokenizer::encode_rendered).
    ///
    /// The one exception is an assistant turn marked [`ChatMessage::generated`]: this server's
    /// model wrote it, and its special tokens (`<think>`, `<tool_call>`) must re-tokenize to the
    /// ids it generated so that the cached KV stays valid. Assistant text from anywhere else (a
    /// `/v1` client's history, an imported file) is guarded like user text: a typed
    /// `<|im_end|>` in it stays text.
    pub fn render_prompt(
        &self,
        messages: &[ChatMessage],
        opts: &RenderOptions,
        guard: &TextGuard,
    ) -> Result<RenderedPrompt> {
        let guarded_messages: Vec<ChatMessage> = messages
            .iter()
            .map(|m| {
                if m.role == "assistant" && m.generated {
                    return m.clone();
                }
                let protect = |s: &String| guard.protect(s).into_owned();
                ChatMessage {
                    role: m.role.clone(),
                    content: protect(&m.content),
                    reasoning_content: m.reasoning_content.as_ref().map(protect),
                    tool_calls: m.tool_calls.as_ref().map(|v| guard.protect_json(v)),
                    tool_call_id: m.tool_call_id.as_ref().map(protect),
                    name: m.name.as_ref().map(protect),
                    generated: false,
                }
            })
            .collect();
        let mut guarded_opts = opts.clone();
        guarded_opts.tools = opts
            .tools
            .as_ref()
            .map(|tools| tools.iter().map(|t| guard.protect_json(t)).collect());
        guarded_opts.extra = opts
            .extra
            .iter()
            .map(|(k, v)| (k.clone(), guard.protect_json(v)))
            .collect();
        let rendered = self.render(&guarded_messages, &guarded_opts)?;
        Ok(RenderedPrompt::new(rendered, guard))
    }

    /// Renders with a raw context (a JSON object: `messages`, `add_generation_prompt`, …), as the
    /// reference cases give it. `strftime_now` reports `date`.
    pub fn render_value(&self, ctx: &serde_json::Value, date: NaiveDate) -> Result<String> {
        let serde_json::Value::Object(map) = ctx else {
            return Err(TextError::Template(format!(
                "the render context must be a JSON object, not {ctx}"
            )));
        };
        let ctx = map
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect();
        self.render_map(ctx, date)
    }

    fn render_map(&self, mut ctx: BTreeMap<String, Value>, date: NaiveDate) -> Result<String> {
        // A per-render function rather than an environment global: the date belongs to the
        // conversation, and one template serves many conversations at once.
        ctx.insert("strftime_now".into(), strftime_now(date));
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error("the chat template is missing", &e))?;
        template
            .render(Value::from_pairs(ctx))
            .map_err(|e| template_error("cannot render the chat template", &e))
    }
}

/// True when a rendered prompt leaves a think block open (it ends with `<think>`, trailing
/// whitespace aside), i.e. the model's output starts inside its reasoning. Feed the result to
/// [`Splitter::new`](super::splitter::Splitter::new). SmolLM3's prompts never do this (thinking
/// mode leaves the `<think>` to the model; `/no_think` pre-fills a closed, empty block), but
/// templates such as DeepSeek-R1's or Qwen3's forced-thinking variants do.
pub fn prompt_ends_in_open_think(rendered: &str) -> bool {
    rendered.trim_end().ends_with("<think>")
}

fn template_error(what: &str, err: &JinjaError) -> TextError {
    let mut msg = format!("{what}: {err}");
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let _ = write!(msg, ": {cause}");
        source = cause.source();
    }
    TextError::Template(msg)
}

fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(
        ErrorKind::InvalidOperation,
        format!("the template raised an exception: {message}"),
    ))
}

fn strftime_now(date: NaiveDate) -> Value {
    // Midnight of the pinned date, so time directives (`%H:%M`) format instead of failing.
    let at = date.and_time(NaiveTime::MIN);
    Value::from_function(
        move |fmt: &str| -> std::result::Result<String, JinjaError> {
            let mut out = String::new();
            // chrono reports a bad directive as a fmt::Error from Display; writing into a String
            // (rather than `to_string()`, which would panic) turns it into a template error.
            write!(out, "{}", at.format(fmt)).map_err(|_| {
                JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: cannot format a date with {fmt:?}"),
                )
            })?;
            Ok(out)
        },
    )
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (any `-`/`+` whitespace modifiers kept)
/// into `{% if true %}` / `{% endif %}`, which minijinja knows and which trims whitespace exactly
/// like the block tag jinja2 sees.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        match rewrite_generation_tag(tag) {
            Some((replacement, consumed)) => {
                out.push_str(&replacement);
                rest = &tag[consumed..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `tag` starts with `{%`. Returns the replacement and the number of bytes it replaces.
fn rewrite_generation_tag(tag: &str) -> Option<(String, usize)> {
    let bytes = tag.as_bytes();
    let mut i = 2;
    let open_mod = match bytes.get(i) {
        Some(b'-' | b'+') => {
            i += 1;
            &tag[i - 1..i]
        }
        _ => "",
    };
    while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let word_start = i;
    while bytes
        .get(i)
        .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
    {
        i += 1;
    }
    let replacement = match &tag[word_start..i] {
        "generation" => "if true",
        "endgeneration" => "endif",
        _ => return None,
    };
    while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let close_mod = match bytes.get(i) {
        Some(b'-' | b'+') => {
            i += 1;
            &tag[i - 1..i]
        }
        _ => "",
    };
    if !tag[i..].starts_with("%}") {
        return None;
    }
    Some((format!("{{%{open_mod} {replacement} {close_mod}%}}"), i + 2))
}

/// serde_json → minijinja, by hand because minijinja's `serde` feature is off.
fn json_to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => items.iter().map(json_to_value).collect(),
        serde_json::Value::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_to_value(v))))
        }
    }
}

/// Layout options of Python's `json.dumps`.
struct PyJsonStyle {
    ensure_ascii: bool,
    /// `None`: one line. `Some(unit)`: one item per line, nested levels indented by `unit`.
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Default for PyJsonStyle {
    /// `json.dumps(x, ensure_ascii=False)`.
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// `tojson` as transformers defines it:
/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson_filter(
    value: &Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, JinjaError> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(JinjaError::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut params: [Option<Value>; 4] = Default::default();
    for (slot, v) in params.iter_mut().zip(args.iter()) {
        *slot = Some(v.clone());
    }
    for (slot, name) in params.iter_mut().zip(NAMES) {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            *slot = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let given = |v: &Option<Value>| v.clone().filter(|v| !v.is_none() && !v.is_undefined());
    let [ensure_ascii, indent, separators, sort_keys] = &params;
    let indent = match given(indent) {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            None => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be an integer or a string, not {v}"),
                ))
            }
        },
    };
    let (item_sep, key_sep) = match given(separators) {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
    };
    let style = PyJsonStyle {
        ensure_ascii: given(ensure_ascii).is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: given(sort_keys).is_some_and(|v| v.is_true()),
    };
    python_json(value, &style).map(Value::from)
}

fn python_json(value: &Value, style: &PyJsonStyle) -> std::result::Result<String, JinjaError> {
    let mut out = String::new();
    write_json(&mut out, value, style, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    v: &Value,
    style: &PyJsonStyle,
    depth: usize,
) -> std::result::Result<(), JinjaError> {
    match v.kind() {
        // jinja2 would refuse to serialize Undefined; null is the forgiving reading.
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => out.push_str(&python_float_repr(f64::try_from(v.clone())?)),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, '[', ']', &items, style, depth, |out, item, d| {
                write_json(out, item, style, d)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                entries.push((json_key(&key)?, value));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', &entries, style, depth, |out, (k, val), d| {
                write_json_str(out, k, style);
                out.push_str(&style.key_sep);
                write_json(out, val, style, d)
            })?;
        }
        kind => {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn write_container<T>(
    out: &mut String,
    open: char,
    close: char,
    items: &[T],
    style: &PyJsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> std::result::Result<(), JinjaError>,
) -> std::result::Result<(), JinjaError> {
    out.push(open);
    // Python writes empty containers as `[]`/`{}` even when indenting.
    if !items.is_empty() {
        let newline = |out: &mut String, level: usize| {
            if let Some(unit) = &style.indent {
                out.push('\n');
                for _ in 0..level {
                    out.push_str(unit);
                }
            }
        };
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&style.item_sep);
            }
            newline(out, depth + 1);
            write_item(out, item, depth + 1)?;
        }
        newline(out, depth);
    }
    out.push(close);
    Ok(())
}

/// Object keys the way `json.dumps` coerces them.
fn json_key(key: &Value) -> std::result::Result<String, JinjaError> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
        ValueKind::None | ValueKind::Undefined => "null".to_string(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => python_float_repr(f64::try_from(key.clone())?),
        kind => {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

fn write_json_str(out: &mut String, s: &str, style: &PyJsonStyle) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            // ensure_ascii escapes everything outside printable ASCII, DEL included, astral
            // characters as UTF-16 surrogate pairs.
            c if style.ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for exponents -4..16,
/// otherwise scientific with a signed, at least two-digit exponent (`1e+16`, `1.5e-07`).
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // `{:e}` prints the shortest round-trip mantissa, e.g. `-1.5e-7`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp < 0 {
            let zeros = "0".repeat((-exp - 1) as usize);
            format!("{sign}0.{zeros}{digits}")
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                let zeros = "0".repeat(int_len - digits.len());
                format!("{sign}{digits}{zeros}.0")
            } else {
                format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
            }
        }
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        let mant = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        format!("{sign}{mant}e{exp_sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        // Expected strings from CPython's repr().
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (2.5, "2.5"),
            (0.1, "0.1"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-1.5e-7, "-1.5e-07"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn generation_tags_become_if_blocks() {
        assert_eq!(
            strip_generation_tags("a{% generation %}b{%- endgeneration -%}c{% generations %}"),
            "a{% if true %}b{%- endif -%}c{% generations %}"
        );
        assert_eq!(strip_generation_tags("{%"), "{%");
        assert_eq!(strip_generation_tags("{%- generation"), "{%- generation");
    }

    #[test]
    fn json_strings_escape_like_python() {
        let mut ascii = String::new();
        let style = PyJsonStyle {
            ensure_ascii: true,
            ..PyJsonStyle::default()
        };
        write_json_str(&mut ascii, "é🚀\u{7f}\"\\\n\u{1}<", &style);
        assert_eq!(ascii, r#""\u00e9\ud83d\ude80\u007f\"\\\n\u0001<""#);
        let mut utf8 = String::new();
        write_json_str(&mut utf8, "é🚀\u{7f}<", &PyJsonStyle::default());
        assert_eq!(utf8, "\"é🚀\u{7f}<\"");
    }
}
