//! Choosing the next token from a row of logits, and finding stop strings in streamed text.
//!
//! The sampler chain is: penalties (repetition, presence, frequency) → greedy, or temperature →
//! top-k → top-p → min-p → a seeded draw. This is the order Hugging Face transformers applies its
//! logits warpers in (llama.cpp applies temperature last instead); with the default temperature
//! below 1 the difference is small, and it is the order clients of an OpenAI-style API expect.
//!
//! Vocabularies reach 128k tokens, so nothing here sorts the whole vocabulary when it can be
//! avoided: top-k is a linear-time selection, min-p is a threshold, and top-p sorts only the
//! candidates near its cut.

use std::cmp::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TextError};

/// How one request wants its tokens chosen and when it wants generation to end.
///
/// Missing fields in JSON take their defaults, so a client can send only what it changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax), and then the seed does not matter.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 turns it
    /// off. Must be in (0, 1].
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the best token's; 0 turns it off.
    pub min_p: f32,
    /// llama.cpp / CTRL repetition penalty over the last `penalty_last_n` tokens: a positive
    /// logit is divided by it, a negative one multiplied. 1 turns it off.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from every token seen in the window.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted once per occurrence in the window.
    pub frequency_penalty: f32,
    /// How many of the most recent tokens the penalties look at; 0 turns all penalties off.
    pub penalty_last_n: usize,
    /// Seed for the random draw; `None` seeds from the operating system.
    pub seed: Option<u64>,
    /// Generation ends after this many new tokens.
    pub max_new_tokens: usize,
    /// Generation ends before the first occurrence of any of these strings in the output.
    pub stop_strings: Vec<String>,
    /// Keep generating past end-of-sequence tokens (for benchmarks and tests); the caller honours
    /// it when it checks [`StopTokens`].
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many most likely alternatives
    /// (0 to [`MAX_TOP_LOGPROBS`]); `None`: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
    /// What the reply must match (JSON Schema, any JSON object, a grammar, a regex); see
    /// [`crate::constraint`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grammar: Option<crate::constraint::Grammar>,
}

/// The most alternatives a token's log-probabilities may list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability under the model (its raw logits: before penalties,
/// temperature and filters, as vLLM reports them) and the most likely tokens at that step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// (token, log-probability), most likely first, ties by lowest id.
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities of `chosen` and of the `top` most likely tokens over `logits` (a log
/// softmax; NaN counts as impossible).
pub fn logprobs_of(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let usable = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = logits
        .iter()
        .map(|&l| usable(l))
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .map(|&l| f64::from(usable(l) - max).exp())
        .sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |l: f32| (f64::from(usable(l)) - lse) as f32;
    let mut best: Vec<(f32, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (usable(l), i as u32))
        .collect();
    let top = top.min(best.len());
    if top > 0 && top < best.len() {
        best.select_nth_unstable_by(top - 1, desc);
    }
    best.truncate(top);
    best.sort_by(desc);
    TokenLogprobs {
        token: chosen,
        logprob: logits
            .get(chosen as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best.into_iter().map(|(l, id)| (id, lp(l))).collect(),
    }
}

impl Default for SamplingParams {
    /// llama-server's defaults, so answers look like what users of llama.cpp are used to.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
            max_new_tokens: 512,
            stop_strings: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            grammar: None,
        }
    }
}

impl SamplingParams {
    /// Plain argmax decoding with the other defaults.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks every field and says which one is wrong and what range it must be in.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(TextError::Sampling(msg));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0 (0 = greedy), got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!(
                "top_p must be in (0, 1] (1 = off), got {}",
                self.top_p
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!(
                "min_p must be in [0, 1] (0 = off), got {}",
                self.min_p
            ));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be a finite number > 0 (1 = off), got {}",
                self.repetition_penalty
            ));
        }
        if !self.presence_penalty.is_finite() {
            return bad(format!(
                "presence_penalty must be a finite number (0 = off), got {}",
                self.presence_penalty
            ));
        }
        if !self.frequency_penalty.is_finite() {
            return bad(format!(
                "frequency_penalty must be a finite number (0 = off), got {}",
                self.frequency_penalty
            ));
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens must be at least 1".to_string());
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return bad(format!(
                "top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"
            ));
        }
        if let Some(i) = self.stop_strings.iter().position(|s| s.is_empty()) {
            // An empty stop string would match before the first character and end every reply.
            return bad(format!("stop string #{i} is empty; remove it"));
        }
        Ok(())
    }

    fn penalties_active(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

/// One token's draw for a device that samples (see [`Sampler::device_draw`]): penalties over
/// `penalties` (token, occurrences), then greedy when `temperature` is 0, else top-k,
/// temperature, min-p and top-p as [`Sampler::sample`] applies them, and `uniform` in `[0, 1)`
/// picks the token.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceDraw {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub penalties: Vec<(u32, u32)>,
    pub uniform: f64,
}

/// Descending by value, then ascending by token id, so equal values always come out in the same
/// order and a seeded draw is reproducible.
fn desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Draws tokens for one sequence. Holds the RNG so a seeded sequence is reproducible token after
/// token, and scratch buffers so sampling does not allocate per token.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// (value, token id) candidates; the value is a logit, then an unnormalised probability.
    candidates: Vec<(f32, u32)>,
    /// Scratch for top-p's boundary bucket.
    boundary: Vec<(f32, u32)>,
    window: Vec<u32>,
    warned_nan: bool,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// Validates `params` and seeds the RNG (from the OS when no seed is given).
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Self {
            params,
            rng,
            candidates: Vec::new(),
            boundary: Vec::new(),
            window: Vec::new(),
            warned_nan: false,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token.
    ///
    /// `recent_tokens` is the sequence so far (prompt and output, oldest first); only its last
    /// `penalty_last_n` tokens are penalised. On return `logits` holds the penalised logits with
    /// NaN replaced by -inf and +inf by `f32::MAX`; temperature and the filters are not written
    /// back. Errors when no token has a usable logit or a recent token is outside the vocabulary.
    pub fn sample(&mut self, logits: &mut [f32], recent_tokens: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(TextError::Sampling("the logits row is empty".to_string()));
        }
        if u32::try_from(logits.len()).is_err() {
            return Err(TextError::Sampling(format!(
                "a vocabulary of {} tokens does not fit u32 token ids",
                logits.len()
            )));
        }
        self.sanitize(logits);
        self.apply_penalties(logits, recent_tokens)?;
        if self.greedy() {
            return argmax(logits);
        }
        self.sample_filtered(logits)
    }

    /// A broken model (or an overflowing kernel) can produce NaN; such a token is never chosen,
    /// and +inf becomes the largest finite value so the softmax below stays finite.
    fn sanitize(&mut self, logits: &mut [f32]) {
        let mut nans = 0usize;
        for l in logits.iter_mut() {
            if l.is_nan() {
                *l = f32::NEG_INFINITY;
                nans += 1;
            } else if *l == f32::INFINITY {
                *l = f32::MAX;
            }
        }
        if nans > 0 && !self.warned_nan {
            // Once per sequence: every later token of a broken model would repeat it.
            self.warned_nan = true;
            tracing::warn!(
                nans,
                vocab = logits.len(),
                "logits contain NaN; those tokens are treated as impossible"
            );
        }
    }

    /// The penalty window of `recent` as (token, occurrences) pairs, ascending by token; empty
    /// when the penalties are off. Sorting the (at most `penalty_last_n`) window counts
    /// occurrences without a vocabulary-sized table.
    fn window_counts(&mut self, recent: &[u32]) -> Vec<(u32, u32)> {
        let p = &self.params;
        if !p.penalties_active() || recent.is_empty() {
            return Vec::new();
        }
        let start = recent.len().saturating_sub(p.penalty_last_n);
        self.window.clear();
        self.window.extend_from_slice(&recent[start..]);
        self.window.sort_unstable();
        let mut counts: Vec<(u32, u32)> = Vec::new();
        for &id in &self.window {
            match counts.last_mut() {
                Some((last, n)) if *last == id => *n += 1,
                _ => counts.push((id, 1)),
            }
        }
        counts
    }

    fn apply_penalties(&mut self, logits: &mut [f32], recent: &[u32]) -> Result<()> {
        let vocab = logits.len();
        for (id, count) in self.window_counts(recent) {
            let p = &self.params;
            let l = logits
                .get_mut(id as usize)
                .ok_or(TextError::BadToken { id, vocab })?;
            if *l > 0.0 {
                *l /= p.repetition_penalty;
            } else {
                *l *= p.repetition_penalty;
            }
            *l -= count as f32 * p.frequency_penalty + p.presence_penalty;
        }
        Ok(())
    }

    /// How a device that draws tokens itself should choose the next token after `recent`
    /// (as for [`Self::sample`]): the parameters, the penalty window, and the uniform draw,
    /// taken from this sampler's generator exactly when [`Self::sample`] would take one (not
    /// for greedy rows), so a seeded sequence stays reproducible. The device orders the
    /// candidates by token id rather than by probability before the draw, so a seeded reply
    /// there is its own reproducible sequence, not the host's.
    pub fn device_draw(&mut self, recent: &[u32]) -> DeviceDraw {
        let uniform = self.take_draw();
        self.draw_with(recent, uniform)
    }

    /// Whether tokens are chosen by argmax (no uniform is drawn for them).
    fn greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == 1
    }

    /// [`Self::device_draw`] with the uniform given.
    fn draw_with(&mut self, recent: &[u32], uniform: f64) -> DeviceDraw {
        let penalties = self.window_counts(recent);
        let greedy = self.greedy();
        let p = &self.params;
        let (repetition_penalty, presence_penalty, frequency_penalty) = if penalties.is_empty() {
            (1.0, 0.0, 0.0)
        } else {
            (
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            )
        };
        DeviceDraw {
            temperature: if greedy { 0.0 } else { p.temperature },
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            penalties,
            uniform,
        }
    }

    /// The draws of `drafts.len() + 1` consecutive tokens after `recent`, as [`Self::device_draw`]
    /// would make them if each draft were accepted in turn (row `j`'s penalty window holds the
    /// first `j` drafts), without taking anything from this sampler's generator: the uniforms
    /// are the next ones it would give. Verifying drafts on a device: only the rows whose tokens
    /// are kept take their uniform, through [`Self::take_draw`], so a seeded reply is the same
    /// with drafts and without.
    pub fn peek_draws(&mut self, recent: &[u32], drafts: &[u32]) -> Vec<DeviceDraw> {
        let greedy = self.greedy();
        let mut ahead = self.rng.clone();
        let mut history: Vec<u32> = recent.to_vec();
        let mut draws = Vec::with_capacity(drafts.len() + 1);
        for j in 0..=drafts.len() {
            let uniform = if greedy { 0.0 } else { ahead.random() };
            draws.push(self.draw_with(&history, uniform));
            if let Some(&d) = drafts.get(j) {
                history.push(d);
            }
        }
        draws
    }

    /// The draw of the token that follows `pending` tokens drawn and not yet kept (their
    /// uniforms not yet taken), when it does not depend on them: `None` when penalties look
    /// back at the tokens before it. Nothing is taken from the generator; the draw's uniform is
    /// the one after the `pending` ones, taken when its token is kept ([`Self::take_draw`]).
    /// What launching a decode step before the previous step's token is known needs.
    pub fn peek_draw_after(&mut self, pending: usize) -> Option<DeviceDraw> {
        if self.params.penalties_active() {
            return None;
        }
        let uniform = if self.greedy() {
            0.0
        } else {
            let mut ahead = self.rng.clone();
            for _ in 0..pending {
                let _: f64 = ahead.random();
            }
            ahead.random()
        };
        Some(self.draw_with(&[], uniform))
    }

    /// Takes the uniform of one draw from the generator (0 for greedy rows, which take none): a
    /// plain draw's ([`Self::device_draw`]) or a peeked row's whose token is kept
    /// ([`Self::peek_draws`]).
    pub fn take_draw(&mut self) -> f64 {
        if self.greedy() {
            0.0
        } else {
            self.rng.random()
        }
    }

    fn sample_filtered(&mut self, logits: &[f32]) -> Result<u32> {
        let p = &self.params;
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, &l)| l > f32::NEG_INFINITY)
                .map(|(i, &l)| (l, i as u32)),
        );
        if c.is_empty() {
            return Err(no_usable_logit());
        }
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, desc);
            c.truncate(p.top_k);
        }
        let max = c.iter().map(|x| x.0).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / p.temperature;
        // Subtracting the maximum before dividing by the temperature keeps every exponent <= 0,
        // so nothing overflows even for huge logits or tiny temperatures; the best token's weight
        // is exactly 1.
        let mut total = 0.0f64;
        for x in c.iter_mut() {
            x.0 = ((x.0 - max) * inv_t).exp();
            total += x.0 as f64;
        }
        if p.min_p > 0.0 {
            // Relative to the best token's weight, which is 1; renormalising by top-p does not
            // change these ratios, so filtering first gives the same set as filtering last.
            let min_p = p.min_p;
            c.retain(|x| x.0 >= min_p);
        }
        if p.top_p < 1.0 {
            // Mass is measured against the distribution before min-p, as if top-p ran first.
            truncate_top_p(c, p.top_p as f64 * total, &mut self.boundary);
        }
        let mass: f64 = c.iter().map(|x| x.0 as f64).sum();
        let r = self.rng.random::<f64>() * mass;
        let mut acc = 0.0f64;
        for &(w, id) in c.iter() {
            acc += w as f64;
            if acc > r {
                return Ok(id);
            }
        }
        // Rounding can leave `acc` a hair below `r`; the last candidate is the right answer.
        c.last().map(|x| x.1).ok_or_else(no_usable_logit)
    }
}

fn no_usable_logit() -> TextError {
    TextError::Sampling(
        "no token has a usable logit (all are NaN or -inf); the model output is broken".to_string(),
    )
}

/// The first maximum, so ties go to the lowest token id.
fn argmax(logits: &[f32]) -> Result<u32> {
    let mut best = 0usize;
    let mut best_l = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_l {
            best = i;
            best_l = l;
        }
    }
    if best_l == f32::NEG_INFINITY {
        return Err(no_usable_logit());
    }
    Ok(best as u32)
}

/// Candidate sets up to this size are simply sorted for top-p.
const TOP_P_SORT_ALL: usize = 512;
/// Bucket keys for top-p: the top bits of an f32 in [0, 1] (sign 0, exponent, 3 mantissa bits),
/// which order the weights on a log scale at no cost: 1.0 has key 0x3f8.
const TOP_P_KEY_SHIFT: u32 = 20;
const TOP_P_BUCKETS: usize = (0x3f80_0000 >> TOP_P_KEY_SHIFT) + 1;

/// Keeps the most likely candidates until their weight reaches `target` (the crossing token is
/// kept, as in llama.cpp). Large sets are not sorted: one pass sums the weight in log-scale
/// buckets, the bucket where the running mass crosses `target` is found from the top, everything
/// above it is kept and only that one bucket is sorted. On a flat 128k distribution this is a
/// few linear passes instead of a sort of most of the vocabulary.
fn truncate_top_p(c: &mut Vec<(f32, u32)>, target: f64, boundary: &mut Vec<(f32, u32)>) {
    if c.len() <= TOP_P_SORT_ALL {
        c.sort_unstable_by(desc);
        let mut acc = 0.0f64;
        if let Some(i) = c.iter().position(|x| {
            acc += x.0 as f64;
            acc >= target
        }) {
            c.truncate(i + 1);
        }
        return;
    }
    // Weights are in [0, 1] (the best is exactly 1), so keys stay below TOP_P_BUCKETS; `min`
    // only guards the indexing.
    let key = |w: f32| ((w.to_bits() >> TOP_P_KEY_SHIFT) as usize).min(TOP_P_BUCKETS - 1);
    let mut mass = [0f64; TOP_P_BUCKETS];
    for x in c.iter() {
        mass[key(x.0)] += x.0 as f64;
    }
    let mut acc = 0.0f64;
    let mut crossing = None;
    for k in (0..TOP_P_BUCKETS).rev() {
        if acc + mass[k] >= target {
            crossing = Some(k);
            break;
        }
        acc += mass[k];
    }
    // Rounding can leave the total a hair short of `target`: then everything is kept.
    let Some(crossing) = crossing else { return };
    boundary.clear();
    boundary.extend(c.iter().filter(|x| key(x.0) == crossing));
    c.retain(|x| key(x.0) > crossing);
    boundary.sort_unstable_by(desc);
    for &x in boundary.iter() {
        c.push(x);
        acc += x.0 as f64;
        if acc >= target {
            break;
        }
    }
}

/// Token ids that end generation (end-of-sequence, `<|im_end|>`, …). The caller checks them by
/// id, before detokenizing, and skips the check when [`SamplingParams::ignore_eos`] is set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopTokens {
    ids: Vec<u32>,
}

impl StopTokens {
    pub fn new(ids: impl IntoIterator<Item = u32>) -> Self {
        let mut s = Self::default();
        for id in ids {
            s.insert(id);
        }
        s
    }

    pub fn insert(&mut self, id: u32) {
        if !self.ids.contains(&id) {
            self.ids.push(id);
        }
    }

    /// A linear scan: there are only a handful of stop tokens.
    pub fn is_stop_token(&self, id: u32) -> bool {
        self.ids.contains(&id)
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// What [`StopMatcher::push`] lets through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is safe to show now.
    pub emit: String,
    /// The stop string that was hit; generation should end. The stop string itself and anything
    /// after it are never emitted.
    pub stopped_by: Option<String>,
}

impl StopOutcome {
    pub fn stopped(&self) -> bool {
        self.stopped_by.is_some()
    }
}

/// Finds stop strings in text that arrives a token at a time, where a stop string may be split
/// across tokens. Text that could be the start of a stop string is held back until the next piece
/// shows whether it is.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// Longest stop string in bytes: more than this minus one byte is never worth holding.
    max_len: usize,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        Self {
            stops,
            held: String::new(),
            max_len,
            stopped: false,
        }
    }

    /// Whether a stop string has been hit; later pushes emit nothing.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next piece of output text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome::default();
        }
        if self.stops.is_empty() {
            return StopOutcome {
                emit: text.to_string(),
                stopped_by: None,
            };
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);
        // The earliest match wins: whatever stop string starts first ends the text there.
        let mut hit: Option<(usize, usize)> = None;
        for (k, s) in self.stops.iter().enumerate() {
            if let Some(pos) = buf.find(s.as_str()) {
                if hit.is_none_or(|(best, _)| pos < best) {
                    hit = Some((pos, k));
                }
            }
        }
        if let Some((pos, k)) = hit {
            self.stopped = true;
            buf.truncate(pos);
            return StopOutcome {
                emit: buf,
                stopped_by: Some(self.stops[k].clone()),
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string. The held
        // text never contains a whole stop string (it would have matched above), so only the
        // last `max_len - 1` bytes can start one.
        let earliest = buf.len().saturating_sub(self.max_len.saturating_sub(1));
        let split = (earliest..buf.len())
            .filter(|&i| buf.is_char_boundary(i))
            .find(|&i| {
                let tail = &buf[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(buf.len());
        self.held = buf.split_off(split);
        StopOutcome {
            emit: buf,
            stopped_by: None,
        }
    }

    /// Releases the held text at the end of generation (it did not turn into a stop string).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peeked_draws_are_the_draws_decoding_would_make() {
        let params = SamplingParams {
            temperature: 0.7,
            repetition_penalty: 1.2,
            penalty_last_n: 4,
            seed: Some(3),
            ..SamplingParams::greedy()
        };
        let sampler = || Sampler::new(params.clone()).unwrap_or_else(|e| panic!("{e}"));
        let (mut plain, mut ahead) = (sampler(), sampler());
        let recent = [5u32, 6, 7];
        let drafts = [8u32, 5, 9];
        let peeked = ahead.peek_draws(&recent, &drafts);
        assert_eq!(peeked.len(), 4);
        // Peeking takes nothing: the same peek again is the same.
        assert_eq!(ahead.peek_draws(&recent, &drafts), peeked);
        // Row j is what decoding draws after the first j drafts were kept.
        let mut history = recent.to_vec();
        for (j, want) in peeked.iter().enumerate() {
            assert_eq!(&plain.device_draw(&history), want, "row {j}");
            if let Some(&d) = drafts.get(j) {
                history.push(d);
            }
        }
        // Two rows kept: the generator moves on by two draws, as decoding's did after two.
        ahead.take_draw();
        ahead.take_draw();
        let mut after_two = sampler();
        after_two.device_draw(&recent);
        after_two.device_draw(&recent);
        assert_eq!(
            ahead.device_draw(&[1]).uniform,
            after_two.device_draw(&[1]).uniform
        );
        assert_ne!(peeked[0].uniform, peeked[1].uniform);
        // The penalty window (the last 4 tokens) slides over the drafts.
        assert_eq!(peeked[1].penalties, vec![(5, 1), (6, 1), (7, 1), (8, 1)]);
        assert_eq!(peeked[3].penalties, vec![(5, 1), (7, 1), (8, 1), (9, 1)]);
    }
}
