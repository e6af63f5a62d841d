//! A sealed memfd mapped shared into this process. The seals forbid
//! shrinking: a peer that truncated the file would otherwise make every
//! access to the missing pages kill us with SIGBUS.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::ShmError;
use crate::layout::Layout;

/// Seals every region carries: its size is fixed for good.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// One mapped region and the memfd behind it.
pub struct Mapping {
    ptr: NonNull<u8>,
    layout: Layout,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this value (unmapped
// on drop); no thread-bound state. Every access to it goes through atomics
// or bounds-checked copies.
unsafe impl Send for Mapping {}
// SAFETY: as for Send: shared access is through atomics, bounds-checked
// copies, and the client's slices of slots it holds (`slot_bytes`, whose
// callers guarantee nothing writes them meanwhile).
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Creates a sealed memfd of `layout.region_size` bytes, maps it and
    /// writes the header.
    pub fn create(name: &str, layout: Layout) -> Result<Mapping, ShmError> {
        let sys = |what: &'static str| move |e: rustix::io::Errno| ShmError::Sys(what, e.into());
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(sys("memfd_create"))?;
        rustix::fs::ftruncate(&fd, layout.region_size as u64).map_err(sys("ftruncate"))?;
        rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(sys("sealing the memfd"))?;
        let mapping = Mapping::map(fd, layout)?;
        // Safety: the header lies inside the fresh mapping, which no one else
        // has seen yet.
        unsafe {
            let header = layout.header();
            std::ptr::copy_nonoverlapping(header.as_ptr(), mapping.ptr.as_ptr(), header.len());
        }
        Ok(mapping)
    }

    /// Maps a region received from the sidecar, after checking its seals, its
    /// size and its header.
    pub fn open(fd: OwnedFd) -> Result<Mapping, ShmError> {
        let sys = |what: &'static str| move |e: rustix::io::Errno| ShmError::Sys(what, e.into());
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(sys("reading the memfd seals"))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(ShmError::BadHeader(format!(
                "the region's memfd is not sealed against resizing (seals {seals:?})"
            )));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(sys("fstat of the memfd"))?
            .st_size;
        let size = usize::try_from(size).unwrap_or(0);
        if size < crate::layout::HEADER_SIZE {
            return Err(ShmError::BadHeader(format!(
                "the region is only {size} bytes"
            )));
        }
        let mut header = [0u8; crate::layout::HEADER_SIZE];
        rustix::io::pread(&fd, &mut header, 0).map_err(sys("reading the region header"))?;
        let layout = Layout::parse(&header, size)?;
        Mapping::map(fd, layout)
    }

    fn map(fd: OwnedFd, layout: Layout) -> Result<Mapping, ShmError> {
        // Safety: a fresh shared mapping of a file we hold; the length is the
        // file's sealed size (or less), so every page is backed.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                layout.region_size,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(|e| ShmError::Sys("mmap", e.into()))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(ShmError::Sys(
            "mmap",
            std::io::Error::other("mmap returned a null pointer"),
        ))?;
        Ok(Mapping { ptr, layout, fd })
    }

    /// The region's geometry.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The memfd behind the region, to pass to the peer.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// The u64 word at `at`; `at` is one of our own aligned offsets.
    pub(crate) fn word64(&self, at: usize) -> &AtomicU64 {
        assert!(at.is_multiple_of(8) && at + 8 <= self.layout.region_size);
        // Safety: in bounds and aligned (the mapping is page-aligned); shared
        // memory is only ever accessed atomically at these offsets.
        unsafe { &*self.ptr.as_ptr().add(at).cast::<AtomicU64>() }
    }

    /// The u32 word at `at`; `at` is one of our own aligned offsets.
    pub(crate) fn word32(&self, at: usize) -> &AtomicU32 {
        assert!(at.is_multiple_of(4) && at + 4 <= self.layout.region_size);
        // Safety: as for `word64`.
        unsafe { &*self.ptr.as_ptr().add(at).cast::<AtomicU32>() }
    }

    /// Copies `out.len()` bytes from slot `slot` at `offset` (checked by the
    /// caller against the layout).
    #[cfg(test)]
    pub(crate) fn read_slot(&self, slot: usize, offset: usize, out: &mut [u8]) {
        let range = self.layout.slot_range(slot);
        assert!(offset + out.len() <= range.len());
        // Safety: in bounds by the assertion. The peer may write the slot at
        // the same time only if it breaks the protocol; then it gets garbage
        // back in its own stream, and we never look at these bytes again.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(range.start + offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
    }

    /// Copies `out.len()` bytes from slot `slot` at `offset` (checked by the
    /// caller against the layout) into memory not yet initialized (a
    /// receive buffer's spare room), which saves zeroing it first.
    pub(crate) fn read_slot_uninit(
        &self,
        slot: usize,
        offset: usize,
        out: &mut [std::mem::MaybeUninit<u8>],
    ) {
        let range = self.layout.slot_range(slot);
        assert!(offset + out.len() <= range.len());
        // Safety: as for `read_slot`; MaybeUninit<u8> has u8's layout.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(range.start + offset),
                out.as_mut_ptr().cast::<u8>(),
                out.len(),
            );
        }
    }

    /// Like [`Mapping::read_slot_uninit`], but through the region's
    /// descriptor (`pread`), so the slot's pages are never mapped into this
    /// process: the sidecar reads what a client wrote without the client's
    /// memory counting as its own resident set (a client may write through
    /// every slot of a large region).
    pub(crate) fn pread_slot_uninit(
        &self,
        slot: usize,
        offset: usize,
        out: &mut [std::mem::MaybeUninit<u8>],
    ) -> std::io::Result<()> {
        let range = self.layout.slot_range(slot);
        assert!(offset + out.len() <= range.len());
        let mut at = 0;
        while at < out.len() {
            let position = (range.start + offset + at) as u64;
            match rustix::io::pread(&self.fd, &mut out[at..], position) {
                Ok(([], _)) => {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                Ok((read, _)) => at += read.len(),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Whether `bytes` lie inside this mapping.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        let start = self.ptr.as_ptr() as usize;
        let at = bytes.as_ptr() as usize;
        at >= start && at + bytes.len() <= start + self.layout.region_size
    }

    /// `len` bytes of slot `slot` at `offset` (checked here against the
    /// layout), read where they are.
    ///
    /// # Safety
    ///
    /// For the client only, while it holds the slot: the sidecar, which the
    /// client trusts, writes a slot only while it owns it (docs/PROTOCOL.md
    /// section 6), so nothing writes the bytes while the slice lives. The
    /// sidecar must never call it on a region a client writes.
    pub(crate) unsafe fn slot_bytes(&self, slot: usize, offset: usize, len: usize) -> &[u8] {
        let range = self.layout.slot_range(slot);
        assert!(offset + len <= range.len());
        // Safety: in bounds by the assertion, and the mapping lives as long
        // as `&self`; the caller guarantees nobody writes the range.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start + offset), len) }
    }

    /// Copies `data` into slot `slot` at `offset` (checked by the caller).
    pub(crate) fn write_slot(&self, slot: usize, offset: usize, data: &[u8]) {
        let range = self.layout.slot_range(slot);
        assert!(offset + data.len() <= range.len());
        // Safety: in bounds by the assertion; the slot is ours until submitted.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().add(range.start + offset),
                data.len(),
            );
        }
    }

    /// Writes raw bytes anywhere in the region: for tests that play a
    /// misbehaving peer.
    #[doc(hidden)]
    pub fn scribble(&self, at: usize, data: &[u8]) {
        assert!(at + data.len() <= self.layout.region_size);
        // Safety: in bounds by the assertion.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(at), data.len())
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Safety: the mapping was made by `map` with this length and is no
        // longer borrowed (borrows are tied to `&self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.layout.region_size) };
    }
}
