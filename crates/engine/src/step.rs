//! The engine's multi-sequence step API: a table of sequences, each with its own KV cache, and a
//! `step` that advances any number of them in one forward pass.

use std::collections::HashMap;

use super::backend::{Backend, Suggested};
use super::config::ModelConfig;
use super::device::{Device, Tier};
use super::error::{EngineError, Result};
use super::kv::{BlockAllocator, BlockTable, KvOptions, KvType, BLOCK_POSITIONS};
use crate::backend::BatchItem;
use crate::cpu::model::Model;
use crate::cpu::CpuBackend;
use crate::logits::LogitsMode;
use crate::logits::{DeviceSampling, Logits};

pub type SeqId = u64;

/// One sequence's work in a step: its new tokens (a prefill chunk of any length or one decode
/// token) and which logits it wants back.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub logits: LogitsMode,
}

/// A sequence's K/V as bytes ([`Engine::save_kv`]): what a restored sequence needs to hold the
/// same positions without computing them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSnapshot {
    /// The tokens the positions were computed for.
    pub tokens: Vec<u32>,
    /// The backend's block format ([`Backend::kv_block_format`]): restored only by the same.
    pub format: String,
    /// The blocks holding the positions, each [`Engine::kv_block_bytes`] long (the last one
    /// may be partly used).
    pub bytes: Vec<u8>,
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

/// One sequence: the blocks holding its K/V and the tokens they were computed for.
struct Sequence {
    table: BlockTable,
    /// `tokens.len()` is the number of positions held (and the next position).
    tokens: Vec<u32>,
}

pub struct Engine {
    /// The weights, the KV pages and the forward pass (the only hardware-specific part).
    backend: Box<dyn Backend>,
    /// Which block ids are free and which sequence holds the others (backend-neutral).
    alloc: BlockAllocator,
    seqs: HashMap<SeqId, Sequence>,
    next_id: SeqId,
    stats: EngineStats,
    /// Why this tier computes when another was asked for (a failed self-check, say).
    note: Option<String>,
    /// The step launched and not finished yet ([`Engine::launch_step`]): each sequence it
    /// stepped and the positions it held before, to give back should the step fail.
    in_flight: Option<Vec<(SeqId, usize)>>,
}

impl Engine {
    /// A CPU engine with the default KV cache: f16 within 2 GiB (f16 stores any head
    /// dimension).
    pub fn new(model: Model) -> Self {
        Self::build(
            Box::new(CpuBackend::f16(model)),
            Suggested::CPU.kv_budget_bytes,
        )
    }

    /// A CPU engine whose KV cache is stored as `options.kv_type` within
    /// `options.budget_bytes`. Errors when the type cannot store this model's rows or the
    /// budget holds no block.
    pub fn with_kv(model: Model, options: KvOptions) -> Result<Self> {
        Self::on_backend(Box::new(CpuBackend::new(model, options.kv_type)?), options)
    }

    /// An engine over any backend, its KV cache within `options.budget_bytes` (the backend's
    /// suggestion when unset; the backend already stores rows as `options.kv_type`). Errors when
    /// the budget holds no block.
    pub fn on_backend(backend: Box<dyn Backend>, options: KvOptions) -> Result<Self> {
        let block = backend.kv_block_bytes();
        let budget = options
            .budget_bytes
            .unwrap_or_else(|| backend.suggested().kv_budget_bytes);
        if budget < block {
            return Err(EngineError::KvConfig(format!(
                "a budget of {} bytes holds no block: one block of {} positions takes {} bytes with {}",
                budget,
                BLOCK_POSITIONS,
                block,
                backend.kv_type()
            )));
        }
        Ok(Self::build(backend, budget))
    }

    /// The serving limits the device suits (for what the configuration leaves unset).
    pub fn suggested(&self) -> Suggested {
        self.backend.suggested()
    }

    fn build(backend: Box<dyn Backend>, budget_bytes: usize) -> Self {
        Self {
            // The backend's page layout decides the block's bytes; the allocator only counts.
            alloc: BlockAllocator::with_budget(budget_bytes, backend.kv_block_bytes()),
            backend,
            seqs: HashMap::new(),
            next_id: 1,
            stats: EngineStats::default(),
            note: None,
            in_flight: None,
        }
    }

    /// Where this engine computes.
    pub fn device(&self) -> Device {
        self.backend.device()
    }

    /// How decode graphs have been used (`None`: this backend runs every step eagerly).
    pub fn graph_stats(&self) -> Option<crate::fast::graph::GraphStats> {
        self.backend.graph_stats()
    }

    /// What the GPU's memory holds now (a driver call: not for every step), when the backend
    /// can tell.
    pub fn device_memory(&self) -> Option<crate::device::DeviceMemory> {
        self.backend.device_memory()
    }

    /// Which path computes there.
    pub fn tier(&self) -> Tier {
        self.backend.tier()
    }

    /// Why this tier computes when another was asked for, if that happened.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// Records why this tier computes (see [`Engine::note`]).
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }

    /// The backend, for another engine (every sequence is dropped).
    pub fn into_backend(self) -> Box<dyn Backend> {
        self.backend
    }

    /// The model's shapes and limits.
    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    /// Bytes of weights held.
    pub fn weight_bytes(&self) -> usize {
        self.backend.weight_bytes()
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// How K/V are stored.
    pub fn kv_type(&self) -> KvType {
        self.backend.kv_type()
    }

    /// Bytes of K/V per cached position.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.backend.kv_bytes_per_position()
    }

    /// Bytes per block of [`BLOCK_POSITIONS`] positions.
    pub fn kv_block_bytes(&self) -> usize {
        self.alloc.bytes_per_block()
    }

    /// Blocks the budget holds.
    pub fn kv_capacity_blocks(&self) -> usize {
        self.alloc.capacity_blocks()
    }

    /// Sizes the backend for the largest steps a server will run, before the first one (see
    /// [`Backend::prepare_for_serving`]): on a GPU the whole KV budget and the step buffers
    /// are allocated now, so no decode graph is dropped while the server warms up.
    pub fn prepare_for_serving(&mut self, limits: crate::backend::StepLimits) -> Result<()> {
        let blocks = self.alloc.capacity_blocks();
        self.backend.prepare_for_serving(limits, blocks)
    }

    /// Positions the budget holds, across all sequences.
    pub fn kv_capacity_tokens(&self) -> usize {
        self.alloc.capacity_positions()
    }

    /// Blocks not held by any sequence.
    pub fn kv_free_blocks(&self) -> usize {
        self.alloc.free_blocks()
    }

    /// Bytes of pages allocated in memory (the peak of blocks in use; freed blocks keep their
    /// pages for reuse). Never more than the budget.
    pub fn kv_resident_bytes(&self) -> usize {
        self.backend.kv_resident_bytes()
    }

    /// More blocks `seq` needs to take `extra` more tokens.
    pub fn kv_blocks_needed(&self, seq: SeqId, extra: usize) -> Result<usize> {
        let s = self.sequence(seq)?;
        Ok(BlockAllocator::blocks_needed(
            &s.table,
            s.tokens.len() + extra,
        ))
    }

    /// Starts an empty sequence (it holds no blocks until its first step).
    pub fn create_sequence(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Sequence {
                table: BlockTable::new(),
                tokens: Vec::new(),
            },
        );
        id
    }

    /// Drops a sequence and gives its blocks back; returns whether it existed.
    pub fn free_sequence(&mut self, seq: SeqId) -> bool {
        match self.seqs.remove(&seq) {
            Some(mut s) => {
                self.alloc.release(&mut s.table);
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    fn sequence(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or(EngineError::UnknownSequence(seq))
    }

    /// Keeps the first `len` cached positions of `seq` (or fewer, see below); whole blocks past
    /// them go back to the free list (a partly used last block is kept). Returns how many are
    /// kept: when the block `len` falls inside is shared with another sequence
    /// ([`Engine::fork`]), the next token would be written into it, so it is let go and only
    /// the positions before it are kept.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<usize> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(EngineError::UnknownSequence(seq))?;
        let mut len = len.min(s.tokens.len());
        if len % BLOCK_POSITIONS != 0
            && s.table
                .blocks()
                .get(len / BLOCK_POSITIONS)
                .is_some_and(|&b| self.alloc.is_shared(b))
        {
            len -= len % BLOCK_POSITIONS;
        }
        if len < s.tokens.len() {
            s.tokens.truncate(len);
            self.alloc.truncate(&mut s.table, len);
        }
        Ok(len)
    }

    /// A new sequence holding the first `len` cached positions of `seq` without computing or
    /// copying them: the blocks are shared (`n` choices of one prompt fork its prefill). `len`
    /// is rounded down to whole blocks, since both sequences go on writing after it; returns
    /// the new sequence and how many positions it holds.
    pub fn fork(&mut self, seq: SeqId, len: usize) -> Result<(SeqId, usize)> {
        let s = self
            .seqs
            .get(&seq)
            .ok_or(EngineError::UnknownSequence(seq))?;
        let len = len.min(s.tokens.len()) / BLOCK_POSITIONS * BLOCK_POSITIONS;
        let tokens = s.tokens[..len].to_vec();
        let table = self.alloc.share(&s.table, len / BLOCK_POSITIONS);
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, Sequence { table, tokens });
        Ok((id, len))
    }

    /// The tokens whose K/V `seq` holds.
    pub fn cached_tokens(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.sequence(seq)?.tokens)
    }

    /// Prepares `seq` to run `prompt`: keeps the longest cached prefix shared with it (but never the
    /// whole prompt, since the last prompt token must be computed for its logits), drops the rest,
    /// and returns how many prompt tokens were kept. The caller then steps `prompt[kept..]`.
    pub fn reuse_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize> {
        let shared = self.common_prefix(seq, prompt)?;
        let kept = shared.min(prompt.len().saturating_sub(1));
        self.truncate(seq, kept)
    }

    /// Length of the longest common prefix of `seq`'s cached tokens and `tokens`.
    pub fn common_prefix(&self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        Ok(self
            .sequence(seq)?
            .tokens
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count())
    }

    /// Bytes of the blocks `seq` holds.
    pub fn kv_bytes(&self, seq: SeqId) -> Result<usize> {
        Ok(self.sequence(seq)?.table.len() * self.alloc.bytes_per_block())
    }

    /// Bytes of the blocks all sequences hold.
    pub fn total_kv_bytes(&self) -> usize {
        self.alloc.used_bytes()
    }

    /// [`Engine::step_into`] into a fresh buffer, each sequence's logits as an owned vector
    /// (`None` where it asked for none): for tests and one-off callers; a loop keeps one
    /// [`Logits`] and calls `step_into`.
    pub fn step(&mut self, steps: &[SeqStep<'_>]) -> Result<Vec<Option<Vec<f32>>>> {
        let mut out = Logits::new();
        self.step_into(steps, &mut out)?;
        Ok(out.into_vecs())
    }

    /// Advances every listed sequence by its tokens in one forward pass, and puts each
    /// sequence's logits as asked (see [`LogitsMode`]) into `out`, in the order of `steps`.
    /// On error no cache has changed and `out` holds nothing.
    pub fn step_into(&mut self, steps: &[SeqStep<'_>], out: &mut Logits) -> Result<()> {
        self.step_sampled_into(steps, &[], out)
    }

    /// The most rows a step of `rows` rows may grow to and still compute each row bit for bit
    /// as before ([`Backend::rows_computed_alike`]): where verifying drafts keeps replies exact.
    pub fn rows_computed_alike(&self, rows: usize) -> usize {
        self.backend.rows_computed_alike(rows)
    }

    /// Whether the backend draws tokens on its device ([`LogitsMode::Sample`]).
    pub fn samples_on_device(&self) -> bool {
        self.backend.samples_on_device()
    }

    /// Opens or closes the backend's profiler range ([`Backend::profiler_range`]).
    pub fn profiler_range(&mut self, on: bool) -> Result<()> {
        self.backend.profiler_range(on)
    }

    /// [`Self::step_into`], where `sampling[i]` says how to draw step `i`'s tokens on the
    /// device when it asks for [`LogitsMode::Sample`] (one row; the token is then
    /// `out.token(i)`) or [`LogitsMode::SampleAll`] (a row per token; `out.tokens(i)`).
    pub fn step_sampled_into(
        &mut self,
        steps: &[SeqStep<'_>],
        sampling: &[&[DeviceSampling]],
        out: &mut Logits,
    ) -> Result<()> {
        self.launch_step(steps, sampling, out)?;
        self.finish_step(out)
    }

    /// The K/V of every position `seq` holds, and the tokens they were computed for, as bytes a
    /// backend of the same format restores ([`Self::restore_kv`]). Errors for a backend that
    /// cannot save its blocks, or while a step is in flight.
    pub fn save_kv(&mut self, seq: SeqId) -> Result<KvSnapshot> {
        if self.in_flight.is_some() {
            return Err(EngineError::InvalidStep(
                "a step is in flight: finish it before saving a sequence".into(),
            ));
        }
        let format = self.backend.kv_block_format().ok_or_else(|| {
            EngineError::InvalidStep(format!(
                "the {} tier cannot save its KV blocks",
                self.backend.tier()
            ))
        })?;
        let s = self.sequence(seq)?;
        let tokens = s.tokens.clone();
        let blocks = s.table.blocks()[..BlockAllocator::blocks_for(tokens.len())].to_vec();
        let mut bytes = Vec::with_capacity(blocks.len() * self.backend.kv_block_bytes());
        self.backend.read_kv_blocks(&blocks, &mut bytes)?;
        Ok(KvSnapshot {
            tokens,
            format,
            bytes,
        })
    }

    /// A new sequence holding the positions of `snapshot` (made by [`Self::save_kv`] on a
    /// backend of this format, for this model), none of them computed. Errors, changing
    /// nothing, when the format or the sizes do not match, a token is outside the vocabulary,
    /// the positions pass the context, or the KV cache lacks the blocks.
    pub fn restore_kv(&mut self, snapshot: &KvSnapshot) -> Result<SeqId> {
        if self.in_flight.is_some() {
            return Err(EngineError::InvalidStep(
                "a step is in flight: finish it before restoring a sequence".into(),
            ));
        }
        let format = self.backend.kv_block_format();
        if format.as_deref() != Some(snapshot.format.as_str()) {
            return Err(EngineError::InvalidStep(format!(
                "KV blocks saved as {} cannot be restored by a backend storing {}",
                snapshot.format,
                format.as_deref().unwrap_or("nothing it can restore")
            )));
        }
        let c = self.backend.config();
        if snapshot.tokens.len() > c.context_length {
            return Err(EngineError::InvalidStep(format!(
                "{} positions pass the context of {}",
                snapshot.tokens.len(),
                c.context_length
            )));
        }
        if let Some(t) = snapshot
            .tokens
            .iter()
            .find(|&&t| t as usize >= c.vocab_size)
        {
            return Err(EngineError::InvalidStep(format!(
                "token {t} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let blocks = BlockAllocator::blocks_for(snapshot.tokens.len());
        let expected = blocks * self.backend.kv_block_bytes();
        if snapshot.bytes.len() != expected {
            return Err(EngineError::InvalidStep(format!(
                "{} bytes of KV blocks for {} positions, which take {expected}",
                snapshot.bytes.len(),
                snapshot.tokens.len()
            )));
        }
        if blocks > self.alloc.free_blocks() {
            return Err(EngineError::KvCacheFull {
                needed_blocks: blocks,
                free_blocks: self.alloc.free_blocks(),
            });
        }
        let mut table = BlockTable::new();
        self.alloc.grow(&mut table, snapshot.tokens.len())?;
        let written = self
            .backend
            .reserve_blocks(self.alloc.high_water(), self.alloc.capacity_blocks())
            .and_then(|()| {
                self.backend
                    .write_kv_blocks(table.blocks(), &snapshot.bytes)
            });
        if let Err(e) = written {
            self.alloc.release(&mut table);
            return Err(e);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Sequence {
                table,
                tokens: snapshot.tokens.clone(),
            },
        );
        Ok(id)
    }

    /// Whether a step was launched and not finished yet.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The first half of [`Self::step_sampled_into`]: the step is checked, its blocks taken, its
    /// tokens recorded and its work started on the device, and this returns before its results
    /// are on the host where the backend computes on its own (a GPU); [`Self::finish_step`]
    /// waits for them and completes `out` (the same buffer). Meanwhile the caller may do host
    /// work, and truncate or free sequences (what the step writes past a truncated length is
    /// never read; a block given back is written by a later step only after this one), but
    /// launches no other step. On error no cache has changed and `out` holds nothing.
    pub fn launch_step(
        &mut self,
        steps: &[SeqStep<'_>],
        sampling: &[&[DeviceSampling]],
        out: &mut Logits,
    ) -> Result<()> {
        if self.in_flight.is_some() {
            return Err(EngineError::InvalidStep(
                "a step is still in flight: finish it before launching another".into(),
            ));
        }
        out.clear();
        let sample = |i: usize| sampling.get(i).copied().unwrap_or(&[]);
        if !self.backend.samples_on_device() && steps.iter().any(|s| s.logits.samples()) {
            return Err(EngineError::InvalidStep(format!(
                "the {} backend draws no tokens on its device; ask for LogitsMode::Last and \
                 sample on the host",
                self.backend.tier()
            )));
        }
        for (i, s) in steps.iter().enumerate() {
            if !self.seqs.contains_key(&s.seq) {
                return Err(EngineError::UnknownSequence(s.seq));
            }
            if steps[..i].iter().any(|o| o.seq == s.seq) {
                return Err(EngineError::InvalidStep(format!(
                    "sequence {} appears twice in one step",
                    s.seq
                )));
            }
        }
        let past: Vec<usize> = steps
            .iter()
            .map(|s| self.seqs.get(&s.seq).map_or(0, |q| q.tokens.len()))
            .collect();
        // Check the step before taking any block, so a refused step changes nothing.
        {
            let items: Vec<BatchItem<'_>> = steps
                .iter()
                .zip(&past)
                .enumerate()
                .map(|(i, (s, &past))| BatchItem {
                    blocks: &[],
                    past,
                    tokens: s.tokens,
                    logits: s.logits,
                    sample: sample(i),
                })
                .collect();
            self.backend.validate(&items)?;
        }
        let needed: usize = steps
            .iter()
            .zip(&past)
            .filter_map(|(s, &p)| {
                self.seqs
                    .get(&s.seq)
                    .map(|q| BlockAllocator::blocks_needed(&q.table, p + s.tokens.len()))
            })
            .sum();
        if needed > self.alloc.free_blocks() {
            return Err(EngineError::KvCacheFull {
                needed_blocks: needed,
                free_blocks: self.alloc.free_blocks(),
            });
        }
        for (s, &p) in steps.iter().zip(&past) {
            if let Some(q) = self.seqs.get_mut(&s.seq) {
                self.alloc.grow(&mut q.table, p + s.tokens.len())?;
            }
        }
        let high_water = self.alloc.high_water();
        let capacity = self.alloc.capacity_blocks();
        let result = self
            .backend
            .reserve_blocks(high_water, capacity)
            .and_then(|()| {
                let items: Vec<BatchItem<'_>> = steps
                    .iter()
                    .zip(&past)
                    .enumerate()
                    .filter_map(|(i, (s, &past))| {
                        self.seqs.get(&s.seq).map(|q| BatchItem {
                            blocks: q.table.blocks(),
                            past,
                            tokens: s.tokens,
                            logits: s.logits,
                            sample: sample(i),
                        })
                    })
                    .collect();
                self.backend.launch(&items, out)
            });
        for (s, &p) in steps.iter().zip(&past) {
            if let Some(q) = self.seqs.get_mut(&s.seq) {
                if result.is_ok() {
                    q.tokens.extend_from_slice(s.tokens);
                } else {
                    // Give back the blocks this step took; what was written in kept blocks past
                    // `p` is never read (positions beyond `tokens.len()` are overwritten).
                    self.alloc.truncate(&mut q.table, p);
                }
            }
        }
        if let Err(e) = result {
            out.clear();
            return Err(e);
        }
        self.stats.steps += 1;
        for s in steps {
            if s.tokens.len() == 1 {
                self.stats.decode_tokens += 1;
            } else {
                self.stats.prefill_tokens += s.tokens.len() as u64;
            }
        }
        self.in_flight = Some(steps.iter().map(|s| s.seq).zip(past).collect());
        Ok(())
    }

    /// Waits for the step [`Self::launch_step`] started and completes `out` with its results.
    /// Should the device fail it, each of its sequences is cut back to what it held before
    /// (what it held then, or less if truncated meanwhile) and `out` holds nothing.
    pub fn finish_step(&mut self, out: &mut Logits) -> Result<()> {
        let Some(before) = self.in_flight.take() else {
            return Err(EngineError::InvalidStep(
                "no step is in flight: launch one before finishing it".into(),
            ));
        };
        let finished = self.backend.finish(out);
        if finished.is_err() {
            out.clear();
            for (seq, p) in before {
                if let Some(q) = self.seqs.get_mut(&seq) {
                    if p < q.tokens.len() {
                        q.tokens.truncate(p);
                        self.alloc.truncate(&mut q.table, p);
                    }
                }
            }
        }
        finished
    }
}
