//! NO_MORE_PAGES: a buffer's or a task's end, commit markers and manifests under `always` and `commit`.

use super::*;

impl Core {
    pub(super) fn no_more_pages(
        &mut self,
        ticket: Ticket,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        now: Instant,
    ) -> Step {
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Step::Done(match self.ended.get(task_id) {
                Some(_) => self.ended_task_finished(request, task_id),
                None => refused(
                    request,
                    Refusal::NoMorePagesUnknownTask {
                        task: task_id.clone(),
                        after: self.config.abandon_after,
                    },
                ),
            });
        };
        if let Some(id) = buffer
            && let Err(e) = check_buffer_id(task, id, max_buffers)
        {
            return Step::Done(refused(request, e));
        }
        if task.durable_in_flight {
            // A durable write of this task (from another connection) lands
            // first; NO_MORE_PAGES waits for it.
            return Step::Blocked;
        }
        if request.token_named() {
            if task.kind == BufferKind::Partitioned && buffer.is_none() {
                return Step::Done(refused(
                    request,
                    Refusal::NumberedEndOfPartitioned {
                        task: task_id.clone(),
                    },
                ));
            }
            let id = buffer.unwrap_or(0);
            // A BROADCAST buffer finished already ends where it ended, not
            // at the shared log's next token (a repeated one is OK).
            let next = match (task.kind, buffer.and_then(|b| task.buffers.get(&b))) {
                (BufferKind::Broadcast, Some(b)) => {
                    b.end.unwrap_or_else(|| task.next_append_token(id))
                }
                _ => task.next_append_token(id),
            };
            if !task.drops_pages(id)
                && let Some(refusal) = self.misnumbered(request, task_id, buffer, next)
            {
                return Step::Done(refusal);
            }
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Step::Async;
        };
        task.finish(buffer, now);
        task.last_activity = now;
        let policy = task.policy;
        let done = task.is_done();
        self.dirty.push((task_id.clone(), buffer));
        if buffer.is_none() {
            self.dirty.push((task_id.clone(), None));
        }
        if done {
            let how = self.tasks.get(task_id).map_or(Gone::Finished, finished);
            self.end_task(task_id, how, now);
            return Step::Done(Reply::new(request.reply(Status::Ok)));
        }
        if !policy.commits() {
            if buffer.is_none() {
                self.release_producers(task_id, now);
            }
            return Step::Done(Reply::new(request.reply(Status::Ok)));
        }
        if policy == SpoolPolicy::Commit && !self.spooled_for_commit(task_id, buffer) {
            // The finished pages still in memory go to storage first
            // (`pick_spill`); `drive_commit_waits` goes on from there.
            if let Some(p) = self.parked.get_mut(&ticket) {
                p.state = ParkState::Spooling(Ending {
                    task: task_id.clone(),
                    buffer,
                });
                if let Some(at) = p.deadline.take() {
                    self.deadlines.remove(&(at, ticket));
                }
            }
            self.spooling.insert(ticket);
            return Step::Async;
        }
        self.start_commit(ticket, request, task_id, buffer, now)
    }

    /// The answer to a NO_MORE_PAGES of a task that ended, before it came
    /// or while it was committed: an aborted or dropped task's refusal (its
    /// output is deleted, so an engine must not count the attempt as
    /// committed); OK for one that finished (read to its end meanwhile), or
    /// whose end is forgotten.
    pub(super) fn ended_task_finished(&self, request: &Request, task_id: &TaskId) -> Reply {
        match self.ended.get(task_id) {
            Some(Gone::Aborted(reason)) => refused(
                request,
                Refusal::Aborted {
                    task: task_id.clone(),
                    reason: reason.clone(),
                },
            ),
            Some(Gone::Abandoned) => refused(
                request,
                Refusal::ProducerOfDroppedTask {
                    what: Mutation::NoMorePages,
                    task: task_id.clone(),
                    after: self.config.abandon_after,
                },
            ),
            Some(Gone::Finished | Gone::FinishedOpenBroadcast) | None => {
                Reply::new(request.reply(Status::Ok))
            }
        }
    }

    /// Whether every page a NO_MORE_PAGES of a `commit` task finished is in
    /// storage (so its markers can name them all).
    pub(super) fn spooled_for_commit(&self, task_id: &TaskId, buffer: Option<u64>) -> bool {
        let Some(task) = self.tasks.get(task_id) else {
            return true;
        };
        match (task.kind, buffer) {
            (BufferKind::Partitioned, Some(b)) => task.log_fully_spooled(LogId::Buffer(b)),
            (BufferKind::Partitioned, None) => task
                .buffers
                .keys()
                .all(|&b| task.log_fully_spooled(LogId::Buffer(b))),
            // One buffer: the shared pages below its end (more may come
            // for the others meanwhile).
            (BufferKind::Broadcast, Some(b)) => match task.buffers.get(&b).and_then(|b| b.end) {
                Some(end) => task.shared.spooled_below(end),
                None => task.log_fully_spooled(LogId::Shared),
            },
            (BufferKind::Broadcast, None) => task.log_fully_spooled(LogId::Shared),
            (BufferKind::Arbitrary, _) => true,
        }
    }

    /// Writes the markers of the buffers a NO_MORE_PAGES finished, then
    /// (task-wide) the task's manifest, before it is answered.
    pub(super) fn start_commit(
        &mut self,
        ticket: Ticket,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        now: Instant,
    ) -> Step {
        let foldable = buffer.is_none() && self.foldable(task_id);
        let plans = match self.tasks.get_mut(task_id) {
            Some(task) => task.commit_plans(buffer, now),
            None => Vec::new(),
        };
        let plans = match foldable {
            true => match self.commit_folded(ticket, task_id, plans) {
                Ok(step) => return step,
                Err(plans) => plans,
            },
            false => plans,
        };
        let mut waiting = 0usize;
        for (buffer_id, end, objects) in plans {
            if self.commit(task_id, buffer_id, end, objects, Some(ticket)) {
                waiting += 1;
            }
        }
        if waiting == 0 {
            return self.after_markers(ticket, request, task_id, buffer, now);
        }
        if let Some(p) = self.parked.get_mut(&ticket) {
            p.state = ParkState::Committing {
                end: Ending {
                    task: task_id.clone(),
                    buffer,
                },
                remaining: waiting,
                failed: None,
            };
        }
        Step::Async
    }

    /// Whether a task-wide commit of `task_id` may fold its markers into
    /// the manifest: a PARTITIONED task (a BROADCAST one's buffers share
    /// objects, which its consumers release marker by marker) whose
    /// manifest is not written and none of whose buffers has a marker yet,
    /// while `fold_markers` is on and no folded write failed for good.
    fn foldable(&self, task_id: &TaskId) -> bool {
        let Some(task) = self.tasks.get(task_id) else {
            return false;
        };
        self.config.spool.as_ref().is_some_and(|s| s.fold_markers)
            && task.kind == BufferKind::Partitioned
            && !task.fold_refused
            && !task.manifest
            && task.buffers.values().all(|b| !b.marker)
            && self
                .markers
                .entries
                .range((task_id.clone(), 0)..=(task_id.clone(), u64::MAX))
                .next()
                .is_none()
    }

    /// Writes a task-wide commit's markers in its manifest (format 2): one
    /// object instead of one a buffer and the manifest. Gives the plans
    /// back when they would not fit in a manifest a reader takes.
    fn commit_folded(
        &mut self,
        ticket: Ticket,
        task_id: &TaskId,
        plans: Vec<(u64, u64, Vec<ObjectId>)>,
    ) -> Result<Step, Vec<(u64, u64, Vec<ObjectId>)>> {
        let Some(buffers) = self.tasks.get(task_id).and_then(|t| t.manifest_buffers()) else {
            return Err(plans);
        };
        let segments: usize = plans.iter().map(|(_, _, objects)| objects.len()).sum();
        let pages: usize = plans
            .iter()
            .flat_map(|(_, _, objects)| objects)
            .filter_map(|&id| self.objects.meta(id))
            .map(|meta| meta.page_sizes.len())
            .sum();
        if !folded_manifest_fits(buffers.len(), segments, pages) {
            return Err(plans);
        }
        let mut markers = Vec::with_capacity(plans.len());
        let mut folded = Vec::with_capacity(plans.len());
        let mut entries = Vec::with_capacity(plans.len());
        for (buffer_id, end_token, objects) in plans {
            let mut metas = Vec::with_capacity(objects.len());
            for &id in &objects {
                self.objects.add_marker(id);
                if let Some(meta) = self.objects.meta(id) {
                    metas.push(meta.clone());
                }
            }
            markers.push(MarkerPlan {
                task: task_id.clone(),
                buffer: buffer_id,
                end_token,
                objects: metas,
                shared: false,
            });
            folded.push(buffer_id);
            entries.push((buffer_id, objects));
        }
        let op = self.new_op(
            OpKind::Manifest {
                ticket: Some(ticket),
                task: task_id.clone(),
                folded,
            },
            Command::WriteManifest(ManifestPlan {
                task: task_id.clone(),
                buffers,
                markers,
            }),
        );
        for (buffer_id, objects) in entries {
            self.markers.entries.insert(
                (task_id.clone(), buffer_id),
                MarkerEntry {
                    objects,
                    state: MarkerState::Writing(op),
                    delete_after_write: false,
                    waiters: Vec::new(),
                    folded: true,
                },
            );
        }
        if let Some(p) = self.parked.get_mut(&ticket) {
            p.state = ParkState::WritingManifest(task_id.clone());
            if let Some(at) = p.deadline.take() {
                self.deadlines.remove(&(at, ticket));
            }
        }
        Ok(Step::Async)
    }

    /// Every marker a NO_MORE_PAGES waited for is written: a task-wide one
    /// writes the task's manifest (once) before its OK.
    pub(super) fn after_markers(
        &mut self,
        ticket: Ticket,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        now: Instant,
    ) -> Step {
        let plan = match self.tasks.get(task_id) {
            Some(task)
                if buffer.is_none() && !task.manifest && task.kind != BufferKind::Arbitrary =>
            {
                task.manifest_buffers().map(|buffers| ManifestPlan {
                    task: task_id.clone(),
                    buffers,
                    markers: Vec::new(),
                })
            }
            _ => None,
        };
        let Some(plan) = plan else {
            if !self.tasks.contains_key(task_id) {
                // It ended while its markers were written (review: an
                // aborted one was answered OK).
                return Step::Done(self.ended_task_finished(request, task_id));
            }
            if buffer.is_none() {
                self.release_producers(task_id, now);
            }
            return Step::Done(Reply::new(request.reply(Status::Ok)));
        };
        if let Some(p) = self.parked.get_mut(&ticket) {
            p.state = ParkState::WritingManifest(task_id.clone());
            if let Some(at) = p.deadline.take() {
                self.deadlines.remove(&(at, ticket));
            }
        }
        self.new_op(
            OpKind::Manifest {
                ticket: Some(ticket),
                task: task_id.clone(),
                folded: Vec::new(),
            },
            Command::WriteManifest(plan),
        );
        Step::Async
    }

    /// NO_MORE_PAGES of `commit` tasks waiting for spills: those whose
    /// pages are all in storage now commit; while spilling is paused after
    /// a failure, they are answered BUSY (the buffer stays finished, and
    /// NO_MORE_PAGES again commits it).
    pub(super) fn drive_commit_waits(&mut self, now: Instant) {
        let paused = self.spill_retry_at.is_some_and(|at| now < at);
        for ticket in self.spooling.clone() {
            let Some(parked) = self.parked.get(&ticket) else {
                self.spooling.remove(&ticket);
                continue;
            };
            let request = parked.request.clone();
            let ParkState::Spooling(Ending {
                task: task_id,
                buffer,
            }) = &parked.state
            else {
                debug_assert!(false, "only a commit waiting for spills is in `spooling`");
                self.spooling.remove(&ticket);
                continue;
            };
            let (task_id, buffer) = (task_id.clone(), *buffer);
            let step = if !self.tasks.contains_key(&task_id) {
                Step::Done(self.ended_task_finished(&request, &task_id))
            } else if self.spooled_for_commit(&task_id, buffer) {
                self.spooling.remove(&ticket);
                self.start_commit(ticket, &request, &task_id, buffer, now)
            } else if paused {
                self.stats.busy_replies += 1;
                let conn = parked.conn;
                self.busy_behind(conn, Some(ticket), &request);
                Step::Done(refused(
                    &request,
                    Refusal::CommitSpillFailed {
                        task: task_id.clone(),
                        buffer,
                        failure: self.last_spill_failure.clone().unwrap_or_else(|| {
                            StoreFailure::transient("no spill failure was recorded")
                        }),
                    },
                ))
            } else {
                continue;
            };
            if let Step::Done(reply) = step {
                let conn = self.parked.get(&ticket).map(|p| p.conn);
                self.unpark(ticket);
                self.emit(ticket, MessageType::NoMorePages, Outcome::Reply(reply));
                if let Some(conn) = conn {
                    self.pump(conn, now);
                }
            }
        }
    }

    /// Writes (or waits for) the commit marker of a finished buffer; true
    /// when `waiter` must wait for a write.
    pub(super) fn commit(
        &mut self,
        task_id: &TaskId,
        buffer_id: u64,
        end_token: u64,
        objects: Vec<ObjectId>,
        waiter: Option<Ticket>,
    ) -> bool {
        let key = (task_id.clone(), buffer_id);
        if let Some(entry) = self.markers.entries.get_mut(&key) {
            return match entry.state {
                MarkerState::Writing(_) => {
                    entry.waiters.extend(waiter);
                    waiter.is_some()
                }
                MarkerState::Written | MarkerState::Deleting(_) | MarkerState::Released => false,
            };
        }
        let mut metas = Vec::with_capacity(objects.len());
        for &id in &objects {
            self.objects.add_marker(id);
            if let Some(meta) = self.objects.meta(id) {
                metas.push(meta.clone());
            }
        }
        self.next_op += 1;
        let op = OpId(self.next_op);
        self.ops.insert(op, OpKind::Marker { key: key.clone() });
        self.events.push_back(Event::Command {
            op,
            command: Command::WriteMarker(MarkerPlan {
                task: task_id.clone(),
                buffer: buffer_id,
                end_token,
                objects: metas,
                shared: self
                    .tasks
                    .get(task_id)
                    .is_some_and(|t| t.kind == BufferKind::Broadcast),
            }),
        });
        self.markers.entries.insert(
            key,
            MarkerEntry {
                objects,
                state: MarkerState::Writing(op),
                delete_after_write: false,
                waiters: waiter.into_iter().collect(),
                folded: false,
            },
        );
        waiter.is_some()
    }

    /// A commit marker write finished.
    pub fn marker_written(&mut self, op: OpId, result: Result<(), StoreFailure>, now: Instant) {
        let Some(OpKind::Marker { key }) = self.ops.remove(&op) else {
            return;
        };
        self.marker_settled(key, &result, now);
        self.after(now);
    }

    /// A marker's write finished, in a file of its own or in its task's
    /// manifest: what waited for it goes on.
    pub(super) fn marker_settled(
        &mut self,
        key: (TaskId, u64),
        result: &Result<(), StoreFailure>,
        now: Instant,
    ) {
        let Some(entry) = self.markers.entries.get_mut(&key) else {
            return;
        };
        let waiters = std::mem::take(&mut entry.waiters);
        match result {
            Ok(()) => {
                entry.state = MarkerState::Written;
                if entry.delete_after_write {
                    self.release_marker(&key.0, key.1);
                } else if let Some(b) = self
                    .tasks
                    .get_mut(&key.0)
                    .and_then(|t| t.buffers.get_mut(&key.1))
                {
                    b.committed_at.get_or_insert(now);
                }
            }
            Err(e) => {
                tracing::warn!(task = %key.0, buffer = key.1, error = %e, "a commit marker could not be written");
                // Not written: its objects are free again, and a repeated
                // NO_MORE_PAGES writes it anew.
                if let Some(entry) = self.markers.entries.remove(&key) {
                    let mut deletes = Vec::new();
                    for id in entry.objects {
                        if let Some(meta) = self.objects.drop_marker(id) {
                            deletes.push(meta);
                        }
                    }
                    self.delete_objects(deletes);
                }
                if let Some(b) = self
                    .tasks
                    .get_mut(&key.0)
                    .and_then(|t| t.buffers.get_mut(&key.1))
                {
                    b.marker = false;
                }
            }
        }
        for ticket in waiters {
            self.commit_answered(ticket, &key, result.as_ref().err(), now);
        }
    }

    pub(super) fn commit_answered(
        &mut self,
        ticket: Ticket,
        key: &(TaskId, u64),
        error: Option<&StoreFailure>,
        now: Instant,
    ) {
        let Some(Parked {
            state:
                ParkState::Committing {
                    end,
                    remaining,
                    failed,
                },
            request,
            ..
        }) = self.parked.get_mut(&ticket)
        else {
            return;
        };
        if let Some(e) = error {
            failed.get_or_insert_with(|| Refusal::MarkerWriteFailed {
                task: key.0.clone(),
                buffer: key.1,
                failure: e.clone(),
            });
        }
        *remaining -= 1;
        if *remaining > 0 {
            return;
        }
        let failed = failed.take();
        let mut answer = None;
        if failed.is_none() {
            let (request, end) = (request.clone(), end.clone());
            match self.after_markers(ticket, &request, &end.task, end.buffer, now) {
                Step::Done(reply) => answer = Some(reply),
                _ => return,
            }
        }
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let reply = match (failed, answer) {
            (Some(why), _) => {
                self.stats.busy_replies += 1;
                self.busy_behind(parked.conn, None, &parked.request);
                refused(&parked.request, why)
            }
            (None, Some(reply)) => reply,
            (None, None) => Reply::new(parked.request.reply(Status::Ok)),
        };
        self.emit(ticket, MessageType::NoMorePages, Outcome::Reply(reply));
        self.pump(parked.conn, now);
    }

    /// The marker of a buffer that went must go; its objects are released
    /// once it is deleted.
    pub(super) fn release_marker(&mut self, task_id: &TaskId, buffer_id: u64) {
        let key = (task_id.clone(), buffer_id);
        let Some(entry) = self.markers.entries.get_mut(&key) else {
            return;
        };
        match entry.state {
            MarkerState::Writing(_) => entry.delete_after_write = true,
            MarkerState::Deleting(_) | MarkerState::Released => {}
            // Deleted with the manifest (`manifest_deleted`), which names
            // its objects until then.
            MarkerState::Written if entry.folded => entry.state = MarkerState::Released,
            MarkerState::Written => {
                self.next_op += 1;
                let op = OpId(self.next_op);
                entry.state = MarkerState::Deleting(op);
                self.ops.insert(op, OpKind::MarkerDelete { key });
                self.events.push_back(Event::Command {
                    op,
                    command: Command::DeleteMarker {
                        task: task_id.clone(),
                        buffer: buffer_id,
                    },
                });
            }
        }
    }

    /// A commit marker deletion finished. Only a deleted marker releases
    /// its objects; one that could not be deleted keeps them (the TTL
    /// pruner takes both).
    pub fn marker_deleted(&mut self, op: OpId, result: Result<(), StoreFailure>, now: Instant) {
        let Some(OpKind::MarkerDelete { key }) = self.ops.remove(&op) else {
            return;
        };
        let Some(entry) = self.markers.entries.remove(&key) else {
            return;
        };
        match result {
            Ok(()) => {
                let mut deletes = Vec::new();
                for id in entry.objects {
                    if let Some(meta) = self.objects.drop_marker(id) {
                        deletes.push(meta);
                    }
                }
                self.delete_objects(deletes);
            }
            Err(e) => {
                tracing::warn!(task = %key.0, buffer = key.1, error = %e, "a commit marker could not be deleted; it and its objects are left to the TTL pruner");
                for id in entry.objects {
                    self.objects.keep_for_ttl(id);
                    self.stats.deletes_left_to_ttl += 1;
                }
            }
        }
        self.after(now);
    }

    /// A task's manifest was deleted (or could not be): the markers folded
    /// into it that were released go, and their objects with them (or are
    /// left to the TTL pruner, as the manifest is).
    pub(super) fn folded_markers_deleted(&mut self, task_id: &TaskId, deleted: bool) {
        let released: Vec<(TaskId, u64)> = self
            .markers
            .entries
            .range((task_id.clone(), 0)..=(task_id.clone(), u64::MAX))
            .filter(|(_, e)| e.folded && e.state == MarkerState::Released)
            .map(|(key, _)| key.clone())
            .collect();
        let mut deletes = Vec::new();
        for key in released {
            let Some(entry) = self.markers.entries.remove(&key) else {
                continue;
            };
            for id in entry.objects {
                if !deleted {
                    self.objects.keep_for_ttl(id);
                    self.stats.deletes_left_to_ttl += 1;
                } else if let Some(meta) = self.objects.drop_marker(id) {
                    deletes.push(meta);
                }
            }
        }
        self.delete_objects(deletes);
    }
}

/// Whether a manifest with markers folded in stays well within what a
/// reader takes (`MAX_MANIFEST_BYTES` in binx-spool, 4 MiB): its JSON
/// holds at most about 84 bytes a buffer, 450 a segment (name, sizes,
/// wrapped key) and 21 a page size. Past 3 MiB the markers are written apart.
pub(crate) fn folded_manifest_fits(buffers: usize, segments: usize, pages: usize) -> bool {
    const BUDGET: usize = 3 << 20;
    buffers
        .saturating_mul(84)
        .saturating_add(segments.saturating_mul(450))
        .saturating_add(pages.saturating_mul(21))
        <= BUDGET
}
