//! Tensor-core prefill attention over the KV arena, the twin of `flash_prefill_d*` in
//! `kernels.cu`.
//!
//! Why a second attention kernel: [`super::attention`] gives one thread block to every (row, KV
//! head) and walks every visible key for it with CUDA cores, so a 512-row prefill reads each key
//! 512 times and does its dot products one lane at a time (44% of a 512-token prefill in the
//! recorded H100 profile). Here one block takes a *tile* of one sequence: [`TILE_PAIRS`] (row,
//! query head) pairs of one KV head, the GQA query heads of a row packed next to each other, so
//! the M dimension of the tensor-core products is rows × group. Keys and values are staged
//! [`CHUNK_KEYS`] at a time (four 16-position pages, in block-table order) into shared memory,
//! `S = Q Kᵀ` and `O += P V` run as f16 `mma.sync.m16n8k16` with f32 accumulators, and the
//! softmax is online per chunk (running max, rescaled sum and output) in registers. A tile stops
//! at the last position its last row sees; a warp whose rows are all masked for a chunk skips
//! its products.
//!
//! The contract with the kernel: the same tiles ([`tiles`]), the same chunks, the same operands
//! rounded to f16 where the kernel rounds them (the query, and the probabilities `P` before
//! `P V`; keys and values are f16 in the arena), the scale applied in the log2 domain
//! (`exp2(s · log2(e) / √d − m)`), and the row sum taken over the unrounded probabilities.
//! The tensor cores' f32 sums run in another order (and Hopper's are not strictly IEEE), so
//! outputs agree within a tolerance, not bit for bit: [`TOLERANCE`].

use half::f16;

use crate::fast::layout::{KvArena, StepTables};
use crate::kv::BLOCK_POSITIONS;

use super::attention::AttnShape;

/// (row, query head) pairs per tile: four warps of 16 rows of the `m16n8k16` products.
pub const TILE_PAIRS: usize = 64;
/// Keys staged and multiplied per chunk.
pub const CHUNK_KEYS: usize = 64;
/// Sequences of a step with at least this many new rows take the flash kernel (when the head
/// dimension has one, see [`crate::fast::launch::uses_flash`]); one-row (decode) sequences keep
/// the split kernel, whose splits spread a long context over the GPU.
pub const MIN_ROWS: usize = 2;
/// Head dimensions the kernel is instantiated for (its accumulators are registers sized by it).
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// The largest |difference| from the twin, relative to the largest |value| of the output row:
/// f16 rounding of `Q` and `P` is shared; what differs is the order of f32 sums.
pub const TOLERANCE: f32 = 2e-3;

/// `log2(e)`, the factor that turns the softmax's `exp` into the kernel's `exp2`.
const LOG2E: f32 = std::f32::consts::LOG2_E;

/// The step's flash tiles, two `u32` each: the sequence (index into `tables.seqs`) and the
/// first (row, head) pair of the tile, pairs counted `row × group + head` within the sequence.
/// Only sequences with at least [`MIN_ROWS`] rows have tiles.
pub fn tiles(tables: &StepTables, group: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for (s, seq) in tables.seqs.iter().enumerate() {
        if (seq.rows as usize) < MIN_ROWS {
            continue;
        }
        let pairs = seq.rows as usize * group;
        for first in (0..pairs).step_by(TILE_PAIRS) {
            out.extend([s as u32, first as u32]);
        }
    }
    out
}

/// The attention of every tile in `tiles`: `q` is `[rows][heads × head_dim]`, `out` the same;
/// rows of other sequences are left as they are.
#[allow(clippy::too_many_arguments)]
pub fn flash_prefill(
    arena: &[f16],
    layout: KvArena,
    layer: usize,
    shape: AttnShape,
    tables: &StepTables,
    tiles: &[u32],
    q: &[f32],
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let width = shape.heads * hd;
    let scale_log2 = LOG2E / (hd as f32).sqrt();
    for tile in tiles.chunks_exact(2) {
        let seq = tables.seqs[tile[0] as usize];
        let blocks = tables.blocks_of(tile[0] as usize);
        let pairs = seq.rows as usize * group;
        let first = tile[1] as usize;
        for kv_head in 0..shape.kv_heads {
            for pair in first..(first + TILE_PAIRS).min(pairs) {
                let (r, g) = (pair / group, pair % group);
                let row = seq.row0 as usize + r;
                let head = kv_head * group + g;
                let at = row * width + head * hd;
                let position = seq.past as usize + r;
                let query: Vec<f32> = q[at..at + hd]
                    .iter()
                    .map(|&v| f16::from_f32(v).to_f32())
                    .collect();
                let o = one_pair(
                    arena, layout, layer, kv_head, blocks, &query, position, scale_log2,
                );
                out[at..at + hd].copy_from_slice(&o);
            }
        }
    }
}

/// One (row, head) pair seeing positions `0..=position`: the chunks in order, each a max, a
/// rescale and its `P V` with `P` rounded to f16. Chunks past `position` would change nothing
/// (all masked: the max stays, the rescale is 1, every probability 0), so they are not visited.
#[allow(clippy::too_many_arguments)]
fn one_pair(
    arena: &[f16],
    layout: KvArena,
    layer: usize,
    kv_head: usize,
    blocks: &[u32],
    query: &[f32],
    position: usize,
    scale_log2: f32,
) -> Vec<f32> {
    let hd = layout.head_dim;
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    let mut acc = vec![0f32; hd];
    let slot = |p: usize| (blocks[p / BLOCK_POSITIONS], p % BLOCK_POSITIONS);
    for start in (0..=position).step_by(CHUNK_KEYS) {
        let end = (start + CHUNK_KEYS).min(position + 1);
        let scores: Vec<f32> = (start..end)
            .map(|p| {
                let (block, s) = slot(p);
                let k = layout.index(block, layer, 0, kv_head, s);
                let dot: f32 = query
                    .iter()
                    .zip(&arena[k..k + hd])
                    .map(|(a, b)| a * b.to_f32())
                    .sum();
                dot * scale_log2
            })
            .collect();
        let chunk_max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let new_max = max.max(chunk_max);
        let alpha = (max - new_max).exp2();
        sum *= alpha;
        acc.iter_mut().for_each(|o| *o *= alpha);
        for (p, &score) in (start..end).zip(&scores) {
            let prob = (score - new_max).exp2();
            sum += prob;
            let weight = f16::from_f32(prob).to_f32();
            let (block, s) = slot(p);
            let v = layout.index(block, layer, 1, kv_head, s);
            for (o, x) in acc.iter_mut().zip(&arena[v..v + hd]) {
                *o += weight * x.to_f32();
            }
        }
        max = new_max;
    }
    acc.iter().map(|o| o / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::layout::{slot_of, SeqInfo};
    use crate::fast::twin::attention;

    fn value(i: usize) -> f32 {
        ((i * 7919 % 1009) as f32 / 504.5 - 1.0) * 0.5
    }

    /// An arena whose every value is set, a step of `seqs` (past, rows) on scattered blocks,
    /// and queries; `group` query heads per KV head.
    struct Case {
        layout: KvArena,
        shape: AttnShape,
        arena: Vec<f16>,
        tables: StepTables,
        q: Vec<f32>,
    }

    fn case(seqs: &[(usize, usize)], kv_heads: usize, group: usize, head_dim: usize) -> Case {
        let layout = KvArena {
            layers: 2,
            kv_heads,
            head_dim,
        };
        let shape = AttnShape {
            heads: kv_heads * group,
            kv_heads,
            head_dim,
        };
        let tables_blocks: Vec<Vec<u32>> = {
            let mut next = 0u32;
            seqs.iter()
                .map(|&(past, rows)| {
                    let n = (past + rows).div_ceil(BLOCK_POSITIONS).max(1);
                    // Scattered and out of order: every other block, backwards.
                    let ids: Vec<u32> = (0..n as u32).rev().map(|b| next + 2 * b + 1).collect();
                    next += 2 * n as u32 + 1;
                    ids
                })
                .collect()
        };
        let n_blocks = tables_blocks.iter().flatten().max().map_or(1, |&m| m + 1) as usize;
        let arena: Vec<f16> = (0..n_blocks * layout.block_values())
            .map(|i| f16::from_f32(value(i * 13 + 5)))
            .collect();
        let max_blocks = tables_blocks.iter().map(Vec::len).max().unwrap_or(1);
        let mut t = StepTables {
            max_blocks,
            ..StepTables::default()
        };
        let mut row0 = 0;
        for (index, (&(past, rows), blocks)) in seqs.iter().zip(&tables_blocks).enumerate() {
            t.seqs.push(SeqInfo {
                row0: row0 as u32,
                rows: rows as u32,
                past: past as u32,
                index: index as u32,
            });
            let mut padded = blocks.clone();
            padded.resize(max_blocks, *blocks.last().unwrap_or(&0));
            t.block_tables.extend(padded);
            for r in 0..rows {
                t.row_seq.push(index as u32);
                t.slots.push(slot_of(blocks, past + r));
                t.tokens.push(0);
            }
            row0 += rows;
        }
        let width = shape.heads * head_dim;
        let q = (0..row0 * width).map(|i| value(i * 31 + 3) * 3.0).collect();
        Case {
            layout,
            shape,
            arena,
            tables: t,
            q,
        }
    }

    /// The plain softmax in f64 over the f16-rounded query (the probabilities unrounded).
    fn naive(c: &Case, row: usize, head: usize) -> Vec<f32> {
        let hd = c.shape.head_dim;
        let group = c.shape.heads / c.shape.kv_heads;
        let s = c.tables.row_seq[row] as usize;
        let seq = c.tables.seqs[s];
        let position = seq.past as usize + row - seq.row0 as usize;
        let blocks = c.tables.blocks_of(s);
        let at = row * c.shape.heads * hd + head * hd;
        let query: Vec<f64> = c.q[at..at + hd]
            .iter()
            .map(|&v| f16::from_f32(v).to_f64())
            .collect();
        let kv = head / group;
        let read = |kind: usize, p: usize| -> Vec<f64> {
            let slot = slot_of(blocks, p) as usize;
            let i = c.layout.index(
                (slot / BLOCK_POSITIONS) as u32,
                1,
                kind,
                kv,
                slot % BLOCK_POSITIONS,
            );
            c.arena[i..i + hd].iter().map(|x| x.to_f64()).collect()
        };
        let scores: Vec<f64> = (0..=position)
            .map(|p| {
                read(0, p)
                    .iter()
                    .zip(&query)
                    .map(|(a, b)| a * b)
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::MIN, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = w.iter().sum();
        let mut out = vec![0f64; hd];
        for (p, wp) in w.iter().enumerate() {
            for (o, v) in out.iter_mut().zip(read(1, p)) {
                *o += wp * v;
            }
        }
        out.iter().map(|o| (o / sum) as f32).collect()
    }

    /// Within `tolerance` of the values' scale: rounding a probability to f16 moves an
    /// output by at most 2⁻¹¹ of the largest |value| it averages (here 0.5), whatever the
    /// output's own size after cancellation.
    fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
        const VALUE_SCALE: f32 = 0.5;
        for (a, b) in got.iter().zip(want) {
            assert!(
                (a - b).abs() <= tolerance * VALUE_SCALE,
                "{what}: {a} vs {b}"
            );
        }
    }

    /// Two prefills (one after a cached past, one from position 0 over more than a chunk) and a
    /// decode row; group 3, so tiles cut rows in the middle of their heads. Every flash row is
    /// the plain softmax over its causal window; the decode row is the split kernel's alone.
    #[test]
    fn flash_tiles_equal_a_causal_softmax_with_the_kernels_roundings() {
        for head_dim in HEAD_DIMS {
            let c = case(&[(37, 29), (0, 1), (0, 150)], 2, 3, head_dim);
            let group = 3;
            let tiles = tiles(&c.tables, group);
            // 29 × 3 = 87 pairs: 2 tiles; the decode row none; 150 × 3 = 450 pairs: 8 tiles.
            assert_eq!(
                tiles,
                [0, 0, 0, 64, 2, 0, 2, 64, 2, 128, 2, 192, 2, 256, 2, 320, 2, 384, 2, 448]
            );
            let width = c.shape.heads * head_dim;
            let rows = c.tables.rows();
            let mut out = vec![f32::NAN; rows * width];
            flash_prefill(
                &c.arena, c.layout, 1, c.shape, &c.tables, &tiles, &c.q, &mut out,
            );
            for row in 0..rows {
                let decode = c.tables.row_seq[row] == 1;
                for head in 0..c.shape.heads {
                    let got = &out[row * width + head * head_dim..][..head_dim];
                    if decode {
                        assert!(got.iter().all(|v| v.is_nan()), "row {row} was written");
                    } else {
                        let want = naive(&c, row, head);
                        assert_close(
                            got,
                            &want,
                            1e-3,
                            &format!("d{head_dim} row {row} head {head}"),
                        );
                    }
                }
            }
            // The split kernel skips the flash sequences and computes the rest as before.
            let mut split = vec![f32::NAN; rows * width];
            attention::attention(
                &c.arena, c.layout, 1, c.shape, &c.tables, &c.q, &mut split, MIN_ROWS,
            );
            for row in 0..rows {
                let cells = &split[row * width..(row + 1) * width];
                if c.tables.row_seq[row] == 1 {
                    assert!(cells.iter().all(|v| v.is_finite()));
                } else {
                    assert!(cells.iter().all(|v| v.is_nan()), "row {row}");
                }
            }
        }
    }

    /// The twin is the split kernel's attention within the rounding of `Q` and `P` to f16.
    #[test]
    fn flash_agrees_with_the_split_kernel_within_f16_rounding() {
        let c = case(&[(100, 70)], 2, 4, 64);
        let width = c.shape.heads * 64;
        let rows = c.tables.rows();
        let tiles = tiles(&c.tables, 4);
        let mut flash = vec![0f32; rows * width];
        flash_prefill(
            &c.arena, c.layout, 1, c.shape, &c.tables, &tiles, &c.q, &mut flash,
        );
        let mut split = vec![0f32; rows * width];
        attention::attention(
            &c.arena,
            c.layout,
            1,
            c.shape,
            &c.tables,
            &c.q,
            &mut split,
            usize::MAX,
        );
        for row in 0..rows {
            for head in 0..c.shape.heads {
                let at = row * width + head * 64;
                assert_close(
                    &flash[at..at + 64],
                    &split[at..at + 64],
                    5e-3,
                    "flash vs split",
                );
            }
        }
    }

    #[test]
    fn only_sequences_of_several_rows_have_tiles() {
        let c = case(&[(5, 1), (0, 2), (9, 1)], 1, 8, 64);
        assert_eq!(tiles(&c.tables, 8), [1, 0]);
        assert!(attention::is_flash(&c.tables.seqs[1], MIN_ROWS));
        assert!(!attention::is_flash(&c.tables.seqs[0], MIN_ROWS));
        assert!(!attention::is_flash(&c.tables.seqs[1], usize::MAX));
    }
}
