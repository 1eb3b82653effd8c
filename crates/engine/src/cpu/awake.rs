//! Keeps the compute pool's other workers awake for the length of one forward pass.
//!
//! Why: a forward pass is hundreds of short parallel regions (decode of the 3B shape: about 180
//! a token, each a few hundred microseconds) separated by serial steps on the thread that runs the
//! pass (norms, RoPE, sampling's inputs). Between two regions an idle rayon worker spins for a
//! few microseconds and then sleeps on a futex; the next region must wake it, and on a virtual
//! machine a sleeping vCPU takes tens of microseconds to come back (an inter-processor interrupt
//! through the hypervisor). Measured on an AMD EPYC Zen 4 VM (2 vCPUs), 3B-shape decode: 11% of
//! both CPUs idle and ~4,400 context switches a second, 375 per token. llama.cpp's OpenMP
//! threads spin in their barriers for the same reason.
//!
//! How: [`run_awake`] spawns one helper job per other worker into a `rayon::scope`. A helper
//! loops on `rayon::yield_now`, which runs any job pending in the pool (the halves of the pass's
//! parallel regions), and spins when there is none, until the pass ends.
//!
//! Why a helper also stops after [`IDLE_LIMIT`] without work: a helper is a job, and rayon may
//! start it on a thread that is waiting in a `join` inside another job (of this pass, or of
//! another pass on the same pool: tests, replicas). That job cannot resume until the helper
//! returns; if the helper waited for the end of its pass, two such waits could wait on each
//! other for ever. With the limit every helper returns once the pool has had nothing to run for
//! a moment, so the worst case is a short delay, never a deadlock. A helper also returns at once
//! on the thread running its pass, and on a thread already inside a helper.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Idle polls between two yields of the OS thread: a helper gives its CPU to other runnable
/// threads (the server's, say) now and then, and otherwise never sleeps.
const POLLS_PER_OS_YIELD: u32 = 256;

/// How long a helper polls an empty pool before it gives up its thread (to rayon's own spin and
/// sleep). Far longer than the serial steps between a decode pass's regions (tens of µs), far
/// shorter than anything a user would notice.
const IDLE_LIMIT: Duration = Duration::from_millis(2);

thread_local! {
    /// Whether this thread is running a helper (possibly further down its stack).
    static IN_HELPER: Cell<bool> = const { Cell::new(false) };
}

/// Sets the flag when dropped, so the helpers stop even when the pass panics.
struct Finish<'a>(&'a AtomicBool);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs `pass` on a worker of the current rayon pool while the pool's other workers spin, ready
/// for its parallel regions, instead of sleeping between them. With one thread it is a plain
/// call on a pool worker.
pub fn run_awake<R: Send>(pass: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    rayon::scope(|s| {
        let runner = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            let done = &done;
            s.spawn(move |_| keep_awake(done, runner));
        }
        let _finish = Finish(&done);
        pass()
    })
}

/// One helper: runs the pool's pending jobs until `done`, or until the pool has had nothing to
/// run for [`IDLE_LIMIT`]; returns at once on the runner's thread or inside another helper.
fn keep_awake(done: &AtomicBool, runner: Option<usize>) {
    if rayon::current_thread_index() == runner || IN_HELPER.get() {
        return;
    }
    IN_HELPER.set(true);
    let _reset = ResetOnDrop;
    let mut idle = 0u32;
    let mut idle_since = Instant::now();
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle = 0,
            // Nothing pending (or, impossibly here, not on a pool thread).
            _ => {
                if idle == 0 {
                    idle_since = Instant::now();
                }
                idle += 1;
                if idle.is_multiple_of(POLLS_PER_OS_YIELD) {
                    if idle_since.elapsed() >= IDLE_LIMIT {
                        break;
                    }
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// Clears [`IN_HELPER`] when a helper ends.
struct ResetOnDrop;

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        IN_HELPER.set(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicUsize;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Many passes of many small parallel regions, nested joins included, on pools of 1 to 4
    /// threads: every pass returns its own result, and the helpers run the regions' jobs (the
    /// work lands on more than one thread). Passes go on (up to 10 s) until a second thread has
    /// worked: on a loaded machine (the whole suite on 2 vCPUs) a sleeping worker may not get a
    /// CPU before a pass of microseconds is over, for many passes in a row.
    #[test]
    fn passes_finish_with_their_results_and_helpers_run_the_regions() {
        for threads in 1..=4 {
            let pool = pool(threads);
            let seen = (0..threads)
                .map(|_| AtomicUsize::new(0))
                .collect::<Vec<_>>();
            let busy = || {
                seen.iter()
                    .filter(|c| c.load(Ordering::Relaxed) > 0)
                    .count()
            };
            let start = std::time::Instant::now();
            for pass in 0u64.. {
                if pass >= 50
                    && (threads == 1
                        || busy() > 1
                        || start.elapsed() > std::time::Duration::from_secs(10))
                {
                    break;
                }
                let sum = pool.install(|| {
                    run_awake(|| {
                        let mut total = 0u64;
                        for region in 0..20u64 {
                            total += (0..64usize)
                                .into_par_iter()
                                .with_max_len(1)
                                .map(|i| {
                                    let i = i as u64;
                                    if let Some(t) = rayon::current_thread_index() {
                                        seen[t].fetch_add(1, Ordering::Relaxed);
                                    }
                                    let (a, b) = rayon::join(|| i * region, || pass);
                                    a + b
                                })
                                .sum::<u64>();
                        }
                        total
                    })
                });
                let want: u64 = (0..20u64)
                    .map(|r| (0..64u64).map(|i| i * r + pass).sum::<u64>())
                    .sum();
                assert_eq!(sum, want, "{threads} threads, pass {pass}");
            }
            let busy = busy();
            assert_eq!(busy > 1, threads > 1, "{threads} threads: {busy} did work");
        }
    }

    /// Passes from several OS threads at once on one pool (as cargo's test threads, or replicas,
    /// run them), each with nested joins, so that helpers of one pass can land inside the waits
    /// of another: every pass finishes, within a generous bound (a deadlock fails the test
    /// instead of hanging it). A liveness guard: with the idle limit and the nesting check taken
    /// out it still passed here (the interleaving that would deadlock is rare), so the module
    /// doc's argument, not this test, is what shows the guards are needed.
    #[test]
    fn concurrent_passes_on_one_pool_finish() {
        for threads in [2, 3] {
            let pool = std::sync::Arc::new(pool(threads));
            let (tx, rx) = std::sync::mpsc::channel();
            for caller in 0..3u64 {
                let (pool, tx) = (pool.clone(), tx.clone());
                std::thread::spawn(move || {
                    for pass in 0..40u64 {
                        let got = pool.install(|| {
                            run_awake(|| {
                                (0..32usize)
                                    .into_par_iter()
                                    .with_max_len(1)
                                    .map(|i| {
                                        let (a, b) = rayon::join(
                                            || (0..64u64).into_par_iter().sum::<u64>(),
                                            || i as u64 + caller + pass,
                                        );
                                        a + b
                                    })
                                    .sum::<u64>()
                            })
                        });
                        let want = 32 * 2016 + (0..32u64).sum::<u64>() + 32 * (caller + pass);
                        assert_eq!(got, want);
                    }
                    let _ = tx.send(caller);
                });
            }
            drop(tx);
            for _ in 0..3 {
                let finished = rx.recv_timeout(std::time::Duration::from_secs(120));
                assert!(
                    finished.is_ok(),
                    "{threads} threads: a caller did not finish"
                );
            }
        }
    }

    /// Called from outside any pool (the pass is injected into the global pool), and with a pass
    /// that panics: the panic reaches the caller, and the helpers stop (the pool is usable after).
    #[test]
    fn a_panicking_pass_stops_the_helpers() {
        let pool = pool(3);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| run_awake(|| panic!("the pass failed")))
        }));
        assert!(caught.is_err());
        let after = pool.install(|| run_awake(|| (0..1000u32).into_par_iter().sum::<u32>()));
        assert_eq!(after, 499_500);
        assert_eq!(run_awake(|| 7), 7);
    }
}
