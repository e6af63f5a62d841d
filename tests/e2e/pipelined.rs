//! Pipelined DATA (docs/PROTOCOL.md section 8) against servers that are not
//! binxd: `ExchangeSource` over a real TCP socket to a server built on the
//! real exchange core whose replies to pipelined DATA lie about the pages
//! that follow, come back out of order, or refuse what was asked past the
//! next page; and to a BinX 1.1 server that knows nothing of pipelining.
//! The client's connection is three sockets (stripes), so the DATA of one
//! buffer reach the server over several, in any order. Either way every
//! page arrives once, in order, with its bytes; a 1.1 server never sees two
//! DATA of one consumer in flight.

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
    /// Most DATA of the consumer in flight at once, over all its sockets.
    most_in_flight: AtomicU64,
    connections: AtomicU64,
}

const STRIPES: usize = 3;

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

/// What every connection of the test server shares: one core, and what
/// the consumer was sent and has in flight over all its sockets.
struct Served {
    core: std::sync::Mutex<Core>,
    /// The highest page_next_token sent: a DATA past it is refused.
    sent_up_to: AtomicU64,
    /// DATA in flight: (connection, request id).
    in_flight: std::sync::Mutex<Vec<(u64, u64)>>,
    ticket: AtomicU64,
}

/// Serves every connection at once (a striped client opens several) from
/// one core.
async fn serve(manner: Manner, pages: u64, seen: Arc<Seen>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let served = Arc::new(Served {
        core: std::sync::Mutex::new(filled_core(pages)),
        sent_up_to: AtomicU64::new(0),
        in_flight: std::sync::Mutex::new(Vec::new()),
        ticket: AtomicU64::new(1_000),
    });
    tokio::spawn(async move {
        let mut conn = 0u64;
        while let Ok((socket, _)) = listener.accept().await {
            conn += 1;
            seen.connections.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(serve_connection(
                socket,
                conn,
                manner,
                served.clone(),
                seen.clone(),
            ));
        }
    });
    addr
}

async fn serve_connection(
    mut socket: tokio::net::TcpStream,
    conn: u64,
    manner: Manner,
    served: Arc<Served>,
    seen: Arc<Seen>,
) {
    let mut rng = fastrand::Rng::with_seed(7 + conn);
    let mut preface = [0u8; 8];
    if socket.read_exact(&mut preface).await.is_err() {
        return;
    }
    let _ = socket.write_all(&Preface::CURRENT.encode()).await;
    let mut frames = Framed::new(socket, FrameCodec::<BinRequest, BinReply>::default());
    let mut held: Option<Frame<BinReply>> = None;
    let in_flight = || served.in_flight.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let next = if held.is_some() {
            // A reply held back goes out after the next one, or when no
            // request comes for a while.
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
            let mut in_flight = in_flight();
            in_flight.push((conn, raw.request_id));
            seen.most_in_flight
                .fetch_max(in_flight.len() as u64, Ordering::Relaxed);
            if raw.ack_token.is_some_and(|a| a < raw.page_token) {
                seen.pipelined.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Manner::Version1_1 = manner {
            raw.ack_token = None;
        }
        let refuse = matches!(manner, Manner::Hostile)
            && raw.r#type == MessageType::Data as i32
            && (raw.page_token > served.sent_up_to.load(Ordering::Relaxed)
                || raw.ack_token.is_some_and(|a| a < raw.page_token) && rng.u32(0..6) == 0);
        let mut reply = if refuse {
            seen.refusals.fetch_add(1, Ordering::Relaxed);
            Frame::new(BinReply::error(&raw, Status::BadRequest, "not sent yet"))
        } else {
            let ticket = served.ticket.fetch_add(1, Ordering::Relaxed);
            let request = match Request::parse(&raw, Door::Remote) {
                Ok(r) => r,
                Err(e) => {
                    let _ = frames.send(Frame::new(*e)).await;
                    continue;
                }
            };
            let handled = served
                .core
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .handle(
                    Ticket(ticket),
                    ConnId(ticket),
                    request,
                    Payload::exact(Bytes::new()),
                    Instant::now(),
                );
            match handled {
                Handled::Reply(r) => Frame {
                    header: r.header,
                    body: Bytes::from(r.body.concat()),
                },
                other => panic!("the buffer is finished: {other:?}"),
            }
        };
        served
            .sent_up_to
            .fetch_max(reply.header.page_next_token, Ordering::Relaxed);
        match manner {
            Manner::Version1_1 => reply.header.following_sizes.clear(),
            Manner::Hostile if !reply.header.following_sizes.is_empty() && rng.bool() => {
                seen.lies.fetch_add(1, Ordering::Relaxed);
                reply.header.following_sizes =
                    (0..rng.usize(1..12)).map(|_| rng.u64(0..400_000)).collect();
            }
            Manner::Hostile => {}
        }
        in_flight().retain(|&(c, id)| (c, id) != (conn, reply.header.request_id));
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

/// Reads the buffer to its end over one connection of `stripes` sockets:
/// with several, DATA reach the server over several (each socket is
/// ordered, together they are not).
async fn read_all(addr: String, pages: u64, stripes: usize) {
    let options = ConnectionOptions {
        stripes,
        ..ConnectionOptions::default()
    };
    let connection = Connection::new(Endpoint::Tcp(addr), options);
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
    for stripes in [1, STRIPES] {
        let seen = Arc::new(Seen::default());
        let addr = serve(Manner::Hostile, 600, seen.clone()).await;
        read_all(addr, 600, stripes).await;
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut happened = vec![
            ("pipelined DATA", count(&seen.pipelined)),
            ("lies", count(&seen.lies)),
            ("refusals", count(&seen.refusals)),
        ];
        if stripes == 1 {
            // Over several sockets replies cross anyway; over one, the
            // server swaps them.
            happened.push(("swapped replies", count(&seen.swaps)));
        }
        for (what, n) in happened {
            assert!(
                n > 0,
                "no {what} over {stripes} socket(s): the test proved little"
            );
        }
        assert_eq!(count(&seen.connections), stripes as u64);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binx_1_1_server_never_sees_two_data_of_one_consumer_in_flight() {
    let seen = Arc::new(Seen::default());
    let addr = serve(Manner::Version1_1, 300, seen.clone()).await;
    read_all(addr, 300, STRIPES).await;
    assert_eq!(seen.pipelined.load(Ordering::Relaxed), 0);
    assert_eq!(seen.most_in_flight.load(Ordering::Relaxed), 1);
    assert_eq!(seen.connections.load(Ordering::Relaxed), STRIPES as u64);
}

/// A reader that has every page has its end within a few seconds even when
/// the DELETE that frees the buffer is not answered (it goes on behind
/// it). A sidecar that did not answer it held the reader's end for the
/// DELETE's whole error budget (3 minutes by default), with every page
/// already taken (review finding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_ends_soon_after_its_last_page_however_long_its_delete_waits() {
    let (addr, deletes) = serve_finished_buffer(DeleteAnswer::Never).await;
    let tokens = read_to_the_end(addr).await;
    assert_eq!(tokens, vec![0, 1, 2]);
    // The DELETE was sent (and goes on after the source is dropped).
    let sent = Instant::now();
    while deletes.load(Ordering::Relaxed) == 0 && sent.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(deletes.load(Ordering::Relaxed) > 0, "no DELETE was sent");
}

/// A reader that has every page, whose daemon restarts before its DELETE
/// is answered, has its end: the DELETE is withheld from the new process
/// (whose buffer of that id is another run's), and the buffer went with
/// the old one. Review finding: the withheld DELETE failed the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_with_every_page_ends_though_its_daemon_restarted_before_the_delete() {
    let (addr, deletes) = serve_finished_buffer(DeleteAnswer::Restart).await;
    let tokens = read_to_the_end(addr).await;
    assert_eq!(tokens, vec![0, 1, 2]);
    assert_eq!(
        deletes.load(Ordering::Relaxed),
        1,
        "sent to the first process only"
    );
}

/// What the server of [`serve_finished_buffer`] does with a DELETE.
#[derive(Clone, Copy, PartialEq)]
enum DeleteAnswer {
    /// Nothing: it is never answered.
    Never,
    /// Closes the connection, as a daemon that restarts; the next one
    /// names another process.
    Restart,
}

/// Serves buffer 0 of task `t`, three finished pages, from one core over
/// every connection, each naming process `p<n>` in its HELLO reply; DELETE
/// as `delete` says (counted).
async fn serve_finished_buffer(delete: DeleteAnswer) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let core = Arc::new(std::sync::Mutex::new(filled_core(3)));
    let deletes = Arc::new(AtomicU64::new(0));
    let counted = deletes.clone();
    tokio::spawn(async move {
        let mut ticket = 0u64;
        let mut process = 0u64;
        while let Ok((mut socket, _)) = listener.accept().await {
            process += 1;
            let mut preface = [0u8; 8];
            if socket.read_exact(&mut preface).await.is_err() {
                continue;
            }
            let _ = socket.write_all(&Preface::CURRENT.encode()).await;
            let mut frames = Framed::new(socket, FrameCodec::<BinRequest, BinReply>::default());
            while let Some(Ok(frame)) = frames.next().await {
                let raw = frame.header;
                let reply = match raw.message_type() {
                    Ok(MessageType::Delete) => {
                        counted.fetch_add(1, Ordering::Relaxed);
                        match delete {
                            DeleteAnswer::Never => continue,
                            DeleteAnswer::Restart => break,
                        }
                    }
                    Ok(MessageType::Hello) => {
                        let mut hello = BinReply::to(&raw, Status::Ok);
                        hello.capabilities = vec![format!("instance=p{process}")];
                        Frame::new(hello)
                    }
                    Ok(MessageType::Data) => {
                        ticket += 1;
                        let request = Request::parse(&raw, Door::Remote).expect("a DATA");
                        let handled = core.lock().unwrap_or_else(|p| p.into_inner()).handle(
                            Ticket(ticket),
                            ConnId(0),
                            request,
                            Payload::exact(Bytes::new()),
                            Instant::now(),
                        );
                        let Handled::Reply(r) = handled else {
                            panic!("the buffer is finished: {handled:?}");
                        };
                        Frame {
                            header: r.header,
                            body: Bytes::from(r.body.concat()),
                        }
                    }
                    _ => Frame::new(BinReply::to(&raw, Status::Ok)),
                };
                if frames.send(reply).await.is_err() {
                    break;
                }
            }
        }
    });
    (addr, deletes)
}

/// Reads buffer 0 of task `t` at `addr` to its end (within 30 s), checking
/// each page; the tokens read.
async fn read_to_the_end(addr: String) -> Vec<u64> {
    let connection = Connection::new(Endpoint::Tcp(addr), ConnectionOptions::default());
    let mut source = ExchangeSource::new(connection, "t", 0, SourceConfig::default());
    let mut tokens = Vec::new();
    while let Some(p) = tokio::time::timeout(Duration::from_secs(30), source.next_page())
        .await
        .expect("the reader ends without waiting for its DELETE")
        .expect("every page, then the end")
    {
        assert_eq!(p.data, page(p.token));
        tokens.push(p.token);
    }
    tokens
}

/// A server whose DATA replies list spooled segments far larger than the
/// reply size asked for (2 GiB a reply against 64 KiB), or a small page in
/// an object of 1 GiB: the source refuses the reply before it fetches
/// anything, naming the sizes, instead of fetching and holding what was
/// listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_larger_than_asked_for_is_refused_before_anything_is_fetched() {
    let cases = [
        (
            vec![1u64 << 30, 1 << 30],
            2u64 << 30,
            "holds 2147483648 bytes of pages, more than the 65536 asked for",
        ),
        (
            vec![1000],
            1 << 30,
            "stored_size 1073741824 is more than a writer stores for 1 pages of 1000 bytes",
        ),
        // One page past what was asked, larger than any frame: no binxd
        // holds such a page.
        (
            vec![1 << 30],
            1000,
            "first page is 1073741824 bytes, larger than a frame of this connection",
        ),
    ];
    for (page_sizes, stored_size, says) in cases {
        let (addr, fetched) = spooling_server(page_sizes, stored_size, None).await;
        let text = spooled_read_failure(addr, ConnectionOptions::default()).await;
        assert!(text.contains(says), "{text}");
        assert_eq!(fetched.load(Ordering::Relaxed), 0, "a segment was fetched");
    }
}

/// A spooled object whose pages are far larger than the reply listing it
/// says (a 16 MiB page of zeros in a few kilobytes of zstd, where the reply
/// promises 4 KiB): refused on its header, before it is inflated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spooled_object_is_decoded_only_up_to_the_pages_its_reply_promised() {
    let bomb = binx_segment::encode_segment(
        0,
        &[Bytes::from(vec![0u8; 16 << 20])],
        binx_segment::Codec::Zstd,
        None,
    )
    .expect("a segment");
    assert!(bomb.len() < 64 << 10, "compressed to {} bytes", bomb.len());
    let stored_size = bomb.len() as u64;
    let (addr, fetched) = spooling_server(vec![4096], stored_size, Some(bomb)).await;
    // A spooled read that fails is asked again until the error budget.
    let mut options = ConnectionOptions::default();
    options.backoff.max_error_duration = Duration::from_secs(2);
    let text = spooled_read_failure(addr, options).await;
    assert!(
        text.contains("page sizes add up to more than the limit of 4096 bytes"),
        "{text}"
    );
    assert!(
        fetched.load(Ordering::Relaxed) > 0,
        "the object was fetched"
    );
}

/// How a source that accepts spooled segments, reading from `addr` with
/// replies of 64 KiB, fails (within a minute).
async fn spooled_read_failure(addr: String, options: ConnectionOptions) -> String {
    let connection = Connection::new(Endpoint::Tcp(addr), options);
    let config = SourceConfig {
        max_reply_size: 64 << 10,
        accept_spooled: true,
        pipeline_depth: 1,
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(connection, "t", 0, config);
    tokio::time::timeout(Duration::from_secs(60), source.next_page())
        .await
        .expect("the source ends")
        .expect_err("the reply is refused")
        .to_string()
}

/// A server that answers every DATA with one spooled segment of
/// `page_sizes` in an object of `stored_size` bytes, at a "store" that
/// counts the connections made to it and answers each GET with `object`
/// (none: nothing).
async fn spooling_server(
    page_sizes: Vec<u64>,
    stored_size: u64,
    object: Option<Bytes>,
) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let storage = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let uri = format!("http://{}/segment", storage.local_addr().expect("addr"));
    let fetched = Arc::new(AtomicU64::new(0));
    let counter = fetched.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = storage.accept().await {
            counter.fetch_add(1, Ordering::Relaxed);
            let Some(object) = object.clone() else {
                continue;
            };
            tokio::spawn(async move {
                // The request's head, then the object.
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && socket.read_exact(&mut byte).await.is_ok() {
                    head.push(byte[0]);
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                    object.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.write_all(&object).await;
            });
        }
    });
    tokio::spawn(async move {
        let Ok((mut socket, _)) = listener.accept().await else {
            return;
        };
        let mut preface = [0u8; 8];
        if socket.read_exact(&mut preface).await.is_err() {
            return;
        }
        let _ = socket.write_all(&Preface::CURRENT.encode()).await;
        let mut frames = Framed::new(socket, FrameCodec::<BinRequest, BinReply>::default());
        while let Some(Ok(frame)) = frames.next().await {
            let raw = frame.header;
            let mut reply = BinReply::to(&raw, Status::Ok);
            if raw.r#type == MessageType::Data as i32 {
                reply.page_token = raw.page_token;
                reply.page_next_token = raw.page_token + page_sizes.len() as u64;
                reply.segments = vec![binx_proto::Segment {
                    first_token: raw.page_token,
                    page_sizes: page_sizes.clone(),
                    body: Some(binx_proto::segment::Body::Spooled(binx_proto::Spooled {
                        uri: uri.clone(),
                        stored_size,
                        ..Default::default()
                    })),
                }];
            }
            if frames.send(Frame::new(reply)).await.is_err() {
                return;
            }
        }
    });
    (addr, fetched)
}
