//! A core driven in memory: requests through the door, storage commands
//! carried out by a [`MemoryStore`] when the test says, time moved by the
//! test; the core's invariants are checked after every step.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use binx_proto::BinRequest;

use super::{Completion, CoreFacts, MemoryStore};
use crate::Reply;
use crate::config::CoreConfig;
use crate::core::{Command, Core, Event, Handled, Outcome, Payload};
use crate::data::DataPlan;
use crate::door::{ConnectionDoor, DoorConfig, Transport, Verdict};
use crate::ids::{ConnId, OpId, Ticket};
use crate::objects::StoreFailure;

/// The door binxd puts before every connection, with its defaults.
pub fn door_config() -> DoorConfig {
    DoorConfig {
        shared_secret: None,
        max_frame_length: binx_proto::DEFAULT_MAX_FRAME_LENGTH,
        max_outstanding_requests: 1024,
        server_name: "memory".into(),
        shm_offered: false,
    }
}

/// A core, its doors, a store and a clock, all in memory.
#[derive(Debug)]
pub struct MemoryDriver {
    /// The core driven.
    pub core: Core,
    /// The time passed to the core.
    pub now: Instant,
    /// Where its storage commands land.
    pub store: MemoryStore,
    /// Answers to requests that waited, not taken yet, by ticket.
    pub outcomes: Vec<(Ticket, Outcome)>,
    /// Commands not carried out yet, in the order given.
    pub commands: Vec<(OpId, Command)>,
    /// The door settings of every connection.
    pub door_config: DoorConfig,
    /// Which listener every connection came from (Unix socket by default).
    pub transport: Transport,
    /// Whether a forwarder stands behind the core (requests may name a
    /// remote); off by default.
    pub forwards: bool,
    doors: BTreeMap<ConnId, ConnectionDoor>,
    /// Requests parked in the core: their connection and body size.
    parked: BTreeMap<Ticket, (ConnId, u64)>,
    next: u64,
}

impl MemoryDriver {
    /// A core with `config` behind binxd's default door, over an empty store.
    pub fn new(config: CoreConfig) -> Self {
        MemoryDriver {
            core: Core::new(config),
            now: Instant::now(),
            store: MemoryStore::new("memory-node", "10.0.0.9:8091"),
            outcomes: Vec::new(),
            commands: Vec::new(),
            door_config: door_config(),
            transport: Transport::Uds,
            forwards: false,
            doors: BTreeMap::new(),
            parked: BTreeMap::new(),
            next: 0,
        }
    }

    /// Sends `raw` (its request id is set to a fresh one) with `body` on
    /// `conn`: through the door, then into the core.
    pub fn send(&mut self, conn: ConnId, mut raw: BinRequest, body: Payload) -> (Ticket, Handled) {
        self.next += 1;
        raw.request_id = self.next;
        let ticket = Ticket(self.next);
        let facts = CoreFacts::of(&self.core, self.forwards);
        let config = &self.door_config;
        let transport = self.transport;
        let door = self
            .doors
            .entry(conn)
            .or_insert_with(|| ConnectionDoor::new(transport, 2, config, None));
        let handled = match door.check(&mut raw, config, &facts) {
            Verdict::Submit(request) => {
                // As binxd counts it (its page sizes too).
                let body_len = request.waiting_bytes(body.bytes.len() as u64);
                let handled = self.core.handle(ticket, conn, request, body, self.now);
                if let Handled::Pending = handled {
                    door.parked(body_len);
                    self.parked.insert(ticket, (conn, body_len));
                }
                handled
            }
            Verdict::Reply(header) | Verdict::Close { reply: header, .. } => {
                Handled::Reply(Reply::new(header))
            }
        };
        self.drain();
        (ticket, handled)
    }

    /// Takes what the core wants done: answers into `outcomes` (their
    /// requests leave the door's count), commands into `commands`.
    pub fn drain(&mut self) {
        while let Some(event) = self.core.poll_event() {
            match event {
                Event::Outcome { ticket, outcome } => {
                    if let Some((conn, body_len)) = self.parked.remove(&ticket)
                        && let Some(door) = self.doors.get_mut(&conn)
                    {
                        door.answered(body_len);
                    }
                    self.outcomes.push((ticket, outcome));
                }
                Event::Command { op, command } => self.commands.push((op, command)),
            }
        }
        self.check();
    }

    /// Panics if the core broke an invariant.
    pub fn check(&self) {
        if let Err(e) = self.core.check_invariants() {
            panic!("invariant broken: {e}");
        }
    }

    /// The answer to `ticket`, if it came (a plan is read from the store).
    pub fn outcome(&mut self, ticket: Ticket) -> Option<Reply> {
        self.drain();
        let at = self.outcomes.iter().position(|(t, _)| *t == ticket)?;
        Some(match self.outcomes.remove(at).1 {
            Outcome::Reply(reply) => reply,
            Outcome::Plan(plan) => self.read(plan),
        })
    }

    /// The reply to a request answered at once, reading what a plan names.
    pub fn answer(&mut self, handled: Handled) -> Option<Reply> {
        match handled {
            Handled::Reply(reply) => Some(reply),
            Handled::Plan(plan) => Some(self.read(plan)),
            Handled::Pending => None,
        }
    }

    /// Reads what `plan` names from the store and assembles its reply, as
    /// binxd's driver does.
    pub fn read(&mut self, plan: DataPlan) -> Reply {
        let resolved = self.store.read(&plan);
        let lease = plan.lease;
        let reply = plan.assemble(resolved);
        self.core
            .plan_finished(lease, reply.header.status_kind(), self.now);
        self.drain();
        reply
    }

    /// Carries out every command, and those they lead to, until none is
    /// left; each fails with what `failure` says for it, or succeeds.
    pub fn complete_with(&mut self, mut failure: impl FnMut(&Command) -> Option<StoreFailure>) {
        self.drain();
        while !self.commands.is_empty() {
            for (op, command) in std::mem::take(&mut self.commands) {
                let done = match failure(&command) {
                    Some(f) => Completion::failed(&command, f),
                    None => self.store.carry_out(command),
                };
                done.deliver(&mut self.core, op, self.now);
                self.drain();
            }
        }
    }

    /// Carries out every command; all succeed.
    pub fn complete_all(&mut self) {
        self.complete_with(|_| None);
    }

    /// Moves the clock on and lets the core's timers fire.
    pub fn advance(&mut self, by: Duration) {
        self.now += by;
        self.core.handle_timeout(self.now);
        self.drain();
    }

    /// The connection closed: the core lets go of what it held for it.
    pub fn close(&mut self, conn: ConnId) {
        self.doors.remove(&conn);
        self.parked.retain(|_, (c, _)| *c != conn);
        self.core.connection_closed(conn, self.now);
        self.drain();
    }
}
