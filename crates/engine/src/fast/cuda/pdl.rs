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

/// The most arguments a kernel of ours takes (`attention_decode_*` has 18).
const MAX_ARGS: usize = 24;

/// One kernel's arguments, each in a slot of 8 bytes (a scalar's bytes at its start: the
/// kernel reads as many as its parameter's type has, little-endian). Fixed arrays: a launch
/// allocates nothing (eager steps make hundreds).
pub(super) struct PdlLaunch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    slots: [u64; MAX_ARGS],
    len: usize,
}

/// Starts a launch of `func` on `stream`.
pub(super) fn launch<'a>(stream: &'a CudaStream, func: &'a CudaFunction) -> PdlLaunch<'a> {
    PdlLaunch {
        stream,
        func,
        slots: [0; MAX_ARGS],
        len: 0,
    }
}

impl PdlLaunch<'_> {
    /// A device buffer argument (its pointer).
    pub(super) fn ptr<T>(&mut self, slice: &CudaSlice<T>) -> &mut Self {
        let (p, _guard) = slice.device_ptr(self.stream);
        self.push(p)
    }

    /// A raw device pointer argument (0 for a null pointer the kernel tests).
    pub(super) fn raw(&mut self, ptr: sys::CUdeviceptr) -> &mut Self {
        self.push(ptr)
    }

    pub(super) fn i32(&mut self, v: i32) -> &mut Self {
        self.push(u64::from(v as u32))
    }

    pub(super) fn f32(&mut self, v: f32) -> &mut Self {
        self.push(u64::from(v.to_bits()))
    }

    /// One more argument; past [`MAX_ARGS`] the count still grows, and `go` refuses.
    fn push(&mut self, value: u64) -> &mut Self {
        if let Some(slot) = self.slots.get_mut(self.len) {
            *slot = value;
        }
        self.len += 1;
        self
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// The arguments must be what the kernel's parameters are, in order, and every pointer
    /// device memory of the stream's context that outlives the kernel's run.
    pub(super) unsafe fn go(&mut self, l: Launch) -> Result<()> {
        if self.len > MAX_ARGS {
            return Err(EngineError::Cuda(format!(
                "a launch of {} arguments, over the {MAX_ARGS} a launch holds",
                self.len
            )));
        }
        self.stream.context().bind_to_thread().map_err(cuda)?;
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (param, slot) in params.iter_mut().zip(&mut self.slots) {
            *param = (slot as *mut u64).cast::<c_void>();
        }
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
