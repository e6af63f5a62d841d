//! The BinX wire protocol, version 1 (see `docs/PROTOCOL.md`).
//!
//! This crate holds only what both ends of a connection share: the
//! connection preface, the protobuf messages, the frame codec with its size
//! limit, the splitting of a frame body into pages, and a writer that sends
//! frames with vectored writes so page bodies are never copied.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod assembler;
pub mod codec;
#[cfg(feature = "io")]
pub mod keepalive;
pub mod messages;
pub mod pages;
pub mod policy;
pub mod preface;
#[cfg(feature = "io")]
pub mod reader;
#[cfg(feature = "io")]
pub mod receive_budget;
#[cfg(feature = "io")]
pub mod stall;
#[cfg(feature = "io")]
pub mod writer;

pub use assembler::FrameAssembler;
pub use codec::{
    DEFAULT_MAX_FRAME_LENGTH, Frame, FrameCodec, FrameError, MAX_HEADER_LENGTH, OutFrame,
    encode_frame_head,
};
pub use messages::{
    BinReply, BinRequest, BufferKind, Committed, Inline, MessageType, Segment, Spooled, Status,
    segment,
};
pub use pages::{PageSplitError, split_pages};
pub use policy::{SpoolPolicy, is_instance_id, truncate};
pub use preface::{PREFACE_LEN, Preface, PrefaceError};
/// The protobuf trait of the messages (encode, decode, encoded_len).
pub use prost::Message;
/// Bytes of a value as a protobuf varint (for bounding header sizes).
pub use prost::encoding::encoded_len_varint;
#[cfg(feature = "io")]
pub use reader::FrameReader;
#[cfg(feature = "io")]
pub use receive_budget::ReceiveBudget;
#[cfg(feature = "io")]
pub use stall::{StallLimit, WriteStalled};
#[cfg(feature = "io")]
pub use writer::{WRITE_BATCH, write_frames, write_queued};

/// Default TCP port of the BinX listener.
pub const DEFAULT_TCP_PORT: u16 = 8091;

/// `buffer_id` that NO_MORE_PAGES uses to finish every buffer of a task.
pub const ALL_BUFFERS: u64 = u64::MAX;

/// The HELLO capability of a server that honours `ack_token` on DATA and
/// fills `following_sizes` (pipelined DATA, docs/PROTOCOL.md section 8).
pub const PIPELINED_DATA: &str = "pipelined-data";

/// The HELLO capability of a server that honours `append_token` on ENQUEUE
/// and NO_MORE_PAGES (numbered appends, docs/PROTOCOL.md section 9).
pub const APPEND_TOKEN: &str = "append-token";

/// The HELLO capability of a server that answers COMMITTED (docs/PROTOCOL.md
/// section 10).
pub const COMMITTED: &str = "committed";

/// The HELLO capability of a server that answers DELETE_TASK
/// (docs/PROTOCOL.md section 11, proposed).
pub const TASK_DELETE: &str = "task-delete";

/// The HELLO capability `max-enqueue-bytes=<n>` (docs/PROTOCOL.md): an
/// ENQUEUE whose bytes, with [`ENQUEUE_PAGE_COST`] for each of its pages,
/// are at most `n` is never refused as one that can never fit the server's
/// memory limit.
pub const MAX_ENQUEUE_BYTES: &str = "max-enqueue-bytes=";

/// The HELLO capability `max-pages-per-enqueue=<n>` (docs/PROTOCOL.md): an
/// ENQUEUE of more than `n` pages is refused (`BAD_REQUEST`); a client that
/// batches pages keeps each batch within it.
pub const MAX_PAGES_PER_ENQUEUE: &str = "max-pages-per-enqueue=";

/// The HELLO capability `max-frame-bytes=<n>` (docs/PROTOCOL.md): the
/// longest frame (its length field) the server reads on this connection; a
/// longer one closes the connection. A client that batches pages keeps each
/// ENQUEUE's frame within it, and refuses a page no frame of it carries.
pub const MAX_FRAME_BYTES: &str = "max-frame-bytes=";

/// What an ENQUEUE's frame holds besides its pages' bytes, at most: the
/// header's length field and a header with every field binx's clients set
/// (at most 11 bytes each), a task id of `task_id_len` bytes and at most 10
/// bytes for each page's size. A client keeps this plus the pages' bytes
/// within `max-frame-bytes=`.
pub const fn enqueue_frame_overhead(task_id_len: usize, pages: usize) -> u64 {
    (256 + task_id_len + 10 * pages) as u64
}

/// What one page of an ENQUEUE counts against `max-enqueue-bytes=` besides
/// its bytes: at least what the server's index holds for it.
pub const ENQUEUE_PAGE_COST: u64 = 128;

/// Buffers one COMMITTED reply lists at most: two varints of at most 10
/// bytes each per buffer, plus a node name and endpoint of at most 1 KiB
/// each, stay below 48 KiB of header, far within the 64 KiB limit.
pub const COMMITTED_PER_REPLY: usize = 2048;
