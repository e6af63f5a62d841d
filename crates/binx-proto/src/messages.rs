//! The protobuf messages of package `binx.v1`, derived by hand with prost
//! (no protoc needed). Field numbers and types follow PROTOCOL.md section 4.

use std::collections::BTreeMap;

/// What a request asks for; a reply carries its request's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum MessageType {
    Unspecified = 0,
    Data = 1,
    Ack = 2,
    Delete = 3,
    Ping = 4,
    Hello = 5,
    OpenTask = 16,
    Enqueue = 17,
    NoMorePages = 18,
    AbortTask = 19,
    /// Asks for shared memory on a Unix socket connection (docs/PROTOCOL.md
    /// section 7); the first request after the preface, sent alone.
    ShmAttach = 20,
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
        }
    }
}

/// Outcome of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Status {
    Unspecified = 0,
    Ok = 1,
    NoData = 2,
    ServerError = 3,
    Timeout = 4,
    BadRequest = 5,
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
    #[prost(uint64, tag = "1")]
    pub request_id: u64,
    #[prost(enumeration = "MessageType", tag = "2")]
    pub r#type: i32,
    #[prost(string, tag = "3")]
    pub task_id: String,
    #[prost(uint64, tag = "4")]
    pub buffer_id: u64,
    #[prost(uint64, tag = "5")]
    pub page_token: u64,
    #[prost(bool, tag = "6")]
    pub get_data_size: bool,
    #[prost(uint64, tag = "7")]
    pub max_size_bytes: u64,
    #[prost(uint64, tag = "8")]
    pub max_wait_micros: u64,
    #[prost(bool, tag = "9")]
    pub accept_spooled: bool,
    #[prost(string, repeated, tag = "10")]
    pub accept_encodings: Vec<String>,
    #[prost(string, tag = "11")]
    pub auth_token: String,
    #[prost(string, tag = "12")]
    pub client_name: String,
    #[prost(uint64, repeated, tag = "13")]
    pub page_sizes: Vec<u64>,
    #[prost(enumeration = "BufferKind", tag = "14")]
    pub buffer_kind: i32,
    #[prost(uint64, tag = "15")]
    pub buffer_count: u64,
    #[prost(string, tag = "16")]
    pub remote: String,
    #[prost(string, tag = "17")]
    pub reason: String,
    #[prost(string, tag = "18")]
    pub spool_policy: String,
}

/// Server to client: the header of every reply frame.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BinReply {
    #[prost(uint64, tag = "1")]
    pub request_id: u64,
    #[prost(enumeration = "MessageType", tag = "2")]
    pub r#type: i32,
    #[prost(enumeration = "Status", tag = "3")]
    pub status: i32,
    #[prost(bool, tag = "4")]
    pub buffer_complete: bool,
    #[prost(uint64, tag = "5")]
    pub page_token: u64,
    #[prost(uint64, tag = "6")]
    pub page_next_token: u64,
    #[prost(uint64, repeated, tag = "7")]
    pub remaining_bytes: Vec<u64>,
    #[prost(message, repeated, tag = "8")]
    pub segments: Vec<Segment>,
    #[prost(string, tag = "9")]
    pub error: String,
    #[prost(string, tag = "10")]
    pub server_name: String,
    #[prost(string, repeated, tag = "11")]
    pub capabilities: Vec<String>,
}

/// A run of consecutive pages, inline in the frame body or in a spooled object.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Segment {
    #[prost(uint64, tag = "1")]
    pub first_token: u64,
    #[prost(uint64, repeated, tag = "2")]
    pub page_sizes: Vec<u64>,
    #[prost(oneof = "segment::Body", tags = "3, 4")]
    pub body: Option<segment::Body>,
}

/// The oneof of [`Segment`].
pub mod segment {
    /// Where a segment's pages are.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Body {
        #[prost(message, tag = "3")]
        Inline(super::Inline),
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
    #[prost(string, tag = "1")]
    pub uri: String,
    #[prost(btree_map = "string, string", tag = "2")]
    pub headers: BTreeMap<String, String>,
    #[prost(uint64, tag = "3")]
    pub stored_size: u64,
    #[prost(bytes = "vec", tag = "4")]
    pub key: Vec<u8>,
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
    /// `page_token` and `page_next_token` (contract section 5: every DATA
    /// reply, errors included, names the token it answers).
    pub fn to(request: &BinRequest, status: Status) -> Self {
        let token = if request.r#type == MessageType::Data as i32 {
            request.page_token
        } else {
            0
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
