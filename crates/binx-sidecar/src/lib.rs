//! binxd and the binx CLI: configuration, wiring of the server crates, the
//! HTTP endpoint, and the human-facing commands. Each piece of real work
//! lives in binx-server or binx-client.

#![forbid(unsafe_code)]

pub mod bench;
pub mod config;
pub mod forwarder;
pub mod http;
pub mod tls;
pub mod units;
