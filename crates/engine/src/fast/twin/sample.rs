//! Sampling on the device, the twin of the `apply_penalties` and `sample_rows` kernels: only
//! token ids cross to the host.
//!
//! The chain is the host sampler's (`smolchat_text::sampling`): penalties (repetition, presence,
//! frequency) → greedy, or top-k → temperature → min-p → top-p → a draw. The kept set is the
//! host's; two things differ, on purpose:
//! - weights are summed in 40-bit fixed point ([`fixed`]) with integer arithmetic, so the
//!   kernel's sums are exact whatever order its threads add in, and equal this twin's;
//! - the draw walks the kept tokens in id order (a scan the kernel does in one pass), where the
//!   host walks its candidate list; a seed therefore gives another (equally distributed)
//!   reply on the fast tier than on the CPU, each reproducible in itself.
//!
//! Contract with the kernels: **bit-exact**. Every float operation here is one the kernel does
//! in the same order without contraction (`__fmul_rn`/`__fadd_rn`, explicit `fmaf`), the
//! exponential is [`exp_neg`] in both (no libm), and everything after the weights is integer.
//! Given the same logits row, the kernel returns the same token id.

/// What a row samples with (`#[repr(C)]`: the kernels read it as `SampleRow`).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct SampleRow {
    /// 0: greedy.
    pub temperature: f32,
    /// `1 / temperature`, computed once on the host (0 when greedy).
    pub inv_temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// The draw, uniform in `[0, 1)`, from the sequence's seeded generator.
    pub uniform: f64,
}

const _: () = assert!(std::mem::size_of::<SampleRow>() == 40);

impl SampleRow {
    /// Argmax, no penalties.
    pub const GREEDY: SampleRow = SampleRow {
        temperature: 0.0,
        inv_temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        uniform: 0.0,
    };

    fn greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// The id a row returns when no token has a usable logit (all NaN or -inf).
pub const NO_TOKEN: u32 = u32::MAX;

/// NaN can never be chosen; +inf becomes the largest finite value (as the host sampler does).
pub fn sanitize(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else if l == f32::INFINITY {
        f32::MAX
    } else {
        l
    }
}

/// The penalties of one row: `entries` are (token, occurrences in the window), distinct tokens.
/// A positive logit is divided by the repetition penalty, a negative one multiplied, then
/// `count × frequency + presence` is subtracted (two roundings, no fused multiply-add).
pub fn apply_penalties(logits: &mut [f32], entries: &[(u32, u32)], row: &SampleRow) {
    for &(token, count) in entries {
        let Some(l) = logits.get_mut(token as usize) else {
            continue;
        };
        let mut v = sanitize(*l);
        v = if v > 0.0 {
            v / row.repetition_penalty
        } else {
            v * row.repetition_penalty
        };
        let minus = count as f32 * row.frequency_penalty + row.presence_penalty;
        *l = v - minus;
    }
}

// The constants as bit patterns, so the kernel (`kernels.cu`, `exp_neg`) and this twin use the
// same floats whatever their compilers do with decimal literals.
pub(crate) const LOG2E: u32 = 0x3fb8_aa3b;
pub(crate) const LN2_HI: u32 = 0x3f31_8000;
pub(crate) const LN2_LO: u32 = 0xb95e_8083;
/// cephes' `expf` polynomial, highest degree first.
pub(crate) const POLY: [u32; 6] = [
    0x3950_6967,
    0x3ab7_43ce,
    0x3c08_8908,
    0x3d2a_a9c1,
    0x3e2a_aaaa,
    0x3f00_0000,
];
/// Below this, `exp` is under the smallest normal f32: the weight is 0.
const EXP_MIN: f32 = -87.0;

/// `e^x` for `x <= 0` with fused multiply-adds only (Cody–Waite reduction, cephes' degree-6
/// polynomial, scaling by a power of two built from its bits): within 2 ulp of `exp`, and the
/// same bits as the kernel's `exp_neg`.
pub fn exp_neg(x: f32) -> f32 {
    if x.is_nan() || x < EXP_MIN {
        return 0.0;
    }
    let f = f32::from_bits;
    let n = (x * f(LOG2E)).round_ties_even();
    let r = (-n).mul_add(f(LN2_HI), x);
    let r = (-n).mul_add(f(LN2_LO), r);
    let mut p = f(POLY[0]);
    for &c in &POLY[1..] {
        p = p.mul_add(r, f(c));
    }
    let r2 = r * r;
    let y = p.mul_add(r2, r) + 1.0;
    // n is in [-126, 0] for x in [-87, 0]: a normal power of two.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    y * scale
}

/// Fixed-point scale of the weights: 40 fractional bits. A weight is at most 1, so a 128k-token
/// vocabulary sums to under 2^57.
pub const FIXED_ONE: f32 = (1u64 << 40) as f32;

/// A weight in `[0, 1]` as fixed point (truncated).
pub fn fixed(w: f32) -> u64 {
    (w * FIXED_ONE) as u64
}

/// A token's softmax weight relative to the best (`max`): exactly 1 for the best, so a huge
/// `1 / temperature` never multiplies a zero difference.
fn weight(l: f32, max: f32, inv_t: f32) -> f32 {
    let d = l - max;
    if d == 0.0 {
        1.0
    } else {
        exp_neg(d * inv_t)
    }
}

/// An order-preserving key of a float (a larger float has a larger key).
pub fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The next token of one row of (penalised) logits, or [`NO_TOKEN`].
pub fn sample_row(logits: &[f32], row: &SampleRow) -> u32 {
    let l: Vec<f32> = logits.iter().map(|&v| sanitize(v)).collect();
    // Argmax, first maximum.
    let mut best = 0usize;
    let mut best_l = f32::NEG_INFINITY;
    for (i, &v) in l.iter().enumerate() {
        if v > best_l {
            best = i;
            best_l = v;
        }
    }
    if best_l == f32::NEG_INFINITY {
        return NO_TOKEN;
    }
    if row.greedy() {
        return best as u32;
    }
    let candidates = l.iter().filter(|&&v| v > f32::NEG_INFINITY).count();
    // Top-k: the k largest by (value, then lowest id).
    let mut keep: Vec<bool> = l.iter().map(|&v| v > f32::NEG_INFINITY).collect();
    let k = row.top_k as usize;
    if k > 0 && k < candidates {
        let mut order: Vec<(u32, usize)> = l
            .iter()
            .enumerate()
            .filter(|(_, &v)| v > f32::NEG_INFINITY)
            .map(|(i, &v)| (order_key(v), i))
            .collect();
        order.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        keep.iter_mut().for_each(|x| *x = false);
        for &(_, i) in &order[..k] {
            keep[i] = true;
        }
    }
    let w: Vec<f32> = l
        .iter()
        .zip(&keep)
        .map(|(&v, &kept)| {
            if kept {
                weight(v, best_l, row.inv_temperature)
            } else {
                0.0
            }
        })
        .collect();
    let total: u64 = (0..l.len()).filter(|&i| keep[i]).map(|i| fixed(w[i])).sum();
    if row.min_p > 0.0 {
        for i in 0..l.len() {
            keep[i] = keep[i] && w[i] >= row.min_p;
        }
    }
    if row.top_p < 1.0 {
        // Mass against the distribution before min-p, as if top-p ran first (the host's rule).
        let target = (f64::from(row.top_p) * total as f64) as u64;
        let mut order: Vec<usize> = (0..l.len()).filter(|&i| keep[i]).collect();
        order.sort_unstable_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        let mut acc = 0u64;
        if let Some(cut) = order.iter().position(|&i| {
            acc += fixed(w[i]);
            acc >= target
        }) {
            for &i in &order[cut + 1..] {
                keep[i] = false;
            }
        }
    }
    let mass: u64 = (0..l.len()).filter(|&i| keep[i]).map(|i| fixed(w[i])).sum();
    let r = (row.uniform * mass as f64) as u64;
    let mut acc = 0u64;
    let mut last = best;
    for i in (0..l.len()).filter(|&i| keep[i]) {
        acc += fixed(w[i]);
        last = i;
        if acc > r {
            return i as u32;
        }
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(temperature: f32, top_k: u32, top_p: f32, min_p: f32, uniform: f64) -> SampleRow {
        SampleRow {
            temperature,
            inv_temperature: if temperature > 0.0 {
                1.0 / temperature
            } else {
                0.0
            },
            top_k,
            top_p,
            min_p,
            uniform,
            ..SampleRow::GREEDY
        }
    }

    #[test]
    fn exp_neg_is_within_two_ulp_of_exp_and_zero_below_the_normals() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let (got, want) = (exp_neg(x), x.exp());
            let ulp = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {want}, got {got} ({ulp} ulp)");
            x -= 0.0137;
        }
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-88.0), 0.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(f32::NAN), 0.0);
    }

    #[test]
    fn keys_order_like_the_floats() {
        let v = [f32::MIN, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, f32::MAX];
        for w in v.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{w:?}");
        }
        assert!(order_key(-1.0) < order_key(1.0));
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_nothing_usable_is_no_token() {
        let l = [0.5f32, 3.0, f32::NAN, 3.0, -1.0];
        assert_eq!(sample_row(&l, &SampleRow::GREEDY), 1);
        assert_eq!(sample_row(&l, &row(0.8, 1, 1.0, 0.0, 0.99)), 1);
        let broken = [f32::NAN, f32::NEG_INFINITY];
        assert_eq!(sample_row(&broken, &row(0.8, 0, 1.0, 0.0, 0.5)), NO_TOKEN);
        assert_eq!(sample_row(&[f32::INFINITY, 1.0], &SampleRow::GREEDY), 0);
    }

    #[test]
    fn the_draw_walks_kept_tokens_in_id_order() {
        // Temperature 1: weights e^(l - max). Top-k 2 keeps ids 1 and 3 (values 2, 2 tie with
        // id 4: the lowest ids win), top-p and min-p off.
        let l = [0.0f32, 2.0, -5.0, 2.0, 2.0];
        let r = |u| row(1.0, 2, 1.0, 0.0, u);
        assert_eq!(sample_row(&l, &r(0.0)), 1);
        assert_eq!(sample_row(&l, &r(0.49)), 1);
        assert_eq!(sample_row(&l, &r(0.51)), 3);
        assert_eq!(sample_row(&l, &r(0.999_999)), 3);
        // Without top-k every token can come, in id order of the cumulative weights.
        let all = |u| row(1.0, 0, 1.0, 0.0, u);
        let w: Vec<f64> = l.iter().map(|&v| f64::from(v - 2.0).exp()).collect();
        let total: f64 = w.iter().sum();
        assert_eq!(sample_row(&l, &all(0.5 * w[0] / total)), 0);
        assert_eq!(sample_row(&l, &all((w[0] + 0.5 * w[1]) / total)), 1);
        assert_eq!(sample_row(&l, &all(1.0 - 0.5 * w[4] / total)), 4);
    }

    #[test]
    fn top_p_keeps_the_smallest_head_reaching_the_mass_and_min_p_drops_the_tail() {
        // Weights 1, 1/2, 1/4, 1/8 (logits in ln 2 steps, temperature 1): total 1.875.
        let ln2 = std::f32::consts::LN_2;
        let l = [0.0f32, -ln2, -2.0 * ln2, -3.0 * ln2];
        // top_p 0.5: target 0.9375, which the best weight (1) reaches alone: only id 0.
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample_row(&l, &row(1.0, 0, 0.5, 0.0, u)), 0);
        }
        // top_p 0.7: target 1.3125; 1 + 1/2 = 1.5 reaches it: ids 0 and 1 (2/3 and 1/3).
        assert_eq!(sample_row(&l, &row(1.0, 0, 0.7, 0.0, 0.6)), 0);
        assert_eq!(sample_row(&l, &row(1.0, 0, 0.7, 0.0, 0.7)), 1);
        assert_eq!(sample_row(&l, &row(1.0, 0, 0.7, 0.0, 0.999)), 1);
        // min_p 0.3 keeps weights >= 0.3: ids 0 and 1 whatever the draw.
        assert_eq!(sample_row(&l, &row(1.0, 0, 1.0, 0.3, 0.999)), 1);
        // Nothing filtered: the last token is reachable.
        assert_eq!(sample_row(&l, &row(1.0, 0, 1.0, 0.0, 0.99)), 3);
    }

    #[test]
    fn penalties_divide_positive_multiply_negative_and_subtract_counts() {
        let mut l = [2.0f32, -2.0, 1.0, f32::INFINITY];
        let r = SampleRow {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SampleRow::GREEDY
        };
        apply_penalties(&mut l, &[(0, 2), (1, 1), (3, 1), (99, 1)], &r);
        assert_eq!(l[0], 2.0 / 2.0 - (2.0 * 0.25 + 0.5));
        assert_eq!(l[1], -2.0 * 2.0 - (0.25 + 0.5));
        assert_eq!(l[2], 1.0);
        assert_eq!(l[3], f32::MAX / 2.0 - 0.75);
    }

    /// The kept set is the host sampler's: over many random rows, every token this twin draws
    /// is one the host's filters keep (checked here against a direct implementation of the
    /// same definitions in f64).
    #[test]
    fn draws_stay_inside_the_filters() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..300 {
            let vocab = 5 + (next() % 300) as usize;
            let l: Vec<f32> = (0..vocab)
                .map(|_| ((next() % 2000) as f32 / 100.0) - 10.0)
                .collect();
            let r = row(
                0.3 + (next() % 150) as f32 / 100.0,
                (next() % 20) as u32,
                0.5 + (next() % 50) as f32 / 100.0,
                (next() % 10) as f32 / 100.0,
                (next() % 1_000_000) as f64 / 1e6,
            );
            let t = sample_row(&l, &r) as usize;
            assert!(t < vocab, "case {case}");
            let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let w = |i: usize| (f64::from(l[i] - max) / f64::from(r.temperature)).exp();
            if r.top_k > 0 {
                let above = l.iter().filter(|&&v| v > l[t]).count();
                assert!(above < r.top_k as usize, "case {case}: outside top-k");
            }
            assert!(
                w(t) >= f64::from(r.min_p) - 1e-6,
                "case {case}: below min-p"
            );
            // Top-p: the tokens strictly more likely than `t` do not reach the mass alone.
            let total: f64 = (0..vocab)
                .filter(|&i| {
                    r.top_k == 0 || l.iter().filter(|&&v| v > l[i]).count() < r.top_k as usize
                })
                .map(w)
                .sum();
            let heavier: f64 = (0..vocab)
                .filter(|&i| w(i) > w(t) * (1.0 + 1e-6))
                .map(w)
                .sum();
            assert!(
                heavier < f64::from(r.top_p) * total * (1.0 + 1e-6),
                "case {case}: outside top-p"
            );
        }
    }
}
