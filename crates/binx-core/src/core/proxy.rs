//! The proxy consumer: forwarding a local client's request to the producer's sidecar, and failover to commit markers once it is gone.

use super::*;

/// A silent remote's run starts over when it fails again this many
/// `failover_after`s after its latest failure (it may have come back
/// and gone again): longer than a client's retry pacing (at most 10 s
/// between tries), so a reader that retries slowly, or reads other buffers
/// from storage for a while, still finds the run.
const SILENCE_GAP_FACTOR: u32 = 10;

impl Core {
    pub(super) fn proxy(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        now: Instant,
    ) -> Option<Outcome> {
        let remote: Arc<str> = Arc::from(request.remote.clone().unwrap_or_default());
        if !self.config.forward_allowed_peers.allows(&remote) {
            self.stats.forwards_refused += 1;
            return Some(Outcome::Reply(refused(
                &request,
                Refusal::RemoteNotAllowed {
                    remote: remote.to_string(),
                    allowed: self.config.forward_allowed_peers.to_string(),
                },
            )));
        }
        if let Op::DeleteTask { task, buffers } = &request.op {
            let (task, buffers) = (task.clone(), *buffers);
            return self.proxy_delete_task(ticket, conn, request, remote, (task, buffers), now);
        }
        let Some(key) = request.buffer_key().cloned() else {
            return Some(Outcome::Reply(refused(&request, Refusal::NotForwardable)));
        };
        let rkey: RemoteKey = (remote.clone(), key.task.clone(), key.buffer);
        match self.remotes.states.get_mut(&rkey) {
            Some(RemoteState::Lost { marker, used }) => {
                *used = now;
                let marker = marker.clone();
                // Served from storage, still read from that process.
                self.remotes.process_of(&rkey, now);
                return Some(self.serve_lost(ticket, &request, &rkey, marker, now));
            }
            // A DELETE repeated, or an ACK late, after the buffer was
            // deleted from storage: nothing left to do (and no process to
            // send it to: the DELETE forgot it).
            Some(RemoteState::Released { .. })
                if matches!(request.op, Op::Delete { .. } | Op::Ack { .. }) =>
            {
                return Some(Outcome::Reply(Reply::new(request.reply(Status::Ok))));
            }
            // Anything else on a released buffer is asked of the remote again.
            Some(RemoteState::Released { .. }) => {
                self.remotes.states.remove(&rkey);
            }
            _ => {}
        }
        self.forward(ticket, conn, request, remote, now)
    }

    /// Sends `request` on to `remote`, parked until it comes back
    /// ([`Core::forwarded`]).
    fn forward(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        remote: Arc<str>,
        now: Instant,
    ) -> Option<Outcome> {
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.outstanding >= self.config.max_outstanding_per_connection)
        {
            return Some(Outcome::Reply(self.too_many(&request)));
        }
        let mut wire = request.to_wire();
        wire.remote.clear();
        // Capped here as a local DATA is: the forwarder waits for the reply
        // as long as it may, so an uncapped wait at a silent remote would
        // hold back TIMEOUT and failover by as much.
        let cap = u64::try_from(self.config.max_wait.as_micros()).unwrap_or(u64::MAX);
        wire.max_wait_micros = wire.max_wait_micros.min(cap);
        // Only to the process the buffer (or, for DELETE_TASK, a buffer of
        // the task) was read from.
        let instance = match (&request.op, request.buffer_key()) {
            (_, Some(key)) => {
                let rkey: RemoteKey = (remote.clone(), key.task.clone(), key.buffer);
                self.remotes.process_of(&rkey, now)
            }
            (Op::DeleteTask { task, buffers }, None) => self
                .remotes
                .task_read_from(&remote, task, *buffers)
                .map(|(_, instance)| instance),
            _ => None,
        };
        self.park(ticket, conn, request, ParkState::Forwarding, None);
        self.new_op(
            OpKind::Forward {
                ticket: Some(ticket),
                remote: remote.clone(),
                instance: instance.clone(),
            },
            Command::Forward {
                remote: remote.to_string(),
                request: Box::new(wire),
                instance,
            },
        );
        None
    }

    /// DELETE_TASK for `remote`: sent on as one request, its answer
    /// returned as it comes (no failover: a client that is not answered OK
    /// deletes the buffers one at a time, and those DELETEs fail over).
    /// Refused while this sidecar tracks one of the buffers as failing,
    /// lost or released at `remote`: a DELETE of its own answers those.
    fn proxy_delete_task(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        remote: Arc<str>,
        (task, buffers): (TaskId, u64),
        now: Instant,
    ) -> Option<Outcome> {
        let max_buffers = self.config.max_buffers_per_task;
        if buffers > max_buffers {
            return Some(Outcome::Reply(refused(
                &request,
                Refusal::DeleteTaskTooWide {
                    task,
                    buffers,
                    why: format!("a task has at most {max_buffers} (max_buffers_per_task)"),
                },
            )));
        }
        let from: RemoteKey = (remote.clone(), task.clone(), 0);
        let to: RemoteKey = (remote.clone(), task.clone(), buffers);
        if let Some(((_, _, buffer), _)) = self.remotes.states.range(from..to).next() {
            let buffer = *buffer;
            return Some(Outcome::Reply(refused(
                &request,
                Refusal::DeleteTaskFailingOver {
                    task,
                    remote: remote.to_string(),
                    buffer,
                },
            )));
        }
        self.forward(ticket, conn, request, remote, now)
    }

    /// Answers a proxy request of a buffer its producer lost, from the
    /// buffer's commit marker. ACK and DELETE still go to the remote, in
    /// case it is alive and holds the buffer (only to the process the
    /// buffer was read from, when it was).
    pub(super) fn serve_lost(
        &mut self,
        ticket: Ticket,
        request: &Request,
        rkey: &RemoteKey,
        marker: Arc<CommitMarker>,
        now: Instant,
    ) -> Outcome {
        let _ = ticket;
        match &request.op {
            Op::Ack { .. } | Op::Delete { .. } => {
                let mut wire = request.to_wire();
                wire.remote.clear();
                // Not to a process other than the one the buffer was read
                // from (a restart is why it is lost): it may hold a task of
                // the same id again.
                let instance = self
                    .remotes
                    .process_of(rkey, now)
                    .or_else(|| marker.instance.as_deref().map(Arc::from));
                self.new_op(
                    OpKind::Forward {
                        ticket: None,
                        remote: rkey.0.clone(),
                        instance: instance.clone(),
                    },
                    Command::Forward {
                        remote: rkey.0.to_string(),
                        request: Box::new(wire),
                        instance,
                    },
                );
                if matches!(request.op, Op::Delete { .. }) {
                    self.remotes.read_from.remove(rkey);
                    self.remotes
                        .states
                        .insert(rkey.clone(), RemoteState::Released { at: now });
                    self.new_op(OpKind::Release, Command::ReleaseCommitted(marker));
                }
                Outcome::Reply(Reply::new(request.reply(Status::Ok)))
            }
            Op::Data(q) => {
                let q = q.clone();
                match self.plan_from_marker(request, &q, &marker) {
                    Outcome::Reply(reply) => Outcome::Reply(reply),
                    Outcome::Plan(mut plan) => {
                        self.stats.failover_replies += 1;
                        let _ = now;
                        self.next_lease += 1;
                        let lease = LeaseId(self.next_lease);
                        self.failover_leases.insert(lease, rkey.clone());
                        plan.lease = Some(lease);
                        plan.on_lost = Status::Timeout;
                        Outcome::Plan(plan)
                    }
                }
            }
            _ => Outcome::Reply(refused(request, Refusal::NotForwardable)),
        }
    }

    /// A DATA reply from a commit marker: the pages from the token on,
    /// exactly as the producer would have sent them.
    pub(super) fn plan_from_marker(
        &self,
        request: &Request,
        q: &DataQuery,
        marker: &CommitMarker,
    ) -> Outcome {
        let (task_id, buffer_id, token) = (&q.key.task, q.key.buffer, q.token);
        if token > marker.end_token {
            return Outcome::Reply(refused(
                request,
                Refusal::BeyondMarkerEnd {
                    task: task_id.clone(),
                    buffer: buffer_id,
                    token,
                    end: marker.end_token,
                },
            ));
        }
        let max = match q.max_size {
            0 => self.config.default_reply_size,
            n => n,
        }
        .min(self.config.max_reply_size)
        .max(1);
        // Pages from `token` on, by the marker's segments: as many as one
        // reply can take (review: every page to the buffer's end, on every
        // DATA of a long buffer), though every segment is checked for gaps.
        // The marker comes from storage: its tokens may be anything.
        let mut pages: Vec<(Arc<ObjectMeta>, u32, u64)> = Vec::new();
        let mut sizes = Vec::new();
        let mut expected = None::<u64>;
        let mut collected = 0u64;
        let mut full = false;
        for segment in &marker.segments {
            let end = segment
                .first_token
                .saturating_add(segment.page_sizes.len() as u64);
            if end <= token {
                continue;
            }
            let start = expected.unwrap_or(token);
            if segment.first_token > start {
                return Outcome::Reply(refused(
                    request,
                    Refusal::MarkerGap {
                        task: task_id.clone(),
                        buffer: buffer_id,
                        token,
                        missing: start,
                    },
                ));
            }
            // Never backwards: a segment that ends before the one before it
            // (a marker out of order) must not have pages served again.
            expected = Some(expected.map_or(end, |e| e.max(end)));
            if full {
                continue;
            }
            let meta = Arc::new(segment.clone());
            for (i, &size) in segment.page_sizes.iter().enumerate() {
                let t = segment.first_token.saturating_add(i as u64);
                // A segment may hold pages past the buffer's end (BROADCAST
                // pages of a shared object): never served as this buffer's.
                if t < start || t >= marker.end_token {
                    continue;
                }
                if q.sizes_only {
                    sizes.push(size);
                    full = sizes.len() >= MAX_REPLY_PAGES;
                } else {
                    pages.push((meta.clone(), i as u32, size));
                    collected = collected.saturating_add(size);
                    // The reply stops at the page past `max` (below).
                    full = pages.len() >= MAX_REPLY_PAGES || collected > max;
                }
                if full {
                    break;
                }
            }
        }
        let covered = expected.unwrap_or(token).max(token);
        if covered < marker.end_token {
            return Outcome::Reply(refused(
                request,
                Refusal::MarkerShort {
                    task: task_id.clone(),
                    buffer: buffer_id,
                    token,
                    covered,
                    end: marker.end_token,
                },
            ));
        }
        if q.sizes_only {
            let mut header = request.reply(Status::Ok);
            header.remaining_bytes = sizes;
            header.buffer_complete = token == marker.end_token;
            return Outcome::Reply(Reply::new(header));
        }
        let mut planned = Vec::new();
        let mut total = 0u64;
        // Each object is read back whole: at most `max_stored_reply_size`
        // of them, as for spilled pages.
        let mut stored = 0u64;
        let mut last_object: Option<Arc<ObjectMeta>> = None;
        for (meta, index, size) in pages {
            let object_bytes = if last_object.as_ref().is_some_and(|o| Arc::ptr_eq(o, &meta)) {
                0
            } else {
                meta.page_bytes()
            };
            if planned.len() >= MAX_REPLY_PAGES
                || (!planned.is_empty()
                    && (total + size > max
                        || stored + object_bytes > self.config.max_stored_reply_size))
            {
                break;
            }
            total += size;
            stored += object_bytes;
            last_object = Some(meta.clone());
            planned.push(PlannedPage::Object {
                meta,
                index,
                whole: false,
            });
        }
        let count = planned.len() as u64;
        let mut header = request.reply(Status::Ok);
        header.page_next_token = token + count;
        header.buffer_complete = token + count == marker.end_token;
        if planned.is_empty() {
            return Outcome::Reply(complete_at(request, token));
        }
        let what = PlanSubject {
            task: task_id.clone(),
            buffer: buffer_id,
            token,
            from_storage: true,
        };
        Outcome::Plan(DataPlan::build(header, what, planned))
    }

    /// A forwarded request came back (or failed), from a remote whose
    /// process instance is not known (see [`Core::forwarded_from`]).
    pub fn forwarded(&mut self, op: OpId, result: Result<Frame<BinReply>, String>, now: Instant) {
        self.forwarded_from(op, result, None, now);
    }

    /// The forward `op` stood for, ended: its parked request (none when
    /// nobody waits for it), its remote, and the process it was sent to.
    fn take_forward(&mut self, op: OpId) -> Option<EndedForward> {
        match self.ops.remove(&op)? {
            OpKind::Forward {
                ticket,
                remote,
                instance,
            } => Some((ticket, remote, instance)),
            _ => None,
        }
    }

    /// A forwarded request came back (or failed); `instance`: the process
    /// the remote's HELLO reply named on the connection the reply came
    /// over. A DATA reply from another process than the one the buffer's
    /// earlier replies came from is refused (another run of the task id).
    pub fn forwarded_from(
        &mut self,
        op: OpId,
        result: Result<Frame<BinReply>, String>,
        instance: Option<Arc<str>>,
        now: Instant,
    ) {
        let Some((ticket, remote, sent_to)) = self.take_forward(op) else {
            return;
        };
        // Whether the remote answers is learnt from every forward, also
        // those nobody waits for (a lost buffer's ACK and DELETE, a client
        // gone). Since when this buffer has failed: from now for an answer
        // that says the remote cannot serve it (NO_DATA, TIMEOUT); for no
        // answer at all, from the remote's first failure since it last
        // answered.
        let answered = result.is_ok();
        let silent_since = match &result {
            Ok(_) => {
                self.silences.answered(&remote);
                None
            }
            Err(_) => self.spool().map(|s| s.failover_after).map(|every| {
                self.silences
                    .silent(&remote, now, every * SILENCE_GAP_FACTOR)
            }),
        };
        let Some(ticket) = ticket else {
            return;
        };
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        let request = parked.request.clone();
        if let Op::DeleteTask { task, buffers } = &request.op {
            let reply = match result {
                Ok(frame) => {
                    if frame.header.status == Status::Ok as i32 {
                        self.remotes.forget_task(&remote, task, *buffers);
                    }
                    remote_reply(&request, frame)
                }
                Err(reason) => refused(
                    &request,
                    Refusal::RemoteSilentForTask {
                        remote: binx_proto::truncate(&remote, 64).to_string(),
                        task: task.clone(),
                        reason,
                    },
                ),
            };
            self.finish_proxy(ticket, reply, now);
            return;
        }
        let Some(key) = request.buffer_key().cloned() else {
            debug_assert!(
                false,
                "only DATA, ACK, DELETE and DELETE_TASK are forwarded"
            );
            return;
        };
        let rkey: RemoteKey = (remote.clone(), key.task.clone(), key.buffer);
        let (reply, failing) = match result {
            Ok(frame) => {
                // A socket that named no process, for a buffer read from
                // one, is another (as the forwarder withholds on it).
                let instance = instance.or_else(|| {
                    self.remotes
                        .read_from
                        .contains_key(&rkey)
                        .then(|| Arc::from("none"))
                });
                if let Some(answering) = instance
                    && let Some(was) =
                        self.read_from_another(&request, &rkey, &frame, &answering, now)
                {
                    self.another_process(ticket, &request, remote, was, answering, now);
                    return;
                }
                let no_data = frame.header.status == Status::NoData as i32
                    && matches!(request.op, Op::Data(_));
                let timeout = frame.header.status == Status::Timeout as i32;
                (
                    remote_reply(&request, frame),
                    (no_data || timeout).then_some(now),
                )
            }
            Err(reason) => (
                refused(
                    &request,
                    Refusal::RemoteSilent {
                        remote: binx_proto::truncate(&remote, 64).to_string(),
                        task: key.task.clone(),
                        buffer: key.buffer,
                        reason,
                    },
                ),
                // None without a spool: nothing to fail over to.
                silent_since,
            ),
        };
        let Some(since) = failing else {
            if let Some(RemoteState::Failing { .. }) = self.remotes.states.get(&rkey) {
                self.remotes.states.remove(&rkey);
            }
            self.finish_proxy(ticket, reply, now);
            return;
        };
        let check = MarkerCheck {
            pinned: sent_to,
            ..MarkerCheck::default()
        };
        self.fail_over(ticket, &rkey, since, answered, reply, check, now);
    }

    /// A forwarded buffer request failing since `since`: its marker is
    /// read when that is due ([`Core::failover_due`]), `reply` answered
    /// otherwise (and when no marker is found; `absent` instead, when set
    /// and storage answered).
    #[allow(clippy::too_many_arguments)]
    fn fail_over(
        &mut self,
        ticket: Ticket,
        rkey: &RemoteKey,
        since: Instant,
        answered: bool,
        reply: Reply,
        check: MarkerCheck,
        now: Instant,
    ) {
        let restarted = self.restart_unchecked(rkey, answered, now);
        if self.failover_due(rkey, since, now, restarted.is_some()) {
            if let Some(at) = restarted {
                self.remotes
                    .restart_checked(rkey.clone(), at, self.config.max_tracked_remotes);
            }
            self.check_marker(ticket, rkey, reply, check, now);
            return;
        }
        self.finish_proxy(ticket, reply, now);
    }

    /// Reads the commit marker of `rkey`'s buffer for the parked proxy
    /// request `ticket` ([`Core::marker_read`]).
    fn check_marker(
        &mut self,
        ticket: Ticket,
        rkey: &RemoteKey,
        fallback: Reply,
        check: MarkerCheck,
        now: Instant,
    ) {
        if let Some(p) = self.parked.get_mut(&ticket) {
            p.state = ParkState::CheckingMarker {
                fallback,
                check: Box::new(check),
            };
        }
        self.new_op(
            OpKind::ReadMarker { ticket },
            Command::ReadMarker {
                task: rkey.1.clone(),
                buffer: rkey.2,
            },
        );
        self.after(now);
    }

    /// The forwarder withheld a request ([`Command::Forward`]'s
    /// `instance`): the remote answers as process `instance` now, not the
    /// one the buffer's pages came from, which went with the buffer (a
    /// restart). The new process is not asked: it may hold a task of the
    /// same id again (a producer that opened it anew), whose pages would
    /// join another run's, and whose pages a DATA would acknowledge (see
    /// `Core::another_process`).
    pub fn forward_withheld(&mut self, op: OpId, instance: Arc<str>, now: Instant) {
        let Some((ticket, remote, sent_to)) = self.take_forward(op) else {
            return;
        };
        // Its HELLO answered: the remote is not silent.
        self.silences.answered(&remote);
        let Some(ticket) = ticket else {
            return;
        };
        let Some(request) = self.parked.get(&ticket).map(|p| p.request.clone()) else {
            return;
        };
        let was = sent_to.unwrap_or_else(|| Arc::from("?"));
        self.another_process(ticket, &request, remote, was, instance, now);
    }

    /// Answers `request` for a buffer read from process `was` of `remote`
    /// when process `answering` answers there now (its request withheld,
    /// or its reply not used). A DATA fails over at once, as after a
    /// restart's NO_DATA: from the commit marker of `was` if storage has
    /// it; `SERVER_ERROR` naming both processes once storage says it has
    /// none; `TIMEOUT` (retry) while that is not known. A DELETE reads the
    /// marker too, so that output `was` committed is released, and is
    /// answered OK either way (the process is forgotten); an ACK is
    /// answered OK; a DELETE_TASK is refused as while a buffer fails over
    /// (the client deletes the buffers one at a time).
    fn another_process(
        &mut self,
        ticket: Ticket,
        request: &Request,
        remote: Arc<str>,
        was: Arc<str>,
        answering: Arc<str>,
        now: Instant,
    ) {
        let (task, buffer) = match &request.op {
            Op::DeleteTask { task, buffers } => {
                let buffer = self
                    .remotes
                    .task_read_from(&remote, task, *buffers)
                    .map_or(0, |(buffer, _)| buffer);
                let refusal = Refusal::DeleteTaskFailingOver {
                    task: task.clone(),
                    remote: remote.to_string(),
                    buffer,
                };
                self.finish_proxy(ticket, refused(request, refusal), now);
                return;
            }
            _ => match request.buffer_key() {
                Some(key) => (key.task.clone(), key.buffer),
                None => {
                    debug_assert!(false, "only buffer requests are forwarded");
                    return;
                }
            },
        };
        let rkey: RemoteKey = (remote.clone(), task.clone(), buffer);
        let ok = || Reply::new(request.reply(Status::Ok));
        let token = match &request.op {
            Op::Data(q) => q.token,
            Op::Delete { .. } if self.spool().is_some() => {
                // Always read: a DELETE comes once per buffer.
                let check = MarkerCheck {
                    pinned: Some(was),
                    forget: true,
                    ..MarkerCheck::default()
                };
                self.check_marker(ticket, &rkey, ok(), check, now);
                return;
            }
            op => {
                if matches!(op, Op::Delete { .. }) {
                    self.remotes.read_from.remove(&rkey);
                }
                self.finish_proxy(ticket, ok(), now);
                return;
            }
        };
        self.stats.forwarded_runs_refused += 1;
        tracing::info!(%task, buffer, token, %remote, %was, now = %answering, "the remote restarted after a buffer was read from it; not asking its new process, failing over");
        let pinned = was.clone();
        let (remote, was, answering) = (
            binx_proto::truncate(&remote, 64).to_string(),
            binx_proto::truncate(&was, 64).to_string(),
            binx_proto::truncate(&answering, 64).to_string(),
        );
        let absent = refused(
            request,
            Refusal::RemoteRunChanged {
                remote: remote.clone(),
                task: task.clone(),
                buffer,
                token,
                was: was.clone(),
                now: answering.clone(),
            },
        );
        if self.spool().is_none() {
            self.finish_proxy(ticket, absent, now);
            return;
        }
        // TIMEOUT, not NO_DATA, while the marker is not known: a client
        // asks again at once after NO_DATA (which a server gives only
        // after the request's wait), and backs off after TIMEOUT.
        let unknown = refused(
            request,
            Refusal::RemoteRestartedMarkerUnknown {
                remote,
                task,
                buffer,
                token,
                was,
                now: answering,
            },
        );
        let check = MarkerCheck {
            absent: Some(absent),
            pinned: Some(pinned),
            forget: false,
        };
        self.fail_over(ticket, &rkey, now, true, unknown, check, now);
    }

    /// The process a forwarded buffer's OK DATA reply `frame` came from,
    /// `answering`, when the buffer was read from another (returned): a
    /// reply sent before the process was known, whose pages are another
    /// run's. Otherwise records `answering` as the buffer's process (a
    /// DELETE answered OK forgets it).
    fn read_from_another(
        &mut self,
        request: &Request,
        rkey: &RemoteKey,
        frame: &Frame<BinReply>,
        answering: &Arc<str>,
        now: Instant,
    ) -> Option<Arc<str>> {
        if frame.header.status != Status::Ok as i32 {
            return None;
        }
        match &request.op {
            Op::Data(_) => self
                .remotes
                .read_from(rkey, answering, now, self.config.max_tracked_remotes)
                .err(),
            Op::Delete { .. } => {
                self.remotes.read_from.remove(rkey);
                None
            }
            _ => None,
        }
    }

    pub(super) fn finish_proxy(&mut self, ticket: Ticket, reply: Reply, now: Instant) {
        if let Some(parked) = self.unpark(ticket) {
            self.emit(ticket, parked.request.kind(), Outcome::Reply(reply));
        }
        self.after(now);
    }

    /// Records a failure to serve a buffer, failing since `since` (now, or
    /// earlier when its remote has been silent that long); true when
    /// storage should be asked for its commit marker now (the failure has
    /// lasted `failover_after` and storage was not asked in that time).
    /// Whether the marker found may be served is decided when it is read:
    /// only for the remote that wrote it, so when storage is asked changes
    /// what it costs, never what is served.
    /// `early`: due now, whatever since when it fails, unless storage was
    /// asked in the last `failover_after` (its remote was seen to restart).
    pub(super) fn failover_due(
        &mut self,
        rkey: &RemoteKey,
        since: Instant,
        now: Instant,
        early: bool,
    ) -> bool {
        let Some(every) = self.spool().map(|s| s.failover_after) else {
            return false;
        };
        if !self.remotes.states.contains_key(rkey)
            && !self
                .remotes
                .make_room(self.config.max_tracked_remotes, now, every * 10)
        {
            return false;
        }
        let state = self
            .remotes
            .states
            .entry(rkey.clone())
            .or_insert(RemoteState::Failing {
                since,
                checked: None,
            });
        if let RemoteState::Failing { since: first, .. } = state {
            *first = (*first).min(since);
        }
        match state {
            RemoteState::Lost { .. } | RemoteState::Released { .. } => false,
            RemoteState::Failing { since, .. }
                if !early && now.saturating_duration_since(*since) < every =>
            {
                false
            }
            RemoteState::Failing {
                checked: Some(at), ..
            } if now.saturating_duration_since(*at) < every => false,
            RemoteState::Failing { checked, .. } => {
                *checked = Some(now);
                true
            }
        }
    }

    /// The remote at `remote` said (in its HELLO reply) it is node `node`.
    pub fn remote_identified(&mut self, remote: &str, node: String) {
        self.remotes
            .identify(remote, node, self.config.max_tracked_remotes);
    }

    /// The remote at `remote` answered over a connection whose HELLO reply
    /// named process `instance` (new at every start of a binxd): seen
    /// to change, the remote restarted, and a buffer it cannot serve from
    /// then on is due for its commit marker at once.
    pub fn remote_instance(&mut self, remote: &str, instance: Arc<str>, now: Instant) {
        if self
            .remotes
            .instance_changed(remote, &instance, self.config.max_tracked_remotes)
            && self
                .silences
                .instance_seen(&Arc::from(remote), &instance, now)
        {
            tracing::info!(%remote, %instance, "a remote restarted; the buffers its earlier process held fail over to storage at once");
            self.stats.remote_restarts += 1;
        }
    }

    /// When the remote of a buffer it answered it cannot serve (`answered`:
    /// NO_DATA or TIMEOUT, not silence) was seen to restart, if that was in
    /// the last `SILENCE_GAP_FACTOR` failover_afters and the buffer's
    /// marker was not read at once for that restart yet. Its earlier
    /// process is gone with every buffer it held, so a committed one is
    /// read from storage at once instead of after a `failover_after` of its
    /// own; once per buffer and restart, since a live buffer of the new
    /// process (no marker) answers NO_DATA between its pages.
    fn restart_unchecked(&self, rkey: &RemoteKey, answered: bool, now: Instant) -> Option<Instant> {
        if !answered {
            return None;
        }
        let every = self.spool().map(|s| s.failover_after)?;
        let at = self.silences.restarted(&rkey.0)?;
        (now.saturating_duration_since(at) <= every * SILENCE_GAP_FACTOR
            && self.remotes.restart_unchecked(rkey, at))
        .then_some(at)
    }

    /// A commit marker read finished (failover).
    pub fn marker_read(
        &mut self,
        op: OpId,
        result: Result<Option<CommitMarker>, StoreFailure>,
        now: Instant,
    ) {
        let ticket = match self.ops.remove(&op) {
            Some(OpKind::ReadMarker { ticket }) => ticket,
            Some(OpKind::ForgottenMarker { key }) => {
                self.forgotten_marker_read(key, result);
                self.start_forgotten_lookups(now);
                self.after(now);
                return;
            }
            _ => return,
        };
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        let request = parked.request.clone();
        let remote: Arc<str> = Arc::from(request.remote.clone().unwrap_or_default());
        let Some(key) = request.buffer_key().cloned() else {
            debug_assert!(false, "only DATA, ACK and DELETE are forwarded");
            return;
        };
        let rkey: RemoteKey = (remote.clone(), key.task.clone(), key.buffer);
        let answered = result.is_ok();
        // The process the buffer was read from, if it was (as the request
        // was sent, else as recorded now): only its marker continues it (a
        // task id opened again after a restart writes its marker at the
        // same path, under the same node and address).
        let pinned = match &parked.state {
            ParkState::CheckingMarker { check, .. } => check.pinned.clone(),
            _ => None,
        };
        let read_from =
            pinned.or_else(|| self.remotes.read_from.get(&rkey).map(|(i, _)| i.clone()));
        let marker = match result {
            Ok(Some(marker))
                if marker.task_id == key.task.as_str()
                    && marker.buffer_id == key.buffer
                    && (marker.endpoint == *remote
                        || self.remotes.vouches(&remote, &marker.node))
                    && read_from
                        .as_deref()
                        .is_none_or(|p| marker.instance.as_deref() == Some(p)) =>
            {
                Some(Arc::new(marker))
            }
            Ok(Some(marker)) => {
                tracing::warn!(task = %key.task, buffer = key.buffer, remote = %remote, writer = %marker.node, endpoint = %marker.endpoint, instance = ?marker.instance, read_from = ?read_from, "a commit marker was not written by the remote named, or by the process the buffer was read from; not serving it");
                None
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(task = %key.task, buffer = key.buffer, error = %e, transient = e.transient, "cannot read a commit marker for failover");
                None
            }
        };
        let Some(marker) = marker else {
            let (fallback, forget) = match self.parked.get_mut(&ticket).map(|p| &mut p.state) {
                Some(ParkState::CheckingMarker { fallback, check }) => {
                    let reply = match check.absent.take() {
                        Some(absent) if answered => absent,
                        _ => std::mem::replace(fallback, Reply::new(BinReply::default())),
                    };
                    (reply, check.forget)
                }
                _ => return,
            };
            if forget {
                self.remotes.read_from.remove(&rkey);
            }
            self.finish_proxy(ticket, fallback, now);
            return;
        };
        tracing::info!(task = %key.task, buffer = key.buffer, %remote, "producer lost a committed buffer; reading the committed buffer from storage");
        // The pages served from now on are that process's run: once storage
        // is left (an object read failed, the state expired), the rest is
        // asked only of it, and a marker read again must be its own (a task
        // id opened again after a restart commits at the same path).
        if read_from.is_none()
            && let Some(instance) = marker.instance.as_deref()
        {
            let _ = self.remotes.read_from(
                &rkey,
                &Arc::from(instance),
                now,
                self.config.max_tracked_remotes,
            );
        }
        self.remotes.states.insert(
            rkey.clone(),
            RemoteState::Lost {
                marker: marker.clone(),
                used: now,
            },
        );
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let outcome = self.serve_lost(ticket, &parked.request, &rkey, marker, now);
        if let Outcome::Reply(r) = &outcome {
            self.count_reply(parked.request.kind(), r.header.status);
        }
        self.events.push_back(Event::Outcome { ticket, outcome });
        self.after(now);
    }

    /// A committed buffer was released from storage (failover DELETE).
    pub fn released(&mut self, op: OpId, now: Instant) {
        self.ops.remove(&op);
        self.after(now);
    }
}

/// The remote's reply to a forwarded request, as the local client's.
fn remote_reply(request: &Request, frame: Frame<BinReply>) -> Reply {
    let mut header = frame.header;
    header.request_id = request.id;
    Reply {
        header,
        body: if frame.body.is_empty() {
            Vec::new()
        } else {
            vec![frame.body]
        },
    }
}

/// A forward's parked request (none when nobody waits for it), its remote,
/// and the process it was sent to ([`Core::take_forward`]).
type EndedForward = (Option<Ticket>, Arc<str>, Option<Arc<str>>);
