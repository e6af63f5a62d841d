//! The BinX listeners: accept loops for TCP and the Unix socket, a limit on
//! open connections, and removal of the socket file on shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::connection::{ConnectionConfig, Transport, serve_connection};
use crate::exchange::{ConnectionEvent, Exchange};

/// Where and how to listen.
#[derive(Clone, Debug, Default)]
pub struct ListenConfig {
    /// `host:port` for remote peers; `None` disables TCP.
    pub tcp: Option<String>,
    /// Socket path for local engines; `None` disables the Unix socket.
    pub uds: Option<PathBuf>,
    /// Connections open at once over both listeners; past it new ones are closed.
    pub max_connections: usize,
    pub connection: ConnectionConfig,
}

/// A listener could not be set up.
#[derive(Debug, Error)]
pub enum ListenError {
    #[error("cannot listen on TCP {addr}: {source}")]
    Tcp { addr: String, source: io::Error },
    #[error("cannot create the directory {dir} for the Unix socket: {source}")]
    SocketDir { dir: PathBuf, source: io::Error },
    #[error("another process is already serving the Unix socket {0}")]
    SocketInUse(PathBuf),
    #[error("cannot listen on the Unix socket {path}: {source}")]
    Uds { path: PathBuf, source: io::Error },
}

/// Bound listeners, ready to serve.
#[derive(Debug)]
pub struct BinxServer {
    exchange: Exchange,
    tcp: Option<TcpListener>,
    uds: Option<(UnixListener, PathBuf)>,
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
            Some(path) => Some((bind_uds(path).await?, path.clone())),
            None => None,
        };
        Ok(BinxServer {
            exchange,
            tcp,
            uds,
            limit: Arc::new(Semaphore::new(config.max_connections.max(1))),
            connection: Arc::new(config.connection),
        })
    }

    /// The bound TCP address (useful with port 0).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The Unix socket path, if listening on one.
    pub fn uds_path(&self) -> Option<&Path> {
        self.uds.as_ref().map(|(_, p)| p.as_path())
    }

    /// Serves until `shutdown` completes, then stops accepting and removes the
    /// socket file. Open connections end with the runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let socket_path = self.uds.as_ref().map(|(_, p)| p.clone());
        let acceptor = Acceptor {
            exchange: self.exchange,
            limit: self.limit,
            connection: self.connection,
        };
        let tcp_loop = async {
            let Some(listener) = self.tcp else {
                return std::future::pending().await;
            };
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        let (r, w) = stream.into_split();
                        acceptor.spawn(r, w, Transport::Tcp, peer.to_string());
                    }
                    Err(e) => accept_failed(Transport::Tcp, e).await,
                }
            }
        };
        let uds_loop = async {
            let Some((listener, _)) = self.uds else {
                return std::future::pending().await;
            };
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let (r, w) = stream.into_split();
                        acceptor.spawn(r, w, Transport::Uds, "local".into());
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
        if let Some(path) = socket_path {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// What every accepted connection shares.
struct Acceptor {
    exchange: Exchange,
    limit: Arc<Semaphore>,
    connection: Arc<ConnectionConfig>,
}

impl Acceptor {
    /// Serves the connection in its own task, or closes it at the limit.
    fn spawn<R, W>(&self, reader: R, writer: W, transport: Transport, peer: String)
    where
        R: tokio::io::AsyncRead + Unpin + Send + 'static,
        W: tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Ok(permit) = self.limit.clone().try_acquire_owned() else {
            self.exchange.count(ConnectionEvent::Refused);
            tracing::warn!(%peer, transport = transport.name(), "connection refused: the connection limit is reached");
            return;
        };
        let exchange = self.exchange.clone();
        let config = self.connection.clone();
        exchange.count(ConnectionEvent::Opened);
        tokio::spawn(async move {
            let result =
                serve_connection(reader, writer, transport, exchange.clone(), config).await;
            if let Err(e) = result {
                tracing::info!(%peer, transport = transport.name(), error = %e, "connection closed");
            }
            exchange.count(ConnectionEvent::Closed);
            drop(permit);
        });
    }
}

async fn accept_failed(transport: Transport, error: io::Error) {
    // Typically out of file descriptors: wait a little instead of spinning.
    tracing::warn!(transport = transport.name(), %error, "accept failed");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

pub(crate) async fn bind_uds(path: &Path) -> Result<UnixListener, ListenError> {
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(|source| ListenError::SocketDir {
            dir: dir.to_path_buf(),
            source,
        })?;
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            return Err(ListenError::SocketInUse(path.to_path_buf()));
        }
        // A stale socket from a process that did not exit cleanly.
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path).map_err(|source| ListenError::Uds {
        path: path.to_path_buf(),
        source,
    })
}
