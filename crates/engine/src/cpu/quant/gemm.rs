//! The matrix-product driver for packed weights: picks the kernel for the CPU, tiles the work
//! (row groups × token tiles, weights kept cache-resident) and splits it over the rayon pool.

use rayon::prelude::*;

use super::act::Acts;
use super::isa::Isa;
use super::kernel::{Kernel, KernelChoice};
use super::layout::{Format, Packed, GROUP};
use super::scalar::{self, FloatOrder};

/// Token count from which [`Unpacked`](super::kernel::Unpacked) paths are taken. Measured on Zen 3 (3B Q6_K shapes, one
/// thread): at 8 tokens unpacking lost up to 20% on the big matrices (`ffn_down`, the LM head),
/// from 16 it gains on every shape (+0–25% at 16, +35% at 128).
const UNPACK_MIN_TOKENS: usize = 16;

macro_rules! scalar_kernel {
    ($name:ident, $format:expr) => {
        scalar_kernel!($name, $format, FloatOrder::Llama);
    };
    ($name:ident, $format:expr, $order:expr) => {
        /// # Safety
        /// See [`Kernel`].
        unsafe fn $name(g: &[u8], acts: &Acts, t0: usize, nt: usize, out: *mut f32, stride: usize) {
            let mut tmp = vec![0f32; nt * GROUP];
            scalar::group($format, $order, g, acts, t0, nt, &mut tmp, GROUP);
            for (t, row) in tmp.chunks_exact(GROUP).enumerate() {
                // SAFETY: the caller guarantees these sixteen floats are ours to write.
                unsafe {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(t * stride), GROUP);
                }
            }
        }
    };
}
scalar_kernel!(scalar_q4_0, Format::Q4_0);
scalar_kernel!(scalar_q4_1, Format::Q4_1);
scalar_kernel!(scalar_q4_1_per_block, Format::Q4_1, FloatOrder::PerBlock);
scalar_kernel!(scalar_q8_0, Format::Q8_0);
scalar_kernel!(scalar_q8_0_per_block, Format::Q8_0, FloatOrder::PerBlock);
scalar_kernel!(scalar_q4k, Format::Q4K);
scalar_kernel!(scalar_q6k, Format::Q6K);

/// The scalar kernel for `format` with Q4_1's and Q8_0's floats rounded in `order`: the path on
/// CPUs without AVX2 (in llama.cpp's order), and the reference every SIMD kernel equals bit for
/// bit.
pub fn scalar_kernel(format: Format, order: FloatOrder) -> KernelChoice {
    let kernel: Kernel = match (format, order) {
        (Format::Q4_0, _) => scalar_q4_0,
        (Format::Q4_1, FloatOrder::Llama) => scalar_q4_1,
        (Format::Q4_1, FloatOrder::PerBlock) => scalar_q4_1_per_block,
        (Format::Q8_0, FloatOrder::Llama) => scalar_q8_0,
        (Format::Q8_0, FloatOrder::PerBlock) => scalar_q8_0_per_block,
        (Format::Q4K, _) => scalar_q4k,
        (Format::Q6K, _) => scalar_q6k,
    };
    KernelChoice {
        kernel,
        tile: 4,
        order,
        unpacked: None,
    }
}

/// The kernel for `format` on `isa`, if `isa` is available on this CPU.
pub fn kernel(format: Format, isa: Isa) -> Option<KernelChoice> {
    if !isa.available() {
        return None;
    }
    match isa {
        Isa::Scalar => Some(scalar_kernel(format, FloatOrder::Llama)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => Some(super::avx512::kernel(format)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(super::avx2::kernel(format, false)),
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => Some(super::avx2::kernel(format, true)),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

/// Multiply-accumulates below which a product runs on the calling thread alone when that thread is
/// a pool worker: handing half to a second thread costs about a microsecond there, as much as this
/// much work saves (about 6 µs of it on one core).
const SERIAL_MACS: usize = 1 << 19;

/// Weight bytes below which a product runs on the calling thread alone when that thread is a pool
/// worker (about 4 µs of streaming from memory on one core).
const SERIAL_BYTES: usize = 48 << 10;

/// Pieces per thread of a decode product (one to three tokens). One contiguous share per thread
/// streams best when both threads keep pace; on a 2-vCPU AMD EPYC Zen 4 VM they do not, and
/// eight pieces of at least [`DECODE_PIECE_BYTES`] (with the pool's workers kept awake,
/// `cpu::awake`) took 3B-shape decode from medians of 11.3 and 12.2 to 12.7 and 14.7 tok/s
/// (alternating runs, docs/BENCHMARKS.md). Claiming small chunks in turn from a shared counter,
/// as llama.cpp's threads do, was slower there (11.5): interleaved chunks stream worse.
const DECODE_PIECES: usize = 8;

/// Smallest decode piece: below this many weight bytes (about 10 µs of streaming) the hand-off
/// costs more than the balance gains (SmolLM2's 576-wide products).
const DECODE_PIECE_BYTES: usize = 256 << 10;

/// Target bytes of weights a task walks per token tile (they stay in L2 while the tile's
/// activations sit in L1).
const CHUNK_BYTES: usize = 192 << 10;

thread_local! {
    /// Each thread's scratch for [`Unpacked`](super::kernel::Unpacked) chunks (a few hundred KiB, kept between products).
    static UNPACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Raw output pointer shared by the tasks of one product.
#[derive(Clone, Copy)]
pub struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint row ranges of the outputs (see `run`), and the buffers outlive the
// parallel loop, which joins before `run` returns.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// One product: `out[t * w.rows + r] = Σ_c W[r, c] · x[t, c]`.
pub struct Job<'a> {
    pub w: &'a Packed,
    pub choice: KernelChoice,
    pub acts: &'a Acts,
    out: OutPtr,
}

impl<'a> Job<'a> {
    /// Checks the shapes; the job keeps a pointer to `out`, which must not be touched until the
    /// job has run (`run` takes the jobs, and the borrow of `out` lasts as long as the job).
    pub fn new(w: &'a Packed, choice: KernelChoice, acts: &'a Acts, out: &'a mut [f32]) -> Self {
        assert_eq!(out.len(), acts.n_tokens * w.rows, "output buffer size");
        assert_eq!(acts.cols, w.cols, "activation width");
        assert_eq!(acts.kind, w.format.act_kind(), "activation kind");
        Self {
            w,
            choice,
            acts,
            out: OutPtr(out.as_mut_ptr()),
        }
    }

    /// Multiply-accumulates per row group.
    fn group_cost(&self) -> usize {
        GROUP * self.w.cols * self.acts.n_tokens
    }
}

/// `out[t * rows + r] = Σ_c W[r, c] · x[t, c]` for the packed `w` and quantized `acts`.
pub fn gemm(w: &Packed, choice: KernelChoice, acts: &Acts, out: &mut [f32]) {
    run(&[Job::new(w, choice, acts, out)]);
}

/// Runs several products in one parallel region (one thread wake-up instead of one per matrix).
pub fn run(jobs: &[Job<'_>]) {
    let costs: Vec<usize> = jobs.iter().map(|j| j.group_cost() * j.w.groups).collect();
    let total: usize = costs.iter().sum();
    if total == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    let max_tokens = jobs.iter().map(|j| j.acts.n_tokens).max().unwrap_or(0);
    // Split only when it saves more than it costs. A parallel region costs about a microsecond
    // when called from a pool worker, 5-8 µs from outside the pool (an injection and a wake-up,
    // measured). A product takes at least its multiply-accumulates at ~80 GMAC/s and, in a real
    // model's decode, its weight bytes at ~11 GB/s per thread (the weights of a whole model do not
    // stay cached between tokens, and two threads stream about twice as fast as one).
    let bytes: usize = jobs.iter().map(|j| j.w.bytes().len()).sum();
    let inside = rayon::current_thread_index().is_some();
    let (serial_macs, serial_bytes) = if inside {
        (SERIAL_MACS, SERIAL_BYTES)
    } else {
        (4 * SERIAL_MACS, 4 * SERIAL_BYTES)
    };
    let serial = total <= serial_macs && bytes <= serial_bytes;
    if serial || threads == 1 {
        for j in jobs {
            run_groups(j, 0..j.w.groups);
        }
        return;
    }
    // Decode streams weights once, prefill is compute-bound; either way threads finish their
    // shares unevenly (a vCPU shares its core with the hypervisor and its neighbours), so each
    // thread's share is cut into pieces that an idle thread can steal.
    let tasks = if max_tokens < 4 {
        (threads * DECODE_PIECES)
            .min(bytes / DECODE_PIECE_BYTES)
            .max(threads)
    } else {
        threads * 4
    };
    // Cut the concatenated row groups of all jobs into `tasks` runs of about equal cost.
    let share = total.div_ceil(tasks);
    let mut pieces: Vec<Vec<(usize, std::ops::Range<usize>)>> = vec![Vec::new(); tasks];
    let (mut task, mut filled) = (0usize, 0usize);
    for (ji, j) in jobs.iter().enumerate() {
        let gc = j.group_cost();
        let mut g = 0;
        while g < j.w.groups {
            let room = share.saturating_sub(filled);
            let take = (room / gc).max(1).min(j.w.groups - g);
            pieces[task].push((ji, g..g + take));
            filled += take * gc;
            g += take;
            if filled >= share && task + 1 < tasks {
                task += 1;
                filled = 0;
            }
        }
    }
    pieces.into_par_iter().for_each(|p| {
        for (ji, range) in p {
            run_groups(&jobs[ji], range);
        }
    });
}

/// Computes row groups `range` of a job for every token.
fn run_groups(job: &Job<'_>, range: std::ops::Range<usize>) {
    let (w, choice, acts, out) = (job.w, job.choice, job.acts, job.out);
    let n = acts.n_tokens;
    let rows = w.rows;
    let group_bytes = w.nblk * w.format.packed_bytes();
    let chunk = (CHUNK_BYTES / group_bytes).max(1);
    let unpacked = choice.unpacked.filter(|_| n >= UNPACK_MIN_TOKENS);
    let kernel = unpacked.map_or(choice.kernel, |u| u.kernel);
    // This thread's scratch for unpacked chunks, taken for the call and put back after it.
    let mut scratch = if unpacked.is_some() {
        UNPACKED.take()
    } else {
        Vec::new()
    };
    let mut tail = [0f32; 16 * GROUP];
    let mut g0 = range.start;
    while g0 < range.end {
        let g1 = (g0 + chunk).min(range.end);
        if let Some(u) = unpacked {
            let ub = w.nblk * u.block_bytes;
            scratch.resize((g1 - g0) * ub, 0);
            for (g, out) in (g0..g1).zip(scratch.chunks_exact_mut(ub)) {
                // SAFETY: the group matches the format the choice (and so `u`) was made for,
                // with `w.nblk` blocks, and `out` is `nblk * block_bytes` long.
                unsafe { (u.unpack)(w.group(g), w.nblk, out) };
            }
        }
        let mut t0 = 0;
        while t0 < n {
            let nt = choice.tile.min(n - t0).min(16);
            for g in g0..g1 {
                let grp = match unpacked {
                    Some(u) => {
                        let ub = w.nblk * u.block_bytes;
                        &scratch[(g - g0) * ub..(g - g0 + 1) * ub]
                    }
                    None => w.group(g),
                };
                let r0 = g * GROUP;
                if r0 + GROUP <= rows {
                    // SAFETY: the group matches the kernel's format (`Packed` and the choice were
                    // made for the same format; `grp` is unpacked exactly when `kernel` is the
                    // unpacked one), `t0 + nt <= n`, and rows r0..r0+16 of tokens
                    // t0..t0+nt lie inside `out` (length n * rows) and belong to this task alone.
                    unsafe {
                        (kernel)(grp, acts, t0, nt, out.0.add(t0 * rows + r0), rows);
                    }
                } else {
                    // A padded last group: compute into a scratch tile, copy the real rows.
                    // SAFETY: as above, with `tail` (16 tokens × 16 lanes) as the output.
                    unsafe {
                        (kernel)(grp, acts, t0, nt, tail.as_mut_ptr(), GROUP);
                    }
                    for t in 0..nt {
                        for l in 0..rows - r0 {
                            // SAFETY: row r0 + l < rows of token t0 + t < n lies inside `out`,
                            // and this task owns it.
                            unsafe { *out.0.add((t0 + t) * rows + r0 + l) = tail[t * GROUP + l] };
                        }
                    }
                }
            }
            t0 += nt;
        }
        g0 = g1;
    }
    if unpacked.is_some() {
        UNPACKED.set(scratch);
    }
}
