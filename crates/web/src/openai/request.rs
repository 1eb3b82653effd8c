//! Checking chat and text completion requests, once for every API dialect: the typed body
//! ([`super::body`], read by serde with each wrong type named by its path) becomes a
//! [`ChatRequest`] or [`TextCompletionRequest`] here, where the rules that are more than a type
//! live: ranges, the one settings check, at most one grammar, the tools a `tool_choice` names,
//! files decoded. Features smolchat cannot honour (`best_of`, `echo`, several prompts) are
//! refused rather than silently dropped.

use serde_json::{Map, Value};

use super::body::{
    ChatBody, CompletionBody, Content, FileBody, GenerationBody, Logprobs, MessageBody, Prompt,
    ResponseFormat, ToolChoice, ToolSpec,
};
use crate::error::ApiError;
use crate::typed::{self, Arguments, Count, Integer, Number, Schema, Strings};
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
    /// `server_tools` (an extension): the tools the server runs itself when the reply calls
    /// them (`tools` then holds their schemas); `None`: calls go back to the client.
    pub server_tools: Option<Vec<String>>,
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

/// What a request asks of `knowledge`: the collections, and how many passages (`None`: the
/// server's `knowledge.top_k`).
#[derive(Debug, Clone, PartialEq)]
pub struct KnowledgeAsk {
    pub collections: Vec<uuid::Uuid>,
    pub k: Option<usize>,
}

/// `knowledge`: an array of collection ids, or `{"collections": [ids], "k": n}`.
pub fn knowledge(v: Option<&Value>) -> Result<Option<KnowledgeAsk>, ApiError> {
    let ids = |list: &Vec<Value>, at: &str| -> Result<Vec<uuid::Uuid>, ApiError> {
        list.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .and_then(|s| uuid::Uuid::parse_str(s).ok())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("{at}[{i}]"),
                            format!("`{at}[{i}]` must be a collection id (a UUID), not {v}"),
                        )
                    })
            })
            .collect()
    };
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(list)) => Ok(Some(KnowledgeAsk {
            collections: ids(list, "knowledge")?,
            k: None,
        })),
        Some(Value::Object(o)) => {
            if let Some(other) = o.keys().find(|k| *k != "collections" && *k != "k") {
                return Err(ApiError::invalid(
                    format!("knowledge.{other}"),
                    format!("`knowledge` takes `collections` and `k`, not `{other}`"),
                ));
            }
            let list = o
                .get("collections")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "knowledge.collections",
                        "`knowledge.collections` must be an array of collection ids",
                    )
                })?;
            let k = match o.get("k") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().filter(|n| (1..=50).contains(n)).ok_or_else(|| {
                    ApiError::invalid("knowledge.k", "`knowledge.k` must be 1 to 50")
                })? as usize),
            };
            Ok(Some(KnowledgeAsk {
                collections: ids(list, "knowledge.collections")?,
                k,
            }))
        }
        Some(other) => Err(ApiError::invalid(
            "knowledge",
            format!(
                "`knowledge` must be an array of collection ids or {{\"collections\": [...], \
                 \"k\": n}}, not {other}"
            ),
        )),
    }
}

/// What a request asks of `server_tools`.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerToolsAsk {
    /// `true`: every tool offered to the caller's key.
    All,
    Named(Vec<String>),
}

/// The most tools one request may name in `server_tools`.
const MAX_SERVER_TOOLS: usize = 64;

/// `server_tools`: `true`, `false` (none), or an array of tool names; the error says which.
pub fn server_tools(v: Option<&Value>) -> Result<Option<ServerToolsAsk>, ApiError> {
    let bad = |m: String| ApiError::invalid("server_tools", m);
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
        Some(Value::Bool(true)) => Ok(Some(ServerToolsAsk::All)),
        Some(Value::Array(items)) => {
            if items.len() > MAX_SERVER_TOOLS {
                return Err(bad(format!(
                    "`server_tools` names {} tools; the limit is {MAX_SERVER_TOOLS}",
                    items.len()
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(name) => Ok(name.clone()),
                    other => Err(bad(format!(
                        "`server_tools[{i}]` must be a tool's name (a string), not {other}"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|names| Some(ServerToolsAsk::Named(names)))
        }
        Some(other) => Err(bad(format!(
            "`server_tools` must be true (every tool offered to your key) or an array of tool \
             names, not {other}"
        ))),
    }
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

/// The most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 8;

/// Parses a chat completion request: the body read as its two typed parts, then checked.
pub fn parse_chat(body: &Value, defaults: &Defaults) -> Result<ChatRequest, ApiError> {
    chat_request(typed::read(body, "")?, typed::read(body, "")?, defaults)
}

/// Parses a text completion request.
pub fn parse_completion(
    body: &Value,
    defaults: &Defaults,
) -> Result<TextCompletionRequest, ApiError> {
    completion_request(typed::read(body, "")?, typed::read(body, "")?, defaults)
}

/// Checks what both endpoints share, once for every dialect: sampling by the one settings
/// check (so a value gets the same verdict and message as on a conversation), the grammar
/// fields, output length, choices and log-probabilities.
pub fn generation_options(
    g: GenerationBody,
    defaults: &Defaults,
) -> Result<GenerationOptions, ApiError> {
    let n = match g.n {
        None => 1,
        Some(Integer(n)) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(Integer(n)) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
            ))
        }
    };
    let top_logprobs = g.top_logprobs.map(|Count(n)| n);
    let logprobs = match g.logprobs {
        None | Some(Logprobs::Flag(false)) => {
            if top_logprobs.is_some_and(|n| n > 0) {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
            None
        }
        Some(Logprobs::Flag(true)) => Some(top_logprobs.unwrap_or(0)),
        Some(Logprobs::Alternatives(n)) => Some(n),
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
    if let Some(Integer(best_of)) = g.best_of.filter(|&Integer(b)| b != 1) {
        return Err(ApiError::unsupported(
            "best_of",
            format!("`best_of` must be 1, got {best_of}"),
        ));
    }
    // Ignored, but checked as OpenAI checks it: token ids to numbers between -100 and 100 (the
    // values' range is their type's).
    for token in g.logit_bias.iter().flat_map(|m| m.keys()) {
        if token.parse::<u32>().is_err() {
            return Err(ApiError::invalid(
                format!("logit_bias.{token}"),
                format!("`logit_bias` keys must be token ids, and {token:?} is not one"),
            ));
        }
    }
    let user = g.user.unwrap_or_default();
    let salt = g.cache_salt.unwrap_or_default();
    // Length-prefixed so that no two different (user, salt) pairs join to the same string.
    let cache_salt = format!("{}:{user}{}:{salt}", user.len(), salt.len());

    let number = |n: Option<Number>, default: f32| n.map_or(default, |Number(x)| x);
    let mut params = SamplingParams {
        temperature: number(g.temperature, defaults.temperature),
        top_p: number(g.top_p, defaults.top_p),
        top_k: g.top_k.map_or(defaults.top_k, |Count(k)| k),
        ..SamplingParams::default()
    };
    params.presence_penalty = number(g.presence_penalty, params.presence_penalty);
    params.frequency_penalty = number(g.frequency_penalty, params.frequency_penalty);
    params.min_p = number(g.min_p, params.min_p);
    params.repetition_penalty = number(
        g.repeat_penalty.or(g.repetition_penalty),
        params.repetition_penalty,
    );
    params.ignore_eos = g.ignore_eos.unwrap_or(params.ignore_eos);
    // Any integer is a valid seed; negative ones keep their bits.
    params.seed = g.seed.map(|Integer(seed)| seed as u64);
    params.stop_strings = check_stop(g.stop.map(|Strings(s)| s).unwrap_or_default())?;
    params.logprobs = logprobs;
    let (grammar, grammar_field) = grammar_fields(
        g.json_schema,
        g.guided_json,
        g.guided_regex,
        g.guided_grammar,
        g.grammar,
    )?;
    params.grammar = grammar;
    smolchat_service::settings::check_sampling(&params).map_err(ApiError::from_settings)?;

    let mut max_tokens = None;
    for (name, value) in [
        ("max_tokens", g.max_tokens),
        ("max_completion_tokens", g.max_completion_tokens),
    ] {
        match value {
            Some(Count(0)) => {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be at least 1"),
                ))
            }
            Some(Count(n)) => max_tokens = Some(n),
            None => {}
        }
    }
    Ok(GenerationOptions {
        model: g.model,
        stream: g.stream.unwrap_or(false),
        include_usage: g
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        params,
        max_tokens,
        grammar_field,
        n,
        cache_salt,
    })
}

/// The grammar fields of llama-server (`json_schema`, GBNF `grammar`) and vLLM (`guided_json`,
/// `guided_regex`, `guided_grammar` in llguidance's Lark dialect); at most one.
fn grammar_fields(
    json_schema: Option<Schema>,
    guided_json: Option<Schema>,
    guided_regex: Option<String>,
    guided_grammar: Option<String>,
    gbnf: Option<String>,
) -> Result<(Option<Grammar>, Option<String>), ApiError> {
    let mut found: Vec<(Grammar, &str)> = Vec::new();
    if let Some(Schema(s)) = json_schema {
        found.push((Grammar::JsonSchema(s), "json_schema"));
    }
    if let Some(Schema(s)) = guided_json {
        found.push((Grammar::JsonSchema(s), "guided_json"));
    }
    if let Some(rx) = guided_regex {
        found.push((Grammar::Regex(rx), "guided_regex"));
    }
    if let Some(lark) = guided_grammar {
        found.push((Grammar::Lark(lark), "guided_grammar"));
    }
    if let Some(gbnf) = gbnf.filter(|g| !g.is_empty()) {
        // llama-server's GBNF, translated into the Lark dialect the constraint compiles.
        let lark = smolchat_text::gbnf::to_lark(&gbnf)
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

/// `stop`: at most [`MAX_STOP`] strings, none empty.
fn check_stop(stops: Vec<String>) -> Result<Vec<String>, ApiError> {
    const MAX_STOP: usize = 16;
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

/// Checks a chat request (every dialect's, once built): its messages, tools and the choice
/// among them, `response_format`, the template's variables.
pub fn chat_request(
    g: GenerationBody,
    c: ChatBody,
    defaults: &Defaults,
) -> Result<ChatRequest, ApiError> {
    let mut common = generation_options(g, defaults)?;
    let raw_messages = c
        .messages
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if raw_messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let messages = raw_messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| check_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;

    let tools = match c.tools {
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
            Some(list)
        }
    };
    // `required` and a named function force a call: the reply is constrained to a tool call
    // whose arguments match the tool's schema (the pipeline builds the grammar).
    let (tool_choice, forced_tools) =
        match c.tool_choice {
            None => ("auto", None),
            Some(ToolChoice::Mode(mode)) => match mode.as_str() {
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
            Some(ToolChoice::Named(Some(name))) => {
                let found: Vec<Value> = tools
                    .iter()
                    .flatten()
                    .filter(|t| t["function"]["name"].as_str() == Some(name.as_str()))
                    .cloned()
                    .collect();
                if found.is_empty() {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!(
                            "`tool_choice` names the function \"{name}\", which `tools` does not \
                         offer"
                        ),
                    ));
                }
                ("required", Some(found))
            }
            Some(ToolChoice::Named(None)) => return Err(ApiError::invalid(
                "tool_choice.function.name",
                "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": …}}",
            )),
        };
    if let Some(grammar) = c
        .response_format
        .map(response_format)
        .transpose()?
        .flatten()
    {
        if common.params.grammar.is_some() {
            return Err(ApiError::invalid(
                "response_format",
                "`response_format` and a grammar field cannot be combined; send one",
            ));
        }
        common.params.grammar = Some(grammar);
        common.grammar_field = Some("response_format".into());
    }

    let mut template_kwargs = c.chat_template_kwargs.unwrap_or_default();
    let enable_thinking = match template_kwargs.remove("enable_thinking") {
        None | Some(Value::Null) => thinking_switch(&messages),
        Some(Value::Bool(b)) => Some(b),
        Some(other) => {
            let param = "chat_template_kwargs.enable_thinking";
            return Err(ApiError::invalid(
                param,
                format!(
                    "`{param}` must be a boolean, not {}",
                    typed::kind_of(&other)
                ),
            ));
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
        server_tools: None,
    })
}

/// `response_format` as the grammar it asks for (`None` for plain text).
fn response_format(rf: ResponseFormat) -> Result<Option<Grammar>, ApiError> {
    match rf.kind.as_deref() {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            let Some(js) = rf.json_schema else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "`response_format.json_schema` is required with type \"json_schema\"",
                ));
            };
            match js.schema {
                Some(schema @ Value::Object(_)) => Ok(Some(Grammar::JsonSchema(schema))),
                Some(Value::Bool(true)) | Some(Value::Null) | None => Ok(Some(Grammar::JsonObject)),
                Some(other) => {
                    let param = "response_format.json_schema.schema";
                    Err(ApiError::invalid(
                        param,
                        format!(
                            "`{param}` must be a JSON Schema object, not {}",
                            typed::kind_of(&other)
                        ),
                    ))
                }
            }
        }
        Some(other) => Err(ApiError::invalid(
            "response_format",
            format!(
                "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\", \
                 got \"{other}\""
            ),
        )),
    }
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
    let spec: ToolSpec = typed::read(t, &path)?;
    match spec.kind.as_deref() {
        None | Some("function") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                format!("{path}.type"),
                format!("tool type \"{other}\" is not supported; only \"function\""),
            ))
        }
    }
    let function = spec
        .function
        .ok_or_else(|| ApiError::invalid(format!("{path}.function"), "a tool needs `function`"))?;
    if function.name.as_deref().is_none_or(str::is_empty) {
        return Err(ApiError::invalid(
            format!("{path}.function.name"),
            "a tool function needs a non-empty `name`",
        ));
    }
    Ok(())
}

/// A `file` content part's file, decoded (`file_data` is base64, bare or as a `data:` URL).
fn decode_file(part: &str, file: Option<FileBody>) -> Result<InlineFile, ApiError> {
    use base64::Engine as _;
    let at = format!("{part}.file");
    let file = file.ok_or_else(|| ApiError::invalid(&at, "a file part needs `file`"))?;
    if file.file_id.is_some() {
        return Err(ApiError::unsupported(
            format!("{at}.file_id"),
            "`file_id` is not supported (smolchat has no /v1/files): send the file itself as \
             `file_data` (base64, or a data: URL) with its `filename`",
        ));
    }
    let name = file
        .filename
        .filter(|n| !n.trim().is_empty())
        .ok_or_else(|| {
            ApiError::invalid(
                format!("{at}.filename"),
                "a file part needs `filename` (its extension gives the file's type)",
            )
        })?;
    let data_param = format!("{at}.file_data");
    let data = file
        .file_data
        .ok_or_else(|| ApiError::invalid(&data_param, "a file part needs `file_data` (base64)"))?;
    let b64 = match data.strip_prefix("data:") {
        Some(rest) => rest.split_once(";base64,").map(|(_, b)| b).ok_or_else(|| {
            ApiError::invalid(
                &data_param,
                "a data: URL in `file_data` must be base64 (data:<type>;base64,…)",
            )
        })?,
        None => data.as_str(),
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| ApiError::invalid(&data_param, format!("`file_data` is not base64: {e}")))?;
    Ok(InlineFile { name, data: bytes })
}

/// `content` as text: a string, or text parts joined by newlines; `file` parts, which only a
/// user message may carry, go to `files`.
fn content_text(
    at: &str,
    content: Option<Content>,
    required: bool,
    mut files: Option<&mut Vec<InlineFile>>,
) -> Result<String, ApiError> {
    let param = format!("{at}.content");
    let text = match content {
        None if required => {
            return Err(ApiError::invalid(&param, format!("`{param}` is required")))
        }
        None => String::new(),
        Some(Content::Text(s)) => s,
        Some(Content::Parts(parts)) => {
            let mut texts = Vec::new();
            for (j, part) in parts.into_iter().enumerate() {
                let at = format!("{param}[{j}]");
                match part.kind.as_deref() {
                    Some("text") => texts.push(part.text.unwrap_or_default()),
                    Some("file") if files.is_some() => {
                        let file = decode_file(&at, part.file)?;
                        if let Some(files) = files.as_deref_mut() {
                            files.push(file);
                        }
                    }
                    other => {
                        return Err(ApiError::unsupported(
                            format!("{at}.type"),
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
            texts.join("\n")
        }
    };
    if let Some(what) = smolchat_service::validation::not_text(&text) {
        return Err(ApiError::invalid(
            &param,
            format!("`{param}` contains {what}, which is not text; remove it"),
        ));
    }
    Ok(text)
}

fn check_message(i: usize, m: MessageBody) -> Result<ApiMessage, ApiError> {
    let at = format!("messages[{i}]");
    let role_param = format!("{at}.role");
    let role = match m.role.as_deref() {
        None => {
            return Err(ApiError::invalid(
                &role_param,
                format!("`{role_param}` is required"),
            ))
        }
        // OpenAI's newer name for the system role.
        Some("developer") => "system",
        Some(role @ ("system" | "user" | "assistant" | "tool")) => role,
        Some(other) => {
            return Err(ApiError::invalid(
                &role_param,
                format!(
                    "`{role_param}` must be system, developer, user, assistant or tool, not \
                     \"{other}\""
                ),
            ))
        }
    };
    let mut tool_calls = Vec::new();
    if role == "assistant" {
        for (j, c) in m.tool_calls.into_iter().flatten().enumerate() {
            let at = format!("{at}.tool_calls[{j}]");
            let function = c.function.ok_or_else(|| {
                ApiError::invalid(format!("{at}.function"), "a tool call needs `function`")
            })?;
            let name = function.name.ok_or_else(|| {
                ApiError::invalid(format!("{at}.function.name"), "a tool call needs a `name`")
            })?;
            tool_calls.push(CallIn {
                id: c.id,
                name,
                arguments: function
                    .arguments
                    .map_or_else(|| "{}".to_string(), |Arguments(a)| a),
            });
        }
    }
    // An assistant turn may be only tool calls; every other role has content. Only a user
    // message may carry files.
    let mut files = Vec::new();
    let content = content_text(
        &at,
        m.content,
        role != "assistant",
        (role == "user").then_some(&mut files),
    )?;
    Ok(ApiMessage {
        role: role.to_string(),
        content,
        files,
        reasoning_content: m.reasoning_content,
        tool_calls,
        tool_call_id: m.tool_call_id,
        name: m.name,
    })
}

/// Checks a text completion request.
pub fn completion_request(
    g: GenerationBody,
    c: CompletionBody,
    defaults: &Defaults,
) -> Result<TextCompletionRequest, ApiError> {
    let common = generation_options(g, defaults)?;
    if c.echo == Some(true) {
        return Err(ApiError::unsupported(
            "echo",
            "`echo` is not supported by smolchat",
        ));
    }
    if c.suffix.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "`suffix` is not supported by smolchat",
        ));
    }
    let prompt = match c.prompt {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Prompt::Text(s)) => PromptIn::Text(s),
        Some(Prompt::Tokens(ids)) => PromptIn::Tokens(ids),
        Some(Prompt::Several(n)) => {
            return Err(ApiError::unsupported(
                "prompt",
                format!("`prompt` holds {n} prompts; smolchat completes one prompt per request"),
            ))
        }
    };
    Ok(TextCompletionRequest { common, prompt })
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
