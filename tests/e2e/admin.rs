//! The admin gRPC service, used as an operator would: through the `binx`
//! CLI over the admin Unix socket (tasks, stats, log level, abort, drain),
//! and over the optional TCP port with its bearer token.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use binx_admin::AdminClient;
use binx_client::{ExchangeSource, SourceConfig};
use binx_proto::{BinRequest, MessageType, Status};
use bytes::Bytes;

use crate::common::{Daemon, binx, http_get, stderr, stdout};

fn admin_socket(daemon: &Daemon) -> std::path::PathBuf {
    daemon.uds.with_file_name("binx-admin.sock")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_lists_tasks_reads_stats_changes_log_level_and_aborts() {
    let daemon = Daemon::start(&[]);
    let mode = std::fs::metadata(admin_socket(&daemon))
        .expect("the admin socket exists beside binx.sock")
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o777,
        0o600,
        "only the owner may use the admin socket"
    );

    let producer = daemon.producer("adm.q1", 2).await;
    let pages = [Bytes::from(vec![1u8; 1000]), Bytes::from(vec![2u8; 500])];
    producer.enqueue("adm.q1", 0, &pages).await.unwrap();
    producer.enqueue("adm.q1", 1, &pages[..1]).await.unwrap();
    producer.no_more_pages("adm.q1", Some(1)).await.unwrap();
    let other = daemon.producer("other", 1).await;
    other.enqueue("other", 0, &pages[1..]).await.unwrap();
    // A consumer acknowledges the first page of buffer 0.
    let consumer = daemon.connect_tcp();
    let request = |kind: MessageType, token: u64| {
        let mut r = BinRequest::new(kind);
        r.task_id = "adm.q1".into();
        r.page_token = token;
        r
    };
    let reply = consumer
        .call(request(MessageType::Ack, 1), Vec::new())
        .await
        .unwrap();
    assert_eq!(
        reply.header.status_kind(),
        Status::Ok,
        "{}",
        reply.header.error
    );

    let out = binx(&daemon, &["tasks", "--prefix", "adm."]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with("adm.q1  PARTITIONED  buffers 2 (2)"),
        "{text}"
    );
    assert!(!text.contains("other"), "the prefix filters: {text}");
    let buffer_line = |id: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(&format!("buffer {id} ")))
            .unwrap_or_else(|| panic!("no line for buffer {id}: {text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(
        buffer_line("0").starts_with("buffer 0 open acked 1 next 2 pages 1 500 B"),
        "{text}"
    );
    assert!(
        buffer_line("1").starts_with("buffer 1 finished acked 0 next 1 pages 1 1000 B"),
        "{text}"
    );

    let out = binx(&daemon, &["stats"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let http = daemon.stats();
    for key in ["pages_enqueued", "bytes_enqueued", "tasks"] {
        let line = format!("{key:<30} {}", http[key]);
        assert!(text.contains(&line), "{line:?} not in:\n{text}");
    }
    assert!(text.contains("ENQUEUE OK"), "{text}");

    // Log level: nothing at DEBUG until it is switched on, then it shows.
    assert!(!daemon.log().contains(" DEBUG "), "{}", daemon.log());
    let out = binx(&daemon, &["log-level", "debug"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("(was \"info\")"), "{}", stdout(&out));
    binx(&daemon, &["tasks"]);
    assert!(
        daemon.log_shows(" DEBUG "),
        "no DEBUG line after log-level debug"
    );
    let out = binx(&daemon, &["log-level", "info,[bad"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not a valid log filter"),
        "{}",
        stderr(&out)
    );

    // Abort: an unknown task is an error; a real one frees its memory and
    // its consumers see the reason.
    let out = binx(&daemon, &["abort", "--task", "adm.nope"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("task adm.nope is not open on this daemon"),
        "{}",
        stderr(&out)
    );
    let before = daemon.stat("page_bytes_held");
    let out = binx(
        &daemon,
        &["abort", "--task", "adm.q1", "--reason", "query cancelled"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("aborted task adm.q1"),
        "{}",
        stdout(&out)
    );
    assert_eq!(daemon.stat("page_bytes_held"), before - 1500);
    let reply = consumer
        .call(request(MessageType::Data, 1), Vec::new())
        .await
        .unwrap();
    assert_eq!(reply.header.status_kind(), Status::ServerError);
    assert!(
        reply.header.error.contains("query cancelled"),
        "{}",
        reply.header.error
    );
    let out = binx(&daemon, &["tasks"]);
    let text = stdout(&out);
    assert!(!text.contains("adm.q1") && text.contains("other"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_drain_stops_the_daemon_once_consumers_have_every_page() {
    let mut daemon = Daemon::start(&["--drain-grace", "60s"]);
    let producer = daemon.producer("drained", 1).await;
    let page = Bytes::from(vec![7u8; 4096]);
    producer
        .enqueue("drained", 0, std::slice::from_ref(&page))
        .await
        .unwrap();
    producer.no_more_pages("drained", None).await.unwrap();

    let out = binx(&daemon, &["drain"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("drain started"), "{}", stdout(&out));
    assert_eq!(http_get(&daemon.http, "/readyz").0, 503);
    let out = binx(&daemon, &["drain"]);
    assert!(
        stdout(&out).contains("already draining"),
        "{}",
        stdout(&out)
    );
    assert!(daemon.alive(), "a page is still held");
    // What the kubelet does after a preStop `binx drain`: SIGTERM. The drain
    // goes on; it is not a second signal.
    daemon.send_signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    assert!(daemon.alive(), "SIGTERM after an admin drain stopped binxd");
    assert!(daemon.log_shows("draining goes on"), "{}", daemon.log());

    let mut source =
        ExchangeSource::new(daemon.connect_tcp(), "drained", 0, SourceConfig::default());
    assert_eq!(source.next_page().await.unwrap().unwrap().data, page);
    assert!(source.next_page().await.unwrap().is_none());
    let status = daemon.wait_exit(Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    assert!(
        !admin_socket(&daemon).exists(),
        "the admin socket is removed on exit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_tcp_port_requires_the_shared_secret() {
    let daemon = Daemon::start(&["--admin-listen", "127.0.0.1:0", "--shared-secret", "s3cret"]);
    let admin = daemon.bound("admin_tcp");
    let target = format!("http://{admin}");

    let mut anonymous = AdminClient::connect(&target, None).await.unwrap();
    let err = anonymous.list_tasks("").await.unwrap_err();
    assert_eq!(
        err.status().map(|s| s.code()),
        Some(tonic::Code::Unauthenticated),
        "{err}"
    );
    let mut wrong = AdminClient::connect(&target, Some("guess".into()))
        .await
        .unwrap();
    let err = wrong.get_stats().await.unwrap_err();
    assert!(err.to_string().contains("wrong admin token"), "{err}");

    let producer = daemon.producer("tcp.admin", 1).await;
    producer
        .enqueue("tcp.admin", 0, &[Bytes::from_static(b"x")])
        .await
        .unwrap();
    let mut client = AdminClient::connect(&target, Some("s3cret".into()))
        .await
        .unwrap();
    let tasks = client.list_tasks("").await.unwrap();
    assert_eq!(tasks.len(), 1);
    assert_eq!(
        (tasks[0].task_id.as_str(), tasks[0].memory_bytes),
        ("tcp.admin", 1)
    );
    let stats = client.get_stats().await.unwrap();
    assert_eq!(stats.values.get("pages_enqueued"), Some(&1));

    // The Unix socket needs no token (file permissions guard it).
    let mut local = AdminClient::connect_unix(&admin_socket(&daemon))
        .await
        .unwrap();
    let reply = local.list_tasks_reply("tcp.").await.unwrap();
    assert_eq!((reply.tasks.len(), reply.truncated), (1, false));
}

#[test]
fn admin_port_off_loopback_without_a_secret_is_refused() {
    let out = std::process::Command::new(crate::common::binary("binxd"))
        .args(["--admin-listen", "0.0.0.0:0", "--print-config"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("admin_listen 0.0.0.0:0 is not a loopback address"),
        "{}",
        stderr(&out)
    );
}

/// Every method of docs/admin.proto, called through the client binx-admin
/// generates from it (not the `binx` CLI's wrapper), over the TCP admin
/// port with its token: the service and the client come from the same
/// file, so a method added there and not served fails here. An oversized
/// request is refused before a method runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_method_answers_the_generated_client() {
    use binx_admin::admin_client::AdminClient as Generated;
    use binx_admin::*;
    use tonic::metadata::MetadataValue;

    let daemon = Daemon::start(&["--admin-listen", "127.0.0.1:0", "--shared-secret", "gen"]);
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", daemon.bound("admin_tcp")))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let token: MetadataValue<_> = "Bearer gen".parse().unwrap();
    let mut client = Generated::with_interceptor(channel, move |mut r: tonic::Request<()>| {
        r.metadata_mut().insert("authorization", token.clone());
        Ok(r)
    });
    let producer = daemon.producer("gen.q", 1).await;
    producer
        .enqueue("gen.q", 0, &[Bytes::from(vec![7u8; 300])])
        .await
        .unwrap();
    // A page nobody reads keeps the drain below from finishing at once.
    let keep = daemon.producer("keep", 1).await;
    keep.enqueue("keep", 0, &[Bytes::from_static(b"k")])
        .await
        .unwrap();

    let tasks = client
        .list_tasks(ListTasksRequest {
            task_id_prefix: "gen.".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .tasks;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].buffers[0].bytes_held, 300);

    let stats = client
        .get_stats(GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        stats.values.get("bytes_enqueued"),
        Some(&301),
        "300 + 1 kept"
    );
    assert_eq!(
        stats.units.get("bytes_enqueued").map(String::as_str),
        Some("bytes")
    );
    assert_eq!(
        stats.units.get("pages_enqueued"),
        None,
        "a count has no unit"
    );
    assert!(
        stats
            .replies
            .iter()
            .any(|r| r.r#type == "ENQUEUE" && r.status == "OK" && r.count == 2),
        "{:?}",
        stats.replies
    );

    let previous = client
        .set_log_level(SetLogLevelRequest {
            filter: "debug".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .previous;
    assert_eq!(previous, "info");
    let bad = client
        .set_log_level(SetLogLevelRequest {
            filter: "info,[bad".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);

    // An oversized request (past the service's 64 KiB) is refused whole.
    let huge = client
        .set_log_level(SetLogLevelRequest {
            filter: "x".repeat(1 << 20),
        })
        .await
        .unwrap_err();
    assert_eq!(huge.code(), tonic::Code::OutOfRange, "{huge}");

    let missing = client
        .abort_task(AbortTaskRequest {
            task_id: "gen.none".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    let freed = client
        .abort_task(AbortTaskRequest {
            task_id: "gen.q".into(),
            reason: "test".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .freed_bytes;
    // The page and what holding it cost (memory_used, not only page bytes).
    assert!(freed >= 300, "{freed}");

    let drain = client
        .start_drain(StartDrainRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!drain.already_draining);
    let again = client
        .start_drain(StartDrainRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(again.already_draining);
    assert!(
        client
            .get_stats(GetStatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .draining
    );
}

/// Strangers who take every slot of the admin port and keep their
/// connections busy with HTTP/2 PINGs (bytes move, nothing is asked) are
/// cut off after the idle timeout, and the operator who waited gets in;
/// a request refused for its token loses its connection at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_serves_a_few_connections_at_once_and_drops_those_that_ask_nothing() {
    use std::io::{Read, Write};
    let daemon = Daemon::start(&[
        "--admin-listen",
        "127.0.0.1:0",
        "--shared-secret",
        "s3cret",
        "--max-wait",
        "1s",
        "--http-idle-timeout",
        "3s",
    ]);
    let admin = daemon.bound("admin_tcp");
    let target = format!("http://{admin}");
    // Half of them read the answers; the other half never read, so binxd
    // soon cannot write its PING answers and stops reading them too.
    // Set once the operator's call is decided: only then do the strangers
    // that read nothing look whether they were closed (reading earlier
    // would let binxd write, and read, again).
    let decided = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let strangers = |reading_half: bool| -> Vec<std::thread::JoinHandle<bool>> {
        (0..binx_server::admin::ADMIN_PORT_CONNECTIONS)
            .map(|i| {
                let mut pinging = crate::common::PingingHttp2::open(&admin);
                let decided = decided.clone();
                std::thread::spawn(move || {
                    let until = std::time::Instant::now() + Duration::from_secs(15);
                    if i % 2 == 1 || !reading_half {
                        let stream = &mut pinging.stream;
                        let ping = crate::common::HTTP2_PING;
                        let flood: Vec<u8> = ping
                            .iter()
                            .copied()
                            .cycle()
                            .take(ping.len() * 1000)
                            .collect();
                        stream
                            .set_write_timeout(Some(Duration::from_millis(200)))
                            .unwrap();
                        // Until the buffers both ways are full (or binxd closes).
                        while std::time::Instant::now() < until && stream.write_all(&flood).is_ok()
                        {
                        }
                        while !decided.load(std::sync::atomic::Ordering::Acquire)
                            && std::time::Instant::now() < until
                        {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        // Closed by now: reading what is left ends.
                        let mut rest = Vec::new();
                        stream
                            .set_read_timeout(Some(Duration::from_secs(5)))
                            .unwrap();
                        return match stream.read_to_end(&mut rest) {
                            Ok(_) => true,
                            Err(e) => !matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ),
                        };
                    }
                    // PINGs until binxd closes the connection (or 15 s).
                    pinging
                        .ping_until_closed(Duration::from_millis(200), Duration::from_secs(15))
                        .is_some()
                })
            })
            .collect()
    };
    let call = |target: String, token: &'static str| async move {
        let mut client = AdminClient::connect(&target, Some(token.into())).await?;
        client.get_stats().await
    };
    // Strangers that read their answers, then strangers that read none.
    for reading_half in [true, false] {
        let strangers = strangers(reading_half);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = std::time::Instant::now();
        let waited =
            tokio::time::timeout(Duration::from_secs(1), call(target.clone(), "s3cret")).await;
        assert!(
            waited.is_err(),
            "an operator got through past {} open connections",
            binx_server::admin::ADMIN_PORT_CONNECTIONS
        );
        // binxd closes the strangers' connections after the idle timeout,
        // PINGs or not, and the operator's call goes through.
        let stats =
            tokio::time::timeout(Duration::from_secs(10), call(target.clone(), "s3cret")).await;
        decided.store(true, std::sync::atomic::Ordering::Release);
        let stats = stats
            .unwrap_or_else(|_| {
                panic!("the call waited past the idle timeout (reading half: {reading_half})")
            })
            .unwrap();
        assert!(stats.values.contains_key("pages_enqueued"));
        assert!(
            started.elapsed() >= Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        for stranger in strangers {
            assert!(stranger.join().unwrap(), "a stranger's connection was kept");
        }
        decided.store(false, std::sync::atomic::Ordering::Release);
    }
    // A wrong token: refused, and the connection goes with the answer.
    let mut wrong = AdminClient::connect(&target, Some("guess".into()))
        .await
        .unwrap();
    let err = wrong.get_stats().await.unwrap_err();
    assert!(err.to_string().contains("wrong admin token"), "{err}");
}
