//! Usage counters every replica adds to and reads (`usage_counters`, migration 0011), so that
//! N replicas on one database enforce one limit: tokens per minute, day and month, and counted
//! events (conversations made per minute). Windows are fixed and UTC: the minute, the day and
//! the calendar month an instant falls in.

use chrono::{DateTime, Datelike, TimeZone, Utc};

use super::{Store, StoreError, WriteTx};

/// A counting window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Period {
    Minute,
    Day,
    Month,
}

impl Period {
    pub const ALL: [Period; 3] = [Period::Minute, Period::Day, Period::Month];

    pub fn as_str(self) -> &'static str {
        match self {
            Period::Minute => "minute",
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    /// The first instant of the window `at` falls in.
    pub fn start(self, at: DateTime<Utc>) -> DateTime<Utc> {
        let s = at.timestamp();
        match self {
            Period::Minute => Utc.timestamp_opt(s - s.rem_euclid(60), 0).single(),
            Period::Day => Utc.timestamp_opt(s - s.rem_euclid(86_400), 0).single(),
            Period::Month => Utc
                .with_ymd_and_hms(at.year(), at.month(), 1, 0, 0, 0)
                .single(),
        }
        .unwrap_or(at)
    }

    /// The first instant of the next window: when a count of this window resets.
    pub fn end(self, at: DateTime<Utc>) -> DateTime<Utc> {
        let start = self.start(at);
        match self {
            Period::Minute => start + chrono::Duration::seconds(60),
            Period::Day => start + chrono::Duration::days(1),
            Period::Month => {
                let (y, m) = if start.month() == 12 {
                    (start.year() + 1, 1)
                } else {
                    (start.year(), start.month() + 1)
                };
                Utc.with_ymd_and_hms(y, m, 1, 0, 0, 0)
                    .single()
                    .unwrap_or(start + chrono::Duration::days(31))
            }
        }
    }
}

/// What one subject used in one window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub tokens: i64,
    pub events: i64,
}

/// Whether `query` (selecting by `$1`) finds a row.
async fn row_exists(tx: &mut WriteTx, query: &'static str, id: &str) -> Result<bool, StoreError> {
    let found: Option<(i32,)> = sqlx::query_as(query)
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(found.is_some())
}

impl Store {
    /// Adds `tokens` and `events` to `subject`'s minute, day and month at `at`, in one
    /// transaction.
    pub async fn add_usage(
        &self,
        subject: &str,
        tokens: i64,
        events: i64,
        at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        // A deleted account's or key's counters are gone with it; a request that finishes just
        // after the delete must not bring them back.
        let gone = match subject.split_once(':') {
            // An account, a guest or an API caller: a deleted account has its tombstone.
            Some(("user", id)) => {
                row_exists(&mut tx, "SELECT 1 FROM deleted_users WHERE id = $1", id).await?
            }
            // Always an account's key, whose row goes with the account.
            Some(("key", id)) => {
                !row_exists(&mut tx, "SELECT 1 FROM api_keys WHERE id = $1", id).await?
            }
            _ => false,
        };
        if gone {
            tx.rollback().await?;
            return Err(StoreError::OwnerGone(subject.to_string()));
        }
        for period in Period::ALL {
            sqlx::query(
                "INSERT INTO usage_counters (subject, period, start, tokens, events) \
                 VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (subject, period, start) DO UPDATE SET \
                   tokens = usage_counters.tokens + excluded.tokens, \
                   events = usage_counters.events + excluded.events",
            )
            .bind(subject)
            .bind(period.as_str())
            .bind(period.start(at).timestamp())
            .bind(tokens)
            .bind(events)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Counts one event of `subject` in the minute of `at` and returns the minute's count with
    /// it, atomically: replicas counting at once each see a different number, so a limit holds
    /// exactly across them.
    pub async fn count_event(&self, subject: &str, at: DateTime<Utc>) -> Result<i64, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        let (events,): (i64,) = sqlx::query_as(
            "INSERT INTO usage_counters (subject, period, start, tokens, events) \
             VALUES ($1, 'minute', $2, 0, 1) \
             ON CONFLICT (subject, period, start) DO UPDATE SET \
               events = usage_counters.events + 1 \
             RETURNING events",
        )
        .bind(subject)
        .bind(Period::Minute.start(at).timestamp())
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(events)
    }

    /// What `subject` used in the window of `period` that `at` falls in.
    pub async fn usage(
        &self,
        subject: &str,
        period: Period,
        at: DateTime<Utc>,
    ) -> Result<Usage, StoreError> {
        let row: Option<(i64, i64)> = sqlx::query_as(
            "SELECT tokens, events FROM usage_counters \
             WHERE subject = $1 AND period = $2 AND start = $3",
        )
        .bind(subject)
        .bind(period.as_str())
        .bind(period.start(at).timestamp())
        .fetch_optional(&self.pool)
        .await?;
        Ok(row
            .map(|(tokens, events)| Usage { tokens, events })
            .unwrap_or_default())
    }

    /// `subject`'s windows of `period`, newest first, at most `limit` (usage over time).
    pub async fn usage_history(
        &self,
        subject: &str,
        period: Period,
        limit: usize,
    ) -> Result<Vec<(DateTime<Utc>, Usage)>, StoreError> {
        let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
            "SELECT start, tokens, events FROM usage_counters \
             WHERE subject = $1 AND period = $2 ORDER BY start DESC LIMIT $3",
        )
        .bind(subject)
        .bind(period.as_str())
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(start, tokens, events)| {
                Utc.timestamp_opt(start, 0)
                    .single()
                    .map(|t| (t, Usage { tokens, events }))
            })
            .collect())
    }

    /// Removes windows no limit or history needs any more: minutes older than a day, days
    /// older than 400 days (a year of history), months older than five years.
    pub async fn trim_usage(&self, at: DateTime<Utc>) -> Result<u64, StoreError> {
        let now = at.timestamp();
        let mut removed = 0;
        for (period, keep_s) in [
            ("minute", 86_400i64),
            ("day", 400 * 86_400),
            ("month", 5 * 366 * 86_400),
        ] {
            removed += sqlx::query("DELETE FROM usage_counters WHERE period = $1 AND start < $2")
                .bind(period)
                .bind(now - keep_s)
                .execute(&self.pool)
                .await?
                .rows_affected();
        }
        Ok(removed)
    }

    /// Forgets every counter of `subject` (its account was deleted).
    pub async fn forget_usage(&self, subject: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM usage_counters WHERE subject = $1")
            .bind(subject)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn windows_start_and_end_on_utc_boundaries() {
        let t = at("2026-12-31T23:59:30Z");
        assert_eq!(Period::Minute.start(t), at("2026-12-31T23:59:00Z"));
        assert_eq!(Period::Minute.end(t), at("2027-01-01T00:00:00Z"));
        assert_eq!(Period::Day.end(t), at("2027-01-01T00:00:00Z"));
        assert_eq!(Period::Month.start(t), at("2026-12-01T00:00:00Z"));
        assert_eq!(Period::Month.end(t), at("2027-01-01T00:00:00Z"));
        assert_eq!(
            Period::Month.end(at("2028-02-10T00:00:00Z")),
            at("2028-03-01T00:00:00Z")
        );
    }
}
