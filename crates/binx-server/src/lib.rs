//! The binx exchange server: the I/O driver around the sans-IO exchange
//! core (`binx-core`), the BinX listeners on TCP, the Unix socket and shared
//! memory, the HTTP door (server, routes and the Presto/Trino exchange), and
//! the admin service.

#![forbid(unsafe_code)]

pub mod admin;
pub mod connection;
pub mod exchange;
pub mod forward;
pub mod histogram;

pub mod http;
pub mod internal_auth;
pub mod listener;
pub mod metrics;
pub mod shm;
pub mod stats;

pub use binx_core::{CoreConfig, CoreStats, SpoolPolicy};
pub use connection::{ConnectionConfig, ConnectionError, Refusal, Transport, serve_connection};
pub use exchange::{Answer, Exchange, ExchangeStats, Reply};
pub use forward::{ForwardReply, Forwarded, Forwarder};
pub use listener::{BinxServer, ListenConfig, ListenError, UdsAccess};
