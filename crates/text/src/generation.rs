//! One request's generation state: from logits to the next token and the text it adds.
//!
//! The same state machine serves the CLI and the scheduler: sample with the request's parameters,
//! stop on end-of-generation tokens, stop strings and the token limit, and turn tokens into text
//! without ever splitting a UTF-8 character or leaking part of a stop string.

use super::sampling::{
    logprobs_of, DeviceDraw, Sampler, SamplingParams, StopMatcher, StopTokens, TokenLogprobs,
};
use super::tokenizer::{Detokenizer, Tokenizer};
use crate::constraint::Constraint;
use crate::error::Result;

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token (EOS, `<|im_end|>`, …) was sampled.
    EndOfGeneration,
    /// A stop string appeared in the output.
    StopString(String),
    /// `max_new_tokens` were generated.
    Length,
}

/// What one sampled token did.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutcome {
    pub token: u32,
    /// Text that can be shown now (may be empty while a character or a possible stop string is
    /// incomplete).
    pub text: String,
    /// Set when this token ended the generation. An end-of-generation token is not part of the
    /// output and should not be fed back to the model.
    pub finished: Option<FinishReason>,
    /// Its log-probabilities, when the request asked for them (see `SamplingParams::logprobs`).
    pub logprobs: Option<TokenLogprobs>,
}

pub struct Generation {
    sampler: Sampler,
    stop_tokens: StopTokens,
    stop_strings: StopMatcher,
    detokenizer: Detokenizer,
    /// Recent context for the penalties: the prompt's tail, then every generated token.
    recent: Vec<u32>,
    generated: Vec<u32>,
    max_new_tokens: usize,
    ignore_eos: bool,
    finished: Option<FinishReason>,
    /// Alternatives to report per token (`SamplingParams::logprobs`), and the raw logits kept
    /// for it (the sampler penalises them in place).
    logprobs: Option<usize>,
    raw: Vec<f32>,
    /// The grammar the reply must match, when the request gave one.
    constraint: Option<Constraint>,
    /// Time spent computing grammar masks since [`Self::take_mask_time`] last asked.
    mask_time: std::time::Duration,
}

impl Generation {
    /// `prompt` is the full prompt (its tail feeds the repetition penalties).
    pub fn new(tokenizer: &Tokenizer, params: SamplingParams, prompt: &[u32]) -> Result<Self> {
        let stop_tokens = StopTokens::new(tokenizer.eog_ids().iter().copied());
        let stop_strings = StopMatcher::new(&params.stop_strings);
        let keep = params.penalty_last_n.min(prompt.len());
        let recent = prompt[prompt.len() - keep..].to_vec();
        let max_new_tokens = params.max_new_tokens;
        let ignore_eos = params.ignore_eos;
        let logprobs = params.logprobs;
        let constraint = params
            .grammar
            .as_ref()
            .map(|g| Constraint::new(tokenizer, g))
            .transpose()?;
        Ok(Self {
            sampler: Sampler::new(params)?,
            stop_tokens,
            stop_strings,
            detokenizer: Detokenizer::new(tokenizer),
            recent,
            generated: Vec::new(),
            max_new_tokens,
            ignore_eos,
            finished: None,
            logprobs,
            raw: Vec::new(),
            constraint,
            mask_time: std::time::Duration::ZERO,
        })
    }

    /// Samples the next token from `logits` (modified in place by the penalties).
    pub fn next_token(&mut self, logits: &mut [f32]) -> Result<TokenOutcome> {
        if self.logprobs.is_some() {
            self.raw.clear();
            self.raw.extend_from_slice(logits);
        }
        if let Some(c) = self.constraint.as_mut() {
            let t = std::time::Instant::now();
            c.mask(logits)?;
            self.mask_time += t.elapsed();
        }
        let token = self.sampler.sample(logits, &self.recent)?;
        let mut outcome = self.accept(token);
        // Once the grammar is complete its mask allows only the end-of-generation token, which
        // then ends the reply as any end does (one more step, but the same accounting).
        if let Some(c) = self.constraint.as_mut() {
            if outcome.finished != Some(FinishReason::EndOfGeneration) && !c.is_stopped() {
                c.consume(token)?;
            }
        }
        if let Some(top) = self.logprobs {
            outcome.logprobs = Some(logprobs_of(&self.raw, token, top));
        }
        Ok(outcome)
    }

    /// Computes the grammar's next mask ahead of the logits (on another thread while the
    /// forward pass runs); a no-op without a grammar. Its time counts as mask time.
    pub fn prepare_mask(&mut self) -> Result<()> {
        if let Some(c) = self.constraint.as_mut() {
            let t = std::time::Instant::now();
            c.prepare()?;
            self.mask_time += t.elapsed();
        }
        Ok(())
    }

    /// Whether a grammar constrains this generation.
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Grammar mask time since the last call (for the worker's metrics); `None` without a
    /// grammar.
    pub fn take_mask_time(&mut self) -> Option<std::time::Duration> {
        self.constraint.as_ref()?;
        Some(std::mem::take(&mut self.mask_time))
    }

    /// Whether the next token must be drawn on the host, from the logits: for its
    /// log-probabilities, or to mask it with a grammar.
    pub fn needs_host_logits(&self) -> bool {
        self.logprobs.is_some() || self.constraint.is_some()
    }

    /// One decode step of a sequence holding `cached` positions in a context window of
    /// `window`: samples like [`Self::next_token`], and when the generation did not stop by
    /// itself but the sampled token could not be fed back (`cached + 1 >= window`), ends it as
    /// [`FinishReason::Length`] with any held-back text flushed into the outcome. The one
    /// decode rule of the model worker and the command line.
    pub fn next_token_within(
        &mut self,
        logits: &mut [f32],
        cached: usize,
        window: usize,
    ) -> Result<TokenOutcome> {
        let mut outcome = self.next_token(logits)?;
        self.apply_window(&mut outcome, cached, window);
        Ok(outcome)
    }

    /// How a device that draws tokens itself should choose this generation's next token; the
    /// token it draws comes back through [`Self::accept_within`].
    pub fn device_draw(&mut self) -> DeviceDraw {
        self.sampler.device_draw(&self.recent)
    }

    /// How a device should draw this generation's next `drafts.len() + 1` tokens when it
    /// verifies `drafts` (see [`smolchat_engine::LogitsMode::SampleAll`]): row `j` as
    /// [`Self::device_draw`] would draw it after the first `j` drafts. Nothing is taken from the
    /// seeded generator until a row's token is kept ([`Self::accept_drawn_within`]).
    pub fn device_draws_ahead(&mut self, drafts: &[u32]) -> Vec<DeviceDraw> {
        self.sampler.peek_draws(&self.recent, drafts)
    }

    /// How a device should draw the token after `pending` tokens already drawn for this
    /// generation and not yet accepted, when that draw depends on none of them (no penalties)
    /// and the device's token is all the host needs (no grammar, no log-probabilities);
    /// otherwise `None`. Nothing is taken from the seeded generator until the token is kept
    /// ([`Self::accept_drawn_within`]), so a reply is the same whether its steps were launched
    /// one ahead or not.
    pub fn device_draw_after(&mut self, pending: usize) -> Option<DeviceDraw> {
        if self.needs_host_logits() {
            return None;
        }
        self.sampler.peek_draw_after(pending)
    }

    /// Keeps the token a device drew for the next row of [`Self::device_draws_ahead`]: takes
    /// that row's uniform from the generator, then as [`Self::accept_within`].
    pub fn accept_drawn_within(
        &mut self,
        token: u32,
        cached: usize,
        window: usize,
    ) -> TokenOutcome {
        self.sampler.take_draw();
        self.accept_within(token, cached, window)
    }

    /// [`Self::accept`] under the context-window rule of [`Self::next_token_within`].
    pub fn accept_within(&mut self, token: u32, cached: usize, window: usize) -> TokenOutcome {
        let mut outcome = self.accept(token);
        self.apply_window(&mut outcome, cached, window);
        outcome
    }

    fn apply_window(&mut self, outcome: &mut TokenOutcome, cached: usize, window: usize) {
        if outcome.finished.is_none() && cached + 1 >= window {
            outcome.text.push_str(&self.finish_early());
            outcome.finished = Some(FinishReason::Length);
        }
    }

    /// Records a token chosen elsewhere (or sampled by [`Self::next_token`]).
    pub fn accept(&mut self, token: u32) -> TokenOutcome {
        if self.finished.is_some() {
            return TokenOutcome {
                token,
                text: String::new(),
                finished: self.finished.clone(),
                logprobs: None,
            };
        }
        if !self.ignore_eos && self.stop_tokens.is_stop_token(token) {
            let text = self.flush();
            self.finished = Some(FinishReason::EndOfGeneration);
            return TokenOutcome {
                token,
                text,
                finished: self.finished.clone(),
                logprobs: None,
            };
        }
        self.generated.push(token);
        self.recent.push(token);
        let piece = self.detokenizer.push(token);
        let outcome = self.stop_strings.push(&piece);
        let mut text = outcome.emit;
        if let Some(stop) = outcome.stopped_by {
            self.finished = Some(FinishReason::StopString(stop));
        } else if self.generated.len() >= self.max_new_tokens {
            text.push_str(&self.flush());
            self.finished = Some(FinishReason::Length);
        }
        TokenOutcome {
            token,
            text,
            finished: self.finished.clone(),
            logprobs: None,
        }
    }

    /// Releases text held back for an incomplete character or a possible stop string.
    fn flush(&mut self) -> String {
        let tail = self.detokenizer.finish();
        let outcome = self.stop_strings.push(&tail);
        let mut text = outcome.emit;
        if outcome.stopped_by.is_none() {
            text.push_str(&self.stop_strings.finish());
        }
        text
    }

    /// Ends the generation early (a stop request or a time limit); returns held-back text.
    pub fn finish_early(&mut self) -> String {
        if self.finished.is_some() {
            return String::new();
        }
        self.finished = Some(FinishReason::Length);
        self.flush()
    }

    pub fn finished(&self) -> Option<&FinishReason> {
        self.finished.as_ref()
    }

    /// Generated tokens (end-of-generation tokens excluded).
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smolchat_engine::synthetic::{self, SyntheticSpec};

    fn tokenizer() -> Tokenizer {
        let spec = SyntheticSpec::tiny("llama").with_placeholder_tokenizer();
        let src = synthetic::build(&spec).expect("synthetic model");
        Tokenizer::from_gguf(&src).expect("placeholder tokenizer")
    }

    /// Logits whose argmax is `id`.
    fn pointing_at(id: u32, vocab: usize) -> Vec<f32> {
        let mut l = vec![0.0; vocab];
        l[id as usize] = 10.0;
        l
    }

    #[test]
    fn the_window_ends_a_reply_as_length_but_never_hides_an_end_of_generation() {
        let tok = tokenizer();
        let vocab = 512;
        let params = SamplingParams {
            max_new_tokens: 100,
            ..SamplingParams::greedy()
        };
        let mut g = Generation::new(&tok, params.clone(), &[1, 2, 3]).expect("generation");
        // Room left: an ordinary token goes on.
        let out = g
            .next_token_within(&mut pointing_at(70, vocab), 5, 10)
            .expect("step");
        assert_eq!((out.token, out.finished), (70, None));
        // The sampled token could not be fed back: the reply ends as `length`.
        let out = g
            .next_token_within(&mut pointing_at(71, vocab), 9, 10)
            .expect("step");
        assert_eq!(out.finished, Some(FinishReason::Length));
        assert_eq!(g.finished(), Some(&FinishReason::Length));
        assert_eq!(g.generated(), &[70, 71]);

        // At the window, an end-of-generation token still ends the reply as a stop.
        let eog = *tok.eog_ids().first().expect("an end-of-generation token");
        let mut g = Generation::new(&tok, params, &[1, 2, 3]).expect("generation");
        let out = g
            .next_token_within(&mut pointing_at(eog, vocab), 9, 10)
            .expect("step");
        assert_eq!(out.finished, Some(FinishReason::EndOfGeneration));
    }
}
