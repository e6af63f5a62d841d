//! The binx exchange server: the buffer manager (plain state, no I/O), the
//! async layer that waits for it, and the BinX listeners on TCP and UDS.

pub mod admin;
pub mod connection;
pub mod exchange;
pub mod forward;
pub mod listener;
pub mod manager;
pub mod presto;
pub mod shm;

pub use connection::{ConnectionConfig, ConnectionError, Refusal, Transport, serve_connection};
pub use exchange::{Exchange, ExchangeStats};
pub use forward::{Forwarded, Forwarder};
pub use listener::{BinxServer, ListenConfig, ListenError, UdsAccess};
pub use manager::{BufferManager, ManagerConfig, ManagerStats, Outcome, SpoolPolicy};
