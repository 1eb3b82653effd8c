//! Twin of the MMVQ quantized matmuls (`launch_mmvq_gguf_<type>_f32_plain`, candle-kernels
//! 0.11.1, `src/mmvq_gguf.cu`, adapted from llama.cpp's `mmvq.cu` / `vecdotq.cuh`): one output is
//! the dot product of a weight row, in GGUF blocks, with an activation row quantized to Q8_1
//! ([`super::q8_1`]).
//!
//! The kernel splits a row's blocks across a warp's threads; each thread calls
//! `vec_dot_<type>_q8_1(block, q8 blocks, iqs)` for its slice `iqs` of a block, which forms
//! integer sums with `dp4a` (four signed byte products added to an int) and turns them into one
//! f32; the threads' f32 partials are then added in a shared-memory and warp-shuffle tree.
//!
//! This twin runs the same `iqs` loops with the same bit manipulations (`dp4a`, `__vsubss4`, the
//! masks and shifts on little-endian 32-bit loads), so its **integer parts are the kernel's, bit
//! for bit**: [`block_int_sums`] exposes them per scale group. It then combines them per weight
//! block with the kernel's formula (the offsets of Q4_0/Q4_1/Q5_0/Q5_1 use the Q8_1 block's
//! stored sum `s`; the K-quants' mins use integer sums of the q8 values), and adds the blocks of
//! a row in order, in f32. The kernel's float order differs (per-thread partials, a tree
//! reduction, FMA contraction), so the contract is: integer parts bit-exact, each output within
//! about 1e-5 relative to the magnitude of its terms.

use half::f16;
use smolchat_gguf::GgmlDType;

use super::q8_1::quantize_rows_q8_1;
use crate::error::{EngineError, Result};
use crate::fast::layout::{padded_columns, BlockQ8_1, QK8_1};

/// The integer parts of one weight block's dot product with its Q8_1 blocks, as the kernel forms
/// them (summed over the threads that share a scale group; integer addition is exact, so the
/// split across threads does not matter).
///
/// Groups: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 have one group (the block's 32 values); Q2_K, Q3_K and
/// Q6_K have 16 groups of 16 values (one per scale); Q4_K and Q5_K have 8 groups of 32.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockInts {
    /// Per group: `Σ q·q8` times the group's integer scale (`sc`; 1 for the legacy types). `q` is
    /// the stored quant as the kernel feeds it to `dp4a`: unsigned nibbles (0..15) for Q4_0/Q4_1
    /// and Q4_K, 5-bit values (0..31) for Q5_0/Q5_1 and Q5_K, 2-bit (0..3) for Q2_K, signed for
    /// Q8_0 (-128..127), Q3_K (-4..3) and Q6_K (-32..31). The legacy types' offsets (−8, −16, or
    /// the min `m`) are applied in floats through the Q8_1 sum `s`, not here.
    pub dot: Vec<i32>,
    /// Per group, Q2_K, Q4_K and Q5_K only (empty otherwise): the group's integer min times
    /// `Σ q8`.
    pub min: Vec<i32>,
}

/// `ggml_cuda_dp4a`: `c` plus the four products of the signed bytes of `a` and `b`.
fn dp4a(a: i32, b: i32, c: i32) -> i32 {
    let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
    c + (0..4)
        .map(|i| i32::from(a[i] as i8) * i32::from(b[i] as i8))
        .sum::<i32>()
}

/// `__vsubss4`: per-byte signed saturating subtraction.
fn vsubss4(a: i32, b: i32) -> i32 {
    let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
    let mut r = [0u8; 4];
    for i in 0..4 {
        r[i] = (a[i] as i8).saturating_sub(b[i] as i8) as u8;
    }
    i32::from_le_bytes(r)
}

/// The little-endian 32-bit int at byte offset `off` (`get_int_from_uint8(x, off / 4)` and its
/// aligned and int8 variants).
fn i32_at(bytes: &[u8], off: usize) -> i32 {
    i32::from_le_bytes([bytes[off], bytes[off + 1], bytes[off + 2], bytes[off + 3]])
}

/// Int `i` (values `4 i .. 4 i + 4`) of a Q8_1 block's quants.
fn q8_int(y: &BlockQ8_1, i: usize) -> i32 {
    let q = &y.qs[4 * i..4 * i + 4];
    i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8])
}

pub(super) fn f16_at(bytes: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([bytes[off], bytes[off + 1]]).to_f32()
}

fn unsupported(dtype: GgmlDType) -> EngineError {
    EngineError::InvalidStep(format!("the fast tier has no MMVQ kernel for {dtype:?}"))
}

pub(super) fn check_supported(dtype: GgmlDType) -> Result<()> {
    match dtype {
        GgmlDType::Q4_0
        | GgmlDType::Q4_1
        | GgmlDType::Q5_0
        | GgmlDType::Q5_1
        | GgmlDType::Q8_0
        | GgmlDType::Q2K
        | GgmlDType::Q3K
        | GgmlDType::Q4K
        | GgmlDType::Q5K
        | GgmlDType::Q6K => Ok(()),
        _ => Err(unsupported(dtype)),
    }
}

/// Bytes of one row of `k` values of `dtype` (`k` a multiple of the type's block size).
pub fn row_bytes(dtype: GgmlDType, k: usize) -> usize {
    k / dtype.block_size() * dtype.type_size()
}

/// The integer parts one thread forms for its slice of a weight block: up to four contributions,
/// each `(group, Q8_1 block, Σ q·q8 × scale, min × Σ q8)` (`min` is 0 for the types without
/// mins). A block of `dtype` has [`slices`]`(dtype)` slices; the kernels give each to one thread
/// (candle's MMVQ: `vec_dot_<type>_q8_1(…, iqs)`; ours, `matvec_*`, the same slices), and summing
/// every slice's contributions per group gives the block's [`BlockInts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceInts {
    /// Contributions in use (1, 2 or 4).
    pub len: usize,
    /// The scale group of each contribution (an index into [`BlockInts::dot`]).
    pub group: [usize; 4],
    /// The Q8_1 block (of the weight block's `block_size / 32`) each contribution reads.
    pub q8: [usize; 4],
    pub dot: [i32; 4],
    pub min: [i32; 4],
}

impl SliceInts {
    fn push(&mut self, group: usize, q8: usize, dot: i32, min: i32) {
        let i = self.len;
        self.group[i] = group;
        self.q8[i] = q8;
        self.dot[i] = dot;
        self.min[i] = min;
        self.len += 1;
    }
}

/// Slices (threads) per weight block: `QI / VDR` of llama.cpp's `vec_dot_<type>_q8_1`.
pub fn slices(dtype: GgmlDType) -> usize {
    match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 => 2,
        GgmlDType::Q8_0 => 4,
        GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K => 16,
        GgmlDType::Q6K => 32,
        _ => 0,
    }
}

/// `Σ q·q8` of slice `s` (`iqs = 2 s`) of a Q4_0/Q4_1 block (16 bytes of nibbles: value `j` is
/// the low nibble of byte `j`, value `j + 16` the high one): QI = 4, VDR = 2, so the two slices
/// each cover 16 values with four `dp4a`s.
fn slice_q4(qs: &[u8], y: &BlockQ8_1, s: usize) -> i32 {
    let iqs = 2 * s;
    let mut sumi = 0;
    for i in 0..2 {
        let v = i32_at(qs, 4 * (iqs + i));
        let u0 = q8_int(y, iqs + i);
        let u1 = q8_int(y, iqs + i + 4); // + QI4_0
        let vi0 = v & 0x0F0F_0F0F;
        let vi1 = (v >> 4) & 0x0F0F_0F0F;
        sumi = dp4a(vi0, u0, sumi);
        sumi = dp4a(vi1, u1, sumi);
    }
    sumi
}

/// `Σ q·q8` of slice `s` of a Q5_0/Q5_1 block (`qh`: 4 bytes of high bits, bit `j` for value
/// `j`; `qs` as for Q4).
fn slice_q5(qh: &[u8], qs: &[u8], y: &BlockQ8_1, s: usize) -> i32 {
    let iqs = 2 * s;
    let mut sumi = 0;
    for i in 0..2 {
        let vl = i32_at(qs, 4 * (iqs + i));
        let vh = i32_at(qh, 0) >> (4 * (iqs + i));
        let u0 = q8_int(y, iqs + i);
        let u1 = q8_int(y, iqs + i + 4); // + QI5_0
        let mut vi0 = vl & 0x0F0F_0F0F;
        vi0 |= (vh << 4) & 0x0000_0010;
        vi0 |= (vh << 11) & 0x0000_1000;
        vi0 |= (vh << 18) & 0x0010_0000;
        vi0 |= (vh << 25) & 0x1000_0000;
        sumi = dp4a(vi0, u0, sumi);
        let mut vi1 = (vl >> 4) & 0x0F0F_0F0F;
        vi1 |= (vh >> 12) & 0x0000_0010;
        vi1 |= (vh >> 5) & 0x0000_1000;
        vi1 |= (vh << 2) & 0x0010_0000;
        vi1 |= (vh << 9) & 0x1000_0000;
        sumi = dp4a(vi1, u1, sumi);
    }
    sumi
}

/// `Σ q·q8` of slice `s` of a Q8_0 block's 32 signed bytes: QI8_0 = 8, VDR = 2, four slices.
fn slice_q8_0(qs: &[u8], y: &BlockQ8_1, s: usize) -> i32 {
    let iqs = 2 * s;
    let mut sumi = 0;
    for i in 0..2 {
        sumi = dp4a(i32_at(qs, 4 * (iqs + i)), q8_int(y, iqs + i), sumi);
    }
    sumi
}

/// Slice `iqs` of `vec_dot_q2_K_q8_1` (QI2_K = 16, VDR = 1). Block: 16 scale bytes (low nibble
/// scale, high nibble min), 64 bytes of 2-bit quants, f16 d, f16 dmin.
fn slice_q2_k(b: &[u8], y: &[BlockQ8_1], iqs: usize, out: &mut SliceInts) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let bq8_offset = 4 * (iqs / 8); // QR2_K * (iqs / QI8_1)
    let scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
    let v = i32_at(qs, 4 * iqs);
    for i in 0..4 {
        let u = q8_int(&y[bq8_offset + i], iqs % 8);
        let g = scale_offset + 2 * i;
        let sc = i32::from(scales[g]);
        let vi = (v >> (2 * i)) & 0x0303_0303;
        let mut m = sc >> 4;
        m |= m << 8;
        m |= m << 16;
        out.push(
            g,
            bq8_offset + i,
            dp4a(vi, u, 0) * (sc & 0xF),
            dp4a(m, u, 0),
        );
    }
}

/// Slice `iqs` of `vec_dot_q3_K_q8_1` (QI3_K = 16, VDR = 1). Block: 32 bytes hmask, 64 bytes of
/// low 2 bits, 12 bytes of 6-bit scales (biased by 32), f16 d.
fn slice_q3_k(b: &[u8], y: &[BlockQ8_1], iqs: usize, out: &mut SliceInts) {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let bq8_offset = 4 * (iqs / 8); // QR3_K * (iqs / (QI3_K / 2))
    let scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
    let vl = i32_at(qs, 4 * iqs);
    let vh = (!i32_at(hmask, 4 * (iqs % 8))) >> bq8_offset;
    for i in 0..4 {
        let u = q8_int(&y[bq8_offset + i], iqs % 8);
        let isc = scale_offset + 2 * i;
        let isc_low = isc % 8; // QK_K / 32
        let sc_shift_low = 4 * (isc / 8);
        let sc_low = (i32::from(scales[isc_low]) >> sc_shift_low) & 0xF;
        let isc_high = isc % 4; // QK_K / 64
        let sc_shift_high = 2 * (isc / 4);
        let sc_high = ((i32::from(scales[8 + isc_high]) >> sc_shift_high) & 3) << 4;
        let sc = (sc_low | sc_high) - 32;
        let vil = (vl >> (2 * i)) & 0x0303_0303;
        let vih = ((vh >> i) << 2) & 0x0404_0404;
        let vi = vsubss4(vil, vih);
        out.push(isc, bq8_offset + i, dp4a(vi, u, 0) * sc, 0);
    }
}

/// The `aux` scales and mins of `vec_dot_q{4,5}_K_q8_1` for sub-blocks `2 j, 2 j + 1`
/// (ggml's `get_scale_min_k4`, on 16-bit words): `([sc0, sc1], [m0, m1])`.
fn scale_min_k4_pair(scales: &[u8], j: usize) -> ([u8; 2], [u8; 2]) {
    let s = |i: usize| u16::from_le_bytes([scales[2 * i], scales[2 * i + 1]]);
    let (aux0, aux1) = if j < 2 {
        (s(j) & 0x3f3f, s(j + 2) & 0x3f3f)
    } else {
        (
            (s(j + 2) & 0x0f0f) | ((s(j - 2) & 0xc0c0) >> 2),
            ((s(j + 2) >> 4) & 0x0f0f) | ((s(j) & 0xc0c0) >> 2),
        )
    };
    (aux0.to_le_bytes(), aux1.to_le_bytes())
}

/// Slice `iqs` (even) of `vec_dot_q4_K_q8_1` (QI4_K = 32, VDR = 2). Block: f16 d, f16 dmin, 12
/// bytes of 6-bit scales and mins, 128 bytes of nibbles.
fn slice_q4_k(b: &[u8], y: &[BlockQ8_1], iqs: usize, out: &mut SliceInts) {
    let (scales, qs) = (&b[4..16], &b[16..144]);
    let bq8_offset = 2 * ((iqs / 2) / 4); // QR4_K * ((iqs / 2) / (QI8_1 / 2))
    let l = (iqs / 2) % 4;
    let q4 = 16 * bq8_offset + 4 * l;
    let v = [i32_at(qs, q4), i32_at(qs, q4 + 16)];
    let (sc, m) = scale_min_k4_pair(scales, bq8_offset / 2);
    for i in 0..2 {
        let y8 = &y[bq8_offset + i];
        let u = [q8_int(y8, l), q8_int(y8, l + 4)];
        let v0i = (v[0] >> (4 * i)) & 0x0F0F_0F0F;
        let v1i = (v[1] >> (4 * i)) & 0x0F0F_0F0F;
        let dot1 = dp4a(v1i, u[1], dp4a(v0i, u[0], 0));
        let dot2 = dp4a(0x0101_0101, u[1], dp4a(0x0101_0101, u[0], 0));
        out.push(
            bq8_offset + i,
            bq8_offset + i,
            dot1 * i32::from(sc[i]),
            dot2 * i32::from(m[i]),
        );
    }
}

/// Slice `iqs` (even) of `vec_dot_q5_K_q8_1` (QI5_K = 32, VDR = 2). Block: f16 d, f16 dmin, 12
/// bytes of scales and mins, 32 bytes of high bits, 128 bytes of nibbles.
fn slice_q5_k(b: &[u8], y: &[BlockQ8_1], iqs: usize, out: &mut SliceInts) {
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    let bq8_offset = 2 * ((iqs / 2) / 4);
    let l = (iqs / 2) % 4;
    let ql = 16 * bq8_offset + 4 * l;
    let vl = [i32_at(qs, ql), i32_at(qs, ql + 16)];
    let vh = [
        i32_at(qh, 4 * l) >> bq8_offset,
        i32_at(qh, 4 * l + 16) >> bq8_offset,
    ];
    let (sc, m) = scale_min_k4_pair(scales, bq8_offset / 2);
    for i in 0..2 {
        let y8 = &y[bq8_offset + i];
        let u = [q8_int(y8, l), q8_int(y8, l + 4)];
        let vl0i = (vl[0] >> (4 * i)) & 0x0F0F_0F0F;
        let vl1i = (vl[1] >> (4 * i)) & 0x0F0F_0F0F;
        let vh0i = ((vh[0] >> i) << 4) & 0x1010_1010;
        let vh1i = ((vh[1] >> i) << 4) & 0x1010_1010;
        let v0i = vl0i | vh0i;
        let v1i = vl1i | vh1i;
        let dot1 = dp4a(v0i, u[0], dp4a(v1i, u[1], 0));
        let dot2 = dp4a(0x0101_0101, u[0], dp4a(0x0101_0101, u[1], 0));
        out.push(
            bq8_offset + i,
            bq8_offset + i,
            dot1 * i32::from(sc[i]),
            dot2 * i32::from(m[i]),
        );
    }
}

/// Slice `iqs` of `vec_dot_q6_K_q8_1` (QI6_K = 32, VDR = 1). Block: 128 bytes of low nibbles,
/// 64 bytes of high 2-bit pairs, 16 signed scales, f16 d.
fn slice_q6_k(b: &[u8], y: &[BlockQ8_1], iqs: usize, out: &mut SliceInts) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let bq8_offset = 4 * (iqs / 16) + (iqs % 16) / 8;
    let scale_offset = 8 * (iqs / 16) + (iqs % 16) / 4;
    let vh_shift = 2 * ((iqs % 16) / 8);
    let vl = i32_at(ql, 4 * iqs);
    let vh = i32_at(qh, 4 * (8 * (iqs / 16) + iqs % 8)) >> vh_shift;
    for i in 0..2 {
        let g = scale_offset + 4 * i;
        let sc = i32::from(scales[g] as i8);
        let u = q8_int(&y[bq8_offset + 2 * i], iqs % 8);
        let vil = (vl >> (4 * i)) & 0x0F0F_0F0F;
        let vih = ((vh >> (4 * i)) << 4) & 0x3030_3030;
        let vi = vsubss4(vil | vih, 0x2020_2020);
        out.push(g, bq8_offset + 2 * i, dp4a(vi, u, 0) * sc, 0);
    }
}

/// The integer parts of slice `s` (`0..slices(dtype)`) of one weight block whose length and
/// dtype the caller has checked, against the block's Q8_1 blocks `y`.
pub(crate) fn slice_ints(dtype: GgmlDType, b: &[u8], y: &[BlockQ8_1], s: usize) -> SliceInts {
    let mut out = SliceInts::default();
    match dtype {
        GgmlDType::Q4_0 => out.push(0, 0, slice_q4(&b[2..18], &y[0], s), 0),
        GgmlDType::Q4_1 => out.push(0, 0, slice_q4(&b[4..20], &y[0], s), 0),
        GgmlDType::Q5_0 => out.push(0, 0, slice_q5(&b[2..6], &b[6..22], &y[0], s), 0),
        GgmlDType::Q5_1 => out.push(0, 0, slice_q5(&b[4..8], &b[8..24], &y[0], s), 0),
        GgmlDType::Q8_0 => out.push(0, 0, slice_q8_0(&b[2..34], &y[0], s), 0),
        GgmlDType::Q2K => slice_q2_k(b, y, s, &mut out),
        GgmlDType::Q3K => slice_q3_k(b, y, s, &mut out),
        GgmlDType::Q4K => slice_q4_k(b, y, 2 * s, &mut out),
        GgmlDType::Q5K => slice_q5_k(b, y, 2 * s, &mut out),
        GgmlDType::Q6K => slice_q6_k(b, y, s, &mut out),
        _ => {}
    }
    out
}

/// Scale groups of a block: 1 for the legacy types, 16 for Q2_K/Q3_K/Q6_K, 8 for Q4_K/Q5_K.
fn groups(dtype: GgmlDType) -> usize {
    match dtype {
        GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q6K => 16,
        GgmlDType::Q4K | GgmlDType::Q5K => 8,
        _ => 1,
    }
}

/// Integer parts of one block whose length and dtype the caller has checked: every slice's
/// contributions added per group.
fn ints_unchecked(dtype: GgmlDType, b: &[u8], y: &[BlockQ8_1]) -> BlockInts {
    let mut dot = vec![0; groups(dtype)];
    let with_min = matches!(dtype, GgmlDType::Q2K | GgmlDType::Q4K | GgmlDType::Q5K);
    let mut min = if with_min {
        vec![0; dot.len()]
    } else {
        Vec::new()
    };
    for s in 0..slices(dtype) {
        let part = slice_ints(dtype, b, y, s);
        for c in 0..part.len {
            dot[part.group[c]] += part.dot[c];
            if with_min {
                min[part.group[c]] += part.min[c];
            }
        }
    }
    BlockInts { dot, min }
}

/// The integer parts of one weight block (`dtype.type_size()` bytes of GGUF block) against its
/// `dtype.block_size() / 32` Q8_1 blocks (extra blocks in `y` are ignored), exactly as the CUDA
/// kernel forms them; see [`BlockInts`].
pub fn block_int_sums(dtype: GgmlDType, block: &[u8], y: &[BlockQ8_1]) -> Result<BlockInts> {
    check_supported(dtype)?;
    if block.len() != dtype.type_size() || y.len() * QK8_1 < dtype.block_size() {
        return Err(EngineError::InvalidStep(format!(
            "an MMVQ {dtype:?} block is {} bytes against {} Q8_1 blocks; got {} bytes and {} blocks",
            dtype.type_size(),
            dtype.block_size() / QK8_1,
            block.len(),
            y.len()
        )));
    }
    Ok(ints_unchecked(dtype, block, y))
}

/// One weight block's contribution, from its integer parts, with the kernel's per-call formulas
/// added over the calls of the block:
///
/// - Q4_0: `d4 * (sumi * d8 - (8 * vdr / QI4_0) * s8)` per thread, two threads: `d4 (sumi d8 - 8 s8)`;
/// - Q4_1: `sumi * (d4 d8) + (m4 s8) / (QI8_1 / (vdr * QR4_1))`, twice: `sumi d4 d8 + m4 s8`;
/// - Q5_0: `d5 * (sumi * d8 - (16 * vdr / QI5_0) * s8)`, twice: `d5 (sumi d8 - 16 s8)`;
/// - Q5_1: `sumi * (d5 d8) + (m5 s8) / (QI5_1 / vdr)`, twice: `sumi d5 d8 + m5 s8`;
/// - Q8_0: `sumi * d0 * d8`;
/// - Q2_K, Q4_K, Q5_K: `d * Σ_g d8_g dot_g - dmin * Σ_g d8_g min_g`;
/// - Q3_K, Q6_K: `d * Σ_g d8_g dot_g`;
///
/// where `d8_g` is the `d` of the Q8_1 block holding group `g`.
fn block_value(dtype: GgmlDType, b: &[u8], y: &[BlockQ8_1], ints: &BlockInts) -> f32 {
    let d8 = |i: usize| y[i].d.to_f32();
    let s8 = y[0].s.to_f32();
    let sumi = ints.dot.first().copied().unwrap_or(0) as f32;
    // Group g's Q8_1 block: two 16-value groups share one.
    let sixteens = matches!(dtype, GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q6K);
    let per_q8 = |g: usize| if sixteens { g / 2 } else { g };
    let weighted = |v: &[i32]| -> f32 {
        v.iter()
            .enumerate()
            .map(|(g, &x)| d8(per_q8(g)) * x as f32)
            .sum()
    };
    match dtype {
        GgmlDType::Q4_0 => f16_at(b, 0) * (sumi * d8(0) - 8.0 * s8),
        GgmlDType::Q5_0 => f16_at(b, 0) * (sumi * d8(0) - 16.0 * s8),
        GgmlDType::Q4_1 | GgmlDType::Q5_1 => sumi * (f16_at(b, 0) * d8(0)) + f16_at(b, 2) * s8,
        GgmlDType::Q8_0 => sumi * f16_at(b, 0) * d8(0),
        GgmlDType::Q2K => f16_at(b, 80) * weighted(&ints.dot) - f16_at(b, 82) * weighted(&ints.min),
        GgmlDType::Q3K => f16_at(b, 108) * weighted(&ints.dot),
        GgmlDType::Q4K | GgmlDType::Q5K => {
            f16_at(b, 0) * weighted(&ints.dot) - f16_at(b, 2) * weighted(&ints.min)
        }
        GgmlDType::Q6K => f16_at(b, 208) * weighted(&ints.dot),
        _ => 0.0,
    }
}

/// One output of the MMVQ kernel: the dot product of a weight row (`row`, the GGUF blocks of `k`
/// values of `dtype`) with an activation row quantized to Q8_1 (`y`, at least `k / 32` blocks;
/// a padded row's extra blocks are not read).
///
/// Errors for a dtype without an MMVQ kernel (only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K have
/// one) and for lengths that do not match.
pub fn dot_q8_1(dtype: GgmlDType, row: &[u8], y: &[BlockQ8_1], k: usize) -> Result<f32> {
    check_supported(dtype)?;
    let (bs, ts) = (dtype.block_size(), dtype.type_size());
    if !k.is_multiple_of(bs) || row.len() != row_bytes(dtype, k) || y.len() * QK8_1 < k {
        return Err(EngineError::InvalidStep(format!(
            "MMVQ {dtype:?} row of {k} values: needs k a multiple of {bs}, {} row bytes and {} \
             Q8_1 blocks; got {} bytes and {} blocks",
            row_bytes(dtype, k),
            k.div_ceil(QK8_1),
            row.len(),
            y.len()
        )));
    }
    let per = bs / QK8_1;
    let mut acc = 0.0f32;
    for (kbx, block) in row.chunks_exact(ts).enumerate() {
        let yb = &y[kbx * per..(kbx + 1) * per];
        let ints = ints_unchecked(dtype, block, yb);
        acc += block_value(dtype, block, yb, &ints);
    }
    Ok(acc)
}

/// The MMVQ matmul: `out[r × n + j] = dot_q8_1(weight row j, Q8_1 of activation row r)` for the
/// `n` weight rows of `w` (`n × row_bytes(dtype, k)` bytes) and the `m` rows of `x` (row-major
/// `[m][k]` f32), each quantized to Q8_1 and padded to [`padded_columns`]`(k)` values as the fast
/// tier uploads it. `out` is `[m][n]`.
pub fn matmul_q8_1(
    dtype: GgmlDType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) -> Result<()> {
    check_supported(dtype)?;
    let rb = row_bytes(dtype, k);
    if !k.is_multiple_of(dtype.block_size())
        || w.len() != n * rb
        || x.len() != m * k
        || out.len() != m * n
    {
        return Err(EngineError::InvalidStep(format!(
            "MMVQ {dtype:?} matmul [{m}×{k}]·[{n}×{k}]ᵀ: needs k a multiple of {}, {} weight \
             bytes, {} inputs and {} outputs; got {}, {} and {}",
            dtype.block_size(),
            n * rb,
            m * k,
            m * n,
            w.len(),
            x.len(),
            out.len()
        )));
    }
    let kp = padded_columns(k);
    let q = quantize_rows_q8_1(x, m, k, kp);
    let per_row = kp / QK8_1;
    for r in 0..m {
        let y = &q[r * per_row..(r + 1) * per_row];
        for j in 0..n {
            out[r * n + j] = dot_q8_1(dtype, &w[j * rb..(j + 1) * rb], y, k)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::twin::q8_1::quantize_row_q8_1;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    const TYPES: [GgmlDType; 10] = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// xorshift64*: deterministic test data.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// Uniform in [-1, 1).
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }

        /// Uniform integer in `lo..=hi`.
        fn int(&mut self, lo: i32, hi: i32) -> i32 {
            lo + (self.next() % (hi - lo + 1) as u64) as i32
        }
    }

    /// `n × k` weights quantized by candle: (GGUF bytes, dequantized f32). Magnitudes vary by
    /// 16-value group and rows get offsets, so scales and mins all matter.
    fn weights(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
        let mut rng = Rng(seed);
        let values: Vec<f32> = (0..n * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                let scale = 0.05 + ((c / 16 * 7 + r * 3) % 11) as f32 * 0.04;
                let offset = if r % 3 == 1 { 0.6 * scale } else { 0.0 };
                rng.uniform() * scale + offset
            })
            .collect();
        let t = Tensor::from_vec(values, (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        let bytes = q.data().unwrap().into_owned();
        let deq = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(bytes.len(), n * row_bytes(dtype, k));
        (bytes, deq)
    }

    /// `m × k` activations: row 0 plain, row 1 with an all-zero block and a wide range, row 2
    /// small values.
    fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng(seed);
        (0..m * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                match r % 3 {
                    0 => rng.uniform() * 2.0,
                    1 if (32..64).contains(&c) => 0.0,
                    1 => rng.uniform() * if c % 7 == 0 { 40.0 } else { 0.5 },
                    _ => rng.uniform() * 1e-3,
                }
            })
            .collect()
    }

    /// The value the kernel's formulas give for one row, in f64 from the dequantized weights and
    /// the dequantized Q8_1 activations (`d × q`), with the legacy types' offset terms taken from
    /// the stored sum `s` as the kernel does; and the magnitude of its terms.
    fn expected(dtype: GgmlDType, row: &[u8], w: &[f32], y: &[BlockQ8_1]) -> (f64, f64) {
        let (mut e, mut mag) = (0.0f64, 0.0f64);
        for (i, &wi) in w.iter().enumerate() {
            let b = &y[i / 32];
            let x = f64::from(b.d.to_f32()) * f64::from(b.qs[i % 32]);
            e += f64::from(wi) * x;
            mag += (f64::from(wi) * x).abs();
        }
        let ts = dtype.type_size();
        for (bi, blk) in row.chunks_exact(ts).enumerate() {
            if dtype.block_size() != 32 || dtype == GgmlDType::Q8_0 {
                break;
            }
            let b = &y[bi];
            let (d8, s) = (f64::from(b.d.to_f32()), f64::from(b.s.to_f32()));
            let sq8: f64 = b.qs.iter().map(|&q| f64::from(q)).sum();
            let d = f64::from(f16_at(blk, 0));
            // kernel − dequantized: Q4_0 uses (q − 8), the kernel q·d8 − 8 s.
            let (corr, c) = match dtype {
                GgmlDType::Q4_0 => (8.0 * d * (d8 * sq8 - s), 8.0 * d),
                GgmlDType::Q5_0 => (16.0 * d * (d8 * sq8 - s), 16.0 * d),
                _ => {
                    let m = f64::from(f16_at(blk, 2));
                    (m * (s - d8 * sq8), m)
                }
            };
            e += corr;
            mag += c.abs() * ((d8 * sq8).abs() + s.abs());
        }
        (e, mag)
    }

    #[test]
    fn dot_matches_dequantized_weights_for_every_type() {
        let (n, k, m) = (6, 512, 3);
        for (t, &dtype) in TYPES.iter().enumerate() {
            let (bytes, deq) = weights(dtype, n, k, 0x1234 + t as u64);
            let x = activations(m, k, 0x9876 + t as u64);
            let q = quantize_rows_q8_1(&x, m, k, padded_columns(k));
            let rb = row_bytes(dtype, k);
            for r in 0..m {
                let y = &q[r * 16..(r + 1) * 16];
                for j in 0..n {
                    let row = &bytes[j * rb..(j + 1) * rb];
                    let got = dot_q8_1(dtype, row, y, k).unwrap();
                    let (want, mag) = expected(dtype, row, &deq[j * k..(j + 1) * k], y);
                    let err = (f64::from(got) - want).abs();
                    assert!(
                        err <= 1e-5 * mag + 1e-30,
                        "{dtype:?} x{r} w{j}: {got} vs {want} (magnitude {mag})"
                    );
                    assert!(mag > 0.0);
                }
            }
        }
    }

    #[test]
    fn matmul_is_the_dot_per_output_and_close_to_the_f32_matmul() {
        // k = 256: the Q8_1 rows are padded to 512 values.
        let (n, k, m) = (8, 256, 3);
        for (t, &dtype) in TYPES.iter().enumerate() {
            let (bytes, deq) = weights(dtype, n, k, 0x55 + t as u64);
            let x = activations(m, k, 0x77 + t as u64);
            let mut out = vec![f32::NAN; m * n];
            matmul_q8_1(dtype, &bytes, n, k, &x, m, &mut out).unwrap();
            let q = quantize_rows_q8_1(&x, m, k, 512);
            let rb = row_bytes(dtype, k);
            for r in 0..m {
                for j in 0..n {
                    let row = &bytes[j * rb..(j + 1) * rb];
                    let y = &q[r * 16..(r + 1) * 16];
                    let dot = dot_q8_1(dtype, row, y, k).unwrap();
                    assert_eq!(out[r * n + j].to_bits(), dot.to_bits(), "{dtype:?}");
                    // Against the unquantized activations: each x is off by at most d8 / 2, and
                    // the legacy offsets see the f16 rounding of s besides.
                    let w = &deq[j * k..(j + 1) * k];
                    let xr = &x[r * k..(r + 1) * k];
                    let (mut want, mut tol) = (0.0f64, 0.0f64);
                    for (i, (&wi, &xi)) in w.iter().zip(xr).enumerate() {
                        let d8 = f64::from(y[i / 32].d.to_f32());
                        want += f64::from(wi) * f64::from(xi);
                        tol += f64::from(wi).abs() * (0.5 * d8 + f64::from(xi).abs() * 1e-3);
                    }
                    if dtype.block_size() == 32 && dtype != GgmlDType::Q8_0 {
                        for (bi, blk) in row.chunks_exact(dtype.type_size()).enumerate() {
                            let c = match dtype {
                                GgmlDType::Q4_0 => 8.0 * f16_at(blk, 0),
                                GgmlDType::Q5_0 => 16.0 * f16_at(blk, 0),
                                _ => f16_at(blk, 2),
                            };
                            let b = &y[bi];
                            let sum: f32 = xr[bi * 32..(bi + 1) * 32].iter().sum();
                            let d8 = b.d.to_f32();
                            tol += f64::from(c.abs()) * f64::from(16.0 * d8 + sum.abs() * 2e-3);
                        }
                    }
                    let got = f64::from(out[r * n + j]);
                    assert!(
                        (got - want).abs() <= tol * 1.01 + 1e-9,
                        "{dtype:?} x{r} w{j}: {got} vs {want} (tolerance {tol})"
                    );
                }
            }
        }
    }

    /// A random Q8_1 block (any i8, -128 included; `d` and `s` do not enter integer parts).
    fn q8_block(rng: &mut Rng) -> BlockQ8_1 {
        let mut qs = [0i8; 32];
        for q in &mut qs {
            *q = rng.int(-128, 127) as i8;
        }
        BlockQ8_1 {
            d: f16::from_f32(0.01),
            s: f16::from_f32(0.0),
            qs,
        }
    }

    /// Value `i` of the Q8_1 blocks.
    fn q8(y: &[BlockQ8_1], i: usize) -> i32 {
        i32::from(y[i / 32].qs[i % 32])
    }

    /// 32 values packed ggml's way for Q4/Q5: value j in the low nibble of byte j, value j + 16
    /// in the high one.
    fn pack_nibbles(q: &[i32]) -> Vec<u8> {
        (0..16)
            .map(|j| ((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)) as u8)
            .collect()
    }

    /// ggml's 6-bit scale/min packing for Q4_K and Q5_K (`quantize_row_q4_K_ref`).
    fn pack_scales_k4(sc: &[i32], m: &[i32]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..8 {
            let (ls, lm) = (sc[j] as u8, m[j] as u8);
            if j < 4 {
                s[j] = ls;
                s[j + 4] = lm;
            } else {
                s[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                s[j - 4] |= (ls >> 4) << 6;
                s[j] |= (lm >> 4) << 6;
            }
        }
        s
    }

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    /// Σ over `range` of `q[i] × q8[i]`, and Σ q8.
    fn sums(q: &[i32], y: &[BlockQ8_1], range: std::ops::Range<usize>) -> (i32, i32) {
        range.fold((0, 0), |(a, b), i| (a + q[i] * q8(y, i), b + q8(y, i)))
    }

    #[test]
    fn legacy_integer_parts_are_exact() {
        let mut rng = Rng(42);
        for round in 0..20 {
            let y = [q8_block(&mut rng)];
            // Q8_0: signed bytes, extremes included.
            let q: Vec<i32> = (0..32)
                .map(|i| match (i + round) % 9 {
                    0 => -128,
                    1 => 127,
                    _ => rng.int(-128, 127),
                })
                .collect();
            let mut b = f16_bytes(0.5).to_vec();
            b.extend(q.iter().map(|&v| v as i8 as u8));
            let want = sums(&q, &y, 0..32).0;
            let got = block_int_sums(GgmlDType::Q8_0, &b, &y).unwrap();
            assert_eq!(
                got,
                BlockInts {
                    dot: vec![want],
                    min: vec![]
                }
            );

            // Q4_0 / Q4_1: unsigned nibbles.
            let q: Vec<i32> = (0..32).map(|_| rng.int(0, 15)).collect();
            let want = sums(&q, &y, 0..32).0;
            let mut b0 = f16_bytes(0.25).to_vec();
            b0.extend(pack_nibbles(&q));
            assert_eq!(
                block_int_sums(GgmlDType::Q4_0, &b0, &y).unwrap().dot,
                [want]
            );
            let mut b1 = [f16_bytes(0.25), f16_bytes(-1.0)].concat();
            b1.extend(pack_nibbles(&q));
            assert_eq!(
                block_int_sums(GgmlDType::Q4_1, &b1, &y).unwrap().dot,
                [want]
            );

            // Q5_0 / Q5_1: 5-bit values, bit 4 of value j in bit j of qh.
            let q: Vec<i32> = (0..32).map(|_| rng.int(0, 31)).collect();
            let qh: u32 = (0..32).map(|j| ((q[j] as u32 >> 4) & 1) << j).sum();
            let want = sums(&q, &y, 0..32).0;
            let mut b0 = f16_bytes(0.25).to_vec();
            b0.extend(qh.to_le_bytes());
            b0.extend(pack_nibbles(&q));
            assert_eq!(
                block_int_sums(GgmlDType::Q5_0, &b0, &y).unwrap().dot,
                [want]
            );
            let mut b1 = [f16_bytes(0.25), f16_bytes(-1.0)].concat();
            b1.extend(qh.to_le_bytes());
            b1.extend(pack_nibbles(&q));
            assert_eq!(
                block_int_sums(GgmlDType::Q5_1, &b1, &y).unwrap().dot,
                [want]
            );
        }
    }

    #[test]
    fn k_quant_integer_parts_are_exact() {
        let mut rng = Rng(7);
        for _ in 0..20 {
            let y: Vec<BlockQ8_1> = (0..8).map(|_| q8_block(&mut rng)).collect();

            // Q4_K: 8 sub-blocks of 32, 6-bit scales and mins.
            let q: Vec<i32> = (0..256).map(|_| rng.int(0, 15)).collect();
            let sc: Vec<i32> = (0..8).map(|_| rng.int(0, 63)).collect();
            let m: Vec<i32> = (0..8).map(|_| rng.int(0, 63)).collect();
            let mut b = [f16_bytes(0.1), f16_bytes(0.2)].concat();
            b.extend(pack_scales_k4(&sc, &m));
            for n in (0..256).step_by(64) {
                b.extend((0..32).map(|l| (q[n + l] | (q[n + l + 32] << 4)) as u8));
            }
            let (dot, min): (Vec<i32>, Vec<i32>) = (0..8)
                .map(|g| {
                    let (d, s) = sums(&q, &y, 32 * g..32 * (g + 1));
                    (sc[g] * d, m[g] * s)
                })
                .unzip();
            let got = block_int_sums(GgmlDType::Q4K, &b, &y).unwrap();
            assert_eq!(
                got,
                BlockInts {
                    dot: dot.clone(),
                    min: min.clone()
                }
            );

            // Q5_K: the same with a fifth bit (sub-block g, value j: bit g of qh[j]).
            let q: Vec<i32> = (0..256).map(|_| rng.int(0, 31)).collect();
            let mut b = [f16_bytes(0.1), f16_bytes(0.2)].concat();
            b.extend(pack_scales_k4(&sc, &m));
            let mut qh = [0u8; 32];
            let mut ql = Vec::new();
            for (p, n) in (0..256).step_by(64).enumerate() {
                for j in 0..32 {
                    let (l1, l2) = (q[n + j], q[n + j + 32]);
                    qh[j] |= (((l1 >> 4) & 1) << (2 * p) | ((l2 >> 4) & 1) << (2 * p + 1)) as u8;
                    ql.push(((l1 & 0xF) | ((l2 & 0xF) << 4)) as u8);
                }
            }
            b.extend(qh);
            b.extend(ql);
            let (dot, min): (Vec<i32>, Vec<i32>) = (0..8)
                .map(|g| {
                    let (d, s) = sums(&q, &y, 32 * g..32 * (g + 1));
                    (sc[g] * d, m[g] * s)
                })
                .unzip();
            assert_eq!(
                block_int_sums(GgmlDType::Q5K, &b, &y).unwrap(),
                BlockInts { dot, min }
            );

            // Q2_K: 16 groups of 16, a byte each (scale | min << 4); value i's 2 bits at
            // qs[32 (i / 128) + i % 32] >> 2 ((i % 128) / 32).
            let q: Vec<i32> = (0..256).map(|_| rng.int(0, 3)).collect();
            let sc: Vec<i32> = (0..16).map(|_| rng.int(0, 15)).collect();
            let m: Vec<i32> = (0..16).map(|_| rng.int(0, 15)).collect();
            let mut b: Vec<u8> = (0..16).map(|g| (sc[g] | (m[g] << 4)) as u8).collect();
            for j in (0..256).step_by(128) {
                b.extend((0..32).map(|l| {
                    (q[j + l] | q[j + l + 32] << 2 | q[j + l + 64] << 4 | q[j + l + 96] << 6) as u8
                }));
            }
            b.extend(f16_bytes(0.1));
            b.extend(f16_bytes(0.2));
            let (dot, min): (Vec<i32>, Vec<i32>) = (0..16)
                .map(|g| {
                    let (d, s) = sums(&q, &y, 16 * g..16 * (g + 1));
                    (sc[g] * d, m[g] * s)
                })
                .unzip();
            assert_eq!(
                block_int_sums(GgmlDType::Q2K, &b, &y).unwrap(),
                BlockInts { dot, min }
            );

            // Q3_K: q in -4..3 stored as q + 4: the low 2 bits like Q2_K, bit 2 in hmask
            // (value i: bit (i / 32) of hmask[i % 32]); 6-bit scales biased by 32, packed as
            // `quantize_row_q3_K_ref` does.
            let q: Vec<i32> = (0..256).map(|_| rng.int(-4, 3)).collect();
            let sc: Vec<i32> = (0..16).map(|_| rng.int(-32, 31)).collect();
            let mut hmask = [0u8; 32];
            for (i, &v) in q.iter().enumerate() {
                if v + 4 > 3 {
                    hmask[i % 32] |= 1 << (i / 32);
                }
            }
            let mut b = hmask.to_vec();
            for j in (0..256).step_by(128) {
                b.extend((0..32).map(|l| {
                    let u = |i: usize| (q[i] + 4) & 3;
                    (u(j + l) | u(j + l + 32) << 2 | u(j + l + 64) << 4 | u(j + l + 96) << 6) as u8
                }));
            }
            let mut scales = [0u8; 12];
            for (j, &s) in sc.iter().enumerate() {
                let l = (s + 32) as u8;
                if j < 8 {
                    scales[j] = l & 0xF;
                } else {
                    scales[j - 8] |= (l & 0xF) << 4;
                }
                scales[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
            }
            b.extend(scales);
            b.extend(f16_bytes(0.1));
            let dot: Vec<i32> = (0..16)
                .map(|g| sc[g] * sums(&q, &y, 16 * g..16 * (g + 1)).0)
                .collect();
            assert_eq!(
                block_int_sums(GgmlDType::Q3K, &b, &y).unwrap(),
                BlockInts { dot, min: vec![] }
            );

            // Q6_K: q in -32..31 stored as q + 32, packed as `quantize_row_q6_K_ref` does.
            let q: Vec<i32> = (0..256).map(|_| rng.int(-32, 31)).collect();
            let sc: Vec<i32> = (0..16).map(|_| rng.int(-128, 127)).collect();
            let mut ql = [0u8; 128];
            let mut qh = [0u8; 64];
            for (h, j) in (0..256).step_by(128).enumerate() {
                for l in 0..32 {
                    let u = |i: usize| (q[i] + 32) as u8;
                    let (q1, q2, q3, q4) = (u(j + l), u(j + l + 32), u(j + l + 64), u(j + l + 96));
                    ql[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                    ql[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                    qh[32 * h + l] =
                        (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
                }
            }
            let mut b = ql.to_vec();
            b.extend(qh);
            b.extend(sc.iter().map(|&s| s as i8 as u8));
            b.extend(f16_bytes(0.1));
            let dot: Vec<i32> = (0..16)
                .map(|g| sc[g] * sums(&q, &y, 16 * g..16 * (g + 1)).0)
                .collect();
            assert_eq!(
                block_int_sums(GgmlDType::Q6K, &b, &y).unwrap(),
                BlockInts { dot, min: vec![] }
            );
        }
    }

    #[test]
    fn a_hand_built_q8_0_row_gives_the_exact_product() {
        // Two Q8_0 blocks with d = 0.5 and 0.25 against Q8_1 blocks of unit scale: every
        // float is exact, so the result is too.
        let mut row = Vec::new();
        for (d, base) in [(0.5f32, 1i8), (0.25, -3)] {
            row.extend(f16_bytes(d));
            row.extend((0..32).map(|i| (base + (i % 5) as i8) as u8));
        }
        let x: Vec<f32> = (0..64).map(|i| ((i * 7) % 23) as f32 - 11.0).collect();
        let mut y = [BlockQ8_1::default(); 2];
        let mut xs = x.clone();
        xs[0] = 127.0; // amax 127: d = 1, q = x
        xs[32] = -127.0;
        quantize_row_q8_1(&xs, &mut y);
        let mut want = 0.0f32;
        for (i, &xv) in xs.iter().enumerate() {
            let (d, base) = if i < 32 { (0.5, 1) } else { (0.25, -3) };
            want += d * (base + (i % 32 % 5) as i32) as f32 * xv;
        }
        assert_eq!(dot_q8_1(GgmlDType::Q8_0, &row, &y, 64).unwrap(), want);
    }

    #[test]
    fn other_types_and_bad_lengths_are_errors() {
        for dtype in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::BF16,
            GgmlDType::Q8_1,
            GgmlDType::Q8K,
        ] {
            let e = dot_q8_1(dtype, &[], &[], 0).unwrap_err().to_string();
            assert!(e.contains(&format!("no MMVQ kernel for {dtype:?}")), "{e}");
            assert!(block_int_sums(dtype, &[], &[]).is_err());
            assert!(matmul_q8_1(dtype, &[], 0, 0, &[], 0, &mut []).is_err());
        }
        let y = [BlockQ8_1::default(); 8];
        let t = GgmlDType::Q4K;
        assert_eq!(row_bytes(t, 512), 288);
        assert!(dot_q8_1(t, &[0; 144], &y, 256).is_ok());
        assert!(dot_q8_1(t, &[0; 143], &y, 256).is_err());
        assert!(dot_q8_1(t, &[0; 144], &y[..7], 256).is_err());
        assert!(dot_q8_1(GgmlDType::Q4_0, &[0; 18], &y, 16).is_err());
        assert!(block_int_sums(t, &[0; 144], &y[..7]).is_err());
        let mut out = [0.0; 2];
        assert!(matmul_q8_1(t, &[0; 288], 2, 256, &[0.0; 256], 1, &mut out).is_ok());
        assert!(matmul_q8_1(t, &[0; 288], 2, 256, &[0.0; 255], 1, &mut out).is_err());
        assert!(matmul_q8_1(t, &[0; 288], 2, 256, &[0.0; 256], 1, &mut out[..1]).is_err());
    }
}
