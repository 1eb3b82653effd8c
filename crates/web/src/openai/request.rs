//! Reading OpenAI request bodies. The body is taken as a JSON value and read field by field, so
//! a wrong type is a 400 that names the field and says what it must be (serde's derive would
//! only give a line and column). JsonFields smolchat has no use for (`user`, `metadata`,
//! `logit_bias`, …) are ignored, as llama-server ignores them; features it cannot honour
//! (`n > 1`, forced tool choice, JSON mode) are refused rather than silently dropped.

use serde_json::{Map, Value};

use crate::error::ApiError;
use smolchat_text::constraint::Grammar;
use smolchat_text::sampling::{SamplingParams, MAX_TOP_LOGPROBS};
use smolchat_text::template::ChatMessage;

/// The most tools one request may offer. Each is printed into the prompt, so thousands would
/// only fill the context window; OpenAI's own limit is 128.
pub const MAX_TOOLS: usize = 128;

/// Server-side defaults for fields a request leaves out (`config.sampling`).
#[derive(Debug, Clone)]
pub struct Defaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
}

/// What chat and text completions share.
#[derive(Debug, Clone)]
pub struct GenerationOptions {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `max_new_tokens` is a placeholder until [`GenerationOptions::max_tokens`] (or the room left in the
    /// context) is applied.
    pub params: SamplingParams,
    pub max_tokens: Option<usize>,
    /// The request field the grammar came from (for the message when it does not compile).
    pub grammar_field: Option<String>,
    /// Choices to generate (`n`, 1 to [`MAX_CHOICES`]).
    pub n: usize,
    /// What the client says separates its cache partition from others': vLLM's `cache_salt`
    /// and OpenAI's `user` (an end-user id), joined. The web layer adds the client's address
    /// and key; see `v1::cache_salt`.
    pub cache_salt: String,
}

/// A parsed `POST /v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub common: GenerationOptions,
    pub messages: Vec<ApiMessage>,
    /// `chat_template_kwargs.enable_thinking`, else `/think` / `/no_think` in the system prompt.
    pub enable_thinking: Option<bool>,
    /// Tool schemas for the template; `None` also when `tool_choice` is `none`.
    pub tools: Option<Vec<Value>>,
    /// Other `chat_template_kwargs`, passed to the template as context variables.
    pub template_kwargs: Map<String, Value>,
    /// `tool_choice` `required` or a named function: the tools one of which the reply must call.
    pub forced_tools: Option<Vec<Value>>,
}

impl ChatRequest {
    /// Whether `<tool_call>` blocks in the output become `tool_calls`.
    pub fn parse_tool_calls(&self) -> bool {
        self.tools.is_some()
    }
}

/// One request message, before it is shaped for the template.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiMessage {
    pub role: String,
    pub content: String,
    /// `file` content parts (user messages): read and placed into `content` when the prompt
    /// is built, off the event loop (`smolchat_service::files`).
    pub files: Vec<InlineFile>,
    pub reasoning_content: Option<String>,
    pub tool_calls: Vec<CallIn>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// A file sent inside a message: `{"type": "file", "file": {"filename", "file_data"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct InlineFile {
    pub name: String,
    pub data: Vec<u8>,
}

/// A tool call of an earlier assistant turn.
#[derive(Debug, Clone, PartialEq)]
pub struct CallIn {
    pub id: Option<String>,
    pub name: String,
    /// As the client sent it: normally a JSON-encoded object.
    pub arguments: String,
}

/// A parsed `POST /v1/completions`.
#[derive(Debug, Clone)]
pub struct TextCompletionRequest {
    pub common: GenerationOptions,
    pub prompt: PromptIn,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
}

/// OpenAI's default for `/v1/completions` (vLLM follows it); chat defaults to the room left.
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(param: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!("`{param}` must be {want}, not {}", kind_of(got)),
    )
}

/// Typed access to the fields of one JSON object; `null` reads as absent (OpenAI's clients send
/// `null` for "not given").
struct JsonFields<'a> {
    obj: &'a Map<String, Value>,
    /// Path prefix for error messages (`messages[2].`).
    prefix: String,
}

impl<'a> JsonFields<'a> {
    fn new(v: &'a Value, path: &str) -> Result<Self, ApiError> {
        match v {
            Value::Object(obj) => Ok(Self {
                obj,
                prefix: if path.is_empty() {
                    String::new()
                } else {
                    format!("{path}.")
                },
            }),
            other if path.is_empty() => Err(ApiError::bad_body(format!(
                "the request body must be a JSON object, not {}",
                kind_of(other)
            ))),
            other => Err(wrong_type(path, "an object", other)),
        }
    }

    fn path(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x as f32)),
                _ => Err(ApiError::invalid(
                    self.path(name),
                    format!("`{}` must be a finite number", self.path(name)),
                )),
            },
            Some(other) => Err(wrong_type(&self.path(name), "a number", other)),
        }
    }

    /// An integer; a float with no fraction (`100.0`) is accepted, as Python clients may send it.
    fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                if let Some(i) = n.as_i64() {
                    return Ok(Some(i));
                }
                if let Some(u) = n.as_u64() {
                    return Ok(Some(i64::try_from(u).unwrap_or(i64::MAX)));
                }
                match n.as_f64() {
                    Some(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => Ok(Some(x as i64)),
                    _ => Err(ApiError::invalid(
                        self.path(name),
                        format!("`{}` must be an integer, not {n}", self.path(name)),
                    )),
                }
            }
            Some(other) => Err(wrong_type(&self.path(name), "an integer", other)),
        }
    }

    /// A non-negative integer.
    fn count(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.i64(name)? {
            None => Ok(None),
            Some(i) if i >= 0 => Ok(Some(usize::try_from(i).unwrap_or(usize::MAX))),
            Some(i) => Err(ApiError::invalid(
                self.path(name),
                format!("`{}` must be >= 0, got {i}", self.path(name)),
            )),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(wrong_type(&self.path(name), "a boolean", other)),
        }
    }

    fn str(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(wrong_type(&self.path(name), "a string", other)),
        }
    }

    fn object(&self, name: &str) -> Result<Option<JsonFields<'a>>, ApiError> {
        self.get(name)
            .map(|v| JsonFields::new(v, &self.path(name)))
            .transpose()
    }

    fn array(&self, name: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(other) => Err(wrong_type(&self.path(name), "an array", other)),
        }
    }
}

/// The most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 8;

/// JsonFields both endpoints take: model, stream, sampling and stopping.
fn parse_common(f: &JsonFields<'_>, defaults: &Defaults) -> Result<GenerationOptions, ApiError> {
    let model = f.str("model")?.map(str::to_string);
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => o.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    let n = match f.i64("n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
            ))
        }
    };
    // Chat: `logprobs: true` and `top_logprobs` (0 to 20); the legacy completions API: a
    // number of alternatives in `logprobs` itself.
    let top_logprobs = f.count("top_logprobs")?;
    let logprobs = match f.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {
            if top_logprobs.is_some_and(|n| n > 0) {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
            None
        }
        Some(Value::Bool(true)) => Some(top_logprobs.unwrap_or(0)),
        Some(Value::Number(_)) => f.count("logprobs")?,
        Some(other) => {
            return Err(wrong_type(
                "logprobs",
                "true, false or a number of alternatives",
                other,
            ))
        }
    };
    if let Some(n) = logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
        let param = if top_logprobs.is_some() {
            "top_logprobs"
        } else {
            "logprobs"
        };
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
        ));
    }
    if let Some(best_of) = f.i64("best_of")? {
        if best_of != 1 {
            return Err(ApiError::unsupported(
                "best_of",
                format!("`best_of` must be 1, got {best_of}"),
            ));
        }
    }
    // Type checks for fields that are otherwise ignored, so a malformed request is still refused.
    // Ignored, but checked as OpenAI checks it: token ids to numbers between -100 and 100.
    if let Some(v) = f.get("logit_bias") {
        let Some(map) = v.as_object() else {
            return Err(wrong_type("logit_bias", "an object", v));
        };
        for (token, bias) in map {
            let param = format!("logit_bias.{token}");
            if token.parse::<u32>().is_err() {
                return Err(ApiError::invalid(
                    &param,
                    format!("`logit_bias` keys must be token ids, and {token:?} is not one"),
                ));
            }
            match bias.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => {}
                Some(b) => {
                    return Err(ApiError::invalid(
                        &param,
                        format!("`{param}` must be between -100 and 100, got {b}"),
                    ))
                }
                None => return Err(wrong_type(&param, "a number between -100 and 100", bias)),
            }
        }
    }
    let user = f.str("user")?.unwrap_or("");
    let salt = f.str("cache_salt")?.unwrap_or("");
    // Length-prefixed so that no two different (user, salt) pairs join to the same string.
    let cache_salt = format!("{}:{user}{}:{salt}", user.len(), salt.len());

    let mut params = SamplingParams {
        temperature: defaults.temperature,
        top_p: defaults.top_p,
        top_k: defaults.top_k,
        ..SamplingParams::default()
    };
    // Values are only read here; whether they are acceptable is decided by the one settings
    // check below, so a value gets the same verdict and message as on a conversation.
    if let Some(t) = f.f32("temperature")? {
        params.temperature = t;
    }
    if let Some(p) = f.f32("top_p")? {
        params.top_p = p;
    }
    if let Some(v) = f.f32("presence_penalty")? {
        params.presence_penalty = v;
    }
    if let Some(v) = f.f32("frequency_penalty")? {
        params.frequency_penalty = v;
    }
    // llama-server / vLLM extensions.
    if let Some(k) = f.count("top_k")? {
        params.top_k = k;
    }
    if let Some(m) = f.f32("min_p")? {
        params.min_p = m;
    }
    for name in ["repetition_penalty", "repeat_penalty"] {
        if let Some(r) = f.f32(name)? {
            params.repetition_penalty = r;
        }
    }
    if let Some(b) = f.bool("ignore_eos")? {
        params.ignore_eos = b;
    }
    if let Some(seed) = f.i64("seed")? {
        // Any integer is a valid seed; negative ones keep their bits.
        params.seed = Some(seed as u64);
    }
    params.stop_strings = parse_stop(f)?;
    params.logprobs = logprobs;
    let (grammar, grammar_field) = parse_grammar_fields(f)?;
    params.grammar = grammar;
    smolchat_service::settings::check_sampling(&params).map_err(ApiError::from_settings)?;

    // `max_completion_tokens` replaced `max_tokens` in OpenAI's API; both are accepted.
    let mut max_tokens = None;
    for name in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = f.count(name)? {
            if n == 0 {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be at least 1"),
                ));
            }
            max_tokens = Some(n);
        }
    }
    Ok(GenerationOptions {
        model,
        stream,
        include_usage,
        params,
        max_tokens,
        grammar_field,
        n,
        cache_salt,
    })
}

/// The grammar fields of llama-server (`json_schema`) and vLLM (`guided_json`, `guided_regex`,
/// `guided_grammar` in llguidance's Lark dialect), and llama-server's GBNF `grammar`; at most
/// one.
fn parse_grammar_fields(f: &JsonFields<'_>) -> Result<(Option<Grammar>, Option<String>), ApiError> {
    let mut found: Vec<(Grammar, &str)> = Vec::new();
    for name in ["json_schema", "guided_json"] {
        match f.get(name) {
            None | Some(Value::Null) => {}
            Some(schema @ Value::Object(_)) => {
                found.push((Grammar::JsonSchema(schema.clone()), name))
            }
            Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                Ok(schema @ Value::Object(_)) => found.push((Grammar::JsonSchema(schema), name)),
                _ => {
                    return Err(ApiError::invalid(
                        name,
                        format!("`{name}` must be a JSON Schema object"),
                    ))
                }
            },
            Some(other) => return Err(wrong_type(name, "a JSON Schema object", other)),
        }
    }
    if let Some(rx) = f.str("guided_regex")? {
        found.push((Grammar::Regex(rx.to_string()), "guided_regex"));
    }
    if let Some(lark) = f.str("guided_grammar")? {
        found.push((Grammar::Lark(lark.to_string()), "guided_grammar"));
    }
    if let Some(gbnf) = f.str("grammar")?.filter(|g| !g.is_empty()) {
        // llama-server's GBNF, translated into the Lark dialect the constraint compiles.
        let lark = smolchat_text::gbnf::to_lark(gbnf)
            .map_err(|e| ApiError::invalid("grammar", format!("`grammar`: {e}")))?;
        found.push((Grammar::Lark(lark), "grammar"));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, n)| *n).collect();
        return Err(ApiError::invalid(
            found[1].1,
            format!(
                "only one grammar field may be sent, got {}",
                names.join(", ")
            ),
        ));
    }
    Ok(match found.pop() {
        Some((g, name)) => (Some(g), Some(name.to_string())),
        None => (None, None),
    })
}

/// `stop`: a string or an array of strings.
fn parse_stop(f: &JsonFields<'_>) -> Result<Vec<String>, ApiError> {
    const MAX_STOP: usize = 16;
    let stops = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(wrong_type(&format!("stop[{i}]"), "a string", other)),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(wrong_type("stop", "a string or an array of strings", other)),
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "`stop` may hold at most {MAX_STOP} strings, got {}",
                stops.len()
            ),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    Ok(stops)
}

/// Parses a chat completion request.
pub fn parse_chat(body: &Value, defaults: &Defaults) -> Result<ChatRequest, ApiError> {
    let f = JsonFields::new(body, "")?;
    let mut common = parse_common(&f, defaults)?;
    let raw_messages = f
        .array("messages")?
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if raw_messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let messages = raw_messages
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;

    let tools = match f.array("tools")? {
        None => None,
        Some(list) => {
            if list.len() > MAX_TOOLS {
                return Err(ApiError::invalid(
                    "tools",
                    format!(
                        "`tools` has {} entries; the limit is {MAX_TOOLS}",
                        list.len()
                    ),
                ));
            }
            for (i, t) in list.iter().enumerate() {
                check_tool(i, t)?;
            }
            Some(list.clone())
        }
    };
    // `required` and a named function force a call: the reply is constrained to a tool call
    // whose arguments match the tool's schema (the handler builds the grammar).
    let named = |name: &str| -> Result<Vec<Value>, ApiError> {
        let found: Vec<Value> = tools
            .iter()
            .flatten()
            .filter(|t| t["function"]["name"].as_str() == Some(name))
            .cloned()
            .collect();
        if found.is_empty() {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` names the function \"{name}\", which `tools` does not offer"
                ),
            ));
        }
        Ok(found)
    };
    let (tool_choice, forced_tools) = match f.get("tool_choice") {
        None => ("auto", None),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ("auto", None),
            "none" => ("none", None),
            "required" => match &tools {
                Some(list) if !list.is_empty() => ("required", Some(list.clone())),
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "`tool_choice: \"required\"` needs `tools` to call",
                    ))
                }
            },
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be \"auto\", \"none\", \"required\" or a named \
                         function, got \"{other}\""
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|fun| fun["name"].as_str()) {
            Some(name) => ("required", Some(named(name)?)),
            None => return Err(ApiError::invalid(
                "tool_choice.function.name",
                "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": …}}",
            )),
        },
        Some(other) => return Err(wrong_type("tool_choice", "a string or an object", other)),
    };
    f.bool("parallel_tool_calls")?;
    if let Some(rf) = f.object("response_format")? {
        let grammar = match rf.str("type")? {
            None | Some("text") => None,
            Some("json_object") => Some(Grammar::JsonObject),
            Some("json_schema") => {
                let Some(js) = rf.object("json_schema")? else {
                    return Err(ApiError::invalid(
                        "response_format.json_schema",
                        "`response_format.json_schema` is required with type \"json_schema\"",
                    ));
                };
                // OpenAI's `strict` asks for exactly what constrained decoding always gives.
                js.bool("strict")?;
                js.str("name")?;
                match js.get("schema") {
                    Some(schema @ Value::Object(_)) => Some(Grammar::JsonSchema(schema.clone())),
                    Some(Value::Bool(true)) | None => Some(Grammar::JsonObject),
                    Some(other) => {
                        return Err(wrong_type(
                            "response_format.json_schema.schema",
                            "a JSON Schema object",
                            other,
                        ))
                    }
                }
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                        "`response_format.type` must be \"text\", \"json_object\" or \
                         \"json_schema\", got \"{other}\""
                    ),
                ))
            }
        };
        if let Some(g) = grammar {
            if common.params.grammar.is_some() {
                return Err(ApiError::invalid(
                    "response_format",
                    "`response_format` and a grammar field cannot be combined; send one",
                ));
            }
            common.params.grammar = Some(g);
            common.grammar_field = Some("response_format".into());
        }
    }

    let mut template_kwargs = match f.object("chat_template_kwargs")? {
        Some(k) => k.obj.clone(),
        None => Map::new(),
    };
    let enable_thinking = match template_kwargs.remove("enable_thinking") {
        None | Some(Value::Null) => thinking_switch(&messages),
        Some(Value::Bool(b)) => Some(b),
        Some(other) => {
            return Err(wrong_type(
                "chat_template_kwargs.enable_thinking",
                "a boolean",
                &other,
            ))
        }
    };
    if forced_tools.is_some() && common.params.grammar.is_some() {
        return Err(ApiError::invalid(
            "tool_choice",
            "a forced tool call cannot be combined with `response_format` or a grammar",
        ));
    }
    Ok(ChatRequest {
        common,
        messages,
        enable_thinking,
        // Forced calls still show the template every tool.
        tools: tools.filter(|_| tool_choice != "none"),
        forced_tools,
        template_kwargs,
    })
}

/// `/think` or `/no_think` in the system prompt (SmolLM3's switches; `/no_think` wins, as in
/// its template). Passed on as `enable_thinking`, so templates that only read the variable
/// follow the switch too.
fn thinking_switch(messages: &[ApiMessage]) -> Option<bool> {
    let system = messages.first().filter(|m| m.role == "system")?;
    if system.content.contains("/no_think") {
        Some(false)
    } else if system.content.contains("/think") {
        Some(true)
    } else {
        None
    }
}

fn check_tool(i: usize, t: &Value) -> Result<(), ApiError> {
    let path = format!("tools[{i}]");
    let f = JsonFields::new(t, &path)?;
    match f.str("type")? {
        None | Some("function") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                format!("{path}.type"),
                format!("tool type \"{other}\" is not supported; only \"function\""),
            ))
        }
    }
    let function = f
        .object("function")?
        .ok_or_else(|| ApiError::invalid(format!("{path}.function"), "a tool needs `function`"))?;
    match function.str("name")? {
        Some(name) if !name.is_empty() => {}
        _ => {
            return Err(ApiError::invalid(
                format!("{path}.function.name"),
                "a tool function needs a non-empty `name`",
            ))
        }
    }
    function.str("description")?;
    function.object("parameters")?;
    Ok(())
}

/// `content`: a string, or an array of `{"type": "text", "text": …}` parts (joined by newlines)
/// and, when `files` is allowed, `{"type": "file", …}` parts.
fn parse_content(
    f: &JsonFields<'_>,
    required: bool,
    files: Option<&mut Vec<InlineFile>>,
) -> Result<String, ApiError> {
    let param = f.path("content");
    let content = parse_content_value(f, &param, required, files)?;
    if let Some(what) = smolchat_service::validation::not_text(&content) {
        return Err(ApiError::invalid(
            &param,
            format!("`{param}` contains {what}, which is not text; remove it"),
        ));
    }
    Ok(content)
}

/// A `file` content part's file: `filename` and `file_data` (base64, bare or as a `data:` URL).
fn parse_file_part(p: &JsonFields<'_>) -> Result<InlineFile, ApiError> {
    use base64::Engine as _;
    let file = p
        .object("file")?
        .ok_or_else(|| ApiError::invalid(p.path("file"), "a file part needs `file`"))?;
    if file.str("file_id")?.is_some() {
        return Err(ApiError::unsupported(
            file.path("file_id"),
            "`file_id` is not supported (smolchat has no /v1/files): send the file itself as \
             `file_data` (base64, or a data: URL) with its `filename`",
        ));
    }
    let name = file
        .str("filename")?
        .filter(|n| !n.trim().is_empty())
        .ok_or_else(|| {
            ApiError::invalid(
                file.path("filename"),
                "a file part needs `filename` (its extension gives the file's type)",
            )
        })?;
    let data = file.str("file_data")?.ok_or_else(|| {
        ApiError::invalid(
            file.path("file_data"),
            "a file part needs `file_data` (base64)",
        )
    })?;
    let b64 = match data.strip_prefix("data:") {
        Some(rest) => rest.split_once(";base64,").map(|(_, b)| b).ok_or_else(|| {
            ApiError::invalid(
                file.path("file_data"),
                "a data: URL in `file_data` must be base64 (data:<type>;base64,…)",
            )
        })?,
        None => data,
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| {
            ApiError::invalid(
                file.path("file_data"),
                format!("`file_data` is not base64: {e}"),
            )
        })?;
    Ok(InlineFile {
        name: name.to_string(),
        data: bytes,
    })
}

fn parse_content_value(
    f: &JsonFields<'_>,
    param: &str,
    required: bool,
    mut files: Option<&mut Vec<InlineFile>>,
) -> Result<String, ApiError> {
    let param = param.to_string();
    match f.get("content") {
        None if required => Err(ApiError::invalid(&param, format!("`{param}` is required"))),
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let p = JsonFields::new(part, &format!("{param}[{j}]"))?;
                match p.str("type")? {
                    Some("text") => texts.push(p.str("text")?.unwrap_or_default().to_string()),
                    Some("file") if files.is_some() => {
                        let file = parse_file_part(&p)?;
                        if let Some(files) = files.as_deref_mut() {
                            files.push(file);
                        }
                    }
                    other => {
                        return Err(ApiError::unsupported(
                            p.path("type"),
                            format!(
                                "content part type {} is not supported here; only \"text\"{}",
                                other.map_or("(missing)".to_string(), |t| format!("\"{t}\"")),
                                if files.is_some() {
                                    " and \"file\""
                                } else {
                                    " (files go in user messages)"
                                }
                            ),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(wrong_type(
            &param,
            "a string or an array of text parts",
            other,
        )),
    }
}

fn parse_message(i: usize, v: &Value) -> Result<ApiMessage, ApiError> {
    let path = format!("messages[{i}]");
    let f = JsonFields::new(v, &path)?;
    let role = f
        .str("role")?
        .ok_or_else(|| ApiError::invalid(f.path("role"), format!("`{path}.role` is required")))?;
    let role = match role {
        // OpenAI's newer name for the system role.
        "developer" => "system",
        "system" | "user" | "assistant" | "tool" => role,
        other => {
            return Err(ApiError::invalid(
                f.path("role"),
                format!(
                "`{path}.role` must be system, developer, user, assistant or tool, not \"{other}\""
            ),
            ))
        }
    };
    let mut tool_calls = Vec::new();
    if role == "assistant" {
        for (j, c) in f.array("tool_calls")?.into_iter().flatten().enumerate() {
            let cp = format!("{path}.tool_calls[{j}]");
            let cf = JsonFields::new(c, &cp)?;
            let function = cf.object("function")?.ok_or_else(|| {
                ApiError::invalid(format!("{cp}.function"), "a tool call needs `function`")
            })?;
            let name = function.str("name")?.ok_or_else(|| {
                ApiError::invalid(format!("{cp}.function.name"), "a tool call needs a `name`")
            })?;
            let arguments = match function.get("arguments") {
                None => "{}".to_string(),
                Some(Value::String(s)) => s.clone(),
                // Some clients send the object itself.
                Some(obj @ Value::Object(_)) => obj.to_string(),
                Some(other) => {
                    return Err(wrong_type(
                        &format!("{cp}.function.arguments"),
                        "a string",
                        other,
                    ))
                }
            };
            tool_calls.push(CallIn {
                id: cf.str("id")?.map(str::to_string),
                name: name.to_string(),
                arguments,
            });
        }
    }
    // An assistant turn may be only tool calls; every other role has content. Only a user
    // message may carry files.
    let mut files = Vec::new();
    let content = parse_content(
        &f,
        role != "assistant",
        (role == "user").then_some(&mut files),
    )?;
    Ok(ApiMessage {
        role: role.to_string(),
        content,
        files,
        reasoning_content: f.str("reasoning_content")?.map(str::to_string),
        tool_calls,
        tool_call_id: f.str("tool_call_id")?.map(str::to_string),
        name: f.str("name")?.map(str::to_string),
    })
}

/// Parses a text completion request.
pub fn parse_completion(
    body: &Value,
    defaults: &Defaults,
) -> Result<TextCompletionRequest, ApiError> {
    let f = JsonFields::new(body, "")?;
    let common = parse_common(&f, defaults)?;
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::unsupported(
            "echo",
            "`echo` is not supported by smolchat",
        ));
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "`suffix` is not supported by smolchat",
        ));
    }
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => PromptIn::Text(s.clone()),
        Some(Value::Array(items)) => parse_prompt_array(items)?,
        Some(other) => {
            return Err(wrong_type(
                "prompt",
                "a string, an array of token ids, or an array of one string",
                other,
            ))
        }
    };
    Ok(TextCompletionRequest { common, prompt })
}

fn parse_prompt_array(items: &[Value]) -> Result<PromptIn, ApiError> {
    let one = "smolchat completes one prompt per request";
    match items {
        [Value::String(s)] => Ok(PromptIn::Text(s.clone())),
        [Value::Array(ids)] => token_ids(ids, "prompt[0]"),
        [] => Err(ApiError::invalid("prompt", "`prompt` is empty")),
        _ if items.iter().all(Value::is_number) => token_ids(items, "prompt"),
        _ => Err(ApiError::unsupported(
            "prompt",
            format!("`prompt` holds {} prompts; {one}", items.len()),
        )),
    }
}

fn token_ids(items: &[Value], param: &str) -> Result<PromptIn, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        format!("`{param}[{i}]` must be a token id (an integer >= 0), got {v}"),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(PromptIn::Tokens)
}

/// Serializes like Python's `json.dumps` (`", "` and `": "` separators, non-ASCII kept), the form
/// Hermes-style models such as SmolLM3 saw tool calls in during training.
pub fn python_json(v: &Value) -> String {
    let mut out = String::new();
    write_python_json(&mut out, v);
    out
}

fn write_python_json(out: &mut String, v: &Value) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(out, item);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// Shapes the request messages for the template. Earlier tool calls go in the form the template
/// reads: as OpenAI/transformers-shaped `tool_calls` (arguments decoded into objects) when the
/// template mentions `tool_calls`, otherwise written into the content as the `<tool_call>` blocks
/// the model itself produces (SmolLM3's template only prints `content`), so the model sees its
/// own earlier calls. Tool results get the `name` of the call they answer when they lack one.
pub fn template_messages(
    messages: &[ApiMessage],
    template_reads_tool_calls: bool,
) -> Vec<ChatMessage> {
    let mut names: Vec<(String, String)> = Vec::new();
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let mut msg = ChatMessage::new(m.role.as_str(), m.content.as_str());
        msg.reasoning_content = m.reasoning_content.clone();
        msg.tool_call_id = m.tool_call_id.clone();
        msg.name = m.name.clone();
        if m.role == "tool" && msg.name.is_none() {
            msg.name = m
                .tool_call_id
                .as_ref()
                .and_then(|id| names.iter().find(|(i, _)| i == id))
                .map(|(_, n)| n.clone());
        }
        if !m.tool_calls.is_empty() {
            let decoded: Vec<(String, Value)> = m
                .tool_calls
                .iter()
                .map(|c| {
                    let args = serde_json::from_str::<Value>(&c.arguments)
                        .unwrap_or_else(|_| Value::String(c.arguments.clone()));
                    (c.name.clone(), args)
                })
                .collect();
            for c in &m.tool_calls {
                if let Some(id) = &c.id {
                    names.push((id.clone(), c.name.clone()));
                }
            }
            if template_reads_tool_calls {
                let calls = m
                    .tool_calls
                    .iter()
                    .zip(&decoded)
                    .map(|(c, (name, args))| {
                        let mut call = Map::new();
                        if let Some(id) = &c.id {
                            call.insert("id".into(), Value::String(id.clone()));
                        }
                        call.insert("type".into(), Value::String("function".into()));
                        let mut function = Map::new();
                        function.insert("name".into(), Value::String(name.clone()));
                        function.insert("arguments".into(), args.clone());
                        call.insert("function".into(), Value::Object(function));
                        Value::Object(call)
                    })
                    .collect();
                msg.tool_calls = Some(Value::Array(calls));
            } else {
                let mut content = msg.content.trim_end().to_string();
                for (name, args) in &decoded {
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    let mut call = Map::new();
                    call.insert("name".into(), Value::String(name.clone()));
                    call.insert("arguments".into(), args.clone());
                    content.push_str(&format!(
                        "<tool_call>\n{}\n</tool_call>",
                        python_json(&Value::Object(call))
                    ));
                }
                msg.content = content;
            }
        }
        out.push(msg);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn defaults() -> Defaults {
        Defaults {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 40,
        }
    }

    fn chat(body: Value) -> Result<ChatRequest, ApiError> {
        parse_chat(&body, &defaults())
    }

    #[test]
    fn fields_and_defaults() {
        let r = chat(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0, "top_p": 0.5, "seed": -1, "stop": "END",
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "max_tokens": 7,
            "stream": true, "stream_options": {"include_usage": true},
            "logit_bias": {"1": 2}, "user": "u", "unknown_extra": [1, 2]
        }))
        .unwrap();
        let c = &r.common;
        assert_eq!(c.model.as_deref(), Some("m"));
        assert!(c.stream && c.include_usage);
        assert_eq!(c.params.temperature, 0.0);
        assert_eq!(c.params.top_p, 0.5);
        assert_eq!(c.params.top_k, 40);
        assert_eq!(c.params.seed, Some(u64::MAX));
        assert_eq!(c.params.stop_strings, vec!["END".to_string()]);
        assert_eq!(c.params.presence_penalty, 0.5);
        assert_eq!(c.params.frequency_penalty, -0.5);
        assert_eq!(c.max_tokens, Some(7));
        let r = chat(json!({"messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3, "stop": ["a", "b"], "n": 1}))
        .unwrap();
        assert_eq!(r.common.max_tokens, Some(3));
        assert_eq!(r.common.params.stop_strings.len(), 2);
        assert_eq!(r.common.params.temperature, 0.8);
        assert!(!r.common.stream);
    }

    #[test]
    fn type_errors_name_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for (field, value, param) in [
            ("temperature", json!("hot"), "temperature"),
            ("max_tokens", json!(1.5), "max_tokens"),
            ("max_tokens", json!(-1), "max_tokens"),
            ("max_tokens", json!(0), "max_tokens"),
            ("stream", json!("yes"), "stream"),
            ("stop", json!(3), "stop"),
            ("stop", json!(["ok", 3]), "stop[1]"),
            ("n", json!(9), "n"),
            ("n", json!(0), "n"),
            ("top_p", json!(0), "top_p"),
            ("presence_penalty", json!(3), "presence_penalty"),
            ("seed", json!("x"), "seed"),
            ("tool_choice", json!("required"), "tool_choice"),
            ("logprobs", json!("yes"), "logprobs"),
            ("logprobs", json!(21), "logprobs"),
            ("top_logprobs", json!(3), "top_logprobs"),
            ("logit_bias", json!([1]), "logit_bias"),
        ] {
            let mut body = json!({"messages": user.clone()});
            body[field] = value;
            let e = chat(body).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{field}: {e}");
            assert_eq!(e.param.as_deref(), Some(param), "{field}: {e}");
            assert!(e.message.contains(param), "{field}: {e}");
        }
        let e = chat(json!({"messages": [{"role": "user", "content": 5}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = chat(json!({"messages": [{"role": "robot", "content": "x"}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = chat(json!({"messages": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = chat(json!([1])).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let e = chat(json!({"messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"enable_thinking": "no"}}))
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("chat_template_kwargs.enable_thinking")
        );
    }

    #[test]
    fn thinking_switches() {
        let with_system = |s: &str| json!({"messages": [{"role": "system", "content": s}, {"role": "user", "content": "x"}]});
        assert_eq!(
            chat(with_system("Be brief.")).unwrap().enable_thinking,
            None
        );
        assert_eq!(
            chat(with_system("Be brief. /no_think"))
                .unwrap()
                .enable_thinking,
            Some(false)
        );
        assert_eq!(
            chat(with_system("/think")).unwrap().enable_thinking,
            Some(true)
        );
        let mut body = with_system("/think");
        body["chat_template_kwargs"] = json!({"enable_thinking": false, "custom": 1});
        let r = chat(body).unwrap();
        assert_eq!(r.enable_thinking, Some(false));
        assert_eq!(r.template_kwargs.get("custom"), Some(&json!(1)));
    }

    #[test]
    fn tools_and_tool_choice() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let base = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools});
        assert!(chat(base.clone()).unwrap().parse_tool_calls());
        let mut none = base.clone();
        none["tool_choice"] = json!("none");
        let r = chat(none).unwrap();
        assert!(!r.parse_tool_calls() && r.tools.is_none());
        let mut bad = base;
        bad["tools"] = json!([{"type": "function", "function": {"description": "no name"}}]);
        let e = chat(bad).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
    }

    #[test]
    fn tool_history_reaches_the_template() {
        let r = chat(json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ]}))
        .unwrap();
        // A template that prints only content gets Hermes-style blocks.
        let plain = template_messages(&r.messages, false);
        assert_eq!(
            plain[1].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert!(plain[1].tool_calls.is_none());
        assert_eq!(plain[2].name.as_deref(), Some("get_weather"));
        // A template that reads tool_calls gets them with decoded arguments.
        let native = template_messages(&r.messages, true);
        assert_eq!(native[1].content, "");
        assert_eq!(
            native[1].tool_calls,
            Some(json!([{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]))
        );
    }

    #[test]
    fn completion_prompts() {
        let p = |v: Value| parse_completion(&json!({"prompt": v}), &defaults());
        assert_eq!(p(json!("hi")).unwrap().prompt, PromptIn::Text("hi".into()));
        assert_eq!(
            p(json!(["hi"])).unwrap().prompt,
            PromptIn::Text("hi".into())
        );
        assert_eq!(
            p(json!([1, 2])).unwrap().prompt,
            PromptIn::Tokens(vec![1, 2])
        );
        assert_eq!(p(json!([[3]])).unwrap().prompt, PromptIn::Tokens(vec![3]));
        assert_eq!(
            p(json!(["a", "b"])).unwrap_err().param.as_deref(),
            Some("prompt")
        );
        assert_eq!(p(json!(5)).unwrap_err().param.as_deref(), Some("prompt"));
        let e = parse_completion(&json!({"prompt": "x", "echo": true}), &defaults()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
    }
}
