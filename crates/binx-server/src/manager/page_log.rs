//! A run of pages numbered by token, freed from the front as consumers
//! acknowledge them. A page lives in memory, in a spooled segment object,
//! or (policy `always`) in both.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use binx_spool::SpooledObject;
use bytes::Bytes;

/// Where a page read from a log is.
#[derive(Clone, Debug)]
pub enum PageRef {
    Memory(Bytes),
    /// Page `index` of a segment object.
    Spooled {
        object: Arc<SpooledObject>,
        index: u32,
    },
}

impl PageRef {
    pub fn size(&self) -> u64 {
        match self {
            PageRef::Memory(b) => b.len() as u64,
            PageRef::Spooled { object, index } => {
                object.page_sizes.get(*index as usize).copied().unwrap_or(0)
            }
        }
    }
}

/// One page of a log.
#[derive(Clone, Debug)]
pub(crate) struct Page {
    size: u64,
    memory: Option<Bytes>,
    spooled: Option<(Arc<SpooledObject>, u32)>,
    /// When it was appended (slow consumers' pages spill after an age).
    at: Instant,
    /// Being written to storage now; not picked again.
    spilling: bool,
}

impl Page {
    pub fn in_memory(body: Bytes, at: Instant) -> Page {
        Page {
            size: body.len() as u64,
            memory: Some(body),
            spooled: None,
            at,
            spilling: false,
        }
    }

    /// A page already written to `object` (policy `always`), kept in memory
    /// too when `body` is given.
    pub fn durable(
        size: u64,
        body: Option<Bytes>,
        object: Arc<SpooledObject>,
        index: u32,
        at: Instant,
    ) -> Page {
        Page {
            size,
            memory: body,
            spooled: Some((object, index)),
            at,
            spilling: false,
        }
    }

    /// Bytes of memory it holds.
    pub fn memory_bytes(&self) -> u64 {
        if self.memory.is_some() { self.size } else { 0 }
    }

    fn to_ref(&self) -> Option<PageRef> {
        if let Some(body) = &self.memory {
            return Some(PageRef::Memory(body.clone()));
        }
        self.spooled
            .as_ref()
            .map(|(object, index)| PageRef::Spooled {
                object: object.clone(),
                index: *index,
            })
    }
}

/// A run of pages to write to storage, taken from a log.
#[derive(Debug)]
pub(crate) struct SpillRun {
    pub first_token: u64,
    pub pages: Vec<Bytes>,
}

/// Pages `base .. base + len` of one buffer (or of a broadcast task).
#[derive(Debug, Default)]
pub(crate) struct PageLog {
    base: u64,
    pages: VecDeque<Page>,
    /// Bytes of memory the pages hold.
    bytes: u64,
    /// Segments spilled from this log so far (the target size grows).
    pub spilled_segments: u64,
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

    /// Bytes of memory the pages hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Size of the oldest page held.
    pub fn front_len(&self) -> Option<u64> {
        self.pages.front().map(|p| p.size)
    }

    /// Appends a page; returns the memory it takes.
    pub fn push(&mut self, page: Page) -> u64 {
        let added = page.memory_bytes();
        self.bytes += added;
        self.pages.push_back(page);
        added
    }

    /// Removes and returns the oldest page (its token is the old `base`).
    pub fn pop_front(&mut self) -> Option<Page> {
        let page = self.pages.pop_front()?;
        self.bytes -= page.memory_bytes();
        self.base += 1;
        Some(page)
    }

    /// Frees every page below `token` (clamped to what is held); returns the
    /// memory freed.
    pub fn ack(&mut self, token: u64) -> u64 {
        let mut freed = 0;
        while self.base < token {
            match self.pop_front() {
                Some(page) => freed += page.memory_bytes(),
                None => break,
            }
        }
        freed
    }

    /// Frees everything and moves `base` to `next`; returns the memory freed.
    pub fn clear(&mut self) -> u64 {
        let freed = self.bytes;
        self.base = self.next();
        self.pages.clear();
        self.bytes = 0;
        freed
    }

    /// Pages from `token` (at least one when any is held there, then whole
    /// pages while the total stays within `max_bytes`), stopping before
    /// `end`. With `whole_objects`, a page that is only in storage counts
    /// its whole object when it is the object's first page, and nothing
    /// when the object already started in this read: replies then carry
    /// whole spooled segments that a client fetches itself.
    pub fn read(&self, token: u64, end: u64, max_bytes: u64, whole_objects: bool) -> Vec<PageRef> {
        let mut out = Vec::new();
        if token < self.base {
            return out;
        }
        let start = (token - self.base) as usize;
        let stop = end.min(self.next()).saturating_sub(self.base) as usize;
        let mut total = 0u64;
        let mut open_object: Option<&Arc<SpooledObject>> = None;
        for page in self.pages.range(start.min(stop)..stop) {
            let cost = match (&page.memory, &page.spooled) {
                (None, Some((object, index))) if whole_objects => {
                    if open_object.is_some_and(|o| Arc::ptr_eq(o, object)) {
                        0
                    } else if *index == 0 {
                        object.page_sizes.iter().sum()
                    } else {
                        page.size
                    }
                }
                _ => page.size,
            };
            if !out.is_empty() && total + cost > max_bytes {
                break;
            }
            let Some(r) = page.to_ref() else { break };
            open_object = page
                .spooled
                .as_ref()
                .map(|(o, _)| o)
                .filter(|_| page.memory.is_none());
            total += cost;
            out.push(r);
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
            .map(|p| p.size)
            .collect()
    }

    /// Marks and returns the oldest run of pages held only in memory (and
    /// appended at or before `older_than`, when given), up to `target`
    /// bytes (at least one page), for writing to storage.
    pub fn take_spill_run(&mut self, target: u64, older_than: Option<Instant>) -> Option<SpillRun> {
        let eligible = |p: &Page| {
            p.memory.is_some()
                && p.spooled.is_none()
                && !p.spilling
                && older_than.is_none_or(|t| p.at <= t)
        };
        let start = self.pages.iter().position(eligible)?;
        let mut pages = Vec::new();
        let mut total = 0;
        for page in self.pages.range_mut(start..) {
            if !eligible(page) || (!pages.is_empty() && total + page.size > target) {
                break;
            }
            total += page.size;
            page.spilling = true;
            if let Some(body) = &page.memory {
                pages.push(body.clone());
            }
        }
        Some(SpillRun {
            first_token: self.base + start as u64,
            pages,
        })
    }

    /// The objects holding this log's pages, once each, in token order.
    pub fn objects(&self) -> Vec<Arc<SpooledObject>> {
        let mut out: Vec<Arc<SpooledObject>> = Vec::new();
        for page in &self.pages {
            if let Some((object, _)) = &page.spooled
                && !out.last().is_some_and(|last| Arc::ptr_eq(last, object))
            {
                out.push(object.clone());
            }
        }
        out
    }

    /// Whether every page held is in storage (nothing to spill, nothing in
    /// flight), so a commit marker listing `objects` covers the log.
    pub fn all_spooled(&self) -> bool {
        self.pages.iter().all(|p| p.spooled.is_some())
    }

    /// Bytes of memory in pages that could be spilled now.
    pub fn spillable_bytes(&self) -> u64 {
        self.pages
            .iter()
            .filter(|p| p.memory.is_some() && p.spooled.is_none() && !p.spilling)
            .map(|p| p.size)
            .sum()
    }

    /// Ends a spill of `count` pages from `first_token`: with the object
    /// written, pages still held point to it and leave memory; either way
    /// they may be picked again. Returns the memory freed.
    pub fn finish_spill(
        &mut self,
        first_token: u64,
        count: usize,
        object: Option<&Arc<SpooledObject>>,
    ) -> u64 {
        let mut freed = 0;
        for i in 0..count {
            let token = first_token + i as u64;
            let Some(pos) = token.checked_sub(self.base) else {
                continue;
            };
            let Some(page) = self.pages.get_mut(pos as usize) else {
                break;
            };
            if !page.spilling {
                continue;
            }
            page.spilling = false;
            if let (Some(object), Ok(index)) = (object, u32::try_from(i)) {
                page.spooled = Some((object.clone(), index));
                if page.memory.take().is_some() {
                    freed += page.size;
                }
            }
        }
        self.bytes -= freed;
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(sizes: &[usize]) -> PageLog {
        let mut log = PageLog::default();
        for &s in sizes {
            log.push(Page::in_memory(Bytes::from(vec![0u8; s]), Instant::now()));
        }
        log
    }

    #[test]
    fn read_returns_one_page_even_above_the_limit_then_whole_pages() {
        let log = log_of(&[10, 20, 30]);
        assert_eq!(log.read(0, u64::MAX, 5, false).len(), 1);
        assert_eq!(log.read(0, u64::MAX, 30, false).len(), 2);
        assert_eq!(log.read(0, u64::MAX, 29, false).len(), 1);
        assert_eq!(log.read(1, u64::MAX, 1000, false).len(), 2);
        assert_eq!(log.read(1, 2, 1000, false).len(), 1);
        assert!(log.read(3, u64::MAX, 1000, false).is_empty());
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
