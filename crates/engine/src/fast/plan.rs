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
    /// The last layer's FFN over the logit rows alone (when fewer rows want logits than the
    /// step has): gate and up `[logit rows][ffn]`, the down projection `[logit rows][hidden]`.
    SelGate,
    SelUp,
    SelProj,
}

/// Every working buffer.
pub const BUFFERS: [Buf; 15] = [
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
    Buf::SelGate,
    Buf::SelUp,
    Buf::SelProj,
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
    /// `Q`, `K`, `V` = `H · W_Q,K,Vᵀ` of `layer`, as three [`Op::MatMul`]s compute them. Steps of
    /// up to 8 rows ([`matvec_rows`]) only: one `matvec` launch where the three matrices share
    /// a type.
    QkvMatVec { layer: usize },
    /// `gate = silu(x · W_gateᵀ) × (x · W_upᵀ)` of `layer` (`up` is scratch), as two
    /// [`Op::MatMul`]s and an [`Op::SiluMul`] compute it. Steps of up to 8 rows only: one
    /// `matvec_swiglu` launch, which also writes the down projection's Q8_1 rows, where gate and
    /// up share a type.
    SwiGluMatVec {
        layer: usize,
        x: Buf,
        gate: Buf,
        up: Buf,
    },
    /// RoPE on `Q` and `K` (layers that use it), then `K`, `V` written into the arena at the rows'
    /// slots for `layer`.
    RopeKvWrite { layer: usize, rope: bool },
    /// Causal attention of `Q` over each sequence's cached positions in `layer` into `Attn`.
    Attention { layer: usize },
    /// `x += y`.
    Add { x: Buf, y: Buf },
    /// `gate = silu(gate) × up` (`Gate` and `Up`, or the logit rows' `SelGate` and `SelUp`).
    SiluMul { gate: Buf, up: Buf },
    /// `Sel[i] = X[logit_rows[i]]`.
    GatherLogitRows,
    /// The penalties of each logit row, in place on `Logits`.
    Penalties,
    /// One token per logit row drawn from `Logits` ([`crate::fast::twin::sample`]).
    Sample,
}

/// Whether matmuls over `rows` activation rows run on our matvec kernels (`fast::twin::matvec`),
/// and so are fused ([`Op::QkvMatVec`], [`Op::SwiGluMatVec`]): steps of up to 8 rows, decode and
/// drafts' verification (wider steps take MMQ or the f16 GEMM).
pub fn matvec_rows(rows: usize) -> bool {
    rows <= crate::fast::twin::matvec::MAX_ROWS
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
        // When fewer rows want logits than the step has (a prompt wanting its last row's), the
        // last layer's FFN, which feeds only the logits, runs on the logit rows alone.
        let prune_last_ffn = logit_rows > 0 && logit_rows < rows;
        for layer in 0..config.n_layers {
            // The residual adds ride on the norms that follow them (the previous layer's FFN
            // output on this layer's attention norm, the attention output on the FFN norm);
            // only the last layer's FFN output is added alone, before the logit rows.
            let residual = (layer > 0).then_some(Buf::Proj);
            ops.push(Op::RmsNorm {
                x: Buf::X,
                add: residual,
                weight: Norm::Attn(layer),
                out: Buf::H,
            });
            if matvec_rows(rows) {
                ops.push(Op::QkvMatVec { layer });
            } else {
                ops.extend([
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
                ]);
            }
            ops.extend([
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
            ]);
            let (x, add, normed, gate, up, proj) = if prune_last_ffn && layer + 1 == config.n_layers
            {
                // The attention output added to every row, then the logit rows gathered: the
                // FFN below sees only them.
                ops.extend([
                    Op::Add {
                        x: Buf::X,
                        y: Buf::Proj,
                    },
                    Op::GatherLogitRows,
                ]);
                (
                    Buf::Sel,
                    None,
                    Buf::SelNorm,
                    Buf::SelGate,
                    Buf::SelUp,
                    Buf::SelProj,
                )
            } else {
                (
                    Buf::X,
                    Some(Buf::Proj),
                    Buf::H,
                    Buf::Gate,
                    Buf::Up,
                    Buf::Proj,
                )
            };
            ops.push(Op::RmsNorm {
                x,
                add,
                weight: Norm::Ffn(layer),
                out: normed,
            });
            let ffn_rows = if normed == Buf::SelNorm {
                logit_rows
            } else {
                rows
            };
            if matvec_rows(ffn_rows) {
                ops.push(Op::SwiGluMatVec {
                    layer,
                    x: normed,
                    gate,
                    up,
                });
            } else {
                ops.extend([
                    Op::MatMul {
                        weight: Matrix::Gate(layer),
                        x: normed,
                        out: gate,
                    },
                    Op::MatMul {
                        weight: Matrix::Up(layer),
                        x: normed,
                        out: up,
                    },
                    Op::SiluMul { gate, up },
                ]);
            }
            ops.push(Op::MatMul {
                weight: Matrix::Down(layer),
                x: gate,
                out: proj,
            });
        }
        if config.n_layers > 0 {
            // The last FFN's output, on every row or on the logit rows alone.
            ops.push(if prune_last_ffn {
                Op::Add {
                    x: Buf::Sel,
                    y: Buf::SelProj,
                }
            } else {
                Op::Add {
                    x: Buf::X,
                    y: Buf::Proj,
                }
            });
        }
        if logit_rows > 0 {
            if !prune_last_ffn || config.n_layers == 0 {
                ops.push(Op::GatherLogitRows);
            }
            ops.extend([
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
            Buf::Sel | Buf::SelNorm | Buf::SelProj => self.logit_rows * c.hidden,
            Buf::SelGate | Buf::SelUp => self.logit_rows * c.ffn,
            Buf::Logits => self.logit_rows * c.vocab_size,
        }
    }

    /// Rows of `buf` (the first dimension).
    pub fn rows_of(&self, buf: Buf) -> usize {
        match buf {
            Buf::Sel | Buf::SelNorm | Buf::Logits | Buf::SelGate | Buf::SelUp | Buf::SelProj => {
                self.logit_rows
            }
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

    /// A prompt wanting fewer logit rows than it has runs its last FFN on those rows alone:
    /// every matmul of the last layer's FFN reads a logit-row buffer, and nothing after the
    /// last attention reads the whole step's FFN buffers; a step whose every row wants logits
    /// (decode, `LogitsMode::All`) keeps the whole-step FFN.
    #[test]
    fn the_last_ffn_runs_on_the_logit_rows_alone() {
        let spec = SyntheticSpec::tiny("llama");
        let src = crate::synthetic::build(&spec).unwrap_or_else(|e| panic!("{e}"));
        let config = ModelConfig::from_gguf(&src).unwrap_or_else(|e| panic!("{e}"));
        let last = config.n_layers - 1;
        let pruned = Plan::forward(&config, 40, 1, 3);
        let ffn_inputs: Vec<Buf> = pruned
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::MatMul {
                    weight: Matrix::Gate(l) | Matrix::Up(l) | Matrix::Down(l),
                    x,
                    ..
                }
                | Op::SwiGluMatVec { layer: l, x, .. }
                    if *l == last =>
                {
                    Some(*x)
                }
                _ => None,
            })
            .collect();
        // One logit row: gate, up and SwiGLU in one matvec op, then the down projection.
        assert_eq!(ffn_inputs, [Buf::SelNorm, Buf::SelGate]);
        assert_eq!(pruned.rows_of(Buf::SelGate), 1);
        assert_eq!(pruned.len_of(&config, Buf::SelUp), config.ffn);
        let gathered = pruned
            .ops
            .iter()
            .position(|op| *op == Op::GatherLogitRows)
            .unwrap_or_else(|| panic!("no gather"));
        let last_attention = pruned
            .ops
            .iter()
            .position(|op| *op == Op::Attention { layer: last })
            .unwrap_or_else(|| panic!("no attention"));
        assert!(gathered > last_attention);
        assert!(pruned.ops[gathered..].iter().all(|op| !matches!(
            op,
            Op::MatMul {
                x: Buf::H | Buf::Gate,
                ..
            } | Op::SiluMul {
                gate: Buf::Gate,
                ..
            } | Op::SwiGluMatVec {
                gate: Buf::Gate,
                ..
            }
        )));
        for whole in [
            Plan::forward(&config, 40, 40, 3),
            Plan::forward(&config, 1, 1, 3),
        ] {
            assert!(!whole.ops.iter().any(|op| matches!(
                op,
                Op::SiluMul {
                    gate: Buf::SelGate,
                    ..
                } | Op::SwiGluMatVec {
                    gate: Buf::SelGate,
                    ..
                }
            )));
            assert_eq!(
                whole
                    .ops
                    .iter()
                    .filter(|op| **op == Op::GatherLogitRows)
                    .count(),
                1
            );
        }
    }

    /// Steps of up to 8 rows (decode, drafts' verification) run Q/K/V and gate/up/SwiGLU as one
    /// matvec op each; a step of 9 rows keeps the separate matmuls, which MMQ or the f16 GEMM
    /// run. The down and output projections and the LM head stay matmuls either way.
    #[test]
    fn steps_of_up_to_eight_rows_fuse_their_projections() {
        let spec = SyntheticSpec::tiny("smollm3");
        let src = crate::synthetic::build(&spec).unwrap_or_else(|e| panic!("{e}"));
        let config = ModelConfig::from_gguf(&src).unwrap_or_else(|e| panic!("{e}"));
        let count =
            |plan: &Plan, f: &dyn Fn(&Op) -> bool| plan.ops.iter().filter(|op| f(op)).count();
        let layers = config.n_layers;
        for rows in [1, 8] {
            let plan = Plan::forward(&config, rows, rows, 1);
            assert_eq!(
                count(&plan, &|op| matches!(op, Op::QkvMatVec { .. })),
                layers
            );
            assert_eq!(
                count(&plan, &|op| matches!(op, Op::SwiGluMatVec { .. })),
                layers
            );
            assert_eq!(count(&plan, &|op| matches!(op, Op::SiluMul { .. })), 0);
            // Per layer O and down, then the LM head.
            assert_eq!(
                count(&plan, &|op| matches!(op, Op::MatMul { .. })),
                2 * layers + 1
            );
        }
        let wide = Plan::forward(&config, 9, 9, 1);
        assert_eq!(
            count(&wide, &|op| matches!(
                op,
                Op::QkvMatVec { .. } | Op::SwiGluMatVec { .. }
            )),
            0
        );
        assert_eq!(
            count(&wide, &|op| matches!(op, Op::MatMul { .. })),
            7 * layers + 1
        );
    }

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
