//! Consumers: engines reading buffers with the real consumer machine
//! (`SourceMachine`), locally or through a proxy, and checking each page.

use super::*;

impl World {
    pub(super) fn consumer_tick(&mut self, c: usize) -> Check {
        let cs = &mut self.consumers[c];
        if !matches!(cs.state, ConsumerState::Waiting | ConsumerState::Running) {
            return Ok(());
        }
        if self.sides[cs.side].core.is_none() {
            cs.state = ConsumerState::Dead;
            return Ok(());
        }
        cs.state = ConsumerState::Running;
        if let Some((at, pause)) = cs.stall
            && !cs.stalled
            && cs.machine.token() >= at
        {
            cs.stalled = true;
            let (task, buffer) = (cs.task, cs.buffer);
            self.after(pause, Ev::Tick(Actor::Consumer(c)));
            self.note(|| {
                format!("consumer of buffer {buffer} of task {task} stalls for {pause:?}")
            });
            return Ok(());
        }
        let side = cs.side;
        let epoch = cs.epoch;
        if let Some(at) = cs.delete_at
            && cs.machine.token() >= at
        {
            let mut r = BinRequest::new(MessageType::Delete);
            r.task_id = self.producers[cs.task].task_id.clone();
            r.buffer_id = cs.buffer;
            r.remote = cs.machine.config().remote.clone().unwrap_or_default();
            cs.next_id += 1;
            r.request_id = cs.next_id;
            cs.in_flight.insert(r.request_id, r.clone());
            cs.state = ConsumerState::Stopped;
            self.send(Actor::Consumer(c), side, r, Bytes::new(), epoch);
            return Ok(());
        }
        // As many requests as the machine wants in flight (more than one
        // only while it pipelines DATA).
        loop {
            let cs = &mut self.consumers[c];
            match cs.machine.poll(cs.held) {
                PullStep::Send(mut r) => {
                    if cs.in_flight.len() > 8 {
                        return Err(format!(
                            "consumer of buffer {} keeps more than 8 requests in flight",
                            cs.buffer
                        ));
                    }
                    cs.next_id += 1;
                    r.request_id = cs.next_id;
                    cs.in_flight.insert(r.request_id, (*r).clone());
                    if cs.machine.data_in_flight() > 1 {
                        self.pipelined_data += 1;
                    }
                    self.send(Actor::Consumer(c), side, *r, Bytes::new(), epoch);
                }
                PullStep::WaitForConsumer | PullStep::AwaitReply => break,
                PullStep::Done => {
                    cs.state = ConsumerState::Done;
                    break;
                }
            }
        }
        Ok(())
    }

    pub(super) fn consumer_reply(&mut self, c: usize, epoch: u64, reply: Option<Reply>) -> Check {
        let cs = &mut self.consumers[c];
        if cs.epoch != epoch {
            return Ok(());
        }
        let Some(reply) = reply else {
            // The connection went with its sidecar.
            if cs.state != ConsumerState::Stopped && !cs.in_flight.is_empty() {
                cs.in_flight.clear();
                cs.state = ConsumerState::Dead;
            }
            return Ok(());
        };
        let Some(request) = cs.in_flight.remove(&reply.header.request_id) else {
            return Ok(());
        };
        if cs.state == ConsumerState::Stopped {
            if request.r#type == MessageType::Delete as i32
                && reply.header.status_kind() == Status::Ok
            {
                if cs.hostile {
                    return Err(format!(
                        "a local client naming an unreachable remote deleted buffer {} of task {}",
                        cs.buffer, self.producers[cs.task].task_id
                    ));
                }
                cs.deleted = true;
            }
            return Ok(());
        }
        let pid = cs.task;
        let status = reply.header.status_kind();
        let what = format!(
            "consumer of buffer {} of task {} (token {})",
            cs.buffer,
            self.producers[pid].task_id,
            cs.machine.token()
        );
        match status {
            Status::Ok | Status::NoData if cs.hostile => {
                return Err(format!(
                    "{what}, naming an unreachable remote, got {} for {:?}",
                    status.name(),
                    request.message_type()
                ));
            }
            _ if !cs.machine.awaits(&request) => {
                // A pipelined DATA past a reply that ended elsewhere, or one
                // that came before the replies ahead of it: dropped, and
                // refusals of it are no failure (its token may have been
                // acknowledged meanwhile).
                cs.machine
                    .on_reply(&request, None)
                    .map_err(|e| format!("{what}: {e}"))?;
                self.dropped_replies += 1;
                self.after(MS, Ev::Tick(Actor::Consumer(c)));
            }
            Status::Ok | Status::NoData => {
                cs.error_since = None;
                let body = Bytes::from(reply.body.concat());
                let parts = cs
                    .machine
                    .on_reply(&request, Some((&reply.header, body.len())))
                    .map_err(|e| {
                        format!("{what} got a reply that does not continue its buffer: {e}")
                    })?;
                if cs.machine.replies_past_listed() > 0 {
                    // Section 10: replies to listed pages end where their
                    // sizes say, whether the pages are still in memory or
                    // were spilled since they were listed.
                    return Err(format!(
                        "{what} got a reply to DATA at {} (asked {} bytes; {} bytes inline) with pages {}..{}, more than the sizes listed for it",
                        request.page_token,
                        request.max_size_bytes,
                        body.len(),
                        reply.header.page_token,
                        reply.header.page_next_token
                    ));
                }
                if request.get_data_size
                    && reply.header.buffer_complete
                    && reply.header.remaining_bytes.is_empty()
                {
                    cs.completed = true;
                    self.check_complete(c)?;
                }
                if request.r#type == MessageType::Data as i32 && !request.get_data_size {
                    let mut pages: Vec<(u64, Bytes)> = Vec::new();
                    for part in parts {
                        match part {
                            ReplyPart::Inline {
                                first_token,
                                offset,
                                sizes,
                            } => {
                                let mut at = offset;
                                for (i, size) in sizes.iter().enumerate() {
                                    let end = at + *size as usize;
                                    pages.push((first_token + i as u64, body.slice(at..end)));
                                    at = end;
                                }
                            }
                            ReplyPart::Spooled {
                                first_token,
                                segment,
                            } => {
                                let Some(segment::Body::Spooled(spooled)) = &segment.body else {
                                    return Err(format!("{what}: a spooled part without a body"));
                                };
                                let name = spooled.uri.trim_start_matches("sim://");
                                let Some(object) = self.store.objects.get(name) else {
                                    // Gone between the reply and the fetch (its
                                    // task ended meanwhile): as binx-client does,
                                    // ask again at the same token; the sidecar
                                    // says why, or serves it again.
                                    let token = request.page_token;
                                    let cs = &mut self.consumers[c];
                                    cs.machine.retry_pages(token);
                                    let delay = Duration::from_millis(self.rng.u64(10..500));
                                    self.after(delay, Ev::Tick(Actor::Consumer(c)));
                                    return Ok(());
                                };
                                for (i, p) in object.pages.iter().enumerate() {
                                    pages.push((first_token + i as u64, p.clone()));
                                }
                            }
                        }
                    }
                    for (token, data) in pages {
                        self.check_page(c, token, &data)?;
                    }
                    if reply.header.buffer_complete {
                        let cs = &mut self.consumers[c];
                        cs.completed = true;
                        self.check_complete(c)?;
                    }
                }
                let cs = &mut self.consumers[c];
                if cs.held > 0 {
                    let slow = c.is_multiple_of(3);
                    let delay =
                        Duration::from_millis(self.rng.u64(0..if slow { 2_000 } else { 200 }));
                    self.after(delay, Ev::Consumed(c));
                }
                self.after(MS, Ev::Tick(Actor::Consumer(c)));
            }
            Status::Busy | Status::Timeout => {
                cs.machine.on_reply(&request, None).ok();
                let since = *cs.error_since.get_or_insert(self.now);
                if self.now - since > GIVE_UP {
                    cs.state = ConsumerState::Failed(format!("gave up: {}", reply.header.error));
                    return Ok(());
                }
                let delay = Duration::from_millis(self.rng.u64(50..1_000));
                self.after(delay, Ev::Tick(Actor::Consumer(c)));
            }
            _ if cs.machine.tolerates_refusal(&request) => {
                // Asked past the next page on the word of following_sizes,
                // and refused: asked again once that page came.
                cs.machine
                    .on_reply(&request, None)
                    .map_err(|e| format!("{what}: {e}"))?;
                self.dropped_replies += 1;
                self.after(MS, Ev::Tick(Actor::Consumer(c)));
            }
            Status::ServerError => {
                let error = reply.header.error.clone();
                let producer = &self.producers[pid];
                let task = task_id(&producer.task_id);
                let buffer = cs.buffer;
                // The reasons a consumer may be failed for, as the core
                // words them.
                let reasons = [
                    producer.aborted.then(|| Refusal::Aborted {
                        task: task.clone(),
                        reason: ABORT_REASON.into(),
                    }),
                    Some(Refusal::TaskAbandoned { task: task.clone() }),
                    Some(Refusal::BufferAbandoned {
                        task,
                        buffer,
                        after: self.params.abandon_after,
                    }),
                ];
                // Read through a proxy from a producer whose sidecar
                // crashed before the buffer was committed: the sidecar's
                // new process is not asked, and storage has no marker.
                let ps = producer.side;
                let lives = self.sides[ps].life;
                let lost = cs.machine.config().remote.is_some()
                    && producer.dead
                    && self.store.marker(&producer.task_id, buffer).is_none()
                    && (0..lives).any(|was| {
                        (was + 1..=lives).any(|now| {
                            Refusal::RemoteRunChanged {
                                remote: self.sides[ps].addr.clone(),
                                task: task_id(&producer.task_id),
                                buffer,
                                token: request.page_token,
                                was: format!("{ps}.{was}"),
                                now: format!("{ps}.{now}"),
                            }
                            .is(reply.header.status, &error)
                        })
                    });
                if lost {
                    self.runs_refused += 1;
                }
                let explained = lost
                    || reasons
                        .iter()
                        .flatten()
                        .any(|r| r.is(reply.header.status, &error));
                if !explained {
                    return Err(format!(
                        "{what} failed with an error that names no reason it could have: {error}"
                    ));
                }
                if cs.completed {
                    return Err(format!("{what} failed after its buffer completed: {error}"));
                }
                cs.state = ConsumerState::Failed(error);
            }
            Status::BadRequest
                if self.producers[pid].kind == BufferKind::Broadcast
                    && !self.producers[pid].fixed
                    && [
                        Refusal::NotInClosedBroadcastSet {
                            task: task_id(&self.producers[pid].task_id),
                            buffer: cs.buffer,
                        },
                        Refusal::NotInFinishedBroadcastSet {
                            task: task_id(&self.producers[pid].task_id),
                            buffer: cs.buffer,
                        },
                    ]
                    .iter()
                    .any(|r| r.is(reply.header.status, &reply.header.error)) =>
            {
                // A late consumer of an open-ended broadcast set is told so.
                cs.state = ConsumerState::Failed(reply.header.error.clone());
            }
            other => {
                return Err(format!(
                    "{what} got {} to {:?}: {}",
                    other.name(),
                    request.message_type(),
                    reply.header.error
                ));
            }
        }
        Ok(())
    }
}
