//! The buffer manager: every exchange request applied to plain state, with no
//! I/O. A request either gets its reply now or says what to wait on; the
//! async layer (`crate::exchange`) does the waiting and asks again.

mod page_log;
mod policy;
mod snapshot;
mod stats;
mod task;
mod tombstones;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use binx_proto::{
    ALL_BUFFERS, BinReply, BinRequest, BufferKind, MessageType, OutFrame, Segment, Status,
    split_pages,
};
use binx_spool::SpooledObject;
use bytes::Bytes;
use tokio::sync::Notify;

use page_log::Page;
pub use page_log::PageRef;
pub use policy::SpoolPolicy;
pub use snapshot::{BufferSnapshot, BufferState, TaskSnapshot};
pub use stats::ManagerStats;
pub use task::MarkerPlan;
use task::{LogId, Task, TokenError};
use tombstones::{Gone, Tombstones};

/// A reply frame: header plus page bodies.
pub type Reply = OutFrame<BinReply>;

/// Limits and defaults of the buffer manager.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Bytes of pages all tasks together may hold.
    pub memory_limit: u64,
    /// Bytes of pages one task may hold.
    pub task_memory_limit: u64,
    /// Cap on any request's `max_wait_micros`.
    pub max_wait: Duration,
    /// Reply size when a DATA asks with `max_size_bytes` = 0.
    pub default_reply_size: u64,
    /// A buffer no consumer polled for this long is dropped.
    pub abandon_after: Duration,
    /// Buffers one task may have.
    pub max_buffers_per_task: u64,
    /// Pages one ENQUEUE may carry: each page has bookkeeping beside its
    /// bytes, so a frame of tiny pages must not become millions of them.
    pub max_pages_per_enqueue: usize,
    /// Spool policy of tasks that do not name one.
    pub default_spool_policy: SpoolPolicy,
    /// Ended tasks remembered (so late consumers see "complete" or the abort reason).
    pub max_ended_tasks: usize,
    /// A spool store is configured: policies other than `off` are allowed.
    pub spool_enabled: bool,
    /// Pages of one log spilled together aim at this size first ...
    pub spill_target_bytes: u64,
    /// ... and at this one after the log's first spill.
    pub spill_max_bytes: u64,
    /// Policy `overflow`: pages held longer than this spill even with room.
    pub spill_after: Duration,
    /// Why policy `always` is refused, when the spool cannot commit buffers.
    pub always_refusal: Option<String>,
    /// The codec of segments, when the spool hands whole segments to
    /// clients that accept them (presigned URLs); `None` when every spooled
    /// page is served inline.
    pub spooled_replies: Option<&'static str>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig {
            memory_limit: 1 << 30,
            task_memory_limit: 256 << 20,
            max_wait: Duration::from_secs(10),
            default_reply_size: 1 << 20,
            abandon_after: Duration::from_secs(600),
            max_buffers_per_task: 65_536,
            max_pages_per_enqueue: 65_536,
            default_spool_policy: SpoolPolicy::Off,
            max_ended_tasks: 100_000,
            spool_enabled: false,
            spill_target_bytes: 8 << 20,
            spill_max_bytes: 16 << 20,
            spill_after: Duration::from_secs(30),
            always_refusal: None,
            spooled_replies: None,
        }
    }
}

/// What a request came to.
#[derive(Debug)]
pub enum Outcome {
    /// The reply to send.
    Reply(Reply),
    /// Nothing to say yet: wait on this (up to the request's deadline) and ask again.
    Wait(Arc<Notify>),
    /// A DATA reply with pages in storage: the async layer reads them (or
    /// presigns URLs) and sends the reply.
    Fetch(PendingReply),
    /// An ENQUEUE for a task under policy `always`: its pages must be
    /// written to storage first (`plan_durable`, then `append_durable`),
    /// holding this gate so ENQUEUEs of the task land in order.
    Durable(Arc<tokio::sync::Mutex<()>>),
    /// A NO_MORE_PAGES under policy `always`, applied: write these commit
    /// markers, then reply OK.
    Commit(Vec<MarkerPlan>),
}

/// A DATA reply whose pages are not all in memory.
#[derive(Debug)]
pub struct PendingReply {
    /// The reply header, all but its segments.
    pub header: BinReply,
    pub pages: Vec<PageRef>,
    /// The client reads spooled segments itself (`accept_spooled`).
    pub accept_spooled: bool,
    pub accept_encodings: Vec<String>,
    /// Object tokens equal buffer tokens (not ARBITRARY): whole objects may
    /// be handed to the client.
    pub objects_align: bool,
}

/// Pages of one log to write to storage (policy `overflow`).
#[derive(Debug)]
pub struct SpillJob {
    pub task_id: String,
    log: LogId,
    pub first_token: u64,
    pub pages: Vec<Bytes>,
    pub bytes: u64,
}

/// An ENQUEUE's pages to write before they are appended (policy `always`).
#[derive(Debug)]
pub struct DurablePlan {
    /// Token the first page will get in the log it goes to.
    pub first_token: u64,
    pub pages: Vec<Bytes>,
}

/// Longest task id accepted.
pub const MAX_TASK_ID_LEN: usize = 256;

/// Checks that a task id is safe to put in logs and storage keys: 1 to 256
/// characters of `A-Z a-z 0-9 . _ - :`.
pub fn validate_task_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("task_id is empty".into());
    }
    if id.len() > MAX_TASK_ID_LEN {
        return Err(format!(
            "task_id is {} bytes long; the limit is {MAX_TASK_ID_LEN}",
            id.len()
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':')))
    {
        return Err(format!(
            "task_id {:?} contains {c:?}; allowed are A-Z, a-z, 0-9, '.', '_', '-' and ':'",
            id.escape_debug().to_string()
        ));
    }
    Ok(())
}

/// All tasks of one daemon and the memory they hold.
#[derive(Debug)]
pub struct BufferManager {
    config: ManagerConfig,
    tasks: HashMap<String, Task>,
    ended: Tombstones,
    memory_used: u64,
    /// Woken when a task opens or aborts (consumers may start before producers).
    task_changed: Arc<Notify>,
    /// Woken when memory is freed (producers wait for room).
    room: Arc<Notify>,
    stats: ManagerStats,
    /// Set when the daemon is stopping: no new task is accepted.
    draining: bool,
    /// Replies by request type and status; the last row and column count
    /// unknown numbers.
    replies: [[u64; STATUSES + 1]; REQUEST_TYPES + 1],
    /// An ENQUEUE of a task under `overflow` is waiting for this many bytes
    /// (of that task, when its own limit is what binds).
    spill_wanted: Option<(Option<String>, u64)>,
    /// Bytes being written by spill jobs now.
    spilling_bytes: u64,
    /// Woken when a spill is wanted.
    spill_wake: Arc<Notify>,
    /// Commit markers to delete: (task, buffer).
    released_markers: Vec<(String, u64)>,
}

/// Request types are numbered below this (PROTOCOL.md section 4).
const REQUEST_TYPES: usize = 20;
/// Statuses are numbered below this.
const STATUSES: usize = 8;

impl BufferManager {
    pub fn new(config: ManagerConfig) -> Self {
        let stats = ManagerStats {
            memory_limit: config.memory_limit,
            task_memory_limit: config.task_memory_limit,
            ..Default::default()
        };
        BufferManager {
            ended: Tombstones::new(config.max_ended_tasks, config.abandon_after),
            config,
            tasks: HashMap::new(),
            memory_used: 0,
            task_changed: Arc::new(Notify::new()),
            room: Arc::new(Notify::new()),
            stats,
            draining: false,
            replies: [[0; STATUSES + 1]; REQUEST_TYPES + 1],
            spill_wanted: None,
            spilling_bytes: 0,
            spill_wake: Arc::new(Notify::new()),
            released_markers: Vec::new(),
        }
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// Bytes of pages held now.
    pub fn memory_used(&self) -> u64 {
        self.memory_used
    }

    /// How long a request may wait: its own `max_wait_micros`, capped by config.
    pub fn wait_budget(&self, request: &BinRequest) -> Duration {
        Duration::from_micros(request.max_wait_micros).min(self.config.max_wait)
    }

    /// Applies one request. `may_wait` is false once the request's wait is
    /// used up: then a request that would wait gets its final reply
    /// (NO_DATA for DATA, BUSY for ENQUEUE).
    pub fn handle(
        &mut self,
        request: &BinRequest,
        body: &Bytes,
        now: Instant,
        may_wait: bool,
    ) -> Outcome {
        let outcome = match request.message_type() {
            Ok(MessageType::Data) => self.data(request, now, may_wait),
            Ok(MessageType::Ack) => Outcome::Reply(self.ack(request, now)),
            Ok(MessageType::Delete) => Outcome::Reply(self.delete(request, now)),
            Ok(MessageType::OpenTask) => Outcome::Reply(self.open_task(request, now)),
            Ok(MessageType::Enqueue) => self.enqueue(request, body, now, may_wait),
            Ok(MessageType::NoMorePages) => self.no_more_pages(request, now),
            Ok(MessageType::AbortTask) => Outcome::Reply(self.abort_task(request)),
            Ok(MessageType::Ping) | Ok(MessageType::Hello) => {
                Outcome::Reply(Reply::new(BinReply::to(request, Status::Ok)))
            }
            // The connection answers it; the buffer manager has no part in it.
            Ok(MessageType::ShmAttach) => Outcome::Reply(bad(
                request,
                "SHM_ATTACH is answered by the connection, not the buffer manager",
            )),
            Ok(MessageType::Unspecified) | Err(_) => Outcome::Reply(bad(
                request,
                format!("unknown message type {}", request.r#type),
            )),
        };
        if let Outcome::Reply(reply) = &outcome {
            self.record_reply(request, &reply.header);
        }
        outcome
    }

    /// Counts a reply by request type and status (replies made outside the
    /// manager, such as HELLO, are recorded through this too). A fixed
    /// table, so counting allocates nothing on the request path.
    pub fn record_reply(&mut self, request: &BinRequest, reply: &BinReply) {
        let kind = usize::try_from(request.r#type)
            .ok()
            .filter(|&k| k < REQUEST_TYPES)
            .unwrap_or(REQUEST_TYPES);
        let status = usize::try_from(reply.status)
            .ok()
            .filter(|&s| s < STATUSES)
            .unwrap_or(STATUSES);
        self.replies[kind][status] += 1;
    }

    /// The reply counts as `"DATA OK"` and the like.
    fn reply_counts(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (kind, row) in self.replies.iter().enumerate() {
            for (status, &n) in row.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let kind = i32::try_from(kind)
                    .ok()
                    .and_then(|k| MessageType::try_from(k).ok())
                    .map_or("UNKNOWN", MessageType::name);
                let status = i32::try_from(status)
                    .ok()
                    .and_then(|s| Status::try_from(s).ok())
                    .map_or("UNKNOWN", Status::name);
                *out.entry(format!("{kind} {status}")).or_insert(0) += n;
            }
        }
        out
    }

    fn release(&mut self, freed: u64) {
        if freed > 0 {
            self.memory_used -= freed;
            self.room.notify_waiters();
        }
    }

    fn data(&mut self, request: &BinRequest, now: Instant, may_wait: bool) -> Outcome {
        let (task_id, buffer_id, token) = (&request.task_id, request.buffer_id, request.page_token);
        if let Err(e) = validate_task_id(task_id) {
            return Outcome::Reply(bad(request, e));
        }
        let max_bytes = match request.max_size_bytes {
            0 => self.config.default_reply_size,
            n => n,
        };
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Outcome::Reply(match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => aborted(request, reason),
                Some(Gone::Finished) => complete_at(request, token),
                None if may_wait => return Outcome::Wait(self.task_changed.clone()),
                None => no_data(request),
            });
        };
        if let Err(e) = check_buffer_id(task, task_id, buffer_id, &self.config) {
            return Outcome::Reply(bad(request, e));
        }
        if !task.buffers.contains_key(&buffer_id) && token > 0 {
            return Outcome::Reply(bad(
                request,
                format!(
                    "DATA for buffer {buffer_id} of task {task_id} at token {token}, but that buffer has no page yet (expected token 0)"
                ),
            ));
        }
        let buffer = task.buffer_mut(buffer_id, now);
        buffer.last_poll = now;
        if buffer.deleted {
            return Outcome::Reply(complete_at(request, token));
        }
        let notify = buffer.notify.clone();
        let kind = task.kind;
        // Whole objects count once against max_size_bytes only when they go
        // out as URLs; pages served inline keep to it.
        let whole_objects = request.accept_spooled
            && self.config.spooled_replies.is_some_and(|codec| {
                codec == "none" || request.accept_encodings.iter().any(|e| e == codec)
            });
        let read = match task.read(
            buffer_id,
            token,
            max_bytes,
            request.get_data_size,
            whole_objects,
        ) {
            Ok(read) => read,
            Err(e) => {
                return Outcome::Reply(bad(request, token_error(e, task_id, buffer_id, token)));
            }
        };
        self.release(read.freed);
        if read.pages.is_empty() && read.sizes.is_empty() && !read.complete {
            return if may_wait {
                Outcome::Wait(notify)
            } else {
                Outcome::Reply(no_data(request))
            };
        }
        let count = read.pages.len() as u64;
        let mut header = BinReply::to(request, Status::Ok);
        header.page_token = token;
        header.page_next_token = token + count;
        header.buffer_complete = read.complete;
        header.remaining_bytes = read.sizes;
        if count == 0 {
            return Outcome::Reply(Reply::new(header));
        }
        let sizes: Vec<u64> = read.pages.iter().map(PageRef::size).collect();
        self.stats.pages_served += count;
        self.stats.bytes_served += sizes.iter().sum::<u64>();
        if read.pages.iter().all(|p| matches!(p, PageRef::Memory(_))) {
            header.segments = vec![Segment::inline(token, sizes)];
            let body = read
                .pages
                .into_iter()
                .filter_map(|p| match p {
                    PageRef::Memory(b) => Some(b),
                    PageRef::Spooled { .. } => None,
                })
                .collect();
            return Outcome::Reply(OutFrame { header, body });
        }
        Outcome::Fetch(PendingReply {
            header,
            pages: read.pages,
            accept_spooled: request.accept_spooled,
            accept_encodings: request.accept_encodings.clone(),
            objects_align: kind != BufferKind::Arbitrary,
        })
    }

    fn ack(&mut self, request: &BinRequest, now: Instant) -> Reply {
        let (task_id, buffer_id, token) = (&request.task_id, request.buffer_id, request.page_token);
        if let Err(e) = validate_task_id(task_id) {
            return bad(request, e);
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            return if self.ended.get(task_id).is_some() {
                Reply::new(BinReply::to(request, Status::Ok))
            } else {
                bad(
                    request,
                    format!("ACK for task {task_id}, which this binxd does not know"),
                )
            };
        };
        if let Err(e) = check_buffer_id(task, task_id, buffer_id, &self.config) {
            return bad(request, e);
        }
        if let Some(buffer) = task.buffers.get_mut(&buffer_id) {
            if buffer.deleted {
                return Reply::new(BinReply::to(request, Status::Ok));
            }
            buffer.last_poll = now;
        }
        match task.ack(buffer_id, token) {
            Ok(freed) => {
                self.release(freed);
                Reply::new(BinReply::to(request, Status::Ok))
            }
            Err(e) => bad(request, token_error(e, task_id, buffer_id, token)),
        }
    }

    fn delete(&mut self, request: &BinRequest, now: Instant) -> Reply {
        let (task_id, buffer_id) = (&request.task_id, request.buffer_id);
        if let Err(e) = validate_task_id(task_id) {
            return bad(request, e);
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            // Unknown or ended: nothing is held, and DELETE is repeatable.
            return Reply::new(BinReply::to(request, Status::Ok));
        };
        if let Err(e) = check_buffer_id(task, task_id, buffer_id, &self.config) {
            return bad(request, e);
        }
        let freed = task.delete(buffer_id, now);
        for id in task.released_markers.drain(..) {
            self.released_markers.push((task_id.clone(), id));
        }
        let done = task.is_done();
        self.release(freed);
        if done {
            self.end_task(task_id, Gone::Finished, now);
        }
        Reply::new(BinReply::to(request, Status::Ok))
    }

    fn open_task(&mut self, request: &BinRequest, now: Instant) -> Reply {
        let task_id = &request.task_id;
        if let Err(e) = validate_task_id(task_id) {
            return bad(request, e);
        }
        let Ok(kind) = BufferKind::try_from(request.buffer_kind) else {
            return bad(
                request,
                format!(
                    "OPEN_TASK for task {task_id}: unknown buffer_kind {}",
                    request.buffer_kind
                ),
            );
        };
        let policy = if request.spool_policy.is_empty() {
            self.config.default_spool_policy
        } else {
            match request.spool_policy.parse::<SpoolPolicy>() {
                Ok(p) => p,
                Err(e) => return bad(request, format!("OPEN_TASK for task {task_id}: {e}")),
            }
        };
        if policy != SpoolPolicy::Off && !self.config.spool_enabled {
            return bad(
                request,
                format!(
                    "OPEN_TASK for task {task_id}: spool policy \"{policy}\" needs a spool store, and this binxd has none configured"
                ),
            );
        }
        if policy == SpoolPolicy::Always
            && let Some(why) = &self.config.always_refusal
        {
            return bad(request, format!("OPEN_TASK for task {task_id}: {why}"));
        }
        let fixed_count = match request.buffer_count {
            0 => None,
            n if n > self.config.max_buffers_per_task => {
                return bad(
                    request,
                    format!(
                        "OPEN_TASK for task {task_id}: buffer_count {n} exceeds the limit of {} buffers per task",
                        self.config.max_buffers_per_task
                    ),
                );
            }
            n => Some(n),
        };
        if self.draining && !self.tasks.contains_key(task_id) {
            return Reply::new(BinReply::error(
                request,
                Status::ServerError,
                format!(
                    "OPEN_TASK for task {task_id}: this binxd is draining before it stops and takes no new tasks"
                ),
            ));
        }
        if let Some(gone) = self.ended.get(task_id) {
            let how = match gone {
                Gone::Aborted(reason) => format!("was aborted ({reason})"),
                Gone::Finished => "already finished".to_string(),
            };
            return bad(
                request,
                format!("OPEN_TASK for task {task_id}: that task {how}; task ids cannot be reused"),
            );
        }
        if let Some(task) = self.tasks.get(task_id) {
            if task.kind == kind && task.fixed_count == fixed_count && task.spool_policy == policy {
                return Reply::new(BinReply::to(request, Status::Ok));
            }
            return bad(
                request,
                format!(
                    "OPEN_TASK for task {task_id}: already open as {:?} with buffer_count {} and spool policy {}",
                    task.kind,
                    task.fixed_count.unwrap_or(0),
                    task.spool_policy
                ),
            );
        }
        self.tasks
            .insert(task_id.clone(), Task::new(kind, fixed_count, policy, now));
        self.task_changed.notify_waiters();
        Reply::new(BinReply::to(request, Status::Ok))
    }

    fn enqueue(
        &mut self,
        request: &BinRequest,
        body: &Bytes,
        now: Instant,
        may_wait: bool,
    ) -> Outcome {
        let (task_id, buffer_id) = (&request.task_id, request.buffer_id);
        if let Err(e) = validate_task_id(task_id) {
            return Outcome::Reply(bad(request, e));
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Outcome::Reply(match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => aborted(request, reason),
                Some(Gone::Finished) => bad(
                    request,
                    format!("ENQUEUE for task {task_id}, which already finished"),
                ),
                None => bad(
                    request,
                    format!(
                        "ENQUEUE for task {task_id}, which was never opened (send OPEN_TASK first)"
                    ),
                ),
            });
        };
        if request.page_sizes.len() > self.config.max_pages_per_enqueue {
            return Outcome::Reply(bad(
                request,
                format!(
                    "ENQUEUE for buffer {buffer_id} of task {task_id} carries {} pages; the limit is {} (max_pages_per_enqueue): send them in several ENQUEUEs",
                    request.page_sizes.len(),
                    self.config.max_pages_per_enqueue
                ),
            ));
        }
        let pages = match split_pages(body, &request.page_sizes) {
            Ok(pages) => pages,
            Err(e) => {
                return Outcome::Reply(bad(
                    request,
                    format!("ENQUEUE for buffer {buffer_id} of task {task_id}: {e}"),
                ));
            }
        };
        if task.kind == BufferKind::Partitioned
            && let Err(e) = check_buffer_id(task, task_id, buffer_id, &self.config)
        {
            return Outcome::Reply(bad(request, e));
        }
        if !task.accepts_pages(buffer_id) {
            let what = if task.input_finished {
                format!("task {task_id} is finished")
            } else {
                format!("buffer {buffer_id} of task {task_id} is finished")
            };
            return Outcome::Reply(bad(
                request,
                format!("ENQUEUE refused: {what} (NO_MORE_PAGES was received)"),
            ));
        }
        if task.spool_policy == SpoolPolicy::Always {
            return Outcome::Durable(task.durable_gate.clone());
        }
        let size = body.len() as u64;
        let limit = self.config.task_memory_limit.min(self.config.memory_limit);
        if size > limit {
            return Outcome::Reply(bad(
                request,
                format!(
                    "ENQUEUE of {size} bytes for buffer {buffer_id} of task {task_id} can never fit the memory limit of {limit} bytes"
                ),
            ));
        }
        let fits = self.memory_used + size <= self.config.memory_limit
            && task.memory + size <= self.config.task_memory_limit;
        if !fits && task.spool_policy == SpoolPolicy::Overflow && may_wait {
            // Make room by writing this task's (or another overflow task's)
            // oldest pages to storage, rather than waiting for consumers.
            let task_room = self.config.task_memory_limit.saturating_sub(task.memory);
            let global_room = self.config.memory_limit.saturating_sub(self.memory_used);
            let own = task_room < global_room;
            let need = size.saturating_sub(task_room.min(global_room));
            self.spill_wanted = Some((own.then(|| task_id.clone()), need));
            self.spill_wake.notify_one();
            return Outcome::Wait(self.room.clone());
        }
        if !fits {
            self.spill_wanted = None;
            if may_wait {
                return Outcome::Wait(self.room.clone());
            }
            self.stats.busy_replies += 1;
            let mut header = BinReply::to(request, Status::Busy);
            header.error = format!(
                "no room for {size} bytes for buffer {buffer_id} of task {task_id}: the daemon holds {} of {} bytes, the task {} of {}; nothing was stored, retry later",
                self.memory_used,
                self.config.memory_limit,
                task.memory,
                self.config.task_memory_limit
            );
            return Outcome::Reply(Reply::new(header));
        }
        if task.spool_policy == SpoolPolicy::Overflow {
            self.spill_wanted = None;
        }
        let count = pages.len() as u64;
        let added = task.append(buffer_id, pages, now);
        task.last_activity = now;
        self.memory_used += added;
        self.stats.memory_high_water = self.stats.memory_high_water.max(self.memory_used);
        self.stats.pages_enqueued += count;
        self.stats.bytes_enqueued += size;
        Outcome::Reply(Reply::new(BinReply::to(request, Status::Ok)))
    }

    /// Policy `always`, step 1: checks an ENQUEUE and says where its pages
    /// will land, so they can be written to storage before they are appended.
    /// Call with the task's durable gate held.
    pub fn plan_durable(
        &mut self,
        request: &BinRequest,
        body: &Bytes,
    ) -> Result<DurablePlan, Box<Reply>> {
        let (task_id, buffer_id) = (&request.task_id, request.buffer_id);
        let pages = self.check_enqueue(request, body)?;
        let Some(task) = self.tasks.get(task_id) else {
            return Err(Box::new(bad(
                request,
                format!("ENQUEUE for task {task_id}, which is not open"),
            )));
        };
        Ok(DurablePlan {
            first_token: task.next_append_token(buffer_id),
            pages,
        })
    }

    /// Policy `always`, step 2: appends pages written to `objects` (in
    /// order, together holding every page of the plan). Pages stay in
    /// memory too when they fit, so consumers are served without a read.
    pub fn append_durable(
        &mut self,
        request: &BinRequest,
        plan: &DurablePlan,
        objects: &[Arc<SpooledObject>],
        now: Instant,
    ) -> Reply {
        let (task_id, buffer_id) = (&request.task_id, request.buffer_id);
        let body = Bytes::new();
        if let Err(reply) = self.check_enqueue(request, &body) {
            return *reply;
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            return bad(
                request,
                format!("ENQUEUE for task {task_id}, which is not open"),
            );
        };
        let next = task.next_append_token(buffer_id);
        if next != plan.first_token {
            return Reply::new(BinReply::error(
                request,
                Status::ServerError,
                format!(
                    "ENQUEUE for buffer {buffer_id} of task {task_id}: pages were written for token {} but the buffer moved to {next}; nothing was stored, retry",
                    plan.first_token
                ),
            ));
        }
        let size: u64 = plan.pages.iter().map(|p| p.len() as u64).sum();
        let keep = self.memory_used + size <= self.config.memory_limit
            && task.memory + size <= self.config.task_memory_limit;
        let mut pages = Vec::with_capacity(plan.pages.len());
        let mut bodies = plan.pages.iter();
        for object in objects {
            for (index, &page_size) in object.page_sizes.iter().enumerate() {
                let body = bodies.next().cloned();
                let Ok(index) = u32::try_from(index) else {
                    break;
                };
                pages.push(Page::durable(
                    page_size,
                    body.filter(|_| keep),
                    object.clone(),
                    index,
                    now,
                ));
            }
        }
        let count = pages.len() as u64;
        let added = task.append_pages(buffer_id, pages, now);
        task.last_activity = now;
        self.memory_used += added;
        self.stats.memory_high_water = self.stats.memory_high_water.max(self.memory_used);
        self.stats.pages_enqueued += count;
        self.stats.bytes_enqueued += size;
        Reply::new(BinReply::to(request, Status::Ok))
    }

    /// The checks every ENQUEUE passes; returns its pages.
    fn check_enqueue(&self, request: &BinRequest, body: &Bytes) -> Result<Vec<Bytes>, Box<Reply>> {
        let (task_id, buffer_id) = (&request.task_id, request.buffer_id);
        validate_task_id(task_id).map_err(|e| Box::new(bad(request, e)))?;
        let Some(task) = self.tasks.get(task_id) else {
            return Err(Box::new(match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => aborted(request, reason),
                _ => bad(
                    request,
                    format!("ENQUEUE for task {task_id}, which is not open"),
                ),
            }));
        };
        let pages = if body.is_empty() {
            Vec::new()
        } else {
            split_pages(body, &request.page_sizes).map_err(|e| {
                Box::new(bad(
                    request,
                    format!("ENQUEUE for buffer {buffer_id} of task {task_id}: {e}"),
                ))
            })?
        };
        if task.kind == BufferKind::Partitioned {
            check_buffer_id(task, task_id, buffer_id, &self.config)
                .map_err(|e| Box::new(bad(request, e)))?;
        }
        if !task.accepts_pages(buffer_id) {
            return Err(Box::new(bad(
                request,
                format!(
                    "ENQUEUE refused: buffer {buffer_id} of task {task_id} is finished (NO_MORE_PAGES was received)"
                ),
            )));
        }
        Ok(pages)
    }

    /// Woken when pages should be written to storage to make room.
    pub fn spill_wake(&self) -> Arc<Notify> {
        self.spill_wake.clone()
    }

    /// The next run of pages to write to storage under policy `overflow`:
    /// first to make room for a waiting ENQUEUE, then pages older than
    /// `spill_after`. The pages stay readable from memory until
    /// `finish_spill`.
    pub fn spill_job(&mut self, now: Instant) -> Option<SpillJob> {
        if !self.config.spool_enabled {
            return None;
        }
        let (target, grown) = (self.config.spill_target_bytes, self.config.spill_max_bytes);
        if let Some((own, need)) = &self.spill_wanted
            && self.spilling_bytes < *need
        {
            let chosen = match own {
                Some(task_id) => self
                    .tasks
                    .get(task_id)
                    .and_then(|t| t.fullest_log())
                    .map(|(log, _)| (task_id.clone(), log)),
                None => self
                    .tasks
                    .iter()
                    .filter(|(_, t)| t.spool_policy == SpoolPolicy::Overflow)
                    .filter_map(|(id, t)| t.fullest_log().map(|(log, bytes)| (id, log, bytes)))
                    .max_by_key(|&(_, _, bytes)| bytes)
                    .map(|(id, log, _)| (id.clone(), log)),
            };
            if let Some((task_id, log)) = chosen
                && let Some(job) = self.take_spill(&task_id, log, target, grown, None)
            {
                return Some(job);
            }
        }
        let older_than = now.checked_sub(self.config.spill_after)?;
        let candidates: Vec<(String, LogId)> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.spool_policy == SpoolPolicy::Overflow)
            .flat_map(|(id, t)| t.log_ids().map(move |log| (id.clone(), log)))
            .collect();
        candidates.into_iter().find_map(|(task_id, log)| {
            self.take_spill(&task_id, log, target, grown, Some(older_than))
        })
    }

    fn take_spill(
        &mut self,
        task_id: &str,
        log: LogId,
        target: u64,
        grown: u64,
        older_than: Option<Instant>,
    ) -> Option<SpillJob> {
        let run = self
            .tasks
            .get_mut(task_id)?
            .take_spill_run(log, target, grown, older_than)?;
        let bytes = run.pages.iter().map(|p| p.len() as u64).sum();
        self.spilling_bytes += bytes;
        Some(SpillJob {
            task_id: task_id.to_string(),
            log,
            first_token: run.first_token,
            pages: run.pages,
            bytes,
        })
    }

    /// Ends a spill: with the object written, the pages still held leave
    /// memory and point to it. Without (the write failed), they stay in
    /// memory and may be picked again.
    pub fn finish_spill(&mut self, job: &SpillJob, object: Option<&Arc<SpooledObject>>) {
        self.spilling_bytes = self.spilling_bytes.saturating_sub(job.bytes);
        if object.is_some() {
            self.stats.pages_spilled += job.pages.len() as u64;
        }
        let freed = match self.tasks.get_mut(&job.task_id) {
            Some(task) => task.finish_spill(job.log, job.first_token, job.pages.len(), object),
            None => 0,
        };
        self.release(freed);
    }

    fn no_more_pages(&mut self, request: &BinRequest, now: Instant) -> Outcome {
        let (task_id, buffer_id) = (&request.task_id, request.buffer_id);
        if let Err(e) = validate_task_id(task_id) {
            return Outcome::Reply(bad(request, e));
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Outcome::Reply(match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => aborted(request, reason),
                Some(Gone::Finished) => Reply::new(BinReply::to(request, Status::Ok)),
                None => bad(
                    request,
                    format!("NO_MORE_PAGES for task {task_id}, which was never opened"),
                ),
            });
        };
        let which = if buffer_id == ALL_BUFFERS {
            None
        } else {
            if let Err(e) = check_buffer_id(task, task_id, buffer_id, &self.config) {
                return Outcome::Reply(bad(request, e));
            }
            Some(buffer_id)
        };
        task.finish(which, now);
        task.last_activity = now;
        if task.is_done() {
            self.end_task(task_id, Gone::Finished, now);
            return Outcome::Reply(Reply::new(BinReply::to(request, Status::Ok)));
        }
        if task.spool_policy == SpoolPolicy::Always {
            let plans = task.commit_plans(task_id, which, now);
            if !plans.is_empty() {
                return Outcome::Commit(plans);
            }
        }
        Outcome::Reply(Reply::new(BinReply::to(request, Status::Ok)))
    }

    /// Commit markers whose buffers are gone, to delete from storage.
    pub fn take_released_markers(&mut self) -> Vec<(String, u64)> {
        std::mem::take(&mut self.released_markers)
    }

    fn abort_task(&mut self, request: &BinRequest) -> Reply {
        let task_id = &request.task_id;
        if let Err(e) = validate_task_id(task_id) {
            return bad(request, e);
        }
        self.abort(task_id, &request.reason, Instant::now());
        Reply::new(BinReply::to(request, Status::Ok))
    }

    /// Aborts a task (known or not yet opened: its consumers then see the
    /// reason); returns the bytes freed.
    pub fn abort(&mut self, task_id: &str, reason: &str, now: Instant) -> u64 {
        let reason = if reason.is_empty() {
            "no reason given".to_string()
        } else {
            reason.to_string()
        };
        tracing::info!(task = %task_id, %reason, "task aborted");
        self.stats.tasks_aborted += 1;
        let before = self.memory_used;
        self.end_task(task_id, Gone::Aborted(reason), now);
        before - self.memory_used
    }

    /// Whether a task is open (for operators who must not abort a typo).
    pub fn has_task(&self, task_id: &str) -> bool {
        self.tasks.contains_key(task_id)
    }

    /// Frees a task's pages and remembers how it ended.
    fn end_task(&mut self, task_id: &str, how: Gone, now: Instant) {
        if let Some(mut task) = self.tasks.remove(task_id) {
            let freed = task.clear();
            self.release(freed);
            for id in task.released_markers.drain(..) {
                self.released_markers.push((task_id.to_string(), id));
            }
        }
        self.ended.insert(task_id.to_string(), how, now);
        self.task_changed.notify_waiters();
    }

    /// Drops buffers no consumer polled for `abandon_after`, and tasks with
    /// nothing left; forgets ended tasks past their keep time. Returns the
    /// number of buffers dropped.
    pub fn sweep(&mut self, now: Instant) -> u64 {
        let abandon_after = self.config.abandon_after;
        let mut dropped = 0;
        let mut freed_total = 0;
        let mut finished = Vec::new();
        for (task_id, task) in &mut self.tasks {
            let stale: Vec<u64> = task
                .buffers
                .iter()
                .filter(|(_, b)| {
                    !b.deleted && now.saturating_duration_since(b.last_poll) >= abandon_after
                })
                .map(|(&id, _)| id)
                .collect();
            for buffer_id in stale {
                let freed = task.delete(buffer_id, now);
                for id in task.released_markers.drain(..) {
                    self.released_markers.push((task_id.clone(), id));
                }
                freed_total += freed;
                dropped += 1;
                tracing::warn!(
                    task = %task_id, buffer = buffer_id, freed_bytes = freed,
                    "dropping abandoned buffer: no consumer polled it for {abandon_after:?}"
                );
            }
            let idle = now.saturating_duration_since(task.last_activity) >= abandon_after;
            let nothing_left = task.buffers.values().all(|b| b.deleted);
            if task.is_done() || (idle && nothing_left) {
                finished.push(task_id.clone());
            }
        }
        self.release(freed_total);
        for task_id in finished {
            tracing::info!(task = %task_id, "task removed: every buffer is gone");
            self.end_task(&task_id, Gone::Finished, now);
        }
        self.ended.expire(now);
        self.stats.abandoned_buffers += dropped;
        dropped
    }

    /// Stops accepting new tasks (existing ones go on) while the daemon
    /// stops; false when a drain had already started.
    pub fn start_drain(&mut self) -> bool {
        !std::mem::replace(&mut self.draining, true)
    }

    /// Draining: the next run of pages held only in memory, of a finished
    /// buffer of a task under `overflow`, to write to storage so that its
    /// consumers can finish from there after this binxd is gone.
    pub fn drain_spill_job(&mut self) -> Option<SpillJob> {
        if !self.config.spool_enabled {
            return None;
        }
        let (target, grown) = (self.config.spill_target_bytes, self.config.spill_max_bytes);
        let candidates: Vec<(String, LogId)> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.spool_policy == SpoolPolicy::Overflow)
            .flat_map(|(id, t)| {
                t.committable_logs()
                    .into_iter()
                    .map(|log| (id.clone(), log))
            })
            .collect();
        candidates
            .into_iter()
            .find_map(|(task_id, log)| self.take_spill(&task_id, log, target, grown, None))
    }

    /// Draining: commit markers for the finished buffers under `overflow`
    /// whose pages are all in storage (see `drain_spill_job`).
    pub fn drain_commit_plans(&mut self, now: Instant) -> Vec<MarkerPlan> {
        self.tasks
            .iter_mut()
            .filter(|(_, t)| t.spool_policy == SpoolPolicy::Overflow)
            .flat_map(|(id, t)| t.drain_commit_plans(id, now))
            .collect()
    }

    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Pages held by all tasks: what stopping now would lose.
    pub fn pages_held(&self) -> u64 {
        self.tasks.values().map(Task::pages_held).sum()
    }

    /// A snapshot of counters and gauges.
    pub fn stats(&self) -> ManagerStats {
        let mut stats = self.stats.clone();
        stats.memory_used = self.memory_used;
        stats.tasks = self.tasks.len() as u64;
        stats.buffers = self.tasks.values().map(|t| t.buffers.len() as u64).sum();
        stats.pages_buffered = self.pages_held();
        stats.draining = self.draining;
        stats.requests = self.reply_counts();
        stats
    }

    /// Sizes of the pages of a buffer held from `token` on, without any of
    /// the effects of a DATA (for reply headers that report what remains).
    pub fn peek_sizes(&self, task_id: &str, buffer_id: u64, token: u64) -> Vec<u64> {
        self.tasks
            .get(task_id)
            .map(|t| t.peek_sizes(buffer_id, token))
            .unwrap_or_default()
    }

    /// Every open task whose id starts with `prefix`, by id, with its buffers.
    pub fn task_snapshots(&self, prefix: &str, now: Instant) -> Vec<TaskSnapshot> {
        let mut out: Vec<TaskSnapshot> = self
            .tasks
            .iter()
            .filter(|(id, _)| id.starts_with(prefix))
            .map(|(id, task)| TaskSnapshot::of(id, task, now))
            .collect();
        out.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        out
    }
}

fn check_buffer_id(
    task: &Task,
    task_id: &str,
    buffer_id: u64,
    config: &ManagerConfig,
) -> Result<(), String> {
    if let Some(count) = task.fixed_count {
        if buffer_id >= count {
            return Err(format!(
                "buffer_id {buffer_id} is at or above the buffer_count {count} of task {task_id}"
            ));
        }
    } else if !task.buffers.contains_key(&buffer_id)
        && task.buffers.len() as u64 >= config.max_buffers_per_task
    {
        return Err(format!(
            "task {task_id} already has {} buffers, the limit per task",
            config.max_buffers_per_task
        ));
    }
    Ok(())
}

fn token_error(e: TokenError, task_id: &str, buffer_id: u64, token: u64) -> String {
    match e {
        TokenError::BelowMark { mark } => format!(
            "token {token} of buffer {buffer_id} of task {task_id} is below its acknowledged mark {mark}: those pages were freed"
        ),
        TokenError::BeyondNext { next } => format!(
            "token {token} of buffer {buffer_id} of task {task_id} is beyond the next token to be produced ({next})"
        ),
    }
}

fn bad(request: &BinRequest, error: impl Into<String>) -> Reply {
    Reply::new(BinReply::error(request, Status::BadRequest, error))
}

fn aborted(request: &BinRequest, reason: &str) -> Reply {
    Reply::new(BinReply::error(
        request,
        Status::ServerError,
        format!("task {} was aborted: {reason}", request.task_id),
    ))
}

fn no_data(request: &BinRequest) -> Reply {
    let mut header = BinReply::to(request, Status::NoData);
    header.page_token = request.page_token;
    header.page_next_token = request.page_token;
    Reply::new(header)
}

fn complete_at(request: &BinRequest, token: u64) -> Reply {
    let mut header = BinReply::to(request, Status::Ok);
    header.page_token = token;
    header.page_next_token = token;
    header.buffer_complete = true;
    Reply::new(header)
}

#[cfg(test)]
mod tests;
