//! `GET /api/conversations/{id}/events`: the conversation's reply events as server-sent events.
//!
//! Each event is named after the reply event's `type` (started, prefilling, reasoning, answer,
//! tool_call, done, error) and carries its JSON. A subscriber that joins mid-reply first gets what
//! it missed of the current reply (the session's replay buffer), then live events. The stream stays
//! open across replies, with keep-alive comments in between.
//!
//! The session's [`SubscriptionGuard`] lives inside the response stream: when the client goes away
//! actix drops the stream, the guard unsubscribes, and a reply nobody watches any more is
//! cancelled after the configured grace period.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::web;
use actix_web_lab::sse;
use futures_util::Stream;
use tokio::sync::mpsc;

use super::api::parse_id;
use super::error::WebError;
use super::owner::Owner;
use super::{AppState, StreamCounter, StreamSlot};
use crate::actors::session::{ReplyEvent, Subscription, SubscriptionGuard};

/// Comment lines sent while nothing happens, so proxies keep the connection and dead clients are
/// noticed.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How soon a browser's EventSource reconnects after losing the stream.
const RETRY: Duration = Duration::from_secs(3);

pub async fn events(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<sse::Sse<EventStream>, WebError> {
    let id = parse_id(&path)?;
    // The place is taken first (and given back with the error if the service refuses), so
    // parallel requests cannot open more streams than the limits allow.
    let slot = StreamCounter::open(&state, id, owner.as_str())?;
    let Subscription {
        replay,
        events,
        guard,
    } = state
        .platform
        .conversations
        .subscribe(&owner.caller(), id)
        .await?;
    tracing::debug!(conversation = %id, replayed = replay.len(), "events subscriber joined");
    let stream = EventStream {
        replay: replay.into_iter(),
        events,
        _guard: guard,
        _slot: slot,
    };
    Ok(sse::Sse::from_stream(stream)
        .with_keep_alive(KEEP_ALIVE)
        .with_retry_duration(RETRY))
}

/// The replayed events, then the live ones. Owns the subscription guard (see the module docs).
pub struct EventStream {
    replay: std::vec::IntoIter<ReplyEvent>,
    events: mpsc::UnboundedReceiver<ReplyEvent>,
    _guard: SubscriptionGuard,
    /// This stream's place under `limits.max_streams*`, given back with the stream.
    _slot: StreamSlot,
}

impl Stream for EventStream {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(event) = self.replay.next() {
            return Poll::Ready(Some(Ok(to_sse(&event))));
        }
        // `None` once the session stopped (conversation deleted, server shutting down): the
        // response ends and the client may reconnect.
        self.events
            .poll_recv(cx)
            .map(|event| event.map(|e| Ok(to_sse(&e))))
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
