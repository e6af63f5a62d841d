//! `ExchangeSource`: pulls one remote buffer to its end, exactly once.
//!
//! A background task asks for pages from the next token on, within a memory
//! budget, and queues them for the consumer. With no room, or when nothing
//! arrived, it asks only for data sizes (a long-poll that moves no pages) and
//! acknowledges what it holds so the server can free it. Errors are retried
//! at the same token, which the protocol makes exact: a page is never lost or
//! delivered twice. At the end it DELETEs the buffer.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use binx_proto::{BinRequest, MessageType, segment, split_pages};
use bytes::Bytes;
use tokio::sync::Notify;

use crate::connection::{Connection, describe};
use crate::error::ClientError;

/// Limits of one source.
#[derive(Clone, Debug)]
pub struct SourceConfig {
    /// Bytes of received pages the source may hold for its consumer. A page
    /// larger than the budget is still fetched when the source holds nothing.
    pub memory_budget: u64,
    /// Largest reply asked for.
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
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            memory_budget: 32 << 20,
            max_reply_size: 1 << 20,
            max_wait: Duration::from_secs(1),
            remote: None,
            accept_spooled: true,
        }
    }
}

/// Codecs this client decodes in spooled segments.
const ACCEPT_ENCODINGS: [&str; 3] = ["none", "lz4", "zstd"];

/// One page and its token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page {
    pub token: u64,
    pub data: Bytes,
}

#[derive(Default)]
struct Inbox {
    pages: VecDeque<Page>,
    bytes: u64,
    finished: bool,
    error: Option<ClientError>,
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
    fetcher: tokio::task::JoinHandle<()>,
}

impl Drop for ExchangeSource {
    fn drop(&mut self) {
        self.fetcher.abort();
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
        let fetcher = Fetcher {
            connection,
            task_id: task_id.into(),
            buffer_id,
            config,
            shared: shared.clone(),
            http: std::sync::OnceLock::new(),
        };
        ExchangeSource {
            shared,
            fetcher: tokio::spawn(fetcher.run()),
        }
    }

    /// The next page in token order; `None` once the buffer is complete.
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
                    return Err(error);
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

struct Fetcher {
    connection: Connection,
    task_id: String,
    buffer_id: u64,
    config: SourceConfig,
    shared: Arc<Shared>,
    /// For spooled segments; built on first use.
    http: std::sync::OnceLock<reqwest::Client>,
}

/// What one DATA reply brought.
enum Fetched {
    Pages { next: u64, complete: bool },
    Nothing,
    Complete,
}

impl Fetcher {
    async fn run(self) {
        let result = self.pull().await;
        let mut inbox = self.shared.inbox();
        match result {
            Ok(()) => inbox.finished = true,
            Err(e) => inbox.error = Some(e),
        }
        drop(inbox);
        self.shared.filled.notify_one();
    }

    fn http(&self) -> &reqwest::Client {
        self.http.get_or_init(crate::spooled::http_client)
    }

    fn request(&self, kind: MessageType, token: u64) -> BinRequest {
        let mut r = BinRequest::new(kind);
        r.task_id = self.task_id.clone();
        r.buffer_id = self.buffer_id;
        r.page_token = token;
        r.remote = self.config.remote.clone().unwrap_or_default();
        r
    }

    async fn pull(&self) -> Result<(), ClientError> {
        let mut token = 0u64;
        let mut backoff = self.connection.backoff();
        // Sizes of the pages waiting at `token`, when the server told us.
        let mut known_sizes: VecDeque<u64> = VecDeque::new();
        let mut nothing_arrived = false;
        let wait_micros = self.config.max_wait.as_micros().min(u128::from(u64::MAX)) as u64;
        loop {
            let (held, room) = {
                let inbox = self.shared.inbox();
                (
                    inbox.bytes,
                    self.config.memory_budget.saturating_sub(inbox.bytes),
                )
            };
            let next_fits = known_sizes.front().is_none_or(|&s| s <= room);
            if held > 0 && (room == 0 || !next_fits) {
                // No room: let the server free what we hold, learn what is
                // coming, and wait for the consumer.
                let drained = self.shared.drained.notified();
                tokio::pin!(drained);
                drained.as_mut().enable();
                self.ack(token).await;
                if known_sizes.is_empty() {
                    let (sizes, complete) = self.sizes(token, 0, &mut backoff).await?;
                    if complete && sizes.is_empty() {
                        break;
                    }
                    known_sizes = sizes.into();
                }
                if self.shared.inbox().bytes == held {
                    drained.await;
                }
                continue;
            }
            if nothing_arrived {
                let (sizes, complete) = self.sizes(token, wait_micros, &mut backoff).await?;
                if complete && sizes.is_empty() {
                    break;
                }
                nothing_arrived = sizes.is_empty();
                known_sizes = sizes.into();
                continue;
            }
            let max_size = room.min(self.config.max_reply_size).max(1);
            let mut request = self.request(MessageType::Data, token);
            request.max_size_bytes = max_size;
            request.max_wait_micros = wait_micros;
            if self.config.accept_spooled {
                request.accept_spooled = true;
                request.accept_encodings = ACCEPT_ENCODINGS.iter().map(|e| e.to_string()).collect();
            }
            let reply = self
                .connection
                .request_with_retry(request.clone(), Vec::new(), &mut backoff)
                .await?;
            let fetched = match self.accept(&request, reply, token).await {
                Ok(fetched) => fetched,
                Err(e @ ClientError::Spooled { .. }) => {
                    // Storage hiccup or an expired URL: ask again at the same
                    // token (a fresh URL comes with the reply).
                    match backoff.failed(tokio::time::Instant::now().into_std()) {
                        Some(delay) => {
                            tracing::warn!(error = %e, "retrying a spooled segment");
                            tokio::time::sleep(delay).await;
                            continue;
                        }
                        None => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            };
            backoff.succeeded();
            match fetched {
                Fetched::Pages { next, complete } => {
                    for _ in token..next {
                        known_sizes.pop_front();
                    }
                    token = next;
                    if complete {
                        break;
                    }
                }
                Fetched::Nothing => {
                    known_sizes.clear();
                    nothing_arrived = true;
                }
                Fetched::Complete => break,
            }
        }
        self.delete(&mut backoff).await;
        Ok(())
    }

    /// Checks a DATA reply against the token asked for and queues its pages
    /// (fetching spooled segments from storage).
    async fn accept(
        &self,
        request: &BinRequest,
        reply: binx_proto::Frame<binx_proto::BinReply>,
        token: u64,
    ) -> Result<Fetched, ClientError> {
        let header = &reply.header;
        let protocol = |detail: String| ClientError::Protocol {
            endpoint: self.connection.endpoint().clone(),
            request: describe(request),
            detail,
        };
        if header.page_token != token {
            return Err(protocol(format!(
                "reply page_token {} differs from the token asked for",
                header.page_token
            )));
        }
        let mut pages = Vec::new();
        let mut offset = 0usize;
        let mut expected = token;
        for segment in &header.segments {
            if segment.first_token != expected {
                return Err(protocol(format!(
                    "segment starts at token {} where {expected} was due",
                    segment.first_token
                )));
            }
            match &segment.body {
                Some(segment::Body::Inline(_)) => {}
                Some(segment::Body::Spooled(spooled)) => {
                    if !request.accept_spooled {
                        return Err(protocol(format!(
                            "server sent a spooled segment ({}) although this client did not accept spooled segments",
                            crate::spooled::redact(&spooled.uri)
                        )));
                    }
                    let data =
                        crate::spooled::fetch(self.http(), request, segment, spooled).await?;
                    for data in data {
                        pages.push(Page {
                            token: expected,
                            data,
                        });
                        expected += 1;
                    }
                    continue;
                }
                None => {
                    return Err(protocol(
                        "segment has neither inline nor spooled body".into(),
                    ));
                }
            }
            let length: u64 = segment.page_sizes.iter().sum();
            let end = offset
                .checked_add(length as usize)
                .filter(|&e| e <= reply.body.len())
                .ok_or_else(|| protocol("segment page sizes exceed the frame body".into()))?;
            let body = reply.body.slice(offset..end);
            let split =
                split_pages(&body, &segment.page_sizes).map_err(|e| protocol(e.to_string()))?;
            for data in split {
                pages.push(Page {
                    token: expected,
                    data,
                });
                expected += 1;
            }
            offset = end;
        }
        if offset != reply.body.len() {
            return Err(protocol(format!(
                "frame body has {} bytes beyond its segments",
                reply.body.len() - offset
            )));
        }
        if header.page_next_token != expected {
            return Err(protocol(format!(
                "page_next_token {} does not follow the {} pages sent from token {token}",
                header.page_next_token,
                pages.len()
            )));
        }
        if pages.is_empty() {
            return Ok(if header.buffer_complete {
                Fetched::Complete
            } else {
                Fetched::Nothing
            });
        }
        let bytes: u64 = pages.iter().map(|p| p.data.len() as u64).sum();
        {
            let mut inbox = self.shared.inbox();
            inbox.bytes += bytes;
            inbox.pages.extend(pages);
        }
        self.shared.filled.notify_one();
        Ok(Fetched::Pages {
            next: expected,
            complete: header.buffer_complete,
        })
    }

    /// Sizes of the pages waiting at `token` (long-polling up to `wait_micros`).
    async fn sizes(
        &self,
        token: u64,
        wait_micros: u64,
        backoff: &mut crate::Backoff,
    ) -> Result<(Vec<u64>, bool), ClientError> {
        let mut request = self.request(MessageType::Data, token);
        request.get_data_size = true;
        request.max_wait_micros = wait_micros;
        let reply = self
            .connection
            .request_with_retry(request, Vec::new(), backoff)
            .await?;
        Ok((reply.header.remaining_bytes, reply.header.buffer_complete))
    }

    /// Best effort: the next DATA acknowledges the same pages anyway.
    async fn ack(&self, token: u64) {
        if token == 0 {
            return;
        }
        let request = self.request(MessageType::Ack, token);
        if let Err(e) = self.connection.request(request, Vec::new()).await {
            tracing::debug!(error = %e, "ACK failed; the next DATA acknowledges the same pages");
        }
    }

    async fn delete(&self, backoff: &mut crate::Backoff) {
        let request = self.request(MessageType::Delete, 0);
        if let Err(e) = self
            .connection
            .request_with_retry(request, Vec::new(), backoff)
            .await
        {
            tracing::warn!(error = %e, "DELETE failed; the server drops the buffer when it is abandoned");
        }
    }
}
