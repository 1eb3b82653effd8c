//! Session actors: one per conversation, started on demand and stopped when idle.
//!
//! A session persists the user's message before acknowledging it, renders the conversation with
//! its settings (system prompt, thinking, pinned template date), asks the scheduler for a reply,
//! fans the reply's events out to every subscriber (several tabs), keeps a replay buffer so a tab
//! that joins mid-reply catches up, and persists the reply when it completes, is stopped or fails.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use actix::prelude::*;
use serde::Serialize;
use tokio::sync::mpsc;
use uuid::Uuid;

mod buffer;
mod mirror;
mod prompt;
mod tool_loop;

pub(crate) use mirror::summary_of_stored;
pub use prompt::{check_message, conversation_prompt};
pub use tool_loop::{DecideTool, DENIED_RESULT};

use crate::cluster::{Cluster, Wire, WireBody};
use crate::reply::ReplyEvent;
use buffer::ReplyBuffer;
use mirror::{Follow, Mirror};
use smolchat_serving::types::{GenEvent, GenSummary, StopReason, SubmitError};
use smolchat_store::{Attachments, Message, MessageStatus, Role, Store, StoreError};

#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Longest accepted user message, in characters.
    pub max_message_chars: usize,
    /// A session with no reply running and no subscriber stops after this long.
    pub idle_timeout: Duration,
    /// When the last subscriber of a running reply goes away, the reply is cancelled after this
    /// long unless a subscriber comes back (a page reload should not kill the reply).
    pub disconnect_grace: Duration,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            max_message_chars: 32_000,
            idle_timeout: Duration::from_secs(300),
            disconnect_grace: Duration::from_secs(5),
        }
    }
}

/// How often a streaming reply's partial text is saved (what a crash can lose at most).
const PARTIAL_SAVE_INTERVAL: Duration = Duration::from_secs(1);

/// What every session shares: the store, the scheduler and the model's text side.
pub struct SessionShared {
    pub store: Store,
    /// The models: each turn runs on its conversation's (`settings.model`).
    pub models: Arc<crate::models::Models>,
    pub cfg: SessionConfig,
    /// This replica among the others: replies are published to them, theirs relayed here.
    pub cluster: Arc<Cluster>,
    /// The tools replies may call (see [`ToolLoop`]).
    pub tools: Arc<crate::tools::Tools>,
    /// Collections whose passages a turn is given (`settings.knowledge`).
    pub knowledge: Arc<crate::knowledge::Knowledge>,
}

/// What a user is told when the store cannot be written (the detail is in the log).
pub const STORAGE_UNAVAILABLE: &str = "the server cannot save anything right now (its storage is full, read-only or busy); nothing was saved, so please try again in a moment";

#[derive(Debug, Clone, thiserror::Error)]
pub enum SessionError {
    #[error("the message is empty")]
    EmptyMessage,
    /// Text no one types: a NUL character (U+0000) and the like.
    #[error("the message contains {0}, which is not text; remove it")]
    NotText(String),
    #[error("the message has {chars} characters; the limit is {limit}")]
    MessageTooLong { chars: usize, limit: usize },
    #[error("a reply is already being generated in this conversation; wait for it or stop it")]
    Busy,
    #[error("conversation not found")]
    NotFound,
    #[error("file {0} is not waiting in this conversation (attach it again)")]
    NoSuchFile(Uuid),
    #[error("there is no message to resend")]
    NothingToResend,
    /// The conversation's model cannot be had (not loaded and no room, or its file is bad).
    #[error(transparent)]
    Model(#[from] crate::models::ModelError),
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// A fault of the store (shared: a session's error goes to every caller waiting on it).
    #[error("storage failed: {0}")]
    Store(#[source] Arc<StoreError>),
    /// The store cannot be written right now (disk full, read-only, locked): nothing was saved.
    #[error("{STORAGE_UNAVAILABLE}")]
    StoreUnavailable,
    #[error("cannot build the prompt: {0}")]
    Prompt(#[source] Arc<smolchat_text::TextError>),
    /// The prompt builder's task ended without an answer (it panicked).
    #[error("the prompt builder failed: {0}")]
    PromptTask(String),
    /// The user's drafts took their share of spare time this minute.
    #[error("{0}; the message will still be sent as usual")]
    DraftLimit(smolchat_serving::warm::WarmRefused),
    /// Allow or Deny for a tool call that does not wait for one.
    #[error("tool call {step} of this reply is not waiting for Allow or Deny (it was decided, or the reply ended); reload to see where it stands")]
    ToolStepNotWaiting { step: i64 },
}

impl From<StoreError> for SessionError {
    fn from(e: StoreError) -> Self {
        if let StoreError::ConversationNotFound(_) = e {
            return SessionError::NotFound;
        }
        if let StoreError::MessageNotFound(_) = e {
            return SessionError::NothingToResend;
        }
        if let StoreError::ReplyInProgress(_) = e {
            // Streaming elsewhere (another replica) counts as busy, like a reply here.
            return SessionError::Busy;
        }
        if e.is_unavailable() {
            tracing::warn!(error = %e, "storage unavailable");
            SessionError::StoreUnavailable
        } else {
            SessionError::Store(Arc::new(e))
        }
    }
}

/// A live subscription: what was missed of the current reply, then the events as they come.
/// Dropping it unsubscribes.
pub struct Subscription {
    pub replay: Vec<ReplyEvent>,
    pub events: mpsc::Receiver<ReplyEvent>,
    pub guard: SubscriptionGuard,
}

/// Events one subscriber may have waiting. A reader that falls this far behind (a client that
/// stopped reading) is dropped: its stream ends, and on reconnecting it gets the reply so far
/// from the replay buffer. Without the bound, a client that never reads would keep every later
/// event in memory.
pub const SUBSCRIBER_BUFFER: usize = 1024;

pub struct SubscriptionGuard {
    session: Addr<SessionActor>,
    id: u64,
}

impl Drop for SubscriptionGuard {
    fn drop(&mut self) {
        self.session.do_send(Unsubscribe(self.id));
    }
}

pub struct SessionActor {
    id: Uuid,
    shared: Arc<SessionShared>,
    registry: Weak<Sessions>,
    subscribers: HashMap<u64, mpsc::Sender<ReplyEvent>>,
    next_subscriber: u64,
    replay: Vec<ReplyEvent>,
    reply: Option<ReplyBuffer>,
    /// A send is between its checks and the scheduler's acceptance.
    sending: bool,
    last_activity: Instant,
    /// Another replica's reply in this conversation, followed for the viewers here.
    remote: Option<Mirror>,
    /// When another replica last said that viewers there follow this replica's reply.
    remote_watched_at: Option<Instant>,
    /// The prompt of the draft offered last (a draft that adds nothing is not offered again).
    last_draft: Option<Vec<u32>>,
    /// The model of the running reply (to stop it there).
    reply_model: Option<Arc<crate::models::ServedModel>>,
    /// The model this conversation's last turn ran on (read-ahead and drafts go there).
    model_id: Option<String>,
    /// The running reply's tool loop, when its conversation offers tools.
    tool_loop: Option<ToolLoop>,
}

/// What a reply that may call tools needs between its rounds: what its prompt is built from,
/// and where its calls stand. The loop: a round of generation ends having made tool calls; each
/// call is saved (`tool_steps`) and shown, waits for the user's Allow when its tool asks for
/// one, runs under the tools' limits and its result is saved and shown; once every call of the
/// round has ended, the prompt (the conversation, the reply so far and the results) is built
/// again and the next round is submitted on the same conversation cache. At most
/// `tools.max_rounds` rounds make calls; Stop ends the reply wherever the loop stands.
struct ToolLoop {
    conversation: smolchat_store::Conversation,
    /// The branch before the user message the reply answers.
    history: Vec<Message>,
    /// The user message's prompt text (files included).
    user_text: String,
    tools: prompt::PromptTools,
    /// The guest address group the reply's tokens also count against.
    group: Option<String>,
    /// Between rounds: the calls wait or run, no request is with the scheduler.
    between_rounds: bool,
    /// The call running now (to stop it).
    running: Option<SpawnHandle>,
}

impl SessionActor {
    /// Sends an event of this replica's reply to the viewers here and to the other replicas.
    fn broadcast(&mut self, event: ReplyEvent) {
        self.publish(&event);
        self.fan_out(event);
    }

    /// Sends an event to the viewers here (and keeps it for those who join later).
    fn fan_out(&mut self, event: ReplyEvent) {
        let id = self.id;
        self.subscribers.retain(|n, tx| match tx.try_send(event.clone()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::debug!(conversation = %id, subscriber = n, "a subscriber fell {SUBSCRIBER_BUFFER} events behind; dropped (it resyncs on reconnect)");
                metrics::counter!("smolchat_slow_subscribers_dropped_total").increment(1);
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        });
        self.replay.push(event);
    }

    fn publish(&self, event: &ReplyEvent) {
        self.shared.cluster.publish_reply(self.id, event);
    }

    /// Answers another replica's [`WireBody::Sync`]: saves the reply so far, then announces how
    /// much of it the stored row holds. Waits (no token is handled meanwhile), so the deltas
    /// published after the snapshot continue exactly where it ends.
    fn send_snapshot(&mut self, ctx: &mut Context<Self>) {
        let cluster = Arc::clone(&self.shared.cluster);
        let Some(reply) = self.reply.as_mut() else {
            return;
        };
        let c = self.id;
        let body = reply.snapshot();
        reply
            .save_now(self.shared.store.clone())
            .into_actor(self)
            .map(move |saved, _, _| match saved {
                Ok(_) => cluster.publish(c, body),
                Err(e) => tracing::warn!("cannot save a reply for a snapshot: {e}"),
            })
            .wait(ctx);
    }

    /// Cancels the reply once nobody follows it any more: no viewer here, and no other replica
    /// said recently that viewers there do. Checked again later while another replica watches.
    fn cancel_when_abandoned(&mut self, reply_id: Option<Uuid>, ctx: &mut Context<Self>) {
        let grace = self.shared.cfg.disconnect_grace;
        let watch_window = grace.max(self.shared.cluster.config().heartbeat * 3);
        ctx.run_later(grace, move |act, ctx| {
            let same_reply = act.reply.as_ref().map(|r| r.assistant_message_id) == reply_id;
            if !same_reply || !act.subscribers.is_empty() {
                return;
            }
            if act
                .remote_watched_at
                .is_some_and(|t| t.elapsed() < watch_window)
            {
                act.cancel_when_abandoned(reply_id, ctx);
                return;
            }
            tracing::debug!(conversation = %act.id, "every listener left; stopping the reply");
            act.cancel_running(ctx);
        });
    }

    /// Starts following another replica's reply for the viewers here, when one is streaming.
    fn follow_remote_reply(&mut self, ctx: &mut Context<Self>) {
        let cluster = Arc::clone(&self.shared.cluster);
        if !cluster.is_shared() || self.is_busy() || self.remote.as_ref().is_some_and(|m| m.synced)
        {
            return;
        }
        let store = self.shared.store.clone();
        let id = self.id;
        ctx.spawn(
            async move { store.streaming_replica(id).await }
                .into_actor(self)
                .map(move |found, act, _| {
                    let Ok(Some((assistant, Some(replica)))) = found else {
                        return;
                    };
                    if replica == cluster.me().id || act.is_busy() {
                        return;
                    }
                    match &act.remote {
                        Some(m) if m.assistant == assistant => {}
                        _ => {
                            act.remote = Some(Mirror {
                                from: replica,
                                assistant,
                                synced: false,
                            })
                        }
                    }
                    cluster.publish(id, WireBody::Sync);
                }),
        );
    }

    /// Periodic: keeps the generating replica from cancelling a reply viewers here follow,
    /// re-asks for a snapshot that did not come, and ends a mirror whose replica died.
    fn tend_remote(&mut self, ctx: &mut Context<Self>) {
        let cluster = Arc::clone(&self.shared.cluster);
        let Some((from, synced)) = self.remote.as_ref().map(|m| (m.from, m.synced)) else {
            return;
        };
        if self.subscribers.is_empty() {
            self.remote = None;
            return;
        }
        let c = self.id;
        if !cluster.live().iter().any(|p| p.id == from) {
            // Its heartbeat is late. The stored row decides: the sweep marks the reply
            // interrupted once the lease has really run out; a final status means its `Done`
            // never arrived (the bus dropped it), so tell the viewers from the row.
            self.settle_remote_from_store(ctx);
            return;
        }
        if synced {
            cluster.publish(c, WireBody::Watch);
        } else {
            self.follow_remote_reply(ctx);
        }
    }

    /// Ends the mirrored reply from its stored row when that row is no longer `streaming`.
    fn settle_remote_from_store(&mut self, ctx: &mut Context<Self>) {
        let Some(assistant) = self.remote.as_ref().map(|m| m.assistant) else {
            return;
        };
        let store = self.shared.store.clone();
        async move { store.get_message(assistant).await }
            .into_actor(self)
            .map(move |found, act, _| {
                let Ok(Some(message)) = found else {
                    return;
                };
                let still_mirrored = act
                    .remote
                    .as_ref()
                    .is_some_and(|m| m.assistant == assistant);
                if !still_mirrored || message.status == MessageStatus::Streaming {
                    return;
                }
                act.remote = None;
                if message.status == MessageStatus::Interrupted {
                    act.fan_out(ReplyEvent::Error {
                        message: "the server generating this reply stopped; what it wrote is kept \
                                  (marked interrupted): reload, then send or regenerate"
                            .to_string(),
                    });
                } else {
                    let summary = mirror::summary_of_stored(&message);
                    act.fan_out(ReplyEvent::Done { message, summary });
                }
                act.replay.clear();
            })
            .wait(ctx);
    }

    /// A message about another replica's reply in this conversation ([`mirror::follow`]
    /// decides; this reads the rows it names and tells the viewers).
    fn on_remote_reply(&mut self, wire: Wire, ctx: &mut Context<Self>) {
        let busy = self.is_busy();
        match mirror::follow(&mut self.remote, busy, wire.from, wire.body) {
            Follow::Ignore => {}
            Follow::FanOut(event) => self.fan_out(*event),
            Follow::Start {
                user_message,
                assistant,
            } => {
                self.replay.clear();
                let store = self.shared.store.clone();
                async move { store.get_message(user_message).await }
                    .into_actor(self)
                    .map(move |found, act, _| match found {
                        Ok(Some(user_message)) if user_message.conversation_id == act.id => act
                            .fan_out(ReplyEvent::Started {
                                user_message,
                                assistant_message_id: assistant,
                            }),
                        Ok(Some(_)) => tracing::warn!(conversation = %act.id, "a relayed reply named a message of another conversation; ignored"),
                        Ok(None) => {}
                        Err(e) => tracing::warn!("cannot load a relayed user message: {e}"),
                    })
                    .wait(ctx);
            }
            Follow::Snapshot {
                user_message,
                assistant,
                content_len,
                reasoning_len,
                tool_calls,
            } => {
                let store = self.shared.store.clone();
                async move {
                    let user = store.get_message(user_message).await?;
                    let reply = store.get_message(assistant).await?;
                    Ok::<_, StoreError>((user, reply))
                }
                .into_actor(self)
                .map(move |found, act, _| {
                    let (user, reply) = match found {
                        Ok((Some(user), Some(reply))) => (user, reply),
                        Ok(_) => return,
                        Err(e) => {
                            tracing::warn!("cannot load a relayed reply: {e}");
                            return;
                        }
                    };
                    let Some(events) = mirror::snapshot_events(
                        act.id,
                        user,
                        &reply,
                        content_len,
                        reasoning_len,
                        tool_calls,
                    ) else {
                        tracing::warn!(conversation = %act.id, "a relayed snapshot named messages of another conversation; ignored");
                        return;
                    };
                    act.replay.clear();
                    if let Some(m) = act.remote.as_mut() {
                        m.synced = true;
                    }
                    for event in events {
                        act.fan_out(event);
                    }
                })
                .wait(ctx);
            }
            Follow::Finish { message, summary } => {
                let store = self.shared.store.clone();
                async move { store.get_message(message).await }
                    .into_actor(self)
                    .map(move |found, act, _| {
                        match found {
                            Ok(Some(message)) if message.conversation_id == act.id => {
                                act.fan_out(ReplyEvent::Done { message, summary })
                            }
                            Ok(Some(_)) => tracing::warn!(conversation = %act.id, "a relayed reply named a message of another conversation; ignored"),
                            Ok(None) => {}
                            Err(e) => tracing::warn!("cannot load a relayed reply: {e}"),
                        }
                        act.replay.clear();
                    })
                    .wait(ctx);
            }
        }
    }

    /// Asks for this conversation's spilled KV cache, if any, to be read ahead (a message or a
    /// draft is on its way).
    fn prefetch(&self) {
        if let Some(m) = self.current_model() {
            m.prefetch(self.id);
        }
    }

    /// The loaded model this conversation's turns run on, if it is loaded (nothing is loaded
    /// for a read-ahead or a draft).
    fn current_model(&self) -> Option<Arc<crate::models::ServedModel>> {
        let models = &self.shared.models;
        let id = self.model_id.clone().unwrap_or_else(|| models.default_id());
        models.peek(&id)
    }

    /// After a complete reply: the task model's chores (see [`crate::chores`]): the title of an
    /// untitled conversation's first exchange, then the questions to ask next; the viewers are
    /// told of each as it is written.
    fn run_chores(&self, reply: Uuid, ctx: &mut Context<Self>) {
        let models = &self.shared.models;
        if models.task_id().is_none() {
            return;
        }
        let (models, store, id) = (Arc::clone(models), self.shared.store.clone(), self.id);
        let title = {
            let (models, store) = (Arc::clone(&models), store.clone());
            async move {
                let ex = crate::chores::Exchange::load(&models, &store, id, reply).await?;
                let title = match &ex {
                    Some(ex) => crate::chores::write_title(&models, &store, ex).await,
                    None => Ok(None),
                };
                Ok::<_, crate::chores::ChoreError>((ex, title))
            }
        };
        title
            .into_actor(self)
            .map(move |loaded, act, _| match loaded {
                Ok((ex, title)) => {
                    match title {
                        Ok(Some(title)) => act.broadcast(ReplyEvent::Titled { title }),
                        Ok(None) => {}
                        Err(e) => tracing::warn!(conversation = %act.id, "no title written: {e}"),
                    }
                    ex
                }
                Err(e) => {
                    tracing::warn!(conversation = %act.id, "no chores run: {e}");
                    None
                }
            })
            .then(move |ex, act, _| {
                async move {
                    match ex {
                        Some(ex) => crate::chores::write_follow_ups(&models, &store, &ex).await,
                        None => Ok(Vec::new()),
                    }
                }
                .into_actor(act)
            })
            .map(move |result, act, _| match result {
                Ok(questions) if !questions.is_empty() => {
                    act.broadcast(ReplyEvent::FollowUps {
                        message_id: reply,
                        questions,
                    });
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(conversation = %act.id, "no follow-ups written: {e}"),
            })
            .spawn(ctx);
    }

    fn is_busy(&self) -> bool {
        self.sending || self.reply.is_some()
    }

    fn finish_reply(&mut self, summary: GenSummary, ctx: &mut Context<Self>) {
        let Some(reply) = self.reply.take() else {
            return;
        };
        self.tool_loop = None;
        let model = self.reply_model.take().map(|m| m.id().to_string());
        let id = reply.assistant_message_id;
        let (tail, mut finished) = reply.finish(&summary);
        finished.timings.model = model;
        for event in tail {
            self.broadcast(event);
        }
        // Keep the session marked busy until the reply is stored.
        self.sending = true;
        let store = self.shared.store.clone();
        async move { store.finish_assistant_message(id, &finished).await }
            .into_actor(self)
            .map(move |result, act, ctx| {
                act.sending = false;
                act.last_activity = Instant::now();
                match result {
                    Ok(message) => {
                        let complete = message.status == MessageStatus::Complete;
                        let reply = message.id;
                        act.broadcast(ReplyEvent::Done { message, summary });
                        if complete {
                            act.run_chores(reply, ctx);
                        }
                    }
                    Err(e) => {
                        tracing::error!(conversation = %act.id, "storing the reply failed: {e}");
                        act.broadcast(ReplyEvent::Error {
                            message: format!("the reply could not be stored: {e}"),
                        });
                    }
                }
                act.replay.clear();
            })
            .wait(ctx);
    }

    /// Saves the partial reply so a crash keeps what was generated (at most one write per tick).
    fn save_partial(&mut self, ctx: &mut Context<Self>) {
        let Some(reply) = self.reply.as_mut() else {
            return;
        };
        if !reply.unsaved() {
            return;
        }
        let save = reply.save_now(self.shared.store.clone());
        ctx.spawn(
            async move {
                if let Err(e) = save.await {
                    tracing::warn!("saving a partial reply failed: {e}");
                }
            }
            .into_actor(self),
        );
    }

    fn cancel_running(&mut self, ctx: &mut Context<Self>) -> bool {
        if self.between_rounds() {
            // No request with the scheduler: the loop ends here (see `tool_loop`).
            if let Some(reply) = self.reply.as_mut() {
                reply.stop_requested = true;
            }
            self.end_between_rounds(StopReason::Cancelled, ctx);
            return true;
        }
        match self.reply.as_mut() {
            Some(reply) => {
                match (reply.request_id, &self.reply_model) {
                    (Some(id), Some(model)) => model.cancel(id),
                    _ => reply.stop_requested = true,
                }
                true
            }
            None => false,
        }
    }
}

impl Actor for SessionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(PARTIAL_SAVE_INTERVAL, |act, ctx| act.save_partial(ctx));
        if self.shared.cluster.is_shared() {
            let heartbeat = self.shared.cluster.config().heartbeat;
            ctx.run_interval(heartbeat, |act, ctx| act.tend_remote(ctx));
        }
        let tick = (self.shared.cfg.idle_timeout / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(5));
        ctx.run_interval(tick, |act, ctx| {
            let idle = !act.is_busy() && act.subscribers.is_empty();
            if idle && act.last_activity.elapsed() >= act.shared.cfg.idle_timeout {
                tracing::debug!(conversation = %act.id, "session idle; stopping");
                ctx.stop();
            }
        });
    }

    fn stopped(&mut self, ctx: &mut Self::Context) {
        if let Some(registry) = self.registry.upgrade() {
            registry.forget(self.id, &ctx.address());
        }
    }
}

/// Send a user message; resolves once it is stored and the reply is queued.
#[derive(Message)]
#[rtype(result = "Result<Accepted, SessionError>")]
pub struct SendMessage {
    /// The user message; `None` sends the replaced message's text again (regenerate).
    pub content: Option<String>,
    /// Regenerate / edit-and-resend: the user message this one replaces, with everything after
    /// it. The old messages stay until the new request has been accepted and stored, in one
    /// transaction, so a refusal (busy, overloaded, context overflow, storage) changes nothing.
    pub replacing: Replacing,
    /// Pending files of the conversation the new user message takes (placed into its prompt
    /// text, see [`crate::files`]). An edit also keeps the edited message's files.
    pub files: Vec<Uuid>,
    /// The group the reply also counts against in the scheduler's token quota: a guest's client
    /// address (set by the conversation service; guest owners cost nothing to mint).
    pub group: Option<String>,
}

/// What a [`SendMessage`] replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replacing {
    /// Nothing: a new exchange continuing the branch shown.
    Nothing,
    /// A new version of this user message of the branch shown: with content, an edit (a new
    /// user message beside it, and its reply: a new branch); without, a new reply to it beside
    /// its others (regenerate). What it replaces is kept.
    Message(Uuid),
    /// The same for the last user message of the branch shown, found inside the session when
    /// the send runs, so a send that lands first cannot make it replace the wrong exchange.
    LastUserMessage,
}

impl SendMessage {
    pub fn new(content: String) -> Self {
        SendMessage {
            content: Some(content),
            replacing: Replacing::Nothing,
            files: Vec::new(),
            group: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Accepted {
    pub user_message: Message,
    pub assistant_message_id: Uuid,
}

impl Handler<SendMessage> for SessionActor {
    type Result = ResponseActFuture<Self, Result<Accepted, SessionError>>;

    fn handle(&mut self, msg: SendMessage, _: &mut Context<Self>) -> Self::Result {
        let SendMessage {
            content,
            replacing,
            files,
            group,
        } = msg;
        if content.is_none() && replacing == Replacing::Nothing {
            return Box::pin(fut::ready(Err(SessionError::EmptyMessage)));
        }
        let check = || {
            if let Some(content) = &content {
                check_message(content, self.shared.cfg.max_message_chars)?;
            }
            if self.is_busy() {
                return Err(SessionError::Busy);
            }
            Ok(())
        };
        if let Err(e) = check() {
            return Box::pin(fut::ready(Err(e)));
        }
        self.sending = true;
        // Its cache, if spilled, is read while the message is stored and the prompt built.
        self.prefetch();
        // What is typed next is a new draft.
        self.last_draft = None;
        self.last_activity = Instant::now();
        let shared = Arc::clone(&self.shared);
        let id = self.id;
        let work = async move {
            let (conversation, mut history) =
                prompt::conversation_and_branch(&shared.store, id).await?;
            let at = match replacing {
                Replacing::Nothing => None,
                Replacing::Message(from) => Some(
                    history
                        .iter()
                        .position(|m| m.id == from && m.role == Role::User)
                        .ok_or(SessionError::NothingToResend)?,
                ),
                Replacing::LastUserMessage => Some(
                    history
                        .iter()
                        .rposition(|m| m.role == Role::User)
                        .ok_or(SessionError::NothingToResend)?,
                ),
            };
            let replacing = at.map(|i| history[i].clone());
            // Regenerate: a new reply to the same message.
            let regenerate = content.is_none();
            let content = match (content, at) {
                (Some(c), _) => c,
                (None, Some(i)) => history[i].content.clone(),
                (None, None) => return Err(SessionError::EmptyMessage),
            };
            // The files the message carries: the pending ones it takes, and on an edit the
            // edited message's own. Their text goes into the prompt (and `raw`).
            let kept = match &replacing {
                Some(m) if !regenerate => shared.store.files_of_message(m.id).await?,
                _ => Vec::new(),
            };
            let taken = prompt::pending_files(&shared.store, id, &files).await?;
            let prompt_text = match &replacing {
                // A regenerated reply answers the message as it was sent, files and all.
                Some(m) if regenerate => m.raw.clone().unwrap_or_else(|| m.content.clone()),
                _ => prompt::with_files(kept.iter().chain(taken.iter()), &content),
            };
            // The conversation's collections: the passages found for the message go before it
            // (in `raw`, so every later prompt reads the same), numbered for citing.
            let mut sources = Vec::new();
            let prompt_text = if !regenerate && !conversation.settings.knowledge.is_empty() {
                let found = shared
                    .knowledge
                    .passages_for_turn(
                        &conversation.owner,
                        &conversation.settings.knowledge,
                        &content,
                    )
                    .await;
                match found {
                    Ok(passages) => {
                        sources = crate::knowledge::sources_of(&passages);
                        crate::knowledge::with_passages(&passages, &prompt_text)
                    }
                    Err(e) => {
                        // The message goes on without them; the reason is for the operator.
                        tracing::warn!(conversation = %id, "no passages for a turn: {e}");
                        prompt_text
                    }
                }
            } else {
                prompt_text
            };
            // (A regenerated reply stores no user message: these go unused then.)
            let attachments = Attachments {
                raw: (prompt_text != content).then(|| prompt_text.clone()),
                pending: files,
                keep_from: replacing
                    .as_ref()
                    .filter(|_| !kept.is_empty())
                    .map(|m| m.id),
            };
            if let Some(at) = at {
                // The prompt is the branch before the replaced message.
                history.truncate(at);
            }
            // The conversation's model, loaded first when it is not (the send waits).
            let model = shared
                .models
                .for_conversation(conversation.settings.model.as_deref())
                .await?;
            let tools = prompt::prompt_tools(&shared.store, &shared.tools, &conversation).await?;
            // Rendering and tokenizing a long history is CPU work: on a blocking thread, not on
            // the event loop that runs this session and the requests beside it.
            let (prepared, conversation, history, prompt_text, tools) = {
                let model = Arc::clone(&model);
                tokio::task::spawn_blocking(move || {
                    prompt::prepare(
                        &model,
                        &conversation,
                        &history,
                        &tools,
                        prompt::Turn::Message(&prompt_text),
                    )
                    .map(|p| (p, conversation, history, prompt_text, tools))
                })
                .await
                .map_err(|e| SessionError::PromptTask(e.to_string()))??
            };
            // A conversation that offers tools keeps what its next rounds are built from.
            let tool_loop = (!tools.specs.is_empty()).then(|| ToolLoop {
                conversation: conversation.clone(),
                history,
                user_text: prompt_text,
                tools,
                group: group.clone(),
                between_rounds: false,
                running: None,
            });
            let request = prepared.request(id, conversation.owner.clone(), group);
            // Ask the scheduler first: an overloaded server refuses before anything is stored.
            let completion = model.submit(request).await?;
            // Should the store refuse the exchange, dropping `completion` cancels the request.
            let (user, assistant) = match replacing {
                Some(user) if regenerate => {
                    let reply = shared.store.insert_reply(id, user.id).await?;
                    (user, reply)
                }
                replacing => {
                    let (user, reply) = shared
                        .store
                        .insert_exchange(id, &content, replacing.map(|m| m.id), &attachments)
                        .await?;
                    // The message's prompt holds them already: a lost record only costs the
                    // page its citations.
                    if let Err(e) = shared.store.save_message_sources(user.id, &sources).await {
                        tracing::warn!(conversation = %id, "cannot record a message's sources: {e}");
                    }
                    (user, reply)
                }
            };
            Ok((completion, user, assistant, prepared, model, tool_loop))
        };
        Box::pin(work.into_actor(self).map(move |result, act, ctx| {
            act.sending = false;
            let (completion, user, assistant, prepared, model, tool_loop) = result?;
            act.tool_loop = tool_loop;
            act.model_id = Some(model.id().to_string());
            act.reply_model = Some(model);
            let request_id = completion.id();
            act.replay.clear();
            act.remote = None;
            act.reply = Some(ReplyBuffer::new(
                request_id,
                user.id,
                assistant.id,
                prepared.starts_in_reasoning,
                prepared.prompt.len(),
            ));
            ctx.add_stream(completion);
            act.broadcast(ReplyEvent::Started {
                user_message: user.clone(),
                assistant_message_id: assistant.id,
            });
            Ok(Accepted {
                user_message: user,
                assistant_message_id: assistant.id,
            })
        }))
    }
}

/// Why a draft is not offered while a reply runs in its conversation.
const DRAFT_WHILE_REPLYING: &str = "a reply is being generated in this conversation";

/// Warm the message being typed (see `smolchat_serving::warm`): the prompt the draft would
/// make, as far as more typing cannot change it, is offered to the scheduler, which computes it
/// into this conversation's KV cache in spare steps. Resolves once offered; what it did.
#[derive(Message)]
#[rtype(result = "Result<DraftOutcome, SessionError>")]
pub struct WarmDraft {
    /// The draft as typed so far.
    pub content: String,
    /// The conversation's waiting files the message will carry (their text is in its prompt).
    pub files: Vec<Uuid>,
}

/// What a [`WarmDraft`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum DraftOutcome {
    /// Offered: its prompt's tokens (computed as spare steps allow).
    Offered { prompt_tokens: usize },
    /// Not offered, and why (a reply is running, warming is off, nothing new, it is too long).
    Skipped { reason: String },
}

impl DraftOutcome {
    fn skipped(reason: impl Into<String>) -> Self {
        DraftOutcome::Skipped {
            reason: reason.into(),
        }
    }
}

/// The part of `drafted` that more typing cannot change: the tokens it shares with the same
/// prompt one character longer (the last word's tokens, and the template's end of the message,
/// are left out).
fn settled_prefix(drafted: &[u32], longer: &[u32]) -> usize {
    drafted
        .iter()
        .zip(longer)
        .take_while(|(a, b)| a == b)
        .count()
}

impl Handler<WarmDraft> for SessionActor {
    type Result = ResponseActFuture<Self, Result<DraftOutcome, SessionError>>;

    fn handle(&mut self, msg: WarmDraft, _: &mut Context<Self>) -> Self::Result {
        if self.is_busy() || self.remote.is_some() {
            return Box::pin(fut::ready(Ok(DraftOutcome::skipped(DRAFT_WHILE_REPLYING))));
        }
        if msg.content.trim().is_empty() && msg.files.is_empty() {
            return Box::pin(fut::ready(Ok(DraftOutcome::skipped("nothing typed yet"))));
        }
        if let Err(e) =
            check_message(&msg.content, self.shared.cfg.max_message_chars).or_else(|e| match e {
                // Files alone are worth warming; the send checks the text again.
                SessionError::EmptyMessage => Ok(()),
                e => Err(e),
            })
        {
            return Box::pin(fut::ready(Err(e)));
        }
        self.last_activity = Instant::now();
        self.prefetch();
        let shared = Arc::clone(&self.shared);
        let id = self.id;
        let work = async move {
            let (conversation, history) =
                prompt::conversation_and_branch(&shared.store, id).await?;
            let files = prompt::pending_files(&shared.store, id, &msg.files).await?;
            let text = prompt::with_files(files.iter(), &msg.content);
            // The same tools as the send's prompt, so the warmed prefix is the one it reuses.
            let tools = prompt::prompt_tools(&shared.store, &shared.tools, &conversation).await?;
            let owner = conversation.owner.clone();
            // Warmed only on the conversation's model when it is loaded: a draft loads nothing.
            let model_id = shared
                .models
                .find(conversation.settings.model.as_deref().unwrap_or(""))
                .unwrap_or_else(|_| shared.models.default_id());
            let Some(model) = shared.models.peek(&model_id) else {
                return Ok(None);
            };
            let prefix = {
                let model = Arc::clone(&model);
                tokio::task::spawn_blocking(move || {
                    let longer_text = format!("{text}x");
                    let drafted = prompt::prepare(
                        &model,
                        &conversation,
                        &history,
                        &tools,
                        prompt::Turn::Message(&text),
                    )?;
                    let longer = prompt::prepare(
                        &model,
                        &conversation,
                        &history,
                        &tools,
                        prompt::Turn::Message(&longer_text),
                    )?;
                    let n = settled_prefix(&drafted.prompt, &longer.prompt);
                    let mut tokens = drafted.prompt;
                    tokens.truncate(n);
                    Ok::<_, SessionError>(tokens)
                })
                .await
                .map_err(|e| SessionError::PromptTask(e.to_string()))??
            };
            Ok::<_, SessionError>(Some((prefix, owner, model)))
        };
        Box::pin(work.into_actor(self).then(move |result, act, _| {
            // Decided here, with the actor: skipped, or offered (to the scheduler, below).
            let offer = match result {
                Err(e) => Err(e),
                Ok(None) => Ok(Err(DraftOutcome::skipped(
                    "the conversation's model is not loaded; it loads when the message is sent",
                ))),
                // A reply started meanwhile: its prompt is what counts now.
                Ok(_) if act.is_busy() => Ok(Err(DraftOutcome::skipped(DRAFT_WHILE_REPLYING))),
                Ok(Some((prompt, _, _))) if act.last_draft.as_ref() == Some(&prompt) => Ok(Err(
                    DraftOutcome::skipped("nothing new since the last draft"),
                )),
                Ok(Some((prompt, owner, model))) => {
                    act.last_draft = Some(prompt.clone());
                    act.model_id = Some(model.id().to_string());
                    let draft = smolchat_serving::warm::Draft {
                        conversation: act.id,
                        user: Some(owner),
                        prompt,
                    };
                    Ok(Ok((draft, model)))
                }
            };
            fut::wrap_future(async move {
                use smolchat_serving::warm::WarmRefused;
                let (draft, model) = match offer? {
                    Err(skipped) => return Ok(skipped),
                    Ok(offer) => offer,
                };
                let prompt_tokens = draft.prompt.len();
                match model.warm(draft).await {
                    Ok(Ok(())) => Ok(DraftOutcome::Offered { prompt_tokens }),
                    Ok(Err(e @ WarmRefused::UserLimit { .. })) => Err(SessionError::DraftLimit(e)),
                    Ok(Err(e)) => Ok(DraftOutcome::skipped(e.to_string())),
                    Err(_) => Ok(DraftOutcome::skipped("the scheduler is not available")),
                }
            })
        }))
    }
}

impl StreamHandler<GenEvent> for SessionActor {
    fn handle(&mut self, event: GenEvent, ctx: &mut Context<Self>) {
        self.last_activity = Instant::now();
        match event {
            GenEvent::Admitted {
                prompt_tokens,
                cached_tokens,
            } => {
                if let Some(r) = self.reply.as_mut() {
                    r.cached_tokens = cached_tokens;
                    if r.stop_requested {
                        self.cancel_running(ctx);
                    }
                }
                self.broadcast(ReplyEvent::Prefilling {
                    prompt_tokens,
                    cached_tokens,
                });
            }
            // A session never asks for embeddings.
            GenEvent::Embedding(_) => {}
            GenEvent::Token { text, .. } => {
                let Some(reply) = self.reply.as_mut() else {
                    return;
                };
                for event in reply.push(&text) {
                    self.broadcast(event);
                }
            }
            GenEvent::Finished(summary) if self.wants_tools(&summary) => {
                self.start_tool_round(summary, ctx)
            }
            GenEvent::Finished(summary) => self.finish_reply(summary, ctx),
        }
    }

    /// The event stream ends after `Finished`; the session lives on.
    fn finished(&mut self, _: &mut Context<Self>) {}
}

/// Stop the running reply. Resolves to whether one was running.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Stop;

impl Handler<Stop> for SessionActor {
    type Result = bool;

    fn handle(&mut self, _: Stop, ctx: &mut Context<Self>) -> bool {
        self.cancel_running(ctx)
    }
}

/// Join the conversation's live events.
#[derive(Message)]
#[rtype(result = "Subscription")]
pub struct Subscribe;

impl Handler<Subscribe> for SessionActor {
    type Result = MessageResult<Subscribe>;

    fn handle(&mut self, _: Subscribe, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
        let id = self.next_subscriber;
        self.next_subscriber += 1;
        self.subscribers.insert(id, tx);
        self.last_activity = Instant::now();
        self.follow_remote_reply(ctx);
        MessageResult(Subscription {
            replay: self.replay.clone(),
            events: rx,
            guard: SubscriptionGuard {
                session: ctx.address(),
                id,
            },
        })
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct Unsubscribe(u64);

impl Handler<Unsubscribe> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: Unsubscribe, ctx: &mut Context<Self>) {
        self.subscribers.remove(&msg.0);
        self.last_activity = Instant::now();
        if self.subscribers.is_empty() && self.reply.is_some() {
            let reply_id = self.reply.as_ref().map(|r| r.assistant_message_id);
            self.cancel_when_abandoned(reply_id, ctx);
        }
    }
}

/// An event of a reply another replica generates in this conversation (relayed by the
/// cluster).
#[derive(Message)]
#[rtype(result = "()")]
pub struct RemoteReply(pub Wire);

impl Handler<RemoteReply> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: RemoteReply, ctx: &mut Context<Self>) {
        self.on_remote_reply(msg.0, ctx);
    }
}

/// What another replica asks of this conversation's session.
#[derive(Message)]
#[rtype(result = "()")]
pub enum RemoteControl {
    /// Stop the running reply.
    Stop,
    /// The conversation was deleted: end the reply and the session.
    Deleted,
    /// Viewers on replica `.0` joined the running reply: send them a snapshot.
    Sync(Uuid),
    /// Viewers elsewhere still follow the running reply.
    Watch,
}

impl Handler<RemoteControl> for SessionActor {
    type Result = ();

    fn handle(&mut self, msg: RemoteControl, ctx: &mut Context<Self>) {
        match msg {
            RemoteControl::Stop => {
                self.cancel_running(ctx);
            }
            RemoteControl::Deleted => {
                self.cancel_running(ctx);
                ctx.stop();
            }
            RemoteControl::Sync(_) => {
                self.remote_watched_at = Some(Instant::now());
                self.send_snapshot(ctx);
            }
            RemoteControl::Watch => self.remote_watched_at = Some(Instant::now()),
        }
    }
}

/// What the admin page shows of a live session.
#[derive(Debug, Clone, Serialize)]
pub struct SessionInfo {
    pub subscribers: usize,
    pub replying: bool,
    pub idle_s: f64,
}

#[derive(Message)]
#[rtype(result = "SessionInfo")]
pub struct GetInfo;

impl Handler<GetInfo> for SessionActor {
    type Result = MessageResult<GetInfo>;

    fn handle(&mut self, _: GetInfo, _: &mut Context<Self>) -> Self::Result {
        MessageResult(SessionInfo {
            subscribers: self.subscribers.len(),
            replying: self.is_busy(),
            idle_s: self.last_activity.elapsed().as_secs_f64(),
        })
    }
}

/// Stop the session now (its conversation was deleted): the reply is cancelled.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown;

impl Handler<Shutdown> for SessionActor {
    type Result = ();

    fn handle(&mut self, _: Shutdown, ctx: &mut Context<Self>) {
        self.cancel_running(ctx);
        ctx.stop();
    }
}

/// The live sessions, by conversation id.
pub struct Sessions {
    shared: Arc<SessionShared>,
    live: Mutex<HashMap<Uuid, Addr<SessionActor>>>,
}

impl Sessions {
    pub fn new(shared: SessionShared) -> Arc<Self> {
        Arc::new(Self {
            shared: Arc::new(shared),
            live: Mutex::new(HashMap::new()),
        })
    }

    pub fn shared(&self) -> &Arc<SessionShared> {
        &self.shared
    }

    /// Takes in what other replicas send about conversations: the cluster delivers over a
    /// channel that a task here reads, handing each message to the conversation's session on
    /// this replica, if there is one. Must run inside an actix system.
    pub fn receive_from(self: &Arc<Self>, cluster: &Cluster) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Wire>();
        cluster.deliver_to(tx);
        let sessions = Arc::downgrade(self);
        actix::spawn(async move {
            while let Some(wire) = rx.recv().await {
                let Some(sessions) = sessions.upgrade() else {
                    return;
                };
                sessions.deliver(wire);
            }
        });
    }

    /// Hands an incoming message to the conversation's session here (a replica without a
    /// session for the conversation has nobody to tell).
    fn deliver(&self, wire: Wire) {
        let Some(session) = self.get(wire.c) else {
            return;
        };
        let control = match &wire.body {
            WireBody::Stop => Some(RemoteControl::Stop),
            WireBody::Deleted => Some(RemoteControl::Deleted),
            WireBody::Sync => Some(RemoteControl::Sync(wire.from)),
            WireBody::Watch => Some(RemoteControl::Watch),
            _ => None,
        };
        match control {
            Some(control) => session.do_send(control),
            None => session.do_send(RemoteReply(wire)),
        }
    }

    /// The session of a conversation, started if it is not running. The caller has checked
    /// that the conversation exists and belongs to the user.
    pub fn get_or_start(self: &Arc<Self>, id: Uuid) -> Addr<SessionActor> {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(addr) = live.get(&id).filter(|a| a.connected()) {
            return addr.clone();
        }
        let addr = SessionActor {
            id,
            shared: Arc::clone(&self.shared),
            registry: Arc::downgrade(self),
            subscribers: HashMap::new(),
            next_subscriber: 0,
            replay: Vec::new(),
            reply: None,
            sending: false,
            last_activity: Instant::now(),
            remote: None,
            remote_watched_at: None,
            last_draft: None,
            reply_model: None,
            model_id: None,
            tool_loop: None,
        }
        .start();
        live.insert(id, addr.clone());
        addr
    }

    /// The session of a conversation if it is running.
    pub fn get(&self, id: Uuid) -> Option<Addr<SessionActor>> {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.get(&id).filter(|a| a.connected()).cloned()
    }

    /// Every running session.
    pub fn all(&self) -> Vec<(Uuid, Addr<SessionActor>)> {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.iter()
            .filter(|(_, a)| a.connected())
            .map(|(k, a)| (*k, a.clone()))
            .collect()
    }

    fn forget(&self, id: Uuid, addr: &Addr<SessionActor>) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if live.get(&id).is_some_and(|a| a == addr) {
            live.remove(&id);
        }
    }
}
