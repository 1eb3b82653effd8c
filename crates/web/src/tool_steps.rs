//! A reply's tool calls as HTML: each call a collapsible block (its arguments, its result, and
//! while it waits the Allow and Deny buttons), placed in the reply's answer where the call was
//! made. One rendering for the chat page, its live stream and the share page; askama escapes
//! everything the model or a tool wrote.

use askama::Template;
use smolchat_service::records::{ToolStep, ToolStepStatus};

#[derive(Template)]
#[template(path = "tool_step.html")]
struct ToolStepBlock<'a> {
    message: String,
    step: i64,
    name: &'a str,
    arguments: String,
    result: &'a str,
    status: &'static str,
    status_text: &'static str,
    duration: String,
    awaiting: bool,
    /// In a page that can still decide (the chat page while the reply runs).
    live: bool,
    open: bool,
}

/// What a call's state reads as, for people.
fn status_text(status: ToolStepStatus) -> &'static str {
    match status {
        ToolStepStatus::AwaitingApproval => "waits for your approval",
        ToolStepStatus::Running => "running…",
        ToolStepStatus::Done => "done",
        ToolStepStatus::Error => "failed",
        ToolStepStatus::Denied => "denied",
        ToolStepStatus::Interrupted => "interrupted",
    }
}

/// The arguments as indented JSON when they are JSON (the model wrote them compact).
fn pretty_arguments(text: &str) -> String {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| text.to_string())
}

/// One call as a block; `live`: with the Allow and Deny buttons while it waits.
pub fn block(step: &ToolStep, live: bool) -> String {
    let awaiting = step.status == ToolStepStatus::AwaitingApproval;
    let view = ToolStepBlock {
        message: step.message_id.to_string(),
        step: step.step,
        name: &step.name,
        arguments: pretty_arguments(&step.arguments),
        result: step.result.as_deref().unwrap_or(""),
        status: step.status.as_str(),
        status_text: status_text(step.status),
        duration: step
            .duration_ms
            .map(|ms| format!("{ms:.0} ms"))
            .unwrap_or_default(),
        awaiting,
        live,
        // A call that needs the user, or runs, is shown open; ended ones folded.
        open: live && step.status.is_open(),
    };
    view.render().unwrap_or_else(|e| {
        tracing::error!("cannot render a tool call: {e}");
        String::new()
    })
}

/// A finished reply's answer as HTML with its calls' blocks where they were made: the answer
/// cut at each call's place, each part rendered as markdown on its own.
pub fn answer_with_steps(content: &str, steps: &[ToolStep]) -> String {
    if steps.is_empty() {
        return crate::markdown::render(content);
    }
    let mut out = String::new();
    let mut at = 0;
    for step in steps {
        let cut = smolchat_service::records::offset_in(content, step.content_offset, at);
        if cut > at {
            out.push_str(&crate::markdown::render(&content[at..cut]));
        }
        out.push_str(&block(step, false));
        at = cut;
    }
    if at < content.len() {
        out.push_str(&crate::markdown::render(&content[at..]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn step(n: i64, offset: i64, status: ToolStepStatus, result: Option<&str>) -> ToolStep {
        ToolStep {
            message_id: Uuid::nil(),
            step: n,
            name: "calculator".into(),
            arguments: r#"{"expression":"<b>1+1</b>"}"#.into(),
            status,
            result: result.map(str::to_string),
            raw_offset: offset,
            content_offset: offset,
            duration_ms: Some(3.2),
        }
    }

    #[test]
    fn calls_sit_where_they_were_made_and_their_text_is_escaped() {
        let html = answer_with_steps(
            "Let me add.The sum is **2**.",
            &[step(0, 11, ToolStepStatus::Done, Some("2 <script>"))],
        );
        let call = html.find("tool-step").unwrap();
        assert!(html.find("Let me add.").unwrap() < call, "{html}");
        assert!(html.find("<strong>2</strong>").unwrap() > call, "{html}");
        assert!(
            html.contains("2 &#60;script&#62;") || html.contains("2 &lt;script&gt;"),
            "{html}"
        );
        assert!(
            !html.contains("<script>") && !html.contains("<b>1+1"),
            "{html}"
        );
        assert!(
            html.contains("3 ms") && html.contains("status-done"),
            "{html}"
        );
        // An offset past the text, or inside a character, stays inside it.
        let odd = answer_with_steps("é", &[step(0, 1, ToolStepStatus::Done, Some("x"))]);
        assert!(odd.contains("tool-step"), "{odd}");
        let far = answer_with_steps("a", &[step(0, 99, ToolStepStatus::Done, Some("x"))]);
        assert!(far.find("<p>a</p>").unwrap() < far.find("tool-step").unwrap());
    }

    #[test]
    fn a_waiting_call_has_its_buttons_only_live() {
        let s = step(1, 0, ToolStepStatus::AwaitingApproval, None);
        assert!(block(&s, true).contains("tool-allow"));
        assert!(block(&s, true).contains(" open"));
        assert!(!block(&s, false).contains("tool-allow"));
    }
}
