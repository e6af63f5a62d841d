//! Serving one BinX connection: preface, then frames read in order and
//! answered out of order. A request that must wait (long-poll, ENQUEUE
//! waiting for room) runs in its own task, so it never delays the replies
//! to other requests on the same connection.

use std::sync::Arc;
use std::time::Duration;

use binx_proto::{
    BinReply, BinRequest, Frame, FrameError, FrameReader, MessageType, OutFrame, PREFACE_LEN,
    Preface, PrefaceError, StallLimit, Status, WriteStalled, write_queued,
};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use binx_proto::Message as _;

use crate::exchange::{Answer, ConnectionEvent, Exchange, Reply};
use binx_core::{ConnId, Door, Payload, Request};

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
}

/// Per-connection limits and identity.
#[derive(Clone, Debug)]
pub struct ConnectionConfig {
    /// When set, the first request on a TCP connection must be a HELLO with it.
    pub shared_secret: Option<String>,
    /// Largest frame accepted (its length field, bytes).
    pub max_frame_length: usize,
    /// Requests that may wait at once on one connection; past it a request
    /// is answered BUSY at once, and the connection keeps being read.
    pub max_outstanding_requests: usize,
    /// Name sent in HELLO replies.
    pub server_name: String,
    /// Time a peer has to send its preface, and then (when a shared secret
    /// is set, on TCP) its HELLO.
    pub handshake_timeout: Duration,
    /// A connection with no request outstanding that sends nothing for
    /// this long is closed; `None` never.
    pub idle_timeout: Option<Duration>,
    /// A connection whose replies cannot be written for this long (its
    /// peer made no room in the socket's buffers) is closed, freeing the
    /// replies it held; `None` never.
    pub write_stall_timeout: Option<Duration>,
    /// Regions handed to Unix socket clients that send SHM_ATTACH; `None`
    /// refuses it.
    pub shm: Option<binx_shm::ShmConfig>,
    /// Shared memory connections at once (each holds two regions); past it
    /// SHM_ATTACH is BUSY and the client stays on the socket.
    pub shm_max_connections: usize,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        ConnectionConfig {
            shared_secret: None,
            max_frame_length: binx_proto::DEFAULT_MAX_FRAME_LENGTH,
            max_outstanding_requests: 1024,
            server_name: "binxd".into(),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Some(Duration::from_secs(300)),
            write_stall_timeout: Some(Duration::from_secs(60)),
            shm: None,
            shm_max_connections: 8,
        }
    }
}

/// Why a connection ended other than by a clean close.
#[derive(Debug, Error)]
pub enum ConnectionError {
    /// No preface within handshake_timeout.
    #[error("peer sent no preface within {0:?}")]
    HandshakeTimeout(Duration),
    /// Not an error to report: the peer closed without sending a byte.
    #[error("peer closed before sending its preface")]
    ClosedBeforePreface,
    /// No HELLO within handshake_timeout, where a shared secret requires one.
    #[error("peer sent no HELLO within {0:?} (a shared secret is set)")]
    HelloTimeout(Duration),
    /// Silent past idle_timeout with nothing outstanding.
    #[error("peer sent nothing for {0:?} with no request outstanding (idle_timeout)")]
    IdleTimeout(Duration),
    /// Replies could not be written for write_stall_timeout.
    #[error("peer made no room for its replies for {0:?} (write_stall_timeout)")]
    WriteStalled(Duration),
    /// The first bytes were not a BinX preface of a version served.
    #[error("bad preface: {0}")]
    Preface(#[from] PrefaceError),
    /// A frame could not be read (length, header).
    #[error("malformed frame: {0}")]
    Frame(#[from] FrameError),
    /// A wrong or missing HELLO secret.
    #[error("peer failed to authenticate: {0}")]
    Unauthenticated(String),
    /// Refused at the door (a limit, a uid not allowed).
    #[error("connection refused: {0}")]
    Refused(String),
    /// The socket failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// Replies queued for the writer; bounded so a peer that does not read
/// stops the reading of its own requests.
const REPLY_QUEUE: usize = 256;

/// Largest frame read before a TCP peer has authenticated, when a shared
/// secret is set: a HELLO has no body and a short header (its token and
/// client name), so 16 KiB is ample, and it stays within the reader's small
/// receive buffer: a stranger never makes binxd grow one.
pub const PRE_AUTH_MAX_FRAME: usize = 16 * 1024;

/// Serves one connection until the peer closes it or breaks the protocol.
pub async fn serve_connection<R, W>(
    reader: R,
    writer: W,
    transport: Transport,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
    refusal: Option<Refusal>,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (reader, writer, peer) = handshake(reader, writer, &config).await.inspect_err(|e| {
        if matches!(e, ConnectionError::HandshakeTimeout(_)) {
            exchange.count(ConnectionEvent::TimedOut);
        }
    })?;
    let frames = FrameReader::new(reader, config.max_frame_length);
    serve_frames(
        frames,
        None,
        writer,
        Link { transport, peer },
        exchange,
        config,
        refusal,
    )
    .await
}

/// What a connection is: its transport, and the version its peer speaks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Link {
    pub transport: Transport,
    /// The peer's preface: a 1.0 peer (minor 0) reads only format 1
    /// segment objects.
    pub peer: Preface,
}

/// Exchanges prefaces: the peer's first, within the handshake timeout;
/// returns the peer's (its minor version decides what it can read).
pub(crate) async fn handshake<R, W>(
    mut reader: R,
    mut writer: W,
    config: &ConnectionConfig,
) -> Result<(R, W, Preface), ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; PREFACE_LEN];
    let read_preface = async {
        let mut filled = 0;
        while filled < PREFACE_LEN {
            match reader.read(&mut preface[filled..]).await? {
                // Gone before saying anything (a probe, a client that
                // changed its mind): a normal close, not an error.
                0 if filled == 0 => return Err(ConnectionError::ClosedBeforePreface),
                0 => {
                    return Err(ConnectionError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("peer closed after {filled} of the preface's {PREFACE_LEN} bytes"),
                    )));
                }
                n => filled += n,
            }
        }
        Ok(())
    };
    match tokio::time::timeout(config.handshake_timeout, read_preface).await {
        Err(_) => return Err(ConnectionError::HandshakeTimeout(config.handshake_timeout)),
        Ok(read) => read?,
    }
    let checked = Preface::decode_compatible(&preface);
    // Our preface goes out either way, so a peer of another version learns ours.
    writer.write_all(&Preface::CURRENT.encode()).await?;
    writer.flush().await?;
    let peer = checked?;
    Ok((reader, writer, peer))
}

/// A request already read from the connection, or the error reading it.
pub(crate) type FirstFrame = Result<Frame<BinRequest>, FrameError>;

/// Serves the frames of a connection whose prefaces are exchanged; `first`
/// is a request already read from `frames`.
pub(crate) async fn serve_frames<R, W>(
    frames: FrameReader<R, BinRequest>,
    first: Option<FirstFrame>,
    writer: W,
    link: Link,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
    refusal: Option<Refusal>,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Reply>(REPLY_QUEUE);
    let writer = StallLimit::new(writer, config.write_stall_timeout);
    let writer_task = tokio::spawn(write_replies(writer, rx, exchange.clone()));
    let mut result = read_requests(frames, first, link, &exchange, &config, refusal, &tx).await;
    if let Err(ConnectionError::Frame(frame_error)) = &result {
        let header = BinReply {
            status: Status::BadRequest as i32,
            error: format!("malformed frame, closing the connection: {frame_error}"),
            ..Default::default()
        };
        let _ = tx.send(OutFrame::new(header)).await;
    }
    drop(tx);
    // The writer ends once its queue is empty, or at the stall limit.
    let stalled = writer_task.await.unwrap_or(false);
    if let (true, Some(limit)) = (stalled, config.write_stall_timeout)
        && matches!(result, Ok(()) | Err(ConnectionError::Io(_)))
    {
        result = Err(ConnectionError::WriteStalled(limit));
    }
    match &result {
        Ok(()) | Err(ConnectionError::HelloTimeout(_) | ConnectionError::IdleTimeout(_)) => {}
        Err(ConnectionError::WriteStalled(_)) => exchange.count(ConnectionEvent::TimedOut),
        Err(_) => exchange.count(ConnectionEvent::ProtocolError),
    }
    result
}

/// Why the listener will not serve a connection: its first request is
/// answered with `status` and `reason`, then it is closed.
#[derive(Clone, Debug)]
pub struct Refusal {
    /// The status of the reply to the first request.
    pub status: Status,
    /// Its error text.
    pub reason: String,
}

async fn read_requests<R>(
    frames: FrameReader<R, BinRequest>,
    first: Option<FirstFrame>,
    link: Link,
    exchange: &Exchange,
    config: &ConnectionConfig,
    refusal: Option<Refusal>,
    tx: &mpsc::Sender<Reply>,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
{
    let conn = exchange.new_connection();
    let result = read_loop(frames, first, link, exchange, config, refusal, tx, conn).await;
    exchange.connection_closed(conn);
    result
}

#[allow(clippy::too_many_arguments)]
async fn read_loop<R>(
    mut frames: FrameReader<R, BinRequest>,
    mut first: Option<FirstFrame>,
    link: Link,
    exchange: &Exchange,
    config: &ConnectionConfig,
    refusal: Option<Refusal>,
    tx: &mpsc::Sender<Reply>,
    conn: ConnId,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
{
    let Link { transport, peer } = link;
    // Dropping the set when the connection ends cancels its waiting requests.
    let mut waiting: JoinSet<u64> = JoinSet::new();
    let mut authenticated = transport != Transport::Tcp || config.shared_secret.is_none();
    if !authenticated {
        frames.set_max_frame_length(PRE_AUTH_MAX_FRAME.min(config.max_frame_length));
    }
    let door = match transport {
        Transport::Tcp => Door::Remote,
        Transport::Uds | Transport::SharedMemory => Door::Local,
    };
    let hello_deadline = tokio::time::Instant::now() + config.handshake_timeout;
    // Bytes of this connection's request bodies still waiting to be applied.
    let mut waiting_bodies: u64 = 0;
    loop {
        reap(&mut waiting, &mut waiting_bodies);
        let next = match first.take() {
            Some(frame) => Some(frame),
            None if !authenticated => {
                match tokio::time::timeout_at(hello_deadline, next_frame(&mut frames, tx)).await {
                    Ok(next) => next?,
                    Err(_) => {
                        exchange.count(ConnectionEvent::TimedOut);
                        return Err(ConnectionError::HelloTimeout(config.handshake_timeout));
                    }
                }
            }
            None => match config.idle_timeout {
                None => next_frame(&mut frames, tx).await?,
                Some(idle) => loop {
                    // The reader is cancel-safe: bytes read stay buffered.
                    match tokio::time::timeout(idle, next_frame(&mut frames, tx)).await {
                        Ok(next) => break next?,
                        Err(_) => {
                            reap(&mut waiting, &mut waiting_bodies);
                            if waiting.is_empty() {
                                exchange.count(ConnectionEvent::TimedOut);
                                return Err(ConnectionError::IdleTimeout(idle));
                            }
                        }
                    }
                },
            },
        };
        let Some(frame) = next else {
            return Ok(());
        };
        let Frame {
            header: mut raw,
            body,
        } = frame?;
        if peer.minor == 0 {
            // A 1.0 peer reads only format 1 segment objects, and binx
            // writes format 2: it gets spooled pages inline (PROTOCOL.md
            // section 6b; every 1.0 client keeps working).
            raw.accept_spooled = false;
        }
        let backing = frames.last_backing();
        exchange.count(ConnectionEvent::Received(
            8 + raw.encoded_len() as u64 + body.len() as u64,
        ));
        let refuse = |reply: BinReply| {
            exchange.record_reply(&reply);
            Reply::new(reply)
        };
        if let Some(refusal) = &refusal {
            // A peer the listener refused learns why from its first reply.
            send(
                tx,
                refuse(BinReply::error(&raw, refusal.status, &refusal.reason)),
            )
            .await?;
            return Err(ConnectionError::Refused(refusal.reason.clone()));
        }
        let kind = raw.message_type();
        if kind == Ok(MessageType::Hello) {
            let reply = hello(&raw, transport, config, exchange);
            exchange.record_reply(&reply.header);
            let refused = reply.header.status_kind() == Status::Unauthenticated;
            if !refused && !authenticated {
                authenticated = true;
                frames.set_max_frame_length(config.max_frame_length);
            }
            send(tx, reply).await?;
            if refused {
                return Err(ConnectionError::Unauthenticated(
                    "wrong auth_token in HELLO".into(),
                ));
            }
            continue;
        }
        if !authenticated {
            send(
                tx,
                refuse(BinReply::error(
                    &raw,
                    Status::Unauthenticated,
                    "this binxd requires a HELLO with the shared secret as the first request on a TCP connection",
                )),
            )
            .await?;
            return Err(ConnectionError::Unauthenticated(
                "first request was not a HELLO".into(),
            ));
        }
        let request = match Request::parse(&raw, door) {
            Ok(request) => request,
            Err(header) => {
                send(tx, refuse(*header)).await?;
                continue;
            }
        };
        if kind == Ok(MessageType::ShmAttach) {
            let reply = BinReply::error(
                &raw,
                Status::BadRequest,
                shm_attach_refusal(transport, config),
            );
            send(tx, refuse(reply)).await?;
            continue;
        }
        // While memory is full, a connection that already has a body
        // waiting for room gets BUSY at once for the next ENQUEUE (its body
        // is dropped here), so pipelined ENQUEUEs cannot pile up past the
        // limit, and the connection keeps reading its ACKs, DATAs and
        // ABORTs, which may be what frees the memory.
        if kind == Ok(MessageType::Enqueue) && waiting_bodies > 0 && exchange.memory_full() {
            let reply = request.error(
                Status::Busy,
                "memory is full and an earlier ENQUEUE on this connection is still waiting for room; nothing of this one was stored, retry it",
            );
            send(tx, refuse(reply)).await?;
            continue;
        }
        if request.remote.is_some() && !exchange.forwards() {
            let reply = request.error(
                Status::BadRequest,
                format!(
                    "{} names remote {:?}, but this binxd does not forward",
                    request.kind().name(),
                    binx_proto::truncate(&raw.remote, 64)
                ),
            );
            send(tx, refuse(reply)).await?;
            continue;
        }
        // PING never waits, so it always flows; anything else past the
        // limit is BUSY at once (the core says BUSY, too, to a request that
        // would wait past its own count).
        if kind != Ok(MessageType::Ping) && waiting.len() >= config.max_outstanding_requests {
            let reply = request.error(
                Status::Busy,
                format!(
                    "{} requests are outstanding on this connection, the limit (max_outstanding_requests); retry when some are answered",
                    config.max_outstanding_requests
                ),
            );
            send(tx, refuse(reply)).await?;
            continue;
        }
        let body_len = body.len() as u64;
        let payload = Payload {
            bytes: body,
            chunk: Some(backing),
        };
        let kind = request.kind();
        let arrived = std::time::Instant::now();
        match exchange.submit(conn, request, payload) {
            Answer::Ready(reply) => {
                observe(exchange, kind, arrived, &reply);
                send(tx, reply).await?
            }
            Answer::Later(future) => {
                let tx = tx.clone();
                let exchange = exchange.clone();
                waiting_bodies += body_len;
                waiting.spawn(async move {
                    let reply = future.await;
                    observe(&exchange, kind, arrived, &reply);
                    let _ = tx.send(reply).await;
                    body_len
                });
            }
        }
    }
}

/// The next frame, or the end of the connection once its writer has
/// stopped (the peer made no room for `write_stall_timeout`, or the socket
/// broke): nothing read after that could be answered.
async fn next_frame<R: AsyncRead + Unpin>(
    frames: &mut FrameReader<R, BinRequest>,
    tx: &mpsc::Sender<Reply>,
) -> Result<Option<FirstFrame>, ConnectionError> {
    let writer_gone = || ConnectionError::Io(std::io::ErrorKind::BrokenPipe.into());
    // The writer's end first: a frame already buffered is not read after it.
    let next = tokio::select! {
        biased;
        () = tx.closed() => return Err(writer_gone()),
        next = frames.next() => next,
    };
    // It may have stopped while the frame was being read.
    if tx.is_closed() {
        return Err(writer_gone());
    }
    Ok(next)
}

/// Collects the waiting requests that were answered, and how many body
/// bytes are still waiting (none once nothing waits, even if a task died).
fn reap(waiting: &mut JoinSet<u64>, waiting_bodies: &mut u64) {
    while let Some(done) = waiting.try_join_next() {
        *waiting_bodies = waiting_bodies.saturating_sub(done.unwrap_or(0));
    }
    if waiting.is_empty() {
        *waiting_bodies = 0;
    }
}

/// Feeds the latency and reply-size histograms.
fn observe(exchange: &Exchange, kind: MessageType, arrived: std::time::Instant, reply: &Reply) {
    let body: usize = reply.body.iter().map(|piece| piece.len()).sum();
    exchange
        .histograms()
        .observe(kind, arrived.elapsed(), body as u64);
}

async fn send(tx: &mpsc::Sender<Reply>, reply: Reply) -> Result<(), ConnectionError> {
    tx.send(reply)
        .await
        .map_err(|_| ConnectionError::Io(std::io::ErrorKind::BrokenPipe.into()))
}

/// Why an SHM_ATTACH that reached the request loop is refused (one that
/// comes first on a Unix socket never gets there).
fn shm_attach_refusal(transport: Transport, config: &ConnectionConfig) -> String {
    match transport {
        Transport::Tcp => "SHM_ATTACH is a local request: send it over the Unix socket".into(),
        Transport::SharedMemory => "this connection already uses shared memory".into(),
        Transport::Uds if config.shm.is_none() => {
            "shared memory is off in this binxd (shm_enabled = false); keep using the Unix socket"
                .into()
        }
        Transport::Uds => {
            "SHM_ATTACH must be the first request on a Unix socket connection, sent alone".into()
        }
    }
}

fn hello(
    request: &BinRequest,
    transport: Transport,
    config: &ConnectionConfig,
    exchange: &Exchange,
) -> Reply {
    if transport == Transport::Tcp
        && let Some(secret) = &config.shared_secret
        && !crate::internal_auth::secret_matches(request.auth_token.as_bytes(), secret.as_bytes())
    {
        return Reply::new(BinReply::error(
            request,
            Status::Unauthenticated,
            "HELLO auth_token does not match this binxd's shared secret",
        ));
    }
    let mut header = BinReply::to(request, Status::Ok);
    header.server_name = config.server_name.clone();
    header.capabilities = exchange.capabilities();
    if transport != Transport::Tcp && config.shm.is_some() {
        header.capabilities.push("shm".into());
    }
    Reply::new(header)
}

/// Writes the queued replies until the queue closes or writing fails;
/// returns whether it stopped because the peer read nothing for the stall
/// limit.
async fn write_replies<W: AsyncWrite + Unpin>(
    writer: StallLimit<W>,
    mut rx: mpsc::Receiver<Reply>,
    exchange: Exchange,
) -> bool {
    let sent = |bytes| {
        exchange.count(ConnectionEvent::Sent(bytes));
        true
    };
    match write_queued(writer, &mut rx, sent).await {
        Ok(()) => false,
        Err(e) => {
            tracing::debug!(error = %e, "writing replies failed; closing the connection");
            matches!(&e, FrameError::Io(io) if WriteStalled::is(io))
        }
    }
}
