//! One task: its buffers, how pages reach them (partitioned, broadcast,
//! arbitrary), what a consumer at a token may read, and what its pages hold
//! (memory chunks, object references).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use binx_proto::{BufferKind, SpoolPolicy};

use crate::ids::ConnId;
use crate::memory::Pins;
use crate::objects::{ObjectId, ObjectMeta, Objects};
use crate::page_log::{Page, PageLog, ReadPage, SpillRun, StoredReads};
use crate::refusal::Refusal;
use crate::task_id::TaskId;
use crate::tombstones::EarlyDeleted;

/// Why a buffer is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BufferGone {
    /// Its consumer deleted it (or did before the task opened).
    Deleted,
    /// No consumer polled it for the abandon time: never reads as complete.
    Abandoned,
}

/// One consumer's view of a task.
#[derive(Debug)]
pub(crate) struct Buffer {
    /// PARTITIONED and ARBITRARY: the pages of this buffer.
    pub log: PageLog,
    /// BROADCAST: every token below it was acknowledged by this buffer.
    pub cursor: u64,
    /// Token after the last page, once NO_MORE_PAGES made it known.
    pub end: Option<u64>,
    /// BROADCAST: bytes of the pages below `end`, counted when it was set
    /// (the shared log may free pages at and past `end` later, when other
    /// buffers have read them).
    pub end_bytes: u64,
    pub gone: Option<BufferGone>,
    pub last_poll: Instant,
    /// A commit marker names this buffer (written or being written).
    pub marker: bool,
    /// When its commit marker was written: from then on it is read from
    /// storage if need be, never dropped as abandoned before the spool's
    /// TTL (its memory may be freed sooner).
    pub committed_at: Option<Instant>,
}

impl Buffer {
    /// BROADCAST: the first token this buffer still needs from the shared
    /// log; none (`u64::MAX`) once it is gone or read to its end.
    fn needs_from(&self) -> u64 {
        if self.gone.is_some() || self.end.is_some_and(|end| self.cursor >= end) {
            u64::MAX
        } else {
            self.cursor
        }
    }

    fn new(now: Instant) -> Self {
        Buffer {
            log: PageLog::default(),
            cursor: 0,
            end: None,
            end_bytes: 0,
            gone: None,
            last_poll: now,
            marker: false,
            committed_at: None,
        }
    }
}

/// What a read at a token found.
#[derive(Debug)]
pub(crate) struct Read {
    pub pages: Vec<ReadPage>,
    pub sizes: Vec<u64>,
    pub complete: bool,
}

/// Why a token cannot be read.
#[derive(Debug)]
pub(crate) enum TokenError {
    BelowMark { mark: u64 },
    BeyondNext { next: u64 },
}

/// Which page log of a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LogId {
    Shared,
    Buffer(u64),
}

/// Where released page references go: object references are dropped in
/// the object table, and objects nobody refers to any more are collected
/// here for deletion.
pub(crate) struct Sink<'a> {
    pub objects: &'a mut Objects,
    pub deletes: &'a mut Vec<Arc<ObjectMeta>>,
}

impl Sink<'_> {
    fn drop_object_page(&mut self, object: ObjectId) {
        if let Some(meta) = self.objects.drop_page(object) {
            self.deletes.push(meta);
        }
    }
}

#[derive(Debug)]
pub(crate) struct Task {
    pub id: TaskId,
    pub kind: BufferKind,
    pub fixed_count: Option<u64>,
    pub policy: SpoolPolicy,
    /// No buffer is added any more: fixed count, or task-wide NO_MORE_PAGES.
    pub buffers_closed: bool,
    /// Task-wide NO_MORE_PAGES was received.
    pub input_finished: bool,
    pub buffers: BTreeMap<u64, Buffer>,
    /// BROADCAST: the pages every buffer reads. ARBITRARY: pages not yet
    /// handed to a buffer. PARTITIONED: unused.
    pub shared: PageLog,
    /// Last request of its producer or of any consumer.
    pub last_activity: Instant,
    /// When OPEN_TASK made it: the abandon clock of the buffers of a fixed
    /// BROADCAST set no consumer ever asked for.
    pub opened_at: Instant,
    /// When OPEN_TASK made it, never moved: every object of the task was
    /// written after it, so each expires (`spool_ttl` after its write) no
    /// sooner than `spool_ttl` after this.
    pub born: Instant,
    /// Buffers deleted before they existed (DELETE before OPEN_TASK, or before
    /// the buffer's first page): born gone.
    pub early_deleted: EarlyDeleted,
    /// Policy `always`: a durable write of this task is in flight (they go
    /// one at a time, so tokens planned before the write stay right).
    pub durable_in_flight: bool,
    /// A buffer was dropped as abandoned: the task ends as abandoned.
    pub abandoned_any: bool,
    /// Connections its producer sent OPEN_TASK, ENQUEUE or NO_MORE_PAGES
    /// on that are still open, until the task-wide NO_MORE_PAGES is
    /// answered: while there is one, the task is not dropped as abandoned,
    /// nor (under `always` or `commit`) a buffer of it (an engine may
    /// produce for longer than the abandon time before anyone reads, as
    /// fault-tolerant execution does).
    pub producers: BTreeSet<ConnId>,
    /// The task's commit manifest was written (task-wide NO_MORE_PAGES
    /// under `always` or `commit`): deleted with its markers.
    pub manifest: bool,
    /// A manifest with this task's markers folded in failed for good (a
    /// store that refuses it): its commit writes them apart instead.
    pub fold_refused: bool,
    /// Pages of it may be held in memory that are in storage too (a
    /// `commit` spill kept them, or an `always` ENQUEUE): memory that room
    /// wanted elsewhere can take at once ([`Task::stored_in_memory_logs`]).
    pub stored_in_memory: bool,
    pins: Pins,
    slot_bytes: u64,
    /// Bytes of the pages held in memory (what `memory()` charges beyond
    /// them is the allocations they pin and the bookkeeping).
    pub page_bytes: u64,
    /// BROADCAST: the floor the last release freed the shared log to, and
    /// how many buffers stood at it, while no change but acknowledgements
    /// came since ([`BroadcastFloor`]).
    floor: Option<BroadcastFloor>,
}

/// BROADCAST: the lowest token some buffer still needs (every buffer's
/// cursor, or none for one gone or read to its end) and how many buffers
/// stand at it. An acknowledgement by a buffer above the floor cannot move
/// it, nor one by a buffer at it while another stands there too: only the
/// last buffer to leave the floor makes the task look at every buffer
/// again. Without it every DATA of a set of N consumers walked all N.
#[derive(Clone, Copy, Debug)]
struct BroadcastFloor {
    token: u64,
    at_floor: usize,
}

/// Adjusts a slot total by a log's change in allocated slots.
fn resync(total: &mut u64, before: u64, after: u64) {
    *total = total.saturating_sub(before) + after;
}

impl Task {
    pub(crate) fn new(
        id: TaskId,
        kind: BufferKind,
        fixed_count: Option<u64>,
        policy: SpoolPolicy,
        early_deleted: EarlyDeleted,
        max_buffers: u64,
        now: Instant,
    ) -> Self {
        let mut task = Task {
            id,
            kind,
            fixed_count,
            policy,
            buffers_closed: fixed_count.is_some(),
            input_finished: false,
            buffers: BTreeMap::new(),
            shared: PageLog::default(),
            last_activity: now,
            opened_at: now,
            born: now,
            early_deleted,
            durable_in_flight: false,
            abandoned_any: false,
            producers: BTreeSet::new(),
            manifest: false,
            fold_refused: false,
            stored_in_memory: false,
            pins: Pins::default(),
            slot_bytes: 0,
            page_bytes: 0,
            floor: None,
        };
        // Buffers their consumers deleted before the task opened are born
        // gone, so a broadcast set can still free pages and the task end;
        // a growing task's within `max_buffers_per_task` (a DELETE_TASK's
        // range and DELETEs' ids could name more; those past it are born
        // gone if the task ever gets them).
        let early: Vec<u64> = task
            .early_deleted
            .iter()
            .take_while(|&id| fixed_count.is_none_or(|count| id < count))
            .take(usize::try_from(max_buffers).unwrap_or(usize::MAX))
            .collect();
        for id in early {
            task.buffer_mut(id, now);
        }
        task
    }

    /// Bytes this task holds: the chunks its pages pin and its log slots.
    pub(crate) fn memory(&self) -> u64 {
        self.pins.bytes() + self.slot_bytes
    }

    /// Recounts memory from the pages themselves (the simulation's check
    /// that the running count is what is really held).
    pub(crate) fn recount_memory(&self) -> u64 {
        let mut chunks: BTreeMap<u64, (u32, u64)> = BTreeMap::new();
        let mut slots = self.shared.slot_bytes();
        let mut count = |log: &PageLog| {
            for page in log.iter() {
                if page.body.is_some() && page.chunk != 0 {
                    chunks.entry(page.chunk).or_insert((0, 0)).0 += 1;
                }
            }
        };
        count(&self.shared);
        for b in self.buffers.values() {
            count(&b.log);
            slots += b.log.slot_bytes();
        }
        for (id, pages, capacity) in self.pins.pages_by_chunk() {
            if let Some(c) = chunks.get_mut(&id) {
                c.1 = capacity;
                if c.0 != pages {
                    return u64::MAX;
                }
            } else {
                return u64::MAX;
            }
        }
        if chunks.values().any(|&(_, cap)| cap == 0) {
            return u64::MAX;
        }
        chunks.values().map(|&(_, cap)| cap).sum::<u64>() + slots
    }

    /// Checks the BROADCAST floor the task keeps against one worked out
    /// from every buffer (the simulation's check that acknowledgements
    /// which skip the walk skip only where it would change nothing).
    /// Worked out here apart from `release_broadcast`'s loop on purpose: a
    /// check sharing the code it checks would share its mistakes.
    pub(crate) fn check_floor(&self) -> Result<(), String> {
        let Some(floor) = self.floor else {
            return Ok(());
        };
        let token = self
            .buffers
            .values()
            .map(Buffer::needs_from)
            .min()
            .unwrap_or(u64::MAX);
        let at_floor = self
            .buffers
            .values()
            .filter(|b| b.needs_from() == token)
            .count();
        if (token, at_floor) != (floor.token, floor.at_floor) {
            return Err(format!(
                "broadcast task {} keeps its floor at token {} with {} buffers, but its buffers put it at {token} with {at_floor}",
                self.id, floor.token, floor.at_floor
            ));
        }
        Ok(())
    }

    /// Releases pages leaving the task: their chunks and object references.
    fn release(&mut self, pages: Vec<Page>, sink: &mut Sink<'_>) {
        for page in pages {
            if page.body.is_some() {
                self.pins.unpin(page.chunk);
                self.page_bytes -= page.size;
            }
            if let Some((object, _)) = page.object {
                sink.drop_object_page(object);
            }
        }
    }

    /// The buffer, created if the task may still gain it. A buffer first
    /// seen after an open-ended set closed is born finished and empty; one of
    /// a fixed set first seen after the input finished is born finished (a
    /// BROADCAST one still sees every page); one deleted early is born gone.
    pub(crate) fn buffer_mut(&mut self, id: u64, now: Instant) -> &mut Buffer {
        let closed_late = self.buffers_closed && self.fixed_count.is_none();
        // ARBITRARY buffers are never born finished: they take unassigned
        // pages like any other, and end once none is left.
        let born_finished =
            (closed_late || self.input_finished) && self.kind != BufferKind::Arbitrary;
        let (kind, shared, early_deleted) = (self.kind, &self.shared, &self.early_deleted);
        let floor = &mut self.floor;
        // Worked out only for a buffer that is new: every DATA comes here,
        // and `bytes_before` walks the shared log.
        self.buffers.entry(id).or_insert_with(|| {
            // A new buffer may stand below the floor.
            *floor = None;
            let end_if_finished = match kind {
                BufferKind::Broadcast if !closed_late => shared.next(),
                _ => 0,
            };
            let bytes_if_finished = match end_if_finished {
                0 => 0,
                end => shared.bytes_before(end),
            };
            let born_deleted = early_deleted.contains(id);
            let mut buffer = Buffer::new(now);
            if born_finished {
                buffer.end = Some(end_if_finished);
                buffer.end_bytes = bytes_if_finished;
            }
            if born_deleted {
                buffer.gone = Some(BufferGone::Deleted);
                buffer.end.get_or_insert(0);
            }
            buffer
        })
    }

    /// Token after the buffer's last page, if it is known yet.
    pub(crate) fn end_of(&self, buffer: &Buffer) -> Option<u64> {
        if let Some(end) = buffer.end {
            return Some(end);
        }
        match self.kind {
            BufferKind::Arbitrary if self.input_finished && self.shared.len() == 0 => {
                Some(buffer.log.next())
            }
            BufferKind::Broadcast if self.input_finished => Some(self.shared.next()),
            _ => None,
        }
    }

    /// Every token below this was acknowledged by buffer `id`.
    pub(crate) fn mark(&self, id: u64) -> u64 {
        match self.buffers.get(&id) {
            Some(b) if self.kind == BufferKind::Broadcast => b.cursor,
            Some(b) => b.log.base(),
            None => 0,
        }
    }

    /// Sizes of the pages of buffer `id` held from `token` on (at most
    /// `max`), changing nothing.
    pub(crate) fn peek_sizes(&self, id: u64, token: u64, max: usize) -> Vec<u64> {
        let Some(buffer) = self.buffers.get(&id) else {
            return Vec::new();
        };
        let limit = self.end_of(buffer).unwrap_or(u64::MAX);
        self.log_read_by(buffer).sizes(token, limit, max)
    }

    /// The log buffer `buffer` reads its pages from: the task's shared one
    /// for BROADCAST, its own otherwise.
    fn log_read_by<'a>(&'a self, buffer: &'a Buffer) -> &'a PageLog {
        match self.kind {
            BufferKind::Broadcast => &self.shared,
            _ => &buffer.log,
        }
    }

    /// Acknowledges every page of buffer `id` below `token` (a token at or
    /// below the mark is harmless).
    pub(crate) fn ack(
        &mut self,
        id: u64,
        token: u64,
        sink: &mut Sink<'_>,
    ) -> Result<(), TokenError> {
        let next = self.next_token(id);
        if token > next {
            return Err(TokenError::BeyondNext { next });
        }
        let kind = self.kind;
        let Some(buffer) = self.buffers.get_mut(&id) else {
            return Ok(());
        };
        if kind == BufferKind::Broadcast {
            let before = buffer.needs_from();
            buffer.cursor = buffer.cursor.max(token);
            let after = buffer.needs_from();
            match self.floor {
                // The floor stays where it is: this buffer stood above it,
                // or did not move.
                Some(floor) if before > floor.token || before == after => {}
                Some(BroadcastFloor { token, at_floor }) if before == token && at_floor > 1 => {
                    self.floor = Some(BroadcastFloor {
                        token,
                        at_floor: at_floor - 1,
                    });
                }
                _ => self.release_broadcast(sink),
            }
        } else {
            let before = buffer.log.slot_bytes();
            let pages = buffer.log.ack(token);
            let after = buffer.log.slot_bytes();
            resync(&mut self.slot_bytes, before, after);
            self.release(pages, sink);
        }
        Ok(())
    }

    /// Token after the last page buffer `id` may read now: a DATA or ACK
    /// above it is refused.
    fn next_token(&self, id: u64) -> u64 {
        match self.buffers.get(&id) {
            None => 0,
            Some(buffer) if self.kind == BufferKind::Broadcast => {
                buffer.end.unwrap_or(self.shared.next())
            }
            Some(buffer) => buffer.log.next(),
        }
    }

    /// What a DATA at `token` acknowledges first: every page below it, or,
    /// pipelined, every page below `ack` (at most `token`, checked at the
    /// door). Either way `token` must still be readable: a token below the
    /// mark, or above the next page, is refused and nothing is
    /// acknowledged.
    pub(crate) fn ack_for_read(
        &mut self,
        id: u64,
        token: u64,
        ack: Option<u64>,
        sink: &mut Sink<'_>,
    ) -> Result<(), TokenError> {
        let mark = self.mark(id);
        if token < mark {
            return Err(TokenError::BelowMark { mark });
        }
        let next = self.next_token(id);
        if token > next {
            return Err(TokenError::BeyondNext { next });
        }
        self.ack(id, ack.unwrap_or(token).min(token), sink)
    }

    /// Sizes of the pages of buffer `id` from `token` on whose replies end
    /// where their sizes say ([`PageLog::predictable_sizes`]), while their
    /// total stays within `max_bytes` (plus the page that crosses it), at
    /// most `max_pages`: what a pipelining consumer needs to tell where its
    /// next reply ends.
    pub(crate) fn following_sizes(
        &self,
        id: u64,
        token: u64,
        max_bytes: u64,
        max_pages: usize,
        max_encoded: usize,
        stored: &StoredReads<'_>,
    ) -> Vec<u64> {
        let Some(buffer) = self.buffers.get(&id) else {
            return Vec::new();
        };
        let limit = self.end_of(buffer).unwrap_or(u64::MAX);
        let source = self.log_read_by(buffer);
        source.predictable_sizes(
            token,
            limit,
            max_bytes,
            max_pages,
            max_encoded,
            Some(stored),
        )
    }

    /// Reads buffer `id` from `token` on (after [`Task::ack_for_read`]):
    /// pages (at most `max_bytes` but at least one, at most `max_pages`),
    /// or only their sizes.
    pub(crate) fn read(
        &mut self,
        id: u64,
        token: u64,
        max_bytes: u64,
        max_pages: usize,
        sizes_only: bool,
        stored: Option<&StoredReads<'_>>,
    ) -> Read {
        let kind = self.kind;
        let Some(buffer) = self.buffers.get_mut(&id) else {
            return Read {
                pages: Vec::new(),
                sizes: Vec::new(),
                complete: true,
            };
        };
        let hand_out = kind == BufferKind::Arbitrary
            && !sizes_only
            && buffer.end.is_none()
            && token == buffer.log.next();
        if hand_out {
            // Whoever asks first gets the next unassigned pages.
            let (shared_before, log_before) = (self.shared.slot_bytes(), buffer.log.slot_bytes());
            let mut total = 0u64;
            let mut count = 0usize;
            for size in self.shared.iter().map(|p| p.size) {
                if count >= max_pages || (total > 0 && total + size > max_bytes) {
                    break;
                }
                total += size;
                count += 1;
            }
            buffer.log.reserve(count);
            for _ in 0..count {
                if let Some(mut page) = self.shared.pop_front() {
                    // A spill of the shared log under way no longer finds
                    // it there: it may spill again from the buffer's log.
                    page.spilling = false;
                    buffer.log.push(page);
                }
            }
            let (shared_after, log_after) = (self.shared.slot_bytes(), buffer.log.slot_bytes());
            resync(&mut self.slot_bytes, shared_before, shared_after);
            resync(&mut self.slot_bytes, log_before, log_after);
        }
        let Some(buffer) = self.buffers.get(&id) else {
            return Read {
                pages: Vec::new(),
                sizes: Vec::new(),
                complete: true,
            };
        };
        let end = self.end_of(buffer);
        let source = self.log_read_by(buffer);
        let limit = end.unwrap_or(u64::MAX);
        if sizes_only {
            let mut sizes = source.sizes(token, limit, max_pages);
            if sizes.is_empty() && self.kind == BufferKind::Arbitrary && buffer.end.is_none() {
                sizes = self.shared.sizes(self.shared.base(), u64::MAX, max_pages);
            }
            return Read {
                pages: Vec::new(),
                sizes,
                complete: end == Some(token),
            };
        }
        let handed_out;
        let stored = match stored {
            // Pages handed out one by one are never presigned whole.
            Some(s) if s.whole && self.kind == BufferKind::Arbitrary => {
                handed_out = StoredReads { whole: false, ..*s };
                Some(&handed_out)
            }
            other => other,
        };
        let pages = source.read(token, limit, max_bytes, max_pages, stored);
        let complete = end == Some(token + pages.len() as u64);
        Read {
            pages,
            sizes: Vec::new(),
            complete,
        }
    }

    /// The next object after `skip` that buffer `id` holds pages in only in
    /// storage, from `token` on (see [`PageLog::next_stored_object`]).
    pub(crate) fn next_stored_object(
        &self,
        id: u64,
        token: u64,
        skip: Option<ObjectId>,
    ) -> Option<ObjectId> {
        /// Pages looked at: a reply or two ahead.
        const SCAN: usize = 1024;
        let buffer = self.buffers.get(&id)?;
        let end = self.end_of(buffer).unwrap_or(u64::MAX);
        let source = self.log_read_by(buffer);
        source.next_stored_object(token, end, skip, SCAN)
    }

    /// BROADCAST: frees pages every buffer has acknowledged, once no buffer
    /// can be added any more.
    fn release_broadcast(&mut self, sink: &mut Sink<'_>) {
        self.floor = None;
        if !self.buffers_closed {
            return;
        }
        if let Some(count) = self.fixed_count
            && (self.buffers.len() as u64) < count
        {
            return;
        }
        let mut floor = BroadcastFloor {
            token: u64::MAX,
            at_floor: 0,
        };
        for needs in self.buffers.values().map(Buffer::needs_from) {
            if needs < floor.token {
                floor = BroadcastFloor {
                    token: needs,
                    at_floor: 1,
                };
            } else if needs == floor.token {
                floor.at_floor += 1;
            }
        }
        self.floor = Some(floor);
        let mark = floor.token;
        let before = self.shared.slot_bytes();
        let pages = self.shared.ack(mark);
        let after = self.shared.slot_bytes();
        resync(&mut self.slot_bytes, before, after);
        self.release(pages, sink);
    }

    /// Whether pages for buffer `id` are dropped on arrival: PARTITIONED
    /// pages for a gone buffer.
    pub(crate) fn drops_pages(&self, id: u64) -> bool {
        self.kind == BufferKind::Partitioned
            && (self.early_deleted.contains(id)
                || self.buffers.get(&id).is_some_and(|b| b.gone.is_some()))
    }

    /// Appends pages for buffer `id` (ignored for BROADCAST and ARBITRARY),
    /// pinning their chunks (`capacity` each) and object references.
    /// Pages for a gone PARTITIONED buffer are dropped: returns false.
    pub(crate) fn append(
        &mut self,
        id: u64,
        pages: Vec<Page>,
        chunk_capacity: u64,
        objects: &mut Objects,
        now: Instant,
    ) -> bool {
        if self.drops_pages(id) {
            return false;
        }
        for page in &pages {
            if page.body.is_some() {
                self.pins.pin(page.chunk, chunk_capacity);
                self.page_bytes += page.size;
            }
            if let Some((object, _)) = page.object {
                objects.add_pages(object, 1);
            }
        }
        match self.kind {
            BufferKind::Partitioned => {
                let buffer = self.buffer_mut(id, now);
                let before = buffer.log.slot_bytes();
                buffer.log.reserve(pages.len());
                for page in pages {
                    buffer.log.push(page);
                }
                let after = buffer.log.slot_bytes();
                resync(&mut self.slot_bytes, before, after);
            }
            BufferKind::Broadcast | BufferKind::Arbitrary => {
                let before = self.shared.slot_bytes();
                self.shared.reserve(pages.len());
                for page in pages {
                    self.shared.push(page);
                }
                let after = self.shared.slot_bytes();
                resync(&mut self.slot_bytes, before, after);
            }
        }
        true
    }

    /// Pages held by the log buffer `id`'s pages go to.
    pub(crate) fn log_len(&self, id: u64) -> u64 {
        match self.kind {
            BufferKind::Partitioned => self.buffers.get(&id).map_or(0, |b| b.log.len() as u64),
            _ => self.shared.len() as u64,
        }
    }

    /// Token the next page appended for buffer `id` gets, in the log it goes
    /// to (for BROADCAST and ARBITRARY, the task's shared log).
    pub(crate) fn next_append_token(&self, id: u64) -> u64 {
        match self.kind {
            BufferKind::Partitioned => self.buffers.get(&id).map_or(0, |b| b.log.next()),
            _ => self.shared.next(),
        }
    }

    fn log(&self, log: LogId) -> Option<&PageLog> {
        match log {
            LogId::Shared => Some(&self.shared),
            LogId::Buffer(id) => self.buffers.get(&id).map(|b| &b.log),
        }
    }

    fn log_mut(&mut self, log: LogId) -> Option<&mut PageLog> {
        match log {
            LogId::Shared => Some(&mut self.shared),
            LogId::Buffer(id) => self.buffers.get_mut(&id).map(|b| &mut b.log),
        }
    }

    /// The log holding the task's oldest page held only in memory, with
    /// that page's arrival order and time.
    pub(crate) fn oldest_spillable(&self) -> Option<(LogId, u64, Instant)> {
        std::iter::once((LogId::Shared, &self.shared))
            .chain(
                self.buffers
                    .iter()
                    .map(|(&id, b)| (LogId::Buffer(id), &b.log)),
            )
            .filter_map(|(id, log)| log.oldest_spillable().map(|(seq, at)| (id, seq, at)))
            .min_by_key(|&(_, seq, _)| seq)
    }

    /// Takes a run of memory-only pages of `log` to write to storage, if
    /// it holds at most `room` bytes.
    pub(crate) fn take_spill_run(
        &mut self,
        log: LogId,
        target: u64,
        grown: u64,
        older_than: Option<Instant>,
        room: u64,
    ) -> Option<SpillRun> {
        let log = self.log_mut(log)?;
        log.take_spill_run(log.spill_target(target, grown), older_than, room)
    }

    /// Frees the memory of every page of buffer `id`'s log that is in
    /// storage too; returns how many pages left memory.
    pub(crate) fn evict_stored(&mut self, id: u64) -> u64 {
        let log = if self.kind == BufferKind::Partitioned || self.kind == BufferKind::Arbitrary {
            LogId::Buffer(id)
        } else {
            LogId::Shared
        };
        self.evict_stored_log(log)
    }

    /// Every log holding pages in memory that are in storage too, with the
    /// arrival order of its oldest such page; clears `stored_in_memory`
    /// when there is none.
    pub(crate) fn stored_in_memory_logs(&mut self) -> Vec<(LogId, u64)> {
        let found: Vec<(LogId, u64)> = std::iter::once((LogId::Shared, &self.shared))
            .chain(
                self.buffers
                    .iter()
                    .map(|(&id, b)| (LogId::Buffer(id), &b.log)),
            )
            .filter_map(|(id, log)| log.oldest_stored_in_memory().map(|seq| (id, seq)))
            .collect();
        if found.is_empty() {
            self.stored_in_memory = false;
        }
        found
    }

    /// Frees the memory of every page of the task that is in storage too;
    /// returns how many pages left memory.
    pub(crate) fn evict_all_stored(&mut self) -> u64 {
        let logs: Vec<LogId> = std::iter::once(LogId::Shared)
            .chain(self.buffers.keys().map(|&id| LogId::Buffer(id)))
            .collect();
        let evicted = logs.into_iter().map(|log| self.evict_stored_log(log)).sum();
        self.stored_in_memory = false;
        evicted
    }

    /// Frees the memory of every page of `log` that is in storage too;
    /// returns how many pages left memory (the memory freed is what
    /// `memory()` drops by: an allocation goes with its last page).
    pub(crate) fn evict_stored_log(&mut self, log: LogId) -> u64 {
        let Some(l) = self.log_mut(log) else {
            return 0;
        };
        let released = l.evict_stored();
        let pages = released.len() as u64;
        for (chunk, size) in released {
            self.pins.unpin(chunk);
            self.page_bytes -= size;
        }
        pages
    }

    /// What its commit manifest says of each buffer (index = buffer id):
    /// its end token and the bytes of its pages; `None` while a buffer has
    /// no end.
    pub(crate) fn manifest_buffers(&self) -> Option<Vec<(u64, u64)>> {
        let count = match self.fixed_count {
            Some(n) => n,
            None => self.buffers.keys().next_back().map_or(0, |&id| id + 1),
        };
        let mut out = Vec::new();
        for id in 0..count {
            let Some(b) = self.buffers.get(&id) else {
                // Never asked for nor written: an empty buffer (PARTITIONED).
                if self.kind == BufferKind::Partitioned {
                    out.push((0, 0));
                    continue;
                }
                let end = self.shared.next();
                out.push((end, self.shared.bytes_before(end)));
                continue;
            };
            let end = b.end?;
            let bytes = match self.kind {
                BufferKind::Broadcast => b.end_bytes,
                _ => b.log.bytes_before(end),
            };
            out.push((end, bytes));
        }
        Some(out)
    }

    /// Ends a spill: pages still held point to `object` and, unless
    /// `keep`, leave memory. Returns how many pages refer to the object now.
    pub(crate) fn finish_spill(
        &mut self,
        log: LogId,
        first_token: u64,
        count: usize,
        object: Option<ObjectId>,
        keep: bool,
        objects: &mut Objects,
    ) -> u64 {
        if keep && object.is_some() {
            self.stored_in_memory = true;
        }
        let Some(l) = self.log_mut(log) else {
            return 0;
        };
        let (released, referring) = l.finish_spill(first_token, count, object, keep);
        for (chunk, size) in released {
            self.pins.unpin(chunk);
            self.page_bytes -= size;
        }
        if let Some(object) = object {
            objects.add_pages(object, referring);
        }
        referring
    }

    /// Why ENQUEUE may not add pages for buffer `id`, if it may not.
    pub(crate) fn refuses_pages(&self, id: u64) -> Option<Refusal> {
        if self.input_finished {
            return Some(Refusal::TaskFinished {
                task: self.id.clone(),
            });
        }
        if self.kind == BufferKind::Partitioned
            && let Some(b) = self.buffers.get(&id)
            && b.gone.is_none()
            && b.end.is_some()
        {
            return Some(Refusal::BufferFinished {
                task: self.id.clone(),
                buffer: id,
            });
        }
        None
    }

    /// NO_MORE_PAGES for one buffer, or (`None`) for the whole task.
    /// Its producer let go of it: abandonment is counted from `now` (a
    /// reader of fault-tolerant output comes only once it is produced).
    pub(crate) fn restart_clocks(&mut self, now: Instant) {
        self.last_activity = now;
        self.opened_at = self.opened_at.max(now);
        for b in self.buffers.values_mut() {
            b.last_poll = b.last_poll.max(now);
        }
    }

    pub(crate) fn finish(&mut self, id: Option<u64>, now: Instant) {
        // Ends (and a closed set) move what buffers need.
        self.floor = None;
        match id {
            None => {
                self.input_finished = true;
                self.buffers_closed = true;
                let shared_next = self.shared.next();
                let shared_bytes = self.shared.bytes_before(shared_next);
                let kind = self.kind;
                for buffer in self.buffers.values_mut() {
                    if buffer.end.is_none() {
                        buffer.end = match kind {
                            BufferKind::Partitioned => Some(buffer.log.next()),
                            BufferKind::Broadcast => Some(shared_next),
                            // Known once the unassigned pages are handed out.
                            BufferKind::Arbitrary => None,
                        };
                        buffer.end_bytes = shared_bytes;
                    }
                }
            }
            Some(id) => {
                let shared_next = self.shared.next();
                let shared_bytes = self.shared.bytes_before(shared_next);
                let kind = self.kind;
                let buffer = self.buffer_mut(id, now);
                if buffer.end.is_none() {
                    buffer.end = Some(match kind {
                        BufferKind::Broadcast => shared_next,
                        _ => buffer.log.next(),
                    });
                    buffer.end_bytes = shared_bytes;
                }
            }
        }
    }

    /// Commit markers for the finished buffers among `ids` (all buffers when
    /// `None`: the fixed set, or those that exist): (buffer, end, objects).
    /// PARTITIONED and BROADCAST only: ARBITRARY pages get their buffer
    /// when read.
    pub(crate) fn commit_plans(
        &mut self,
        ids: Option<u64>,
        now: Instant,
    ) -> Vec<(u64, u64, Vec<ObjectId>)> {
        if self.kind == BufferKind::Arbitrary {
            return Vec::new();
        }
        let ids: Vec<u64> = match (ids, self.fixed_count) {
            (Some(id), _) => vec![id],
            (None, Some(count)) => (0..count).collect(),
            (None, None) => self.buffers.keys().copied().collect(),
        };
        let broadcast = self.kind == BufferKind::Broadcast;
        let mut plans = Vec::new();
        for id in ids {
            let buffer = self.buffer_mut(id, now);
            let Some(end) = buffer.end.filter(|_| buffer.gone.is_none()) else {
                continue;
            };
            buffer.marker = true;
            let objects = if broadcast {
                // The shared log goes on past a buffer that ended early.
                self.shared.objects_before(end)
            } else {
                buffer.log.objects()
            };
            plans.push((id, end, objects));
        }
        plans
    }

    /// Draining: the logs whose pages a consumer could finish from storage
    /// once spooled and committed: finished PARTITIONED buffers without a
    /// marker; BROADCAST's shared log once the input is finished.
    pub(crate) fn committable_logs(&self) -> Vec<LogId> {
        match self.kind {
            BufferKind::Partitioned => self
                .buffers
                .iter()
                .filter(|(_, b)| b.end.is_some() && b.gone.is_none() && !b.marker)
                .map(|(&id, _)| LogId::Buffer(id))
                .collect(),
            // Members of a fixed set no consumer asked for yet count too.
            BufferKind::Broadcast
                if self.input_finished
                    && (self.buffers.values().any(|b| !b.marker)
                        || (self.buffers.len() as u64) < self.fixed_count.unwrap_or(0)) =>
            {
                vec![LogId::Shared]
            }
            _ => Vec::new(),
        }
    }

    /// `commit`, BROADCAST: a buffer finished on its own waits for its
    /// commit marker (its NO_MORE_PAGES for the shared pages below its end
    /// to be spooled), before the task's input is finished.
    pub(crate) fn broadcast_commit_waiting(&self) -> bool {
        self.kind == BufferKind::Broadcast
            && self.policy == SpoolPolicy::Commit
            && !self.input_finished
            && self
                .buffers
                .values()
                .any(|b| b.end.is_some() && !b.marker && b.gone.is_none())
    }

    /// Whether a log has pages still to spill or being spilled.
    pub(crate) fn log_fully_spooled(&self, log: LogId) -> bool {
        self.log(log).is_none_or(PageLog::all_spooled)
    }

    /// Draining: commit plans for the committable logs whose pages are all
    /// in storage now.
    pub(crate) fn drain_commit_plans(&mut self, now: Instant) -> Vec<(u64, u64, Vec<ObjectId>)> {
        let mut plans = Vec::new();
        for log in self.committable_logs() {
            if !self.log_fully_spooled(log) {
                continue;
            }
            match log {
                LogId::Buffer(id) => plans.extend(self.commit_plans(Some(id), now)),
                // As a task-wide NO_MORE_PAGES under `always` does: every
                // buffer of the set, also those no consumer asked for yet.
                LogId::Shared => {
                    let all = self.commit_plans(None, now);
                    let fresh: Vec<_> = all
                        .into_iter()
                        .filter(|(id, _, _)| !plans.iter().any(|(p, _, _)| p == id))
                        .collect();
                    plans.extend(fresh);
                }
            }
        }
        plans
    }

    /// Frees buffers `ids` for good (deleted or abandoned); returns those a
    /// commit marker named (the caller deletes the markers). A BROADCAST
    /// set's shared pages are released once, after the last (the floor is
    /// a walk over every buffer).
    pub(crate) fn delete(
        &mut self,
        ids: impl IntoIterator<Item = u64>,
        how: BufferGone,
        now: Instant,
        sink: &mut Sink<'_>,
    ) -> Vec<u64> {
        let mut markers = Vec::new();
        for id in ids {
            let buffer = self.buffer_mut(id, now);
            if std::mem::take(&mut buffer.marker) {
                markers.push(id);
            }
            let before = buffer.log.slot_bytes();
            let pages = buffer.log.clear();
            let after = buffer.log.slot_bytes();
            if buffer.end.is_none() {
                buffer.end = Some(buffer.log.next());
            }
            if buffer.gone != Some(BufferGone::Abandoned) {
                buffer.gone = Some(how);
            }
            resync(&mut self.slot_bytes, before, after);
            self.release(pages, sink);
        }
        if how == BufferGone::Abandoned {
            self.abandoned_any = true;
        }
        if self.kind == BufferKind::Broadcast {
            self.release_broadcast(sink);
        }
        markers
    }

    /// Frees every page; returns the buffers whose markers must go.
    pub(crate) fn clear(&mut self, sink: &mut Sink<'_>) -> Vec<u64> {
        let mut pages = self.shared.clear();
        let mut markers = Vec::new();
        for (&id, buffer) in self.buffers.iter_mut() {
            pages.extend(buffer.log.clear());
            if std::mem::take(&mut buffer.marker) {
                markers.push(id);
            }
        }
        self.slot_bytes = self.shared.slot_bytes()
            + self
                .buffers
                .values()
                .map(|b| b.log.slot_bytes())
                .sum::<u64>();
        self.release(pages, sink);
        markers
    }

    /// Every buffer is gone and no buffer can be added: the task is over
    /// (for ARBITRARY, once no unassigned page is left for a buffer that may
    /// still come).
    pub(crate) fn is_done(&self) -> bool {
        if !self.buffers_closed {
            return false;
        }
        if self.kind == BufferKind::Arbitrary && self.shared.len() > 0 {
            return false;
        }
        if let Some(count) = self.fixed_count
            && (self.buffers.len() as u64) < count
        {
            return false;
        }
        self.buffers.values().all(|b| b.gone.is_some())
    }

    pub(crate) fn pages_held(&self) -> u64 {
        self.shared.len() as u64
            + self
                .buffers
                .values()
                .map(|b| b.log.len() as u64)
                .sum::<u64>()
    }
}
