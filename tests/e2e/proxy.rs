//! Proxy consumer (docs/PROTOCOL.md section 4, "Local-only requests and `remote`"): an engine that has only its local
//! sidecar's Unix socket reads a remote buffer through it.

use binx_client::{ClientError, Connection, ConnectionOptions, ExchangeSource, Page, SourceConfig};
use binx_proto::{BinRequest, MessageType, Status};
use bytes::Bytes;

use std::time::Duration;

use crate::common::{Daemon, metric, rng};

/// Reads a buffer to its end through `connection` (forwarded to `remote`
/// when set).
pub(crate) async fn read_all(
    connection: Connection,
    task: &str,
    buffer: u64,
    remote: Option<String>,
) -> Vec<Page> {
    let config = SourceConfig {
        memory_budget: 1 << 20,
        remote,
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(connection, task, buffer, config);
    let mut pages = Vec::new();
    while let Some(page) = source.next_page().await.expect("source") {
        pages.push(page);
    }
    pages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_through_the_local_socket_equals_reading_the_remote_directly() {
    let secret = ["--shared-secret", "cluster-secret"];
    let local = Daemon::start(&secret);
    let remote = Daemon::start(&secret);
    let producer = remote.producer("px", 2).await;
    let mut rng = rng(21);
    let sent: Vec<Bytes> = (0..300)
        .map(|_| {
            let mut p = vec![0u8; rng.usize(0..256 << 10)];
            rng.fill(&mut p);
            Bytes::from(p)
        })
        .collect();
    // The same pages in both buffers: one read directly, one through the proxy.
    producer.enqueue("px", 0, &sent).await.unwrap();
    producer.enqueue("px", 1, &sent).await.unwrap();
    producer.no_more_pages("px", None).await.unwrap();

    let direct = Connection::new(
        remote.tcp_endpoint(),
        ConnectionOptions {
            auth_token: Some("cluster-secret".into()),
            ..Default::default()
        },
    );
    let (direct_pages, proxied_pages) = tokio::join!(
        read_all(direct, "px", 0, None),
        read_all(local.connect_uds(), "px", 1, Some(remote.tcp.clone())),
    );
    assert_eq!(direct_pages.len(), sent.len());
    assert_eq!(
        proxied_pages, direct_pages,
        "same pages and tokens either way"
    );
    for (page, expected) in proxied_pages.iter().zip(&sent) {
        assert_eq!(&page.data, expected);
    }
    // The DELETE was forwarded too: the remote holds nothing; the local
    // sidecar kept no state of its own.
    let stats = remote.stats();
    assert_eq!(
        (stats["memory_used"].as_u64(), stats["tasks"].as_u64()),
        (Some(0), Some(0)),
        "{stats}"
    );
    assert_eq!(local.stat("tasks"), 0);
    assert!(
        local.stats()["requests"]["DATA OK"].as_u64().unwrap() > 0,
        "the local sidecar counted the forwarded DATA"
    );
}

/// Striping: a proxy consumer's requests to one remote go over
/// `forward_connections_per_remote` connections in turn, 2 by default, and
/// every page arrives once, in order, either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_requests_are_spread_over_the_configured_connections() {
    let remote = Daemon::start(&[]);
    let producer = remote.producer("stripes", 2).await;
    let sent: Vec<Bytes> = (0..24u8).map(|i| Bytes::from(vec![i; 200_000])).collect();
    producer.enqueue("stripes", 0, &sent).await.unwrap();
    producer.enqueue("stripes", 1, &sent).await.unwrap();
    producer.no_more_pages("stripes", None).await.unwrap();
    for (buffer, flags, expected) in [
        (0u64, &[][..], 2u64),
        (1, &["--forward-connections-per-remote", "1"][..], 1),
    ] {
        let local = Daemon::start(flags);
        let before = remote.stat("connections_total");
        // A 1 MiB budget: several DATA requests, then ACKs and a DELETE.
        let pages = read_all(
            local.connect_uds(),
            "stripes",
            buffer,
            Some(remote.tcp.clone()),
        )
        .await;
        let got: Vec<&Bytes> = pages.iter().map(|p| &p.data).collect();
        assert_eq!(got, sent.iter().collect::<Vec<_>>(), "flags {flags:?}");
        assert!(pages.iter().enumerate().all(|(i, p)| p.token == i as u64));
        assert_eq!(
            remote.stat("connections_total") - before,
            expected,
            "connections the forwarder opened with flags {flags:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_refusals_and_an_unreachable_remote() {
    let daemon = Daemon::start(&[]);
    let data = |remote: &str| {
        let mut r = BinRequest::new(MessageType::Data);
        r.task_id = "t".into();
        r.remote = remote.into();
        r
    };
    // Over TCP nobody may ask for forwarding.
    match daemon
        .connect_tcp()
        .request(data(&daemon.tcp), Vec::new())
        .await
    {
        Err(ClientError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, Status::BadRequest);
            assert!(
                message.contains("only local clients on the Unix socket"),
                "{message}"
            );
        }
        other => panic!("remote over TCP: {other:?}"),
    }
    let uds = daemon.connect_uds();
    // Only DATA, ACK and DELETE are forwarded.
    let mut enqueue = BinRequest::new(MessageType::Enqueue);
    enqueue.task_id = "t".into();
    enqueue.remote = daemon.tcp.clone();
    let err = uds
        .request(enqueue, Vec::new())
        .await
        .expect_err("ENQUEUE with remote");
    assert!(
        err.to_string().contains("only DATA, ACK and DELETE"),
        "{err}"
    );
    // A remote that does not answer: TIMEOUT naming it, which clients retry.
    let reply = uds.call(data("127.0.0.1:1"), Vec::new()).await.unwrap();
    assert_eq!(reply.header.status_kind(), Status::Timeout);
    assert!(
        reply
            .header
            .error
            .contains("no reply from remote 127.0.0.1:1"),
        "{}",
        reply.header.error
    );
    assert!(
        ClientError::Refused {
            endpoint: daemon.uds_endpoint(),
            request: "DATA".into(),
            status: Status::Timeout,
            message: String::new(),
        }
        .is_retryable()
    );

    // With forwarding switched off, the refusal says so.
    let off = Daemon::start(&["--forward-connections-per-remote", "0"]);
    let err = off
        .connect_uds()
        .request(data(&daemon.tcp), Vec::new())
        .await
        .expect_err("forwarding off");
    assert!(err.to_string().contains("does not forward"), "{err}");
}

/// A reader going through its local sidecar reads two pages of a remote
/// buffer; the remote's binxd is killed and restarted at the same address,
/// and a producer writes a task of the same id there again. The local
/// sidecar read the buffer from the earlier process (the instance its
/// HELLO named) and does not ask the new one: storage has no commit marker
/// of the buffer, so it refuses the read, where the old sidecar handed
/// page 2 of the second run to a reader with pages 0 and 1 of the first (a
/// buffer of two runs) and acknowledged the second run's pages 0 and 1.
/// The second run's buffer is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_reader_never_gets_pages_of_another_run_of_a_restarted_remote() {
    // Its storage is asked for a marker at most once a second.
    let local = Daemon::start(&["--spool-failover-after", "1s"]);
    let mut remote = Daemon::start(&[]);
    let run = |name: &str| -> Vec<Bytes> {
        (0..4)
            .map(|i| Bytes::from(format!("{name} page {i}")))
            .collect()
    };
    let task = "proxied.rerun";
    let first = run("first run");
    let producer = remote.producer(task, 1).await;
    producer.enqueue(task, 0, &first[..2]).await.unwrap();
    let config = SourceConfig {
        remote: Some(remote.tcp.clone()),
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(local.connect_uds(), task, 0, config.clone());
    for expected in &first[..2] {
        let page = source.next_page().await.expect("read").expect("a page");
        assert_eq!(&page.data, expected);
    }
    remote.signal("KILL");
    let restarted = Daemon::restart_of(&remote, &[]);
    let again = restarted.producer(task, 1).await;
    let second = run("second run");
    again.enqueue(task, 0, &second).await.unwrap();
    again.no_more_pages(task, None).await.unwrap();
    let refused = |what: &str, next: Result<Option<Page>, ClientError>| match next {
        Err(ClientError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, Status::ServerError, "{what}: {message}");
            assert!(
                message.contains("restarted")
                    && message.contains("never served")
                    && message.contains(&restarted.tcp),
                "{what}: {message}"
            );
        }
        other => panic!("{what} went on across the restart: {other:?}"),
    };
    let next = tokio::time::timeout(Duration::from_secs(60), source.next_page())
        .await
        .expect("the reader ends within a minute");
    refused("the proxy reader", next);
    // Until the buffer is deleted through it, the sidecar reads it from no
    // other process of the remote: a second reader is refused too (told to
    // retry until storage is asked again, a second later).
    let mut other = ExchangeSource::new(local.connect_uds(), task, 0, config);
    let next = tokio::time::timeout(Duration::from_secs(60), other.next_page())
        .await
        .expect("the second reader ends within a minute");
    refused("a second reader", next);
    let counted = metric(&local, "binx_forwarded_runs_refused_total");
    assert!((2..100).contains(&counted), "{counted}: retries back off");
    // Nothing was asked of the new process: its buffer is whole.
    let mut direct = ExchangeSource::new(restarted.connect_tcp(), task, 0, SourceConfig::default());
    for expected in &second {
        let page = direct.next_page().await.expect("read").expect("a page");
        assert_eq!(&page.data, expected);
    }
    assert!(direct.next_page().await.expect("read").is_none());
}
