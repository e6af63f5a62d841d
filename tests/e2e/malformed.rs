//! Bad input on real sockets: each case gets a clear error or a close, the
//! daemon never dies, and other connections keep being served.

use std::time::Duration;

use binx_client::{ClientError, Connection, ConnectionOptions};
use binx_proto::{BinReply, BinRequest, FrameCodec, MessageType, Preface, Status};
use bytes::{BufMut, BytesMut};
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::FramedRead;

use crate::common::Daemon;

/// What the server did with one bad input.
#[derive(Debug)]
struct Outcome {
    /// Bytes the server sent before closing.
    received: Vec<u8>,
}

impl Outcome {
    /// The server's preface came back first.
    fn preface_echoed(&self) -> bool {
        self.received.starts_with(&Preface::CURRENT.encode())
    }

    /// The frames after the server's preface.
    async fn replies(&self) -> Vec<BinReply> {
        let rest = self.received.get(8..).unwrap_or(&[]).to_vec();
        let codec = FrameCodec::<BinReply, BinRequest>::default();
        let mut frames = FramedRead::new(&rest[..], codec);
        let mut out = Vec::new();
        while let Some(Ok(frame)) = frames.next().await {
            out.push(frame.header);
        }
        out
    }
}

/// Sends `bytes` on a fresh TCP connection and half-closes it (the peer
/// disconnects, mid-frame if the bytes end inside one), then reads until the
/// server closes; fails if it does not close within 15 s.
async fn send_raw(addr: &str, bytes: &[u8]) -> Outcome {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let _ = stream.write_all(bytes).await;
    let _ = stream.shutdown().await;
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(15), stream.read_to_end(&mut received))
        .await
        .expect("the server must close a connection that sent bad input")
        .ok();
    Outcome { received }
}

fn with_preface(frame: &[u8]) -> Vec<u8> {
    let mut v = Preface::CURRENT.encode().to_vec();
    v.extend_from_slice(frame);
    v
}

fn raw_frame(length: u32, header_length: u32, rest: &[u8]) -> Vec<u8> {
    let mut b = BytesMut::new();
    b.put_u32(length);
    b.put_u32(header_length);
    b.put_slice(rest);
    b.to_vec()
}

async fn assert_serves(connection: &Connection) {
    connection
        .ping()
        .await
        .expect("the daemon keeps serving other connections");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_gets_an_error_or_a_close_and_the_daemon_keeps_serving() {
    let mut daemon = Daemon::start(&["--max-frame-size", "1MiB"]);
    // A connection opened before the attacks must survive them.
    let bystander = daemon.connect_tcp();
    assert_serves(&bystander).await;

    let mut seed = crate::common::rng(7);
    let mut random = vec![0u8; 4096];
    seed.fill(&mut random);

    // Wrong or missing preface: closed (the server may write its preface).
    for bytes in [
        &random[..],
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"BINX\x01\x00\x00\x07",
    ] {
        let outcome = send_raw(&daemon.tcp, bytes).await;
        assert!(
            outcome.replies().await.is_empty(),
            "no frame answers a bad preface"
        );
    }
    // Another major version: our preface, then close.
    let outcome = send_raw(&daemon.tcp, b"BINX\x02\x00\x00\x00").await;
    assert!(outcome.preface_echoed(), "{:?}", outcome.received);
    assert_eq!(outcome.received.len(), 8);

    // Valid preface, bad frames: one BAD_REQUEST with request_id 0, then close.
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "length 0xFFFFFFFF",
            raw_frame(0xFFFF_FFFF, 0, &[]),
            "exceeds the limit",
        ),
        ("length below 4", raw_frame(3, 0, &[]), "below the minimum"),
        (
            "header_length beyond length",
            raw_frame(10, 7, &[0; 6]),
            "header length 7 exceeds",
        ),
        (
            "undecodable header",
            raw_frame(4 + 3, 3, &[0x1a, 0x05, 0xff]),
            "does not decode",
        ),
        (
            "invalid UTF-8 in task_id",
            raw_frame(4 + 3, 3, &[0x1a, 0x01, 0xff]),
            "does not decode",
        ),
        (
            "truncated frame",
            raw_frame(100, 2, &[0x08, 0x01, 0xaa]),
            "in the middle of a frame",
        ),
        (
            "random bytes after the preface",
            random.clone(),
            "malformed frame",
        ),
    ];
    for (name, frame, expected) in cases {
        let outcome = send_raw(&daemon.tcp, &with_preface(&frame)).await;
        assert!(outcome.preface_echoed(), "{name}");
        let replies = outcome.replies().await;
        assert_eq!(replies.len(), 1, "{name}: {replies:?}");
        assert_eq!(replies[0].request_id, 0, "{name}");
        assert_eq!(replies[0].status_kind(), Status::BadRequest, "{name}");
        assert!(
            replies[0].error.contains(expected),
            "{name}: {:?}",
            replies[0].error
        );
        assert_serves(&bystander).await;
    }

    // A connection that dies mid-frame on the Unix socket hurts nobody.
    {
        let mut s = tokio::net::UnixStream::connect(&daemon.uds)
            .await
            .expect("uds");
        s.write_all(&with_preface(&raw_frame(1000, 4, &[8, 1, 16, 17])))
            .await
            .unwrap();
    }
    assert_serves(&daemon.connect_uds()).await;
    assert_serves(&bystander).await;
    assert!(daemon.alive(), "binxd died; log:\n{}", daemon.log());
    assert!(daemon.stat_when("protocol_errors", |n| n >= 7) >= 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_requires_hello_with_the_secret_and_refuses_local_requests() {
    let daemon = Daemon::start(&["--shared-secret", "s3cret"]);
    // No HELLO: the PING is refused and the connection closed.
    let anonymous = daemon.connect_tcp();
    let err = anonymous.ping().await.expect_err("PING without HELLO");
    assert_eq!(err.status(), Some(Status::Unauthenticated), "{err}");
    assert!(err.to_string().contains("HELLO"), "{err}");

    let wrong = Connection::new(
        daemon.tcp_endpoint(),
        ConnectionOptions {
            auth_token: Some("guess".into()),
            ..Default::default()
        },
    );
    let err = wrong.ping().await.expect_err("wrong secret");
    assert_eq!(err.status(), Some(Status::Unauthenticated), "{err}");

    let right = Connection::new(
        daemon.tcp_endpoint(),
        ConnectionOptions {
            auth_token: Some("s3cret".into()),
            ..Default::default()
        },
    );
    right
        .ping()
        .await
        .expect("PING after HELLO with the secret");

    // Local-only requests are refused on TCP, even when authenticated.
    let mut open = BinRequest::new(MessageType::OpenTask);
    open.task_id = "t1".into();
    match right.request(open.clone(), Vec::new()).await {
        Err(ClientError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, Status::BadRequest);
            assert!(
                message.contains("OPEN_TASK is a local request"),
                "{message}"
            );
        }
        other => panic!("OPEN_TASK on TCP: {other:?}"),
    }
    // The Unix socket needs no HELLO and takes local requests.
    daemon
        .connect_uds()
        .request(open, Vec::new())
        .await
        .expect("OPEN_TASK on the UDS");
}
