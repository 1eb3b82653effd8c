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
//! there. A draft model would be another implementation.
//!
//! [`DraftControl`] sizes each sequence's drafts from its recent acceptance, and stops drafting
//! (for a while) where drafts do not pay.

/// Settings (`scheduler.speculative`, `scheduler.draft_max`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub enabled: bool,
    /// Most draft tokens one sequence verifies in a step.
    pub max_draft: usize,
    /// The longest n-gram looked up (longer first).
    pub max_ngram: usize,
    /// The shortest.
    pub min_ngram: usize,
    /// Drafts only in steps with at most this many decoding sequences: beyond it a step is
    /// already busy enough that extra positions cost more than they save.
    pub max_batch: usize,
    /// Draft on a GPU too. Off: measured on an H100, a verification step (every position's
    /// logits copied back, drawn on the host, outside the decode graphs) cost more than the
    /// accepted drafts saved, 0.2–0.5× at one conversation.
    pub on_gpu: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            enabled: false,
            max_draft: 8,
            max_ngram: 4,
            min_ngram: 2,
            max_batch: 2,
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

/// One sequence's drafting: how long its drafts may be, from how many were accepted lately.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftControl {
    /// Moving average of the share of drafted tokens accepted.
    acceptance: f32,
    /// Steps left before drafting is tried again after it stopped paying.
    cooldown: u32,
    pub drafted: u64,
    pub accepted: u64,
}

impl Default for DraftControl {
    fn default() -> Self {
        DraftControl {
            // Optimistic: the first drafts are tried at full length.
            acceptance: 0.6,
            cooldown: 0,
            drafted: 0,
            accepted: 0,
        }
    }
}

/// Below this acceptance drafts cost more than they save (each rejected position is computed
/// for nothing); drafting pauses for [`COOLDOWN_STEPS`].
const MIN_ACCEPTANCE: f32 = 0.15;
const COOLDOWN_STEPS: u32 = 16;
/// Weight of the latest step in the moving average.
const EMA: f32 = 0.3;

impl DraftControl {
    /// The longest draft worth verifying now, at most `max` (0: do not draft this step).
    pub fn draft_len(&mut self, max: usize) -> usize {
        if self.cooldown > 0 {
            self.cooldown -= 1;
            return 0;
        }
        // Expected accepted length of a draft grows with the acceptance rate; a draft a bit
        // longer than that is cheap on a memory-bound step.
        let a = self.acceptance.clamp(0.0, 0.95);
        let expected = a / (1.0 - a);
        ((expected * 2.0).ceil() as usize)
            .clamp(1, max.max(1))
            .min(max)
    }

    /// Records a verification: `drafted` tokens proposed, `accepted` of them kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        let rate = accepted as f32 / drafted as f32;
        self.acceptance = (1.0 - EMA) * self.acceptance + EMA * rate;
        if self.acceptance < MIN_ACCEPTANCE {
            self.cooldown = COOLDOWN_STEPS;
            // Come back hopeful enough to try a short draft.
            self.acceptance = MIN_ACCEPTANCE * 2.0;
        }
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
    fn drafts_grow_with_acceptance_and_pause_when_they_do_not_pay() {
        let mut c = DraftControl::default();
        let first = c.draft_len(8);
        assert!(first >= 2, "{first}");
        for _ in 0..6 {
            let n = c.draft_len(8);
            c.record(n, n);
        }
        assert_eq!(c.draft_len(8), 8, "all accepted: full length");
        for _ in 0..8 {
            let n = c.draft_len(8);
            if n > 0 {
                c.record(n, 0);
            }
        }
        // Rejected again and again: drafting pauses, then tries a short draft.
        let mut paused = 0;
        let mut next = 0;
        for _ in 0..COOLDOWN_STEPS + 1 {
            next = c.draft_len(8);
            if next == 0 {
                paused += 1;
            }
        }
        assert!(paused >= COOLDOWN_STEPS - 8, "{paused}");
        assert!((1..=2).contains(&next), "{next}");
        assert!(c.acceptance_rate() > 0.0 && c.acceptance_rate() < 1.0);
    }

    #[test]
    fn the_accepted_prefix_stops_at_the_first_difference() {
        assert_eq!(accepted_prefix(&[4, 5, 6], &[4, 5, 7, 1]), 2);
        assert_eq!(accepted_prefix(&[4, 5, 6], &[4, 5, 6, 1]), 3);
        assert_eq!(accepted_prefix(&[4], &[3]), 0);
        assert_eq!(accepted_prefix(&[], &[3]), 0);
    }
}
