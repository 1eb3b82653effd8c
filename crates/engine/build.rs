// Two jobs:
// - The AVX-512 kernels' source (src/cpu/quant/avx512.rs) is copied without its
//   `#[target_feature]` attributes and its `std::arch` import, for the kernel tests to compile over
//   emulated intrinsics (src/cpu/quant/emu512.rs) on CPUs without AVX-512.
// - With the `cuda` feature, the fast tier's kernels (src/fast/cuda/kernels.cu) are compiled to PTX
//   for sm_90 by nvcc (`$NVCC`, which scripts/cuda-env.sh points at the caching wrapper, or `nvcc`)
//   and embedded by src/fast/cuda/mod.rs.
use std::path::PathBuf;
use std::process::Command;

/// Writes `$OUT_DIR/avx512_emulable.rs`: `avx512.rs` as items that can be `include!`d into a module
/// importing the emulated intrinsics. Only whole lines are dropped (module docs and inner
/// attributes, which `include!` rejects; the `std::arch` import; `#[target_feature]` attributes,
/// which would let the compiler emit AVX-512 instructions in the emulated copy), and `super::`
/// paths are made absolute.
fn emulable_avx512(out: &std::path::Path) {
    const SRC: &str = "src/cpu/quant/avx512.rs";
    println!("cargo:rerun-if-changed={SRC}");
    let src = std::fs::read_to_string(SRC).unwrap_or_else(|e| panic!("cannot read {SRC}: {e}"));
    let mut copy = String::with_capacity(src.len());
    for line in src.lines() {
        let t = line.trim_start();
        let dropped = t.starts_with("//!")
            || t.starts_with("#![")
            || t.starts_with("#[target_feature(")
            || t == "use std::arch::x86_64::*;";
        if !dropped {
            copy.push_str(&line.replace("super::", "crate::cpu::quant::"));
            copy.push('\n');
        }
    }
    if copy.contains("target_feature") || copy.contains("std::arch") {
        panic!(
            "{SRC}: a `target_feature` attribute or `std::arch` path is not on a line of its own; \
             the emulated copy for the kernel tests needs them alone on their lines"
        );
    }
    let dest = out.join("avx512_emulable.rs");
    std::fs::write(&dest, copy).unwrap_or_else(|e| panic!("cannot write {}: {e}", dest.display()));
}

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into()));
    emulable_avx512(&out);
    println!("cargo:rerun-if-changed=src/fast/cuda/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let ptx = out.join("fast_kernels.ptx");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let status = Command::new(&nvcc)
        .args([
            "-arch=sm_90",
            "--ptx",
            "-O3",
            "--Werror",
            "all-warnings",
            "-o",
        ])
        .arg(&ptx)
        .arg("src/fast/cuda/kernels.cu")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed on src/fast/cuda/kernels.cu ({s}); see its output above"),
        Err(e) => panic!(
            "cannot run {nvcc} ({e}): the `cuda` feature needs the CUDA 13.0 compiler; \
             run `make cuda-toolkit` and `eval \"$(scripts/cuda-env.sh)\"`"
        ),
    }
}
