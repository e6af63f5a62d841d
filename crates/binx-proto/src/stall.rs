//! A writer that gives up on a peer that stops reading: binxd must not keep
//! a reply (and the memory it holds) for as long as a stalled consumer
//! keeps its socket open, and a client must not wait for good on a server
//! that stopped reading its requests.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::AsyncWrite;
use tokio::time::Sleep;

/// Wraps a writer so that a write, flush or shutdown that makes no
/// progress for `limit` fails with [`io::ErrorKind::TimedOut`] (and a
/// [`WriteStalled`] inside). Progress (any ready poll) starts the clock
/// again; a socket is ready again once its peer has drained a good part of
/// the send buffer, so that is the least a peer must read per `limit`.
pub struct StallLimit<W> {
    inner: W,
    limit: Option<Duration>,
    /// The clock, kept between stalls so that a busy writer, pending
    /// often, resets one timer instead of allocating one each time.
    clock: Option<Pin<Box<Sleep>>>,
    /// Whether the clock runs: set at the first pending poll since the
    /// last ready one.
    stalled: bool,
}

impl<W> StallLimit<W> {
    /// `None` never gives up.
    pub fn new(inner: W, limit: Option<Duration>) -> Self {
        StallLimit {
            inner,
            limit,
            clock: None,
            stalled: false,
        }
    }

    /// Passes a ready poll through (and stops the clock); a pending one
    /// fails once it has been pending for the whole limit.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.stalled = false;
            return poll;
        }
        let Some(limit) = self.limit else {
            return Poll::Pending;
        };
        let clock = self
            .clock
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if !std::mem::replace(&mut self.stalled, true) {
            clock.as_mut().reset(tokio::time::Instant::now() + limit);
        }
        match clock.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                WriteStalled(limit),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The error a [`StallLimit`] gives up with, told apart from a kernel's
/// own `ETIMEDOUT` (a TCP retransmission or keepalive timeout).
#[derive(Debug)]
pub struct WriteStalled(pub Duration);

impl std::fmt::Display for WriteStalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the peer made no room for its replies for {:?} (write_stall_timeout)",
            self.0
        )
    }
}

impl std::error::Error for WriteStalled {}

impl WriteStalled {
    /// Whether `error` is a stall limit giving up.
    pub fn is(error: &io::Error) -> bool {
        error
            .get_ref()
            .is_some_and(|inner| inner.is::<WriteStalled>())
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for StallLimit<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, poll)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_writer_whose_peer_reads_nothing_fails_after_the_limit() {
        let (near, _far) = tokio::io::duplex(1024);
        let mut writer = StallLimit::new(near, Some(Duration::from_secs(30)));
        let started = tokio::time::Instant::now();
        let error = writer
            .write_all(&vec![7u8; 64 * 1024])
            .await
            .expect_err("nobody reads the far end");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(WriteStalled::is(&error), "{error}");
        assert!(!WriteStalled::is(&io::ErrorKind::TimedOut.into()));
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_is_served_however_long_it_takes() {
        let (near, mut far) = tokio::io::duplex(1024);
        let mut writer = StallLimit::new(near, Some(Duration::from_secs(30)));
        // Reads 1 KiB every 20 s: each stall is shorter than the limit,
        // all of them together far longer.
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut chunk = [0u8; 1024];
            loop {
                tokio::time::sleep(Duration::from_secs(20)).await;
                match far.read(&mut chunk).await {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                }
            }
        });
        let body: Vec<u8> = (0..16 * 1024u32).map(|i| i as u8).collect();
        writer.write_all(&body).await.expect("the reader keeps up");
        writer.shutdown().await.expect("shutdown");
        drop(writer);
        assert_eq!(reader.await.expect("reader"), body);
    }

    #[tokio::test(start_paused = true)]
    async fn no_limit_waits_forever() {
        let (near, _far) = tokio::io::duplex(1024);
        let mut writer = StallLimit::new(near, None);
        let write = writer.write_all(&[1u8; 4096]);
        let waited = tokio::time::timeout(Duration::from_secs(3600), write).await;
        assert!(waited.is_err(), "a writer without a limit never gives up");
    }
}
