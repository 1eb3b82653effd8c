//! AVX2 kernels (with or without AVX-VNNI) on the packed layout (see [`super::layout`]).
//!
//! The same scheme as [`super::avx512`] on 256-bit registers: each 64-byte chunk of a group is
//! taken as two halves (rows 0-7, then rows 8-15), one lane per row. A kernel walks the group once
//! per half, except for one or two tokens (decode; three for Q4_K), which take both halves in one
//! pass (see `tiled_k!`): two passes touch every cache line twice and repeat the activation
//! broadcasts (one token, one Zen 4 core, weights from memory: Q4_K 15-16 -> 20-24 GB/s from the
//! single pass alone; Q6_K 9-13 -> 22-27 GB/s with its cheaper sums).
//!
//! Q4_1 and Q8_0 round in [`FloatOrder::PerBlock`] here, not in llama.cpp's order (see
//! [`super::scalar`]): one conversion per block instead of eight.
//!
//! Without VNNI the u8×i8 dot of four bytes is `vpmaddubsw` + `vpmaddwd`; that is exact here
//! because `vpmaddubsw` cannot saturate when the unsigned operand is at most 63
//! (2·63·128 < 32768). Q8_0's unsigned quants reach 255, so its kernel splits them into nibbles.
//! With VNNI, `vpdpbusd` (VEX-encoded, emitted with inline assembly so that one generic body
//! serves both variants) does it in one instruction.
//!
//! The VNNI kernels are also tested on CPUs without AVX-VNNI: the kernel tests set
//! `EMULATE_VNNI`, and `dp` then computes `vpdpbusd` lane by lane.
//!
//! Every function here is `unsafe` for the reasons stated in [`super::avx512`]: the CPU must have
//! AVX2, FMA and F16C (and AVX-VNNI for `VNNI = true`), checked by `Isa::available` before a
//! kernel is handed out, and the pointer arithmetic relies on the [`super::kernel::Kernel`] contract.

// Index loops mirror the layout arithmetic (chunk j feeds lanes j and j+4, and so on).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::act::Acts;
use super::kernel::{kq_prefetch_blocks, Kernel, KernelChoice, Unpacked};
use super::layout::{Format, Q4K_D, Q4K_DMIN, Q4K_MIN_LOW, Q4K_SCALES};
use super::scalar::FloatOrder;

/// Tokens per kernel call (the register tiles of `tiled!` below walk them).
const TILE: usize = 4;

pub fn kernel(format: Format, vnni: bool) -> KernelChoice {
    let kernel: Kernel = match (format, vnni) {
        (Format::Q4_0, false) => q4_0::<false>,
        (Format::Q4_0, true) => q4_0::<true>,
        (Format::Q4_1, false) => q4_1::<false>,
        (Format::Q4_1, true) => q4_1::<true>,
        (Format::Q8_0, false) => q8_0::<false>,
        (Format::Q8_0, true) => q8_0::<true>,
        (Format::Q4K, false) => q4k::<false>,
        (Format::Q4K, true) => q4k::<true>,
        (Format::Q6K, false) => q6k::<false>,
        (Format::Q6K, true) => q6k::<true>,
    };
    // Q4_1 and Q8_0 in llama.cpp's order are bound by the multiply ports on 256-bit registers
    // (see `scalar`): the AVX2 kernels round per block instead.
    let unpacked = match (format, vnni) {
        (Format::Q6K, false) => Some(q6k_unpacked_choice::<false>()),
        (Format::Q6K, true) => Some(q6k_unpacked_choice::<true>()),
        _ => None,
    };
    KernelChoice {
        kernel,
        tile: TILE,
        order: FloatOrder::PerBlock,
        unpacked,
    }
}

/// Expands to a [`Kernel`] that walks both halves of the group and `nt` tokens in register tiles
/// of the listed sizes (`1..max`, then `max`).
macro_rules! tiled {
    ($name:ident, $tile:ident, [$($n:literal),*], $max:literal) => {
        unsafe fn $name<const VNNI: bool>(
            g: &[u8],
            acts: &Acts,
            t0: usize,
            nt: usize,
            out: *mut f32,
            stride: usize,
        ) {
            for half in 0..2 {
                let mut t = 0;
                while t < nt {
                    let o = out.add(t * stride + 8 * half);
                    let n = (nt - t).min($max);
                    match n {
                        $($n => $tile::<$n, VNNI>(g, half, acts, t0 + t, o, stride),)*
                        _ => $tile::<$max, VNNI>(g, half, acts, t0 + t, o, stride),
                    }
                    t += n;
                }
            }
        }
    };
}

tiled!(q4_0, q4_0_tile, [1, 2, 3], 4);

/// Expands to a [`Kernel`] for a tile function `$tile::<T, H, VNNI>` that computes `H`
/// halves of the group from a given one. Up to two tokens (three for Q4_K) take both halves in one
/// pass over the weights: decode streams them from memory once, and the halves share the
/// activation broadcasts. One core, 3B shapes, weights from memory: two tokens 1.5-2x faster than
/// with two passes for both formats; three tokens 1.2-1.7x for Q4_K, no gain for Q6_K (its
/// accumulators spill). Larger tiles keep four tokens' accumulators (`$many`) and walk the halves
/// one after the other.
macro_rules! tiled_k {
    ($name:ident, $tile:ident, $many:ident, three_in_one_pass: $three:literal) => {
        unsafe fn $name<const VNNI: bool>(
            g: &[u8],
            acts: &Acts,
            t0: usize,
            nt: usize,
            out: *mut f32,
            stride: usize,
        ) {
            match nt {
                1 => return $tile::<1, 2, VNNI>(g, 0, acts, t0, out, stride),
                2 => return $tile::<2, 2, VNNI>(g, 0, acts, t0, out, stride),
                3 if $three => return $tile::<3, 2, VNNI>(g, 0, acts, t0, out, stride),
                _ => {}
            }
            halves_in_tiles_of_four!($many, g, acts, t0, nt, out, stride);
        }
    };
}

/// The body of a [`Kernel`] that walks the two halves of the group one after the other, each in
/// tiles of up to four tokens, with a tile function `$many::<T, 1, VNNI>` for one half.
macro_rules! halves_in_tiles_of_four {
    ($many:ident, $g:ident, $acts:ident, $t0:ident, $nt:ident, $out:ident, $stride:ident) => {
        for half in 0..2 {
            let mut t = 0;
            while t < $nt {
                let o = $out.add(t * $stride);
                let n = ($nt - t).min(4);
                match n {
                    1 => $many::<1, 1, VNNI>($g, half, $acts, $t0 + t, o, $stride),
                    2 => $many::<2, 1, VNNI>($g, half, $acts, $t0 + t, o, $stride),
                    3 => $many::<3, 1, VNNI>($g, half, $acts, $t0 + t, o, $stride),
                    _ => $many::<4, 1, VNNI>($g, half, $acts, $t0 + t, o, $stride),
                }
                t += n;
            }
        }
    };
}

tiled_k!(q4k, q4k_tile, q4k_tile, three_in_one_pass: true);
tiled_k!(q6k, q6k_tile, q6k_tile_half_packed, three_in_one_pass: false);
// Q4_1 and Q8_0 in the per-block order: one and two tokens (decode) take both halves in one pass
// as well (SmolLM2's Q8_0 LM head is a third of its decode bytes).
tiled_k!(q4_1, q4_1_tile, q4_1_tile, three_in_one_pass: false);
tiled_k!(q8_0, q8_0_tile, q8_0_tile, three_in_one_pass: false);

/// `acc + Σ_{i<4} u[4k+i]·s[4k+i]` per 32-bit lane, for unsigned `u` at most 63.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dp<const VNNI: bool>(mut acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    if VNNI {
        #[cfg(test)]
        if EMULATE_VNNI.with(|e| e.get()) {
            return super::emu512::dpbusd_avx_vnni(acc, u, s);
        }
        // SAFETY: `VNNI` kernels are only handed out when the CPU has AVX-VNNI; the instruction
        // reads and writes registers only.
        std::arch::asm!(
            "{{vex}} vpdpbusd {acc}, {u}, {s}",
            acc = inout(ymm_reg) acc,
            u = in(ymm_reg) u,
            s = in(ymm_reg) s,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    } else {
        let p = _mm256_maddubs_epi16(u, s);
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }
}

#[cfg(test)]
thread_local! {
    /// Set by the kernel tests, on their own thread, to run the VNNI kernels on CPUs without
    /// AVX-VNNI (Zen 2-4, and so most of this project's machines and its CI): `dp` then computes
    /// `vpdpbusd` lane by lane instead of executing it. Only `dp` differs between the real and the
    /// emulated runs.
    pub static EMULATE_VNNI: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Prefetches `lines` cache lines from `p` into L1 (see the AVX-512 kernels: it lets the weight
/// stream of decode overlap the arithmetic; a prefetch never faults, so addresses past the matrix
/// are fine). Both halves of a group share every cache line, so only the first half's pass
/// prefetches.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn prefetch(half: usize, p: *const u8, lines: usize) {
    prefetch_hint::<_MM_HINT_T0>(half, p, lines);
}

/// [`prefetch`] for the K-quant tiles of `T` tokens: one token's tile (decode) prefetches into L2
/// (`T1`), as the AVX-512 kernels do and for the same reason (an L1 prefetch holds one of the
/// few L1 miss buffers until its line comes from DRAM). Measured on Zen 4, AVX2 path, 3B-shape
/// decode, inside one process with the variant switched every two tokens (200 tokens each):
/// `T1` three super-blocks ahead took 1.9–7.8% off the time of a token in six runs (mean 5.5%;
/// the same switching with no change read −1.3 to +0.9%), `T1` two ahead 0.7–4.1%, four ahead
/// −0.3 to 2.2%, `T0` three ahead nothing; no prefetch at all cost 41%. The Q4_1/Q8_0 tiles keep
/// `T0`: SmolLM2's decode (Q4_1) was 4–9% slower with `T1` in the same kind of runs.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn prefetch_kq<const T: usize>(half: usize, p: *const u8, lines: usize) {
    if T == 1 {
        prefetch_hint::<_MM_HINT_T1>(half, p, lines);
    } else {
        prefetch_hint::<_MM_HINT_T0>(half, p, lines);
    }
}

/// [`prefetch`] with the cache-level hint `HINT`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn prefetch_hint<const HINT: i32>(half: usize, p: *const u8, lines: usize) {
    if half == 0 {
        for k in 0..lines {
            _mm_prefetch::<HINT>(p.wrapping_add(64 * k) as *const i8);
        }
    }
}

/// Writes the tile `f[t][h]` (token `t`, half `h0 + h` of the group: eight rows) to
/// `out.add(t * stride + 8 * (h0 + h))`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_halves<const T: usize, const H: usize>(
    f: &[[__m256; H]; T],
    h0: usize,
    out: *mut f32,
    stride: usize,
) {
    for (t, row) in f.iter().enumerate() {
        for (h, v) in row.iter().enumerate() {
            _mm256_storeu_ps(out.add(t * stride + 8 * (h0 + h)), *v);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Q4_1 in [`FloatOrder::PerBlock`] on `H` halves of the group from half `h0`: each row's
/// 32-value block sum is converted once, then the block's `d_w·d_x` and `m·s` terms go into one
/// running sum. Without VNNI the sum is kept in 16-bit lanes (eight `vpmaddubsw` pairs of at most
/// 2·15·128 each: at most 30720, no overflow) and widened by one `vpmaddwd` per block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_tile<const T: usize, const H: usize, const VNNI: bool>(
    g: &[u8],
    h0: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 320 && t0 + T <= acts.n_tokens && h0 + H <= 2);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let sx = acts.s.as_ptr().add(t0 * nblk);
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut f = [[_mm256_setzero_ps(); H]; T];
    for b in 0..nblk {
        let blk = gp.add(b * 320);
        prefetch(h0, blk.wrapping_add(8 * 320), 5);
        // VNNI: 32-bit sums; otherwise 16-bit sums widened after the block.
        let mut isum = [[_mm256_setzero_si256(); H]; T];
        for j in 0..4 {
            let xs: [(__m256i, __m256i); T] = std::array::from_fn(|t| {
                let x = xq.add(t * cols + b * 32 + 4 * j);
                (bcast4(x), bcast4(x.add(16)))
            });
            for h in 0..H {
                let p = load(blk.add(64 * j + 32 * (h0 + h)));
                let lo = _mm256_and_si256(p, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(p), m4);
                for t in 0..T {
                    let (xl, xh) = xs[t];
                    let s = &mut isum[t][h];
                    if VNNI {
                        *s = dp::<true>(dp::<true>(*s, lo, xl), hi, xh);
                    } else {
                        let pl = _mm256_maddubs_epi16(lo, xl);
                        let ph = _mm256_maddubs_epi16(hi, xh);
                        *s = _mm256_add_epi16(*s, _mm256_add_epi16(pl, ph));
                    }
                }
            }
        }
        for h in 0..H {
            let dw = f16x8(blk.add(256 + 16 * (h0 + h)));
            let mw = f16x8(blk.add(288 + 16 * (h0 + h)));
            for t in 0..T {
                let i = if VNNI {
                    isum[t][h]
                } else {
                    _mm256_madd_epi16(isum[t][h], ones)
                };
                let dd = _mm256_mul_ps(dw, _mm256_set1_ps(*dx.add(t * nblk + b)));
                f[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), dd, f[t][h]);
                f[t][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*sx.add(t * nblk + b)), f[t][h]);
            }
        }
    }
    store_halves(&f, h0, out, stride);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_tile<const T: usize, const VNNI: bool>(
    g: &[u8],
    half: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 288 && t0 + T <= acts.n_tokens);
    let gp = g.as_ptr().add(32 * half);
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bias = acts.bias.as_ptr().add(t0 * nblk);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut f = [_mm256_setzero_ps(); T];
    for b in 0..nblk {
        let blk = gp.add(b * 288);
        prefetch(half, blk.wrapping_add(8 * 288), 5);
        let mut a = [_mm256_setzero_si256(); T];
        for (t, a) in a.iter_mut().enumerate() {
            *a = _mm256_set1_epi32(*bias.add(t * nblk + b));
        }
        for j in 0..4 {
            let p = load(blk.add(64 * j));
            let lo = _mm256_and_si256(p, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(p), m4);
            for (t, a) in a.iter_mut().enumerate() {
                let x = xq.add(t * cols + b * 32 + 4 * j);
                *a = dp::<VNNI>(*a, lo, bcast4(x));
                *a = dp::<VNNI>(*a, hi, bcast4(x.add(16)));
            }
        }
        let dw = f16x8(blk.add(256 - 16 * half));
        for t in 0..T {
            let dd = _mm256_mul_ps(dw, _mm256_set1_ps(*dx.add(t * nblk + b)));
            f[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[t]), dd, f[t]);
        }
    }
    for (t, f) in f.iter().enumerate() {
        _mm256_storeu_ps(out.add(t * stride), *f);
    }
}

/// Q8_0 in [`FloatOrder::PerBlock`] on `H` halves of the group from half `h0`: each row's block
/// sum, its eight `-128·Σx` corrections included, is converted once. Without VNNI the unsigned
/// quants are split into nibbles whose `vpmaddubsw` products are summed in 16-bit lanes (eight of
/// at most 2·15·128 each: at most 30720) and widened once per block, the high nibbles' sum times 16.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_tile<const T: usize, const H: usize, const VNNI: bool>(
    g: &[u8],
    h0: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 544 && t0 + T <= acts.n_tokens && h0 + H <= 2);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bias = acts.bias.as_ptr().add(t0 * nblk * 8);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut f = [[_mm256_setzero_ps(); H]; T];
    for b in 0..nblk {
        let blk = gp.add(b * 544);
        prefetch(h0, blk.wrapping_add(6 * 544), 9);
        let mut lo_sum = [[_mm256_setzero_si256(); H]; T];
        let mut hi_sum = [[_mm256_setzero_si256(); H]; T];
        for k in 0..8 {
            let xs: [__m256i; T] =
                std::array::from_fn(|t| bcast4(xq.add(t * cols + b * 32 + 4 * k)));
            for h in 0..H {
                let p = load(blk.add(64 * k + 32 * (h0 + h)));
                if VNNI {
                    for t in 0..T {
                        lo_sum[t][h] = dp::<true>(lo_sum[t][h], p, xs[t]);
                    }
                } else {
                    let lo = _mm256_and_si256(p, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(p), m4);
                    for t in 0..T {
                        let pl = _mm256_maddubs_epi16(lo, xs[t]);
                        let ph = _mm256_maddubs_epi16(hi, xs[t]);
                        lo_sum[t][h] = _mm256_add_epi16(lo_sum[t][h], pl);
                        hi_sum[t][h] = _mm256_add_epi16(hi_sum[t][h], ph);
                    }
                }
            }
        }
        for t in 0..T {
            let c = bias.add((t * nblk + b) * 8);
            let correction = _mm256_set1_epi32((0..8).map(|k| *c.add(k)).sum::<i32>());
            let dd = _mm256_set1_ps(*dx.add(t * nblk + b));
            for h in 0..H {
                let i = if VNNI {
                    lo_sum[t][h]
                } else {
                    let lo = _mm256_madd_epi16(lo_sum[t][h], _mm256_set1_epi16(1));
                    let hi = _mm256_madd_epi16(hi_sum[t][h], _mm256_set1_epi16(16));
                    _mm256_add_epi32(lo, hi)
                };
                let i = _mm256_add_epi32(i, correction);
                let dw = f16x8(blk.add(512 + 16 * (h0 + h)));
                f[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dw, dd), f[t][h]);
            }
        }
    }
    store_halves(&f, h0, out, stride);
}

/// Bytes of a packed Q4_K group-block.
const Q4K_BYTES: usize = 2304;

/// Q4_K on `H` halves of the group from half `h0` (see [`q4k`] for which).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_tile<const T: usize, const H: usize, const VNNI: bool>(
    g: &[u8],
    h0: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * Q4K_BYTES && t0 + T <= acts.n_tokens && h0 + H <= 2);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bsum = acts.bsum32.as_ptr().add(t0 * nblk * 8);
    let mut f = [[_mm256_setzero_ps(); H]; T];
    for b in 0..nblk {
        let blk = gp.add(b * Q4K_BYTES);
        let mut sup = [[_mm256_setzero_si256(); H]; T];
        for sbp in 0..4 {
            q4k_sub_block::<T, H, VNNI, false>(blk, h0, xq, cols, b, 2 * sbp, &mut sup);
            q4k_sub_block::<T, H, VNNI, true>(blk, h0, xq, cols, b, 2 * sbp + 1, &mut sup);
        }
        // Each row's mins: the low nibbles from its dword at Q4K_MIN_LOW (sub-block `sb`'s in bits
        // 4sb..4sb+4), the high two bits from bits 6..8 of its scale bytes.
        let m15 = _mm256_set1_epi32(0x0F);
        let m48 = _mm256_set1_epi32(0x30);
        let mut min_low: [__m256i; H] =
            std::array::from_fn(|h| load(blk.add(Q4K_MIN_LOW + 32 * (h0 + h))));
        let mut min = [[_mm256_setzero_si256(); H]; T];
        for p in 0..4 {
            let pairs: [__m256i; T] = std::array::from_fn(|t| {
                let at = bsum.add((t * nblk + b) * 8 + 2 * p) as *const i32;
                _mm256_set1_epi32(at.read_unaligned())
            });
            for (h, low) in min_low.iter_mut().enumerate() {
                let high = |sb: usize| {
                    let bytes =
                        _mm_loadl_epi64(blk.add(Q4K_SCALES + 16 * sb + 8 * (h0 + h)) as *const _);
                    _mm256_and_si256(_mm256_srli_epi32::<2>(_mm256_cvtepu8_epi32(bytes)), m48)
                };
                let even = _mm256_or_si256(_mm256_and_si256(*low, m15), high(2 * p));
                let odd = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi32::<4>(*low), m15),
                    high(2 * p + 1),
                );
                *low = _mm256_srli_epi32::<8>(*low);
                // (m[2p], m[2p + 1]) as 16-bit halves of each row's lane.
                let mv = _mm256_or_si256(even, _mm256_slli_epi32::<16>(odd));
                for t in 0..T {
                    min[t][h] = _mm256_add_epi32(min[t][h], _mm256_madd_epi16(mv, pairs[t]));
                }
            }
        }
        for h in 0..H {
            let dw = f16x8(blk.add(Q4K_D + 16 * (h0 + h)));
            let dm = f16x8(blk.add(Q4K_DMIN + 16 * (h0 + h)));
            for t in 0..T {
                let d = _mm256_set1_ps(*dx.add(t * nblk + b));
                let fs = _mm256_cvtepi32_ps(sup[t][h]);
                let fm = _mm256_cvtepi32_ps(min[t][h]);
                f[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, d), fs, f[t][h]);
                f[t][h] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, d), fm, f[t][h]);
            }
        }
    }
    store_halves(&f, h0, out, stride);
}

/// Sub-block `sb` (32 values; odd ones in the high nibbles, hence `ODD == (sb % 2 == 1)`) of
/// [`q4k_tile`]: adds each row's scaled integer dot to `sup`. The parity is a constant rather than
/// `sb % 2` of a loop so that each call compiles to straight code: with the loop LLVM kept a
/// branch per sub-block and spilled accumulators (Q4_K products at 128 tokens, one Zen 3 core:
/// 86-91 -> 93-99 GMAC/s).
#[inline(always)]
unsafe fn q4k_sub_block<const T: usize, const H: usize, const VNNI: bool, const ODD: bool>(
    blk: *const u8,
    h0: usize,
    xq: *const i8,
    cols: usize,
    b: usize,
    sb: usize,
    sup: &mut [[__m256i; H]; T],
) {
    let m4 = _mm256_set1_epi8(0x0F);
    // A block ahead (two, or three for one token), 36 lines, in eight overlapping runs of five.
    prefetch_kq::<T>(
        h0,
        blk.wrapping_add(kq_prefetch_blocks(T) * Q4K_BYTES + 64 * (sb * 36 / 8)),
        5,
    );
    let scales: [__m128i; H] = std::array::from_fn(|h| {
        _mm_loadl_epi64(blk.add(Q4K_SCALES + 16 * sb + 8 * (h0 + h)) as *const _)
    });
    let weight = |kg: usize, h: usize| {
        let p = load(blk.add(64 * (8 * (sb / 2) + kg) + 32 * (h0 + h)));
        if !ODD {
            _mm256_and_si256(p, m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(p), m4)
        }
    };
    let x = |t: usize, kg: usize| bcast4(xq.add(t * cols + b * 256 + 32 * sb + 4 * kg));
    // With VNNI `vpdpbusd` sums in 32-bit lanes and a 32-bit multiply applies the sub-block
    // scale. Without it the eight `vpmaddubsw` products of a sub-block are summed as 16-bit lanes
    // (each is at most 2·15·127 = 3810, eight of them 30480 < 2^15), and one `vpmaddwd` against
    // the sub-block scale (repeated in both 16-bit halves of a row's lane) widens and scales them
    // at once: 17 instructions a sub-block instead of 26 (three per product plus a 32-bit
    // multiply). Integer sums either way, so the result is bit-for-bit the same.
    let mut acc = [[_mm256_setzero_si256(); H]; T];
    for kg in 0..8 {
        let xs: [__m256i; T] = std::array::from_fn(|t| x(t, kg));
        for h in 0..H {
            let w = weight(kg, h);
            for t in 0..T {
                acc[t][h] = if VNNI {
                    dp::<true>(acc[t][h], w, xs[t])
                } else {
                    _mm256_add_epi16(acc[t][h], _mm256_maddubs_epi16(w, xs[t]))
                };
            }
        }
    }
    for h in 0..H {
        // The scale byte's top two bits belong to the sub-block's min.
        let sc = _mm256_and_si256(_mm256_cvtepu8_epi32(scales[h]), _mm256_set1_epi32(63));
        let sc = if VNNI {
            sc
        } else {
            _mm256_or_si256(sc, _mm256_slli_epi32::<16>(sc))
        };
        for t in 0..T {
            let s = if VNNI {
                _mm256_mullo_epi32(acc[t][h], sc)
            } else {
                _mm256_madd_epi16(acc[t][h], sc)
            };
            sup[t][h] = _mm256_add_epi32(sup[t][h], s);
        }
    }
}

/// Q6_K on `H` halves of the group from half `h0` (see [`q6k`] for which).
///
/// Per 16-value group `g` of a row the integer part is `sc_g·(Σ v·x + bias_g)`, with `bias_g` the
/// activations' `-32·bsum16`. Both terms are computed separately, in integers:
/// - Without VNNI, the `vpmaddubsw` products of kq 0+1 and of kq 2+3 are summed as 16-bit lanes
///   (each product is at most 2·63·128 = 16128 in magnitude, two of them 32256 < 2^15), and one
///   `vpmaddwd` against the scale (repeated in both 16-bit halves of a row's lane) widens and
///   scales each sum: 10 multiply/add instructions a group instead of 13 (three per product plus
///   a 32-bit multiply). With VNNI, `vpdpbusd` sums the four products and `vpmulld` scales them.
/// - `Σ_g sc_g·bias_g` takes one `vpmaddwd` per pair of groups: the stored scale pair times 32 (at
///   most 4096 in magnitude, still 16-bit) against the pair `bias_g / 32` (exact: the bias is a
///   multiple of 32; at most 2048).
///
/// Integer sums in another order, so the result is bit-for-bit the scalar one.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile<const T: usize, const H: usize, const VNNI: bool>(
    g: &[u8],
    h0: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    debug_assert!(g.len() >= nblk * 3360 && t0 + T <= acts.n_tokens && h0 + H <= 2);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bias = acts.bias.as_ptr().add(t0 * nblk * 16);
    let mut f = [[_mm256_setzero_ps(); H]; T];
    for b in 0..nblk {
        let blk = gp.add(b * 3360);
        let mut sup = [[_mm256_setzero_si256(); H]; T];
        let x = xq.add(b * 256);
        let bias = bias.add(b * 16);
        for ccp in 0..4 {
            let at = Q6kGroupAt {
                blk,
                pairs_at: 3072,
                half: h0,
                x,
                cols,
                bias,
                stride: nblk * 16,
            };
            q6k_tile_step::<T, H, VNNI, false>(&at, 2 * ccp, &mut sup);
            q6k_tile_step::<T, H, VNNI, true>(&at, 2 * ccp + 1, &mut sup);
        }
        for h in 0..H {
            let dw = f16x8(blk.add(3328 + 16 * (h0 + h)));
            for t in 0..T {
                let d = _mm256_set1_ps(*dx.add(t * nblk + b));
                let fs = _mm256_cvtepi32_ps(sup[t][h]);
                f[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, d), fs, f[t][h]);
            }
        }
    }
    store_halves(&f, h0, out, stride);
}

/// Step `cc` (groups `2cc` and `2cc + 1` of every row; `ODD_CC == (cc % 2 == 1)`, the high
/// nibbles) of [`q6k_tile`], reading where `at` says from half `at.half` on. The parity is a
/// constant, as in [`q4k_sub_block`], so that the step compiles to straight code.
#[inline(always)]
unsafe fn q6k_tile_step<const T: usize, const H: usize, const VNNI: bool, const ODD_CC: bool>(
    at: &Q6kGroupAt,
    cc: usize,
    sup: &mut [[__m256i; H]; T],
) {
    let (blk, h0, cols) = (at.blk, at.half, at.cols);
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    // `vpshufb` patterns: a row's even (odd) group scale into both 16-bit halves of its lane.
    let even = _mm256_setr_epi8(
        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12,
        13, 12, 13,
    );
    let odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
    // 3360 bytes a block: seven lines for each of the eight steps cover it.
    prefetch_kq::<T>(
        h0,
        blk.wrapping_add(kq_prefetch_blocks(T) * 3360 + 448 * cc),
        7,
    );
    // Lane l: the i16 scales of groups 2cc and 2cc+1 of row l.
    let pairs: [__m256i; H] = std::array::from_fn(|h| {
        _mm256_cvtepi8_epi16(_mm_loadu_si128(
            blk.add(3072 + 32 * cc + 16 * (h0 + h)) as *const _
        ))
    });
    for t in 0..T {
        let bp = at.bias.add(t * at.stride + 2 * cc);
        let lo = (*bp >> 5) as u16 as u32;
        let hi = (*bp.add(1) >> 5) as u16 as u32;
        let bv = _mm256_set1_epi32((lo | (hi << 16)) as i32);
        for h in 0..H {
            let sc32 = _mm256_slli_epi16::<5>(pairs[h]);
            sup[t][h] = _mm256_add_epi32(sup[t][h], _mm256_madd_epi16(sc32, bv));
        }
    }
    for e in 0..2 {
        let gi = 2 * cc + e;
        let hd: [__m256i; H] =
            std::array::from_fn(|h| load(blk.add(2048 + 64 * gi + 32 * (h0 + h))));
        let sc: [__m256i; H] = std::array::from_fn(|h| {
            if VNNI {
                if e == 0 {
                    _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pairs[h]))
                } else {
                    _mm256_srai_epi32::<16>(pairs[h])
                }
            } else if e == 0 {
                _mm256_shuffle_epi8(pairs[h], even)
            } else {
                _mm256_shuffle_epi8(pairs[h], odd)
            }
        });
        // VNNI: the 32-bit dot; without: the 16-bit sum of two products.
        let mut acc = [[_mm256_setzero_si256(); H]; T];
        for kq in 0..4 {
            let kg = 4 * e + kq;
            let x: [__m256i; T] =
                std::array::from_fn(|t| bcast4(at.x.add(t * cols + 32 * cc + 4 * kg)));
            for h in 0..H {
                let p = load(blk.add(64 * (8 * (cc / 2) + kg) + 32 * (h0 + h)));
                let lo = if !ODD_CC {
                    _mm256_and_si256(p, m4)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(p), m4)
                };
                // Bits 2kq..2kq+2 of each byte moved to bits 4..6 (see the AVX-512
                // kernel).
                let hb = match kq {
                    0 => _mm256_slli_epi16::<4>(hd[h]),
                    1 => _mm256_slli_epi16::<2>(hd[h]),
                    2 => hd[h],
                    _ => _mm256_srli_epi16::<2>(hd[h]),
                };
                let w = _mm256_or_si256(lo, _mm256_and_si256(hb, m30));
                for t in 0..T {
                    if VNNI {
                        acc[t][h] = dp::<true>(acc[t][h], w, x[t]);
                    } else {
                        let prod = _mm256_maddubs_epi16(w, x[t]);
                        if kq % 2 == 0 {
                            acc[t][h] = prod;
                        } else {
                            let s16 = _mm256_add_epi16(acc[t][h], prod);
                            let s = _mm256_madd_epi16(s16, sc[h]);
                            sup[t][h] = _mm256_add_epi32(sup[t][h], s);
                        }
                    }
                }
            }
        }
        if VNNI {
            for t in 0..T {
                for h in 0..H {
                    let s = _mm256_mullo_epi32(acc[t][h], sc[h]);
                    sup[t][h] = _mm256_add_epi32(sup[t][h], s);
                }
            }
        }
    }
}

/// Q6_K for several tokens on one half of the group (`H` is 1; the parameter matches
/// [`tiled_k`]), one 16-value group at a time, so that four tokens' sums fit the registers
/// ([`q6k_tile`] walks two groups at once and spills for four tokens: 34.5 vs 28 ms for 64 tokens
/// of the 3B `ffn_down` on one Zen 4 core). With VNNI each group's sum starts from its bias and is
/// scaled by a 32-bit multiply. Without, the sums are [`q6k_tile`]'s: products summed in pairs as
/// 16-bit lanes and widened and scaled by one `vpmaddwd`, the bias terms of two groups taken by one
/// more (10 multiply/add instructions per group and token instead of 14).
///
/// With `UNPACKED`, `g` is a group unpacked by [`q6k_unpack`] and the six-bit values are loaded
/// as they are instead of being rebuilt from the nibble and high-bit bytes ([`q6k_weights`]) for
/// every tile: prefill of 16 tokens and more (see [`Unpacked`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile_half<const T: usize, const H: usize, const VNNI: bool, const UNPACKED: bool>(
    g: &[u8],
    half: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nblk, cols) = (acts.nblk, acts.cols);
    // Packed blocks (3360 bytes) or unpacked ones (see `q6k_unpack`).
    let (bb, pairs_at, dw_at) = if UNPACKED {
        (Q6K_UNPACKED_BLOCK, 4096, 4352)
    } else {
        (3360, 3072, 3328)
    };
    debug_assert!(g.len() >= nblk * bb && t0 + T <= acts.n_tokens && H == 1);
    let gp = g.as_ptr();
    let xq = acts.qs.as_ptr().add(t0 * cols);
    let dx = acts.d.as_ptr().add(t0 * nblk);
    let bias = acts.bias.as_ptr().add(t0 * nblk * 16);
    let mut f = [_mm256_setzero_ps(); T];
    for b in 0..nblk {
        let blk = gp.add(b * bb);
        let mut sup = [_mm256_setzero_si256(); T];
        let x = xq.add(b * 256);
        let bias = bias.add(b * 16);
        for cc in 0..8 {
            let at = Q6kGroupAt {
                blk,
                pairs_at,
                half,
                x,
                cols,
                bias,
                stride: nblk * 16,
            };
            q6k_group::<T, VNNI, UNPACKED, false>(&at, 2 * cc, &mut sup);
            q6k_group::<T, VNNI, UNPACKED, true>(&at, 2 * cc + 1, &mut sup);
        }
        let dw = f16x8(blk.add(dw_at + 16 * half));
        for t in 0..T {
            let d = _mm256_set1_ps(*dx.add(t * nblk + b));
            f[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, d), _mm256_cvtepi32_ps(sup[t]), f[t]);
        }
    }
    for (t, f) in f.iter().enumerate() {
        _mm256_storeu_ps(out.add(t * stride + 8 * half), *f);
    }
}

/// Where [`q6k_group`] reads: block `blk` of a group (packed, or unpacked with `pairs_at` 4096),
/// its half, and the block's activations (`x`, row stride `cols`) and biases (`bias`, token
/// stride `stride`).
struct Q6kGroupAt {
    blk: *const u8,
    pairs_at: usize,
    half: usize,
    x: *const i8,
    cols: usize,
    bias: *const i32,
    stride: usize,
}

/// Group `gi` (16 values; `ODD == (gi % 2 == 1)`) of [`q6k_tile_half`]: adds each row's scaled
/// integer dot and bias term to `sup`. The parity is a constant, as in [`q4k_sub_block`], so that
/// the scale pattern and the bias step compile without a branch.
#[inline(always)]
unsafe fn q6k_group<const T: usize, const VNNI: bool, const UNPACKED: bool, const ODD: bool>(
    at: &Q6kGroupAt,
    gi: usize,
    sup: &mut [__m256i; T],
) {
    let (blk, half, cols, bias) = (at.blk, at.half, at.cols, at.bias);
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    if !UNPACKED {
        prefetch(half, blk.wrapping_add(2 * 3360 + 256 * gi), 4);
    }
    let cc = gi / 2;
    let pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128(
        blk.add(at.pairs_at + 32 * cc + 16 * half) as *const _
    ));
    let weight = |kq: usize| {
        if UNPACKED {
            load(blk.add(64 * (4 * gi + kq) + 32 * half))
        } else {
            q6k_weights(blk, gi, kq, half, m4, m30)
        }
    };
    let x = |t: usize, kg: usize| bcast4(at.x.add(t * cols + 32 * cc + 4 * kg));
    if !VNNI {
        if !ODD {
            // The bias terms of groups 2cc and 2cc+1 (see `q6k_tile`).
            let sc32 = _mm256_slli_epi16::<5>(pairs);
            for (t, s) in sup.iter_mut().enumerate() {
                let bp = bias.add(t * at.stride + gi);
                let lo = (*bp >> 5) as u16 as u32;
                let hi = (*bp.add(1) >> 5) as u16 as u32;
                let bv = _mm256_set1_epi32((lo | (hi << 16)) as i32);
                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(sc32, bv));
            }
        }
        // `vpshufb` pattern as in `q6k_tile`: a row's even (odd) group scale into both 16-bit
        // halves of its lane.
        let pattern = _mm256_setr_epi8(
            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9,
            12, 13, 12, 13,
        );
        let pattern = if ODD {
            _mm256_add_epi8(pattern, _mm256_set1_epi8(2))
        } else {
            pattern
        };
        let sc = _mm256_shuffle_epi8(pairs, pattern);
        let mut acc = [_mm256_setzero_si256(); T];
        for kq in 0..4 {
            let kg = 4 * (gi % 2) + kq;
            let w = weight(kq);
            for t in 0..T {
                let prod = _mm256_maddubs_epi16(w, x(t, kg));
                if kq % 2 == 0 {
                    acc[t] = prod;
                } else {
                    let s16 = _mm256_add_epi16(acc[t], prod);
                    sup[t] = _mm256_add_epi32(sup[t], _mm256_madd_epi16(s16, sc));
                }
            }
        }
        return;
    }
    let scv = if ODD {
        _mm256_srai_epi32::<16>(pairs)
    } else {
        _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pairs))
    };
    let mut acc = [_mm256_setzero_si256(); T];
    for (t, a) in acc.iter_mut().enumerate() {
        *a = _mm256_set1_epi32(*bias.add(t * at.stride + gi));
    }
    for kq in 0..4 {
        let kg = 4 * (gi % 2) + kq;
        let w = weight(kq);
        for (t, a) in acc.iter_mut().enumerate() {
            *a = dp::<VNNI>(*a, w, x(t, kg));
        }
    }
    for t in 0..T {
        sup[t] = _mm256_add_epi32(sup[t], _mm256_mullo_epi32(acc[t], scv));
    }
}

/// [`q6k_tile_half`] on the packed layout, in the shape `tiled_k!` calls.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile_half_packed<const T: usize, const H: usize, const VNNI: bool>(
    g: &[u8],
    half: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    q6k_tile_half::<T, H, VNNI, false>(g, half, acts, t0, out, stride)
}

/// The six-bit values of group `gi`, step `kq` (four values of each of the half's eight rows) of
/// a packed Q6_K block, one per byte: the low nibble (of the byte's low or high half, by `cc`) ORed
/// with bits `2kq..2kq+2` of the high-bits byte moved to bits 4..6 (see the AVX-512 kernel).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q6k_weights(
    blk: *const u8,
    gi: usize,
    kq: usize,
    half: usize,
    m4: __m256i,
    m30: __m256i,
) -> __m256i {
    let cc = gi / 2;
    let kg = 4 * (gi % 2) + kq;
    let hd = load(blk.add(2048 + 64 * gi + 32 * half));
    let p = load(blk.add(64 * (8 * (cc / 2) + kg) + 32 * half));
    let lo = if cc.is_multiple_of(2) {
        _mm256_and_si256(p, m4)
    } else {
        _mm256_and_si256(_mm256_srli_epi16::<4>(p), m4)
    };
    let h = match kq {
        0 => _mm256_slli_epi16::<4>(hd),
        1 => _mm256_slli_epi16::<2>(hd),
        2 => hd,
        _ => _mm256_srli_epi16::<2>(hd),
    };
    _mm256_or_si256(lo, _mm256_and_si256(h, m30))
}

/// Bytes of an unpacked Q6_K block of sixteen rows: the values one per byte in the order the
/// tile reads them (`64 * (4 * gi + kq) + 32 * half`, 4096 bytes), then the packed block's scales
/// and `d` unchanged (its bytes 3072..3360).
const Q6K_UNPACKED_BLOCK: usize = 4096 + 288;

/// Unpacks a Q6_K group for [`q6k_tile_half`] with `UNPACKED` (see [`Unpacked`]). The values are
/// the ones the packed tile builds in registers, so the products are the same bit for bit.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_unpack(g: &[u8], nblk: usize, out: &mut [u8]) {
    debug_assert!(g.len() >= nblk * 3360 && out.len() >= nblk * Q6K_UNPACKED_BLOCK);
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    for b in 0..nblk {
        let blk = g.as_ptr().add(b * 3360);
        let dst = out[b * Q6K_UNPACKED_BLOCK..(b + 1) * Q6K_UNPACKED_BLOCK].as_mut_ptr();
        for gi in 0..16 {
            for kq in 0..4 {
                for half in 0..2 {
                    let w = q6k_weights(blk, gi, kq, half, m4, m30);
                    _mm256_storeu_si256(dst.add(64 * (4 * gi + kq) + 32 * half) as *mut _, w);
                }
            }
        }
        std::ptr::copy_nonoverlapping(blk.add(3072), dst.add(4096), 288);
    }
}

/// [`q6k_tile_half`] on unpacked groups, in the shape `halves_in_tiles_of_four!` calls.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tile_half_unpacked<const T: usize, const H: usize, const VNNI: bool>(
    g: &[u8],
    half: usize,
    acts: &Acts,
    t0: usize,
    out: *mut f32,
    stride: usize,
) {
    q6k_tile_half::<T, H, VNNI, true>(g, half, acts, t0, out, stride)
}

/// Q6_K on unpacked groups: both halves, tiles of up to four tokens.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_unpacked<const VNNI: bool>(
    g: &[u8],
    acts: &Acts,
    t0: usize,
    nt: usize,
    out: *mut f32,
    stride: usize,
) {
    halves_in_tiles_of_four!(q6k_tile_half_unpacked, g, acts, t0, nt, out, stride);
}

fn q6k_unpacked_choice<const VNNI: bool>() -> Unpacked {
    Unpacked {
        block_bytes: Q6K_UNPACKED_BLOCK,
        unpack: q6k_unpack,
        kernel: q6k_unpacked::<VNNI>,
    }
}
