//! binxd's admin API (list tasks, abort a task, drain, log level, stats),
//! generated at build time from `docs/admin.proto`, the one definition of
//! it: messages always, the `admin_server` service trait with feature
//! `server` (binx-server implements it), and with feature `client` the
//! generated `admin_client` plus [`AdminClient`], which dials a Unix socket
//! or TCP address and carries the bearer token. The `binx` CLI needs only
//! this crate, not the server.

mod generated {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("binx.admin.v1");
}

pub use generated::*;

#[cfg(feature = "client")]
mod client;
#[cfg(feature = "client")]
pub use client::{AdminClient, AdminError};
