//! One exchange as several shards ([`Shards`]): each task on its own
//! shard, one memory limit over all of them, and a request waiting for
//! room on one shard answered when another shard frees it (by consumers
//! or by spilling its own pages).

use std::time::{Duration, Instant};

use binx_core::config::SpoolRules;
use binx_core::testing::MemoryStore;
use binx_core::{
    Command, ConnId, CoreConfig, Door, Event, Handled, OpId, Outcome, Payload, Refusal, Request,
    Shards, Ticket, shard_of,
};
use binx_proto::{BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;

/// Shards, a store and a clock, with what came out of the shards.
struct Harness {
    shards: Shards,
    store: MemoryStore,
    now: Instant,
    next: u64,
    outcomes: Vec<(Ticket, Outcome)>,
    commands: Vec<(OpId, Command)>,
}

impl Harness {
    fn new(config: CoreConfig, shards: usize) -> Self {
        Harness {
            shards: Shards::new(config, shards),
            store: MemoryStore::new("node", "10.0.0.1:8091"),
            now: Instant::now(),
            next: 0,
            outcomes: Vec::new(),
            commands: Vec::new(),
        }
    }

    fn send(&mut self, raw: BinRequest, body: &[u8]) -> (Ticket, Handled) {
        self.next += 1;
        let ticket = Ticket(self.next);
        let request = Request::parse(&raw, Door::Local).expect("a valid request");
        // One connection per task, as an engine's producers often have.
        let conn = ConnId(raw.task_id.len() as u64 + u64::from(raw.task_id.as_bytes()[0]));
        let body = Payload::exact(Bytes::copy_from_slice(body));
        let handled = self.shards.handle(ticket, conn, request, body, self.now);
        self.drain();
        (ticket, handled)
    }

    fn reply(&mut self, raw: BinRequest, body: &[u8]) -> binx_core::Reply {
        match self.send(raw, body).1 {
            Handled::Reply(reply) => reply,
            other => panic!("expected a reply now, got {other:?}"),
        }
    }

    fn drain(&mut self) {
        while let Some(event) = self.shards.poll_event() {
            match event {
                Event::Outcome { ticket, outcome } => self.outcomes.push((ticket, outcome)),
                Event::Command { op, command } => self.commands.push((op, command)),
            }
        }
        if let Err(e) = self.shards.check_invariants() {
            panic!("invariant broken: {e}");
        }
    }

    fn answered(&mut self, ticket: Ticket) -> Option<Status> {
        self.drain();
        self.outcomes.iter().find_map(|(t, o)| match o {
            Outcome::Reply(r) if *t == ticket => Some(r.header.status_kind()),
            _ => None,
        })
    }

    /// Carries out every command the shards asked for so far.
    fn complete_all(&mut self) {
        while !self.commands.is_empty() {
            for (op, command) in std::mem::take(&mut self.commands) {
                let done = self.store.carry_out(command);
                let now = self.now;
                self.shards
                    .complete(op, now, |core, op| done.deliver(core, op, now));
                self.drain();
            }
        }
    }
}

fn req(kind: MessageType, task: &str, buffer: u64) -> BinRequest {
    let mut r = BinRequest::new(kind);
    r.task_id = task.into();
    r.buffer_id = buffer;
    r
}

fn open(task: &str, policy: &str) -> BinRequest {
    let mut r = req(MessageType::OpenTask, task, 0);
    r.buffer_kind = BufferKind::Partitioned as i32;
    r.buffer_count = 1;
    r.spool_policy = policy.into();
    r
}

fn enqueue(task: &str, size: usize, wait: Duration) -> (BinRequest, Vec<u8>) {
    let mut r = req(MessageType::Enqueue, task, 0);
    r.page_sizes = vec![size as u64];
    r.max_wait_micros = wait.as_micros() as u64;
    (r, vec![b'p'; size])
}

/// Two task ids that land on different shards of `n`.
fn on_two_shards(n: usize) -> (String, String) {
    let first = "q0.0.0".to_string();
    let other = (1..)
        .map(|i| format!("q{i}.0.0"))
        .find(|t| shard_of(t, n) != shard_of(&first, n))
        .expect("some id lands elsewhere");
    (first, other)
}

fn limits(memory_limit: u64) -> CoreConfig {
    CoreConfig {
        memory_limit,
        task_memory_limit: memory_limit,
        spool: Some(SpoolRules {
            spill_target_bytes: 100_000,
            spill_max_bytes: 200_000,
            ..SpoolRules::default()
        }),
        ..CoreConfig::default()
    }
}

#[test]
fn the_memory_limit_holds_across_shards() {
    let (a, b) = on_two_shards(2);
    let mut h = Harness::new(limits(100_000), 2);
    for task in [&a, &b] {
        assert_eq!(
            h.reply(open(task, "off"), b"").header.status_kind(),
            Status::Ok
        );
    }
    let (r, body) = enqueue(&a, 60_000, Duration::ZERO);
    assert_eq!(h.reply(r, &body).header.status_kind(), Status::Ok);
    let (r, body) = enqueue(&b, 60_000, Duration::ZERO);
    let refused = h.reply(r, &body);
    assert_eq!(refused.header.status_kind(), Status::Busy);
    let used = h.shards.stats().memory_used;
    let expected = Refusal::NoRoom {
        task: binx_core::TaskId::parse(&b).expect("task id"),
        buffer: 0,
        size: 60_000,
        used,
        limit: 100_000,
        task_used: 0,
        task_limit: 100_000,
    };
    assert_eq!(refused.header.error, expected.to_string());
    // Each shard holds its own task; the figures are the daemon's.
    let stats = h.shards.stats();
    assert_eq!((stats.tasks, stats.pages_buffered), (2, 1));
    assert!(stats.memory_used >= 60_000 && stats.memory_used < 100_000);
    assert_eq!(stats.memory_high_water, stats.memory_used);
    assert_eq!(h.shards.task_snapshots("", h.now).len(), 2);
}

#[test]
fn a_request_waiting_on_one_shard_gets_the_room_another_frees() {
    let (a, b) = on_two_shards(2);
    let mut h = Harness::new(limits(100_000), 2);
    for task in [&a, &b] {
        h.reply(open(task, "off"), b"");
    }
    let (r, body) = enqueue(&a, 60_000, Duration::ZERO);
    assert_eq!(h.reply(r, &body).header.status_kind(), Status::Ok);
    let (r, body) = enqueue(&b, 60_000, Duration::from_secs(5));
    let (waiter, handled) = h.send(r, &body);
    assert!(matches!(handled, Handled::Pending), "{handled:?}");
    // Its body and its page's cost.
    assert_eq!(
        h.shards.stats().memory_pending,
        60_000 + binx_proto::ENQUEUE_PAGE_COST
    );
    // The consumer of a's buffer takes its page: a's shard frees the room,
    // and b's ENQUEUE on the other shard is applied at once, not at its
    // deadline.
    let mut ack = req(MessageType::Ack, &a, 0);
    ack.page_token = 1;
    assert_eq!(h.reply(ack, b"").header.status_kind(), Status::Ok);
    assert_eq!(h.answered(waiter), Some(Status::Ok));
    assert_eq!(h.shards.stats().pages_buffered, 1);
}

#[test]
fn overflow_pages_on_one_shard_spill_for_a_request_waiting_on_another() {
    let (a, b) = on_two_shards(2);
    let mut h = Harness::new(limits(1 << 20), 2);
    for task in [&a, &b] {
        h.reply(open(task, "overflow"), b"");
    }
    // a holds 660 kB, below the three quarters past which pages spill
    // ahead of need: nothing spills yet.
    for _ in 0..6 {
        let (r, body) = enqueue(&a, 110_000, Duration::ZERO);
        assert_eq!(h.reply(r, &body).header.status_kind(), Status::Ok);
    }
    assert!(h.commands.is_empty(), "{:?}", h.commands.len());
    // b, on the other shard, has nothing to spill and needs 400 kB.
    let (r, body) = enqueue(&b, 400_000, Duration::from_secs(5));
    let (waiter, handled) = h.send(r, &body);
    assert!(matches!(handled, Handled::Pending), "{handled:?}");
    let spilled: Vec<String> = h
        .commands
        .iter()
        .filter_map(|(_, c)| match c {
            Command::WriteSegment { task, .. } => Some(task.to_string()),
            _ => None,
        })
        .collect();
    assert!(
        !spilled.is_empty() && spilled.iter().all(|t| *t == a),
        "a's shard spills for b: {spilled:?}"
    );
    h.complete_all();
    assert_eq!(h.answered(waiter), Some(Status::Ok));
    assert!(h.shards.stats().pages_spilled > 0);
}

#[test]
fn a_task_always_lands_on_the_same_shard() {
    for n in [1, 2, 3, 16, 256] {
        for i in 0..200 {
            let task = format!("20261127_{i}.1.0.0");
            let shard = shard_of(&task, n);
            assert!(shard < n);
            assert_eq!(shard, shard_of(&task, n));
        }
    }
    // Tasks spread: 1000 ids over 16 shards leave none empty.
    let mut seen = [0u32; 16];
    for i in 0..1000 {
        seen[shard_of(&format!("query_{i}.3.{}.0", i % 7), 16)] += 1;
    }
    assert!(seen.iter().all(|&c| c > 20), "{seen:?}");
}
