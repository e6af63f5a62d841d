//! What the frame readers of one server hold together beyond what pages
//! pin: receive buffers kept for reuse, and large frames still arriving.
//!
//! A page is a slice of the receive buffer it arrived in, and the server
//! counts that buffer against its memory limit while a page pins it. Two
//! things no page pins: a spare buffer a reader keeps to receive into again
//! (whose pages are gone), and a frame still arriving (whose pages do not
//! exist yet). Without a bound, each connection kept up to three spares of
//! up to a frame each, and a local peer could send most of a 64 MiB frame
//! on every connection and stop. Readers that share a [`ReceiveBudget`]
//! keep spares within it (a buffer past it is freed with its pages), and
//! receive frames larger than a small buffer within it too: a reader waits
//! for room before it reads such a frame's body (its bytes wait in the
//! socket), and a frame must be whole within the frame timeout of the room
//! taken for it, so a peer that stalls inside one gives the room back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Room is counted in KiB, so a frame of up to 4 TiB fits a permit count.
const UNIT: u64 = 1024;

/// Bytes of spare receive buffers and of frames being received that the
/// readers sharing it may hold, each up to the same limit; cheap to clone
/// (every clone is the same budget).
#[derive(Clone, Debug)]
pub struct ReceiveBudget {
    inner: Arc<Counts>,
}

#[derive(Debug)]
struct Counts {
    limit: u64,
    spares: AtomicU64,
    /// Room for frames being received, in `UNIT`s.
    frames: Arc<Semaphore>,
}

/// Room one frame being received holds, until it is whole or dropped.
#[derive(Debug)]
pub(crate) struct FrameRoom {
    _permit: Option<OwnedSemaphorePermit>,
    /// The frame must be whole by then.
    pub(crate) deadline: tokio::time::Instant,
    /// Bytes of the frame (its length field included).
    pub(crate) length: usize,
}

impl ReceiveBudget {
    /// `limit` bytes of spare buffers and `limit` bytes of frames being
    /// received.
    pub fn new(limit: u64) -> Self {
        let units = (limit / UNIT).clamp(1, Semaphore::MAX_PERMITS as u64);
        ReceiveBudget {
            inner: Arc::new(Counts {
                limit,
                spares: AtomicU64::new(0),
                frames: Arc::new(Semaphore::new(units as usize)),
            }),
        }
    }

    /// The limit of each part (bytes).
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes of spare buffers kept now, every reader together.
    pub fn spares_held(&self) -> u64 {
        self.inner.spares.load(Ordering::Acquire)
    }

    /// Bytes of room frames being received hold now, every reader together.
    pub fn frames_held(&self) -> u64 {
        let units = (self.inner.limit / UNIT).clamp(1, Semaphore::MAX_PERMITS as u64);
        units.saturating_sub(self.inner.frames.available_permits() as u64) * UNIT
    }

    /// Takes `bytes` for a spare buffer if they fit.
    pub(crate) fn try_take_spare(&self, bytes: u64) -> bool {
        self.inner
            .spares
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&h| h <= self.inner.limit)
            })
            .is_ok()
    }

    /// Gives back what spare buffers took.
    pub(crate) fn give_back_spare(&self, bytes: u64) {
        self.inner.spares.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Room for a frame of `length` bytes, once there is (a frame larger
    /// than the whole budget waits for all of it), to be whole within
    /// `timeout`. Cancel-safe: nothing is held until it returns.
    pub(crate) async fn frame_room(&self, length: usize, timeout: Duration) -> FrameRoom {
        let all = self.inner.frames.clone();
        let units = (length as u64)
            .div_ceil(UNIT)
            .clamp(1, (self.inner.limit / UNIT).max(1));
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        // Never closed, so never an error.
        let permit = all.acquire_many_owned(units).await.ok();
        let now = tokio::time::Instant::now();
        FrameRoom {
            _permit: permit,
            // A timeout past what an instant can say is none (30 years).
            deadline: now
                .checked_add(timeout)
                .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 86_400)),
            length,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_wait_for_room_and_give_it_back_when_dropped() {
        let budget = ReceiveBudget::new(8 << 20);
        let a = budget.frame_room(5 << 20, Duration::from_secs(1)).await;
        assert_eq!(budget.frames_held(), 5 << 20);
        // A second 5 MiB frame does not fit beside it: it waits.
        let waiting = tokio::time::timeout(
            Duration::from_millis(50),
            budget.frame_room(5 << 20, Duration::from_secs(1)),
        );
        assert!(waiting.await.is_err(), "no room for a second frame");
        drop(a);
        let b = budget.frame_room(5 << 20, Duration::from_secs(1)).await;
        // A frame larger than the whole budget waits for all of it.
        let huge = tokio::spawn({
            let budget = budget.clone();
            async move {
                budget
                    .frame_room(64 << 20, Duration::from_secs(1))
                    .await
                    .length
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!huge.is_finished());
        drop(b);
        assert_eq!(huge.await.unwrap(), 64 << 20);
        assert_eq!(budget.frames_held(), 0);
    }

    #[test]
    fn spares_are_taken_only_within_the_limit() {
        let budget = ReceiveBudget::new(10);
        assert!(budget.try_take_spare(6));
        assert!(!budget.try_take_spare(6));
        assert!(budget.try_take_spare(4));
        budget.give_back_spare(10);
        assert_eq!(budget.spares_held(), 0);
    }
}
