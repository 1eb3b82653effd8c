//! Block allocation and per-sequence block tables, independent of where the pages live.
//!
//! Block ids run from 0 to `capacity - 1`. Ids never handed out are counted rather than listed
//! (`fresh`), so a large capacity costs nothing until it is used; ids given back go on a free list
//! and are handed out again first, which keeps the set of touched pages (and so the storage's
//! memory) as small as the peak number of blocks in use.
//!
//! A [`BlockTable`] cannot be cloned and only the allocator adds or removes its blocks. A block
//! may be held by several tables ([`BlockAllocator::share`]: the prompt's blocks of `n` choices,
//! say); it counts once in use and goes back to the free list when the last table lets go of it.
//! Only whole blocks are shared, and a table writes only past its own length, so a shared block
//! is never written (the engine keeps it so when it truncates into one, see
//! [`BlockAllocator::is_shared`]). Tables are owned by the engine, which gives their blocks back
//! when a sequence is freed, truncated, or dropped with the engine.

use crate::error::{EngineError, Result};

/// Positions per block (vLLM's default, and a multiple of the 16-row tiles attention works in).
pub const BLOCK_POSITIONS: usize = 16;

pub type BlockId = u32;

/// The blocks of one sequence, in position order: position `p` lives in `blocks[p / 16]` at slot
/// `p % 16`.
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Positions the held blocks can store.
    pub fn capacity_positions(&self) -> usize {
        self.blocks.len() * BLOCK_POSITIONS
    }
}

#[derive(Debug)]
pub struct BlockAllocator {
    capacity: usize,
    bytes_per_block: usize,
    /// Ids given back, reused last-in first-out.
    free: Vec<BlockId>,
    /// Ids `fresh..capacity` have never been handed out.
    fresh: usize,
    /// Distinct blocks held.
    in_use: usize,
    /// Per id below `fresh`: how many tables hold it (0: free).
    holders: Vec<u32>,
}

impl BlockAllocator {
    /// An allocator for as many blocks of `bytes_per_block` as fit in `budget_bytes`.
    pub fn with_budget(budget_bytes: usize, bytes_per_block: usize) -> Self {
        let capacity = budget_bytes
            .checked_div(bytes_per_block)
            .unwrap_or(0)
            .min(BlockId::MAX as usize);
        Self::with_capacity(capacity, bytes_per_block)
    }

    pub fn with_capacity(capacity: usize, bytes_per_block: usize) -> Self {
        Self {
            capacity,
            bytes_per_block,
            free: Vec::new(),
            fresh: 0,
            in_use: 0,
            holders: Vec::new(),
        }
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(positions: usize) -> usize {
        positions.div_ceil(BLOCK_POSITIONS)
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity
    }

    pub fn used_blocks(&self) -> usize {
        self.in_use
    }

    pub fn free_blocks(&self) -> usize {
        self.capacity - self.in_use
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    /// Bytes of the blocks in use.
    pub fn used_bytes(&self) -> usize {
        self.in_use * self.bytes_per_block
    }

    /// Bytes the whole capacity would take.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity * self.bytes_per_block
    }

    /// Positions the whole capacity holds.
    pub fn capacity_positions(&self) -> usize {
        self.capacity * BLOCK_POSITIONS
    }

    /// Highest block id handed out so far plus one (what a storage must be able to index).
    pub fn high_water(&self) -> usize {
        self.fresh
    }

    /// More blocks `table` needs to hold `positions` positions.
    pub fn blocks_needed(table: &BlockTable, positions: usize) -> usize {
        Self::blocks_for(positions).saturating_sub(table.len())
    }

    /// Grows `table` to hold `positions` positions. All or nothing: when the free blocks do not
    /// suffice, nothing is allocated and the error says how many were needed.
    pub fn grow(&mut self, table: &mut BlockTable, positions: usize) -> Result<()> {
        let needed = Self::blocks_needed(table, positions);
        if needed > self.free_blocks() {
            return Err(EngineError::KvCacheFull {
                needed_blocks: needed,
                free_blocks: self.free_blocks(),
            });
        }
        for _ in 0..needed {
            let id = match self.free.pop() {
                Some(id) => id,
                None => {
                    let id = self.fresh as BlockId;
                    self.fresh += 1;
                    self.holders.push(0);
                    id
                }
            };
            self.holders[id as usize] = 1;
            table.blocks.push(id);
        }
        self.in_use += needed;
        Ok(())
    }

    /// A new table holding the first `blocks` blocks of `table` too (no new block is taken;
    /// each is freed when its last holder lets go). `blocks` is clamped to what `table` holds.
    pub fn share(&mut self, table: &BlockTable, blocks: usize) -> BlockTable {
        let shared: Vec<BlockId> = table.blocks[..blocks.min(table.blocks.len())].to_vec();
        for &id in &shared {
            self.holders[id as usize] += 1;
        }
        BlockTable { blocks: shared }
    }

    /// Whether more than one table holds block `id` (it must not be written).
    pub fn is_shared(&self, id: BlockId) -> bool {
        self.holders.get(id as usize).is_some_and(|&n| n > 1)
    }

    /// Keeps the blocks `positions` positions need and gives back the rest. A partly used last
    /// block is kept (its tail slots are simply overwritten by the next append).
    pub fn truncate(&mut self, table: &mut BlockTable, positions: usize) {
        let keep = Self::blocks_for(positions);
        if keep >= table.blocks.len() {
            return;
        }
        for id in table.blocks.drain(keep..).rev() {
            let holders = &mut self.holders[id as usize];
            *holders -= 1;
            if *holders == 0 {
                self.free.push(id);
                self.in_use -= 1;
            }
        }
    }

    /// Gives back every block of `table`.
    pub fn release(&mut self, table: &mut BlockTable) {
        self.truncate(table, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_comes_from_the_budget_in_whole_blocks() {
        let a = BlockAllocator::with_budget(10_000, 1_000);
        assert_eq!(a.capacity_blocks(), 10);
        let a = BlockAllocator::with_budget(10_999, 1_000);
        assert_eq!(a.capacity_blocks(), 10);
        assert_eq!(a.capacity_bytes(), 10_000);
        assert_eq!(a.capacity_positions(), 160);
        assert_eq!(BlockAllocator::with_budget(999, 1_000).capacity_blocks(), 0);
        assert_eq!(BlockAllocator::with_budget(5, 0).capacity_blocks(), 0);
    }

    #[test]
    fn grow_allocates_whole_blocks_and_accounts_exactly() {
        let mut a = BlockAllocator::with_capacity(8, 100);
        let mut t = BlockTable::new();
        a.grow(&mut t, 1).expect("grow");
        assert_eq!(t.len(), 1);
        a.grow(&mut t, 16).expect("grow");
        assert_eq!(t.len(), 1, "16 positions still fit one block");
        a.grow(&mut t, 17).expect("grow");
        assert_eq!(t.len(), 2);
        assert_eq!(a.used_blocks(), 2);
        assert_eq!(a.used_bytes(), 200);
        assert_eq!(a.free_blocks(), 6);
        let mut u = BlockTable::new();
        a.grow(&mut u, 40).expect("grow");
        assert_eq!(u.len(), 3);
        assert_eq!(a.used_bytes(), 500);
        // Distinct ids across tables.
        let mut all: Vec<BlockId> = t.blocks().iter().chain(u.blocks()).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 5);
    }

    #[test]
    fn truncate_frees_trailing_blocks_and_keeps_a_partial_one() {
        let mut a = BlockAllocator::with_capacity(8, 64);
        let mut t = BlockTable::new();
        a.grow(&mut t, 64).expect("grow");
        assert_eq!(t.len(), 4);
        let first = t.blocks()[0];
        a.truncate(&mut t, 20);
        assert_eq!(t.len(), 2, "positions 16..20 keep the second block");
        assert_eq!(t.blocks()[0], first);
        assert_eq!(a.used_blocks(), 2);
        a.truncate(&mut t, 32);
        assert_eq!(
            t.len(),
            2,
            "truncating to more than is held changes nothing"
        );
        a.truncate(&mut t, 16);
        assert_eq!(t.len(), 1);
        a.truncate(&mut t, 0);
        assert!(t.is_empty());
        assert_eq!(a.used_blocks(), 0);
        assert_eq!(a.used_bytes(), 0);
    }

    #[test]
    fn freed_blocks_are_reused_before_fresh_ones() {
        let mut a = BlockAllocator::with_capacity(100, 1);
        let mut t = BlockTable::new();
        a.grow(&mut t, 48).expect("grow");
        let held: Vec<BlockId> = t.blocks().to_vec();
        a.release(&mut t);
        let mut u = BlockTable::new();
        a.grow(&mut u, 48).expect("grow");
        let mut got = u.blocks().to_vec();
        got.sort_unstable();
        assert_eq!(got, held);
        assert_eq!(a.high_water(), 3, "no new ids were touched");
    }

    #[test]
    fn running_out_is_an_error_that_allocates_nothing() {
        let mut a = BlockAllocator::with_capacity(3, 10);
        let mut t = BlockTable::new();
        a.grow(&mut t, 32).expect("grow");
        let mut u = BlockTable::new();
        let err = a.grow(&mut u, 33).expect_err("only one block is left");
        match err {
            EngineError::KvCacheFull {
                needed_blocks,
                free_blocks,
            } => {
                assert_eq!((needed_blocks, free_blocks), (3, 1));
            }
            other => panic!("unexpected error {other}"),
        }
        assert!(u.is_empty());
        assert_eq!(a.used_blocks(), 2);
        // What fits still fits, and freeing makes room again.
        a.grow(&mut u, 16).expect("one block fits");
        assert_eq!(a.free_blocks(), 0);
        assert!(a.grow(&mut u, 17).is_err());
        a.release(&mut t);
        a.grow(&mut u, 48).expect("room after release");
        assert_eq!(a.used_blocks(), 3);
        assert_eq!(a.used_bytes(), 30);
    }

    #[test]
    fn shared_blocks_count_once_and_are_freed_by_their_last_holder() {
        let mut a = BlockAllocator::with_capacity(8, 10);
        let mut t = BlockTable::new();
        a.grow(&mut t, 40).expect("grow");
        let mut u = a.share(&t, 2);
        assert_eq!(u.blocks(), &t.blocks()[..2]);
        assert_eq!(a.used_blocks(), 3, "sharing takes no block");
        assert!(a.is_shared(t.blocks()[0]) && a.is_shared(t.blocks()[1]));
        assert!(!a.is_shared(t.blocks()[2]));
        a.grow(&mut u, 48).expect("grow");
        assert_eq!(u.len(), 3);
        assert_ne!(
            u.blocks()[2],
            t.blocks()[2],
            "each grows into its own blocks"
        );
        assert_eq!(a.used_blocks(), 4);
        a.release(&mut t);
        assert_eq!(a.used_blocks(), 3, "the shared ones stay with u");
        assert!(!a.is_shared(u.blocks()[0]));
        a.release(&mut u);
        assert_eq!(a.used_blocks(), 0);
        assert_eq!(a.free_blocks(), 8);
        let mut v = BlockTable::new();
        a.grow(&mut v, 128).expect("every block is free again");
        assert_eq!(a.high_water(), 8);
    }

    #[test]
    fn zero_capacity_refuses_every_block() {
        let mut a = BlockAllocator::with_capacity(0, 10);
        let mut t = BlockTable::new();
        assert!(a.grow(&mut t, 0).is_ok(), "nothing needed, nothing refused");
        assert!(matches!(
            a.grow(&mut t, 1),
            Err(EngineError::KvCacheFull {
                needed_blocks: 1,
                free_blocks: 0
            })
        ));
    }
}
