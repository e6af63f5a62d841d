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

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use binx_core::config::SpoolRules;
use binx_core::door::{ConnectionDoor, DoorConfig, ExchangeFacts, Transport, Verdict};
use binx_core::source::{PullConfig, PullStep, ReplyPart, SourceMachine};
use binx_core::{
    BufferState, Command, CommitMarker, ConnId, Core, CoreConfig, DataPlan, Door, Durability,
    Event, Handled, ManifestPlan, ObjectMeta, OpId, Outcome, Payload, Reply, Resolved, Ticket,
};
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
}

#[derive(Debug)]
enum StoreDone {
    Written(Result<ObjectMeta, String>),
    Marker(Result<(), String>),
    ObjectDeleted(Result<(), String>),
    MarkerDeleted(Result<(), String>),
    MarkerRead(Result<Option<CommitMarker>, String>),
    Released,
    ManifestWritten(Result<(), String>),
    ManifestDeleted(Result<(), String>),
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
        done: StoreDone,
    },
    Forwarded {
        side: usize,
        life: u32,
        op: OpId,
        /// The reply, and the remote's address and node name.
        result: Result<(Frame<BinReply>, String, String), String>,
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
    core: Option<Core>,
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
struct SimFacts {
    memory_full: bool,
}

impl ExchangeFacts for SimFacts {
    fn memory_full(&self) -> bool {
        self.memory_full
    }
    fn forwards(&self) -> bool {
        true
    }
    fn capabilities(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The door every simulated connection passes: binxd's defaults.
fn door_rules() -> DoorConfig {
    DoorConfig {
        shared_secret: None,
        max_frame_length: binx_proto::DEFAULT_MAX_FRAME_LENGTH,
        max_outstanding_requests: 1024,
        server_name: "sim".into(),
        shm_offered: false,
    }
}

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
    serial: u64,
    failed_deletes: u64,
}

impl Store {
    fn named_by_marker(&self, name: &str) -> Option<&(String, u64)> {
        self.markers
            .iter()
            .find(|(_, m)| m.segments.iter().any(|s| s.name == name))
            .map(|(k, _)| k)
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
    dropped_replies: u64,
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
    pub pages_spilled: u64,
    pub busy: u64,
    /// Producer connections that closed while requests waited.
    pub closes: u64,
    /// Of those, ones with an ENQUEUE waiting ahead of a NO_MORE_PAGES.
    pub cut_pipelines: u64,
    /// DATA sent by a consumer while another of its DATA was in flight.
    pub pipelined_data: u64,
    /// Replies to DATA a consumer no longer waited for, dropped.
    pub dropped_replies: u64,
    /// ENQUEUE and NO_MORE_PAGES refused for their `append_token` (by
    /// sidecars that did not crash).
    pub append_token_refusals: u64,
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
        self.pages_spilled += other.pages_spilled;
        self.busy += other.busy;
        self.closes += other.closes;
        self.cut_pipelines += other.cut_pipelines;
        self.pipelined_data += other.pipelined_data;
        self.dropped_replies += other.dropped_replies;
        self.append_token_refusals += other.append_token_refusals;
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
        let params = Params::draw(&mut rng);
        let mut world = World {
            seed,
            pipelined_data: 0,
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
            partitions: Vec::new(),
            arbitrary_seen: BTreeMap::new(),
            links: BTreeMap::new(),
            unread: BTreeSet::new(),
            cut: BTreeSet::new(),
            closes: 0,
            chaos: fastrand::Rng::with_seed(seed ^ 0x9e37_79b9_7f4a_7c15),
            burst_at: None,
            trace: trace.then(Vec::new),
            steps: 0,
            rng,
        };
        for i in 0..params.sidecars {
            let side = Sidecar {
                addr: format!("pod{i}:8091"),
                node: format!("pod{i}"),
                life: 0,
                core: Some(world.new_core()),
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

    fn new_core(&mut self) -> Core {
        let p = &self.params;
        Core::new(CoreConfig {
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
                spill_concurrency: 2,
                always_refusal: None,
                presigns: p.presigns,
                codec: Default::default(),
                failover_after: p.failover_after,
                max_pending_deletes: 64,
                // Committed buffers nobody reads are dropped at their TTL,
                // well within the run.
                ttl: p.abandon_after * (2 + (mix(self.seed ^ 0x6a09_e667_f3bc_c909, 0) % 4) as u32),
            }),
            ..CoreConfig::default()
        })
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
    fn store_done(&mut self, delay: Duration, side: usize, life: u32, op: OpId, done: StoreDone) {
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
                    dropped_replies: self.dropped_replies,
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
                        summary.pages_spilled += stats.pages_spilled;
                        summary.busy += stats.busy_replies;
                        summary.append_token_refusals += stats.append_token_refusals;
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

    fn check_cores(&mut self) -> Check {
        for (i, side) in self.sides.iter().enumerate() {
            if let Some(core) = &side.core {
                core.check_invariants()
                    .map_err(|e| format!("sidecar {i}: {e}"))?;
            }
        }
        // A NO_MORE_PAGES takes effect when its task's input is finished,
        // which may be before its reply (under `always` the reply waits for
        // the commit markers, and may even be BUSY).
        for p in 0..self.producers.len() {
            let pr = &self.producers[p];
            if !pr.nmp_sent || pr.nmp_applied {
                continue;
            }
            let Some(core) = &self.sides[pr.side].core else {
                continue;
            };
            let finished = core
                .task_snapshots(&pr.task_id, self.base + self.now)
                .iter()
                .any(|t| t.task_id == pr.task_id && t.input_finished);
            if finished {
                self.nmp_took_effect(p)?;
            }
        }
        // A buffer its consumer deleted (even before the task opened) holds
        // no page: the producer's pages for it are dropped on arrival.
        // (Only for consumers on the producer's own sidecar: a proxy consumer
        // whose producer is unreachable deletes from storage, and the
        // producer drops the buffer when it is abandoned.)
        for c in self.consumers.iter().filter(|c| c.deleted) {
            let pr = &self.producers[c.task];
            if pr.kind != BufferKind::Partitioned
                || self.sides[pr.side].life > 0
                || c.side != pr.side
            {
                continue;
            }
            let Some(core) = &self.sides[pr.side].core else {
                continue;
            };
            for task in core.task_snapshots(&pr.task_id, self.base + self.now) {
                if task.task_id != pr.task_id {
                    continue;
                }
                if let Some(b) = task.buffers.iter().find(|b| b.buffer_id == c.buffer)
                    && b.pages_held > 0
                {
                    return Err(format!(
                        "buffer {} of task {} was deleted by its consumer, yet holds {} pages",
                        c.buffer, pr.task_id, b.pages_held
                    ));
                }
            }
        }
        Ok(())
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
            },
            Ev::Store {
                side,
                life,
                op,
                done,
            } => {
                if self.sides[side].life != life {
                    return Ok(());
                }
                let now = self.instant();
                let Some(core) = self.sides[side].core.as_mut() else {
                    return Ok(());
                };
                match done {
                    StoreDone::Written(r) => core.segment_written(op, r, now),
                    StoreDone::Marker(r) => core.marker_written(op, r, now),
                    StoreDone::ObjectDeleted(r) => core.object_deleted(op, r, now),
                    StoreDone::MarkerDeleted(r) => core.marker_deleted(op, r, now),
                    StoreDone::MarkerRead(r) => core.marker_read(op, r, now),
                    StoreDone::Released => core.released(op, now),
                    StoreDone::ManifestWritten(r) => core.manifest_written(op, r, now),
                    StoreDone::ManifestDeleted(r) => core.manifest_deleted(op, r, now),
                }
                self.drain_core(side)
            }
            Ev::Forwarded {
                side,
                life,
                op,
                result,
            } => {
                if self.sides[side].life != life {
                    return Ok(());
                }
                let now = self.instant();
                let Some(core) = self.sides[side].core.as_mut() else {
                    return Ok(());
                };
                // As binxd's forwarder: the HELLO reply named the remote's node.
                let result = result.map(|(frame, addr, node)| {
                    core.remote_identified(&addr, node);
                    frame
                });
                core.forwarded(op, result, now);
                self.drain_core(side)
            }
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

    /// What the core answered an ENQUEUE or NO_MORE_PAGES of a producer
    /// (whether or not the producer still waits for it): OK means it took
    /// effect.
    fn mutation_done(&mut self, side: usize, ticket: Ticket, status: Status) -> Check {
        let Some((p, _, what)) = self.sides[side].mutations.remove(&ticket) else {
            return Ok(());
        };
        self.mutation_answered(p, what, status)
    }

    fn mutation_answered(&mut self, p: usize, what: ProducerReq, status: Status) -> Check {
        if status != Status::Ok {
            return Ok(());
        }
        match what {
            ProducerReq::Batch(i) => {
                // An OK that dropped the pages (their consumer deleted the
                // buffer, or every consumer went) says nothing of order.
                let buffer = self.producers[p].batches[i].buffer;
                if self.drops_pages(p, buffer) {
                    self.producers[p].applied[i] = true;
                    return Ok(());
                }
                let pr = &mut self.producers[p];
                let has_pages = |j: usize| !pr.batches[j].sizes.is_empty();
                let key =
                    |j: usize| (pr.kind == BufferKind::Partitioned).then_some(pr.batches[j].buffer);
                if has_pages(i) && pr.applied[i] {
                    return Err(format!(
                        "producer {p}: ENQUEUE {i} of task {} took effect twice",
                        pr.task_id
                    ));
                }
                // Its buffer holds every page before it: each page at the
                // token its producer meant.
                let missing: Vec<usize> = (0..i)
                    .filter(|&j| key(j) == key(i) && has_pages(j) && !pr.applied[j])
                    .collect();
                if has_pages(i) && !missing.is_empty() {
                    return Err(format!(
                        "producer {p}: ENQUEUE {i} of task {} took effect before ENQUEUEs {missing:?} of the same buffer (numbered: {}, states {:?})",
                        pr.task_id, pr.numbered, pr.states
                    ));
                }
                pr.applied[i] = true;
                Ok(())
            }
            ProducerReq::NoMorePages if !self.producers[p].nmp_applied => self.nmp_took_effect(p),
            _ => Ok(()),
        }
    }

    /// Whether producer `p`'s sidecar drops pages enqueued to `buffer` now
    /// (its consumer deleted or abandoned it, or the task ended).
    fn drops_pages(&self, p: usize, buffer: u64) -> bool {
        let pr = &self.producers[p];
        let Some(core) = &self.sides[pr.side].core else {
            return true;
        };
        let tasks = core.task_snapshots(&pr.task_id, self.base + self.now);
        let Some(task) = tasks.iter().find(|t| t.task_id == pr.task_id) else {
            return true;
        };
        let gone = |b: &binx_core::BufferSnapshot| {
            matches!(b.state, BufferState::Deleted | BufferState::Abandoned)
        };
        if pr.kind == BufferKind::Partitioned {
            // A buffer deleted before its first page never shows.
            return task
                .buffers
                .iter()
                .find(|b| b.buffer_id == buffer)
                .is_none_or(gone);
        }
        // A shared log's pages go nowhere once every buffer of a fixed
        // count is gone (its consumers deleted them: the task is over).
        task.buffer_count
            .is_some_and(|count| task.buffers.len() as u64 == count)
            && task.buffers.iter().all(gone)
    }

    /// A producer's NO_MORE_PAGES took effect: so did every ENQUEUE it sent
    /// before it (whatever took effect is a prefix of what a connection
    /// sent, and a producer sends NO_MORE_PAGES only after all its
    /// ENQUEUEs, on the same connection or after their OK).
    fn nmp_took_effect(&mut self, p: usize) -> Check {
        // An ENQUEUE whose pages would be dropped now (its buffer, or every
        // buffer, deleted by consumers) loses nothing by not taking effect.
        let missing: Vec<usize> = (0..self.producers[p].batches.len())
            .filter(|&i| {
                let pr = &self.producers[p];
                !pr.applied[i] && !self.drops_pages(p, pr.batches[i].buffer)
            })
            .collect();
        let pr = &mut self.producers[p];
        pr.nmp_applied = true;
        if !missing.is_empty() {
            return Err(format!(
                "producer {p}: the NO_MORE_PAGES of task {} took effect, but ENQUEUEs {missing:?} it sent before it did not (states {:?})",
                pr.task_id, pr.states
            ));
        }
        Ok(())
    }

    /// A commit manifest says, of every buffer still committed, exactly
    /// where its producer ended it and how many bytes it made for it: a
    /// coordinator sizes tasks and checks reads by it.
    fn check_manifest(&self, side: usize, plan: &ManifestPlan) -> Check {
        let Some(p) = self
            .producers
            .iter()
            .position(|pr| pr.task_id == plan.task.as_str())
        else {
            return Err(format!(
                "sidecar {side} writes a manifest of unknown task {}",
                plan.task
            ));
        };
        let pr = &self.producers[p];
        for (b, &(end, bytes)) in plan.buffers.iter().enumerate() {
            let b = b as u64;
            if !self.store.markers.contains_key(&(pr.task_id.clone(), b)) {
                // Deleted or dropped since: nobody reads it by the manifest.
                continue;
            }
            let mine = |batch: &&Batch| pr.kind != BufferKind::Partitioned || batch.buffer == b;
            let pages: u64 = pr
                .batches
                .iter()
                .filter(mine)
                .map(|x| x.sizes.len() as u64)
                .sum();
            let made: u64 = pr
                .batches
                .iter()
                .filter(mine)
                .flat_map(|x| x.sizes.iter())
                .map(|&size| size as u64)
                .sum();
            if (end, bytes) != (pages, made) {
                return Err(format!(
                    "the manifest of task {} says buffer {b} ends at {end} with {bytes} bytes; its producer made {pages} pages of {made} bytes",
                    pr.task_id
                ));
            }
        }
        Ok(())
    }

    fn partitioned(&self, a: usize, b: usize) -> bool {
        self.partitions
            .iter()
            .any(|&(x, y, until)| self.now < until && ((x, y) == (a, b) || (x, y) == (b, a)))
    }

    #[allow(clippy::too_many_arguments)]
    fn request(
        &mut self,
        side: usize,
        life: u32,
        conn: ConnId,
        waiter: Waiter,
        mut raw: BinRequest,
        body: Bytes,
        door: Door,
    ) -> Check {
        if self.sides[side].life != life || self.sides[side].core.is_none() {
            // The sidecar went while the request travelled.
            return self.lost(waiter);
        }
        if self.unread.contains(&conn) {
            // Its connection closed: binxd reads nothing after that (its
            // client learnt of the close on its own).
            self.note(|| format!("request on closed connection {conn:?} is not read"));
            return Ok(());
        }
        let s = &mut self.sides[side];
        let core = s.core.as_ref().expect("checked above");
        let facts = SimFacts {
            memory_full: core.memory_full(),
        };
        let transport = match door {
            Door::Remote => Transport::Tcp,
            Door::Local => Transport::Uds,
        };
        let rules = door_rules();
        let verdict = s
            .doors
            .entry(conn)
            .or_insert_with(|| ConnectionDoor::new(transport, 2, &rules, None))
            .check(&mut raw, &rules, &facts);
        let request = match verdict {
            Verdict::Submit(request) => request,
            Verdict::Reply(header) => {
                self.deliver(side, waiter, Reply::new(header));
                return Ok(());
            }
            Verdict::Close { reply, .. } => {
                self.unread.insert(conn);
                self.deliver(side, waiter, Reply::new(reply));
                return Ok(());
            }
        };
        let now = self.instant();
        let body_len = body.len() as u64;
        let s = &mut self.sides[side];
        s.next_ticket += 1;
        let ticket = Ticket(s.next_ticket);
        let core = s.core.as_mut().expect("checked above");
        let handled = core.handle(ticket, conn, request, Payload::exact(body), now);
        let mutation = match &waiter {
            Waiter::Actor(Actor::Producer(p), _) => self.producers[*p]
                .sent
                .get(&raw.request_id)
                .copied()
                .filter(|w| matches!(w, ProducerReq::Batch(_) | ProducerReq::NoMorePages))
                .map(|w| (*p, w)),
            _ => None,
        };
        if let Some((p, what)) = mutation {
            match &handled {
                Handled::Reply(reply) => {
                    self.mutation_answered(p, what, reply.header.status_kind())?;
                }
                Handled::Pending => {
                    self.sides[side].mutations.insert(ticket, (p, conn, what));
                }
                Handled::Plan(_) => {}
            }
        }
        match handled {
            Handled::Reply(reply) => self.deliver(side, waiter, reply),
            Handled::Plan(plan) => {
                let delay = self.store_latency();
                self.after(
                    delay,
                    Ev::Plan {
                        side,
                        life,
                        waiter,
                        plan,
                    },
                );
            }
            Handled::Pending => {
                let s = &mut self.sides[side];
                s.waiters.insert(ticket, waiter);
                s.parked.insert(ticket, (conn, body_len));
                if let Some(door) = s.doors.get_mut(&conn) {
                    door.parked(body_len);
                }
            }
        }
        self.drain_core(side)
    }

    /// A request whose sidecar died: its waiter learns the connection is gone.
    fn lost(&mut self, waiter: Waiter) -> Check {
        match waiter {
            Waiter::Actor(actor, epoch) => {
                let delay = self.latency();
                self.after(
                    delay,
                    Ev::Reply {
                        actor,
                        epoch,
                        reply: None,
                    },
                );
            }
            Waiter::Remote { from, life, op } => {
                let delay = Duration::from_millis(self.rng.u64(100..2_000));
                self.after(
                    delay,
                    Ev::Forwarded {
                        side: from,
                        life,
                        op,
                        result: Err("connection reset".into()),
                    },
                );
            }
        }
        Ok(())
    }

    fn deliver(&mut self, side: usize, waiter: Waiter, reply: Reply) {
        match waiter {
            Waiter::Actor(actor, epoch) => {
                let delay = self.latency();
                self.after(
                    delay,
                    Ev::Reply {
                        actor,
                        epoch,
                        reply: Some(reply),
                    },
                );
            }
            Waiter::Remote { from, life, op } => {
                let lost =
                    self.partitioned(side, from) || self.rng.f64() < self.params.drop_forward;
                let node = self.sides[side].node.clone();
                let addr = self.sides[side].addr.clone();
                if lost {
                    let delay = Duration::from_millis(self.rng.u64(1_000..8_000));
                    self.after(
                        delay,
                        Ev::Forwarded {
                            side: from,
                            life,
                            op,
                            result: Err("the reply was lost".into()),
                        },
                    );
                } else {
                    let delay = self.latency();
                    let frame = Frame {
                        header: reply.header,
                        body: Bytes::from(reply.body.concat()),
                    };
                    self.after(
                        delay,
                        Ev::Forwarded {
                            side: from,
                            life,
                            op,
                            result: Ok((frame, addr, node)),
                        },
                    );
                }
            }
        }
    }

    /// Carries out what a sidecar's core asked for.
    fn drain_core(&mut self, side: usize) -> Check {
        loop {
            let Some(core) = self.sides[side].core.as_mut() else {
                return Ok(());
            };
            let Some(event) = core.poll_event() else {
                break;
            };
            let life = self.sides[side].life;
            match event {
                Event::Outcome { ticket, outcome } => {
                    let s = &mut self.sides[side];
                    if let Some((conn, body_len)) = s.parked.remove(&ticket)
                        && let Some(door) = s.doors.get_mut(&conn)
                    {
                        door.answered(body_len);
                    }
                    if let Outcome::Reply(reply) = &outcome {
                        self.mutation_done(side, ticket, reply.header.status_kind())?;
                    }
                    let Some(waiter) = self.sides[side].waiters.remove(&ticket) else {
                        if let Outcome::Plan(plan) = outcome {
                            let now = self.instant();
                            if let Some(core) = self.sides[side].core.as_mut() {
                                core.plan_finished(plan.lease, Status::Ok, now);
                            }
                        }
                        continue;
                    };
                    match outcome {
                        Outcome::Reply(reply) => self.deliver(side, waiter, reply),
                        Outcome::Plan(plan) => {
                            let delay = self.store_latency();
                            self.after(
                                delay,
                                Ev::Plan {
                                    side,
                                    life,
                                    waiter,
                                    plan,
                                },
                            );
                        }
                    }
                }
                Event::Command { op, command } => self.command(side, life, op, command)?,
            }
        }
        // The core's next deadline.
        let now = self.now;
        let base = self.base;
        let s = &mut self.sides[side];
        if let Some(at) = s.core.as_ref().and_then(Core::poll_timeout) {
            let at = at.saturating_duration_since(base).max(now);
            if s.timer_at.is_none_or(|t| at < t) {
                s.timer_at = Some(at);
                let life = s.life;
                self.push(at, Ev::Timer { side, life });
            }
        }
        Ok(())
    }

    fn command(&mut self, side: usize, life: u32, op: OpId, command: Command) -> Check {
        let delay = self.store_latency();
        let fails = self.rng.f64() < self.params.store_fail;
        let node = self.sides[side].node.clone();
        match command {
            Command::WriteSegment {
                task,
                first_token,
                pages,
                durability,
            } => {
                let done = if fails {
                    // Sometimes the object lands although the writer hears
                    // of a failure (a timeout after the write).
                    if self.rng.bool() {
                        self.store.serial += 1;
                        let name = format!("{node}-l{life}-{}-orphan", self.store.serial);
                        self.store.objects.insert(
                            name,
                            StoredObject {
                                pages: pages.clone(),
                                node: node.clone(),
                                side,
                                life,
                                durability,
                            },
                        );
                    }
                    StoreDone::Written(Err("the store is unreachable".into()))
                } else {
                    self.store.serial += 1;
                    let letter = match durability {
                        Durability::Overflow => "o",
                        Durability::Durable => "a",
                    };
                    let name = format!("{node}-l{life}-{}-{letter}-{task}", self.store.serial);
                    let meta = ObjectMeta {
                        store: 0,
                        name: name.clone(),
                        first_token,
                        page_sizes: pages.iter().map(|p| p.len() as u64).collect(),
                        stored_size: pages.iter().map(|p| p.len() as u64).sum(),
                        codec: Default::default(),
                        key: None,
                        expires_at_unix_ms: 0,
                    };
                    self.store.objects.insert(
                        name,
                        StoredObject {
                            pages,
                            node: node.clone(),
                            side,
                            life,
                            durability,
                        },
                    );
                    StoreDone::Written(Ok(meta))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::WriteMarker(plan) => {
                let done = if fails {
                    StoreDone::Marker(Err("the store is unreachable".into()))
                } else {
                    for o in &plan.objects {
                        if !self.store.objects.contains_key(&o.name) {
                            return Err(format!(
                                "sidecar {side} commits buffer {} of task {} naming object {}, which is not in storage",
                                plan.buffer, plan.task, o.name
                            ));
                        }
                    }
                    self.store.markers.insert(
                        (plan.task.to_string(), plan.buffer),
                        CommitMarker {
                            task_id: plan.task.to_string(),
                            buffer_id: plan.buffer,
                            end_token: plan.end_token,
                            node: node.clone(),
                            endpoint: self.sides[side].addr.clone(),
                            segments: plan.objects.iter().map(|o| (**o).clone()).collect(),
                            shared: plan.shared,
                        },
                    );
                    StoreDone::Marker(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::DeleteObject(meta) => {
                let done = if self.rng.f64() < self.params.delete_fail {
                    self.store.failed_deletes += 1;
                    StoreDone::ObjectDeleted(Err("the store is unreachable".into()))
                } else {
                    if let Some((task, buffer)) = self.store.named_by_marker(&meta.name) {
                        return Err(format!(
                            "sidecar {side} deletes object {} while the commit marker of buffer {buffer} of task {task} names it",
                            meta.name
                        ));
                    }
                    self.store.objects.remove(&meta.name);
                    StoreDone::ObjectDeleted(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::DeleteMarker { task, buffer } => {
                let done = if self.rng.f64() < self.params.delete_fail {
                    StoreDone::MarkerDeleted(Err("the store is unreachable".into()))
                } else {
                    self.store.markers.remove(&(task.to_string(), buffer));
                    StoreDone::MarkerDeleted(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::ReadMarker { task, buffer } => {
                let done = if fails {
                    StoreDone::MarkerRead(Err("the store is unreachable".into()))
                } else {
                    StoreDone::MarkerRead(Ok(self
                        .store
                        .markers
                        .get(&(task.to_string(), buffer))
                        .cloned()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::WriteManifest(plan) => {
                let done = if fails {
                    StoreDone::ManifestWritten(Err("the store is unreachable".into()))
                } else {
                    self.check_manifest(side, &plan)?;
                    self.store
                        .manifests
                        .insert(plan.task.to_string(), (side, life, plan));
                    StoreDone::ManifestWritten(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::ReadManifest { task } => {
                // Nothing in the simulation asks COMMITTED (the core's
                // tests and the Java plugin's do); answered all the same.
                let result = if fails {
                    Err(binx_core::ManifestError::Unavailable(
                        "the store is unreachable".into(),
                    ))
                } else {
                    Ok(self.store.manifests.get(task.as_str()).map(|(s, _, plan)| {
                        binx_core::Manifest {
                            node: self.sides[*s].node.clone(),
                            endpoint: self.sides[*s].addr.clone(),
                            buffers: plan.buffers.clone(),
                        }
                    }))
                };
                let now = self.instant();
                if let Some(core) = self.sides[side].core.as_mut() {
                    core.manifest_read(op, result, now);
                }
            }
            Command::DeleteManifest { task } => {
                let done = if self.rng.f64() < self.params.delete_fail {
                    self.store.failed_deletes += 1;
                    StoreDone::ManifestDeleted(Err("the store is unreachable".into()))
                } else {
                    self.store.manifests.remove(task.as_str());
                    StoreDone::ManifestDeleted(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::ReleaseCommitted(marker) => {
                // As binx-spool does: the marker, then the segments no
                // other marker of the task lists (BROADCAST buffers share
                // segments: the last marker to go takes them), shared ones
                // only once the task's manifest exists (before that, a
                // producer that is only cut off may still serve them or
                // list them in markers it has yet to write); the last
                // marker to go takes the manifest.
                self.store
                    .markers
                    .remove(&(marker.task_id.clone(), marker.buffer_id));
                let has_manifest = self.store.manifests.contains_key(marker.task_id.as_str());
                let markers_left = self
                    .store
                    .markers
                    .keys()
                    .any(|(task, _)| *task == marker.task_id);
                if has_manifest && !markers_left {
                    self.store.manifests.remove(marker.task_id.as_str());
                }
                let segments: &[_] = if marker.shared && !has_manifest {
                    &[]
                } else {
                    &marker.segments
                };
                for segment in segments {
                    let listed = self.store.markers.values().any(|m| {
                        m.task_id == marker.task_id
                            && m.segments.iter().any(|s| s.name == segment.name)
                    });
                    if !listed {
                        if let Some(key) = self.store.named_by_marker(&segment.name) {
                            return Err(format!(
                                "releasing a committed buffer deletes {} which marker {key:?} names",
                                segment.name
                            ));
                        }
                        self.store.objects.remove(&segment.name);
                    }
                }
                self.store_done(delay, side, life, op, StoreDone::Released);
            }
            Command::Forward { remote, request } => {
                let target = self.sides.iter().position(|s| s.addr == remote);
                let reachable = target.is_some_and(|t| {
                    self.sides[t].core.is_some()
                        && !self.partitioned(side, t)
                        && self.rng.f64() >= self.params.drop_forward
                });
                match target {
                    Some(t) if reachable => {
                        let delay = self.latency();
                        let tlife = self.sides[t].life;
                        self.after(
                            delay,
                            Ev::Request {
                                side: t,
                                life: tlife,
                                conn: ConnId(1_000_000 + side as u64),
                                waiter: Waiter::Remote {
                                    from: side,
                                    life,
                                    op,
                                },
                                raw: request,
                                body: Bytes::new(),
                                door: Door::Remote,
                            },
                        );
                    }
                    _ => {
                        let delay = Duration::from_millis(self.rng.u64(10..5_000));
                        self.after(
                            delay,
                            Ev::Forwarded {
                                side,
                                life,
                                op,
                                result: Err(format!("cannot connect to {remote}")),
                            },
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads what a DATA plan names from the store and assembles the reply,
    /// as binx-server's driver does.
    fn carry_out(&mut self, side: usize, plan: DataPlan) -> Result<Reply, String> {
        let read: Vec<u64> = plan.objects().map(|(m, _)| m.page_bytes()).collect();
        if read.len() > 1 && read.iter().sum::<u64>() > MAX_STORED_REPLY {
            return Err(format!(
                "sidecar {side} planned to read back objects of {read:?} bytes ({}), more than {MAX_STORED_REPLY}",
                plan.what
            ));
        }
        let mut resolved = Vec::new();
        for (meta, may_presign) in plan.objects() {
            if may_presign && self.rng.bool() {
                resolved.push(Resolved::Url {
                    url: format!("sim://{}", meta.name),
                    expires_at_unix_ms: 1,
                });
                continue;
            }
            let transient = self.rng.f64() < self.params.store_fail;
            resolved.push(match self.store.objects.get(&meta.name) {
                _ if transient => Resolved::Failed {
                    error: "the store is unreachable".into(),
                    retry: true,
                },
                Some(o) => Resolved::Pages(Arc::new(o.pages.clone())),
                None => Resolved::Failed {
                    error: format!("{} does not exist", meta.name),
                    retry: false,
                },
            });
        }
        let lease = plan.lease;
        let what = plan.what.clone();
        let reply = plan.assemble(resolved);
        let status = reply.header.status_kind();
        if status == Status::ServerError {
            return Err(format!(
                "sidecar {side} could not read pages it planned ({what}): {}",
                reply.header.error
            ));
        }
        let now = self.instant();
        if let Some(core) = self.sides[side].core.as_mut() {
            core.plan_finished(lease, status, now);
        }
        Ok(reply)
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
        let core = self.new_core();
        let s = &mut self.sides[side];
        if rename {
            s.node = format!("pod{side}-r{}", s.life);
        }
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

    fn send(&mut self, actor: Actor, side: usize, raw: BinRequest, body: Bytes, epoch: u64) {
        let life = self.sides[side].life;
        let conn = match actor {
            Actor::Producer(p) => producer_conn(p, epoch),
            Actor::Consumer(c) => ConnId(c as u64 * 2 + 2 + 10_000),
        };
        let arrive = match self.burst_at {
            Some(at) => at,
            None => self.now + self.latency(),
        };
        let last = self.links.get(&(actor, side)).copied().unwrap_or_default();
        let at = arrive.max(last + Duration::from_micros(1));
        self.links.insert((actor, side), at);
        self.push(
            at,
            Ev::Request {
                side,
                life,
                conn,
                waiter: Waiter::Actor(actor, epoch),
                raw: Box::new(raw),
                body,
                door: Door::Local,
            },
        );
    }

    fn producer_request(&mut self, p: usize, kind: MessageType, what: ProducerReq) -> BinRequest {
        let pr = &mut self.producers[p];
        pr.next_id += 1;
        let mut r = BinRequest::new(kind);
        r.request_id = pr.next_id;
        r.task_id = pr.task_id.clone();
        pr.in_flight.insert(pr.next_id, what);
        pr.sent.insert(pr.next_id, what);
        r
    }

    fn producer_tick(&mut self, p: usize) -> Check {
        let pr = &self.producers[p];
        if pr.dead
            || pr.aborted
            || pr.dropped
            || (pr.nmp_ok && !pr.lost)
            || self.now < pr.backoff_until
        {
            return Ok(());
        }
        let side = pr.side;
        if self.sides[side].core.is_none() {
            self.producers[p].dead = true;
            return Ok(());
        }
        let epoch = pr.epoch;
        if !pr.opened {
            if !pr.open_in_flight {
                let (kind, buffers, policy) = (pr.kind, pr.buffers, pr.policy);
                let mut r = self.producer_request(p, MessageType::OpenTask, ProducerReq::Open);
                r.buffer_kind = kind as i32;
                r.buffer_count = if self.producers[p].fixed { buffers } else { 0 };
                r.spool_policy = policy.to_string();
                self.producers[p].open_in_flight = true;
                self.send(Actor::Producer(p), side, r, Bytes::new(), epoch);
            }
            return Ok(());
        }
        // What to send again: BUSY batches, and, for a producer that
        // numbers its appends, those a lost connection left unknown (the
        // numbers make a second copy of an applied one a refusal).
        let numbered = pr.numbered;
        let again = |s: BatchState| s == BatchState::Busy || (numbered && s == BatchState::Unknown);
        if pr.states.iter().any(|&s| again(s)) {
            // Resend from the first of them once nothing is in flight.
            if pr.in_flight.is_empty() {
                let pr = &mut self.producers[p];
                for s in &mut pr.states {
                    if again(*s) {
                        *s = BatchState::Unsent;
                    }
                }
            } else {
                return Ok(());
            }
        }
        let pr = &self.producers[p];
        let sent_ok = pr.states.iter().filter(|s| **s == BatchState::Ok).count();
        let gave_up = pr
            .busy_since
            .is_some_and(|since| self.now - since > GIVE_UP);
        if (pr.abort_after.is_some_and(|after| sent_ok >= after) || gave_up || pr.lost)
            && !pr.aborted
        {
            let mut r = self.producer_request(p, MessageType::AbortTask, ProducerReq::Abort);
            r.reason = "the query was cancelled".into();
            self.producers[p].aborted = true;
            self.note(|| format!("producer {p} aborts"));
            self.send(Actor::Producer(p), side, r, Bytes::new(), epoch);
            return Ok(());
        }
        let in_flight = pr
            .states
            .iter()
            .filter(|s| **s == BatchState::InFlight)
            .count();
        // The next unsent batches, in order, as many as the window allows
        // (a pipelining producer sends them all).
        let room = if pr.pipelined {
            usize::MAX
        } else {
            pr.window.saturating_sub(in_flight)
        };
        // One that does not number its appends keeps at most one ENQUEUE
        // of a buffer in flight (docs/PROTOCOL.md, numbered appends).
        let key = |i: usize| {
            if pr.kind == BufferKind::Partitioned {
                pr.batches[i].buffer
            } else {
                u64::MAX
            }
        };
        let mut busy_keys: BTreeSet<u64> = (0..pr.states.len())
            .filter(|&i| pr.states[i] == BatchState::InFlight)
            .map(key)
            .collect();
        let to_send: Vec<usize> = match pr.states.iter().position(|s| *s == BatchState::Unsent) {
            Some(first) => (first..pr.states.len())
                .take_while(|&i| {
                    pr.states[i] == BatchState::Unsent && (pr.numbered || busy_keys.insert(key(i)))
                })
                .take(room)
                .collect(),
            None => Vec::new(),
        };
        let sent_now = to_send.len();
        if pr.pipelined && sent_now > 0 {
            let at = self.now + self.latency();
            self.burst_at = Some(at);
        }
        for i in to_send {
            let pr = &self.producers[p];
            let batch = &pr.batches[i];
            let (task, kind, buffer) = (pr.task, pr.kind, batch.buffer);
            let bodies: Vec<Bytes> = batch
                .sizes
                .iter()
                .enumerate()
                .map(|(j, &size)| {
                    let b = if kind == BufferKind::Partitioned {
                        buffer as u32
                    } else {
                        u32::MAX
                    };
                    page(task, b, batch.first_seq + j as u64, size)
                })
                .collect();
            let sizes: Vec<u64> = bodies.iter().map(|b| b.len() as u64).collect();
            // A pipelining producer waits long enough that all it sent at
            // once is queued before the first can time out (one sent after
            // a BUSY reply was written would be applied: PROTOCOL.md).
            let wait = if pr.pipelined {
                self.rng.u64(1_000_000..6_000_000)
            } else {
                self.rng.u64(0..3_000_000)
            };
            let first_seq = batch.first_seq;
            let numbered = pr.numbered;
            let mut r = self.producer_request(p, MessageType::Enqueue, ProducerReq::Batch(i));
            r.buffer_id = buffer;
            r.page_sizes = sizes;
            r.max_wait_micros = wait;
            // A batch's first page is its first sequence number's token.
            r.append_token = numbered.then_some(first_seq);
            self.producers[p].states[i] = BatchState::InFlight;
            self.send(
                Actor::Producer(p),
                side,
                r,
                Bytes::from(bodies.concat()),
                epoch,
            );
        }
        let pr = &self.producers[p];
        // A pipelining producer of a BROADCAST or ARBITRARY task sends
        // NO_MORE_PAGES right behind the ENQUEUEs it just sent, unanswered,
        // naming the token the task ends at: it takes effect only after all
        // of them, however their replies go. (A PARTITIONED task's buffers
        // end at tokens of their own, which one NO_MORE_PAGES cannot name:
        // its producer waits for every OK.)
        let ends_at = (pr.numbered && pr.kind != BufferKind::Partitioned)
            .then(|| pr.batches.iter().map(|b| b.sizes.len() as u64).sum::<u64>());
        let burst = pr.pipelined
            && ends_at.is_some()
            && sent_now > 0
            && in_flight == 0
            && pr
                .states
                .iter()
                .all(|s| matches!(s, BatchState::Ok | BatchState::InFlight));
        if (burst || pr.states.iter().all(|s| *s == BatchState::Ok)) && !pr.nmp_in_flight {
            let mut counts = BTreeMap::new();
            for b in &pr.batches {
                let key = if pr.kind == BufferKind::Partitioned {
                    b.buffer
                } else {
                    u64::MAX
                };
                *counts.entry(key).or_insert(0) += b.sizes.len() as u64;
            }
            let mut r =
                self.producer_request(p, MessageType::NoMorePages, ProducerReq::NoMorePages);
            r.buffer_id = ALL_BUFFERS;
            r.append_token = ends_at;
            let pr = &mut self.producers[p];
            pr.final_counts = counts;
            pr.nmp_sent = true;
            pr.nmp_in_flight = true;
            self.send(Actor::Producer(p), side, r, Bytes::new(), epoch);
        }
        self.burst_at = None;
        let pr = &mut self.producers[p];
        if pr.closes_left > 0 && !pr.close_pending && !pr.in_flight.is_empty() {
            // The connection may go while what was just sent waits.
            pr.close_pending = true;
            let delay = Duration::from_millis(self.chaos.u64(0..1_500));
            self.after(delay, Ev::CloseProducer { p, epoch });
        }
        Ok(())
    }

    /// A producer that finished (or aborted) closes its connection: from
    /// then on its task's abandon clock runs.
    fn producer_done(&mut self, p: usize) {
        let pr = &self.producers[p];
        let (side, conn) = (pr.side, producer_conn(p, pr.epoch));
        let life = self.sides[side].life;
        let at = self.now + self.latency();
        self.push(at, Ev::ConnClosed { side, life, conn });
    }

    /// The producer's connection closes (the producer crashed and came
    /// back, or the connection dropped) if requests wait on it; the
    /// producer reconnects knowing only the replies it saw.
    fn producer_close(&mut self, p: usize, epoch: u64) -> Check {
        let pr = &mut self.producers[p];
        if pr.epoch != epoch || pr.dead || pr.aborted || pr.dropped || pr.closes_left == 0 {
            pr.close_pending = false;
            return Ok(());
        }
        let side = pr.side;
        let conn = producer_conn(p, epoch);
        let waiting: Vec<Ticket> = self.sides[side]
            .mutations
            .iter()
            .filter(|(_, (q, c, _))| *q == p && *c == conn)
            .map(|(&t, _)| t)
            .collect();
        if waiting.is_empty() || self.sides[side].core.is_none() {
            // Nothing waits (yet): look again while requests are out.
            if self.producers[p].in_flight.is_empty() || self.sides[side].core.is_none() {
                self.producers[p].close_pending = false;
            } else {
                let delay = Duration::from_millis(self.chaos.u64(5..300));
                self.after(delay, Ev::CloseProducer { p, epoch });
            }
            return Ok(());
        }
        self.closes += 1;
        // The producer: a new connection, and every request it saw no reply
        // to is of unknown fate.
        let delay = Duration::from_millis(self.chaos.u64(1..500));
        let pr = &mut self.producers[p];
        pr.closes_left -= 1;
        pr.close_pending = false;
        pr.epoch += 1;
        for (_, what) in std::mem::take(&mut pr.in_flight) {
            match what {
                ProducerReq::Batch(i) => {
                    pr.states[i] = BatchState::Unknown;
                    // Numbered, it resends and learns from the reply.
                    pr.lost |= !pr.numbered;
                }
                // NO_MORE_PAGES again is exact (a repeated one is OK).
                ProducerReq::NoMorePages => pr.nmp_in_flight = false,
                ProducerReq::Open => pr.open_in_flight = false,
                ProducerReq::Abort => {}
            }
        }
        pr.backoff_until = self.now + delay;
        let lost = pr.lost;
        self.after(delay + MS, Ev::Tick(Actor::Producer(p)));
        // binxd: what it does as the connection goes.
        let life = self.sides[side].life;
        let how = self.chaos.usize(0..3);
        let what = [
            "reset",
            "closed after its last frames",
            "dropped request by request",
        ][how];
        self.note(|| {
            format!(
                "producer {p}'s connection {conn:?} goes ({what}) with {} waiting; it {}",
                waiting.len(),
                if lost {
                    "will abort"
                } else {
                    "will carry on, resending what it has no reply to"
                }
            )
        });
        match how {
            0 => {
                // Reset: frames still travelling are lost.
                self.unread.insert(conn);
                self.step(Ev::ConnClosed { side, life, conn })?;
            }
            1 => {
                // The client closed: binxd reads the frames sent before.
                let last = self
                    .links
                    .get(&(Actor::Producer(p), side))
                    .copied()
                    .unwrap_or_default();
                let at = last.max(self.now) + self.latency();
                self.push(at, Ev::ConnClosed { side, life, conn });
            }
            _ => {
                // The request futures are dropped one by one, in any order
                // (some maybe not before the connection is seen closed).
                self.unread.insert(conn);
                self.note_cut(side, conn);
                let mut tickets = waiting;
                self.chaos.shuffle(&mut tickets);
                let keep = self.chaos.usize(0..tickets.len());
                tickets.truncate(tickets.len() - keep);
                let mut at = self.now;
                for ticket in tickets {
                    at += Duration::from_micros(self.chaos.u64(0..20_000));
                    self.push(at, Ev::Cancel { side, life, ticket });
                }
                at += Duration::from_micros(self.chaos.u64(0..20_000));
                self.push(at, Ev::ConnClosed { side, life, conn });
            }
        }
        Ok(())
    }

    fn producer_reply(&mut self, p: usize, epoch: u64, reply: Option<Reply>) -> Check {
        if self.producers[p].epoch != epoch || self.producers[p].dead {
            return Ok(());
        }
        let Some(reply) = reply else {
            self.producers[p].dead = true;
            return Ok(());
        };
        let id = reply.header.request_id;
        let Some(what) = self.producers[p].in_flight.remove(&id) else {
            return Err(format!(
                "producer {p} got a reply to request {id}, which it did not send or already had"
            ));
        };
        let status = reply.header.status_kind();
        let pr = &mut self.producers[p];
        match (what, status) {
            (ProducerReq::Open, Status::Ok) => {
                pr.opened = true;
                pr.open_in_flight = false;
            }
            (ProducerReq::Open, Status::ServerError) if self.sides[pr.side].draining => {
                // A draining sidecar takes no new task: this producer gives up.
                pr.dead = true;
            }
            (ProducerReq::Open, _) => {
                pr.open_in_flight = false;
                pr.backoff_until = self.now + 100 * MS;
            }
            (ProducerReq::Batch(i), Status::Ok) => {
                pr.busy_since = None;
                pr.states[i] = BatchState::Ok;
            }
            (ProducerReq::Batch(i), Status::Busy) => {
                pr.busy_since.get_or_insert(self.now);
                pr.states[i] = BatchState::Busy;
                pr.backoff_until = self.now + Duration::from_millis(50);
            }
            (ProducerReq::Batch(i), Status::BadRequest)
                if pr.numbered && reply.header.page_next_token != reply.header.page_token =>
            {
                // Its append_token was not the buffer's next token N.
                let (first, count) = (pr.batches[i].first_seq, pr.batches[i].sizes.len() as u64);
                let next = reply.header.page_next_token;
                if reply.header.page_token != first {
                    return Err(format!(
                        "producer {p}: the refusal of ENQUEUE {i} names token {}, not its append_token {first}",
                        reply.header.page_token
                    ));
                }
                if next >= first + count {
                    // An earlier copy of it was applied (its pages are
                    // there: numbers name one batch).
                    pr.states[i] = BatchState::Ok;
                    if count == 0 {
                        pr.applied[i] = true;
                    }
                } else if next < first {
                    // Sent behind one that was not applied: again later.
                    pr.busy_since.get_or_insert(self.now);
                    pr.states[i] = BatchState::Busy;
                    pr.backoff_until = self.now + Duration::from_millis(50);
                } else {
                    return Err(format!(
                        "producer {p}: ENQUEUE {i} of tokens {first}..{} was refused with the buffer at token {next}, inside it: {}",
                        first + count,
                        reply.header.error
                    ));
                }
            }
            (ProducerReq::Batch(_), Status::ServerError) if pr.aborted => {}
            (ProducerReq::Batch(_) | ProducerReq::NoMorePages, Status::ServerError)
                if reply
                    .header
                    .error
                    .contains("dropped that task as abandoned") =>
            {
                pr.dropped = true;
                self.producer_done(p);
                return Ok(());
            }
            (ProducerReq::Batch(i), other) => {
                return Err(format!(
                    "producer {p}: ENQUEUE {i} answered {}: {}",
                    other.name(),
                    reply.header.error
                ));
            }
            (ProducerReq::NoMorePages, Status::Ok) => {
                pr.nmp_ok = true;
                pr.nmp_in_flight = false;
                // Done: it closes its connection (an engine's sink does).
                if !pr.lost {
                    self.producer_done(p);
                }
            }
            (ProducerReq::NoMorePages, Status::Busy) => {
                pr.nmp_in_flight = false;
                pr.backoff_until = self.now + 100 * MS;
            }
            (ProducerReq::NoMorePages, Status::BadRequest)
                if pr.numbered && reply.header.page_next_token < reply.header.page_token =>
            {
                // Sent behind an ENQUEUE that was not applied: again once
                // every ENQUEUE is.
                pr.nmp_in_flight = false;
                pr.backoff_until = self.now + 100 * MS;
            }
            (ProducerReq::NoMorePages, Status::ServerError) if pr.aborted => {}
            (ProducerReq::NoMorePages, other) => {
                return Err(format!(
                    "producer {p}: NO_MORE_PAGES answered {}: {}",
                    other.name(),
                    reply.header.error
                ));
            }
            (ProducerReq::Abort, _) => self.producer_done(p),
        }
        let delay = self.producers[p].backoff_until.saturating_sub(self.now) + MS;
        self.after(delay, Ev::Tick(Actor::Producer(p)));
        Ok(())
    }

    // ------------------------------------------------------------ consumer

    fn consumer_tick(&mut self, c: usize) -> Check {
        let cs = &mut self.consumers[c];
        if !matches!(cs.state, ConsumerState::Waiting | ConsumerState::Running) {
            return Ok(());
        }
        if self.sides[cs.side].core.is_none() {
            cs.state = ConsumerState::Dead;
            return Ok(());
        }
        cs.state = ConsumerState::Running;
        if let Some((at, pause)) = cs.stall
            && !cs.stalled
            && cs.machine.token() >= at
        {
            cs.stalled = true;
            let (task, buffer) = (cs.task, cs.buffer);
            self.after(pause, Ev::Tick(Actor::Consumer(c)));
            self.note(|| {
                format!("consumer of buffer {buffer} of task {task} stalls for {pause:?}")
            });
            return Ok(());
        }
        let side = cs.side;
        let epoch = cs.epoch;
        if let Some(at) = cs.delete_at
            && cs.machine.token() >= at
        {
            let mut r = BinRequest::new(MessageType::Delete);
            r.task_id = self.producers[cs.task].task_id.clone();
            r.buffer_id = cs.buffer;
            r.remote = cs.machine.config().remote.clone().unwrap_or_default();
            cs.next_id += 1;
            r.request_id = cs.next_id;
            cs.in_flight.insert(r.request_id, r.clone());
            cs.state = ConsumerState::Stopped;
            self.send(Actor::Consumer(c), side, r, Bytes::new(), epoch);
            return Ok(());
        }
        // As many requests as the machine wants in flight (more than one
        // only while it pipelines DATA).
        loop {
            let cs = &mut self.consumers[c];
            match cs.machine.poll(cs.held) {
                PullStep::Send(mut r) => {
                    if cs.in_flight.len() > 8 {
                        return Err(format!(
                            "consumer of buffer {} keeps more than 8 requests in flight",
                            cs.buffer
                        ));
                    }
                    cs.next_id += 1;
                    r.request_id = cs.next_id;
                    cs.in_flight.insert(r.request_id, (*r).clone());
                    if cs.machine.data_in_flight() > 1 {
                        self.pipelined_data += 1;
                    }
                    self.send(Actor::Consumer(c), side, *r, Bytes::new(), epoch);
                }
                PullStep::WaitForConsumer | PullStep::AwaitReply => break,
                PullStep::Done => {
                    cs.state = ConsumerState::Done;
                    break;
                }
            }
        }
        Ok(())
    }

    fn consumer_reply(&mut self, c: usize, epoch: u64, reply: Option<Reply>) -> Check {
        let cs = &mut self.consumers[c];
        if cs.epoch != epoch {
            return Ok(());
        }
        let Some(reply) = reply else {
            // The connection went with its sidecar.
            if cs.state != ConsumerState::Stopped && !cs.in_flight.is_empty() {
                cs.in_flight.clear();
                cs.state = ConsumerState::Dead;
            }
            return Ok(());
        };
        let Some(request) = cs.in_flight.remove(&reply.header.request_id) else {
            return Ok(());
        };
        if cs.state == ConsumerState::Stopped {
            if request.r#type == MessageType::Delete as i32
                && reply.header.status_kind() == Status::Ok
            {
                if cs.hostile {
                    return Err(format!(
                        "a local client naming an unreachable remote deleted buffer {} of task {}",
                        cs.buffer, self.producers[cs.task].task_id
                    ));
                }
                cs.deleted = true;
            }
            return Ok(());
        }
        let pid = cs.task;
        let status = reply.header.status_kind();
        let what = format!(
            "consumer of buffer {} of task {} (token {})",
            cs.buffer,
            self.producers[pid].task_id,
            cs.machine.token()
        );
        match status {
            Status::Ok | Status::NoData if cs.hostile => {
                return Err(format!(
                    "{what}, naming an unreachable remote, got {} for {:?}",
                    status.name(),
                    request.message_type()
                ));
            }
            _ if !cs.machine.awaits(&request) => {
                // A pipelined DATA past a reply that ended elsewhere, or one
                // that came before the replies ahead of it: dropped, and
                // refusals of it are no failure (its token may have been
                // acknowledged meanwhile).
                cs.machine
                    .on_reply(&request, None)
                    .map_err(|e| format!("{what}: {e}"))?;
                self.dropped_replies += 1;
                self.after(MS, Ev::Tick(Actor::Consumer(c)));
            }
            Status::Ok | Status::NoData => {
                cs.error_since = None;
                let body = Bytes::from(reply.body.concat());
                let parts = cs
                    .machine
                    .on_reply(&request, Some((&reply.header, body.len())))
                    .map_err(|e| {
                        format!("{what} got a reply that does not continue its buffer: {e}")
                    })?;
                if request.get_data_size
                    && reply.header.buffer_complete
                    && reply.header.remaining_bytes.is_empty()
                {
                    cs.completed = true;
                    self.check_complete(c)?;
                }
                if request.r#type == MessageType::Data as i32 && !request.get_data_size {
                    let mut pages: Vec<(u64, Bytes)> = Vec::new();
                    for part in parts {
                        match part {
                            ReplyPart::Inline {
                                first_token,
                                offset,
                                sizes,
                            } => {
                                let mut at = offset;
                                for (i, size) in sizes.iter().enumerate() {
                                    let end = at + *size as usize;
                                    pages.push((first_token + i as u64, body.slice(at..end)));
                                    at = end;
                                }
                            }
                            ReplyPart::Spooled {
                                first_token,
                                segment,
                            } => {
                                let Some(segment::Body::Spooled(spooled)) = &segment.body else {
                                    return Err(format!("{what}: a spooled part without a body"));
                                };
                                let name = spooled.uri.trim_start_matches("sim://");
                                let Some(object) = self.store.objects.get(name) else {
                                    // Gone between the reply and the fetch (its
                                    // task ended meanwhile): as binx-client does,
                                    // ask again at the same token; the sidecar
                                    // says why, or serves it again.
                                    let token = request.page_token;
                                    let cs = &mut self.consumers[c];
                                    cs.machine.retry_pages(token);
                                    let delay = Duration::from_millis(self.rng.u64(10..500));
                                    self.after(delay, Ev::Tick(Actor::Consumer(c)));
                                    return Ok(());
                                };
                                for (i, p) in object.pages.iter().enumerate() {
                                    pages.push((first_token + i as u64, p.clone()));
                                }
                            }
                        }
                    }
                    for (token, data) in pages {
                        self.check_page(c, token, &data)?;
                    }
                    if reply.header.buffer_complete {
                        let cs = &mut self.consumers[c];
                        cs.completed = true;
                        self.check_complete(c)?;
                    }
                }
                let cs = &mut self.consumers[c];
                if cs.held > 0 {
                    let slow = c.is_multiple_of(3);
                    let delay =
                        Duration::from_millis(self.rng.u64(0..if slow { 2_000 } else { 200 }));
                    self.after(delay, Ev::Consumed(c));
                }
                self.after(MS, Ev::Tick(Actor::Consumer(c)));
            }
            Status::Busy | Status::Timeout => {
                cs.machine.on_reply(&request, None).ok();
                let since = *cs.error_since.get_or_insert(self.now);
                if self.now - since > GIVE_UP {
                    cs.state = ConsumerState::Failed(format!("gave up: {}", reply.header.error));
                    return Ok(());
                }
                let delay = Duration::from_millis(self.rng.u64(50..1_000));
                self.after(delay, Ev::Tick(Actor::Consumer(c)));
            }
            _ if cs.machine.tolerates_refusal(&request) => {
                // Asked past the next page on the word of following_sizes,
                // and refused: asked again once that page came.
                cs.machine
                    .on_reply(&request, None)
                    .map_err(|e| format!("{what}: {e}"))?;
                self.dropped_replies += 1;
                self.after(MS, Ev::Tick(Actor::Consumer(c)));
            }
            Status::ServerError => {
                let error = reply.header.error.clone();
                let producer = &self.producers[pid];
                let explained =
                    (error.contains("aborted") && producer.aborted) || error.contains("abandoned");
                if !explained {
                    return Err(format!(
                        "{what} failed with an error that names no reason it could have: {error}"
                    ));
                }
                if cs.completed {
                    return Err(format!("{what} failed after its buffer completed: {error}"));
                }
                cs.state = ConsumerState::Failed(error);
            }
            Status::BadRequest
                if self.producers[pid].kind == BufferKind::Broadcast
                    && !self.producers[pid].fixed
                    && reply.header.error.contains("not part of its buffer set") =>
            {
                // A late consumer of an open-ended broadcast set is told so.
                cs.state = ConsumerState::Failed(reply.header.error.clone());
            }
            other => {
                return Err(format!(
                    "{what} got {} to {:?}: {}",
                    other.name(),
                    request.message_type(),
                    reply.header.error
                ));
            }
        }
        Ok(())
    }

    /// A page received at `token` must be exactly the page produced there.
    fn check_page(&mut self, c: usize, token: u64, data: &Bytes) -> Check {
        let cs = &self.consumers[c];
        // Every page once, in token order: nothing skipped, nothing twice.
        if token != cs.pages {
            return Err(format!(
                "consumer {c} of buffer {} got page {token} after {} pages",
                cs.buffer, cs.pages
            ));
        }
        let producer = &self.producers[cs.task];
        let (task, kind) = (producer.task, producer.kind);
        let expected_buffer = if kind == BufferKind::Partitioned {
            cs.buffer as u32
        } else {
            u32::MAX
        };
        if data.len() >= 16 {
            let t = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize;
            let b = u32::from_be_bytes([data[4], data[5], data[6], data[7]]);
            let seq = u64::from_be_bytes(data[8..16].try_into().unwrap_or_default());
            if t != task || b != expected_buffer {
                return Err(format!(
                    "consumer {c} of buffer {} got page {token} of task {t} buffer {b}",
                    cs.buffer
                ));
            }
            match kind {
                BufferKind::Arbitrary
                    if !self.arbitrary_seen.entry(cs.task).or_default().insert(seq) =>
                {
                    return Err(format!(
                        "page {seq} of arbitrary task {task} was handed out twice"
                    ));
                }
                BufferKind::Arbitrary => {}
                _ if seq != token => {
                    let wrong = format!(
                        "consumer {c} of buffer {} got page {seq} at token {token}",
                        cs.buffer
                    );
                    self.consumers[c].suspect.get_or_insert(wrong);
                }
                _ => {}
            }
        } else if kind != BufferKind::Arbitrary {
            // Small pages: their size and fill must match what was produced at `token`.
            let expected = self.produced_size(cs.task, cs.buffer, token);
            if expected != Some(data.len()) || data.iter().any(|&x| x != (token % 251) as u8) {
                let wrong = format!(
                    "consumer {c} of buffer {} got a {}-byte page at token {token}, where {expected:?} bytes were produced",
                    cs.buffer,
                    data.len()
                );
                self.consumers[c].suspect.get_or_insert(wrong);
            }
        }
        let cs = &mut self.consumers[c];
        cs.held += data.len() as u64;
        cs.pages += 1;
        Ok(())
    }

    fn produced_size(&self, p: usize, buffer: u64, token: u64) -> Option<usize> {
        let pr = &self.producers[p];
        pr.batches
            .iter()
            .filter(|b| pr.kind != BufferKind::Partitioned || b.buffer == buffer)
            .find(|b| (b.first_seq..b.first_seq + b.sizes.len() as u64).contains(&token))
            .map(|b| b.sizes[(token - b.first_seq) as usize])
    }

    /// A buffer reads as complete only with every page its producer
    /// finished it with.
    fn check_complete(&self, c: usize) -> Check {
        let cs = &self.consumers[c];
        let pr = &self.producers[cs.task];
        if let Some(wrong) = &cs.suspect {
            return Err(format!("a buffer read as complete, but {wrong}"));
        }
        if !pr.nmp_sent || !pr.nmp_applied {
            return Err(format!(
                "buffer {} of task {} read as complete at token {}, but no NO_MORE_PAGES of its producer took effect (sent: {})",
                cs.buffer,
                pr.task_id,
                cs.machine.token(),
                pr.nmp_sent
            ));
        }
        // Every ENQUEUE sent before NO_MORE_PAGES (all of them) took effect.
        let missing: Vec<usize> = (0..pr.batches.len())
            .filter(|&i| {
                !pr.applied[i]
                    && (pr.kind != BufferKind::Partitioned || pr.batches[i].buffer == cs.buffer)
            })
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "buffer {} of task {} read as complete at token {}, but ENQUEUEs {missing:?} its producer sent before NO_MORE_PAGES never took effect",
                cs.buffer,
                pr.task_id,
                cs.machine.token()
            ));
        }
        if pr.kind == BufferKind::Arbitrary {
            return Ok(());
        }
        let key = if pr.kind == BufferKind::Partitioned {
            cs.buffer
        } else {
            u64::MAX
        };
        let expected = pr.final_counts.get(&key).copied().unwrap_or(0);
        if cs.machine.token() != expected {
            return Err(format!(
                "buffer {} of task {} read as complete with {} pages; its producer made {expected}",
                cs.buffer,
                pr.task_id,
                cs.machine.token()
            ));
        }
        Ok(())
    }

    /// At the end: every consumer finished, failed with a reason, or is
    /// waiting on a producer that went; storage holds nothing a live
    /// sidecar no longer needs.
    fn check_end(&mut self) -> Check {
        for (c, cs) in self.consumers.iter().enumerate() {
            let pr = &self.producers[cs.task];
            if let Some(wrong) = &cs.suspect {
                return Err(wrong.clone());
            }
            match &cs.state {
                ConsumerState::Done if !cs.completed => {
                    return Err(format!(
                        "consumer {c} deleted its buffer without completing it"
                    ));
                }
                ConsumerState::Waiting | ConsumerState::Running => {
                    // Waiting forever is allowed only when the producer's
                    // sidecar no longer knows the task (it went without
                    // committing, or ended and was forgotten): as for a
                    // consumer that starts before its producer, the engine
                    // decides how long to wait.
                    let known = self.sides[pr.side].core.as_ref().is_some_and(|core| {
                        !core
                            .task_snapshots(&pr.task_id, self.base + self.now)
                            .is_empty()
                    });
                    if known && !pr.aborted {
                        return Err(format!(
                            "consumer {c} of buffer {} of task {} never finished ({:?}), though its producer lives",
                            cs.buffer, pr.task_id, cs.state
                        ));
                    }
                }
                _ => {}
            }
            if pr.kind == BufferKind::Arbitrary && pr.nmp_ok && !pr.aborted {
                // Checked below over all consumers.
            }
        }
        // Live sidecars hold nothing once every task ended; storage holds
        // nothing of theirs but what a failed deletion left to the TTL.
        for (i, side) in self.sides.iter().enumerate() {
            let Some(core) = &side.core else { continue };
            let stats = core.stats();
            if stats.tasks > 0 || stats.memory_used > 0 {
                let waiting = self.consumers.iter().any(|c| {
                    c.side == i
                        && matches!(c.state, ConsumerState::Waiting | ConsumerState::Running)
                });
                if !waiting {
                    return Err(format!(
                        "sidecar {i} still holds {} tasks and {} bytes at the end",
                        stats.tasks, stats.memory_used
                    ));
                }
            }
            let ttl = stats.deletes_left_to_ttl > 0 || self.store.failed_deletes > 0;
            let leaked: Vec<&String> = self
                .store
                .objects
                .iter()
                .filter(|(name, o)| {
                    o.side == i && o.life == side.life && !name.ends_with("-orphan")
                })
                .map(|(n, _)| n)
                .collect();
            let busy = stats.tasks > 0 || stats.requests_waiting > 0;
            if !leaked.is_empty() && !ttl && !busy {
                return Err(format!(
                    "sidecar {i} left objects in storage after every task ended: {leaked:?}"
                ));
            }
            let manifests: Vec<&String> = self
                .store
                .manifests
                .iter()
                .filter(|(_, (s, l, _))| *s == i && *l == side.life)
                .map(|(task, _)| task)
                .collect();
            if !manifests.is_empty() && !ttl && !busy {
                return Err(format!(
                    "sidecar {i} left commit manifests in storage after every task ended: {manifests:?}"
                ));
            }
        }
        // Arbitrary: when every consumer completed, together they got every page.
        for (pid, pr) in self.producers.iter().enumerate() {
            if pr.kind != BufferKind::Arbitrary {
                continue;
            }
            let all_done = self
                .consumers
                .iter()
                .filter(|c| c.task == pid && !c.hostile)
                .all(|c| c.completed);
            if all_done && pr.nmp_sent {
                let total: u64 = pr.final_counts.values().sum();
                let seen = self.arbitrary_seen.get(&pid).map_or(0, |s| s.len() as u64);
                let small: u64 = pr
                    .batches
                    .iter()
                    .flat_map(|b| b.sizes.iter())
                    .filter(|&&s| s < 16)
                    .count() as u64;
                if seen + small < total {
                    return Err(format!(
                        "arbitrary task {} completed everywhere with {seen} of {total} pages (and {small} too small to name)",
                        pr.task_id
                    ));
                }
            }
        }
        Ok(())
    }

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
                Ok((frame, addr, node)) => format!(
                    "forwarded reply to sidecar {side} {op:?} from {addr} ({node}): {}",
                    rep(&Reply::new(frame.header.clone()))
                ),
                Err(e) => format!("forward of sidecar {side} {op:?} failed: {e}"),
            },
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
