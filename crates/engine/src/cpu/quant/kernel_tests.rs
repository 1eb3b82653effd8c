//! Kernel tests: every SIMD kernel against the scalar one (bit for bit: each lane performs the
//! scalar sequence of operations), and the scalar one against GGML's definition of the product
//! computed from candle's dequantization in f64.

use candle_core::quantized::GgmlDType;
use half::f16;

use super::act::{ActKind, Acts};
use super::gemm;
use super::generic;
use super::isa::Isa;
use super::layout::{Format, Packed};
use super::scalar::FloatOrder;

const FORMATS: [Format; 5] = [
    Format::Q4_0,
    Format::Q4_1,
    Format::Q8_0,
    Format::Q4K,
    Format::Q6K,
];

fn dtype(f: Format) -> GgmlDType {
    match f {
        Format::Q4_0 => GgmlDType::Q4_0,
        Format::Q4_1 => GgmlDType::Q4_1,
        Format::Q8_0 => GgmlDType::Q8_0,
        Format::Q4K => GgmlDType::Q4K,
        Format::Q6K => GgmlDType::Q6K,
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    fn f32(&mut self) -> f32 {
        (self.next() % 20001) as f32 / 10000.0 - 1.0
    }
}

/// A sane f16 scale (random bytes could be NaN or infinite).
fn scale(rng: &mut Rng) -> [u8; 2] {
    f16::from_f32(rng.f32() * 0.02).to_le_bytes()
}

/// Random GGML blocks with valid scales; every 7th block is all zeros and every 5th has extreme
/// quants (all bits set, or Q8_0's -128).
fn random_native(format: Format, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let nb = format.native_bytes();
    let nblocks = rows * cols / format.block();
    let mut out = vec![0u8; nblocks * nb];
    for (i, blk) in out.chunks_exact_mut(nb).enumerate() {
        if i % 7 == 3 {
            continue;
        }
        let extreme = i % 5 == 1;
        for b in blk.iter_mut() {
            *b = if extreme { 0xFF } else { rng.byte() };
        }
        match format {
            Format::Q4_0 => blk[0..2].copy_from_slice(&scale(rng)),
            Format::Q4_1 => {
                blk[0..2].copy_from_slice(&scale(rng));
                blk[2..4].copy_from_slice(&scale(rng));
            }
            Format::Q8_0 => {
                blk[0..2].copy_from_slice(&scale(rng));
                if extreme {
                    blk[2..34].fill(0x80);
                }
            }
            Format::Q4K => {
                blk[0..2].copy_from_slice(&scale(rng));
                blk[2..4].copy_from_slice(&scale(rng));
            }
            Format::Q6K => {
                blk[208..210].copy_from_slice(&scale(rng));
                if extreme {
                    blk[192..208].fill(0x80);
                }
            }
        }
    }
    out
}

/// Activations with a zero row block, then quants forced to the extremes (-128 and 127) in places,
/// with every derived sum recomputed to stay consistent.
fn random_acts(kind: ActKind, n: usize, cols: usize, rng: &mut Rng) -> Acts {
    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
    x[..32.min(cols)].fill(0.0);
    let mut a = Acts::quantize(kind, &x, n, cols);
    for (i, q) in a.qs.iter_mut().enumerate() {
        match i % 97 {
            5 => *q = -128,
            6 => *q = 127,
            _ => {}
        }
    }
    let bs = cols / a.nblk;
    for t in 0..n {
        for b in 0..a.nblk {
            let q = &a.qs[t * cols + b * bs..t * cols + (b + 1) * bs];
            let ab = t * a.nblk + b;
            match kind {
                ActKind::Q8_0 {
                    bias_mul,
                    bias_group,
                } => {
                    let per = 32 / bias_group;
                    for (i, q) in q.chunks_exact(bias_group).enumerate() {
                        a.bias[ab * per + i] = -bias_mul * q.iter().map(|&v| v as i32).sum::<i32>();
                    }
                }
                ActKind::Q8_1 => {
                    let s: i32 = q.iter().map(|&v| v as i32).sum();
                    a.s[ab] = f16::from_f32(a.d[ab] * s as f32).to_f32();
                }
                ActKind::Q8K => {
                    for j in 0..16 {
                        let s: i32 = q[16 * j..16 * j + 16].iter().map(|&v| v as i32).sum();
                        a.bias[ab * 16 + j] = -32 * s;
                    }
                    for j in 0..8 {
                        let s: i32 = q[32 * j..32 * j + 32].iter().map(|&v| v as i32).sum();
                        a.bsum32[ab * 8 + j] = s as i16;
                    }
                }
            }
        }
    }
    a
}

fn run_choice(p: &Packed, choice: super::kernel::KernelChoice, acts: &Acts) -> Vec<f32> {
    let mut out = vec![f32::NAN; acts.n_tokens * p.rows];
    gemm::gemm(p, choice, acts, &mut out);
    out
}

/// GGML's product from candle's dequantized rows (f64): Σ_c w[c]·dx·q[c], except that Q4_1's
/// minimum multiplies the stored `s` (as ggml's Q4_1×Q8_1 does). Also returns Σ|terms|, the scale
/// for the tolerance.
fn reference(format: Format, native: &[u8], rows: usize, acts: &Acts) -> Vec<(f64, f64)> {
    let cols = acts.cols;
    let rb = cols / format.block() * format.native_bytes();
    let bs = cols / acts.nblk;
    let mut out = Vec::new();
    for t in 0..acts.n_tokens {
        for r in 0..rows {
            let row = &native[r * rb..(r + 1) * rb];
            let mut w = vec![0f32; cols];
            generic::to_float(dtype(format), row, &mut w);
            let (mut sum, mut mag) = (0f64, 0f64);
            for c in 0..cols {
                let ab = t * acts.nblk + c / bs;
                let mut wc = w[c] as f64;
                if format == Format::Q4_1 {
                    let m = f16::from_le_bytes([row[(c / 32) * 20 + 2], row[(c / 32) * 20 + 3]]);
                    wc -= m.to_f64();
                }
                let term = wc * acts.d[ab] as f64 * acts.qs[t * cols + c] as f64;
                sum += term;
                mag += term.abs();
            }
            if format == Format::Q4_1 {
                for b in 0..acts.nblk {
                    let m = f16::from_le_bytes([row[b * 20 + 2], row[b * 20 + 3]]).to_f64();
                    let term = m * acts.s[t * acts.nblk + b] as f64;
                    sum += term;
                    mag += term.abs();
                }
            }
            out.push((sum, mag));
        }
    }
    out
}

/// Calls `each(format, packed, acts)` for every format on matrices of 37 rows (two full groups and
/// a padded one) and token counts that hit every tile remainder, below and above the count from
/// which kernels run on unpacked groups.
fn for_each_kernel_case(seed: u64, mut each: impl FnMut(Format, &Packed, &Acts)) {
    let mut rng = Rng(seed);
    for format in FORMATS {
        let (rows, cols) = (37, 3 * format.block().max(128));
        let native = random_native(format, rows, cols, &mut rng);
        let p = Packed::from_native(format, rows, cols, &native);
        for n in [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 18, 19, 20] {
            let acts = random_acts(format.act_kind(), n, cols, &mut rng);
            each(format, &p, &acts);
        }
    }
}

/// `choice` (a SIMD kernel for `format`, named `what`) equals the scalar kernel of its float order
/// bit for bit.
fn assert_equals_scalar(
    format: Format,
    what: &str,
    choice: super::kernel::KernelChoice,
    p: &Packed,
    acts: &Acts,
) {
    let want = run_choice(p, gemm::scalar_kernel(format, choice.order), acts);
    let got = run_choice(p, choice, acts);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{format:?} {what} ({:?} order) n={} token {} row {}: {g} vs {w}",
            choice.order,
            acts.n_tokens,
            i / p.rows,
            i % p.rows
        );
    }
}

/// Every SIMD kernel *this CPU has* equals the scalar kernel of its float order. Kernels of
/// instruction sets the CPU lacks cannot run natively here: they are named in the test's log (the
/// AVX-VNNI and AVX-512 kernels are also checked on every CPU with their missing instructions
/// emulated, in the tests below). At least one SIMD path must have been checked on x86-64.
#[test]
fn simd_kernels_this_cpu_has_equal_scalar_bit_for_bit() {
    let mut checked = std::collections::BTreeSet::new();
    for_each_kernel_case(1, |format, p, acts| {
        for isa in [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni] {
            let Some(choice) = gemm::kernel(format, isa) else {
                // Logged to the test's output, so a run says what it skipped.
                if format == FORMATS[0] && acts.n_tokens == 1 {
                    crate::test_log::init();
                    tracing::warn!("{isa:?} kernels: this CPU lacks them, skipped");
                }
                continue;
            };
            checked.insert(format!("{isa:?}"));
            assert_equals_scalar(format, &format!("{isa:?}"), choice, p, acts);
        }
    });
    crate::test_log::init();
    tracing::info!("SIMD kernels checked on this CPU: {checked:?}");
    if cfg!(target_arch = "x86_64") {
        // SMOLCHAT_ISA=scalar turns the SIMD paths off on purpose; otherwise every x86-64
        // machine of this project has AVX2.
        let forced_scalar = std::env::var("SMOLCHAT_ISA").is_ok_and(|v| v == "scalar");
        assert!(
            forced_scalar || !checked.is_empty(),
            "no SIMD kernel ran: the test checked nothing"
        );
    }
}

/// The AVX-VNNI kernels equal the scalar kernel of their float order bit for bit on any CPU with
/// AVX2: with `EMULATE_VNNI` set, their one AVX-VNNI instruction is computed lane by lane, so they
/// are checked where the CPU lacks AVX-VNNI (Zen 2-4: most of this project's machines and CI).
#[cfg(target_arch = "x86_64")]
#[test]
fn avx_vnni_kernels_equal_scalar_bit_for_bit_with_vpdpbusd_emulated() {
    if !Isa::Avx2.available() {
        crate::test_log::init();
        tracing::warn!("no AVX2 on this CPU: the AVX-VNNI kernels cannot run even emulated");
        return;
    }
    // One worker thread, so that every kernel call of the products runs where the flag is set.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    pool.install(|| {
        super::avx2::EMULATE_VNNI.with(|e| e.set(true));
        for_each_kernel_case(6, |format, p, acts| {
            let choice = super::avx2::kernel(format, true);
            assert_equals_scalar(format, "AVX-VNNI (vpdpbusd emulated)", choice, p, acts);
        });
    });
}

/// The AVX-512 kernels' own source (`avx512.rs`, copied by `build.rs` without its
/// `#[target_feature]` lines) over the emulated intrinsics of `emu512`.
#[allow(clippy::needless_range_loop)]
mod avx512_emulated {
    use super::super::emu512::*;
    include!(concat!(env!("OUT_DIR"), "/avx512_emulable.rs"));
}

/// The AVX-512 kernels equal the scalar kernel of their float order bit for bit on any CPU: their
/// source runs over emulated intrinsics, so a change to them is checked where no CPU has AVX-512
/// (most of this project's machines and its CI).
#[test]
fn avx512_kernels_equal_scalar_bit_for_bit_over_emulated_intrinsics() {
    for_each_kernel_case(5, |format, p, acts| {
        let choice = avx512_emulated::kernel(format);
        assert_equals_scalar(format, "emulated AVX-512", choice, p, acts);
    });
}

/// Both float orders of the scalar kernels (they differ for Q4_1 and Q8_0) against GGML's
/// definition.
#[test]
fn scalar_kernels_match_ggml_definition() {
    let mut rng = Rng(2);
    for (format, order) in FORMATS
        .into_iter()
        .flat_map(|f| [(f, FloatOrder::Llama), (f, FloatOrder::PerBlock)])
    {
        let (rows, cols) = (21, 2 * format.block().max(128));
        let native = random_native(format, rows, cols, &mut rng);
        let p = Packed::from_native(format, rows, cols, &native);
        let acts = random_acts(format.act_kind(), 3, cols, &mut rng);
        let got = run_choice(&p, gemm::scalar_kernel(format, order), &acts);
        for (i, (g, (want, mag))) in got
            .iter()
            .zip(reference(format, &native, rows, &acts))
            .enumerate()
        {
            assert!(
                (*g as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                "{format:?} {order:?} token {} row {}: {g} vs {want} (scale {mag})",
                i / rows,
                i % rows
            );
        }
    }
}

/// The generic (candle `vec_dot`) path and the packed path agree on real quantized data.
#[test]
fn packed_path_matches_candle_vec_dot() {
    use super::QMatrix;
    use smolchat_gguf::{AlignedBytes, RawTensor};
    let mut rng = Rng(3);
    for format in FORMATS {
        let (rows, cols, n) = (48, 512, 5);
        let native = random_native(format, rows, cols, &mut rng);
        let raw = |native: &[u8]| RawTensor {
            name: "w".into(),
            dtype: dtype(format),
            dims: vec![rows, cols],
            data: AlignedBytes::from_slice(native),
        };
        let packed = QMatrix::from_raw(raw(&native)).unwrap_or_else(|e| panic!("{e}"));
        let plain = QMatrix::from_raw_native(raw(&native)).unwrap_or_else(|e| panic!("{e}"));
        assert!(packed.is_repacked() && !plain.is_repacked());
        assert_eq!(&packed.native_bytes()[..], &native[..]);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        packed.matmul(&x, n, &mut a);
        plain.matmul(&x, n, &mut b);
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            // Same integer sums; only the float accumulation order differs.
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{format:?} {i}: {a} vs {b}"
            );
        }
        let (mut r1, mut r2) = (vec![0f32; cols], vec![0f32; cols]);
        for r in [0, 17, rows - 1] {
            packed
                .dequantize_row(r, &mut r1)
                .unwrap_or_else(|e| panic!("{e}"));
            plain
                .dequantize_row(r, &mut r2)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(r1, r2);
        }
    }
}

/// `matmul_many` equals separate `matmul` calls, and the parallel split (a 3-thread pool, several
/// matrices, work above the serial threshold) equals the serial run, bit for bit.
#[test]
fn fused_and_parallel_products_equal_serial() {
    use super::QMatrix;
    use smolchat_gguf::{AlignedBytes, RawTensor};
    let mut rng = Rng(4);
    let cols = 512;
    let shapes = [
        (Format::Q4_1, 200),
        (Format::Q4K, 77),
        (Format::Q6K, 512),
        (Format::Q8_0, 300),
    ];
    let mats: Vec<QMatrix> = shapes
        .iter()
        .map(|&(format, rows)| {
            let native = random_native(format, rows, cols, &mut rng);
            QMatrix::from_raw(RawTensor {
                name: format!("{format:?}"),
                dtype: dtype(format),
                dims: vec![rows, cols],
                data: AlignedBytes::from_slice(&native),
            })
            .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    let refs: Vec<&QMatrix> = mats.iter().collect();
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap_or_else(|e| panic!("{e}"))
    };
    for n in [1, 3, 9] {
        let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
        let run_many = |threads| {
            let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; n * m.rows]).collect();
            let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            pool(threads).install(|| QMatrix::matmul_many(&refs, &x, n, &mut views));
            outs
        };
        let serial = run_many(1);
        assert_eq!(run_many(3), serial, "n={n}");
        for (m, want) in mats.iter().zip(&serial) {
            let mut got = vec![0f32; n * m.rows];
            m.matmul(&x, n, &mut got);
            assert_eq!(&got, want, "{} n={n}", m.name);
        }
    }
}
