//! Titles written by the task model (`models.task`): after a conversation's first reply, when it
//! has no title yet, the task model reads the first exchange and writes a short title. It is a
//! chore: submitted as background work (admitted only when no user's request waits, never into
//! the last free slot), greedy and short, and a title the user set meanwhile is never replaced.

use std::sync::Arc;

use smolchat_store::{MessageStatus, Role, Store};
use smolchat_text::sampling::SamplingParams;
use smolchat_text::template::{ChatMessage, RenderOptions};
use uuid::Uuid;

use crate::completions::{CacheUse, CompletionRequest, GenEvent, StopReason};
use crate::models::Models;

/// How much of the first message and of the reply the task model reads, in characters.
const EXCERPT_CHARS: usize = 1200;
/// The most tokens a title may take.
const TITLE_TOKENS: usize = 20;
/// The longest title kept, in characters and in words (a small model rambles on).
const TITLE_CHARS: usize = 60;
const TITLE_WORDS: usize = 6;

/// The prompt's instruction.
const INSTRUCTION: &str = "Write a short title (at most six words) for the conversation below. \
    Reply with the title only: no quotes, no punctuation at the end.";

/// Why no title was written (logged; a chore that fails costs nothing else).
#[derive(Debug, thiserror::Error)]
pub enum TitleError {
    #[error("storage: {0}")]
    Store(#[from] smolchat_store::StoreError),
    #[error("the task model: {0}")]
    Model(#[from] crate::models::ModelError),
    #[error("the prompt: {0}")]
    Prompt(#[from] smolchat_text::TextError),
    #[error("the request: {0}")]
    Submit(#[from] crate::completions::SubmitError),
    #[error("the task model wrote nothing usable")]
    Empty,
}

/// Writes the title of `conversation` if it is untitled and has had exactly one complete reply:
/// `Ok(Some(title))` once stored, `Ok(None)` when there was nothing to do.
pub async fn write_title(
    models: &Arc<Models>,
    store: &Store,
    conversation: Uuid,
) -> Result<Option<String>, TitleError> {
    let Some(task) = models.task_id() else {
        return Ok(None);
    };
    let Some(c) = store.get_conversation(conversation).await? else {
        return Ok(None);
    };
    if !c.title.trim().is_empty() {
        return Ok(None);
    }
    let branch = store.branch(conversation).await?;
    let (Some(user), Some(reply)) = (
        branch.iter().find(|m| m.role == Role::User),
        branch.iter().find(|m| m.role == Role::Assistant),
    ) else {
        return Ok(None);
    };
    let replies = branch.iter().filter(|m| m.role == Role::Assistant).count();
    if replies != 1 || reply.status != MessageStatus::Complete {
        return Ok(None);
    }
    let model = models.load(&task).await?;
    let excerpt = |t: &str| t.chars().take(EXCERPT_CHARS).collect::<String>();
    let exchange = format!(
        "{INSTRUCTION}\n\nUser: {}\n\nAssistant: {}",
        excerpt(&user.content),
        excerpt(&reply.content)
    );
    let mut opts = RenderOptions::new(c.settings.pinned_date);
    // A title needs no reasoning.
    opts.enable_thinking = model.can_think().then_some(false);
    let prompt = model
        .prompt_builder()
        .build(&[ChatMessage::user(&exchange)], &opts)?;
    let mut completion = model
        .completions()
        .submit_background(CompletionRequest {
            prompt: prompt.tokens,
            params: SamplingParams::greedy(),
            max_tokens: Some(TITLE_TOKENS),
            // Its own partition: the chore keeps no cache another request could reuse.
            cache: CacheUse::Partition(format!("task:{conversation}")),
            user: Some("task:titles".into()),
            group: None,
            usage_owner: None,
            key: None,
        })
        .await?;
    let mut text = String::new();
    use futures_util::StreamExt;
    while let Some(event) = completion.next().await {
        match event {
            GenEvent::Token { text: piece, .. } => text.push_str(&piece),
            GenEvent::Finished(summary) => {
                if matches!(summary.reason, StopReason::Error(_) | StopReason::Cancelled) {
                    return Err(TitleError::Empty);
                }
                break;
            }
            _ => {}
        }
    }
    let title = clean(&text).ok_or(TitleError::Empty)?;
    // Only if still untitled: a title the user set meanwhile stays.
    if store.title_if_untitled(conversation, &title).await? {
        Ok(Some(title))
    } else {
        Ok(None)
    }
}

/// The model's answer as a title: its first line without reasoning, quotes, a `Title:` label or
/// closing punctuation, within [`TITLE_WORDS`] words and [`TITLE_CHARS`] characters (cut at a
/// word, marked `…`); `None` when nothing is left.
pub fn clean(text: &str) -> Option<String> {
    let text = match text.rfind("</think>") {
        Some(i) => &text[i + "</think>".len()..],
        None => text,
    };
    let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    let line = line
        .strip_prefix("Title:")
        .or_else(|| line.strip_prefix("title:"))
        .unwrap_or(line)
        .trim()
        .trim_end_matches(['.', '!', ':', ';', ','])
        .trim_matches(|c: char| matches!(c, '"' | '\'' | '*' | '#' | '`' | '“' | '”'))
        .trim_end_matches(['.', '!', ':', ';', ','])
        .trim();
    if line.is_empty() || crate::validation::not_text(line).is_some() {
        return None;
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let line = if words.len() > TITLE_WORDS {
        format!(
            "{}…",
            words[..TITLE_WORDS]
                .join(" ")
                .trim_end_matches([',', ';', ':', '-', '.'])
        )
    } else {
        words.join(" ")
    };
    if line.chars().count() <= TITLE_CHARS {
        return Some(line);
    }
    let mut cut: String = line.chars().take(TITLE_CHARS).collect();
    if let Some(space) = cut.rfind(' ') {
        cut.truncate(space);
    }
    Some(
        cut.trim_end_matches([',', ';', ':', '-'])
            .trim()
            .to_string()
            + "…",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_becomes_a_title() {
        assert_eq!(
            clean("\"Paris Trip Ideas\".\nMore"),
            Some("Paris Trip Ideas".into())
        );
        assert_eq!(
            clean("<think>\nhm\n</think>\nTitle: Rust lifetimes"),
            Some("Rust lifetimes".into())
        );
        assert_eq!(
            clean("  \n**Baking bread at home!**"),
            Some("Baking bread at home".into())
        );
        assert_eq!(clean(""), None);
        assert_eq!(clean("\"\""), None);
        assert_eq!(
            clean("The colours of the rainbow are a classic example, of course"),
            Some("The colours of the rainbow are…".into())
        );
        let long = "abcdefghijklmnopqrstuvwxyz ".repeat(4);
        let t = clean(&long).unwrap_or_default();
        assert!(
            t.ends_with('…') && t.chars().count() <= TITLE_CHARS + 1,
            "{t}"
        );
    }
}
