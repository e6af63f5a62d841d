//! The README walk-through, run as a user would: binxd, `binx put`,
//! `binx get`, `binx ping`, `binx stats`; config layering; clean stop.

use std::process::Command;
use std::time::Duration;

use crate::common::{Daemon, TempDir, binary, binx, metric, stderr, wait_until};

#[test]
fn put_get_ping_and_stats_work_as_the_readme_says() {
    let daemon = Daemon::start(&[]);
    let dir = TempDir::new("cli");
    let input = dir.0.join("input.bin");
    let mut data = vec![0u8; 3_500_000];
    crate::common::rng(5).fill(&mut data);
    std::fs::write(&input, &data).unwrap();
    let small = dir.0.join("small.txt");
    std::fs::write(&small, b"hello binx\n").unwrap();

    // One page per file.
    let put = binx(
        &daemon,
        &[
            "put",
            "--task",
            "demo",
            small.to_str().unwrap(),
            small.to_str().unwrap(),
        ],
    );
    assert!(put.status.success(), "{}", stderr(&put));
    assert!(stderr(&put).contains("put 2 pages"), "{}", stderr(&put));
    // Split at 1 MiB: 4 pages.
    let put = binx(
        &daemon,
        &[
            "put",
            "--task",
            "big",
            "--split-at",
            "1MiB",
            input.to_str().unwrap(),
        ],
    );
    assert!(put.status.success(), "{}", stderr(&put));
    assert!(stderr(&put).contains("put 4 pages"), "{}", stderr(&put));

    let got = binx(&daemon, &["get", "--remote", &daemon.tcp, "--task", "demo"]);
    assert!(got.status.success(), "{}", stderr(&got));
    assert_eq!(got.stdout, b"hello binx\nhello binx\n");
    let out = dir.0.join("out.bin");
    let got = binx(
        &daemon,
        &[
            "get",
            "--remote",
            &daemon.tcp,
            "--task",
            "big",
            "-o",
            out.to_str().unwrap(),
            "--progress",
            "always",
        ],
    );
    assert!(got.status.success(), "{}", stderr(&got));
    assert_eq!(std::fs::read(&out).unwrap(), data);
    assert!(stderr(&got).contains("got 4 pages"), "{}", stderr(&got));

    let ping = binx(&daemon, &["ping", "--remote", &daemon.tcp, "-c", "3"]);
    assert!(ping.status.success(), "{}", stderr(&ping));
    assert!(String::from_utf8_lossy(&ping.stdout).contains("3 pings: min"));

    let stats = binx(&daemon, &["stats"]);
    assert!(stats.status.success(), "{}", stderr(&stats));
    let text = String::from_utf8_lossy(&stats.stdout);
    assert!(text.contains("pages_enqueued                 6"), "{text}");
    assert!(text.contains("ENQUEUE OK"), "{text}");

    // Errors read like sentences and name what was wrong.
    let bad = binx(
        &daemon,
        &["put", "--task", "no such/task", small.to_str().unwrap()],
    );
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("task_id \"no such/task\" contains ' '"),
        "{}",
        stderr(&bad)
    );
    let missing = binx(&daemon, &["put", "--task", "x", "/nonexistent/file"]);
    assert!(
        stderr(&missing).contains("cannot open /nonexistent/file"),
        "{}",
        stderr(&missing)
    );
    let no_daemon = Command::new(binary("binx"))
        .args(["ping", "--remote", "unix:///nonexistent/binx.sock"])
        .output()
        .unwrap();
    assert!(
        stderr(&no_daemon).contains("cannot ping binxd at unix:///nonexistent/binx.sock"),
        "{}",
        stderr(&no_daemon)
    );
    // A put to a socket nobody listens on says so at once; the client
    // library's minutes of reconnecting are for engines, not for a typed
    // command (the child is killed if it is still running after 20 s).
    let mut put = Command::new(binary("binx"))
        .args(["put", "--task", "x", "--uds", "/nonexistent/binx.sock"])
        .arg(&small)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while put.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = put.kill();
            panic!("binx put kept trying a socket nobody listens on");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let put = put.wait_with_output().unwrap();
    assert!(!put.status.success());
    assert!(
        stderr(&put).contains("cannot connect to binxd on /nonexistent/binx.sock"),
        "{}",
        stderr(&put)
    );
}

#[test]
fn config_file_then_environment_then_flags() {
    let dir = TempDir::new("config");
    let file = dir.0.join("binxd.toml");
    std::fs::write(
        &file,
        "memory_limit = \"2GiB\"\nmax_wait = \"3s\"\nname = \"from-file\"\n",
    )
    .unwrap();
    let out = Command::new(binary("binxd"))
        .args([
            "--config",
            file.to_str().unwrap(),
            "--print-config",
            "--name",
            "from-flag",
        ])
        .env("BINX_MAX_WAIT", "7s")
        .env("BINX_NAME", "from-env")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("memory_limit = \"2GiB\""), "{text}");
    assert!(
        text.contains("max_wait = \"7s\""),
        "env beats the file: {text}"
    );
    assert!(
        text.contains("name = \"from-flag\""),
        "the flag beats env: {text}"
    );
    assert!(
        text.contains("task_memory_limit = \"256MiB\""),
        "defaults stay: {text}"
    );

    let out = Command::new(binary("binxd"))
        .args(["--print-config"])
        .env("BINX_SHARED_SECRET", "hunter2")
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("hunter2"),
        "the secret is shown"
    );

    std::fs::write(&file, "memory_limit = \"lots\"\n").unwrap();
    let out = Command::new(binary("binxd"))
        .args(["--config", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(file.to_str().unwrap()) && err.contains("is not a size"),
        "{err}"
    );
}

#[test]
fn sigterm_and_sigint_stop_binxd_and_remove_its_socket() {
    for signal in ["TERM", "INT"] {
        let mut daemon = Daemon::start(&[]);
        assert!(daemon.uds.exists());
        let status = daemon.signal(signal);
        assert!(
            status.success(),
            "SIG{signal}: {status:?}\n{}",
            daemon.log()
        );
        assert!(
            !daemon.uds.exists(),
            "SIG{signal} left the socket file behind"
        );
        assert!(daemon.log().contains("binxd stopped"), "{}", daemon.log());
    }
}

#[test]
fn binxd_refuses_a_socket_another_binxd_serves() {
    let daemon = Daemon::start(&[]);
    let out = Command::new(binary("binxd"))
        .arg("--uds-path")
        .arg(&daemon.uds)
        .args(["--tcp-listen", "127.0.0.1:0", "--http-listen", ""])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("another process is already serving the Unix socket"),
        "{}",
        stderr(&out)
    );
}

/// A misspelt `BINX_*` variable is named in a warning at start, not
/// ignored without a word (the file refuses unknown keys; the environment
/// cannot, since scripts set variables of their own).
#[test]
fn an_unknown_binx_variable_is_warned_of() {
    let env = [("BINX_MEMORY_LIMT".to_string(), "4GiB".to_string())];
    let daemon = crate::common::Daemon::start_with_env(&[], &env);
    let log = daemon.log();
    assert!(
        log.contains("BINX_MEMORY_LIMT is set but is no binxd setting"),
        "{log}"
    );
    assert!(!log.contains("BINX_LOG_LEVEL is set but"), "{log}");
}

/// `binx stats | head -1`: the reader goes away, and binx ends quietly
/// instead of panicking on the closed pipe.
#[test]
fn output_into_a_closed_pipe_ends_binx_quietly() {
    let daemon = Daemon::start(&[]);
    let uds = daemon.uds.to_string_lossy();
    for command in [
        &["stats"][..],
        &["tasks"],
        &["ping", "--count", "3", "--remote", &uds],
    ] {
        let mut child = Command::new(binary("binx"))
            .args(command)
            .env("BINX_UDS_PATH", &daemon.uds)
            .env_remove("BINX_ADMIN")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("binx runs");
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("binx ends");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{command:?}: {err}");
        assert!(out.status.success(), "{command:?}: {:?} {err}", out.status);
    }
}

/// `binx get ... | head -c 100`: the reader goes away after the first
/// page, and binx fails (the pages it read were taken from the buffer), saying
/// how far the output got, not a bare "Broken pipe" (what it said before);
/// into a file that cannot be written (`/dev/full`) it fails, naming why.
#[test]
fn get_into_a_pipe_its_reader_closed_fails_saying_how_far_it_got() {
    let daemon = Daemon::start(&[]);
    let dir = TempDir::new("cli-pipe");
    let mut files = Vec::new();
    for i in 0..40 {
        let path = dir.0.join(format!("page-{i:02}"));
        std::fs::write(&path, vec![b'a' + (i % 26) as u8; 100 * 1024]).expect("page file");
        files.push(path);
    }
    let put = |task: &str| put_files(&daemon, task, &files, &[]);
    let get = |task: &str| {
        let mut get = Command::new(binary("binx"));
        get.args(["get", "--task", task, "--remote"])
            .arg(&daemon.uds)
            .args(["--progress", "never"]);
        get
    };
    put("cli.pipe");
    let mut child = get("cli.pipe")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("binx get runs");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut first = vec![0u8; 100];
    std::io::Read::read_exact(&mut stdout, &mut first).expect("the first bytes");
    assert_eq!(first, vec![b'a'; 100]);
    drop(stdout);
    let out = child.wait_with_output().expect("binx get ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("the output was closed by its reader after")
            && err.contains("buffer 0 of task cli.pipe was not read to its end"),
        "{err}"
    );

    put("cli.full");
    let out = get("cli.full")
        .args(["--output", "/dev/full"])
        .output()
        .expect("binx get runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("cannot write the output"), "{err}");
}

/// A binxd that takes at most 100 pages an ENQUEUE
/// (`--max-pages-per-enqueue 100`, said in its HELLO) takes a `binx put`
/// of 1,000 pages of 10 bytes: the producer sends at most 100 a batch,
/// where it sent one of 1,000 that binxd refused ("carries 1000 pages; the
/// limit is 100"); the buffer reads back byte for byte.
#[test]
fn a_put_batches_within_the_pages_a_daemon_takes_in_one_enqueue() {
    let daemon = Daemon::start(&["--max-pages-per-enqueue", "100"]);
    let dir = TempDir::new("cli-few-pages");
    let path = dir.0.join("input");
    let input: Vec<u8> = (0..10_000u32)
        .map(|k| (k.wrapping_mul(7) >> 3) as u8)
        .collect();
    std::fs::write(&path, &input).expect("input file");
    let path = path.to_string_lossy();
    let out = binx(
        &daemon,
        &["put", "--task", "cli.few", "--split-at", "10", &path],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("put 1000 pages"), "{}", stderr(&out));
    assert!(
        read_all(&daemon, "cli.few") == input,
        "the pages read back differ"
    );
}

/// A binxd that reads frames of at most 64 KiB (`--max-frame-size 64KiB`,
/// said in its HELLO as `max-frame-bytes=65536`): `binx put` of three
/// 30,000-byte pages sends them in two frames (it sent them in one frame of
/// 90 KB, and binxd closed the connection: "frame length 90027 exceeds the
/// limit"), and they read back byte for byte; a 100,000-byte page, which no
/// frame of it carries, is refused before anything is sent, naming the
/// setting.
#[test]
fn a_put_keeps_its_frames_within_what_the_daemon_reads() {
    let daemon = Daemon::start(&["--max-frame-size", "64KiB"]);
    let dir = TempDir::new("cli-frames");
    put_pages_and_read_them_back(&daemon, &dir, "cli.frames", 3, |_| 30_000);

    let large = dir.0.join("large");
    std::fs::write(&large, vec![7u8; 100_000]).expect("large file");
    let out = binx(
        &daemon,
        &[
            "put",
            "--task",
            "cli.frames.large",
            &large.to_string_lossy(),
        ],
    );
    assert!(!out.status.success());
    let why = stderr(&out);
    assert!(
        why.contains("a page of 100000 bytes")
            && why.contains("max_frame_size")
            && why.contains("65536"),
        "{why}"
    );
}

/// A binxd with a small memory limit (4 MiB, pages spilled to storage)
/// takes a `binx put` of 14 MiB of pages of 200 to 263 KB: the producer
/// batches within the `max-enqueue-bytes=` its HELLO said (4 MiB, with 128
/// bytes a page), where it sent 8 MiB batches that binxd refused as never fitting the limit,
/// though every page fit; and the buffer reads back byte for byte.
#[test]
fn a_put_batches_within_what_a_small_daemon_takes() {
    let daemon = Daemon::start(&[
        "--memory-limit",
        "4MiB",
        "--default-spool-policy",
        "overflow",
    ]);
    let dir = TempDir::new("cli-small");
    put_pages_and_read_them_back(&daemon, &dir, "cli.small", 64, |i| 200_000 + i * 1000);
}

/// `binx put` of `count` files into task `task` (file `i` one page of
/// `size(i)` bytes, a pattern of its own), then `binx get` of the task:
/// every page's bytes, in order.
fn put_pages_and_read_them_back(
    daemon: &Daemon,
    dir: &TempDir,
    task: &str,
    count: u32,
    size: impl Fn(u32) -> u32,
) {
    let mut files = Vec::new();
    let mut expected = Vec::new();
    for i in 0..count {
        let path = dir.0.join(format!("page-{i:02}"));
        let page: Vec<u8> = (0..size(i))
            .map(|k| (k.wrapping_mul(31) ^ i) as u8)
            .collect();
        std::fs::write(&path, &page).expect("page file");
        expected.extend_from_slice(&page);
        files.push(path.to_string_lossy().into_owned());
    }
    let mut put = vec!["put", "--task", task];
    put.extend(files.iter().map(String::as_str));
    let out = binx(daemon, &put);
    assert!(out.status.success(), "{}", stderr(&out));
    let read = read_all(daemon, task);
    assert_eq!(read.len(), expected.len());
    assert!(read == expected, "the pages read back differ");
}

/// `binx get` of buffer 0 of `task` from the daemon: what it wrote out.
fn read_all(daemon: &Daemon, task: &str) -> Vec<u8> {
    let uds = daemon.uds.to_string_lossy();
    let out = binx(
        daemon,
        &[
            "get",
            "--task",
            task,
            "--remote",
            &uds,
            "--progress",
            "never",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    out.stdout
}

/// `binx get` of a buffer whose binxd restarted after it read pages of it
/// fails naming the restart, and writes none of the pages a producer wrote
/// to the new process under the same task id (another run): without a
/// HELLO its connection could not tell one run from the other.
#[test]
fn a_get_across_a_restart_of_its_binxd_fails_rather_than_mix_two_runs() {
    let mut daemon = Daemon::start(&[]);
    let dir = TempDir::new("cli-restart");
    let page = |name: &str| {
        let path = dir.0.join(name);
        std::fs::write(&path, name).expect("page file");
        path
    };
    let first = [page("first-0"), page("first-1")];
    put_files(&daemon, "cli.rerun", &first, &["--keep-open"]);
    let mut child = Command::new(binary("binx"))
        .args([
            "get",
            "--task",
            "cli.rerun",
            "--progress",
            "never",
            "--remote",
        ])
        .arg(&daemon.tcp)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("binx get runs");
    let mut stdout = child.stdout.take().expect("stdout");
    // Served (binx get writes its output through a buffer).
    assert!(
        wait_until(Duration::from_secs(20), || {
            metric(&daemon, "binx_served_bytes_total") >= 14
        }),
        "binx get read the first run's pages"
    );
    daemon.signal("KILL");
    let restarted = Daemon::restart_of(&daemon, &[]);
    let second = [page("second-0"), page("second-1"), page("second-2")];
    put_files(&restarted, "cli.rerun", &second, &[]);
    let mut written = Vec::new();
    std::io::Read::read_to_end(&mut stdout, &mut written).expect("the output");
    let out = child.wait_with_output().expect("binx get ends");
    let err = String::from_utf8_lossy(&out.stderr);
    let written = String::from_utf8_lossy(&written);
    assert!(
        !out.status.success(),
        "binx get read across the restart: {written:?}"
    );
    assert_eq!(written, "first-0first-1", "only the first run's pages");
    // Whether the new run had the buffer when binx get asked (its pages
    // told apart by the HELLO) or not yet (a refusal from the new run).
    assert!(err.contains("restarted"), "{err}");
}

/// `binx put --task <task> <extra> <files>` into `daemon`, which must succeed.
fn put_files(daemon: &Daemon, task: &str, files: &[std::path::PathBuf], extra: &[&str]) {
    let out = Command::new(binary("binx"))
        .args(["put", "--task", task])
        .args(extra)
        .args(files)
        .env("BINX_UDS_PATH", &daemon.uds)
        .output()
        .expect("binx put runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
