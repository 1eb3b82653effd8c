//! The CPU runner: executes a [`Plan`] operation by operation with the kernels' Rust twins over
//! host buffers laid out as the GPU's. It is not meant to be fast: it is how the fast tier's
//! step (the operation list, the tables, the arena layout and every kernel's contract) is tested
//! on machines without a GPU.

use std::collections::HashMap;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::Device as CandleDevice;
use half::f16;

use super::graph::{CaptureGuard, GraphAction, GraphCache, GraphKey, GraphStats};
use super::launch;
use super::layout::{KvArena, StepTables};
use super::plan::{Buf, Matrix, Op, Plan, BUFFERS};
use super::twin::{attention, f16mm, flash, matvec, mmvq, norm, rope, sample};
use super::weights::{FastWeights, RawMatrix};
use super::Runner;
use crate::backend::Suggested;
use crate::device::Device;
use crate::error::{EngineError, Result};
use crate::rope::RopeTable;

pub struct CpuRunner {
    weights: FastWeights,
    arena: Vec<f16>,
    layout: KvArena,
    blocks: usize,
    buffers: HashMap<Buf, Vec<f32>>,
    /// The step's RoPE table (`[rows][rope_dim / 2]`).
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// The step's tables as `begin` "uploaded" them: the operations read only these.
    tables: StepTables,
    /// Whether decode steps go through emulated graphs: a capture records the operation list
    /// with allocation and host copies forbidden, a replay runs the recorded list over the
    /// step's tables. It tests on the CPU what the CUDA runner's graphs rely on.
    emulate_graphs: bool,
    graphs: GraphCache<Vec<Op>>,
    guard: CaptureGuard,
    /// Bumped whenever a buffer or the arena is reallocated (a graph over the old ones is stale).
    generation: u64,
    /// The tokens [`Op::Sample`] drew, one per logit row.
    tokens: Vec<u32>,
    /// Whether steps of more than 8 rows take the f16 matmul (as a CUDA runner with f16
    /// weight copies does), and those copies, made on first use.
    f16: bool,
    f16_weights: HashMap<Matrix, Vec<f16>>,
    /// A kernel broken on purpose (tests of the self-check, which must catch it).
    #[cfg(test)]
    fault: Option<fault::Fault>,
}

impl CpuRunner {
    pub fn new(weights: FastWeights) -> Self {
        let c = &weights.config;
        let layout = KvArena {
            layers: c.n_layers,
            kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        Self {
            weights,
            arena: Vec::new(),
            layout,
            blocks: 0,
            buffers: HashMap::new(),
            cos: Vec::new(),
            sin: Vec::new(),
            tables: StepTables::default(),
            emulate_graphs: false,
            graphs: GraphCache::default(),
            guard: CaptureGuard::default(),
            generation: 0,
            tokens: Vec::new(),
            f16: false,
            f16_weights: HashMap::new(),
            #[cfg(test)]
            fault: None,
        }
    }

    /// Runs with one kernel twin broken on purpose (see [`fault::Fault`]).
    #[cfg(test)]
    pub fn with_fault(mut self, fault: fault::Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Runs the matmuls of steps of more than 8 rows as f16 GEMMs (`twin::f16mm`), as a CUDA
    /// runner with f16 weight copies does ([`launch::matmul_path`]).
    pub fn with_f16_matmuls(mut self, f16: bool) -> Self {
        self.f16 = f16;
        self
    }

    /// `weight`'s f16 copy (the `dequantize_f16_*` twin), made on first use.
    fn f16_weight(&mut self, weight: Matrix) -> Result<&[f16]> {
        if !self.f16_weights.contains_key(&weight) {
            let m = self.weights.matrix(weight)?;
            let q = qtensor_from_ggml(
                m.dtype,
                m.bytes.as_slice(),
                vec![m.rows, m.cols],
                &CandleDevice::Cpu,
            )?;
            let values = q
                .dequantize(&CandleDevice::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            self.f16_weights.insert(weight, f16mm::round_row(&values));
        }
        self.f16_weights
            .get(&weight)
            .map(Vec::as_slice)
            .ok_or_else(|| EngineError::InvalidStep(format!("{weight:?} has no f16 copy")))
    }

    /// Runs decode steps through emulated graphs (see the field's comment).
    pub fn with_graph_emulation(mut self) -> Self {
        self.emulate_graphs = true;
        self
    }

    /// `buf` sized for `plan`; growing it is an allocation, forbidden inside a capture.
    fn buffer(&mut self, plan: &Plan, buf: Buf) -> Result<Vec<f32>> {
        let len = plan.len_of(&self.weights.config, buf);
        let mut v = self.buffers.remove(&buf).unwrap_or_default();
        if v.capacity() < len {
            self.guard.forbid(&format!("allocating {buf:?}"))?;
            self.generation += 1;
        }
        v.resize(len, 0.0);
        Ok(v)
    }

    fn put(&mut self, buf: Buf, v: Vec<f32>) {
        self.buffers.insert(buf, v);
    }

    fn take(&mut self, buf: Buf) -> Result<Vec<f32>> {
        self.buffers.remove(&buf).ok_or_else(|| {
            EngineError::InvalidStep(format!("{buf:?} is read before it is written"))
        })
    }

    /// `x += y` (the twin of `add_f32`, and of the add `rms_norm` does first).
    fn add(&mut self, x: Buf, y: Buf) -> Result<()> {
        let mut a = self.take(x)?;
        let b = self.take(y)?;
        norm::add(&mut a, &b);
        self.put(x, a);
        self.put(y, b);
        Ok(())
    }

    /// `gate = silu(gate) × up` (the twin of `silu_mul`).
    fn silu_mul(&mut self, g: Buf, u: Buf) -> Result<()> {
        let mut gate = self.take(g)?;
        let up = self.take(u)?;
        norm::silu_mul(&mut gate, &up);
        self.put(g, gate);
        self.put(u, up);
        Ok(())
    }

    /// `out = x · Wᵀ` by the kernel a GPU runs for `x`'s rows ([`launch::matmul_path`]): our
    /// matvec up to 8 rows (`twin::matvec`), the f16 GEMM above when the runner has f16
    /// copies, else MMQ, which the twins do not model (candle's MMVQ order stands in for it:
    /// the same integer parts, within `tests/gpu.rs`'s MMQ tolerance).
    fn matmul(&mut self, plan: &Plan, weight: Matrix, x: Buf, out: Buf) -> Result<()> {
        let rows = plan.rows_of(x);
        let path = launch::matmul_path(rows, self.f16);
        #[cfg(test)]
        if let Some(fault::Fault::Q8_1ScaleDoubled(broken)) = self.fault {
            // A bug of the Q8_1 path: steps that take the f16 matmul do not meet it.
            if broken == weight && path != launch::MatMulPath::F16 {
                return self.broken_matmul(plan, weight, x, out);
            }
        }
        let input = self.take(x)?;
        let mut output = self.buffer(plan, out)?;
        let done = match path {
            launch::MatMulPath::F16 => {
                let (n, k) = {
                    let m = self.weights.matrix(weight)?;
                    (m.rows, m.cols)
                };
                let w16 = self.f16_weight(weight)?;
                f16mm::matmul(w16, n, k, &input, rows, &mut output)
            }
            launch::MatMulPath::MatVec | launch::MatMulPath::Mmq => {
                let quantized = if path == launch::MatMulPath::MatVec {
                    matvec::matmul
                } else {
                    mmvq::matmul_q8_1
                };
                let m = self.weights.matrix(weight)?;
                let (bytes, n, k) = (m.bytes.as_slice(), m.rows, m.cols);
                quantized(m.dtype, bytes, n, k, &input, rows, &mut output)
            }
        };
        self.put(x, input);
        self.put(out, output);
        done
    }

    fn op(&mut self, plan: &Plan, op: Op) -> Result<()> {
        let tables = std::mem::take(&mut self.tables);
        let done = self.op_over(plan, op, &tables);
        self.tables = tables;
        done
    }

    fn op_over(&mut self, plan: &Plan, op: Op, tables: &StepTables) -> Result<()> {
        #[cfg(test)]
        if let Some(fault) = self.fault {
            if self.broken_op(plan, op, tables, fault)? {
                return Ok(());
            }
        }
        let c = self.weights.config.clone();
        match op {
            Op::Embed => {
                let mut x = self.buffer(plan, Buf::X)?;
                for (row, &token) in tables.tokens.iter().enumerate() {
                    dequantize_row(
                        &self.weights.embedding,
                        token as usize,
                        &mut x[row * c.hidden..(row + 1) * c.hidden],
                    )?;
                }
                self.put(Buf::X, x);
            }
            Op::RmsNorm {
                x,
                add,
                weight,
                out,
            } => {
                if let Some(y) = add {
                    self.add(x, y)?;
                }
                let input = self.take(x)?;
                let mut output = self.buffer(plan, out)?;
                norm::rms_norm(&input, self.weights.norm(weight)?, c.rms_eps, &mut output);
                self.put(x, input);
                self.put(out, output);
            }
            Op::MatMul { weight, x, out } => self.matmul(plan, weight, x, out)?,
            Op::QkvMatVec { layer } => {
                for (weight, out) in [
                    (Matrix::Q(layer), Buf::Q),
                    (Matrix::K(layer), Buf::K),
                    (Matrix::V(layer), Buf::V),
                ] {
                    self.matmul(plan, weight, Buf::H, out)?;
                }
            }
            Op::SwiGluMatVec { layer, x, gate, up } => {
                self.matmul(plan, Matrix::Gate(layer), x, gate)?;
                self.matmul(plan, Matrix::Up(layer), x, up)?;
                self.silu_mul(gate, up)?;
            }
            Op::RopeKvWrite { layer, rope } => {
                let (mut q, mut k, v) =
                    (self.take(Buf::Q)?, self.take(Buf::K)?, self.take(Buf::V)?);
                if rope {
                    let shape = rope_shape(&c);
                    rope::rotate(&mut q, c.n_heads, shape, &self.cos, &self.sin);
                    rope::rotate(&mut k, c.n_kv_heads, shape, &self.cos, &self.sin);
                }
                rope::write_kv(&mut self.arena, self.layout, layer, &k, &v, &tables.slots);
                self.put(Buf::Q, q);
                self.put(Buf::K, k);
                self.put(Buf::V, v);
            }
            Op::Attention { layer } => {
                let q = self.take(Buf::Q)?;
                let mut out = self.buffer(plan, Buf::Attn)?;
                let shape = attention::AttnShape {
                    heads: c.n_heads,
                    kv_heads: c.n_kv_heads,
                    head_dim: c.head_dim,
                };
                // As the CUDA runner launches them: the flash kernel takes the multi-row
                // sequences, the split kernel the rest.
                let flash_rows = if launch::uses_flash(c.head_dim) {
                    let tiles = flash::tiles(tables, c.n_heads / c.n_kv_heads);
                    flash::flash_prefill(
                        &self.arena,
                        self.layout,
                        layer,
                        shape,
                        tables,
                        &tiles,
                        &q,
                        &mut out,
                    );
                    flash::MIN_ROWS
                } else {
                    usize::MAX
                };
                attention::attention(
                    &self.arena,
                    self.layout,
                    layer,
                    shape,
                    tables,
                    &q,
                    &mut out,
                    flash_rows,
                );
                self.put(Buf::Q, q);
                self.put(Buf::Attn, out);
            }
            Op::Add { x, y } => self.add(x, y)?,
            Op::SiluMul { gate, up } => self.silu_mul(gate, up)?,
            Op::GatherLogitRows => {
                let x = self.take(Buf::X)?;
                let mut sel = self.buffer(plan, Buf::Sel)?;
                for (i, &r) in tables.logit_rows.iter().enumerate() {
                    let r = r as usize;
                    sel[i * c.hidden..(i + 1) * c.hidden]
                        .copy_from_slice(&x[r * c.hidden..(r + 1) * c.hidden]);
                }
                self.put(Buf::X, x);
                self.put(Buf::Sel, sel);
            }
            Op::Penalties => {
                let mut logits = self.take(Buf::Logits)?;
                for (r, row) in logits.chunks_mut(c.vocab_size).enumerate() {
                    let entries = penalty_entries(tables, r);
                    sample::apply_penalties(row, &entries, &tables.sampling[r]);
                }
                self.put(Buf::Logits, logits);
            }
            Op::Sample => {
                let logits = self.take(Buf::Logits)?;
                for (r, row) in logits.chunks(c.vocab_size).enumerate() {
                    self.tokens[r] = sample::sample_row(row, &tables.sampling[r]);
                }
                self.put(Buf::Logits, logits);
            }
        }
        Ok(())
    }
}

/// The model's RoPE shape, as the twins of `rope_kv_write` take it.
fn rope_shape(c: &crate::config::ModelConfig) -> rope::RopeShape {
    rope::RopeShape {
        heads: c.n_heads,
        kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        rope_dim: c.rope_dim,
    }
}

/// Logit row `r`'s penalty entries.
fn penalty_entries(tables: &StepTables, r: usize) -> Vec<(u32, u32)> {
    let (start, end) = (
        tables.penalty_spans[2 * r] as usize,
        tables.penalty_spans[2 * r + 1] as usize,
    );
    tables.penalties[2 * start..2 * end]
        .chunks(2)
        .map(|p| (p[0], p[1]))
        .collect()
}

/// Row `row` of `m`, dequantized as ggml does (candle's block types, exact).
fn dequantize_row(m: &RawMatrix, row: usize, out: &mut [f32]) -> Result<()> {
    let row_bytes = mmvq::row_bytes(m.dtype, m.cols);
    let bytes = m
        .bytes
        .as_slice()
        .get(row * row_bytes..(row + 1) * row_bytes)
        .ok_or_else(|| EngineError::InvalidStep(format!("embedding row {row} is out of range")))?;
    let q = qtensor_from_ggml(m.dtype, bytes, vec![1, m.cols], &CandleDevice::Cpu)?;
    let values = q
        .dequantize(&CandleDevice::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    out.copy_from_slice(&values);
    Ok(())
}

impl Runner for CpuRunner {
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// As the CUDA runner's: the twins run the GPU's matmul classes (our matvec up to 8 rows,
    /// MMQ's stand-in or the f16 GEMM above), so a step may grow only within its class.
    fn rows_computed_alike(&self, rows: usize) -> usize {
        launch::rows_computed_alike(rows)
    }

    fn config(&self) -> &crate::config::ModelConfig {
        &self.weights.config
    }

    fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }

    fn arena(&self) -> KvArena {
        self.layout
    }

    fn reserve_blocks(&mut self, blocks: usize) -> Result<()> {
        if blocks > self.blocks {
            self.guard.forbid("growing the KV arena")?;
            self.generation += 1;
            self.arena
                .resize(blocks * self.layout.block_values(), f16::ZERO);
            self.blocks = blocks;
        }
        Ok(())
    }

    fn resident_blocks(&self) -> usize {
        self.blocks
    }

    fn read_blocks(&mut self, blocks: &[u32], out: &mut Vec<u8>) -> Result<()> {
        let n = self.layout.block_values();
        for &b in blocks {
            let at = b as usize * n;
            let values = self.arena.get(at..at + n).ok_or_else(|| {
                EngineError::InvalidStep(format!("KV block {b} is outside the arena"))
            })?;
            out.extend(values.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        }
        Ok(())
    }

    fn write_blocks(&mut self, blocks: &[u32], bytes: &[u8]) -> Result<()> {
        let n = self.layout.block_values();
        for (&b, chunk) in blocks.iter().zip(bytes.chunks_exact(2 * n)) {
            let at = b as usize * n;
            let values = self.arena.get_mut(at..at + n).ok_or_else(|| {
                EngineError::InvalidStep(format!("KV block {b} is outside the arena"))
            })?;
            for (v, x) in values.iter_mut().zip(chunk.chunks_exact(2)) {
                *v = f16::from_bits(u16::from_le_bytes([x[0], x[1]]));
            }
        }
        Ok(())
    }

    fn suggested(&self) -> Suggested {
        Suggested::CPU
    }

    fn reserve_steps(&mut self, plan: &Plan, _sequences: usize) -> Result<()> {
        self.guard.forbid("reserving the step buffers")?;
        // As `begin` sizes them (growth bumps the generation), but for the widest step; the
        // tables are the step's own copy here, so only the buffers and the drawn tokens count.
        for buf in BUFFERS {
            let b = self.buffer(plan, buf)?;
            self.put(buf, b);
        }
        if self.tokens.capacity() < plan.logit_rows {
            self.generation += 1;
            self.tokens.reserve(plan.logit_rows - self.tokens.len());
        }
        Ok(())
    }

    fn begin(&mut self, plan: &Plan, tables: &StepTables, rope: &RopeTable) -> Result<()> {
        self.guard.forbid("uploading the step's tables")?;
        for buf in BUFFERS {
            let b = self.buffer(plan, buf)?;
            self.put(buf, b);
        }
        self.cos = rope.cos().to_vec();
        self.sin = rope.sin().to_vec();
        self.tables = tables.clone();
        if self.tokens.capacity() < plan.logit_rows {
            self.generation += 1;
        }
        self.tokens.resize(plan.logit_rows, 0);
        Ok(())
    }

    fn read_tokens(&mut self, plan: &Plan) -> Result<Vec<u32>> {
        self.guard.forbid("copying the drawn tokens to the host")?;
        Ok(self.tokens[..plan.logit_rows].to_vec())
    }

    fn run_op(&mut self, plan: &Plan, op: Op) -> Result<()> {
        self.op(plan, op)
    }

    fn graphs(&self) -> bool {
        self.emulate_graphs
    }

    fn launch_graph(
        &mut self,
        key: GraphKey,
        plan: &Plan,
        tables: &StepTables,
        rope: &RopeTable,
    ) -> Result<()> {
        if !self.emulate_graphs {
            return self.launch(plan, tables, rope);
        }
        self.begin(plan, tables, rope)?;
        let ops = match self.graphs.action(key, self.generation) {
            GraphAction::WarmUp => {
                for &op in &plan.ops {
                    self.run_op(plan, op)?;
                }
                None
            }
            GraphAction::Capture => Some(plan.ops.clone()),
            GraphAction::Replay => self.graphs.get(key).cloned(),
        };
        if let Some(ops) = ops {
            self.guard.begin(key)?;
            let ran = ops.iter().try_for_each(|&op| self.run_op(plan, op));
            self.guard.end();
            ran?;
            if self.graphs.get(key).is_none() {
                self.graphs.insert(key, ops, self.generation);
            }
        }
        Ok(())
    }

    fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    fn read(&mut self, plan: &Plan, buf: Buf) -> Result<Vec<f32>> {
        self.guard.forbid(&format!("copying {buf:?} to the host"))?;
        let values = self.take(buf)?;
        let out = values[..plan.len_of(&self.weights.config, buf)].to_vec();
        self.put(buf, values);
        Ok(out)
    }

    fn write(&mut self, plan: &Plan, buf: Buf, values: &[f32]) -> Result<()> {
        let mut b = self.buffer(plan, buf)?;
        b.copy_from_slice(values);
        self.put(buf, b);
        Ok(())
    }
}

#[cfg(test)]
pub mod fault {
    //! Kernels broken on purpose, each the way a real kernel bug would break it (an index off by
    //! one, a scale read wrong, a table missed), for the tests that show the start-up self-check
    //! ([`crate::selfcheck`]) catches them. Test-only: no build of the server can run them.

    use super::super::plan::{Matrix, Norm};
    use super::*;
    use crate::fast::layout::{padded_columns, QK8_1};
    use crate::fast::twin::q8_1::quantize_rows_q8_1;

    /// One broken kernel twin.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub enum Fault {
        /// Decode rows' attention misses the newest key (its own): the visible count off by one
        /// in the decode kernel. Prefill rows stay right.
        AttentionDropsNewestKey,
        /// Keys rotated at position + 1, queries right: every relative distance off by one.
        RopeKeysOneAhead,
        /// The first Q8_1 block of every activation row fed to this matrix with its scale `d`
        /// doubled (the block sum `s` left as it was).
        Q8_1ScaleDoubled(Matrix),
        /// Every row's K/V written one slot late within its block (wrapping to the block's
        /// first slot), so attention reads each position's neighbour.
        KvSlotOffByOne,
        /// This norm applied without its weight (as if the weight were all ones).
        NormWithoutWeight(Norm),
    }

    impl CpuRunner {
        /// The matmul of `weight` with the first Q8_1 block of every activation row's scale
        /// doubled ([`Fault::Q8_1ScaleDoubled`]).
        pub(super) fn broken_matmul(
            &mut self,
            plan: &Plan,
            weight: Matrix,
            x: Buf,
            out: Buf,
        ) -> Result<()> {
            let input = self.take(x)?;
            let mut output = self.buffer(plan, out)?;
            let m = self.weights.matrix(weight)?;
            let (rows, k) = (plan.rows_of(x), m.cols);
            let kp = padded_columns(k);
            let mut q = quantize_rows_q8_1(&input, rows, k, kp);
            let row_bytes = mmvq::row_bytes(m.dtype, k);
            for (r, y) in q.chunks_mut(kp / QK8_1).enumerate() {
                y[0].d = f16::from_f32(2.0 * y[0].d.to_f32());
                for j in 0..m.rows {
                    let w = &m.bytes.as_slice()[j * row_bytes..(j + 1) * row_bytes];
                    output[r * m.rows + j] = mmvq::dot_q8_1(m.dtype, w, y, k)?;
                }
            }
            self.put(x, input);
            self.put(out, output);
            Ok(())
        }

        /// Runs `op` the broken way when `fault` breaks it; `false` when `op` is not affected
        /// (the caller then runs it right).
        pub(super) fn broken_op(
            &mut self,
            plan: &Plan,
            op: Op,
            tables: &StepTables,
            fault: Fault,
        ) -> Result<bool> {
            let c = self.weights.config.clone();
            match (fault, op) {
                (Fault::AttentionDropsNewestKey, Op::Attention { .. }) => {
                    let mut short = tables.clone();
                    for seq in &mut short.seqs {
                        if seq.rows == 1 && seq.past > 0 {
                            seq.past -= 1;
                        }
                    }
                    self.op_correct(plan, op, &short)?;
                }
                (Fault::RopeKeysOneAhead, Op::RopeKvWrite { layer, rope: true }) => {
                    let (mut q, mut k, v) =
                        (self.take(Buf::Q)?, self.take(Buf::K)?, self.take(Buf::V)?);
                    let shape = rope_shape(&c);
                    rope::rotate(&mut q, c.n_heads, shape, &self.cos, &self.sin);
                    let ahead: Vec<usize> =
                        tables.positions.iter().map(|&p| p as usize + 1).collect();
                    let table = RopeTable::new(&c, &ahead);
                    rope::rotate(&mut k, c.n_kv_heads, shape, table.cos(), table.sin());
                    rope::write_kv(&mut self.arena, self.layout, layer, &k, &v, &tables.slots);
                    self.put(Buf::Q, q);
                    self.put(Buf::K, k);
                    self.put(Buf::V, v);
                }
                (Fault::KvSlotOffByOne, Op::RopeKvWrite { .. }) => {
                    let mut late = tables.clone();
                    for slot in &mut late.slots {
                        if *slot != crate::fast::graph::SKIP_SLOT {
                            *slot = *slot / 16 * 16 + (*slot % 16 + 1) % 16;
                        }
                    }
                    self.op_correct(plan, op, &late)?;
                }
                (
                    Fault::NormWithoutWeight(broken),
                    Op::RmsNorm {
                        x,
                        add,
                        weight,
                        out,
                    },
                ) if weight == broken => {
                    if let Some(y) = add {
                        self.add(x, y)?;
                    }
                    let input = self.take(x)?;
                    let mut output = self.buffer(plan, out)?;
                    norm::rms_norm(&input, &vec![1.0; c.hidden], c.rms_eps, &mut output);
                    self.put(x, input);
                    self.put(out, output);
                }
                _ => return Ok(false),
            }
            Ok(true)
        }

        /// `op` run right over `tables` (a broken variant's altered copy).
        fn op_correct(&mut self, plan: &Plan, op: Op, tables: &StepTables) -> Result<()> {
            let fault = self.fault.take();
            let done = self.op_over(plan, op, tables);
            self.fault = fault;
            done
        }
    }
}
