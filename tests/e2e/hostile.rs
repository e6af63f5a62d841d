//! Hostile peers, hostile local clients and hostile storage against a real
//! binxd (docs/SECURITY.md): each gets a clear refusal or the contract's
//! reply, nothing is lost, and binxd's peak RSS (VmHWM) stays within its
//! memory limit + 64 MiB where memory is the point.

use std::io::{Read, Write};
use std::net::TcpStream as StdTcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, Producer, TaskSpec};
use binx_proto::{BinRequest, MessageType, Preface, Status};
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{Daemon, binary, http_request, peak_rss, presto_bearer, stats_of};

const MIB: u64 = 1 << 20;

/// binxd's peak RSS grew at most its memory limit + 64 MiB since `base`.
fn assert_rss_within(daemon: &Daemon, base: u64, limit: u64) {
    let grown = peak_rss(daemon).saturating_sub(base);
    assert!(
        grown <= limit + 64 * MIB,
        "peak RSS grew {} MiB with a {} MiB limit",
        grown / MIB,
        limit / MIB
    );
}

/// Waits (up to 20 s) until binxd's stat `key` reaches `at_least`: the
/// requests a test sent are then really in binxd, whatever the load.
async fn until_stat(daemon: &Daemon, key: &str, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.stat(key) < at_least {
        assert!(Instant::now() < deadline, "{key} never reached {at_least}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn data(task: &str, buffer: u64, token: u64) -> BinRequest {
    let mut r = BinRequest::new(MessageType::Data);
    r.task_id = task.into();
    r.buffer_id = buffer;
    r.page_token = token;
    r
}

fn authed(daemon: &Daemon, secret: &str) -> Connection {
    Connection::new(
        daemon.tcp_endpoint(),
        ConnectionOptions {
            auth_token: Some(secret.into()),
            ..Default::default()
        },
    )
}

/// A TCP listener that counts the connections made to it.
async fn target() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            // A banner, as an SSH or Redis server would send.
            let _ = stream.write_all(b"SSH-2.0-secret-banner\r\n").await;
        }
    });
    (addr, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_is_refused_on_tcp_on_unknown_types_and_outside_the_allow_list() {
    let (target, connects) = target().await;
    let daemon = Daemon::start(&["--forward-allowed-peers", "10.0.0.0/8"]);
    let tcp = daemon.connect_tcp();
    for kind in [99, 0, MessageType::Data as i32, MessageType::Ping as i32] {
        let mut r = data("t", 0, 0);
        r.r#type = kind;
        r.remote = target.clone();
        let reply = tcp.call(r, Vec::new()).await.expect("a reply").header;
        assert_eq!(reply.status_kind(), Status::BadRequest, "type {kind}");
        assert!(!reply.error.contains("SSH"), "{}", reply.error);
    }
    // Over the Unix socket, a remote outside forward_allowed_peers.
    let uds = daemon.connect_uds();
    for (kind, remote) in [
        (MessageType::Data, target.as_str()),
        (MessageType::Ack, "169.254.169.254:80"),
        (MessageType::Delete, "metadata.google.internal:80"),
    ] {
        let mut r = data("t", 0, 0);
        r.r#type = kind as i32;
        r.remote = remote.into();
        let reply = uds.call(r, Vec::new()).await.expect("a reply").header;
        assert_eq!(reply.status_kind(), Status::BadRequest, "{kind:?} {remote}");
        assert!(
            reply.error.contains("forward_allowed_peers") && reply.error.contains(remote),
            "{}",
            reply.error
        );
    }
    // A remote that is not host:port at all, and one far too long.
    for remote in ["no-port".to_string(), format!("{}:1", "a".repeat(60_000))] {
        let mut r = data("t", 0, 0);
        r.remote = remote;
        let reply = uds.call(r, Vec::new()).await.expect("a reply").header;
        assert_eq!(reply.status_kind(), Status::BadRequest);
        assert!(reply.error.len() < 1024, "{}", reply.error.len());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        connects.load(Ordering::SeqCst),
        0,
        "binxd connected to the target"
    );
    assert_eq!(daemon.stat("forwards_refused"), 3);
}

/// Sends a frame announcing `length` bytes, with a PING header (a request
/// that takes no body), then zeros up to `length`, as fast as binxd takes
/// them; returns what binxd sent until it closed (or all is sent).
async fn flood_ping_body(addr: String, length: u32) -> Vec<u8> {
    let mut ping = BinRequest::new(MessageType::Ping);
    ping.request_id = 1;
    let header = binx_proto::Message::encode_to_vec(&ping);
    let mut head = length.to_be_bytes().to_vec();
    head.extend_from_slice(&(header.len() as u32).to_be_bytes());
    head.extend_from_slice(&header);
    flood(addr, head, length).await
}

/// Sends the preface and `head`, then zeros for at most `length` bytes.
async fn flood(addr: String, head: Vec<u8>, length: u32) -> Vec<u8> {
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    let head = [Preface::CURRENT.encode().to_vec(), head].concat();
    let _ = stream.write_all(&head).await;
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        let zeros = vec![0u8; 1 << 20];
        let mut sent = 0u64;
        while sent < u64::from(length) {
            if write.write_all(&zeros).await.is_err() {
                break;
            }
            sent += zeros.len() as u64;
        }
    });
    let mut received = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), read.read_to_end(&mut received)).await;
    writer.abort();
    received
}

/// Three TCP connections at once each send a PING with a 64 MiB body:
/// each gets one BAD_REQUEST naming the limit, then the close, and
/// binxd's peak RSS grows by less than one such body.
async fn three_floods_are_refused_and_rss_stays_low(daemon: &Daemon) {
    let before = peak_rss(daemon);
    let floods: Vec<_> = (0..3)
        .map(|_| tokio::spawn(flood_ping_body(daemon.tcp.clone(), 64 << 20)))
        .collect();
    for flood in floods {
        let received = flood.await.unwrap();
        assert!(received.len() > 8, "binxd said nothing");
        let text = String::from_utf8_lossy(&received);
        assert!(text.contains("limit"), "{text}");
    }
    let grown = peak_rss(daemon).saturating_sub(before);
    assert!(grown < 64 * MIB, "peak RSS grew {} MiB", grown / MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_large_is_read_before_hello_and_peak_rss_stays_low() {
    let daemon = Daemon::start(&["--shared-secret", "s3cret", "--memory-limit", "64MiB"]);
    three_floods_are_refused_and_rss_stays_low(&daemon).await;
    // An authenticated peer is served.
    let connection = authed(&daemon, "s3cret");
    connection.ping().await.expect("PING after HELLO");
}

/// No request a TCP peer may send carries a body, so its frames are a
/// header at most (64 KiB), authenticated or not (a review found a peer
/// could make binxd keep two 64 MiB receive buffers per connection with
/// PINGs carrying junk, outside the memory limit). A larger frame gets
/// one BAD_REQUEST naming the limit and the connection closes; peak RSS
/// does not grow by what was announced. The local engine's ENQUEUEs still
/// carry large bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_peer_sends_no_frame_larger_than_a_header() {
    let daemon = Daemon::start(&["--memory-limit", "64MiB"]);
    three_floods_are_refused_and_rss_stays_low(&daemon).await;
    // A frame one byte past the largest header is refused too.
    let limit = 4 + binx_proto::MAX_HEADER_LENGTH as u32;
    let refused = flood_ping_body(daemon.tcp.clone(), limit + 1).await;
    assert!(String::from_utf8_lossy(&refused).contains("limit"));
    let peer = daemon.connect_tcp();
    peer.ping().await.expect("PING over TCP");
    let producer = Producer::new(daemon.connect_uds());
    producer
        .open_task("local", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    producer
        .enqueue("local", 0, &[Bytes::from(vec![7u8; 8 << 20])])
        .await
        .expect("an 8 MiB page over the Unix socket");
}

/// Opens a TCP connection, sends only the preface, and returns it.
/// Waits until `daemon` holds no connection: Daemon::start's readiness
/// probes hold a slot until binxd sees them close, and a slow machine can
/// still be at it.
async fn every_slot_free(daemon: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.stat("connections_open") > 0 {
        assert!(
            Instant::now() < deadline,
            "the readiness probes never closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn preface_only(addr: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&Preface::CURRENT.encode()).await.unwrap();
    let mut preface = [0u8; 8];
    stream.read_exact(&mut preface).await.unwrap();
    stream
}

/// The same on the Unix socket.
async fn preface_only_unix(path: &Path) -> tokio::net::UnixStream {
    let mut stream = tokio::net::UnixStream::connect(path).await.unwrap();
    stream.write_all(&Preface::CURRENT.encode()).await.unwrap();
    let mut preface = [0u8; 8];
    stream.read_exact(&mut preface).await.unwrap();
    stream
}

/// Waits until binxd closes `stream`; the time it took.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(
    mut stream: S,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    let mut sink = Vec::new();
    tokio::time::timeout(limit, stream.read_to_end(&mut sink))
        .await
        .expect("binxd closes the connection")
        .ok();
    start.elapsed()
}

/// Anyone who reaches the TCP port can hold connections (until their
/// handshake or idle time runs out); they can never take the slots of
/// `max_connections` kept for the local engine's Unix socket (a quarter,
/// at most 256).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_on_tcp_cannot_take_the_slots_kept_for_the_unix_socket() {
    let daemon = Daemon::start(&["--max-connections", "8"]);
    every_slot_free(&daemon).await;
    // Eight silent TCP connections: six are served (and held), two told
    // the limit.
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(preface_only(&daemon.tcp).await);
    }
    let err = daemon
        .connect_tcp()
        .ping()
        .await
        .expect_err("over the TCP share");
    assert_eq!(err.status(), Some(Status::Busy), "{err}");
    assert!(
        err.to_string().contains(
            "limit of 6 TCP connections (max_connections, less 2 kept for the Unix socket)"
        ),
        "{err}"
    );
    // The engine still gets its two.
    let (one, two) = (daemon.connect_uds(), daemon.connect_uds());
    one.ping().await.expect("the first Unix socket connection");
    two.ping().await.expect("the second Unix socket connection");
    assert!(daemon.stat("connections_refused") >= 3);
    drop(silent);
}

/// Strangers who open TCP connections and never say HELLO (a shared
/// secret is set) hold at most a few of them at once: past
/// `unauthenticated_limit`, the oldest is closed for each new one, so a
/// peer with the secret gets its HELLO through however many there are
/// (before, 64 silent connections took every slot for 20 s each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_connections_that_never_authenticate_never_keeps_a_peer_out() {
    let secret = "flood-secret";
    let daemon = Daemon::start(&["--shared-secret", secret, "--max-connections", "64"]);
    every_slot_free(&daemon).await;
    // 64 slots: 16 kept for the Unix socket, 48 for TCP, of which at most
    // 24 wait to authenticate.
    use binx_server::listener::{unauthenticated_limit, unix_reserve};
    let waiting = unauthenticated_limit(64 - unix_reserve(64));
    assert_eq!(waiting, 24);
    let mut silent = Vec::new();
    for _ in 0..64 {
        silent.push(preface_only(&daemon.tcp).await);
    }
    let peer = Connection::new(
        daemon.tcp_endpoint(),
        ConnectionOptions {
            auth_token: Some(secret.into()),
            ..ConnectionOptions::default()
        },
    );
    peer.ping().await.expect("a peer with the secret is served");
    // The strangers' oldest connections were closed (the peer's took one
    // more place, then left the waiting ones once its HELLO was answered).
    let mut closed = 0;
    for stream in &mut silent {
        let mut byte = [0u8; 1];
        if let Ok(Ok(0)) =
            tokio::time::timeout(Duration::from_millis(200), stream.read(&mut byte)).await
        {
            closed += 1;
        }
    }
    assert!(
        closed >= 64 - waiting,
        "{closed} of 64 silent connections closed"
    );
    assert!(daemon.stat("connections_timed_out") >= (64 - waiting) as u64);
    assert!(daemon.log_shows("TCP connections were waiting to authenticate"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_and_free_their_slots() {
    let daemon = Daemon::start(&[
        "--max-connections",
        "4",
        "--max-wait",
        "1s",
        "--idle-timeout",
        "4s",
    ]);
    every_slot_free(&daemon).await;
    let opened = Instant::now();
    // Two on TCP, two on the Unix socket (which shares the slots).
    let mut silent = Vec::new();
    let mut silent_local = Vec::new();
    for _ in 0..2 {
        silent.push(preface_only(&daemon.tcp).await);
        silent_local.push(preface_only_unix(&daemon.uds).await);
    }
    // All slots are held: a new connection is told so.
    let err = daemon
        .connect_tcp()
        .ping()
        .await
        .expect_err("over the limit");
    assert_eq!(err.status(), Some(Status::Busy), "{err}");
    for stream in silent {
        closed_within(stream, Duration::from_secs(20)).await;
        let took = opened.elapsed();
        assert!(took >= Duration::from_secs(3), "closed after {took:?}");
    }
    for stream in silent_local {
        closed_within(stream, Duration::from_secs(20)).await;
        let took = opened.elapsed();
        assert!(took >= Duration::from_secs(3), "closed after {took:?}");
    }
    daemon
        .connect_tcp()
        .ping()
        .await
        .expect("a slot is free again");
    assert!(daemon.stat_when("connections_timed_out", |n| n >= 4) >= 4);

    // With a secret, a peer that never says HELLO is closed after the
    // handshake timeout, idle timeout or not.
    let secret = Daemon::start(&[
        "--shared-secret",
        "x",
        "--handshake-timeout",
        "1s",
        "--idle-timeout",
        "0s",
    ]);
    let stream = preface_only(&secret.tcp).await;
    let took = closed_within(stream, Duration::from_secs(10)).await;
    assert!(took < Duration::from_secs(5), "{took:?}");
    // A long-poll is not idleness: it is answered, not cut.
    let reply = daemon
        .connect_tcp()
        .call(
            BinRequest {
                max_wait_micros: 900_000,
                ..data("never", 0, 0)
            },
            Vec::new(),
        )
        .await
        .expect("reply")
        .header;
    assert_eq!(reply.status_kind(), Status::NoData);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_exchange_requires_the_engines_internal_bearer() {
    let secret = "cluster secret";
    let daemon = Daemon::start(&["--shared-secret", secret]);
    let producer = Producer::new(daemon.connect_uds());
    producer
        .open_task("h", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    let pages: Vec<Bytes> = (0..3u8).map(|i| Bytes::from(vec![i; 100])).collect();
    producer.enqueue("h", 0, &pages).await.unwrap();
    producer.no_more_pages("h", None).await.unwrap();

    let http = daemon.http.clone();
    let get = move |method: &str, path: &str, headers: &[(&str, &str)]| {
        http_request(&http, method, path, headers)
    };
    for (method, path) in [
        ("GET", "/v1/task/h/results/0/0"),
        ("HEAD", "/v1/task/h/results/0/0"),
        ("GET", "/v1/task/h/results/0/3/acknowledge"),
        ("DELETE", "/v1/task/h/results/0"),
        ("GET", "/v1/stats"),
    ] {
        let r = get(method, path, &[]);
        assert_eq!(r.status, 401, "{method} {path}");
        assert!(r.header("www-authenticate").starts_with("Bearer"));
        if method != "HEAD" {
            let body = String::from_utf8_lossy(&r.body);
            assert!(body.contains("X-Presto-Internal-Bearer"), "{body}");
        }
    }
    let [sha, hkdf] = binx_server::internal_auth::derived_keys(secret);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let expired = binx_server::internal_auth::sign_token(&sha, "w", now - 10);
    let r = get(
        "GET",
        "/v1/task/h/results/0/0",
        &[("X-Presto-Internal-Bearer", &expired)],
    );
    assert_eq!(r.status, 401);
    assert!(String::from_utf8_lossy(&r.body).contains("expired"));
    let [other, _] = binx_server::internal_auth::derived_keys("guess");
    let forged = binx_server::internal_auth::sign_token(&other, "w", now + 300);
    let r = get(
        "GET",
        "/v1/task/h/results/0/0",
        &[("X-Trino-Internal-Bearer", &forged)],
    );
    assert_eq!(r.status, 401);
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(get("GET", path, &[]).status, 200, "{path} stays open");
    }
    // The engines' tokens: Presto's (SHA-256 key) and Trino 480's (HKDF).
    let presto = presto_bearer(secret);
    let r = get(
        "GET",
        "/v1/task/h/results/0/0",
        &[("X-Presto-Internal-Bearer", &presto)],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 300);
    let trino = binx_server::internal_auth::sign_token(&hkdf, "trino-worker", now + 300);
    let r = get(
        "GET",
        "/v1/task/h/results/0/1",
        &[("X-Trino-Internal-Bearer", &trino)],
    );
    // A Trino header makes it Trino's dialect: the serialized-pages header
    // (magic, checksum, count) before the page.
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 16 + 200);
    assert_eq!(r.body[..4], [0x01, 0xf0, 0xa4, 0xfe]);
    // Nothing the unauthenticated requests asked was done: a BinX
    // consumer still gets every page from token 1.
    let consumer = authed(&daemon, secret);
    let reply = consumer.call(data("h", 0, 1), Vec::new()).await.unwrap();
    assert_eq!(reply.header.status_kind(), Status::Ok);
    assert_eq!(reply.body.len(), 200);
    assert!(reply.header.buffer_complete);
    assert!(stats_of(&daemon.http, Some(secret))["http_unauthenticated"].as_u64() >= Some(7));
}

/// Opens an HTTP connection and sends a request head that never ends.
fn unfinished_head(addr: &str) -> StdTcpStream {
    let mut stream = StdTcpStream::connect(addr).unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connections_are_capped_slow_heads_time_out_and_binx_keeps_answering() {
    // The cap, held by long-polls (requests in flight, 6 s each).
    let daemon = Daemon::start(&["--http-max-connections", "8"]);
    let polls: Vec<_> = (0..8)
        .map(|i| {
            let http = daemon.http.clone();
            std::thread::spawn(move || {
                let path = format!("/v1/task/capped{i}/results/0/0");
                http_request(&http, "GET", &path, &[("X-Presto-Max-Wait", "6s")]).status
            })
        })
        .collect();
    // Read on the admin socket: HTTP has no slot left.
    let mut admin =
        binx_admin::AdminClient::connect_unix(&daemon.uds.with_file_name("binx-admin.sock"))
            .await
            .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let stats = admin.get_stats().await.unwrap();
        if stats.values.get("long_polls_waiting") == Some(&8) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the 8 long-polls never all waited: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Past the cap a connection is not accepted (no 503, which the
    // engines' clients take as a failed query): its request waits...
    let mut waiting = StdTcpStream::connect(&daemon.http).unwrap();
    waiting
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    waiting
        .set_read_timeout(Some(Duration::from_millis(1500)))
        .unwrap();
    let mut answer = Vec::new();
    assert!(
        waiting.read_to_end(&mut answer).is_err() && answer.is_empty(),
        "answered past the cap: {}",
        String::from_utf8_lossy(&answer)
    );
    // BinX answers on both doors meanwhile.
    daemon.connect_tcp().ping().await.expect("PING on TCP");
    daemon
        .connect_uds()
        .ping()
        .await
        .expect("PING on the Unix socket");
    // ...and is served once a slot is free: the long-polls end (204), and
    // their connections, idle then, are closed for it.
    waiting
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    waiting.read_to_end(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    for poll in polls {
        assert_eq!(poll.join().unwrap(), 204);
    }
    assert!(daemon.stat("http_connections_waited") >= 1);

    // At the cap, connections that ask nothing (heads that never end, kept
    // alive between requests) are closed for a new one: they cannot lock
    // out a health probe.
    let mut slow: Vec<StdTcpStream> = (0..8).map(|_| unfinished_head(&daemon.http)).collect();
    let r = tokio::task::spawn_blocking({
        let http = daemon.http.clone();
        move || http_request(&http, "GET", "/healthz", &[])
    })
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    let mut closed = 0;
    for s in &mut slow {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if matches!(s.read(&mut [0u8; 64]), Ok(0)) {
            closed += 1;
        }
    }
    assert!(closed >= 1, "no idle connection was closed for the new one");

    // Another daemon, with no cap in the way: heads too large, and heads
    // that never finish.
    let daemon = Daemon::start(&["--http-header-read-timeout", "1s"]);
    // A head larger than the 64 KiB read buffer is refused (431, or a
    // reset if binxd closes while it is still being sent), never served.
    let mut big = StdTcpStream::connect(&daemon.http).unwrap();
    big.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: {}\r\n\r\n",
        "a".repeat(200_000)
    );
    let _ = big.write_all(head.as_bytes());
    let mut answer = Vec::new();
    let _ = big.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
        "{answer}"
    );
    // The head timeout: unfinished heads are closed.
    let slow: Vec<StdTcpStream> = (0..8).map(|_| unfinished_head(&daemon.http)).collect();
    for mut stream in slow {
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let start = Instant::now();
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
        assert!(
            start.elapsed() < Duration::from_secs(25),
            "the head never timed out"
        );
    }
    assert_eq!(
        http_request(&daemon.http, "GET", "/healthz", &[]).status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_pages_and_pinned_receive_buffers_count_and_rss_stays_within_the_limit() {
    let limit = 32 * MIB;
    let daemon = Daemon::start(&["--memory-limit", "32MiB", "--task-memory-limit", "32MiB"]);
    let base = peak_rss(&daemon);
    let uds = daemon.connect_uds();
    let producer = Producer::new(uds.clone());
    producer
        .open_task("z", &TaskSpec::partitioned(2))
        .await
        .unwrap();
    // Zero-length pages, 65,536 per ENQUEUE, until binxd says BUSY.
    let mut busy = false;
    for _ in 0..300 {
        let mut r = BinRequest::new(MessageType::Enqueue);
        r.task_id = "z".into();
        // As many as fit the 64 KiB header limit.
        r.page_sizes = vec![0; 60_000];
        let reply = uds.call(r, Vec::new()).await.unwrap().header;
        match reply.status_kind() {
            Status::Ok => {}
            Status::Busy => {
                busy = true;
                break;
            }
            other => panic!("{other:?}: {}", reply.error),
        }
        assert!(daemon.stat("memory_used") > 0, "empty pages cost nothing");
    }
    assert!(busy, "18 M empty pages were all accepted");
    assert!(daemon.stat("memory_used") <= limit);
    // The sizes of all of them are not one reply.
    let mut sizes = data("z", 0, 0);
    sizes.get_data_size = true;
    let reply = uds.call(sizes, Vec::new()).await.unwrap().header;
    assert!(
        reply.remaining_bytes.len() <= 1 << 16,
        "{}",
        reply.remaining_bytes.len()
    );
    assert_rss_within(&daemon, base, limit);

    // One-byte pages, each arriving in a receive buffer of its own: a large
    // page to another buffer fills the rest, and its consumer takes it at
    // once, so only the one-byte page pins that receive buffer.
    producer
        .open_task("p", &TaskSpec::partitioned(2))
        .await
        .unwrap();
    let enqueue = |buffer: u64, page: Bytes| {
        let mut r = BinRequest::new(MessageType::Enqueue);
        r.task_id = "p".into();
        r.buffer_id = buffer;
        r.page_sizes = vec![page.len() as u64];
        uds.call(r, vec![page])
    };
    let one_byte = Bytes::from_static(b"x");
    let filler = Bytes::from(vec![7u8; 3 << 20]);
    let consumer = daemon.connect_uds();
    let mut held = 0;
    for token in 1..=200u64 {
        let reply = enqueue(0, one_byte.clone()).await.unwrap().header;
        if reply.status_kind() == Status::Busy {
            break;
        }
        held += 1;
        let reply = enqueue(1, filler.clone()).await.unwrap().header;
        if reply.status_kind() == Status::Busy {
            break;
        }
        // DATA at the next token acknowledges the filler.
        let _ = consumer.call(data("p", 1, token), Vec::new()).await;
    }
    // Either the small pages were copied out of their receive buffers or
    // the buffers were charged: both keep binxd within its limit.
    assert!(held > 0);
    let used = daemon.stat("memory_used");
    assert!(used <= limit, "memory_used {used}");
    assert_rss_within(&daemon, base, limit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasons_are_cut_and_repeated_aborts_do_not_grow_memory() {
    let daemon = Daemon::start(&[]);
    let uds = daemon.connect_uds();
    let mut abort = BinRequest::new(MessageType::AbortTask);
    abort.task_id = "a".into();
    abort.reason = "r".repeat(60_000);
    let reply = uds.call(abort.clone(), Vec::new()).await.unwrap().header;
    assert_eq!(reply.status_kind(), Status::Ok);
    let reply = daemon
        .connect_tcp()
        .call(data("a", 0, 0), Vec::new())
        .await
        .unwrap()
        .header;
    assert_eq!(reply.status_kind(), Status::ServerError);
    assert!(reply.error.len() <= 4096 + 256, "{}", reply.error.len());
    // A reason over the header limit does not even get in.
    abort.reason = "r".repeat(70_000);
    assert!(uds.call(abort.clone(), Vec::new()).await.is_err());
    let uds = daemon.connect_uds();
    let before = peak_rss(&daemon);
    abort.reason = "r".repeat(4000);
    let mut calls = Vec::new();
    for _ in 0..100_000 {
        calls.push(uds.call(abort.clone(), Vec::new()));
        if calls.len() == 512 {
            for reply in futures_util::future::join_all(calls.drain(..)).await {
                assert_eq!(reply.unwrap().header.status_kind(), Status::Ok);
            }
        }
    }
    futures_util::future::join_all(calls).await;
    let grown = peak_rss(&daemon).saturating_sub(before);
    assert!(
        grown < 32 * MIB,
        "100,000 ABORTs of one task grew RSS {} MiB",
        grown / MIB
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_max_size_on_a_spilled_buffer_gets_at_most_one_frame_limit() {
    let daemon = Daemon::start(&[
        "--memory-limit",
        "8MiB",
        "--task-memory-limit",
        "8MiB",
        "--default-spool-policy",
        "overflow",
    ]);
    let producer = Producer::new(daemon.connect_uds());
    producer
        .open_task("big", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    let page = Bytes::from(vec![3u8; 1 << 20]);
    for _ in 0..24 {
        producer
            .enqueue("big", 0, &vec![page.clone(); 4])
            .await
            .unwrap();
    }
    producer.no_more_pages("big", None).await.unwrap();
    let mut r = data("big", 0, 0);
    r.max_size_bytes = u64::MAX;
    let reply = daemon
        .connect_tcp()
        .call(r, Vec::new())
        .await
        .expect("a reply");
    assert_eq!(
        reply.header.status_kind(),
        Status::Ok,
        "{}",
        reply.header.error
    );
    let limit = binx_proto::DEFAULT_MAX_FRAME_LENGTH - (64 << 10);
    assert!(
        !reply.body.is_empty() && reply.body.len() <= limit,
        "{}",
        reply.body.len()
    );
    assert!(!reply.header.buffer_complete);
    // The HTTP exchange caps it the same way.
    let r = http_request(
        &daemon.http,
        "GET",
        "/v1/task/big/results/0/0",
        &[("X-Presto-Max-Size", "1000GB")],
    );
    assert_eq!(r.status, 200);
    assert!(r.body.len() <= limit, "{}", r.body.len());
}

/// Every file under `dir`, at any depth.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_or_grown_objects_in_storage_are_refused_not_served() {
    let daemon = Daemon::start(&[
        "--shared-secret",
        "cluster",
        "--spool-encryption",
        "on",
        "--default-spool-policy",
        "overflow",
        "--spool-overflow-age",
        "0s",
    ]);
    let producer = Producer::new(daemon.connect_uds());
    let spool = daemon.dir.0.join("data").join("spool");
    let segments = || -> Vec<PathBuf> {
        files_under(&spool)
            .into_iter()
            .filter(|p| !p.to_string_lossy().contains("/commit/"))
            .collect()
    };
    let mut of = std::collections::HashMap::new();
    for task in ["swap", "grow"] {
        let before = segments();
        producer
            .open_task(task, &TaskSpec::partitioned(1))
            .await
            .unwrap();
        let pages: Vec<Bytes> = (0..4u8).map(|i| Bytes::from(vec![i; 1000])).collect();
        producer.enqueue(task, 0, &pages).await.unwrap();
        producer.no_more_pages(task, None).await.unwrap();
        // Every page spilled: DATA must read the object back.
        let deadline = Instant::now() + Duration::from_secs(20);
        while daemon.stat("page_bytes_held") > 0 || segments().len() == before.len() {
            assert!(Instant::now() < deadline, "{task} never spilled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let new: Vec<PathBuf> = segments()
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect();
        assert_eq!(new.len(), 1, "{task}: {new:?}");
        of.insert(task, new[0].clone());
    }
    let of = |task: &str| of[task].clone();
    // An unencrypted object with a valid CRC, as large as the encrypted one
    // (format 2: its nonce prefix and one chunk tag, 23 bytes, are page
    // bytes instead).
    let forged: Vec<Bytes> = [1006, 1006, 1006, 1005]
        .into_iter()
        .map(|n| Bytes::from(vec![b'!'; n]))
        .collect();
    let plain = binx_spool::encode_segment(0, &forged, binx_spool::Codec::None, None).unwrap();
    assert_eq!(
        plain.len() as u64,
        std::fs::metadata(of("swap")).unwrap().len()
    );
    std::fs::write(of("swap"), &plain).unwrap();
    // A 1 GiB object where a small one was.
    let grown = std::fs::OpenOptions::new()
        .write(true)
        .open(of("grow"))
        .unwrap();
    grown.set_len(1 << 30).unwrap();
    drop(grown);
    let before = peak_rss(&daemon);
    let consumer = authed(&daemon, "cluster");
    for task in ["swap", "grow"] {
        let reply = consumer.call(data(task, 0, 0), Vec::new()).await.unwrap();
        assert_ne!(
            reply.header.status_kind(),
            Status::Ok,
            "{task}: forged pages served"
        );
        assert!(!reply.body.contains(&b'!'));
        let text = &reply.header.error;
        // The swapped object is refused either for its pages adding up to
        // more than were written, or for not being encrypted.
        let why: &[&str] = if task == "swap" {
            &["is not encrypted", "more than the limit of 4000 bytes"]
        } else {
            &["is 1073741824 bytes"]
        };
        assert!(why.iter().any(|w| text.contains(w)), "{task}: {text}");
    }
    let grown = peak_rss(&daemon).saturating_sub(before);
    assert!(
        grown < 64 * MIB,
        "read the 1 GiB object: +{} MiB",
        grown / MIB
    );
}

#[test]
fn settings_out_of_range_or_that_do_not_load_stop_binxd_with_the_key_named() {
    for (args, key) in [
        (vec!["--max-connections", "100000000"], "max_connections"),
        (vec!["--spool-ttl", "100000h"], "spool_ttl"),
        (
            vec!["--forward-allowed-peers", "10.0.0.0/40"],
            "forward_allowed_peers",
        ),
        (
            vec!["--idle-timeout", "5s", "--max-wait", "10s"],
            "idle_timeout",
        ),
        (
            vec![
                "--tls-cert",
                "/nonexistent/cert.pem",
                "--tls-key",
                "/nonexistent/key.pem",
            ],
            "/nonexistent/cert.pem",
        ),
        (vec!["--memory-limit", "1KiB"], "memory_limit"),
    ] {
        let out = std::process::Command::new(binary("binxd"))
            .args(&args)
            .args([
                "--tcp-listen",
                "",
                "--uds-path",
                "/nonexistent-dir/binx.sock",
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{args:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_polls_past_the_limit_are_busy_at_once_and_ping_flows() {
    let daemon = Daemon::start(&["--max-outstanding-requests", "16"]);
    let connection = daemon.connect_tcp();
    let mut polls = Vec::new();
    for i in 0..16 {
        let mut r = data("lp", i, 0);
        r.max_wait_micros = 5_000_000;
        polls.push(tokio::spawn({
            let c = connection.clone();
            async move { c.call(r, Vec::new()).await }
        }));
    }
    until_stat(&daemon, "long_polls_waiting", 16).await;
    let start = Instant::now();
    let mut r = data("lp", 99, 0);
    r.max_wait_micros = 5_000_000;
    let reply = connection.call(r, Vec::new()).await.unwrap().header;
    assert_eq!(reply.status_kind(), Status::Busy);
    connection.ping().await.expect("PING");
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    for poll in polls {
        poll.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_regions_have_a_limit_of_their_own() {
    let daemon = Daemon::start(&["--shm-max-connections", "1"]);
    let shm = || {
        Connection::new(
            daemon.uds_endpoint(),
            ConnectionOptions {
                shared_memory: true,
                ..Default::default()
            },
        )
    };
    let first = shm();
    first.ping().await.expect("the first attaches");
    let err = shm()
        .ping()
        .await
        .expect_err("the second is over the limit");
    assert!(err.to_string().contains("shm_max_connections"), "{err}");
    // The socket itself still serves it.
    daemon.connect_uds().ping().await.expect("plain socket");
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match shm().ping().await {
            Ok(_) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "the slot never came back: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_enqueues_under_always_wait_within_the_memory_limit() {
    let daemon = Daemon::start(&[
        "--memory-limit",
        "16MiB",
        "--task-memory-limit",
        "16MiB",
        "--default-spool-policy",
        "always",
    ]);
    let base = peak_rss(&daemon);
    let uds = daemon.connect_uds();
    Producer::new(uds.clone())
        .open_task("alw", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    let page = Bytes::from(vec![5u8; 8 << 20]);
    let calls: Vec<_> = (0..40)
        .map(|_| {
            let mut r = BinRequest::new(MessageType::Enqueue);
            r.task_id = "alw".into();
            r.page_sizes = vec![page.len() as u64];
            r.max_wait_micros = 2_000_000;
            uds.call(r, vec![page.clone()])
        })
        .collect();
    let mut ok = 0;
    for reply in futures_util::future::join_all(calls).await {
        let header = reply.expect("a reply").header;
        match header.status_kind() {
            Status::Ok => ok += 1,
            Status::Busy => {}
            other => panic!("{other:?}: {}", header.error),
        }
    }
    assert!(ok > 0, "no ENQUEUE got through");
    let grown = peak_rss(&daemon).saturating_sub(base);
    assert!(
        grown <= 16 * MIB + 64 * MIB,
        "40 pipelined 8 MiB ENQUEUEs under always: peak RSS +{} MiB with a 16 MiB limit",
        grown / MIB
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_never_takes_the_file_descriptors_binx_needs() {
    // 400 descriptors: 256 kept free, BinX's 100 connections first, so HTTP
    // gets what is left (44), whatever http_max_connections says.
    let daemon = Daemon::start_launched(
        &["prlimit", "--nofile=400:400"],
        &["--max-connections", "100", "--http-max-connections", "4096"],
    );
    assert!(
        daemon.log_shows("lowered the connection limits"),
        "{}",
        daemon.log()
    );
    // 80 long-polls at once: 44 are accepted and wait for pages; the rest
    // wait in the listen backlog, holding none of binxd's descriptors.
    let mut held = Vec::new();
    for i in 0..80 {
        let mut stream = StdTcpStream::connect(&daemon.http).unwrap();
        let head = format!(
            "GET /v1/task/fd{i}/results/0/0 HTTP/1.1\r\nHost: x\r\nX-Presto-Max-Wait: 20s\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).unwrap();
        held.push(stream);
    }
    // Read on the admin socket: HTTP has no slot left.
    let mut admin =
        binx_admin::AdminClient::connect_unix(&daemon.uds.with_file_name("binx-admin.sock"))
            .await
            .unwrap();
    let waiting = |stats: &binx_admin::GetStatsReply| {
        stats.values.get("long_polls_waiting").copied().unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut stats = admin.get_stats().await.unwrap();
    while waiting(&stats) < 44 {
        assert!(Instant::now() < deadline, "{stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        stats = admin.get_stats().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stats = admin.get_stats().await.unwrap();
    assert_eq!(waiting(&stats), 44, "HTTP holds only what is left to it");
    // BinX still has descriptors on both doors.
    let tcp: Vec<Connection> = (0..20).map(|_| daemon.connect_tcp()).collect();
    for c in &tcp {
        c.ping().await.expect("PING on TCP");
    }
    daemon
        .connect_uds()
        .ping()
        .await
        .expect("PING on the Unix socket");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_enqueue_never_stops_its_connection_from_freeing_memory() {
    let daemon = Daemon::start(&["--memory-limit", "16MiB", "--task-memory-limit", "16MiB"]);
    // One connection, as an engine's pooled one: producer and consumer.
    let uds = daemon.connect_uds();
    Producer::new(uds.clone())
        .open_task("mix", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    let page = Bytes::from(vec![1u8; 6 << 20]);
    let enqueue = |wait_micros: u64| {
        let mut r = BinRequest::new(MessageType::Enqueue);
        r.task_id = "mix".into();
        r.page_sizes = vec![page.len() as u64];
        r.max_wait_micros = wait_micros;
        let (uds, page) = (uds.clone(), page.clone());
        async move { uds.call(r, vec![page]).await }
    };
    for _ in 0..2 {
        assert_eq!(enqueue(0).await.unwrap().header.status_kind(), Status::Ok);
    }
    // Memory is full: this one waits for room (up to 20 s)...
    let start = Instant::now();
    let waiting = tokio::spawn(enqueue(20_000_000));
    until_stat(&daemon, "memory_pending", 1).await;
    // ...another pipelined behind it is BUSY at once...
    let busy = enqueue(20_000_000).await.unwrap().header;
    assert_eq!(busy.status_kind(), Status::Busy, "{}", busy.error);
    // ...and a DATA on the same connection, which acknowledges both pages,
    // is still read, so the waiting ENQUEUE gets its room.
    let reply = uds
        .call(data("mix", 0, 2), Vec::new())
        .await
        .unwrap()
        .header;
    assert_eq!(reply.status_kind(), Status::NoData, "{}", reply.error);
    let stored = waiting.await.unwrap().unwrap().header;
    assert_eq!(stored.status_kind(), Status::Ok, "{}", stored.error);
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
}

/// Long-polls are capped over all HTTP connections and streams: past
/// `http_max_long_polls` a GET of a buffer with pages is answered at once;
/// one with nothing yet waits for a permit as long as it would have waited
/// for pages (at most 2 s), then is answered (204) and counted. Never an
/// empty answer at once: the engines' clients ask again at once after any
/// answer, and would spin. A GET that gets a permit while it waits
/// long-polls as any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_long_polls_past_the_cap_wait_for_a_permit_then_are_answered() {
    let daemon = Daemon::start(&["--http-max-long-polls", "1"]);
    let producer = Producer::new(daemon.connect_uds());
    for task in ["lp", "lp2", "full"] {
        producer
            .open_task(task, &TaskSpec::partitioned(1))
            .await
            .unwrap();
    }
    let get = |task: &'static str, wait: &'static str| {
        let http = daemon.http.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let path = format!("/v1/task/{task}/results/0/0");
            let r = http_request(&http, "GET", &path, &[("X-Presto-Max-Wait", wait)]);
            (r, started.elapsed())
        })
    };
    // One long-poll holds the only permit...
    let waiting = get("lp", "8s");
    until_stat(&daemon, "long_polls_waiting", 1).await;
    // ...another waits 2 s for it (not the 5 s it asked), then gets 204.
    let (r, took) = get("lp2", "5s").await.unwrap();
    assert_eq!(r.status, 204);
    assert_eq!(r.header("X-Presto-Buffer-Complete"), "false");
    assert!(
        (Duration::from_millis(1900)..Duration::from_millis(4900)).contains(&took),
        "the GET past the cap was answered after {took:?}"
    );
    assert_eq!(daemon.stat("http_long_polls_refused"), 1);
    // A buffer with pages is read without a permit, and nothing is refused.
    producer
        .enqueue("full", 0, &[Bytes::from_static(b"held")])
        .await
        .unwrap();
    let (r, _) = get("full", "5s").await.unwrap();
    assert_eq!((r.status, r.body.as_slice()), (200, b"held".as_slice()));
    assert_eq!(daemon.stat("http_long_polls_refused"), 1);
    // A GET waiting for the permit gets it when the long-poll ends (its
    // page arrives), and then waits for pages of its own.
    let queued = get("lp2", "5s");
    tokio::time::sleep(Duration::from_millis(300)).await;
    producer
        .enqueue("lp", 0, &[Bytes::from_static(b"first")])
        .await
        .unwrap();
    let (r, _) = waiting.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"first");
    until_stat(&daemon, "long_polls_waiting", 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    producer
        .enqueue("lp2", 0, &[Bytes::from_static(b"second")])
        .await
        .unwrap();
    let (r, _) = queued.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"second");
    assert_eq!(daemon.stat("http_long_polls_refused"), 1);
}

/// Over HTTP/2 (h2c) a request without a valid bearer token gets its 401,
/// and then the connection is closed (GOAWAY): a stranger cannot keep a
/// connection slot by repeating cheap refused requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_http2_connection_is_closed_after_its_401() {
    use http_body_util::{BodyExt, Empty};
    let daemon = Daemon::start(&["--shared-secret", "h2-secret"]);
    let stream = TcpStream::connect(&daemon.http).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2c handshake (prior knowledge)");
    let connection = tokio::spawn(connection);
    let request = hyper::Request::get(format!("http://{}/v1/task/h2/results/0/0", daemon.http))
        .header("X-Trino-Max-Size", "1MB")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(response.version(), hyper::Version::HTTP_2);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("X-Trino-Internal-Bearer"),
        "{body:?}"
    );
    tokio::time::timeout(Duration::from_secs(10), connection)
        .await
        .expect("binxd closed the HTTP/2 connection after the 401")
        .unwrap()
        .ok();
    assert_eq!(daemon.stat("http_unauthenticated"), 1);
}

/// binxd with a 16 MiB memory limit whose pages all go to storage at once
/// (policy overflow, no age).
fn spilling_daemon(extra: &[&str]) -> Daemon {
    let mut args = vec![
        "--memory-limit",
        "16MiB",
        "--task-memory-limit",
        "16MiB",
        "--default-spool-policy",
        "overflow",
        "--spool-overflow-age",
        "0s",
    ];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

/// Waits (up to 30 s) until no page is held in memory.
async fn until_all_spilled(daemon: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while daemon.stat("page_bytes_held") > 0 {
        assert!(Instant::now() < deadline, "the pages never all spilled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A BinX connection that asks for the whole of buffer 0 of `task` 64
/// times, pipelined, and reads nothing: far more than the sockets' buffers
/// hold.
async fn asking_without_reading(daemon: &Daemon, task: &str) -> TcpStream {
    let mut stalled = preface_only(&daemon.tcp).await;
    let mut requests = bytes::BytesMut::new();
    for id in 1..=64u64 {
        let mut request = data(task, 0, 0);
        request.request_id = id;
        request.max_size_bytes = u64::MAX;
        binx_proto::encode_frame_head(&request, 0, &mut requests).unwrap();
    }
    stalled.write_all(&requests).await.unwrap();
    stalled
}

/// Waits (up to 10 s) until what binxd holds of objects read back is at
/// most its read cache (a sixteenth of a 16 MiB limit): the replies of a
/// connection it closed no longer hold the read budget.
async fn until_read_budget_free(daemon: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let held = daemon.stats()["spool"]["read_bytes_held"]
            .as_u64()
            .unwrap_or(u64::MAX);
        if held <= MIB {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replies of a closed connection still hold {held} bytes of the read budget"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (up to 20 s) until replies nobody reads hold the read budget for
/// good: at least 1 MiB held, and nothing sent for a second. Until the
/// kernel's socket buffers are full, a held reply is written out and frees
/// the budget a moment later: seeing it held once is not enough (a GET in
/// that moment found room, under load).
async fn until_budget_held_for_good(daemon: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sent = u64::MAX;
    let mut still_since = Instant::now();
    loop {
        let stats = daemon.stats();
        let held = stats["spool"]["read_bytes_held"].as_u64().unwrap_or(0);
        let now_sent = stats["bytes_sent"]
            .as_u64()
            .unwrap_or_else(|| panic!("stats without bytes_sent: {stats}"));
        if held < MIB || now_sent != sent {
            still_since = Instant::now();
            sent = now_sent;
        } else if still_since.elapsed() >= Duration::from_secs(1) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the stalled replies never held the budget for good ({held} bytes held)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `request` until the reply is not BUSY (the budget of replies held
/// stayed full), as a client does, for at most a minute.
async fn call_until_not_busy(
    connection: Connection,
    request: BinRequest,
) -> binx_proto::Frame<binx_proto::BinReply> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reply = connection
            .call(request.clone(), Vec::new())
            .await
            .expect("a reply");
        if reply.header.status_kind() != Status::Busy {
            return reply;
        }
        assert!(Instant::now() < deadline, "BUSY for a minute");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The pages of an OK DATA reply at token 0, every one inline.
fn inline_pages_from_zero(reply: &binx_proto::Frame<binx_proto::BinReply>) -> Vec<Bytes> {
    let header = &reply.header;
    assert_eq!(header.status_kind(), Status::Ok, "{}", header.error);
    assert_eq!(header.segments.first().map(|s| s.first_token), Some(0));
    let mut at = 0;
    let mut pages = Vec::new();
    for segment in &header.segments {
        assert!(
            matches!(segment.body, Some(binx_proto::segment::Body::Inline(_))),
            "not asked for spooled segments"
        );
        for size in &segment.page_sizes {
            let size = *size as usize;
            pages.push(reply.body.slice(at..at + size));
            at += size;
        }
    }
    assert_eq!(at, reply.body.len());
    assert!(!pages.is_empty());
    pages
}

/// Pages read back from storage are held by binxd too: many consumers
/// asking at once for whole spilled buffers (each reply up to the frame
/// limit) must not take binxd's peak RSS past its memory limit + 64 MiB,
/// and every reply still carries exactly the pages written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_of_spilled_buffers_stay_within_the_memory_limit() {
    const TASKS: usize = 6;
    const PAGES: usize = 48;
    let limit = 16 * MIB;
    let daemon = spilling_daemon(&[]);
    let base = peak_rss(&daemon);
    let producer = Producer::new(daemon.connect_uds());
    let page = |task: usize, i: usize| Bytes::from(vec![(task * PAGES + i) as u8; 1 << 20]);
    for task in 0..TASKS {
        let id = format!("spilled-{task}");
        producer
            .open_task(&id, &TaskSpec::partitioned(1))
            .await
            .unwrap();
        for batch in 0..PAGES / 4 {
            let pages: Vec<Bytes> = (0..4).map(|i| page(task, batch * 4 + i)).collect();
            producer.enqueue(&id, 0, &pages).await.unwrap();
        }
        producer.no_more_pages(&id, None).await.unwrap();
    }
    until_all_spilled(&daemon).await;
    // Four requests for each whole buffer at once, on four connections.
    let connections: Vec<Connection> = (0..4).map(|_| daemon.connect_tcp()).collect();
    let mut reads = tokio::task::JoinSet::new();
    for task in 0..TASKS {
        for connection in &connections {
            let connection = connection.clone();
            reads.spawn(async move {
                let mut r = data(&format!("spilled-{task}"), 0, 0);
                r.max_size_bytes = u64::MAX;
                (task, call_until_not_busy(connection, r).await)
            });
        }
    }
    while let Some(read) = reads.join_next().await {
        let (task, reply) = read.unwrap();
        for (i, page) in inline_pages_from_zero(&reply).iter().enumerate() {
            assert_eq!(page.len(), 1 << 20, "spilled-{task} page {i}");
            assert!(
                page.iter().all(|b| *b == (task * PAGES + i) as u8),
                "spilled-{task} page {i} is not the page written"
            );
        }
    }
    assert_rss_within(&daemon, base, limit);
}

/// The same for forwarded DATA: a local engine asking binxd to forward many
/// requests for a whole remote buffer at once gets one budget's worth per
/// reply while the budget has room, and small replies past it, never each
/// whole buffer held at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_forwarded_reads_stay_within_the_memory_limit() {
    const PAGES: usize = 48;
    let remote = Daemon::start(&[]);
    let producer = remote.producer("far", 1).await;
    let page = |i: usize| Bytes::from(vec![i as u8; 1 << 20]);
    for batch in 0..PAGES / 8 {
        let pages: Vec<Bytes> = (0..8).map(|i| page(batch * 8 + i)).collect();
        producer.enqueue("far", 0, &pages).await.unwrap();
    }
    producer.no_more_pages("far", None).await.unwrap();
    let limit = 16 * MIB;
    let local = Daemon::start(&["--memory-limit", "16MiB", "--task-memory-limit", "16MiB"]);
    let base = peak_rss(&local);
    let connections: Vec<Connection> = (0..4).map(|_| local.connect_uds()).collect();
    let mut reads = tokio::task::JoinSet::new();
    for _ in 0..6 {
        for connection in &connections {
            let connection = connection.clone();
            let tcp = remote.tcp.clone();
            reads.spawn(async move {
                let mut r = data("far", 0, 0);
                r.max_size_bytes = u64::MAX;
                r.remote = tcp;
                call_until_not_busy(connection, r).await
            });
        }
    }
    while let Some(read) = reads.join_next().await {
        let reply = read.unwrap();
        for (i, page) in inline_pages_from_zero(&reply).iter().enumerate() {
            assert!(
                page.iter().all(|b| *b == i as u8),
                "page {i} is not the page written"
            );
        }
    }
    assert_rss_within(&local, base, limit);
}

/// A consumer that asks for spilled pages and then reads nothing must not
/// keep what its replies hold: binxd closes its connection after
/// `write_stall_timeout`, the read budget is free again, and another
/// consumer reads the whole buffer, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_reads_nothing_is_cut_off_and_frees_its_replies() {
    const PAGES: usize = 24;
    let daemon = spilling_daemon(&["--write-stall-timeout", "2s"]);
    let producer = Producer::new(daemon.connect_uds());
    let page = |i: usize| Bytes::from(vec![i as u8; 1 << 20]);
    producer
        .open_task("stalled", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    for batch in 0..PAGES / 4 {
        let pages: Vec<Bytes> = (0..4).map(|i| page(batch * 4 + i)).collect();
        producer.enqueue("stalled", 0, &pages).await.unwrap();
    }
    producer.no_more_pages("stalled", None).await.unwrap();
    until_all_spilled(&daemon).await;
    let timed_out = daemon.stat("connections_timed_out");

    // Asks for the whole buffer many times over, pipelined, and reads
    // nothing: far more than the sockets' buffers hold.
    let mut stalled = asking_without_reading(&daemon, "stalled").await;

    // Cut off after the stall limit, however long the replies took to
    // build (each waits for the read budget its predecessors hold).
    until_stat(&daemon, "connections_timed_out", timed_out + 1).await;
    until_read_budget_free(&daemon).await;

    // Another consumer reads everything, page for page.
    let reader = daemon.connect_tcp();
    let mut token = 0;
    let mut got = 0;
    loop {
        let mut request = data("stalled", 0, token);
        request.max_size_bytes = 4 * MIB;
        let reply = call_until_not_busy(reader.clone(), request).await;
        let header = &reply.header;
        assert_eq!(header.status_kind(), Status::Ok, "{}", header.error);
        let mut at = 0;
        for segment in &header.segments {
            for size in &segment.page_sizes {
                let size = *size as usize;
                assert_eq!(size, 1 << 20);
                assert!(
                    reply.body[at..at + size].iter().all(|b| *b == got as u8),
                    "page {got} is not the page written"
                );
                at += size;
                got += 1;
            }
        }
        token = header.page_next_token;
        if header.buffer_complete {
            break;
        }
    }
    assert_eq!(got, PAGES);

    // The stalled socket is closed: what was in flight drains, then EOF
    // (or a reset).
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stalled.read_to_end(&mut sink))
        .await
        .expect("binxd closed the stalled connection");
}

/// An HTTP/2 consumer that grants no flow-control window, and keeps its
/// connection busy with PINGs so that bytes keep moving, does not keep its
/// response: binxd closes the connection once the response has made no
/// progress for `http_idle_timeout`, the read budget is free again, and
/// the pages are all still there for the next consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_consumer_granting_no_window_is_cut_off_and_frees_its_response() {
    const PAGES: usize = 16;
    let daemon = spilling_daemon(&["--max-wait", "1s", "--http-idle-timeout", "2s"]);
    let producer = Producer::new(daemon.connect_uds());
    producer
        .open_task("nowindow", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    let pages: Vec<Bytes> = (0..PAGES)
        .map(|i| Bytes::from(vec![i as u8; 1 << 20]))
        .collect();
    for batch in pages.chunks(4) {
        producer.enqueue("nowindow", 0, batch).await.unwrap();
    }
    producer.no_more_pages("nowindow", None).await.unwrap();
    until_all_spilled(&daemon).await;

    let stream = TcpStream::connect(&daemon.http).await.unwrap();
    let mut builder =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .initial_stream_window_size(0)
        .keep_alive_interval(Duration::from_millis(250))
        .keep_alive_while_idle(true);
    let (mut sender, connection) = builder
        .handshake::<_, http_body_util::Empty<Bytes>>(hyper_util::rt::TokioIo::new(stream))
        .await
        .expect("h2c handshake (prior knowledge)");
    let connection = tokio::spawn(connection);
    let request = hyper::Request::get(format!(
        "http://{}/v1/task/nowindow/results/0/0",
        daemon.http
    ))
    .header("X-Presto-Max-Size", "32MB")
    .body(http_body_util::Empty::<Bytes>::new())
    .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    // The body is never read: no window, only PINGs.
    tokio::time::timeout(Duration::from_secs(15), connection)
        .await
        .expect("binxd closed the HTTP/2 connection whose response did not move")
        .unwrap()
        .ok();
    drop(response);
    until_read_budget_free(&daemon).await;
    // Nothing was acknowledged: every page is read, exactly.
    let mut source = binx_client::ExchangeSource::new(
        daemon.connect_tcp(),
        "nowindow",
        0,
        binx_client::SourceConfig::default(),
    );
    let mut got = 0;
    while let Some(page) = source.next_page().await.expect("read") {
        assert_eq!(page.data, pages[got], "page {got}");
        got += 1;
    }
    assert_eq!(got, PAGES);
}

/// A GET of the HTTP exchange that DATA would answer BUSY (here: the read
/// budget stays held by a consumer that reads nothing) is an empty 204 at
/// the same token, never complete, with the reason: Presto's and Trino's
/// clients poll again after it, while any other status fails their query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_get_that_finds_no_room_to_read_storage_is_polled_again_not_failed() {
    let daemon = spilling_daemon(&["--write-stall-timeout", "60s"]);
    let producer = Producer::new(daemon.connect_uds());
    let page = |i: usize| Bytes::from(vec![i as u8; 1 << 20]);
    for task in ["held", "wanted"] {
        producer
            .open_task(task, &TaskSpec::partitioned(1))
            .await
            .unwrap();
        for batch in 0..4 {
            let pages: Vec<Bytes> = (0..4).map(|i| page(batch * 4 + i)).collect();
            producer.enqueue(task, 0, &pages).await.unwrap();
        }
        producer.no_more_pages(task, None).await.unwrap();
    }
    until_all_spilled(&daemon).await;
    // A consumer asks for "held" many times over and reads nothing: its
    // replies keep the read budget.
    let stalled = asking_without_reading(&daemon, "held").await;
    until_budget_held_for_good(&daemon).await;
    for (dialect, prefix) in [("Presto", "X-Presto"), ("Trino", "X-Trino")] {
        let max_size = format!("{prefix}-Max-Size");
        let max_wait = format!("{prefix}-Max-Wait");
        // http_request runs on a thread of its own.
        let response = http_request(
            &daemon.http,
            "GET",
            "/v1/task/wanted/results/0/0",
            &[(max_size.as_str(), "8MB"), (max_wait.as_str(), "1s")],
        );
        assert_eq!(
            response.status,
            204,
            "{dialect}: {:?}",
            String::from_utf8_lossy(&response.body)
        );
        assert_eq!(
            response.header(&format!("{prefix}-Page-Sequence-Id")),
            "0",
            "{dialect}"
        );
        assert_eq!(
            response.header(&format!("{prefix}-Page-End-Sequence-Id")),
            "0",
            "{dialect}"
        );
        assert_eq!(
            response.header(&format!("{prefix}-Buffer-Complete")),
            "false",
            "{dialect}"
        );
        assert!(
            response.header("X-Binx-Error").contains("retry"),
            "{dialect}: {}",
            response.header("X-Binx-Error")
        );
    }
    drop(stalled);
    // Once the budget is free, the same GET gets the pages.
    until_read_budget_free(&daemon).await;
    let response = http_request(
        &daemon.http,
        "GET",
        "/v1/task/wanted/results/0/0",
        &[("X-Presto-Max-Size", "1MB")],
    );
    assert_eq!(response.status, 200);
}

/// Sends `requests` (numbered 1 on, no body) in one write, from a task of
/// its own, as a client that reads none of the replies; the writer comes
/// back once all is written.
fn send_unread<W: tokio::io::AsyncWrite + Unpin + Send + 'static>(
    mut writer: W,
    requests: impl Iterator<Item = BinRequest>,
) -> tokio::task::JoinHandle<W> {
    let mut wire = bytes::BytesMut::new();
    for (id, mut request) in (1..).zip(requests) {
        request.request_id = id;
        binx_proto::encode_frame_head(&request, 0, &mut wire).unwrap();
    }
    tokio::spawn(async move {
        writer.write_all(&wire).await.unwrap();
        writer
    })
}

/// Waits until `answered` stops growing (binxd stopped reading); its value.
async fn until_steady(answered: impl Fn() -> u64) -> u64 {
    let mut last = answered();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = answered();
        if now == last && now > 0 {
            return now;
        }
        last = now;
    }
}

/// Reads the reply to request `id` (`what` names it), which must be the
/// next and come within 30 s.
async fn next_reply<R: tokio::io::AsyncRead + Unpin>(
    frames: &mut binx_proto::FrameReader<R, binx_proto::BinReply>,
    what: &str,
    id: u64,
) -> binx_proto::Frame<binx_proto::BinReply> {
    let reply = tokio::time::timeout(Duration::from_secs(30), frames.next())
        .await
        .unwrap_or_else(|_| panic!("no reply to {what} {id} within 30 s"))
        .unwrap_or_else(|| panic!("binxd closed the connection before {what} {id}"))
        .unwrap();
    assert_eq!(reply.header.request_id, id, "replies come in order");
    reply
}

/// PINGs binxd answered OK.
fn pings_answered(daemon: &Daemon) -> u64 {
    daemon.stats()["requests"]["PING OK"].as_u64().unwrap_or(0)
}

/// A client that sends far more requests than it reads replies to stops
/// binxd reading its requests (the reply queue and the socket are full,
/// nothing more is held for it), and once it reads, it gets every reply,
/// in order: the queue's full path, where the connection awaits room
/// instead of queueing without waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reading_no_replies_is_not_read_until_it_does_then_gets_every_reply() {
    const PINGS: u64 = 200_000;
    let daemon = Daemon::start(&[]);
    let (reader, writer) = preface_only_unix(&daemon.uds).await.into_split();
    let pings = (0..PINGS).map(|_| BinRequest::new(MessageType::Ping));
    let sender = send_unread(writer, pings);
    let answered = until_steady(|| pings_answered(&daemon)).await;
    assert!(
        answered < PINGS && !sender.is_finished(),
        "binxd answered {answered} of {PINGS} PINGs nobody read"
    );
    let mut frames = binx_proto::FrameReader::<_, binx_proto::BinReply>::new(reader, 1 << 20);
    for id in 1..=PINGS {
        let reply = next_reply(&mut frames, "PING", id).await;
        assert_eq!(reply.header.status(), Status::Ok);
    }
    let _writer = sender.await.unwrap();
    assert_eq!(pings_answered(&daemon), PINGS);
}

/// A consumer that sends many DATAs and reads none of their replies stops
/// binxd reading its requests once about 32 MiB of replies wait to be
/// written (a reply holds its pages' memory until written, even after an
/// ACK frees them from the count, so a review found a peer could pile
/// replies up to the queue's 256 of up to 64 MiB each); once it reads, it
/// gets every reply, in order and exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_reading_no_replies_holds_a_bounded_amount_of_them() {
    const REQUESTS: u64 = 200;
    const PAGE: usize = 1 << 20;
    let daemon = Daemon::start(&[]);
    let producer = Producer::new(daemon.connect_uds());
    producer
        .open_task("unread", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    let pages: Vec<Bytes> = (0..4u8).map(|i| Bytes::from(vec![i; PAGE])).collect();
    producer.enqueue("unread", 0, &pages).await.unwrap();
    let data_answered = || daemon.stats()["requests"]["DATA OK"].as_u64().unwrap_or(0);
    let (reader, writer) = preface_only(&daemon.tcp).await.into_split();
    let asks = (0..REQUESTS).map(|_| {
        let mut r = data("unread", 0, 0);
        r.max_size_bytes = 4 * PAGE as u64;
        r
    });
    let sender = send_unread(writer, asks);
    let answered = until_steady(data_answered).await;
    // 32 MiB queued, the reply past it, and what the sockets hold (a few
    // MiB each way on loopback): far below the 800 MiB asked for.
    assert!(
        answered * 4 * PAGE as u64 <= 96 * MIB,
        "binxd answered {answered} DATAs of 4 MiB nobody read"
    );
    let mut frames = binx_proto::FrameReader::<_, binx_proto::BinReply>::new(
        reader,
        binx_proto::DEFAULT_MAX_FRAME_LENGTH,
    );
    for id in 1..=REQUESTS {
        let reply = next_reply(&mut frames, "DATA", id).await;
        assert_eq!(reply.header.status(), Status::Ok, "{}", reply.header.error);
        assert_eq!(reply.body.len(), 4 * PAGE);
        for (i, page) in reply.body.chunks(PAGE).enumerate() {
            assert!(page.iter().all(|b| *b == i as u8), "page {i} of reply {id}");
        }
    }
    let _writer = sender.await.unwrap();
    assert_eq!(data_answered(), REQUESTS);
}

/// With a shared secret, an HTTP/1.1 request without a valid token (a
/// probe, a scrape) is answered and its connection closed, so strangers
/// cannot hold every HTTP connection slot with a keep-alive /healthz a few
/// seconds apart (review finding); without a secret the connection stays
/// open for the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_without_a_token_do_not_keep_their_connection_when_a_secret_is_set() {
    let probe = |addr: &str| -> (String, bool) {
        let mut stream = StdTcpStream::connect(addr).unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut said = Vec::new();
        // Read until the server closes, or 5 s pass with the connection open.
        let closed = loop {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk) {
                Ok(0) => break true,
                Ok(n) => said.extend_from_slice(&chunk[..n]),
                Err(_) => break false,
            }
        };
        (String::from_utf8_lossy(&said).into_owned(), closed)
    };
    let secret = Daemon::start(&["--shared-secret", "s3cret"]);
    let (said, closed) = probe(&secret.http);
    assert!(
        said.starts_with("HTTP/1.1 200") && said.ends_with("ok\n"),
        "{said}"
    );
    assert!(
        said.to_ascii_lowercase().contains("connection: close"),
        "{said}"
    );
    assert!(closed, "the connection was left open: {said}");
    let open = Daemon::start(&[]);
    let (said, closed) = probe(&open.http);
    assert!(said.starts_with("HTTP/1.1 200"), "{said}");
    assert!(!closed, "without a secret a probe keeps its connection");
}

/// An HTTP/2 connection (prior knowledge) that asks nothing and only sends
/// PINGs moves bytes, so the byte idle timer never fired and it held its
/// slot for ever (review finding). It is closed once it has asked nothing
/// for `http_idle_timeout`.
#[test]
fn an_http2_connection_that_only_pings_is_closed_after_the_idle_timeout() {
    let daemon = Daemon::start(&["--max-wait", "1s", "--http-idle-timeout", "2s"]);
    let mut pinging = crate::common::PingingHttp2::open(&daemon.http);
    let started = Instant::now();
    let received = pinging.ping_until_closed(Duration::from_millis(300), Duration::from_secs(10));
    assert!(
        received.is_some(),
        "still open after {:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "closed before the idle timeout: {:?}",
        started.elapsed()
    );
    // It was answered (PING ACKs) while it was kept, so bytes did move.
    let received = received.unwrap_or(0);
    assert!(received > 9 * 3, "{received} bytes received");
}

/// The local engine writing large pages on many connections at once, with
/// its consumers reading along: each connection's receive buffers are
/// reused frame after frame, and those it keeps for reuse (counted nowhere
/// while no page pins them) are bounded for the whole process, so peak RSS
/// stays within the memory limit + 64 MiB however many connections write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_engine_connections_writing_large_pages_keep_rss_within_the_limit() {
    const CONNECTIONS: usize = 16;
    const PAGES: usize = 16;
    const PAGE: usize = 4 << 20;
    let limit = 64 * MIB;
    let daemon = Daemon::start(&["--memory-limit", "64MiB", "--task-memory-limit", "16MiB"]);
    let base = peak_rss(&daemon);
    let mut writers = Vec::new();
    for c in 0..CONNECTIONS {
        let task = format!("wide-{c}");
        let producer = daemon.producer(&task, 1).await;
        let connection = daemon.connect_tcp();
        let reader = tokio::spawn({
            let task = task.clone();
            async move {
                let mut source = binx_client::ExchangeSource::new(
                    connection,
                    task,
                    0,
                    binx_client::SourceConfig::default(),
                );
                let mut pages = 0;
                while let Some(page) = source.next_page().await.expect("reading") {
                    assert_eq!(page.data.len(), PAGE);
                    assert!(page.data.iter().all(|&b| b == c as u8));
                    pages += 1;
                }
                pages
            }
        });
        writers.push(tokio::spawn(async move {
            let page = Bytes::from(vec![c as u8; PAGE]);
            for _ in 0..PAGES {
                producer
                    .enqueue(&task, 0, std::slice::from_ref(&page))
                    .await
                    .expect("ENQUEUE");
            }
            producer
                .no_more_pages(&task, None)
                .await
                .expect("NO_MORE_PAGES");
            reader.await.unwrap()
        }));
    }
    for writer in writers {
        assert_eq!(writer.await.unwrap(), PAGES);
    }
    eprintln!("grew {} MiB", (peak_rss(&daemon) - base) / MIB);
    assert_rss_within(&daemon, base, limit);
}

/// Local connections that each send most of a 64 MiB frame and then stall:
/// binxd receives large frames within one budget for all connections
/// (the others wait, their bytes in the kernel's socket buffers), so peak
/// RSS stays within the memory limit + 64 MiB; a frame not complete within
/// `frame_timeout` of its start closes its connection, so an honest
/// producer behind one such frame is served (its client's request timeout
/// is longer), and one behind all of them after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_connections_stalling_inside_large_frames_hold_a_bounded_amount() {
    const STALLERS: usize = 8;
    let limit = 64 * MIB;
    let daemon = Daemon::start(&["--memory-limit", "64MiB", "--frame-timeout", "3s"]);
    let base = peak_rss(&daemon);
    // One stalled frame takes all the room (it is larger than the budget).
    let first = stall_inside_a_large_frame(&daemon).await;
    until_stat(&daemon, "receive_frames_bytes", 1).await;
    let producer = daemon.producer("behind-one", 1).await;
    producer
        .enqueue("behind-one", 0, &[Bytes::from(vec![7u8; 8 << 20])])
        .await
        .expect("an 8 MiB page behind one stalled frame");
    first.await.unwrap();
    let mut stallers = Vec::new();
    for _ in 0..STALLERS {
        stallers.push(stall_inside_a_large_frame(&daemon).await);
    }
    // Every staller at its stall (or waiting for the budget), then served
    // after the timeouts.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_rss_within(&daemon, base, limit);
    for staller in stallers {
        staller.await.unwrap();
    }
    assert_rss_within(&daemon, base, limit);
    assert!(daemon.stat("connections_timed_out") > STALLERS as u64);
    let producer = daemon.producer("after", 1).await;
    producer
        .enqueue("after", 0, &[Bytes::from(vec![7u8; 8 << 20])])
        .await
        .expect("an 8 MiB page after the stallers");
}

/// A local connection that sends 48 MiB of a 64 MiB frame, then nothing;
/// the task ends when binxd closed it.
async fn stall_inside_a_large_frame(daemon: &Daemon) -> tokio::task::JoinHandle<usize> {
    const FRAME: u32 = 64 << 20;
    const SENT: usize = 48 << 20;
    let mut stream = preface_only_unix(&daemon.uds).await;
    tokio::spawn(async move {
        let mut start = FRAME.to_be_bytes().to_vec();
        start.extend_from_slice(&2u32.to_be_bytes());
        start.extend_from_slice(&[8, 1]);
        let chunk = vec![0u8; 1 << 20];
        let mut sent = start.len();
        let mut wrote = stream.write_all(&start).await;
        while wrote.is_ok() && sent < SENT {
            wrote = stream.write_all(&chunk).await;
            sent += chunk.len();
        }
        // Then nothing more: binxd closes it at frame_timeout.
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut rest))
            .await
            .expect("binxd closes a stalled frame's connection");
        sent
    })
}

/// binxd asks the kernel to probe its accepted TCP connections (keepalive)
/// and to give up on replies unacknowledged for write_stall_timeout: a
/// client whose node vanished leaves no connection behind for
/// idle_timeout or the quarter hour of retransmits. Read back from the
/// kernel with `ss`, on binxd's side of a real connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binxd_has_the_kernel_probe_its_tcp_peers() {
    let daemon = Daemon::start(&["--write-stall-timeout", "90s"]);
    let peer = daemon.connect_tcp();
    peer.ping().await.expect("PING");
    let port = daemon.tcp.rsplit(':').next().unwrap().to_string();
    let ss = || {
        let out = std::process::Command::new("ss")
            .args([
                "-tnoH",
                "state",
                "established",
                "sport",
                "=",
                &format!(":{port}"),
            ])
            .output()
            .expect("ss runs");
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // Once the PING's reply is acknowledged, the socket is idle: its timer
    // is keepalive's (a retransmit timer runs while bytes are unacknowledged).
    let mut text = ss();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !text.contains("timer:(keepalive,") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        text = ss();
    }
    assert!(text.contains("timer:(keepalive,"), "{text}");
    // ss shows no TCP_USER_TIMEOUT; keepalive's idle time shows as the timer.
    let timer = text.split("timer:(keepalive,").nth(1).unwrap_or("");
    let secs: f64 = timer
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .find(|s| !s.is_empty())
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::MAX);
    assert!(
        secs <= 30.0,
        "keepalive in {secs} s (binxd asks for 30 s): {text}"
    );
}
