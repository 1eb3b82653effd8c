//! Streaming split of generated text into reasoning, answer and tool calls.
//!
//! SmolLM3 (and Hermes-style models) write `<think>…</think>` for reasoning and
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>` for tool calls. Text arrives in arbitrary
//! pieces (a tag may be split as `<thi` + `nk>`), so the splitter holds back only the shortest
//! tail that could still become a tag and releases it the moment it cannot (`<th` + `e`).
//!
//! Whitespace follows llama-server's reasoning parser (`common_chat_msg_parser::try_parse_reasoning`
//! strips the reasoning and consumes the whitespace after `</think>`), generalised to every tag:
//! - reasoning is the text between the tags with leading and trailing whitespace removed;
//! - whitespace directly before or after any tag is dropped from the answer (so `</think>\n\nHi`
//!   gives `Hi`, and `Let me check.\n<tool_call>` gives `Let me check.`);
//! - all other whitespace is kept, including the answer's leading whitespace at the very start of
//!   the output and its trailing whitespace at the end.
//!
//! The raw generated text is stored elsewhere, so nothing is lost by this normalisation.
//!
//! Tags recognised: in the answer, `<think>` and `<tool_call>` (anywhere, not only at the start);
//! in reasoning, only `</think>` (a tool call drafted while thinking stays reasoning); in a tool
//! call, only `</tool_call>`. A stray `</think>` in the answer is answer text.
//!
//! At [`Splitter::finish`]: a held-back partial tag is released as text of the current section;
//! an unterminated think block's content stays reasoning; an unterminated tool call whose body
//! still parses as a complete call (a model that stops right after the JSON) becomes a
//! [`SplitEvent::ToolCall`], otherwise an [`SplitEvent::InvalidToolCall`] carrying the body.

use serde::{Deserialize, Serialize};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// A tool call the model asked for. Tools are never executed by the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub name: String,
    /// Usually an object. A call without arguments gets `{}`; arguments written as a
    /// JSON-encoded string holding an object are decoded into that object.
    pub arguments: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq)]
pub enum SplitEvent {
    Reasoning(String),
    Answer(String),
    ToolCall(ToolCall),
    /// A tool call whose body is not a valid call. `raw` is the body between the tags, verbatim.
    InvalidToolCall {
        raw: String,
        error: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Answer,
    Reasoning,
    ToolCall,
}

impl Section {
    /// The tags that end or change the section. The longest is 12 bytes (`</tool_call>`).
    fn tags(self) -> &'static [&'static str] {
        match self {
            Section::Answer => &[THINK_OPEN, TOOL_CALL_OPEN],
            Section::Reasoning => &[THINK_CLOSE],
            Section::ToolCall => &[TOOL_CALL_CLOSE],
        }
    }
}

/// Incremental splitter; one per generated message.
#[derive(Debug, Clone)]
pub struct Splitter {
    starts_in_reasoning: bool,
    section: Section,
    /// Unclassified input: at most the tail that may still turn into a tag.
    pending: String,
    /// Whitespace at the end of the current text run, held until we know whether a tag (drop it)
    /// or more text (emit it) follows.
    held_ws: String,
    /// The current text run began at a tag (or at an implicitly open think block): its leading
    /// whitespace is dropped.
    at_run_start: bool,
    /// The body of the tool call being read.
    tool_body: String,
}

impl Splitter {
    /// `starts_in_reasoning`: the prompt already opened a think block, so the output begins as
    /// reasoning (see [`prompt_ends_in_open_think`](super::template::prompt_ends_in_open_think)).
    pub fn new(starts_in_reasoning: bool) -> Self {
        Self {
            starts_in_reasoning,
            section: if starts_in_reasoning {
                Section::Reasoning
            } else {
                Section::Answer
            },
            pending: String::new(),
            held_ws: String::new(),
            at_run_start: starts_in_reasoning,
            tool_body: String::new(),
        }
    }

    /// Feeds the next piece of generated text; returns what can be classified so far.
    /// Consecutive pieces of the same kind are merged into one event.
    pub fn push(&mut self, delta: &str) -> Vec<SplitEvent> {
        let mut events = Vec::new();
        self.pending.push_str(delta);
        self.drain(&mut events);
        events
    }

    /// Ends the message: flushes everything held back (see the module docs for what unterminated
    /// blocks become). The splitter is then as new and may be reused for another message.
    pub fn finish(&mut self) -> Vec<SplitEvent> {
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        self.content(&rest, &mut events);
        match self.section {
            Section::Answer => {
                let ws = std::mem::take(&mut self.held_ws);
                if !ws.is_empty() {
                    push_merged(&mut events, SplitEvent::Answer(ws));
                }
            }
            // Reasoning is trimmed at both ends, also when the block never closed.
            Section::Reasoning => {}
            Section::ToolCall => {
                let body = std::mem::take(&mut self.tool_body);
                events.push(match parse_tool_call(&body) {
                    Ok(call) => SplitEvent::ToolCall(call),
                    Err(e) => SplitEvent::InvalidToolCall {
                        raw: body,
                        error: format!(
                            "the output ended inside a tool call (no {TOOL_CALL_CLOSE}): {e}"
                        ),
                    },
                });
            }
        }
        *self = Self::new(self.starts_in_reasoning);
        events
    }

    fn drain(&mut self, events: &mut Vec<SplitEvent>) {
        loop {
            let tags = self.section.tags();
            let found = tags
                .iter()
                .filter_map(|tag| self.pending.find(tag).map(|pos| (pos, *tag)))
                .min_by_key(|(pos, _)| *pos);
            if let Some((pos, tag)) = found {
                let after = self.pending[pos + tag.len()..].to_string();
                self.pending.truncate(pos);
                let before = std::mem::replace(&mut self.pending, after);
                self.content(&before, events);
                self.on_tag(tag, events);
                continue;
            }
            let keep = partial_tag_len(&self.pending, tags);
            let tail = self.pending.split_off(self.pending.len() - keep);
            let ready = std::mem::replace(&mut self.pending, tail);
            self.content(&ready, events);
            return;
        }
    }

    /// Text known not to contain a tag of the current section.
    fn content(&mut self, text: &str, events: &mut Vec<SplitEvent>) {
        if text.is_empty() {
            return;
        }
        let mut text = text;
        if self.section == Section::ToolCall {
            self.tool_body.push_str(text);
            return;
        }
        if self.at_run_start {
            text = text.trim_start();
            if text.is_empty() {
                return;
            }
            self.at_run_start = false;
        }
        let body = text.trim_end();
        if body.is_empty() {
            self.held_ws.push_str(text);
            return;
        }
        let mut out = std::mem::take(&mut self.held_ws);
        out.push_str(body);
        self.held_ws.push_str(&text[body.len()..]);
        push_merged(
            events,
            if self.section == Section::Reasoning {
                SplitEvent::Reasoning(out)
            } else {
                SplitEvent::Answer(out)
            },
        );
    }

    fn on_tag(&mut self, tag: &str, events: &mut Vec<SplitEvent>) {
        // Whitespace on either side of a tag is layout, not content.
        self.held_ws.clear();
        self.at_run_start = true;
        self.section = match tag {
            THINK_OPEN => Section::Reasoning,
            TOOL_CALL_OPEN => {
                self.tool_body.clear();
                Section::ToolCall
            }
            TOOL_CALL_CLOSE => {
                let body = std::mem::take(&mut self.tool_body);
                events.push(match parse_tool_call(&body) {
                    Ok(call) => SplitEvent::ToolCall(call),
                    Err(error) => SplitEvent::InvalidToolCall { raw: body, error },
                });
                Section::Answer
            }
            // THINK_CLOSE; `tags()` yields nothing else.
            _ => Section::Answer,
        };
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
fn partial_tag_len(text: &str, tags: &[&str]) -> usize {
    let max = tags.iter().map(|t| t.len()).max().unwrap_or(0);
    let window = text.len().saturating_sub(max.saturating_sub(1));
    // Every tag starts with the ASCII `<`, so candidates start at char boundaries.
    text.char_indices()
        .skip_while(|(i, _)| *i < window)
        .filter(|(_, c)| *c == '<')
        .map(|(i, _)| &text[i..])
        .find(|tail| {
            tags.iter()
                .any(|t| t.len() > tail.len() && t.starts_with(tail))
        })
        .map_or(0, str::len)
}

fn push_merged(events: &mut Vec<SplitEvent>, event: SplitEvent) {
    match (events.last_mut(), event) {
        (Some(SplitEvent::Answer(a)), SplitEvent::Answer(b)) => a.push_str(&b),
        (Some(SplitEvent::Reasoning(a)), SplitEvent::Reasoning(b)) => a.push_str(&b),
        (_, event) => events.push(event),
    }
}

/// Parses a tool-call body: a JSON object with a string `name` and an `arguments` value
/// (`parameters` is accepted as an alias, as other Hermes-style models write it).
pub fn parse_tool_call(body: &str) -> Result<ToolCall, String> {
    let value: serde_json::Value = serde_json::from_str(body.trim())
        .map_err(|e| format!("the tool call is not valid JSON: {e}"))?;
    let serde_json::Value::Object(mut obj) = value else {
        return Err("the tool call is not a JSON object".to_string());
    };
    let name = match obj.remove("name") {
        Some(serde_json::Value::String(name)) => name,
        Some(other) => return Err(format!("the tool call's `name` is not a string: {other}")),
        None => return Err("the tool call has no `name`".to_string()),
    };
    let arguments = match obj.remove("arguments").or_else(|| obj.remove("parameters")) {
        None => serde_json::Value::Object(serde_json::Map::new()),
        Some(serde_json::Value::String(s)) => match serde_json::from_str(&s) {
            Ok(decoded @ serde_json::Value::Object(_)) => decoded,
            _ => serde_json::Value::String(s),
        },
        Some(other) => other,
    };
    Ok(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_tags() {
        let answer = Section::Answer.tags();
        assert_eq!(partial_tag_len("abc <thi", answer), 4);
        assert_eq!(partial_tag_len("abc <tool_ca", answer), 8);
        assert_eq!(partial_tag_len("abc <the", answer), 0);
        assert_eq!(partial_tag_len("<", answer), 1);
        assert_eq!(partial_tag_len("a < b", answer), 0);
        assert_eq!(partial_tag_len("🚀<", answer), 1);
        assert_eq!(partial_tag_len("</thi", Section::Reasoning.tags()), 5);
        assert_eq!(partial_tag_len("</think", Section::Reasoning.tags()), 7);
    }
}
