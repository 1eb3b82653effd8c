//! Login throttling: a failure counter with exponential lockout per client address and per
//! subject (an account, or `admin` for the admin token), in memory.
//!
//! Each key may fail `free` times (per address and per subject separately); the failure that
//! reaches that number locks the key for `base_lockout`, and every further failure doubles it,
//! up to `max_lockout`. While any key of an attempt is locked the attempt is refused **without
//! checking the credential**, so a right guess during a lockout is refused like a wrong one and
//! the lockout really limits guesses. A successful sign-in clears the subject's failures and
//! takes back its own count from the address, but leaves the address's other failures: an
//! attacker who signs in to an account of their own now and then must not wipe the count of the
//! passwords they sprayed at others from the same address. Counters of keys that stop failing
//! are forgotten after [`FORGET_AFTER`].
//!
//! An attempt is counted as a failure when it starts ([`LoginThrottle::attempt`]) and taken back
//! on success ([`LoginThrottle::success`]): counting after the check would let a burst of
//! parallel guesses all pass the lock check before the first failure was recorded.
//!
//! A subject locked by failures from many addresses would lock its real owner out too. So an
//! address that has signed in to that subject before ([`KNOWN_ADDRESSES`] per subject are
//! remembered) and has no failures of its own is let through the subject's lock: the owner
//! at their usual place keeps working while the guessing from elsewhere stays locked.
//!
//! The table is bounded ([`ThrottlePolicy::max_entries`]): a flood of addresses evicts forgotten
//! entries first, then the unlocked entry that failed least recently, and only then the locked
//! entry whose lockout ends soonest, so the flood cannot grow memory and does not free a locked
//! address. The subject's entry fails on every attempt of the flood, so it is never the one
//! evicted. IPv6 addresses count per /64 (what one host or home gets).
//!
//! The per-subject lock is what stops guessing from many addresses; its price is that such a
//! flood also locks the real owner of the subject out until it ends, which is why subjects get
//! more free failures than addresses. Times come from the caller (`now`), so tests drive a clock
//! of their own.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// How long a key that stopped failing keeps its count. Long, so waiting out a lockout does not
/// buy a fresh set of free guesses; memory stays bounded by `max_entries` regardless.
pub const FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);
/// The longest lockout whatever the policy says, so `now + lockout` cannot overflow.
pub const LOCKOUT_CAP: Duration = Duration::from_secs(7 * 24 * 3600);
/// Addresses remembered per subject as having signed in to it (see the module documentation).
pub const KNOWN_ADDRESSES: usize = 4;

/// The scope one client address is counted by, everywhere something is limited per address
/// (sign-in throttles, guest and import limits, stream caps, anonymous `/v1` identities): an
/// IPv4-mapped IPv6 address is its IPv4 address; another IPv6 address is its /64 (the prefix,
/// the rest zero), since one host usually holds a whole /64 and could otherwise take a new
/// address per request.
pub fn address_scope(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut s = v6.segments();
                s[4..].fill(0);
                IpAddr::V6(s.into())
            }
        },
        v4 => v4,
    }
}

/// What an attempt is counted against.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ThrottleKey {
    /// A client address; build with [`ThrottleKey::address`].
    Address(IpAddr),
    /// An account name, or `admin` for the admin token, as a digest of fixed size: the name
    /// comes from the client, and a flood of long made-up names must not grow the table's
    /// memory beyond its entry count.
    Subject([u8; 16]),
}

impl ThrottleKey {
    /// The key of a client address: IPv4 (IPv4-mapped IPv6 included) as is, other IPv6
    /// addresses by their /64 prefix, since one host usually has a whole /64 to pick from.
    pub fn address(ip: IpAddr) -> ThrottleKey {
        ThrottleKey::Address(address_scope(ip))
    }

    /// The key of a subject: the first 16 bytes of the name's SHA-256.
    /// The name its failures are counted under in the store (shared by the replicas).
    pub fn counter_name(&self) -> String {
        match self {
            ThrottleKey::Address(ip) => format!("login:address:{ip}"),
            ThrottleKey::Subject(digest) => format!("login:subject:{}", crate::secret::hex(digest)),
        }
    }

    pub fn subject(name: impl AsRef<str>) -> ThrottleKey {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(name.as_ref().as_bytes());
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        ThrottleKey::Subject(key)
    }
}

/// The limits; see the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThrottlePolicy {
    /// Failures an address may have before it is locked.
    pub free_per_address: u32,
    /// Failures a subject may have, from all addresses together, before it is locked.
    pub free_per_subject: u32,
    /// The first lockout; each further failure doubles it.
    pub base_lockout: Duration,
    /// The longest lockout.
    pub max_lockout: Duration,
    /// Keys remembered at most.
    pub max_entries: usize,
}

impl Default for ThrottlePolicy {
    fn default() -> Self {
        ThrottlePolicy {
            free_per_address: 5,
            free_per_subject: 20,
            base_lockout: Duration::from_secs(1),
            max_lockout: Duration::from_secs(15 * 60),
            max_entries: 10_000,
        }
    }
}

/// Which kind of key refused an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockedBy {
    Address,
    Subject,
}

impl LockedBy {
    /// For messages: "from this address", "for this account".
    pub fn describe(self) -> &'static str {
        match self {
            LockedBy::Address => "from this address",
            LockedBy::Subject => "for this account",
        }
    }
}

/// A refused attempt: which lock, and how long until it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lockout {
    pub by: LockedBy,
    pub retry_after: Duration,
}

impl Lockout {
    /// Whole seconds to wait (rounded up, at least 1), for `Retry-After`.
    pub fn retry_after_s(&self) -> u64 {
        let d = self.retry_after;
        (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1)
    }
}

#[derive(Clone, Debug)]
struct Entry {
    failures: u32,
    locked_until: Option<Instant>,
    last_failure: Instant,
}

impl Entry {
    fn locked_at(&self, now: Instant) -> Option<Duration> {
        self.locked_until
            .filter(|until| *until > now)
            .map(|until| until - now)
    }

    fn forgotten_at(&self, now: Instant) -> bool {
        self.locked_at(now).is_none()
            && now.saturating_duration_since(self.last_failure) >= FORGET_AFTER
    }
}

/// The throttle's state. Not synchronised: the owner wraps it in a mutex.
#[derive(Debug)]
pub struct LoginThrottle {
    policy: ThrottlePolicy,
    entries: HashMap<ThrottleKey, Entry>,
    /// Per subject, the addresses that signed in to it last (at most [`KNOWN_ADDRESSES`]
    /// each, at most `max_entries` subjects), with when.
    known: HashMap<ThrottleKey, Vec<(ThrottleKey, Instant)>>,
}

impl LoginThrottle {
    pub fn new(policy: ThrottlePolicy) -> LoginThrottle {
        LoginThrottle {
            policy,
            entries: HashMap::new(),
            known: HashMap::new(),
        }
    }

    pub fn policy(&self) -> &ThrottlePolicy {
        &self.policy
    }

    /// Keys remembered now (at most `max_entries`).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The lockout of `keys` at `now`, if any (the longest one); changes nothing.
    pub fn locked(&self, keys: &[ThrottleKey], now: Instant) -> Option<Lockout> {
        keys.iter()
            .filter_map(|k| {
                let wait = self.entries.get(k)?.locked_at(now)?;
                Some(Lockout {
                    by: by_of(k),
                    retry_after: wait,
                })
            })
            .max_by_key(|l| l.retry_after)
    }

    /// Starts a sign-in attempt against `keys` at `now`: refused while any key is locked (the
    /// caller must then not check the credential); otherwise counted as a failure of every key
    /// (locking those that reach their limit for the attempts after this one) until
    /// [`LoginThrottle::success`] takes it back.
    pub fn attempt(&mut self, keys: &[ThrottleKey], now: Instant) -> Result<(), Lockout> {
        if let Some(lockout) = self.locked(keys, now) {
            if !(lockout.by == LockedBy::Subject && self.known_and_clean(keys, now)) {
                return Err(lockout);
            }
        }
        for key in keys {
            let free = match key {
                ThrottleKey::Address(_) => self.policy.free_per_address,
                ThrottleKey::Subject(_) => self.policy.free_per_subject,
            };
            let (base, max) = (self.policy.base_lockout, self.policy.max_lockout);
            if !self.entries.contains_key(key) {
                self.make_room(now);
            }
            let entry = self.entries.entry(key.clone()).or_insert(Entry {
                failures: 0,
                locked_until: None,
                last_failure: now,
            });
            if entry.forgotten_at(now) {
                entry.failures = 0;
            }
            entry.failures = entry.failures.saturating_add(1);
            entry.last_failure = now;
            if entry.failures >= free.max(1) {
                let doublings = (entry.failures - free.max(1)).min(30);
                let max = max.min(LOCKOUT_CAP);
                let lockout = base.checked_mul(1u32 << doublings).unwrap_or(max).min(max);
                entry.locked_until = Some(now.checked_add(lockout).unwrap_or(now));
            }
        }
        Ok(())
    }

    /// Whether `keys` hold an address with no failures (and no lock) that has signed in to
    /// one of the subjects among them before.
    fn known_and_clean(&self, keys: &[ThrottleKey], now: Instant) -> bool {
        let address = keys.iter().find(|k| matches!(k, ThrottleKey::Address(_)));
        let Some(address) = address else {
            return false;
        };
        if self
            .entries
            .get(address)
            .is_some_and(|e| e.locked_at(now).is_some() || (e.failures > 0 && !e.forgotten_at(now)))
        {
            return false;
        }
        keys.iter()
            .filter(|k| matches!(k, ThrottleKey::Subject(_)))
            .any(|subject| {
                self.known
                    .get(subject)
                    .is_some_and(|list| list.iter().any(|(a, _)| a == address))
            })
    }

    /// A sign-in against `keys` succeeded: the subjects' failures and lockouts are forgotten;
    /// each address gets back the one failure this attempt counted (its other failures stay)
    /// and is remembered as one that signs in to the subjects.
    pub fn success(&mut self, keys: &[ThrottleKey], now: Instant) {
        for key in keys {
            match key {
                ThrottleKey::Subject(_) => {
                    self.entries.remove(key);
                }
                ThrottleKey::Address(_) => {
                    if let Some(entry) = self.entries.get_mut(key) {
                        entry.failures = entry.failures.saturating_sub(1);
                        // This attempt passed the lock check, so a lock now is the one its own
                        // count set; with its earlier failures kept, the next failure locks.
                        entry.locked_until = None;
                        if entry.failures == 0 {
                            self.entries.remove(key);
                        }
                    }
                }
            }
        }
        let addresses: Vec<&ThrottleKey> = keys
            .iter()
            .filter(|k| matches!(k, ThrottleKey::Address(_)))
            .collect();
        for subject in keys.iter().filter(|k| matches!(k, ThrottleKey::Subject(_))) {
            if !self.known.contains_key(subject) && self.known.len() >= self.policy.max_entries {
                // Forget the subject whose last sign-in is oldest.
                let oldest = self
                    .known
                    .iter()
                    .min_by_key(|(_, list)| list.iter().map(|(_, t)| *t).max())
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.known.remove(&k);
                }
            }
            let list = self.known.entry(subject.clone()).or_default();
            for address in &addresses {
                list.retain(|(a, _)| a != *address);
                list.push(((*address).clone(), now));
            }
            if list.len() > KNOWN_ADDRESSES {
                let excess = list.len() - KNOWN_ADDRESSES;
                list.drain(..excess);
            }
        }
    }

    /// Frees one place when the table is full: a forgotten entry if there is one (all of them
    /// go), else the unlocked entry that failed least recently, else the locked entry whose
    /// lockout ends soonest.
    fn make_room(&mut self, now: Instant) {
        let max = self.policy.max_entries.max(1);
        if self.entries.len() < max {
            return;
        }
        self.entries.retain(|_, e| !e.forgotten_at(now));
        if self.entries.len() < max {
            return;
        }
        let victim = self
            .entries
            .iter()
            .min_by_key(|(_, e)| match e.locked_at(now) {
                None => (false, e.last_failure),
                Some(_) => (true, e.locked_until.unwrap_or(now)),
            })
            .map(|(k, _)| k.clone());
        if let Some(k) = victim {
            self.entries.remove(&k);
        }
    }
}

/// Failed bearer secrets (`/v1` keys, the `/metrics` token) per client address: a wrong one
/// counts as a failed sign-in of that address, and a locked address gets 429 for every bearer.
/// Only failures count (a right key takes nothing back: an attacker holding one key must not
/// reset the count of their guesses at others); no subject is locked, so guessing cannot lock
/// anyone else out.
#[derive(Debug)]
pub struct BearerThrottle {
    inner: std::sync::Mutex<LoginThrottle>,
}

impl BearerThrottle {
    pub fn new(policy: ThrottlePolicy) -> BearerThrottle {
        BearerThrottle {
            inner: std::sync::Mutex::new(LoginThrottle::new(ThrottlePolicy {
                free_per_subject: u32::MAX,
                ..policy
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LoginThrottle> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lockout of `address` now, if any.
    pub fn locked(&self, address: IpAddr) -> Option<Lockout> {
        self.lock()
            .locked(&[ThrottleKey::address(address)], Instant::now())
    }

    /// Counts a wrong bearer from `address`.
    pub fn failed(&self, address: IpAddr) {
        // Refused only when already locked, and then there is nothing more to count.
        let _ = self
            .lock()
            .attempt(&[ThrottleKey::address(address)], Instant::now());
    }
}

fn by_of(key: &ThrottleKey) -> LockedBy {
    match key {
        ThrottleKey::Address(_) => LockedBy::Address,
        ThrottleKey::Subject(_) => LockedBy::Subject,
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn policy() -> ThrottlePolicy {
        ThrottlePolicy {
            free_per_address: 3,
            free_per_subject: 5,
            base_lockout: Duration::from_secs(2),
            max_lockout: Duration::from_secs(16),
            max_entries: 100,
        }
    }

    fn ip(last: u8) -> ThrottleKey {
        ThrottleKey::address(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)))
    }

    fn keys(last: u8) -> [ThrottleKey; 2] {
        [ip(last), ThrottleKey::subject("admin")]
    }

    /// A clock the test moves by hand.
    struct Clock(Instant);
    impl Clock {
        fn now(&self) -> Instant {
            self.0
        }
        fn advance(&mut self, d: Duration) {
            self.0 += d;
        }
    }

    #[test]
    fn free_failures_then_doubling_lockouts_up_to_the_cap() {
        let mut t = LoginThrottle::new(ThrottlePolicy {
            free_per_subject: 1000,
            ..policy()
        });
        let mut clock = Clock(Instant::now());
        let k = keys(1);
        // Three attempts are checked; the third locks for the base lockout.
        for _ in 0..3 {
            assert_eq!(t.attempt(&k, clock.now()), Ok(()));
        }
        let locked = t.attempt(&k, clock.now()).unwrap_err();
        assert_eq!(locked.by, LockedBy::Address);
        assert_eq!(locked.retry_after, Duration::from_secs(2));
        assert_eq!(locked.retry_after_s(), 2);
        // Refusals do not count: still 2 s from the same instant, and after 1 s, 1 s left.
        assert_eq!(
            t.attempt(&k, clock.now()).unwrap_err().retry_after,
            Duration::from_secs(2)
        );
        clock.advance(Duration::from_secs(1));
        assert_eq!(t.attempt(&k, clock.now()).unwrap_err().retry_after_s(), 1);
        // Each failure after a lockout doubles it: 4, 8, then 16 (the cap), 16.
        let mut expected = Vec::new();
        let mut got = Vec::new();
        for want in [4, 8, 16, 16] {
            clock.advance(Duration::from_secs(20));
            assert_eq!(t.attempt(&k, clock.now()), Ok(()), "the lockout ended");
            got.push(
                t.attempt(&k, clock.now())
                    .unwrap_err()
                    .retry_after
                    .as_secs(),
            );
            expected.push(want);
        }
        assert_eq!(got, expected);
    }

    #[test]
    fn a_right_credential_during_a_lockout_is_still_refused_and_success_clears() {
        let mut t = LoginThrottle::new(policy());
        let mut clock = Clock(Instant::now());
        let k = keys(1);
        for _ in 0..3 {
            t.attempt(&k, clock.now()).unwrap();
        }
        // The caller never gets to check the (right) credential while locked.
        assert!(t.attempt(&k, clock.now()).is_err());
        clock.advance(Duration::from_millis(1999));
        assert!(t.attempt(&k, clock.now()).is_err());
        clock.advance(Duration::from_millis(1));
        // Lockout over: this attempt is checked, is right, and clears the subject; the
        // address keeps its three earlier failures, so its next wrong guess locks again.
        assert_eq!(t.attempt(&k, clock.now()), Ok(()));
        t.success(&k, clock.now());
        assert_eq!(t.len(), 1, "only the address's count is left");
        assert_eq!(t.attempt(&k, clock.now()), Ok(()));
        assert!(t.attempt(&k, clock.now()).is_err());
    }

    #[test]
    fn a_correct_sign_in_does_not_clear_the_address_count() {
        // The attacker has an account of their own ("mallory") and sprays passwords at
        // "alice" from one address, signing in to their own account after every fourth.
        let mut t = LoginThrottle::new(ThrottlePolicy {
            free_per_address: 5,
            free_per_subject: 1000,
            ..policy()
        });
        let now = Instant::now();
        let attacker = ip(9);
        let mut refused = 0;
        for n in 1..=16 {
            match t.attempt(&[attacker.clone(), ThrottleKey::subject("alice")], now) {
                Ok(()) => {}
                Err(l) => {
                    assert_eq!(l.by, LockedBy::Address);
                    refused += 1;
                }
            }
            if n % 4 == 0 {
                let own = [attacker.clone(), ThrottleKey::subject("mallory")];
                if t.attempt(&own, now).is_ok() {
                    t.success(&own, now);
                }
            }
        }
        assert!(
            refused >= 11,
            "only the first 5 guesses are checked: {refused} refused"
        );
    }

    #[test]
    fn a_known_clean_address_passes_a_subject_lock() {
        let mut t = LoginThrottle::new(policy());
        let now = Instant::now();
        // The owner signs in from address 1 once.
        t.attempt(&keys(1), now).unwrap();
        t.success(&keys(1), now);
        // Five other addresses guess wrong: the subject is locked.
        for a in 2..=6 {
            t.attempt(&keys(a), now).unwrap();
        }
        assert_eq!(t.attempt(&keys(7), now).unwrap_err().by, LockedBy::Subject);
        // The owner's address has no failures and signed in before: it gets through.
        assert_eq!(t.attempt(&keys(1), now), Ok(()));
        t.success(&keys(1), now);
        // Once it fails, it is no longer clean: the lock holds for it too.
        for a in 2..=6 {
            let _ = t.attempt(&keys(a), now);
        }
        t.attempt(&keys(1), now).unwrap_or(());
        assert!(t.attempt(&keys(1), now).is_err());
    }

    #[test]
    fn subject_keys_have_a_fixed_size_whatever_the_name() {
        let long = "x".repeat(1 << 20);
        assert_eq!(
            std::mem::size_of_val(&ThrottleKey::subject(&long)),
            std::mem::size_of_val(&ThrottleKey::subject("a"))
        );
        assert_ne!(ThrottleKey::subject("a"), ThrottleKey::subject("b"));
    }

    #[test]
    fn lockouts_are_per_address() {
        let mut t = LoginThrottle::new(policy());
        let now = Instant::now();
        for _ in 0..3 {
            t.attempt(&keys(1), now).unwrap();
        }
        assert_eq!(t.attempt(&keys(1), now).unwrap_err().by, LockedBy::Address);
        // Another address is not locked (the subject has 5 free failures, 3 used).
        assert_eq!(t.attempt(&keys(2), now), Ok(()));
        t.success(&keys(2), now);
        // Success elsewhere cleared the subject, not address 1.
        assert_eq!(t.attempt(&keys(1), now).unwrap_err().by, LockedBy::Address);
    }

    #[test]
    fn the_subject_locks_across_addresses() {
        let mut t = LoginThrottle::new(policy());
        let now = Instant::now();
        // Five addresses, one guess each: no address reaches its limit, the subject does.
        for a in 1..=5 {
            assert_eq!(t.attempt(&keys(a), now), Ok(()));
        }
        let locked = t.attempt(&keys(6), now).unwrap_err();
        assert_eq!(locked.by, LockedBy::Subject);
        assert_eq!(locked.retry_after, Duration::from_secs(2));
        // Another subject from a fresh address is unaffected.
        assert_eq!(
            t.attempt(&[ip(7), ThrottleKey::subject("alice")], now),
            Ok(())
        );
    }

    #[test]
    fn ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() {
        let a: Ipv6Addr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: Ipv6Addr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: Ipv6Addr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(
            ThrottleKey::address(IpAddr::V6(a)),
            ThrottleKey::address(IpAddr::V6(b))
        );
        assert_ne!(
            ThrottleKey::address(IpAddr::V6(a)),
            ThrottleKey::address(IpAddr::V6(c))
        );
        let mapped = Ipv4Addr::new(192, 0, 2, 1).to_ipv6_mapped();
        assert_eq!(
            ThrottleKey::address(IpAddr::V6(mapped)),
            ThrottleKey::address(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
        );
    }

    #[test]
    fn a_flood_of_addresses_stays_bounded_and_keeps_locks() {
        let mut t = LoginThrottle::new(ThrottlePolicy {
            max_entries: 50,
            free_per_subject: u32::MAX,
            ..policy()
        });
        let mut clock = Clock(Instant::now());
        let attacker = [ip(1), ThrottleKey::subject("admin")];
        for _ in 0..3 {
            t.attempt(&attacker, clock.now()).unwrap();
        }
        assert!(t.attempt(&attacker, clock.now()).is_err());
        // 10,000 other addresses, one failure each.
        for n in 0..10_000u32 {
            clock.advance(Duration::from_micros(10));
            let addr = IpAddr::V4(Ipv4Addr::from(0x0b00_0000 + n));
            t.attempt(
                &[ThrottleKey::address(addr), ThrottleKey::subject("admin")],
                clock.now(),
            )
            .unwrap();
            assert!(t.len() <= 50);
        }
        assert_eq!(t.len(), 50);
        // The locked address is still locked (0.1 s of its 2 s passed).
        assert_eq!(
            t.attempt(&attacker, clock.now()).map_err(|l| l.by),
            Err(LockedBy::Address)
        );
    }

    #[test]
    fn counts_are_forgotten_a_day_after_the_last_failure() {
        let mut t = LoginThrottle::new(policy());
        let mut clock = Clock(Instant::now());
        let k = keys(1);
        for _ in 0..2 {
            t.attempt(&k, clock.now()).unwrap();
        }
        clock.advance(FORGET_AFTER);
        // Two more would lock if the first two still counted; they do not.
        for _ in 0..2 {
            assert_eq!(t.attempt(&k, clock.now()), Ok(()));
        }
        assert_eq!(t.attempt(&k, clock.now()), Ok(()));
        assert!(t.attempt(&k, clock.now()).is_err());
    }
}
