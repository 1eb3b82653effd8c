//! `GET /api/conversations/{id}/events`: the conversation's reply events as server-sent events.
//!
//! Each event is named after the reply event's `type` (started, prefilling, reasoning, answer,
//! tool_call, done, error) and carries its JSON. A subscriber that joins mid-reply first gets what
//! it missed of the current reply (the session's replay buffer), then live events. The stream stays
//! open across replies, with keep-alive comments in between.
//!
//! With `?render=html` (the chat page asks for it) each `answer` event becomes `answer_html`:
//! the piece of text, plus the reply so far as sanitized HTML in two parts, the blocks that just
//! finished (to append) and the open block (to show in place of the last one); see
//! [`LiveMarkdown`]. Each subscriber renders its own copy, replayed events included, so a page
//! that joins mid-reply gets the same HTML.
//!
//! The session's [`SubscriptionGuard`] lives inside the response stream: when the client goes away
//! actix drops the stream, the guard unsubscribes, and a reply nobody watches any more is
//! cancelled after the configured grace period.
//!
//! A client that stops reading without going away is noticed two ways. The session drops a
//! subscriber that falls [`SUBSCRIBER_BUFFER`](smolchat_service::session::SUBSCRIBER_BUFFER)
//! events behind, which ends its stream. And actix stops polling a response body whose socket
//! does not drain, so a stream not polled for `limits.stream_stall_timeout_s` (longer than the
//! keep-alive interval, which polls a healthy stream at least that often) has stalled: a
//! watchdog then gives its subscription and its place under the stream limits back, so a
//! stuck client holds neither events in memory nor anyone's stream quota.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use actix_web::web;
use actix_web_lab::sse;
use futures_util::Stream;
use tokio::sync::mpsc;

use super::api::parse_id;
use super::client::Client;
use super::error::WebError;
use super::markdown::LiveMarkdown;
use super::owner::Owner;
use super::AppState;
use smolchat_service::reply::ReplyEvent;
use smolchat_service::session::{Subscription, SubscriptionGuard};

/// Comment lines sent while nothing happens, so proxies keep the connection and dead clients are
/// noticed.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How soon a browser's EventSource reconnects after losing the stream.
const RETRY: Duration = Duration::from_secs(3);

/// `?render=html`: answers as live HTML too (see the module docs). `?after=<message id>`: the
/// message the client posted (or its reply; both ids come in the post's 202): when that reply
/// has already ended, its `done` (or `error`) comes first, so post-then-subscribe cannot miss
/// the end of a fast reply.
#[derive(Debug, serde::Deserialize)]
pub struct EventsQuery {
    #[serde(default)]
    render: Option<String>,
    #[serde(default)]
    after: Option<String>,
}

pub async fn events(
    state: web::Data<AppState>,
    owner: Owner,
    client: Client,
    path: web::Path<String>,
    query: web::Query<EventsQuery>,
) -> Result<sse::Sse<ConversationStream>, WebError> {
    let id = parse_id(&path)?;
    let after = match query.after.as_deref() {
        None => None,
        Some(a) => Some(uuid::Uuid::parse_str(a.trim()).map_err(|_| {
            WebError::BadRequest(format!(
                "`after` must be a message id (a UUID: the `id` of the posted message or the \
                 `assistant_message_id` of the 202), got {a:?}"
            ))
        })?),
    };
    let live = match query.render.as_deref() {
        None => None,
        Some("html") => Some(LiveMarkdown::default()),
        Some(other) => {
            return Err(WebError::BadRequest(format!(
                "`render` may only be `html` (answers rendered as they stream), got {other:?}"
            )))
        }
    };
    // The place is taken first (and given back with the error if the service refuses), so
    // parallel requests cannot open more streams than the limits allow.
    let slot = StreamCounter::open(&state, id, owner.as_str(), client.address)?;
    let Subscription {
        replay,
        events,
        guard,
    } = state
        .platform
        .conversations()
        .subscribe(&owner.caller(), id, after)
        .await
        .map_err(|e| {
            // A browser's EventSource does not retry a refused stream: say why in the log.
            tracing::info!(conversation = %id, "an event stream was refused: {e}");
            WebError::from(e)
        })?;
    tracing::debug!(conversation = %id, replayed = replay.len(), "events subscriber joined");
    let held = Arc::new(Mutex::new(StreamResources {
        last_poll: Instant::now(),
        resources: Some((guard, slot)),
    }));
    let stall = Duration::from_secs(state.platform.config().limits.stream_stall_timeout_s);
    watch_for_stall(Arc::downgrade(&held), stall, id);
    let stream = ConversationStream {
        replay: replay.into_iter(),
        events,
        held,
        live,
    };
    // A healthy stream is polled at least every keep-alive interval, so it must be well inside
    // the stall timeout.
    let keep_alive = KEEP_ALIVE.min(stall / 3);
    Ok(sse::Sse::from_stream(stream)
        .with_keep_alive(keep_alive)
        .with_retry_duration(RETRY))
}

/// What a stream holds until it ends or stalls: the subscription guard and its place under
/// `limits.max_streams*`, and when actix last polled it.
struct StreamResources {
    last_poll: Instant,
    resources: Option<(SubscriptionGuard, StreamSlot)>,
}

/// Drops `held`'s resources once the stream goes `stall` without a poll; ends with the stream.
fn watch_for_stall(
    held: std::sync::Weak<Mutex<StreamResources>>,
    stall: Duration,
    conversation: uuid::Uuid,
) {
    actix_web::rt::spawn(async move {
        let tick = (stall / 4).max(Duration::from_millis(100));
        loop {
            actix_web::rt::time::sleep(tick).await;
            let Some(held) = held.upgrade() else {
                return;
            };
            let taken = {
                let mut h = held.lock().unwrap_or_else(|p| p.into_inner());
                if h.last_poll.elapsed() < stall {
                    continue;
                }
                h.resources.take()
            };
            if taken.is_some() {
                tracing::debug!(%conversation, "event stream stalled (the client stopped reading); subscription ended");
                metrics::counter!("smolchat_stalled_streams_total").increment(1);
            }
            // Dropped outside the lock: the guard messages the session.
            drop(taken);
            return;
        }
    });
}

/// The replayed events, then the live ones. Owns the subscription guard (see the module docs).
pub struct ConversationStream {
    replay: std::vec::IntoIter<ReplyEvent>,
    events: mpsc::Receiver<ReplyEvent>,
    held: Arc<Mutex<StreamResources>>,
    /// The reply rendered so far, when the subscriber asked for HTML.
    live: Option<LiveMarkdown>,
}

impl ConversationStream {
    fn encode(&mut self, event: &ReplyEvent) -> sse::Event {
        let Some(live) = self.live.as_mut() else {
            return to_sse(event);
        };
        match event {
            ReplyEvent::Started { .. } => *live = LiveMarkdown::default(),
            // A call ends the answer's open block; the call's block follows it (rendered here,
            // once for every page, with the Allow and Deny buttons while it waits).
            ReplyEvent::ToolStep { step } => {
                let body = serde_json::json!({
                    "type": "tool_step",
                    "step": step,
                    "flush": live.flush(),
                    "html": crate::tool_steps::block(step, true),
                });
                return sse::Data::new(body.to_string()).event("tool_step").into();
            }
            ReplyEvent::Answer { text } => {
                let update = live.push(text);
                let body = serde_json::json!({
                    "type": "answer_html",
                    "text": text,
                    "blocks": update.blocks,
                    "tail": update.tail,
                });
                return sse::Data::new(body.to_string()).event("answer_html").into();
            }
            _ => {}
        }
        to_sse(event)
    }
}

impl Stream for ConversationStream {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            if held.resources.is_none() {
                // The watchdog ended it: the client will reconnect and resync.
                return Poll::Ready(None);
            }
            held.last_poll = Instant::now();
        }
        if let Some(event) = self.replay.next() {
            return Poll::Ready(Some(Ok(self.encode(&event))));
        }
        // `None` once the session stopped (conversation deleted, server shutting down): the
        // response ends and the client may reconnect.
        match self.events.poll_recv(cx) {
            Poll::Ready(Some(event)) => Poll::Ready(Some(Ok(self.encode(&event)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// One reply event as an SSE message named after its `type`.
fn to_sse(event: &ReplyEvent) -> sse::Event {
    match serde_json::to_value(event) {
        Ok(value) => {
            let name = value
                .get("type")
                .and_then(|t| t.as_str())
                .unwrap_or("message")
                .to_string();
            sse::Data::new(value.to_string()).event(name).into()
        }
        Err(e) => {
            tracing::error!("cannot encode a reply event: {e}");
            let body = serde_json::json!({
                "type": "error",
                "message": format!("an event could not be encoded: {e}"),
            });
            sse::Data::new(body.to_string()).event("error").into()
        }
    }
}

/// Counts open event streams per conversation, per owner and in all, against
/// `limits.max_streams*`.
#[derive(Default)]
pub struct StreamCounter {
    open: std::sync::Mutex<OpenStreams>,
}

#[derive(Default)]
struct OpenStreams {
    total: usize,
    per_conversation: std::collections::HashMap<uuid::Uuid, usize>,
    per_owner: std::collections::HashMap<String, usize>,
    /// By client address (IPv6 per /64): guests mint owners for free, so the per-owner cap
    /// alone would not bound one address.
    per_address: std::collections::HashMap<smolchat_auth::ThrottleKey, usize>,
}

/// One open event stream; gives its place back when dropped (the client went away).
pub struct StreamSlot {
    state: web::Data<AppState>,
    conversation: uuid::Uuid,
    owner: String,
    address: smolchat_auth::ThrottleKey,
}

/// Takes one from `map[key]`, forgetting keys that reach 0.
fn release<K: std::hash::Hash + Eq>(map: &mut std::collections::HashMap<K, usize>, key: &K) {
    if let Some(n) = map.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            map.remove(key);
        }
    }
}

impl StreamCounter {
    /// Open event streams in all.
    pub fn total(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// Takes a place for `owner`'s stream on `conversation` from `address`, or says which limit
    /// is reached.
    pub fn open(
        state: &web::Data<AppState>,
        conversation: uuid::Uuid,
        owner: &str,
        address: std::net::IpAddr,
    ) -> Result<StreamSlot, WebError> {
        let address = smolchat_auth::ThrottleKey::address(address);
        let limits = &state.platform.config().limits;
        let mut open = state
            .streams
            .open
            .lock()
            .map_err(|_| WebError::Internal("the stream counter is poisoned".into()))?;
        let here = open
            .per_conversation
            .get(&conversation)
            .copied()
            .unwrap_or(0);
        if here >= limits.max_streams_per_conversation {
            return Err(WebError::TooManyRequests {
                message: format!(
                    "this conversation already has {here} open event streams (the limit is {}); \
                     close a tab or retry later",
                    limits.max_streams_per_conversation
                ),
                retry_after_s: 5,
            });
        }
        let mine = open.per_owner.get(owner).copied().unwrap_or(0);
        if mine >= limits.max_streams_per_user {
            return Err(WebError::TooManyRequests {
                message: format!(
                    "you already have {mine} open event streams (the limit per user is {}); \
                     close some tabs or retry later",
                    limits.max_streams_per_user
                ),
                retry_after_s: 5,
            });
        }
        let from_here = open.per_address.get(&address).copied().unwrap_or(0);
        if from_here >= limits.max_streams_per_address {
            return Err(WebError::TooManyRequests {
                message: format!(
                    "your address already has {from_here} open event streams (the limit per \
                     address is {}); close some tabs or retry later",
                    limits.max_streams_per_address
                ),
                retry_after_s: 5,
            });
        }
        if open.total >= limits.max_streams {
            return Err(WebError::Overloaded {
                message: format!(
                    "the server has {} open event streams, its limit; retry later",
                    open.total
                ),
                retry_after_s: 5,
            });
        }
        open.total += 1;
        *open.per_conversation.entry(conversation).or_insert(0) += 1;
        *open.per_owner.entry(owner.to_string()).or_insert(0) += 1;
        *open.per_address.entry(address.clone()).or_insert(0) += 1;
        Ok(StreamSlot {
            state: state.clone(),
            conversation,
            owner: owner.to_string(),
            address,
        })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        if let Ok(mut open) = self.state.streams.open.lock() {
            open.total = open.total.saturating_sub(1);
            release(&mut open.per_conversation, &self.conversation);
            release(&mut open.per_owner, &self.owner);
            release(&mut open.per_address, &self.address);
        }
    }
}
