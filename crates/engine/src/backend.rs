//! The seam between the engine's bookkeeping and the hardware: a [`Backend`] holds the weights
//! and the KV pages and runs one forward pass over a step's items. The [`super::Engine`] owns
//! the rest (the block allocator, the sequence table, prefix reuse), the same whatever computes.
//!
//! Today there is one backend, [`crate::cpu::CpuBackend`]: the transformer of `cpu/model.rs`
//! over the host KV pages of `cpu/kv.rs`, its matmuls on the rayon pool. A CUDA backend
//! implements the same trait over VRAM pages indexed by the same block ids.

use crate::config::ModelConfig;
use crate::device::{Device, Tier};
use crate::error::{EngineError, Result};
use crate::kv::{BlockId, KvType};
use crate::logits::{Logits, LogitsMode};

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]
pub struct BatchItem<'a> {
    /// The sequence's block table, already grown to hold `past + tokens.len()` positions.
    pub blocks: &'a [BlockId],
    /// Positions already cached; the new tokens go at `past..`.
    pub past: usize,
    pub tokens: &'a [u32],
    pub logits: LogitsMode,
    /// How to draw tokens on the device: one row for [`LogitsMode::Sample`], one per token for
    /// [`LogitsMode::SampleAll`], none otherwise.
    pub sample: &'a [crate::logits::DeviceSampling],
}

pub use crate::device::Suggested;

/// How far an arena that is costly to grow grows to hold `wanted` blocks: at least double what
/// it holds and at least `min_blocks`, so growth happens a logarithmic number of times, but never
/// past `capacity` (the budget) unless `wanted` itself is past it.
pub fn grown_blocks(resident: usize, wanted: usize, capacity: usize, min_blocks: usize) -> usize {
    wanted.max((resident * 2).max(min_blocks).min(capacity))
}

/// Every block id in `blocks` has pages (ids below `resident`): the check of a backend's
/// [`Backend::read_kv_blocks`] and [`Backend::write_kv_blocks`].
pub fn check_resident(blocks: &[BlockId], resident: usize) -> Result<()> {
    match blocks.iter().find(|&&b| b as usize >= resident) {
        Some(b) => Err(EngineError::InvalidStep(format!(
            "KV block {b} has no pages"
        ))),
        None => Ok(()),
    }
}

/// One compute backend (see the module docs).
pub trait Backend: Send {
    /// Where it computes.
    fn device(&self) -> Device;
    /// The serving limits this device suits, for the settings the configuration leaves unset.
    fn suggested(&self) -> Suggested;
    /// Which path computes there.
    fn tier(&self) -> Tier;
    /// How decode graphs have been used, for a backend that replays them.
    fn graph_stats(&self) -> Option<crate::fast::graph::GraphStats> {
        None
    }
    /// What the device's memory holds, for a backend on a GPU that can tell.
    fn device_memory(&self) -> Option<crate::device::DeviceMemory> {
        None
    }
    /// The model's shapes and limits.
    fn config(&self) -> &ModelConfig;
    /// Bytes of weights held.
    fn weight_bytes(&self) -> usize;
    /// How KV rows are stored.
    fn kv_type(&self) -> KvType;
    /// Bytes one position takes across every layer and KV head.
    fn kv_bytes_per_position(&self) -> usize;
    /// Bytes of one block of [`super::kv::BLOCK_POSITIONS`] positions: the allocator's unit.
    fn kv_block_bytes(&self) -> usize;
    /// Makes pages exist for every block id below `blocks` (they are allocated lazily). A
    /// backend whose growth is costly (a GPU arena is reallocated and copied, and its decode
    /// graphs captured anew) may take more, never past `capacity`, the allocator's whole budget.
    fn reserve_blocks(&mut self, blocks: usize, capacity: usize) -> Result<()>;
    /// Bytes of KV pages allocated so far.
    fn kv_resident_bytes(&self) -> usize;
    /// Sizes what grows with the steps (the KV pages, up to `kv_blocks`, the allocator's whole
    /// budget; the step's buffers and tables, for steps within `limits`) before the first step,
    /// where growing later costs more than holding: a GPU arena or buffer reallocated drops
    /// every decode graph captured over it, so a server warming up would capture its graphs
    /// again and again. Backends that grow cheaply do nothing.
    fn prepare_for_serving(&mut self, _limits: StepLimits, _kv_blocks: usize) -> Result<()> {
        Ok(())
    }
    /// The most rows a step of `rows` rows may grow to (by a decode's drafts) and still compute
    /// each row's outputs bit for bit as the smaller step would (see
    /// [`crate::fast::launch::rows_computed_alike`] for the CUDA kernels). The CPU kernels
    /// compute every row alike whatever the step's size.
    fn rows_computed_alike(&self, _rows: usize) -> usize {
        usize::MAX
    }
    /// Whether it can draw tokens on its device ([`LogitsMode::Sample`]).
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Opens (`on`) or closes a profiler range: on a GPU, what Nsight Compute run with
    /// `--profile-from-start off` profiles (`smolchat bench --profile-decode-at`). Backends
    /// without a profiler do nothing.
    fn profiler_range(&mut self, _on: bool) -> Result<()> {
        Ok(())
    }
    /// How this backend lays a KV block out in bytes ([`Self::read_kv_blocks`]), naming the
    /// storage and its type: blocks saved by one backend are restored only by a backend of the
    /// same format. `None`: this backend cannot save its blocks (they are then recomputed).
    fn kv_block_format(&self) -> Option<String> {
        None
    }
    /// Appends the bytes of `blocks` (each [`Self::kv_block_bytes`] long, in the backend's
    /// format) to `out`.
    fn read_kv_blocks(&mut self, _blocks: &[BlockId], _out: &mut Vec<u8>) -> Result<()> {
        Err(EngineError::InvalidStep(format!(
            "the {} tier cannot save its KV blocks",
            self.tier()
        )))
    }
    /// Writes `bytes` (as [`Self::read_kv_blocks`] gave them) into `blocks`, which have pages.
    fn write_kv_blocks(&mut self, _blocks: &[BlockId], _bytes: &[u8]) -> Result<()> {
        Err(EngineError::InvalidStep(format!(
            "the {} tier cannot restore KV blocks",
            self.tier()
        )))
    }
    /// Checks a step's items before any block is taken (token ids, lengths, the window).
    fn validate(&self, items: &[BatchItem<'_>]) -> Result<()>;
    /// One forward pass over `items`, whose blocks are reserved: writes their K/V and puts each
    /// item's logits as it asked ([`crate::LogitsMode`]) into `out`, reusing its buffer.
    fn forward(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()>;
    /// Starts [`Self::forward`] and returns before its results are on the host where the device
    /// computes on its own (a GPU: the step's kernels are queued, its drawn tokens fetched by
    /// [`Self::finish`]), so the host can deliver the step before while it runs. Backends that
    /// compute on the host run it whole here (the default). `out` is prepared here and
    /// completed by `finish`.
    fn launch(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        self.forward(items, out)
    }
    /// Waits for the pass [`Self::launch`] started and completes `out` with its results.
    fn finish(&mut self, _out: &mut Logits) -> Result<()> {
        Ok(())
    }
}

/// The largest steps a server will run: what [`Backend::prepare_for_serving`] sizes for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    /// Rows (tokens) of one step: the scheduler's token budget plus its decode rows.
    pub rows: usize,
    /// Sequences of one step (the running requests, each draft a sequence of its own).
    pub sequences: usize,
    /// Positions one sequence may reach (the context window).
    pub context: usize,
}

/// A backend that computes as `inner` does and tells `watch` what the engine asks of it (for
/// tests, here and in the crates above, that check what reaches a backend): every reservation
/// and every forward pass. `rows_alike` replaces `inner`'s
/// [`Backend::rows_computed_alike`] when set (a CPU backend answering as a GPU's would).
pub struct Watched {
    pub inner: Box<dyn Backend>,
    pub watch: Box<dyn FnMut(Asked<'_>) + Send>,
    pub rows_alike: Option<fn(usize) -> usize>,
}

/// What the engine asked of a [`Watched`] backend.
#[derive(Debug, Clone, Copy)]
pub enum Asked<'a> {
    /// Pages for every block id below this many.
    Reserve(usize),
    /// A forward pass over these items.
    Forward(&'a [BatchItem<'a>]),
}

impl Backend for Watched {
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn suggested(&self) -> Suggested {
        self.inner.suggested()
    }
    fn tier(&self) -> Tier {
        self.inner.tier()
    }
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn kv_type(&self) -> KvType {
        self.inner.kv_type()
    }
    fn kv_bytes_per_position(&self) -> usize {
        self.inner.kv_bytes_per_position()
    }
    fn kv_block_bytes(&self) -> usize {
        self.inner.kv_block_bytes()
    }
    fn reserve_blocks(&mut self, blocks: usize, capacity: usize) -> Result<()> {
        (self.watch)(Asked::Reserve(blocks));
        self.inner.reserve_blocks(blocks, capacity)
    }
    fn kv_resident_bytes(&self) -> usize {
        self.inner.kv_resident_bytes()
    }
    fn prepare_for_serving(&mut self, limits: StepLimits, kv_blocks: usize) -> Result<()> {
        self.inner.prepare_for_serving(limits, kv_blocks)
    }
    fn rows_computed_alike(&self, rows: usize) -> usize {
        match self.rows_alike {
            Some(rule) => rule(rows),
            None => self.inner.rows_computed_alike(rows),
        }
    }
    fn samples_on_device(&self) -> bool {
        self.inner.samples_on_device()
    }
    fn validate(&self, items: &[BatchItem<'_>]) -> Result<()> {
        self.inner.validate(items)
    }
    fn kv_block_format(&self) -> Option<String> {
        self.inner.kv_block_format()
    }
    fn read_kv_blocks(&mut self, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<()> {
        self.inner.read_kv_blocks(blocks, out)
    }
    fn write_kv_blocks(&mut self, blocks: &[BlockId], bytes: &[u8]) -> Result<()> {
        self.inner.write_kv_blocks(blocks, bytes)
    }
    fn forward(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        (self.watch)(Asked::Forward(items));
        self.inner.forward(items, out)
    }
    fn launch(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        (self.watch)(Asked::Forward(items));
        self.inner.launch(items, out)
    }
    fn finish(&mut self, out: &mut Logits) -> Result<()> {
        self.inner.finish(out)
    }
}

/// The checks of a step that do not depend on KV blocks, the same on every backend: tokens
/// present and in the vocabulary, and the context window respected.
pub fn check_request(c: &ModelConfig, items: &[BatchItem<'_>]) -> Result<()> {
    if items.is_empty() {
        return Err(EngineError::InvalidStep(
            "a step needs at least one sequence".into(),
        ));
    }
    for (i, item) in items.iter().enumerate() {
        if item.tokens.is_empty() {
            return Err(EngineError::InvalidStep(format!(
                "sequence #{i} of the step has no tokens"
            )));
        }
        if let Some(&id) = item.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(EngineError::BadToken {
                id,
                vocab: c.vocab_size,
            });
        }
        let wanted = item.logits.drawn_rows(item.tokens.len());
        if item.sample.len() != wanted {
            return Err(EngineError::InvalidStep(format!(
                "sequence #{i} of the step asks for {wanted} tokens drawn on the device but gives \
                 {} rows of sampling parameters",
                item.sample.len()
            )));
        }
        for s in item.sample {
            if let Some(&(id, _)) = s.penalties.iter().find(|p| p.0 as usize >= c.vocab_size) {
                return Err(EngineError::BadToken {
                    id,
                    vocab: c.vocab_size,
                });
            }
        }
        let needed = item.past + item.tokens.len();
        if needed > c.context_length {
            return Err(EngineError::ContextOverflow {
                seq: i as u64,
                needed,
                window: c.context_length,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::grown_blocks;

    #[test]
    fn costly_arenas_double_within_the_budget() {
        assert_eq!(grown_blocks(0, 3, 1000, 64), 64);
        assert_eq!(grown_blocks(64, 65, 1000, 64), 128);
        assert_eq!(grown_blocks(600, 601, 1000, 64), 1000);
        // Asked for more than double: exactly that.
        assert_eq!(grown_blocks(64, 300, 1000, 64), 300);
        // A budget smaller than the minimum growth.
        assert_eq!(grown_blocks(0, 2, 6, 64), 6);
    }

    use super::*;

    #[test]
    fn a_gpus_kv_budget_is_its_free_memory_less_a_margin() {
        let gib = 1usize << 30;
        // An H100 with a 2 GB model loaded: a tenth kept back.
        assert_eq!(
            Suggested::gpu(78 * gib).kv_budget_bytes,
            78 * gib - 78 * gib / 10
        );
        // A small card: at least 1 GiB kept back.
        assert_eq!(Suggested::gpu(4 * gib).kv_budget_bytes, 3 * gib);
        assert_eq!(Suggested::gpu(gib / 2).kv_budget_bytes, 0);
        assert_eq!(
            (
                Suggested::gpu(gib).max_running,
                Suggested::gpu(gib).batch_token_budget
            ),
            (64, 2048)
        );
        assert_eq!(Suggested::CPU.kv_budget_bytes, 2048 << 20);
    }
}
