//! Row-interleaved ("packed") weight layouts for the SIMD kernels.
//!
//! Rows are taken sixteen at a time (a *group*; a short last group is padded with zero blocks).
//! For every block column the sixteen rows' blocks are stored together so that one 64-byte load
//! gives four consecutive quants of each of the sixteen rows: dword `lane` of a 64-byte chunk
//! belongs to row `lane`, and `vpdpbusd` against four broadcast activation bytes yields sixteen
//! row partial sums at once, with no horizontal reduction. (An AVX2 kernel takes each chunk as two
//! 32-byte halves: rows 0-7 and 8-15.) Sizes equal GGML's, so decode streams the same number of
//! bytes.
//!
//! Per 16-row group and block column (offsets in bytes, `l` = row within the group):
//! - Q4_0 (288): quants `[j 0..4][l][4]` = the row's `qs[4j..4j+4]` (low nibbles: values
//!   `4j..4j+4`, high nibbles: values `16+4j..`), then `d` f16 `[l]` at 256.
//! - Q4_1 (320): as Q4_0, then `m` f16 `[l]` at 288.
//! - Q8_0 (544): quants `[j 0..8][l][4]` = `qs[4j..4j+4] ^ 0x80` (stored unsigned: `q + 128`),
//!   then `d` f16 `[l]` at 512.
//! - Q4_K (2304): quants `[c 0..32][l][4]` = the row's `qs[4c..4c+4]` (low nibbles: sub-block
//!   `2(c/8)`, high: `2(c/8)+1`, values `4(c%8)..` of the sub-block); the 6-bit scales and mins
//!   in GGML's 12 bytes a row, rearranged so that a kernel gets sixteen rows' scales with one
//!   widening load and a mask: bytes `[sb 0..8][l]` = `sc[sb] | (m[sb] >> 4) << 6` at
//!   [`Q4K_SCALES`], and per row a little-endian dword `[l]` whose nibble `sb` is `m[sb] & 15`
//!   at [`Q4K_MIN_LOW`]; `d` f16 `[l]` at [`Q4K_D`]; `dmin` f16 `[l]` at [`Q4K_DMIN`]. (Until
//!   the 2026-11-27 change the scales and mins took a byte each: 2368 bytes, 2.7% more to stream.)
//! - Q6_K (3360): the unsigned 6-bit value `v` of element `e` (`e` in GGML's dequantized order) is
//!   split: its low nibble goes to quants `[c 0..32][l][4]` like Q4_K (chunk `C = e/32` is nibble
//!   half `C%2` of `c = 8(C/2) + (e%32)/4`, byte `e%4`); its high two bits go to `[D 0..16][l][4]`
//!   at 2048, `D = 2C + (e%32)/16`, byte `e%4`, bits `2((e%16)/4)..`; scales as i8 pairs
//!   `[p 0..8][l][2]` = `(sc[2p], sc[2p+1])` at 3072; `d` f16 `[l]` at 3328.

use candle_core::quantized::GgmlDType;
use rayon::prelude::*;

use super::act::ActKind;
use smolchat_gguf::AlignedBytes;

/// Rows per interleaved group.
pub const GROUP: usize = 16;

/// Q4_K group-block offsets (see the module's comment): the scale bytes (each with two bits of
/// its sub-block's min), the mins' low nibbles, `d` and `dmin`.
pub const Q4K_SCALES: usize = 2048;
pub const Q4K_MIN_LOW: usize = 2176;
pub const Q4K_D: usize = 2240;
pub const Q4K_DMIN: usize = 2272;

/// The 6-bit scale and min of sub-block `sb` of row `l` in a packed Q4_K group-block.
pub fn q4k_packed_scale_min(packed: &[u8], sb: usize, l: usize) -> (u8, u8) {
    let byte = packed[Q4K_SCALES + 16 * sb + l];
    let low = packed[Q4K_MIN_LOW + 4 * l + sb / 2] >> (4 * (sb % 2)) & 0xF;
    (byte & 63, low | (byte >> 6) << 4)
}

/// The weight formats with SIMD kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl Format {
    pub fn from_dtype(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// Values per block.
    pub fn block(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes of one GGML block.
    pub fn native_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// Bytes of one packed group-block (sixteen rows' blocks).
    pub fn packed_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 288,
            Self::Q4_1 => 320,
            Self::Q8_0 => 544,
            Self::Q4K => 2304,
            Self::Q6K => 3360,
        }
    }

    /// The activation format the kernels multiply this weight format with.
    pub fn act_kind(self) -> ActKind {
        match self {
            // Kernels multiply unsigned quants: Q4_0 stores q + 8 and Q8_0 q + 128, so each block's
            // integer sum starts from -offset * Σx.
            Self::Q4_0 => ActKind::Q8_0 {
                bias_mul: 8,
                bias_group: 32,
            },
            // Q8_0 mirrors ggml's float order, which converts every 4-value lane sum separately.
            Self::Q8_0 => ActKind::Q8_0 {
                bias_mul: 128,
                bias_group: 4,
            },
            Self::Q4_1 => ActKind::Q8_1,
            Self::Q4K | Self::Q6K => ActKind::Q8K,
        }
    }
}

/// A weight matrix in packed layout.
pub struct Packed {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row.
    pub nblk: usize,
    /// Row groups (`rows / 16` rounded up).
    pub groups: usize,
    data: AlignedBytes,
}

impl Packed {
    /// Repacks GGML-layout bytes (`rows * cols / block * native_bytes` of them).
    pub fn from_native(format: Format, rows: usize, cols: usize, native: &[u8]) -> Self {
        let nblk = cols / format.block();
        let groups = rows.div_ceil(GROUP);
        let nb = format.native_bytes();
        let pb = format.packed_bytes();
        debug_assert_eq!(native.len(), rows * nblk * nb);
        let mut data = AlignedBytes::zeroed(groups * nblk * pb);
        let zero = vec![0u8; nb];
        data.as_mut_slice()
            .par_chunks_mut(nblk * pb)
            .enumerate()
            .for_each(|(g, out)| {
                for b in 0..nblk {
                    let blocks: [&[u8]; GROUP] = std::array::from_fn(|l| {
                        let r = g * GROUP + l;
                        if r < rows {
                            let at = (r * nblk + b) * nb;
                            &native[at..at + nb]
                        } else {
                            &zero[..]
                        }
                    });
                    pack_block(format, &blocks, &mut out[b * pb..(b + 1) * pb]);
                }
            });
        Self {
            format,
            rows,
            cols,
            nblk,
            groups,
            data,
        }
    }

    /// The packed bytes of row group `g` (`nblk * packed_bytes`).
    pub fn group(&self, g: usize) -> &[u8] {
        let n = self.nblk * self.format.packed_bytes();
        &self.data.as_slice()[g * n..(g + 1) * n]
    }

    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Writes row `row` in GGML layout (`nblk * native_bytes` bytes) into `out`.
    pub fn native_row(&self, row: usize, out: &mut [u8]) {
        let nb = self.format.native_bytes();
        let pb = self.format.packed_bytes();
        let g = self.group(row / GROUP);
        for (b, o) in out.chunks_exact_mut(nb).enumerate() {
            unpack_block(self.format, &g[b * pb..(b + 1) * pb], row % GROUP, o);
        }
    }

    /// The whole matrix in GGML layout.
    pub fn to_native(&self) -> Vec<u8> {
        let rb = self.nblk * self.format.native_bytes();
        let mut out = vec![0u8; self.rows * rb];
        for (r, o) in out.chunks_exact_mut(rb).enumerate() {
            self.native_row(r, o);
        }
        out
    }
}

fn f16_bytes(src: &[u8], at: usize) -> [u8; 2] {
    [src[at], src[at + 1]]
}

/// Copies dword `i` of every lane's source slice (at byte offset `src_at + 4i`) into chunk `i`.
fn interleave_dwords(blocks: &[&[u8]; GROUP], src_at: usize, n: usize, xor: u8, out: &mut [u8]) {
    let mask = u32::from_ne_bytes([xor; 4]);
    for (l, blk) in blocks.iter().enumerate() {
        let src = &blk[src_at..src_at + 4 * n];
        for (i, d) in src.chunks_exact(4).enumerate() {
            let v = u32::from_ne_bytes([d[0], d[1], d[2], d[3]]) ^ mask;
            out[64 * i + 4 * l..64 * i + 4 * l + 4].copy_from_slice(&v.to_ne_bytes());
        }
    }
}

fn deinterleave_dwords(packed: &[u8], lane: usize, n: usize, xor: u8, out: &mut [u8]) {
    for i in 0..n {
        for k in 0..4 {
            out[4 * i + k] = packed[64 * i + 4 * lane + k] ^ xor;
        }
    }
}

/// GGML's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j`.
pub fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The inverse of [`q4k_scale_min`] (all 96 bits are used, so this is a bijection).
fn q4k_encode_scales(sc: &[u8; 8], m: &[u8; 8], q: &mut [u8]) {
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
}

/// Q6_K: (ql byte, nibble shift, qh byte, bit shift) of element `e` in GGML's layout.
fn q6k_native_pos(e: usize) -> (usize, u32, usize, u32) {
    let (h, r) = (e / 128, e % 128);
    let (q, l) = (r / 32, r % 32);
    (
        64 * h + l + 32 * (q & 1),
        if q < 2 { 0 } else { 4 },
        32 * h + l,
        2 * q as u32,
    )
}

/// Q6_K: (low-nibble byte, nibble shift, high-bits byte, bit shift) of element `e` in a packed
/// group-block for lane `l`.
fn q6k_packed_pos(e: usize, l: usize) -> (usize, u32, usize, u32) {
    let (cc, kg, i) = (e / 32, (e % 32) / 4, e % 4);
    let c = 8 * (cc / 2) + kg;
    let d = 2 * cc + kg / 4;
    (
        64 * c + 4 * l + i,
        if cc % 2 == 0 { 0 } else { 4 },
        2048 + 64 * d + 4 * l + i,
        2 * (kg % 4) as u32,
    )
}

fn pack_block(format: Format, blocks: &[&[u8]; GROUP], out: &mut [u8]) {
    match format {
        Format::Q4_0 => {
            interleave_dwords(blocks, 2, 4, 0, out);
            for (l, b) in blocks.iter().enumerate() {
                out[256 + 2 * l..258 + 2 * l].copy_from_slice(&f16_bytes(b, 0));
            }
        }
        Format::Q4_1 => {
            interleave_dwords(blocks, 4, 4, 0, out);
            for (l, b) in blocks.iter().enumerate() {
                out[256 + 2 * l..258 + 2 * l].copy_from_slice(&f16_bytes(b, 0));
                out[288 + 2 * l..290 + 2 * l].copy_from_slice(&f16_bytes(b, 2));
            }
        }
        Format::Q8_0 => {
            interleave_dwords(blocks, 2, 8, 0x80, out);
            for (l, b) in blocks.iter().enumerate() {
                out[512 + 2 * l..514 + 2 * l].copy_from_slice(&f16_bytes(b, 0));
            }
        }
        Format::Q4K => {
            interleave_dwords(blocks, 16, 32, 0, out);
            for (l, b) in blocks.iter().enumerate() {
                for sb in 0..8 {
                    let (sc, m) = q4k_scale_min(sb, &b[4..16]);
                    out[Q4K_SCALES + 16 * sb + l] = sc | (m >> 4) << 6;
                    out[Q4K_MIN_LOW + 4 * l + sb / 2] |= (m & 0xF) << (4 * (sb % 2));
                }
                out[Q4K_D + 2 * l..Q4K_D + 2 * l + 2].copy_from_slice(&f16_bytes(b, 0));
                out[Q4K_DMIN + 2 * l..Q4K_DMIN + 2 * l + 2].copy_from_slice(&f16_bytes(b, 2));
            }
        }
        Format::Q6K => {
            for (l, b) in blocks.iter().enumerate() {
                for e in 0..256 {
                    let (qa, qs, ha, hs) = q6k_native_pos(e);
                    let lo = (b[qa] >> qs) & 0xF;
                    let hi = (b[128 + ha] >> hs) & 3;
                    let (pa, ps, pha, phs) = q6k_packed_pos(e, l);
                    out[pa] |= lo << ps;
                    out[pha] |= hi << phs;
                }
                for j in 0..16 {
                    out[3072 + 32 * (j / 2) + 2 * l + j % 2] = b[192 + j];
                }
                out[3328 + 2 * l..3330 + 2 * l].copy_from_slice(&f16_bytes(b, 208));
            }
        }
    }
}

fn unpack_block(format: Format, packed: &[u8], l: usize, out: &mut [u8]) {
    match format {
        Format::Q4_0 => {
            out[..2].copy_from_slice(&f16_bytes(packed, 256 + 2 * l));
            deinterleave_dwords(packed, l, 4, 0, &mut out[2..18]);
        }
        Format::Q4_1 => {
            out[..2].copy_from_slice(&f16_bytes(packed, 256 + 2 * l));
            out[2..4].copy_from_slice(&f16_bytes(packed, 288 + 2 * l));
            deinterleave_dwords(packed, l, 4, 0, &mut out[4..20]);
        }
        Format::Q8_0 => {
            out[..2].copy_from_slice(&f16_bytes(packed, 512 + 2 * l));
            deinterleave_dwords(packed, l, 8, 0x80, &mut out[2..34]);
        }
        Format::Q4K => {
            out[..2].copy_from_slice(&f16_bytes(packed, Q4K_D + 2 * l));
            out[2..4].copy_from_slice(&f16_bytes(packed, Q4K_DMIN + 2 * l));
            let sm: [(u8, u8); 8] = std::array::from_fn(|sb| q4k_packed_scale_min(packed, sb, l));
            q4k_encode_scales(&sm.map(|p| p.0), &sm.map(|p| p.1), &mut out[4..16]);
            deinterleave_dwords(packed, l, 32, 0, &mut out[16..144]);
        }
        Format::Q6K => {
            out[..192].fill(0);
            for e in 0..256 {
                let (pa, ps, pha, phs) = q6k_packed_pos(e, l);
                let lo = (packed[pa] >> ps) & 0xF;
                let hi = (packed[pha] >> phs) & 3;
                let (qa, qs, ha, hs) = q6k_native_pos(e);
                out[qa] |= lo << qs;
                out[128 + ha] |= hi << hs;
            }
            for j in 0..16 {
                out[192 + j] = packed[3072 + 32 * (j / 2) + 2 * l + j % 2];
            }
            out[208..210].copy_from_slice(&f16_bytes(packed, 3328 + 2 * l));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u8 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u8
    }

    #[test]
    fn repack_round_trips_every_format() {
        for format in [
            Format::Q4_0,
            Format::Q4_1,
            Format::Q8_0,
            Format::Q4K,
            Format::Q6K,
        ] {
            // 37 rows: two full groups and a padded one.
            let (rows, cols) = (37, 2 * format.block());
            let mut seed = 42;
            let native: Vec<u8> = (0..rows * 2 * format.native_bytes())
                .map(|_| lcg(&mut seed))
                .collect();
            let p = Packed::from_native(format, rows, cols, &native);
            assert_eq!(p.to_native(), native, "{format:?}");
        }
    }

    #[test]
    fn q4k_scale_codec_is_a_bijection() {
        let mut seed = 7;
        for _ in 0..1000 {
            let q: [u8; 12] = std::array::from_fn(|_| lcg(&mut seed));
            let sc: [u8; 8] = std::array::from_fn(|j| q4k_scale_min(j, &q).0);
            let m: [u8; 8] = std::array::from_fn(|j| q4k_scale_min(j, &q).1);
            let mut back = [0u8; 12];
            q4k_encode_scales(&sc, &m, &mut back);
            assert_eq!(back, q);
        }
    }
}
