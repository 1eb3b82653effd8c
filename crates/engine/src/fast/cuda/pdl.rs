//! Launches of our kernels with programmatic dependent launch (Hopper's `griddepcontrol`, what
//! llama.cpp b9793 uses): each launch carries the programmatic-stream-serialization attribute,
//! so the next kernel of the stream (or of the captured graph) is scheduled as soon as every
//! block of this one has run its `griddepcontrol.launch_dependents`, and waits at its own
//! `griddepcontrol.wait` for this one to finish. Every kernel in `kernels.cu` starts with both
//! (`GRID_DEPENDENCY()`; `scripts/check-kernels.py` refuses a kernel without the wait), so the
//! order of the results is the stream's; what is saved is the launch latency between kernels.
//!
//! cudarc's launch builder has no launch attributes, so this is a builder of its own over
//! `cuLaunchKernelEx`. The runner disables cudarc's event tracking (one stream, ordered by the
//! runner), so taking the device pointers needs no events.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, DevicePtr,
};

use super::{cuda, Launch};
use crate::error::{EngineError, Result};

/// One kernel's arguments, each in a slot of 8 bytes (a scalar's bytes at its start: the
/// kernel reads as many as its parameter's type has, little-endian).
pub(super) struct PdlLaunch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    slots: Vec<u64>,
}

/// Starts a launch of `func` on `stream`.
pub(super) fn launch<'a>(stream: &'a CudaStream, func: &'a CudaFunction) -> PdlLaunch<'a> {
    PdlLaunch {
        stream,
        func,
        slots: Vec::with_capacity(16),
    }
}

impl PdlLaunch<'_> {
    /// A device buffer argument (its pointer).
    pub(super) fn ptr<T>(&mut self, slice: &CudaSlice<T>) -> &mut Self {
        let (p, _guard) = slice.device_ptr(self.stream);
        self.slots.push(p);
        self
    }

    /// A raw device pointer argument (0 for a null pointer the kernel tests).
    pub(super) fn raw(&mut self, ptr: sys::CUdeviceptr) -> &mut Self {
        self.slots.push(ptr);
        self
    }

    pub(super) fn i32(&mut self, v: i32) -> &mut Self {
        self.slots.push(u64::from(v as u32));
        self
    }

    pub(super) fn f32(&mut self, v: f32) -> &mut Self {
        self.slots.push(u64::from(v.to_bits()));
        self
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// The arguments must be what the kernel's parameters are, in order, and every pointer
    /// device memory of the stream's context that outlives the kernel's run.
    pub(super) unsafe fn go(&mut self, l: Launch) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(cuda)?;
        let mut params: Vec<*mut c_void> = self
            .slots
            .iter_mut()
            .map(|s| (s as *mut u64).cast::<c_void>())
            .collect();
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: l.grid.0,
            gridDimY: l.grid.1,
            gridDimZ: l.grid.2,
            blockDimX: l.block.0,
            blockDimY: l.block.1,
            blockDimZ: l.block.2,
            sharedMemBytes: 0,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: the caller's contract; `params` and `attr` live until the call returns, and
        // the driver copies the argument values before it does.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }
        .map_err(|e| EngineError::Cuda(format!("launch with programmatic dependence: {e}")))
    }
}
