//! The engine's multi-sequence step API: a table of sequences, each with its own KV cache, and a
//! `step` that advances any number of them in one forward pass.

use std::collections::HashMap;

use super::error::{EngineError, Result};
use super::kv_cache::KvCache;
use super::model::{BatchItem, LogitsMode, Model};

pub type SeqId = u64;

/// One sequence's work in a step: its new tokens (a prefill chunk of any length or one decode
/// token) and which logits it wants back.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub logits: LogitsMode,
}

/// Counters for tests, metrics and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub steps: u64,
    /// Tokens processed in chunks of more than one token.
    pub prefill_tokens: u64,
    /// Tokens processed one at a time.
    pub decode_tokens: u64,
}

pub struct Engine {
    model: Model,
    caches: HashMap<SeqId, KvCache>,
    next_id: SeqId,
    stats: EngineStats,
}

impl Engine {
    pub fn new(model: Model) -> Self {
        Self {
            model,
            caches: HashMap::new(),
            next_id: 1,
            stats: EngineStats::default(),
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Starts an empty sequence.
    pub fn create_sequence(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.caches.insert(id, self.model.new_cache());
        id
    }

    /// Drops a sequence and its cache; returns whether it existed.
    pub fn free_sequence(&mut self, seq: SeqId) -> bool {
        self.caches.remove(&seq).is_some()
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.caches.contains_key(&seq)
    }

    fn cache(&self, seq: SeqId) -> Result<&KvCache> {
        self.caches
            .get(&seq)
            .ok_or(EngineError::UnknownSequence(seq))
    }

    /// Keeps the first `len` cached positions of `seq`.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        self.caches
            .get_mut(&seq)
            .ok_or(EngineError::UnknownSequence(seq))?
            .truncate(len);
        Ok(())
    }

    /// The tokens whose K/V `seq` holds.
    pub fn cached_tokens(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(self.cache(seq)?.tokens())
    }

    /// Prepares `seq` to run `prompt`: keeps the longest cached prefix shared with it (but never the
    /// whole prompt, since the last prompt token must be computed for its logits), drops the rest,
    /// and returns how many prompt tokens were kept. The caller then steps `prompt[kept..]`.
    pub fn reuse_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize> {
        let shared = self.common_prefix(seq, prompt)?;
        let kept = shared.min(prompt.len().saturating_sub(1));
        self.truncate(seq, kept)?;
        Ok(kept)
    }

    /// Length of the longest common prefix of `seq`'s cached tokens and `tokens`.
    pub fn common_prefix(&self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        Ok(self.cache(seq)?.common_prefix(tokens))
    }

    /// Bytes allocated by `seq`'s cache.
    pub fn kv_bytes(&self, seq: SeqId) -> Result<usize> {
        Ok(self.cache(seq)?.allocated_bytes())
    }

    /// Bytes allocated by all caches.
    pub fn total_kv_bytes(&self) -> usize {
        self.caches.values().map(|c| c.allocated_bytes()).sum()
    }

    /// Advances every listed sequence by its tokens in one forward pass. Returns each sequence's
    /// logits as asked (see [`LogitsMode`]). On error no cache has changed.
    pub fn step(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Option<Vec<f32>>>> {
        for (i, s) in steps.iter().enumerate() {
            if !self.caches.contains_key(&s.seq) {
                return Err(EngineError::UnknownSequence(s.seq));
            }
            if steps[..i].iter().any(|o| o.seq == s.seq) {
                return Err(EngineError::InvalidStep(format!(
                    "sequence {} appears twice in one step",
                    s.seq
                )));
            }
        }
        // Move the caches out so the model can hold many `&mut` at once, and always put them back.
        let mut taken: Vec<(SeqId, KvCache)> = steps
            .iter()
            .filter_map(|s| self.caches.remove_entry(&s.seq))
            .collect();
        let result = {
            let mut items: Vec<BatchItem<'_>> = taken
                .iter_mut()
                .zip(steps)
                .map(|((_, cache), s)| BatchItem {
                    cache,
                    tokens: s.tokens,
                    logits: s.logits,
                })
                .collect();
            // Run the pass on a worker of the compute pool: parallel regions started from inside
            // the pool are much cheaper than ones injected from an outside thread.
            let model = &self.model;
            let mut result = None;
            rayon::scope(|_| result = Some(model.forward(&mut items)));
            result.unwrap_or_else(|| {
                Err(EngineError::InvalidStep(
                    "the compute pool did not run the step".into(),
                ))
            })
        };
        for (id, cache) in taken {
            self.caches.insert(id, cache);
        }
        let out = result?;
        self.stats.steps += 1;
        for s in steps {
            if s.tokens.len() == 1 {
                self.stats.decode_tokens += 1;
            } else {
                self.stats.prefill_tokens += s.tokens.len() as u64;
            }
        }
        Ok(out)
    }
}
