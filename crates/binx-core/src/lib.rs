//! The rules of the binx exchange, as one sans-IO state machine.
//!
//! Modelled on quinn-proto: [`Core`] has no sockets, no clock, no tokio and
//! no object store. Drivers hand it typed requests ([`Request`]) with the
//! current time; it answers at once or later, and everything it wants done
//! comes out of [`Core::poll_event`]: replies to requests that waited, DATA
//! replies that need pages read from storage ([`DataPlan`]), storage
//! commands (write a segment or a commit marker, delete an object, read a
//! marker) and forwarded requests. Completions go back in
//! (`Core::segment_written` and friends); wake-ups and deadlines are
//! [`Core::poll_timeout`] and [`Core::handle_timeout`].
//!
//! What a connection may send before a request reaches the core (HELLO
//! and the shared secret, refusals, per-connection limits) is [`door`]'s,
//! the same for binxd and the simulation.
//!
//! Every rule of a DATA reply is decided in one place ([`data`]) whether the
//! pages are in memory, in objects this daemon wrote, or in a commit marker
//! another daemon wrote (failover), and the BinX listeners and the HTTP
//! exchange use it alike. The consumer side of the exchange
//! ([`source::SourceMachine`]) is sans-IO too, so the deterministic
//! simulation in `tests/` runs the real rules on both ends.

#![forbid(unsafe_code)]

pub mod budget;
pub mod config;
pub mod core;
#[cfg(test)]
mod core_tests;
pub mod data;
pub mod door;
mod failover;
pub mod ids;
mod markers;
mod memory;
pub mod objects;
mod page_log;
pub mod peers;
pub mod refusal;
pub mod request;
pub mod shards;
pub mod silences;
pub mod snapshot;
pub mod source;
pub mod stats;
mod task;
pub mod task_id;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod tombstones;

pub use crate::budget::MemoryBudget;
pub use crate::config::CoreConfig;
pub use crate::core::{
    Command, Core, Event, Handled, MAX_REPLY_PAGES, Manifest, ManifestError, ManifestPlan,
    MarkerPlan, Outcome, Payload,
};
pub use crate::data::{DataPlan, PlanPart, PlanSubject, Resolved};
pub use crate::ids::{ConnId, LeaseId, OpId, Ticket};
pub use crate::objects::{
    Codec, CommitMarker, Durability, MarkerSegment, ObjectMeta, StoreFailure,
};
pub use crate::peers::PeerAllowList;
pub use crate::refusal::{Mutation, Refusal};
pub use crate::request::{BufferKey, DataQuery, Door, Encodings, Op, Request};
pub use crate::shards::{MAX_SHARDS, Shards, shard_of};
pub use crate::silences::RemoteSilences;
pub use crate::snapshot::{BufferSnapshot, BufferState, TaskSnapshot};
pub use crate::stats::{CoreStats, ReplyCount};
pub use crate::task_id::{MAX_TASK_ID_LEN, TaskId, validate_task_id};
pub use binx_proto::{BufferKind, SpoolPolicy};

/// A reply frame: header plus page bodies.
pub type Reply = binx_proto::OutFrame<binx_proto::BinReply>;

/// Longest abort reason or error text kept and echoed (docs/PROTOCOL.md section 4, "DELETE, ABORT_TASK and abandoned buffers").
pub const MAX_REASON_LEN: usize = 4096;
