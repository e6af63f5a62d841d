//! DATA: what a reply holds (memory, this daemon's objects, or a commit marker), long-polls, pipelined DATA and the acknowledgements it carries.

use super::*;

impl Core {
    pub(super) fn wait_budget(&self, q: &DataQuery) -> Duration {
        q.max_wait.min(self.config.max_wait)
    }

    pub(super) fn add_waiter(&mut self, ticket: Ticket, key: &BufferKey) {
        self.data_waiters
            .entry(key.task.clone())
            .or_default()
            .entry(key.buffer)
            .or_default()
            .insert(ticket);
    }

    /// Evaluates a waiting DATA again: answers it, or (while `may_wait`)
    /// leaves it waiting.
    pub(super) fn retry_data(&mut self, ticket: Ticket, now: Instant, may_wait: bool) {
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        let Op::Data(q) = &parked.request.op else {
            debug_assert!(false, "a DATA wait holds a DATA");
            return;
        };
        let q = q.clone();
        let request = parked.request.clone();
        let may_wait = may_wait && parked.deadline.is_some_and(|at| at > now);
        if let Some(outcome) = self.data(&request, &q, now, may_wait) {
            self.unpark(ticket);
            self.emit(ticket, MessageType::Data, outcome);
        }
    }

    /// The answer to a DATA now, or `None` to wait (only when `may_wait`).
    pub(super) fn data(
        &mut self,
        request: &Request,
        q: &DataQuery,
        now: Instant,
        may_wait: bool,
    ) -> Option<Outcome> {
        let (task_id, buffer_id, token) = (&q.key.task, q.key.buffer, q.token);
        let reply = |refusal: Refusal| Some(Outcome::Reply(refused(request, refusal)));
        let tid = || task_id.clone();
        if !self.tasks.contains_key(task_id) {
            return match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => reply(Refusal::Aborted {
                    task: tid(),
                    reason: reason.clone(),
                }),
                Some(Gone::Abandoned) => reply(Refusal::TaskAbandoned { task: tid() }),
                Some(Gone::Finished) => Some(Outcome::Reply(complete_at(request, token))),
                Some(Gone::FinishedOpenBroadcast) => reply(Refusal::NotInFinishedBroadcastSet {
                    task: tid(),
                    buffer: buffer_id,
                }),
                None if self
                    .early
                    .get(task_id)
                    .is_some_and(|set| set.contains(buffer_id)) =>
                {
                    Some(Outcome::Reply(complete_at(request, token)))
                }
                None if may_wait => None,
                None => Some(Outcome::Reply(Reply::new(request.reply(Status::NoData)))),
            };
        }
        let max_buffers = self.config.max_buffers_per_task;
        let spool = self.config.spool.clone();
        let (default_size, max_reply, max_stored) = (
            self.config.default_reply_size,
            self.config.max_reply_size,
            self.config.max_stored_reply_size,
        );
        let task = self.tasks.get_mut(task_id)?;
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return reply(e);
        }
        if task.kind == BufferKind::Broadcast
            && task.fixed_count.is_none()
            && task.buffers_closed
            && !task.buffers.contains_key(&buffer_id)
        {
            // Every buffer of a broadcast sees every page: one that joins
            // after the set closed would read an empty buffer as complete.
            return reply(Refusal::NotInClosedBroadcastSet {
                task: tid(),
                buffer: buffer_id,
            });
        }
        if !task.buffers.contains_key(&buffer_id) && token > 0 {
            return reply(Refusal::NoPageYet {
                task: tid(),
                buffer: buffer_id,
                token,
            });
        }
        task.last_activity = now;
        let buffer = task.buffer_mut(buffer_id, now);
        buffer.last_poll = now;
        match buffer.gone {
            Some(BufferGone::Deleted) => return Some(Outcome::Reply(complete_at(request, token))),
            Some(BufferGone::Abandoned) => {
                return reply(Refusal::BufferAbandoned {
                    task: tid(),
                    buffer: buffer_id,
                    after: self.config.abandon_after,
                });
            }
            None => {}
        }
        let max_bytes = match q.max_size {
            0 => default_size,
            n => n,
        }
        .min(max_reply)
        .max(1);
        // Pages handed out one by one (ARBITRARY) carry other tokens than
        // the shared log's object they lie in: never presigned whole (a
        // review found such an object's URL refused by the client for its
        // first token).
        let whole = q.accept_spooled
            && task.kind != BufferKind::Arbitrary
            && spool
                .as_ref()
                .is_some_and(|s| s.presigns && q.encodings.contains(s.codec));
        let before = task.memory();
        let mut deletes = Vec::new();
        let acked = task.ack_for_read(
            buffer_id,
            token,
            q.ack,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let objects = &self.objects;
        let object_size = |id: ObjectId| objects.meta(id).map_or(0, |m| m.page_bytes());
        let stored = StoredReads {
            object_size: &object_size,
            whole,
            max_bytes: max_stored,
        };
        let read = acked.map(|()| {
            task.read(
                buffer_id,
                token,
                max_bytes,
                MAX_REPLY_PAGES,
                q.sizes_only,
                Some(&stored),
            )
        });
        let following = match (&read, q.ack) {
            (Ok(read), Some(_)) if !q.sizes_only && !read.pages.is_empty() => task.following_sizes(
                buffer_id,
                token + read.pages.len() as u64,
                max_bytes.saturating_mul(2),
                MAX_FOLLOWING_SIZES,
                MAX_FOLLOWING_SIZES_BYTES,
                &stored,
            ),
            _ => Vec::new(),
        };
        let after = task.memory();
        self.account(before, after);
        self.delete_objects(deletes);
        let read = match read {
            Ok(read) => read,
            Err(e) => {
                return reply(token_error(e, task_id, buffer_id, token));
            }
        };
        if q.sizes_only {
            if read.sizes.is_empty() && !read.complete && may_wait {
                return None;
            }
            let mut header = request.reply(Status::Ok);
            header.remaining_bytes = read.sizes;
            header.buffer_complete = read.complete;
            return Some(Outcome::Reply(Reply::new(header)));
        }
        if read.pages.is_empty() {
            if read.complete {
                return Some(Outcome::Reply(complete_at(request, token)));
            }
            if may_wait {
                return None;
            }
            return Some(Outcome::Reply(Reply::new(request.reply(Status::NoData))));
        }
        let count = read.pages.len() as u64;
        let mut header = request.reply(Status::Ok);
        header.page_next_token = token + count;
        header.buffer_complete = read.complete;
        header.following_sizes = following;
        let mut planned = Vec::with_capacity(read.pages.len());
        let mut leased: Vec<ObjectId> = Vec::new();
        let mut bytes = 0u64;
        for page in read.pages {
            bytes += page.size;
            match (page.body, page.object) {
                (Some(body), _) => planned.push(PlannedPage::Memory(body)),
                (None, Some((id, index))) => {
                    let Some(meta) = self.objects.meta(id).cloned() else {
                        debug_assert!(false, "a page refers to an object the core forgot");
                        return reply(Refusal::PageObjectUnknown {
                            task: tid(),
                            buffer: buffer_id,
                            token,
                        });
                    };
                    if leased.last() != Some(&id) {
                        leased.push(id);
                    }
                    planned.push(PlannedPage::Object { meta, index, whole });
                }
                (None, None) => {
                    debug_assert!(false, "a page is neither in memory nor in storage");
                    return reply(Refusal::PageNowhere {
                        task: tid(),
                        buffer: buffer_id,
                        token,
                    });
                }
            }
        }
        self.stats.pages_served += count;
        self.stats.bytes_served += bytes;
        let what = PlanSubject {
            task: tid(),
            buffer: buffer_id,
            token,
            from_storage: false,
        };
        let mut plan = DataPlan::build(header, what, planned);
        if plan.is_ready() {
            return Some(Outcome::Reply(plan.assemble(Vec::new())));
        }
        if !whole {
            // Read from storage by the driver: the next object can be read
            // while this reply is sent.
            plan.read_ahead = self.tasks.get(task_id).and_then(|task| {
                let next =
                    task.next_stored_object(buffer_id, token + count, leased.last().copied())?;
                self.objects.meta(next).cloned()
            });
        }
        leased.sort();
        leased.dedup();
        for &id in &leased {
            self.objects.add_lease(id);
        }
        self.next_lease += 1;
        let lease = LeaseId(self.next_lease);
        self.leases.insert(lease, leased);
        plan.lease = Some(lease);
        Some(Outcome::Plan(plan))
    }

    /// A DATA plan was carried out: its objects may go; `status` is the
    /// reply's.
    pub fn plan_finished(&mut self, lease: Option<LeaseId>, status: Status, now: Instant) {
        self.count_reply(MessageType::Data, status as i32);
        // BUSY (the store unreachable for now, or no room to read) says
        // nothing of the objects: the consumer asks storage again.
        if let Some(rkey) = lease.and_then(|l| self.failover_leases.remove(&l))
            && !matches!(status, Status::Ok | Status::Busy)
        {
            // The committed buffer's objects are gone (its producer deleted
            // the buffer, or it expired): ask the producer again.
            self.remotes.states.remove(&rkey);
        }
        if let Some(ids) = lease.and_then(|l| self.leases.remove(&l)) {
            let mut deletes = Vec::new();
            for id in ids {
                if let Some(meta) = self.objects.drop_lease(id) {
                    deletes.push(meta);
                }
            }
            self.delete_objects(deletes);
        }
        self.after(now);
    }

    /// Whether `task_id` ended as a failure (aborted by its producer or an
    /// operator, or abandoned): what the HTTP exchange reports as a failed
    /// task (`X-Trino-Task-Failed`) rather than as a server error.
    pub fn task_failed(&self, task_id: &str) -> bool {
        !self.tasks.contains_key(task_id)
            && matches!(
                self.ended.get(task_id),
                Some(Gone::Aborted(_) | Gone::Abandoned)
            )
    }

    /// Sizes of the pages of a buffer held from `token` on; changes nothing.
    pub fn peek_sizes(&self, task_id: &str, buffer_id: u64, token: u64) -> Vec<u64> {
        self.tasks
            .get(task_id)
            .map(|t| t.peek_sizes(buffer_id, token, MAX_REPLY_PAGES))
            .unwrap_or_default()
    }

    /// The token below which buffer `buffer_id` of `task_id` was
    /// acknowledged (a DATA below it is refused), if the task is held.
    pub fn acknowledged_mark(&self, task_id: &str, buffer_id: u64) -> Option<u64> {
        self.tasks.get(task_id).map(|t| t.mark(buffer_id))
    }
}
