//! GPU checks. They are `#[ignore]`d, so `make test` on a machine without a GPU counts them as
//! ignored, never as passed; asked for (`--ignored`), each needs a CUDA device and fails without
//! one. They compile in every build: candle's device API is the same with and without CUDA
//! (`Device::new_cuda` then just fails), so the CPU build's clippy keeps this file honest too.
//!
//! On a GPU machine: build with `make cuda-tests` (or `cargo test --no-run --features cuda`),
//! carry the `gpu-*` test binary there and run it with `--ignored --nocapture` (see README, "GPU
//! build").

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use smolchat_engine::cpu::quant::QMatrix;
use smolchat_engine::device::{self, Capabilities, Device as EngineDevice, DeviceRequest};
use smolchat_gguf::{AlignedBytes, RawTensor};

/// Why an ignored GPU test was not run.
const NEEDS_GPU: &str = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there";

/// The first CUDA device; a test that asked for one fails without it (never a silent pass).
fn cuda_required(test: &str) -> Device {
    match Device::new_cuda(0) {
        Ok(dev) => dev,
        Err(e) => {
            // First line only: candle appends a backtrace to driver errors.
            let e = e.to_string();
            let reason = e.lines().next().unwrap_or_default();
            panic!("{test} needs a CUDA device and found none ({reason}); {NEEDS_GPU}");
        }
    }
}

/// A small deterministic generator (splitmix64), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// GGML block bytes of a random `rows x cols` matrix quantized to `dtype` by candle on the CPU.
fn random_quantized(dtype: GgmlDType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    // Per-row scales that differ, so a row mix-up cannot cancel out.
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| rng.unit() * 0.05 * (1.0 + (i / cols % 7) as f32))
        .collect();
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let q = QTensor::quantize(&t, dtype).unwrap_or_else(|e| panic!("{e}"));
    q.data().unwrap_or_else(|e| panic!("{e}")).into_owned()
}

/// The exact product of the dequantized weights with `x`, in f64: what both sides approximate.
fn exact_product(w: &QMatrix, x: &[f32], n: usize) -> Vec<f64> {
    let mut row = vec![0f32; w.cols];
    let mut out = vec![0f64; n * w.rows];
    for r in 0..w.rows {
        w.dequantize_row(r, &mut row)
            .unwrap_or_else(|e| panic!("{e}"));
        for t in 0..n {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            out[t * w.rows + r] = row.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
        }
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max)
}

/// candle's CUDA quantized matmul (llama.cpp's MMVQ for up to 8 rows, MMQ above) on the exact bytes
/// our CPU `QMatrix` multiplies, at token counts on both sides of the MMVQ/MMQ switch. Both quantize
/// the activations (the CPU to Q8_0/Q8_K, the GPU to Q8_1), so each is compared with the exact
/// product of the dequantized weights: the GPU's error may be at most twice the CPU's plus a small
/// floor (its Q8_1 blocks are no coarser than the CPU's), and the two must agree on every argmax.
#[test]
#[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
fn cuda_qmatmul_matches_the_cpu_qmatrix() {
    let gpu = cuda_required("cuda_qmatmul_matches_the_cpu_qmatrix");
    let mut rng = Rng(8);
    let (rows, cols) = (512, 2048);
    for dtype in [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
    ] {
        let bytes = random_quantized(dtype, rows, cols, &mut rng);
        let cpu = QMatrix::from_raw(RawTensor {
            name: format!("w.{dtype:?}"),
            dtype,
            dims: vec![rows, cols],
            data: AlignedBytes::from_slice(&bytes),
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let storage = QStorage::from_data(Cow::Borrowed(&bytes), &gpu, dtype)
            .unwrap_or_else(|e| panic!("upload {dtype:?}: {e}"));
        let qt = QTensor::new(storage, (rows, cols)).unwrap_or_else(|e| panic!("{e}"));
        let mm = QMatMul::from_qtensor(qt).unwrap_or_else(|e| panic!("{e}"));
        // CANDLE_DEQUANTIZE_ALL would turn this into an f32 matmul and test nothing of interest.
        assert!(
            matches!(mm, QMatMul::QTensor(_)),
            "{dtype:?}: not quantized on the GPU"
        );
        for n in [1usize, 2, 7, 8, 9, 33, 64] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
            let mut on_cpu = vec![0f32; n * rows];
            cpu.matmul(&x, n, &mut on_cpu);
            let xs = Tensor::from_vec(x.clone(), (n, cols), &gpu).unwrap_or_else(|e| panic!("{e}"));
            let on_gpu: Vec<f32> = mm
                .forward(&xs)
                .and_then(|y| y.to_device(&Device::Cpu))
                .and_then(|y| y.flatten_all())
                .and_then(|y| y.to_vec1())
                .unwrap_or_else(|e| panic!("{dtype:?} n={n}: {e}"));
            assert_eq!(on_gpu.len(), n * rows);
            let exact = exact_product(&cpu, &x, n);
            let scale = exact.iter().map(|v| v.abs()).fold(0.0, f64::max);
            let (cpu_err, gpu_err) = (max_abs_diff(&on_cpu, &exact), max_abs_diff(&on_gpu, &exact));
            eprintln!("{dtype:?} n={n}: max |y| {scale:.3}, CPU error {cpu_err:.2e}, GPU error {gpu_err:.2e}");
            // The GPU quantizes activations to Q8_1, whose per-block scale and scaled sum are
            // f16: for the offset formats (Q4_0's -8, the K-quants' mins) the f16 sum adds an
            // error the CPU's Q8_0/Q8_K activations lack. Measured on an H100: Q4_0 2.3x the
            // CPU's error, Q4_K 1.7x; a wrong kernel is off by the size of |y|.
            assert!(
                gpu_err <= 3.0 * cpu_err + 1e-3 * scale,
                "{dtype:?} n={n}: GPU error {gpu_err:.3e} vs CPU error {cpu_err:.3e} (max |y| {scale:.3})"
            );
            for t in 0..n {
                let argmax =
                    |v: &[f32]| (0..rows).fold(0, |best, r| if v[r] > v[best] { r } else { best });
                let (c, g) = (
                    &on_cpu[t * rows..(t + 1) * rows],
                    &on_gpu[t * rows..(t + 1) * rows],
                );
                let (ac, ag) = (argmax(c), argmax(g));
                // A near-tie may flip under different activation rounding; only a real gap counts.
                assert!(
                    ac == ag || (c[ac] - c[ag]).abs() <= 2.0 * cpu_err as f32 + 1e-3 * scale as f32,
                    "{dtype:?} n={n} token {t}: argmax {ac} on the CPU, {ag} on the GPU"
                );
            }
        }
    }
}

/// With a GPU present, the engine's probe counts it and `auto` says what it saw: with the `cuda`
/// feature it picks the GPU; without it (a CPU build) it stays on the CPU.
#[test]
#[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
fn device_selection_sees_the_gpu() {
    cuda_required("device_selection_sees_the_gpu");
    let count = device::probe_cuda().unwrap_or_else(|e| panic!("probe: {e}"));
    assert!(
        count >= 1,
        "candle opened cuda:0 but the probe counted {count}"
    );
    let caps = Capabilities::this_build();
    let auto = device::choose(DeviceRequest::Auto, caps, device::probe_cuda)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        auto.reason.contains("CUDA device(s) found"),
        "{}",
        auto.reason
    );
    let explicit = device::choose(DeviceRequest::Cuda(0), caps, device::probe_cuda);
    if caps.cuda_backend {
        assert_eq!(auto.device, EngineDevice::Cuda(0));
        assert_eq!(explicit.ok().map(|c| c.device), Some(EngineDevice::Cuda(0)));
    } else {
        assert_eq!(auto.device, EngineDevice::Cpu);
        let e = explicit.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("CUDA backend is not built yet"), "{e}");
    }
    let beyond = device::choose(DeviceRequest::Cuda(count), caps, device::probe_cuda);
    assert!(
        beyond.is_err(),
        "cuda:{count} of {count} devices was accepted"
    );
}

/// The fast tier on the GPU: its kernels against their Rust twins operation by operation, the
/// engine over it against llama.cpp's logits and itself, and the start-up self-check. Built only
/// with the `cuda` feature (`make cuda-tests`); run by `make gpu-check`.
#[cfg(feature = "cuda")]
mod fast_tier {
    use super::cuda_required;
    use smolchat_engine::backend::BatchItem;
    use smolchat_engine::device::{Device as EngineDevice, GpuTier, Tier};
    use smolchat_engine::fast::cpu::CpuRunner;
    use smolchat_engine::fast::cuda::CudaRunner;
    use smolchat_engine::fast::differential::{self, OpDiff};
    use smolchat_engine::fast::graph::{self, GraphStats};
    use smolchat_engine::fast::launch::MATVEC_MAX_ROWS;
    use smolchat_engine::fast::plan::{Op, Plan};
    use smolchat_engine::fast::weights::FastWeights;
    use smolchat_engine::fast::StepOut;
    use smolchat_engine::fast::{step_tables, Runner};
    use smolchat_engine::rope::RopeTable;
    use smolchat_engine::synthetic::{self, SyntheticSpec, TypeMix};
    use smolchat_engine::{
        DeviceSampling, Engine, EngineOptions, LogitsMode, ModelConfig, SampleRow, SeqStep,
    };
    use smolchat_gguf::{GgmlDType, GgufSource};

    fn weights(spec: &SyntheticSpec) -> FastWeights {
        let mut src = synthetic::build(spec).unwrap_or_else(|e| panic!("{e}"));
        let config = ModelConfig::from_gguf(&src).unwrap_or_else(|e| panic!("{e}"));
        FastWeights::load(&mut src, config, &mut |_, _| {}).unwrap_or_else(|e| panic!("{e}"))
    }

    /// How far a kernel may be from its twin, relative to the largest value it wrote (the
    /// contracts: integer parts exact, floats reduced in another order). A matmul over more
    /// than 8 rows runs llama.cpp's MMQ, which the twins do not model: its activations carry an
    /// f16 block sum for the K-quants' mins and the offset formats, which the twin's MMVQ forms
    /// from the exact integers (measured on an H100: up to 7e-3 on the 3B shape's random
    /// blocks; candle's own MMQ is as far from the exact product, `cuda_qmatmul_…`).
    /// With the device's f16 weight copies the wide matmuls are cuBLAS GEMMs of the twin's own
    /// f16 operands (`fast::twin::f16mm::TOLERANCE`: only the f32 sums' order differs).
    fn tolerance(d: &OpDiff, plan: &Plan, f16: bool) -> f32 {
        match d.op {
            Op::MatMul { out, .. } if plan.rows_of(out) > MATVEC_MAX_ROWS && f16 => {
                smolchat_engine::fast::twin::f16mm::TOLERANCE
            }
            Op::MatMul { out, .. } if plan.rows_of(out) > MATVEC_MAX_ROWS => 2e-2,
            // Our matvec kernels and their twin perform the same float operations in the same
            // order (`fast::twin::matvec`; bit for bit on the same Q8_1 rows:
            // `matvec_kernels_equal_their_twin_bit_for_bit`); here each side quantizes its own
            // input, and the block sums (summed in another order) that the legacy types read
            // may differ in a last bit.
            Op::MatMul { .. } | Op::QkvMatVec { .. } | Op::SwiGluMatVec { .. } => 1e-3,
            // The flash kernel's contract (`fast::twin::flash::TOLERANCE`): its f16 operands
            // are the twin's, its f32 sums run in the tensor cores' order.
            Op::Attention { .. } => smolchat_engine::fast::twin::flash::TOLERANCE,
            // Sample: `max_diff` counts the rows whose drawn tokens differ.
            _ => 1e-5,
        }
    }

    /// Runs the step of `items` on both runners, comparing every operation.
    fn step(cpu: &mut CpuRunner, gpu: &mut CudaRunner, items: &[BatchItem<'_>], what: &str) {
        let config = cpu.config().clone();
        let tables = step_tables(items);
        let positions: Vec<usize> = tables.positions.iter().map(|&p| p as usize).collect();
        let rope = RopeTable::new(&config, &positions);
        let plan = Plan::for_step(&config, &tables);
        let diffs = differential::compare(cpu, gpu, &plan, &tables, &rope)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let worst: Vec<&OpDiff> = diffs
            .iter()
            .filter(|d| !d.within(tolerance(d, &plan, gpu.f16_matmuls())))
            .collect();
        for d in diffs
            .iter()
            .filter(|d| {
                matches!(
                    d.op,
                    Op::Attention { .. }
                        | Op::MatMul { .. }
                        | Op::QkvMatVec { .. }
                        | Op::SwiGluMatVec { .. }
                )
            })
            .take(4)
        {
            eprintln!(
                "{what}: op {} {:?} -> {:?}: {:.2e} of {:.2e}",
                d.index, d.op, d.buf, d.max_diff, d.scale
            );
        }
        assert!(
            worst.is_empty(),
            "{what}: kernels off their twins: {worst:?}"
        );
    }

    /// The sampling rows the kernels test draws with: greedy, the product's defaults, the whole
    /// vocabulary, a narrow nucleus, min-p, penalties, top-k 1, and a draw at the very top.
    fn sampling_rows() -> Vec<DeviceSampling> {
        let row = |temperature: f32, top_k: u32, top_p: f32, min_p: f32, uniform: f64| SampleRow {
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
        };
        let plain = |row: SampleRow| DeviceSampling {
            row,
            penalties: Vec::new(),
        };
        vec![
            plain(SampleRow::GREEDY),
            plain(row(0.7, 40, 0.95, 0.0, 0.42)),
            plain(row(1.0, 0, 1.0, 0.0, 0.77)),
            plain(row(1.5, 0, 0.5, 0.0, 0.05)),
            plain(row(1.0, 0, 1.0, 0.1, 0.63)),
            DeviceSampling {
                row: SampleRow {
                    repetition_penalty: 1.3,
                    presence_penalty: 0.5,
                    frequency_penalty: 0.2,
                    ..row(0.9, 0, 1.0, 0.0, 0.31)
                },
                penalties: vec![(3, 1), (40, 3), (41, 1), (399, 2)],
            },
            plain(row(0.8, 1, 1.0, 0.0, 0.99)),
            plain(row(0.3, 0, 0.9, 0.0, 0.999_999)),
        ]
    }

    /// The kernels that quantize their output in place for the MMVQ matmuls after them
    /// (`rms_norm` with a Q8_1 output, the residual add fused before it, `attention_merge` and
    /// `silu_mul_q8_1`)
    /// write the Q8_1 rows the twin makes of the values they wrote: scales and values bit for
    /// bit, block sums within one f16 step (summed in another order). The differential check
    /// cannot see these rows: it aligns each op's outputs, which makes the matmuls quantize
    /// again.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn kernels_quantizing_in_place_write_the_twins_q8_1_rows() {
        use smolchat_engine::fast::layout::padded_columns;
        use smolchat_engine::fast::twin::q8_1::quantize_rows_q8_1;
        cuda_required("kernels_quantizing_in_place_write_the_twins_q8_1_rows");
        let mut spec = SyntheticSpec::smollm3_3b();
        spec.n_layers = 2;
        let mut gpu = CudaRunner::load(weights(&spec), 0, false).unwrap_or_else(|e| panic!("{e}"));
        gpu.reserve_blocks(8).unwrap_or_else(|e| panic!("{e}"));
        let config = gpu.config().clone();
        let tokens = [5u32, 9, 14];
        let blocks: Vec<[u32; 1]> = (0..3u32).map(|b| [b]).collect();
        let items: Vec<BatchItem<'_>> = (0..3)
            .map(|i| BatchItem {
                blocks: &blocks[i],
                past: 0,
                tokens: &tokens[i..i + 1],
                logits: LogitsMode::Last,
                sample: &[],
            })
            .collect();
        let tables = step_tables(&items);
        let rope = RopeTable::new(&config, &[0, 0, 0]);
        let plan = Plan::for_step(&config, &tables);
        gpu.begin(&plan, &tables, &rope)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut checked = 0;
        for &op in &plan.ops {
            gpu.run_op(&plan, op).unwrap_or_else(|e| panic!("{e}"));
            if !matches!(
                op,
                Op::RmsNorm { .. }
                    | Op::SiluMul { .. }
                    | Op::SwiGluMatVec { .. }
                    | Op::Attention { .. }
            ) {
                continue;
            }
            let Some((buf, got)) = gpu.quantized_rows(&plan).unwrap_or_else(|e| panic!("{e}"))
            else {
                panic!("{op:?} left no Q8_1 rows in a step of 3 rows");
            };
            let values = gpu.read(&plan, buf).unwrap_or_else(|e| panic!("{e}"));
            let rows = plan.rows_of(buf);
            let k = values.len() / rows;
            let want = quantize_rows_q8_1(&values, rows, k, padded_columns(k));
            assert_eq!(got.len(), want.len(), "{op:?}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.d.to_bits(), w.d.to_bits(), "{op:?}, block {i}: scale");
                assert_eq!(g.qs, w.qs, "{op:?}, block {i}: values");
                let step = (half::f16::from_bits(w.s.to_bits() + 1).to_f32() - w.s.to_f32()).abs();
                assert!(
                    (g.s.to_f32() - w.s.to_f32()).abs() <= step.max(1e-7),
                    "{op:?}, block {i}: sum {} against the twin's {}",
                    g.s,
                    w.s
                );
            }
            checked += 1;
        }
        // Per layer the attention norm, the attention's merge, the FFN norm and SwiGLU; then the
        // output norm.
        assert_eq!(checked, 4 * spec.n_layers + 1);
    }

    /// Our matvec kernels equal their twin (`fast::twin::matvec`) bit for bit given the same
    /// Q8_1 rows: the rows the kernels quantizing in place wrote are read back and fed to the
    /// twin, for Q/K/V in one launch, the down projection over `matvec_swiglu`'s Q8_1 rows, and
    /// (within `expf`'s last bits) the SwiGLU itself; every weight type family, steps of 1, 3
    /// and 8 decode rows.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn matvec_kernels_equal_their_twin_bit_for_bit() {
        use smolchat_engine::fast::plan::{Buf, Matrix};
        use smolchat_engine::fast::twin::{matvec, norm};
        cuda_required("matvec_kernels_equal_their_twin_bit_for_bit");
        let mut three_b = SyntheticSpec::smollm3_3b();
        three_b.n_layers = 1;
        let mut specs = vec![("3B Q4_K_M", three_b)];
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
        ] {
            specs.push((
                "tiny",
                SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Uniform(dtype)),
            ));
        }
        for (name, spec) in specs {
            let host = weights(&spec);
            let mut gpu =
                CudaRunner::load(weights(&spec), 0, false).unwrap_or_else(|e| panic!("{e}"));
            gpu.reserve_blocks(8).unwrap_or_else(|e| panic!("{e}"));
            let config = gpu.config().clone();
            for n_rows in [1usize, 3, 8] {
                let tokens: Vec<u32> = (0..n_rows as u32).map(|i| 5 + 7 * i).collect();
                let blocks: Vec<[u32; 1]> = (0..n_rows as u32).map(|b| [b]).collect();
                let items: Vec<BatchItem<'_>> = (0..n_rows)
                    .map(|i| BatchItem {
                        blocks: &blocks[i],
                        past: 0,
                        tokens: &tokens[i..i + 1],
                        logits: LogitsMode::Last,
                        sample: &[],
                    })
                    .collect();
                let tables = step_tables(&items);
                let rope = RopeTable::new(&config, &vec![0; n_rows]);
                let plan = Plan::for_step(&config, &tables);
                gpu.begin(&plan, &tables, &rope)
                    .unwrap_or_else(|e| panic!("{e}"));
                let mut held: Option<(Buf, Vec<smolchat_engine::fast::layout::BlockQ8_1>)> = None;
                let mut checked = 0;
                let what = format!(
                    "{name} {:?}, {n_rows} rows",
                    host.matrix(Matrix::Q(0)).map(|m| m.dtype)
                );
                let same_bits = |weight: Matrix, got: &[f32], want: &[f32]| {
                    let differ = got
                        .iter()
                        .zip(want)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ, 0,
                        "{what}: {weight:?}: {differ} outputs differ from the twin's"
                    );
                };
                for &op in &plan.ops {
                    gpu.run_op(&plan, op).unwrap_or_else(|e| panic!("{e}"));
                    let twin = |weight: Matrix, q8: &[smolchat_engine::fast::layout::BlockQ8_1]| {
                        let m = host.matrix(weight).unwrap_or_else(|e| panic!("{e}"));
                        let mut out = vec![0.0; n_rows * m.rows];
                        matvec::matvec(
                            m.dtype,
                            m.bytes.as_slice(),
                            m.rows,
                            m.cols,
                            q8,
                            n_rows,
                            &mut out,
                        )
                        .unwrap_or_else(|e| panic!("{e}"));
                        out
                    };
                    match op {
                        Op::QkvMatVec { layer } => {
                            let (buf, q8) = held
                                .take()
                                .unwrap_or_else(|| panic!("{what}: no Q8_1 rows of H"));
                            assert_eq!(buf, Buf::H);
                            for (weight, out) in [
                                (Matrix::Q(layer), Buf::Q),
                                (Matrix::K(layer), Buf::K),
                                (Matrix::V(layer), Buf::V),
                            ] {
                                let got = gpu.read(&plan, out).unwrap_or_else(|e| panic!("{e}"));
                                let want = twin(weight, &q8);
                                same_bits(weight, &got, &want);
                            }
                            checked += 1;
                        }
                        Op::SwiGluMatVec { layer, x, gate, .. } => {
                            let (buf, q8) = held
                                .take()
                                .unwrap_or_else(|| panic!("{what}: no Q8_1 rows of {x:?}"));
                            assert_eq!(buf, x);
                            let mut g = twin(Matrix::Gate(layer), &q8);
                            let u = twin(Matrix::Up(layer), &q8);
                            norm::silu_mul(&mut g, &u);
                            let got = gpu.read(&plan, gate).unwrap_or_else(|e| panic!("{e}"));
                            for (i, (a, b)) in got.iter().zip(&g).enumerate() {
                                assert!(
                                    (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                                    "{what}: SwiGLU {i}: {a} against {b}"
                                );
                            }
                            checked += 1;
                        }
                        Op::MatMul {
                            weight: weight @ Matrix::Down(_),
                            out,
                            ..
                        } => {
                            let (_, q8) = held
                                .take()
                                .unwrap_or_else(|| panic!("{what}: no Q8_1 rows of the SwiGLU"));
                            let got = gpu.read(&plan, out).unwrap_or_else(|e| panic!("{e}"));
                            let want = twin(weight, &q8);
                            same_bits(weight, &got, &want);
                            checked += 1;
                        }
                        _ => {}
                    }
                    held = gpu.quantized_rows(&plan).unwrap_or_else(|e| panic!("{e}"));
                }
                assert_eq!(checked, 3 * config.n_layers, "{what}");
            }
        }
    }

    /// Every kernel over steps of many shapes: prefill across block boundaries, decode over
    /// context splits beside short prefills (MMQ: more than 8 rows), and eight one-token rows
    /// drawn on the device with as many sampling settings (MMVQ, penalties, sampling), for each
    /// weight type family. The 3B shape (real matrix sizes, Q4_K_M) runs shorter prompts: its
    /// twins are plain loops on the host.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn kernels_equal_their_twins() {
        cuda_required("kernels_equal_their_twins");
        let mut three_b = SyntheticSpec::smollm3_3b();
        three_b.n_layers = 2;
        let sampling = sampling_rows();
        for (name, spec, prompt) in [
            (
                "smollm3 q8_0",
                SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Uniform(GgmlDType::Q8_0)),
                700,
            ),
            (
                "llama q4_1",
                SyntheticSpec::tiny("llama").with_type_mix(TypeMix::Uniform(GgmlDType::Q4_1)),
                700,
            ),
            (
                "llama q6_k",
                SyntheticSpec::tiny("llama").with_type_mix(TypeMix::Uniform(GgmlDType::Q6K)),
                700,
            ),
            ("3B shape Q4_K_M", three_b, 40),
        ] {
            let started = std::time::Instant::now();
            let mut gpu = CudaRunner::load(weights(&spec), 0, false)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            // The twins of the path the GPU takes for wide steps.
            let mut cpu = CpuRunner::new(weights(&spec)).with_f16_matmuls(gpu.f16_matmuls());
            eprintln!("{name}: f16 matmuls for wide steps: {}", gpu.f16_matmuls());
            for r in [&mut cpu as &mut dyn Runner, &mut gpu] {
                r.reserve_blocks(64).unwrap_or_else(|e| panic!("{e}"));
            }
            let long: Vec<u32> = (0..prompt).map(|i| (i * 37 % 400 + 3) as u32).collect();
            let a_blocks: Vec<u32> = (0..45).collect();
            let b_blocks: Vec<u32> = (50..53).collect();
            let c_blocks: Vec<u32> = vec![60, 61];
            let short = prompt.min(37);
            // A long prefill in one step, then a decode over the context splits beside two
            // short prefills.
            step(
                &mut cpu,
                &mut gpu,
                &[BatchItem {
                    blocks: &a_blocks,
                    past: 0,
                    tokens: &long[..prompt - 1],
                    logits: LogitsMode::Last,
                    sample: &[],
                }],
                &format!("{name} prefill"),
            );
            step(
                &mut cpu,
                &mut gpu,
                &[
                    BatchItem {
                        blocks: &a_blocks,
                        past: prompt - 1,
                        tokens: &long[prompt - 1..],
                        logits: LogitsMode::Last,
                        sample: &[],
                    },
                    BatchItem {
                        blocks: &b_blocks,
                        past: 0,
                        tokens: &long[..short],
                        logits: LogitsMode::All,
                        sample: &[],
                    },
                    BatchItem {
                        blocks: &c_blocks,
                        past: 0,
                        tokens: &long[10..27],
                        logits: LogitsMode::None,
                        sample: &[],
                    },
                ],
                &format!("{name} mixed"),
            );
            let own: Vec<[u32; 1]> = (45..50).chain(53..56).map(|b| [b]).collect();
            let items: Vec<BatchItem<'_>> = sampling
                .iter()
                .zip(&own)
                .enumerate()
                .map(|(i, (s, blocks))| BatchItem {
                    blocks,
                    past: 0,
                    tokens: &long[i..i + 1],
                    logits: LogitsMode::Sample,
                    sample: std::slice::from_ref(s),
                })
                .collect();
            step(&mut cpu, &mut gpu, &items, &format!("{name} sampled"));
            eprintln!("{name}: {:.1} s", started.elapsed().as_secs_f64());
        }
    }

    fn engine(path: &std::path::Path, tier: GpuTier) -> Engine {
        let mut src = GgufSource::open(path).unwrap_or_else(|e| panic!("{e}"));
        Engine::load(
            &mut src,
            EngineDevice::Cuda(0),
            &EngineOptions {
                gpu_tier: tier,
                ..EngineOptions::default()
            },
            &mut |_, _| {},
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `tests/data/<name>` of the repository the test runs in: `SMOLTEST_ROOT` when set (the
    /// test binary is carried to a GPU machine, where the tree is not where it was built).
    fn data(name: &str) -> std::path::PathBuf {
        std::env::var_os("SMOLTEST_ROOT")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
            .join("tests/data")
            .join(name)
    }

    /// The engine on the fast tier: the tiny SmolLM3 within 0.05 of llama.cpp with its argmax,
    /// sequences batched equal to alone, and a cache dropped and rebuilt giving the same logits.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn the_fast_tier_matches_llama_cpp_and_itself() {
        cuda_required("the_fast_tier_matches_llama_cpp_and_itself");
        let mut e = engine(&data("smollm3-tiny-q8_0.gguf"), GpuTier::Fast);
        assert_eq!(e.tier(), Tier::Fast);
        let text = std::fs::read_to_string(data("smollm3-tiny-q8_0-tokens.json"))
            .unwrap_or_else(|e| panic!("{e}"));
        let meta: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
        let ids = |k: &str| -> Vec<u32> {
            meta[k]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_u64())
                        .map(|v| v as u32)
                        .collect()
                })
                .unwrap_or_default()
        };
        let tokens = ids("token_ids");
        let argmax = ids("argmax_per_position");
        let expected =
            candle_core::Tensor::read_npy(data("smollm3-tiny-q8_0-logits-fa-off-kvf32.npy"))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .unwrap_or_else(|e| panic!("{e}"));
        let vocab = expected.len() / tokens.len();
        let seq = e.create_sequence();
        let got = e
            .step(&[SeqStep {
                seq,
                tokens: &tokens,
                logits: LogitsMode::All,
            }])
            .unwrap_or_else(|e| panic!("{e}"));
        let got = got.into_iter().next().flatten().unwrap_or_default();
        e.free_sequence(seq);
        for (pos, (g, w)) in got.chunks(vocab).zip(expected.chunks(vocab)).enumerate() {
            let d = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d <= 0.05, "position {pos}: {d}");
            let best = (0..vocab).fold(0, |b, i| if g[i] > g[b] { i } else { b });
            assert_eq!(best as u32, argmax[pos], "argmax at {pos}");
        }
        // Batched equal to alone. Steps of at most 8 rows take MMVQ, whose activations carry
        // f16 scales; larger ones take MMQ, whose Q8_0 activations carry f32 scales (as in
        // llama.cpp, where a sequence's logits also depend on that): within one path 1e-3 of
        // the largest logit, across the two the bound held against llama.cpp above (measured
        // on an H100: 0.023 for the 3-token prompt).
        let within_path = batched_equals_alone(&mut e, &tokens, &[1, 2, 3]);
        let across_paths = batched_equals_alone(&mut e, &tokens, &[3, 17, 33]);
        for (i, (d, scale)) in within_path.iter().enumerate() {
            assert!(*d <= 1e-3 * scale, "MMVQ, sequence {i}: {d} of {scale}");
        }
        for (i, (d, scale)) in across_paths.iter().enumerate() {
            assert!(*d <= 0.05, "MMQ vs MMVQ, sequence {i}: {d} of {scale}");
        }
    }

    /// Embeddings on the GPU: the final hidden states the fast tier's CUDA runner copies back
    /// (its plan stops at the output norm) are the CPU engine's, beside a sequence that wants
    /// logits in the same step.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn hidden_states_for_embeddings_match_the_cpu_engine() {
        cuda_required("hidden_states_for_embeddings_match_the_cpu_engine");
        let path = data("smollm3-tiny-q8_0.gguf");
        let mut gpu = engine(&path, GpuTier::Fast);
        let mut src = GgufSource::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let model = smolchat_engine::Model::load(&mut src, &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{e}"));
        let mut cpu = Engine::new(model);
        let prompt: Vec<u32> = (100..140).collect();
        let other: Vec<u32> = (300..305).collect();
        let hidden = |e: &mut Engine| {
            let (a, b) = (e.create_sequence(), e.create_sequence());
            let mut out = smolchat_engine::Logits::new();
            e.step_into(
                &[
                    SeqStep {
                        seq: a,
                        tokens: &prompt,
                        logits: LogitsMode::Hidden,
                    },
                    SeqStep {
                        seq: b,
                        tokens: &other,
                        logits: LogitsMode::Last,
                    },
                ],
                &mut out,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            e.free_sequence(a);
            e.free_sequence(b);
            assert!(out.get(1).is_some(), "the neighbour's logits");
            out.hidden(0).map(<[f32]>::to_vec).unwrap_or_default()
        };
        let (g, c) = (hidden(&mut gpu), hidden(&mut cpu));
        assert_eq!(g.len(), c.len());
        assert_eq!(g.len(), prompt.len() * gpu.config().hidden);
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = g
            .iter()
            .zip(&c)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 2e-2 * scale, "hidden states: {d} of {scale}");
    }

    /// Prompts cut from `tokens` stepped alone, then together: for each, the largest logit
    /// difference and the largest |logit| alone.
    fn batched_equals_alone(e: &mut Engine, tokens: &[u32], lengths: &[usize]) -> Vec<(f32, f32)> {
        let prompts: Vec<Vec<u32>> = lengths
            .iter()
            .map(|&n| tokens.iter().cycle().take(n).copied().collect())
            .collect();
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| {
                let s = e.create_sequence();
                let out = e
                    .step(&[SeqStep {
                        seq: s,
                        tokens: p,
                        logits: LogitsMode::Last,
                    }])
                    .unwrap_or_else(|e| panic!("{e}"));
                e.free_sequence(s);
                out.into_iter().next().flatten().unwrap_or_default()
            })
            .collect();
        let seqs: Vec<_> = prompts.iter().map(|_| e.create_sequence()).collect();
        let steps: Vec<SeqStep<'_>> = seqs
            .iter()
            .zip(&prompts)
            .map(|(&seq, p)| SeqStep {
                seq,
                tokens: p,
                logits: LogitsMode::Last,
            })
            .collect();
        let together = e.step(&steps).unwrap_or_else(|e| panic!("{e}"));
        for s in seqs {
            e.free_sequence(s);
        }
        together
            .iter()
            .zip(&alone)
            .map(|(g, w)| {
                let g = g.as_deref().unwrap_or_default();
                assert_eq!(g.len(), w.len());
                let d = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                (d, w.iter().map(|v| v.abs()).fold(1.0, f32::max))
            })
            .collect()
    }

    /// `auto` checks the fast tier against the reference tier at load and keeps it.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn the_self_check_passes_on_this_gpu() {
        cuda_required("the_self_check_passes_on_this_gpu");
        let e = engine(&data("smollm3-tiny-q8_0.gguf"), GpuTier::Auto);
        assert_eq!((e.tier(), e.note()), (Tier::Fast, None), "{:?}", e.note());
        let r = engine(&data("smollm3-tiny-q8_0.gguf"), GpuTier::Reference);
        assert_eq!(r.tier(), Tier::Reference);
    }

    /// A decode with drafts, every position drawn on the GPU (`LogitsMode::SampleAll`), is one
    /// replay of a decode graph and draws what plain decoding drew, greedy and sampled (the
    /// check the CPU twins pass in `fast::verify`).
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn verifying_steps_draw_as_decoding_does_in_graphs() {
        cuda_required("verifying_steps_draw_as_decoding_does_in_graphs");
        for sampled in [false, true] {
            let mut e = engine(&data("smollm3-tiny-q8_0.gguf"), GpuTier::Fast);
            assert!(e.graph_stats().is_some(), "the fast tier replays graphs");
            smolchat_engine::fast::verify::verifying_steps_draw_as_decoding_does(&mut e, sampled)
                .unwrap_or_else(|err| panic!("{err}"));
        }
    }

    /// CUDA graphs replay exactly what the same padded step computes eagerly (bit for bit: the
    /// same kernels with the same arguments), across buckets of 5 and 10 sequences (MMVQ and
    /// MMQ inside the capture), a block-table bucket change, and a recapture after the KV arena
    /// grows.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn graphs_replay_what_eager_computes() {
        cuda_required("graphs_replay_what_eager_computes");
        let mut spec = SyntheticSpec::smollm3_3b();
        spec.n_layers = 2;
        let mut eager =
            CudaRunner::load(weights(&spec), 0, false).unwrap_or_else(|e| panic!("{e}"));
        let mut graphed =
            CudaRunner::load(weights(&spec), 0, true).unwrap_or_else(|e| panic!("{e}"));
        let config = eager.config().clone();
        let vocab = config.vocab_size;
        let sampling = sampling_rows();
        for sequences in [5usize, 10] {
            for r in [&mut eager as &mut dyn Runner, &mut graphed] {
                r.reserve_blocks(sequences * 20)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            let tables_of: Vec<Vec<u32>> = (0..sequences)
                .map(|s| ((s * 20) as u32..(s * 20 + 20) as u32).collect())
                .collect();
            let mut past = vec![0usize; sequences];
            let mut next = vec![1u32; sequences];
            // Prompts of different lengths (the longest crosses 256 positions while decoding).
            let prompts: Vec<Vec<u32>> = (0..sequences)
                .map(|s| {
                    (0..(250 - s * 20) as u32)
                        .map(|i| (i * 31 + s as u32) % 900 + 3)
                        .collect()
                })
                .collect();
            let items: Vec<BatchItem<'_>> = (0..sequences)
                .map(|s| BatchItem {
                    blocks: &tables_of[s],
                    past: 0,
                    tokens: &prompts[s],
                    logits: LogitsMode::None,
                    sample: &[],
                })
                .collect();
            let tables = step_tables(&items);
            let positions: Vec<usize> = tables.positions.iter().map(|&p| p as usize).collect();
            let rope = RopeTable::new(&config, &positions);
            let plan = Plan::for_step(&config, &tables);
            for r in [&mut eager as &mut dyn Runner, &mut graphed] {
                r.run(&plan, &tables, &rope, StepOut::logits(&mut []))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            for (s, p) in prompts.iter().enumerate() {
                past[s] = p.len();
            }
            for step in 0..12 {
                if step == 8 {
                    // The arena grows: every graph over the old one is stale.
                    let more = sequences * 20 + 8;
                    for r in [&mut eager as &mut dyn Runner, &mut graphed] {
                        r.reserve_blocks(more).unwrap_or_else(|e| panic!("{e}"));
                    }
                }
                let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                // From step 6 on, the rows draw their tokens inside the graph.
                let drawn = step >= 6;
                let items: Vec<BatchItem<'_>> = (0..sequences)
                    .map(|s| BatchItem {
                        blocks: &tables_of[s],
                        past: past[s],
                        tokens: &tokens[s],
                        logits: if drawn {
                            LogitsMode::Sample
                        } else {
                            LogitsMode::Last
                        },
                        sample: if drawn {
                            std::slice::from_ref(&sampling[(s + step) % sampling.len()])
                        } else {
                            &[]
                        },
                    })
                    .collect();
                let tables = step_tables(&items);
                let key = graph::key_of(&tables).unwrap_or_else(|| panic!("no bucket"));
                let padded = graph::pad_decode(&tables, key).unwrap_or_else(|e| panic!("{e}"));
                let positions: Vec<usize> = padded.positions.iter().map(|&p| p as usize).collect();
                let rope = RopeTable::new(&config, &positions);
                let plan = Plan::for_step(&config, &padded);
                let mut want = vec![0f32; key.rows * vocab];
                let mut got = vec![0f32; key.rows * vocab];
                let (mut want_tokens, mut got_tokens) = if drawn {
                    (vec![0u32; key.rows], vec![0u32; key.rows])
                } else {
                    (Vec::new(), Vec::new())
                };
                eager
                    .run(
                        &plan,
                        &padded,
                        &rope,
                        StepOut {
                            logits: &mut want,
                            tokens: &mut want_tokens,
                        },
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                graphed
                    .run_graph(
                        key,
                        &plan,
                        &padded,
                        &rope,
                        StepOut {
                            logits: &mut got,
                            tokens: &mut got_tokens,
                        },
                    )
                    .unwrap_or_else(|e| panic!("{sequences} sequences, step {step}: {e}"));
                let real = sequences * vocab;
                assert!(
                    got[..real] == want[..real],
                    "{sequences} sequences, step {step} ({key:?}): the graph differs from eager"
                );
                assert_eq!(
                    got_tokens, want_tokens,
                    "{sequences} sequences, step {step}: drawn tokens differ"
                );
                for s in 0..sequences {
                    let row = &got[s * vocab..(s + 1) * vocab];
                    next[s] = if drawn {
                        got_tokens[s]
                    } else {
                        (0..vocab).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as u32
                    };
                    past[s] += 1;
                }
            }
        }
        let stats: GraphStats = graphed.graph_stats();
        eprintln!("graph stats: {stats:?}");
        assert!(stats.captures >= 2, "{stats:?}");
        assert!(stats.invalidated >= 1, "{stats:?}");
        assert!(stats.replays >= 10, "{stats:?}");
    }

    /// Where the 3B shape's step time goes on this GPU (all 36 layers, Q4_K_M): a prefill of
    /// 512 and decode steps of 1 and 64 rows at 512 positions of context, each operation run
    /// eagerly with a synchronize after it (so each figure holds one launch's overhead too),
    /// summed by kind; then whole steps eager and replayed from a graph. A measurement that
    /// gpu-check prints, not a timed assertion.
    #[test]
    #[ignore = "needs a CUDA GPU and a `--features cuda` build: run with --ignored there"]
    fn profile_the_3b_shape() {
        use std::collections::BTreeMap;
        use std::time::Instant;
        cuda_required("profile_the_3b_shape");
        let spec = SyntheticSpec::smollm3_3b();
        let mut gpu = CudaRunner::load(weights(&spec), 0, true).unwrap_or_else(|e| panic!("{e}"));
        let config = gpu.config().clone();
        gpu.reserve_blocks(64 * 34)
            .unwrap_or_else(|e| panic!("{e}"));
        let prompt: Vec<u32> = (0..512).map(|i| (i * 7919 % 128_000) as u32).collect();
        let tables_of: Vec<Vec<u32>> = (0..64)
            .map(|s| ((s * 34) as u32..(s * 34 + 33) as u32).collect())
            .collect();
        let kind = |op: Op| -> String {
            format!("{op:?}")
                .chars()
                .filter(|c| !c.is_ascii_digit())
                .collect::<String>()
                .replace("()", "")
        };
        let greedy = DeviceSampling {
            row: SampleRow::GREEDY,
            penalties: Vec::new(),
        };
        let profile = |what: &str, items: &[BatchItem<'_>], gpu: &mut CudaRunner| {
            let tables = step_tables(items);
            let positions: Vec<usize> = tables.positions.iter().map(|&p| p as usize).collect();
            let rope = RopeTable::new(&config, &positions);
            let plan = Plan::for_step(&config, &tables);
            let mut by_kind: BTreeMap<String, (f64, usize)> = BTreeMap::new();
            gpu.begin(&plan, &tables, &rope)
                .unwrap_or_else(|e| panic!("{e}"));
            gpu.synchronize().unwrap_or_else(|e| panic!("{e}"));
            for &op in &plan.ops {
                let t = Instant::now();
                gpu.run_op(&plan, op).unwrap_or_else(|e| panic!("{e}"));
                gpu.synchronize().unwrap_or_else(|e| panic!("{e}"));
                let e = by_kind.entry(kind(op)).or_default();
                e.0 += t.elapsed().as_secs_f64() * 1e3;
                e.1 += 1;
            }
            let total: f64 = by_kind.values().map(|v| v.0).sum();
            let mut rows: Vec<_> = by_kind.into_iter().collect();
            rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
            eprintln!("== {what}: {} ops, {total:.2} ms op by op", plan.ops.len());
            for (k, (ms, n)) in rows {
                eprintln!("{ms:9.3} ms {:5.1}% {n:4}x  {k}", 100.0 * ms / total);
            }
            // Whole steps: eager, then (decode only) replayed from a graph.
            let mut tokens = vec![0u32; plan.logit_rows];
            let reps = 5;
            let t = Instant::now();
            for _ in 0..reps {
                gpu.run(
                    &plan,
                    &tables,
                    &rope,
                    StepOut {
                        logits: &mut [],
                        tokens: &mut tokens,
                    },
                )
                .unwrap_or_else(|e| panic!("{e}"));
            }
            eprintln!(
                "   eager step: {:.3} ms",
                t.elapsed().as_secs_f64() * 1e3 / reps as f64
            );
            if let Some(key) = graph::key_of(&tables) {
                let padded = graph::pad_decode(&tables, key).unwrap_or_else(|e| panic!("{e}"));
                let positions: Vec<usize> = padded.positions.iter().map(|&p| p as usize).collect();
                let rope = RopeTable::new(&config, &positions);
                let plan = Plan::for_step(&config, &padded);
                let mut tokens = vec![0u32; key.rows];
                for _ in 0..3 {
                    gpu.run_graph(
                        key,
                        &plan,
                        &padded,
                        &rope,
                        StepOut {
                            logits: &mut [],
                            tokens: &mut tokens,
                        },
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                }
                let reps = 20;
                let t = Instant::now();
                for _ in 0..reps {
                    gpu.run_graph(
                        key,
                        &plan,
                        &padded,
                        &rope,
                        StepOut {
                            logits: &mut [],
                            tokens: &mut tokens,
                        },
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                }
                eprintln!(
                    "   graph step: {:.3} ms",
                    t.elapsed().as_secs_f64() * 1e3 / reps as f64
                );
            }
        };
        profile(
            "prefill 512",
            &[BatchItem {
                blocks: &tables_of[0],
                past: 0,
                tokens: &prompt,
                logits: LogitsMode::None,
                sample: &[],
            }],
            &mut gpu,
        );
        // The other 63 contexts, eight prompts a step.
        let fill: Vec<BatchItem<'_>> = (1..64)
            .map(|s| BatchItem {
                blocks: &tables_of[s],
                past: 0,
                tokens: &prompt,
                logits: LogitsMode::None,
                sample: &[],
            })
            .collect();
        for chunk in fill.chunks(8) {
            let tables = step_tables(chunk);
            let positions: Vec<usize> = tables.positions.iter().map(|&p| p as usize).collect();
            let rope = RopeTable::new(&config, &positions);
            let plan = Plan::for_step(&config, &tables);
            gpu.run(&plan, &tables, &rope, StepOut::logits(&mut []))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let next = [[1u32]; 64];
        for rows in [1usize, 64] {
            let items: Vec<BatchItem<'_>> = (0..rows)
                .map(|s| BatchItem {
                    blocks: &tables_of[s],
                    past: 512,
                    tokens: &next[s],
                    logits: LogitsMode::Sample,
                    sample: std::slice::from_ref(&greedy),
                })
                .collect();
            profile(&format!("decode {rows} rows at 512"), &items, &mut gpu);
        }
    }
}
