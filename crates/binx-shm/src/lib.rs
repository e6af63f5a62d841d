//! Shared-memory transport between a local engine and its sidecar
//! (docs/PROTOCOL.md section 6, "Shared memory", which also gives the layout).
//!
//! Over its Unix socket a client asks for shared memory; the sidecar creates
//! two sealed memfd regions, one per direction, and four eventfds, and passes
//! them with SCM_RIGHTS. From then on the BinX byte stream (the same frames
//! as on the socket) runs through the regions: the writer copies stream
//! bytes into a free slot and submits a descriptor (slot, generation,
//! offset, length); the reader copies them out, or on the client's side
//! reads them in place, and completes the slot when done with it (in any
//! order). The socket stays open only to notice when the peer goes away.
//!
//! - [`layout`]: where things are in a region;
//! - [`ring`]: the slot and ring state machines, with every check;
//! - [`mapping`]: memfd creation, sealing and mapping;
//! - [`stream`]: `AsyncRead`/`AsyncWrite` over the rings, with wake-ups;
//! - [`pass`]: passing descriptors over the socket.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod layout;
pub mod mapping;
pub mod pass;
pub mod ring;
pub mod stream;

use std::time::Duration;

use thiserror::Error;

pub use layout::Layout;
pub use mapping::Mapping;
pub use stream::{Link, Regions, ShmReader, ShmWriter, attach, serve};

/// Descriptors passed with the attach reply, in this order: the
/// client-to-sidecar region, the sidecar-to-client region, then the submit
/// and complete eventfds of the first region, then those of the second.
pub const PASSED_FDS: usize = 6;

/// Sizes and timing of the regions a sidecar hands out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Bytes of each region (one per direction).
    pub region_size: usize,
    /// Bytes of each slot.
    pub slot_size: usize,
    /// How long a side that finds nothing to do spins before it parks on its
    /// eventfd.
    pub spin: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            region_size: 64 << 20,
            slot_size: 1 << 20,
            spin: Duration::from_micros(50),
        }
    }
}

/// What went wrong with shared memory.
#[derive(Debug, Error)]
pub enum ShmError {
    /// Region or slot sizes that give no valid layout.
    #[error("shared memory settings: {0}")]
    Config(String),
    /// A received region is not one this side can map: bad seals, size,
    /// magic, version or geometry.
    #[error("shared memory region header: {0}")]
    BadHeader(String),
    /// The peer broke the ring protocol (or scribbled over the region).
    #[error("shared memory ring: {0}")]
    Ring(String),
    /// The file descriptors passed over the Unix socket were not the ones
    /// expected.
    #[error("passing shared memory descriptors: {0}")]
    Passing(String),
    /// A system call failed: what was being done, and the OS error.
    #[error("{0} failed: {1}")]
    Sys(&'static str, std::io::Error),
}

impl From<ShmError> for std::io::Error {
    fn from(e: ShmError) -> Self {
        match e {
            ShmError::Sys(_, ref io) => std::io::Error::new(io.kind(), e.to_string()),
            other => std::io::Error::new(std::io::ErrorKind::InvalidData, other.to_string()),
        }
    }
}
