//! The async face of the buffer manager: applies requests, waits (long-poll,
//! room for ENQUEUE) without holding the lock, and keeps daemon-wide gauges.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use binx_proto::BinRequest;
use bytes::Bytes;
use serde::Serialize;
use tokio::time::Instant;

use crate::manager::{BufferManager, ManagerConfig, ManagerStats, Outcome, Reply, TaskSnapshot};

/// Shared handle to one daemon's buffers; cheap to clone.
#[derive(Clone, Debug)]
pub struct Exchange {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    manager: Mutex<BufferManager>,
    long_polls_waiting: AtomicU64,
    pub(crate) connections_open: AtomicU64,
    pub(crate) connections_total: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    pub(crate) protocol_errors: AtomicU64,
    bytes_received: AtomicU64,
    bytes_sent: AtomicU64,
    backpressure_waits: AtomicU64,
}

/// Everything `binx stats` shows: the manager's numbers plus the listeners'.
#[derive(Clone, Debug, Serialize)]
pub struct ExchangeStats {
    #[serde(flatten)]
    pub manager: ManagerStats,
    pub long_polls_waiting: u64,
    pub connections_open: u64,
    pub connections_total: u64,
    pub connections_refused: u64,
    pub protocol_errors: u64,
    /// Bytes of BinX frames received and sent, on every connection.
    pub bytes_received: u64,
    pub bytes_sent: u64,
    /// ENQUEUEs that had to wait for room (whether or not they then got BUSY).
    pub backpressure_waits: u64,
    /// Replies with BAD_REQUEST, SERVER_ERROR or UNAUTHENTICATED, plus
    /// connections closed for a protocol error.
    pub errors: u64,
}

/// Which connection counter to move.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ConnectionEvent {
    Opened,
    Closed,
    Refused,
    ProtocolError,
    Received(u64),
    Sent(u64),
}

impl Exchange {
    pub fn new(config: ManagerConfig) -> Self {
        Exchange {
            inner: Arc::new(Inner {
                manager: Mutex::new(BufferManager::new(config)),
                long_polls_waiting: AtomicU64::new(0),
                connections_open: AtomicU64::new(0),
                connections_total: AtomicU64::new(0),
                connections_refused: AtomicU64::new(0),
                protocol_errors: AtomicU64::new(0),
                bytes_received: AtomicU64::new(0),
                bytes_sent: AtomicU64::new(0),
                backpressure_waits: AtomicU64::new(0),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BufferManager> {
        // The manager never panics while locked; if it did, its state is
        // still consistent enough to keep serving.
        self.inner
            .manager
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The reply if the request needs no waiting, `None` if it must wait (then
    /// call [`Exchange::handle`]).
    pub fn try_handle(&self, request: &BinRequest, body: &Bytes) -> Option<Reply> {
        let mut manager = self.lock();
        let may_wait = !manager.wait_budget(request).is_zero();
        match manager.handle(request, body, Instant::now().into_std(), may_wait) {
            Outcome::Reply(reply) => Some(reply),
            Outcome::Wait(_) => None,
        }
    }

    /// Applies a request, waiting up to its (capped) max wait for pages or room.
    pub async fn handle(&self, request: BinRequest, body: Bytes) -> Reply {
        let budget = self.lock().wait_budget(&request);
        let deadline = Instant::now() + budget;
        let mut counted_wait = false;
        loop {
            let now = Instant::now();
            let notify;
            let mut notified;
            {
                let mut manager = self.lock();
                match manager.handle(&request, &body, now.into_std(), now < deadline) {
                    Outcome::Reply(reply) => return reply,
                    Outcome::Wait(n) => notify = n,
                }
                // Registered before the lock is released, so a wake-up that
                // comes right after cannot be missed.
                notified = Box::pin(notify.notified());
                notified.as_mut().enable();
            }
            if !counted_wait && request.r#type == binx_proto::MessageType::Enqueue as i32 {
                counted_wait = true;
                self.inner
                    .backpressure_waits
                    .fetch_add(1, Ordering::Relaxed);
            }
            self.inner
                .long_polls_waiting
                .fetch_add(1, Ordering::Relaxed);
            let _ = tokio::time::timeout_at(deadline, notified).await;
            self.inner
                .long_polls_waiting
                .fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Starts draining: new tasks are refused, existing ones are served.
    pub fn start_drain(&self) {
        self.lock().start_drain();
    }

    pub fn is_draining(&self) -> bool {
        self.lock().is_draining()
    }

    /// Pages held: what stopping now would lose.
    pub fn pages_held(&self) -> u64 {
        self.lock().pages_held()
    }

    /// Sizes of the pages of a buffer held from `token` on; changes nothing.
    pub fn peek_sizes(&self, task_id: &str, buffer_id: u64, token: u64) -> Vec<u64> {
        self.lock().peek_sizes(task_id, buffer_id, token)
    }

    /// Open tasks whose id starts with `prefix`, with their buffers.
    pub fn task_snapshots(&self, prefix: &str) -> Vec<TaskSnapshot> {
        self.lock()
            .task_snapshots(prefix, Instant::now().into_std())
    }

    /// Aborts an open task for an operator; returns the bytes freed, or
    /// `None` when no such task is open (so a typo aborts nothing).
    pub fn abort_open_task(&self, task_id: &str, reason: &str) -> Option<u64> {
        let mut manager = self.lock();
        if !manager.has_task(task_id) {
            return None;
        }
        Some(manager.abort(task_id, reason, Instant::now().into_std()))
    }

    /// Runs the abandoned-buffer sweep until the returned task is dropped or aborted.
    pub fn spawn_sweeper(&self) -> tokio::task::JoinHandle<()> {
        let exchange = self.clone();
        let abandon_after = self.lock().config().abandon_after;
        let period = (abandon_after / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                exchange.lock().sweep(Instant::now().into_std());
            }
        })
    }

    pub(crate) fn count(&self, event: ConnectionEvent) {
        let c = &self.inner;
        match event {
            ConnectionEvent::Opened => {
                c.connections_open.fetch_add(1, Ordering::Relaxed);
                c.connections_total.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::Closed => {
                c.connections_open.fetch_sub(1, Ordering::Relaxed);
            }
            ConnectionEvent::Refused => {
                c.connections_refused.fetch_add(1, Ordering::Relaxed);
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

    /// Counts a reply made outside the buffer manager (HELLO, refusals).
    pub(crate) fn record_reply(&self, request: &BinRequest, reply: &binx_proto::BinReply) {
        self.lock().record_reply(request, reply);
    }

    /// A snapshot of every counter and gauge.
    pub fn stats(&self) -> ExchangeStats {
        let manager = self.lock().stats();
        let c = &self.inner;
        let protocol_errors = c.protocol_errors.load(Ordering::Relaxed);
        let error_replies: u64 = manager
            .requests
            .iter()
            .filter(|(key, _)| {
                key.ends_with(" BAD_REQUEST")
                    || key.ends_with(" SERVER_ERROR")
                    || key.ends_with(" UNAUTHENTICATED")
            })
            .map(|(_, n)| n)
            .sum();
        ExchangeStats {
            manager,
            long_polls_waiting: c.long_polls_waiting.load(Ordering::Relaxed),
            connections_open: c.connections_open.load(Ordering::Relaxed),
            connections_total: c.connections_total.load(Ordering::Relaxed),
            connections_refused: c.connections_refused.load(Ordering::Relaxed),
            protocol_errors,
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            backpressure_waits: c.backpressure_waits.load(Ordering::Relaxed),
            errors: error_replies + protocol_errors,
        }
    }
}
