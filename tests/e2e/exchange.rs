//! Two binxd processes; producers write through each daemon's Unix socket;
//! consumers read every buffer over TCP through `ExchangeSource`, via proxies
//! that cut connections at random. Every buffer must arrive exactly: same
//! pages, same order, nothing lost, nothing twice.

use std::time::Duration;

use binx_client::{
    ClientError, Connection, ConnectionOptions, Endpoint, ExchangeSource, Producer, SourceConfig,
    TaskSpec,
};
use bytes::Bytes;

use crate::chaos::{ChaosProxy, FreezingRelay};
use crate::common::{CuttingRelay, Daemon, StreamHash, TempDir, page_size, rng};

const BUFFERS: u64 = 8;

/// Writes `pages` pages of random sizes into `BUFFERS` buffers of `task`;
/// returns the hash of each buffer's stream.
async fn produce(
    uds: std::path::PathBuf,
    task: &str,
    pages: usize,
    seed: u64,
) -> Vec<(u64, u64, [u8; 32])> {
    let producer = Producer::unix(uds, ConnectionOptions::default());
    producer
        .open_task(task, &TaskSpec::partitioned(BUFFERS))
        .await
        .expect("OPEN_TASK");
    let mut rng = rng(seed);
    let mut hashes = vec![StreamHash::default(); BUFFERS as usize];
    let mut pending: Vec<Vec<Bytes>> = vec![Vec::new(); BUFFERS as usize];
    let mut pending_bytes = vec![0usize; BUFFERS as usize];
    for _ in 0..pages {
        let buffer = rng.usize(0..BUFFERS as usize);
        let mut page = vec![0u8; page_size(&mut rng)];
        rng.fill(&mut page);
        hashes[buffer].add(&page);
        pending_bytes[buffer] += page.len();
        pending[buffer].push(Bytes::from(page));
        if pending[buffer].len() >= 16 || pending_bytes[buffer] >= 2 << 20 {
            producer
                .enqueue(task, buffer as u64, &std::mem::take(&mut pending[buffer]))
                .await
                .expect("ENQUEUE");
            pending_bytes[buffer] = 0;
        }
    }
    for (buffer, batch) in pending.into_iter().enumerate() {
        producer
            .enqueue(task, buffer as u64, &batch)
            .await
            .expect("ENQUEUE");
    }
    producer
        .no_more_pages(task, None)
        .await
        .expect("NO_MORE_PAGES");
    hashes.into_iter().map(StreamHash::finish).collect()
}

/// Reads one buffer to its end; checks tokens run 0, 1, 2, ... without gaps.
async fn consume(connection: Connection, task: String, buffer: u64) -> (u64, u64, [u8; 32]) {
    let config = SourceConfig {
        memory_budget: 4 << 20,
        max_reply_size: 1 << 20,
        max_wait: Duration::from_secs(1),
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(connection, task.clone(), buffer, config);
    let mut hash = StreamHash::default();
    while let Some(page) = source
        .next_page()
        .await
        .unwrap_or_else(|e| panic!("buffer {buffer} of {task}: {e}"))
    {
        assert_eq!(
            page.token, hash.pages,
            "buffer {buffer} of {task}: token out of order"
        );
        hash.add(&page.data);
    }
    hash.finish()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_arrive_exactly_once_through_a_proxy_that_drops_connections() {
    let limits = ["--memory-limit", "96MiB", "--task-memory-limit", "64MiB"];
    let a = Daemon::start(&limits);
    let b = Daemon::start(&limits);
    let proxy_a = ChaosProxy::start(a.tcp.clone(), 11, 1 << 20, 24 << 20).await;
    let proxy_b = ChaosProxy::start(b.tcp.clone(), 12, 1 << 20, 24 << 20).await;
    // One multiplexed connection per remote, shared by all its consumers.
    let conn_a = Connection::new(
        Endpoint::Tcp(proxy_a.addr.clone()),
        ConnectionOptions::default(),
    );
    let conn_b = Connection::new(
        Endpoint::Tcp(proxy_b.addr.clone()),
        ConnectionOptions::default(),
    );

    let run = async {
        let producer_a = tokio::spawn(produce(a.uds.clone(), "query1.stage1", 10_000, 1));
        let producer_b = tokio::spawn(produce(b.uds.clone(), "query1.stage2", 2_000, 2));
        let mut consumers = Vec::new();
        for buffer in 0..BUFFERS {
            consumers.push(tokio::spawn(consume(
                conn_a.clone(),
                "query1.stage1".into(),
                buffer,
            )));
            consumers.push(tokio::spawn(consume(
                conn_b.clone(),
                "query1.stage2".into(),
                buffer,
            )));
        }
        let sent_a = producer_a.await.expect("producer a");
        let sent_b = producer_b.await.expect("producer b");
        let mut got = Vec::new();
        for c in consumers {
            got.push(c.await.expect("consumer"));
        }
        (sent_a, sent_b, got)
    };
    let (sent_a, sent_b, got) = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .unwrap_or_else(|_| panic!("exchange did not finish; daemon a log:\n{}", a.log()));

    let mut total_pages = 0;
    for buffer in 0..BUFFERS as usize {
        assert_eq!(got[2 * buffer], sent_a[buffer], "daemon a, buffer {buffer}");
        assert_eq!(
            got[2 * buffer + 1],
            sent_b[buffer],
            "daemon b, buffer {buffer}"
        );
        total_pages += sent_a[buffer].0 + sent_b[buffer].0;
    }
    assert_eq!(total_pages, 12_000);
    let kills = proxy_a.kills() + proxy_b.kills();
    assert!(
        kills >= 5,
        "the proxies cut only {kills} connections: the test proved little"
    );
    eprintln!("exchange finished with {kills} connections cut mid-stream");

    // Every consumer DELETEd its buffer: both daemons hold nothing. The
    // consumers pipelined their DATA (the default) through all of it.
    for daemon in [&a, &b] {
        let stats = daemon.stats();
        assert!(
            stats["data_pipelined"].as_u64().unwrap_or(0) > 0,
            "no DATA was pipelined: {stats}"
        );
        assert_eq!(stats["memory_used"], 0, "{stats}");
        assert_eq!(stats["tasks"], 0, "{stats}");
        assert!(stats["memory_high_water"].as_u64().unwrap() <= 96 << 20);
    }
}

/// A reader of a buffer whose binxd restarted after pages of it were read
/// fails, naming the restart, and never goes on with pages a producer wrote
/// to the new process under the same task id (another run of the task,
/// whose page 2 is not the first run's); nor does it acknowledge or delete
/// anything of that run (its requests go only to the process its pages
/// came from). Presto's and Trino's HTTP clients fail the same way, on the
/// changed task instance id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_binxd_restarted_mid_buffer_fails_rather_than_read_another_run() {
    // One socket with the default options (which say HELLO); and several
    // sockets, whose DATA go round them (each must name its run).
    let one = ConnectionOptions {
        stripes: 1,
        ..ConnectionOptions::default()
    };
    let striped = ConnectionOptions {
        stripes: 4,
        ..ConnectionOptions::default()
    };
    for (round, options) in [one, striped].into_iter().enumerate() {
        read_across_a_restart(&format!("rerun-{round}"), options).await;
    }
}

/// A path to the serving binxd that black-holes mid-buffer (a node gone
/// without a FIN, a network that drops every packet) leaves the reader's
/// socket open for many minutes. Once a DATA on it times out, the socket is
/// probed and given up, and the read goes on over a new socket: every page
/// exactly once, in order. (Before, each retry timed out on the dead
/// socket in turn until the error budget was spent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_path_black_holes_goes_on_over_a_new_socket() {
    let task = "blackhole.1";
    let daemon = Daemon::start(&[]);
    let relay = FreezingRelay::start(daemon.tcp.clone()).await;
    let pages: Vec<Bytes> = (0..8)
        .map(|i| Bytes::from(format!("page {i} ").repeat(100)))
        .collect();
    let producer = daemon.producer(task, 1).await;
    producer.enqueue(task, 0, &pages[..2]).await.unwrap();
    let connection = Connection::new(
        Endpoint::Tcp(relay.addr.clone()),
        ConnectionOptions {
            stripes: 1,
            request_timeout: Duration::from_secs(1),
            backoff: binx_client::BackoffConfig {
                min_delay: Duration::from_millis(50),
                max_delay: Duration::from_millis(200),
                // Many times what a timeout and its probe take, far less
                // than the dead socket would take to close by itself.
                max_error_duration: Duration::from_secs(20),
            },
            ..ConnectionOptions::default()
        },
    );
    let config = SourceConfig {
        max_wait: Duration::from_millis(500),
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(connection.clone(), task, 0, config);
    for expected in &pages[..2] {
        let page = source.next_page().await.expect("read").expect("a page");
        assert_eq!(&page.data, expected);
    }
    // The reader's next DATA is waiting at binxd, over the relay.
    relay.freeze();
    producer.enqueue(task, 0, &pages[2..]).await.unwrap();
    producer.no_more_pages(task, None).await.unwrap();
    let mut read = Vec::new();
    while let Some(page) = tokio::time::timeout(Duration::from_secs(60), source.next_page())
        .await
        .expect("the reader ends within a minute")
        .unwrap_or_else(|e| panic!("the read failed after the path black-holed: {e}"))
    {
        assert_eq!(page.token, 2 + read.len() as u64, "tokens in order");
        read.push(page.data);
    }
    assert_eq!(read, pages[2..], "every page after the freeze, once");
    assert_eq!(relay.accepted(), 2, "one new socket, after the dead one");
    assert_eq!(
        daemon.stat_when("tasks", |n| n == 0),
        0,
        "the buffer was read and deleted"
    );
}

/// Reads two pages of `task`, kills binxd, writes another run of `task` to
/// a binxd restarted on the same port, and checks the reader fails naming
/// the restart, having handed over none of the new run's pages, and left
/// the new run whole for its own readers.
async fn read_across_a_restart(task: &str, options: ConnectionOptions) {
    let mut daemon = Daemon::start(&[]);
    let run = |name: &str| -> Vec<Bytes> {
        (0..4)
            .map(|i| Bytes::from(format!("{name} page {i}")))
            .collect()
    };
    let first = run("first run");
    let producer = daemon.producer(task, 1).await;
    producer.enqueue(task, 0, &first[..2]).await.unwrap();
    let connection = Connection::new(daemon.tcp_endpoint(), options);
    let mut source = ExchangeSource::new(connection, task, 0, SourceConfig::default());
    for expected in &first[..2] {
        let page = source.next_page().await.expect("read").expect("a page");
        assert_eq!(&page.data, expected, "{task}");
    }
    daemon.signal("KILL");
    let restarted = Daemon::restart_of(&daemon, &[]);
    let again = restarted.producer(task, 1).await;
    again.enqueue(task, 0, &run("second run")).await.unwrap();
    again.no_more_pages(task, None).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(60), source.next_page())
        .await
        .expect("the reader ends within a minute");
    match next {
        Err(e @ ClientError::DaemonRestarted { .. }) => {
            let why = e.to_string();
            assert!(
                why.contains("restarted") && why.contains("below token 2"),
                "{task}: {why}"
            );
        }
        other => panic!("{task}: the reader went on across the restart: {other:?}"),
    }
    drop(source);
    let mut reader = ExchangeSource::new(restarted.connect_tcp(), task, 0, SourceConfig::default());
    let mut second = Vec::new();
    while let Some(page) = tokio::time::timeout(Duration::from_secs(30), reader.next_page())
        .await
        .expect("the second run is read within 30 s")
        .expect("the second run reads whole")
    {
        second.push(page.data);
    }
    assert_eq!(
        second,
        run("second run"),
        "{task}: the second run as written"
    );
}

/// A producer whose sidecar cannot be reached for a moment (its socket not
/// there yet, as while a pod's sidecar starts) retries the ENQUEUE, which
/// was never sent, and stores it once the sidecar answers: exactly once.
/// (It failed at once, "may or may not have been stored".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_that_could_not_connect_is_retried_and_stored_once() {
    let daemon = Daemon::start(&[]);
    let opened = daemon.producer("unreached", 1).await;
    let dir = TempDir::new("unreached");
    let path = dir.0.join("cutting.sock");
    let mut options = ConnectionOptions::default();
    options.backoff.max_error_duration = Duration::from_secs(30);
    let producer = Producer::new(Connection::new(Endpoint::Unix(path.clone()), options));
    let pages: Vec<Bytes> = (0..3).map(|i| Bytes::from(format!("page {i}"))).collect();
    let sent = pages.clone();
    let enqueue = tokio::spawn(async move { producer.enqueue("unreached", 0, &sent).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!enqueue.is_finished(), "the ENQUEUE waits for the sidecar");
    let relay = CuttingRelay::start(&dir.0, &daemon.uds, usize::MAX);
    assert_eq!(relay.path, path);
    enqueue
        .await
        .expect("joined")
        .expect("stored once the sidecar answers");
    opened.no_more_pages("unreached", None).await.unwrap();
    let mut source = ExchangeSource::new(
        daemon.connect_tcp(),
        "unreached",
        0,
        SourceConfig::default(),
    );
    for expected in &pages {
        let page = source.next_page().await.expect("read").expect("a page");
        assert_eq!(&page.data, expected);
    }
    assert!(
        source.next_page().await.expect("read").is_none(),
        "no page twice"
    );
}

/// An abort whose reason is longer than binxd keeps (an engine passes a
/// stack trace) is still sent: the reason is cut at a character's end to
/// what binxd keeps, and the task's readers see it. (The request's header
/// passed its limit, and the abort was never sent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_with_a_stack_trace_for_a_reason_aborts_the_task() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("traced", 1).await;
    producer
        .enqueue("traced", 0, &[Bytes::from_static(b"p")])
        .await
        .unwrap();
    let reason = format!("worker lost: {}", "at Frame.é(Frame.java:1)\n".repeat(3000));
    assert!(reason.len() > 70_000);
    producer.abort("traced", &reason).await.expect("aborted");
    let mut source =
        ExchangeSource::new(daemon.connect_tcp(), "traced", 0, SourceConfig::default());
    let failed = loop {
        match source.next_page().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("an aborted task read to its end"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(failed.contains("worker lost: at Frame.é"), "{failed}");
}
