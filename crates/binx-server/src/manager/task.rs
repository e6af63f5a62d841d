//! One task: its buffers, how pages reach them (partitioned, broadcast,
//! arbitrary), and what a consumer at a token may read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use binx_proto::BufferKind;
use bytes::Bytes;
use tokio::sync::Notify;

use super::page_log::{Page, PageLog, PageRef, SpillRun};
use super::policy::SpoolPolicy;

/// One consumer's view of a task.
#[derive(Debug)]
pub(crate) struct Buffer {
    /// PARTITIONED and ARBITRARY: the pages of this buffer.
    pub log: PageLog,
    /// BROADCAST: every token below it was acknowledged by this buffer.
    pub cursor: u64,
    /// Token after the last page, once NO_MORE_PAGES made it known.
    pub end: Option<u64>,
    pub deleted: bool,
    /// Policy `always`: a commit marker was written for it.
    pub committed: bool,
    pub last_poll: Instant,
    /// Woken when pages arrive, the buffer finishes or the task aborts.
    pub notify: Arc<Notify>,
}

impl Buffer {
    fn new(now: Instant) -> Self {
        Buffer {
            log: PageLog::default(),
            cursor: 0,
            end: None,
            deleted: false,
            committed: false,
            last_poll: now,
            notify: Arc::new(Notify::new()),
        }
    }
}

/// What a read at a token found.
#[derive(Debug)]
pub(crate) struct Read {
    pub pages: Vec<PageRef>,
    pub sizes: Vec<u64>,
    pub complete: bool,
    /// Bytes freed by the implicit acknowledgement.
    pub freed: u64,
}

impl Read {
    /// Nothing to read and nothing will come.
    fn complete_empty(freed: u64) -> Self {
        Read {
            pages: Vec::new(),
            sizes: Vec::new(),
            complete: true,
            freed,
        }
    }
}

/// Why a token cannot be read.
#[derive(Debug)]
pub(crate) enum TokenError {
    BelowMark { mark: u64 },
    BeyondNext { next: u64 },
}

#[derive(Debug)]
pub(crate) struct Task {
    pub kind: BufferKind,
    pub fixed_count: Option<u64>,
    pub spool_policy: SpoolPolicy,
    /// No buffer is added any more: fixed count, or task-wide NO_MORE_PAGES.
    pub buffers_closed: bool,
    /// Task-wide NO_MORE_PAGES was received.
    pub input_finished: bool,
    /// Bytes of pages this task holds.
    pub memory: u64,
    pub buffers: BTreeMap<u64, Buffer>,
    /// BROADCAST: the pages every buffer reads. ARBITRARY: pages not yet
    /// handed to a buffer. PARTITIONED: unused.
    pub shared: PageLog,
    pub last_activity: Instant,
    /// Policy `always`: held from the write of an ENQUEUE's pages to their
    /// append, so ENQUEUEs land in the order they came.
    pub durable_gate: Arc<tokio::sync::Mutex<()>>,
    /// Buffers whose commit markers must go (deleted buffers of a task
    /// under `always`); the manager collects them.
    pub released_markers: Vec<u64>,
}

/// A commit marker to write: a finished buffer of a task under `always`.
#[derive(Debug)]
pub struct MarkerPlan {
    pub task_id: String,
    pub buffer_id: u64,
    pub end_token: u64,
    pub objects: Vec<Arc<binx_spool::SpooledObject>>,
}

/// Which page log of a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LogId {
    Shared,
    Buffer(u64),
}

impl Task {
    pub fn new(
        kind: BufferKind,
        fixed_count: Option<u64>,
        spool_policy: SpoolPolicy,
        now: Instant,
    ) -> Self {
        Task {
            kind,
            fixed_count,
            spool_policy,
            buffers_closed: fixed_count.is_some(),
            input_finished: false,
            memory: 0,
            buffers: BTreeMap::new(),
            shared: PageLog::default(),
            last_activity: now,
            durable_gate: Arc::new(tokio::sync::Mutex::new(())),
            released_markers: Vec::new(),
        }
    }

    /// The buffer, created if the task may still gain it. A buffer first seen
    /// after an open-ended buffer set closed is born finished and empty. One
    /// of a fixed set first seen after the input finished is born finished:
    /// a BROADCAST one still sees every page (they are held until every
    /// buffer of the set has read them), the others have none.
    pub fn buffer_mut(&mut self, id: u64, now: Instant) -> &mut Buffer {
        let closed_late = self.buffers_closed && self.fixed_count.is_none();
        let end_if_finished = match self.kind {
            BufferKind::Broadcast if !closed_late => self.shared.next(),
            _ => 0,
        };
        let born_finished = closed_late || self.input_finished;
        self.buffers.entry(id).or_insert_with(|| {
            let mut buffer = Buffer::new(now);
            if born_finished {
                buffer.end = Some(end_if_finished);
            }
            buffer
        })
    }

    /// Token after the buffer's last page, if it is known yet.
    fn end_of(&self, buffer: &Buffer) -> Option<u64> {
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

    /// Sizes of the pages of buffer `id` held from `token` on, changing
    /// nothing (no acknowledgement, no hand-out).
    pub fn peek_sizes(&self, id: u64, token: u64) -> Vec<u64> {
        let Some(buffer) = self.buffers.get(&id) else {
            return Vec::new();
        };
        let limit = self.end_of(buffer).unwrap_or(u64::MAX);
        match self.kind {
            BufferKind::Broadcast => self.shared.sizes(token, limit),
            _ => buffer.log.sizes(token, limit),
        }
    }

    /// Acknowledges every page of buffer `id` below `token` (a token at or
    /// below the mark is harmless); returns bytes freed.
    pub fn ack(&mut self, id: u64, token: u64) -> Result<u64, TokenError> {
        let kind = self.kind;
        let shared_next = self.shared.next();
        let Some(buffer) = self.buffers.get_mut(&id) else {
            return if token == 0 {
                Ok(0)
            } else {
                Err(TokenError::BeyondNext { next: 0 })
            };
        };
        let freed = if kind == BufferKind::Broadcast {
            let next = buffer.end.unwrap_or(shared_next);
            if token > next {
                return Err(TokenError::BeyondNext { next });
            }
            buffer.cursor = buffer.cursor.max(token);
            self.release_broadcast()
        } else {
            let next = buffer.log.next();
            if token > next {
                return Err(TokenError::BeyondNext { next });
            }
            buffer.log.ack(token)
        };
        self.memory -= freed;
        Ok(freed)
    }

    /// Acknowledges every page below `token` for buffer `id` and reads from
    /// `token` on: pages (at most `max_bytes` but at least one), or only
    /// their sizes. A token below the acknowledged mark is refused.
    pub fn read(
        &mut self,
        id: u64,
        token: u64,
        max_bytes: u64,
        sizes_only: bool,
        whole_objects: bool,
    ) -> Result<Read, TokenError> {
        let mark = match self.buffers.get(&id) {
            Some(b) if self.kind == BufferKind::Broadcast => b.cursor,
            Some(b) => b.log.base(),
            None => 0,
        };
        if token < mark {
            return Err(TokenError::BelowMark { mark });
        }
        let freed = self.ack(id, token)?;
        let Some(buffer) = self.buffers.get_mut(&id) else {
            return Ok(Read::complete_empty(freed));
        };
        let hand_out = self.kind == BufferKind::Arbitrary
            && !sizes_only
            && buffer.end.is_none()
            && token == buffer.log.next();
        if hand_out {
            // Whoever asks first gets the next unassigned pages.
            let mut total = 0u64;
            while let Some(size) = self.shared.front_len() {
                if total > 0 && total + size > max_bytes {
                    break;
                }
                let Some(page) = self.shared.pop_front() else {
                    break;
                };
                total += size;
                buffer.log.push(page);
            }
        }
        let Some(buffer) = self.buffers.get(&id) else {
            return Ok(Read::complete_empty(freed));
        };
        let end = self.end_of(buffer);
        let source = match self.kind {
            BufferKind::Broadcast => &self.shared,
            _ => &buffer.log,
        };
        let limit = end.unwrap_or(u64::MAX);
        if sizes_only {
            let mut sizes = source.sizes(token, limit);
            if sizes.is_empty() && self.kind == BufferKind::Arbitrary && buffer.end.is_none() {
                sizes = self.shared.sizes(self.shared.base(), u64::MAX);
            }
            return Ok(Read {
                pages: Vec::new(),
                sizes,
                complete: end == Some(token),
                freed,
            });
        }
        let whole_objects = whole_objects && self.kind != BufferKind::Arbitrary;
        let pages = source.read(token, limit, max_bytes, whole_objects);
        let complete = end == Some(token + pages.len() as u64);
        Ok(Read {
            pages,
            sizes: Vec::new(),
            complete,
            freed,
        })
    }

    /// BROADCAST: frees pages every buffer has acknowledged, once no buffer
    /// can be added any more. Returns bytes freed (the caller updates memory).
    fn release_broadcast(&mut self) -> u64 {
        if !self.buffers_closed {
            return 0;
        }
        if let Some(count) = self.fixed_count
            && (self.buffers.len() as u64) < count
        {
            return 0;
        }
        let mark = self
            .buffers
            .values()
            .map(|b| if b.deleted { u64::MAX } else { b.cursor })
            .min()
            .unwrap_or(u64::MAX);
        self.shared.ack(mark)
    }

    /// Appends pages for buffer `id` (ignored for BROADCAST and ARBITRARY);
    /// returns how many bytes are now held (pages for a deleted buffer are
    /// dropped and count zero).
    pub fn append(&mut self, id: u64, pages: Vec<Bytes>, now: Instant) -> u64 {
        self.append_pages(
            id,
            pages.into_iter().map(|p| Page::in_memory(p, now)).collect(),
            now,
        )
    }

    /// Appends pages that may live in storage; returns the memory they take.
    pub fn append_pages(&mut self, id: u64, pages: Vec<Page>, now: Instant) -> u64 {
        let mut added = 0;
        match self.kind {
            BufferKind::Partitioned => {
                let buffer = self.buffer_mut(id, now);
                if buffer.deleted {
                    return 0;
                }
                for page in pages {
                    added += buffer.log.push(page);
                }
                buffer.notify.notify_waiters();
            }
            BufferKind::Broadcast | BufferKind::Arbitrary => {
                for page in pages {
                    added += self.shared.push(page);
                }
                self.notify_all();
            }
        }
        self.memory += added;
        added
    }

    /// Token the next page appended for buffer `id` gets, in the log it
    /// goes to (for BROADCAST and ARBITRARY, the task's shared log).
    pub fn next_append_token(&self, id: u64) -> u64 {
        match self.kind {
            BufferKind::Partitioned => self.buffers.get(&id).map_or(0, |b| b.log.next()),
            _ => self.shared.next(),
        }
    }

    fn log_mut(&mut self, log: LogId) -> Option<&mut PageLog> {
        match log {
            LogId::Shared => Some(&mut self.shared),
            LogId::Buffer(id) => self.buffers.get_mut(&id).map(|b| &mut b.log),
        }
    }

    /// Every page log of the task.
    pub fn log_ids(&self) -> impl Iterator<Item = LogId> + '_ {
        std::iter::once(LogId::Shared).chain(self.buffers.keys().map(|&id| LogId::Buffer(id)))
    }

    /// The log with the most spillable memory, and that many bytes.
    pub fn fullest_log(&self) -> Option<(LogId, u64)> {
        std::iter::once((LogId::Shared, self.shared.spillable_bytes()))
            .chain(
                self.buffers
                    .iter()
                    .map(|(&id, b)| (LogId::Buffer(id), b.log.spillable_bytes())),
            )
            .filter(|&(_, bytes)| bytes > 0)
            .max_by_key(|&(_, bytes)| bytes)
    }

    /// Takes a run of memory-only pages of `log` to write to storage.
    pub fn take_spill_run(
        &mut self,
        log: LogId,
        target: u64,
        grown: u64,
        older_than: Option<Instant>,
    ) -> Option<SpillRun> {
        let log = self.log_mut(log)?;
        let target = if log.spilled_segments == 0 {
            target
        } else {
            grown
        };
        let run = log.take_spill_run(target, older_than)?;
        log.spilled_segments += 1;
        Some(run)
    }

    /// Ends a spill (see `PageLog::finish_spill`); returns the memory freed.
    pub fn finish_spill(
        &mut self,
        log: LogId,
        first_token: u64,
        count: usize,
        object: Option<&Arc<binx_spool::SpooledObject>>,
    ) -> u64 {
        let freed = self
            .log_mut(log)
            .map_or(0, |l| l.finish_spill(first_token, count, object));
        self.memory -= freed;
        freed
    }

    /// Whether ENQUEUE may still add pages for buffer `id`.
    pub fn accepts_pages(&self, id: u64) -> bool {
        if self.input_finished {
            return false;
        }
        match self.kind {
            BufferKind::Partitioned => self
                .buffers
                .get(&id)
                .is_none_or(|b| b.deleted || b.end.is_none()),
            _ => true,
        }
    }

    /// NO_MORE_PAGES for one buffer, or (`None`) for the whole task.
    pub fn finish(&mut self, id: Option<u64>, now: Instant) {
        match id {
            None => {
                self.input_finished = true;
                self.buffers_closed = true;
                let shared_next = self.shared.next();
                let kind = self.kind;
                for buffer in self.buffers.values_mut() {
                    if buffer.end.is_none() {
                        buffer.end = match kind {
                            BufferKind::Partitioned => Some(buffer.log.next()),
                            BufferKind::Broadcast => Some(shared_next),
                            // Known once the unassigned pages are handed out.
                            BufferKind::Arbitrary => None,
                        };
                    }
                }
                self.notify_all();
            }
            Some(id) => {
                let shared_next = self.shared.next();
                let kind = self.kind;
                let buffer = self.buffer_mut(id, now);
                if buffer.end.is_none() {
                    buffer.end = Some(match kind {
                        BufferKind::Broadcast => shared_next,
                        _ => buffer.log.next(),
                    });
                }
                buffer.notify.notify_waiters();
            }
        }
    }

    /// Commit markers for the finished buffers among `ids` (all buffers
    /// when `None`: the fixed set, or those that exist). PARTITIONED and
    /// BROADCAST only: ARBITRARY pages get their buffer when read.
    pub fn commit_plans(
        &mut self,
        task_id: &str,
        ids: Option<u64>,
        now: Instant,
    ) -> Vec<MarkerPlan> {
        if self.kind == BufferKind::Arbitrary {
            return Vec::new();
        }
        let ids: Vec<u64> = match (ids, self.fixed_count) {
            (Some(id), _) => vec![id],
            (None, Some(count)) => (0..count).collect(),
            (None, None) => self.buffers.keys().copied().collect(),
        };
        let shared_objects = (self.kind == BufferKind::Broadcast).then(|| self.shared.objects());
        let mut plans = Vec::new();
        for id in ids {
            let buffer = self.buffer_mut(id, now);
            let Some(end) = buffer.end.filter(|_| !buffer.deleted) else {
                continue;
            };
            buffer.committed = true;
            let objects = match &shared_objects {
                Some(objects) => objects.clone(),
                None => buffer.log.objects(),
            };
            plans.push(MarkerPlan {
                task_id: task_id.to_string(),
                buffer_id: id,
                end_token: end,
                objects,
            });
        }
        plans
    }

    /// Draining: the logs whose pages a consumer could finish from storage
    /// once they are spooled and committed. PARTITIONED: finished buffers
    /// without a marker yet; BROADCAST: the shared log once the input is
    /// finished. ARBITRARY gets no marker (see `commit_plans`).
    pub fn committable_logs(&self) -> Vec<LogId> {
        match self.kind {
            BufferKind::Partitioned => self
                .buffers
                .iter()
                .filter(|(_, b)| b.end.is_some() && !b.deleted && !b.committed)
                .map(|(&id, _)| LogId::Buffer(id))
                .collect(),
            BufferKind::Broadcast if self.input_finished => vec![LogId::Shared],
            _ => Vec::new(),
        }
    }

    /// Draining: commit markers for the buffers of `committable_logs`
    /// whose pages are all in storage now.
    pub fn drain_commit_plans(&mut self, task_id: &str, now: Instant) -> Vec<MarkerPlan> {
        let mut plans = Vec::new();
        for log in self.committable_logs() {
            match log {
                LogId::Buffer(id) if self.buffers.get(&id).is_some_and(|b| b.log.all_spooled()) => {
                    plans.extend(self.commit_plans(task_id, Some(id), now));
                }
                // As a task-wide NO_MORE_PAGES under `always` does: every
                // buffer of the set, also those no consumer has asked for yet.
                LogId::Shared if self.shared.all_spooled() => {
                    plans.extend(self.commit_plans(task_id, None, now));
                }
                _ => {}
            }
        }
        plans
    }

    /// Frees buffer `id` for good; returns bytes freed.
    pub fn delete(&mut self, id: u64, now: Instant) -> u64 {
        if std::mem::take(&mut self.buffer_mut(id, now).committed) {
            self.released_markers.push(id);
        }
        let buffer = self.buffer_mut(id, now);
        let mut freed = buffer.log.clear();
        if buffer.end.is_none() {
            buffer.end = Some(buffer.log.next());
        }
        buffer.deleted = true;
        buffer.notify.notify_waiters();
        if self.kind == BufferKind::Broadcast {
            freed += self.release_broadcast();
        }
        self.memory -= freed;
        freed
    }

    /// Frees every page; returns bytes freed.
    pub fn clear(&mut self) -> u64 {
        let mut freed = self.shared.clear();
        for (&id, buffer) in self.buffers.iter_mut() {
            freed += buffer.log.clear();
            if std::mem::take(&mut buffer.committed) {
                self.released_markers.push(id);
            }
        }
        self.notify_all();
        self.memory -= freed;
        freed
    }

    /// Every buffer is deleted and no buffer can be added: the task is over.
    pub fn is_done(&self) -> bool {
        if !self.buffers_closed {
            return false;
        }
        if let Some(count) = self.fixed_count
            && (self.buffers.len() as u64) < count
        {
            return false;
        }
        self.buffers.values().all(|b| b.deleted)
    }

    pub fn pages_held(&self) -> u64 {
        self.shared.len() as u64
            + self
                .buffers
                .values()
                .map(|b| b.log.len() as u64)
                .sum::<u64>()
    }

    pub fn notify_all(&self) {
        for buffer in self.buffers.values() {
            buffer.notify.notify_waiters();
        }
    }
}
