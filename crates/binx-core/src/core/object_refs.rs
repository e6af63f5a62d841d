//! Objects this daemon wrote: references, leases and deletion once nothing refers to them.

use super::*;

impl Core {
    /// Asks for the deletion of objects nothing refers to, within the
    /// bound on deletions in flight (past it, the TTL pruner takes them).
    pub(super) fn delete_objects(&mut self, deletes: Vec<Arc<ObjectMeta>>) {
        let max = self.spool().map_or(0, |s| s.max_pending_deletes);
        for meta in deletes {
            if self.deletes_in_flight >= max {
                self.stats.deletes_left_to_ttl += 1;
                tracing::warn!(object = %meta.name, "deletion queue full; the TTL pruner will remove this object");
                continue;
            }
            self.deletes_in_flight += 1;
            self.new_op(OpKind::ObjectDelete, Command::DeleteObject(meta));
        }
    }

    /// An object deletion finished (a failure leaves it to the TTL pruner).
    pub fn object_deleted(&mut self, op: OpId, result: Result<(), StoreFailure>, now: Instant) {
        if let Some(OpKind::ObjectDelete) = self.ops.remove(&op) {
            self.deletes_in_flight = self.deletes_in_flight.saturating_sub(1);
            if let Err(e) = result {
                tracing::warn!(error = %e, "could not delete a released spool object; the TTL pruner will");
            }
        }
        self.after(now);
    }
}
