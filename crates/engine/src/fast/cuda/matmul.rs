//! The runner's quantized matmuls: our matvec kernels (up to 8 activation rows, quantized to
//! Q8_1; `fast::twin::matvec`), fused for Q/K/V and for gate/up/SwiGLU, and MMQ (more rows,
//! MMQ's own Q8_1 layout) as candle-kernels exports it, with an input quantized once for
//! consecutive matmuls that read it.

use super::*;

/// MMQ's activation quantizer for a scale layout.
pub(super) type MmqQuantizer = unsafe extern "C" fn(
    *const c_void,
    *const i32,
    *mut c_void,
    i32,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    *mut c_void,
);

pub(super) fn mmq_quantizer(scales: launch::MmqScales) -> MmqQuantizer {
    use candle_kernels::ffi;
    match scales {
        launch::MmqScales::D4 => ffi::launch_mmq_quantize_q8_1_D4,
        launch::MmqScales::DS4 => ffi::launch_mmq_quantize_q8_1_DS4,
        launch::MmqScales::D2S6 => ffi::launch_mmq_quantize_q8_1_D2S6,
    }
}

/// MMQ's matmul for a weight type.
pub(super) type MmqLauncher = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    i64,
    i64,
    i64,
    i64,
    i64,
    i32,
    i32,
    i64,
    i32,
    *mut c_void,
);

pub(super) fn mmq_launcher(dtype: GgmlDType) -> Result<MmqLauncher> {
    use candle_kernels::ffi;
    Ok(match dtype {
        GgmlDType::Q4_0 => ffi::launch_mmq_gguf_q4_0,
        GgmlDType::Q4_1 => ffi::launch_mmq_gguf_q4_1,
        GgmlDType::Q5_0 => ffi::launch_mmq_gguf_q5_0,
        GgmlDType::Q5_1 => ffi::launch_mmq_gguf_q5_1,
        GgmlDType::Q8_0 => ffi::launch_mmq_gguf_q8_0,
        GgmlDType::Q2K => ffi::launch_mmq_gguf_q2_k,
        GgmlDType::Q3K => ffi::launch_mmq_gguf_q3_k,
        GgmlDType::Q4K => ffi::launch_mmq_gguf_q4_k,
        GgmlDType::Q5K => ffi::launch_mmq_gguf_q5_k,
        GgmlDType::Q6K => ffi::launch_mmq_gguf_q6_k,
        other => return Err(EngineError::Cuda(format!("no MMQ kernel for {other:?}"))),
    })
}

/// What MMQ's launchers need to know about the GPU.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceInfo {
    /// Compute capability as ggml writes it (major × 100 + minor × 10).
    cc: i32,
    sms: i32,
    /// Opt-in shared memory per block.
    shared_per_block: i64,
    warp_size: i32,
}

impl DeviceInfo {
    pub(super) fn of(ctx: &CudaContext) -> Result<Self> {
        use sys::CUdevice_attribute as A;
        let get = |a| ctx.attribute(a).map_err(cuda);
        Ok(Self {
            cc: get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? * 100
                + get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? * 10,
            sms: get(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            shared_per_block: i64::from(get(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?),
            warp_size: get(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
        })
    }
}

/// One matrix of a matvec launch: its weights, its output and its rows.
type Segment = (sys::CUdeviceptr, sys::CUdeviceptr, usize);

impl CudaRunner {
    /// `out = x · Wᵀ`: up to 8 rows, the rows quantized to Q8_1 and our matvec; above, MMQ
    /// over the rows quantized to MMQ's Q8_1 layout, or the f16 GEMM ([`launch::matmul_path`]).
    pub(super) fn matmul(&mut self, plan: &Plan, weight: Matrix, x: Buf, out: Buf) -> Result<()> {
        let result = self.matmul_from(plan, weight, x, out);
        self.quantized = match result {
            // `out` is never `x`; were it so, its quantized copy would be stale.
            Ok(
                Quantized::MatVec(b)
                | Quantized::MatVecFfn(b)
                | Quantized::Mmq(b, _)
                | Quantized::F16(b),
            ) if b == out => None,
            Ok(q) => Some(q),
            Err(_) => None,
        };
        result.map(|_| ())
    }

    /// Launches one matmul, quantizing `x` unless the scratch already holds it in the form
    /// this matmul reads; returns what the scratch holds afterwards.
    pub(super) fn matmul_from(
        &self,
        plan: &Plan,
        weight: Matrix,
        x: Buf,
        out: Buf,
    ) -> Result<Quantized> {
        let m = self.matrix(weight);
        let (n, k) = matrix_shape(&self.config, weight);
        if (m.rows, m.cols) != (n, k) {
            return Err(EngineError::Cuda(format!(
                "{weight:?} is {}x{}, the plan expects {n}x{k}",
                m.rows, m.cols
            )));
        }
        let rows = plan.rows_of(x);
        let f16 = self.f16_weights.contains_key(&weight);
        if launch::matmul_path(rows, f16) == launch::MatMulPath::F16 {
            return self.matmul_f16(weight, x, out, rows, n, k);
        }
        let k_padded = padded_columns(k);
        let stream = self.stream.cu_stream() as *mut c_void;
        let (x_ptr, _x) = self.buffer(x)?.device_ptr(&self.stream);
        let (w_ptr, _w) = m.data.device_ptr(&self.stream);
        let (out_ptr, _o) = self.buffer(out)?.device_ptr(&self.stream);
        match launch::matmul_path(rows, false) {
            launch::MatMulPath::MatVec => {}
            launch::MatMulPath::F16 => {
                return Err(EngineError::Cuda("the f16 path was not taken above".into()))
            }
            launch::MatMulPath::Mmq => {
                let y = self
                    .mmq_y
                    .as_ref()
                    .ok_or_else(|| missing("the MMQ scratch"))?;
                let fixup = self
                    .mmq_fixup
                    .as_ref()
                    .ok_or_else(|| missing("the MMQ fix-up buffer"))?;
                let (y_ptr, _y) = y.device_ptr(&self.stream);
                let (fixup_ptr, _f) = fixup.device_ptr(&self.stream);
                let d = self.info;
                let scales = launch::mmq_scales(m.dtype)?;
                let quantize = mmq_quantizer(scales);
                let multiply = mmq_launcher(m.dtype)?;
                let held = Quantized::Mmq(x, scales);
                unsafe {
                    if self.quantized != Some(held) {
                        quantize(
                            x_ptr as *const c_void,
                            std::ptr::null(),
                            y_ptr as *mut c_void,
                            0,
                            k as i64,
                            k as i64,
                            0,
                            0,
                            k_padded as i64,
                            rows as i64,
                            1,
                            1,
                            stream,
                        );
                    }
                    multiply(
                        fixup_ptr as *mut c_void,
                        w_ptr as *const c_void,
                        y_ptr as *const c_void,
                        out_ptr as *mut c_void,
                        k as i64,
                        n as i64,
                        rows as i64,
                        (k / launch::block_values(m.dtype)) as i64,
                        n as i64,
                        d.cc,
                        d.sms,
                        d.shared_per_block,
                        d.warp_size,
                        stream,
                    );
                }
                return Ok(held);
            }
        }
        let (y, held) = self.q8_input(x, rows, k)?;
        self.launch_matvec(m.dtype, &[(w_ptr, out_ptr, n)], y, k, rows)?;
        Ok(held)
    }

    /// The Q8_1 rows of `x` (`rows` of `k` values) for the matvec kernels: where a kernel
    /// quantizing in place left them, or quantized now into the scratch's first half.
    fn q8_input(&self, x: Buf, rows: usize, k: usize) -> Result<(sys::CUdeviceptr, Quantized)> {
        let (first, second) = self.q8_regions()?;
        match self.quantized {
            Some(Quantized::MatVecFfn(b)) if b == x => {
                return Ok((second, Quantized::MatVecFfn(x)))
            }
            Some(Quantized::MatVec(b)) if b == x => return Ok((first, Quantized::MatVec(x))),
            _ => {}
        }
        let k_padded = padded_columns(k);
        let f = self.function("quantize_rows_q8_1")?;
        unsafe {
            pdl::launch(&self.stream, f)
                .ptr(self.buffer(x)?)
                .raw(first)
                .i32(k as i32)
                .i32(k_padded as i32)
                .go(launch::silu_mul_q8_1(rows, k_padded)?)
        }?;
        Ok((first, Quantized::MatVec(x)))
    }

    /// One `matvec_<dtype>` launch over up to three matrices of `dtype` (`(weights, output,
    /// rows of the matrix)` each) and the Q8_1 rows at `y`.
    fn launch_matvec(
        &self,
        dtype: GgmlDType,
        segments: &[Segment],
        y: sys::CUdeviceptr,
        k: usize,
        rows: usize,
    ) -> Result<()> {
        if segments.is_empty() || segments.len() > 3 {
            return Err(EngineError::Cuda(format!(
                "a matvec launch takes 1 to 3 matrices, not {}",
                segments.len()
            )));
        }
        let (name, _) = launch::matvec_kernel(dtype)?;
        let f = self.function(name)?;
        let seg = |i: usize| segments.get(i).copied().unwrap_or((0, 0, 0));
        let outputs: usize = segments.iter().map(|s| s.2).sum();
        let mut l = pdl::launch(&self.stream, f);
        for i in 0..3 {
            l.raw(seg(i).0);
        }
        for i in 0..3 {
            l.raw(seg(i).1);
        }
        for i in 0..3 {
            l.i32(seg(i).2 as i32);
        }
        l.raw(y)
            .i32(k as i32)
            .i32((padded_columns(k) / QK8_1) as i32)
            .i32(rows as i32);
        unsafe { l.go(launch::matvec(outputs, rows)?) }
    }

    /// `Q`, `K`, `V` of `layer` from `H`'s Q8_1 rows: one launch per weight type among the
    /// three (one for the usual models).
    pub(super) fn qkv_matvec(&mut self, plan: &Plan, layer: usize) -> Result<()> {
        let rows = plan.rows_of(Buf::H);
        let k = self.config.hidden;
        let (y, held) = self.q8_input(Buf::H, rows, k)?;
        self.quantized = Some(held);
        let mut groups: Vec<(GgmlDType, Vec<Segment>)> = Vec::new();
        let mut guards = Vec::new();
        for (weight, out) in [
            (Matrix::Q(layer), Buf::Q),
            (Matrix::K(layer), Buf::K),
            (Matrix::V(layer), Buf::V),
        ] {
            let m = self.matrix(weight);
            let (n, cols) = matrix_shape(&self.config, weight);
            if (m.rows, m.cols) != (n, cols) || cols != k {
                return Err(EngineError::Cuda(format!(
                    "{weight:?} is {}x{}, the plan expects {n}x{k}",
                    m.rows, m.cols
                )));
            }
            let (w_ptr, gw) = m.data.device_ptr(&self.stream);
            let (o_ptr, go) = self.buffer(out)?.device_ptr(&self.stream);
            guards.push((gw, go));
            match groups.iter_mut().find(|(d, _)| *d == m.dtype) {
                Some((_, segs)) => segs.push((w_ptr, o_ptr, n)),
                None => groups.push((m.dtype, vec![(w_ptr, o_ptr, n)])),
            }
        }
        for (dtype, segments) in &groups {
            self.launch_matvec(*dtype, segments, y, k, rows)?;
        }
        Ok(())
    }

    /// `gate = silu(x · W_gateᵀ) × (x · W_upᵀ)` of `layer` and its Q8_1 rows in one
    /// `matvec_swiglu` launch; `false` (nothing launched) when gate and up differ in type.
    pub(super) fn swiglu_matvec(
        &mut self,
        plan: &Plan,
        layer: usize,
        x: Buf,
        gate: Buf,
    ) -> Result<bool> {
        let (wg, wu) = (
            self.matrix(Matrix::Gate(layer)),
            self.matrix(Matrix::Up(layer)),
        );
        if wg.dtype != wu.dtype {
            return Ok(false);
        }
        let c = &self.config;
        let (rows, k, n) = (plan.rows_of(x), c.hidden, c.ffn);
        for m in [wg, wu] {
            if (m.rows, m.cols) != (n, k) {
                return Err(EngineError::Cuda(format!(
                    "layer {layer}'s FFN matrix is {}x{}, the plan expects {n}x{k}",
                    m.rows, m.cols
                )));
            }
        }
        let (_, name) = launch::matvec_kernel(wg.dtype)?;
        let f = self.function(name)?;
        let (y, _) = self.q8_input(x, rows, k)?;
        let (first, second) = self.q8_regions()?;
        if y != first {
            return Err(EngineError::Cuda(
                "matvec_swiglu's input must be in the Q8_1 scratch's first half".into(),
            ));
        }
        let cols_padded = padded_columns(n);
        unsafe {
            pdl::launch(&self.stream, f)
                .ptr(&wg.data)
                .ptr(&wu.data)
                .raw(y)
                .ptr(self.buffer(gate)?)
                .raw(second)
                .i32(k as i32)
                .i32((padded_columns(k) / QK8_1) as i32)
                .i32(n as i32)
                .i32(cols_padded as i32)
                .i32(rows as i32)
                .go(launch::matvec_swiglu(cols_padded, rows)?)
        }?;
        self.quantized = Some(Quantized::MatVecFfn(gate));
        Ok(true)
    }
}

impl CudaRunner {
    /// `out = x · Wᵀ` with `W`'s f16 copy: `x` rounded to f16 (once for consecutive matmuls
    /// reading it), then cuBLAS `GemmEx`, f16 operands, f32 accumulation and output (twin:
    /// `fast::twin::f16mm`). Row-major `[rows][k]` times `[n][k]` is, in cuBLAS's column-major
    /// terms, `Wᵀ` (op T on a k × n matrix) times `xᵀ` (k × rows), giving `outᵀ` (n × rows):
    /// exactly `out` row-major.
    fn matmul_f16(
        &self,
        weight: Matrix,
        x: Buf,
        out: Buf,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<Quantized> {
        use candle_core::cuda_backend::cudarc::cublas::{result, sys as blas_sys};
        let w16 = self
            .f16_weights
            .get(&weight)
            .ok_or_else(|| missing(&format!("{weight:?}'s f16 copy")))?;
        let x16 = self
            .x16
            .as_ref()
            .ok_or_else(|| missing("the f16 activations"))?;
        let blas = self.blas.as_ref().ok_or_else(|| missing("cuBLAS"))?;
        let held = Quantized::F16(x);
        if self.quantized != Some(held) {
            let f = self.function("f32_to_f16")?;
            let count = (rows * k) as i32;
            unsafe {
                pdl::launch(&self.stream, f)
                    .ptr(self.buffer(x)?)
                    .ptr(x16)
                    .i32(count)
                    .go(launch::elementwise(rows * k)?)
            }?;
        }
        let (w_ptr, _w) = w16.device_ptr(&self.stream);
        let (x_ptr, _x) = x16.device_ptr(&self.stream);
        let (o_ptr, _o) = self.buffer(out)?.device_ptr(&self.stream);
        let (alpha, beta) = (1f32, 0f32);
        let dim = |v: usize| {
            i32::try_from(v)
                .map_err(|_| EngineError::InvalidStep(format!("{v} is too large for cuBLAS")))
        };
        unsafe {
            result::gemm_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                dim(n)?,
                dim(rows)?,
                dim(k)?,
                (&alpha as *const f32).cast(),
                w_ptr as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                dim(k)?,
                x_ptr as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                dim(k)?,
                (&beta as *const f32).cast(),
                o_ptr as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                dim(n)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| EngineError::Cuda(format!("cuBLAS GemmEx for {weight:?}: {e}")))?;
        Ok(held)
    }
}
