//! The Llama-family transformer that serves both SmolLM2 (`llama`) and SmolLM3 (`smollm3`, which is
//! Llama with RoPE left out of every fourth layer).
//!
//! One forward pass serves many sequences: the new tokens of every sequence (a prefill chunk or a
//! single decode token) are concatenated, each linear layer runs once over all of them, and
//! attention runs per sequence and head against that sequence's own KV cache at its own positions.
//! Logits are computed only for the rows that are asked for.

use rayon::prelude::*;
use tracing::trace_span;

use super::attention::{attention, AttnShape, SeqAttn};
use super::kv::CpuKvStorage;
use super::math::exp;
use super::quant::QMatrix;
use crate::backend::{check_request, BatchItem};
use crate::config::{Architecture, ModelConfig};
use crate::error::{EngineError, Result};
use crate::kv::{KvKind, BLOCK_POSITIONS};
use crate::logits::{Logits, LogitsMode};
use crate::rope::RopeTable;
use smolchat_gguf::{GgufSource, RawTensor};
use std::collections::HashMap;

use crate::weights::{self, Matrix, Norm, WeightSink};

type Layer = weights::LayerWeights<QMatrix, Vec<f32>>;

pub struct Model {
    pub config: ModelConfig,
    token_embd: QMatrix,
    /// `None` when the embeddings are tied (the LM head is `token_embd`).
    output: Option<QMatrix>,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
}

/// The weights as [`weights::read`] hands them over, each matrix repacked at once.
#[derive(Default)]
struct RepackedWeights {
    embedding: Option<QMatrix>,
    matrices: HashMap<Matrix, QMatrix>,
    norms: HashMap<Norm, Vec<f32>>,
}

impl WeightSink for RepackedWeights {
    fn embedding(&mut self, raw: RawTensor) -> Result<()> {
        self.embedding = Some(QMatrix::from_raw(raw)?);
        Ok(())
    }

    fn matrix(&mut self, which: Matrix, raw: RawTensor) -> Result<()> {
        self.matrices.insert(which, QMatrix::from_raw(raw)?);
        Ok(())
    }

    fn norm(&mut self, which: Norm, weight: Vec<f32>) -> Result<()> {
        self.norms.insert(which, weight);
        Ok(())
    }
}

/// Progress of a load, in bytes of tensor data.
pub type LoadProgress<'a> = &'a mut dyn FnMut(u64, u64);

impl Model {
    /// Builds the model from a GGUF source, reading one tensor at a time (weights stay quantized,
    /// repacked for the CPU's kernels as they are read: [`weights::read`]).
    pub fn load(src: &mut GgufSource, progress: LoadProgress<'_>) -> Result<Self> {
        let config = ModelConfig::from_gguf(src)?;
        let mut held = RepackedWeights::default();
        weights::read(src, &config, &mut held, progress)?;
        let RepackedWeights {
            embedding,
            mut matrices,
            mut norms,
        } = held;
        let output = matrices.remove(&Matrix::Head);
        let layers = weights::take_layers(config.n_layers, &mut matrices, &mut norms)?;
        let output_norm = norms
            .remove(&Norm::Output)
            .ok_or_else(|| weights::missing(Norm::Output))?;
        Ok(Self {
            config,
            token_embd: embedding.ok_or_else(|| weights::missing(weights::EMBEDDING))?,
            output,
            output_norm,
            layers,
        })
    }

    /// Bytes of weights held.
    pub fn weight_bytes(&self) -> usize {
        let mut n = self.token_embd.size_in_bytes()
            + self.output.as_ref().map_or(0, |o| o.size_in_bytes())
            + self.output_norm.len() * 4;
        for l in &self.layers {
            n += [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                .iter()
                .map(|m| m.size_in_bytes())
                .sum::<usize>()
                + (l.attn_norm.len() + l.ffn_norm.len()) * 4;
        }
        n
    }

    /// Checks a batch before anything is computed, so a bad request never leaves caches
    /// half-updated: everything [`Self::validate_request`] checks, and that every item has blocks
    /// for its new positions.
    pub fn validate(&self, items: &[BatchItem<'_>]) -> Result<()> {
        self.validate_request(items)?;
        for (i, item) in items.iter().enumerate() {
            let needed = item.past + item.tokens.len();
            if item.blocks.len() * BLOCK_POSITIONS < needed {
                return Err(EngineError::InvalidStep(format!(
                    "sequence #{i} of the step has KV blocks for {} positions but needs {needed}",
                    item.blocks.len() * BLOCK_POSITIONS
                )));
            }
        }
        Ok(())
    }

    /// The checks that do not depend on KV blocks ([`check_request`]).
    pub fn validate_request(&self, items: &[BatchItem<'_>]) -> Result<()> {
        check_request(&self.config, items)
    }

    /// Runs one step, storing the new positions' K/V in `kv` (the items' blocks must have pages
    /// there). Returns, per item, `None`, the last row of logits (`vocab` floats) or every row
    /// (`tokens.len() * vocab` floats), as each item asked.
    pub fn forward(
        &self,
        kv: &mut CpuKvStorage,
        items: &[BatchItem<'_>],
        out: &mut Logits,
    ) -> Result<()> {
        self.validate(items)?;
        if let Some(b) = items
            .iter()
            .flat_map(|i| i.blocks.iter())
            .find(|&&b| b as usize >= kv.blocks())
        {
            return Err(EngineError::InvalidStep(format!(
                "KV block {b} has no pages in the storage"
            )));
        }
        let _span = trace_span!("forward", seqs = items.len()).entered();
        let c = &self.config;
        let hidden = c.hidden;
        let hd = c.head_dim;
        let q_dim = c.n_heads * hd;
        let kv_dim = c.n_kv_heads * hd;

        // Row layout of the concatenated batch.
        let mut offsets = Vec::with_capacity(items.len() + 1);
        let mut positions = Vec::new();
        offsets.push(0usize);
        for item in items.iter() {
            let start = item.past;
            positions.extend(start..start + item.tokens.len());
            offsets.push(offsets[offsets.len() - 1] + item.tokens.len());
        }
        let n = positions.len();
        let seqs: Vec<SeqAttn<'_>> = items
            .iter()
            .zip(&offsets)
            .map(|(item, &row0)| SeqAttn {
                blocks: item.blocks,
                past: item.past,
                row0,
                rows: item.tokens.len(),
            })
            .collect();
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
        };

        let mut x = vec![0f32; n * hidden];
        for (row, &tok) in items.iter().flat_map(|i| i.tokens.iter()).enumerate() {
            self.token_embd
                .dequantize_row(tok as usize, &mut x[row * hidden..(row + 1) * hidden])?;
        }
        let rope = RopeTable::new(c, &positions);

        let mut h = vec![0f32; n * hidden];
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * q_dim];
        let mut proj = vec![0f32; n * hidden];
        let mut gate = vec![0f32; n * c.ffn];
        let mut up = vec![0f32; n * c.ffn];

        for (li, layer) in self.layers.iter().enumerate() {
            let _span = trace_span!("layer", li).entered();
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            QMatrix::matmul_many(
                &[&layer.wq, &layer.wk, &layer.wv],
                &h,
                n,
                &mut [&mut q[..], &mut k[..], &mut v[..]],
            );
            if c.uses_rope[li] {
                rope.apply(&mut q, c.n_heads, hd);
                rope.apply(&mut k, c.n_kv_heads, hd);
            }
            for s in &seqs {
                for r in 0..s.rows {
                    let pos = s.past + r;
                    let block = s.blocks[pos / BLOCK_POSITIONS];
                    let slot = pos % BLOCK_POSITIONS;
                    let row = s.row0 + r;
                    for kh in 0..c.n_kv_heads {
                        let src = row * kv_dim + kh * hd;
                        kv.write(block, slot, li, kh, KvKind::K, &k[src..src + hd]);
                        kv.write(block, slot, li, kh, KvKind::V, &v[src..src + hd]);
                    }
                }
            }
            attention(shape, kv, li, &seqs, &q, &mut attn);
            layer.wo.matmul(&attn, n, &mut proj);
            add_in_place(&mut x, &proj);

            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            QMatrix::matmul_many(
                &[&layer.w_gate, &layer.w_up],
                &h,
                n,
                &mut [&mut gate[..], &mut up[..]],
            );
            swiglu_in_place(&mut gate, &up);
            layer.w_down.matmul(&gate, n, &mut proj);
            add_in_place(&mut x, &proj);
        }

        // Only the rows somebody asked for go through the final norm and the LM head.
        let mut rows = Vec::new();
        let mut hidden_rows = Vec::new();
        for (si, item) in items.iter().enumerate() {
            match item.logits {
                LogitsMode::None | LogitsMode::Sample | LogitsMode::SampleAll => {}
                LogitsMode::Last => rows.push(offsets[si + 1] - 1),
                LogitsMode::All => rows.extend(offsets[si]..offsets[si + 1]),
                LogitsMode::Hidden => hidden_rows.extend(offsets[si]..offsets[si + 1]),
            }
        }
        out.set_hidden_width(hidden);
        let logits = out.prepare(
            c.vocab_size,
            items.iter().map(|item| (item.tokens.len(), item.logits)),
        );
        if !rows.is_empty() {
            let _span = trace_span!("lm_head", rows = rows.len()).entered();
            let mut sel = vec![0f32; rows.len() * hidden];
            for (i, &r) in rows.iter().enumerate() {
                sel[i * hidden..(i + 1) * hidden].copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            let mut normed = vec![0f32; sel.len()];
            rms_norm(&sel, &self.output_norm, c.rms_eps, &mut normed);
            let head = self.output.as_ref().unwrap_or(&self.token_embd);
            head.matmul(&normed, rows.len(), logits);
        }
        if !hidden_rows.is_empty() {
            // Embeddings: the final norm of every row asked for, in item order, no LM head.
            let mut sel = vec![0f32; hidden_rows.len() * hidden];
            for (i, &r) in hidden_rows.iter().enumerate() {
                sel[i * hidden..(i + 1) * hidden].copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            rms_norm(&sel, &self.output_norm, c.rms_eps, out.hidden_mut());
        }
        Ok(())
    }

    pub fn architecture(&self) -> Architecture {
        self.config.arch
    }
}

/// Element-wise work between the matmuls (norms, residual adds, SwiGLU) of at least this many
/// values is split across the pool. Why: in prefill it is about 6% of single-thread time (3B
/// shape, 1024 tokens: `Model::forward` 3.1% and SwiGLU's `expf` 2.5% in `perf`); left on one
/// thread it caps 16 threads at ~9× one. Below it (decode) a parallel region, about a
/// microsecond inside the pool, would cost more than the work. Every value is computed the same
/// way either way, so results do not depend on the thread count.
const PAR_VALUES: usize = 1 << 14;

/// Values per task of the element-wise splits.
const PAR_CHUNK: usize = 1 << 12;

/// `out[r] = x[r] / rms(x[r]) * weight` for every row (sum in f64, as ggml does).
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let row = |(xr, or): (&[f32], &mut [f32])| {
        let ss = sum_of_squares(xr);
        let scale = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    };
    if x.len() >= PAR_VALUES {
        x.par_chunks(d).zip(out.par_chunks_mut(d)).for_each(row);
    } else {
        x.chunks(d).zip(out.chunks_mut(d)).for_each(row);
    }
}

/// `Σ x²` in f64 over eight interleaved partial sums, so the loop vectorises: one running sum
/// is a chain of dependent f64 additions, about 2 ns a value (0.5% of the 3B shape's decode).
/// Each square of an f32 is exact in f64, so the order changes only the f64 sum's last bits,
/// far below the f32 the norm's scale is rounded to.
fn sum_of_squares(x: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum();
    for c in chunks {
        for (s, &v) in lanes.iter_mut().zip(c) {
            *s += (v as f64) * (v as f64);
        }
    }
    let [a, b, c, d, e, f, g, h] = lanes;
    (((a + e) + (b + f)) + ((c + g) + (d + h))) + tail
}

/// Applies `f(a, b)` to every pair `(x[i], y[i])`, split across the pool when large.
fn zip_in_place(x: &mut [f32], y: &[f32], f: impl Fn(&mut f32, f32) + Sync) {
    let chunk = |(xs, ys): (&mut [f32], &[f32])| {
        for (a, &b) in xs.iter_mut().zip(ys) {
            f(a, b);
        }
    };
    if x.len() >= PAR_VALUES {
        x.par_chunks_mut(PAR_CHUNK)
            .zip(y.par_chunks(PAR_CHUNK))
            .for_each(chunk);
    } else {
        chunk((x, y));
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    zip_in_place(x, y, |a, b| *a += b);
}

/// `gate = silu(gate) * up`, with [`exp`] so the loop vectorises: libm's `expf` per value took
/// 2.3% of the 3B shape's decode (34 µs a layer on one thread, now 9). llama.cpp's CPU SiLU
/// also uses a vector exponential of its own.
fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    zip_in_place(gate, up, |g, u| *g = *g / (1.0 + exp(-*g)) * u);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eight-lane sum of squares is the plain running sum up to f64 rounding, at every length
    /// (the tail included) and at the models' widths.
    #[test]
    fn sum_of_squares_equals_the_running_sum() {
        for len in (0..40).chain([576, 2048, 2049]) {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 7919) % 2003) as f32 / 37.0 - 27.0)
                .collect();
            let plain: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
            let got = sum_of_squares(&x);
            assert!(
                (got - plain).abs() <= plain * 1e-14,
                "len {len}: {got} vs {plain}"
            );
        }
    }

    /// The element-wise steps split across a pool give exactly the values of a plain loop, above
    /// and below the split threshold (so logits cannot depend on the thread count through them).
    #[test]
    fn elementwise_steps_split_across_threads_equal_plain_loops() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let d = 576;
        for rows in [1, 3 * PAR_VALUES / d + 5] {
            let n = rows * d;
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0)
                .collect();
            let y: Vec<f32> = (0..n)
                .map(|i| ((i * 104729) % 997) as f32 / 498.0 - 1.0)
                .collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();

            let mut norm = vec![0f32; n];
            let (mut sum, mut glu) = (x.clone(), x.clone());
            pool.install(|| {
                rms_norm(&x, &w, 1e-5, &mut norm);
                add_in_place(&mut sum, &y);
                swiglu_in_place(&mut glu, &y);
            });
            for r in 0..rows {
                let xr = &x[r * d..(r + 1) * d];
                let ss = sum_of_squares(xr);
                let scale = 1.0 / ((ss / d as f64) as f32 + 1e-5).sqrt();
                for (c, &wc) in w.iter().enumerate() {
                    let i = r * d + c;
                    assert_eq!(norm[i].to_bits(), (x[i] * scale * wc).to_bits(), "norm {i}");
                }
            }
            for i in 0..n {
                assert_eq!(sum[i].to_bits(), (x[i] + y[i]).to_bits(), "add {i}");
                let g = x[i] / (1.0 + exp(-x[i])) * y[i];
                assert_eq!(glu[i].to_bits(), g.to_bits(), "swiglu {i}");
            }
        }
    }
}
