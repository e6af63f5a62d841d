//! binxd: configuration, wiring of the server crates (the BinX listeners,
//! the HTTP door, the admin service), signals and drain. Each piece of real
//! work lives in binx-server,
//! binx-spool or binx-shm; the `binxd` binary (root package) calls
//! [`daemon::main`].

// Only `allocator` calls into C (glibc's mallopt).
#![deny(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[allow(unsafe_code)]
pub mod allocator;
pub mod config;
pub mod daemon;
pub mod forwarder;
pub mod tls;
pub mod units;
