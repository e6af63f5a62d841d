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
use crate::budget::MemoryBudget;
use crate::config::{CoreConfig, SpoolRules};
use crate::data::{DataPlan, PlanSubject, PlannedPage};
use crate::failover::{RemoteKey, RemoteState, RemoteWatch};
use crate::ids::{ConnId, LeaseId, OpId, Ticket};
use crate::markers::{MarkerEntry, MarkerState, Markers};
use crate::objects::{CommitMarker, Durability, ObjectId, ObjectMeta, Objects, StoreFailure};
use crate::page_log::{Page, SLOT_BYTES, StoredReads};
use crate::refusal::{Mutation, Refusal};
use crate::request::{BufferKey, DataQuery, Op, Request};
use crate::silences::RemoteSilences;
use crate::snapshot::TaskSnapshot;
use crate::stats::{CoreStats, ReplyCount};
use crate::task::{BufferGone, LogId, Sink, Task, TokenError};
use crate::task_id::TaskId;
use crate::tombstones::{EarlyDeleted, EarlyDeletes, Ended, Expiring, Gone};

mod consume;
mod drain;
mod enqueue;
mod finish;
mod lifecycle;
mod object_refs;
mod proxy;
mod requests;
mod serve;
mod shared_room;
mod spill;
mod timers;
mod views;

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
        /// The pages of a finished buffer of a `commit` task, written to be
        /// committed (a task-wide commit ends in a manifest): the driver
        /// may store it together with others of the task written at once
        /// (one file of a `file://` store).
        committing: bool,
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
        /// Send it only to this process of the remote (the `instance=` of
        /// its HELLO reply), the one the buffer's pages came from: over a
        /// connection to another, withhold it and report that
        /// ([`Core::forward_withheld`]). A DATA or ACK at token T
        /// acknowledges the pages below T: sent to a restarted remote that
        /// holds a task of the same id again, it would free another run's.
        instance: Option<Arc<str>>,
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
        /// Markers are folded into it: the records of their release by
        /// consumers (which found this producer gone) go with it.
        folded: bool,
    },
}

/// A commit manifest to write: where each buffer of a finished task ends
/// and how many bytes its pages hold (index = buffer id). The driver adds
/// who wrote it (node name and advertised address), as for markers.
#[derive(Clone, Debug)]
pub struct ManifestPlan {
    /// The finished task.
    pub task: TaskId,
    /// Per buffer (index = buffer id): its end token and its pages' bytes.
    pub buffers: Vec<(u64, u64)>,
    /// The markers folded into the manifest (format 2), in buffer order:
    /// a PARTITIONED task's task-wide commit writes its buffers' markers
    /// here instead of a file each (one object per task instead of one a
    /// buffer). Empty: a manifest of format 1, the markers written apart.
    pub markers: Vec<MarkerPlan>,
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
    /// The pages stay in memory once written (a finished buffer of a
    /// `commit` task, or one a drain spools): its readers come after the
    /// finish, and memory is what the sidecar is for. Pages spilled for
    /// room leave memory.
    keep: bool,
}

#[derive(Debug)]
enum OpKind {
    Spill(Spill),
    Durable {
        ticket: Ticket,
        part: usize,
    },
    Marker {
        key: (TaskId, u64),
    },
    MarkerDelete {
        key: (TaskId, u64),
    },
    ObjectDelete,
    ReadMarker {
        ticket: Ticket,
    },
    /// A DELETE's buffer of a task this process does not know: its commit
    /// marker, released when this node wrote it.
    ForgottenMarker {
        key: (TaskId, u64),
    },
    Forward {
        ticket: Option<Ticket>,
        remote: Arc<str>,
        /// The process it may be sent to (`Command::Forward`).
        instance: Option<Arc<str>>,
    },
    Release,
    Manifest {
        ticket: Option<Ticket>,
        task: TaskId,
        /// The buffers whose markers the manifest carries.
        folded: Vec<u64>,
    },
    ReadManifest {
        ticket: Ticket,
    },
    /// The manifest's folded markers wait for it (`MarkerState::Released`).
    ManifestDelete {
        task: TaskId,
    },
}

#[derive(Debug)]
enum ParkState {
    /// A DATA long-poll.
    DataWait,
    /// An ENQUEUE or NO_MORE_PAGES in its connection's queue.
    Queued { body: Payload },
    /// A durable ENQUEUE whose segments are being written.
    Writing {
        /// The ENQUEUE's buffer.
        key: BufferKey,
        first_token: u64,
        pages: Vec<Bytes>,
        parts: Vec<Option<ObjectMeta>>,
        remaining: usize,
        /// The first write that failed.
        failed: Option<StoreFailure>,
        /// What it counted as pending when queued (see `Parked::waiting_bytes`).
        body_len: u64,
    },
    /// A NO_MORE_PAGES waiting for its commit markers.
    Committing {
        end: Ending,
        remaining: usize,
        failed: Option<Refusal>,
    },
    /// A NO_MORE_PAGES of a `commit` task waiting for the finished pages
    /// to reach storage before its markers are written.
    Spooling(Ending),
    /// A task-wide NO_MORE_PAGES waiting for the task's commit manifest.
    WritingManifest(TaskId),
    /// A COMMITTED waiting for the manifest to be read.
    ReadingManifest {
        task: TaskId,
        /// The first buffer asked for.
        from: u64,
    },
    /// A proxy request sent to its remote.
    Forwarding,
    /// A proxy request whose remote failed: its marker is being read;
    /// `fallback` is the reply if there is none (see [`MarkerCheck`]).
    CheckingMarker {
        fallback: Reply,
        check: Box<MarkerCheck>,
    },
}

/// What a commit-marker read for a proxy request serves and answers.
#[derive(Debug, Default)]
pub(super) struct MarkerCheck {
    /// The reply when storage answered that it has no marker the request
    /// may be served from (rather than failed); `fallback` when unset.
    pub absent: Option<Reply>,
    /// The process of the remote the buffer was read from, as the request
    /// was sent: only a marker it wrote is served (also should its record
    /// be forgotten meanwhile).
    pub pinned: Option<Arc<str>>,
    /// A DELETE withheld from another process: the buffer's process is
    /// forgotten once it is answered (a DELETE that failed otherwise keeps
    /// it, so that its retry is not sent to another process).
    pub forget: bool,
}

/// What a NO_MORE_PAGES ends: one buffer of a task, or (`None`) all.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Ending {
    task: TaskId,
    buffer: Option<u64>,
}

impl ParkState {
    /// Whether a request of `op` may be parked in this state. States that
    /// outlive their first step carry what they need themselves (their
    /// handlers never look into the request again); this says they agree
    /// with the request they answer (checked by [`Core::check_invariants`]).
    fn fits(&self, op: &Op) -> bool {
        let ends = |end: &Ending| matches!(op, Op::NoMorePages { task, buffer, .. } if *task == end.task && *buffer == end.buffer);
        match self {
            ParkState::DataWait => matches!(op, Op::Data(_)),
            ParkState::Queued { .. } => matches!(op, Op::Enqueue { .. } | Op::NoMorePages { .. }),
            ParkState::Writing { key, .. } => matches!(op, Op::Enqueue { key: k, .. } if k == key),
            ParkState::Committing { end, .. } | ParkState::Spooling(end) => ends(end),
            ParkState::WritingManifest(task) => ends(&Ending {
                task: task.clone(),
                buffer: None,
            }),
            ParkState::ReadingManifest { task, from } => {
                matches!(op, Op::Committed { task: t, from: f } if t == task && f == from)
            }
            ParkState::Forwarding => matches!(
                op,
                Op::Data(_) | Op::Ack { .. } | Op::Delete { .. } | Op::DeleteTask { .. }
            ),
            ParkState::CheckingMarker { .. } => {
                matches!(op, Op::Data(_) | Op::Ack { .. } | Op::Delete { .. })
            }
        }
    }
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

impl Parked {
    /// What it holds counted as pending memory (see
    /// [`Request::waiting_bytes`]): kept as it was counted once its pages
    /// are being written.
    fn waiting_bytes(&self) -> u64 {
        match &self.state {
            ParkState::Queued { body } => self.request.waiting_bytes(body.bytes.len() as u64),
            ParkState::Writing { body_len, .. } => *body_len,
            _ => 0,
        }
    }
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
    /// Since when remotes have answered nothing, shared with the other
    /// shards.
    silences: RemoteSilences,
    /// Bytes this shard's tasks hold (the daemon's are in `budget`).
    memory_used: u64,
    pending_bytes: u64,
    /// The daemon's memory limit, shared with the other shards.
    budget: MemoryBudget,
    /// What this shard last told the budget it wants: (waiting for room,
    /// bytes missed by requests any spill would help).
    reported_want: (bool, u64, u64),
    /// Memory or waiting bodies were freed since the driver last asked
    /// ([`Core::take_room_signal`]).
    freed_since_signal: bool,
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
    dirty: Vec<(TaskId, Option<u64>)>,
    room_freed: bool,
    /// NO_MORE_PAGES of `commit` tasks waiting for their pages to spool.
    spooling: BTreeSet<Ticket>,
    /// Tasks each open connection produced for (see `Task::producers`).
    producer_conns: BTreeMap<ConnId, BTreeSet<TaskId>>,
    spills_in_flight: usize,
    /// Commit markers of forgotten tasks being read ([`OpKind::ForgottenMarker`]).
    forgotten_lookups: usize,
    /// Those started in the second that began at `.0` (a rate bound).
    forgotten_window: (Option<Instant>, usize),
    /// Forgotten DELETEs whose marker is still to be read, in turn.
    forgotten_queue: VecDeque<(TaskId, u64)>,
    /// When the rate lets the next of `forgotten_queue` go; none while
    /// nothing waits for the rate alone.
    next_forgotten: Option<Instant>,
    /// When DELETEs past the queue's room were last warned of, and how
    /// many came since: one warning in [`FORGOTTEN_WARNING_EVERY`], so a
    /// peer's DELETEs of made-up tasks cannot flood the log.
    forgotten_warned: (Option<Instant>, u64),
    spill_bytes_in_flight: u64,
    /// Of those, the bytes of spills that free their pages once written
    /// (not a commit's, which keeps them): what room the spills will make.
    spill_bytes_freeing: u64,
    /// ENQUEUEs of tasks that cannot spill (`off`, `always`) waiting for
    /// room, and the bytes each misses: pages in memory and in storage too
    /// may leave for them ([`Core::evict_for_room`]), nothing is spilled.
    room_wanted_unspillable: BTreeMap<Ticket, u64>,
    /// The count of wants reported ([`MemoryBudget::evictable_wants`])
    /// when this shard last freed memory for other shards, and how much it
    /// freed for them since: a want stays as reported until its shard
    /// tries again, and must not be freed twice.
    evicted_for_others: (u64, u64),
    deletes_in_flight: usize,
    draining: bool,
    drain_spooling: bool,
    next_sweep: Option<Instant>,
    next_age_check: Option<Instant>,
    /// After a failed spill no spill starts before this (the store may be
    /// full or unreachable: retrying at once would spin).
    spill_retry_at: Option<Instant>,
    /// What the store said to the spill that failed last (a commit that
    /// waits for spills while they are paused tells its producer).
    last_spill_failure: Option<StoreFailure>,
    stats: CoreStats,
    replies: [[u64; STATUSES + 1]; REQUEST_TYPES + 1],
}

/// Request types are numbered below this (docs/PROTOCOL.md section 3): one past
/// the highest, so a new type gets its own row and never shares the row of
/// numbers outside the protocol.
const REQUEST_TYPES: usize = MessageType::DeleteTask as usize + 1;
/// Statuses are numbered below this.
const STATUSES: usize = Status::Busy as usize + 1;

/// Chunk ids the core gives bodies it copied (the receive buffers' own ids
/// stay below).
const OWN_CHUNKS: u64 = 1 << 63;

impl Core {
    /// An empty exchange with these limits and policies.
    pub fn new(config: CoreConfig) -> Self {
        let budget = MemoryBudget::new(config.memory_limit);
        Core::with_budget(config, budget)
    }

    /// One shard of an exchange: its tasks' pages count against `budget`,
    /// which the other shards share (its limit replaces
    /// `config.memory_limit`).
    pub fn with_budget(config: CoreConfig, budget: MemoryBudget) -> Self {
        let silences = RemoteSilences::new(config.max_tracked_remotes);
        Core::shard(config, budget, silences)
    }

    /// One shard of an exchange, sharing with the others its memory
    /// `budget` (its limit replaces `config.memory_limit`) and what it
    /// learns of remotes that answer nothing (`silences`).
    pub fn shard(mut config: CoreConfig, budget: MemoryBudget, silences: RemoteSilences) -> Self {
        config.memory_limit = budget.limit();
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
            silences,
            memory_used: 0,
            pending_bytes: 0,
            budget,
            reported_want: (false, 0, 0),
            freed_since_signal: false,
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
            dirty: Vec::new(),
            room_freed: false,
            spooling: BTreeSet::new(),
            producer_conns: BTreeMap::new(),
            spills_in_flight: 0,
            forgotten_lookups: 0,
            forgotten_window: (None, 0),
            forgotten_queue: VecDeque::new(),
            next_forgotten: None,
            forgotten_warned: (None, 0),
            spill_bytes_in_flight: 0,
            spill_bytes_freeing: 0,
            room_wanted_unspillable: BTreeMap::new(),
            evicted_for_others: (0, 0),
            deletes_in_flight: 0,
            draining: false,
            drain_spooling: false,
            next_sweep: None,
            next_age_check: None,
            spill_retry_at: None,
            last_spill_failure: None,
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

    /// Bytes this shard holds for pages now.
    pub fn memory_used(&self) -> u64 {
        self.memory_used
    }

    /// The memory budget this shard counts against.
    pub fn budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// Whether pages held and request bodies waiting together (every
    /// shard's) reach the memory limit: a connection then stops reading new
    /// requests until its own waiting ones are answered.
    pub fn memory_full(&self) -> bool {
        self.budget.full()
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
            self.next_forgotten,
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

    fn new_op(&mut self, kind: OpKind, command: Command) -> OpId {
        self.next_op += 1;
        let op = OpId(self.next_op);
        self.ops.insert(op, kind);
        self.events.push_back(Event::Command { op, command });
        op
    }

    /// Answers `ticket` with an event (`handle` takes it back out when it
    /// answers the request at hand).
    fn emit(&mut self, ticket: Ticket, kind: MessageType, outcome: Outcome) {
        if let Outcome::Reply(reply) = &outcome {
            self.count_reply(kind, reply.header.status);
        }
        self.events.push_back(Event::Outcome { ticket, outcome });
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

fn check_buffer_id(task: &Task, buffer_id: u64, max_buffers: u64) -> Result<(), Refusal> {
    if let Some(count) = task.fixed_count {
        if buffer_id >= count {
            return Err(Refusal::BufferBeyondCount {
                task: task.id.clone(),
                buffer: buffer_id,
                count,
            });
        }
    } else if !task.buffers.contains_key(&buffer_id) && task.buffers.len() as u64 >= max_buffers {
        return Err(Refusal::TooManyBuffers {
            task: task.id.clone(),
            limit: max_buffers,
        });
    }
    Ok(())
}

fn token_error(e: TokenError, task_id: &TaskId, buffer_id: u64, token: u64) -> Refusal {
    let (task, buffer) = (task_id.clone(), buffer_id);
    match e {
        TokenError::BelowMark { mark } => Refusal::TokenBelowMark {
            task,
            buffer,
            token,
            mark,
        },
        TokenError::BeyondNext { next } => Refusal::TokenBeyondNext {
            task,
            buffer,
            token,
            next,
        },
    }
}

/// A refusal as the reply to `request`.
fn refused(request: &Request, refusal: Refusal) -> Reply {
    Reply::new(request.refuse(&refusal))
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
