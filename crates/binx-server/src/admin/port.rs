//! The admin TCP port's connections: whoever reaches the pod reaches the
//! port, token or not, so it serves a few connections at once and keeps
//! none that says nothing for its idle timeout (the exchange's own HTTP
//! servers have the same two limits).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
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
/// each closed after `idle` without a byte either way. The accepting task
/// ends when the stream is dropped.
pub(crate) fn limited(
    listener: TcpListener,
    limit: usize,
    idle: Duration,
) -> ReceiverStream<io::Result<AdminConnection>> {
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
                        idle,
                        deadline: Box::pin(tokio::time::sleep(idle)),
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

/// One admin TCP connection: holds its slot until it closes, and reads
/// fail with `TimedOut` once nothing moved for the idle timeout.
pub(crate) struct AdminConnection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl AdminConnection {
    fn moved(&mut self) {
        self.deadline.as_mut().reset(Instant::now() + self.idle);
    }
}

impl AsyncRead for AdminConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.moved();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the admin connection was idle past its timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
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
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            this.moved();
        }
        written
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Connected for AdminConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}
