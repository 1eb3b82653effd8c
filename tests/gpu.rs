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
            assert!(
                gpu_err <= 2.0 * cpu_err + 1e-3 * scale,
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

/// With a GPU present, the engine's probe counts it and `auto` says what it saw. Until the CUDA
/// backend exists, `auto` stays on the CPU and an explicit `cuda` is refused with the reason.
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
