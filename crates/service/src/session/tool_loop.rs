//! The tool loop of a reply (see [`ToolLoop`]): what happens when a round of generation ends
//! having called tools, when the user allows or denies a call, and when the reply is stopped
//! between rounds.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use smolchat_serving::types::{Failure, GenSummary, StopReason};
use smolchat_store::{ToolStep, ToolStepStatus};
use uuid::Uuid;

use super::{prompt, SessionActor, SessionError};
use crate::reply::ReplyEvent;
use crate::tools::ToolContext;

/// What the model reads for a call the user denied.
pub const DENIED_RESULT: &str = "error: the user denied this call; do not call it again for \
     this request, answer without it or ask the user";

/// What the model would read for a call the reply was stopped before (shown, never read).
const STOPPED_RESULT: &str = "error: the reply was stopped before this call ended";

/// A summary for a reply that ends between rounds (no request with the scheduler).
fn between_rounds_summary(reason: StopReason) -> GenSummary {
    GenSummary {
        reason,
        prompt_tokens: 0,
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

impl SessionActor {
    /// Whether a round that ended with `summary` goes on to its tool calls: the conversation
    /// offers tools, the round made calls and ended by itself, and the reply has rounds left.
    pub(super) fn wants_tools(&self, summary: &GenSummary) -> bool {
        let (Some(_), Some(reply)) = (self.tool_loop.as_ref(), self.reply.as_ref()) else {
            return false;
        };
        let ended_by_itself = matches!(
            summary.reason,
            StopReason::EndOfGeneration | StopReason::StopString(_)
        );
        ended_by_itself
            && !reply.stop_requested
            && !reply.round_calls().is_empty()
            && reply.round() <= self.shared.tools.max_rounds()
    }

    /// A round ended having called tools: each call becomes a saved, shown step, then they run
    /// in order (or wait for the user's decision).
    pub(super) fn start_tool_round(&mut self, summary: GenSummary, ctx: &mut Context<Self>) {
        let tools = Arc::clone(&self.shared.tools);
        let Some(reply) = self.reply.as_mut() else {
            return;
        };
        let events = reply.end_round(&summary);
        let (raw_offset, content_offset) = reply.offsets();
        let calls = reply.round_calls().to_vec();
        let mut made = Vec::with_capacity(calls.len());
        for call in calls {
            let step = ToolStep {
                message_id: reply.assistant_message_id,
                step: reply.steps.len() as i64,
                arguments: serde_json::to_string(&call.arguments)
                    .unwrap_or_else(|_| "{}".to_string()),
                status: if tools.needs_approval(&call.name) {
                    ToolStepStatus::AwaitingApproval
                } else {
                    ToolStepStatus::Running
                },
                name: call.name,
                result: None,
                raw_offset: raw_offset as i64,
                content_offset: content_offset as i64,
                duration_ms: None,
            };
            reply.steps.push(step.clone());
            made.push(step);
        }
        if let Some(l) = self.tool_loop.as_mut() {
            l.between_rounds = true;
        }
        for event in events {
            self.broadcast(event);
        }
        // Saved before they are shown or run: the reply's text so far, then the calls (in
        // order, so a later update never lands before its row). A viewer never sees a call a
        // crash could lose.
        let store = self.shared.store.clone();
        let save_text = self.reply.as_mut().map(|r| r.save_now(store.clone()));
        async move {
            if let Some(save) = save_text {
                save.await?;
            }
            for step in &made {
                store.save_tool_step(step).await?;
            }
            Ok::<_, smolchat_store::StoreError>(made)
        }
        .into_actor(self)
        .map(|saved, act, ctx| match saved {
            Ok(made) => {
                for step in made {
                    act.broadcast(ReplyEvent::ToolStep { step });
                }
                act.run_next_step(ctx)
            }
            Err(e) => {
                tracing::error!(conversation = %act.id, "cannot save a reply's tool calls: {e}");
                act.end_between_rounds(
                    StopReason::Error(Failure::Engine(format!(
                        "the reply's tool calls could not be saved: {e}"
                    ))),
                    ctx,
                );
            }
        })
        .wait(ctx);
    }

    /// Runs the first call that may run; once none waits or runs, the reply goes on.
    fn run_next_step(&mut self, ctx: &mut Context<Self>) {
        let Some(reply) = self.reply.as_ref() else {
            return;
        };
        if let Some(step) = reply
            .steps
            .iter()
            .find(|s| s.status == ToolStepStatus::Running)
            .cloned()
        {
            let (store, tools) = (self.shared.store.clone(), Arc::clone(&self.shared.tools));
            let (owner, admin) = self
                .tool_loop
                .as_ref()
                .map(|l| (l.conversation.owner.clone(), l.tools.owner_admin))
                .unwrap_or_default();
            let started = Instant::now();
            let id = self.id;
            let call = async move {
                let arguments = serde_json::from_str(&step.arguments)
                    .unwrap_or(serde_json::Value::String(step.arguments.clone()));
                let ctx = ToolContext {
                    store: &store,
                    owner: &owner,
                    admin,
                };
                let result = tools.call(&ctx, &step.name, &arguments).await;
                let how = if result.error { "error" } else { "done" };
                crate::audit::Audit::new(store.clone())
                    .record_owner(
                        &owner,
                        "tool.call",
                        &format!("conversation:{id}"),
                        &format!("{}: {how} in {} ms", step.name, result.duration.as_millis()),
                    )
                    .await;
                (step.step, result)
            }
            .into_actor(self)
            .map(
                move |(n, result), act: &mut Self, ctx: &mut Context<Self>| {
                    if let Some(l) = act.tool_loop.as_mut() {
                        l.running = None;
                    }
                    let status = if result.error {
                        ToolStepStatus::Error
                    } else {
                        ToolStepStatus::Done
                    };
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    act.set_steps(
                        vec![(n, status, Some(result.text), Some(ms))],
                        ctx,
                        |act, ctx| act.run_next_step(ctx),
                    );
                },
            );
            let handle = ctx.spawn(call);
            if let Some(l) = self.tool_loop.as_mut() {
                l.running = Some(handle);
            }
            return;
        }
        let waiting = reply
            .steps
            .iter()
            .any(|s| s.status == ToolStepStatus::AwaitingApproval);
        if !waiting {
            self.continue_reply(ctx);
        }
    }

    /// Records where steps stand now (`(step, status, result, duration)`): in the reply, in the
    /// store, to the viewers, in that order; then `then`. Everything after runs in `then`:
    /// actix polls the futures a handler `wait`s on last first, so a second `wait` here would
    /// run before this one.
    fn set_steps(
        &mut self,
        ended: Vec<(i64, ToolStepStatus, Option<String>, Option<f64>)>,
        ctx: &mut Context<Self>,
        then: impl FnOnce(&mut Self, &mut Context<Self>) + 'static,
    ) {
        let mut changed = Vec::with_capacity(ended.len());
        if let Some(reply) = self.reply.as_mut() {
            for (n, status, result, duration_ms) in ended {
                if let Some(step) = reply.steps.iter_mut().find(|s| s.step == n) {
                    step.status = status;
                    step.result = result;
                    step.duration_ms = duration_ms;
                    changed.push(step.clone());
                }
            }
        }
        let store = self.shared.store.clone();
        // Saved, then shown (a failed save is logged: the reply goes on, and its end is saved).
        async move {
            let mut failed = None;
            for step in &changed {
                if let Err(e) = store.save_tool_step(step).await {
                    failed = Some(e);
                }
            }
            (failed, changed)
        }
        .into_actor(self)
        .map(move |(failed, changed), act, ctx| {
            if let Some(e) = failed {
                tracing::warn!(conversation = %act.id, "cannot save a tool call's result: {e}");
            }
            for step in changed {
                act.broadcast(ReplyEvent::ToolStep { step });
            }
            then(act, ctx);
        })
        .wait(ctx);
    }

    /// Every call of the round has ended: the prompt with their results is built again and the
    /// next round submitted on the conversation's cache.
    fn continue_reply(&mut self, ctx: &mut Context<Self>) {
        let (Some(reply), Some(l), Some(model)) = (
            self.reply.as_ref(),
            self.tool_loop.as_ref(),
            self.reply_model.clone(),
        ) else {
            return;
        };
        if reply.stop_requested {
            self.end_between_rounds(StopReason::Cancelled, ctx);
            return;
        }
        let raw = reply.raw().to_string();
        let steps = reply.steps.clone();
        let (conversation, history, user_text, tools, group) = (
            l.conversation.clone(),
            l.history.clone(),
            l.user_text.clone(),
            l.tools.clone(),
            l.group.clone(),
        );
        let id = self.id;
        let work = async move {
            let owner = conversation.owner.clone();
            let prepared = {
                let model = Arc::clone(&model);
                tokio::task::spawn_blocking(move || {
                    prompt::prepare(
                        &model,
                        &conversation,
                        &history,
                        &tools,
                        prompt::Turn::Continue {
                            user: &user_text,
                            raw: &raw,
                            steps: &steps,
                        },
                    )
                })
                .await
                .map_err(|e| SessionError::PromptTask(e.to_string()))??
            };
            let completion = model.submit(prepared.request(id, owner, group)).await?;
            Ok::<_, SessionError>((completion, prepared))
        };
        work.into_actor(self)
            .map(move |result, act, ctx| match result {
                Ok((completion, prepared)) => {
                    let Some(reply) = act.reply.as_mut() else {
                        return;
                    };
                    reply.start_round(
                        completion.id(),
                        prepared.starts_in_reasoning,
                        prepared.prompt.len(),
                    );
                    let stop = reply.stop_requested;
                    if let Some(l) = act.tool_loop.as_mut() {
                        l.between_rounds = false;
                    }
                    ctx.add_stream(completion);
                    let round = reply.round();
                    act.broadcast(ReplyEvent::Continuing { round });
                    if stop {
                        act.cancel_running(ctx);
                    }
                }
                Err(e) => {
                    tracing::warn!(conversation = %act.id, "a reply could not go on after its tool calls: {e}");
                    act.end_between_rounds(
                        StopReason::Error(Failure::Engine(format!(
                            "the reply could not go on after its tool calls: {e}"
                        ))),
                        ctx,
                    );
                }
            })
            .wait(ctx);
    }

    /// Ends a reply between rounds (stopped, or its next round could not start): the calls still
    /// waiting or running end as stopped, then the reply is stored as usual.
    pub(super) fn end_between_rounds(&mut self, reason: StopReason, ctx: &mut Context<Self>) {
        if let Some(handle) = self.tool_loop.as_mut().and_then(|l| l.running.take()) {
            ctx.cancel_future(handle);
        }
        let open: Vec<i64> = self
            .reply
            .as_ref()
            .map(|r| {
                r.steps
                    .iter()
                    .filter(|s| s.status.is_open())
                    .map(|s| s.step)
                    .collect()
            })
            .unwrap_or_default();
        let ended = open
            .into_iter()
            .map(|n| {
                (
                    n,
                    ToolStepStatus::Error,
                    Some(STOPPED_RESULT.to_string()),
                    None,
                )
            })
            .collect();
        self.set_steps(ended, ctx, move |act, ctx| {
            act.finish_reply(between_rounds_summary(reason), ctx)
        });
    }

    /// Whether the reply is between rounds (its calls wait or run).
    pub(super) fn between_rounds(&self) -> bool {
        self.tool_loop.as_ref().is_some_and(|l| l.between_rounds)
    }
}

/// Allow or deny a tool call that waits for the user's decision.
#[derive(Message)]
#[rtype(result = "Result<(), SessionError>")]
pub struct DecideTool {
    /// The reply (assistant message) that made the call.
    pub message: Uuid,
    pub step: i64,
    pub allow: bool,
}

impl Handler<DecideTool> for SessionActor {
    type Result = Result<(), SessionError>;

    fn handle(&mut self, msg: DecideTool, ctx: &mut Context<Self>) -> Self::Result {
        let waiting = self.reply.as_ref().is_some_and(|r| {
            r.assistant_message_id == msg.message
                && r.steps
                    .iter()
                    .any(|s| s.step == msg.step && s.status == ToolStepStatus::AwaitingApproval)
        });
        if !waiting {
            return Err(SessionError::ToolStepNotWaiting { step: msg.step });
        }
        self.last_activity = Instant::now();
        // Allowed, it runs; denied, the model reads a refusal.
        let (status, result) = if msg.allow {
            (ToolStepStatus::Running, None)
        } else {
            (ToolStepStatus::Denied, Some(DENIED_RESULT.to_string()))
        };
        self.set_steps(vec![(msg.step, status, result, None)], ctx, |act, ctx| {
            // Unless a call runs already (the loop goes on when that one ends).
            if act.tool_loop.as_ref().is_some_and(|l| l.running.is_none()) {
                act.run_next_step(ctx);
            }
        });
        Ok(())
    }
}
