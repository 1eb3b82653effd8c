//! Byte buffers for tensor data: 64-byte aligned, so SIMD loads and block casts are safe; on
//! Linux, buffers of 2 MiB and more are mapped at a 2 MiB boundary and advised for transparent
//! huge pages.
//!
//! Why huge pages: decode streams every weight byte once per token, 1.9 GB for the 3B shape.
//! With 4 KiB pages that is a TLB miss (a page walk) every 4 KiB of stream; with 2 MiB pages, one
//! every 2 MiB. Machines default to `transparent_hugepage=madvise`, so without the advice the
//! weights never get huge pages.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// The huge page size (x86-64) and the smallest buffer mapped for it.
const HUGE_PAGE: usize = 2 << 20;

/// A byte buffer aligned to 64 bytes (2 MiB from `HUGE_PAGE` bytes on Linux), zero-filled at
/// creation.
pub struct AlignedBytes {
    ptr: NonNull<u8>,
    len: usize,
    memory: Memory,
}

enum Memory {
    /// From the global allocator with this layout.
    Heap(Layout),
    /// An anonymous mapping of this many bytes at `ptr` (Linux).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    Mapped(usize),
}

// SAFETY: the buffer owns its memory outright (no sharing, no interior mutability): it is as
// thread-safe as a `Vec<u8>`.
unsafe impl Send for AlignedBytes {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    pub fn zeroed(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE {
            if let Some(b) = Self::mapped(len) {
                return b;
            }
        }
        // A zero-sized layout cannot be allocated: an empty buffer still holds 64 bytes.
        let layout = match Layout::from_size_align(len.max(64).next_multiple_of(64), 64) {
            Ok(l) => l,
            Err(_) => handle_alloc_error(Layout::new::<[u8; 64]>()),
        };
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            handle_alloc_error(layout)
        };
        Self {
            ptr,
            len,
            memory: Memory::Heap(layout),
        }
    }

    /// A zeroed anonymous mapping whose start is 2 MiB-aligned, advised for huge pages (the
    /// kernel backs each whole aligned 2 MiB inside it with one; the tail past the last whole one
    /// stays in small pages, so nothing beyond `len` rounded to 4 KiB is ever resident). `None`
    /// when the kernel refuses the mapping (the caller then uses the heap).
    #[cfg(target_os = "linux")]
    fn mapped(len: usize) -> Option<Self> {
        let size = len.next_multiple_of(4096);
        let span = size + HUGE_PAGE;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
        // existing memory.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        // SAFETY: both ranges lie inside the mapping just made and are page-aligned (`base`, the
        // kernel's, and `start`, a multiple of 2 MiB; `size` is a multiple of 4 KiB); what is
        // left, `start..start + size`, is the buffer.
        unsafe {
            if start > base {
                libc::munmap(base as *mut libc::c_void, start - base);
            }
            let tail = base + span - (start + size);
            if tail > 0 {
                libc::munmap((start + size) as *mut libc::c_void, tail);
            }
            // Advice only: a kernel without THP answers EINVAL and the buffer keeps small pages.
            libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        Some(Self {
            ptr: NonNull::new(start as *mut u8)?,
            len,
            memory: Memory::Mapped(size),
        })
    }

    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut out = Self::zeroed(bytes.len());
        out.as_mut_slice().copy_from_slice(bytes);
        out
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points at at least `len` initialised (zeroed, then written) bytes that
        // live as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        match self.memory {
            // SAFETY: allocated by `alloc_zeroed` with exactly this layout.
            Memory::Heap(layout) => unsafe { dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: the mapping made in `mapped`, of exactly this size.
            #[cfg(target_os = "linux")]
            Memory::Mapped(size) => unsafe {
                libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, size);
            },
            #[cfg(not(target_os = "linux"))]
            Memory::Mapped(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_of_every_size_are_zeroed_aligned_and_writable() {
        for len in [
            0,
            1,
            63,
            64,
            4097,
            HUGE_PAGE - 1,
            HUGE_PAGE,
            3 * HUGE_PAGE + 12345,
        ] {
            let mut b = AlignedBytes::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_slice().as_ptr() as usize % 64, 0, "len {len}");
            if len >= HUGE_PAGE && cfg!(target_os = "linux") {
                assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0, "len {len}");
            }
            assert!(b.as_slice().iter().all(|&x| x == 0), "len {len}");
            for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
                *x = i as u8;
            }
            let c = AlignedBytes::from_slice(b.as_slice());
            assert_eq!(c.as_slice(), b.as_slice());
        }
    }
}
