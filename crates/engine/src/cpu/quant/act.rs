//! Activation quantization, bit for bit as ggml's x86 build does it.
//!
//! llama.cpp quantizes each activation row to the weight type's dot-product partner before a
//! matrix product; matching its rounding exactly is what keeps our logits on llama.cpp's side of
//! near-ties. The rules (ggml-cpu/arch/x86/quants.c and ggml-quants.c):
//! - Q8_0 / Q8_1 (32 values): `d = amax / 127`, `id = 127 / amax` (0 when amax is 0),
//!   `q = round_half_even(x * id)` (`_mm256_round_ps(_MM_ROUND_NEAREST)`), `d` stored as f16;
//!   Q8_1 also stores `s = f16(d * Σq)` with the f32 `d`.
//! - Q8_K (256 values, `quantize_row_q8_K_ref`): `max` is the first value of largest magnitude
//!   (sign kept), `iscale = -127 / max`, `q = min(127, nearest_int(iscale * x))` where
//!   `nearest_int` rounds half to even, `d = 1 / iscale` (f32), `bsums[j] = Σ q[16j..16j+16]`;
//!   an all-zero block has `d = 0` and zero quants.
//!
//! Two outputs exist: [`Acts`], the layout our kernels read (quants contiguous per token, scales and
//! precomputed integer corrections beside them), and candle's block structs for the types that
//! still go through candle's `vec_dot`.

use half::f16;
use rayon::prelude::*;

/// Which partner format the activations were quantized to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActKind {
    /// Q8_0, 32-value blocks, with `bias[i] = -bias_mul * Σq` over each run of `bias_group`
    /// values (32: one per block; 4: one per `vpdpbusd` lane): the kernels' correction for weights
    /// stored as unsigned `q + bias_mul`.
    Q8_0 { bias_mul: i32, bias_group: usize },
    /// Q8_1, 32-value blocks, with `s`.
    Q8_1,
    /// Q8_K, 256-value blocks.
    Q8K,
}

/// Quantized activations for `n_tokens` rows of `cols` values.
///
/// For 32-value kinds, block `b` of token `t` has index `t * nblk + b` (Q8_0's `bias` has
/// `32 / bias_group` entries per block); for Q8_K, the 256-value
/// super-block `b` has `d[t * nblk + b]`, sixteen `bias` entries (one per 16 values, `-32 * bsum`,
/// the Q6_K offset) and eight `bsum32` entries (sums of 32 values, paired for `vpdpwssd`).
pub struct Acts {
    pub kind: ActKind,
    pub n_tokens: usize,
    pub cols: usize,
    /// Blocks per token row.
    pub nblk: usize,
    /// `[t * cols + c]`.
    pub qs: Vec<i8>,
    /// Block scale as the kernels multiply it (f16-rounded for Q8_0/Q8_1, f32 for Q8_K).
    pub d: Vec<f32>,
    /// Q8_1 only: `f16(d * Σq)` widened to f32.
    pub s: Vec<f32>,
    /// Integer correction each block's accumulator starts from (see the type docs).
    pub bias: Vec<i32>,
    /// Q8_K only: Σq over each 32 values.
    pub bsum32: Vec<i16>,
}

/// One token's input and its shares of the output arrays, as the zipped iterators yield them.
type RowSlices<'a> = (
    (((&'a [f32], &'a mut [i8]), &'a mut [f32]), &'a mut [f32]),
    (&'a mut [i32], &'a mut [i16]),
);

/// Values below which quantization stays on the calling thread.
const PAR_VALUES: usize = 1 << 15;

impl Acts {
    /// Quantizes `x` (`n_tokens * cols` values; `cols` a multiple of the block size).
    pub fn quantize(kind: ActKind, x: &[f32], n_tokens: usize, cols: usize) -> Self {
        assert_eq!(x.len(), n_tokens * cols, "activation size");
        let blk = match kind {
            ActKind::Q8K => 256,
            _ => 32,
        };
        assert_eq!(cols % blk, 0, "activation width");
        let nblk = cols / blk;
        // Per-token lengths of the side arrays (at least 1, so that they chunk per token).
        let bias_len = match kind {
            ActKind::Q8K => nblk * 16,
            ActKind::Q8_0 { bias_group, .. } => {
                assert!(bias_group > 0 && 32 % bias_group == 0, "bias group");
                cols / bias_group
            }
            ActKind::Q8_1 => 0,
        }
        .max(1);
        let s_len = if kind == ActKind::Q8_1 { nblk } else { 1 };
        let bsum_len = if kind == ActKind::Q8K { nblk * 8 } else { 1 };
        let mut a = SPARE.with(|spare| spare.take()).unwrap_or_default();
        a.kind = kind;
        a.n_tokens = n_tokens;
        a.cols = cols;
        a.nblk = nblk;
        refill(&mut a.qs, n_tokens * cols);
        refill(&mut a.d, n_tokens * nblk.max(1));
        refill(&mut a.s, n_tokens * s_len);
        refill(&mut a.bias, n_tokens * bias_len);
        refill(&mut a.bsum32, n_tokens * bsum_len);
        if n_tokens == 0 || cols == 0 {
            return a;
        }
        let simd = simd_available();
        let row = |((((x, q), d), s), (bias, bsum)): RowSlices<'_>| {
            quantize_row(kind, simd, x, q, d, s, bias, bsum)
        };
        if n_tokens > 1 && n_tokens * cols >= PAR_VALUES {
            x.par_chunks_exact(cols)
                .zip(a.qs.par_chunks_exact_mut(cols))
                .zip(a.d.par_chunks_exact_mut(nblk))
                .zip(a.s.par_chunks_exact_mut(s_len))
                .zip(
                    a.bias
                        .par_chunks_exact_mut(bias_len)
                        .zip(a.bsum32.par_chunks_exact_mut(bsum_len)),
                )
                .for_each(row);
        } else {
            x.chunks_exact(cols)
                .zip(a.qs.chunks_exact_mut(cols))
                .zip(a.d.chunks_exact_mut(nblk))
                .zip(a.s.chunks_exact_mut(s_len))
                .zip(
                    a.bias
                        .chunks_exact_mut(bias_len)
                        .zip(a.bsum32.chunks_exact_mut(bsum_len)),
                )
                .for_each(row);
        }
        a
    }

    /// Quants of token `t`.
    pub fn row(&self, t: usize) -> &[i8] {
        &self.qs[t * self.cols..(t + 1) * self.cols]
    }

    /// Hands the buffers back for the next [`Acts::quantize`] on this thread. Prefill activations
    /// run to megabytes; fresh allocations of that size come from the kernel as untouched pages,
    /// and faulting them in cost ~3% of a 3B prefill.
    pub fn recycle(self) {
        // Keep the larger set (one per thread: a few megabytes after a long prefill).
        SPARE.with(|spare| {
            let old = spare.take();
            let keep_new = old
                .as_ref()
                .is_none_or(|o| o.qs.capacity() <= self.qs.capacity());
            spare.set(if keep_new { Some(self) } else { old });
        });
    }
}

impl Default for Acts {
    fn default() -> Self {
        Self {
            kind: ActKind::Q8_1,
            n_tokens: 0,
            cols: 0,
            nblk: 0,
            qs: Vec::new(),
            d: Vec::new(),
            s: Vec::new(),
            bias: Vec::new(),
            bsum32: Vec::new(),
        }
    }
}

thread_local! {
    /// One set of activation buffers per thread, reused by [`Acts::quantize`].
    static SPARE: std::cell::Cell<Option<Acts>> = const { std::cell::Cell::new(None) };
}

/// Sets `v` to `len` zeros, reusing its allocation.
fn refill<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    v.clear();
    v.resize(len, T::default());
}

/// Whether the AVX2 quantizers can run (they compute exactly what the scalar ones do).
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // A forced scalar path (`SMOLCHAT_ISA=scalar`) covers the quantizers too.
        super::isa::Isa::best() != super::isa::Isa::Scalar
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Quantizes one token row into its share of each array.
#[allow(clippy::too_many_arguments)]
fn quantize_row(
    kind: ActKind,
    simd: bool,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    bias: &mut [i32],
    bsum32: &mut [i16],
) {
    let block32 = |x: &[f32], q: &mut [i8]| -> (f32, i32) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is true only when AVX2 and FMA were detected; slices are 32 long.
            return unsafe { x86::block_32(x, q) };
        }
        quantize_block_32_f32(x, q)
    };
    match kind {
        ActKind::Q8_0 {
            bias_mul,
            bias_group,
        } => {
            for ((xb, qb), d) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).zip(d) {
                *d = f16::from_f32(block32(xb, qb).0).to_f32();
            }
            for (qg, bias) in q.chunks_exact(bias_group).zip(bias) {
                *bias = -bias_mul * qg.iter().map(|&v| v as i32).sum::<i32>();
            }
        }
        ActKind::Q8_1 => {
            for (((xb, qb), d), s) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).zip(d).zip(s) {
                let (df, sum) = block32(xb, qb);
                *d = f16::from_f32(df).to_f32();
                *s = f16::from_f32(df * sum as f32).to_f32();
            }
        }
        ActKind::Q8K => {
            for (i, (xb, qb)) in x.chunks_exact(256).zip(q.chunks_exact_mut(256)).enumerate() {
                let mut bsums = [0i16; 16];
                #[cfg(target_arch = "x86_64")]
                let dk = if simd {
                    // SAFETY: AVX2 and FMA were detected; slices are 256 long.
                    unsafe { x86::block_k(xb, qb, &mut bsums) }
                } else {
                    quantize_block_k(xb, qb, &mut bsums)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let dk = quantize_block_k(xb, qb, &mut bsums);
                d[i] = dk;
                for (j, &bs) in bsums.iter().enumerate() {
                    bias[i * 16 + j] = -32 * bs as i32;
                }
                for j in 0..8 {
                    bsum32[i * 8 + j] = bsums[2 * j] + bsums[2 * j + 1];
                }
            }
        }
    }
}

/// The absolute maximum, as the x86 build computes it (`max_ps` of absolute values: NaN-free
/// inputs give the same value in any order).
#[inline]
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// ggml's x86 `quantize_row_q8_0` for one block: returns the f16 scale and Σq.
#[inline]
pub fn quantize_block_32(x: &[f32], q: &mut [i8]) -> (f16, i32) {
    let (d, sum) = quantize_block_32_f32(x, q);
    (f16::from_f32(d), sum)
}

/// [`quantize_block_32`] returning the f32 scale (Q8_1's `s` is computed from it).
#[inline]
fn quantize_block_32_f32(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    debug_assert_eq!((x.len(), q.len()), (32, 32));
    let amax = amax(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // |v * id| <= 127 by construction, so the cast cannot saturate.
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    (d, sum)
}

/// ggml's `quantize_row_q8_K_ref` for one 256-value block: returns `d`.
pub fn quantize_block_k(x: &[f32], q: &mut [i8], bsums: &mut [i16; 16]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax == 0.0 {
        q.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (j, bs) in bsums.iter_mut().enumerate() {
        *bs = q[16 * j..16 * j + 16].iter().map(|&v| v as i16).sum();
    }
    1.0 / iscale
}

/// ggml's `nearest_int`: round half to even (the magic-number trick is exact for |v| < 2^22, and
/// the values here are at most 127 in magnitude).
#[inline]
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// AVX2 versions of the block quantizers: ggml's own x86 sequence (the same multiply, the same
/// round-half-even), so they return exactly what the scalar functions return.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hmax(m: __m256) -> f32 {
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    }

    /// Rounds 32 values times `mul` to the nearest integer (ties to even), stores them as bytes in
    /// order and returns the four 8-lane integer vectors.
    ///
    /// # Safety
    /// AVX2 available; `x` and `q` hold at least 32 elements; results fit in i8.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn round_pack(x: *const f32, q: *mut i8, mul: __m256, cap: __m256i) -> [__m256i; 4] {
        let i: [__m256i; 4] = std::array::from_fn(|k| {
            // SAFETY: the caller guarantees 32 readable floats at `x`.
            let v = unsafe { _mm256_loadu_ps(x.add(8 * k)) };
            _mm256_min_epi32(
                _mm256_cvtps_epi32(_mm256_round_ps::<RNE>(_mm256_mul_ps(v, mul))),
                cap,
            )
        });
        // packs interleave 128-bit lanes; the permutation restores the order (as ggml does).
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: the caller guarantees 32 writable bytes at `q`.
        unsafe { _mm256_storeu_si256(q as *mut __m256i, p) };
        i
    }

    /// [`super::quantize_block_32_f32`].
    ///
    /// # Safety
    /// AVX2 and FMA available; `x` and `q` hold at least 32 elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block_32(x: &[f32], q: &mut [i8]) -> (f32, i32) {
        debug_assert!(x.len() >= 32 && q.len() >= 32);
        let p = x.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for k in 0..4 {
            // SAFETY: 32 floats at `p` (caller).
            m = _mm256_max_ps(
                m,
                _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(p.add(8 * k)) }),
            );
        }
        let amax = hmax(m);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        // |x·id| <= 127: the cap never binds.
        // SAFETY: 32 elements at `p` and `q` (caller).
        let i = unsafe {
            round_pack(
                p,
                q.as_mut_ptr(),
                _mm256_set1_ps(id),
                _mm256_set1_epi32(127),
            )
        };
        let sum = hsum(_mm256_add_epi32(
            _mm256_add_epi32(i[0], i[1]),
            _mm256_add_epi32(i[2], i[3]),
        ));
        (d, sum)
    }

    /// [`super::quantize_block_k`].
    ///
    /// # Safety
    /// AVX2 and FMA available; `x` and `q` hold at least 256 elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block_k(x: &[f32], q: &mut [i8], bsums: &mut [i16; 16]) -> f32 {
        debug_assert!(x.len() >= 256 && q.len() >= 256);
        let p = x.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for k in 0..32 {
            // SAFETY: 256 floats at `p` (caller).
            m = _mm256_max_ps(
                m,
                _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(p.add(8 * k)) }),
            );
        }
        let amax = hmax(m);
        if amax == 0.0 {
            q[..256].fill(0);
            bsums.fill(0);
            return 0.0;
        }
        // The first value of largest magnitude, sign kept (the scalar loop's strict `>`).
        let max = x[..256]
            .iter()
            .copied()
            .find(|v| v.abs() == amax)
            .unwrap_or(amax);
        let iscale = -127.0 / max;
        let (mul, cap) = (_mm256_set1_ps(iscale), _mm256_set1_epi32(127));
        for g in 0..8 {
            // SAFETY: values 32g..32g+32 lie inside the 256 of `x` and `q` (caller).
            let i = unsafe { round_pack(p.add(32 * g), q.as_mut_ptr().add(32 * g), mul, cap) };
            bsums[2 * g] = hsum(_mm256_add_epi32(i[0], i[1])) as i16;
            bsums[2 * g + 1] = hsum(_mm256_add_epi32(i[2], i[3])) as i16;
        }
        1.0 / iscale
    }
}

/// Layout twins of candle's activation blocks (`repr(C)`, same fields, same order; sizes are
/// checked below), so the candle path can be fed from the ggml-faithful quantizers.
#[repr(C)]
pub struct Q8_0Block {
    pub d: f16,
    pub qs: [i8; 32],
}

#[repr(C)]
pub struct Q8_1Block {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; 32],
}

#[repr(C)]
pub struct Q8KBlock {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

const _: () = {
    use candle_core::quantized::k_quants::{BlockQ8K, BlockQ8_0, BlockQ8_1};
    use std::mem::{align_of, size_of};
    assert!(size_of::<Q8_0Block>() == size_of::<BlockQ8_0>());
    assert!(size_of::<Q8_1Block>() == size_of::<BlockQ8_1>());
    assert!(size_of::<Q8KBlock>() == size_of::<BlockQ8K>());
    assert!(align_of::<Q8_0Block>() == align_of::<BlockQ8_0>());
    assert!(align_of::<Q8_1Block>() == align_of::<BlockQ8_1>());
    assert!(align_of::<Q8KBlock>() == align_of::<BlockQ8K>());
};

pub fn quantize_q8_0_blocks(x: &[f32], out: &mut [Q8_0Block]) {
    for (xb, yb) in x.chunks_exact(32).zip(out.iter_mut()) {
        yb.d = quantize_block_32(xb, &mut yb.qs).0;
    }
}

pub fn quantize_q8_1_blocks(x: &[f32], out: &mut [Q8_1Block]) {
    for (xb, yb) in x.chunks_exact(32).zip(out.iter_mut()) {
        // s = f16(d · Σq) with the f32 d, as ggml's x86 quantize_row_q8_1 computes it.
        let (d, sum) = quantize_block_32_f32(xb, &mut yb.qs);
        yb.d = f16::from_f32(d);
        yb.s = f16::from_f32(d * sum as f32);
    }
}

pub fn quantize_q8k_blocks(x: &[f32], out: &mut [Q8KBlock]) {
    for (xb, yb) in x.chunks_exact(256).zip(out.iter_mut()) {
        yb.d = quantize_block_k(xb, &mut yb.qs, &mut yb.bsums);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_rounds_half_to_even_with_127_over_amax() {
        // amax 127 makes id exactly 1, so x * id lands on the .5 ties unchanged.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 3.5;
        x[4] = 0.5;
        let mut q = [0i8; 32];
        let (d, sum) = quantize_block_32(&x, &mut q);
        assert_eq!(&q[..5], &[127, 2, -2, 4, 0]);
        assert_eq!(sum, 131);
        assert_eq!(d, f16::from_f32(1.0));
        let mut z = [0i8; 32];
        assert_eq!(quantize_block_32(&[0.0; 32], &mut z), (f16::ZERO, 0));
    }

    #[test]
    fn q8k_uses_signed_max_and_clamps_at_127() {
        let mut x = [0f32; 256];
        x[3] = -127.0; // the first value of largest magnitude: iscale = 1
        x[4] = 127.0;
        x[5] = 0.5; // rounds to 0
        x[6] = -1.5; // rounds to -2
        x[7] = 2.5; // rounds to 2
        let mut q = [0i8; 256];
        let mut bs = [0i16; 16];
        let d = quantize_block_k(&x, &mut q, &mut bs);
        assert_eq!(d, 1.0);
        assert_eq!(&q[3..8], &[-127, 127, 0, -2, 2]);
        // A negative max makes iscale positive.
        let mut y = [0f32; 256];
        y[0] = -1.0;
        y[1] = 1.0;
        let d = quantize_block_k(&y, &mut q, &mut bs);
        assert_eq!(d, 1.0 / 127.0);
        assert_eq!(&q[..2], &[-127, 127]);
        assert_eq!(bs[0], 0);
    }

    /// The AVX2 block quantizers return exactly what the scalar ones return, ties included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_quantizers_equal_scalar() {
        if !simd_available() {
            return;
        }
        let mut seed = 5u64;
        let mut rnd = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for case in 0..400 {
            let mut x: Vec<f32> = (0..256).map(|_| rnd() * 3.0).collect();
            match case % 4 {
                // Ties: amax 127 makes the scale exactly 1, half-integers sit on .5.
                0 => {
                    for (i, v) in x.iter_mut().enumerate() {
                        *v = (i % 50) as f32 - 24.5;
                    }
                    x[7] = 127.0;
                    x[200] = -127.0;
                }
                1 => x[..32].fill(0.0),
                2 => x[100] = -9.0, // a negative max
                _ => {}
            }
            for b in 0..8 {
                let (mut q1, mut q2) = ([0i8; 32], [0i8; 32]);
                let want = quantize_block_32_f32(&x[32 * b..32 * b + 32], &mut q1);
                // SAFETY: AVX2 and FMA were detected above.
                let got = unsafe { x86::block_32(&x[32 * b..32 * b + 32], &mut q2) };
                assert_eq!((got.0.to_bits(), got.1, q2), (want.0.to_bits(), want.1, q1));
            }
            let (mut q1, mut q2) = ([0i8; 256], [0i8; 256]);
            let (mut b1, mut b2) = ([0i16; 16], [0i16; 16]);
            let want = quantize_block_k(&x, &mut q1, &mut b1);
            // SAFETY: as above.
            let got = unsafe { x86::block_k(&x, &mut q2, &mut b2) };
            assert_eq!(
                (got.to_bits(), q2, b2),
                (want.to_bits(), q1, b1),
                "case {case}"
            );
        }
    }

    #[test]
    fn acts_bias_and_sums() {
        let x: Vec<f32> = (0..512).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        let a = Acts::quantize(ActKind::Q8K, &x, 2, 256);
        for t in 0..2 {
            let q = a.row(t);
            for j in 0..16 {
                let s: i32 = q[16 * j..16 * j + 16].iter().map(|&v| v as i32).sum();
                assert_eq!(a.bias[t * 16 + j], -32 * s);
            }
            for j in 0..8 {
                let s: i32 = q[32 * j..32 * j + 32].iter().map(|&v| v as i32).sum();
                assert_eq!(a.bsum32[t * 8 + j] as i32, s);
            }
        }
        for group in [4, 32] {
            let kind = ActKind::Q8_0 {
                bias_mul: 8,
                bias_group: group,
            };
            let a = Acts::quantize(kind, &x, 2, 256);
            for b in 0..512 / group {
                let s: i32 = a.qs[group * b..group * (b + 1)]
                    .iter()
                    .map(|&v| v as i32)
                    .sum();
                assert_eq!(a.bias[b], -8 * s);
            }
        }
    }
}
