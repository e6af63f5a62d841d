//! Responses that hold data and stop moving. An HTTP/2 client can grant no
//! flow-control window while it keeps its connection busy with PINGs, and
//! hyper then holds the response (and the read-budget room its pages took)
//! for as long as the client likes; counting bytes on the socket cannot see
//! it. So each response with a body is tracked until it and every piece of
//! it are gone, and a connection whose oldest response made no progress
//! for the limit is closed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

/// The responses of one connection still holding data, and when each last
/// made progress (a piece handed to hyper, or a piece hyper sent and
/// dropped).
#[derive(Clone, Debug, Default)]
pub(crate) struct ResponseWatch {
    inner: Arc<Mutex<Watched>>,
}

#[derive(Debug, Default)]
struct Watched {
    next: u64,
    last_progress: HashMap<u64, Instant>,
}

impl ResponseWatch {
    fn lock(&self) -> MutexGuard<'_, Watched> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts tracking a response: it is held until the returned handle
    /// and every piece tied to it (with [`Tracked::tie`]) are dropped.
    pub(crate) fn track(&self) -> Arc<Tracked> {
        let mut watched = self.lock();
        let id = watched.next;
        watched.next += 1;
        watched.last_progress.insert(id, Instant::now());
        Arc::new(Tracked {
            watch: self.clone(),
            id,
        })
    }

    /// Returns once some response has made no progress for `limit`.
    pub(crate) async fn stalled_for(&self, limit: Duration) {
        loop {
            let oldest = self.lock().last_progress.values().min().copied();
            let quiet = oldest.map_or(Duration::ZERO, |at| at.elapsed());
            if quiet >= limit {
                return;
            }
            tokio::time::sleep(limit - quiet).await;
        }
    }

    /// Responses tracked now.
    pub(crate) fn held(&self) -> usize {
        self.lock().last_progress.len()
    }
}

/// One tracked response.
#[derive(Debug)]
pub(crate) struct Tracked {
    watch: ResponseWatch,
    id: u64,
}

impl Tracked {
    /// The response moved.
    pub(crate) fn progress(&self) {
        if let Some(at) = self.watch.lock().last_progress.get_mut(&self.id) {
            *at = Instant::now();
        }
    }

    /// `piece`, holding the response tracked until hyper drops it (which
    /// is progress too).
    pub(crate) fn tie(self: &Arc<Self>, piece: Bytes) -> Bytes {
        Bytes::from_owner(TiedPiece {
            piece,
            tracked: self.clone(),
        })
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.watch.lock().last_progress.remove(&self.id);
    }
}

struct TiedPiece {
    piece: Bytes,
    tracked: Arc<Tracked>,
}

impl AsRef<[u8]> for TiedPiece {
    fn as_ref(&self) -> &[u8] {
        &self.piece
    }
}

impl Drop for TiedPiece {
    fn drop(&mut self) {
        self.tracked.progress();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_piece_held_without_progress_is_found_after_the_limit() {
        let watch = ResponseWatch::default();
        let tracked = watch.track();
        let piece = tracked.tie(Bytes::from_static(b"a page"));
        drop(tracked);
        assert_eq!(&piece[..], b"a page");
        assert_eq!(watch.held(), 1, "the piece still holds the response");
        let started = tokio::time::Instant::now();
        watch.stalled_for(Duration::from_secs(60)).await;
        assert!(started.elapsed() >= Duration::from_secs(60));
        drop(piece);
        assert_eq!(watch.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn progress_restarts_the_clock_and_nothing_held_never_stalls() {
        let watch = ResponseWatch::default();
        let tracked = watch.track();
        let stalled = tokio::spawn({
            let watch = watch.clone();
            async move { watch.stalled_for(Duration::from_secs(60)).await }
        });
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(40)).await;
            tracked.progress();
        }
        assert!(!stalled.is_finished(), "progress every 40 s is not a stall");
        drop(tracked);
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!stalled.is_finished(), "no response held, no stall");
        stalled.abort();
    }
}
