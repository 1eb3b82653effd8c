//! The creation limits: how many conversations an owner keeps and creates a minute (per owner
//! and, for guests, per client address; in memory here and counted across replicas in the store),
//! and the keys they count by.

use super::*;

/// The window `conversations_per_minute` counts over.
pub(super) const CREATION_WINDOW: Duration = Duration::from_secs(60);

/// Owners and addresses the creation limiter remembers at most (bounded memory under a flood
/// of made-up owners); beyond it, keys with nothing in the window are forgotten first.
pub(super) const CREATION_KEYS: usize = 100_000;

/// A client address as a limit key: the address's scope as the sign-in throttle counts it (an
/// IPv4-mapped IPv6 address is its IPv4 address, other IPv6 addresses their /64, which one host
/// usually holds whole).
pub(super) fn address_key(ip: IpAddr) -> String {
    match smolchat_auth::throttle::address_scope(ip) {
        IpAddr::V4(v4) => format!("addr:{v4}"),
        IpAddr::V6(prefix) => format!("addr:{prefix}/64"),
    }
}

impl Conversations {
    /// Whether the caller may add one more conversation now: the stored total, then the rate
    /// (per owner, and per address for guests). Taking a place in the rate happens here, so
    /// parallel requests cannot all slip through.
    pub(super) async fn admit_new_conversation(&self, caller: &Caller) -> Result<()> {
        let max = self.cfg.max_conversations_per_user;
        if max > 0 {
            let n = self.store.count_conversations(&caller.owner).await?;
            if n >= 0 && n as u64 >= max {
                return Err(ConversationError::UserLimit {
                    message: format!(
                        "you have {n} conversations, the most one user may keep ({max}); delete \
                         some to start new ones"
                    ),
                    retry_after_s: 60,
                });
            }
        }
        let per_minute = self.cfg.conversations_per_minute;
        if per_minute > 0 {
            let keys = self.limit_keys(caller);
            let taken = self
                .creations
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(&keys, 1, u64::from(per_minute), Instant::now());
            if let Err(wait) = taken {
                return Err(ConversationError::UserLimit {
                    message: format!(
                        "{} created {per_minute} conversations in the last minute, the \
                         limit; retry in {wait} s",
                        Self::who(caller)
                    ),
                    retry_after_s: wait,
                });
            }
            // The same limit over every replica on this database: counted atomically there,
            // per UTC minute. A store that cannot count lets the creation through (logged).
            let now = chrono::Utc::now();
            for key in &keys {
                match self.store.count_event(&format!("conv:{key}"), now).await {
                    Ok(n) if n > i64::from(per_minute) => {
                        let wait = u64::try_from(
                            (smolchat_store::Period::Minute.end(now) - now).num_seconds(),
                        )
                        .unwrap_or(60)
                        .max(1);
                        return Err(ConversationError::UserLimit {
                            message: format!(
                                "{} created {per_minute} conversations this minute on all \
                                 replicas together (limits.conversations_per_minute); retry in \
                                 {wait} s",
                                Self::who(caller)
                            ),
                            retry_after_s: wait,
                        });
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("cannot count a conversation across replicas: {e}"),
                }
            }
        }
        Ok(())
    }

    /// The keys a caller's rates count against: the owner, and for guests (whose owner ids
    /// cost nothing to mint) also the client address.
    pub(super) fn limit_keys(&self, caller: &Caller) -> Vec<String> {
        let mut keys = vec![format!("owner:{}", caller.owner)];
        if caller.guest {
            if let Some(ip) = caller.address {
                keys.push(address_key(ip));
            }
        }
        keys
    }

    pub(super) fn who(caller: &Caller) -> &'static str {
        if caller.guest {
            "you (or other guests from your address)"
        } else {
            "you"
        }
    }
}
