//! Replicas: this server process among the others sharing its database.
//!
//! [`Cluster`] registers the replica, keeps its heartbeat (with a snapshot of its load) and the
//! list of live replicas, ends the replies of dead replicas (the sweep), says which replica owns
//! a conversation (rendezvous hashing of the conversation id over the live replicas' names, so
//! each conversation's turns meet its warm KV cache), and carries the messages that let a reply
//! be followed, stopped or deleted from any replica ([`Wire`], over the store's bus).
//!
//! With SQLite there is one replica and no bus: the same code runs, every conversation is owned
//! here, and nothing is published.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use actix::Addr;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use uuid::Uuid;

use smolchat_serving::scheduler::{GetCacheInfo, GetStats, SchedulerActor};
use smolchat_store::{Bus, Replica, ReplicaLoad, ReplicaRecord, Store, StoreError};
use smolchat_text::splitter::ToolCall;

use crate::reply::ReplyEvent;

/// Replicas stopped or dead within this long still show on the admin page.
const SHOWN_AFTER_DEATH: Duration = Duration::from_secs(3600);
/// Text of one reply event per bus message at most (a payload must stay under 8000 bytes with
/// its JSON around it, and JSON may escape a character into six).
const MAX_TEXT_BYTES: usize = 1150;

#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub name: String,
    pub url: String,
    pub heartbeat: Duration,
    pub lease: Duration,
    pub affinity: bool,
    /// Signs and checks every bus message (`server.cookie_secret`, the same on every replica):
    /// a database role that can `LISTEN` and `NOTIFY` on the channel cannot forge messages
    /// without it.
    pub bus_key: Vec<u8>,
}

/// What a bus message's signature covers.
const BUS_SIGNATURE_PURPOSE: &str = "smolchat-bus-v1";

/// `payload` signed for the bus: the hex HMAC, a `.`, the payload.
fn sign_payload(key: &[u8], payload: &str) -> String {
    let mac = smolchat_auth::secret::fingerprint(key, BUS_SIGNATURE_PURPOSE, payload);
    format!("{mac}.{payload}")
}

/// The payload of a signed bus message, or `None` when the signature is missing or wrong.
fn verify_payload<'a>(key: &[u8], message: &'a str) -> Option<&'a str> {
    let (mac, payload) = message.split_once('.')?;
    let expected = smolchat_auth::secret::fingerprint(key, BUS_SIGNATURE_PURPOSE, payload);
    use subtle::ConstantTimeEq;
    bool::from(expected.as_bytes().ct_eq(mac.as_bytes())).then_some(payload)
}

/// A live replica as the router sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub id: Uuid,
    pub name: String,
    pub url: String,
}

impl Peer {
    fn of(replica: &Replica) -> Peer {
        Peer {
            id: replica.id,
            name: replica.name.clone(),
            url: replica.url.clone(),
        }
    }
}

/// One message between replicas: about conversation `c`, from replica `from` (a replica ignores
/// its own messages).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Wire {
    pub c: Uuid,
    pub from: Uuid,
    #[serde(flatten)]
    pub body: WireBody,
}

/// What a [`Wire`] says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "k", rename_all = "snake_case")]
pub enum WireBody {
    /// An event of the reply `from` is generating in the conversation (stored messages by id:
    /// the follower reads them from the shared store).
    Reply { event: ReplyEvent<Uuid> },
    /// Answer to [`WireBody::Sync`]: the reply so far is stored, and was exactly the first
    /// `content_len` bytes of its content and `reasoning_len` of its reasoning when this was
    /// sent; what follows on the bus continues from there.
    Snapshot {
        user_message: Uuid,
        assistant: Uuid,
        content_len: usize,
        reasoning_len: usize,
        tool_calls: Vec<ToolCall>,
    },
    /// "A viewer here joined your running reply: send a snapshot" (also counts as `Watch`).
    Sync,
    /// "Viewers here still follow your running reply": keeps it from being cancelled as
    /// abandoned when its own replica has no viewer left (a reload landed elsewhere).
    Watch,
    /// Stop the running reply (asked on another replica).
    Stop,
    /// The conversation was deleted on another replica: end its session and reply.
    Deleted,
}

/// Splits `text` into pieces of at most `max` bytes on character boundaries.
pub fn split_text(text: &str, max: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while rest.len() > max {
        let mut cut = max;
        while cut > 0 && !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut == 0 {
            // `max` is smaller than one character: send the character whole.
            cut = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        let (head, tail) = rest.split_at(cut);
        pieces.push(head);
        rest = tail;
    }
    if !rest.is_empty() || pieces.is_empty() {
        pieces.push(rest);
    }
    pieces
}

/// The live replica that owns `conversation`: highest rendezvous weight
/// SHA-256(name, id) among `peers`. Names, not ids, so a replica restarted under its name gets
/// its conversations back; removing a replica moves only its own conversations.
pub fn owner_of(peers: &[Peer], conversation: Uuid) -> Option<&Peer> {
    peers.iter().max_by_key(|p| {
        let mut h = Sha256::new();
        h.update(p.name.as_bytes());
        h.update([0u8]);
        h.update(conversation.as_bytes());
        let digest = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        (u64::from_be_bytes(first), p.name.clone())
    })
}

pub struct Cluster {
    store: Store,
    bus: Option<Bus>,
    me: Replica,
    cfg: ClusterConfig,
    live: RwLock<Vec<Peer>>,
    /// Where incoming messages for conversations go (the session registry reads the other end).
    inbox: Mutex<Option<mpsc::UnboundedSender<Wire>>>,
    /// Open SSE streams on this replica, reported in the heartbeat (set by the web layer).
    streams: Mutex<Option<Arc<dyn Fn() -> usize + Send + Sync>>>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("me", &self.me)
            .field("bus", &self.bus.is_some())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Registers this replica (ending the replies of its earlier runs and of dead replicas) and
    /// connects the bus. The heartbeat and the relay start with [`Cluster::run`].
    pub async fn join(store: Store, cfg: ClusterConfig) -> Result<(Arc<Cluster>, u64), StoreError> {
        let registration = store
            .register_replica(&cfg.name, &cfg.url, cfg.lease)
            .await?;
        let bus = Bus::connect(&store).await?;
        let me = registration.replica;
        let cluster = Arc::new(Cluster {
            live: RwLock::new(vec![Peer::of(&me)]),
            store,
            bus,
            me,
            cfg,
            inbox: Mutex::new(None),
            streams: Mutex::new(None),
        });
        cluster.refresh_live().await;
        Ok((cluster, registration.interrupted))
    }

    pub fn me(&self) -> &Replica {
        &self.me
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    /// Whether other replicas can exist (a bus is connected).
    pub fn is_shared(&self) -> bool {
        self.bus.is_some()
    }

    /// Sends the messages other replicas address to conversations into `inbox` (the session
    /// registry reads it: the cluster knows nothing of sessions). Until this is called, and
    /// after the reader goes away, such messages are dropped: nobody here holds the
    /// conversation.
    pub fn deliver_to(&self, inbox: mpsc::UnboundedSender<Wire>) {
        *self.inbox.lock().unwrap_or_else(|p| p.into_inner()) = Some(inbox);
    }

    /// Lets the heartbeat report the open streams (the web layer counts them).
    pub fn attach_stream_count(&self, count: Arc<dyn Fn() -> usize + Send + Sync>) {
        *self.streams.lock().unwrap_or_else(|p| p.into_inner()) = Some(count);
    }

    /// The live replicas as of the last heartbeat (this one always among them).
    pub fn live(&self) -> Vec<Peer> {
        self.live.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The replica whose turn it is to answer `conversation`: with affinity, its owner among the
    /// live replicas that can be reached; without, or when no other one can be reached, this
    /// one.
    pub fn route(&self, conversation: Uuid) -> Peer {
        let here = Peer::of(&self.me);
        if !self.cfg.affinity || self.bus.is_none() {
            return here;
        }
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        let reachable: Vec<Peer> = live
            .iter()
            .filter(|p| p.id == self.me.id || !p.url.is_empty())
            .cloned()
            .collect();
        owner_of(&reachable, conversation).cloned().unwrap_or(here)
    }

    /// A new conversation id that this replica owns, so a conversation's first turns warm the
    /// cache where its later turns will be routed (a few tries: each live replica owns about
    /// one id in n).
    pub fn new_conversation_id(&self) -> Uuid {
        let mut id = Uuid::now_v7();
        if !self.cfg.affinity || self.bus.is_none() {
            return id;
        }
        for _ in 0..64 {
            if self.route(id).id == self.me.id {
                return id;
            }
            id = Uuid::now_v7();
        }
        id
    }

    /// Sends `body` about conversation `c` to the other replicas (nothing on SQLite).
    pub fn publish(&self, c: Uuid, body: WireBody) {
        let Some(bus) = &self.bus else {
            return;
        };
        let wire = Wire {
            c,
            from: self.me.id,
            body,
        };
        match serde_json::to_string(&wire) {
            Ok(payload) => bus.publish(sign_payload(&self.cfg.bus_key, &payload)),
            Err(e) => tracing::error!("cannot encode a cluster message: {e}"),
        }
    }

    /// Publishes an event of this replica's reply in conversation `c`, text split so that every
    /// message fits the bus.
    pub fn publish_reply(&self, c: Uuid, event: &ReplyEvent) {
        if self.bus.is_none() {
            return;
        }
        let pieces = |text: &str| -> Vec<String> {
            split_text(text, MAX_TEXT_BYTES)
                .into_iter()
                .map(str::to_string)
                .collect()
        };
        let events = match event.to_wire() {
            ReplyEvent::Reasoning { text } => pieces(&text)
                .into_iter()
                .map(|text| ReplyEvent::Reasoning { text })
                .collect(),
            ReplyEvent::Answer { text } => pieces(&text)
                .into_iter()
                .map(|text| ReplyEvent::Answer { text })
                .collect(),
            // An error is told in one message: its start says what happened.
            ReplyEvent::Error { message } => vec![ReplyEvent::Error {
                message: split_text(&message, MAX_TEXT_BYTES)
                    .first()
                    .map_or_else(String::new, |m| m.to_string()),
            }],
            other => vec![other],
        };
        for event in events {
            self.publish(c, WireBody::Reply { event });
        }
    }

    /// Replicas live or recently gone, for the admin page.
    pub async fn replicas(&self) -> Result<Vec<ReplicaRecord>, StoreError> {
        self.store.replicas(self.cfg.lease, SHOWN_AFTER_DEATH).await
    }

    async fn refresh_live(&self) {
        match self.store.live_replicas(self.cfg.lease).await {
            Ok(records) => {
                let mut peers: Vec<Peer> = records
                    .into_iter()
                    .map(|r| Peer {
                        id: r.id,
                        name: r.name,
                        url: r.url,
                    })
                    .collect();
                if !peers.iter().any(|p| p.id == self.me.id) {
                    // Our own heartbeat may not be committed yet; we are alive regardless.
                    peers.push(Peer::of(&self.me));
                }
                *self.live.write().unwrap_or_else(|p| p.into_inner()) = peers;
            }
            Err(e) => tracing::warn!("cannot read the live replicas: {e}"),
        }
    }

    async fn load(&self, scheduler: &Addr<SchedulerActor>) -> ReplicaLoad {
        let stats = scheduler.send(GetStats).await.unwrap_or_default();
        let caches = scheduler.send(GetCacheInfo).await.unwrap_or_default();
        let held: Vec<Uuid> = caches.iter().filter_map(|c| c.key.conversation()).collect();
        let streams = self
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |count| count());
        ReplicaLoad {
            queued: stats.queued,
            running: stats.running,
            tokens_per_s: stats.tokens_per_s,
            kv_bytes: stats.kv_bytes,
            kv_budget_bytes: stats.kv_budget_bytes,
            held_count: held.len(),
            held: held.into_iter().take(ReplicaLoad::MAX_HELD).collect(),
            streams,
        }
    }

    /// Starts the heartbeat (load, live list, sweep of dead replicas' replies) and, with a bus,
    /// the relay of other replicas' messages to the local sessions. Must run inside the actix
    /// system (the relay talks to actors).
    pub fn run(self: &Arc<Self>, scheduler: Addr<SchedulerActor>) {
        let this = Arc::clone(self);
        actix::spawn(async move {
            let mut tick = tokio::time::interval(this.cfg.heartbeat);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut load = ReplicaLoad::default();
            loop {
                tick.tick().await;
                // The load comes partly from the model thread, which may be in the middle of a
                // long step: it must never delay the heartbeat itself (a late heartbeat makes a
                // busy replica look dead), so a slow answer keeps the last load.
                if let Ok(fresh) =
                    tokio::time::timeout(this.cfg.heartbeat / 2, this.load(&scheduler)).await
                {
                    load = fresh;
                }
                match this.store.heartbeat(this.me.id, &load).await {
                    Ok(true) => {}
                    Ok(false) => tracing::error!(
                        replica = %this.me.id,
                        "this replica's row was taken over by a restart under the same name \
                         ({}); give each replica its own replica.name",
                        this.me.name
                    ),
                    Err(e) => tracing::warn!("heartbeat failed: {e}"),
                }
                match this.store.sweep_dead_replicas(this.cfg.lease).await {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::warn!(count = n, "replies of dead replicas marked interrupted")
                    }
                    Err(e) => tracing::warn!("sweeping dead replicas failed: {e}"),
                }
                this.refresh_live().await;
            }
        });
        let Some(bus) = &self.bus else {
            return;
        };
        let mut incoming = bus.subscribe();
        let this = Arc::clone(self);
        actix::spawn(async move {
            loop {
                let payload = match incoming.recv().await {
                    Ok(p) => p,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "the relay fell behind the cluster bus");
                        continue;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                };
                let Some(payload) = verify_payload(&this.cfg.bus_key, &payload) else {
                    tracing::warn!("a cluster message without a valid signature was ignored (another replica with a different server.cookie_secret, or someone else on the channel)");
                    metrics::counter!("smolchat_bus_forgeries_total").increment(1);
                    continue;
                };
                let wire: Wire = match serde_json::from_str(payload) {
                    Ok(w) => w,
                    Err(e) => {
                        tracing::warn!("an unreadable cluster message was ignored: {e}");
                        continue;
                    }
                };
                if wire.from == this.me.id {
                    continue;
                }
                this.deliver(wire);
            }
        });
    }

    /// Hands an incoming message to the inbox, if one is attached.
    fn deliver(&self, wire: Wire) {
        if let Some(inbox) = self
            .inbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            // A closed inbox means the registry is gone (shutting down): nobody to tell.
            let _ = inbox.send(wire);
        }
    }

    /// Marks this replica stopped (clean shutdown).
    pub async fn leave(&self) {
        if let Err(e) = self.store.stop_replica(self.me.id).await {
            tracing::warn!("cannot mark this replica stopped: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(names: &[&str]) -> Vec<Peer> {
        names
            .iter()
            .map(|n| Peer {
                id: Uuid::now_v7(),
                name: n.to_string(),
                url: format!("http://{n}"),
            })
            .collect()
    }

    #[test]
    fn owners_spread_and_removing_a_replica_moves_only_its_conversations() {
        let three = peers(&["a", "b", "c"]);
        let ids: Vec<Uuid> = (0..3000).map(|_| Uuid::now_v7()).collect();
        let mut counts = std::collections::HashMap::new();
        for id in &ids {
            *counts
                .entry(owner_of(&three, *id).map(|p| p.name.clone()))
                .or_insert(0) += 1;
        }
        for name in ["a", "b", "c"] {
            let n = counts.get(&Some(name.to_string())).copied().unwrap_or(0);
            assert!((800..1200).contains(&n), "{name} owns {n} of 3000");
        }
        let two: Vec<Peer> = three.iter().filter(|p| p.name != "b").cloned().collect();
        for id in &ids {
            let before = owner_of(&three, *id).map(|p| p.name.clone());
            let after = owner_of(&two, *id).map(|p| p.name.clone());
            if before.as_deref() != Some("b") {
                assert_eq!(before, after, "a conversation not on b moved");
            }
        }
        assert!(owner_of(&[], Uuid::now_v7()).is_none());
    }

    #[test]
    fn the_owner_depends_on_names_not_on_ids_or_order() {
        let a = peers(&["x", "y", "z"]);
        let mut b = peers(&["z", "x", "y"]);
        b.reverse();
        for _ in 0..200 {
            let id = Uuid::now_v7();
            assert_eq!(
                owner_of(&a, id).map(|p| &p.name),
                owner_of(&b, id).map(|p| &p.name)
            );
        }
    }

    #[test]
    fn text_splits_on_character_boundaries_within_the_limit() {
        let text = "héllo wörld ✓ ".repeat(300);
        let pieces = split_text(&text, 100);
        assert!(pieces.iter().all(|p| p.len() <= 100));
        assert_eq!(pieces.concat(), text);
        assert_eq!(split_text("", 10), vec![""]);
        assert_eq!(split_text("✓✓", 1), vec!["✓", "✓"]);
    }

    #[test]
    fn wire_messages_round_trip_and_fit_the_bus() {
        let c = Uuid::now_v7();
        let from = Uuid::now_v7();
        let text = "\"\\\u{1}".repeat(MAX_TEXT_BYTES / 3);
        for piece in split_text(&text, MAX_TEXT_BYTES) {
            let wire = Wire {
                c,
                from,
                body: WireBody::Reply {
                    event: ReplyEvent::Answer {
                        text: piece.to_string(),
                    },
                },
            };
            let json = sign_payload(b"key", &serde_json::to_string(&wire).unwrap());
            assert!(
                json.len() <= smolchat_store::BUS_MAX_PAYLOAD,
                "{}",
                json.len()
            );
            let payload = verify_payload(b"key", &json).unwrap();
            assert_eq!(serde_json::from_str::<Wire>(payload).unwrap(), wire);
        }
    }

    #[test]
    fn bus_messages_need_the_shared_key() {
        let signed = sign_payload(b"the shared secret", r#"{"c":"x"}"#);
        assert_eq!(
            verify_payload(b"the shared secret", &signed),
            Some(r#"{"c":"x"}"#)
        );
        assert_eq!(verify_payload(b"another secret", &signed), None);
        // Unsigned, or signed and then changed.
        assert_eq!(verify_payload(b"the shared secret", r#"{"c":"x"}"#), None);
        let changed = signed.replace(r#""x""#, r#""y""#);
        assert_eq!(verify_payload(b"the shared secret", &changed), None);
    }
}

#[cfg(test)]
mod wire_tests {
    use super::*;

    #[test]
    fn control_messages_are_small_and_tagged() {
        let wire = Wire {
            c: Uuid::nil(),
            from: Uuid::max(),
            body: WireBody::Sync,
        };
        let json = serde_json::to_string(&wire).unwrap();
        assert!(json.contains("\"k\":\"sync\""), "{json}");
        assert_eq!(serde_json::from_str::<Wire>(&json).unwrap(), wire);
    }
}
