//! The async face of the buffer manager: applies requests, waits (long-poll,
//! room for ENQUEUE) without holding the lock, and keeps daemon-wide gauges.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use binx_proto::{BinReply, BinRequest, MessageType, Segment, Status, segment};
use binx_spool::{Durability, Spool, SpoolStats, SpooledObject};
use bytes::Bytes;
use serde::Serialize;
use tokio::time::Instant;

mod failover;

use crate::manager::{
    BufferManager, ManagerConfig, ManagerStats, MarkerPlan, Outcome, PageRef, PendingReply, Reply,
    SpillJob, TaskSnapshot,
};

/// Shared handle to one daemon's buffers; cheap to clone.
#[derive(Clone, Debug)]
pub struct Exchange {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    manager: Mutex<BufferManager>,
    spool: Option<Arc<Spool>>,
    /// Proxy consumer: remotes that fail to serve a buffer.
    remotes: failover::RemoteWatch,
    long_polls_waiting: AtomicU64,
    pub(crate) connections_open: AtomicU64,
    pub(crate) connections_total: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    shm_connections_open: AtomicU64,
    shm_attached: AtomicU64,
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
    /// Connections moving their frames through shared memory now, and
    /// since start.
    pub shm_connections_open: u64,
    pub shm_attached_total: u64,
    pub protocol_errors: u64,
    /// Bytes of BinX frames received and sent, on every connection.
    pub bytes_received: u64,
    pub bytes_sent: u64,
    /// ENQUEUEs that had to wait for room (whether or not they then got BUSY).
    pub backpressure_waits: u64,
    /// Replies with BAD_REQUEST, SERVER_ERROR or UNAUTHENTICATED, plus
    /// connections closed for a protocol error.
    pub errors: u64,
    /// Spooling counters; absent when no store is configured.
    pub spool: Option<SpoolStats>,
}

/// What a request needs beyond one pass over the buffer manager.
#[derive(Debug)]
pub enum Deferred {
    /// It waits for pages or room.
    Wait,
    /// Its reply needs pages read from storage (or URLs presigned).
    Fetch(Box<PendingReply>),
    /// An ENQUEUE under policy `always`: written to storage first.
    Durable(Arc<tokio::sync::Mutex<()>>),
    /// A NO_MORE_PAGES under policy `always`: commit markers to write.
    Commit(Vec<MarkerPlan>),
}

/// Which connection counter to move.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ConnectionEvent {
    Opened,
    Closed,
    /// A Unix socket connection switched to shared memory, or ended after.
    ShmAttached,
    ShmDetached,
    Refused,
    ProtocolError,
    Received(u64),
    Sent(u64),
}

impl Exchange {
    /// An exchange that holds pages in memory only (spool policy `off`).
    pub fn new(config: ManagerConfig) -> Self {
        Exchange::with_spool(config, None)
    }

    /// An exchange that may spool to `spool` (policies `overflow`, `always`).
    pub fn with_spool(mut config: ManagerConfig, spool: Option<Arc<Spool>>) -> Self {
        config.spool_enabled = spool.is_some();
        if let Some(spool) = &spool {
            config.spill_target_bytes = spool.config().segment_target_bytes;
            config.spill_max_bytes = spool.config().segment_max_bytes;
            config.always_refusal = spool.always_refusal();
            config.spooled_replies = spool.presigns().then(|| spool.config().codec.name());
        }
        Exchange {
            inner: Arc::new(Inner {
                manager: Mutex::new(BufferManager::new(config)),
                spool,
                remotes: failover::RemoteWatch::default(),
                long_polls_waiting: AtomicU64::new(0),
                connections_open: AtomicU64::new(0),
                connections_total: AtomicU64::new(0),
                connections_refused: AtomicU64::new(0),
                shm_connections_open: AtomicU64::new(0),
                shm_attached: AtomicU64::new(0),
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

    /// The reply if one pass over the buffer manager gives it; otherwise
    /// what remains to do (then call [`Exchange::finish`]).
    pub fn try_handle(&self, request: &BinRequest, body: &Bytes) -> Result<Reply, Deferred> {
        let mut manager = self.lock();
        let may_wait = !manager.wait_budget(request).is_zero();
        let outcome = manager.handle(request, body, Instant::now().into_std(), may_wait);
        let released = manager.take_released_markers();
        drop(manager);
        self.delete_markers(released);
        match outcome {
            Outcome::Reply(reply) => Ok(reply),
            Outcome::Wait(_) => Err(Deferred::Wait),
            Outcome::Fetch(pending) => Err(Deferred::Fetch(Box::new(pending))),
            Outcome::Durable(gate) => Err(Deferred::Durable(gate)),
            Outcome::Commit(plans) => Err(Deferred::Commit(plans)),
        }
    }

    /// Deletes, in the background, the commit markers of buffers that went.
    fn delete_markers(&self, released: Vec<(String, u64)>) {
        if released.is_empty() {
            return;
        }
        let Some(spool) = self.inner.spool.clone() else {
            return;
        };
        tokio::spawn(async move {
            for (task_id, buffer_id) in released {
                spool.delete_marker(&task_id, buffer_id).await;
            }
        });
    }

    /// Applies a request, waiting up to its (capped) max wait for pages or
    /// room, reading spooled pages and writing durable ones as needed.
    pub async fn handle(&self, request: BinRequest, body: Bytes) -> Reply {
        match self.try_handle(&request, &body) {
            Ok(reply) => reply,
            Err(deferred) => self.finish(request, body, deferred).await,
        }
    }

    /// Finishes what [`Exchange::try_handle`] could not.
    pub async fn finish(&self, request: BinRequest, body: Bytes, deferred: Deferred) -> Reply {
        let reply = match deferred {
            Deferred::Wait => return self.wait_and_handle(request, body).await,
            Deferred::Fetch(pending) => self.resolve(&request, *pending).await,
            Deferred::Durable(gate) => self.durable_enqueue(&request, &body, gate).await,
            Deferred::Commit(plans) => self.commit(&request, plans).await,
        };
        self.lock().record_reply(&request, &reply.header);
        reply
    }

    async fn wait_and_handle(&self, request: BinRequest, body: Bytes) -> Reply {
        let budget = self.lock().wait_budget(&request);
        let deadline = Instant::now() + budget;
        let mut counted_wait = false;
        loop {
            let now = Instant::now();
            let waited = {
                let mut manager = self.lock();
                match manager.handle(&request, &body, now.into_std(), now < deadline) {
                    Outcome::Reply(reply) => return reply,
                    Outcome::Wait(notify) => {
                        // Registered before the lock is released, so a
                        // wake-up that comes right after cannot be missed.
                        let mut notified = Box::pin(notify.notified_owned());
                        notified.as_mut().enable();
                        Ok(notified)
                    }
                    Outcome::Fetch(pending) => Err(Deferred::Fetch(Box::new(pending))),
                    Outcome::Durable(gate) => Err(Deferred::Durable(gate)),
                    Outcome::Commit(plans) => Err(Deferred::Commit(plans)),
                }
            };
            let notified = match waited {
                Ok(notified) => notified,
                Err(deferred) => return Box::pin(self.finish(request, body, deferred)).await,
            };
            if !counted_wait && request.r#type == MessageType::Enqueue as i32 {
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

    /// Turns a DATA reply with pages in storage into one the client can
    /// read: whole objects as Spooled segments (presigned URLs) when the
    /// client takes them, the rest read here and sent inline.
    async fn resolve(&self, request: &BinRequest, pending: PendingReply) -> Reply {
        let Some(spool) = &self.inner.spool else {
            return server_error(
                request,
                "pages are in storage but no spool is configured".into(),
            );
        };
        let mut header = pending.header;
        let client_fetches = pending.accept_spooled
            && pending.objects_align
            && spool.client_decodes(&pending.accept_encodings);
        let mut segments: Vec<Segment> = Vec::new();
        let mut body: Vec<Bytes> = Vec::new();
        let mut token = header.page_token;
        let mut pages = pending.pages.into_iter().peekable();
        while let Some(page) = pages.next() {
            let (object, index) = match page {
                PageRef::Memory(b) => {
                    push_inline(&mut segments, token, b.len() as u64);
                    body.push(b);
                    token += 1;
                    continue;
                }
                PageRef::Spooled { object, index } => (object, index),
            };
            // The run of consecutive pages of this object in the reply.
            let mut count = 1u32;
            while let Some(PageRef::Spooled {
                object: o,
                index: i,
            }) = pages.peek()
            {
                if !Arc::ptr_eq(o, &object) || *i != index + count {
                    break;
                }
                count += 1;
                pages.next();
            }
            let whole = index == 0 && count as usize == object.page_sizes.len();
            if client_fetches && whole {
                match spool.presign(&object).await {
                    Ok(Some(url)) => {
                        segments.push(spooled_segment(token, &object, url));
                        token += u64::from(count);
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "presigning failed; serving the object inline")
                    }
                }
            }
            let decoded = match spool.read(&object).await {
                Ok(decoded) => decoded,
                Err(e) => {
                    return server_error(
                        request,
                        format!(
                            "DATA for buffer {} of task {} at token {token}: cannot read spooled pages: {e}",
                            request.buffer_id, request.task_id
                        ),
                    );
                }
            };
            let from = index as usize;
            let to = from + count as usize;
            let Some(run) = decoded.get(from..to) else {
                return server_error(
                    request,
                    format!(
                        "spool object {} has fewer pages than its pages refer to",
                        object.name
                    ),
                );
            };
            for b in run {
                push_inline(&mut segments, token, b.len() as u64);
                body.push(b.clone());
                token += 1;
            }
        }
        header.segments = segments;
        Reply { header, body }
    }

    /// ENQUEUE under policy `always`: the pages are written to storage
    /// (objects of at most the segment size) before they are appended and
    /// the producer hears OK. A write that fails stores nothing: BUSY.
    async fn durable_enqueue(
        &self,
        request: &BinRequest,
        body: &Bytes,
        gate: Arc<tokio::sync::Mutex<()>>,
    ) -> Reply {
        let Some(spool) = self.inner.spool.clone() else {
            return server_error(request, "policy always needs a spool store".into());
        };
        let _order = gate.lock().await;
        let plan = match self.lock().plan_durable(request, body) {
            Ok(plan) => plan,
            Err(reply) => return *reply,
        };
        let max = spool.config().segment_max_bytes;
        let mut objects: Vec<Arc<SpooledObject>> = Vec::new();
        let mut first = 0usize;
        while first < plan.pages.len() {
            let mut last = first + 1;
            let mut bytes = plan.pages[first].len() as u64;
            while let Some(next) = plan.pages.get(last) {
                if bytes + next.len() as u64 > max {
                    break;
                }
                bytes += next.len() as u64;
                last += 1;
            }
            let pages = plan.pages[first..last].to_vec();
            let token = plan.first_token + first as u64;
            match spool
                .write(&request.task_id, token, pages, Durability::Durable)
                .await
            {
                Ok(object) => objects.push(object),
                Err(e) => {
                    return Reply::new(BinReply::error(
                        request,
                        Status::Busy,
                        format!(
                            "ENQUEUE for buffer {} of task {} (policy always): writing to storage failed, nothing was stored; retry later: {e}",
                            request.buffer_id, request.task_id
                        ),
                    ));
                }
            }
            first = last;
        }
        let now = Instant::now().into_std();
        self.lock().append_durable(request, &plan, &objects, now)
    }

    /// NO_MORE_PAGES under policy `always`: the buffers are finished; their
    /// commit markers are written before the producer hears OK. A failed
    /// write is BUSY: repeating NO_MORE_PAGES writes the markers again.
    async fn commit(&self, request: &BinRequest, plans: Vec<MarkerPlan>) -> Reply {
        let Some(spool) = self.inner.spool.clone() else {
            return server_error(request, "policy always needs a spool store".into());
        };
        for plan in plans {
            if let Err(e) = spool
                .write_marker(&plan.task_id, plan.buffer_id, plan.end_token, &plan.objects)
                .await
            {
                return Reply::new(BinReply::error(
                    request,
                    Status::Busy,
                    format!(
                        "NO_MORE_PAGES for buffer {} of task {}: the buffer is finished, but its commit marker could not be written; retry: {e}",
                        plan.buffer_id, plan.task_id
                    ),
                ));
            }
        }
        Reply::new(BinReply::to(request, Status::Ok))
    }

    /// Writes pages of tasks under policy `overflow` to storage when an
    /// ENQUEUE needs room or pages grow old; runs until the task is aborted.
    pub fn spawn_spiller(&self) -> Option<tokio::task::JoinHandle<()>> {
        let spool = self.inner.spool.clone()?;
        let exchange = self.clone();
        let wake = self.lock().spill_wake();
        Some(tokio::spawn(async move {
            loop {
                let _ = tokio::time::timeout(Duration::from_secs(1), wake.notified()).await;
                loop {
                    let job = exchange.lock().spill_job(Instant::now().into_std());
                    let Some(job) = job else { break };
                    if !exchange.spill(&spool, job).await {
                        // The store is failing: back off before trying again.
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        break;
                    }
                }
            }
        }))
    }

    /// Writes one run of pages to storage; false when the store failed
    /// (the pages stay in memory).
    async fn spill(&self, spool: &Spool, job: SpillJob) -> bool {
        let written = spool
            .write(
                &job.task_id,
                job.first_token,
                job.pages.clone(),
                Durability::Overflow,
            )
            .await;
        let object = match written {
            Ok(object) => Some(object),
            Err(e) => {
                tracing::warn!(task = %job.task_id, token = job.first_token, error = %e, "spilling pages to storage failed; they stay in memory");
                None
            }
        };
        self.lock().finish_spill(&job, object.as_ref());
        object.is_some()
    }

    /// Draining (DESIGN: spool unacknowledged pages if a store is
    /// configured): the pages still only in memory of finished buffers
    /// under `overflow` go to storage, then each such buffer gets a commit
    /// marker, as under `always`. A consumer reading through its own
    /// sidecar then finishes from storage once this binxd is gone. This
    /// binxd goes on serving them meanwhile.
    async fn spool_for_drain(&self, spool: Arc<Spool>) {
        if let Some(reason) = spool.always_refusal() {
            tracing::warn!(
                "draining: held pages are not spooled, as their buffers could not be committed: {reason}"
            );
            return;
        }
        let mut spilled = 0usize;
        loop {
            let job = self.lock().drain_spill_job();
            let Some(job) = job else { break };
            let pages = job.pages.len();
            if !self.spill(&spool, job).await {
                tracing::warn!(
                    "draining: the store failed; pages not yet spooled stay in memory only, and their buffers get no commit marker"
                );
                break;
            }
            spilled += pages;
        }
        let plans = self.lock().drain_commit_plans(Instant::now().into_std());
        let mut committed = 0usize;
        for plan in plans {
            match spool
                .write_marker(&plan.task_id, plan.buffer_id, plan.end_token, &plan.objects)
                .await
            {
                Ok(()) => committed += 1,
                Err(e) => {
                    tracing::warn!(task = %plan.task_id, buffer = plan.buffer_id, error = %e, "draining: the commit marker could not be written; consumers cannot finish this buffer from storage");
                }
            }
        }
        if spilled > 0 || committed > 0 {
            tracing::info!(
                pages_spooled = spilled,
                buffers_committed = committed,
                "draining: unacknowledged pages of finished buffers are in storage under commit markers; their consumers can finish from there"
            );
        }
    }

    /// What HELLO advertises: with a spool, `spool`, the codecs it writes
    /// besides none, and `proxy` (it reads spooled segments for clients).
    pub fn capabilities(&self) -> Vec<String> {
        let Some(spool) = &self.inner.spool else {
            return Vec::new();
        };
        let mut out = vec!["spool".to_string(), "proxy".to_string()];
        let codec = spool.config().codec.name();
        if codec != "none" {
            out.push(codec.to_string());
        }
        out
    }

    pub fn spool(&self) -> Option<&Arc<Spool>> {
        self.inner.spool.as_ref()
    }

    /// Starts draining: new tasks are refused, existing ones are served,
    /// and (with a store) held pages of finished buffers are spooled and
    /// committed in the background (see `spool_for_drain`).
    pub fn start_drain(&self) {
        let started = self.lock().start_drain();
        if let (true, Some(spool), Ok(runtime)) = (
            started,
            self.inner.spool.clone(),
            tokio::runtime::Handle::try_current(),
        ) {
            let exchange = self.clone();
            runtime.spawn(async move { exchange.spool_for_drain(spool).await });
        }
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
        let freed = manager.abort(task_id, reason, Instant::now().into_std());
        let released = manager.take_released_markers();
        drop(manager);
        self.delete_markers(released);
        Some(freed)
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
                let released = {
                    let mut manager = exchange.lock();
                    manager.sweep(Instant::now().into_std());
                    manager.take_released_markers()
                };
                exchange.delete_markers(released);
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
            ConnectionEvent::ShmAttached => {
                c.shm_connections_open.fetch_add(1, Ordering::Relaxed);
                c.shm_attached.fetch_add(1, Ordering::Relaxed);
            }
            ConnectionEvent::ShmDetached => {
                c.shm_connections_open.fetch_sub(1, Ordering::Relaxed);
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
            shm_connections_open: c.shm_connections_open.load(Ordering::Relaxed),
            shm_attached_total: c.shm_attached.load(Ordering::Relaxed),
            protocol_errors,
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            backpressure_waits: c.backpressure_waits.load(Ordering::Relaxed),
            errors: error_replies + protocol_errors,
            spool: self.inner.spool.as_ref().map(|s| s.stats()),
        }
    }
}

fn server_error(request: &BinRequest, error: String) -> Reply {
    Reply::new(BinReply::error(request, Status::ServerError, error))
}

/// Adds one inline page to the reply, extending the last inline segment.
fn push_inline(segments: &mut Vec<Segment>, token: u64, size: u64) {
    if let Some(last) = segments.last_mut()
        && matches!(last.body, Some(segment::Body::Inline(_)))
        && last.first_token + last.page_sizes.len() as u64 == token
    {
        last.page_sizes.push(size);
        return;
    }
    segments.push(Segment::inline(token, vec![size]));
}

fn spooled_segment(token: u64, object: &SpooledObject, url: binx_spool::Presigned) -> Segment {
    Segment {
        first_token: token,
        page_sizes: object.page_sizes.clone(),
        body: Some(segment::Body::Spooled(binx_proto::Spooled {
            uri: url.url,
            headers: Default::default(),
            stored_size: object.stored_size,
            key: object.key.map(|k| k.to_vec()).unwrap_or_default(),
            expires_at_unix_ms: url.expires_at_unix_ms,
        })),
    }
}
