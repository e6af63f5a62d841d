//! glibc malloc settings for binxd. Page bodies of up to megabytes are
//! allocated as they arrive and freed as consumers acknowledge them, all
//! the time. With glibc's defaults, freed memory at the top of the heap is
//! handed back to the kernel past a small threshold (`brk`, then `munmap`
//! of the pages) and taken again at the next arrival, where every page
//! faults and is zeroed anew: in the shared memory bench that was most of
//! the sidecar thread's time outside the copy itself (BENCHMARKS.md).
//!
//! binxd keeps up to `retain` bytes of freed heap at the top of each malloc
//! arena for reuse instead. Its resident set stays near its peak after a
//! burst rather than falling back. Only the live bytes are bounded by
//! `memory_limit` (as before: glibc never returned freed memory below the
//! top of a heap either); the e2e tests check the peak resident set
//! against the limit.

/// glibc's `mallopt` parameters (malloc.h).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use std::ffi::c_int;

    pub const M_TRIM_THRESHOLD: c_int = -1;
    pub const M_MMAP_THRESHOLD: c_int = -3;

    unsafe extern "C" {
        pub fn mallopt(param: c_int, value: c_int) -> c_int;
    }
}

/// Largest allocation served from the heap rather than a mapping of its
/// own (glibc's maximum): a page body of a few MiB is reused, not mapped
/// and unmapped each time.
pub const HEAP_UP_TO: usize = 32 << 20;

/// Free heap binxd keeps for a daemon with `memory_limit`: an eighth of it,
/// between 32 MiB and 256 MiB.
pub fn retained_for(memory_limit: u64) -> usize {
    usize::try_from(memory_limit / 8)
        .unwrap_or(usize::MAX)
        .clamp(32 << 20, 256 << 20)
}

/// Keeps up to `retain` bytes of freed heap for reuse and serves
/// allocations up to [`HEAP_UP_TO`] from the heap. Returns false where the
/// allocator is not glibc's (nothing is changed there).
pub fn retain_freed_memory(retain: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let retain = std::ffi::c_int::try_from(retain).unwrap_or(std::ffi::c_int::MAX);
        // Safety: mallopt takes two integers, touches only malloc's own
        // settings and is safe to call at any time (it takes malloc's
        // lock); setting both values also turns off glibc's dynamic
        // adjustment of them.
        // Each on its own: glibc may refuse one (a mapping threshold past
        // its limit with huge pages configured) and take the other.
        let (mapped, trimmed) = unsafe {
            (
                glibc::mallopt(glibc::M_MMAP_THRESHOLD, HEAP_UP_TO as std::ffi::c_int),
                glibc::mallopt(glibc::M_TRIM_THRESHOLD, retain),
            )
        };
        mapped == 1 && trimmed == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = retain;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eighth_of_the_limit_within_bounds() {
        assert_eq!(retained_for(1 << 30), 128 << 20);
        assert_eq!(retained_for(64 << 20), 32 << 20);
        assert_eq!(retained_for(1 << 40), 256 << 20);
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_settings() {
        assert!(retain_freed_memory(retained_for(1 << 30)));
    }
}
