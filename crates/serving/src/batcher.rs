//! The scheduler's state machine, free of actors and of the model so it can be tested directly.
//!
//! Continuous batching: every step carries one decode token for each generating sequence, then
//! prefill chunks of admitted sequences up to the step's token budget (chunked prefill, so a long
//! prompt never holds running streams back for more than one step), then admits waiting requests
//! while there is room. The model worker reports back after each step.
//!
//! Fair sharing: a request carries the user it is for (an account, a guest, an API key; opaque
//! here). Admission takes the waiting request of the user with the fewest running sequences
//! (first come first within a tie), so one user with a hundred requests queued cannot hold every
//! batch slot while another waits; per-user caps on queued and running requests bound what one
//! user can hold at all, and a user over the queued cap is refused with [`SubmitError::UserLimit`]
//! (429) while the global queue being full stays [`SubmitError::Overloaded`] (503).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::types::WarmStats;
use super::types::{RequestId, SequenceState, SubmitError};
use super::warm::{Draft, WarmConfig, WarmQueue, WarmRefused};
use super::window::SlidingWindow;

#[derive(Debug, Clone)]
pub struct BatcherConfig {
    /// Sequences prefilling or generating at once.
    pub max_running: usize,
    /// Requests waiting for a slot; beyond this, submissions are refused as overload.
    pub queue_capacity: usize,
    /// Tokens per step (decode tokens plus prefill chunks).
    pub step_token_budget: usize,
    /// The model's context window.
    pub context_window: usize,
    /// Requests one user may have waiting (0: no per-user cap).
    pub max_queued_per_user: usize,
    /// Sequences one user may have running (0: no per-user cap).
    pub max_running_per_user: usize,
    /// Tokens one user may have generated over the last minute before a new request of theirs
    /// is refused (0: no limit).
    pub tokens_per_minute_per_user: u64,
    /// The same for a request's group (a guest's address) together (0: no limit).
    pub tokens_per_minute_per_group: u64,
    /// KV cache blocks (of [`BLOCK_POSITIONS`] positions) the model worker has in all (0:
    /// unknown, no KV planning). A prompt that cannot fit even in an empty cache is refused at
    /// submit; others wait until their blocks are free.
    pub kv_capacity_blocks: usize,
    /// Warming drafts in spare steps (see [`crate::warm`]).
    pub warm: WarmConfig,
}

/// Positions per KV block (the engine's allocator unit).
use smolchat_engine::kv::BLOCK_POSITIONS;

/// The window per-user token usage is counted over.
const TOKEN_WINDOW: Duration = Duration::from_secs(60);
/// Usage is kept in buckets this long, so a user costs at most 60 entries however fast they go.
const TOKEN_BUCKET: Duration = Duration::from_secs(1);
/// Users whose usage is remembered at most; beyond it the oldest-used are forgotten (bounded
/// memory against a flood of made-up users).
const TOKEN_USERS: usize = 100_000;

/// Tokens per user (and per group) over the last minute, shared by the batchers of every model
/// a server runs: a user's tokens count once against `limits.tokens_per_minute_per_user`,
/// whatever model computed them. A clone is the same meter.
#[derive(Clone)]
pub struct TokenMeter(std::sync::Arc<std::sync::Mutex<SlidingWindow<String>>>);

impl Default for TokenMeter {
    fn default() -> Self {
        Self(std::sync::Arc::new(std::sync::Mutex::new(
            SlidingWindow::new(TOKEN_WINDOW, TOKEN_BUCKET, TOKEN_USERS),
        )))
    }
}

impl std::fmt::Debug for TokenMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenMeter")
    }
}

impl TokenMeter {
    fn window(&self) -> std::sync::MutexGuard<'_, SlidingWindow<String>> {
        // A panic elsewhere while it was held leaves counts that are still counts.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn used(&self, key: &str, now: Instant) -> u64 {
        self.window().used(key, now)
    }

    fn retry_after_s(&self, key: &str, n: u64, limit: u64, now: Instant) -> u64 {
        self.window().retry_after_s(key, n, limit, now)
    }

    fn add(&self, key: &str, n: u64, now: Instant) {
        self.window().add(key, n, now)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Prefilling,
    Decoding,
}

#[derive(Debug, Clone)]
struct Entry {
    id: RequestId,
    cache_key: Option<Uuid>,
    /// Who the work is for; `None` (tools, tests) counts as one anonymous user without caps.
    user: Option<String>,
    /// The user's group with a token quota of its own (`group:`-prefixed), if any.
    group: Option<String>,
    /// Prompt tokens still to prefill. Starts at the prompt length (an upper bound: the worker
    /// may find a cached prefix) and is corrected by the worker's reports.
    remaining_prefill: usize,
    phase: Phase,
    deadline: Option<Instant>,
    /// Chores (a title written by the task model): admitted only when no other request waits,
    /// and never into the last free slot.
    background: bool,
}

/// The work of one step, as the scheduler decides it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Requests to end before the step (stopped, timed out, or cancelled while queued).
    pub cancel: Vec<RequestId>,
    /// Generating requests: one decode token each.
    pub decode: Vec<RequestId>,
    /// Prefilling requests and the most prompt tokens each may process in this step.
    pub prefill: Vec<(RequestId, usize)>,
    /// Positions of the step's token budget left over, which decoding requests may fill with
    /// draft tokens to verify (speculative decoding).
    pub draft_budget: usize,
    /// A typed draft to start warming in this step (its chunk is in `prefill`): the worker
    /// makes its request (see [`crate::warm`]).
    pub warm_start: Option<(RequestId, Draft)>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.cancel.is_empty() && self.decode.is_empty() && self.prefill.is_empty()
    }
}

/// The worker's account of one request after a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemReport {
    pub id: RequestId,
    /// Prompt tokens still to prefill (0 once generating).
    pub remaining_prefill: usize,
    /// Prompt tokens computed for this request in the step (a reused cached prefix is not
    /// computed, so not counted): they are charged to the user's token usage like generated
    /// ones, or a long prompt with `max_tokens: 1` would cost nothing.
    pub prefilled: usize,
    /// The worker took the request's KV blocks back for older sequences (the cache was full):
    /// it goes back to the queue to recompute `remaining_prefill` tokens (its prompt and what
    /// it generated) later. Never an error the user sees.
    pub preempted: bool,
    /// The request ended (finished, cancelled, failed); its slot is free.
    pub finished: bool,
    /// Tokens generated in the step beyond the one a decoding request makes (accepted draft
    /// tokens of speculative decoding): counted in the user's token usage too.
    pub extra_generated: usize,
}

impl ItemReport {
    /// A request that ended in the step, having computed `prefilled` prompt tokens in it.
    pub fn ended(id: RequestId, prefilled: usize) -> Self {
        Self {
            id,
            remaining_prefill: 0,
            prefilled,
            preempted: false,
            finished: true,
            extra_generated: 0,
        }
    }

    /// A request still running, with `remaining_prefill` prompt tokens to go.
    pub fn running(id: RequestId, prefilled: usize, remaining_prefill: usize) -> Self {
        Self {
            id,
            remaining_prefill,
            prefilled,
            preempted: false,
            finished: false,
            extra_generated: 0,
        }
    }

    /// A request whose KV blocks were taken back: it recomputes `remaining_prefill` later.
    pub fn preempted(id: RequestId, remaining_prefill: usize) -> Self {
        Self {
            id,
            remaining_prefill,
            prefilled: 0,
            preempted: true,
            finished: false,
            extra_generated: 0,
        }
    }
}

#[derive(Debug)]
pub struct Batcher {
    cfg: BatcherConfig,
    waiting: VecDeque<Entry>,
    running: Vec<Entry>,
    /// Running requests to cancel at the next step.
    to_cancel: Vec<RequestId>,
    next_id: RequestId,
    /// Tokens computed per user (and group) over the last minute, on every model.
    tokens: TokenMeter,
    /// When each user with waiting requests was last admitted (an admission counter), so that
    /// among users with equal running sequences the one served longest ago goes next: with a
    /// single free slot, users take turns instead of the oldest request's user going again.
    last_admitted: HashMap<Option<String>, u64>,
    admissions: u64,
    /// KV blocks the worker could give new work after its last step (free blocks plus those of
    /// idle caches it may evict); `None` until the first report.
    kv_free_blocks: Option<usize>,
    /// Typed drafts warmed in spare steps.
    warm: WarmQueue,
}

/// What a cancellation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    NotFound,
    /// It was still queued; it is gone (the worker is told in the next plan).
    Dequeued,
    /// It is running; it ends at the next step.
    Pending,
}

impl Batcher {
    pub fn new(cfg: BatcherConfig) -> Self {
        Self::with_meter(cfg, TokenMeter::default())
    }

    /// A batcher counting users' tokens in `tokens`, which other models' batchers may share.
    pub fn with_meter(cfg: BatcherConfig, tokens: TokenMeter) -> Self {
        Self {
            waiting: VecDeque::new(),
            running: Vec::new(),
            to_cancel: Vec::new(),
            next_id: 1,
            tokens,
            last_admitted: HashMap::new(),
            admissions: 0,
            kv_free_blocks: None,
            warm: WarmQueue::new(cfg.warm, cfg.context_window),
            cfg,
        }
    }

    /// What the worker reported it could give new work in KV blocks (see `kv_free_blocks`).
    pub fn set_kv_free_blocks(&mut self, blocks: usize) {
        self.kv_free_blocks = Some(blocks);
    }

    pub fn config(&self) -> &BatcherConfig {
        &self.cfg
    }

    /// Accepts an anonymous request into the queue, or refuses it at once.
    pub fn submit(
        &mut self,
        cache_key: Option<Uuid>,
        prompt_len: usize,
        deadline: Option<Instant>,
    ) -> Result<RequestId, SubmitError> {
        self.submit_for(None, cache_key, prompt_len, deadline)
    }

    /// Accepts `user`'s request into the queue, or refuses it at once.
    pub fn submit_for(
        &mut self,
        user: Option<String>,
        cache_key: Option<Uuid>,
        prompt_len: usize,
        deadline: Option<Instant>,
    ) -> Result<RequestId, SubmitError> {
        self.submit_grouped(user, None, cache_key, prompt_len, deadline)
    }

    /// Accepts the request of `user` of `group` into the queue, or refuses it at once: the
    /// group's token quota is checked like the user's, and its usage counted with theirs.
    pub fn submit_grouped(
        &mut self,
        user: Option<String>,
        group: Option<String>,
        cache_key: Option<Uuid>,
        prompt_len: usize,
        deadline: Option<Instant>,
    ) -> Result<RequestId, SubmitError> {
        let group = group.map(|g| format!("group:{g}"));
        if prompt_len == 0 {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if prompt_len >= self.cfg.context_window {
            return Err(SubmitError::ContextOverflow {
                prompt_tokens: prompt_len,
                window: self.cfg.context_window,
            });
        }
        // The prompt and one generated token must fit the whole KV cache, or the request could
        // never run, however long it waited.
        let capacity_tokens = self.cfg.kv_capacity_blocks * BLOCK_POSITIONS;
        if self.cfg.kv_capacity_blocks > 0 && prompt_len + 1 > capacity_tokens {
            return Err(SubmitError::ExceedsKvCache {
                prompt_tokens: prompt_len,
                capacity_tokens,
            });
        }
        let retry_after_s = |queued: usize| 1 + queued as u64 / self.cfg.max_running.max(1) as u64;
        if let Some(u) = user.as_deref() {
            let limit = self.cfg.tokens_per_minute_per_user;
            let now = Instant::now();
            let used = self.tokens.used(u, now);
            if limit > 0 && used >= limit {
                return Err(SubmitError::TokenLimit {
                    used,
                    limit,
                    retry_after_s: self.tokens.retry_after_s(u, 1, limit, now),
                });
            }
            if let Some(g) = group.as_deref() {
                let limit = self.cfg.tokens_per_minute_per_group;
                let used = self.tokens.used(g, now);
                if limit > 0 && used >= limit {
                    return Err(SubmitError::GroupTokenLimit {
                        used,
                        limit,
                        retry_after_s: self.tokens.retry_after_s(g, 1, limit, now),
                    });
                }
            }
            let queued = self
                .waiting
                .iter()
                .filter(|e| e.user.as_deref() == Some(u))
                .count();
            let cap = self.cfg.max_queued_per_user;
            if cap > 0 && queued >= cap {
                return Err(SubmitError::UserLimit {
                    queued,
                    limit: cap,
                    retry_after_s: retry_after_s(queued),
                });
            }
        }
        if self.waiting.len() >= self.cfg.queue_capacity {
            return Err(SubmitError::Overloaded {
                queued: self.waiting.len(),
                retry_after_s: retry_after_s(self.waiting.len()),
            });
        }
        if let Some(c) = cache_key {
            // The message is being sent: its draft is moot.
            self.warm.forget(c);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Entry {
            id,
            cache_key,
            user,
            group,
            remaining_prefill: prompt_len,
            phase: Phase::Waiting,
            deadline,
            background: false,
        });
        Ok(id)
    }

    /// Makes a waiting request a chore (see `Entry::background`).
    pub fn mark_background(&mut self, id: RequestId) {
        if let Some(e) = self.waiting.iter_mut().find(|e| e.id == id) {
            e.background = true;
        }
    }

    /// The waiting request to admit next: the one whose user has the fewest running sequences,
    /// then whose user was admitted longest ago (round-robin by user), oldest first within a
    /// user, skipping users at their running cap.
    fn next_admission(&self) -> Option<usize> {
        let cap = self.cfg.max_running_per_user;
        // A chore never takes the last free slot (a user's request may come at any moment).
        let chores_may_run =
            self.cfg.max_running <= 1 || self.running.len() + 1 < self.cfg.max_running;
        // (a chore, running of its user, when its user was last admitted, index): the smallest
        // wins, so any user's request before a chore, then the oldest request of the least
        // served user.
        let mut best: Option<(bool, usize, u64, usize)> = None;
        for (i, e) in self.waiting.iter().enumerate() {
            if e.background && !chores_may_run {
                continue;
            }
            let running = self.running.iter().filter(|r| r.user == e.user).count();
            if cap > 0 && e.user.is_some() && running >= cap {
                continue;
            }
            let last = self.last_admitted.get(&e.user).copied().unwrap_or(0);
            let key = (e.background, running, last);
            if best.is_none_or(|(b, r, l, _)| key < (b, r, l)) {
                best = Some((e.background, running, last, i));
            }
        }
        best.map(|(_, _, _, i)| i)
    }

    /// Records that `user` was admitted now, forgetting users with nothing waiting or running
    /// (they start afresh when they come back: bounded memory). Called after the admitted
    /// request joined `running`.
    fn note_admission(&mut self, user: &Option<String>) {
        self.admissions += 1;
        self.last_admitted.insert(user.clone(), self.admissions);
        let (waiting, running) = (&self.waiting, &self.running);
        self.last_admitted.retain(|u, _| {
            waiting.iter().any(|e| &e.user == u) || running.iter().any(|e| &e.user == u)
        });
    }

    pub fn cancel(&mut self, id: RequestId) -> CancelOutcome {
        if let Some(pos) = self.waiting.iter().position(|e| e.id == id) {
            self.waiting.remove(pos);
            self.to_cancel.push(id);
            return CancelOutcome::Dequeued;
        }
        if self.running.iter().any(|e| e.id == id) {
            if !self.to_cancel.contains(&id) {
                self.to_cancel.push(id);
            }
            return CancelOutcome::Pending;
        }
        CancelOutcome::NotFound
    }

    /// Cancels every request whose deadline has passed; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<RequestId> {
        let expired: Vec<RequestId> = self
            .waiting
            .iter()
            .chain(self.running.iter())
            .filter(|e| e.deadline.is_some_and(|d| d <= now))
            .map(|e| e.id)
            .collect();
        for &id in &expired {
            self.cancel(id);
        }
        expired
    }

    /// Decides the next step, or `None` when there is nothing to do.
    pub fn plan(&mut self) -> Option<StepPlan> {
        let mut plan = StepPlan {
            cancel: std::mem::take(&mut self.to_cancel),
            ..StepPlan::default()
        };
        // Cancelled running requests take no part in the step; their slots free when reported.
        let cancelled = plan.cancel.clone();
        let mut budget = self.cfg.step_token_budget;
        for e in self.running.iter().filter(|e| !cancelled.contains(&e.id)) {
            if e.phase == Phase::Decoding {
                plan.decode.push(e.id);
                budget = budget.saturating_sub(1);
            }
        }
        // Keep prefill moving even when decode tokens fill the budget: a starved prompt would
        // otherwise wait as long as the longest running reply.
        let mut budget = budget.max(self.cfg.step_token_budget / 4).max(1);
        for e in self.running.iter().filter(|e| !cancelled.contains(&e.id)) {
            if e.phase == Phase::Prefilling && budget > 0 {
                let n = e.remaining_prefill.clamp(1, budget);
                plan.prefill.push((e.id, n));
                budget -= n.min(budget);
            }
        }
        // KV blocks for new work: what the worker could give after its last step, less one block
        // per decoding sequence (each may start a new block in this step). A request whose
        // prompt does not fit waits (nothing is admitted past it, so it is not starved); when
        // nothing runs at all it is admitted anyway, and the worker evicts or preempts to make
        // room (the estimate ignores reusable cached prefixes, so it errs on the safe side).
        let mut kv_free = self
            .kv_free_blocks
            .filter(|_| self.cfg.kv_capacity_blocks > 0)
            .map(|f| f.saturating_sub(plan.decode.len()));
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(i) = self.next_admission() else {
                break;
            };
            if let Some(free) = kv_free.as_mut() {
                let need = (self.waiting[i].remaining_prefill + 1).div_ceil(BLOCK_POSITIONS);
                if need > *free && !self.running.is_empty() {
                    break;
                }
                *free = free.saturating_sub(need);
            }
            let Some(mut e) = self.waiting.remove(i) else {
                break;
            };

            e.phase = Phase::Prefilling;
            let n = e.remaining_prefill.clamp(1, budget);
            plan.prefill.push((e.id, n));
            budget -= n.min(budget);
            let user = e.user.clone();
            self.running.push(e);
            self.note_admission(&user);
        }
        plan.draft_budget = budget;
        // Drafts: only in a step with nothing else to do (see `crate::warm`).
        let busy = !self.running.is_empty() || !self.waiting.is_empty();
        let kv_free = self
            .kv_free_blocks
            .filter(|_| self.cfg.kv_capacity_blocks > 0);
        let next_id = &mut self.next_id;
        let warm = self.warm.plan(
            busy,
            kv_free,
            |tokens| tokens.div_ceil(BLOCK_POSITIONS),
            || {
                let id = *next_id;
                *next_id += 1;
                id
            },
        );
        plan.cancel.extend(warm.cancel);
        plan.prefill.extend(warm.prefill);
        plan.warm_start = warm.start;
        (!plan.is_empty()).then_some(plan)
    }

    /// Takes a typed draft to warm in spare steps (see [`crate::warm`]).
    pub fn offer_draft(&mut self, draft: Draft) -> Result<(), WarmRefused> {
        self.warm.offer(draft, Instant::now())
    }

    /// What drafts are doing.
    pub fn warm_stats(&self) -> WarmStats {
        self.warm.stats()
    }

    /// Applies the worker's report of a step.
    pub fn apply(&mut self, reports: &[ItemReport]) {
        self.apply_at(reports, Instant::now())
    }

    /// Applies the worker's report of a step that ended at `now`. A request that was decoding,
    /// or whose prefill just completed, got one generated token in the step; that token and
    /// the prompt tokens computed in the step are what per-user token usage counts.
    pub fn apply_at(&mut self, reports: &[ItemReport], now: Instant) {
        for r in reports {
            if self.warm.owns(r.id) {
                // A draft's tokens count against nothing but its own per-user cap.
                self.warm.apply(
                    r.id,
                    r.prefilled,
                    r.remaining_prefill,
                    r.finished || r.preempted,
                    now,
                );
                continue;
            }
            if let Some(e) = self.running.iter().find(|e| e.id == r.id) {
                let generated = e.phase == Phase::Decoding
                    || (e.phase == Phase::Prefilling && r.remaining_prefill == 0);
                let used = u64::from(generated) + r.prefilled as u64 + r.extra_generated as u64;
                for key in [e.user.as_deref(), e.group.as_deref()]
                    .into_iter()
                    .flatten()
                {
                    self.tokens.add(key, used, now);
                }
            }
            if r.finished {
                self.running.retain(|e| e.id != r.id);
                self.waiting.retain(|e| e.id != r.id);
                self.to_cancel.retain(|&id| id != r.id);
                continue;
            }
            if r.preempted {
                // Its KV blocks went to older sequences: it waits again, first in line, to
                // recompute what it had (prompt and generated tokens) when blocks are free.
                if let Some(pos) = self.running.iter().position(|e| e.id == r.id) {
                    let mut e = self.running.remove(pos);
                    e.phase = Phase::Waiting;
                    e.remaining_prefill = r.remaining_prefill;
                    self.waiting.push_front(e);
                }
                continue;
            }
            if let Some(e) = self.running.iter_mut().find(|e| e.id == r.id) {
                e.remaining_prefill = r.remaining_prefill;
                if r.remaining_prefill == 0 {
                    e.phase = Phase::Decoding;
                }
            }
        }
    }

    pub fn queued(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Nothing queued, running or to cancel (drafts being warmed aside).
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.to_cancel.is_empty()
    }

    /// The state of the request holding `cache_key`, if any.
    pub fn state_of(&self, cache_key: Uuid) -> SequenceState {
        let key = Some(cache_key);
        if let Some(e) = self.running.iter().find(|e| e.cache_key == key) {
            return match e.phase {
                Phase::Decoding => SequenceState::Generating,
                Phase::Prefilling | Phase::Waiting => SequenceState::Prefilling,
            };
        }
        if self.waiting.iter().any(|e| e.cache_key == key) {
            return SequenceState::Queued;
        }
        if self.warm.warming_conversation() == key {
            return SequenceState::Warming;
        }
        SequenceState::Idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batcher(max_running: usize, queue: usize, budget: usize) -> Batcher {
        Batcher::new(BatcherConfig {
            max_running,
            queue_capacity: queue,
            step_token_budget: budget,
            context_window: 4096,
            max_queued_per_user: 0,
            max_running_per_user: 0,
            tokens_per_minute_per_user: 0,
            tokens_per_minute_per_group: 0,
            kv_capacity_blocks: 0,
            warm: crate::warm::WarmConfig::default(),
        })
    }

    fn user(name: &str) -> Option<String> {
        Some(name.to_string())
    }

    #[test]
    fn a_chore_waits_for_every_users_request_and_leaves_the_last_slot_free() {
        let mut b = batcher(2, 64, 512);
        let chore = b.submit_for(user("task"), None, 5, None).unwrap();
        b.mark_background(chore);
        let a = b.submit_for(user("a"), None, 5, None).unwrap();
        let bee = b.submit_for(user("b"), None, 5, None).unwrap();
        // Both users' requests first, though the chore came first.
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(a, 5), (bee, 5)]);
        b.apply(&[report(a, 0, true), report(bee, 0, false)]);
        // One slot free, and it is the last: the chore still waits.
        assert!(b
            .plan()
            .is_some_and(|p| !p.prefill.iter().any(|(id, _)| *id == chore)));
        b.apply(&[report(bee, 0, true)]);
        // Nothing else waits and a slot stays free: the chore runs.
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(chore, 5)]);
    }

    #[test]
    fn admission_is_round_robin_by_user_not_first_come() {
        let mut b = batcher(2, 64, 512);
        // A floods the queue first; B and C come later with one request each.
        let a: Vec<_> = (0..10)
            .map(|_| b.submit_for(user("a"), None, 5, None).unwrap())
            .collect();
        let bee = b.submit_for(user("b"), None, 5, None).unwrap();
        let c = b.submit_for(user("c"), None, 5, None).unwrap();
        let plan = b.plan().unwrap();
        // One of A's, then B's (A already has one running), not A's second.
        assert_eq!(plan.prefill, vec![(a[0], 5), (bee, 5)]);
        b.apply(&[report(a[0], 0, true), report(bee, 0, false)]);
        // A and C both have none running now: C, never served, before A, just served (round
        // robin, not first come).
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(c, 5)]);
        b.apply(&[report(bee, 0, true), report(c, 0, false)]);
        // B left, C runs, A none: A's second.
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(a[1], 5)]);
    }

    #[test]
    fn per_user_caps_refuse_with_a_user_limit_and_leave_room_for_others() {
        let mut b = Batcher::new(BatcherConfig {
            max_running: 4,
            queue_capacity: 8,
            step_token_budget: 512,
            context_window: 4096,
            max_queued_per_user: 3,
            max_running_per_user: 2,
            tokens_per_minute_per_user: 0,
            tokens_per_minute_per_group: 0,
            kv_capacity_blocks: 0,
            warm: crate::warm::WarmConfig::default(),
        });
        for _ in 0..3 {
            b.submit_for(user("a"), None, 5, None).unwrap();
        }
        match b.submit_for(user("a"), None, 5, None) {
            Err(SubmitError::UserLimit {
                queued,
                limit,
                retry_after_s,
            }) => {
                assert_eq!((queued, limit), (3, 3));
                assert!(retry_after_s >= 1);
            }
            other => panic!("{other:?}"),
        }
        // Another user is not affected by A's cap.
        let bee = b.submit_for(user("b"), None, 5, None).unwrap();
        let plan = b.plan().unwrap();
        // A may run two at once; the third waits although a slot is free.
        assert_eq!(plan.prefill.len(), 3);
        assert!(plan.prefill.iter().any(|&(id, _)| id == bee));
        assert_eq!(b.running(), 3);
        assert_eq!(b.queued(), 1);
        // A can queue again once below its cap.
        b.submit_for(user("a"), None, 5, None).unwrap();
        // Anonymous work has no per-user caps: it fills the global queue (2 waiting + 6).
        assert_eq!(b.queued(), 2);
        for _ in 0..6 {
            b.submit(None, 5, None).unwrap();
        }
        match b.submit(None, 5, None) {
            Err(SubmitError::Overloaded { .. }) => {}
            other => panic!("the global queue is full: {other:?}"),
        }
    }

    fn report(id: RequestId, remaining: usize, finished: bool) -> ItemReport {
        ItemReport {
            prefilled: 0,
            preempted: false,
            id,
            remaining_prefill: remaining,
            finished,
            extra_generated: 0,
        }
    }

    #[test]
    fn long_prompt_is_chunked_and_decodes_keep_going() {
        let mut b = batcher(4, 8, 64);
        let key_a = Uuid::now_v7();
        let a = b.submit(Some(key_a), 10, None).unwrap();
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(a, 10)]);
        b.apply(&[report(a, 0, false)]);
        assert_eq!(b.state_of(key_a), SequenceState::Generating);

        // A 200-token prompt arrives: it is prefilled in chunks while `a` decodes every step.
        let long = b.submit(Some(Uuid::now_v7()), 200, None).unwrap();
        let mut remaining = 200;
        let mut steps = 0;
        while remaining > 0 {
            let plan = b.plan().unwrap();
            assert_eq!(
                plan.decode,
                vec![a],
                "the running stream decodes every step"
            );
            let (id, n) = plan.prefill[0];
            assert_eq!(id, long);
            assert!(n + plan.decode.len() <= 64);
            remaining -= n;
            b.apply(&[report(a, 0, false), report(long, remaining, false)]);
            steps += 1;
        }
        assert_eq!(steps, 4);
        assert_eq!(b.plan().unwrap().decode, vec![a, long]);
    }

    #[test]
    fn fifo_admission_with_a_cap_on_running() {
        let mut b = batcher(2, 8, 512);
        let ids: Vec<_> = (0..4).map(|_| b.submit(None, 5, None).unwrap()).collect();
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(ids[0], 5), (ids[1], 5)]);
        assert_eq!(b.running(), 2);
        assert_eq!(b.queued(), 2);
        b.apply(&[report(ids[0], 0, true), report(ids[1], 0, false)]);
        let plan = b.plan().unwrap();
        assert_eq!(plan.decode, vec![ids[1]]);
        assert_eq!(
            plan.prefill,
            vec![(ids[2], 5)],
            "the oldest waiting request is admitted"
        );
    }

    #[test]
    fn full_queue_refuses_at_once_and_keeps_what_was_queued() {
        let mut b = batcher(1, 2, 512);
        let first = b.submit(None, 5, None).unwrap();
        let second = b.submit(None, 5, None).unwrap();
        match b.submit(None, 5, None) {
            Err(SubmitError::Overloaded { queued, .. }) => assert_eq!(queued, 2),
            other => panic!("{other:?}"),
        }
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(first, 5)]);
        b.apply(&[report(first, 0, true)]);
        assert_eq!(b.plan().unwrap().prefill, vec![(second, 5)]);
    }

    #[test]
    fn cancellation_of_queued_and_running_requests() {
        let mut b = batcher(1, 4, 512);
        let run = b.submit(Some(Uuid::now_v7()), 5, None).unwrap();
        let key_q = Uuid::now_v7();
        let queued = b.submit(Some(key_q), 5, None).unwrap();
        b.plan().unwrap();
        b.apply(&[report(run, 0, false)]);
        assert_eq!(b.state_of(key_q), SequenceState::Queued);
        assert_eq!(b.cancel(queued), CancelOutcome::Dequeued);
        assert_eq!(b.state_of(key_q), SequenceState::Idle);
        assert_eq!(b.cancel(run), CancelOutcome::Pending);
        let plan = b.plan().unwrap();
        assert_eq!(plan.cancel, vec![queued, run]);
        assert!(plan.decode.is_empty(), "a cancelled request is not stepped");
        b.apply(&[report(run, 0, true), report(queued, 0, true)]);
        assert!(b.is_idle());
        assert_eq!(b.cancel(run), CancelOutcome::NotFound);
    }

    #[test]
    fn deadlines_expire_requests() {
        let mut b = batcher(1, 4, 512);
        let now = Instant::now();
        let a = b.submit(None, 5, Some(now)).unwrap();
        let c = b.submit(None, 5, None).unwrap();
        assert_eq!(b.expire(now), vec![a]);
        let plan = b.plan().unwrap();
        assert_eq!(plan.cancel, vec![a]);
        assert_eq!(plan.prefill, vec![(c, 5)]);
    }

    #[test]
    fn prompts_beyond_the_window_are_refused() {
        let mut b = batcher(1, 4, 512);
        assert!(matches!(
            b.submit(None, 4096, None),
            Err(SubmitError::ContextOverflow { .. })
        ));
        assert!(matches!(
            b.submit(None, 0, None),
            Err(SubmitError::Invalid(_))
        ));
    }

    #[test]
    fn prefill_gets_a_share_even_when_decodes_fill_the_budget() {
        let mut b = batcher(16, 16, 8);
        let ids: Vec<_> = (0..8).map(|_| b.submit(None, 1, None).unwrap()).collect();
        b.plan().unwrap();
        b.apply(&ids.iter().map(|&i| report(i, 0, false)).collect::<Vec<_>>());
        let late = b.submit(None, 100, None).unwrap();
        let plan = b.plan().unwrap();
        assert_eq!(plan.decode.len(), 8);
        assert_eq!(plan.prefill, vec![(late, 2)]);
    }

    #[test]
    fn a_user_over_the_token_rate_is_refused_with_a_retry_time_and_others_are_not() {
        let mut b = Batcher::new(BatcherConfig {
            max_running: 4,
            queue_capacity: 8,
            step_token_budget: 512,
            context_window: 4096,
            max_queued_per_user: 0,
            max_running_per_user: 0,
            tokens_per_minute_per_user: 3,
            tokens_per_minute_per_group: 0,
            kv_capacity_blocks: 0,
            warm: crate::warm::WarmConfig::default(),
        });
        let a = b.submit_for(user("a"), None, 5, None).unwrap();
        b.plan().unwrap();
        // Prefill done (first token), then two decode steps: three tokens.
        b.apply(&[report(a, 0, false)]);
        b.plan().unwrap();
        b.apply(&[report(a, 0, false)]);
        b.plan().unwrap();
        b.apply(&[report(a, 0, true)]);
        match b.submit_for(user("a"), None, 5, None) {
            Err(SubmitError::TokenLimit {
                used,
                limit,
                retry_after_s,
            }) => {
                assert_eq!((used, limit), (3, 3));
                assert!((1..=60).contains(&retry_after_s), "{retry_after_s}");
            }
            other => panic!("{other:?}"),
        }
        assert!(b.submit_for(user("b"), None, 5, None).is_ok());
    }

    #[test]
    fn a_group_shares_one_token_quota_and_prompt_tokens_count() {
        let mut b = Batcher::new(BatcherConfig {
            tokens_per_minute_per_user: 1000,
            tokens_per_minute_per_group: 30,
            ..batcher(4, 8, 512).cfg
        });
        let now = Instant::now();
        // Guest a (of address x) prefills 20 prompt tokens and generates one.
        let a = b
            .submit_grouped(user("a"), Some("x".into()), None, 20, None)
            .unwrap();
        b.plan().unwrap();
        b.apply_at(
            &[ItemReport {
                id: a,
                remaining_prefill: 0,
                prefilled: 20,
                preempted: false,
                finished: false,
                extra_generated: 0,
            }],
            now,
        );
        // Guest b of the same address: 21 of 30 used, still allowed; its 10 more fill it.
        let bee = b
            .submit_grouped(user("b"), Some("x".into()), None, 10, None)
            .unwrap();
        b.plan().unwrap();
        b.apply_at(
            &[ItemReport {
                id: bee,
                remaining_prefill: 0,
                prefilled: 10,
                preempted: false,
                finished: true,
                extra_generated: 0,
            }],
            now,
        );
        // A third guest of that address is refused; a guest of another address is not.
        match b.submit_grouped(user("c"), Some("x".into()), None, 5, None) {
            Err(SubmitError::GroupTokenLimit { used, limit, .. }) => {
                assert_eq!((used, limit), (32, 30))
            }
            other => panic!("expected the group's limit, got {other:?}"),
        }
        assert!(b
            .submit_grouped(user("d"), Some("y".into()), None, 5, None)
            .is_ok());
    }

    #[test]
    fn with_one_slot_users_take_turns() {
        let mut b = batcher(1, 16, 512);
        // "a" queues three requests, then "b" one: a1 runs, then b (a was just served), then
        // a2 and a3.
        let a: Vec<RequestId> = (0..3)
            .map(|_| b.submit_for(user("a"), None, 5, None).unwrap())
            .collect();
        let bee = b.submit_for(user("b"), None, 5, None).unwrap();
        let mut order = Vec::new();
        while let Some(plan) = b.plan() {
            let admitted: Vec<RequestId> = plan.prefill.iter().map(|p| p.0).collect();
            order.extend(admitted.iter().copied());
            let reports: Vec<ItemReport> = admitted
                .iter()
                .chain(plan.decode.iter())
                .map(|&id| report(id, 0, true))
                .collect();
            b.apply(&reports);
        }
        assert_eq!(order, [a[0], bee, a[1], a[2]]);

        // The same when "a"'s later requests arrive after its first was admitted (its turn is
        // remembered while it runs).
        let mut b = batcher(1, 16, 512);
        let first = b.submit_for(user("a"), None, 5, None).unwrap();
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill[0].0, first);
        let more: Vec<RequestId> = (0..2)
            .map(|_| b.submit_for(user("a"), None, 5, None).unwrap())
            .collect();
        let bee = b.submit_for(user("b"), None, 5, None).unwrap();
        b.apply(&[report(first, 0, true)]);
        let mut order = Vec::new();
        while let Some(plan) = b.plan() {
            let admitted: Vec<RequestId> = plan.prefill.iter().map(|p| p.0).collect();
            order.extend(admitted.iter().copied());
            let reports: Vec<ItemReport> = admitted.iter().map(|&id| report(id, 0, true)).collect();
            b.apply(&reports);
        }
        assert_eq!(order, [bee, more[0], more[1]]);
    }

    fn kv_batcher(blocks: usize) -> Batcher {
        Batcher::new(BatcherConfig {
            kv_capacity_blocks: blocks,
            ..batcher(8, 16, 512).cfg
        })
    }

    #[test]
    fn a_prompt_larger_than_the_whole_kv_cache_is_refused_at_once() {
        let mut b = kv_batcher(4); // 64 positions
        assert!(b.submit(None, 63, None).is_ok());
        match b.submit(None, 64, None) {
            Err(SubmitError::ExceedsKvCache {
                prompt_tokens: 64,
                capacity_tokens: 64,
            }) => {}
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn requests_wait_for_kv_blocks_instead_of_failing() {
        let mut b = kv_batcher(8);
        // Three prompts of 40 tokens: 3 blocks each (with the first generated token).
        let ids: Vec<RequestId> = (0..3).map(|_| b.submit(None, 40, None).unwrap()).collect();
        // Before any report nothing is known: the first plan admits by the usual rules.
        b.set_kv_free_blocks(7);
        let plan = b.plan().unwrap();
        // 7 free blocks: two prompts (6 blocks) fit, the third waits.
        assert_eq!(plan.prefill, vec![(ids[0], 40), (ids[1], 40)]);
        b.apply(&[report(ids[0], 0, false), report(ids[1], 0, false)]);
        b.set_kv_free_blocks(1);
        let plan = b.plan().unwrap();
        assert_eq!(plan.decode, vec![ids[0], ids[1]]);
        assert!(plan.prefill.is_empty(), "the third still waits: {plan:?}");
        assert_eq!(b.queued(), 1);
        // One finishes and its blocks come back: the third is admitted.
        b.apply(&[report(ids[0], 0, true), report(ids[1], 0, false)]);
        b.set_kv_free_blocks(4);
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(ids[2], 40)]);
    }

    #[test]
    fn a_preempted_request_waits_first_in_line_to_recompute() {
        let mut b = kv_batcher(8);
        let first = b.submit(None, 10, None).unwrap();
        let second = b.submit(None, 10, None).unwrap();
        let later = b.submit(None, 10, None).unwrap();
        b.set_kv_free_blocks(8);
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill.len(), 3);
        // The worker preempted the youngest running one: 14 tokens to recompute.
        b.apply(&[
            report(first, 0, false),
            report(second, 0, false),
            ItemReport {
                id: later,
                remaining_prefill: 14,
                prefilled: 10,
                preempted: true,
                finished: false,
                extra_generated: 0,
            },
        ]);
        assert_eq!(b.running(), 2);
        assert_eq!(b.queued(), 1);
        b.set_kv_free_blocks(1);
        let plan = b.plan().unwrap();
        assert!(plan.prefill.is_empty(), "no room yet: {plan:?}");
        b.apply(&[report(first, 0, true), report(second, 0, false)]);
        b.set_kv_free_blocks(4);
        let plan = b.plan().unwrap();
        assert_eq!(plan.prefill, vec![(later, 14)]);
    }
}
