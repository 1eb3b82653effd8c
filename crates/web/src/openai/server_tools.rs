//! `server_tools`, an extension of `POST /v1/chat/completions`: the caller names tools the
//! server runs itself (`true`: every tool its key's account is offered), the same tools the chat
//! offers, under the same rules (`service::tools`: time limit, size cap, audit, metrics). The
//! reply goes round by round as in the chat: each round the model ends having called tools, the
//! server runs them, the calls and their results join the messages as a client would send them
//! back, and the next round is built by the one prompt builder and submitted like any request
//! (fair-shared, counted in the caller's usage).
//!
//! What comes back is an ordinary chat completion: the rounds' text as `content` (and
//! `reasoning_content`), the calls the server ran in `message.server_tool_calls` (each with its
//! result, whether it failed or was cut, and how long it took), never in `tool_calls`, which
//! stay the client's to run. Streamed, the same text arrives as content deltas and each call as
//! a `server_tool_calls` delta when it starts and when it ends. A reply that calls again after
//! `tools.max_rounds` rounds ends there (`finish_reason: "stop"`), its last calls `skipped`.
//! `max_tokens` bounds the whole reply, every round together.
//!
//! Who may ask, and for what, is the service's rule (`Conversations::api_tools`): `[tools]
//! api = true`, a caller with an API key, tools offered to its account that need no Allow.

use std::convert::Infallible;
use std::sync::Arc;

use actix_web::web;
use actix_web::{HttpRequest, HttpResponse};
use actix_web_lab::sse;
use serde::Serialize;
use serde_json::{json, Value};
use smolchat_service::completions::{Completion, GenSummary, StopReason};
use smolchat_service::models::ServedModel;
use smolchat_service::Caller;

use super::assemble::finish_reason;
use super::request::{ApiMessage, CallIn, ChatRequest};
use super::{usage_of_rounds, Assembler, ChatAssembler, Envelope, DONE};
use crate::error::ApiError;
use crate::v1::{self, build_chat_prompt, client_identity, read_files, submit, ApiUser};
use crate::AppState;

/// One call the server ran (or did not) for the reply, as the caller sees it.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ServerStep {
    pub id: String,
    /// The round of the reply that made it (from 1).
    pub round: usize,
    pub name: String,
    /// As the model wrote them (JSON text).
    pub arguments: String,
    /// `running`, `done`, `error` or `skipped` (after `tools.max_rounds`: not run).
    pub status: &'static str,
    pub result: Option<String>,
    /// The result was cut to `tools.max_result_chars`.
    pub truncated: bool,
    pub duration_ms: Option<f64>,
}

/// What the loop hands out as it goes (for a stream; a whole answer ignores it).
enum Progress {
    /// Choice deltas of the reply's text (OpenAI's chunk `choices`).
    Deltas(Vec<Value>),
    /// A call started or ended.
    Step(ServerStep),
}

/// The reply once every round has ended.
struct Outcome {
    content: String,
    reasoning: String,
    steps: Vec<ServerStep>,
    finish_reason: &'static str,
    rounds: Vec<GenSummary>,
}

/// What every round of one request shares.
struct Run {
    state: web::Data<AppState>,
    http: HttpRequest,
    served: Arc<ServedModel>,
    caller: Caller,
    salt: String,
    user: ApiUser,
}

/// Answers a chat request with `server_tools` (already checked: see the module docs).
pub(super) async fn answer(
    http: HttpRequest,
    state: web::Data<AppState>,
    served: Arc<ServedModel>,
    mut req: ChatRequest,
    salt: String,
    user: ApiUser,
    sources: Option<Value>,
) -> Result<HttpResponse, ApiError> {
    if req.common.n != 1 {
        return Err(ApiError::invalid(
            "n",
            "`server_tools` answer one choice: leave `n` out or set it to 1",
        ));
    }
    if req.common.params.logprobs.is_some() {
        return Err(ApiError::invalid(
            "logprobs",
            "`logprobs` are not given with `server_tools`: leave one of them out",
        ));
    }
    let Some(caller) = v1::api_owner(&http) else {
        // `api_tools` refused a caller without an account already; kept as a guard.
        return Err(ApiError::forbidden(
            "server_tools",
            "server-side tools run for an account: send the request with an API key",
        ));
    };
    // Files are read once, into the messages every round is built from.
    read_files(&state, &served, &client_identity(&http), &mut req).await?;
    let run = Run {
        state,
        http: http.clone(),
        served,
        caller,
        salt,
        user,
    };
    // The first round is submitted before answering, so its refusals (a prompt too long, a
    // full server, a limit) are the response's status, streamed or not.
    let first = run.submit_round(&req).await?;
    let envelope = Envelope::new("chatcmpl", run.served.id());
    let (stream, include_usage) = (req.common.stream, req.common.include_usage);
    if !stream {
        let outcome = run.rounds(req, first, &mut |_| true).await?;
        let mut message = json!({"role": "assistant", "content": outcome.content});
        if !outcome.reasoning.is_empty() {
            message["reasoning_content"] = json!(outcome.reasoning);
        }
        message["server_tool_calls"] = json!(outcome.steps);
        let choice = json!({"index": 0, "message": message, "logprobs": null,
            "finish_reason": outcome.finish_reason});
        let mut body = envelope.wrap("chat.completion", vec![choice]);
        body["usage"] = usage_of_rounds(&outcome.rounds);
        if let Some(s) = sources {
            body["sources"] = s;
        }
        return Ok(HttpResponse::Ok().json(body));
    }

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<sse::Event>();
    let chunk = {
        let envelope = envelope.clone();
        move |choices: Vec<Value>| {
            super::sse(
                &envelope.wrap("chat.completion.chunk", choices),
                include_usage,
            )
        }
    };
    let task = actix_web::rt::spawn(async move {
        let opening = json!({"index": 0, "delta": {"role": "assistant", "content": ""},
            "logprobs": null, "finish_reason": null});
        let mut head = envelope.wrap("chat.completion.chunk", vec![opening]);
        if let Some(s) = sources {
            head["sources"] = s;
        }
        // A send fails once the client has gone: the loop stops at its next piece.
        let _ = tx.send(super::sse(&head, include_usage));
        let mut emit = |p: Progress| {
            let choices = match p {
                Progress::Deltas(d) => d,
                Progress::Step(step) => vec![json!({"index": 0,
                    "delta": {"server_tool_calls": [step]}, "logprobs": null,
                    "finish_reason": null})],
            };
            choices.is_empty() || tx.send(chunk(choices)).is_ok()
        };
        match run.rounds(req, first, &mut emit).await {
            Ok(outcome) => {
                let last = json!({"index": 0, "delta": {}, "logprobs": null,
                    "finish_reason": outcome.finish_reason});
                let _ = tx.send(chunk(vec![last]));
                if include_usage {
                    let mut usage = envelope.wrap("chat.completion.chunk", Vec::new());
                    usage["usage"] = usage_of_rounds(&outcome.rounds);
                    let _ = tx.send(v1::stream::event(None, usage));
                }
            }
            Err(e) => {
                let _ = tx.send(v1::stream::event(None, e.body()));
            }
        }
        let _ = tx.send(v1::stream::event(None, DONE));
    });
    // The client going away drops the stream, which stops the loop (and with it the round's
    // request, cancelled as its completion drops).
    let guard = AbortOnDrop(task);
    let events = futures_util::stream::unfold((rx, guard), |(mut rx, guard)| async move {
        rx.recv()
            .await
            .map(|event| (Ok::<_, Infallible>(event), (rx, guard)))
    });
    Ok(v1::stream::sse_response(&http, events))
}

/// Stops the loop's task when the answer's stream is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Run {
    /// Builds `req`'s prompt and submits it as one round.
    async fn submit_round(&self, req: &ChatRequest) -> Result<(Completion, bool), ApiError> {
        let prompt = build_chat_prompt(&self.state, &self.http, &self.served, req).await?;
        let completion = submit(
            &self.state,
            &self.served,
            req.common.clone(),
            self.salt.clone(),
            self.user.clone(),
            prompt.tokens,
            "messages",
        )
        .await?;
        Ok((completion, prompt.starts_in_reasoning))
    }

    /// Runs the rounds from the first one's completion to the reply's end; `emit` is told of
    /// each piece (it returns false once nobody listens, which ends the loop).
    async fn rounds(
        &self,
        mut req: ChatRequest,
        first: (Completion, bool),
        emit: &mut dyn FnMut(Progress) -> bool,
    ) -> Result<Outcome, ApiError> {
        let conversations = self.state.platform.conversations();
        let max_rounds = conversations.max_tool_rounds();
        let budget = req.common.max_tokens;
        let mut out = Outcome {
            content: String::new(),
            reasoning: String::new(),
            steps: Vec::new(),
            finish_reason: "stop",
            rounds: Vec::new(),
        };
        let (mut completion, mut starts_in_reasoning) = first;
        for round in 1.. {
            let mut assembler = ChatAssembler::new(starts_in_reasoning, true);
            let mut joined = Joined::new(&out.content, &out.reasoning);
            let mut gone = false;
            let summary = v1::collect(completion, |text, _| {
                let deltas = joined.deltas(assembler.push(text));
                gone |= !emit(Progress::Deltas(deltas));
            })
            .await?;
            let tail = assembler.finish(&summary.reason);
            if gone || !emit(Progress::Deltas(joined.deltas(tail))) {
                return Err(ApiError::unavailable("the client went away"));
            }
            let sep = |done: &str, new: &str| {
                if done.is_empty() || new.is_empty() {
                    ""
                } else {
                    "\n\n"
                }
            };
            out.content = format!(
                "{}{}{}",
                out.content,
                sep(&out.content, assembler.content()),
                assembler.content()
            );
            out.reasoning = format!(
                "{}{}{}",
                out.reasoning,
                sep(&out.reasoning, assembler.reasoning()),
                assembler.reasoning()
            );
            let ended_by_itself = matches!(
                summary.reason,
                StopReason::EndOfGeneration | StopReason::StopString(_)
            );
            out.rounds.push(summary.clone());
            let calls = assembler.calls().to_vec();
            if calls.is_empty() || !ended_by_itself {
                out.finish_reason = finish_reason(&summary.reason, false);
                return Ok(out);
            }
            if round > max_rounds {
                for call in calls {
                    let step = ServerStep {
                        id: call.id,
                        round,
                        name: call.name,
                        arguments: call.arguments,
                        status: "skipped",
                        result: None,
                        truncated: false,
                        duration_ms: None,
                    };
                    emit(Progress::Step(step.clone()));
                    out.steps.push(step);
                }
                out.finish_reason = "stop";
                return Ok(out);
            }
            // What the next round reads: the model's turn with its calls, then their results,
            // as a client running them would send them back.
            let mut results = Vec::with_capacity(calls.len());
            for call in &calls {
                let mut step = ServerStep {
                    id: call.id.clone(),
                    round,
                    name: call.name.clone(),
                    arguments: call.arguments.clone(),
                    status: "running",
                    result: None,
                    truncated: false,
                    duration_ms: None,
                };
                if !emit(Progress::Step(step.clone())) {
                    return Err(ApiError::unavailable("the client went away"));
                }
                let arguments = serde_json::from_str(&call.arguments)
                    .unwrap_or_else(|_| Value::String(call.arguments.clone()));
                let result = conversations
                    .call_api_tool(&self.caller, &call.name, &arguments)
                    .await;
                step.status = if result.error { "error" } else { "done" };
                step.truncated = result.truncated;
                step.duration_ms = Some(result.duration.as_secs_f64() * 1e3);
                step.result = Some(result.text.clone());
                emit(Progress::Step(step.clone()));
                out.steps.push(step);
                results.push(ApiMessage {
                    role: "tool".into(),
                    content: result.text,
                    files: Vec::new(),
                    reasoning_content: None,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(call.id.clone()),
                    name: Some(call.name.clone()),
                });
            }
            req.messages.push(ApiMessage {
                role: "assistant".into(),
                content: assembler.content().to_string(),
                files: Vec::new(),
                reasoning_content: None,
                tool_calls: calls
                    .iter()
                    .map(|c| CallIn {
                        id: Some(c.id.clone()),
                        name: c.name.clone(),
                        arguments: c.arguments.clone(),
                    })
                    .collect(),
                tool_call_id: None,
                name: None,
            });
            req.messages.extend(results);
            // A forced call (`tool_choice`) is the first round's; the model is free after it.
            req.forced_tools = None;
            if req.common.grammar_field.as_deref() == Some("tool_choice") {
                req.common.params.grammar = None;
                req.common.grammar_field = None;
            }
            // `max_tokens` is the whole reply's.
            if let Some(limit) = budget {
                let used: usize = out.rounds.iter().map(|s| s.completion_tokens).sum();
                if used >= limit {
                    out.finish_reason = "length";
                    return Ok(out);
                }
                req.common.max_tokens = Some(limit - used);
            }
            (completion, starts_in_reasoning) = self.submit_round(&req).await?;
        }
        Ok(out)
    }
}

/// Joins the rounds' text into one reply for the stream: the server's calls are reported as
/// `server_tool_calls`, never as `tool_calls` deltas, and a round's text is set apart from the
/// last round's by a blank line, as the whole answer's `content` is.
struct Joined {
    content_before: bool,
    reasoning_before: bool,
    content_started: bool,
    reasoning_started: bool,
}

impl Joined {
    fn new(content: &str, reasoning: &str) -> Self {
        Self {
            content_before: !content.is_empty(),
            reasoning_before: !reasoning.is_empty(),
            content_started: false,
            reasoning_started: false,
        }
    }

    fn deltas(&mut self, choices: Vec<Value>) -> Vec<Value> {
        choices
            .into_iter()
            .filter(|c| c["delta"].get("tool_calls").is_none() && c["finish_reason"].is_null())
            .map(|mut c| {
                for (key, before, started) in [
                    ("content", self.content_before, &mut self.content_started),
                    (
                        "reasoning_content",
                        self.reasoning_before,
                        &mut self.reasoning_started,
                    ),
                ] {
                    if let Some(text) = c["delta"][key].as_str().filter(|t| !t.is_empty()) {
                        if before && !*started {
                            c["delta"][key] = json!(format!("\n\n{text}"));
                        }
                        *started = true;
                    }
                }
                c
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(key: &str, text: &str) -> Value {
        json!({"index": 0, "delta": {key: text}, "logprobs": null, "finish_reason": null})
    }

    #[test]
    fn a_later_rounds_text_is_set_apart_and_calls_and_endings_are_not_streamed() {
        let mut first = Joined::new("", "");
        assert_eq!(
            first.deltas(vec![delta("content", "Let me see.")]),
            [delta("content", "Let me see.")]
        );
        let mut second = Joined::new("Let me see.", "");
        let call = json!({"index": 0, "delta": {"tool_calls": [{"index": 0}]},
            "logprobs": null, "finish_reason": null});
        let end = json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"});
        assert_eq!(
            second.deltas(vec![
                call,
                delta("reasoning_content", "hm"),
                delta("content", "It is 84."),
                delta("content", " Done."),
                end,
            ]),
            [
                delta("reasoning_content", "hm"),
                delta("content", "\n\nIt is 84."),
                delta("content", " Done."),
            ]
        );
    }
}
