//! RMSNorm and the element-wise steps, as the kernels compute them: one row per thread block,
//! the sum of squares in f32 (the kernel reduces across a block in another order: floats agree
//! to a few ulps).

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) × weight` for every row of `weight.len()` values.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ss: f32 = xr.iter().map(|&v| v * v).sum();
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `gate = silu(gate) × up`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_normed_row_has_unit_rms_times_the_weight() {
        let x = [3.0f32, -4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let w = [1.0f32, 2.0, 1.0, 1.0];
        let mut out = [0f32; 8];
        rms_norm(&x, &w, 0.0, &mut out);
        // Row 0: rms = sqrt(25 / 4) = 2.5.
        assert_eq!(&out[..4], &[1.2, -3.2, 0.0, 0.0]);
        assert_eq!(&out[4..], &[1.0, 2.0, 1.0, 1.0]);
        let mut g = [0.0f32, 1.0];
        silu_mul(&mut g, &[5.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-7);
    }
}
