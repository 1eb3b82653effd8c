//! The runner's quantized matmuls: llama.cpp's MMVQ (up to 8 activation rows, quantized to
//! Q8_1) and MMQ (more rows, MMQ's own Q8_1 layout) as candle-kernels exports them, with an input
//! quantized once for consecutive matmuls that read it.

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

pub(super) type MmvqArgs = (
    *const c_void,
    *const c_void,
    *mut c_void,
    i32,
    i32,
    i32,
    i32,
    i32,
    *mut c_void,
);

/// One MMVQ launch for a weight of `dtype` (up to 8 activation rows).
///
/// # Safety
/// The pointers are device memory of the right sizes on the stream's context.
unsafe fn mmvq(dtype: GgmlDType, a: MmvqArgs) -> Result<()> {
    use candle_kernels::ffi;
    let f = match dtype {
        GgmlDType::Q4_0 => ffi::launch_mmvq_gguf_q4_0_f32_plain,
        GgmlDType::Q4_1 => ffi::launch_mmvq_gguf_q4_1_f32_plain,
        GgmlDType::Q5_0 => ffi::launch_mmvq_gguf_q5_0_f32_plain,
        GgmlDType::Q5_1 => ffi::launch_mmvq_gguf_q5_1_f32_plain,
        GgmlDType::Q8_0 => ffi::launch_mmvq_gguf_q8_0_f32_plain,
        GgmlDType::Q2K => ffi::launch_mmvq_gguf_q2_k_f32_plain,
        GgmlDType::Q3K => ffi::launch_mmvq_gguf_q3_k_f32_plain,
        GgmlDType::Q4K => ffi::launch_mmvq_gguf_q4_k_f32_plain,
        GgmlDType::Q5K => ffi::launch_mmvq_gguf_q5_k_f32_plain,
        GgmlDType::Q6K => ffi::launch_mmvq_gguf_q6_k_f32_plain,
        other => return Err(EngineError::Cuda(format!("no MMVQ kernel for {other:?}"))),
    };
    f(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8);
    Ok(())
}

impl CudaRunner {
    /// `out = x · Wᵀ`: up to 8 rows, the rows quantized to Q8_1 and MMVQ; above, MMQ over the
    /// rows quantized to MMQ's Q8_1 layout ([`launch::matmul_path`]).
    pub(super) fn matmul(&mut self, plan: &Plan, weight: Matrix, x: Buf, out: Buf) -> Result<()> {
        let result = self.matmul_from(plan, weight, x, out);
        self.quantized = match result {
            // `out` is never `x`; were it so, its quantized copy would be stale.
            Ok(Quantized::Mmvq(b) | Quantized::Mmq(b, _) | Quantized::F16(b)) if b == out => None,
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
        let pieces = match launch::matmul_path(rows, false) {
            launch::MatMulPath::Mmvq(pieces) => pieces,
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
        };
        let q8 = self.q8_scratch()?;
        let (q8_ptr, _q) = q8.device_ptr(&self.stream);
        let held = Quantized::Mmvq(x);
        if self.quantized != Some(held) {
            unsafe {
                candle_kernels::ffi::launch_mmvq_gguf_quantize_q8_1_f32(
                    x_ptr as *const c_void,
                    q8_ptr as *mut c_void,
                    k as i32,
                    k_padded as i32,
                    rows as i32,
                    stream,
                );
            }
        }
        let y_row_bytes = (k_padded / QK8_1 * BLOCK_Q8_1_BYTES) as u64;
        for piece in pieces {
            let y = q8_ptr + piece.start as u64 * y_row_bytes;
            let dst = out_ptr + (piece.start * n * std::mem::size_of::<f32>()) as u64;
            let args = (
                w_ptr as *const c_void,
                y as *const c_void,
                dst as *mut c_void,
                k as i32,
                n as i32,
                (k_padded / QK8_1) as i32,
                n as i32,
                piece.len() as i32,
                stream,
            );
            unsafe { mmvq(m.dtype, args)? };
        }
        Ok(held)
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
                self.stream
                    .launch_builder(f)
                    .arg(self.buffer(x)?)
                    .arg(x16)
                    .arg(&count)
                    .launch(config_of(launch::elementwise(rows * k)?))
            }
            .map_err(cuda)?;
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
