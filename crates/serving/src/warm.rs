//! Warm before send: the prompt a user is typing is prefilled into their conversation's KV cache
//! while they type, so that when they press send only the tail that changed is computed.
//!
//! The chat page sends the settled part of its draft (and its attached files) to the
//! conversation's session actor, which builds the prompt the message would have and offers it
//! here ([`WarmQueue::offer`]). This is the policy, free of actors and of the model so it is
//! tested directly; the [`crate::batcher::Batcher`] calls it when it plans a step:
//!
//! - **Only spare capacity.** A draft is prefilled only in steps that carry nothing else: while
//!   any reply is queued, prefilling or generating, no draft is computed, and a draft being
//!   computed when such work arrives is cancelled in the very plan that admits it (its
//!   conversation keeps the part already computed; the draft goes back to the front of the line
//!   for the next idle step). So a draft never delays a running reply's tokens; what it can
//!   delay is a reply submitted while one of its chunks runs, by one chunk's step at most, which
//!   [`WarmConfig::chunk_tokens`] bounds.
//! - **Bounded per user.** One draft per user is kept (a newer one, in any of their
//!   conversations, replaces it), and the tokens computed for a user's drafts over the last
//!   minute are capped ([`WarmConfig::tokens_per_minute_per_user`]). Drafts count against
//!   nothing else: not the user's token quota, not the queue, not admission.
//! - **Never a wrong reply.** A draft only fills the conversation's cache; the message sent
//!   afterwards reuses whatever prefix of it agrees with its prompt (the model worker's
//!   `reuse_prefix`), so a draft that was edited, shortened or abandoned costs only spare time.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::types::{RequestId, WarmStats};
use super::window::SlidingWindow;

/// Drafts kept waiting at most (one per user); past it the oldest is dropped.
pub const MAX_WAITING_DRAFTS: usize = 256;

/// How drafts are warmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmConfig {
    /// Whether drafts are warmed at all.
    pub enabled: bool,
    /// Prompt tokens of a draft computed per step (a reply submitted meanwhile waits for one
    /// such step at most).
    pub chunk_tokens: usize,
    /// Tokens of one user's drafts computed over the last minute before more are refused (0:
    /// no limit).
    pub tokens_per_minute_per_user: u64,
}

impl Default for WarmConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            chunk_tokens: 64,
            tokens_per_minute_per_user: 16_384,
        }
    }
}

impl WarmConfig {
    /// Drafts never warmed.
    pub fn off() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }
}

/// A draft's prompt, waiting to be warmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Draft {
    pub conversation: Uuid,
    /// Whose draft it is (`None`: nobody in particular, tests and tools).
    pub user: Option<String>,
    pub prompt: Vec<u32>,
}

impl Draft {
    /// Whether this draft makes `older` moot: the same conversation, or the same user (one
    /// draft per user).
    fn replaces(&self, older: &Draft) -> bool {
        older.conversation == self.conversation || (older.user.is_some() && older.user == self.user)
    }
}

/// Why a draft was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WarmRefused {
    #[error("warming drafts is off (scheduler.warm_drafts)")]
    Off,
    #[error("the draft's prompt is empty")]
    Empty,
    #[error("the draft's prompt has {prompt_tokens} tokens; the context window is {window}")]
    TooLong { prompt_tokens: usize, window: usize },
    #[error(
        "this user's drafts took {used} tokens in the last minute; the limit is {limit} \
         (scheduler.warm_tokens_per_minute_per_user)"
    )]
    UserLimit { used: u64, limit: u64 },
}

/// The draft being computed: its request id, the draft (to requeue it when interrupted) and the
/// prompt tokens still to compute (corrected by the worker's reports).
#[derive(Debug, Clone)]
struct Warming {
    id: RequestId,
    draft: Draft,
    remaining: usize,
    /// Cancelled in a plan (interrupted or replaced): its end is still to be reported.
    cancelled: bool,
    /// A message was sent in its conversation: not warmed again when interrupted.
    moot: bool,
}

/// What a plan does with drafts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WarmPlan {
    /// A draft request to end before the step (a reply arrived, or a newer draft replaced it).
    pub cancel: Option<RequestId>,
    /// A draft request to start: register it with the worker before the step.
    pub start: Option<(RequestId, Draft)>,
    /// The draft request's chunk in this step (its id and the most tokens to compute).
    pub prefill: Option<(RequestId, usize)>,
}

/// Drafts waiting and the one being computed (see the module docs).
#[derive(Debug)]
pub struct WarmQueue {
    cfg: WarmConfig,
    context_window: usize,
    waiting: VecDeque<Draft>,
    warming: Option<Warming>,
    /// A draft request cancelled by `offer` or `forget`, for the next plan to end.
    to_cancel: Option<RequestId>,
    /// Tokens of each user's drafts computed over the last minute.
    meter: SlidingWindow<String>,
    stats: WarmStats,
}

impl WarmQueue {
    pub fn new(cfg: WarmConfig, context_window: usize) -> Self {
        Self {
            cfg,
            context_window,
            waiting: VecDeque::new(),
            warming: None,
            to_cancel: None,
            meter: SlidingWindow::new(Duration::from_secs(60), Duration::from_secs(1), 100_000),
            stats: WarmStats::default(),
        }
    }

    pub fn config(&self) -> WarmConfig {
        self.cfg
    }

    /// Takes a draft to warm at the next spare step, replacing the user's previous draft and any
    /// other of the same conversation (a draft being computed for either is cancelled: its
    /// conversation keeps what it computed, which the new draft reuses as far as they agree).
    pub fn offer(&mut self, draft: Draft, now: Instant) -> Result<(), WarmRefused> {
        if !self.cfg.enabled {
            return Err(WarmRefused::Off);
        }
        if draft.prompt.is_empty() {
            return Err(WarmRefused::Empty);
        }
        if draft.prompt.len() >= self.context_window {
            return Err(WarmRefused::TooLong {
                prompt_tokens: draft.prompt.len(),
                window: self.context_window,
            });
        }
        if let Some(user) = draft.user.as_deref() {
            let limit = self.cfg.tokens_per_minute_per_user;
            let used = self.meter.used(user, now);
            if limit > 0 && used >= limit {
                return Err(WarmRefused::UserLimit { used, limit });
            }
        }
        self.waiting.retain(|d| !draft.replaces(d));
        if self
            .warming
            .as_ref()
            .is_some_and(|w| !w.cancelled && draft.replaces(&w.draft))
        {
            self.cancel_warming();
        }
        if self.waiting.len() >= MAX_WAITING_DRAFTS {
            self.waiting.pop_front();
        }
        self.waiting.push_back(draft);
        self.stats.offered += 1;
        Ok(())
    }

    /// A message is being sent in `conversation`: its draft is moot. (A draft being computed
    /// for it is cancelled by the plan that admits the message, before its admission.)
    pub fn forget(&mut self, conversation: Uuid) {
        self.waiting.retain(|d| d.conversation != conversation);
        if let Some(w) = self.warming.as_mut() {
            if w.draft.conversation == conversation {
                w.moot = true;
            }
        }
    }

    fn cancel_warming(&mut self) {
        if let Some(w) = self.warming.as_mut() {
            w.cancelled = true;
            self.to_cancel = Some(w.id);
        }
    }

    /// The drafts' part of a step. `busy`: the step carries other work, or other work waits
    /// (then no draft is computed, and one being computed is interrupted). `kv_free`: KV
    /// blocks new work may take (`None`: unknown), with `blocks_for(tokens)` the blocks a prompt
    /// needs; a draft that does not fit waits. `next_id` gives a new request id.
    pub fn plan(
        &mut self,
        busy: bool,
        kv_free: Option<usize>,
        blocks_for: impl Fn(usize) -> usize,
        next_id: impl FnOnce() -> RequestId,
    ) -> WarmPlan {
        let mut plan = WarmPlan {
            cancel: self.to_cancel.take(),
            ..WarmPlan::default()
        };
        if busy {
            if let Some(w) = self.warming.as_mut().filter(|w| !w.cancelled) {
                w.cancelled = true;
                plan.cancel = Some(w.id);
                self.stats.interrupted += 1;
                // Back to the front of the line, unless a send made it moot or a newer draft
                // of its user or conversation is waiting.
                let newer = self.waiting.iter().any(|d| d.replaces(&w.draft));
                if !w.moot && !newer {
                    self.waiting.push_front(w.draft.clone());
                }
            }
            return plan;
        }
        // A cancelled draft request ends in this step; the next one starts in a later step,
        // so its conversation's cache is free by then.
        if self.warming.as_ref().is_some_and(|w| w.cancelled) {
            return plan;
        }
        if let Some(w) = self.warming.as_ref() {
            plan.prefill = Some((w.id, self.chunk(w.remaining)));
            return plan;
        }
        let fits = |d: &Draft| kv_free.is_none_or(|free| blocks_for(d.prompt.len() + 1) <= free);
        let Some(pos) = self.waiting.iter().position(fits) else {
            return plan;
        };
        let Some(draft) = self.waiting.remove(pos) else {
            return plan;
        };
        let id = next_id();
        let remaining = draft.prompt.len();
        plan.prefill = Some((id, self.chunk(remaining)));
        plan.start = Some((id, draft.clone()));
        self.warming = Some(Warming {
            id,
            draft,
            remaining,
            cancelled: false,
            moot: false,
        });
        self.stats.started += 1;
        plan
    }

    /// A draft chunk for `remaining` prompt tokens (at least one, at most `chunk_tokens`).
    fn chunk(&self, remaining: usize) -> usize {
        remaining.clamp(1, self.cfg.chunk_tokens.max(1))
    }

    /// Whether `id` is a draft request (the batcher leaves its reports to [`Self::apply`]).
    pub fn owns(&self, id: RequestId) -> bool {
        self.warming.as_ref().is_some_and(|w| w.id == id)
    }

    /// The worker's report of the draft request `id` after a step: `prefilled` tokens computed
    /// in it, `remaining` still to compute, whether it ended.
    pub fn apply(
        &mut self,
        id: RequestId,
        prefilled: usize,
        remaining: usize,
        ended: bool,
        now: Instant,
    ) {
        let Some(w) = self.warming.as_mut().filter(|w| w.id == id) else {
            return;
        };
        self.stats.tokens += prefilled as u64;
        if let Some(user) = w.draft.user.as_deref() {
            self.meter.add(user, prefilled as u64, now);
        }
        w.remaining = remaining;
        if ended {
            if !w.cancelled && remaining == 0 {
                self.stats.completed += 1;
            }
            self.warming = None;
        }
    }

    /// Whether anything is waiting or running (a step is worth planning).
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || self.warming.is_some() || self.to_cancel.is_some()
    }

    /// The conversation whose draft is being computed, if any.
    pub fn warming_conversation(&self) -> Option<Uuid> {
        self.warming
            .as_ref()
            .filter(|w| !w.cancelled)
            .map(|w| w.draft.conversation)
    }

    pub fn stats(&self) -> WarmStats {
        WarmStats {
            enabled: self.cfg.enabled,
            waiting: self.waiting.len(),
            warming: self.warming.as_ref().is_some_and(|w| !w.cancelled),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(conversation: Uuid, user: &str, len: usize) -> Draft {
        Draft {
            conversation,
            user: Some(user.to_string()),
            prompt: (0..len as u32).collect(),
        }
    }

    fn queue(chunk: usize) -> WarmQueue {
        WarmQueue::new(
            WarmConfig {
                enabled: true,
                chunk_tokens: chunk,
                tokens_per_minute_per_user: 1_000,
            },
            4096,
        )
    }

    /// Plans with ids counting up from 100.
    fn plan(q: &mut WarmQueue, busy: bool, next: &mut RequestId) -> WarmPlan {
        q.plan(
            busy,
            None,
            |t| t.div_ceil(16),
            || {
                *next += 1;
                *next
            },
        )
    }

    #[test]
    fn a_draft_is_computed_in_chunks_only_in_idle_steps() {
        let mut q = queue(64);
        let mut next = 100;
        let c = Uuid::now_v7();
        let now = Instant::now();
        q.offer(draft(c, "a", 150), now).unwrap();
        // Other work: nothing of the draft.
        assert_eq!(plan(&mut q, true, &mut next), WarmPlan::default());
        let p = plan(&mut q, false, &mut next);
        let (id, d) = p.start.clone().unwrap();
        assert_eq!((id, d.prompt.len()), (101, 150));
        assert_eq!(p.prefill, Some((101, 64)));
        q.apply(id, 64, 86, false, now);
        assert_eq!(plan(&mut q, false, &mut next).prefill, Some((101, 64)));
        q.apply(id, 64, 22, false, now);
        assert_eq!(plan(&mut q, false, &mut next).prefill, Some((101, 22)));
        q.apply(id, 22, 0, true, now);
        assert!(!q.has_work());
        let s = q.stats();
        assert_eq!(
            (s.started, s.completed, s.tokens, s.interrupted),
            (1, 1, 150, 0)
        );
    }

    #[test]
    fn a_reply_interrupts_the_draft_which_resumes_at_the_next_idle_step() {
        let mut q = queue(64);
        let mut next = 100;
        let c = Uuid::now_v7();
        let now = Instant::now();
        q.offer(draft(c, "a", 150), now).unwrap();
        let id = plan(&mut q, false, &mut next).start.unwrap().0;
        q.apply(id, 64, 86, false, now);
        // Another user's reply arrives: the draft ends in that very plan.
        let p = plan(&mut q, true, &mut next);
        assert_eq!(p.cancel, Some(id));
        assert_eq!((p.start, p.prefill), (None, None));
        q.apply(id, 0, 86, true, now);
        // Still busy: nothing.
        assert_eq!(plan(&mut q, true, &mut next), WarmPlan::default());
        // Idle again: the same draft as a new request (its conversation kept what it had).
        let p = plan(&mut q, false, &mut next);
        let (again, d) = p.start.unwrap();
        assert_ne!(again, id);
        assert_eq!(d.conversation, c);
        assert_eq!(q.stats().interrupted, 1);
        assert_eq!(q.stats().completed, 0);
    }

    #[test]
    fn a_send_makes_the_draft_moot_and_a_newer_draft_replaces_the_users_older() {
        let mut q = queue(64);
        let mut next = 100;
        let (c1, c2) = (Uuid::now_v7(), Uuid::now_v7());
        let now = Instant::now();
        q.offer(draft(c1, "a", 100), now).unwrap();
        q.offer(draft(c2, "b", 100), now).unwrap();
        // A's newer draft in another conversation replaces A's first.
        q.offer(draft(c2, "a", 120), now).unwrap();
        // (and B's, of the same conversation)
        assert_eq!(q.stats().waiting, 1);
        let p = plan(&mut q, false, &mut next);
        let (id, d) = p.start.unwrap();
        assert_eq!((d.conversation, d.prompt.len()), (c2, 120));
        // A sends in c2: the draft is not requeued when the send's plan interrupts it.
        q.forget(c2);
        let p = plan(&mut q, true, &mut next);
        assert_eq!(p.cancel, Some(id));
        q.apply(id, 0, 56, true, now);
        assert!(!q.has_work());
        // A newer draft of the conversation being warmed cancels the running one first.
        q.offer(draft(c1, "a", 100), now).unwrap();
        let id = plan(&mut q, false, &mut next).start.unwrap().0;
        q.offer(draft(c1, "a", 110), now).unwrap();
        let p = plan(&mut q, false, &mut next);
        assert_eq!((p.cancel, p.start), (Some(id), None));
        q.apply(id, 0, 100, true, now);
        let p = plan(&mut q, false, &mut next);
        assert_eq!(p.start.map(|(_, d)| d.prompt.len()), Some(110));
    }

    #[test]
    fn a_users_drafts_are_capped_per_minute_and_count_against_nothing_else() {
        let mut q = queue(600);
        let mut next = 100;
        let now = Instant::now();
        q.offer(draft(Uuid::now_v7(), "a", 600), now).unwrap();
        let id = plan(&mut q, false, &mut next).start.unwrap().0;
        q.apply(id, 600, 0, true, now);
        q.offer(draft(Uuid::now_v7(), "a", 600), now).unwrap();
        let id = plan(&mut q, false, &mut next).start.unwrap().0;
        q.apply(id, 600, 0, true, now);
        match q.offer(draft(Uuid::now_v7(), "a", 10), now) {
            Err(WarmRefused::UserLimit { used, limit }) => assert_eq!((used, limit), (1200, 1000)),
            other => panic!("{other:?}"),
        }
        // Another user is not affected; a minute later A may again.
        q.offer(draft(Uuid::now_v7(), "b", 10), now).unwrap();
        q.offer(
            draft(Uuid::now_v7(), "a", 10),
            now + Duration::from_secs(61),
        )
        .unwrap();
    }

    #[test]
    fn off_too_long_and_empty_drafts_are_refused() {
        let mut q = WarmQueue::new(WarmConfig::off(), 4096);
        let now = Instant::now();
        assert_eq!(
            q.offer(draft(Uuid::now_v7(), "a", 10), now),
            Err(WarmRefused::Off)
        );
        let mut q = queue(64);
        assert_eq!(
            q.offer(draft(Uuid::now_v7(), "a", 4096), now),
            Err(WarmRefused::TooLong {
                prompt_tokens: 4096,
                window: 4096
            })
        );
        assert_eq!(
            q.offer(draft(Uuid::now_v7(), "a", 0), now),
            Err(WarmRefused::Empty)
        );
        assert!(!q.has_work());
    }

    #[test]
    fn a_draft_waits_for_kv_blocks() {
        let mut q = queue(64);
        let now = Instant::now();
        q.offer(draft(Uuid::now_v7(), "a", 100), now).unwrap();
        // 101 tokens need 7 blocks of 16.
        let p = q.plan(false, Some(6), |t| t.div_ceil(16), || 1);
        assert_eq!(p, WarmPlan::default());
        let p = q.plan(false, Some(7), |t| t.div_ceil(16), || 1);
        assert!(p.start.is_some());
    }
}
