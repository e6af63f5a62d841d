//! The sans-IO core alone: what one request costs it, with no socket, no
//! codec and no task hand-off, as a function of how many consumers a task
//! has (the cost per request must not grow with them).
//!
//! `cargo bench --bench core` (quick mode for CI: `cargo test --bench core`)
//!
//! `broadcast_ack/N`: a BROADCAST task read by N consumers, each
//! acknowledging one page at a time in turn, as consumers in step do. The
//! task frees a page once all N have acknowledged it. The requests are
//! parsed before the clock starts; the time is `Core::handle` and the
//! events it leaves.

use std::hint::black_box;
use std::time::{Duration, Instant};

use binx_core::{ConnId, Core, CoreConfig, Door, Handled, Payload, Request, Ticket};
use binx_proto::{BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;
use criterion::{Criterion, Throughput};

/// Pages of the task: each consumer acknowledges every one of them.
const PAGES: u64 = 256;

fn raw(kind: MessageType, buffer: u64) -> BinRequest {
    let mut r = BinRequest::new(kind);
    r.task_id = "20261128_000000_00001_bench.1.0.0.0".into();
    r.buffer_id = buffer;
    r
}

fn parsed(raw: &BinRequest) -> Request {
    match Request::parse(raw, Door::Local) {
        Ok(request) => request,
        Err(reply) => panic!("the bench's request was refused: {}", reply.error),
    }
}

/// Hands `request` to the core and checks it was answered OK at once.
fn handle(core: &mut Core, ticket: &mut u64, request: Request, body: Bytes, now: Instant) {
    *ticket += 1;
    let payload = Payload {
        bytes: body,
        chunk: None,
    };
    match core.handle(Ticket(*ticket), ConnId(1), request, payload, now) {
        Handled::Reply(reply) => assert_eq!(reply.header.status(), Status::Ok),
        Handled::Plan(_) | Handled::Pending => {
            panic!("the bench's request was not answered at once")
        }
    }
    while core.poll_event().is_some() {}
}

/// A core holding a BROADCAST task of `buffers` consumers, each of which
/// has read every page (none acknowledged).
fn broadcast_task(buffers: u64, now: Instant) -> (Core, u64) {
    let mut core = Core::new(CoreConfig::default());
    let mut ticket = 0;
    let mut open = raw(MessageType::OpenTask, 0);
    open.buffer_kind = BufferKind::Broadcast as i32;
    open.buffer_count = buffers;
    handle(&mut core, &mut ticket, parsed(&open), Bytes::new(), now);
    let mut enqueue = raw(MessageType::Enqueue, 0);
    enqueue.page_sizes = vec![8; PAGES as usize];
    let body = Bytes::from(vec![7u8; 8 * PAGES as usize]);
    handle(&mut core, &mut ticket, parsed(&enqueue), body, now);
    for buffer in 0..buffers {
        let mut data = raw(MessageType::Data, buffer);
        data.max_size_bytes = 1;
        handle(&mut core, &mut ticket, parsed(&data), Bytes::new(), now);
    }
    let stats = core.stats();
    assert_eq!((stats.buffers, stats.pages_buffered), (buffers, PAGES));
    (core, ticket)
}

fn broadcast_ack(c: &mut Criterion) {
    let mut group = c.benchmark_group("core");
    group.throughput(Throughput::Elements(1));
    for buffers in [1u64, 64, 1024, 8192] {
        // Every ACK of one pass over the task: page by page, each consumer
        // in turn.
        let acks: Vec<Request> = (1..=PAGES)
            .flat_map(|token| {
                (0..buffers).map(move |buffer| {
                    let mut ack = raw(MessageType::Ack, buffer);
                    ack.page_token = token;
                    ack
                })
            })
            .map(|ack| parsed(&ack))
            .collect();
        // What is measured does what it says: a whole pass frees every page.
        let now = Instant::now();
        let (mut core, mut ticket) = broadcast_task(buffers, now);
        for ack in acks.iter().cloned() {
            handle(&mut core, &mut ticket, ack, Bytes::new(), now);
        }
        assert_eq!(
            core.stats().page_bytes_held,
            0,
            "{buffers} consumers acknowledged every page"
        );
        group.bench_function(format!("broadcast_ack/{buffers}"), |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let now = Instant::now();
                    let (mut core, mut ticket) = broadcast_task(buffers, now);
                    let pass: Vec<Request> = acks.iter().take(left as usize).cloned().collect();
                    let count = pass.len() as u64;
                    let held = core.memory_used();
                    let start = Instant::now();
                    for ack in pass {
                        handle(&mut core, &mut ticket, ack, Bytes::new(), now);
                    }
                    spent += start.elapsed();
                    if count == acks.len() as u64 {
                        // Every consumer acknowledged every page.
                        assert!(
                            core.stats().page_bytes_held == 0 && core.memory_used() < held,
                            "the task held {held} bytes and still holds {}",
                            core.memory_used()
                        );
                    }
                    black_box(&core);
                    left -= count;
                }
                spent
            })
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    broadcast_ack(&mut criterion);
    criterion.final_summary();
}
