//! Honest memory accounting. A page received from a socket is a slice of
//! the receive buffer it arrived in, and keeps all of that buffer alive; so
//! the core charges whole allocations ("chunks"), once each, for as long as
//! any page still pins them, plus the bookkeeping slots of its page logs.
//! Small bodies in large receive buffers are copied out first (see
//! [`crate::Core::handle`]), so no chunk is charged for more than twice the
//! pages it holds; so are bodies whose receive buffer finds no room where
//! their own bytes do.

use std::collections::HashMap;

/// One allocation pinned by pages.
#[derive(Debug, Clone, Copy)]
struct Pin {
    capacity: u64,
    pages: u32,
}

/// The allocations the pages of one task pin.
#[derive(Debug, Default)]
pub(crate) struct Pins {
    chunks: HashMap<u64, Pin>,
    bytes: u64,
}

impl Pins {
    /// Bytes of the allocations pinned now.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// One more page in chunk `id` of `capacity` bytes (chunk 0: no memory).
    pub(crate) fn pin(&mut self, id: u64, capacity: u64) {
        if id == 0 {
            return;
        }
        let pin = self.chunks.entry(id).or_insert_with(|| {
            self.bytes += capacity;
            Pin { capacity, pages: 0 }
        });
        pin.pages += 1;
    }

    /// One page fewer in chunk `id`; the chunk's bytes are released with its last page.
    pub(crate) fn unpin(&mut self, id: u64) {
        if id == 0 {
            return;
        }
        if let Some(pin) = self.chunks.get_mut(&id) {
            pin.pages -= 1;
            if pin.pages == 0 {
                self.bytes -= pin.capacity;
                self.chunks.remove(&id);
            }
        }
    }

    /// Chunks pinned and the pages in each (for the recount check).
    pub(crate) fn pages_by_chunk(&self) -> impl Iterator<Item = (u64, u32, u64)> + '_ {
        self.chunks
            .iter()
            .map(|(&id, pin)| (id, pin.pages, pin.capacity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_is_charged_once_until_its_last_page_goes() {
        let mut pins = Pins::default();
        pins.pin(7, 4096);
        pins.pin(7, 4096);
        pins.pin(0, 99);
        assert_eq!(pins.bytes(), 4096);
        pins.unpin(7);
        assert_eq!(pins.bytes(), 4096);
        pins.unpin(7);
        assert_eq!(pins.bytes(), 0);
        pins.unpin(7);
        assert_eq!(pins.bytes(), 0);
    }
}
