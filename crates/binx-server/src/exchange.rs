//! The I/O driver of the exchange core: a thin loop around
//! [`binx_core::Core`]. It hands the core requests with the time, carries out
//! what comes out (replies to waiting requests, storage commands, forwarded
//! requests, DATA plans that read objects) and feeds completions back. The
//! core's deadlines drive one timer task. Every rule lives in the core.
//!
//! The exchange is sharded by task (`binx_core::shards`): one core per
//! shard, each behind a lock of its own with its own waiters and timer, so
//! requests of tasks on two shards never wait for each other. The shards
//! share the memory budget's atomics and, on the proxy path, what they
//! learn of remotes that answer nothing (`binx_core::RemoteSilences`, a
//! lock taken only when a forward fails or a silent remote answers), and
//! nothing else on the request path; when one frees room another waits for (or starts to wait),
//! [`Core::take_room_signal`] says so and the others look again.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use binx_core::StoreFailure;
use binx_core::config::SpoolRules;
use binx_core::shards::{shard_of_request, spread_room};
use binx_core::{
    Command, ConnId, Core, CoreConfig, CoreStats, DataPlan, Event, Handled, LeaseId, MemoryBudget,
    Outcome, Payload, Request, Resolved, TaskSnapshot, Ticket, shard_of,
};
use binx_proto::{BinReply, ReceiveBudget, Status};
use binx_spool::{SegmentWrite, Spool};
use futures_util::FutureExt;
use tokio::sync::{Notify, oneshot};

use crate::forward::Forwarder;
use crate::metrics::Histograms;
pub use crate::stats::ExchangeStats;

/// A reply frame: header plus page bodies.
pub type Reply = binx_core::Reply;

/// Shared handle to one daemon's exchange; cheap to clone.
#[derive(Clone, Debug)]
pub struct Exchange {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Shard]>,
    /// The memory limit every shard counts against.
    budget: MemoryBudget,
    /// Receive buffers kept for reuse and large frames being received,
    /// every connection together.
    receive_budget: ReceiveBudget,
    /// `max_buffers_per_task`, for reading manifests.
    max_buffers_per_task: u64,
    /// Pages one buffer holds at most (HELLO's `max-pages-per-buffer=`).
    max_pages_per_buffer: u64,
    /// HELLO's `max-enqueue-bytes=` (see [`max_enqueue_bytes`]).
    max_enqueue_bytes: u64,
    /// Pages one ENQUEUE carries at most (HELLO's `max-pages-per-enqueue=`).
    max_pages_per_enqueue: usize,
    spool: Option<Arc<Spool>>,
    forwarder: Mutex<Option<Arc<dyn Forwarder>>>,
    /// What forwarded DATA replies hold at once (the core's
    /// `max_stored_reply_size`, at most 64 MiB): each asks the remote for
    /// no more than the budget and reserves it until written.
    forward_budget: binx_spool::ReplyBudget,
    next_ticket: AtomicU64,
    next_conn: AtomicU64,
    /// Object deletions go to a few workers through a bounded queue (the
    /// core bounds how many are in flight).
    deletes: Mutex<Option<DeleteQueue>>,
    counters: Counters,
    histograms: Histograms,
    /// host:port other sidecars reach this one under (HELLO's `address=`).
    advertised: Mutex<String>,
    /// This process's id (HELLO `instance=`, HTTP `X-*-Task-Instance-Id`):
    /// a producer that reconnects and finds another instance knows the
    /// pages it had confirmed are gone.
    instance: String,
}

/// HELLO's `max-enqueue-bytes=`: an ENQUEUE whose bytes, with
/// [`binx_proto::ENQUEUE_PAGE_COST`] a page, are at most this is never
/// refused as one that can never fit: its pages (copied out of the buffer
/// they were read into when that would not fit) and their slots in their
/// buffer's index, at least 4 of them, fit the smaller of the memory and
/// the task memory limit; the 3 slots a page or three may take besides
/// their own are left out here.
fn max_enqueue_bytes(config: &CoreConfig) -> u64 {
    config
        .task_memory_limit
        .min(config.memory_limit)
        .saturating_sub(3 * binx_proto::ENQUEUE_PAGE_COST)
}

/// 16 hex digits, new at every start of the process: unguessable is not
/// needed (it proves nothing to anyone), only that two starts differ.
fn new_instance_id() -> String {
    use std::hash::BuildHasher;
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    // RandomState is keyed from the OS's randomness once per process.
    let id = std::collections::hash_map::RandomState::new().hash_one((std::process::id(), started));
    format!("{id:016x}")
}

/// One shard: a core and what its driver keeps beside it.
#[derive(Debug)]
struct Shard {
    core: Mutex<Core>,
    /// The requests its core parked, by ticket.
    waiters: Mutex<HashMap<Ticket, oneshot::Sender<Outcome>>>,
    /// Woken when the core's next deadline moved earlier than the timer's.
    timer: Notify,
    armed: Mutex<Option<Instant>>,
}

/// Object deletions for the deleter workers: (shard, op, object).
type DeleteQueue = tokio::sync::mpsc::Sender<(usize, binx_core::OpId, Arc<binx_core::ObjectMeta>)>;

#[derive(Debug, Default)]
struct Counters {
    connections_open: AtomicU64,
    connections_total: AtomicU64,
    connections_refused: AtomicU64,
    connections_timed_out: AtomicU64,
    /// Shared memory connections holding their regions (or creating them).
    shm_reserved: AtomicU64,
    http_unauthenticated: AtomicU64,
    http_long_polls_refused: AtomicU64,
    http_connections_waited: AtomicU64,
    shm_connections_open: AtomicU64,
    shm_attached: AtomicU64,
    tls_kernel: AtomicU64,
    tls_rustls: AtomicU64,
    protocol_errors: AtomicU64,
    bytes_received: AtomicU64,
    bytes_sent: AtomicU64,
}

/// Which connection counter to move.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ConnectionEvent {
    Opened,
    Closed,
    /// A Unix socket connection switched to shared memory, or ended after.
    ShmAttached,
    ShmDetached,
    /// A TLS handshake finished, and the kernel or rustls took the records.
    TlsKernel,
    TlsRustls,
    Refused,
    TimedOut,
    ProtocolError,
    Received(u64),
    Sent(u64),
}

/// The answer to a submitted request: now, or a future that yields it.
pub enum Answer {
    /// Answered at once.
    Ready(Reply),
    /// Parked: the future yields the reply.
    Later(Pin<Box<dyn Future<Output = Reply> + Send>>),
}

/// What the core made of a submitted request, taken out of its lock.
enum Submitted {
    Reply(Reply),
    Plan(DataPlan),
    Waits(oneshot::Receiver<Outcome>),
}

/// Bytes of receive buffers connections keep for reuse, all together: a
/// sixteenth of the memory limit, 4-64 MiB. No page pins them, so the
/// memory limit does not count them; without a bound, each connection
/// writing large frames kept up to three (a 64 MiB limit grew peak RSS by
/// 159 MiB with 16 connections writing 4 MiB pages).
fn spare_buffer_bytes(memory_limit: u64) -> u64 {
    (memory_limit / 16).clamp(4 << 20, 64 << 20)
}

/// Concurrent object deletions at most.
const DELETE_WORKERS: usize = 8;

impl Exchange {
    /// An exchange that holds pages in memory only, in one shard.
    pub fn new(config: CoreConfig) -> Self {
        Exchange::with_spool(config, None)
    }

    /// An exchange of one shard that may spool to `spool`.
    pub fn with_spool(config: CoreConfig, spool: Option<Arc<Spool>>) -> Self {
        Exchange::sharded(config, spool, 1)
    }

    /// An exchange of `shards` shards (1 to [`binx_core::MAX_SHARDS`])
    /// that may spool to `spool` (policies `overflow`, `always`): the core
    /// learns what it must of the spool (segment sizes, whether it can
    /// commit buffers, whether clients get URLs).
    pub fn sharded(mut config: CoreConfig, spool: Option<Arc<Spool>>, shards: usize) -> Self {
        let n = shards.clamp(1, binx_core::MAX_SHARDS);
        config.spool = spool.as_ref().map(|spool| {
            let rules = config.spool.clone().unwrap_or_default();
            let c = spool.config();
            SpoolRules {
                spill_concurrency: spill_writes(rules.spill_concurrency, n),
                spill_target_bytes: c.segment_target_bytes,
                spill_max_bytes: c.segment_max_bytes,
                spill_bytes_max: c.segment_max_bytes.saturating_mul(SPILL_BYTES_IN_SEGMENTS),
                always_refusal: spool.always_refusal(),
                presigns: spool.presigns(),
                codec: c.codec,
                failover_after: c.failover_after,
                node: c.node_name.clone(),
                max_pending_deletes: c.max_pending_deletes,
                ttl: c.ttl,
                ..rules
            }
        });
        let forward_budget =
            binx_spool::ReplyBudget::new(config.max_stored_reply_size.min(64 << 20));
        let budget = MemoryBudget::new(config.memory_limit);
        let receive_budget = ReceiveBudget::new(spare_buffer_bytes(config.memory_limit));
        // A remote is one node whatever the task: what a shard learns of
        // one that answers nothing, the others use too.
        let silences = binx_core::RemoteSilences::new(config.max_tracked_remotes);
        let per_shard = config.for_shard(n);
        let shards = (0..n)
            .map(|_| Shard {
                core: Mutex::new(Core::shard(
                    per_shard.clone(),
                    budget.clone(),
                    silences.clone(),
                )),
                waiters: Mutex::new(HashMap::new()),
                timer: Notify::new(),
                armed: Mutex::new(None),
            })
            .collect();
        let instance = new_instance_id();
        if let Some(spool) = &spool {
            spool.set_instance(instance.clone());
        }
        Exchange {
            inner: Arc::new(Inner {
                shards,
                budget,
                receive_budget,
                max_buffers_per_task: config.max_buffers_per_task,
                max_pages_per_buffer: config.max_pages_per_log,
                max_enqueue_bytes: max_enqueue_bytes(&config),
                max_pages_per_enqueue: config.max_pages_per_enqueue,
                spool,
                forwarder: Mutex::new(None),
                forward_budget,
                next_ticket: AtomicU64::new(1),
                next_conn: AtomicU64::new(1),
                deletes: Mutex::new(None),
                counters: Counters::default(),
                histograms: Histograms::default(),
                advertised: Mutex::new(String::new()),
                instance,
            }),
        }
    }

    /// What every connection's frame reader holds together beyond what
    /// pages pin: spare receive buffers, large frames being received.
    pub fn receive_budget(&self) -> ReceiveBudget {
        self.inner.receive_budget.clone()
    }

    /// Forwards requests that name a `remote` (the proxy consumer).
    pub fn set_forwarder(&self, forwarder: Arc<dyn Forwarder>) {
        *lock(&self.inner.forwarder) = Some(forwarder);
    }

    /// Whether requests that name a `remote` can be forwarded.
    pub fn forwards(&self) -> bool {
        lock(&self.inner.forwarder).is_some()
    }

    /// How many shards.
    pub fn shards(&self) -> usize {
        self.inner.shards.len()
    }

    fn core(&self, shard: usize) -> MutexGuard<'_, Core> {
        lock(&self.inner.shards[shard].core)
    }

    /// The shard that owns `task_id`.
    fn shard_of(&self, task_id: &str) -> usize {
        shard_of(task_id, self.inner.shards.len())
    }

    /// Runs `f` on shard `shard`'s core, carries out what it asked for,
    /// and lets the other shards look at the memory budget again when the
    /// core says they should.
    fn with_shard<R>(&self, shard: usize, f: impl FnOnce(&mut Core) -> R) -> R {
        let sharded = self.inner.shards.len() > 1;
        let (result, signal) = self.step(shard, |core| {
            let result = f(core);
            (result, sharded && core.take_room_signal())
        });
        if signal {
            let now = Instant::now();
            spread_room(self.inner.shards.len(), |i, visit| {
                self.step(i, |core| visit.apply(core, now))
            });
        }
        result
    }

    /// One call into a shard's core under its lock; then its events.
    fn step<R>(&self, shard: usize, f: impl FnOnce(&mut Core) -> R) -> R {
        let (result, events, next) = {
            let mut core = self.core(shard);
            let result = f(&mut core);
            let events: Vec<Event> = std::iter::from_fn(|| core.poll_event()).collect();
            (result, events, core.poll_timeout())
        };
        self.rearm(shard, next);
        self.dispatch(shard, events);
        result
    }

    /// Runs `f` on every shard in turn (`f` gets the shard's index).
    fn each_shard(&self, mut f: impl FnMut(&mut Core)) {
        for shard in 0..self.inner.shards.len() {
            self.with_shard(shard, &mut f);
        }
    }

    fn rearm(&self, shard: usize, next: Option<Instant>) {
        let shard = &self.inner.shards[shard];
        let armed = *lock(&shard.armed);
        if let Some(next) = next
            && armed.is_none_or(|at| next < at)
        {
            shard.timer.notify_one();
        }
    }

    /// A number for a new client connection.
    pub fn new_connection(&self) -> ConnId {
        ConnId(self.inner.next_conn.fetch_add(1, Ordering::Relaxed))
    }

    /// A connection closed: its waiting requests go.
    pub fn connection_closed(&self, conn: ConnId) {
        self.each_shard(|core| core.connection_closed(conn, Instant::now()));
    }

    /// Submits a request that passed the door. The reply is ready now, or
    /// comes from the returned future (dropping it cancels the request).
    pub fn submit(&self, conn: ConnId, request: Request, body: Payload) -> Answer {
        self.submit_at(conn, request, body, Instant::now())
    }

    /// [`Exchange::submit`] for a request that arrived at `now` (the
    /// listener reads the clock once for the core and its latency figure).
    pub fn submit_at(&self, conn: ConnId, request: Request, body: Payload, now: Instant) -> Answer {
        let ticket = Ticket(self.inner.next_ticket.fetch_add(1, Ordering::Relaxed));
        let shard = shard_of_request(&request, conn, self.inner.shards.len());
        let submitted = self.with_shard(shard, |core| {
            match core.handle(ticket, conn, request, body, now) {
                Handled::Reply(reply) => Submitted::Reply(reply),
                Handled::Plan(plan) => Submitted::Plan(plan),
                Handled::Pending => {
                    // A channel only for a request that waits (most are
                    // answered at once, and each channel is an allocation),
                    // registered before the core is unlocked: an outcome for
                    // this ticket can only be dispatched after.
                    let (tx, rx) = oneshot::channel();
                    lock(&self.inner.shards[shard].waiters).insert(ticket, tx);
                    Submitted::Waits(rx)
                }
            }
        });
        match submitted {
            Submitted::Reply(reply) => Answer::Ready(reply),
            Submitted::Plan(plan) => {
                // Made now: a future dropped before its first poll (its
                // client gone) still ends the plan's lease.
                let lease = self.lease_of(shard, &plan);
                let exchange = self.clone();
                Answer::Later(Box::pin(
                    async move { exchange.carry_out(lease, plan).await },
                ))
            }
            Submitted::Waits(rx) => {
                let guard = CancelOnDrop {
                    exchange: self.clone(),
                    shard,
                    ticket: Some(ticket),
                    outcome: Some(rx),
                };
                let exchange = self.clone();
                Answer::Later(Box::pin(async move {
                    let mut guard = guard;
                    let outcome = match guard.outcome.as_mut() {
                        Some(rx) => rx.await.ok(),
                        None => None,
                    };
                    guard.outcome = None;
                    guard.ticket = None;
                    match outcome {
                        Some(Outcome::Reply(reply)) => reply,
                        Some(Outcome::Plan(plan)) => {
                            let lease = exchange.lease_of(shard, &plan);
                            exchange.carry_out(lease, plan).await
                        }
                        None => Reply::new(BinReply {
                            status: Status::ServerError as i32,
                            error: "the exchange stopped before answering".into(),
                            ..Default::default()
                        }),
                    }
                }))
            }
        }
    }

    /// Submits a request and waits for its reply (the HTTP exchange).
    pub async fn handle(&self, request: Request, body: Payload) -> Reply {
        let conn = self.new_connection();
        match self.submit(conn, request, body) {
            Answer::Ready(reply) => reply,
            Answer::Later(future) => future.await,
        }
    }

    /// A wire request from a local client, checked at the door and answered
    /// (for in-process users: benches and tests).
    pub async fn handle_wire(&self, raw: &binx_proto::BinRequest, body: bytes::Bytes) -> Reply {
        match Request::parse(raw, binx_core::Door::Local) {
            Ok(request) => self.handle(request, Payload::exact(body)).await,
            Err(header) => Reply::new(*header),
        }
    }

    /// Like [`Exchange::handle_wire`] when the answer is ready at once;
    /// `None` (and the request cancelled) when it would have to wait.
    pub fn try_handle_wire(
        &self,
        raw: &binx_proto::BinRequest,
        body: bytes::Bytes,
    ) -> Option<Reply> {
        let request = match Request::parse(raw, binx_core::Door::Local) {
            Ok(request) => request,
            Err(header) => return Some(Reply::new(*header)),
        };
        match self.submit(self.new_connection(), request, Payload::exact(body)) {
            Answer::Ready(reply) => Some(reply),
            Answer::Later(_) => None,
        }
    }

    /// A forwarded DATA asks the remote for at most the forward budget and
    /// reserves what it asks for, until its reply is written. When the
    /// budget is taken (by replies being written, or by long-polls waiting
    /// at remotes) it is not made to wait: it asks for at most
    /// `FORWARDED_UNRESERVED_SIZE` instead, so a long-poll never blocks
    /// another and each reply stays small. Returns the reservation, and
    /// whether the size the client asked for was made smaller: then the
    /// reply's `following_sizes` are dropped (section 10 of the contract
    /// promises replies that end where the listed sizes say for the
    /// client's size, which a smaller one would not keep).
    fn reserve_forwarded(&self, request: &mut binx_proto::BinRequest) -> ForwardedSize {
        if request.r#type != binx_proto::MessageType::Data as i32 || request.get_data_size {
            return ForwardedSize::default();
        }
        let budget = &self.inner.forward_budget;
        let asked = match request.max_size_bytes {
            0 => FORWARDED_DEFAULT_SIZE,
            n => n,
        };
        let want = asked.min(budget.capacity());
        let reservation = budget.try_reserve(want);
        request.max_size_bytes = match reservation {
            Some(_) => want,
            None => want.min(FORWARDED_UNRESERVED_SIZE),
        };
        let smaller = request.max_size_bytes < asked;
        ForwardedSize {
            reservation,
            smaller,
        }
    }

    /// What ends `plan`'s lease if it is never carried out to the end.
    fn lease_of(&self, shard: usize, plan: &DataPlan) -> LeaseOnDrop {
        LeaseOnDrop {
            exchange: self.clone(),
            shard,
            lease: plan.lease,
            started: false,
            done: false,
        }
    }

    /// Reads (or presigns) what a DATA plan names, and assembles the reply;
    /// `lease` ends the plan's lease however this ends.
    async fn carry_out(&self, mut lease: LeaseOnDrop, plan: DataPlan) -> Reply {
        lease.started = true;
        if let (Some(next), Some(spool)) = (plan.read_ahead.clone(), self.inner.spool.clone()) {
            tokio::spawn(async move { spool.read_ahead(&next).await });
        }
        let objects: Vec<(Arc<binx_core::ObjectMeta>, bool)> = plan
            .objects()
            .map(|(meta, presign)| (meta.clone(), presign))
            .collect();
        let (resolved, reservation) = match &self.inner.spool {
            Some(spool) => read_objects(spool, objects).await,
            None => (
                objects
                    .iter()
                    .map(|_| Resolved::Failed {
                        error: "no spool store is configured".into(),
                        retry: false,
                    })
                    .collect(),
                None,
            ),
        };
        let mut reply = plan.assemble(resolved);
        if let Some(reservation) = reservation {
            reservation.hold_with(&mut reply.body);
        }
        lease.done = true;
        let status = reply.header.status_kind();
        let (id, shard) = (lease.lease, lease.shard);
        self.with_shard(shard, |core| core.plan_finished(id, status, Instant::now()));
        reply
    }

    /// Carries out the core's events: answers to waiting requests go to
    /// them; commands run in tasks of their own and report back.
    fn dispatch(&self, shard: usize, events: Vec<Event>) {
        let mut markers = Vec::new();
        let mut gone_markers = Vec::new();
        let mut segments = Vec::new();
        for event in events {
            match event {
                Event::Outcome { ticket, outcome } => {
                    let waiter = lock(&self.inner.shards[shard].waiters).remove(&ticket);
                    match (waiter, outcome) {
                        (Some(tx), outcome) => {
                            if let Err(Outcome::Plan(plan)) = tx.send(outcome) {
                                self.abandon_plan(shard, plan);
                            }
                        }
                        (None, Outcome::Plan(plan)) => self.abandon_plan(shard, plan),
                        (None, Outcome::Reply(_)) => {}
                    }
                }
                Event::Command {
                    op,
                    command: Command::WriteMarker(plan),
                } => markers.push((op, plan)),
                Event::Command {
                    op,
                    command: Command::DeleteMarker { task, buffer },
                } => gone_markers.push((op, (task, buffer))),
                Event::Command {
                    op,
                    command:
                        Command::WriteSegment {
                            task,
                            first_token,
                            pages,
                            durability,
                            committing,
                        },
                } if self.inner.spool.as_ref().is_some_and(|s| {
                    s.writes_together(task.as_str(), pages.iter().map(|p| p.len() as u64).sum())
                }) =>
                {
                    segments.push((
                        op,
                        SegmentWrite {
                            task: task.as_str().to_string(),
                            first_token,
                            pages,
                            durability,
                            pack: committing,
                        },
                    ))
                }
                Event::Command { op, command } => self.run(shard, op, command),
            }
        }
        // A task's markers together; each task apart, so that a slow store
        // request of one holds no other's reply back.
        for markers in by_task(markers, |(_, plan)| &plan.task) {
            self.write_markers(shard, markers);
        }
        for markers in by_task(gone_markers, |(_, (task, _))| task) {
            self.delete_markers(shard, markers);
        }
        for segments in by_task(segments, |(_, segment)| &segment.task) {
            self.write_segments(shard, segments);
        }
    }

    /// The small segments one step of a shard asks a `file://` store for
    /// (a task-wide NO_MORE_PAGES under spool policy `commit` asks for one
    /// a buffer): written together ([`Spool::write_segments`], a few jobs
    /// on the blocking pool for many small files instead of a hand-off
    /// between threads each), their outcomes given to the shard in one
    /// visit. Each task apart, as for markers; only small ones
    /// ([`Spool::writes_together`]), so that no large write holds back
    /// the report of the others (an overflow spill frees memory when
    /// reported).
    fn write_segments(&self, shard: usize, segments: Vec<(binx_core::OpId, SegmentWrite)>) {
        let exchange = self.clone();
        let spool = self.inner.spool.clone();
        tokio::spawn(async move {
            let (ops, writes): (Vec<_>, Vec<_>) = segments.into_iter().unzip();
            let named: Vec<(String, u64)> = writes
                .iter()
                .map(|w| (w.task.clone(), w.first_token))
                .collect();
            let outcomes = on_spool(&spool, |s| async move {
                Ok::<_, binx_spool::SpoolError>(s.write_segments(writes).await)
            })
            .await;
            let results = each_reported(outcomes, ops.len(), "a segment's write was not reported");
            for ((task, token), result) in named.iter().zip(&results) {
                if let Err(e) = result {
                    tracing::warn!(task = %task, token = *token, error = %e.reason, "writing a segment to storage failed");
                }
            }
            exchange.with_shard(shard, |core| {
                let now = Instant::now();
                for (op, result) in ops.into_iter().zip(results) {
                    core.segment_written(op, result, now);
                }
            });
        });
    }

    /// The commit markers one step of a shard asked for (a task-wide
    /// NO_MORE_PAGES asks for every buffer's at once): written together
    /// ([`Spool::write_markers`]), their outcomes given to the shard in one
    /// visit.
    fn write_markers(&self, shard: usize, markers: Vec<(binx_core::OpId, binx_core::MarkerPlan)>) {
        self.on_markers(
            shard,
            markers,
            |spool, plans| Box::pin(spool.write_markers(plans)),
            Core::marker_written,
        );
    }

    /// The commit markers one step of a shard deletes (a task that ends
    /// deletes all of its own): deleted together
    /// ([`Spool::delete_markers`]), reported as [`Exchange::write_markers`].
    fn delete_markers(
        &self,
        shard: usize,
        markers: Vec<(binx_core::OpId, (binx_core::TaskId, u64))>,
    ) {
        self.on_markers(
            shard,
            markers,
            |spool, gone| {
                Box::pin(async move {
                    let gone: Vec<(&str, u64)> =
                        gone.iter().map(|(t, b)| (t.as_str(), *b)).collect();
                    spool.delete_markers(&gone).await
                })
            },
            Core::marker_deleted,
        );
    }

    /// Runs one operation on many markers in a task of its own, then gives
    /// each op its outcome in one visit to the shard: every op is
    /// answered, whatever happens (no spool, a panic, an outcome missing).
    fn on_markers<T: Send + Sync + 'static>(
        &self,
        shard: usize,
        items: Vec<(binx_core::OpId, T)>,
        operation: MarkersOperation<T>,
        report: fn(&mut Core, binx_core::OpId, Result<(), StoreFailure>, Instant),
    ) {
        let exchange = self.clone();
        let spool = self.inner.spool.clone();
        tokio::spawn(async move {
            let (ops, items): (Vec<_>, Vec<_>) = items.into_iter().unzip();
            let outcomes = on_spool(&spool, |s| async move {
                Ok::<_, binx_spool::SpoolError>(operation(s, &items).await)
            })
            .await;
            let results = each_reported(
                outcomes,
                ops.len(),
                "an operation on a commit marker was not reported",
            );
            exchange.with_shard(shard, |core| {
                let now = Instant::now();
                for (op, result) in ops.into_iter().zip(results) {
                    report(core, op, result, now);
                }
            });
        });
    }

    /// A plan nobody will carry out: its objects may go.
    fn abandon_plan(&self, shard: usize, plan: DataPlan) {
        let lease = plan.lease;
        self.with_shard(shard, |core| {
            core.plan_finished(lease, Status::Ok, Instant::now())
        });
    }

    fn run(&self, shard: usize, op: binx_core::OpId, command: Command) {
        let exchange = self.clone();
        let spool = self.inner.spool.clone();
        match command {
            Command::DeleteObject(meta) => {
                let queued = lock(&self.inner.deletes)
                    .as_ref()
                    .map(|tx| tx.try_send((shard, op, meta.clone())));
                if !matches!(queued, Some(Ok(()))) {
                    // No deleter running (or full): delete here.
                    tokio::spawn(async move {
                        let result = on_spool(&spool, |s| s.delete(&meta)).await;
                        exchange.with_shard(shard, |core| {
                            core.object_deleted(op, result, Instant::now())
                        });
                    });
                }
            }
            Command::WriteSegment {
                task,
                first_token,
                pages,
                durability,
                ..
            } => {
                tokio::spawn(async move {
                    let result = on_spool(&spool, |s| {
                        s.write(task.as_str(), first_token, pages, durability)
                    })
                    .await;
                    if let Err(e) = &result {
                        tracing::warn!(task = %task, token = first_token, error = %e, "writing a segment to storage failed");
                    }
                    exchange.with_shard(shard, |core| {
                        core.segment_written(op, result, Instant::now())
                    });
                });
            }
            Command::WriteMarker(plan) => self.write_markers(shard, vec![(op, plan)]),
            Command::DeleteMarker { task, buffer } => {
                self.delete_markers(shard, vec![(op, (task, buffer))])
            }
            Command::ReadMarker { task, buffer } => {
                tokio::spawn(async move {
                    let result = on_spool(&spool, |s| s.read_marker(task.as_str(), buffer)).await;
                    exchange.with_shard(shard, |core| core.marker_read(op, result, Instant::now()));
                });
            }
            Command::WriteManifest(plan) => {
                tokio::spawn(async move {
                    let result = on_spool(&spool, |s| s.write_manifest(&plan)).await;
                    exchange.with_shard(shard, |core| {
                        core.manifest_written(op, result, Instant::now())
                    });
                });
            }
            Command::ReadManifest { task } => {
                let max_buffers = self.inner.max_buffers_per_task;
                tokio::spawn(async move {
                    let result = on_spool(&spool, |s| s.read_manifest(task.as_str(), max_buffers))
                        .await
                        .map_err(|e| {
                            if e.transient {
                                binx_core::ManifestError::Unavailable(e.reason)
                            } else {
                                binx_core::ManifestError::Invalid(e.reason)
                            }
                        });
                    exchange
                        .with_shard(shard, |core| core.manifest_read(op, result, Instant::now()));
                });
            }
            Command::DeleteManifest { task, folded } => {
                tokio::spawn(async move {
                    let result =
                        on_spool(&spool, |s| s.delete_manifest(task.as_str(), folded)).await;
                    exchange.with_shard(shard, |core| {
                        core.manifest_deleted(op, result, Instant::now())
                    });
                });
            }
            Command::ReleaseCommitted(marker) => {
                tokio::spawn(async move {
                    if let Some(spool) = &spool {
                        // Nothing to report but that it ended, panic or not.
                        let _ = caught(
                            spool.release_committed(&marker).map(Ok::<(), String>),
                            |m| m,
                        )
                        .await;
                    }
                    exchange.with_shard(shard, |core| core.released(op, Instant::now()));
                });
            }
            Command::Forward {
                remote,
                request,
                instance,
            } => {
                let forwarder = lock(&self.inner.forwarder).clone();
                tokio::spawn(async move {
                    let mut request = *request;
                    let size = exchange.reserve_forwarded(&mut request);
                    let result = match forwarder {
                        Some(f) => {
                            let remote = remote.clone();
                            caught(
                                async move { f.forward(remote, request, instance).await },
                                |m| m,
                            )
                            .await
                        }
                        None => Err("this binxd does not forward".to_string()),
                    };
                    exchange.with_shard(shard, |core| {
                        let now = Instant::now();
                        let forwarded = match result {
                            Ok(forwarded) => forwarded,
                            Err(reason) => return core.forwarded(op, Err(reason), now),
                        };
                        if let Some(node) = forwarded.node {
                            core.remote_identified(&remote, node);
                        }
                        if let Some(instance) = &forwarded.instance {
                            core.remote_instance(&remote, instance.clone(), now);
                        }
                        match (forwarded.frame, forwarded.instance) {
                            (Some(mut frame), instance) => {
                                size.apply(&mut frame);
                                core.forwarded_from(op, Ok(frame), instance, now);
                            }
                            (None, Some(instance)) => core.forward_withheld(op, instance, now),
                            (None, None) => core.forwarded(
                                op,
                                Err("the forwarder returned neither a reply nor a process".into()),
                                now,
                            ),
                        }
                    });
                });
            }
        }
    }

    /// Starts the driver's tasks: the timer that applies the core's
    /// deadlines (long-poll ends, abandoned buffers, aged pages to spill)
    /// and the object deleters. Runs until the returned task is aborted.
    pub fn spawn_driver(&self) -> tokio::task::JoinHandle<()> {
        if let Some(spool) = self.inner.spool.clone() {
            let capacity = spool.config().max_pending_deletes.max(1);
            let (tx, rx) = tokio::sync::mpsc::channel(capacity);
            *lock(&self.inner.deletes) = Some(tx);
            let exchange = self.clone();
            tokio::spawn(async move {
                use futures_util::StreamExt;
                let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
                stream
                    .for_each_concurrent(DELETE_WORKERS, |(shard, op, meta)| {
                        let (spool, exchange) = (spool.clone(), exchange.clone());
                        async move {
                            let result = on_spool(&Some(spool), |s| s.delete(&meta)).await;
                            exchange.with_shard(shard, |core| {
                                core.object_deleted(op, result, Instant::now())
                            });
                        }
                    })
                    .await;
            });
        }
        let timers: Vec<tokio::task::JoinHandle<()>> = (0..self.inner.shards.len())
            .map(|shard| tokio::spawn(self.clone().shard_timer(shard)))
            .collect();
        // One handle: aborting it stops every shard's timer.
        tokio::spawn(async move {
            let _stop = AbortAll(timers);
            std::future::pending::<()>().await
        })
    }

    /// Applies shard `shard`'s deadlines. The guard tick also lets a
    /// shard's requests waiting for room look at the budget again, in case
    /// a wake-up from another shard was missed.
    async fn shard_timer(self, shard: usize) {
        loop {
            let next = self.core(shard).poll_timeout();
            *lock(&self.inner.shards[shard].armed) = next;
            let guard = Instant::now() + TIMER_GUARD;
            let at = next.map_or(guard, |at| at.min(guard));
            let sleep = tokio::time::sleep_until(tokio::time::Instant::from_std(at));
            tokio::select! {
                _ = sleep => {
                    let waits = self.inner.budget.someone_waits();
                    self.with_shard(shard, |core| {
                        let now = Instant::now();
                        core.handle_timeout(now);
                        if waits {
                            core.room_elsewhere(now);
                        }
                    });
                }
                _ = self.inner.shards[shard].timer.notified() => {}
            }
        }
    }

    /// This process's instance id: HELLO's `instance=` and the HTTP
    /// exchange's `X-*-Task-Instance-Id`, new at every start.
    pub fn instance(&self) -> &str {
        &self.inner.instance
    }

    /// The address other sidecars reach this one under: HELLO names it
    /// (`address=`), and commit markers and manifests do.
    pub fn set_advertised(&self, address: String) {
        if let Some(spool) = &self.inner.spool {
            spool.set_endpoint(address.clone());
        }
        *lock(&self.inner.advertised) = address;
    }

    /// What HELLO advertises: `pipelined-data` (DATA with `ack_token`,
    /// docs/PROTOCOL.md section 8), `append-token` (numbered ENQUEUE and
    /// NO_MORE_PAGES, section 9), `instance=<id>` (new at every start,
    /// section 9), `max-pages-per-buffer=<n>` (a producer whose consumers
    /// read only after it finished can fail at once past it, instead of
    /// waiting for room that cannot come), `max-enqueue-bytes=<n>` (a
    /// client that batches pages keeps each ENQUEUE's bytes, with 128 a
    /// page, at most this: a larger one may be refused as one that can
    /// never fit the memory limit, though each of its pages would),
    /// `max-pages-per-enqueue=<n>` (more pages in one ENQUEUE are refused),
    /// `address=<host:port>` when known, and
    /// with a spool `committed` (section 10), `spool`, `proxy`,
    /// the codec it writes besides none, and `node=<spool node name>` (a
    /// proxy consumer serves a commit marker only for the node that wrote
    /// it).
    pub fn capabilities(&self) -> Vec<String> {
        let mut out = vec![
            binx_proto::PIPELINED_DATA.to_string(),
            binx_proto::APPEND_TOKEN.to_string(),
            binx_proto::TASK_DELETE.to_string(),
            format!("instance={}", self.inner.instance),
            format!("max-pages-per-buffer={}", self.inner.max_pages_per_buffer),
            format!(
                "{}{}",
                binx_proto::MAX_ENQUEUE_BYTES,
                self.inner.max_enqueue_bytes
            ),
            format!(
                "{}{}",
                binx_proto::MAX_PAGES_PER_ENQUEUE,
                self.inner.max_pages_per_enqueue
            ),
        ];
        let advertised = lock(&self.inner.advertised).clone();
        if !advertised.is_empty() {
            out.push(format!("address={advertised}"));
        }
        let Some(spool) = &self.inner.spool else {
            return out;
        };
        out.extend([
            "spool".to_string(),
            "proxy".to_string(),
            binx_proto::COMMITTED.to_string(),
        ]);
        let codec = spool.config().codec.name();
        if codec != "none" {
            out.push(codec.to_string());
        }
        out.push(format!("node={}", spool.config().node_name));
        out
    }

    /// Object deletions under way (the driver lets them finish on stop).
    pub fn deletes_in_flight(&self) -> u64 {
        (0..self.shards())
            .map(|s| self.core(s).deletes_in_flight())
            .sum()
    }

    /// The spool, when storage is configured.
    pub fn spool(&self) -> Option<&Arc<Spool>> {
        self.inner.spool.as_ref()
    }

    /// Starts draining: new tasks are refused, existing ones are served,
    /// and (with a store) the pages of finished `overflow` buffers held
    /// only in memory are spooled and committed in the background.
    pub fn start_drain(&self) {
        self.each_shard(|core| {
            core.start_drain(Instant::now());
        });
    }

    /// Whether a drain started.
    pub fn is_draining(&self) -> bool {
        self.core(0).is_draining()
    }

    /// Pages held: what stopping now would lose.
    pub fn pages_held(&self) -> u64 {
        (0..self.shards()).map(|s| self.core(s).pages_held()).sum()
    }

    /// Sizes of the pages of a buffer held from `token` on; changes nothing.
    pub fn peek_sizes(&self, task_id: &str, buffer_id: u64, token: u64) -> Vec<u64> {
        self.core(self.shard_of(task_id))
            .peek_sizes(task_id, buffer_id, token)
    }

    /// The token below which a buffer was acknowledged
    /// (`Core::acknowledged_mark`).
    pub fn acknowledged_mark(&self, task_id: &str, buffer_id: u64) -> Option<u64> {
        self.core(self.shard_of(task_id))
            .acknowledged_mark(task_id, buffer_id)
    }

    /// A request's wait for pages, capped at `max_wait`, as the core caps
    /// a DATA's (`task_id` picks the shard whose settings say it).
    pub fn capped_wait(&self, task_id: &str, wait: Duration) -> Duration {
        wait.min(self.core(self.shard_of(task_id)).config().max_wait)
    }

    /// Whether `task_id` ended aborted or abandoned (`Core::task_failed`).
    pub fn task_failed(&self, task_id: &str) -> bool {
        self.core(self.shard_of(task_id)).task_failed(task_id)
    }

    /// Open tasks whose id starts with `prefix`, with their buffers, by
    /// id: as many as `room` allows (a task and each of its buffers take
    /// one), and whether more matched. The shards are asked in turn, so
    /// what is listed is bounded however many tasks there are.
    pub fn task_snapshots(&self, prefix: &str, mut room: usize) -> (Vec<TaskSnapshot>, bool) {
        let mut all = Vec::new();
        let mut more = false;
        for shard in 0..self.shards() {
            let (tasks, left) =
                self.core(shard)
                    .task_snapshots_within(prefix, Instant::now(), &mut room);
            all.extend(tasks);
            if left {
                more = true;
                break;
            }
        }
        all.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        (all, more)
    }

    /// Aborts an open task for an operator; returns the bytes freed, or
    /// `None` when no such task is open (so a typo aborts nothing).
    pub fn abort_open_task(&self, task_id: &str, reason: &str) -> Option<u64> {
        self.with_shard(self.shard_of(task_id), |core| {
            core.abort_open_task(task_id, reason, Instant::now())
        })
    }

    pub(crate) fn count(&self, event: ConnectionEvent) {
        let c = &self.inner.counters;
        match event {
            ConnectionEvent::Opened => {
                c.connections_open.fetch_add(1, Ordering::Relaxed);
                c.connections_total.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::Closed => {
                c.connections_open.fetch_sub(1, Ordering::Relaxed);
            }
            ConnectionEvent::ShmAttached => {
                c.shm_connections_open.fetch_add(1, Ordering::Relaxed);
                c.shm_attached.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::ShmDetached => {
                c.shm_connections_open.fetch_sub(1, Ordering::Relaxed);
            }
            ConnectionEvent::TlsKernel => {
                c.tls_kernel.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::TlsRustls => {
                c.tls_rustls.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::Refused => {
                c.connections_refused.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::TimedOut => {
                c.connections_timed_out.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::ProtocolError => {
                c.protocol_errors.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::Received(bytes) => {
                c.bytes_received.fetch_add(bytes, Ordering::Relaxed);
            }
            ConnectionEvent::Sent(bytes) => {
                c.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
            }
        }
    }

    /// Whether held pages and waiting request bodies reach the memory limit.
    pub(crate) fn memory_full(&self) -> bool {
        self.inner.budget.full()
    }

    /// Takes one of `max` shared memory slots; false when all are taken.
    pub(crate) fn try_reserve_shm(&self, max: usize) -> bool {
        let reserved = &self.inner.counters.shm_reserved;
        if reserved.fetch_add(1, Ordering::AcqRel) >= max as u64 {
            reserved.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Gives a shared memory slot back.
    pub(crate) fn release_shm(&self) {
        self.inner
            .counters
            .shm_reserved
            .fetch_sub(1, Ordering::AcqRel);
    }

    /// Counts an HTTP exchange request refused for its bearer token.
    pub fn count_http_unauthenticated(&self) {
        self.inner
            .counters
            .http_unauthenticated
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an HTTP exchange GET that could not wait (too many waiting).
    pub fn count_http_long_poll_refused(&self) {
        self.inner
            .counters
            .http_long_polls_refused
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a time the HTTP listener stopped accepting at its limit.
    pub fn count_http_connections_waited(&self) {
        self.inner
            .counters
            .http_connections_waited
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a reply made outside the core (HELLO, refusals at the door).
    pub(crate) fn record_reply(&self, reply: &BinReply) {
        self.core(0).record_reply(reply.r#type, reply.status);
    }

    /// The latency and reply-size histograms the listeners feed.
    pub fn histograms(&self) -> &Histograms {
        &self.inner.histograms
    }

    /// A snapshot of every counter and gauge.
    pub fn stats(&self) -> ExchangeStats {
        let mut manager = CoreStats::default();
        for shard in 0..self.shards() {
            manager.add(&self.core(shard).stats());
        }
        let c = &self.inner.counters;
        let protocol_errors = c.protocol_errors.load(Ordering::Relaxed);
        let error_replies: u64 = manager
            .requests
            .iter()
            .filter(|c| {
                matches!(
                    c.status,
                    Some(Status::BadRequest | Status::ServerError | Status::Unauthenticated)
                )
            })
            .map(|c| c.count)
            .sum();
        ExchangeStats {
            manager,
            shards: self.shards() as u64,
            runtime_threads: tokio::runtime::Handle::try_current()
                .map_or(0, |runtime| runtime.metrics().num_workers() as u64),
            connections_open: c.connections_open.load(Ordering::Relaxed),
            connections_total: c.connections_total.load(Ordering::Relaxed),
            connections_refused: c.connections_refused.load(Ordering::Relaxed),
            connections_timed_out: c.connections_timed_out.load(Ordering::Relaxed),
            http_unauthenticated: c.http_unauthenticated.load(Ordering::Relaxed),
            http_long_polls_refused: c.http_long_polls_refused.load(Ordering::Relaxed),
            http_connections_waited: c.http_connections_waited.load(Ordering::Relaxed),
            shm_connections_open: c.shm_connections_open.load(Ordering::Relaxed),
            receive_buffers_spare_bytes: self.inner.receive_budget.spares_held(),
            receive_frames_bytes: self.inner.receive_budget.frames_held(),
            shm_attached_total: c.shm_attached.load(Ordering::Relaxed),
            tls_kernel_total: c.tls_kernel.load(Ordering::Relaxed),
            tls_rustls_total: c.tls_rustls.load(Ordering::Relaxed),
            protocol_errors,
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            errors: error_replies + protocol_errors,
            spool: self.inner.spool.as_ref().map(|s| s.stats()),
        }
    }
}

/// Spill writes in flight over all shards: `setting`, or when it is
/// [`binx_core::config::AUTO_SPILL_CONCURRENCY`], [`SPILL_WRITES_PER_SHARD`]
/// a shard, at most [`MAX_AUTO_SPILL_WRITES`] in all (at least one a
/// shard). What they hold is bounded apart, in bytes
/// ([`SPILL_BYTES_IN_SEGMENTS`]).
fn spill_writes(setting: usize, shards: usize) -> usize {
    match setting {
        binx_core::config::AUTO_SPILL_CONCURRENCY => {
            (SPILL_WRITES_PER_SHARD * shards).min(MAX_AUTO_SPILL_WRITES)
        }
        n => n,
    }
}

/// Spill writes a shard by default: a task's commit writes every buffer's
/// last pages at once, and a shard holds each task whole, so a commit of
/// N buffers waits for N / this rounds of writes (`commit_finish` in
/// benches/spool.rs: with 4 a shard a task of 8 buffers commits in two
/// thirds of the time 1 takes; `commit_finish_s3`: a task of 50 buffers on
/// S3 waited 13 rounds of PUTs with 4 a shard, 4 with 16). A `file://`
/// store writes a commit's small segments in jobs of up to 32 files, so
/// this does not add threads there; what the writes hold is bounded in
/// bytes apart ([`SPILL_BYTES_IN_SEGMENTS`]).
pub const SPILL_WRITES_PER_SHARD: usize = 16;

/// Spill writes in all by default at most: each takes a connection, or
/// blocking threads (two for a compressed or encrypted `file://` segment,
/// sealed while written), unless written together; 128 keep those to half
/// of tokio's blocking pool (512), so other blocking work (local reads,
/// markers) never queues behind a wide commit.
pub const MAX_AUTO_SPILL_WRITES: usize = 128;

/// The pages spill writes hold at once, in segments of the largest size
/// (`spool_segment_max`), over all shards: 32 MiB by default, what two
/// writes held before more than two could run. A shard with no write in
/// flight starts one whatever its size, so at most one segment a shard
/// when that is more.
pub const SPILL_BYTES_IN_SEGMENTS: u64 = 2;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while these are held; if something did, the state is
    // still consistent enough to keep serving.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Cancels a waiting request whose future was dropped (its client went).
struct CancelOnDrop {
    exchange: Exchange,
    shard: usize,
    ticket: Option<Ticket>,
    /// Where the outcome comes, until it came: a plan sent there but never
    /// received (the client went between) ends its lease here.
    outcome: Option<oneshot::Receiver<Outcome>>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let shard = self.shard;
        if let Some(ticket) = self.ticket.take() {
            lock(&self.exchange.inner.shards[shard].waiters).remove(&ticket);
            self.exchange
                .with_shard(shard, |core| core.cancel(ticket, Instant::now()));
        }
        if let Some(mut outcome) = self.outcome.take() {
            // Closed first: a send after this fails, and its sender
            // abandons the plan; one before it is taken here.
            outcome.close();
            if let Ok(Outcome::Plan(plan)) = outcome.try_recv() {
                self.exchange.abandon_plan(shard, plan);
            }
        }
    }
}

/// Ends a DATA plan's lease if its future is dropped before it finished.
struct LeaseOnDrop {
    exchange: Exchange,
    shard: usize,
    lease: Option<LeaseId>,
    /// Its plan began to be carried out.
    started: bool,
    done: bool,
}

impl Drop for LeaseOnDrop {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Never carried out (its client went first): as a plan nobody
        // takes (`Exchange::abandon_plan`), not a failed read of its objects.
        let status = if self.started {
            Status::ServerError
        } else {
            Status::Ok
        };
        let lease = self.lease;
        self.exchange.with_shard(self.shard, |core| {
            core.plan_finished(lease, status, Instant::now())
        });
    }
}

/// Aborts the shards' timers when the driver's task is aborted.
struct AbortAll(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortAll {
    fn drop(&mut self) {
        for timer in &self.0 {
            timer.abort();
        }
    }
}

/// The timer looks at the core at least this often (a guard against a lost
/// wake-up; the core's own deadlines are exact).
const TIMER_GUARD: Duration = Duration::from_secs(1);

/// What the forward budget made of a forwarded DATA's size.
#[derive(Default)]
struct ForwardedSize {
    /// Room it holds in the budget, until its reply is written.
    reservation: Option<binx_spool::Reservation>,
    /// It asks the remote for less than its client asked for.
    smaller: bool,
}

impl ForwardedSize {
    /// Fits the remote's reply to it: the reservation goes with the body,
    /// and a reply to a smaller DATA lists no `following_sizes` (they
    /// promise where replies end for the client's size).
    fn apply(self, frame: &mut binx_proto::Frame<binx_proto::BinReply>) {
        if self.smaller {
            frame.header.following_sizes.clear();
        }
        if let Some(reservation) = self.reservation {
            reservation.hold_with(std::slice::from_mut(&mut frame.body));
        }
    }
}

/// A forwarded DATA without `max_size_bytes` asks for this much (a remote
/// binxd's default reply size).
const FORWARDED_DEFAULT_SIZE: u64 = 1 << 20;

/// What a forwarded DATA asks for when the forward budget is taken (a
/// remote still sends at least one page).
const FORWARDED_UNRESERVED_SIZE: u64 = 64 << 10;

/// How long a DATA that reads storage waits for room in the read budget
/// before it is answered `BUSY`.
const READ_BUDGET_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Presigns what may be presigned, then reads the rest back within the
/// spool's read budget: the reservation is returned to be held by the
/// reply. Without room in time every object to read fails as retryable,
/// and the reply becomes `BUSY` (asking again at the same token is exact).
async fn read_objects(
    spool: &binx_spool::Spool,
    objects: Vec<(Arc<binx_core::ObjectMeta>, bool)>,
) -> (Vec<Resolved>, Option<binx_spool::Reservation>) {
    let mut resolved: Vec<Option<Resolved>> = Vec::with_capacity(objects.len());
    for (meta, may_presign) in &objects {
        let mut url = None;
        if *may_presign {
            match spool.presign(meta).await {
                Ok(Some(presigned)) => {
                    url = Some(Resolved::Url {
                        url: presigned.url,
                        expires_at_unix_ms: presigned.expires_at_unix_ms,
                    })
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "presigning failed; serving the object inline")
                }
            }
        }
        resolved.push(url);
    }
    let to_read: u64 = objects
        .iter()
        .zip(&resolved)
        .filter(|(_, r)| r.is_none())
        .map(|((meta, _), _)| meta.page_bytes())
        .sum();
    let reservation = spool.reserve_reading(to_read, READ_BUDGET_WAIT).await;
    let mut out = Vec::with_capacity(objects.len());
    for ((meta, _), done) in objects.iter().zip(resolved) {
        out.push(match (done, &reservation) {
            (Some(url), _) => url,
            (None, None) => Resolved::Failed {
                error: format!(
                    "replies hold all of the spool's read budget ({} bytes) for {READ_BUDGET_WAIT:?}",
                    spool.config().read_budget_bytes
                ),
                retry: true,
            },
            (None, Some(_)) => match spool.read(meta).await {
                Ok(pages) => Resolved::Pages(pages),
                Err(e @ binx_spool::SpoolError::Expired { .. }) => Resolved::Expired {
                    error: e.to_string(),
                },
                Err(e) => Resolved::Failed {
                    retry: e.is_transient(),
                    error: e.to_string(),
                },
            },
        });
    }
    (out, reservation)
}

impl binx_core::door::ExchangeFacts for Exchange {
    fn memory_full(&self) -> bool {
        Exchange::memory_full(self)
    }

    fn forwards(&self) -> bool {
        Exchange::forwards(self)
    }

    fn capabilities(&self) -> Vec<String> {
        Exchange::capabilities(self)
    }
}

/// `items` grouped by their task, each group in the order given (one step
/// that ends many tasks deletes all their markers at once).
fn by_task<T, K: std::hash::Hash + Eq + Clone>(
    items: Vec<T>,
    task: impl Fn(&T) -> &K,
) -> Vec<Vec<T>> {
    let mut index: HashMap<K, usize> = HashMap::new();
    let mut groups: Vec<Vec<T>> = Vec::new();
    for item in items {
        let at = *index.entry(task(&item).clone()).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[at].push(item);
    }
    groups
}

/// An operation on many commit markers at once: one outcome for each.
type MarkersOperation<T> = for<'a> fn(
    &'a Spool,
    &'a [T],
) -> Pin<
    Box<dyn Future<Output = Vec<Result<(), binx_spool::SpoolError>>> + Send + 'a>,
>;

/// One outcome for each of `n` operations done together: each one's own,
/// the failure of all when they could not be done (no spool, a panic), and
/// `missing` for any the spool did not report (none is).
fn each_reported<T: Clone>(
    outcomes: Result<Vec<Result<T, binx_spool::SpoolError>>, StoreFailure>,
    n: usize,
    missing: &'static str,
) -> Vec<Result<T, StoreFailure>> {
    let mut results: Vec<Result<T, StoreFailure>> = match outcomes {
        Ok(results) => results
            .into_iter()
            .map(|r| r.map_err(store_failure))
            .collect(),
        Err(failure) => vec![Err(failure); n],
    };
    results.resize_with(n, || Err(StoreFailure::permanent(missing)));
    results
}

/// A spool error as the core weighs it: whether asking again may work.
fn store_failure(e: binx_spool::SpoolError) -> StoreFailure {
    StoreFailure {
        transient: e.is_transient(),
        reason: e.to_string(),
    }
}

/// Runs `operation` on the spool and gives its outcome as the core weighs
/// it: no spool, a spool error, or a panic in it are failures.
async fn on_spool<'a, T, F>(
    spool: &'a Option<Arc<Spool>>,
    operation: impl FnOnce(&'a Spool) -> F,
) -> Result<T, StoreFailure>
where
    F: Future<Output = Result<T, binx_spool::SpoolError>> + 'a,
{
    let Some(spool) = spool else {
        return Err(StoreFailure::permanent("no spool store is configured"));
    };
    // The operation is made inside the future caught, so a panic before
    // its first await is caught too.
    caught(
        async move { operation(spool).await.map_err(store_failure) },
        StoreFailure::permanent,
    )
    .await
}

/// The outcome of an operation the core started, with a panic in it (a bug)
/// turned into the error `failed` makes of its message. The core must hear
/// how every operation it started ended: one it never hears of stays in
/// flight for good, so a drain waits for it, and a spill write keeps
/// counting against the shard's spill writes and bytes in flight. The
/// panic itself is printed by the panic hook, as any.
async fn caught<T, E>(
    operation: impl Future<Output = Result<T, E>>,
    failed: impl FnOnce(String) -> E,
) -> Result<T, E> {
    match std::panic::AssertUnwindSafe(operation).catch_unwind().await {
        Ok(outcome) => outcome,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|m| (*m).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            tracing::error!(panic = %message, "a storage or forwarding operation panicked; it is reported as failed");
            Err(failed(format!(
                "the operation panicked (a bug in binxd): {message}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use binx_core::config::AUTO_SPILL_CONCURRENCY;

    /// A panic in a storage operation comes back as a failure that says so,
    /// so the core hears the operation ended; an outcome without a panic
    /// passes as it is.
    #[tokio::test]
    async fn a_panicking_operation_is_reported_as_failed() {
        let failed = on_spool_panic(async { panic!("segment {} went wrong", 7) }).await;
        assert!(!failed.transient);
        assert!(
            failed.reason.contains("panicked") && failed.reason.contains("segment 7 went wrong"),
            "{failed:?}"
        );
        let failed = on_spool_panic(async { panic!("a fixed message") }).await;
        assert!(failed.reason.contains("a fixed message"), "{failed:?}");
        let passed: Result<u32, String> = caught(async { Ok(3) }, |m| m).await;
        assert_eq!(passed, Ok(3));
        let refused: Result<u32, String> = caught(async { Err("no".into()) }, |m| m).await;
        assert_eq!(refused, Err("no".to_string()));
    }

    async fn on_spool_panic(operation: impl Future<Output = ()>) -> StoreFailure {
        let outcome: Result<(), StoreFailure> = caught(
            async {
                operation.await;
                Ok(())
            },
            StoreFailure::permanent,
        )
        .await;
        outcome.expect_err("a panic is a failure")
    }

    /// A DATA read from storage leases the objects it reads; a reply
    /// whose future is dropped before it ever ran (its client gone at
    /// once) ends that lease, so the objects of a deleted buffer are
    /// deleted rather than held for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_data_read_from_storage_dropped_before_it_ran_leaves_no_object_held() {
        use binx_proto::{BinRequest, BufferKind, MessageType};
        use bytes::Bytes;
        let dir = std::env::temp_dir().join(format!("binx-unpolled-plan-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let spool = Spool::open(binx_spool::SpoolConfig {
            stores: vec![format!("file://{}", dir.display())],
            node_name: "unit".into(),
            ..binx_spool::SpoolConfig::default()
        })
        .expect("spool");
        let exchange = Exchange::with_spool(
            CoreConfig {
                memory_limit: 256 << 10,
                task_memory_limit: 256 << 10,
                default_spool_policy: binx_proto::SpoolPolicy::Overflow,
                ..CoreConfig::default()
            },
            Some(spool),
        );
        let request = |kind, buffer| {
            let mut r = BinRequest::new(kind);
            r.task_id = "t".into();
            r.buffer_id = buffer;
            r
        };
        let ok = |reply: Reply, what: &str| {
            assert_eq!(
                reply.header.status,
                Status::Ok as i32,
                "{what}: {:?}",
                reply.header
            );
        };
        let mut open = request(MessageType::OpenTask, 0);
        open.buffer_kind = BufferKind::Partitioned as i32;
        open.buffer_count = 1;
        ok(exchange.handle_wire(&open, Bytes::new()).await, "OPEN_TASK");
        // 2 MiB into 256 KiB of memory: the first pages go to storage.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut sent = 0;
        while sent < 32 {
            let mut enqueue = request(MessageType::Enqueue, 0);
            enqueue.page_sizes = vec![16 << 10; 4];
            let reply = exchange
                .handle_wire(&enqueue, Bytes::from(vec![7u8; 64 << 10]))
                .await;
            if reply.header.status == Status::Busy as i32 && Instant::now() < deadline {
                // Memory is full until a spill lands.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            ok(reply, "ENQUEUE");
            sent += 1;
        }
        let held = || exchange.stats().manager.objects_held;
        assert!(held() > 0, "pages were spilled");
        let mut data = request(MessageType::Data, 0);
        data.max_size_bytes = 1 << 20;
        let parsed = Request::parse(&data, binx_core::Door::Local).expect("a DATA");
        match exchange.submit(
            exchange.new_connection(),
            parsed,
            Payload::exact(Bytes::new()),
        ) {
            Answer::Later(reply) => drop(reply),
            Answer::Ready(reply) => panic!("read from storage, not at once: {:?}", reply.header),
        }
        ok(
            exchange
                .handle_wire(&request(MessageType::Delete, 0), Bytes::new())
                .await,
            "DELETE",
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while held() > 0 {
            assert!(
                Instant::now() < deadline,
                "{} objects of the deleted buffer still held",
                held()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A forwarded DATA asks for what the forward budget reserves, else
    /// 64 KiB; whenever it asks for less than its client did, the reply's
    /// `following_sizes` are dropped (they promise where replies end for
    /// the client's size).
    #[test]
    fn a_forwarded_data_made_smaller_gets_no_following_sizes_back() {
        let exchange = Exchange::new(CoreConfig {
            max_stored_reply_size: 2 << 20,
            ..CoreConfig::default()
        });
        let data = |size: u64| {
            let mut r = binx_proto::BinRequest::new(binx_proto::MessageType::Data);
            r.max_size_bytes = size;
            r
        };
        // The remote's reply: a page and the sizes of the next ones.
        let reply = || binx_proto::Frame {
            header: binx_proto::BinReply {
                following_sizes: vec![10, 20],
                ..Default::default()
            },
            body: bytes::Bytes::from_static(b"page"),
        };
        let listed = |size: ForwardedSize| {
            let mut frame = reply();
            size.apply(&mut frame);
            assert_eq!(&frame.body[..], b"page");
            frame.header.following_sizes
        };
        let mut first = data(1 << 20);
        let held = exchange.reserve_forwarded(&mut first);
        assert!(held.reservation.is_some() && !held.smaller);
        assert_eq!(first.max_size_bytes, 1 << 20);
        let mut default = data(0);
        let second = exchange.reserve_forwarded(&mut default);
        assert!(
            second.reservation.is_some() && !second.smaller,
            "the default size, reserved"
        );
        assert_eq!(default.max_size_bytes, FORWARDED_DEFAULT_SIZE);
        let mut third = data(1 << 20);
        let none = exchange.reserve_forwarded(&mut third);
        assert!(
            none.reservation.is_none() && none.smaller,
            "the budget is taken"
        );
        assert_eq!(third.max_size_bytes, FORWARDED_UNRESERVED_SIZE);
        assert!(
            listed(none).is_empty(),
            "a smaller DATA's reply lists nothing"
        );
        let mut tiny = data(1_000);
        let fits = exchange.reserve_forwarded(&mut tiny);
        assert!(!fits.smaller, "1,000 bytes asked, 1,000 sent");
        assert_eq!(tiny.max_size_bytes, 1_000);
        assert_eq!(listed(fits), [10, 20], "as asked: the list comes back");
        assert_eq!(listed(held), [10, 20]);
        drop(second);
        let mut wide = data(8 << 20);
        let capped = exchange.reserve_forwarded(&mut wide);
        assert!(
            capped.reservation.is_some() && capped.smaller,
            "more than the budget holds"
        );
        assert_eq!(wide.max_size_bytes, 2 << 20);
        let mut sizes = data(1 << 20);
        sizes.get_data_size = true;
        let untouched = exchange.reserve_forwarded(&mut sizes);
        assert!(untouched.reservation.is_none() && !untouched.smaller);
    }

    #[test]
    fn markers_are_grouped_by_task_in_their_order() {
        let t = |s: &str| binx_core::TaskId::parse(s).unwrap();
        let items = vec![
            (t("a"), 0),
            (t("b"), 0),
            (t("a"), 1),
            (t("c"), 0),
            (t("b"), 1),
        ];
        let groups = by_task(items, |(task, _)| task);
        let names: Vec<Vec<(String, i32)>> = groups
            .into_iter()
            .map(|g| {
                g.into_iter()
                    .map(|(t, b)| (t.as_str().to_string(), b))
                    .collect()
            })
            .collect();
        let n = |s: &str, b| (s.to_string(), b);
        assert_eq!(
            names,
            vec![
                vec![n("a", 0), n("a", 1)],
                vec![n("b", 0), n("b", 1)],
                vec![n("c", 0)]
            ]
        );
    }

    #[test]
    fn spill_writes_grow_with_the_shards_up_to_a_bound_unless_set() {
        assert_eq!(spill_writes(AUTO_SPILL_CONCURRENCY, 1), 16);
        assert_eq!(spill_writes(AUTO_SPILL_CONCURRENCY, 2), 32);
        assert_eq!(spill_writes(AUTO_SPILL_CONCURRENCY, 8), 128);
        assert_eq!(spill_writes(AUTO_SPILL_CONCURRENCY, 16), 128);
        assert_eq!(spill_writes(AUTO_SPILL_CONCURRENCY, 256), 128);
        assert_eq!(spill_writes(5, 16), 5);
        assert_eq!(spill_writes(1024, 1), 1024);
    }
}
