//! Scalar kernels on the packed layout: the reference the SIMD kernels are tested against, and
//! the path on CPUs without AVX2.
//!
//! Each row's result is computed with exactly the operations, in exactly the order, that one SIMD
//! lane performs, so a SIMD kernel must agree with these bit for bit. The integer sums are GGML's.
//!
//! Q4_1 and Q8_0 also follow llama.cpp's float order exactly (`ggml_vec_dot_q4_1_q8_1`,
//! `ggml_vec_dot_q8_0_q8_0` and tinyBLAS on x86): every block's eight 4-value lane sums are
//! converted and accumulated separately (`acc[k] = fma(d_w·d_x, sum_k, acc[k])`), the eight
//! accumulators are reduced by [`ggml_hsum8`], and Q4_1 adds `Σ fma(m, s)` last. That makes each
//! output bit-identical to llama.cpp's, which keeps our logits on llama.cpp's side of near-ties
//! (activation re-quantization amplifies any rounding difference). The K-quant kernels use their
//! own (cheaper) float order; their integer parts are exact.
//!
//! Q4_1 and Q8_0 have a second order, [`FloatOrder::PerBlock`], for the SIMD kernels (AVX2 and
//! AVX-512): llama.cpp's order costs a conversion and a multiply-add per 4-value lane, which on
//! 256-bit registers without VNNI leaves the kernel bound by the multiply ports (52-58 against
//! 88-94 GMAC/s on one Zen 4 core, 64 tokens), and on AVX-512 costs eight conversions and eight
//! multiply-adds where the per-block order needs one and two. Both orders are exact in their integer parts; they differ only in where the
//! floats round.

use half::f16;

use super::act::Acts;
use super::layout::{q4k_packed_scale_min, Format, GROUP, Q4K_D, Q4K_DMIN};

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Σ over four lanes' dword chunks: `Σ_i u(chunk[4l+i]) * x[i]`.
#[inline]
fn dot4(chunk: &[u8], l: usize, shift: u32, mask: u8, x: &[i8]) -> i32 {
    (0..4)
        .map(|i| ((chunk[4 * l + i] >> shift) & mask) as i32 * x[i] as i32)
        .sum()
}

/// Where a kernel rounds the floats of its Q4_1 and Q8_0 products (the other formats have one
/// order each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatOrder {
    /// llama.cpp's order (see the module documentation): bit-identical to llama.cpp.
    Llama,
    /// One integer sum per 32-value block (Q8_0's corrections included), converted once:
    /// `f = fma(Σu·x, d_w·d_x, f)`, then for Q4_1 the block's minimum term `f = fma(m, s, f)`.
    PerBlock,
}

/// ggml's `hsum_float_8` (and tinyBLAS's `hsum`): `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline]
pub fn ggml_hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// The eight 4-value lane sums of a 32-value block (Q4_0, Q4_1, Q8_0) for row `l`, as ggml's
/// `vpdpbusd` lanes hold them: lane `k` covers values `4k..4k+4`. Each is Σ u·x (stored unsigned
/// quants times activations) plus `bias[k]`.
pub fn block32_lanes(format: Format, blk: &[u8], l: usize, x: &[i8], bias: [i32; 8]) -> [i32; 8] {
    std::array::from_fn(|k| {
        bias[k]
            + match format {
                // Q4 chunk j holds values 4j.. in its low nibbles and 16+4j.. in its high ones.
                Format::Q4_0 | Format::Q4_1 => {
                    let (j, shift) = (k % 4, 4 * (k / 4) as u32);
                    dot4(&blk[64 * j..64 * j + 64], l, shift, 0xF, &x[4 * k..])
                }
                Format::Q8_0 => dot4(&blk[64 * k..64 * k + 64], l, 0, 0xFF, &x[4 * k..]),
                Format::Q4K | Format::Q6K => unreachable!("not a 32-value format"),
            }
    })
}

/// Q4_K super-block integer parts for lane `l`: (Σ_sb sc·Σu·x, Σ_sb m·bsum32).
pub fn q4k_isums(blk: &[u8], l: usize, x: &[i8], bsum32: &[i16]) -> (i32, i32) {
    let mut sup = 0i32;
    for sb in 0..8 {
        let (j, shift) = (sb / 2, 4 * (sb % 2) as u32);
        let mut acc = 0;
        for kg in 0..8 {
            let c = &blk[64 * (8 * j + kg)..64 * (8 * j + kg) + 64];
            acc += dot4(c, l, shift, 0xF, &x[32 * sb + 4 * kg..]);
        }
        sup += acc * q4k_packed_scale_min(blk, sb, l).0 as i32;
    }
    let mut min = 0i32;
    for (sb, &bsum) in bsum32.iter().enumerate().take(8) {
        min += q4k_packed_scale_min(blk, sb, l).1 as i32 * bsum as i32;
    }
    (sup, min)
}

/// Q6_K super-block integer part for lane `l`: Σ_g sc·(Σv·x - 32·bsum16) (`bias` holds the
/// `-32·bsum16` terms).
pub fn q6k_isum(blk: &[u8], l: usize, x: &[i8], bias: &[i32]) -> i32 {
    let mut sup = 0i32;
    for g in 0..16 {
        let cc = g / 2;
        let (j, shift) = (cc / 2, 4 * (cc % 2) as u32);
        let mut acc = bias[g];
        for kq in 0..4 {
            let kg = 4 * (g % 2) + kq;
            let lo = &blk[64 * (8 * j + kg)..];
            let hi = &blk[2048 + 64 * g..];
            for i in 0..4 {
                let v = ((lo[4 * l + i] >> shift) & 0xF) | (((hi[4 * l + i] >> (2 * kq)) & 3) << 4);
                acc += v as i32 * x[32 * cc + 4 * kg + i] as i32;
            }
        }
        let sc = blk[3072 + 32 * (g / 2) + 2 * l + g % 2] as i8 as i32;
        sup += acc * sc;
    }
    sup
}

/// Computes the 16 rows of packed group `g` against tokens `t0..t0 + nt`, writing
/// `out[t * stride + l]` for `t < nt`, `l < 16`, with Q4_1's and Q8_0's floats rounded in `order`.
#[allow(clippy::too_many_arguments)]
pub fn group(
    format: Format,
    order: FloatOrder,
    g: &[u8],
    acts: &Acts,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    let pb = format.packed_bytes();
    let bs = format.block();
    for t in 0..nt {
        let tok = t0 + t;
        let x = acts.row(tok);
        let mut f = [0f32; GROUP];
        // Q4_1 and Q8_0: ggml's eight lane accumulators and Q4_1's Σ m·s, per row.
        let mut acc = [[0f32; 8]; GROUP];
        let mut summs = [0f32; GROUP];
        for b in 0..acts.nblk {
            let blk = &g[b * pb..(b + 1) * pb];
            let xb = &x[b * bs..(b + 1) * bs];
            let ab = tok * acts.nblk + b;
            let dx = acts.d[ab];
            for (l, f) in f.iter_mut().enumerate() {
                match format {
                    Format::Q4_0 => {
                        let bias = [acts.bias[ab], 0, 0, 0, 0, 0, 0, 0];
                        let i: i32 = block32_lanes(format, blk, l, xb, bias).iter().sum();
                        *f = (i as f32).mul_add(f16_at(blk, 256 + 2 * l) * dx, *f);
                    }
                    Format::Q4_1 if order == FloatOrder::PerBlock => {
                        let i: i32 = block32_lanes(format, blk, l, xb, [0; 8]).iter().sum();
                        *f = (i as f32).mul_add(f16_at(blk, 256 + 2 * l) * dx, *f);
                        *f = f16_at(blk, 288 + 2 * l).mul_add(acts.s[ab], *f);
                    }
                    Format::Q4_1 => {
                        let lanes = block32_lanes(format, blk, l, xb, [0; 8]);
                        let dd = f16_at(blk, 256 + 2 * l) * dx;
                        for (a, &i) in acc[l].iter_mut().zip(&lanes) {
                            *a = (i as f32).mul_add(dd, *a);
                        }
                        summs[l] = f16_at(blk, 288 + 2 * l).mul_add(acts.s[ab], summs[l]);
                    }
                    Format::Q8_0 if order == FloatOrder::PerBlock => {
                        let bias = std::array::from_fn(|k| acts.bias[ab * 8 + k]);
                        let i: i32 = block32_lanes(format, blk, l, xb, bias).iter().sum();
                        *f = (i as f32).mul_add(f16_at(blk, 512 + 2 * l) * dx, *f);
                    }
                    Format::Q8_0 => {
                        let bias = std::array::from_fn(|k| acts.bias[ab * 8 + k]);
                        let lanes = block32_lanes(format, blk, l, xb, bias);
                        let dd = f16_at(blk, 512 + 2 * l) * dx;
                        for (a, &i) in acc[l].iter_mut().zip(&lanes) {
                            *a = (i as f32).mul_add(dd, *a);
                        }
                    }
                    Format::Q4K => {
                        let (sup, min) = q4k_isums(blk, l, xb, &acts.bsum32[ab * 8..ab * 8 + 8]);
                        let dd = f16_at(blk, Q4K_D + 2 * l) * dx;
                        let dm = f16_at(blk, Q4K_DMIN + 2 * l) * dx;
                        *f = dd.mul_add(sup as f32, *f);
                        *f = (-dm).mul_add(min as f32, *f);
                    }
                    Format::Q6K => {
                        let sup = q6k_isum(blk, l, xb, &acts.bias[ab * 16..ab * 16 + 16]);
                        *f = (f16_at(blk, 3328 + 2 * l) * dx).mul_add(sup as f32, *f);
                    }
                }
            }
        }
        let llama_order =
            matches!(format, Format::Q4_1 | Format::Q8_0) && order == FloatOrder::Llama;
        if llama_order {
            for (l, f) in f.iter_mut().enumerate() {
                *f = ggml_hsum8(&acc[l]) + summs[l];
            }
        }
        out[t * stride..t * stride + GROUP].copy_from_slice(&f);
    }
}
