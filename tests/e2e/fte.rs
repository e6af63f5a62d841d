//! What an engine's fault-tolerant exchange needs of binxd, through real
//! sockets: policy `commit`, commit manifests and COMMITTED, the advertised
//! address, and the JVM side (java/: the Java client and the Trino plugin,
//! with Trino's own SPI suite and a multi-node Trino running TPC-H).

use std::path::PathBuf;
use std::process::{Command, Stdio};

use binx_client::{Producer, TaskSpec};
use binx_proto::{ALL_BUFFERS, BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;

use crate::common::{Daemon, binary, skipped};

fn committed(task: &str, from: u64) -> BinRequest {
    let mut r = BinRequest::new(MessageType::Committed);
    r.task_id = task.into();
    r.page_token = from;
    r
}

fn spool_dir(daemon: &Daemon) -> PathBuf {
    daemon.dir.0.join("data").join("spool")
}

/// A task under `commit` keeps its pages in memory while it writes; its
/// finish writes them (its buffers' segments packed into one file), then
/// the manifest with a marker per buffer folded in (format 3: no object a
/// marker, segments named as ranges of the pack), and COMMITTED
/// then says where it is and how large each buffer is. On TCP COMMITTED is
/// refused; a forged manifest is refused by its MAC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_writes_at_the_finish_and_committed_says_where_the_output_is() {
    let secret = "fte-test-secret";
    let daemon = Daemon::start(&["--shared-secret", secret]);
    let producer = Producer::new(daemon.connect_uds());
    producer
        .open_task(
            "fte.q1",
            &TaskSpec {
                kind: BufferKind::Partitioned,
                buffer_count: 3,
                spool_policy: "commit".into(),
            },
        )
        .await
        .unwrap();
    let pages: Vec<Bytes> = (0..10u8)
        .map(|i| Bytes::from(vec![i; 100 + i as usize]))
        .collect();
    producer.enqueue("fte.q1", 0, &pages).await.unwrap();
    producer.enqueue("fte.q1", 2, &pages[..3]).await.unwrap();
    let manifest = spool_dir(&daemon).join("commit/fte.q1/task.json");
    assert!(
        !manifest.exists(),
        "nothing is committed while the task writes"
    );
    producer.no_more_pages("fte.q1", None).await.unwrap();
    assert!(
        manifest.exists(),
        "the finish's OK comes after the manifest"
    );
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(written["format"], 3, "{written}");
    let folded: Vec<u64> = written["markers"]
        .as_array()
        .expect("markers in the manifest")
        .iter()
        .map(|m| m["buffer_id"].as_u64().unwrap())
        .collect();
    assert_eq!(folded, vec![0, 1, 2], "{written}");
    let task_dir: Vec<PathBuf> = walk(&spool_dir(&daemon).join("commit/fte.q1"));
    assert_eq!(task_dir, vec![manifest.clone()], "no marker objects");
    let segments = segment_files(&spool_dir(&daemon));
    assert_eq!(
        segments.len(),
        1,
        "one pack for both buffers' segments: {segments:?}"
    );
    let pack = segments[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let named: Vec<String> = written["markers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["segments"].as_array().unwrap().clone())
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(named.len(), 2, "{written}");
    for name in &named {
        assert!(
            name.starts_with(&format!("{pack}@")),
            "{name} is a range of {pack}"
        );
    }
    assert_eq!(stat(&daemon, true, "objects_packed"), 2);

    let uds = daemon.connect_uds();
    let reply = uds
        .call(committed("fte.q1", 0), Vec::new())
        .await
        .unwrap()
        .header;
    assert_eq!(reply.status_kind(), Status::Ok, "{}", reply.error);
    let c = reply.committed.expect("the commit");
    assert_eq!(
        c.endpoint, daemon.tcp,
        "the address other sidecars reach it under"
    );
    assert_eq!(c.buffer_count, 3);
    assert_eq!(c.end_tokens, vec![10, 0, 3]);
    let bytes: u64 = pages.iter().map(|p| p.len() as u64).sum();
    let first3: u64 = pages[..3].iter().map(|p| p.len() as u64).sum();
    assert_eq!(c.bytes, vec![bytes, 0, first3]);
    assert!(reply.buffer_complete);

    let hello = uds
        .call(BinRequest::new(MessageType::Hello), Vec::new())
        .await
        .unwrap()
        .header;
    let caps = hello.capabilities;
    assert!(
        caps.contains(&format!("address={}", daemon.tcp)),
        "{caps:?}"
    );
    assert!(caps.contains(&"committed".to_string()), "{caps:?}");

    // Not on TCP: the coordinator asks its own sidecar.
    let tcp = binx_client::Connection::new(
        daemon.tcp_endpoint(),
        binx_client::ConnectionOptions {
            auth_token: Some(secret.into()),
            ..binx_client::ConnectionOptions::default()
        },
    );
    let refused = tcp
        .call(committed("fte.q1", 0), Vec::new())
        .await
        .unwrap()
        .header;
    assert_eq!(refused.status_kind(), Status::BadRequest);
    assert!(refused.error.contains("local request"), "{}", refused.error);

    // Unknown task: NO_DATA. A manifest altered in storage: refused, named.
    let none = uds
        .call(committed("fte.none", 0), Vec::new())
        .await
        .unwrap()
        .header;
    assert_eq!(none.status_kind(), Status::NoData);
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replace("[10,", "[11,")).unwrap();
    let forged = uds
        .call(committed("fte.q1", 0), Vec::new())
        .await
        .unwrap()
        .header;
    assert_eq!(forged.status_kind(), Status::ServerError);
    assert!(
        forged.error.contains("task.json") && forged.error.contains("shared_secret"),
        "{}",
        forged.error
    );

    // Deleting every buffer takes the markers, the manifest and the objects.
    for b in 0..3 {
        let mut d = BinRequest::new(MessageType::Delete);
        d.task_id = "fte.q1".into();
        d.buffer_id = b;
        uds.request(d, Vec::new()).await.unwrap();
    }
    let gone = crate::common::wait_until(std::time::Duration::from_secs(20), || {
        walk(&spool_dir(&daemon)).is_empty()
    });
    assert!(gone, "left in storage: {:?}", walk(&spool_dir(&daemon)));
    let mut all = BinRequest::new(MessageType::NoMorePages);
    all.task_id = "fte.q2".into();
    all.buffer_id = ALL_BUFFERS;
    assert_eq!(
        uds.call(all, Vec::new())
            .await
            .unwrap()
            .header
            .status_kind(),
        Status::BadRequest,
        "a task never opened"
    );
}

/// A task's stat from /v1/stats (`spool.<key>` when `spool`).
fn stat(daemon: &Daemon, spool: bool, key: &str) -> u64 {
    let stats = daemon.stats();
    let v = if spool {
        &stats["spool"][key]
    } else {
        &stats[key]
    };
    v.as_u64()
        .unwrap_or_else(|| panic!("no {key} in /v1/stats: {stats}"))
}

/// Reads buffer 0 of `task` to its end with DATA that acknowledge nothing
/// (`ack_token` 0), so the pages stay for a later read; true when it holds
/// exactly `expected` (compared here: a failure prints no megabytes).
async fn reads_exactly(uds: &binx_client::Connection, task: &str, expected: &[Bytes]) -> bool {
    let mut got: Vec<Bytes> = Vec::new();
    loop {
        let mut d = BinRequest::new(MessageType::Data);
        d.task_id = task.into();
        d.page_token = got.len() as u64;
        d.ack_token = Some(0);
        d.max_size_bytes = 64 << 20;
        let reply = uds.call(d, Vec::new()).await.unwrap();
        let h = &reply.header;
        assert_eq!(h.status_kind(), Status::Ok, "{}", h.error);
        let mut at = 0;
        for segment in &h.segments {
            for size in &segment.page_sizes {
                got.push(reply.body.slice(at..at + *size as usize));
                at += *size as usize;
            }
        }
        if h.buffer_complete {
            return got == expected;
        }
    }
}

/// Under `commit` what the finish wrote stays in memory: the readers of
/// fault-tolerant output, who come after the finish, are served without a
/// read of storage. When another task needs the room, those pages leave
/// memory (they are in storage: core_tests checks no write is made for it),
/// and are then read from storage, exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_pages_are_served_from_memory_until_room_is_wanted() {
    // One shard: which task's pages make the room is then this test's to
    // say (with more, the second task's shard spills its own as well).
    let daemon = Daemon::start(&[
        "--memory-limit",
        "4MiB",
        "--task-memory-limit",
        "4MiB",
        "--shards",
        "1",
    ]);
    let producer = Producer::new(daemon.connect_uds());
    let commit = |buffers| TaskSpec {
        kind: BufferKind::Partitioned,
        buffer_count: buffers,
        spool_policy: "commit".into(),
    };
    let pages: Vec<Bytes> = (0..16u8).map(|i| Bytes::from(vec![i; 100 << 10])).collect();
    producer.open_task("fte.a", &commit(1)).await.unwrap();
    producer.enqueue("fte.a", 0, &pages).await.unwrap();
    producer.no_more_pages("fte.a", None).await.unwrap();
    assert!(
        stat(&daemon, false, "memory_used") >= 1600 << 10,
        "the committed pages stay in memory"
    );
    let uds = daemon.connect_uds();
    assert!(reads_exactly(&uds, "fte.a", &pages).await);
    assert_eq!(stat(&daemon, true, "objects_read"), 0, "served from memory");

    // Another commit task needs more than the room left: the first task's
    // pages leave memory (what else the room takes, the second task's own
    // pages spilled ahead, depends on the receive buffers' sizes).
    producer.open_task("fte.b", &commit(1)).await.unwrap();
    let more: Vec<Bytes> = (0..26u8)
        .map(|i| Bytes::from(vec![i ^ 0x55; 100 << 10]))
        .collect();
    producer.enqueue("fte.b", 0, &more[..13]).await.unwrap();
    producer.enqueue("fte.b", 0, &more[13..]).await.unwrap();
    assert!(
        stat(&daemon, false, "bytes_evicted") >= 1600 << 10,
        "{}",
        daemon.stats()
    );
    assert!(stat(&daemon, false, "memory_used") <= 4 << 20);
    assert!(reads_exactly(&uds, "fte.a", &pages).await);
    assert!(stat(&daemon, true, "objects_read") > 0, "read from storage");
    producer.no_more_pages("fte.b", None).await.unwrap();
    assert!(reads_exactly(&uds, "fte.b", &more).await);
}

/// The segment files (`.bxs`) under `dir`, packs included.
fn segment_files(dir: &PathBuf) -> Vec<PathBuf> {
    walk(dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "bxs"))
        .collect()
}

/// Sidecars of two nodes that share one `file://` store (a volume both
/// mount): a commit's buffers' segments go into one file (a pack); the
/// producer's sidecar dies; the consumer's sidecar reads every buffer from
/// the pack through its failover, exact (an empty buffer too); its reads
/// release the buffers one by one, and the last release takes the pack, the
/// manifest and the release records: nothing is left in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packed_commit_fails_over_from_a_shared_local_store_and_leaves_nothing() {
    let store = crate::common::TempDir::new("fte-packed");
    let url = format!("file://{}", store.0.display());
    let flags = |node: &'static str| -> Vec<String> {
        [
            "--spool-stores",
            url.as_str(),
            "--shared-secret",
            "fte-pack-secret",
            "--spool-node-name",
            node,
            "--spool-failover-after",
            "2s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let (producer_flags, consumer_flags) = (flags("producer"), flags("consumer"));
    let mut producer_daemon = Daemon::start(
        &producer_flags
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let consumer_daemon = Daemon::start(
        &consumer_flags
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    const BUFFERS: u64 = 6;
    let producer = Producer::new(producer_daemon.connect_uds());
    producer
        .open_task(
            "fte.pack",
            &TaskSpec {
                kind: BufferKind::Partitioned,
                buffer_count: BUFFERS,
                spool_policy: "commit".into(),
            },
        )
        .await
        .unwrap();
    // Buffer 3 gets no page; the others 1 to 6 pages of their own sizes.
    let produced: Vec<Vec<Bytes>> = (0..BUFFERS)
        .map(|b| {
            let count = if b == 3 { 0 } else { b + 1 };
            (0..count)
                .map(|i| Bytes::from(vec![(b * 16 + i) as u8; 1 + (b * 997 + i * 131) as usize]))
                .collect()
        })
        .collect();
    for (b, pages) in produced.iter().enumerate() {
        if !pages.is_empty() {
            producer.enqueue("fte.pack", b as u64, pages).await.unwrap();
        }
    }
    producer.no_more_pages("fte.pack", None).await.unwrap();
    let packs = segment_files(&store.0);
    assert_eq!(packs.len(), 1, "the five segments are one file: {packs:?}");
    assert_eq!(stat(&producer_daemon, true, "objects_packed"), 5);
    let manifest = store.0.join("commit/fte.pack/task.json");
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(written["format"], 3, "{written}");

    producer_daemon.send_signal("KILL");
    producer_daemon.wait_exit(std::time::Duration::from_secs(5));
    for (b, pages) in produced.iter().enumerate() {
        let mut source = binx_client::ExchangeSource::new(
            consumer_daemon.connect_uds(),
            "fte.pack",
            b as u64,
            binx_client::SourceConfig {
                remote: Some(producer_daemon.tcp.clone()),
                ..binx_client::SourceConfig::default()
            },
        );
        let mut got = Vec::new();
        while let Some(page) =
            tokio::time::timeout(std::time::Duration::from_secs(60), source.next_page())
                .await
                .expect("never stuck on a page for a minute (failover is 2 s)")
                .expect("read")
        {
            assert_eq!(page.token, got.len() as u64, "buffer {b}: in order, once");
            got.push(page.data);
        }
        assert!(got == *pages, "buffer {b}: exactly what was written");
    }
    assert!(
        stat(&consumer_daemon, true, "objects_read") >= 1,
        "read from storage"
    );
    let gone = crate::common::wait_until(std::time::Duration::from_secs(20), || {
        walk(&store.0).is_empty()
    });
    assert!(gone, "left in the store: {:?}", walk(&store.0));
}

fn walk(dir: &PathBuf) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The JVM side: `scripts/java.sh` builds java/ with Java 25 and Maven and
/// runs its tests against this build's binxd: the Java client's (vectors,
/// seeded round trips, a real binxd, a proxy that cuts connections, lying
/// servers), Trino's own exchange SPI suite, and a coordinator and two
/// workers running the 22 TPC-H queries under retry-policy=TASK on binx.
/// Where Java 25 or Maven cannot be had, it is listed as skipped.
#[test]
fn the_java_client_and_the_trino_plugin_pass_their_tests() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let java25 = std::fs::read_dir("/usr/lib/jvm")
        .ok()
        .and_then(|d| {
            d.flatten()
                .find(|e| e.file_name().to_string_lossy().contains("25"))
                .map(|e| e.path())
        })
        .or_else(|| std::env::var_os("BINX_JAVA25_HOME").map(PathBuf::from));
    if java25.is_none() {
        skipped(
            "fte::the_java_client_and_the_trino_plugin_pass_their_tests",
            "no Java 25 (Trino 483 needs it); set BINX_JAVA25_HOME",
        );
        return;
    }
    let status = Command::new(repo.join("scripts/java.sh"))
        .arg("verify")
        .env("BINX_BINXD", binary("binxd"))
        .stdin(Stdio::null())
        .status()
        .expect("scripts/java.sh runs");
    assert!(
        status.success(),
        "scripts/java.sh verify failed ({status}); the Maven reports are under target/java/*/surefire-reports and failsafe-reports"
    );
    // The SPI benchmark in its quick mode, once (after verify: one Maven
    // at a time in target/java): its harness works and every page it
    // writes comes back, on each exchange.
    quick_bench(
        &repo,
        "BinxSinkBench",
        "trino-sink-quick.md",
        &["-Dbinx.bench.rounds=3", "-Dbinx.bench.warmup-rounds=2"],
        &["| filesystem |", "| binx commit |", "| binx always |"],
    );
    // And the TPC-H benchmark's harness, in its quick mode on three
    // queries, in the shape its comparison of binx with the filesystem
    // exchange runs: the clusters (binx commit and always, and the
    // filesystem exchange) side by side, timed query by query in turn, two
    // rounds (the second in the reverse order), every TASK answer checked
    // against NONE's.
    quick_bench(
        &repo,
        "BinxTpchBench",
        "trino-tpch-quick.md",
        &[
            "-Dbinx.bench.schema=tiny",
            "-Dbinx.bench.warmup=false",
            "-Dbinx.bench.queries=3,5,22",
            "-Dbinx.bench.order=commit,filesystem,always",
            "-Dbinx.bench.rounds=2",
            "-Dbinx.bench.paired=true",
        ],
        &[
            "| q03 |",
            "| q05 |",
            "| q22 |",
            "| **total** |",
            "clusters in this order: (commit with filesystem with always, side by side), (always with filesystem with commit, side by side)",
            "| always NONE |",
            "commit / fs",
            "(rounds: ",
        ],
    );
}

/// Runs the Java benchmark `test` once through `scripts/java.sh bench`
/// with `settings`, and checks that its report (under target/bench/) has
/// every line in `expected`.
fn quick_bench(
    repo: &std::path::Path,
    test: &str,
    report: &str,
    settings: &[&str],
    expected: &[&str],
) {
    let report = repo.join("target/bench").join(report);
    let _ = std::fs::remove_file(&report);
    let status = Command::new(repo.join("scripts/java.sh"))
        .arg("bench")
        .args(settings)
        .arg(format!("-Dbinx.bench.out={}", report.display()))
        .env("BINX_BINXD", binary("binxd"))
        .env("BINX_BENCH_TEST", test)
        .env("BINX_BENCH_XMX", "4g")
        .stdin(Stdio::null())
        .status()
        .expect("scripts/java.sh bench runs");
    assert!(status.success(), "{test} failed ({status})");
    let text = std::fs::read_to_string(&report).expect("the bench's report");
    for line in expected {
        assert!(text.contains(line), "{line} in {text}");
    }
}

/// The value of HELLO's capability `name=<value>` on `c`.
async fn said_in_hello(c: &binx_client::Connection, name: &str) -> String {
    let hello = c
        .call(BinRequest::new(MessageType::Hello), Vec::new())
        .await
        .expect("HELLO")
        .header;
    let prefix = format!("{name}=");
    let found = hello
        .capabilities
        .iter()
        .find_map(|c| c.strip_prefix(prefix.as_str()))
        .map(str::to_string);
    found.unwrap_or_else(|| panic!("no {prefix} in {:?}", hello.capabilities))
}

/// HELLO's `instance=` is one value for every connection to one binxd
/// process and a new one for the next process: what lets a
/// producer that reconnects tell that the pages it had confirmed are gone
/// (docs/PROTOCOL.md section 9), where a resent OPEN_TASK and token 0 would
/// otherwise be taken as new and the task would end short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_names_an_instance_new_at_every_start() {
    async fn instance(c: binx_client::Connection) -> String {
        said_in_hello(&c, "instance").await
    }
    let daemon = Daemon::start(&[]);
    let first = instance(daemon.connect_uds()).await;
    assert_eq!(first.len(), 16, "{first}");
    assert!(first.bytes().all(|b| b.is_ascii_hexdigit()), "{first}");
    assert_eq!(first, instance(daemon.connect_uds()).await);
    drop(daemon);
    // Another process (on another socket and port: HELLO is all that is compared).
    let restarted = Daemon::start(&[]);
    let second = instance(restarted.connect_uds()).await;
    assert_ne!(first, second, "a restarted binxd is another instance");
}

/// HELLO says how many pages one buffer holds (`max_pages_per_buffer`),
/// and the limit it says is the one binxd keeps: a producer whose consumers
/// read only once it finished (Trino's) fails at once past it instead of
/// waiting out BUSY replies for room no consumer will free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_says_the_pages_a_buffer_holds_and_binxd_keeps_that_limit() {
    let daemon = Daemon::start(&[]);
    let said = said_in_hello(&daemon.connect_uds(), "max-pages-per-buffer").await;
    assert_eq!(said, "1048576", "the default");
    drop(daemon);

    let daemon = Daemon::start(&["--max-pages-per-buffer", "5"]);
    let uds = daemon.connect_uds();
    assert_eq!(said_in_hello(&uds, "max-pages-per-buffer").await, "5");
    let task = "t.hello-max-pages";
    Producer::new(daemon.connect_uds())
        .open_task(
            task,
            &TaskSpec {
                kind: BufferKind::Partitioned,
                buffer_count: 1,
                spool_policy: "commit".into(),
            },
        )
        .await
        .expect("OPEN_TASK");
    let enqueue = |pages: u64, wait_micros: u64| {
        let mut r = BinRequest::new(MessageType::Enqueue);
        r.task_id = task.to_string();
        r.buffer_id = 0;
        r.max_wait_micros = wait_micros;
        r.page_sizes = vec![1; pages as usize];
        (r, vec![Bytes::from(vec![7u8; pages as usize])])
    };
    let (r, body) = enqueue(5, 0);
    let five = uds.call(r, body).await.expect("ENQUEUE of 5");
    assert_eq!(five.header.status, Status::Ok as i32, "{:?}", five.header);
    let (r, body) = enqueue(1, 1_000);
    let sixth = uds.call(r, body).await.expect("ENQUEUE of a sixth");
    assert_eq!(
        sixth.header.status,
        Status::Busy as i32,
        "{:?}",
        sixth.header
    );
    assert!(
        sixth.header.error.contains("max_pages_per_buffer") && sixth.header.error.contains(task),
        "{}",
        sixth.header.error
    );
}
