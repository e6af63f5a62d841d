//! Who may use binxd's Unix socket: its mode (0660 by default) and group,
//! and the uid allow list checked with SO_PEERCRED. A refused peer learns
//! why; everybody else is served as before.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::process::Command;

use binx_client::ClientError;

use crate::common::{Daemon, binary};

/// A uid and gid no account on a test machine has.
const STRANGER: u32 = 4242;

fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `binx ping` against `daemon`'s socket as `uid`:`gid`.
fn ping_as(daemon: &Daemon, uid: u32, gid: u32) -> std::process::Output {
    Command::new(binary("binx"))
        .args(["ping", "--count", "1", "--remote"])
        .arg(&daemon.uds)
        .uid(uid)
        .gid(gid)
        .output()
        .expect("binx runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_is_0660_and_its_group_and_mode_are_configurable() {
    let daemon = Daemon::start(&[]);
    let meta = std::fs::metadata(&daemon.uds).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);

    let daemon = Daemon::start(&["--uds-mode", "0600", "--uds-group", &STRANGER.to_string()]);
    let meta = std::fs::metadata(&daemon.uds).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.gid(), STRANGER);
    // The owner is still served.
    daemon.connect_uds().ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_permissions_keep_out_other_users_and_let_the_group_in() {
    if !is_root() {
        crate::common::skipped(
            "security::file_permissions_keep_out_other_users_and_let_the_group_in",
            "needs root to run a client as another uid",
        );
        return;
    }
    // Mode 0660, owner root, group root: a stranger cannot connect.
    let daemon = Daemon::start(&[]);
    let out = ping_as(&daemon, STRANGER, STRANGER);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.to_lowercase().contains("permission denied"), "{err}");

    // The socket's group is the stranger's: now it can.
    let daemon = Daemon::start(&["--uds-group", &STRANGER.to_string()]);
    let out = ping_as(&daemon, STRANGER, STRANGER);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // With an allow list that names only root, the stranger gets through the
    // file permissions but is refused by uid, with the reason.
    let daemon = Daemon::start(&[
        "--uds-group",
        &STRANGER.to_string(),
        "--uds-allowed-uids",
        "0",
    ]);
    let out = ping_as(&daemon, STRANGER, STRANGER);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("uid {STRANGER}")) && err.contains("uds_allowed_uids"),
        "{err}"
    );
    daemon.connect_uds().ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uid_outside_the_allow_list_is_refused_with_the_reason() {
    let me = std::fs::metadata("/proc/self").unwrap().uid();
    let other = if me == STRANGER {
        STRANGER + 1
    } else {
        STRANGER
    };
    let daemon = Daemon::start(&["--uds-allowed-uids", &format!("{other}, 65534")]);
    let err = daemon.connect_uds().ping().await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            ClientError::Refused {
                status: binx_proto::Status::Unauthenticated,
                ..
            }
        ) && text.contains(&format!("uid {me}"))
            && text.contains("uds_allowed_uids"),
        "{text}"
    );
    assert!(
        daemon.log_shows("Unix socket connection refused"),
        "{}",
        daemon.log()
    );
    // TCP is not the socket's business: it is served.
    daemon.connect_tcp().ping().await.unwrap();

    let allowed = Daemon::start(&["--uds-allowed-uids", &format!("{other},{me}")]);
    allowed.connect_uds().ping().await.unwrap();
}

#[test]
fn bad_socket_settings_stop_binxd_with_the_key_named() {
    for (flag, value, named) in [
        ("--uds-mode", "999", "uds_mode"),
        ("--uds-mode", "rw-rw----", "uds_mode"),
        ("--uds-group", "no-such-group-here", "uds_group"),
        ("--uds-allowed-uids", "root", "uds_allowed_uids"),
    ] {
        let out = Command::new(binary("binxd"))
            .args([flag, value, "--print-config"])
            .output()
            .expect("binxd runs");
        assert!(!out.status.success(), "{flag} {value} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(named), "{flag} {value}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_the_limit_is_told_why_and_served_once_a_slot_frees() {
    let daemon = Daemon::start(&["--max-connections", "1"]);
    // Daemon::start's readiness probes may hold the one slot for a moment.
    let first = daemon.connect_uds();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while first.ping().await.is_err() {
        assert!(std::time::Instant::now() < deadline, "{}", daemon.log());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let second = daemon.connect_tcp();
    let err = second.ping().await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Refused {
                status: binx_proto::Status::Busy,
                ..
            }
        ) && err
            .to_string()
            .contains("limit of 1 connections (max_connections)"),
        "{err}"
    );
    // The first connection is unaffected.
    first.ping().await.unwrap();
    drop(first);
    // Its slot frees; the refused client reconnects and is served.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while second.ping().await.is_err() {
        assert!(std::time::Instant::now() < deadline, "{}", daemon.log());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        daemon.log_shows("the connection limit is reached"),
        "{}",
        daemon.log()
    );
}
