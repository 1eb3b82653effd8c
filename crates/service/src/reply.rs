//! The events of a reply, one type for everyone who follows it: the viewers of this replica (the
//! event stream), and the other replicas (the bus), where it travels inside a [`crate::cluster`]
//! envelope.
//!
//! The two differ only in how a stored message travels: here the row itself, between replicas
//! its id (the row is in the shared store, and NOTIFY payloads are small). So the event is
//! generic over that: [`ReplyEvent`] (`M = Message`) for viewers, `ReplyEvent<Uuid>` on the
//! wire, and [`ReplyEvent::to_wire`] is the one conversion.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use smolchat_serving::types::GenSummary;
use smolchat_store::{Message, ToolStep};
use smolchat_text::splitter::ToolCall;

/// One event of a reply (see the module docs). Serialized with a `type` tag: the event stream's
/// JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ReplyEvent<M = Message> {
    /// A reply began (after the user message was stored).
    Started {
        user_message: M,
        assistant_message_id: Uuid,
    },
    /// The prompt left the queue and is being prefilled.
    Prefilling {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Reasoning {
        text: String,
    },
    Answer {
        text: String,
    },
    ToolCall {
        call: ToolCall,
    },
    /// A tool call the reply made, as it stands: made (waiting for approval, or running), then
    /// ended with its result. Sent again at each change; the latest for a step is what counts.
    ToolStep {
        step: ToolStep,
    },
    /// The reply goes on after its tool calls' results (a new round of generation).
    Continuing {
        round: usize,
    },
    /// The reply ended and is stored.
    Done {
        message: M,
        summary: GenSummary,
    },
    Error {
        message: String,
    },
    /// The task model wrote the conversation's title (after its first reply).
    Titled {
        title: String,
    },
    /// The task model suggests questions to ask after reply `message_id`.
    FollowUps {
        message_id: Uuid,
        questions: Vec<String>,
    },
}

impl ReplyEvent {
    /// The event as it travels between replicas: stored messages by id.
    pub fn to_wire(&self) -> ReplyEvent<Uuid> {
        match self {
            ReplyEvent::Started {
                user_message,
                assistant_message_id,
            } => ReplyEvent::Started {
                user_message: user_message.id,
                assistant_message_id: *assistant_message_id,
            },
            ReplyEvent::Prefilling {
                prompt_tokens,
                cached_tokens,
            } => ReplyEvent::Prefilling {
                prompt_tokens: *prompt_tokens,
                cached_tokens: *cached_tokens,
            },
            ReplyEvent::Reasoning { text } => ReplyEvent::Reasoning { text: text.clone() },
            ReplyEvent::Answer { text } => ReplyEvent::Answer { text: text.clone() },
            ReplyEvent::ToolCall { call } => ReplyEvent::ToolCall { call: call.clone() },
            ReplyEvent::ToolStep { step } => ReplyEvent::ToolStep { step: step.clone() },
            ReplyEvent::Continuing { round } => ReplyEvent::Continuing { round: *round },
            ReplyEvent::Done { message, summary } => ReplyEvent::Done {
                message: message.id,
                summary: summary.clone(),
            },
            ReplyEvent::Error { message } => ReplyEvent::Error {
                message: message.clone(),
            },
            ReplyEvent::Titled { title } => ReplyEvent::Titled {
                title: title.clone(),
            },
            ReplyEvent::FollowUps {
                message_id,
                questions,
            } => ReplyEvent::FollowUps {
                message_id: *message_id,
                questions: questions.clone(),
            },
        }
    }
}

impl<M> ReplyEvent<M> {
    /// The same event with its stored messages carried as `N` (`Some`), or `None` when the event
    /// names a message and `f` has none for it. Events without a message pass through.
    pub fn with_messages<N>(self, mut f: impl FnMut(M) -> Option<N>) -> Option<ReplyEvent<N>> {
        Some(match self {
            ReplyEvent::Started {
                user_message,
                assistant_message_id,
            } => ReplyEvent::Started {
                user_message: f(user_message)?,
                assistant_message_id,
            },
            ReplyEvent::Done { message, summary } => ReplyEvent::Done {
                message: f(message)?,
                summary,
            },
            ReplyEvent::Prefilling {
                prompt_tokens,
                cached_tokens,
            } => ReplyEvent::Prefilling {
                prompt_tokens,
                cached_tokens,
            },
            ReplyEvent::Reasoning { text } => ReplyEvent::Reasoning { text },
            ReplyEvent::Answer { text } => ReplyEvent::Answer { text },
            ReplyEvent::ToolCall { call } => ReplyEvent::ToolCall { call },
            ReplyEvent::ToolStep { step } => ReplyEvent::ToolStep { step },
            ReplyEvent::Continuing { round } => ReplyEvent::Continuing { round },
            ReplyEvent::Error { message } => ReplyEvent::Error { message },
            ReplyEvent::Titled { title } => ReplyEvent::Titled { title },
            ReplyEvent::FollowUps {
                message_id,
                questions,
            } => ReplyEvent::FollowUps {
                message_id,
                questions,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smolchat_serving::types::StopReason;

    #[test]
    fn the_wire_form_carries_ids_and_comes_back_with_the_rows() {
        let summary = GenSummary {
            reason: StopReason::EndOfGeneration,
            prompt_tokens: 3,
            cached_tokens: 0,
            completion_tokens: 2,
            queue_ms: 0.0,
            prefill_ms: 1.0,
            ttft_ms: 1.0,
            generation_ms: 1.0,
            drafted_tokens: 0,
            accepted_tokens: 0,
            restored_tokens: 0,
            warmed_tokens: 0,
        };
        let (user, reply) = (Uuid::now_v7(), Uuid::now_v7());
        let wire = ReplyEvent::<Uuid>::Done {
            message: reply,
            summary: summary.clone(),
        };
        let json = serde_json::to_string(&wire).expect("serialize");
        assert_eq!(
            serde_json::from_str::<ReplyEvent<Uuid>>(&json).expect("parse"),
            wire
        );
        // A follower reads the rows back; an id it cannot resolve drops the event.
        let found = wire
            .clone()
            .with_messages(|id| (id == reply).then_some("row"));
        assert_eq!(
            found,
            Some(ReplyEvent::Done {
                message: "row",
                summary
            })
        );
        let started = ReplyEvent::<Uuid>::Started {
            user_message: user,
            assistant_message_id: reply,
        };
        assert_eq!(started.with_messages(|_| None::<()>), None);
        // Events without a message pass through untouched.
        let text = ReplyEvent::<Uuid>::Answer { text: "hi".into() };
        assert_eq!(
            text.with_messages(|_| None::<()>),
            Some(ReplyEvent::Answer { text: "hi".into() })
        );
    }
}
