//! Launch configurations of the fast tier's kernels (`cuda/kernels.cu`): grid and block sizes
//! as pure functions of the shapes, so they are unit-tested on machines without a GPU and the
//! CUDA runner only passes them on. Each states the limits its kernel was written for.

use smolchat_gguf::GgmlDType;

use crate::error::{EngineError, Result};

/// Grid and block dimensions of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
}

/// Threads per block of the row-wise kernels (RMSNorm, embedding rows, row gathers).
pub const ROW_THREADS: u32 = 256;
/// Threads per block of the element-wise kernels.
pub const ELEMENT_THREADS: u32 = 256;
/// Threads per block of `attention_partial_g*` (its `__launch_bounds__`).
pub const ATTENTION_THREADS: u32 = 128;
/// The largest head dimension the attention kernels take (each thread owns two dimensions).
pub const MAX_HEAD_DIM: usize = 2 * ATTENTION_THREADS as usize;
/// The most query heads per KV head the attention kernels are instantiated for.
pub const MAX_GROUP: usize = 8;
/// The largest grid dimension y and z on every CUDA device.
const MAX_GRID_YZ: usize = 65_535;

fn dim(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n)
        .map_err(|_| EngineError::InvalidStep(format!("{what} {n} is too large for a launch")))
}

/// One block per row.
pub fn per_row(rows: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (dim(rows, "rows")?, 1, 1),
        block: (ROW_THREADS, 1, 1),
    })
}

/// `n` values, one per thread.
pub fn elementwise(n: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (
            dim(n.div_ceil(ELEMENT_THREADS as usize).max(1), "values")?,
            1,
            1,
        ),
        block: (ELEMENT_THREADS, 1, 1),
    })
}

/// `silu_mul_q8_1` and `quantize_rows_q8_1`: rows of `cols_padded` values (a multiple of [`ELEMENT_THREADS`], as
/// [`crate::fast::layout::padded_columns`] makes them), one thread per value, one block per
/// [`ELEMENT_THREADS`] values of a row, so each warp quantizes whole Q8_1 blocks.
pub fn silu_mul_q8_1(rows: usize, cols_padded: usize) -> Result<Launch> {
    if !cols_padded.is_multiple_of(ELEMENT_THREADS as usize) {
        return Err(EngineError::InvalidStep(format!(
            "silu_mul_q8_1 takes rows padded to a multiple of {ELEMENT_THREADS} values, not {cols_padded}"
        )));
    }
    Ok(Launch {
        grid: (
            dim((cols_padded / ELEMENT_THREADS as usize).max(1), "values")?,
            dim(rows, "rows")?,
            1,
        ),
        block: (ELEMENT_THREADS, 1, 1),
    })
}

/// Whether a step of `rows` rows quantizes a matmul's input in the kernel that writes it
/// (`rms_norm` with a Q8_1 output, `silu_mul_q8_1`): when its matmuls take our matvec, whose Q8_1
/// rows those kernels write; MMQ reads another layout, quantized by its own launch.
pub fn quantizes_in_place(rows: usize) -> bool {
    crate::fast::plan::matvec_rows(rows)
}

/// `kv_write`: one block per (row, KV head), one thread per dimension.
pub fn kv_write(rows: usize, kv_heads: usize, head_dim: usize) -> Result<Launch> {
    if head_dim > 1024 {
        return Err(EngineError::InvalidStep(format!(
            "head dimension {head_dim} is over 1024"
        )));
    }
    Ok(Launch {
        grid: (dim(rows, "rows")?, dim(kv_heads, "KV heads")?, 1),
        block: (dim(head_dim, "head dim")?, 1, 1),
    })
}

/// `rope_kv_write`: one block per (row, query or KV head), one thread per dimension (the first
/// `rope_dim / 2` rotate a pair each).
pub fn rope_kv_write(
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rope_dim: usize,
) -> Result<Launch> {
    if head_dim > 1024
        || !rope_dim.is_multiple_of(2)
        || rope_dim > head_dim
        || heads + kv_heads > MAX_GRID_YZ
    {
        return Err(EngineError::InvalidStep(format!(
            "rope_kv_write takes an even rope dimension within a head of at most 1024 and at \
             most {MAX_GRID_YZ} heads, not {rope_dim} of {head_dim} and {heads} + {kv_heads}"
        )));
    }
    Ok(Launch {
        grid: (dim(rows, "rows")?, dim(heads + kv_heads, "heads")?, 1),
        block: (dim(head_dim, "head dim")?, 1, 1),
    })
}

/// The attention kernel instance for `heads / kv_heads` query heads per KV head.
pub fn attention_kernel(heads: usize, kv_heads: usize, head_dim: usize) -> Result<&'static str> {
    const NAMES: [&str; MAX_GROUP] = [
        "attention_partial_g1",
        "attention_partial_g2",
        "attention_partial_g3",
        "attention_partial_g4",
        "attention_partial_g5",
        "attention_partial_g6",
        "attention_partial_g7",
        "attention_partial_g8",
    ];
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(EngineError::InvalidStep(format!(
            "{heads} query heads do not share {kv_heads} KV heads evenly"
        )));
    }
    if head_dim > MAX_HEAD_DIM {
        return Err(EngineError::InvalidStep(format!(
            "head dimension {head_dim} is over the attention kernel's {MAX_HEAD_DIM}"
        )));
    }
    let group = heads / kv_heads;
    NAMES.get(group.wrapping_sub(1)).copied().ok_or_else(|| {
        EngineError::InvalidStep(format!(
            "{group} query heads per KV head is over the attention kernel's {MAX_GROUP}"
        ))
    })
}

/// The decode attention kernel for one-row sequences (`attention_decode_d*_g*`: queries in
/// registers, 16-byte K/V loads, the splits merged by the last block to finish), when the head
/// dimension and group have an instance (64 or 128, 1 to 8 query heads per KV head); `None`
/// otherwise (the split kernel and the merge then serve them).
pub fn attention_decode_kernel(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Option<&'static str> {
    const D64: [&str; MAX_GROUP] = [
        "attention_decode_d64_g1",
        "attention_decode_d64_g2",
        "attention_decode_d64_g3",
        "attention_decode_d64_g4",
        "attention_decode_d64_g5",
        "attention_decode_d64_g6",
        "attention_decode_d64_g7",
        "attention_decode_d64_g8",
    ];
    const D128: [&str; MAX_GROUP] = [
        "attention_decode_d128_g1",
        "attention_decode_d128_g2",
        "attention_decode_d128_g3",
        "attention_decode_d128_g4",
        "attention_decode_d128_g5",
        "attention_decode_d128_g6",
        "attention_decode_d128_g7",
        "attention_decode_d128_g8",
    ];
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return None;
    }
    let names = match head_dim {
        64 => &D64,
        128 => &D128,
        _ => return None,
    };
    names.get((heads / kv_heads).wrapping_sub(1)).copied()
}

/// Context splits the partial buffers need room for: the most any decode row of the step can
/// have (no row seeing more than `max_visible` positions).
pub fn max_splits(max_visible: usize) -> usize {
    crate::fast::twin::attention::max_splits(max_visible)
}

/// `attention_partial_g*`: one block per (row, KV head, split); blocks past a row's own splits
/// return at once.
pub fn attention_partial(rows: usize, kv_heads: usize, splits: usize) -> Result<Launch> {
    if splits > MAX_GRID_YZ || kv_heads > MAX_GRID_YZ {
        return Err(EngineError::InvalidStep(format!(
            "{splits} splits or {kv_heads} KV heads are over the grid's limit"
        )));
    }
    Ok(Launch {
        grid: (
            dim(rows, "rows")?,
            dim(kv_heads, "KV heads")?,
            dim(splits, "splits")?,
        ),
        block: (ATTENTION_THREADS, 1, 1),
    })
}

/// Threads per block of `flash_prefill_d*`: four warps, each 16 of the tile's (row, head)
/// pairs (its `__launch_bounds__`).
pub const FLASH_THREADS: u32 = 128;

/// Whether multi-row sequences' attention runs on the tensor-core flash kernel: when the head
/// dimension has an instance. It does not depend on the step's other rows, so a prompt's rows
/// are computed alike alone or batched; one-row (decode) sequences, drafts' verifying rows
/// included, always take the split kernel, so drafts never change a reply.
pub fn uses_flash(head_dim: usize) -> bool {
    flash_kernel(head_dim).is_some()
}

/// The flash kernel instance for `head_dim`, if there is one.
pub fn flash_kernel(head_dim: usize) -> Option<&'static str> {
    match head_dim {
        64 => Some("flash_prefill_d64"),
        128 => Some("flash_prefill_d128"),
        _ => None,
    }
}

/// `flash_prefill_d*`: one block per (tile, KV head); `tiles` from
/// [`crate::fast::twin::flash::tiles`] (two values each).
pub fn flash_prefill(tiles: usize, kv_heads: usize) -> Result<Launch> {
    if kv_heads > MAX_GRID_YZ {
        return Err(EngineError::InvalidStep(format!(
            "{kv_heads} KV heads are over the grid's limit"
        )));
    }
    Ok(Launch {
        grid: (dim(tiles, "flash tiles")?, dim(kv_heads, "KV heads")?, 1),
        block: (FLASH_THREADS, 1, 1),
    })
}

/// `attention_merge`: one block per (row, head), one thread per dimension.
pub fn attention_merge(rows: usize, heads: usize, head_dim: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (dim(rows, "rows")?, dim(heads, "heads")?, 1),
        block: (dim(head_dim, "head dim")?, 1, 1),
    })
}

/// The embedding kernel for a table of `dtype`.
pub fn get_rows_kernel(dtype: GgmlDType) -> Result<&'static str> {
    Ok(match dtype {
        GgmlDType::Q4_0 => "get_rows_q4_0",
        GgmlDType::Q4_1 => "get_rows_q4_1",
        GgmlDType::Q5_0 => "get_rows_q5_0",
        GgmlDType::Q5_1 => "get_rows_q5_1",
        GgmlDType::Q8_0 => "get_rows_q8_0",
        GgmlDType::Q2K => "get_rows_q2_k",
        GgmlDType::Q3K => "get_rows_q3_k",
        GgmlDType::Q4K => "get_rows_q4_k",
        GgmlDType::Q5K => "get_rows_q5_k",
        GgmlDType::Q6K => "get_rows_q6_k",
        other => {
            return Err(EngineError::InvalidStep(format!(
                "the fast tier has no embedding kernel for {other:?}"
            )))
        }
    })
}

/// Rows of activations one matvec launch takes (llama.cpp's `MMVQ_MAX_BATCH_SIZE` too): the
/// steps of decode and drafts' verification; wider steps take MMQ or the f16 GEMM.
pub const MATVEC_MAX_ROWS: usize = crate::fast::twin::matvec::MAX_ROWS;

/// The most rows a step of `rows` rows may grow to (a decode verifying drafts) with every row's
/// matmul outputs still computed bit for bit as before, so that drafts never change a reply.
/// Up to 8 rows the matmuls are our matvec kernels (`fast::twin::matvec`), which compute a row
/// the same way whatever the other rows and their number: one class, 1 to 8 rows, so a lone
/// conversation may verify 7 drafts. (candle's MMVQ, which they replace, had two: its warps per
/// block changed between 4 and 5 rows.) Above 8 rows MMQ's tiles and the f16 GEMM's are chosen
/// by the row count, so no growth is known to keep their sums.
pub fn rows_computed_alike(rows: usize) -> usize {
    if crate::fast::plan::matvec_rows(rows) {
        MATVEC_MAX_ROWS
    } else {
        rows
    }
}

/// How a matmul over `rows` activation rows is launched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatMulPath {
    /// Our matvec kernels, one launch of at most [`MATVEC_MAX_ROWS`] rows (Q8_1 activations).
    MatVec,
    /// MMQ: tiled, int8 tensor-core MMA, stream-k (Q8_1 activations in MMQ's layout).
    Mmq,
    /// The weights' f16 copy times the activations rounded to f16, cuBLAS `GemmEx` with f32
    /// accumulation (`fast::twin::f16mm`).
    F16,
}

/// Our matvec kernels up to [`MATVEC_MAX_ROWS`] rows (where llama.cpp's CUDA backend takes
/// MMVQ); above, the f16
/// GEMM when the weights have an f16 copy on the device (`f16`), else MMQ. The f16 GEMM reads
/// 2 bytes a weight instead of ~0.6 but runs on the tensor cores at their f16 rate, where MMQ
/// is bound by its integer tiles and the activations' quantization from a few dozen rows up
/// (issue 48: a 64-row step of the 3B shape took ~10 ms against a ~0.6 ms read floor).
/// Steps of at most 8 rows (every step that may carry drafts) are untouched.
pub fn matmul_path(rows: usize, f16: bool) -> MatMulPath {
    if crate::fast::plan::matvec_rows(rows) {
        MatMulPath::MatVec
    } else if f16 {
        MatMulPath::F16
    } else {
        MatMulPath::Mmq
    }
}

/// Whether a model whose f16 weight copies take `f16_bytes` keeps them on a device with
/// `free_bytes` free after its quantized weights: when they take at most a quarter of it, so
/// the KV cache and the step buffers keep the rest (on an 80 GB H100 the 3B shape's 6.2 GB
/// copy qualifies; on a 24 GB card it does not, and MMQ serves the wide steps).
pub fn keeps_f16_weights(f16_bytes: usize, free_bytes: usize) -> bool {
    f16_bytes <= free_bytes / 4
}

/// The kernel writing a `dtype` matrix's f16 copy.
pub fn dequantize_f16_kernel(dtype: GgmlDType) -> Result<&'static str> {
    Ok(match dtype {
        GgmlDType::Q4_0 => "dequantize_f16_q4_0",
        GgmlDType::Q4_1 => "dequantize_f16_q4_1",
        GgmlDType::Q5_0 => "dequantize_f16_q5_0",
        GgmlDType::Q5_1 => "dequantize_f16_q5_1",
        GgmlDType::Q8_0 => "dequantize_f16_q8_0",
        GgmlDType::Q2K => "dequantize_f16_q2_k",
        GgmlDType::Q3K => "dequantize_f16_q3_k",
        GgmlDType::Q4K => "dequantize_f16_q4_k",
        GgmlDType::Q5K => "dequantize_f16_q5_k",
        GgmlDType::Q6K => "dequantize_f16_q6_k",
        other => {
            return Err(EngineError::InvalidStep(format!(
                "the fast tier has no f16 dequantization kernel for {other:?}"
            )))
        }
    })
}

/// Bytes of one `block_q8_1_mmq` (128 values as int8 and 16 bytes of scales).
pub const BLOCK_Q8_1_MMQ_BYTES: usize = 144;

/// Values of one `block_q8_1_mmq`.
pub const QK8_1_MMQ: usize = 128;

/// The tallest MMQ tile along the activation rows (`mmq_x` of the MMA path): MMQ reads up to a
/// tile past the last row, so its activation buffer has this many rows of slack.
pub const MMQ_X_MAX: usize = 128;

/// Bytes of MMQ's activations for `rows` rows of `k` values: rows padded like the weights'
/// (to [`MATRIX_ROW_PADDING`](super::layout::MATRIX_ROW_PADDING), a multiple of 128), plus
/// the slack of [`MMQ_X_MAX`] blocks.
pub fn mmq_activation_bytes(rows: usize, k: usize) -> usize {
    let blocks = super::layout::padded_columns(k) / QK8_1_MMQ;
    rows * blocks * BLOCK_Q8_1_MMQ_BYTES + MMQ_X_MAX * BLOCK_Q8_1_MMQ_BYTES
}

/// Bytes of MMQ's stream-k fix-up buffer: one 128×128 f32 tile per SM, for up to 256 SMs.
pub const MMQ_FIXUP_BYTES: usize = 256 * 128 * 128 * 4;

/// The scale layout of MMQ's activation blocks a weight type's kernel reads (llama.cpp's
/// `mmq_get_q8_1_ds_layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmqScales {
    /// Four scales `d`, one per 32 values.
    D4,
    /// Four (`d`, sum) pairs.
    DS4,
    /// Two scales and six partial sums (Q2_K).
    D2S6,
}

pub fn mmq_scales(dtype: GgmlDType) -> Result<MmqScales> {
    Ok(match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_1 => MmqScales::DS4,
        GgmlDType::Q4K | GgmlDType::Q5K => MmqScales::DS4,
        GgmlDType::Q5_0 | GgmlDType::Q8_0 | GgmlDType::Q3K | GgmlDType::Q6K => MmqScales::D4,
        GgmlDType::Q2K => MmqScales::D2S6,
        other => {
            return Err(EngineError::InvalidStep(format!(
                "no MMQ kernel for {other:?}"
            )))
        }
    })
}

/// Weight values in one block of `dtype` (32, or 256 for the K-quants).
pub fn block_values(dtype: GgmlDType) -> usize {
    dtype.block_size()
}

/// Zeroed bytes after a quantized weight's last row on the GPU: one
/// [`MATRIX_ROW_PADDING`](super::layout::MATRIX_ROW_PADDING) of values in `dtype`'s blocks.
pub fn weight_slack_bytes(dtype: GgmlDType) -> usize {
    super::layout::MATRIX_ROW_PADDING / block_values(dtype) * dtype.type_size()
}

/// Threads of `sample_rows`' block (one block per logit row; its `__launch_bounds__`).
pub const SAMPLE_THREADS: u32 = 512;

/// `sample_rows`: one block of [`SAMPLE_THREADS`] per logit row.
pub fn sample_rows(rows: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (dim(rows, "logit rows")?, 1, 1),
        block: (SAMPLE_THREADS, 1, 1),
    })
}

/// `apply_penalties`: one block of 64 threads per logit row (a row has at most a window's
/// worth of distinct tokens).
pub fn apply_penalties(rows: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (dim(rows, "logit rows")?, 1, 1),
        block: (64, 1, 1),
    })
}

/// Warps (weight rows) per block of `matvec_*` (`MATVEC_WARPS` in the kernels).
pub const MATVEC_WARPS: usize = 4;
/// Warps per block of `matvec_swiglu_*` (`SWIGLU_WARPS`): 32 outputs a block, one Q8_1 block
/// of every row.
pub const SWIGLU_WARPS: usize = 8;

/// The matvec kernels for weights of `dtype`: (`matvec_<type>`, `matvec_swiglu_<type>`).
pub fn matvec_kernel(dtype: GgmlDType) -> Result<(&'static str, &'static str)> {
    Ok(match dtype {
        GgmlDType::Q4_0 => ("matvec_q4_0", "matvec_swiglu_q4_0"),
        GgmlDType::Q4_1 => ("matvec_q4_1", "matvec_swiglu_q4_1"),
        GgmlDType::Q5_0 => ("matvec_q5_0", "matvec_swiglu_q5_0"),
        GgmlDType::Q5_1 => ("matvec_q5_1", "matvec_swiglu_q5_1"),
        GgmlDType::Q8_0 => ("matvec_q8_0", "matvec_swiglu_q8_0"),
        GgmlDType::Q2K => ("matvec_q2_k", "matvec_swiglu_q2_k"),
        GgmlDType::Q3K => ("matvec_q3_k", "matvec_swiglu_q3_k"),
        GgmlDType::Q4K => ("matvec_q4_k", "matvec_swiglu_q4_k"),
        GgmlDType::Q5K => ("matvec_q5_k", "matvec_swiglu_q5_k"),
        GgmlDType::Q6K => ("matvec_q6_k", "matvec_swiglu_q6_k"),
        other => {
            return Err(EngineError::InvalidStep(format!(
                "the fast tier has no matvec kernel for {other:?}"
            )))
        }
    })
}

/// `matvec_*` over the rows of up to three matrices (`outputs` in all) and `rows` activation
/// rows: one warp per output, [`MATVEC_WARPS`] a block.
pub fn matvec(outputs: usize, rows: usize) -> Result<Launch> {
    if rows == 0 || rows > MATVEC_MAX_ROWS {
        return Err(EngineError::InvalidStep(format!(
            "the matvec kernels take 1 to {MATVEC_MAX_ROWS} rows, not {rows}"
        )));
    }
    Ok(Launch {
        grid: (dim(outputs.div_ceil(MATVEC_WARPS).max(1), "outputs")?, 1, 1),
        block: (32 * MATVEC_WARPS as u32, 1, 1),
    })
}

/// `matvec_swiglu_*`: one block per 32 of the `cols_padded` outputs (a multiple of 32).
pub fn matvec_swiglu(cols_padded: usize, rows: usize) -> Result<Launch> {
    if rows == 0 || rows > MATVEC_MAX_ROWS || !cols_padded.is_multiple_of(QK8_1_VALUES) {
        return Err(EngineError::InvalidStep(format!(
            "matvec_swiglu takes 1 to {MATVEC_MAX_ROWS} rows padded to a multiple of 32 values, \
             not {rows} rows of {cols_padded}"
        )));
    }
    Ok(Launch {
        grid: (dim((cols_padded / QK8_1_VALUES).max(1), "outputs")?, 1, 1),
        block: (32 * SWIGLU_WARPS as u32, 1, 1),
    })
}

/// Values of a Q8_1 block.
const QK8_1_VALUES: usize = 32;

/// Every kernel name `cuda/kernels.cu` must define.
pub fn kernel_names() -> Vec<&'static str> {
    let mut names = vec![
        "rms_norm",
        "add_f32",
        "silu_mul",
        "silu_mul_q8_1",
        "quantize_rows_q8_1",
        "gather_rows",
        "kv_write",
        "rope_kv_write",
        "attention_merge",
        "apply_penalties",
        "sample_rows",
        "f32_to_f16",
    ];
    for dtype in crate::fast::weights::MATRIX_TYPES {
        names.extend(get_rows_kernel(dtype));
        names.extend(dequantize_f16_kernel(dtype));
        names.extend(matvec_kernel(dtype).into_iter().flat_map(|(a, b)| [a, b]));
    }
    for group in 1..=MAX_GROUP {
        names.extend(attention_kernel(group, 1, 64));
        for head_dim in crate::fast::twin::flash::HEAD_DIMS {
            names.extend(attention_decode_kernel(group, 1, head_dim));
        }
    }
    for head_dim in crate::fast::twin::flash::HEAD_DIMS {
        names.extend(flash_kernel(head_dim));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::twin::attention::{MAX_SPLITS, MIN_SPLIT_POSITIONS};

    #[test]
    fn every_named_kernel_is_in_the_kernel_source() {
        let source = include_str!("cuda/kernels.cu");
        for name in kernel_names() {
            // The attention instances come from a macro (checked below); the rest are written out.
            if let Some(group) = name.strip_prefix("attention_partial_g") {
                assert!(
                    source.contains(&format!("ATTENTION_PARTIAL({group})")),
                    "{name}"
                );
            } else if let Some(rest) = name.strip_prefix("attention_decode_d") {
                let (d, g) = rest.split_once("_g").expect("d and g");
                assert!(
                    source.contains(&format!("ATTENTION_DECODE({d}, {g})")),
                    "{name}"
                );
            } else if let Some(d) = name.strip_prefix("flash_prefill_d") {
                assert!(source.contains(&format!("FLASH_PREFILL({d})")), "{name}");
            } else if let Some(kind) = name.strip_prefix("dequantize_f16_") {
                assert!(
                    source.contains(&format!("DEQUANTIZE_F16({kind}, ")),
                    "{name}"
                );
            } else if let Some(kind) = name.strip_prefix("get_rows_") {
                assert!(source.contains(&format!("GET_ROWS({kind}, ")), "{name}");
            } else if let Some(kind) = name
                .strip_prefix("matvec_swiglu_")
                .or_else(|| name.strip_prefix("matvec_"))
            {
                assert!(source.contains(&format!("MATVEC({kind}, ")), "{name}");
            } else {
                // `void name(` or `void __launch_bounds__(…) name(`.
                assert!(
                    source.contains(&format!("void {name}("))
                        || source.contains(&format!(") {name}(")),
                    "{name} is not in kernels.cu"
                );
            }
        }
        // The instances the macro makes are exactly the groups launch.rs names.
        for group in 1..=MAX_GROUP {
            assert!(
                source.contains(&format!("ATTENTION_PARTIAL({group})")),
                "group {group}"
            );
        }
        assert!(!source.contains(&format!("ATTENTION_PARTIAL({})", MAX_GROUP + 1)));
        // The constants the kernels hard-code agree with the Rust side.
        for (name, value) in [
            ("MIN_SPLIT_POSITIONS", MIN_SPLIT_POSITIONS),
            ("MAX_SPLITS", MAX_SPLITS),
            ("MAX_GROUP", MAX_GROUP),
            ("MAX_HEAD_DIM", MAX_HEAD_DIM),
            ("BLOCK_POSITIONS", crate::kv::BLOCK_POSITIONS),
        ] {
            assert!(
                source.contains(&format!("#define {name} {value}\n")),
                "{name} must be {value} in kernels.cu"
            );
        }
        assert!(source.contains(&format!("__launch_bounds__({ATTENTION_THREADS}, 4)")));
        {
            use crate::fast::twin::flash::{CHUNK_KEYS, TILE_PAIRS};
            assert_eq!(TILE_PAIRS, 16 * FLASH_THREADS as usize / 32);
            assert!(source.contains(&format!("#define FLASH_THREADS {FLASH_THREADS}\n")));
            assert!(source.contains(&format!("#define FLASH_KEYS {CHUNK_KEYS}\n")));
            assert!(source.contains(&format!("__launch_bounds__({FLASH_THREADS}, 2)")));
        }
        assert_eq!(crate::fast::graph::SKIP_SLOT, 0xffff_ffff);
        assert!(source.contains("#define SKIP_SLOT 0xffffffffu\n"));
        assert!(source.contains(&format!("#define SAMPLE_THREADS {SAMPLE_THREADS}\n")));
        assert!(source.contains("__launch_bounds__(SAMPLE_THREADS)"));
        assert_eq!(crate::fast::twin::sample::NO_TOKEN, 0xffff_ffff);
        assert!(source.contains("#define NO_TOKEN 0xffffffffu\n"));
        // The exponential's constants are the twin's bit patterns.
        use crate::fast::twin::sample::{LN2_HI, LN2_LO, LOG2E, POLY};
        for bits in [LOG2E, LN2_HI, LN2_LO].iter().chain(&POLY) {
            let literal = format!("__uint_as_float(0x{bits:08x}u)");
            assert!(source.contains(&literal), "{literal} is not in kernels.cu");
        }
    }

    #[test]
    fn matmuls_take_matvec_up_to_eight_rows_and_mmq_or_f16_above() {
        for f16 in [false, true] {
            assert_eq!(matmul_path(1, f16), MatMulPath::MatVec);
            assert_eq!(matmul_path(8, f16), MatMulPath::MatVec);
        }
        assert_eq!(matmul_path(9, false), MatMulPath::Mmq);
        assert_eq!(matmul_path(512, false), MatMulPath::Mmq);
        assert_eq!(matmul_path(9, true), MatMulPath::F16);
        assert_eq!(matmul_path(512, true), MatMulPath::F16);
        // The 3B shape's 6.2 GB of f16 copies on an 80 GB card, not on a 24 GB one.
        assert!(keeps_f16_weights(6_200 << 20, 76 << 30));
        assert!(!keeps_f16_weights(6_200 << 20, 21 << 30));
        // SmolLM3's hidden size 2048: 16 MMQ blocks per row, plus 128 blocks of slack.
        assert_eq!(mmq_activation_bytes(10, 2048), (10 * 16 + 128) * 144);
        // 576 (SmolLM2) pads to 1024: 8 blocks per row.
        assert_eq!(mmq_activation_bytes(1, 576), (8 + 128) * 144);
        assert_eq!(mmq_scales(GgmlDType::Q4K).ok(), Some(MmqScales::DS4));
        assert_eq!(mmq_scales(GgmlDType::Q6K).ok(), Some(MmqScales::D4));
        assert_eq!(mmq_scales(GgmlDType::Q8_0).ok(), Some(MmqScales::D4));
        assert_eq!(mmq_scales(GgmlDType::Q2K).ok(), Some(MmqScales::D2S6));
        assert!(mmq_scales(GgmlDType::F16).is_err());
        for t in [
            GgmlDType::Q4_0,
            GgmlDType::Q8_0,
            GgmlDType::Q6K,
            GgmlDType::Q4K,
        ] {
            assert!(crate::fast::weights::supported(t) && mmq_scales(t).is_ok());
        }
        assert_eq!(block_values(GgmlDType::Q4K), 256);
        assert_eq!(block_values(GgmlDType::Q8_0), 32);
    }

    #[test]
    fn shapes_become_grids_within_the_kernels_limits() {
        // SmolLM3-3B: 16 heads over 4 KV heads of 128; SmolLM2: 9 over 3 of 64.
        assert_eq!(
            attention_kernel(16, 4, 128).ok(),
            Some("attention_partial_g4")
        );
        assert_eq!(
            attention_kernel(9, 3, 64).ok(),
            Some("attention_partial_g3")
        );
        assert!(attention_kernel(32, 2, 128).is_err(), "16 per KV head");
        assert!(attention_kernel(16, 3, 128).is_err(), "uneven");
        assert!(attention_kernel(8, 8, 512).is_err(), "head dim 512");
        assert_eq!(
            attention_decode_kernel(16, 4, 128),
            Some("attention_decode_d128_g4")
        );
        assert_eq!(
            attention_decode_kernel(9, 3, 64),
            Some("attention_decode_d64_g3")
        );
        assert_eq!(attention_decode_kernel(16, 4, 96), None, "no instance");
        // The decode kernel leaves every sequence of two rows or more to the flash kernel,
        // which must then have an instance for the same head dimensions.
        assert_eq!(crate::fast::twin::flash::MIN_ROWS, 2);
        for head_dim in [64, 128] {
            assert!(attention_decode_kernel(8, 8, head_dim).is_some() && uses_flash(head_dim));
        }
        assert_eq!(attention_decode_kernel(32, 2, 128), None, "16 per KV head");
        assert_eq!(max_splits(1), 1);
        assert_eq!(max_splits(64), 1);
        // Drafts may grow a step within the matvec kernels' one class (1 to 8 rows: a lone
        // conversation verifies up to 7), and graph buckets stay in it.
        assert_eq!(rows_computed_alike(1), 8);
        assert_eq!(rows_computed_alike(4), 8);
        assert_eq!(rows_computed_alike(5), 8);
        assert_eq!(rows_computed_alike(9), 9);
        for rows in 1..=8 {
            let bucket = crate::fast::graph::bucket_rows(rows).expect("a bucket");
            assert_eq!(
                rows_computed_alike(bucket),
                rows_computed_alike(rows),
                "{rows}"
            );
        }
        assert_eq!(
            matvec(2048 + 512 + 512, 1).map(|l| l.grid.0).ok(),
            Some(768)
        );
        assert_eq!(
            matvec(5, 8).map(|l| (l.grid.0, l.block.0)).ok(),
            Some((2, 128))
        );
        assert!(matvec(5, 9).is_err() && matvec(5, 0).is_err());
        assert_eq!(
            matvec_swiglu(11008, 1).map(|l| (l.grid.0, l.block.0)).ok(),
            Some((344, 256))
        );
        assert!(matvec_swiglu(11000, 1).is_err());
        assert_eq!(max_splits(65), 2);
        assert_eq!(max_splits(512), 8);
        assert_eq!(max_splits(131_072), 32);
        // A bound on every shorter row's splits, though those are not monotonic.
        for max in [1usize, 100, 2048, 2049, 3000, 70_000] {
            let most = (1..=max).map(crate::fast::twin::attention::splits).max();
            assert!(most <= Some(max_splits(max)), "{max}");
        }
        let l = attention_partial(64, 4, 256).expect("launch");
        assert_eq!(l.grid, (64, 4, 256));
        assert_eq!(l.block, (ATTENTION_THREADS, 1, 1));
        assert_eq!(elementwise(1).map(|l| l.grid.0).ok(), Some(1));
        // SmolLM3's FFN width 11008 pads to 11264: 44 blocks of 256 values a row.
        let padded = crate::fast::layout::padded_columns(11008);
        assert_eq!(
            silu_mul_q8_1(3, padded).map(|l| (l.grid, l.block)).ok(),
            Some(((44, 3, 1), (256, 1, 1)))
        );
        assert!(
            silu_mul_q8_1(1, 11000).is_err(),
            "not a multiple of the block"
        );
        assert!(quantizes_in_place(1) && quantizes_in_place(8) && !quantizes_in_place(9));
        // rms_norm's quantizing loop runs whole padded rows in steps of its block.
        let pad = crate::fast::layout::MATRIX_ROW_PADDING;
        assert!(
            pad.is_multiple_of(ROW_THREADS as usize)
                && pad.is_multiple_of(ELEMENT_THREADS as usize)
        );
        assert_eq!(elementwise(257).map(|l| l.grid.0).ok(), Some(2));
        assert_eq!(kv_write(5, 4, 128).map(|l| l.block.0).ok(), Some(128));
        assert_eq!(
            rope_kv_write(5, 16, 4, 128, 128)
                .map(|l| (l.grid, l.block))
                .ok(),
            Some(((5, 20, 1), (128, 1, 1)))
        );
        assert!(
            rope_kv_write(1, 16, 4, 64, 128).is_err(),
            "rope wider than the head"
        );
        assert!(
            rope_kv_write(1, 16, 4, 128, 127).is_err(),
            "odd rope dimension"
        );
        assert!(get_rows_kernel(GgmlDType::F32).is_err());
    }
}
