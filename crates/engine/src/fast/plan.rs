//! A step of the fast tier as a list of operations over named buffers. The same list runs on
//! the GPU (each operation a kernel launch, the list captured as a CUDA graph for decode) and on
//! the CPU runner (each operation its Rust twin), which is how CI tests the fast tier without a
//! GPU: the list, the buffers and the kernels' contracts are shared, only the executor differs.

use crate::config::ModelConfig;
use crate::fast::layout::StepTables;
use crate::kv::BLOCK_POSITIONS;
pub use crate::weights::{matrix_shape, Matrix, Norm};

/// The working buffers of a step (f32 unless said otherwise), sized by [`Plan::rows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The residual stream, `[rows][hidden]`.
    X,
    /// A normed copy of the residual stream, `[rows][hidden]`.
    H,
    /// Queries, `[rows][heads × head dim]`.
    Q,
    /// Keys and values of the step's rows, `[rows][KV heads × head dim]`.
    K,
    V,
    /// Attention output, `[rows][heads × head dim]`.
    Attn,
    /// A projection back to `[rows][hidden]`.
    Proj,
    /// FFN gate and up, `[rows][ffn]`.
    Gate,
    Up,
    /// The rows whose logits are wanted, `[logit rows][hidden]`.
    Sel,
    /// Their normed copy.
    SelNorm,
    /// Logits, `[logit rows][vocab]`.
    Logits,
}

/// Every working buffer.
pub const BUFFERS: [Buf; 12] = [
    Buf::X,
    Buf::H,
    Buf::Q,
    Buf::K,
    Buf::V,
    Buf::Attn,
    Buf::Proj,
    Buf::Gate,
    Buf::Up,
    Buf::Sel,
    Buf::SelNorm,
    Buf::Logits,
];

/// One operation. Shapes come from the model config and the step's tables.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    /// `X[r] = embedding row of tokens[r]`.
    Embed,
    /// `x += add` when `add` is set (the residual add, fused into the norm: one launch on a
    /// GPU), then `out[r] = x[r] / rms(x[r]) × weight`, over `rows` rows of `hidden`.
    RmsNorm {
        x: Buf,
        add: Option<Buf>,
        weight: Norm,
        out: Buf,
    },
    /// `out = x · Wᵀ` (activations quantized to Q8_1, then the quantized dot products).
    MatMul { weight: Matrix, x: Buf, out: Buf },
    /// RoPE on `Q` and `K` (layers that use it), then `K`, `V` written into the arena at the rows'
    /// slots for `layer`.
    RopeKvWrite { layer: usize, rope: bool },
    /// Causal attention of `Q` over each sequence's cached positions in `layer` into `Attn`.
    Attention { layer: usize },
    /// `x += y`.
    Add { x: Buf, y: Buf },
    /// `gate = silu(gate) × up`.
    SiluMul,
    /// `Sel[i] = X[logit_rows[i]]`.
    GatherLogitRows,
    /// The penalties of each logit row, in place on `Logits`.
    Penalties,
    /// One token per logit row drawn from `Logits` ([`crate::fast::twin::sample`]).
    Sample,
}

/// The operations of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub ops: Vec<Op>,
    /// Rows of the step (tokens of every sequence).
    pub rows: usize,
    /// Rows whose logits are computed.
    pub logit_rows: usize,
    /// Block ids per sequence in the step's block tables (their stride).
    pub max_blocks: usize,
    /// Context splits the attention partials have room for (the grid's third dimension): as
    /// many as a decode row seeing `max_blocks` full blocks can use, so a plan's launches depend
    /// on its shape only, never on the lengths of its sequences (what a CUDA graph needs).
    pub splits: usize,
    /// Whether the plan ends with [`Op::Penalties`] and [`Op::Sample`].
    pub sample: bool,
    /// Whether the plan stops at the output norm (`SelNorm` holds the rows' final hidden
    /// states, for embeddings) instead of computing logits.
    pub hidden: bool,
}

impl Plan {
    /// The forward pass of `config` over the step of `tables`.
    pub fn for_step(config: &ModelConfig, tables: &StepTables) -> Self {
        let mut plan = Self::forward(
            config,
            tables.rows(),
            tables.logit_rows.len(),
            tables.max_blocks,
        );
        if tables.hidden && plan.logit_rows > 0 {
            // Embeddings: the normed rows are the answer; the LM head would be wasted work.
            let head = plan.ops.pop();
            debug_assert!(matches!(
                head,
                Some(Op::MatMul {
                    weight: Matrix::Head,
                    ..
                })
            ));
            plan.hidden = true;
        } else if tables.sample && plan.logit_rows > 0 {
            plan.ops.extend([Op::Penalties, Op::Sample]);
            plan.sample = true;
        }
        plan
    }

    /// The forward pass of `config` over a step of `rows` rows, `logit_rows` of which want
    /// logits, whose block tables hold `max_blocks` ids per sequence.
    pub fn forward(
        config: &ModelConfig,
        rows: usize,
        logit_rows: usize,
        max_blocks: usize,
    ) -> Self {
        let mut ops = vec![Op::Embed];
        for layer in 0..config.n_layers {
            // The residual adds ride on the norms that follow them (the previous layer's FFN
            // output on this layer's attention norm, the attention output on the FFN norm);
            // only the last layer's FFN output is added alone, before the logit rows.
            let residual = (layer > 0).then_some(Buf::Proj);
            ops.extend([
                Op::RmsNorm {
                    x: Buf::X,
                    add: residual,
                    weight: Norm::Attn(layer),
                    out: Buf::H,
                },
                Op::MatMul {
                    weight: Matrix::Q(layer),
                    x: Buf::H,
                    out: Buf::Q,
                },
                Op::MatMul {
                    weight: Matrix::K(layer),
                    x: Buf::H,
                    out: Buf::K,
                },
                Op::MatMul {
                    weight: Matrix::V(layer),
                    x: Buf::H,
                    out: Buf::V,
                },
                Op::RopeKvWrite {
                    layer,
                    rope: config.uses_rope[layer],
                },
                Op::Attention { layer },
                Op::MatMul {
                    weight: Matrix::O(layer),
                    x: Buf::Attn,
                    out: Buf::Proj,
                },
                Op::RmsNorm {
                    x: Buf::X,
                    add: Some(Buf::Proj),
                    weight: Norm::Ffn(layer),
                    out: Buf::H,
                },
                Op::MatMul {
                    weight: Matrix::Gate(layer),
                    x: Buf::H,
                    out: Buf::Gate,
                },
                Op::MatMul {
                    weight: Matrix::Up(layer),
                    x: Buf::H,
                    out: Buf::Up,
                },
                Op::SiluMul,
                Op::MatMul {
                    weight: Matrix::Down(layer),
                    x: Buf::Gate,
                    out: Buf::Proj,
                },
            ]);
        }
        if config.n_layers > 0 {
            ops.push(Op::Add {
                x: Buf::X,
                y: Buf::Proj,
            });
        }
        if logit_rows > 0 {
            ops.extend([
                Op::GatherLogitRows,
                Op::RmsNorm {
                    x: Buf::Sel,
                    add: None,
                    weight: Norm::Output,
                    out: Buf::SelNorm,
                },
                Op::MatMul {
                    weight: Matrix::Head,
                    x: Buf::SelNorm,
                    out: Buf::Logits,
                },
            ]);
        }
        Self {
            ops,
            rows,
            logit_rows,
            max_blocks,
            splits: crate::fast::twin::attention::max_splits(max_blocks * BLOCK_POSITIONS),
            sample: false,
            hidden: false,
        }
    }

    /// Values (f32) of `buf` for this step.
    pub fn len_of(&self, config: &ModelConfig, buf: Buf) -> usize {
        let c = config;
        let q_dim = c.n_heads * c.head_dim;
        let kv_dim = c.n_kv_heads * c.head_dim;
        match buf {
            Buf::X | Buf::H | Buf::Proj => self.rows * c.hidden,
            Buf::Q | Buf::Attn => self.rows * q_dim,
            Buf::K | Buf::V => self.rows * kv_dim,
            Buf::Gate | Buf::Up => self.rows * c.ffn,
            Buf::Sel | Buf::SelNorm => self.logit_rows * c.hidden,
            Buf::Logits => self.logit_rows * c.vocab_size,
        }
    }

    /// Rows of `buf` (the first dimension).
    pub fn rows_of(&self, buf: Buf) -> usize {
        match buf {
            Buf::Sel | Buf::SelNorm | Buf::Logits => self.logit_rows,
            _ => self.rows,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BatchItem;
    use crate::fast::step_tables;
    use crate::synthetic::SyntheticSpec;
    use crate::LogitsMode;

    /// A step of hidden-state rows (embeddings) ends at the output norm: no LM head, no draw.
    #[test]
    fn a_hidden_state_step_stops_at_the_output_norm() {
        let spec = SyntheticSpec::tiny("llama");
        let src = crate::synthetic::build(&spec).unwrap_or_else(|e| panic!("{e}"));
        let config = ModelConfig::from_gguf(&src).unwrap_or_else(|e| panic!("{e}"));
        let tokens = [1u32, 2, 3];
        let item = |logits| BatchItem {
            blocks: &[0],
            past: 0,
            tokens: &tokens,
            logits,
            sample: &[],
        };
        let hidden = Plan::for_step(&config, &step_tables(&[item(LogitsMode::Hidden)]));
        assert!(hidden.hidden && !hidden.sample);
        assert_eq!(hidden.logit_rows, 3, "every row is normed");
        assert_eq!(
            hidden.ops.last(),
            Some(&Op::RmsNorm {
                x: Buf::Sel,
                add: None,
                weight: Norm::Output,
                out: Buf::SelNorm,
            })
        );
        let logits = Plan::for_step(&config, &step_tables(&[item(LogitsMode::All)]));
        assert!(!logits.hidden);
        assert!(matches!(
            logits.ops.last(),
            Some(Op::MatMul {
                weight: Matrix::Head,
                ..
            })
        ));
        assert_eq!(logits.ops.len(), hidden.ops.len() + 1);
    }

    /// The residual adds ride on the norms after them: every norm but the first layer's
    /// attention norm (after the embedding) and the output norm adds `Proj` into `X` first, and
    /// one lone add is left, the last layer's, before the logit rows are gathered.
    #[test]
    fn residual_adds_ride_on_the_norms_after_them() {
        let spec = SyntheticSpec::tiny("smollm3");
        let src = crate::synthetic::build(&spec).unwrap_or_else(|e| panic!("{e}"));
        let config = ModelConfig::from_gguf(&src).unwrap_or_else(|e| panic!("{e}"));
        let plan = Plan::forward(&config, 3, 3, 1);
        let norms: Vec<(Option<Buf>, Norm)> = plan
            .ops
            .iter()
            .filter_map(|op| match *op {
                Op::RmsNorm { add, weight, .. } => Some((add, weight)),
                _ => None,
            })
            .collect();
        assert_eq!(norms.len(), 2 * config.n_layers + 1);
        for (add, weight) in norms {
            let expected = match weight {
                Norm::Attn(0) | Norm::Output => None,
                _ => Some(Buf::Proj),
            };
            assert_eq!(add, expected, "{weight:?}");
        }
        let adds: Vec<usize> = (0..plan.ops.len())
            .filter(|&i| matches!(plan.ops[i], Op::Add { .. }))
            .collect();
        assert_eq!(adds.len(), 1);
        assert!(matches!(
            plan.ops[adds[0] - 1],
            Op::MatMul {
                weight: Matrix::Down(l),
                ..
            } if l == config.n_layers - 1
        ));
        assert_eq!(plan.ops[adds[0] + 1], Op::GatherLogitRows);
    }
}
