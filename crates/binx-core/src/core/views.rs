//! Views: stats, task snapshots and the checks of the core's own invariants.

use super::*;

impl Core {
    /// Bytes of bookkeeping counted past the memory limit (see
    /// `max_slot_slack`).
    pub(crate) fn memory_slack(&self) -> u64 {
        self.tasks.values().map(max_slot_slack).sum()
    }

    /// The tasks this shard holds.
    pub(crate) fn task_ids(&self) -> impl Iterator<Item = &TaskId> {
        self.tasks.keys()
    }

    /// A snapshot of counters and gauges.
    pub fn stats(&self) -> CoreStats {
        let mut stats = self.stats.clone();
        stats.memory_used = self.memory_used;
        stats.memory_high_water = self.budget.high_water();
        stats.memory_pending = self.pending_bytes;
        stats.tasks = self.tasks.len() as u64;
        stats.buffers = self.tasks.values().map(|t| t.buffers.len() as u64).sum();
        stats.pages_buffered = self.pages_held();
        stats.page_bytes_held = self.tasks.values().map(|t| t.page_bytes).sum();
        stats.draining = self.draining;
        stats.spills_in_flight = self.spills_in_flight as u64;
        stats.requests_waiting = self.parked.len() as u64;
        stats.objects_held = self.objects.len() as u64;
        stats.pending_deletes = self.deletes_in_flight as u64;
        stats.markers = self.markers.len() as u64;
        stats.requests = self.reply_counts();
        stats
    }

    /// The reply counts as `"DATA OK"` and the like.
    pub(super) fn reply_counts(&self) -> Vec<ReplyCount> {
        let mut out = Vec::new();
        for (kind, row) in self.replies.iter().enumerate() {
            for (status, &count) in row.iter().enumerate() {
                if count == 0 {
                    continue;
                }
                let kind = i32::try_from(kind)
                    .ok()
                    .and_then(|k| MessageType::try_from(k).ok());
                let status = i32::try_from(status)
                    .ok()
                    .and_then(|s| Status::try_from(s).ok());
                // Several numbers outside the protocol are all "unknown":
                // one entry each pair, so no series is repeated.
                match out
                    .iter_mut()
                    .find(|c: &&mut ReplyCount| c.kind == kind && c.status == status)
                {
                    Some(same) => same.count += count,
                    None => out.push(ReplyCount {
                        kind,
                        status,
                        count,
                    }),
                }
            }
        }
        out
    }

    /// Every open task whose id starts with `prefix`, by id, with its buffers.
    pub fn task_snapshots(&self, prefix: &str, now: Instant) -> Vec<TaskSnapshot> {
        let mut room = usize::MAX;
        self.task_snapshots_within(prefix, now, &mut room).0
    }

    /// The first open tasks whose id starts with `prefix`, by id, with
    /// their buffers, as many as `room` allows (a task takes one, and one
    /// a buffer; it is taken off `room`), and whether more matched: an
    /// operator's listing of a busy daemon stays bounded.
    pub fn task_snapshots_within(
        &self,
        prefix: &str,
        now: Instant,
        room: &mut usize,
    ) -> (Vec<TaskSnapshot>, bool) {
        let mut out = Vec::new();
        let from = (
            std::ops::Bound::Included(prefix),
            std::ops::Bound::Unbounded,
        );
        for (id, task) in self.tasks.range::<str, _>(from) {
            if !id.as_str().starts_with(prefix) {
                break;
            }
            let cost = 1 + task.buffers.len();
            if cost > *room {
                return (out, true);
            }
            *room = room.saturating_sub(cost);
            out.push(TaskSnapshot::of(id.as_str(), task, now));
        }
        (out, false)
    }

    /// Checks the core's own bookkeeping against a recount from its state:
    /// memory equals what the pages really pin and stays within the limits;
    /// pending bytes equal the bodies held; every parked request is where
    /// its indexes say. For tests and the simulation.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.reported_want.0 && self.budget.wants().0 == 0 {
            return Err("the shard waits for room, and the budget counts no shard waiting".into());
        }
        let mut total = 0u64;
        for task in self.tasks.values() {
            task.check_floor()?;
            let recount = task.recount_memory();
            if recount != task.memory() {
                return Err(format!(
                    "task {} counts {} bytes of memory but its pages hold {recount}",
                    task.id,
                    task.memory()
                ));
            }
            if task.memory() > self.config.task_memory_limit + max_slot_slack(task) {
                return Err(format!(
                    "task {} holds {} bytes, above its limit of {}",
                    task.id,
                    task.memory(),
                    self.config.task_memory_limit
                ));
            }
            total += task.memory();
        }
        if total != self.memory_used {
            return Err(format!(
                "memory_used is {} but the tasks hold {total}",
                self.memory_used
            ));
        }
        let slack: u64 = self.tasks.values().map(max_slot_slack).sum();
        if self.memory_used > self.config.memory_limit + slack {
            return Err(format!(
                "memory_used {} is above the limit {}",
                self.memory_used, self.config.memory_limit
            ));
        }
        let pending: u64 = self.parked.values().map(Parked::waiting_bytes).sum();
        // Every parked request counts in its connection's entry (which
        // `connection_closed` relies on to skip the walk).
        let mut parked_per_conn: std::collections::HashMap<ConnId, usize> =
            std::collections::HashMap::new();
        for p in self.parked.values() {
            *parked_per_conn.entry(p.conn).or_default() += 1;
        }
        for (conn, count) in parked_per_conn {
            let counted = self.conns.get(&conn).map_or(0, |c| c.outstanding);
            if counted < count {
                return Err(format!(
                    "connection {conn:?} has {count} parked requests and counts {counted} outstanding"
                ));
            }
        }
        if pending != self.pending_bytes {
            return Err(format!(
                "pending_bytes is {} but the parked requests hold {pending}",
                self.pending_bytes
            ));
        }
        let outstanding: usize = self.conns.values().map(|c| c.outstanding).sum();
        if outstanding != self.parked.len() {
            return Err(format!(
                "connections count {outstanding} outstanding requests, {} are parked",
                self.parked.len()
            ));
        }
        for (ticket, parked) in &self.parked {
            if !parked.state.fits(&parked.request.op) {
                return Err(format!(
                    "{ticket:?} is a {} parked as {:?}",
                    parked.request.kind().name(),
                    parked.state
                ));
            }
        }
        for ticket in &self.spooling {
            if let Some(p) = self.parked.get(ticket)
                && !matches!(p.state, ParkState::Spooling(_))
            {
                return Err(format!(
                    "{ticket:?} waits for spills but is parked as {:?}",
                    p.state
                ));
            }
        }
        for (_, ticket) in &self.deadlines {
            if !self.parked.contains_key(ticket) {
                return Err(format!("deadline for {ticket:?}, which is not parked"));
            }
        }
        Ok(())
    }

    /// The id of the last command issued (tests).
    #[cfg(test)]
    pub(crate) fn debug_last_op(&self) -> u64 {
        self.next_op
    }

    /// Names of the objects a commit marker of this daemon names now.
    pub fn objects_named_by_markers(&self) -> Vec<String> {
        self.objects
            .counts()
            .filter(|(_, _, _, markers, _)| *markers > 0)
            .map(|(_, meta, ..)| meta.name.clone())
            .collect()
    }

    /// Names of every object this daemon still refers to.
    pub fn objects_held(&self) -> Vec<String> {
        self.objects
            .counts()
            .map(|(_, meta, ..)| meta.name.clone())
            .collect()
    }
}
