//! glibc malloc settings for binxd. Page bodies of up to megabytes are
//! allocated as they arrive and freed as consumers acknowledge them, all
//! the time. With glibc's defaults, freed memory at the top of the heap is
//! handed back to the kernel past a small threshold (`brk`, then `munmap`
//! of the pages) and taken again at the next arrival, where every page
//! faults and is zeroed anew: in the shared memory bench that was most of
//! the sidecar thread's time outside the copy itself (BENCHMARKS.md).
//!
//! binxd keeps up to `retain` bytes of freed heap, split over at most
//! [`arenas`] malloc arenas, for reuse instead. Its resident set stays near
//! its peak after a burst rather than falling back. Only the live bytes are
//! bounded by `memory_limit`; what malloc keeps on top is bounded here, in
//! total: glibc makes up to eight arenas per core, each keeping its own
//! freed memory, so a per-arena allowance alone grew with the threads that
//! ever allocated (a daemon with a 16 MiB limit went 65 MiB over it). The
//! e2e tests check the peak resident set against the limit + 64 MiB.

/// glibc's `mallopt` parameters (malloc.h).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use std::ffi::c_int;

    pub(super) const M_TRIM_THRESHOLD: c_int = -1;
    pub(super) const M_MMAP_THRESHOLD: c_int = -3;
    pub(super) const M_ARENA_MAX: c_int = -8;

    unsafe extern "C" {
        pub(super) fn mallopt(param: c_int, value: c_int) -> c_int;
    }
}

/// Largest allocation served from the heap rather than a mapping of its
/// own (glibc's maximum): a page body of a few MiB is reused, not mapped
/// and unmapped each time.
pub const HEAP_UP_TO: usize = 32 << 20;

/// Free heap binxd keeps, in total, for a daemon with `memory_limit`: an
/// eighth of it, between 8 MiB and 256 MiB.
pub fn retained_for(memory_limit: u64) -> usize {
    usize::try_from(memory_limit / 8)
        .unwrap_or(usize::MAX)
        .clamp(8 << 20, 256 << 20)
}

/// Malloc arenas binxd allows: one per core (at least 2, at most 8), as
/// many as threads allocate at once in the runtime.
pub fn arenas() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// What [`retain_freed_memory`] sets: each arena keeps at most its share
/// of `retain` at the top of its heap, and allocations larger than that
/// share get mappings of their own (given back when freed) instead of
/// heap that could not be trimmed.
pub fn malloc_settings(retain: usize) -> (usize, usize, usize) {
    let arenas = arenas();
    let per_arena = (retain / arenas).max(1 << 20);
    (arenas, per_arena, per_arena.min(HEAP_UP_TO))
}

/// Keeps up to `retain` bytes of freed heap for reuse, over at most
/// [`arenas`] arenas, and serves allocations up to an arena's share of it
/// (at most [`HEAP_UP_TO`]) from the heap. Returns false where the
/// allocator is not glibc's (nothing is changed there).
pub fn retain_freed_memory(retain: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let (arenas, trim, heap_up_to) = malloc_settings(retain);
        let int = |v: usize| std::ffi::c_int::try_from(v).unwrap_or(std::ffi::c_int::MAX);
        // Safety: mallopt takes two integers, touches only malloc's own
        // settings and is safe to call at any time (it takes malloc's
        // lock); setting the thresholds also turns off glibc's dynamic
        // adjustment of them.
        // Each on its own: glibc may refuse one (a mapping threshold past
        // its limit with huge pages configured) and take the others.
        let (arenas, mapped, trimmed) = unsafe {
            (
                glibc::mallopt(glibc::M_ARENA_MAX, int(arenas)),
                glibc::mallopt(glibc::M_MMAP_THRESHOLD, int(heap_up_to)),
                glibc::mallopt(glibc::M_TRIM_THRESHOLD, int(trim)),
            )
        };
        arenas == 1 && mapped == 1 && trimmed == 1
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
        assert_eq!(retained_for(64 << 20), 8 << 20);
        assert_eq!(retained_for(16 << 20), 8 << 20);
        assert_eq!(retained_for(1 << 40), 256 << 20);
    }

    #[test]
    fn the_allowance_is_shared_by_the_arenas() {
        let (arenas, trim, heap_up_to) = malloc_settings(retained_for(16 << 20));
        assert!((2..=8).contains(&arenas));
        assert!(arenas * trim <= 8 << 20);
        assert!(heap_up_to <= trim);
        let (arenas, trim, heap_up_to) = malloc_settings(retained_for(1 << 30));
        assert!(arenas * trim <= 128 << 20);
        assert!(heap_up_to <= HEAP_UP_TO);
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_settings() {
        assert!(retain_freed_memory(retained_for(1 << 30)));
    }
}
