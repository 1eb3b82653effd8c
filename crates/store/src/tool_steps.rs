//! The tool calls a reply made (`tool_steps`): saved when a call is made, again when it ends, so
//! a reload shows every step and a restart never re-runs one.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::*;

/// Where a tool call stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolStepStatus {
    /// Waits for the user to allow or deny it.
    AwaitingApproval,
    Running,
    Done,
    /// The tool failed, timed out or was stopped; the result says which.
    Error,
    /// The user denied it; the model read a refusal.
    Denied,
    /// The server stopped while it waited or ran; it is never re-run.
    Interrupted,
}

impl ToolStepStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolStepStatus::AwaitingApproval => "awaiting_approval",
            ToolStepStatus::Running => "running",
            ToolStepStatus::Done => "done",
            ToolStepStatus::Error => "error",
            ToolStepStatus::Denied => "denied",
            ToolStepStatus::Interrupted => "interrupted",
        }
    }

    /// Whether the call has not ended (it waits or runs).
    pub fn is_open(self) -> bool {
        matches!(
            self,
            ToolStepStatus::AwaitingApproval | ToolStepStatus::Running
        )
    }
}

impl std::str::FromStr for ToolStepStatus {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "awaiting_approval" => ToolStepStatus::AwaitingApproval,
            "running" => ToolStepStatus::Running,
            "done" => ToolStepStatus::Done,
            "error" => ToolStepStatus::Error,
            "denied" => ToolStepStatus::Denied,
            "interrupted" => ToolStepStatus::Interrupted,
            other => return Err(format!("unknown tool step status {other:?}")),
        })
    }
}

/// Where a stored byte `offset` into `text` falls: inside it, on a character, and not before
/// `from` (offsets come from the database; a wrong one moves a call, it never panics a reader).
/// The one reading of `raw_offset` and `content_offset` for the prompt, the page and exports.
pub fn offset_in(text: &str, offset: i64, from: usize) -> usize {
    let mut at = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(text.len())
        .max(from.min(text.len()));
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The result the model reads for a call the server stopped during.
pub const INTERRUPTED_TOOL_RESULT: &str =
    "error: the call was interrupted (the server stopped while it ran); it was not run again";

/// One tool call of a reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolStep {
    pub message_id: Uuid,
    /// 0, 1, 2, … within the reply, in the order made.
    pub step: i64,
    pub name: String,
    /// The arguments as the model wrote them (JSON text).
    pub arguments: String,
    pub status: ToolStepStatus,
    /// What the model read (`None` while the call waits or runs).
    pub result: Option<String>,
    /// Bytes of the reply's raw text, and of its answer text, when the call was made.
    pub raw_offset: i64,
    pub content_offset: i64,
    pub duration_ms: Option<f64>,
}

impl ToolStep {
    /// What the model reads as this call's result (an interrupted call's note when it has none).
    pub fn result_for_model(&self) -> &str {
        self.result.as_deref().unwrap_or(INTERRUPTED_TOOL_RESULT)
    }
}

#[derive(sqlx::FromRow)]
struct ToolStepRow {
    message_id: String,
    step: i64,
    name: String,
    arguments: String,
    status: String,
    result: Option<String>,
    raw_offset: i64,
    content_offset: i64,
    duration_ms: Option<f64>,
    /// The reply's status: a step left open by a reply that is no longer streaming was cut off.
    message_status: String,
}

impl ToolStepRow {
    fn into_step(self) -> Result<ToolStep, StoreError> {
        const T: &str = "tool_steps";
        let mut status: ToolStepStatus = self
            .status
            .parse()
            .map_err(|e: String| corrupt(T, &self.message_id, e))?;
        if status.is_open() && self.message_status != "streaming" {
            status = ToolStepStatus::Interrupted;
        }
        Ok(ToolStep {
            message_id: parse_uuid(T, &self.message_id, &self.message_id)?,
            step: self.step,
            name: self.name,
            arguments: self.arguments,
            status,
            result: self.result,
            raw_offset: self.raw_offset.max(0),
            content_offset: self.content_offset.max(0),
            duration_ms: self.duration_ms,
        })
    }
}

impl Store {
    /// Saves a tool call as it stands now (made, then ended).
    pub async fn save_tool_step(&self, step: &ToolStep) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO tool_steps (message_id, step, name, arguments, status, result, \
               raw_offset, content_offset, duration_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (message_id, step) DO UPDATE SET status = excluded.status, \
               result = excluded.result, duration_ms = excluded.duration_ms",
        )
        .bind(step.message_id.to_string())
        .bind(step.step)
        .bind(&step.name)
        .bind(&step.arguments)
        .bind(step.status.as_str())
        .bind(step.result.as_deref())
        .bind(step.raw_offset)
        .bind(step.content_offset)
        .bind(step.duration_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The tool calls of a conversation's replies, by reply, each in order. A call left waiting
    /// or running by a reply that no longer streams reads as `interrupted`.
    pub async fn tool_steps_of(
        &self,
        conversation: Uuid,
    ) -> Result<HashMap<Uuid, Vec<ToolStep>>, StoreError> {
        let rows: Vec<ToolStepRow> = sqlx::query_as(
            "SELECT s.message_id, s.step, s.name, s.arguments, s.status, s.result, \
               s.raw_offset, s.content_offset, s.duration_ms, m.status AS message_status \
             FROM tool_steps s JOIN messages m ON m.id = s.message_id \
             WHERE m.conversation_id = $1 ORDER BY s.message_id, s.step",
        )
        .bind(conversation.to_string())
        .fetch_all(&self.pool)
        .await?;
        let mut by_reply: HashMap<Uuid, Vec<ToolStep>> = HashMap::new();
        for row in rows {
            let step = row.into_step()?;
            by_reply.entry(step.message_id).or_default().push(step);
        }
        Ok(by_reply)
    }

    /// The tool calls of one reply, in order (read as [`Store::tool_steps_of`] reads them).
    pub async fn tool_steps_of_reply(&self, reply: Uuid) -> Result<Vec<ToolStep>, StoreError> {
        let rows: Vec<ToolStepRow> = sqlx::query_as(
            "SELECT s.message_id, s.step, s.name, s.arguments, s.status, s.result, \
               s.raw_offset, s.content_offset, s.duration_ms, m.status AS message_status \
             FROM tool_steps s JOIN messages m ON m.id = s.message_id \
             WHERE s.message_id = $1 ORDER BY s.step",
        )
        .bind(reply.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(ToolStepRow::into_step).collect()
    }

    /// Marks the calls left waiting or running `interrupted` (their replies were marked so by
    /// [`Store::mark_streaming_interrupted`]); how many there were.
    pub(crate) async fn mark_open_tool_steps_interrupted(&self) -> Result<u64, StoreError> {
        let result = sqlx::query(
            "UPDATE tool_steps SET status = 'interrupted' \
             WHERE status IN ('awaiting_approval', 'running') AND message_id IN \
               (SELECT id FROM messages WHERE status <> 'streaming')",
        )
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::offset_in;

    #[test]
    fn a_stored_offset_stays_inside_the_text_on_a_character() {
        assert_eq!(offset_in("abc", 2, 0), 2);
        assert_eq!(offset_in("abc", 99, 0), 3);
        assert_eq!(offset_in("abc", -5, 0), 3, "negative reads as past the end");
        assert_eq!(offset_in("abc", 1, 2), 2, "never before `from`");
        assert_eq!(
            offset_in("é", 1, 0),
            0,
            "inside a character: back to its start"
        );
        assert_eq!(offset_in("ab", 1, 9), 2, "`from` past the end");
    }
}
