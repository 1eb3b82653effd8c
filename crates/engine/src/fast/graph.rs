//! Decode steps replayed from captured graphs (CUDA graphs on a GPU).
//!
//! A decode step launches a few hundred small kernels; launching them one by one costs more
//! than they compute for a 3B model at small batch sizes, so the runner captures the launches of
//! a decode step once and replays them. A graph fixes every launch's arguments (buffer pointers,
//! grid sizes, the block-table stride), so a step is padded to a *bucket* — a row count from
//! [`DECODE_BUCKETS`] and a block-table width from [`bucket_blocks`] — and everything that varies
//! from step to step (tokens, slots, sequences, block tables, RoPE tables) lives in static
//! device buffers that are refreshed before the replay. Padded rows are harmless by
//! construction ([`pad_decode`]): their K/V writes are skipped ([`SKIP_SLOT`]), their attention
//! reads one cached position of block 0, and their logits are never read.
//!
//! The rules every runner keeps (the CPU runner emulates capture to test them without a GPU):
//! - nothing allocates and nothing is copied to the host while capturing ([`CaptureGuard`]);
//! - a graph is valid only for the buffers it was captured over: any reallocation (a bigger
//!   step, the KV arena growing) bumps the runner's generation and the graph is recaptured;
//! - a bucket is warmed up by one eager step before it is captured.

use crate::error::{EngineError, Result};
use crate::fast::layout::{SeqInfo, StepTables};
use crate::fast::twin::sample::SampleRow;
use crate::kv::BLOCK_POSITIONS;

/// Row counts decode graphs are captured for; a decode part with more rows runs eagerly.
pub const DECODE_BUCKETS: &[usize] = &[
    1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
];

/// The slot of a padded row: the K/V write kernel skips it.
pub const SKIP_SLOT: u32 = u32::MAX;

/// The smallest block-table width of a graph (256 positions): short contexts share one.
pub const MIN_GRAPH_BLOCKS: usize = 16;

/// What a graph is captured for: rows (all of them decode rows wanting logits) and the
/// block-table width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub rows: usize,
    pub max_blocks: usize,
    /// Whether the step ends with drawing tokens on the device.
    pub sample: bool,
}

/// The bucket of a decode part of `rows` rows, `None` above the largest.
pub fn bucket_rows(rows: usize) -> Option<usize> {
    DECODE_BUCKETS.iter().copied().find(|&b| b >= rows.max(1))
}

/// The block-table width of a graph whose longest sequence has `blocks` blocks: a power of two,
/// at least [`MIN_GRAPH_BLOCKS`], so contexts growing token by token change graphs rarely.
pub fn bucket_blocks(blocks: usize) -> usize {
    blocks.max(MIN_GRAPH_BLOCKS).next_power_of_two()
}

/// The graph key of a decode part's `tables`, `None` when it has too many rows for a graph.
pub fn key_of(tables: &StepTables) -> Option<GraphKey> {
    Some(GraphKey {
        rows: bucket_rows(tables.rows())?,
        max_blocks: bucket_blocks(tables.max_blocks),
        sample: tables.sample,
    })
}

/// The tables of a decode part (every sequence one row that wants logits) padded to `key`:
/// padded rows get token 0 at position 0, a slot the K/V write skips, and a sequence of their
/// own whose block table is block 0 (any resident block does: the row reads one position and
/// its output is thrown away). Every row wants logits, so the LM head's shape is the bucket's.
pub fn pad_decode(tables: &StepTables, key: GraphKey) -> Result<StepTables> {
    let n = tables.rows();
    if n > key.rows || tables.max_blocks > key.max_blocks {
        return Err(EngineError::InvalidStep(format!(
            "a decode part of {n} rows and {} blocks does not fit the graph for {} rows and {} blocks",
            tables.max_blocks, key.rows, key.max_blocks
        )));
    }
    if tables.seqs.len() != n || tables.seqs.iter().any(|s| s.rows != 1) {
        return Err(EngineError::InvalidStep(
            "only decode parts (one row per sequence) are replayed from graphs".into(),
        ));
    }
    if tables.sample != key.sample || tables.logit_rows.len() != n {
        return Err(EngineError::InvalidStep(
            "a decode part for a graph has one logit row per sequence and the graph's sampling"
                .into(),
        ));
    }
    let mut t = StepTables {
        max_blocks: key.max_blocks,
        sample: key.sample,
        sampling: tables.sampling.clone(),
        penalty_spans: tables.penalty_spans.clone(),
        penalties: tables.penalties.clone(),
        ..StepTables::default()
    };
    for s in 0..n {
        let blocks = tables.blocks_of(s);
        let last = blocks.last().copied().unwrap_or(0);
        t.block_tables.extend_from_slice(blocks);
        t.block_tables
            .extend(std::iter::repeat_n(last, key.max_blocks - blocks.len()));
    }
    t.tokens = tables.tokens.clone();
    t.positions = tables.positions.clone();
    t.slots = tables.slots.clone();
    t.row_seq = tables.row_seq.clone();
    t.seqs = tables.seqs.clone();
    for row in n..key.rows {
        t.tokens.push(0);
        t.positions.push(0);
        t.slots.push(SKIP_SLOT);
        t.row_seq.push(row as u32);
        t.seqs.push(SeqInfo {
            row0: row as u32,
            rows: 1,
            past: 0,
            index: row as u32,
        });
        t.block_tables
            .extend(std::iter::repeat_n(0, key.max_blocks));
        let end = (t.penalties.len() / 2) as u32;
        t.sampling.push(SampleRow::GREEDY);
        t.penalty_spans.extend([end, end]);
    }
    t.logit_rows = (0..key.rows as u32).collect();
    Ok(t)
}

/// Positions a graph's block tables cover.
pub fn positions_of(key: GraphKey) -> usize {
    key.max_blocks * BLOCK_POSITIONS
}

/// How graphs have been used (for tests, the benchmark and `gpu-check`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphStats {
    /// Steps run eagerly to warm a bucket up before its capture.
    pub warmups: u64,
    pub captures: u64,
    pub replays: u64,
    /// Graphs dropped because a buffer they were captured over was reallocated.
    pub invalidated: u64,
}

/// Forbids allocation and copies to the host while a graph is being captured or replayed: a
/// capture records only launches, so an allocation inside it would be baked into the graph (or
/// fail) and a copy to the host would break the capture.
#[derive(Debug, Default)]
pub struct CaptureGuard {
    capturing: Option<GraphKey>,
}

impl CaptureGuard {
    pub fn begin(&mut self, key: GraphKey) -> Result<()> {
        if let Some(open) = self.capturing {
            return Err(EngineError::InvalidStep(format!(
                "a capture for {key:?} began while the one for {open:?} is open"
            )));
        }
        self.capturing = Some(key);
        Ok(())
    }

    pub fn end(&mut self) {
        self.capturing = None;
    }

    pub fn capturing(&self) -> Option<GraphKey> {
        self.capturing
    }

    /// Errors when `what` (an allocation, a copy to the host) happens inside a capture.
    pub fn forbid(&self, what: &str) -> Result<()> {
        match self.capturing {
            None => Ok(()),
            Some(key) => Err(EngineError::InvalidStep(format!(
                "{what} inside the decode graph for {} rows and {} blocks: every buffer must be \
                 allocated and every table uploaded before the capture",
                key.rows, key.max_blocks
            ))),
        }
    }
}

/// The graphs of a runner by key, each with the generation of the buffers it was captured over,
/// and which keys have been warmed up. `G` is the runner's graph (a CUDA graph, or the recorded
/// operation list of the CPU runner's emulation).
#[derive(Debug)]
pub struct GraphCache<G> {
    graphs: std::collections::HashMap<GraphKey, (G, u64)>,
    warmed: std::collections::HashSet<GraphKey>,
    pub stats: GraphStats,
}

impl<G> Default for GraphCache<G> {
    fn default() -> Self {
        Self {
            graphs: Default::default(),
            warmed: Default::default(),
            stats: GraphStats::default(),
        }
    }
}

/// What a runner does with a padded decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphAction {
    /// Run it eagerly: the bucket's first step warms it up.
    WarmUp,
    /// Capture its launches, then replay them.
    Capture,
    /// Replay the graph captured for it.
    Replay,
}

impl<G> GraphCache<G> {
    /// What to do with a step for `key` over buffers of `generation`; drops a stale graph.
    pub fn action(&mut self, key: GraphKey, generation: u64) -> GraphAction {
        if let Some((_, captured)) = self.graphs.get(&key) {
            if *captured == generation {
                self.stats.replays += 1;
                return GraphAction::Replay;
            }
            self.graphs.remove(&key);
            self.stats.invalidated += 1;
        }
        if self.warmed.insert(key) {
            self.stats.warmups += 1;
            GraphAction::WarmUp
        } else {
            GraphAction::Capture
        }
    }

    /// Keeps the graph just captured for `key` (the runner replays it next).
    pub fn insert(&mut self, key: GraphKey, graph: G, generation: u64) {
        self.stats.captures += 1;
        self.graphs.insert(key, (graph, generation));
    }

    pub fn get(&self, key: GraphKey) -> Option<&G> {
        self.graphs.get(&key).map(|(g, _)| g)
    }

    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_row_count_up_to_the_largest() {
        assert_eq!(bucket_rows(0), Some(1));
        assert_eq!(bucket_rows(1), Some(1));
        assert_eq!(bucket_rows(3), Some(4));
        assert_eq!(bucket_rows(9), Some(12));
        assert_eq!(bucket_rows(64), Some(64));
        assert_eq!(bucket_rows(65), Some(80));
        assert_eq!(bucket_rows(256), Some(256));
        assert_eq!(bucket_rows(257), None);
        for w in DECODE_BUCKETS.windows(2) {
            assert!(w[0] < w[1]);
        }
        assert_eq!(bucket_blocks(1), 16);
        assert_eq!(bucket_blocks(16), 16);
        assert_eq!(bucket_blocks(17), 32);
        assert_eq!(
            positions_of(GraphKey {
                rows: 1,
                max_blocks: 16,
                sample: false
            }),
            256
        );
    }

    fn decode_tables() -> StepTables {
        // Two sequences of one row: blocks [3, 5] at position 20, and [7] at position 2.
        StepTables {
            tokens: vec![11, 12],
            positions: vec![20, 2],
            slots: vec![5 * 16 + 4, 7 * 16 + 2],
            row_seq: vec![0, 1],
            seqs: vec![
                SeqInfo {
                    row0: 0,
                    rows: 1,
                    past: 20,
                    index: 0,
                },
                SeqInfo {
                    row0: 1,
                    rows: 1,
                    past: 2,
                    index: 1,
                },
            ],
            block_tables: vec![3, 5, 7, 7],
            max_blocks: 2,
            logit_rows: vec![0, 1],
            sample: false,
            hidden: false,
            sampling: vec![SampleRow::GREEDY; 2],
            penalty_spans: vec![0, 0, 0, 0],
            penalties: vec![],
        }
    }

    #[test]
    fn padding_keeps_real_rows_and_makes_padded_rows_harmless() {
        let t = decode_tables();
        let key = key_of(&t).expect("fits");
        assert_eq!(
            key,
            GraphKey {
                rows: 2,
                max_blocks: 16,
                sample: false
            }
        );
        let key = GraphKey {
            rows: 4,
            max_blocks: 16,
            sample: false,
        };
        let p = pad_decode(&t, key).expect("pads");
        assert_eq!(p.rows(), 4);
        assert_eq!(&p.tokens[..2], &t.tokens[..]);
        assert_eq!(&p.slots[..2], &t.slots[..]);
        assert_eq!(&p.slots[2..], &[SKIP_SLOT, SKIP_SLOT]);
        assert_eq!(p.max_blocks, 16);
        assert_eq!(&p.blocks_of(0)[..3], &[3, 5, 5]);
        assert_eq!(&p.blocks_of(1)[..2], &[7, 7]);
        assert!(p.blocks_of(3).iter().all(|&b| b == 0));
        assert_eq!(
            p.seqs[3],
            SeqInfo {
                row0: 3,
                rows: 1,
                past: 0,
                index: 3
            }
        );
        assert_eq!(p.row_seq, vec![0, 1, 2, 3]);
        assert_eq!(p.logit_rows, vec![0, 1, 2, 3]);
        assert_eq!(p.block_tables.len(), 4 * 16);
    }

    #[test]
    fn padded_rows_are_drawn_greedily_without_penalties() {
        let mut t = decode_tables();
        t.sample = true;
        t.sampling[1] = SampleRow {
            temperature: 0.5,
            ..SampleRow::GREEDY
        };
        t.penalties = vec![9, 2, 4, 1];
        t.penalty_spans = vec![0, 0, 0, 2];
        let key = GraphKey {
            rows: 4,
            max_blocks: 16,
            sample: true,
        };
        assert_eq!(key_of(&t).map(|k| k.sample), Some(true));
        let p = pad_decode(&t, key).expect("pads");
        assert_eq!(&p.sampling[..2], &t.sampling[..]);
        assert_eq!(&p.sampling[2..], &[SampleRow::GREEDY, SampleRow::GREEDY]);
        assert_eq!(p.penalty_spans, vec![0, 0, 0, 2, 2, 2, 2, 2]);
        assert_eq!(p.penalties, t.penalties);
        assert!(p.sample);
        // A graph captured without the draw does not take a step that draws.
        assert!(pad_decode(
            &t,
            GraphKey {
                sample: false,
                ..key
            }
        )
        .is_err());
    }

    #[test]
    fn padding_refuses_what_does_not_fit_or_is_not_decode() {
        let t = decode_tables();
        assert!(pad_decode(
            &t,
            GraphKey {
                rows: 1,
                max_blocks: 16,
                sample: false
            }
        )
        .is_err());
        assert!(pad_decode(
            &t,
            GraphKey {
                rows: 2,
                max_blocks: 1,
                sample: false
            }
        )
        .is_err());
        let mut prefill = t.clone();
        prefill.seqs[0].rows = 2;
        assert!(pad_decode(
            &prefill,
            GraphKey {
                rows: 2,
                max_blocks: 16,
                sample: false
            }
        )
        .is_err());
    }

    #[test]
    fn the_cache_warms_up_captures_replays_and_recaptures_after_a_reallocation() {
        let key = GraphKey {
            rows: 4,
            max_blocks: 16,
            sample: false,
        };
        let mut cache = GraphCache::<&str>::default();
        assert_eq!(cache.action(key, 0), GraphAction::WarmUp);
        assert_eq!(cache.action(key, 0), GraphAction::Capture);
        cache.insert(key, "graph", 0);
        assert_eq!(cache.action(key, 0), GraphAction::Replay);
        assert_eq!(cache.get(key), Some(&"graph"));
        // The buffers were reallocated: the graph is dropped and captured again (no new warm-up).
        assert_eq!(cache.action(key, 1), GraphAction::Capture);
        assert_eq!(cache.stats.invalidated, 1);
        assert!(cache.is_empty());
    }

    #[test]
    fn the_guard_forbids_allocation_inside_a_capture() {
        let mut guard = CaptureGuard::default();
        assert!(guard.forbid("allocating X").is_ok());
        let key = GraphKey {
            rows: 8,
            max_blocks: 32,
            sample: false,
        };
        guard.begin(key).expect("begins");
        let e = guard.forbid("allocating X").expect_err("forbidden");
        assert!(
            e.to_string()
                .contains("allocating X inside the decode graph for 8 rows"),
            "{e}"
        );
        assert!(guard.begin(key).is_err(), "nested captures");
        guard.end();
        assert!(guard.forbid("allocating X").is_ok());
    }
}
