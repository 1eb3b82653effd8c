//! Token quotas that hold across replicas: counted in the store's `usage_counters`, which every
//! replica on one database adds to and reads, so three replicas enforce one limit, not three.
//!
//! - `limits.tokens_per_minute_per_user` and `limits.tokens_per_minute_per_guest_address`: the
//!   scheduler of each replica enforces them within a step on what it runs; here they are
//!   enforced again on what every replica counted.
//! - `limits.tokens_per_day_per_user` / `…_per_month_per_user`, and the same `…_per_key` for
//!   personal API keys (a key's requests count against the key and its account both).
//!
//! A request is checked before it is queued, and its tokens (prompt computed plus generated,
//! the scheduler's own measure) are counted when it ends. So requests already running when a
//! quota fills may finish beyond it by what they generate; the next is refused. Windows are the
//! UTC minute, day and calendar month (fixed, not sliding). A store that cannot answer lets the
//! request through (logged): quotas must not turn a database hiccup into an outage.

use chrono::{DateTime, Utc};
use smolchat_store::{Period, Store, StoreError};

/// The quota settings (from `[limits]`); 0 turns one off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaLimits {
    pub per_minute_user: u64,
    pub per_minute_group: u64,
    pub per_day_user: u64,
    pub per_month_user: u64,
    pub per_day_key: u64,
    pub per_month_key: u64,
}

/// Whom a request's tokens count against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuotaSubjects {
    /// The scheduler's user (an account, a guest owner, an API caller).
    pub user: Option<String>,
    /// A guest's address group.
    pub group: Option<String>,
    /// The personal API key's id, for a request made with one.
    pub key: Option<String>,
}

/// A quota that is used up: which, how much, and when it resets.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("your {what} quota is used up: {used} of {limit} tokens across all replicas ({setting}); it resets at {} UTC, in {} s", .resets_at.format("%Y-%m-%d %H:%M:%S"), self.retry_after_s())]
pub struct QuotaExceeded {
    /// In words: "per-minute", "daily", "monthly API key".
    pub what: &'static str,
    /// The setting that sets it.
    pub setting: &'static str,
    pub used: i64,
    pub limit: u64,
    pub resets_at: DateTime<Utc>,
    /// When the check was made.
    pub now: DateTime<Utc>,
}

impl QuotaExceeded {
    pub fn retry_after_s(&self) -> u64 {
        u64::try_from((self.resets_at - self.now).num_seconds())
            .unwrap_or(0)
            .max(1)
    }
}

/// One quota as an account page shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaLine {
    pub what: &'static str,
    pub used: i64,
    /// 0: no limit.
    pub limit: u64,
    pub resets_at: DateTime<Utc>,
}

/// One rule: the counter's subject, its window, its limit and how to name it.
struct Rule {
    subject: String,
    period: Period,
    limit: u64,
    what: &'static str,
    setting: &'static str,
}

#[derive(Clone)]
pub struct Quotas {
    store: Store,
    limits: QuotaLimits,
}

impl Quotas {
    pub fn new(store: Store, limits: QuotaLimits) -> Quotas {
        Quotas { store, limits }
    }

    /// Every quota that applies to `s`: one table of (whom, window, limit, name, setting).
    fn rules(&self, s: &QuotaSubjects) -> Vec<Rule> {
        let l = &self.limits;
        let user = s.user.as_ref().map(|u| format!("user:{u}"));
        let group = s.group.as_ref().map(|g| format!("group:{g}"));
        let key = s.key.as_ref().map(|k| format!("key:{k}"));
        let table = [
            (
                &user,
                Period::Minute,
                l.per_minute_user,
                "per-minute",
                "limits.tokens_per_minute_per_user",
            ),
            (
                &user,
                Period::Day,
                l.per_day_user,
                "daily",
                "limits.tokens_per_day_per_user",
            ),
            (
                &user,
                Period::Month,
                l.per_month_user,
                "monthly",
                "limits.tokens_per_month_per_user",
            ),
            (
                &group,
                Period::Minute,
                l.per_minute_group,
                "guest (per address, per minute)",
                "limits.tokens_per_minute_per_guest_address",
            ),
            (
                &key,
                Period::Day,
                l.per_day_key,
                "daily API key",
                "limits.tokens_per_day_per_key",
            ),
            (
                &key,
                Period::Month,
                l.per_month_key,
                "monthly API key",
                "limits.tokens_per_month_per_key",
            ),
        ];
        table
            .into_iter()
            .filter_map(|(subject, period, limit, what, setting)| {
                Some(Rule {
                    subject: subject.clone()?,
                    period,
                    limit,
                    what,
                    setting,
                })
            })
            .collect()
    }

    /// Refuses when any quota of `subjects` is used up (on every replica together).
    pub async fn check(&self, subjects: &QuotaSubjects) -> Result<(), QuotaExceeded> {
        self.check_at(subjects, Utc::now()).await
    }

    async fn check_at(
        &self,
        subjects: &QuotaSubjects,
        now: DateTime<Utc>,
    ) -> Result<(), QuotaExceeded> {
        for rule in self.rules(subjects) {
            if rule.limit == 0 {
                continue;
            }
            let used = match self.store.usage(&rule.subject, rule.period, now).await {
                Ok(u) => u.tokens,
                Err(e) => {
                    tracing::warn!(subject = %rule.subject, "cannot read a quota's usage; letting the request through: {e}");
                    continue;
                }
            };
            if used >= i64::try_from(rule.limit).unwrap_or(i64::MAX) {
                metrics::counter!("smolchat_quota_refusals_total", "quota" => rule.setting)
                    .increment(1);
                return Err(QuotaExceeded {
                    what: rule.what,
                    setting: rule.setting,
                    used,
                    limit: rule.limit,
                    resets_at: rule.period.end(now),
                    now,
                });
            }
        }
        Ok(())
    }

    /// Counts `tokens` against every subject (whether or not a limit is set, so usage is
    /// there to see when one is set later).
    pub async fn record(&self, subjects: &QuotaSubjects, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let now = Utc::now();
        let tokens = i64::try_from(tokens).unwrap_or(i64::MAX);
        let mut seen = Vec::new();
        for rule in self.rules(subjects) {
            if seen.contains(&rule.subject) {
                continue;
            }
            match self.store.add_usage(&rule.subject, tokens, 1, now).await {
                Ok(()) => {}
                // The account or key was deleted while this request ran.
                Err(e @ StoreError::OwnerGone(_)) => tracing::debug!("{e}"),
                Err(e) => {
                    tracing::warn!(subject = %rule.subject, "cannot count tokens against a quota: {e}")
                }
            }
            seen.push(rule.subject);
        }
    }

    /// An account's quotas now (for its account page): used, limit, reset.
    pub async fn of_account(&self, user_id: &str) -> Vec<QuotaLine> {
        let now = Utc::now();
        let subjects = QuotaSubjects {
            user: Some(user_id.to_string()),
            ..QuotaSubjects::default()
        };
        let mut lines = Vec::new();
        for rule in self.rules(&subjects) {
            let used = self
                .store
                .usage(&rule.subject, rule.period, now)
                .await
                .map(|u| u.tokens)
                .unwrap_or(0);
            lines.push(QuotaLine {
                what: rule.what,
                used,
                limit: rule.limit,
                resets_at: rule.period.end(now),
            });
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("db.sqlite").display());
        let store = Store::open(&url).await.unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn a_used_up_quota_names_itself_and_its_reset() {
        let (_dir, store) = store().await;
        // A key's usage is counted only for a key that exists (a deleted account's is gone).
        let key = "a".repeat(64);
        let made = store
            .create_user(&smolchat_store::NewUser {
                id: "alice",
                name: "alice",
                password_hash: "$argon2id$unused",
                role: smolchat_store::UserRole::User,
                invite: None,
                adopt_from: None,
            })
            .await
            .unwrap();
        assert!(matches!(made, smolchat_store::CreatedUser::Created { .. }));
        store
            .create_api_key(&key, "alice", "laptop", "sk-smol-aaaaaa")
            .await
            .unwrap();
        let q = Quotas::new(
            store,
            QuotaLimits {
                per_day_user: 100,
                per_day_key: 30,
                ..QuotaLimits::default()
            },
        );
        let alice = QuotaSubjects {
            user: Some("alice".into()),
            ..QuotaSubjects::default()
        };
        let with_key = QuotaSubjects {
            key: Some(key.clone()),
            ..alice.clone()
        };
        assert_eq!(q.check(&with_key).await, Ok(()));
        q.record(&with_key, 40).await;
        // The key's 30 are used up; the account's 100 are not.
        let e = q.check(&with_key).await.unwrap_err();
        assert_eq!(e.setting, "limits.tokens_per_day_per_key");
        assert!(
            e.to_string()
                .contains("daily API key quota is used up: 40 of 30"),
            "{e}"
        );
        assert_eq!(q.check(&alice).await, Ok(()));
        q.record(&alice, 60).await;
        let e = q.check(&alice).await.unwrap_err();
        assert_eq!((e.what, e.used, e.limit), ("daily", 100, 100));
        let midnight = Period::Day.end(Utc::now());
        assert_eq!(e.resets_at, midnight);
        assert!(e.retry_after_s() <= 86_400 && e.retry_after_s() >= 1);
        assert!(e.to_string().contains("UTC"), "{e}");
        let lines = q.of_account("alice").await;
        let daily = lines.iter().find(|l| l.what == "daily").unwrap();
        assert_eq!((daily.used, daily.limit), (100, 100));
    }

    #[tokio::test]
    async fn no_limits_refuse_nothing_but_usage_is_counted() {
        let (_dir, store) = store().await;
        let q = Quotas::new(store, QuotaLimits::default());
        let s = QuotaSubjects {
            user: Some("bob".into()),
            group: Some("10.0.0.0".into()),
            key: None,
        };
        q.record(&s, 1_000_000).await;
        assert_eq!(q.check(&s).await, Ok(()));
        assert_eq!(q.of_account("bob").await[1].used, 1_000_000);
    }
}
