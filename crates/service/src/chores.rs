//! The task model's chores (`models.task`): after a conversation's first reply, when it has no
//! title yet, the task model reads the first exchange and writes a short title; after every
//! complete reply (with `models.follow_ups`), it suggests questions the user could ask next.
//! Chores are submitted as background work (admitted only when no user's request waits, never
//! into the last free slot), greedy and short; a title the user set meanwhile is never replaced.

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
pub enum ChoreError {
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

/// The most questions suggested after a reply, their longest length in characters, and the
/// tokens the task model may take to write them.
const FOLLOW_UPS: usize = 3;
const FOLLOW_UP_CHARS: usize = 120;
const FOLLOW_UP_TOKENS: usize = 64;

const FOLLOW_UP_INSTRUCTION: &str = "Here is a conversation. Write three follow-up questions the \
    user might ask next. Write each question on its own line and end it with a question mark.";

/// Runs `text` (one user message) through the task model as a chore; the generated text.
async fn chore(
    models: &Arc<Models>,
    task: &str,
    conversation: &smolchat_store::Conversation,
    text: &str,
    max_tokens: usize,
) -> Result<String, ChoreError> {
    let model = models.load(task).await?;
    let mut opts = RenderOptions::new(conversation.settings.pinned_date);
    // A chore needs no reasoning.
    opts.enable_thinking = model.can_think().then_some(false);
    let prompt = model
        .prompt_builder()
        .build(&[ChatMessage::user(text)], &opts)?;
    let mut completion = model
        .completions()
        .submit_background(CompletionRequest {
            prompt: prompt.tokens,
            params: SamplingParams::greedy(),
            max_tokens: Some(max_tokens),
            // Its own partition: a chore keeps no cache another request could reuse.
            cache: CacheUse::Partition(format!("task:{}", conversation.id)),
            user: Some("task:chores".into()),
            group: None,
            usage_owner: None,
            key: None,
        })
        .await?;
    let mut out = String::new();
    use futures_util::StreamExt;
    while let Some(event) = completion.next().await {
        match event {
            GenEvent::Token { text: piece, .. } => out.push_str(&piece),
            GenEvent::Finished(summary) => {
                if matches!(summary.reason, StopReason::Error(_) | StopReason::Cancelled) {
                    return Err(ChoreError::Empty);
                }
                break;
            }
            _ => {}
        }
    }
    Ok(out)
}

/// A reply and the user message it answers, in their conversation: what the chores read.
pub struct Exchange {
    conversation: smolchat_store::Conversation,
    user: smolchat_store::Message,
    reply: smolchat_store::Message,
    /// The reply is the conversation's first.
    first: bool,
}

impl Exchange {
    /// Reply `reply` of `conversation` with the user message it answers, read once for every
    /// chore; `None` when there is no task model, or the reply is gone, not complete or not on
    /// the branch shown.
    pub async fn load(
        models: &Models,
        store: &Store,
        conversation: Uuid,
        reply: Uuid,
    ) -> Result<Option<Exchange>, ChoreError> {
        if models.task_id().is_none() {
            return Ok(None);
        }
        let Some(c) = store.get_conversation(conversation).await? else {
            return Ok(None);
        };
        let branch = store.branch(conversation).await?;
        let Some(at) = branch.iter().position(|m| m.id == reply) else {
            return Ok(None);
        };
        let Some(user) = branch[..at].iter().rev().find(|m| m.role == Role::User) else {
            return Ok(None);
        };
        if branch[at].status != MessageStatus::Complete {
            return Ok(None);
        }
        Ok(Some(Exchange {
            first: !branch[..at].iter().any(|m| m.role == Role::Assistant),
            user: user.clone(),
            reply: branch[at].clone(),
            conversation: c,
        }))
    }

    /// The instruction, then the exchange (each side cut to [`EXCERPT_CHARS`]).
    fn prompt(&self, instruction: &str) -> String {
        let excerpt = |t: &str| t.chars().take(EXCERPT_CHARS).collect::<String>();
        format!(
            "{instruction}\n\nUser: {}\n\nAssistant: {}",
            excerpt(&self.user.content),
            excerpt(&self.reply.content)
        )
    }
}

/// Suggests the questions to ask after the exchange's reply and keeps them: `Ok(questions)`,
/// empty when there was nothing to do or nothing usable.
pub async fn write_follow_ups(
    models: &Arc<Models>,
    store: &Store,
    ex: &Exchange,
) -> Result<Vec<String>, ChoreError> {
    let Some(task) = models.task_id().filter(|_| models.follow_ups()) else {
        return Ok(Vec::new());
    };
    let prompt = ex.prompt(FOLLOW_UP_INSTRUCTION);
    let out = chore(models, &task, &ex.conversation, &prompt, FOLLOW_UP_TOKENS).await?;
    // Not the question just asked again (a small model often echoes it).
    let asked = ex.user.content.trim().to_lowercase();
    let questions: Vec<String> = follow_ups_of(&out)
        .into_iter()
        .filter(|q| q.to_lowercase() != asked)
        .collect();
    tracing::debug!(conversation = %ex.conversation.id, offered = questions.len(), written = out.len(), "follow-up questions");
    if !questions.is_empty() {
        store.set_follow_ups(ex.reply.id, &questions).await?;
    }
    Ok(questions)
}

/// The task model's answer as questions: its lines that are questions (ending in `?`), without
/// numbering, bullets, quotes or a `User:`/`Q:` label, each within [`FOLLOW_UP_CHARS`], none
/// twice, at most [`FOLLOW_UPS`]. A small model also writes statements and whole made-up
/// exchanges; only its questions are offered.
pub fn follow_ups_of(text: &str) -> Vec<String> {
    let text = match text.rfind("</think>") {
        Some(i) => &text[i + "</think>".len()..],
        None => text,
    };
    let mut out: Vec<String> = Vec::new();
    // Questions may share a line ("1. What…? 2. How…?"): every piece ending in `?` is one,
    // after any lead-in ("Here are three questions: What…?").
    let pieces = text
        .lines()
        .flat_map(|line| line.split_inclusive('?'))
        .map(|p| p.rsplit_once(": ").map_or(p, |(_, q)| q));
    for piece in pieces {
        let q = piece
            .trim()
            .trim_start_matches(|c: char| {
                c.is_ascii_digit() || matches!(c, '.' | ')' | '-' | '*' | '•')
            })
            .trim();
        let q = ["User:", "Q:", "Question:", "User :"]
            .iter()
            .find_map(|label| q.strip_prefix(label))
            .unwrap_or(q)
            .trim()
            .trim_matches(|c: char| matches!(c, '"' | '“' | '”' | '*' | '`'))
            .trim();
        let chars = q.chars().count();
        if chars < 3
            || !q.ends_with('?')
            || chars > FOLLOW_UP_CHARS
            || crate::validation::not_text(q).is_some()
            || out.iter().any(|o| o.eq_ignore_ascii_case(q))
        {
            continue;
        }
        out.push(q.to_string());
        if out.len() == FOLLOW_UPS {
            break;
        }
    }
    out
}

/// Writes the conversation's title after its first reply, if it is untitled: `Ok(Some(title))`
/// once stored, `Ok(None)` when there was nothing to do.
pub async fn write_title(
    models: &Arc<Models>,
    store: &Store,
    ex: &Exchange,
) -> Result<Option<String>, ChoreError> {
    let Some(task) = models.task_id() else {
        return Ok(None);
    };
    if !ex.first || !ex.conversation.title.trim().is_empty() {
        return Ok(None);
    }
    let prompt = ex.prompt(INSTRUCTION);
    let text = chore(models, &task, &ex.conversation, &prompt, TITLE_TOKENS).await?;
    let title = clean(&text).ok_or(ChoreError::Empty)?;
    // Only if still untitled: a title the user set meanwhile stays.
    if store.title_if_untitled(ex.conversation.id, &title).await? {
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
    fn an_answer_becomes_questions() {
        assert_eq!(
            follow_ups_of("1. What is a hash map?\n2) \"How fast is it?\"\n\n- what is a hash map?\n* Why?\n- And then?\n- More?"),
            vec!["What is a hash map?", "How fast is it?", "Why?"]
        );
        assert_eq!(
            follow_ups_of("Here are three questions: 1. Is Mars cold? 2. Has it water? Then more"),
            vec!["Is Mars cold?", "Has it water?"]
        );
        // Statements and the model's made-up answers are not offered; a `User:` label goes.
        assert_eq!(
            follow_ups_of("User: What is the capital of France?\n\nAssistant: Paris.\nThe rainbow is a phenomenon."),
            vec!["What is the capital of France?"]
        );
        assert!(follow_ups_of("").is_empty());
        assert_eq!(follow_ups_of(&"x".repeat(200)), Vec::<String>::new());
    }

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
