//! A producer twice as fast as its consumer: the daemon's memory stays within
//! its limit (read from the daemon's own stats while the transfer runs), the
//! producer gets BUSY only after its ENQUEUE waited, a BUSY stores nothing,
//! and the consumer still gets every page exactly once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use binx_client::{ExchangeSource, SourceConfig};
use binx_proto::{BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;

use crate::common::{Daemon, StreamHash, rng};

const LIMIT: u64 = 2 << 20;
const PAGE: usize = 64 << 10;
const PAGES: usize = 200;
const ENQUEUE_WAIT: Duration = Duration::from_millis(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_producer_stays_within_the_memory_limit_and_gets_busy_only_after_waiting() {
    let daemon = Daemon::start(&["--memory-limit", "2MiB", "--task-memory-limit", "2MiB"]);

    // Watch the daemon's memory from its stats while the transfer runs.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (done, peak, http) = (done.clone(), peak.clone(), daemon.http.clone());
        std::thread::spawn(move || {
            let mut samples = 0u64;
            while !done.load(Ordering::Relaxed) {
                let (_, body) = crate::common::http_get(&http, "/v1/stats");
                let stats: serde_json::Value = serde_json::from_str(&body).expect("stats JSON");
                peak.fetch_max(
                    stats["memory_used"].as_u64().expect("memory_used"),
                    Ordering::Relaxed,
                );
                samples += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            samples
        })
    };

    let uds = daemon.connect_uds();
    let mut open = BinRequest::new(MessageType::OpenTask);
    open.task_id = "bp".into();
    open.buffer_kind = BufferKind::Partitioned as i32;
    open.buffer_count = 1;
    uds.request(open, Vec::new()).await.expect("OPEN_TASK");

    // Consumer: one page every 20 ms.
    let consumer = tokio::spawn({
        let connection = daemon.connect_tcp();
        async move {
            let budget = 128 << 10;
            let config = SourceConfig {
                memory_budget: budget,
                ..SourceConfig::default()
            };
            let mut source = ExchangeSource::new(connection, "bp", 0, config);
            let mut hash = StreamHash::default();
            while let Some(page) = source.next_page().await.expect("consumer") {
                // The source keeps within its budget (counting the page just taken).
                let held = source.buffered_bytes() + page.data.len() as u64;
                assert!(
                    held <= budget,
                    "the source held {held} bytes, over its budget"
                );
                hash.add(&page.data);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            hash.finish()
        }
    });

    // Producer: two pages every 20 ms, each ENQUEUE waiting at most 15 ms.
    let mut rng = rng(3);
    let mut sent = StreamHash::default();
    let (mut busy, mut ok) = (0u32, 0u32);
    for _ in 0..PAGES / 2 {
        let pages: Vec<Bytes> = (0..2)
            .map(|_| {
                let mut p = vec![0u8; PAGE];
                rng.fill(&mut p);
                Bytes::from(p)
            })
            .collect();
        for p in &pages {
            sent.add(p);
        }
        let mut request = BinRequest::new(MessageType::Enqueue);
        request.task_id = "bp".into();
        request.page_sizes = vec![PAGE as u64; 2];
        request.max_wait_micros = ENQUEUE_WAIT.as_micros() as u64;
        loop {
            let start = Instant::now();
            let reply = uds
                .call(request.clone(), pages.clone())
                .await
                .expect("ENQUEUE");
            let took = start.elapsed();
            match reply.header.status_kind() {
                Status::Ok => {
                    ok += 1;
                    break;
                }
                Status::Busy => {
                    busy += 1;
                    assert!(
                        took >= ENQUEUE_WAIT,
                        "BUSY after {took:?}, before the wait of {ENQUEUE_WAIT:?}"
                    );
                    assert!(
                        reply.header.error.contains("nothing was stored"),
                        "{}",
                        reply.header.error
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                other => panic!("ENQUEUE: {other:?} {}", reply.header.error),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut finish = BinRequest::new(MessageType::NoMorePages);
    finish.task_id = "bp".into();
    uds.request(finish, Vec::new())
        .await
        .expect("NO_MORE_PAGES");

    let received = tokio::time::timeout(Duration::from_secs(120), consumer)
        .await
        .expect("consumer finishes")
        .expect("consumer task");
    done.store(true, Ordering::Relaxed);
    let samples = watcher.join().expect("watcher");

    assert_eq!(
        received,
        sent.finish(),
        "the consumer got every page exactly once"
    );
    assert_eq!(ok as usize, PAGES / 2);
    assert!(
        busy > 0,
        "the producer was never pushed back: the test proved nothing"
    );
    let peak = peak.load(Ordering::Relaxed);
    assert!(
        peak <= LIMIT,
        "memory peaked at {peak} bytes, over the limit of {LIMIT}"
    );
    assert!(
        peak >= LIMIT / 2,
        "memory never filled up ({peak} bytes): the producer was not ahead"
    );
    let stats = daemon.stats();
    assert!(
        stats["memory_high_water"].as_u64().unwrap() <= LIMIT,
        "{stats}"
    );
    assert_eq!(stats["busy_replies"].as_u64().unwrap(), u64::from(busy));
    assert!(samples > 20, "only {samples} stats samples");
    eprintln!(
        "backpressure: {busy} BUSY replies, peak memory {peak} of {LIMIT}, {samples} samples"
    );
}
