//! ENQUEUE: a connection's queue of appends, room in memory (or a wait, then BUSY), numbered appends, and durable writes under `always`.

use super::*;

impl Core {
    /// Applies the head of a connection's queue and what follows, until one
    /// has to wait.
    pub(super) fn pump(&mut self, conn: ConnId, now: Instant) {
        loop {
            let Some(&head) = self.conns.get(&conn).and_then(|c| c.queue.front()) else {
                return;
            };
            match self.step_mutation(head, now) {
                Step::Done(reply) => {
                    let kind = self
                        .parked
                        .get(&head)
                        .map_or(MessageType::Enqueue, |p| p.request.kind());
                    self.unpark(head);
                    self.emit(head, kind, Outcome::Reply(reply));
                }
                Step::Blocked => {
                    if let Some(p) = self.parked.get_mut(&head)
                        && !std::mem::replace(&mut p.waited, true)
                    {
                        self.stats.backpressure_waits += 1;
                    }
                    self.blocked.insert(head);
                    return;
                }
                Step::Async => return,
            }
        }
    }

    /// One try at a queued ENQUEUE or NO_MORE_PAGES (the head of its queue).
    pub(super) fn step_mutation(&mut self, ticket: Ticket, now: Instant) -> Step {
        let Some(parked) = self.parked.get(&ticket) else {
            return Step::Async;
        };
        if !matches!(parked.state, ParkState::Queued { .. }) {
            return Step::Async;
        }
        let request = parked.request.clone();
        match &request.op {
            Op::Enqueue {
                key,
                page_sizes,
                max_wait,
                ..
            } => self.enqueue(ticket, &request, key, page_sizes, *max_wait, now),
            Op::NoMorePages { task, buffer, .. } => {
                self.no_more_pages(ticket, &request, task, *buffer, now)
            }
            _ => {
                debug_assert!(false, "only ENQUEUE and NO_MORE_PAGES are queued");
                Step::Done(refused(
                    &request,
                    Refusal::Misrouted("a request other than ENQUEUE and NO_MORE_PAGES"),
                ))
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue(
        &mut self,
        ticket: Ticket,
        request: &Request,
        key: &BufferKey,
        page_sizes: &[u64],
        max_wait: Duration,
        now: Instant,
    ) -> Step {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let bad = |r: Refusal| Step::Done(refused(request, r));
        let tid = || task_id.clone();
        if page_sizes.len() > self.config.max_pages_per_enqueue {
            return bad(Refusal::TooManyPages {
                task: tid(),
                buffer: buffer_id,
                count: page_sizes.len(),
                limit: self.config.max_pages_per_enqueue,
            });
        }
        let body = match self.parked.get(&ticket).map(|p| &p.state) {
            Some(ParkState::Queued { body }) => body.clone(),
            _ => return Step::Async,
        };
        let pages = match binx_proto::split_pages(&body.bytes, page_sizes) {
            Ok(pages) => pages,
            Err(e) => {
                return bad(Refusal::BadPages {
                    task: tid(),
                    buffer: buffer_id,
                    why: e.to_string(),
                });
            }
        };
        if !self.tasks.contains_key(task_id) {
            return match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => bad(Refusal::Aborted {
                    task: tid(),
                    reason: reason.clone(),
                }),
                Some(Gone::Finished | Gone::FinishedOpenBroadcast) => {
                    // As for a deleted buffer: the consumers are gone (they
                    // deleted every buffer).
                    self.stats.pages_dropped += pages.len() as u64;
                    Step::Done(Reply::new(appended(request, pages.len())))
                }
                Some(Gone::Abandoned) => bad(Refusal::ProducerOfDroppedTask {
                    what: Mutation::Enqueue,
                    task: tid(),
                    after: self.config.abandon_after,
                }),
                None => bad(Refusal::EnqueueUnknownTask {
                    task: tid(),
                    after: self.config.abandon_after,
                }),
            };
        }
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Step::Async;
        };
        task.last_activity = now;
        if task.kind == BufferKind::Partitioned
            && let Err(e) = check_buffer_id(task, buffer_id, max_buffers)
        {
            return bad(e);
        }
        if task.drops_pages(buffer_id) {
            self.stats.pages_dropped += pages.len() as u64;
            return Step::Done(Reply::new(appended(request, pages.len())));
        }
        // Before "finished": a copy of an ENQUEUE that was applied learns
        // so even after the buffer ended.
        let next = task.next_append_token(buffer_id);
        let why_not = task.refuses_pages(buffer_id);
        if let Some(refusal) = self.misnumbered(request, task_id, Some(buffer_id), next) {
            return Step::Done(refusal);
        }
        if let Some(why) = why_not {
            // A numbered ENQUEUE of no page at the end of a finished buffer
            // adds nothing where it says: a copy of one that was applied.
            if pages.is_empty() && request.token_named() {
                return Step::Done(Reply::new(appended(request, 0)));
            }
            return bad(why);
        }
        let budget = max_wait.min(self.config.max_wait);
        let deadline = match self.parked.get(&ticket).and_then(|p| p.deadline) {
            Some(at) => at,
            None => {
                let at = now + budget;
                self.set_deadline(ticket, at);
                at
            }
        };
        let may_wait = now < deadline;
        let size = body.bytes.len() as u64;
        let count = pages.len() as u64;
        let task = &self.tasks[task_id];
        let policy = task.policy;
        let growth = slot_growth(task, buffer_id, count);
        let limit = self.config.task_memory_limit.min(self.config.memory_limit);
        // What the pages cost at least, whatever the buffer holds: their
        // bytes, copied out, and their slots in its index, which holds at
        // least 4 once it holds any (a VecDeque's least capacity). Growing
        // a full index can cost more, until consumers acknowledge pages:
        // that waits for room, as any other.
        let slots = if count == 0 {
            0
        } else {
            count.max(4).saturating_mul(SLOT_BYTES)
        };
        if policy != SpoolPolicy::Always && size.saturating_add(slots) > limit {
            return bad(Refusal::NeverFits {
                task: tid(),
                buffer: buffer_id,
                size,
                pages: count,
                slots,
                limit,
            });
        }
        let task_room = self.config.task_memory_limit.saturating_sub(task.memory());
        // The allocation the pages will pin: a small body in a large receive
        // buffer is copied out, so the buffer can be reused; so is one whose
        // buffer (up to twice its size) finds no room that its bytes would
        // find: the pages are stored instead of waiting for room they do not
        // need (which may never come, under a small limit).
        let room_now = task_room.min(self.budget.room());
        let (chunk_capacity, copy) = match body.chunk {
            Some((_, capacity))
                if size * 2 >= capacity
                    && (capacity.saturating_add(growth) <= room_now
                        || size.saturating_add(growth) > room_now) =>
            {
                (capacity, false)
            }
            _ => (size, true),
        };
        let charge = if size == 0 { 0 } else { chunk_capacity } + growth;
        // What it waits for: once its bytes fit, they are copied out.
        let wanted = charge.min(size + growth);
        let pages_full = task.log_len(buffer_id) + count > self.config.max_pages_per_log;
        if policy == SpoolPolicy::Always {
            if task.durable_in_flight || pages_full {
                return self.wait_or_busy(ticket, request, may_wait, || {
                    Refusal::DurableWriteBusy {
                        task: tid(),
                        buffer: buffer_id,
                    }
                });
            }
            return self.start_durable(ticket, request, key, pages);
        }
        // The daemon's room is taken at once (other shards share it), and
        // given back once the pages are counted as this shard's.
        let fits = charge <= task_room && !pages_full && self.budget.try_reserve(charge);
        if !fits {
            let global_room = self.budget.room();
            // What it missed on an earlier try no longer holds.
            self.room_wanted.remove(&ticket);
            self.room_wanted_unspillable.remove(&ticket);
            if policy.spills() && may_wait && !pages_full {
                let own = task_room < global_room;
                let need = wanted.saturating_sub(task_room.min(global_room));
                self.room_wanted
                    .insert(ticket, (own.then(|| task_id.clone()), need));
            } else if may_wait && !pages_full && global_room < task_room {
                // Nothing of this task can spill, but pages in storage too
                // may leave memory for it.
                self.room_wanted_unspillable
                    .insert(ticket, wanted.saturating_sub(global_room));
            }
            let (used, task_mem) = (self.budget.used(), task.memory());
            let (limit, task_limit) = (self.config.memory_limit, self.config.task_memory_limit);
            let max_pages = self.config.max_pages_per_log;
            return self.wait_or_busy(ticket, request, may_wait, || {
                if pages_full {
                    Refusal::BufferFull {
                        task: tid(),
                        buffer: buffer_id,
                        count,
                        limit: max_pages,
                    }
                } else {
                    Refusal::NoRoom {
                        task: tid(),
                        buffer: buffer_id,
                        size,
                        used,
                        limit,
                        task_used: task_mem,
                        task_limit,
                    }
                }
            });
        }
        self.forget_room_wanted(ticket);
        let chunk = self.chunk_for(&body, copy);
        let bodies: Vec<Bytes> = if copy && size > 0 {
            let own = Bytes::copy_from_slice(&body.bytes);
            binx_proto::split_pages(&own, page_sizes).unwrap_or_default()
        } else {
            pages
        };
        let pages: Vec<Page> = bodies
            .into_iter()
            .map(|b| {
                self.next_seq += 1;
                Page {
                    size: b.len() as u64,
                    chunk: if b.is_empty() { 0 } else { chunk },
                    body: Some(b),
                    object: None,
                    seq: self.next_seq,
                    at: now,
                    spilling: false,
                }
            })
            .collect();
        self.append(task_id, buffer_id, pages, chunk_capacity, now);
        self.budget.release(charge);
        self.stats.pages_enqueued += count;
        self.stats.bytes_enqueued += size;
        Step::Done(Reply::new(appended(request, count as usize)))
    }

    /// The refusal of an ENQUEUE or NO_MORE_PAGES whose `append_token` is
    /// not `next`, the token the buffer's next page would get (numbered
    /// appends): it was sent behind one that was not applied, or it repeats
    /// one that was. Nothing changes; the reply's `page_next_token` says
    /// where the buffer is, so the producer knows which.
    pub(super) fn misnumbered(
        &mut self,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        next: u64,
    ) -> Option<Reply> {
        let (Op::Enqueue { append_token, .. } | Op::NoMorePages { append_token, .. }) = &request.op
        else {
            return None;
        };
        let wanted = (*append_token)?;
        if wanted == next {
            return None;
        }
        self.stats.append_token_refusals += 1;
        let what = match &request.op {
            Op::Enqueue { .. } => Mutation::Enqueue,
            _ => Mutation::NoMorePages,
        };
        let mut header = request.refuse(&Refusal::Misnumbered {
            what,
            task: task_id.clone(),
            buffer,
            wanted,
            next,
        });
        header.page_next_token = next;
        Some(Reply::new(header))
    }

    /// The id of the allocation a body's pages pin.
    pub(super) fn chunk_for(&mut self, body: &Payload, copy: bool) -> u64 {
        match body.chunk {
            Some((id, _)) if !copy && id != 0 && id < OWN_CHUNKS => id,
            _ => {
                self.next_chunk += 1;
                OWN_CHUNKS | self.next_chunk
            }
        }
    }

    pub(super) fn append(
        &mut self,
        task_id: &TaskId,
        buffer_id: u64,
        pages: Vec<Page>,
        capacity: u64,
        now: Instant,
    ) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        let before = task.memory();
        task.append(buffer_id, pages, capacity, &mut self.objects, now);
        let after = task.memory();
        let which = (task.kind == BufferKind::Partitioned).then_some(buffer_id);
        self.account(before, after);
        self.dirty.push((task_id.clone(), which));
    }

    /// The ENQUEUE `ticket` waits for room no more.
    pub(super) fn forget_room_wanted(&mut self, ticket: Ticket) {
        self.room_wanted.remove(&ticket);
        self.room_wanted_unspillable.remove(&ticket);
    }

    /// Waits (the head stays blocked) or, with its wait used up, answers
    /// BUSY; everything queued behind it on the connection is BUSY too, so
    /// what takes effect stays in the order sent.
    pub(super) fn wait_or_busy(
        &mut self,
        ticket: Ticket,
        request: &Request,
        may_wait: bool,
        why: impl FnOnce() -> Refusal,
    ) -> Step {
        if may_wait {
            return Step::Blocked;
        }
        self.forget_room_wanted(ticket);
        self.stats.busy_replies += 1;
        let reply = refused(request, why());
        if let Some(conn) = self.parked.get(&ticket).map(|p| p.conn) {
            self.busy_behind(conn, Some(ticket), request);
        }
        Step::Done(reply)
    }

    /// Answers BUSY every ENQUEUE and NO_MORE_PAGES queued on `conn` behind
    /// one that got BUSY (`head`, when still queued, is skipped): what takes
    /// effect stays a prefix of what was sent.
    pub(super) fn busy_behind(&mut self, conn: ConnId, head: Option<Ticket>, cause: &Request) {
        let behind: Vec<Ticket> = self
            .conns
            .get(&conn)
            .map(|c| {
                c.queue
                    .iter()
                    .copied()
                    .filter(|t| Some(*t) != head)
                    .collect()
            })
            .unwrap_or_default();
        for t in behind {
            self.refuse_queued(t, cause);
        }
    }

    /// Answers BUSY to a queued ENQUEUE or NO_MORE_PAGES that must not be
    /// applied because `cause`, sent before it on its connection, was not.
    pub(super) fn refuse_queued(&mut self, ticket: Ticket, cause: &Request) {
        if !matches!(
            self.parked.get(&ticket).map(|p| &p.state),
            Some(ParkState::Queued { .. })
        ) {
            return;
        }
        if let Some(p) = self.unpark(ticket) {
            self.stats.busy_replies += 1;
            let kind = p.request.kind();
            let reply = refused(
                &p.request,
                Refusal::BehindUnapplied {
                    cause: cause.kind(),
                    cause_id: cause.id,
                },
            );
            self.emit(ticket, kind, Outcome::Reply(reply));
        }
    }

    /// Policy `always`: writes the pages to storage (objects of at most the
    /// segment size) before they are appended and the producer hears OK.
    pub(super) fn start_durable(
        &mut self,
        ticket: Ticket,
        request: &Request,
        key: &BufferKey,
        pages: Vec<Bytes>,
    ) -> Step {
        let Some(task) = self.tasks.get_mut(&key.task) else {
            return Step::Async;
        };
        if pages.is_empty() {
            return Step::Done(Reply::new(appended(request, 0)));
        }
        let first_token = task.next_append_token(key.buffer);
        task.durable_in_flight = true;
        let max = self.spool().map_or(16 << 20, |s| s.spill_max_bytes);
        let mut cuts: Vec<(u64, Vec<Bytes>)> = Vec::new();
        let mut start = 0usize;
        while start < pages.len() {
            let mut end = start + 1;
            let mut bytes = pages[start].len() as u64;
            while end < pages.len() && bytes + pages[end].len() as u64 <= max {
                bytes += pages[end].len() as u64;
                end += 1;
            }
            cuts.push((first_token + start as u64, pages[start..end].to_vec()));
            start = end;
        }
        let body_len = self.parked.get(&ticket).map_or(0, Parked::waiting_bytes);
        if let Some(p) = self.parked.get_mut(&ticket) {
            // The body stays pending until the pages are appended.
            p.state = ParkState::Writing {
                key: key.clone(),
                first_token,
                pages,
                parts: vec![None; cuts.len()],
                remaining: cuts.len(),
                failed: None,
                body_len,
            };
            if let Some(at) = p.deadline.take() {
                self.deadlines.remove(&(at, ticket));
            }
        }
        for (part, (token, pages)) in cuts.into_iter().enumerate() {
            self.new_op(
                OpKind::Durable { ticket, part },
                Command::WriteSegment {
                    task: key.task.clone(),
                    first_token: token,
                    pages,
                    durability: Durability::Durable,
                    committing: false,
                },
            );
        }
        Step::Async
    }

    /// A segment write finished (spill or durable ENQUEUE).
    pub fn segment_written(
        &mut self,
        op: OpId,
        result: Result<ObjectMeta, StoreFailure>,
        now: Instant,
    ) {
        match self.ops.remove(&op) {
            Some(OpKind::Spill(spill)) => self.spill_written(spill, result, now),
            Some(OpKind::Durable { ticket, part }) => {
                self.durable_written(ticket, part, result, now)
            }
            _ => {
                // Unknown op: an object nobody will refer to.
                if let Ok(meta) = result {
                    self.delete_objects(vec![Arc::new(meta)]);
                }
            }
        }
        self.after(now);
    }

    pub(super) fn durable_written(
        &mut self,
        ticket: Ticket,
        part: usize,
        result: Result<ObjectMeta, StoreFailure>,
        now: Instant,
    ) {
        let Some(Parked {
            state:
                ParkState::Writing {
                    parts,
                    remaining,
                    failed,
                    ..
                },
            ..
        }) = self.parked.get_mut(&ticket)
        else {
            if let Ok(meta) = result {
                self.delete_objects(vec![Arc::new(meta)]);
            }
            return;
        };
        match result {
            Ok(meta) => {
                if let Some(slot) = parts.get_mut(part) {
                    *slot = Some(meta);
                }
            }
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
        *remaining -= 1;
        if *remaining > 0 {
            return;
        }
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let ParkState::Writing {
            key,
            first_token,
            pages,
            parts,
            failed,
            ..
        } = parked.state
        else {
            debug_assert!(false, "only a durable write has Durable ops");
            return;
        };
        let request = parked.request;
        let key = &key;
        if let Some(task) = self.tasks.get_mut(&key.task) {
            task.durable_in_flight = false;
        }
        self.room_freed = true;
        let written: Vec<ObjectMeta> = parts.into_iter().flatten().collect();
        let reply = match failed {
            Some(e) => {
                self.delete_objects(written.into_iter().map(Arc::new).collect());
                self.busy_behind(parked.conn, None, &request);
                if e.transient {
                    self.stats.busy_replies += 1;
                }
                refused(
                    &request,
                    Refusal::DurableWriteFailed {
                        task: key.task.clone(),
                        buffer: key.buffer,
                        failure: e,
                    },
                )
            }
            None => self.append_durable(&request, key, first_token, pages, written, now),
        };
        self.emit(ticket, MessageType::Enqueue, Outcome::Reply(reply));
        // The next mutation of that connection may go now.
        self.pump(parked.conn, now);
    }

    /// Appends pages written to `objects` (in order, together every page).
    /// Pages stay in memory too when they fit, so consumers are served
    /// without a read.
    pub(super) fn append_durable(
        &mut self,
        request: &Request,
        key: &BufferKey,
        first_token: u64,
        bodies: Vec<Bytes>,
        objects: Vec<ObjectMeta>,
        now: Instant,
    ) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let tid = || task_id.clone();
        let refusal = match self.tasks.get(task_id) {
            None => match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => Some(Refusal::Aborted {
                    task: tid(),
                    reason: reason.clone(),
                }),
                Some(Gone::Abandoned) => Some(Refusal::ProducerOfDroppedTask {
                    what: Mutation::Enqueue,
                    task: tid(),
                    after: self.config.abandon_after,
                }),
                Some(_) => {
                    // Its consumers went while the pages were written.
                    self.stats.pages_dropped += bodies.len() as u64;
                    self.delete_objects(objects.into_iter().map(Arc::new).collect());
                    return Reply::new(appended(request, bodies.len()));
                }
                None => Some(Refusal::TaskNoLongerOpen { task: tid() }),
            },
            Some(t) if t.drops_pages(buffer_id) => None,
            Some(t) => t.refuses_pages(buffer_id).or_else(|| {
                let next = t.next_append_token(buffer_id);
                (next != first_token).then(|| Refusal::DurableWriteMoved {
                    task: tid(),
                    buffer: buffer_id,
                    written: first_token,
                    next,
                })
            }),
        };
        if let Some(refusal) = refusal {
            self.delete_objects(objects.into_iter().map(Arc::new).collect());
            return refused(request, refusal);
        }
        let size: u64 = bodies.iter().map(|b| b.len() as u64).sum();
        let count = bodies.len() as u64;
        let Some(task) = self.tasks.get(task_id) else {
            return Reply::new(appended(request, bodies.len()));
        };
        if task.drops_pages(buffer_id) {
            self.stats.pages_dropped += count;
            self.delete_objects(objects.into_iter().map(Arc::new).collect());
            return Reply::new(appended(request, bodies.len()));
        }
        let charge = size + slot_growth(task, buffer_id, count);
        // Kept below three quarters of the limits only: past them, pages in
        // storage too leave memory for room (`evict_for_room`).
        let keep = task.memory() + charge <= self.config.task_memory_limit / 4 * 3
            && self.budget.unspilled() + charge <= self.config.memory_limit / 4 * 3
            && self.budget.try_reserve(charge);
        let chunk = if keep && size > 0 {
            self.next_chunk += 1;
            OWN_CHUNKS | self.next_chunk
        } else {
            0
        };
        // Kept bodies are copied into one allocation of their own (the
        // written ones may sit in a receive buffer shared with others).
        let kept: Option<Vec<Bytes>> = keep.then(|| {
            let own = Bytes::from(bodies.concat());
            let sizes: Vec<u64> = bodies.iter().map(|b| b.len() as u64).collect();
            binx_proto::split_pages(&own, &sizes).unwrap_or_default()
        });
        let mut pages = Vec::with_capacity(bodies.len());
        let mut kept = kept.map(Vec::into_iter);
        for meta in objects {
            let id = self.objects.insert(meta, task_id.clone());
            let sizes = self
                .objects
                .meta(id)
                .map(|m| m.page_sizes.clone())
                .unwrap_or_default();
            for (index, page_size) in sizes.into_iter().enumerate() {
                let body = kept.as_mut().and_then(Iterator::next);
                let Ok(index) = u32::try_from(index) else {
                    break;
                };
                self.next_seq += 1;
                pages.push(Page {
                    size: page_size,
                    chunk: if body.as_ref().is_some_and(|b| !b.is_empty()) {
                        chunk
                    } else {
                        0
                    },
                    body,
                    object: Some((id, index)),
                    seq: self.next_seq,
                    at: now,
                    spilling: false,
                });
            }
        }
        self.append(task_id, buffer_id, pages, size, now);
        if keep {
            self.budget.release(charge);
            if let Some(task) = self.tasks.get_mut(task_id) {
                task.stored_in_memory = true;
            }
        }
        self.stats.pages_enqueued += count;
        self.stats.bytes_enqueued += size;
        Reply::new(appended(request, count as usize))
    }
}
