//! A conversation's next prompt: the stored conversation and the new user message as the
//! template's messages, rendered and tokenized by the one prompt builder; and the checks every
//! user message meets.

use smolchat_store::{Conversation, FileRecord, Message, MessageStatus, Role, Store};
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

/// The messages a stored conversation plus a new user message stand for: the system prompt, the
/// kept history (failed replies left out) and the new message. The one mapping from stored
/// messages to the template's, used by every turn whichever interface sent it.
fn conversation_messages(
    conversation: &Conversation,
    history: &[Message],
    new_user: &str,
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
            // The exact generated text, so the re-rendered prompt matches the cached tokens.
            Role::Assistant if m.status != MessageStatus::Error => messages.push(
                ChatMessage::generated(m.raw.as_deref().unwrap_or(&m.content)),
            ),
            Role::System => messages.push(ChatMessage::system(&m.content)),
            _ => {}
        }
    }
    messages.push(ChatMessage::user(new_user));
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

/// The render options of a conversation's turns: its pinned date and its thinking switch.
fn conversation_render_options(conversation: &Conversation) -> RenderOptions {
    let s = &conversation.settings;
    let mut opts = RenderOptions::new(s.pinned_date);
    opts.enable_thinking = Some(s.thinking);
    opts
}

/// The prompt of a conversation's next turn, built by the one prompt builder.
pub fn conversation_prompt(
    builder: PromptBuilder<'_>,
    conversation: &Conversation,
    history: &[Message],
    new_user: &str,
) -> Result<Prompt, SessionError> {
    builder
        .build(
            &conversation_messages(conversation, history, new_user),
            &conversation_render_options(conversation),
        )
        .map_err(|e| SessionError::Prompt(std::sync::Arc::new(e)))
}

/// Builds the conversation plus the new user message into prompt tokens and sampling settings.
pub(super) fn prepare(
    model: &crate::models::ServedModel,
    conversation: &Conversation,
    history: &[Message],
    new_user: &str,
) -> Result<Prepared, SessionError> {
    // A model kept from thinking gets `enable_thinking = false`, whatever the switch said.
    let prompt = if !model.thinking_kept_off() || !conversation.settings.thinking {
        conversation_prompt(model.prompt_builder(), conversation, history, new_user)?
    } else {
        let mut c = conversation.clone();
        c.settings.thinking = false;
        conversation_prompt(model.prompt_builder(), &c, history, new_user)?
    };
    Ok(Prepared {
        prompt: prompt.tokens,
        starts_in_reasoning: prompt.starts_in_reasoning,
        params: crate::settings::sampling_of(&conversation.settings),
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
        let messages = conversation_messages(&conversation(Some("Be brief.")), &history, "Thanks");
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
        let none = conversation_messages(&conversation(Some("  ")), &[], "Hi");
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
        let opts = conversation_render_options(&c);
        assert_eq!(opts.enable_thinking, Some(false));
        assert_eq!(opts.date, c.settings.pinned_date);
    }
}
