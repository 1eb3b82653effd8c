//! The fast tier: the step as a list of operations ([`plan`]) over buffers whose layouts the
//! GPU kernels and their Rust twins share ([`layout`], [`twin`]), run by a [`Runner`]: the CUDA
//! runner on a GPU (llama.cpp's quantized matmul launchers from candle-kernels, kernels of our
//! own), or the CPU runner ([`cpu`]), which executes the same list with the twins so that CI,
//! without a GPU, tests the step the GPU runs. [`FastBackend`] turns the engine's step into the
//! tables and the plan.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod differential;
pub mod graph;
pub mod launch;
pub mod layout;
pub mod packed;
pub mod plan;
pub mod twin;
pub mod verify;
pub mod weights;

use crate::backend::{check_request, Backend, BatchItem, StepLimits, Suggested};
use crate::config::ModelConfig;
use crate::device::{Device, Tier};
use crate::error::{EngineError, Result};
use crate::kv::{KvType, BLOCK_POSITIONS};
use crate::logits::{Logits, LogitsMode, SampleRow};
use crate::rope::RopeTable;
use graph::{GraphKey, GraphStats};
use layout::{slot_of, KvArena, SeqInfo, StepTables};
use plan::{Buf, Op, Plan};

/// What executes a plan: owns the weights, the KV arena and the working buffers.
pub trait Runner: Send {
    fn device(&self) -> Device;
    fn config(&self) -> &ModelConfig;
    fn weight_bytes(&self) -> usize;
    fn arena(&self) -> KvArena;
    /// Makes the arena hold at least `blocks` blocks.
    fn reserve_blocks(&mut self, blocks: usize) -> Result<()>;
    fn resident_blocks(&self) -> usize;
    /// The serving limits its device suits.
    fn suggested(&self) -> Suggested;
    /// See [`Backend::rows_computed_alike`].
    fn rows_computed_alike(&self, rows: usize) -> usize;
    /// See [`Backend::profiler_range`]; the CPU runner has no profiler.
    fn profiler_range(&mut self, _on: bool) -> Result<()> {
        Ok(())
    }
    /// Sizes every buffer and table for steps up to `plan` (its rows, logit rows, blocks per
    /// sequence and splits) of up to `sequences` sequences, before the first step (see
    /// [`Backend::prepare_for_serving`]). Runners without graphs need not.
    fn reserve_steps(&mut self, _plan: &Plan, _sequences: usize) -> Result<()> {
        Ok(())
    }
    /// Gets ready for `plan` over the step's `tables` (RoPE's cos/sin in `rope`): every buffer
    /// allocated, the tables uploaded. The operations read the tables from the runner's copy
    /// only, so a replayed graph sees the tables of the step it replays.
    fn begin(&mut self, plan: &Plan, tables: &StepTables, rope: &RopeTable) -> Result<()>;
    /// Runs one operation of the plan begun.
    fn run_op(&mut self, plan: &Plan, op: Op) -> Result<()>;
    /// The values of a working buffer now (`plan.len_of(buf)` of them).
    fn read(&mut self, plan: &Plan, buf: Buf) -> Result<Vec<f32>>;
    /// Sets a working buffer (the differential checks align two runners with it).
    fn write(&mut self, plan: &Plan, buf: Buf, values: &[f32]) -> Result<()>;
    /// The tokens the plan's [`Op::Sample`] drew, one per logit row.
    fn read_tokens(&mut self, plan: &Plan) -> Result<Vec<u32>>;

    /// Runs `plan`, then fetches what `out` asks for: the logits of the step's logit rows
    /// (`[logit rows][vocab]`) when `out.logits` is not empty, the drawn tokens when
    /// `out.tokens` is not empty.
    fn run(
        &mut self,
        plan: &Plan,
        tables: &StepTables,
        rope: &RopeTable,
        out: StepOut<'_>,
    ) -> Result<()> {
        self.launch(plan, tables, rope)?;
        self.fetch(plan, out)
    }

    /// [`Runner::run`] without the fetch: the plan's operations are queued (on a GPU they
    /// may still be running when this returns); [`Runner::fetch`] then waits for them.
    fn launch(&mut self, plan: &Plan, tables: &StepTables, rope: &RopeTable) -> Result<()> {
        self.begin(plan, tables, rope)?;
        for &op in &plan.ops {
            self.run_op(plan, op)?;
        }
        Ok(())
    }

    /// Copies what `out` asks for to the host (see [`Runner::run`]).
    fn fetch(&mut self, plan: &Plan, out: StepOut<'_>) -> Result<()> {
        if !out.logits.is_empty() && plan.logit_rows > 0 {
            out.logits.copy_from_slice(&self.read(plan, Buf::Logits)?);
        }
        if !out.tokens.is_empty() && plan.sample {
            out.tokens.copy_from_slice(&self.read_tokens(plan)?);
        }
        Ok(())
    }

    /// Whether [`Runner::run_graph`] replays captured graphs (otherwise it runs eagerly).
    fn graphs(&self) -> bool {
        false
    }

    /// Runs a decode step padded to `key` ([`graph::pad_decode`]) through the graph captured for
    /// `key`: warming the bucket up, capturing it or replaying it ([`graph::GraphCache`]).
    fn run_graph(
        &mut self,
        key: GraphKey,
        plan: &Plan,
        tables: &StepTables,
        rope: &RopeTable,
        out: StepOut<'_>,
    ) -> Result<()> {
        self.launch_graph(key, plan, tables, rope)?;
        self.fetch(plan, out)
    }

    /// [`Runner::run_graph`] without the fetch (see [`Runner::launch`]).
    fn launch_graph(
        &mut self,
        key: GraphKey,
        plan: &Plan,
        tables: &StepTables,
        rope: &RopeTable,
    ) -> Result<()> {
        let _ = key;
        self.launch(plan, tables, rope)
    }

    fn graph_stats(&self) -> GraphStats {
        GraphStats::default()
    }

    /// What the device's memory holds (a runner on a GPU).
    fn device_memory(&self) -> Option<crate::device::DeviceMemory> {
        None
    }

    /// Appends the bytes of arena blocks `blocks` (each [`KvArena::block_bytes`], f16
    /// little-endian in the arena's layout) to `out`, after every step queued before.
    fn read_blocks(&mut self, blocks: &[u32], out: &mut Vec<u8>) -> Result<()>;
    /// Writes `bytes` (as [`Runner::read_blocks`] gave them) into arena blocks `blocks`.
    fn write_blocks(&mut self, blocks: &[u32], bytes: &[u8]) -> Result<()>;

    /// Waits until everything launched has finished (for profiles; a no-op on the host).
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Where a step's results go on the host: either may be empty (not wanted).
pub struct StepOut<'a> {
    /// `[logit rows][vocab]`.
    pub logits: &'a mut [f32],
    /// One token per logit row.
    pub tokens: &'a mut [u32],
}

impl<'a> StepOut<'a> {
    pub fn logits(logits: &'a mut [f32]) -> Self {
        Self {
            logits,
            tokens: &mut [],
        }
    }
}

/// The KV arena's smallest growth on the fast tier: 64 blocks (1,024 positions), so short
/// conversations never reallocate it (each reallocation copies the arena and drops every decode
/// graph captured over it).
const GROW_BLOCKS: usize = 64;

/// The fast tier as an engine backend, over any runner.
pub struct FastBackend<R: Runner> {
    runner: R,
    /// Logits and drawn tokens of a part of a step on their way to the caller, kept from step
    /// to step.
    scratch: Vec<f32>,
    tokens: Vec<u32>,
    /// The last part of a launched step whose drawn tokens are fetched by `finish`.
    deferred: Option<Deferred>,
    /// Every position's RoPE row so far: a step's table is copied from it.
    rope: crate::rope::RopeCache,
}

/// A part of a step launched and not fetched yet: its plan, and for each of its items (by
/// index in the step) the first of its rows among the drawn tokens and how many it has.
struct Deferred {
    plan: Plan,
    items: Vec<(usize, usize, usize)>,
}

impl<R: Runner> FastBackend<R> {
    pub fn new(runner: R) -> Self {
        Self {
            runner,
            scratch: Vec::new(),
            tokens: Vec::new(),
            deferred: None,
            rope: crate::rope::RopeCache::default(),
        }
    }

    pub fn runner(&self) -> &R {
        &self.runner
    }
}

/// The tables of a step of `items`.
///
/// An item drawing every position ([`LogitsMode::SampleAll`], verifying drafts) becomes one
/// sequence of one row per position, each seeing the positions before it (the earlier rows' K/V
/// are written before attention reads them, layer by layer): exactly a decode row at that
/// position, so such a step is a decode step and fits a decode graph.
pub fn step_tables(items: &[BatchItem<'_>]) -> StepTables {
    let max_blocks = items
        .iter()
        .map(|i| i.blocks.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut t = StepTables {
        max_blocks,
        ..StepTables::default()
    };
    for item in items {
        let row0 = t.tokens.len();
        let n = item.tokens.len();
        let last = item.blocks.last().copied().unwrap_or(0);
        // (sequences, rows each): a verifying item is `n` sequences of one row.
        let (seqs, rows) = if item.logits == LogitsMode::SampleAll {
            (n, 1)
        } else {
            (1, n)
        };
        for s in 0..seqs {
            let first = s * rows;
            let index = t.seqs.len() as u32;
            t.seqs.push(SeqInfo {
                row0: (row0 + first) as u32,
                rows: rows as u32,
                past: (item.past + first) as u32,
                index,
            });
            t.block_tables.extend_from_slice(item.blocks);
            t.block_tables
                .extend(std::iter::repeat_n(last, max_blocks - item.blocks.len()));
            for _ in 0..rows {
                t.row_seq.push(index);
            }
        }
        for (r, &token) in item.tokens.iter().enumerate() {
            let position = item.past + r;
            t.tokens.push(token);
            t.positions.push(position as u32);
            t.slots.push(slot_of(item.blocks, position));
        }
        t.hidden |= item.logits == LogitsMode::Hidden;
        let first = row0 + n - item.logits.device_rows(n);
        for (k, row) in (first..row0 + n).enumerate() {
            t.logit_rows.push(row as u32);
            let start = (t.penalties.len() / 2) as u32;
            match (item.logits.samples(), item.sample.get(k)) {
                (true, Some(s)) => {
                    t.sample = true;
                    t.sampling.push(s.row);
                    t.penalties.extend(
                        s.penalties
                            .iter()
                            .flat_map(|&(token, count)| [token, count]),
                    );
                }
                _ => t.sampling.push(SampleRow::GREEDY),
            }
            t.penalty_spans
                .extend([start, (t.penalties.len() / 2) as u32]);
        }
    }
    t
}

impl<R: Runner> Backend for FastBackend<R> {
    fn device(&self) -> Device {
        self.runner.device()
    }

    fn tier(&self) -> Tier {
        Tier::Fast
    }

    fn graph_stats(&self) -> Option<GraphStats> {
        self.runner.graphs().then(|| self.runner.graph_stats())
    }

    fn device_memory(&self) -> Option<crate::device::DeviceMemory> {
        self.runner.device_memory()
    }

    fn suggested(&self) -> Suggested {
        self.runner.suggested()
    }

    fn config(&self) -> &ModelConfig {
        self.runner.config()
    }

    fn weight_bytes(&self) -> usize {
        self.runner.weight_bytes()
    }

    fn kv_type(&self) -> KvType {
        KvType::F16
    }

    fn kv_bytes_per_position(&self) -> usize {
        self.runner.arena().block_bytes() / BLOCK_POSITIONS
    }

    fn kv_block_bytes(&self) -> usize {
        self.runner.arena().block_bytes()
    }

    fn reserve_blocks(&mut self, blocks: usize, capacity: usize) -> Result<()> {
        if blocks <= self.runner.resident_blocks() {
            return Ok(());
        }
        let resident = self.runner.resident_blocks();
        self.runner.reserve_blocks(crate::backend::grown_blocks(
            resident,
            blocks,
            capacity,
            GROW_BLOCKS,
        ))
    }

    fn kv_resident_bytes(&self) -> usize {
        self.runner.resident_blocks() * self.kv_block_bytes()
    }

    /// With graphs, everything they are captured over is sized now: the whole arena, and the
    /// buffers and tables of the widest step (every row, a logit row per sequence, a drawn
    /// token each, the context's blocks per sequence). Without graphs nothing is lost by
    /// growing as steps come.
    fn prepare_for_serving(&mut self, limits: StepLimits, kv_blocks: usize) -> Result<()> {
        if !self.runner.graphs() {
            return Ok(());
        }
        self.runner.reserve_blocks(kv_blocks)?;
        let sequences = limits.sequences.max(1);
        let blocks_per_sequence = limits
            .context
            .div_ceil(BLOCK_POSITIONS)
            .clamp(1, kv_blocks.max(1));
        let mut plan = Plan::forward(
            self.config(),
            limits.rows.max(sequences),
            sequences,
            blocks_per_sequence,
        );
        plan.sample = true;
        self.runner.reserve_steps(&plan, sequences)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn profiler_range(&mut self, on: bool) -> Result<()> {
        self.runner.profiler_range(on)
    }

    fn kv_block_format(&self) -> Option<String> {
        Some("fast-arena-f16-v1".into())
    }

    fn read_kv_blocks(&mut self, blocks: &[u32], out: &mut Vec<u8>) -> Result<()> {
        crate::backend::check_resident(blocks, self.runner.resident_blocks())?;
        self.runner.read_blocks(blocks, out)
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], bytes: &[u8]) -> Result<()> {
        crate::backend::check_resident(blocks, self.runner.resident_blocks())?;
        let size = self.runner.arena().block_bytes();
        if bytes.len() != blocks.len() * size {
            return Err(EngineError::InvalidStep(format!(
                "{} bytes are not {} blocks of {size}",
                bytes.len(),
                blocks.len()
            )));
        }
        self.runner.write_blocks(blocks, bytes)
    }

    fn rows_computed_alike(&self, rows: usize) -> usize {
        self.runner.rows_computed_alike(rows)
    }

    fn validate(&self, items: &[BatchItem<'_>]) -> Result<()> {
        check_request(self.config(), items)
    }

    fn forward(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        self.launch(items, out)?;
        self.finish(out)
    }

    fn finish(&mut self, out: &mut Logits) -> Result<()> {
        let Some(d) = self.deferred.take() else {
            return Ok(());
        };
        self.tokens.resize(d.plan.logit_rows, 0);
        let step_out = StepOut {
            logits: &mut [],
            tokens: &mut self.tokens,
        };
        self.runner.fetch(&d.plan, step_out)?;
        for (i, row, n) in d.items {
            out.set_tokens(i, &self.tokens[row..row + n]);
        }
        Ok(())
    }

    /// A step's parts run in turn; the last one's drawn tokens, when they are all it gives back,
    /// are left on the device for [`Backend::finish`].
    fn launch(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        if self.deferred.is_some() {
            return Err(EngineError::InvalidStep(
                "the fast tier still has a step in flight".into(),
            ));
        }
        check_request(self.config(), items)?;
        for (i, item) in items.iter().enumerate() {
            let needed = item.past + item.tokens.len();
            if item.blocks.len() * BLOCK_POSITIONS < needed {
                return Err(EngineError::InvalidStep(format!(
                    "sequence #{i} of the step has KV blocks for {} positions but needs {needed}",
                    item.blocks.len() * BLOCK_POSITIONS
                )));
            }
            let resident = self.runner.resident_blocks();
            if let Some(&b) = item.blocks.iter().find(|&&b| b as usize >= resident) {
                return Err(EngineError::InvalidStep(format!(
                    "KV block {b} has no pages in the arena"
                )));
            }
        }
        let vocab = self.config().vocab_size;
        // Each item's first row in the logits the caller gets.
        let mut host_row = Vec::with_capacity(items.len());
        let mut rows = 0;
        for item in items {
            host_row.push(rows);
            rows += item.logits.host_rows(item.tokens.len());
        }
        out.set_hidden_width(self.config().hidden);
        out.prepare(
            vocab,
            items.iter().map(|item| (item.tokens.len(), item.logits)),
        );
        // Hidden-state items (embeddings) run as a part of their own, whose plan stops at the
        // output norm: no LM head for them, and no hidden rows for the others.
        let (hidden, items_rest): (Vec<usize>, Vec<usize>) =
            (0..items.len()).partition(|&i| items[i].logits == LogitsMode::Hidden);
        if !hidden.is_empty() {
            self.run_part(items, &hidden, &host_row, out, false, false)?;
        }
        // Decode rows: one-token items wanting their last logits or a draw, and verifying items
        // (a draw at every position, each a decode row of its own).
        let (decode, rest): (Vec<usize>, Vec<usize>) = items_rest.iter().partition(|&&i| {
            self.runner.graphs()
                && match items[i].logits {
                    LogitsMode::Last | LogitsMode::Sample => items[i].tokens.len() == 1,
                    LogitsMode::SampleAll => true,
                    _ => false,
                }
        });
        let decode_rows: usize = decode.iter().map(|&i| items[i].tokens.len()).sum();
        // Only a step of decode rows alone is replayed from a graph. A mixed step runs as one
        // eager pass: its decode rows ride in the prefill's matmuls, so the weights are read
        // once instead of once for a graphed decode part and again for an eager prefill part
        // (issue 48: at 64 conversations the server reached 36% of the engine's decode rate).
        if rest.is_empty() && graph::bucket_rows(decode_rows).is_some() {
            self.run_part(items, &decode, &host_row, out, true, true)?;
        } else if !items_rest.is_empty() {
            self.run_part(items, &items_rest, &host_row, out, false, true)?;
        }
        Ok(())
    }
}

impl<R: Runner> FastBackend<R> {
    /// Runs the items `part` of `items` as one step (through a graph when `graphed`: a decode
    /// part), and hands each item its logits rows (at `host_row`) or its drawn token; when
    /// `may_defer` and drawn tokens are all the part gives back, they are fetched by
    /// [`Backend::finish`] instead.
    fn run_part(
        &mut self,
        items: &[BatchItem<'_>],
        part: &[usize],
        host_row: &[usize],
        out: &mut Logits,
        graphed: bool,
        may_defer: bool,
    ) -> Result<()> {
        let vocab = self.config().vocab_size;
        let sub: Vec<BatchItem<'_>> = part.iter().map(|&i| items[i]).collect();
        let mut tables = step_tables(&sub);
        let key = if graphed {
            let key = graph::key_of(&tables).ok_or_else(|| {
                EngineError::InvalidStep(format!(
                    "{} decode rows have no graph bucket",
                    tables.rows()
                ))
            })?;
            tables = graph::pad_decode(&tables, key)?;
            Some(key)
        } else {
            None
        };
        let positions: Vec<usize> = tables.positions.iter().map(|&p| p as usize).collect();
        let rope = self.rope.rows(self.runner.config(), &positions);
        let plan = Plan::for_step(self.config(), &tables);
        let wants_logits = sub
            .iter()
            .any(|i| matches!(i.logits, LogitsMode::Last | LogitsMode::All));
        let device_rows = tables.logit_rows.len();
        self.scratch
            .resize(if wants_logits { device_rows * vocab } else { 0 }, 0.0);
        self.tokens
            .resize(if plan.sample { device_rows } else { 0 }, 0);
        if may_defer && plan.sample && !wants_logits && !plan.hidden {
            match key {
                Some(key) => self.runner.launch_graph(key, &plan, &tables, &rope)?,
                None => self.runner.launch(&plan, &tables, &rope)?,
            }
            let mut row = 0;
            let mut rows = Vec::with_capacity(part.len());
            for (&i, item) in part.iter().zip(&sub) {
                let n = item.logits.device_rows(item.tokens.len());
                if item.logits.samples() {
                    rows.push((i, row, n));
                }
                row += n;
            }
            self.deferred = Some(Deferred { plan, items: rows });
            return Ok(());
        }
        let step_out = StepOut {
            logits: &mut self.scratch,
            tokens: &mut self.tokens,
        };
        match key {
            Some(key) => self
                .runner
                .run_graph(key, &plan, &tables, &rope, step_out)?,
            None => self.runner.run(&plan, &tables, &rope, step_out)?,
        }
        if plan.hidden {
            // A hidden part's normed rows are its items' hidden states, in the items' order.
            let normed = self.runner.read(&plan, Buf::SelNorm)?;
            let width = self.config().hidden;
            let mut row = 0;
            for &i in part {
                if let Some(dst) = out.hidden_item_mut(i) {
                    let n = dst.len() / width;
                    dst.copy_from_slice(&normed[row * width..(row + n) * width]);
                    row += n;
                }
            }
            return Ok(());
        }
        // Device logit rows follow the items' order: hand them out.
        let mut row = 0;
        for (&i, item) in part.iter().zip(&sub) {
            let n = item.logits.device_rows(item.tokens.len());
            match item.logits {
                LogitsMode::Last | LogitsMode::All => {
                    let host = out.rows_mut(host_row[i], n);
                    host.copy_from_slice(&self.scratch[row * vocab..(row + n) * vocab]);
                }
                LogitsMode::Sample | LogitsMode::SampleAll => {
                    out.set_tokens(i, &self.tokens[row..row + n]);
                }
                LogitsMode::None | LogitsMode::Hidden => {}
            }
            row += n;
        }
        Ok(())
    }
}
