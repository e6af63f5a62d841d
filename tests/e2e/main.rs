//! End-to-end tests: real binxd processes, real sockets.

mod chaos;
mod common;
mod exchange;
