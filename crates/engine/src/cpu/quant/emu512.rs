//! The AVX-512 intrinsics our kernels use (and AVX-VNNI's one instruction), emulated in plain
//! Rust, lane by lane, as Intel's instruction reference defines them (wrapping integer sums, one
//! rounding per fused multiply-add, round-to-nearest-even conversions).
//!
//! Why: most machines this project builds and tests on (the 2-core CI host among them) have no
//! AVX-512, so [`super::avx512`] could only be tested where a CPU happened to have it. `build.rs`
//! writes a copy of `avx512.rs` without its `#[target_feature]` attributes and its
//! `std::arch` import; `kernel_tests.rs` compiles that copy over these functions, so the very
//! same kernel source runs everywhere and is checked bit for bit against the scalar kernels. On a
//! CPU with AVX-512 both the real and the emulated kernels are checked against the same scalar
//! reference, which also checks this emulation against the hardware.
//!
//! Names and signatures mirror `std::arch::x86_64` so that the kernel source compiles unchanged;
//! the functions are `unsafe` where the real ones are (pointer reads and writes).

#![allow(non_camel_case_types)]

use half::f16;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct __m512i([u8; 64]);
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct __m512([f32; 16]);
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct __m256i([u8; 32]);
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct __m128i([u8; 16]);

pub const _MM_HINT_T0: i32 = 3;
pub const _MM_HINT_T1: i32 = 2;

impl __m512i {
    fn i32s(self) -> [i32; 16] {
        std::array::from_fn(|i| {
            i32::from_le_bytes([
                self.0[4 * i],
                self.0[4 * i + 1],
                self.0[4 * i + 2],
                self.0[4 * i + 3],
            ])
        })
    }
    fn from_i32s(v: [i32; 16]) -> Self {
        let mut b = [0u8; 64];
        for (i, x) in v.iter().enumerate() {
            b[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
        }
        __m512i(b)
    }
    fn u16s(self) -> [u16; 32] {
        std::array::from_fn(|i| u16::from_le_bytes([self.0[2 * i], self.0[2 * i + 1]]))
    }
    fn from_u16s(v: [u16; 32]) -> Self {
        let mut b = [0u8; 64];
        for (i, x) in v.iter().enumerate() {
            b[2 * i..2 * i + 2].copy_from_slice(&x.to_le_bytes());
        }
        __m512i(b)
    }
    fn map_i32(self, f: impl Fn(i32) -> i32) -> Self {
        Self::from_i32s(self.i32s().map(f))
    }
    fn zip_i32(self, o: Self, f: impl Fn(i32, i32) -> i32) -> Self {
        let (a, b) = (self.i32s(), o.i32s());
        Self::from_i32s(std::array::from_fn(|i| f(a[i], b[i])))
    }
}

impl __m512 {
    fn zip(self, o: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        __m512(std::array::from_fn(|i| f(self.0[i], o.0[i])))
    }
}

pub unsafe fn _mm512_setzero_si512() -> __m512i {
    __m512i([0; 64])
}

pub unsafe fn _mm512_setzero_ps() -> __m512 {
    __m512([0.0; 16])
}

pub unsafe fn _mm512_set1_epi8(a: i8) -> __m512i {
    __m512i([a as u8; 64])
}

pub unsafe fn _mm512_set1_epi32(a: i32) -> __m512i {
    __m512i::from_i32s([a; 16])
}

pub unsafe fn _mm512_set1_ps(a: f32) -> __m512 {
    __m512([a; 16])
}

pub unsafe fn _mm512_loadu_si512(p: *const __m512i) -> __m512i {
    p.read_unaligned()
}

pub unsafe fn _mm256_loadu_si256(p: *const __m256i) -> __m256i {
    p.read_unaligned()
}

pub unsafe fn _mm_loadu_si128(p: *const __m128i) -> __m128i {
    p.read_unaligned()
}

pub unsafe fn _mm512_storeu_ps(p: *mut f32, a: __m512) {
    (p as *mut [f32; 16]).write_unaligned(a.0)
}

/// A hint: nothing to emulate.
pub unsafe fn _mm_prefetch<const STRATEGY: i32>(_p: *const i8) {}

pub unsafe fn _mm512_cvtph_ps(a: __m256i) -> __m512 {
    __m512(std::array::from_fn(|i| {
        f16::from_le_bytes([a.0[2 * i], a.0[2 * i + 1]]).to_f32()
    }))
}

/// Round to nearest, ties to even (MXCSR's default), as Rust's `as` does.
pub unsafe fn _mm512_cvtepi32_ps(a: __m512i) -> __m512 {
    __m512(a.i32s().map(|x| x as f32))
}

pub unsafe fn _mm512_add_ps(a: __m512, b: __m512) -> __m512 {
    a.zip(b, |x, y| x + y)
}

pub unsafe fn _mm512_mul_ps(a: __m512, b: __m512) -> __m512 {
    a.zip(b, |x, y| x * y)
}

/// `a·b + c`, rounded once.
pub unsafe fn _mm512_fmadd_ps(a: __m512, b: __m512, c: __m512) -> __m512 {
    __m512(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
}

/// `-(a·b) + c`, rounded once.
pub unsafe fn _mm512_fnmadd_ps(a: __m512, b: __m512, c: __m512) -> __m512 {
    __m512(std::array::from_fn(|i| (-a.0[i]).mul_add(b.0[i], c.0[i])))
}

pub unsafe fn _mm512_add_epi32(a: __m512i, b: __m512i) -> __m512i {
    a.zip_i32(b, i32::wrapping_add)
}

/// The low 32 bits of each product.
pub unsafe fn _mm512_mullo_epi32(a: __m512i, b: __m512i) -> __m512i {
    a.zip_i32(b, i32::wrapping_mul)
}

pub unsafe fn _mm512_and_si512(a: __m512i, b: __m512i) -> __m512i {
    __m512i(std::array::from_fn(|i| a.0[i] & b.0[i]))
}

pub unsafe fn _mm512_or_si512(a: __m512i, b: __m512i) -> __m512i {
    __m512i(std::array::from_fn(|i| a.0[i] | b.0[i]))
}

/// Logical right shift of each 32-bit lane (a count above 31 clears it).
pub unsafe fn _mm512_srli_epi32<const IMM8: u32>(a: __m512i) -> __m512i {
    a.map_i32(|x| (x as u32).checked_shr(IMM8).unwrap_or(0) as i32)
}

/// Logical shift of each 16-bit lane (a count above 15 clears it).
pub unsafe fn _mm512_srli_epi16<const IMM8: u32>(a: __m512i) -> __m512i {
    __m512i::from_u16s(a.u16s().map(|x| x.checked_shr(IMM8).unwrap_or(0)))
}

pub unsafe fn _mm512_slli_epi16<const IMM8: u32>(a: __m512i) -> __m512i {
    __m512i::from_u16s(a.u16s().map(|x| x.checked_shl(IMM8).unwrap_or(0)))
}

pub unsafe fn _mm512_slli_epi32<const IMM8: u32>(a: __m512i) -> __m512i {
    a.map_i32(|x| x.checked_shl(IMM8).unwrap_or(0))
}

/// Arithmetic shift of each 32-bit lane (a count above 31 fills it with the sign).
pub unsafe fn _mm512_srai_epi32<const IMM8: u32>(a: __m512i) -> __m512i {
    a.map_i32(|x| x >> IMM8.min(31))
}

/// Each result bit is bit `(a << 2) | (b << 1) | c` of `IMM8`.
pub unsafe fn _mm512_ternarylogic_epi32<const IMM8: i32>(
    a: __m512i,
    b: __m512i,
    c: __m512i,
) -> __m512i {
    __m512i(std::array::from_fn(|i| {
        (0..8).fold(0u8, |r, bit| {
            let idx =
                ((a.0[i] >> bit) & 1) << 2 | ((b.0[i] >> bit) & 1) << 1 | ((c.0[i] >> bit) & 1);
            r | ((((IMM8 as u8) >> idx) & 1) << bit)
        })
    }))
}

/// `vpdpbusd`'s rule for lanes of any width: `src[i] + Σ_{k<4} u8(a[4i+k])·i8(b[4i+k])`,
/// wrapping (not saturating).
fn dpbusd_lanes<const N: usize>(src: [i32; N], a: &[u8], b: &[u8]) -> [i32; N] {
    std::array::from_fn(|i| {
        (0..4).fold(src[i], |acc, k| {
            acc.wrapping_add(a[4 * i + k] as i32 * b[4 * i + k] as i8 as i32)
        })
    })
}

pub unsafe fn _mm512_dpbusd_epi32(src: __m512i, a: __m512i, b: __m512i) -> __m512i {
    __m512i::from_i32s(dpbusd_lanes(src.i32s(), &a.0, &b.0))
}

/// AVX-VNNI's 256-bit `vpdpbusd` on the real `std::arch` type, for the AVX2 kernels' VNNI
/// variants on CPUs without AVX-VNNI (see `avx2::EMULATE_VNNI`).
#[cfg(target_arch = "x86_64")]
pub fn dpbusd_avx_vnni(
    src: std::arch::x86_64::__m256i,
    a: std::arch::x86_64::__m256i,
    b: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::__m256i as Ymm;
    // SAFETY: plain 32-byte values; every bit pattern is a valid array of integers and back.
    unsafe {
        let (src, a, b) = (
            std::mem::transmute::<Ymm, [i32; 8]>(src),
            std::mem::transmute::<Ymm, [u8; 32]>(a),
            std::mem::transmute::<Ymm, [u8; 32]>(b),
        );
        std::mem::transmute::<[i32; 8], Ymm>(dpbusd_lanes(src, &a, &b))
    }
}

/// `src + Σ_{k<2} i16(a[2i+k])·i16(b[2i+k])` per 32-bit lane, wrapping (not saturating).
pub unsafe fn _mm512_dpwssd_epi32(src: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let (s, a, b) = (src.i32s(), a.u16s(), b.u16s());
    __m512i::from_i32s(std::array::from_fn(|i| {
        (0..2).fold(s[i], |acc, k| {
            acc.wrapping_add((a[2 * i + k] as i16 as i32).wrapping_mul(b[2 * i + k] as i16 as i32))
        })
    }))
}

/// 32 signed bytes widened to 16 bits.
pub unsafe fn _mm512_cvtepi8_epi16(a: __m256i) -> __m512i {
    __m512i::from_u16s(std::array::from_fn(|i| a.0[i] as i8 as i16 as u16))
}

/// 32 unsigned bytes widened to 16 bits.
pub unsafe fn _mm512_cvtepu8_epi16(a: __m256i) -> __m512i {
    __m512i::from_u16s(std::array::from_fn(|i| a.0[i] as u16))
}

/// 16 unsigned bytes widened to 32 bits.
pub unsafe fn _mm512_cvtepu8_epi32(a: __m128i) -> __m512i {
    __m512i::from_i32s(std::array::from_fn(|i| a.0[i] as i32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(f: impl Fn(usize) -> u8) -> __m512i {
        __m512i(std::array::from_fn(f))
    }

    /// Worked examples from the instruction reference's definitions, one per operation whose
    /// semantics are easy to get wrong (signedness, saturation, shift counts, truth tables).
    #[test]
    fn emulated_intrinsics_follow_the_instruction_reference() {
        unsafe {
            // vpdpbusd: unsigned a, signed b, no saturation: 4·(255·-128) + i32::MAX wraps.
            let r = _mm512_dpbusd_epi32(
                _mm512_set1_epi32(i32::MAX),
                _mm512_set1_epi8(-1),
                _mm512_set1_epi8(-128),
            );
            assert_eq!(r.i32s()[7], i32::MAX.wrapping_add(4 * 255 * -128));
            let r = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(),
                bytes(|i| i as u8),
                _mm512_set1_epi32(i32::from_le_bytes([1, 2, 0xFF, 3])),
            );
            // Lane 1: bytes 4..8 = 4, 5, 6, 7 against 1, 2, -1, 3.
            assert_eq!(r.i32s()[1], 4 + 10 - 6 + 21);
            // AVX-VNNI's 256-bit form follows the same rule on the real register type.
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::x86_64::__m256i as Ymm;
                let u = std::mem::transmute::<[u8; 32], Ymm>(std::array::from_fn(|i| i as u8));
                let x = std::mem::transmute::<[i8; 32], Ymm>(
                    [1, 2, -1, 3].repeat(8).try_into().unwrap(),
                );
                let acc = std::mem::transmute::<[i32; 8], Ymm>([10; 8]);
                let r = std::mem::transmute::<Ymm, [i32; 8]>(dpbusd_avx_vnni(acc, u, x));
                assert_eq!(r[1], 10 + 4 + 10 - 6 + 21);
            }
            // vpdpwssd: signed 16-bit pairs, wrapping past i32.
            let m = __m512i::from_u16s([0x8000; 32]);
            let r = _mm512_dpwssd_epi32(_mm512_setzero_si512(), m, m);
            assert_eq!(r.i32s()[0], (2i64 * 32768 * 32768) as i32);
            // Shifts: 16-bit lanes do not carry into each other; srai keeps the sign.
            let r = _mm512_srli_epi16::<4>(__m512i::from_u16s([0xABCD; 32]));
            assert_eq!(r.u16s()[31], 0x0ABC);
            let r = _mm512_slli_epi16::<4>(__m512i::from_u16s([0xABCD; 32]));
            assert_eq!(r.u16s()[0], 0xBCD0);
            assert_eq!(_mm512_srli_epi16::<16>(_mm512_set1_epi8(-1)).u16s()[3], 0);
            let r = _mm512_srai_epi32::<16>(_mm512_set1_epi32(-0x12345));
            assert_eq!(r.i32s()[2], -2);
            let r = _mm512_slli_epi32::<16>(_mm512_set1_epi32(0x1234_5678));
            assert_eq!(r.i32s()[0], 0x5678_0000);
            // Logical, not arithmetic.
            let r = _mm512_srli_epi32::<4>(_mm512_set1_epi32(-0x10));
            assert_eq!(r.i32s()[5], 0x0FFF_FFFF);
            let r = _mm512_or_si512(_mm512_set1_epi32(0x0F00), _mm512_set1_epi32(0x00F1));
            assert_eq!(r.i32s()[15], 0x0FF1);
            // 0xF8 = a | (b & c).
            let r = _mm512_ternarylogic_epi32::<0xF8>(
                _mm512_set1_epi8(0x0F),
                _mm512_set1_epi8(0x7C),
                _mm512_set1_epi8(0x30),
            );
            assert_eq!(r.0[9], 0x3F);
            // Widening.
            let w = __m256i(std::array::from_fn(|i| (i as u8).wrapping_mul(37)));
            assert_eq!(_mm512_cvtepi8_epi16(w).u16s()[5], -71i16 as u16);
            assert_eq!(_mm512_cvtepu8_epi16(w).u16s()[5], 185);
            let n = __m128i([200; 16]);
            assert_eq!(_mm512_cvtepu8_epi32(n).i32s()[15], 200);
            // Floats: conversions round to nearest even; the fused forms round once.
            assert_eq!(
                _mm512_cvtepi32_ps(_mm512_set1_epi32(16_777_219)).0[0],
                16_777_220.0
            );
            let (a, b) = (1.0 + f32::EPSILON, 1.0 - f32::EPSILON);
            let c = -1.0f32;
            let fused = _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_set1_ps(b), _mm512_set1_ps(c));
            assert_eq!(fused.0[0], -f32::EPSILON * f32::EPSILON);
            assert_ne!(fused.0[0], a * b + c);
            let fnm = _mm512_fnmadd_ps(_mm512_set1_ps(a), _mm512_set1_ps(b), _mm512_set1_ps(1.0));
            assert_eq!(fnm.0[0], f32::EPSILON * f32::EPSILON);
            let h = __m256i(std::array::from_fn(|i| [0x00, 0x3C][i % 2]));
            assert_eq!(_mm512_cvtph_ps(h).0, [1.0; 16]);
        }
    }
}
