//! The static checks of the fast tier's CUDA kernels (`scripts/check-kernels.py`: nvcc for
//! sm_90 with warnings as errors, ptxas's resource report) pass on the kernels as they are, and
//! fail on a copy with a warning, and on one whose attention kernel spills, whose tensor-core
//! kernel has no tensor-core instruction left and whose `add_f32` lacks the grid-dependency
//! wait (one copy with the three faults: one compile, each named). They need the CUDA
//! 13.0 compiler `make cuda-toolkit` installs (no GPU): without it these tests say so and pass,
//! unless `SMOLTEST_REQUIRE_NVCC=1` (as `make test` sets) makes that a failure.

mod common;

use std::path::Path;
use std::process::Command;

fn nvcc_available() -> bool {
    let found = run_in_cuda_env("nvcc --version").0;
    if !found {
        assert!(
            std::env::var("SMOLTEST_REQUIRE_NVCC").is_err(),
            "nvcc is missing, and SMOLTEST_REQUIRE_NVCC=1 says the kernels must be checked here: \
             run `make cuda-toolkit`"
        );
        eprintln!("skipped: no nvcc (run `make cuda-toolkit` for the CUDA 13.0 compiler)");
    }
    found
}

/// Runs `command` under the environment of `scripts/cuda-env.sh`.
fn run_in_cuda_env(command: &str) -> (bool, String) {
    let root = common::crate_root();
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("eval \"$(scripts/cuda-env.sh)\" && {command}"))
        .current_dir(&root)
        .output()
        .expect("bash runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn check(source: &Path) -> (bool, String) {
    run_in_cuda_env(&format!(
        "python3 scripts/check-kernels.py --source {}",
        source.display()
    ))
}

fn kernels() -> String {
    std::fs::read_to_string(common::crate_root().join("crates/engine/src/fast/cuda/kernels.cu"))
        .expect("kernels.cu")
}

#[test]
fn the_kernels_compile_clean_without_spills() {
    if !nvcc_available() {
        return;
    }
    let (ok, text) = check(&common::crate_root().join("crates/engine/src/fast/cuda/kernels.cu"));
    assert!(ok, "{text}");
    assert!(text.contains("no spills"), "{text}");
}

#[test]
fn a_warning_fails_the_check() {
    if !nvcc_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let warned = dir.path().join("warned.cu");
    std::fs::write(
        &warned,
        format!(
            "{}\nextern \"C\" __global__ void unused_variable(float *x) {{ int never_read = 3; }}\n",
            kernels()
        ),
    )
    .expect("write");
    let (ok, text) = check(&warned);
    assert!(!ok, "{text}");
    assert!(text.contains("nvcc failed (warnings are errors)"), "{text}");
}

/// One copy of the kernels with three faults, each of which the check names:
/// - without its launch bounds' minimum blocks, ptxas keeps the 8-head attention kernel under
///   fewer registers and it spills;
/// - the flash kernel's products compiled away: it still builds, without HMMA;
/// - `add_f32` without `GRID_DEPENDENCY()`: launched with programmatic dependence, it could read
///   `y` before the kernel writing it has finished.
#[test]
fn a_spilling_kernel_a_scalar_tensor_core_kernel_and_a_missing_wait_fail_the_check() {
    if !nvcc_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut source = kernels();
    assert!(source.contains("__launch_bounds__(128, 4)"));
    source = source.replace("__launch_bounds__(128, 4)", "__launch_bounds__(128)");
    let mma = "asm volatile(\n        \"mma.sync.aligned.m16n8k16";
    assert!(
        source.contains(mma),
        "the flash kernel's mma is where this test expects it"
    );
    source = source.replace(mma, &format!("if (false) {mma}"));
    let head = "void add_f32(float *__restrict__ x, const float *__restrict__ y, int n) {\n    GRID_DEPENDENCY();\n";
    assert!(
        source.contains(head),
        "add_f32 starts with GRID_DEPENDENCY() where this test expects it"
    );
    source = source.replace(
        head,
        "void add_f32(float *__restrict__ x, const float *__restrict__ y, int n) {\n",
    );
    let broken = dir.path().join("broken.cu");
    std::fs::write(&broken, source).expect("write");
    let (ok, text) = check(&broken);
    assert!(!ok, "{text}");
    for problem in [
        "attention_partial_g8: spills",
        "flash_prefill_d128: no tensor-core (HMMA) instruction",
        "add_f32: no griddepcontrol.wait in its PTX",
    ] {
        assert!(text.contains(problem), "{problem}: {text}");
    }
}
