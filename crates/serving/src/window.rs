//! [`SlidingWindow`]: weighted events per key over the last stretch of time, the one counter
//! behind every "so many a minute" limit kept in memory (tokens generated per user a minute,
//! conversations created and searches run per owner a minute, bytes imported per address an
//! hour). Time is passed in, so tests drive it.

use std::borrow::Borrow;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Events per key in the last `window`, each with a weight (1 for a creation, its size for
/// bytes, its count for tokens). Events closer together than `bucket` share one entry, so a key
/// costs at most `window / bucket` entries however fast it goes (a zero `bucket` keeps every
/// event). At most `max_keys` keys are remembered: past that, keys with nothing in the window are
/// forgotten first, then the one idle longest, so memory stays bounded against a flood of
/// made-up keys.
#[derive(Debug)]
pub struct SlidingWindow<K> {
    window: Duration,
    bucket: Duration,
    max_keys: usize,
    keys: HashMap<K, VecDeque<(Instant, u64)>>,
}

impl<K: Hash + Eq + Clone> SlidingWindow<K> {
    pub fn new(window: Duration, bucket: Duration, max_keys: usize) -> Self {
        Self {
            window,
            bucket,
            max_keys: max_keys.max(1),
            keys: HashMap::new(),
        }
    }

    fn live(&self, t: Instant, now: Instant) -> bool {
        now.saturating_duration_since(t) < self.window
    }

    /// The weight `key` has in the window ending at `now`.
    pub fn used<Q>(&self, key: &Q, now: Instant) -> u64
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.keys.get(key).map_or(0, |events| {
            events
                .iter()
                .filter(|(t, _)| self.live(*t, now))
                .map(|(_, n)| n)
                .sum()
        })
    }

    /// Whole seconds (at least 1) until `key` has room for `n` more under `limit`: until its
    /// weight in the window is at most `limit - n`. A whole window when `n` alone is over the
    /// limit.
    pub fn retry_after_s<Q>(&self, key: &Q, n: u64, limit: u64, now: Instant) -> u64
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some(events) = self.keys.get(key) else {
            return if n > limit { self.window.as_secs() } else { 1 };
        };
        let mut used = self.used(key, now);
        if used.saturating_add(n) <= limit {
            return 1;
        }
        for (t, weight) in events.iter().filter(|(t, _)| self.live(*t, now)) {
            used = used.saturating_sub(*weight);
            if used.saturating_add(n) <= limit {
                let free_at = *t + self.window;
                return free_at
                    .saturating_duration_since(now)
                    .as_secs_f64()
                    .ceil()
                    .max(1.0) as u64;
            }
        }
        self.window.as_secs().max(1)
    }

    /// Adds `n` for `key` at `now`.
    pub fn add<Q>(&mut self, key: &Q, n: u64, now: Instant)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if n == 0 {
            return;
        }
        // Called for every generated token: look the key up before making an owned copy.
        if !self.keys.contains_key(key) {
            self.make_room(now);
            self.keys.insert(key.to_owned(), VecDeque::new());
        }
        let (window, bucket) = (self.window, self.bucket);
        let Some(events) = self.keys.get_mut(key) else {
            return;
        };
        match events.back_mut() {
            Some((start, weight)) if now.saturating_duration_since(*start) < bucket => *weight += n,
            _ => events.push_back((now, n)),
        }
        while events
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= window)
        {
            events.pop_front();
        }
    }

    /// Takes `n` for every key of `keys` at `now` when each stays within `limit`; else refuses
    /// with the seconds until the fullest has room ([`Self::retry_after_s`]), taking nothing.
    pub fn take(&mut self, keys: &[K], n: u64, limit: u64, now: Instant) -> Result<(), u64> {
        let wait = keys
            .iter()
            .filter(|k| self.used(*k, now).saturating_add(n) > limit)
            .map(|k| self.retry_after_s(k, n, limit, now))
            .max();
        if let Some(wait) = wait {
            return Err(wait);
        }
        for key in keys {
            self.add(key, n, now);
        }
        Ok(())
    }

    /// Room for one more key: keys with nothing in the window go first, then the one idle
    /// longest.
    fn make_room(&mut self, now: Instant) {
        if self.keys.len() < self.max_keys {
            return;
        }
        let window = self.window;
        self.keys.retain(|_, events| {
            events
                .back()
                .is_some_and(|(t, _)| now.saturating_duration_since(*t) < window)
        });
        if self.keys.len() >= self.max_keys {
            let idlest = self
                .keys
                .iter()
                .min_by_key(|(_, events)| events.back().map(|(t, _)| *t))
                .map(|(k, _)| k.clone());
            if let Some(k) = idlest {
                self.keys.remove(&k);
            }
        }
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn weight_leaves_the_window_and_retry_says_when_there_is_room() {
        let mut w = SlidingWindow::<String>::new(MINUTE, Duration::from_secs(1), 100);
        let t0 = Instant::now();
        w.add("a", 5, t0);
        w.add("a", 5, t0 + Duration::from_secs(30));
        assert_eq!(w.used("a", t0 + Duration::from_secs(31)), 10);
        // Room for one more under 6 once the first entry leaves, 29 s after t0 + 31 s.
        assert_eq!(w.retry_after_s("a", 1, 6, t0 + Duration::from_secs(31)), 29);
        assert_eq!(w.used("a", t0 + Duration::from_secs(61)), 5);
        assert_eq!(w.used("a", t0 + Duration::from_secs(91)), 0);
        assert_eq!(w.used("nobody", t0), 0);
        // More than the limit alone: a whole window.
        assert_eq!(w.retry_after_s("a", 7, 6, t0 + Duration::from_secs(31)), 60);
    }

    #[test]
    fn events_within_a_bucket_share_an_entry() {
        let mut w = SlidingWindow::<String>::new(MINUTE, Duration::from_secs(1), 100);
        let t0 = Instant::now();
        for i in 0..1000 {
            w.add("a", 1, t0 + Duration::from_millis(i));
        }
        assert_eq!(w.used("a", t0 + Duration::from_secs(1)), 1000);
        assert_eq!(w.keys["a"].len(), 1);
    }

    #[test]
    fn take_counts_every_key_and_a_refusal_takes_nothing() {
        let mut w = SlidingWindow::<String>::new(MINUTE, Duration::ZERO, 100);
        let t0 = Instant::now();
        let a = ["owner:a".to_string(), "addr:1.2.3.4".to_string()];
        let b = ["owner:b".to_string(), "addr:1.2.3.4".to_string()];
        assert!(w.take(&a, 1, 2, t0).is_ok());
        // Another owner from the same address shares the address's count.
        assert!(w.take(&b, 1, 2, t0 + Duration::from_secs(10)).is_ok());
        assert_eq!(w.take(&a, 1, 2, t0 + Duration::from_secs(20)), Err(40));
        assert_eq!(w.used("owner:a", t0 + Duration::from_secs(20)), 1);
        assert!(w.take(&a, 1, 2, t0 + Duration::from_secs(61)).is_ok());
        // Weights: 60 of 100 bytes, then 50 more only once the first 60 have left.
        let mut bytes = SlidingWindow::<String>::new(MINUTE, Duration::ZERO, 100);
        let k = ["addr:x".to_string()];
        assert!(bytes.take(&k, 60, 100, t0).is_ok());
        assert_eq!(
            bytes.take(&k, 50, 100, t0 + Duration::from_secs(15)),
            Err(45)
        );
        assert!(bytes
            .take(&k, 50, 100, t0 + Duration::from_secs(60))
            .is_ok());
    }

    #[test]
    fn keys_are_bounded_forgetting_the_idle_first() {
        let mut w = SlidingWindow::<String>::new(MINUTE, Duration::ZERO, 3);
        let t0 = Instant::now();
        w.add("old", 1, t0);
        w.add("b", 1, t0 + Duration::from_secs(50));
        w.add("c", 1, t0 + Duration::from_secs(55));
        // "old" has left the window: it goes first.
        w.add("d", 1, t0 + Duration::from_secs(70));
        assert_eq!(w.len(), 3);
        assert_eq!(w.used("old", t0), 0);
        // All live: the one idle longest ("b") goes.
        w.add("e", 1, t0 + Duration::from_secs(71));
        assert_eq!(w.len(), 3);
        assert_eq!(w.used("b", t0 + Duration::from_secs(71)), 0);
        assert_eq!(w.used("c", t0 + Duration::from_secs(71)), 1);
    }
}
