//! The door of one BinX connection: the rules a request meets before the
//! core sees it, checked once, with no I/O (docs/PROTOCOL.md section 1,
//! "Connection", and section 4, "Requests and replies").
//!
//! A driver keeps one [`ConnectionDoor`] per connection and hands it every
//! frame header it reads; the door answers with a [`Verdict`]: a reply to
//! send at once (HELLO, a refusal), a typed [`Request`] to submit to the
//! core, or a reply after which the connection closes. What the door needs
//! to know about the exchange (is memory full, does it forward) comes
//! through [`ExchangeFacts`], so binxd and the simulation run the same door.

use binx_proto::{BinReply, BinRequest, MessageType, Status};

use crate::refusal::Refusal;
use crate::request::{Door, Request};

/// Largest frame read before a TCP peer has authenticated, when a shared
/// secret is set: a HELLO has no body and a short header (its token and
/// client name), so 16 KiB is ample, and it stays within a reader's small
/// receive buffer: a stranger never makes binxd grow one.
pub const PRE_AUTH_MAX_FRAME: usize = 16 * 1024;

/// Largest frame a TCP peer may send once authenticated (its length
/// field): no request it may send carries a body (ENQUEUE is local), so
/// its frames are a header at most, and fit a reader's small buffer. A
/// receive buffer holds the frame read (and is kept for the next), so a
/// larger limit would let a peer make binxd hold tens of MiB per
/// connection, outside the memory limit, with bodies it ignores.
pub const REMOTE_MAX_FRAME: usize = 4 + binx_proto::MAX_HEADER_LENGTH;

/// Which listener a connection came from; TCP peers are remote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// The TCP listener: a remote peer.
    Tcp,
    /// The Unix socket: the local engine.
    Uds,
    /// A Unix socket connection that attached shared memory.
    SharedMemory,
}

impl Transport {
    /// The name in logs and refusals.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "TCP",
            Transport::Uds => "Unix socket",
            Transport::SharedMemory => "shared memory",
        }
    }

    /// Which requests it may carry: local-only requests and forwarding
    /// need the Unix socket (or shared memory).
    pub fn door(self) -> Door {
        match self {
            Transport::Tcp => Door::Remote,
            Transport::Uds | Transport::SharedMemory => Door::Local,
        }
    }
}

/// The settings the door applies, the same for every connection.
#[derive(Clone, Debug)]
pub struct DoorConfig {
    /// When set, the first request on a TCP connection must be a HELLO with it.
    pub shared_secret: Option<String>,
    /// Largest frame accepted once authenticated (its length field, bytes).
    pub max_frame_length: usize,
    /// Requests that may wait at once on one connection; past it a request
    /// (other than PING) is answered BUSY at once.
    pub max_outstanding_requests: usize,
    /// Name sent in HELLO replies.
    pub server_name: String,
    /// Shared memory is offered to Unix socket clients.
    pub shm_offered: bool,
}

/// What the door asks of the exchange behind it.
pub trait ExchangeFacts {
    /// Whether the memory limit is reached now.
    fn memory_full(&self) -> bool;
    /// Whether a proxy consumer is configured (requests may name a remote).
    fn forwards(&self) -> bool;
    /// The capabilities a HELLO reply lists (without `shm` and
    /// `max-frame-bytes=`, which the door adds: they depend on the connection).
    fn capabilities(&self) -> Vec<String>;
}

/// Why the door closed a connection after its reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The listener refused the connection (a limit, a uid not allowed).
    Refused(String),
    /// A wrong HELLO secret, or another request before HELLO.
    Unauthenticated(String),
}

/// What to do with one request.
#[derive(Debug)]
pub enum Verdict {
    /// Send this reply now and keep reading (an accepted HELLO, a refusal).
    Reply(BinReply),
    /// Hand the request to the core.
    Submit(Request),
    /// Send this reply, then close the connection.
    Close {
        /// The last reply.
        reply: BinReply,
        /// Why the connection ends.
        reason: CloseReason,
    },
}

/// The state of one connection's door.
#[derive(Debug)]
pub struct ConnectionDoor {
    transport: Transport,
    /// The peer's protocol minor version (from its preface).
    peer_minor: u8,
    authenticated: bool,
    /// Set when the listener will not serve this connection.
    refusal: Option<(Status, String)>,
    /// Requests waiting for their answer, and their bodies' bytes.
    outstanding: usize,
    waiting_bodies: u64,
}

impl ConnectionDoor {
    /// The door of a connection whose prefaces were exchanged; with
    /// `refusal`, its first request is answered with it and it closes.
    pub fn new(
        transport: Transport,
        peer_minor: u8,
        config: &DoorConfig,
        refusal: Option<(Status, String)>,
    ) -> Self {
        ConnectionDoor {
            transport,
            peer_minor,
            authenticated: transport != Transport::Tcp || config.shared_secret.is_none(),
            refusal,
            outstanding: 0,
            waiting_bodies: 0,
        }
    }

    /// Whether a HELLO is still owed (TCP with a shared secret).
    pub fn awaits_hello(&self) -> bool {
        !self.authenticated
    }

    /// The largest frame to read next: small until the peer authenticated,
    /// a header's worth from a TCP peer after.
    pub fn max_frame_length(&self, config: &DoorConfig) -> usize {
        if !self.authenticated {
            PRE_AUTH_MAX_FRAME.min(config.max_frame_length)
        } else if self.transport == Transport::Tcp {
            REMOTE_MAX_FRAME.min(config.max_frame_length)
        } else {
            config.max_frame_length
        }
    }

    /// Requests submitted and not answered yet.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// A submitted request waits for its answer (its body, `body_len`
    /// bytes, with it).
    pub fn parked(&mut self, body_len: u64) {
        self.outstanding += 1;
        self.waiting_bodies += body_len;
    }

    /// A request that waited was answered.
    pub fn answered(&mut self, body_len: u64) {
        debug_assert!(
            self.outstanding > 0,
            "an answer for a request that was not parked"
        );
        self.outstanding = self.outstanding.saturating_sub(1);
        self.waiting_bodies = if self.outstanding == 0 {
            0
        } else {
            self.waiting_bodies.saturating_sub(body_len)
        };
    }

    /// Checks one request header; `raw` may be adjusted for the peer's
    /// version (a 1.0 peer is never sent spooled segments).
    pub fn check(
        &mut self,
        raw: &mut BinRequest,
        config: &DoorConfig,
        exchange: &dyn ExchangeFacts,
    ) -> Verdict {
        if self.peer_minor == 0 {
            // A 1.0 peer reads only format 1 segment objects, and binx
            // writes format 2: it gets spooled pages inline (every 1.0
            // client keeps working).
            raw.accept_spooled = false;
        }
        if let Some((status, reason)) = &self.refusal {
            // A peer the listener refused learns why from its first reply.
            return Verdict::Close {
                reply: BinReply::error(raw, *status, reason.as_str()),
                reason: CloseReason::Refused(reason.clone()),
            };
        }
        let kind = raw.message_type();
        if kind == Ok(MessageType::Hello) {
            return self.hello(raw, config, exchange);
        }
        if !self.authenticated {
            return Verdict::Close {
                reply: refuse(raw, &Refusal::HelloFirst),
                reason: CloseReason::Unauthenticated("first request was not a HELLO".into()),
            };
        }
        let request = match Request::parse(raw, self.transport.door()) {
            Ok(request) => request,
            Err(header) => return Verdict::Reply(*header),
        };
        if kind == Ok(MessageType::ShmAttach) {
            return Verdict::Reply(request.refuse(&Refusal::ShmAttachMisplaced(
                self.shm_attach_refusal(config),
            )));
        }
        // While memory is full, a connection that already has a body
        // waiting for room gets BUSY at once for the next ENQUEUE (its body
        // is dropped), so pipelined ENQUEUEs cannot pile up past the limit,
        // and the connection keeps reading its ACKs, DATAs and ABORTs,
        // which may be what frees the memory. An ENQUEUE of no page holds
        // none, so it goes on (refused, it would leave a numbered
        // NO_MORE_PAGES behind it applied at the same end).
        if kind == Ok(MessageType::Enqueue)
            && !raw.page_sizes.is_empty()
            && self.waiting_bodies > 0
            && exchange.memory_full()
        {
            return Verdict::Reply(request.refuse(&Refusal::MemoryFullBehindWaiting));
        }
        if request.remote.is_some() && !exchange.forwards() {
            return Verdict::Reply(request.refuse(&Refusal::DoesNotForward {
                kind: request.kind(),
                remote: binx_proto::truncate(&raw.remote, 64).to_string(),
            }));
        }
        // PING never waits, so it always flows; anything else past the
        // limit is BUSY at once. (The core counts what it parks per
        // connection too: a request the driver already passed on may still
        // be about to wait there.)
        if kind != Ok(MessageType::Ping) && self.outstanding >= config.max_outstanding_requests {
            return Verdict::Reply(request.refuse(&Refusal::TooManyOutstanding {
                limit: config.max_outstanding_requests,
            }));
        }
        Verdict::Submit(request)
    }

    fn hello(
        &mut self,
        raw: &BinRequest,
        config: &DoorConfig,
        exchange: &dyn ExchangeFacts,
    ) -> Verdict {
        if self.transport == Transport::Tcp
            && let Some(secret) = &config.shared_secret
            && !secret_matches(raw.auth_token.as_bytes(), secret.as_bytes())
        {
            return Verdict::Close {
                reply: refuse(raw, &Refusal::WrongSecret),
                reason: CloseReason::Unauthenticated("wrong auth_token in HELLO".into()),
            };
        }
        self.authenticated = true;
        let mut header = BinReply::to(raw, Status::Ok);
        header.server_name = config.server_name.clone();
        header.capabilities = exchange.capabilities();
        // What this connection reads from now on (a TCP peer sends no bodies).
        header.capabilities.push(format!(
            "{}{}",
            binx_proto::MAX_FRAME_BYTES,
            self.max_frame_length(config)
        ));
        if self.transport != Transport::Tcp && config.shm_offered {
            header.capabilities.push("shm".into());
        }
        Verdict::Reply(header)
    }

    /// Why an SHM_ATTACH that reached the door is refused (one that comes
    /// first on a Unix socket is taken by the driver before).
    fn shm_attach_refusal(&self, config: &DoorConfig) -> &'static str {
        match self.transport {
            Transport::Tcp => "SHM_ATTACH is a local request: send it over the Unix socket",
            Transport::SharedMemory => "this connection already uses shared memory",
            Transport::Uds if !config.shm_offered => {
                "shared memory is off in this binxd (shm_enabled = false); keep using the Unix socket"
            }
            Transport::Uds => {
                "SHM_ATTACH must be the first request on a Unix socket connection, sent alone"
            }
        }
    }
}

/// The reply refusing `raw` before it was parsed.
fn refuse(raw: &BinRequest, refusal: &Refusal) -> BinReply {
    BinReply::error(raw, refusal.status(), refusal.to_string())
}

/// Whether a secret someone sent equals ours, in time that does not depend
/// on where they differ (HELLO's auth_token, the admin bearer token).
pub fn secret_matches(given: &[u8], ours: &[u8]) -> bool {
    use subtle::ConstantTimeEq as _;
    bool::from(given.ct_eq(ours))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::CoreFacts;

    const FACTS: CoreFacts = CoreFacts {
        memory_full: false,
        forwards: false,
        capabilities: &["pipelined-data"],
    };

    fn config(secret: Option<&str>) -> DoorConfig {
        DoorConfig {
            shared_secret: secret.map(str::to_string),
            max_frame_length: 1 << 20,
            max_outstanding_requests: 2,
            server_name: "door-test".into(),
            shm_offered: true,
        }
    }

    fn raw(kind: MessageType) -> BinRequest {
        BinRequest {
            request_id: 7,
            r#type: kind as i32,
            task_id: "q.1.0.0".into(),
            ..Default::default()
        }
    }

    fn hello(token: &str) -> BinRequest {
        BinRequest {
            auth_token: token.into(),
            ..raw(MessageType::Hello)
        }
    }

    #[test]
    fn tcp_with_a_secret_takes_only_a_hello_with_it_first() {
        let config = config(Some("s3cret"));
        let mut door = ConnectionDoor::new(Transport::Tcp, 2, &config, None);
        assert!(door.awaits_hello());
        assert_eq!(door.max_frame_length(&config), PRE_AUTH_MAX_FRAME);
        match door.check(&mut raw(MessageType::Ping), &config, &FACTS) {
            Verdict::Close {
                reply,
                reason: CloseReason::Unauthenticated(_),
            } => assert_eq!(reply.status_kind(), Status::Unauthenticated),
            other => panic!("{other:?}"),
        }
        let mut door = ConnectionDoor::new(Transport::Tcp, 2, &config, None);
        assert!(matches!(
            door.check(&mut hello("guess"), &config, &FACTS),
            Verdict::Close {
                reason: CloseReason::Unauthenticated(_),
                ..
            }
        ));
        let mut door = ConnectionDoor::new(Transport::Tcp, 2, &config, None);
        match door.check(&mut hello("s3cret"), &config, &FACTS) {
            Verdict::Reply(reply) => {
                assert_eq!(reply.status_kind(), Status::Ok);
                assert_eq!(reply.server_name, "door-test");
                // Shared memory is for the local engine only; a TCP peer
                // is read a header's worth a frame.
                assert_eq!(
                    reply.capabilities,
                    vec![
                        "pipelined-data".to_string(),
                        format!("max-frame-bytes={REMOTE_MAX_FRAME}")
                    ]
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(!door.awaits_hello());
        // A header's worth: no request of a TCP peer carries a body.
        assert_eq!(door.max_frame_length(&config), REMOTE_MAX_FRAME);
        assert!(matches!(
            door.check(&mut raw(MessageType::Ping), &config, &FACTS),
            Verdict::Submit(_)
        ));
        let open = self::config(None);
        let door = ConnectionDoor::new(Transport::Tcp, 2, &open, None);
        assert_eq!(door.max_frame_length(&open), REMOTE_MAX_FRAME);
        let local = ConnectionDoor::new(Transport::Uds, 2, &open, None);
        assert_eq!(local.max_frame_length(&open), 1 << 20, "the engine's pages");
    }

    #[test]
    fn the_unix_socket_needs_no_hello_and_offers_shared_memory() {
        let config = config(Some("s3cret"));
        let mut door = ConnectionDoor::new(Transport::Uds, 2, &config, None);
        assert!(!door.awaits_hello());
        assert!(matches!(
            door.check(&mut raw(MessageType::Ping), &config, &FACTS),
            Verdict::Submit(_)
        ));
        match door.check(&mut hello(""), &config, &FACTS) {
            Verdict::Reply(reply) => {
                assert!(reply.capabilities.contains(&"shm".to_string()));
                // The engine's frames: the configured limit.
                let said = format!("max-frame-bytes={}", 1 << 20);
                assert!(
                    reply.capabilities.contains(&said),
                    "{:?}",
                    reply.capabilities
                );
            }
            other => panic!("{other:?}"),
        }
        match door.check(&mut raw(MessageType::ShmAttach), &config, &FACTS) {
            Verdict::Reply(reply) => assert!(
                Refusal::ShmAttachMisplaced(
                    "SHM_ATTACH must be the first request on a Unix socket connection, sent alone"
                )
                .is(reply.status, &reply.error),
                "{reply:?}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_refused_connection_answers_its_first_request_and_closes() {
        let config = config(None);
        let refusal = Some((Status::Busy, "4096 connections are open".to_string()));
        let mut door = ConnectionDoor::new(Transport::Tcp, 2, &config, refusal);
        match door.check(&mut raw(MessageType::Ping), &config, &FACTS) {
            Verdict::Close {
                reply,
                reason: CloseReason::Refused(reason),
            } => {
                assert_eq!(reply.status_kind(), Status::Busy);
                assert_eq!(reply.error, reason);
                assert_eq!(reply.request_id, 7);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn past_the_outstanding_limit_only_ping_flows() {
        let config = config(None);
        let mut door = ConnectionDoor::new(Transport::Uds, 2, &config, None);
        door.parked(0);
        door.parked(0);
        match door.check(&mut raw(MessageType::Ack), &config, &FACTS) {
            Verdict::Reply(reply) => assert!(
                Refusal::TooManyOutstanding { limit: 2 }.is(reply.status, &reply.error),
                "{reply:?}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            door.check(&mut raw(MessageType::Ping), &config, &FACTS),
            Verdict::Submit(_)
        ));
        door.answered(0);
        assert!(matches!(
            door.check(&mut raw(MessageType::Ack), &config, &FACTS),
            Verdict::Submit(_)
        ));
    }

    #[test]
    fn a_second_enqueue_while_memory_is_full_is_busy_at_once() {
        let config = config(None);
        let full = CoreFacts {
            memory_full: true,
            ..FACTS
        };
        let mut door = ConnectionDoor::new(Transport::Uds, 2, &config, None);
        let mut enqueue = BinRequest {
            page_sizes: vec![3],
            ..raw(MessageType::Enqueue)
        };
        assert!(matches!(
            door.check(&mut enqueue.clone(), &config, &full),
            Verdict::Submit(_)
        ));
        door.parked(3);
        match door.check(&mut enqueue, &config, &full) {
            Verdict::Reply(reply) => assert_eq!(reply.status_kind(), Status::Busy),
            other => panic!("{other:?}"),
        }
        // Once the first is answered, the next one goes to the core.
        door.answered(3);
        assert!(matches!(
            door.check(&mut raw(MessageType::Enqueue), &config, &full),
            Verdict::Submit(_)
        ));
    }

    #[test]
    fn a_remote_needs_a_forwarder_and_a_1_0_peer_is_never_sent_segments() {
        let config = config(None);
        let mut door = ConnectionDoor::new(Transport::Uds, 0, &config, None);
        let mut data = BinRequest {
            remote: "10.0.0.2:8091".into(),
            accept_spooled: true,
            ..raw(MessageType::Data)
        };
        match door.check(&mut data, &config, &FACTS) {
            Verdict::Reply(reply) => assert!(
                Refusal::DoesNotForward {
                    kind: MessageType::Data,
                    remote: "10.0.0.2:8091".into(),
                }
                .is(reply.status, &reply.error),
                "{reply:?}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(!data.accept_spooled);
        let forwarding = CoreFacts {
            forwards: true,
            ..FACTS
        };
        assert!(matches!(
            door.check(&mut data, &config, &forwarding),
            Verdict::Submit(_)
        ));
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;

        /// Any header a stranger could send: any type number, any
        /// strings, any sizes and tokens.
        fn any_header() -> impl Strategy<Value = BinRequest> {
            (
                any::<u64>(),
                prop_oneof![0i32..=25, any::<i32>()],
                ".{0,40}",
                any::<u64>(),
                any::<u64>(),
                ".{0,24}",
                prop::collection::vec(any::<u64>(), 0..4),
                ".{0,24}",
                any::<bool>(),
            )
                .prop_map(
                    |(id, kind, task, buffer, token, auth, sizes, remote, spooled)| BinRequest {
                        request_id: id,
                        r#type: kind,
                        task_id: task,
                        buffer_id: buffer,
                        page_token: token,
                        auth_token: auth,
                        page_sizes: sizes,
                        remote,
                        accept_spooled: spooled,
                        ..Default::default()
                    },
                )
        }

        proptest! {
            /// Before its HELLO, a TCP peer gets nothing but the HELLO
            /// answered: every other header closes the connection with
            /// UNAUTHENTICATED, and none reaches the core.
            #[test]
            fn nothing_but_the_secret_opens_a_tcp_door(headers in prop::collection::vec(any_header(), 1..8)) {
                let config = config(Some("s3cret"));
                let mut door = ConnectionDoor::new(Transport::Tcp, 2, &config, None);
                for mut raw in headers {
                    let kind = raw.message_type();
                    let right = kind == Ok(MessageType::Hello) && raw.auth_token == "s3cret";
                    match door.check(&mut raw, &config, &FACTS) {
                        Verdict::Reply(reply) => {
                            prop_assert!(right);
                            prop_assert_eq!(reply.status_kind(), Status::Ok);
                            return Ok(());
                        }
                        Verdict::Close { reply, reason: CloseReason::Unauthenticated(_) } => {
                            prop_assert!(!right);
                            prop_assert_eq!(reply.status_kind(), Status::Unauthenticated);
                            prop_assert_eq!(reply.request_id, raw.request_id);
                            return Ok(());
                        }
                        other => prop_assert!(false, "{:?}", other),
                    }
                }
            }

            /// Whatever an authenticated peer sends, the door answers it
            /// (naming its request id) or submits it, never panics, and
            /// never lets past the limit more than PING.
            #[test]
            fn every_header_is_answered_or_submitted(headers in prop::collection::vec(any_header(), 1..32)) {
                let config = config(None);
                for transport in [Transport::Tcp, Transport::Uds, Transport::SharedMemory] {
                    let mut door = ConnectionDoor::new(transport, 2, &config, None);
                    for mut raw in headers.clone() {
                        let id = raw.request_id;
                        let full = door.outstanding() >= config.max_outstanding_requests;
                        match door.check(&mut raw, &config, &FACTS) {
                            Verdict::Reply(reply) => prop_assert_eq!(reply.request_id, id),
                            Verdict::Submit(request) => {
                                prop_assert_eq!(request.id, id);
                                prop_assert!(!full || request.kind() == MessageType::Ping);
                                if transport == Transport::Tcp {
                                    // Local-only requests never pass on TCP.
                                    prop_assert!(request.remote.is_none());
                                }
                                door.parked(0);
                            }
                            Verdict::Close { .. } => prop_assert!(false, "closed without a refusal"),
                        }
                    }
                }
            }
        }
    }
}
