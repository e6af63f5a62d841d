//! Requests in: `handle` and the dispatch to each kind, parking a request that waits (its state, deadline and queue place) and answering it later.

use super::*;

impl Core {
    /// Applies one request that passed the door.
    pub fn handle(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        body: Payload,
        now: Instant,
    ) -> Handled {
        self.start_clock(now);
        let kind = request.kind();
        // An answer to this request that came about on the way (a queue
        // applied at once) is among the events pushed from here on.
        let mark = self.events.len();
        let immediate = self.dispatch(ticket, conn, request, body, now);
        self.after(now);
        let outcome = match immediate {
            Some(outcome) => {
                if let Outcome::Reply(reply) = &outcome {
                    self.count_reply(kind, reply.header.status);
                }
                Some(outcome)
            }
            None => self.take_outcome(mark, ticket),
        };
        match outcome {
            Some(Outcome::Reply(reply)) => Handled::Reply(reply),
            Some(Outcome::Plan(plan)) => Handled::Plan(plan),
            None => Handled::Pending,
        }
    }

    /// Takes the answer to `ticket` out of the events pushed since `mark`,
    /// if there is one, so `handle` returns it instead.
    fn take_outcome(&mut self, mark: usize, ticket: Ticket) -> Option<Outcome> {
        let at = (mark..self.events.len()).find(
            |&i| matches!(&self.events[i], Event::Outcome { ticket: t, .. } if *t == ticket),
        )?;
        match self.events.remove(at) {
            Some(Event::Outcome { outcome, .. }) => Some(outcome),
            other => {
                debug_assert!(other.is_none(), "found an outcome, removed something else");
                None
            }
        }
    }

    pub(super) fn dispatch(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        body: Payload,
        now: Instant,
    ) -> Option<Outcome> {
        if request.remote.is_some() {
            return self.proxy(ticket, conn, request, now);
        }
        if let Op::Data(q) = &request.op {
            let q = q.clone();
            return self.dispatch_data(ticket, conn, request, q, now);
        }
        self.dispatch_reply(ticket, conn, request, body, now)
            .map(Outcome::Reply)
    }

    /// DATA: a reply now (from memory or a plan of objects to read), or
    /// parked until pages come or its wait is over.
    fn dispatch_data(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        q: DataQuery,
        now: Instant,
    ) -> Option<Outcome> {
        if q.ack.is_some_and(|ack| ack < q.token) {
            self.stats.data_pipelined += 1;
        }
        let may_wait = !self.wait_budget(&q).is_zero();
        match self.data(&request, &q, now, may_wait) {
            Some(outcome) => Some(outcome),
            None => {
                if self
                    .conns
                    .get(&conn)
                    .is_some_and(|c| c.outstanding >= self.config.max_outstanding_per_connection)
                {
                    return Some(Outcome::Reply(self.too_many(&request)));
                }
                let deadline = now + self.wait_budget(&q);
                self.park(ticket, conn, request, ParkState::DataWait, Some(deadline));
                self.add_waiter(ticket, &q.key);
                None
            }
        }
    }

    /// Every request but DATA and those naming a remote: a reply now, or
    /// none while it waits (queued ENQUEUE and NO_MORE_PAGES, COMMITTED).
    fn dispatch_reply(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        body: Payload,
        now: Instant,
    ) -> Option<Reply> {
        match &request.op {
            Op::Ping | Op::Hello { .. } => Some(Reply::new(request.reply(Status::Ok))),
            Op::ShmAttach => Some(refused(
                &request,
                Refusal::ShmAttachMisplaced(
                    "SHM_ATTACH is answered by the connection, as its first request",
                ),
            )),
            Op::Data(_) => {
                debug_assert!(false, "DATA is dispatched by dispatch_data");
                Some(refused(&request, Refusal::Misrouted("DATA")))
            }
            Op::Ack { key, token } => {
                let (key, token) = (key.clone(), *token);
                Some(self.ack(&request, &key, token, now))
            }
            Op::Delete { key } => {
                let key = key.clone();
                Some(self.delete(&request, &key, now))
            }
            Op::DeleteTask { task, buffers } => {
                let (task, buffers) = (task.clone(), *buffers);
                Some(self.delete_task(&request, &task, buffers, now))
            }
            Op::OpenTask { task, .. } => {
                let task = task.clone();
                let reply = self.open_task(&request, now);
                if reply.header.status_kind() == Status::Ok {
                    self.note_producer(conn, &task);
                }
                Some(reply)
            }
            Op::Committed { task, from } => {
                let (task, from) = (task.clone(), *from);
                self.committed(ticket, conn, request, &task, from)
            }
            Op::AbortTask { task, reason } => {
                let (task, reason) = (task.clone(), reason.clone());
                self.abort(&task, &reason, now);
                Some(Reply::new(request.reply(Status::Ok)))
            }
            Op::Enqueue { .. } | Op::NoMorePages { .. } => {
                if self
                    .conns
                    .get(&conn)
                    .is_some_and(|c| c.outstanding >= self.config.max_outstanding_per_connection)
                {
                    return Some(self.too_many(&request));
                }
                let task = match &request.op {
                    Op::Enqueue { key, .. } => key.task.clone(),
                    Op::NoMorePages { task, .. } => task.clone(),
                    _ => return None,
                };
                self.note_producer(conn, &task);
                // A NO_MORE_PAGES carries no pages: a body sent with one is
                // not kept (nor counted: its later states count nothing).
                let body = if matches!(request.op, Op::Enqueue { .. }) {
                    body
                } else {
                    Payload::empty()
                };
                let len = request.waiting_bytes(body.bytes.len() as u64);
                self.pending_bytes += len;
                self.budget.pend(len, true);
                self.park(ticket, conn, request, ParkState::Queued { body }, None);
                let state = self.conns.entry(conn).or_default();
                state.queue.push_back(ticket);
                if state.queue.len() == 1 {
                    self.pump(conn, now);
                }
                None
            }
        }
    }

    /// `conn` carries requests of `task_id`'s producer: while it is open,
    /// and until the task's input is finished, the task is not dropped as
    /// abandoned.
    pub(super) fn note_producer(&mut self, conn: ConnId, task_id: &TaskId) {
        if let Some(task) = self.tasks.get_mut(task_id)
            && !task.input_finished
            && task.producers.insert(conn)
        {
            self.producer_conns
                .entry(conn)
                .or_default()
                .insert(task_id.clone());
        }
    }

    /// COMMITTED: reads the task's commit manifest (local only; the door
    /// refused it on TCP).
    pub(super) fn committed(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        task_id: &TaskId,
        from: u64,
    ) -> Option<Reply> {
        if self.spool().is_none() {
            let mut header = request.refuse(&Refusal::CommittedWithoutStore {
                task: task_id.clone(),
            });
            header.page_token = from;
            header.page_next_token = from;
            return Some(Reply::new(header));
        }
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.outstanding >= self.config.max_outstanding_per_connection)
        {
            return Some(self.too_many(&request));
        }
        self.new_op(
            OpKind::ReadManifest { ticket },
            Command::ReadManifest {
                task: task_id.clone(),
            },
        );
        let state = ParkState::ReadingManifest {
            task: task_id.clone(),
            from,
        };
        self.park(ticket, conn, request, state, None);
        None
    }

    /// A commit manifest was read for a COMMITTED.
    pub fn manifest_read(
        &mut self,
        op: OpId,
        result: Result<Option<Manifest>, ManifestError>,
        now: Instant,
    ) {
        let Some(OpKind::ReadManifest { ticket }) = self.ops.remove(&op) else {
            return;
        };
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let request = parked.request;
        let ParkState::ReadingManifest { task, from } = parked.state else {
            debug_assert!(false, "only a COMMITTED has ReadManifest ops");
            return;
        };
        let error = |refusal: Refusal| {
            let mut header = request.refuse(&refusal);
            header.page_token = from;
            header.page_next_token = from;
            Reply::new(header)
        };
        let reply = match result {
            Ok(None) => {
                let mut header = request.reply(Status::NoData);
                header.page_token = from;
                header.page_next_token = from;
                Reply::new(header)
            }
            Ok(Some(m)) if m.buffers.len() as u64 > self.config.max_buffers_per_task => {
                error(Refusal::ManifestTooLarge {
                    task: task.clone(),
                    count: m.buffers.len(),
                    limit: self.config.max_buffers_per_task,
                })
            }
            Ok(Some(m)) => {
                let count = m.buffers.len() as u64;
                if from >= count && !(from == 0 && count == 0) {
                    error(Refusal::CommittedBeyondBuffers {
                        task: task.clone(),
                        from,
                        count,
                    })
                } else {
                    let start = from as usize;
                    let end = (start + binx_proto::COMMITTED_PER_REPLY).min(m.buffers.len());
                    let part = &m.buffers[start..end];
                    let mut header = request.reply(Status::Ok);
                    header.page_token = from;
                    header.page_next_token = end as u64;
                    header.buffer_complete = end as u64 == count;
                    header.committed = Some(Box::new(binx_proto::Committed {
                        node: m.node,
                        endpoint: m.endpoint,
                        buffer_count: count,
                        end_tokens: part.iter().map(|&(e, _)| e).collect(),
                        bytes: part.iter().map(|&(_, b)| b).collect(),
                    }));
                    Reply::new(header)
                }
            }
            Err(ManifestError::Unavailable(e)) => {
                self.stats.busy_replies += 1;
                error(Refusal::ManifestUnavailable {
                    task: task.clone(),
                    why: e,
                })
            }
            Err(ManifestError::Invalid(e)) => error(Refusal::ManifestInvalid {
                task: task.clone(),
                why: e,
            }),
        };
        self.emit(ticket, MessageType::Committed, Outcome::Reply(reply));
        self.after(now);
    }

    /// A manifest write finished (its NO_MORE_PAGES is answered now), and
    /// with it the markers folded into it.
    pub fn manifest_written(&mut self, op: OpId, result: Result<(), StoreFailure>, now: Instant) {
        let Some(OpKind::Manifest {
            ticket,
            task: task_id,
            folded,
        }) = self.ops.remove(&op)
        else {
            return;
        };
        let alive = self.tasks.contains_key(&task_id);
        let had_folded = !folded.is_empty();
        if let Some(task) = self.tasks.get_mut(&task_id) {
            match &result {
                Ok(()) => task.manifest = true,
                // Asking again would fail the same way: the repeated
                // NO_MORE_PAGES writes the markers apart.
                Err(e) if !e.transient && had_folded => task.fold_refused = true,
                Err(_) => {}
            }
        }
        for buffer in folded {
            self.marker_settled((task_id.clone(), buffer), &result, now);
        }
        if result.is_ok() && !alive {
            // The task went while the manifest was written (its folded
            // markers, released, go with it).
            self.new_op(
                OpKind::ManifestDelete {
                    task: task_id.clone(),
                },
                Command::DeleteManifest {
                    task: task_id.clone(),
                    folded: had_folded,
                },
            );
        }
        let Some((ticket, parked)) =
            ticket.and_then(|ticket| self.unpark(ticket).map(|p| (ticket, p)))
        else {
            self.after(now);
            return;
        };
        let reply = match &result {
            Ok(()) if alive => {
                self.release_producers(&task_id, now);
                Reply::new(parked.request.reply(Status::Ok))
            }
            Ok(()) => self.ended_task_finished(&parked.request, &task_id),
            Err(e) => {
                tracing::warn!(task = %task_id, error = %e, "a commit manifest could not be written");
                self.stats.busy_replies += 1;
                self.busy_behind(parked.conn, None, &parked.request);
                refused(
                    &parked.request,
                    Refusal::ManifestWriteFailed {
                        task: task_id,
                        failure: e.clone(),
                    },
                )
            }
        };
        self.emit(ticket, MessageType::NoMorePages, Outcome::Reply(reply));
        self.pump(parked.conn, now);
        self.after(now);
    }

    /// A manifest deletion finished; one that failed is left to the TTL.
    pub fn manifest_deleted(&mut self, op: OpId, result: Result<(), StoreFailure>, now: Instant) {
        let Some(OpKind::ManifestDelete { task }) = self.ops.remove(&op) else {
            return;
        };
        if let Err(e) = &result {
            tracing::warn!(task = %task, error = %e, "a commit manifest could not be deleted; the TTL pruner will");
            self.stats.deletes_left_to_ttl += 1;
        }
        self.folded_markers_deleted(&task, result.is_ok());
        self.after(now);
    }

    pub(super) fn too_many(&mut self, request: &Request) -> Reply {
        refused(
            request,
            Refusal::TooManyOutstanding {
                limit: self.config.max_outstanding_per_connection,
            },
        )
    }

    pub(super) fn park(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        state: ParkState,
        deadline: Option<Instant>,
    ) {
        self.conns.entry(conn).or_default().outstanding += 1;
        if let Some(at) = deadline {
            self.deadlines.insert((at, ticket));
        }
        self.parked.insert(
            ticket,
            Parked {
                conn,
                request,
                state,
                deadline,
                waited: false,
            },
        );
    }

    /// Removes a parked request (and its deadline, waiter and queue entry).
    pub(super) fn unpark(&mut self, ticket: Ticket) -> Option<Parked> {
        let parked = self.parked.remove(&ticket)?;
        if let Some(at) = parked.deadline {
            self.deadlines.remove(&(at, ticket));
        }
        if matches!(parked.state, ParkState::DataWait)
            && let Op::Data(q) = &parked.request.op
            && let Some(waiters) = self.data_waiters.get_mut(&q.key.task)
        {
            if let Some(set) = waiters.get_mut(&q.key.buffer) {
                set.remove(&ticket);
                if set.is_empty() {
                    waiters.remove(&q.key.buffer);
                }
            }
            if waiters.is_empty() {
                self.data_waiters.remove(&q.key.task);
            }
        }
        let len = parked.waiting_bytes();
        if len > 0 {
            self.pending_bytes -= len;
            self.budget.pend(len, false);
            self.freed_since_signal = true;
        }
        self.blocked.remove(&ticket);
        self.forget_room_wanted(ticket);
        self.spooling.remove(&ticket);
        if let Some(conn) = self.conns.get_mut(&parked.conn) {
            conn.outstanding -= 1;
            if let Some(pos) = conn.queue.iter().position(|&t| t == ticket) {
                conn.queue.remove(pos);
            }
            if conn.outstanding == 0 && conn.queue.is_empty() {
                self.conns.remove(&parked.conn);
            }
        }
        Some(parked)
    }

    pub(super) fn set_deadline(&mut self, ticket: Ticket, at: Instant) {
        if let Some(p) = self.parked.get_mut(&ticket) {
            if let Some(old) = p.deadline.replace(at) {
                self.deadlines.remove(&(old, ticket));
            }
            self.deadlines.insert((at, ticket));
        }
    }

    /// The driver no longer wants the answer (its client went away).
    pub fn cancel(&mut self, ticket: Ticket, now: Instant) {
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        // Storage work under way finishes (and its effects stand); the rest goes.
        if matches!(
            parked.state,
            ParkState::DataWait | ParkState::Queued { .. } | ParkState::Forwarding
        ) {
            let conn = parked.conn;
            let queued = matches!(parked.state, ParkState::Queued { .. });
            let cause = parked.request.clone();
            // The ENQUEUEs and NO_MORE_PAGES sent after a queued one that
            // goes unapplied must not be applied either: what takes effect
            // is always a prefix of what a connection sent (a NO_MORE_PAGES
            // applied without the ENQUEUE before it would end the buffer
            // short).
            let behind: Vec<Ticket> = if queued {
                self.conns
                    .get(&conn)
                    .map(|c| {
                        c.queue
                            .iter()
                            .skip_while(|&&t| t != ticket)
                            .skip(1)
                            .copied()
                            .collect()
                    })
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            self.unpark(ticket);
            for t in behind {
                self.refuse_queued(t, &cause);
            }
            self.after(now);
        }
    }

    /// A client connection closed: its waiting requests go, and the tasks
    /// it produced for start their abandon clock once no connection of
    /// their producer is left.
    pub fn connection_closed(&mut self, conn: ConnId, now: Instant) {
        // Every parked request counts in its connection's entry: without
        // one, nothing of it waits, and the parked requests of every other
        // connection are not walked (under the shard's lock, for each
        // connection that closes: a stranger's included).
        let tickets: Vec<Ticket> = if self.conns.contains_key(&conn) {
            self.parked
                .iter()
                .filter(|(_, p)| p.conn == conn)
                .map(|(&t, _)| t)
                .collect()
        } else {
            Vec::new()
        };
        for ticket in tickets {
            self.cancel(ticket, now);
        }
        for task_id in self.producer_conns.remove(&conn).unwrap_or_default() {
            if let Some(task) = self.tasks.get_mut(&task_id) {
                task.producers.remove(&conn);
                if task.producers.is_empty() {
                    task.restart_clocks(now);
                }
            }
        }
    }

    /// A task-wide NO_MORE_PAGES was answered OK: the task needs its
    /// producer's connections no more (an engine may keep one connection
    /// for all its tasks), and its abandonment clocks start now.
    pub(super) fn release_producers(&mut self, task_id: &TaskId, now: Instant) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        if task.producers.is_empty() {
            return;
        }
        for conn in std::mem::take(&mut task.producers) {
            if let Some(set) = self.producer_conns.get_mut(&conn) {
                set.remove(task_id);
                if set.is_empty() {
                    self.producer_conns.remove(&conn);
                }
            }
        }
        task.restart_clocks(now);
    }
}
