//! [`Shards`]: one exchange as several [`Core`]s, each owning the tasks
//! [`shard_of`] gives it, sharing one [`MemoryBudget`].
//!
//! Sharding is how binxd uses more than one core: every request names its
//! task, a task lives on one shard, and two shards share nothing on the
//! request path but the budget's atomics (and, when forwards fail, the
//! remotes' silences: [`crate::silences`]). binxd puts each shard behind a
//! lock of its own; [`Shards`] drives them all from one thread, as the
//! simulation and the tests do, with the same rules between shards:
//! after every call into a shard, [`Core::take_room_signal`] says whether
//! the others must look at the budget again ([`Core::room_elsewhere`]).
//!
//! Ordering: a connection's ENQUEUEs and NO_MORE_PAGES take effect in the
//! order sent per shard, so per task (and per buffer), as before; requests
//! of two tasks on two shards no longer wait for each other.

use std::time::Instant;

use binx_proto::Status;

use crate::budget::MemoryBudget;
use crate::config::CoreConfig;
use crate::core::{Core, Event, Handled, Outcome, Payload};
use crate::ids::{ConnId, LeaseId, OpId, Ticket};
use crate::request::Request;
use crate::silences::RemoteSilences;
use crate::snapshot::TaskSnapshot;
use crate::stats::CoreStats;

/// Most shards one exchange has.
pub const MAX_SHARDS: usize = 256;

/// The shard of `shards` that owns `task` (FNV-1a of its bytes): the same
/// in every process, so a task's requests always meet on one shard.
pub fn shard_of(task: &str, shards: usize) -> usize {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in task.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % shards.max(1) as u64) as usize
}

/// The shard a request goes to: its task's; one that names no task (PING,
/// HELLO) goes to its connection's.
pub fn shard_of_request(request: &Request, conn: ConnId, shards: usize) -> usize {
    match request.task() {
        Some(task) => shard_of(task.as_str(), shards),
        None => (conn.0 % shards.max(1) as u64) as usize,
    }
}

/// What [`spread_room`] asks of one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoomVisit {
    /// [`Core::room_elsewhere`], then [`Core::take_room_signal`].
    Nudge,
}

impl RoomVisit {
    /// Does it on `core`; true when the others must look again.
    pub fn apply(self, core: &mut Core, now: Instant) -> bool {
        match self {
            RoomVisit::Nudge => {
                core.room_elsewhere(now);
                core.take_room_signal()
            }
        }
    }
}

/// A shard signalled ([`Core::take_room_signal`]): every shard, that one
/// too (what it waits for may have come free meanwhile), looks at
/// the budget again, and so on while one of them signals in turn (a few
/// rounds at most: a signal is a hint, and the next call into any shard
/// looks again). `visit` does what it is asked on shard `i` (a driver
/// locks the shard, and carries out what the call asked for).
pub fn spread_room(shards: usize, mut visit: impl FnMut(usize, RoomVisit) -> bool) {
    if shards < 2 {
        return;
    }
    for _ in 0..4 {
        let mut again = false;
        for shard in 0..shards {
            again |= visit(shard, RoomVisit::Nudge);
        }
        if !again {
            return;
        }
    }
}

/// Several shards driven from one thread (tests and the simulation); ids
/// the shards give out (commands' [`OpId`]s, plans' [`LeaseId`]s) carry
/// their shard, so completions find their way back.
#[derive(Debug)]
pub struct Shards {
    cores: Vec<Core>,
}

/// A shard's id made unique among `n` shards, and back.
fn tag(id: u64, shard: usize, n: usize) -> u64 {
    id * n as u64 + shard as u64
}

fn untag(id: u64, n: usize) -> (usize, u64) {
    ((id % n as u64) as usize, id / n as u64)
}

impl Shards {
    /// `shards` shards (1 to [`MAX_SHARDS`]) with `config`'s limits, the
    /// countable ones shared out ([`CoreConfig::for_shard`]).
    pub fn new(config: CoreConfig, shards: usize) -> Self {
        let n = shards.clamp(1, MAX_SHARDS);
        let budget = MemoryBudget::new(config.memory_limit);
        let silences = RemoteSilences::new(config.max_tracked_remotes);
        let per_shard = config.for_shard(n);
        Shards {
            cores: (0..n)
                .map(|_| Core::shard(per_shard.clone(), budget.clone(), silences.clone()))
                .collect(),
        }
    }

    /// How many shards.
    pub fn len(&self) -> usize {
        self.cores.len()
    }

    /// Never: there is at least one shard.
    pub fn is_empty(&self) -> bool {
        self.cores.is_empty()
    }

    /// The shards themselves.
    pub fn cores(&self) -> &[Core] {
        &self.cores
    }

    fn settle(&mut self, touched: usize, now: Instant) {
        if self.cores.len() < 2 || !self.cores[touched].take_room_signal() {
            return;
        }
        let cores = &mut self.cores;
        spread_room(cores.len(), |i, visit| visit.apply(&mut cores[i], now));
    }

    fn tag_plan(plan: &mut crate::DataPlan, shard: usize, n: usize) {
        plan.lease = plan.lease.map(|l| LeaseId(tag(l.0, shard, n)));
    }

    /// [`Core::handle`] on the request's shard.
    pub fn handle(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        body: Payload,
        now: Instant,
    ) -> Handled {
        let n = self.cores.len();
        let i = shard_of_request(&request, conn, n);
        let mut handled = self.cores[i].handle(ticket, conn, request, body, now);
        if let Handled::Plan(plan) = &mut handled {
            Shards::tag_plan(plan, i, n);
        }
        self.settle(i, now);
        handled
    }

    /// The next event of any shard, in shard order.
    pub fn poll_event(&mut self) -> Option<Event> {
        let n = self.cores.len();
        for (i, core) in self.cores.iter_mut().enumerate() {
            if let Some(mut event) = core.poll_event() {
                match &mut event {
                    Event::Command { op, .. } => *op = OpId(tag(op.0, i, n)),
                    Event::Outcome {
                        outcome: Outcome::Plan(plan),
                        ..
                    } => Shards::tag_plan(plan, i, n),
                    Event::Outcome { .. } => {}
                }
                return Some(event);
            }
        }
        None
    }

    /// The earliest deadline of any shard.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.cores.iter().filter_map(Core::poll_timeout).min()
    }

    /// [`Core::handle_timeout`] on every shard that is due.
    pub fn handle_timeout(&mut self, now: Instant) {
        for i in 0..self.cores.len() {
            if self.cores[i].poll_timeout().is_some_and(|at| at <= now) {
                self.cores[i].handle_timeout(now);
                self.settle(i, now);
            }
        }
    }

    /// Runs `f` on the shard that asked for command `op`, with the shard's
    /// own id for it: the completion of a command.
    pub fn complete<R>(
        &mut self,
        op: OpId,
        now: Instant,
        f: impl FnOnce(&mut Core, OpId) -> R,
    ) -> R {
        let n = self.cores.len();
        let (i, op) = untag(op.0, n);
        let result = f(&mut self.cores[i], OpId(op));
        self.settle(i, now);
        result
    }

    /// [`Core::plan_finished`] on the plan's shard.
    pub fn plan_finished(&mut self, lease: Option<LeaseId>, status: Status, now: Instant) {
        let n = self.cores.len();
        match lease {
            Some(lease) => {
                let (i, id) = untag(lease.0, n);
                self.cores[i].plan_finished(Some(LeaseId(id)), status, now);
                self.settle(i, now);
            }
            None => self.cores[0].plan_finished(None, status, now),
        }
    }

    /// [`Core::cancel`] on every shard (only the one holding it acts).
    pub fn cancel(&mut self, ticket: Ticket, now: Instant) {
        for i in 0..self.cores.len() {
            self.cores[i].cancel(ticket, now);
            self.settle(i, now);
        }
    }

    /// [`Core::connection_closed`] on every shard.
    pub fn connection_closed(&mut self, conn: ConnId, now: Instant) {
        for i in 0..self.cores.len() {
            self.cores[i].connection_closed(conn, now);
            self.settle(i, now);
        }
    }

    /// [`Core::start_drain`] on every shard.
    pub fn start_drain(&mut self, now: Instant) {
        for i in 0..self.cores.len() {
            self.cores[i].start_drain(now);
            self.settle(i, now);
        }
    }

    /// Whether the shared memory limit is reached.
    pub fn memory_full(&self) -> bool {
        self.cores[0].memory_full()
    }

    /// Every shard's figures, summed.
    pub fn stats(&self) -> CoreStats {
        let mut stats = CoreStats::default();
        for core in &self.cores {
            stats.add(&core.stats());
        }
        stats
    }

    /// Every shard's open tasks whose id starts with `prefix`, by id.
    pub fn task_snapshots(&self, prefix: &str, now: Instant) -> Vec<TaskSnapshot> {
        let mut all: Vec<TaskSnapshot> = self
            .cores
            .iter()
            .flat_map(|core| core.task_snapshots(prefix, now))
            .collect();
        all.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        all
    }

    /// Every shard's own invariants, each task on the shard [`shard_of`]
    /// gives it, and the budget equal to what the shards count, within
    /// the limit.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.cores.len();
        let (mut used, mut pending, mut slack) = (0u64, 0u64, 0u64);
        for (i, core) in self.cores.iter().enumerate() {
            core.check_invariants()
                .map_err(|e| format!("shard {i} of {n}: {e}"))?;
            let stats = core.stats();
            used += stats.memory_used;
            pending += stats.memory_pending;
            slack += core.memory_slack();
            if let Some(task) = core.task_ids().find(|t| shard_of(t.as_str(), n) != i) {
                return Err(format!(
                    "task {task} is on shard {i} of {n}, not on shard {}",
                    shard_of(task.as_str(), n)
                ));
            }
        }
        let budget = self.cores[0].budget();
        if (budget.used(), budget.pending()) != (used, pending) {
            return Err(format!(
                "the budget counts {} bytes held and {} waiting; the shards {used} and {pending}",
                budget.used(),
                budget.pending()
            ));
        }
        if used > budget.limit() + slack {
            return Err(format!(
                "the shards hold {used} bytes together, above the limit {}",
                budget.limit()
            ));
        }
        Ok(())
    }
}
