//! The memory limit the shards of one daemon share.
//!
//! Each [`crate::Core`] is one shard: it owns its tasks, and counts what
//! they hold itself. The limit is the daemon's, so every shard mirrors its
//! count into one [`MemoryBudget`] and asks it whether there is room. A
//! shard takes room with a compare-and-swap (`MemoryBudget::try_reserve`)
//! before it keeps pages, so two shards on two threads never both take the
//! last bytes. Atomics are not a clock or I/O: driven from one thread (the
//! simulation), the budget is as deterministic as the rest of the core.
//!
//! What one shard must learn of the others goes through the budget too:
//! how many bytes shards waiting for room want (so a shard with `overflow`
//! pages spills for them), and how much is being spilled.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// One daemon's memory limit and what its shards hold against it; cheap
/// to clone (every clone is the same budget).
#[derive(Clone, Debug)]
pub struct MemoryBudget {
    inner: Arc<Counts>,
}

#[derive(Debug)]
struct Counts {
    limit: u64,
    /// Bytes held for pages, every shard together.
    used: AtomicU64,
    /// Bytes of request bodies waiting, every shard together.
    pending: AtomicU64,
    /// Highest `used` seen, reservations not counted.
    high_water: AtomicU64,
    /// Of `used`, what reservations hold (until their pages are counted).
    reserved: AtomicU64,
    /// Bytes being written to storage to free memory.
    spilling: AtomicU64,
    /// Shards with requests waiting for room.
    wanting: AtomicU64,
    /// Bytes those requests miss (for any task: what a spill anywhere frees).
    wanted: AtomicU64,
    /// Bytes ENQUEUEs of tasks that cannot spill miss: only pages in memory
    /// that are in storage too may leave for them, nothing is spilled.
    wanted_unspillable: AtomicU64,
    /// Reports of wants so far: a shard that freed room for a want knows
    /// a new report from the one it freed for, even of the same size.
    want_reports: AtomicU64,
}

impl MemoryBudget {
    /// An empty budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        MemoryBudget {
            inner: Arc::new(Counts {
                limit,
                used: AtomicU64::new(0),
                pending: AtomicU64::new(0),
                high_water: AtomicU64::new(0),
                reserved: AtomicU64::new(0),
                spilling: AtomicU64::new(0),
                wanting: AtomicU64::new(0),
                wanted: AtomicU64::new(0),
                wanted_unspillable: AtomicU64::new(0),
                want_reports: AtomicU64::new(0),
            }),
        }
    }

    /// The limit (bytes).
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes held for pages now, every shard together.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Acquire)
    }

    /// Bytes of waiting request bodies, every shard together.
    pub fn pending(&self) -> u64 {
        self.inner.pending.load(Ordering::Acquire)
    }

    /// Highest [`MemoryBudget::used`] since start.
    pub fn high_water(&self) -> u64 {
        self.inner.high_water.load(Ordering::Acquire)
    }

    /// Whether some shard has requests waiting for room.
    pub fn someone_waits(&self) -> bool {
        self.inner.wanting.load(Ordering::Acquire) > 0
    }

    /// Whether held pages and waiting bodies reach the limit.
    pub fn full(&self) -> bool {
        self.used().saturating_add(self.pending()) >= self.inner.limit
    }

    /// Room left under the limit for pages.
    pub fn room(&self) -> u64 {
        self.inner.limit.saturating_sub(self.used())
    }

    /// Takes `bytes` if they fit under the limit; they are counted until
    /// [`MemoryBudget::release`]. Atomic: two shards never both take the
    /// last room.
    pub(crate) fn try_reserve(&self, bytes: u64) -> bool {
        if bytes == 0 {
            return true;
        }
        let limit = self.inner.limit;
        let taken = self
            .inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            })
            .is_ok();
        if taken {
            self.inner.reserved.fetch_add(bytes, Ordering::AcqRel);
        }
        taken
    }

    /// Gives back what [`MemoryBudget::try_reserve`] took.
    pub(crate) fn release(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.inner.reserved.fetch_sub(bytes, Ordering::AcqRel);
        self.inner.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// A shard's count moved from `before` to `after`.
    pub(crate) fn moved(&self, before: u64, after: u64) {
        if after >= before {
            let now =
                self.inner.used.fetch_add(after - before, Ordering::AcqRel) + (after - before);
            let held = now.saturating_sub(self.inner.reserved.load(Ordering::Acquire));
            self.inner.high_water.fetch_max(held, Ordering::AcqRel);
        } else {
            self.inner.used.fetch_sub(before - after, Ordering::AcqRel);
        }
    }

    /// Waiting request bodies grew (`true`) or shrank by `bytes`.
    pub(crate) fn pend(&self, bytes: u64, grew: bool) {
        if grew {
            self.inner.pending.fetch_add(bytes, Ordering::AcqRel);
        } else {
            self.inner.pending.fetch_sub(bytes, Ordering::AcqRel);
        }
    }

    /// Spill writes started (`true`) or ended holding `bytes`.
    pub(crate) fn spill(&self, bytes: u64, started: bool) {
        if started {
            self.inner.spilling.fetch_add(bytes, Ordering::AcqRel);
        } else {
            self.inner.spilling.fetch_sub(bytes, Ordering::AcqRel);
        }
    }

    /// Bytes held that no spill under way will free.
    pub(crate) fn unspilled(&self) -> u64 {
        self.used()
            .saturating_sub(self.inner.spilling.load(Ordering::Acquire))
    }

    /// A shard's want changed from `before` to `after`: (waiting for room,
    /// bytes missed, bytes missed by ENQUEUEs that cannot spill).
    pub(crate) fn want(&self, before: (bool, u64, u64), after: (bool, u64, u64)) {
        self.inner.want_reports.fetch_add(1, Ordering::AcqRel);
        shift(&self.inner.wanted_unspillable, before.2, after.2);
        shift(&self.inner.wanted, before.1, after.1);
        match (before.0, after.0) {
            (false, true) => {
                self.inner.wanting.fetch_add(1, Ordering::AcqRel);
            }
            (true, false) => {
                self.inner.wanting.fetch_sub(1, Ordering::AcqRel);
            }
            _ => {}
        }
    }

    /// Shards waiting for room, and the bytes they miss (every shard's
    /// last report).
    pub(crate) fn wants(&self) -> (u64, u64) {
        (
            self.inner.wanting.load(Ordering::Acquire),
            self.inner.wanted.load(Ordering::Acquire),
        )
    }

    /// Bytes all shards' ENQUEUEs miss that only eviction can free (spills
    /// help the others), and how many wants were reported so far.
    pub(crate) fn evictable_wants(&self) -> (u64, u64) {
        (
            self.inner.wanted.load(Ordering::Acquire)
                + self.inner.wanted_unspillable.load(Ordering::Acquire),
            self.inner.want_reports.load(Ordering::Acquire),
        )
    }
}

/// Moves a shared total by one shard's change of its part, `before` to `after`.
fn shift(total: &AtomicU64, before: u64, after: u64) {
    if after >= before {
        total.fetch_add(after - before, Ordering::AcqRel);
    } else {
        total.fetch_sub(before - after, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_never_passes_the_limit() {
        let budget = MemoryBudget::new(100);
        assert!(budget.try_reserve(60));
        assert!(!budget.try_reserve(41));
        assert!(budget.try_reserve(40));
        assert!(budget.full());
        budget.release(60);
        assert_eq!(budget.used(), 40);
        assert!(!budget.try_reserve(u64::MAX));
    }

    #[test]
    fn the_high_water_follows_the_counts_not_the_reservations() {
        let budget = MemoryBudget::new(100);
        budget.moved(0, 30);
        budget.moved(30, 10);
        assert!(budget.try_reserve(80));
        budget.release(80);
        assert_eq!((budget.used(), budget.high_water()), (10, 30));
    }

    #[test]
    fn reservations_from_many_threads_stay_within_the_limit() {
        let budget = MemoryBudget::new(1000);
        let taken: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let budget = budget.clone();
                    s.spawn(move || (0..1000).filter(|_| budget.try_reserve(7)).count() as u64)
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        assert_eq!(taken, 1000 / 7);
        assert_eq!(budget.used(), taken * 7);
    }
}
