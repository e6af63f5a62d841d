//! The protobuf messages of package `binx.v1`, derived by hand with prost
//! (no protoc needed). Field numbers and types follow docs/PROTOCOL.md section 3.

use std::collections::BTreeMap;

/// What a request asks for; a reply carries its request's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum MessageType {
    /// Never valid: a request of type 0 is BAD_REQUEST.
    Unspecified = 0,
    /// Read pages of a buffer from a token on (a long-poll when none is there yet).
    Data = 1,
    /// Acknowledge every page below a token, so the server may free them.
    Ack = 2,
    /// The consumer is done with a buffer: free it.
    Delete = 3,
    /// A round trip, nothing else.
    Ping = 4,
    /// Authenticate (TCP with a shared secret) and learn the server's name and capabilities.
    Hello = 5,
    /// Create a task with its buffer kind, count and spool policy (local only).
    OpenTask = 16,
    /// Add pages to a buffer (local only); may wait for room, or be BUSY.
    Enqueue = 17,
    /// Finish one buffer, or every buffer of the task (local only).
    NoMorePages = 18,
    /// Fail a task: consumers get SERVER_ERROR with the reason (local only).
    AbortTask = 19,
    /// Asks for shared memory on a Unix socket connection (docs/PROTOCOL.md
    /// section 6); the first request after the preface, sent alone.
    ShmAttach = 20,
    /// Where a finished task's output is, from its commit manifest (local
    /// only; docs/PROTOCOL.md section 10, proposed).
    Committed = 21,
    /// DELETE of buffers `0..buffer_count` of a task in one request, as
    /// that many DELETEs (docs/PROTOCOL.md section 11, proposed; capability
    /// `task-delete`). Forwarded like DELETE when `remote` is set.
    DeleteTask = 22,
}

impl MessageType {
    /// Requests only a local engine may send (UDS or shared memory).
    pub fn is_local_only(self) -> bool {
        matches!(
            self,
            MessageType::OpenTask
                | MessageType::Enqueue
                | MessageType::NoMorePages
                | MessageType::AbortTask
                | MessageType::ShmAttach
                | MessageType::Committed
        )
    }

    /// The protocol name of the type, as PROTOCOL.md spells it.
    pub fn name(self) -> &'static str {
        match self {
            MessageType::Unspecified => "UNSPECIFIED",
            MessageType::Data => "DATA",
            MessageType::Ack => "ACK",
            MessageType::Delete => "DELETE",
            MessageType::Ping => "PING",
            MessageType::Hello => "HELLO",
            MessageType::OpenTask => "OPEN_TASK",
            MessageType::Enqueue => "ENQUEUE",
            MessageType::NoMorePages => "NO_MORE_PAGES",
            MessageType::AbortTask => "ABORT_TASK",
            MessageType::ShmAttach => "SHM_ATTACH",
            MessageType::Committed => "COMMITTED",
            MessageType::DeleteTask => "DELETE_TASK",
        }
    }
}

/// Outcome of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Status {
    /// Never sent.
    Unspecified = 0,
    /// Done; a DATA reply may carry pages.
    Ok = 1,
    /// A DATA long-poll ended with no page yet; ask again at the same token.
    NoData = 2,
    /// The task failed or the server could not serve; `error` says why.
    ServerError = 3,
    /// A wait ran out.
    Timeout = 4,
    /// The request is wrong (unknown task, token out of range, a field missing); never retried.
    BadRequest = 5,
    /// Wrong or missing shared secret in HELLO, or a request before it.
    Unauthenticated = 6,
    /// Backpressure: the request stored nothing; retry later.
    Busy = 7,
}

impl Status {
    /// The protocol name of the status, as PROTOCOL.md spells it.
    pub fn name(self) -> &'static str {
        match self {
            Status::Unspecified => "UNSPECIFIED",
            Status::Ok => "OK",
            Status::NoData => "NO_DATA",
            Status::ServerError => "SERVER_ERROR",
            Status::Timeout => "TIMEOUT",
            Status::BadRequest => "BAD_REQUEST",
            Status::Unauthenticated => "UNAUTHENTICATED",
            Status::Busy => "BUSY",
        }
    }
}

/// How a task's pages reach its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum BufferKind {
    /// Each ENQUEUE names the one buffer that receives its pages.
    Partitioned = 0,
    /// Every buffer sees every page.
    Broadcast = 1,
    /// Each page goes to one buffer, whichever asks first.
    Arbitrary = 2,
}

impl BufferKind {
    /// The protocol name of the kind, as PROTOCOL.md spells it.
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Partitioned => "PARTITIONED",
            BufferKind::Broadcast => "BROADCAST",
            BufferKind::Arbitrary => "ARBITRARY",
        }
    }
}

/// Client to server: the header of every request frame.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BinRequest {
    /// Chosen by the client, echoed in the reply; 0 is left for connection-level errors.
    #[prost(uint64, tag = "1")]
    pub request_id: u64,
    /// A [`MessageType`].
    #[prost(enumeration = "MessageType", tag = "2")]
    pub r#type: i32,
    /// The task the request is about (section "Task ids").
    #[prost(string, tag = "3")]
    pub task_id: String,
    /// The buffer of the task (DATA, ACK, DELETE, ENQUEUE, NO_MORE_PAGES).
    #[prost(uint64, tag = "4")]
    pub buffer_id: u64,
    /// DATA: the first page wanted; ACK: every page below it is acknowledged.
    #[prost(uint64, tag = "5")]
    pub page_token: u64,
    /// DATA: also report the bytes left (`remaining_bytes`).
    #[prost(bool, tag = "6")]
    pub get_data_size: bool,
    /// DATA: at most this many page bytes in the reply (at least one page always comes); 0 asks for the server's default.
    #[prost(uint64, tag = "7")]
    pub max_size_bytes: u64,
    /// DATA and ENQUEUE: how long to wait for pages or room, capped by the server's `max_wait`.
    #[prost(uint64, tag = "8")]
    pub max_wait_micros: u64,
    /// DATA: the client can read spooled segments from storage.
    #[prost(bool, tag = "9")]
    pub accept_spooled: bool,
    /// DATA: segment codecs the client can decode (`lz4`, `zstd`).
    #[prost(string, repeated, tag = "10")]
    pub accept_encodings: Vec<String>,
    /// HELLO: the cluster's shared secret, on TCP when the server has one.
    #[prost(string, tag = "11")]
    pub auth_token: String,
    /// HELLO: who the client is, for logs.
    #[prost(string, tag = "12")]
    pub client_name: String,
    /// ENQUEUE: the size of each page in the frame body, in order.
    #[prost(uint64, repeated, tag = "13")]
    pub page_sizes: Vec<u64>,
    /// OPEN_TASK: a [`BufferKind`].
    #[prost(enumeration = "BufferKind", tag = "14")]
    pub buffer_kind: i32,
    /// OPEN_TASK: a fixed number of buffers; 0 for buffers added as consumers come.
    #[prost(uint64, tag = "15")]
    pub buffer_count: u64,
    /// Proxy consumer: the remote sidecar (`host:port`) that holds the buffer; empty for this one.
    #[prost(string, tag = "16")]
    pub remote: String,
    /// ABORT_TASK: why, shown to consumers.
    #[prost(string, tag = "17")]
    pub reason: String,
    /// OPEN_TASK: `off`, `overflow` or `always`; empty for the daemon's default.
    #[prost(string, tag = "18")]
    pub spool_policy: String,
    /// DATA, pipelined (capability `pipelined-data`): acknowledge only the
    /// pages below this token instead of below `page_token`, so that several
    /// DATA may be in flight and each stays exact to retry. At most
    /// `page_token`. Absent: the DATA acknowledges below `page_token`.
    #[prost(uint64, optional, tag = "19")]
    pub ack_token: Option<u64>,
    /// ENQUEUE and NO_MORE_PAGES, numbered appends (capability
    /// `append-token`): the token the buffer's next page must get for the
    /// request to take effect (ENQUEUE: its first page's; NO_MORE_PAGES:
    /// where the buffer ends). A producer that pipelines names it, so that
    /// an ENQUEUE sent behind one that was refused is refused too, and a
    /// resend after a lost reply is never applied twice. Absent: no check.
    #[prost(uint64, optional, tag = "20")]
    pub append_token: Option<u64>,
}

/// Server to client: the header of every reply frame.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BinReply {
    /// The request's id; 0 for a connection-level error.
    #[prost(uint64, tag = "1")]
    pub request_id: u64,
    /// The request's [`MessageType`].
    #[prost(enumeration = "MessageType", tag = "2")]
    pub r#type: i32,
    /// A [`Status`].
    #[prost(enumeration = "Status", tag = "3")]
    pub status: i32,
    /// DATA: every page of the buffer has been produced and this reply reaches its end.
    #[prost(bool, tag = "4")]
    pub buffer_complete: bool,
    /// DATA: the request's token, error replies included.
    #[prost(uint64, tag = "5")]
    pub page_token: u64,
    /// DATA: the token to ask for next (the token itself when no page came).
    #[prost(uint64, tag = "6")]
    pub page_next_token: u64,
    /// DATA with `get_data_size`: bytes produced and not yet sent.
    #[prost(uint64, repeated, tag = "7")]
    pub remaining_bytes: Vec<u64>,
    /// DATA: the pages of the reply, inline in the body or spooled.
    #[prost(message, repeated, tag = "8")]
    pub segments: Vec<Segment>,
    /// What was wrong, naming the task, buffer and token, on every error and BUSY.
    #[prost(string, tag = "9")]
    pub error: String,
    /// HELLO: the server's configured `name`.
    #[prost(string, tag = "10")]
    pub server_name: String,
    /// HELLO: what the server offers (`spool`, `proxy`, `lz4`, `zstd`, `node=...`, `shm`,
    /// `pipelined-data`).
    #[prost(string, repeated, tag = "11")]
    pub capabilities: Vec<String>,
    /// DATA with `ack_token`: sizes of pages from `page_next_token` on whose
    /// replies end where their sizes say (capped), so the client can tell
    /// where its next reply will end and ask for the one after it at once.
    #[prost(uint64, repeated, tag = "12")]
    pub following_sizes: Vec<u64>,
    /// COMMITTED: what a finished task's commit manifest says, for
    /// buffers `page_token` to `page_next_token` (docs/PROTOCOL.md
    /// section 10, proposed).
    #[prost(message, optional, boxed, tag = "13")]
    pub committed: Option<Box<Committed>>,
}

/// Where a finished task's output is and how large each of its buffers is
/// (the reply to COMMITTED).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Committed {
    /// The spool node name of the binxd that wrote the task.
    #[prost(string, tag = "1")]
    pub node: String,
    /// host:port other sidecars reach that binxd under.
    #[prost(string, tag = "2")]
    pub endpoint: String,
    /// Buffers of the task, in all.
    #[prost(uint64, tag = "3")]
    pub buffer_count: u64,
    /// Per buffer from the reply's `page_token` on: its page count.
    #[prost(uint64, repeated, tag = "4")]
    pub end_tokens: Vec<u64>,
    /// Per buffer from the reply's `page_token` on: its pages' bytes.
    #[prost(uint64, repeated, tag = "5")]
    pub bytes: Vec<u64>,
}

/// A run of consecutive pages, inline in the frame body or in a spooled object.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Segment {
    /// The token of the segment's first page.
    #[prost(uint64, tag = "1")]
    pub first_token: u64,
    /// The size of each of its pages, in order.
    #[prost(uint64, repeated, tag = "2")]
    pub page_sizes: Vec<u64>,
    /// Where the pages are: inline in the frame body, or spooled.
    #[prost(oneof = "segment::Body", tags = "3, 4")]
    pub body: Option<segment::Body>,
}

/// The oneof of [`Segment`].
pub mod segment {
    /// Where a segment's pages are.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Body {
        /// The pages follow in the frame body.
        #[prost(message, tag = "3")]
        Inline(super::Inline),
        /// The pages are in an object in storage.
        #[prost(message, tag = "4")]
        Spooled(super::Spooled),
    }
}

/// Marker: the segment's pages follow in the frame body.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Inline {}

/// The segment's pages are in an object in storage.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Spooled {
    /// Where to GET the object (a presigned URL, or a store path the client can reach).
    #[prost(string, tag = "1")]
    pub uri: String,
    /// Headers to send with the GET.
    #[prost(btree_map = "string, string", tag = "2")]
    pub headers: BTreeMap<String, String>,
    /// Bytes of the object as stored.
    #[prost(uint64, tag = "3")]
    pub stored_size: u64,
    /// The segment's AES-256-GCM key when it is encrypted, else empty.
    #[prost(bytes = "vec", tag = "4")]
    pub key: Vec<u8>,
    /// When `uri` stops working (Unix time, milliseconds).
    #[prost(uint64, tag = "5")]
    pub expires_at_unix_ms: u64,
}

impl BinRequest {
    /// A request of `kind` with every other field at its default.
    pub fn new(kind: MessageType) -> Self {
        BinRequest {
            r#type: kind as i32,
            ..Default::default()
        }
    }

    /// The request's type, or `Err` with the raw number when it is unknown.
    pub fn message_type(&self) -> Result<MessageType, i32> {
        MessageType::try_from(self.r#type).map_err(|_| self.r#type)
    }
}

impl BinReply {
    /// A reply to `request` with `status` and every other field at its
    /// default, except that a reply to DATA carries the request's token as
    /// `page_token` and `page_next_token` (docs/PROTOCOL.md section 4, "DATA": every DATA
    /// reply, errors included, names the token it answers), and a reply to
    /// an ENQUEUE or NO_MORE_PAGES with `append_token` carries that token
    /// (docs/PROTOCOL.md section 9, numbered appends).
    pub fn to(request: &BinRequest, status: Status) -> Self {
        let token = match request.message_type() {
            Ok(MessageType::Data) => request.page_token,
            Ok(MessageType::Enqueue | MessageType::NoMorePages) => {
                request.append_token.unwrap_or(0)
            }
            _ => 0,
        };
        BinReply {
            request_id: request.request_id,
            r#type: request.r#type,
            status: status as i32,
            page_token: token,
            page_next_token: token,
            ..Default::default()
        }
    }

    /// A refusal of `request` carrying a human-readable reason.
    pub fn error(request: &BinRequest, status: Status, error: impl Into<String>) -> Self {
        BinReply {
            error: error.into(),
            ..BinReply::to(request, status)
        }
    }

    /// The reply's status, `Unspecified` when the number is unknown.
    pub fn status_kind(&self) -> Status {
        Status::try_from(self.status).unwrap_or(Status::Unspecified)
    }
}

impl Segment {
    /// An inline segment of pages with these sizes starting at `first_token`.
    pub fn inline(first_token: u64, page_sizes: Vec<u64>) -> Self {
        Segment {
            first_token,
            page_sizes,
            body: Some(segment::Body::Inline(Inline {})),
        }
    }
}
