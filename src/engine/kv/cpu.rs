//! The CPU storage of the paged KV cache: the pages of every block id in host memory.
//!
//! A block's pages sit in one boxed slice of the element type: page `p` (see
//! [`KvLayout::page`]) covers `BLOCK_POSITIONS` rows of `head_dim` values (or `head_dim / 32`
//! q8_0 blocks), so attention reads 16 keys of one head from one contiguous run. Pages are
//! allocated when their block id is first handed out and kept for reuse afterwards, so the memory
//! held is the allocator's high-water mark in blocks, never more than its capacity.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::{BlockId, KvKind, KvLayout, KvType, BLOCK_POSITIONS, Q8_0_BLOCK};

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
    let d = b.d.to_f32();
    for (o, &q) in out.iter_mut().zip(&b.qs) {
        *o = d * q as f32;
    }
}

enum Pages {
    F32(Vec<Box<[f32]>>),
    F16(Vec<Box<[f16]>>),
    Q8(Vec<Box<[BlockQ8_0]>>),
}

pub struct CpuKvStorage {
    layout: KvLayout,
    pages: Pages,
    /// Elements of the storage type per page (`BLOCK_POSITIONS` rows).
    page_units: usize,
    /// Elements per row.
    row_units: usize,
}

impl CpuKvStorage {
    pub fn new(layout: KvLayout) -> Self {
        let row_units = match layout.kv_type {
            KvType::Q8_0 => layout.head_dim / Q8_0_BLOCK,
            KvType::F32 | KvType::F16 => layout.head_dim,
        };
        let pages = match layout.kv_type {
            KvType::F32 => Pages::F32(Vec::new()),
            KvType::F16 => Pages::F16(Vec::new()),
            KvType::Q8_0 => Pages::Q8(Vec::new()),
        };
        Self {
            layout,
            pages,
            page_units: BLOCK_POSITIONS * row_units,
            row_units,
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Block ids `0..blocks()` have pages.
    pub fn blocks(&self) -> usize {
        self.materialized()
    }

    fn materialized(&self) -> usize {
        match &self.pages {
            Pages::F32(p) => p.len(),
            Pages::F16(p) => p.len(),
            Pages::Q8(p) => p.len(),
        }
    }

    /// Bytes of pages allocated (blocks ever handed out, in use or free for reuse).
    pub fn resident_bytes(&self) -> usize {
        self.materialized() * self.layout.bytes_per_block()
    }

    /// Makes sure block ids `0..blocks` have pages.
    pub fn ensure(&mut self, blocks: usize) {
        let units = self.page_units * self.layout.pages_per_block();
        fn grow<T: Copy + Default>(v: &mut Vec<Box<[T]>>, blocks: usize, units: usize) {
            while v.len() < blocks {
                v.push(vec![T::default(); units].into_boxed_slice());
            }
        }
        match &mut self.pages {
            Pages::F32(p) => grow(p, blocks, units),
            Pages::F16(p) => grow(p, blocks, units),
            Pages::Q8(p) => grow(p, blocks, units),
        }
    }

    #[inline]
    fn range(&self, layer: usize, head: usize, kind: KvKind, slot: usize) -> usize {
        self.layout.page(layer, head, kind) * self.page_units + slot * self.row_units
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
        let at = self.range(layer, head, kind, slot);
        let units = self.row_units;
        match &mut self.pages {
            Pages::F32(p) => p[block as usize][at..at + units].copy_from_slice(row),
            Pages::F16(p) => p[block as usize][at..at + units].convert_from_f32_slice(row),
            Pages::Q8(p) => {
                for (b, x) in p[block as usize][at..at + units]
                    .iter_mut()
                    .zip(row.chunks_exact(Q8_0_BLOCK))
                {
                    quantize_q8_0(x, b);
                }
            }
        }
    }

    /// Asks the CPU to start loading `block`'s K and V pages of (`layer`, `head`) into cache.
    ///
    /// Why: a sequence's blocks are scattered over the storage, so one head's 16 positions are a
    /// short contiguous run (2 KiB for f16 at head_dim 64) far from the next block's. The
    /// hardware prefetcher does not follow such jumps, and decode at long contexts was stalled on
    /// these loads (three quarters of its time on the conversion's first load). Attention calls
    /// this for the block after the one it is working on.
    #[inline]
    pub fn prefetch(&self, block: BlockId, layer: usize, head: usize) {
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
            let k = self.range(layer, head, KvKind::K, 0);
            let v = self.range(layer, head, KvKind::V, 0);
            let b = block as usize;
            match &self.pages {
                Pages::F32(p) => {
                    if let Some(page) = p.get(b) {
                        touch(&page[k..k + units]);
                        touch(&page[v..v + units]);
                    }
                }
                Pages::F16(p) => {
                    if let Some(page) = p.get(b) {
                        touch(&page[k..k + units]);
                        touch(&page[v..v + units]);
                    }
                }
                Pages::Q8(p) => {
                    if let Some(page) = p.get(b) {
                        touch(&page[k..k + units]);
                        touch(&page[v..v + units]);
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (block, layer, head);
    }

    /// The first `rows` rows of a page as f32: borrowed directly for f32 storage, converted into
    /// `scratch` (at least `rows * head_dim` long) otherwise.
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
        let at = self.range(layer, head, kind, 0);
        let hd = self.layout.head_dim;
        match &self.pages {
            Pages::F32(p) => &p[block as usize][at..at + rows * hd],
            Pages::F16(p) => {
                let out = &mut scratch[..rows * hd];
                p[block as usize][at..at + rows * hd].convert_to_f32_slice(out);
                out
            }
            Pages::Q8(p) => {
                let n = rows * self.row_units;
                let out = &mut scratch[..rows * hd];
                for (b, o) in p[block as usize][at..at + n]
                    .iter()
                    .zip(out.chunks_exact_mut(Q8_0_BLOCK))
                {
                    dequantize_q8_0(b, o);
                }
                out
            }
        }
    }
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
                let got = &tile[slot * 64..(slot + 1) * 64];
                for (g, w) in got.iter().zip(row(i)) {
                    assert!((g - w).abs() <= tol, "{t}: {g} vs {w}");
                }
            }
        }
    }
}
