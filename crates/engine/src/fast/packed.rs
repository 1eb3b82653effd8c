//! A step's tables packed into one buffer, so the CUDA runner uploads them in one copy from
//! pinned memory instead of eleven from pageable memory (the RoPE rows, two of the eleven, are
//! not uploaded at all: the runner holds every position's row, [`crate::rope::RopeCache`]) (each a driver call, and each a moment
//! the GPU waits for between two steps launched back to back). Every table has a region at a
//! fixed offset, sized ahead ([`PackedLayout::grown`]): a replayed decode graph reads the tables
//! at the addresses it was captured with, so the offsets move only when a region must grow (the
//! runner then counts a new generation, and the graphs are captured again).
//!
//! Plain Rust over bytes, so the packing is tested on machines without a GPU.

use super::layout::{sample_rows_bytes, StepTables};

/// The tables of a step, in the order they lie in the buffer: what every step has first, the
/// penalty entries (long, and only for steps that draw with penalties) last, so that a step's
/// copy ends early when it has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    Tokens,
    /// Each row's position (the kernels find its RoPE row in the runner's whole table).
    Positions,
    Slots,
    RowSeq,
    /// `[row0, rows, past, index]` per sequence.
    Seqs,
    LogitRows,
    BlockTables,
    /// `SampleRow`s as the kernels read them ([`sample_rows_bytes`]).
    Sampling,
    PenaltySpans,
    Penalties,
}

pub const REGIONS: [Region; 10] = [
    Region::Tokens,
    Region::Positions,
    Region::Slots,
    Region::RowSeq,
    Region::Seqs,
    Region::LogitRows,
    Region::BlockTables,
    Region::Sampling,
    Region::PenaltySpans,
    Region::Penalties,
];

/// Every region starts at a multiple of this many bytes (more than any table's element needs;
/// a memory transaction's worth).
pub const ALIGN: usize = 256;

/// Bytes per region, in the order of [`REGIONS`].
pub type RegionBytes = [usize; REGIONS.len()];

/// Where each region lies in the packed buffer and how many bytes it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PackedLayout {
    offsets: RegionBytes,
    capacity: RegionBytes,
}

impl PackedLayout {
    /// Regions holding `capacity` bytes each, laid one after another.
    pub fn new(capacity: RegionBytes) -> Self {
        let mut offsets = [0; REGIONS.len()];
        let mut at = 0;
        for (offset, &cap) in offsets.iter_mut().zip(&capacity) {
            *offset = at;
            at += cap.max(1).div_ceil(ALIGN) * ALIGN;
        }
        Self { offsets, capacity }
    }

    pub fn offset(&self, region: Region) -> usize {
        self.offsets[region as usize]
    }

    pub fn capacity(&self, region: Region) -> usize {
        self.capacity[region as usize]
    }

    /// Bytes of the whole buffer.
    pub fn total(&self) -> usize {
        let last = REGIONS.len() - 1;
        self.offsets[last] + self.capacity[last].max(1).div_ceil(ALIGN) * ALIGN
    }

    /// Whether every region holds what `needs` says.
    pub fn holds(&self, needs: &RegionBytes) -> bool {
        self.capacity.iter().zip(needs).all(|(c, n)| c >= n)
    }

    /// This layout when it holds `needs`; otherwise one whose regions hold at least `needs`
    /// and what they held, a region that must grow at least doubling (so a server warming up
    /// moves the offsets a logarithmic number of times).
    pub fn grown(&self, needs: &RegionBytes) -> Self {
        let mut capacity = self.capacity;
        for (cap, &need) in capacity.iter_mut().zip(needs) {
            if need > *cap {
                *cap = need.max(2 * *cap);
            }
        }
        Self::new(capacity)
    }
}

/// The bytes each region of a step's tables takes (the sampling ones only when the step draws
/// on the device).
pub fn needs(tables: &StepTables, sample: bool) -> RegionBytes {
    let word = std::mem::size_of::<u32>();
    let sampling = if sample {
        [
            tables.sampling.len() * SAMPLE_ROW_BYTES,
            tables.penalty_spans.len() * word,
            tables.penalties.len() * word,
        ]
    } else {
        [0; 3]
    };
    [
        tables.tokens.len() * word,
        tables.positions.len() * word,
        tables.slots.len() * word,
        tables.row_seq.len() * word,
        tables.seqs.len() * 4 * word,
        tables.logit_rows.len() * word,
        tables.block_tables.len() * word,
        sampling[0],
        sampling[1],
        sampling[2],
    ]
}

/// Bytes of one `SampleRow` as the kernels read it.
pub const SAMPLE_ROW_BYTES: usize = std::mem::size_of::<crate::fast::twin::sample::SampleRow>();

/// Writes a step's tables into `dst` (at least `layout.total()` bytes) at the layout's offsets;
/// returns how many leading bytes of `dst` the step uses (what the upload copies). `layout`
/// must hold [`needs`] of the same arguments.
pub fn pack(layout: &PackedLayout, tables: &StepTables, sample: bool, dst: &mut [u8]) -> usize {
    let mut end = 0;
    let mut put = |region: Region, bytes: &[u8]| {
        let at = layout.offset(region);
        if let Some(slot) = dst.get_mut(at..at + bytes.len()) {
            slot.copy_from_slice(bytes);
            if !bytes.is_empty() {
                end = end.max(at + bytes.len());
            }
        }
    };
    let words =
        |values: &[u32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
    put(Region::Tokens, &words(&tables.tokens));
    put(Region::Positions, &words(&tables.positions));
    put(Region::Slots, &words(&tables.slots));
    put(Region::RowSeq, &words(&tables.row_seq));
    let seqs: Vec<u32> = tables
        .seqs
        .iter()
        .flat_map(|s| [s.row0, s.rows, s.past, s.index])
        .collect();
    put(Region::Seqs, &words(&seqs));
    put(Region::LogitRows, &words(&tables.logit_rows));
    put(Region::BlockTables, &words(&tables.block_tables));
    if sample {
        put(Region::Sampling, &sample_rows_bytes(&tables.sampling));
        put(Region::PenaltySpans, &words(&tables.penalty_spans));
        put(Region::Penalties, &words(&tables.penalties));
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BatchItem;
    use crate::fast::step_tables;
    use crate::logits::{DeviceSampling, LogitsMode, SampleRow};

    fn read_words(bytes: &[u8]) -> Vec<u32> {
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Every table comes back from its region as it went in, regions never overlap and are
    /// aligned, and the copy ends where the last table used ends.
    #[test]
    fn tables_pack_into_aligned_regions_and_unpack_unchanged() {
        let blocks_a: Vec<u32> = vec![3, 7];
        let blocks_b: Vec<u32> = vec![1];
        let prompt: Vec<u32> = (10..30).collect();
        let draw = DeviceSampling {
            row: SampleRow {
                temperature: 0.7,
                inv_temperature: 1.0 / 0.7,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.0,
                repetition_penalty: 1.1,
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                uniform: 0.25,
            },
            penalties: vec![(5, 2), (9, 1)],
        };
        let sample = [draw];
        let items = [
            BatchItem {
                blocks: &blocks_a,
                past: 0,
                tokens: &prompt,
                logits: LogitsMode::Sample,
                sample: &sample,
            },
            BatchItem {
                blocks: &blocks_b,
                past: 4,
                tokens: &[42],
                logits: LogitsMode::Sample,
                sample: &sample,
            },
        ];
        let tables = step_tables(&items);
        let need = needs(&tables, true);
        let layout = PackedLayout::default().grown(&need);
        assert!(layout.holds(&need));
        for (i, r) in REGIONS.iter().enumerate() {
            assert_eq!(layout.offset(*r) % ALIGN, 0);
            if let Some(next) = REGIONS.get(i + 1) {
                assert!(layout.offset(*r) + layout.capacity(*r) <= layout.offset(*next));
            }
        }
        let mut buf = vec![0xAAu8; layout.total()];
        let end = pack(&layout, &tables, true, &mut buf);
        let region = |r: Region| &buf[layout.offset(r)..layout.offset(r) + need[r as usize]];
        assert_eq!(read_words(region(Region::Tokens)), tables.tokens);
        assert_eq!(read_words(region(Region::Slots)), tables.slots);
        assert_eq!(read_words(region(Region::RowSeq)), tables.row_seq);
        assert_eq!(read_words(region(Region::BlockTables)), tables.block_tables);
        assert_eq!(read_words(region(Region::LogitRows)), tables.logit_rows);
        let seqs = read_words(region(Region::Seqs));
        assert_eq!(seqs.len(), 4 * tables.seqs.len());
        assert_eq!(seqs[4..8], [20, 1, 4, 1]);
        assert_eq!(read_words(region(Region::Positions)), tables.positions);
        assert_eq!(
            region(Region::Sampling),
            sample_rows_bytes(&tables.sampling)
        );
        assert_eq!(read_words(region(Region::Penalties)), tables.penalties);
        assert_eq!(
            end,
            layout.offset(Region::Penalties) + need[Region::Penalties as usize]
        );

        // Without a draw the copy stops at the block tables, and a larger step grows only the
        // regions it must (at least doubling them).
        let end = pack(&layout, &tables, false, &mut buf);
        assert_eq!(
            end,
            layout.offset(Region::BlockTables) + need[Region::BlockTables as usize]
        );
        let mut more = need;
        more[Region::Tokens as usize] += 4;
        let grown = layout.grown(&more);
        assert_eq!(
            grown.capacity(Region::Tokens),
            2 * need[Region::Tokens as usize]
        );
        assert_eq!(
            grown.capacity(Region::Penalties),
            layout.capacity(Region::Penalties)
        );
        assert_eq!(
            grown.grown(&more),
            grown,
            "a layout that holds a step is kept"
        );
    }
}
