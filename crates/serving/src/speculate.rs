//! Speculative decoding: draft tokens proposed per sequence, verified by the model in the same
//! step as everyone else's work.
//!
//! A decoding sequence with drafts `d1..dk` steps `[last, d1..dk]` and asks for the logits of
//! every position. Its tokens are then drawn row by row exactly as plain decoding would draw
//! them (the same sampler, penalties, grammar and stop rules, in order): row 0 gives `t0`; when
//! `t0 == d1` the row after it was computed from the right token, so row 1 gives `t1`, and so on.
//! The first draw that differs from its draft (or the row after the last draft) ends the step:
//! `t0..tj` are output and the KV cache keeps `last, d1..dj`. Drawing from the model's own
//! distribution and keeping a draft only when the draw equals it is the standard rejection rule
//! for a draft of probability 1 (accept `d` with probability `p(d)`, else draw from `p` without
//! `d`), so the output distribution is the model's, and a seeded or greedy reply is the same
//! token for token (up to the float rounding of a multi-row step).
//!
//! Proposers implement [`Proposer`]: [`PromptLookup`] (an n-gram of the sequence's last tokens
//! found earlier in its own tokens, as llama.cpp's lookup decoding) proposes what followed it
//! there; where it finds nothing, [`NgramCache`] (counts of what followed short n-grams in the
//! same user's earlier replies, across their conversations) proposes the usual continuation. A
//! draft model would be another implementation.
//!
//! [`DraftControl`] sizes each sequence's drafts from its recent acceptance against the
//! break-even acceptance that [`StepCost`] measures from the worker's own steps: a draft position
//! is verified only when its expected yield in tokens is worth more than the seconds it adds, so
//! drafts shrink to nothing where they do not pay (a conversation that does not repeat itself, a
//! batch already compute-bound).

use std::collections::HashMap;

/// Settings (`scheduler.speculative`, `scheduler.draft_max`, …).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecConfig {
    pub enabled: bool,
    /// Most draft tokens one sequence verifies in a step.
    pub max_draft: usize,
    /// The longest n-gram looked up (longer first).
    pub max_ngram: usize,
    /// The shortest.
    pub min_ngram: usize,
    /// Drafts only in steps with at most this many decoding sequences: a hard cap on top of
    /// the measured rule ([`StepCost::break_even`]), which already stops drafting where a step
    /// is busy enough that extra positions cost more than they save.
    pub max_batch: usize,
    /// The acceptance a draft position needs, fixed instead of measured from the steps' cost
    /// (tests and benchmarks that must draft whatever the machine's timing; 0: always draft
    /// what a proposer finds).
    pub fixed_break_even: Option<f32>,
    /// Where prompt lookup finds nothing, draft from what followed the reply's last tokens in
    /// the same user's earlier replies ([`NgramCache`]).
    pub ngram_cache: bool,
    /// Draft on a GPU too. Off: measured on an H100, a verification step (every position's
    /// logits copied back, drawn on the host, outside the decode graphs) cost more than the
    /// accepted drafts saved, 0.2–0.5× at one conversation.
    pub on_gpu: bool,
}

/// Off: the model worker alone (tests, `smolchat generate`) runs without drafts unless asked;
/// the service's `scheduler.speculative` (on) is the product's default.
impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            enabled: false,
            max_draft: 8,
            max_ngram: 4,
            min_ngram: 2,
            max_batch: 16,
            fixed_break_even: None,
            ngram_cache: true,
            on_gpu: false,
        }
    }
}

/// Something that proposes what a sequence says next.
pub trait Proposer {
    /// Up to `max` tokens likely to follow `history` (the sequence's tokens, oldest first, the
    /// last one included); empty when it has no idea.
    fn propose(&self, history: &[u32], max: usize) -> Vec<u32>;
}

/// Prompt lookup: the most recent earlier occurrence of the history's last `n` tokens (longest
/// `n` first), and what followed it.
#[derive(Debug, Clone, Copy)]
pub struct PromptLookup {
    pub max_ngram: usize,
    pub min_ngram: usize,
}

impl Proposer for PromptLookup {
    fn propose(&self, history: &[u32], max: usize) -> Vec<u32> {
        if max == 0 {
            return Vec::new();
        }
        let len = history.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let tail = &history[len - n..];
            // The most recent match whose continuation is not the tail itself.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == tail {
                    let from = start + n;
                    let to = (from + max).min(len);
                    if from < to {
                        return history[from..to].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

/// What followed each short n-gram in a user's earlier replies, and how often: drafts for a
/// reply that does not repeat its own conversation but says what this user's replies said
/// before (greetings, list openings, code idioms, sign-offs). Looked up only when prompt lookup
/// finds nothing. Keys are 2- and 3-grams packed exactly into a `u64` (no hash collisions);
/// each keeps up to [`FOLLOWERS`] candidates with counts. Bounded: when the current generation
/// holds `capacity` keys it becomes the previous one and the one before is dropped, so memory
/// stays under two generations and what is used lately survives.
#[derive(Debug, Clone)]
pub struct NgramCache {
    current: HashMap<u64, Followers>,
    previous: HashMap<u64, Followers>,
    capacity: usize,
}

/// Candidates kept per n-gram.
const FOLLOWERS: usize = 4;
type Followers = [(u32, u16); FOLLOWERS];
/// Tokens must fit 21 bits to be packed (three to a key); larger ids are never learned.
const TOKEN_BITS: u32 = 21;
/// A 3-gram's continuation is drafted once seen this often and in this share of its
/// continuations; a 2-gram, which says less, needs more.
const MIN_COUNT_3: u32 = 2;
const MIN_SHARE_3: f32 = 0.6;
const MIN_COUNT_2: u32 = 3;
const MIN_SHARE_2: f32 = 0.75;

impl NgramCache {
    pub fn new(capacity: usize) -> Self {
        NgramCache {
            current: HashMap::new(),
            previous: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    fn key(gram: &[u32]) -> Option<u64> {
        let mut key = gram.len() as u64; // n in the low bits keeps 2- and 3-grams apart
        for &t in gram {
            if t >= 1 << TOKEN_BITS {
                return None;
            }
            key = (key << TOKEN_BITS) | u64::from(t);
        }
        Some(key)
    }

    /// Learns every 2- and 3-gram of `tokens` and what followed it.
    pub fn learn(&mut self, tokens: &[u32]) {
        for i in 2..tokens.len() {
            let next = tokens[i];
            for n in [2, 3] {
                if i < n {
                    continue;
                }
                if let Some(key) = Self::key(&tokens[i - n..i]) {
                    self.count(key, next);
                }
            }
        }
    }

    fn count(&mut self, key: u64, next: u32) {
        if !self.current.contains_key(&key) && self.current.len() >= self.capacity {
            self.previous = std::mem::take(&mut self.current);
        }
        let followers = self.current.entry(key).or_insert_with(|| {
            // Carry what the previous generation knew of this n-gram.
            self.previous
                .get(&key)
                .copied()
                .unwrap_or([(0, 0); FOLLOWERS])
        });
        if let Some(slot) = followers.iter_mut().find(|(t, c)| *c > 0 && *t == next) {
            slot.1 = slot.1.saturating_add(1);
        } else if let Some(slot) = followers.iter_mut().min_by_key(|(_, c)| *c) {
            // Full: the rarest candidate makes way.
            *slot = (next, 1);
        }
    }

    /// The token that followed `gram` often enough to draft, if any.
    fn follower(&self, gram: &[u32], min_count: u32, min_share: f32) -> Option<u32> {
        let key = Self::key(gram)?;
        let followers = self.current.get(&key).or_else(|| self.previous.get(&key))?;
        let total: u32 = followers.iter().map(|(_, c)| u32::from(*c)).sum();
        let (token, count) = followers.iter().max_by_key(|(_, c)| *c)?;
        let count = u32::from(*count);
        (count >= min_count && count as f32 >= min_share * total as f32).then_some(*token)
    }

    /// Distinct n-grams known (both generations).
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Proposer for NgramCache {
    /// Token by token: the follower of the tip's 3-gram, else of its 2-gram, while one is
    /// confident enough.
    fn propose(&self, history: &[u32], max: usize) -> Vec<u32> {
        let mut tip: Vec<u32> = history[history.len().saturating_sub(3)..].to_vec();
        let mut drafts = Vec::new();
        while drafts.len() < max {
            let n = tip.len();
            let next = (n >= 3)
                .then(|| self.follower(&tip[n - 3..], MIN_COUNT_3, MIN_SHARE_3))
                .flatten()
                .or_else(|| {
                    (n >= 2)
                        .then(|| self.follower(&tip[n - 2..], MIN_COUNT_2, MIN_SHARE_2))
                        .flatten()
                });
            let Some(next) = next else { break };
            drafts.push(next);
            tip.push(next);
            if tip.len() > 3 {
                tip.remove(0);
            }
        }
        drafts
    }
}

/// One [`NgramCache`] per user (requests without a user share one), so that drafts never come
/// from another account's replies: a draft never changes a reply, but how fast a reply comes
/// could tell one user what another's said. The least recently used user's cache goes first.
#[derive(Debug, Clone)]
pub struct UserNgrams {
    caches: HashMap<String, (NgramCache, u64)>,
    /// Most users with a cache at once, and n-grams per generation of each.
    max_users: usize,
    capacity: usize,
    clock: u64,
}

impl UserNgrams {
    pub fn new(max_users: usize, capacity: usize) -> Self {
        UserNgrams {
            caches: HashMap::new(),
            max_users: max_users.max(1),
            capacity,
            clock: 0,
        }
    }

    /// The user's cache, if they have one.
    pub fn get(&mut self, user: Option<&str>) -> Option<&NgramCache> {
        self.clock += 1;
        let clock = self.clock;
        self.caches
            .get_mut(user.unwrap_or(""))
            .map(|(cache, used)| {
                *used = clock;
                &*cache
            })
    }

    /// Learns a finished reply of `user`.
    pub fn learn(&mut self, user: Option<&str>, reply: &[u32]) {
        if reply.len() < 3 {
            return;
        }
        self.clock += 1;
        let user = user.unwrap_or("");
        if !self.caches.contains_key(user) && self.caches.len() >= self.max_users {
            let oldest = self
                .caches
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(u, _)| u.clone());
            if let Some(oldest) = oldest {
                self.caches.remove(&oldest);
            }
        }
        let capacity = self.capacity;
        let (cache, used) = self
            .caches
            .entry(user.to_string())
            .or_insert_with(|| (NgramCache::new(capacity), 0));
        cache.learn(reply);
        *used = self.clock;
    }
}

/// One sequence's drafting: how likely its next draft token is to be accepted, learned from its
/// recent verifications.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftControl {
    /// Moving average of the chance that a draft position is accepted given that the one before
    /// it was (a draft's positions are tried in order and the first rejection ends the rest).
    acceptance: f32,
    pub drafted: u64,
    pub accepted: u64,
}

impl Default for DraftControl {
    fn default() -> Self {
        DraftControl {
            acceptance: PRIOR_ACCEPTANCE,
            drafted: 0,
            accepted: 0,
        }
    }
}

/// A sequence nobody has measured yet: hopeful enough to try a few draft tokens.
const PRIOR_ACCEPTANCE: f32 = 0.5;
/// Weight of the latest verification in the moving average.
const EMA: f32 = 0.3;
/// While a sequence does not draft, its acceptance drifts back toward the prior by this share
/// each step, so a conversation that stopped repeating itself is tried again now and then
/// (one short draft every twenty-odd steps) rather than never. Measured on free chat through the
/// server (2 Zen 2 cores, SmolLM2): at twice this rate the trial drafts, nearly all rejected,
/// cost 2%.
const HOPE: f32 = 0.01;
/// A draft position must beat the break-even acceptance by this factor: measured costs are
/// noisy, and a position that only breaks even is not worth the risk.
const MARGIN: f32 = 1.1;
/// Nor is a position that would be accepted less often than this, cheap as it may look.
const MIN_REACH: f32 = 0.05;

impl DraftControl {
    /// How many draft tokens are worth verifying now, at most `max` (0: do not draft this
    /// step). `break_even` is the acceptance at which one more position pays for itself (see
    /// [`StepCost::break_even`]): position `i` of a draft is accepted with probability about
    /// `acceptance^i`, so the draft grows while that stays above it.
    pub fn draft_len(&mut self, max: usize, break_even: f32) -> usize {
        if max == 0 {
            // No room for drafts in this step: nothing was decided.
            return 0;
        }
        let need = (break_even.max(0.0) * MARGIN).max(MIN_REACH);
        let a = self.acceptance.clamp(0.0, 0.98);
        let mut len = 0;
        let mut reach = a;
        while len < max && reach > need {
            len += 1;
            reach *= a;
        }
        if len == 0 {
            self.acceptance += HOPE * (PRIOR_ACCEPTANCE - self.acceptance);
        }
        len
    }

    /// Records a verification: `drafted` tokens proposed, the first `accepted` of them kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let accepted = accepted.min(drafted);
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        // Positions tried: every accepted one, and the one that was rejected (if any).
        let tried = (accepted + 1).min(drafted);
        let rate = accepted as f32 / tried as f32;
        self.acceptance = (1.0 - EMA) * self.acceptance + EMA * rate;
    }

    /// The share of drafted tokens accepted so far (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// What a decode step costs, learned from the steps the worker runs: `seconds ≈ fixed +
/// per_position × positions`. On the CPU `fixed` is mostly streaming the weights (memory-bound)
/// and `per_position` the arithmetic each extra position adds; as the batch grows a step turns
/// compute-bound and drafts stop paying. A weighted least-squares line over the recent
/// decode-only steps (older ones fade), anchored by a prior from the first step so that a
/// worker that has only ever seen one batch size still has a slope.
///
/// The real curve is not a line (on the SmolLM3-3B shape on 2 Zen 2 cores a second position is
/// free: 2 positions cost 0.98× one, 4 cost 1.46×, 8 cost 2.53×). A faded mean per position
/// count, with the difference of neighbouring counts as the marginal cost, was tried and not
/// kept: steps of one count come from conversations of other lengths than steps of the next
/// (attention grows with the context), and the differences priced drafts wrongly (free chat
/// in `bench --speculative` fell from 1.14× to 0.98×).
#[derive(Debug, Clone, Default)]
pub struct StepCost {
    /// Exponentially faded sums over observed steps: weight, Σx, Σy, Σx², Σxy.
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// `(fixed, per_position)` guessed from the first step.
    prior: Option<(f64, f64)>,
}

/// Each new step fades the older ones by this factor (about the last 50 steps count).
const COST_FADE: f64 = 0.98;
/// Before any slope is measured: one position's share of a one-position step (measured on
/// 2 Zen 2 cores with SmolLM2-135M: about 0.18; a larger model is more memory-bound, lower).
const PRIOR_POSITION_SHARE: f64 = 0.2;
/// How many observations the prior is worth.
const PRIOR_WEIGHT: f64 = 2.0;

impl StepCost {
    /// Records a decode-only step of `positions` positions that took `seconds`.
    pub fn observe(&mut self, positions: usize, seconds: f64) {
        if positions == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let x = positions as f64;
        let mut y = seconds;
        match self.line() {
            // A step the machine stalled in (another process, a page fault) says little about
            // the model: at most three times the prediction counts.
            Some((fixed, per)) => y = y.min(3.0 * (fixed + per * x)),
            None => {
                let per = y / ((1.0 - PRIOR_POSITION_SHARE) / PRIOR_POSITION_SHARE + x);
                let fixed = per * (1.0 - PRIOR_POSITION_SHARE) / PRIOR_POSITION_SHARE;
                self.prior = Some((fixed, per));
            }
        }
        self.w = self.w * COST_FADE + 1.0;
        self.sx = self.sx * COST_FADE + x;
        self.sy = self.sy * COST_FADE + y;
        self.sxx = self.sxx * COST_FADE + x * x;
        self.sxy = self.sxy * COST_FADE + x * y;
    }

    /// `(fixed, per_position)` seconds, or `None` before the first step.
    pub fn line(&self) -> Option<(f64, f64)> {
        let (pf, pp) = self.prior?;
        // The prior as two half-weight points on its line, at one and at nine positions.
        let half = PRIOR_WEIGHT / 2.0;
        let (x1, y1, x9, y9) = (1.0, pf + pp, 9.0, pf + 9.0 * pp);
        let w = self.w + PRIOR_WEIGHT;
        let sx = self.sx + half * (x1 + x9);
        let sy = self.sy + half * (y1 + y9);
        let sxx = self.sxx + half * (x1 * x1 + x9 * x9);
        let sxy = self.sxy + half * (x1 * y1 + x9 * y9);
        let det = w * sxx - sx * sx;
        if det <= f64::EPSILON {
            return Some((pf, pp));
        }
        let mean_y = sy / w;
        // A slope measured negative is noise: a position never costs less than nothing.
        let per = ((w * sxy - sx * sy) / det).max(mean_y * 1e-3);
        let fixed = ((sy - per * sx) / w).max(0.0);
        Some((fixed, per))
    }

    /// The acceptance at which one more draft position pays for itself in a step of `batch`
    /// decoding sequences: a position costs `per_position` seconds and yields its acceptance
    /// in tokens, while without drafts a token costs the step's seconds over `batch`. So the
    /// break-even is `per_position × batch / (fixed + per_position × batch)`: low for one
    /// conversation on a memory-bound step, near 1 for a busy, compute-bound one. `None`
    /// before any step was measured.
    pub fn break_even(&self, batch: usize) -> Option<f32> {
        let (fixed, per) = self.line()?;
        let busy = per * batch.max(1) as f64;
        Some((busy / (fixed + busy)) as f32)
    }
}

/// How many leading drafts the drawn tokens confirm: `drawn[i]` was drawn from the row whose
/// input was `drafts[i - 1]` (row 0's input is the sequence's last token), so draft `i` stands
/// when `drawn[i] == drafts[i]`.
pub fn accepted_prefix(drafts: &[u32], drawn: &[u32]) -> usize {
    drafts.iter().zip(drawn).take_while(|(d, t)| d == t).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup() -> PromptLookup {
        PromptLookup {
            max_ngram: 3,
            min_ngram: 1,
        }
    }

    #[test]
    fn prompt_lookup_continues_the_latest_earlier_match() {
        // "a b c d e ... a b c" → propose "d e" (what followed "a b c").
        let h = [1, 2, 3, 4, 5, 9, 1, 2, 3];
        assert_eq!(lookup().propose(&h, 2), vec![4, 5]);
        assert_eq!(lookup().propose(&h, 10), vec![4, 5, 9, 1, 2, 3]);
        // The latest match wins: "7 8" followed by 1 first, then by 2.
        let h = [7, 8, 1, 7, 8, 2, 7, 8];
        assert_eq!(lookup().propose(&h, 1), vec![2]);
        // Longer n-grams first: "5 6" matches at 0 (→ 7), "6" alone later (→ 9).
        let h = [5, 6, 7, 6, 9, 5, 6];
        assert_eq!(lookup().propose(&h, 1), vec![7]);
        // Nothing repeats: no draft; and max 0 is no draft.
        assert!(lookup().propose(&[1, 2, 3, 4], 4).is_empty());
        assert!(lookup().propose(&[1, 2, 1, 2], 0).is_empty());
        assert!(lookup().propose(&[], 4).is_empty());
        let two = PromptLookup {
            max_ngram: 3,
            min_ngram: 2,
        };
        assert!(
            two.propose(&[1, 9, 1], 4).is_empty(),
            "1-grams are below min_ngram"
        );
    }

    #[test]
    fn drafts_grow_with_acceptance_and_stop_when_they_do_not_pay() {
        let mut c = DraftControl::default();
        // The prior (0.5) at a break-even of 0.18: positions while 0.5^i > 0.198.
        assert_eq!(c.draft_len(8, 0.18), 2);
        for _ in 0..8 {
            let n = c.draft_len(8, 0.2);
            c.record(n, n);
        }
        assert_eq!(c.draft_len(8, 0.2), 8, "all accepted: full length");
        assert!(c.draft_len(8, 0.85) < 8, "a busier step drafts less");
        // Rejected again and again: drafting all but stops, with a short draft tried again
        // now and then (one position every twenty-odd steps).
        let mut drafting_steps = 0;
        let mut positions = 0;
        for step in 0..200 {
            let n = c.draft_len(8, 0.2);
            if n > 0 {
                c.record(n, 0);
                if step >= 20 {
                    drafting_steps += 1;
                    positions += n;
                }
            }
        }
        assert!((5..=25).contains(&drafting_steps), "{drafting_steps}");
        assert_eq!(positions, drafting_steps, "one position at a time");
        // Never past the break-even of a compute-bound step (a position worth 0.99 tokens).
        let mut sure = DraftControl::default();
        for _ in 0..20 {
            sure.record(4, 4);
        }
        assert_eq!(sure.draft_len(8, 0.95), 0);
        assert!(c.acceptance_rate() > 0.0 && c.acceptance_rate() < 1.0);
    }

    #[test]
    fn the_step_cost_line_is_learned_and_sets_the_break_even() {
        let mut cost = StepCost::default();
        assert_eq!(cost.break_even(1), None);
        // One batch size seen so far: the prior's slope.
        cost.observe(1, 0.010);
        let (fixed, per) = cost.line().expect("a line");
        assert!((fixed + per - 0.010).abs() < 1e-9);
        assert!((per / (fixed + per) - PRIOR_POSITION_SHARE).abs() < 1e-6);
        // Steps on the line 5 ms + 1 ms a position, at assorted sizes: learned.
        for i in 0..200 {
            let x = 1 + i % 9;
            cost.observe(x, 0.005 + 0.001 * x as f64);
        }
        let (fixed, per) = cost.line().expect("a line");
        assert!((fixed - 0.005).abs() < 3e-4, "{fixed}");
        assert!((per - 0.001).abs() < 1e-4, "{per}");
        let one = cost.break_even(1).expect("measured");
        let eight = cost.break_even(8).expect("measured");
        assert!((one - 1.0 / 6.0).abs() < 0.02, "{one}");
        // (The prior, two points on a steeper line, still pulls a little.)
        assert!((eight - 8.0 / 13.0).abs() < 0.04, "{eight}");
        // A stalled step counts for at most three predictions; the line barely moves.
        cost.observe(1, 10.0);
        let (_, after) = cost.line().expect("a line");
        assert!((after - per).abs() < 3e-4, "{after}");
        // Nonsense is ignored.
        cost.observe(0, 1.0);
        cost.observe(3, f64::NAN);
        cost.observe(3, -1.0);
        assert!(cost.line().is_some());
    }

    #[test]
    fn the_ngram_cache_drafts_the_usual_continuation() {
        let mut cache = NgramCache::new(1024);
        // "1 2 3 4 5" three times, once "1 2 3 9".
        for _ in 0..3 {
            cache.learn(&[7, 1, 2, 3, 4, 5, 8]);
        }
        cache.learn(&[6, 1, 2, 3, 9]);
        // After "1 2 3": 4 (3 of 4 times), then "2 3 4" → 5, "3 4 5" → 8.
        assert_eq!(cache.propose(&[0, 1, 2, 3], 8), vec![4, 5, 8]);
        assert_eq!(cache.propose(&[0, 1, 2, 3], 2), vec![4, 5]);
        assert!(cache.propose(&[0, 1, 2, 3], 0).is_empty());
        // Seen once only: not confident enough.
        assert!(cache.propose(&[6, 1], 4).is_empty());
        // Only a 2-gram known (the tip's 3-gram is new): it needs three sightings.
        assert_eq!(cache.propose(&[42, 4, 5], 1), vec![8]);
        let mut once = NgramCache::new(1024);
        once.learn(&[1, 2, 3, 1, 2, 3]);
        assert!(
            once.propose(&[42, 1, 2], 1).is_empty(),
            "{:?}",
            once.propose(&[42, 1, 2], 1)
        );
        // Split continuations: no majority, no draft.
        let mut split = NgramCache::new(1024);
        for next in [4, 5, 4, 5] {
            split.learn(&[1, 2, 3, next]);
        }
        assert!(split.propose(&[1, 2, 3], 1).is_empty());
        // Short histories and unpackable token ids are no trouble.
        assert!(cache.propose(&[], 4).is_empty());
        assert!(cache.propose(&[3], 4).is_empty());
        cache.learn(&[1 << 22, 1, 2, 1 << 22]);
    }

    #[test]
    fn the_ngram_cache_is_bounded_and_per_user() {
        let mut cache = NgramCache::new(8);
        for i in 0..100u32 {
            cache.learn(&[i, i + 1, i + 2, i + 3]);
        }
        assert!(
            cache.len() <= 16,
            "two generations of 8 at most: {}",
            cache.len()
        );
        // What is used lately survives a turnover.
        for _ in 0..3 {
            cache.learn(&[500, 501, 502, 503]);
        }
        assert_eq!(cache.propose(&[500, 501, 502], 1), vec![503]);

        let mut users = UserNgrams::new(2, 1024);
        for _ in 0..3 {
            users.learn(Some("alice"), &[1, 2, 3, 4]);
        }
        let alice = users.get(Some("alice")).map(|c| c.propose(&[1, 2, 3], 1));
        assert_eq!(alice, Some(vec![4]));
        assert!(
            users.get(Some("bob")).is_none(),
            "bob drafts nothing from alice's replies"
        );
        users.learn(Some("bob"), &[5, 6, 7]);
        users.learn(None, &[5, 6, 7]);
        // Three users at a cap of two: the least recently used (alice) went.
        assert!(users.get(Some("alice")).is_none());
        assert!(users.get(Some("bob")).is_some() && users.get(None).is_some());
    }

    #[test]
    fn the_accepted_prefix_stops_at_the_first_difference() {
        assert_eq!(accepted_prefix(&[4, 5, 6], &[4, 5, 7, 1]), 2);
        assert_eq!(accepted_prefix(&[4, 5, 6], &[4, 5, 6, 1]), 3);
        assert_eq!(accepted_prefix(&[4], &[3]), 0);
        assert_eq!(accepted_prefix(&[], &[3]), 0);
    }
}
