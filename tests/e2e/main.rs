//! End-to-end tests: real binxd processes, real sockets.

mod admin;
mod azurite;
mod backpressure;
mod bench_cli;
mod c_abi;
mod chaos;
mod chart;
mod cli;
mod common;
mod drain;
mod engines;
mod exchange;
mod fake_gcs;
mod hostile;
mod http_exchange;
mod long_poll;
mod malformed;
mod metrics;
mod netns;
mod pipelined;
mod proxy;
mod s3;
mod security;
mod shm;
mod spool;
mod tls;
