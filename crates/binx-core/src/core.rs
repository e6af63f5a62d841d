//! [`Core`]: every rule of the exchange applied to plain state.
//!
//! Requests go in with [`Core::handle`] and the time; a request is answered
//! at once ([`Handled::Reply`] or [`Handled::Plan`]) or later, as an
//! [`Event::Outcome`]. Whatever the core needs done outside comes out as
//! [`Event::Command`]s, and their completions come back through the
//! `*_written`, `*_deleted`, `*_read` and `forwarded` methods. The core
//! never reads a clock: [`Core::poll_timeout`] says when it next needs
//! [`Core::handle_timeout`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use binx_proto::{BinReply, BinRequest, BufferKind, Frame, MessageType, SpoolPolicy, Status};
use bytes::Bytes;

use crate::Reply;
use crate::config::{CoreConfig, SpoolRules};
use crate::data::{DataPlan, PlannedPage};
use crate::failover::{RemoteKey, RemoteState, RemoteWatch};
use crate::ids::{ConnId, LeaseId, OpId, Ticket};
use crate::markers::{MarkerEntry, MarkerState, Markers};
use crate::objects::{CommitMarker, Durability, ObjectId, ObjectMeta, Objects};
use crate::page_log::{Page, SLOT_BYTES, StoredReads};
use crate::request::{BufferKey, DataQuery, Op, Request};
use crate::snapshot::TaskSnapshot;
use crate::stats::{CoreStats, ReplyCount};
use crate::task::{BufferGone, LogId, Sink, Task, TokenError};
use crate::task_id::TaskId;
use crate::tombstones::{EarlyDeletes, Ended, Expiring, Gone, MAX_EARLY_DELETES_PER_TASK};

/// How long spilling pauses after a spill failed.
const SPILL_RETRY_AFTER: Duration = Duration::from_millis(500);
/// Pages (and remaining sizes) one reply lists at most, so its header stays
/// well within the 64 KiB header limit.
pub const MAX_REPLY_PAGES: usize = 8192;

/// Most page sizes a reply to a pipelined DATA lists in `following_sizes`:
/// enough to cover a whole next reply and the page after it.
pub const MAX_FOLLOWING_SIZES: usize = MAX_REPLY_PAGES + 1;

/// Most bytes `following_sizes` takes in a reply header: with the reply's
/// own page sizes (at most [`MAX_REPLY_PAGES`] of at most 5 bytes each)
/// the header stays below the 64 KiB header limit whatever the sizes.
pub const MAX_FOLLOWING_SIZES_BYTES: usize = 20 << 10;

/// A request body and the allocation it lies in.
#[derive(Clone, Debug, Default)]
pub struct Payload {
    /// The body's bytes.
    pub bytes: Bytes,
    /// (id, capacity) of the receive buffer the body is a slice of; `None`
    /// when the body is an allocation of its own.
    pub chunk: Option<(u64, u64)>,
}

impl Payload {
    /// No body (requests that carry none).
    pub fn empty() -> Self {
        Payload::default()
    }

    /// A body that is an allocation of its own.
    pub fn exact(bytes: Bytes) -> Self {
        Payload { bytes, chunk: None }
    }
}

/// What [`Core::handle`] did with a request.
#[derive(Debug)]
pub enum Handled {
    /// The reply, now.
    Reply(Reply),
    /// A DATA reply with pages to fetch from storage first; then
    /// [`DataPlan::assemble`] and [`Core::plan_finished`].
    Plan(DataPlan),
    /// The answer comes later as an [`Event::Outcome`] for the ticket.
    Pending,
}

/// The answer to a request that did not get one at once.
#[derive(Debug)]
pub enum Outcome {
    /// The reply.
    Reply(Reply),
    /// A DATA reply that needs pages from storage first (as [`Handled::Plan`]).
    Plan(DataPlan),
}

/// What the core wants done. An outcome (a reply header) is the larger
/// variant and the common one: boxing it would cost an allocation per reply.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Event {
    /// The answer to the parked request `ticket`.
    Outcome {
        /// The request it answers, as [`Core::handle`] was given it.
        ticket: Ticket,
        /// The answer.
        outcome: Outcome,
    },
    /// Work for the driver; its completion names `op`.
    Command {
        /// Names the work in its completion.
        op: OpId,
        /// The work.
        command: Command,
    },
}

/// Work for the drivers; each completes through the method named.
#[derive(Debug)]
pub enum Command {
    /// Write `pages` as one segment object ([`Core::segment_written`]).
    WriteSegment {
        /// The task whose pages these are (part of the object's name).
        task: TaskId,
        /// Token of the first page.
        first_token: u64,
        /// The pages, in token order.
        pages: Vec<Bytes>,
        /// Whether the write must be durable before it completes.
        durability: Durability,
    },
    /// Write a commit marker ([`Core::marker_written`]).
    WriteMarker(MarkerPlan),
    /// Delete an object nothing refers to ([`Core::object_deleted`]).
    DeleteObject(Arc<ObjectMeta>),
    /// Delete a commit marker ([`Core::marker_deleted`]).
    DeleteMarker {
        /// The marker's task.
        task: TaskId,
        /// The marker's buffer.
        buffer: u64,
    },
    /// Read a buffer's commit marker ([`Core::marker_read`]).
    ReadMarker {
        /// The marker's task.
        task: TaskId,
        /// The marker's buffer.
        buffer: u64,
    },
    /// A consumer finished a committed buffer from storage: delete its
    /// marker and the segments no other marker of its task lists
    /// ([`Core::released`]).
    ReleaseCommitted(Arc<CommitMarker>),
    /// Send `request` to the sidecar at `remote` ([`Core::forwarded`]).
    Forward {
        /// host:port of the remote sidecar.
        remote: String,
        /// The request to send, as the remote will read it.
        request: Box<BinRequest>,
    },
    /// Write a finished task's commit manifest, after its markers
    /// ([`Core::manifest_written`]).
    WriteManifest(ManifestPlan),
    /// Read a task's commit manifest for COMMITTED ([`Core::manifest_read`]).
    ReadManifest {
        /// The manifest's task.
        task: TaskId,
    },
    /// Delete a task's commit manifest ([`Core::manifest_deleted`]).
    DeleteManifest {
        /// The manifest's task.
        task: TaskId,
    },
}

/// A commit manifest to write: where each buffer of a finished task ends
/// and how many bytes its pages hold (index = buffer id). The driver adds
/// who wrote it (node name and advertised address), as for markers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestPlan {
    /// The finished task.
    pub task: TaskId,
    /// Per buffer (index = buffer id): its end token and its pages' bytes.
    pub buffers: Vec<(u64, u64)>,
}

/// A commit manifest as read back (and checked) by the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// The spool node name of the binxd that wrote it.
    pub node: String,
    /// host:port other sidecars reach that binxd under.
    pub endpoint: String,
    /// Per buffer: its end token and its pages' bytes.
    pub buffers: Vec<(u64, u64)>,
}

/// Why a manifest could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ManifestError {
    /// Storage did not answer now: retry (BUSY).
    Unavailable(String),
    /// It is there but fails its checks (SERVER_ERROR).
    Invalid(String),
}

/// A commit marker to write: a finished buffer and the objects with its pages.
#[derive(Clone, Debug)]
pub struct MarkerPlan {
    /// The buffer's task.
    pub task: TaskId,
    /// The finished buffer.
    pub buffer: u64,
    /// The token after the buffer's last page.
    pub end_token: u64,
    /// The segment objects that hold its pages, in token order.
    pub objects: Vec<Arc<ObjectMeta>>,
    /// The objects hold pages of other buffers too (BROADCAST).
    pub shared: bool,
}

/// A run of pages being written to storage to free memory.
#[derive(Debug)]
struct Spill {
    task: TaskId,
    log: LogId,
    first_token: u64,
    count: usize,
    bytes: u64,
}

#[derive(Debug)]
enum OpKind {
    Spill(Spill),
    Durable { ticket: Ticket, part: usize },
    Marker { key: (TaskId, u64) },
    MarkerDelete { key: (TaskId, u64) },
    ObjectDelete,
    ReadMarker { ticket: Ticket },
    Forward { ticket: Option<Ticket> },
    Release,
    Manifest { ticket: Option<Ticket> },
    ReadManifest { ticket: Ticket },
    ManifestDelete,
}

#[derive(Debug)]
enum ParkState {
    /// A DATA long-poll.
    DataWait,
    /// An ENQUEUE or NO_MORE_PAGES in its connection's queue.
    Queued { body: Payload },
    /// A durable ENQUEUE whose segments are being written.
    Writing {
        first_token: u64,
        pages: Vec<Bytes>,
        parts: Vec<Option<ObjectMeta>>,
        remaining: usize,
        failed: Option<String>,
        body_len: u64,
    },
    /// A NO_MORE_PAGES waiting for its commit markers.
    Committing {
        remaining: usize,
        failed: Option<String>,
    },
    /// A NO_MORE_PAGES of a `commit` task waiting for the finished pages
    /// to reach storage before its markers are written.
    Spooling,
    /// A task-wide NO_MORE_PAGES waiting for the task's commit manifest.
    WritingManifest,
    /// A COMMITTED waiting for the manifest to be read.
    ReadingManifest,
    /// A proxy request sent to its remote.
    Forwarding,
    /// A proxy request whose remote failed: its marker is being read;
    /// `fallback` is the reply if there is none.
    CheckingMarker { fallback: Reply },
}

#[derive(Debug)]
struct Parked {
    conn: ConnId,
    request: Request,
    state: ParkState,
    deadline: Option<Instant>,
    /// Counted as a backpressure wait already.
    waited: bool,
}

#[derive(Debug, Default)]
struct ConnState {
    /// ENQUEUE and NO_MORE_PAGES, applied in this order.
    queue: VecDeque<Ticket>,
    /// Requests of the connection the core holds.
    outstanding: usize,
}

/// Why a mutation did not finish now. A value returned and matched at
/// once: boxing its reply would cost an allocation per ENQUEUE.
#[allow(clippy::large_enum_variant)]
enum Step {
    Done(Reply),
    /// Waits for room (or the task's durable slot), up to its deadline.
    Blocked,
    /// Storage work is under way.
    Async,
}

/// The exchange's state and rules; see the module docs. Every map is
/// ordered, so the same inputs give the same outputs in the same order (the
/// simulation replays a seed exactly) and no key can be crafted to collide.
#[derive(Debug)]
pub struct Core {
    config: CoreConfig,
    tasks: BTreeMap<TaskId, Task>,
    ended: Ended,
    early: EarlyDeletes,
    objects: Objects,
    markers: Markers,
    remotes: RemoteWatch,
    memory_used: u64,
    pending_bytes: u64,
    parked: BTreeMap<Ticket, Parked>,
    deadlines: BTreeSet<(Instant, Ticket)>,
    data_waiters: BTreeMap<TaskId, BTreeMap<u64, BTreeSet<Ticket>>>,
    conns: BTreeMap<ConnId, ConnState>,
    /// Queue heads waiting for room, oldest first.
    blocked: BTreeSet<Ticket>,
    /// Blocked heads of `overflow` tasks: bytes they miss, and whether their
    /// own task's limit is what binds.
    room_wanted: BTreeMap<Ticket, (Option<TaskId>, u64)>,
    ops: BTreeMap<OpId, OpKind>,
    next_op: u64,
    next_seq: u64,
    next_chunk: u64,
    next_lease: u64,
    leases: BTreeMap<LeaseId, Vec<ObjectId>>,
    /// Replies being read from another node's commit marker, by lease.
    failover_leases: BTreeMap<LeaseId, RemoteKey>,
    events: VecDeque<Event>,
    /// The request `handle` is working on: its outcome is returned, not queued.
    current: Option<Ticket>,
    current_outcome: Option<Outcome>,
    dirty: Vec<(TaskId, Option<u64>)>,
    room_freed: bool,
    /// NO_MORE_PAGES of `commit` tasks waiting for their pages to spool.
    spooling: BTreeSet<Ticket>,
    /// Tasks each open connection produced for (see `Task::producers`).
    producer_conns: BTreeMap<ConnId, BTreeSet<TaskId>>,
    spills_in_flight: usize,
    spill_bytes_in_flight: u64,
    deletes_in_flight: usize,
    draining: bool,
    drain_spooling: bool,
    next_sweep: Option<Instant>,
    next_age_check: Option<Instant>,
    /// After a failed spill no spill starts before this (the store may be
    /// full or unreachable: retrying at once would spin).
    spill_retry_at: Option<Instant>,
    stats: CoreStats,
    replies: [[u64; STATUSES + 1]; REQUEST_TYPES + 1],
}

/// Request types are numbered below this (docs/PROTOCOL.md section 3): one past
/// the highest, so a new type gets its own row and never shares the row of
/// numbers outside the protocol.
const REQUEST_TYPES: usize = MessageType::Committed as usize + 1;
/// Statuses are numbered below this.
const STATUSES: usize = Status::Busy as usize + 1;

/// Chunk ids the core gives bodies it copied (the receive buffers' own ids
/// stay below).
const OWN_CHUNKS: u64 = 1 << 63;

impl Core {
    /// An empty exchange with these limits and policies.
    pub fn new(config: CoreConfig) -> Self {
        let stats = CoreStats {
            memory_limit: config.memory_limit,
            task_memory_limit: config.task_memory_limit,
            ..Default::default()
        };
        Core {
            ended: Expiring::new(config.max_tombstones, config.abandon_after),
            early: Expiring::new(config.max_tombstones, config.abandon_after),
            config,
            tasks: BTreeMap::new(),
            objects: Objects::default(),
            markers: Markers::default(),
            remotes: RemoteWatch::default(),
            memory_used: 0,
            pending_bytes: 0,
            parked: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            data_waiters: BTreeMap::new(),
            conns: BTreeMap::new(),
            blocked: BTreeSet::new(),
            room_wanted: BTreeMap::new(),
            ops: BTreeMap::new(),
            next_op: 0,
            next_seq: 0,
            next_chunk: 0,
            next_lease: 0,
            leases: BTreeMap::new(),
            failover_leases: BTreeMap::new(),
            events: VecDeque::new(),
            current: None,
            current_outcome: None,
            dirty: Vec::new(),
            room_freed: false,
            spooling: BTreeSet::new(),
            producer_conns: BTreeMap::new(),
            spills_in_flight: 0,
            spill_bytes_in_flight: 0,
            deletes_in_flight: 0,
            draining: false,
            drain_spooling: false,
            next_sweep: None,
            next_age_check: None,
            spill_retry_at: None,
            stats,
            replies: [[0; STATUSES + 1]; REQUEST_TYPES + 1],
        }
    }

    /// The limits and policies it was made with.
    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    fn spool(&self) -> Option<&SpoolRules> {
        self.config.spool.as_ref()
    }

    /// Bytes held for pages now.
    pub fn memory_used(&self) -> u64 {
        self.memory_used
    }

    /// Whether pages held and request bodies waiting together reach the
    /// memory limit: a connection then stops reading new requests until
    /// its own waiting ones are answered.
    pub fn memory_full(&self) -> bool {
        self.memory_used + self.pending_bytes >= self.config.memory_limit
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Core::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.deadlines.first().map(|(at, _)| *at),
            self.next_sweep,
            self.next_age_check,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn start_clock(&mut self, now: Instant) {
        if self.next_sweep.is_none() {
            self.next_sweep = Some(now + self.sweep_period());
        }
    }

    fn sweep_period(&self) -> Duration {
        (self.config.abandon_after / 4).clamp(Duration::from_millis(100), Duration::from_secs(30))
    }

    fn new_op(&mut self, kind: OpKind, command: Command) {
        self.next_op += 1;
        let op = OpId(self.next_op);
        self.ops.insert(op, kind);
        self.events.push_back(Event::Command { op, command });
    }

    /// Answers `ticket`: returned from `handle` when it is the request at
    /// hand, else queued as an event.
    fn emit(&mut self, ticket: Ticket, kind: MessageType, outcome: Outcome) {
        if let Outcome::Reply(reply) = &outcome {
            self.count_reply(kind, reply.header.status);
        }
        if self.current == Some(ticket) {
            self.current_outcome = Some(outcome);
        } else {
            self.events.push_back(Event::Outcome { ticket, outcome });
        }
    }

    fn count_reply(&mut self, kind: MessageType, status: i32) {
        let kind = (kind as usize).min(REQUEST_TYPES);
        let status = usize::try_from(status)
            .ok()
            .filter(|&s| s < STATUSES)
            .unwrap_or(STATUSES);
        self.replies[kind][status] += 1;
    }

    /// Counts a reply made outside the core (HELLO, refusals at the door).
    pub fn record_reply(&mut self, kind: i32, status: i32) {
        let kind = usize::try_from(kind)
            .ok()
            .filter(|&k| k < REQUEST_TYPES)
            .unwrap_or(REQUEST_TYPES);
        let status = usize::try_from(status)
            .ok()
            .filter(|&s| s < STATUSES)
            .unwrap_or(STATUSES);
        self.replies[kind][status] += 1;
    }

    // ---------------------------------------------------------------- requests

    /// Applies one request that passed the door.
    pub fn handle(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        body: Payload,
        now: Instant,
    ) -> Handled {
        self.start_clock(now);
        self.current = Some(ticket);
        let kind = request.kind();
        let immediate = self.dispatch(ticket, conn, request, body, now);
        self.after(now);
        self.current = None;
        match (immediate, self.current_outcome.take()) {
            (Some(reply), _) => {
                self.count_reply(kind, reply.header.status);
                Handled::Reply(reply)
            }
            (None, Some(Outcome::Reply(reply))) => Handled::Reply(reply),
            (None, Some(Outcome::Plan(plan))) => Handled::Plan(plan),
            (None, None) => Handled::Pending,
        }
    }

    fn dispatch(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        body: Payload,
        now: Instant,
    ) -> Option<Reply> {
        if request.remote.is_some() {
            return self.proxy(ticket, conn, request, now);
        }
        match &request.op {
            Op::Ping | Op::Hello { .. } => Some(Reply::new(request.reply(Status::Ok))),
            Op::ShmAttach => Some(Reply::new(request.error(
                Status::BadRequest,
                "SHM_ATTACH is answered by the connection, as its first request",
            ))),
            Op::Data(q) => {
                let q = q.clone();
                if q.ack.is_some_and(|ack| ack < q.token) {
                    self.stats.data_pipelined += 1;
                }
                let may_wait = !self.wait_budget(&q).is_zero();
                match self.data(&request, &q, now, may_wait) {
                    Some(Outcome::Reply(reply)) => Some(reply),
                    Some(outcome) => {
                        self.current_outcome = Some(outcome);
                        None
                    }
                    None => {
                        if self.conns.get(&conn).is_some_and(|c| {
                            c.outstanding >= self.config.max_outstanding_per_connection
                        }) {
                            return Some(self.too_many(&request));
                        }
                        let deadline = now + self.wait_budget(&q);
                        self.park(ticket, conn, request, ParkState::DataWait, Some(deadline));
                        self.add_waiter(ticket, &q.key);
                        None
                    }
                }
            }
            Op::Ack { key, token } => {
                let (key, token) = (key.clone(), *token);
                Some(self.ack(&request, &key, token, now))
            }
            Op::Delete { key } => {
                let key = key.clone();
                Some(self.delete(&request, &key, now))
            }
            Op::OpenTask { task, .. } => {
                let task = task.clone();
                let reply = self.open_task(&request, now);
                if reply.header.status_kind() == Status::Ok {
                    self.note_producer(conn, &task);
                }
                Some(reply)
            }
            Op::Committed { task, from } => {
                let (task, from) = (task.clone(), *from);
                self.committed(ticket, conn, request, &task, from)
            }
            Op::AbortTask { task, reason } => {
                let (task, reason) = (task.clone(), reason.clone());
                self.abort(&task, &reason, now);
                Some(Reply::new(request.reply(Status::Ok)))
            }
            Op::Enqueue { .. } | Op::NoMorePages { .. } => {
                if self
                    .conns
                    .get(&conn)
                    .is_some_and(|c| c.outstanding >= self.config.max_outstanding_per_connection)
                {
                    return Some(self.too_many(&request));
                }
                let task = match &request.op {
                    Op::Enqueue { key, .. } => key.task.clone(),
                    Op::NoMorePages { task, .. } => task.clone(),
                    _ => return None,
                };
                self.note_producer(conn, &task);
                let len = body.bytes.len() as u64;
                self.pending_bytes += len;
                self.park(ticket, conn, request, ParkState::Queued { body }, None);
                let state = self.conns.entry(conn).or_default();
                state.queue.push_back(ticket);
                if state.queue.len() == 1 {
                    self.pump(conn, now);
                }
                None
            }
        }
    }

    /// `conn` carries requests of `task_id`'s producer: while it is open,
    /// and until the task's input is finished, the task is not dropped as
    /// abandoned.
    fn note_producer(&mut self, conn: ConnId, task_id: &TaskId) {
        if let Some(task) = self.tasks.get_mut(task_id)
            && !task.input_finished
            && task.producers.insert(conn)
        {
            self.producer_conns
                .entry(conn)
                .or_default()
                .insert(task_id.clone());
        }
    }

    /// COMMITTED: reads the task's commit manifest (local only; the door
    /// refused it on TCP).
    fn committed(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        task_id: &TaskId,
        from: u64,
    ) -> Option<Reply> {
        if self.spool().is_none() {
            let mut header = request.error(
                Status::BadRequest,
                format!(
                    "COMMITTED for task {task_id}: this binxd has no spool store, so nothing is committed through it"
                ),
            );
            header.page_token = from;
            header.page_next_token = from;
            return Some(Reply::new(header));
        }
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.outstanding >= self.config.max_outstanding_per_connection)
        {
            return Some(self.too_many(&request));
        }
        self.new_op(
            OpKind::ReadManifest { ticket },
            Command::ReadManifest {
                task: task_id.clone(),
            },
        );
        self.park(ticket, conn, request, ParkState::ReadingManifest, None);
        None
    }

    /// A commit manifest was read for a COMMITTED.
    pub fn manifest_read(
        &mut self,
        op: OpId,
        result: Result<Option<Manifest>, ManifestError>,
        now: Instant,
    ) {
        let Some(OpKind::ReadManifest { ticket }) = self.ops.remove(&op) else {
            return;
        };
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let request = parked.request;
        let Op::Committed { task, from } = &request.op else {
            return;
        };
        let (task, from) = (task.clone(), *from);
        let error = |status: Status, why: String| {
            let mut header = request.error(status, why);
            header.page_token = from;
            header.page_next_token = from;
            Reply::new(header)
        };
        let reply = match result {
            Ok(None) => {
                let mut header = request.reply(Status::NoData);
                header.page_token = from;
                header.page_next_token = from;
                Reply::new(header)
            }
            Ok(Some(m)) if m.buffers.len() as u64 > self.config.max_buffers_per_task => error(
                Status::ServerError,
                format!(
                    "COMMITTED for task {task}: its manifest lists {} buffers, more than max_buffers_per_task ({})",
                    m.buffers.len(),
                    self.config.max_buffers_per_task
                ),
            ),
            Ok(Some(m)) => {
                let count = m.buffers.len() as u64;
                if from >= count && !(from == 0 && count == 0) {
                    error(
                        Status::BadRequest,
                        format!(
                            "COMMITTED for task {task} from buffer {from}: the task has {count} buffers"
                        ),
                    )
                } else {
                    let start = from as usize;
                    let end = (start + binx_proto::COMMITTED_PER_REPLY).min(m.buffers.len());
                    let part = &m.buffers[start..end];
                    let mut header = request.reply(Status::Ok);
                    header.page_token = from;
                    header.page_next_token = end as u64;
                    header.buffer_complete = end as u64 == count;
                    header.committed = Some(Box::new(binx_proto::Committed {
                        node: m.node,
                        endpoint: m.endpoint,
                        buffer_count: count,
                        end_tokens: part.iter().map(|&(e, _)| e).collect(),
                        bytes: part.iter().map(|&(_, b)| b).collect(),
                    }));
                    Reply::new(header)
                }
            }
            Err(ManifestError::Unavailable(e)) => {
                self.stats.busy_replies += 1;
                error(
                    Status::Busy,
                    format!(
                        "COMMITTED for task {task}: its manifest cannot be read from storage now; retry: {e}"
                    ),
                )
            }
            Err(ManifestError::Invalid(e)) => error(
                Status::ServerError,
                format!("COMMITTED for task {task}: its manifest is not valid: {e}"),
            ),
        };
        self.emit(ticket, MessageType::Committed, Outcome::Reply(reply));
        self.after(now);
    }

    /// A manifest write finished (its NO_MORE_PAGES is answered now).
    pub fn manifest_written(&mut self, op: OpId, result: Result<(), String>, now: Instant) {
        let Some(OpKind::Manifest { ticket }) = self.ops.remove(&op) else {
            return;
        };
        let task_of = |r: &Request| match &r.op {
            Op::NoMorePages { task, .. } => Some(task.clone()),
            _ => None,
        };
        let Some(ticket) = ticket else {
            return;
        };
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let reply = match (&result, task_of(&parked.request)) {
            (Ok(()), Some(task_id)) => {
                if let Some(task) = self.tasks.get_mut(&task_id) {
                    task.manifest = true;
                    self.release_producers(&task_id, now);
                } else {
                    // The task went while the manifest was written.
                    self.new_op(
                        OpKind::ManifestDelete,
                        Command::DeleteManifest { task: task_id },
                    );
                }
                Reply::new(parked.request.reply(Status::Ok))
            }
            (Err(e), task_id) => {
                tracing::warn!(task = ?task_id, error = %e, "a commit manifest could not be written");
                self.stats.busy_replies += 1;
                self.busy_behind(parked.conn, None, &parked.request);
                Reply::new(parked.request.error(
                    Status::Busy,
                    format!(
                        "NO_MORE_PAGES for task {}: every buffer is committed, but the task's commit manifest could not be written; retry: {e}",
                        task_id.map(|t| t.to_string()).unwrap_or_default()
                    ),
                ))
            }
            (Ok(()), None) => Reply::new(parked.request.reply(Status::Ok)),
        };
        self.emit(ticket, MessageType::NoMorePages, Outcome::Reply(reply));
        self.pump(parked.conn, now);
        self.after(now);
    }

    /// A manifest deletion finished; one that failed is left to the TTL.
    pub fn manifest_deleted(&mut self, op: OpId, result: Result<(), String>, now: Instant) {
        if self.ops.remove(&op).is_none() {
            return;
        }
        if let Err(e) = result {
            tracing::warn!(error = %e, "a commit manifest could not be deleted; the TTL pruner will");
            self.stats.deletes_left_to_ttl += 1;
        }
        self.after(now);
    }

    fn too_many(&mut self, request: &Request) -> Reply {
        Reply::new(request.error(
            Status::Busy,
            format!(
                "{} requests are outstanding on this connection, the limit (max_outstanding_requests); retry when some are answered",
                self.config.max_outstanding_per_connection
            ),
        ))
    }

    fn park(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        state: ParkState,
        deadline: Option<Instant>,
    ) {
        self.conns.entry(conn).or_default().outstanding += 1;
        if let Some(at) = deadline {
            self.deadlines.insert((at, ticket));
        }
        self.parked.insert(
            ticket,
            Parked {
                conn,
                request,
                state,
                deadline,
                waited: false,
            },
        );
    }

    /// Removes a parked request (and its deadline, waiter and queue entry).
    fn unpark(&mut self, ticket: Ticket) -> Option<Parked> {
        let parked = self.parked.remove(&ticket)?;
        if let Some(at) = parked.deadline {
            self.deadlines.remove(&(at, ticket));
        }
        if matches!(parked.state, ParkState::DataWait)
            && let Op::Data(q) = &parked.request.op
            && let Some(waiters) = self.data_waiters.get_mut(&q.key.task)
        {
            if let Some(set) = waiters.get_mut(&q.key.buffer) {
                set.remove(&ticket);
                if set.is_empty() {
                    waiters.remove(&q.key.buffer);
                }
            }
            if waiters.is_empty() {
                self.data_waiters.remove(&q.key.task);
            }
        }
        if let ParkState::Queued { body } = &parked.state {
            self.pending_bytes -= body.bytes.len() as u64;
        }
        if let ParkState::Writing { body_len, .. } = &parked.state {
            self.pending_bytes -= body_len;
        }
        self.blocked.remove(&ticket);
        self.room_wanted.remove(&ticket);
        self.spooling.remove(&ticket);
        if let Some(conn) = self.conns.get_mut(&parked.conn) {
            conn.outstanding -= 1;
            if let Some(pos) = conn.queue.iter().position(|&t| t == ticket) {
                conn.queue.remove(pos);
            }
            if conn.outstanding == 0 && conn.queue.is_empty() {
                self.conns.remove(&parked.conn);
            }
        }
        Some(parked)
    }

    fn set_deadline(&mut self, ticket: Ticket, at: Instant) {
        if let Some(p) = self.parked.get_mut(&ticket) {
            if let Some(old) = p.deadline.replace(at) {
                self.deadlines.remove(&(old, ticket));
            }
            self.deadlines.insert((at, ticket));
        }
    }

    /// The driver no longer wants the answer (its client went away).
    pub fn cancel(&mut self, ticket: Ticket, now: Instant) {
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        // Storage work under way finishes (and its effects stand); the rest goes.
        if matches!(
            parked.state,
            ParkState::DataWait | ParkState::Queued { .. } | ParkState::Forwarding
        ) {
            let conn = parked.conn;
            let queued = matches!(parked.state, ParkState::Queued { .. });
            let cause = parked.request.clone();
            // The ENQUEUEs and NO_MORE_PAGES sent after a queued one that
            // goes unapplied must not be applied either: what takes effect
            // is always a prefix of what a connection sent (a NO_MORE_PAGES
            // applied without the ENQUEUE before it would end the buffer
            // short).
            let behind: Vec<Ticket> = if queued {
                self.conns
                    .get(&conn)
                    .map(|c| {
                        c.queue
                            .iter()
                            .skip_while(|&&t| t != ticket)
                            .skip(1)
                            .copied()
                            .collect()
                    })
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            self.unpark(ticket);
            for t in behind {
                self.refuse_queued(t, &cause);
            }
            self.after(now);
        }
    }

    /// A client connection closed: its waiting requests go, and the tasks
    /// it produced for start their abandon clock once no connection of
    /// their producer is left.
    pub fn connection_closed(&mut self, conn: ConnId, now: Instant) {
        let tickets: Vec<Ticket> = self
            .parked
            .iter()
            .filter(|(_, p)| p.conn == conn)
            .map(|(&t, _)| t)
            .collect();
        for ticket in tickets {
            self.cancel(ticket, now);
        }
        for task_id in self.producer_conns.remove(&conn).unwrap_or_default() {
            if let Some(task) = self.tasks.get_mut(&task_id) {
                task.producers.remove(&conn);
                if task.producers.is_empty() {
                    task.restart_clocks(now);
                }
            }
        }
    }

    /// A task-wide NO_MORE_PAGES was answered OK: the task needs its
    /// producer's connections no more (an engine may keep one connection
    /// for all its tasks), and its abandonment clocks start now.
    fn release_producers(&mut self, task_id: &TaskId, now: Instant) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        if task.producers.is_empty() {
            return;
        }
        for conn in std::mem::take(&mut task.producers) {
            if let Some(set) = self.producer_conns.get_mut(&conn) {
                set.remove(task_id);
                if set.is_empty() {
                    self.producer_conns.remove(&conn);
                }
            }
        }
        task.restart_clocks(now);
    }

    // --------------------------------------------------------------- DATA

    fn wait_budget(&self, q: &DataQuery) -> Duration {
        q.max_wait.min(self.config.max_wait)
    }

    fn add_waiter(&mut self, ticket: Ticket, key: &BufferKey) {
        self.data_waiters
            .entry(key.task.clone())
            .or_default()
            .entry(key.buffer)
            .or_default()
            .insert(ticket);
    }

    /// Evaluates a waiting DATA again: answers it, or (while `may_wait`)
    /// leaves it waiting.
    fn retry_data(&mut self, ticket: Ticket, now: Instant, may_wait: bool) {
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        let Op::Data(q) = &parked.request.op else {
            return;
        };
        let q = q.clone();
        let request = parked.request.clone();
        let may_wait = may_wait && parked.deadline.is_some_and(|at| at > now);
        if let Some(outcome) = self.data(&request, &q, now, may_wait) {
            self.unpark(ticket);
            self.emit(ticket, MessageType::Data, outcome);
        }
    }

    /// The answer to a DATA now, or `None` to wait (only when `may_wait`).
    fn data(
        &mut self,
        request: &Request,
        q: &DataQuery,
        now: Instant,
        may_wait: bool,
    ) -> Option<Outcome> {
        let (task_id, buffer_id, token) = (&q.key.task, q.key.buffer, q.token);
        let reply =
            |status, error: String| Some(Outcome::Reply(Reply::new(request.error(status, error))));
        if !self.tasks.contains_key(task_id) {
            return match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => reply(
                    Status::ServerError,
                    format!("task {task_id} was aborted: {reason}"),
                ),
                Some(Gone::Abandoned) => reply(Status::ServerError, abandoned_task(task_id)),
                Some(Gone::Finished) => Some(Outcome::Reply(complete_at(request, token))),
                Some(Gone::FinishedOpenBroadcast) => reply(
                    Status::BadRequest,
                    format!(
                        "buffer {buffer_id} of broadcast task {task_id} is not part of its buffer set: the task finished (NO_MORE_PAGES closed the set, and every buffer in it was deleted)"
                    ),
                ),
                None if self
                    .early
                    .get(task_id)
                    .is_some_and(|set| set.contains(&buffer_id)) =>
                {
                    Some(Outcome::Reply(complete_at(request, token)))
                }
                None if may_wait => None,
                None => Some(Outcome::Reply(Reply::new(request.reply(Status::NoData)))),
            };
        }
        let max_buffers = self.config.max_buffers_per_task;
        let spool = self.config.spool.clone();
        let (default_size, max_reply, max_stored) = (
            self.config.default_reply_size,
            self.config.max_reply_size,
            self.config.max_stored_reply_size,
        );
        let task = self.tasks.get_mut(task_id)?;
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return reply(Status::BadRequest, e);
        }
        if task.kind == BufferKind::Broadcast
            && task.fixed_count.is_none()
            && task.buffers_closed
            && !task.buffers.contains_key(&buffer_id)
        {
            // Every buffer of a broadcast sees every page: one that joins
            // after the set closed would read an empty buffer as complete.
            return reply(
                Status::BadRequest,
                format!(
                    "buffer {buffer_id} of broadcast task {task_id} is not part of its buffer set, which NO_MORE_PAGES closed before a consumer asked for it"
                ),
            );
        }
        if !task.buffers.contains_key(&buffer_id) && token > 0 {
            return reply(
                Status::BadRequest,
                format!(
                    "DATA for buffer {buffer_id} of task {task_id} at token {token}, but that buffer has no page yet (expected token 0)"
                ),
            );
        }
        task.last_activity = now;
        let buffer = task.buffer_mut(buffer_id, now);
        buffer.last_poll = now;
        match buffer.gone {
            Some(BufferGone::Deleted) => return Some(Outcome::Reply(complete_at(request, token))),
            Some(BufferGone::Abandoned) => {
                return reply(
                    Status::ServerError,
                    abandoned_buffer(task_id, buffer_id, self.config.abandon_after),
                );
            }
            None => {}
        }
        let max_bytes = match q.max_size {
            0 => default_size,
            n => n,
        }
        .min(max_reply)
        .max(1);
        let whole = q.accept_spooled
            && spool
                .as_ref()
                .is_some_and(|s| s.presigns && q.encodings.contains(s.codec));
        let before = task.memory();
        let mut deletes = Vec::new();
        let acked = task.ack_for_read(
            buffer_id,
            token,
            q.ack,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let objects = &self.objects;
        let object_size = |id: ObjectId| objects.meta(id).map_or(0, |m| m.page_bytes());
        let stored = StoredReads {
            object_size: &object_size,
            whole,
            max_bytes: max_stored,
        };
        let read = acked.map(|()| {
            task.read(
                buffer_id,
                token,
                max_bytes,
                MAX_REPLY_PAGES,
                q.sizes_only,
                Some(&stored),
            )
        });
        let following = match (&read, q.ack) {
            (Ok(read), Some(_)) if !q.sizes_only && !read.pages.is_empty() => task.following_sizes(
                buffer_id,
                token + read.pages.len() as u64,
                max_bytes.saturating_mul(2),
                MAX_FOLLOWING_SIZES,
                MAX_FOLLOWING_SIZES_BYTES,
                &stored,
            ),
            _ => Vec::new(),
        };
        let after = task.memory();
        self.account(before, after);
        self.delete_objects(deletes);
        let read = match read {
            Ok(read) => read,
            Err(e) => {
                return reply(
                    Status::BadRequest,
                    token_error(e, task_id, buffer_id, token),
                );
            }
        };
        if q.sizes_only {
            if read.sizes.is_empty() && !read.complete && may_wait {
                return None;
            }
            let mut header = request.reply(Status::Ok);
            header.remaining_bytes = read.sizes;
            header.buffer_complete = read.complete;
            return Some(Outcome::Reply(Reply::new(header)));
        }
        if read.pages.is_empty() {
            if read.complete {
                return Some(Outcome::Reply(complete_at(request, token)));
            }
            if may_wait {
                return None;
            }
            return Some(Outcome::Reply(Reply::new(request.reply(Status::NoData))));
        }
        let count = read.pages.len() as u64;
        let mut header = request.reply(Status::Ok);
        header.page_next_token = token + count;
        header.buffer_complete = read.complete;
        header.following_sizes = following;
        let mut planned = Vec::with_capacity(read.pages.len());
        let mut leased: Vec<ObjectId> = Vec::new();
        let mut bytes = 0u64;
        for page in read.pages {
            bytes += page.size;
            match (page.body, page.object) {
                (Some(body), _) => planned.push(PlannedPage::Memory(body)),
                (None, Some((id, index))) => {
                    let Some(meta) = self.objects.meta(id).cloned() else {
                        return reply(
                            Status::ServerError,
                            format!(
                                "DATA for buffer {buffer_id} of task {task_id} at token {token}: a page's spooled object is no longer known"
                            ),
                        );
                    };
                    if leased.last() != Some(&id) {
                        leased.push(id);
                    }
                    planned.push(PlannedPage::Object { meta, index, whole });
                }
                (None, None) => {
                    return reply(
                        Status::ServerError,
                        format!(
                            "DATA for buffer {buffer_id} of task {task_id} at token {token}: a page is neither in memory nor in storage"
                        ),
                    );
                }
            }
        }
        self.stats.pages_served += count;
        self.stats.bytes_served += bytes;
        let what = format!("DATA for buffer {buffer_id} of task {task_id} at token {token}");
        let mut plan = DataPlan::build(header, what, planned);
        if plan.is_ready() {
            return Some(Outcome::Reply(plan.assemble(Vec::new())));
        }
        if !whole {
            // Read from storage by the driver: the next object can be read
            // while this reply is sent.
            plan.read_ahead = self.tasks.get(task_id).and_then(|task| {
                let next =
                    task.next_stored_object(buffer_id, token + count, leased.last().copied())?;
                self.objects.meta(next).cloned()
            });
        }
        leased.sort();
        leased.dedup();
        for &id in &leased {
            self.objects.add_lease(id);
        }
        self.next_lease += 1;
        let lease = LeaseId(self.next_lease);
        self.leases.insert(lease, leased);
        plan.lease = Some(lease);
        Some(Outcome::Plan(plan))
    }

    /// A DATA plan was carried out: its objects may go; `status` is the
    /// reply's.
    pub fn plan_finished(&mut self, lease: Option<LeaseId>, status: Status, now: Instant) {
        self.count_reply(MessageType::Data, status as i32);
        // BUSY (the store unreachable for now, or no room to read) says
        // nothing of the objects: the consumer asks storage again.
        if let Some(rkey) = lease.and_then(|l| self.failover_leases.remove(&l))
            && !matches!(status, Status::Ok | Status::Busy)
        {
            // The committed buffer's objects are gone (its producer deleted
            // the buffer, or it expired): ask the producer again.
            self.remotes.states.remove(&rkey);
        }
        if let Some(ids) = lease.and_then(|l| self.leases.remove(&l)) {
            let mut deletes = Vec::new();
            for id in ids {
                if let Some(meta) = self.objects.drop_lease(id) {
                    deletes.push(meta);
                }
            }
            self.delete_objects(deletes);
        }
        self.after(now);
    }

    /// Whether `task_id` ended as a failure (aborted by its producer or an
    /// operator, or abandoned): what the HTTP exchange reports as a failed
    /// task (`X-Trino-Task-Failed`) rather than as a server error.
    pub fn task_failed(&self, task_id: &str) -> bool {
        !self.tasks.contains_key(task_id)
            && matches!(
                self.ended.get(task_id),
                Some(Gone::Aborted(_) | Gone::Abandoned)
            )
    }

    /// Sizes of the pages of a buffer held from `token` on; changes nothing.
    pub fn peek_sizes(&self, task_id: &str, buffer_id: u64, token: u64) -> Vec<u64> {
        self.tasks
            .get(task_id)
            .map(|t| t.peek_sizes(buffer_id, token, MAX_REPLY_PAGES))
            .unwrap_or_default()
    }

    // --------------------------------------------------------------- ACK, DELETE

    fn ack(&mut self, request: &Request, key: &BufferKey, token: u64, now: Instant) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            if self.ended.get(task_id).is_some() {
                return Reply::new(request.reply(Status::Ok));
            }
            if token == 0 {
                // Remembered as a DELETE: the consumer has gone before the
                // producer came (docs/PROTOCOL.md section 4, "DELETE, ABORT_TASK
                // and abandoned buffers").
                self.remember_early_delete(task_id, buffer_id, now);
                return Reply::new(request.reply(Status::Ok));
            }
            return Reply::new(request.error(
                Status::BadRequest,
                format!(
                    "ACK at token {token} for buffer {buffer_id} of task {task_id}, which this binxd does not know (beyond the next token, 0)"
                ),
            ));
        };
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return Reply::new(request.error(Status::BadRequest, e));
        }
        task.last_activity = now;
        if let Some(buffer) = task.buffers.get_mut(&buffer_id) {
            if buffer.gone.is_some() {
                return Reply::new(request.reply(Status::Ok));
            }
            buffer.last_poll = now;
        }
        let before = task.memory();
        let mut deletes = Vec::new();
        let result = task.ack(
            buffer_id,
            token,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let after = task.memory();
        self.account(before, after);
        self.delete_objects(deletes);
        match result {
            Ok(()) => Reply::new(request.reply(Status::Ok)),
            Err(e) => Reply::new(request.error(
                Status::BadRequest,
                token_error(e, task_id, buffer_id, token),
            )),
        }
    }

    fn remember_early_delete(&mut self, task_id: &TaskId, buffer_id: u64, now: Instant) {
        match self.early.get_mut(task_id) {
            Some(set) => {
                if set.len() < MAX_EARLY_DELETES_PER_TASK {
                    set.insert(buffer_id);
                }
            }
            None => self
                .early
                .insert(task_id.clone(), BTreeSet::from([buffer_id]), now),
        }
    }

    fn delete(&mut self, request: &Request, key: &BufferKey, now: Instant) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            if self.ended.get(task_id).is_none() {
                self.remember_early_delete(task_id, buffer_id, now);
            }
            // Nothing is held, and DELETE is repeatable.
            return Reply::new(request.reply(Status::Ok));
        };
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return Reply::new(request.error(Status::BadRequest, e));
        }
        task.last_activity = now;
        self.drop_buffer(task_id, buffer_id, BufferGone::Deleted, now);
        Reply::new(request.reply(Status::Ok))
    }

    /// Deletes or abandons a buffer: frees its pages, deletes its marker,
    /// and ends the task once nothing is left.
    fn drop_buffer(&mut self, task_id: &TaskId, buffer_id: u64, how: BufferGone, now: Instant) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        let before = task.memory();
        let mut deletes = Vec::new();
        let had_marker = task.delete(
            buffer_id,
            how,
            now,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let after = task.memory();
        // Every buffer gone ends the task, unless its producer still holds
        // a connection: then it stays (its pages dropped as they come) until
        // the producer finishes or goes.
        let done = task.is_done() && (how == BufferGone::Deleted || task.producers.is_empty());
        self.account(before, after);
        self.delete_objects(deletes);
        if had_marker {
            self.release_marker(task_id, buffer_id);
        }
        self.dirty.push((task_id.clone(), None));
        if done {
            let how = self.tasks.get(task_id).map_or(Gone::Finished, finished);
            self.end_task(task_id, how, now);
        }
    }

    // --------------------------------------------------------------- OPEN, ABORT

    fn open_task(&mut self, request: &Request, now: Instant) -> Reply {
        let Op::OpenTask {
            task: task_id,
            kind,
            buffer_count,
            policy,
        } = &request.op
        else {
            return Reply::new(request.error(Status::BadRequest, "not an OPEN_TASK"));
        };
        let bad = |e: String| Reply::new(request.error(Status::BadRequest, e));
        let policy = policy.unwrap_or(self.config.default_spool_policy);
        if policy != SpoolPolicy::Off && self.spool().is_none() {
            return bad(format!(
                "OPEN_TASK for task {task_id}: spool policy \"{policy}\" needs a spool store, and this binxd has none configured"
            ));
        }
        if policy.commits()
            && let Some(why) = self.spool().and_then(|s| s.always_refusal.clone())
        {
            return bad(format!("OPEN_TASK for task {task_id}: {why}"));
        }
        if let Some(n) = buffer_count
            && *n > self.config.max_buffers_per_task
        {
            return bad(format!(
                "OPEN_TASK for task {task_id}: buffer_count {n} exceeds the limit of {} buffers per task",
                self.config.max_buffers_per_task
            ));
        }
        if let Some(task) = self.tasks.get(task_id) {
            if task.kind == *kind && task.fixed_count == *buffer_count && task.policy == policy {
                return Reply::new(request.reply(Status::Ok));
            }
            return bad(format!(
                "OPEN_TASK for task {task_id}: already open as {} with buffer_count {} and spool policy {}",
                task.kind.name(),
                task.fixed_count.unwrap_or(0),
                task.policy
            ));
        }
        if let Some(gone) = self.ended.get(task_id) {
            let how = match gone {
                Gone::Aborted(reason) => format!("was aborted ({reason})"),
                Gone::Finished | Gone::FinishedOpenBroadcast => "already finished".to_string(),
                Gone::Abandoned => "was dropped as abandoned".to_string(),
            };
            return bad(format!(
                "OPEN_TASK for task {task_id}: that task {how}; task ids cannot be reused"
            ));
        }
        if self.draining {
            return Reply::new(request.error(
                Status::ServerError,
                format!(
                    "OPEN_TASK for task {task_id}: this binxd is draining before it stops and takes no new tasks"
                ),
            ));
        }
        let early = self.early.remove(task_id).unwrap_or_default();
        let task = Task::new(task_id.clone(), *kind, *buffer_count, policy, early, now);
        let mem = task.memory();
        self.tasks.insert(task_id.clone(), task);
        self.account(0, mem);
        self.dirty.push((task_id.clone(), None));
        Reply::new(request.reply(Status::Ok))
    }

    /// Aborts a task (known or not yet opened: its consumers then see the
    /// reason).
    fn abort(&mut self, task_id: &TaskId, reason: &str, now: Instant) {
        tracing::info!(task = %task_id, reason = %binx_proto::truncate(reason, 256), "task aborted");
        self.stats.tasks_aborted += 1;
        self.end_task(task_id, Gone::Aborted(reason.to_string()), now);
    }

    /// Aborts an open task for an operator; returns the bytes freed, or
    /// `None` when no such task is open (so a typo aborts nothing).
    pub fn abort_open_task(&mut self, task_id: &str, reason: &str, now: Instant) -> Option<u64> {
        let task = TaskId::parse(task_id).ok()?;
        self.tasks.contains_key(&task).then_some(())?;
        let before = self.memory_used;
        let reason = binx_proto::truncate(reason, crate::MAX_REASON_LEN);
        self.abort(
            &task,
            if reason.is_empty() {
                "aborted by an operator"
            } else {
                reason
            },
            now,
        );
        self.after(now);
        Some(before - self.memory_used)
    }

    /// Frees a task's pages and remembers how it ended.
    fn end_task(&mut self, task_id: &TaskId, how: Gone, now: Instant) {
        if let Some(mut task) = self.tasks.remove(task_id) {
            for conn in &task.producers {
                if let Some(set) = self.producer_conns.get_mut(conn) {
                    set.remove(task_id);
                    if set.is_empty() {
                        self.producer_conns.remove(conn);
                    }
                }
            }
            if task.manifest {
                self.new_op(
                    OpKind::ManifestDelete,
                    Command::DeleteManifest {
                        task: task_id.clone(),
                    },
                );
            }
            let before = task.memory();
            let mut deletes = Vec::new();
            let markers = task.clear(&mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            });
            let after = task.memory();
            // The task is gone: everything it held is released.
            self.account(before, after);
            self.account(after, 0);
            self.delete_objects(deletes);
            for buffer in markers {
                self.release_marker(task_id, buffer);
            }
        }
        self.ended.insert(task_id.clone(), how, now);
        self.early.remove(task_id);
        self.dirty.push((task_id.clone(), None));
    }

    // --------------------------------------------------------------- ENQUEUE

    /// Applies the head of a connection's queue and what follows, until one
    /// has to wait.
    fn pump(&mut self, conn: ConnId, now: Instant) {
        loop {
            let Some(&head) = self.conns.get(&conn).and_then(|c| c.queue.front()) else {
                return;
            };
            match self.step_mutation(head, now) {
                Step::Done(reply) => {
                    let kind = self
                        .parked
                        .get(&head)
                        .map_or(MessageType::Enqueue, |p| p.request.kind());
                    self.unpark(head);
                    self.emit(head, kind, Outcome::Reply(reply));
                }
                Step::Blocked => {
                    if let Some(p) = self.parked.get_mut(&head)
                        && !std::mem::replace(&mut p.waited, true)
                    {
                        self.stats.backpressure_waits += 1;
                    }
                    self.blocked.insert(head);
                    return;
                }
                Step::Async => return,
            }
        }
    }

    /// One try at a queued ENQUEUE or NO_MORE_PAGES (the head of its queue).
    fn step_mutation(&mut self, ticket: Ticket, now: Instant) -> Step {
        let Some(parked) = self.parked.get(&ticket) else {
            return Step::Async;
        };
        if !matches!(parked.state, ParkState::Queued { .. }) {
            return Step::Async;
        }
        let request = parked.request.clone();
        match &request.op {
            Op::Enqueue {
                key,
                page_sizes,
                max_wait,
                ..
            } => self.enqueue(ticket, &request, key, page_sizes, *max_wait, now),
            Op::NoMorePages { task, buffer, .. } => {
                self.no_more_pages(ticket, &request, task, *buffer, now)
            }
            _ => Step::Done(Reply::new(
                request.error(Status::BadRequest, "not a queued request"),
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &mut self,
        ticket: Ticket,
        request: &Request,
        key: &BufferKey,
        page_sizes: &[u64],
        max_wait: Duration,
        now: Instant,
    ) -> Step {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let bad = |e: String| Step::Done(Reply::new(request.error(Status::BadRequest, e)));
        if page_sizes.len() > self.config.max_pages_per_enqueue {
            return bad(format!(
                "ENQUEUE for buffer {buffer_id} of task {task_id} carries {} pages; the limit is {} (max_pages_per_enqueue): send them in several ENQUEUEs",
                page_sizes.len(),
                self.config.max_pages_per_enqueue
            ));
        }
        let body = match self.parked.get(&ticket).map(|p| &p.state) {
            Some(ParkState::Queued { body }) => body.clone(),
            _ => return Step::Async,
        };
        let pages = match binx_proto::split_pages(&body.bytes, page_sizes) {
            Ok(pages) => pages,
            Err(e) => {
                return bad(format!(
                    "ENQUEUE for buffer {buffer_id} of task {task_id}: {e}"
                ));
            }
        };
        if !self.tasks.contains_key(task_id) {
            return match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => Step::Done(Reply::new(request.error(
                    Status::ServerError,
                    format!("task {task_id} was aborted: {reason}"),
                ))),
                Some(Gone::Finished | Gone::FinishedOpenBroadcast) => {
                    // As for a deleted buffer: the consumers are gone (they
                    // deleted every buffer).
                    self.stats.pages_dropped += pages.len() as u64;
                    Step::Done(Reply::new(appended(request, pages.len())))
                }
                Some(Gone::Abandoned) => Step::Done(Reply::new(request.error(
                    Status::ServerError,
                    dropped_task(task_id, "ENQUEUE", self.config.abandon_after),
                ))),
                None => bad(format!(
                    "ENQUEUE for task {task_id}, which this binxd does not know: it was never opened (send OPEN_TASK first), or it ended more than {:?} ago (abandon_after)",
                    self.config.abandon_after
                )),
            };
        }
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Step::Async;
        };
        task.last_activity = now;
        if task.kind == BufferKind::Partitioned
            && let Err(e) = check_buffer_id(task, buffer_id, max_buffers)
        {
            return bad(e);
        }
        if task.drops_pages(buffer_id) {
            self.stats.pages_dropped += pages.len() as u64;
            return Step::Done(Reply::new(appended(request, pages.len())));
        }
        // Before "finished": a copy of an ENQUEUE that was applied learns
        // so even after the buffer ended.
        let next = task.next_append_token(buffer_id);
        let why_not = task.refuses_pages(buffer_id);
        if let Some(refusal) = self.misnumbered(request, task_id, Some(buffer_id), next) {
            return Step::Done(refusal);
        }
        if let Some(why) = why_not {
            // A numbered ENQUEUE of no page at the end of a finished buffer
            // adds nothing where it says: a copy of one that was applied.
            if pages.is_empty() && request.token_named() {
                return Step::Done(Reply::new(appended(request, 0)));
            }
            return bad(why);
        }
        let budget = max_wait.min(self.config.max_wait);
        let deadline = match self.parked.get(&ticket).and_then(|p| p.deadline) {
            Some(at) => at,
            None => {
                let at = now + budget;
                self.set_deadline(ticket, at);
                at
            }
        };
        let may_wait = now < deadline;
        let size = body.bytes.len() as u64;
        let count = pages.len() as u64;
        let task = &self.tasks[task_id];
        let policy = task.policy;
        // The allocation the pages will pin: a small body in a large receive
        // buffer is copied out, so the buffer can be reused.
        let (chunk_capacity, copy) = match body.chunk {
            Some((_, capacity)) if size * 2 >= capacity => (capacity, false),
            _ => (size, true),
        };
        let charge =
            if size == 0 { 0 } else { chunk_capacity } + slot_growth(task, buffer_id, count);
        let limit = self.config.task_memory_limit.min(self.config.memory_limit);
        if policy != SpoolPolicy::Always && charge > limit {
            return bad(format!(
                "ENQUEUE of {size} bytes for buffer {buffer_id} of task {task_id} can never fit the memory limit of {limit} bytes"
            ));
        }
        let pages_full = task.log_len(buffer_id) + count > self.config.max_pages_per_log;
        if policy == SpoolPolicy::Always {
            if task.durable_in_flight || pages_full {
                return self.wait_or_busy(ticket, request, may_wait, || {
                    format!(
                        "ENQUEUE for buffer {buffer_id} of task {task_id} (policy always): an earlier write of this task is still going on; nothing was stored, retry later"
                    )
                });
            }
            return self.start_durable(ticket, request, key, pages);
        }
        let task_room = self.config.task_memory_limit.saturating_sub(task.memory());
        let global_room = self.config.memory_limit.saturating_sub(self.memory_used);
        let fits = charge <= task_room && charge <= global_room && !pages_full;
        if !fits {
            if policy.spills() && may_wait && !pages_full {
                let own = task_room < global_room;
                let need = charge.saturating_sub(task_room.min(global_room));
                self.room_wanted
                    .insert(ticket, (own.then(|| task_id.clone()), need));
            }
            let (used, task_mem) = (self.memory_used, task.memory());
            let (limit, task_limit) = (self.config.memory_limit, self.config.task_memory_limit);
            let max_pages = self.config.max_pages_per_log;
            return self.wait_or_busy(ticket, request, may_wait, || {
                if pages_full {
                    format!(
                        "no room for {count} more pages in buffer {buffer_id} of task {task_id}: it holds {max_pages} (max_pages_per_buffer) until its consumer acknowledges some; nothing was stored, retry later"
                    )
                } else {
                    format!(
                        "no room for {size} bytes for buffer {buffer_id} of task {task_id}: the daemon holds {used} of {limit} bytes, the task {task_mem} of {task_limit}; nothing was stored, retry later"
                    )
                }
            });
        }
        self.room_wanted.remove(&ticket);
        let chunk = self.chunk_for(&body, copy);
        let bodies: Vec<Bytes> = if copy && size > 0 {
            let own = Bytes::copy_from_slice(&body.bytes);
            binx_proto::split_pages(&own, page_sizes).unwrap_or_default()
        } else {
            pages
        };
        let pages: Vec<Page> = bodies
            .into_iter()
            .map(|b| {
                self.next_seq += 1;
                Page {
                    size: b.len() as u64,
                    chunk: if b.is_empty() { 0 } else { chunk },
                    body: Some(b),
                    object: None,
                    seq: self.next_seq,
                    at: now,
                    spilling: false,
                }
            })
            .collect();
        self.append(task_id, buffer_id, pages, chunk_capacity, now);
        self.stats.pages_enqueued += count;
        self.stats.bytes_enqueued += size;
        Step::Done(Reply::new(appended(request, count as usize)))
    }

    /// The refusal of an ENQUEUE or NO_MORE_PAGES whose `append_token` is
    /// not `next`, the token the buffer's next page would get (numbered
    /// appends): it was sent behind one that was not applied, or it repeats
    /// one that was. Nothing changes; the reply's `page_next_token` says
    /// where the buffer is, so the producer knows which.
    fn misnumbered(
        &mut self,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        next: u64,
    ) -> Option<Reply> {
        let (Op::Enqueue { append_token, .. } | Op::NoMorePages { append_token, .. }) = &request.op
        else {
            return None;
        };
        let wanted = (*append_token)?;
        if wanted == next {
            return None;
        }
        self.stats.append_token_refusals += 1;
        let what = match (&request.op, buffer) {
            (Op::Enqueue { .. }, Some(b)) => {
                format!("ENQUEUE for buffer {b} of task {task_id} names append_token {wanted}")
            }
            (_, Some(b)) => format!(
                "NO_MORE_PAGES for buffer {b} of task {task_id} names append_token {wanted}"
            ),
            (_, None) => {
                format!("NO_MORE_PAGES for task {task_id} names append_token {wanted}")
            }
        };
        let why = if next < wanted {
            format!(
                "the buffer's next page gets token {next}: an earlier ENQUEUE of it was not applied; nothing was stored, resend from token {next}"
            )
        } else {
            format!(
                "the buffer's next page gets token {next}: tokens up to {next} are taken (an earlier copy of this request was applied, or the pages were numbered wrong); nothing was stored"
            )
        };
        let mut header = request.error(Status::BadRequest, format!("{what}, but {why}"));
        header.page_next_token = next;
        Some(Reply::new(header))
    }

    /// The id of the allocation a body's pages pin.
    fn chunk_for(&mut self, body: &Payload, copy: bool) -> u64 {
        match body.chunk {
            Some((id, _)) if !copy && id != 0 && id < OWN_CHUNKS => id,
            _ => {
                self.next_chunk += 1;
                OWN_CHUNKS | self.next_chunk
            }
        }
    }

    fn append(
        &mut self,
        task_id: &TaskId,
        buffer_id: u64,
        pages: Vec<Page>,
        capacity: u64,
        now: Instant,
    ) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        let before = task.memory();
        task.append(buffer_id, pages, capacity, &mut self.objects, now);
        let after = task.memory();
        let which = (task.kind == BufferKind::Partitioned).then_some(buffer_id);
        self.account(before, after);
        self.dirty.push((task_id.clone(), which));
    }

    /// Waits (the head stays blocked) or, with its wait used up, answers
    /// BUSY; everything queued behind it on the connection is BUSY too, so
    /// what takes effect stays in the order sent.
    fn wait_or_busy(
        &mut self,
        ticket: Ticket,
        request: &Request,
        may_wait: bool,
        why: impl FnOnce() -> String,
    ) -> Step {
        if may_wait {
            return Step::Blocked;
        }
        self.room_wanted.remove(&ticket);
        self.stats.busy_replies += 1;
        let reply = Reply::new(request.error(Status::Busy, why()));
        if let Some(conn) = self.parked.get(&ticket).map(|p| p.conn) {
            self.busy_behind(conn, Some(ticket), request);
        }
        Step::Done(reply)
    }

    /// Answers BUSY every ENQUEUE and NO_MORE_PAGES queued on `conn` behind
    /// one that got BUSY (`head`, when still queued, is skipped): what takes
    /// effect stays a prefix of what was sent.
    fn busy_behind(&mut self, conn: ConnId, head: Option<Ticket>, cause: &Request) {
        let behind: Vec<Ticket> = self
            .conns
            .get(&conn)
            .map(|c| {
                c.queue
                    .iter()
                    .copied()
                    .filter(|t| Some(*t) != head)
                    .collect()
            })
            .unwrap_or_default();
        for t in behind {
            self.refuse_queued(t, cause);
        }
    }

    /// Answers BUSY to a queued ENQUEUE or NO_MORE_PAGES that must not be
    /// applied because `cause`, sent before it on its connection, was not.
    fn refuse_queued(&mut self, ticket: Ticket, cause: &Request) {
        if !matches!(
            self.parked.get(&ticket).map(|p| &p.state),
            Some(ParkState::Queued { .. })
        ) {
            return;
        }
        if let Some(p) = self.unpark(ticket) {
            self.stats.busy_replies += 1;
            let kind = p.request.kind();
            let reply = Reply::new(p.request.error(
                Status::Busy,
                format!(
                    "an earlier {} on this connection (request {}) was not applied, so this one was not either; nothing was stored, resend from there",
                    cause.kind().name(),
                    cause.id
                ),
            ));
            self.emit(ticket, kind, Outcome::Reply(reply));
        }
    }

    /// Policy `always`: writes the pages to storage (objects of at most the
    /// segment size) before they are appended and the producer hears OK.
    fn start_durable(
        &mut self,
        ticket: Ticket,
        request: &Request,
        key: &BufferKey,
        pages: Vec<Bytes>,
    ) -> Step {
        let Some(task) = self.tasks.get_mut(&key.task) else {
            return Step::Async;
        };
        if pages.is_empty() {
            return Step::Done(Reply::new(appended(request, 0)));
        }
        let first_token = task.next_append_token(key.buffer);
        task.durable_in_flight = true;
        let max = self.spool().map_or(16 << 20, |s| s.spill_max_bytes);
        let mut cuts: Vec<(u64, Vec<Bytes>)> = Vec::new();
        let mut start = 0usize;
        while start < pages.len() {
            let mut end = start + 1;
            let mut bytes = pages[start].len() as u64;
            while end < pages.len() && bytes + pages[end].len() as u64 <= max {
                bytes += pages[end].len() as u64;
                end += 1;
            }
            cuts.push((first_token + start as u64, pages[start..end].to_vec()));
            start = end;
        }
        let body_len = match self.parked.get(&ticket).map(|p| &p.state) {
            Some(ParkState::Queued { body }) => body.bytes.len() as u64,
            _ => 0,
        };
        if let Some(p) = self.parked.get_mut(&ticket) {
            // The body stays pending until the pages are appended.
            p.state = ParkState::Writing {
                first_token,
                pages,
                parts: vec![None; cuts.len()],
                remaining: cuts.len(),
                failed: None,
                body_len,
            };
            if let Some(at) = p.deadline.take() {
                self.deadlines.remove(&(at, ticket));
            }
        }
        for (part, (token, pages)) in cuts.into_iter().enumerate() {
            self.new_op(
                OpKind::Durable { ticket, part },
                Command::WriteSegment {
                    task: key.task.clone(),
                    first_token: token,
                    pages,
                    durability: Durability::Durable,
                },
            );
        }
        Step::Async
    }

    /// A segment write finished (spill or durable ENQUEUE).
    pub fn segment_written(&mut self, op: OpId, result: Result<ObjectMeta, String>, now: Instant) {
        match self.ops.remove(&op) {
            Some(OpKind::Spill(spill)) => self.spill_written(spill, result, now),
            Some(OpKind::Durable { ticket, part }) => {
                self.durable_written(ticket, part, result, now)
            }
            _ => {
                // Unknown op: an object nobody will refer to.
                if let Ok(meta) = result {
                    self.delete_objects(vec![Arc::new(meta)]);
                }
            }
        }
        self.after(now);
    }

    fn durable_written(
        &mut self,
        ticket: Ticket,
        part: usize,
        result: Result<ObjectMeta, String>,
        now: Instant,
    ) {
        let Some(Parked {
            state:
                ParkState::Writing {
                    parts,
                    remaining,
                    failed,
                    ..
                },
            ..
        }) = self.parked.get_mut(&ticket)
        else {
            if let Ok(meta) = result {
                self.delete_objects(vec![Arc::new(meta)]);
            }
            return;
        };
        match result {
            Ok(meta) => {
                if let Some(slot) = parts.get_mut(part) {
                    *slot = Some(meta);
                }
            }
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
        *remaining -= 1;
        if *remaining > 0 {
            return;
        }
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let ParkState::Writing {
            first_token,
            pages,
            parts,
            failed,
            ..
        } = parked.state
        else {
            return;
        };
        let request = parked.request;
        let Op::Enqueue { key, .. } = &request.op else {
            return;
        };
        if let Some(task) = self.tasks.get_mut(&key.task) {
            task.durable_in_flight = false;
        }
        self.room_freed = true;
        let written: Vec<ObjectMeta> = parts.into_iter().flatten().collect();
        let reply = match failed {
            Some(e) => {
                self.delete_objects(written.into_iter().map(Arc::new).collect());
                self.stats.busy_replies += 1;
                self.busy_behind(parked.conn, None, &request);
                Reply::new(request.error(
                    Status::Busy,
                    format!(
                        "ENQUEUE for buffer {} of task {} (policy always): writing to storage failed, nothing was stored; retry later: {e}",
                        key.buffer, key.task
                    ),
                ))
            }
            None => self.append_durable(&request, key, first_token, pages, written, now),
        };
        self.emit(ticket, MessageType::Enqueue, Outcome::Reply(reply));
        // The next mutation of that connection may go now.
        self.pump(parked.conn, now);
    }

    /// Appends pages written to `objects` (in order, together every page).
    /// Pages stay in memory too when they fit, so consumers are served
    /// without a read.
    fn append_durable(
        &mut self,
        request: &Request,
        key: &BufferKey,
        first_token: u64,
        bodies: Vec<Bytes>,
        objects: Vec<ObjectMeta>,
        now: Instant,
    ) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let refusal = match self.tasks.get(task_id) {
            None => match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => Some((
                    Status::ServerError,
                    format!("task {task_id} was aborted: {reason}"),
                )),
                Some(Gone::Abandoned) => Some((
                    Status::ServerError,
                    dropped_task(task_id, "ENQUEUE", self.config.abandon_after),
                )),
                Some(_) => {
                    // Its consumers went while the pages were written.
                    self.stats.pages_dropped += bodies.len() as u64;
                    self.delete_objects(objects.into_iter().map(Arc::new).collect());
                    return Reply::new(appended(request, bodies.len()));
                }
                None => Some((
                    Status::BadRequest,
                    format!("ENQUEUE for task {task_id}, which is no longer open"),
                )),
            },
            Some(task) if task.drops_pages(buffer_id) => None,
            Some(task) => task
                .refuses_pages(buffer_id)
                .map(|why| (Status::BadRequest, why))
                .or_else(|| {
                    let next = task.next_append_token(buffer_id);
                    (next != first_token).then(|| {
                        (
                            Status::ServerError,
                            format!(
                                "ENQUEUE for buffer {buffer_id} of task {task_id}: pages were written for token {first_token} but the buffer moved to {next}; nothing was stored, retry"
                            ),
                        )
                    })
                }),
        };
        if let Some((status, why)) = refusal {
            self.delete_objects(objects.into_iter().map(Arc::new).collect());
            return Reply::new(request.error(status, why));
        }
        let size: u64 = bodies.iter().map(|b| b.len() as u64).sum();
        let count = bodies.len() as u64;
        let Some(task) = self.tasks.get(task_id) else {
            return Reply::new(appended(request, bodies.len()));
        };
        if task.drops_pages(buffer_id) {
            self.stats.pages_dropped += count;
            self.delete_objects(objects.into_iter().map(Arc::new).collect());
            return Reply::new(appended(request, bodies.len()));
        }
        let charge = size + slot_growth(task, buffer_id, count);
        let keep = self.memory_used + charge <= self.config.memory_limit
            && task.memory() + charge <= self.config.task_memory_limit;
        let chunk = if keep && size > 0 {
            self.next_chunk += 1;
            OWN_CHUNKS | self.next_chunk
        } else {
            0
        };
        // Kept bodies are copied into one allocation of their own (the
        // written ones may sit in a receive buffer shared with others).
        let kept: Option<Vec<Bytes>> = keep.then(|| {
            let own = Bytes::from(bodies.concat());
            let sizes: Vec<u64> = bodies.iter().map(|b| b.len() as u64).collect();
            binx_proto::split_pages(&own, &sizes).unwrap_or_default()
        });
        let mut pages = Vec::with_capacity(bodies.len());
        let mut kept = kept.map(Vec::into_iter);
        for meta in objects {
            let id = self.objects.insert(meta, task_id.clone());
            let sizes = self
                .objects
                .meta(id)
                .map(|m| m.page_sizes.clone())
                .unwrap_or_default();
            for (index, page_size) in sizes.into_iter().enumerate() {
                let body = kept.as_mut().and_then(Iterator::next);
                let Ok(index) = u32::try_from(index) else {
                    break;
                };
                self.next_seq += 1;
                pages.push(Page {
                    size: page_size,
                    chunk: if body.as_ref().is_some_and(|b| !b.is_empty()) {
                        chunk
                    } else {
                        0
                    },
                    body,
                    object: Some((id, index)),
                    seq: self.next_seq,
                    at: now,
                    spilling: false,
                });
            }
        }
        self.append(task_id, buffer_id, pages, size, now);
        self.stats.pages_enqueued += count;
        self.stats.bytes_enqueued += size;
        Reply::new(appended(request, count as usize))
    }

    // --------------------------------------------------------------- NO_MORE_PAGES

    fn no_more_pages(
        &mut self,
        ticket: Ticket,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        now: Instant,
    ) -> Step {
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Step::Done(match self.ended.get(task_id) {
                Some(Gone::Aborted(reason)) => Reply::new(request.error(
                    Status::ServerError,
                    format!("task {task_id} was aborted: {reason}"),
                )),
                Some(Gone::Finished | Gone::FinishedOpenBroadcast) => {
                    Reply::new(request.reply(Status::Ok))
                }
                Some(Gone::Abandoned) => Reply::new(request.error(
                    Status::ServerError,
                    dropped_task(task_id, "NO_MORE_PAGES", self.config.abandon_after),
                )),
                None => Reply::new(request.error(
                    Status::BadRequest,
                    format!(
                        "NO_MORE_PAGES for task {task_id}, which this binxd does not know: it was never opened, or it ended more than {:?} ago (abandon_after)",
                        self.config.abandon_after
                    ),
                )),
            });
        };
        if let Some(id) = buffer
            && let Err(e) = check_buffer_id(task, id, max_buffers)
        {
            return Step::Done(Reply::new(request.error(Status::BadRequest, e)));
        }
        if task.durable_in_flight {
            // A durable write of this task (from another connection) lands
            // first; NO_MORE_PAGES waits for it.
            return Step::Blocked;
        }
        if request.token_named() {
            if task.kind == BufferKind::Partitioned && buffer.is_none() {
                return Step::Done(Reply::new(request.error(
                    Status::BadRequest,
                    format!(
                        "NO_MORE_PAGES for every buffer of partitioned task {task_id} names an append_token, but each buffer ends at its own: finish each buffer with its own append_token, or send this one without"
                    ),
                )));
            }
            let id = buffer.unwrap_or(0);
            // A BROADCAST buffer finished already ends where it ended, not
            // at the shared log's next token (a repeated one is OK).
            let next = match (task.kind, buffer.and_then(|b| task.buffers.get(&b))) {
                (BufferKind::Broadcast, Some(b)) => {
                    b.end.unwrap_or_else(|| task.next_append_token(id))
                }
                _ => task.next_append_token(id),
            };
            if !task.drops_pages(id)
                && let Some(refusal) = self.misnumbered(request, task_id, buffer, next)
            {
                return Step::Done(refusal);
            }
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            return Step::Async;
        };
        task.finish(buffer, now);
        task.last_activity = now;
        let policy = task.policy;
        let done = task.is_done();
        self.dirty.push((task_id.clone(), buffer));
        if buffer.is_none() {
            self.dirty.push((task_id.clone(), None));
        }
        if done {
            let how = self.tasks.get(task_id).map_or(Gone::Finished, finished);
            self.end_task(task_id, how, now);
            return Step::Done(Reply::new(request.reply(Status::Ok)));
        }
        if !policy.commits() {
            if buffer.is_none() {
                self.release_producers(task_id, now);
            }
            return Step::Done(Reply::new(request.reply(Status::Ok)));
        }
        if policy == SpoolPolicy::Commit && !self.spooled_for_commit(task_id, buffer) {
            // The finished pages still in memory go to storage first
            // (`pick_spill`); `drive_commit_waits` goes on from there.
            if let Some(p) = self.parked.get_mut(&ticket) {
                p.state = ParkState::Spooling;
                if let Some(at) = p.deadline.take() {
                    self.deadlines.remove(&(at, ticket));
                }
            }
            self.spooling.insert(ticket);
            return Step::Async;
        }
        self.start_commit(ticket, request, task_id, buffer, now)
    }

    /// Whether every page a NO_MORE_PAGES of a `commit` task finished is in
    /// storage (so its markers can name them all).
    fn spooled_for_commit(&self, task_id: &TaskId, buffer: Option<u64>) -> bool {
        let Some(task) = self.tasks.get(task_id) else {
            return true;
        };
        match (task.kind, buffer) {
            (BufferKind::Partitioned, Some(b)) => task.log_fully_spooled(LogId::Buffer(b)),
            (BufferKind::Partitioned, None) => task
                .buffers
                .keys()
                .all(|&b| task.log_fully_spooled(LogId::Buffer(b))),
            // One buffer: the shared pages below its end (more may come
            // for the others meanwhile).
            (BufferKind::Broadcast, Some(b)) => match task.buffers.get(&b).and_then(|b| b.end) {
                Some(end) => task.shared.spooled_below(end),
                None => task.log_fully_spooled(LogId::Shared),
            },
            (BufferKind::Broadcast, None) => task.log_fully_spooled(LogId::Shared),
            (BufferKind::Arbitrary, _) => true,
        }
    }

    /// Writes the markers of the buffers a NO_MORE_PAGES finished, then
    /// (task-wide) the task's manifest, before it is answered.
    fn start_commit(
        &mut self,
        ticket: Ticket,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        now: Instant,
    ) -> Step {
        let plans = match self.tasks.get_mut(task_id) {
            Some(task) => task.commit_plans(buffer, now),
            None => Vec::new(),
        };
        let mut waiting = 0usize;
        for (buffer_id, end, objects) in plans {
            if self.commit(task_id, buffer_id, end, objects, Some(ticket)) {
                waiting += 1;
            }
        }
        if waiting == 0 {
            return self.after_markers(ticket, request, task_id, buffer, now);
        }
        if let Some(p) = self.parked.get_mut(&ticket) {
            p.state = ParkState::Committing {
                remaining: waiting,
                failed: None,
            };
        }
        Step::Async
    }

    /// Every marker a NO_MORE_PAGES waited for is written: a task-wide one
    /// writes the task's manifest (once) before its OK.
    fn after_markers(
        &mut self,
        ticket: Ticket,
        request: &Request,
        task_id: &TaskId,
        buffer: Option<u64>,
        now: Instant,
    ) -> Step {
        let plan = match self.tasks.get(task_id) {
            Some(task)
                if buffer.is_none() && !task.manifest && task.kind != BufferKind::Arbitrary =>
            {
                task.manifest_buffers().map(|buffers| ManifestPlan {
                    task: task_id.clone(),
                    buffers,
                })
            }
            _ => None,
        };
        let Some(plan) = plan else {
            if buffer.is_none() {
                self.release_producers(task_id, now);
            }
            return Step::Done(Reply::new(request.reply(Status::Ok)));
        };
        if let Some(p) = self.parked.get_mut(&ticket) {
            p.state = ParkState::WritingManifest;
            if let Some(at) = p.deadline.take() {
                self.deadlines.remove(&(at, ticket));
            }
        }
        self.new_op(
            OpKind::Manifest {
                ticket: Some(ticket),
            },
            Command::WriteManifest(plan),
        );
        Step::Async
    }

    /// NO_MORE_PAGES of `commit` tasks waiting for spills: those whose
    /// pages are all in storage now commit; while spilling is paused after
    /// a failure, they are answered BUSY (the buffer stays finished, and
    /// NO_MORE_PAGES again commits it).
    fn drive_commit_waits(&mut self, now: Instant) {
        let paused = self.spill_retry_at.is_some_and(|at| now < at);
        for ticket in self.spooling.clone() {
            let Some(parked) = self.parked.get(&ticket) else {
                self.spooling.remove(&ticket);
                continue;
            };
            let request = parked.request.clone();
            let Op::NoMorePages { task, buffer, .. } = &request.op else {
                self.spooling.remove(&ticket);
                continue;
            };
            let (task_id, buffer) = (task.clone(), *buffer);
            let step = if !self.tasks.contains_key(&task_id) {
                let reply = match self.ended.get(&task_id) {
                    Some(Gone::Aborted(reason)) => request.error(
                        Status::ServerError,
                        format!("task {task_id} was aborted: {reason}"),
                    ),
                    _ => request.reply(Status::Ok),
                };
                Step::Done(Reply::new(reply))
            } else if self.spooled_for_commit(&task_id, buffer) {
                self.spooling.remove(&ticket);
                self.start_commit(ticket, &request, &task_id, buffer, now)
            } else if paused {
                self.stats.busy_replies += 1;
                let conn = parked.conn;
                self.busy_behind(conn, Some(ticket), &request);
                Step::Done(Reply::new(request.error(
                    Status::Busy,
                    format!(
                        "NO_MORE_PAGES for {} of task {task_id}: the buffer is finished, but writing its pages to storage failed; retry",
                        buffer.map_or("every buffer".to_string(), |b| format!("buffer {b}"))
                    ),
                )))
            } else {
                continue;
            };
            if let Step::Done(reply) = step {
                let conn = self.parked.get(&ticket).map(|p| p.conn);
                self.unpark(ticket);
                self.emit(ticket, MessageType::NoMorePages, Outcome::Reply(reply));
                if let Some(conn) = conn {
                    self.pump(conn, now);
                }
            }
        }
    }

    /// Writes (or waits for) the commit marker of a finished buffer; true
    /// when `waiter` must wait for a write.
    fn commit(
        &mut self,
        task_id: &TaskId,
        buffer_id: u64,
        end_token: u64,
        objects: Vec<ObjectId>,
        waiter: Option<Ticket>,
    ) -> bool {
        let key = (task_id.clone(), buffer_id);
        if let Some(entry) = self.markers.entries.get_mut(&key) {
            return match entry.state {
                MarkerState::Writing(_) => {
                    entry.waiters.extend(waiter);
                    waiter.is_some()
                }
                MarkerState::Written | MarkerState::Deleting(_) => false,
            };
        }
        let mut metas = Vec::with_capacity(objects.len());
        for &id in &objects {
            self.objects.add_marker(id);
            if let Some(meta) = self.objects.meta(id) {
                metas.push(meta.clone());
            }
        }
        self.next_op += 1;
        let op = OpId(self.next_op);
        self.ops.insert(op, OpKind::Marker { key: key.clone() });
        self.events.push_back(Event::Command {
            op,
            command: Command::WriteMarker(MarkerPlan {
                task: task_id.clone(),
                buffer: buffer_id,
                end_token,
                objects: metas,
                shared: self
                    .tasks
                    .get(task_id)
                    .is_some_and(|t| t.kind == BufferKind::Broadcast),
            }),
        });
        self.markers.entries.insert(
            key,
            MarkerEntry {
                objects,
                state: MarkerState::Writing(op),
                delete_after_write: false,
                waiters: waiter.into_iter().collect(),
            },
        );
        waiter.is_some()
    }

    /// A commit marker write finished.
    pub fn marker_written(&mut self, op: OpId, result: Result<(), String>, now: Instant) {
        let Some(OpKind::Marker { key }) = self.ops.remove(&op) else {
            return;
        };
        let Some(entry) = self.markers.entries.get_mut(&key) else {
            return;
        };
        let waiters = std::mem::take(&mut entry.waiters);
        match &result {
            Ok(()) => {
                entry.state = MarkerState::Written;
                if entry.delete_after_write {
                    self.release_marker(&key.0, key.1);
                } else if let Some(b) = self
                    .tasks
                    .get_mut(&key.0)
                    .and_then(|t| t.buffers.get_mut(&key.1))
                {
                    b.committed_at.get_or_insert(now);
                }
            }
            Err(e) => {
                tracing::warn!(task = %key.0, buffer = key.1, error = %e, "a commit marker could not be written");
                // Not written: its objects are free again, and a repeated
                // NO_MORE_PAGES writes it anew.
                if let Some(entry) = self.markers.entries.remove(&key) {
                    let mut deletes = Vec::new();
                    for id in entry.objects {
                        if let Some(meta) = self.objects.drop_marker(id) {
                            deletes.push(meta);
                        }
                    }
                    self.delete_objects(deletes);
                }
                if let Some(b) = self
                    .tasks
                    .get_mut(&key.0)
                    .and_then(|t| t.buffers.get_mut(&key.1))
                {
                    b.marker = false;
                }
            }
        }
        for ticket in waiters {
            self.commit_answered(ticket, &key, result.as_ref().err(), now);
        }
        self.after(now);
    }

    fn commit_answered(
        &mut self,
        ticket: Ticket,
        key: &(TaskId, u64),
        error: Option<&String>,
        now: Instant,
    ) {
        let Some(Parked {
            state: ParkState::Committing { remaining, failed },
            ..
        }) = self.parked.get_mut(&ticket)
        else {
            return;
        };
        if let Some(e) = error {
            failed.get_or_insert_with(|| {
                format!(
                    "NO_MORE_PAGES for buffer {} of task {}: the buffer is finished, but its commit marker could not be written; retry: {e}",
                    key.1, key.0
                )
            });
        }
        *remaining -= 1;
        if *remaining > 0 {
            return;
        }
        let failed = failed.take();
        if failed.is_none()
            && let Some(p) = self.parked.get(&ticket)
            && let Op::NoMorePages { task, buffer, .. } = &p.request.op
        {
            let (request, task, buffer) = (p.request.clone(), task.clone(), *buffer);
            if let Step::Async = self.after_markers(ticket, &request, &task, buffer, now) {
                return;
            }
        }
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let reply = match failed {
            Some(why) => {
                self.stats.busy_replies += 1;
                self.busy_behind(parked.conn, None, &parked.request);
                Reply::new(parked.request.error(Status::Busy, why))
            }
            None => Reply::new(parked.request.reply(Status::Ok)),
        };
        self.emit(ticket, MessageType::NoMorePages, Outcome::Reply(reply));
        self.pump(parked.conn, now);
    }

    /// The marker of a buffer that went must go; its objects are released
    /// once it is deleted.
    fn release_marker(&mut self, task_id: &TaskId, buffer_id: u64) {
        let key = (task_id.clone(), buffer_id);
        let Some(entry) = self.markers.entries.get_mut(&key) else {
            return;
        };
        match entry.state {
            MarkerState::Writing(_) => entry.delete_after_write = true,
            MarkerState::Deleting(_) => {}
            MarkerState::Written => {
                self.next_op += 1;
                let op = OpId(self.next_op);
                entry.state = MarkerState::Deleting(op);
                self.ops.insert(op, OpKind::MarkerDelete { key });
                self.events.push_back(Event::Command {
                    op,
                    command: Command::DeleteMarker {
                        task: task_id.clone(),
                        buffer: buffer_id,
                    },
                });
            }
        }
    }

    /// A commit marker deletion finished. Only a deleted marker releases
    /// its objects; one that could not be deleted keeps them (the TTL
    /// pruner takes both).
    pub fn marker_deleted(&mut self, op: OpId, result: Result<(), String>, now: Instant) {
        let Some(OpKind::MarkerDelete { key }) = self.ops.remove(&op) else {
            return;
        };
        let Some(entry) = self.markers.entries.remove(&key) else {
            return;
        };
        match result {
            Ok(()) => {
                let mut deletes = Vec::new();
                for id in entry.objects {
                    if let Some(meta) = self.objects.drop_marker(id) {
                        deletes.push(meta);
                    }
                }
                self.delete_objects(deletes);
            }
            Err(e) => {
                tracing::warn!(task = %key.0, buffer = key.1, error = %e, "a commit marker could not be deleted; it and its objects are left to the TTL pruner");
                for id in entry.objects {
                    self.objects.keep_for_ttl(id);
                    self.stats.deletes_left_to_ttl += 1;
                }
            }
        }
        self.after(now);
    }

    // --------------------------------------------------------------- objects

    /// Asks for the deletion of objects nothing refers to, within the
    /// bound on deletions in flight (past it, the TTL pruner takes them).
    fn delete_objects(&mut self, deletes: Vec<Arc<ObjectMeta>>) {
        let max = self.spool().map_or(0, |s| s.max_pending_deletes);
        for meta in deletes {
            if self.deletes_in_flight >= max {
                self.stats.deletes_left_to_ttl += 1;
                tracing::warn!(object = %meta.name, "deletion queue full; the TTL pruner will remove this object");
                continue;
            }
            self.deletes_in_flight += 1;
            self.new_op(OpKind::ObjectDelete, Command::DeleteObject(meta));
        }
    }

    /// An object deletion finished (a failure leaves it to the TTL pruner).
    pub fn object_deleted(&mut self, op: OpId, result: Result<(), String>, now: Instant) {
        if let Some(OpKind::ObjectDelete) = self.ops.remove(&op) {
            self.deletes_in_flight = self.deletes_in_flight.saturating_sub(1);
            if let Err(e) = result {
                tracing::warn!(error = %e, "could not delete a released spool object; the TTL pruner will");
            }
        }
        self.after(now);
    }

    // --------------------------------------------------------------- spilling

    fn spill_written(&mut self, spill: Spill, result: Result<ObjectMeta, String>, now: Instant) {
        let Spill {
            task: task_id,
            log,
            first_token,
            count,
            bytes,
        } = spill;
        self.spills_in_flight -= 1;
        self.spill_bytes_in_flight -= bytes;
        let (object, failed) = match result {
            Ok(meta) => (Some(self.objects.insert(meta, task_id.clone())), false),
            Err(e) => {
                tracing::warn!(task = %task_id, token = first_token, error = %e, "spilling pages to storage failed; they stay in memory");
                (None, true)
            }
        };
        if let Some(task) = self.tasks.get_mut(&task_id) {
            let before = task.memory();
            let referring = task.finish_spill(log, first_token, count, object, &mut self.objects);
            let after = task.memory();
            self.account(before, after);
            if object.is_some() {
                self.stats.pages_spilled += referring;
            }
        }
        if let Some(id) = object
            && let Some(meta) = self.objects.collect(id)
        {
            // Every page was acknowledged while it was written.
            self.delete_objects(vec![meta]);
        }
        if failed {
            // Back off: no spill for a while; the age check wakes the core
            // then.
            let retry = now + SPILL_RETRY_AFTER;
            self.spill_retry_at = Some(retry);
            self.next_age_check = Some(retry);
        }
    }

    /// Starts the spills that are due: room for blocked ENQUEUEs of
    /// `overflow` tasks (the task's oldest pages held only in memory first),
    /// pages older than `spill_after`, and, while draining, what finished
    /// buffers still hold only in memory.
    fn drive_spills(&mut self, now: Instant) {
        let Some(rules) = self.config.spool.clone() else {
            return;
        };
        while self.spills_in_flight < rules.spill_concurrency.max(1) {
            let Some((task_id, log, older_than)) = self.pick_spill(now, &rules) else {
                break;
            };
            let Some(task) = self.tasks.get_mut(&task_id) else {
                break;
            };
            let Some(run) = task.take_spill_run(
                log,
                rules.spill_target_bytes,
                rules.spill_max_bytes,
                older_than,
            ) else {
                break;
            };
            let bytes: u64 = run.pages.iter().map(|p| p.len() as u64).sum();
            self.spills_in_flight += 1;
            self.spill_bytes_in_flight += bytes;
            self.new_op(
                OpKind::Spill(Spill {
                    task: task_id.clone(),
                    log,
                    first_token: run.first_token,
                    count: run.pages.len(),
                    bytes,
                }),
                Command::WriteSegment {
                    task: task_id,
                    first_token: run.first_token,
                    pages: run.pages,
                    durability: Durability::Overflow,
                },
            );
        }
    }

    fn pick_spill(
        &self,
        now: Instant,
        rules: &SpoolRules,
    ) -> Option<(TaskId, LogId, Option<Instant>)> {
        if self.spill_retry_at.is_some_and(|at| now < at) {
            return None;
        }
        let overflow = || self.tasks.values().filter(|t| t.policy.spills());
        let need: u64 = self.room_wanted.values().map(|(_, n)| n).sum();
        if need > self.spill_bytes_in_flight {
            for (own, _) in self.room_wanted.values() {
                let pick = match own {
                    Some(task_id) => self
                        .tasks
                        .get(task_id)
                        .and_then(|t| t.oldest_spillable().map(|(log, _, _)| (t.id.clone(), log))),
                    None => overflow()
                        .filter_map(|t| {
                            t.oldest_spillable()
                                .map(|(log, seq, _)| (seq, t.id.clone(), log))
                        })
                        .min_by_key(|(seq, _, _)| *seq)
                        .map(|(_, id, log)| (id, log)),
                };
                if let Some((task, log)) = pick {
                    return Some((task, log, None));
                }
            }
        }
        // Ahead of need: past three quarters of the memory limit (the
        // daemon's, or an overflow task's own), the oldest pages go to
        // storage while the producer keeps enqueuing, so room is there
        // before an ENQUEUE has to wait for it.
        let high_water = |limit: u64| limit / 4 * 3;
        let daemon_high = self.memory_used.saturating_sub(self.spill_bytes_in_flight)
            > high_water(self.config.memory_limit);
        let ahead = overflow()
            .filter(|t| daemon_high || t.memory() > high_water(self.config.task_memory_limit))
            .filter_map(|t| {
                t.oldest_spillable()
                    .map(|(log, seq, _)| (seq, t.id.clone(), log))
            })
            .min_by_key(|(seq, _, _)| *seq);
        if let Some((_, task, log)) = ahead {
            return Some((task, log, None));
        }
        if let Some(older) = now.checked_sub(rules.spill_after) {
            let aged = overflow()
                .filter_map(|t| {
                    t.oldest_spillable()
                        .map(|(log, seq, at)| (seq, at, t.id.clone(), log))
                })
                .filter(|(_, at, _, _)| *at <= older)
                .min_by_key(|(seq, ..)| *seq);
            if let Some((_, _, task, log)) = aged {
                return Some((task, log, Some(older)));
            }
        }
        // Finished buffers of `commit` tasks (their NO_MORE_PAGES waits for
        // them), and while draining those of `overflow` tasks too.
        for t in overflow().filter(|t| self.drain_spooling || t.policy == SpoolPolicy::Commit) {
            let mut logs = t.committable_logs();
            if t.broadcast_commit_waiting() {
                logs.push(LogId::Shared);
            }
            for log in logs {
                if !t.log_fully_spooled(log) {
                    // Only pages not yet spilling are taken again.
                    let spillable = match log {
                        LogId::Shared => t.shared.spillable_bytes() > 0,
                        LogId::Buffer(id) => t
                            .buffers
                            .get(&id)
                            .is_some_and(|b| b.log.spillable_bytes() > 0),
                    };
                    if spillable {
                        return Some((t.id.clone(), log, None));
                    }
                }
            }
        }
        None
    }

    // --------------------------------------------------------------- drain

    /// Stops accepting new tasks (existing ones go on); with a store, the
    /// pages of finished `overflow` buffers held only in memory are spooled
    /// and committed, so consumers can finish from storage once this daemon
    /// is gone. False when a drain had already started.
    pub fn start_drain(&mut self, now: Instant) -> bool {
        if std::mem::replace(&mut self.draining, true) {
            return false;
        }
        match self.spool() {
            Some(rules) if rules.always_refusal.is_none() => self.drain_spooling = true,
            Some(rules) => {
                tracing::warn!(
                    "draining: held pages are not spooled, as their buffers could not be committed: {}",
                    rules.always_refusal.clone().unwrap_or_default()
                );
            }
            None => {}
        }
        self.after(now);
        true
    }

    /// While draining: once nothing is left to spill, commits every log
    /// that is fully in storage.
    fn drive_drain(&mut self, now: Instant) {
        // After a failed spill, the spills resume when the pause ends: the
        // drain waits for them rather than committing without them.
        if !self.drain_spooling
            || self.spills_in_flight > 0
            || self.spill_retry_at.is_some_and(|at| now < at)
        {
            return;
        }
        self.drain_spooling = false;
        let ids: Vec<TaskId> = self
            .tasks
            .values()
            .filter(|t| t.policy.spills())
            .map(|t| t.id.clone())
            .collect();
        let mut committed = 0usize;
        for task_id in ids {
            let plans = match self.tasks.get_mut(&task_id) {
                Some(task) => task.drain_commit_plans(now),
                None => continue,
            };
            for (buffer, end, objects) in plans {
                self.commit(&task_id, buffer, end, objects, None);
                committed += 1;
            }
        }
        if committed > 0 {
            tracing::info!(
                buffers_committed = committed,
                "draining: unacknowledged pages of finished buffers are in storage under commit markers; their consumers can finish from there"
            );
        }
    }

    /// Whether [`Core::start_drain`] was called: new tasks are refused.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Object deletions asked for and not yet done.
    pub fn deletes_in_flight(&self) -> u64 {
        self.deletes_in_flight as u64
    }

    /// Pages held by all tasks: what stopping now would lose.
    pub fn pages_held(&self) -> u64 {
        self.tasks.values().map(Task::pages_held).sum()
    }

    // --------------------------------------------------------------- timers

    /// Applies what is due at `now`: expired waits answer (NO_DATA, BUSY),
    /// abandoned buffers are dropped, old pages spill.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.start_clock(now);
        while let Some(&(at, ticket)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.remove(&(at, ticket));
            let Some(parked) = self.parked.get(&ticket) else {
                continue;
            };
            match parked.state {
                ParkState::DataWait => self.retry_data(ticket, now, false),
                ParkState::Queued { .. } => {
                    let conn = parked.conn;
                    self.blocked.remove(&ticket);
                    if let Step::Done(reply) = self.step_mutation(ticket, now) {
                        let kind = self
                            .parked
                            .get(&ticket)
                            .map_or(MessageType::Enqueue, |p| p.request.kind());
                        self.unpark(ticket);
                        self.emit(ticket, kind, Outcome::Reply(reply));
                        self.pump(conn, now);
                    } else {
                        self.blocked.insert(ticket);
                    }
                }
                _ => {}
            }
        }
        if self.next_sweep.is_some_and(|at| at <= now) {
            self.sweep(now);
            self.next_sweep = Some(now + self.sweep_period());
        }
        if self.next_age_check.is_some_and(|at| at <= now) {
            self.next_age_check = None;
        }
        self.after(now);
    }

    /// Drops buffers no consumer polled for `abandon_after`, and tasks with
    /// nothing left that nobody touched for as long; forgets old tombstones.
    fn sweep(&mut self, now: Instant) {
        let abandon_after = self.config.abandon_after;
        let ttl = self.spool().map(|s| s.ttl);
        let mut stale: Vec<(TaskId, u64)> = Vec::new();
        let mut idle: Vec<TaskId> = Vec::new();
        let mut evict: Vec<(TaskId, u64)> = Vec::new();
        for (task_id, task) in &self.tasks {
            let producing = !task.producers.is_empty();
            // A task that commits its output, while its producer still
            // holds a connection, may produce for longer than the abandon
            // time before anyone reads (fault-tolerant execution reads a
            // stage's output only once it finished): none of its buffers
            // is dropped. Others lose the buffers nobody polls (their
            // consumer went); the task itself stays while it is produced.
            if producing && task.policy.commits() {
                continue;
            }
            for (&id, b) in &task.buffers {
                if b.gone.is_some() || now.saturating_duration_since(b.last_poll) < abandon_after {
                    continue;
                }
                match b.committed_at {
                    // Committed: read from storage until its objects may
                    // expire (the first was written after the task was
                    // born); nobody reads it now, so its memory goes.
                    Some(_)
                        if ttl.is_none_or(|ttl| now.saturating_duration_since(task.born) < ttl) =>
                    {
                        evict.push((task_id.clone(), id));
                    }
                    _ => stale.push((task_id.clone(), id)),
                }
            }
            // A member of a fixed BROADCAST set that no consumer ever asked
            // for holds every page of the set (each is freed once all
            // members have it): abandoned like one that stopped asking.
            if task.kind == BufferKind::Broadcast
                && let Some(count) = task.fixed_count
                && (task.buffers.len() as u64) < count
                && now.saturating_duration_since(task.opened_at) >= abandon_after
            {
                stale.extend(
                    (0..count)
                        .filter(|id| !task.buffers.contains_key(id))
                        .map(|id| (task_id.clone(), id)),
                );
            }
            let untouched = now.saturating_duration_since(task.last_activity) >= abandon_after;
            if untouched && !producing && task.buffers.values().all(|b| b.gone.is_some()) {
                idle.push(task_id.clone());
            }
        }
        for (task_id, buffer_id) in evict {
            if let Some(task) = self.tasks.get_mut(&task_id) {
                let before = task.memory();
                let freed = task.evict_stored(buffer_id);
                let after = task.memory();
                self.account(before, after);
                if freed > 0 {
                    tracing::debug!(task = %task_id, buffer = buffer_id, freed, "committed buffer unread for the abandon time: its memory is freed; it is read from storage");
                }
            }
        }
        for (task_id, buffer_id) in stale {
            tracing::warn!(
                task = %task_id, buffer = buffer_id,
                "dropping abandoned buffer: no consumer polled it for {abandon_after:?}"
            );
            self.stats.abandoned_buffers += 1;
            self.drop_buffer(&task_id, buffer_id, BufferGone::Abandoned, now);
        }
        for task_id in idle {
            let Some(task) = self.tasks.get(&task_id) else {
                continue;
            };
            let how = if task.is_done() && !task.abandoned_any {
                finished(task)
            } else {
                tracing::warn!(task = %task_id, "dropping a task nobody touched for {abandon_after:?}; its consumers will see it as abandoned");
                Gone::Abandoned
            };
            self.end_task(&task_id, how, now);
        }
        self.ended.expire(now);
        self.early.expire(now);
        let idle_remotes = self
            .spool()
            .map_or(Duration::from_secs(600), |s| s.failover_after * 10)
            .max(abandon_after);
        self.remotes.expire(now, idle_remotes);
    }

    /// After any change: wake DATA waiters of changed buffers, retry
    /// ENQUEUEs waiting for room, start due spills and drain steps.
    fn after(&mut self, now: Instant) {
        for _ in 0..4 {
            let dirty = std::mem::take(&mut self.dirty);
            for (task, buffer) in dirty {
                self.wake_data(&task, buffer, now);
            }
            if std::mem::take(&mut self.room_freed) && !self.blocked.is_empty() {
                let heads: Vec<Ticket> = self.blocked.iter().copied().collect();
                for ticket in heads {
                    self.blocked.remove(&ticket);
                    let Some(conn) = self.parked.get(&ticket).map(|p| p.conn) else {
                        continue;
                    };
                    if self.conns.get(&conn).and_then(|c| c.queue.front()) == Some(&ticket) {
                        self.pump(conn, now);
                    }
                }
            }
            self.drive_spills(now);
            self.drive_commit_waits(now);
            self.drive_drain(now);
            if self.dirty.is_empty() && !self.room_freed {
                break;
            }
        }
        self.stats.memory_high_water = self.stats.memory_high_water.max(self.memory_used);
        if self.next_age_check.is_none()
            && let Some(rules) = &self.config.spool
            && self
                .tasks
                .values()
                .any(|t| t.policy.spills() && t.memory() > 0)
        {
            self.next_age_check =
                Some(now + (rules.spill_after / 4).max(Duration::from_millis(100)));
        }
    }

    fn wake_data(&mut self, task: &TaskId, buffer: Option<u64>, now: Instant) {
        let Some(waiters) = self.data_waiters.get(task) else {
            return;
        };
        let tickets: Vec<Ticket> = match buffer {
            Some(b) => waiters
                .get(&b)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default(),
            None => waiters.values().flatten().copied().collect(),
        };
        for ticket in tickets {
            self.retry_data(ticket, now, true);
        }
    }

    /// Moves the daemon's count by a task's change from `before` to `after`.
    fn account(&mut self, before: u64, after: u64) {
        self.memory_used = self.memory_used.saturating_sub(before) + after;
        if after < before {
            self.room_freed = true;
        }
    }

    // --------------------------------------------------------------- proxy

    fn proxy(
        &mut self,
        ticket: Ticket,
        conn: ConnId,
        request: Request,
        now: Instant,
    ) -> Option<Reply> {
        let remote: Arc<str> = Arc::from(request.remote.clone().unwrap_or_default());
        let Some(key) = request.buffer_key().cloned() else {
            return Some(Reply::new(request.error(
                Status::BadRequest,
                "only DATA, ACK and DELETE may name a remote",
            )));
        };
        if !self.config.forward_allowed_peers.allows(&remote) {
            self.stats.forwards_refused += 1;
            return Some(Reply::new(request.error(
                Status::BadRequest,
                format!(
                    "remote {remote} is not in this binxd's forward_allowed_peers ({}); nothing was sent to it",
                    self.config.forward_allowed_peers
                ),
            )));
        }
        let rkey: RemoteKey = (remote.clone(), key.task.clone(), key.buffer);
        match self.remotes.states.get_mut(&rkey) {
            Some(RemoteState::Lost { marker, used }) => {
                *used = now;
                let marker = marker.clone();
                return self.serve_lost(ticket, &request, &rkey, marker, now);
            }
            Some(RemoteState::Released { .. }) if matches!(request.op, Op::Delete { .. }) => {
                return Some(Reply::new(request.reply(Status::Ok)));
            }
            // Anything else on a released buffer is asked of the remote again.
            Some(RemoteState::Released { .. }) => {
                self.remotes.states.remove(&rkey);
            }
            _ => {}
        }
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.outstanding >= self.config.max_outstanding_per_connection)
        {
            return Some(self.too_many(&request));
        }
        let mut wire = request.to_wire();
        wire.remote.clear();
        self.park(ticket, conn, request, ParkState::Forwarding, None);
        self.new_op(
            OpKind::Forward {
                ticket: Some(ticket),
            },
            Command::Forward {
                remote: remote.to_string(),
                request: Box::new(wire),
            },
        );
        None
    }

    /// Answers a proxy request of a buffer its producer lost, from the
    /// buffer's commit marker. ACK and DELETE still go to the remote, in
    /// case it is alive and holds the buffer.
    fn serve_lost(
        &mut self,
        ticket: Ticket,
        request: &Request,
        rkey: &RemoteKey,
        marker: Arc<CommitMarker>,
        now: Instant,
    ) -> Option<Reply> {
        let _ = ticket;
        match &request.op {
            Op::Ack { .. } | Op::Delete { .. } => {
                let mut wire = request.to_wire();
                wire.remote.clear();
                self.new_op(
                    OpKind::Forward { ticket: None },
                    Command::Forward {
                        remote: rkey.0.to_string(),
                        request: Box::new(wire),
                    },
                );
                if matches!(request.op, Op::Delete { .. }) {
                    self.remotes
                        .states
                        .insert(rkey.clone(), RemoteState::Released { at: now });
                    self.new_op(OpKind::Release, Command::ReleaseCommitted(marker));
                }
                Some(Reply::new(request.reply(Status::Ok)))
            }
            Op::Data(q) => {
                let q = q.clone();
                match self.plan_from_marker(request, &q, &marker) {
                    Outcome::Reply(reply) => Some(reply),
                    Outcome::Plan(mut plan) => {
                        self.stats.failover_replies += 1;
                        let _ = now;
                        self.next_lease += 1;
                        let lease = LeaseId(self.next_lease);
                        self.failover_leases.insert(lease, rkey.clone());
                        plan.lease = Some(lease);
                        plan.on_lost = Status::Timeout;
                        self.current_outcome = Some(Outcome::Plan(plan));
                        None
                    }
                }
            }
            _ => Some(Reply::new(request.error(
                Status::BadRequest,
                "only DATA, ACK and DELETE may name a remote",
            ))),
        }
    }

    /// A DATA reply from a commit marker: the pages from the token on,
    /// exactly as the producer would have sent them.
    fn plan_from_marker(&self, request: &Request, q: &DataQuery, marker: &CommitMarker) -> Outcome {
        let (task_id, buffer_id, token) = (&q.key.task, q.key.buffer, q.token);
        if token > marker.end_token {
            return Outcome::Reply(Reply::new(request.error(
                Status::BadRequest,
                format!(
                    "token {token} of buffer {buffer_id} of task {task_id} is beyond its end {} (commit marker)",
                    marker.end_token
                ),
            )));
        }
        let max = match q.max_size {
            0 => self.config.default_reply_size,
            n => n,
        }
        .min(self.config.max_reply_size)
        .max(1);
        // Pages from `token` on, by the marker's segments.
        let mut pages: Vec<(Arc<ObjectMeta>, u32, u64)> = Vec::new();
        let mut sizes = Vec::new();
        let mut expected = None::<u64>;
        for segment in &marker.segments {
            let end = segment.first_token + segment.page_sizes.len() as u64;
            if end <= token {
                continue;
            }
            let start = expected.unwrap_or(token);
            if segment.first_token > start {
                return Outcome::Reply(Reply::new(request.error(
                    Status::ServerError,
                    format!(
                        "DATA for buffer {buffer_id} of task {task_id} at token {token}, from storage: the commit marker has no segment for token {start}"
                    ),
                )));
            }
            let meta = Arc::new(segment.clone());
            for (i, &size) in segment.page_sizes.iter().enumerate() {
                let t = segment.first_token + i as u64;
                // A segment may hold pages past the buffer's end (BROADCAST
                // pages of a shared object): never served as this buffer's.
                if t < start || t >= marker.end_token {
                    continue;
                }
                if q.sizes_only {
                    if sizes.len() < MAX_REPLY_PAGES {
                        sizes.push(size);
                    }
                } else {
                    pages.push((meta.clone(), i as u32, size));
                }
            }
            expected = Some(end);
        }
        let covered = expected.unwrap_or(token).max(token);
        if covered < marker.end_token {
            return Outcome::Reply(Reply::new(request.error(
                Status::ServerError,
                format!(
                    "DATA for buffer {buffer_id} of task {task_id} at token {token}, from storage: the commit marker covers tokens up to {covered} of {}",
                    marker.end_token
                ),
            )));
        }
        if q.sizes_only {
            let mut header = request.reply(Status::Ok);
            header.remaining_bytes = sizes;
            header.buffer_complete = token == marker.end_token;
            return Outcome::Reply(Reply::new(header));
        }
        let mut planned = Vec::new();
        let mut total = 0u64;
        // Each object is read back whole: at most `max_stored_reply_size`
        // of them, as for spilled pages.
        let mut stored = 0u64;
        let mut last_object: Option<Arc<ObjectMeta>> = None;
        for (meta, index, size) in pages {
            let object_bytes = if last_object.as_ref().is_some_and(|o| Arc::ptr_eq(o, &meta)) {
                0
            } else {
                meta.page_bytes()
            };
            if planned.len() >= MAX_REPLY_PAGES
                || (!planned.is_empty()
                    && (total + size > max
                        || stored + object_bytes > self.config.max_stored_reply_size))
            {
                break;
            }
            total += size;
            stored += object_bytes;
            last_object = Some(meta.clone());
            planned.push(PlannedPage::Object {
                meta,
                index,
                whole: false,
            });
        }
        let count = planned.len() as u64;
        let mut header = request.reply(Status::Ok);
        header.page_next_token = token + count;
        header.buffer_complete = token + count == marker.end_token;
        if planned.is_empty() {
            return Outcome::Reply(complete_at(request, token));
        }
        let what =
            format!("DATA for buffer {buffer_id} of task {task_id} at token {token}, from storage");
        Outcome::Plan(DataPlan::build(header, what, planned))
    }

    /// A forwarded request came back (or failed).
    pub fn forwarded(&mut self, op: OpId, result: Result<Frame<BinReply>, String>, now: Instant) {
        let Some(OpKind::Forward { ticket }) = self.ops.remove(&op) else {
            return;
        };
        let Some(ticket) = ticket else {
            return;
        };
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        let request = parked.request.clone();
        let remote: Arc<str> = Arc::from(request.remote.clone().unwrap_or_default());
        let Some(key) = request.buffer_key().cloned() else {
            return;
        };
        let rkey: RemoteKey = (remote.clone(), key.task.clone(), key.buffer);
        let (reply, failing) = match result {
            Ok(frame) => {
                let no_data = frame.header.status == Status::NoData as i32
                    && matches!(request.op, Op::Data(_));
                let timeout = frame.header.status == Status::Timeout as i32;
                let mut header = frame.header;
                header.request_id = request.id;
                let reply = Reply {
                    header,
                    body: if frame.body.is_empty() {
                        Vec::new()
                    } else {
                        vec![frame.body]
                    },
                };
                (reply, no_data || timeout)
            }
            Err(reason) => (
                Reply::new(request.error(
                    Status::Timeout,
                    format!(
                        "no reply from remote {} for buffer {} of task {}: {reason}; retry",
                        binx_proto::truncate(&remote, 64),
                        key.buffer,
                        key.task
                    ),
                )),
                true,
            ),
        };
        if !failing {
            if let Some(RemoteState::Failing { .. }) = self.remotes.states.get(&rkey) {
                self.remotes.states.remove(&rkey);
            }
            self.finish_proxy(ticket, reply, now);
            return;
        }
        if self.failover_due(&rkey, now) {
            if let Some(p) = self.parked.get_mut(&ticket) {
                p.state = ParkState::CheckingMarker { fallback: reply };
            }
            self.new_op(
                OpKind::ReadMarker { ticket },
                Command::ReadMarker {
                    task: key.task.clone(),
                    buffer: key.buffer,
                },
            );
            self.after(now);
            return;
        }
        self.finish_proxy(ticket, reply, now);
    }

    fn finish_proxy(&mut self, ticket: Ticket, reply: Reply, now: Instant) {
        if let Some(parked) = self.unpark(ticket) {
            self.emit(ticket, parked.request.kind(), Outcome::Reply(reply));
        }
        self.after(now);
    }

    /// Records a failure to serve a buffer; true when storage should be
    /// asked for its commit marker now (the failure has lasted
    /// `failover_after` and storage was not asked in that time). Whether
    /// the marker found may be served is decided when it is read: only for
    /// the remote that wrote it.
    fn failover_due(&mut self, rkey: &RemoteKey, now: Instant) -> bool {
        let Some(every) = self.spool().map(|s| s.failover_after) else {
            return false;
        };
        if !self.remotes.states.contains_key(rkey)
            && !self
                .remotes
                .make_room(self.config.max_tracked_remotes, now, every * 10)
        {
            return false;
        }
        let state = self
            .remotes
            .states
            .entry(rkey.clone())
            .or_insert(RemoteState::Failing {
                since: now,
                checked: None,
            });
        match state {
            RemoteState::Lost { .. } | RemoteState::Released { .. } => false,
            RemoteState::Failing { since, .. } if now.saturating_duration_since(*since) < every => {
                false
            }
            RemoteState::Failing {
                checked: Some(at), ..
            } if now.saturating_duration_since(*at) < every => false,
            RemoteState::Failing { checked, .. } => {
                *checked = Some(now);
                true
            }
        }
    }

    /// The remote at `remote` said (in its HELLO reply) it is node `node`.
    pub fn remote_identified(&mut self, remote: &str, node: String) {
        self.remotes
            .identify(remote, node, self.config.max_tracked_remotes);
    }

    /// A commit marker read finished (failover).
    pub fn marker_read(
        &mut self,
        op: OpId,
        result: Result<Option<CommitMarker>, String>,
        now: Instant,
    ) {
        let Some(OpKind::ReadMarker { ticket }) = self.ops.remove(&op) else {
            return;
        };
        let Some(parked) = self.parked.get(&ticket) else {
            return;
        };
        let request = parked.request.clone();
        let remote: Arc<str> = Arc::from(request.remote.clone().unwrap_or_default());
        let Some(key) = request.buffer_key().cloned() else {
            return;
        };
        let rkey: RemoteKey = (remote.clone(), key.task.clone(), key.buffer);
        let marker = match result {
            Ok(Some(marker))
                if marker.task_id == key.task.as_str()
                    && marker.buffer_id == key.buffer
                    && (marker.endpoint == *remote
                        || self.remotes.vouches(&remote, &marker.node)) =>
            {
                Some(Arc::new(marker))
            }
            Ok(Some(marker)) => {
                tracing::warn!(task = %key.task, buffer = key.buffer, remote = %remote, writer = %marker.node, endpoint = %marker.endpoint, "a commit marker was not written by the remote named; not serving it");
                None
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(task = %key.task, buffer = key.buffer, error = %e, "cannot read a commit marker for failover");
                None
            }
        };
        let Some(marker) = marker else {
            let fallback = match self.parked.get_mut(&ticket).map(|p| &mut p.state) {
                Some(ParkState::CheckingMarker { fallback }) => {
                    std::mem::replace(fallback, Reply::new(BinReply::default()))
                }
                _ => return,
            };
            self.finish_proxy(ticket, fallback, now);
            return;
        };
        tracing::info!(task = %key.task, buffer = key.buffer, %remote, "producer lost a committed buffer; reading the committed buffer from storage");
        self.remotes.states.insert(
            rkey.clone(),
            RemoteState::Lost {
                marker: marker.clone(),
                used: now,
            },
        );
        let Some(parked) = self.unpark(ticket) else {
            return;
        };
        let saved = self.current.replace(ticket);
        let immediate = self.serve_lost(ticket, &parked.request, &rkey, marker, now);
        self.current = saved;
        let outcome = match (immediate, self.current_outcome.take()) {
            (Some(reply), _) => Outcome::Reply(reply),
            (None, Some(outcome)) => outcome,
            (None, None) => Outcome::Reply(Reply::new(
                parked
                    .request
                    .error(Status::ServerError, "no reply from storage"),
            )),
        };
        if let Outcome::Reply(r) = &outcome {
            self.count_reply(parked.request.kind(), r.header.status);
        }
        self.events.push_back(Event::Outcome { ticket, outcome });
        self.after(now);
    }

    /// A committed buffer was released from storage (failover DELETE).
    pub fn released(&mut self, op: OpId, now: Instant) {
        self.ops.remove(&op);
        self.after(now);
    }

    // --------------------------------------------------------------- views

    /// A snapshot of counters and gauges.
    pub fn stats(&self) -> CoreStats {
        let mut stats = self.stats.clone();
        stats.memory_used = self.memory_used;
        stats.memory_pending = self.pending_bytes;
        stats.tasks = self.tasks.len() as u64;
        stats.buffers = self.tasks.values().map(|t| t.buffers.len() as u64).sum();
        stats.pages_buffered = self.pages_held();
        stats.page_bytes_held = self.tasks.values().map(|t| t.page_bytes).sum();
        stats.draining = self.draining;
        stats.spills_in_flight = self.spills_in_flight as u64;
        stats.requests_waiting = self.parked.len() as u64;
        stats.objects_held = self.objects.len() as u64;
        stats.pending_deletes = self.deletes_in_flight as u64;
        stats.markers = self.markers.len() as u64;
        stats.requests = self.reply_counts();
        stats
    }

    /// The reply counts as `"DATA OK"` and the like.
    fn reply_counts(&self) -> Vec<ReplyCount> {
        let mut out = Vec::new();
        for (kind, row) in self.replies.iter().enumerate() {
            for (status, &count) in row.iter().enumerate() {
                if count == 0 {
                    continue;
                }
                let kind = i32::try_from(kind)
                    .ok()
                    .and_then(|k| MessageType::try_from(k).ok());
                let status = i32::try_from(status)
                    .ok()
                    .and_then(|s| Status::try_from(s).ok());
                // Several numbers outside the protocol are all "unknown":
                // one entry each pair, so no series is repeated.
                match out
                    .iter_mut()
                    .find(|c: &&mut ReplyCount| c.kind == kind && c.status == status)
                {
                    Some(same) => same.count += count,
                    None => out.push(ReplyCount {
                        kind,
                        status,
                        count,
                    }),
                }
            }
        }
        out
    }

    /// Every open task whose id starts with `prefix`, by id, with its buffers.
    pub fn task_snapshots(&self, prefix: &str, now: Instant) -> Vec<TaskSnapshot> {
        let mut out: Vec<TaskSnapshot> = self
            .tasks
            .iter()
            .filter(|(id, _)| id.as_str().starts_with(prefix))
            .map(|(id, task)| TaskSnapshot::of(id.as_str(), task, now))
            .collect();
        out.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        out
    }

    /// Checks the core's own bookkeeping against a recount from its state:
    /// memory equals what the pages really pin and stays within the limits;
    /// pending bytes equal the bodies held; every parked request is where
    /// its indexes say. For tests and the simulation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut total = 0u64;
        for task in self.tasks.values() {
            let recount = task.recount_memory();
            if recount != task.memory() {
                return Err(format!(
                    "task {} counts {} bytes of memory but its pages hold {recount}",
                    task.id,
                    task.memory()
                ));
            }
            if task.memory() > self.config.task_memory_limit + max_slot_slack(task) {
                return Err(format!(
                    "task {} holds {} bytes, above its limit of {}",
                    task.id,
                    task.memory(),
                    self.config.task_memory_limit
                ));
            }
            total += task.memory();
        }
        if total != self.memory_used {
            return Err(format!(
                "memory_used is {} but the tasks hold {total}",
                self.memory_used
            ));
        }
        let slack: u64 = self.tasks.values().map(max_slot_slack).sum();
        if self.memory_used > self.config.memory_limit + slack {
            return Err(format!(
                "memory_used {} is above the limit {}",
                self.memory_used, self.config.memory_limit
            ));
        }
        let pending: u64 = self
            .parked
            .values()
            .map(|p| match &p.state {
                ParkState::Queued { body } => body.bytes.len() as u64,
                ParkState::Writing { body_len, .. } => *body_len,
                _ => 0,
            })
            .sum();
        if pending != self.pending_bytes {
            return Err(format!(
                "pending_bytes is {} but the parked requests hold {pending}",
                self.pending_bytes
            ));
        }
        let outstanding: usize = self.conns.values().map(|c| c.outstanding).sum();
        if outstanding != self.parked.len() {
            return Err(format!(
                "connections count {outstanding} outstanding requests, {} are parked",
                self.parked.len()
            ));
        }
        for (_, ticket) in &self.deadlines {
            if !self.parked.contains_key(ticket) {
                return Err(format!("deadline for {ticket:?}, which is not parked"));
            }
        }
        Ok(())
    }

    /// The id of the last command issued (tests).
    #[cfg(test)]
    pub(crate) fn debug_last_op(&self) -> u64 {
        self.next_op
    }

    /// Names of the objects a commit marker of this daemon names now.
    pub fn objects_named_by_markers(&self) -> Vec<String> {
        self.objects
            .counts()
            .filter(|(_, _, _, markers, _)| *markers > 0)
            .map(|(_, meta, ..)| meta.name.clone())
            .collect()
    }

    /// Names of every object this daemon still refers to.
    pub fn objects_held(&self) -> Vec<String> {
        self.objects
            .counts()
            .map(|(_, meta, ..)| meta.name.clone())
            .collect()
    }
}

/// Slots that are counted but not admitted against the limit: those of
/// pages handed to ARBITRARY buffers and of durable pages kept only in
/// storage (their bytes are in the object; their bookkeeping is real and
/// counted, and may pass the limit by that much).
fn max_slot_slack(task: &Task) -> u64 {
    match (task.kind, task.policy) {
        (_, SpoolPolicy::Always) | (BufferKind::Arbitrary, _) => {
            task.shared.slot_bytes()
                + task
                    .buffers
                    .values()
                    .map(|b| b.log.slot_bytes())
                    .sum::<u64>()
        }
        _ => 0,
    }
}

/// Bytes of slots appending `count` pages to buffer `id`'s log adds,
/// following `VecDeque`'s growth (double, or what is needed).
fn slot_growth(task: &Task, id: u64, count: u64) -> u64 {
    let (len, cap) = match task.kind {
        BufferKind::Partitioned => task.buffers.get(&id).map_or((0, 0), |b| {
            (b.log.len() as u64, b.log.slot_bytes() / SLOT_BYTES)
        }),
        _ => (
            task.shared.len() as u64,
            task.shared.slot_bytes() / SLOT_BYTES,
        ),
    };
    let needed = len + count;
    if needed <= cap {
        return 0;
    }
    let grown = needed.max(cap * 2).max(4);
    (grown - cap) * SLOT_BYTES
}

/// How a task whose every buffer is gone ended.
fn finished(task: &Task) -> Gone {
    if task.abandoned_any {
        Gone::Abandoned
    } else if task.kind == BufferKind::Broadcast && task.fixed_count.is_none() {
        Gone::FinishedOpenBroadcast
    } else {
        Gone::Finished
    }
}

fn check_buffer_id(task: &Task, buffer_id: u64, max_buffers: u64) -> Result<(), String> {
    if let Some(count) = task.fixed_count {
        if buffer_id >= count {
            return Err(format!(
                "buffer_id {buffer_id} is at or above the buffer_count {count} of task {}",
                task.id
            ));
        }
    } else if !task.buffers.contains_key(&buffer_id) && task.buffers.len() as u64 >= max_buffers {
        return Err(format!(
            "task {} already has {max_buffers} buffers, the limit per task",
            task.id
        ));
    }
    Ok(())
}

fn token_error(e: TokenError, task_id: &TaskId, buffer_id: u64, token: u64) -> String {
    match e {
        TokenError::BelowMark { mark } => format!(
            "token {token} of buffer {buffer_id} of task {task_id} is below its acknowledged mark {mark}: those pages were freed"
        ),
        TokenError::BeyondNext { next } => format!(
            "token {token} of buffer {buffer_id} of task {task_id} is beyond the next token to be produced ({next})"
        ),
    }
}

/// Why an ENQUEUE or NO_MORE_PAGES into a task binxd dropped is refused.
fn dropped_task(task_id: &TaskId, what: &str, after: Duration) -> String {
    format!(
        "{what} for task {task_id}: binxd dropped that task as abandoned (a consumer stopped polling its buffer, or no producer and no consumer touched the task, for {after:?}, and every other buffer was deleted); nothing was stored, and its consumers see it as abandoned"
    )
}

fn abandoned_task(task_id: &TaskId) -> String {
    format!(
        "task {task_id} was dropped as abandoned (nobody read or wrote it for the abandon time); its pages are gone, so the buffer is incomplete"
    )
}

fn abandoned_buffer(task_id: &TaskId, buffer_id: u64, after: Duration) -> String {
    format!(
        "buffer {buffer_id} of task {task_id} was dropped as abandoned: no consumer polled it for {after:?}; its pages are gone, so it is incomplete"
    )
}

/// OK to an ENQUEUE of `count` pages: with `append_token` F, the reply
/// says where the buffer is now (`page_token` F, `page_next_token` F +
/// `count`), whether the pages were kept or dropped.
fn appended(request: &Request, count: usize) -> BinReply {
    let mut header = request.reply(Status::Ok);
    if request.token_named() {
        header.page_next_token = header.page_token.saturating_add(count as u64);
    }
    header
}

/// OK, no pages, complete, at `token`.
fn complete_at(request: &Request, token: u64) -> Reply {
    let mut header = request.reply(Status::Ok);
    header.page_token = token;
    header.page_next_token = token;
    header.buffer_complete = true;
    Reply::new(header)
}
