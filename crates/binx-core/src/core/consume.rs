//! ACK and DELETE: consumers freeing pages and buffers, and deletions that come before their task.

use super::*;

/// Commit markers of forgotten tasks read at once at most, per shard (see
/// `Core::release_forgotten`) ...
const MAX_FORGOTTEN_LOOKUPS: usize = 64;
/// ... and started per second at most, per shard: DELETEs of made-up task
/// ids cost the store at most this many reads a second ...
const FORGOTTEN_LOOKUPS_PER_SECOND: usize = 64;
/// ... while at most this many wait their turn, per shard: a burst (a
/// coordinator closing a query's exchanges after this node restarted sends
/// a DELETE for every buffer of every task it committed) is read at that
/// rate, not dropped. Past it, a DELETE's output is left to the storage
/// TTL (counted in `deletes_left_to_ttl`).
const MAX_FORGOTTEN_QUEUED: usize = 4096;
/// DELETEs left to the TTL past that are warned of once in this long (with
/// how many there were), however many requests bring them.
pub(super) const FORGOTTEN_WARNING_EVERY: Duration = Duration::from_secs(10);

impl Core {
    pub(super) fn ack(
        &mut self,
        request: &Request,
        key: &BufferKey,
        token: u64,
        now: Instant,
    ) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            if self.ended.get(task_id).is_some() {
                return Reply::new(request.reply(Status::Ok));
            }
            if token == 0 {
                // Remembered as a DELETE: the consumer has gone before the
                // producer came (docs/PROTOCOL.md section 4, "DELETE, ABORT_TASK
                // and abandoned buffers").
                // Its commit marker is not read (an ACK never releases
                // committed output): a DELETE after it still reads it.
                self.remember_early(task_id, now, |early| early.insert_acked(buffer_id));
                return Reply::new(request.reply(Status::Ok));
            }
            return refused(
                request,
                Refusal::AckUnknownTask {
                    task: task_id.clone(),
                    buffer: buffer_id,
                    token,
                },
            );
        };
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return refused(request, e);
        }
        task.last_activity = now;
        if let Some(buffer) = task.buffers.get_mut(&buffer_id) {
            if buffer.gone.is_some() {
                return Reply::new(request.reply(Status::Ok));
            }
            buffer.last_poll = now;
        }
        let before = task.memory();
        let mut deletes = Vec::new();
        let result = task.ack(
            buffer_id,
            token,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let after = task.memory();
        self.account(before, after);
        self.delete_objects(deletes);
        match result {
            Ok(()) => Reply::new(request.reply(Status::Ok)),
            Err(e) => refused(request, token_error(e, task_id, buffer_id, token)),
        }
    }

    /// A DELETE of a buffer of a task this process does not know may be the
    /// consumer's last word on output an earlier run of this node committed
    /// (binxd restarted at the same address, which its consumers still
    /// ask): its commit marker is read, and the output released if this
    /// node wrote it, rather than left to the storage TTL. Once per buffer
    /// while the DELETE is remembered; read in turn within
    /// [`MAX_FORGOTTEN_LOOKUPS`] at once and [`FORGOTTEN_LOOKUPS_PER_SECOND`]
    /// started a second, [`MAX_FORGOTTEN_QUEUED`] waiting at most.
    /// Those past the queue's room are counted and warned of once for
    /// the request (a DELETE_TASK names up to `max_buffers_per_task`).
    fn release_forgotten(&mut self, task_id: &TaskId, buffer_ids: Vec<u64>, now: Instant) {
        if self.spool().is_none() || buffer_ids.is_empty() {
            return;
        }
        let room = MAX_FORGOTTEN_QUEUED.saturating_sub(self.forgotten_queue.len());
        let left = buffer_ids.len().saturating_sub(room);
        for buffer_id in buffer_ids.into_iter().take(room) {
            self.forgotten_queue.push_back((task_id.clone(), buffer_id));
        }
        if left > 0 {
            self.stats.deletes_left_to_ttl += left as u64;
            let (warned_at, since) = &mut self.forgotten_warned;
            *since += left as u64;
            if warned_at
                .is_none_or(|at| now.saturating_duration_since(at) >= FORGOTTEN_WARNING_EVERY)
            {
                tracing::warn!(task = %task_id, buffers = *since, "too many DELETEs of forgotten tasks wait for their commit marker to be read; the output of these buffers (this task's and others' since the last such warning), if an earlier run of this node committed it, is left to the storage TTL (counted in deletes_left_to_ttl)");
                *warned_at = Some(now);
                *since = 0;
            }
        }
        self.start_forgotten_lookups(now);
    }

    /// Starts the marker reads of queued forgotten DELETEs the bounds allow
    /// now; when only the rate holds them, the core's timeout comes when it
    /// lets them go.
    pub(super) fn start_forgotten_lookups(&mut self, now: Instant) {
        self.next_forgotten = None;
        while !self.forgotten_queue.is_empty() && self.forgotten_lookups < MAX_FORGOTTEN_LOOKUPS {
            let (start, started) = &mut self.forgotten_window;
            let second = Duration::from_secs(1);
            let opened = match *start {
                Some(at) if now.saturating_duration_since(at) < second => at,
                _ => {
                    *started = 0;
                    *start = Some(now);
                    now
                }
            };
            if *started >= FORGOTTEN_LOOKUPS_PER_SECOND {
                self.next_forgotten = Some(opened + second);
                return;
            }
            let Some((task, buffer)) = self.forgotten_queue.pop_front() else {
                return;
            };
            if self.tasks.contains_key(&task) || self.ended.get(&task).is_some() {
                // Known again while it waited: not an earlier run's.
                continue;
            }
            self.forgotten_window.1 += 1;
            self.forgotten_lookups += 1;
            self.new_op(
                OpKind::ForgottenMarker {
                    key: (task.clone(), buffer),
                },
                Command::ReadMarker { task, buffer },
            );
        }
    }

    /// The commit marker of a forgotten task's deleted buffer was read.
    pub(super) fn forgotten_marker_read(
        &mut self,
        key: (TaskId, u64),
        result: Result<Option<CommitMarker>, StoreFailure>,
    ) {
        self.forgotten_lookups = self.forgotten_lookups.saturating_sub(1);
        self.stats.forgotten_markers_read += 1;
        let (task_id, buffer_id) = key;
        let marker = match result {
            Ok(Some(marker)) => marker,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(task = %task_id, buffer = buffer_id, error = %e, "cannot read the commit marker of a deleted buffer of a forgotten task; its output is left to the storage TTL");
                return;
            }
        };
        let mine = self.spool().is_some_and(|rules| rules.node == marker.node);
        if marker.task_id != task_id.as_str()
            || marker.buffer_id != buffer_id
            || !mine
            || self.tasks.contains_key(&task_id)
            || self.ended.get(&task_id).is_some()
        {
            // Another node's output (its consumers delete it through it, or
            // its failover), or the task came back meanwhile.
            return;
        }
        tracing::info!(task = %task_id, buffer = buffer_id, "a DELETE released output an earlier run of this node committed");
        self.stats.forgotten_releases += 1;
        self.new_op(OpKind::Release, Command::ReleaseCommitted(Arc::new(marker)));
    }

    pub(super) fn remember_early_delete(&mut self, task_id: &TaskId, buffer_id: u64, now: Instant) {
        self.remember_early(task_id, now, |early| early.insert(buffer_id));
    }

    /// Changes, or makes, `task_id`'s record of buffers deleted before it
    /// opened.
    fn remember_early(
        &mut self,
        task_id: &TaskId,
        now: Instant,
        change: impl FnOnce(&mut EarlyDeleted),
    ) {
        match self.early.get_mut(task_id) {
            Some(early) => change(early),
            None => {
                let mut early = EarlyDeleted::default();
                change(&mut early);
                self.early.insert(task_id.clone(), early, now);
            }
        }
    }

    pub(super) fn delete(&mut self, request: &Request, key: &BufferKey, now: Instant) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            if self.ended.get(task_id).is_none() {
                let asked = self
                    .early
                    .get(task_id)
                    .is_some_and(|early| early.deleted_by_delete(buffer_id));
                self.remember_early_delete(task_id, buffer_id, now);
                if !asked {
                    self.release_forgotten(task_id, vec![buffer_id], now);
                }
            }
            // Nothing is held, and DELETE is repeatable.
            return Reply::new(request.reply(Status::Ok));
        };
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return refused(request, e);
        }
        task.last_activity = now;
        self.drop_buffer(task_id, buffer_id, BufferGone::Deleted, now);
        Reply::new(request.reply(Status::Ok))
    }

    /// DELETE_TASK: what DELETEs of buffers `0..buffers` do, or, refused,
    /// nothing (every buffer is checked first). Its cost is linear in
    /// `buffers`: a live task's are dropped together, an unknown task's
    /// remembered as one range.
    pub(super) fn delete_task(
        &mut self,
        request: &Request,
        task_id: &TaskId,
        buffers: u64,
        now: Instant,
    ) -> Reply {
        let max_buffers = self.config.max_buffers_per_task;
        let too_wide = |why: String| {
            refused(
                request,
                Refusal::DeleteTaskTooWide {
                    task: task_id.clone(),
                    buffers,
                    why,
                },
            )
        };
        if buffers > max_buffers {
            return too_wide(format!(
                "a task has at most {max_buffers} (max_buffers_per_task)"
            ));
        }
        if let Some(task) = self.tasks.get_mut(task_id) {
            match task.fixed_count {
                Some(count) if buffers > count => {
                    return too_wide(format!("the task has {count}"));
                }
                Some(_) => {}
                None => {
                    // A DELETE makes the buffer it names if the task does
                    // not have it yet: all of them must fit the limit.
                    let after = buffers + task.buffers.range(buffers..).count() as u64;
                    if after > max_buffers {
                        return too_wide(format!(
                            "the task would then have {after} buffers, more than {max_buffers} (max_buffers_per_task)"
                        ));
                    }
                }
            }
            task.last_activity = now;
            self.drop_buffers(task_id, 0..buffers, BufferGone::Deleted, now);
        } else if self.ended.get(task_id).is_none() {
            // As DELETEs of each: remembered until the task opens (as one
            // range, whatever its length), and with a spool each buffer's
            // marker read once, in case an earlier run committed it.
            let unasked: Vec<u64> = match (self.spool(), self.early.get(task_id)) {
                (None, _) => Vec::new(),
                (Some(_), Some(early)) => (0..buffers)
                    .filter(|&b| !early.deleted_by_delete(b))
                    .collect(),
                (Some(_), None) => (0..buffers).collect(),
            };
            self.remember_early(task_id, now, |early| early.insert_below(buffers));
            self.release_forgotten(task_id, unasked, now);
        }
        Reply::new(request.reply(Status::Ok))
    }

    /// Deletes or abandons a buffer: frees its pages, deletes its marker,
    /// and ends the task once nothing is left.
    pub(super) fn drop_buffer(
        &mut self,
        task_id: &TaskId,
        buffer_id: u64,
        how: BufferGone,
        now: Instant,
    ) {
        self.drop_buffers(task_id, [buffer_id], how, now);
    }

    /// [`Core::drop_buffer`] of several buffers of one task at once: whether
    /// the task is over is looked at once, after the last (a walk over its
    /// buffers: at each of thousands, that would be quadratic).
    pub(super) fn drop_buffers(
        &mut self,
        task_id: &TaskId,
        buffer_ids: impl IntoIterator<Item = u64>,
        how: BufferGone,
        now: Instant,
    ) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        let before = task.memory();
        let mut deletes = Vec::new();
        let markers = task.delete(
            buffer_ids,
            how,
            now,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let after = task.memory();
        // Every buffer gone ends the task, unless its producer still holds
        // a connection: then it stays (its pages dropped as they come) until
        // the producer finishes or goes.
        let done = task.is_done() && (how == BufferGone::Deleted || task.producers.is_empty());
        self.account(before, after);
        self.delete_objects(deletes);
        for buffer_id in markers {
            self.release_marker(task_id, buffer_id);
        }
        self.dirty.push((task_id.clone(), None));
        if done {
            let how = self.tasks.get(task_id).map_or(Gone::Finished, finished);
            self.end_task(task_id, how, now);
        }
    }
}
