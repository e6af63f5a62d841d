//! The buffer manager as a state machine: requests in, replies or waits out.

use super::*;

const SEC: Duration = Duration::from_secs(1);

struct Harness {
    manager: BufferManager,
    now: Instant,
    next_id: u64,
}

fn harness(config: ManagerConfig) -> Harness {
    Harness {
        manager: BufferManager::new(config),
        now: Instant::now(),
        next_id: 1,
    }
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

fn data(task: &str, buffer: u64, token: u64, max_size: u64) -> BinRequest {
    let mut r = req(MessageType::Data, task, buffer);
    r.page_token = token;
    r.max_size_bytes = max_size;
    r
}

fn sizes(task: &str, buffer: u64, token: u64) -> BinRequest {
    let mut r = data(task, buffer, token, 0);
    r.get_data_size = true;
    r
}

impl Harness {
    fn send(&mut self, mut request: BinRequest, body: &[u8], may_wait: bool) -> Outcome {
        request.request_id = self.next_id;
        self.next_id += 1;
        self.manager
            .handle(&request, &Bytes::copy_from_slice(body), self.now, may_wait)
    }

    /// Sends and expects a reply (with may_wait = false nothing waits).
    fn reply(&mut self, request: BinRequest, body: &[u8]) -> Reply {
        match self.send(request, body, false) {
            Outcome::Reply(r) => r,
            Outcome::Wait(_) => panic!("request waited with may_wait = false"),
            other => panic!("request needs storage without a spool: {other:?}"),
        }
    }

    fn ok(&mut self, request: BinRequest, body: &[u8]) -> Reply {
        let what = format!("{:?}", request.message_type());
        let r = self.reply(request, body);
        assert_eq!(
            r.header.status_kind(),
            Status::Ok,
            "{what} failed: {}",
            r.header.error
        );
        r
    }

    fn enqueue(&mut self, task: &str, buffer: u64, pages: &[&[u8]]) -> Reply {
        let mut r = req(MessageType::Enqueue, task, buffer);
        r.page_sizes = pages.iter().map(|p| p.len() as u64).collect();
        let body: Vec<u8> = pages.concat();
        self.reply(r, &body)
    }
}

fn pages_of(reply: &Reply) -> Vec<Vec<u8>> {
    reply.body.iter().map(|b| b.to_vec()).collect()
}

fn status(reply: &Reply) -> Status {
    reply.header.status_kind()
}

#[test]
fn partitioned_pages_flow_in_token_order_and_free_on_ack() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    assert_eq!(
        status(&h.enqueue("t", 0, &[b"aa", b"bbb", b"c"])),
        Status::Ok
    );
    assert_eq!(status(&h.enqueue("t", 1, &[b"zz"])), Status::Ok);
    assert_eq!(h.manager.memory_used(), 8);

    let r = h.ok(data("t", 0, 0, 1), b"");
    assert_eq!(
        pages_of(&r),
        vec![b"aa".to_vec()],
        "one page even above max size"
    );
    assert_eq!((r.header.page_token, r.header.page_next_token), (0, 1));
    assert_eq!(r.header.segments, vec![Segment::inline(0, vec![2])]);
    assert!(!r.header.buffer_complete);

    // Repeating the same token returns the same pages.
    let again = h.ok(data("t", 0, 0, 1), b"");
    assert_eq!(pages_of(&again), pages_of(&r));

    // Token 1 acknowledges page 0; whole pages while within the size.
    let r = h.ok(data("t", 0, 1, 4), b"");
    assert_eq!(pages_of(&r), vec![b"bbb".to_vec(), b"c".to_vec()]);
    assert_eq!(h.manager.memory_used(), 6);

    // Below the mark is refused, and refusing changes nothing.
    let r = h.reply(data("t", 0, 0, 10), b"");
    assert_eq!(status(&r), Status::BadRequest);
    assert!(
        r.header.error.contains("below its acknowledged mark 1"),
        "{}",
        r.header.error
    );
    let r = h.reply(data("t", 0, 4, 10), b"");
    assert_eq!(status(&r), Status::BadRequest);
    assert!(
        r.header.error.contains("beyond the next token"),
        "{}",
        r.header.error
    );
    assert_eq!(h.manager.memory_used(), 6);

    // Explicit ACK frees; ACK at or below the mark is harmless; above next is refused.
    h.ok(req_ack("t", 0, 3), b"");
    assert_eq!(h.manager.memory_used(), 2);
    h.ok(req_ack("t", 0, 1), b"");
    assert_eq!(
        status(&h.reply(req_ack("t", 0, 9), b"")),
        Status::BadRequest
    );
}

fn req_ack(task: &str, buffer: u64, token: u64) -> BinRequest {
    let mut r = req(MessageType::Ack, task, buffer);
    r.page_token = token;
    r
}

#[test]
fn completion_comes_with_the_last_pages_and_at_the_end_token() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    h.enqueue("t", 0, &[b"x", b"y"]);
    h.ok(req(MessageType::NoMorePages, "t", 0), b"");
    let r = h.ok(data("t", 0, 0, 1), b"");
    assert!(!r.header.buffer_complete);
    let r = h.ok(data("t", 0, 1, 100), b"");
    assert!(
        r.header.buffer_complete,
        "the reply holding the last page completes"
    );
    let r = h.ok(data("t", 0, 2, 100), b"");
    assert!(r.header.buffer_complete && r.body.is_empty());
    assert_eq!(r.header.page_next_token, 2);
    // ENQUEUE after NO_MORE_PAGES is refused.
    assert_eq!(status(&h.enqueue("t", 0, &[b"late"])), Status::BadRequest);
}

#[test]
fn empty_buffer_waits_then_no_data_and_pages_wake_the_waiter() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 0), b"");
    let Outcome::Wait(notify) = h.send(data("t", 3, 0, 0), b"", true) else {
        panic!("empty buffer should wait");
    };
    let notified = notify.notified();
    tokio::pin!(notified);
    assert!(!notified.as_mut().enable(), "not yet notified");
    h.enqueue("t", 3, &[b"p"]);
    // The enqueue woke the waiter: polling the future now completes it.
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(notified.as_mut().poll(&mut cx).is_ready());

    let r = h.reply(data("t", 4, 0, 0), b"");
    assert_eq!(status(&r), Status::NoData);
    assert_eq!(r.header.page_next_token, 0);
}

#[test]
fn unknown_task_waits_and_sees_its_later_end() {
    let mut h = harness(ManagerConfig::default());
    assert!(matches!(
        h.send(data("later", 0, 0, 0), b"", true),
        Outcome::Wait(_)
    ));
    assert_eq!(
        status(&h.reply(data("later", 0, 0, 0), b"")),
        Status::NoData
    );
    // ABORT of a task nobody opened still tells its consumers.
    let mut abort = req(MessageType::AbortTask, "later", 0);
    abort.reason = "query cancelled".into();
    h.ok(abort, b"");
    let r = h.reply(data("later", 0, 0, 0), b"");
    assert_eq!(status(&r), Status::ServerError);
    assert!(
        r.header.error.contains("query cancelled"),
        "{}",
        r.header.error
    );
}

#[test]
fn get_data_size_lists_sizes_without_pages() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    h.enqueue("t", 0, &[b"12", b"12345"]);
    let r = h.ok(sizes("t", 0, 0), b"");
    assert_eq!(r.header.remaining_bytes, vec![2, 5]);
    assert!(r.body.is_empty() && r.header.segments.is_empty());
    assert_eq!(r.header.page_next_token, 0);
    let r = h.ok(sizes("t", 0, 1), b"");
    assert_eq!(r.header.remaining_bytes, vec![5]);
    assert_eq!(
        h.manager.memory_used(),
        5,
        "the size request acknowledged page 0"
    );
}

#[test]
fn broadcast_gives_every_buffer_every_page_and_frees_when_all_acked() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("b", BufferKind::Broadcast, 2), b"");
    h.enqueue("b", 7, &[b"one", b"two"]);
    assert_eq!(h.manager.memory_used(), 6, "a broadcast page is held once");
    for buffer in 0..2 {
        let r = h.ok(data("b", buffer, 0, 100), b"");
        assert_eq!(pages_of(&r), vec![b"one".to_vec(), b"two".to_vec()]);
    }
    h.ok(req_ack("b", 0, 2), b"");
    assert_eq!(
        h.manager.memory_used(),
        6,
        "buffer 1 has not acknowledged yet"
    );
    h.ok(req_ack("b", 1, 1), b"");
    assert_eq!(h.manager.memory_used(), 3);
    h.ok(req(MessageType::Delete, "b", 1), b"");
    assert_eq!(h.manager.memory_used(), 0);
    h.ok(req(MessageType::NoMorePages, "b", ALL_BUFFERS), b"");
    let r = h.ok(data("b", 0, 2, 100), b"");
    assert!(r.header.buffer_complete);
}

#[test]
fn arbitrary_hands_each_page_to_one_buffer() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("a", BufferKind::Arbitrary, 2), b"");
    h.enqueue("a", 0, &[b"p0", b"p1", b"p2"]);
    let r0 = h.ok(data("a", 0, 0, 2), b"");
    let r1 = h.ok(data("a", 1, 0, 4), b"");
    assert_eq!(pages_of(&r0), vec![b"p0".to_vec()]);
    assert_eq!(pages_of(&r1), vec![b"p1".to_vec(), b"p2".to_vec()]);
    // A retry of buffer 0 at token 0 gets the same page, not a new one.
    assert_eq!(
        pages_of(&h.ok(data("a", 0, 0, 100), b"")),
        vec![b"p0".to_vec()]
    );
    h.ok(req(MessageType::NoMorePages, "a", ALL_BUFFERS), b"");
    assert!(h.ok(data("a", 0, 1, 100), b"").header.buffer_complete);
    assert!(h.ok(data("a", 1, 2, 100), b"").header.buffer_complete);
    assert_eq!(h.manager.memory_used(), 0);
}

#[test]
fn memory_limits_make_enqueue_wait_then_busy_and_store_nothing() {
    let mut h = harness(ManagerConfig {
        memory_limit: 10,
        task_memory_limit: 6,
        ..ManagerConfig::default()
    });
    h.ok(open("t", BufferKind::Partitioned, 1), b"");
    h.ok(open("u", BufferKind::Partitioned, 1), b"");
    assert_eq!(status(&h.enqueue("t", 0, &[b"12345"])), Status::Ok);
    // Over the task limit: waits while it may, then BUSY.
    let mut r = req(MessageType::Enqueue, "t", 0);
    r.page_sizes = vec![2];
    assert!(matches!(h.send(r.clone(), b"ab", true), Outcome::Wait(_)));
    let busy = h.reply(r.clone(), b"ab");
    assert_eq!(status(&busy), Status::Busy);
    assert!(
        busy.header.error.contains("task t"),
        "{}",
        busy.header.error
    );
    assert_eq!(h.manager.memory_used(), 5, "BUSY stored nothing");
    // Another task still has room under the global limit.
    assert_eq!(status(&h.enqueue("u", 0, &[b"12345"])), Status::Ok);
    assert_eq!(
        status(&h.enqueue("u", 0, &[b"1"])),
        Status::Busy,
        "global limit"
    );
    // A consumer frees room; the same ENQUEUE now succeeds.
    assert_eq!(status(&h.reply(data("t", 0, 1, 0), b"")), Status::NoData);
    assert_eq!(status(&h.reply(r, b"ab")), Status::Ok);
    // Larger than any limit: refused outright.
    let r = h.enqueue("t", 0, &[b"1234567"]);
    assert_eq!(status(&r), Status::BadRequest);
    assert_eq!(h.manager.stats().busy_replies, 2);
    assert!(h.manager.stats().memory_high_water <= 10);
}

#[test]
fn an_enqueue_past_the_page_count_limit_is_refused_whole() {
    let mut h = harness(ManagerConfig {
        max_pages_per_enqueue: 4,
        ..ManagerConfig::default()
    });
    h.ok(open("many", BufferKind::Partitioned, 1), b"");
    let five: Vec<&[u8]> = vec![b"a"; 5];
    let refused = h.enqueue("many", 0, &five);
    assert_eq!(status(&refused), Status::BadRequest);
    for named in [
        "5 pages",
        "limit is 4",
        "max_pages_per_enqueue",
        "task many",
        "buffer 0",
    ] {
        assert!(
            refused.header.error.contains(named),
            "{named}: {}",
            refused.header.error
        );
    }
    assert_eq!(h.manager.memory_used(), 0, "nothing of it is stored");
    // At the limit it goes through, from token 0.
    assert_eq!(status(&h.enqueue("many", 0, &five[..4])), Status::Ok);
    let r = h.reply(data("many", 0, 0, 1 << 20), b"");
    assert_eq!(pages_of(&r).len(), 4);
    assert_eq!(r.header.page_token, 0);
}

#[test]
fn abort_frees_memory_and_consumers_see_the_reason() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 0), b"");
    h.enqueue("t", 0, &[b"data"]);
    let mut abort = req(MessageType::AbortTask, "t", 0);
    abort.reason = "worker lost".into();
    h.ok(abort, b"");
    assert_eq!(h.manager.memory_used(), 0);
    let r = h.reply(data("t", 0, 0, 0), b"");
    assert_eq!(status(&r), Status::ServerError);
    assert_eq!(r.header.error, "task t was aborted: worker lost");
    let r = h.enqueue("t", 0, &[b"x"]);
    assert_eq!(status(&r), Status::ServerError);
    assert_eq!(
        status(&h.reply(open("t", BufferKind::Partitioned, 0), b"")),
        Status::BadRequest
    );
}

#[test]
fn delete_frees_the_buffer_and_later_data_is_complete() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    h.enqueue("t", 0, &[b"abc"]);
    h.ok(req(MessageType::Delete, "t", 0), b"");
    h.ok(req(MessageType::Delete, "t", 0), b"");
    assert_eq!(h.manager.memory_used(), 0);
    let r = h.ok(data("t", 0, 0, 0), b"");
    assert!(r.header.buffer_complete && r.body.is_empty());
    // Pages for a deleted buffer are dropped, not held.
    assert_eq!(status(&h.enqueue("t", 0, &[b"more"])), Status::Ok);
    assert_eq!(h.manager.memory_used(), 0);
    // Deleting the last buffer of a finished task ends the task.
    h.ok(req(MessageType::NoMorePages, "t", ALL_BUFFERS), b"");
    h.ok(req(MessageType::Delete, "t", 1), b"");
    assert_eq!(h.manager.stats().tasks, 0);
    assert!(h.ok(data("t", 1, 0, 0), b"").header.buffer_complete);
}

#[test]
fn abandoned_buffers_are_dropped_after_the_configured_time() {
    let mut h = harness(ManagerConfig {
        abandon_after: 10 * SEC,
        ..ManagerConfig::default()
    });
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    h.enqueue("t", 0, &[b"abandoned"]);
    h.enqueue("t", 1, &[b"polled"]);
    h.now += 6 * SEC;
    h.ok(data("t", 1, 0, 0), b"");
    h.now += 6 * SEC;
    assert_eq!(
        h.manager.sweep(h.now),
        1,
        "only buffer 0 went unpolled for 10 s"
    );
    assert_eq!(h.manager.memory_used(), 6);
    assert_eq!(h.manager.stats().abandoned_buffers, 1);
    h.now += 20 * SEC;
    assert_eq!(h.manager.sweep(h.now), 1);
    assert_eq!(
        h.manager.stats().tasks,
        0,
        "a task with nothing left is removed"
    );
}

#[test]
fn bad_requests_name_what_was_wrong() {
    let mut h = harness(ManagerConfig::default());
    let cases: Vec<(BinRequest, &[u8], &str)> = vec![
        (data("", 0, 0, 0), b"", "task_id is empty"),
        (data("../etc", 0, 0, 0), b"", "contains '/'"),
        (req(MessageType::Enqueue, "nope", 0), b"", "never opened"),
        (
            open("t", BufferKind::Partitioned, 1_000_000),
            b"",
            "exceeds the limit",
        ),
        (
            BinRequest {
                r#type: 99,
                ..Default::default()
            },
            b"",
            "unknown message type 99",
        ),
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
    h.ok(open("t", BufferKind::Partitioned, 2), b"");
    let mut r = req(MessageType::Enqueue, "t", 0);
    r.page_sizes = vec![5];
    let reply = h.reply(r, b"abc");
    assert!(
        reply
            .header
            .error
            .contains("page sizes add up to 5 bytes but the body has 3")
    );
    let reply = h.reply(data("t", 2, 0, 0), b"");
    assert!(
        reply
            .header
            .error
            .contains("at or above the buffer_count 2 of task t")
    );
    let mut policy = open("s", BufferKind::Partitioned, 1);
    policy.spool_policy = "always".into();
    assert!(
        h.reply(policy, b"")
            .header
            .error
            .contains("needs a spool store")
    );
    assert_eq!(h.manager.stats().tasks, 1);
}

#[test]
fn draining_refuses_new_tasks_and_serves_existing_ones() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("old", BufferKind::Partitioned, 1), b"");
    h.enqueue("old", 0, &[b"page"]);
    h.manager.start_drain();
    let r = h.reply(open("new", BufferKind::Partitioned, 1), b"");
    assert_eq!(status(&r), Status::ServerError);
    assert!(r.header.error.contains("draining"), "{}", r.header.error);
    // Re-opening an existing task is still idempotent, and it still works.
    h.ok(open("old", BufferKind::Partitioned, 1), b"");
    assert_eq!(status(&h.enqueue("old", 0, &[b"more"])), Status::Ok);
    assert_eq!(h.manager.pages_held(), 2);
    h.ok(req(MessageType::NoMorePages, "old", 0), b"");
    assert!(h.ok(data("old", 0, 0, 100), b"").header.buffer_complete);
    h.ok(req(MessageType::Delete, "old", 0), b"");
    assert_eq!(h.manager.pages_held(), 0);
    assert!(h.manager.stats().draining);
}

#[test]
fn snapshots_show_each_buffer_state_tokens_and_bytes() {
    let mut h = harness(ManagerConfig::default());
    h.ok(open("q.1", BufferKind::Partitioned, 3), b"");
    h.ok(open("q.2", BufferKind::Broadcast, 2), b"");
    h.ok(open("other", BufferKind::Partitioned, 1), b"");
    h.enqueue("q.1", 0, &[b"aa", b"bbb"]);
    h.enqueue("q.1", 1, &[b"c"]);
    h.enqueue("q.1", 2, &[b"dddd"]);
    let mut nmp = req(MessageType::NoMorePages, "q.1", 1);
    h.ok(nmp.clone(), b"");
    nmp.buffer_id = 2;
    h.ok(nmp, b"");
    // Buffer 1 read and acknowledged to its end; buffer 0 acknowledged one page.
    h.ok(data("q.1", 1, 0, 100), b"");
    h.ok(req_ack("q.1", 1, 1), b"");
    h.ok(req_ack("q.1", 0, 1), b"");
    h.enqueue("q.2", 0, &[b"xy"]);
    h.ok(data("q.2", 0, 0, 100), b"");
    h.ok(data("q.2", 1, 0, 100), b"");
    h.ok(req_ack("q.2", 0, 1), b"");

    let snaps = h.manager.task_snapshots("q.", h.now);
    let ids: Vec<&str> = snaps.iter().map(|t| t.task_id.as_str()).collect();
    assert_eq!(ids, ["q.1", "q.2"], "the prefix selects, sorted by id");
    let q1 = &snaps[0];
    assert_eq!(
        (q1.kind, q1.buffer_count, q1.memory),
        (BufferKind::Partitioned, Some(3), 3 + 4)
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
    let q2 = &snaps[1];
    let view: Vec<_> = q2
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
    assert_eq!(h.manager.task_snapshots("", h.now).len(), 3);

    assert!(h.manager.has_task("q.1"));
    assert_eq!(h.manager.abort("q.1", "operator", h.now), 7);
    assert!(!h.manager.has_task("q.1"));
    assert_eq!(h.manager.memory_used(), 2);
}

#[test]
fn a_broadcast_consumer_that_comes_after_the_producer_finished_gets_every_page() {
    let mut h = harness(ManagerConfig::default());
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
    h.ok(req_ack("late", 0, 2), b"");
    h.ok(req_ack("late", 1, 2), b"");
    assert_eq!(h.manager.memory_used(), 0, "freed once both have read");
}

fn open_with_policy(task: &str, kind: BufferKind, count: u64, policy: &str) -> BinRequest {
    let mut r = open(task, kind, count);
    r.spool_policy = policy.into();
    r
}

#[test]
fn a_drain_spools_only_finished_overflow_buffers_and_commits_them_once_spooled() {
    let mut h = harness(ManagerConfig {
        spool_enabled: true,
        ..ManagerConfig::default()
    });
    h.ok(
        open_with_policy("ovf", BufferKind::Partitioned, 2, "overflow"),
        b"",
    );
    h.ok(
        open_with_policy("mem", BufferKind::Partitioned, 1, "off"),
        b"",
    );
    h.enqueue("ovf", 0, &[b"aa", b"bb"]);
    h.enqueue("ovf", 1, &[b"cc"]);
    h.enqueue("mem", 0, &[b"dd"]);
    h.ok(req(MessageType::NoMorePages, "ovf", 0), b"");
    h.ok(req(MessageType::NoMorePages, "mem", 0), b"");
    assert!(h.manager.start_drain());
    assert!(!h.manager.start_drain(), "a drain starts once");

    // Only buffer 0 of the overflow task: buffer 1 is unfinished (no marker
    // could cover it) and `mem` chose memory only.
    let job = h.manager.drain_spill_job().expect("buffer 0 is spooled");
    assert_eq!((job.task_id.as_str(), job.first_token), ("ovf", 0));
    assert_eq!(
        job.pages,
        vec![Bytes::from_static(b"aa"), Bytes::from_static(b"bb")]
    );
    assert!(h.manager.drain_spill_job().is_none());
    // Its pages are in flight, not in storage: no marker yet.
    assert!(h.manager.drain_commit_plans(h.now).is_empty());
    // The write failed: the pages stay in memory, are picked again, and
    // the buffer still gets no marker.
    h.manager.finish_spill(&job, None);
    assert_eq!(h.manager.pages_held(), 4);
    assert!(h.manager.drain_commit_plans(h.now).is_empty());
    assert_eq!(h.manager.drain_spill_job().map(|j| j.first_token), Some(0));
}

#[test]
fn a_drain_commits_every_buffer_of_a_finished_broadcast_set_even_unseen_ones() {
    let mut h = harness(ManagerConfig {
        spool_enabled: true,
        ..ManagerConfig::default()
    });
    h.ok(
        open_with_policy("b", BufferKind::Broadcast, 3, "overflow"),
        b"",
    );
    assert_eq!(status(&h.reply(data("b", 0, 0, 0), b"")), Status::NoData);
    h.ok(req(MessageType::NoMorePages, "b", ALL_BUFFERS), b"");
    h.manager.start_drain();
    // Nothing held, so nothing to spool; buffers 1 and 2 were never asked
    // for, and their consumers must find markers all the same.
    assert!(h.manager.drain_spill_job().is_none());
    let plans = h.manager.drain_commit_plans(h.now);
    let committed: Vec<(u64, u64)> = plans.iter().map(|p| (p.buffer_id, p.end_token)).collect();
    assert_eq!(committed, vec![(0, 0), (1, 0), (2, 0)]);
}
