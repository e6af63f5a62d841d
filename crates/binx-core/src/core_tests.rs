//! The core as a state machine: requests and time in, replies, commands and
//! deadlines out. Every test checks the core's own bookkeeping after every
//! step (`check_invariants`).

use std::sync::Arc;
use std::time::Duration;

use binx_proto::{
    ALL_BUFFERS, BinReply, BinRequest, BufferKind, MessageType, Segment, SpoolPolicy, Status,
};
use bytes::Bytes;

use crate::Reply;
use crate::budget::MemoryBudget;
use crate::config::{CoreConfig, SpoolRules};
use crate::core::Core;
use crate::core::{Command, Handled, Manifest, Payload};
use crate::data::PlanPart;
use crate::ids::{ConnId, OpId, Ticket};
use crate::objects::{CommitMarker, Durability, ObjectMeta, StoreFailure};
use crate::refusal::{Mutation, Refusal};
use crate::request::{Door, Request};
use crate::silences::RemoteSilences;
use crate::snapshot::BufferState;
use crate::task_id::TaskId;
use crate::testing::{MemoryDriver, StoredObject};

const SEC: Duration = Duration::from_secs(1);

fn tid(task: &str) -> TaskId {
    TaskId::parse(task).expect("a valid task id")
}

/// That `reply` is `expected`: its status and its whole text.
#[track_caller]
fn assert_refused(reply: &Reply, expected: Refusal) {
    assert!(
        expected.is(reply.header.status, &reply.header.error),
        "expected {} {expected:?}, got {} {:?}",
        expected.status().name(),
        reply.header.status_kind().name(),
        reply.header.error
    );
}

/// The in-memory driver; [`Shorthands`] adds what these tests use.
type Harness = MemoryDriver;

fn harness(config: CoreConfig) -> Harness {
    let mut driver = MemoryDriver::new(config);
    driver.forwards = true;
    driver
}

fn spooled(config: CoreConfig) -> Harness {
    harness(CoreConfig {
        spool: Some(SpoolRules::default()),
        ..config
    })
}

fn req(kind: MessageType, task: &str, buffer: u64) -> BinRequest {
    let mut r = BinRequest::new(kind);
    r.task_id = task.into();
    r.buffer_id = buffer;
    r
}

fn open(task: &str, kind: BufferKind, count: u64) -> BinRequest {
    let mut r = req(MessageType::OpenTask, task, 0);
    r.buffer_kind = kind as i32;
    r.buffer_count = count;
    r
}

fn open_with(task: &str, kind: BufferKind, count: u64, policy: &str) -> BinRequest {
    let mut r = open(task, kind, count);
    r.spool_policy = policy.into();
    r
}

fn data(task: &str, buffer: u64, token: u64, max_size: u64) -> BinRequest {
    let mut r = req(MessageType::Data, task, buffer);
    r.page_token = token;
    r.max_size_bytes = max_size;
    r
}

fn waiting(mut r: BinRequest, wait: Duration) -> BinRequest {
    r.max_wait_micros = wait.as_micros() as u64;
    r
}

fn sizes(task: &str, buffer: u64, token: u64) -> BinRequest {
    let mut r = data(task, buffer, token, 0);
    r.get_data_size = true;
    r
}

fn ack(task: &str, buffer: u64, token: u64) -> BinRequest {
    let mut r = req(MessageType::Ack, task, buffer);
    r.page_token = token;
    r
}

fn enqueue_req(task: &str, buffer: u64, pages: &[&[u8]]) -> (BinRequest, Vec<u8>) {
    let mut r = req(MessageType::Enqueue, task, buffer);
    r.page_sizes = pages.iter().map(|p| p.len() as u64).collect();
    (r, pages.concat())
}

trait Shorthands {
    fn send_req(&mut self, request: BinRequest, body: &[u8]) -> (Ticket, Handled);
    fn reply(&mut self, request: BinRequest, body: &[u8]) -> Reply;
    fn reply_after(&mut self, request: BinRequest) -> Reply;
    fn ok(&mut self, request: BinRequest, body: &[u8]) -> Reply;
    fn enqueue(&mut self, task: &str, buffer: u64, pages: &[&[u8]]) -> Reply;
    fn pending(&mut self, request: BinRequest, body: &[u8]) -> Ticket;
    fn complete(&mut self, fail: bool);
    fn stored(&self) -> Vec<ObjectMeta>;
    fn put_segment(&mut self, meta: ObjectMeta);
    fn markers(&self) -> Vec<(String, u64)>;
    fn folded_markers(&self) -> Vec<(String, u64)>;
    fn marker_objects(&self) -> Vec<(u64, u64, Vec<u64>)>;
    fn manifests(&self) -> Vec<Manifest>;
}

impl Shorthands for MemoryDriver {
    /// Sends on connection 1.
    fn send_req(&mut self, request: BinRequest, body: &[u8]) -> (Ticket, Handled) {
        self.send(
            ConnId(1),
            request,
            Payload::exact(Bytes::copy_from_slice(body)),
        )
    }

    /// Sends and expects an immediate reply (reading storage if need be).
    fn reply(&mut self, request: BinRequest, body: &[u8]) -> Reply {
        let handled = self.send_req(request, body).1;
        self.answer(handled).expect("request is pending")
    }

    /// Sends, carries out the storage work it asks for, and returns its reply.
    fn reply_after(&mut self, request: BinRequest) -> Reply {
        let (ticket, handled) = self.send_req(request, b"");
        match self.answer(handled) {
            Some(reply) => reply,
            None => {
                self.complete(false);
                self.outcome(ticket)
                    .expect("answered once storage answered")
            }
        }
    }

    fn ok(&mut self, request: BinRequest, body: &[u8]) -> Reply {
        let what = format!("{:?}", request.message_type());
        let r = self.reply(request, body);
        assert_eq!(status(&r), Status::Ok, "{what} failed: {}", r.header.error);
        r
    }

    fn enqueue(&mut self, task: &str, buffer: u64, pages: &[&[u8]]) -> Reply {
        let (r, body) = enqueue_req(task, buffer, pages);
        self.reply(r, &body)
    }

    fn pending(&mut self, request: BinRequest, body: &[u8]) -> Ticket {
        let (ticket, handled) = self.send_req(request, body);
        assert!(
            matches!(handled, Handled::Pending),
            "expected to wait: {handled:?}"
        );
        ticket
    }

    /// Completes every command issued so far (`fail`: writes and reads of
    /// storage fail as if it were unreachable; deletions, releases and
    /// forwards go as usual).
    fn complete(&mut self, fail: bool) {
        self.complete_with(|command| {
            let fallible = matches!(
                command,
                Command::WriteSegment { .. }
                    | Command::WriteMarker(_)
                    | Command::DeleteMarker { .. }
                    | Command::WriteManifest(_)
                    | Command::ReadManifest { .. }
            );
            (fail && fallible).then(|| StoreFailure::transient("the store is unreachable"))
        });
    }

    /// Segment objects in storage.
    fn stored(&self) -> Vec<ObjectMeta> {
        self.store
            .objects
            .values()
            .map(|o| o.meta.clone())
            .collect()
    }

    /// Puts an object another node wrote into storage (its pages are
    /// `page_bytes`).
    fn put_segment(&mut self, meta: ObjectMeta) {
        let pages = meta
            .page_sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| Bytes::from(page_bytes(&meta.name, i, size)))
            .collect();
        let object = StoredObject {
            meta: meta.clone(),
            pages,
            durability: Durability::Durable,
        };
        self.store.objects.insert(meta.name, object);
    }

    /// The commit markers in storage as objects of their own: (task, buffer).
    fn markers(&self) -> Vec<(String, u64)> {
        self.store.markers.keys().cloned().collect()
    }

    /// The commit markers folded into manifests (not released): (task, buffer).
    fn folded_markers(&self) -> Vec<(String, u64)> {
        self.store
            .folded
            .keys()
            .filter(|k| !self.store.released.contains(*k))
            .cloned()
            .collect()
    }

    /// Of each marker in storage: (buffer, end token, first token of each object).
    fn marker_objects(&self) -> Vec<(u64, u64, Vec<u64>)> {
        self.store
            .markers
            .values()
            .map(|m| {
                let firsts = m.segments.iter().map(|s| s.first_token).collect();
                (m.buffer_id, m.end_token, firsts)
            })
            .collect()
    }

    /// The commit manifests in storage.
    fn manifests(&self) -> Vec<Manifest> {
        self.store.manifests.values().cloned().collect()
    }
}

/// What the test store holds as page `i` of object `name`: the tests enqueue
/// pages made by the same function when they spool.
fn page_bytes(name: &str, i: usize, size: u64) -> Vec<u8> {
    let _ = (name, i);
    vec![b's'; size as usize]
}

fn pages_of(reply: &Reply) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let body: Vec<u8> = reply.body.concat();
    let mut at = 0usize;
    for segment in &reply.header.segments {
        for &size in &segment.page_sizes {
            out.push(body[at..at + size as usize].to_vec());
            at += size as usize;
        }
    }
    out
}

fn status(reply: &Reply) -> Status {
    reply.header.status_kind()
}

#[test]
fn partitioned_pages_flow_in_token_order_and_free_on_ack() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    assert_eq!(
        status(&h.enqueue("t", 0, &[b"aa", b"bbb", b"c"])),
        Status::Ok
    );
    assert_eq!(status(&h.enqueue("t", 1, &[b"zz"])), Status::Ok);
    let full = h.core.memory_used();
    assert!(full >= 8, "at least the page bytes: {full}");

    let r = h.ok(data("t", 0, 0, 1), b"");
    assert_eq!(
        pages_of(&r),
        vec![b"aa".to_vec()],
        "one page even above max size"
    );
    assert_eq!((r.header.page_token, r.header.page_next_token), (0, 1));
    assert_eq!(r.header.segments, vec![Segment::inline(0, vec![2])]);
    assert!(!r.header.buffer_complete);

    let again = h.ok(data("t", 0, 0, 1), b"");
    assert_eq!(
        pages_of(&again),
        pages_of(&r),
        "a retry returns the same pages"
    );

    let r = h.ok(data("t", 0, 1, 4), b"");
    assert_eq!(pages_of(&r), vec![b"bbb".to_vec(), b"c".to_vec()]);

    let r = h.reply(data("t", 0, 0, 10), b"");
    assert_eq!(status(&r), Status::BadRequest);
    assert_refused(
        &r,
        Refusal::TokenBelowMark {
            task: tid("t"),
            buffer: 0,
            token: 0,
            mark: 1,
        },
    );
    assert_eq!(r.header.page_token, 0, "errors carry the token asked for");
    let r = h.reply(data("t", 0, 4, 10), b"");
    assert_eq!(status(&r), Status::BadRequest);
    assert_refused(
        &r,
        Refusal::TokenBeyondNext {
            task: tid("t"),
            buffer: 0,
            token: 4,
            next: 3,
        },
    );
    assert_eq!((r.header.page_token, r.header.page_next_token), (4, 4));

    h.ok(ack("t", 0, 3), b"");
    h.ok(ack("t", 0, 1), b"");
    assert_eq!(status(&h.reply(ack("t", 0, 9), b"")), Status::BadRequest);
    h.ok(ack("t", 1, 1), b"");
    assert_eq!(
        h.core.memory_used(),
        0,
        "every page acknowledged: nothing held"
    );
}

#[test]
fn completion_comes_with_the_last_pages_and_at_the_end_token() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    h.enqueue("t", 0, &[b"x", b"y"]);
    h.ok(req(MessageType::NoMorePages, "t", 0), b"");
    assert!(!h.ok(data("t", 0, 0, 1), b"").header.buffer_complete);
    assert!(h.ok(data("t", 0, 1, 100), b"").header.buffer_complete);
    let r = h.ok(data("t", 0, 2, 100), b"");
    assert!(r.header.buffer_complete && r.body.is_empty());
    assert_eq!(r.header.page_next_token, 2);
    assert_eq!(status(&h.enqueue("t", 0, &[b"late"])), Status::BadRequest);
}

#[test]
fn a_long_poll_waits_is_woken_by_pages_and_otherwise_times_out() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 0), b"");
    let waiter = h.pending(waiting(data("t", 3, 0, 0), 5 * SEC), b"");
    assert!(h.core.poll_timeout().is_some());
    h.enqueue("t", 3, &[b"p"]);
    let woken = h.outcome(waiter).expect("pages wake the waiter");
    assert_eq!(pages_of(&woken), vec![b"p".to_vec()]);

    let waiter = h.pending(waiting(data("t", 4, 0, 0), 2 * SEC), b"");
    h.advance(SEC);
    assert!(h.outcome(waiter).is_none());
    h.advance(SEC);
    let r = h.outcome(waiter).expect("the wait ends");
    assert_eq!(status(&r), Status::NoData);
    assert_eq!((r.header.page_token, r.header.page_next_token), (0, 0));
    let r = h.reply(data("t", 5, 0, 0), b"");
    assert_eq!(status(&r), Status::NoData, "no wait asked: NO_DATA at once");
}

#[test]
fn unknown_task_waits_and_sees_its_later_end() {
    let mut h = harness(CoreConfig::default());
    let waiter = h.pending(waiting(data("later", 0, 0, 0), 5 * SEC), b"");
    let mut abort = req(MessageType::AbortTask, "later", 0);
    abort.reason = "query cancelled".into();
    h.ok(abort, b"");
    let r = h.outcome(waiter).expect("the abort answers the waiter");
    assert_eq!(status(&r), Status::ServerError);
    assert_refused(
        &r,
        Refusal::Aborted {
            task: tid("later"),
            reason: "query cancelled".into(),
        },
    );
    let r = h.reply(data("later", 0, 0, 0), b"");
    assert_eq!(status(&r), Status::ServerError);
}

#[test]
fn get_data_size_lists_sizes_without_pages() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    h.enqueue("t", 0, &[b"12", b"12345"]);
    let r = h.ok(sizes("t", 0, 0), b"");
    assert_eq!(r.header.remaining_bytes, vec![2, 5]);
    assert!(r.body.is_empty() && r.header.segments.is_empty());
    assert_eq!(r.header.page_next_token, 0);
    let r = h.ok(sizes("t", 0, 1), b"");
    assert_eq!(
        r.header.remaining_bytes,
        vec![5],
        "the size request acknowledged page 0"
    );
}

#[test]
fn broadcast_gives_every_buffer_every_page_and_frees_when_all_acked() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("b", BufferKind::Broadcast, 2), b"");
    h.enqueue("b", 7, &[b"one", b"two"]);
    let held = h.core.memory_used();
    for buffer in 0..2 {
        let r = h.ok(data("b", buffer, 0, 100), b"");
        assert_eq!(pages_of(&r), vec![b"one".to_vec(), b"two".to_vec()]);
    }
    h.ok(ack("b", 0, 2), b"");
    assert_eq!(
        h.core.memory_used(),
        held,
        "buffer 1 has not acknowledged yet"
    );
    h.ok(ack("b", 1, 1), b"");
    h.ok(req(MessageType::Delete, "b", 1), b"");
    assert_eq!(h.core.memory_used(), 0);
    h.ok(req(MessageType::NoMorePages, "b", ALL_BUFFERS), b"");
    assert!(h.ok(data("b", 0, 2, 100), b"").header.buffer_complete);
}

#[test]
fn a_broadcast_page_is_freed_when_the_last_buffer_at_the_floor_moves_past_it() {
    // Three consumers read three pages (one ENQUEUE each, so each page
    // holds its own chunk) in varying orders; a page's memory goes exactly
    // when the last buffer that had not acknowledged it does, whichever
    // buffer that is (the task keeps the floor and how many buffers stand
    // at it, and `check_invariants` holds it against every buffer after
    // each step).
    let mut h = harness(CoreConfig::default());
    h.ok(open("b", BufferKind::Broadcast, 3), b"");
    for page in [b"one".as_slice(), b"two", b"six"] {
        h.enqueue("b", 0, &[page]);
    }
    for buffer in 0..3 {
        assert_eq!(pages_of(&h.ok(data("b", buffer, 0, 100), b"")).len(), 3);
    }
    // Per page, the order the buffers acknowledge it in.
    let orders = [[0u64, 1, 2], [2, 0, 1], [1, 2, 0]];
    let mut held = h.core.memory_used();
    for (page, order) in orders.iter().enumerate() {
        for (n, &buffer) in order.iter().enumerate() {
            h.ok(ack("b", buffer, page as u64 + 1), b"");
            let now = h.core.memory_used();
            if n < 2 {
                assert_eq!(
                    now, held,
                    "page {page} is still needed after buffer {buffer} acknowledged it"
                );
            } else {
                assert!(
                    now < held,
                    "page {page} is freed once its last reader, buffer {buffer}, acknowledged it"
                );
            }
            held = now;
        }
    }
    // A buffer ahead of the others acknowledging again moves nothing.
    h.enqueue("b", 0, &[b"ten"]);
    let before = h.core.memory_used();
    h.ok(ack("b", 0, 4), b"");
    h.ok(ack("b", 0, 4), b"");
    h.ok(ack("b", 1, 4), b"");
    assert_eq!(h.core.memory_used(), before, "buffer 2 still needs page 3");
    h.ok(ack("b", 2, 4), b"");
    assert_eq!(h.core.memory_used(), 0);
}

#[test]
fn arbitrary_hands_each_page_to_one_buffer() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("a", BufferKind::Arbitrary, 2), b"");
    h.enqueue("a", 0, &[b"p0", b"p1", b"p2"]);
    let r0 = h.ok(data("a", 0, 0, 2), b"");
    let r1 = h.ok(data("a", 1, 0, 4), b"");
    assert_eq!(pages_of(&r0), vec![b"p0".to_vec()]);
    assert_eq!(pages_of(&r1), vec![b"p1".to_vec(), b"p2".to_vec()]);
    assert_eq!(
        pages_of(&h.ok(data("a", 0, 0, 100), b"")),
        vec![b"p0".to_vec()]
    );
    h.ok(req(MessageType::NoMorePages, "a", ALL_BUFFERS), b"");
    assert!(h.ok(data("a", 0, 1, 100), b"").header.buffer_complete);
    assert!(h.ok(data("a", 1, 2, 100), b"").header.buffer_complete);
    assert_eq!(h.core.memory_used(), 0);
}

fn small_limits() -> CoreConfig {
    CoreConfig {
        memory_limit: 10_000,
        task_memory_limit: 6_000,
        ..CoreConfig::default()
    }
}

#[test]
fn memory_limits_make_enqueue_wait_then_busy_and_store_nothing() {
    let mut h = harness(small_limits());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    h.ok(open("u", BufferKind::Partitioned, 1), b"");
    let big = vec![b'x'; 4_000];
    assert_eq!(status(&h.enqueue("t", 0, &[&big])), Status::Ok);
    let held = h.core.memory_used();
    // Over the task limit: waits while it may, then BUSY.
    let (mut r, body) = enqueue_req("t", 0, &[&big[..2_500]]);
    r.max_wait_micros = 2_000_000;
    let waiter = h.pending(r.clone(), &body);
    h.advance(3 * SEC);
    let busy = h.outcome(waiter).expect("BUSY after the wait");
    assert_refused(
        &busy,
        Refusal::NoRoom {
            task: tid("t"),
            buffer: 0,
            size: 2_500,
            used: held,
            limit: 10_000,
            // Task t holds all that is held.
            task_used: held,
            task_limit: 6_000,
        },
    );
    assert_eq!(h.core.memory_used(), held, "BUSY stored nothing");
    // Another task still has room under the global limit, until it has not.
    assert_eq!(status(&h.enqueue("u", 0, &[&big])), Status::Ok);
    assert_eq!(
        status(&h.enqueue("u", 0, &[&big[..2_500]])),
        Status::Busy,
        "global limit"
    );
    // A consumer frees room; a waiting ENQUEUE then goes in by itself.
    let waiter = h.pending(r, &body);
    assert_eq!(status(&h.reply(data("t", 0, 1, 0), b"")), Status::NoData);
    assert_eq!(status(&h.outcome(waiter).expect("room came")), Status::Ok);
    // Larger than any limit: refused outright.
    assert_eq!(
        status(&h.enqueue("t", 0, &[&vec![0u8; 7_000]])),
        Status::BadRequest
    );
    let stats = h.core.stats();
    assert_eq!(stats.busy_replies, 2);
    assert!(stats.memory_high_water <= 10_000);
}

/// ENQUEUEs queued behind one that waits for room count as pending memory
/// with their page sizes, not only their bodies: a connection that queues
/// ENQUEUEs of thousands of empty pages, no body at all, holds their
/// decoded sizes (review: half a GiB per connection uncounted).
#[test]
fn enqueues_of_empty_pages_queued_behind_a_waiting_one_count_as_pending() {
    let mut h = harness(small_limits());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    let big = vec![b'x'; 4_000];
    assert_eq!(status(&h.enqueue("t", 0, &[&big])), Status::Ok);
    // Over the task limit: waits, at the head of its connection's queue.
    let (mut r, body) = enqueue_req("t", 0, &[&big[..2_500]]);
    r.max_wait_micros = 5_000_000;
    let head = h.pending(r, &body);
    let empty: Vec<&[u8]> = vec![b""; 1_000];
    let empties = || {
        let (mut r, body) = enqueue_req("t", 0, &empty);
        r.max_wait_micros = 5_000_000;
        (r, body)
    };
    let (r, body) = empties();
    let queued = h.pending(r, &body);
    let cost = binx_proto::ENQUEUE_PAGE_COST;
    assert_eq!(h.core.stats().memory_pending, 2_500 + cost + 1_000 * cost);
    assert!(h.core.budget().full(), "what waits fills the limit");
    // The next is refused at once rather than queued uncounted.
    let (r, body) = empties();
    assert_eq!(status(&h.reply(r, &body)), Status::Busy);
    h.advance(6 * SEC);
    for ticket in [head, queued] {
        assert_eq!(status(&h.outcome(ticket).expect("answered")), Status::Busy);
    }
    assert_eq!(h.core.stats().memory_pending, 0, "released as they ended");
    h.core.check_invariants().expect("invariants");
}

#[test]
fn pipelined_enqueues_take_effect_in_the_order_sent_even_under_backpressure() {
    let mut h = harness(small_limits());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    let big = vec![b'1'; 5_000];
    assert_eq!(status(&h.enqueue("t", 0, &[&big])), Status::Ok);
    // Two more on the same connection: the first does not fit and waits;
    // the second (small enough to fit) must not overtake it.
    let (mut first, body1) = enqueue_req("t", 0, &[&[b'2'; 2_000]]);
    first.max_wait_micros = 10_000_000;
    let (mut second, body2) = enqueue_req("t", 0, &[b"3"]);
    second.max_wait_micros = 10_000_000;
    let (mut finish, _) = enqueue_req("t", 0, &[]);
    finish.r#type = MessageType::NoMorePages as i32;
    let t1 = h.pending(first, &body1);
    let t2 = h.pending(second, &body2);
    let t3 = h.pending(finish, b"");
    // The consumer reads and acknowledges the first page: both go, in order.
    h.ok(data("t", 0, 0, 0), b"");
    h.ok(ack("t", 0, 1), b"");
    for t in [t1, t2, t3] {
        assert_eq!(status(&h.outcome(t).expect("applied")), Status::Ok);
    }
    let r = h.ok(data("t", 0, 1, 1 << 20), b"");
    let sizes: Vec<usize> = pages_of(&r).iter().map(Vec::len).collect();
    assert_eq!(sizes, vec![2_000, 1], "in the order sent");
    assert!(r.header.buffer_complete);
}

#[test]
fn a_busy_enqueue_makes_the_ones_queued_behind_it_busy_too() {
    let mut h = harness(small_limits());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    assert_eq!(status(&h.enqueue("t", 0, &[&[0u8; 5_000]])), Status::Ok);
    let (mut first, body1) = enqueue_req("t", 0, &[&[0u8; 2_000]]);
    first.max_wait_micros = 1_000_000;
    let (second, body2) = enqueue_req("t", 0, &[b"3"]);
    let (mut finish, _) = enqueue_req("t", 0, &[]);
    finish.r#type = MessageType::NoMorePages as i32;
    let t1 = h.pending(first, &body1);
    let t2 = h.pending(second, &body2);
    let t3 = h.pending(finish, b"");
    h.advance(2 * SEC);
    for t in [t1, t2, t3] {
        assert_eq!(status(&h.outcome(t).expect("answered")), Status::Busy);
    }
    let r = h.ok(data("t", 0, 0, 1 << 20), b"");
    assert_eq!(pages_of(&r).len(), 1);
    assert!(
        !r.header.buffer_complete,
        "the NO_MORE_PAGES behind the BUSY one did not apply"
    );
}

/// A waiting ENQUEUE whose client goes away is not applied, and neither is
/// anything its connection sent after it: a NO_MORE_PAGES applied without
/// the ENQUEUE before it would end the buffer short (review finding).
#[test]
fn requests_queued_behind_a_cancelled_enqueue_are_not_applied() {
    let setup = |h: &mut Harness| {
        h.ok(open("t", BufferKind::Partitioned, 1), b"");
        assert_eq!(status(&h.enqueue("t", 0, &[&[0u8; 5_000]])), Status::Ok);
        let (mut first, body1) = enqueue_req("t", 0, &[&[0u8; 2_000]]);
        first.max_wait_micros = 10_000_000;
        let (mut finish, _) = enqueue_req("t", 0, &[]);
        finish.r#type = MessageType::NoMorePages as i32;
        (h.pending(first, &body1), h.pending(finish, b""))
    };
    let not_short = |h: &mut Harness, how: &str| {
        let r = h.ok(data("t", 0, 0, 1 << 20), b"");
        assert_eq!(pages_of(&r).len(), 1, "{how}");
        assert!(
            !r.header.buffer_complete,
            "{how}: the NO_MORE_PAGES sent after the unapplied ENQUEUE ended the buffer"
        );
    };
    // The driver cancels the waiting ENQUEUE alone.
    let mut h = harness(small_limits());
    let (first, finish) = setup(&mut h);
    h.core.cancel(first, h.now);
    h.drain();
    h.check();
    assert_eq!(status(&h.outcome(finish).expect("answered")), Status::Busy);
    not_short(&mut h, "cancel");
    // The connection closes (its tickets are cancelled in no set order).
    for round in 0..8 {
        let mut h = harness(small_limits());
        setup(&mut h);
        h.core.connection_closed(ConnId(1), h.now);
        h.drain();
        h.check();
        not_short(&mut h, &format!("connection closed, round {round}"));
    }
}

#[test]
fn an_enqueue_past_the_page_count_limit_is_refused_whole() {
    let mut h = harness(CoreConfig {
        max_pages_per_enqueue: 4,
        ..CoreConfig::default()
    });
    h.ok(open("many", BufferKind::Partitioned, 1), b"");
    let five: Vec<&[u8]> = vec![b"a"; 5];
    let refused = h.enqueue("many", 0, &five);
    assert_refused(
        &refused,
        Refusal::TooManyPages {
            task: tid("many"),
            buffer: 0,
            count: 5,
            limit: 4,
        },
    );
    for named in ["5 pages", "limit is 4", "max_pages_per_enqueue"] {
        assert!(
            refused.header.error.contains(named),
            "the text names the limit: {named}: {}",
            refused.header.error
        );
    }
    assert_eq!(h.core.memory_used(), 0, "nothing of it is stored");
    assert_eq!(status(&h.enqueue("many", 0, &five[..4])), Status::Ok);
    let r = h.reply(data("many", 0, 0, 1 << 20), b"");
    assert_eq!(pages_of(&r).len(), 4);
}

#[test]
fn zero_length_pages_count_and_a_buffer_holds_a_bounded_number_of_pages() {
    let mut h = harness(CoreConfig {
        max_pages_per_log: 1000,
        ..CoreConfig::default()
    });
    h.ok(open("z", BufferKind::Partitioned, 1), b"");
    let empty: Vec<&[u8]> = vec![b""; 600];
    assert_eq!(status(&h.enqueue("z", 0, &empty)), Status::Ok);
    assert!(
        h.core.memory_used() >= 600 * 64,
        "zero-length pages are not free: {}",
        h.core.memory_used()
    );
    let busy = h.enqueue("z", 0, &empty);
    assert_eq!(status(&busy), Status::Busy);
    assert_refused(
        &busy,
        Refusal::BufferFull {
            task: tid("z"),
            buffer: 0,
            count: 600,
            limit: h.core.config().max_pages_per_log,
        },
    );
    let r = h.ok(data("z", 0, 0, 0), b"");
    assert_eq!(
        pages_of(&r).len(),
        600,
        "zero-length pages are read like any other"
    );
    h.ok(ack("z", 0, 600), b"");
    assert_eq!(h.core.memory_used(), 0);
}

/// Two pages of 1.5 MiB in 3 MiB of `receive`, a 4 MiB receive buffer
/// (allocation `chunk`), into `buffer` of `task`: answered OK at once.
fn enqueue_in_place(h: &mut Harness, task: &str, buffer: u64, receive: &Bytes, chunk: u64) {
    let (mut r, _) = enqueue_req(task, buffer, &[]);
    r.page_sizes = vec![3 << 19, 3 << 19];
    let big = Payload {
        bytes: receive.slice(1..1 + (3 << 20)),
        chunk: Some((chunk, 4 << 20)),
    };
    let Handled::Reply(reply) = h.send(ConnId(1), r, big).1 else {
        panic!("ENQUEUE waited")
    };
    assert_eq!(status(&reply), Status::Ok, "{}", reply.header.error);
}

#[test]
fn small_bodies_are_copied_out_of_large_receive_buffers_and_large_ones_charge_their_buffer() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("m", BufferKind::Partitioned, 2), b"");
    // One byte in a 4 MiB receive buffer: copied, so only the byte counts.
    let receive = Bytes::from(vec![7u8; 4 << 20]);
    let (r, _) = enqueue_req("m", 0, &[b"x"]);
    let one = Payload {
        bytes: receive.slice(10..11),
        chunk: Some((42, 4 << 20)),
    };
    let Handled::Reply(reply) = h.send(ConnId(1), r, one).1 else {
        panic!("ENQUEUE waited")
    };
    assert_eq!(status(&reply), Status::Ok);
    let small = h.core.memory_used();
    assert!(
        small < 4096,
        "a copied byte costs its bookkeeping only: {small}"
    );
    // Two pages of 1.5 MiB in 3 MiB of the same buffer: kept in place,
    // charged the whole buffer once.
    enqueue_in_place(&mut h, "m", 1, &receive, 43);
    let used = h.core.memory_used() - small;
    assert!(
        (4 << 20..(4 << 20) + 4096).contains(&used),
        "the receive buffer counts once, whole: {used}"
    );
    h.ok(data("m", 1, 1, 0), b"");
    assert!(
        h.core.memory_used() - small >= 4 << 20,
        "half its pages still pin it"
    );
    h.ok(ack("m", 1, 2), b"");
    assert_eq!(h.core.memory_used(), small);
}

/// Under a small limit, pages whose receive buffer would not fit (the
/// room now, or the limit at all) are copied out instead: 3 MiB of pages in
/// a 4 MiB buffer under a 4 MiB limit that holds a little already are
/// stored, charged their bytes, where they were refused as never fitting
/// (or waited for room no consumer would make). Only pages larger than the
/// limit themselves never fit.
#[test]
fn pages_whose_receive_buffer_finds_no_room_are_copied_out() {
    let mut h = harness(CoreConfig {
        memory_limit: 4 << 20,
        task_memory_limit: 4 << 20,
        ..CoreConfig::default()
    });
    h.ok(open("c", BufferKind::Partitioned, 2), b"");
    h.enqueue("c", 0, &[&[1u8; 1000]]);
    let before = h.core.memory_used();
    let receive = Bytes::from(vec![7u8; 4 << 20]);
    enqueue_in_place(&mut h, "c", 1, &receive, 44);
    let used = h.core.memory_used() - before;
    assert!(
        (3 << 20..(3 << 20) + 4096).contains(&used),
        "charged the pages' bytes, not their 4 MiB buffer: {used}"
    );
    let r = h.ok(data("c", 1, 0, 4 << 20), b"");
    assert_eq!(pages_of(&r).len(), 2);
    assert!(
        pages_of(&r)
            .iter()
            .all(|p| p.len() == 3 << 19 && p.iter().all(|&b| b == 7)),
        "the copies are the pages"
    );
    h.ok(ack("c", 1, 2), b"");
    // Pages of more than the limit can never fit, copied or not.
    let (mut r, _) = enqueue_req("c", 0, &[]);
    r.page_sizes = vec![(4 << 20) + 1];
    let huge = Bytes::from(vec![0u8; (4 << 20) + 1]);
    let reply = h.reply(r, &huge);
    assert_eq!(status(&reply), Status::BadRequest);
    assert!(
        reply
            .header
            .error
            .contains("can never fit the memory limit"),
        "{}",
        reply.header.error
    );
}

/// HELLO's `max-enqueue-bytes=` (the smaller limit less 384) holds: 1 to 5
/// pages whose bytes, with 128 a page, are exactly at it are stored into an
/// empty daemon; pages whose bytes and least index slots (4 at least) pass
/// the limit are refused at once as never fitting, naming their pages,
/// empty pages too.
#[test]
fn an_enqueue_within_what_hello_says_is_never_refused_as_never_fitting() {
    use crate::page_log::SLOT_BYTES;
    let limit: u64 = 1 << 20;
    let said = limit - 3 * binx_proto::ENQUEUE_PAGE_COST;
    for count in 1..=5u64 {
        let mut h = harness(CoreConfig {
            memory_limit: limit,
            task_memory_limit: limit,
            ..CoreConfig::default()
        });
        h.ok(open("w", BufferKind::Partitioned, 1), b"");
        let bytes = said - count * binx_proto::ENQUEUE_PAGE_COST;
        let (mut r, _) = enqueue_req("w", 0, &[]);
        r.page_sizes = (0..count)
            .map(|i| bytes / count + u64::from(i == 0) * (bytes % count))
            .collect();
        let body = vec![3u8; bytes as usize];
        let reply = h.reply(r, &body);
        assert_eq!(
            status(&reply),
            Status::Ok,
            "{count} pages: {}",
            reply.header.error
        );
    }
    let mut h = harness(CoreConfig {
        memory_limit: limit,
        task_memory_limit: limit,
        ..CoreConfig::default()
    });
    h.ok(open("w", BufferKind::Partitioned, 1), b"");
    // One page that fits only with one slot, not with the 4 an index holds.
    let size = limit - 4 * SLOT_BYTES + 1;
    let (mut r, _) = enqueue_req("w", 0, &[]);
    r.page_sizes = vec![size];
    let reply = h.reply(r, &vec![0u8; size as usize]);
    assert_eq!(status(&reply), Status::BadRequest);
    assert!(
        reply.header.error.contains("in 1 pages")
            && reply
                .header
                .error
                .contains("can never fit the memory limit of 1048576 bytes"),
        "{}",
        reply.header.error
    );
    // Empty pages whose slots alone pass the limit.
    let many = limit / SLOT_BYTES + 1;
    let (mut r, _) = enqueue_req("w", 0, &[]);
    r.page_sizes = vec![0; many as usize];
    let reply = h.reply(r, b"");
    assert_eq!(status(&reply), Status::BadRequest, "{}", reply.header.error);
    assert!(
        reply
            .header
            .error
            .contains(&format!("0 bytes in {many} pages")),
        "{}",
        reply.header.error
    );
    assert_eq!(h.core.memory_used(), 0);
}

#[test]
fn abort_frees_memory_and_consumers_see_the_reason() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 0), b"");
    h.enqueue("t", 0, &[b"data"]);
    let mut abort = req(MessageType::AbortTask, "t", 0);
    abort.reason = "worker lost".into();
    h.ok(abort, b"");
    assert_eq!(h.core.memory_used(), 0);
    let r = h.reply(data("t", 0, 3, 0), b"");
    assert_eq!(status(&r), Status::ServerError);
    assert_eq!(r.header.error, "task t was aborted: worker lost");
    assert_eq!(r.header.page_token, 3);
    assert_eq!(status(&h.enqueue("t", 0, &[b"x"])), Status::ServerError);
    assert_eq!(
        status(&h.reply(open("t", BufferKind::Partitioned, 0), b"")),
        Status::BadRequest
    );
    // Repeated aborts of one id take no more room.
    for _ in 0..1000 {
        let mut abort = req(MessageType::AbortTask, "t", 0);
        abort.reason = "x".repeat(100_000);
        h.ok(abort, b"");
    }
    let r = h.reply(data("t", 0, 0, 0), b"");
    assert!(
        r.header.error.len() <= crate::MAX_REASON_LEN,
        "{}",
        r.header.error.len()
    );
}

#[test]
fn delete_frees_the_buffer_and_later_data_is_complete() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    h.enqueue("t", 0, &[b"abc"]);
    h.ok(req(MessageType::Delete, "t", 0), b"");
    h.ok(req(MessageType::Delete, "t", 0), b"");
    assert_eq!(h.core.memory_used(), 0);
    let r = h.ok(data("t", 0, 0, 0), b"");
    assert!(r.header.buffer_complete && r.body.is_empty());
    assert_eq!(status(&h.enqueue("t", 0, &[b"more"])), Status::Ok);
    assert_eq!(
        h.core.memory_used(),
        0,
        "pages for a deleted buffer are dropped"
    );
    assert_eq!(h.core.stats().pages_dropped, 1);
    h.ok(req(MessageType::NoMorePages, "t", ALL_BUFFERS), b"");
    h.ok(req(MessageType::Delete, "t", 1), b"");
    assert_eq!(h.core.stats().tasks, 0);
    assert!(h.ok(data("t", 1, 0, 0), b"").header.buffer_complete);
}

#[test]
fn a_delete_or_ack_before_the_task_opens_is_remembered_and_its_pages_are_dropped() {
    let mut h = harness(CoreConfig::default());
    h.ok(req(MessageType::Delete, "early", 1), b"");
    h.ok(ack("early", 2, 0), b"");
    assert_eq!(
        status(&h.reply(ack("early", 3, 5), b"")),
        Status::BadRequest
    );
    h.ok(open("early", BufferKind::Partitioned, 4), b"");
    assert_eq!(status(&h.enqueue("early", 1, &[b"gone"])), Status::Ok);
    assert_eq!(status(&h.enqueue("early", 2, &[b"gone too"])), Status::Ok);
    assert_eq!(status(&h.enqueue("early", 0, &[b"kept"])), Status::Ok);
    assert_eq!(h.core.stats().pages_dropped, 2);
    assert_eq!(h.core.pages_held(), 1);
    let r = h.ok(data("early", 1, 0, 0), b"");
    assert!(r.header.buffer_complete && r.body.is_empty());
    // A broadcast set frees pages with an early-deleted buffer in it.
    h.ok(req(MessageType::Delete, "bc", 1), b"");
    h.ok(open("bc", BufferKind::Broadcast, 2), b"");
    h.enqueue("bc", 0, &[b"p"]);
    h.ok(data("bc", 0, 0, 0), b"");
    h.ok(ack("bc", 0, 1), b"");
    assert_eq!(h.core.pages_held(), 1, "only `early`'s page is left");
}

#[test]
fn an_abandoned_buffer_never_reads_as_complete_and_later_pages_are_dropped() {
    let mut h = harness(CoreConfig {
        abandon_after: 10 * SEC,
        ..CoreConfig::default()
    });
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    h.enqueue("t", 0, &[b"abandoned"]);
    h.enqueue("t", 1, &[b"polled"]);
    h.advance(6 * SEC);
    h.ok(data("t", 1, 0, 0), b"");
    h.advance(6 * SEC);
    assert_eq!(
        h.core.stats().abandoned_buffers,
        1,
        "only buffer 0 went unpolled for 10 s"
    );
    let r = h.reply(data("t", 0, 0, 0), b"");
    assert_refused(
        &r,
        Refusal::BufferAbandoned {
            task: tid("t"),
            buffer: 0,
            after: 10 * SEC,
        },
    );
    assert!(!r.header.buffer_complete);
    assert_eq!(status(&h.enqueue("t", 0, &[b"late"])), Status::Ok);
    assert_eq!(h.core.stats().pages_dropped, 1);
    // The task ends as abandoned, never as finished.
    h.ok(req(MessageType::NoMorePages, "t", ALL_BUFFERS), b"");
    h.ok(req(MessageType::Delete, "t", 1), b"");
    assert_eq!(h.core.stats().tasks, 0);
    let r = h.reply(data("t", 0, 0, 0), b"");
    assert_refused(&r, Refusal::TaskAbandoned { task: tid("t") });
}

#[test]
fn a_task_without_buffers_stays_while_its_producer_writes_and_then_ends_abandoned() {
    let mut h = harness(CoreConfig {
        abandon_after: 10 * SEC,
        ..CoreConfig::default()
    });
    h.ok(open("b", BufferKind::Broadcast, 0), b"");
    for _ in 0..5 {
        assert_eq!(status(&h.enqueue("b", 0, &[b"page"])), Status::Ok);
        h.advance(5 * SEC);
    }
    assert_eq!(h.core.stats().tasks, 1, "a writing producer keeps its task");
    h.advance(20 * SEC);
    assert_eq!(
        h.core.stats().tasks,
        1,
        "nor is it dropped while its producer holds its connection"
    );
    h.core.connection_closed(ConnId(1), h.now);
    h.advance(20 * SEC);
    assert_eq!(h.core.stats().tasks, 0);
    let r = h.reply(data("b", 0, 0, 0), b"");
    assert_eq!(
        status(&r),
        Status::ServerError,
        "never complete: {}",
        r.header.error
    );
    let late = h.enqueue("b", 0, &[b"late"]);
    assert_eq!(status(&late), Status::ServerError, "refused, saying why");
    assert_refused(
        &late,
        Refusal::ProducerOfDroppedTask {
            what: Mutation::Enqueue,
            task: tid("b"),
            after: 10 * SEC,
        },
    );
    assert_eq!(h.core.memory_used(), 0);
}

/// An operator's listing is bounded: a task and each of its buffers take
/// one of the room given, the first tasks by id are listed while they fit,
/// and the listing says when more matched.
#[test]
fn a_listing_of_tasks_stops_at_its_room_and_says_so() {
    let mut h = harness(CoreConfig::default());
    for task in ["l.a", "l.b", "l.c", "other"] {
        h.ok(open(task, BufferKind::Partitioned, 4), b"");
        for buffer in 0..3 {
            h.enqueue(task, buffer, &[b"p"]);
        }
    }
    let listed = |room: usize| {
        let mut left = room;
        let (tasks, more) = h.core.task_snapshots_within("l.", h.now, &mut left);
        let ids: Vec<String> = tasks.into_iter().map(|t| t.task_id).collect();
        (ids, more, left)
    };
    assert_eq!(
        listed(12),
        (vec!["l.a".into(), "l.b".into(), "l.c".into()], false, 0)
    );
    assert_eq!(
        listed(100),
        (vec!["l.a".into(), "l.b".into(), "l.c".into()], false, 88)
    );
    assert_eq!(listed(11), (vec!["l.a".into(), "l.b".into()], true, 3));
    assert_eq!(listed(3), (Vec::<String>::new(), true, 3));
    assert_eq!(h.core.task_snapshots("", h.now).len(), 4);
}

#[test]
fn bad_requests_name_what_was_wrong() {
    let mut h = harness(CoreConfig::default());
    let cases: Vec<(BinRequest, &[u8], &str)> = vec![
        (data("", 0, 0, 0), b"", "task_id is empty"),
        (data("../etc", 0, 0, 0), b"", "contains '/'"),
        (data("..", 0, 0, 0), b"", "not allowed"),
    ];
    for (request, body, expected) in cases {
        let r = h.reply(request, body);
        assert_eq!(status(&r), Status::BadRequest);
        assert!(
            r.header.error.contains(expected),
            "{:?} lacks {expected:?}",
            r.header.error
        );
    }
    let r = h.reply(req(MessageType::Enqueue, "nope", 0), b"");
    assert_refused(
        &r,
        Refusal::EnqueueUnknownTask {
            task: tid("nope"),
            after: h.core.config().abandon_after,
        },
    );
    let r = h.reply(open("t", BufferKind::Partitioned, 1_000_000), b"");
    assert_refused(
        &r,
        Refusal::BufferCountOverLimit {
            task: tid("t"),
            count: 1_000_000,
            limit: h.core.config().max_buffers_per_task,
        },
    );
    let unknown = BinRequest {
        r#type: 99,
        ..Default::default()
    };
    let r = h.reply(unknown, b"");
    assert_refused(&r, Refusal::UnknownMessageType { number: 99 });
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    let mut r = req(MessageType::Enqueue, "t", 0);
    r.page_sizes = vec![5];
    let reply = h.reply(r, b"abc");
    assert_refused(
        &reply,
        Refusal::BadPages {
            task: tid("t"),
            buffer: 0,
            why: "page sizes add up to 5 bytes but the body has 3".into(),
        },
    );
    let reply = h.reply(data("t", 2, 7, 0), b"");
    assert_refused(
        &reply,
        Refusal::BufferBeyondCount {
            task: tid("t"),
            buffer: 2,
            count: 2,
        },
    );
    assert_eq!(reply.header.page_token, 7);
    assert_refused(
        &h.reply(open_with("s", BufferKind::Partitioned, 1, "always"), b""),
        Refusal::NeedsSpoolStore {
            task: tid("s"),
            policy: SpoolPolicy::Always,
        },
    );
    assert_eq!(h.core.stats().tasks, 1);
}

#[test]
fn draining_refuses_new_tasks_and_serves_existing_ones() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("old", BufferKind::Partitioned, 1), b"");
    h.enqueue("old", 0, &[b"page"]);
    assert!(h.core.start_drain(h.now));
    assert!(!h.core.start_drain(h.now));
    let r = h.reply(open("new", BufferKind::Partitioned, 1), b"");
    assert_refused(&r, Refusal::Draining { task: tid("new") });
    h.ok(open("old", BufferKind::Partitioned, 1), b"");
    assert_eq!(status(&h.enqueue("old", 0, &[b"more"])), Status::Ok);
    assert_eq!(h.core.pages_held(), 2);
    h.ok(req(MessageType::NoMorePages, "old", 0), b"");
    assert!(h.ok(data("old", 0, 0, 100), b"").header.buffer_complete);
    h.ok(req(MessageType::Delete, "old", 0), b"");
    assert_eq!(h.core.pages_held(), 0);
    assert!(h.core.stats().draining);
}

#[test]
fn snapshots_show_each_buffer_state_tokens_and_bytes() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("q.1", BufferKind::Partitioned, 3), b"");
    h.ok(open("q.2", BufferKind::Broadcast, 2), b"");
    h.ok(open("other", BufferKind::Partitioned, 1), b"");
    h.enqueue("q.1", 0, &[b"aa", b"bbb"]);
    h.enqueue("q.1", 1, &[b"c"]);
    h.enqueue("q.1", 2, &[b"dddd"]);
    h.ok(req(MessageType::NoMorePages, "q.1", 1), b"");
    h.ok(req(MessageType::NoMorePages, "q.1", 2), b"");
    h.ok(data("q.1", 1, 0, 100), b"");
    h.ok(ack("q.1", 1, 1), b"");
    h.ok(ack("q.1", 0, 1), b"");
    h.enqueue("q.2", 0, &[b"xy"]);
    h.ok(data("q.2", 0, 0, 100), b"");
    h.ok(data("q.2", 1, 0, 100), b"");
    h.ok(ack("q.2", 0, 1), b"");

    let snaps = h.core.task_snapshots("q.", h.now);
    let ids: Vec<&str> = snaps.iter().map(|t| t.task_id.as_str()).collect();
    assert_eq!(ids, ["q.1", "q.2"], "the prefix selects, sorted by id");
    let q1 = &snaps[0];
    assert_eq!(
        (q1.kind, q1.buffer_count),
        (BufferKind::Partitioned, Some(3))
    );
    let view: Vec<_> = q1
        .buffers
        .iter()
        .map(|b| {
            (
                b.buffer_id,
                b.state,
                b.acknowledged_token,
                b.next_token,
                b.pages_held,
                b.bytes_held,
            )
        })
        .collect();
    assert_eq!(
        view,
        [
            (0, BufferState::Open, 1, 2, 1, 3),
            (1, BufferState::Complete, 1, 1, 0, 0),
            (2, BufferState::Finished, 0, 1, 1, 4),
        ]
    );
    let view: Vec<_> = snaps[1]
        .buffers
        .iter()
        .map(|b| {
            (
                b.buffer_id,
                b.acknowledged_token,
                b.pages_held,
                b.bytes_held,
            )
        })
        .collect();
    assert_eq!(
        view,
        [(0, 1, 0, 0), (1, 0, 1, 2)],
        "broadcast: each buffer's own view"
    );
    assert_eq!(h.core.task_snapshots("", h.now).len(), 3);
    let before = h.core.memory_used();
    let freed = h
        .core
        .abort_open_task("q.1", "operator", h.now)
        .expect("open");
    assert!(freed > 0 && freed < before);
    assert_eq!(h.core.abort_open_task("q.1", "operator", h.now), None);
}

#[test]
fn a_broadcast_consumer_that_comes_after_the_producer_finished_gets_every_page() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("late", BufferKind::Broadcast, 2), b"");
    h.enqueue("late", 0, &[b"one", b"two"]);
    h.ok(req(MessageType::NoMorePages, "late", ALL_BUFFERS), b"");
    for buffer in 0..2 {
        let r = h.ok(data("late", buffer, 0, 100), b"");
        assert_eq!(
            pages_of(&r),
            vec![b"one".to_vec(), b"two".to_vec()],
            "buffer {buffer}"
        );
        assert!(r.header.buffer_complete);
    }
    h.ok(ack("late", 0, 2), b"");
    h.ok(ack("late", 1, 2), b"");
    assert_eq!(h.core.memory_used(), 0, "freed once both have read");
}

#[test]
fn too_many_waiting_requests_on_one_connection_get_busy_at_once_and_ping_still_answers() {
    let mut h = harness(CoreConfig {
        max_outstanding_per_connection: 3,
        ..CoreConfig::default()
    });
    h.ok(open("t", BufferKind::Partitioned, 0), b"");
    for b in 0..3 {
        h.pending(waiting(data("t", b, 0, 0), 5 * SEC), b"");
    }
    let r = h.reply(waiting(data("t", 9, 0, 0), 5 * SEC), b"");
    assert_eq!(status(&r), Status::Busy);
    assert_refused(&r, Refusal::TooManyOutstanding { limit: 3 });
    h.ok(req(MessageType::Ping, "", 0), b"");
    // Another connection is not held back.
    let (_, handled) = h.send(
        ConnId(2),
        waiting(data("t", 9, 0, 0), 5 * SEC),
        Payload::empty(),
    );
    assert!(matches!(handled, Handled::Pending));
    h.core.connection_closed(ConnId(1), h.now);
    h.check();
    assert_eq!(h.core.stats().requests_waiting, 1);
}

// ------------------------------------------------------------------ spooling

fn overflow_limits() -> CoreConfig {
    CoreConfig {
        memory_limit: 1 << 20,
        task_memory_limit: 1 << 20,
        spool: Some(SpoolRules {
            spill_target_bytes: 100_000,
            spill_max_bytes: 200_000,
            ..SpoolRules::default()
        }),
        ..CoreConfig::default()
    }
}

#[test]
fn overflow_spills_the_task_s_oldest_memory_pages_first_instead_of_waiting() {
    let mut h = harness(overflow_limits());
    h.ok(open_with("o", BufferKind::Partitioned, 3, "overflow"), b"");
    let page = vec![b's'; 110_000];
    // Oldest pages in buffer 2, then buffer 0, then buffer 1.
    for buffer in [2u64, 0, 1] {
        for _ in 0..3 {
            assert_eq!(status(&h.enqueue("o", buffer, &[&page])), Status::Ok);
        }
    }
    let (mut more, body) = enqueue_req("o", 1, &[&page]);
    more.max_wait_micros = 5_000_000;
    let waiter = h.pending(more, &body);
    let spills: Vec<(String, u64)> = h
        .commands
        .iter()
        .filter_map(|(_, c)| match c {
            Command::WriteSegment {
                task, first_token, ..
            } => Some((task.to_string(), *first_token)),
            _ => None,
        })
        .collect();
    assert!(!spills.is_empty(), "room is made by spilling");
    assert!(
        !h.commands.iter().any(|(_, c)| matches!(
            c,
            Command::WriteSegment {
                committing: true,
                ..
            }
        )),
        "an overflow spill is no commit's"
    );
    h.complete(false);
    assert_eq!(status(&h.outcome(waiter).expect("room came")), Status::Ok);
    let snap = &h.core.task_snapshots("o", h.now)[0];
    let in_memory: Vec<u64> = snap.buffers.iter().map(|b| b.bytes_held).collect();
    assert!(
        in_memory[0] > 0 && in_memory[2] < in_memory[0],
        "buffer 2's pages were the oldest: {in_memory:?}"
    );
    // Every page reads back, from storage or memory, in order.
    for buffer in [2u64, 0] {
        let r = h.ok(data("o", buffer, 0, 1 << 20), b"");
        assert_eq!(pages_of(&r).len(), 3, "buffer {buffer}");
    }
}

fn spill_commands(h: &Harness) -> Vec<u64> {
    h.commands
        .iter()
        .filter_map(|(_, c)| match c {
            Command::WriteSegment { first_token, .. } => Some(*first_token),
            _ => None,
        })
        .collect()
}

#[test]
fn overflow_spills_ahead_of_need_past_three_quarters_of_the_limit() {
    let mut h = harness(overflow_limits());
    h.ok(open_with("o", BufferKind::Partitioned, 1, "overflow"), b"");
    let page = vec![b's'; 100_000];
    // 7 pages: about 2/3 of the 1 MiB limit; nothing spills yet.
    for _ in 0..7 {
        assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
    }
    assert_eq!(spill_commands(&h), Vec::<u64>::new());
    // The 8th crosses three quarters: OK at once, and the oldest pages
    // start going to storage while nothing waits for room.
    assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
    assert_eq!(spill_commands(&h).first(), Some(&0));
    h.complete(false);
    assert!(h.core.memory_used() <= 3 << 18, "{}", h.core.memory_used());
    // A task with policy off is never spilled, however full.
    let mut h = harness(overflow_limits());
    h.ok(open_with("plain", BufferKind::Partitioned, 1, "off"), b"");
    for _ in 0..9 {
        assert_eq!(status(&h.enqueue("plain", 0, &[&page])), Status::Ok);
    }
    assert_eq!(spill_commands(&h), Vec::<u64>::new());
    let r = h.ok(data("plain", 0, 0, 16 << 20), b"");
    assert_eq!(pages_of(&r).len(), 9);
}

#[test]
fn a_plan_reading_storage_names_the_next_object_to_read_ahead() {
    let mut h = harness(overflow_limits());
    h.ok(open_with("o", BufferKind::Partitioned, 1, "overflow"), b"");
    let page = vec![b's'; 100_000];
    for _ in 0..9 {
        assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
        h.complete(false);
    }
    let objects: Vec<(String, u64)> = h
        .stored()
        .iter()
        .map(|o| (o.name.clone(), o.first_token))
        .collect();
    assert!(
        objects.len() >= 2,
        "spilled into several objects: {objects:?}"
    );
    // One page of the first object: the plan reads it, and names the
    // second as the next to read.
    let Handled::Plan(plan) = h.send_req(data("o", 0, 0, 1), b"").1 else {
        panic!("the first pages are in storage");
    };
    let names: Vec<String> = plan.objects().map(|(m, _)| m.name.clone()).collect();
    assert_eq!(names, vec![objects[0].0.clone()]);
    assert_eq!(
        plan.read_ahead.as_ref().map(|m| m.name.clone()),
        Some(objects[1].0.clone())
    );
    let r = h.read(plan);
    assert_eq!(pages_of(&r).len(), 1);
}

#[test]
fn a_failed_spill_pauses_spilling_instead_of_retrying_at_once() {
    let mut h = harness(overflow_limits());
    h.ok(open_with("o", BufferKind::Partitioned, 1, "overflow"), b"");
    // Past three quarters of the memory limit: spills start ahead of need.
    let page = vec![b's'; 200_000];
    for _ in 0..4 {
        assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
    }
    let writes = |h: &mut Harness| {
        h.drain();
        h.commands
            .iter()
            .filter(|(_, c)| matches!(c, Command::WriteSegment { .. }))
            .count()
    };
    assert!(writes(&mut h) > 0, "no spill ahead of need");
    // The store fails every write: the pages stay, and no spill starts
    // again at once (it would spin on a full disk).
    for (op, command) in std::mem::take(&mut h.commands) {
        if let Command::WriteSegment { .. } = command {
            h.core
                .segment_written(op, Err(StoreFailure::transient("disk full")), h.now);
        }
    }
    assert_eq!(writes(&mut h), 0, "spilling again at once");
    h.advance(Duration::from_millis(100));
    assert_eq!(writes(&mut h), 0, "spilling again within the pause");
    h.advance(Duration::from_millis(500));
    assert!(writes(&mut h) > 0, "never tried again");
    h.complete(false);
    assert!(!h.stored().is_empty());
}

#[test]
fn a_reply_reads_back_at_most_max_stored_reply_size_of_objects() {
    let mut h = harness(CoreConfig {
        max_stored_reply_size: 300_000,
        ..overflow_limits()
    });
    h.ok(open_with("o", BufferKind::Partitioned, 1, "overflow"), b"");
    for i in 0..9u32 {
        let page = vec![b's'; 200_000 + i as usize];
        assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
        h.complete(false);
    }
    h.ok(req(MessageType::NoMorePages, "o", 0), b"");
    assert!(h.stored().len() >= 2, "spilled into several objects");
    // Every page once and in order, however the replies are cut; no reply
    // reads objects of more than 300 kB back, unless one object alone.
    let (mut token, mut seen) = (0u64, Vec::new());
    loop {
        let r = match h.send_req(data("o", 0, token, 64 << 20), b"").1 {
            Handled::Plan(plan) => {
                let read: Vec<u64> = plan.objects().map(|(m, _)| m.page_bytes()).collect();
                assert!(
                    read.len() == 1 || read.iter().sum::<u64>() <= 300_000,
                    "one reply reads back objects of {read:?} bytes"
                );
                h.read(plan)
            }
            Handled::Reply(r) => r,
            other => panic!("{other:?}"),
        };
        assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
        for page in pages_of(&r) {
            // The harness's store gives back what was written.
            assert!(page.iter().all(|b| *b == b's'), "page {}", seen.len());
            seen.push(page.len() - 200_000);
        }
        if r.header.buffer_complete {
            break;
        }
        token = r.header.page_next_token;
    }
    assert_eq!(seen, (0..9).collect::<Vec<usize>>());
}

#[test]
fn always_gives_tokens_to_zero_length_pages_and_commits_markers_before_ok() {
    let mut h = spooled(CoreConfig::default());
    h.ok(open_with("a", BufferKind::Partitioned, 1, "always"), b"");
    let (r, body) = enqueue_req("a", 0, &[b"", b""]);
    let t = h.pending(r, &body);
    h.complete(false);
    assert_eq!(status(&h.outcome(t).expect("written")), Status::Ok);
    let t = h.pending(req(MessageType::NoMorePages, "a", 0), b"");
    assert_eq!(h.markers().len(), 0, "the marker is written before OK");
    h.complete(false);
    assert_eq!(status(&h.outcome(t).expect("committed")), Status::Ok);
    assert_eq!(h.markers(), vec![("a".to_string(), 0)]);
    let r = h.ok(data("a", 0, 0, 0), b"");
    assert_eq!(pages_of(&r), vec![Vec::<u8>::new(), Vec::new()]);
    assert!(r.header.buffer_complete);
}

/// Opens task "a" (one buffer) under policy always and writes `pages`
/// into it, storage answering.
fn written_under_always(h: &mut MemoryDriver, pages: &[&[u8]]) {
    h.ok(open_with("a", BufferKind::Partitioned, 1, "always"), b"");
    let (r, body) = enqueue_req("a", 0, pages);
    let t = h.pending(r, &body);
    h.complete(false);
    h.outcome(t);
}

/// A NO_MORE_PAGES sent with a body (it carries no pages) keeps none of
/// it: counted as pending while it commits, it was never released
/// (review: memory_pending stuck, and the limit with it).
#[test]
fn a_no_more_pages_with_a_body_leaves_nothing_pending_once_committed() {
    let mut h = spooled(CoreConfig::default());
    written_under_always(&mut h, &[b"x"]);
    let t = h.pending(req(MessageType::NoMorePages, "a", 0), &[7u8; 1000]);
    assert_eq!(h.core.stats().memory_pending, 0, "its body is not kept");
    h.complete(false);
    assert_eq!(status(&h.outcome(t).expect("committed")), Status::Ok);
    assert_eq!(h.core.stats().memory_pending, 0);
    h.core.check_invariants().expect("invariants");
}

#[test]
fn a_committed_object_outlives_its_acknowledged_pages_until_the_marker_is_deleted() {
    let mut h = spooled(CoreConfig::default());
    written_under_always(&mut h, &[b"x", b"y"]);
    let t = h.pending(req(MessageType::NoMorePages, "a", 0), b"");
    h.complete(false);
    h.outcome(t);
    h.ok(ack("a", 0, 2), b"");
    h.complete(false);
    assert_eq!(h.stored().len(), 1, "the marker still names the object");
    // A marker that cannot be deleted keeps its objects (the TTL takes both).
    h.ok(req(MessageType::Delete, "a", 0), b"");
    h.complete(true);
    assert_eq!(h.stored().len(), 1);
    assert_eq!(h.markers().len(), 1);
    assert!(h.core.stats().deletes_left_to_ttl >= 1);
}

#[test]
fn a_deleted_buffer_s_marker_goes_first_then_its_objects() {
    let mut h = spooled(CoreConfig::default());
    written_under_always(&mut h, &[b"x"]);
    let t = h.pending(req(MessageType::NoMorePages, "a", 0), b"");
    h.complete(false);
    h.outcome(t);
    h.ok(req(MessageType::Delete, "a", 0), b"");
    h.drain();
    let order: Vec<&str> = h
        .commands
        .iter()
        .map(|(_, c)| match c {
            Command::DeleteMarker { .. } => "marker",
            Command::DeleteObject(_) => "object",
            _ => "other",
        })
        .collect();
    assert_eq!(order, ["marker"], "objects wait for the marker's deletion");
    h.complete(false);
    assert!(h.stored().is_empty() && h.markers().is_empty());
}

/// A durable ENQUEUE whose write fails stores nothing: BUSY when the
/// store fails for now, SERVER_ERROR when it refuses for good (retrying
/// would fail the same way); either way a later write starts at token 0.
#[test]
fn a_failed_durable_write_stores_nothing_and_says_whether_to_retry() {
    for (failure, expected) in [
        (
            StoreFailure::transient("the store is unreachable"),
            Status::Busy,
        ),
        (
            StoreFailure::permanent("spool store s3://b: access denied"),
            Status::ServerError,
        ),
    ] {
        let mut h = spooled(CoreConfig::default());
        h.ok(open_with("a", BufferKind::Partitioned, 1, "always"), b"");
        let (r, body) = enqueue_req("a", 0, &[b"x"]);
        let t = h.pending(r, &body);
        h.drain();
        for (op, command) in std::mem::take(&mut h.commands) {
            if let Command::WriteSegment { .. } = command {
                h.core.segment_written(op, Err(failure.clone()), h.now);
            }
        }
        let r = h.outcome(t).expect("answered");
        assert_eq!(status(&r), expected, "{}", r.header.error);
        assert_refused(
            &r,
            Refusal::DurableWriteFailed {
                task: tid("a"),
                buffer: 0,
                failure: failure.clone(),
            },
        );
        assert_eq!(h.core.pages_held(), 0);
        let (r, body) = enqueue_req("a", 0, &[b"y"]);
        let t = h.pending(r, &body);
        h.complete(false);
        assert_eq!(status(&h.outcome(t).expect("answered")), Status::Ok);
        assert_eq!(
            pages_of(&h.ok(data("a", 0, 0, 0), b"")),
            vec![b"y".to_vec()]
        );
    }
}

#[test]
fn a_drain_spools_finished_overflow_buffers_then_commits_them() {
    let mut h = spooled(CoreConfig::default());
    h.ok(
        open_with("ovf", BufferKind::Partitioned, 2, "overflow"),
        b"",
    );
    h.ok(open_with("mem", BufferKind::Partitioned, 1, "off"), b"");
    h.enqueue("ovf", 0, &[b"ss", b"ss"]);
    h.enqueue("ovf", 1, &[b"cc"]);
    h.enqueue("mem", 0, &[b"dd"]);
    h.ok(req(MessageType::NoMorePages, "ovf", 0), b"");
    h.ok(req(MessageType::NoMorePages, "mem", 0), b"");
    assert!(h.core.start_drain(h.now));
    h.drain();
    let writes: Vec<(String, u64, usize)> = h
        .commands
        .iter()
        .filter_map(|(_, c)| match c {
            Command::WriteSegment {
                task,
                first_token,
                pages,
                ..
            } => Some((task.to_string(), *first_token, pages.len())),
            _ => None,
        })
        .collect();
    assert_eq!(
        writes,
        vec![("ovf".to_string(), 0, 2)],
        "only the finished overflow buffer"
    );
    h.complete(false);
    assert_eq!(h.markers(), vec![("ovf".to_string(), 0)]);
    let r = h.ok(data("ovf", 0, 0, 0), b"");
    assert_eq!(
        pages_of(&r),
        vec![b"ss".to_vec(), b"ss".to_vec()],
        "served from storage"
    );
}

#[test]
fn a_drain_waits_out_a_failed_spill_and_commits_the_pages_after_it() {
    let mut h = spooled(CoreConfig::default());
    h.ok(
        open_with("ovf", BufferKind::Partitioned, 1, "overflow"),
        b"",
    );
    h.enqueue("ovf", 0, &[b"ss", b"ss"]);
    h.ok(req(MessageType::NoMorePages, "ovf", 0), b"");
    assert!(h.core.start_drain(h.now));
    // The first spill fails: no commit marker without the pages, and no
    // spill again at once.
    h.drain();
    for (op, command) in std::mem::take(&mut h.commands) {
        if let Command::WriteSegment { .. } = command {
            h.core.segment_written(
                op,
                Err(StoreFailure::transient("the store is unreachable")),
                h.now,
            );
        }
    }
    h.drain();
    assert!(
        !h.commands
            .iter()
            .any(|(_, c)| matches!(c, Command::WriteSegment { .. } | Command::WriteMarker(_))),
        "spilled again, or committed without the pages, within the pause"
    );
    // After the pause the spill is tried again, and the buffer committed.
    h.advance(Duration::from_millis(600));
    h.complete(false);
    assert_eq!(h.markers(), vec![("ovf".to_string(), 0)]);
    let r = h.ok(data("ovf", 0, 0, 0), b"");
    assert_eq!(pages_of(&r), vec![b"ss".to_vec(), b"ss".to_vec()]);
}

#[test]
fn a_drain_commits_every_buffer_of_a_finished_broadcast_set_even_unseen_ones() {
    let mut h = spooled(CoreConfig::default());
    h.ok(open_with("b", BufferKind::Broadcast, 3, "overflow"), b"");
    assert_eq!(status(&h.reply(data("b", 0, 0, 0), b"")), Status::NoData);
    h.ok(req(MessageType::NoMorePages, "b", ALL_BUFFERS), b"");
    h.core.start_drain(h.now);
    h.complete(false);
    let mut committed = h.markers();
    committed.sort();
    assert_eq!(
        committed,
        vec![
            ("b".to_string(), 0),
            ("b".to_string(), 1),
            ("b".to_string(), 2)
        ]
    );
}

// ------------------------------------------------------------------ proxy

/// A core that may forward to the remotes these tests name.
fn proxying() -> CoreConfig {
    CoreConfig {
        forward_allowed_peers: "10.0.0.0/8,elsewhere".parse().expect("peers"),
        ..CoreConfig::default()
    }
}

#[test]
fn a_remote_outside_the_allow_list_is_refused_before_anything_is_sent() {
    let mut h = spooled(CoreConfig::default());
    for remote in ["10.0.0.9:8091", "169.254.169.254:80", "evil.example:8091"] {
        let r = h.reply(proxy_data(remote, "q", 0, 0), b"");
        assert_refused(
            &r,
            Refusal::RemoteNotAllowed {
                remote: remote.into(),
                allowed: h.core.config().forward_allowed_peers.to_string(),
            },
        );
        let mut ack = proxy_data(remote, "q", 0, 0);
        ack.r#type = MessageType::Ack as i32;
        assert_eq!(status(&h.reply(ack, b"")), Status::BadRequest);
    }
    assert!(h.commands.is_empty(), "no command: {:?}", h.commands);
    assert_eq!(h.core.stats().forwards_refused, 6);
    // Loopback is allowed by default.
    let _ = h.pending(proxy_data("127.0.0.1:8091", "q", 0, 0), b"");
    assert!(matches!(
        h.commands.last(),
        Some((_, Command::Forward { remote, .. })) if remote == "127.0.0.1:8091"
    ));
}

fn proxy_data(remote: &str, task: &str, buffer: u64, token: u64) -> BinRequest {
    let mut r = data(task, buffer, token, 0);
    r.remote = remote.into();
    r
}

/// A forwarded DATA waits at most `max_wait`, as a local one does: the
/// forwarder waits for the reply as long as the request may, so a client's
/// hour-long wait at a silent remote would hold back TIMEOUT and failover
/// by as much (review finding).
#[test]
fn a_forwarded_data_waits_no_longer_than_max_wait() {
    let mut h = spooled(proxying());
    for (asked, sent) in [
        (Duration::from_secs(3600), SEC * 10),
        (Duration::from_secs(2), SEC * 2),
    ] {
        let _ = h.pending(waiting(proxy_data("10.0.0.9:8091", "q", 0, 0), asked), b"");
        let forwards: Vec<u64> = h
            .commands
            .drain(..)
            .filter_map(|(_, c)| match c {
                Command::Forward { request, .. } => Some(request.max_wait_micros),
                _ => None,
            })
            .collect();
        assert_eq!(forwards, [sent.as_micros() as u64], "asked {asked:?}");
    }
}

/// The last marker read asked for comes back as node-a's marker of
/// `buffer` of `task`: it is released, and nothing else is done.
fn marker_read_is_released(h: &mut Harness, task: &str, buffer: u64) {
    let read = OpId(h.core_last_op());
    h.core
        .marker_read(read, Ok(Some(marker(task, buffer, "node-a", &[3]))), h.now);
    h.drain();
    let released: Vec<Command> = h.commands.drain(..).map(|(_, c)| c).collect();
    let [Command::ReleaseCommitted(m)] = released.as_slice() else {
        panic!("released: {released:?}")
    };
    assert_eq!((m.task_id.as_str(), m.buffer_id), (task, buffer));
}

/// A spooling core whose commit markers name node `node-a`.
fn node_a() -> Harness {
    harness(CoreConfig {
        spool: Some(SpoolRules {
            node: "node-a".into(),
            ..SpoolRules::default()
        }),
        ..CoreConfig::default()
    })
}

fn marker(task: &str, buffer: u64, node: &str, pages: &[u64]) -> CommitMarker {
    CommitMarker {
        task_id: task.into(),
        buffer_id: buffer,
        end_token: pages.len() as u64,
        node: node.into(),
        endpoint: "elsewhere:1".into(),
        instance: None,
        shared: false,
        folded: false,
        segments: vec![ObjectMeta {
            store: 0,
            name: format!("{task}-committed"),
            first_token: 0,
            page_sizes: pages.to_vec(),
            stored_size: 0,
            codec: Default::default(),
            key: None,
            expires_at_unix_ms: 0,
        }],
    }
}

#[test]
fn a_marker_with_segments_out_of_order_never_serves_a_page_twice() {
    let mut h = spooled(proxying());
    let remote = "10.0.0.9:8091";
    h.core.remote_identified(remote, "node-b".into());
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "q", 0, 0));
    h.outcome(t);
    h.now += 31 * SEC;
    let (t, commands) = fail_forward(&mut h, proxy_data(remote, "q", 0, 0));
    let [Command::ReadMarker { .. }] = commands.as_slice() else {
        panic!("{commands:?}")
    };
    // Segments A (tokens 0-4), B (1-2) and C (3-9): B ends before A did.
    let mut forged = marker("q", 0, "node-b", &[]);
    forged.end_token = 10;
    let segment = |name: &str, first_token: u64, pages: usize| ObjectMeta {
        name: name.into(),
        first_token,
        page_sizes: vec![first_token + 1; pages],
        ..forged.segments[0].clone()
    };
    forged.segments = vec![segment("a", 0, 5), segment("b", 1, 2), segment("c", 3, 7)];
    for object in &forged.segments {
        h.put_segment(object.clone());
    }
    let read = OpId(h.core_last_op());
    h.core.marker_read(read, Ok(Some(forged)), h.now);
    h.drain();
    let r = h.outcome(t).expect("served from storage");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    // Tokens 0-4 from A and 5-9 from C, each once: before, C's pages from
    // token 3 followed A's, 12 pages for 10 tokens.
    let sizes: Vec<usize> = pages_of(&r).iter().map(Vec::len).collect();
    assert_eq!(sizes, [1, 1, 1, 1, 1, 4, 4, 4, 4, 4]);
    assert_eq!(r.header.page_next_token, 10);
    assert!(r.header.buffer_complete);
}

/// Forwards one proxy DATA that fails; returns the commands it led to.
fn fail_forward(h: &mut Harness, request: BinRequest) -> (Ticket, Vec<Command>) {
    let t = h.pending(request, b"");
    let (op, _) = h.commands.pop().expect("forwarded");
    h.core
        .forwarded(op, Err("connection refused".into()), h.now);
    h.drain();
    h.check();
    (t, h.commands.drain(..).map(|(_, c)| c).collect())
}

#[test]
fn failover_reads_a_marker_only_from_the_node_the_remote_is_and_only_after_failover_after() {
    let mut h = spooled(proxying());
    let remote = "10.0.0.9:8091";
    let (t, commands) = fail_forward(&mut h, proxy_data(remote, "q", 0, 0));
    assert!(commands.is_empty(), "failing only since now: {commands:?}");
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Timeout);
    h.now += 31 * SEC;
    // A marker of a node the remote never said it is, at another address,
    // is not served: naming an unreachable remote reads nothing.
    let (t, commands) = fail_forward(&mut h, proxy_data(remote, "q", 0, 0));
    let [Command::ReadMarker { .. }] = commands.as_slice() else {
        panic!("{commands:?}")
    };
    let read = OpId(h.core_last_op());
    h.core
        .marker_read(read, Ok(Some(marker("q", 0, "node-b", &[1]))), h.now);
    h.drain();
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Timeout);
    h.core.remote_identified(remote, "node-b".into());
    h.now += 31 * SEC;
    let (t, commands) = fail_forward(&mut h, proxy_data(remote, "q", 0, 0));
    let [Command::ReadMarker { .. }] = commands.as_slice() else {
        panic!("{commands:?}")
    };
    // A marker another node wrote is not served.
    let read = OpId(h.core_last_op());
    h.core
        .marker_read(read, Ok(Some(marker("q", 0, "node-c", &[1]))), h.now);
    h.drain();
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Timeout);
    // Storage is asked at most once per failover_after.
    let (t, commands) = fail_forward(&mut h, proxy_data(remote, "q", 0, 0));
    assert!(commands.is_empty());
    h.outcome(t);
    h.now += 31 * SEC;
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "q", 0, 0));
    let read = OpId(h.core_last_op());
    h.put_segment(marker("q", 0, "node-b", &[1, 1]).segments[0].clone());
    h.core
        .marker_read(read, Ok(Some(marker("q", 0, "node-b", &[1, 1]))), h.now);
    h.drain();
    let r = h.outcome(t).expect("served from storage");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert_eq!(pages_of(&r).len(), 2);
    assert!(r.header.buffer_complete);
    // From then on, without asking the remote.
    let r = h.reply(proxy_data(remote, "q", 0, 2), b"");
    assert!(r.header.buffer_complete);
    // DELETE releases it from storage and still tells the remote.
    let mut delete = req(MessageType::Delete, "q", 0);
    delete.remote = remote.into();
    h.ok(delete, b"");
    h.drain();
    let kinds: Vec<&str> = h
        .commands
        .iter()
        .map(|(_, c)| match c {
            Command::Forward { .. } => "forward",
            Command::ReleaseCommitted(_) => "release",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["forward", "release"]);
    // The same DELETE again (its reply was lost) is OK at once, not a
    // forward to the dead remote that times out.
    h.commands.clear();
    let mut again = req(MessageType::Delete, "q", 0);
    again.remote = remote.into();
    let r = h.reply(again, b"");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert!(h.commands.is_empty(), "{:?}", h.commands);
}

/// Forwards one proxy DATA that the remote answers with `status`.
fn answer_forward(h: &mut Harness, request: BinRequest, status: Status) -> Vec<Command> {
    let t = h.pending(request.clone(), b"");
    let (op, _) = h.commands.pop().expect("forwarded");
    let mut header = request;
    header.remote.clear();
    let reply = BinReply {
        request_id: header.request_id,
        status: status as i32,
        ..BinReply::default()
    };
    h.core.forwarded(
        op,
        Ok(binx_proto::Frame {
            header: reply,
            body: Default::default(),
        }),
        h.now,
    );
    h.drain();
    h.check();
    h.outcome(t).expect("answered");
    h.commands.drain(..).map(|(_, c)| c).collect()
}

/// Fails one proxy DATA's forward and takes its reply; returns how many
/// commit-marker reads it led to.
fn failed_reads(h: &mut Harness, request: BinRequest) -> usize {
    let (t, commands) = fail_forward(h, request);
    h.outcome(t);
    commands
        .iter()
        .filter(|c| matches!(c, Command::ReadMarker { .. }))
        .count()
}

/// A dead node's buffers fail over on one clock, the remote's: once it has
/// answered nothing for `failover_after`, a buffer first asked of it then
/// is due at once (review of issue 31: a source reading many buffers of a
/// dead node waited `failover_after` for each). Any answer from the remote
/// stops the clock; NO_DATA (the remote is alive but lost the buffer) keeps
/// the buffer's own clock; and a failure ten `failover_after`s after the
/// remote's previous one starts the silence over.
#[test]
fn a_remote_silent_for_failover_after_makes_its_other_buffers_due_at_once() {
    let mut h = spooled(proxying());
    let (dead, alive) = ("10.0.0.9:8091", "10.0.0.8:8091");
    let reads = |commands: &[Command]| {
        commands
            .iter()
            .filter(|c| matches!(c, Command::ReadMarker { .. }))
            .count()
    };
    assert_eq!(
        failed_reads(&mut h, proxy_data(dead, "q", 0, 0)),
        0,
        "silent only since now"
    );
    h.now += 20 * SEC;
    assert_eq!(
        failed_reads(&mut h, proxy_data(dead, "q", 1, 0)),
        0,
        "silent for 20 s of 30"
    );
    h.now += 11 * SEC;
    // Buffers 2 and 3 fail for the first time, 31 s into the silence.
    for buffer in [2, 3] {
        let (t, commands) = fail_forward(&mut h, proxy_data(dead, "q", buffer, 0));
        assert_eq!(reads(&commands), 1, "buffer {buffer}: {commands:?}");
        let read = OpId(h.core_last_op());
        h.core.marker_read(read, Ok(None), h.now);
        h.drain();
        assert_eq!(status(&h.outcome(t).expect("answered")), Status::Timeout);
    }
    // Another remote's silence is its own.
    assert_eq!(failed_reads(&mut h, proxy_data(alive, "q", 4, 0)), 0);
    // The dead remote answers (any status): its clock stops, and a buffer
    // that fails after that waits its own failover_after again.
    assert_eq!(
        reads(&answer_forward(
            &mut h,
            proxy_data(dead, "q", 5, 0),
            Status::Timeout
        )),
        0
    );
    assert_eq!(
        failed_reads(&mut h, proxy_data(dead, "q", 6, 0)),
        0,
        "the remote answered"
    );
    // NO_DATA from a live remote starts only that buffer's clock (and
    // ends that remote's silence: buffer 4's failure was 31 s ago).
    h.now += 31 * SEC;
    assert_eq!(
        reads(&answer_forward(
            &mut h,
            proxy_data(alive, "q", 7, 0),
            Status::NoData
        )),
        0
    );
    assert_eq!(
        failed_reads(&mut h, proxy_data(alive, "q", 12, 0)),
        0,
        "the remote answered"
    );
    // A silence nobody asked the remote about for ten failover_afters
    // (longer than any client's retry pacing) starts over: the dead
    // remote's last failure was 301 s before this request.
    h.now += 270 * SEC;
    assert_eq!(
        failed_reads(&mut h, proxy_data(dead, "q", 8, 0)),
        0,
        "an old silence"
    );
    h.now += 30 * SEC;
    let (t, commands) = fail_forward(&mut h, proxy_data(dead, "q", 9, 0));
    assert_eq!(reads(&commands), 1, "silent for 30 s again: {commands:?}");
    let read = OpId(h.core_last_op());
    h.put_segment(marker("q", 9, "node-b", &[2]).segments[0].clone());
    let mut m = marker("q", 9, "node-b", &[2]);
    m.endpoint = dead.into();
    h.core.marker_read(read, Ok(Some(m)), h.now);
    h.drain();
    let r = h.outcome(t).expect("served from storage");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert_eq!(pages_of(&r).len(), 1);
    // Silent since its first failure after its last answer, not since an
    // old request that failed late went out: the remote answered while
    // that request was outstanding (review: a half-open stripe's timeout
    // dated the silence back past the answer).
    let flaky = "10.0.0.7:8091";
    let t_old = h.pending(proxy_data(flaky, "q", 11, 0), b"");
    let (old, _) = h.commands.pop().expect("forwarded");
    h.now += 5 * SEC;
    assert_eq!(
        reads(&answer_forward(
            &mut h,
            proxy_data(flaky, "q", 12, 0),
            Status::Ok
        )),
        0
    );
    h.now += 15 * SEC;
    h.core
        .forwarded(old, Err("request timed out".into()), h.now);
    h.drain();
    h.outcome(t_old);
    assert!(h.commands.is_empty(), "{:?}", h.commands);
    h.now += 11 * SEC;
    assert_eq!(
        failed_reads(&mut h, proxy_data(flaky, "q", 13, 0)),
        0,
        "silent for 11 s only"
    );
    h.now += 20 * SEC;
    let (t, commands) = fail_forward(&mut h, proxy_data(flaky, "q", 14, 0));
    h.outcome(t);
    assert_eq!(reads(&commands), 1, "silent for 31 s: {commands:?}");
}

/// One shard of a proxying, spooled exchange whose shards share `silences`.
fn proxy_shard(silences: &RemoteSilences) -> Harness {
    let config = CoreConfig {
        spool: Some(SpoolRules::default()),
        ..proxying()
    };
    let mut h = harness(config.clone());
    h.core = Core::shard(config, MemoryBudget::new(64 << 20), silences.clone());
    h
}

/// A remote whose HELLO replies name another process instance than before
/// restarted and lost every buffer it held: a buffer it then answers NO_DATA
/// for is due for its commit marker at once, on every shard, instead of
/// after a `failover_after` of its own (a restarted sidecar otherwise cost
/// its readers one `failover_after` per buffer). Only for ten
/// `failover_after`s after the restart was seen; a remote first seen, or
/// seen with the same instance, keeps the buffer's own clock; and what is
/// served is still decided by the marker (only the node that wrote it).
#[test]
fn a_buffer_a_restarted_remote_cannot_serve_is_due_for_its_marker_at_once() {
    let silences = RemoteSilences::new(16);
    let (mut a, mut b) = (proxy_shard(&silences), proxy_shard(&silences));
    let remote = "10.0.0.9:8091";
    // The remote answers NO_DATA for a buffer: the commit-marker reads
    // that leads to (the request stays parked while one is under way).
    let no_data = |h: &mut Harness, buffer: u64| -> (Ticket, usize) {
        let t = h.pending(proxy_data(remote, "q", buffer, 0), b"");
        let (op, _) = h.commands.pop().expect("forwarded");
        let header = BinReply {
            status: Status::NoData as i32,
            ..BinReply::default()
        };
        let frame = binx_proto::Frame {
            header,
            body: Default::default(),
        };
        h.core.forwarded(op, Ok(frame), h.now);
        h.drain();
        h.check();
        let reads = h
            .commands
            .drain(..)
            .filter(|(_, c)| matches!(c, Command::ReadMarker { .. }))
            .count();
        (t, reads)
    };
    a.core
        .remote_instance(remote, Arc::from("instance-1"), a.now);
    a.core
        .remote_instance(remote, Arc::from("instance-1"), a.now);
    let (t, reads) = no_data(&mut a, 0);
    assert_eq!(reads, 0, "no restart seen: the buffer's own clock");
    assert_eq!(status(&a.outcome(t).expect("answered")), Status::NoData);
    assert_eq!(a.core.stats().remote_restarts, 0);
    // The remote restarts: shard b, which never forwarded to it before,
    // sees the new instance first, and tells the restart from what shard
    // a saw; the restart is counted once.
    b.now = a.now + SEC;
    b.core
        .remote_instance(remote, Arc::from("instance-2"), b.now);
    b.core
        .remote_instance(remote, Arc::from("instance-2"), b.now);
    assert_eq!(b.core.stats().remote_restarts, 1);
    a.now = b.now;
    a.core
        .remote_instance(remote, Arc::from("instance-2"), a.now);
    assert_eq!(a.core.stats().remote_restarts, 0);
    // Both shards' buffers are due at once, a's and b's.
    for h in [&mut a, &mut b] {
        let (t, reads) = no_data(h, 1);
        assert_eq!(reads, 1);
        let read = OpId(h.core_last_op());
        let mut m = marker("q", 1, "node-b", &[2]);
        m.endpoint = remote.into();
        h.put_segment(m.segments[0].clone());
        h.core.marker_read(read, Ok(Some(m)), h.now);
        h.drain();
        let r = h.outcome(t).expect("served from storage");
        assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
        assert_eq!(pages_of(&r).len(), 1);
        assert!(r.header.buffer_complete);
    }
    // A marker of another node at another address is not served.
    let (t, reads) = no_data(&mut a, 4);
    assert_eq!(reads, 1);
    a.core.marker_read(
        OpId(a.core_last_op()),
        Ok(Some(marker("q", 4, "node-x", &[2]))),
        a.now,
    );
    a.drain();
    assert_eq!(status(&a.outcome(t).expect("answered")), Status::NoData);
    // No marker (a buffer of the new process, or never committed): the
    // buffer keeps failing, and storage is asked again only after
    // failover_after.
    let (t, reads) = no_data(&mut a, 2);
    assert_eq!(reads, 1);
    a.core.marker_read(OpId(a.core_last_op()), Ok(None), a.now);
    a.drain();
    assert_eq!(status(&a.outcome(t).expect("answered")), Status::NoData);
    a.now += 10 * SEC;
    let (t, reads) = no_data(&mut a, 2);
    assert_eq!(reads, 0, "asked 10 s ago");
    a.outcome(t);
    a.now += 21 * SEC;
    let (t, reads) = no_data(&mut a, 2);
    assert_eq!(reads, 1, "asked 31 s ago");
    a.core.marker_read(OpId(a.core_last_op()), Ok(None), a.now);
    a.drain();
    a.outcome(t);
    // A live buffer of the new process answers NO_DATA between its pages:
    // its marker is read at once only once for the restart, not after
    // every OK (review: a read per NO_DATA for ten failover_afters).
    let (t, reads) = no_data(&mut a, 5);
    assert_eq!(reads, 1);
    a.core.marker_read(OpId(a.core_last_op()), Ok(None), a.now);
    a.drain();
    a.outcome(t);
    assert!(answer_forward(&mut a, proxy_data(remote, "q", 5, 0), Status::Ok).is_empty());
    let (t, reads) = no_data(&mut a, 5);
    assert_eq!(reads, 0, "read at once for this restart already");
    a.outcome(t);
    // No answer at all is silence, timed as ever, not a restart's NO_DATA;
    // TIMEOUT is an answer like NO_DATA.
    let (t, commands) = fail_forward(&mut a, proxy_data(remote, "q", 6, 0));
    a.outcome(t);
    assert!(commands.is_empty(), "silent only since now: {commands:?}");
    let t = a.pending(proxy_data(remote, "q", 7, 0), b"");
    let (op, _) = a.commands.pop().expect("forwarded");
    let header = BinReply {
        status: Status::Timeout as i32,
        ..BinReply::default()
    };
    a.core.forwarded(
        op,
        Ok(binx_proto::Frame {
            header,
            body: Default::default(),
        }),
        a.now,
    );
    a.drain();
    let commands: Vec<Command> = a.commands.drain(..).map(|(_, c)| c).collect();
    let [Command::ReadMarker { .. }] = commands.as_slice() else {
        panic!("TIMEOUT after a restart: {commands:?}")
    };
    a.core.marker_read(OpId(a.core_last_op()), Ok(None), a.now);
    a.drain();
    a.outcome(t);
    // Another restart: once more, unless storage was asked for the buffer
    // in the last failover_after (buffer 2, 10 s ago).
    a.now += 10 * SEC;
    a.core
        .remote_instance(remote, Arc::from("instance-3"), a.now);
    let (t, reads) = no_data(&mut a, 2);
    assert_eq!(
        reads, 0,
        "asked 10 s ago: the throttle holds after a restart too"
    );
    a.outcome(t);
    let (t, reads) = no_data(&mut a, 5);
    assert_eq!(reads, 1, "a new restart");
    a.core.marker_read(OpId(a.core_last_op()), Ok(None), a.now);
    a.drain();
    a.outcome(t);
    // A late reply over a connection to an earlier process is not one.
    b.core
        .remote_instance(remote, Arc::from("instance-1"), b.now);
    assert_eq!(
        a.core.stats().remote_restarts + b.core.stats().remote_restarts,
        2
    );
    // Ten failover_afters after the restart, a buffer's own clock again.
    a.now += 301 * SEC;
    let (t, reads) = no_data(&mut a, 3);
    assert_eq!(reads, 0, "the restart was 301 s ago");
    a.outcome(t);
}

/// Tasks live on different shards, and a remote is one node whatever the
/// task: a shard that finds a remote silent makes the other shards' first
/// failures due at once too.
/// Forwards `request` and answers it as process `instance` of the remote,
/// with `status` and, for OK, one page of `page` at the token asked.
fn answer_from(
    h: &mut Harness,
    request: BinRequest,
    instance: &str,
    status: Status,
    page: &[u8],
) -> Reply {
    let t = h.pending(request.clone(), b"");
    let (op, _) = h.commands.pop().expect("forwarded");
    let mut header = BinReply {
        request_id: request.request_id,
        status: status as i32,
        page_token: request.page_token,
        page_next_token: request.page_token,
        ..BinReply::default()
    };
    if status == Status::Ok && !page.is_empty() {
        header.page_next_token += 1;
        header.segments = vec![Segment {
            first_token: request.page_token,
            page_sizes: vec![page.len() as u64],
            body: Some(binx_proto::segment::Body::Inline(binx_proto::Inline {})),
        }];
    }
    let frame = binx_proto::Frame {
        header,
        body: Bytes::copy_from_slice(page),
    };
    h.core
        .forwarded_from(op, Ok(frame), Some(Arc::from(instance)), h.now);
    h.drain();
    h.check();
    h.outcome(t).expect("answered")
}

/// Sends `request` to be forwarded; returns its ticket, the forward's op
/// and the process it may be sent to.
fn forward_of(h: &mut Harness, request: BinRequest) -> (Ticket, OpId, Option<Arc<str>>) {
    let t = h.pending(request, b"");
    match h.commands.pop() {
        Some((op, Command::Forward { instance, .. })) => (t, op, instance),
        other => panic!("not forwarded: {other:?}"),
    }
}

/// The forwarder sends a buffer's requests only to the process of the
/// remote its pages came from; over a connection to another (the remote
/// restarted) it withholds them. The new process is never asked (a DATA
/// at token T would hand over another run's page T of a task opened
/// there again, and acknowledge its pages below T): the buffer fails over
/// at once, from its commit marker when storage has it, refused naming
/// both processes when storage says it has none, TIMEOUT (retry) when
/// storage could not be read, until it is asked again after
/// `failover_after`. ACK and DELETE are answered OK; a DELETE forgets the
/// process.
#[test]
fn requests_withheld_from_a_restarted_remote_fail_the_buffer_over_without_asking_it() {
    let silences = RemoteSilences::new(16);
    let mut h = proxy_shard(&silences);
    let remote = "10.0.0.9:8091";
    h.core.remote_instance(remote, Arc::from("run-1"), h.now);
    for buffer in 0..4 {
        // Its first forward may go anywhere; its pages pin the process.
        let (t, op, instance) = forward_of(&mut h, proxy_data(remote, "q", buffer, 0));
        assert_eq!(instance, None);
        h.core.forwarded(op, Err("not yet".into()), h.now);
        h.drain();
        h.outcome(t);
        answer_from(
            &mut h,
            proxy_data(remote, "q", buffer, 0),
            "run-1",
            Status::Ok,
            b"p0",
        );
        let (t, _, instance) = forward_of(&mut h, proxy_data(remote, "q", buffer, 1));
        assert_eq!(instance.as_deref(), Some("run-1"), "buffer {buffer}");
        h.core.cancel(t, h.now);
        h.drain();
        h.commands.clear();
    }
    h.now += SEC;
    h.core.remote_instance(remote, Arc::from("run-2"), h.now);
    let withheld = |h: &mut Harness, request: BinRequest| -> (Ticket, Vec<Command>) {
        let (t, op, instance) = forward_of(h, request);
        assert_eq!(instance.as_deref(), Some("run-1"));
        h.core.forward_withheld(op, Arc::from("run-2"), h.now);
        h.drain();
        h.check();
        (t, h.commands.drain(..).map(|(_, c)| c).collect())
    };
    // Buffer 0 was committed: its marker is read at once, and the rest of
    // it served from storage.
    let (t, commands) = withheld(&mut h, proxy_data(remote, "q", 0, 1));
    let [Command::ReadMarker { .. }] = commands.as_slice() else {
        panic!("{commands:?}")
    };
    let mut m = marker("q", 0, "node-b", &[2, 2]);
    m.endpoint = remote.into();
    m.instance = Some("run-1".into());
    h.put_segment(m.segments[0].clone());
    h.core
        .marker_read(OpId(h.core_last_op()), Ok(Some(m)), h.now);
    h.drain();
    let r = h.outcome(t).expect("served from storage");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert_eq!((r.header.page_token, pages_of(&r).len()), (1, 1));
    assert!(r.header.buffer_complete);
    // Its DELETE is answered here, and goes on only to the earlier process.
    let mut delete = req(MessageType::Delete, "q", 0);
    delete.remote = remote.into();
    assert_eq!(status(&h.reply(delete, b"")), Status::Ok);
    let forwards: Vec<Option<Arc<str>>> = h
        .commands
        .drain(..)
        .filter_map(|(_, c)| match c {
            Command::Forward { instance, .. } => Some(instance),
            _ => None,
        })
        .collect();
    assert_eq!(forwards, vec![Some(Arc::from("run-1"))]);
    // Buffer 1's marker is the new process's (the task id opened again and
    // committed there, at the same path): not served, as none.
    let (t, commands) = withheld(&mut h, proxy_data(remote, "q", 1, 1));
    assert_eq!(commands.len(), 1, "{commands:?}");
    let mut m = marker("q", 1, "node-b", &[2, 2]);
    m.endpoint = remote.into();
    m.instance = Some("run-2".into());
    h.core
        .marker_read(OpId(h.core_last_op()), Ok(Some(m)), h.now);
    h.drain();
    let expected = Refusal::RemoteRunChanged {
        remote: remote.into(),
        task: tid("q"),
        buffer: 1,
        token: 1,
        was: "run-1".into(),
        now: "run-2".into(),
    };
    assert_refused(&h.outcome(t).expect("answered"), expected);
    // Buffer 2's marker cannot be read: TIMEOUT, and storage is asked
    // again only after failover_after, TIMEOUT meanwhile.
    let unknown = Refusal::RemoteRestartedMarkerUnknown {
        remote: remote.into(),
        task: tid("q"),
        buffer: 2,
        token: 1,
        was: "run-1".into(),
        now: "run-2".into(),
    };
    let (t, commands) = withheld(&mut h, proxy_data(remote, "q", 2, 1));
    assert_eq!(commands.len(), 1, "{commands:?}");
    let failure = StoreFailure {
        transient: true,
        reason: "storage unreachable".into(),
    };
    h.core
        .marker_read(OpId(h.core_last_op()), Err(failure), h.now);
    h.drain();
    assert_refused(&h.outcome(t).expect("answered"), unknown.clone());
    h.now += 10 * SEC;
    let (t, commands) = withheld(&mut h, proxy_data(remote, "q", 2, 1));
    assert!(commands.is_empty(), "asked 10 s ago: {commands:?}");
    assert_refused(&h.outcome(t).expect("answered"), unknown);
    h.now += 21 * SEC;
    let (t, commands) = withheld(&mut h, proxy_data(remote, "q", 2, 1));
    assert_eq!(commands.len(), 1, "asked 31 s ago: {commands:?}");
    h.core.marker_read(OpId(h.core_last_op()), Ok(None), h.now);
    h.drain();
    assert_eq!(
        status(&h.outcome(t).expect("answered")),
        Status::ServerError
    );
    // Buffer 3: an ACK withheld is answered OK; a DELETE reads the marker
    // (to release what the earlier process committed), is answered OK
    // without one too, and forgets the process: the buffer is asked of the
    // new one again.
    let mut ack = req(MessageType::Ack, "q", 3);
    ack.page_token = 1;
    ack.remote = remote.into();
    let (t, commands) = withheld(&mut h, ack);
    assert!(commands.is_empty(), "{commands:?}");
    assert_eq!(status(&h.outcome(t).expect("answered")), Status::Ok);
    let mut delete = req(MessageType::Delete, "q", 3);
    delete.remote = remote.into();
    let (t, commands) = withheld(&mut h, delete);
    let [Command::ReadMarker { .. }] = commands.as_slice() else {
        panic!("{commands:?}")
    };
    h.core.marker_read(OpId(h.core_last_op()), Ok(None), h.now);
    h.drain();
    assert_eq!(status(&h.outcome(t).expect("answered")), Status::Ok);
    let (t, _, instance) = forward_of(&mut h, proxy_data(remote, "q", 3, 0));
    assert_eq!(instance, None);
    h.core.cancel(t, h.now);
    h.drain();
    h.commands.clear();
    assert_eq!(h.core.stats().forwarded_runs_refused, 5);
    // A DELETE that fails (no answer, no marker) keeps the process: its
    // retry goes only to that process too.
    answer_from(
        &mut h,
        proxy_data(remote, "q", 5, 0),
        "run-1",
        Status::Ok,
        b"p0",
    );
    let mut delete = req(MessageType::Delete, "q", 5);
    delete.remote = remote.into();
    let (t, op, instance) = forward_of(&mut h, delete.clone());
    assert_eq!(instance.as_deref(), Some("run-1"));
    h.core.forwarded(op, Err("connection reset".into()), h.now);
    h.drain();
    if let Some((op, Command::ReadMarker { .. })) = h.commands.pop() {
        h.core.marker_read(op, Ok(None), h.now);
        h.drain();
    }
    assert_eq!(status(&h.outcome(t).expect("answered")), Status::Timeout);
    let (t, _, instance) = forward_of(&mut h, delete);
    assert_eq!(instance.as_deref(), Some("run-1"), "the retry");
    h.core.cancel(t, h.now);
    h.drain();
    h.commands.clear();
    // DELETE_TASK goes only to the process the task's buffers were read
    // from; withheld, it is refused, and the client deletes the buffers one
    // at a time (each failing over).
    answer_from(
        &mut h,
        proxy_data(remote, "r", 1, 0),
        "run-1",
        Status::Ok,
        b"p0",
    );
    let mut delete_task = req(MessageType::DeleteTask, "r", 0);
    delete_task.buffer_count = 2;
    delete_task.remote = remote.into();
    let (t, op, instance) = forward_of(&mut h, delete_task);
    assert_eq!(instance.as_deref(), Some("run-1"));
    h.core.forward_withheld(op, Arc::from("run-2"), h.now);
    h.drain();
    assert_refused(
        &h.outcome(t).expect("answered"),
        Refusal::DeleteTaskFailingOver {
            task: tid("r"),
            remote: remote.into(),
            buffer: 1,
        },
    );
}

/// A forwarded DATA of one buffer answered by another process of the
/// remote than the one its earlier pages came from: the remote restarted
/// and a task of the same id answers there now (its producer opened it
/// again), so its pages are another run's (a DATA sent before the buffer's
/// process was known, which the forwarder cannot withhold). They are
/// never joined to the ones read (a buffer of two runs, the worst answer
/// an exchange can give): the buffer fails over as a withheld DATA does,
/// while NO_DATA from the new process is passed on, and another buffer,
/// or the same one after its DELETE, reads from the new process.
#[test]
fn a_buffer_read_from_one_process_of_a_remote_is_never_continued_by_another() {
    let silences = RemoteSilences::new(16);
    let mut h = proxy_shard(&silences);
    let remote = "10.0.0.9:8091";
    // Buffer `buffer` of task q at `token`, answered OK by process
    // `instance` with one page.
    let read = |h: &mut Harness, buffer: u64, token: u64, instance: &str, page: &[u8]| {
        answer_from(
            h,
            proxy_data(remote, "q", buffer, token),
            instance,
            Status::Ok,
            page,
        )
    };
    let r = read(&mut h, 0, 0, "run-1", b"first run 0");
    assert_eq!(pages_of(&r), vec![b"first run 0".to_vec()]);
    let r = read(&mut h, 0, 1, "run-1", b"first run 1");
    assert_eq!(pages_of(&r), vec![b"first run 1".to_vec()]);
    // The remote restarts; its new process has task q again, page 2 of
    // another run (a DATA sent before the process was known): not passed
    // on but failed over, naming both processes, and counted; TIMEOUT
    // until storage is asked (this shard did not see the restart, so the
    // buffer waits failover_after).
    let expected = Refusal::RemoteRestartedMarkerUnknown {
        remote: remote.into(),
        task: tid("q"),
        buffer: 0,
        token: 2,
        was: "run-1".into(),
        now: "run-2".into(),
    };
    let r = read(&mut h, 0, 2, "run-2", b"second run 2");
    assert_refused(&r, expected.clone());
    assert!(pages_of(&r).is_empty());
    // Also an empty reply, or a sizes reply: either could say the buffer
    // ended, and end the read short.
    let r = read(&mut h, 0, 2, "run-2", b"");
    assert_refused(&r, expected.clone());
    let mut sizes = proxy_data(remote, "q", 0, 2);
    sizes.get_data_size = true;
    let r = answer_from(&mut h, sizes, "run-2", Status::Ok, b"");
    assert_refused(&r, expected);
    assert_eq!(h.core.stats().forwarded_runs_refused, 3);
    // A late reply from the earlier process is still its own.
    let r = read(&mut h, 0, 2, "run-1", b"first run 2");
    assert_eq!(pages_of(&r), vec![b"first run 2".to_vec()]);
    // NO_DATA and errors from the new process are passed on (NO_DATA
    // fails over to storage, as the test above shows).
    let r = answer_from(
        &mut h,
        proxy_data(remote, "q", 0, 3),
        "run-2",
        Status::NoData,
        b"",
    );
    assert_eq!(status(&r), Status::NoData);
    // Another buffer is read from the new process; the first one's DELETE
    // forgets which process served it, and it is read anew.
    let r = read(&mut h, 1, 0, "run-2", b"second run b1");
    assert_eq!(pages_of(&r), vec![b"second run b1".to_vec()]);
    let mut delete = req(MessageType::Delete, "q", 0);
    delete.remote = remote.into();
    let r = answer_from(&mut h, delete, "run-2", Status::Ok, b"");
    assert_eq!(status(&r), Status::Ok);
    let r = read(&mut h, 0, 0, "run-2", b"second run 0");
    assert_eq!(pages_of(&r), vec![b"second run 0".to_vec()]);
    assert_eq!(h.core.stats().forwarded_runs_refused, 3);
    // A reply over a socket that names no process, for a buffer read from
    // one, is another process's (a binxd before 1.2 put back); a buffer of
    // a remote that never named one is not checked.
    let r = read(&mut h, 2, 0, "run-2", b"x");
    assert_eq!(pages_of(&r).len(), 1);
    let unnamed = |h: &mut Harness, buffer: u64, token: u64| -> Reply {
        let t = h.pending(proxy_data(remote, "q", buffer, token), b"");
        let (op, _) = h.commands.pop().expect("forwarded");
        let frame = binx_proto::Frame {
            header: BinReply {
                status: Status::Ok as i32,
                page_token: token,
                page_next_token: token,
                ..BinReply::default()
            },
            body: Default::default(),
        };
        h.core.forwarded(op, Ok(frame), h.now);
        h.drain();
        h.outcome(t).expect("answered")
    };
    assert_refused(
        &unnamed(&mut h, 2, 1),
        Refusal::RemoteRestartedMarkerUnknown {
            remote: remote.into(),
            task: tid("q"),
            buffer: 2,
            token: 1,
            was: "run-2".into(),
            now: "none".into(),
        },
    );
    assert_eq!(status(&unnamed(&mut h, 4, 0)), Status::Ok);
}

/// Which process served a buffer is remembered for at most
/// `max_tracked_remotes` buffers: past that the half read from longest ago
/// is forgotten (read on unchecked), never an unbounded map.
#[test]
fn which_process_served_a_forwarded_buffer_is_remembered_within_a_bound() {
    let mut watch = crate::failover::RemoteWatch::default();
    let t0 = std::time::Instant::now();
    let key = |b: u64| -> crate::failover::RemoteKey { (Arc::from("10.0.0.9:8091"), tid("q"), b) };
    let one: Arc<str> = Arc::from("run-1");
    let two: Arc<str> = Arc::from("run-2");
    for b in 0..8 {
        watch
            .read_from(&key(b), &one, t0 + b as u32 * SEC, 8)
            .expect("first");
    }
    assert_eq!(
        watch.read_from(&key(7), &two, t0 + 9 * SEC, 8),
        Err(one.clone())
    );
    // Full: the older half is forgotten to make room.
    watch
        .read_from(&key(8), &one, t0 + 10 * SEC, 8)
        .expect("room");
    assert_eq!(watch.read_from.len(), 4);
    assert!(
        watch.read_from(&key(0), &two, t0 + 11 * SEC, 8).is_ok(),
        "forgotten"
    );
    assert_eq!(
        watch.read_from(&key(6), &two, t0 + 11 * SEC, 8),
        Err(one.clone())
    );
    // Idle ones are forgotten by the timer's expiry.
    watch.expire(t0 + 20 * SEC, 5 * SEC);
    assert!(watch.read_from.is_empty());
}

#[test]
fn the_shards_of_an_exchange_share_what_they_learn_of_a_silent_remote() {
    let silences = RemoteSilences::new(16);
    let (mut a, mut b) = (proxy_shard(&silences), proxy_shard(&silences));
    let dead = "10.0.0.9:8091";
    let (t, commands) = fail_forward(&mut a, proxy_data(dead, "on-a", 0, 0));
    a.outcome(t);
    assert!(commands.is_empty(), "{commands:?}");
    assert_eq!(silences.len(), 1);
    b.now = a.now + 31 * SEC;
    let (t, commands) = fail_forward(&mut b, proxy_data(dead, "on-b", 0, 0));
    let [Command::ReadMarker { task, .. }] = commands.as_slice() else {
        panic!("shard b found the remote silent for 31 s: {commands:?}")
    };
    assert_eq!(task.as_str(), "on-b");
    let read = OpId(b.core_last_op());
    b.core.marker_read(read, Ok(None), b.now);
    b.drain();
    assert_eq!(status(&b.outcome(t).expect("answered")), Status::Timeout);
    // An answer on one shard ends the silence for all.
    assert_eq!(
        answer_forward(&mut a, proxy_data(dead, "on-a", 1, 0), Status::Ok).len(),
        0
    );
    assert!(silences.is_empty());
}

/// A binxd restarted at its address knows none of its earlier run's tasks,
/// yet their consumers still DELETE through it (the coordinator's sidecar
/// forwards Exchange.close's DELETEs to the address in the commit; the
/// remote answers, so no failover releases them): the DELETE of a buffer of
/// a task it does not know releases the buffer's committed output when this
/// node wrote it, once per buffer, never another node's (found by a real
/// Trino cluster whose worker sidecar restarted mid-query: committed output
/// was left to the storage TTL).
#[test]
fn a_delete_of_a_forgotten_task_releases_what_this_node_committed_before_a_restart() {
    let mut h = node_a();
    let delete = |task: &str, buffer: u64| req(MessageType::Delete, task, buffer);
    let reads =
        |h: &mut Harness| -> Vec<Command> { h.commands.drain(..).map(|(_, c)| c).collect() };
    h.ok(delete("before-restart", 0), b"");
    let asked = reads(&mut h);
    let [Command::ReadMarker { task, buffer: 0 }] = asked.as_slice() else {
        panic!("the marker is read: {asked:?}")
    };
    assert_eq!(task.as_str(), "before-restart");
    marker_read_is_released(&mut h, "before-restart", 0);
    assert_eq!(h.core.stats().forgotten_releases, 1);
    // The same DELETE again (its reply was lost): read once per buffer.
    h.ok(delete("before-restart", 0), b"");
    assert!(reads(&mut h).is_empty());
    // Another node's output is not this node's to release.
    h.ok(delete("elsewhere", 1), b"");
    assert_eq!(reads(&mut h).len(), 1);
    let read = OpId(h.core_last_op());
    h.core.marker_read(
        read,
        Ok(Some(marker("elsewhere", 1, "node-b", &[3]))),
        h.now,
    );
    h.drain();
    assert!(reads(&mut h).is_empty(), "another node's marker");
    // No marker, or none readable: nothing.
    h.ok(delete("never-committed", 0), b"");
    let read = OpId(h.core_last_op());
    reads(&mut h);
    h.core.marker_read(read, Ok(None), h.now);
    h.drain();
    assert!(reads(&mut h).is_empty());
    assert_eq!(h.core.stats().forgotten_releases, 1);
    // A task opened while its marker was read is not forgotten any more.
    h.ok(delete("reopened", 0), b"");
    let read = OpId(h.core_last_op());
    reads(&mut h);
    h.ok(open("reopened", BufferKind::Partitioned, 1), b"");
    h.core
        .marker_read(read, Ok(Some(marker("reopened", 0, "node-a", &[3]))), h.now);
    h.drain();
    assert!(reads(&mut h).is_empty(), "the task is known again");
    assert_eq!(h.core.stats().forgotten_markers_read, 4);
    // A burst of DELETEs (a coordinator closing a query's exchanges after
    // this node restarted) is read in turn, never dropped: at most 64 reads
    // at once and 64 started a second; the rest wait, and go as reads end
    // and seconds pass.
    h.now += SEC;
    for i in 0..300 {
        h.ok(delete(&format!("burst-{i}"), i % 7), b"");
    }
    let mut read_keys = Vec::new();
    let mut in_flight: Vec<OpId> = Vec::new();
    // The marker reads just issued, now in flight.
    let take = |h: &mut Harness, in_flight: &mut Vec<OpId>, read_keys: &mut Vec<(String, u64)>| {
        let issued: Vec<(OpId, Command)> = h.commands.drain(..).collect();
        for (op, command) in &issued {
            let Command::ReadMarker { task, buffer } = command else {
                panic!("only marker reads: {command:?}")
            };
            read_keys.push((task.to_string(), *buffer));
            in_flight.push(*op);
        }
        issued.len()
    };
    assert_eq!(
        take(&mut h, &mut in_flight, &mut read_keys),
        64,
        "64 at once"
    );
    // All 64 end within that second: the rate holds the rest until it ends.
    for op in in_flight.drain(..) {
        h.core.marker_read(op, Ok(None), h.now);
    }
    h.drain();
    let held = take(&mut h, &mut in_flight, &mut read_keys);
    assert_eq!(held, 0, "64 started a second");
    assert_eq!(
        h.core.poll_timeout(),
        Some(h.now + SEC),
        "the core's timer comes when the rate lets the rest go"
    );
    h.advance(SEC);
    let next = take(&mut h, &mut in_flight, &mut read_keys);
    assert_eq!(next, 64, "the next second");
    h.advance(SEC);
    assert_eq!(
        take(&mut h, &mut in_flight, &mut read_keys),
        0,
        "none while 64 are read"
    );
    let mut seconds = 0;
    while read_keys.len() < 300 && seconds < 60 {
        // Half of those in flight end, then a second passes.
        let ending: Vec<OpId> = in_flight.drain(..in_flight.len() / 2).collect();
        for op in ending {
            h.core.marker_read(op, Ok(None), h.now);
        }
        h.drain();
        let started_now = take(&mut h, &mut in_flight, &mut read_keys);
        h.advance(SEC);
        let started_later = take(&mut h, &mut in_flight, &mut read_keys);
        assert!(
            started_now + started_later <= 64 + 64,
            "within the rate: {started_now} + {started_later}"
        );
        assert!(in_flight.len() <= 64, "{} at once", in_flight.len());
        seconds += 1;
    }
    assert_eq!(read_keys.len(), 300, "every DELETE's marker is read");
    read_keys.sort();
    read_keys.dedup();
    assert_eq!(read_keys.len(), 300, "each once");
    assert!(seconds < 20, "within seconds: {seconds}");
    for op in in_flight.drain(..) {
        h.core.marker_read(op, Ok(None), h.now);
    }
    h.drain();
    // A DELETE that waited its turn releases this node's output as one read
    // at once does; one whose task came back meanwhile is not read.
    h.now += SEC;
    for i in 0..64 {
        h.ok(delete(&format!("filler-{i}"), 0), b"");
    }
    h.ok(delete("waited", 2), b"");
    h.ok(delete("came-back", 0), b"");
    let fillers: Vec<(OpId, Command)> = h.commands.drain(..).collect();
    assert_eq!(fillers.len(), 64, "the two wait");
    h.ok(open("came-back", BufferKind::Partitioned, 1), b"");
    for (op, _) in fillers {
        h.core.marker_read(op, Ok(None), h.now);
    }
    h.drain();
    h.advance(SEC);
    let asked = reads(&mut h);
    let [Command::ReadMarker { task, buffer: 2 }] = asked.as_slice() else {
        panic!("only the one whose task stayed unknown is read: {asked:?}")
    };
    assert_eq!(task.as_str(), "waited");
    let releases = h.core.stats().forgotten_releases;
    h.core.marker_read(
        OpId(h.core_last_op()),
        Ok(Some(marker("waited", 2, "node-a", &[3]))),
        h.now,
    );
    h.drain();
    let released = reads(&mut h);
    assert!(
        matches!(released.as_slice(), [Command::ReleaseCommitted(m)] if m.task_id == "waited"),
        "{released:?}"
    );
    assert_eq!(h.core.stats().forgotten_releases, releases + 1);
    // Past 4,096 waiting, a DELETE's output is left to the TTL, counted.
    let left_before = h.core.stats().deletes_left_to_ttl;
    h.now += SEC;
    for i in 0..(64 + 4096 + 10) {
        h.ok(delete(&format!("flood-{i}"), 0), b"");
    }
    h.drain();
    assert_eq!(h.commands.len(), 64);
    assert_eq!(h.core.stats().deletes_left_to_ttl - left_before, 10);
    h.check();
    // Without a spool nothing is looked up.
    let mut bare = harness(CoreConfig::default());
    bare.ok(delete("before-restart", 0), b"");
    assert!(bare.commands.is_empty(), "{:?}", bare.commands);
}

/// An ACK at token 0 before a task opens deletes the buffer as a DELETE
/// would (its pages are dropped on arrival), but never reads or releases a
/// commit marker: a consumer that acknowledged nothing may still read the
/// output from storage. The DELETE after it, its last word, still reads
/// the marker, alone or in a DELETE_TASK's range (a review found the ACK
/// taken for the DELETE: the output an earlier run committed was left to
/// the storage TTL).
#[test]
fn an_ack_at_token_0_before_a_delete_still_lets_the_delete_read_the_marker() {
    let mut h = node_a();
    let reads = |h: &mut Harness| -> Vec<(String, u64)> {
        h.commands
            .drain(..)
            .map(|(_, c)| match c {
                Command::ReadMarker { task, buffer } => (task.to_string(), buffer),
                other => panic!("only marker reads: {other:?}"),
            })
            .collect()
    };
    h.ok(ack("forgotten", 0, 0), b"");
    h.ok(ack("forgotten", 1, 0), b"");
    h.ok(ack("forgotten", 2, 0), b"");
    assert!(reads(&mut h).is_empty(), "an ACK reads no marker");
    h.ok(req(MessageType::Delete, "forgotten", 0), b"");
    assert_eq!(reads(&mut h), [("forgotten".to_string(), 0)]);
    marker_read_is_released(&mut h, "forgotten", 0);
    // Read once: an ACK after the DELETE, or the DELETE again, reads nothing.
    h.ok(ack("forgotten", 0, 0), b"");
    h.ok(req(MessageType::Delete, "forgotten", 0), b"");
    assert!(reads(&mut h).is_empty());
    // A DELETE_TASK over them reads the two only ACKed, not the deleted one.
    let mut wide = req(MessageType::DeleteTask, "forgotten", 0);
    wide.buffer_count = 3;
    h.ok(wide.clone(), b"");
    let mut asked = reads(&mut h);
    asked.sort();
    assert_eq!(
        asked,
        [("forgotten".to_string(), 1), ("forgotten".to_string(), 2)]
    );
    h.ok(wide, b"");
    assert!(reads(&mut h).is_empty(), "a repeat reads nothing");
    // The task opened after all this: its buffers are born deleted.
    h.ok(open("forgotten", BufferKind::Partitioned, 3), b"");
    let reply = h.enqueue("forgotten", 1, &[b"dropped"]);
    assert_eq!(reply.header.status_kind(), Status::Ok);
    assert_eq!(
        h.core.memory_used(),
        0,
        "pages of a deleted buffer are dropped"
    );
}

#[test]
fn a_consumer_that_comes_after_its_producer_died_fails_over_by_the_address_in_the_marker() {
    let mut h = spooled(proxying());
    let remote = "elsewhere:1";
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "late", 0, 0));
    h.outcome(t);
    h.now += 31 * SEC;
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "late", 0, 0));
    let read = OpId(h.core_last_op());
    let m = marker("late", 0, "never-met", &[3]);
    h.put_segment(m.segments[0].clone());
    h.core.marker_read(read, Ok(Some(m)), h.now);
    let r = h.outcome(t).expect("served");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert_eq!(pages_of(&r), vec![vec![b's'; 3]]);
}

/// A buffer read from its commit marker is tied to the process that wrote
/// it: once storage is left (an object read failed), the rest is asked only
/// of that process, and a marker read again must be its own. Before, none
/// was recorded: the next DATA went to whichever process answered (a task
/// id opened again after a restart: another run's pages from the token on),
/// and any process's marker at the same path was served (review finding).
#[test]
fn a_buffer_read_from_its_marker_is_pinned_to_the_process_that_wrote_it() {
    let silences = RemoteSilences::new(16);
    let mut h = proxy_shard(&silences);
    let remote = "10.0.0.9:8091";
    h.core.remote_instance(remote, Arc::from("run-1"), h.now);
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "late", 0, 0));
    h.outcome(t);
    h.now += 31 * SEC;
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "late", 0, 0));
    let mut m = marker("late", 0, "never-met", &[3, 3]);
    m.endpoint = remote.into();
    m.instance = Some("run-1".into());
    h.put_segment(m.segments[0].clone());
    h.core
        .marker_read(OpId(h.core_last_op()), Ok(Some(m.clone())), h.now);
    h.drain();
    // The object cannot be read this time: the consumer is told to retry,
    // and the buffer is asked of its producer again.
    let at = h
        .outcomes
        .iter()
        .position(|(x, _)| *x == t)
        .expect("answered");
    let crate::Outcome::Plan(plan) = h.outcomes.remove(at).1 else {
        panic!("served from storage");
    };
    h.core.plan_finished(plan.lease, Status::Timeout, h.now);
    h.drain();
    let (t, op, instance) = forward_of(&mut h, proxy_data(remote, "late", 0, 0));
    assert_eq!(
        instance.as_deref(),
        Some("run-1"),
        "only to the marker's process"
    );
    // The remote restarted: its marker is read again at once, and one the
    // new process wrote at the same path is not served.
    h.now += SEC;
    h.core.remote_instance(remote, Arc::from("run-2"), h.now);
    let read = withheld_then_marker_read(&mut h, op);
    let mut other = m.clone();
    other.instance = Some("run-2".into());
    h.core.marker_read(read, Ok(Some(other)), h.now);
    h.drain();
    let r = h.outcome(t).expect("answered");
    assert_ne!(status(&r), Status::Ok, "another run's marker was served");
    // Its own marker still is (read again after failover_after).
    h.now += 31 * SEC;
    let (t, op, _) = forward_of(&mut h, proxy_data(remote, "late", 0, 0));
    let read = withheld_then_marker_read(&mut h, op);
    h.core.marker_read(read, Ok(Some(m)), h.now);
    let r = h.outcome(t).expect("served");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert_eq!(pages_of(&r), vec![vec![b's'; 3], vec![b's'; 3]]);
}

/// The forward `op` withheld (the remote answers as process `run-2`): the
/// marker read that follows.
fn withheld_then_marker_read(h: &mut Harness, op: OpId) -> OpId {
    h.core.forward_withheld(op, Arc::from("run-2"), h.now);
    h.drain();
    h.commands
        .drain(..)
        .map(|(op, _)| op)
        .next_back()
        .expect("a marker read")
}

/// ARBITRARY pages handed out while a spill of the shared log is under
/// way can still spill from the buffer they went to (review finding: they
/// stayed marked as spilling, in memory until acknowledged).
#[test]
fn arbitrary_pages_handed_out_during_a_spill_can_spill_again() {
    let mut config = overflow_limits();
    if let Some(rules) = config.spool.as_mut() {
        rules.spill_after = SEC;
    }
    let mut h = harness(config);
    h.ok(open_with("a", BufferKind::Arbitrary, 1, "overflow"), b"");
    let page = vec![b'a'; 100_000];
    // Past three quarters of the limit: a spill of the oldest pages starts.
    for _ in 0..8 {
        assert_eq!(status(&h.enqueue("a", 0, &[&page])), Status::Ok);
    }
    assert!(
        h.commands
            .iter()
            .any(|(_, c)| matches!(c, Command::WriteSegment { .. })),
        "a spill is under way"
    );
    // The consumer takes the pages meanwhile (and keeps them unacknowledged).
    let r = h.ok(data("a", 0, 0, 1 << 30), b"");
    assert!(!pages_of(&r).is_empty());
    h.complete(false);
    // Old pages spill even with room: all of them, in time.
    for _ in 0..10 {
        h.advance(2 * SEC);
        h.complete(false);
    }
    assert_eq!(
        h.core.stats().page_bytes_held,
        0,
        "pages handed out during the spill stayed in memory"
    );
}

/// A BROADCAST buffer read to its end (and not deleted) holds none of the
/// pages the other buffers get after it: the producer goes on within the
/// limit while the other consumer keeps up (review finding: every later
/// page stayed in memory until the finished buffer was deleted).
#[test]
fn a_broadcast_buffer_read_to_its_end_holds_no_later_page() {
    let mut h = harness(small_limits());
    h.ok(open("b", BufferKind::Broadcast, 2), b"");
    assert_eq!(status(&h.enqueue("b", 0, &[&[0u8; 1_000]])), Status::Ok);
    h.ok(req(MessageType::NoMorePages, "b", 0), b"");
    // Buffer 0 reads its page and acknowledges it: it is at its end.
    h.ok(data("b", 0, 0, 0), b"");
    assert!(h.ok(data("b", 0, 1, 0), b"").header.buffer_complete);
    h.ok(data("b", 1, 0, 0), b"");
    for token in 1..20u64 {
        let r = h.enqueue("b", 0, &[&[token as u8; 1_000]]);
        assert_eq!(status(&r), Status::Ok, "page {token}: {}", r.header.error);
        let r = h.ok(data("b", 1, token, 0), b"");
        assert_eq!(pages_of(&r), vec![vec![token as u8; 1_000]]);
    }
}

/// A member of a fixed BROADCAST set that no consumer ever asks for is
/// abandoned after `abandon_after` from OPEN_TASK, like one that stopped
/// asking: it no longer holds every page of the set (review finding: the
/// producer stayed BUSY for good).
#[test]
fn a_broadcast_member_nobody_ever_asks_for_is_abandoned() {
    let mut h = harness(CoreConfig {
        abandon_after: 60 * SEC,
        ..small_limits()
    });
    h.ok(open("b", BufferKind::Broadcast, 2), b"");
    let mut token = 0u64;
    let busy = loop {
        let r = h.enqueue("b", 0, &[&[token as u8; 1_000]]);
        if status(&r) == Status::Busy {
            break r;
        }
        h.ok(data("b", 0, token, 0), b"");
        h.ok(ack("b", 0, token + 1), b"");
        token += 1;
        assert!(token < 100, "never full");
    };
    assert_refused(
        &busy,
        Refusal::NoRoom {
            task: tid("b"),
            buffer: 0,
            size: 1_000,
            used: h.core.memory_used(),
            limit: 10_000,
            task_used: h.core.memory_used(),
            task_limit: 6_000,
        },
    );
    // Buffer 0's consumer keeps asking; buffer 1's never has.
    h.advance(40 * SEC);
    h.ok(ack("b", 0, token), b"");
    h.advance(21 * SEC);
    let r = h.enqueue("b", 0, &[&[token as u8; 1_000]]);
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert_eq!(h.core.stats().abandoned_buffers, 1);
    let r = h.reply(data("b", 1, 0, 0), b"");
    assert_eq!(status(&r), Status::ServerError, "{}", r.header.error);
}

/// A BROADCAST buffer that ended before the others: its marker names no
/// object wholly past its end, and a consumer failing over to a marker
/// whose shared segment goes on past the end gets the buffer's pages only,
/// complete at its end (review finding: it got the other buffers' pages).
#[test]
fn a_broadcast_buffer_that_ended_early_is_committed_and_served_only_to_its_end() {
    // Each page is over a third of the memory limit: p0 spills alone
    // before p1 and p2 go in (ahead of need, past three quarters).
    let mut h = harness(overflow_limits());
    let page = vec![b'p'; 400_000];
    h.ok(open_with("b", BufferKind::Broadcast, 2, "overflow"), b"");
    assert_eq!(status(&h.enqueue("b", 0, &[&page])), Status::Ok);
    h.ok(req(MessageType::NoMorePages, "b", 0), b"");
    for _ in 0..2 {
        assert_eq!(status(&h.enqueue("b", 0, &[&page])), Status::Ok);
        h.complete(false);
    }
    h.ok(req(MessageType::NoMorePages, "b", ALL_BUFFERS), b"");
    h.core.start_drain(h.now);
    h.complete(false);
    let (_, end, firsts) = h
        .marker_objects()
        .iter()
        .find(|(buffer, _, _)| *buffer == 0)
        .cloned()
        .expect("buffer 0 committed");
    assert_eq!(end, 1);
    assert!(
        firsts.iter().all(|&first| first < end),
        "buffer 0's marker names objects from tokens {firsts:?}, its end is {end}"
    );

    // Failover to a marker whose one segment holds three pages, of which
    // the buffer has one.
    let mut h = spooled(proxying());
    let remote = "elsewhere:1";
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "s", 0, 0));
    h.outcome(t);
    h.now += 31 * SEC;
    let (t, _) = fail_forward(&mut h, proxy_data(remote, "s", 0, 0));
    let read = OpId(h.core_last_op());
    let mut m = marker("s", 0, "never-met", &[3, 4, 5]);
    m.end_token = 1;
    m.shared = true;
    h.put_segment(m.segments[0].clone());
    h.core.marker_read(read, Ok(Some(m)), h.now);
    let r = h.outcome(t).expect("served");
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    assert_eq!(pages_of(&r).len(), 1, "only the buffer's page");
    assert_eq!(r.header.page_next_token, 1);
    assert!(r.header.buffer_complete);
}

impl Harness {
    /// The op id of the last command the core issued.
    fn core_last_op(&self) -> u64 {
        // Ops are numbered in order; the harness has drained them all.
        let _ = BinReply::default();
        self.core_next_op()
    }

    fn core_next_op(&self) -> u64 {
        self.core.debug_last_op()
    }
}

#[test]
fn a_late_consumer_of_an_open_arbitrary_set_still_takes_unassigned_pages() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("a", BufferKind::Arbitrary, 0), b"");
    h.enqueue("a", 0, &[b"p0"]);
    h.ok(req(MessageType::NoMorePages, "a", ALL_BUFFERS), b"");
    let r = h.ok(data("a", 1, 0, 1), b"");
    assert_eq!(pages_of(&r), vec![b"p0".to_vec()]);
    assert!(r.header.buffer_complete);
    let r = h.ok(data("a", 2, 0, 1), b"");
    assert!(r.header.buffer_complete && r.body.is_empty());
}

#[test]
fn a_late_consumer_of_an_open_broadcast_set_is_told_it_is_not_part_of_it() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("b", BufferKind::Broadcast, 0), b"");
    assert_eq!(status(&h.reply(data("b", 0, 0, 0), b"")), Status::NoData);
    h.enqueue("b", 0, &[b"p0"]);
    h.ok(req(MessageType::NoMorePages, "b", ALL_BUFFERS), b"");
    let r = h.reply(data("b", 1, 0, 0), b"");
    assert_eq!(status(&r), Status::BadRequest);
    assert_refused(
        &r,
        Refusal::NotInClosedBroadcastSet {
            task: tid("b"),
            buffer: 1,
        },
    );
    h.ok(req(MessageType::Delete, "b", 0), b"");
    assert_eq!(h.core.stats().tasks, 0);
    let r = h.reply(data("b", 1, 0, 0), b"");
    assert_eq!(
        status(&r),
        Status::BadRequest,
        "and after the task ended: {}",
        r.header.error
    );
}

fn pipelined(task: &str, buffer: u64, token: u64, ack: u64, max_size: u64) -> BinRequest {
    let mut r = data(task, buffer, token, max_size);
    r.ack_token = Some(ack);
    r
}

#[test]
fn a_pipelined_data_frees_only_below_its_ack_token_so_every_reply_in_flight_stays_exact() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("p", BufferKind::Partitioned, 1), b"");
    let pages: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 10]).collect();
    let refs: Vec<&[u8]> = pages.iter().map(|p| p.as_slice()).collect();
    h.enqueue("p", 0, &refs);
    // Two DATA in flight: 0..3, then 3..6 asked for before the first reply
    // was used. The first lists the sizes after it.
    let first = h.ok(pipelined("p", 0, 0, 0, 30), b"");
    assert_eq!(pages_of(&first), pages[0..3].to_vec());
    assert_eq!(first.header.page_next_token, 3);
    assert_eq!(first.header.following_sizes, vec![10; 7]);
    let second = h.ok(pipelined("p", 0, 3, 0, 30), b"");
    assert_eq!(pages_of(&second), pages[3..6].to_vec());
    // The first reply was lost: asking again gives the same pages.
    let again = h.ok(pipelined("p", 0, 0, 0, 30), b"");
    assert_eq!(pages_of(&again), pages[0..3].to_vec());
    // Acknowledging up to 3 frees pages 0..3 and nothing more.
    let third = h.ok(pipelined("p", 0, 6, 3, 30), b"");
    assert_eq!(pages_of(&third), pages[6..9].to_vec());
    assert_eq!(
        h.core.task_snapshots("p", h.now)[0].buffers[0].acknowledged_token,
        3
    );
    let gone = h.reply(pipelined("p", 0, 0, 0, 30), b"");
    assert_eq!(status(&gone), Status::BadRequest);
    assert_refused(
        &gone,
        Refusal::TokenBelowMark {
            task: tid("p"),
            buffer: 0,
            token: 0,
            mark: 3,
        },
    );
    // Pages 3..6 are still there for a lost second reply.
    let second_again = h.ok(pipelined("p", 0, 3, 3, 30), b"");
    assert_eq!(pages_of(&second_again), pages[3..6].to_vec());
    // A plain DATA acknowledges below its own token, as in BinX 1.1.
    let plain = h.ok(data("p", 0, 9, 30), b"");
    assert_eq!(pages_of(&plain), pages[9..10].to_vec());
    assert!(
        plain.header.following_sizes.is_empty(),
        "only asked for with ack_token"
    );
    assert_eq!(
        h.core.task_snapshots("p", h.now)[0].buffers[0].acknowledged_token,
        9
    );
}

#[test]
fn a_pipelined_data_past_the_next_page_is_refused_and_acknowledges_nothing() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("p", BufferKind::Partitioned, 1), b"");
    h.enqueue("p", 0, &[b"a", b"b", b"c"]);
    let past = h.reply(pipelined("p", 0, 4, 2, 30), b"");
    assert_eq!(status(&past), Status::BadRequest);
    assert_eq!(past.header.page_token, 4);
    assert_eq!(
        h.core.task_snapshots("p", h.now)[0].buffers[0].acknowledged_token,
        0
    );
    // At the next page to come: it waits for it like any DATA.
    let waiter = h.pending(waiting(pipelined("p", 0, 3, 1, 30), SEC), b"");
    assert_eq!(
        h.core.task_snapshots("p", h.now)[0].buffers[0].acknowledged_token,
        1
    );
    h.enqueue("p", 0, &[b"d"]);
    let reply = h.outcome(waiter).expect("woken by the page");
    assert_eq!(pages_of(&reply), vec![b"d".to_vec()]);
    // ack_token above page_token is refused at the door.
    let mut wrong = pipelined("p", 0, 2, 0, 30);
    wrong.ack_token = Some(3);
    assert_eq!(status(&h.reply(wrong, b"")), Status::BadRequest);
    assert_eq!(
        h.core.task_snapshots("p", h.now)[0].buffers[0].acknowledged_token,
        1
    );
}

#[test]
fn following_sizes_cover_the_next_reply() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("p", BufferKind::Partitioned, 1), b"");
    let sizes: Vec<usize> = (1..=40).collect();
    let pages: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![7; s]).collect();
    let refs: Vec<&[u8]> = pages.iter().map(|p| p.as_slice()).collect();
    h.enqueue("p", 0, &refs);
    let r = h.ok(pipelined("p", 0, 0, 0, 10), b"");
    // Pages 1+2+3+4 = 10 bytes; then sizes while their total is within
    // twice the size asked for, and the one that crosses it.
    assert_eq!(r.header.page_next_token, 4);
    assert_eq!(r.header.following_sizes, vec![5, 6, 7, 8]);
}

/// Where a reply to DATA(token, max) ends by the sizes of the pages from
/// `token` on, as a pipelining client tells it: `None` when they run out
/// before the reply's end.
fn end_by_sizes(token: u64, sizes: &[u64], max: u64) -> Option<u64> {
    let mut total = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        if i > 0 && total + size > max {
            return Some(token + i as u64);
        }
        total += size;
    }
    None
}

#[test]
fn following_sizes_tell_where_replies_end_from_memory_and_from_storage_alike() {
    for presigns in [false, true] {
        let mut h = harness(CoreConfig {
            max_stored_reply_size: 300_000,
            spool: Some(SpoolRules {
                spill_target_bytes: 100_000,
                spill_max_bytes: 200_000,
                presigns,
                ..SpoolRules::default()
            }),
            ..overflow_limits()
        });
        h.ok(open_with("o", BufferKind::Partitioned, 1, "overflow"), b"");
        let sizes: Vec<usize> = (0..24)
            .map(|i| [30_000, 70_000, 110_000, 150_000][i % 4] + i)
            .collect();
        for &size in &sizes {
            assert_eq!(status(&h.enqueue("o", 0, &[&vec![b's'; size]])), Status::Ok);
            h.complete(false);
        }
        h.ok(req(MessageType::NoMorePages, "o", 0), b"");
        let held = h.core.task_snapshots("o", h.now)[0].buffers[0].bytes_held;
        assert!(
            held < sizes.iter().sum::<usize>() as u64,
            "some pages spilled"
        );
        let mut predicted = 0;
        let mut stored_listed = false;
        for max in [1, 100_000, 250_000, 400_000] {
            for token in 0..sizes.len() as u64 {
                let mut r = pipelined("o", 0, token, 0, max);
                r.accept_spooled = true;
                let reply = h.ok(r, b"");
                let next = reply.header.page_next_token;
                let listed = reply.header.following_sizes.clone();
                let in_storage = |t: u64| {
                    h.stored().iter().any(|o| {
                        (o.first_token..o.first_token + o.page_sizes.len() as u64).contains(&t)
                    })
                };
                let listed_in_storage = (next..next + listed.len() as u64).any(in_storage);
                if presigns {
                    // Whole objects go out as URLs: their pages are not listed.
                    assert!(!listed_in_storage, "{listed:?} from {next}");
                    continue;
                }
                stored_listed |= listed_in_storage;
                let Some(end) = end_by_sizes(next, &listed, max) else {
                    continue;
                };
                let mut r = pipelined("o", 0, next, 0, max);
                r.accept_spooled = true;
                let after = h.ok(r, b"");
                assert_eq!(
                    after.header.page_next_token, end,
                    "DATA at {next} with {max} bytes ends where the sizes {listed:?} say"
                );
                predicted += 1;
            }
        }
        if !presigns {
            assert!(
                predicted > 20 && stored_listed,
                "{predicted} predictions, stored pages listed: {stored_listed}"
            );
        }
    }
}

/// A core that spills (`overflow_limits`, 100 kB segments) to a store that
/// presigns, reading at most `stored` bytes of objects a reply.
fn presigning(stored: u64) -> Harness {
    harness(CoreConfig {
        max_stored_reply_size: stored,
        spool: Some(SpoolRules {
            spill_target_bytes: 100_000,
            spill_max_bytes: 200_000,
            presigns: true,
            ..SpoolRules::default()
        }),
        ..overflow_limits()
    })
}

/// Seed 148,017,808 of the wide simulation: pages listed in
/// `following_sizes` while in memory spilled before their DATA came, and
/// a DATA (of a client taking spooled segments) that entered their object
/// past its first page was answered with the rest of the object, past the
/// size it asked for. A read counts an object whole only from its first
/// page; entered later, its pages count by their sizes.
#[test]
fn a_read_entering_an_object_past_its_first_page_counts_its_pages_by_size() {
    let mut h = presigning(1 << 20);
    h.ok(open_with("o", BufferKind::Partitioned, 1, "overflow"), b"");
    let page = vec![b's'; 40_000];
    for _ in 0..8 {
        assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
        h.complete(false);
    }
    let mut r = pipelined("o", 0, 0, 0, 40_000);
    r.accept_spooled = true;
    let first = h.ok(r, b"");
    assert_eq!(first.header.page_next_token, 1);
    let listed = first.header.following_sizes.clone();
    assert_eq!(listed, vec![40_000; 3], "pages in memory are listed");
    for _ in 0..30 {
        assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
        h.complete(false);
    }
    let objects = h.stored();
    let object_at = |t: u64| {
        objects
            .iter()
            .find(|o| o.first_token <= t && t < o.first_token + o.page_sizes.len() as u64)
            .cloned()
    };
    // Every listed page spilled since: pages 0 and 1 into one object,
    // pages 2 to 6 into the next (so page 3 lies past its first page).
    let span = |t: u64| object_at(t).map(|o| (o.first_token, o.page_sizes.len()));
    assert_eq!(
        (span(1), span(2), span(3)),
        (Some((0, 2)), Some((2, 5)), Some((2, 5))),
        "{objects:?}"
    );
    // An object that does not fit what is left of the reply counts by its
    // pages' sizes (the reply ends where they say, not before the object);
    // one that fits goes out whole. Nothing is acknowledged yet.
    for (token, max, end) in [(1, 120_000, 4), (2, 120_000, 5), (2, 200_000, 7)] {
        let mut r = pipelined("o", 0, token, 0, max);
        r.accept_spooled = true;
        let reply = h.ok(r, b"");
        assert_eq!(
            reply.header.page_next_token, end,
            "DATA at {token} for {max} bytes"
        );
    }
    for token in 1..4 {
        let mut r = pipelined("o", 0, token, token, 40_000);
        r.accept_spooled = true;
        let reply = h.ok(r, b"");
        assert_eq!(
            reply.header.page_next_token,
            token + 1,
            "DATA at {token} for 40,000 bytes ends where the listed sizes say, not with {:?}",
            object_at(token)
        );
    }
    // Entered at its first page, an object that fits goes out whole.
    let object = objects
        .iter()
        .filter(|o| o.first_token >= 4 && o.page_sizes.len() > 1)
        .min_by_key(|o| o.first_token)
        .expect("a later object of several pages");
    let at = object.first_token;
    let fits = object.page_sizes.iter().sum::<u64>();
    let mut r = pipelined("o", 0, at, at, fits);
    r.accept_spooled = true;
    let whole = h.ok(r, b"");
    assert_eq!(
        whole.header.page_next_token,
        at + object.page_sizes.len() as u64,
        "{object:?}"
    );
}

/// An object spilled from an ARBITRARY task's shared log holds its pages
/// under the log's tokens, which a buffer's hand-out numbers anew: it is
/// never offered whole as a spooled segment (a client checks the object's
/// first token against the reply's and refused it), while a PARTITIONED
/// buffer's object read whole from its first page is.
#[test]
fn objects_of_handed_out_pages_are_never_offered_whole() {
    for kind in [BufferKind::Partitioned, BufferKind::Arbitrary] {
        let mut h = presigning(4 << 20);
        h.ok(open_with("o", kind, 1, "overflow"), b"");
        let page = vec![b's'; 40_000];
        for _ in 0..40 {
            assert_eq!(status(&h.enqueue("o", 0, &[&page])), Status::Ok);
            h.complete(false);
        }
        assert!(h.stored().len() > 2, "{kind:?}: pages spilled");
        let mut r = data("o", 0, 0, 4 << 20);
        r.accept_spooled = true;
        let (_, handled) = h.send_req(r, b"");
        let Handled::Plan(plan) = handled else {
            panic!("{kind:?}: a read from storage: {handled:?}")
        };
        let offered = plan
            .parts
            .iter()
            .filter(|p| {
                matches!(
                    p,
                    PlanPart::Object {
                        may_presign: true,
                        ..
                    }
                )
            })
            .count();
        match kind {
            BufferKind::Arbitrary => assert_eq!(offered, 0, "{:?}", plan.parts),
            _ => assert!(offered > 0, "{:?}", plan.parts),
        }
        let reply = h.read(plan);
        assert_eq!(status(&reply), Status::Ok, "{}", reply.header.error);
    }
}

fn numbered(task: &str, buffer: u64, token: u64, pages: &[&[u8]]) -> (BinRequest, Vec<u8>) {
    let (mut r, body) = enqueue_req(task, buffer, pages);
    r.append_token = Some(token);
    (r, body)
}

fn finish_at(task: &str, buffer: u64, token: Option<u64>) -> BinRequest {
    let mut r = req(MessageType::NoMorePages, task, buffer);
    r.append_token = token;
    r
}

/// The race the wide simulation found (seeds 21163439 and five more): an
/// ENQUEUE fails in storage, and one its producer sent before it saw that
/// refusal arrives after it. Unnumbered, the later one is applied and every
/// page after the hole moves up a token; numbered, it is refused and the
/// producer resends from the hole.
#[test]
fn an_enqueue_sent_behind_a_refused_one_is_refused_when_numbered() {
    for numbered_appends in [false, true] {
        let mut h = spooled(CoreConfig::default());
        h.ok(open_with("a", BufferKind::Partitioned, 1, "always"), b"");
        let make = |token: u64, pages: &[&[u8]]| {
            if numbered_appends {
                numbered("a", 0, token, pages)
            } else {
                enqueue_req("a", 0, pages)
            }
        };
        let (r, body) = make(0, &[b"p0"]);
        let t = h.pending(r, &body);
        h.complete(true);
        assert_eq!(status(&h.outcome(t).expect("answered")), Status::Busy);
        // Sent before the producer read that BUSY, arriving after it.
        let (r, body) = make(1, &[b"p1", b"p2"]);
        let (t, handled) = h.send_req(r, &body);
        if !numbered_appends {
            assert!(matches!(handled, Handled::Pending));
            h.complete(false);
            assert_eq!(status(&h.outcome(t).unwrap()), Status::Ok);
            assert_eq!(
                pages_of(&h.ok(data("a", 0, 0, 0), b"")),
                vec![b"p1".to_vec(), b"p2".to_vec()],
                "1.2 semantics: page 1 got token 0"
            );
            continue;
        }
        let Handled::Reply(refused) = handled else {
            panic!("a misnumbered ENQUEUE is refused at once: {handled:?}")
        };
        assert_eq!(status(&refused), Status::BadRequest);
        assert_eq!(
            (refused.header.page_token, refused.header.page_next_token),
            (1, 0),
            "the refusal names the token asked and where the buffer is"
        );
        assert_refused(
            &refused,
            Refusal::Misnumbered {
                what: Mutation::Enqueue,
                task: tid("a"),
                buffer: Some(0),
                wanted: 1,
                next: 0,
            },
        );
        assert_eq!(h.core.pages_held(), 0, "nothing was stored");
        assert_eq!(h.core.stats().append_token_refusals, 1);
        // The producer resends in order: both apply, each at its token.
        for (token, pages, next) in [(0, &[&b"p0"[..]][..], 1), (1, &[b"p1", b"p2"], 3)] {
            let (r, body) = make(token, pages);
            let t = h.pending(r, &body);
            h.complete(false);
            let ok = h.outcome(t).unwrap();
            assert_eq!(status(&ok), Status::Ok, "{}", ok.header.error);
            assert_eq!(
                (ok.header.page_token, ok.header.page_next_token),
                (token, next)
            );
        }
        assert_eq!(
            pages_of(&h.ok(data("a", 0, 0, 0), b"")),
            vec![b"p0".to_vec(), b"p1".to_vec(), b"p2".to_vec()]
        );
    }
}

/// A numbered ENQUEUE resent after its reply was lost is never applied
/// twice: the copy is refused, and the refusal says the pages are in.
#[test]
fn a_numbered_enqueue_repeated_is_refused_and_says_it_was_applied() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    let (r, body) = numbered("t", 1, 0, &[b"a", b"b"]);
    let first = h.ok(r.clone(), &body);
    assert_eq!(
        (first.header.page_token, first.header.page_next_token),
        (0, 2)
    );
    let again = h.reply(r, &body);
    assert_eq!(status(&again), Status::BadRequest);
    assert_eq!(again.header.page_next_token, 2);
    assert_refused(
        &again,
        Refusal::Misnumbered {
            what: Mutation::Enqueue,
            task: tid("t"),
            buffer: Some(1),
            wanted: 0,
            next: 2,
        },
    );
    // Buffer 0 numbers its own pages.
    h.ok(numbered("t", 0, 0, &[b"z"]).0, b"z");
    // NO_MORE_PAGES of one buffer: at its end only.
    let early = h.reply(finish_at("t", 1, Some(1)), b"");
    assert_eq!(status(&early), Status::BadRequest);
    assert_eq!(
        (early.header.page_token, early.header.page_next_token),
        (1, 2)
    );
    let r = h.ok(data("t", 1, 0, 0), b"");
    assert!(
        !r.header.buffer_complete,
        "the refused NO_MORE_PAGES ended nothing"
    );
    h.ok(finish_at("t", 1, Some(2)), b"");
    let r = h.ok(data("t", 1, 2, 0), b"");
    assert!(r.header.buffer_complete);
    // Task-wide on a partitioned task: buffers end at tokens of their own.
    let all = h.reply(finish_at("t", ALL_BUFFERS, Some(1)), b"");
    assert_eq!(status(&all), Status::BadRequest);
    assert_refused(&all, Refusal::NumberedEndOfPartitioned { task: tid("t") });
    h.ok(finish_at("t", ALL_BUFFERS, None), b"");
    assert_eq!(h.core.stats().append_token_refusals, 2);
    // After the finish: pages are refused, but a numbered ENQUEUE of no
    // page at the end (a copy of one that was applied) adds nothing, OK.
    let late = h.reply(numbered("t", 1, 2, &[b"x"]).0, b"x");
    assert_eq!(status(&late), Status::BadRequest);
    assert_refused(&late, Refusal::TaskFinished { task: tid("t") });
    h.ok(numbered("t", 1, 2, &[]).0, b"");
    assert_eq!(
        status(&h.reply(enqueue_req("t", 1, &[]).0, b"")),
        Status::BadRequest
    );
}

/// BROADCAST and ARBITRARY tasks number their pages task-wide, whatever
/// `buffer_id` an ENQUEUE names; a deleted PARTITIONED buffer drops pages
/// whatever their numbers.
#[test]
fn shared_and_deleted_buffers_number_as_their_pages_go() {
    for kind in [BufferKind::Broadcast, BufferKind::Arbitrary] {
        let mut h = harness(CoreConfig::default());
        h.ok(open("s", kind, 2), b"");
        h.ok(numbered("s", 0, 0, &[b"a"]).0, b"a");
        h.ok(numbered("s", 1, 1, &[b"b", b"c"]).0, b"bc");
        let wrong = h.reply(numbered("s", 0, 1, &[b"d"]).0, b"d");
        assert_eq!(status(&wrong), Status::BadRequest, "{kind:?}");
        assert_eq!(wrong.header.page_next_token, 3);
        let early = h.reply(finish_at("s", ALL_BUFFERS, Some(2)), b"");
        assert_eq!(status(&early), Status::BadRequest, "{kind:?}");
        h.ok(finish_at("s", ALL_BUFFERS, Some(3)), b"");
    }
    let mut h = harness(CoreConfig::default());
    h.ok(open("d", BufferKind::Partitioned, 2), b"");
    h.ok(req(MessageType::Delete, "d", 1), b"");
    let dropped = h.ok(numbered("d", 1, 7, &[b"x", b"y"]).0, b"xy");
    assert_eq!(
        (dropped.header.page_token, dropped.header.page_next_token),
        (7, 9)
    );
    h.ok(finish_at("d", 1, Some(9)), b"");
}

fn committed_req(task: &str, from: u64) -> BinRequest {
    let mut r = req(MessageType::Committed, task, 0);
    r.page_token = from;
    r
}

/// Policy `commit`: pages stay in memory while the task writes; its
/// task-wide NO_MORE_PAGES writes what is left to storage, then the task's
/// manifest with a marker per buffer in it (no object a marker), and only
/// then says OK. The objects stay while the manifest names them.
#[test]
fn commit_makes_no_more_pages_the_durability_point_and_writes_a_manifest() {
    let mut h = spooled(CoreConfig::default());
    h.ok(open_with("c", BufferKind::Partitioned, 3, "commit"), b"");
    h.ok(numbered("c", 0, 0, &[b"aa", b"bbb"]).0, b"aabbb");
    h.ok(numbered("c", 2, 0, &[b"z"]).0, b"z");
    h.drain();
    assert!(
        h.commands.is_empty(),
        "nothing is written while the task writes"
    );
    assert!(h.core.pages_held() == 3);
    let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
    // Spills of the finished buffers first; the NO_MORE_PAGES waits.
    h.drain();
    assert!(
        h.commands
            .iter()
            .all(|(_, c)| matches!(c, Command::WriteSegment { .. })),
        "{:?}",
        h.commands
    );
    assert!(h.outcome(t).is_none());
    h.complete(false);
    let ok = h.outcome(t).expect("answered once committed");
    assert_eq!(status(&ok), Status::Ok, "{}", ok.header.error);
    assert_eq!(
        h.folded_markers().len(),
        3,
        "a marker per buffer, empty ones too, in the manifest"
    );
    assert!(
        h.markers().is_empty(),
        "no marker objects: {:?}",
        h.markers()
    );
    assert_eq!(h.manifests().len(), 1);
    assert_eq!(h.manifests()[0].buffers, vec![(2, 5), (0, 0), (1, 1)]);
    // Written at the finish, the pages stay in memory too: readers come
    // after the finish, and are served without a read of storage.
    assert_eq!(h.core.pages_held(), 3, "the committed pages stay in memory");
    let Handled::Reply(served) = h.send_req(data("c", 0, 0, 0), b"").1 else {
        panic!("a committed buffer is served from memory");
    };
    assert_eq!(pages_of(&served), vec![b"aa".to_vec(), b"bbb".to_vec()]);
    // COMMITTED reads the manifest back.
    let r = h.reply_after(committed_req("c", 0));
    assert_eq!(status(&r), Status::Ok, "{}", r.header.error);
    let c = r.header.committed.clone().expect("the commit");
    assert_eq!(
        (c.buffer_count, c.end_tokens, c.bytes),
        (3, vec![2, 0, 1], vec![5, 0, 1])
    );
    assert_eq!(
        (c.node.as_str(), c.endpoint.as_str()),
        (h.store.node.as_str(), h.store.endpoint.as_str()),
        "the writer the manifest names"
    );
    assert!(r.header.buffer_complete);
    assert_eq!(r.header.page_next_token, 3);
    // Past the last buffer: refused; a task without a manifest: NO_DATA.
    assert_eq!(
        status(&h.reply_after(committed_req("c", 3))),
        Status::BadRequest
    );
    assert_eq!(
        status(&h.reply_after(committed_req("nope", 0))),
        Status::NoData
    );
    // Deleting a buffer leaves its objects while the manifest names them
    // (a reader of the task from storage finds them all); deleting every
    // buffer ends the task: the manifest goes, then the objects.
    let objects = h.stored().len();
    assert_eq!(objects, 2, "buffers 0 and 2 hold pages: {:?}", h.stored());
    for b in 0..2 {
        h.ok(req(MessageType::Delete, "c", b), b"");
    }
    h.complete(false);
    assert_eq!(h.stored().len(), objects, "{:?}", h.stored());
    assert_eq!(h.manifests().len(), 1);
    h.ok(req(MessageType::Delete, "c", 2), b"");
    h.drain();
    assert!(
        h.commands
            .iter()
            .all(|(_, c)| matches!(c, Command::DeleteManifest { .. })),
        "the manifest goes before its objects: {:?}",
        h.commands
    );
    h.complete(false);
    assert!(h.manifests().is_empty(), "{:?}", h.manifests());
    assert!(h.folded_markers().is_empty(), "{:?}", h.folded_markers());
    assert!(h.stored().is_empty(), "{:?}", h.stored());
}

/// A manifest with the markers folded in that the store refuses for good
/// (not transient, as binx-spool refuses one past what a reader takes):
/// the NO_MORE_PAGES is BUSY, and the repeated one writes the markers apart
/// (an object each, then a manifest of format 1), as it does with
/// `fold_markers` off.
#[test]
fn a_folded_manifest_refused_for_good_commits_with_the_markers_apart() {
    for fold_markers in [true, false] {
        let mut h = harness(CoreConfig {
            spool: Some(SpoolRules {
                fold_markers,
                ..SpoolRules::default()
            }),
            ..CoreConfig::default()
        });
        h.ok(open_with("c", BufferKind::Partitioned, 2, "commit"), b"");
        h.ok(numbered("c", 0, 0, &[b"aa"]).0, b"aa");
        let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
        h.complete_with(|c| match c {
            Command::WriteManifest(plan) if !plan.markers.is_empty() => Some(StoreFailure {
                transient: false,
                reason: "would be 5000000 bytes".into(),
            }),
            _ => None,
        });
        let first = h.outcome(t).expect("answered");
        if fold_markers {
            assert_eq!(status(&first), Status::Busy, "{}", first.header.error);
            assert!(
                first.header.error.contains("5000000"),
                "{}",
                first.header.error
            );
            assert!(h.folded_markers().is_empty() && h.markers().is_empty());
            let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
            h.complete(false);
            let ok = h.outcome(t).expect("answered");
            assert_eq!(status(&ok), Status::Ok, "{}", ok.header.error);
        } else {
            assert_eq!(status(&first), Status::Ok, "{}", first.header.error);
        }
        assert_eq!(h.markers().len(), 2, "fold_markers {fold_markers}");
        assert!(h.folded_markers().is_empty());
        assert_eq!(h.manifests().len(), 1);
    }
}

/// A task aborted while its finish is committed: the NO_MORE_PAGES is
/// refused as aborted, whether the abort came while the markers or while
/// the manifest were written (review: it was answered OK, so an engine
/// counted as committed an attempt whose output was being deleted), and
/// the task's markers, manifest and segments all go.
#[test]
fn an_abort_while_a_finish_commits_refuses_the_finish() {
    for held in ["marker", "manifest"] {
        let mut h = spooled(CoreConfig::default());
        h.ok(open_with("c", BufferKind::Partitioned, 2, "commit"), b"");
        h.ok(numbered("c", 0, 0, &[b"aa"]).0, b"aa");
        h.ok(numbered("c", 1, 0, &[b"b"]).0, b"b");
        if held == "marker" {
            // Buffer 0 finished on its own has a marker object, so the
            // task-wide commit writes buffer 1's apart too (not folded).
            let t0 = h.pending(finish_at("c", 0, None), b"");
            h.complete(false);
            assert_eq!(status(&h.outcome(t0).expect("buffer 0")), Status::Ok);
        }
        let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
        // Storage does all it is asked up to the writes held.
        let mut waiting = Vec::new();
        while waiting.is_empty() {
            h.drain();
            let commands = std::mem::take(&mut h.commands);
            assert!(!commands.is_empty(), "{held}: the commit went on");
            for (op, command) in commands {
                let hold = match held {
                    "marker" => matches!(command, Command::WriteMarker(_)),
                    _ => matches!(command, Command::WriteManifest(_)),
                };
                if hold {
                    waiting.push((op, command));
                } else {
                    let done = h.store.carry_out(command);
                    done.deliver(&mut h.core, op, h.now);
                }
            }
        }
        assert!(h.outcome(t).is_none(), "{held}: not answered yet");
        let mut abort = req(MessageType::AbortTask, "c", 0);
        abort.reason = "query cancelled".into();
        h.ok(abort, b"");
        h.commands.splice(0..0, waiting);
        h.complete(false);
        let r = h.outcome(t).expect("answered");
        assert_refused(
            &r,
            Refusal::Aborted {
                task: tid("c"),
                reason: "query cancelled".into(),
            },
        );
        assert!(h.markers().is_empty(), "{held}: {:?}", h.markers());
        assert!(h.manifests().is_empty(), "{held}: {:?}", h.manifests());
        assert!(h.stored().is_empty(), "{held}: {:?}", h.stored());
    }
}

/// A spooled core with 64 KiB of memory, for the tests of what leaves it.
fn small_memory() -> Harness {
    spooled(CoreConfig {
        memory_limit: 64 << 10,
        task_memory_limit: 64 << 10,
        ..CoreConfig::default()
    })
}

/// Opens `task` under `commit` with one buffer, writes `pages` and
/// finishes it: committed.
fn commit_one(h: &mut Harness, task: &str, pages: &[&[u8]]) {
    h.ok(open_with(task, BufferKind::Partitioned, 1, "commit"), b"");
    let (r, body) = enqueue_req(task, 0, pages);
    h.ok(r, &body);
    let t = h.pending(finish_at(task, ALL_BUFFERS, None), b"");
    h.complete(false);
    assert_eq!(status(&h.outcome(t).expect("committed")), Status::Ok);
}

/// An ENQUEUE that may wait for room, answered at once or once the core
/// has done what it asked (with no storage work carried out).
fn enqueue_waiting(h: &mut Harness, task: &str, pages: &[&[u8]]) -> Reply {
    let (r, body) = enqueue_req(task, 0, pages);
    let (t, handled) = h.send_req(waiting(r, Duration::from_secs(5)), &body);
    match handled {
        Handled::Reply(reply) => reply,
        _ => {
            h.drain();
            h.outcome(t).expect("answered without storage")
        }
    }
}

/// No segment write was asked for.
fn no_write_asked(h: &Harness) -> bool {
    h.commands
        .iter()
        .all(|(_, c)| !matches!(c, Command::WriteSegment { .. }))
}

/// What a `commit` task's finish wrote stays in memory until room is
/// wanted: then it leaves at once, with no write (it is in storage), oldest
/// first, and is read from storage after; the ENQUEUE that wanted the room
/// goes on.
#[test]
fn committed_pages_leave_memory_without_a_write_when_room_is_wanted() {
    let mut h = small_memory();
    let page = vec![b'c'; 10 << 10];
    commit_one(&mut h, "old", &[&page, &page]);
    commit_one(&mut h, "new", &[&page, &page]);
    assert_eq!(h.core.pages_held(), 4, "both commits stay in memory");
    let held = h.core.memory_used();
    assert!(held >= 40 << 10, "{held}");
    let written = h.stored().len();
    // A third task needs more room than is left: the oldest committed
    // pages leave memory, and nothing is written for it.
    h.ok(open_with("more", BufferKind::Partitioned, 1, "commit"), b"");
    let (r, body) = enqueue_req("more", 0, &[&page, &page]);
    let reply = h.reply(r, &body);
    assert_eq!(status(&reply), Status::Ok, "{}", reply.header.error);
    h.drain();
    assert!(no_write_asked(&h), "{:?}", h.commands);
    assert_eq!(h.stored().len(), written, "no write to free the room");
    assert!(h.core.memory_used() <= 64 << 10);
    // The oldest commit is read from storage now, the newer from memory.
    let Handled::Plan(_) = h.send_req(data("old", 0, 0, 0), b"").1 else {
        panic!("the oldest committed pages left memory");
    };
    h.complete(false);
    let Handled::Reply(newer) = h.send_req(data("new", 0, 0, 0), b"").1 else {
        panic!("the newer committed pages are still in memory");
    };
    assert_eq!(pages_of(&newer), vec![page.clone(), page.clone()]);
    let old = h.reply_after(data("old", 0, 0, 0));
    assert_eq!(pages_of(&old), vec![page.clone(), page.clone()]);
}

/// Only as much leaves memory as a waiting ENQUEUE misses: the oldest
/// committed buffer goes, a newer one stays and is served from memory.
#[test]
fn only_what_an_enqueue_misses_leaves_memory_oldest_first() {
    let mut h = small_memory();
    let page = vec![b'c'; 10 << 10];
    commit_one(&mut h, "old", &[&page, &page]);
    commit_one(&mut h, "new", &[&page, &page]);
    // It misses a little of the room: one commit's pages make it, and with
    // them memory stays under three quarters of the limit.
    h.ok(open_with("more", BufferKind::Partitioned, 1, "off"), b"");
    let small = vec![b'm'; 8 << 10];
    let reply = enqueue_waiting(&mut h, "more", &[&small, &small, &small]);
    assert_eq!(status(&reply), Status::Ok, "{}", reply.header.error);
    let evicted = h.core.stats().bytes_evicted;
    assert!((20 << 10..30 << 10).contains(&evicted), "{evicted}");
    let Handled::Reply(newer) = h.send_req(data("new", 0, 0, 0), b"").1 else {
        panic!("the newer commit stays in memory");
    };
    assert_eq!(pages_of(&newer), vec![page.clone(), page.clone()]);
    let Handled::Plan(_) = h.send_req(data("old", 0, 0, 0), b"").1 else {
        panic!("the oldest commit left memory");
    };
    h.complete(false);
}

/// Committed pages in memory leave it for an ENQUEUE of any policy: an
/// `off` task's (nothing of it can spill) and an `overflow` task's, whose
/// own pages are not written when what left memory makes the room.
#[test]
fn committed_pages_leave_memory_for_off_and_overflow_enqueues_before_any_spill() {
    for policy in ["off", "overflow"] {
        let mut h = small_memory();
        let page = vec![b'c'; 10 << 10];
        commit_one(&mut h, "done", &[&page, &page, &page]);
        assert_eq!(h.core.pages_held(), 3);
        let written = h.stored().len();
        h.ok(open_with("next", BufferKind::Partitioned, 1, policy), b"");
        // Below three quarters of the limit nothing leaves memory.
        let (r, body) = enqueue_req("next", 0, &[&page]);
        h.ok(r, &body);
        assert_eq!(h.core.stats().bytes_evicted, 0, "{policy}");
        // This one needs more than the room left, and may wait for it.
        let reply = enqueue_waiting(&mut h, "next", &[&page, &page, &page]);
        assert_eq!(
            status(&reply),
            Status::Ok,
            "{policy}: {}",
            reply.header.error
        );
        assert!(no_write_asked(&h), "{policy}: {:?}", h.commands);
        assert_eq!(h.stored().len(), written, "{policy}: nothing written");
        assert!(h.core.stats().bytes_evicted >= 30 << 10, "{policy}");
        assert!(h.core.memory_used() <= 64 << 10, "{policy}");
        let done = h.reply_after(data("done", 0, 0, 0));
        assert_eq!(pages_of(&done), vec![page.clone(); 3], "{policy}");
    }
}

/// Runs the spill writes of a task-wide commit of task "c" round by round
/// (each round carries out the writes issued then, and nothing they lead
/// to); returns how many were in flight at each round, and checks the
/// NO_MORE_PAGES `t` waits for all of them, then commits.
fn spill_rounds(h: &mut Harness, t: Ticket) -> Vec<usize> {
    let mut rounds = Vec::new();
    loop {
        h.drain();
        let writes = h
            .commands
            .iter()
            .filter(|(_, c)| matches!(c, Command::WriteSegment { .. }))
            .count();
        if writes == 0 {
            break;
        }
        assert_eq!(writes, h.commands.len(), "{:?}", h.commands);
        assert!(
            h.commands.iter().all(|(_, c)| matches!(
                c,
                Command::WriteSegment {
                    committing: true,
                    ..
                }
            )),
            "a commit's writes say they are one's (the driver may pack them)"
        );
        rounds.push(writes);
        for (op, command) in std::mem::take(&mut h.commands) {
            let done = h.store.carry_out(command);
            done.deliver(&mut h.core, op, h.now);
        }
        assert!(
            h.outcome(t).is_none(),
            "answered before its pages are stored"
        );
    }
    h.complete(false);
    let ok = h.outcome(t).expect("answered once committed");
    assert_eq!(status(&ok), Status::Ok, "{}", ok.header.error);
    rounds
}

fn spill_limited(concurrency: usize, bytes: u64) -> Harness {
    harness(CoreConfig {
        spool: Some(SpoolRules {
            spill_concurrency: concurrency,
            spill_bytes_max: bytes,
            ..SpoolRules::default()
        }),
        ..CoreConfig::default()
    })
}

/// A task-wide commit writes its buffers' last pages `spill_concurrency`
/// segments at a time, never more, and answers once all are written.
#[test]
fn a_commit_writes_at_most_spill_concurrency_segments_at_once() {
    let mut h = spill_limited(3, 1 << 20);
    h.ok(open_with("c", BufferKind::Partitioned, 8, "commit"), b"");
    for b in 0..8 {
        h.ok(numbered("c", b, 0, &[b"page"]).0, b"page");
    }
    let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
    assert_eq!(spill_rounds(&mut h, t), vec![3, 3, 2]);
    assert_eq!(h.folded_markers().len(), 8);
}

/// Spill writes in flight hold at most `spill_bytes_max` of pages, past the
/// first: a segment larger than that is written alone, and the writes
/// behind it wait for it.
#[test]
fn spill_writes_in_flight_hold_at_most_spill_bytes_max() {
    let mut h = spill_limited(8, 10);
    h.ok(open_with("c", BufferKind::Partitioned, 7, "commit"), b"");
    let large = [b'x'; 40];
    for b in 0..7 {
        let page: &[u8] = if b == 3 { &large } else { b"four" };
        h.ok(numbered("c", b, 0, &[page]).0, page);
    }
    let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
    // One write carried out at a time, oldest first; after each, what is
    // in flight is checked.
    let (mut written, mut most, mut large_alone) = (0, 0, false);
    loop {
        h.drain();
        let in_flight: Vec<u64> = h
            .commands
            .iter()
            .filter_map(|(_, c)| match c {
                Command::WriteSegment { pages, .. } => {
                    Some(pages.iter().map(|p| p.len() as u64).sum())
                }
                _ => None,
            })
            .collect();
        if in_flight.is_empty() {
            break;
        }
        assert_eq!(in_flight.len(), h.commands.len(), "{:?}", h.commands);
        assert!(
            in_flight.len() == 1 || in_flight.iter().sum::<u64>() <= 10,
            "{in_flight:?} in flight"
        );
        large_alone |= in_flight == [40];
        most = most.max(in_flight.len());
        let (op, command) = h.commands.remove(0);
        let done = h.store.carry_out(command);
        done.deliver(&mut h.core, op, h.now);
        written += 1;
        assert!(
            h.outcome(t).is_none(),
            "answered before its pages are stored"
        );
    }
    assert!(large_alone, "the 40-byte segment was written beside others");
    assert_eq!((written, most), (7, 2), "two 4-byte writes fit in 10 bytes");
    h.complete(false);
    let ok = h.outcome(t).expect("answered once committed");
    assert_eq!(status(&ok), Status::Ok, "{}", ok.header.error);
    assert_eq!(h.folded_markers().len(), 7);
}

/// A spill that fails while a `commit` task's NO_MORE_PAGES waits makes it
/// BUSY (the buffer stays finished); NO_MORE_PAGES again commits it.
#[test]
fn a_failed_spill_makes_the_commit_busy_and_a_repeat_commits() {
    let mut h = spooled(CoreConfig::default());
    h.ok(open_with("c", BufferKind::Partitioned, 1, "commit"), b"");
    h.ok(numbered("c", 0, 0, &[b"x"]).0, b"x");
    let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
    h.complete(true);
    let busy = h.outcome(t).expect("answered");
    assert_refused(
        &busy,
        Refusal::CommitSpillFailed {
            task: tid("c"),
            buffer: None,
            failure: StoreFailure::transient("the store is unreachable"),
        },
    );
    assert!(h.manifests().is_empty());
    // After the pause, a repeat goes through.
    h.advance(10 * SEC);
    let t = h.pending(finish_at("c", ALL_BUFFERS, None), b"");
    h.complete(false);
    assert_eq!(status(&h.outcome(t).expect("answered")), Status::Ok);
    assert_eq!(h.manifests().len(), 1);
    assert_eq!(h.manifests()[0].buffers, vec![(1, 1)]);
}

/// COMMITTED is local only, lists at most 2048 buffers a reply, and says
/// BUSY when storage cannot be read.
#[test]
fn committed_pages_through_large_tasks_and_is_refused_remotely() {
    let mut h = spooled(CoreConfig::default());
    h.ok(open_with("w", BufferKind::Partitioned, 5000, "always"), b"");
    let t = h.pending(numbered("w", 4999, 0, &[b"last"]).0, b"last");
    h.complete(false);
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Ok);
    let t = h.pending(finish_at("w", ALL_BUFFERS, None), b"");
    h.complete(false);
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Ok);
    let first = h.reply_after(committed_req("w", 0));
    assert_eq!(first.header.page_next_token, 2048);
    assert!(!first.header.buffer_complete);
    let second = h.reply_after(committed_req("w", 2048));
    assert_eq!(second.header.page_next_token, 4096);
    assert!(!second.header.buffer_complete);
    let rest = h.reply_after(committed_req("w", 4096));
    let c = rest.header.committed.clone().unwrap();
    assert_eq!(c.end_tokens.len(), 904);
    assert_eq!((c.end_tokens[903], c.bytes[903]), (1, 4));
    assert!(rest.header.buffer_complete);
    // Storage down: BUSY, retry.
    let (ticket, _) = h.send_req(committed_req("w", 0), b"");
    h.complete(true);
    assert_eq!(status(&h.outcome(ticket).unwrap()), Status::Busy);
    // On TCP it never reaches the core.
    let mut raw = committed_req("w", 0);
    raw.request_id = 1;
    assert!(Request::parse(&raw, Door::Remote).is_err());
}

/// While its producer holds a connection, a task that commits its output
/// keeps every buffer however long nobody reads (fault-tolerant execution
/// reads a stage only once it finished), and no task is dropped; the
/// abandon clock starts when its last producer connection closes.
#[test]
fn a_task_whose_producer_holds_its_connection_is_never_abandoned() {
    let mut h = harness(CoreConfig {
        abandon_after: 10 * SEC,
        spool: Some(SpoolRules::default()),
        ..CoreConfig::default()
    });
    h.ok(open_with("p", BufferKind::Partitioned, 1, "commit"), b"");
    h.ok(numbered("p", 0, 0, &[b"a"]).0, b"a");
    // A streaming task on another connection loses an unpolled buffer,
    // but is not dropped itself while its producer holds on.
    h.send(
        ConnId(2),
        open("s", BufferKind::Partitioned, 1),
        Payload::empty(),
    );
    let (r, body) = enqueue_req("s", 0, &[b"x"]);
    h.send(ConnId(2), r, Payload::exact(Bytes::from(body)));
    for _ in 0..10 {
        h.advance(10 * SEC);
    }
    assert_eq!(
        h.core.stats().abandoned_buffers,
        1,
        "only the streaming one"
    );
    assert_eq!(h.core.stats().tasks, 2);
    h.ok(numbered("p", 0, 1, &[b"b"]).0, b"b");
    h.core.connection_closed(ConnId(1), h.now);
    h.advance(5 * SEC);
    assert_eq!(
        h.core.stats().abandoned_buffers,
        1,
        "the clock starts at the close"
    );
    for _ in 0..4 {
        h.advance(SEC * 5 / 2);
    }
    assert_eq!(h.core.stats().abandoned_buffers, 2);
    // The dropped task refuses later pages, saying so; once its tombstone
    // expired (after the abandon time), it says it does not know the task.
    let late = h.reply(numbered("p", 0, 2, &[b"c"]).0, b"c");
    assert_eq!(status(&late), Status::ServerError, "{}", late.header.error);
    assert_refused(
        &late,
        Refusal::ProducerOfDroppedTask {
            what: Mutation::Enqueue,
            task: tid("p"),
            after: h.core.config().abandon_after,
        },
    );
    for _ in 0..3 {
        h.advance(10 * SEC);
    }
    let later = h.reply(numbered("p", 0, 2, &[b"c"]).0, b"c");
    assert_eq!(status(&later), Status::BadRequest);
    assert_refused(
        &later,
        Refusal::EnqueueUnknownTask {
            task: tid("p"),
            after: h.core.config().abandon_after,
        },
    );
}

/// A core with a 10 s abandon time and a 100 s TTL, holding task `task`
/// under `always`: one page in buffer 0, committed by a task-wide
/// NO_MORE_PAGES (both answered OK).
fn committed_one_page(task: &str) -> Harness {
    let mut h = harness(CoreConfig {
        abandon_after: 10 * SEC,
        spool: Some(SpoolRules {
            ttl: 100 * SEC,
            ..SpoolRules::default()
        }),
        ..CoreConfig::default()
    });
    h.ok(open_with(task, BufferKind::Partitioned, 1, "always"), b"");
    let (r, body) = numbered(task, 0, 0, &[b"kept"]);
    let t = h.pending(r, &body);
    h.complete(false);
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Ok);
    let t = h.pending(finish_at(task, ALL_BUFFERS, None), b"");
    h.complete(false);
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Ok);
    h
}

/// An engine may keep one connection for all its tasks: once a task's
/// task-wide NO_MORE_PAGES is answered, that connection holds it no more
/// (nor does a repeated NO_MORE_PAGES on it), so a committed buffer nobody
/// reads loses its memory after the abandon time, and the task ends at
/// its TTL, while the connection stays open.
#[test]
fn a_finished_task_is_not_held_by_its_producers_open_connection() {
    let mut h = committed_one_page("f");
    h.ok(finish_at("f", ALL_BUFFERS, None), b"");
    assert!(h.core.stats().page_bytes_held > 0);
    for _ in 0..4 {
        h.advance(10 * SEC);
    }
    assert_eq!(
        h.core.stats().page_bytes_held,
        0,
        "its memory went, the producer's connection open"
    );
    assert_eq!(h.core.stats().abandoned_buffers, 0);
    for _ in 0..8 {
        h.advance(10 * SEC);
    }
    assert_eq!(h.core.stats().abandoned_buffers, 1, "dropped at its TTL");
    assert_eq!(h.core.stats().tasks, 0, "and the task with it");
}

/// A committed buffer nobody reads loses its memory after the abandon time
/// (it is read from storage), and is dropped only once its objects expire.
#[test]
fn a_committed_buffer_outlives_the_abandon_time_until_its_ttl() {
    let mut h = committed_one_page("a");
    h.core.connection_closed(ConnId(1), h.now);
    assert!(h.core.stats().page_bytes_held > 0);
    for _ in 0..4 {
        h.advance(10 * SEC);
    }
    assert_eq!(h.core.stats().abandoned_buffers, 0);
    assert_eq!(h.core.stats().page_bytes_held, 0, "its memory went");
    // Still served, from storage.
    assert_eq!(
        pages_of(&h.ok(data("a", 0, 0, 0), b"")),
        vec![b"kept".to_vec()],
        "the pages as enqueued"
    );
    for _ in 0..12 {
        h.advance(10 * SEC);
    }
    assert_eq!(h.core.stats().abandoned_buffers, 1, "dropped at its TTL");
}

/// Every request type of the protocol is counted under its own name, the
/// newest included; numbers outside it all share one "unknown" entry per
/// status (a type added without a row of its own once took the unknown
/// row, and unknown numbers were reported as COMMITTED).
#[test]
fn reply_counts_name_every_request_type_and_merge_unknown_numbers() {
    let mut h = harness(CoreConfig::default());
    let known: Vec<MessageType> = (0..=255)
        .filter_map(|k| MessageType::try_from(k).ok())
        .collect();
    assert!(known.contains(&MessageType::Committed), "{known:?}");
    for &kind in &known {
        h.core.record_reply(kind as i32, Status::BadRequest as i32);
    }
    assert!(known.contains(&MessageType::DeleteTask), "{known:?}");
    for unknown in [6, 7, 15, 23, 100, -1, i32::MAX] {
        h.core.record_reply(unknown, Status::BadRequest as i32);
    }
    h.core.record_reply(MessageType::Ping as i32, 99);
    let counts = h.core.stats().requests;
    for &kind in &known {
        let found: Vec<_> = counts
            .iter()
            .filter(|c| c.kind == Some(kind) && c.status == Some(Status::BadRequest))
            .collect();
        assert_eq!(found.len(), 1, "{kind:?}: {counts:?}");
        assert_eq!(found[0].count, 1, "{kind:?}");
    }
    let unknown: Vec<_> = counts.iter().filter(|c| c.kind.is_none()).collect();
    assert_eq!(unknown.len(), 1, "{counts:?}");
    assert_eq!(unknown[0].count, 7);
    assert!(
        counts
            .iter()
            .any(|c| c.kind == Some(MessageType::Ping) && c.status.is_none() && c.count == 1)
    );
}

fn delete_task(task: &str, buffers: u64) -> BinRequest {
    let mut r = req(MessageType::DeleteTask, task, 0);
    r.buffer_count = buffers;
    r
}

/// DELETE_TASK does what DELETEs of its buffers do, in one request: a
/// live task's pages freed and the task ended, later DATA complete; pages
/// that come after are dropped.
#[test]
fn delete_task_deletes_every_buffer_named_as_deletes_of_each_would() {
    let mut h = harness(CoreConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 3), b"");
    h.enqueue("t", 0, &[b"abc"]);
    h.enqueue("t", 2, &[b"de", b"f"]);
    h.ok(req(MessageType::NoMorePages, "t", ALL_BUFFERS), b"");
    assert!(h.core.memory_used() > 0);
    let r = h.ok(delete_task("t", 3), b"");
    assert_eq!(r.header.r#type, MessageType::DeleteTask as i32);
    assert_eq!(h.core.memory_used(), 0);
    assert_eq!(h.core.stats().tasks, 0, "every buffer gone ends the task");
    for buffer in 0..3 {
        let r = h.ok(data("t", buffer, 0, 0), b"");
        assert!(r.header.buffer_complete && r.body.is_empty());
    }
    // Repeatable, like DELETE.
    h.ok(delete_task("t", 3), b"");

    // Fewer than all: those named go, the rest stay readable.
    h.ok(open("u", BufferKind::Partitioned, 3), b"");
    h.enqueue("u", 0, &[b"x"]);
    h.enqueue("u", 1, &[b"y"]);
    h.enqueue("u", 2, &[b"z"]);
    h.ok(delete_task("u", 2), b"");
    assert!(h.ok(data("u", 1, 0, 0), b"").header.buffer_complete);
    assert_eq!(pages_of(&h.ok(data("u", 2, 0, 0), b"")), [b"z".to_vec()]);
    assert_eq!(status(&h.enqueue("u", 0, &[b"late"])), Status::Ok);
    assert_eq!(h.core.stats().pages_dropped, 1, "a deleted buffer's page");
    assert_eq!(h.core.pages_held(), 1);
}

/// Refused DELETE_TASKs delete nothing: no buffer, more than the task has,
/// more than any task may have (a task whose buffers grow counts those it
/// has past the range too).
#[test]
fn a_refused_delete_task_deletes_nothing() {
    let mut h = harness(CoreConfig {
        max_buffers_per_task: 8,
        ..CoreConfig::default()
    });
    h.ok(open("t", BufferKind::Partitioned, 3), b"");
    h.enqueue("t", 0, &[b"abc"]);
    assert_refused(
        &h.reply(delete_task("t", 0), b""),
        Refusal::NoBuffersToDelete { task: tid("t") },
    );
    assert_refused(
        &h.reply(delete_task("t", 4), b""),
        Refusal::DeleteTaskTooWide {
            task: tid("t"),
            buffers: 4,
            why: "the task has 3".into(),
        },
    );
    for task in ["t", "unknown"] {
        assert_refused(
            &h.reply(delete_task(task, 9), b""),
            Refusal::DeleteTaskTooWide {
                task: tid(task),
                buffers: 9,
                why: "a task has at most 8 (max_buffers_per_task)".into(),
            },
        );
    }
    assert_refused(
        &h.reply(delete_task("t", u64::MAX), b""),
        Refusal::DeleteTaskTooWide {
            task: tid("t"),
            buffers: u64::MAX,
            why: "a task has at most 8 (max_buffers_per_task)".into(),
        },
    );
    assert_eq!(pages_of(&h.ok(data("t", 0, 0, 0), b"")), [b"abc".to_vec()]);
    // Buffers added until NO_MORE_PAGES: 100 and 101 exist, so 0..7 would
    // make the task hold 9 buffers.
    h.ok(open("g", BufferKind::Partitioned, 0), b"");
    h.enqueue("g", 100, &[b"six"]);
    h.enqueue("g", 101, &[b"seven"]);
    assert_refused(
        &h.reply(delete_task("g", 7), b""),
        Refusal::DeleteTaskTooWide {
            task: tid("g"),
            buffers: 7,
            why: "the task would then have 9 buffers, more than 8 (max_buffers_per_task)".into(),
        },
    );
    assert_eq!(h.core.pages_held(), 3);
    h.ok(delete_task("g", 6), b"");
    assert_eq!(
        pages_of(&h.ok(data("g", 100, 0, 0), b"")),
        [b"six".to_vec()]
    );
    assert_eq!(h.core.pages_held(), 3);
}

/// Before the task opens, DELETE_TASK is remembered as its DELETEs are:
/// the buffers named are born deleted, the others are not.
#[test]
fn a_delete_task_before_the_task_opens_is_remembered() {
    let mut h = harness(CoreConfig::default());
    h.ok(delete_task("early", 2), b"");
    h.ok(open("early", BufferKind::Partitioned, 3), b"");
    assert_eq!(status(&h.enqueue("early", 0, &[b"gone"])), Status::Ok);
    assert_eq!(status(&h.enqueue("early", 1, &[b"gone"])), Status::Ok);
    assert_eq!(status(&h.enqueue("early", 2, &[b"kept"])), Status::Ok);
    assert_eq!(h.core.stats().pages_dropped, 2);
    assert_eq!(
        pages_of(&h.ok(data("early", 2, 0, 0), b"")),
        [b"kept".to_vec()]
    );
}

/// A growing task opened after DELETE_TASK's range and DELETEs of other
/// buffers has those buffers born deleted within `max_buffers_per_task`,
/// never more (a review found the early record made a task of the limit
/// plus 4,096 buffers).
#[test]
fn early_deletes_never_give_a_growing_task_more_buffers_than_its_limit() {
    let mut h = harness(CoreConfig {
        max_buffers_per_task: 8,
        ..CoreConfig::default()
    });
    h.ok(delete_task("early", 8), b"");
    h.ok(req(MessageType::Delete, "early", 100), b"");
    h.ok(req(MessageType::Delete, "early", u64::MAX), b"");
    h.ok(open("early", BufferKind::Partitioned, 0), b"");
    let snapshots = h.core.task_snapshots("early", h.now);
    let buffers: Vec<u64> = snapshots
        .iter()
        .flat_map(|t| t.buffers.iter().map(|b| b.buffer_id))
        .collect();
    assert_eq!(buffers, (0..8).collect::<Vec<_>>());
    assert_eq!(status(&h.enqueue("early", 3, &[b"dropped"])), Status::Ok);
    assert_eq!(h.core.stats().pages_dropped, 1, "born deleted");
    let r = h.enqueue("early", 100, &[b"past the limit"]);
    assert_eq!(status(&r), Status::BadRequest, "{}", r.header.error);
}

/// With a spool, DELETE_TASK of a task this run does not know reads each
/// buffer's marker, as DELETE does, and releases this node's (a restarted
/// sidecar frees all its earlier run committed, not only the buffers its
/// consumers had not deleted before the restart).
#[test]
fn a_delete_task_of_a_forgotten_task_releases_each_buffer_this_node_committed() {
    let mut h = node_a();
    h.ok(delete_task("before-restart", 3), b"");
    let asked: Vec<(OpId, Command)> = h.commands.drain(..).collect();
    let buffers: Vec<u64> = asked
        .iter()
        .map(|(_, c)| match c {
            Command::ReadMarker { task, buffer } if task.as_str() == "before-restart" => *buffer,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(buffers, [0, 1, 2]);
    for (op, command) in asked {
        let Command::ReadMarker { buffer, .. } = command else {
            unreachable!()
        };
        h.core.marker_read(
            op,
            Ok(Some(marker("before-restart", buffer, "node-a", &[3]))),
            h.now,
        );
    }
    h.drain();
    let released: Vec<u64> = h
        .commands
        .drain(..)
        .map(|(_, c)| match c {
            Command::ReleaseCommitted(m) => m.buffer_id,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(released, [0, 1, 2]);
    assert_eq!(h.core.stats().forgotten_releases, 3);
    // Each buffer's marker is read once while the range is remembered:
    // again, or a DELETE of one of them, reads nothing; one past it does.
    h.ok(delete_task("before-restart", 3), b"");
    h.ok(req(MessageType::Delete, "before-restart", 1), b"");
    assert!(h.commands.is_empty(), "{:?}", h.commands);
    h.ok(delete_task("before-restart", 5), b"");
    let asked: Vec<u64> = h
        .commands
        .drain(..)
        .map(|(_, c)| match c {
            Command::ReadMarker { buffer, .. } => buffer,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(asked, [3, 4]);
}

/// Through a local sidecar, DELETE_TASK goes on to the remote as one
/// request and its answer comes back as it is; no answer is TIMEOUT naming
/// the task, with no failover (the client deletes buffer by buffer then).
/// A buffer the sidecar serves from storage already refuses it.
#[test]
fn a_proxy_delete_task_is_one_forward_and_never_fails_over() {
    let mut h = spooled(proxying());
    let remote = "10.0.0.9:8091";
    let proxied = |buffers: u64| {
        let mut r = delete_task("q", buffers);
        r.remote = remote.into();
        r
    };
    answer_forward(&mut h, proxied(4), Status::Ok);
    let t = h.pending(proxied(4), b"");
    let forwards: Vec<BinRequest> = h
        .commands
        .drain(..)
        .map(|(op, c)| match c {
            Command::Forward { request, .. } => {
                h.core
                    .forwarded(op, Err("connection refused".into()), h.now);
                *request
            }
            other => panic!("{other:?}"),
        })
        .collect();
    let [sent] = forwards.as_slice() else {
        panic!("{forwards:?}")
    };
    assert_eq!(sent.r#type, MessageType::DeleteTask as i32);
    assert_eq!((sent.task_id.as_str(), sent.buffer_count), ("q", 4));
    assert!(sent.remote.is_empty());
    h.drain();
    let r = h.outcome(t).expect("answered");
    assert_refused(
        &r,
        Refusal::RemoteSilentForTask {
            remote: remote.into(),
            task: tid("q"),
            reason: "connection refused".into(),
        },
    );
    h.now += 31 * SEC;
    let t = h.pending(proxied(4), b"");
    let (op, _) = h.commands.pop().expect("forwarded again");
    h.core
        .forwarded(op, Err("connection refused".into()), h.now);
    h.drain();
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Timeout);
    assert!(h.commands.is_empty(), "no marker read: {:?}", h.commands);
    // A DELETE of buffer 2 fails: the remote has been silent for
    // failover_after, so its marker is read (none) and the buffer is
    // tracked as failing: the task's DELETE_TASK is refused, not sent.
    let mut delete = req(MessageType::Delete, "q", 2);
    delete.remote = remote.into();
    let (t, commands) = fail_forward(&mut h, delete);
    let [Command::ReadMarker { buffer: 2, .. }] = commands.as_slice() else {
        panic!("{commands:?}")
    };
    let read = OpId(h.core_last_op());
    h.core.marker_read(read, Ok(None), h.now);
    h.drain();
    assert_eq!(status(&h.outcome(t).unwrap()), Status::Timeout);
    let r = h.reply(proxied(4), b"");
    assert_refused(
        &r,
        Refusal::DeleteTaskFailingOver {
            task: tid("q"),
            remote: remote.into(),
            buffer: 2,
        },
    );
    // One that names fewer buffers is sent.
    let t = h.pending(proxied(2), b"");
    assert!(matches!(
        h.commands.last(),
        Some((_, Command::Forward { .. }))
    ));
    let _ = t;
}

/// The widest DELETE_TASK costs one pass over the task: a BROADCAST set
/// of the most buffers a task may have ends at once (its shared pages
/// freed once, not per buffer); an unknown task's range is remembered as
/// one record, every buffer of it born deleted when the task opens; with a
/// spool, the marker reads past the queue's room are counted, the rest
/// queued.
#[test]
fn the_widest_delete_task_is_one_pass_and_one_record() {
    let wide = CoreConfig::default().max_buffers_per_task;
    let mut h = harness(CoreConfig::default());
    h.ok(open("b", BufferKind::Broadcast, wide), b"");
    h.enqueue("b", 0, &[b"shared", b"pages"]);
    h.ok(req(MessageType::NoMorePages, "b", ALL_BUFFERS), b"");
    h.ok(delete_task("b", wide), b"");
    assert_eq!(h.core.stats().tasks, 0);
    assert_eq!(h.core.memory_used(), 0);

    let mut h = node_a();
    h.ok(req(MessageType::Delete, "gone", 7), b"");
    h.ok(delete_task("gone", wide), b"");
    let reads = h
        .commands
        .iter()
        .filter(|(_, c)| matches!(c, Command::ReadMarker { .. }))
        .count();
    assert!(reads > 0, "marker reads start");
    let stats = h.core.stats();
    // Buffer 7 was asked already; 4,096 wait or are read; the rest are left.
    assert_eq!(stats.deletes_left_to_ttl, wide - 1 - 4096);
    // Asked again: nothing more is queued or left (the queue is full, so
    // one more buffer would be counted).
    h.ok(delete_task("gone", wide), b"");
    assert_eq!(h.core.stats().deletes_left_to_ttl, wide - 1 - 4096);
    // Opened: every buffer is born deleted, so the task ends with its
    // input, and pages that come are dropped.
    h.ok(open("gone", BufferKind::Partitioned, wide), b"");
    for buffer in [0, 7, wide - 1] {
        assert_eq!(status(&h.enqueue("gone", buffer, &[b"late"])), Status::Ok);
    }
    assert_eq!(h.core.stats().pages_dropped, 3);
    assert_eq!(h.core.pages_held(), 0);
    h.ok(req(MessageType::NoMorePages, "gone", ALL_BUFFERS), b"");
    assert_eq!(h.core.stats().tasks, 0, "every buffer was born deleted");
}
