//! AVX-512 VNNI kernels on the packed layout (see [`super::layout`]).
//!
//! One 64-byte chunk holds four quants of each of sixteen rows; `vpdpbusd` multiplies them (as
//! unsigned bytes) with four activation bytes broadcast to every lane, so each 32-bit lane collects
//! one row's partial sum and no horizontal reductions are needed. `T` tokens share every weight
//! load: the kernel keeps `T` sets of accumulators in registers, so weights are fetched once per
//! `T` tokens and prefill becomes compute-bound. Per lane, the operations and their order are those
//! of [`super::scalar`], so results agree with it bit for bit.
//!
//! Q4_1 and Q8_0 round in [`FloatOrder::PerBlock`], as the AVX2 kernels do, not in llama.cpp's
//! order: that order converts and accumulates each 4-value lane on its own (per token and block,
//! eight conversions and eight multiply-adds beside the eight `vpdpbusd`, instead of one and two),
//! which left this path's SmolLM2 prefill behind its own AVX2 path on Zen 4 (931 against 967
//! tok/s) and behind ik_llama.cpp's `-march=native` build (1,091 against 1,251). So the x86 SIMD paths all compute
//! the same Q4_1/Q8_0 products; only the scalar path keeps llama.cpp's order.
//!
//! These kernels are tested on every CPU: `build.rs` copies this file without its
//! `#[target_feature]` lines and `kernel_tests.rs` runs that copy over emulated intrinsics
//! (`emu512.rs`). Keep each such attribute and the `std::arch` import on a line of its own.
//!
//! Every function here is `unsafe` for two reasons stated once: the CPU must support
//! AVX512F/BW/VL/VNNI (guaranteed by `Isa::available` before a kernel is handed out), and the
//! pointer arithmetic relies on the [`super::kernel::Kernel`] contract (a whole packed group of
//! `acts.nblk` blocks, tokens `t0..t0+nt` present in `acts`, 16 writable floats per token at
//! `out + t * stride`).

// Index loops mirror the layout arithmetic (chunk j feeds lanes j and j+4, and so on).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::act::Acts;
use super::kernel::{kq_prefetch_blocks, KernelChoice};
use super::layout::{Format, Q4K_D, Q4K_DMIN, Q4K_MIN_LOW, Q4K_SCALES};
use super::scalar::FloatOrder;

pub fn kernel(format: Format) -> KernelChoice {
    // Tokens per call: eight, the register tile of `tiled!` below. Every kernel keeps three
    // registers per token (two integer chains and a float sum, or the K-quants' three sums): eight
    // tokens fit in the 32 registers (K-quants: +20-27% prefill over four).
    let kernel: super::kernel::Kernel = match format {
        Format::Q4_0 => q4_0,
        Format::Q4_1 => q4_1,
        Format::Q8_0 => q8_0,
        Format::Q4K => q4k,
        Format::Q6K => q6k,
    };
    KernelChoice {
        kernel,
        tile: 8,
        order: FloatOrder::PerBlock,
        unpacked: None,
    }
}

/// Expands to a [`super::kernel::Kernel`] that walks `nt` tokens in register tiles of the listed
/// sizes (`1..max`, then `max`).
macro_rules! tiled {
    ($name:ident, $tile:ident, [$($n:literal),*], $max:literal) => {
        unsafe fn $name(g: &[u8], acts: &Acts, t0: usize, nt: usize, out: *mut f32, stride: usize) {
            let mut t = 0;
            while t < nt {
                let o = out.add(t * stride);
                let n = (nt - t).min($max);
                match n {
                    $($n => $tile::<$n>(g, acts, t0 + t, o, stride),)*
                    _ => $tile::<$max>(g, acts, t0 + t, o, stride),
                }
                t += n;
            }
        }
    };
}

tiled!(q4_0, q4_0_tile, [1, 2, 3, 4, 5, 6, 7], 8);
tiled!(q4_1, q4_1_tile, [1, 2, 3, 4, 5, 6, 7], 8);
tiled!(q8_0, q8_0_tile, [1, 2, 3, 4, 5, 6, 7], 8);
tiled!(q4k, q4k_tile, [1, 2, 3, 4, 5, 6, 7], 8);
tiled!(q6k, q6k_tile, [1, 2, 3, 4, 5, 6, 7], 8);

/// Four activation bytes at `p`, broadcast to every lane (folds into `vpdpbusd`'s `{1to16}`).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast4(p: *const i8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

/// Sixteen f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

/// Decode (one token, or a few sequences' tokens) streams weights from memory once: prefetch
/// `lines` cache lines starting at `p`, a few kilobytes ahead of the loads, so that the stream
/// overlaps the arithmetic (cold Q4_K 11008x2048 with 8 tokens, one thread: 2.31 -> 1.32 ms). Addresses
/// past the matrix are harmless: a prefetch never faults.
///
/// One token's tile (`T == 1`, decode) prefetches into L2 (`T1`), not L1: a prefetch into L1
/// holds one of the core's few L1 miss buffers until its line arrives from DRAM, so the loop
/// stalls on full buffers; L2 tracks many more misses and the L1's own prefetcher pulls the lines
/// on from L2. Zen 4, 2 threads, interleaved runs: the 3B shape's decode median 12.9 -> 14.9
/// tok/s (9 runs each, prefetching 3 blocks ahead); in later ABBA sittings 13.8 -> 15.0 (4
/// rounds) and 13.8 -> 16.0 (6 rounds).
/// Tiles of several tokens (prefill) keep `T0`: they are compute-bound and lost 9–27% of
/// SmolLM2's prefill with `T1`. The AVX2 kernels do the same for their K-quant one-token tiles
/// (see `avx2::prefetch_kq`).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn prefetch<const T: usize>(p: *const u8, lines: usize) {
    for k in 0..lines {
        let line = p.wrapping_add(64 * k) as *const i8;
        if T == 1 {
            _mm_prefetch::<_MM_HINT_T1>(line);
        } else {
            _mm_prefetch::<_MM_HINT_T0>(line);
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p as *const __m512i)
}

/// The integer sum of a token's `vpdpbusd` chains (exact: the order does not matter).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn sum_chains([c0, c1, c2, c3]: [__m512i; 4]) -> __m512i {
    _mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3))
}

/// [`FloatOrder::PerBlock`]'s block term: `f + f32(Σ chains)·(d_w·d_x)`, rounded as the scalar
/// kernel rounds it.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn add_block(f: __m512, chains: [__m512i; 4], dw: __m512, dx: f32) -> __m512 {
    let dd = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_chains(chains)), dd, f)
}

/// Q4_1 in [`FloatOrder::PerBlock`]: each row's 32-value block sum (its low and high nibbles'
/// integer sums added) is converted once, then the block's `d_w·d_x` and `m·s` terms go into one
/// running sum. Three registers per token, so eight tokens share every weight load.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_1_tile<const T: usize>(
    g: &[u8],
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 320 && t0 + T <= acts.n_tokens);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let sx = acts.s.as_ptr().add(t0 * nblk);
    let m4 = _mm512_set1_epi8(0x0F);
    let mut f = [_mm512_setzero_ps(); T];
    for b in 0..nblk {
        let blk = gp.add(b * 320);
        prefetch::<T>(blk.wrapping_add(8 * 320), 5);
        // Independent `vpdpbusd` chains, low and high nibbles apart: four for one token (decode,
        // whose short loop shows the chains' latency; even and odd chunks apart too), two
        // otherwise (registers).
        let pairs = if T == 1 { 2 } else { 1 };
        let mut sums = [[_mm512_setzero_si512(); 4]; T];
        for j in 0..4 {
            let p = load(blk.add(64 * j));
            let lo = _mm512_and_si512(p, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(p), m4);
            let c = 2 * (j % pairs);
            for t in 0..T {
                let x = xq.add(t * cols + b * 32 + 4 * j);
                sums[t][c] = _mm512_dpbusd_epi32(sums[t][c], lo, bcast4(x));
                sums[t][c + 1] = _mm512_dpbusd_epi32(sums[t][c + 1], hi, bcast4(x.add(16)));
            }
        }
        let dw = f16x16(blk.add(256));
        let mw = f16x16(blk.add(288));
        for t in 0..T {
            f[t] = add_block(f[t], sums[t], dw, *dx.add(t * nblk + b));
            f[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sx.add(t * nblk + b)), f[t]);
        }
    }
    for (t, f) in f.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *f);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_0_tile<const T: usize>(
    g: &[u8],
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 288 && t0 + T <= acts.n_tokens);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bias = acts.bias.as_ptr().add(t0 * nblk);
    let m4 = _mm512_set1_epi8(0x0F);
    let mut f = [_mm512_setzero_ps(); T];
    for b in 0..nblk {
        let blk = gp.add(b * 288);
        prefetch::<T>(blk.wrapping_add(8 * 288), 5);
        let mut a0 = [_mm512_setzero_si512(); T];
        let mut a1 = [_mm512_setzero_si512(); T];
        for (t, a) in a0.iter_mut().enumerate() {
            *a = _mm512_set1_epi32(*bias.add(t * nblk + b));
        }
        for j in 0..4 {
            let p = load(blk.add(64 * j));
            let lo = _mm512_and_si512(p, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(p), m4);
            for t in 0..T {
                let x = xq.add(t * cols + b * 32 + 4 * j);
                a0[t] = _mm512_dpbusd_epi32(a0[t], lo, bcast4(x));
                a1[t] = _mm512_dpbusd_epi32(a1[t], hi, bcast4(x.add(16)));
            }
        }
        let dw = f16x16(blk.add(256));
        for t in 0..T {
            let i = _mm512_add_epi32(a0[t], a1[t]);
            let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*dx.add(t * nblk + b)));
            f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), dd, f[t]);
        }
    }
    for (t, f) in f.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *f);
    }
}

/// Q8_0 in [`FloatOrder::PerBlock`]: each row's block sum starts from the block's eight
/// `-128·Σx` corrections (summed as integers) and is converted once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_tile<const T: usize>(
    g: &[u8],
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 544 && t0 + T <= acts.n_tokens);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bias = acts.bias.as_ptr().add(t0 * nblk * 8);
    let mut f = [_mm512_setzero_ps(); T];
    for b in 0..nblk {
        let blk = gp.add(b * 544);
        prefetch::<T>(blk.wrapping_add(6 * 544), 9);
        // Independent `vpdpbusd` chains: four for one token (decode, whose short loop shows the
        // chains' latency), two otherwise (registers).
        let chains = if T == 1 { 4 } else { 2 };
        let mut sums: [[__m512i; 4]; T] = std::array::from_fn(|t| {
            let c = bias.add((t * nblk + b) * 8);
            let correction = (0..8).map(|k| *c.add(k)).sum::<i32>();
            let z = _mm512_setzero_si512();
            [_mm512_set1_epi32(correction), z, z, z]
        });
        for k in 0..8 {
            let p = load(blk.add(64 * k));
            for t in 0..T {
                let x = bcast4(xq.add(t * cols + b * 32 + 4 * k));
                sums[t][k % chains] = _mm512_dpbusd_epi32(sums[t][k % chains], p, x);
            }
        }
        let dw = f16x16(blk.add(512));
        for t in 0..T {
            f[t] = add_block(f[t], sums[t], dw, *dx.add(t * nblk + b));
        }
    }
    for (t, f) in f.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *f);
    }
}

/// Q4_K: per sub-block `sb`, sixteen rows' scale bytes widened to dwords give the scales
/// (`& 63`) and, with the mins' low nibbles (one dword a row, shifted four bits a sub-block), the
/// mins; each pair of sub-blocks' mins goes into one `vpdpwssd` against the pair of activation
/// sums (see the layout in [`super::layout`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4k_tile<const T: usize>(g: &[u8], acts: &Acts, t0: usize, out: *mut f32, stride: usize) {
    const PB: usize = 2304;
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * PB && t0 + T <= acts.n_tokens);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bsum = acts.bsum32.as_ptr().add(t0 * nblk * 8);
    let m4 = _mm512_set1_epi8(0x0F);
    let m15 = _mm512_set1_epi32(0x0F);
    let m63 = _mm512_set1_epi32(63);
    let mut f = [_mm512_setzero_ps(); T];
    for b in 0..nblk {
        let blk = gp.add(b * PB);
        let mut sup = [_mm512_setzero_si512(); T];
        let mut min = [_mm512_setzero_si512(); T];
        // Bits 0..4: the current sub-block's min, low nibble.
        let mut min_low = load(blk.add(Q4K_MIN_LOW));
        let mut even_min = _mm512_setzero_si512();
        for sb in 0..8 {
            // The block `kq_prefetch_blocks(T)` ahead, 36 lines, in eight overlapping runs of five.
            prefetch::<T>(
                blk.wrapping_add(kq_prefetch_blocks(T) * PB + 64 * (sb * 36 / 8)),
                5,
            );
            let bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(Q4K_SCALES + 16 * sb) as *const _));
            let scv = _mm512_and_si512(bytes, m63);
            // min = (min_low & 15) | (bytes >> 2 & 0x30): `bytes >> 2` is at most 63, so bits
            // 4..6 are the min's high bits and bits 0..4 are taken from `min_low` (0xCA: A ? B : C).
            let mv = _mm512_ternarylogic_epi32::<0xCA>(m15, min_low, _mm512_srli_epi32::<2>(bytes));
            min_low = _mm512_srli_epi32::<4>(min_low);
            // One token (decode) sums the eight chunks in four chains: its short loop shows the
            // latency of one chain of eight `vpdpbusd` (llvm-mca, one super-block: Zen 4 52 -> 40
            // cycles, Sapphire Rapids 139 -> 62).
            let chains = if T == 1 { 4 } else { 1 };
            let mut acc = [[_mm512_setzero_si512(); 4]; T];
            for kg in 0..8 {
                let p = load(blk.add(64 * (8 * (sb / 2) + kg)));
                let w = if sb % 2 == 0 {
                    _mm512_and_si512(p, m4)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(p), m4)
                };
                for (t, a) in acc.iter_mut().enumerate() {
                    let c = kg % chains;
                    a[c] = _mm512_dpbusd_epi32(
                        a[c],
                        w,
                        bcast4(xq.add(t * cols + b * 256 + 32 * sb + 4 * kg)),
                    );
                }
            }
            for t in 0..T {
                let a = sum_chains(acc[t]);
                sup[t] = _mm512_add_epi32(sup[t], _mm512_mullo_epi32(a, scv));
            }
            if sb % 2 == 0 {
                even_min = mv;
            } else {
                // (m[sb - 1], m[sb]) as 16-bit halves of each row's lane.
                let pair_mins = _mm512_or_si512(even_min, _mm512_slli_epi32::<16>(mv));
                for (t, m) in min.iter_mut().enumerate() {
                    let pair =
                        (bsum.add((t * nblk + b) * 8 + sb - 1) as *const i32).read_unaligned();
                    *m = _mm512_dpwssd_epi32(*m, pair_mins, _mm512_set1_epi32(pair));
                }
            }
        }
        let dw = f16x16(blk.add(Q4K_D));
        let dm = f16x16(blk.add(Q4K_DMIN));
        for t in 0..T {
            let d = _mm512_set1_ps(*dx.add(t * nblk + b));
            f[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, d), _mm512_cvtepi32_ps(sup[t]), f[t]);
            f[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dm, d), _mm512_cvtepi32_ps(min[t]), f[t]);
        }
    }
    for (t, f) in f.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *f);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6k_tile<const T: usize>(g: &[u8], acts: &Acts, t0: usize, out: *mut f32, stride: usize) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 3360 && t0 + T <= acts.n_tokens);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bias = acts.bias.as_ptr().add(t0 * nblk * 16);
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    let mut f = [_mm512_setzero_ps(); T];
    for b in 0..nblk {
        let blk = gp.add(b * 3360);
        let mut sup = [_mm512_setzero_si512(); T];
        for gi in 0..16 {
            prefetch::<T>(blk.wrapping_add(kq_prefetch_blocks(T) * 3360 + 256 * gi), 4);
            let cc = gi / 2;
            let pairs =
                _mm512_cvtepi8_epi16(_mm256_loadu_si256(blk.add(3072 + 32 * cc) as *const _));
            let scv = if gi % 2 == 0 {
                _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pairs))
            } else {
                _mm512_srai_epi32::<16>(pairs)
            };
            let hd = load(blk.add(2048 + 64 * gi));
            // One token (decode) sums the four chunks in two chains (see `q4k_tile`).
            let chains = if T == 1 { 2 } else { 1 };
            let mut acc = [[_mm512_setzero_si512(); 2]; T];
            for (t, a) in acc.iter_mut().enumerate() {
                a[0] = _mm512_set1_epi32(*bias.add((t * nblk + b) * 16 + gi));
            }
            for kq in 0..4 {
                let kg = 4 * (gi % 2) + kq;
                let p = load(blk.add(64 * (8 * (cc / 2) + kg)));
                let lo = if cc % 2 == 0 {
                    _mm512_and_si512(p, m4)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(p), m4)
                };
                // Bits 2kq..2kq+2 of each byte moved to bits 4..6 (16-bit shifts are fine: the
                // mask drops whatever crosses a byte boundary).
                let h = match kq {
                    0 => _mm512_slli_epi16::<4>(hd),
                    1 => _mm512_slli_epi16::<2>(hd),
                    2 => hd,
                    _ => _mm512_srli_epi16::<2>(hd),
                };
                // lo | (h & 0x30)
                let w = _mm512_ternarylogic_epi32::<0xF8>(lo, h, m30);
                for (t, a) in acc.iter_mut().enumerate() {
                    let c = kq % chains;
                    a[c] = _mm512_dpbusd_epi32(
                        a[c],
                        w,
                        bcast4(xq.add(t * cols + b * 256 + 32 * cc + 4 * kg)),
                    );
                }
            }
            for t in 0..T {
                let a = _mm512_add_epi32(acc[t][0], acc[t][1]);
                sup[t] = _mm512_add_epi32(sup[t], _mm512_mullo_epi32(a, scv));
            }
        }
        let dw = f16x16(blk.add(3328));
        for t in 0..T {
            let d = _mm512_set1_ps(*dx.add(t * nblk + b));
            f[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, d), _mm512_cvtepi32_ps(sup[t]), f[t]);
        }
    }
    for (t, f) in f.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * stride), *f);
    }
}
