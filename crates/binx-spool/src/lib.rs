//! binx spooling: the object stores pages are spooled to, object names,
//! commit markers and manifests, and the lifecycle of spooled objects
//! (deletion on release, TTL and restart pruning). The segment object
//! format (docs/PROTOCOL.md section 4, "Spooling"; vectors in section 5) is binx-segment's, re-exported here.

#![forbid(unsafe_code)]

pub mod budget;
pub mod commit;
pub mod file_jobs;
mod manifest_cache;
pub mod naming;
/// The segment format lives in binx-segment (the client needs it without the
/// object stores); re-exported so `binx_spool::segment` keeps its paths.
pub use binx_segment as segment;
pub mod spool;
pub mod store;

pub use budget::{ReplyBudget, Reservation};
pub use commit::{
    KeyWrap, ManifestFile, MarkerFile, MarkerSegment, is_commit_object, is_manifest, manifest_path,
    marker_path,
};
pub use naming::{Durability, ObjectName, PackedName, object_of, validate_node_name};
pub use segment::{
    Codec, SegmentError, SegmentLimits, decode_segment, decode_segment_shared, encode_segment,
    encode_segment_content, encode_segment_pieces, new_key, segment_crc,
};
pub use spool::{
    CUT_PUT_AGE, Encryption, Presigned, Retrieval, SegmentWrite, Spool, SpoolConfig, SpoolError,
    SpoolStats, unix_ms,
};
pub use store::{ObjectSize, SpoolStore, StoreError, StoreKind, StoreOptions};
