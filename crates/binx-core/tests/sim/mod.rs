//! A deterministic simulation of binx, FoundationDB style: producers, N
//! sidecars (each a real [`binx_core::Core`]), consumers running the real
//! consumer machine ([`binx_core::source::SourceMachine`]), a shared object
//! store and a network that delays, drops and partitions, all in simulated
//! time driven by one seed. Sidecars crash and restart (under the same node
//! name or another), drain, run short of memory; consumers stall past the
//! abandon time and delete at any moment. Producers pipeline ENQUEUEs and
//! NO_MORE_PAGES, and their connections close (a crash, a dropped
//! connection) while requests wait. Invariants are checked after every step
//! and at the end; a violation names the seed, and the seed replays the same
//! schedule.

#![allow(clippy::too_many_lines)]

// The world (this file: parameters, actors' state, the event loop) and its
// parts, each an `impl World` of its own.
mod checker;
mod consumer;
mod deleter;
mod network;
mod producer;
mod store;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use binx_core::config::SpoolRules;
use binx_core::door::{ConnectionDoor, Transport, Verdict};
use binx_core::source::{PullConfig, PullStep, ReplyPart, SourceMachine};
use binx_core::testing::{Completion, CoreFacts, door_config, segment_meta, written_marker};
use binx_core::{
    BufferState, Command, CommitMarker, ConnId, Core, CoreConfig, DataPlan, Door, Durability,
    Event, Handled, ManifestPlan, OpId, Outcome, Payload, Reply, Resolved, Shards, StoreFailure,
    Ticket,
};
use binx_core::{Mutation, Refusal, TaskId};
use binx_proto::{
    ALL_BUFFERS, BinReply, BinRequest, BufferKind, Frame, MessageType, SpoolPolicy, Status, segment,
};
use bytes::Bytes;

/// Bytes of objects one reply may read back: one or two segments.
const MAX_STORED_REPLY: u64 = 24 << 10;
const MS: Duration = Duration::from_millis(1);
const SEC: Duration = Duration::from_secs(1);

/// What a seed chose.
#[derive(Clone, Debug)]
pub(crate) struct Params {
    sidecars: usize,
    tasks: usize,
    memory_limit: u64,
    abandon_after: Duration,
    failover_after: Duration,
    store_fail: f64,
    delete_fail: f64,
    drop_forward: f64,
    crashes: usize,
    drains: usize,
    partitions: usize,
    presigns: bool,
    stalls: bool,
    /// Shards each sidecar's exchange has (`Shards`), drawn apart from
    /// the rest so every other draw of a seed stays as it was.
    shards: usize,
    /// Consumers' requests travel over several connections (binx-client's
    /// stripes), so they reach the sidecar in any order; drawn apart too.
    striped: bool,
}

impl Params {
    fn draw(rng: &mut fastrand::Rng) -> Params {
        Params {
            sidecars: rng.usize(2..=3),
            tasks: rng.usize(1..=3),
            memory_limit: [48 << 10, 64 << 10, 160 << 10, 1 << 20, 4 << 20][rng.usize(0..5)],
            abandon_after: Duration::from_secs(rng.u64(20..=60)),
            failover_after: Duration::from_secs(rng.u64(2..=10)),
            store_fail: [0.0, 0.0, 0.05, 0.2][rng.usize(0..4)],
            delete_fail: [0.0, 0.0, 0.0, 0.1][rng.usize(0..4)],
            drop_forward: [0.0, 0.01, 0.05][rng.usize(0..3)],
            crashes: [0, 0, 1, 2][rng.usize(0..4)],
            drains: [0, 0, 1][rng.usize(0..3)],
            partitions: [0, 0, 1, 2][rng.usize(0..4)],
            presigns: rng.bool(),
            stalls: rng.usize(0..4) == 0,
            shards: 1,
            striped: false,
        }
    }
}

/// Who waits for the answer to a request.
#[derive(Clone, Debug)]
enum Waiter {
    Actor(Actor, u64),
    /// A request forwarded by sidecar `from` (generation `life`) as `op`.
    Remote {
        from: usize,
        life: u32,
        op: OpId,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Actor {
    Producer(usize),
    Consumer(usize),
    /// An engine's coordinator deleting a task's output with DELETE_TASK
    /// once its consumers are done (index into `World::deleters`).
    Deleter(usize),
}

#[derive(Debug)]
enum Ev {
    Request {
        side: usize,
        life: u32,
        conn: ConnId,
        waiter: Waiter,
        raw: Box<BinRequest>,
        body: Bytes,
        door: Door,
    },
    Reply {
        actor: Actor,
        epoch: u64,
        reply: Option<Reply>,
    },
    Store {
        side: usize,
        life: u32,
        op: OpId,
        done: Completion,
    },
    Forwarded {
        side: usize,
        life: u32,
        op: OpId,
        /// The reply, and the remote's address, node name and process
        /// instance.
        result: Result<(Frame<BinReply>, String, String, Arc<str>), String>,
    },
    /// A forward withheld: the remote answers as another process than
    /// the one it was meant for (address, node name, instance).
    Withheld {
        side: usize,
        life: u32,
        op: OpId,
        from: (String, String, Arc<str>),
    },
    Plan {
        side: usize,
        life: u32,
        waiter: Waiter,
        plan: DataPlan,
    },
    Timer {
        side: usize,
        life: u32,
    },
    Tick(Actor),
    Consumed(usize),
    Crash(usize),
    Restart {
        side: usize,
        rename: bool,
    },
    Drain(usize),
    Partition {
        a: usize,
        b: usize,
        until: Duration,
    },
    /// Producer `p` may lose its connection (of generation `epoch`) now.
    CloseProducer {
        p: usize,
        epoch: u64,
    },
    /// The driver drops a request of a connection that went (its future is
    /// dropped: `Core::cancel`).
    Cancel {
        side: usize,
        life: u32,
        ticket: Ticket,
    },
    /// The driver sees a connection end (`Core::connection_closed`).
    ConnClosed {
        side: usize,
        life: u32,
        conn: ConnId,
    },
}

struct Queued {
    at: Duration,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

struct Sidecar {
    addr: String,
    node: String,
    life: u32,
    core: Option<Shards>,
    waiters: BTreeMap<Ticket, Waiter>,
    timer_at: Option<Duration>,
    next_ticket: u64,
    draining: bool,
    /// The producers' ENQUEUEs and NO_MORE_PAGES the core holds (waiting,
    /// queued or being written), whoever still wants the answer.
    mutations: BTreeMap<Ticket, (usize, ConnId, ProducerReq)>,
    /// Each connection's door, as binxd keeps one per connection.
    doors: BTreeMap<ConnId, ConnectionDoor>,
    /// Requests the core parked: their connection and body bytes, for the
    /// door's count of what waits.
    parked: BTreeMap<Ticket, (ConnId, u64)>,
}

/// What a simulated sidecar's door asks of its exchange.
struct StoredObject {
    pages: Vec<Bytes>,
    node: String,
    side: usize,
    life: u32,
    durability: Durability,
}

#[derive(Default)]
struct Store {
    objects: BTreeMap<String, StoredObject>,
    markers: BTreeMap<(String, u64), CommitMarker>,
    /// Commit manifests by task: who wrote it (side, life), and its plan.
    manifests: BTreeMap<String, (usize, u32, ManifestPlan)>,
    /// The markers folded into the manifests, as a reader gets them.
    folded: BTreeMap<(String, u64), CommitMarker>,
    /// Folded markers a consumer released (binx-spool's release records):
    /// they name nothing any more; the last release takes the manifest.
    released: BTreeSet<(String, u64)>,
    /// Folded markers read back (for failover or a forgotten task's DELETE).
    folded_read: u64,
    /// Folded markers a consumer released.
    folded_released: u64,
    serial: u64,
    failed_deletes: u64,
    /// (task, buffer) a consumer (not a hostile one) sent DELETE for: the
    /// only buffers whose committed output may be released.
    deleted_by_consumers: BTreeSet<(String, u64)>,
}

impl Store {
    /// The marker that names object `name`: one of its own, or one folded
    /// into a manifest and not released.
    fn named_by_marker(&self, name: &str) -> Option<&(String, u64)> {
        self.markers
            .iter()
            .chain(
                self.folded
                    .iter()
                    .filter(|(k, _)| !self.released.contains(*k)),
            )
            .find(|(_, m)| m.segments.iter().any(|s| s.name == name))
            .map(|(k, _)| k)
    }

    /// A buffer's marker as a reader finds it: its own, or the one folded
    /// into its task's manifest unless released.
    fn marker(&self, task: &str, buffer: u64) -> Option<CommitMarker> {
        let key = (task.to_string(), buffer);
        self.markers.get(&key).cloned().or_else(|| {
            (!self.released.contains(&key))
                .then(|| self.folded.get(&key).cloned())
                .flatten()
        })
    }

    /// Whether a marker of `task` still names objects: one of its own, or
    /// a folded one not released.
    fn markers_left(&self, task: &str) -> bool {
        self.markers.keys().any(|(t, _)| t == task)
            || self
                .folded
                .keys()
                .any(|k| k.0 == task && !self.released.contains(k))
    }

    /// A manifest goes, and the markers folded into it with it.
    fn remove_manifest(&mut self, task: &str) {
        self.manifests.remove(task);
        self.folded.retain(|(t, _), _| t != task);
        self.released.retain(|(t, _)| t != task);
    }
}

/// Producer `p`'s connection: a new one after each that closed (`epoch`).
/// A draw of its own for item `i` of a seed (a splitmix64 step).
fn mix(seed: u64, i: u64) -> u64 {
    let mut x = seed ^ (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    x
}

fn producer_conn(p: usize, epoch: u64) -> ConnId {
    ConnId(p as u64 * 2 + 1 + epoch * 20_000)
}

/// A page's contents say which page it is: (task, buffer or u32::MAX, seq).
fn page(task: usize, buffer: u32, seq: u64, size: usize) -> Bytes {
    if size < 16 {
        // Too small to carry its id: filled so a wrong one still shows
        // (sizes are checked too).
        return Bytes::from(vec![(seq % 251) as u8; size]);
    }
    let mut v = Vec::with_capacity(size);
    v.extend_from_slice(&(task as u32).to_be_bytes());
    v.extend_from_slice(&buffer.to_be_bytes());
    v.extend_from_slice(&seq.to_be_bytes());
    v.resize(size, (seq % 251) as u8);
    Bytes::from(v)
}

struct Batch {
    buffer: u64,
    sizes: Vec<usize>,
    /// Sequence number of its first page (per buffer, or task-wide).
    first_seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BatchState {
    Unsent,
    InFlight,
    Ok,
    Busy,
    /// Its connection closed before its reply came: it may or may not have
    /// been applied, and nothing tells the producer which.
    Unknown,
}

struct Producer {
    task: usize,
    task_id: String,
    side: usize,
    kind: BufferKind,
    buffers: u64,
    policy: SpoolPolicy,
    /// OPEN_TASK named the buffer count (else buffers come as consumers ask).
    fixed: bool,
    batches: Vec<Batch>,
    states: Vec<BatchState>,
    window: usize,
    opened: bool,
    open_in_flight: bool,
    nmp_in_flight: bool,
    nmp_sent: bool,
    nmp_ok: bool,
    abort_after: Option<usize>,
    aborted: bool,
    dead: bool,
    /// binxd dropped its task as abandoned (a consumer stopped polling
    /// and every other buffer was deleted): it stops, as an engine's task
    /// that is told so fails.
    dropped: bool,
    epoch: u64,
    /// Pages per buffer (or task-wide at key u64::MAX) when NO_MORE_PAGES was sent.
    final_counts: BTreeMap<u64, u64>,
    backoff_until: Duration,
    /// BUSY since then (the engine gives up after GIVE_UP, and aborts).
    busy_since: Option<Duration>,
    /// Names `append_token` on every ENQUEUE (and on NO_MORE_PAGES where
    /// one token ends every buffer), so it may keep several ENQUEUEs of a
    /// buffer in flight, and resends what a lost connection left unknown.
    /// A producer that does not (a BinX 1.2 client) keeps at most one
    /// ENQUEUE of a buffer in flight, and aborts after a lost connection.
    numbered: bool,
    /// Request ids of in-flight requests -> what they are.
    in_flight: BTreeMap<u64, ProducerReq>,
    /// Every request it ever sent, by id (on any connection).
    sent: BTreeMap<u64, ProducerReq>,
    next_id: u64,
    /// Sends every unsent ENQUEUE and then NO_MORE_PAGES at once, without
    /// waiting for replies (resending from the first BUSY one).
    pipelined: bool,
    /// Connections it may still lose while requests wait.
    closes_left: u32,
    close_pending: bool,
    /// A connection closed with an ENQUEUE unanswered, and the producer
    /// does not number its appends: it cannot learn whether that one took
    /// effect, so it aborts the task.
    lost: bool,
    /// What the sidecar applied (seen by the simulation, whether or not the
    /// producer saw the reply): each batch, and NO_MORE_PAGES.
    applied: Vec<bool>,
    nmp_applied: bool,
}

/// The reason producers give when they abort their task.
const ABORT_REASON: &str = "the query was cancelled";

/// A simulated task's id (always valid: the simulation makes them).
fn task_id(name: &str) -> TaskId {
    TaskId::parse(name).expect("the simulation's task ids are valid")
}

#[derive(Clone, Copy, Debug)]
enum ProducerReq {
    Open,
    Batch(usize),
    NoMorePages,
    Abort,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ConsumerState {
    Waiting,
    Running,
    Done,
    Stopped,
    Failed(String),
    Dead,
}

/// Deletes every buffer of a task with one DELETE_TASK, through a
/// sidecar (forwarded when it is not the producer's), once every consumer
/// of the task stopped reading, as the Trino plugin's coordinator does.
struct TaskDeleter {
    task: usize,
    side: usize,
    remote: Option<String>,
    /// Ticks and refusals so far: it gives up at `MAX_DELETER_TRIES`.
    tries: u32,
    /// The request in flight.
    in_flight: Option<u64>,
    /// A DELETE_TASK naming more buffers than a task may have is still to
    /// be sent, at once, while consumers read: every sidecar must refuse
    /// it whole (the store's checks see any release it would start, the
    /// consumers any page it would drop).
    too_wide: bool,
    /// The request in flight is that one.
    too_wide_in_flight: bool,
    next_id: u64,
    done: bool,
    /// Answered OK.
    deleted: bool,
    /// The too-wide DELETE_TASK was refused (BAD_REQUEST).
    refused_too_wide: bool,
}

const MAX_DELETER_TRIES: u32 = 300;

struct Consumer {
    task: usize,
    buffer: u64,
    side: usize,
    machine: SourceMachine,
    state: ConsumerState,
    held: u64,
    /// Requests sent and not answered, by request id: several DATA when
    /// its machine pipelines.
    in_flight: BTreeMap<u64, BinRequest>,
    next_id: u64,
    epoch: u64,
    stall: Option<(u64, Duration)>,
    stalled: bool,
    delete_at: Option<u64>,
    error_since: Option<Duration>,
    completed: bool,
    pages: u64,
    /// Its early DELETE was answered OK: its buffer holds nothing from then on.
    deleted: bool,
    /// It got a page that is not the one produced at its token: wrong unless
    /// its producer lost its order (and so never finishes the buffer).
    suspect: Option<String>,
    /// A local client that names a remote that is not the producer (an
    /// unreachable one): it must never read or delete the buffer.
    hostile: bool,
}

/// One run of the simulation.
pub(crate) struct World {
    seed: u64,
    pipelined_data: u64,
    /// Proxy consumers refused a buffer whose producer's sidecar crashed
    /// before committing it (its new process not asked).
    runs_refused: u64,
    dropped_replies: u64,
    overtaken: u64,
    /// Every consumer sends one DATA at a time (see `pipeline_depth`).
    unpipelined: bool,
    /// Every producer numbers its appends (see `numbers_appends`).
    all_numbered: bool,
    rng: fastrand::Rng,
    params: Params,
    base: Instant,
    now: Duration,
    seq: u64,
    queue: BinaryHeap<Reverse<Queued>>,
    sides: Vec<Sidecar>,
    store: Store,
    producers: Vec<Producer>,
    consumers: Vec<Consumer>,
    deleters: Vec<TaskDeleter>,
    partitions: Vec<(usize, usize, Duration)>,
    arbitrary_seen: BTreeMap<usize, BTreeSet<u64>>,
    /// A connection delivers its frames in order: when the last request on
    /// each (actor, sidecar) link arrives.
    links: BTreeMap<(Actor, usize), Duration>,
    /// Connections binxd reads nothing more from (they closed).
    unread: BTreeSet<ConnId>,
    /// Connections that closed with an ENQUEUE waiting and a NO_MORE_PAGES
    /// queued behind it.
    cut: BTreeSet<ConnId>,
    closes: u64,
    /// Draws for the producers' pipelining and connection losses, apart
    /// from `rng` so a seed without them keeps the schedule it had.
    chaos: fastrand::Rng,
    /// While a pipelining producer sends a burst: when it arrives (it is
    /// written at once, so all of it is read before anything in it can be
    /// answered).
    burst_at: Option<Duration>,
    /// Draws for the receive buffers request bodies lie in, apart from
    /// `rng` and `chaos` so a seed keeps the schedule it had.
    receive: fastrand::Rng,
    /// Each connection's receive buffer: (id, capacity, bytes of bodies in
    /// it). binxd's reader hands the core each body with the buffer it is
    /// a slice of, and several bodies may share one.
    receive_buffers: BTreeMap<ConnId, (u64, u64, u64)>,
    next_receive_buffer: u64,
    trace: Option<Vec<String>>,
    steps: u64,
}

/// What a run came to.
#[derive(Clone, Debug, Default)]
pub(crate) struct Summary {
    pub steps: u64,
    pub complete: u64,
    pub stopped: u64,
    pub dead: u64,
    pub abandoned: u64,
    pub aborted: u64,
    pub gave_up: u64,
    pub other_errors: u64,
    pub waiting: u64,
    pub failover_replies: u64,
    /// Remotes a proxy consumer saw restart (another instance).
    pub remote_restarts: u64,
    /// Commit markers read for DELETEs of tasks a sidecar did not know
    /// (queued in turn, `release_forgotten`).
    pub forgotten_markers_read: u64,
    pub bytes_evicted: u64,
    pub pages_spilled: u64,
    pub busy: u64,
    /// Producer connections that closed while requests waited.
    pub closes: u64,
    /// Of those, ones with an ENQUEUE waiting ahead of a NO_MORE_PAGES.
    pub cut_pipelines: u64,
    /// DATA sent by a consumer while another of its DATA was in flight.
    pub pipelined_data: u64,
    /// Proxy consumers refused a buffer whose producer's sidecar crashed
    /// uncommitted (the sidecar's new process not asked).
    pub runs_refused: u64,
    /// Replies to DATA a consumer no longer waited for, dropped.
    pub dropped_replies: u64,
    /// Requests of a striped consumer that reached the sidecar before one
    /// it sent earlier.
    pub overtaken: u64,
    /// ENQUEUE and NO_MORE_PAGES refused for their `append_token` (by
    /// sidecars that did not crash).
    pub append_token_refusals: u64,
    /// Commit markers read from a manifest they were folded into.
    pub folded_markers_read: u64,
    /// Of those, released by their consumer's DELETE.
    pub folded_markers_released: u64,
    /// DELETE_TASKs answered OK: at the producer's sidecar, and through
    /// another one.
    pub task_deletes: u64,
    pub task_deletes_forwarded: u64,
    /// DELETE_TASKs naming more buffers than a task may have, refused.
    pub task_deletes_refused: u64,
}

impl Summary {
    pub(crate) fn add(&mut self, other: &Summary) {
        self.steps += other.steps;
        self.complete += other.complete;
        self.stopped += other.stopped;
        self.dead += other.dead;
        self.abandoned += other.abandoned;
        self.aborted += other.aborted;
        self.gave_up += other.gave_up;
        self.other_errors += other.other_errors;
        self.waiting += other.waiting;
        self.failover_replies += other.failover_replies;
        self.remote_restarts += other.remote_restarts;
        self.forgotten_markers_read += other.forgotten_markers_read;
        self.bytes_evicted += other.bytes_evicted;
        self.pages_spilled += other.pages_spilled;
        self.busy += other.busy;
        self.closes += other.closes;
        self.cut_pipelines += other.cut_pipelines;
        self.pipelined_data += other.pipelined_data;
        self.runs_refused += other.runs_refused;
        self.dropped_replies += other.dropped_replies;
        self.overtaken += other.overtaken;
        self.append_token_refusals += other.append_token_refusals;
        self.folded_markers_read += other.folded_markers_read;
        self.folded_markers_released += other.folded_markers_released;
        self.task_deletes += other.task_deletes;
        self.task_deletes_forwarded += other.task_deletes_forwarded;
        self.task_deletes_refused += other.task_deletes_refused;
    }
}

/// A violated invariant, with the seed that shows it.
#[derive(Debug)]
pub(crate) struct Violation {
    pub at: Duration,
    pub what: String,
}

type Check = Result<(), String>;

const GIVE_UP: Duration = Duration::from_secs(180);
const RUN_FOR: Duration = Duration::from_secs(900);

impl World {
    pub(crate) fn new(seed: u64, trace: bool) -> World {
        Self::build(seed, trace, false, false)
    }

    /// The seed's schedule with every consumer sending one DATA at a time,
    /// as before consumers pipelined: replays seeds found before that.
    pub(crate) fn unpipelined(seed: u64, trace: bool) -> World {
        Self::build(seed, trace, true, false)
    }

    /// The seed's schedule with every producer numbering its appends, as
    /// every producer pipelined before some stopped (producers of BinX 1.2
    /// may not), and no task under `commit` (which came after): replays
    /// seeds found before that.
    pub(crate) fn numbered(seed: u64, trace: bool) -> World {
        Self::build(seed, trace, false, true)
    }

    fn build(seed: u64, trace: bool, unpipelined: bool, all_numbered: bool) -> World {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut params = Params::draw(&mut rng);
        params.shards = 1 + (mix(seed ^ 0x3c6e_f372_fe94_f82b, 0) % 4) as usize;
        params.striped = mix(seed ^ 0xa54f_f53a_5f1d_36f1, 0).is_multiple_of(2);
        let mut world = World {
            seed,
            pipelined_data: 0,
            runs_refused: 0,
            overtaken: 0,
            dropped_replies: 0,
            unpipelined,
            all_numbered,
            params: params.clone(),
            base: Instant::now(),
            now: Duration::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            sides: Vec::new(),
            store: Store::default(),
            producers: Vec::new(),
            consumers: Vec::new(),
            deleters: Vec::new(),
            partitions: Vec::new(),
            arbitrary_seen: BTreeMap::new(),
            links: BTreeMap::new(),
            unread: BTreeSet::new(),
            cut: BTreeSet::new(),
            closes: 0,
            chaos: fastrand::Rng::with_seed(seed ^ 0x9e37_79b9_7f4a_7c15),
            burst_at: None,
            receive: fastrand::Rng::with_seed(seed ^ 0x5be0_cd19_137e_2179),
            receive_buffers: BTreeMap::new(),
            next_receive_buffer: 0,
            trace: trace.then(Vec::new),
            steps: 0,
            rng,
        };
        for i in 0..params.sidecars {
            let side = Sidecar {
                addr: format!("pod{i}:8091"),
                node: format!("pod{i}"),
                life: 0,
                core: Some(world.new_core(&format!("pod{i}"))),
                waiters: BTreeMap::new(),
                timer_at: None,
                next_ticket: 0,
                draining: false,
                mutations: BTreeMap::new(),
                doors: BTreeMap::new(),
                parked: BTreeMap::new(),
            };
            world.sides.push(side);
        }
        for t in 0..params.tasks {
            world.add_task(t);
            let p = &world.producers[t];
            let line = format!(
                "task {} on sidecar {}: {:?} x{} fixed={} policy {} window {} numbered={} pipelined={} closes={} batches {:?}",
                p.task_id,
                p.side,
                p.kind,
                p.buffers,
                p.fixed,
                p.policy,
                p.window,
                p.numbered,
                p.pipelined,
                p.closes_left,
                p.batches
                    .iter()
                    .map(|b| (b.buffer, b.sizes.len()))
                    .collect::<Vec<_>>()
            );
            world.note(|| line);
        }
        for i in 0..params.crashes {
            let side = world.rng.usize(0..params.sidecars);
            let at = Duration::from_millis(world.rng.u64(100..60_000));
            world.push(at, Ev::Crash(side));
            let back = at + Duration::from_millis(world.rng.u64(500..40_000));
            let rename = world.rng.usize(0..3) == 0 || i > 5;
            world.push(back, Ev::Restart { side, rename });
        }
        for _ in 0..params.drains {
            let side = world.rng.usize(0..params.sidecars);
            let at = Duration::from_millis(world.rng.u64(1_000..30_000));
            world.push(at, Ev::Drain(side));
        }
        for _ in 0..params.partitions {
            let a = world.rng.usize(0..params.sidecars);
            let b = (a + 1 + world.rng.usize(0..params.sidecars - 1)) % params.sidecars;
            let at = Duration::from_millis(world.rng.u64(0..30_000));
            let until = at + Duration::from_millis(world.rng.u64(1_000..20_000));
            world.push(at, Ev::Partition { a, b, until });
        }
        world
    }

    /// The exchange of a sidecar whose commit markers name `node`.
    fn new_core(&mut self, node: &str) -> Shards {
        let p = &self.params;
        let config = CoreConfig {
            memory_limit: p.memory_limit,
            task_memory_limit: p.memory_limit,
            max_wait: 5 * SEC,
            abandon_after: p.abandon_after,
            max_tombstones: 1000,
            max_outstanding_per_connection: 64,
            max_stored_reply_size: MAX_STORED_REPLY,
            // The pods of the simulated network, and a name nobody answers.
            forward_allowed_peers: "pod0,pod1,pod2,pod3,ghost".parse().expect("peer list"),
            spool: Some(SpoolRules {
                spill_target_bytes: 8 << 10,
                spill_max_bytes: 16 << 10,
                spill_after: 10 * SEC,
                // 2 in all (binxd's default before 2026-11-29, and what
                // the seeds were found with), 4 a shard (its default
                // now), or 16.
                spill_concurrency: if self.unpipelined || self.all_numbered {
                    2
                } else {
                    [2, 2, 4 * p.shards, 16]
                        [(mix(self.seed ^ 0xbb67_ae85_84ca_a73b, 0) % 4) as usize]
                },
                // binxd's two segments, one, three, or no bound (as the
                // seeds were found).
                spill_bytes_max: if self.unpipelined || self.all_numbered {
                    u64::MAX
                } else {
                    [32 << 10, 32 << 10, 16 << 10, 48 << 10, u64::MAX]
                        [(mix(self.seed ^ 0x3c6e_f372_fe94_f82b, 1) % 5) as usize]
                },
                // Markers folded into manifests (binxd's default) in three
                // seeds of four, an object each (as before) in the rest.
                fold_markers: !mix(self.seed ^ 0xa54f_f53a_5f1d_36f1, 2).is_multiple_of(4),
                always_refusal: None,
                presigns: p.presigns,
                codec: Default::default(),
                failover_after: p.failover_after,
                max_pending_deletes: 64,
                // Committed buffers nobody reads are dropped at their TTL,
                // well within the run.
                ttl: p.abandon_after * (2 + (mix(self.seed ^ 0x6a09_e667_f3bc_c909, 0) % 4) as u32),
                node: node.to_string(),
            }),
            ..CoreConfig::default()
        };
        Shards::new(config, p.shards)
    }

    fn add_task(&mut self, t: usize) {
        let (seed, as_found) = (self.seed, self.all_numbered);
        let rng = &mut self.rng;
        let kind = [
            BufferKind::Partitioned,
            BufferKind::Partitioned,
            BufferKind::Broadcast,
            BufferKind::Arbitrary,
        ][rng.usize(0..4)];
        let policy =
            [SpoolPolicy::Off, SpoolPolicy::Overflow, SpoolPolicy::Always][rng.usize(0..3)];
        // Half the committing tasks commit at the finish rather than at
        // every ENQUEUE (a draw of its own, so the rest of a seed stays).
        let policy = if policy == SpoolPolicy::Always
            && !as_found
            && mix(seed ^ 0x2545_f491_4f6c_dd1d, t as u64).is_multiple_of(2)
        {
            SpoolPolicy::Commit
        } else {
            policy
        };
        let buffers = rng.u64(1..=3);
        let side = rng.usize(0..self.params.sidecars);
        let mut batches = Vec::new();
        let mut seqs: BTreeMap<u64, u64> = BTreeMap::new();
        for _ in 0..rng.usize(0..=12) {
            let buffer = if kind == BufferKind::Partitioned {
                rng.u64(0..buffers)
            } else {
                0
            };
            // A body stays well within the memory limit (a larger one is
            // refused as never fitting, which is not what this tests);
            // small, mixed and large batches follow each other, so a large
            // one waiting for room has small ones queued behind it.
            let limit = self.params.memory_limit as usize;
            let sizes: Vec<usize> = match rng.usize(0..10) {
                0..=3 => (0..rng.usize(0..=6)).map(|_| rng.usize(0..500)).collect(),
                4..=7 => {
                    let mut room = limit / 3;
                    (0..rng.usize(0..=6))
                        .map(|_| {
                            let size = match rng.usize(0..10) {
                                0 => 0,
                                1 => rng.usize(16..20_000),
                                _ => rng.usize(0..3_000),
                            }
                            .min(room);
                            room -= size;
                            size
                        })
                        .collect()
                }
                _ => vec![rng.usize(limit / 5..limit / 3)],
            };
            let key = if kind == BufferKind::Partitioned {
                buffer
            } else {
                u64::MAX
            };
            let seq = seqs.entry(key).or_insert(0);
            let first_seq = *seq;
            *seq += sizes.len() as u64;
            batches.push(Batch {
                buffer,
                sizes,
                first_seq,
            });
        }
        let start_at = Duration::from_millis(rng.u64(0..3_000));
        let abort_after = (rng.usize(0..10) == 0).then(|| rng.usize(0..=batches.len()));
        let n = batches.len();
        let numbered = self.numbers_appends(t);
        // Only a producer that numbers its appends may pipeline a buffer.
        let pipelined = self.chaos.usize(0..4) == 0 && numbered;
        let closes_left = match self.chaos.usize(0..12) {
            0..=4 if pipelined => 1,
            0 | 1 => 1,
            2 => 2,
            _ => 0,
        };
        let rng = &mut self.rng;
        self.producers.push(Producer {
            task: t,
            task_id: format!("q{t}.{}", self.seed % 1000),
            side,
            kind,
            buffers,
            policy,
            fixed: rng.bool(),
            batches,
            states: vec![BatchState::Unsent; n],
            window: rng.usize(1..=4),
            opened: false,
            open_in_flight: false,
            nmp_in_flight: false,
            nmp_sent: false,
            nmp_ok: false,
            abort_after,
            aborted: false,
            dead: false,
            dropped: false,
            epoch: 0,
            final_counts: BTreeMap::new(),
            backoff_until: Duration::ZERO,
            busy_since: None,
            numbered,
            in_flight: BTreeMap::new(),
            sent: BTreeMap::new(),
            next_id: 0,
            pipelined,
            closes_left,
            close_pending: false,
            lost: false,
            applied: vec![false; n],
            nmp_applied: false,
        });
        let pid = self.producers.len() - 1;
        self.push(start_at, Ev::Tick(Actor::Producer(pid)));
        for buffer in 0..buffers {
            let depth = self.pipeline_depth(self.consumers.len());
            let rng = &mut self.rng;
            let side = rng.usize(0..self.params.sidecars);
            let remote = (side != self.producers[pid].side)
                .then(|| self.sides[self.producers[pid].side].addr.clone());
            // A pipelining consumer needs room for more than one reply.
            let least = if depth > 1 { 16 << 10 } else { 1 };
            let config = PullConfig {
                memory_budget: [1, 4 << 10, 64 << 10][rng.usize(0..3)].max(least),
                max_reply_size: [1, 8 << 10, 1 << 20][rng.usize(0..3)],
                max_wait: Duration::from_millis(rng.u64(0..3_000)),
                remote,
                accept_spooled: rng.bool(),
                pipeline_depth: depth,
            };
            let start_at = Duration::from_millis(rng.u64(0..5_000));
            let stall = (self.params.stalls && rng.bool()).then(|| {
                (
                    rng.u64(0..10),
                    Duration::from_secs(rng.u64(1..=2 * self.params.abandon_after.as_secs())),
                )
            });
            let delete_at = (rng.usize(0..12) == 0).then(|| rng.u64(0..5));
            let task_id = self.producers[pid].task_id.clone();
            self.consumers.push(Consumer {
                task: pid,
                buffer,
                side,
                machine: SourceMachine::new(task_id, buffer, config),
                state: ConsumerState::Waiting,
                held: 0,
                in_flight: BTreeMap::new(),
                next_id: 0,
                epoch: 0,
                stall,
                stalled: false,
                delete_at,
                error_since: None,
                completed: false,
                pages: 0,
                deleted: false,
                suspect: None,
                hostile: false,
            });
            let cid = self.consumers.len() - 1;
            self.push(start_at, Ev::Tick(Actor::Consumer(cid)));
        }
        if self.rng.usize(0..3) == 0 {
            let depth = self.pipeline_depth(self.consumers.len());
            let rng = &mut self.rng;
            let buffer = rng.u64(0..buffers);
            let side = rng.usize(0..self.params.sidecars);
            let config = PullConfig {
                max_wait: Duration::from_millis(rng.u64(0..3_000)),
                remote: Some("ghost:8091".into()),
                accept_spooled: rng.bool(),
                pipeline_depth: depth,
                ..PullConfig::default()
            };
            let start_at = Duration::from_millis(rng.u64(5_000..60_000));
            let delete_at = rng.bool().then_some(0);
            let task_id = self.producers[pid].task_id.clone();
            self.consumers.push(Consumer {
                task: pid,
                buffer,
                side,
                machine: SourceMachine::new(task_id, buffer, config),
                state: ConsumerState::Waiting,
                held: 0,
                in_flight: BTreeMap::new(),
                next_id: 0,
                epoch: 0,
                stall: None,
                stalled: false,
                delete_at,
                error_since: None,
                completed: false,
                pages: 0,
                deleted: false,
                suspect: None,
                hostile: true,
            });
            let cid = self.consumers.len() - 1;
            self.push(start_at, Ev::Tick(Actor::Consumer(cid)));
        }
        // Drawn from the seed apart from `rng`, so that adding it left
        // every other draw as it was.
        let draw = mix(self.seed ^ 0x3c6e_f372_fe94_f82b, pid as u64);
        if draw.is_multiple_of(3) {
            let side = (draw >> 8) as usize % self.params.sidecars;
            let remote = (side != self.producers[pid].side)
                .then(|| self.sides[self.producers[pid].side].addr.clone());
            self.deleters.push(TaskDeleter {
                task: pid,
                side,
                remote,
                tries: 0,
                in_flight: None,
                too_wide: (draw >> 40).is_multiple_of(2),
                too_wide_in_flight: false,
                next_id: 0,
                done: false,
                deleted: false,
                refused_too_wide: false,
            });
            let d = self.deleters.len() - 1;
            let start_at = Duration::from_millis(5_000 + (draw >> 20) % 60_000);
            self.push(start_at, Ev::Tick(Actor::Deleter(d)));
        }
    }

    /// Whether producer `t` numbers its appends: three in four do (all of
    /// them in `World::numbered`), drawn from the seed apart from `rng`
    /// and `chaos`, so that adding it left every other draw as it was.
    fn numbers_appends(&self, t: usize) -> bool {
        self.all_numbered || !mix(self.seed ^ 0x5851_f42d_4c95_7f2d, t as u64).is_multiple_of(4)
    }

    /// DATA requests consumer `c` keeps in flight: 1 (a BinX 1.1 client),
    /// 2 or 3, drawn from the seed apart from `rng` so that adding it left
    /// every other draw of a seed as it was. `World::unpipelined` replays a
    /// seed with 1 everywhere, the schedule it had before pipelining.
    fn pipeline_depth(&self, c: usize) -> usize {
        if self.unpipelined {
            return 1;
        }
        [1, 2, 2, 3][(mix(self.seed, c as u64) % 4) as usize]
    }

    fn instant(&self) -> Instant {
        self.base + self.now
    }

    fn push(&mut self, at: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Queued {
            at,
            seq: self.seq,
            ev,
        }));
    }

    fn after(&mut self, delay: Duration, ev: Ev) {
        let at = self.now + delay;
        self.push(at, ev);
    }

    /// Storage answers operation `op` of sidecar `side` (in its life
    /// `life`) after `delay`.
    fn store_done(&mut self, delay: Duration, side: usize, life: u32, op: OpId, done: Completion) {
        self.after(
            delay,
            Ev::Store {
                side,
                life,
                op,
                done,
            },
        );
    }

    fn latency(&mut self) -> Duration {
        Duration::from_micros(self.rng.u64(50..3_000))
    }

    fn store_latency(&mut self) -> Duration {
        Duration::from_micros(self.rng.u64(500..60_000))
    }

    fn note(&mut self, what: impl FnOnce() -> String) {
        if let Some(trace) = &mut self.trace {
            trace.push(format!("{:>10.3}s {}", self.now.as_secs_f64(), what()));
        }
    }

    fn fail(&self, what: String) -> Violation {
        Violation { at: self.now, what }
    }

    /// Runs to the end; `Err` names the first violated invariant.
    pub(crate) fn run(self) -> Result<Summary, (Violation, Option<Vec<String>>)> {
        match self.run_traced() {
            (Ok(summary), _) => Ok(summary),
            (Err(v), trace) => Err((v, trace)),
        }
    }

    /// Runs, and returns the trace (of a world built with one) whatever
    /// the outcome.
    pub(crate) fn run_traced(mut self) -> (Result<Summary, Violation>, Option<Vec<String>>) {
        let result = self.run_inner();
        let result = self.conclude(result);
        (result, self.trace.take())
    }

    fn conclude(&mut self, result: Check) -> Result<Summary, Violation> {
        match result {
            Ok(()) => {
                let mut summary = Summary {
                    steps: self.steps,
                    closes: self.closes,
                    cut_pipelines: self.cut.len() as u64,
                    pipelined_data: self.pipelined_data,
                    runs_refused: self.runs_refused,
                    dropped_replies: self.dropped_replies,
                    overtaken: self.overtaken,
                    ..Summary::default()
                };
                for c in &self.consumers {
                    match &c.state {
                        ConsumerState::Done => summary.complete += 1,
                        ConsumerState::Stopped => summary.stopped += 1,
                        ConsumerState::Dead => summary.dead += 1,
                        ConsumerState::Failed(e) if e.contains("abandoned") => {
                            summary.abandoned += 1
                        }
                        ConsumerState::Failed(e) if e.contains("aborted") => summary.aborted += 1,
                        ConsumerState::Failed(e) if e.contains("gave up") => summary.gave_up += 1,
                        ConsumerState::Failed(_) => summary.other_errors += 1,
                        ConsumerState::Waiting | ConsumerState::Running => summary.waiting += 1,
                    }
                }
                for side in &self.sides {
                    if let Some(core) = &side.core {
                        let stats = core.stats();
                        summary.failover_replies += stats.failover_replies;
                        summary.remote_restarts += stats.remote_restarts;
                        summary.forgotten_markers_read += stats.forgotten_markers_read;
                        summary.bytes_evicted += stats.bytes_evicted;
                        summary.pages_spilled += stats.pages_spilled;
                        summary.busy += stats.busy_replies;
                        summary.append_token_refusals += stats.append_token_refusals;
                    }
                }
                summary.folded_markers_read = self.store.folded_read;
                summary.folded_markers_released = self.store.folded_released;
                for d in &self.deleters {
                    summary.task_deletes_refused += u64::from(d.refused_too_wide);
                    if d.deleted {
                        match d.remote {
                            None => summary.task_deletes += 1,
                            Some(_) => summary.task_deletes_forwarded += 1,
                        }
                    }
                }
                Ok(summary)
            }
            Err(what) => Err(self.fail(what)),
        }
    }

    fn run_inner(&mut self) -> Check {
        while let Some(Reverse(Queued { at, ev, .. })) = self.queue.pop() {
            if at > RUN_FOR {
                break;
            }
            self.now = at;
            self.steps += 1;
            if self.trace.is_some() {
                let line = self.describe_event(&ev);
                self.note(|| line);
            }
            self.step(ev)?;
            self.check_cores()?;
        }
        self.check_end()
    }

    fn step(&mut self, ev: Ev) -> Check {
        match ev {
            Ev::Request {
                side,
                life,
                conn,
                waiter,
                raw,
                body,
                door,
            } => self.request(side, life, conn, waiter, *raw, body, door),
            Ev::Reply {
                actor,
                epoch,
                reply,
            } => match actor {
                Actor::Producer(p) => self.producer_reply(p, epoch, reply),
                Actor::Consumer(c) => self.consumer_reply(c, epoch, reply),
                Actor::Deleter(d) => self.deleter_reply(d, reply),
            },
            Ev::Store {
                side,
                life,
                op,
                done,
            } => self.complete_on(side, life, op, |core, op, now| done.deliver(core, op, now)),
            Ev::Forwarded {
                side,
                life,
                op,
                result,
            } => {
                // As binxd's forwarder: the HELLO reply named the remote's
                // node and process instance.
                self.complete_on(side, life, op, |core, op, now| {
                    let mut from = None;
                    let result = result.map(|(frame, addr, node, instance)| {
                        core.remote_identified(&addr, node);
                        core.remote_instance(&addr, instance.clone(), now);
                        from = Some(instance);
                        frame
                    });
                    core.forwarded_from(op, result, from, now);
                })
            }
            Ev::Withheld {
                side,
                life,
                op,
                from: (addr, node, instance),
            } => self.complete_on(side, life, op, |core, op, now| {
                core.remote_identified(&addr, node);
                core.remote_instance(&addr, instance.clone(), now);
                core.forward_withheld(op, instance, now);
            }),
            Ev::Plan {
                side,
                life,
                waiter,
                plan,
            } => {
                if self.sides[side].life != life {
                    return Ok(());
                }
                let reply = self.carry_out(side, plan)?;
                self.deliver(side, waiter, reply);
                self.drain_core(side)
            }
            Ev::Timer { side, life } => {
                // Only the timer last set counts (earlier ones are stale).
                if self.sides[side].life != life || self.sides[side].timer_at != Some(self.now) {
                    return Ok(());
                }
                self.sides[side].timer_at = None;
                let now = self.instant();
                if let Some(core) = self.sides[side].core.as_mut() {
                    core.handle_timeout(now);
                    if let Some(at) = core.poll_timeout()
                        && at <= now
                    {
                        return Err(format!(
                            "sidecar {side}: after handle_timeout its next deadline is still due ({:?} ago)",
                            now - at
                        ));
                    }
                }
                self.drain_core(side)
            }
            Ev::Tick(Actor::Producer(p)) => self.producer_tick(p),
            Ev::Tick(Actor::Consumer(c)) => self.consumer_tick(c),
            Ev::Tick(Actor::Deleter(d)) => self.deleter_tick(d),
            Ev::Consumed(c) => {
                self.consumers[c].held = 0;
                self.consumer_tick(c)
            }
            Ev::Crash(side) => self.crash(side),
            Ev::Restart { side, rename } => self.restart(side, rename),
            Ev::Drain(side) => {
                let now = self.instant();
                let s = &mut self.sides[side];
                if let Some(core) = s.core.as_mut() {
                    s.draining = true;
                    core.start_drain(now);
                    let grace = Duration::from_millis(self.rng.u64(2_000..30_000));
                    self.after(grace, Ev::Crash(side));
                    let back = grace + Duration::from_millis(self.rng.u64(1_000..10_000));
                    let rename = self.rng.bool();
                    self.after(back, Ev::Restart { side, rename });
                    self.note(|| format!("sidecar {side} drains"));
                    return self.drain_core(side);
                }
                Ok(())
            }
            Ev::Partition { a, b, until } => {
                self.note(|| format!("partition {a} <-> {b} until {:.3}s", until.as_secs_f64()));
                self.partitions.push((a, b, until));
                Ok(())
            }
            Ev::CloseProducer { p, epoch } => self.producer_close(p, epoch),
            Ev::Cancel { side, life, ticket } => {
                if self.sides[side].life != life {
                    return Ok(());
                }
                let now = self.instant();
                let s = &mut self.sides[side];
                s.waiters.remove(&ticket);
                let Some(core) = s.core.as_mut() else {
                    return Ok(());
                };
                core.cancel(ticket, now);
                self.drain_core(side)
            }
            Ev::ConnClosed { side, life, conn } => {
                self.unread.insert(conn);
                if self.sides[side].life != life {
                    return Ok(());
                }
                self.note_cut(side, conn);
                let now = self.instant();
                let Some(core) = self.sides[side].core.as_mut() else {
                    return Ok(());
                };
                core.connection_closed(conn, now);
                self.drain_core(side)
            }
        }
    }

    /// Counts a connection that goes with an ENQUEUE waiting ahead of a
    /// NO_MORE_PAGES (what a cancelled ENQUEUE must not let through).
    fn note_cut(&mut self, side: usize, conn: ConnId) {
        let mut enqueue_ahead = false;
        for (_, c, what) in self.sides[side].mutations.values() {
            if *c != conn {
                continue;
            }
            match what {
                ProducerReq::Batch(_) => enqueue_ahead = true,
                ProducerReq::NoMorePages if enqueue_ahead => {
                    self.cut.insert(conn);
                    return;
                }
                _ => {}
            }
        }
    }

    /// Hands sidecar `side` the completion of its op `op`, unless the
    /// sidecar died since it started the op (`life`).
    fn complete_on(
        &mut self,
        side: usize,
        life: u32,
        op: OpId,
        deliver: impl FnOnce(&mut Core, OpId, Instant),
    ) -> Check {
        if self.sides[side].life != life {
            return Ok(());
        }
        let now = self.instant();
        let Some(core) = self.sides[side].core.as_mut() else {
            return Ok(());
        };
        core.complete(op, now, |core, op| deliver(core, op, now));
        self.drain_core(side)
    }

    fn crash(&mut self, side: usize) -> Check {
        if self.sides[side].core.is_none() {
            return Ok(());
        }
        self.note(|| format!("sidecar {side} crashes"));
        let s = &mut self.sides[side];
        s.core = None;
        s.life += 1;
        s.timer_at = None;
        s.draining = false;
        s.mutations.clear();
        s.doors.clear();
        s.parked.clear();
        let waiters: Vec<Waiter> = std::mem::take(&mut s.waiters).into_values().collect();
        for waiter in waiters {
            self.lost(waiter)?;
        }
        // The engine in the same pod goes too.
        for p in &mut self.producers {
            if p.side == side && !p.dead {
                p.dead = true;
            }
        }
        for c in &mut self.consumers {
            if c.side == side && matches!(c.state, ConsumerState::Waiting | ConsumerState::Running)
            {
                c.state = ConsumerState::Dead;
            }
        }
        Ok(())
    }

    fn restart(&mut self, side: usize, rename: bool) -> Check {
        if self.sides[side].core.is_some() {
            return Ok(());
        }
        if rename {
            self.sides[side].node = format!("pod{side}-r{}", self.sides[side].life);
        }
        let node = self.sides[side].node.clone();
        let core = self.new_core(&node);
        let s = &mut self.sides[side];
        s.core = Some(core);
        let node = s.node.clone();
        let life = s.life;
        self.note(|| format!("sidecar {side} restarts as {node}"));
        // The startup prune, as binx-spool does it: this node's overflow
        // objects of earlier runs, unless a commit marker names them.
        let leftovers: Vec<String> = self
            .store
            .objects
            .iter()
            .filter(|(name, o)| {
                o.node == node
                    && o.life < life
                    && o.durability == Durability::Overflow
                    && self.store.named_by_marker(name).is_none()
            })
            .map(|(n, _)| n.clone())
            .collect();
        for name in leftovers {
            self.store.objects.remove(&name);
        }
        Ok(())
    }

    // ------------------------------------------------------------ producer

    fn describe_event(&self, ev: &Ev) -> String {
        let req = |r: &BinRequest| {
            format!(
                "{} #{} task {} buffer {} token {}{}{}{}",
                r.message_type().map_or("?", MessageType::name),
                r.request_id,
                r.task_id,
                r.buffer_id,
                r.append_token.unwrap_or(r.page_token),
                if r.get_data_size { " sizes" } else { "" },
                if r.remote.is_empty() {
                    String::new()
                } else {
                    format!(" via {}", r.remote)
                },
                if r.page_sizes.is_empty() {
                    String::new()
                } else {
                    format!(" pages {:?}", r.page_sizes)
                },
            )
        };
        let rep = |r: &Reply| {
            let h = &r.header;
            format!(
                "{} #{} {} tokens {}..{}{}{} {}",
                MessageType::try_from(h.r#type).map_or("?", MessageType::name),
                h.request_id,
                h.status_kind().name(),
                h.page_token,
                h.page_next_token,
                if h.buffer_complete { " complete" } else { "" },
                if h.remaining_bytes.is_empty() {
                    String::new()
                } else {
                    format!(" sizes {:?}", h.remaining_bytes)
                },
                h.error
            )
        };
        match ev {
            Ev::Request {
                side,
                waiter,
                raw,
                door,
                ..
            } => {
                format!("-> sidecar {side} ({door:?}) from {waiter:?}: {}", req(raw))
            }
            Ev::Reply { actor, reply, .. } => match reply {
                Some(r) => format!("<- {actor:?}: {}", rep(r)),
                None => format!("<- {actor:?}: connection lost"),
            },
            Ev::Store { side, op, done, .. } => {
                format!("store done for sidecar {side} {op:?}: {done:?}")
            }
            Ev::Forwarded {
                side, op, result, ..
            } => match result {
                Ok((frame, addr, node, instance)) => format!(
                    "forwarded reply to sidecar {side} {op:?} from {addr} ({node}, instance {instance}): {}",
                    rep(&Reply::new(frame.header.clone()))
                ),
                Err(e) => format!("forward of sidecar {side} {op:?} failed: {e}"),
            },
            Ev::Withheld {
                side,
                op,
                from: (addr, _, instance),
                ..
            } => {
                format!("forward of sidecar {side} {op:?} withheld: {addr} is instance {instance}")
            }
            Ev::Plan { side, plan, .. } => {
                format!("sidecar {side} reads for a plan: {}", plan.what)
            }
            Ev::Timer { side, .. } => format!("timer of sidecar {side}"),
            Ev::Tick(a) => format!("tick {a:?}"),
            Ev::Consumed(c) => format!("consumer {c} took its pages"),
            Ev::Crash(s) => format!("crash sidecar {s}"),
            Ev::Restart { side, rename } => format!("restart sidecar {side} rename={rename}"),
            Ev::Drain(s) => format!("drain sidecar {s}"),
            Ev::Partition { a, b, .. } => format!("partition {a} {b}"),
            Ev::CloseProducer { p, epoch } => {
                format!("producer {p} may lose connection {epoch}")
            }
            Ev::Cancel { side, ticket, .. } => format!("sidecar {side} cancels {ticket:?}"),
            Ev::ConnClosed { side, conn, .. } => {
                format!("sidecar {side} sees {conn:?} closed")
            }
        }
    }

    /// The schedule and the outcome, for a failing seed.
    pub(crate) fn describe(params: &Params) -> String {
        let mut s = String::new();
        let _ = write!(s, "{params:?}");
        s
    }

    pub(crate) fn params(&self) -> &Params {
        &self.params
    }
}
