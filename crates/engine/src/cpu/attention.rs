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

use std::sync::OnceLock;

use rayon::prelude::*;

use super::kv::{CpuKvStorage, Page, CHUNK_BLOCKS};
use super::math::exp;
use crate::kv::{BlockId, KvKind, BLOCK_POSITIONS};

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

/// How decode attention prefetches the KV pages. Decided once per process: by
/// `SMOLCHAT_DECODE_PREFETCH` (`eager` or `lazy`) when set, so that one machine can compare the
/// two, else by `model.decode_prefetch` (or `--decode-prefetch`) when configured, else by the
/// size of the L1 data cache.
///
/// Why two: the measured cores disagree. On Zen 5 (48 KiB L1D) prefetching every line of the
/// next block's K and V pages into L1 made decode attention from memory 20–35% faster
/// (SmolLM2 and SmolLM3-3B shapes, f16 and q8_0, 4096 positions; whole SmolLM2 decode at 4096
/// +16–26%), because the step's arithmetic and the page loads then overlap instead of adding up.
/// On Zen 4 (32 KiB L1D) the same done two blocks ahead was up to a quarter slower (3B shape,
/// f16: 17–20 ms a token without, 22–26 with, the prefetch loops stalled on full miss buffers),
/// so cores with a smaller L1D keep prefetching only where the hardware prefetcher cannot follow.
/// The cache size is a proxy that separates the cores measured, not a law: other cores need
/// measuring (docs/BENCHMARKS.md, `decode_attention_speed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodePrefetch {
    /// Every line of the next block's pages, one block ahead.
    Eager,
    /// Only at chunk starts and non-consecutive block ids, two blocks ahead.
    Lazy,
}

/// The environment variable that forces [`DecodePrefetch`].
const DECODE_PREFETCH_VARIABLE: &str = "SMOLCHAT_DECODE_PREFETCH";

/// The L1 data cache size from which [`DecodePrefetch::Eager`] is the default.
const EAGER_PREFETCH_MIN_L1D: usize = 48 << 10;

/// The configured choice ([`configure_decode_prefetch`]), read when the choice is first made.
static CONFIGURED_PREFETCH: OnceLock<Option<DecodePrefetch>> = OnceLock::new();

/// Records the configured prefetch choice (`None`: by cache size). Only the first call counts,
/// and only before the first decode step; the environment variable still overrides it.
pub fn configure_decode_prefetch(choice: Option<DecodePrefetch>) {
    if CONFIGURED_PREFETCH.set(choice).is_err() && CONFIGURED_PREFETCH.get() != Some(&choice) {
        tracing::warn!(
            ?choice,
            "the decode prefetch choice was already made for this process; ignored"
        );
    }
}

impl DecodePrefetch {
    fn get() -> DecodePrefetch {
        static CHOICE: OnceLock<DecodePrefetch> = OnceLock::new();
        *CHOICE.get_or_init(|| {
            let forced = std::env::var(DECODE_PREFETCH_VARIABLE).ok();
            let configured = CONFIGURED_PREFETCH.get().copied().flatten();
            let l1d = l1d_bytes();
            let choice = DecodePrefetch::choose(forced.as_deref(), configured, l1d);
            tracing::info!(prefetch = ?choice, l1d_bytes = ?l1d, "decode attention");
            choice
        })
    }

    /// The choice for a forced name (`eager`, `lazy`; anything else is ignored with a warning),
    /// the configured choice and the L1D size, when known, in that order of precedence.
    fn choose(
        forced: Option<&str>,
        configured: Option<DecodePrefetch>,
        l1d: Option<usize>,
    ) -> DecodePrefetch {
        if let Some(name) = forced {
            match name.parse() {
                Ok(choice) => return choice,
                Err(e) => tracing::warn!("{DECODE_PREFETCH_VARIABLE}: {e}; ignored"),
            }
        }
        if let Some(choice) = configured {
            return choice;
        }
        if l1d.is_some_and(|b| b >= EAGER_PREFETCH_MIN_L1D) {
            DecodePrefetch::Eager
        } else {
            DecodePrefetch::Lazy
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DecodePrefetch::Eager => "eager",
            DecodePrefetch::Lazy => "lazy",
        }
    }
}

impl std::str::FromStr for DecodePrefetch {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "eager" => Ok(DecodePrefetch::Eager),
            "lazy" => Ok(DecodePrefetch::Lazy),
            other => Err(format!(
                "decode prefetch `{other}` is not one of eager, lazy"
            )),
        }
    }
}

impl std::fmt::Display for DecodePrefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

crate::serde_via_str!(DecodePrefetch);

/// The L1 data cache of this CPU in bytes, where the C library knows it.
fn l1d_bytes() -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `sysconf` only reads a configuration value.
        let n = unsafe { libc::sysconf(libc::_SC_LEVEL1_DCACHE_SIZE) };
        usize::try_from(n).ok().filter(|&n| n > 0)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
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

    // The group's queries for these rows, pre-scaled; query `r * group + g` is head g of row r,
    // so one row's heads are consecutive (the kernels take them as one slice).
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
    let simd = simd::supported(group, hd);

    // The last row sees up to its own position.
    let end = t.key_end.min(s.past + t.first + t.rows);
    let eager_prefetch = t.rows == 1 && DecodePrefetch::get() == DecodePrefetch::Eager;
    let mut b = t.key_start / BLOCK_POSITIONS;
    while b * BLOCK_POSITIONS < end {
        let pos0 = b * BLOCK_POSITIONS;
        // `plan` starts every key range at a block boundary, so a task's keys in this block are
        // its first `cnt` positions.
        let lo = t.key_start.max(pos0);
        let hi = end.min(pos0 + BLOCK_POSITIONS);
        let Some(&block) = s.blocks.get(b) else {
            // The engine reserves every block before a step; a missing one is a bug upstream,
            // and reading nothing is safer than reading another sequence's page.
            break;
        };
        // Start loading a block ahead. In decode, where the CPU takes it (see
        // `DecodePrefetch`), every line of the next block's pages; otherwise only where the
        // hardware prefetcher cannot follow: at the start of another chunk of storage, or when
        // block ids are not consecutive (reused from the free list). Within a chunk the pages of
        // consecutive ids are one contiguous run that the hardware streams by itself.
        if eager_prefetch {
            if let Some(&next) = s
                .blocks
                .get(b + 1)
                .filter(|_| (b + 1) * BLOCK_POSITIONS < end)
            {
                kv.prefetch(next, layer, t.kv_head);
            }
        } else if (b + 2) * BLOCK_POSITIONS < end {
            if let (Some(&prev), Some(&next)) = (s.blocks.get(b + 1), s.blocks.get(b + 2)) {
                let contiguous =
                    next == prev.wrapping_add(1) && !(next as usize).is_multiple_of(CHUNK_BLOCKS);
                if !contiguous {
                    kv.prefetch(next, layer, t.kv_head);
                }
            }
        }
        if simd && t.rows == 1 && lo == pos0 {
            // Decode: one row, whose heads read the stored pages directly, each K and V vector
            // loaded (and converted) once for all the heads of the group.
            let k = kv.page(block, layer, t.kv_head, KvKind::K);
            let v = kv.page(block, layer, t.kv_head, KvKind::V);
            let row = Row {
                q: &qs,
                m: &mut m,
                l: &mut l,
                acc: &mut acc,
            };
            if simd::block(group, hd, &k, &v, hi - lo, row) {
                b += 1;
                continue;
            }
        }
        // Several rows (prefill): convert the block once and serve every row from the tiles.
        let n = hi - pos0;
        let keys = kv.tile(block, layer, t.kv_head, KvKind::K, n, &mut kbuf);
        let values = kv.tile(block, layer, t.kv_head, KvKind::V, n, &mut vbuf);
        let (kt, vt) = (Page::F32(keys), Page::F32(values));
        for r in 0..t.rows {
            let row_end = hi.min(s.past + t.first + r + 1);
            if row_end <= lo {
                continue;
            }
            let cnt = row_end - lo;
            let k0 = lo - pos0;
            let heads = r * group..(r + 1) * group;
            let row = Row {
                q: &qs[heads.start * hd..heads.end * hd],
                m: &mut m[heads.clone()],
                l: &mut l[heads.clone()],
                acc: &mut acc[heads.start * hd..heads.end * hd],
            };
            if k0 == 0 && simd && simd::block(group, hd, &kt, &vt, cnt, row) {
                continue;
            }
            let row = Row {
                q: &qs[heads.start * hd..heads.end * hd],
                m: &mut m[heads.clone()],
                l: &mut l[heads.clone()],
                acc: &mut acc[heads.start * hd..heads.end * hd],
            };
            block_portable(hd, keys, values, k0, cnt, row);
        }
        b += 1;
    }
    Partial { m, l, acc }
}

/// One query row's state for the heads of its group: `q` (pre-scaled), running maxima `m`,
/// sums `l` and unnormalised outputs `acc`, head after head.
struct Row<'a> {
    q: &'a [f32],
    m: &'a mut [f32],
    l: &'a mut [f32],
    acc: &'a mut [f32],
}

/// The online-softmax step of one row over keys `k0..k0 + cnt` of a block, from f32 tiles (keys
/// transposed `[dim][16]`, values row by row): the reference the SIMD kernel is tested against,
/// and the path for shapes and targets it does not cover.
fn block_portable(hd: usize, keys: &[f32], values: &[f32], k0: usize, cnt: usize, row: Row<'_>) {
    let group = row.m.len();
    for g in 0..group {
        let qv = &row.q[g * hd..(g + 1) * hd];
        let mut scores = [0f32; BLOCK_POSITIONS];
        dots_transposed(qv, keys, &mut scores);
        // A plain comparison, not `f32::max`: scores are finite, and `max`'s NaN rule kept this
        // loop scalar.
        let block_max = scores[k0..k0 + cnt]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &s| if s > m { s } else { m });
        let a = &mut row.acc[g * hd..(g + 1) * hd];
        if block_max > row.m[g] {
            // Rescale what was accumulated under the old maximum (a no-op the first time, when
            // everything is still zero).
            let c = exp(row.m[g] - block_max);
            row.l[g] *= c;
            for x in a.iter_mut() {
                *x *= c;
            }
            row.m[g] = block_max;
        }
        // All 16 lanes at once so the exponentials vectorise; lanes outside the keys are zeroed
        // so the sum can take all 16 as a tree.
        let mut p = [0f32; BLOCK_POSITIONS];
        let mq = row.m[g];
        for (j, (pj, &sc)) in p.iter_mut().zip(&scores).enumerate() {
            *pj = if j >= k0 && j < k0 + cnt {
                exp(sc - mq)
            } else {
                0.0
            };
        }
        row.l[g] += sum16(&p);
        for (j, &pj) in p.iter().enumerate().skip(k0).take(cnt) {
            axpy(pj, &values[j * hd..(j + 1) * hd], a);
        }
    }
}

/// `out[j] = q · k_j` for the 16 positions of a transposed key tile (`keys[d * 16 + j]`): the 16
/// positions are the vector lanes, so this vectorises without any horizontal sum.
fn dots_transposed(q: &[f32], keys: &[f32], out: &mut [f32; BLOCK_POSITIONS]) {
    *out = [0f32; BLOCK_POSITIONS];
    for (&x, k) in q.iter().zip(keys.chunks_exact(BLOCK_POSITIONS)) {
        for (o, &k) in out.iter_mut().zip(k) {
            *o += x * k;
        }
    }
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

/// The AVX2/FMA/F16C attention step (the build's baseline, see `.cargo/config.toml`): one query
/// row, all heads of its KV group, one block of 16 positions, read straight from the stored
/// page (f32, f16 or q8_0) or from f32 tiles.
///
/// Why this shape: at long contexts decode attention streams the whole KV cache per token, and
/// the earlier kernel (convert each page into an f32 tile, then per head one horizontal sum per
/// key and a reload of the tile) ran at about 19 GB/s, well below what the weights stream at.
/// Here keys are stored transposed, so the scores of 16 positions are two registers built by
/// `q[d]`-broadcast FMAs, with no horizontal sum; each 16-position K vector and each value row
/// is loaded and converted once and used by every head of the group (register-level GQA); the
/// softmax (mask, maximum, exponentials, sum) runs on those registers; and the rescale by the
/// new maximum is folded into loading the accumulators for the value sum.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod simd {
    use std::arch::x86_64::*;

    use super::{Page, Row, BLOCK_POSITIONS};
    use crate::kv::Q8_0_BLOCK;

    /// Value dimensions per accumulator set: 8 lanes × `w` registers × `group` heads stay in
    /// registers across a block's positions, beside `w` converted value vectors and `group`
    /// broadcast weights; AVX2 has 16 registers. A chunk never straddles a q8_0 scale block
    /// (`8w` divides 32). Group 3 (SmolLM2) takes 2, not 4: 12 accumulators + 4 values + 3
    /// weights are more than 16 registers, and with one layer's cache in L3 the step ran 1.3–1.4× faster at 2 (three
    /// alternating rounds; from memory the two tied within the noise).
    const fn width(group: usize) -> usize {
        match group {
            1..=2 => 4,
            3..=6 => 2,
            _ => 1,
        }
    }

    /// Whether [`block`] handles this group size and head dimension.
    pub(super) fn supported(group: usize, hd: usize) -> bool {
        (1..=8).contains(&group) && hd.is_multiple_of(8 * width(group))
    }

    /// One online-softmax step of `row` over the first `cnt` positions of the block whose keys
    /// are `k` and values `v` (same storage type; f32 tiles come as `Page::F32`). Returns false,
    /// having done nothing, when the shape or the pages are not what this kernel reads.
    pub(super) fn block(
        group: usize,
        hd: usize,
        k: &Page<'_>,
        v: &Page<'_>,
        cnt: usize,
        row: Row<'_>,
    ) -> bool {
        let np = BLOCK_POSITIONS;
        if !supported(group, hd)
            || cnt == 0
            || cnt > np
            || row.q.len() < group * hd
            || row.acc.len() < group * hd
            || row.m.len() < group
            || row.l.len() < group
        {
            return false;
        }
        // Every load below stays inside these lengths: keys at `d * 16 + 0..16` for d < hd,
        // values at `j * hd + d..+8` for j < cnt, q8_0 scales at `b * 16 + 0..16` for b < hd / 32.
        match (k, v) {
            (Page::F32(k), Page::F32(v)) if k.len() >= np * hd && v.len() >= cnt * hd => {
                let src = F32Src {
                    k: k.as_ptr(),
                    v: v.as_ptr(),
                    hd,
                };
                // SAFETY: lengths checked above; AVX2/FMA/F16C are enabled for the build.
                unsafe { dispatch(group, &src, hd, cnt, row) };
                true
            }
            (Page::F16(k), Page::F16(v)) if k.len() >= np * hd && v.len() >= cnt * hd => {
                let src = F16Src {
                    k: k.as_ptr(),
                    v: v.as_ptr(),
                    hd,
                };
                // SAFETY: as above.
                unsafe { dispatch(group, &src, hd, cnt, row) };
                true
            }
            (
                Page::Q8 {
                    scales: ks,
                    quants: kq,
                },
                Page::Q8 {
                    scales: vs,
                    quants: vq,
                },
            ) if hd.is_multiple_of(Q8_0_BLOCK)
                && kq.len() >= np * hd
                && vq.len() >= cnt * hd
                && ks.len() >= np * (hd / Q8_0_BLOCK)
                && vs.len() >= np * (hd / Q8_0_BLOCK) =>
            {
                let src = Q8Src {
                    ks: ks.as_ptr(),
                    kq: kq.as_ptr(),
                    vs: vs.as_ptr(),
                    vq: vq.as_ptr(),
                    hd,
                };
                // SAFETY: as above.
                unsafe { dispatch(group, &src, hd, cnt, row) };
                true
            }
            _ => false,
        }
    }

    /// # Safety
    /// `src` must cover the loads described in [`block`]; `row` holds `group` heads.
    #[inline(always)]
    unsafe fn dispatch<L: Load>(group: usize, src: &L, hd: usize, cnt: usize, row: Row<'_>) {
        match group {
            1 => step::<1, { width(1) }, L>(src, hd, cnt, row),
            2 => step::<2, { width(2) }, L>(src, hd, cnt, row),
            3 => step::<3, { width(3) }, L>(src, hd, cnt, row),
            4 => step::<4, { width(4) }, L>(src, hd, cnt, row),
            5 => step::<5, { width(5) }, L>(src, hd, cnt, row),
            6 => step::<6, { width(6) }, L>(src, hd, cnt, row),
            7 => step::<7, { width(7) }, L>(src, hd, cnt, row),
            _ => step::<8, { width(8) }, L>(src, hd, cnt, row),
        }
    }

    /// Reads one block's pages as f32 vectors.
    trait Load {
        /// q8_0: keys and values are quants, to be multiplied by their scales.
        const Q8: bool;
        /// Dimension `d` of the 16 positions' keys.
        unsafe fn k16(&self, d: usize) -> [__m256; 2];
        /// The 16 positions' key scales of scale block `b` (q8_0 only; ones for float pages).
        #[inline(always)]
        unsafe fn kscale(&self, _b: usize) -> [__m256; 2] {
            [_mm256_set1_ps(1.0); 2]
        }
        /// The 16 positions' value scales of scale block `b` (q8_0 only; ones for float pages).
        #[inline(always)]
        unsafe fn vscale(&self, _b: usize) -> [__m256; 2] {
            [_mm256_set1_ps(1.0); 2]
        }
        /// Dimensions `d..d + 8` of position `j`'s value.
        unsafe fn v8(&self, j: usize, d: usize) -> __m256;
    }

    struct F32Src {
        k: *const f32,
        v: *const f32,
        hd: usize,
    }

    impl Load for F32Src {
        const Q8: bool = false;
        #[inline(always)]
        unsafe fn k16(&self, d: usize) -> [__m256; 2] {
            let p = self.k.add(d * BLOCK_POSITIONS);
            [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
        }
        #[inline(always)]
        unsafe fn v8(&self, j: usize, d: usize) -> __m256 {
            _mm256_loadu_ps(self.v.add(j * self.hd + d))
        }
    }

    struct F16Src {
        k: *const u16,
        v: *const u16,
        hd: usize,
    }

    #[inline(always)]
    unsafe fn f16x8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }

    impl Load for F16Src {
        const Q8: bool = false;
        #[inline(always)]
        unsafe fn k16(&self, d: usize) -> [__m256; 2] {
            let p = self.k.add(d * BLOCK_POSITIONS);
            [f16x8(p), f16x8(p.add(8))]
        }
        #[inline(always)]
        unsafe fn v8(&self, j: usize, d: usize) -> __m256 {
            f16x8(self.v.add(j * self.hd + d))
        }
    }

    struct Q8Src {
        ks: *const u16,
        kq: *const i8,
        vs: *const u16,
        vq: *const i8,
        hd: usize,
    }

    #[inline(always)]
    unsafe fn i8x8(p: *const i8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
    }

    impl Load for Q8Src {
        const Q8: bool = true;
        #[inline(always)]
        unsafe fn k16(&self, d: usize) -> [__m256; 2] {
            let p = self.kq.add(d * BLOCK_POSITIONS);
            [i8x8(p), i8x8(p.add(8))]
        }
        #[inline(always)]
        unsafe fn kscale(&self, b: usize) -> [__m256; 2] {
            let p = self.ks.add(b * BLOCK_POSITIONS);
            [f16x8(p), f16x8(p.add(8))]
        }
        #[inline(always)]
        unsafe fn vscale(&self, b: usize) -> [__m256; 2] {
            let p = self.vs.add(b * BLOCK_POSITIONS);
            [f16x8(p), f16x8(p.add(8))]
        }
        #[inline(always)]
        unsafe fn v8(&self, j: usize, d: usize) -> __m256 {
            i8x8(self.vq.add(j * self.hd + d))
        }
    }

    /// [`super::exp`] on eight lanes (the same Cephes polynomial; `r` is formed with fused
    /// multiply-adds, so results may differ from the scalar one in the last bit).
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
            _mm256_set1_ps(88.0),
        );
        let n = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
            _mm256_set1_ps(0.5),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_199_9e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666_666_5e-1));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
            _mm256_set1_ps(1.0),
        );
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
    }

    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The step for `G` heads, value dimensions `8 * W` at a time.
    ///
    /// # Safety
    /// As [`dispatch`]; `hd` a multiple of `8 * W` (and of 32 for q8_0).
    #[inline(always)]
    unsafe fn step<const G: usize, const W: usize, L: Load>(
        src: &L,
        hd: usize,
        cnt: usize,
        row: Row<'_>,
    ) {
        let qp = row.q.as_ptr();
        // Scores of the 16 positions (lanes) for each head: per dimension one broadcast of
        // `q[d]` and two FMAs, the key vector shared by the heads. q8_0 sums each 32-dimension
        // block apart and scales it by the 16 positions' scales of that block.
        let zero = _mm256_setzero_ps();
        let mut s = [[zero; 2]; G];
        let bw = if L::Q8 { Q8_0_BLOCK } else { hd };
        let mut b0 = 0;
        while b0 < hd {
            let sc = src.kscale(b0 / Q8_0_BLOCK);
            for d in b0..b0 + bw {
                let mut k = src.k16(d);
                if L::Q8 {
                    // Scale times quant per value, as the f32 tile holds it, so decode (pages)
                    // and prefill (tiles) compute bit-identical scores: with the scale factored
                    // out of the sum instead, the last-bit differences flipped q8_0 roundings of
                    // later layers' keys and values between the two.
                    k = [_mm256_mul_ps(k[0], sc[0]), _mm256_mul_ps(k[1], sc[1])];
                }
                for (g, s) in s.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*qp.add(g * hd + d));
                    s[0] = _mm256_fmadd_ps(x, k[0], s[0]);
                    s[1] = _mm256_fmadd_ps(x, k[1], s[1]);
                }
            }
            b0 += bw;
        }

        // Online softmax per head: lanes at or past `cnt` (positions not yet written, or past
        // this row) get -inf before the maximum and weight 0 after the exponential.
        let n = _mm256_set1_ps(cnt as f32);
        let mask = [
            _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_setr_ps(0., 1., 2., 3., 4., 5., 6., 7.), n),
            _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_setr_ps(8., 9., 10., 11., 12., 13., 14., 15.), n),
        ];
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut w = [[0f32; BLOCK_POSITIONS]; G];
        let mut c = [0f32; G];
        for g in 0..G {
            let s0 = _mm256_blendv_ps(ninf, s[g][0], mask[0]);
            let s1 = _mm256_blendv_ps(ninf, s[g][1], mask[1]);
            let bmax = hmax(_mm256_max_ps(s0, s1));
            let m_old = row.m[g];
            let m_new = if bmax > m_old { bmax } else { m_old };
            // exp(-inf) is clamped to ~1e-38: the first block scales zeros.
            c[g] = super::exp(m_old - m_new);
            row.m[g] = m_new;
            let mv = _mm256_set1_ps(m_new);
            let e0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, mv)), mask[0]);
            let e1 = _mm256_and_ps(exp8(_mm256_sub_ps(s1, mv)), mask[1]);
            row.l[g] = row.l[g] * c[g] + hsum(_mm256_add_ps(e0, e1));
            _mm256_storeu_ps(w[g].as_mut_ptr(), e0);
            _mm256_storeu_ps(w[g].as_mut_ptr().add(8), e1);
        }

        // acc = c · acc + Σ_j w_j v_j, `8 * W` dimensions of every head at a time in registers.
        // q8_0 values are scale times quant, as in the f32 tile (see the keys above).
        let ap = row.acc.as_mut_ptr();
        let mut vsc = [0f32; BLOCK_POSITIONS];
        let mut d0 = 0;
        while d0 < hd {
            if L::Q8 && d0.is_multiple_of(Q8_0_BLOCK) {
                let sc = src.vscale(d0 / Q8_0_BLOCK);
                _mm256_storeu_ps(vsc.as_mut_ptr(), sc[0]);
                _mm256_storeu_ps(vsc.as_mut_ptr().add(8), sc[1]);
            }
            // Even and odd positions go to two sets of accumulators where both fit the registers
            // (G·W ≤ 6: SmolLM2's three heads), so each is a chain of 8 dependent FMAs per block
            // rather than 16 (FMA latency, not throughput, bound the step). Splitting the
            // scores' dimensions the same way was faster as well (prefill at 4096 +7%), but its
            // rounding flipped the f32-KV argmax at a near-tie of the reference test (llama.cpp's
            // own gap there is 0.10), so the scores keep one chain.
            let vsets = if G * W <= 6 { 2 } else { 1 };
            let mut a2 = [[[zero; W]; G]; 2];
            for (g, a) in a2[0].iter_mut().enumerate() {
                let cg = _mm256_set1_ps(c[g]);
                for (i, a) in a.iter_mut().enumerate() {
                    *a = _mm256_mul_ps(_mm256_loadu_ps(ap.add(g * hd + d0 + 8 * i)), cg);
                }
            }
            let mut j0 = 0;
            while j0 < cnt {
                for (set, a) in a2.iter_mut().enumerate().take(vsets) {
                    let j = j0 + set;
                    if j >= cnt {
                        break;
                    }
                    let mut x = [zero; W];
                    for (i, x) in x.iter_mut().enumerate() {
                        *x = src.v8(j, d0 + 8 * i);
                    }
                    if L::Q8 {
                        let sc = _mm256_broadcast_ss(&vsc[j]);
                        for x in &mut x {
                            *x = _mm256_mul_ps(*x, sc);
                        }
                    }
                    for (a, ws) in a.iter_mut().zip(&w) {
                        let p = _mm256_broadcast_ss(&ws[j]);
                        for (a, &x) in a.iter_mut().zip(&x) {
                            *a = _mm256_fmadd_ps(p, x, *a);
                        }
                    }
                }
                j0 += vsets;
            }
            let mut a = a2[0];
            if vsets == 2 {
                for (a, b) in a.iter_mut().zip(&a2[1]) {
                    for (a, &b) in a.iter_mut().zip(b) {
                        *a = _mm256_add_ps(*a, b);
                    }
                }
            }
            for (g, a) in a.iter().enumerate() {
                for (i, &a) in a.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(g * hd + d0 + 8 * i), a);
                }
            }
            d0 += 8 * W;
        }
    }
}

/// Without AVX2/FMA/F16C at build time every block takes [`block_portable`].
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
mod simd {
    use super::{Page, Row};

    pub(super) fn supported(_group: usize, _hd: usize) -> bool {
        false
    }

    pub(super) fn block(
        _group: usize,
        _hd: usize,
        _k: &Page<'_>,
        _v: &Page<'_>,
        _cnt: usize,
        _row: Row<'_>,
    ) -> bool {
        false
    }
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
    use crate::kv::{BlockAllocator, BlockTable, KvLayout, KvType};

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
    /// chunks) agree with a float64 two-pass softmax, for every storage type and for groups of
    /// 2, 3 (SmolLM2) and 4 (SmolLM3) query heads per KV head.
    #[test]
    fn paged_online_softmax_matches_two_pass_reference() {
        for (n_heads, n_kv_heads, head_dim) in [(4, 2, 32), (6, 2, 64), (8, 2, 128)] {
            let shape = AttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
            };
            paged_online_softmax_case(shape);
        }
    }

    fn paged_online_softmax_case(shape: AttnShape) {
        let hd = shape.head_dim;
        let nh = shape.n_heads;
        let group = nh / shape.n_kv_heads;
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
                    // Keys are stored transposed (`[dim][position]`).
                    let k = kv.tile(b, 0, kh, KvKind::K, slot + 1, &mut scratch);
                    keys[kh].push((0..hd).map(|d| k[d * BLOCK_POSITIONS + slot]).collect());
                    let v = kv.tile(b, 0, kh, KvKind::V, slot + 1, &mut scratch);
                    values[kh].push(v[slot * hd..(slot + 1) * hd].to_vec());
                }
            }
            let q: Vec<f32> = (0..new * nh * hd).map(|i| value(i, 3) * 0.5).collect();
            // Both as one prefill chunk of 40 rows and as a single decode row.
            for (rows, past) in [(new, past), (1, n - 1)] {
                let seqs = [SeqAttn {
                    blocks: table.blocks(),
                    past,
                    row0: 0,
                    rows,
                }];
                let mut out = vec![0f32; rows * nh * hd];
                attention(shape, &kv, 0, &seqs, &q[..rows * nh * hd], &mut out);
                for r in 0..rows {
                    for h in 0..nh {
                        let kh = h / group;
                        let visible = past + r + 1;
                        let qv = &q[(r * nh + h) * hd..(r * nh + h + 1) * hd];
                        let want = reference(qv, &keys[kh][..visible], &values[kh][..visible]);
                        let got = &out[(r * nh + h) * hd..(r * nh + h + 1) * hd];
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (g - w).abs() < 1e-4,
                                "{t} {shape:?} row {r} head {h}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The SIMD block step, reading f32, f16 and q8_0 pages directly, agrees with the portable
    /// step on the same block converted to f32 tiles, for every group size it handles, head
    /// dimensions of one and several q8_0 blocks, every count of valid positions, and a running
    /// state (maximum, sum, accumulators) that the block must rescale or leave.
    #[test]
    fn simd_block_step_matches_portable_step() {
        for hd in [32usize, 64, 128] {
            for t in KvType::ALL {
                let layout = KvLayout {
                    kv_type: t,
                    n_layers: 1,
                    n_kv_heads: 1,
                    head_dim: hd,
                };
                let mut kv = CpuKvStorage::new(layout);
                kv.ensure(1);
                for p in 0..BLOCK_POSITIONS {
                    let kr: Vec<f32> = (0..hd).map(|d| value(p * hd + d, 11)).collect();
                    let vr: Vec<f32> = (0..hd).map(|d| value(p * hd + d, 13)).collect();
                    kv.write(0, p, 0, 0, KvKind::K, &kr);
                    kv.write(0, p, 0, 0, KvKind::V, &vr);
                }
                let mut kbuf = vec![0f32; BLOCK_POSITIONS * hd];
                let mut vbuf = vec![0f32; BLOCK_POSITIONS * hd];
                let keys = kv
                    .tile(0, 0, 0, KvKind::K, BLOCK_POSITIONS, &mut kbuf)
                    .to_vec();
                let values = kv
                    .tile(0, 0, 0, KvKind::V, BLOCK_POSITIONS, &mut vbuf)
                    .to_vec();
                for group in 1..=8 {
                    if !simd::supported(group, hd) {
                        continue;
                    }
                    let q: Vec<f32> = (0..group * hd).map(|i| value(i, group) * 0.3).collect();
                    for cnt in 1..=BLOCK_POSITIONS {
                        // Fresh state, and a state with a maximum above and below the block's.
                        for start_m in [f32::NEG_INFINITY, -1.0, 3.0] {
                            let fresh = start_m == f32::NEG_INFINITY;
                            let m0 = vec![start_m; group];
                            let l0 = vec![if fresh { 0.0 } else { 1.5 }; group];
                            let acc0: Vec<f32> = (0..group * hd)
                                .map(|i| if fresh { 0.0 } else { value(i, 17) })
                                .collect();
                            let (mut m1, mut l1, mut a1) = (m0.clone(), l0.clone(), acc0.clone());
                            let row = Row {
                                q: &q,
                                m: &mut m1,
                                l: &mut l1,
                                acc: &mut a1,
                            };
                            block_portable(hd, &keys, &values, 0, cnt, row);
                            let (mut m2, mut l2, mut a2) = (m0.clone(), l0.clone(), acc0.clone());
                            let row = Row {
                                q: &q,
                                m: &mut m2,
                                l: &mut l2,
                                acc: &mut a2,
                            };
                            let k = kv.page(0, 0, 0, KvKind::K);
                            let v = kv.page(0, 0, 0, KvKind::V);
                            assert!(simd::block(group, hd, &k, &v, cnt, row));
                            let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * (1.0 + b.abs());
                            let what = format!("{t} hd {hd} group {group} cnt {cnt} m {start_m}");
                            for g in 0..group {
                                assert!(close(m2[g], m1[g]), "{what}: m {} vs {}", m2[g], m1[g]);
                                assert!(close(l2[g], l1[g]), "{what}: l {} vs {}", l2[g], l1[g]);
                            }
                            for (i, (x, y)) in a2.iter().zip(&a1).enumerate() {
                                assert!(close(*x, *y), "{what}: acc[{i}] {x} vs {y}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn decode_prefetch_follows_the_variable_then_the_config_then_the_l1_size() {
        use DecodePrefetch::{Eager, Lazy};
        let choose = DecodePrefetch::choose;
        assert_eq!(choose(Some("eager"), None, Some(32 << 10)), Eager);
        assert_eq!(choose(Some(" LAZY "), None, Some(48 << 10)), Lazy);
        assert_eq!(choose(Some("sometimes"), None, Some(48 << 10)), Eager);
        assert_eq!(choose(None, None, Some(48 << 10)), Eager);
        assert_eq!(choose(None, None, Some(32 << 10)), Lazy);
        assert_eq!(choose(None, None, None), Lazy);
        // The configured choice beats the cache size; the variable beats the configuration.
        assert_eq!(choose(None, Some(Lazy), Some(48 << 10)), Lazy);
        assert_eq!(choose(None, Some(Eager), Some(32 << 10)), Eager);
        assert_eq!(choose(Some("lazy"), Some(Eager), Some(48 << 10)), Lazy);
        assert_eq!(choose(Some("bad"), Some(Eager), Some(32 << 10)), Eager);
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
        crate::test_log::init();
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
        // `ATTN_BENCH_CTX=1024 ATTN_BENCH_LAYERS=1` keeps the cache in L2 (`=4096` and `=1`: in
        // L3): the kernel's compute ceiling, without the memory system (or a neighbour's use of
        // it) in the figure.
        let ctx: usize = std::env::var("ATTN_BENCH_CTX")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(4096);
        let layers: Option<usize> = std::env::var("ATTN_BENCH_LAYERS")
            .ok()
            .and_then(|s| s.parse().ok());
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
            let n_layers = layers.unwrap_or(n_layers);
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
                tracing::info!(
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
