//! One multiplexed connection to a binx daemon. Requests get ids and may be
//! outstanding together; replies are matched by id in any order. The socket is
//! opened on first use (callers queue while it connects) and again after it
//! drops. A writer task batches frames into vectored writes; a reader task
//! hands replies to their callers.
//!
//! Over TCP a connection is a few sockets (stripes), because one TCP stream
//! and the one task that writes it are a limit on fast links with many
//! cores. DATA goes round the stripes: pipelined DATA stays exact whatever
//! order its requests arrive in (docs/PROTOCOL.md section 10), and a
//! consumer that sends one DATA at a time orders them itself. Every other
//! request goes to the stripe its task hashes to, so a producer's ENQUEUEs
//! and NO_MORE_PAGES of one task arrive in the order they were sent, the
//! order binxd keeps (per task, across its shards).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use binx_proto::{
    BinReply, BinRequest, Frame, FrameAssembler, FrameError, FrameReader, MessageType, OutFrame,
    PREFACE_LEN, Preface, StallLimit, Status, write_queued,
};
use binx_shm::ShmReader;
use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot};

use crate::backoff::{Backoff, BackoffConfig};
use crate::endpoint::Endpoint;
use crate::error::ClientError;

/// Bytes read from a TLS socket at once (see `Connection::connect`).
const TLS_READ_BUFFER: usize = 256 << 10;

/// Most sockets one connection spreads its requests over.
pub const MAX_STRIPES: usize = 64;

/// Stripes a TCP connection uses by default: one per two cores this
/// process may use (which follows cgroup quotas), at least 1, at most 8.
/// On 2 cores a second socket lost up to a quarter at 8 exchanges in
/// parallel (fewer requests per socket to batch into one write) and gained
/// up to a quarter at 64 (BENCHMARKS.md, "Striped connections"), so one it
/// is; on a 16-core machine one connection stopped at 4-5 GB/s where
/// eight, from eight processes, moved 25 GB/s.
pub fn default_stripes() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 8))
}

/// How a connection behaves.
#[derive(Clone, Debug)]
pub struct ConnectionOptions {
    /// Longest wait for the socket and the preface.
    pub connect_timeout: Duration,
    /// Time a reply may take beyond the request's own `max_wait_micros`.
    pub request_timeout: Duration,
    /// Sent in a HELLO right after connecting, when set.
    pub auth_token: Option<String>,
    /// Say HELLO right after connecting even without a token (the
    /// default), to learn the server's name and capabilities
    /// ([`Connection::server_node`]), and which run of it answers: an
    /// [`crate::ExchangeSource`] tells a restart of the daemon it reads from
    /// only over a connection that says HELLO. Off, a single-socket
    /// connection saves that round trip per connect, and a reader of it
    /// cannot tell a restarted daemon from the one it read.
    pub hello: bool,
    /// Sent in HELLO, for the daemon's logs.
    pub client_name: String,
    /// Largest reply frame accepted (the daemon's `max_frame_size`).
    pub max_frame_length: usize,
    /// Pacing of retried requests.
    pub backoff: BackoffConfig,
    /// TLS for TCP endpoints (see [`crate::tls::client_config`]); `None`
    /// speaks plain TCP. Unix sockets never use it.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// On a Unix socket, ask the sidecar for shared memory and move every
    /// frame through it; connecting fails if the sidecar refuses. TCP
    /// endpoints ignore it.
    pub shared_memory: bool,
    /// With shared memory: how long a side that finds nothing to read (or no
    /// free slot) spins before it sleeps.
    pub shm_spin: Duration,
    /// A connection with nothing outstanding that has been quiet this long
    /// is replaced by a new one before the next request, so a request never
    /// races the server closing it for idleness (binxd's `idle_timeout`, 5
    /// minutes by default, must be longer).
    pub idle_reconnect_after: Duration,
    /// TCP sockets the connection spreads its requests over (see the
    /// module docs), each opened when a request first goes to it; between
    /// 1 and [`MAX_STRIPES`], [`default_stripes`] by default. Unix sockets
    /// always use one.
    pub stripes: usize,
}

impl Default for ConnectionOptions {
    fn default() -> Self {
        ConnectionOptions {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            auth_token: None,
            hello: true,
            client_name: format!("binx-client/{}", env!("CARGO_PKG_VERSION")),
            max_frame_length: binx_proto::DEFAULT_MAX_FRAME_LENGTH,
            backoff: BackoffConfig::default(),
            tls: None,
            shared_memory: false,
            shm_spin: binx_shm::ShmConfig::default().spin,
            idle_reconnect_after: Duration::from_secs(240),
            stripes: default_stripes(),
        }
    }
}

type ReplySlot = oneshot::Sender<Result<Frame<BinReply>, String>>;

/// Requests queued for the writer at most; callers wait for room past it.
const REQUEST_QUEUE: usize = 1024;

/// A socket that is (or was) open, with its reader and writer tasks.
struct Live {
    tx: mpsc::Sender<OutFrame<BinRequest>>,
    state: Arc<LiveState>,
    /// Over shared memory: the largest reply whose frame still fits one
    /// slot, so that it is read in place.
    reply_size_in_place: Option<u64>,
    /// The process instance its HELLO reply named (set before the socket
    /// is published): which run of the daemon answers what goes over it.
    instance: std::sync::OnceLock<Arc<str>>,
}

/// A request's reply slot in its socket's pending map, taken out when the
/// request ends without the reader having taken it: timed out, its frame
/// never sent, or its caller gone (a future dropped while it waited for
/// room in the queue). A slot whose frame never left would otherwise stay
/// for good, and keep the socket from ever counting as idle.
struct PendingSlot<'a> {
    state: &'a LiveState,
    id: u64,
    armed: bool,
}

impl Drop for PendingSlot<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.state.pending().remove(&self.id);
        }
    }
}

struct LiveState {
    pending: Mutex<HashMap<u64, ReplySlot>>,
    closed: AtomicBool,
    /// Woken when the connection fails, so its reader stops even if the
    /// server never sends another byte.
    failed: tokio::sync::Notify,
    born: Instant,
    /// Milliseconds after `born` a request was last sent or answered.
    last_used_ms: AtomicU64,
    /// A PING checks whether the socket still answers (see
    /// `Connection::probe`).
    probing: AtomicBool,
    /// Replies read so far: any reply read while a PING waits shows the
    /// socket alive (its replies may just be queued behind others').
    replies: AtomicU64,
}

impl LiveState {
    fn touch(&self) {
        let now = self.born.elapsed().as_millis() as u64;
        self.last_used_ms.store(now, Ordering::Relaxed);
    }

    /// Quiet for at least `idle` with nothing outstanding.
    fn idle_for(&self, idle: Duration) -> bool {
        let last = Duration::from_millis(self.last_used_ms.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(last) >= idle && self.pending().is_empty()
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<u64, ReplySlot>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After a PING went unanswered for `waited`: fails the socket unless
    /// some reply was read since `replies_before` (then it is alive, its
    /// replies queued behind others' on a busy link).
    fn fail_if_silent(&self, replies_before: u64, waited: Duration) {
        if self.replies.load(Ordering::Relaxed) == replies_before {
            self.fail(&format!(
                "a PING went unanswered for {waited:?}, and no other reply came meanwhile: the socket is taken for dead"
            ));
        }
    }

    /// Marks the socket dead and fails every outstanding request.
    fn fail(&self, reason: &str) {
        let mut pending = self.pending();
        self.closed.store(true, Ordering::Release);
        for (_, slot) in pending.drain() {
            let _ = slot.send(Err(reason.to_string()));
        }
        // A stored permit if the reader is not waiting right now.
        self.failed.notify_one();
    }
}

/// One socket of a connection, opened on first use and again after it drops.
#[derive(Default)]
struct Stripe {
    live: Mutex<Option<Arc<Live>>>,
    connecting: tokio::sync::Mutex<()>,
    /// Attempts to open it that have ended, and how the last one failed
    /// (`None` if it succeeded): callers that waited for an attempt share
    /// its failure rather than each dialling again in turn.
    attempts: AtomicU64,
    failed: Mutex<Option<ClientError>>,
    /// The daemon refused this socket BUSY when it opened (its connection
    /// limit): its requests go to the first stripe from then on. Never back:
    /// a task's requests stay on one socket once moved, so they stay in
    /// order (nothing was in flight on a socket that never opened).
    refused: AtomicBool,
}

/// The failure of a connect another caller waited for, in the same words
/// and of the same kind (so retried, or not, alike).
fn shared_failure(dialled: &Endpoint, e: &ClientError) -> ClientError {
    match e {
        ClientError::Connect { endpoint, source } => ClientError::Connect {
            endpoint: endpoint.clone(),
            source: std::io::Error::new(source.kind(), source.to_string()),
        },
        ClientError::ConnectTimeout { endpoint, after } => ClientError::ConnectTimeout {
            endpoint: endpoint.clone(),
            after: *after,
        },
        ClientError::Preface { endpoint, source } => ClientError::Preface {
            endpoint: endpoint.clone(),
            source: source.clone(),
        },
        ClientError::Refused {
            endpoint,
            request,
            status,
            message,
        } => ClientError::Refused {
            endpoint: endpoint.clone(),
            request: request.clone(),
            status: *status,
            message: message.clone(),
        },
        ClientError::Timeout {
            endpoint,
            request,
            after,
        } => ClientError::Timeout {
            endpoint: endpoint.clone(),
            request: request.clone(),
            after: *after,
        },
        ClientError::ConnectionLost { endpoint, reason } => ClientError::ConnectionLost {
            endpoint: endpoint.clone(),
            reason: reason.clone(),
        },
        // Opening a socket fails in none of the other ways; were it to,
        // the caller that waited is told so in words.
        other => ClientError::ConnectionLost {
            endpoint: dialled.clone(),
            reason: format!("connecting failed: {other}"),
        },
    }
}

struct Shared {
    endpoint: Endpoint,
    options: ConnectionOptions,
    stripes: Box<[Stripe]>,
    /// The stripe the next DATA goes to (modulo their number).
    next_stripe: AtomicUsize,
    /// What the server said it is in its last HELLO reply.
    server: Mutex<ServerIdentity>,
    next_id: AtomicU64,
}

/// What [`Connection::call_if_instance`] came back with.
#[derive(Debug)]
pub enum Called {
    /// The reply, and the process instance the socket's HELLO named.
    Replied {
        /// The reply frame, whatever its status.
        frame: Box<Frame<BinReply>>,
        /// The daemon's process instance, when it named one.
        instance: Option<Arc<str>>,
    },
    /// Not sent: the daemon answers as another process.
    Withheld {
        /// The process that answers now.
        instance: Arc<str>,
    },
}

/// What a server said it is in its HELLO reply, and the limit it named
/// that a producer batches under.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerIdentity {
    /// Its spool node name (`node=`, at most 64 bytes).
    pub node: Option<String>,
    /// Its process's instance id (`instance=`, new at every start; at most
    /// 64 bytes of letters, digits and `._:-`, else not taken): a change
    /// at the same address is a restart.
    pub instance: Option<Arc<str>>,
    /// `max-enqueue-bytes=`: an ENQUEUE whose bytes, with
    /// [`binx_proto::ENQUEUE_PAGE_COST`] a page, are at most this is never
    /// refused as one that can never fit its memory limit; a larger one may
    /// be, though each of its pages would fit.
    pub max_enqueue_bytes: Option<u64>,
    /// `max-pages-per-enqueue=`: an ENQUEUE of more pages is refused.
    pub max_pages_per_enqueue: Option<u64>,
    /// `max-frame-bytes=`: a longer frame closes the connection.
    pub max_frame_bytes: Option<u64>,
}

impl ServerIdentity {
    /// What a HELLO reply's capabilities say: `node=` (cut to 64 bytes),
    /// `instance=`, `max-enqueue-bytes=`, `max-pages-per-enqueue=` and
    /// `max-frame-bytes=` (a positive number, else not taken).
    pub fn from_capabilities(capabilities: &[String]) -> ServerIdentity {
        let said = |name: &str| capabilities.iter().find_map(|c| c.strip_prefix(name));
        ServerIdentity {
            node: said("node=").map(|n| binx_proto::truncate(n, 64).to_string()),
            // An id, not text: anything else (a hostile server's log
            // line) is not taken as one.
            instance: said("instance=")
                .filter(|id| binx_proto::is_instance_id(id))
                .map(Arc::from),
            max_enqueue_bytes: positive(said(binx_proto::MAX_ENQUEUE_BYTES)),
            max_pages_per_enqueue: positive(said(binx_proto::MAX_PAGES_PER_ENQUEUE)),
            max_frame_bytes: positive(said(binx_proto::MAX_FRAME_BYTES)),
        }
    }
}

/// A limit a capability says: a positive number, else none (a server that
/// says `0` or words cannot be held to it).
fn positive(said: Option<&str>) -> Option<u64> {
    said.and_then(|n| n.parse().ok()).filter(|&n| n > 0)
}

/// A handle to the one connection to a daemon (over TCP, its stripes);
/// cheap to clone.
#[derive(Clone)]
pub struct Connection {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("endpoint", &self.shared.endpoint)
            .field("stripes", &self.shared.stripes.len())
            .finish()
    }
}

/// Names a request in error messages: type, task, buffer, token.
pub(crate) fn describe(request: &BinRequest) -> String {
    let kind = request
        .message_type()
        .map(MessageType::name)
        .unwrap_or("UNKNOWN");
    match request.message_type() {
        Ok(MessageType::Ping | MessageType::Hello) => kind.to_string(),
        Ok(MessageType::OpenTask | MessageType::AbortTask) => {
            format!("{kind} for task {}", request.task_id)
        }
        Ok(MessageType::DeleteTask) => format!(
            "{kind} for buffers 0..{} of task {}",
            request.buffer_count, request.task_id
        ),
        Ok(MessageType::Data | MessageType::Ack) => format!(
            "{kind} for buffer {} of task {} at token {}",
            request.buffer_id, request.task_id, request.page_token
        ),
        _ => format!(
            "{kind} for buffer {} of task {}",
            request.buffer_id, request.task_id
        ),
    }
}

impl Connection {
    /// A connection to `endpoint`; nothing is opened until the first request.
    pub fn new(endpoint: Endpoint, options: ConnectionOptions) -> Self {
        let stripes = match endpoint {
            Endpoint::Tcp(_) => options.stripes.clamp(1, MAX_STRIPES),
            Endpoint::Unix(_) => 1,
        };
        Connection {
            shared: Arc::new(Shared {
                endpoint,
                options,
                stripes: (0..stripes).map(|_| Stripe::default()).collect(),
                next_stripe: AtomicUsize::new(0),
                server: Mutex::new(ServerIdentity::default()),
                next_id: AtomicU64::new(1),
            }),
        }
    }

    /// Sockets this connection spreads its requests over.
    pub fn stripes(&self) -> usize {
        self.shared.stripes.len()
    }

    /// Sockets open now.
    pub fn open_stripes(&self) -> usize {
        self.shared
            .stripes
            .iter()
            .filter(|s| {
                s.live
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .is_some_and(|l| !l.state.closed.load(Ordering::Acquire))
            })
            .count()
    }

    /// The stripe `request` goes to: DATA round the stripes, PING and
    /// HELLO the first (so a PING times a round trip on an open socket, not
    /// the opening of another), any other request its task's (see the
    /// module docs).
    fn stripe_for(&self, request: &BinRequest) -> usize {
        let n = self.shared.stripes.len();
        if n == 1 {
            return 0;
        }
        match request.message_type() {
            Ok(MessageType::Data) => self.shared.next_stripe.fetch_add(1, Ordering::Relaxed) % n,
            Ok(MessageType::Ping | MessageType::Hello) => 0,
            _ => binx_core::shard_of(&request.task_id, n),
        }
    }

    /// Opens every stripe not open yet, so that no request pays for
    /// connecting (a benchmark's first iteration, say); fails with the
    /// first stripe that could not be opened.
    pub async fn open_all(&self) -> Result<(), ClientError> {
        for stripe in 0..self.stripes() {
            self.live(stripe).await?;
        }
        Ok(())
    }

    /// Whether both handles share one connection.
    pub fn same_as(&self, other: &Connection) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// The daemon this connection dials.
    pub fn endpoint(&self) -> &Endpoint {
        &self.shared.endpoint
    }

    /// The options it was made with.
    pub fn options(&self) -> &ConnectionOptions {
        &self.shared.options
    }

    /// The spool node name the server gave in its last HELLO reply, when
    /// `hello` (or a token) made the connection ask.
    pub fn server_node(&self) -> Option<String> {
        self.server_identity().node
    }

    /// What the server said it is in its last HELLO reply (node name and
    /// process instance), when `hello` (or a token) made the connection ask.
    pub fn server_identity(&self) -> ServerIdentity {
        self.shared
            .server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Over shared memory, the largest reply whose frame fits one slot of
    /// the sidecar's region, so that its pages are read in place rather
    /// than copied (connecting first if needed); `None` on other transports
    /// or when connecting fails (the request that follows reports why).
    pub async fn reply_size_in_place(&self) -> Option<u64> {
        self.live(0).await.ok()?.reply_size_in_place
    }

    /// Connects now if no connection is up (saying HELLO when `hello` or a
    /// token asks), so that what the server says is known before a request
    /// is shaped by it; a failure is left to the request that follows.
    pub async fn connect_now(&self) {
        let _ = self.live(0).await;
    }

    fn current(&self, stripe: usize) -> Option<Arc<Live>> {
        let live = self.shared.stripes[stripe]
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let live = live
            .as_ref()
            .filter(|l| !l.state.closed.load(Ordering::Acquire))?;
        if live
            .state
            .idle_for(self.shared.options.idle_reconnect_after)
        {
            // Dropping it closes the socket once its tasks see the end.
            live.state.fail("replaced after being idle");
            return None;
        }
        Some(live.clone())
    }

    async fn live(&self, stripe: usize) -> Result<Arc<Live>, ClientError> {
        if let Some(live) = self.current(stripe) {
            return Ok(live);
        }
        // One caller connects; the others queue here and then use its
        // socket, or get its failure (an unreachable daemon costs every
        // waiting caller one connect timeout, not one each in turn).
        let slot = &self.shared.stripes[stripe];
        let attempts = slot.attempts.load(Ordering::Acquire);
        let _connecting = slot.connecting.lock().await;
        if let Some(live) = self.current(stripe) {
            return Ok(live);
        }
        if slot.attempts.load(Ordering::Acquire) != attempts
            && let Some(e) = slot
                .failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
        {
            return Err(shared_failure(&self.shared.endpoint, e));
        }
        let opened = self.open(stripe).await;
        *slot.failed.lock().unwrap_or_else(|p| p.into_inner()) = opened
            .as_ref()
            .err()
            .map(|e| shared_failure(&self.shared.endpoint, e));
        slot.attempts.fetch_add(1, Ordering::AcqRel);
        opened
    }

    /// Dials stripe `stripe`, says HELLO when asked to, and publishes the
    /// socket; the caller holds the stripe's `connecting` lock.
    async fn open(&self, stripe: usize) -> Result<Arc<Live>, ClientError> {
        let slot = &self.shared.stripes[stripe];
        let live = Arc::new(self.connect().await?);
        // The socket is published only after its HELLO was answered, so no
        // request of another caller can reach the server before it (binxd
        // closes a TCP connection whose first request is not the HELLO it
        // requires).
        let token = &self.shared.options.auth_token;
        // Every socket of several says HELLO: a daemon at its connection
        // limit refuses one past the first there (BUSY), before any request
        // of a caller goes over it, so its requests can move to the first
        // stripe; and each names the run of the daemon it reached, which a
        // reader compares across sockets (a socket without it would let
        // another run's pages through unseen).
        if token.is_some() || self.shared.options.hello || self.shared.stripes.len() > 1 {
            let mut hello = BinRequest::new(MessageType::Hello);
            hello.auth_token = token.clone().unwrap_or_default();
            hello.client_name = self.shared.options.client_name.clone();
            let reply = self.send_on(&live, hello.clone(), Vec::new()).await?;
            match self.check(&hello, reply) {
                Ok(reply) => {
                    let said = ServerIdentity::from_capabilities(&reply.header.capabilities);
                    if let Some(instance) = &said.instance {
                        let _ = live.instance.set(instance.clone());
                    }
                    let mut server = self.shared.server.lock().unwrap_or_else(|p| p.into_inner());
                    server.node = said.node;
                    server.max_enqueue_bytes = said.max_enqueue_bytes;
                    server.max_pages_per_enqueue = said.max_pages_per_enqueue;
                    server.max_frame_bytes = said.max_frame_bytes;
                    // The same process's instance keeps its allocation, so
                    // a reader can tell "unchanged" by pointer.
                    if server.instance != said.instance {
                        server.instance = said.instance;
                    }
                }
                Err(e) => {
                    live.state.fail("HELLO was refused");
                    return Err(e);
                }
            }
        }
        *slot.live.lock().unwrap_or_else(|p| p.into_inner()) = Some(live.clone());
        Ok(live)
    }

    async fn connect(&self) -> Result<Live, ClientError> {
        let endpoint = &self.shared.endpoint;
        let timeout = self.shared.options.connect_timeout;
        let attempt = async {
            Ok::<Live, HandshakeError>(match endpoint {
                Endpoint::Tcp(addr) => {
                    let stream = TcpStream::connect(addr.as_str()).await?;
                    stream.set_nodelay(true)?;
                    if let Err(e) = keep_alive(&stream, self.shared.options.request_timeout) {
                        // A sandbox may refuse the options: the probe after
                        // a timeout still finds a dead peer.
                        tracing::warn!(error = %e, endpoint = %addr, "cannot set TCP keepalive on a connection");
                    }
                    if let Some(tls) = &self.shared.options.tls {
                        let name = crate::tls::server_name(addr).map_err(|e| {
                            std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
                        })?;
                        // rustls reads the socket 4 KiB at a time; a buffer
                        // beneath it turns that into a read call per 256 KiB
                        // of records (replies are megabytes).
                        let stream = tokio::io::BufReader::with_capacity(TLS_READ_BUFFER, stream);
                        let stream = tokio_rustls::TlsConnector::from(tls.clone())
                            .connect(name, stream)
                            .await
                            .map_err(|e| {
                                std::io::Error::new(e.kind(), format!("TLS handshake failed: {e}"))
                            })?;
                        let (r, w) = tokio::io::split(stream);
                        // Under TLS 1.3 a server refuses a client certificate
                        // only after the handshake: the alert arrives here.
                        let (r, w) = handshake(r, w).await.map_err(|e| match e {
                            HandshakeError::Io(io) => HandshakeError::Io(std::io::Error::new(
                                io.kind(),
                                format!("the server ended the TLS session: {io}"),
                            )),
                            other => other,
                        })?;
                        self.start_io(r, w)
                    } else {
                        let (r, w) = stream.into_split();
                        let (r, w) = handshake(r, w).await?;
                        self.start_io(r, w)
                    }
                }
                Endpoint::Unix(path) if self.shared.options.shared_memory => {
                    let mut stream = UnixStream::connect(path).await?;
                    let (r, w) = stream.split();
                    handshake(r, w).await?;
                    let (r, w, slot_size) =
                        crate::shm::attach(stream, self.shared.options.shm_spin).await?;
                    let frames = ReplyFrames::<ShmReader>::InPlace {
                        reader: r,
                        frames: FrameAssembler::new(self.shared.options.max_frame_length),
                    };
                    let mut live = self.start_io_with(frames, w);
                    live.reply_size_in_place = crate::shm::reply_size_in_place(slot_size);
                    live
                }
                Endpoint::Unix(path) => {
                    let (r, w) = UnixStream::connect(path).await?.into_split();
                    let (r, w) = handshake(r, w).await?;
                    self.start_io(r, w)
                }
            })
        };
        match tokio::time::timeout(timeout, attempt).await {
            Err(_) => Err(ClientError::ConnectTimeout {
                endpoint: endpoint.clone(),
                after: timeout,
            }),
            Ok(Err(HandshakeError::Io(source))) => Err(ClientError::Connect {
                endpoint: endpoint.clone(),
                source,
            }),
            Ok(Err(HandshakeError::Preface(source))) => Err(ClientError::Preface {
                endpoint: endpoint.clone(),
                source,
            }),
            Ok(Ok(live)) => Ok(live),
        }
    }

    fn start_io<R, W>(&self, reader: R, writer: W) -> Live
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let frames = FrameReader::new(reader, self.shared.options.max_frame_length);
        self.start_io_with(ReplyFrames::Stream(frames), writer)
    }

    fn start_io_with<R, W>(&self, frames: ReplyFrames<R>, writer: W) -> Live
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let state = Arc::new(LiveState {
            pending: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            failed: tokio::sync::Notify::new(),
            born: Instant::now(),
            last_used_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            replies: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
        // A server that stops reading fails the connection (and every
        // request on it) instead of holding its writer for good.
        let writer = StallLimit::new(writer, Some(self.shared.options.request_timeout));
        tokio::spawn(write_requests(writer, rx, state.clone()));
        tokio::spawn(read_replies(frames, state.clone()));
        Live {
            tx,
            state,
            reply_size_in_place: None,
            instance: std::sync::OnceLock::new(),
        }
    }

    async fn send_on(
        &self,
        live: &Arc<Live>,
        mut request: BinRequest,
        body: Vec<Bytes>,
    ) -> Result<Frame<BinReply>, ClientError> {
        request.request_id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let lost = |reason: &str| ClientError::ConnectionLost {
            endpoint: self.shared.endpoint.clone(),
            reason: reason.to_string(),
        };
        let label = describe(&request);
        let kind = request.message_type();
        let wait = Duration::from_micros(request.max_wait_micros);
        // Queueing the request counts towards its time: the queue is full
        // when the server reads nothing.
        let limit = wait.saturating_add(self.shared.options.request_timeout);
        let replies_before = live.state.replies.load(Ordering::Relaxed);
        match round_trip(live, request, body, limit).await {
            RoundTrip::NotSent => Err(lost("the connection closed before the request was sent")),
            RoundTrip::Lost(reason) => Err(lost(&reason)),
            RoundTrip::Answered(frame) => Ok(frame),
            RoundTrip::TimedOut => {
                match kind {
                    // A PING waits for nothing at the server: a socket on
                    // which it and every other reply stayed unanswered is
                    // dead (a peer gone or a path black-holed leaves it
                    // open for many minutes).
                    Ok(MessageType::Ping) => live.state.fail_if_silent(replies_before, limit),
                    // A HELLO that timed out leaves its socket unpublished:
                    // `open` drops it.
                    Ok(MessageType::Hello) => {}
                    _ => self.probe(live),
                }
                Err(ClientError::Timeout {
                    endpoint: self.shared.endpoint.clone(),
                    request: label,
                    after: limit,
                })
            }
        }
    }

    /// After a request on `live` timed out, sends a PING on the same socket
    /// (one at a time) and fails the socket when that goes unanswered for
    /// `request_timeout` too: requests that follow (and retries) then go
    /// over a new socket, rather than each timing out in turn on one the
    /// kernel keeps for many minutes. A PING that is answered leaves the
    /// socket be: the server was slow, not gone.
    fn probe(&self, live: &Arc<Live>) {
        if live.state.closed.load(Ordering::Acquire)
            || live.state.probing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let mut ping = BinRequest::new(MessageType::Ping);
        ping.request_id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let limit = self.shared.options.request_timeout;
        let live = live.clone();
        tokio::spawn(async move {
            let replies_before = live.state.replies.load(Ordering::Relaxed);
            if let RoundTrip::TimedOut = round_trip(&live, ping, Vec::new(), limit).await {
                live.state.fail_if_silent(replies_before, limit);
            }
            live.state.probing.store(false, Ordering::Release);
        });
    }

    /// Sends one request and returns the reply whatever its status.
    pub async fn call(
        &self,
        request: BinRequest,
        body: Vec<Bytes>,
    ) -> Result<Frame<BinReply>, ClientError> {
        self.fits(&request, &body)?;
        let live = self.live_routed(self.stripe_for(&request)).await?;
        self.send_on(&live, request, body).await
    }

    /// Sends one request, whatever the reply's status, only to process
    /// `instance` of the daemon (the `instance=` of its HELLO reply): over
    /// a socket whose HELLO named another, nothing is sent and
    /// [`Called::Withheld`] names that one (a daemon that restarted: a
    /// request meant for a buffer of its earlier process could act on
    /// another run's), or `none` for a daemon that names no process. With
    /// `None` it is sent as [`Connection::call`] does.
    pub async fn call_if_instance(
        &self,
        request: BinRequest,
        body: Vec<Bytes>,
        instance: Option<&str>,
    ) -> Result<Called, ClientError> {
        self.fits(&request, &body)?;
        let live = self.live_routed(self.stripe_for(&request)).await?;
        let answering = live.instance.get().cloned();
        match (instance, &answering) {
            (Some(wanted), Some(answering)) if **answering != *wanted => {
                return Ok(Called::Withheld {
                    instance: answering.clone(),
                });
            }
            // A process that names none (a binxd before 1.2 put back) is
            // not the one named either.
            (Some(_), None) => {
                return Ok(Called::Withheld {
                    instance: Arc::from("none"),
                });
            }
            _ => {}
        }
        let frame = self.send_on(&live, request, body).await?;
        Ok(Called::Replied {
            frame: Box::new(frame),
            instance: answering,
        })
    }

    /// Refuses a request the daemon would take for a malformed frame (and
    /// close the connection every request in flight shares): a header over
    /// the header limit, or a frame over this connection's frame limit.
    fn fits(&self, request: &BinRequest, body: &[Bytes]) -> Result<(), ClientError> {
        use binx_proto::Message;
        let refuse = |source| ClientError::Encode {
            endpoint: self.shared.endpoint.clone(),
            request: describe(request),
            source,
        };
        let header = request.encoded_len() + 16;
        if header > binx_proto::MAX_HEADER_LENGTH {
            return Err(refuse(binx_proto::FrameError::HeaderOverLimit {
                header_length: u32::try_from(header).unwrap_or(u32::MAX),
                limit: binx_proto::MAX_HEADER_LENGTH,
            }));
        }
        let length = 4 + header + body.iter().map(Bytes::len).sum::<usize>();
        let limit = self.shared.options.max_frame_length;
        if length > limit {
            return Err(refuse(binx_proto::FrameError::TooLarge {
                length: length as u64,
                limit,
            }));
        }
        Ok(())
    }

    /// Stripe `stripe`'s socket, or the first stripe's when the daemon
    /// refused `stripe` BUSY as it opened: a daemon at its connection limit
    /// admits fewer sockets than the stripes, and a task whose requests go
    /// to a refused one would otherwise be refused on every retry.
    async fn live_routed(&self, stripe: usize) -> Result<Arc<Live>, ClientError> {
        let slot = &self.shared.stripes[stripe];
        if stripe == 0 || slot.refused.load(Ordering::Acquire) {
            return self.live(0).await;
        }
        match self.live(stripe).await {
            Err(ClientError::Refused {
                status: Status::Busy,
                ..
            }) => {
                slot.refused.store(true, Ordering::Release);
                self.live(0).await
            }
            other => other,
        }
    }

    /// Maps a reply whose status is not OK or NO_DATA to an error.
    pub fn check(
        &self,
        request: &BinRequest,
        reply: Frame<BinReply>,
    ) -> Result<Frame<BinReply>, ClientError> {
        match reply.header.status_kind() {
            Status::Ok | Status::NoData => Ok(reply),
            status => Err(ClientError::Refused {
                endpoint: self.shared.endpoint.clone(),
                request: describe(request),
                status,
                message: if reply.header.error.is_empty() {
                    "(no error text)".to_string()
                } else {
                    reply.header.error
                },
            }),
        }
    }

    /// Sends one request; a status other than OK or NO_DATA is an error.
    pub async fn request(
        &self,
        request: BinRequest,
        body: Vec<Bytes>,
    ) -> Result<Frame<BinReply>, ClientError> {
        let reply = self.call(request.clone(), body).await?;
        self.check(&request, reply)
    }

    /// Like [`Connection::request`], retrying transport errors and BUSY with
    /// backoff until the maximum error duration. Only for requests that are
    /// safe to repeat.
    pub async fn request_with_retry(
        &self,
        request: BinRequest,
        body: Vec<Bytes>,
        backoff: &mut Backoff,
    ) -> Result<Frame<BinReply>, ClientError> {
        self.request_retrying(request, body, backoff, ClientError::is_retryable)
            .await
    }

    /// Like [`Connection::request`], retrying the errors `retryable` picks
    /// with backoff; once they have lasted the maximum error duration, the
    /// last one comes back as [`ClientError::GaveUp`].
    pub async fn request_retrying(
        &self,
        request: BinRequest,
        body: Vec<Bytes>,
        backoff: &mut Backoff,
        retryable: impl Fn(&ClientError) -> bool,
    ) -> Result<Frame<BinReply>, ClientError> {
        self.request_retrying_from(request, body, backoff, retryable, None)
            .await
            .map(|(reply, _)| reply)
    }

    /// Like [`Connection::request`], also naming the run of the daemon
    /// that answered: the process instance the HELLO of the socket it went
    /// over named (`None` when the connection says no HELLO, or the daemon
    /// named none). With `pin`, the request goes only to that process
    /// instance (as [`Connection::call_if_instance`] sends it): over a
    /// socket to another one, or to one that names none, nothing is sent and
    /// the error is [`ClientError::DaemonRestarted`] (a request meant for a
    /// buffer of the earlier process must not act on another run's).
    pub async fn request_from(
        &self,
        request: BinRequest,
        body: Vec<Bytes>,
        pin: Option<&str>,
    ) -> Result<(Frame<BinReply>, Option<Arc<str>>), ClientError> {
        match self.call_if_instance(request.clone(), body, pin).await? {
            Called::Replied { frame, instance } => Ok((self.check(&request, *frame)?, instance)),
            Called::Withheld { instance } => Err(ClientError::DaemonRestarted {
                endpoint: self.shared.endpoint.clone(),
                request: describe(&request),
                before: pin.unwrap_or_default().to_string(),
                now: instance.to_string(),
                token: request.page_token,
            }),
        }
    }

    /// [`Connection::request_retrying`] with [`Connection::request_from`]'s
    /// instance of the daemon that answered, and its `pin`.
    pub async fn request_retrying_from(
        &self,
        request: BinRequest,
        body: Vec<Bytes>,
        backoff: &mut Backoff,
        retryable: impl Fn(&ClientError) -> bool,
        pin: Option<&str>,
    ) -> Result<(Frame<BinReply>, Option<Arc<str>>), ClientError> {
        loop {
            match self.request_from(request.clone(), body.clone(), pin).await {
                Ok(reply) => {
                    backoff.succeeded();
                    return Ok(reply);
                }
                Err(e) if retryable(&e) => {
                    tracing::debug!(error = %e, "retrying");
                    if let Err(after) = backoff.wait_after_error().await {
                        return Err(ClientError::GaveUp {
                            endpoint: self.shared.endpoint.clone(),
                            request: describe(&request),
                            after,
                            last: Box::new(e),
                        });
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A fresh backoff with this connection's limits.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.shared.options.backoff)
    }

    /// Round trip of one PING.
    pub async fn ping(&self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        self.request(BinRequest::new(MessageType::Ping), Vec::new())
            .await?;
        Ok(start.elapsed())
    }

    /// Closes the sockets now; the next request opens a new one.
    pub fn disconnect(&self) {
        for stripe in self.shared.stripes.iter() {
            if let Some(live) = stripe.live.lock().unwrap_or_else(|p| p.into_inner()).take() {
                live.state.fail("disconnected by the client");
            }
        }
    }
}

enum HandshakeError {
    Io(std::io::Error),
    Preface(binx_proto::PrefaceError),
}

impl From<std::io::Error> for HandshakeError {
    fn from(e: std::io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

/// Client preface first, then the server's.
async fn handshake<R, W>(mut reader: R, mut writer: W) -> Result<(R, W), HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    writer.write_all(&Preface::CURRENT.encode()).await?;
    writer.flush().await?;
    let mut theirs = [0u8; PREFACE_LEN];
    reader.read_exact(&mut theirs).await?;
    Preface::decode_compatible(&theirs).map_err(HandshakeError::Preface)?;
    Ok((reader, writer))
}

/// Longest time sent bytes may stay unacknowledged before the kernel
/// closes the socket, or the connection's `request_timeout` if longer.
const UNACKNOWLEDGED_LIMIT: Duration = Duration::from_secs(60);

/// Makes the kernel close a TCP socket whose peer is gone (a node powered
/// off, a path black-holed) within about a minute, whether requests are
/// in flight or not, rather than the many minutes it keeps one by default:
/// its requests then fail as a lost connection and are retried on a new
/// one. (`Connection::probe` finds such a socket sooner once a request on
/// it timed out.)
fn keep_alive(stream: &TcpStream, request_timeout: Duration) -> std::io::Result<()> {
    binx_proto::keepalive::keep_alive(stream, Some(UNACKNOWLEDGED_LIMIT.max(request_timeout)))
}

/// How one request on one socket ended.
enum RoundTrip {
    /// The socket closed before its frame was queued.
    NotSent,
    /// No reply within the limit.
    TimedOut,
    /// The socket failed while the request waited, for this reason.
    Lost(String),
    Answered(Frame<BinReply>),
}

/// Queues `request` (its id set) on `live` and waits up to `limit` for its
/// reply, queueing included.
async fn round_trip(
    live: &Live,
    request: BinRequest,
    body: Vec<Bytes>,
    limit: Duration,
) -> RoundTrip {
    let id = request.request_id;
    let (slot, reply) = oneshot::channel();
    {
        let mut pending = live.state.pending();
        if live.state.closed.load(Ordering::Acquire) {
            return RoundTrip::NotSent;
        }
        pending.insert(id, slot);
    }
    let mut slot = PendingSlot {
        state: &live.state,
        id,
        armed: true,
    };
    live.state.touch();
    let sent_and_answered = async {
        let frame = OutFrame {
            header: request,
            body,
        };
        if live.tx.send(frame).await.is_err() {
            return Err(());
        }
        Ok(reply.await)
    };
    let answered = tokio::time::timeout(limit, sent_and_answered).await;
    // Answered (or failed with the socket): the reader took the slot.
    slot.armed = !matches!(answered, Ok(Ok(_)));
    match answered {
        Err(_) => RoundTrip::TimedOut,
        Ok(Err(())) => RoundTrip::NotSent,
        Ok(Ok(Err(_))) => RoundTrip::Lost("the reader stopped".to_string()),
        Ok(Ok(Ok(Err(reason)))) => RoundTrip::Lost(reason),
        Ok(Ok(Ok(Ok(frame)))) => RoundTrip::Answered(frame),
    }
}

async fn write_requests<W: AsyncWrite + Unpin>(
    writer: W,
    mut rx: mpsc::Receiver<OutFrame<BinRequest>>,
    state: Arc<LiveState>,
) {
    let closed = write_queued(writer, &mut rx, |_, _| {
        !state.closed.load(Ordering::Acquire)
    })
    .await;
    if let Err(e) = closed {
        state.fail(&format!("writing to the socket failed: {e}"));
    }
}

/// Where a connection's replies come from: a byte stream read into receive
/// buffers, or shared memory runs read in place.
enum ReplyFrames<R> {
    Stream(FrameReader<R, BinReply>),
    InPlace {
        reader: ShmReader,
        frames: FrameAssembler<BinReply>,
    },
}

impl<R: AsyncRead + Unpin> ReplyFrames<R> {
    /// The next reply; `None` when the server closed cleanly between frames.
    async fn next(&mut self) -> Option<Result<Frame<BinReply>, FrameError>> {
        match self {
            ReplyFrames::Stream(frames) => frames.next().await,
            ReplyFrames::InPlace { reader, frames } => loop {
                match frames.next_frame() {
                    Ok(Some(frame)) => return Some(Ok(frame)),
                    Ok(None) => {}
                    Err(e) => return Some(Err(e)),
                }
                match reader.next_run_async().await {
                    Ok(Some(run)) => frames.push(run),
                    Ok(None) => return frames.finish().err().map(Err),
                    Err(e) => return Some(Err(e.into())),
                }
            },
        }
    }
}

async fn read_replies<R: AsyncRead + Unpin>(mut frames: ReplyFrames<R>, state: Arc<LiveState>) {
    let reason = loop {
        let next = tokio::select! {
            biased;
            () = state.failed.notified() => break "the connection failed".to_string(),
            next = frames.next() => next,
        };
        match next {
            None => break "the server closed the connection".to_string(),
            Some(Err(e)) => break format!("reading a reply failed: {e}"),
            Some(Ok(frame)) => {
                let id = frame.header.request_id;
                if id == 0 {
                    // A connection-level error from the server.
                    break format!("the server reported: {}", frame.header.error);
                }
                state.replies.fetch_add(1, Ordering::Relaxed);
                let slot = state.pending().remove(&id);
                state.touch();
                if let Some(slot) = slot {
                    let _ = slot.send(Ok(frame));
                }
            }
        }
        if state.closed.load(Ordering::Acquire) {
            break "disconnected by the client".to_string();
        }
    };
    state.fail(&reason);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server that answers the preface and then reads nothing more,
    /// holding every connection open; counts the connections.
    async fn deaf_server() -> (String, Arc<AtomicUsize>) {
        server(true).await
    }

    /// Holds every connection open, reading nothing (but, when `preface`,
    /// the preface, which it answers, and a first frame, answered OK when
    /// it is a HELLO); counts the connections.
    async fn server(preface: bool) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let mut theirs = [0u8; PREFACE_LEN];
                if preface && stream.read_exact(&mut theirs).await.is_ok() {
                    let _ = stream.write_all(&Preface::CURRENT.encode()).await;
                    held.push(tokio::spawn(answer_hello(stream)));
                    continue;
                }
                held.push(tokio::spawn(async move {
                    let _stream = stream;
                    std::future::pending::<()>().await
                }));
            }
        });
        (addr, accepted)
    }

    /// Answers the first frame OK if it is a HELLO, then reads no more.
    async fn answer_hello(stream: TcpStream) {
        let (reader, mut writer) = stream.into_split();
        let mut frames = FrameReader::<_, BinRequest>::new(reader, 1 << 20);
        if let Some(Ok(first)) = frames.next().await
            && first.header.message_type() == Ok(MessageType::Hello)
        {
            let mut head = bytes::BytesMut::new();
            let reply = BinReply::to(&first.header, Status::Ok);
            if binx_proto::encode_frame_head(&reply, 0, &mut head).is_ok() {
                let _ = writer.write_all(&head).await;
            }
        }
        let _kept = (frames, writer);
        std::future::pending::<()>().await
    }

    #[test]
    fn a_hello_reply_names_the_server_and_its_process_instance() {
        let caps = |list: &[&str]| list.iter().map(|c| c.to_string()).collect::<Vec<_>>();
        let said = ServerIdentity::from_capabilities(&caps(&[
            "pipelined-data",
            "node=pod-1",
            "instance=0123456789abcdef",
        ]));
        assert_eq!(said.node.as_deref(), Some("pod-1"));
        assert_eq!(said.instance.as_deref(), Some("0123456789abcdef"));
        assert_eq!(
            ServerIdentity::from_capabilities(&caps(&["pipelined-data"])),
            ServerIdentity::default()
        );
        // Not an id: a line break, spaces, nothing, or more than 64 bytes.
        for bad in [
            "instance=ab\ninjected log line",
            "instance=a b",
            "instance=",
            &format!("instance={}", "a".repeat(65)),
        ] {
            assert_eq!(
                ServerIdentity::from_capabilities(&caps(&[bad])).instance,
                None,
                "{bad:?}"
            );
        }
        let long = format!("node={}", "n".repeat(100));
        assert_eq!(
            ServerIdentity::from_capabilities(&caps(&[&long]))
                .node
                .map(|n| n.len()),
            Some(64)
        );
        // A limit is a number, or not taken (a hostile server's text, a
        // negative, past u64).
        let all = ServerIdentity::from_capabilities(&caps(&[
            "max-enqueue-bytes=1048576",
            "max-pages-per-enqueue=100",
            "max-frame-bytes=65536",
        ]));
        assert_eq!(all.max_enqueue_bytes, Some(1 << 20));
        assert_eq!(all.max_pages_per_enqueue, Some(100));
        assert_eq!(all.max_frame_bytes, Some(65536));
        for name in [
            "max-enqueue-bytes=",
            "max-pages-per-enqueue=",
            "max-frame-bytes=",
        ] {
            for bad in ["", "0", "-1", "1 MiB", "18446744073709551616"] {
                let said = ServerIdentity::from_capabilities(&caps(&[&format!("{name}{bad}")]));
                assert_eq!(
                    (
                        said.max_enqueue_bytes,
                        said.max_pages_per_enqueue,
                        said.max_frame_bytes
                    ),
                    (None, None, None),
                    "{name}{bad:?}"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_that_stops_reading_fails_the_request_in_time_and_the_connection() {
        let (addr, accepted) = deaf_server().await;
        let timeout = Duration::from_millis(500);
        let connection = Connection::new(
            Endpoint::Tcp(addr),
            ConnectionOptions {
                request_timeout: timeout,
                stripes: 1,
                ..Default::default()
            },
        );
        // More than the sockets' buffers hold: the writes stall.
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let connection = connection.clone();
            calls.spawn(async move {
                let started = Instant::now();
                let mut enqueue = BinRequest::new(MessageType::Enqueue);
                enqueue.task_id = "deaf".into();
                enqueue.page_sizes = vec![8 << 20];
                let result = connection
                    .call(enqueue, vec![Bytes::from(vec![0u8; 8 << 20])])
                    .await;
                (started.elapsed(), result)
            });
        }
        while let Some(call) = calls.join_next().await {
            let (took, result) = call.unwrap();
            let error = match result {
                Ok(reply) => panic!("a reply from a deaf server: {:?}", reply.header),
                Err(e) => e,
            };
            assert!(
                matches!(
                    error,
                    ClientError::Timeout { .. } | ClientError::ConnectionLost { .. }
                ),
                "{error}"
            );
            assert!(took < timeout * 6, "failed after {took:?}: {error}");
        }
        // The stalled connection is given up once its writer made no
        // progress for request_timeout: the next call dials again.
        tokio::time::sleep(timeout * 2).await;
        let _ = connection.ping().await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Answers the preface, then HELLO and PING for as long as the
    /// connection lasts, and never anything else (a server too busy to
    /// answer a request, its socket alive); counts the connections.
    async fn busy_server() -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut theirs = [0u8; PREFACE_LEN];
                    stream.read_exact(&mut theirs).await.ok()?;
                    stream.write_all(&Preface::CURRENT.encode()).await.ok()?;
                    let (reader, mut writer) = stream.into_split();
                    let mut frames = FrameReader::<_, BinRequest>::new(reader, 1 << 20);
                    while let Some(Ok(frame)) = frames.next().await {
                        if matches!(
                            frame.header.message_type(),
                            Ok(MessageType::Hello | MessageType::Ping)
                        ) {
                            let mut head = bytes::BytesMut::new();
                            let reply = BinReply::to(&frame.header, Status::Ok);
                            binx_proto::encode_frame_head(&reply, 0, &mut head).ok()?;
                            writer.write_all(&head).await.ok()?;
                        }
                    }
                    Some(())
                });
            }
        });
        (addr, accepted)
    }

    fn data_request() -> BinRequest {
        let mut data = BinRequest::new(MessageType::Data);
        data.task_id = "t".into();
        data
    }

    /// A socket on which a request timed out is probed with a PING: one
    /// that answers is kept (the server was slow), one that does not is
    /// given up at once, so the next request dials a new socket instead of
    /// timing out on one the kernel keeps open for many minutes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_socket_on_which_a_request_timed_out_is_kept_only_if_it_answers_a_ping() {
        let timeout = Duration::from_millis(300);
        let options = ConnectionOptions {
            request_timeout: timeout,
            stripes: 1,
            ..Default::default()
        };
        // A DATA that times out on a new connection to `addr`, and time for
        // its probe to end.
        let timed_out_at = |addr: String| {
            let connection = Connection::new(Endpoint::Tcp(addr), options.clone());
            async move {
                let timed_out = connection.call(data_request(), Vec::new()).await;
                assert!(
                    matches!(timed_out, Err(ClientError::Timeout { .. })),
                    "{timed_out:?}"
                );
                tokio::time::sleep(timeout * 3).await;
                connection
            }
        };

        let (addr, accepted) = busy_server().await;
        let connection = timed_out_at(addr).await;
        assert_eq!(
            connection.open_stripes(),
            1,
            "a socket that answered its PING"
        );
        connection.ping().await.expect("a PING on the kept socket");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);

        let (addr, accepted) = deaf_server().await;
        let connection = timed_out_at(addr).await;
        assert_eq!(
            connection.open_stripes(),
            0,
            "a socket that answered nothing"
        );
        // A PING that times out gives its socket up itself.
        assert!(connection.ping().await.is_err());
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(connection.open_stripes(), 0);
        assert!(connection.ping().await.is_err());
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    /// The kernel is told to close a TCP socket whose peer is gone within
    /// about a minute (keepalive probes, a limit on unacknowledged bytes).
    #[tokio::test]
    async fn tcp_sockets_are_closed_by_the_kernel_once_their_peer_is_gone() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        keep_alive(&stream, Duration::from_secs(10)).unwrap();
        use binx_proto::keepalive::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES};
        let socket = socket2::SockRef::from(&stream);
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(socket.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(UNACKNOWLEDGED_LIMIT)
        );
        // A longer request timeout is not cut short by the kernel.
        keep_alive(&stream, Duration::from_secs(300)).unwrap();
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(300))
        );
    }

    /// A request whose caller went while it waited for room in the socket's
    /// queue (its frame never sent) leaves no reply slot behind: nothing
    /// would ever answer it, and the socket would never count as idle again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_dropped_before_its_frame_left_leaves_no_reply_slot() {
        let (addr, _) = deaf_server().await;
        let connection = Connection::new(
            Endpoint::Tcp(addr),
            ConnectionOptions {
                request_timeout: Duration::from_secs(120),
                stripes: 1,
                ..Default::default()
            },
        );
        let enqueue = || {
            let mut enqueue = BinRequest::new(MessageType::Enqueue);
            enqueue.task_id = "deaf".into();
            enqueue.page_sizes = vec![64 << 10];
            (enqueue, vec![Bytes::from(vec![0u8; 64 << 10])])
        };
        // More than the socket's buffers and its queue hold.
        let mut held = tokio::task::JoinSet::new();
        for _ in 0..REQUEST_QUEUE + 256 {
            let connection = connection.clone();
            let (request, body) = enqueue();
            held.spawn(async move { connection.call(request, body).await });
        }
        let pending = || {
            connection.shared.stripes[0]
                .live
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map_or(0, |live| live.state.pending().len())
        };
        let mut settled = 0;
        for _ in 0..100 {
            let now = pending();
            tokio::time::sleep(Duration::from_millis(200)).await;
            if now > REQUEST_QUEUE && pending() == now {
                settled = now;
                break;
            }
        }
        assert!(settled > REQUEST_QUEUE, "the queue filled: {}", pending());
        for _ in 0..10 {
            let (request, body) = enqueue();
            let waited =
                tokio::time::timeout(Duration::from_millis(100), connection.call(request, body))
                    .await;
            assert!(waited.is_err(), "no room: the caller gives up first");
        }
        assert_eq!(pending(), settled, "slots of requests never sent stayed");
        held.abort_all();
    }

    /// A server that accepts connections and never answers the preface;
    /// counts the connections.
    async fn mute_server() -> (String, Arc<AtomicUsize>) {
        server(false).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_waiting_for_a_connect_share_its_failure_instead_of_dialling_in_turn() {
        let (addr, accepted) = mute_server().await;
        let timeout = Duration::from_millis(300);
        let connection = Connection::new(
            Endpoint::Tcp(addr),
            ConnectionOptions {
                connect_timeout: timeout,
                stripes: 1,
                ..Default::default()
            },
        );
        // join_all polls all eight before the first connect can end: seven
        // wait for it.
        let calls = (0..8).map(|_| connection.ping());
        for result in futures_util::future::join_all(calls).await {
            match result {
                Err(ClientError::ConnectTimeout { after, .. }) => assert_eq!(after, timeout),
                other => panic!("a ping of a mute server: {other:?}"),
            }
        }
        // One connect for all eight, not eight in turn (each a timeout).
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // A later request dials again.
        assert!(connection.ping().await.is_err());
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    fn striped(endpoint: &str, stripes: usize) -> Connection {
        Connection::new(
            endpoint.parse().unwrap(),
            ConnectionOptions {
                stripes,
                request_timeout: Duration::from_secs(5),
                ..Default::default()
            },
        )
    }

    #[test]
    fn data_goes_round_the_stripes_and_every_other_request_by_its_task() {
        let connection = striped("127.0.0.1:1", 4);
        let stripe = |kind: MessageType, task: &str| {
            let mut request = BinRequest::new(kind);
            request.task_id = task.into();
            connection.stripe_for(&request)
        };
        let data: Vec<usize> = (0..8).map(|_| stripe(MessageType::Data, "t")).collect();
        assert_eq!(data, [0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(stripe(MessageType::Ping, ""), 0);
        assert_eq!(stripe(MessageType::Ping, ""), 0);
        // A task's ENQUEUEs, NO_MORE_PAGES and the rest keep one socket, so
        // they arrive in the order sent; tasks spread over all of them.
        let mut used = std::collections::BTreeSet::new();
        for n in 0..64 {
            let task = format!("q7.{n}.0.0");
            let own = stripe(MessageType::Enqueue, &task);
            for kind in [
                MessageType::OpenTask,
                MessageType::NoMorePages,
                MessageType::Ack,
                MessageType::Delete,
                MessageType::AbortTask,
            ] {
                assert_eq!(stripe(kind, &task), own, "{kind:?} of {task}");
            }
            used.insert(own);
        }
        assert_eq!(used.len(), 4);
        // A Unix socket is one socket; the count is kept within its range.
        assert_eq!(striped("/tmp/binx-test.sock", 4).stripes(), 1);
        assert_eq!(striped("127.0.0.1:1", 0).stripes(), 1);
        assert_eq!(striped("127.0.0.1:1", 1000).stripes(), MAX_STRIPES);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stripes_open_as_requests_first_use_them_and_all_close_on_disconnect() {
        let (addr, accepted) = deaf_server().await;
        let connection = striped(&addr, 3);
        assert_eq!(
            connection.open_stripes(),
            0,
            "nothing opens before a request"
        );
        let mut calls = tokio::task::JoinSet::new();
        for n in 0..6 {
            let connection = connection.clone();
            calls.spawn(async move {
                let mut data = BinRequest::new(MessageType::Data);
                data.task_id = "t".into();
                data.page_token = n;
                connection.call(data, Vec::new()).await
            });
        }
        // Two DATA on each stripe, all six waiting for their replies.
        let waiting = || -> usize {
            connection
                .shared
                .stripes
                .iter()
                .filter_map(|s| s.live.lock().unwrap().clone())
                .map(|l| l.state.pending().len())
                .sum()
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while waiting() < 6 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(waiting(), 6);
        assert_eq!(connection.open_stripes(), 3);
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        connection.disconnect();
        assert_eq!(connection.open_stripes(), 0);
        while let Some(call) = calls.join_next().await {
            match call.unwrap() {
                Err(ClientError::ConnectionLost { reason, .. }) => {
                    assert!(reason.contains("disconnected by the client"), "{reason}")
                }
                other => panic!("a DATA on a closed stripe: {other:?}"),
            }
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3, "no stripe opened twice");
    }
}
