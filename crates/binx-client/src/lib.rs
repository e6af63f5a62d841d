//! binx client: one multiplexed connection per remote, an `ExchangeSource`
//! that pulls one remote buffer to its end exactly once, and a producer for
//! the local requests over the Unix socket (or shared memory attached on it).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backoff;
pub mod connection;
pub mod endpoint;
pub mod error;
pub mod pool;
pub mod producer;
mod shm;
pub mod source;
mod spooled;
pub mod tls;

pub use backoff::{Backoff, BackoffConfig};
pub use connection::{Called, Connection, ConnectionOptions, ServerIdentity};
pub use endpoint::{Endpoint, admin_uds_beside, default_uds_path};
pub use error::ClientError;
pub use pool::ConnectionPool;
pub use producer::{Producer, TaskSpec};
pub use source::{DELETE_GRACE, ExchangeSource, Page, SourceConfig};
