//! Long-polls: a waiting DATA returns as soon as a page arrives, NO_DATA comes
//! after the max wait (capped by the daemon), a consumer may start before its
//! producer, and a waiting request never delays others on its connection.

use std::time::{Duration, Instant};

use binx_proto::{BinRequest, MessageType, Status};
use bytes::Bytes;

use crate::common::Daemon;

fn data(task: &str, buffer: u64, token: u64, wait: Duration) -> BinRequest {
    let mut r = BinRequest::new(MessageType::Data);
    r.task_id = task.into();
    r.buffer_id = buffer;
    r.page_token = token;
    r.max_wait_micros = wait.as_micros() as u64;
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_returns_when_a_page_arrives_and_never_blocks_the_connection() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("lp", 2).await;
    let consumer = daemon.connect_tcp();

    let started = Instant::now();
    let poll = tokio::spawn({
        let consumer = consumer.clone();
        async move {
            let reply = consumer
                .request(data("lp", 0, 0, Duration::from_secs(8)), Vec::new())
                .await;
            (reply, started.elapsed())
        }
    });
    // While the long-poll waits, other requests on the same connection are
    // answered: a PING, and a DATA for another buffer that has a page.
    tokio::time::sleep(Duration::from_millis(200)).await;
    producer
        .enqueue("lp", 1, &[Bytes::from_static(b"other")])
        .await
        .unwrap();
    consumer.ping().await.unwrap();
    let other = consumer
        .request(data("lp", 1, 0, Duration::ZERO), Vec::new())
        .await
        .unwrap();
    assert_eq!(&other.body[..], b"other");
    assert!(
        !poll.is_finished(),
        "the long-poll returned before any page for it arrived"
    );

    producer
        .enqueue("lp", 0, &[Bytes::from_static(b"late page")])
        .await
        .unwrap();
    let (reply, elapsed) = poll.await.unwrap();
    let reply = reply.unwrap();
    assert_eq!(reply.header.status_kind(), Status::Ok);
    assert_eq!(&reply.body[..], b"late page");
    assert!(elapsed >= Duration::from_millis(200), "{elapsed:?}");
    assert!(
        elapsed < Duration::from_secs(8),
        "the reply waited for the max wait: {elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_data_after_the_max_wait_which_the_daemon_caps() {
    let daemon = Daemon::start(&["--max-wait", "1s"]);
    daemon.producer("idle", 1).await;
    let consumer = daemon.connect_tcp();

    let start = Instant::now();
    let reply = consumer
        .request(data("idle", 0, 0, Duration::from_millis(300)), Vec::new())
        .await
        .unwrap();
    let waited = start.elapsed();
    assert_eq!(reply.header.status_kind(), Status::NoData);
    assert_eq!(reply.header.page_next_token, 0);
    assert!(waited >= Duration::from_millis(300), "{waited:?}");

    // Asking for a minute gets the daemon's cap of one second.
    let start = Instant::now();
    let reply = consumer
        .request(data("idle", 0, 0, Duration::from_secs(60)), Vec::new())
        .await
        .unwrap();
    let waited = start.elapsed();
    assert_eq!(reply.header.status_kind(), Status::NoData);
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(30),
        "{waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_may_start_before_its_producer() {
    let daemon = Daemon::start(&[]);
    let consumer = daemon.connect_tcp();
    let poll = tokio::spawn(async move {
        consumer
            .request(data("early", 0, 0, Duration::from_secs(8)), Vec::new())
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!poll.is_finished());
    let producer = daemon.producer("early", 1).await;
    producer
        .enqueue("early", 0, &[Bytes::from_static(b"first")])
        .await
        .unwrap();
    let reply = poll.await.unwrap().unwrap();
    assert_eq!(&reply.body[..], b"first");
}
