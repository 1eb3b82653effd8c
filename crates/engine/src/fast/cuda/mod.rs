//! The CUDA runner: executes a [`Plan`] on one GPU. Quantized matmuls of up to 8 rows are our
//! matvec kernels (Q8_1 activations), wider ones llama.cpp's MMQ as candle-kernels exports it
//! (`candle_kernels::ffi`) or cuBLAS over f16 weight copies; everything else is our own kernels
//! (`kernels.cu`, compiled to PTX for sm_90 by the build script), launched with the
//! configurations of [`crate::fast::launch`]. One stream, no event tracking (the runner orders
//! its work itself), every buffer allocated before the operations run: the step itself neither
//! allocates nor copies to the host until the logits come back.
//!
//! Nothing here runs without a GPU; what it computes is fixed by the twins (`fast::twin`),
//! which the CPU runner executes in CI, and `make gpu-check` compares the two on a GPU.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublas::{self, CudaBlas};
use candle_core::cuda_backend::cudarc::driver::{
    result as driver_result, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule,
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, LaunchConfig, PinnedHostSlice,
    PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use smolchat_gguf::GgmlDType;

use super::graph::{CaptureGuard, GraphAction, GraphCache, GraphKey, GraphStats};
use super::launch::{self, Launch};
use super::layout::{padded_columns, BlockQ8_1, KvArena, StepTables, BLOCK_Q8_1_BYTES, QK8_1};
use super::packed::{self, PackedLayout, Region};
use super::plan::{matrix_shape, Buf, Matrix, Norm, Op, Plan, BUFFERS};
use super::twin::flash;
use super::weights::{FastWeights, RawMatrix};
use super::Runner;
use crate::backend::Suggested;
use crate::config::ModelConfig;
use crate::device::Device;
use crate::error::{EngineError, Result};
use crate::rope::RopeTable;

mod matmul;
mod pdl;

use matmul::DeviceInfo;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fast_kernels.ptx"));

fn cuda(e: DriverError) -> EngineError {
    EngineError::Cuda(e.to_string())
}

struct DeviceMatrix {
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    data: CudaSlice<u8>,
}

/// The step's tables: packed into one device buffer ([`packed`]), uploaded in one copy from
/// one pinned host buffer, and the flash kernel's tiles (prompt steps only) on their own.
#[derive(Default)]
struct Tables {
    layout: PackedLayout,
    device: Option<CudaSlice<u8>>,
    host: Option<PinnedHostSlice<u8>>,
    /// Recorded after the last upload: the host buffer is written again only once it has
    /// been copied.
    uploaded: Option<CudaEvent>,
    /// The flash kernel's tiles (`fast::twin::flash::tiles`), two values each, and how many.
    flash_tiles: Option<CudaSlice<u32>>,
    flash_tile_count: usize,
    /// Every position's RoPE row (`[position][rope_dim / 2]`), computed once on the host and
    /// kept here: `rope_kv_write` finds a row's by its position, so a step uploads no RoPE.
    rope: crate::rope::RopeCache,
    rope_cos: Option<CudaSlice<f32>>,
    rope_sin: Option<CudaSlice<f32>>,
}

/// A captured decode graph. `CudaGraph` holds raw driver handles and so is not `Send`; the
/// runner that owns it is used by one thread at a time (the model actor), which is all the
/// driver asks of graph objects (no concurrent use).
struct DecodeGraph(CudaGraph);

// SAFETY: see `DecodeGraph`: the graph moves between threads with its runner but is never used
// from two threads at once.
unsafe impl Send for DecodeGraph {}

pub struct CudaRunner {
    ordinal: usize,
    config: ModelConfig,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    functions: HashMap<&'static str, CudaFunction>,
    embedding: DeviceMatrix,
    matrices: HashMap<Matrix, DeviceMatrix>,
    norms: HashMap<Norm, CudaSlice<f32>>,
    layout: KvArena,
    /// f16 values, as u16.
    arena: Option<CudaSlice<u16>>,
    blocks: usize,
    buffers: HashMap<Buf, CudaSlice<f32>>,
    /// Q8_1 blocks of the activations a matmul reads.
    q8: Option<CudaSlice<u8>>,
    /// MMQ's activations (steps of more than 8 rows) and its stream-k fix-up buffer.
    mmq_y: Option<CudaSlice<u8>>,
    /// Which activation buffer `q8` or `mmq_y` holds quantized now: Q, K and V (and gate and
    /// up) read the same normed rows one after the other, which are then quantized once.
    quantized: Option<Quantized>,
    mmq_fixup: Option<CudaSlice<u8>>,
    info: DeviceInfo,
    /// The tokens `sample_rows` drew, one per logit row.
    drawn: Option<CudaSlice<u32>>,
    part_max: Option<CudaSlice<f32>>,
    part_sum: Option<CudaSlice<f32>>,
    part_out: Option<CudaSlice<f32>>,
    /// Per (row, KV head), the splits of `attention_decode_*` finished so far: zero between
    /// launches (the block that merges resets its counter).
    attn_counters: Option<CudaSlice<u32>>,
    tables: Tables,
    weight_bytes: usize,
    /// Whether decode steps are replayed from CUDA graphs.
    use_graphs: bool,
    graphs: GraphCache<DecodeGraph>,
    guard: CaptureGuard,
    /// Bumped whenever a buffer the kernels read or write is reallocated: graphs captured over
    /// the old pointers are stale.
    generation: u64,
    /// The f16 copies of the matrices (and the LM head), when the device keeps them
    /// ([`launch::keeps_f16_weights`]): steps of more than 8 rows multiply them with cuBLAS.
    f16_weights: HashMap<Matrix, CudaSlice<u16>>,
    /// The activations rounded to f16 for those products.
    x16: Option<CudaSlice<u16>>,
    /// cuBLAS on the runner's stream, with a workspace of its own so that its calls can be
    /// captured in a graph (no allocation inside a capture).
    blas: Option<CudaBlas>,
    _blas_workspace: Option<CudaSlice<u8>>,
}

/// An activation buffer's quantized copy in the matmul scratch: the matvec kernels' Q8_1 rows, or MMQ's
/// blocks in the layout of one scale kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quantized {
    /// Q8_1 rows in the scratch's first half (the matvec kernels' input).
    MatVec(Buf),
    /// Q8_1 rows `matvec_swiglu` wrote into the scratch's second half while it read its input
    /// from the first.
    MatVecFfn(Buf),
    Mmq(Buf, launch::MmqScales),
    /// The f16 activations of the cuBLAS path (not quantized: rounded).
    F16(Buf),
}

/// Copies `data` into `slot`, reallocating when it does not fit; whether it reallocated.
fn upload<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    data: &[T],
) -> Result<bool> {
    let grew = ensure(stream, slot, data.len())?;
    if let Some(dst) = slot.as_mut() {
        if !data.is_empty() {
            let mut view = dst.slice_mut(0..data.len());
            stream.memcpy_htod(data, &mut view).map_err(cuda)?;
        }
    }
    Ok(grew)
}

/// A slot that holds at least `len` values; whether it reallocated.
fn ensure<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<bool> {
    if slot.as_ref().is_none_or(|s| s.len() < len.max(1)) {
        *slot = Some(stream.alloc_zeros::<T>(len.max(1)).map_err(cuda)?);
        return Ok(true);
    }
    Ok(false)
}

fn config_of(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: l.grid,
        block_dim: l.block,
        shared_mem_bytes: 0,
    }
}

fn missing(what: &str) -> EngineError {
    EngineError::Cuda(format!("{what} is not allocated"))
}

/// The matrices' f16 copies (the LM head's too: the embedding when tied), cuBLAS on `stream`
/// and its workspace, when the device has room for the copies
/// ([`launch::keeps_f16_weights`]); none of them otherwise.
#[allow(clippy::type_complexity)]
fn f16_copies(
    stream: &Arc<CudaStream>,
    functions: &HashMap<&'static str, CudaFunction>,
    matrices: &HashMap<Matrix, DeviceMatrix>,
    embedding: &DeviceMatrix,
) -> Result<(
    HashMap<Matrix, CudaSlice<u16>>,
    Option<CudaBlas>,
    Option<CudaSlice<u8>>,
)> {
    let mut sources: Vec<(Matrix, &DeviceMatrix)> = matrices.iter().map(|(k, m)| (*k, m)).collect();
    if !matrices.contains_key(&Matrix::Head) {
        sources.push((Matrix::Head, embedding));
    }
    let bytes: usize = sources.iter().map(|(_, m)| m.rows * m.cols * 2).sum();
    let (free, _total) = stream.context().mem_get_info().map_err(cuda)?;
    if !launch::keeps_f16_weights(bytes + BLAS_WORKSPACE_BYTES, free) {
        tracing::info!(
            "f16 weight copies ({} MiB) do not fit a quarter of the GPU's {} MiB free: steps of \
             more than 8 rows use MMQ",
            bytes >> 20,
            free >> 20
        );
        return Ok((HashMap::new(), None, None));
    }
    let blas =
        CudaBlas::new(Arc::clone(stream)).map_err(|e| EngineError::Cuda(format!("cuBLAS: {e}")))?;
    let workspace = stream
        .alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)
        .map_err(cuda)?;
    {
        let (ptr, _guard) = workspace.device_ptr(stream);
        // SAFETY: the workspace lives in the runner beside the handle (dropped after it is no
        // longer used: both belong to the runner, which owns the stream's work).
        unsafe {
            cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                ptr as *mut c_void,
                BLAS_WORKSPACE_BYTES,
            )
            .result()
        }
        .map_err(|e| EngineError::Cuda(format!("cuBLAS workspace: {e}")))?;
    }
    let mut copies = HashMap::new();
    for (key, m) in sources {
        let name = launch::dequantize_f16_kernel(m.dtype)?;
        let f = functions
            .get(name)
            .ok_or_else(|| EngineError::Cuda(format!("kernel {name} is not loaded")))?;
        let out = stream.alloc_zeros::<u16>(m.rows * m.cols).map_err(cuda)?;
        let cols = m.cols as i32;
        unsafe {
            stream
                .launch_builder(f)
                .arg(&m.data)
                .arg(&out)
                .arg(&cols)
                .launch(config_of(launch::per_row(m.rows)?))
        }
        .map_err(cuda)?;
        copies.insert(key, out);
    }
    stream.synchronize().map_err(cuda)?;
    tracing::info!(
        "f16 weight copies on the GPU: {} MiB; steps of more than 8 rows use cuBLAS",
        bytes >> 20
    );
    Ok((copies, Some(blas), Some(workspace)))
}

/// cuBLAS's workspace: what it asks for on Hopper (32 MiB), owned by the runner.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl CudaRunner {
    /// Uploads `weights` to GPU `ordinal` and loads the kernels; decode steps are replayed
    /// from CUDA graphs when `graphs` is set.
    pub fn load(weights: FastWeights, ordinal: usize, graphs: bool) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(cuda)?;
        // One stream, ordered by the runner: no per-buffer events (they would also break graph
        // capture).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda)?;
        let info = DeviceInfo::of(&ctx)?;
        let module = ctx.load_module(Ptx::from_src(PTX)).map_err(cuda)?;
        let mut functions = HashMap::new();
        for name in launch::kernel_names() {
            functions.insert(name, module.load_function(name).map_err(cuda)?);
        }
        let device_matrix = |m: &RawMatrix| -> Result<DeviceMatrix> {
            // Zeroed slack after the last row, as candle and llama.cpp allocate quantized
            // weights: the matmul kernels may read up to a padded row past the end.
            let bytes = m.bytes.as_slice();
            let slack = launch::weight_slack_bytes(m.dtype);
            let mut data = stream
                .alloc_zeros::<u8>(bytes.len() + slack)
                .map_err(cuda)?;
            let mut head = data.slice_mut(0..bytes.len());
            stream.memcpy_htod(bytes, &mut head).map_err(cuda)?;
            Ok(DeviceMatrix {
                dtype: m.dtype,
                rows: m.rows,
                cols: m.cols,
                data,
            })
        };
        let embedding = device_matrix(&weights.embedding)?;
        let mut matrices = HashMap::new();
        for (k, m) in &weights.matrices {
            matrices.insert(*k, device_matrix(m)?);
        }
        let mut norms = HashMap::new();
        for (k, v) in &weights.norms {
            norms.insert(*k, stream.clone_htod(v.as_slice()).map_err(cuda)?);
        }
        let c = weights.config.clone();
        let layout = KvArena {
            layers: c.n_layers,
            kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        launch::attention_kernel(c.n_heads, c.n_kv_heads, c.head_dim)?;
        stream.synchronize().map_err(cuda)?;
        // The f16 copies are a speed-up: a device that cannot make them serves with MMQ.
        let (f16_weights, blas, blas_workspace) =
            match f16_copies(&stream, &functions, &matrices, &embedding) {
                Ok(copies) => copies,
                Err(e) => {
                    tracing::warn!("no f16 weight copies ({e}): steps of more than 8 rows use MMQ");
                    (HashMap::new(), None, None)
                }
            };
        Ok(Self {
            ordinal,
            weight_bytes: weights.bytes(),
            config: c,
            stream,
            _module: module,
            functions,
            embedding,
            matrices,
            norms,
            layout,
            arena: None,
            blocks: 0,
            buffers: HashMap::new(),
            q8: None,
            mmq_y: None,
            mmq_fixup: None,
            quantized: None,
            drawn: None,
            part_max: None,
            part_sum: None,
            part_out: None,
            attn_counters: None,
            tables: Tables::default(),
            use_graphs: graphs,
            info,
            graphs: GraphCache::default(),
            guard: CaptureGuard::default(),
            generation: 0,
            f16_weights,
            x16: None,
            blas,
            _blas_workspace: blas_workspace,
        })
    }

    /// Whether steps of more than 8 rows take the f16 cuBLAS path (the device kept the
    /// weights' f16 copies); the CPU runner models it with `with_f16_matmuls`.
    pub fn f16_matmuls(&self) -> bool {
        !self.f16_weights.is_empty()
    }

    /// The buffer whose matvec Q8_1 rows the matmul scratch holds now, and those rows (for the
    /// GPU tests: a kernel that quantizes its output in place against the twin); `None` when the
    /// scratch holds none.
    pub fn quantized_rows(&mut self, plan: &Plan) -> Result<Option<(Buf, Vec<BlockQ8_1>)>> {
        let (buf, second) = match self.quantized {
            Some(Quantized::MatVec(buf)) => (buf, false),
            Some(Quantized::MatVecFfn(buf)) => (buf, true),
            _ => return Ok(None),
        };
        let rows = plan.rows_of(buf);
        let k = plan.len_of(&self.config, buf) / rows.max(1);
        let blocks = rows * padded_columns(k) / QK8_1;
        let q8 = self.q8_scratch()?;
        let start = if second {
            (q8.len() / 2) / 256 * 256
        } else {
            0
        };
        let mut bytes = vec![0u8; blocks * BLOCK_Q8_1_BYTES];
        if !bytes.is_empty() {
            let view = q8.slice(start..start + bytes.len());
            self.stream.memcpy_dtoh(&view, &mut bytes).map_err(cuda)?;
        }
        self.stream.synchronize().map_err(cuda)?;
        let parsed = bytes
            .chunks_exact(BLOCK_Q8_1_BYTES)
            .map(|b| {
                let mut qs = [0i8; QK8_1];
                for (q, &v) in qs.iter_mut().zip(&b[4..]) {
                    *q = v as i8;
                }
                BlockQ8_1 {
                    d: half::f16::from_le_bytes([b[0], b[1]]),
                    s: half::f16::from_le_bytes([b[2], b[3]]),
                    qs,
                }
            })
            .collect();
        Ok(Some((buf, parsed)))
    }

    /// The Q8_1 rows the matvec kernels read (allocated by `begin` for every step): the
    /// kernels that quantize in place write its first half.
    fn q8_scratch(&self) -> Result<&CudaSlice<u8>> {
        self.q8.as_ref().ok_or_else(|| missing("the Q8_1 scratch"))
    }

    /// The device addresses of the Q8_1 scratch's two halves: `matvec_swiglu` reads its input
    /// from the first and writes the down projection's rows into the second (one launch both
    /// reads and writes Q8_1 rows, so they cannot share memory).
    fn q8_regions(&self) -> Result<(sys::CUdeviceptr, sys::CUdeviceptr)> {
        let q8 = self.q8_scratch()?;
        let (base, _guard) = q8.device_ptr(&self.stream);
        let half = (q8.len() / 2) / 256 * 256;
        Ok((base, base + half as u64))
    }

    fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| EngineError::Cuda(format!("kernel {name} is not loaded")))
    }

    fn buffer(&self, buf: Buf) -> Result<&CudaSlice<f32>> {
        self.buffers
            .get(&buf)
            .ok_or_else(|| missing(&format!("{buf:?}")))
    }

    fn matrix(&self, m: Matrix) -> &DeviceMatrix {
        self.matrices.get(&m).unwrap_or(&self.embedding)
    }

    /// Allocates every buffer and table the plan needs and uploads the tables, before anything
    /// runs (never inside a capture).
    fn prepare(&mut self, plan: &Plan, tables: &StepTables, rope: &RopeTable) -> Result<()> {
        self.guard
            .forbid("preparing a step (allocating, uploading tables)")?;
        self.quantized = None;
        let c = self.config.clone();
        let mut grew = self.allocate(plan)?;
        let _ = rope; // the runner's own whole table serves (`Tables::rope`)
        let end = tables.positions.iter().max().map_or(0, |&p| p as usize + 1);
        grew |= self.hold_rope(end)?;
        grew |= self.upload_tables(plan, tables)?;
        let s = &self.stream;
        let t = &mut self.tables;
        t.flash_tile_count = 0;
        if launch::uses_flash(c.head_dim) {
            let tiles = flash::tiles(tables, c.n_heads / c.n_kv_heads.max(1));
            t.flash_tile_count = tiles.len() / 2;
            // Not counted in `grew`: decode graphs (one row per sequence) have no tiles, so a
            // prompt that needs a larger tile table leaves them valid.
            if !tiles.is_empty() {
                upload(s, &mut t.flash_tiles, &tiles)?;
            }
        }
        if plan.sample {
            grew |= ensure(s, &mut self.drawn, plan.logit_rows)?;
        }
        if grew {
            self.generation += 1;
        }
        Ok(())
    }

    /// The step buffers, the matmuls' scratch and the attention partials sized for `plan`;
    /// whether any was reallocated.
    fn allocate(&mut self, plan: &Plan) -> Result<bool> {
        let c = self.config.clone();
        let mut grew = false;
        for buf in BUFFERS {
            let len = plan.len_of(&c, buf).max(1);
            if self.buffers.get(&buf).is_none_or(|b| b.len() < len) {
                let fresh = self.stream.alloc_zeros::<f32>(len).map_err(cuda)?;
                self.buffers.insert(buf, fresh);
                grew = true;
            }
        }
        let widest = [c.hidden, c.n_heads * c.head_dim, c.ffn]
            .into_iter()
            .map(padded_columns)
            .max()
            .unwrap_or(0);
        let s = &self.stream;
        // Two halves (see `q8_regions`), each rounded to 256 bytes.
        let half = (plan.rows * widest / QK8_1 * BLOCK_Q8_1_BYTES).div_ceil(256) * 256;
        grew |= ensure(s, &mut self.q8, 2 * half)?;
        let widest_rows = plan.rows.max(plan.logit_rows);
        let widest_k = [c.hidden, c.n_heads * c.head_dim, c.ffn]
            .into_iter()
            .max()
            .unwrap_or(0);
        match launch::matmul_path(widest_rows, !self.f16_weights.is_empty()) {
            launch::MatMulPath::Mmq => {
                let bytes = launch::mmq_activation_bytes(widest_rows, widest_k);
                grew |= ensure(s, &mut self.mmq_y, bytes)?;
                grew |= ensure(s, &mut self.mmq_fixup, launch::MMQ_FIXUP_BYTES)?;
            }
            launch::MatMulPath::F16 => {
                grew |= ensure(s, &mut self.x16, widest_rows * widest_k)?;
            }
            launch::MatMulPath::MatVec => {}
        }
        let partials = plan.rows * c.n_heads * plan.splits;
        grew |= ensure(s, &mut self.part_max, partials)?;
        grew |= ensure(s, &mut self.part_sum, partials)?;
        grew |= ensure(s, &mut self.part_out, partials * c.head_dim)?;
        grew |= ensure(s, &mut self.attn_counters, plan.rows * c.n_kv_heads)?;
        Ok(grew)
    }

    /// Sizes every table a step of `plan` over `sequences` sequences uploads, so that no
    /// upload within those limits reallocates; whether any was reallocated.
    fn allocate_tables(&mut self, plan: &Plan, sequences: usize) -> Result<bool> {
        let rows = plan.rows;
        // A penalty entry per distinct token of a row's window: a generous share for each row;
        // a longer list still works, at the cost of one reallocation.
        const PENALTY_ENTRIES_PER_ROW: usize = 1024;
        let word = std::mem::size_of::<u32>();
        let mut needs = [0; packed::REGIONS.len()];
        for (region, bytes) in [
            (Region::Tokens, rows * word),
            (Region::Positions, rows * word),
            (Region::Slots, rows * word),
            (Region::RowSeq, rows * word),
            (Region::Seqs, 4 * sequences * word),
            (Region::LogitRows, plan.logit_rows * word),
            (Region::BlockTables, sequences * plan.max_blocks * word),
            (Region::Sampling, plan.logit_rows * packed::SAMPLE_ROW_BYTES),
            (Region::PenaltySpans, 2 * plan.logit_rows * word),
            (
                Region::Penalties,
                2 * PENALTY_ENTRIES_PER_ROW * plan.logit_rows * word,
            ),
        ] {
            needs[region as usize] = bytes;
        }
        let grew = self.hold_tables(&needs)?
            | self.hold_rope(plan.max_blocks * crate::kv::BLOCK_POSITIONS)?;
        Ok(grew | ensure(&self.stream, &mut self.drawn, plan.logit_rows)?)
    }

    /// Makes the packed tables hold `needs` bytes per region (moving every offset when one
    /// must grow); whether they moved.
    fn hold_tables(&mut self, needs: &packed::RegionBytes) -> Result<bool> {
        let t = &mut self.tables;
        if t.device.is_some() && t.layout.holds(needs) {
            return Ok(false);
        }
        let layout = t.layout.grown(needs);
        // The old host buffer may still be being copied from.
        if let Some(event) = &t.uploaded {
            event.synchronize().map_err(cuda)?;
        }
        t.device = Some(
            self.stream
                .alloc_zeros::<u8>(layout.total())
                .map_err(cuda)?,
        );
        // SAFETY: the bytes are unset until `packed::pack` writes the ones a step uses, and
        // only those are copied.
        t.host = Some(
            unsafe {
                self.stream
                    .context()
                    .alloc_pinned_with_flags::<u8>(layout.total(), 0)
            }
            .map_err(cuda)?,
        );
        t.layout = layout;
        Ok(true)
    }

    /// Packs the step's tables into the pinned host buffer and queues their one upload;
    /// whether the packed buffer moved (it had to grow).
    fn upload_tables(&mut self, plan: &Plan, tables: &StepTables) -> Result<bool> {
        let needs = packed::needs(tables, plan.sample);
        let grew = self.hold_tables(&needs)?;
        let stream = Arc::clone(&self.stream);
        let t = &mut self.tables;
        if let Some(event) = &t.uploaded {
            event.synchronize().map_err(cuda)?;
        }
        let (Some(host), Some(device)) = (t.host.as_mut(), t.device.as_ref()) else {
            return Err(missing("the packed tables"));
        };
        let bytes = host.as_mut_slice().map_err(cuda)?;
        let used = packed::pack(&t.layout, tables, plan.sample, bytes);
        if used > 0 {
            let (dst, _guard) = device.device_ptr(&stream);
            // SAFETY: `bytes[..used]` is pinned host memory that stays untouched until the
            // event recorded below has passed (checked above before the next write), and
            // `dst` holds `layout.total() >= used` bytes.
            unsafe { driver_result::memcpy_htod_async(dst, &bytes[..used], stream.cu_stream()) }
                .map_err(cuda)?;
        }
        let event = match t.uploaded.take() {
            Some(event) => event,
            None => stream.context().new_event(None).map_err(cuda)?,
        };
        event.record(&stream).map_err(cuda)?;
        t.uploaded = Some(event);
        Ok(grew)
    }

    /// Makes the device's RoPE table hold every position below `positions` (uploaded whole when
    /// it grows, which moves it); whether it moved.
    fn hold_rope(&mut self, positions: usize) -> Result<bool> {
        let t = &mut self.tables;
        if !t.rope.hold(&self.config, positions) && t.rope_cos.is_some() {
            return Ok(false);
        }
        t.rope_cos = Some(self.stream.clone_htod(t.rope.cos()).map_err(cuda)?);
        t.rope_sin = Some(self.stream.clone_htod(t.rope.sin()).map_err(cuda)?);
        Ok(true)
    }

    /// The device address of a region of the packed tables.
    fn table(&self, region: Region) -> Result<sys::CUdeviceptr> {
        let device = self
            .tables
            .device
            .as_ref()
            .ok_or_else(|| missing("the packed tables"))?;
        let (base, _guard) = device.device_ptr(&self.stream);
        Ok(base + self.tables.layout.offset(region) as u64)
    }

    fn op(&mut self, plan: &Plan, op: Op) -> Result<()> {
        if !matches!(
            op,
            Op::MatMul { .. } | Op::QkvMatVec { .. } | Op::SwiGluMatVec { .. }
        ) {
            // Any other operation may write the buffer last quantized.
            self.quantized = None;
        }
        let c = &self.config;
        let rows = plan.rows;
        match op {
            Op::Embed => {
                let f = self.function(launch::get_rows_kernel(self.embedding.dtype)?)?;
                let tokens = self.table(Region::Tokens)?;
                let x = self.buffer(Buf::X)?;
                let cols = c.hidden as i32;
                unsafe {
                    pdl::launch(&self.stream, f)
                        .ptr(&self.embedding.data)
                        .raw(tokens)
                        .ptr(x)
                        .i32(cols)
                        .go(launch::per_row(rows)?)
                }?;
            }
            Op::RmsNorm {
                x,
                add,
                weight,
                out,
            } => {
                let n = plan.rows_of(x);
                let f = self.function("rms_norm")?;
                let w = self
                    .norms
                    .get(&weight)
                    .ok_or_else(|| missing(&format!("{weight:?}")))?;
                let (cols, eps) = (c.hidden as i32, c.rms_eps);
                let cols_padded = padded_columns(c.hidden) as i32;
                let quantize = launch::quantizes_in_place(n);
                // The pointers' guards end with the block, before `quantized` changes.
                {
                    // The residual add and, for matvec steps, the matmuls' Q8_1 rows in the same
                    // launch: null pointers leave either out.
                    let y = add.map(|y| self.buffer(y)).transpose()?;
                    let q8 = quantize.then(|| self.q8_scratch()).transpose()?;
                    let (y_ptr, _y) = nullable(&self.stream, y);
                    let (q8_ptr, _q) = nullable(&self.stream, q8);
                    unsafe {
                        pdl::launch(&self.stream, f)
                            .ptr(self.buffer(x)?)
                            .raw(y_ptr)
                            .ptr(w)
                            .ptr(self.buffer(out)?)
                            .raw(q8_ptr)
                            .i32(cols)
                            .i32(cols_padded)
                            .f32(eps)
                            .go(launch::per_row(n)?)
                    }?;
                }
                if quantize {
                    self.quantized = Some(Quantized::MatVec(out));
                }
            }
            Op::MatMul { weight, x, out } => self.matmul(plan, weight, x, out)?,
            Op::QkvMatVec { layer } => self.qkv_matvec(plan, layer)?,
            Op::SwiGluMatVec { layer, x, gate, up } => {
                if !self.swiglu_matvec(plan, layer, x, gate)? {
                    // Gate and up of different types: two launches and the SwiGLU.
                    self.matmul(plan, Matrix::Gate(layer), x, gate)?;
                    self.matmul(plan, Matrix::Up(layer), x, up)?;
                    self.op(plan, Op::SiluMul { gate, up })?;
                }
            }
            Op::RopeKvWrite { layer, rope } => {
                let slots = self.table(Region::Slots)?;
                let arena = self.arena.as_ref().ok_or_else(|| missing("the KV arena"))?;
                let (l, layers, kvh, hd) = (
                    layer as i32,
                    c.n_layers as i32,
                    c.n_kv_heads as i32,
                    c.head_dim as i32,
                );
                if rope {
                    // Both rotations and the K/V stores in one launch.
                    let f = self.function("rope_kv_write")?;
                    let cos = self
                        .tables
                        .rope_cos
                        .as_ref()
                        .ok_or_else(|| missing("cos"))?;
                    let sin = self
                        .tables
                        .rope_sin
                        .as_ref()
                        .ok_or_else(|| missing("sin"))?;
                    let positions = self.table(Region::Positions)?;
                    let (heads, rope_dim) = (c.n_heads as i32, c.rope_dim as i32);
                    let launch = launch::rope_kv_write(
                        rows,
                        c.n_heads,
                        c.n_kv_heads,
                        c.head_dim,
                        c.rope_dim,
                    )?;
                    unsafe {
                        pdl::launch(&self.stream, f)
                            .ptr(self.buffer(Buf::Q)?)
                            .ptr(self.buffer(Buf::K)?)
                            .ptr(self.buffer(Buf::V)?)
                            .ptr(cos)
                            .ptr(sin)
                            .raw(positions)
                            .raw(slots)
                            .ptr(arena)
                            .i32(heads)
                            .i32(kvh)
                            .i32(hd)
                            .i32(rope_dim)
                            .i32(l)
                            .i32(layers)
                            .go(launch)
                    }?;
                } else {
                    let f = self.function("kv_write")?;
                    unsafe {
                        pdl::launch(&self.stream, f)
                            .ptr(self.buffer(Buf::K)?)
                            .ptr(self.buffer(Buf::V)?)
                            .raw(slots)
                            .ptr(arena)
                            .i32(l)
                            .i32(layers)
                            .i32(kvh)
                            .i32(hd)
                            .go(launch::kv_write(rows, c.n_kv_heads, c.head_dim)?)
                    }?;
                }
            }
            Op::Attention { layer } => {
                if self.attention(plan, layer)? {
                    self.quantized = Some(Quantized::MatVec(Buf::Attn));
                }
            }
            Op::Add { x, y } => {
                let f = self.function("add_f32")?;
                let n = plan.len_of(c, x);
                let n32 = n as i32;
                unsafe {
                    pdl::launch(&self.stream, f)
                        .ptr(self.buffer(x)?)
                        .ptr(self.buffer(y)?)
                        .i32(n32)
                        .go(launch::elementwise(n)?)
                }?;
            }
            Op::SiluMul { gate, up } if launch::quantizes_in_place(plan.rows_of(gate)) => {
                // The down projection's Q8_1 rows in the same launch.
                let f = self.function("silu_mul_q8_1")?;
                let cols_padded = padded_columns(c.ffn);
                let q8 = self.q8_scratch()?;
                let (cols, padded32) = (c.ffn as i32, cols_padded as i32);
                unsafe {
                    pdl::launch(&self.stream, f)
                        .ptr(self.buffer(gate)?)
                        .ptr(self.buffer(up)?)
                        .ptr(q8)
                        .i32(cols)
                        .i32(padded32)
                        .go(launch::silu_mul_q8_1(plan.rows_of(gate), cols_padded)?)
                }?;
                self.quantized = Some(Quantized::MatVec(gate));
            }
            Op::SiluMul { gate, up } => {
                let f = self.function("silu_mul")?;
                let n = plan.len_of(c, gate);
                let n32 = n as i32;
                unsafe {
                    pdl::launch(&self.stream, f)
                        .ptr(self.buffer(gate)?)
                        .ptr(self.buffer(up)?)
                        .i32(n32)
                        .go(launch::elementwise(n)?)
                }?;
            }
            Op::Penalties => {
                let f = self.function("apply_penalties")?;
                let entries = self.table(Region::Penalties)?;
                let spans = self.table(Region::PenaltySpans)?;
                let sampling = self.table(Region::Sampling)?;
                let vocab = c.vocab_size as i32;
                unsafe {
                    pdl::launch(&self.stream, f)
                        .ptr(self.buffer(Buf::Logits)?)
                        .raw(entries)
                        .raw(spans)
                        .raw(sampling)
                        .i32(vocab)
                        .go(launch::apply_penalties(plan.logit_rows)?)
                }?;
            }
            Op::Sample => {
                let f = self.function("sample_rows")?;
                let sampling = self.table(Region::Sampling)?;
                let drawn = self.drawn.as_ref().ok_or_else(|| missing("drawn tokens"))?;
                let vocab = c.vocab_size as i32;
                unsafe {
                    pdl::launch(&self.stream, f)
                        .ptr(self.buffer(Buf::Logits)?)
                        .raw(sampling)
                        .ptr(drawn)
                        .i32(vocab)
                        .go(launch::sample_rows(plan.logit_rows)?)
                }?;
            }
            Op::GatherLogitRows => {
                let f = self.function("gather_rows")?;
                let picked = self.table(Region::LogitRows)?;
                let cols = c.hidden as i32;
                unsafe {
                    pdl::launch(&self.stream, f)
                        .ptr(self.buffer(Buf::X)?)
                        .raw(picked)
                        .ptr(self.buffer(Buf::Sel)?)
                        .i32(cols)
                        .go(launch::per_row(plan.logit_rows)?)
                }?;
            }
        }
        Ok(())
    }

    /// Launches the attention of `layer` and the merge of its splits; whether the merge also
    /// wrote `Attn`'s Q8_1 rows.
    fn attention(&self, plan: &Plan, layer: usize) -> Result<bool> {
        let c = &self.config;
        let rows = plan.rows;
        let splits = plan.splits;
        let t = &self.tables;
        let row_seq = self.table(Region::RowSeq)?;
        let seqs = self.table(Region::Seqs)?;
        let block_tables = self.table(Region::BlockTables)?;
        let arena = self.arena.as_ref().ok_or_else(|| missing("the KV arena"))?;
        let part_max = self.part_max.as_ref().ok_or_else(|| missing("partials"))?;
        let part_sum = self.part_sum.as_ref().ok_or_else(|| missing("partials"))?;
        let part_out = self.part_out.as_ref().ok_or_else(|| missing("partials"))?;
        let (max_blocks, max_splits, l, layers, heads, kvh, hd) = (
            plan.max_blocks as i32,
            splits as i32,
            layer as i32,
            c.n_layers as i32,
            c.n_heads as i32,
            c.n_kv_heads as i32,
            c.head_dim as i32,
        );
        // The multi-row sequences' tiles on the tensor cores first; the split kernel and the
        // merge then leave those rows alone.
        let flash_rows = match launch::flash_kernel(c.head_dim) {
            Some(kernel) if t.flash_tile_count > 0 => {
                let tiles = t
                    .flash_tiles
                    .as_ref()
                    .ok_or_else(|| missing("flash tiles"))?;
                unsafe {
                    pdl::launch(&self.stream, self.function(kernel)?)
                        .ptr(self.buffer(Buf::Q)?)
                        .ptr(arena)
                        .raw(seqs)
                        .raw(block_tables)
                        .i32(max_blocks)
                        .ptr(tiles)
                        .ptr(self.buffer(Buf::Attn)?)
                        .i32(l)
                        .i32(layers)
                        .i32(heads)
                        .i32(kvh)
                        .go(launch::flash_prefill(t.flash_tile_count, c.n_kv_heads)?)
                }?;
                flash::MIN_ROWS as i32
            }
            _ => i32::MAX,
        };
        // For matvec steps the merge also writes the output projection's Q8_1 rows, where
        // every warp's 32 values are one whole block of them; not when flash rows (which it
        // leaves alone) are in the step: the matmul then quantizes all rows itself.
        let q_dim = c.n_heads * c.head_dim;
        let quantize = launch::quantizes_in_place(rows)
            && flash_rows == i32::MAX
            && padded_columns(q_dim) == q_dim
            && c.head_dim.is_multiple_of(QK8_1);
        let q8 = quantize.then(|| self.q8_scratch()).transpose()?;
        let (q8_ptr, _q) = nullable(&self.stream, q8);
        let cols_padded = q_dim as i32;
        if let Some(kernel) = launch::attention_decode_kernel(c.n_heads, c.n_kv_heads, c.head_dim) {
            // One-row sequences on the decode kernel, which merges its own splits (the flash
            // kernel took every longer sequence: its head dimensions are the decode kernel's).
            let counters = self
                .attn_counters
                .as_ref()
                .ok_or_else(|| missing("the attention counters"))?;
            unsafe {
                pdl::launch(&self.stream, self.function(kernel)?)
                    .ptr(self.buffer(Buf::Q)?)
                    .ptr(arena)
                    .raw(row_seq)
                    .raw(seqs)
                    .raw(block_tables)
                    .i32(max_blocks)
                    .ptr(part_max)
                    .ptr(part_sum)
                    .ptr(part_out)
                    .ptr(counters)
                    .ptr(self.buffer(Buf::Attn)?)
                    .raw(q8_ptr)
                    .i32(cols_padded)
                    .i32(max_splits)
                    .i32(l)
                    .i32(layers)
                    .i32(heads)
                    .i32(kvh)
                    .go(launch::attention_partial(rows, c.n_kv_heads, splits)?)
            }?;
            return Ok(quantize);
        }
        // Other head dimensions and groups: the split kernel, then the merge.
        let name = launch::attention_kernel(c.n_heads, c.n_kv_heads, c.head_dim)?;
        unsafe {
            pdl::launch(&self.stream, self.function(name)?)
                .ptr(self.buffer(Buf::Q)?)
                .ptr(arena)
                .raw(row_seq)
                .raw(seqs)
                .raw(block_tables)
                .i32(max_blocks)
                .ptr(part_max)
                .ptr(part_sum)
                .ptr(part_out)
                .i32(max_splits)
                .i32(l)
                .i32(layers)
                .i32(heads)
                .i32(kvh)
                .i32(hd)
                .i32(flash_rows)
                .go(launch::attention_partial(rows, c.n_kv_heads, splits)?)
        }?;
        let f = self.function("attention_merge")?;
        unsafe {
            pdl::launch(&self.stream, f)
                .raw(row_seq)
                .raw(seqs)
                .ptr(part_max)
                .ptr(part_sum)
                .ptr(part_out)
                .ptr(self.buffer(Buf::Attn)?)
                .raw(q8_ptr)
                .i32(cols_padded)
                .i32(max_splits)
                .i32(heads)
                .i32(hd)
                .i32(flash_rows)
                .go(launch::attention_merge(rows, c.n_heads, c.head_dim)?)
        }?;
        Ok(quantize)
    }
}

/// `slice`'s device pointer, or null for a kernel argument the launch leaves out; the guard
/// must live until the launch is queued.
fn nullable<'a, T>(
    stream: &'a Arc<CudaStream>,
    slice: Option<&'a CudaSlice<T>>,
) -> (sys::CUdeviceptr, Option<impl Drop + 'a>) {
    match slice {
        Some(s) => {
            let (p, guard) = s.device_ptr(stream);
            (p, Some(guard))
        }
        None => (0, None),
    }
}

impl Runner for CudaRunner {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn rows_computed_alike(&self, rows: usize) -> usize {
        launch::rows_computed_alike(rows)
    }

    /// `cuProfilerStart`/`cuProfilerStop`, after the stream's work so far has finished (the
    /// range then holds exactly the work queued inside it).
    fn profiler_range(&mut self, on: bool) -> Result<()> {
        self.stream.synchronize().map_err(cuda)?;
        self.stream.context().bind_to_thread().map_err(cuda)?;
        // SAFETY: plain driver calls on the bound context.
        unsafe {
            if on {
                sys::cuProfilerStart().result()
            } else {
                sys::cuProfilerStop().result()
            }
        }
        .map_err(cuda)
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn arena(&self) -> KvArena {
        self.layout
    }

    fn reserve_blocks(&mut self, blocks: usize) -> Result<()> {
        if blocks <= self.blocks {
            return Ok(());
        }
        self.guard.forbid("growing the KV arena")?;
        self.generation += 1;
        let values = blocks * self.layout.block_values();
        let mut grown = self.stream.alloc_zeros::<u16>(values).map_err(cuda)?;
        if let Some(old) = &self.arena {
            let mut head = grown.slice_mut(0..old.len());
            self.stream.memcpy_dtod(old, &mut head).map_err(cuda)?;
        }
        self.arena = Some(grown);
        self.blocks = blocks;
        Ok(())
    }

    fn resident_blocks(&self) -> usize {
        self.blocks
    }

    fn read_blocks(&mut self, blocks: &[u32], out: &mut Vec<u8>) -> Result<()> {
        self.guard.forbid("copying KV blocks to the host")?;
        let arena = self.arena.as_ref().ok_or_else(|| missing("the KV arena"))?;
        let n = self.layout.block_values();
        let mut values = vec![0u16; n];
        for &b in blocks {
            let at = b as usize * n;
            if at + n > arena.len() {
                return Err(EngineError::InvalidStep(format!(
                    "KV block {b} is outside the arena"
                )));
            }
            self.stream
                .memcpy_dtoh(&arena.slice(at..at + n), &mut values)
                .map_err(cuda)?;
            self.stream.synchronize().map_err(cuda)?;
            out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        }
        Ok(())
    }

    fn write_blocks(&mut self, blocks: &[u32], bytes: &[u8]) -> Result<()> {
        self.guard.forbid("copying KV blocks to the device")?;
        let n = self.layout.block_values();
        let arena = self.arena.as_mut().ok_or_else(|| missing("the KV arena"))?;
        for (&b, chunk) in blocks.iter().zip(bytes.chunks_exact(2 * n)) {
            let at = b as usize * n;
            if at + n > arena.len() {
                return Err(EngineError::InvalidStep(format!(
                    "KV block {b} is outside the arena"
                )));
            }
            let values: Vec<u16> = chunk
                .chunks_exact(2)
                .map(|x| u16::from_le_bytes([x[0], x[1]]))
                .collect();
            let mut view = arena.slice_mut(at..at + n);
            self.stream.memcpy_htod(&values, &mut view).map_err(cuda)?;
        }
        // The host's values must outlive the copies (pageable: staged before the call returns).
        self.stream.synchronize().map_err(cuda)
    }

    fn synchronize(&mut self) -> Result<()> {
        self.stream.synchronize().map_err(cuda)
    }

    fn device_memory(&self) -> Option<crate::device::DeviceMemory> {
        let (free, total) = self.stream.context().mem_get_info().ok()?;
        Some(crate::device::DeviceMemory {
            weights_bytes: self.weight_bytes,
            kv_bytes: self.blocks * self.layout.block_bytes(),
            free_bytes: free,
            total_bytes: total,
        })
    }

    fn suggested(&self) -> Suggested {
        // What is free now, with the weights and (when already grown) the arena in place.
        let held = self.blocks * self.layout.block_bytes();
        self.stream
            .context()
            .mem_get_info()
            .map_or(Suggested::CPU, |(free, _)| Suggested::gpu(free + held))
    }

    fn reserve_steps(&mut self, plan: &Plan, sequences: usize) -> Result<()> {
        self.guard.forbid("reserving the step buffers")?;
        let grew = self.allocate(plan)? | self.allocate_tables(plan, sequences)?;
        if grew {
            self.generation += 1;
        }
        Ok(())
    }

    fn begin(&mut self, plan: &Plan, tables: &StepTables, rope: &RopeTable) -> Result<()> {
        self.prepare(plan, tables, rope)
    }

    fn run_op(&mut self, plan: &Plan, op: Op) -> Result<()> {
        self.op(plan, op)
    }

    fn graphs(&self) -> bool {
        self.use_graphs
    }

    fn launch_graph(
        &mut self,
        key: GraphKey,
        plan: &Plan,
        tables: &StepTables,
        rope: &RopeTable,
    ) -> Result<()> {
        if !self.use_graphs {
            return self.launch(plan, tables, rope);
        }
        self.prepare(plan, tables, rope)?;
        match self.graphs.action(key, self.generation) {
            GraphAction::WarmUp => {
                for &op in &plan.ops {
                    self.op(plan, op)?;
                }
            }
            GraphAction::Capture => {
                self.guard.begin(key)?;
                let began = self
                    .stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(cuda);
                let ran =
                    began.and_then(|()| plan.ops.iter().try_for_each(|&op| self.op(plan, op)));
                // End the capture whatever happened, so the stream is usable again.
                let ended = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
                self.guard.end();
                ran?;
                let graph = ended.map_err(cuda)?.ok_or_else(|| {
                    EngineError::Cuda(format!("the capture of the decode graph {key:?} is empty"))
                })?;
                graph.upload().map_err(cuda)?;
                graph.launch().map_err(cuda)?;
                self.graphs.insert(key, DecodeGraph(graph), self.generation);
            }
            GraphAction::Replay => {
                let graph = self.graphs.get(key).ok_or_else(|| {
                    EngineError::Cuda(format!("the decode graph {key:?} is gone"))
                })?;
                graph.0.launch().map_err(cuda)?;
            }
        }
        Ok(())
    }

    fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    fn read(&mut self, plan: &Plan, buf: Buf) -> Result<Vec<f32>> {
        self.guard.forbid(&format!("copying {buf:?} to the host"))?;
        let len = plan.len_of(&self.config, buf);
        let mut out = vec![0f32; len];
        if len > 0 {
            let view = self.buffer(buf)?.slice(0..len);
            self.stream.memcpy_dtoh(&view, &mut out).map_err(cuda)?;
        }
        self.stream.synchronize().map_err(cuda)?;
        Ok(out)
    }

    fn read_tokens(&mut self, plan: &Plan) -> Result<Vec<u32>> {
        self.guard.forbid("copying the drawn tokens to the host")?;
        let mut out = vec![0u32; plan.logit_rows];
        if plan.logit_rows > 0 {
            let drawn = self.drawn.as_ref().ok_or_else(|| missing("drawn tokens"))?;
            let view = drawn.slice(0..plan.logit_rows);
            self.stream.memcpy_dtoh(&view, &mut out).map_err(cuda)?;
        }
        self.stream.synchronize().map_err(cuda)?;
        Ok(out)
    }

    fn write(&mut self, _plan: &Plan, buf: Buf, values: &[f32]) -> Result<()> {
        self.quantized = None;
        let dst = self
            .buffers
            .get_mut(&buf)
            .ok_or_else(|| missing(&format!("{buf:?}")))?;
        if !values.is_empty() {
            let mut view = dst.slice_mut(0..values.len());
            self.stream.memcpy_htod(values, &mut view).map_err(cuda)?;
        }
        Ok(())
    }
}
