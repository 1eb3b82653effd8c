//! Every API's streamed answer: an [`AnswerStream`] queues what its request's events become in
//! its API's shape, [`poll_events`] drains it (ending, and the worker going away, handled once),
//! and [`sse_response`] frames the server-sent events with actix-web-lab, keep-alive comments
//! included. (Ollama's answer is JSON lines, not events: its items are bytes.)

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::{HttpRequest, HttpResponse, Responder};
use actix_web_lab::sse;
use futures_util::Stream;
use smolchat_service::completions::{Completion, GenEvent};

/// A comment line goes out when a stream has sent nothing for this long, so proxies and clients
/// keep a stream open through a long prefill or a full queue.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// A streamed answer of any API: what it has queued, fed by its request's events. Every API's
/// stream is polled by [`poll_events`], so draining, ending and the worker going away are
/// handled once.
pub(crate) trait AnswerStream: Unpin {
    /// What it queues: server-sent events, or bytes for a JSON-lines answer.
    type Item;
    fn completion(&mut self) -> &mut Completion;
    fn queued(&mut self) -> &mut VecDeque<Self::Item>;
    /// Whether the answer has ended (nothing more is read once the queue is empty).
    fn ended(&self) -> bool;
    fn on_event(&mut self, event: GenEvent);
    /// The worker dropped the request without a summary (it stopped): queue the API's error
    /// and end.
    fn on_worker_gone(&mut self);
}

/// `Stream::poll_next` of an [`AnswerStream`].
pub(crate) fn poll_events<S: AnswerStream>(
    this: &mut S,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<S::Item, Infallible>>> {
    loop {
        if let Some(item) = this.queued().pop_front() {
            return Poll::Ready(Some(Ok(item)));
        }
        if this.ended() {
            return Poll::Ready(None);
        }
        match Pin::new(this.completion()).poll_next(cx) {
            Poll::Ready(Some(event)) => this.on_event(event),
            Poll::Ready(None) => this.on_worker_gone(),
            Poll::Pending => return Poll::Pending,
        }
    }
}

/// One event: `data` (JSON) under `name`, or unnamed.
pub(crate) fn event(name: Option<&str>, data: impl ToString) -> sse::Event {
    let data = sse::Data::new(data.to_string());
    match name {
        Some(name) => data.event(name.to_string()).into(),
        None => data.into(),
    }
}

/// The response carrying `stream`'s events: actix-web-lab's framing (`text/event-stream`, no
/// caching), a keep-alive comment whenever the stream is quiet for [`KEEP_ALIVE`], and never
/// buffered by a reverse proxy.
pub(crate) fn sse_response<S>(http: &HttpRequest, stream: S) -> HttpResponse
where
    S: Stream<Item = Result<sse::Event, Infallible>> + 'static,
{
    let mut response = sse::Sse::from_stream(stream)
        .with_keep_alive(KEEP_ALIVE)
        .respond_to(http);
    response.headers_mut().insert(
        HeaderName::from_static("x-accel-buffering"),
        HeaderValue::from_static("no"),
    );
    response
}
