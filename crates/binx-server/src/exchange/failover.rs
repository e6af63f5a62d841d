//! Proxy consumer failover: a buffer committed to storage (policy `always`)
//! is read from storage once its producer has lost it for `failover_after`,
//! whether the producer stopped answering (pod gone) or answers NO_DATA
//! (restarted without the task: a live producer never answers NO_DATA for a
//! committed buffer, whose pages are all there).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use binx_proto::{BinReply, BinRequest, MessageType, Segment, Status};
use binx_spool::{CommitMarker, Spool};
use tokio::time::Instant;

use super::{Exchange, push_inline, server_error};
use crate::manager::Reply;

/// (remote, task, buffer) triples tracked at most.
const MAX_TRACKED: usize = 65_536;

/// One buffer read through one remote.
type RemoteKey = (String, String, u64);

#[derive(Debug)]
enum RemoteState {
    /// Failing since `since` (no answer, or NO_DATA). `checked`: when
    /// storage last said the buffer has no commit marker, so storage is
    /// asked at most once per `failover_after`.
    Failing {
        since: Instant,
        checked: Option<Instant>,
    },
    /// The producer lost this committed buffer: served from storage (and
    /// the remote no longer asked) until the consumer deletes it.
    Lost(Arc<CommitMarker>),
}

/// What the proxy consumer knows of remotes that fail to serve a buffer.
#[derive(Debug, Default)]
pub(super) struct RemoteWatch {
    states: Mutex<HashMap<RemoteKey, RemoteState>>,
}

impl RemoteWatch {
    fn lock(&self) -> MutexGuard<'_, HashMap<RemoteKey, RemoteState>> {
        self.states.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn key(remote: &str, request: &BinRequest) -> RemoteKey {
    (
        remote.to_string(),
        request.task_id.clone(),
        request.buffer_id,
    )
}

/// What to do with a failing buffer now.
enum Step {
    /// Keep failing (the client retries).
    Wait,
    /// Ask storage whether the buffer was committed.
    Check,
    Serve(Arc<CommitMarker>),
}

impl Exchange {
    /// Proxy consumer: the remote answered (other than NO_DATA), so it is
    /// not failing.
    pub(crate) fn remote_answered(&self, remote: &str, request: &BinRequest) {
        if self.inner.spool.is_none() {
            return;
        }
        let mut states = self.inner.remotes.lock();
        if let Some(RemoteState::Failing { .. }) = states.get(&key(remote, request)) {
            states.remove(&key(remote, request));
        }
    }

    /// Proxy consumer: the producer already lost this buffer, so the reply
    /// comes from storage without asking it.
    pub(crate) async fn lost_reply(&self, request: &BinRequest, remote: &str) -> Option<Reply> {
        let spool = self.inner.spool.clone()?;
        let marker = match self.inner.remotes.lock().get(&key(remote, request)) {
            Some(RemoteState::Lost(marker)) => marker.clone(),
            _ => return None,
        };
        Some(self.committed_reply(&spool, request, remote, &marker).await)
    }

    /// Proxy consumer: the remote did not answer a DATA, ACK or DELETE, or
    /// answered a DATA with NO_DATA. Once that has lasted `failover_after`
    /// and the buffer was committed to storage, the reply comes from
    /// storage. `None`: keep failing (the client retries, or takes the
    /// NO_DATA).
    pub(crate) async fn failover(&self, request: &BinRequest, remote: &str) -> Option<Reply> {
        let spool = self.inner.spool.clone()?;
        let key = key(remote, request);
        let every = spool.config().failover_after;
        let step = {
            let mut states = self.inner.remotes.lock();
            if states.len() >= MAX_TRACKED && !states.contains_key(&key) {
                // Forget failures no consumer has retried for a while.
                states.retain(|_, state| match state {
                    RemoteState::Failing { since, .. } => since.elapsed() < every * 10,
                    RemoteState::Lost(_) => true,
                });
                if states.len() >= MAX_TRACKED {
                    return None;
                }
            }
            let state = states.entry(key.clone()).or_insert(RemoteState::Failing {
                since: Instant::now(),
                checked: None,
            });
            match state {
                RemoteState::Lost(marker) => Step::Serve(marker.clone()),
                RemoteState::Failing { since, .. } if since.elapsed() < every => Step::Wait,
                RemoteState::Failing {
                    checked: Some(at), ..
                } if at.elapsed() < every => Step::Wait,
                RemoteState::Failing { checked, .. } => {
                    // Claimed now, so concurrent retries do not all ask.
                    *checked = Some(Instant::now());
                    Step::Check
                }
            }
        };
        let marker = match step {
            Step::Wait => return None,
            Step::Serve(marker) => marker,
            Step::Check => {
                let (task_id, buffer_id) = (&request.task_id, request.buffer_id);
                match spool.read_marker(task_id, buffer_id).await {
                    Ok(Some(marker)) => {
                        tracing::info!(task = %task_id, buffer = buffer_id, %remote, "producer lost a committed buffer; reading the committed buffer from storage");
                        let marker = Arc::new(marker);
                        self.inner
                            .remotes
                            .lock()
                            .insert(key, RemoteState::Lost(marker.clone()));
                        marker
                    }
                    Ok(None) => return None,
                    Err(e) => {
                        tracing::warn!(task = %task_id, buffer = buffer_id, error = %e, "cannot read a commit marker for failover");
                        return None;
                    }
                }
            }
        };
        Some(self.committed_reply(&spool, request, remote, &marker).await)
    }

    /// The reply to a DATA, ACK or DELETE of a committed buffer, from
    /// storage: DATA reads the marker's segments, ACK has nothing to free,
    /// DELETE removes the marker and the segments no other buffer lists.
    async fn committed_reply(
        &self,
        spool: &Arc<Spool>,
        request: &BinRequest,
        remote: &str,
        marker: &CommitMarker,
    ) -> Reply {
        let ok = || BinReply::to(request, Status::Ok);
        match request.message_type() {
            Ok(MessageType::Ack) => return Reply::new(ok()),
            Ok(MessageType::Delete) => {
                self.inner.remotes.lock().remove(&key(remote, request));
                spool.release_committed(marker).await;
                return Reply::new(ok());
            }
            _ => {}
        }
        let (task_id, buffer_id, token) = (&request.task_id, request.buffer_id, request.page_token);
        if token > marker.end_token {
            return Reply::new(BinReply::error(
                request,
                Status::BadRequest,
                format!(
                    "token {token} of buffer {buffer_id} of task {task_id} is beyond its end {} (commit marker)",
                    marker.end_token
                ),
            ));
        }
        let max = match request.max_size_bytes {
            0 => self.lock().config().default_reply_size,
            n => n,
        };
        let mut header = ok();
        header.page_token = token;
        header.page_next_token = token;
        let mut body = Vec::new();
        let mut segments: Vec<Segment> = Vec::new();
        let mut next = token;
        let mut total = 0u64;
        'segments: for segment in &marker.segments {
            let end = segment.first_token + segment.page_sizes.len() as u64;
            if end <= next {
                continue;
            }
            if request.get_data_size {
                let from = (next.saturating_sub(segment.first_token)) as usize;
                header
                    .remaining_bytes
                    .extend(segment.page_sizes.iter().skip(from));
                next = end;
                continue;
            }
            let pages = match spool.marker_object(segment) {
                Ok(object) => spool.read(&object).await,
                Err(e) => Err(e),
            };
            let pages = match pages {
                Ok(pages) => pages,
                Err(e) => {
                    return server_error(
                        request,
                        format!(
                            "DATA for buffer {buffer_id} of task {task_id} at token {token}, from storage: {e}"
                        ),
                    );
                }
            };
            let from = next.saturating_sub(segment.first_token) as usize;
            for page in pages.iter().skip(from) {
                let size = page.len() as u64;
                if next > token && total + size > max {
                    break 'segments;
                }
                push_inline(&mut segments, next, size);
                body.push(page.clone());
                total += size;
                next += 1;
            }
        }
        if !request.get_data_size {
            header.page_next_token = next;
            header.buffer_complete = next == marker.end_token;
            header.segments = segments;
        } else {
            header.buffer_complete = token == marker.end_token;
        }
        Reply { header, body }
    }
}
