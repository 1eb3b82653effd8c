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

use super::batcher::{ItemReport, StepPlan};
use crate::speculate::{DraftControl, PromptLookup, Proposer, SpecConfig, StepCost, UserNgrams};
use uuid::Uuid;

use super::types::{
    CacheKey, GenEvent, GenSummary, GenerationRequest, Pooling, RequestId, StopReason,
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
        done: oneshot::Sender<bool>,
    },
    /// Per-conversation cache sizes.
    CacheInfo(oneshot::Sender<Vec<CacheEntryInfo>>),
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
    pub step_ms: f64,
    pub generated_tokens: u64,
    pub prefilled_tokens: u64,
    pub reused_tokens: u64,
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
}

/// What an embedding request has pooled of the hidden states computed so far.
struct PoolState {
    pooling: Pooling,
    /// Sum over positions (mean pooling) or the latest row (last pooling), in f64 so a long
    /// prompt's mean does not depend on the order of its chunks more than rounding must.
    acc: Vec<f64>,
    positions: usize,
}

impl PoolState {
    fn new(pooling: Pooling) -> Self {
        Self {
            pooling,
            acc: Vec::new(),
            positions: 0,
        }
    }

    /// Adds `rows` (each `width` floats) of consecutive positions.
    fn add(&mut self, rows: &[f32], width: usize) {
        if width == 0 {
            return;
        }
        if self.acc.len() != width {
            self.acc = vec![0.0; width];
        }
        for row in rows.chunks_exact(width) {
            match self.pooling {
                Pooling::Mean => {
                    for (a, &v) in self.acc.iter_mut().zip(row) {
                        *a += v as f64;
                    }
                }
                Pooling::Last => {
                    for (a, &v) in self.acc.iter_mut().zip(row) {
                        *a = v as f64;
                    }
                }
            }
            self.positions += 1;
        }
    }

    /// The pooled vector, L2-normalized (a zero vector stays zero).
    fn finish(&self) -> Vec<f32> {
        let n = match self.pooling {
            Pooling::Mean => self.positions.max(1) as f64,
            Pooling::Last => 1.0,
        };
        let pooled: Vec<f64> = self.acc.iter().map(|a| a / n).collect();
        let norm = pooled.iter().map(|v| v * v).sum::<f64>().sqrt();
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        pooled.iter().map(|v| (v * scale) as f32).collect()
    }
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
        }
    }
}

/// What [`ModelWorker::prefix_donor`] found.
enum Donor {
    /// Fork `positions` positions of `seq`.
    Ready { seq: SeqId, positions: usize },
    /// Wait: the shared prefix is being computed.
    Computing,
}

/// At most this many stateless caches are kept.
const MAX_ANONYMOUS_CACHES: usize = 16;

/// Users whose replies' n-grams are kept for drafting (the least recently used go first), and
/// n-grams per generation of each: 14,000 keys stay within a table of 16,384 buckets of 41
/// bytes (hashbrown's 7/8 load), about 0.66 MiB, so two generations are 1.3 MiB a user and
/// 42 MiB for all users at the very most (replies of about 7,000 tokens fill a generation).
const NGRAM_USERS: usize = 32;
const NGRAM_CAPACITY: usize = 14_000;

struct CacheSlot {
    seq: SeqId,
    last_used: Instant,
    /// Speculative decoding's counts for this cache's conversation (see [`CacheEntryInfo`]).
    drafted: u64,
    accepted: u64,
    verify_steps: u64,
}

/// One row of a step: the request, its sequence, the tokens to compute, and whether a token is
/// drawn after them (a prefill's last chunk, every decode).
type Planned = (RequestId, SeqId, Vec<u32>, bool);

/// A step as its phases gather and run it ([`ModelWorker::step_held`]).
#[derive(Default)]
struct StepWork {
    report: StepReport,
    work: Vec<Planned>,
    /// Draft tokens per decoding request, verified in this step.
    drafts: HashMap<RequestId, Vec<u32>>,
    /// Accepted draft tokens per request (beyond the one token a decode makes).
    extra: HashMap<RequestId, usize>,
    /// Prompt tokens each request computes in this step (charged to its user's usage).
    prefilled: HashMap<RequestId, usize>,
    /// Requests that fail, with why.
    failed: Vec<(RequestId, String)>,
    /// The positions of a decode-only step, which teaches the cost line.
    decode_positions: Option<usize>,
}

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
        }
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
        while let Ok(cmd) = commands.recv() {
            match cmd {
                WorkerCommand::Register {
                    id,
                    request,
                    submitted,
                } => {
                    self.active.insert(id, Active::new(*request, submitted));
                }
                WorkerCommand::Step(plan) => {
                    let mut r = self.step_held(plan);
                    r.finished = std::mem::take(&mut self.finished);
                    report(r)
                }
                WorkerCommand::Evict { conversation, done } => {
                    let _ = done.send(self.forget_conversation(conversation));
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

    /// Whether a running request uses the cache `key` (only conversations' caches are kept in
    /// the map while in use; an anonymous one is taken out while its request runs).
    fn busy(&self, key: &CacheKey) -> bool {
        let Some(conversation) = key.conversation() else {
            return false;
        };
        self.active
            .values()
            .any(|a| a.keyed && a.request.cache_key == Some(conversation))
    }

    /// Drops a conversation's cache now, or when its running request ends. Returns whether a
    /// cache was (or will be) dropped.
    fn forget_conversation(&mut self, conversation: Uuid) -> bool {
        let key = CacheKey::Conversation(conversation);
        if self.busy(&key) {
            if !self.doomed.contains(&conversation) {
                self.doomed.push(conversation);
            }
            return true;
        }
        self.evict_key(&key)
    }

    fn evict_key(&mut self, key: &CacheKey) -> bool {
        if self.busy(key) {
            return false;
        }
        match self.caches.remove(key) {
            Some(slot) => {
                self.engine.free_sequence(slot.seq);
                self.evictions += 1;
                true
            }
            None => false,
        }
    }

    /// Evicts least-recently-used idle caches until `blocks` more KV blocks are free in the
    /// engine's allocator (the one KV budget). Returns whether they fit.
    fn make_room(&mut self, blocks: usize) -> bool {
        loop {
            if self.engine.kv_free_blocks() >= blocks {
                return true;
            }
            let victim = self
                .caches
                .iter()
                .filter(|(k, _)| !self.busy(k))
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| k.clone());
            match victim {
                Some(k) => {
                    tracing::debug!(cache_key = %k, "evicting idle KV cache");
                    self.evict_key(&k);
                }
                None => return false,
            }
        }
    }

    /// A sequence for a request without a cache key: the kept anonymous cache sharing the longest
    /// prefix with its prompt (a stateless API client resending its conversation), or a new one.
    fn adopt_anonymous(&mut self, id: RequestId) -> SeqId {
        let Some(request) = self.active.get(&id).map(|a| &a.request) else {
            return self.engine.create_sequence();
        };
        let prompt = &request.prompt;
        // Only caches of the same partition: reuse across clients would let one probe another's
        // prompts through `cached_tokens` and timing.
        let partition = request.cache_salt.as_deref().unwrap_or("");
        let best = self
            .caches
            .iter()
            .filter(
                |(k, _)| matches!(k, CacheKey::Anonymous { partition: p, .. } if p == partition),
            )
            .map(|(k, slot)| {
                let shared = self.engine.common_prefix(slot.seq, prompt).unwrap_or(0);
                (shared, k.clone())
            })
            .filter(|(shared, _)| *shared > 0)
            .max_by_key(|(shared, _)| *shared);
        match best.and_then(|(_, k)| self.caches.remove(&k)) {
            Some(slot) => slot.seq,
            None => self.engine.create_sequence(),
        }
    }

    /// Keeps a finished anonymous sequence for reuse (bounded; oldest dropped first).
    fn keep_anonymous(&mut self, seq: SeqId, salt: Option<&str>, now: Instant) {
        let anonymous: Vec<(CacheKey, Instant)> = self
            .caches
            .iter()
            .filter(|(k, _)| matches!(k, CacheKey::Anonymous { .. }))
            .map(|(k, s)| (k.clone(), s.last_used))
            .collect();
        if anonymous.len() >= MAX_ANONYMOUS_CACHES {
            if let Some((oldest, _)) = anonymous.iter().min_by_key(|(_, t)| *t) {
                self.evict_key(oldest);
            }
        }
        self.caches.insert(
            CacheKey::Anonymous {
                partition: salt.unwrap_or("").to_string(),
                seq,
            },
            CacheSlot {
                seq,
                last_used: now,
                drafted: 0,
                accepted: 0,
                verify_steps: 0,
            },
        );
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
                Some(Donor::Ready { seq, positions }) => {
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
                Some(Donor::Computing) => return,
                None => {}
            }
        }
        let key = a.request.cache_key.map(CacheKey::Conversation);
        let reusable = key
            .as_ref()
            .filter(|k| !self.busy(k))
            .and_then(|k| self.caches.get(k).map(|s| s.seq));
        let (seq, keyed) = match (reusable, key) {
            (Some(seq), Some(_)) => (seq, true),
            (None, Some(k)) if !self.busy(&k) => {
                let seq = self.engine.create_sequence();
                self.caches.insert(
                    k,
                    CacheSlot {
                        seq,
                        last_used: Instant::now(),
                        drafted: 0,
                        accepted: 0,
                        verify_steps: 0,
                    },
                );
                (seq, true)
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

    /// Another running request of the same cache partition whose prompt shares at least one
    /// whole KV block with this request's and more than any idle cache does (the `n` choices of
    /// one prompt, a client resending a conversation while its last turn runs): its blocks are
    /// forked rather than computed again once it has computed them.
    fn prefix_donor(&self, id: RequestId) -> Option<Donor> {
        let a = self.active.get(&id)?;
        if a.pool.is_some() {
            return None;
        }
        let prompt = &a.request.prompt;
        // The last prompt token is always computed (its logits are needed).
        let usable = prompt.len().saturating_sub(1);
        let whole = |n: usize| n.min(usable) / BLOCK_POSITIONS * BLOCK_POSITIONS;
        let idle = self
            .caches
            .iter()
            .filter(|(k, _)| {
                matches!(k, CacheKey::Anonymous { partition, .. }
                    if Some(partition.as_str()) == a.request.cache_salt.as_deref())
            })
            .map(|(_, slot)| self.engine.common_prefix(slot.seq, prompt).unwrap_or(0))
            .max()
            .unwrap_or(0);
        let (seq, will, now) = self
            .active
            .iter()
            .filter(|(other, b)| {
                **other != id
                    && b.pool.is_none()
                    && b.request.cache_salt.is_some()
                    && b.request.cache_salt == a.request.cache_salt
            })
            .filter_map(|(_, b)| {
                let seq = b.seq?;
                let will = whole(
                    b.request
                        .prompt
                        .iter()
                        .zip(prompt)
                        .take_while(|(x, y)| x == y)
                        .count(),
                );
                let now = whole(self.engine.common_prefix(seq, prompt).unwrap_or(0));
                Some((seq, will, now))
            })
            .max_by_key(|&(_, will, now)| (will, now))?;
        if will == 0 || will <= idle {
            return None;
        }
        Some(if now >= will {
            Donor::Ready {
                seq,
                positions: now,
            }
        } else {
            Donor::Computing
        })
    }

    /// Admits an embedding request: a fresh sequence, since pooling needs the hidden state of
    /// every position (a cached prefix has none), and no generation state beyond the prompt.
    fn admit_embedding(&mut self, id: RequestId) {
        let seq = self.engine.create_sequence();
        let Some(a) = self.active.get_mut(&id) else {
            self.engine.free_sequence(seq);
            return;
        };
        a.seq = Some(seq);
        a.keyed = false;
        if let Some(pool) = a.pool.as_mut() {
            // After a preemption: the positions pooled so far are computed again.
            *pool = PoolState::new(pool.pooling);
        }
        let first = a.resume.take().is_none();
        a.pending_prompt = a.request.prompt.clone();
        a.last_token = None;
        if !first {
            return;
        }
        a.cached_tokens = 0;
        a.admitted = Some(Instant::now());
        match Generation::new(&self.tokenizer, a.request.params.clone(), &a.request.prompt) {
            Ok(g) => a.generation = Some(g),
            Err(e) => tracing::warn!("bad sampling parameters reached the worker: {e}"),
        }
        let _ = a.request.events.send(GenEvent::Admitted {
            prompt_tokens: a.request.prompt.len(),
            cached_tokens: 0,
        });
    }

    /// Ends a request: sends its summary, frees a temporary sequence, keeps a keyed one.
    fn finish(&mut self, id: RequestId, reason: StopReason) {
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

    /// Adds an embedding request's hidden-state rows of this step to its pool; after its last
    /// chunk, sends the vector and ends it.
    fn pool_hidden(&mut self, id: RequestId, rows: Option<&[f32]>, width: usize, last: bool) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let Some(pool) = a.pool.as_mut() else {
            return;
        };
        if let Some(rows) = rows {
            pool.add(rows, width);
        }
        if last {
            let vector = pool.finish();
            let _ = a.request.events.send(GenEvent::Embedding(vector));
            self.finish(id, StopReason::EndOfGeneration);
        }
    }

    /// KV positions the budget holds in all (the allocator's blocks).
    fn kv_capacity_tokens(&self) -> usize {
        self.kv_capacity_blocks() * BLOCK_POSITIONS
    }

    fn kv_capacity_blocks(&self) -> usize {
        self.engine.kv_capacity_blocks()
    }

    /// Blocks new work could have: those not held (within the budget), plus those held by idle
    /// caches, which [`ModelWorker::make_room`] would evict.
    fn kv_free_for_new_work(&self) -> usize {
        let held = self.engine.total_kv_bytes() / self.engine.kv_block_bytes().max(1);
        let free = self
            .kv_capacity_blocks()
            .saturating_sub(held)
            .min(self.engine.kv_free_blocks());
        let idle: usize = self
            .caches
            .iter()
            .filter(|(k, _)| !self.busy(k))
            .map(|(_, slot)| {
                self.engine.kv_bytes(slot.seq).unwrap_or(0) / self.engine.kv_block_bytes().max(1)
            })
            .sum();
        free + idle
    }

    /// Takes a running request's KV blocks back: its sequence (and conversation cache, if it
    /// has one) is dropped, and it keeps everything it had as tokens to recompute when it is
    /// admitted again: what was cached, this step's `chunk` (a prefill chunk, or the last
    /// sampled token of a decode, never its drafts: the step drops those before it preempts) and the
    /// prompt not yet fed. Returns how many tokens that is.
    fn preempt(&mut self, id: RequestId, seq: SeqId, chunk: Vec<u32>) -> usize {
        let mut tokens = self
            .engine
            .cached_tokens(seq)
            .map(|t| t.to_vec())
            .unwrap_or_default();
        let Some(a) = self.active.get_mut(&id) else {
            return 0;
        };
        tokens.extend_from_slice(&chunk);
        tokens.extend_from_slice(&a.pending_prompt);
        a.last_token = None;
        a.pending_prompt.clear();
        a.seq = None;
        let key = a.request.cache_key.filter(|_| a.keyed);
        a.keyed = false;
        let remaining = tokens.len();
        a.resume = Some(tokens);
        if let Some(k) = key {
            self.caches.remove(&CacheKey::Conversation(k));
        }
        self.engine.free_sequence(seq);
        tracing::debug!(
            request = id,
            tokens = remaining,
            "preempted: the KV cache is full; it recomputes later"
        );
        remaining
    }

    /// A step whose `Finished` events are sent at once (the tests, which apply reports
    /// themselves).
    #[cfg(test)]
    fn step(&mut self, plan: StepPlan) -> StepReport {
        let report = self.step_held(plan);
        let mut held = StepReport {
            finished: std::mem::take(&mut self.finished),
            ..StepReport::default()
        };
        held.deliver_finished();
        report
    }

    /// A step, in its phases; the `Finished` events of the requests it ended wait in
    /// `self.finished`.
    fn step_held(&mut self, plan: StepPlan) -> StepReport {
        let start = Instant::now();
        let graph_work = self.graph_work();
        let mut step = StepWork::default();
        self.cancel_requests(&plan, &mut step);
        self.admit_planned(&plan, &mut step);
        let (draft_budget, break_even) = self.draft_budget(&plan);
        self.gather_decodes(&plan, draft_budget, break_even, &mut step);
        self.gather_prefills(&plan, &mut step);
        self.fit_in_kv(&mut step);
        if !step.work.is_empty() {
            self.run_and_deliver(&plan, &mut step);
        }
        self.end_failed(&plan, &mut step);
        self.report_standing(&plan, &mut step);
        self.measure(step, start, graph_work)
    }

    /// Cancel: the requests the plan stops, and those whose listener went away.
    fn cancel_requests(&mut self, plan: &StepPlan, step: &mut StepWork) {
        for &id in &plan.cancel {
            if self.active.contains_key(&id) {
                self.finish(id, StopReason::Cancelled);
            }
            step.report.items.push(ItemReport::ended(id, 0));
        }
        let gone: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.request.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.finish(id, StopReason::Cancelled);
            step.report.items.push(ItemReport::ended(id, 0));
        }
    }

    /// Admit: a sequence (and any cached prefix) for each planned prefill not yet admitted.
    fn admit_planned(&mut self, plan: &StepPlan, step: &mut StepWork) {
        for &(id, _) in &plan.prefill {
            if self.active.get(&id).is_some_and(|a| a.seq.is_none()) {
                self.admit(id);
                if let Some(a) = self.active.get(&id) {
                    step.report.reused_tokens += a.cached_tokens as u64;
                }
            }
        }
    }

    /// How many draft tokens the step may carry, and the acceptance a draft position needs to
    /// pay in it. Speculation: draft tokens only in steps without prompt work (a prefill already
    /// makes the step compute-bound) and with few decoding sequences, within the step's spare
    /// token budget.
    fn draft_budget(&self, plan: &StepPlan) -> (usize, f32) {
        let mut draft_budget = if self.drafts_here()
            && plan.prefill.is_empty()
            && plan.decode.len() <= self.spec.max_batch
        {
            plan.draft_budget
        } else {
            0
        };
        // Before the first step is measured: no drafts.
        let break_even = match self.spec.fixed_break_even {
            Some(fixed) => Some(fixed),
            None => self.step_cost.break_even(plan.decode.len()),
        };
        if break_even.is_none() {
            draft_budget = 0;
        }
        // Drafts never change a reply: the step may grow only as far as the backend still
        // computes every row bit for bit as without them (on a GPU, within the matmul kernels'
        // class of the step's row count; on the CPU, as far as it likes). Counted only in a
        // step that may draft at all.
        if draft_budget > 0 {
            let decode_rows = plan
                .decode
                .iter()
                .filter(|id| {
                    self.active
                        .get(id)
                        .is_some_and(|a| a.seq.is_some() && a.last_token.is_some())
                })
                .count();
            let alike = self.engine.rows_computed_alike(decode_rows);
            draft_budget = draft_budget.min(alike.saturating_sub(decode_rows));
        }
        (draft_budget, break_even.unwrap_or(1.0))
    }

    /// Drafts and decodes: each decoding request's last token, with the draft tokens prompt
    /// lookup (or the user's n-gram cache) proposes while the budget and its window allow.
    fn gather_decodes(
        &mut self,
        plan: &StepPlan,
        mut draft_budget: usize,
        break_even: f32,
        step: &mut StepWork,
    ) {
        let window_now = self.context_window.min(self.kv_capacity_tokens());
        let lookup = PromptLookup {
            max_ngram: self.spec.max_ngram,
            min_ngram: self.spec.min_ngram,
        };
        for &id in &plan.decode {
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            let (Some(seq), Some(tok)) = (a.seq, a.last_token) else {
                continue;
            };
            let mut tokens = vec![tok];
            if draft_budget > 0 && a.pool.is_none() && a.generation.is_some() {
                if let Ok(cached) = self.engine.cached_tokens(seq) {
                    // Room in the window after this step's own token.
                    let room = window_now.saturating_sub(cached.len() + 2);
                    let most = room.min(draft_budget);
                    let max = a.draft.draft_len(self.spec.max_draft.min(most), break_even);
                    if max > 0 {
                        let mut history = Vec::with_capacity(cached.len() + 1);
                        history.extend_from_slice(cached);
                        history.push(tok);
                        let mut proposed = lookup.propose(&history, max);
                        if proposed.is_empty() && self.spec.ngram_cache {
                            if let Some(cache) = self.ngrams.get(a.request.user.as_deref()) {
                                proposed = cache.propose(&history, max);
                            }
                        }
                        if !proposed.is_empty() {
                            draft_budget -= proposed.len();
                            tokens.extend_from_slice(&proposed);
                            step.drafts.insert(id, proposed);
                        }
                    }
                }
            }
            step.work.push((id, seq, tokens, true));
        }
    }

    /// Prefills: each planned request's next chunk of its prompt.
    fn gather_prefills(&mut self, plan: &StepPlan, step: &mut StepWork) {
        for &(id, max) in &plan.prefill {
            if let Some(a) = self.active.get_mut(&id) {
                let Some(seq) = a.seq else { continue };
                if a.generation.is_none() {
                    continue;
                }
                let n = max.min(a.pending_prompt.len());
                if n == 0 {
                    continue;
                }
                let chunk: Vec<u32> = a.pending_prompt.drain(..n).collect();
                let last = a.pending_prompt.is_empty();
                step.report.prefilled_tokens += chunk.len() as u64;
                step.prefilled.insert(id, chunk.len());
                step.work.push((id, seq, chunk, last));
            }
        }
    }

    /// KV room and preemption: evict idle caches to make room; if the step still does not fit,
    /// drop its drafts, then preempt the youngest of its requests (the one admitted last) and
    /// try again, as vLLM does: its blocks go to the older ones and it recomputes later. A
    /// request that cannot fit even alone in the whole cache ends as if it had reached the
    /// context window (or fails, when it has generated nothing).
    fn fit_in_kv(&mut self, step: &mut StepWork) {
        loop {
            let needed: usize = step
                .work
                .iter()
                .map(|(_, seq, toks, _)| {
                    self.engine.kv_blocks_needed(*seq, toks.len()).unwrap_or(0)
                })
                .sum();
            if self.make_room(needed) {
                return;
            }
            // Drafts are optional work: drop them all before preempting anyone. Besides being
            // cheaper, it keeps a preempted request from recomputing its unverified drafts as if
            // they were accepted (its `chunk` must be only what it really had).
            if !step.drafts.is_empty() {
                for (id, _, tokens, _) in step.work.iter_mut() {
                    if step.drafts.remove(id).is_some() {
                        tokens.truncate(1);
                    }
                }
                continue;
            }
            let youngest = step
                .work
                .iter()
                .enumerate()
                .max_by_key(|(_, (id, _, _, _))| self.active.get(id).and_then(|a| a.admitted))
                .map(|(i, _)| i);
            let Some(i) = youngest else {
                return;
            };
            let (id, seq, chunk, _) = step.work.remove(i);
            step.prefilled.remove(&id);
            if step.work.is_empty() {
                self.end_too_big(id, step);
                return;
            }
            let remaining = self.preempt(id, seq, chunk);
            step.report.preemptions += 1;
            step.report.items.push(ItemReport::preempted(id, remaining));
        }
    }

    /// A request alone and still too big for the whole KV cache: a reply under way ends as at
    /// the context window; a prompt that never fits fails.
    fn end_too_big(&mut self, id: RequestId, step: &mut StepWork) {
        let capacity = self.kv_capacity_tokens();
        match self.active.get_mut(&id) {
            Some(a) if a.completion_tokens > 0 => {
                let text = a
                    .generation
                    .as_mut()
                    .map(|g| g.finish_early())
                    .unwrap_or_default();
                if !text.is_empty() {
                    let _ = a.request.events.send(GenEvent::Token {
                        token: a.last_token.unwrap_or(0),
                        text,
                        logprobs: None,
                    });
                }
                self.finish(id, StopReason::Length);
                step.report.items.push(ItemReport::ended(id, 0));
            }
            _ => step.failed.push((
                id,
                format!(
                    "the prompt does not fit the KV cache ({capacity} tokens in all, \
                     scheduler.kv_budget_mib); shorten the conversation"
                ),
            )),
        }
    }

    /// Run: one engine step over the gathered work (each row's logits mode and device draw
    /// chosen here), then each row delivered: hidden states pooled for embeddings, drafts
    /// verified, tokens drawn and sent.
    fn run_and_deliver(&mut self, plan: &StepPlan, step: &mut StepWork) {
        // A backend that draws tokens on its device gets each sampling row's draw (the
        // penalty window and the generator's uniform) and returns only token ids.
        let on_device = self.engine.samples_on_device() && !self.host_sampling;
        // Embedding requests want every chunk's final hidden states, never logits.
        let embeds: Vec<bool> = step
            .work
            .iter()
            .map(|(id, ..)| self.active.get(id).is_some_and(|a| a.pool.is_some()))
            .collect();
        // A decode-only step (no prompt work, no embedding) teaches the cost line: its
        // positions and, at the end, its seconds.
        if plan.prefill.is_empty() && !embeds.contains(&true) {
            step.decode_positions = Some(step.work.iter().map(|(_, _, toks, _)| toks.len()).sum());
        }
        // Each row's draw for the device: one for a plain decode, one per position for a
        // decode verifying drafts (drawn as plain decoding would draw each, so the drafts are
        // verified inside a decode graph and only token ids come back). Log-probabilities and
        // grammars need the logits on the host.
        let draws: Vec<Vec<DeviceSampling>> = step
            .work
            .iter()
            .zip(&embeds)
            .map(|((id, _, _, want), &embed)| {
                if embed || !on_device || !*want {
                    return Vec::new();
                }
                let Some(generation) = self.active.get_mut(id).and_then(|a| a.generation.as_mut())
                else {
                    return Vec::new();
                };
                if generation.needs_host_logits() {
                    return Vec::new();
                }
                match step.drafts.get(id) {
                    Some(d) => generation
                        .device_draws_ahead(d)
                        .into_iter()
                        .map(device_sampling)
                        .collect(),
                    None => vec![device_sampling(generation.device_draw())],
                }
            })
            .collect();
        // Out of `self` while rows of it are sampled, so `finish` can borrow the worker.
        let mut logits = std::mem::take(&mut self.logits);
        let stepped = self.run_engine(step, &embeds, &draws, &mut logits);
        match stepped {
            Ok(()) => self.deliver_rows(step, &embeds, &draws, &mut logits),
            Err(e) => {
                // A failed step says nothing of what a step costs.
                step.decode_positions = None;
                tracing::error!("engine step failed: {e}");
                step.failed
                    .extend(step.work.iter().map(|w| (w.0, e.to_string())));
            }
        }
        self.logits = logits;
    }

    /// The engine step itself. Grammar masks depend only on the tokens drawn so far: on a GPU,
    /// whose forward pass leaves the host's cores idle, they are computed on another thread
    /// meanwhile, so a constrained sequence adds no mask time to its neighbours' step (a
    /// failure surfaces when the token is drawn). On the CPU the forward pass has every core
    /// already (measured on 2 Zen 2 cores: overlapping was no faster, within the noise), so
    /// they are computed when each token is drawn.
    fn run_engine(
        &mut self,
        step: &StepWork,
        embeds: &[bool],
        draws: &[Vec<DeviceSampling>],
        logits: &mut Logits,
    ) -> Result<(), smolchat_engine::EngineError> {
        let steps: Vec<SeqStep<'_>> = step
            .work
            .iter()
            .zip(draws)
            .zip(embeds)
            .map(|(((id, seq, toks, want), draw), &embed)| SeqStep {
                seq: *seq,
                tokens: toks,
                logits: match (embed, want, draw.is_empty(), step.drafts.contains_key(id)) {
                    (true, ..) => LogitsMode::Hidden,
                    (false, false, ..) => LogitsMode::None,
                    // A decode with drafts: every position drawn (on the device) or every
                    // position's logits (on the host), to verify them.
                    (false, true, false, true) => LogitsMode::SampleAll,
                    (false, true, true, true) => LogitsMode::All,
                    (false, true, false, false) => LogitsMode::Sample,
                    (false, true, true, false) => LogitsMode::Last,
                },
            })
            .collect();
        let sampling: Vec<&[DeviceSampling]> = draws.iter().map(Vec::as_slice).collect();
        let overlap = self.mask_overlap.unwrap_or(!matches!(
            self.engine.device(),
            smolchat_engine::device::Device::Cpu
        ));
        let mut constrained: Vec<&mut Generation> = Vec::new();
        if overlap {
            let wanted: std::collections::HashSet<RequestId> =
                step.work.iter().filter(|w| w.3).map(|w| w.0).collect();
            constrained = self
                .active
                .iter_mut()
                .filter(|(id, _)| wanted.contains(id))
                .filter_map(|(_, a)| a.generation.as_mut())
                .filter(|g| g.is_constrained())
                .collect();
        }
        let engine = &mut self.engine;
        if constrained.is_empty() {
            engine.step_sampled_into(&steps, &sampling, logits)
        } else {
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    for g in constrained.iter_mut() {
                        // An error is reported again when the token is drawn.
                        let _ = g.prepare_mask();
                    }
                });
                engine.step_sampled_into(&steps, &sampling, logits)
            })
        }
    }

    /// Deliver: each row of a step that ran, in the order of the work.
    fn deliver_rows(
        &mut self,
        step: &mut StepWork,
        embeds: &[bool],
        draws: &[Vec<DeviceSampling>],
        logits: &mut Logits,
    ) {
        // The KV cache bounds a sequence like the context window does.
        let window = self.context_window.min(self.kv_capacity_tokens());
        for (i, (id, _, _, last)) in step.work.iter().enumerate() {
            if embeds[i] {
                self.pool_hidden(*id, logits.hidden(i), logits.hidden_width(), *last);
                if *last {
                    let prefilled = step.prefilled.get(id).copied().unwrap_or(0);
                    step.report.items.push(ItemReport::ended(*id, prefilled));
                }
            }
        }
        let work = std::mem::take(&mut step.work);
        for (i, (id, seq, _, want)) in work.iter().enumerate() {
            if !*want || embeds[i] {
                continue;
            }
            // Unknown (it cannot be): as if at the window, so the reply ends.
            let cached = self.engine.cached_tokens(*seq).map_or(window, <[u32]>::len);
            if let Some(d) = step.drafts.get(id).cloned() {
                self.verify_drafts(*id, *seq, &d, cached, window, i, &draws[i], logits, step);
                continue;
            }
            let Some(a) = self.active.get_mut(id) else {
                continue;
            };
            let Some(generation) = a.generation.as_mut() else {
                continue;
            };
            let vocab = logits.vocab();
            let outcome = match (!draws[i].is_empty(), logits.token(i)) {
                (true, token) => checked_draw(token, vocab)
                    .map(|token| generation.accept_within(token, cached, window)),
                (false, _) => match logits.last_row_mut(i) {
                    Some(row) => draw_on_host(generation, row, cached, window),
                    None => continue,
                },
            };
            match outcome {
                Ok(outcome) => {
                    if let Some(reason) = deliver(a, outcome, &mut step.report) {
                        let id = *id;
                        self.finish(id, reason);
                        let prefilled = step.prefilled.get(&id).copied().unwrap_or(0);
                        step.report.items.push(ItemReport::ended(id, prefilled));
                    }
                }
                Err(e) => step.failed.push((*id, e)),
            }
        }
        step.work = work;
    }

    /// Verify: the rows of a decode that carried drafts `d` (k of them), drawn in order as
    /// plain decoding would draw them; a draft stands while the draw before it equals it. The
    /// rejected drafts' positions leave the KV cache; the last drawn token is the next step's
    /// input.
    #[allow(clippy::too_many_arguments)]
    fn verify_drafts(
        &mut self,
        id: RequestId,
        seq: SeqId,
        d: &[u32],
        cached: usize,
        window: usize,
        row: usize,
        draw: &[DeviceSampling],
        logits: &mut Logits,
        step: &mut StepWork,
    ) {
        let vocab = logits.vocab();
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let k = d.len();
        let past = cached.saturating_sub(k + 1);
        let mut rows = if draw.is_empty() {
            match logits.get_mut(row) {
                Some(rows) => VerifyRows::Logits(rows),
                None => return,
            }
        } else {
            VerifyRows::Drawn(logits.tokens(row))
        };
        let mut accepted = 0;
        let mut ended = None;
        for j in 0..=k {
            let Some(generation) = a.generation.as_mut() else {
                break;
            };
            let at = past + 1 + j;
            let outcome = match &mut rows {
                VerifyRows::Logits(rows) => {
                    let Some(row) = rows.get_mut(j * vocab..(j + 1) * vocab) else {
                        break;
                    };
                    draw_on_host(generation, row, at, window)
                }
                VerifyRows::Drawn(tokens) => checked_draw(tokens.get(j).copied().flatten(), vocab)
                    .map(|t| generation.accept_drawn_within(t, at, window)),
            };
            match outcome {
                Ok(outcome) => {
                    let token = outcome.token;
                    if let Some(reason) = deliver(a, outcome, &mut step.report) {
                        ended = Some(Ok(reason));
                        break;
                    }
                    if d.get(j) == Some(&token) {
                        accepted += 1;
                    } else {
                        break;
                    }
                }
                Err(e) => {
                    ended = Some(Err(e));
                    break;
                }
            }
        }
        a.draft.record(k, accepted);
        let keyed = a.keyed;
        let cache_key = a.request.cache_key;
        self.spec_drafted += k as u64;
        self.spec_accepted += accepted as u64;
        step.report.drafted_tokens += k as u64;
        step.report.accepted_tokens += accepted as u64;
        step.report.verifying_sequences += 1;
        if keyed {
            if let Some(slot) =
                cache_key.and_then(|c| self.caches.get_mut(&CacheKey::Conversation(c)))
            {
                slot.drafted += k as u64;
                slot.accepted += accepted as u64;
                slot.verify_steps += 1;
            }
        }
        metrics::counter!("smolchat_spec_drafted_tokens_total").increment(k as u64);
        metrics::counter!("smolchat_spec_accepted_tokens_total").increment(accepted as u64);
        if accepted > 0 {
            step.extra.insert(id, accepted);
        }
        match ended {
            Some(Ok(reason)) => {
                self.finish(id, reason);
                step.report.items.push(ItemReport::ended(id, 0));
            }
            Some(Err(e)) => step.failed.push((id, e)),
            None => {
                let keep = past + 1 + accepted;
                match self.engine.truncate(seq, keep) {
                    Ok(kept) if kept == keep => {}
                    Ok(kept) => step.failed.push((
                        id,
                        format!(
                            "the KV cache kept {kept} of {keep} positions after verifying drafts"
                        ),
                    )),
                    Err(e) => step.failed.push((id, e.to_string())),
                }
            }
        }
    }

    /// Failures: requests admitted without sampling state (bad parameters) fail too (those
    /// waiting to share a prefix, [`ModelWorker::prefix_donor`], have not been admitted); then
    /// every failed request ends with its error.
    fn end_failed(&mut self, plan: &StepPlan, step: &mut StepWork) {
        for &(id, _) in &plan.prefill {
            if self
                .active
                .get(&id)
                .is_some_and(|a| a.seq.is_some() && a.generation.is_none())
            {
                step.failed.push((id, "invalid sampling parameters".into()));
            }
        }
        for (id, msg) in std::mem::take(&mut step.failed) {
            if self.active.contains_key(&id) {
                self.finish(id, StopReason::Error(msg));
                let prefilled = step.prefilled.get(&id).copied().unwrap_or(0);
                step.report.items.push(ItemReport::ended(id, prefilled));
            }
        }
    }

    /// Report: everyone planned and not yet reported says where it stands; accepted drafts
    /// count as extra tokens generated.
    fn report_standing(&mut self, plan: &StepPlan, step: &mut StepWork) {
        let planned = plan
            .decode
            .iter()
            .copied()
            .chain(plan.prefill.iter().map(|p| p.0));
        for id in planned {
            if step.report.items.iter().any(|r| r.id == id) {
                continue;
            }
            let prefilled = step.prefilled.get(&id).copied().unwrap_or(0);
            let item = match self.active.get(&id) {
                Some(a) => ItemReport::running(
                    id,
                    prefilled,
                    // Not admitted yet (waiting for a prefix another request computes): all of
                    // it is still to prefill.
                    match a.seq {
                        Some(_) => a.pending_prompt.len(),
                        None => a.resume.as_ref().map_or(a.request.prompt.len(), Vec::len),
                    },
                ),
                None => ItemReport::ended(id, prefilled),
            };
            step.report.items.push(item);
        }
        for item in &mut step.report.items {
            item.extra_generated = step.extra.get(&item.id).copied().unwrap_or(0);
        }
    }

    /// The step's time (teaching the cost line when it was a plain decode step) and the state
    /// of the caches and the device, into the report.
    fn measure(&mut self, step: StepWork, start: Instant, graph_work: u64) -> StepReport {
        let mut report = step.report;
        let seconds = start.elapsed().as_secs_f64();
        // A step that warmed up or captured a decode graph took many steps' time once: measured,
        // it would make a position look dear and switch drafting off (seen on an H100: the
        // first drafts' new buckets, 1.0 -> 0.91x for one conversation).
        if let Some(positions) = step
            .decode_positions
            .filter(|_| self.graph_work() == graph_work)
        {
            self.step_cost.observe(positions, seconds);
        }
        report.step_ms = seconds * 1e3;
        report.step_cost_ms = self
            .step_cost
            .line()
            .map(|(fixed, per)| (fixed * 1e3, per * 1e3));
        report.draft_break_even = self.step_cost.break_even(1);
        report.kv_bytes = self.engine.total_kv_bytes();
        report.cached_sequences = self.caches.len();
        report.kv_free_blocks = self.kv_free_for_new_work();
        report.evictions = self.evictions;
        report.device_memory = self.device_memory();
        report.graphs = self.engine.graph_stats();
        report
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

/// The engine's form of a generation's device draw (the one place the two meet: the text crate
/// knows no engine).
/// Sends one drawn token's output to the request's listener and counts it; returns why the
/// reply ended, if this token ended it. The one place a generated token leaves the worker.
fn deliver(
    a: &mut Active,
    outcome: smolchat_text::generation::TokenOutcome,
    report: &mut StepReport,
) -> Option<StopReason> {
    a.first_token.get_or_insert_with(Instant::now);
    if outcome.finished != Some(smolchat_text::generation::FinishReason::EndOfGeneration) {
        a.completion_tokens += 1;
        report.generated_tokens += 1;
    }
    a.last_token = Some(outcome.token);
    let text = outcome.text;
    let finished = outcome.finished.map(StopReason::from);
    // An end-of-generation token is not output; only text it flushed (a held-back character or
    // stop-string prefix) is.
    let is_eog = finished == Some(StopReason::EndOfGeneration);
    if !is_eog || !text.is_empty() {
        let _ = a.request.events.send(GenEvent::Token {
            token: outcome.token,
            text,
            logprobs: outcome.logprobs.filter(|_| !is_eog),
        });
    }
    finished
}

/// What a decode with drafts got back to verify them: every position's logits (drawn on the
/// host) or every position's token drawn on the device.
enum VerifyRows<'a> {
    Logits(&'a mut [f32]),
    Drawn(&'a [Option<u32>]),
}

/// Draws a sequence's next token from its logits `row` on the host (the one decode rule,
/// [`Generation::next_token_within`]), recording the grammar mask's time.
fn draw_on_host(
    generation: &mut Generation,
    row: &mut [f32],
    cached: usize,
    window: usize,
) -> Result<smolchat_text::generation::TokenOutcome, String> {
    let outcome = generation
        .next_token_within(row, cached, window)
        .map_err(|e| e.to_string());
    if let Some(t) = generation.take_mask_time() {
        metrics::histogram!("smolchat_grammar_mask_seconds").record(t.as_secs_f64());
    }
    outcome
}

/// A token the device drew, checked: an error when no token had a usable logit or the device
/// drew one outside the vocabulary.
fn checked_draw(token: Option<u32>, vocab: usize) -> Result<u32, String> {
    match token {
        None | Some(NO_TOKEN) => Err("no token has a usable logit (all are NaN or -inf); the \
                                      model output is broken"
            .to_string()),
        Some(token) if token as usize >= vocab => Err(format!(
            "the device drew token {token}, outside the vocabulary of {vocab}"
        )),
        Some(token) => Ok(token),
    }
}

pub fn device_sampling(draw: DeviceDraw) -> DeviceSampling {
    DeviceSampling {
        row: SampleRow {
            temperature: draw.temperature,
            inv_temperature: if draw.temperature > 0.0 {
                1.0 / draw.temperature
            } else {
                0.0
            },
            top_k: draw.top_k,
            top_p: draw.top_p,
            min_p: draw.min_p,
            repetition_penalty: draw.repetition_penalty,
            presence_penalty: draw.presence_penalty,
            frequency_penalty: draw.frequency_penalty,
            uniform: draw.uniform,
        },
        penalties: draw.penalties,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A conversation id for the tests (a fixed one per number).
    fn conversation(n: u128) -> Option<Uuid> {
        Some(Uuid::from_u128(n))
    }
    use smolchat_engine::synthetic::{self, SyntheticSpec};
    use smolchat_engine::{KvOptions, KvType, Model};
    use smolchat_gguf::GgufSource;
    use smolchat_text::sampling::SamplingParams;
    use tokio::sync::mpsc;

    fn worker() -> ModelWorker {
        worker_with_kv(None)
    }

    /// Registers embedding requests and steps them together, each prompt fed in chunks of at
    /// most `chunk` tokens per step, beside `decoding` (a generation request id already
    /// prefilled, kept decoding in the same steps); returns each vector.
    fn embed_together(
        w: &mut ModelWorker,
        prompts: &[(RequestId, Vec<u32>, Pooling)],
        chunk: usize,
        decoding: Option<RequestId>,
    ) -> Vec<Vec<f32>> {
        let mut receivers = Vec::new();
        for (id, prompt, pooling) in prompts {
            let (tx, rx) = mpsc::unbounded_channel();
            w.active.insert(
                *id,
                Active::new(
                    GenerationRequest {
                        cache_key: None,
                        user: None,
                        group: None,
                        cache_salt: None,
                        prompt: prompt.clone(),
                        params: SamplingParams::greedy(),
                        max_time: None,
                        events: tx,
                        embed: Some(*pooling),
                    },
                    Instant::now(),
                ),
            );
            receivers.push(rx);
        }
        let mut open: Vec<RequestId> = prompts.iter().map(|p| p.0).collect();
        for _ in 0..100 {
            if open.is_empty() {
                break;
            }
            let plan = StepPlan {
                prefill: open.iter().map(|&id| (id, chunk)).collect(),
                decode: decoding.into_iter().collect(),
                ..StepPlan::default()
            };
            let report = w.step(plan);
            open.retain(|id| !report.items.iter().any(|r| r.id == *id && r.finished));
        }
        receivers
            .into_iter()
            .map(|mut rx| {
                let mut vector = None;
                let mut finished = None;
                while let Ok(e) = rx.try_recv() {
                    match e {
                        GenEvent::Embedding(v) => vector = Some(v),
                        GenEvent::Finished(s) => finished = Some(s),
                        GenEvent::Token { .. } => panic!("an embedding generates no token"),
                        GenEvent::Admitted { cached_tokens, .. } => assert_eq!(cached_tokens, 0),
                    }
                }
                let summary = finished.expect("finished");
                assert_eq!(summary.reason, StopReason::EndOfGeneration);
                assert_eq!(summary.completion_tokens, 0);
                vector.expect("an embedding comes before Finished")
            })
            .collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// An embedding is the mean (or last) of the final hidden states the engine computes,
    /// L2-normalized; the same alone, beside other embeddings and a decoding reply, and fed in
    /// chunks; it leaves no cache behind and is not served from one.
    #[test]
    fn embeddings_pool_the_final_hidden_states_alone_batched_and_chunked() {
        let mut w = worker();
        let prompt: Vec<u32> = (200..237).collect();
        let other: Vec<u32> = (400..420).collect();

        // What the engine itself gives, pooled by hand.
        let seq = w.engine.create_sequence();
        let mut out = Logits::new();
        w.engine
            .step_into(
                &[SeqStep {
                    seq,
                    tokens: &prompt,
                    logits: LogitsMode::Hidden,
                }],
                &mut out,
            )
            .expect("step");
        w.engine.free_sequence(seq);
        let width = out.hidden_width();
        assert_eq!(width, w.engine.config().hidden);
        let rows = out.hidden(0).expect("hidden rows");
        assert_eq!(rows.len(), prompt.len() * width);
        assert!(out.get(0).is_none(), "no logits for a hidden-state item");
        let normalize = |v: Vec<f64>| {
            let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            v.iter().map(|x| (x / n) as f32).collect::<Vec<f32>>()
        };
        let mean = normalize(
            (0..width)
                .map(|c| rows.chunks(width).map(|r| r[c] as f64).sum::<f64>() / prompt.len() as f64)
                .collect(),
        );
        let last = normalize(
            rows[rows.len() - width..]
                .iter()
                .map(|&x| x as f64)
                .collect(),
        );

        let alone = embed_together(&mut w, &[(1, prompt.clone(), Pooling::Mean)], 1000, None);
        assert!(
            max_diff(&alone[0], &mean) < 1e-6,
            "{}",
            max_diff(&alone[0], &mean)
        );
        let norm: f32 = alone[0].iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "L2-normalized: {norm}");
        let caches = w.caches.len();

        // Beside a reply being decoded and another embedding, in chunks of 5.
        let reply = run(&mut w, 2, None, (300..310).collect());
        assert!(!reply.is_empty());
        let (tx, _rx) = mpsc::unbounded_channel();
        w.active.insert(
            3,
            Active::new(
                GenerationRequest {
                    cache_key: None,
                    user: None,
                    group: None,
                    cache_salt: None,
                    prompt: (500..510).collect(),
                    params: SamplingParams {
                        max_new_tokens: 50,
                        ignore_eos: true,
                        ..SamplingParams::greedy()
                    },
                    max_time: None,
                    events: tx,
                    embed: None,
                },
                Instant::now(),
            ),
        );
        w.step(StepPlan {
            prefill: vec![(3, 1000)],
            ..StepPlan::default()
        });
        let together = embed_together(
            &mut w,
            &[
                (4, other.clone(), Pooling::Mean),
                (5, prompt.clone(), Pooling::Mean),
                (6, prompt.clone(), Pooling::Last),
            ],
            5,
            Some(3),
        );
        assert!(
            max_diff(&together[1], &alone[0]) < 1e-5,
            "{}",
            max_diff(&together[1], &alone[0])
        );
        assert!(
            max_diff(&together[2], &last) < 1e-5,
            "{}",
            max_diff(&together[2], &last)
        );
        assert!(
            max_diff(&together[0], &alone[0]) > 1e-3,
            "another text, another vector"
        );
        // The same prompt again is computed afresh (no cached prefix has hidden states), and
        // no embedding left a cache to reuse.
        let again = embed_together(&mut w, &[(7, prompt.clone(), Pooling::Mean)], 1000, None);
        assert!(max_diff(&again[0], &alone[0]) < 1e-6);
        assert!(
            w.caches.len() <= caches + 1,
            "only the reply's cache was kept"
        );
        assert!(w.caches.values().all(|slot| w.engine.contains(slot.seq)));
    }

    /// The GPU's fast tier (its CPU runner) gives the CPU engine's embedding, and no logits are
    /// computed for it (its plan stops at the output norm).
    #[test]
    fn the_fast_tier_embeds_like_the_cpu_engine() {
        let (spec, tokenizer) = tiny_with_tokenizer();
        let spec = spec.with_type_mix(smolchat_engine::synthetic::TypeMix::Uniform(
            smolchat_gguf::GgmlDType::Q8_0,
        ));
        let mut src = synthetic::build(&spec).expect("build");
        let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
        let mut cpu = ModelWorker::new(Engine::new(model), Arc::new(tokenizer), 2048);
        let mut fast = fast_tier_worker(None);
        let prompts = [
            (1, (200..260).collect::<Vec<u32>>(), Pooling::Mean),
            (2, (900..911).collect(), Pooling::Last),
        ];
        let a = embed_together(&mut cpu, &prompts, 16, None);
        let b = embed_together(&mut fast, &prompts, 16, None);
        for (x, y) in a.iter().zip(&b) {
            // Unit vectors: their dot product is the cosine. The fast tier quantizes activations
            // to Q8_1 where the CPU engine uses its own tiles, so they agree closely, not exactly.
            let cosine: f32 = x.iter().zip(y).map(|(p, q)| p * q).sum();
            assert!(cosine > 0.9999, "cosine {cosine}");
            assert!(max_diff(x, y) < 5e-3, "{}", max_diff(x, y));
        }
    }

    /// A worker on a tiny model; with `Some(n)`, an engine and budget of exactly `n` KV blocks.
    fn worker_with_kv(blocks: Option<usize>) -> ModelWorker {
        let (spec, tokenizer) = tiny_with_tokenizer();
        let mut src = synthetic::build(&spec).expect("build");
        let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
        match blocks {
            None => ModelWorker::new(Engine::new(model), Arc::new(tokenizer), 2048),
            Some(n) => {
                let kv = smolchat_engine::kv::KvLayout::new(&model.config, KvType::F16);
                let budget = n * kv.bytes_per_block();
                let options = KvOptions {
                    kv_type: KvType::F16,
                    budget_bytes: Some(budget),
                };
                let engine = Engine::with_kv(model, options).expect("engine");
                ModelWorker::new(engine, Arc::new(tokenizer), 2048)
            }
        }
    }

    /// A tiny random model with SmolLM2's vocabulary, and that tokenizer.
    fn tiny_with_tokenizer() -> (SyntheticSpec, Tokenizer) {
        // The repository's models/ folder, two levels above this crate.
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let real = GgufSource::open(&path).expect("run ./scripts/fetch-model.sh");
        let tokenizer = Tokenizer::from_gguf(&real).expect("tokenizer");
        let spec = SyntheticSpec::tiny("llama")
            .with_tokenizer_from(&real)
            .expect("spec");
        (spec, tokenizer)
    }

    /// A worker over the GPU's fast tier executed by its CPU runner (the kernels' twins), on a
    /// Q8_0 tiny model; with `Some(n)`, a cache of exactly `n` blocks.
    fn fast_tier_worker(blocks: Option<usize>) -> ModelWorker {
        use smolchat_engine::fast::{cpu::CpuRunner, weights::FastWeights, FastBackend};
        let (spec, tokenizer) = tiny_with_tokenizer();
        let spec = spec.with_type_mix(smolchat_engine::synthetic::TypeMix::Uniform(
            smolchat_gguf::GgmlDType::Q8_0,
        ));
        let mut src = synthetic::build(&spec).expect("build");
        let config = smolchat_engine::ModelConfig::from_gguf(&src).expect("config");
        let weights = FastWeights::load(&mut src, config, &mut |_, _| {}).expect("weights");
        let backend = Box::new(FastBackend::new(
            CpuRunner::new(weights).with_graph_emulation(),
        ));
        let budget = blocks.map(|n| n * smolchat_engine::Backend::kv_block_bytes(backend.as_ref()));
        let engine = Engine::on_backend(
            backend,
            KvOptions {
                kv_type: KvType::F16,
                budget_bytes: budget,
            },
        )
        .expect("engine");
        ModelWorker::new(engine, Arc::new(tokenizer), 2048)
    }

    /// Runs one request to the end; returns its events.
    fn run(
        w: &mut ModelWorker,
        id: RequestId,
        key: Option<Uuid>,
        prompt: Vec<u32>,
    ) -> Vec<GenEvent> {
        run_salted(w, id, key, None, prompt)
    }

    fn run_salted(
        w: &mut ModelWorker,
        id: RequestId,
        key: Option<Uuid>,
        salt: Option<&str>,
        prompt: Vec<u32>,
    ) -> Vec<GenEvent> {
        let params = SamplingParams {
            max_new_tokens: 3,
            ignore_eos: true,
            ..SamplingParams::greedy()
        };
        run_with(w, id, key, salt, prompt, params)
    }

    /// Runs one request with `params` to its end (prefill, then decode steps) and returns its
    /// events.
    fn run_with(
        w: &mut ModelWorker,
        id: RequestId,
        key: Option<Uuid>,
        salt: Option<&str>,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Vec<GenEvent> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        w.active.insert(
            id,
            Active::new(
                GenerationRequest {
                    cache_key: key,
                    cache_salt: salt.map(str::to_string),
                    ..GenerationRequest::anonymous(prompt, params, tx)
                },
                Instant::now(),
            ),
        );
        let mut plan = StepPlan {
            prefill: vec![(id, 1000)],
            ..StepPlan::default()
        };
        // Ends by itself well before: the bound only stops a runaway test.
        for _ in 0..30 {
            let report = w.step(plan);
            if report.items.iter().any(|r| r.id == id && r.finished) {
                break;
            }
            plan = StepPlan {
                decode: vec![id],
                // Room for drafts, used only by a worker with speculation on.
                draft_budget: 8,
                ..StepPlan::default()
            };
        }
        let mut events = Vec::new();
        while let Ok(e) = rx.try_recv() {
            events.push(e);
        }
        events
    }

    fn cached(events: &[GenEvent]) -> usize {
        events
            .iter()
            .find_map(|e| match e {
                GenEvent::Admitted { cached_tokens, .. } => Some(*cached_tokens),
                _ => None,
            })
            .expect("admitted")
    }

    #[test]
    fn caches_are_kept_per_conversation_and_for_stateless_prefixes() {
        let mut w = worker();
        let prompt: Vec<u32> = (100..120).collect();
        let first = run(&mut w, 1, None, prompt.clone());
        assert_eq!(cached(&first), 0);
        assert!(matches!(first.last(), Some(GenEvent::Finished(s)) if s.completion_tokens == 3));

        // A stateless request resending the same conversation plus more reuses the kept prefix.
        let mut longer = prompt.clone();
        longer.extend(200..205);
        assert_eq!(cached(&run(&mut w, 2, None, longer)), 20);

        // A conversation's cache survives between its turns.
        assert_eq!(cached(&run(&mut w, 3, conversation(1), prompt.clone())), 0);
        let mut turn2 = prompt.clone();
        turn2.extend(300..304);
        assert_eq!(cached(&run(&mut w, 4, conversation(1), turn2)), 20);

        // Evicting it forces a full prefill.
        assert!(w.forget_conversation(Uuid::from_u128(1)));
        assert_eq!(cached(&run(&mut w, 5, conversation(1), prompt)), 0);
    }

    #[test]
    fn stateless_caches_are_reused_only_within_their_salt() {
        let mut w = worker();
        let secret: Vec<u32> = (100..130).collect();
        let first = run_salted(&mut w, 1, None, Some("alice"), secret.clone());
        assert_eq!(cached(&first), 0);
        let mut probe = secret.clone();
        probe.push(7);
        // Another client (another salt, or none) shares nothing with Alice's cache.
        assert_eq!(
            cached(&run_salted(&mut w, 2, None, Some("bob"), probe.clone())),
            0
        );
        assert_eq!(cached(&run_salted(&mut w, 3, None, None, probe.clone())), 0);
        // A salt that extends Alice's as a string is still another partition.
        assert_eq!(
            cached(&run_salted(&mut w, 4, None, Some("alice/"), probe.clone())),
            0
        );
        // Alice herself reuses her prefix.
        assert_eq!(
            cached(&run_salted(&mut w, 5, None, Some("alice"), probe)),
            30
        );
    }

    /// With a budget of 3 KV blocks (48 positions): an idle conversation is evicted to make room
    /// for another, and a prompt larger than the whole budget (the batcher refuses those at
    /// submit; here the worker is driven directly) ends its request with a clear error instead of
    /// crashing the worker, which keeps serving afterwards.
    #[test]
    fn a_full_kv_cache_evicts_idle_caches_then_refuses_with_an_error() {
        let mut w = worker_with_kv(Some(3));
        assert_eq!(w.engine.kv_capacity_blocks(), 3);
        let prompt_a: Vec<u32> = (100..120).collect(); // 20 + 3 generated: 2 blocks
        let prompt_b: Vec<u32> = (200..220).collect();
        let a = run(&mut w, 1, conversation(2), prompt_a.clone());
        assert!(matches!(a.last(), Some(GenEvent::Finished(s)) if s.reason == StopReason::Length));
        assert_eq!(w.engine.kv_free_blocks(), 1);
        let b = run(&mut w, 2, conversation(3), prompt_b.clone());
        assert!(matches!(b.last(), Some(GenEvent::Finished(s)) if s.reason == StopReason::Length));
        assert_eq!(w.evictions, 1, "a's idle cache made room for b");
        assert!(!w
            .caches
            .contains_key(&CacheKey::Conversation(Uuid::from_u128(2))));
        // b's cache survived and is reused.
        let mut b2 = prompt_b.clone();
        b2.extend(300..304);
        assert_eq!(cached(&run(&mut w, 3, conversation(3), b2)), 20);

        // 60 prompt tokens need 4 blocks: more than the whole budget.
        let huge: Vec<u32> = (0..60).collect();
        let events = run(&mut w, 4, conversation(4), huge);
        match events.last() {
            Some(GenEvent::Finished(s)) => match &s.reason {
                StopReason::Error(msg) => {
                    assert!(msg.contains("does not fit the KV cache"), "{msg}")
                }
                other => panic!("expected an error, got {other:?}"),
            },
            other => panic!("expected a finished event, got {other:?}"),
        }
        assert!(w.active.is_empty());
        // The worker still serves.
        let again = run(&mut w, 5, conversation(2), prompt_a);
        assert!(matches!(again.last(), Some(GenEvent::Finished(s)) if s.completion_tokens == 3));
    }

    /// Drives `w` with the real batcher over `requests` (prompt, new tokens) submitted together,
    /// as the scheduler does; returns each request's generated tokens, its stop reason, and how
    /// many preemptions happened.
    fn drive(
        w: &mut ModelWorker,
        requests: &[(Vec<u32>, usize)],
    ) -> (Vec<(Vec<u32>, StopReason)>, u64) {
        drive_with(w, requests, &SamplingParams::greedy())
    }

    /// Runs `requests` (prompt, tokens to generate) through a batcher and `w` with `params`.
    fn drive_with(
        w: &mut ModelWorker,
        requests: &[(Vec<u32>, usize)],
        params: &SamplingParams,
    ) -> (Vec<(Vec<u32>, StopReason)>, u64) {
        let requests: Vec<(Vec<u32>, usize, Option<&str>)> = requests
            .iter()
            .map(|(p, n)| (p.clone(), *n, None))
            .collect();
        let driven = drive_all(w, &requests, params);
        let results = driven
            .results
            .into_iter()
            .map(|(tokens, reason, _)| (tokens, reason))
            .collect();
        (results, driven.preemptions)
    }

    /// What [`drive_all`] saw: per request its tokens, why it stopped and how many prompt
    /// tokens came from a cache; the preemptions; the most KV blocks held at once.
    struct Driven {
        results: Vec<(Vec<u32>, StopReason, usize)>,
        preemptions: u64,
        peak_blocks: usize,
    }

    /// Requests through a real batcher, each `(prompt, tokens, cache salt)` (the salt is the
    /// request's user too), sampled with `params` (end of generation ignored), until every one
    /// has finished.
    fn drive_all(
        w: &mut ModelWorker,
        requests: &[(Vec<u32>, usize, Option<&str>)],
        params: &SamplingParams,
    ) -> Driven {
        use super::super::batcher::{Batcher, BatcherConfig};
        let mut b = Batcher::new(BatcherConfig {
            max_running: 8,
            queue_capacity: 16,
            step_token_budget: 64,
            context_window: 2048,
            max_queued_per_user: 0,
            max_running_per_user: 0,
            tokens_per_minute_per_user: 0,
            tokens_per_minute_per_group: 0,
            kv_capacity_blocks: w.kv_capacity_blocks(),
        });
        let mut receivers = Vec::new();
        for (prompt, n, salt) in requests {
            let id = b.submit(None, prompt.len(), None).expect("submit");
            let (tx, rx) = mpsc::unbounded_channel();
            w.active.insert(
                id,
                Active::new(
                    GenerationRequest {
                        user: salt.map(str::to_string),
                        cache_salt: salt.map(str::to_string),
                        ..GenerationRequest::anonymous(
                            prompt.clone(),
                            SamplingParams {
                                max_new_tokens: *n,
                                ignore_eos: true,
                                ..params.clone()
                            },
                            tx,
                        )
                    },
                    Instant::now(),
                ),
            );
            receivers.push(rx);
        }
        let (mut peak_blocks, mut preemptions) = (0, 0);
        for _ in 0..10_000 {
            let Some(plan) = b.plan() else { break };
            let report = w.step(plan);
            preemptions += report.preemptions;
            peak_blocks = peak_blocks.max(w.engine.total_kv_bytes() / w.engine.kv_block_bytes());
            b.apply(&report.items);
            b.set_kv_free_blocks(report.kv_free_blocks);
        }
        let results = receivers
            .into_iter()
            .map(|mut rx| {
                let (mut tokens, mut reason, mut cached) = (Vec::new(), None, 0);
                while let Ok(e) = rx.try_recv() {
                    match e {
                        GenEvent::Token { token, .. } => tokens.push(token),
                        GenEvent::Finished(s) => reason = Some(s.reason),
                        GenEvent::Admitted { cached_tokens, .. } => cached = cached_tokens,
                        GenEvent::Embedding(_) => {}
                    }
                }
                (tokens, reason.expect("every request finishes"), cached)
            })
            .collect();
        Driven {
            results,
            preemptions,
            peak_blocks,
        }
    }

    /// [`drive_all`], greedy: the results and the most KV blocks held at once.
    fn drive_shared(
        w: &mut ModelWorker,
        requests: &[(Vec<u32>, usize, Option<&str>)],
    ) -> (Vec<(Vec<u32>, StopReason, usize)>, usize) {
        let driven = drive_all(w, requests, &SamplingParams::greedy());
        (driven.results, driven.peak_blocks)
    }

    /// Three requests of one prompt from one client (a request's `n` choices) compute its
    /// prefill once: the later two fork the first's whole blocks (held once), and every reply
    /// is token for token the one it gets alone. Another client's identical prompt shares
    /// nothing.
    #[test]
    fn requests_of_one_client_share_the_blocks_of_a_common_prompt() {
        shared_prompt_case(worker);
        // The GPU's fast tier (its CPU runner) reads shared blocks the same way.
        shared_prompt_case(|| fast_tier_worker(None));
    }

    fn shared_prompt_case(worker: impl Fn() -> ModelWorker) {
        let prompt: Vec<u32> = (1000..1100).collect();
        let alone = {
            let mut w = worker();
            drive_shared(&mut w, &[(prompt.clone(), 12, Some("a"))])
                .0
                .remove(0)
        };
        assert_eq!(alone.2, 0);
        let mut w = worker();
        let (results, peak) = drive_shared(
            &mut w,
            &[
                (prompt.clone(), 12, Some("a")),
                (prompt.clone(), 12, Some("a")),
                (prompt.clone(), 12, Some("a")),
            ],
        );
        for (i, (tokens, reason, _)) in results.iter().enumerate() {
            assert_eq!(tokens, &alone.0, "choice {i}");
            assert_eq!(*reason, StopReason::Length);
        }
        assert_eq!(results[0].2, 0);
        // 99 usable prompt positions: 96 in whole blocks.
        assert_eq!((results[1].2, results[2].2), (96, 96));
        // Alone: 112 positions = 7 blocks. Three sharing 6 prompt blocks: 6 + 3 × 2.
        assert!(peak <= 12, "{peak} blocks at the peak");

        let mut w = worker();
        let (results, _) = drive_shared(
            &mut w,
            &[
                (prompt.clone(), 12, Some("a")),
                (prompt.clone(), 12, Some("b")),
            ],
        );
        assert_eq!(
            (results[0].2, results[1].2),
            (0, 0),
            "no sharing across clients"
        );
        assert_eq!(results[1].0, alone.0);
    }

    /// Drives each of `requests` alone on a fresh worker from `alone`, then all of them together
    /// on `pressed`: every reply completes without an error and is token for token the one it got
    /// alone. Returns `pressed`, the replies and how many preemptions it made.
    fn replies_hold_under_pressure(
        alone: impl Fn() -> ModelWorker,
        mut pressed: ModelWorker,
        requests: &[(Vec<u32>, usize)],
    ) -> (ModelWorker, Vec<(Vec<u32>, StopReason)>, u64) {
        let want: Vec<Vec<u32>> = requests
            .iter()
            .map(|req| drive(&mut alone(), std::slice::from_ref(req)).0.remove(0).0)
            .collect();
        let (got, preemptions) = drive(&mut pressed, requests);
        for (i, ((tokens, reason), want)) in got.iter().zip(&want).enumerate() {
            assert!(
                !matches!(reason, StopReason::Error(_)),
                "request {i} failed: {reason:?}"
            );
            assert_eq!(
                tokens, want,
                "request {i}: the reply changed under pressure"
            );
        }
        assert!(preemptions > 0, "the test never preempted anything");
        (pressed, got, preemptions)
    }

    /// Six requests that each fit a 6-block cache alone but not together: every one completes
    /// (some after waiting, some after being preempted and recomputed), none with an error, and
    /// each greedy reply is token for token the one it gets alone in a roomy cache.
    #[test]
    fn under_kv_pressure_requests_wait_or_are_preempted_and_replies_stay_the_same() {
        let requests: Vec<(Vec<u32>, usize)> = (0..6u32)
            .map(|r| ((100 + 40 * r..120 + 40 * r).collect(), 30))
            .collect();
        // 20 prompt + 30 generated = 50 positions: 4 blocks each; 6 blocks hold one at a time
        // at its end, but two fit at their start, so the second is preempted as they grow.
        let (w, replies, _) =
            replies_hold_under_pressure(worker, worker_with_kv(Some(6)), &requests);
        for (i, (tokens, _)) in replies.iter().enumerate() {
            assert_eq!(tokens.len(), 30, "request {i}");
        }
        assert!(w.active.is_empty());
    }

    /// Speculating under KV pressure: a request preempted in a step that verifies its drafts
    /// recomputes only what it had accepted (its last sampled token, not the drafts), so every
    /// greedy reply is still token for token the one it gets alone without speculation.
    #[test]
    fn preempted_drafts_are_not_recomputed_as_accepted() {
        let requests: Vec<(Vec<u32>, usize)> = mixed_prompts()
            .into_iter()
            .take(6)
            .map(|(prompt, _)| (prompt, 30))
            .collect();
        let pressed = speculative(worker_with_kv(Some(6)));
        let (w, _, _) = replies_hold_under_pressure(worker, pressed, &requests);
        assert!(w.spec_drafted > 0, "the test never drafted anything");
    }

    /// The same under the GPU's fast tier (its CPU runner): waits and preemptions change no reply.
    #[test]
    fn the_fast_tier_preempts_under_kv_pressure_and_replies_stay_the_same() {
        let requests: Vec<(Vec<u32>, usize)> = (0..4u32)
            .map(|r| ((100 + 40 * r..120 + 40 * r).collect(), 30))
            .collect();
        replies_hold_under_pressure(
            || fast_tier_worker(None),
            fast_tier_worker(Some(6)),
            &requests,
        );
    }

    /// The fast tier draws on its device: greedy replies equal the host's draw from the same
    /// logits, a seeded reply is the same every time and another seed gives another, and
    /// penalties reach the device (a strong repetition penalty changes the greedy reply).
    #[test]
    fn the_fast_tier_draws_tokens_on_its_device() {
        let requests: Vec<(Vec<u32>, usize)> = (0..3u32)
            .map(|r| ((100 + 40 * r..120 + 40 * r).collect(), 12))
            .collect();
        let tokens = |w: &mut ModelWorker, p: &SamplingParams| -> Vec<Vec<u32>> {
            let (got, _) = drive_with(w, &requests, p);
            got.into_iter()
                .map(|(t, reason)| {
                    assert_eq!(reason, StopReason::Length, "{t:?}");
                    t
                })
                .collect()
        };
        let greedy = SamplingParams::greedy();
        assert!(fast_tier_worker(None).engine.samples_on_device());
        let on_device = tokens(&mut fast_tier_worker(None), &greedy);
        let on_host = tokens(&mut fast_tier_worker(None).sample_on_host(), &greedy);
        assert_eq!(on_device, on_host);

        let seeded = |seed| SamplingParams {
            temperature: 1.2,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let a = tokens(&mut fast_tier_worker(None), &seeded(7));
        let b = tokens(&mut fast_tier_worker(None), &seeded(7));
        let c = tokens(&mut fast_tier_worker(None), &seeded(8));
        assert_eq!(a, b, "a seeded reply changed");
        assert_ne!(a, c, "two seeds drew the same replies");
        assert_ne!(a, on_device, "temperature 1.2 drew the greedy replies");

        let penalised = SamplingParams {
            repetition_penalty: 50.0,
            presence_penalty: 5.0,
            penalty_last_n: 64,
            ..SamplingParams::greedy()
        };
        let p_device = tokens(&mut fast_tier_worker(None), &penalised);
        let p_host = tokens(&mut fast_tier_worker(None).sample_on_host(), &penalised);
        assert_eq!(p_device, p_host, "penalties differ between device and host");
        assert_ne!(p_device, on_device, "the penalties changed nothing");
    }

    /// Log-probabilities need the logits on the host: a backend that draws on its device brings
    /// them back for the requests that ask, and each output token carries its own.
    #[test]
    fn logprobs_come_back_from_a_backend_that_draws_on_its_device() {
        let mut w = fast_tier_worker(None);
        assert!(w.engine.samples_on_device());
        let params = SamplingParams {
            max_new_tokens: 5,
            ignore_eos: true,
            logprobs: Some(2),
            ..SamplingParams::greedy()
        };
        let events = run_with(&mut w, 7, None, None, (100..120).collect(), params);
        let mut tokens = 0;
        for e in events {
            if let GenEvent::Token {
                token, logprobs, ..
            } = e
            {
                let lp = logprobs.expect("every token has its log-probabilities");
                assert_eq!(lp.token, token);
                assert_eq!(lp.top.len(), 2);
                // Greedy: the chosen token is the most likely one.
                assert_eq!(lp.top[0].0, token);
                assert!(lp.logprob <= 0.0 && (lp.logprob - lp.top[0].1).abs() < 1e-6);
                tokens += 1;
            }
        }
        assert_eq!(tokens, 5);
    }

    /// Speculation on, drafting whatever a proposer finds (the break-even fixed at zero, not
    /// measured from this machine's timing), in batches of up to eight too.
    fn speculative(w: ModelWorker) -> ModelWorker {
        w.with_speculation(speculation())
    }

    fn speculation() -> SpecConfig {
        SpecConfig {
            enabled: true,
            max_batch: 8,
            fixed_break_even: Some(0.0),
            on_gpu: true,
            ..SpecConfig::default()
        }
    }

    /// Prompts of eight conversations, some repeating themselves (lookups find drafts there),
    /// some not.
    fn mixed_prompts() -> Vec<(Vec<u32>, usize)> {
        let mut prompts = Vec::new();
        for i in 0..8u32 {
            let prompt: Vec<u32> = if i % 2 == 0 {
                // A phrase said three times: what follows is likely said again.
                let phrase: Vec<u32> = (0..6).map(|t| 100 + 7 * i + t).collect();
                phrase
                    .iter()
                    .chain(&phrase)
                    .chain(&phrase)
                    .copied()
                    .collect()
            } else {
                (0..20).map(|t| 300 + 13 * i + 3 * t).collect()
            };
            prompts.push((prompt, 40 + 4 * i as usize));
        }
        prompts
    }

    #[test]
    fn drafts_come_from_the_same_users_earlier_replies_only() {
        // Prompt lookup off (no n-gram is ever looked up in the sequence's own tokens): every
        // draft comes from the user's n-gram cache.
        let mut w = worker().with_speculation(SpecConfig {
            enabled: true,
            max_ngram: 0,
            min_ngram: 0,
            fixed_break_even: Some(0.0),
            on_gpu: true,
            ..SpecConfig::default()
        });
        let prompt: Vec<u32> = (0..12).map(|t| 200 + 5 * t).collect();
        let greedy = SamplingParams::greedy();
        let reply = |w: &mut ModelWorker, user: &str| {
            let driven = drive_all(w, &[(prompt.clone(), 40, Some(user))], &greedy);
            driven.results[0].0.clone()
        };
        let plain = reply(&mut worker(), "alice");
        assert_eq!(reply(&mut w, "alice"), plain);
        assert_eq!(
            w.spec_drafted, 0,
            "nothing learned before the first reply ended"
        );
        assert_eq!(reply(&mut w, "bob"), plain);
        assert_eq!(w.spec_drafted, 0, "nothing of alice's is drafted for bob");
        assert_eq!(reply(&mut w, "alice"), plain, "the same reply with drafts");
        println!(
            "alice's second reply: {} drafted, {} accepted",
            w.spec_drafted, w.spec_accepted
        );
        assert!(w.spec_accepted > 0, "drafted {}", w.spec_drafted);
    }

    /// A reply asked for its log-probabilities is the same with drafts verified: each token
    /// carries the log-probabilities of its own row of the verifying step, as plain decoding's.
    #[test]
    fn log_probabilities_are_the_same_with_speculation() {
        let phrase: Vec<u32> = (0..6).map(|t| 140 + 3 * t).collect();
        let prompt: Vec<u32> = phrase.iter().cycle().take(18).copied().collect();
        let params = SamplingParams {
            max_new_tokens: 24,
            ignore_eos: true,
            logprobs: Some(3),
            ..SamplingParams::greedy()
        };
        let run = |w: &mut ModelWorker| {
            let mut tokens = Vec::new();
            for e in run_with(w, 9, None, None, prompt.clone(), params.clone()) {
                if let GenEvent::Token {
                    token, logprobs, ..
                } = e
                {
                    let lp = logprobs.expect("every token has its log-probabilities");
                    assert_eq!(lp.token, token);
                    tokens.push((token, lp.logprob, lp.top));
                }
            }
            tokens
        };
        let plain = run(&mut worker());
        let mut w = speculative(worker());
        let drafted = run(&mut w);
        assert!(
            w.spec_accepted > 0,
            "drafts were accepted ({} drafted)",
            w.spec_drafted
        );
        assert_eq!(plain.len(), 24);
        assert_eq!(plain.len(), drafted.len());
        for (i, (a, b)) in plain.iter().zip(&drafted).enumerate() {
            assert_eq!(a.0, b.0, "token {i}");
            assert!((a.1 - b.1).abs() < 1e-5, "token {i}: {} vs {}", a.1, b.1);
            assert_eq!(a.2.len(), 3);
            for (x, y) in a.2.iter().zip(&b.2) {
                assert_eq!(x.0, y.0, "token {i}'s alternatives");
                assert!((x.1 - y.1).abs() < 1e-5, "token {i}: {x:?} vs {y:?}");
            }
        }
    }

    #[test]
    fn greedy_replies_are_the_same_with_speculation_and_drafts_are_accepted() {
        let requests = mixed_prompts();
        let greedy = SamplingParams::greedy();
        let (plain, _) = drive_with(&mut worker(), &requests, &greedy);
        let mut w = speculative(worker());
        let (spec, _) = drive_with(&mut w, &requests, &greedy);
        assert_eq!(plain, spec, "the same tokens, request by request");
        println!(
            "greedy, 8 conversations: {} drafted, {} accepted",
            w.spec_drafted, w.spec_accepted
        );
        assert!(w.spec_drafted > 0, "drafts were verified");
        assert!(
            w.spec_accepted > 0,
            "some drafts were accepted ({} drafted)",
            w.spec_drafted
        );
        // One request alone too (the batch of one, where speculation pays most).
        let (alone, _) = drive_with(&mut worker(), &requests[..1], &greedy);
        let (alone_spec, _) = drive_with(&mut speculative(worker()), &requests[..1], &greedy);
        assert_eq!(alone, alone_spec);
    }

    /// A step that warmed up or captured a decode graph says nothing of what a step costs (a
    /// capture takes many steps' time): only eager and replayed steps are measured.
    #[test]
    fn steps_that_make_decode_graphs_are_not_measured() {
        let mut w = fast_tier_worker(None);
        let prompt: Vec<u32> = (0..12).map(|t| 200 + 5 * t).collect();
        // The prompt's step, then one decode: the one-row bucket's warm-up.
        w.generate_alone(prompt.clone(), 2);
        let g = w
            .engine
            .graph_stats()
            .expect("the fast tier keeps graph statistics");
        assert_eq!((g.warmups, g.replays), (1, 0), "{g:?}");
        assert_eq!(w.step_cost.line(), None, "a warm-up step was measured");
        // Its capture, then replays: those are measured.
        w.generate_alone(prompt, 8);
        let g = w.engine.graph_stats().expect("graph statistics");
        assert!(g.captures >= 1 && g.replays >= 1, "{g:?}");
        assert!(
            w.step_cost.line().is_some(),
            "replayed steps were not measured"
        );
    }

    /// On a backend whose kernels compute a row alike only within a class of step sizes (the
    /// GPU's), drafts never take a step out of its class: a lone conversation still drafts (up
    /// to 3 positions), a step of 5-8 sequences grows to 8 rows at most, and the replies are the
    /// ones plain decoding gives.
    #[test]
    fn drafts_keep_a_step_within_the_rows_its_kernels_compute_alike() {
        let classes = || {
            let (spec, tokenizer) = tiny_with_tokenizer();
            let mut src = synthetic::build(&spec).expect("build");
            let model = Model::load(&mut src, &mut |_, _| {}).expect("load");
            // The CPU backend, saying of its rows what the CUDA kernels say, and recording each
            // verifying step's (sequences, rows): only a decode verifying drafts asks for
            // every position's logits here.
            let verifying = Arc::new(std::sync::Mutex::new(Vec::new()));
            let seen = verifying.clone();
            let backend = smolchat_engine::backend::Watched {
                inner: Box::new(smolchat_engine::CpuBackend::f16(model)),
                watch: Box::new(move |asked| {
                    if let smolchat_engine::backend::Asked::Forward(items) = asked {
                        let all = |i: &smolchat_engine::backend::BatchItem<'_>| {
                            i.tokens.len() > 1 && matches!(i.logits, LogitsMode::All)
                        };
                        if items.iter().any(all) {
                            let rows: usize = items.iter().map(|i| i.tokens.len()).sum();
                            if let Ok(mut v) = seen.lock() {
                                v.push((items.len(), rows));
                            }
                        }
                    }
                }),
                rows_alike: Some(smolchat_engine::fast::launch::rows_computed_alike),
            };
            let engine =
                Engine::on_backend(Box::new(backend), KvOptions::default()).expect("engine");
            (
                ModelWorker::new(engine, Arc::new(tokenizer), 2048),
                verifying,
            )
        };
        let greedy = SamplingParams::greedy();
        let requests = mixed_prompts();
        for conversations in [1, 8] {
            let requests = &requests[..conversations];
            let (plain, _) = drive_with(&mut worker(), requests, &greedy);
            let (w, verifying) = classes();
            let mut w = speculative(w);
            let (spec, _) = drive_with(&mut w, requests, &greedy);
            assert_eq!(
                plain, spec,
                "{conversations} conversations: the same replies"
            );
            let steps = verifying.lock().map(|v| v.clone()).unwrap_or_default();
            assert!(
                !steps.is_empty() && w.spec_accepted > 0,
                "{conversations} conversations: drafts verified in {} steps, {} accepted",
                steps.len(),
                w.spec_accepted
            );
            for &(sequences, rows) in &steps {
                let most = smolchat_engine::fast::launch::rows_computed_alike(sequences);
                assert!(
                    sequences <= 8 && rows <= most,
                    "{conversations} conversations: a step of {sequences} sequences verified \
                     drafts in {rows} rows (at most {most} keep each row's arithmetic)"
                );
            }
        }
    }

    #[test]
    fn the_fast_tier_verifies_drafts_with_the_same_replies() {
        // The GPU's fast tier, run by its kernels' CPU twins: every position's logits of a
        // decode with drafts, and the truncation after it, give the replies plain decoding
        // gives.
        same_with_speculation(
            || fast_tier_worker(None),
            speculation(),
            &mixed_prompts(),
            &SamplingParams::greedy(),
        );
    }

    /// Drives `requests` on a worker from `make` with drafts off, then on (`spec`): the replies
    /// must be the same and some drafts accepted. Both workers come back.
    fn same_with_speculation(
        make: impl Fn() -> ModelWorker,
        spec: SpecConfig,
        requests: &[(Vec<u32>, usize)],
        params: &SamplingParams,
    ) -> (ModelWorker, ModelWorker) {
        let mut plain_worker = make();
        let (plain, _) = drive_with(&mut plain_worker, requests, params);
        let mut w = make().with_speculation(spec);
        let (drafted, _) = drive_with(&mut w, requests, params);
        assert_eq!(plain, drafted);
        assert!(
            w.spec_drafted > 0 && w.spec_accepted > 0,
            "{} / {}",
            w.spec_accepted,
            w.spec_drafted
        );
        (plain_worker, w)
    }

    #[test]
    fn the_fast_tier_verifies_drafts_on_the_device_with_the_same_seeded_replies() {
        // On the fast tier (its kernels' CPU twins, graphs emulated) a decode with drafts is
        // drawn on the device row by row (LogitsMode::SampleAll) inside a decode graph: each row
        // takes the uniform plain decoding would take, and only for the tokens kept, so seeded
        // replies with a repetition penalty are the same token for token.
        let params = SamplingParams {
            temperature: 0.35,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.05,
            seed: Some(77),
            ..SamplingParams::greedy()
        };
        // Four conversations (two repeating themselves) keep it quick in a debug build; single-
        // token lookups too, as sampled replies repeat themselves less than greedy ones.
        let (plain_worker, w) = same_with_speculation(
            || fast_tier_worker(None),
            SpecConfig {
                min_ngram: 1,
                ..speculation()
            },
            &mixed_prompts()[..4],
            &params,
        );
        let stats = w.engine.graph_stats().unwrap_or_default();
        let plain_stats = plain_worker.engine.graph_stats().unwrap_or_default();
        // Each verifying step is one decode graph step in place of several (the engine's own
        // test checks that such a step replays a decode graph). Graphs are recaptured a few
        // times more than without drafts: a verifying step has more rows than any plain step,
        // and the runner's buffers grow to the largest step seen.
        assert!(
            stats.replays > 0
                && stats.replays + stats.captures + stats.warmups
                    < plain_stats.replays + plain_stats.captures + plain_stats.warmups,
            "fewer decode graph steps with drafts: {stats:?} against {plain_stats:?}"
        );
    }

    #[test]
    fn sampling_with_speculation_keeps_the_distribution() {
        // Many seeded draws of one repetitive prompt, with and without speculation. Drawing
        // each row from the model's own distribution and keeping a draft only when the draw
        // equals it is the rejection rule for a draft of probability 1, so the distribution is
        // the model's, and seeded replies are even the same token for token.
        let (prompt, _) = mixed_prompts()[0].clone();
        let mut plain_hist: HashMap<(usize, u32), u32> = HashMap::new();
        let mut spec_hist: HashMap<(usize, u32), u32> = HashMap::new();
        let mut same = 0;
        let mut total = 0;
        let mut w_plain = worker();
        // Single-token lookups too: sampled replies repeat themselves less than greedy ones.
        let mut w_spec = worker().with_speculation(SpecConfig {
            min_ngram: 1,
            ..speculation()
        });
        for batch in 0..20u64 {
            let params = SamplingParams {
                temperature: 0.35,
                top_k: 0,
                top_p: 1.0,
                seed: Some(1000 + batch),
                ..SamplingParams::greedy()
            };
            let requests: Vec<(Vec<u32>, usize)> = (0..8u32)
                .map(|i| {
                    let mut p = prompt.clone();
                    // A different last token per request, so the eight differ.
                    p.push(500 + i);
                    (p, 10)
                })
                .collect();
            let (a, _) = drive_with(&mut w_plain, &requests, &params);
            let (b, _) = drive_with(&mut w_spec, &requests, &params);
            for ((ta, _), (tb, _)) in a.iter().zip(&b) {
                total += 1;
                same += u32::from(ta == tb);
                for (pos, t) in ta.iter().enumerate() {
                    *plain_hist.entry((pos, *t)).or_default() += 1;
                }
                for (pos, t) in tb.iter().enumerate() {
                    *spec_hist.entry((pos, *t)).or_default() += 1;
                }
            }
        }
        assert!(
            w_spec.spec_drafted > 0 && w_spec.spec_accepted > 0,
            "drafts were verified ({}) and some accepted ({})",
            w_spec.spec_drafted,
            w_spec.spec_accepted
        );
        // Total variation distance per position, over the 160 draws.
        for pos in 0..10 {
            let keys: std::collections::HashSet<u32> = plain_hist
                .keys()
                .chain(spec_hist.keys())
                .filter(|k| k.0 == pos)
                .map(|k| k.1)
                .collect();
            let tv: f64 = keys
                .iter()
                .map(|t| {
                    let a = f64::from(*plain_hist.get(&(pos, *t)).unwrap_or(&0));
                    let b = f64::from(*spec_hist.get(&(pos, *t)).unwrap_or(&0));
                    (a - b).abs()
                })
                .sum::<f64>()
                / 2.0
                / f64::from(total);
            assert!(tv < 0.1, "position {pos}: total variation {tv}");
        }
        println!(
            "sampled: {same} of {total} seeded replies equal; {} drafted, {} accepted",
            w_spec.spec_drafted, w_spec.spec_accepted
        );
        assert!(
            f64::from(same) / f64::from(total) > 0.95,
            "{same} of {total} seeded replies equal"
        );
    }

    #[test]
    fn grammar_masks_computed_during_the_step_give_the_same_reply() {
        let reply = |overlap: bool| -> (String, Vec<StopReason>) {
            let mut w = fast_tier_worker(None).with_mask_overlap(overlap);
            let params = SamplingParams {
                max_new_tokens: 20,
                grammar: Some(smolchat_text::constraint::Grammar::Regex(
                    "[a-z]{3,6}".into(),
                )),
                ..SamplingParams::greedy()
            };
            let mut text = String::new();
            let mut reasons = Vec::new();
            for e in run_with(&mut w, 9, None, None, (100..120).collect(), params) {
                match e {
                    GenEvent::Token { text: t, .. } => text.push_str(&t),
                    GenEvent::Finished(s) => reasons.push(s.reason),
                    GenEvent::Admitted { .. } | GenEvent::Embedding(_) => {}
                }
            }
            (text, reasons)
        };
        let (serial, serial_end) = reply(false);
        let (overlapped, overlapped_end) = reply(true);
        assert_eq!(serial, overlapped);
        assert_eq!(serial_end, vec![StopReason::EndOfGeneration]);
        assert_eq!(overlapped_end, serial_end);
        assert!(
            (3..=6).contains(&serial.len()) && serial.chars().all(|c| c.is_ascii_lowercase()),
            "{serial:?}"
        );
    }
}
