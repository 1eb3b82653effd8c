//! Rotary position embedding as llama.cpp computes it for llama and smollm3 weights (GGML's
//! "normal" RoPE: adjacent pairs rotated), with YaRN when the file or the configuration asks:
//! the cos/sin table of a step's rows, the same for every backend (the CPU backend rotates with
//! it in place; the reference tier uploads it).

use crate::config::{ModelConfig, YarnScaling};

/// cos/sin of every (row, frequency) pair of a step, shared by all RoPE layers.
pub struct RopeTable {
    rope_dim: usize,
    /// `[row][rope_dim / 2]`
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Dimensions of each head that are rotated (the first `rope_dim`).
    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    /// cos of `(row, pair)`, `[rows][rope_dim / 2]`.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// sin of `(row, pair)`, `[rows][rope_dim / 2]`.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

impl RopeTable {
    pub fn new(c: &ModelConfig, positions: &[usize]) -> Self {
        let half = c.rope_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        let theta_scale = c.rope_theta.powf(-2.0 / c.rope_dim as f32);
        let yarn = c
            .yarn
            .map(|y| YarnParams::new(&y, c.rope_dim, c.rope_theta));
        for &p in positions {
            let mut theta = p as f32;
            for i in 0..half {
                let (cs, sn) = match &yarn {
                    None => (theta.cos(), theta.sin()),
                    Some(y) => y.cos_sin(theta, i),
                };
                cos.push(cs);
                sin.push(sn);
                theta *= theta_scale;
            }
        }
        Self {
            rope_dim: c.rope_dim,
            cos,
            sin,
        }
    }

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of each head (GGML's "normal" RoPE, which is what
    /// llama.cpp's converters prepare llama and smollm3 weights for).
    pub fn apply(&self, data: &mut [f32], n_heads: usize, head_dim: usize) {
        let half = self.rope_dim / 2;
        let width = n_heads * head_dim;
        for (row, chunk) in data.chunks_mut(width).enumerate() {
            let cos = &self.cos[row * half..(row + 1) * half];
            let sin = &self.sin[row * half..(row + 1) * half];
            for head in chunk.chunks_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

/// YaRN as computed by ggml's `rope_yarn`: interpolate low frequencies, extrapolate high ones,
/// with a linear ramp between the correction dimensions, and scale magnitudes by `mscale`.
struct YarnParams {
    freq_scale: f32,
    low: f32,
    high: f32,
    mscale: f32,
}

impl YarnParams {
    fn new(y: &YarnScaling, rope_dim: usize, base: f32) -> Self {
        let corr_dim = |beta: f32| {
            rope_dim as f32 * (y.original_context as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let low = corr_dim(y.beta_fast).floor().max(0.0);
        let high = corr_dim(y.beta_slow).ceil().min(rope_dim as f32 - 1.0);
        let freq_scale = 1.0 / y.factor;
        Self {
            freq_scale,
            low,
            high,
            mscale: y.attn_factor * (1.0 + 0.1 * (1.0 / freq_scale).ln()),
        }
    }

    fn cos_sin(&self, theta_extrap: f32, pair: usize) -> (f32, f32) {
        let theta_interp = self.freq_scale * theta_extrap;
        let ramp = {
            let y = (pair as f32 - self.low) / (self.high - self.low).max(0.001);
            1.0 - y.clamp(0.0, 1.0)
        };
        let theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp;
        (theta.cos() * self.mscale, theta.sin() * self.mscale)
    }
}

/// The cos/sin rows of every position from 0 up, computed once (each position's row depends on
/// that position alone, so a row copied from here is the row [`RopeTable::new`] computes): a
/// step's table is then copies, not sines and cosines (for a 64-row decode step of the 3B shape,
/// 8,192 of them), and a device holds the whole table and finds each row by position.
#[derive(Default)]
pub struct RopeCache {
    /// Rows for positions `0..positions`.
    table: Option<RopeTable>,
    positions: usize,
}

/// The fewest positions a cache holds once it holds any.
const ROPE_CACHE_MIN: usize = 1024;

impl RopeCache {
    /// Makes the cache hold every position below `positions` (growing to at least twice what it
    /// held); whether it grew.
    pub fn hold(&mut self, c: &ModelConfig, positions: usize) -> bool {
        if positions <= self.positions && self.table.is_some() {
            return false;
        }
        let n = positions.max(2 * self.positions).max(ROPE_CACHE_MIN);
        let all: Vec<usize> = (0..n).collect();
        self.table = Some(RopeTable::new(c, &all));
        self.positions = n;
        true
    }

    /// Positions held.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// The whole table, `[position][rope_dim / 2]` (empty before [`Self::hold`]).
    pub fn cos(&self) -> &[f32] {
        self.table.as_ref().map_or(&[], RopeTable::cos)
    }

    pub fn sin(&self) -> &[f32] {
        self.table.as_ref().map_or(&[], RopeTable::sin)
    }

    /// The table of a step whose rows are at `positions`, copied from the cache (grown when a
    /// position is past it): equal to `RopeTable::new(c, positions)` value for value.
    pub fn rows(&mut self, c: &ModelConfig, positions: &[usize]) -> RopeTable {
        let end = positions.iter().max().map_or(0, |&p| p + 1);
        self.hold(c, end);
        let half = c.rope_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            cos.extend_from_slice(&self.cos()[p * half..(p + 1) * half]);
            sin.extend_from_slice(&self.sin()[p * half..(p + 1) * half]);
        }
        RopeTable {
            rope_dim: c.rope_dim,
            cos,
            sin,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's rows copied from the cache are the rows computed for the step, bit for bit,
    /// with YaRN and without, for positions in any order and past what the cache held.
    #[test]
    fn cached_rows_are_the_computed_rows() {
        let src = crate::synthetic::build(&crate::synthetic::SyntheticSpec::tiny("llama"))
            .expect("build");
        let plain = ModelConfig::from_gguf(&src).expect("config");
        let mut yarn = plain.clone();
        yarn.yarn = Some(YarnScaling::new(4.0, 4096));
        for c in [plain, yarn] {
            let mut cache = RopeCache::default();
            for positions in [vec![0, 5, 3, 1023], vec![7, 4000, 4000, 12]] {
                let cached = cache.rows(&c, &positions);
                let computed = RopeTable::new(&c, &positions);
                assert_eq!(cached.cos(), computed.cos());
                assert_eq!(cached.sin(), computed.sin());
            }
            assert_eq!(cache.positions(), 4001.max(2 * ROPE_CACHE_MIN));
            assert!(
                !cache.hold(&c, 100),
                "a cache that holds the positions stays"
            );
        }
    }

    /// YaRN keeps the fastest-turning pairs as they are (extrapolation), divides the slowest by
    /// the factor (interpolation), ramps in between, and scales every cos/sin by
    /// `1 + 0.1 ln(factor)`, as ggml's `rope_yarn` does.
    #[test]
    fn yarn_interpolates_slow_frequencies_and_keeps_fast_ones() {
        let rope_dim = 128;
        let base = 5_000_000f32;
        let y = YarnParams::new(&YarnScaling::new(2.0, 65_536), rope_dim, base);
        let mscale = 1.0 + 0.1 * 2f32.ln();
        assert!((y.mscale - mscale).abs() < 1e-6);
        assert!(y.low < y.high && y.high < rope_dim as f32);
        let theta_scale = base.powf(-2.0 / rope_dim as f32);
        let pos = 1000f32;
        for pair in [0usize, (y.high as usize + 1).min(63)] {
            let theta = pos * theta_scale.powi(pair as i32);
            let (c, s) = y.cos_sin(theta, pair);
            let expected = if (pair as f32) < y.low {
                theta
            } else {
                theta / 2.0
            };
            assert!((c - expected.cos() * mscale).abs() < 1e-4, "pair {pair}");
            assert!((s - expected.sin() * mscale).abs() < 1e-4, "pair {pair}");
        }
    }
}
