//! A run of pages numbered by token, freed from the front as consumers
//! acknowledge them. A page lives in memory, in a spooled object, or (policy
//! `always`) in both. The log only moves pages; what a removed page releases
//! (its chunk, its object reference) is the task's business.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;

use crate::objects::ObjectId;

/// One page of a log.
#[derive(Clone, Debug)]
pub(crate) struct Page {
    pub size: u64,
    /// The bytes, while in memory.
    pub body: Option<Bytes>,
    /// The allocation `body` pins (0: none).
    pub chunk: u64,
    /// Page `index` of an object this daemon wrote.
    pub object: Option<(ObjectId, u32)>,
    /// Arrival order across the daemon: the oldest pages spill first.
    pub seq: u64,
    /// When it arrived (pages left unread this long spill).
    pub at: Instant,
    /// Being written to storage now; not picked again.
    pub spilling: bool,
}

impl Page {
    /// Held only in memory: a spill candidate.
    fn spillable(&self) -> bool {
        self.body.is_some() && self.object.is_none() && !self.spilling
    }
}

/// What a read found for one page.
#[derive(Clone, Debug)]
pub(crate) struct ReadPage {
    pub size: u64,
    pub body: Option<Bytes>,
    pub object: Option<(ObjectId, u32)>,
}

/// A run of pages to write to storage, taken from a log.
#[derive(Debug)]
pub(crate) struct SpillRun {
    pub first_token: u64,
    pub pages: Vec<Bytes>,
}

/// How pages held only in storage count in a read.
pub(crate) struct StoredReads<'a> {
    /// An object's decoded bytes.
    pub object_size: &'a dyn Fn(ObjectId) -> u64,
    /// The reply hands out whole objects (presigned URLs): a page counts
    /// its whole object at the object's first page, and nothing after it.
    pub whole: bool,
    /// Bytes of objects one read may touch (each is read back whole).
    pub max_bytes: u64,
}

/// What a read has taken so far and what each next page costs it: the one
/// rule of where a reply stops, shared by [`PageLog::read`] and
/// [`PageLog::predictable_sizes`] (which must agree with it).
struct ReadMeter<'a, 'b> {
    stored: Option<&'a StoredReads<'b>>,
    total: u64,
    stored_total: u64,
    /// The object the last page taken was read from (its bytes are counted).
    open_object: Option<ObjectId>,
    /// `open_object` was counted whole (entered at its first page), so its
    /// later pages cost nothing more.
    open_whole: bool,
}

/// What one page costs a read.
struct Charge {
    /// Bytes counted against the reply size.
    cost: u64,
    /// Bytes of objects this page makes the read fetch.
    stored_cost: u64,
    /// The page may go out as part of a whole object (a URL).
    whole_object: bool,
    /// The page's object counts whole in this read: entered at its first
    /// page, with every byte charged there.
    counted_whole: bool,
    in_storage: Option<ObjectId>,
}

impl<'a, 'b> ReadMeter<'a, 'b> {
    fn new(stored: Option<&'a StoredReads<'b>>) -> Self {
        ReadMeter {
            stored,
            total: 0,
            stored_total: 0,
            open_object: None,
            open_whole: false,
        }
    }

    /// What `page` costs a read that may take `max_bytes`.
    fn charge(&self, page: &Page, max_bytes: u64) -> Charge {
        let in_storage = page.object.filter(|_| page.body.is_none());
        let (cost, stored_cost, whole_object, counted_whole) = match (in_storage, self.stored) {
            // The object is already fetched; its pages are counted by their
            // sizes unless the whole object was counted at its first page.
            // (A read that enters an object past its first page hands out
            // no URL for it, and its later pages must still count, or the
            // reply runs past the size asked: wide-run seed 148,017,808.)
            // Either way a reply ends where its pages' sizes say.
            (Some((object, _)), Some(s)) if self.open_object == Some(object) => {
                let cost = if self.open_whole { 0 } else { page.size };
                (cost, 0, s.whole, self.open_whole)
            }
            (Some((object, index)), Some(s)) => {
                let object_bytes = (s.object_size)(object);
                // Whole (one URL) only when the whole object fits what is
                // left: else its pages count by size, and the reply still
                // ends where they say rather than before the object.
                let counted_whole =
                    s.whole && index == 0 && self.total.saturating_add(object_bytes) <= max_bytes;
                let cost = if counted_whole {
                    object_bytes
                } else {
                    page.size
                };
                (cost, object_bytes, s.whole, counted_whole)
            }
            _ => (page.size, 0, false, false),
        };
        Charge {
            cost,
            stored_cost,
            whole_object,
            counted_whole,
            in_storage: in_storage.map(|(o, _)| o),
        }
    }

    /// Whether the objects the page makes the read fetch stay within what
    /// one read may take back.
    fn stored_fits(&self, charge: &Charge) -> bool {
        self.stored
            .is_none_or(|s| self.stored_total.saturating_add(charge.stored_cost) <= s.max_bytes)
    }

    /// Whether a page fits after those taken (the caller always takes the
    /// first).
    fn fits(&self, charge: &Charge, max_bytes: u64) -> bool {
        self.total.saturating_add(charge.cost) <= max_bytes && self.stored_fits(charge)
    }

    fn take(&mut self, charge: &Charge) {
        self.open_object = charge.in_storage;
        self.open_whole = charge.counted_whole;
        self.total = self.total.saturating_add(charge.cost);
        self.stored_total = self.stored_total.saturating_add(charge.stored_cost);
    }
}

/// Pages `base .. base + len` of one buffer (or of a task's shared log).
#[derive(Debug, Default)]
pub(crate) struct PageLog {
    base: u64,
    pages: VecDeque<Page>,
    /// Segments spilled from this log so far (the target size grows).
    pub spilled_segments: u64,
    /// Bytes of the pages below `base` (acknowledged and freed): with the
    /// pages held, the bytes below any token (a commit manifest's sizes).
    freed_bytes: u64,
    /// Bytes of the pages held: the bytes below the next token without a
    /// walk (a BROADCAST set's member made late starts there).
    held_bytes: u64,
}

/// Bytes of bookkeeping per page slot.
pub(crate) const SLOT_BYTES: u64 = std::mem::size_of::<Page>() as u64;

// HELLO's `max-enqueue-bytes=` promise counts each page at
// `ENQUEUE_PAGE_COST` besides its bytes: at least its slot here.
const _: () = assert!(SLOT_BYTES <= binx_proto::ENQUEUE_PAGE_COST);

impl PageLog {
    /// Token of the oldest page still held: every token below it was acknowledged.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Token the next appended page gets.
    pub(crate) fn next(&self) -> u64 {
        self.base + self.pages.len() as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.pages.len()
    }

    /// Bytes of the slots the log has allocated (charged as memory).
    pub(crate) fn slot_bytes(&self) -> u64 {
        self.pages.capacity() as u64 * SLOT_BYTES
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Page> {
        self.pages.iter()
    }

    /// Room for `n` more pages at once (one growth, as the core charged).
    pub(crate) fn reserve(&mut self, n: usize) {
        self.pages.reserve(n);
    }

    pub(crate) fn push(&mut self, page: Page) {
        self.held_bytes += page.size;
        self.pages.push_back(page);
    }

    /// Removes the oldest page (its token is the old `base`).
    pub(crate) fn pop_front(&mut self) -> Option<Page> {
        let page = self.pages.pop_front()?;
        self.base += 1;
        self.freed_bytes += page.size;
        self.held_bytes -= page.size;
        self.shrink();
        Some(page)
    }

    /// Removes every page below `token` (clamped to what is held).
    pub(crate) fn ack(&mut self, token: u64) -> Vec<Page> {
        let count = token.saturating_sub(self.base).min(self.pages.len() as u64) as usize;
        let out: Vec<Page> = self.pages.drain(..count).collect();
        self.base += count as u64;
        let freed = out.iter().map(|p| p.size).sum::<u64>();
        self.freed_bytes += freed;
        self.held_bytes -= freed;
        self.shrink();
        out
    }

    /// Removes everything and moves `base` to `next`.
    pub(crate) fn clear(&mut self) -> Vec<Page> {
        self.base = self.next();
        self.freed_bytes += self.held_bytes;
        self.held_bytes = 0;
        std::mem::take(&mut self.pages).into()
    }

    /// Bytes of the pages below `end` (clamped to the pages appended).
    pub(crate) fn bytes_before(&self, end: u64) -> u64 {
        let held = end.saturating_sub(self.base).min(self.pages.len() as u64) as usize;
        if held == self.pages.len() {
            return self.freed_bytes + self.held_bytes;
        }
        self.freed_bytes + self.pages.iter().take(held).map(|p| p.size).sum::<u64>()
    }

    /// Frees the memory of pages that are in storage too (a committed
    /// buffer nobody reads now can be read from there); returns the
    /// allocations and bytes released.
    pub(crate) fn evict_stored(&mut self) -> Vec<(u64, u64)> {
        let mut released = Vec::new();
        for page in &mut self.pages {
            if page.object.is_some() && !page.spilling && page.body.take().is_some() {
                released.push((page.chunk, page.size));
            }
        }
        released
    }

    /// Gives back slots a long log no longer needs, so they stop counting.
    fn shrink(&mut self) {
        let cap = self.pages.capacity();
        if self.pages.is_empty() {
            self.pages = VecDeque::new();
        } else if cap > 64 && self.pages.len() * 4 < cap {
            self.pages.shrink_to(self.pages.len() * 2);
        }
    }

    /// The pages held from `token` up to `end`; none when `token` is below
    /// the acknowledged mark.
    fn pages_from(&self, token: u64, end: u64) -> std::collections::vec_deque::Iter<'_, Page> {
        let stop = end.min(self.next()).saturating_sub(self.base) as usize;
        let start = match token.checked_sub(self.base) {
            Some(offset) => usize::try_from(offset).unwrap_or(usize::MAX).min(stop),
            None => stop,
        };
        self.pages.range(start..stop)
    }

    /// Pages from `token` (at least one when any is held there, then whole
    /// pages while the total stays within `max_bytes`), at most `max_pages`,
    /// stopping before `end`. With `stored`, pages only in storage also
    /// stop the read before the object that would take the objects touched
    /// past `stored.max_bytes`, and with `stored.whole` a page only in
    /// storage counts its whole object when it is the object's first page,
    /// and nothing when that object already started in this read.
    pub(crate) fn read(
        &self,
        token: u64,
        end: u64,
        max_bytes: u64,
        max_pages: usize,
        stored: Option<&StoredReads<'_>>,
    ) -> Vec<ReadPage> {
        let mut out = Vec::new();
        let mut meter = ReadMeter::new(stored);
        for page in self.pages_from(token, end) {
            if out.len() >= max_pages {
                break;
            }
            let charge = meter.charge(page, max_bytes);
            if !out.is_empty() && !meter.fits(&charge, max_bytes) {
                break;
            }
            meter.take(&charge);
            out.push(ReadPage {
                size: page.size,
                body: page.body.clone(),
                object: page.object,
            });
        }
        out
    }

    /// The first object, other than `skip`, that holds pages from `token`
    /// on (below `end`, among the next `scan` pages) only in storage: what
    /// a consumer reading from storage will need next.
    pub(crate) fn next_stored_object(
        &self,
        token: u64,
        end: u64,
        skip: Option<ObjectId>,
        scan: usize,
    ) -> Option<ObjectId> {
        self.pages_from(token, end)
            .take(scan)
            .filter(|p| p.body.is_none())
            .filter_map(|p| p.object.map(|(id, _)| id))
            .find(|&id| Some(id) != skip)
    }

    /// Sizes of the pages from `token` up to `end` whose replies end where
    /// their sizes say (see [`PageLog::read`]): pages in memory, and, with
    /// `stored` not handing out whole objects, pages only in storage while
    /// the objects they are in stay within `stored.max_bytes` (counted as a
    /// read counts them, so a read from any of these pages stops only by
    /// size). Stops at the first other page, once their total exceeds
    /// `max_bytes` (that page included), after `max` of them, or before
    /// their protobuf encoding would pass `max_encoded` bytes.
    pub(crate) fn predictable_sizes(
        &self,
        token: u64,
        end: u64,
        max_bytes: u64,
        max: usize,
        max_encoded: usize,
        stored: Option<&StoredReads<'_>>,
    ) -> Vec<u64> {
        let mut out = Vec::new();
        let mut total = 0u64;
        let mut encoded = 0usize;
        let mut meter = ReadMeter::new(stored);
        for page in self.pages_from(token, end).take(max) {
            encoded += binx_proto::encoded_len_varint(page.size);
            if total > max_bytes || encoded > max_encoded {
                break;
            }
            // Every listed page is charged by its size, and the objects of
            // the run stay within what one read may take back, so a read
            // from any listed page stops only by size.
            let charge = meter.charge(page, max_bytes);
            if charge.cost != page.size
                || charge.whole_object
                || (page.body.is_none() && stored.is_none())
                || !meter.stored_fits(&charge)
            {
                break;
            }
            meter.take(&charge);
            total = total.saturating_add(page.size);
            out.push(page.size);
        }
        out
    }

    /// Sizes of the pages from `token` up to `end`, at most `max` of them.
    pub(crate) fn sizes(&self, token: u64, end: u64, max: usize) -> Vec<u64> {
        self.pages_from(token, end)
            .take(max)
            .map(|p| p.size)
            .collect()
    }

    /// The arrival order of the oldest page held in memory that is in
    /// storage too: such pages leave memory without a write.
    pub(crate) fn oldest_stored_in_memory(&self) -> Option<u64> {
        self.pages
            .iter()
            .find(|p| p.object.is_some() && p.body.is_some() && !p.spilling)
            .map(|p| p.seq)
    }

    /// The oldest page held only in memory: (arrival order, when).
    pub(crate) fn oldest_spillable(&self) -> Option<(u64, Instant)> {
        self.pages
            .iter()
            .find(|p| p.spillable())
            .map(|p| (p.seq, p.at))
    }

    /// Marks and returns the oldest run of pages held only in memory (and
    /// arrived at or before `older_than`, when given), up to `target` bytes
    /// (at least one page); `None` when there is none, or when it holds
    /// more than `room` bytes (it is left for later).
    pub(crate) fn take_spill_run(
        &mut self,
        target: u64,
        older_than: Option<Instant>,
        room: u64,
    ) -> Option<SpillRun> {
        let eligible = |p: &Page| p.spillable() && older_than.is_none_or(|t| p.at <= t);
        let start = self.pages.iter().position(eligible)?;
        let (mut end, mut total) = (start, 0);
        for page in self.pages.range(start..) {
            if !eligible(page) || (end > start && total + page.size > target) {
                break;
            }
            total += page.size;
            end += 1;
        }
        if total > room {
            return None;
        }
        let mut pages = Vec::with_capacity(end - start);
        for page in self.pages.range_mut(start..end) {
            page.spilling = true;
            if let Some(body) = &page.body {
                pages.push(body.clone());
            }
        }
        self.spilled_segments += 1;
        Some(SpillRun {
            first_token: self.base + start as u64,
            pages,
        })
    }

    /// The size a spill run of this log aims at: `first` for its first
    /// segment, `grown` after.
    pub(crate) fn spill_target(&self, first: u64, grown: u64) -> u64 {
        if self.spilled_segments == 0 {
            first
        } else {
            grown
        }
    }

    /// Ends a spill of `count` pages from `first_token`: with the object
    /// written, pages still held point to it and, unless `keep`, leave
    /// memory (the chunks they pinned, and their sizes, are returned);
    /// either way they may be picked again. Kept pages are served from
    /// memory and may leave it at any time ([`PageLog::evict_stored`]).
    /// Also returns how many pages now refer to the object.
    pub(crate) fn finish_spill(
        &mut self,
        first_token: u64,
        count: usize,
        object: Option<ObjectId>,
        keep: bool,
    ) -> (Vec<(u64, u64)>, u64) {
        let mut released = Vec::new();
        let mut referring = 0;
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
                page.object = Some((object, index));
                referring += 1;
                if !keep && page.body.take().is_some() {
                    released.push((page.chunk, page.size));
                }
            }
        }
        (released, referring)
    }

    /// The objects holding this log's pages, once each, in token order.
    pub(crate) fn objects(&self) -> Vec<ObjectId> {
        self.objects_before(u64::MAX)
    }

    /// The objects holding pages below token `end`, in token order (a
    /// BROADCAST buffer that ended early commits only those).
    pub(crate) fn objects_before(&self, end: u64) -> Vec<ObjectId> {
        let held = end.saturating_sub(self.base).min(self.pages.len() as u64) as usize;
        let mut out: Vec<ObjectId> = Vec::new();
        for page in self.pages.iter().take(held) {
            if let Some((object, _)) = page.object
                && out.last() != Some(&object)
            {
                out.push(object);
            }
        }
        out
    }

    /// Whether every page held is in storage.
    pub(crate) fn all_spooled(&self) -> bool {
        self.pages.iter().all(|p| p.object.is_some())
    }

    /// Whether every page held below token `end` is in storage.
    pub(crate) fn spooled_below(&self, end: u64) -> bool {
        let held = end.saturating_sub(self.base).min(self.pages.len() as u64) as usize;
        self.pages.iter().take(held).all(|p| p.object.is_some())
    }

    /// Bytes of memory in pages that could be spilled now.
    pub(crate) fn spillable_bytes(&self) -> u64 {
        self.pages
            .iter()
            .filter(|p| p.spillable())
            .map(|p| p.size)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(sizes: &[usize]) -> PageLog {
        let mut log = PageLog::default();
        for (i, &s) in sizes.iter().enumerate() {
            log.push(Page {
                size: s as u64,
                body: Some(Bytes::from(vec![0u8; s])),
                chunk: 0,
                object: None,
                seq: i as u64,
                at: Instant::now(),
                spilling: false,
            });
        }
        log
    }

    #[test]
    fn read_returns_one_page_even_above_the_limit_then_whole_pages() {
        let log = log_of(&[10, 20, 30]);
        assert_eq!(log.read(0, u64::MAX, 5, 100, None).len(), 1);
        assert_eq!(log.read(0, u64::MAX, 30, 100, None).len(), 2);
        assert_eq!(log.read(0, u64::MAX, 29, 100, None).len(), 1);
        assert_eq!(log.read(1, u64::MAX, 1000, 100, None).len(), 2);
        assert_eq!(log.read(1, 2, 1000, 100, None).len(), 1);
        assert_eq!(log.read(0, u64::MAX, 1000, 2, None).len(), 2);
        assert!(log.read(3, u64::MAX, 1000, 100, None).is_empty());
    }

    #[test]
    fn a_reply_with_every_page_and_every_following_size_fits_the_header_limit() {
        use crate::core::{MAX_FOLLOWING_SIZES, MAX_FOLLOWING_SIZES_BYTES, MAX_REPLY_PAGES};
        use binx_proto::{BinReply, Message, Segment};
        // The largest sizes a frame allows: 5 bytes each as varints.
        let size = u64::from(u32::MAX) - 8;
        let mut log = PageLog::default();
        for i in 0..(MAX_REPLY_PAGES + MAX_FOLLOWING_SIZES) as u64 {
            log.push(Page {
                size,
                body: Some(Bytes::new()),
                chunk: 0,
                object: None,
                seq: i,
                at: Instant::now(),
                spilling: false,
            });
        }
        let following = log.predictable_sizes(
            MAX_REPLY_PAGES as u64,
            u64::MAX,
            u64::MAX,
            MAX_FOLLOWING_SIZES,
            MAX_FOLLOWING_SIZES_BYTES,
            None,
        );
        assert!(!following.is_empty());
        assert!(
            following.len() * binx_proto::encoded_len_varint(size) <= MAX_FOLLOWING_SIZES_BYTES
        );
        let reply = BinReply {
            request_id: u64::MAX,
            r#type: 1,
            status: 1,
            page_token: u64::MAX - 1,
            page_next_token: u64::MAX,
            segments: vec![Segment::inline(u64::MAX, vec![size; MAX_REPLY_PAGES])],
            following_sizes: following,
            ..Default::default()
        };
        assert!(
            reply.encoded_len() <= binx_proto::MAX_HEADER_LENGTH,
            "{} bytes",
            reply.encoded_len()
        );
        // Small pages: the whole next reply and the page after it.
        let log = log_of(&[1; 2 * MAX_REPLY_PAGES + 2]);
        let following = log.predictable_sizes(
            0,
            u64::MAX,
            u64::MAX,
            MAX_FOLLOWING_SIZES,
            MAX_FOLLOWING_SIZES_BYTES,
            None,
        );
        assert_eq!(following.len(), MAX_REPLY_PAGES + 1);
    }

    #[test]
    fn ack_removes_from_the_front() {
        let mut log = log_of(&[10, 20, 30]);
        assert_eq!(log.ack(2).len(), 2);
        assert_eq!((log.base(), log.next()), (2, 3));
        assert!(log.ack(1).is_empty());
        assert_eq!(log.sizes(2, u64::MAX, 10), vec![30]);
        assert_eq!(log.ack(99).len(), 1);
        assert_eq!((log.base(), log.next()), (3, 3));
    }

    #[test]
    fn long_logs_give_back_their_slots() {
        let mut log = log_of(&vec![0; 10_000]);
        let full = log.slot_bytes();
        log.ack(9_990);
        assert!(
            log.slot_bytes() * 10 < full,
            "{} of {full}",
            log.slot_bytes()
        );
    }

    /// The bytes below any token, counted as pages come and go, are what
    /// a walk over the pages says, through pushes, pops, acks and clears.
    #[test]
    fn bytes_before_keeps_its_count_through_every_change() {
        let mut log = PageLog::default();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut made = 0u64;
        for _ in 0..5_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            match seed % 7 {
                0 => {
                    log.pop_front();
                }
                1 => {
                    log.ack(log.base() + seed % 5);
                }
                2 if seed % 50 == 2 => {
                    log.clear();
                }
                _ => {
                    let size = (seed >> 8) % 1000;
                    made += size;
                    log.push(Page {
                        size,
                        body: None,
                        chunk: 0,
                        object: None,
                        seq: 0,
                        at: Instant::now(),
                        spilling: false,
                    });
                }
            }
            let walked: u64 = log.freed_bytes + log.iter().map(|p| p.size).sum::<u64>();
            assert_eq!(log.bytes_before(log.next()), walked);
            assert_eq!(log.bytes_before(u64::MAX), made);
            let mid = log.base() + log.len() as u64 / 2;
            let below_mid: u64 =
                log.freed_bytes + log.iter().take(log.len() / 2).map(|p| p.size).sum::<u64>();
            assert_eq!(log.bytes_before(mid), below_mid);
        }
    }
}
