//! One step, in named phases ([`ModelWorker::step_held`]): cancel, admit, drafts, decodes and
//! prefills gathered, KV room and preemption, the engine run, verification and delivery, failures,
//! the report.

use super::*;

/// One row of a step: the request, its sequence, the tokens to compute, and whether a token is
/// drawn after them (a prefill's last chunk, every decode).
pub(super) type Planned = (RequestId, SeqId, Vec<u32>, bool);

/// A step as its phases gather and run it ([`ModelWorker::step_held`]).
#[derive(Default)]
pub(super) struct StepWork {
    pub(super) report: StepReport,
    pub(super) work: Vec<Planned>,
    /// Draft tokens per decoding request, verified in this step.
    pub(super) drafts: HashMap<RequestId, Vec<u32>>,
    /// Accepted draft tokens per request (beyond the one token a decode makes).
    pub(super) extra: HashMap<RequestId, usize>,
    /// Prompt tokens each request computes in this step (charged to its user's usage).
    pub(super) prefilled: HashMap<RequestId, usize>,
    /// Requests that fail, with why.
    pub(super) failed: Vec<(RequestId, Failure)>,
    /// The positions of a decode-only step, which teaches the cost line.
    pub(super) decode_positions: Option<usize>,
    /// Requests whose decode in this step was the step launched ahead ([`Ahead`]).
    pub(super) claimed: Vec<RequestId>,
    /// When the step began, and its seconds up to launching the next step ahead (what the
    /// step itself cost: the cost line learns that, not the launch).
    pub(super) started: Option<Instant>,
    pub(super) seconds_before_ahead: Option<f64>,
}

/// A decode step launched before the tokens of the step it follows were delivered (vLLM's
/// async scheduling): a steady decode step's rows go on with the tokens just drawn while the
/// host sends those tokens, reports, and waits for the scheduler's next plan, so on a GPU the
/// device does not sit idle through the host's part of each step. The next plan's decodes of
/// the same requests are then this step's rows ([`ModelWorker::claim_ahead`]).
///
/// A stop is seen one step late: the row launched for a reply that ended (a stop string, the
/// end of generation, its token limit, a cancel) computed a position the reply never had. It is
/// voided: its sequence is cut back to what it held before, its token is never delivered and
/// its draw's uniform never taken, so every reply and every conversation cache is what it would
/// be without launching ahead.
pub(super) struct Ahead {
    rows: Vec<AheadRow>,
}

struct AheadRow {
    id: RequestId,
    seq: SeqId,
    /// Positions the sequence held before the step.
    past: usize,
    void: bool,
}

/// The engine's form of a generation's device draw (the one place the two meet: the text crate
/// knows no engine).
/// Sends one drawn token's output to the request's listener and counts it; returns why the
/// reply ended, if this token ended it. The one place a generated token leaves the worker.
pub(super) fn deliver(
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
pub(super) fn draw_on_host(
    generation: &mut Generation,
    row: &mut [f32],
    cached: usize,
    window: usize,
) -> Result<smolchat_text::generation::TokenOutcome, Failure> {
    let outcome = generation
        .next_token_within(row, cached, window)
        .map_err(|e| match e {
            smolchat_text::TextError::Constraint(m) => Failure::Constraint(m),
            other => Failure::Engine(other.to_string()),
        });
    if let Some(t) = generation.take_mask_time() {
        metrics::histogram!("smolchat_grammar_mask_seconds").record(t.as_secs_f64());
    }
    outcome
}

/// A token the device drew, checked: an error when no token had a usable logit or the device
/// drew one outside the vocabulary.
pub(super) fn checked_draw(token: Option<u32>, vocab: usize) -> Result<u32, Failure> {
    match token {
        None | Some(NO_TOKEN) => Err(Failure::Engine(
            "no token has a usable logit (all are NaN or -inf); the model output is broken".into(),
        )),
        Some(token) if token as usize >= vocab => Err(Failure::Engine(format!(
            "the device drew token {token}, outside the vocabulary of {vocab}"
        ))),
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

impl ModelWorker {
    /// Takes a running request's KV blocks back: its sequence (and conversation cache, if it
    /// has one) is dropped, and it keeps everything it had as tokens to recompute when it is
    /// admitted again: what was cached, this step's `chunk` (a prefill chunk, or the last
    /// sampled token of a decode, never its drafts: the step drops those before it preempts) and the
    /// prompt not yet fed. Returns how many tokens that is.
    pub(super) fn preempt(&mut self, id: RequestId, seq: SeqId, chunk: Vec<u32>) -> usize {
        self.void_ahead(id);
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
    pub(super) fn step(&mut self, plan: StepPlan) -> StepReport {
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
    pub(super) fn step_held(&mut self, mut plan: StepPlan) -> StepReport {
        let start = Instant::now();
        if let Some((id, draft)) = plan.warm_start.take() {
            self.register_draft(id, draft, start);
        }
        let graph_work = self.graph_work();
        let mut step = StepWork {
            started: Some(start),
            ..StepWork::default()
        };
        let claimed = self.claim_ahead(&plan, &mut step);
        step.claimed = claimed.iter().map(|c| c.0).collect();
        self.cancel_requests(&plan, &mut step);
        self.admit_planned(&plan, &mut step);
        let (draft_budget, break_even) = self.draft_budget(&plan);
        self.gather_decodes(&plan, draft_budget, break_even, &mut step);
        self.gather_prefills(&plan, &mut step);
        self.fit_in_kv(&mut step);
        if !claimed.is_empty() {
            if step.work.is_empty() {
                // A steady step: the next one goes ahead before these tokens are delivered.
                let launched = Instant::now();
                self.launch_ahead(&claimed, 1);
                step.report.engine_ms += launched.elapsed().as_secs_f64() * 1e3;
            }
            self.deliver_claimed(&claimed, &mut step);
        }
        if !step.work.is_empty() {
            self.run_and_deliver(&plan, &mut step, claimed.is_empty());
        }
        self.end_failed(&plan, &mut step);
        self.end_warmed(&plan, &mut step);
        self.report_standing(&plan, &mut step);
        self.measure(step, start, graph_work)
    }

    /// Whether steady decode steps are launched one ahead here: asked for (by default on a GPU
    /// only) and tokens drawn on the device. (A step whose replies would verify drafts next is
    /// not: see [`Self::would_draft`].)
    fn async_here(&self) -> bool {
        self.async_steps.unwrap_or(!matches!(
            self.engine.device(),
            smolchat_engine::device::Device::Cpu
        )) && self.engine.samples_on_device()
            && !self.host_sampling
    }

    /// Positions of `seq` that `id`'s reply holds: those cached, less the one its row in the
    /// step launched ahead is computing.
    fn settled_len(&self, id: RequestId, seq: SeqId) -> Option<usize> {
        let len = self.engine.cached_tokens(seq).ok()?.len();
        let ahead = self
            .ahead
            .as_ref()
            .is_some_and(|a| a.rows.iter().any(|r| r.id == id && !r.void));
        Some(len - usize::from(ahead))
    }

    /// Voids `id`'s row in the step launched ahead, if it has one: its sequence is cut back to
    /// what it held before that step (see [`Ahead`]).
    pub(super) fn void_ahead(&mut self, id: RequestId) {
        let Some(ahead) = self.ahead.as_mut() else {
            return;
        };
        for row in ahead.rows.iter_mut().filter(|r| r.id == id && !r.void) {
            row.void = true;
            self.ahead_voided += 1;
            metrics::counter!("smolchat_ahead_rows_voided_total").increment(1);
            match self.engine.truncate(row.seq, row.past) {
                Ok(kept) if kept == row.past => {}
                Ok(kept) => tracing::debug!(
                    seq = row.seq,
                    kept,
                    "a sequence cut back after a stop kept less than it had (a shared block)"
                ),
                Err(e) => tracing::warn!(seq = row.seq, "cutting a sequence back failed: {e}"),
            }
        }
    }

    /// Launches the next decode step of `rows` (each request, its sequence, and the token just
    /// drawn for it and not yet delivered, of which `pending` draws are not yet taken from its
    /// generator) before those tokens are delivered ([`Ahead`]); whether it did. Only when every
    /// row may go: its draw does not depend on the tokens before it (no penalties, grammar or
    /// log-probabilities), its token would not end the reply at the context window, and the KV
    /// cache has the blocks free (a step that may be wasted evicts nothing).
    pub(super) fn launch_ahead(
        &mut self,
        rows: &[(RequestId, SeqId, Option<u32>)],
        pending: usize,
    ) -> bool {
        if rows.is_empty() || !self.async_here() || self.ahead.is_some() {
            return false;
        }
        // A reply that would verify drafts next gains more from them than from going ahead.
        for &(id, seq, token) in rows {
            if token.is_some_and(|t| self.would_draft(id, seq, t, rows.len())) {
                return false;
            }
        }
        let window = self.context_window.min(self.kv_capacity_tokens());
        let vocab = self.engine.config().vocab_size;
        let mut tokens = Vec::with_capacity(rows.len());
        let mut draws = Vec::with_capacity(rows.len());
        let mut ahead = Vec::with_capacity(rows.len());
        let mut blocks = 0;
        for &(id, seq, token) in rows {
            let Ok(token) = checked_draw(token, vocab) else {
                return false;
            };
            let Some(a) = self.active.get_mut(&id) else {
                return false;
            };
            let Some(generation) = a.generation.as_mut().filter(|_| a.pool.is_none()) else {
                return false;
            };
            let Ok(past) = self.engine.cached_tokens(seq).map(<[u32]>::len) else {
                return false;
            };
            if past + 2 >= window {
                return false;
            }
            let Some(draw) = generation.device_draw_after(pending) else {
                return false;
            };
            let Ok(needed) = self.engine.kv_blocks_needed(seq, 1) else {
                return false;
            };
            blocks += needed;
            tokens.push([token]);
            draws.push([device_sampling(draw)]);
            ahead.push(AheadRow {
                id,
                seq,
                past,
                void: false,
            });
        }
        if blocks > self.engine.kv_free_blocks() {
            return false;
        }
        let steps: Vec<SeqStep<'_>> = ahead
            .iter()
            .zip(&tokens)
            .map(|(row, token)| SeqStep {
                seq: row.seq,
                tokens: token,
                logits: LogitsMode::Sample,
            })
            .collect();
        let sampling: Vec<&[DeviceSampling]> = draws.iter().map(|d| d.as_slice()).collect();
        match self
            .engine
            .launch_step(&steps, &sampling, &mut self.ahead_logits)
        {
            Ok(()) => {
                self.ahead = Some(Ahead { rows: ahead });
                self.ahead_launched += 1;
                metrics::counter!("smolchat_steps_launched_ahead_total").increment(1);
                true
            }
            Err(e) => {
                // Nothing changed: the step runs in its turn instead.
                tracing::debug!("a decode step could not be launched ahead: {e}");
                false
            }
        }
    }

    /// Whether `id`'s next decode, after `token`, would verify drafts (what a step launched
    /// ahead cannot do: it is launched before the step's tokens are known on the host, so
    /// nothing is looked up for it). Asked without changing the request's draft control.
    fn would_draft(&mut self, id: RequestId, seq: SeqId, token: u32, rows: usize) -> bool {
        if !self.drafts_here()
            || rows > self.spec.max_batch
            || self.engine.rows_computed_alike(rows) <= rows
        {
            return false;
        }
        let break_even = self
            .spec
            .fixed_break_even
            .or_else(|| self.step_cost.break_even(rows));
        let (Some(break_even), Some(a)) = (break_even, self.active.get(&id)) else {
            return false;
        };
        if a.draft.clone().draft_len(self.spec.max_draft, break_even) == 0 {
            return false;
        }
        let Ok(cached) = self.engine.cached_tokens(seq) else {
            return false;
        };
        let mut history = Vec::with_capacity(cached.len() + 1);
        history.extend_from_slice(cached);
        history.push(token);
        let lookup = PromptLookup {
            max_ngram: self.spec.max_ngram,
            min_ngram: self.spec.min_ngram,
        };
        if !lookup.propose(&history, 1).is_empty() {
            return true;
        }
        let user = a.request.user.clone();
        self.spec.ngram_cache
            && self
                .ngrams
                .get(user.as_deref())
                .is_some_and(|c| !c.propose(&history, 1).is_empty())
    }

    /// Finishes the step launched ahead, if any, and voids all its rows (nothing claims them).
    pub(super) fn settle_ahead(&mut self) {
        let mut step = StepWork::default();
        self.claim_ahead(&StepPlan::default(), &mut step);
    }

    /// The step launched ahead, finished: its rows for requests this plan decodes again are
    /// their decode in this step (returned: each request, its sequence and the token drawn),
    /// and the others (requests stopped, cancelled, gone or not planned) are voided.
    fn claim_ahead(
        &mut self,
        plan: &StepPlan,
        step: &mut StepWork,
    ) -> Vec<(RequestId, SeqId, Option<u32>)> {
        let Some(ahead) = self.ahead.as_ref() else {
            return Vec::new();
        };
        let rows: Vec<(usize, RequestId, SeqId)> = ahead
            .rows
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.void)
            .map(|(i, r)| (i, r.id, r.seq))
            .collect();
        let waited = Instant::now();
        let mut logits = std::mem::take(&mut self.ahead_logits);
        let finished = self.engine.finish_step(&mut logits);
        step.report.engine_ms += waited.elapsed().as_secs_f64() * 1e3;
        let mut claimed = Vec::with_capacity(rows.len());
        for (i, id, seq) in rows {
            let keep = finished.is_ok()
                && plan.decode.contains(&id)
                && !plan.cancel.contains(&id)
                && self
                    .active
                    .get(&id)
                    .is_some_and(|a| !a.request.events.is_closed());
            if keep {
                claimed.push((id, seq, logits.token(i)));
                continue;
            }
            self.void_ahead(id);
            if let Err(e) = &finished {
                tracing::error!("engine step failed: {e}");
                step.failed.push((id, Failure::Engine(e.to_string())));
            }
        }
        self.ahead = None;
        self.ahead_logits = logits;
        claimed
    }

    /// Deliver the rows claimed from the step launched ahead: each token drawn, kept (taking
    /// its draw's uniform) and sent, as [`Self::deliver_rows`] does for a step's own rows.
    fn deliver_claimed(
        &mut self,
        claimed: &[(RequestId, SeqId, Option<u32>)],
        step: &mut StepWork,
    ) {
        let window = self.context_window.min(self.kv_capacity_tokens());
        let vocab = self.engine.config().vocab_size;
        for &(id, seq, token) in claimed {
            let cached = self.settled_len(id, seq).unwrap_or(window);
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            let Some(generation) = a.generation.as_mut() else {
                continue;
            };
            match checked_draw(token, vocab)
                .map(|t| generation.accept_drawn_within(t, cached, window))
            {
                Ok(outcome) => {
                    if let Some(reason) = deliver(a, outcome, &mut step.report) {
                        self.finish(id, reason);
                        step.report.items.push(ItemReport::ended(id, 0));
                    }
                }
                Err(e) => step.failed.push((id, e)),
            }
        }
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
                // A cache still being read from the spill tier: admitted in a later step rather
                // than hold up the others' tokens (it is then in memory).
                let others = !plan.decode.is_empty()
                    || plan.prefill.iter().any(|p| {
                        p.0 != id && self.active.get(&p.0).is_some_and(|a| a.seq.is_some())
                    });
                if self.admission_waits_for_read(id, others) {
                    continue;
                }
                self.admit(id);
                if let Some(a) = self.active.get(&id) {
                    step.report.reused_tokens += a.cached_tokens as u64;
                    step.report.warm_reused_tokens += a.warmed_tokens as u64;
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
            if step.claimed.contains(&id) {
                continue;
            }
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
                // A typed draft wants no logits: nothing is drawn from it.
                let last = a.pending_prompt.is_empty() && !a.request.warm;
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
            if needed > self.engine.kv_free_blocks() && self.fit_draft(step, needed) {
                continue;
            }
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

    /// A typed draft takes only free KV blocks: it never evicts another conversation's cache.
    /// When the step (`needed` blocks) does not fit the free ones, the step's draft chunk shrinks
    /// to what fits, or, when nothing does, the draft ends (keeping what it computed). Whether
    /// the step had a draft to change.
    fn fit_draft(&mut self, step: &mut StepWork, needed: usize) -> bool {
        let Some(i) = step
            .work
            .iter()
            .position(|(id, ..)| self.active.get(id).is_some_and(|a| a.request.warm))
        else {
            return false;
        };
        let (id, seq) = (step.work[i].0, step.work[i].1);
        let own = self
            .engine
            .kv_blocks_needed(seq, step.work[i].2.len())
            .unwrap_or(0);
        let room = self.engine.kv_free_blocks().saturating_sub(needed - own);
        let mut fit = step.work[i].2.len();
        while fit > 0 && self.engine.kv_blocks_needed(seq, fit).unwrap_or(usize::MAX) > room {
            fit -= 1;
        }
        if fit > 0 {
            let rest: Vec<u32> = step.work[i].2.drain(fit..).collect();
            step.report.prefilled_tokens -= rest.len() as u64;
            if let Some(a) = self.active.get_mut(&id) {
                a.pending_prompt.splice(0..0, rest);
            }
            step.prefilled.insert(id, fit);
        } else {
            step.work.remove(i);
            step.prefilled.remove(&id);
            self.finish(id, StopReason::Cancelled);
            step.report.items.push(ItemReport::ended(id, 0));
        }
        true
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
                Failure::Request(format!(
                    "the prompt does not fit the KV cache ({capacity} tokens in all, \
                     scheduler.kv_budget_mib); shorten the conversation"
                )),
            )),
        }
    }

    /// Run: one engine step over the gathered work (each row's logits mode and device draw
    /// chosen here), then each row delivered: hidden states pooled for embeddings, drafts
    /// verified, tokens drawn and sent.
    fn run_and_deliver(&mut self, plan: &StepPlan, step: &mut StepWork, may_go_ahead: bool) {
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
        let engine_start = Instant::now();
        let stepped = self.run_engine(step, &embeds, &draws, &mut logits);
        step.report.engine_ms += engine_start.elapsed().as_secs_f64() * 1e3;
        match stepped {
            Ok(()) => {
                // A steady decode step (every row a plain decode drawn on the device): the
                // next one goes ahead before these tokens are delivered.
                let steady = may_go_ahead
                    && plan.prefill.is_empty()
                    && step.drafts.is_empty()
                    && !embeds.contains(&true)
                    && step
                        .work
                        .iter()
                        .zip(&draws)
                        .all(|(w, d)| w.3 && w.2.len() == 1 && d.len() == 1);
                if steady {
                    let rows: Vec<(RequestId, SeqId, Option<u32>)> = step
                        .work
                        .iter()
                        .enumerate()
                        .map(|(i, w)| (w.0, w.1, logits.token(i)))
                        .collect();
                    let launched = Instant::now();
                    step.seconds_before_ahead = step
                        .started
                        .map(|s| launched.duration_since(s).as_secs_f64());
                    self.launch_ahead(&rows, 0);
                    step.report.engine_ms += launched.elapsed().as_secs_f64() * 1e3;
                }
                self.deliver_rows(step, &embeds, &draws, &mut logits)
            }
            Err(e) => {
                // A failed step says nothing of what a step costs.
                step.decode_positions = None;
                tracing::error!("engine step failed: {e}");
                step.failed.extend(
                    step.work
                        .iter()
                        .map(|w| (w.0, Failure::Engine(e.to_string()))),
                );
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
            let cached = self.settled_len(*id, *seq).unwrap_or(window);
            // Taken out: nothing reads a step's drafts after its rows are delivered.
            if let Some(d) = step.drafts.remove(id) {
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
                        Failure::Engine(format!(
                            "the KV cache kept {kept} of {keep} positions after verifying drafts"
                        )),
                    )),
                    Err(e) => step.failed.push((id, Failure::Engine(e.to_string()))),
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
                step.failed
                    .push((id, Failure::Request("invalid sampling parameters".into())));
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

    /// Typed drafts whose prompt is all in their conversation's cache end (nothing is
    /// generated for them; see [`crate::warm`]).
    fn end_warmed(&mut self, plan: &StepPlan, step: &mut StepWork) {
        for &(id, _) in &plan.prefill {
            let done = self
                .active
                .get(&id)
                .is_some_and(|a| a.request.warm && a.seq.is_some() && a.pending_prompt.is_empty());
            if done && !step.report.items.iter().any(|r| r.id == id) {
                self.finish(id, StopReason::Length);
                let prefilled = step.prefilled.get(&id).copied().unwrap_or(0);
                step.report.items.push(ItemReport::ended(id, prefilled));
            }
        }
    }

    /// Starts the typed draft `id` (the batcher planned its first chunk in this step): a
    /// request that computes `draft`'s prompt into its conversation's cache and generates
    /// nothing.
    fn register_draft(&mut self, id: RequestId, draft: crate::warm::Draft, now: Instant) {
        let (tx, rx) = mpsc::unbounded_channel();
        self.warm_listener = Some(rx);
        let params = smolchat_text::sampling::SamplingParams {
            max_new_tokens: 1,
            ..smolchat_text::sampling::SamplingParams::greedy()
        };
        let mut request = GenerationRequest::anonymous(draft.prompt, params, tx);
        request.cache_key = Some(draft.conversation);
        request.user = draft.user;
        request.warm = true;
        self.active.insert(id, Active::new(request, now));
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
        let seconds = step
            .seconds_before_ahead
            .unwrap_or_else(|| start.elapsed().as_secs_f64());
        // A step that warmed up or captured a decode graph took many steps' time once: measured,
        // it would make a position look dear and switch drafting off (seen on an H100: the
        // first drafts' new buckets, 1.0 -> 0.91x for one conversation).
        if let Some(positions) = step
            .decode_positions
            .filter(|_| self.graph_work() == graph_work)
        {
            self.step_cost.observe(positions, seconds);
        }
        report.step_ms = start.elapsed().as_secs_f64() * 1e3;
        report.step_cost_ms = self
            .step_cost
            .line()
            .map(|(fixed, per)| (fixed * 1e3, per * 1e3));
        report.draft_break_even = self.step_cost.break_even(1);
        report.kv_bytes = self.engine.total_kv_bytes();
        report.spill = self.spill.as_ref().map(|t| crate::types::SpillStats {
            files: t.files(),
            bytes: t.bytes(),
            budget_bytes: t.budget(),
            ram_bytes: t.ram_bytes(),
            writes: t.writes,
            restores: t.restores,
            misses: t.misses,
            rejected: t.rejected,
            restore_micros: t.restore_micros,
        });
        report.cached_sequences = self.caches.len();
        report.kv_free_blocks = self.kv_free_for_new_work();
        report.evictions = self.evictions;
        report.device_memory = self.device_memory();
        report.graphs = self.engine.graph_stats();
        report
    }
}
