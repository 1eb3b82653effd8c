//! Following a reply another replica is generating in this conversation, for the viewers here.
//! [`follow`] decides what a message from the bus means for the session (pure: tested here);
//! the session carries the decision out, reading from the store the rows the message names.

use uuid::Uuid;

use smolchat_serving::types::{Failure, GenSummary, StopReason};
use smolchat_store::{Message, MessageStatus};
use smolchat_text::splitter::ToolCall;

use crate::cluster::WireBody;
use crate::reply::ReplyEvent;

/// A reply another replica is generating in this conversation, mirrored for the viewers here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mirror {
    /// The replica generating it.
    pub from: Uuid,
    pub assistant: Uuid,
    /// Whether this mirror holds the reply from its start (its `Started`, or a snapshot), so
    /// deltas can be passed on; until then they are dropped and a snapshot is awaited.
    pub synced: bool,
}

/// What a session does with a message about another replica's reply.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Follow {
    /// Nothing: not the reply followed, not yet synced, or this replica generates here.
    Ignore,
    /// Pass the event on to the viewers (boxed: a reply event can hold message rows).
    FanOut(Box<ReplyEvent>),
    /// A reply began there: read its user message, then tell the viewers (the replay buffer
    /// starts over).
    Start { user_message: Uuid, assistant: Uuid },
    /// The snapshot this session waited for: read both rows, then replay the reply so far
    /// ([`snapshot_events`]).
    Snapshot {
        user_message: Uuid,
        assistant: Uuid,
        content_len: usize,
        reasoning_len: usize,
        tool_calls: Vec<ToolCall>,
    },
    /// The followed reply ended: read its final row, then tell the viewers.
    Finish { message: Uuid, summary: GenSummary },
}

/// Decides what `body`, sent by replica `from`, means for a session following `mirror`
/// (updated in place). `busy`: this replica is generating in the conversation itself, and the
/// unique streaming row means the other cannot be.
pub(super) fn follow(
    mirror: &mut Option<Mirror>,
    busy: bool,
    from: Uuid,
    body: WireBody,
) -> Follow {
    if busy {
        return Follow::Ignore;
    }
    let following = mirror.as_ref().is_some_and(|m| m.synced && m.from == from);
    match body {
        WireBody::Reply {
            event:
                ReplyEvent::Started {
                    user_message,
                    assistant_message_id: assistant,
                },
        } => {
            *mirror = Some(Mirror {
                from,
                assistant,
                synced: true,
            });
            Follow::Start {
                user_message,
                assistant,
            }
        }
        WireBody::Reply {
            event: ReplyEvent::Done { message, summary },
        } => {
            // Only the end of the reply this session follows: a `Done` of an earlier reply can
            // arrive after a viewer (who already saw it elsewhere) joined here.
            if mirror.as_ref().is_none_or(|m| m.assistant != message) {
                return Follow::Ignore;
            }
            *mirror = None;
            Follow::Finish { message, summary }
        }
        // Deltas: they name no stored message.
        WireBody::Reply { event } if following => event
            .with_messages(|_| None)
            .map_or(Follow::Ignore, |e| Follow::FanOut(Box::new(e))),
        WireBody::Snapshot {
            user_message,
            assistant,
            content_len,
            reasoning_len,
            tool_calls,
        } => {
            let waiting = mirror
                .as_ref()
                .is_some_and(|m| !m.synced && m.assistant == assistant);
            if !waiting {
                return Follow::Ignore;
            }
            Follow::Snapshot {
                user_message,
                assistant,
                content_len,
                reasoning_len,
                tool_calls,
            }
        }
        _ => Follow::Ignore,
    }
}

/// The events that replay a snapshot: the stored rows cut to the lengths the generating replica
/// announced (the deltas after the snapshot continue exactly there). `None` when a row is not of
/// `conversation`: a relayed id naming another conversation's message must not show its text.
pub(super) fn snapshot_events(
    conversation: Uuid,
    user: Message,
    reply: &Message,
    content_len: usize,
    reasoning_len: usize,
    tool_calls: Vec<ToolCall>,
) -> Option<Vec<ReplyEvent>> {
    if user.conversation_id != conversation || reply.conversation_id != conversation {
        return None;
    }
    let prefix = |text: &str, len: usize| text.get(..len).unwrap_or(text).to_string();
    let content = prefix(&reply.content, content_len);
    let reasoning = prefix(reply.reasoning.as_deref().unwrap_or(""), reasoning_len);
    let mut events = vec![ReplyEvent::Started {
        user_message: user,
        assistant_message_id: reply.id,
    }];
    if !reasoning.is_empty() {
        events.push(ReplyEvent::Reasoning { text: reasoning });
    }
    events.extend(
        tool_calls
            .into_iter()
            .map(|call| ReplyEvent::ToolCall { call }),
    );
    if !content.is_empty() {
        events.push(ReplyEvent::Answer { text: content });
    }
    Some(events)
}

/// What a finished reply's row says of how it went, for a `Done` made from the row (its `Done`
/// event was lost between replicas).
pub(crate) fn summary_of_stored(message: &Message) -> GenSummary {
    let timings = message.timings.clone().unwrap_or_default();
    GenSummary {
        reason: match message.status {
            MessageStatus::Stopped => StopReason::Cancelled,
            MessageStatus::Error => {
                StopReason::Error(Failure::from_stored(message.error.as_deref().unwrap_or("")))
            }
            _ => StopReason::EndOfGeneration,
        },
        prompt_tokens: message.prompt_tokens.unwrap_or(0).max(0) as usize,
        cached_tokens: message.cached_tokens.unwrap_or(0).max(0) as usize,
        completion_tokens: message.completion_tokens.unwrap_or(0).max(0) as usize,
        queue_ms: timings.queue_ms,
        prefill_ms: timings.prefill_ms,
        ttft_ms: timings.ttft_ms,
        generation_ms: timings.generation_ms,
        drafted_tokens: timings.drafted_tokens,
        accepted_tokens: timings.accepted_tokens,
        restored_tokens: timings.restored_tokens as usize,
        warmed_tokens: timings.warmed_tokens as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smolchat_store::{Role, Timings};

    fn reply(event: ReplyEvent<Uuid>) -> WireBody {
        WireBody::Reply { event }
    }

    fn summary() -> GenSummary {
        summary_of_stored(&message(Uuid::now_v7(), Role::Assistant, ""))
    }

    fn message(conversation: Uuid, role: Role, content: &str) -> Message {
        Message {
            id: Uuid::now_v7(),
            conversation_id: conversation,
            position: 1,
            role,
            content: content.into(),
            reasoning: None,
            raw: None,
            status: MessageStatus::Complete,
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
    fn a_reply_started_elsewhere_is_followed_from_its_start_to_its_end() {
        let (there, user, assistant) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let mut mirror = None;
        let start = reply(ReplyEvent::Started {
            user_message: user,
            assistant_message_id: assistant,
        });
        assert_eq!(
            follow(&mut mirror, false, there, start),
            Follow::Start {
                user_message: user,
                assistant
            }
        );
        assert_eq!(
            mirror,
            Some(Mirror {
                from: there,
                assistant,
                synced: true
            })
        );
        let text = reply(ReplyEvent::Answer { text: "Hi".into() });
        assert_eq!(
            follow(&mut mirror, false, there, text.clone()),
            Follow::FanOut(Box::new(ReplyEvent::Answer { text: "Hi".into() }))
        );
        // The same text from a replica this session does not follow is dropped.
        assert_eq!(
            follow(&mut mirror, false, Uuid::now_v7(), text),
            Follow::Ignore
        );
        // The end of an earlier reply is not this one's.
        let old_done = reply(ReplyEvent::Done {
            message: Uuid::now_v7(),
            summary: summary(),
        });
        assert_eq!(follow(&mut mirror, false, there, old_done), Follow::Ignore);
        assert!(mirror.is_some());
        let done = reply(ReplyEvent::Done {
            message: assistant,
            summary: summary(),
        });
        assert_eq!(
            follow(&mut mirror, false, there, done),
            Follow::Finish {
                message: assistant,
                summary: summary()
            }
        );
        assert_eq!(mirror, None, "the mirror ends with its reply");
    }

    #[test]
    fn deltas_wait_for_the_snapshot_a_late_joiner_asked_for() {
        let (there, assistant) = (Uuid::now_v7(), Uuid::now_v7());
        let mut mirror = Some(Mirror {
            from: there,
            assistant,
            synced: false,
        });
        let text = reply(ReplyEvent::Reasoning { text: "hm".into() });
        assert_eq!(follow(&mut mirror, false, there, text), Follow::Ignore);
        let snapshot = |assistant| WireBody::Snapshot {
            user_message: Uuid::nil(),
            assistant,
            content_len: 3,
            reasoning_len: 0,
            tool_calls: Vec::new(),
        };
        assert_eq!(
            follow(&mut mirror, false, there, snapshot(Uuid::now_v7())),
            Follow::Ignore,
            "another reply's snapshot"
        );
        assert!(matches!(
            follow(&mut mirror, false, there, snapshot(assistant)),
            Follow::Snapshot { content_len: 3, .. }
        ));
    }

    #[test]
    fn a_replica_generating_here_ignores_the_bus() {
        let mut mirror = None;
        let start = reply(ReplyEvent::Started {
            user_message: Uuid::now_v7(),
            assistant_message_id: Uuid::now_v7(),
        });
        assert_eq!(
            follow(&mut mirror, true, Uuid::now_v7(), start),
            Follow::Ignore
        );
        assert_eq!(mirror, None);
        for control in [
            WireBody::Sync,
            WireBody::Watch,
            WireBody::Stop,
            WireBody::Deleted,
        ] {
            assert_eq!(
                follow(&mut mirror, false, Uuid::now_v7(), control),
                Follow::Ignore
            );
        }
    }

    #[test]
    fn a_snapshot_replays_the_rows_cut_where_the_deltas_continue() {
        let c = Uuid::now_v7();
        let user = message(c, Role::User, "Hello?");
        let mut row = message(c, Role::Assistant, "Hi there, friend");
        row.reasoning = Some("greet them".into());
        let events =
            snapshot_events(c, user.clone(), &row, 8, 5, Vec::new()).expect("same conversation");
        assert_eq!(
            events,
            vec![
                ReplyEvent::Started {
                    user_message: user.clone(),
                    assistant_message_id: row.id
                },
                ReplyEvent::Reasoning {
                    text: "greet".into()
                },
                ReplyEvent::Answer {
                    text: "Hi there".into()
                },
            ]
        );
        // A length inside a character, or past the end, keeps the whole text.
        let events = snapshot_events(c, user.clone(), &row, 999, 0, Vec::new()).expect("ok");
        assert_eq!(
            events.last(),
            Some(&ReplyEvent::Answer {
                text: "Hi there, friend".into()
            })
        );
        let elsewhere = message(Uuid::now_v7(), Role::Assistant, "secret");
        assert_eq!(snapshot_events(c, user, &elsewhere, 3, 0, Vec::new()), None);
    }

    #[test]
    fn a_stored_row_tells_how_its_reply_ended() {
        let c = Uuid::now_v7();
        let mut row = message(c, Role::Assistant, "x");
        row.status = MessageStatus::Error;
        row.error = Some("the model thread stopped".into());
        row.completion_tokens = Some(4);
        row.timings = Some(Timings {
            generation_ms: 30.0,
            ..Timings::default()
        });
        let s = summary_of_stored(&row);
        assert_eq!(
            s.reason,
            StopReason::Error(Failure::Engine("the model thread stopped".into()))
        );
        assert_eq!((s.completion_tokens, s.generation_ms), (4, 30.0));
        row.status = MessageStatus::Stopped;
        assert_eq!(summary_of_stored(&row).reason, StopReason::Cancelled);
        row.completion_tokens = Some(-3);
        assert_eq!(summary_of_stored(&row).completion_tokens, 0);
    }
}
