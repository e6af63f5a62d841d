//! Shared memory between an engine and its sidecar (docs/PROTOCOL.md
//! section 6): the same pages and tokens as the socket and TCP, and engines
//! that die or scribble over their regions hurt only themselves. The
//! misbehaving engines are tests/e2e/shm_client.py, a client written in
//! Python from the documented layout alone.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, Endpoint, Producer, TaskSpec};
use binx_proto::BufferKind;
use bytes::Bytes;

use crate::common::{Daemon, peak_rss, rng};
use crate::proxy::read_all;

fn shm_options() -> ConnectionOptions {
    ConnectionOptions {
        shared_memory: true,
        ..Default::default()
    }
}

fn shm_connection(daemon: &Daemon) -> Connection {
    Connection::new(Endpoint::Unix(daemon.uds.clone()), shm_options())
}

/// Regions binxd has open: its memfd descriptors.
fn memfds(daemon: &Daemon) -> usize {
    let dir = PathBuf::from(format!("/proc/{}/fd", daemon.child.id()));
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|target| target.to_string_lossy().contains("memfd:binx"))
                .count()
        })
        .unwrap_or(0)
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Fills buffer 0 of `task` with random pages of `sizes`, `per_enqueue`
/// at a time, and finishes it; returns the pages sent.
async fn produce_random_pages(
    producer: &Producer,
    task: &str,
    seed: u64,
    sizes: impl IntoIterator<Item = usize>,
    per_enqueue: usize,
) -> Vec<Bytes> {
    let mut rng = rng(seed);
    let sent: Vec<Bytes> = sizes
        .into_iter()
        .map(|size| {
            let mut p = vec![0u8; size];
            rng.fill(&mut p);
            Bytes::from(p)
        })
        .collect();
    for chunk in sent.chunks(per_enqueue) {
        producer.enqueue(task, 0, chunk).await.unwrap();
    }
    producer.no_more_pages(task, None).await.unwrap();
    sent
}

fn python_client(args: &[&std::ffi::OsStr]) -> Command {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/shm_client.py");
    let mut command = Command::new("python3");
    command.arg(script).args(args);
    command
}

/// The Python engine run with `args`, once it printed "ready".
fn ready_engine(args: &[&std::ffi::OsStr]) -> std::process::Child {
    let mut engine = python_client(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(engine.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "ready");
    engine
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_consumer_over_shared_memory_equals_the_socket_and_direct_tcp_with_spooled_pages() {
    let local = Daemon::start(&[]);
    // Every page of the remote's task is in its file:// store before ENQUEUE
    // is answered, so replies come from spooled segments.
    let remote = Daemon::start(&[]);
    let producer = Producer::unix(remote.uds.clone(), shm_options());
    let spec = TaskSpec {
        kind: BufferKind::Partitioned,
        buffer_count: 3,
        spool_policy: "always".into(),
    };
    producer.open_task("shm", &spec).await.unwrap();
    let mut rng = rng(77);
    let sent: Vec<Bytes> = (0..200)
        .map(|_| {
            let mut p = vec![0u8; rng.usize(0..300 << 10)];
            rng.fill(&mut p);
            Bytes::from(p)
        })
        .collect();
    for buffer in 0..3 {
        producer.enqueue("shm", buffer, &sent).await.unwrap();
    }
    producer.no_more_pages("shm", None).await.unwrap();
    assert!(
        remote.stats()["spool"]["objects_spooled"].as_u64().unwrap() > 0,
        "the pages were spooled"
    );

    let (direct, socket, shared) = tokio::join!(
        read_all(remote.connect_tcp(), "shm", 0, None),
        read_all(local.connect_uds(), "shm", 1, Some(remote.tcp.clone())),
        read_all(shm_connection(&local), "shm", 2, Some(remote.tcp.clone())),
    );
    assert_eq!(direct.len(), sent.len());
    assert_eq!(socket, direct, "same pages and tokens through the socket");
    assert_eq!(
        shared, direct,
        "same pages and tokens through shared memory"
    );
    for (page, expected) in shared.iter().zip(&sent) {
        assert_eq!(&page.data, expected);
    }
    assert!(local.stat("shm_attached_total") >= 1);
    assert!(
        remote.stat("shm_attached_total") >= 1,
        "the producer used shared memory"
    );
    assert_eq!(remote.stat_when("memory_used", |n| n == 0), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_in_the_middle_of_an_enqueue_through_shared_memory_costs_nothing_else() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("killed", 1).await;
    // Another engine on shared memory, busy the whole time.
    let bystander = Producer::new(shm_connection(&daemon));
    bystander
        .open_task("bystander", &TaskSpec::partitioned(1))
        .await
        .unwrap();
    bystander
        .enqueue("bystander", 0, &[Bytes::from_static(b"before")])
        .await
        .unwrap();

    let mut engine = ready_engine(&[
        "half-enqueue".as_ref(),
        daemon.uds.as_os_str(),
        "killed".as_ref(),
    ]);
    assert_eq!(daemon.stat_when("shm_connections_open", |n| n == 2), 2);
    assert_eq!(memfds(&daemon), 4, "two regions per attached connection");
    engine.kill().unwrap();
    engine.wait().unwrap();

    // binxd drops the dead engine's connection and unmaps its regions.
    wait_for("the connection to close", Duration::from_secs(5), || {
        daemon.stat("shm_connections_open") == 1
    });
    wait_for("the regions to be released", Duration::from_secs(5), || {
        memfds(&daemon) == 2
    });
    // The cut ENQUEUE stored nothing; the task stays open and goes on.
    producer
        .enqueue("killed", 0, &[Bytes::from_static(b"after")])
        .await
        .unwrap();
    producer.no_more_pages("killed", None).await.unwrap();
    let pages = read_all(daemon.connect_uds(), "killed", 0, None).await;
    assert_eq!(pages.len(), 1, "only the complete ENQUEUE's page");
    assert_eq!(&pages[0].data[..], b"after");
    // The other engine never noticed.
    bystander
        .enqueue("bystander", 0, &[Bytes::from_static(b"after")])
        .await
        .unwrap();
    bystander.no_more_pages("bystander", None).await.unwrap();
    let pages = read_all(shm_connection(&daemon), "bystander", 0, None).await;
    let data: Vec<&[u8]> = pages.iter().map(|p| &p.data[..]).collect();
    assert_eq!(data, [&b"before"[..], b"after"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_scribbles_over_its_ring_is_closed_with_the_reason_and_others_are_served() {
    let daemon = Daemon::start(&[]);
    let bystander = shm_connection(&daemon);
    bystander.ping().await.unwrap();
    let out = python_client(&["ping-then-garbage".as_ref(), daemon.uds.as_os_str()])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The documented layout works from another language...
    assert!(stdout.contains("ping status 1"), "{stdout}");
    // ...and breaking it gets a reason, on the socket, then the close.
    assert!(
        stdout.contains(
            "closed with status 5: closing the shared memory connection: shared memory ring: submit ring head"
        ),
        "{stdout}"
    );
    assert!(daemon.log_shows("submit ring head"), "binxd logs why");
    assert!(daemon.stat_when("protocol_errors", |n| n >= 1) >= 1);
    wait_for("the regions to be released", Duration::from_secs(5), || {
        memfds(&daemon) == 2
    });
    bystander
        .ping()
        .await
        .expect("the other engine is still served");
    shm_connection(&daemon)
        .ping()
        .await
        .expect("new engines are served");
}

/// A client that writes through every slot of a large region A (as the
/// contract allows) costs binxd no resident memory for it: binxd reads the
/// slots without mapping them into its own pages, so its peak RSS stays
/// within its memory limit + 64 MiB however large the region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cycling_through_every_slot_costs_binxd_no_resident_memory() {
    const MIB: u64 = 1 << 20;
    let daemon = Daemon::start(&[
        "--memory-limit",
        "16MiB",
        "--task-memory-limit",
        "16MiB",
        "--max-wait",
        "1s",
        "--shm-region-size",
        "256MiB",
    ]);
    let producer = daemon.producer("flood", 1).await;
    let base = peak_rss(&daemon);
    let out = python_client(&[
        "flood".as_ref(),
        daemon.uds.as_os_str(),
        "flood".as_ref(),
        "192".as_ref(),
    ])
    .output()
    .expect("python3 runs");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}\nbinxd's log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        daemon.log()
    );
    // Some ENQUEUEs fit; the rest were BUSY (memory full), but every
    // frame went through region A and was read by binxd.
    assert!(said.starts_with("ok "), "{said}");
    let peak = peak_rss(&daemon);
    let grown = peak.saturating_sub(base);
    assert!(
        grown <= 16 * MIB + 64 * MIB,
        "binxd's peak RSS grew {} MiB for 192 MiB sent through a 256 MiB region",
        grown / MIB
    );
    // binxd still serves, and the stored pages are whole.
    producer.no_more_pages("flood", None).await.unwrap();
    let pages = read_all(daemon.connect_uds(), "flood", 0, None).await;
    assert!(!pages.is_empty());
    for page in &pages {
        assert_eq!(page.data.len(), 64 << 10);
        assert!(page.data.iter().enumerate().all(|(i, b)| *b == i as u8));
    }
}

/// An engine reading over shared memory gets pages that are views of the
/// slots binxd wrote (no copy on its side). One that keeps every page it
/// reads, eight times what the region holds, must still get every page
/// intact, without binxd's writer ever waiting long for a slot: the client
/// holds at most half the slots so and copies the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_keeping_every_page_read_in_place_never_stalls_binxd() {
    let daemon = Daemon::start(&[
        "--shm-region-size",
        "8MiB",
        "--shm-slot-size",
        "1MiB",
        // A client keeping every slot would be cut off within this.
        "--write-stall-timeout",
        "2s",
    ]);
    let producer = daemon.producer("kept", 1).await;
    // Mostly pages read in place, some small (copied) ones.
    let sizes = (0..256).map(|i| if i % 5 == 0 { 3000 } else { 250_000 });
    let sent = produce_random_pages(&producer, "kept", 64, sizes, 16).await;
    let held = daemon.stat("memory_used");
    assert!(held >= 50 << 20, "{held} bytes held");

    let connection = shm_connection(&daemon);
    let config = binx_client::SourceConfig {
        memory_budget: 8 << 20,
        ..binx_client::SourceConfig::default()
    };
    let mut source = binx_client::ExchangeSource::new(connection, "kept", 0, config);
    let mut kept = Vec::new();
    let read = async {
        while let Some(page) = source.next_page().await.expect("source") {
            kept.push(page);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("the engine read every page in time");
    assert_eq!(kept.len(), sent.len());
    for (i, (page, sent)) in kept.iter().zip(&sent).enumerate() {
        assert!(page.data == *sent, "page {i} differs");
    }
    assert_eq!(daemon.stat("connections_timed_out"), 0);
    drop(kept);
    assert_eq!(daemon.stat_when("memory_used", |n| n == 0), 0);
}

/// Pages too large for a slot are copied whatever the reply size, so after
/// the first one `ExchangeSource` goes back to its usual replies (several
/// pages each) instead of one page per round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_larger_than_a_slot_are_read_in_the_usual_reply_size() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("large", 1).await;
    let sent = produce_random_pages(&producer, "large", 65, [1536 << 10; 24], 4).await;
    // One DATA at a time, so the reply size is what the count shows (a
    // pipelined 2 MiB reply holds one such page whatever happens).
    let config = binx_client::SourceConfig {
        pipeline_depth: 1,
        ..binx_client::SourceConfig::default()
    };
    let mut source = binx_client::ExchangeSource::new(shm_connection(&daemon), "large", 0, config);
    let mut got = Vec::new();
    while let Some(page) = source.next_page().await.expect("source") {
        got.push(page.data);
    }
    assert_eq!(got, sent);
    // 36 MiB in replies of up to 4 MiB (two pages): about 12 DATA, where
    // one page per reply would take 24.
    // (The daemon is fresh: every DATA it answered is this source's.)
    let asked = crate::common::metric(&daemon, "binx_requests_total{type=\"DATA\",status=\"OK\"}");
    assert!(asked <= 16, "{asked} DATA replies for 24 pages");
}

/// An engine that clears O_NONBLOCK on the eventfds it shares with binxd
/// (the open files are the same), fills the count of the one binxd wakes
/// it through and says it waits, then wakes binxd twice, does not stop
/// binxd: with one runtime thread, a write or read that waited on those
/// eventfds would stop every connection (a review found both). binxd
/// still answers over TCP and HTTP, and on the Unix socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_makes_its_eventfds_block_stops_nothing_but_itself() {
    let daemon = Daemon::start(&["--runtime-threads", "1"]);
    let mut engine = ready_engine(&["blocking-wakes".as_ref(), daemon.uds.as_os_str()]);
    for _ in 0..3 {
        tokio::time::timeout(Duration::from_secs(5), daemon.connect_tcp().ping())
            .await
            .expect("binxd answers over TCP within 5 s")
            .expect("PING over TCP");
        tokio::time::timeout(Duration::from_secs(5), daemon.connect_uds().ping())
            .await
            .expect("binxd answers on the Unix socket within 5 s")
            .expect("PING on the Unix socket");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(daemon.stats()["requests"].is_object(), "HTTP answers");
    engine.kill().unwrap();
    engine.wait().unwrap();
}
