//! The reference tier: the model's forward pass written over candle tensors on a candle
//! [`CandleDevice`], the same code on the CPU and on a GPU. It is the CUDA backend's correct
//! path: CI runs it on the CPU device against the CPU engine, so on a GPU it is right wherever
//! candle's own kernels are; the fast tier is checked against it.
//!
//! - Weights stay quantized: every matrix is a candle `QTensor` on the device, multiplied with
//!   `QMatMul`; the token embedding is also kept on the host (as the CPU engine keeps it) for row
//!   lookups, so the embedding rows are exactly the CPU engine's.
//! - The KV cache is one paged arena per layer, `[blocks × 16 positions, KV heads, head dim]` in
//!   f16 (or f32) on the device, indexed by the engine's block ids (the shared allocator's, same
//!   block size): a new row goes to `block × 16 + position % 16`, and attention gathers a
//!   sequence's rows with its block table.
//!
//! It is correct, not bit-stable: candle's f32 matmul may round differently for different matrix
//! sizes, and activation quantization can turn such a last-bit change into a visible one, so a
//! sequence's logits alone and in a batch, or computed at once and in chunks, agree to the
//! tolerances of the tests (`tests/reference_tier.rs`), not bit for bit as the CPU engine's do.
//! On the CPU, candle 0.11 also picks its quantized kernels by the host (a Q8K-activation repack
//! on AVX512-VNNI, AMX tiles where advertised) unless [`PIN_CANDLE_CPU_KERNELS`] is set, so the
//! tier loads on the CPU only with it set (`.cargo/config.toml` sets it for every process cargo
//! starts): the reference is then the same on every host.
//! - Everything else is candle's operations, candle-nn's fused ones where it has them (one
//!   kernel each on a GPU): `rms_norm`, RoPE by `rotary_emb::rope_i` (adjacent pairs) from the
//!   shared table (`rope.rs`), GQA attention with a causal mask and `softmax_last_dim` in f32,
//!   SiLU.

use candle_core::quantized::{ggml_file::qtensor_from_ggml, QMatMul};
use candle_core::{DType, Device as CandleDevice, Module, Tensor};
use std::collections::HashMap;

use smolchat_gguf::{GgufSource, RawTensor};
use tracing::trace_span;

use crate::backend::{check_request, Backend, BatchItem, Suggested};
use crate::config::ModelConfig;
use crate::cpu::quant::QMatrix;
use crate::device::{Device, Tier};
use crate::error::{EngineError, Result};
use crate::kv::{KvType, BLOCK_POSITIONS};
use crate::logits::{Logits, LogitsMode};
use crate::rope::RopeTable;
use crate::weights::{self, Matrix, Norm, WeightSink};

/// candle's switch that keeps its AVX2 quantized CPU kernels on every x86 host (the name is
/// mistral.rs's).
pub const PIN_CANDLE_CPU_KERNELS: &str = "MISTRALRS_FORCE_AVX2";

type Layer = weights::LayerWeights<QMatMul, Tensor>;

/// The reference tier as an engine backend (see the module docs).
pub struct ReferenceBackend {
    device: Device,
    dev: CandleDevice,
    config: ModelConfig,
    /// The token embedding on the host, for row lookups.
    embedding: QMatrix,
    /// The LM head (`output.weight`, or the token embedding when they are tied) on the device.
    head: QMatMul,
    output_norm: Tensor,
    layers: Vec<Layer>,
    /// Per layer, the K and V arenas: `[blocks × 16, KV heads, head dim]`, in `kv_dtype`.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    /// Blocks the arenas hold.
    blocks: usize,
    kv_type: KvType,
    weight_bytes: usize,
}

/// Arenas grow by at least this many blocks at a time.
const GROW_BLOCKS: usize = 16;

/// The weights as [`weights::read`] hands them over: matrices uploaded to `dev` at once, the
/// embedding kept on the host for row lookups (and uploaded as the LM head when it is `tied`).
struct UploadedWeights<'a> {
    dev: &'a CandleDevice,
    tied: bool,
    embedding: Option<QMatrix>,
    head: Option<QMatMul>,
    matrices: HashMap<Matrix, QMatMul>,
    norms: HashMap<Norm, Tensor>,
    weight_bytes: usize,
}

impl WeightSink for UploadedWeights<'_> {
    fn embedding(&mut self, raw: RawTensor) -> Result<()> {
        self.weight_bytes += raw.data.len();
        if self.tied {
            self.head = Some(matmul(&raw, self.dev)?);
        }
        self.embedding = Some(QMatrix::from_raw(raw)?);
        Ok(())
    }

    fn matrix(&mut self, which: Matrix, raw: RawTensor) -> Result<()> {
        self.weight_bytes += raw.data.len();
        let uploaded = matmul(&raw, self.dev)?;
        if which == Matrix::Head {
            self.head = Some(uploaded);
        } else {
            self.matrices.insert(which, uploaded);
        }
        Ok(())
    }

    fn norm(&mut self, which: Norm, weight: Vec<f32>) -> Result<()> {
        let len = weight.len();
        self.norms
            .insert(which, Tensor::from_vec(weight, len, self.dev)?);
        Ok(())
    }
}

impl ReferenceBackend {
    /// Loads `src` (whose config, YaRN applied, is `config`) onto `dev`, which is `device`, with
    /// its KV cache stored as `kv_type` (f16 or f32).
    pub fn load(
        src: &mut GgufSource,
        config: ModelConfig,
        device: Device,
        dev: CandleDevice,
        kv_type: KvType,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        if kv_type == KvType::Q8_0 {
            return Err(EngineError::KvConfig(format!(
                "the reference tier stores the KV cache as f16 or f32, not {kv_type}; set model.kv_type = \"f16\""
            )));
        }
        if dev.is_cpu() && std::env::var(PIN_CANDLE_CPU_KERNELS).as_deref() != Ok("1") {
            return Err(EngineError::BadDevice {
                value: device.to_string(),
                reason: format!(
                    "the reference tier on the CPU needs {PIN_CANDLE_CPU_KERNELS}=1 (cargo sets it \
                     from .cargo/config.toml): without it candle's quantized kernels, and so the \
                     reference logits, depend on the host"
                ),
            });
        }
        let mut held = UploadedWeights {
            dev: &dev,
            tied: !src.tensors.contains_key(&Matrix::Head.gguf_name()),
            embedding: None,
            head: None,
            matrices: HashMap::new(),
            norms: HashMap::new(),
            weight_bytes: 0,
        };
        weights::read(src, &config, &mut held, progress)?;
        let UploadedWeights {
            embedding,
            head,
            mut matrices,
            mut norms,
            weight_bytes,
            ..
        } = held;
        let layers = weights::take_layers(config.n_layers, &mut matrices, &mut norms)?;
        let output_norm = norms
            .remove(&Norm::Output)
            .ok_or_else(|| weights::missing(Norm::Output))?;
        let head = head.ok_or_else(|| weights::missing(Matrix::Head))?;
        let embedding = embedding.ok_or_else(|| weights::missing(weights::EMBEDDING))?;
        Ok(Self {
            device,
            dev,
            embedding,
            head,
            output_norm,
            layers,
            keys: Vec::new(),
            values: Vec::new(),
            blocks: 0,
            kv_type,
            weight_bytes,
            config,
        })
    }

    /// The reference tier over weights already read for the fast tier (the start-up self-check
    /// runs both on the same bytes).
    pub fn from_weights(
        weights: &crate::fast::weights::FastWeights,
        device: Device,
        dev: CandleDevice,
    ) -> Result<Self> {
        let c = weights.config.clone();
        let upload = |m: &crate::fast::weights::RawMatrix| -> Result<QMatMul> {
            let q = qtensor_from_ggml(m.dtype, m.bytes.as_slice(), vec![m.rows, m.cols], &dev)?;
            Ok(QMatMul::from_qtensor(q)?)
        };
        let vector = |n: Norm| -> Result<Tensor> {
            Ok(Tensor::from_slice(weights.norm(n)?, c.hidden, &dev)?)
        };
        let e = &weights.embedding;
        let embedding = QMatrix::from_raw(RawTensor {
            name: "token_embd.weight".into(),
            dtype: e.dtype,
            dims: vec![e.rows, e.cols],
            data: smolchat_gguf::AlignedBytes::from_slice(e.bytes.as_slice()),
        })?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            layers.push(Layer {
                attn_norm: vector(Norm::Attn(i))?,
                wq: upload(weights.matrix(Matrix::Q(i))?)?,
                wk: upload(weights.matrix(Matrix::K(i))?)?,
                wv: upload(weights.matrix(Matrix::V(i))?)?,
                wo: upload(weights.matrix(Matrix::O(i))?)?,
                ffn_norm: vector(Norm::Ffn(i))?,
                w_gate: upload(weights.matrix(Matrix::Gate(i))?)?,
                w_up: upload(weights.matrix(Matrix::Up(i))?)?,
                w_down: upload(weights.matrix(Matrix::Down(i))?)?,
            });
        }
        Ok(Self {
            device,
            head: upload(weights.matrix(Matrix::Head)?)?,
            output_norm: vector(Norm::Output)?,
            dev,
            embedding,
            layers,
            keys: Vec::new(),
            values: Vec::new(),
            blocks: 0,
            kv_type: KvType::F16,
            weight_bytes: weights.bytes(),
            config: c,
        })
    }

    fn kv_dtype(&self) -> DType {
        match self.kv_type {
            KvType::F32 => DType::F32,
            _ => DType::F16,
        }
    }

    fn kv_row_shape(&self) -> (usize, usize) {
        (self.config.n_kv_heads, self.config.head_dim)
    }

    /// The arena slot of `position` in a sequence whose blocks are `blocks`.
    fn slot(blocks: &[u32], position: usize) -> usize {
        blocks[position / BLOCK_POSITIONS] as usize * BLOCK_POSITIONS + position % BLOCK_POSITIONS
    }

    /// Writes `rows` (`[n, KV heads, head dim]`, f16) of one sequence at `past..` into `arena`.
    fn write_rows(arena: &Tensor, rows: &Tensor, blocks: &[u32], past: usize) -> Result<()> {
        let n = rows.dim(0)?;
        let mut r = 0;
        // Consecutive positions inside one block are consecutive slots: one copy per block.
        while r < n {
            let position = past + r;
            let run = (BLOCK_POSITIONS - position % BLOCK_POSITIONS).min(n - r);
            let src = rows.narrow(0, r, run)?.contiguous()?;
            arena.slice_set(&src, 0, Self::slot(blocks, position))?;
            r += run;
        }
        Ok(())
    }

    /// Causal GQA attention of one sequence's `q` rows (`[n, heads × head dim]`) over its first
    /// `past + n` cached positions in layer `li`.
    fn attend(&self, li: usize, q: &Tensor, blocks: &[u32], past: usize) -> Result<Tensor> {
        let c = &self.config;
        let (n_kv, hd) = self.kv_row_shape();
        let n = q.dim(0)?;
        let group = c.n_heads / n_kv;
        let total = past + n;
        let slots: Vec<u32> = (0..total).map(|p| Self::slot(blocks, p) as u32).collect();
        let slots = Tensor::from_vec(slots, total, &self.dev)?;
        // [KV heads, total, head dim]
        let gather = |arena: &Tensor| -> candle_core::Result<Tensor> {
            arena
                .index_select(&slots, 0)?
                .to_dtype(DType::F32)?
                .transpose(0, 1)?
                .contiguous()
        };
        let (k, v) = (gather(&self.keys[li])?, gather(&self.values[li])?);
        // Query head h reads KV head h / group: [KV heads, group × n, head dim].
        let q = q
            .reshape((n, n_kv, group, hd))?
            .permute((1, 2, 0, 3))?
            .contiguous()?
            .reshape((n_kv, group * n, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
        // Row r (position past + r) sees keys 0..=past + r.
        let mask: Vec<f32> = (0..n)
            .flat_map(|r| {
                (0..total).map(move |key| {
                    if key <= past + r {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, n, total), &self.dev)?;
        let scores = scores
            .reshape((n_kv, group, n, total))?
            .broadcast_add(&mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?;
        let out = probs.reshape((n_kv, group * n, total))?.matmul(&v)?;
        Ok(out
            .reshape((n_kv, group, n, hd))?
            .permute((2, 0, 1, 3))?
            .contiguous()?
            .reshape((n, c.n_heads * hd))?)
    }

    /// Rotates the first `rope_dim` dimensions of every head of `x` (`[n, heads × head dim]`) by
    /// `cos`/`sin` (`[n, rope_dim / 2]`), adjacent pairs as the CPU engine does: candle-nn's
    /// interleaved rotary embedding (`rope_i`), over the rows as one sequence of `n` positions
    /// (each row's own angles are its row of `cos`/`sin`, so the rows may be of any sequences).
    fn rope(&self, x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let hd = self.config.head_dim;
        let rope_dim = self.config.rope_dim;
        let n = x.dim(0)?;
        let x = x.reshape((n, heads, hd))?;
        // [1, heads, n, rope_dim], contiguous, as rope_i takes it.
        let part = x
            .narrow(2, 0, rope_dim)?
            .transpose(0, 1)?
            .unsqueeze(0)?
            .contiguous()?;
        let rotated = candle_nn::rotary_emb::rope_i(&part, cos, sin)?
            .squeeze(0)?
            .transpose(0, 1)?;
        let whole = if rope_dim < hd {
            Tensor::cat(&[rotated, x.narrow(2, rope_dim, hd - rope_dim)?], 2)?
        } else {
            rotated.contiguous()?
        };
        Ok(whole.reshape((n, heads * hd))?)
    }

    /// candle-nn's fused RMS norm (one kernel on the GPU) over the rows of `x`.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            weight,
            self.config.rms_eps,
        )?)
    }

    fn pass(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        let c = self.config.clone();
        let (n_kv, hd) = self.kv_row_shape();
        let mut positions = Vec::new();
        let mut row0 = Vec::with_capacity(items.len());
        for item in items {
            row0.push(positions.len());
            positions.extend(item.past..item.past + item.tokens.len());
        }
        let n = positions.len();
        let mut embedded = vec![0f32; n * c.hidden];
        for (row, &token) in items.iter().flat_map(|i| i.tokens.iter()).enumerate() {
            self.embedding.dequantize_row(
                token as usize,
                &mut embedded[row * c.hidden..(row + 1) * c.hidden],
            )?;
        }
        let mut x = Tensor::from_vec(embedded, (n, c.hidden), &self.dev)?;
        let rope = RopeTable::new(&c, &positions);
        let half = rope.rope_dim() / 2;
        let cos = Tensor::from_slice(rope.cos(), (n, half), &self.dev)?;
        let sin = Tensor::from_slice(rope.sin(), (n, half), &self.dev)?;
        for li in 0..self.layers.len() {
            let _span = trace_span!("layer", li).entered();
            let layer = &self.layers[li];
            let h = self.rms_norm(&x, &layer.attn_norm)?;
            let mut q = layer.wq.forward(&h)?;
            let mut k = layer.wk.forward(&h)?;
            let v = layer.wv.forward(&h)?;
            if c.uses_rope[li] {
                q = self.rope(&q, c.n_heads, &cos, &sin)?;
                k = self.rope(&k, n_kv, &cos, &sin)?;
            }
            let dtype = self.kv_dtype();
            let k = k.to_dtype(dtype)?.reshape((n, n_kv, hd))?;
            let v = v.to_dtype(dtype)?.reshape((n, n_kv, hd))?;
            for (item, &r0) in items.iter().zip(&row0) {
                let len = item.tokens.len();
                Self::write_rows(
                    &self.keys[li],
                    &k.narrow(0, r0, len)?,
                    item.blocks,
                    item.past,
                )?;
                Self::write_rows(
                    &self.values[li],
                    &v.narrow(0, r0, len)?,
                    item.blocks,
                    item.past,
                )?;
            }
            let mut attended = Vec::with_capacity(items.len());
            for (item, &r0) in items.iter().zip(&row0) {
                let q = q.narrow(0, r0, item.tokens.len())?;
                attended.push(self.attend(li, &q, item.blocks, item.past)?);
            }
            let attn = Tensor::cat(&attended, 0)?;
            let layer = &self.layers[li];
            x = (x + layer.wo.forward(&attn)?)?;
            let h = self.rms_norm(&x, &layer.ffn_norm)?;
            let gate = layer.w_gate.forward(&h)?.silu()?;
            let up = layer.w_up.forward(&h)?;
            x = (&x + layer.w_down.forward(&(gate * up)?)?)?;
        }
        // Only the rows somebody asked for go through the final norm and the LM head.
        let mut rows = Vec::new();
        let mut hidden_rows = Vec::new();
        for (item, &r0) in items.iter().zip(&row0) {
            let len = item.tokens.len();
            match item.logits {
                LogitsMode::None | LogitsMode::Sample | LogitsMode::SampleAll => {}
                LogitsMode::Last => rows.push((r0 + len - 1) as u32),
                LogitsMode::All => rows.extend((r0..r0 + len).map(|r| r as u32)),
                LogitsMode::Hidden => hidden_rows.extend((r0..r0 + len).map(|r| r as u32)),
            }
        }
        out.set_hidden_width(c.hidden);
        let logits = out.prepare(
            c.vocab_size,
            items.iter().map(|item| (item.tokens.len(), item.logits)),
        );
        if !rows.is_empty() {
            let _span = trace_span!("lm_head", rows = rows.len()).entered();
            let picked = Tensor::from_vec(rows.clone(), rows.len(), &self.dev)?;
            let selected = x.index_select(&picked, 0)?;
            let normed = self.rms_norm(&selected, &self.output_norm)?;
            let values = self
                .head
                .forward(&normed)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            logits.copy_from_slice(&values);
        }
        if !hidden_rows.is_empty() {
            let picked = Tensor::from_vec(hidden_rows.clone(), hidden_rows.len(), &self.dev)?;
            let selected = x.index_select(&picked, 0)?;
            let values = self
                .rms_norm(&selected, &self.output_norm)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            out.hidden_mut().copy_from_slice(&values);
        }
        Ok(())
    }
}

/// A weight matrix as a quantized candle tensor on `dev`.
fn matmul(raw: &RawTensor, dev: &CandleDevice) -> Result<QMatMul> {
    let q = qtensor_from_ggml(raw.dtype, raw.data.as_slice(), raw.dims.clone(), dev)?;
    Ok(QMatMul::from_qtensor(q)?)
}

impl Backend for ReferenceBackend {
    fn device(&self) -> Device {
        self.device
    }

    fn tier(&self) -> Tier {
        Tier::Reference
    }

    fn suggested(&self) -> Suggested {
        crate::device::suggested_for(self.device)
    }

    fn rows_computed_alike(&self, rows: usize) -> usize {
        match self.device {
            Device::Cpu => usize::MAX,
            // candle's CUDA quantized matmul picks its kernels by the row count.
            _ => rows,
        }
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn kv_type(&self) -> KvType {
        self.kv_type
    }

    fn kv_bytes_per_position(&self) -> usize {
        let (n_kv, hd) = self.kv_row_shape();
        2 * self.config.n_layers * n_kv * hd * self.kv_dtype().size_in_bytes()
    }

    fn kv_block_bytes(&self) -> usize {
        BLOCK_POSITIONS * self.kv_bytes_per_position()
    }

    fn reserve_blocks(&mut self, blocks: usize, capacity: usize) -> Result<()> {
        if blocks <= self.blocks {
            return Ok(());
        }
        let grown = crate::backend::grown_blocks(self.blocks, blocks, capacity, GROW_BLOCKS);
        let (n_kv, hd) = self.kv_row_shape();
        let shape = (grown * BLOCK_POSITIONS, n_kv, hd);
        let mut keys = Vec::with_capacity(self.config.n_layers);
        let mut values = Vec::with_capacity(self.config.n_layers);
        for li in 0..self.config.n_layers {
            let k = Tensor::zeros(shape, self.kv_dtype(), &self.dev)?;
            let v = Tensor::zeros(shape, self.kv_dtype(), &self.dev)?;
            if self.blocks > 0 {
                k.slice_set(&self.keys[li], 0, 0)?;
                v.slice_set(&self.values[li], 0, 0)?;
            }
            keys.push(k);
            values.push(v);
        }
        self.keys = keys;
        self.values = values;
        self.blocks = grown;
        Ok(())
    }

    fn kv_resident_bytes(&self) -> usize {
        self.blocks * self.kv_block_bytes()
    }

    fn validate(&self, items: &[BatchItem<'_>]) -> Result<()> {
        check_request(&self.config, items)
    }

    fn forward(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        check_request(&self.config, items)?;
        for (i, item) in items.iter().enumerate() {
            let needed = item.past + item.tokens.len();
            if item.blocks.len() * BLOCK_POSITIONS < needed {
                return Err(EngineError::InvalidStep(format!(
                    "sequence #{i} of the step has KV blocks for {} positions but needs {needed}",
                    item.blocks.len() * BLOCK_POSITIONS
                )));
            }
            if let Some(&b) = item.blocks.iter().find(|&&b| b as usize >= self.blocks) {
                return Err(EngineError::InvalidStep(format!(
                    "KV block {b} has no pages in the arena"
                )));
            }
        }
        let _span = trace_span!("forward", seqs = items.len(), device = %self.device).entered();
        self.pass(items, out)
    }
}
