//! The one pipeline every API dialect's request goes through once parsed: the model and
//! admin-only checks, files read, the prompt built by the one prompt builder, and the request
//! submitted to the completions service.

use super::*;

/// The model a request's `model` means, loaded first when it is not (the request waits while
/// it loads). The one place every API dialect turns a model name into a model.
pub(crate) async fn resolve_model(p: &Platform, name: &str) -> Result<Arc<ServedModel>, ApiError> {
    p.models().resolve(name).await.map_err(model_error)
}

/// A model that cannot be had, as the API answers it: an unknown name is 404
/// `model_not_found`, a model that cannot load now is 503.
pub(crate) fn model_error(e: ModelError) -> ApiError {
    match e {
        ModelError::NotFound { name, available } => ApiError::model_not_found(&name, &available),
        e @ (ModelError::NoRoom { .. } | ModelError::Busy { .. }) => WebError::TooManyRequests {
            message: e.to_string(),
            retry_after_s: 5,
        }
        .into(),
        e => ApiError::unavailable(e.to_string()),
    }
}

/// The default sampling of a request naming `model`: the model's own where its entry sets
/// it, `[sampling]`'s otherwise.
pub(crate) fn defaults(p: &Platform, model: Option<&str>) -> Defaults {
    let (temperature, top_p, top_k) = p.models().sampling_defaults(model.unwrap_or(""));
    Defaults {
        temperature,
        top_p,
        top_k,
    }
}

/// The model a request names (lenient like llama-server: none or an empty name is the
/// default model), loaded when it is not.
pub(crate) async fn check_model(
    p: &Platform,
    common: &GenerationOptions,
) -> Result<Arc<ServedModel>, ApiError> {
    resolve_model(p, common.model.as_deref().unwrap_or("")).await
}

/// A raw `/v1/completions` prompt: BOS when the tokenizer asks for it, special tokens written
/// in the prompt parsed as llama-server does. The client writes the whole prompt, markup
/// included, so there is no template text to tell apart from its own (chat requests, where
/// there is, keep message text out of the control tokens: see [`chat_prompt`]).
pub(crate) fn encode(m: &ServedModel, text: &str) -> Result<Vec<u32>, ApiError> {
    m.tokenizer()
        .encode_prompt(text)
        .map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
}

/// A chat request, as every chat-shaped API route's body becomes the one typed request
/// ([`request::chat_request`]: one set of checks), with a forced tool call turned into its
/// grammar, the admin-only fields checked, and the model it names (loaded when it is not).
/// `grammar_field` names the field a grammar came from in the client's API.
pub(crate) async fn checked_chat(
    state: &web::Data<AppState>,
    http: &HttpRequest,
    generation: GenerationBody,
    mut chat: ChatBody,
    grammar_field: Option<&str>,
) -> Result<(request::ChatRequest, Arc<ServedModel>), ApiError> {
    let p = &state.platform;
    let named = generation.model.clone();
    // Server-side tools become the request's tools (so `tool_choice` may name them) before the
    // one set of checks.
    let server_tools = match request::server_tools(chat.server_tools.take().as_ref())? {
        None => None,
        Some(_) if chat.tools.is_some() => {
            return Err(ApiError::invalid(
                "server_tools",
                "send either `tools` (you run the calls) or `server_tools` (the server runs \
                 them), not both",
            ))
        }
        Some(ask) => {
            let specs = resolve_server_tools(state, http, ask)?;
            chat.tools = Some(specs.iter().map(|s| s.to_openai()).collect());
            Some(specs.into_iter().map(|s| s.name).collect())
        }
    };
    let mut req = request::chat_request(generation, chat, &defaults(p, named.as_deref()))?;
    req.server_tools = server_tools;
    if let (Some(name), Some(_)) = (grammar_field, &req.common.grammar_field) {
        req.common.grammar_field = Some(name.to_string());
    }
    check_admin_only(state, http, &req.common)?;
    let model = check_model(p, &req.common).await?;
    force_tool_call(&model, &mut req);
    Ok((req, model))
}

/// The tools a request's `server_tools` asks for, as the caller's key may have them.
fn resolve_server_tools(
    state: &AppState,
    http: &HttpRequest,
    ask: request::ServerToolsAsk,
) -> Result<Vec<smolchat_service::tools::ToolSpec>, ApiError> {
    let conversations = state.platform.conversations();
    let caller = api_owner(http);
    let names = match ask {
        request::ServerToolsAsk::Named(names) => names,
        request::ServerToolsAsk::All => conversations
            .api_tool_specs(caller.as_ref())
            .into_iter()
            .map(|s| s.name)
            .collect(),
    };
    conversations
        .api_tools(caller.as_ref(), &names)
        .map_err(|e| match e {
            ConversationError::Forbidden(m) => ApiError::forbidden("server_tools", m),
            ConversationError::Invalid { message, .. } => {
                ApiError::invalid("server_tools", message)
            }
            other => ApiError::internal(other.to_string()),
        })
}

/// The request's `model`, or the model's id when it names none.
pub(crate) fn model_name(m: &ServedModel, common: &GenerationOptions) -> String {
    common
        .model
        .clone()
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| m.id().to_string())
}

/// A chat request's prompt from the one prompt builder, its files read first (see
/// [`read_files`]). Rendering and tokenizing a long conversation takes a while, so it runs off
/// the event loop.
pub(crate) async fn build_chat_prompt(
    state: &web::Data<AppState>,
    http: &HttpRequest,
    model: &Arc<ServedModel>,
    req: &request::ChatRequest,
) -> Result<Prompt, ApiError> {
    let mut render = req.clone();
    // A model configured not to think is told so, whatever the request asked.
    if model.thinking_kept_off() {
        render.enable_thinking = Some(false);
    }
    read_files(state, model, &client_identity(http), &mut render).await?;
    let model = Arc::clone(model);
    web::block(move || {
        chat_prompt(
            model.prompt_builder(),
            model.template(),
            &render,
            chrono::Local::now().date_naive(),
        )
    })
    .await
    .map_err(|e| ApiError::internal(format!("prompt task: {e}")))?
}

/// Places the files of `req`'s user messages (`file` content parts) into their text, in the one
/// format every interface uses (`smolchat_service::files`): each checked and read by the
/// platform's document reader (a PDF in its sandboxed child process, so many at once per
/// caller `who`), at most `limits.max_files_per_message` a message.
pub(crate) async fn read_files(
    state: &web::Data<AppState>,
    model: &ServedModel,
    who: &str,
    req: &mut request::ChatRequest,
) -> Result<(), ApiError> {
    use smolchat_service::documents::ReadError;
    use smolchat_service::files;
    let p = &state.platform;
    let max_files = p.config().limits.max_files_per_message;
    for (i, m) in req.messages.iter_mut().enumerate() {
        if m.files.is_empty() {
            continue;
        }
        let param = format!("messages[{i}].content");
        if m.files.len() > max_files {
            return Err(ApiError::invalid(
                &param,
                format!(
                    "a message may carry at most {max_files} files \
                     (limits.max_files_per_message), got {}",
                    m.files.len()
                ),
            ));
        }
        let mut read = Vec::with_capacity(m.files.len());
        for f in std::mem::take(&mut m.files) {
            let extracted =
                p.read_inline_file(who, &f.name, f.data)
                    .await
                    .map_err(|e| match e {
                        ReadError::File(e) => ApiError::invalid(&param, e.to_string()),
                        ReadError::DoesNotFit { at_least } => ApiError::invalid(
                            &param,
                            format!(
                                "{:?} is at least {at_least} tokens of text; the model's context \
                             window is {} tokens: attach a shorter part of it",
                                f.name,
                                model.info().context_window
                            ),
                        ),
                        ReadError::Busy {
                            message,
                            retry_after_s,
                        } => WebError::TooManyRequests {
                            message,
                            retry_after_s,
                        }
                        .into(),
                        ReadError::Unavailable(m) => WebError::Unavailable(m).into(),
                    })?;
            let name =
                files::check_name(&f.name).map_err(|e| ApiError::invalid(&param, e.to_string()))?;
            read.push((name, extracted));
        }
        let texts: Vec<files::FileText<'_>> = read
            .iter()
            .map(|(name, e)| files::FileText {
                name,
                kind: e.kind.as_str(),
                text: &e.text,
            })
            .collect();
        m.content = files::message_with_files(&texts, &m.content);
    }
    Ok(())
}

/// `tool_choice` `required` or named: constrains the reply to one call of the forced tools,
/// with arguments that match their parameter schemas.
pub(crate) fn force_tool_call(m: &ServedModel, req: &mut request::ChatRequest) {
    if let Some(tools) = &req.forced_tools {
        let calls: Vec<(String, Value)> = tools
            .iter()
            .map(|t| {
                let f = &t["function"];
                (
                    f["name"].as_str().unwrap_or_default().to_string(),
                    f.get("parameters")
                        .cloned()
                        .unwrap_or(json!({"type": "object"})),
                )
            })
            .collect();
        req.common.params.grammar = Some(smolchat_text::constraint::tool_call_grammar(
            m.tokenizer(),
            &calls,
        ));
        req.common.grammar_field = Some("tool_choice".into());
    }
}

/// What a chat request asks the template to render: messages shaped for it (see
/// [`request::template_messages`]), the thinking switch, the offered tools and any other
/// `chat_template_kwargs`.
pub fn chat_render_input(
    template: &ChatTemplate,
    req: &request::ChatRequest,
    date: chrono::NaiveDate,
) -> (Vec<ChatMessage>, RenderOptions) {
    let reads_tool_calls = template.source().contains("tool_calls");
    let messages = request::template_messages(&req.messages, reads_tool_calls);
    let mut opts = RenderOptions::new(date);
    opts.enable_thinking = req.enable_thinking;
    opts.tools = req.tools.clone();
    opts.extra = req.template_kwargs.clone();
    (messages, opts)
}

/// A chat request's prompt, built by the one prompt builder. A template that refuses the
/// messages (wrong role order, …) is the client's error.
pub fn chat_prompt(
    builder: PromptBuilder<'_>,
    template: &ChatTemplate,
    req: &request::ChatRequest,
    date: chrono::NaiveDate,
) -> Result<Prompt, ApiError> {
    let (messages, opts) = chat_render_input(template, req, date);
    builder.build(&messages, &opts).map_err(|e| match e {
        TextError::Template(_) => ApiError::invalid(
            "messages",
            format!("the chat template refused the messages: {e}"),
        ),
        other => ApiError::internal(format!("prompt: {other}")),
    })
}

/// Checks the prompt against the context window and submits it through the one completions
/// service, as the API caller `user` (see [`client_identity`]) in the cache partition
/// `cache_salt`. Every API route of this server generates through here.
pub(crate) async fn submit(
    state: &web::Data<AppState>,
    model: &Arc<ServedModel>,
    common: GenerationOptions,
    cache_salt: String,
    user: ApiUser,
    prompt: Vec<u32>,
    prompt_param: &str,
) -> Result<Completion, ApiError> {
    if !state.ready.load(Ordering::Acquire) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            prompt_param,
            format!("`{prompt_param}` is empty"),
        ));
    }
    if let Some(grammar) = common.params.grammar.clone() {
        // Compiled here, off the event loop, so a schema or grammar that cannot be followed is
        // the client's 400 before anything is queued (the model thread compiles it again).
        let field = common
            .grammar_field
            .clone()
            .unwrap_or_else(|| "response_format".into());
        let model = Arc::clone(model);
        web::block(move || smolchat_text::constraint::check(model.tokenizer(), &grammar))
            .await
            .map_err(|e| ApiError::internal(format!("grammar task: {e}")))?
            .map_err(|e| ApiError::invalid(&field, format!("`{field}`: {e}")))?;
    }
    let completion = model
        .submit(CompletionRequest {
            prompt,
            params: common.params,
            // Without a limit, the reply may fill the context (the scheduler clamps to its own).
            max_tokens: common.max_tokens,
            cache: CacheUse::Partition(cache_salt),
            // Anonymous callers are already their address (see `client_identity`).
            user: Some(user.id.clone()),
            group: None,
            usage_owner: Some(user.id),
            key: user.key,
        })
        .await
        .map_err(|e| match e {
            smolchat_service::completions::SubmitError::ContextOverflow {
                prompt_tokens,
                window,
            } => ApiError::context_exceeded(prompt_tokens, window, prompt_param),
            other => ApiError::from(other),
        })?;
    Ok(completion)
}

/// A generation that failed: a grammar the reply could not follow any further, or a request
/// the model cannot serve as asked, is the client's fault (400); the engine's is the server's.
pub(crate) fn generation_failed(failure: &Failure) -> ApiError {
    match failure {
        Failure::Constraint(_) => ApiError::invalid(
            "response_format",
            format!("the grammar could not be followed: {failure}"),
        ),
        Failure::Request(_) => ApiError::bad_body(format!("generation failed: {failure}")),
        Failure::Engine(_) => ApiError::internal(format!("generation failed: {failure}")),
    }
}

pub(crate) fn log_finished(id: RequestId, s: &GenSummary) {
    tracing::info!(
        request = id,
        reason = ?s.reason,
        prompt_tokens = s.prompt_tokens,
        cached_tokens = s.cached_tokens,
        completion_tokens = s.completion_tokens,
        ttft_ms = s.ttft_ms,
        generation_ms = s.generation_ms,
        "API completion finished"
    );
}

/// What every dialect tells a client whose reply's worker stopped before the reply ended.
pub(crate) const WORKER_GONE: &str = "the model worker stopped before the reply was finished";

/// A completion run to its end for an answer given whole (every dialect's non-streamed path):
/// each piece of text handed to `piece` with its log-probabilities (when asked), then how it
/// ended. A reply that ended in error is the request's error; a finished one is logged.
pub(crate) async fn collect(
    mut completion: Completion,
    mut piece: impl FnMut(&str, Option<smolchat_text::sampling::TokenLogprobs>),
) -> Result<GenSummary, ApiError> {
    use smolchat_service::completions::{GenEvent, StopReason};
    while let Some(event) = futures_util::StreamExt::next(&mut completion).await {
        match event {
            GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
            GenEvent::Token { text, logprobs, .. } => piece(&text, logprobs),
            GenEvent::Finished(summary) => {
                if let StopReason::Error(e) = &summary.reason {
                    return Err(generation_failed(e));
                }
                log_finished(completion.id(), &summary);
                return Ok(summary);
            }
        }
    }
    Err(ApiError::unavailable(WORKER_GONE))
}
