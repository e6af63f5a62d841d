//! Producers: engines writing tasks through their local sidecar, with
//! pipelining, numbered appends, lost connections and aborts.

use super::*;

impl World {
    pub(super) fn send(
        &mut self,
        actor: Actor,
        side: usize,
        raw: BinRequest,
        body: Bytes,
        epoch: u64,
    ) {
        if let Actor::Consumer(c) = actor
            && raw.r#type == MessageType::Delete as i32
            && !self.consumers[c].hostile
        {
            self.store
                .deleted_by_consumers
                .insert((raw.task_id.clone(), raw.buffer_id));
        }
        if let Actor::Deleter(d) = actor
            && raw.r#type == MessageType::DeleteTask as i32
            && !self.deleters[d].too_wide_in_flight
        {
            for buffer in 0..raw.buffer_count {
                self.store
                    .deleted_by_consumers
                    .insert((raw.task_id.clone(), buffer));
            }
        }
        let life = self.sides[side].life;
        let conn = match actor {
            Actor::Producer(p) => producer_conn(p, epoch),
            Actor::Consumer(c) => ConnId(c as u64 * 2 + 2 + 10_000),
            Actor::Deleter(d) => ConnId(d as u64 + (1 << 48)),
        };
        let arrive = match self.burst_at {
            Some(at) => at,
            None => self.now + self.latency(),
        };
        // One connection delivers in order; a striped consumer's requests
        // may take any of several, so each arrives when its latency says.
        let last = self.links.get(&(actor, side)).copied().unwrap_or_default();
        let at = if self.params.striped && matches!(actor, Actor::Consumer(_)) {
            if arrive < last {
                self.overtaken += 1;
            }
            arrive
        } else {
            arrive.max(last + Duration::from_micros(1))
        };
        self.links.insert((actor, side), at.max(last));
        self.push(
            at,
            Ev::Request {
                side,
                life,
                conn,
                waiter: Waiter::Actor(actor, epoch),
                raw: Box::new(raw),
                body,
                door: Door::Local,
            },
        );
    }

    pub(super) fn producer_request(
        &mut self,
        p: usize,
        kind: MessageType,
        what: ProducerReq,
    ) -> BinRequest {
        let pr = &mut self.producers[p];
        pr.next_id += 1;
        let mut r = BinRequest::new(kind);
        r.request_id = pr.next_id;
        r.task_id = pr.task_id.clone();
        pr.in_flight.insert(pr.next_id, what);
        pr.sent.insert(pr.next_id, what);
        r
    }

    pub(super) fn producer_tick(&mut self, p: usize) -> Check {
        let pr = &self.producers[p];
        if pr.dead
            || pr.aborted
            || pr.dropped
            || (pr.nmp_ok && !pr.lost)
            || self.now < pr.backoff_until
        {
            return Ok(());
        }
        let side = pr.side;
        if self.sides[side].core.is_none() {
            self.producers[p].dead = true;
            return Ok(());
        }
        let epoch = pr.epoch;
        if !pr.opened {
            if !pr.open_in_flight {
                let (kind, buffers, policy) = (pr.kind, pr.buffers, pr.policy);
                let mut r = self.producer_request(p, MessageType::OpenTask, ProducerReq::Open);
                r.buffer_kind = kind as i32;
                r.buffer_count = if self.producers[p].fixed { buffers } else { 0 };
                r.spool_policy = policy.to_string();
                self.producers[p].open_in_flight = true;
                self.send(Actor::Producer(p), side, r, Bytes::new(), epoch);
            }
            return Ok(());
        }
        // What to send again: BUSY batches, and, for a producer that
        // numbers its appends, those a lost connection left unknown (the
        // numbers make a second copy of an applied one a refusal).
        let numbered = pr.numbered;
        let again = |s: BatchState| s == BatchState::Busy || (numbered && s == BatchState::Unknown);
        if pr.states.iter().any(|&s| again(s)) {
            // Resend from the first of them once nothing is in flight.
            if pr.in_flight.is_empty() {
                let pr = &mut self.producers[p];
                for s in &mut pr.states {
                    if again(*s) {
                        *s = BatchState::Unsent;
                    }
                }
            } else {
                return Ok(());
            }
        }
        let pr = &self.producers[p];
        let sent_ok = pr.states.iter().filter(|s| **s == BatchState::Ok).count();
        let gave_up = pr
            .busy_since
            .is_some_and(|since| self.now - since > GIVE_UP);
        if (pr.abort_after.is_some_and(|after| sent_ok >= after) || gave_up || pr.lost)
            && !pr.aborted
        {
            let mut r = self.producer_request(p, MessageType::AbortTask, ProducerReq::Abort);
            r.reason = ABORT_REASON.into();
            self.producers[p].aborted = true;
            self.note(|| format!("producer {p} aborts"));
            self.send(Actor::Producer(p), side, r, Bytes::new(), epoch);
            return Ok(());
        }
        let in_flight = pr
            .states
            .iter()
            .filter(|s| **s == BatchState::InFlight)
            .count();
        // The next unsent batches, in order, as many as the window allows
        // (a pipelining producer sends them all).
        let room = if pr.pipelined {
            usize::MAX
        } else {
            pr.window.saturating_sub(in_flight)
        };
        // One that does not number its appends keeps at most one ENQUEUE
        // of a buffer in flight (docs/PROTOCOL.md, numbered appends).
        let key = |i: usize| {
            if pr.kind == BufferKind::Partitioned {
                pr.batches[i].buffer
            } else {
                u64::MAX
            }
        };
        let mut busy_keys: BTreeSet<u64> = (0..pr.states.len())
            .filter(|&i| pr.states[i] == BatchState::InFlight)
            .map(key)
            .collect();
        let to_send: Vec<usize> = match pr.states.iter().position(|s| *s == BatchState::Unsent) {
            Some(first) => (first..pr.states.len())
                .take_while(|&i| {
                    pr.states[i] == BatchState::Unsent && (pr.numbered || busy_keys.insert(key(i)))
                })
                .take(room)
                .collect(),
            None => Vec::new(),
        };
        let sent_now = to_send.len();
        if pr.pipelined && sent_now > 0 {
            let at = self.now + self.latency();
            self.burst_at = Some(at);
        }
        for i in to_send {
            let pr = &self.producers[p];
            let batch = &pr.batches[i];
            let (task, kind, buffer) = (pr.task, pr.kind, batch.buffer);
            let bodies: Vec<Bytes> = batch
                .sizes
                .iter()
                .enumerate()
                .map(|(j, &size)| {
                    let b = if kind == BufferKind::Partitioned {
                        buffer as u32
                    } else {
                        u32::MAX
                    };
                    page(task, b, batch.first_seq + j as u64, size)
                })
                .collect();
            let sizes: Vec<u64> = bodies.iter().map(|b| b.len() as u64).collect();
            // A pipelining producer waits long enough that all it sent at
            // once is queued before the first can time out (one sent after
            // a BUSY reply was written would be applied: PROTOCOL.md).
            let wait = if pr.pipelined {
                self.rng.u64(1_000_000..6_000_000)
            } else {
                self.rng.u64(0..3_000_000)
            };
            let first_seq = batch.first_seq;
            let numbered = pr.numbered;
            let mut r = self.producer_request(p, MessageType::Enqueue, ProducerReq::Batch(i));
            r.buffer_id = buffer;
            r.page_sizes = sizes;
            r.max_wait_micros = wait;
            // A batch's first page is its first sequence number's token.
            r.append_token = numbered.then_some(first_seq);
            self.producers[p].states[i] = BatchState::InFlight;
            self.send(
                Actor::Producer(p),
                side,
                r,
                Bytes::from(bodies.concat()),
                epoch,
            );
        }
        let pr = &self.producers[p];
        // A pipelining producer of a BROADCAST or ARBITRARY task sends
        // NO_MORE_PAGES right behind the ENQUEUEs it just sent, unanswered,
        // naming the token the task ends at: it takes effect only after all
        // of them, however their replies go. (A PARTITIONED task's buffers
        // end at tokens of their own, which one NO_MORE_PAGES cannot name:
        // its producer waits for every OK.)
        let ends_at = (pr.numbered && pr.kind != BufferKind::Partitioned)
            .then(|| pr.batches.iter().map(|b| b.sizes.len() as u64).sum::<u64>());
        let burst = pr.pipelined
            && ends_at.is_some()
            && sent_now > 0
            && in_flight == 0
            && pr
                .states
                .iter()
                .all(|s| matches!(s, BatchState::Ok | BatchState::InFlight));
        if (burst || pr.states.iter().all(|s| *s == BatchState::Ok)) && !pr.nmp_in_flight {
            let mut counts = BTreeMap::new();
            for b in &pr.batches {
                let key = if pr.kind == BufferKind::Partitioned {
                    b.buffer
                } else {
                    u64::MAX
                };
                *counts.entry(key).or_insert(0) += b.sizes.len() as u64;
            }
            let mut r =
                self.producer_request(p, MessageType::NoMorePages, ProducerReq::NoMorePages);
            r.buffer_id = ALL_BUFFERS;
            r.append_token = ends_at;
            let pr = &mut self.producers[p];
            pr.final_counts = counts;
            pr.nmp_sent = true;
            pr.nmp_in_flight = true;
            self.send(Actor::Producer(p), side, r, Bytes::new(), epoch);
        }
        self.burst_at = None;
        let pr = &mut self.producers[p];
        if pr.closes_left > 0 && !pr.close_pending && !pr.in_flight.is_empty() {
            // The connection may go while what was just sent waits.
            pr.close_pending = true;
            let delay = Duration::from_millis(self.chaos.u64(0..1_500));
            self.after(delay, Ev::CloseProducer { p, epoch });
        }
        Ok(())
    }

    /// A producer that finished (or aborted) closes its connection: from
    /// then on its task's abandon clock runs.
    pub(super) fn producer_done(&mut self, p: usize) {
        let pr = &self.producers[p];
        let (side, conn) = (pr.side, producer_conn(p, pr.epoch));
        let life = self.sides[side].life;
        let at = self.now + self.latency();
        self.push(at, Ev::ConnClosed { side, life, conn });
    }

    /// The producer's connection closes (the producer crashed and came
    /// back, or the connection dropped) if requests wait on it; the
    /// producer reconnects knowing only the replies it saw.
    pub(super) fn producer_close(&mut self, p: usize, epoch: u64) -> Check {
        let pr = &mut self.producers[p];
        if pr.epoch != epoch || pr.dead || pr.aborted || pr.dropped || pr.closes_left == 0 {
            pr.close_pending = false;
            return Ok(());
        }
        let side = pr.side;
        let conn = producer_conn(p, epoch);
        let waiting: Vec<Ticket> = self.sides[side]
            .mutations
            .iter()
            .filter(|(_, (q, c, _))| *q == p && *c == conn)
            .map(|(&t, _)| t)
            .collect();
        if waiting.is_empty() || self.sides[side].core.is_none() {
            // Nothing waits (yet): look again while requests are out.
            if self.producers[p].in_flight.is_empty() || self.sides[side].core.is_none() {
                self.producers[p].close_pending = false;
            } else {
                let delay = Duration::from_millis(self.chaos.u64(5..300));
                self.after(delay, Ev::CloseProducer { p, epoch });
            }
            return Ok(());
        }
        self.closes += 1;
        // The producer: a new connection, and every request it saw no reply
        // to is of unknown fate.
        let delay = Duration::from_millis(self.chaos.u64(1..500));
        let pr = &mut self.producers[p];
        pr.closes_left -= 1;
        pr.close_pending = false;
        pr.epoch += 1;
        for (_, what) in std::mem::take(&mut pr.in_flight) {
            match what {
                ProducerReq::Batch(i) => {
                    pr.states[i] = BatchState::Unknown;
                    // Numbered, it resends and learns from the reply.
                    pr.lost |= !pr.numbered;
                }
                // NO_MORE_PAGES again is exact (a repeated one is OK).
                ProducerReq::NoMorePages => pr.nmp_in_flight = false,
                ProducerReq::Open => pr.open_in_flight = false,
                ProducerReq::Abort => {}
            }
        }
        pr.backoff_until = self.now + delay;
        let lost = pr.lost;
        self.after(delay + MS, Ev::Tick(Actor::Producer(p)));
        // binxd: what it does as the connection goes.
        let life = self.sides[side].life;
        let how = self.chaos.usize(0..3);
        let what = [
            "reset",
            "closed after its last frames",
            "dropped request by request",
        ][how];
        self.note(|| {
            format!(
                "producer {p}'s connection {conn:?} goes ({what}) with {} waiting; it {}",
                waiting.len(),
                if lost {
                    "will abort"
                } else {
                    "will carry on, resending what it has no reply to"
                }
            )
        });
        match how {
            0 => {
                // Reset: frames still travelling are lost.
                self.unread.insert(conn);
                self.step(Ev::ConnClosed { side, life, conn })?;
            }
            1 => {
                // The client closed: binxd reads the frames sent before.
                let last = self
                    .links
                    .get(&(Actor::Producer(p), side))
                    .copied()
                    .unwrap_or_default();
                let at = last.max(self.now) + self.latency();
                self.push(at, Ev::ConnClosed { side, life, conn });
            }
            _ => {
                // The request futures are dropped one by one, in any order
                // (some maybe not before the connection is seen closed).
                self.unread.insert(conn);
                self.note_cut(side, conn);
                let mut tickets = waiting;
                self.chaos.shuffle(&mut tickets);
                let keep = self.chaos.usize(0..tickets.len());
                tickets.truncate(tickets.len() - keep);
                let mut at = self.now;
                for ticket in tickets {
                    at += Duration::from_micros(self.chaos.u64(0..20_000));
                    self.push(at, Ev::Cancel { side, life, ticket });
                }
                at += Duration::from_micros(self.chaos.u64(0..20_000));
                self.push(at, Ev::ConnClosed { side, life, conn });
            }
        }
        Ok(())
    }

    pub(super) fn producer_reply(&mut self, p: usize, epoch: u64, reply: Option<Reply>) -> Check {
        if self.producers[p].epoch != epoch || self.producers[p].dead {
            return Ok(());
        }
        let Some(reply) = reply else {
            self.producers[p].dead = true;
            return Ok(());
        };
        let id = reply.header.request_id;
        let Some(what) = self.producers[p].in_flight.remove(&id) else {
            return Err(format!(
                "producer {p} got a reply to request {id}, which it did not send or already had"
            ));
        };
        let status = reply.header.status_kind();
        let pr = &mut self.producers[p];
        match (what, status) {
            (ProducerReq::Open, Status::Ok) => {
                pr.opened = true;
                pr.open_in_flight = false;
            }
            (ProducerReq::Open, Status::ServerError) if self.sides[pr.side].draining => {
                // A draining sidecar takes no new task: this producer gives up.
                pr.dead = true;
            }
            (ProducerReq::Open, _) => {
                pr.open_in_flight = false;
                pr.backoff_until = self.now + 100 * MS;
            }
            (ProducerReq::Batch(i), Status::Ok) => {
                pr.busy_since = None;
                pr.states[i] = BatchState::Ok;
            }
            (ProducerReq::Batch(i), Status::Busy) => {
                pr.busy_since.get_or_insert(self.now);
                pr.states[i] = BatchState::Busy;
                pr.backoff_until = self.now + Duration::from_millis(50);
            }
            (ProducerReq::Batch(i), Status::BadRequest)
                if pr.numbered && reply.header.page_next_token != reply.header.page_token =>
            {
                // Its append_token was not the buffer's next token N.
                let (first, count) = (pr.batches[i].first_seq, pr.batches[i].sizes.len() as u64);
                let next = reply.header.page_next_token;
                if reply.header.page_token != first {
                    return Err(format!(
                        "producer {p}: the refusal of ENQUEUE {i} names token {}, not its append_token {first}",
                        reply.header.page_token
                    ));
                }
                if next >= first + count {
                    // An earlier copy of it was applied (its pages are
                    // there: numbers name one batch).
                    pr.states[i] = BatchState::Ok;
                    if count == 0 {
                        pr.applied[i] = true;
                    }
                } else if next < first {
                    // Sent behind one that was not applied: again later.
                    pr.busy_since.get_or_insert(self.now);
                    pr.states[i] = BatchState::Busy;
                    pr.backoff_until = self.now + Duration::from_millis(50);
                } else {
                    return Err(format!(
                        "producer {p}: ENQUEUE {i} of tokens {first}..{} was refused with the buffer at token {next}, inside it: {}",
                        first + count,
                        reply.header.error
                    ));
                }
            }
            (ProducerReq::Batch(_), Status::ServerError) if pr.aborted => {}
            (ProducerReq::Batch(_) | ProducerReq::NoMorePages, Status::ServerError)
                if Refusal::ProducerOfDroppedTask {
                    what: match what {
                        ProducerReq::NoMorePages => Mutation::NoMorePages,
                        _ => Mutation::Enqueue,
                    },
                    task: task_id(&pr.task_id),
                    after: self.params.abandon_after,
                }
                .is(reply.header.status, &reply.header.error) =>
            {
                pr.dropped = true;
                self.producer_done(p);
                return Ok(());
            }
            (ProducerReq::Batch(i), other) => {
                return Err(format!(
                    "producer {p}: ENQUEUE {i} answered {}: {}",
                    other.name(),
                    reply.header.error
                ));
            }
            (ProducerReq::NoMorePages, Status::Ok) => {
                pr.nmp_ok = true;
                pr.nmp_in_flight = false;
                // Done: it closes its connection (an engine's sink does).
                if !pr.lost {
                    self.producer_done(p);
                }
            }
            (ProducerReq::NoMorePages, Status::Busy) => {
                pr.nmp_in_flight = false;
                pr.backoff_until = self.now + 100 * MS;
            }
            (ProducerReq::NoMorePages, Status::BadRequest)
                if pr.numbered && reply.header.page_next_token < reply.header.page_token =>
            {
                // Sent behind an ENQUEUE that was not applied: again once
                // every ENQUEUE is.
                pr.nmp_in_flight = false;
                pr.backoff_until = self.now + 100 * MS;
            }
            (ProducerReq::NoMorePages, Status::ServerError) if pr.aborted => {}
            (ProducerReq::NoMorePages, other) => {
                return Err(format!(
                    "producer {p}: NO_MORE_PAGES answered {}: {}",
                    other.name(),
                    reply.header.error
                ));
            }
            (ProducerReq::Abort, _) => self.producer_done(p),
        }
        let delay = self.producers[p].backoff_until.saturating_sub(self.now) + MS;
        self.after(delay, Ev::Tick(Actor::Producer(p)));
        Ok(())
    }
}
