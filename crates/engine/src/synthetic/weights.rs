//! The random tensors. Each has its own seed (from the spec's seed and its name) and each
//! fixed-size chunk of it its own stream, so a spec means the same bytes on any thread count.

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use super::{SyntheticSpec, TensorPlan, WeightFill};
use crate::error::Result;
use smolchat_gguf::{AlignedBytes, GgmlDType, RawTensor};

/// SplitMix64: tiny, fast, and fixed forever, so a seed means the same model in every build
/// (a library RNG may change its stream between versions).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform integer in `lo..=hi`.
    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (((self.next_u64() >> 32) * u64::from(hi - lo + 1)) >> 32) as u32
    }
    fn fill_bytes(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let b = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of one tensor: from the spec's seed and the name only (FNV-1a), so neither the
/// architecture, the type nor the other tensors change it.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    mix64(seed ^ mix64(h))
}

/// Work is split into fixed-size chunks, each with its own seed, so results do not depend on the
/// number of threads.
const FLOAT_CHUNK: usize = 1 << 16;
const BLOCK_CHUNK: usize = 1 << 12;

fn chunk_rng(seed: u64, chunk: usize) -> SplitMix64 {
    SplitMix64(mix64(seed ^ mix64(chunk as u64 ^ 0x6a09_e667_f3bc_c909)))
}

pub(super) fn generate_tensor(spec: &SyntheticSpec, plan: &TensorPlan) -> Result<RawTensor> {
    let seed = tensor_seed(spec.seed, &plan.name);
    let elems: usize = plan.dims.iter().product();
    let cols = plan.dims.last().copied().unwrap_or(1).max(1);
    let data = if plan.dims.len() == 1 {
        // Norm weights near 1, as trained models have them.
        f32_bytes(&random_floats(elems, seed, |r| {
            1.0 + (r.unit() - 0.5) * 0.2
        }))
    } else {
        let sigma = 1.0 / (cols as f32).sqrt();
        let half_width = sigma * 3f32.sqrt();
        let uniform = move |r: &mut SplitMix64| (r.unit() * 2.0 - 1.0) * half_width;
        match (plan.dtype, spec.fill) {
            (GgmlDType::F32, _) => f32_bytes(&random_floats(elems, seed, uniform)),
            (GgmlDType::F16, _) => {
                let v = random_floats(elems, seed, uniform);
                let mut out = AlignedBytes::zeroed(elems * 2);
                for (o, x) in out.as_mut_slice().chunks_exact_mut(2).zip(&v) {
                    o.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
                }
                out
            }
            (t, WeightFill::RandomBlocks) if block_recipe(t).is_some() => {
                random_blocks(t, elems, sigma, seed)
            }
            (t, _) => {
                let v = random_floats(elems, seed, uniform);
                let tensor = Tensor::from_vec(v, plan.dims.as_slice(), &Device::Cpu)?;
                let q = QTensor::quantize(&tensor, t)?;
                AlignedBytes::from_slice(&q.data()?)
            }
        }
    };
    Ok(RawTensor {
        name: plan.name.clone(),
        dtype: plan.dtype,
        dims: plan.dims.clone(),
        data,
    })
}

fn random_floats(n: usize, seed: u64, draw: impl Fn(&mut SplitMix64) -> f32 + Sync) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(FLOAT_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut r = chunk_rng(seed, c);
            for x in chunk.iter_mut() {
                *x = draw(&mut r);
            }
        });
    v
}

fn f32_bytes(v: &[f32]) -> AlignedBytes {
    let mut out = AlignedBytes::zeroed(v.len() * 4);
    for (o, x) in out.as_mut_slice().chunks_exact_mut(4).zip(v) {
        o.copy_from_slice(&x.to_le_bytes());
    }
    out
}

/// How to turn a block of random bytes into a plausible block of type `t`: `gain` is the standard
/// deviation of a weight per unit of the block scale `d`, given the scale pattern `fix` writes.
struct BlockRecipe {
    gain: f32,
    fix: fn(&mut [u8], f32, &mut SplitMix64),
}

fn put_f16(b: &mut [u8], at: usize, x: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
}

/// Types that store `q - offset` with a lopsided range (-8..=7 for Q4_0) would give every block
/// a mean of -d/2; a random sign on the scale, as real quantizers produce, centres them.
fn random_sign(x: f32, r: &mut SplitMix64) -> f32 {
    if r.next_u64() & 1 == 0 {
        x
    } else {
        -x
    }
}

/// Packs eight 6-bit scales and mins the way Q4_K and Q5_K store them (the inverse of
/// `get_scale_min_k4`).
fn pack_k4_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    q
}

/// Recipes for the types whose layout we write directly; other types are quantized from floats.
/// In every recipe the weights are centred on zero: where a type stores a minimum, it is set to
/// the middle of the quant range; where the quant range is lopsided, the scale's sign is random.
fn block_recipe(t: GgmlDType) -> Option<BlockRecipe> {
    Some(match t {
        // {d, qs[16]}: d * (q - 8), q in 0..16.
        GgmlDType::Q4_0 => BlockRecipe {
            gain: 4.61,
            fix: |b, d, r| put_f16(b, 0, random_sign(d, r)),
        },
        // {d, m, qs[16]}: d * q + m.
        GgmlDType::Q4_1 => BlockRecipe {
            gain: 4.61,
            fix: |b, d, _| {
                put_f16(b, 0, d);
                put_f16(b, 2, -7.5 * d);
            },
        },
        // {d, qh[4], qs[16]}: d * (q - 16), q in 0..32.
        GgmlDType::Q5_0 => BlockRecipe {
            gain: 9.23,
            fix: |b, d, r| put_f16(b, 0, random_sign(d, r)),
        },
        // {d, m, qh[4], qs[16]}: d * q + m.
        GgmlDType::Q5_1 => BlockRecipe {
            gain: 9.23,
            fix: |b, d, _| {
                put_f16(b, 0, d);
                put_f16(b, 2, -15.5 * d);
            },
        },
        // {d, qs[32] i8}: d * q.
        GgmlDType::Q8_0 => BlockRecipe {
            gain: 73.9,
            fix: |b, d, r| put_f16(b, 0, random_sign(d, r)),
        },
        // {scales[16] (scale | min << 4), qs[64], d, dmin}: d * sc * q - dmin * m, q in 0..4.
        GgmlDType::Q2K => BlockRecipe {
            gain: 9.8,
            fix: |b, d, r| {
                for s in b[..16].iter_mut() {
                    let sc = r.range(1, 15) as u8;
                    *s = sc | (sc << 4);
                }
                put_f16(b, 80, d);
                put_f16(b, 82, 1.5 * d);
            },
        },
        // {hmask[32], qs[64], scales[12], d}: d * (sc - 32) * q, q in -4..4; random 6-bit
        // scales are already centred.
        GgmlDType::Q3K => BlockRecipe {
            gain: 42.0,
            fix: |b, d, _| put_f16(b, 108, d),
        },
        // {d, dmin, scales[12], qs[128]}: d * sc * q - dmin * m, q in 0..16.
        GgmlDType::Q4K => BlockRecipe {
            gain: 54.0,
            fix: |b, d, r| {
                let sc: [u8; 8] = std::array::from_fn(|_| r.range(8, 15) as u8);
                put_f16(b, 0, d);
                put_f16(b, 2, 7.5 * d);
                b[4..16].copy_from_slice(&pack_k4_scales(sc, sc));
            },
        },
        // {d, dmin, scales[12], qh[32], qs[128]}: as Q4_K with q in 0..32.
        GgmlDType::Q5K => BlockRecipe {
            gain: 108.0,
            fix: |b, d, r| {
                let sc: [u8; 8] = std::array::from_fn(|_| r.range(8, 15) as u8);
                put_f16(b, 0, d);
                put_f16(b, 2, 15.5 * d);
                b[4..16].copy_from_slice(&pack_k4_scales(sc, sc));
            },
        },
        // {ql[128], qh[64], scales[16] i8, d}: d * sc * (q - 32), q in 0..64.
        GgmlDType::Q6K => BlockRecipe {
            gain: 188.0,
            fix: |b, d, r| {
                for s in b[192..208].iter_mut() {
                    *s = random_sign(r.range(4, 15) as f32, r) as i8 as u8;
                }
                put_f16(b, 208, d);
            },
        },
        _ => return None,
    })
}

/// Random quants with scales chosen so the weights have standard deviation about `sigma`; each
/// block's `d` varies by ±25% as real blocks' do.
fn random_blocks(t: GgmlDType, elems: usize, sigma: f32, seed: u64) -> AlignedBytes {
    let block_bytes = t.type_size();
    let n_blocks = elems / t.block_size();
    let mut out = AlignedBytes::zeroed(n_blocks * block_bytes);
    if let Some(recipe) = block_recipe(t) {
        let base = sigma / recipe.gain;
        out.as_mut_slice()
            .par_chunks_mut(BLOCK_CHUNK * block_bytes)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut r = chunk_rng(seed, c);
                r.fill_bytes(chunk);
                for block in chunk.chunks_exact_mut(block_bytes) {
                    let d = base * (0.75 + 0.5 * r.unit());
                    (recipe.fix)(block, d, &mut r);
                }
            });
    }
    out
}
