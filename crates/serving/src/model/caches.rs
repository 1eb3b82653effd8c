//! The cache registry: which KV sequences are kept after their request (a conversation's, and
//! up to [`MAX_ANONYMOUS_CACHES`] stateless prompts' per salt), which prefix a new request can
//! fork from, and the room they leave (evicting idle caches when a step needs blocks).

use super::*;

/// What [`ModelWorker::prefix_donor`] found.
pub(super) enum PrefixDonor {
    /// Fork `positions` positions of `seq`.
    Ready { seq: SeqId, positions: usize },
    /// Wait: the shared prefix is being computed.
    Computing,
}

/// At most this many stateless caches are kept.
pub(super) const MAX_ANONYMOUS_CACHES: usize = 16;

pub(super) struct CacheSlot {
    pub(super) seq: SeqId,
    pub(super) last_used: Instant,
    /// Whether the spill tier holds this cache as it is now (written while it was idle).
    pub(super) spilled: bool,
    /// Speculative decoding's counts for this cache's conversation (see [`CacheEntryInfo`]).
    pub(super) drafted: u64,
    pub(super) accepted: u64,
    pub(super) verify_steps: u64,
    /// Leading positions read back from the spill tier and not yet counted in a reply's
    /// `restored_tokens`.
    pub(super) restored: usize,
    /// Where the positions a typed draft computed begin (not yet counted in a reply's
    /// `warmed_tokens`), if a draft computed any.
    pub(super) warm_from: Option<usize>,
}

impl CacheSlot {
    /// A slot for `seq`, used now.
    pub(super) fn new(seq: SeqId, now: Instant) -> Self {
        Self {
            seq,
            last_used: now,
            spilled: false,
            drafted: 0,
            accepted: 0,
            verify_steps: 0,
            restored: 0,
            warm_from: None,
        }
    }
}

impl ModelWorker {
    /// Whether a running request uses the cache `key` (only conversations' caches are kept in
    /// the map while in use; an anonymous one is taken out while its request runs).
    pub(super) fn busy(&self, key: &CacheKey) -> bool {
        let Some(conversation) = key.conversation() else {
            return false;
        };
        self.active
            .values()
            .any(|a| a.keyed && a.request.cache_key == Some(conversation))
    }

    /// Drops a conversation's cache now, or when its running request ends. Returns whether a
    /// cache was (or will be) dropped.
    pub(super) fn forget_conversation(&mut self, conversation: Uuid) -> bool {
        let key = CacheKey::Conversation(conversation);
        let spilled = self
            .spill
            .as_ref()
            .is_some_and(|t| t.contains(conversation));
        if let Some(tier) = self.spill.as_mut() {
            tier.remove(conversation);
        }
        if self.busy(&key) {
            if !self.doomed.contains(&conversation) {
                self.doomed.push(conversation);
            }
            return true;
        }
        self.evict_key(&key) || spilled
    }

    /// Writes a conversation's idle cache to the spill tier, unless it holds it as it is.
    pub(super) fn spill_cache(&mut self, key: &CacheKey) {
        let Some(conversation) = key.conversation().filter(|_| self.spill.is_some()) else {
            return;
        };
        if self.caches.get(key).is_none_or(|s| s.spilled) {
            return;
        }
        // A step launched ahead must finish before blocks are copied out (its rows are voided:
        // the next plan runs them again).
        if self.engine.in_flight() {
            self.settle_ahead();
        }
        let (Some(tier), Some(slot)) = (self.spill.as_mut(), self.caches.get_mut(key)) else {
            return;
        };
        let started = Instant::now();
        let written = self
            .engine
            .save_kv(slot.seq)
            .map_err(|e| e.to_string())
            .and_then(|snapshot| tier.put(conversation, snapshot).map_err(|e| e.to_string()));
        match written {
            Ok(()) => {
                // Copied out here; compressed and written on the tier's own thread.
                slot.spilled = true;
                metrics::histogram!("smolchat_kv_spill_save_seconds")
                    .record(started.elapsed().as_secs_f64());
            }
            Err(e) => {
                tracing::warn!(%conversation, "writing a KV cache to the spill tier failed: {e}")
            }
        }
    }

    /// A returning conversation's cache read back from the spill tier into a new sequence,
    /// when the tier holds one that this engine can restore (see [`crate::spill`]).
    pub(super) fn restore_spilled(&mut self, conversation: Uuid) -> Option<SeqId> {
        let tier = self.spill.as_mut()?;
        let started = Instant::now();
        let snapshot = match tier.take(conversation) {
            Ok(Some(s)) => s,
            Ok(None) => {
                tier.misses += 1;
                metrics::counter!("smolchat_kv_spill_misses_total").increment(1);
                return None;
            }
            Err(e) => {
                tier.rejected += 1;
                metrics::counter!("smolchat_kv_spill_rejected_total").increment(1);
                tracing::warn!(%conversation, "a spilled KV cache is not used (it is computed again): {e}");
                return None;
            }
        };
        // Room for it: idle caches go (to the tier themselves) first.
        let blocks = snapshot.bytes.len() / self.engine.kv_block_bytes().max(1);
        if !self.make_room(blocks) {
            return None;
        }
        match self.engine.restore_kv(&snapshot) {
            Ok(seq) => {
                if let Some(tier) = self.spill.as_mut() {
                    tier.restore_micros += started.elapsed().as_micros() as u64;
                }
                metrics::counter!("smolchat_kv_spill_restores_total").increment(1);
                metrics::histogram!("smolchat_kv_spill_restore_seconds")
                    .record(started.elapsed().as_secs_f64());
                Some(seq)
            }
            Err(e) => {
                tracing::warn!(%conversation, "a spilled KV cache could not be restored (it is computed again): {e}");
                None
            }
        }
    }

    /// Writes every conversation cache idle for `after` or longer to the spill tier (once per
    /// idle spell), so a restart finds it.
    pub(super) fn spill_idle(&mut self, after: std::time::Duration) {
        if self.spill.is_none() {
            return;
        }
        let idle: Vec<CacheKey> = self
            .caches
            .iter()
            .filter(|(k, s)| {
                k.conversation().is_some()
                    && !s.spilled
                    && s.last_used.elapsed() >= after
                    && !self.busy(k)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.spill_cache(&k);
        }
    }

    /// Drops an idle conversation's cache from memory, written to the spill tier first (when
    /// there is one); whether it had one.
    pub(super) fn evict_to_disk(&mut self, conversation: Uuid) -> bool {
        let key = CacheKey::Conversation(conversation);
        if self.busy(&key) {
            return false;
        }
        self.spill_cache(&key);
        self.evict_key(&key)
    }

    pub(super) fn evict_key(&mut self, key: &CacheKey) -> bool {
        if self.busy(key) {
            return false;
        }
        match self.caches.remove(key) {
            Some(slot) => {
                self.engine.free_sequence(slot.seq);
                self.evictions += 1;
                true
            }
            None => false,
        }
    }

    /// Evicts least-recently-used idle caches until `blocks` more KV blocks are free in the
    /// engine's allocator (the one KV budget). Returns whether they fit.
    pub(super) fn make_room(&mut self, blocks: usize) -> bool {
        loop {
            if self.engine.kv_free_blocks() >= blocks {
                return true;
            }
            let victim = self
                .caches
                .iter()
                .filter(|(k, _)| !self.busy(k))
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| k.clone());
            match victim {
                Some(k) => {
                    tracing::debug!(cache_key = %k, "evicting idle KV cache");
                    self.spill_cache(&k);
                    self.evict_key(&k);
                }
                None => return false,
            }
        }
    }

    /// A sequence for a request without a cache key: the kept anonymous cache sharing the longest
    /// prefix with its prompt (a stateless API client resending its conversation), or a new one.
    pub(super) fn adopt_anonymous(&mut self, id: RequestId) -> SeqId {
        let Some(request) = self.active.get(&id).map(|a| &a.request) else {
            return self.engine.create_sequence();
        };
        let prompt = &request.prompt;
        // Only caches of the same partition: reuse across clients would let one probe another's
        // prompts through `cached_tokens` and timing.
        let partition = request.cache_salt.as_deref().unwrap_or("");
        let best = self
            .caches
            .iter()
            .filter(
                |(k, _)| matches!(k, CacheKey::Anonymous { partition: p, .. } if p == partition),
            )
            .map(|(k, slot)| {
                let shared = self.engine.common_prefix(slot.seq, prompt).unwrap_or(0);
                (shared, k.clone())
            })
            .filter(|(shared, _)| *shared > 0)
            .max_by_key(|(shared, _)| *shared);
        match best.and_then(|(_, k)| self.caches.remove(&k)) {
            Some(slot) => slot.seq,
            None => self.engine.create_sequence(),
        }
    }

    /// Keeps a finished anonymous sequence for reuse (bounded; oldest dropped first).
    pub(super) fn keep_anonymous(&mut self, seq: SeqId, salt: Option<&str>, now: Instant) {
        let anonymous: Vec<(CacheKey, Instant)> = self
            .caches
            .iter()
            .filter(|(k, _)| matches!(k, CacheKey::Anonymous { .. }))
            .map(|(k, s)| (k.clone(), s.last_used))
            .collect();
        if anonymous.len() >= MAX_ANONYMOUS_CACHES {
            if let Some((oldest, _)) = anonymous.iter().min_by_key(|(_, t)| *t) {
                self.evict_key(oldest);
            }
        }
        self.caches.insert(
            CacheKey::Anonymous {
                partition: salt.unwrap_or("").to_string(),
                seq,
            },
            CacheSlot::new(seq, now),
        );
    }

    /// Another running request of the same cache partition whose prompt shares at least one
    /// whole KV block with this request's and more than any idle cache does (the `n` choices of
    /// one prompt, a client resending a conversation while its last turn runs): its blocks are
    /// forked rather than computed again once it has computed them.
    pub(super) fn prefix_donor(&self, id: RequestId) -> Option<PrefixDonor> {
        let a = self.active.get(&id)?;
        if a.pool.is_some() {
            return None;
        }
        let prompt = &a.request.prompt;
        // The last prompt token is always computed (its logits are needed).
        let usable = prompt.len().saturating_sub(1);
        let whole = |n: usize| n.min(usable) / BLOCK_POSITIONS * BLOCK_POSITIONS;
        let idle = self
            .caches
            .iter()
            .filter(|(k, _)| {
                matches!(k, CacheKey::Anonymous { partition, .. }
                    if Some(partition.as_str()) == a.request.cache_salt.as_deref())
            })
            .map(|(_, slot)| self.engine.common_prefix(slot.seq, prompt).unwrap_or(0))
            .max()
            .unwrap_or(0);
        let (seq, will, now) = self
            .active
            .iter()
            .filter(|(other, b)| {
                **other != id
                    && b.pool.is_none()
                    && b.request.cache_salt.is_some()
                    && b.request.cache_salt == a.request.cache_salt
            })
            .filter_map(|(_, b)| {
                let seq = b.seq?;
                let will = whole(
                    b.request
                        .prompt
                        .iter()
                        .zip(prompt)
                        .take_while(|(x, y)| x == y)
                        .count(),
                );
                let now = whole(self.engine.common_prefix(seq, prompt).unwrap_or(0));
                Some((seq, will, now))
            })
            .max_by_key(|&(_, will, now)| (will, now))?;
        if will == 0 || will <= idle {
            return None;
        }
        Some(if now >= will {
            PrefixDonor::Ready {
                seq,
                positions: now,
            }
        } else {
            PrefixDonor::Computing
        })
    }

    /// KV positions the budget holds in all (the allocator's blocks).
    pub(super) fn kv_capacity_tokens(&self) -> usize {
        self.kv_capacity_blocks() * BLOCK_POSITIONS
    }

    pub(super) fn kv_capacity_blocks(&self) -> usize {
        self.engine.kv_capacity_blocks()
    }

    /// Blocks new work could have: those not held (within the budget), plus those held by idle
    /// caches, which [`ModelWorker::make_room`] would evict.
    pub(super) fn kv_free_for_new_work(&self) -> usize {
        let held = self.engine.total_kv_bytes() / self.engine.kv_block_bytes().max(1);
        let free = self
            .kv_capacity_blocks()
            .saturating_sub(held)
            .min(self.engine.kv_free_blocks());
        let idle: usize = self
            .caches
            .iter()
            .filter(|(k, _)| !self.busy(k))
            .map(|(_, slot)| {
                self.engine.kv_bytes(slot.seq).unwrap_or(0) / self.engine.kv_block_bytes().max(1)
            })
            .sum();
        free + idle
    }
}
