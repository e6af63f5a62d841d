//! The binx exchange server: the buffer manager (plain state, no I/O), the
//! async layer that waits for it, and the BinX listeners on TCP and UDS.

pub mod manager;

pub use manager::{BufferManager, ManagerConfig, ManagerStats, Outcome, SpoolPolicy};
