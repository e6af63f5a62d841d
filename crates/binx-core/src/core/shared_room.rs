//! Room shared with other shards: what a shard tells the [`MemoryBudget`]
//! it wants, when the driver must let the other shards look again, and
//! what they do then.

use super::*;

impl Core {
    /// Whether the other shards of this exchange should look at the shared
    /// memory budget again ([`Core::room_elsewhere`]): this shard freed
    /// memory or waiting bodies while some shard waits for room, or it
    /// began to wait itself (others may spill for it). The driver asks
    /// after every call into the shard; a single core never needs to.
    pub fn take_room_signal(&mut self) -> bool {
        let waiting = !self.blocked.is_empty();
        let missed = self.room_missed_here();
        let unspillable: u64 = self.room_wanted_unspillable.values().sum();
        let want = (waiting, missed, unspillable);
        let before = std::mem::replace(&mut self.reported_want, want);
        if before != want {
            self.budget.want(before, want);
        }
        let began = (waiting && !before.0) || missed > before.1 || unspillable > before.2;
        let freed = std::mem::take(&mut self.freed_since_signal);
        let (wanting, _) = self.budget.wants();
        let others_wait = wanting > u64::from(waiting);
        began || (freed && others_wait)
    }

    /// What this shard's ENQUEUEs that can spill miss of the daemon's room
    /// (not of their task's own), as each last tried.
    pub(super) fn room_missed_here(&self) -> u64 {
        self.room_wanted
            .values()
            .filter(|(own, _)| own.is_none())
            .map(|(_, bytes)| bytes)
            .sum()
    }

    /// Another shard freed room, or waits for it: requests waiting here
    /// for room try again, and spills this shard owes start.
    pub fn room_elsewhere(&mut self, now: Instant) {
        self.room_freed = true;
        self.after(now);
    }
}
