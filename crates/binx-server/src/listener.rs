//! The BinX listeners: accept loops for TCP and the Unix socket, a limit on
//! open connections, and removal of the socket file on shutdown.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use thiserror::Error;
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::connection::{
    ConnectionConfig, ConnectionError, OnAuthenticated, Refusal, Transport, serve_connection,
};
use crate::exchange::{ConnectionEvent, Exchange};
use crate::shm::serve_unix;
use binx_ktls::{KernelTls, RecordReader, Secured, secure};

/// Where and how to listen.
#[derive(Clone, Debug, Default)]
pub struct ListenConfig {
    /// `host:port` for remote peers; `None` disables TCP.
    pub tcp: Option<String>,
    /// Socket path for local engines; `None` disables the Unix socket.
    pub uds: Option<PathBuf>,
    /// Who may use the Unix socket.
    pub uds_access: UdsAccess,
    /// Connections open at once over both listeners; past it new ones are
    /// closed. TCP may hold all but [`unix_reserve`] of them, so that
    /// strangers on the network can never take every slot from the local
    /// engine.
    pub max_connections: usize,
    /// Limits and identity of each connection.
    pub connection: ConnectionConfig,
    /// TLS on the TCP listener (the Unix socket never uses it); with a
    /// client certificate verifier in it, mutual TLS.
    pub tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    /// After each TLS handshake, hand the connection's keys to the kernel
    /// where it offers kernel TLS for the negotiated suite (probed at bind);
    /// elsewhere rustls serves the connection as without it.
    pub kernel_tls: bool,
}

/// Who may use the Unix socket: file permissions first, then the peer's
/// uid (SO_PEERCRED) when an allow list is set.
#[derive(Clone, Debug)]
pub struct UdsAccess {
    /// Permission bits of the socket file; connecting needs write permission.
    pub mode: u32,
    /// Group of the socket file; `None` keeps the one it was created with
    /// (the directory's, when the directory is setgid, as a Kubernetes
    /// emptyDir with an fsGroup is).
    pub group: Option<u32>,
    /// Uids allowed to talk; empty allows whoever can open the socket.
    pub allowed_uids: Vec<u32>,
}

impl Default for UdsAccess {
    fn default() -> Self {
        UdsAccess {
            mode: 0o660,
            group: None,
            allowed_uids: Vec::new(),
        }
    }
}

impl UdsAccess {
    /// Why a peer may not use the socket, if it may not.
    fn refusal(&self, peer: Option<(u32, Option<i32>)>) -> Option<Refusal> {
        self.refusal_reason(peer).map(|reason| Refusal {
            status: binx_proto::Status::Unauthenticated,
            reason,
        })
    }

    fn refusal_reason(&self, peer: Option<(u32, Option<i32>)>) -> Option<String> {
        if self.allowed_uids.is_empty() {
            return None;
        }
        match peer {
            Some((uid, _)) if self.allowed_uids.contains(&uid) => None,
            Some((uid, pid)) => Some(format!(
                "uid {uid} (pid {}) is not in this binxd's uds_allowed_uids",
                pid.map_or_else(|| "unknown".to_string(), |p| p.to_string())
            )),
            None => {
                Some("the peer's credentials cannot be read, and uds_allowed_uids is set".into())
            }
        }
    }
}

/// A listener could not be set up.
#[derive(Debug, Error)]
pub enum ListenError {
    /// The TCP address could not be bound.
    #[error("cannot listen on TCP {addr}: {source}")]
    Tcp {
        /// The address as configured.
        addr: String,
        /// Why binding failed.
        source: io::Error,
    },
    /// The Unix socket's directory could not be created.
    #[error("cannot create the directory {dir} for the Unix socket: {source}")]
    SocketDir {
        /// The directory.
        dir: PathBuf,
        /// Why creating it failed.
        source: io::Error,
    },
    /// A live binxd answers on the socket path.
    #[error("another process is already serving the Unix socket {0}")]
    SocketInUse(PathBuf),
    /// The Unix socket could not be bound.
    #[error("cannot listen on the Unix socket {path}: {source}")]
    Uds {
        /// The socket's path.
        path: PathBuf,
        /// Why binding failed.
        source: io::Error,
    },
    /// The Unix socket's mode or group could not be set.
    #[error("cannot set the mode {mode:o} or group {group:?} of the Unix socket {path}: {source}")]
    UdsPermissions {
        /// The socket's path.
        path: PathBuf,
        /// The mode asked for (uds_mode).
        mode: u32,
        /// The group asked for (uds_group), as a gid.
        group: Option<u32>,
        /// Why it failed.
        source: io::Error,
    },
}

/// Bound listeners, ready to serve.
#[derive(Debug)]
pub struct BinxServer {
    exchange: Exchange,
    tcp: Option<TcpListener>,
    uds: Option<(UnixListener, SocketFile)>,
    uds_access: UdsAccess,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    /// What the kernel takes of TLS, when kernel TLS is on and offered.
    kernel_tls: Option<Arc<KernelTls>>,
    limit: Arc<Semaphore>,
    connection: Arc<ConnectionConfig>,
}

impl BinxServer {
    /// Binds every configured listener, or fails naming the one that could not be bound.
    pub async fn bind(exchange: Exchange, config: ListenConfig) -> Result<Self, ListenError> {
        let tcp = match &config.tcp {
            Some(addr) => {
                Some(
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| ListenError::Tcp {
                            addr: addr.clone(),
                            source,
                        })?,
                )
            }
            None => None,
        };
        let uds = match &config.uds {
            Some(path) => {
                let (listener, file) = bind_uds(path, &config.uds_access).await?;
                Some((listener, file))
            }
            None => None,
        };
        let kernel_tls = match (&config.tls, config.kernel_tls) {
            (Some(_), true) => {
                let kernel = KernelTls::probe();
                match kernel.unavailable() {
                    None => Some(Arc::new(kernel)),
                    Some(why) => {
                        tracing::info!(
                            reason = why,
                            "kernel TLS is not offered here; rustls encrypts TLS connections"
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        let tls = match (&config.tls, &kernel_tls) {
            (Some(tls), Some(_)) => Some(binx_ktls::allow_secret_extraction(tls)),
            (tls, _) => tls.clone(),
        };
        Ok(BinxServer {
            exchange,
            tcp,
            uds,
            uds_access: config.uds_access,
            tls,
            kernel_tls,
            limit: Arc::new(Semaphore::new(config.max_connections.max(1))),
            connection: Arc::new(config.connection),
        })
    }

    /// Whether TLS connections go to the kernel (kernel TLS on and offered).
    pub fn kernel_tls(&self) -> bool {
        self.kernel_tls.is_some()
    }

    /// The bound TCP address (useful with port 0).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The Unix socket path, if listening on one.
    pub fn uds_path(&self) -> Option<&Path> {
        self.uds.as_ref().map(|(_, file)| file.path())
    }

    /// Serves until `shutdown` completes, then stops accepting and removes the
    /// socket file. Open connections end with the runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let (uds, socket_file) = match self.uds {
            Some((listener, file)) => (Some(listener), Some(file)),
            None => (None, None),
        };
        let max_connections = self.limit.available_permits();
        // Kept for the Unix socket only when there is one.
        let unix_reserve = if uds.is_some() {
            unix_reserve(max_connections)
        } else {
            0
        };
        let acceptor = Acceptor {
            exchange: self.exchange,
            max_connections,
            unix_reserve,
            tcp_limit: Arc::new(Semaphore::new(max_connections - unix_reserve)),
            unauthenticated: Arc::new(Unauthenticated::new(unauthenticated_limit(
                max_connections - unix_reserve,
            ))),
            limit: self.limit,
            refusing: Arc::new(Semaphore::new(REFUSING_AT_ONCE)),
            connection: self.connection,
        };
        let tls = self.tls.map(tokio_rustls::TlsAcceptor::from);
        let tcp_loop = async {
            let Some(listener) = self.tcp else {
                return std::future::pending().await;
            };
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        if let Err(e) = keep_alive(&stream, acceptor.connection.write_stall_timeout)
                        {
                            tracing::debug!(%peer, error = %e, "cannot set TCP keepalive on an accepted connection");
                        }
                        match &tls {
                            Some(tls) => acceptor.spawn_tls(
                                stream,
                                tls.clone(),
                                self.kernel_tls.clone(),
                                peer.to_string(),
                            ),
                            None => {
                                let (r, w) = stream.into_split();
                                acceptor.spawn(
                                    Transport::Tcp,
                                    peer.to_string(),
                                    None,
                                    move |exchange, config, refusal, authenticated| {
                                        serve_connection(
                                            r,
                                            w,
                                            Transport::Tcp,
                                            exchange,
                                            config,
                                            refusal,
                                            authenticated,
                                        )
                                    },
                                );
                            }
                        }
                    }
                    Err(e) => accept_failed(Transport::Tcp, e).await,
                }
            }
        };
        let uds_access = self.uds_access;
        let uds_loop = async {
            // Borrowed: the socket stays bound until its file is removed
            // below (closed first, another binxd could take the path and
            // even the inode in between).
            let Some(listener) = uds.as_ref() else {
                return std::future::pending().await;
            };
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let cred = stream.peer_cred().ok().map(|c| (c.uid(), c.pid()));
                        let refusal = uds_access.refusal(cred);
                        let peer = match cred {
                            Some((uid, Some(pid))) => format!("local uid {uid} pid {pid}"),
                            Some((uid, None)) => format!("local uid {uid}"),
                            None => "local".into(),
                        };
                        if let Some(refusal) = &refusal {
                            tracing::warn!(%peer, "Unix socket connection refused: {}", refusal.reason);
                        }
                        acceptor.spawn(
                            Transport::Uds,
                            peer,
                            refusal,
                            move |exchange, config, refusal, _| {
                                serve_unix(stream, exchange, config, refusal)
                            },
                        );
                    }
                    Err(e) => accept_failed(Transport::Uds, e).await,
                }
            }
        };
        tokio::select! {
            _ = tcp_loop => {}
            _ = uds_loop => {}
            _ = shutdown => {}
        }
        if let Some(file) = socket_file {
            file.remove();
        }
        drop(uds);
    }
}

/// Slots of `max_connections` TCP connections may not take: a quarter, at
/// most 256. Anyone who reaches the TCP port can open connections that
/// hold a slot until their handshake times out; the local engine's Unix
/// socket connections keep these slots whatever TCP holds.
pub fn unix_reserve(max_connections: usize) -> usize {
    (max_connections / 4).min(256)
}

/// What every accepted connection shares.
struct Acceptor {
    exchange: Exchange,
    /// Every connection takes one of these...
    limit: Arc<Semaphore>,
    max_connections: usize,
    /// ...and a TCP connection one of these too (`max_connections` less
    /// the Unix socket's reserve).
    tcp_limit: Arc<Semaphore>,
    /// Slots TCP may not take ([`unix_reserve`], or none without a Unix
    /// socket).
    unix_reserve: usize,
    /// TCP connections that have not authenticated yet.
    unauthenticated: Arc<Unauthenticated>,
    /// Connections over the limit that are being told so (bounded: past it
    /// they are just closed).
    refusing: Arc<Semaphore>,
    connection: Arc<ConnectionConfig>,
}

/// Connections over the limit told why at once, at most.
const REFUSING_AT_ONCE: usize = 32;
/// Longest a refused connection is kept to be told why.
const REFUSAL_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// A connection's slots, held while it is served.
type Slots = (
    tokio::sync::OwnedSemaphorePermit,
    Option<tokio::sync::OwnedSemaphorePermit>,
);

/// Slots to serve, or a slot to deliver a refusal (or nothing: just close).
enum Admission {
    Serve(Slots),
    Refuse(tokio::sync::OwnedSemaphorePermit, Refusal),
    Close,
}

/// What a connection's task holds until it ends (dropped, the slots free).
enum Held {
    Serving(#[allow(dead_code)] Slots),
    Refusing(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit),
}

impl Admission {
    /// What to hold, and the refusal to deliver (`refusal` unless over the
    /// limit); `None`: close at once.
    fn held(self, refusal: Option<Refusal>) -> Option<(Held, Option<Refusal>)> {
        match self {
            Admission::Serve(slots) => Some((Held::Serving(slots), refusal)),
            Admission::Refuse(permit, limit) => Some((Held::Refusing(permit), Some(limit))),
            Admission::Close => None,
        }
    }
}

impl Acceptor {
    /// Takes a connection slot (and a TCP connection a TCP slot); at the
    /// limit, a slot to tell the peer why.
    fn admit(&self, peer: &str, transport: Transport, name: &str) -> Admission {
        let tcp = match transport {
            Transport::Tcp => self.tcp_limit.clone().try_acquire_owned().ok(),
            Transport::Uds | Transport::SharedMemory => None,
        };
        let refusal = match (transport, &tcp) {
            (Transport::Tcp, None) => Some(self.tcp_limit_refusal()),
            _ => None,
        };
        if refusal.is_none()
            && let Ok(permit) = self.limit.clone().try_acquire_owned()
        {
            return Admission::Serve((permit, tcp));
        }
        let refusal = refusal.unwrap_or_else(|| self.limit_refusal());
        self.exchange.count(ConnectionEvent::Refused);
        tracing::warn!(%peer, transport = name, "connection refused: the connection limit is reached");
        match self.refusing.clone().try_acquire_owned() {
            Ok(permit) => Admission::Refuse(permit, refusal),
            Err(_) => Admission::Close,
        }
    }

    fn limit_refusal(&self) -> Refusal {
        Refusal {
            status: binx_proto::Status::Busy,
            reason: format!(
                "binxd is serving its limit of {} connections (max_connections); retry later",
                self.max_connections
            ),
        }
    }

    /// A served TCP connection's place among those waiting to
    /// authenticate (none for the Unix socket, or a refused connection,
    /// which is closed within seconds anyway).
    fn enter_unauthenticated(
        &self,
        transport: Transport,
        refusal: &Option<Refusal>,
    ) -> Option<Entry> {
        (transport == Transport::Tcp && refusal.is_none()).then(|| self.unauthenticated.enter())
    }

    fn tcp_limit_refusal(&self) -> Refusal {
        if self.unix_reserve == 0 {
            return self.limit_refusal();
        }
        Refusal {
            status: binx_proto::Status::Busy,
            reason: format!(
                "binxd is serving its limit of {} TCP connections (max_connections, less {} kept for the Unix socket); retry later",
                self.max_connections - self.unix_reserve,
                self.unix_reserve
            ),
        }
    }

    /// Serves the connection in its own task; over the limit, answers its
    /// first request BUSY, naming the limit, and closes it.
    fn spawn<S, F>(&self, transport: Transport, peer: String, refusal: Option<Refusal>, serve: S)
    where
        S: FnOnce(Exchange, Arc<ConnectionConfig>, Option<Refusal>, Option<OnAuthenticated>) -> F
            + Send
            + 'static,
        F: Future<Output = Result<(), crate::connection::ConnectionError>> + Send + 'static,
    {
        let Some((held, refusal)) = self.admit(&peer, transport, transport.name()).held(refusal)
        else {
            return;
        };
        let entry = self.enter_unauthenticated(transport, &refusal);
        let exchange = self.exchange.clone();
        let config = self.connection.clone();
        exchange.count(ConnectionEvent::Opened);
        tokio::spawn(async move {
            let refused = refusal.is_some();
            let hook = entry.as_ref().map(Entry::hook);
            let serve = serve(exchange.clone(), config, refusal, hook);
            let served = displaceable(bounded_if_refused(serve, refused), entry, &exchange).await;
            match served {
                Ok(()) | Err(ConnectionError::ClosedBeforePreface) => {}
                Err(e) => {
                    tracing::info!(%peer, transport = transport.name(), error = %e, "connection closed");
                }
            }
            exchange.count(ConnectionEvent::Closed);
            drop(held);
        });
    }
}

/// A refused connection is kept only long enough to be told why.
async fn bounded_if_refused(
    serve: impl Future<Output = Result<(), crate::connection::ConnectionError>>,
    refused: bool,
) -> Result<(), crate::connection::ConnectionError> {
    if refused {
        tokio::time::timeout(REFUSAL_TIME, serve)
            .await
            .unwrap_or(Ok(()))
    } else {
        serve.await
    }
}

impl ListenError {
    /// The same error, naming the socket's final path (not where it was bound).
    fn at(self, final_path: &Path) -> Self {
        match self {
            ListenError::UdsPermissions {
                mode,
                group,
                source,
                ..
            } => ListenError::UdsPermissions {
                path: final_path.to_path_buf(),
                mode,
                group,
                source,
            },
            other => other,
        }
    }
}

/// Applies `access`'s mode and group to the socket file.
fn set_socket_access(path: &Path, access: &UdsAccess) -> Result<(), ListenError> {
    use std::os::unix::fs::PermissionsExt;
    let failed = |source| ListenError::UdsPermissions {
        path: path.to_path_buf(),
        mode: access.mode,
        group: access.group,
        source,
    };
    if let Some(gid) = access.group {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(failed)?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(access.mode)).map_err(failed)
}

/// Plaintext rustls takes from a reply before it writes records (see
/// `Acceptor::spawn_tls`).
const TLS_WRITE_BUFFER: usize = 1 << 20;

impl Acceptor {
    /// Completes the TLS handshake (bounded by the preface timeout) in a task
    /// of its own, then serves the connection; a failed handshake is logged
    /// with its reason and counted as a protocol error.
    fn spawn_tls(
        &self,
        stream: tokio::net::TcpStream,
        tls: tokio_rustls::TlsAcceptor,
        kernel: Option<Arc<KernelTls>>,
        peer: String,
    ) {
        let Some((held, refusal)) = self.admit(&peer, Transport::Tcp, "tcp+tls").held(None) else {
            return;
        };
        let entry = self.enter_unauthenticated(Transport::Tcp, &refusal);
        let exchange = self.exchange.clone();
        let config = self.connection.clone();
        let limit = config.handshake_timeout;
        tokio::spawn(async move {
            let hook = entry.as_ref().map(Entry::hook);
            let opened = std::sync::atomic::AtomicBool::new(false);
            let work = async {
                let stream = RecordReader::new(stream, kernel.is_some());
                let handshake = async {
                    let stream = tls.accept(stream).await.map_err(|e| e.to_string())?;
                    match &kernel {
                        Some(kernel) => secure(stream, kernel).await.map_err(|e| e.to_string()),
                        None => Ok(Secured::Rustls(Box::new(stream))),
                    }
                };
                let secured = match tokio::time::timeout(limit, handshake).await {
                    Ok(Ok(secured)) => secured,
                    Ok(Err(e)) => {
                        exchange.count(ConnectionEvent::ProtocolError);
                        tracing::warn!(%peer, error = %e, "TLS handshake failed");
                        return Ok(());
                    }
                    Err(_) => {
                        exchange.count(ConnectionEvent::ProtocolError);
                        tracing::warn!(%peer, "TLS handshake took longer than {limit:?}");
                        return Ok(());
                    }
                };
                exchange.count(ConnectionEvent::Opened);
                opened.store(true, std::sync::atomic::Ordering::Relaxed);
                match secured {
                    Secured::Kernel(reader, writer) => {
                        exchange.count(ConnectionEvent::TlsKernel);
                        serve_tcp(reader, writer, exchange.clone(), config, refusal, hook).await
                    }
                    Secured::Rustls(mut stream) => {
                        exchange.count(ConnectionEvent::TlsRustls);
                        // rustls encrypts at most its buffer limit (64 KiB by
                        // default) before it writes: replies are megabytes, so
                        // fewer, larger writes. Memory is held only while a
                        // reply is being sent.
                        stream.get_mut().1.set_buffer_limit(Some(TLS_WRITE_BUFFER));
                        let (reader, writer) = tokio::io::split(*stream);
                        serve_tcp(reader, writer, exchange.clone(), config, refusal, hook).await
                    }
                }
            };
            let served = displaceable(work, entry, &exchange).await;
            match served {
                Ok(()) | Err(ConnectionError::ClosedBeforePreface) => {}
                Err(e) => {
                    tracing::info!(%peer, transport = "tcp+tls", error = %e, "connection closed");
                }
            }
            if opened.load(std::sync::atomic::Ordering::Relaxed) {
                exchange.count(ConnectionEvent::Closed);
            }
            drop(held);
        });
    }
}

/// Serves a TCP connection (TLS already done), bounded when refused.
async fn serve_tcp<R, W>(
    reader: R,
    writer: W,
    exchange: Exchange,
    config: Arc<ConnectionConfig>,
    refusal: Option<Refusal>,
    authenticated: Option<OnAuthenticated>,
) -> Result<(), ConnectionError>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let refused = refusal.is_some();
    let serve = serve_connection(
        reader,
        writer,
        Transport::Tcp,
        exchange,
        config,
        refusal,
        authenticated,
    );
    bounded_if_refused(serve, refused).await
}

/// Of `tcp_connections` (TCP's share of `max_connections`), the TCP
/// connections that have not authenticated (no HELLO yet where a
/// shared secret asks for one, or no preface yet) that binxd keeps at once:
/// anyone who reaches the port can open such connections, each held until
/// its handshake times out; past this many, the oldest is closed for a new
/// one, so that a flood of them never keeps a real peer from saying HELLO
/// (its connection is the newest while it does).
pub fn unauthenticated_limit(tcp_connections: usize) -> usize {
    (tcp_connections / 2).clamp(1, 256)
}

/// The TCP connections waiting to authenticate, oldest first.
struct Unauthenticated {
    waiting: Mutex<VecDeque<(u64, tokio::sync::oneshot::Sender<usize>)>>,
    next_id: std::sync::atomic::AtomicU64,
    most: usize,
}

impl Unauthenticated {
    fn new(most: usize) -> Self {
        Unauthenticated {
            waiting: Mutex::new(VecDeque::new()),
            next_id: std::sync::atomic::AtomicU64::new(0),
            most,
        }
    }

    /// Adds a connection, displacing the oldest when `most` wait already.
    fn enter(self: &Arc<Self>) -> Entry {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if waiting.len() >= self.most
            && let Some((_, oldest)) = waiting.pop_front()
        {
            let _ = oldest.send(self.most);
        }
        waiting.push_back((id, tx));
        Entry {
            registry: self.clone(),
            id,
            displaced: rx,
        }
    }

    fn leave(&self, id: u64) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = waiting.iter().position(|(i, _)| *i == id) {
            waiting.remove(at);
        }
    }
}

/// A connection's place among those waiting to authenticate; left when
/// dropped, or when its peer authenticated.
struct Entry {
    registry: Arc<Unauthenticated>,
    id: u64,
    displaced: tokio::sync::oneshot::Receiver<usize>,
}

impl Entry {
    /// Called by the connection once its peer owes no HELLO.
    fn hook(&self) -> OnAuthenticated {
        let (registry, id) = (self.registry.clone(), self.id);
        Box::new(move || registry.leave(id))
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.registry.leave(self.id);
    }
}

/// Runs a connection's `work`, ending it (dropped) if the connection is
/// displaced before it authenticated.
async fn displaceable<T>(
    work: impl Future<Output = Result<T, ConnectionError>>,
    entry: Option<Entry>,
    exchange: &Exchange,
) -> Result<T, ConnectionError> {
    let Some(mut entry) = entry else {
        return work.await;
    };
    let displaced = async {
        match (&mut entry.displaced).await {
            Ok(most) => most,
            // Authenticated: never displaced.
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        done = work => done,
        most = displaced => {
            exchange.count(ConnectionEvent::TimedOut);
            Err(ConnectionError::Displaced(most))
        }
    }
}

async fn accept_failed(transport: Transport, error: io::Error) {
    // Typically out of file descriptors: wait a little instead of spinning.
    tracing::warn!(transport = transport.name(), %error, "accept failed");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

/// Binds the Unix socket `path` with `access`'s mode and group, so that
/// it is never reachable with wider access: the socket is bound in a fresh
/// directory only this user can enter, given its mode and group there, and
/// linked into place (binding at `path` and setting the mode after would
/// leave a moment in which the umask's mode lets anyone connect). A link
/// never replaces a file, so of two binxd starting on one path at once
/// one is told the path is in use, as a second bind would have been.
pub(crate) async fn bind_uds(
    path: &Path,
    access: &UdsAccess,
) -> Result<(UnixListener, SocketFile), ListenError> {
    // Two binxd clearing one stale socket at once could each remove what
    // the other just placed: the directory's lock makes their turns one
    // after the other (held only while binding).
    let turn = DirectoryTurn::take(path).await?;
    StagedSocket::bind(path, access, turn.0.is_some())
        .await?
        .place()
        .await
}

/// The directory of socket `path`, made if missing.
fn socket_dir(path: &Path) -> Result<PathBuf, ListenError> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(|source| ListenError::SocketDir {
        dir: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// An exclusive lock (flock) on a socket's directory, held while a socket
/// is being bound there.
struct DirectoryTurn(Option<std::fs::File>);

/// Longest wait for a directory's turn: whoever else holds it (any user
/// who can read the directory can) is not waited on for ever.
const TURN_WAIT: std::time::Duration = if cfg!(test) {
    std::time::Duration::from_millis(500)
} else {
    std::time::Duration::from_secs(5)
};

impl DirectoryTurn {
    async fn take(path: &Path) -> Result<DirectoryTurn, ListenError> {
        let dir = socket_dir(path)?;
        // A directory that cannot be opened or locked (a file system
        // without flock), or whose lock is held past the wait, binds
        // without: the race it guards is rare.
        let Ok(file) = std::fs::File::open(&dir) else {
            return Ok(DirectoryTurn(None));
        };
        let started = tokio::time::Instant::now();
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(DirectoryTurn(Some(file))),
                Err(std::fs::TryLockError::WouldBlock) if started.elapsed() < TURN_WAIT => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    tracing::warn!(dir = %dir.display(), "another process holds the lock of the socket's directory; binding without it");
                    return Ok(DirectoryTurn(None));
                }
                Err(std::fs::TryLockError::Error(_)) => return Ok(DirectoryTurn(None)),
            }
        }
    }
}

impl Drop for DirectoryTurn {
    fn drop(&mut self) {
        if let Some(file) = &self.0 {
            let _ = file.unlock();
        }
    }
}

/// A socket bound and given its access in a private directory, not yet
/// at its path.
struct StagedSocket {
    listener: UnixListener,
    path: PathBuf,
    /// The directory it is bound in and its name there; `None` when it was
    /// bound at its path (only that path fits a socket address).
    staged: Option<(PrivateDir, PathBuf)>,
}

impl StagedSocket {
    /// `our_turn`: the directory's lock is held, so no other binxd is
    /// between its bind and its link there, and staging directories left
    /// in it are a dead process's.
    async fn bind(
        path: &Path,
        access: &UdsAccess,
        our_turn: bool,
    ) -> Result<StagedSocket, ListenError> {
        let dir = socket_dir(path)?;
        let failed = |source| ListenError::Uds {
            path: path.to_path_buf(),
            source,
        };
        clear_stale(path).await?;
        let private = PrivateDir::create(&dir).map_err(failed)?;
        if our_turn {
            private.clear_left_beside().await;
        }
        let bound = private.0.join("s");
        if bound.as_os_str().len() > MAX_SOCKET_PATH && path.as_os_str().len() <= MAX_SOCKET_PATH {
            let listener = UnixListener::bind(path).map_err(failed)?;
            set_socket_access(path, access)?;
            return Ok(StagedSocket {
                listener,
                path: path.to_path_buf(),
                staged: None,
            });
        }
        let listener = UnixListener::bind(&bound).map_err(failed)?;
        set_socket_access(&bound, access).map_err(|e| e.at(path))?;
        Ok(StagedSocket {
            listener,
            path: path.to_path_buf(),
            staged: Some((private, bound)),
        })
    }

    /// Links the socket at its path: never over another file, so of two
    /// binxd starting on one path at once one is told it is in use.
    async fn place(self) -> Result<(UnixListener, SocketFile), ListenError> {
        let path = self.path.as_path();
        let failed = |source| ListenError::Uds {
            path: path.to_path_buf(),
            source,
        };
        let Some((_private, bound)) = &self.staged else {
            let file = SocketFile::at(path).map_err(failed)?;
            return Ok((self.listener, file));
        };
        // Once more if a stale socket appeared meanwhile; a live one is refused.
        for _ in 0..2 {
            match std::fs::hard_link(bound, path) {
                Ok(()) => {
                    let file = SocketFile::at(path).map_err(failed)?;
                    return Ok((self.listener, file));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => clear_stale(path).await?,
                Err(e) => return Err(failed(e)),
            }
        }
        Err(ListenError::SocketInUse(path.to_path_buf()))
    }
}

/// Removes a socket file at `path` that nobody serves (a process that did
/// not exit cleanly left it); one that answers is in use, and one whose
/// state cannot be told (no permission, a full backlog) is not touched.
async fn clear_stale(path: &Path) -> Result<(), ListenError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    // A connect to a file that is no socket is refused too: never remove one.
    if !meta.file_type().is_socket() {
        return Err(ListenError::Uds {
            path: path.to_path_buf(),
            source: io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a file that is not a socket is there; binxd does not remove it",
            ),
        });
    }
    match UnixStream::connect(path).await {
        Ok(_) => Err(ListenError::SocketInUse(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            let _ = std::fs::remove_file(path);
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            Err(ListenError::SocketInUse(path.to_path_buf()))
        }
        Err(source) => Err(ListenError::Uds {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The socket file a listener was bound to, known by its inode: removed
/// at shutdown only while it is still that file (another binxd may have
/// put its own at the path since).
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    fn at(path: &Path) -> io::Result<SocketFile> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path)?;
        Ok(SocketFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// The path it was bound at.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the file if it is still the one bound.
    pub(crate) fn remove(&self) {
        use std::os::unix::fs::MetadataExt;
        if std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino)
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// A directory only its owner may enter, made fresh beside a socket's
/// path (never one that was there: another user may have made it) and
/// removed with what is left in it when dropped.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn create(beside: &Path) -> io::Result<Self> {
        use std::hash::{BuildHasher, Hasher};
        use std::os::unix::fs::DirBuilderExt;
        let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
        for _ in 0..16 {
            // A name nobody can guess ahead (RandomState is seeded at random).
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u32(std::process::id());
            let dir = beside.join(format!(".bx{:08x}", hasher.finish() as u32));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(PrivateDir(dir)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }
}

impl PrivateDir {
    /// Removes staging directories a process that died between its bind
    /// and its link left beside this one: named as binxd names them, owned
    /// by the same user, holding at most their socket, and that socket
    /// refusing connections (a binxd that bound without the directory's
    /// lock may be staging there now: its socket answers). Anything else is
    /// left alone.
    async fn clear_left_beside(&self) {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let (Some(parent), Ok(ours)) = (self.0.parent(), std::fs::symlink_metadata(&self.0)) else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(parent) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let Some(hex) = name.to_str().and_then(|n| n.strip_prefix(".bx")) else {
                continue;
            };
            if path == self.0 || hex.len() != 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                continue;
            }
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if !meta.is_dir() || meta.uid() != ours.uid() {
                continue;
            }
            let socket = path.join("s");
            if std::fs::symlink_metadata(&socket).is_ok_and(|m| m.file_type().is_socket()) {
                match UnixStream::connect(&socket).await {
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        let _ = std::fs::remove_file(&socket);
                    }
                    // Live, or its state cannot be told.
                    _ => continue,
                }
            }
            // Fails, and keeps it, unless it is empty now.
            if std::fs::remove_dir(&path).is_ok() {
                tracing::info!(dir = %path.display(), "removed a socket staging directory a stopped binxd left");
            }
        }
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Least time replies may stay unacknowledged before the kernel closes the
/// socket, and the margin past `write_stall_timeout` (so binxd's own stall
/// rule, which frees the replies, fires first).
const UNACKNOWLEDGED_LEAST: std::time::Duration = std::time::Duration::from_secs(60);
const UNACKNOWLEDGED_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Makes the kernel close an accepted TCP socket whose peer is gone (its
/// node powered off, the path black-holed), idle or with replies
/// unacknowledged, after about `write_stall_timeout` (at least a minute),
/// rather than at `idle_timeout` or after the quarter hour of retransmits
/// it keeps by default: its slot, and the replies it holds, come back
/// sooner. Without a `write_stall_timeout`, keepalive alone: about a
/// minute and a half idle.
fn keep_alive(
    stream: &tokio::net::TcpStream,
    write_stall_timeout: Option<std::time::Duration>,
) -> std::io::Result<()> {
    let unacknowledged =
        write_stall_timeout.map(|stall| stall.max(UNACKNOWLEDGED_LEAST) + UNACKNOWLEDGED_MARGIN);
    binx_proto::keepalive::keep_alive(stream, unacknowledged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// A directory of its own under the system's temporary directory (or
    /// /tmp, where that is too long for a socket's staging path to fit a
    /// socket address, which the tests here rely on).
    fn scratch(name: &str) -> PathBuf {
        let base = std::env::temp_dir();
        let base = if base.as_os_str().len() > 48 {
            PathBuf::from("/tmp")
        } else {
            base
        };
        let dir = base.join(format!("binx-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[tokio::test]
    async fn accepted_tcp_sockets_are_closed_by_the_kernel_once_their_peer_is_gone() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let seconds = std::time::Duration::from_secs;
        for (stall, unacknowledged) in [
            (seconds(90), Some(seconds(95))),
            (seconds(5), Some(seconds(65))),
        ] {
            keep_alive(&stream, Some(stall)).unwrap();
            use binx_proto::keepalive::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES};
            let socket = socket2::SockRef::from(&stream);
            assert!(socket.keepalive().unwrap());
            assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
            assert_eq!(socket.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
            assert_eq!(socket.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
            assert_eq!(socket.tcp_user_timeout().unwrap(), unacknowledged);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_socket_never_shows_a_wider_mode_than_asked_for() {
        let dir = scratch("bind-mode");
        let path = dir.join("binx.sock");
        let access = UdsAccess {
            mode: 0o600,
            ..UdsAccess::default()
        };
        // A neighbour looks at the path as often as it can while the socket
        // is bound again and again; bound at its path and given its mode
        // after, it was seen with the umask's mode.
        let done = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(AtomicU64::new(0));
        let watcher = {
            let (done, seen, path) = (done.clone(), seen.clone(), path.clone());
            std::thread::spawn(move || {
                let mut wrong = Vec::new();
                while !done.load(Ordering::Acquire) {
                    if let Ok(meta) = std::fs::symlink_metadata(&path) {
                        seen.fetch_add(1, Ordering::Relaxed);
                        let mode = meta.permissions().mode() & 0o777;
                        if mode != 0o600 {
                            wrong.push(mode);
                        }
                    }
                }
                wrong
            })
        };
        for _ in 0..300 {
            let (listener, file) = bind_uds(&path, &access).await.unwrap();
            UnixStream::connect(&path).await.unwrap();
            drop(listener);
            file.remove();
            assert!(!path.exists());
        }
        done.store(true, Ordering::Release);
        let wrong = watcher.join().unwrap();
        assert!(wrong.is_empty(), "seen with modes {wrong:?} (decimal)");
        assert!(
            seen.load(Ordering::Relaxed) > 0,
            "the watcher never saw the socket"
        );
        // Nothing is left beside it.
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A binxd that died between binding in its staging directory and
    /// linking the socket into place left the directory: the next bind in
    /// that directory removes it, and only what binxd would have left.
    #[tokio::test]
    async fn staging_directories_a_dead_binxd_left_are_removed() {
        let dir = scratch("bind-left");
        let path = dir.join("binx.sock");
        let left = dir.join(".bx0a1b2c3d");
        std::fs::create_dir(&left).unwrap();
        drop(std::os::unix::net::UnixListener::bind(left.join("s")).unwrap());
        let empty = dir.join(".bxffffffff");
        std::fs::create_dir(&empty).unwrap();
        // Another binxd staging there now (bound without the lock): kept.
        let live = dir.join(".bx00000003");
        std::fs::create_dir(&live).unwrap();
        let _staging = std::os::unix::net::UnixListener::bind(live.join("s")).unwrap();
        // Not binxd's, or not only binxd's: kept.
        let other_name = dir.join(".bxnothex1");
        std::fs::create_dir(&other_name).unwrap();
        let with_file = dir.join(".bx00000001");
        std::fs::create_dir(&with_file).unwrap();
        std::fs::write(with_file.join("keep"), b"x").unwrap();
        let a_file = dir.join(".bx00000002");
        std::fs::write(&a_file, b"x").unwrap();
        let (_listener, _file) = bind_uds(&path, &UdsAccess::default()).await.unwrap();
        assert!(!left.exists() && !empty.exists());
        assert!(other_name.exists() && with_file.join("keep").exists() && a_file.exists());
        assert!(live.join("s").exists());
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                ".bx00000001",
                ".bx00000002",
                ".bx00000003",
                ".bxnothex1",
                "binx.sock"
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_is_not() {
        let dir = scratch("bind-stale");
        let path = dir.join("binx.sock");
        let first = bind_uds(&path, &UdsAccess::default()).await.unwrap();
        assert!(matches!(
            bind_uds(&path, &UdsAccess::default()).await,
            Err(ListenError::SocketInUse(_))
        ));
        // Its process gone without removing it: stale, and replaced.
        drop(first);
        let second = bind_uds(&path, &UdsAccess::default()).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        UnixStream::connect(&path).await.unwrap();
        // The first one's file handle no longer names what is there: its
        // removal leaves the second one's socket alone.
        first_file_remove_spares(&path, &second.1);
        drop(second);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("binx.sock")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn binds_in_one_directory_take_turns() {
        let dir = scratch("bind-turns");
        let path = dir.join("binx.sock");
        let first = DirectoryTurn::take(&path).await.unwrap();
        assert!(first.0.is_some(), "the directory was not locked");
        let waiting = {
            let path = path.clone();
            tokio::spawn(async move { DirectoryTurn::take(&path).await.map(|_| ()) })
        };
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "a second turn was taken at once");
        drop(first);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the second turn comes once the first ends")
            .unwrap()
            .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_directory_lock_held_by_another_is_waited_on_only_so_long() {
        let dir = scratch("bind-held");
        let path = dir.join("binx.sock");
        let holder = std::fs::File::open(&dir).unwrap();
        holder.lock().unwrap();
        let started = std::time::Instant::now();
        let (_listener, _file) = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            bind_uds(&path, &UdsAccess::default()),
        )
        .await
        .expect("the bind does not wait for ever")
        .unwrap();
        assert!(started.elapsed() >= TURN_WAIT, "{:?}", started.elapsed());
        UnixStream::connect(&path).await.unwrap();
        drop(holder);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_file_that_is_no_socket_is_never_removed() {
        let dir = scratch("bind-file");
        let path = dir.join("binx.sock");
        std::fs::write(&path, b"an operator's file").unwrap();
        let e = bind_uds(&path, &UdsAccess::default()).await.unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"an operator's file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file handle of an earlier socket at `path` removes nothing now.
    fn first_file_remove_spares(path: &Path, now: &SocketFile) {
        let earlier = SocketFile {
            path: path.to_path_buf(),
            dev: now.dev,
            ino: now.ino.wrapping_add(1),
        };
        earlier.remove();
        assert!(path.exists(), "another binxd's socket was removed");
    }

    #[tokio::test]
    async fn of_two_binds_at_once_on_one_path_one_is_told_it_is_in_use() {
        let dir = scratch("bind-race");
        let path = dir.join("binx.sock");
        // Both found the path free and bound in their own directories.
        let a = StagedSocket::bind(&path, &UdsAccess::default(), false)
            .await
            .unwrap();
        let b = StagedSocket::bind(&path, &UdsAccess::default(), false)
            .await
            .unwrap();
        let (_a, a_file) = a.place().await.unwrap();
        assert!(matches!(b.place().await, Err(ListenError::SocketInUse(_))));
        // The first one's socket is still the one there, and answers.
        UnixStream::connect(&path).await.unwrap();
        a_file.remove();
        assert!(!path.exists());
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
