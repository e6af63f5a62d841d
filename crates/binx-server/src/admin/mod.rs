//! The admin service (gRPC over the admin Unix socket, optionally a TCP
//! port): list tasks and buffers, abort a task, start a drain, change the
//! log level, read the stats. Operators reach it with `binx tasks` and
//! `binx stats`; docs/ADMIN.md describes it, and binx-admin generates the
//! messages and the service trait from docs/admin.proto.

mod port;
mod service;

use std::future::Future;
use std::path::Path;

use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::UnixListenerStream;

pub use port::ADMIN_PORT_CONNECTIONS;
pub use service::{AdminHandler, AdminRoutes, AdminService, TokenCheck};

use crate::listener::{ListenError, SocketFile, UdsAccess, bind_uds};

/// What only the daemon itself can do (its signal handling and its log
/// subscriber live in the binary, not in this crate).
pub trait DaemonControl: Send + Sync + 'static {
    /// Starts the drain SIGTERM starts; a second call changes nothing.
    fn start_drain(&self);
    /// Replaces the log filter; returns the previous one, or why `filter` is invalid.
    fn set_log_level(&self, filter: &str) -> Result<String, String>;
}

/// Binds the admin Unix socket, readable and writable by its owner only
/// (abort and drain are an operator's tools, not an engine's), from its
/// first moment on (see `bind_uds`).
pub async fn bind_admin_uds(path: &Path) -> Result<AdminSocket, ListenError> {
    let owner_only = UdsAccess {
        mode: 0o600,
        ..UdsAccess::default()
    };
    let (listener, file) = bind_uds(path, &owner_only).await?;
    Ok(AdminSocket { listener, file })
}

/// The bound admin Unix socket.
#[derive(Debug)]
pub struct AdminSocket {
    listener: UnixListener,
    file: SocketFile,
}

/// Serves `service` on the admin Unix socket until `shutdown`, removing
/// its file as shutdown starts (if it is still the one bound).
pub async fn serve_unix(
    socket: AdminSocket,
    service: AdminService,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    // The file goes as shutdown starts, while the server still holds the
    // socket (removed after, another binxd could have taken the path and
    // even the inode in between).
    let file = socket.file;
    let shutdown = async move {
        shutdown.await;
        file.remove();
    };
    tonic::transport::Server::builder()
        .serve_with_incoming_shutdown(
            service.routes(),
            UnixListenerStream::new(socket.listener),
            shutdown,
        )
        .await
}

/// Serves `service` on a bound TCP listener until `shutdown`: at most
/// [`ADMIN_PORT_CONNECTIONS`] connections at once, each kept only while
/// it makes requests with the right token (idle timeout `idle`, see
/// `port.rs`).
pub async fn serve_tcp(
    listener: TcpListener,
    idle: std::time::Duration,
    service: AdminService,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .serve_with_incoming_shutdown(
            service.routes(),
            port::limited(listener, ADMIN_PORT_CONNECTIONS, idle),
            shutdown,
        )
        .await
}
