//! The completions service: the one way any interface runs a prompt on the model. The session
//! actors (behind the pages and the JSON API) and `/v1` submit a [`CompletionRequest`] and read
//! the [`Completion`] it returns: a stream of the request's events that cancels the request when
//! dropped before it finished, and records `/v1` usage when it finishes.
//!
//! The rule every interface shares lives here once: a request without a token limit may fill
//! what the context window leaves (the batcher refuses prompts that are empty or fill it).

use std::pin::Pin;
use std::task::{Context, Poll};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use futures_util::Stream;
use tokio::sync::{mpsc, Notify};
use uuid::Uuid;

use crate::quotas::{QuotaSubjects, Quotas};
use smolchat_serving::scheduler::{Cancel, SchedulerActor, Submit, SubmitBackground};
use smolchat_serving::types::GenerationRequest;
use smolchat_store::Store;

/// A completion's vocabulary, as the scheduler defines it: its events, its summary, why it
/// stopped and why it was refused; and the scheduler's counters and per-conversation states
/// the operator sees.
pub use smolchat_serving::types::{
    DeviceMemory, Failure, GenEvent, GenSummary, GraphStats, ModelUnavailable, Pooling, RequestId,
    SchedulerStats, SequenceState, StopReason, SubmitError, WarmStats,
};
pub use smolchat_serving::warm::WarmRefused;
use smolchat_text::sampling::SamplingParams;

/// Which KV cache a request reuses and keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheUse {
    /// A conversation's own cache, kept for its next turn.
    Conversation(Uuid),
    /// A stateless request: it reuses (and leaves for reuse) only caches of this partition, an
    /// opaque tag of the client's identity.
    Partition(String),
}

/// One prompt to run.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// The most tokens to generate; `None`: as many as the context window leaves after the
    /// prompt (the scheduler clamps either to `limits.max_new_tokens`).
    pub max_tokens: Option<usize>,
    pub cache: CacheUse,
    /// Who the work is for (fair sharing and per-user limits); `None`: no per-user caps.
    pub user: Option<String>,
    /// The wider group with a token quota of its own (a guest's address).
    pub group: Option<String>,
    /// The account whose `/v1` usage the finished request adds to (`api_usage`); `None`: not
    /// recorded there (conversations store their counts with the reply).
    pub usage_owner: Option<String>,
    /// The personal API key the request came with (its own quotas, `limits.*_per_key`).
    pub key: Option<String>,
}

/// The completions service (see the module docs).
#[derive(Clone)]
pub struct Completions {
    scheduler: Addr<SchedulerActor>,
    store: Store,
    context_window: usize,
    /// The quotas counted across replicas (see [`crate::quotas`]).
    quotas: Quotas,
    /// The writes finished requests left running (their usage, their quota count).
    writes: PendingWrites,
}

/// Writes a finished request leaves running after its answer has gone (its usage row, its
/// quota count): shutdown waits for them ([`Completions::settle`]) instead of cutting them off
/// with the runtime, which lost the row and panicked in the database pool's drop.
#[derive(Clone, Default)]
struct PendingWrites(Arc<(AtomicUsize, Notify)>);

impl PendingWrites {
    /// Runs `write` off the response path, counted until it is done.
    fn spawn(&self, write: impl std::future::Future<Output = ()> + 'static) {
        self.0 .0.fetch_add(1, Ordering::AcqRel);
        let pending = self.clone();
        actix::spawn(async move {
            write.await;
            if pending.0 .0.fetch_sub(1, Ordering::AcqRel) == 1 {
                pending.0 .1.notify_waiters();
            }
        });
    }

    /// Waits until no write is left, at most `limit`; the writes still running then.
    async fn settled(&self, limit: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let done = self.0 .1.notified();
            let left = self.0 .0.load(Ordering::Acquire);
            if left == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                return self.0 .0.load(Ordering::Acquire);
            }
        }
    }
}

impl Completions {
    pub fn new(
        scheduler: Addr<SchedulerActor>,
        store: Store,
        context_window: usize,
        quotas: Quotas,
    ) -> Self {
        Self {
            scheduler,
            store,
            context_window,
            quotas,
            writes: PendingWrites::default(),
        }
    }

    /// The same service (store, quotas, pending writes) over another model's scheduler.
    pub(crate) fn for_scheduler(
        &self,
        scheduler: Addr<SchedulerActor>,
        context_window: usize,
    ) -> Self {
        Self {
            scheduler,
            context_window,
            ..self.clone()
        }
    }

    /// Waits, at most `limit`, for the writes of finished requests still running (usage rows,
    /// quota counts); at shutdown, after the replies have drained. The writes left then.
    pub async fn settle(&self, limit: Duration) -> usize {
        self.writes.settled(limit).await
    }

    /// The quotas, for account pages.
    pub fn quotas(&self) -> &Quotas {
        &self.quotas
    }

    /// Queues `request`. The batcher refuses an empty prompt or one that fills the context window
    /// (`SubmitError::Invalid`, `SubmitError::ContextOverflow`): an interface maps one error type.
    pub async fn submit(&self, request: CompletionRequest) -> Result<Completion, SubmitError> {
        self.submit_as(request, None, false).await
    }

    /// [`Completions::submit`] for a chore (a title written by the task model): admitted only
    /// when no other request waits, and never into the last free slot.
    pub async fn submit_background(
        &self,
        request: CompletionRequest,
    ) -> Result<Completion, SubmitError> {
        self.submit_as(request, None, true).await
    }

    /// [`Completions::submit`], or an embedding of the prompt when `embed` is set.
    async fn submit_as(
        &self,
        request: CompletionRequest,
        embed: Option<Pooling>,
        background: bool,
    ) -> Result<Completion, SubmitError> {
        let subjects = QuotaSubjects {
            user: request.user.clone(),
            group: request.group.clone(),
            key: request.key.clone(),
        };
        self.quotas
            .check(&subjects)
            .await
            .map_err(|e| SubmitError::Quota {
                retry_after_s: e.retry_after_s(),
                message: e.to_string(),
            })?;
        let mut params = request.params;
        // At least 1, so a prompt that fills the window is refused for that, not for its limit.
        params.max_new_tokens = request.max_tokens.unwrap_or_else(|| {
            self.context_window
                .saturating_sub(request.prompt.len())
                .max(1)
        });
        let (cache_key, cache_salt) = match request.cache {
            // Should the conversation's cache be busy, any temporary cache stays with it.
            CacheUse::Conversation(id) => (Some(id), Some(id.to_string())),
            CacheUse::Partition(salt) => (None, Some(salt)),
        };
        let (tx, events) = mpsc::unbounded_channel();
        let generation = GenerationRequest {
            cache_key,
            user: request.user,
            group: request.group,
            cache_salt,
            prompt: request.prompt,
            params,
            max_time: None,
            events: tx,
            embed,
            warm: false,
        };
        let sent = if background {
            self.scheduler.send(SubmitBackground(generation)).await
        } else {
            self.scheduler.send(Submit(generation)).await
        };
        let id = sent.map_err(|e| SubmitError::Unavailable(ModelUnavailable::Scheduler(e)))??;
        Ok(Completion {
            id,
            events,
            scheduler: self.scheduler.clone(),
            finished: false,
            usage: request.usage_owner.map(|owner| (self.store.clone(), owner)),
            quota: Some((self.quotas.clone(), subjects)),
            writes: self.writes.clone(),
            _holds: None,
        })
    }
}

/// Most inputs one embeddings request may carry.
pub const MAX_EMBEDDING_INPUTS: usize = 256;

/// Inputs of one embeddings request in the scheduler at once: enough to batch together, few
/// enough that a request of many inputs leaves room in its caller's queue
/// (`scheduler.max_queued_per_user`, 16 by default).
const EMBED_IN_FLIGHT: usize = 8;

/// Texts (as tokens) to embed.
#[derive(Debug, Clone)]
pub struct EmbeddingRequest {
    pub inputs: Vec<Vec<u32>>,
    pub pooling: Pooling,
    /// As in [`CompletionRequest`].
    pub user: Option<String>,
    pub cache_salt: String,
    pub usage_owner: Option<String>,
    /// At the scheduler's background priority: admitted only when no one else waits, never
    /// into the last free slot (indexing documents; a caller waiting for the answer: false).
    pub background: bool,
}

/// One vector per input, in order, and the tokens they took.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: usize,
}

/// Why an embeddings request failed, naming the input.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EmbedError {
    #[error("{count} inputs is more than the {MAX_EMBEDDING_INPUTS} one request may carry; split them across requests")]
    TooMany { count: usize },
    #[error("there is nothing to embed: give at least one input")]
    Empty,
    #[error("input {index}: {error}")]
    Refused { index: usize, error: SubmitError },
    #[error("input {index}: {failure}")]
    Failed { index: usize, failure: Failure },
}

impl Completions {
    /// Embeds every input (see [`GenerationRequest::embed`]): each a request of its own to the
    /// scheduler, [`EMBED_IN_FLIGHT`] at a time, so they batch with each other and with
    /// everyone's replies under the same fair sharing and limits.
    pub async fn embed(&self, request: EmbeddingRequest) -> Result<Embeddings, EmbedError> {
        use futures_util::{StreamExt, TryStreamExt};
        if request.inputs.is_empty() {
            return Err(EmbedError::Empty);
        }
        if request.inputs.len() > MAX_EMBEDDING_INPUTS {
            return Err(EmbedError::TooMany {
                count: request.inputs.len(),
            });
        }
        let prompt_tokens = request.inputs.iter().map(Vec::len).sum();
        let one = |(index, prompt): (usize, Vec<u32>)| {
            let req = CompletionRequest {
                prompt,
                params: SamplingParams::greedy(),
                max_tokens: Some(1),
                cache: CacheUse::Partition(request.cache_salt.clone()),
                user: request.user.clone(),
                group: None,
                usage_owner: request.usage_owner.clone(),
                key: None,
            };
            async move {
                let mut completion = self
                    .submit_as(req, Some(request.pooling), request.background)
                    .await
                    .map_err(|error| EmbedError::Refused { index, error })?;
                let mut vector = None;
                while let Some(event) = completion.next().await {
                    match event {
                        GenEvent::Embedding(v) => vector = Some(v),
                        GenEvent::Finished(summary) => {
                            return match (summary.reason, vector) {
                                (StopReason::EndOfGeneration, Some(v)) => Ok(v),
                                (StopReason::Error(failure), _) => {
                                    Err(EmbedError::Failed { index, failure })
                                }
                                (reason, _) => Err(EmbedError::Failed {
                                    index,
                                    failure: Failure::Engine(format!(
                                        "the embedding ended early ({reason:?})"
                                    )),
                                }),
                            };
                        }
                        GenEvent::Admitted { .. } | GenEvent::Token { .. } => {}
                    }
                }
                Err(EmbedError::Failed {
                    index,
                    failure: Failure::Engine(
                        "the model worker stopped before the embedding was finished".into(),
                    ),
                })
            }
        };
        let vectors = futures_util::stream::iter(request.inputs.clone().into_iter().enumerate())
            .map(one)
            .buffered(EMBED_IN_FLIGHT)
            .try_collect()
            .await?;
        Ok(Embeddings {
            vectors,
            prompt_tokens,
        })
    }
}

/// A submitted request: its events, in order, ending with [`GenEvent::Finished`]. Dropping it
/// before then cancels the request (the client went away, the session stopped).
pub struct Completion {
    id: RequestId,
    events: mpsc::UnboundedReceiver<GenEvent>,
    scheduler: Addr<SchedulerActor>,
    finished: bool,
    usage: Option<(Store, String)>,
    /// Where the request's tokens count when it ends.
    quota: Option<(Quotas, QuotaSubjects)>,
    writes: PendingWrites,
    /// What must outlive the request (its model: not unloaded while it runs).
    _holds: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Completion {
    /// The completion, keeping `hold` alive until it is dropped.
    pub(crate) fn holding(mut self, hold: Arc<dyn std::any::Any + Send + Sync>) -> Self {
        self._holds = Some(hold);
        self
    }

    /// The scheduler's id of the request (for logs and [`Cancel`]).
    pub fn id(&self) -> RequestId {
        self.id
    }

    fn on_finished(&mut self, summary: &GenSummary) {
        self.finished = true;
        if let Some((quotas, subjects)) = self.quota.take() {
            // The scheduler's measure: prompt tokens computed (not those from the cache) and
            // those generated.
            let tokens = summary
                .prompt_tokens
                .saturating_sub(summary.cached_tokens)
                .saturating_add(summary.completion_tokens) as u64;
            self.writes
                .spawn(async move { quotas.record(&subjects, tokens).await });
        }
        if let Some((store, owner)) = self.usage.take() {
            // Off the response path: the answer does not wait for the write, and a database
            // that cannot take it only loses the statistic.
            let prompt = i64::try_from(summary.prompt_tokens).unwrap_or(i64::MAX);
            let completion = i64::try_from(summary.completion_tokens).unwrap_or(i64::MAX);
            self.writes.spawn(async move {
                match store.add_api_usage(&owner, prompt, completion).await {
                    Ok(()) => {}
                    // The account was deleted while the request ran: nothing to record.
                    Err(e @ smolchat_store::StoreError::OwnerGone(_)) => tracing::debug!("{e}"),
                    Err(e) => tracing::warn!("cannot record API usage: {e}"),
                }
            });
        }
    }
}

impl Stream for Completion {
    type Item = GenEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<GenEvent>> {
        let this = self.get_mut();
        let polled = this.events.poll_recv(cx);
        match &polled {
            Poll::Ready(Some(GenEvent::Finished(summary))) => this.on_finished(summary),
            // The worker dropped the request without a summary (it stopped): nothing to cancel.
            Poll::Ready(None) => this.finished = true,
            _ => {}
        }
        polled
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.finished {
            tracing::debug!(request = self.id, "a completion was dropped; cancelling it");
            self.scheduler.do_send(Cancel(self.id));
        }
    }
}
