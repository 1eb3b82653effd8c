//! The paged KV cache: one block allocator, one storage per backend.
//!
//! - [`block`] is backend-neutral bookkeeping: a fixed block size in positions
//!   ([`BLOCK_POSITIONS`]), a capacity in blocks derived from a byte budget, a free list, and a
//!   [`BlockTable`] per sequence mapping its positions to block ids. It knows nothing of where the
//!   pages live, so a CUDA storage (pages in one VRAM arena indexed by block id) reuses it as is:
//!   only the storage and the attention kernels that read it differ ("one allocator, two
//!   storages").
//! - `crate::cpu::kv` is the CPU storage: the K/V pages of each block id in host memory, in the
//!   element type chosen by [`KvType`] (f32, f16, or ggml's q8_0 blocks), written row by row
//!   after the K/V projections and read tile by tile by the CPU attention.
//!
//! A block holds [`BLOCK_POSITIONS`] consecutive positions of one sequence for every layer and KV
//! head, so a sequence needs one block id per 16 positions whatever the model depth, and a block's
//! byte size is `16 × (bytes per position)`. Accounting is exact: bytes in use are blocks held ×
//! bytes per block; the budget is a number of blocks, so running out is an ordinary error
//! ([`crate::EngineError::KvCacheFull`]) that callers answer by evicting or refusing.

pub mod block;

pub use block::{BlockAllocator, BlockId, BlockTable, BLOCK_POSITIONS};

use std::fmt;
use std::str::FromStr;

use super::config::ModelConfig;

/// Element type of the stored K/V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvType {
    F32,
    /// IEEE half precision (what llama.cpp stores by default).
    #[default]
    F16,
    /// ggml's Q8_0: blocks of 32 values as one f16 scale and 32 signed bytes (34 bytes per 32
    /// values, 8.5 bits each). Needs a head dimension that is a multiple of 32.
    Q8_0,
}

/// Values per q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per q8_0 block: an f16 scale and 32 `i8`.
pub const Q8_0_BYTES: usize = 34;

impl KvType {
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    /// Bytes one stored row of `head_dim` values takes.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvType::F32 => head_dim * 4,
            KvType::F16 => head_dim * 2,
            KvType::Q8_0 => head_dim / Q8_0_BLOCK * Q8_0_BYTES,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            "q8_0" | "q8" => Ok(KvType::Q8_0),
            other => Err(format!(
                "KV cache type `{other}` is not one of f32, f16, q8_0"
            )),
        }
    }
}

crate::serde_via_str!(KvType);

/// How an engine stores its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvOptions {
    pub kv_type: KvType,
    /// The most bytes the cache may hold, rounded down to whole blocks; `None`: what the backend
    /// suggests for its device (2 GiB on the CPU, the GPU's free memory after the weights).
    pub budget_bytes: Option<usize>,
}

/// The shape of one block's pages: which bytes of a block belong to which (layer, KV head, K/V).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub kv_type: KvType,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    pub fn new(config: &ModelConfig, kv_type: KvType) -> Self {
        Self {
            kv_type,
            n_layers: config.n_layers,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
        }
    }

    /// Whether rows of this shape can be stored as `kv_type` (q8_0 needs whole blocks of 32).
    pub fn check(&self) -> Result<(), String> {
        if self.kv_type == KvType::Q8_0 && !self.head_dim.is_multiple_of(Q8_0_BLOCK) {
            return Err(format!(
                "KV cache type q8_0 needs a head dimension that is a multiple of {Q8_0_BLOCK}, this model's is {}; use f16",
                self.head_dim
            ));
        }
        Ok(())
    }

    /// Bytes of K and V for one position across every layer and KV head.
    pub fn bytes_per_position(&self) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.kv_type.row_bytes(self.head_dim)
    }

    /// Bytes of one block (all its positions, layers, heads, K and V).
    pub fn bytes_per_block(&self) -> usize {
        BLOCK_POSITIONS * self.bytes_per_position()
    }

    /// Pages (one per layer, KV head and K/V) in a block.
    pub fn pages_per_block(&self) -> usize {
        2 * self.n_layers * self.n_kv_heads
    }

    /// Index of the page of (`layer`, `head`, K or V) inside a block.
    #[inline]
    pub fn page(&self, layer: usize, head: usize, kind: KvKind) -> usize {
        (layer * self.n_kv_heads + head) * 2 + kind as usize
    }
}

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    K = 0,
    V = 1,
}
