//! Causal attention over the paged KV cache, on the CPU.
//!
//! Work is cut into tasks of (sequence, KV head, up to 32 query rows, a range of key positions).
//! A task reads its KV head's pages one 16-position block at a time (converted to f32 on the
//! stack-sized scratch once per block, whatever the storage type) and serves every query head of
//! the group (GQA) and every query row from that tile, with an online softmax (running maximum
//! and sum, flash-attention style) so no score vector of the context's length is ever built.
//!
//! When a step has fewer (sequence, KV head, row chunk) tasks than the pool has threads, which is
//! decode with few sequences, long key ranges are split ("split-K") and the partial results
//! (maximum, sum, unnormalised output) are merged afterwards, so one long conversation's decode
//! uses every thread.

use rayon::prelude::*;

use super::kv::{BlockId, CpuKvStorage, KvKind, BLOCK_POSITIONS};

/// One sequence's part of a step, as attention sees it.
pub(crate) struct SeqAttn<'a> {
    pub blocks: &'a [BlockId],
    /// Positions cached before this step; the new rows are positions `past..past + rows`.
    pub past: usize,
    /// First row of this sequence in the step's concatenated rows.
    pub row0: usize,
    pub rows: usize,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Query rows per task (prefill).
const QUERY_ROWS_PER_TASK: usize = 32;
/// Key ranges shorter than this are not split across threads.
const MIN_SPLIT_POSITIONS: usize = 256;

#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
    /// First query row, relative to the sequence's new rows.
    first: usize,
    rows: usize,
    key_start: usize,
    key_end: usize,
}

/// A task's unnormalised result: per (row, head of the group) the running maximum `m`, the sum of
/// `exp(score - m)` and `Σ exp(score - m) · v`.
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

fn plan(shape: AttnShape, seqs: &[SeqAttn<'_>]) -> Vec<Task> {
    let base: usize = seqs
        .iter()
        .map(|s| shape.n_kv_heads * s.rows.div_ceil(QUERY_ROWS_PER_TASK))
        .sum();
    let want = 2 * rayon::current_num_threads();
    let splits = if base >= want {
        1
    } else {
        want.div_ceil(base.max(1))
    };
    let mut tasks = Vec::with_capacity(base * splits);
    for (si, s) in seqs.iter().enumerate() {
        for kv_head in 0..shape.n_kv_heads {
            let mut first = 0;
            while first < s.rows {
                let rows = QUERY_ROWS_PER_TASK.min(s.rows - first);
                let keys = s.past + first + rows;
                let n_split = splits.min(keys / MIN_SPLIT_POSITIONS).max(1);
                let piece = keys
                    .div_ceil(n_split)
                    .next_multiple_of(BLOCK_POSITIONS)
                    .max(BLOCK_POSITIONS);
                let mut key_start = 0;
                while key_start < keys {
                    let key_end = (key_start + piece).min(keys);
                    tasks.push(Task {
                        seq: si,
                        kv_head,
                        first,
                        rows,
                        key_start,
                        key_end,
                    });
                    key_start = key_end;
                }
                first += rows;
            }
        }
    }
    tasks
}

/// Writes `out[row][head]` = softmax(q·K / sqrt(d)) V for every new row of every sequence, each
/// row seeing its own sequence's positions up to and including its own (the new rows' K/V must
/// already be stored).
pub(crate) fn attention(
    shape: AttnShape,
    kv: &CpuKvStorage,
    layer: usize,
    seqs: &[SeqAttn<'_>],
    q: &[f32],
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    let q_dim = shape.n_heads * hd;
    let group = shape.n_heads / shape.n_kv_heads;
    let tasks = plan(shape, seqs);
    let partials: Vec<Partial> = tasks
        .par_iter()
        .map(|t| run_task(shape, kv, layer, &seqs[t.seq], t, q))
        .collect();

    // Merge the splits of each (sequence, KV head, row chunk) and normalise.
    let mut i = 0;
    let mut merged = vec![0f32; hd];
    while i < tasks.len() {
        let t = tasks[i];
        let mut j = i + 1;
        while j < tasks.len()
            && tasks[j].seq == t.seq
            && tasks[j].kv_head == t.kv_head
            && tasks[j].first == t.first
        {
            j += 1;
        }
        let parts = &partials[i..j];
        let s = &seqs[t.seq];
        for r in 0..t.rows {
            let row = s.row0 + t.first + r;
            for g in 0..group {
                let qi = r * group + g;
                let m = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.m[qi]));
                merged.fill(0.0);
                let mut l = 0f32;
                for p in parts {
                    if p.l[qi] == 0.0 {
                        continue;
                    }
                    let c = exp(p.m[qi] - m);
                    l += p.l[qi] * c;
                    axpy(c, &p.acc[qi * hd..(qi + 1) * hd], &mut merged);
                }
                let head = t.kv_head * group + g;
                let o = &mut out[row * q_dim + head * hd..row * q_dim + (head + 1) * hd];
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                for (o, &a) in o.iter_mut().zip(&merged) {
                    *o = a * inv;
                }
            }
        }
        i = j;
    }
}

fn run_task(
    shape: AttnShape,
    kv: &CpuKvStorage,
    layer: usize,
    s: &SeqAttn<'_>,
    t: &Task,
    q: &[f32],
) -> Partial {
    let hd = shape.head_dim;
    let q_dim = shape.n_heads * hd;
    let group = shape.n_heads / shape.n_kv_heads;
    let nq = t.rows * group;
    let scale = 1.0 / (hd as f32).sqrt();

    // The group's queries for these rows, pre-scaled.
    let mut qs = vec![0f32; nq * hd];
    for r in 0..t.rows {
        let row = s.row0 + t.first + r;
        for g in 0..group {
            let head = t.kv_head * group + g;
            let src = &q[row * q_dim + head * hd..row * q_dim + (head + 1) * hd];
            let qi = r * group + g;
            for (d, &v) in qs[qi * hd..(qi + 1) * hd].iter_mut().zip(src) {
                *d = v * scale;
            }
        }
    }
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0f32; nq];
    let mut acc = vec![0f32; nq * hd];
    let mut kbuf = vec![0f32; BLOCK_POSITIONS * hd];
    let mut vbuf = vec![0f32; BLOCK_POSITIONS * hd];
    let mut scores = [0f32; BLOCK_POSITIONS];

    // The last row sees up to its own position.
    let end = t.key_end.min(s.past + t.first + t.rows);
    let mut b = t.key_start / BLOCK_POSITIONS;
    while b * BLOCK_POSITIONS < end {
        let pos0 = b * BLOCK_POSITIONS;
        let lo = t.key_start.max(pos0);
        let hi = end.min(pos0 + BLOCK_POSITIONS);
        let Some(&block) = s.blocks.get(b) else {
            // The engine reserves every block before a step; a missing one is a bug upstream,
            // and reading nothing is safer than reading another sequence's page.
            break;
        };
        // Start loading the next block while this one is computed (see `CpuKvStorage::prefetch`).
        if (b + 2) * BLOCK_POSITIONS < end {
            if let Some(&next) = s.blocks.get(b + 2) {
                kv.prefetch(next, layer, t.kv_head);
            }
        }
        let n = hi - pos0;
        let keys = kv.tile(block, layer, t.kv_head, KvKind::K, n, &mut kbuf);
        let values = kv.tile(block, layer, t.kv_head, KvKind::V, n, &mut vbuf);
        for r in 0..t.rows {
            let row_end = hi.min(s.past + t.first + r + 1);
            if row_end <= lo {
                continue;
            }
            let cnt = row_end - lo;
            let k0 = lo - pos0;
            for g in 0..group {
                let qi = r * group + g;
                let qv = &qs[qi * hd..(qi + 1) * hd];
                dots(qv, &keys[k0 * hd..(k0 + cnt) * hd], &mut scores[..cnt]);
                // A plain comparison, not `f32::max`: scores are finite, and `max`'s NaN rule
                // kept this loop scalar.
                let block_max =
                    scores[..cnt]
                        .iter()
                        .fold(f32::NEG_INFINITY, |m, &s| if s > m { s } else { m });
                let a = &mut acc[qi * hd..(qi + 1) * hd];
                if block_max > m[qi] {
                    // Rescale what was accumulated under the old maximum (a no-op the first time,
                    // when everything is still zero).
                    let c = exp(m[qi] - block_max);
                    l[qi] *= c;
                    for x in a.iter_mut() {
                        *x *= c;
                    }
                    m[qi] = block_max;
                }
                // All 16 lanes at once so the exponentials vectorise; lanes past `cnt` are ignored.
                let mut p = [0f32; BLOCK_POSITIONS];
                let mq = m[qi];
                for (pj, &sc) in p.iter_mut().zip(&scores) {
                    *pj = exp(sc - mq);
                }
                // Lanes past `cnt` are zeroed so the sum can take all 16 as a tree.
                for pj in &mut p[cnt..] {
                    *pj = 0.0;
                }
                l[qi] += sum16(&p);
                weighted_sum(&p[..cnt], &values[k0 * hd..(k0 + cnt) * hd], a);
            }
        }
        b += 1;
    }
    Partial { m, l, acc }
}

/// The sum of 16 values as a pairwise tree, which vectorises (a running sum cannot be reordered).
#[inline(always)]
fn sum16(p: &[f32; BLOCK_POSITIONS]) -> f32 {
    let mut h = [0f32; 8];
    for i in 0..8 {
        h[i] = p[i] + p[i + 8];
    }
    let mut q = [0f32; 4];
    for i in 0..4 {
        q[i] = h[i] + h[i + 4];
    }
    (q[0] + q[2]) + (q[1] + q[3])
}

/// `e^x` to about 1 ulp (Cephes' `expf`: `x = n ln 2 + r`, a degree-6 polynomial in `r`, then
/// `2^n` through the exponent bits), written without branches so loops over it vectorise; libm's
/// `expf` per score was the largest cost of attention at long contexts. Inputs below -87.3 give
/// about 1e-38 instead of 0 (a weight nobody can see next to the row's maximum, which is 1).
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n through the exponent bits. Adding 1.5 * 2^23 leaves the integer n in the low mantissa
    // bits, which avoids `as i32` (a saturating conversion that keeps the loop scalar).
    let n_bits = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000);
    y * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// `out[j] = q · keys[j]` for consecutive rows of `q.len()` values, with AVX2/FMA (the build's
/// baseline, see `.cargo/config.toml`). Eight keys at a time: each key's eight-lane partial sums
/// stay in a register, and the eight registers are reduced together by a transposing
/// horizontal-add tree (8 instructions for 8 sums instead of ~5 per sum), which was the largest
/// cost of decode attention at long contexts after the memory stalls. Other shapes and targets
/// take the portable code.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline]
fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = q.len();
    if !hd.is_multiple_of(8) || keys.len() < out.len() * hd {
        return dots_portable(q, keys, out);
    }
    /// # Safety
    /// Needs AVX (enabled for the whole build, see the cfg on `dots`).
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
    let qp = q.as_ptr();
    let kp = keys.as_ptr();
    let op = out.as_mut_ptr();
    let mut j = 0;
    // SAFETY: AVX2 and FMA are enabled for the whole build (cfg above). Every load reads 8 floats
    // at `d < hd` (hd a multiple of 8) of `q` or of key row `j < out.len()`, and `keys` holds
    // `out.len() * hd` floats (checked above); the store writes `out[j..j + 8]` with
    // `j + 8 <= out.len()`.
    unsafe {
        while j + 8 <= out.len() {
            let k = kp.add(j * hd);
            let mut a = [_mm256_setzero_ps(); 8];
            let mut d = 0;
            while d < hd {
                let x = _mm256_loadu_ps(qp.add(d));
                for (i, a) in a.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(x, _mm256_loadu_ps(k.add(i * hd + d)), *a);
                }
                d += 8;
            }
            // hadd(a0, a1) = [a0 01, a0 23, a1 01, a1 23 | a0 45, a0 67, a1 45, a1 67]; two more
            // levels leave lane i of each 128-bit half holding half of key i's sum.
            let t0 = _mm256_hadd_ps(a[0], a[1]);
            let t1 = _mm256_hadd_ps(a[2], a[3]);
            let t2 = _mm256_hadd_ps(a[4], a[5]);
            let t3 = _mm256_hadd_ps(a[6], a[7]);
            let u0 = _mm256_hadd_ps(t0, t1);
            let u1 = _mm256_hadd_ps(t2, t3);
            let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
            let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
            _mm256_storeu_ps(op.add(j), _mm256_add_ps(lo, hi));
            j += 8;
        }
        while j < out.len() {
            let k = kp.add(j * hd);
            let mut a = _mm256_setzero_ps();
            let mut d = 0;
            while d < hd {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(d)), _mm256_loadu_ps(k.add(d)), a);
                d += 8;
            }
            out[j] = hsum(a);
            j += 1;
        }
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
#[inline]
fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
    dots_portable(q, keys, out)
}

/// `a += Σ_j p[j] · values[j]`. Eight dimensions at a time held in a register across all the keys
/// of the tile (one load and one FMA per key), instead of loading and storing `a` once per key.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline]
fn weighted_sum(p: &[f32], values: &[f32], a: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = a.len();
    if !hd.is_multiple_of(8) || values.len() < p.len() * hd {
        return weighted_sum_portable(p, values, a);
    }
    let vp = values.as_ptr();
    let ap = a.as_mut_ptr();
    // SAFETY: AVX2/FMA are enabled for the whole build; loads and stores touch `a[d..d + 8]` and
    // `values[j * hd + d..][..8]` with `d < hd` (a multiple of 8) and `j < p.len()`, inside the
    // slices (lengths checked above).
    unsafe {
        // Four registers (32 dimensions) at a time: four independent FMA chains per key hide the
        // FMA latency that a single running register would wait on.
        let mut d = 0;
        while d + 32 <= hd {
            let mut acc = [
                _mm256_loadu_ps(ap.add(d)),
                _mm256_loadu_ps(ap.add(d + 8)),
                _mm256_loadu_ps(ap.add(d + 16)),
                _mm256_loadu_ps(ap.add(d + 24)),
            ];
            for (j, &pj) in p.iter().enumerate() {
                let w = _mm256_set1_ps(pj);
                let v = vp.add(j * hd + d);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(8 * i)), *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(ap.add(d + 8 * i), *a);
            }
            d += 32;
        }
        while d < hd {
            let mut acc = _mm256_loadu_ps(ap.add(d));
            for (j, &pj) in p.iter().enumerate() {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(pj), _mm256_loadu_ps(vp.add(j * hd + d)), acc);
            }
            _mm256_storeu_ps(ap.add(d), acc);
            d += 8;
        }
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
#[inline]
fn weighted_sum(p: &[f32], values: &[f32], a: &mut [f32]) {
    weighted_sum_portable(p, values, a)
}

fn weighted_sum_portable(p: &[f32], values: &[f32], a: &mut [f32]) {
    let hd = a.len();
    for (j, &pj) in p.iter().enumerate() {
        axpy(pj, &values[j * hd..(j + 1) * hd], a);
    }
}

/// Portable [`dots`]: four keys at a time, eight lanes of accumulators each.
fn dots_portable(q: &[f32], keys: &[f32], out: &mut [f32]) {
    let hd = q.len();
    let lanes = hd / 8 * 8;
    let mut quads = out.chunks_exact_mut(4);
    let mut j = 0;
    for o in &mut quads {
        let k = &keys[j * hd..(j + 4) * hd];
        let (k0, rest) = k.split_at(hd);
        let (k1, rest) = rest.split_at(hd);
        let (k2, k3) = rest.split_at(hd);
        let mut a = [[0f32; 8]; 4];
        for c in (0..lanes).step_by(8) {
            for l in 0..8 {
                let x = q[c + l];
                a[0][l] += x * k0[c + l];
                a[1][l] += x * k1[c + l];
                a[2][l] += x * k2[c + l];
                a[3][l] += x * k3[c + l];
            }
        }
        for (i, (acc, key)) in a.iter().zip([k0, k1, k2, k3]).enumerate() {
            let mut s: f32 = acc.iter().sum();
            for d in lanes..hd {
                s += q[d] * key[d];
            }
            o[i] = s;
        }
        j += 4;
    }
    for o in quads.into_remainder() {
        *o = dot(q, &keys[j * hd..(j + 1) * hd]);
        j += 1;
    }
}

/// Dot product with sixteen independent accumulators (two AVX registers' worth), so the compiler
/// vectorises it and the additions do not wait on each other.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = a.len() / 16;
    for c in 0..chunks {
        let (x, y) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 16..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[inline]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += alpha * v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv::{BlockAllocator, BlockTable, KvLayout, KvType};

    /// The plain two-pass softmax attention of one query row against `n` keys.
    fn reference(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>]) -> Vec<f32> {
        let scale = 1.0 / (q.len() as f32).sqrt();
        let s: Vec<f64> = k
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>() * scale as f64)
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = p.iter().sum();
        let mut o = vec![0f64; q.len()];
        for (pi, vi) in p.iter().zip(v) {
            for (o, &x) in o.iter_mut().zip(vi) {
                *o += pi / sum * x as f64;
            }
        }
        o.into_iter().map(|x| x as f32).collect()
    }

    fn value(i: usize, salt: usize) -> f32 {
        (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0 - 1.0) * 2.0
    }

    /// Decode rows over a context long enough to be split across threads (and prefill rows in
    /// chunks) agree with a float64 two-pass softmax, for every storage type.
    #[test]
    fn paged_online_softmax_matches_two_pass_reference() {
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 32,
        };
        let hd = shape.head_dim;
        let n = 1000; // positions; the last 40 are "new" rows
        let new = 40;
        let past = n - new;
        for t in KvType::ALL {
            let layout = KvLayout {
                kv_type: t,
                n_layers: 1,
                n_kv_heads: 2,
                head_dim: hd,
            };
            let mut alloc = BlockAllocator::with_capacity(1000, layout.bytes_per_block());
            let mut table = BlockTable::new();
            alloc.grow(&mut table, n).expect("grow");
            let mut kv = CpuKvStorage::new(layout);
            kv.ensure(alloc.high_water());
            // Keys/values as stored (read back, so the reference sees the same rounding).
            let mut keys = vec![Vec::new(); 2];
            let mut values = vec![Vec::new(); 2];
            let mut scratch = vec![0f32; BLOCK_POSITIONS * hd];
            for kh in 0..2 {
                for p in 0..n {
                    let kr: Vec<f32> = (0..hd).map(|d| value(p * hd + d, kh)).collect();
                    let vr: Vec<f32> = (0..hd).map(|d| value(p * hd + d, kh + 7)).collect();
                    let b = table.blocks()[p / BLOCK_POSITIONS];
                    let slot = p % BLOCK_POSITIONS;
                    kv.write(b, slot, 0, kh, KvKind::K, &kr);
                    kv.write(b, slot, 0, kh, KvKind::V, &vr);
                }
                for p in 0..n {
                    let b = table.blocks()[p / BLOCK_POSITIONS];
                    let slot = p % BLOCK_POSITIONS;
                    let k = kv.tile(b, 0, kh, KvKind::K, slot + 1, &mut scratch);
                    keys[kh].push(k[slot * hd..(slot + 1) * hd].to_vec());
                    let v = kv.tile(b, 0, kh, KvKind::V, slot + 1, &mut scratch);
                    values[kh].push(v[slot * hd..(slot + 1) * hd].to_vec());
                }
            }
            let q: Vec<f32> = (0..new * 4 * hd).map(|i| value(i, 3) * 0.5).collect();
            // Both as one prefill chunk of 40 rows and as a single decode row.
            for (rows, past) in [(new, past), (1, n - 1)] {
                let seqs = [SeqAttn {
                    blocks: table.blocks(),
                    past,
                    row0: 0,
                    rows,
                }];
                let mut out = vec![0f32; rows * 4 * hd];
                attention(shape, &kv, 0, &seqs, &q[..rows * 4 * hd], &mut out);
                for r in 0..rows {
                    for h in 0..4 {
                        let kh = h / 2;
                        let visible = past + r + 1;
                        let qv = &q[(r * 4 + h) * hd..(r * 4 + h + 1) * hd];
                        let want = reference(qv, &keys[kh][..visible], &values[kh][..visible]);
                        let got = &out[(r * 4 + h) * hd..(r * 4 + h + 1) * hd];
                        for (g, w) in got.iter().zip(&want) {
                            assert!((g - w).abs() < 1e-4, "{t} row {r} head {h}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }

    /// The SIMD kernels agree with plain f64 sums, for every tile length and for head dimensions
    /// that do (64) and do not (36) fill whole registers.
    #[test]
    fn dot_and_weighted_sum_kernels_match_plain_sums() {
        for hd in [64usize, 36] {
            let q: Vec<f32> = (0..hd).map(|i| value(i, 1)).collect();
            let keys: Vec<f32> = (0..16 * hd).map(|i| value(i, 2)).collect();
            for cnt in 1..=16 {
                let mut out = vec![0f32; cnt];
                dots(&q, &keys[..cnt * hd], &mut out);
                for (j, &o) in out.iter().enumerate() {
                    let want: f64 = (0..hd).map(|d| q[d] as f64 * keys[j * hd + d] as f64).sum();
                    assert!((o as f64 - want).abs() < 1e-4, "hd {hd} cnt {cnt} key {j}");
                }
                let p: Vec<f32> = (0..cnt).map(|j| value(j, 5).abs()).collect();
                let mut a: Vec<f32> = (0..hd).map(|i| value(i, 9)).collect();
                let start = a.clone();
                weighted_sum(&p, &keys[..cnt * hd], &mut a);
                for d in 0..hd {
                    let want = start[d] as f64
                        + (0..cnt)
                            .map(|j| p[j] as f64 * keys[j * hd + d] as f64)
                            .sum::<f64>();
                    assert!(
                        (a[d] as f64 - want).abs() < 1e-4,
                        "hd {hd} cnt {cnt} dim {d}"
                    );
                }
            }
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -90.0f32;
        while x < 20.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            if want > 1e-37 {
                worst = worst.max((got - want).abs() / want);
            } else {
                assert!(got < 2e-37, "{x}: {got}");
            }
            x += 0.0137;
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 2e-38);
    }

    #[test]
    fn long_decode_is_split_and_short_is_not() {
        let shape = AttnShape {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
        };
        let blocks: Vec<BlockId> = (0..256).collect();
        let long = [SeqAttn {
            blocks: &blocks,
            past: 4095,
            row0: 0,
            rows: 1,
        }];
        let tasks = plan(shape, &long);
        let threads = rayon::current_num_threads();
        if threads > 1 {
            assert!(
                tasks.len() > 3,
                "{} tasks for {threads} threads",
                tasks.len()
            );
        }
        // Key ranges tile 0..4096 per head without gaps or overlaps, at block boundaries.
        for kh in 0..3 {
            let mut at = 0;
            for t in tasks.iter().filter(|t| t.kv_head == kh) {
                assert_eq!(t.key_start, at);
                assert_eq!(t.key_start % BLOCK_POSITIONS, 0);
                at = t.key_end;
            }
            assert_eq!(at, 4096);
        }
        let short = [SeqAttn {
            blocks: &blocks,
            past: 100,
            row0: 0,
            rows: 1,
        }];
        assert_eq!(plan(shape, &short).len(), 3);
    }

    /// Decode attention speed at long contexts (not a check: `cargo test --release --lib
    /// decode_attention_speed -- --ignored --nocapture`). One token's attention over every layer
    /// of a SmolLM2-135M-shaped (and a SmolLM3-3B-shaped) cache of 4096 positions, on a pool of
    /// `ATTN_BENCH_THREADS` (default 2) threads; best and median of the repetitions, and the KV
    /// bytes read per token over the best time. In-process best-of timing, because on a shared
    /// machine whole-model runs swing by 2× while the best of many short runs barely moves.
    #[test]
    #[ignore]
    fn decode_attention_speed() {
        let threads: usize = std::env::var("ATTN_BENCH_THREADS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2);
        let reps: usize = std::env::var("ATTN_BENCH_REPS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(40);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        let ctx = 4096;
        for (name, shape, n_layers) in [
            (
                "smollm2-135m",
                AttnShape {
                    n_heads: 9,
                    n_kv_heads: 3,
                    head_dim: 64,
                },
                30,
            ),
            (
                "smollm3-3b",
                AttnShape {
                    n_heads: 16,
                    n_kv_heads: 4,
                    head_dim: 128,
                },
                36,
            ),
        ] {
            for t in [KvType::F16, KvType::Q8_0, KvType::F32] {
                let hd = shape.head_dim;
                let layout = KvLayout {
                    kv_type: t,
                    n_layers,
                    n_kv_heads: shape.n_kv_heads,
                    head_dim: hd,
                };
                let mut alloc = BlockAllocator::with_capacity(1 << 16, layout.bytes_per_block());
                let mut table = BlockTable::new();
                alloc.grow(&mut table, ctx).expect("grow");
                let mut kv = CpuKvStorage::new(layout);
                kv.ensure(alloc.high_water());
                let mut row = vec![0f32; hd];
                for p in 0..ctx {
                    let b = table.blocks()[p / BLOCK_POSITIONS];
                    for layer in 0..n_layers {
                        for kh in 0..shape.n_kv_heads {
                            for (kind, salt) in [(KvKind::K, 1), (KvKind::V, 2)] {
                                for (d, x) in row.iter_mut().enumerate() {
                                    *x = value(p * hd + d + layer, kh + salt) * 0.5;
                                }
                                kv.write(b, p % BLOCK_POSITIONS, layer, kh, kind, &row);
                            }
                        }
                    }
                }
                let q: Vec<f32> = (0..shape.n_heads * hd).map(|i| value(i, 5)).collect();
                let mut out = vec![0f32; shape.n_heads * hd];
                let seqs = [SeqAttn {
                    blocks: table.blocks(),
                    past: ctx - 1,
                    row0: 0,
                    rows: 1,
                }];
                let mut times = Vec::with_capacity(reps);
                pool.install(|| {
                    for _ in 0..reps {
                        let t0 = std::time::Instant::now();
                        for layer in 0..n_layers {
                            attention(shape, &kv, layer, &seqs, &q, &mut out);
                        }
                        times.push(t0.elapsed().as_secs_f64());
                    }
                });
                times.sort_by(f64::total_cmp);
                let bytes = ctx as f64 * layout.bytes_per_position() as f64;
                println!(
                    "{name} {t} ctx {ctx} threads {threads}: best {:.3} ms, median {:.3} ms per token, {:.1} GB/s (KV {:.1} MB)",
                    times[0] * 1e3,
                    times[reps / 2] * 1e3,
                    bytes / times[0] / 1e9,
                    bytes / 1e6
                );
            }
        }
    }
}
