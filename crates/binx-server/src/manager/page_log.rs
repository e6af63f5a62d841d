//! A run of pages numbered by token, freed from the front as consumers
//! acknowledge them.

use std::collections::VecDeque;

use bytes::Bytes;

/// Pages `base .. base + len` of one buffer (or of a broadcast task).
#[derive(Debug, Default)]
pub(crate) struct PageLog {
    base: u64,
    pages: VecDeque<Bytes>,
    bytes: u64,
}

impl PageLog {
    /// Token of the oldest page still held: every token below it was acknowledged.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Token the next appended page gets.
    pub fn next(&self) -> u64 {
        self.base + self.pages.len() as u64
    }

    /// Bytes of the pages held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Size of the oldest page held.
    pub fn front_len(&self) -> Option<u64> {
        self.pages.front().map(|p| p.len() as u64)
    }

    pub fn push(&mut self, page: Bytes) {
        self.bytes += page.len() as u64;
        self.pages.push_back(page);
    }

    /// Removes and returns the oldest page (its token is the old `base`).
    pub fn pop_front(&mut self) -> Option<Bytes> {
        let page = self.pages.pop_front()?;
        self.bytes -= page.len() as u64;
        self.base += 1;
        Some(page)
    }

    /// Frees every page below `token` (clamped to what is held); returns the
    /// bytes freed.
    pub fn ack(&mut self, token: u64) -> u64 {
        let mut freed = 0;
        while self.base < token {
            match self.pop_front() {
                Some(page) => freed += page.len() as u64,
                None => break,
            }
        }
        freed
    }

    /// Frees everything and moves `base` to `next`; returns the bytes freed.
    pub fn clear(&mut self) -> u64 {
        let freed = self.bytes;
        self.base = self.next();
        self.pages.clear();
        self.bytes = 0;
        freed
    }

    /// Pages from `token` (at least one when any is held there, then whole
    /// pages while the total stays within `max_bytes`), stopping before `end`.
    pub fn read(&self, token: u64, end: u64, max_bytes: u64) -> Vec<Bytes> {
        let mut out = Vec::new();
        if token < self.base {
            return out;
        }
        let start = (token - self.base) as usize;
        let stop = end.min(self.next()).saturating_sub(self.base) as usize;
        let mut total = 0u64;
        for page in self.pages.range(start.min(stop)..stop) {
            let size = page.len() as u64;
            if !out.is_empty() && total + size > max_bytes {
                break;
            }
            total += size;
            out.push(page.clone());
        }
        out
    }

    /// Sizes of every page from `token` up to `end`.
    pub fn sizes(&self, token: u64, end: u64) -> Vec<u64> {
        if token < self.base {
            return Vec::new();
        }
        let start = (token - self.base) as usize;
        let stop = end.min(self.next()).saturating_sub(self.base) as usize;
        self.pages
            .range(start.min(stop)..stop)
            .map(|p| p.len() as u64)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(sizes: &[usize]) -> PageLog {
        let mut log = PageLog::default();
        for &s in sizes {
            log.push(Bytes::from(vec![0u8; s]));
        }
        log
    }

    #[test]
    fn read_returns_one_page_even_above_the_limit_then_whole_pages() {
        let log = log_of(&[10, 20, 30]);
        assert_eq!(log.read(0, u64::MAX, 5).len(), 1);
        assert_eq!(log.read(0, u64::MAX, 30).len(), 2);
        assert_eq!(log.read(0, u64::MAX, 29).len(), 1);
        assert_eq!(log.read(1, u64::MAX, 1000).len(), 2);
        assert_eq!(log.read(1, 2, 1000).len(), 1);
        assert!(log.read(3, u64::MAX, 1000).is_empty());
    }

    #[test]
    fn ack_frees_from_the_front_and_counts_bytes() {
        let mut log = log_of(&[10, 20, 30]);
        assert_eq!(log.ack(2), 30);
        assert_eq!((log.base(), log.next(), log.bytes), (2, 3, 30));
        assert_eq!(log.ack(1), 0);
        assert_eq!(log.sizes(2, u64::MAX), vec![30]);
        assert_eq!(log.ack(99), 30);
        assert_eq!((log.base(), log.next(), log.bytes), (3, 3, 0));
    }
}
