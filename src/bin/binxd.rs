//! binxd, the binx exchange daemon (the code is in binx-sidecar).

#![forbid(unsafe_code)]

fn main() {
    binx_sidecar::daemon::main()
}
