//! Scalar math written so that loops over it vectorise (the build's baseline is AVX2/FMA), and
//! so that every thread and every SIMD width computes the same bits.

/// `e^x` to about 1 ulp (Cephes' `expf`: `x = n ln 2 + r`, a degree-6 polynomial in `r`, then
/// `2^n` through the exponent bits), written without branches so loops over it vectorise; libm's
/// `expf` per score was the largest cost of attention at long contexts, and SwiGLU's per value
/// 2.3% of the 3B shape's decode. Inputs below -87.3 give about 1e-38 instead of 0 (a weight
/// nobody can see next to the row's maximum, which is 1).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -90.0f32;
        while x < 88.0 {
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
}
