//! Timers: deadlines of parked requests, abandonment, tombstone expiry, and the next wake-up.

use super::*;

impl Core {
    /// Applies what is due at `now`: expired waits answer (NO_DATA, BUSY),
    /// abandoned buffers are dropped, old pages spill.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.start_clock(now);
        while let Some(&(at, ticket)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.remove(&(at, ticket));
            let Some(parked) = self.parked.get(&ticket) else {
                continue;
            };
            match parked.state {
                ParkState::DataWait => self.retry_data(ticket, now, false),
                ParkState::Queued { .. } => {
                    let conn = parked.conn;
                    self.blocked.remove(&ticket);
                    if let Step::Done(reply) = self.step_mutation(ticket, now) {
                        let kind = self
                            .parked
                            .get(&ticket)
                            .map_or(MessageType::Enqueue, |p| p.request.kind());
                        self.unpark(ticket);
                        self.emit(ticket, kind, Outcome::Reply(reply));
                        self.pump(conn, now);
                    } else {
                        self.blocked.insert(ticket);
                    }
                }
                _ => {}
            }
        }
        if self.next_sweep.is_some_and(|at| at <= now) {
            self.sweep(now);
            self.next_sweep = Some(now + self.sweep_period());
        }
        if self.next_age_check.is_some_and(|at| at <= now) {
            self.next_age_check = None;
        }
        if self.next_forgotten.is_some_and(|at| at <= now) {
            self.start_forgotten_lookups(now);
        }
        self.after(now);
    }

    /// Drops buffers no consumer polled for `abandon_after`, and tasks with
    /// nothing left that nobody touched for as long; forgets old tombstones.
    pub(super) fn sweep(&mut self, now: Instant) {
        let abandon_after = self.config.abandon_after;
        let ttl = self.spool().map(|s| s.ttl);
        let mut stale: Vec<(TaskId, u64)> = Vec::new();
        let mut idle: Vec<TaskId> = Vec::new();
        let mut evict: Vec<(TaskId, u64)> = Vec::new();
        for (task_id, task) in &self.tasks {
            let producing = !task.producers.is_empty();
            // A task that commits its output, while its producer still
            // holds a connection, may produce for longer than the abandon
            // time before anyone reads (fault-tolerant execution reads a
            // stage's output only once it finished): none of its buffers
            // is dropped. Others lose the buffers nobody polls (their
            // consumer went); the task itself stays while it is produced.
            if producing && task.policy.commits() {
                continue;
            }
            for (&id, b) in &task.buffers {
                if b.gone.is_some() || now.saturating_duration_since(b.last_poll) < abandon_after {
                    continue;
                }
                match b.committed_at {
                    // Committed: read from storage until its objects may
                    // expire (the first was written after the task was
                    // born); nobody reads it now, so its memory goes.
                    Some(_)
                        if ttl.is_none_or(|ttl| now.saturating_duration_since(task.born) < ttl) =>
                    {
                        evict.push((task_id.clone(), id));
                    }
                    _ => stale.push((task_id.clone(), id)),
                }
            }
            // A member of a fixed BROADCAST set that no consumer ever asked
            // for holds every page of the set (each is freed once all
            // members have it): abandoned like one that stopped asking.
            if task.kind == BufferKind::Broadcast
                && let Some(count) = task.fixed_count
                && (task.buffers.len() as u64) < count
                && now.saturating_duration_since(task.opened_at) >= abandon_after
            {
                stale.extend(
                    (0..count)
                        .filter(|id| !task.buffers.contains_key(id))
                        .map(|id| (task_id.clone(), id)),
                );
            }
            let untouched = now.saturating_duration_since(task.last_activity) >= abandon_after;
            if untouched && !producing && task.buffers.values().all(|b| b.gone.is_some()) {
                idle.push(task_id.clone());
            }
        }
        for (task_id, buffer_id) in evict {
            if let Some(task) = self.tasks.get_mut(&task_id) {
                let before = task.memory();
                let pages = task.evict_stored(buffer_id);
                let after = task.memory();
                self.account(before, after);
                self.stats.bytes_evicted += before.saturating_sub(after);
                if pages > 0 {
                    let freed = before.saturating_sub(after);
                    tracing::debug!(task = %task_id, buffer = buffer_id, pages, freed, "committed buffer unread for the abandon time: its memory is freed; it is read from storage");
                }
            }
        }
        // A task's stale buffers (listed together) are dropped together:
        // whether the task is over, and a BROADCAST set's floor, are looked
        // at once, not at each of thousands.
        let mut by_task: Vec<(TaskId, Vec<u64>)> = Vec::new();
        for (task_id, buffer_id) in stale {
            tracing::warn!(
                task = %task_id, buffer = buffer_id,
                "dropping abandoned buffer: no consumer polled it for {abandon_after:?}"
            );
            self.stats.abandoned_buffers += 1;
            match by_task.last_mut() {
                Some((last, ids)) if *last == task_id => ids.push(buffer_id),
                _ => by_task.push((task_id, vec![buffer_id])),
            }
        }
        for (task_id, buffer_ids) in by_task {
            self.drop_buffers(&task_id, buffer_ids, BufferGone::Abandoned, now);
        }
        for task_id in idle {
            let Some(task) = self.tasks.get(&task_id) else {
                continue;
            };
            let how = if task.is_done() && !task.abandoned_any {
                finished(task)
            } else {
                tracing::warn!(task = %task_id, "dropping a task nobody touched for {abandon_after:?}; its consumers will see it as abandoned");
                Gone::Abandoned
            };
            self.end_task(&task_id, how, now);
        }
        self.ended.expire(now);
        self.early.expire(now);
        let idle_remotes = self
            .spool()
            .map_or(Duration::from_secs(600), |s| s.failover_after * 10)
            .max(abandon_after);
        self.remotes.expire(now, idle_remotes);
        self.silences.expire(now, idle_remotes);
    }

    /// After any change: wake DATA waiters of changed buffers, retry
    /// ENQUEUEs waiting for room, start due spills and drain steps.
    pub(super) fn after(&mut self, now: Instant) {
        for _ in 0..4 {
            let dirty = std::mem::take(&mut self.dirty);
            for (task, buffer) in dirty {
                self.wake_data(&task, buffer, now);
            }
            if std::mem::take(&mut self.room_freed) && !self.blocked.is_empty() {
                let heads: Vec<Ticket> = self.blocked.iter().copied().collect();
                for ticket in heads {
                    self.blocked.remove(&ticket);
                    let Some(conn) = self.parked.get(&ticket).map(|p| p.conn) else {
                        continue;
                    };
                    if self.conns.get(&conn).and_then(|c| c.queue.front()) == Some(&ticket) {
                        self.pump(conn, now);
                    }
                }
            }
            self.drive_spills(now);
            self.drive_commit_waits(now);
            self.drive_drain(now);
            if self.dirty.is_empty() && !self.room_freed {
                break;
            }
        }
        if self.next_age_check.is_none()
            && let Some(rules) = &self.config.spool
            && self
                .tasks
                .values()
                .any(|t| t.policy.spills() && t.memory() > 0)
        {
            self.next_age_check =
                Some(now + (rules.spill_after / 4).max(Duration::from_millis(100)));
        }
    }

    pub(super) fn wake_data(&mut self, task: &TaskId, buffer: Option<u64>, now: Instant) {
        let Some(waiters) = self.data_waiters.get(task) else {
            return;
        };
        let tickets: Vec<Ticket> = match buffer {
            Some(b) => waiters
                .get(&b)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default(),
            None => waiters.values().flatten().copied().collect(),
        };
        for ticket in tickets {
            self.retry_data(ticket, now, true);
        }
    }

    /// Moves the daemon's count by a task's change from `before` to `after`.
    pub(super) fn account(&mut self, before: u64, after: u64) {
        let old = self.memory_used;
        self.memory_used = old.saturating_sub(before) + after;
        self.budget.moved(old, self.memory_used);
        if after < before {
            self.room_freed = true;
            self.freed_since_signal = true;
        }
    }
}
