//! The producer side for a local engine: OPEN_TASK, ENQUEUE with
//! backpressure, NO_MORE_PAGES and ABORT_TASK over the Unix socket.

use std::time::Duration;

use binx_proto::{ALL_BUFFERS, BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;

use crate::connection::{Connection, ConnectionOptions, describe};
use crate::endpoint::Endpoint;
use crate::error::ClientError;

/// How a task's buffers are laid out (OPEN_TASK).
#[derive(Clone, Debug)]
pub struct TaskSpec {
    /// How pages reach the buffers.
    pub kind: BufferKind,
    /// 0: buffers are added until NO_MORE_PAGES for the whole task.
    pub buffer_count: u64,
    /// `off`, `overflow`, `always`, or empty for the daemon's default.
    pub spool_policy: String,
}

impl TaskSpec {
    /// `count` partitioned buffers with the daemon's default spool policy.
    pub fn partitioned(count: u64) -> Self {
        TaskSpec {
            kind: BufferKind::Partitioned,
            buffer_count: count,
            spool_policy: String::new(),
        }
    }
}

/// Hands pages to the local daemon.
#[derive(Clone, Debug)]
pub struct Producer {
    connection: Connection,
    /// ENQUEUE bodies are cut into batches of at most this many bytes (and
    /// within the daemon's `max-enqueue-bytes=`, when its HELLO said it).
    pub max_batch_bytes: usize,
    /// How long one ENQUEUE may wait for room in the daemon before BUSY.
    pub enqueue_wait: Duration,
}

/// Room kept in a frame for the header of an ENQUEUE.
const HEADER_ROOM: usize = 64 * 1024;

/// Most pages one ENQUEUE carries: their sizes (at most 10 bytes each in
/// the header) and the task id stay well inside the 64 KiB header limit.
pub const MAX_BATCH_PAGES: usize = 4096;

impl Producer {
    /// A producer over `connection` (a Unix socket, or shared memory on one).
    pub fn new(connection: Connection) -> Self {
        let frame = connection.options().max_frame_length;
        Producer {
            max_batch_bytes: frame.saturating_sub(HEADER_ROOM).clamp(1, 16 << 20),
            enqueue_wait: Duration::from_secs(1),
            connection,
        }
    }

    /// A producer on the daemon's Unix socket. Its connection says HELLO,
    /// so that batches stay within what the daemon takes
    /// (`max-enqueue-bytes=`): a daemon with a small memory limit refuses a
    /// large batch as one that can never fit, though each page would.
    pub fn unix(path: impl Into<std::path::PathBuf>, options: ConnectionOptions) -> Self {
        let options = ConnectionOptions {
            hello: true,
            ..options
        };
        Producer::new(Connection::new(Endpoint::Unix(path.into()), options))
    }

    /// What the daemon said it takes in one ENQUEUE in its last HELLO
    /// (`max-enqueue-bytes=`): a batch's bytes, with
    /// [`binx_proto::ENQUEUE_PAGE_COST`] a page, stay within it; `None`
    /// when it said nothing.
    pub fn daemon_enqueue_limit(&self) -> Option<u64> {
        self.connection.server_identity().max_enqueue_bytes
    }

    /// The connection it sends on.
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    fn request(&self, kind: MessageType, task_id: &str, buffer_id: u64) -> BinRequest {
        let mut r = BinRequest::new(kind);
        r.task_id = task_id.to_string();
        r.buffer_id = buffer_id;
        r
    }

    /// The largest page one ENQUEUE carries: a frame less room for its header.
    pub fn max_page_len(&self) -> usize {
        self.connection
            .options()
            .max_frame_length
            .saturating_sub(HEADER_ROOM)
    }

    /// Creates the task's buffers (idempotent, so retried on transport errors).
    pub async fn open_task(&self, task_id: &str, spec: &TaskSpec) -> Result<(), ClientError> {
        let mut r = self.request(MessageType::OpenTask, task_id, 0);
        r.buffer_kind = spec.kind as i32;
        r.buffer_count = spec.buffer_count;
        r.spool_policy = spec.spool_policy.clone();
        let mut backoff = self.connection.backoff();
        self.connection
            .request_with_retry(r, Vec::new(), &mut backoff)
            .await?;
        Ok(())
    }

    /// Appends `pages` to buffer `buffer_id`, in order, in batches that fit a
    /// frame and what the daemon's HELLO said it takes (at most
    /// [`MAX_BATCH_PAGES`] pages each, fewer when its
    /// `max-pages-per-enqueue=` says so). BUSY (the daemon is
    /// full) is retried with backoff until the maximum error duration; a
    /// BUSY batch stored nothing, so this is exact. A transport error is not
    /// retried, since the batch may have been stored; the error says so.
    /// When a batch after the first fails, the error is
    /// [`ClientError::PartlyStored`], which says how many pages were stored.
    pub async fn enqueue(
        &self,
        task_id: &str,
        buffer_id: u64,
        pages: &[Bytes],
    ) -> Result<(), ClientError> {
        // A page no frame carries is refused before anything is sent, so a
        // call is never stored in part for it.
        if let Some(page) = pages.iter().find(|p| p.len() > self.max_page_len()) {
            return Err(ClientError::Encode {
                endpoint: self.connection.endpoint().clone(),
                request: format!("ENQUEUE to buffer {buffer_id} of task {task_id}"),
                source: binx_proto::FrameError::TooLarge {
                    length: page.len() as u64,
                    limit: self.max_page_len(),
                },
            });
        }
        if pages.is_empty() {
            return Ok(());
        }
        // The daemon's limits are learnt from its HELLO: connected first.
        self.connection.connect_now().await;
        let said = self.connection.server_identity();
        let daemon = said.max_enqueue_bytes.unwrap_or(u64::MAX);
        let max_pages = said.max_pages_per_enqueue.map_or(MAX_BATCH_PAGES, |n| {
            usize::try_from(n)
                .unwrap_or(usize::MAX)
                .min(MAX_BATCH_PAGES)
        });
        // A longer frame would close the connection: a page that cannot go
        // in one is refused here, before anything of the call is stored.
        let frame = said.max_frame_bytes.unwrap_or(u64::MAX);
        let overhead = |pages: usize| binx_proto::enqueue_frame_overhead(task_id.len(), pages);
        if let Some(page) = pages.iter().find(|p| p.len() as u64 + overhead(1) > frame) {
            return Err(ClientError::Encode {
                endpoint: self.connection.endpoint().clone(),
                request: format!(
                    "ENQUEUE to buffer {buffer_id} of task {task_id} (a page of {} bytes, past what the daemon reads in one frame: its max_frame_size)",
                    page.len()
                ),
                source: binx_proto::FrameError::TooLarge {
                    length: page.len() as u64 + overhead(1),
                    limit: usize::try_from(frame).unwrap_or(usize::MAX),
                },
            });
        }
        let mut start = 0;
        while start < pages.len() {
            let mut end = start;
            let mut bytes = 0usize;
            // What the batch counts against the daemon's limit.
            let mut cost = 0u64;
            while end < pages.len() && end - start < max_pages {
                let len = pages[end].len();
                let page_cost = len as u64 + binx_proto::ENQUEUE_PAGE_COST;
                let fits = bytes + len <= self.max_batch_bytes
                    && cost.saturating_add(page_cost) <= daemon
                    && (bytes + len) as u64 + overhead(end - start + 1) <= frame;
                // A page goes alone when nothing more fits with it.
                if end > start && !fits {
                    break;
                }
                bytes += len;
                cost = cost.saturating_add(page_cost);
                end += 1;
            }
            if let Err(e) = self
                .enqueue_batch(task_id, buffer_id, &pages[start..end])
                .await
            {
                return Err(match start {
                    0 => e,
                    stored => ClientError::PartlyStored {
                        request: format!("ENQUEUE to buffer {buffer_id} of task {task_id}"),
                        stored,
                        total: pages.len(),
                        last: Box::new(e),
                    },
                });
            }
            start = end;
        }
        Ok(())
    }

    async fn enqueue_batch(
        &self,
        task_id: &str,
        buffer_id: u64,
        pages: &[Bytes],
    ) -> Result<(), ClientError> {
        let mut r = self.request(MessageType::Enqueue, task_id, buffer_id);
        r.page_sizes = pages.iter().map(|p| p.len() as u64).collect();
        r.max_wait_micros = self.enqueue_wait.as_micros().min(u128::from(u64::MAX)) as u64;
        let mut backoff = self.connection.backoff();
        // Retried only where nothing of the batch was stored: BUSY, and a
        // connection that could not be made (the batch was never sent).
        // After a connection broke some pages may have been stored, so
        // repeating could duplicate them.
        let unsent = |e: &ClientError| {
            e.status() == Some(Status::Busy)
                || matches!(
                    e,
                    ClientError::Connect { .. } | ClientError::ConnectTimeout { .. }
                )
        };
        match self
            .connection
            .request_retrying(r.clone(), pages.to_vec(), &mut backoff, unsent)
            .await
        {
            Ok(_) => Ok(()),
            Err(
                e @ (ClientError::Refused { .. }
                | ClientError::GaveUp { .. }
                | ClientError::Encode { .. }),
            ) => Err(e),
            Err(e) => Err(ClientError::ConnectionLost {
                endpoint: self.connection.endpoint().clone(),
                reason: format!(
                    "{} of {} pages may or may not have been stored: {e}",
                    describe(&r),
                    pages.len()
                ),
            }),
        }
    }

    /// Finishes one buffer, or (`None`) every buffer of the task.
    pub async fn no_more_pages(
        &self,
        task_id: &str,
        buffer_id: Option<u64>,
    ) -> Result<(), ClientError> {
        let r = self.request(
            MessageType::NoMorePages,
            task_id,
            buffer_id.unwrap_or(ALL_BUFFERS),
        );
        let mut backoff = self.connection.backoff();
        self.connection
            .request_with_retry(r, Vec::new(), &mut backoff)
            .await?;
        Ok(())
    }

    /// Frees the task; its consumers see SERVER_ERROR with `reason`.
    pub async fn abort(&self, task_id: &str, reason: &str) -> Result<(), ClientError> {
        let mut r = self.request(MessageType::AbortTask, task_id, 0);
        // binxd keeps no more of it; a longer one (a stack trace) could
        // pass the header limit, and the abort would never be sent.
        r.reason = binx_proto::truncate(reason, binx_core::MAX_REASON_LEN).to_string();
        let mut backoff = self.connection.backoff();
        self.connection
            .request_with_retry(r, Vec::new(), &mut backoff)
            .await?;
        Ok(())
    }
}
