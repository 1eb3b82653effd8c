//! The CPU storage of the paged KV cache: the pages of every block id in host memory.
//!
//! A page (see [`KvLayout::page`]) covers `BLOCK_POSITIONS` rows of `head_dim` values (or
//! `head_dim / 32` q8_0 blocks) of one (layer, head, K or V), so attention reads 16 keys of one
//! head from one contiguous run. Inside a page:
//! - V is stored row by row (`[position][dim]`): attention adds `p_j · v_j` over positions with
//!   the dimensions in vector lanes.
//! - K is stored transposed (`[dim][position]`, 16 positions per dimension): attention's scores
//!   `q · k_j` then come out with the 16 positions in vector lanes, one broadcast `q[d]` times one
//!   16-lane load per dimension, with no horizontal sum per key (those sums, and converting the
//!   page into a row-major f32 tile first, were most of decode attention's time at long contexts).
//! - q8_0 scales (one per 32 values of a row) are stored `[scale block][position]` for K and V,
//!   so the 16 positions' scales of one block are one 16-lane load too.
//!
//! The pages of the same (layer, head, K or V) of consecutive block ids are contiguous too, in
//! chunks of [`CHUNK_BLOCKS`]. Block ids get pages when they are first handed out and keep them
//! for reuse afterwards, so the memory held is the allocator's high-water mark in blocks, never
//! more than its capacity.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::kv::{BlockId, KvKind, KvLayout, KvType, BLOCK_POSITIONS, Q8_0_BLOCK};

/// ggml's `block_q8_0`: `x[i] = d * qs[i]` (34 bytes, the same layout as ggml's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; Q8_0_BLOCK],
}

/// Quantizes 32 values as ggml's x86 `quantize_row_q8_0` does: scale `max|x| / 127` stored as
/// f16, values multiplied by `127 / max|x|` (not by the inverse of the rounded scale) and rounded
/// to nearest, ties to even (`_mm256_round_ps` with `_MM_ROUND_NEAREST`).
pub fn quantize_q8_0(x: &[f32], out: &mut BlockQ8_0) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    out.d = f16::from_f32(d);
    for (q, &v) in out.qs.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
    }
}

/// `out[i] = d * qs[i]` for one block.
#[inline]
pub fn dequantize_q8_0(b: &BlockQ8_0, out: &mut [f32]) {
    dequantize_q8_0_parts(b.d.to_f32(), &b.qs, out);
}

/// Blocks per chunk of storage. Each chunk is one allocation holding, for every page
/// (layer, head, K or V), the pages of its `CHUNK_BLOCKS` blocks one after another. Why: decode
/// at long contexts reads one head's pages of block after block, and with a block's pages kept
/// together those reads were 2 KiB runs scattered a whole block (hundreds of KiB) apart, which
/// the hardware prefetcher does not follow: KV reads ran at a fifth of the bandwidth the weight
/// matrices stream at. With this layout a sequence whose block ids are consecutive (the usual
/// case: the allocator hands out fresh ids in order) reads up to `CHUNK_BLOCKS` pages as one
/// contiguous run.
pub const CHUNK_BLOCKS: usize = 16;

/// The chunks of one storage type. Chunks are allocated zeroed (`vec![0; n]` of a primitive
/// type, i.e. `calloc`), so the operating system only backs the pages of blocks that get
/// written: resident memory follows the blocks handed out, not whole chunks. That is also why
/// f16 is kept as its bits (`u16`) and q8_0 as separate scale and quant arrays: zeroed
/// allocation is only available for primitive element types.
/// `out[i] = d * q[i]` for one q8_0 block. Fixed-size arrays, so the loop is known to be 32
/// lanes and vectorises (sign-extend, convert, multiply); over slices of unknown length the
/// release build kept it scalar, and dequantisation was a third of decode at long contexts.
#[inline]
fn dequantize_q8_0_parts(d: f32, q: &[i8], out: &mut [f32]) {
    match (
        <&[i8; Q8_0_BLOCK]>::try_from(q),
        <&mut [f32; Q8_0_BLOCK]>::try_from(&mut *out),
    ) {
        (Ok(q), Ok(out)) => {
            for i in 0..Q8_0_BLOCK {
                out[i] = d * f32::from(q[i]);
            }
        }
        _ => {
            for (o, &q) in out.iter_mut().zip(q) {
                *o = d * f32::from(q);
            }
        }
    }
}

enum Chunks {
    F32(Vec<Box<[f32]>>),
    F16(Vec<Box<[u16]>>),
    Q8 {
        /// Per q8_0 block: its scale as f16 bits.
        scales: Vec<Box<[u16]>>,
        /// Per q8_0 block: its 32 quants.
        quants: Vec<Box<[i8]>>,
    },
}

pub struct CpuKvStorage {
    layout: KvLayout,
    chunks: Chunks,
    /// Block ids `0..materialized` are usable (their chunks exist).
    materialized: usize,
    /// Units of the storage type per page (`BLOCK_POSITIONS` rows); a unit is one value for
    /// f32/f16 and one q8_0 block (32 values) for q8_0.
    page_units: usize,
    /// Units per row.
    row_units: usize,
}

impl CpuKvStorage {
    pub fn new(layout: KvLayout) -> Self {
        let row_units = match layout.kv_type {
            KvType::Q8_0 => layout.head_dim / Q8_0_BLOCK,
            KvType::F32 | KvType::F16 => layout.head_dim,
        };
        let chunks = match layout.kv_type {
            KvType::F32 => Chunks::F32(Vec::new()),
            KvType::F16 => Chunks::F16(Vec::new()),
            KvType::Q8_0 => Chunks::Q8 {
                scales: Vec::new(),
                quants: Vec::new(),
            },
        };
        Self {
            layout,
            chunks,
            materialized: 0,
            page_units: BLOCK_POSITIONS * row_units,
            row_units,
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Block ids `0..blocks()` have pages.
    pub fn blocks(&self) -> usize {
        self.materialized
    }

    /// Bytes of pages in use or kept for reuse: the blocks ever handed out. Chunks are allocated
    /// zeroed, so the rest of the last chunk costs address space but no memory until written.
    pub fn resident_bytes(&self) -> usize {
        self.materialized * self.layout.bytes_per_block()
    }

    /// Makes sure block ids `0..blocks` have pages.
    pub fn ensure(&mut self, blocks: usize) {
        let units = self.page_units * self.layout.pages_per_block() * CHUNK_BLOCKS;
        let chunks = blocks.div_ceil(CHUNK_BLOCKS);
        match &mut self.chunks {
            Chunks::F32(c) => {
                while c.len() < chunks {
                    c.push(vec![0f32; units].into_boxed_slice());
                }
            }
            Chunks::F16(c) => {
                while c.len() < chunks {
                    c.push(vec![0u16; units].into_boxed_slice());
                }
            }
            Chunks::Q8 { scales, quants } => {
                while scales.len() < chunks {
                    scales.push(vec![0u16; units].into_boxed_slice());
                    quants.push(vec![0i8; units * Q8_0_BLOCK].into_boxed_slice());
                }
            }
        }
        self.materialized = self.materialized.max(blocks);
    }

    /// The chunk holding `block`, and the unit offset of row `slot` of the page of (`layer`,
    /// `head`, `kind`) of `block` inside it.
    #[inline]
    fn locate(
        &self,
        block: BlockId,
        layer: usize,
        head: usize,
        kind: KvKind,
        slot: usize,
    ) -> (usize, usize) {
        let b = block as usize;
        let page = self.layout.page(layer, head, kind);
        let at = (page * CHUNK_BLOCKS + b % CHUNK_BLOCKS) * self.page_units + slot * self.row_units;
        (b / CHUNK_BLOCKS, at)
    }

    /// Appends the bytes of `block`'s pages (every layer, KV head, K and V, in page order; f32
    /// and f16 values little-endian, q8_0 pages as their scales then their quants) to `out`:
    /// [`KvLayout::bytes_per_block`] bytes, what [`Self::import_block`] takes back. The block
    /// must have pages.
    pub fn export_block(&self, block: BlockId, out: &mut Vec<u8>) {
        let n = self.page_units;
        let b = block as usize;
        let c = b / CHUNK_BLOCKS;
        for page in 0..self.layout.pages_per_block() {
            let at = (page * CHUNK_BLOCKS + b % CHUNK_BLOCKS) * n;
            match &self.chunks {
                Chunks::F32(p) => out.extend(p[c][at..at + n].iter().flat_map(|v| v.to_le_bytes())),
                Chunks::F16(p) => out.extend(p[c][at..at + n].iter().flat_map(|v| v.to_le_bytes())),
                Chunks::Q8 { scales, quants } => {
                    out.extend(scales[c][at..at + n].iter().flat_map(|v| v.to_le_bytes()));
                    out.extend(
                        quants[c][at * Q8_0_BLOCK..(at + n) * Q8_0_BLOCK]
                            .iter()
                            .map(|&q| q as u8),
                    );
                }
            }
        }
    }

    /// Writes `bytes` (one block's, as [`Self::export_block`] made them) into `block`'s pages.
    /// The block must have pages and `bytes` be [`KvLayout::bytes_per_block`] long.
    pub fn import_block(&mut self, block: BlockId, bytes: &[u8]) {
        let n = self.page_units;
        let b = block as usize;
        let c = b / CHUNK_BLOCKS;
        let mut rest = bytes;
        let mut take = |len: usize| -> &[u8] {
            let (head, tail) = rest.split_at(len.min(rest.len()));
            rest = tail;
            head
        };
        for page in 0..self.layout.pages_per_block() {
            let at = (page * CHUNK_BLOCKS + b % CHUNK_BLOCKS) * n;
            match &mut self.chunks {
                Chunks::F32(p) => {
                    for (v, x) in p[c][at..at + n].iter_mut().zip(take(4 * n).chunks_exact(4)) {
                        *v = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                    }
                }
                Chunks::F16(p) => {
                    for (v, x) in p[c][at..at + n].iter_mut().zip(take(2 * n).chunks_exact(2)) {
                        *v = u16::from_le_bytes([x[0], x[1]]);
                    }
                }
                Chunks::Q8 { scales, quants } => {
                    for (v, x) in scales[c][at..at + n]
                        .iter_mut()
                        .zip(take(2 * n).chunks_exact(2))
                    {
                        *v = u16::from_le_bytes([x[0], x[1]]);
                    }
                    let q = &mut quants[c][at * Q8_0_BLOCK..(at + n) * Q8_0_BLOCK];
                    for (v, &x) in q.iter_mut().zip(take(n * Q8_0_BLOCK)) {
                        *v = x as i8;
                    }
                }
            }
        }
    }

    /// Stores one row (`head_dim` values) at `slot` of `block`. The block must have pages
    /// ([`Self::ensure`]).
    pub fn write(
        &mut self,
        block: BlockId,
        slot: usize,
        layer: usize,
        head: usize,
        kind: KvKind,
        row: &[f32],
    ) {
        // Unit offset of the page's first row (K is stored transposed, see the module comment).
        let (c, page) = self.locate(block, layer, head, kind, 0);
        let at = page + slot * self.row_units;
        let units = self.row_units;
        match (&mut self.chunks, kind) {
            (Chunks::F32(p), KvKind::V) => p[c][at..at + units].copy_from_slice(row),
            (Chunks::F32(p), KvKind::K) => {
                for (d, &x) in row.iter().enumerate() {
                    p[c][page + d * BLOCK_POSITIONS + slot] = x;
                }
            }
            (Chunks::F16(p), KvKind::V) => p[c][at..at + units]
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(row),
            (Chunks::F16(p), KvKind::K) => {
                for (d, &x) in row.iter().enumerate() {
                    p[c][page + d * BLOCK_POSITIONS + slot] = f16::from_f32(x).to_bits();
                }
            }
            (Chunks::Q8 { scales, quants }, kind) => {
                let mut b = BlockQ8_0::default();
                for (i, x) in row.chunks_exact(Q8_0_BLOCK).enumerate() {
                    quantize_q8_0(x, &mut b);
                    scales[c][page + i * BLOCK_POSITIONS + slot] = b.d.to_bits();
                    match kind {
                        KvKind::V => {
                            let q = (at + i) * Q8_0_BLOCK;
                            quants[c][q..q + Q8_0_BLOCK].copy_from_slice(&b.qs);
                        }
                        KvKind::K => {
                            for (j, &q) in b.qs.iter().enumerate() {
                                let d = i * Q8_0_BLOCK + j;
                                quants[c][page * Q8_0_BLOCK + d * BLOCK_POSITIONS + slot] = q;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Asks the CPU to start loading `block`'s K and V pages of (`layer`, `head`) into cache.
    ///
    /// Why: within a chunk the pages of consecutive blocks are contiguous and the hardware
    /// prefetcher streams them, but a sequence's blocks can also sit in different chunks or out
    /// of order (ids reused from the free list). Attention calls this for a block ahead of the
    /// one it is working on, which costs little when the data is already on its way.
    #[inline]
    pub fn prefetch(&self, block: BlockId, layer: usize, head: usize) {
        if block as usize >= self.materialized {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            fn touch<T>(page: &[T]) {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                let bytes = std::mem::size_of_val(page);
                let base = page.as_ptr().cast::<i8>();
                let mut off = 0;
                while off < bytes {
                    // SAFETY: prefetching is a hint and never faults; the address is inside
                    // `page` anyway (off < its length in bytes).
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(off)) };
                    off += 64;
                }
            }
            let units = self.page_units;
            let (c, k) = self.locate(block, layer, head, KvKind::K, 0);
            let (_, v) = self.locate(block, layer, head, KvKind::V, 0);
            match &self.chunks {
                Chunks::F32(p) => {
                    touch(&p[c][k..k + units]);
                    touch(&p[c][v..v + units]);
                }
                Chunks::F16(p) => {
                    touch(&p[c][k..k + units]);
                    touch(&p[c][v..v + units]);
                }
                Chunks::Q8 { scales, quants } => {
                    touch(&scales[c][k..k + units]);
                    touch(&scales[c][v..v + units]);
                    touch(&quants[c][k * Q8_0_BLOCK..(k + units) * Q8_0_BLOCK]);
                    touch(&quants[c][v * Q8_0_BLOCK..(v + units) * Q8_0_BLOCK]);
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (block, layer, head);
    }

    /// The page of (`layer`, `head`, `kind`) of `block` as stored, for kernels that read it
    /// directly (layouts in the module comment).
    #[inline]
    pub fn page(&self, block: BlockId, layer: usize, head: usize, kind: KvKind) -> Page<'_> {
        let (c, at) = self.locate(block, layer, head, kind, 0);
        let n = self.page_units;
        match &self.chunks {
            Chunks::F32(p) => Page::F32(&p[c][at..at + n]),
            Chunks::F16(p) => Page::F16(&p[c][at..at + n]),
            Chunks::Q8 { scales, quants } => Page::Q8 {
                scales: &scales[c][at..at + n],
                quants: &quants[c][at * Q8_0_BLOCK..(at + n) * Q8_0_BLOCK],
            },
        }
    }

    /// A page as f32, borrowed directly for f32 storage, converted into `scratch` (at least
    /// `BLOCK_POSITIONS * head_dim` long) otherwise. Keys come in the stored transposed layout,
    /// all 16 positions (`[dim][position]`); values row by row, the first `rows` rows.
    #[inline]
    pub fn tile<'a>(
        &'a self,
        block: BlockId,
        layer: usize,
        head: usize,
        kind: KvKind,
        rows: usize,
        scratch: &'a mut [f32],
    ) -> &'a [f32] {
        let hd = self.layout.head_dim;
        let len = match kind {
            KvKind::K => BLOCK_POSITIONS * hd,
            KvKind::V => rows * hd,
        };
        match self.page(block, layer, head, kind) {
            Page::F32(p) => &p[..len],
            Page::F16(p) => {
                let out = &mut scratch[..len];
                p[..len].reinterpret_cast::<f16>().convert_to_f32_slice(out);
                out
            }
            Page::Q8 { scales, quants } => {
                let out = &mut scratch[..len];
                match kind {
                    KvKind::V => {
                        for (r, (q, o)) in quants
                            .chunks_exact(hd)
                            .zip(out.chunks_exact_mut(hd))
                            .enumerate()
                        {
                            for (i, (q, o)) in q
                                .chunks_exact(Q8_0_BLOCK)
                                .zip(o.chunks_exact_mut(Q8_0_BLOCK))
                                .enumerate()
                            {
                                let d = f16::from_bits(scales[i * BLOCK_POSITIONS + r]).to_f32();
                                dequantize_q8_0_parts(d, q, o);
                            }
                        }
                    }
                    KvKind::K => {
                        // Row d of the transposed page is dimension d of the 16 positions, whose
                        // scales are the 16 of its scale block.
                        for (d, (q, o)) in quants
                            .chunks_exact(BLOCK_POSITIONS)
                            .zip(out.chunks_exact_mut(BLOCK_POSITIONS))
                            .enumerate()
                        {
                            let sc =
                                &scales[(d / Q8_0_BLOCK) * BLOCK_POSITIONS..][..BLOCK_POSITIONS];
                            for ((o, &q), &s) in o.iter_mut().zip(q).zip(sc) {
                                *o = f16::from_bits(s).to_f32() * f32::from(q);
                            }
                        }
                    }
                }
                out
            }
        }
    }
}

/// One page as stored (see the module comment for the layouts).
pub enum Page<'a> {
    F32(&'a [f32]),
    /// f16 bits.
    F16(&'a [u16]),
    Q8 {
        /// f16 bits, `[scale block][position]`.
        scales: &'a [u16],
        quants: &'a [i8],
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(kv_type: KvType) -> KvLayout {
        KvLayout {
            kv_type,
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 64,
        }
    }

    #[test]
    fn q8_0_matches_ggml_rounding() {
        // max |x| = 127 gives scale 1 and exact integers; halves round to even.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        x[4] = -126.6;
        let mut b = BlockQ8_0::default();
        quantize_q8_0(&x, &mut b);
        assert_eq!(b.d.to_f32(), 1.0);
        assert_eq!(&b.qs[..5], &[127, 2, -4, 0, -127]);
        // All zeros: zero scale and zero values, no NaN.
        quantize_q8_0(&[0.0; 32], &mut b);
        assert_eq!(b.d.to_f32(), 0.0);
        assert!(b.qs.iter().all(|&q| q == 0));
        // Round trip within half a step of the scale.
        let x: Vec<f32> = (0..32)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .collect();
        quantize_q8_0(&x, &mut b);
        let mut y = [0f32; 32];
        dequantize_q8_0(&b, &mut y);
        let step = b.d.to_f32();
        for (a, r) in x.iter().zip(&y) {
            assert!((a - r).abs() <= 0.5 * step + 1e-3 * step, "{a} vs {r}");
        }
    }

    #[test]
    fn rows_round_trip_through_pages() {
        for t in KvType::ALL {
            let l = layout(t);
            let mut s = CpuKvStorage::new(l);
            s.ensure(2);
            assert_eq!(s.resident_bytes(), 2 * l.bytes_per_block());
            let row = |seed: usize| -> Vec<f32> {
                (0..64)
                    .map(|i| ((i * 7 + seed * 13) % 29) as f32 / 29.0 - 0.5)
                    .collect()
            };
            // Write distinct rows in distinct places and read every one back.
            let places = [
                (0u32, 0usize, 0usize, 0usize, KvKind::K),
                (1, 15, 1, 2, KvKind::V),
                (1, 3, 0, 1, KvKind::K),
                (0, 7, 1, 2, KvKind::K),
            ];
            for (i, &(b, slot, layer, head, kind)) in places.iter().enumerate() {
                s.write(b, slot, layer, head, kind, &row(i));
            }
            let tol = match t {
                KvType::F32 => 0.0,
                KvType::F16 => 1e-3,
                KvType::Q8_0 => 0.5 / 127.0 + 1e-4,
            };
            let mut scratch = vec![0f32; BLOCK_POSITIONS * 64];
            for (i, &(b, slot, layer, head, kind)) in places.iter().enumerate() {
                let tile = s.tile(b, layer, head, kind, slot + 1, &mut scratch);
                // Keys are transposed: dimension d of position `slot` is at d * 16 + slot.
                let got: Vec<f32> = match kind {
                    KvKind::K => (0..64).map(|d| tile[d * BLOCK_POSITIONS + slot]).collect(),
                    KvKind::V => tile[slot * 64..(slot + 1) * 64].to_vec(),
                };
                for (g, w) in got.iter().zip(row(i)) {
                    assert!((g - w).abs() <= tol, "{t}: {g} vs {w}");
                }
            }
        }
    }
}
