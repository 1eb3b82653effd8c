//! RoPE on the step's queries and keys, then the keys and values written into the KV arena at
//! the rows' slots: the twin of the fused kernel (one thread per (row, head, pair) for the
//! rotation; the write converts to f16 as it stores). The cos/sin table is computed on the host
//! by `crate::rope::RopeTable` (the CPU engine's, so positions and YaRN agree exactly) and
//! uploaded with the step.

use half::f16;

use crate::fast::layout::KvArena;

/// The shapes the kernel needs.
#[derive(Debug, Clone, Copy)]
pub struct RopeShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions rotated per head (the first `rope_dim`, in adjacent pairs).
    pub rope_dim: usize,
}

/// Rotates adjacent pairs `(x[2i], x[2i+1])`, `i < rope_dim / 2`, of every head of every row
/// of `data` (`[rows][heads × head_dim]`) by the row's `cos`/`sin` (`[rows][rope_dim / 2]`).
pub fn rotate(data: &mut [f32], heads: usize, s: RopeShape, cos: &[f32], sin: &[f32]) {
    let half = s.rope_dim / 2;
    for (row, chunk) in data.chunks_mut(heads * s.head_dim).enumerate() {
        let (c, sn) = (
            &cos[row * half..(row + 1) * half],
            &sin[row * half..(row + 1) * half],
        );
        for head in chunk.chunks_mut(s.head_dim) {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c[i] - b * sn[i];
                head[2 * i + 1] = a * sn[i] + b * c[i];
            }
        }
    }
}

/// Writes every row's keys and values (`[rows][kv_heads × head_dim]`) into `arena` for `layer`
/// at the row's slot (`block × 16 + position % 16`).
pub fn write_kv(
    arena: &mut [f16],
    layout: KvArena,
    layer: usize,
    k: &[f32],
    v: &[f32],
    slots: &[u32],
) {
    let hd = layout.head_dim;
    let width = layout.kv_heads * hd;
    for (row, &slot) in slots.iter().enumerate() {
        if slot == crate::fast::graph::SKIP_SLOT {
            // A padded row of a graphed decode step: it has no place in the arena.
            continue;
        }
        let (block, at) = (slot / 16, slot as usize % 16);
        for head in 0..layout.kv_heads {
            let src = row * width + head * hd;
            for (kind, values) in [(0, k), (1, v)] {
                let dst = layout.index(block, layer, kind, head, at);
                for (d, s) in arena[dst..dst + hd].iter_mut().zip(&values[src..src + hd]) {
                    *d = f16::from_f32(*s);
                }
            }
        }
    }
}
