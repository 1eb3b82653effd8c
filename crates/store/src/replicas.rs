//! Replicas (`replicas`, migration 0004): the server processes sharing this database.
//!
//! Each `smolchat serve` registers itself at start with a new id and its stable name, then
//! refreshes its heartbeat (and a snapshot of its load) every few seconds. A replica whose
//! heartbeat is older than the lease is dead: any replica's sweep marks its `streaming` replies
//! `interrupted`, keeping their partial text. Replies of live replicas are never touched, so one
//! replica's start-up or crash cannot end another's replies.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{
    encode_json, now_micros, parse_time, parse_uuid, Backend, Store, StoreError, WriteTx,
    INTERRUPTED_BY_RESTART,
};

/// A query with the database's own clock (microseconds since the Unix epoch) spliced in where
/// `$before` and `$after` meet. Heartbeats are written and judged by that one clock, so replicas
/// whose clocks disagree can never see a live replica as dead.
macro_rules! with_db_now {
    ($backend:expr, $before:literal, $after:literal) => {
        match $backend {
            Backend::Sqlite => concat!(
                $before,
                "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)",
                $after
            ),
            Backend::Postgres => concat!(
                $before,
                "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)",
                $after
            ),
        }
    };
}

/// What a replica reports about itself at each heartbeat (shown on the admin page; the warm
/// conversations tell an operator where each conversation's KV cache lives).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReplicaLoad {
    pub queued: usize,
    pub running: usize,
    pub tokens_per_s: f64,
    pub kv_bytes: usize,
    pub kv_budget_bytes: usize,
    /// Conversations whose KV cache this replica holds (at most [`ReplicaLoad::MAX_HELD`]).
    pub held: Vec<Uuid>,
    /// How many it holds in all (`held` may be cut short).
    pub held_count: usize,
    /// Streams (SSE) open on this replica.
    pub streams: usize,
}

impl ReplicaLoad {
    /// Keeps the heartbeat row small whatever the cache holds.
    pub const MAX_HELD: usize = 200;
}

/// This process's registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    pub id: Uuid,
    pub name: String,
    pub url: String,
}

/// A replica as the admin page and the router see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaRecord {
    pub id: Uuid,
    pub name: String,
    pub url: String,
    pub started_at: DateTime<Utc>,
    pub heartbeat_at: DateTime<Utc>,
    pub stopped_at: Option<DateTime<Utc>>,
    pub load: ReplicaLoad,
    /// Heartbeat within the lease and not stopped.
    pub live: bool,
}

/// What [`Store::register_replica`] did.
#[derive(Debug, Clone)]
pub struct Registration {
    pub replica: Replica,
    /// Replies of earlier runs of this name and of dead replicas, marked `interrupted`.
    pub interrupted: u64,
}

fn lease_micros(lease: Duration) -> i64 {
    i64::try_from(lease.as_micros()).unwrap_or(i64::MAX)
}

impl Store {
    /// Registers this process as replica `name` reachable at `url`: a new row with a new id,
    /// earlier runs of the same name marked stopped and their `streaming` replies (and those of
    /// every replica dead for longer than `lease`) marked `interrupted`, in one transaction.
    /// Later replies this store starts carry the new id.
    pub async fn register_replica(
        &self,
        name: &str,
        url: &str,
        lease: Duration,
    ) -> Result<Registration, StoreError> {
        let id = Uuid::now_v7();
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        sqlx::query("UPDATE replicas SET stopped_at = $1 WHERE name = $2 AND stopped_at IS NULL")
            .bind(now)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        sqlx::query(with_db_now!(
            self.backend,
            "INSERT INTO replicas (id, name, url, started_at, heartbeat_at) \
             VALUES ($1, $2, $3, $4, ",
            ")"
        ))
        .bind(id.to_string())
        .bind(name)
        .bind(url)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let interrupted = sweep(&mut tx, self.backend, lease).await?;
        tx.commit().await?;
        let replica = Replica {
            id,
            name: name.to_string(),
            url: url.to_string(),
        };
        // Set once per process; a second registration (tests) keeps the first id for replies.
        let _ = self.replica.set(id);
        if interrupted > 0 {
            tracing::warn!(
                count = interrupted,
                "replies of stopped or dead replicas marked interrupted"
            );
        }
        tracing::info!(replica = %id, name, url, "replica registered");
        Ok(Registration {
            replica,
            interrupted,
        })
    }

    /// The id of the replica this store registered, which replies it starts record.
    pub fn replica_id(&self) -> Option<Uuid> {
        self.replica.get().copied()
    }

    /// Refreshes replica `id`'s heartbeat and load. `false` when its row is gone or was marked
    /// stopped (a restart of the same name took over): the caller should stop serving.
    pub async fn heartbeat(&self, id: Uuid, load: &ReplicaLoad) -> Result<bool, StoreError> {
        let load = encode_json("replica load", load)?;
        let updated = sqlx::query(with_db_now!(
            self.backend,
            "UPDATE replicas SET heartbeat_at = ",
            ", load = $1 WHERE id = $2 AND stopped_at IS NULL"
        ))
        .bind(load)
        .bind(id.to_string())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(updated > 0)
    }

    /// Marks `streaming` every reply whose replica is stopped or has not sent a heartbeat within
    /// `lease` as `interrupted` (keeping the partial text); returns how many. Every replica runs
    /// this after its heartbeat, so a replica killed mid-reply has its replies ended within about
    /// one lease, by whichever replica looks first.
    pub async fn sweep_dead_replicas(&self, lease: Duration) -> Result<u64, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        let n = sweep(&mut tx, self.backend, lease).await?;
        tx.commit().await?;
        Ok(n)
    }

    /// Marks replica `id` stopped (a clean shutdown, after its replies were finished).
    pub async fn stop_replica(&self, id: Uuid) -> Result<(), StoreError> {
        sqlx::query("UPDATE replicas SET stopped_at = $1 WHERE id = $2 AND stopped_at IS NULL")
            .bind(now_micros())
            .bind(id.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Replicas that are live or stopped within `recent` of now, newest first (the admin page).
    /// `live` is judged against `lease`.
    pub async fn replicas(
        &self,
        lease: Duration,
        recent: Duration,
    ) -> Result<Vec<ReplicaRecord>, StoreError> {
        let rows: Vec<ReplicaRow> = sqlx::query_as(with_db_now!(
            self.backend,
            "SELECT id, name, url, started_at, heartbeat_at, stopped_at, load, now FROM \
             (SELECT r.*, ",
            " AS now FROM replicas r) t WHERE heartbeat_at > now - $1 \
             ORDER BY started_at DESC, id DESC"
        ))
        .bind(lease_micros(recent))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(|row| row.into_record(lease)).collect()
    }

    /// The live replicas (heartbeat within `lease`, not stopped), ordered by id: the set the
    /// conversation router hashes over.
    pub async fn live_replicas(&self, lease: Duration) -> Result<Vec<ReplicaRecord>, StoreError> {
        let mut live: Vec<ReplicaRecord> = self
            .replicas(lease, lease)
            .await?
            .into_iter()
            .filter(|r| r.live)
            .collect();
        live.sort_by_key(|r| r.id);
        Ok(live)
    }

    /// The replica generating the `streaming` reply of `conversation`, if one is.
    pub async fn streaming_replica(
        &self,
        conversation: Uuid,
    ) -> Result<Option<(Uuid, Option<Uuid>)>, StoreError> {
        let row: Option<(String, Option<String>)> = sqlx::query_as(
            "SELECT id, replica_id FROM messages WHERE conversation_id = $1 AND status = 'streaming'",
        )
        .bind(conversation.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.map(|(id, replica)| {
            let message = parse_uuid("messages", &id, &id)?;
            let replica = replica
                .map(|r| parse_uuid("messages", &id, &r))
                .transpose()?;
            Ok((message, replica))
        })
        .transpose()
    }
}

async fn sweep(tx: &mut WriteTx, backend: Backend, lease: Duration) -> Result<u64, StoreError> {
    let result = sqlx::query(with_db_now!(
        backend,
        "UPDATE messages SET status = 'interrupted', error = COALESCE(error, $1) \
         WHERE status = 'streaming' AND (replica_id IS NULL OR replica_id NOT IN \
           (SELECT id FROM replicas WHERE stopped_at IS NULL AND heartbeat_at > ",
        " - $2))"
    ))
    .bind(INTERRUPTED_BY_RESTART)
    .bind(lease_micros(lease))
    .execute(&mut **tx)
    .await?;
    Ok(result.rows_affected())
}

#[derive(sqlx::FromRow)]
struct ReplicaRow {
    id: String,
    name: String,
    url: String,
    started_at: i64,
    heartbeat_at: i64,
    stopped_at: Option<i64>,
    load: String,
    /// The database's clock when the row was read.
    now: i64,
}

impl ReplicaRow {
    fn into_record(self, lease: Duration) -> Result<ReplicaRecord, StoreError> {
        let live_after = self.now.saturating_sub(lease_micros(lease));
        const T: &str = "replicas";
        // A load written by another version of smolchat reads as empty rather than failing the
        // admin page.
        let load = serde_json::from_str(&self.load).unwrap_or_default();
        Ok(ReplicaRecord {
            id: parse_uuid(T, &self.id, &self.id)?,
            started_at: parse_time(T, &self.id, self.started_at)?,
            heartbeat_at: parse_time(T, &self.id, self.heartbeat_at)?,
            stopped_at: self
                .stopped_at
                .map(|t| parse_time(T, &self.id, t))
                .transpose()?,
            live: self.stopped_at.is_none() && self.heartbeat_at > live_after,
            name: self.name,
            url: self.url,
            load,
        })
    }
}
