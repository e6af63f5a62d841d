//! `ExchangeSource`: pulls one remote buffer to its end, exactly once.
//!
//! A background task drives the exchange core's consumer machine
//! ([`binx_core::source::SourceMachine`], the same one the deterministic
//! simulation runs): it asks for pages from the next token on, within a
//! memory budget, and queues them for the consumer; with no room, or when
//! nothing arrived, it asks only for data sizes (a long-poll that moves no
//! pages) and acknowledges what it holds so the server can free it. Every
//! reply is checked to continue the buffer exactly; errors are retried at
//! the same token, which the protocol makes exact. At the end it DELETEs
//! the buffer.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use binx_core::source::{PullConfig, PullStep, ReplyPart, SourceMachine, auto_reply_size};
use binx_proto::{BinReply, BinRequest, Frame, MessageType, segment, split_pages};
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use tokio::sync::Notify;

use crate::connection::{Connection, describe};
use crate::error::ClientError;

/// Limits of one source.
#[derive(Clone, Debug)]
pub struct SourceConfig {
    /// Bytes of received pages the source may hold for its consumer. A page
    /// larger than the budget is still fetched when the source holds nothing.
    pub memory_budget: u64,
    /// Largest reply asked for (the server caps it at its own limit); 0,
    /// the default, is a sixteenth of `memory_budget` between 1 MiB and
    /// 2 MiB when DATA is pipelined, an eighth between 1 MiB and 16 MiB
    /// when not ([`binx_core::source::auto_reply_size`]), and over shared
    /// memory at most what fits one slot, so that pages are read in place.
    pub max_reply_size: u64,
    /// Long-poll time per request.
    pub max_wait: Duration,
    /// `host:port` of the sidecar that serves the buffer, when `connection`
    /// is the local sidecar's Unix socket and it should forward (proxy
    /// consumer); `None` reads from `connection` itself.
    pub remote: Option<String>,
    /// Fetch spooled segments from storage directly (presigned URLs) rather
    /// than have the serving sidecar read them and send them inline.
    pub accept_spooled: bool,
    /// DATA requests kept in flight at once (pipelined DATA,
    /// docs/PROTOCOL.md section 8): the next reply is asked for before the
    /// last one arrives, so the link is not idle for a round trip between
    /// replies. 1 sends one at a time, as a BinX 1.1 client does. A server
    /// that does not list `following_sizes` is read one request at a time
    /// whatever this says.
    pub pipeline_depth: usize,
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            memory_budget: 32 << 20,
            max_reply_size: 0,
            max_wait: Duration::from_secs(1),
            remote: None,
            accept_spooled: true,
            pipeline_depth: binx_core::source::DEFAULT_PIPELINE_DEPTH,
        }
    }
}

/// One page and its token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page {
    /// Its position in the buffer: the first page is token 0.
    pub token: u64,
    /// The page's bytes, exactly as the producer enqueued them.
    pub data: Bytes,
}

#[derive(Default)]
struct Inbox {
    pages: VecDeque<Page>,
    bytes: u64,
    finished: bool,
    error: Option<ClientError>,
    /// The error handed out, for every later call.
    failed: Option<String>,
}

struct Shared {
    inbox: Mutex<Inbox>,
    /// The fetcher queued pages, finished or failed.
    filled: Notify,
    /// The consumer took pages.
    drained: Notify,
}

impl Shared {
    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Pulls one remote buffer; see the module docs.
pub struct ExchangeSource {
    shared: Arc<Shared>,
    /// "buffer B of task T", for errors.
    label: String,
    fetcher: tokio::task::JoinHandle<()>,
}

/// Longest a reader that has every page waits for the DELETE that frees
/// the buffer before it is handed its end (the DELETE goes on behind it).
pub const DELETE_GRACE: Duration = Duration::from_secs(5);

impl Drop for ExchangeSource {
    fn drop(&mut self) {
        // A source read to its end lets its DELETE finish (bounded by the
        // connection's error budget): the buffer is freed at once rather
        // than when it is abandoned.
        if !self.shared.inbox().finished {
            self.fetcher.abort();
        }
    }
}

impl ExchangeSource {
    /// Starts pulling buffer `buffer_id` of `task_id` from `connection`.
    pub fn new(
        connection: Connection,
        task_id: impl Into<String>,
        buffer_id: u64,
        config: SourceConfig,
    ) -> Self {
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            filled: Notify::new(),
            drained: Notify::new(),
        });
        let task_id = task_id.into();
        let label = format!("buffer {buffer_id} of task {task_id}");
        let fetcher = Fetcher {
            connection,
            task_id,
            buffer_id,
            config,
            shared: shared.clone(),
            http: std::sync::OnceLock::new(),
        };
        ExchangeSource {
            shared,
            label,
            fetcher: tokio::spawn(fetcher.run()),
        }
    }

    /// The next page in token order; `None` once the buffer is complete
    /// and every page was handed over: when the DELETE that frees the
    /// buffer is answered, or [`DELETE_GRACE`] after it was sent, whichever
    /// comes first (the DELETE goes on behind it).
    pub async fn next_page(&mut self) -> Result<Option<Page>, ClientError> {
        loop {
            let filled = self.shared.filled.notified();
            tokio::pin!(filled);
            filled.as_mut().enable();
            {
                let mut inbox = self.shared.inbox();
                if let Some(page) = inbox.pages.pop_front() {
                    inbox.bytes -= page.data.len() as u64;
                    drop(inbox);
                    self.shared.drained.notify_one();
                    return Ok(Some(page));
                }
                if let Some(error) = inbox.error.take() {
                    inbox.failed = Some(error.to_string());
                    return Err(error);
                }
                // The fetcher has stopped: waiting would be for ever.
                if let Some(reason) = &inbox.failed {
                    return Err(ClientError::SourceFailed {
                        request: self.label.clone(),
                        reason: reason.clone(),
                    });
                }
                if inbox.finished {
                    return Ok(None);
                }
            }
            filled.await;
        }
    }

    /// Bytes of pages received and not yet taken.
    pub fn buffered_bytes(&self) -> u64 {
        self.shared.inbox().bytes
    }
}

/// A request the pull sent, its outcome, and the run of the daemon that
/// answered it (the instance its socket's HELLO named).
type Sent = (
    BinRequest,
    Result<Frame<BinReply>, ClientError>,
    Option<Arc<str>>,
);

struct Fetcher {
    connection: Connection,
    task_id: String,
    buffer_id: u64,
    config: SourceConfig,
    shared: Arc<Shared>,
    /// For spooled segments; built on first use.
    http: std::sync::OnceLock<reqwest::Client>,
}

impl Fetcher {
    async fn run(self) {
        use futures_util::FutureExt;
        // A panic in the pull (a bug) must end the reader's wait too, which
        // would otherwise last for ever.
        let result = std::panic::AssertUnwindSafe(self.pull())
            .catch_unwind()
            .await;
        let mut inbox = self.shared.inbox();
        match result {
            Ok(Ok(())) => inbox.finished = true,
            // After the end was handed over (only the DELETE was left),
            // an error is the cleanup's, logged.
            Ok(Err(e)) if inbox.finished => {
                tracing::warn!(error = %e, "a source read to its end could not delete its buffer");
            }
            Ok(Err(e)) => inbox.error = Some(e),
            Err(_) => {
                tracing::error!(task = %self.task_id, buffer = self.buffer_id, "the source's fetcher panicked");
                if !inbox.finished {
                    inbox.failed = Some("its fetcher panicked (a bug; see the log)".into());
                }
            }
        }
        drop(inbox);
        self.shared.filled.notify_one();
    }

    fn http(&self) -> &reqwest::Client {
        self.http.get_or_init(crate::spooled::http_client)
    }

    /// Drives the consumer machine of the exchange core: it says which
    /// request comes next and checks that every reply continues the buffer
    /// exactly; this only carries the requests (several at once when the
    /// machine pipelines DATA), fetches spooled segments and hands pages to
    /// the consumer. Replies are handled in the order their requests were
    /// sent, so a pipelined reply is never dropped for arriving early.
    async fn pull(&self) -> Result<(), ClientError> {
        let mut max_reply_size = self.config.max_reply_size;
        // Over shared memory, replies that fit one slot are read in place:
        // no copy on this side. Not for a buffer the local sidecar forwards
        // from a remote, where each reply costs a network round trip.
        let mut in_place = None;
        if max_reply_size == 0 && self.config.remote.is_none() {
            in_place = self.connection.reply_size_in_place().await;
            if let Some(in_place) = in_place {
                let auto = auto_reply_size(self.config.memory_budget, self.config.pipeline_depth);
                max_reply_size = auto.min(in_place);
            }
        }
        let mut machine = SourceMachine::new(
            self.task_id.clone(),
            self.buffer_id,
            PullConfig {
                memory_budget: self.config.memory_budget,
                max_reply_size,
                max_wait: self.config.max_wait,
                remote: self.config.remote.clone(),
                accept_spooled: self.config.accept_spooled,
                pipeline_depth: self.config.pipeline_depth.max(1),
            },
        );
        let mut backoff = self.connection.backoff();
        let mut in_flight = FuturesOrdered::new();
        // The daemon process the pages read so far came from, when read
        // from the local daemon itself (a forwarding one fails over on its
        // own): a restarted one lost the buffer.
        let mut read_from: Option<Arc<str>> = None;
        loop {
            let drained = self.shared.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            let held = self.shared.inbox().bytes;
            let step = machine.poll(held);
            let (request, reply, answered_by) = match step {
                PullStep::Done => return Ok(()),
                PullStep::Send(request) => {
                    if request.r#type == MessageType::Delete as i32 {
                        // Every page is taken (the machine deletes only
                        // after the buffer's last reply). The end is handed
                        // over once the DELETE is answered (the buffer is
                        // then freed), or after DELETE_GRACE at most: the
                        // DELETE is only the buffer's cleanup, and a
                        // sidecar that does not answer it must not hold
                        // the reader for the DELETE's whole error budget.
                        let shared = self.shared.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(DELETE_GRACE).await;
                            shared.inbox().finished = true;
                            shared.filled.notify_one();
                        });
                    }
                    // Once pages came from a process, every request goes to
                    // it alone: a DATA's acknowledgement or a DELETE sent to
                    // a restarted one would act on another run's buffer.
                    let pin = read_from.clone().filter(|_| self.config.remote.is_none());
                    in_flight.push_back(self.send(*request, pin));
                    continue;
                }
                PullStep::WaitForConsumer | PullStep::AwaitReply if in_flight.is_empty() => {
                    if self.shared.inbox().bytes == held {
                        drained.await;
                    }
                    continue;
                }
                PullStep::WaitForConsumer | PullStep::AwaitReply => {
                    tokio::select! {
                        done = in_flight.next() => match done {
                            Some(done) => done,
                            None => continue,
                        },
                        () = &mut drained => continue,
                    }
                }
            };
            if !machine.awaits(&request) {
                // A DATA the machine stopped waiting for (past a reply that
                // ended elsewhere): its outcome, even a refusal, means
                // nothing for the pull.
                machine
                    .on_reply(&request, None)
                    .map_err(|e| self.protocol(&request, e.0))?;
                continue;
            }
            match request.message_type() {
                Ok(MessageType::Ack) => {
                    if let Err(e) = &reply {
                        tracing::debug!(error = %e, "ACK failed; the next DATA acknowledges the same pages");
                    }
                    let reply = reply.ok();
                    machine
                        .on_reply(&request, reply.as_ref().map(|r| (&r.header, r.body.len())))
                        .map_err(|e| self.protocol(&request, e.0))?;
                }
                Ok(MessageType::Delete) => {
                    if let Err(e) = reply {
                        tracing::warn!(error = %e, "DELETE failed; the server drops the buffer when it is abandoned");
                    }
                    machine
                        .on_reply(&request, Some((&BinReply::default(), 0)))
                        .map_err(|e| self.protocol(&request, e.0))?;
                }
                _ => {
                    if let Err(ClientError::DaemonRestarted { now, .. }) = &reply {
                        // Withheld from a process other than the one the
                        // pages came from (a pinned request is never sent
                        // there). An ACK or DELETE withheld is only logged
                        // above: the next DATA fails, or the buffer had
                        // every page.
                        return Err(self.restarted(
                            read_from.as_deref().unwrap_or_default(),
                            now,
                            machine.token(),
                        ));
                    }
                    if self.config.remote.is_none() {
                        self.same_daemon(&read_from, answered_by.as_ref(), machine.token())?;
                    }
                    let reply = match reply {
                        Ok(reply) => reply,
                        Err(e) if machine.tolerates_refusal(&request) => {
                            // Sent past the next page on the word of the
                            // server's following_sizes: asked again once
                            // that page came.
                            tracing::debug!(error = %e, "a pipelined DATA was refused; asking again in turn");
                            machine
                                .on_reply(&request, None)
                                .map_err(|e| self.protocol(&request, e.0))?;
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    let parts = machine
                        .on_reply(&request, Some((&reply.header, reply.body.len())))
                        .map_err(|e| self.protocol(&request, e.0))?;
                    if let Some(limit) = in_place
                        && reply.body.len() as u64 > limit
                    {
                        // Pages too large for a slot: their frames span
                        // slots and are copied anyway, so smaller replies
                        // would only cost round trips.
                        machine.set_max_reply_size(self.config.max_reply_size);
                        in_place = None;
                    }
                    match self.take(&request, &reply, parts).await {
                        Ok(()) => {
                            backoff.succeeded();
                            // The run the pages read so far came from: the
                            // one that sent this reply.
                            if read_from.is_none() && machine.token() > 0 {
                                read_from = answered_by;
                            }
                        }
                        Err(e @ ClientError::Spooled { .. }) => {
                            // Storage hiccup or an expired URL: ask again at the
                            // same token (a fresh URL comes with the reply).
                            machine.retry_pages(request.page_token);
                            tracing::warn!(error = %e, "retrying a spooled segment");
                            if backoff.wait_after_error().await.is_err() {
                                return Err(e);
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }

    /// Sends one request of the machine: an ACK once (the next DATA
    /// acknowledges the same pages), anything else retried on transport
    /// errors and BUSY (DATA and DELETE are exact to repeat).
    /// With `pin`, only to that process of the daemon.
    fn send(
        &self,
        request: BinRequest,
        pin: Option<Arc<str>>,
    ) -> impl Future<Output = Sent> + use<> {
        let connection = self.connection.clone();
        async move {
            let reply = if request.r#type == MessageType::Ack as i32 {
                connection
                    .request_from(request.clone(), Vec::new(), pin.as_deref())
                    .await
            } else {
                let mut backoff = connection.backoff();
                connection
                    .request_retrying_from(
                        request.clone(),
                        Vec::new(),
                        &mut backoff,
                        ClientError::is_retryable,
                        pin.as_deref(),
                    )
                    .await
            };
            match reply {
                Ok((reply, instance)) => (request, Ok(reply), instance),
                // A refusal came from the run the connection's last HELLO
                // named (a restarted daemon refuses a token of the buffer
                // it lost): a restart is named rather than the refusal.
                Err(e) => {
                    let instance = match &e {
                        ClientError::Refused { .. } => connection.server_identity().instance,
                        _ => None,
                    };
                    (request, Err(e), instance)
                }
            }
        }
    }

    /// Checks that the run of the daemon that sent a reply (`answered_by`)
    /// is the one the pages read so far (below `token`) came from.
    fn same_daemon(
        &self,
        read_from: &Option<Arc<str>>,
        answered_by: Option<&Arc<str>>,
        token: u64,
    ) -> Result<(), ClientError> {
        match (read_from, answered_by) {
            (Some(before), Some(now)) if before != now => Err(self.restarted(before, now, token)),
            _ => Ok(()),
        }
    }

    /// The daemon the pages below `token` came from (process `before`)
    /// answers as process `now`.
    fn restarted(&self, before: &str, now: &str, token: u64) -> ClientError {
        ClientError::DaemonRestarted {
            endpoint: self.connection.endpoint().clone(),
            request: format!(
                "buffer {} of task {}",
                self.buffer_id,
                self.task_id.as_str()
            ),
            before: before.to_string(),
            now: now.to_string(),
            token,
        }
    }

    fn protocol(&self, request: &BinRequest, detail: String) -> ClientError {
        ClientError::Protocol {
            endpoint: self.connection.endpoint().clone(),
            request: describe(request),
            detail,
        }
    }

    /// Queues the pages of a checked DATA reply for the consumer, fetching
    /// spooled segments from storage; all of them or none.
    async fn take(
        &self,
        request: &BinRequest,
        reply: &binx_proto::Frame<BinReply>,
        parts: Vec<ReplyPart>,
    ) -> Result<(), ClientError> {
        // Within what was asked before anything is fetched (section 3: one
        // page past it at most when alone): a server listing segments of
        // any size would otherwise have this hold them all at once.
        let sizes = || {
            parts.iter().flat_map(|part| match part {
                ReplyPart::Inline { sizes, .. } => sizes.as_slice(),
                ReplyPart::Spooled { segment, .. } => segment.page_sizes.as_slice(),
            })
        };
        let total = sizes().fold(0u64, |sum, &size| sum.saturating_add(size));
        let first = sizes().next().copied().unwrap_or(0);
        if total > request.max_size_bytes.max(first) {
            return Err(self.protocol(
                request,
                format!(
                    "the reply holds {total} bytes of pages, more than the {} asked for and more than its first page",
                    request.max_size_bytes
                ),
            ));
        }
        // The page past what was asked is no larger than a frame: no
        // binxd holds a page a producer could not send it in one.
        let frame_limit = self.connection.options().max_frame_length as u64;
        if first > request.max_size_bytes && first > frame_limit {
            return Err(self.protocol(
                request,
                format!(
                    "the reply's first page is {first} bytes, larger than a frame of this connection ({frame_limit}; raise ConnectionOptions::max_frame_length to read pages of a daemon whose max_frame_size is larger)"
                ),
            ));
        }
        // An object is fetched whole on the strength of its stored size: no
        // more than a writer stores for the pages listed.
        for part in &parts {
            if let ReplyPart::Spooled { segment, .. } = part
                && let Some(segment::Body::Spooled(spooled)) = &segment.body
            {
                let page_bytes = segment
                    .page_sizes
                    .iter()
                    .fold(0u64, |sum, &size| sum.saturating_add(size));
                let pages = segment.page_sizes.len() as u64;
                let most = binx_segment::max_stored_size(pages, page_bytes);
                if spooled.stored_size > most {
                    return Err(self.protocol(
                        request,
                        format!(
                            "a spooled segment's stored_size {} is more than a writer stores for {pages} pages of {page_bytes} bytes (at most {most})",
                            spooled.stored_size
                        ),
                    ));
                }
            }
        }
        let mut pages = Vec::new();
        for part in parts {
            match part {
                ReplyPart::Inline {
                    first_token,
                    offset,
                    sizes,
                } => {
                    let length: u64 = sizes.iter().sum();
                    let end = offset + length as usize;
                    let body = reply.body.slice(offset..end);
                    let split = split_pages(&body, &sizes)
                        .map_err(|e| self.protocol(request, e.to_string()))?;
                    for (i, data) in split.into_iter().enumerate() {
                        pages.push(Page {
                            token: first_token + i as u64,
                            data,
                        });
                    }
                }
                ReplyPart::Spooled {
                    first_token,
                    segment,
                } => {
                    let Some(segment::Body::Spooled(spooled)) = &segment.body else {
                        return Err(
                            self.protocol(request, "a spooled segment without its object".into())
                        );
                    };
                    let data =
                        crate::spooled::fetch(self.http(), request, &segment, spooled).await?;
                    for (i, data) in data.into_iter().enumerate() {
                        pages.push(Page {
                            token: first_token + i as u64,
                            data,
                        });
                    }
                }
            }
        }
        if pages.is_empty() {
            return Ok(());
        }
        let bytes: u64 = pages.iter().map(|p| p.data.len() as u64).sum();
        {
            let mut inbox = self.shared.inbox();
            inbox.bytes += bytes;
            inbox.pages.extend(pages);
        }
        self.shared.filled.notify_one();
        Ok(())
    }
}
