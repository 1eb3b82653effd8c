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
//! parallel regions), and spins when there is none, until the pass ends. A helper that lands on
//! the thread running the pass itself (that thread runs queued jobs while it waits in a `join`)
//! returns at once: spinning there would wait on the pass it interrupts.

use std::sync::atomic::{AtomicBool, Ordering};

/// Idle polls between two yields of the OS thread: a helper gives its CPU to other runnable
/// threads (the server's, say) now and then, and otherwise never sleeps.
const POLLS_PER_OS_YIELD: u32 = 256;

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
    let mut result = None;
    rayon::scope(|s| {
        let runner = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            let done = &done;
            s.spawn(move |_| keep_awake(done, runner));
        }
        let _finish = Finish(&done);
        result = Some(pass());
    });
    match result {
        Some(r) => r,
        // `rayon::scope` runs its closure to the end or propagates its panic.
        None => unreachable!("rayon::scope returned without running the pass"),
    }
}

/// One helper: runs the pool's pending jobs until `done`, unless it is on the runner's thread.
fn keep_awake(done: &AtomicBool, runner: Option<usize>) {
    if rayon::current_thread_index() == runner {
        return;
    }
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle = 0,
            // Nothing pending (or, impossibly here, not on a pool thread).
            _ => {
                idle += 1;
                if idle.is_multiple_of(POLLS_PER_OS_YIELD) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
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
    /// work lands on more than one thread).
    #[test]
    fn passes_finish_with_their_results_and_helpers_run_the_regions() {
        for threads in 1..=4 {
            let pool = pool(threads);
            let seen = (0..threads)
                .map(|_| AtomicUsize::new(0))
                .collect::<Vec<_>>();
            for pass in 0..50u64 {
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
            let busy = seen
                .iter()
                .filter(|c| c.load(Ordering::Relaxed) > 0)
                .count();
            assert_eq!(busy > 1, threads > 1, "{threads} threads: {busy} did work");
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
