//! Every API's streamed answer is one [`EventStream`]: it reads its request's events, hands the
//! reply's text and its end to the dialect's [`Render`], and sends what that queues. Ending,
//! a failed generation, the worker going away, the log line and holding the last item back
//! while the reply is stored are handled here once; a dialect only says what its events look
//! like. [`sse_response`] frames server-sent events with actix-web-lab, keep-alive comments
//! included. (Ollama's answer is JSON lines, not events: its items are bytes.)

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::{HttpRequest, HttpResponse, Responder};
use actix_web_lab::sse;
use futures_util::Stream;
use smolchat_service::completions::{Completion, GenEvent, GenSummary, StopReason};
use smolchat_text::sampling::TokenLogprobs;

use crate::error::ApiError;

/// A comment line goes out when a stream has sent nothing for this long, so proxies and clients
/// keep a stream open through a long prefill or a full queue.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Work an answer waits for before its last item goes out (storing the reply, so a client that
/// has the last event can already read it back).
pub(crate) type Finishing = Pin<Box<dyn Future<Output = ()>>>;

/// What one API dialect makes of its request's events: the items it queues.
pub(crate) trait Render: Unpin {
    /// Server-sent events, or bytes for a JSON-lines answer.
    type Item: Unpin;
    /// A piece of the reply (never empty).
    fn text(&mut self, text: &str, out: &mut VecDeque<Self::Item>);
    /// The log-probabilities of a token, before its text (kept until the text goes out).
    fn logprobs(&mut self, _logprobs: TokenLogprobs) {}
    /// The reply ended without a fault: the rest of it, then the API's ending.
    fn finished(&mut self, summary: &GenSummary, out: &mut VecDeque<Self::Item>);
    /// The reply failed, or the worker went away without a summary: the API's error.
    fn failed(&mut self, error: &ApiError, out: &mut VecDeque<Self::Item>);
    /// Work to finish before the last queued item goes out, asked once after `finished`.
    fn finishing(&mut self) -> Option<Finishing> {
        None
    }
}

/// A streamed answer of any API. Dropping it (the client went away) cancels the request through
/// its [`Completion`].
pub(crate) struct EventStream<R: Render> {
    completion: Completion,
    render: R,
    out: VecDeque<R::Item>,
    ended: bool,
    started: Instant,
    /// While set, the last item is held back until it is done.
    finishing: Option<Finishing>,
    last: Option<R::Item>,
}

impl<R: Render> EventStream<R> {
    /// A stream of `completion`'s answer, after the items `first` (a dialect's opening events).
    pub(crate) fn new(completion: Completion, render: R, first: Vec<R::Item>) -> Self {
        Self {
            completion,
            render,
            out: first.into(),
            ended: false,
            started: Instant::now(),
            finishing: None,
            last: None,
        }
    }

    pub(crate) fn render(&self) -> &R {
        &self.render
    }

    fn on_event(&mut self, event: GenEvent) {
        match event {
            GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
            GenEvent::Token { text, logprobs, .. } => {
                if let Some(lp) = logprobs {
                    self.render.logprobs(lp);
                }
                if !text.is_empty() {
                    self.render.text(&text, &mut self.out);
                }
            }
            GenEvent::Finished(summary) => {
                if let StopReason::Error(e) = &summary.reason {
                    self.render
                        .failed(&super::generation_failed(e), &mut self.out);
                } else {
                    self.render.finished(&summary, &mut self.out);
                    if let Some(work) = self.render.finishing() {
                        self.last = self.out.pop_back();
                        self.finishing = Some(work);
                    }
                }
                super::log_finished(self.completion.id(), &summary);
                tracing::debug!(
                    request = self.completion.id(),
                    stream_s = self.started.elapsed().as_secs_f64(),
                    "API stream finished"
                );
                self.ended = true;
            }
        }
    }
}

impl<R: Render> Stream for EventStream<R> {
    type Item = Result<R::Item, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(item) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(item)));
            }
            if let Some(work) = this.finishing.as_mut() {
                match work.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) => {
                        this.finishing = None;
                        this.out.extend(this.last.take());
                        continue;
                    }
                }
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.completion).poll_next(cx) {
                Poll::Ready(Some(event)) => this.on_event(event),
                Poll::Ready(None) => {
                    let gone = ApiError::unavailable(super::WORKER_GONE);
                    this.render.failed(&gone, &mut this.out);
                    this.ended = true;
                }
                Poll::Pending => return Poll::Pending,
            }
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
