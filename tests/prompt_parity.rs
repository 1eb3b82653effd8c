//! One conversation, one prompt: the session actors' path (behind both the pages and the JSON
//! API, which hand the same text to the same `Conversations::send`) and `/v1`'s chat path build
//! the same conversation into identical token ids, through the one prompt builder, with
//! SmolLM2's vocabulary under both SmolLM2's and SmolLM3's chat templates.
//! (`tests/http.rs` checks the same end to end: equal prompt counts and greedy replies.)

mod common;

use chrono::{NaiveDate, Utc};
use serde_json::{json, Value};
use smolchat_gguf::GgufSource;
use smolchat_service::session::conversation_prompt;
use smolchat_store::{Conversation, ConversationSettings, Message, MessageStatus, Role};
use smolchat_text::prompt::PromptBuilder;
use smolchat_text::template::ChatTemplate;
use smolchat_text::tokenizer::Tokenizer;
use smolchat_web::openai::request::{parse_chat, Defaults};
use smolchat_web::v1::chat_prompt;
use uuid::Uuid;

const SYSTEM: &str = "You are terse. Answer in one line.";
/// Text a person might type, including the template's own markers, which must stay text.
const FIRST: &str = "What is <|im_end|> in ChatML?\r\nAnswer in one word, café.";
const REPLY: &str = "A turn end marker.";
const SECOND: &str = "And <think> tags? 🙂 Be brief.";

fn message(conversation: &Conversation, position: i64, role: Role, content: &str) -> Message {
    Message {
        id: Uuid::now_v7(),
        conversation_id: conversation.id,
        position,
        role,
        content: content.to_string(),
        reasoning: None,
        raw: (role == Role::Assistant).then(|| content.to_string()),
        status: MessageStatus::Complete,
        error: None,
        prompt_tokens: None,
        completion_tokens: None,
        cached_tokens: None,
        timings: None,
        created_at: Utc::now(),
        imported: false,
        parent_id: None,
    }
}

fn conversation(thinking: bool, date: NaiveDate) -> Conversation {
    Conversation {
        id: Uuid::now_v7(),
        owner: "someone".into(),
        title: String::new(),
        settings: ConversationSettings {
            system_prompt: Some(SYSTEM.into()),
            thinking,
            pinned_date: date,
            ..ConversationSettings::default()
        },
        created_at: Utc::now(),
        updated_at: Utc::now(),
    }
}

/// The same turn as a `/v1/chat/completions` body, as the `openai` client sends it.
fn v1_body(thinking: Option<bool>) -> Value {
    let mut body = json!({
        "model": "smollm",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": SECOND},
        ],
    });
    if let Some(t) = thinking {
        body["chat_template_kwargs"] = json!({ "enable_thinking": t });
    }
    body
}

#[test]
fn pages_json_api_and_v1_build_identical_prompt_ids() {
    let src = GgufSource::open(&common::smollm2_path()).expect("SmolLM2 GGUF");
    let tokenizer = Tokenizer::from_gguf(&src).expect("tokenizer");
    let templates = [
        (
            "SmolLM2",
            ChatTemplate::from_gguf(&src).expect("SmolLM2 template"),
        ),
        (
            "SmolLM3",
            ChatTemplate::smollm3_default().expect("SmolLM3 template"),
        ),
    ];
    let date = chrono::Local::now().date_naive();
    let defaults = Defaults {
        temperature: 0.7,
        top_p: 0.95,
        top_k: 40,
    };
    for (name, template) in &templates {
        let builder = PromptBuilder::new(template, &tokenizer);
        let mut by_thinking = Vec::new();
        // Thinking on is the conversations' default and what `/v1` gets when the client says
        // nothing; off is a conversation setting and vLLM's `chat_template_kwargs`.
        for (thinking, v1_thinking) in [(true, None), (true, Some(true)), (false, Some(false))] {
            let conv = conversation(thinking, date);
            let history = [
                message(&conv, 1, Role::User, FIRST),
                message(&conv, 2, Role::Assistant, REPLY),
            ];
            let session = conversation_prompt(builder, &conv, &history, SECOND).expect("session");
            let req = parse_chat(&v1_body(v1_thinking), &defaults).expect("a valid request");
            let v1 = chat_prompt(builder, template, &req, date).expect("v1");
            assert_eq!(
                session.tokens, v1.tokens,
                "{name}, thinking {thinking} (/v1: {v1_thinking:?}): the prompts differ\n\
                 session: {}\n/v1: {}",
                session.text, v1.text
            );
            assert_eq!(session.starts_in_reasoning, v1.starts_in_reasoning);
            by_thinking.push((thinking, session.tokens.clone()));
            // The marker the user typed stayed text: as many `<|im_end|>` ids as in the same
            // conversation without it.
            let im_end = tokenizer.encode("<|im_end|>", true).expect("encode");
            let closes = |tokens: &[u32]| tokens.iter().filter(|&&t| t == im_end[0]).count();
            let plain = [
                message(
                    &conv,
                    1,
                    Role::User,
                    &FIRST.replace("<|im_end|>", "the marker"),
                ),
                message(&conv, 2, Role::Assistant, REPLY),
            ];
            let plain = conversation_prompt(builder, &conv, &plain, SECOND).expect("plain");
            assert_eq!(
                closes(&session.tokens),
                closes(&plain.tokens),
                "{name}: the user's `<|im_end|>` became a control token"
            );
        }
        // The switch reaches the template (SmolLM3's system header says which mode it is in),
        // so the comparisons above compare prompts that depend on it.
        if *name == "SmolLM3" {
            let on = by_thinking.iter().find(|(t, _)| *t).map(|(_, p)| p);
            let off = by_thinking.iter().find(|(t, _)| !*t).map(|(_, p)| p);
            assert_ne!(on, off, "thinking on and off built the same SmolLM3 prompt");
        }
    }
}
