//! Paged causal attention over the KV arena, the twin of the fast tier's attention kernels.
//!
//! One work item is (sequence row, KV head, split): the `group` query heads that share the KV
//! head are computed together, so each key and value row is read once for all of them (GQA
//! sharing). Keys are visited block by block (16 positions) in block-table order with an online
//! softmax (running max, running sum, rescaled output). A decode row over a long context is
//! split along the context into [`splits`] pieces of [`split_positions`] positions, each giving a
//! partial `(max, sum, output)`; [`merge`] combines them. Prefill rows (several new rows of one
//! sequence) run as one split each, causally: row `r` at position `p` sees positions `0..=p`.
//! The kernels follow the same order: dot products in dimension order within a key, keys in
//! position order within a split, splits merged in split order.

use half::f16;

use crate::fast::layout::{KvArena, SeqInfo, StepTables};
use crate::kv::BLOCK_POSITIONS;

/// The shortest split of a decode row.
pub const MIN_SPLIT_POSITIONS: usize = 64;
/// The most splits of one decode row (bounds the partial buffers).
pub const MAX_SPLITS: usize = 32;

/// Positions per split of a decode row that sees `visible` positions: 64, or past 2,048
/// positions the multiple of 16 that cuts them into at most 32 splits. A decode step's attention
/// then has rows × KV heads × splits blocks to spread over the GPU (one row at 512 positions:
/// 8 splits per KV head), and the partials stay bounded. Measured on an H100 with 512-position
/// splits: one row at 512 positions took 0.32 ms of attention per layer on 4 blocks.
pub fn split_positions(visible: usize) -> usize {
    MIN_SPLIT_POSITIONS.max(
        visible
            .div_ceil(MAX_SPLITS)
            .next_multiple_of(BLOCK_POSITIONS),
    )
}

/// Splits of a decode row that sees `visible` positions: at least one.
pub fn splits(visible: usize) -> usize {
    visible.div_ceil(split_positions(visible)).max(1)
}

/// Splits the partial buffers need room for when no row sees more than `max_visible`
/// positions: a bound on [`splits`] of every `visible <= max_visible` (which is not monotonic
/// past 2,048 positions, where the split length starts to grow).
pub fn max_splits(max_visible: usize) -> usize {
    max_visible
        .div_ceil(MIN_SPLIT_POSITIONS)
        .clamp(1, MAX_SPLITS)
}

/// A partial result of one split for one query head: the running max and sum of the softmax,
/// and the output scaled by `exp(score - max)` (not yet divided by the sum).
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    pub max: f32,
    pub sum: f32,
    pub out: Vec<f32>,
}

/// The attention shapes.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Online softmax of the `group` query heads `q` (`[group][head_dim]`) over positions
/// `from..to` of a sequence whose block table is `blocks`, in `layer`, KV head `kv_head`.
#[allow(clippy::too_many_arguments)]
pub fn partial(
    arena: &[f16],
    layout: KvArena,
    layer: usize,
    kv_head: usize,
    blocks: &[u32],
    q: &[f32],
    group: usize,
    from: usize,
    to: usize,
) -> Vec<Partial> {
    let hd = layout.head_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut parts: Vec<Partial> = (0..group)
        .map(|_| Partial {
            max: f32::NEG_INFINITY,
            sum: 0.0,
            out: vec![0.0; hd],
        })
        .collect();
    let mut position = from;
    while position < to {
        let block = blocks[position / BLOCK_POSITIONS];
        let end = ((position / BLOCK_POSITIONS + 1) * BLOCK_POSITIONS).min(to);
        for (g, part) in parts.iter_mut().enumerate() {
            let qg = &q[g * hd..(g + 1) * hd];
            let scores: Vec<f32> = (position..end)
                .map(|p| {
                    let at = layout.index(block, layer, 0, kv_head, p % BLOCK_POSITIONS);
                    let key = &arena[at..at + hd];
                    qg.iter().zip(key).map(|(a, k)| a * k.to_f32()).sum::<f32>() * scale
                })
                .collect();
            let block_max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let max = part.max.max(block_max);
            let factor = (part.max - max).exp();
            part.sum *= factor;
            for o in &mut part.out {
                *o *= factor;
            }
            for (p, &score) in (position..end).zip(&scores) {
                let w = (score - max).exp();
                part.sum += w;
                let at = layout.index(block, layer, 1, kv_head, p % BLOCK_POSITIONS);
                for (o, v) in part.out.iter_mut().zip(&arena[at..at + hd]) {
                    *o += w * v.to_f32();
                }
            }
            part.max = max;
        }
        position = end;
    }
    parts
}

/// Combines the partials of one query head's splits, in split order, into its output.
pub fn merge(parts: &[Partial], out: &mut [f32]) {
    let max = parts
        .iter()
        .map(|p| p.max)
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    out.iter_mut().for_each(|o| *o = 0.0);
    for p in parts {
        let w = (p.max - max).exp();
        sum += p.sum * w;
        for (o, &v) in out.iter_mut().zip(&p.out) {
            *o += v * w;
        }
    }
    for o in out {
        *o /= sum;
    }
}

/// The decode kernel's own order (`attention_decode_d*_g*`) for one query head over positions
/// `from..to` (a split): the query pre-scaled by `1 / sqrt(head_dim)`, each key's dot product
/// as `head_dim / 8` lanes of 8 dimensions added in a butterfly, 16 positions at a time with the
/// chunk's exponentials taken once per key against the running max, and the running sum and
/// output rescaled once per chunk. The same contract as [`partial`] (float order aside).
#[allow(clippy::too_many_arguments)]
pub fn decode_partial(
    arena: &[f16],
    layout: KvArena,
    layer: usize,
    kv_head: usize,
    blocks: &[u32],
    q: &[f32],
    from: usize,
    to: usize,
) -> Partial {
    let hd = layout.head_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let lanes = hd / 8;
    let qs: Vec<f32> = q.iter().map(|v| v * scale).collect();
    let mut part = Partial {
        max: f32::NEG_INFINITY,
        sum: 0.0,
        out: vec![0.0; hd],
    };
    let mut position = from;
    while position < to {
        let block = blocks[position / BLOCK_POSITIONS];
        let n = BLOCK_POSITIONS.min(to - position);
        let mut scores = [f32::NEG_INFINITY; BLOCK_POSITIONS];
        for (key, score) in scores.iter_mut().enumerate().take(n) {
            let at = layout.index(block, layer, 0, kv_head, (position + key) % BLOCK_POSITIONS);
            let k = &arena[at..at + hd];
            let mut lane_sums: Vec<f32> = (0..lanes)
                .map(|l| (0..8).fold(0.0f32, |s, j| s + qs[8 * l + j] * k[8 * l + j].to_f32()))
                .collect();
            let mut m = lanes / 2;
            while m > 0 {
                let old = lane_sums.clone();
                for (i, v) in lane_sums.iter_mut().enumerate() {
                    *v = old[i] + old[i ^ m];
                }
                m /= 2;
            }
            *score = lane_sums[0];
        }
        let top = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let new_max = part.max.max(top);
        let probs: Vec<f32> = scores
            .iter()
            .map(|&s| {
                if s == f32::NEG_INFINITY {
                    0.0
                } else {
                    (s - new_max).exp()
                }
            })
            .collect();
        let factor = if part.max == f32::NEG_INFINITY {
            0.0
        } else {
            (part.max - new_max).exp()
        };
        part.sum = part.sum * factor + probs.iter().sum::<f32>();
        for o in &mut part.out {
            *o *= factor;
        }
        for (key, &p) in probs.iter().enumerate().take(n) {
            let at = layout.index(block, layer, 1, kv_head, (position + key) % BLOCK_POSITIONS);
            for (o, v) in part.out.iter_mut().zip(&arena[at..at + hd]) {
                *o += p * v.to_f32();
            }
        }
        part.max = new_max;
        position += n;
    }
    part
}

/// Whether this kernel leaves sequence `seq` to the flash prefill kernel (`super::flash`):
/// `min_rows` is its `MIN_ROWS` in a step that uses it and `usize::MAX` otherwise.
pub fn is_flash(seq: &SeqInfo, min_rows: usize) -> bool {
    seq.rows as usize >= min_rows
}

/// Attention of every row of the step: `q` is `[rows][heads × head_dim]`, `out` the same.
/// Sequences of at least `flash_rows` rows are left to the flash kernel ([`is_flash`];
/// `usize::MAX` leaves none), their rows untouched.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    arena: &[f16],
    layout: KvArena,
    layer: usize,
    shape: AttnShape,
    tables: &StepTables,
    q: &[f32],
    out: &mut [f32],
    flash_rows: usize,
) {
    let hd = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let width = shape.heads * hd;
    for (s, seq) in tables.seqs.iter().enumerate() {
        if is_flash(seq, flash_rows) {
            continue;
        }
        let blocks = tables.blocks_of(s);
        for r in 0..seq.rows as usize {
            let row = seq.row0 as usize + r;
            let visible = seq.past as usize + r + 1;
            // Decode rows over long contexts are split; prefill rows run whole.
            let n_splits = if seq.rows == 1 { splits(visible) } else { 1 };
            for kv_head in 0..shape.kv_heads {
                let heads = kv_head * group..(kv_head + 1) * group;
                let qg = &q[row * width + heads.start * hd..row * width + heads.end * hd];
                let mut per_head: Vec<Vec<Partial>> = vec![Vec::new(); group];
                let per = split_positions(visible);
                for split in 0..n_splits {
                    let from = split * per;
                    let to = if n_splits == 1 {
                        visible
                    } else {
                        ((split + 1) * per).min(visible)
                    };
                    let parts = partial(arena, layout, layer, kv_head, blocks, qg, group, from, to);
                    for (g, p) in parts.into_iter().enumerate() {
                        per_head[g].push(p);
                    }
                }
                for (g, parts) in per_head.iter().enumerate() {
                    let h = heads.start + g;
                    merge(
                        parts,
                        &mut out[row * width + h * hd..row * width + (h + 1) * hd],
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::layout::slot_of;

    #[test]
    fn splits_are_64_positions_then_at_most_32() {
        assert_eq!((split_positions(1), splits(1)), (64, 1));
        assert_eq!((split_positions(512), splits(512)), (64, 8));
        assert_eq!((split_positions(2048), splits(2048)), (64, 32));
        assert_eq!((split_positions(2049), splits(2049)), (80, 26));
        assert_eq!((split_positions(65_536), splits(65_536)), (2048, 32));
        for visible in 1..20_000 {
            let per = split_positions(visible);
            assert_eq!(per % BLOCK_POSITIONS, 0);
            let n = splits(visible);
            assert!((1..=MAX_SPLITS).contains(&n), "{visible}");
            // The splits cover the context, the last one not empty.
            assert!((n - 1) * per < visible && visible <= n * per, "{visible}");
        }
    }

    /// A plain softmax attention in f64 over explicit key and value rows.
    fn naive(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>]) -> Vec<f32> {
        let hd = q.len();
        let scale = 1.0 / (hd as f64).sqrt();
        let scores: Vec<f64> = keys
            .iter()
            .map(|k| {
                q.iter()
                    .zip(k)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::MIN, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = w.iter().sum();
        (0..hd)
            .map(|d| {
                (w.iter()
                    .zip(values)
                    .map(|(w, v)| w * v[d] as f64)
                    .sum::<f64>()
                    / sum) as f32
            })
            .collect()
    }

    fn value(i: usize) -> f32 {
        ((i * 7919 % 1009) as f32 / 504.5 - 1.0) * 0.5
    }

    /// A decode row over 1,300 positions (three splits) and a prefill of 5 rows after 20 cached
    /// positions, on scattered blocks: each head's output is the plain softmax over the
    /// positions it may see, its KV head shared by its group.
    #[test]
    fn paged_split_and_causal_attention_equal_a_plain_softmax() {
        let layout = KvArena {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
        };
        let shape = AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let (decode_len, prefill_past, prefill_rows) = (1300usize, 20usize, 5usize);
        let decode_blocks: Vec<u32> = (0..decode_len.div_ceil(16) as u32)
            .map(|b| 3 * b + 1)
            .collect();
        let prefill_blocks: Vec<u32> = (0..2u32).map(|b| 3 * b + 2).collect();
        let n_blocks = 3 * decode_blocks.len() + 3;
        let mut arena = vec![f16::ZERO; n_blocks * layout.block_values()];
        let layer = 1;
        let mut kv_rows = |blocks: &[u32], n: usize, seed: usize| -> Vec<[Vec<f32>; 2]> {
            (0..n)
                .map(|p| {
                    let slot = slot_of(blocks, p);
                    let mut pair = [Vec::new(), Vec::new()];
                    for (kind, rows) in pair.iter_mut().enumerate() {
                        for head in 0..2 {
                            let at = layout.index(slot / 16, layer, kind, head, slot as usize % 16);
                            for d in 0..8 {
                                let v =
                                    f16::from_f32(value(seed + p * 97 + kind * 13 + head * 7 + d));
                                arena[at + d] = v;
                                rows.push(v.to_f32());
                            }
                        }
                    }
                    pair
                })
                .collect()
        };
        let decode_kv = kv_rows(&decode_blocks, decode_len, 1);
        let prefill_kv = kv_rows(&prefill_blocks, prefill_past + prefill_rows, 5);
        let rows = 1 + prefill_rows;
        let q: Vec<f32> = (0..rows * 32).map(|i| value(i * 31 + 3) * 2.0).collect();
        let max_blocks = decode_blocks.len();
        let mut block_tables = decode_blocks.clone();
        let mut padded = prefill_blocks.clone();
        padded.resize(max_blocks, *prefill_blocks.last().unwrap_or(&0));
        block_tables.extend(padded);
        let tables = StepTables {
            seqs: vec![
                SeqInfo {
                    row0: 0,
                    rows: 1,
                    past: decode_len as u32 - 1,
                    index: 0,
                },
                SeqInfo {
                    row0: 1,
                    rows: prefill_rows as u32,
                    past: prefill_past as u32,
                    index: 1,
                },
            ],
            block_tables,
            max_blocks,
            ..StepTables::default()
        };
        let mut out = vec![0f32; rows * 32];
        attention(
            &arena,
            layout,
            layer,
            shape,
            &tables,
            &q,
            &mut out,
            usize::MAX,
        );
        let check = |row: usize, kv: &[[Vec<f32>; 2]], visible: usize| {
            for h in 0..4 {
                let kh = h / 2;
                let keys: Vec<Vec<f32>> = kv[..visible]
                    .iter()
                    .map(|p| p[0][kh * 8..kh * 8 + 8].to_vec())
                    .collect();
                let values: Vec<Vec<f32>> = kv[..visible]
                    .iter()
                    .map(|p| p[1][kh * 8..kh * 8 + 8].to_vec())
                    .collect();
                let want = naive(&q[row * 32 + h * 8..row * 32 + h * 8 + 8], &keys, &values);
                let got = &out[row * 32 + h * 8..row * 32 + h * 8 + 8];
                for (a, b) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "row {row} head {h}: {got:?} vs {want:?}"
                    );
                }
            }
        };
        assert_eq!(splits(decode_len), 21);
        check(0, &decode_kv, decode_len);
        for r in 0..prefill_rows {
            check(1 + r, &prefill_kv, prefill_past + r + 1);
        }
    }

    /// The decode kernel's order ([`decode_partial`]: pre-scaled query, 8-dimension lanes added
    /// in a butterfly, one exponential per key against the chunk's running max) gives the split
    /// kernel's partials: splits starting inside the context and ending inside a block, both
    /// head dimensions of the kernel, and the merge of a row's splits equal to the plain
    /// softmax.
    #[test]
    fn the_decode_kernels_order_gives_the_same_partials() {
        for head_dim in [64usize, 128] {
            let layout = KvArena {
                layers: 1,
                kv_heads: 1,
                head_dim,
            };
            let visible = 300usize;
            let blocks: Vec<u32> = (0..visible.div_ceil(16) as u32)
                .map(|b| 2 * b + 1)
                .collect();
            let mut arena = vec![f16::ZERO; (2 * blocks.len() + 2) * layout.block_values()];
            let mut keys = Vec::new();
            let mut values = Vec::new();
            for p in 0..visible {
                let slot = slot_of(&blocks, p);
                let mut pair = [Vec::new(), Vec::new()];
                for (kind, row) in pair.iter_mut().enumerate() {
                    let at = layout.index(slot / 16, 0, kind, 0, slot as usize % 16);
                    for d in 0..head_dim {
                        let v = f16::from_f32(value(p * 131 + kind * 17 + d * 3) * 3.0);
                        arena[at + d] = v;
                        row.push(v.to_f32());
                    }
                }
                let [k, v] = pair;
                keys.push(k);
                values.push(v);
            }
            let q: Vec<f32> = (0..head_dim).map(|d| value(d * 29 + 11) * 2.0).collect();
            for (from, to) in [
                (0, 1),
                (0, 15),
                (0, 16),
                (0, 17),
                (0, 64),
                (64, 100),
                (128, 300),
            ] {
                let want = &partial(&arena, layout, 0, 0, &blocks, &q, 1, from, to)[0];
                let got = decode_partial(&arena, layout, 0, 0, &blocks, &q, from, to);
                assert!(
                    (got.max - want.max).abs() <= 1e-5 * want.max.abs().max(1.0),
                    "{from}..{to}"
                );
                let (mut a, mut b) = (vec![0.0; head_dim], vec![0.0; head_dim]);
                merge(std::slice::from_ref(&got), &mut a);
                merge(std::slice::from_ref(want), &mut b);
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() < 1e-5, "{head_dim} {from}..{to}: {x} vs {y}");
                }
            }
            // A decode row's splits, merged in split order: the plain softmax.
            let per = split_positions(visible);
            let parts: Vec<Partial> = (0..splits(visible))
                .map(|s| {
                    decode_partial(
                        &arena,
                        layout,
                        0,
                        0,
                        &blocks,
                        &q,
                        s * per,
                        ((s + 1) * per).min(visible),
                    )
                })
                .collect();
            assert_eq!(parts.len(), 5);
            let mut out = vec![0.0; head_dim];
            merge(&parts, &mut out);
            let want = naive(&q, &keys, &values);
            for (x, y) in out.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "{head_dim}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn merging_one_partial_divides_by_its_sum() {
        let p = Partial {
            max: 1.0,
            sum: 2.0,
            out: vec![4.0, 6.0],
        };
        let mut out = [0f32; 2];
        merge(&[p], &mut out);
        assert_eq!(out, [2.0, 3.0]);
    }
}
