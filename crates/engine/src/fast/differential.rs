//! Differential checks of two runners over one step, operation by operation: after each
//! operation the buffers it wrote are compared, then the second runner is given the first one's
//! values, so each operation starts from identical inputs and every difference found belongs to
//! that operation's kernel alone. `make gpu-check` runs the CUDA runner against the CPU runner
//! (the twins) this way over steps of many shapes; CI runs the comparison machinery itself.

use super::layout::StepTables;
use super::plan::{Buf, Op, Plan};
use super::Runner;
use crate::error::Result;
use crate::rope::RopeTable;

/// What one operation wrote, compared.
#[derive(Debug, Clone, PartialEq)]
pub struct OpDiff {
    /// Its index in the plan.
    pub index: usize,
    pub op: Op,
    pub buf: Buf,
    /// The largest |difference| of any value; for [`Op::Sample`] (whose `buf` is the logits it
    /// drew from) the number of rows whose drawn tokens differ, which must be 0.
    pub max_diff: f32,
    /// The largest |value| the reference wrote (to judge the difference against).
    pub scale: f32,
}

impl OpDiff {
    /// Whether the difference is within `relative` of the scale (and a small floor).
    pub fn within(&self, relative: f32) -> bool {
        self.max_diff <= relative * self.scale.max(1.0)
    }
}

/// The buffers `op` writes (the KV arena, which `RopeKvWrite` also writes, is judged through the
/// attention that reads it).
pub fn written(op: Op) -> Vec<Buf> {
    match op {
        Op::Embed => vec![Buf::X],
        Op::RmsNorm {
            x,
            add: Some(_),
            out,
            ..
        } => vec![x, out],
        Op::RmsNorm { out, .. } | Op::MatMul { out, .. } => vec![out],
        Op::QkvMatVec { .. } => vec![Buf::Q, Buf::K, Buf::V],
        Op::SwiGluMatVec { gate, .. } => vec![gate],
        Op::RopeKvWrite { .. } => vec![Buf::Q, Buf::K],
        Op::Attention { .. } => vec![Buf::Attn],
        Op::Add { x, .. } => vec![x],
        Op::SiluMul { gate, .. } => vec![gate],
        Op::GatherLogitRows => vec![Buf::Sel],
        Op::Penalties => vec![Buf::Logits],
        // Tokens, not a float buffer: `compare` counts the draws that differ.
        Op::Sample => vec![],
    }
}

/// Runs `plan` on `reference` and on `tested` side by side, comparing every operation's output
/// and then aligning `tested` with `reference`.
pub fn compare(
    reference: &mut dyn Runner,
    tested: &mut dyn Runner,
    plan: &Plan,
    tables: &StepTables,
    rope: &RopeTable,
) -> Result<Vec<OpDiff>> {
    reference.begin(plan, tables, rope)?;
    tested.begin(plan, tables, rope)?;
    let mut diffs = Vec::new();
    for (index, &op) in plan.ops.iter().enumerate() {
        reference.run_op(plan, op)?;
        tested.run_op(plan, op)?;
        for buf in written(op) {
            let want = reference.read(plan, buf)?;
            let got = tested.read(plan, buf)?;
            let max_diff = want
                .iter()
                .zip(&got)
                .map(|(a, b)| {
                    let d = (a - b).abs();
                    if d.is_nan() {
                        f32::INFINITY
                    } else {
                        d
                    }
                })
                .fold(0f32, f32::max);
            let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
            diffs.push(OpDiff {
                index,
                op,
                buf,
                max_diff,
                scale,
            });
            tested.write(plan, buf, &want)?;
        }
        if op == Op::Sample {
            let (want, got) = (reference.read_tokens(plan)?, tested.read_tokens(plan)?);
            let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count()
                + want.len().abs_diff(got.len());
            diffs.push(OpDiff {
                index,
                op,
                buf: Buf::Logits,
                max_diff: differ as f32,
                scale: 0.0,
            });
        }
    }
    Ok(diffs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BatchItem;
    use crate::config::ModelConfig;
    use crate::fast::cpu::CpuRunner;
    use crate::fast::step_tables;
    use crate::fast::weights::FastWeights;
    use crate::kv::BLOCK_POSITIONS;
    use crate::logits::LogitsMode;
    use crate::synthetic::{self, SyntheticSpec, TypeMix};
    use smolchat_gguf::GgmlDType;

    fn runner() -> CpuRunner {
        let spec = SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Uniform(GgmlDType::Q4K));
        let mut src = synthetic::build(&spec).expect("build");
        let config = ModelConfig::from_gguf(&src).expect("config");
        CpuRunner::new(FastWeights::load(&mut src, config, &mut |_, _| {}).expect("weights"))
    }

    /// A runner whose SiLU-mul is wrong (alone, or in the fused matvec of the last layer's FFN,
    /// which runs on the one logit row): the check names that operation and no other.
    struct Miscomputes(CpuRunner);

    impl Runner for Miscomputes {
        fn device(&self) -> crate::device::Device {
            self.0.device()
        }
        fn config(&self) -> &ModelConfig {
            self.0.config()
        }
        fn weight_bytes(&self) -> usize {
            self.0.weight_bytes()
        }
        fn rows_computed_alike(&self, rows: usize) -> usize {
            self.0.rows_computed_alike(rows)
        }
        fn arena(&self) -> crate::fast::layout::KvArena {
            self.0.arena()
        }
        fn reserve_blocks(&mut self, blocks: usize) -> Result<()> {
            self.0.reserve_blocks(blocks)
        }
        fn resident_blocks(&self) -> usize {
            self.0.resident_blocks()
        }
        fn read_blocks(&mut self, blocks: &[u32], out: &mut Vec<u8>) -> Result<()> {
            self.0.read_blocks(blocks, out)
        }
        fn write_blocks(&mut self, blocks: &[u32], bytes: &[u8]) -> Result<()> {
            self.0.write_blocks(blocks, bytes)
        }
        fn suggested(&self) -> crate::backend::Suggested {
            self.0.suggested()
        }
        fn begin(&mut self, plan: &Plan, tables: &StepTables, rope: &RopeTable) -> Result<()> {
            self.0.begin(plan, tables, rope)
        }
        fn run_op(&mut self, plan: &Plan, op: Op) -> Result<()> {
            self.0.run_op(plan, op)?;
            if let Op::SiluMul { gate, .. } | Op::SwiGluMatVec { gate, .. } = op {
                let mut g = self.0.read(plan, gate)?;
                g[3] += 0.5;
                self.0.write(plan, gate, &g)?;
            }
            Ok(())
        }
        fn read(&mut self, plan: &Plan, buf: Buf) -> Result<Vec<f32>> {
            self.0.read(plan, buf)
        }
        fn write(&mut self, plan: &Plan, buf: Buf, values: &[f32]) -> Result<()> {
            self.0.write(plan, buf, values)
        }
        fn read_tokens(&mut self, plan: &Plan) -> Result<Vec<u32>> {
            let mut t = self.0.read_tokens(plan)?;
            if let Some(first) = t.first_mut() {
                *first ^= 1;
            }
            Ok(t)
        }
    }

    #[test]
    fn a_wrong_kernel_is_named_and_the_rest_agree() {
        let (mut a, mut b) = (runner(), Miscomputes(runner()));
        let config = a.config().clone();
        let blocks: Vec<u32> = (0..3).collect();
        let tokens: Vec<u32> = (0..40).map(|i| i * 7 % 500).collect();
        let items = [BatchItem {
            blocks: &blocks,
            past: 0,
            tokens: &tokens,
            logits: LogitsMode::Last,
            sample: &[],
        }];
        a.reserve_blocks(3).expect("blocks");
        b.reserve_blocks(3).expect("blocks");
        assert!(blocks.len() * BLOCK_POSITIONS >= tokens.len());
        let tables = step_tables(&items);
        let positions: Vec<usize> = tables.positions.iter().map(|&p| p as usize).collect();
        let rope = RopeTable::new(&config, &positions);
        let plan = Plan::for_step(&config, &tables);
        let diffs = compare(&mut a, &mut b, &plan, &tables, &rope).expect("compare");
        assert_eq!(
            diffs.len(),
            plan.ops.iter().map(|&op| written(op).len()).sum::<usize>()
        );
        let wrong: Vec<&OpDiff> = diffs.iter().filter(|d| d.max_diff > 0.0).collect();
        assert_eq!(wrong.len(), config.n_layers, "{wrong:?}");
        assert!(wrong.iter().all(
            |d| matches!(d.op, Op::SiluMul { .. } | Op::SwiGluMatVec { .. })
                && (d.max_diff - 0.5).abs() < 1e-6
        ));
    }

    #[test]
    fn sampled_tokens_are_compared_row_by_row() {
        let (mut a, mut b) = (runner(), runner());
        let config = a.config().clone();
        let blocks: Vec<u32> = (0..2).collect();
        let (p, q): (Vec<u32>, Vec<u32>) = ((0..20).collect(), (5..12).collect());
        let sampling = crate::logits::DeviceSampling {
            row: crate::SampleRow {
                temperature: 0.8,
                inv_temperature: 1.0 / 0.8,
                top_k: 20,
                top_p: 0.9,
                uniform: 0.37,
                ..crate::SampleRow::GREEDY
            },
            penalties: vec![(7, 2)],
        };
        let other: Vec<u32> = (4..6).collect();
        let items = [
            BatchItem {
                blocks: &blocks,
                past: 0,
                tokens: &p,
                logits: LogitsMode::Sample,
                sample: std::slice::from_ref(&sampling),
            },
            BatchItem {
                blocks: &other,
                past: 0,
                tokens: &q,
                logits: LogitsMode::Sample,
                sample: std::slice::from_ref(&sampling),
            },
        ];
        for r in [&mut a as &mut dyn Runner, &mut b] {
            r.reserve_blocks(6).expect("blocks");
        }
        let tables = step_tables(&items);
        let positions: Vec<usize> = tables.positions.iter().map(|&p| p as usize).collect();
        let rope = RopeTable::new(&config, &positions);
        let plan = Plan::for_step(&config, &tables);
        let sampled = |diffs: &[OpDiff]| {
            diffs
                .iter()
                .filter(|d| d.op == Op::Sample)
                .map(|d| d.max_diff)
                .collect::<Vec<f32>>()
        };
        let same = compare(&mut a, &mut b, &plan, &tables, &rope).expect("compare");
        assert_eq!(sampled(&same), vec![0.0]);
        let mut c = Miscomputes(runner());
        c.reserve_blocks(6).expect("blocks");
        let off = compare(&mut a, &mut c, &plan, &tables, &rope).expect("compare");
        assert_eq!(sampled(&off), vec![1.0]);
    }
}
