//! The engines' own exchange clients against a real binxd: Presto 0.296's
//! `PageBufferClient` + `HttpRpcShuffleClient` and Trino 483's
//! `HttpPageBufferClient` (over cleartext HTTP/2, Trino's default, and
//! HTTP/1.1), from Maven Central, built by scripts/ensure-engine-clients.sh
//! (tests/engines/). Pages are made by each engine's own serde from real
//! BIGINT and VARCHAR blocks, put with `binx put` through the Unix socket,
//! and pulled by the engine's client, which decodes them and compares every
//! row (tests/engines/*/src/main/java/binx/engines/*Exchange.java).

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::common::{Daemon, TempDir, binx, ensure_tool, stderr};

/// Pages per buffer: sizes from 91 bytes to ~300 KiB, about 2 MB in all,
/// so a 1 MB (Presto) reply holds a few and a 12 MB (Trino) one all.
const PAGES: usize = 12;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Engine {
    Presto,
    Trino,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Presto => "presto",
            Engine::Trino => "trino",
        }
    }

    /// target/engines/<engine>/run, built once per test run.
    fn launcher(self) -> PathBuf {
        static DIR: OnceLock<PathBuf> = OnceLock::new();
        DIR.get_or_init(|| PathBuf::from(ensure_tool("ensure-engine-clients.sh")))
            .join(self.name())
            .join("run")
    }

    /// Task ids as the engine writes them (Trino's TaskId accepts only
    /// `[_a-z0-9]` parts).
    fn task(self, label: &str) -> String {
        format!("20261124_000000_00000_{label}.1.0.0")
    }

    /// The engine's pages, one file each, in `dir`.
    fn make_pages(self, dir: &TempDir) -> PathBuf {
        self.make(dir, Pages::MIXED)
    }

    fn make(self, dir: &TempDir, shape: Pages) -> PathBuf {
        let pages = dir.0.join(format!("{}-pages-{}", self.name(), shape.count));
        let out = self
            .command(shape)
            .args(["make", path_str(&pages), &shape.count.to_string()])
            .output()
            .expect("the engine client runs");
        assert!(
            out.status.success(),
            "{} make: {}",
            self.name(),
            stderr(&out)
        );
        pages
    }

    /// The engine's client, making or checking pages of `shape`.
    fn command(self, shape: Pages) -> Command {
        let mut command = Command::new(self.launcher());
        match shape.rows {
            Some(rows) => command.env("BINX_ENGINE_PAGE_ROWS", rows.to_string()),
            None => command.env_remove("BINX_ENGINE_PAGE_ROWS"),
        };
        command
    }

    /// Starts the engine's client pulling `task`'s buffer 0 from `daemon`.
    fn pull(self, daemon: &Daemon, task: &str, protocol: &str, secret: Option<&str>) -> Child {
        self.pull_of(daemon, task, protocol, secret, Pages::MIXED)
    }

    fn pull_of(
        self,
        daemon: &Daemon,
        task: &str,
        protocol: &str,
        secret: Option<&str>,
        shape: Pages,
    ) -> Child {
        let location = format!("http://{}/v1/task/{task}/results/0", daemon.http);
        let count = shape.count.to_string();
        let mut args = vec!["pull", location.as_str(), count.as_str()];
        if self == Engine::Trino {
            args.push(protocol);
        }
        args.extend(secret);
        self.command(shape)
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the engine client starts")
    }
}

/// What a buffer's pages are: how many, and their rows (`None`: the mix of
/// 1 to 20,000 rows the clients make by default).
#[derive(Clone, Copy, Debug)]
struct Pages {
    count: usize,
    rows: Option<u32>,
}

impl Pages {
    const MIXED: Pages = Pages {
        count: PAGES,
        rows: None,
    };
}

fn path_str(path: &std::path::Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// `binx put` of every page file, in order, into buffer 0 of `task`.
fn put(daemon: &Daemon, task: &str, pages: &std::path::Path, keep_open: bool) {
    put_count(daemon, task, pages, keep_open, PAGES);
}

fn put_count(daemon: &Daemon, task: &str, pages: &std::path::Path, keep_open: bool, count: usize) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(pages)
        .expect("page directory")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    assert_eq!(files.len(), count);
    let mut args = vec!["put", "--task", task];
    if keep_open {
        args.push("--keep-open");
    }
    args.extend(files.iter().map(|f| path_str(f)));
    let out = binx(daemon, &args);
    assert!(out.status.success(), "binx put: {}", stderr(&out));
}

/// ACKs binxd has answered OK.
fn acks(daemon: &Daemon) -> u64 {
    daemon.stats()["requests"]["ACK OK"].as_u64().unwrap_or(0)
}

/// Waits (60 s at most) until binxd has answered `at_least` ACKs.
fn wait_for_acks(daemon: &Daemon, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while acks(daemon) < at_least {
        assert!(
            Instant::now() < deadline,
            "fewer than {at_least} ACKs in 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (2 min at most) for the client to exit; its output.
fn finish(mut child: Child, what: &str) -> Output {
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!("{what} did not finish in 2 min: {}", stderr(&out));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

/// The `ok key=value ...` line a successful pull prints.
struct Pulled(Vec<(String, String)>);

impl Pulled {
    fn of(out: &Output, what: &str) -> Pulled {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{what} failed:\n{text}\n{}",
            stderr(out)
        );
        let line = text
            .lines()
            .find(|l| l.starts_with("ok "))
            .unwrap_or_else(|| panic!("{what} printed no result: {text}"));
        Pulled(
            line.split_whitespace()
                .skip(1)
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn get(&self, key: &str) -> u64 {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in the result"))
    }
}

/// The whole exchange as a worker does it: the consumer starts first and
/// polls an empty buffer (its task not even open) for 3 s, then the
/// producer's pages arrive; every page is decoded and compared by the
/// client; it acknowledges and DELETEs the buffer, and binxd then holds
/// nothing.
fn exchange(engine: Engine, protocol: &str, secret: Option<&str>) {
    let mut flags = vec![];
    if let Some(secret) = secret {
        flags.extend(["--shared-secret", secret]);
    }
    let daemon = Daemon::start(&flags);
    let pages = engine.make_pages(&daemon.dir);
    let task = engine.task(&format!("{}{protocol}", engine.name()));
    let client = engine.pull(&daemon, &task, protocol, secret);
    // Once its first GET waits in binxd (the JVM takes a while to start),
    // the buffer stays empty for 3 s more.
    let deadline = Instant::now() + Duration::from_secs(60);
    while daemon.stat("long_polls_waiting") == 0 {
        assert!(
            Instant::now() < deadline,
            "the {engine:?} client sent no GET"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_secs(3));
    put(&daemon, &task, &pages, false);
    let what = format!("{} {protocol} pull", engine.name());
    let pulled = Pulled::of(&finish(client, &what), &what);

    assert_eq!(pulled.get("pages"), PAGES as u64);
    assert!(pulled.get("rows") > 60_000, "rows: {}", pulled.get("rows"));
    // Each GET of an empty buffer waits 1-2 s, as the engines' servers do
    // (their clients send no max-wait): a few requests, not thousands.
    let waited = pulled.get("waited_ms");
    let polls = pulled.get("gets_before_first_page");
    assert!(waited >= 3_000, "the first page came after {waited} ms");
    assert!(
        polls <= waited / 1000 + 2,
        "{polls} GETs in {waited} ms while the buffer was empty"
    );
    assert!(pulled.get("acks") >= 1, "the client acknowledges pages");
    assert_eq!(pulled.get("deletes"), 1, "one DELETE once complete");
    // The DELETE freed the buffer and ended the task.
    let stats = daemon.stats();
    assert_eq!(stats["tasks"], 0, "{stats}");
    assert_eq!(stats["page_bytes_held"], 0, "{stats}");
    assert!(
        stats["requests"]["DELETE OK"].as_u64() >= Some(1),
        "{stats}"
    );
    // Acknowledgements are fire-and-forget: one may land after the exit.
    wait_for_acks(&daemon, 1);
    if secret.is_some() {
        assert_eq!(stats["http_unauthenticated"], 0, "{stats}");
    }
}

#[test]
fn presto_client_reads_every_page_once_and_long_polls_an_empty_buffer() {
    exchange(Engine::Presto, "http1", None);
}

#[test]
fn presto_client_signs_with_the_shared_secret() {
    exchange(Engine::Presto, "http1", Some("presto-cluster-secret"));
}

#[test]
fn trino_client_reads_every_page_once_over_cleartext_http2() {
    exchange(Engine::Trino, "http2", None);
}

#[test]
fn trino_client_reads_every_page_once_over_http1() {
    exchange(Engine::Trino, "http1", None);
}

#[test]
fn trino_client_signs_with_the_shared_secret_over_http2() {
    exchange(Engine::Trino, "http2", Some("trino-cluster-secret"));
}

/// A buffer of thousands of one-row pages (about 100 bytes each), as a
/// selective stage writes: each reply lists its pages' sizes and the sizes
/// left in its headers, and the engines' HTTP clients refuse headers past
/// 16 KiB (Trino's over HTTP/1.1: "Response Header Bytes Too Large", over
/// HTTP/2: `invalid_hpack_block`), retrying until the query fails. binxd
/// sends fewer pages a reply instead, and every client reads them all.
#[test]
fn engines_read_a_buffer_of_thousands_of_small_pages() {
    let daemon = Daemon::start(&[]);
    let shape = Pages {
        count: 10_000,
        rows: Some(1),
    };
    for (engine, protocol) in [
        (Engine::Trino, "http2"),
        (Engine::Trino, "http1"),
        (Engine::Presto, "http1"),
    ] {
        let pages = engine.make(&daemon.dir, shape);
        let task = engine.task(&format!("{}small{protocol}", engine.name()));
        put_count(&daemon, &task, &pages, false, shape.count);
        let what = format!("{} {protocol} pull of small pages", engine.name());
        let client = engine.pull_of(&daemon, &task, protocol, None, shape);
        let pulled = Pulled::of(&finish(client, &what), &what);
        assert_eq!(pulled.get("pages"), shape.count as u64, "{what}");
        assert_eq!(pulled.get("rows"), shape.count as u64, "{what}");
        // Several replies, not one per page.
        let gets = pulled.get("gets");
        assert!((2..=100).contains(&gets), "{what}: {gets} GETs");
    }
    let stats = daemon.stats();
    assert_eq!(stats["tasks"], 0, "{stats}");
    assert_eq!(stats["page_bytes_held"], 0, "{stats}");
}

/// At `http_max_connections`, a client's connection waits to be accepted
/// instead of getting 503, which each engine's client takes as a failed
/// query (no retry): once a slot is free it reads every page.
#[test]
fn engines_wait_for_a_connection_slot_instead_of_failing() {
    let daemon = Daemon::start(&["--http-max-connections", "1"]);
    for engine in [Engine::Presto, Engine::Trino] {
        let pages = engine.make_pages(&daemon.dir);
        let task = engine.task(&format!("{}slot", engine.name()));
        put(&daemon, &task, &pages, false);
        // A long-poll of an empty buffer holds the only slot for 4 s...
        let http = daemon.http.clone();
        let holder = std::thread::spawn(move || {
            crate::common::http_request(
                &http,
                "GET",
                "/v1/task/holder/results/0/0",
                &[("X-Presto-Max-Wait", "4s")],
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        let what = format!("{} pull past the connection cap", engine.name());
        let client = engine.pull(&daemon, &task, "http1", None);
        // ...while the client starts and its connection waits for it.
        assert_eq!(holder.join().expect("holder").status, 204);
        let pulled = Pulled::of(&finish(client, &what), &what);
        assert_eq!(pulled.get("pages"), PAGES as u64, "{what}");
    }
    // The stats are on HTTP too: read once the slots are free.
    assert!(daemon.stat("http_connections_waited") >= 2);
}

/// A wrong secret is refused (401), and each engine's client fails the
/// query instead of reading nothing.
#[test]
fn a_client_with_another_secret_fails() {
    let daemon = Daemon::start(&["--shared-secret", "the-right-one"]);
    for engine in [Engine::Presto, Engine::Trino] {
        let task = engine.task(&format!("{}wrong", engine.name()));
        let client = engine.pull(&daemon, &task, "http2", Some("another-one"));
        let out = finish(client, "pull with a wrong secret");
        assert!(!out.status.success(), "{engine:?} read without the secret");
        let err = stderr(&out);
        assert!(err.contains("401"), "{engine:?}: {err}");
    }
    assert!(daemon.stat("http_unauthenticated") >= 2);
}

/// A task aborted while its consumer reads: Trino's client sees
/// `X-Trino-Task-Failed: true` (REMOTE_TASK_FAILED), Presto's a 500 with
/// the reason; neither reports the buffer as complete.
#[test]
fn an_aborted_task_fails_the_engines_reader() {
    let daemon = Daemon::start(&[]);
    for engine in [Engine::Presto, Engine::Trino] {
        let pages = engine.make_pages(&daemon.dir);
        let task = engine.task(&format!("{}aborted", engine.name()));
        put(&daemon, &task, &pages, true);
        let acks_before = acks(&daemon);
        let client = engine.pull(&daemon, &task, "http2", None);
        // The client has read what was put and waits for more.
        wait_for_acks(&daemon, acks_before + 1);
        let out = binx(
            &daemon,
            &["abort", "--task", &task, "--reason", "worker lost"],
        );
        assert!(out.status.success(), "binx abort: {}", stderr(&out));
        let out = finish(client, "pull of an aborted task");
        assert!(!out.status.success(), "{engine:?} finished an aborted task");
        let err = stderr(&out);
        match engine {
            Engine::Trino => assert!(err.contains("Remote task failed"), "{err}"),
            Engine::Presto => assert!(err.contains("worker lost"), "{err}"),
        }
    }
}

/// A producer's binxd that restarts (its pages lost) while a consumer reads:
/// the new run answers with another task instance id, and each engine's
/// client fails the query (REMOTE_TASK_MISMATCH) instead of waiting forever
/// or reading a short buffer as complete.
#[test]
fn a_restarted_binxd_fails_the_engines_reader() {
    for engine in [Engine::Presto, Engine::Trino] {
        let mut daemon = Daemon::start(&[]);
        let pages = engine.make_pages(&daemon.dir);
        let task = engine.task(&format!("{}restarted", engine.name()));
        put(&daemon, &task, &pages, true);
        let client = engine.pull(&daemon, &task, "http2", None);
        wait_for_acks(&daemon, 1);
        daemon.signal("KILL");
        let _restarted = Daemon::restart_of(&daemon, &[]);
        let out = finish(client, "pull across a restart");
        assert!(
            !out.status.success(),
            "{engine:?} finished across a restart"
        );
        let err = stderr(&out);
        assert!(
            err.contains("Could not communicate with the remote task"),
            "{engine:?}: {err}"
        );
    }
}
