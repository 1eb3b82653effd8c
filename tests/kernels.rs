//! The static checks of the fast tier's CUDA kernels (`scripts/check-kernels.py`: nvcc for
//! sm_90 with warnings as errors, ptxas's resource report) pass on the kernels as they are, and
//! fail on a copy whose attention kernel spills, on one with a warning, and on one whose
//! tensor-core kernel has no tensor-core instruction left. They need the CUDA
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
fn a_spilling_kernel_and_a_warning_fail_the_check() {
    if !nvcc_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // Without its launch bounds' minimum blocks, ptxas keeps the 8-head attention kernel under
    // fewer registers and spills.
    let spilling = dir.path().join("spilling.cu");
    let source = kernels();
    assert!(source.contains("__launch_bounds__(128, 4)"));
    std::fs::write(
        &spilling,
        source.replace("__launch_bounds__(128, 4)", "__launch_bounds__(128)"),
    )
    .expect("write");
    let (ok, text) = check(&spilling);
    assert!(!ok, "{text}");
    assert!(text.contains("attention_partial_g8: spills"), "{text}");
    let warned = dir.path().join("warned.cu");
    std::fs::write(
        &warned,
        format!("{source}\nextern \"C\" __global__ void unused_variable(float *x) {{ int never_read = 3; }}\n"),
    )
    .expect("write");
    let (ok, text) = check(&warned);
    assert!(!ok, "{text}");
    assert!(text.contains("nvcc failed (warnings are errors)"), "{text}");
}

#[test]
fn a_tensor_core_kernel_without_tensor_core_instructions_fails_the_check() {
    if !nvcc_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let source = kernels();
    let mma = "asm volatile(\n        \"mma.sync.aligned.m16n8k16";
    assert!(
        source.contains(mma),
        "the flash kernel's mma is where this test expects it"
    );
    // The products compiled away: the kernel still builds, without HMMA.
    let scalar = dir.path().join("scalar.cu");
    std::fs::write(&scalar, source.replace(mma, &format!("if (false) {mma}"))).expect("write");
    let (ok, text) = check(&scalar);
    assert!(!ok, "{text}");
    assert!(
        text.contains("flash_prefill_d128: no tensor-core (HMMA) instruction"),
        "{text}"
    );
}

#[test]
fn a_kernel_without_the_grid_dependency_wait_fails_the_check() {
    if !nvcc_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let source = kernels();
    let head = "void add_f32(float *__restrict__ x, const float *__restrict__ y, int n) {\n    GRID_DEPENDENCY();\n";
    assert!(
        source.contains(head),
        "add_f32 starts with GRID_DEPENDENCY() where this test expects it"
    );
    // Launched with programmatic dependence, it could read `y` before the kernel writing it
    // has finished.
    let racing = dir.path().join("racing.cu");
    std::fs::write(
        &racing,
        source.replace(
            head,
            "void add_f32(float *__restrict__ x, const float *__restrict__ y, int n) {\n",
        ),
    )
    .expect("write");
    let (ok, text) = check(&racing);
    assert!(!ok, "{text}");
    assert!(
        text.contains("add_f32: no griddepcontrol.wait in its PTX"),
        "{text}"
    );
}
