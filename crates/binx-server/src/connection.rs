//! Serving one BinX connection: preface, then frames read in order and
//! answered out of order. A request that must wait (long-poll, ENQUEUE
//! waiting for room) runs in its own task, so it never delays the replies
//! to other requests on the same connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use binx_proto::{
    BinReply, BinRequest, Frame, FrameError, FrameReader, MessageType, OutFrame, PREFACE_LEN,
    Preface, PrefaceError, StallLimit, Status, WriteStalled, write_queued,
};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;

use binx_proto::Message as _;

use crate::exchange::{Answer, ConnectionEvent, Exchange, Reply};
use binx_core::door::{CloseReason, ConnectionDoor, DoorConfig, Verdict};
use binx_core::{ConnId, Payload};

pub use binx_core::door::{PRE_AUTH_MAX_FRAME, Transport};

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
    /// A frame larger than a small receive buffer must be whole within
    /// this long of binxd taking room for it (else its connection closes),
    /// so a peer stalled inside one gives the room back to the others.
    pub frame_timeout: Duration,
    /// Regions handed to Unix socket clients that send SHM_ATTACH; `None`
    /// refuses it.
    pub shm: Option<binx_shm::ShmConfig>,
    /// Shared memory connections at once (each holds two regions); past it
    /// SHM_ATTACH is BUSY and the client stays on the socket.
    pub shm_max_connections: usize,
}

impl ConnectionConfig {
    /// A connection's frame reader: frames up to `max_frame_length`, its
    /// spare receive buffers within the budget every connection of
    /// `exchange` shares.
    pub(crate) fn frame_reader<R, H>(&self, exchange: &Exchange, reader: R) -> FrameReader<R, H>
    where
        R: AsyncRead + Unpin,
        H: binx_proto::Message + Default,
    {
        FrameReader::new(reader, self.max_frame_length)
            .with_receive_budget(exchange.receive_budget(), self.frame_timeout)
    }

    /// The rules of the door every request of a connection passes.
    pub fn door(&self) -> DoorConfig {
        DoorConfig {
            shared_secret: self.shared_secret.clone(),
            max_frame_length: self.max_frame_length,
            max_outstanding_requests: self.max_outstanding_requests,
            server_name: self.server_name.clone(),
            shm_offered: self.shm.is_some(),
        }
    }
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
            frame_timeout: Duration::from_secs(5),
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
    /// Closed before it authenticated to make room for a newer connection:
    /// that many TCP connections were waiting to authenticate.
    #[error(
        "closed before its HELLO: {0} TCP connections were waiting to authenticate, the most binxd keeps (the oldest goes)"
    )]
    Displaced(usize),
    /// Silent past idle_timeout with nothing outstanding.
    #[error("peer sent nothing for {0:?} with no request outstanding (idle_timeout)")]
    IdleTimeout(Duration),
    /// Replies could not be written for write_stall_timeout.
    #[error("peer made no room for its replies for {0:?} (write_stall_timeout)")]
    WriteStalled(Duration),
    /// The first bytes were not a BinX preface of a version served.
    #[error("bad preface: {0}")]
    Preface(#[from] PrefaceError),
    /// A frame could not be read (length, header, too slow, the socket).
    #[error("reading a frame: {0}")]
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

/// A connection that sent nothing for this long gives back the receive
/// buffers its reader keeps for reuse.
const RECEIVE_BUFFERS_KEPT_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Replies queued for the writer; bounded so a peer that does not read
/// stops the reading of its own requests.
const REPLY_QUEUE: usize = 256;

/// Bytes of reply frames queued for the writer past which the connection's
/// requests are not read until the writer has written some: a reply holds
/// its pages' memory until it is written, even once they are acknowledged
/// (and no longer counted against the memory limit), so a peer that reads
/// slowly, or not at all, holds at most this much (and the reply that
/// crossed it, and those of DATAs already waiting) through its own
/// requests. Well above what a pipelining consumer keeps in flight.
const UNSENT_REPLY_BYTES: u64 = 32 << 20;

/// One connection's reply bodies queued and not yet written, and the
/// wake-up of a reader that waits for them to drain.
#[derive(Debug, Default)]
struct UnsentReplies {
    bytes: AtomicU64,
    drained: Notify,
}

impl UnsentReplies {
    /// A reply is about to be queued: its whole frame counts (a header
    /// can be most of it: a `get_data_size` reply's 8,192 sizes, a DATA's
    /// `following_sizes`), as the writer reports it written.
    fn queued(&self, reply: &Reply) {
        let frame = 8 + reply.header.encoded_len() as u64 + reply.body_len() as u64;
        self.bytes.fetch_add(frame, Ordering::AcqRel);
    }

    /// The writer wrote frames of `bytes` in all.
    fn written(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let before = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                Some(b.saturating_sub(bytes))
            })
            .unwrap_or_default();
        if before > UNSENT_REPLY_BYTES {
            self.drained.notify_waiters();
        }
    }

    /// Returns once at most [`UNSENT_REPLY_BYTES`] wait to be written.
    async fn within_limit(&self) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.bytes.load(Ordering::Acquire) <= UNSENT_REPLY_BYTES {
                return;
            }
            drained.await;
        }
    }

    fn over_limit(&self) -> bool {
        self.bytes.load(Ordering::Acquire) > UNSENT_REPLY_BYTES
    }
}

/// Serves one connection until the peer closes it or breaks the protocol.
pub async fn serve_connection<R, W>(
    reader: R,
    writer: W,
    transport: Transport,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
    refusal: Option<Refusal>,
    authenticated: Option<OnAuthenticated>,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut authenticated = authenticated;
    // Where no HELLO is owed, a peer whose preface came has authenticated,
    // before it can see ours (and open another connection meanwhile).
    let no_hello_owed = transport != Transport::Tcp || config.shared_secret.is_none();
    let preface_came = || {
        if no_hello_owed && let Some(authenticated) = authenticated.take() {
            authenticated();
        }
    };
    let handshaken = handshake_then(reader, writer, &config, preface_came).await;
    let (reader, writer, peer) = handshaken.inspect_err(|e| {
        if matches!(e, ConnectionError::HandshakeTimeout(_)) {
            exchange.count(ConnectionEvent::TimedOut);
        }
    })?;
    let frames = config.frame_reader(&exchange, reader);
    serve_frames(
        frames,
        None,
        writer,
        Link { transport, peer },
        exchange,
        config,
        refusal,
        authenticated,
    )
    .await
}

/// Called once a connection's peer owes no HELLO (at once where none is
/// owed: the Unix socket, TCP without a shared secret).
pub type OnAuthenticated = Box<dyn FnOnce() + Send>;

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
    reader: R,
    writer: W,
    config: &ConnectionConfig,
) -> Result<(R, W, Preface), ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    handshake_then(reader, writer, config, || {}).await
}

/// [`handshake`], calling `preface_came` once the peer's preface is read
/// and checked, before ours is sent.
async fn handshake_then<R, W>(
    mut reader: R,
    mut writer: W,
    config: &ConnectionConfig,
    preface_came: impl FnOnce(),
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
    if checked.is_ok() {
        preface_came();
    }
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
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve_frames<R, W>(
    frames: FrameReader<R, BinRequest>,
    first: Option<FirstFrame>,
    writer: W,
    link: Link,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
    refusal: Option<Refusal>,
    authenticated: Option<OnAuthenticated>,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Reply>(REPLY_QUEUE);
    let unsent = Arc::new(UnsentReplies::default());
    let writer = StallLimit::new(writer, config.write_stall_timeout);
    let writer_task = tokio::spawn(write_replies(writer, rx, exchange.clone(), unsent.clone()));
    let queue = ReplyQueue { tx, unsent };
    let mut result = read_requests(
        frames,
        first,
        link,
        &exchange,
        &config,
        (refusal, authenticated),
        &queue,
    )
    .await;
    let tx = queue.tx;
    if let Err(ConnectionError::Frame(frame_error)) = &result
        && !matches!(frame_error, FrameError::Io(e) if socket_failed(e))
    {
        let what = match frame_error {
            FrameError::Stalled { .. } => "frame too slow",
            _ => "malformed frame",
        };
        let header = BinReply {
            status: Status::BadRequest as i32,
            error: format!("{what}, closing the connection: {frame_error}"),
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
        Err(
            ConnectionError::WriteStalled(_) | ConnectionError::Frame(FrameError::Stalled { .. }),
        ) => exchange.count(ConnectionEvent::TimedOut),
        // The socket failed under the reader: the kernel gave up on a
        // peer that vanished (keepalive, TCP_USER_TIMEOUT), or the peer
        // reset it. Not a frame it sent wrong.
        Err(ConnectionError::Frame(FrameError::Io(e))) if socket_failed(e) => {
            if e.kind() == std::io::ErrorKind::TimedOut {
                exchange.count(ConnectionEvent::TimedOut);
            }
        }
        Err(_) => exchange.count(ConnectionEvent::ProtocolError),
    }
    result
}

/// Whether a read failed because the socket did (the peer reset it, or
/// the kernel gave up on a peer that vanished: keepalive, user timeout),
/// not because of what the peer sent: no reply can reach it, and it broke
/// no rule.
fn socket_failed(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        TimedOut | ConnectionReset | ConnectionAborted | BrokenPipe
    )
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
    (refusal, on_authenticated): (Option<Refusal>, Option<OnAuthenticated>),
    queue: &ReplyQueue,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
{
    let rules = config.door();
    let door = ConnectionDoor::new(
        link.transport,
        link.peer.minor,
        &rules,
        refusal.map(|r| (r.status, r.reason)),
    );
    let conn = exchange.new_connection();
    // However the loop ends (returned, dropped, or a panic), the exchange
    // learns the connection closed: its waiting requests go and its tasks
    // start their abandon clock.
    let _closed = ClosedOnDrop { exchange, conn };
    let mut requests = RequestLoop {
        exchange,
        config,
        rules,
        door,
        queue,
        conn,
        waiting: JoinSet::new(),
        on_authenticated,
    };
    requests.run(frames, first).await
}

/// Tells the exchange a connection closed when dropped.
struct ClosedOnDrop<'a> {
    exchange: &'a Exchange,
    conn: ConnId,
}

impl Drop for ClosedOnDrop<'_> {
    fn drop(&mut self) {
        self.exchange.connection_closed(self.conn);
    }
}

/// Where a connection's replies go: the writer's queue, and the count of
/// their bytes not yet written.
struct ReplyQueue {
    tx: mpsc::Sender<Reply>,
    unsent: Arc<UnsentReplies>,
}

/// What became of one request at the door.
enum Answered {
    /// Its reply, to send now.
    Now(Reply),
    /// A reply to send, then the connection closes with the error.
    Closing(Reply, ConnectionError),
    /// It waits; its reply is sent when it comes.
    Later,
}

/// One connection's requests: each frame through the door, then to the
/// exchange; a request that waits runs in `waiting`, its reply sent when
/// it comes.
struct RequestLoop<'a> {
    exchange: &'a Exchange,
    config: &'a ConnectionConfig,
    rules: DoorConfig,
    door: ConnectionDoor,
    queue: &'a ReplyQueue,
    conn: ConnId,
    /// Dropping the set when the connection ends cancels its waiting requests.
    waiting: JoinSet<u64>,
    /// Called once the peer owes no HELLO.
    on_authenticated: Option<OnAuthenticated>,
}

impl RequestLoop<'_> {
    /// Reads and answers requests until the peer closes, times out or
    /// breaks the protocol.
    async fn run<R>(
        &mut self,
        mut frames: FrameReader<R, BinRequest>,
        mut first: Option<FirstFrame>,
    ) -> Result<(), ConnectionError>
    where
        R: AsyncRead + Unpin,
    {
        let (exchange, config, queue) = (self.exchange, self.config, self.queue);
        let tx = &queue.tx;
        frames.set_max_frame_length(self.door.max_frame_length(&self.rules));
        let hello_deadline = tokio::time::Instant::now() + config.handshake_timeout;
        loop {
            self.reap();
            if queue.unsent.over_limit() {
                // Not read on until the peer takes some of its replies
                // (or the writer gives up on it, at write_stall_timeout).
                // Between frames: no frame holds receive room here.
                tokio::select! {
                    biased;
                    () = tx.closed() => return Err(writer_gone()),
                    () = queue.unsent.within_limit() => {}
                }
            }
            let next = match first.take() {
                Some(frame) => Some(frame),
                // A frame read already is taken without a future (nor a
                // timer): under load most are. As in `next_frame`, none is
                // taken once the writer has stopped.
                None if !tx.is_closed()
                    && let Some(frame) = frames.buffered_frame() =>
                {
                    // Thousands of small frames can arrive in one read:
                    // taken without a future, they would never give the
                    // thread back to the tasks beside this one. Each counts
                    // against the task's cooperative budget (it yields
                    // once that is spent, every 128 or so).
                    tokio::task::consume_budget().await;
                    Some(frame)
                }
                None if self.door.awaits_hello() => {
                    match tokio::time::timeout_at(hello_deadline, next_frame(&mut frames, tx)).await
                    {
                        Ok(next) => next?,
                        Err(_) => {
                            exchange.count(ConnectionEvent::TimedOut);
                            return Err(ConnectionError::HelloTimeout(config.handshake_timeout));
                        }
                    }
                }
                // The reader is cancel-safe: bytes read stay buffered.
                None => match tokio::time::timeout(
                    RECEIVE_BUFFERS_KEPT_IDLE,
                    next_frame(&mut frames, tx),
                )
                .await
                {
                    Ok(next) => next?,
                    Err(_) => {
                        // Quiet for a while: the receive buffers kept for
                        // reuse go (up to three frames of up to 64 MiB
                        // each, counted nowhere once their pages are gone).
                        frames.release_spare_buffers();
                        match config.idle_timeout {
                            None => next_frame(&mut frames, tx).await?,
                            Some(idle) => {
                                let mut wait = idle.saturating_sub(RECEIVE_BUFFERS_KEPT_IDLE);
                                loop {
                                    match tokio::time::timeout(wait, next_frame(&mut frames, tx))
                                        .await
                                    {
                                        Ok(next) => break next?,
                                        Err(_) => {
                                            self.reap();
                                            if self.waiting.is_empty() {
                                                exchange.count(ConnectionEvent::TimedOut);
                                                return Err(ConnectionError::IdleTimeout(idle));
                                            }
                                            wait = idle;
                                        }
                                    }
                                }
                            }
                        }
                    }
                },
            };
            let Some(frame) = next else {
                return Ok(());
            };
            let Frame {
                header: mut raw,
                body,
            } = frame?;
            let backing = frames.last_backing();
            exchange.count(ConnectionEvent::Received(
                8 + raw.encoded_len() as u64 + body.len() as u64,
            ));
            let payload = Payload {
                bytes: body,
                chunk: Some(backing),
            };
            let (reply, closes) = match self.one(&mut raw, payload) {
                Answered::Now(reply) => (Some(reply), None),
                Answered::Closing(reply, error) => (Some(reply), Some(error)),
                Answered::Later => (None, None),
            };
            // Authenticated by this request (a HELLO): told before its reply
            // goes, so the peer cannot act on the reply first.
            if closes.is_none()
                && !self.door.awaits_hello()
                && let Some(authenticated) = self.on_authenticated.take()
            {
                authenticated();
            }
            if let Some(reply) = reply {
                // Queued without a future while the queue has room (most
                // of the time).
                queue.unsent.queued(&reply);
                match tx.try_send(reply) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(reply)) => send(tx, reply).await?,
                    Err(mpsc::error::TrySendError::Closed(_)) => return Err(writer_gone()),
                }
            }
            if let Some(error) = closes {
                return Err(error);
            }
            frames.set_max_frame_length(self.door.max_frame_length(&self.rules));
        }
    }

    /// Takes one request through the door and, if it passes, to the
    /// exchange. Not async: most requests are answered at once, and the
    /// reply is sent by the caller.
    fn one(&mut self, raw: &mut BinRequest, payload: Payload) -> Answered {
        let exchange = self.exchange;
        match self.door.check(raw, &self.rules, exchange) {
            Verdict::Reply(reply) => {
                exchange.record_reply(&reply);
                Answered::Now(Reply::new(reply))
            }
            Verdict::Close { reply, reason } => {
                exchange.record_reply(&reply);
                Answered::Closing(
                    Reply::new(reply),
                    match reason {
                        CloseReason::Refused(reason) => ConnectionError::Refused(reason),
                        CloseReason::Unauthenticated(why) => ConnectionError::Unauthenticated(why),
                    },
                )
            }
            Verdict::Submit(request) => {
                // Its page sizes count too: an ENQUEUE of many empty pages
                // holds its decoded sizes while it waits.
                let body_len = request.waiting_bytes(payload.bytes.len() as u64);
                let kind = request.kind();
                let arrived = std::time::Instant::now();
                match exchange.submit_at(self.conn, request, payload, arrived) {
                    Answer::Ready(reply) => {
                        observe(exchange, kind, arrived, &reply);
                        Answered::Now(reply)
                    }
                    Answer::Later(future) => {
                        let (tx, unsent) = (self.queue.tx.clone(), self.queue.unsent.clone());
                        let exchange = exchange.clone();
                        self.door.parked(body_len);
                        self.waiting.spawn(async move {
                            let reply = future.await;
                            observe(&exchange, kind, arrived, &reply);
                            unsent.queued(&reply);
                            let _ = tx.send(reply).await;
                            body_len
                        });
                        Answered::Later
                    }
                }
            }
        }
    }

    /// Tells the door about the waiting requests that were answered.
    fn reap(&mut self) {
        while let Some(done) = self.waiting.try_join_next() {
            // A task that died (a panic) still ends its request.
            self.door.answered(done.unwrap_or(0));
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

/// Feeds the latency and reply-size histograms.
fn observe(exchange: &Exchange, kind: MessageType, arrived: std::time::Instant, reply: &Reply) {
    let body: usize = reply.body.iter().map(|piece| piece.len()).sum();
    exchange
        .histograms()
        .observe(kind, arrived.elapsed(), body as u64);
}

/// The error of a connection whose writer has stopped.
fn writer_gone() -> ConnectionError {
    ConnectionError::Io(std::io::ErrorKind::BrokenPipe.into())
}

async fn send(tx: &mpsc::Sender<Reply>, reply: Reply) -> Result<(), ConnectionError> {
    tx.send(reply).await.map_err(|_| writer_gone())
}

/// Writes the queued replies until the queue closes or writing fails;
/// returns whether it stopped because the peer read nothing for the stall
/// limit.
async fn write_replies<W: AsyncWrite + Unpin>(
    writer: StallLimit<W>,
    mut rx: mpsc::Receiver<Reply>,
    exchange: Exchange,
    unsent: Arc<UnsentReplies>,
) -> bool {
    let sent = |bytes, _bodies| {
        exchange.count(ConnectionEvent::Sent(bytes));
        unsent.written(bytes);
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
