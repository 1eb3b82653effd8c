//! The memory layouts the fast tier's kernels and their Rust twins share, byte for byte: the
//! Q8_1 activation blocks the quantized matmuls read, the KV page arena, and the per-step tables
//! (tokens, positions, slot mapping, sequences, block tables) a step uploads.
//!
//! Everything here is plain data with `#[repr(C)]` where a kernel reads it, so a buffer written
//! by a twin on the CPU is exactly what the CUDA kernel would read or write.

use half::f16;

use crate::fast::twin::sample::SampleRow;

use crate::kv::BLOCK_POSITIONS;

/// Values per Q8_1 block (ggml's `QK8_1`).
pub const QK8_1: usize = 32;

/// ggml's `block_q8_1`: 32 signed bytes with `d` (the scale, `amax / 127`) and `s` (the sum of
/// the 32 original values), both f16. 36 bytes; a row of `k` values (a multiple of 32 after
/// padding) is `k / 32` consecutive blocks.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK8_1],
}

/// Bytes of one [`BlockQ8_1`].
pub const BLOCK_Q8_1_BYTES: usize = 36;

const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == BLOCK_Q8_1_BYTES);

/// Rows of a weight matrix are padded to a multiple of this many values when uploaded, and Q8_1
/// activation rows to the same, as llama.cpp's CUDA backend does (`MATRIX_ROW_PADDING`), so the
/// matmul kernels never read past a row.
pub const MATRIX_ROW_PADDING: usize = 512;

/// `k` rounded up to [`MATRIX_ROW_PADDING`].
pub fn padded_columns(k: usize) -> usize {
    k.div_ceil(MATRIX_ROW_PADDING) * MATRIX_ROW_PADDING
}

/// The KV page arena of the fast tier: one buffer of f16, indexed by the engine's block ids.
///
/// `[block][layer][K, V][kv head][16 positions][head dim]`: a block's pages for all layers are
/// contiguous (a block is allocated and freed as one), and within a page one position's
/// `head_dim` values are contiguous, so writing a new row is `head_dim` consecutive f16 per (layer,
/// K/V, head), and decode attention reads a head's 16 keys of a block as one `16 × head_dim` tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvArena {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvArena {
    /// f16 values of one (layer, K or V, head) page: 16 positions × head dim.
    pub fn page_values(&self) -> usize {
        BLOCK_POSITIONS * self.head_dim
    }

    /// f16 values of one block (every layer, K and V, every head).
    pub fn block_values(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.page_values()
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_values() * std::mem::size_of::<f16>()
    }

    /// Index (in f16 values) of `(block, layer, kind, head, position in block, dim 0)`; `kind` is
    /// 0 for K, 1 for V.
    pub fn index(&self, block: u32, layer: usize, kind: usize, head: usize, slot: usize) -> usize {
        let page = ((block as usize * self.layers + layer) * 2 + kind) * self.kv_heads + head;
        page * self.page_values() + slot * self.head_dim
    }
}

/// The slot of a sequence's `position` in the arena: `block × 16 + position % 16`, with `block`
/// from the sequence's block table. Kernels receive slots, never positions, for writes.
pub fn slot_of(blocks: &[u32], position: usize) -> u32 {
    blocks[position / BLOCK_POSITIONS] * BLOCK_POSITIONS as u32
        + (position % BLOCK_POSITIONS) as u32
}

/// One sequence of a step, as the attention kernels see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct SeqInfo {
    /// The step's first row of this sequence.
    pub row0: u32,
    /// New rows (tokens) of this sequence in the step.
    pub rows: u32,
    /// Positions cached before the step.
    pub past: u32,
    /// Its block table is row `index` of the step's block tables.
    pub index: u32,
}

/// What one step uploads before its operations run: every array a kernel indexes, flat and
/// padded so shapes stay fixed for a batch size (CUDA graphs replay on static buffers).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTables {
    /// The step's tokens, row by row (sequences concatenated).
    pub tokens: Vec<u32>,
    /// Each row's position in its sequence.
    pub positions: Vec<u32>,
    /// Each row's arena slot (where its K/V go).
    pub slots: Vec<u32>,
    /// Each row's sequence (index into `seqs`).
    pub row_seq: Vec<u32>,
    pub seqs: Vec<SeqInfo>,
    /// `seqs.len() × max_blocks` block ids, each sequence's table padded with its last id.
    pub block_tables: Vec<u32>,
    /// Blocks per row of `block_tables`.
    pub max_blocks: usize,
    /// Rows whose logits are wanted, in output order.
    pub logit_rows: Vec<u32>,
    /// Whether some logit row is drawn on the device ([`crate::LogitsMode::Sample`]): the plan
    /// then ends with the penalties and the draw.
    pub sample: bool,
    /// Whether the logit rows want their final hidden state instead of logits
    /// ([`crate::LogitsMode::Hidden`]): the plan then stops at the output norm.
    pub hidden: bool,
    /// Per logit row: how it is drawn (greedy for rows nobody draws).
    pub sampling: Vec<SampleRow>,
    /// Per logit row: `[start, end)` of its penalty entries (two values per row).
    pub penalty_spans: Vec<u32>,
    /// Penalty entries, `[token, occurrences]` each, flat.
    pub penalties: Vec<u32>,
}

/// The `SampleRow`s as the kernels read them: `#[repr(C)]` little-endian, 40 bytes each.
pub fn sample_rows_bytes(rows: &[SampleRow]) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of_val(rows));
    for r in rows {
        for v in [
            r.temperature,
            r.inv_temperature,
            f32::from_bits(r.top_k),
            r.top_p,
            r.min_p,
            r.repetition_penalty,
            r.presence_penalty,
            r.frequency_penalty,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&r.uniform.to_le_bytes());
    }
    out
}

impl StepTables {
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Sequence `s`'s block table (padded to `max_blocks`).
    pub fn blocks_of(&self, s: usize) -> &[u32] {
        &self.block_tables[s * self.max_blocks..(s + 1) * self.max_blocks]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_pages_do_not_overlap_and_a_block_is_contiguous() {
        let a = KvArena {
            layers: 3,
            kv_heads: 2,
            head_dim: 8,
        };
        let mut seen = std::collections::HashSet::new();
        for block in 0..4u32 {
            for layer in 0..3 {
                for kind in 0..2 {
                    for head in 0..2 {
                        for slot in 0..BLOCK_POSITIONS {
                            let i = a.index(block, layer, kind, head, slot);
                            assert!(seen.insert(i), "{block} {layer} {kind} {head} {slot}");
                            assert_eq!(i % a.head_dim, 0);
                            let base = block as usize * a.block_values();
                            assert!((base..base + a.block_values()).contains(&i));
                        }
                    }
                }
            }
        }
        assert_eq!(seen.len(), 4 * a.block_values() / a.head_dim);
    }

    #[test]
    fn sample_rows_serialize_as_their_memory_layout() {
        let row = SampleRow {
            temperature: 0.7,
            inv_temperature: 1.0 / 0.7,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: 0.25,
            frequency_penalty: -0.5,
            uniform: 0.123_456_789,
        };
        let bytes = sample_rows_bytes(&[row, SampleRow::GREEDY]);
        assert_eq!(bytes.len(), 2 * std::mem::size_of::<SampleRow>());
        // SAFETY: SampleRow is #[repr(C)] plain old data without padding (40 bytes, checked at
        // compile time); reading its bytes is what the kernel does.
        let memory =
            unsafe { std::slice::from_raw_parts((&row as *const SampleRow).cast::<u8>(), 40) };
        assert_eq!(&bytes[..40], memory);
        assert_eq!(&bytes[8..12], &40u32.to_le_bytes());
    }

    #[test]
    fn slots_follow_the_block_table() {
        let table = [7u32, 2, 9];
        assert_eq!(slot_of(&table, 0), 7 * 16);
        assert_eq!(slot_of(&table, 15), 7 * 16 + 15);
        assert_eq!(slot_of(&table, 16), 2 * 16);
        assert_eq!(slot_of(&table, 40), 9 * 16 + 8);
        assert_eq!(padded_columns(576), 1024);
        assert_eq!(padded_columns(2048), 2048);
    }
}
