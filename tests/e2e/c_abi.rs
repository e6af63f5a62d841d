//! The C ABI as an engine uses it: examples/c/engine.c, compiled with the
//! system C compiler against include/binx.h and libbinx.a, produces a
//! buffer through a real binxd and reads it back (directly, and forwarded
//! through the sidecar to a "remote" one), checking every byte.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::common::{CuttingRelay, Daemon, TempDir};

/// Links the example engine against libbinx.a once. cargo builds the
/// library before the tests (binx-capi is a dev-dependency of the root
/// package): as a dependency it is written to `deps/`, and it is uplifted
/// beside the binaries when built on its own.
fn engine() -> PathBuf {
    static ENGINE: OnceLock<PathBuf> = OnceLock::new();
    ENGINE.get_or_init(|| compiled("engine")).clone()
}

/// examples/c/<name>.c, compiled and linked against libbinx.a.
fn compiled(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps dir");
    let target = deps.parent().expect("target dir");
    let lib = [deps.join("libbinx.a"), target.join("libbinx.a")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .expect("cargo built libbinx.a (binx-capi is a dev-dependency)");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = target.join(format!("binx-c-{name}"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiled = Command::new(cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-I"])
        .arg(root.join("include"))
        .arg(root.join(format!("examples/c/{name}.c")))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&out)
        .output()
        .expect("the C compiler runs");
    assert!(
        compiled.status.success(),
        "compiling examples/c/{name}.c failed:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    out
}

fn run_engine(args: &[&std::ffi::OsStr]) -> (bool, String, String) {
    let out = Command::new(engine())
        .args(args)
        .output()
        .expect("engine runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn c_engine_produces_and_consumes_through_binxd() {
    let daemon = Daemon::start(&[]);
    let (ok, stdout, stderr) = run_engine(&[daemon.uds.as_os_str(), "c.local".as_ref()]);
    assert!(ok, "engine failed: {stderr}\nbinxd log:\n{}", daemon.log());
    assert!(stdout.starts_with("ok 200 "), "{stdout}");

    // Through the proxy consumer: the local sidecar forwards to the remote one.
    let (ok, stdout, stderr) = run_engine(&[
        daemon.uds.as_os_str(),
        "c.forwarded".as_ref(),
        daemon.tcp.as_ref(),
    ]);
    assert!(ok, "engine failed: {stderr}");
    let (pages, bytes) = stdout
        .trim()
        .strip_prefix("ok ")
        .and_then(|s| s.split_once(' '))
        .expect("ok <pages> <bytes>");
    assert_eq!(pages, "200");
    assert!(bytes.parse::<u64>().unwrap() > 10 << 20, "{stdout}");
    // Both buffers were read to their end and deleted: nothing is held.
    assert_eq!(daemon.stat_when("memory_used", |n| n == 0), 0);
    assert_eq!(
        daemon.stat("shm_attached_total"),
        0,
        "no engine asked for shared memory"
    );

    // The same through shared memory, directly and through the proxy consumer.
    for args in [
        vec!["--shm".as_ref(), daemon.uds.as_os_str(), "c.shm".as_ref()],
        vec![
            "--shm".as_ref(),
            daemon.uds.as_os_str(),
            "c.shm.forwarded".as_ref(),
            daemon.tcp.as_ref(),
        ],
    ] {
        let (ok, stdout, stderr) = run_engine(&args);
        assert!(
            ok,
            "engine --shm failed: {stderr}\nbinxd log:\n{}",
            daemon.log()
        );
        assert!(stdout.starts_with("ok 200 "), "{stdout}");
    }
    assert!(daemon.stat_when("shm_attached_total", |n| n >= 2) >= 2);
    // binxd sees each engine's connection close on its own time.
    assert_eq!(
        daemon.stat_when("shm_connections_open", |n| n == 0),
        0,
        "the engines' regions were released"
    );
    assert_eq!(daemon.stat_when("memory_used", |n| n == 0), 0);
}

#[test]
fn c_engine_asking_for_shared_memory_from_a_sidecar_without_it_gets_the_reason() {
    let daemon = Daemon::start(&["--shm-enabled", "false"]);
    let (ok, _, stderr) =
        run_engine(&["--shm".as_ref(), daemon.uds.as_os_str(), "c.noshm".as_ref()]);
    assert!(!ok);
    assert!(
        stderr.contains("binx_open_task failed") && stderr.contains("shared memory is off"),
        "{stderr}"
    );
}

#[test]
fn c_engine_gets_a_clear_error_when_no_sidecar_listens() {
    let dir = TempDir::new("c-abi");
    let missing = dir.0.join("nobody.sock");
    let (ok, _, stderr) = run_engine(&[missing.as_os_str(), "c.none".as_ref()]);
    assert!(!ok);
    assert!(
        stderr.contains("binx_open_task failed (2)") && stderr.contains("nobody.sock"),
        "{stderr}"
    );
}

/// What a C engine meets when things go wrong: a call stored in part says
/// how much, an oversized page or task id is refused before anything is
/// sent (the connection other threads share stays up), and a source that
/// failed says so again at once instead of waiting for ever.
#[test]
fn c_engine_learns_what_was_stored_and_errors_end_a_source() {
    let daemon = Daemon::start(&["--memory-limit", "24MiB", "--task-memory-limit", "24MiB"]);
    runs_ok("errors", &daemon);
    assert_eq!(daemon.stat_when("memory_used", |n| n == 0), 0);
}

/// examples/c/<name>.c, compiled, run against `daemon` (its socket and the
/// task prefix `c.<name>`), exits 0 printing "ok": every check it makes
/// held.
fn runs_ok(name: &str, daemon: &Daemon) {
    let out = Command::new(compiled(name))
        .arg(&daemon.uds)
        .arg(format!("c.{name}"))
        .output()
        .expect("the C program runs");
    assert!(
        out.status.success(),
        "{}{}\nbinxd log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        daemon.log()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
}

/// A C engine against a sidecar that reads frames of at most 64 KiB
/// (examples/c/frames.c): pages that fit a frame each go in one call
/// (the library keeps its frames within what the sidecar's HELLO said,
/// where it sent one frame of 90 KB and the sidecar closed the connection),
/// and a page no frame carries is refused before anything is sent.
#[test]
fn c_engine_sends_frames_within_what_the_sidecar_reads() {
    let daemon = Daemon::start(&["--max-frame-size", "64KiB"]);
    runs_ok("frames", &daemon);
}

/// A C engine that leaves SIGPIPE at its default action (ending the
/// process) while its sidecar's connection is cut in the middle of a
/// request the library writes (examples/c/sigpipe.c): the call returns
/// the error, nothing of it is stored, and the process lives, with SIGPIPE
/// as it was. (The library wrote to the closed socket with SIGPIPE
/// deliverable, and the engine died of it.)
#[test]
fn a_connection_cut_mid_write_never_kills_the_c_engine_with_sigpipe() {
    let daemon = Daemon::start(&[]);
    let dir = TempDir::new("c-sigpipe");
    let relay = CuttingRelay::start(&dir.0, &daemon.uds, 1 << 20);
    let out = Command::new(compiled("sigpipe"))
        .arg(&relay.path)
        .arg("c.sigpipe")
        .output()
        .expect("the C program runs");
    drop(relay);
    assert!(
        out.status.success(),
        "{:?}: {}{}\nbinxd log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        daemon.log()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("ok ") && stdout.ends_with(" 0\n"),
        "{stdout}"
    );
}
