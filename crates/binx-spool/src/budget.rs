//! A budget of bytes that replies hold outside the memory limit (objects
//! read back from storage, replies forwarded from remotes): a reply
//! reserves its bytes before it is read, and gives them back when its body
//! is dropped, after it was written.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes replies may hold at once, in KiB permits.
#[derive(Debug)]
pub struct ReplyBudget {
    permits: Arc<Semaphore>,
    kib: u32,
}

impl ReplyBudget {
    /// A budget of `bytes`, rounded up to whole KiB (at least 1 KiB).
    pub fn new(bytes: u64) -> Self {
        let kib = kib_of(bytes, u32::MAX);
        ReplyBudget {
            permits: Arc::new(Semaphore::new(kib as usize)),
            kib,
        }
    }

    /// The whole budget, in bytes.
    pub fn capacity(&self) -> u64 {
        u64::from(self.kib) * 1024
    }

    /// Reserves room for `bytes` (more than the whole budget takes all of
    /// it: such a reply goes alone), waiting at most `wait`; `None` when
    /// there was no room by then.
    pub async fn reserve(&self, bytes: u64, wait: Duration) -> Option<Reservation> {
        if bytes == 0 {
            return Some(Reservation(None));
        }
        let kib = kib_of(bytes, self.kib);
        let permit = tokio::time::timeout(wait, self.permits.clone().acquire_many_owned(kib))
            .await
            .ok()?
            .ok()?;
        Some(Reservation(Some(permit)))
    }

    /// Room for `bytes` now, or `None`.
    pub fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        if bytes == 0 {
            return Some(Reservation(None));
        }
        let kib = kib_of(bytes, self.kib);
        self.permits
            .clone()
            .try_acquire_many_owned(kib)
            .ok()
            .map(|p| Reservation(Some(p)))
    }

    /// Bytes reserved now.
    pub fn held_bytes(&self) -> u64 {
        u64::from(self.kib).saturating_sub(self.permits.available_permits() as u64) * 1024
    }
}

/// Room reserved in a [`ReplyBudget`]; given back when dropped, or when the
/// body it is tied to goes (see [`Reservation::hold_with`]).
#[derive(Debug)]
pub struct Reservation(Option<OwnedSemaphorePermit>);

impl Reservation {
    /// Ties the reservation to a reply body: it is given back when the
    /// body's largest piece is dropped, or now when the body is empty. The
    /// writers copy small pieces (under 4 KiB) into the frame head and drop
    /// them before the write; a large piece is written from where it is
    /// and dropped after.
    pub fn hold_with(self, body: &mut [Bytes]) {
        let (Some(permit), Some(largest)) = (self.0, body.iter_mut().max_by_key(|p| p.len()))
        else {
            return;
        };
        let bytes = std::mem::take(largest);
        *largest = Bytes::from_owner(Held {
            bytes,
            _permit: permit,
        });
    }
}

/// A reply's last piece with the reservation it keeps.
struct Held {
    bytes: Bytes,
    _permit: OwnedSemaphorePermit,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Whole KiB covering `bytes`, between 1 and `cap`.
fn kib_of(bytes: u64, cap: u32) -> u32 {
    u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .clamp(1, cap.max(1))
}
