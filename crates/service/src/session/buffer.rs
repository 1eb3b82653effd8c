//! The reply a session is generating, as text: the tokens' text as it arrives, split into
//! answer, reasoning and tool calls (the events viewers see), what of it is saved, and the row it
//! becomes when it ends. Plain state, no actor: the session feeds it and sends what it returns.

use std::future::Future;

use uuid::Uuid;

use smolchat_serving::types::{GenSummary, RequestId, StopReason};
use smolchat_store::{FinishedReply, MessageStatus, Store, StoreError, Timings, ToolStep};
use smolchat_text::splitter::{SplitEvent, Splitter, ToolCall};

use crate::cluster::WireBody;
use crate::reply::ReplyEvent;

/// Tool calls ride along in a snapshot only while it stays this small (bytes of JSON); the
/// final row has them all.
const SNAPSHOT_TOOL_CALL_BYTES: usize = 4000;

pub(super) struct ReplyBuffer {
    /// The scheduler's id for the request (to cancel it).
    pub request_id: Option<RequestId>,
    pub user_message_id: Uuid,
    pub assistant_message_id: Uuid,
    splitter: Splitter,
    /// Exactly what the model generated (the prompt of the next turn re-renders it).
    raw: String,
    content: String,
    reasoning: String,
    tool_calls: Vec<ToolCall>,
    prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Stop was asked before the scheduler gave an id.
    pub stop_requested: bool,
    /// Length of `raw` at the last partial save.
    saved_len: usize,
    /// Calls of `tool_calls` made in rounds before the current one.
    round_start: usize,
    /// The current round of generation, from 1 (a reply with tool calls is several).
    round: usize,
    /// The rounds before the current one, added up (a reply with tool calls is several
    /// requests to the scheduler).
    earlier: Option<GenSummary>,
    /// The reply's tool calls as they stand (see [`crate::session`]'s tool loop).
    pub steps: Vec<ToolStep>,
}

impl ReplyBuffer {
    pub fn new(
        request_id: RequestId,
        user_message_id: Uuid,
        assistant_message_id: Uuid,
        starts_in_reasoning: bool,
        prompt_tokens: usize,
    ) -> Self {
        Self {
            request_id: Some(request_id),
            user_message_id,
            assistant_message_id,
            splitter: Splitter::new(starts_in_reasoning),
            raw: String::new(),
            content: String::new(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            prompt_tokens,
            cached_tokens: 0,
            stop_requested: false,
            saved_len: 0,
            round_start: 0,
            round: 1,
            earlier: None,
            steps: Vec::new(),
        }
    }

    /// Exactly what the model generated so far, every round's text.
    pub fn raw(&self) -> &str {
        &self.raw
    }

    /// The tool calls made in the current round.
    pub fn round_calls(&self) -> &[ToolCall] {
        &self.tool_calls[self.round_start.min(self.tool_calls.len())..]
    }

    /// The current round of generation, from 1.
    pub fn round(&self) -> usize {
        self.round
    }

    /// Bytes of the raw text and of the answer so far (where a tool call made now sits).
    pub fn offsets(&self) -> (usize, usize) {
        (self.raw.len(), self.content.len())
    }

    /// Ends a round of generation that made tool calls: the text the splitter held, and the
    /// round's figures kept for the reply's totals. Returns the events for the viewers.
    pub fn end_round(&mut self, summary: &GenSummary) -> Vec<ReplyEvent> {
        let held = self.splitter.finish();
        let events = self.take(held);
        self.earlier = Some(match self.earlier.take() {
            None => summary.clone(),
            Some(e) => add_rounds(e, summary),
        });
        events
    }

    /// Starts the next round: its request, and a splitter for its text (the prompt says
    /// whether it opens in reasoning).
    pub fn start_round(
        &mut self,
        request_id: RequestId,
        starts_in_reasoning: bool,
        prompt_tokens: usize,
    ) {
        self.round_start = self.tool_calls.len();
        self.round += 1;
        self.request_id = Some(request_id);
        self.splitter = Splitter::new(starts_in_reasoning);
        self.prompt_tokens = prompt_tokens;
    }

    /// Takes the text of generated tokens; returns the events it completes for the viewers.
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        self.raw.push_str(text);
        let events = self.splitter.push(text);
        self.take(events)
    }

    /// Keeps what the splitter recognised and turns it into viewers' events.
    fn take(&mut self, events: Vec<SplitEvent>) -> Vec<ReplyEvent> {
        events
            .into_iter()
            .map(|event| match event {
                SplitEvent::Reasoning(text) => {
                    self.reasoning.push_str(&text);
                    ReplyEvent::Reasoning { text }
                }
                SplitEvent::Answer(text) => {
                    self.content.push_str(&text);
                    ReplyEvent::Answer { text }
                }
                SplitEvent::ToolCall(call) => {
                    self.tool_calls.push(call.clone());
                    ReplyEvent::ToolCall { call }
                }
                // A call that does not parse stays visible, as the text the model wrote.
                SplitEvent::InvalidToolCall { raw, .. } => {
                    let text = format!("<tool_call>{raw}</tool_call>");
                    self.content.push_str(&text);
                    ReplyEvent::Answer { text }
                }
            })
            .collect()
    }

    /// Whether text arrived since the last save.
    pub fn unsaved(&self) -> bool {
        self.raw.len() != self.saved_len
    }

    /// The write that saves the reply as it is now (content, reasoning, raw text), which from
    /// then on counts as saved.
    pub fn save_now(
        &mut self,
        store: Store,
    ) -> impl Future<Output = Result<bool, StoreError>> + 'static {
        self.saved_len = self.raw.len();
        let (id, content, raw) = (
            self.assistant_message_id,
            self.content.clone(),
            self.raw.clone(),
        );
        let reasoning = (!self.reasoning.is_empty()).then(|| self.reasoning.clone());
        async move {
            store
                .save_partial_reply(id, &content, reasoning.as_deref(), &raw)
                .await
        }
    }

    /// What another replica's viewers need to join the reply where it stands: how much of the
    /// row (saved just before this is sent) is the reply so far.
    pub fn snapshot(&self) -> WireBody {
        let mut tool_calls = self.tool_calls.clone();
        while serde_json::to_string(&tool_calls).map_or(0, |j| j.len()) > SNAPSHOT_TOOL_CALL_BYTES {
            tool_calls.pop();
        }
        WireBody::Snapshot {
            user_message: self.user_message_id,
            assistant: self.assistant_message_id,
            content_len: self.content.len(),
            reasoning_len: self.reasoning.len(),
            tool_calls,
        }
    }

    /// The end of the reply: the events the splitter still held, and the row to store.
    pub fn finish(mut self, summary: &GenSummary) -> (Vec<ReplyEvent>, FinishedReply) {
        let total = match self.earlier.take() {
            None => summary.clone(),
            Some(e) => add_rounds(e, summary),
        };
        let summary = &total;
        let held = self.splitter.finish();
        let tail = self.take(held);
        let (status, error) = match &summary.reason {
            StopReason::EndOfGeneration | StopReason::StopString(_) | StopReason::Length => {
                (MessageStatus::Complete, None)
            }
            StopReason::Cancelled | StopReason::TimeLimit => (MessageStatus::Stopped, None),
            StopReason::Error(e) => (MessageStatus::Error, Some(e.to_string())),
        };
        // The first token comes with the prefill; speed is over the ones after it.
        let tokens_per_s = if summary.generation_ms > 0.0 {
            summary.completion_tokens.saturating_sub(1) as f64 / (summary.generation_ms / 1e3)
        } else {
            0.0
        };
        let finished = FinishedReply {
            content: self.content,
            reasoning: (!self.reasoning.is_empty()).then_some(self.reasoning),
            raw: self.raw,
            status,
            error,
            prompt_tokens: self.prompt_tokens as i64,
            completion_tokens: summary.completion_tokens as i64,
            cached_tokens: self.cached_tokens as i64,
            timings: Timings {
                queue_ms: summary.queue_ms,
                prefill_ms: summary.prefill_ms,
                ttft_ms: summary.ttft_ms,
                generation_ms: summary.generation_ms,
                tokens_per_s,
                drafted_tokens: summary.drafted_tokens,
                accepted_tokens: summary.accepted_tokens,
                restored_tokens: summary.restored_tokens as u64,
                warmed_tokens: summary.warmed_tokens as u64,
                model: None,
            },
        };
        (tail, finished)
    }
}

/// Two rounds of one reply as one: tokens and times added up, the first round's wait for its
/// first token, the last round's reason and prompt.
fn add_rounds(earlier: GenSummary, later: &GenSummary) -> GenSummary {
    GenSummary {
        reason: later.reason.clone(),
        prompt_tokens: later.prompt_tokens,
        cached_tokens: later.cached_tokens,
        completion_tokens: earlier.completion_tokens + later.completion_tokens,
        queue_ms: earlier.queue_ms + later.queue_ms,
        prefill_ms: earlier.prefill_ms + later.prefill_ms,
        ttft_ms: earlier.ttft_ms,
        generation_ms: earlier.generation_ms + later.generation_ms,
        drafted_tokens: earlier.drafted_tokens + later.drafted_tokens,
        accepted_tokens: earlier.accepted_tokens + later.accepted_tokens,
        restored_tokens: earlier.restored_tokens + later.restored_tokens,
        warmed_tokens: earlier.warmed_tokens + later.warmed_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(reason: StopReason) -> GenSummary {
        GenSummary {
            reason,
            prompt_tokens: 12,
            cached_tokens: 0,
            completion_tokens: 0,
            queue_ms: 0.0,
            prefill_ms: 0.0,
            ttft_ms: 0.0,
            generation_ms: 0.0,
            drafted_tokens: 0,
            accepted_tokens: 0,
            restored_tokens: 0,
            warmed_tokens: 0,
        }
    }

    fn buffer(starts_in_reasoning: bool) -> ReplyBuffer {
        ReplyBuffer::new(7, Uuid::now_v7(), Uuid::now_v7(), starts_in_reasoning, 12)
    }

    fn texts(events: &[ReplyEvent]) -> Vec<(&'static str, String)> {
        events
            .iter()
            .map(|e| match e {
                ReplyEvent::Reasoning { text } => ("reasoning", text.clone()),
                ReplyEvent::Answer { text } => ("answer", text.clone()),
                ReplyEvent::ToolCall { call } => ("tool", call.name.clone()),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn text_is_split_into_reasoning_and_answer_and_kept_raw() {
        let mut b = buffer(true);
        let mut events = Vec::new();
        for piece in ["Let me", " think.</think>", "\n\nHello", " there."] {
            events.extend(b.push(piece));
        }
        let summary = GenSummary {
            completion_tokens: 5,
            generation_ms: 2000.0,
            ..summary(StopReason::EndOfGeneration)
        };
        let (tail, row) = b.finish(&summary);
        events.extend(tail);
        let seen: String = texts(&events)
            .iter()
            .filter(|(k, _)| *k == "answer")
            .map(|(_, t)| t.as_str())
            .collect();
        assert_eq!(seen.trim_start(), "Hello there.");
        assert_eq!(
            row.reasoning.as_deref().map(str::trim),
            Some("Let me think.")
        );
        assert_eq!(row.content.trim_start(), "Hello there.");
        assert_eq!(row.raw, "Let me think.</think>\n\nHello there.");
        assert_eq!(row.status, MessageStatus::Complete);
        assert_eq!(row.prompt_tokens, 12);
        // Four tokens after the first in two seconds.
        assert_eq!(row.timings.tokens_per_s, 2.0);
    }

    #[test]
    fn tool_calls_are_events_and_a_broken_one_stays_visible_text() {
        let mut b = buffer(false);
        let mut events =
            b.push(r#"<tool_call>{"name": "lookup", "arguments": {"q": 1}}</tool_call>"#);
        events.extend(b.push("<tool_call>not json</tool_call>"));
        let (tail, row) = b.finish(&summary(StopReason::EndOfGeneration));
        events.extend(tail);
        let kinds = texts(&events);
        assert!(kinds.contains(&("tool", "lookup".to_string())), "{kinds:?}");
        assert!(
            row.content.contains("<tool_call>not json</tool_call>"),
            "{}",
            row.content
        );
        assert!(
            !row.content.contains("lookup"),
            "a parsed call is not answer text"
        );
    }

    #[test]
    fn how_a_reply_ended_decides_its_status() {
        for (reason, status, error) in [
            (StopReason::Length, MessageStatus::Complete, None),
            (
                StopReason::StopString("x".into()),
                MessageStatus::Complete,
                None,
            ),
            (StopReason::Cancelled, MessageStatus::Stopped, None),
            (StopReason::TimeLimit, MessageStatus::Stopped, None),
            (
                StopReason::Error(smolchat_serving::types::Failure::Engine("boom".into())),
                MessageStatus::Error,
                Some("boom".to_string()),
            ),
        ] {
            let (_, row) = buffer(false).finish(&summary(reason));
            assert_eq!((row.status, row.error), (status, error));
            assert_eq!(
                row.timings.tokens_per_s, 0.0,
                "no generation time, no speed"
            );
        }
    }

    #[test]
    fn a_snapshot_measures_the_reply_so_far_and_bounds_its_tool_calls() {
        let mut b = buffer(false);
        b.push("Hi");
        for i in 0..200 {
            b.push(&format!(
                r#"<tool_call>{{"name": "call{i}", "arguments": {{"pad": "{}"}}}}</tool_call>"#,
                "x".repeat(40)
            ));
        }
        assert!(b.unsaved());
        match b.snapshot() {
            WireBody::Snapshot {
                user_message,
                assistant,
                content_len,
                reasoning_len,
                tool_calls,
            } => {
                assert_eq!(
                    (user_message, assistant),
                    (b.user_message_id, b.assistant_message_id)
                );
                assert_eq!((content_len, reasoning_len), (2, 0));
                assert!(!tool_calls.is_empty() && tool_calls.len() < 200);
                let bytes = serde_json::to_string(&tool_calls).map_or(0, |j| j.len());
                assert!(bytes <= SNAPSHOT_TOOL_CALL_BYTES, "{bytes}");
            }
            other => panic!("{other:?}"),
        }
    }
}
