//! Every metric the daemon promises appears in /metrics and moves when its
//! event happens.

use std::time::{Duration, Instant};

use binx_proto::{BinRequest, MessageType, Status};
use bytes::Bytes;

use crate::common::{Daemon, http_get, metric};

/// Waits up to 5 s for `check` to hold on a fresh scrape.
fn eventually(daemon: &Daemon, what: &str, check: impl Fn(&Daemon) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !check(daemon) {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen:\n{}",
            http_get(&daemon.http, "/metrics").1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_appears_and_moves_with_its_event() {
    let daemon = Daemon::start(&["--memory-limit", "1MiB", "--task-memory-limit", "1MiB"]);
    let (_, text) = http_get(&daemon.http, "/metrics");
    // binx_requests_total has a series per (type, status) that occurred:
    // none before the first request; it is checked after the PING below.
    for name in [
        "binx_received_bytes_total",
        "binx_sent_bytes_total",
        "binx_enqueued_bytes_total",
        "binx_served_bytes_total",
        "binx_pages_buffered",
        "binx_memory_used_bytes",
        "binx_memory_pages_bytes",
        "binx_memory_pending_bytes",
        "binx_memory_limit_bytes",
        "binx_long_polls_waiting",
        "binx_connections_open",
        "binx_backpressure_waits_total",
        "binx_busy_replies_total",
        "binx_errors_total",
        "binx_protocol_errors_total",
    ] {
        assert!(
            text.lines().any(|l| l
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))),
            "{name} missing from /metrics:\n{text}"
        );
    }
    assert_eq!(metric(&daemon, "binx_memory_limit_bytes"), 1 << 20);

    // Connections, requests by type and status, bytes in and out.
    // The readiness probes of Daemon::start opened and dropped connections;
    // wait until the daemon has seen them close.
    eventually(&daemon, "the readiness probes closing", |d| {
        metric(d, "binx_connections_open") == 0
    });
    let consumer = daemon.connect_tcp();
    consumer.ping().await.unwrap();
    // A probe connection accepted late may still be counted for a moment;
    // once it is gone, only the consumer's is open.
    eventually(&daemon, "the consumer's connection counted", |d| {
        metric(d, "binx_connections_open") == 1
    });
    assert_eq!(
        metric(&daemon, "binx_requests_total{type=\"PING\",status=\"OK\"}"),
        1
    );
    // Sent bytes are counted once the write returns: maybe after the reply
    // was read.
    eventually(&daemon, "the PING reply counted as sent", |d| {
        metric(d, "binx_sent_bytes_total") > 0
    });
    let received = metric(&daemon, "binx_received_bytes_total");
    assert!(received > 0);

    // Pages buffered and memory used.
    let producer = daemon.producer("m", 2).await;
    producer
        .enqueue("m", 0, &[Bytes::from(vec![1u8; 512 << 10])])
        .await
        .unwrap();
    assert_eq!(metric(&daemon, "binx_pages_buffered"), 1);
    assert_eq!(metric(&daemon, "binx_memory_pages_bytes"), 512 << 10);
    assert!(metric(&daemon, "binx_memory_used_bytes") >= 512 << 10);
    assert!(metric(&daemon, "binx_received_bytes_total") >= received + (512 << 10));

    // A long-poll waiting.
    let poller = consumer.clone();
    let poll = tokio::spawn(async move {
        let mut r = BinRequest::new(MessageType::Data);
        r.task_id = "m".into();
        r.buffer_id = 1;
        r.max_wait_micros = 3_000_000;
        poller.request(r, Vec::new()).await
    });
    eventually(&daemon, "a long-poll waiting", |d| {
        metric(d, "binx_long_polls_waiting") == 1
    });

    // Backpressure: an ENQUEUE that waits for room, then gets BUSY.
    let uds = daemon.connect_uds();
    let mut enqueue = BinRequest::new(MessageType::Enqueue);
    enqueue.task_id = "m".into();
    enqueue.page_sizes = vec![768 << 10];
    enqueue.max_wait_micros = 100_000;
    let reply = uds
        .call(enqueue, vec![Bytes::from(vec![2u8; 768 << 10])])
        .await
        .unwrap();
    assert_eq!(reply.header.status_kind(), Status::Busy);
    assert_eq!(metric(&daemon, "binx_backpressure_waits_total"), 1);
    assert_eq!(metric(&daemon, "binx_busy_replies_total"), 1);

    // Errors: a refused request.
    let errors = metric(&daemon, "binx_errors_total");
    let mut bad = BinRequest::new(MessageType::Data);
    bad.task_id = "m".into();
    bad.page_token = 99;
    assert!(consumer.request(bad, Vec::new()).await.is_err());
    assert_eq!(metric(&daemon, "binx_errors_total"), errors + 1);
    assert_eq!(
        metric(
            &daemon,
            "binx_requests_total{type=\"DATA\",status=\"BAD_REQUEST\"}"
        ),
        1
    );

    // Serving the page moves bytes out; deleting frees memory.
    let served = metric(&daemon, "binx_sent_bytes_total");
    let mut data = BinRequest::new(MessageType::Data);
    data.task_id = "m".into();
    consumer.request(data, Vec::new()).await.unwrap();
    // The writer counts a reply's bytes once its write returns, which can
    // be just after the client has read them.
    eventually(&daemon, "the reply's bytes counted as sent", |d| {
        metric(d, "binx_sent_bytes_total") >= served + (512 << 10)
    });
    assert_eq!(metric(&daemon, "binx_served_bytes_total"), 512 << 10);
    let mut delete = BinRequest::new(MessageType::Delete);
    delete.task_id = "m".into();
    consumer.request(delete, Vec::new()).await.unwrap();
    assert_eq!(metric(&daemon, "binx_memory_used_bytes"), 0);
    assert_eq!(metric(&daemon, "binx_pages_buffered"), 0);

    producer
        .enqueue("m", 1, &[Bytes::from_static(b"wake")])
        .await
        .unwrap();
    poll.await.unwrap().unwrap();
    eventually(&daemon, "the long-poll finishing", |d| {
        metric(d, "binx_long_polls_waiting") == 0
    });
    let open = metric(&daemon, "binx_connections_open");
    consumer.disconnect();
    eventually(&daemon, "the connection closing", |d| {
        metric(d, "binx_connections_open") == open - 1
    });
}

/// /metrics as Prometheus itself reads it: the prometheus_client Python
/// package's OpenMetrics parser (installed by
/// scripts/ensure-prometheus-parser.sh), which checks `# UNIT` against the
/// names, histogram buckets, `_total` and `# EOF`, accepts the whole
/// exposition after traffic has made every labelled series appear, and
/// reads each family with the type and unit binx declares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_parser_reads_the_exposition() {
    use std::io::Write as _;
    let daemon = Daemon::start(&["--shared-secret", "scrape-me"]);
    let producer = daemon.producer("prom", 1).await;
    producer
        .enqueue("prom", 0, &[Bytes::from_static(b"page")])
        .await
        .unwrap();
    producer.no_more_pages("prom", None).await.unwrap();
    // An unauthenticated HTTP request, so its counter is not zero.
    let refused =
        crate::common::http_request(&daemon.http, "GET", "/v1/task/prom/results/0/0", &[]);
    assert_eq!(refused.status, 401);
    // Two request types outside the protocol (7 and 100): one UNKNOWN
    // series counts both, never two series with the same labels.
    let local = daemon.connect_uds();
    for kind in [7, 100] {
        let mut r = BinRequest::new(MessageType::Ping);
        r.r#type = kind;
        assert!(local.request(r, Vec::new()).await.is_err());
    }
    let response = crate::common::http_request(&daemon.http, "GET", "/metrics", &[]);
    assert_eq!(response.status, 200);
    assert!(
        response
            .header("content-type")
            .starts_with("application/openmetrics-text; version=1.0.0"),
        "{}",
        response.header("content-type")
    );
    let text = String::from_utf8(response.body).expect("UTF-8 exposition");

    let parser = crate::common::ensure_tool("ensure-prometheus-parser.sh");
    let mut child = std::process::Command::new(parser)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the parser runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    // name, type, unit ("-" for none), samples
    let families: Vec<(String, String, String, usize)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let mut f = l.split_whitespace();
            let name = f.next().unwrap().to_string();
            let kind = f.next().unwrap().to_string();
            let unit = f.next().unwrap().to_string();
            let samples = f.next().unwrap().parse().unwrap();
            (name, kind, unit, samples)
        })
        .collect();
    // Every family binx writes a TYPE for is read back, with that type.
    let declared: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split_once(' ').unwrap())
        .collect();
    assert_eq!(families.len(), declared.len(), "{families:?}");
    for (name, kind) in declared {
        let found = families
            .iter()
            .find(|(n, ..)| n == name)
            .unwrap_or_else(|| panic!("{name} not read back: {families:?}"));
        assert_eq!(found.1, kind, "{name}");
        assert!(found.3 >= 1, "{name} has no sample");
    }
    let family = |name: &str| {
        families
            .iter()
            .find(|(n, ..)| n == name)
            .map(|(_, kind, unit, samples)| (kind.as_str(), unit.as_str(), *samples))
            .unwrap_or_else(|| panic!("no family {name}: {families:?}"))
    };
    // Units are declared and in the names, as Prometheus conventions ask.
    assert_eq!(family("binx_memory_used_bytes").0, "gauge");
    assert_eq!(family("binx_memory_used_bytes").1, "bytes");
    assert_eq!(family("binx_enqueued_bytes").0, "counter");
    assert_eq!(family("binx_enqueued_bytes").1, "bytes");
    assert_eq!(family("binx_http_unauthenticated").0, "counter");
    // Histograms of request latency and reply size, by request type: the
    // ENQUEUE and NO_MORE_PAGES above were timed.
    let (kind, unit, samples) = family("binx_request_duration_seconds");
    assert_eq!((kind, unit), ("histogram", "seconds"));
    assert!(samples > 10, "buckets, sum and count: {samples}");
    let (kind, unit, _) = family("binx_reply_body_bytes");
    assert_eq!((kind, unit), ("histogram", "bytes"));
    assert!(
        text.contains("binx_request_duration_seconds_count{type=\"ENQUEUE\"} "),
        "{text}"
    );
    let unknown: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("binx_requests_total{type=\"UNKNOWN\",status=\"BAD_REQUEST\"}"))
        .collect();
    assert_eq!(unknown.len(), 1, "{text}");
    assert!(unknown[0].ends_with(" 2"), "{}", unknown[0]);
}

/// deploy/helm/binx/dashboards/binx-dashboard.json reads only metrics a live binxd
/// exposes, and shows every family it exposes (deploy/grafana/check.py,
/// run against a real scrape after traffic); a misspelt name fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grafana_dashboard_reads_exactly_what_binxd_exposes() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("dash", 1).await;
    producer
        .enqueue("dash", 0, &[Bytes::from_static(b"page")])
        .await
        .unwrap();
    producer.no_more_pages("dash", None).await.unwrap();
    let local = daemon.connect_uds();
    let mut data = BinRequest::new(MessageType::Data);
    data.task_id = "dash".into();
    let reply = local.request(data, Vec::new()).await.unwrap();
    assert_eq!(reply.header.status_kind(), Status::Ok);
    let (status, exposition) = http_get(&daemon.http, "/metrics");
    assert_eq!(status, 200);

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let check = root.join("deploy/grafana/check.py");
    let dashboard = root.join("deploy/helm/binx/dashboards/binx-dashboard.json");
    let dir = std::env::temp_dir().join(format!("binx-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let scrape = dir.join("metrics.txt");
    std::fs::write(&scrape, &exposition).unwrap();
    let run = |dashboard: &std::path::Path| {
        std::process::Command::new("python3")
            .arg(&check)
            .arg("--unused")
            .arg(dashboard)
            .arg(&scrape)
            .output()
            .expect("python3 runs deploy/grafana/check.py")
    };
    let out = run(&dashboard);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains("not on the dashboard"),
        "a metric binxd exposes has no panel:\n{stdout}"
    );

    // The check can fail: the same dashboard with one name misspelt.
    let json = std::fs::read_to_string(&dashboard).unwrap();
    assert!(json.contains("binx_memory_used_bytes"));
    let typo = dir.join("typo.json");
    std::fs::write(
        &typo,
        json.replace("binx_memory_used_bytes", "binx_memory_usde_bytes"),
    )
    .unwrap();
    let out = run(&typo);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("binx_memory_usde_bytes"));
    let _ = std::fs::remove_dir_all(&dir);
}
