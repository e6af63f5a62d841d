//! The network between actors and sidecars: requests through each
//! connection's door into a core, replies back, partitions, and what a
//! crashed sidecar's waiters learn.

use super::*;

impl World {
    pub(super) fn partitioned(&self, a: usize, b: usize) -> bool {
        self.partitions
            .iter()
            .any(|&(x, y, until)| self.now < until && ((x, y) == (a, b) || (x, y) == (b, a)))
    }

    /// `body` as binxd's reader hands it to the core: an allocation of its
    /// own (half the time), or a slice of the connection's receive buffer,
    /// which may hold other bodies too and be up to eight times its size
    /// (so the core keeps it, or copies the body out, by its own rules).
    /// A superset of what a real reader makes: its buffer also holds the
    /// frames' headers, so it never is exactly one body, nor holds two
    /// bodies that are each kept (half of it or more); both only charge more.
    fn received(&mut self, conn: ConnId, body: Bytes) -> Payload {
        let len = body.len() as u64;
        if len == 0 || self.receive.bool() {
            self.receive_buffers.remove(&conn);
            return Payload::exact(body);
        }
        let shared = match self.receive_buffers.get(&conn) {
            Some(&(id, capacity, used)) if used + len <= capacity && self.receive.bool() => {
                Some((id, capacity))
            }
            _ => None,
        };
        let (id, capacity) = shared.unwrap_or_else(|| {
            self.next_receive_buffer += 1;
            let capacity = match self.receive.usize(0..5) {
                0 => len,
                1 => len + len / 4,
                2 => 2 * len,
                3 => 3 * len,
                _ => (8 * len).max(64 << 10),
            };
            (self.next_receive_buffer, capacity)
        });
        let used = self
            .receive_buffers
            .get(&conn)
            .filter(|b| b.0 == id)
            .map_or(0, |b| b.2);
        self.receive_buffers
            .insert(conn, (id, capacity, used + len));
        Payload {
            bytes: body,
            chunk: Some((id, capacity)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn request(
        &mut self,
        side: usize,
        life: u32,
        conn: ConnId,
        waiter: Waiter,
        mut raw: BinRequest,
        body: Bytes,
        door: Door,
    ) -> Check {
        if self.sides[side].life != life || self.sides[side].core.is_none() {
            // The sidecar went while the request travelled.
            return self.lost(waiter);
        }
        if self.unread.contains(&conn) {
            // Its connection closed: binxd reads nothing after that (its
            // client learnt of the close on its own).
            self.note(|| format!("request on closed connection {conn:?} is not read"));
            return Ok(());
        }
        let s = &mut self.sides[side];
        let core = s.core.as_ref().expect("checked above");
        let facts = CoreFacts {
            memory_full: core.memory_full(),
            forwards: true,
            capabilities: &[],
        };
        let transport = match door {
            Door::Remote => Transport::Tcp,
            Door::Local => Transport::Uds,
        };
        let rules = door_config();
        let verdict = s
            .doors
            .entry(conn)
            .or_insert_with(|| ConnectionDoor::new(transport, 2, &rules, None))
            .check(&mut raw, &rules, &facts);
        let request = match verdict {
            Verdict::Submit(request) => request,
            Verdict::Reply(header) => {
                self.deliver(side, waiter, Reply::new(header));
                return Ok(());
            }
            Verdict::Close { reply, .. } => {
                self.unread.insert(conn);
                self.deliver(side, waiter, Reply::new(reply));
                return Ok(());
            }
        };
        let now = self.instant();
        let body_len = body.len() as u64;
        let body = self.received(conn, body);
        let s = &mut self.sides[side];
        s.next_ticket += 1;
        let ticket = Ticket(s.next_ticket);
        let core = s.core.as_mut().expect("checked above");
        let handled = core.handle(ticket, conn, request, body, now);
        let mutation = match &waiter {
            Waiter::Actor(Actor::Producer(p), _) => self.producers[*p]
                .sent
                .get(&raw.request_id)
                .copied()
                .filter(|w| matches!(w, ProducerReq::Batch(_) | ProducerReq::NoMorePages))
                .map(|w| (*p, w)),
            _ => None,
        };
        if let Some((p, what)) = mutation {
            match &handled {
                Handled::Reply(reply) => {
                    self.mutation_answered(p, what, reply.header.status_kind())?;
                }
                Handled::Pending => {
                    self.sides[side].mutations.insert(ticket, (p, conn, what));
                }
                Handled::Plan(_) => {}
            }
        }
        match handled {
            Handled::Reply(reply) => self.deliver(side, waiter, reply),
            Handled::Plan(plan) => {
                let delay = self.store_latency();
                self.after(
                    delay,
                    Ev::Plan {
                        side,
                        life,
                        waiter,
                        plan,
                    },
                );
            }
            Handled::Pending => {
                let s = &mut self.sides[side];
                s.waiters.insert(ticket, waiter);
                s.parked.insert(ticket, (conn, body_len));
                if let Some(door) = s.doors.get_mut(&conn) {
                    door.parked(body_len);
                }
            }
        }
        self.drain_core(side)
    }

    /// The process instance sidecar `side` names in its HELLO replies: new
    /// at every start, as binxd's `instance=`.
    pub(super) fn instance_of(&self, side: usize) -> Arc<str> {
        format!("{side}.{}", self.sides[side].life).into()
    }

    /// A request whose sidecar died: its waiter learns the connection is gone.
    pub(super) fn lost(&mut self, waiter: Waiter) -> Check {
        match waiter {
            Waiter::Actor(actor, epoch) => {
                let delay = self.latency();
                self.after(
                    delay,
                    Ev::Reply {
                        actor,
                        epoch,
                        reply: None,
                    },
                );
            }
            Waiter::Remote { from, life, op } => {
                let delay = Duration::from_millis(self.rng.u64(100..2_000));
                self.after(
                    delay,
                    Ev::Forwarded {
                        side: from,
                        life,
                        op,
                        result: Err("connection reset".into()),
                    },
                );
            }
        }
        Ok(())
    }

    pub(super) fn deliver(&mut self, side: usize, waiter: Waiter, reply: Reply) {
        match waiter {
            Waiter::Actor(actor, epoch) => {
                let delay = self.latency();
                self.after(
                    delay,
                    Ev::Reply {
                        actor,
                        epoch,
                        reply: Some(reply),
                    },
                );
            }
            Waiter::Remote { from, life, op } => {
                let lost =
                    self.partitioned(side, from) || self.rng.f64() < self.params.drop_forward;
                let node = self.sides[side].node.clone();
                let addr = self.sides[side].addr.clone();
                let instance = self.instance_of(side);
                if lost {
                    let delay = Duration::from_millis(self.rng.u64(1_000..8_000));
                    self.after(
                        delay,
                        Ev::Forwarded {
                            side: from,
                            life,
                            op,
                            result: Err("the reply was lost".into()),
                        },
                    );
                } else {
                    let delay = self.latency();
                    let frame = Frame {
                        header: reply.header,
                        body: Bytes::from(reply.body.concat()),
                    };
                    self.after(
                        delay,
                        Ev::Forwarded {
                            side: from,
                            life,
                            op,
                            result: Ok((frame, addr, node, instance)),
                        },
                    );
                }
            }
        }
    }

    /// Carries out what a sidecar's core asked for.
    pub(super) fn drain_core(&mut self, side: usize) -> Check {
        loop {
            let Some(core) = self.sides[side].core.as_mut() else {
                return Ok(());
            };
            let Some(event) = core.poll_event() else {
                break;
            };
            let life = self.sides[side].life;
            match event {
                Event::Outcome { ticket, outcome } => {
                    let s = &mut self.sides[side];
                    if let Some((conn, body_len)) = s.parked.remove(&ticket)
                        && let Some(door) = s.doors.get_mut(&conn)
                    {
                        door.answered(body_len);
                    }
                    if let Outcome::Reply(reply) = &outcome {
                        self.mutation_done(side, ticket, reply.header.status_kind())?;
                    }
                    let Some(waiter) = self.sides[side].waiters.remove(&ticket) else {
                        if let Outcome::Plan(plan) = outcome {
                            let now = self.instant();
                            if let Some(core) = self.sides[side].core.as_mut() {
                                core.plan_finished(plan.lease, Status::Ok, now);
                            }
                        }
                        continue;
                    };
                    match outcome {
                        Outcome::Reply(reply) => self.deliver(side, waiter, reply),
                        Outcome::Plan(plan) => {
                            let delay = self.store_latency();
                            self.after(
                                delay,
                                Ev::Plan {
                                    side,
                                    life,
                                    waiter,
                                    plan,
                                },
                            );
                        }
                    }
                }
                Event::Command { op, command } => self.command(side, life, op, command)?,
            }
        }
        // The core's next deadline.
        let now = self.now;
        let base = self.base;
        let s = &mut self.sides[side];
        if let Some(at) = s.core.as_ref().and_then(Shards::poll_timeout) {
            let at = at.saturating_duration_since(base).max(now);
            if s.timer_at.is_none_or(|t| at < t) {
                s.timer_at = Some(at);
                let life = s.life;
                self.push(at, Ev::Timer { side, life });
            }
        }
        Ok(())
    }
}
