//! SIGTERM drains: readiness goes false, new tasks are refused, consumers
//! still get every held page, then binxd stops by itself; the grace period
//! bounds the wait.

use std::time::Duration;

use binx_client::{ExchangeSource, SourceConfig, TaskSpec};
use binx_proto::Status;
use bytes::Bytes;

use crate::common::{Daemon, StreamHash, http_get, rng};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_held_pages_to_consumers_then_stops() {
    let mut daemon = Daemon::start(&["--drain-grace", "60s"]);
    let producer = daemon.producer("drain", 1).await;
    let mut rng = rng(8);
    let mut sent = StreamHash::default();
    let pages: Vec<Bytes> = (0..50)
        .map(|_| {
            let mut p = vec![0u8; rng.usize(1..64 << 10)];
            rng.fill(&mut p);
            sent.add(&p);
            Bytes::from(p)
        })
        .collect();
    producer.enqueue("drain", 0, &pages).await.unwrap();
    producer.no_more_pages("drain", None).await.unwrap();

    daemon.send_signal("TERM");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while http_get(&daemon.http, "/readyz").0 != 503 {
        assert!(
            std::time::Instant::now() < deadline,
            "readiness never went false"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // No new task, but the daemon is still up with the pages.
    let err = producer
        .open_task("new", &TaskSpec::partitioned(1))
        .await
        .expect_err("a new task while draining");
    assert_eq!(err.status(), Some(Status::ServerError));
    assert!(err.to_string().contains("draining"), "{err}");
    assert!(daemon.alive());

    let mut source = ExchangeSource::new(daemon.connect_tcp(), "drain", 0, SourceConfig::default());
    let mut got = StreamHash::default();
    while let Some(page) = source.next_page().await.expect("reading while draining") {
        got.add(&page.data);
    }
    assert_eq!(
        got.finish(),
        sent.finish(),
        "every held page was served during the drain"
    );
    let status = daemon.wait_exit(Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    assert!(
        daemon
            .log()
            .contains("drained: every held page was consumed"),
        "{}",
        daemon.log()
    );
    assert!(!daemon.uds.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grace_period_bounds_a_drain_nobody_reads() {
    let mut daemon = Daemon::start(&["--drain-grace", "500ms"]);
    let producer = daemon.producer("stuck", 1).await;
    producer
        .enqueue("stuck", 0, &[Bytes::from_static(b"never read")])
        .await
        .unwrap();
    daemon.send_signal("TERM");
    let status = daemon.wait_exit(Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    assert!(
        daemon
            .log()
            .contains("drain grace of 500ms ended with 1 pages held"),
        "{}",
        daemon.log()
    );
}
