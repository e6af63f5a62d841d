//! binxd with its core in several shards (`--shards`): producers of tasks
//! on different shards share one memory limit, every page arrives exactly
//! once, a producer waiting for room on one shard gets the room a consumer
//! frees on another, and the stats and metrics are the daemon's (summed);
//! and the runtime runs the threads `runtime_threads` gives it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use binx_client::{ExchangeSource, SourceConfig};
use binx_core::shard_of;
use binx_proto::{BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;

use crate::common::{Daemon, StreamHash, http_get, rng};

const SHARDS: usize = 4;
const LIMIT: u64 = 2 << 20;
const PAGE: usize = 64 << 10;

fn open(task: &str) -> BinRequest {
    let mut open = BinRequest::new(MessageType::OpenTask);
    open.task_id = task.into();
    open.buffer_kind = BufferKind::Partitioned as i32;
    open.buffer_count = 1;
    open
}

fn enqueue(task: &str, sizes: Vec<u64>, wait: Duration) -> BinRequest {
    let mut request = BinRequest::new(MessageType::Enqueue);
    request.task_id = task.into();
    request.page_sizes = sizes;
    request.max_wait_micros = wait.as_micros() as u64;
    request
}

/// Whether binxd's `/metrics` has gauge `name` at `value`.
fn shows_gauge(daemon: &Daemon, name: &str, value: usize) -> bool {
    let (_, metrics) = http_get(&daemon.http, "/metrics");
    metrics.lines().any(|l| l == format!("{name} {value}"))
}

/// Reads buffer 0 of `task` to its end, a page every `pause`.
async fn consume(daemon: &Daemon, task: String, pause: Duration) -> (u64, u64, [u8; 32]) {
    let connection = daemon.connect_tcp();
    let config = SourceConfig {
        memory_budget: 256 << 10,
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(connection, &task, 0, config);
    let mut hash = StreamHash::default();
    while let Some(page) = source.next_page().await.expect("consumer") {
        hash.add(&page.data);
        tokio::time::sleep(pause).await;
    }
    hash.finish()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_on_several_shards_share_one_memory_limit_and_lose_nothing() {
    let daemon = Arc::new(Daemon::start(&[
        "--shards",
        "4",
        "--memory-limit",
        "2MiB",
        "--task-memory-limit",
        "2MiB",
    ]));
    let tasks: Vec<String> = (0..6).map(|i| format!("shards.{i}.0.0")).collect();
    let mut used: Vec<usize> = tasks.iter().map(|t| shard_of(t, SHARDS)).collect();
    used.sort_unstable();
    used.dedup();
    assert!(used.len() >= 3, "the tasks land on shards {used:?} only");

    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (done, peak, http) = (done.clone(), peak.clone(), daemon.http.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let (_, body) = http_get(&http, "/v1/stats");
                let stats: serde_json::Value = serde_json::from_str(&body).expect("stats JSON");
                peak.fetch_max(
                    stats["memory_used"].as_u64().expect("memory_used"),
                    Ordering::Relaxed,
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };

    let mut producers = Vec::new();
    for (i, task) in tasks.iter().enumerate() {
        let uds = daemon.connect_uds();
        uds.request(open(task), Vec::new())
            .await
            .expect("OPEN_TASK");
        producers.push(tokio::spawn({
            let task = task.clone();
            async move {
                let mut rng = rng(100 + i as u64);
                let mut sent = StreamHash::default();
                let mut busy = 0u32;
                for _ in 0..24 {
                    let mut page = vec![0u8; PAGE];
                    rng.fill(&mut page);
                    sent.add(&page);
                    let page = Bytes::from(page);
                    let request = enqueue(&task, vec![PAGE as u64], Duration::from_millis(200));
                    loop {
                        let reply = uds
                            .call(request.clone(), vec![page.clone()])
                            .await
                            .expect("ENQUEUE");
                        match reply.header.status_kind() {
                            Status::Ok => break,
                            Status::Busy => {
                                busy += 1;
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            other => panic!("ENQUEUE {task}: {other:?} {}", reply.header.error),
                        }
                    }
                }
                let mut finish = BinRequest::new(MessageType::NoMorePages);
                finish.task_id = task.clone();
                uds.request(finish, Vec::new())
                    .await
                    .expect("NO_MORE_PAGES");
                (sent.finish(), busy)
            }
        }));
    }
    // The producers send 9 MiB into a 2 MiB limit: with no consumer yet,
    // they must be pushed back, whatever the machine's speed. Consumers
    // start once one was.
    let pushed_back = async {
        while daemon.stat("backpressure_waits") == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), pushed_back)
        .await
        .expect("the producers fill the memory limit");
    let consumers: Vec<_> = tasks
        .iter()
        .map(|task| {
            let (daemon, task) = (daemon.clone(), task.clone());
            tokio::spawn(async move { consume(&daemon, task, Duration::from_millis(3)).await })
        })
        .collect();
    let mut busy = 0;
    for (task, (producer, consumer)) in tasks.iter().zip(producers.into_iter().zip(consumers)) {
        let (sent, b) = tokio::time::timeout(Duration::from_secs(120), producer)
            .await
            .expect("producer finishes")
            .expect("producer task");
        busy += b;
        let received = tokio::time::timeout(Duration::from_secs(120), consumer)
            .await
            .expect("consumer finishes")
            .expect("consumer task");
        assert_eq!(received, sent, "task {task}: every page exactly once");
    }
    done.store(true, Ordering::Relaxed);
    watcher.join().expect("watcher");

    let peak = peak.load(Ordering::Relaxed);
    assert!(
        peak <= LIMIT,
        "memory peaked at {peak}, over the limit {LIMIT}"
    );
    let stats = daemon.stats();
    assert_eq!(stats["shards"].as_u64(), Some(SHARDS as u64), "{stats}");
    let high = stats["memory_high_water"].as_u64().expect("high water");
    assert!(high <= LIMIT, "{stats}");
    assert!(
        high >= LIMIT / 2,
        "memory never filled up ({high} bytes): the shards were not made to share it"
    );
    assert_eq!(
        stats["pages_enqueued"].as_u64(),
        Some(6 * 24),
        "the daemon's count sums the shards'"
    );
    assert!(
        shows_gauge(&daemon, "binx_shards", SHARDS),
        "no binx_shards gauge"
    );
    eprintln!("shards: peak memory {peak} of {LIMIT}, {busy} BUSY replies");
}

/// `runtime_threads` is what binxd's runtime really runs (its stats and
/// gauge read the runtime, not the setting), and 0 is one per core.
#[test]
fn the_runtime_runs_the_threads_it_is_given() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let env = |value: &str| vec![("BINX_RUNTIME_THREADS".to_string(), value.to_string())];
    for (args, env, threads) in [
        (&["--runtime-threads", "1"][..], vec![], 1),
        (&[][..], env("3"), 3),
        // 0 is one per core (and the flag wins over the environment).
        (&["--runtime-threads", "0"][..], env("3"), cores),
    ] {
        let daemon = Daemon::start_with_env(args, &env);
        let stats = daemon.stats();
        assert_eq!(
            stats["runtime_threads"].as_u64(),
            Some(threads as u64),
            "{args:?} {env:?}: {stats}"
        );
        assert!(
            shows_gauge(&daemon, "binx_runtime_threads", threads),
            "{args:?} {env:?}: no binx_runtime_threads {threads} gauge"
        );
        assert!(
            // The line's last field: 1 must not pass as 16.
            daemon.log_shows(&format!("runtime_threads={threads}\n")),
            "{args:?} {env:?}: {}",
            daemon.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_waiting_on_one_shard_gets_the_room_a_consumer_frees_on_another() {
    let daemon = Daemon::start(&[
        "--shards",
        "4",
        "--memory-limit",
        "1MiB",
        "--task-memory-limit",
        "1MiB",
    ]);
    let holder = "hold.0.0.0".to_string();
    let waiter = (0..)
        .map(|i| format!("wait.{i}.0.0"))
        .find(|t| shard_of(t, SHARDS) != shard_of(&holder, SHARDS))
        .expect("a task on another shard");
    let uds = daemon.connect_uds();
    for task in [&holder, &waiter] {
        uds.request(open(task), Vec::new())
            .await
            .expect("OPEN_TASK");
    }
    let big = Bytes::from(vec![7u8; 640 << 10]);
    let reply = uds
        .call(
            enqueue(&holder, vec![big.len() as u64], Duration::ZERO),
            vec![big],
        )
        .await
        .expect("ENQUEUE");
    assert_eq!(
        reply.header.status_kind(),
        Status::Ok,
        "{}",
        reply.header.error
    );

    // The other shard's ENQUEUE does not fit; it may wait 5 s.
    let other = daemon.connect_uds();
    let page = Bytes::from(vec![9u8; 512 << 10]);
    let waiting = tokio::spawn(async move {
        let reply = other
            .call(
                enqueue(&waiter, vec![page.len() as u64], Duration::from_secs(5)),
                vec![page],
            )
            .await
            .expect("ENQUEUE");
        (reply.header.status_kind(), reply.header.error.clone())
    });
    // It is held, waiting: its body and its one page's cost count as
    // pending (however long it takes to arrive on a loaded machine).
    let held = async {
        while daemon.stat("memory_pending") != (512 << 10) + binx_proto::ENQUEUE_PAGE_COST {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), held)
        .await
        .expect("the ENQUEUE waits for room");
    assert!(!waiting.is_finished(), "the ENQUEUE should wait for room");

    // The holder's consumer takes its page: its shard frees the room.
    let hash = consume(&daemon, holder.clone(), Duration::ZERO);
    let mut finish = BinRequest::new(MessageType::NoMorePages);
    finish.task_id = holder.clone();
    uds.request(finish, Vec::new())
        .await
        .expect("NO_MORE_PAGES");
    tokio::time::timeout(Duration::from_secs(30), hash)
        .await
        .expect("the holder's consumer finishes");
    let (status, error) = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiting ENQUEUE is answered")
        .expect("task");
    assert_eq!(status, Status::Ok, "{error}");
}
