//! The scheduler actor: admission queue, continuous batching, fairness and cancellation, driving the
//! model worker thread one step at a time. The decisions live in [`Batcher`]; this actor feeds it
//! messages and carries its plans to the worker. While a step runs on the worker thread, the actor
//! stays free to admit, refuse and cancel requests.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::batcher::{Batcher, BatcherConfig, CancelOutcome};
use super::model::{CacheEntryInfo, ModelWorker, StepReport, WorkerCommand};
use super::types::{GenerationRequest, RequestId, SchedulerStats, SequenceState, SubmitError};
use smolchat_engine::{Engine, StepLimits};
use smolchat_text::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub batcher: BatcherConfig,
    /// Upper bound on new tokens per request (requests asking for more are clamped).
    pub max_new_tokens: usize,
    /// Default wall-clock limit per request.
    pub request_timeout: Option<Duration>,
    /// Speculative decoding (see [`crate::speculate`]).
    pub speculative: crate::speculate::SpecConfig,
    /// Whether a steady decode step's successor is launched before its tokens are delivered
    /// (`None`: on a GPU only; see [`crate::model::ModelWorker::with_async_steps`]).
    pub async_steps: Option<bool>,
    /// The KV spill tier (see [`crate::spill`]); `None`: off.
    pub spill: Option<crate::spill::SpillSettings>,
    /// Users' tokens over the last minute, shared with the other models' schedulers.
    pub tokens: super::batcher::TokenMeter,
    /// The model's id: the `model` label of its per-model metrics.
    pub model: String,
}

/// Clears its flag when dropped: held by the model thread for its whole life, so the flag says
/// false once the thread has ended for any reason, a panic included. `ended` tells whoever
/// waits for the thread's memory to be freed ([`Retire`]).
struct AliveGuard {
    alive: Arc<AtomicBool>,
    retired: Arc<AtomicBool>,
    ended: Option<oneshot::Sender<()>>,
}

impl AliveGuard {
    fn new(alive: Arc<AtomicBool>) -> Self {
        Self {
            alive,
            retired: Arc::new(AtomicBool::new(false)),
            ended: None,
        }
    }
}

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Release);
        // The worker's loop only returns when its scheduler is gone (unloaded, or the server
        // stopping); a panic is the one way it ends while still needed.
        if std::thread::panicking() {
            tracing::error!(
                "the model thread has ended; this server can no longer generate replies"
            );
        } else if self.retired.load(Ordering::Acquire) {
            tracing::info!("the model thread has ended: the model is unloaded");
        } else {
            tracing::info!(
                "the model thread has ended with its scheduler (the server is stopping)"
            );
        }
        if let Some(ended) = self.ended.take() {
            let _ = ended.send(());
        }
    }
}

pub struct SchedulerActor {
    /// Whether the model thread is running (see [`ModelAlive`]).
    model_alive: Arc<AtomicBool>,
    batcher: Batcher,
    cfg: SchedulerConfig,
    worker: std_mpsc::Sender<WorkerCommand>,
    step_in_flight: bool,
    stats: SchedulerStats,
    /// (time, generated tokens) of recent steps, for tokens/s.
    recent: VecDeque<(Instant, u64)>,
    /// Set by [`Retire`]: no more requests; the model thread is ending or has ended.
    retired: Arc<AtomicBool>,
    /// Resolves once the model thread has ended (its engine, weights and caches freed).
    ended: Option<oneshot::Receiver<()>>,
    /// This model's labelled counters, registered once (not looked up at every step).
    per_model: PerModel,
}

/// The counters labelled with the model's id.
struct PerModel {
    requests: metrics::Counter,
    generated: metrics::Counter,
}

impl PerModel {
    fn new(model: &str) -> Self {
        Self {
            requests: metrics::counter!("smolchat_model_requests_total", "model" => model.to_string()),
            generated: metrics::counter!("smolchat_model_generated_tokens_total", "model" => model.to_string()),
        }
    }
}

impl SchedulerActor {
    /// Starts the model worker thread and the scheduler actor (call inside an actix system).
    pub fn start(
        mut engine: Engine,
        tokenizer: Arc<Tokenizer>,
        mut cfg: SchedulerConfig,
    ) -> Addr<Self> {
        let (tx, rx) = std_mpsc::channel::<WorkerCommand>();
        // The one KV budget: the engine's allocator's blocks.
        cfg.batcher.kv_capacity_blocks = engine.kv_capacity_blocks();
        let kv_budget_bytes = engine.kv_capacity_blocks() * engine.kv_block_bytes();
        let window = cfg.batcher.context_window;
        // The largest step the batcher plans: its token budget (decode rows and prompt chunks
        // together), at least a row for every running request.
        let limits = StepLimits {
            rows: cfg.batcher.step_token_budget.max(cfg.batcher.max_running),
            sequences: cfg.batcher.max_running,
            context: window,
        };
        if let Err(e) = engine.prepare_for_serving(limits) {
            // Not fatal: the backend grows as steps come, as it did before.
            tracing::warn!("could not size the model's buffers for {limits:?} ahead of time: {e}");
        }
        let spec = cfg.speculative;
        let async_steps = cfg.async_steps;
        let spill = cfg.spill.as_ref().and_then(|s| {
            match crate::spill::SpillTier::open(&s.dir, s.budget_bytes, &s.model) {
                Ok((tier, found)) => {
                    let tier = tier.with_ram(s.ram_bytes);
                    tracing::info!(dir = %s.dir.display(), kept = found.kept, dropped = found.dropped, bytes = found.bytes, "KV spill tier opened");
                    Some((tier, s.idle))
                }
                Err(e) => {
                    tracing::warn!(dir = %s.dir.display(), "the KV spill tier is off: {e}");
                    None
                }
            }
        });
        SchedulerActor::create(move |ctx| {
            let addr = ctx.address();
            let mut worker = ModelWorker::new(engine, tokenizer, window).with_speculation(spec);
            if let Some(on) = async_steps {
                worker = worker.with_async_steps(on);
            }
            if let Some((tier, idle)) = spill {
                worker = worker.with_spill(tier, idle);
            }
            let model_alive = Arc::new(AtomicBool::new(true));
            let mut guard = AliveGuard::new(Arc::clone(&model_alive));
            let retired = Arc::clone(&guard.retired);
            let (ended_tx, ended) = oneshot::channel();
            guard.ended = Some(ended_tx);
            let spawned = std::thread::Builder::new()
                .name("smolchat-model".into())
                .spawn(move || {
                    let _alive = guard;
                    worker.run(rx, move |report| addr.do_send(StepDone(report)))
                });
            if let Err(e) = spawned {
                // The closure (and the guard in it) was dropped: the flag is already false.
                tracing::error!("cannot start the model thread: {e}");
            }
            SchedulerActor {
                model_alive,
                stats: SchedulerStats {
                    max_running: cfg.batcher.max_running,
                    queue_capacity: cfg.batcher.queue_capacity,
                    kv_budget_bytes,
                    ..SchedulerStats::default()
                },
                batcher: Batcher::with_meter(cfg.batcher.clone(), cfg.tokens.clone()),
                per_model: PerModel::new(&cfg.model),
                cfg,
                worker: tx,
                step_in_flight: false,
                recent: VecDeque::new(),
                retired,
                ended: Some(ended),
            }
        })
    }

    /// Queues a request (see [`Submit`]); a chore when `background` (see [`SubmitBackground`]).
    fn submit(
        &mut self,
        request: GenerationRequest,
        background: bool,
    ) -> Result<RequestId, SubmitError> {
        if self.retired.load(Ordering::Acquire) {
            return Err(SubmitError::Unavailable(
                crate::types::ModelUnavailable::Unloaded,
            ));
        }
        let mut request = request;
        request
            .params
            .validate()
            .map_err(|e| SubmitError::Invalid(e.to_string()))?;
        request.params.max_new_tokens = request.params.max_new_tokens.min(self.cfg.max_new_tokens);
        let timeout = request.max_time.or(self.cfg.request_timeout);
        let submitted = Instant::now();
        let id = self.batcher.submit_grouped(
            request.user.clone(),
            request.group.clone(),
            request.cache_key,
            request.prompt.len(),
            timeout.map(|t| submitted + t),
        )?;
        if self
            .worker
            .send(WorkerCommand::Register {
                id,
                request: Box::new(request),
                submitted,
            })
            .is_err()
        {
            self.batcher.cancel(id);
            return Err(SubmitError::Unavailable(
                crate::types::ModelUnavailable::ModelStopped,
            ));
        }
        if background {
            self.batcher.mark_background(id);
        }
        metrics::counter!("smolchat_requests_total").increment(1);
        self.per_model.requests.increment(1);
        self.maybe_step();
        Ok(id)
    }

    fn maybe_step(&mut self) {
        if self.step_in_flight {
            return;
        }
        if let Some(plan) = self.batcher.plan() {
            if self.worker.send(WorkerCommand::Step(plan)).is_ok() {
                self.step_in_flight = true;
            } else {
                tracing::error!("the model thread is gone");
            }
        }
        self.publish();
    }

    fn publish(&mut self) {
        self.stats.queued = self.batcher.queued();
        self.stats.running = self.batcher.running();
        let warm = crate::types::WarmStats {
            reused_tokens: self.stats.warm.reused_tokens,
            ..self.batcher.warm_stats()
        };
        // Recorded only when drafts did something (most steps carry none).
        if warm != self.stats.warm {
            self.stats.warm = warm;
            metrics::gauge!("smolchat_warm_drafts_waiting").set(warm.waiting as f64);
            metrics::counter!("smolchat_warm_tokens_total").absolute(warm.tokens);
            metrics::counter!("smolchat_warm_interrupted_total").absolute(warm.interrupted);
        }
        metrics::gauge!("smolchat_queue_depth").set(self.stats.queued as f64);
        metrics::gauge!("smolchat_running_sequences").set(self.stats.running as f64);
    }
}

impl Actor for SchedulerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Deadlines are checked a few times a second.
        ctx.run_interval(Duration::from_millis(200), |act, _| {
            if !act.batcher.expire(Instant::now()).is_empty() {
                act.maybe_step();
            }
        });
    }
}

/// Queue a request. Refused at once when the queue is full or the prompt cannot fit.
#[derive(Message)]
#[rtype(result = "Result<RequestId, SubmitError>")]
pub struct Submit(pub GenerationRequest);

impl Handler<Submit> for SchedulerActor {
    type Result = Result<RequestId, SubmitError>;

    fn handle(&mut self, msg: Submit, _: &mut Context<Self>) -> Self::Result {
        self.submit(msg.0, false)
    }
}

/// Queue a chore (a title for the task model): as [`Submit`], but admitted only when no other
/// request waits, and never into the last free slot.
#[derive(Message)]
#[rtype(result = "Result<RequestId, SubmitError>")]
pub struct SubmitBackground(pub GenerationRequest);

impl Handler<SubmitBackground> for SchedulerActor {
    type Result = Result<RequestId, SubmitError>;

    fn handle(&mut self, msg: SubmitBackground, _: &mut Context<Self>) -> Self::Result {
        self.submit(msg.0, true)
    }
}

/// Warm a typed draft's prompt into its conversation's cache in spare steps (see
/// [`crate::warm`]); the user's previous draft is dropped.
#[derive(Message)]
#[rtype(result = "Result<(), crate::warm::WarmRefused>")]
pub struct Warm(pub crate::warm::Draft);

impl Handler<Warm> for SchedulerActor {
    type Result = Result<(), crate::warm::WarmRefused>;

    fn handle(&mut self, msg: Warm, _: &mut Context<Self>) -> Self::Result {
        if self.retired.load(Ordering::Acquire) {
            return Ok(());
        }
        let tokens = msg.0.prompt.len();
        self.batcher.offer_draft(msg.0)?;
        metrics::counter!("smolchat_warm_drafts_total").increment(1);
        tracing::debug!(tokens, "a typed draft to warm");
        self.maybe_step();
        Ok(())
    }
}

/// A conversation may come back soon (its page opened, a message on its way): its spilled KV
/// cache, if any, is read ahead off the model thread.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Prefetch(pub Uuid);

impl Handler<Prefetch> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: Prefetch, _: &mut Context<Self>) {
        let _ = self.worker.send(WorkerCommand::Prefetch(msg.0));
    }
}

/// Stop a request; it ends at the next step. Returns whether it was known.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Cancel(pub RequestId);

impl Handler<Cancel> for SchedulerActor {
    type Result = bool;

    fn handle(&mut self, msg: Cancel, _: &mut Context<Self>) -> bool {
        let outcome = self.batcher.cancel(msg.0);
        self.maybe_step();
        outcome != CancelOutcome::NotFound
    }
}

/// A step report from the worker thread.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StepDone(pub StepReport);

impl Handler<StepDone> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: StepDone, _: &mut Context<Self>) {
        let mut r = msg.0;
        self.step_in_flight = false;
        self.batcher.apply(&r.items);
        // Now that the step's tokens count against their users' quotas, the requests it ended
        // may tell their clients.
        r.deliver_finished();
        self.batcher.set_kv_free_blocks(r.kv_free_blocks);
        let s = &mut self.stats;
        s.steps += 1;
        s.generated_tokens += r.generated_tokens;
        s.prefilled_tokens += r.prefilled_tokens;
        s.reused_tokens += r.reused_tokens;
        s.warm.reused_tokens += r.warm_reused_tokens;
        metrics::counter!("smolchat_warm_reused_tokens_total").increment(r.warm_reused_tokens);
        s.drafted_tokens += r.drafted_tokens;
        s.accepted_draft_tokens += r.accepted_tokens;
        s.verifying_steps += r.verifying_sequences;
        if let Some((fixed, per)) = r.step_cost_ms {
            s.step_fixed_ms = fixed;
            s.step_position_ms = per;
            metrics::gauge!("smolchat_step_fixed_seconds").set(fixed / 1e3);
            metrics::gauge!("smolchat_step_position_seconds").set(per / 1e3);
        }
        if let Some(even) = r.draft_break_even {
            s.draft_break_even = f64::from(even);
        }
        s.kv_bytes = r.kv_bytes;
        s.cached_sequences = r.cached_sequences;
        if let Some(spill) = r.spill {
            s.spill = Some(spill);
            metrics::gauge!("smolchat_kv_spill_bytes").set(spill.bytes as f64);
            metrics::gauge!("smolchat_kv_spill_files").set(spill.files as f64);
        }
        s.evictions = r.evictions;
        s.last_step_ms = r.step_ms;
        if r.device_memory.is_some() {
            s.device_memory = r.device_memory;
        }
        s.graphs = r.graphs;
        let now = Instant::now();
        self.recent.push_back((now, r.generated_tokens));
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(5))
        {
            self.recent.pop_front();
        }
        let window = self
            .recent
            .front()
            .map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64());
        let tokens: u64 = self.recent.iter().map(|(_, n)| n).sum();
        s.tokens_per_s = if window > 0.5 {
            tokens as f64 / window
        } else {
            0.0
        };
        metrics::counter!("smolchat_generated_tokens_total").increment(r.generated_tokens);
        self.per_model.generated.increment(r.generated_tokens);
        metrics::counter!("smolchat_prefilled_tokens_total").increment(r.prefilled_tokens);
        metrics::counter!("smolchat_kv_preemptions_total").increment(r.preemptions);
        metrics::gauge!("smolchat_kv_bytes").set(r.kv_bytes as f64);
        metrics::gauge!("smolchat_kv_budget_bytes").set(s.kv_budget_bytes as f64);
        metrics::gauge!("smolchat_kv_evictions").set(r.evictions as f64);
        metrics::gauge!("smolchat_tokens_per_second").set(s.tokens_per_s);
        metrics::histogram!("smolchat_step_seconds").record(r.step_ms / 1e3);
        // Where a step's time goes besides the forward pass: the worker's host work, and the
        // hop from its report to its next plan.
        metrics::histogram!("smolchat_step_engine_seconds").record(r.engine_ms / 1e3);
        metrics::histogram!("smolchat_step_host_seconds")
            .record((r.step_ms - r.engine_ms).max(0.0) / 1e3);
        if let Some(gap) = r.gap_ms {
            metrics::histogram!("smolchat_step_gap_seconds").record(gap / 1e3);
        }
        self.maybe_step();
    }
}

#[derive(Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetStats;

impl Handler<GetStats> for SchedulerActor {
    type Result = MessageResult<GetStats>;

    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        self.publish();
        MessageResult(self.stats.clone())
    }
}

/// Whether the model thread is still running. `/readyz` reports not ready once it is not.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct ModelAlive;

impl Handler<ModelAlive> for SchedulerActor {
    type Result = bool;

    fn handle(&mut self, _: ModelAlive, _: &mut Context<Self>) -> bool {
        self.model_alive.load(Ordering::Acquire)
    }
}

/// The live state of each given cache key (conversation).
#[derive(Message)]
#[rtype(result = "Vec<SequenceState>")]
pub struct StatesOf(pub Vec<Uuid>);

impl Handler<StatesOf> for SchedulerActor {
    type Result = MessageResult<StatesOf>;

    fn handle(&mut self, msg: StatesOf, _: &mut Context<Self>) -> Self::Result {
        MessageResult(msg.0.iter().map(|&k| self.batcher.state_of(k)).collect())
    }
}

/// Drop an idle conversation's KV cache from memory. Resolves to whether one was dropped.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Evict {
    pub conversation: Uuid,
    /// Keep it in the spill tier (an admin freeing memory: the conversation comes back without
    /// computing its prompt again); otherwise it is forgotten there too (a deleted
    /// conversation's cache is dropped, or dropped as soon as its running reply ends).
    pub keep_on_disk: bool,
}

impl Handler<Evict> for SchedulerActor {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, msg: Evict, _: &mut Context<Self>) -> Self::Result {
        let (done, rx) = oneshot::channel();
        let sent = self.worker.send(WorkerCommand::Evict {
            conversation: msg.conversation,
            keep_on_disk: msg.keep_on_disk,
            done,
        });
        Box::pin(async move { sent.is_ok() && rx.await.unwrap_or(false) })
    }
}

/// Writes every idle conversation cache to the spill tier (when there is one) before the server
/// stops; resolves when done.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SpillAll;

impl Handler<SpillAll> for SchedulerActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: SpillAll, _: &mut Context<Self>) -> Self::Result {
        let (done, rx) = oneshot::channel();
        let sent = self.worker.send(WorkerCommand::SpillAll(done));
        Box::pin(async move {
            if sent.is_ok() {
                let _ = rx.await;
            }
        })
    }
}

/// Unload the model: refused (false) while any request is queued or running, so a model is
/// never unloaded under a reply. Otherwise the scheduler takes no more requests
/// ([`ModelUnavailable::Unloaded`](crate::types::ModelUnavailable::Unloaded)), the worker
/// writes its idle conversation caches to the spill tier (when there is one) and ends, and this
/// resolves to true once its thread has ended and the engine's memory is freed.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Retire;

impl Handler<Retire> for SchedulerActor {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, _: Retire, ctx: &mut Context<Self>) -> Self::Result {
        if !self.batcher.is_idle() || self.retired.load(Ordering::Acquire) {
            return Box::pin(async { false });
        }
        self.retired.store(true, Ordering::Release);
        let (done, _) = oneshot::channel();
        let _ = self.worker.send(WorkerCommand::SpillAll(done));
        // Dropping the only sender ends the worker's loop once it has read what was sent.
        let (dead, _) = std_mpsc::channel();
        self.worker = dead;
        ctx.stop();
        let ended = self.ended.take();
        Box::pin(async move {
            if let Some(ended) = ended {
                let _ = ended.await;
            }
            true
        })
    }
}

/// Sizes of every conversation cache the worker holds.
#[derive(Message)]
#[rtype(result = "Vec<CacheEntryInfo>")]
pub struct GetCacheInfo;

impl Handler<GetCacheInfo> for SchedulerActor {
    type Result = ResponseFuture<Vec<CacheEntryInfo>>;

    fn handle(&mut self, _: GetCacheInfo, _: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let sent = self.worker.send(WorkerCommand::CacheInfo(tx));
        Box::pin(async move {
            if sent.is_err() {
                return Vec::new();
            }
            rx.await.unwrap_or_default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alive_flag_clears_when_the_thread_ends_even_by_panic() {
        for panics in [false, true] {
            let flag = Arc::new(AtomicBool::new(true));
            let guard = AliveGuard::new(Arc::clone(&flag));
            let thread = std::thread::spawn(move || {
                let _alive = guard;
                assert!(!panics, "the model thread panicked (on purpose)");
            });
            assert_eq!(thread.join().is_err(), panics);
            assert!(!flag.load(Ordering::Acquire), "panics: {panics}");
        }
    }
}
