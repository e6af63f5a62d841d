//! Pipelined DATA (docs/PROTOCOL.md section 8) against servers that are not
//! binxd: `ExchangeSource` over a real TCP socket to a server built on the
//! real exchange core whose replies to pipelined DATA lie about the pages
//! that follow, come back out of order, or refuse what was asked past the
//! next page; and to a BinX 1.1 server that knows nothing of pipelining.
//! Either way every page arrives once, in order, with its bytes; a 1.1
//! server never sees two DATA of one consumer in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, Endpoint, ExchangeSource, SourceConfig};
use binx_core::{ConnId, Core, CoreConfig, Door, Handled, Payload, Request, Ticket};
use binx_proto::{
    BinReply, BinRequest, BufferKind, Frame, FrameCodec, MessageType, Preface, Status,
};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::codec::Framed;

/// How the test server departs from binxd.
#[derive(Clone, Copy)]
enum Manner {
    /// Lies in `following_sizes`, swaps replies, refuses DATA past the
    /// next page it has sent and, at times, any pipelined DATA.
    Hostile,
    /// A BinX 1.1 server: ignores `ack_token` (a DATA acknowledges below
    /// its token) and never lists `following_sizes`.
    Version1_1,
}

#[derive(Default)]
struct Seen {
    pipelined: AtomicU64,
    lies: AtomicU64,
    swaps: AtomicU64,
    refusals: AtomicU64,
    /// Most DATA of the consumer in flight at once.
    most_in_flight: AtomicU64,
}

fn page(token: u64) -> Vec<u8> {
    let size = [0usize, 100, 4_000, 70_000, 300_000][(token * 7 % 5) as usize];
    (0..size).map(|i| (token as usize * 13 + i) as u8).collect()
}

/// A core holding one finished buffer of `pages` pages.
fn filled_core(pages: u64) -> Core {
    let mut core = Core::new(CoreConfig::default());
    let mut id = 0;
    let mut send = |core: &mut Core, raw: BinRequest, body: Vec<u8>| {
        id += 1;
        let request = Request::parse(&raw, Door::Local).expect("valid");
        match core.handle(
            Ticket(id),
            ConnId(0),
            request,
            Payload::exact(Bytes::from(body)),
            Instant::now(),
        ) {
            Handled::Reply(r) => {
                assert_eq!(r.header.status_kind(), Status::Ok, "{}", r.header.error)
            }
            other => panic!("{other:?}"),
        }
    };
    let mut open = BinRequest::new(MessageType::OpenTask);
    open.task_id = "t".into();
    open.buffer_kind = BufferKind::Partitioned as i32;
    open.buffer_count = 1;
    send(&mut core, open, Vec::new());
    for first in (0..pages).step_by(8) {
        let tokens = first..(first + 8).min(pages);
        let mut r = BinRequest::new(MessageType::Enqueue);
        r.task_id = "t".into();
        r.page_sizes = tokens.clone().map(|t| page(t).len() as u64).collect();
        send(&mut core, r, tokens.flat_map(page).collect());
    }
    let mut done = BinRequest::new(MessageType::NoMorePages);
    done.task_id = "t".into();
    send(&mut core, done, Vec::new());
    core
}

/// Serves connections one after another from one core.
async fn serve(manner: Manner, pages: u64, seen: Arc<Seen>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(async move {
        let mut core = filled_core(pages);
        let mut rng = fastrand::Rng::with_seed(7);
        let mut ticket = 1_000;
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut preface = [0u8; 8];
            if socket.read_exact(&mut preface).await.is_err() {
                continue;
            }
            let _ = socket.write_all(&Preface::CURRENT.encode()).await;
            let mut frames = Framed::new(socket, FrameCodec::<BinRequest, BinReply>::default());
            // The highest page_next_token sent: a DATA past it is refused.
            let mut sent_up_to = 0u64;
            let mut held: Option<Frame<BinReply>> = None;
            let mut in_flight: Vec<u64> = Vec::new();
            loop {
                let next = if held.is_some() {
                    // A reply held back goes out after the next one, or
                    // when no request comes for a while.
                    match tokio::time::timeout(Duration::from_millis(20), frames.next()).await {
                        Ok(next) => next,
                        Err(_) => {
                            let earlier = held.take().expect("held");
                            if frames.send(earlier).await.is_err() {
                                break;
                            }
                            continue;
                        }
                    }
                } else {
                    frames.next().await
                };
                let Some(Ok(frame)) = next else {
                    break;
                };
                let mut raw = frame.header;
                if raw.r#type == MessageType::Data as i32 && !raw.get_data_size {
                    in_flight.push(raw.request_id);
                    let n = in_flight.len() as u64;
                    seen.most_in_flight.fetch_max(n, Ordering::Relaxed);
                    if raw.ack_token.is_some_and(|a| a < raw.page_token) {
                        seen.pipelined.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if let Manner::Version1_1 = manner {
                    raw.ack_token = None;
                }
                let refuse = matches!(manner, Manner::Hostile)
                    && raw.r#type == MessageType::Data as i32
                    && (raw.page_token > sent_up_to
                        || raw.ack_token.is_some_and(|a| a < raw.page_token) && rng.u32(0..6) == 0);
                let mut reply = if refuse {
                    seen.refusals.fetch_add(1, Ordering::Relaxed);
                    Frame::new(BinReply::error(&raw, Status::BadRequest, "not sent yet"))
                } else {
                    ticket += 1;
                    let request = match Request::parse(&raw, Door::Remote) {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = frames.send(Frame::new(*e)).await;
                            continue;
                        }
                    };
                    match core.handle(
                        Ticket(ticket),
                        ConnId(ticket),
                        request,
                        Payload::exact(Bytes::new()),
                        Instant::now(),
                    ) {
                        Handled::Reply(r) => Frame {
                            header: r.header,
                            body: Bytes::from(r.body.concat()),
                        },
                        other => panic!("the buffer is finished: {other:?}"),
                    }
                };
                sent_up_to = sent_up_to.max(reply.header.page_next_token);
                match manner {
                    Manner::Version1_1 => reply.header.following_sizes.clear(),
                    Manner::Hostile if !reply.header.following_sizes.is_empty() && rng.bool() => {
                        seen.lies.fetch_add(1, Ordering::Relaxed);
                        reply.header.following_sizes =
                            (0..rng.usize(1..12)).map(|_| rng.u64(0..400_000)).collect();
                    }
                    Manner::Hostile => {}
                }
                in_flight.retain(|&id| id != reply.header.request_id);
                if matches!(manner, Manner::Hostile) && held.is_none() && rng.bool() {
                    // Sent after the next reply.
                    held = Some(reply);
                    continue;
                }
                if frames.send(reply).await.is_err() {
                    break;
                }
                if let Some(earlier) = held.take() {
                    seen.swaps.fetch_add(1, Ordering::Relaxed);
                    if frames.send(earlier).await.is_err() {
                        break;
                    }
                }
            }
        }
    });
    addr
}

async fn read_all(addr: String, pages: u64) {
    let connection = Connection::new(Endpoint::Tcp(addr), ConnectionOptions::default());
    let config = SourceConfig {
        memory_budget: 2 << 20,
        max_reply_size: 400 << 10,
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(connection, "t", 0, config);
    let mut next = 0u64;
    let read = async {
        while let Some(p) = source.next_page().await.expect("the pull succeeds") {
            assert_eq!(p.token, next, "every page once, in order");
            assert!(p.data == page(next), "page {next} has the bytes produced");
            next += 1;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .expect("the pull ends");
    assert_eq!(next, pages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_lies_swaps_and_refuses_still_gives_every_page_once_in_order() {
    let seen = Arc::new(Seen::default());
    let addr = serve(Manner::Hostile, 600, seen.clone()).await;
    read_all(addr, 600).await;
    let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
    for (what, n) in [
        ("pipelined DATA", count(&seen.pipelined)),
        ("lies", count(&seen.lies)),
        ("swapped replies", count(&seen.swaps)),
        ("refusals", count(&seen.refusals)),
    ] {
        assert!(n > 0, "no {what}: the test proved little");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binx_1_1_server_never_sees_two_data_of_one_consumer_in_flight() {
    let seen = Arc::new(Seen::default());
    let addr = serve(Manner::Version1_1, 300, seen.clone()).await;
    read_all(addr, 300).await;
    assert_eq!(seen.pipelined.load(Ordering::Relaxed), 0);
    assert_eq!(seen.most_in_flight.load(Ordering::Relaxed), 1);
}
