//! The message bus between replicas: PostgreSQL `LISTEN`/`NOTIFY` on one channel.
//!
//! Why PostgreSQL and not Redis or NATS: the replicas already share the database, so the bus
//! costs no second service to run, secure and monitor; notifications are delivered only after
//! the sending transaction commits (a reply's "done" can never overtake the row it announces);
//! and the traffic is small (one notification per generated token of a reply, a few hundred a
//! second per GPU). Its limits, which the callers design around: a payload holds at most 8000
//! bytes, and a listener that is disconnected misses what was sent meanwhile (the relay then
//! re-synchronises from the stored partial reply).
//!
//! Order: everything one replica publishes goes through one connection, in the order
//! [`Bus::publish`] was called, and PostgreSQL delivers one session's notifications in that
//! order; so a listener sees each replica's messages in the order they were sent.
//!
//! The bus carries opaque text: what the messages mean belongs to the actors
//! (`actors::cluster`).

use std::time::Duration;

use sqlx::postgres::{PgConnection, PgListener};
use sqlx::Connection;
use tokio::sync::{broadcast, mpsc};

use super::{redact_url, Backend, Store, StoreError};

/// The one channel every replica listens on.
pub const CHANNEL: &str = "smolchat_cluster";
/// PostgreSQL refuses payloads of 8000 bytes or more; callers split longer text.
pub const MAX_PAYLOAD: usize = 7900;
/// Messages a slow consumer may fall behind by before it misses some.
const INCOMING_CAPACITY: usize = 16_384;
/// Wait between attempts to reconnect a lost publishing connection.
const RECONNECT_DELAY: Duration = Duration::from_millis(500);

/// A handle on the bus. Cloning is cheap.
#[derive(Clone, Debug)]
pub struct Bus {
    outgoing: mpsc::UnboundedSender<String>,
    incoming: broadcast::Sender<String>,
}

impl Bus {
    /// Connects the listening and the publishing connection. `None` on SQLite, where one
    /// process serves everything and there is nobody to tell.
    pub async fn connect(store: &Store) -> Result<Option<Bus>, StoreError> {
        if store.backend() != Backend::Postgres {
            return Ok(None);
        }
        let url = store.url().to_string();
        let open_err = |source| StoreError::Open {
            url: redact_url(&url),
            source,
        };
        let mut listener = PgListener::connect(&url).await.map_err(open_err)?;
        listener.listen(CHANNEL).await?;
        let publisher = PgConnection::connect(&url).await.map_err(open_err)?;

        let (incoming, _) = broadcast::channel(INCOMING_CAPACITY);
        let (outgoing, rx) = mpsc::unbounded_channel();
        tokio::spawn(listen(listener, incoming.clone()));
        tokio::spawn(publish(url, publisher, rx));
        Ok(Some(Bus { outgoing, incoming }))
    }

    /// Sends `payload` to every replica (this one included: receivers skip their own).
    /// Returns at once; a payload over [`MAX_PAYLOAD`] bytes is dropped with an error in the log.
    pub fn publish(&self, payload: String) {
        if payload.len() > MAX_PAYLOAD {
            tracing::error!(
                bytes = payload.len(),
                "a cluster message is too long for NOTIFY and was dropped"
            );
            return;
        }
        if self.outgoing.send(payload).is_err() {
            tracing::warn!("the cluster bus is closed; a message was dropped");
        }
    }

    /// Every payload published from now on, by any replica.
    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.incoming.subscribe()
    }
}

async fn listen(mut listener: PgListener, incoming: broadcast::Sender<String>) {
    loop {
        // `recv` reconnects by itself after a lost connection (and re-LISTENs); what was sent
        // meanwhile is gone, which `try_recv` would report as `None`.
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                // No receiver yet (start-up) is not an error.
                let _ = incoming.send(notification.payload().to_string());
            }
            Ok(None) => {
                tracing::warn!(
                    "the cluster bus listener reconnected; messages sent meanwhile were missed"
                );
            }
            Err(e) => {
                tracing::warn!("the cluster bus listener failed: {e}; retrying");
                tokio::time::sleep(RECONNECT_DELAY).await;
            }
        }
    }
}

async fn publish(url: String, mut conn: PgConnection, mut rx: mpsc::UnboundedReceiver<String>) {
    while let Some(payload) = rx.recv().await {
        // One retry on a fresh connection: a message is worth one reconnect, not a queue
        // that grows while the database is away.
        for attempt in 0..2 {
            let sent = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(CHANNEL)
                .bind(&payload)
                .execute(&mut conn)
                .await;
            match sent {
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(attempt, "publishing on the cluster bus failed: {e}");
                    tokio::time::sleep(RECONNECT_DELAY).await;
                    match PgConnection::connect(&url).await {
                        Ok(fresh) => conn = fresh,
                        Err(e) => tracing::warn!("cannot reconnect the cluster bus: {e}"),
                    }
                }
            }
        }
    }
}
