//! Micro-benchmark of `QMatrix::matmul` on the model shapes: candle's `vec_dot` path ("candle",
//! the engine's original path) against the packed SIMD kernels ("packed", best ISA, or every ISA
//! with `BENCH_ISA=all`), for several token counts, on rayon pools of 1 and 2 threads.
//!
//! `cargo bench --bench matmul` runs everything. Environment knobs:
//! - `BENCH_FILTER=q4_1` keeps the cases whose label contains the text;
//! - `BENCH_TOKENS=1,8` sets the token counts (default 1,8,64,512);
//! - `BENCH_THREADS=2` sets the pool sizes (default 1,2);
//! - `BENCH_CANDLE=0` skips the candle path (it takes minutes on the big shapes);
//! - `BENCH_ISA=all` also runs the AVX-VNNI, AVX2 and scalar kernels;
//! - `BENCH_SECS=0.5` is the time spent per measurement;
//! - `BENCH_COLD=1` rotates through enough copies of the matrix (512 MB) that every call streams
//!   its weights from memory, as decode does in a real model (otherwise a small matrix stays in
//!   cache between calls and decode looks faster than it is; `BENCH_COLD_MB` sets the size);
//! - `BENCH_OUTSIDE=1` adds rows ("thr" shown as `2o`) where the 2-thread global pool is called
//!   from the main thread, which is not one of its workers (every parallel region then pays a
//!   cross-thread injection and wake-up, as when a model runs outside `ThreadPool::install`).
//!
//! Columns: milliseconds per call; GB/s of weight bytes streamed (bytes held / time: what decode is
//! bound by); rows·tokens per second (outputs produced); GMAC/s (multiply-accumulates per second).

use std::time::{Duration, Instant};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use smolchat_engine::cpu::quant::act::Acts;
use smolchat_engine::cpu::quant::layout::Format;
use smolchat_engine::cpu::quant::Isa;
use smolchat_engine::cpu::quant::QMatrix;
use smolchat_gguf::{AlignedBytes, RawTensor};

struct Case {
    label: &'static str,
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
}

const fn case(label: &'static str, dtype: GgmlDType, rows: usize, cols: usize) -> Case {
    Case {
        label,
        dtype,
        rows,
        cols,
    }
}

const CASES: &[Case] = &[
    // SmolLM2-135M Q4_1 (tied Q8_0 LM head).
    case("135m q4_1 attn_q/o 576x576", GgmlDType::Q4_1, 576, 576),
    case("135m q4_1 attn_k/v 192x576", GgmlDType::Q4_1, 192, 576),
    case("135m q4_1 ffn_gate/up 1536x576", GgmlDType::Q4_1, 1536, 576),
    case("135m q4_1 ffn_down 576x1536", GgmlDType::Q4_1, 576, 1536),
    case("135m q8_0 lm_head 49152x576", GgmlDType::Q8_0, 49152, 576),
    // SmolLM3-3B, llama.cpp's Q4_K_M mix.
    case("3b q4_k attn_q/o 2048x2048", GgmlDType::Q4K, 2048, 2048),
    case("3b q4_k attn_k 512x2048", GgmlDType::Q4K, 512, 2048),
    case("3b q6_k attn_v 512x2048", GgmlDType::Q6K, 512, 2048),
    case(
        "3b q4_k ffn_gate/up 11008x2048",
        GgmlDType::Q4K,
        11008,
        2048,
    ),
    case("3b q4_k ffn_down 2048x11008", GgmlDType::Q4K, 2048, 11008),
    case("3b q6_k ffn_down 2048x11008", GgmlDType::Q6K, 2048, 11008),
    case("3b q6_k lm_head 128256x2048", GgmlDType::Q6K, 128256, 2048),
    // The other kernels, on a 3B-sized square.
    case("q4_0 2048x2048", GgmlDType::Q4_0, 2048, 2048),
    case("q8_0 2048x2048", GgmlDType::Q8_0, 2048, 2048),
];

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| default.to_vec())
}

/// Random weights: a block of at most 1024 rows quantized by candle, repeated to the full height
/// (quantizing 128256 rows would take minutes; repetition does not help any cache, the matrices
/// are streamed).
fn weights(c: &Case) -> Vec<u8> {
    let src_rows = c.rows.min(1024);
    let mut seed = 0x9E3779B97F4A7C15u64 ^ (c.rows * 31 + c.cols) as u64;
    let vals: Vec<f32> = (0..src_rows * c.cols)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    let t = Tensor::from_vec(vals, (src_rows, c.cols), &Device::Cpu).expect("tensor");
    let q = QTensor::quantize(&t, c.dtype).expect("quantize");
    let block = q.data().expect("bytes").to_vec();
    let row_bytes = block.len() / src_rows;
    let mut out = Vec::with_capacity(c.rows * row_bytes);
    while out.len() < c.rows * row_bytes {
        let take = (c.rows * row_bytes - out.len()).min(block.len());
        out.extend_from_slice(&block[..take]);
    }
    out
}

fn raw(c: &Case, bytes: &[u8]) -> RawTensor {
    RawTensor {
        name: c.label.to_string(),
        dtype: c.dtype,
        dims: vec![c.rows, c.cols],
        data: AlignedBytes::from_slice(bytes),
    }
}

/// Time per call: the fastest of many short batches spread over about `secs` (the build machines
/// are shared, and the minimum is what the code can do; interference only ever adds time). A call
/// slower than `secs` is timed once.
fn time(secs: f64, mut f: impl FnMut()) -> Duration {
    let t = Instant::now();
    f();
    let first = t.elapsed();
    if first.as_secs_f64() > secs {
        return first;
    }
    // Batches of about 2 ms.
    let per_batch = ((2e-3 / first.as_secs_f64().max(1e-7)) as u32).clamp(1, 10_000);
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut batches = 0;
    while batches < 3 || start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        best = best.min(t.elapsed() / per_batch);
        batches += 1;
    }
    best
}

fn main() {
    let filter = std::env::var("BENCH_FILTER").unwrap_or_default();
    let tokens = env_list("BENCH_TOKENS", &[1, 8, 64, 512]);
    let threads = env_list("BENCH_THREADS", &[1, 2]);
    let candle = std::env::var("BENCH_CANDLE").map_or(true, |v| v != "0");
    let secs: f64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.5);
    let isas: Vec<Isa> = if std::env::var("BENCH_ISA").is_ok_and(|v| v == "all") {
        [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Scalar]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    } else {
        vec![Isa::best()]
    };
    let pools: Vec<(usize, rayon::ThreadPool)> = threads
        .iter()
        .map(|&n| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("thread pool");
            (n, pool)
        })
        .collect();
    let outside = std::env::var("BENCH_OUTSIDE").is_ok_and(|v| v == "1");
    let cold = std::env::var("BENCH_COLD").is_ok_and(|v| v == "1");
    if outside {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build_global()
            .expect("global pool");
    }
    println!("best ISA: {:?}", Isa::best());
    println!(
        "{:<32} {:>4} {:>3} {:<18} {:>10} {:>8} {:>10} {:>8}",
        "case", "tok", "thr", "path", "ms/call", "GB/s", "Mrow·tok/s", "GMAC/s"
    );
    for c in CASES.iter().filter(|c| c.label.contains(filter.as_str())) {
        let bytes = weights(c);
        let copies = if cold {
            (std::env::var("BENCH_COLD_MB")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(512usize)
                << 20)
                .div_ceil(bytes.len())
        } else {
            1
        };
        let packed: Vec<QMatrix> = (0..copies)
            .map(|_| QMatrix::from_raw(raw(c, &bytes)).expect("packed matrix"))
            .collect();
        let plain: Vec<QMatrix> = (0..copies.min(4))
            .map(|_| QMatrix::from_raw_native(raw(c, &bytes)).expect("native matrix"))
            .collect();
        let wbytes = packed[0].size_in_bytes() as f64;
        for &n in &tokens {
            let x: Vec<f32> = (0..n * c.cols)
                .map(|i| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0)
                .collect();
            let mut out = vec![0f32; n * c.rows];
            if let Some(kind) = Format::from_dtype(c.dtype).map(|f| f.act_kind()) {
                let d = time(secs / 4.0, || {
                    std::hint::black_box(Acts::quantize(kind, &x, n, c.cols));
                });
                println!(
                    "{:<32} {:>4} {:>3} {:<18} {:>10.3}",
                    c.label,
                    n,
                    1,
                    format!("quantize {kind:?}")
                        .chars()
                        .take(18)
                        .collect::<String>(),
                    d.as_secs_f64() * 1e3
                );
            }
            for (nt, pool) in &pools {
                let mut runs: Vec<(String, &[QMatrix], Isa)> = isas
                    .iter()
                    .map(|&i| (format!("packed {i:?}"), &packed[..], i))
                    .collect();
                // The candle path at 512 tokens on the big shapes takes minutes per call.
                let macs = c.rows * c.cols * n;
                if candle && (macs as f64) < 3e10 {
                    runs.push(("candle".into(), &plain[..], Isa::Scalar));
                }
                let mut runs: Vec<(String, &[QMatrix], Isa, bool)> =
                    runs.into_iter().map(|(a, b, c)| (a, b, c, false)).collect();
                if outside && *nt == 2 {
                    runs.push((
                        format!("packed {:?}", Isa::best()),
                        &packed,
                        Isa::best(),
                        true,
                    ));
                }
                for (name, ms, isa, global) in runs {
                    let mut i = 0;
                    let call = || {
                        i = (i + 1) % ms.len();
                        ms[i].matmul_isa(isa, &x, n, &mut out)
                    };
                    let d = if global {
                        time(secs, call)
                    } else {
                        pool.install(|| time(secs, call))
                    };
                    let s = d.as_secs_f64();
                    println!(
                        "{:<32} {:>4} {:>3} {:<18} {:>10.3} {:>8.2} {:>10.2} {:>8.2}",
                        c.label,
                        n,
                        if global {
                            "2o".to_string()
                        } else {
                            nt.to_string()
                        },
                        name,
                        s * 1e3,
                        wbytes / s / 1e9,
                        (c.rows * n) as f64 / s / 1e6,
                        macs as f64 / s / 1e9
                    );
                }
            }
        }
    }
}
