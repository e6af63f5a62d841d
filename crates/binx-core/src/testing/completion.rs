//! The result of one command, as a driver hands it back to the core.

use std::time::Instant;

use binx_proto::{BinReply, Frame};

use crate::core::{Command, Core, Manifest, ManifestError};
use crate::ids::OpId;
use crate::objects::{CommitMarker, ObjectMeta, StoreFailure};

/// How a command ended; [`Completion::deliver`] calls the core's method
/// for it.
#[derive(Debug)]
pub enum Completion {
    /// [`Command::WriteSegment`].
    SegmentWritten(Result<ObjectMeta, StoreFailure>),
    /// [`Command::WriteMarker`].
    MarkerWritten(Result<(), StoreFailure>),
    /// [`Command::DeleteObject`].
    ObjectDeleted(Result<(), StoreFailure>),
    /// [`Command::DeleteMarker`].
    MarkerDeleted(Result<(), StoreFailure>),
    /// [`Command::ReadMarker`].
    MarkerRead(Result<Option<CommitMarker>, StoreFailure>),
    /// [`Command::ReleaseCommitted`] (a release is best effort: it has no
    /// failure).
    Released,
    /// [`Command::WriteManifest`].
    ManifestWritten(Result<(), StoreFailure>),
    /// [`Command::ReadManifest`].
    ManifestRead(Result<Option<Manifest>, ManifestError>),
    /// [`Command::DeleteManifest`].
    ManifestDeleted(Result<(), StoreFailure>),
    /// [`Command::Forward`].
    Forwarded(Result<Frame<BinReply>, String>),
}

impl Completion {
    /// `command` failed with `failure`.
    pub fn failed(command: &Command, failure: StoreFailure) -> Completion {
        match command {
            Command::WriteSegment { .. } => Completion::SegmentWritten(Err(failure)),
            Command::WriteMarker(_) => Completion::MarkerWritten(Err(failure)),
            Command::DeleteObject(_) => Completion::ObjectDeleted(Err(failure)),
            Command::DeleteMarker { .. } => Completion::MarkerDeleted(Err(failure)),
            Command::ReadMarker { .. } => Completion::MarkerRead(Err(failure)),
            Command::ReleaseCommitted(_) => Completion::Released,
            Command::Forward { .. } => Completion::Forwarded(Err(failure.reason)),
            Command::WriteManifest(_) => Completion::ManifestWritten(Err(failure)),
            Command::ReadManifest { .. } => Completion::ManifestRead(Err(if failure.transient {
                ManifestError::Unavailable(failure.reason)
            } else {
                ManifestError::Invalid(failure.reason)
            })),
            Command::DeleteManifest { .. } => Completion::ManifestDeleted(Err(failure)),
        }
    }

    /// Hands the result of command `op` to `core`.
    pub fn deliver(self, core: &mut Core, op: OpId, now: Instant) {
        match self {
            Completion::SegmentWritten(r) => core.segment_written(op, r, now),
            Completion::MarkerWritten(r) => core.marker_written(op, r, now),
            Completion::ObjectDeleted(r) => core.object_deleted(op, r, now),
            Completion::MarkerDeleted(r) => core.marker_deleted(op, r, now),
            Completion::MarkerRead(r) => core.marker_read(op, r, now),
            Completion::Released => core.released(op, now),
            Completion::ManifestWritten(r) => core.manifest_written(op, r, now),
            Completion::ManifestRead(r) => core.manifest_read(op, r, now),
            Completion::ManifestDeleted(r) => core.manifest_deleted(op, r, now),
            Completion::Forwarded(r) => core.forwarded(op, r, now),
        }
    }
}
