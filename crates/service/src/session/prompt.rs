//! A conversation's next prompt: the stored conversation and the new user message as the
//! template's messages, rendered and tokenized by the one prompt builder; and the checks every
//! user message meets.

use std::collections::HashMap;

use serde_json::Value;
use smolchat_store::{Conversation, FileRecord, Message, MessageStatus, Role, Store, ToolStep};
use smolchat_text::prompt::{Prompt, PromptBuilder};
use smolchat_text::sampling::SamplingParams;
use smolchat_text::template::{ChatMessage, RenderOptions};
use uuid::Uuid;

use super::SessionError;
use crate::validation::not_text;

pub(super) struct Prepared {
    pub prompt: Vec<u32>,
    pub starts_in_reasoning: bool,
    pub params: SamplingParams,
}

impl Prepared {
    /// The scheduler's request for this prompt: a turn of `conversation` (its cache) for
    /// `owner`, counted against `group` too (a guest's address).
    pub fn request(
        &self,
        conversation: Uuid,
        owner: String,
        group: Option<String>,
    ) -> crate::completions::CompletionRequest {
        crate::completions::CompletionRequest {
            prompt: self.prompt.clone(),
            params: self.params.clone(),
            max_tokens: Some(self.params.max_new_tokens),
            cache: crate::completions::CacheUse::Conversation(conversation),
            user: Some(owner),
            group,
            usage_owner: None,
            key: None,
        }
    }
}

/// The rules every user message meets: not empty, text, within the length limit.
pub fn check_message(content: &str, max_chars: usize) -> Result<(), SessionError> {
    if content.trim().is_empty() {
        return Err(SessionError::EmptyMessage);
    }
    if let Some(what) = not_text(content) {
        return Err(SessionError::NotText(what));
    }
    let chars = content.chars().count();
    if chars > max_chars {
        return Err(SessionError::MessageTooLong {
            chars,
            limit: max_chars,
        });
    }
    Ok(())
}

/// What follows the stored history in a prompt.
#[derive(Debug, Clone, Copy)]
pub(super) enum Turn<'a> {
    /// A new user message (its prompt text).
    Message(&'a str),
    /// The reply being generated goes on after its tool calls: the user message it answers
    /// (prompt text), the reply's raw text so far and its calls, each with its result.
    Continue {
        user: &'a str,
        raw: &'a str,
        steps: &'a [ToolStep],
    },
}

/// The tools of a turn's prompt: those offered, those the reply must call one of, and the calls
/// the stored replies made.
#[derive(Debug, Clone, Default)]
pub(super) struct PromptTools {
    /// The offered tools' specs (OpenAI's shape, as the templates read them); empty: none.
    pub specs: Vec<Value>,
    /// `(name, parameters)` of the tools the reply's first round must call one of (the
    /// conversation's `tool_choice`); empty: the model decides.
    pub forced: Vec<(String, Value)>,
    /// The stored replies' tool calls, by reply.
    pub steps: HashMap<Uuid, Vec<ToolStep>>,
    /// Whether the conversation's owner is an admin (tools for admins only are theirs too).
    pub owner_admin: bool,
}

/// A generated reply as the template's messages: its text up to each round of tool calls, the
/// calls' results as `tool` messages, then the rest (`closed`: the reply ended; an open one is
/// continued by the generation prompt).
fn push_reply(out: &mut Vec<ChatMessage>, raw: &str, steps: &[ToolStep], closed: bool) {
    let mut at = 0;
    let mut i = 0;
    while i < steps.len() {
        let cut = smolchat_store::offset_in(raw, steps[i].raw_offset, at);
        out.push(ChatMessage::generated(&raw[at..cut]));
        let round = steps[i].raw_offset;
        while i < steps.len() && steps[i].raw_offset == round {
            let mut result = ChatMessage::tool(steps[i].result_for_model());
            result.name = Some(steps[i].name.clone());
            out.push(result);
            i += 1;
        }
        at = cut;
    }
    if steps.is_empty() || (closed && at < raw.len()) {
        out.push(ChatMessage::generated(&raw[at..]));
    }
}

/// The messages a stored conversation plus what follows (a new user message, or the reply going
/// on after its tool calls) stand for: the system prompt, the kept history (failed replies left
/// out) and the turn. The one mapping from stored messages to the template's, used by every
/// turn whichever interface sent it.
fn conversation_messages(
    conversation: &Conversation,
    history: &[Message],
    steps: &HashMap<Uuid, Vec<ToolStep>>,
    turn: Turn<'_>,
) -> Vec<ChatMessage> {
    let s = &conversation.settings;
    let mut messages = Vec::new();
    if let Some(system) = s.system_prompt.as_deref().filter(|p| !p.trim().is_empty()) {
        messages.push(ChatMessage::system(system));
    }
    for m in history {
        match m.role {
            // As it was sent: with its files placed in it (`raw`, see `with_files`).
            Role::User => messages.push(ChatMessage::user(m.raw.as_deref().unwrap_or(&m.content))),
            // An imported reply is whoever wrote the file's text, not the model's: guarded like
            // user text, so control tokens typed into it stay text.
            Role::Assistant if m.status != MessageStatus::Error && m.imported => {
                messages.push(ChatMessage::assistant(&m.content))
            }
            // The exact generated text, so the re-rendered prompt matches the cached tokens;
            // with its tool calls' results where they were read.
            Role::Assistant if m.status != MessageStatus::Error => push_reply(
                &mut messages,
                m.raw.as_deref().unwrap_or(&m.content),
                steps.get(&m.id).map_or(&[][..], Vec::as_slice),
                true,
            ),
            Role::System => messages.push(ChatMessage::system(&m.content)),
            _ => {}
        }
    }
    match turn {
        Turn::Message(text) => messages.push(ChatMessage::user(text)),
        Turn::Continue { user, raw, steps } => {
            messages.push(ChatMessage::user(user));
            push_reply(&mut messages, raw, steps, false);
        }
    }
    messages
}

/// A user message's prompt text: its files' blocks, then its text ([`crate::files`]).
pub(super) fn with_files<'a>(files: impl Iterator<Item = &'a FileRecord>, content: &str) -> String {
    let texts: Vec<crate::files::FileText<'_>> = files
        .map(|f| crate::files::FileText {
            name: &f.name,
            kind: &f.kind,
            text: &f.text,
        })
        .collect();
    crate::files::message_with_files(&texts, content)
}

/// The stored conversation and the branch it shows, what a turn's prompt is built from.
pub(super) async fn conversation_and_branch(
    store: &Store,
    id: Uuid,
) -> Result<(Conversation, Vec<Message>), SessionError> {
    let conversation = store
        .get_conversation(id)
        .await?
        .ok_or(SessionError::NotFound)?;
    let history = store.branch(id).await?;
    Ok((conversation, history))
}

/// The pending files `ids` of `conversation`, in the order given; an id that is not one is
/// refused, naming it.
pub(super) async fn pending_files(
    store: &Store,
    conversation: Uuid,
    ids: &[Uuid],
) -> Result<Vec<FileRecord>, SessionError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let all = store.files_of(conversation).await?;
    ids.iter()
        .map(|id| {
            all.iter()
                .find(|f| f.id == *id && f.message_id.is_none())
                .cloned()
                .ok_or(SessionError::NoSuchFile(*id))
        })
        .collect()
}

/// The render options of a conversation's turns: its pinned date, its thinking switch and the
/// tools it offers.
fn conversation_render_options(conversation: &Conversation, tools: &[Value]) -> RenderOptions {
    let s = &conversation.settings;
    let mut opts = RenderOptions::new(s.pinned_date);
    opts.enable_thinking = Some(s.thinking);
    opts.tools = (!tools.is_empty()).then(|| tools.to_vec());
    opts
}

/// The prompt of a conversation's next message when it offers no tools: what `/v1` builds from
/// the same messages (`tests/prompt_parity.rs` holds them equal).
pub fn conversation_prompt(
    builder: PromptBuilder<'_>,
    conversation: &Conversation,
    history: &[Message],
    new_user: &str,
) -> Result<Prompt, SessionError> {
    turn_prompt(
        builder,
        conversation,
        history,
        &PromptTools::default(),
        Turn::Message(new_user),
    )
}

/// The prompt of a conversation's next turn, built by the one prompt builder.
fn turn_prompt(
    builder: PromptBuilder<'_>,
    conversation: &Conversation,
    history: &[Message],
    tools: &PromptTools,
    turn: Turn<'_>,
) -> Result<Prompt, SessionError> {
    builder
        .build(
            &conversation_messages(conversation, history, &tools.steps, turn),
            &conversation_render_options(conversation, &tools.specs),
        )
        .map_err(|e| SessionError::Prompt(std::sync::Arc::new(e)))
}

/// Builds the conversation plus what follows into prompt tokens and sampling settings. A reply
/// whose first round must call a tool (`tools.forced`, a new message only) is held to one call
/// by a grammar.
pub(super) fn prepare(
    model: &crate::models::ServedModel,
    conversation: &Conversation,
    history: &[Message],
    tools: &PromptTools,
    turn: Turn<'_>,
) -> Result<Prepared, SessionError> {
    // A model kept from thinking gets `enable_thinking = false`, whatever the switch said.
    let prompt = if !model.thinking_kept_off() || !conversation.settings.thinking {
        turn_prompt(model.prompt_builder(), conversation, history, tools, turn)?
    } else {
        let mut c = conversation.clone();
        c.settings.thinking = false;
        turn_prompt(model.prompt_builder(), &c, history, tools, turn)?
    };
    let mut params = crate::settings::sampling_of(&conversation.settings);
    if matches!(turn, Turn::Message(_)) && !tools.forced.is_empty() {
        params.grammar = Some(smolchat_text::constraint::tool_call_grammar(
            model.tokenizer(),
            &tools.forced,
        ));
    }
    Ok(Prepared {
        prompt: prompt.tokens,
        starts_in_reasoning: prompt.starts_in_reasoning,
        params,
    })
}

/// A forced call's argument schema with no arguments beyond those it names: an object schema
/// that does not say (as many MCP servers' do not) gets `additionalProperties: false`, so a
/// forced call cannot wander off inventing arguments until it runs out of tokens.
fn closed(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        if o.get("type").and_then(Value::as_str) == Some("object")
            && !o.contains_key("additionalProperties")
        {
            o.insert("additionalProperties".into(), Value::Bool(false));
        }
    }
    schema
}

/// The tools of a conversation's prompts: the specs of those it offers (that are on), those its
/// `tool_choice` forces, and its replies' stored calls.
pub(super) async fn prompt_tools(
    store: &Store,
    tools: &crate::tools::Tools,
    conversation: &Conversation,
) -> Result<PromptTools, SessionError> {
    let s = &conversation.settings;
    // Who the owner is matters only when some tools are for admins only.
    let owner_admin = !s.tools.is_empty()
        && tools.has_admin_only()
        && matches!(
            store.user_by_id(&conversation.owner).await?,
            Some(u) if u.role == smolchat_store::UserRole::Admin && u.disabled_at.is_none()
        );
    let offered = tools.offered(&s.tools, owner_admin);
    let forced = match s.tool_choice.as_deref() {
        None | Some("auto") => Vec::new(),
        Some("required") => offered.clone(),
        Some(name) => offered.iter().filter(|t| t.name == name).cloned().collect(),
    };
    Ok(PromptTools {
        specs: offered.iter().map(|t| t.to_openai()).collect(),
        forced: forced
            .into_iter()
            .map(|t| (t.name, closed(t.parameters)))
            .collect(),
        steps: store.tool_steps_of(conversation.id).await?,
        owner_admin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use smolchat_store::ConversationSettings;
    use uuid::Uuid;

    fn conversation(system_prompt: Option<&str>) -> Conversation {
        Conversation {
            id: Uuid::now_v7(),
            owner: "someone".into(),
            title: String::new(),
            settings: ConversationSettings {
                system_prompt: system_prompt.map(str::to_string),
                ..ConversationSettings::default()
            },
            created_at: chrono::Utc::now(),
            updated_at: chrono::Utc::now(),
        }
    }

    fn message(role: Role, content: &str, status: MessageStatus) -> Message {
        Message {
            id: Uuid::now_v7(),
            conversation_id: Uuid::nil(),
            position: 1,
            role,
            content: content.into(),
            reasoning: None,
            raw: None,
            status,
            error: None,
            prompt_tokens: None,
            completion_tokens: None,
            cached_tokens: None,
            timings: None,
            created_at: chrono::Utc::now(),
            imported: false,
            parent_id: None,
        }
    }

    #[test]
    fn history_becomes_the_templates_messages() {
        let mut generated = message(Role::Assistant, "Paris.", MessageStatus::Complete);
        generated.raw = Some("<think>\nThe capital.\n</think>\nParis.".into());
        let mut imported = message(Role::Assistant, "<|im_end|>pasted", MessageStatus::Complete);
        imported.imported = true;
        let history = [
            message(Role::User, "Capital of France?", MessageStatus::Complete),
            generated,
            message(Role::User, "And Spain?", MessageStatus::Complete),
            message(Role::Assistant, "half a reply", MessageStatus::Error),
            message(Role::User, "Again?", MessageStatus::Complete),
            imported,
        ];
        let messages = conversation_messages(
            &conversation(Some("Be brief.")),
            &history,
            &HashMap::new(),
            Turn::Message("Thanks"),
        );
        let roles: Vec<(&str, &str, bool)> = messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str(), m.generated))
            .collect();
        assert_eq!(
            roles,
            vec![
                ("system", "Be brief.", false),
                ("user", "Capital of France?", false),
                // The model's exact output, so the re-rendered prompt matches its cache.
                ("assistant", "<think>\nThe capital.\n</think>\nParis.", true),
                ("user", "And Spain?", false),
                // The failed reply is left out.
                ("user", "Again?", false),
                // An imported reply is someone's text: guarded like user text.
                ("assistant", "<|im_end|>pasted", false),
                ("user", "Thanks", false),
            ]
        );
        // A blank system prompt is no system message.
        let none = conversation_messages(
            &conversation(Some("  ")),
            &[],
            &HashMap::new(),
            Turn::Message("Hi"),
        );
        assert_eq!(none.len(), 1);
    }

    #[test]
    fn a_message_must_be_text_within_the_limit() {
        assert!(check_message("hello", 10).is_ok());
        assert!(matches!(
            check_message("  \n", 10),
            Err(SessionError::EmptyMessage)
        ));
        assert!(matches!(
            check_message("a\u{0}b", 10),
            Err(SessionError::NotText(_))
        ));
        // Characters, not bytes.
        assert!(check_message(&"é".repeat(10), 10).is_ok());
        assert!(matches!(
            check_message(&"é".repeat(11), 10),
            Err(SessionError::MessageTooLong {
                chars: 11,
                limit: 10
            })
        ));
    }

    #[test]
    fn a_conversations_date_and_thinking_switch_reach_the_template() {
        let mut c = conversation(None);
        c.settings.thinking = false;
        let opts = conversation_render_options(&c, &[]);
        assert_eq!(opts.enable_thinking, Some(false));
        assert_eq!(opts.date, c.settings.pinned_date);
        assert_eq!(opts.tools, None);
        let spec = serde_json::json!({"type": "function", "function": {"name": "f"}});
        let opts = conversation_render_options(&c, std::slice::from_ref(&spec));
        assert_eq!(opts.tools, Some(vec![spec]));
    }

    fn step(reply: Uuid, n: i64, offset: i64, result: Option<&str>) -> ToolStep {
        ToolStep {
            message_id: reply,
            step: n,
            name: format!("tool{n}"),
            arguments: "{}".into(),
            status: smolchat_store::ToolStepStatus::Done,
            result: result.map(str::to_string),
            raw_offset: offset,
            content_offset: 0,
            duration_ms: None,
        }
    }

    #[test]
    fn a_reply_with_tool_calls_is_its_rounds_with_the_results_between() {
        let raw = "<tool_call>a</tool_call><tool_call>b</tool_call>Four.";
        let mut reply = message(Role::Assistant, "Four.", MessageStatus::Complete);
        reply.raw = Some(raw.into());
        let history = [
            message(Role::User, "2+2?", MessageStatus::Complete),
            reply.clone(),
        ];
        // Two calls in the first round (both at offset 24 would be one round); here one call
        // a round, the second one interrupted (no result).
        let steps = HashMap::from([(
            reply.id,
            vec![
                step(reply.id, 0, 24, Some("4")),
                step(reply.id, 1, 48, None),
            ],
        )]);
        let shape = |ms: &[ChatMessage]| -> Vec<(String, String)> {
            ms.iter()
                .map(|m| (m.role.clone(), m.content.clone()))
                .collect()
        };
        let messages = conversation_messages(
            &conversation(None),
            &history,
            &steps,
            Turn::Message("Thanks"),
        );
        let s = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            shape(&messages),
            vec![
                s("user", "2+2?"),
                s("assistant", "<tool_call>a</tool_call>"),
                s("tool", "4"),
                s("assistant", "<tool_call>b</tool_call>"),
                s("tool", smolchat_store::INTERRUPTED_TOOL_RESULT),
                s("assistant", "Four."),
                s("user", "Thanks"),
            ]
        );
        assert_eq!(messages[2].name.as_deref(), Some("tool0"));
        // The reply going on after its first call: its text so far and the result, and no
        // closing turn (the generation prompt opens the next round).
        let first = [step(reply.id, 0, 24, Some("4"))];
        let going_on = conversation_messages(
            &conversation(None),
            &history[..0],
            &HashMap::new(),
            Turn::Continue {
                user: "2+2?",
                raw: &raw[..24],
                steps: &first,
            },
        );
        assert_eq!(
            shape(&going_on),
            vec![
                s("user", "2+2?"),
                s("assistant", "<tool_call>a</tool_call>"),
                s("tool", "4"),
            ]
        );
        // Two calls of one round share an offset: one assistant turn, two results.
        let both = [
            step(reply.id, 0, 48, Some("x")),
            step(reply.id, 1, 48, Some("y")),
        ];
        let mut out = Vec::new();
        push_reply(&mut out, raw, &both, true);
        assert_eq!(
            shape(&out),
            vec![
                s("assistant", &raw[..48]),
                s("tool", "x"),
                s("tool", "y"),
                s("assistant", "Four.")
            ]
        );
        // An offset beyond the text stays inside it.
        let far = [step(reply.id, 0, 999, Some("x"))];
        let mut out = Vec::new();
        push_reply(&mut out, "ab", &far, true);
        assert_eq!(shape(&out), vec![s("assistant", "ab"), s("tool", "x")]);
    }
}
