//! The admin TCP port's connections: whoever reaches the pod reaches the
//! port, token or not, so it serves a few connections at once and keeps
//! one only while it asks: a connection is closed once it has made no
//! request with the right token for its idle timeout (at least a minute
//! after one, 10 s at most before the first; bytes do not count: an
//! HTTP/2 client can send PINGs for ever), and a second after a request
//! was refused for its token. Connections over the limit wait in the
//! kernel's accept queue, in order, so strangers that keep reconnecting
//! delay an operator by one timeout at most.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Connections the admin port serves at once; more wait in the kernel's
/// accept queue until one closes (an operator's CLI needs one).
pub const ADMIN_PORT_CONNECTIONS: usize = 16;

/// Connections accepted from `listener`, at most `limit` open at once,
/// each closed as the module says. The accepting task ends when the
/// stream is dropped.
pub(crate) fn limited(
    listener: TcpListener,
    limit: usize,
    idle: Duration,
) -> ReceiverStream<io::Result<AdminConnection>> {
    // A client that connects sends its request at once.
    let first = idle.min(FIRST_REQUEST);
    let (tx, rx) = mpsc::channel(1);
    let slots = Arc::new(Semaphore::new(limit.max(1)));
    tokio::spawn(async move {
        loop {
            let slot = tokio::select! {
                slot = slots.clone().acquire_owned() => slot,
                () = tx.closed() => return,
            };
            let Ok(slot) = slot else { return };
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return,
            };
            match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let connection = AdminConnection {
                        stream,
                        _slot: slot,
                        asked: Arc::new(Asked::new(first, idle)),
                        deadline: Box::pin(tokio::time::sleep(first)),
                    };
                    if tx.send(Ok(connection)).await.is_err() {
                        return;
                    }
                }
                Err(error) => {
                    // Out of descriptors and the like: wait, do not spin.
                    tracing::warn!(%error, "the admin port could not accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// Longest wait for a connection's first request with the right token.
const FIRST_REQUEST: Duration = Duration::from_secs(10);

/// Least time a connection is kept after a request with the right token
/// (whatever `http_idle_timeout` says): room to send a large ListTasks
/// reply over a slow link.
const AFTER_REQUEST: Duration = Duration::from_secs(60);

/// Time to write the answer to a request refused for its token.
const AFTER_REFUSAL: Duration = Duration::from_secs(1);

/// What one connection asked, told by the token check.
#[derive(Debug)]
pub(crate) struct Asked {
    opened: Instant,
    first: Duration,
    idle: Duration,
    /// Milliseconds after `opened` of the last request with the right
    /// token, plus one (0: none yet).
    last: AtomicU64,
    /// Milliseconds after `opened` of a refusal, plus one (0: none).
    refused: AtomicU64,
}

impl Asked {
    fn new(first: Duration, idle: Duration) -> Self {
        Asked {
            opened: Instant::now(),
            first,
            idle,
            last: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    /// A request with the right token.
    pub(crate) fn asked(&self) {
        self.last.store(self.now(), Ordering::Release);
    }

    /// A request refused for its token.
    pub(crate) fn refused(&self) {
        let _ = self
            .refused
            .compare_exchange(0, self.now(), Ordering::AcqRel, Ordering::Acquire);
    }

    /// When the connection is closed, as things stand.
    fn deadline(&self) -> Instant {
        let at = |millis: u64, after: Duration| {
            self.opened + Duration::from_millis(millis.saturating_sub(1)) + after
        };
        match (
            self.refused.load(Ordering::Acquire),
            self.last.load(Ordering::Acquire),
        ) {
            (refused, _) if refused > 0 => at(refused, AFTER_REFUSAL),
            (0, 0) => self.opened + self.first,
            (0, last) => at(last, self.idle.max(AFTER_REQUEST)),
            _ => self.opened,
        }
    }
}

/// What the token check learns of a TCP admin connection (its request
/// extensions carry it).
#[derive(Clone, Debug)]
pub(crate) struct AdminPeer {
    /// The peer's address.
    pub(crate) tcp: TcpConnectInfo,
    /// Where to tell what it asked.
    pub(crate) asked: Arc<Asked>,
}

/// One admin TCP connection: holds its slot until it closes, and reads
/// fail with `TimedOut` once its deadline ([`Asked`]) passed.
pub(crate) struct AdminConnection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    asked: Arc<Asked>,
    deadline: Pin<Box<Sleep>>,
}

impl AdminConnection {
    /// Whether its deadline passed; if not, the task is woken when it
    /// does. Checked whenever the socket would block, reading or writing:
    /// a peer that reads nothing stops the server reading too (its
    /// answers wait to be written), so a check on reads alone never came.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        // What the token check said since may have moved it.
        let deadline = self.asked.deadline();
        if self.deadline.deadline() != deadline {
            self.deadline.as_mut().reset(deadline);
        }
        self.deadline.as_mut().poll(cx).is_ready()
    }

    fn timed_out<T>() -> Poll<io::Result<T>> {
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the admin connection asked nothing with the right token for its timeout",
        )))
    }
}

impl AsyncRead for AdminConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Pending if this.expired(cx) => Self::timed_out(),
            other => other,
        }
    }
}

impl AsyncWrite for AdminConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_write(cx, buf) {
            Poll::Pending if this.expired(cx) => Self::timed_out(),
            other => other,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_flush(cx) {
            Poll::Pending if this.expired(cx) => Self::timed_out(),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Connected for AdminConnection {
    type ConnectInfo = AdminPeer;

    fn connect_info(&self) -> Self::ConnectInfo {
        AdminPeer {
            tcp: self.stream.connect_info(),
            asked: self.asked.clone(),
        }
    }
}
