// With the `cuda` feature, the fast tier's kernels (src/fast/cuda/kernels.cu) are compiled to PTX
// for sm_90 by nvcc (`$NVCC`, which scripts/cuda-env.sh points at the caching wrapper, or `nvcc`)
// and embedded by src/fast/cuda/mod.rs. Without the feature this does nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/fast/cuda/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into()));
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
