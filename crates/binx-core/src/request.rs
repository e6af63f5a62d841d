//! Typed requests, parsed once from the wire header at the door. Past
//! [`Request::parse`] no code looks at a raw string or number again: task
//! ids are [`TaskId`]s, policies and kinds are enums, unknown message types
//! never get in, and what a transport may not ask is refused here.

use std::time::Duration;

use binx_proto::{BinReply, BinRequest, BufferKind, MessageType, SpoolPolicy, Status};

use crate::MAX_REASON_LEN;
use crate::objects::Codec;
use crate::refusal::Refusal;
use crate::task_id::TaskId;

/// Where a request came in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Door {
    /// TCP from another pod (or a remote consumer): no local-only requests,
    /// no forwarding.
    Remote,
    /// The Unix socket or shared memory: the local engine.
    Local,
}

/// One buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferKey {
    /// The task the buffer belongs to.
    pub task: TaskId,
    /// The buffer's id within its task.
    pub buffer: u64,
}

/// Codecs a client decodes in spooled segments (`accept_encodings`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Encodings(u8);

impl Encodings {
    /// Every codec binx knows.
    pub fn all() -> Self {
        Encodings(0b111)
    }

    /// Whether the client decodes `codec` (it always reads uncompressed).
    pub fn contains(self, codec: Codec) -> bool {
        codec == Codec::None || self.0 & (1 << codec.byte()) != 0
    }

    fn add(&mut self, codec: Codec) {
        self.0 |= 1 << codec.byte();
    }

    /// The names, for a forwarded request.
    pub fn names(self) -> Vec<String> {
        [Codec::None, Codec::Lz4, Codec::Zstd]
            .into_iter()
            .filter(|&c| self.0 & (1 << c.byte()) != 0)
            .map(|c| c.name().to_string())
            .collect()
    }
}

/// A DATA request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataQuery {
    /// The buffer read.
    pub key: BufferKey,
    /// The first page wanted; pages below it are acknowledged (unless `ack`).
    pub token: u64,
    /// `get_data_size`: only the sizes of the pages available.
    pub sizes_only: bool,
    /// `max_size_bytes` as asked (0: the server's default).
    pub max_size: u64,
    /// `max_wait_micros` as asked (the core caps it).
    pub max_wait: Duration,
    /// The client may be sent spooled segments (a URL) instead of pages.
    pub accept_spooled: bool,
    /// Codecs the client decodes in spooled segments.
    pub encodings: Encodings,
    /// `ack_token` (pipelined DATA): acknowledge only below it, not below
    /// `token`; never above `token` (checked at the door). The reply then
    /// carries `following_sizes`.
    pub ack: Option<u64>,
}

/// What a request asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// DATA: pages from a token on.
    Data(DataQuery),
    /// ACK: the consumer holds every page below `token`.
    Ack {
        /// The buffer acknowledged.
        key: BufferKey,
        /// Pages below it may be freed.
        token: u64,
    },
    /// DELETE: the consumer is done with the buffer.
    Delete {
        /// The buffer deleted.
        key: BufferKey,
    },
    /// OPEN_TASK: a producer declares a task.
    OpenTask {
        /// The task opened.
        task: TaskId,
        /// How its pages map to buffers.
        kind: BufferKind,
        /// `None`: buffers are added until the task-wide NO_MORE_PAGES.
        buffer_count: Option<u64>,
        /// `None`: the daemon's default.
        policy: Option<SpoolPolicy>,
    },
    /// The pages are in the frame body; `page_sizes` describe it.
    Enqueue {
        /// The buffer appended to (for BROADCAST and ARBITRARY, the task's).
        key: BufferKey,
        /// Size of each page in the body, in order (bytes).
        page_sizes: Vec<u64>,
        /// How long it may wait for room (capped by the core).
        max_wait: Duration,
        /// `append_token` (numbered appends): applied only if the buffer's
        /// first page would get this token.
        append_token: Option<u64>,
    },
    /// NO_MORE_PAGES: a buffer (or the whole task) is finished.
    NoMorePages {
        /// The task finished.
        task: TaskId,
        /// `None`: every buffer of the task (`buffer_id` 2^64-1).
        buffer: Option<u64>,
        /// `append_token` (numbered appends): applied only if the buffer
        /// ends at this token.
        append_token: Option<u64>,
    },
    /// ABORT_TASK: the producer gives up; its pages are dropped.
    AbortTask {
        /// The task aborted.
        task: TaskId,
        /// Cut to [`MAX_REASON_LEN`] bytes.
        reason: String,
    },
    /// PING: liveness.
    Ping,
    /// HELLO: the client names itself (and authenticates on TCP).
    Hello {
        /// The shared secret, when the daemon requires one.
        auth_token: String,
        /// The client's name, for logs.
        client_name: String,
    },
    /// SHM_ATTACH: move this Unix socket connection to shared memory.
    ShmAttach,
    /// DELETE_TASK: DELETE of buffers `0..buffers` of a task, as that many
    /// DELETEs in one request (docs/PROTOCOL.md section 11).
    DeleteTask {
        /// The task whose buffers are deleted.
        task: TaskId,
        /// How many buffers, from 0 (at least 1).
        buffers: u64,
    },
    /// What a finished task's commit manifest says, from buffer `from` on
    /// (docs/PROTOCOL.md section 10).
    Committed {
        /// The finished task.
        task: TaskId,
        /// The first buffer wanted.
        from: u64,
    },
}

/// A request that passed the door.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The client's request id, echoed in the reply.
    pub id: u64,
    /// What it asks.
    pub op: Op,
    /// DATA, ACK or DELETE from a local client: `host:port` of the sidecar
    /// that serves the buffer (proxy consumer).
    pub remote: Option<String>,
}

/// Longest `remote` accepted: a DNS name (253) and a port.
pub const MAX_REMOTE_LEN: usize = 261;

impl Request {
    /// Parses and checks a wire request arriving at `door`; a refusal is
    /// the BAD_REQUEST reply to send (DATA refusals carry the token).
    pub fn parse(raw: &BinRequest, door: Door) -> Result<Request, Box<BinReply>> {
        let refuse = |r: Refusal| Box::new(BinReply::error(raw, r.status(), r.to_string()));
        let bad = |e: String| refuse(Refusal::BadField(e));
        let unknown = || refuse(Refusal::UnknownMessageType { number: raw.r#type });
        let kind = raw.message_type().map_err(|_| unknown())?;
        if kind == MessageType::Unspecified {
            return Err(unknown());
        }
        if door == Door::Remote && kind.is_local_only() {
            return Err(refuse(Refusal::LocalOnly { kind }));
        }
        let remote = if raw.remote.is_empty() {
            None
        } else {
            if door == Door::Remote {
                return Err(refuse(Refusal::RemoteOverTcp {
                    kind,
                    remote: binx_proto::truncate(&raw.remote, 64).to_string(),
                }));
            }
            if !matches!(
                kind,
                MessageType::Data
                    | MessageType::Ack
                    | MessageType::Delete
                    | MessageType::DeleteTask
            ) {
                return Err(refuse(Refusal::RemoteNotForThisRequest {
                    kind,
                    remote: binx_proto::truncate(&raw.remote, 64).to_string(),
                }));
            }
            Some(parse_remote(&raw.remote).map_err(bad)?)
        };
        let task = || TaskId::parse(&raw.task_id).map_err(bad);
        let key = || {
            Ok::<_, Box<BinReply>>(BufferKey {
                task: task()?,
                buffer: raw.buffer_id,
            })
        };
        let op = match kind {
            MessageType::Data => {
                let mut encodings = Encodings::default();
                for name in &raw.accept_encodings {
                    if let Some(codec) = Codec::from_name(name) {
                        encodings.add(codec);
                    }
                }
                let key = key()?;
                if let Some(ack) = raw.ack_token
                    && ack > raw.page_token
                {
                    return Err(refuse(Refusal::AckAboveToken {
                        task: key.task,
                        buffer: key.buffer,
                        token: raw.page_token,
                        ack,
                    }));
                }
                Op::Data(DataQuery {
                    key,
                    token: raw.page_token,
                    sizes_only: raw.get_data_size,
                    max_size: raw.max_size_bytes,
                    max_wait: Duration::from_micros(raw.max_wait_micros),
                    accept_spooled: raw.accept_spooled,
                    encodings,
                    ack: raw.ack_token,
                })
            }
            MessageType::Ack => Op::Ack {
                key: key()?,
                token: raw.page_token,
            },
            MessageType::Delete => Op::Delete { key: key()? },
            MessageType::DeleteTask => {
                let task = task()?;
                if raw.buffer_count == 0 {
                    return Err(refuse(Refusal::NoBuffersToDelete { task }));
                }
                Op::DeleteTask {
                    task,
                    buffers: raw.buffer_count,
                }
            }
            MessageType::OpenTask => {
                let task = task()?;
                let kind = BufferKind::try_from(raw.buffer_kind).map_err(|_| {
                    refuse(Refusal::UnknownBufferKind {
                        task: task.clone(),
                        number: raw.buffer_kind,
                    })
                })?;
                let policy = if raw.spool_policy.is_empty() {
                    None
                } else {
                    Some(raw.spool_policy.parse::<SpoolPolicy>().map_err(|e| {
                        refuse(Refusal::BadSpoolPolicy {
                            task: task.clone(),
                            why: e.to_string(),
                        })
                    })?)
                };
                Op::OpenTask {
                    task,
                    kind,
                    buffer_count: (raw.buffer_count > 0).then_some(raw.buffer_count),
                    policy,
                }
            }
            MessageType::Enqueue => Op::Enqueue {
                key: key()?,
                page_sizes: raw.page_sizes.clone(),
                max_wait: Duration::from_micros(raw.max_wait_micros),
                append_token: raw.append_token,
            },
            MessageType::NoMorePages => Op::NoMorePages {
                task: task()?,
                buffer: (raw.buffer_id != binx_proto::ALL_BUFFERS).then_some(raw.buffer_id),
                append_token: raw.append_token,
            },
            MessageType::AbortTask => {
                let reason = binx_proto::truncate(&raw.reason, MAX_REASON_LEN);
                Op::AbortTask {
                    task: task()?,
                    reason: if reason.is_empty() {
                        "no reason given".into()
                    } else {
                        reason.to_string()
                    },
                }
            }
            MessageType::Ping => Op::Ping,
            MessageType::Hello => Op::Hello {
                auth_token: raw.auth_token.clone(),
                client_name: binx_proto::truncate(&raw.client_name, 256).to_string(),
            },
            MessageType::ShmAttach => Op::ShmAttach,
            MessageType::Committed => Op::Committed {
                task: task()?,
                from: raw.page_token,
            },
            MessageType::Unspecified => return Err(unknown()),
        };
        Ok(Request {
            id: raw.request_id,
            op,
            remote,
        })
    }

    /// What the request holds while it waits in its connection's queue,
    /// counted as pending memory: its body, and for an ENQUEUE
    /// [`binx_proto::ENQUEUE_PAGE_COST`] a page (its decoded sizes: an
    /// ENQUEUE of tens of thousands of empty pages holds half a MiB of them
    /// with no body at all).
    pub fn waiting_bytes(&self, body_len: u64) -> u64 {
        let pages = match &self.op {
            Op::Enqueue { page_sizes, .. } => page_sizes.len() as u64,
            _ => 0,
        };
        body_len.saturating_add(pages.saturating_mul(binx_proto::ENQUEUE_PAGE_COST))
    }

    /// The request's message type.
    pub fn kind(&self) -> MessageType {
        match &self.op {
            Op::Data(_) => MessageType::Data,
            Op::Ack { .. } => MessageType::Ack,
            Op::Delete { .. } => MessageType::Delete,
            Op::OpenTask { .. } => MessageType::OpenTask,
            Op::Enqueue { .. } => MessageType::Enqueue,
            Op::NoMorePages { .. } => MessageType::NoMorePages,
            Op::AbortTask { .. } => MessageType::AbortTask,
            Op::Ping => MessageType::Ping,
            Op::Hello { .. } => MessageType::Hello,
            Op::ShmAttach => MessageType::ShmAttach,
            Op::Committed { .. } => MessageType::Committed,
            Op::DeleteTask { .. } => MessageType::DeleteTask,
        }
    }

    /// The token a reply must carry (DATA; ENQUEUE and NO_MORE_PAGES with
    /// `append_token`), else 0.
    pub fn token(&self) -> u64 {
        match &self.op {
            Op::Data(q) => q.token,
            Op::Enqueue {
                append_token: Some(token),
                ..
            }
            | Op::NoMorePages {
                append_token: Some(token),
                ..
            } => *token,
            _ => 0,
        }
    }

    /// An ENQUEUE or NO_MORE_PAGES that names its `append_token`.
    pub fn token_named(&self) -> bool {
        matches!(
            &self.op,
            Op::Enqueue {
                append_token: Some(_),
                ..
            } | Op::NoMorePages {
                append_token: Some(_),
                ..
            }
        )
    }

    /// The task the request is about (PING, HELLO and SHM_ATTACH name none).
    pub fn task(&self) -> Option<&TaskId> {
        match &self.op {
            Op::Data(q) => Some(&q.key.task),
            Op::Ack { key, .. } | Op::Delete { key } | Op::Enqueue { key, .. } => Some(&key.task),
            Op::OpenTask { task, .. }
            | Op::NoMorePages { task, .. }
            | Op::AbortTask { task, .. }
            | Op::DeleteTask { task, .. }
            | Op::Committed { task, .. } => Some(task),
            Op::Ping | Op::Hello { .. } | Op::ShmAttach => None,
        }
    }

    /// The buffer a DATA, ACK or DELETE is about.
    pub fn buffer_key(&self) -> Option<&BufferKey> {
        match &self.op {
            Op::Data(q) => Some(&q.key),
            Op::Ack { key, .. } | Op::Delete { key } => Some(key),
            _ => None,
        }
    }

    /// The wire header of this request (for forwarding: `remote` cleared).
    pub fn to_wire(&self) -> BinRequest {
        let mut r = BinRequest::new(self.kind());
        r.request_id = self.id;
        match &self.op {
            Op::Data(q) => {
                r.task_id = q.key.task.to_string();
                r.buffer_id = q.key.buffer;
                r.page_token = q.token;
                r.get_data_size = q.sizes_only;
                r.max_size_bytes = q.max_size;
                r.max_wait_micros = q.max_wait.as_micros().min(u128::from(u64::MAX)) as u64;
                r.accept_spooled = q.accept_spooled;
                r.accept_encodings = q.encodings.names();
                r.ack_token = q.ack;
            }
            Op::Ack { key, token } => {
                r.task_id = key.task.to_string();
                r.buffer_id = key.buffer;
                r.page_token = *token;
            }
            Op::Delete { key } => {
                r.task_id = key.task.to_string();
                r.buffer_id = key.buffer;
            }
            Op::OpenTask {
                task,
                kind,
                buffer_count,
                policy,
            } => {
                r.task_id = task.to_string();
                r.buffer_kind = *kind as i32;
                r.buffer_count = buffer_count.unwrap_or(0);
                r.spool_policy = policy.map(|p| p.to_string()).unwrap_or_default();
            }
            Op::Enqueue {
                key,
                page_sizes,
                max_wait,
                append_token,
            } => {
                r.task_id = key.task.to_string();
                r.buffer_id = key.buffer;
                r.page_sizes = page_sizes.clone();
                r.max_wait_micros = max_wait.as_micros().min(u128::from(u64::MAX)) as u64;
                r.append_token = *append_token;
            }
            Op::NoMorePages {
                task,
                buffer,
                append_token,
            } => {
                r.task_id = task.to_string();
                r.buffer_id = buffer.unwrap_or(binx_proto::ALL_BUFFERS);
                r.append_token = *append_token;
            }
            Op::AbortTask { task, reason } => {
                r.task_id = task.to_string();
                r.reason = reason.clone();
            }
            Op::Hello {
                auth_token,
                client_name,
            } => {
                r.auth_token = auth_token.clone();
                r.client_name = client_name.clone();
            }
            Op::Committed { task, from } => {
                r.task_id = task.to_string();
                r.page_token = *from;
            }
            Op::DeleteTask { task, buffers } => {
                r.task_id = task.to_string();
                r.buffer_count = *buffers;
            }
            Op::Ping | Op::ShmAttach => {}
        }
        r
    }

    /// A reply to this request with `status` (DATA replies carry the token).
    pub fn reply(&self, status: Status) -> BinReply {
        let mut header = BinReply {
            request_id: self.id,
            r#type: self.kind() as i32,
            status: status as i32,
            ..Default::default()
        };
        header.page_token = self.token();
        header.page_next_token = self.token();
        header
    }

    /// The reply refusing this request.
    pub fn refuse(&self, refusal: &Refusal) -> BinReply {
        self.error(refusal.status(), refusal.to_string())
    }

    /// A refusal with a reason.
    pub fn error(&self, status: Status, error: impl Into<String>) -> BinReply {
        let mut header = self.reply(status);
        header.error = cap_error(error.into());
        header
    }
}

/// Cuts an error text to [`MAX_REASON_LEN`] bytes.
pub fn cap_error(mut error: String) -> String {
    if error.len() > MAX_REASON_LEN {
        let keep = binx_proto::truncate(&error, MAX_REASON_LEN).len();
        error.truncate(keep);
    }
    error
}

/// Checks `host:port`: a DNS name or IPv4 address, or `[IPv6]`, and a port.
pub fn parse_remote(remote: &str) -> Result<String, String> {
    let shown = binx_proto::truncate(remote, 64);
    if remote.len() > MAX_REMOTE_LEN {
        return Err(format!(
            "remote {shown:?}... is {} bytes long; a host:port is at most {MAX_REMOTE_LEN}",
            remote.len()
        ));
    }
    let Some((host, port)) = remote.rsplit_once(':') else {
        return Err(format!("remote {shown:?} is not host:port"));
    };
    let port_ok = !port.is_empty()
        && port.len() <= 5
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u32>().is_ok_and(|p| (1..=65535).contains(&p));
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        !inner.is_empty()
            && inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
    } else {
        !host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
            && !host.starts_with(['-', '.'])
    };
    if !(host_ok && port_ok) {
        return Err(format!(
            "remote {shown:?} is not host:port (a DNS name, an IPv4 address or [IPv6], and a port 1 to 65535)"
        ));
    }
    Ok(remote.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(kind: i32) -> BinRequest {
        BinRequest {
            r#type: kind,
            request_id: 7,
            task_id: "t".into(),
            ..Default::default()
        }
    }

    #[test]
    fn unknown_types_and_misplaced_fields_are_refused_at_the_door() {
        for kind in [0, 6, 15, 23, 99, -1] {
            let err = Request::parse(&raw(kind), Door::Local).unwrap_err();
            assert_eq!(err.status, Status::BadRequest as i32);
            assert!(err.error.contains("unknown message type"), "{}", err.error);
        }
        // DELETE_TASK (22) names how many buffers it deletes: none is
        // refused at the door, on either transport.
        for door in [Door::Local, Door::Remote] {
            let err = Request::parse(&raw(MessageType::DeleteTask as i32), door).unwrap_err();
            assert_eq!(err.status, Status::BadRequest as i32);
            assert!(err.error.contains("names no buffer"), "{}", err.error);
        }
        let mut r = raw(MessageType::DeleteTask as i32);
        r.buffer_count = 3;
        r.remote = "10.0.0.1:8091".into();
        assert!(Request::parse(&r, Door::Remote).is_err(), "remote over TCP");
        let request = Request::parse(&r, Door::Local).expect("a forwarded DELETE_TASK");
        assert_eq!(
            request.op,
            Op::DeleteTask {
                task: TaskId::parse("t").expect("valid"),
                buffers: 3
            }
        );
        assert_eq!(request.to_wire().buffer_count, 3);
        let mut r = raw(MessageType::Ping as i32);
        r.remote = "10.0.0.1:8091".into();
        assert!(Request::parse(&r, Door::Local).is_err(), "PING with remote");
        let mut r = raw(MessageType::Data as i32);
        r.remote = "10.0.0.1:8091".into();
        r.page_token = 5;
        let err = Request::parse(&r, Door::Remote).unwrap_err();
        assert_eq!(err.page_token, 5, "DATA refusals carry the token");
        assert!(Request::parse(&r, Door::Local).is_ok());
        let enqueue = raw(MessageType::Enqueue as i32);
        assert!(Request::parse(&enqueue, Door::Remote).is_err());
        let mut open = raw(MessageType::OpenTask as i32);
        open.task_id = "..".into();
        assert!(Request::parse(&open, Door::Local).is_err());
    }

    #[test]
    fn append_tokens_round_trip_and_mark_their_replies() {
        for kind in [MessageType::Enqueue, MessageType::NoMorePages] {
            let mut r = raw(kind as i32);
            r.buffer_id = 2;
            r.append_token = Some(0);
            let parsed = Request::parse(&r, Door::Local).unwrap();
            assert!(parsed.token_named());
            assert_eq!(parsed.to_wire().append_token, Some(0));
            r.append_token = Some(9);
            let parsed = Request::parse(&r, Door::Local).unwrap();
            let refusal = parsed.error(Status::Busy, "later");
            assert_eq!((refusal.page_token, refusal.page_next_token), (9, 9));
            r.append_token = None;
            let parsed = Request::parse(&r, Door::Local).unwrap();
            assert!(!parsed.token_named());
            assert_eq!(parsed.reply(Status::Ok).page_token, 0);
        }
    }

    #[test]
    fn remotes_must_be_host_and_port() {
        for ok in [
            "a:1",
            "pod-1.svc.cluster.local:8091",
            "10.1.2.3:65535",
            "[::1]:80",
        ] {
            assert!(parse_remote(ok).is_ok(), "{ok}");
        }
        let long = format!("{}:1", "a".repeat(300));
        for bad in [
            "a",
            "a:0",
            "a:65536",
            ":80",
            "a b:1",
            "-a:1",
            "[]:1",
            long.as_str(),
            "a:1x",
        ] {
            assert!(parse_remote(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn reasons_are_capped_and_requests_round_trip() {
        let mut r = raw(MessageType::AbortTask as i32);
        r.reason = "x".repeat(1 << 20);
        let parsed = Request::parse(&r, Door::Local).unwrap();
        let Op::AbortTask { reason, .. } = &parsed.op else {
            panic!()
        };
        assert_eq!(reason.len(), MAX_REASON_LEN);
        let mut d = raw(MessageType::Data as i32);
        d.page_token = 3;
        d.max_size_bytes = 10;
        d.accept_encodings = vec!["zstd".into(), "bogus".into()];
        let parsed = Request::parse(&d, Door::Local).unwrap();
        let back = parsed.to_wire();
        assert_eq!(back.page_token, 3);
        assert_eq!(back.accept_encodings, vec!["zstd".to_string()]);
        assert_eq!(Request::parse(&back, Door::Local).unwrap(), parsed);
        // A pipelined DATA keeps its acknowledgment when forwarded.
        d.ack_token = Some(2);
        let parsed = Request::parse(&d, Door::Local).unwrap();
        assert_eq!(parsed.to_wire().ack_token, Some(2));
    }

    #[test]
    fn a_pipelined_data_may_not_acknowledge_past_its_own_token() {
        let mut d = raw(MessageType::Data as i32);
        d.page_token = 3;
        d.ack_token = Some(4);
        let err = Request::parse(&d, Door::Remote).unwrap_err();
        assert_eq!(err.status, Status::BadRequest as i32);
        assert_eq!(err.page_token, 3);
        assert!(err.error.contains("ack_token 4"), "{}", err.error);
        d.ack_token = Some(3);
        assert!(Request::parse(&d, Door::Remote).is_ok());
        d.ack_token = Some(0);
        assert!(Request::parse(&d, Door::Remote).is_ok());
    }
}
