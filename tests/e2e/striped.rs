//! binx-client's striped connections against a real binxd: one connection
//! spreads the DATA of its consumers over several TCP sockets, pipelined
//! DATA of one buffer reaching binxd over different sockets (so in any
//! order) still gives every page once, in order, and the sockets are the
//! ones binxd counts.

use binx_client::{Connection, ConnectionOptions, ExchangeSource, SourceConfig};
use bytes::Bytes;

use crate::common::Daemon;

const BUFFERS: u64 = 6;
const PAGES: u64 = 150;

/// Page `token` of `buffer`: its size (1 B to 40 KiB) and bytes say which.
fn page(buffer: u64, token: u64) -> Bytes {
    let size = ((buffer * 7_919 + token * 104_729) % 40_000 + 1) as usize;
    (0..size)
        .map(|i| (i as u64 ^ token.wrapping_mul(31) ^ buffer.wrapping_mul(131)) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_over_four_sockets_reads_every_buffer_exactly() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("striped", BUFFERS).await;
    for buffer in 0..BUFFERS {
        let pages: Vec<Bytes> = (0..PAGES).map(|t| page(buffer, t)).collect();
        for batch in pages.chunks(25) {
            producer.enqueue("striped", buffer, batch).await.unwrap();
        }
    }
    producer.no_more_pages("striped", None).await.unwrap();

    let before = daemon.stat("connections_total");
    let connection = Connection::new(
        daemon.tcp_endpoint(),
        ConnectionOptions {
            stripes: 4,
            ..ConnectionOptions::default()
        },
    );
    // A small budget and small replies: each buffer takes dozens of DATA,
    // up to four in flight at once.
    let config = SourceConfig {
        memory_budget: 256 << 10,
        max_reply_size: 48 << 10,
        pipeline_depth: 4,
        ..SourceConfig::default()
    };
    let reads = (0..BUFFERS).map(|buffer| {
        let mut source = ExchangeSource::new(connection.clone(), "striped", buffer, config.clone());
        async move {
            let mut token = 0;
            while let Some(got) = source.next_page().await.unwrap() {
                assert_eq!(got.token, token, "buffer {buffer}");
                assert!(
                    got.data == page(buffer, token),
                    "page {token} of buffer {buffer}"
                );
                token += 1;
            }
            token
        }
    });
    let counts = futures_util::future::join_all(reads).await;
    assert_eq!(counts, vec![PAGES; BUFFERS as usize]);
    assert_eq!(connection.open_stripes(), 4);
    assert_eq!(
        daemon.stat("connections_total") - before,
        4,
        "binxd accepted one connection per stripe"
    );
    let stats = daemon.stats();
    assert!(
        stats["requests"]["DATA OK"].as_u64().unwrap() >= BUFFERS * 10,
        "{stats}"
    );
    // Every buffer was read to its end and deleted.
    assert_eq!(
        (stats["tasks"].as_u64(), stats["memory_used"].as_u64()),
        (Some(0), Some(0)),
        "{stats}"
    );
}

/// With the cluster's shared secret, binxd refuses every request on a TCP
/// connection that did not say HELLO with it first. Each socket of a
/// striped connection says its own HELLO, before any request of the
/// callers that opened it at once (it is used only once HELLO was
/// answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_socket_of_a_striped_connection_says_hello_with_the_secret() {
    let daemon = Daemon::start(&["--shared-secret", "stripes-secret"]);
    let producer = daemon.producer("hello-first", 1).await;
    producer
        .enqueue("hello-first", 0, &[Bytes::from_static(b"page")])
        .await
        .unwrap();
    for round in 0..5 {
        let connection = Connection::new(
            daemon.tcp_endpoint(),
            ConnectionOptions {
                stripes: 4,
                auth_token: Some("stripes-secret".into()),
                ..ConnectionOptions::default()
            },
        );
        let sizes = (0..32).map(|_| {
            let connection = connection.clone();
            async move {
                let mut data = binx_proto::BinRequest::new(binx_proto::MessageType::Data);
                data.task_id = "hello-first".into();
                data.get_data_size = true;
                connection.request(data, Vec::new()).await
            }
        });
        for reply in futures_util::future::join_all(sizes).await {
            let reply = reply.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(reply.header.remaining_bytes, vec![4], "round {round}");
        }
        assert_eq!(connection.open_stripes(), 4);
    }
}

/// A daemon at its connection limit admits fewer sockets than a
/// connection's stripes. The sockets it refuses (BUSY, at their HELLO) send
/// their requests over the first socket instead, so the consumers whose
/// DELETEs (and ACKs) hash to a refused socket still go through, and every
/// buffer reads exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripes_refused_at_the_connection_limit_send_over_the_first_socket() {
    // The producer's Unix socket takes one slot, the striped TCP
    // connection gets the other two.
    let daemon = Daemon::start(&["--max-connections", "3"]);
    // Daemon::start's readiness probes hold a slot until binxd sees them
    // close: start with every slot free.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while daemon.stat("connections_open") > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the probes never closed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let refused_before = daemon.stat("connections_refused");
    let connection = Connection::new(
        daemon.tcp_endpoint(),
        ConnectionOptions {
            stripes: 4,
            ..ConnectionOptions::default()
        },
    );
    let tasks: Vec<String> = (0..8).map(|t| format!("capped-{t}")).collect();
    let work = async {
        let producer = binx_client::Producer::new(daemon.connect_uds());
        for (t, task) in tasks.iter().enumerate() {
            producer
                .open_task(task, &binx_client::TaskSpec::partitioned(1))
                .await
                .unwrap_or_else(|e| panic!("OPEN_TASK {task}: {e}"));
            let pages: Vec<Bytes> = (0..20).map(|token| page(t as u64, token)).collect();
            for batch in pages.chunks(10) {
                producer
                    .enqueue(task, 0, batch)
                    .await
                    .unwrap_or_else(|e| panic!("ENQUEUE {task}: {e}"));
            }
            producer
                .no_more_pages(task, None)
                .await
                .unwrap_or_else(|e| panic!("NO_MORE_PAGES {task}: {e}"));
        }
        let reads = tasks.iter().enumerate().map(|(t, task)| {
            let mut source = ExchangeSource::new(
                connection.clone(),
                task.as_str(),
                0,
                SourceConfig::default(),
            );
            async move {
                let mut token = 0;
                while let Some(got) = source
                    .next_page()
                    .await
                    .unwrap_or_else(|e| panic!("{task}: {e}"))
                {
                    assert!(got.data == page(t as u64, token), "page {token} of {task}");
                    token += 1;
                }
                token
            }
        });
        futures_util::future::join_all(reads).await
    };
    let counts = tokio::time::timeout(std::time::Duration::from_secs(60), work)
        .await
        .expect("every task written and read within a minute");
    assert_eq!(counts, vec![20; tasks.len()]);
    assert_eq!(connection.open_stripes(), 2, "binxd admits two sockets");
    assert!(
        daemon.stat("connections_refused") - refused_before >= 2,
        "the other two were refused"
    );
    let stats = daemon.stats();
    assert_eq!(
        (stats["tasks"].as_u64(), stats["memory_used"].as_u64()),
        (Some(0), Some(0)),
        "every buffer was read to its end and deleted: {stats}"
    );
}
