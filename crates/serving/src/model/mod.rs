//! The model actor: owns the engine and every KV cache on its own OS thread, so the heavy compute
//! never blocks the actix event loop. It executes the scheduler's step plans, samples tokens and
//! sends them straight to each request's listener, and keeps each conversation's cache between
//! turns (the next turn prefills only what is new), evicting least-recently-used idle caches to
//! stay within the KV budget.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use crate::batcher::{ItemReport, StepPlan};
use crate::speculate::{DraftControl, PromptLookup, Proposer, SpecConfig, StepCost, UserNgrams};
use uuid::Uuid;

use crate::types::{
    CacheKey, Failure, GenEvent, GenSummary, GenerationRequest, Pooling, RequestId, StopReason,
};
use smolchat_engine::device::DeviceMemory;
use smolchat_engine::fast::graph::GraphStats;
use smolchat_engine::kv::BLOCK_POSITIONS;
use smolchat_engine::{
    DeviceSampling, Engine, Logits, LogitsMode, SampleRow, SeqId, SeqStep, NO_TOKEN,
};
use smolchat_text::generation::Generation;
use smolchat_text::sampling::DeviceDraw;
use smolchat_text::tokenizer::Tokenizer;

mod caches;
mod pool;
mod step;
#[cfg(test)]
mod tests;

use caches::{CacheSlot, PrefixDonor};
use pool::PoolState;
pub use step::device_sampling;

/// Commands to the model thread.
pub enum WorkerCommand {
    /// A new request (kept until the scheduler plans it).
    Register {
        id: RequestId,
        /// Boxed: a request is far larger than the other commands.
        request: Box<GenerationRequest>,
        submitted: Instant,
    },
    /// Run one step and report back.
    Step(StepPlan),
    /// Drop an idle conversation's cache (admin "evict", or its conversation was deleted).
    Evict {
        conversation: Uuid,
        /// Write it to the spill tier first (an admin freeing memory), rather than forget it
        /// there too (its conversation was deleted).
        keep_on_disk: bool,
        done: oneshot::Sender<bool>,
    },
    /// Per-conversation cache sizes.
    CacheInfo(oneshot::Sender<Vec<CacheEntryInfo>>),
    /// Write every idle conversation cache not yet in the spill tier (the server is stopping:
    /// the next start finds them).
    SpillAll(oneshot::Sender<()>),
    /// A conversation may come back soon (its page was opened, a message is on its way): when
    /// its cache is not on the device but in the spill tier, start reading it there, off this
    /// thread (see [`crate::spill::SpillTier::preload`]).
    Prefetch(Uuid),
}

#[derive(Debug, Clone)]
pub struct CacheEntryInfo {
    pub key: CacheKey,
    pub tokens: usize,
    pub bytes: usize,
    /// Speculative decoding in this conversation since its cache was made: draft tokens
    /// verified, accepted, and the steps that verified drafts.
    pub drafted: u64,
    pub accepted: u64,
    pub verify_steps: u64,
}

/// One request run alone to its end ([`ModelWorker::generate_alone`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AloneRun {
    /// The tokens generated.
    pub tokens: Vec<u32>,
    /// From the first generated token to the last.
    pub seconds: f64,
    /// Engine steps, the prompt's included.
    pub steps: usize,
    /// Per decode step (the prompt's step left out): draft tokens verified and accepted, so
    /// the run's steps can be replayed on another model's cost (`bench --speculative
    /// --replay-shape`).
    pub verified: Vec<(usize, usize)>,
}

impl AloneRun {
    /// Draft tokens verified over the run.
    pub fn drafted(&self) -> usize {
        self.verified.iter().map(|v| v.0).sum()
    }

    /// Draft tokens accepted over the run.
    pub fn accepted(&self) -> usize {
        self.verified.iter().map(|v| v.1).sum()
    }

    /// Tokens after the first (which the prompt's step drew) per second.
    pub fn decode_tokens_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.tokens.len().saturating_sub(1) as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// What the worker tells the scheduler after each step.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    pub items: Vec<ItemReport>,
    /// The step on the model thread, and the part of it spent in the engine's forward pass
    /// (the rest is the worker's own host work: planning, drafting, delivering tokens).
    pub step_ms: f64,
    pub engine_ms: f64,
    /// How long the model thread waited for this step's plan after reporting the previous
    /// one, when that one left requests running (the hop through the scheduler actor and
    /// back); `None` after a step that left nothing running.
    pub gap_ms: Option<f64>,
    pub generated_tokens: u64,
    pub prefilled_tokens: u64,
    pub reused_tokens: u64,
    /// Of `reused_tokens`, those typed drafts had computed (see [`crate::warm`]).
    pub warm_reused_tokens: u64,
    pub kv_bytes: usize,
    pub cached_sequences: usize,
    pub evictions: u64,
    /// KV blocks new work could have after this step: free ones, plus those of idle caches the
    /// worker would evict (the batcher admits only what fits them).
    pub kv_free_blocks: usize,
    /// Requests preempted in this step (their blocks went to older sequences).
    pub preemptions: u64,
    /// What the GPU's memory holds (asked of the driver at most once a second).
    pub device_memory: Option<DeviceMemory>,
    /// How decode graphs have been used, on a backend that replays them.
    pub graphs: Option<GraphStats>,
    /// Speculative decoding in this step: draft tokens verified, accepted, and the sequences
    /// that verified drafts.
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    pub verifying_sequences: u64,
    /// The measured cost of a decode-only step, `(fixed, per_position)` in milliseconds (see
    /// [`StepCost`]); `None` before the first such step.
    pub step_cost_ms: Option<(f64, f64)>,
    /// The acceptance one conversation's draft position must reach to pay, as measured now
    /// ([`StepCost::break_even`]).
    pub draft_break_even: Option<f32>,
    /// The KV spill tier (files, bytes, writes and restores since start); `None`: off.
    pub spill: Option<crate::types::SpillStats>,
    /// The `Finished` events of requests that ended in this step, held back until the
    /// scheduler has applied the report ([`StepReport::deliver_finished`]): a client that sends
    /// its next request as soon as one ends then meets the token quota with this step counted.
    pub finished: Vec<(mpsc::UnboundedSender<GenEvent>, GenSummary)>,
}

impl StepReport {
    /// Sends the held `Finished` events (after the report's tokens are counted).
    pub fn deliver_finished(&mut self) {
        for (events, summary) in self.finished.drain(..) {
            let _ = events.send(GenEvent::Finished(summary));
        }
    }
}

struct Active {
    request: GenerationRequest,
    generation: Option<Generation>,
    seq: Option<SeqId>,
    /// Whether `seq` is a conversation cache (kept afterwards) or a temporary one.
    keyed: bool,
    /// Prompt tokens not yet in the cache.
    pending_prompt: Vec<u32>,
    /// The token sampled last, to feed at the next decode.
    last_token: Option<u32>,
    cached_tokens: usize,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    completion_tokens: usize,
    /// Set while a preempted request waits to be admitted again: every token it had in its
    /// cache (prompt, generated, and the last sampled one), to recompute. Its sampler,
    /// detokenizer and stop state are kept, so it continues exactly where it was.
    resume: Option<Vec<u32>>,
    /// An embedding request's pooling so far.
    pool: Option<PoolState>,
    /// Its speculative drafting (see [`crate::speculate`]).
    draft: DraftControl,
    /// Of `cached_tokens`, those read back from the spill tier and those a typed draft
    /// computed (see [`GenSummary`]).
    restored_tokens: usize,
    warmed_tokens: usize,
}

impl Active {
    /// A registered request that has not been admitted yet.
    fn new(request: GenerationRequest, submitted: Instant) -> Self {
        let pool = request.embed.map(PoolState::new);
        Self {
            request,
            generation: None,
            seq: None,
            keyed: false,
            pending_prompt: Vec::new(),
            last_token: None,
            cached_tokens: 0,
            submitted,
            admitted: None,
            first_token: None,
            completion_tokens: 0,
            resume: None,
            pool,
            draft: DraftControl::default(),
            restored_tokens: 0,
            warmed_tokens: 0,
        }
    }
}

/// Users whose replies' n-grams are kept for drafting (the least recently used go first), and
/// n-grams per generation of each: 14,000 keys stay within a table of 16,384 buckets of 41
/// bytes (hashbrown's 7/8 load), about 0.66 MiB, so two generations are 1.3 MiB a user and
/// 42 MiB for all users at the very most (replies of about 7,000 tokens fill a generation).
const NGRAM_USERS: usize = 32;
const NGRAM_CAPACITY: usize = 14_000;

pub struct ModelWorker {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    active: HashMap<RequestId, Active>,
    caches: HashMap<CacheKey, CacheSlot>,
    evictions: u64,
    /// The usable context window (the model's, or less when configured).
    context_window: usize,
    /// Caches to drop as soon as their running request ends (their conversation was deleted).
    doomed: Vec<Uuid>,
    /// The step's logits, one buffer kept from step to step.
    logits: Logits,
    /// Draw every token on the host even where the backend could draw it on its device.
    host_sampling: bool,
    /// The device's memory as last asked, and when.
    device_memory: Option<(Instant, Option<DeviceMemory>)>,
    /// Whether grammar masks are computed while the forward pass runs (`None`: on a GPU only).
    mask_overlap: Option<bool>,
    /// `Finished` events of this step, sent with its report (see [`StepReport::finished`]).
    finished: Vec<(mpsc::UnboundedSender<GenEvent>, GenSummary)>,
    /// Speculative decoding (off unless configured).
    spec: SpecConfig,
    /// What a decode-only step costs on this machine, measured (drafts go where they pay).
    step_cost: StepCost,
    /// What followed short n-grams in each user's finished replies (a draft source).
    ngrams: UserNgrams,
    /// Draft tokens verified and accepted since start (tests and benchmarks).
    spec_drafted: u64,
    spec_accepted: u64,
    /// Whether a steady decode step's successor is launched before its tokens are delivered
    /// (`None`: on a GPU only; see [`step::Ahead`]).
    async_steps: Option<bool>,
    /// The decode step launched ahead and not finished yet, and the buffer it fills.
    ahead: Option<step::Ahead>,
    ahead_logits: Logits,
    /// Steps launched ahead, and their rows voided by a stop seen a step late, since start
    /// (tests; `/metrics` counts them too).
    ahead_launched: u64,
    ahead_voided: u64,
    /// Conversations' KV caches on disk (see [`crate::spill`]); `None`: off.
    spill: Option<crate::spill::SpillTier>,
    /// How long a conversation's cache stays idle before it is written to the spill tier.
    spill_idle: std::time::Duration,
    /// The listener of the typed draft being warmed (see [`crate::warm`]): kept open so the
    /// request is not taken for abandoned; nobody reads it.
    warm_listener: Option<mpsc::UnboundedReceiver<GenEvent>>,
}

impl ModelWorker {
    pub fn new(engine: Engine, tokenizer: Arc<Tokenizer>, context_window: usize) -> Self {
        let context_window = context_window.min(engine.config().context_length);
        Self {
            context_window,
            doomed: Vec::new(),
            logits: Logits::new(),
            engine,
            tokenizer,
            active: HashMap::new(),
            caches: HashMap::new(),
            evictions: 0,
            host_sampling: false,
            device_memory: None,
            mask_overlap: None,
            finished: Vec::new(),
            spec: SpecConfig::default(),
            step_cost: StepCost::default(),
            ngrams: UserNgrams::new(NGRAM_USERS, NGRAM_CAPACITY),
            spec_drafted: 0,
            spec_accepted: 0,
            async_steps: None,
            ahead: None,
            ahead_logits: Logits::new(),
            ahead_launched: 0,
            ahead_voided: 0,
            spill: None,
            spill_idle: std::time::Duration::from_secs(30),
            warm_listener: None,
        }
    }

    /// Keeps conversations' KV caches in `tier` when they are evicted or idle for `idle`, and
    /// restores them from it when their conversation returns.
    pub fn with_spill(mut self, tier: crate::spill::SpillTier, idle: std::time::Duration) -> Self {
        self.spill = Some(tier);
        self.spill_idle = idle;
        self
    }

    /// Launches each steady decode step's successor before delivering its tokens (`true`), or
    /// never (`false`); by default on a GPU only, whose steps run while the host delivers (on
    /// the CPU the step would take the cores the delivery needs, and its tokens would come a
    /// step later).
    pub fn with_async_steps(mut self, on: bool) -> Self {
        self.async_steps = Some(on);
        self
    }

    /// Draws every token on the host, from logits brought back, even where the backend draws
    /// on its device (which orders a seeded draw's candidates otherwise: see
    /// `Sampler::device_draw`). For comparisons across tiers.
    /// Verifies draft tokens with every decode where it pays (see [`crate::speculate`]).
    pub fn with_speculation(mut self, spec: SpecConfig) -> Self {
        self.spec = spec;
        self
    }

    /// Decode graphs warmed up and captured so far (0 without graphs).
    fn graph_work(&self) -> u64 {
        self.engine
            .graph_stats()
            .map_or(0, |g| g.warmups + g.captures)
    }

    /// Whether this worker verifies drafts at all: speculation on, and on the CPU or allowed on
    /// a GPU. (Nothing is learned for drafting where none will be made.)
    fn drafts_here(&self) -> bool {
        self.spec.enabled
            && (self.spec.on_gpu
                || matches!(self.engine.device(), smolchat_engine::device::Device::Cpu))
    }

    /// Runs `prompt` alone to its end, greedily, at most `max_tokens` new tokens, outside any
    /// scheduler (for `smolchat bench --speculative`). Speculation applies as configured, with
    /// the whole step budget left to drafts.
    pub fn generate_alone(&mut self, prompt: Vec<u32>, max_tokens: usize) -> AloneRun {
        let id = RequestId::MAX - self.active.len() as RequestId;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let params = smolchat_text::sampling::SamplingParams {
            max_new_tokens: max_tokens,
            ignore_eos: true,
            ..smolchat_text::sampling::SamplingParams::greedy()
        };
        let prompt_len = prompt.len();
        self.active.insert(
            id,
            Active::new(
                GenerationRequest::anonymous(prompt, params, tx),
                Instant::now(),
            ),
        );
        let mut plan = StepPlan {
            prefill: vec![(id, prompt_len.max(1))],
            ..StepPlan::default()
        };
        let mut tokens = Vec::new();
        let mut first: Option<Instant> = None;
        let mut last = Instant::now();
        let mut steps = 0;
        let mut verified = Vec::new();
        // Every step generates at least one token once the prompt is in.
        for _ in 0..max_tokens + 4 {
            let report = self.step_held(plan);
            // Nobody else waits on these.
            self.finished.clear();
            steps += 1;
            if steps > 1 {
                verified.push((
                    report.drafted_tokens as usize,
                    report.accepted_tokens as usize,
                ));
            }
            while let Ok(event) = rx.try_recv() {
                if let GenEvent::Token { token, .. } = event {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last = now;
                    tokens.push(token);
                }
            }
            if report.items.iter().any(|r| r.id == id && r.finished) {
                break;
            }
            plan = StepPlan {
                decode: vec![id],
                draft_budget: self.spec.max_draft,
                ..StepPlan::default()
            };
        }
        // A step launched ahead of the last token computes nothing anyone wants.
        self.settle_ahead();
        let seconds = first.map_or(0.0, |f| last.duration_since(f).as_secs_f64());
        AloneRun {
            tokens,
            seconds,
            steps,
            verified,
        }
    }

    pub fn sample_on_host(mut self) -> Self {
        self.host_sampling = true;
        self
    }

    /// Computes grammar masks during the forward pass (`true`) or when each token is drawn,
    /// whatever the device (by default: during it on a GPU only).
    pub fn with_mask_overlap(mut self, overlap: bool) -> Self {
        self.mask_overlap = Some(overlap);
        self
    }

    /// Runs the command loop until every sender is gone. `report` carries step reports back to the
    /// scheduler.
    pub fn run(mut self, commands: std_mpsc::Receiver<WorkerCommand>, report: impl Fn(StepReport)) {
        // When the last report left requests running: the gap to the next plan is the hop.
        let mut reported_busy: Option<Instant> = None;
        loop {
            let cmd = if self.spill.is_some() {
                match commands.recv_timeout(std::time::Duration::from_secs(1)) {
                    Ok(cmd) => cmd,
                    Err(std_mpsc::RecvTimeoutError::Timeout) => {
                        self.spill_idle(self.spill_idle);
                        continue;
                    }
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                match commands.recv() {
                    Ok(cmd) => cmd,
                    Err(_) => break,
                }
            };
            match cmd {
                WorkerCommand::Register {
                    id,
                    request,
                    submitted,
                } => {
                    if let Some(c) = request.cache_key {
                        self.prefetch(c);
                    }
                    self.active.insert(id, Active::new(*request, submitted));
                }
                WorkerCommand::Prefetch(conversation) => self.prefetch(conversation),
                WorkerCommand::Step(plan) => {
                    let gap = reported_busy
                        .take()
                        .map(|t| t.elapsed().as_secs_f64() * 1e3);
                    let mut r = self.step_held(plan);
                    r.gap_ms = gap;
                    r.finished = std::mem::take(&mut self.finished);
                    let busy = r.items.iter().any(|i| !i.finished);
                    report(r);
                    reported_busy = busy.then(Instant::now);
                }
                WorkerCommand::Evict {
                    conversation,
                    keep_on_disk,
                    done,
                } => {
                    let dropped = if keep_on_disk {
                        self.evict_to_disk(conversation)
                    } else {
                        self.forget_conversation(conversation)
                    };
                    let _ = done.send(dropped);
                }
                WorkerCommand::SpillAll(done) => {
                    self.spill_idle(std::time::Duration::ZERO);
                    if let Some(tier) = self.spill.as_mut() {
                        tier.flush();
                    }
                    let _ = done.send(());
                }
                WorkerCommand::CacheInfo(reply) => {
                    let info = self
                        .caches
                        .iter()
                        .map(|(k, slot)| CacheEntryInfo {
                            key: k.clone(),
                            tokens: self.engine.cached_tokens(slot.seq).map_or(0, |t| t.len()),
                            bytes: self.engine.kv_bytes(slot.seq).unwrap_or(0),
                            drafted: slot.drafted,
                            accepted: slot.accepted,
                            verify_steps: slot.verify_steps,
                        })
                        .collect();
                    let _ = reply.send(info);
                }
            }
        }
        tracing::info!("model worker stopped");
    }

    /// Starts reading `conversation`'s spilled cache ahead when it is not on the device.
    fn prefetch(&mut self, conversation: Uuid) {
        if self
            .caches
            .contains_key(&CacheKey::Conversation(conversation))
        {
            return;
        }
        if let Some(tier) = self.spill.as_mut() {
            tier.preload(conversation);
        }
    }

    /// Whether `id`'s admission should wait for its conversation's spilled cache, still being
    /// read ahead, because the step has other work that would wait with it (alone, it waits for
    /// the read: nobody else is held up).
    fn admission_waits_for_read(&mut self, id: RequestId, others: bool) -> bool {
        let Some(c) = self.active.get(&id).and_then(|a| a.request.cache_key) else {
            return false;
        };
        others
            && !self.caches.contains_key(&CacheKey::Conversation(c))
            && self.spill.as_mut().is_some_and(|t| t.is_loading(c))
    }

    /// First time a request is planned: find or make its sequence and work out what of the prompt
    /// is already cached.
    fn admit(&mut self, id: RequestId) {
        let Some(a) = self.active.get(&id) else {
            return;
        };
        if a.pool.is_some() {
            self.admit_embedding(id);
            return;
        }
        if a.request.cache_key.is_none() && a.resume.is_none() {
            match self.prefix_donor(id) {
                Some(PrefixDonor::Ready { seq, positions }) => {
                    // The prefix another request of the same client computed, shared.
                    match self.engine.fork(seq, positions) {
                        Ok((forked, _)) => {
                            self.start(id, forked, false);
                            return;
                        }
                        Err(e) => tracing::warn!(seq, "forking a sequence failed: {e}"),
                    }
                }
                // Admitted once the other request has computed what they share.
                Some(PrefixDonor::Computing) => return,
                None => {}
            }
        }
        let key = a.request.cache_key.map(CacheKey::Conversation);
        let warm = a.request.warm;
        let reusable = key
            .as_ref()
            .filter(|k| !self.busy(k))
            .and_then(|k| self.caches.get(k).map(|s| s.seq));
        let (seq, keyed) = match (reusable, key) {
            (Some(seq), Some(_)) => (seq, true),
            (None, Some(k)) if !self.busy(&k) => {
                let restored = k.conversation().and_then(|c| self.restore_spilled(c));
                let seq = restored.unwrap_or_else(|| self.engine.create_sequence());
                let mut slot = CacheSlot::new(seq, Instant::now());
                if restored.is_some() {
                    slot.restored = self.engine.cached_tokens(seq).map_or(0, <[u32]>::len);
                }
                self.caches.insert(k, slot);
                (seq, true)
            }
            // A draft whose conversation's cache is in use has nothing to warm.
            _ if warm => {
                self.finish(id, StopReason::Cancelled);
                return;
            }
            _ => (self.adopt_anonymous(id), false),
        };
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        if let Some(tokens) = a.resume.take() {
            // A preempted request comes back: recompute what it had; its generation state,
            // first admission and cached-token count stay as they were.
            let reuse = self.engine.reuse_prefix(seq, &tokens).unwrap_or(0);
            a.seq = Some(seq);
            a.keyed = keyed;
            a.pending_prompt = tokens[reuse..].to_vec();
            a.last_token = None;
            return;
        }
        self.start(id, seq, keyed);
    }

    /// Starts an admitted request on `seq`: keeps what of its prompt the sequence holds, sets up
    /// its generation and tells its listener.
    fn start(&mut self, id: RequestId, seq: SeqId, keyed: bool) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let prompt = &a.request.prompt;
        let reuse = self.engine.reuse_prefix(seq, prompt).unwrap_or_else(|e| {
            tracing::warn!(seq, "preparing the sequence's cache failed: {e}");
            0
        });
        a.seq = Some(seq);
        a.keyed = keyed;
        a.cached_tokens = reuse;
        a.pending_prompt = prompt[reuse..].to_vec();
        a.admitted = Some(Instant::now());
        // Where the reused prefix came from: the spill tier, a typed draft, or a reply before.
        let slot = a
            .request
            .cache_key
            .filter(|_| keyed)
            .and_then(|k| self.caches.get_mut(&CacheKey::Conversation(k)));
        if let Some(slot) = slot {
            if a.request.warm {
                // The draft computes from `reuse` on.
                slot.warm_from = Some(slot.warm_from.map_or(reuse, |w| w.min(reuse)));
            } else {
                a.restored_tokens = slot.restored.min(reuse);
                a.warmed_tokens = slot.warm_from.map_or(0, |w| reuse.saturating_sub(w));
                slot.restored = 0;
                slot.warm_from = None;
            }
        }
        let generation = Generation::new(&self.tokenizer, a.request.params.clone(), prompt);
        match generation {
            Ok(g) => a.generation = Some(g),
            Err(e) => tracing::warn!("bad sampling parameters reached the worker: {e}"),
        }
        let _ = a.request.events.send(GenEvent::Admitted {
            prompt_tokens: prompt.len(),
            cached_tokens: reuse,
        });
    }

    /// Ends a request: sends its summary, frees a temporary sequence, keeps a keyed one.
    fn finish(&mut self, id: RequestId, reason: StopReason) {
        // A row launched ahead for it computes nothing it keeps (the stop is seen a step late).
        self.void_ahead(id);
        let Some(a) = self.active.remove(&id) else {
            return;
        };
        let now = Instant::now();
        if let (true, true, Some(seq), Some(last)) = (
            self.drafts_here() && self.spec.ngram_cache,
            a.pool.is_none() && a.completion_tokens >= 3,
            a.seq,
            a.last_token,
        ) {
            // The reply: its tokens in the cache, and the last one drawn (not stepped yet).
            if let Ok(cached) = self.engine.cached_tokens(seq) {
                let from = cached.len().saturating_sub(a.completion_tokens - 1);
                let mut reply = cached[from..].to_vec();
                reply.push(last);
                self.ngrams.learn(a.request.user.as_deref(), &reply);
            }
        }
        if let (Some(seq), Some(_)) = (a.seq, &a.pool) {
            // An embedding's positions are of no use to later requests (and were never shared).
            self.engine.free_sequence(seq);
        } else if let Some(seq) = a.seq {
            if a.keyed {
                if let Some(slot) = a
                    .request
                    .cache_key
                    .and_then(|k| self.caches.get_mut(&CacheKey::Conversation(k)))
                {
                    slot.last_used = now;
                    slot.spilled = false;
                }
            } else {
                self.keep_anonymous(seq, a.request.cache_salt.as_deref(), now);
            }
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let admitted = a.admitted.unwrap_or(now);
        let summary = GenSummary {
            reason,
            prompt_tokens: a.request.prompt.len(),
            cached_tokens: a.cached_tokens,
            completion_tokens: a.completion_tokens,
            queue_ms: ms(admitted.duration_since(a.submitted)),
            prefill_ms: a
                .first_token
                .map_or(0.0, |f| ms(f.duration_since(admitted))),
            ttft_ms: a
                .first_token
                .map_or(0.0, |f| ms(f.duration_since(a.submitted))),
            generation_ms: a.first_token.map_or(0.0, |f| ms(now.duration_since(f))),
            drafted_tokens: a.draft.drafted,
            accepted_tokens: a.draft.accepted,
            restored_tokens: a.restored_tokens,
            warmed_tokens: a.warmed_tokens,
        };
        // Held until the step's report is applied (see `StepReport::finished`).
        self.finished.push((a.request.events.clone(), summary));
        if let Some(conversation) = a.request.cache_key.filter(|_| a.keyed) {
            if let Some(pos) = self.doomed.iter().position(|k| *k == conversation) {
                self.doomed.remove(pos);
                self.evict_key(&CacheKey::Conversation(conversation));
            }
        }
    }

    /// What the GPU's memory holds, asked of the driver at most once a second.
    fn device_memory(&mut self) -> Option<DeviceMemory> {
        match self.device_memory {
            Some((at, memory)) if at.elapsed() < std::time::Duration::from_secs(1) => memory,
            _ => {
                let memory = self.engine.device_memory();
                self.device_memory = Some((Instant::now(), memory));
                memory
            }
        }
    }
}
