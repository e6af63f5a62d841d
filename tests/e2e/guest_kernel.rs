//! Kernel TLS where the kernel has it. This machine's kernel offers no TLS
//! upper layer protocol, so here binxd's TLS tests only see rustls serve;
//! this test boots Debian's cloud kernel (which has the tls module) in an
//! emulated guest with scripts/ktls-vm.sh and runs the `tls::` tests there
//! with this very test binary, requiring kernel TLS
//! (`BINX_TEST_EXPECT_KERNEL_TLS=1`): pages across record edges, many
//! requests, forged records, a request arriving in pieces right after the
//! handshake, TLS 1.2 left to rustls, mutual TLS and the proxy consumer,
//! with the kernel sealing and opening the records.

use std::path::Path;

use crate::common::{binary, skipped};

#[test]
fn the_tls_tests_pass_with_kernel_tls_in_a_guest_kernel() {
    const TEST: &str = "guest_kernel::the_tls_tests_pass_with_kernel_tls_in_a_guest_kernel";
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(root.join("scripts/ktls-vm.sh"))
        .arg("test")
        .env("BINX_VM_E2E", std::env::current_exe().unwrap())
        .env("BINX_VM_BINXD", binary("binxd"))
        .env("BINX_VM_BINX", binary("binx"))
        .current_dir(root)
        .output()
        .unwrap();
    let console = String::from_utf8_lossy(&out.stdout);
    let errors = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(2) {
        skipped(TEST, errors.lines().last().unwrap_or("no guest here"));
        return;
    }
    assert!(out.status.success(), "{console}\n{errors}");
    // The guest kernel offered the ULP, and kernel TLS carried the tests.
    let ulps = console
        .lines()
        .find_map(|l| l.split_once("ULPs:").map(|(_, u)| u.to_string()))
        .unwrap_or_default();
    assert!(ulps.split_whitespace().any(|u| u == "tls"), "{console}");
    for test in [
        "tls::kernel_tls_moves_the_same_bytes_where_offered_and_rustls_serves_elsewhere ... ok",
        "tls::a_forged_tls_record_closes_only_its_own_connection ... ok",
        "tls::the_proxy_consumer_forwards_over_mutual_tls ... ok",
        "tls::a_request_arriving_in_pieces_after_the_handshake_is_served_whole ... ok",
        "tls::a_tls_1_2_client_is_served_by_rustls_even_where_the_kernel_takes_tls_1_3 ... ok",
    ] {
        assert!(console.contains(test), "{test} did not pass:\n{console}");
    }
}
