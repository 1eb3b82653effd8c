//! Logs for unit tests: a subscriber that writes through the test harness's captured output
//! (shown for a failing test, or for every test with `--nocapture`), so what a test reports, such
//! as the kernels it skipped or a benchmark's figures, goes through `tracing` like everything else.

/// Installs the subscriber once per test binary; later calls, and a subscriber already set, are
/// left alone.
pub(crate) fn init() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_ansi(false)
        .with_target(false)
        .without_time()
        .try_init();
}
