//! Per-sequence KV caches.
//!
//! Layout: for every layer and KV head, one contiguous `[position][head_dim]` f32 buffer for K and
//! one for V. A head's keys are therefore scanned contiguously by attention, grouped-query heads
//! share them without copies, and appending a token is an amortised O(1) `Vec` push. Memory is
//! accounted from the buffers' real capacities, so the scheduler's budget matches what is held.

/// K and V of one layer: `k[kv_head]` is `[len * head_dim]`.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

#[derive(Debug, Clone)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    /// The tokens whose K/V are held, in order; `tokens.len()` is the next position.
    tokens: Vec<u32>,
    head_dim: usize,
}

impl KvCache {
    pub fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            layers: (0..n_layers)
                .map(|_| LayerCache {
                    k: vec![Vec::new(); n_kv_heads],
                    v: vec![Vec::new(); n_kv_heads],
                })
                .collect(),
            tokens: Vec::new(),
            head_dim,
        }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The cached token ids, position by position.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes of K/V data in use (positions held).
    pub fn used_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.k.iter().chain(l.v.iter()))
            .map(|b| b.len() * std::mem::size_of::<f32>())
            .sum()
    }

    /// Bytes allocated for K/V data (capacity, which is what the process holds).
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.k.iter().chain(l.v.iter()))
            .map(|b| b.capacity() * std::mem::size_of::<f32>())
            .sum::<usize>()
            + self.tokens.capacity() * std::mem::size_of::<u32>()
    }

    /// Keeps the first `len` positions and drops the rest (a re-rendered prompt diverged there).
    /// Memory is kept for reuse; `shrink` returns it.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.tokens.len() {
            return;
        }
        self.tokens.truncate(len);
        for l in &mut self.layers {
            for b in l.k.iter_mut().chain(l.v.iter_mut()) {
                b.truncate(len * self.head_dim);
            }
        }
    }

    /// Releases capacity beyond what the held positions need.
    pub fn shrink(&mut self) {
        self.tokens.shrink_to_fit();
        for l in &mut self.layers {
            for b in l.k.iter_mut().chain(l.v.iter_mut()) {
                b.shrink_to_fit();
            }
        }
    }

    /// Reserves room for `extra` more positions in every buffer, growing geometrically so appends
    /// stay amortised O(1).
    pub(crate) fn reserve(&mut self, extra: usize) {
        let need = (self.tokens.len() + extra) * self.head_dim;
        for l in &mut self.layers {
            for b in l.k.iter_mut().chain(l.v.iter_mut()) {
                if b.capacity() < need {
                    let target = need.max(b.capacity() * 2).max(64 * self.head_dim);
                    b.reserve_exact(target - b.len());
                }
            }
        }
        self.tokens.reserve(extra);
    }

    /// Records that `tokens` were appended to every layer (called once per step, after all layers).
    pub(crate) fn commit_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Length of the longest common prefix of the cached tokens and `tokens`.
    pub fn common_prefix(&self, tokens: &[u32]) -> usize {
        self.tokens
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
    }
}
