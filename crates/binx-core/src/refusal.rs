//! Every reason binxd refuses a request: one variant each, its wire status
//! ([`Refusal::status`]) and the text the reply carries (`Display`).
//!
//! Texts say what was asked, why it cannot be done and what to do; they
//! name the task, buffer and token concerned. Tests match variants (built
//! with the same fields), never fragments of the text.

use std::time::Duration;

use binx_proto::{BufferKind, MessageType, SpoolPolicy, Status};

use crate::objects::StoreFailure;
use crate::task_id::TaskId;

/// Which request a refusal of an unknown or dropped task answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// ENQUEUE.
    Enqueue,
    /// NO_MORE_PAGES.
    NoMorePages,
}

impl std::fmt::Display for Mutation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mutation::Enqueue => "ENQUEUE",
            Mutation::NoMorePages => "NO_MORE_PAGES",
        })
    }
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    // --- The door: the connection and the request's shape. ---
    /// A TCP request before HELLO, where a shared secret is set.
    #[error(
        "this binxd requires a HELLO with the shared secret as the first request on a TCP connection"
    )]
    HelloFirst,
    /// HELLO with the wrong secret.
    #[error("HELLO auth_token does not match this binxd's shared secret")]
    WrongSecret,
    /// The listener will not serve this connection (a limit, a peer not allowed).
    #[error("{reason}")]
    ConnectionRefused {
        /// The listener's status.
        status: Status,
        /// The listener's reason.
        reason: String,
    },
    /// A message type this binxd does not know.
    #[error(
        "unknown message type {number}; this binxd speaks BinX 1.2 (docs/PROTOCOL.md section 3)"
    )]
    UnknownMessageType {
        /// The number received.
        number: i32,
    },
    /// A local-only request over TCP.
    #[error("{} is a local request: send it over the Unix socket, not TCP", .kind.name())]
    LocalOnly {
        /// The request's type.
        kind: MessageType,
    },
    /// A `remote` in a request over TCP.
    #[error(
        "{} names remote {remote:?}: only local clients on the Unix socket may ask for forwarding",
        .kind.name()
    )]
    RemoteOverTcp {
        /// The request's type.
        kind: MessageType,
        /// The remote named (cut to 64 bytes).
        remote: String,
    },
    /// A `remote` in a request other than DATA, ACK and DELETE.
    #[error("only DATA, ACK and DELETE may name a remote; this {} names {remote:?}", .kind.name())]
    RemoteNotForThisRequest {
        /// The request's type.
        kind: MessageType,
        /// The remote named (cut to 64 bytes).
        remote: String,
    },
    /// A request field that does not parse (a task id, a remote).
    #[error("{0}")]
    BadField(String),
    /// A pipelined DATA acknowledging the page it asks for, or later ones.
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}: ack_token {ack} is above page_token; a pipelined DATA acknowledges only pages below the one it asks for"
    )]
    AckAboveToken {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// The ack_token sent.
        ack: u64,
    },
    /// OPEN_TASK with a buffer kind this binxd does not know.
    #[error("OPEN_TASK for task {task}: unknown buffer_kind {number}")]
    UnknownBufferKind {
        /// The task.
        task: TaskId,
        /// The number received.
        number: i32,
    },
    /// OPEN_TASK with a spool policy that does not parse.
    #[error("OPEN_TASK for task {task}: {why}")]
    BadSpoolPolicy {
        /// The task.
        task: TaskId,
        /// What the policy parser said.
        why: String,
    },
    /// SHM_ATTACH anywhere but first on a Unix socket with shared memory on.
    #[error("{0}")]
    ShmAttachMisplaced(&'static str),
    /// Memory is full and the connection already has an ENQUEUE waiting.
    #[error(
        "memory is full and an earlier ENQUEUE on this connection is still waiting for room; nothing of this one was stored, retry it"
    )]
    MemoryFullBehindWaiting,
    /// A `remote` where this binxd does not forward.
    #[error("{} names remote {remote:?}, but this binxd does not forward", .kind.name())]
    DoesNotForward {
        /// The request's type.
        kind: MessageType,
        /// The remote named (cut to 64 bytes).
        remote: String,
    },
    /// Too many requests outstanding on the connection.
    #[error(
        "{limit} requests are outstanding on this connection, the limit (max_outstanding_requests); retry when some are answered"
    )]
    TooManyOutstanding {
        /// The limit.
        limit: usize,
    },

    // --- Tasks and buffers: what is known, what ended. ---
    /// The task was aborted.
    #[error("task {task} was aborted: {reason}")]
    Aborted {
        /// The task.
        task: TaskId,
        /// The ABORT_TASK's reason.
        reason: String,
    },
    /// A producer's request for a task binxd dropped as abandoned.
    #[error(
        "{what} for task {task}: binxd dropped that task as abandoned (a consumer stopped polling its buffer, or no producer and no consumer touched the task, for {after:?}, and every other buffer was deleted); nothing was stored, and its consumers see it as abandoned"
    )]
    ProducerOfDroppedTask {
        /// The request.
        what: Mutation,
        /// The task.
        task: TaskId,
        /// The abandon time.
        after: Duration,
    },
    /// A consumer's request for a task binxd dropped as abandoned.
    #[error(
        "task {task} was dropped as abandoned (nobody read or wrote it for the abandon time); its pages are gone, so the buffer is incomplete"
    )]
    TaskAbandoned {
        /// The task.
        task: TaskId,
    },
    /// A buffer binxd dropped as abandoned.
    #[error(
        "buffer {buffer} of task {task} was dropped as abandoned: no consumer polled it for {after:?}; its pages are gone, so it is incomplete"
    )]
    BufferAbandoned {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The abandon time.
        after: Duration,
    },
    /// ENQUEUE for a task binxd does not know.
    #[error(
        "ENQUEUE for task {task}, which this binxd does not know: it was never opened (send OPEN_TASK first), or it ended more than {after:?} ago (abandon_after)"
    )]
    EnqueueUnknownTask {
        /// The task.
        task: TaskId,
        /// How long ended tasks are remembered.
        after: Duration,
    },
    /// NO_MORE_PAGES for a task binxd does not know.
    #[error(
        "NO_MORE_PAGES for task {task}, which this binxd does not know: it was never opened, or it ended more than {after:?} ago (abandon_after)"
    )]
    NoMorePagesUnknownTask {
        /// The task.
        task: TaskId,
        /// How long ended tasks are remembered.
        after: Duration,
    },
    /// ACK past token 0 for a task binxd does not know.
    #[error(
        "ACK at token {token} for buffer {buffer} of task {task}, which this binxd does not know (beyond the next token, 0)"
    )]
    AckUnknownTask {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token acknowledged.
        token: u64,
    },
    /// A durable ENQUEUE whose task ended while its pages were written.
    #[error("ENQUEUE for task {task}, which is no longer open")]
    TaskNoLongerOpen {
        /// The task.
        task: TaskId,
    },
    /// A buffer id past the task's fixed buffer count.
    #[error("buffer_id {buffer} is at or above the buffer_count {count} of task {task}")]
    BufferBeyondCount {
        /// The task.
        task: TaskId,
        /// The buffer asked for.
        buffer: u64,
        /// The task's buffer count.
        count: u64,
    },
    /// A new buffer past the limit per task.
    #[error("task {task} already has {limit} buffers, the limit per task")]
    TooManyBuffers {
        /// The task.
        task: TaskId,
        /// max_buffers_per_task.
        limit: u64,
    },
    /// A token below what the consumer acknowledged.
    #[error(
        "token {token} of buffer {buffer} of task {task} is below its acknowledged mark {mark}: those pages were freed"
    )]
    TokenBelowMark {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// The acknowledged mark.
        mark: u64,
    },
    /// A token past the next one to be produced.
    #[error(
        "token {token} of buffer {buffer} of task {task} is beyond the next token to be produced ({next})"
    )]
    TokenBeyondNext {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// The next token.
        next: u64,
    },

    // --- OPEN_TASK. ---
    /// A spooling policy on a binxd with no store.
    #[error(
        "OPEN_TASK for task {task}: spool policy \"{policy}\" needs a spool store, and this binxd has none configured"
    )]
    NeedsSpoolStore {
        /// The task.
        task: TaskId,
        /// The policy asked for.
        policy: SpoolPolicy,
    },
    /// A committing policy the store cannot serve.
    #[error("OPEN_TASK for task {task}: {why}")]
    CommitUnavailable {
        /// The task.
        task: TaskId,
        /// Why the store cannot commit.
        why: String,
    },
    /// A buffer count past the limit per task.
    #[error(
        "OPEN_TASK for task {task}: buffer_count {count} exceeds the limit of {limit} buffers per task"
    )]
    BufferCountOverLimit {
        /// The task.
        task: TaskId,
        /// The count asked for.
        count: u64,
        /// max_buffers_per_task.
        limit: u64,
    },
    /// A second OPEN_TASK that differs from the first.
    #[error(
        "OPEN_TASK for task {task}: already open as {} with buffer_count {count} and spool policy {policy}",
        .kind.name()
    )]
    AlreadyOpen {
        /// The task.
        task: TaskId,
        /// Its kind.
        kind: BufferKind,
        /// Its buffer count (0: open).
        count: u64,
        /// Its policy.
        policy: SpoolPolicy,
    },
    /// OPEN_TASK for a task id that ended.
    #[error("OPEN_TASK for task {task}: that task {how}; task ids cannot be reused")]
    TaskIdReused {
        /// The task.
        task: TaskId,
        /// How it ended ("already finished", "was aborted (..)").
        how: String,
    },
    /// OPEN_TASK while the daemon drains.
    #[error(
        "OPEN_TASK for task {task}: this binxd is draining before it stops and takes no new tasks"
    )]
    Draining {
        /// The task.
        task: TaskId,
    },

    // --- ENQUEUE and NO_MORE_PAGES. ---
    /// More pages than one ENQUEUE may carry.
    #[error(
        "ENQUEUE for buffer {buffer} of task {task} carries {count} pages; the limit is {limit} (max_pages_per_enqueue): send them in several ENQUEUEs"
    )]
    TooManyPages {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// Pages sent.
        count: usize,
        /// max_pages_per_enqueue.
        limit: usize,
    },
    /// Page sizes that do not add up to the body.
    #[error("ENQUEUE for buffer {buffer} of task {task}: {why}")]
    BadPages {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// What the page split said.
        why: String,
    },
    /// ENQUEUE into a task that received NO_MORE_PAGES.
    #[error("ENQUEUE refused: task {task} is finished (NO_MORE_PAGES was received)")]
    TaskFinished {
        /// The task.
        task: TaskId,
    },
    /// ENQUEUE into a partitioned buffer that received NO_MORE_PAGES.
    #[error(
        "ENQUEUE refused: buffer {buffer} of task {task} is finished (NO_MORE_PAGES was received)"
    )]
    BufferFinished {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
    },
    /// An ENQUEUE whose pages and their index slots exceed the memory limit.
    #[error(
        "ENQUEUE of {size} bytes in {pages} pages for buffer {buffer} of task {task} can never fit the memory limit of {limit} bytes (with {slots} bytes for the pages' slots in the buffer's index)"
    )]
    NeverFits {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The body's bytes.
        size: u64,
        /// Its pages.
        pages: u64,
        /// What the pages' slots in the buffer's index take at least.
        slots: u64,
        /// The smaller of the memory limits.
        limit: u64,
    },
    /// A buffer holding max_pages_per_buffer pages.
    #[error(
        "no room for {count} more pages in buffer {buffer} of task {task}: it holds {limit} (max_pages_per_buffer) until its consumer acknowledges some; nothing was stored, retry later"
    )]
    BufferFull {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// Pages sent.
        count: u64,
        /// max_pages_per_buffer.
        limit: u64,
    },
    /// No memory for the pages within the wait.
    #[error(
        "no room for {size} bytes for buffer {buffer} of task {task}: the daemon holds {used} of {limit} bytes, the task {task_used} of {task_limit}; nothing was stored, retry later"
    )]
    NoRoom {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The body's bytes.
        size: u64,
        /// Bytes the daemon holds.
        used: u64,
        /// memory_limit.
        limit: u64,
        /// Bytes the task holds.
        task_used: u64,
        /// task_memory_limit.
        task_limit: u64,
    },
    /// Under `always`, a write of the same task still going on.
    #[error(
        "ENQUEUE for buffer {buffer} of task {task} (policy always): an earlier write of this task is still going on; nothing was stored, retry later"
    )]
    DurableWriteBusy {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
    },
    /// Under `always`, the write of the pages failed.
    #[error("{}", durable_write_failed(.task, *.buffer, .failure))]
    DurableWriteFailed {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// What the store said.
        failure: StoreFailure,
    },
    /// Under `always`, the buffer moved while the pages were written.
    #[error(
        "ENQUEUE for buffer {buffer} of task {task}: pages were written for token {written} but the buffer moved to {next}; nothing was stored, retry"
    )]
    DurableWriteMoved {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// Token the pages were written for.
        written: u64,
        /// The buffer's next token now.
        next: u64,
    },
    /// A queued request behind one that was not applied.
    #[error(
        "an earlier {} on this connection (request {cause_id}) was not applied, so this one was not either; nothing was stored, resend from there",
        .cause.name()
    )]
    BehindUnapplied {
        /// The request that was not applied.
        cause: MessageType,
        /// Its id.
        cause_id: u64,
    },
    /// An `append_token` that is not the buffer's next token.
    #[error("{}", misnumbered(.what, .task, *.buffer, *.wanted, *.next))]
    Misnumbered {
        /// The request.
        what: Mutation,
        /// The task.
        task: TaskId,
        /// The buffer (`None`: NO_MORE_PAGES for the whole task).
        buffer: Option<u64>,
        /// The append_token sent.
        wanted: u64,
        /// The buffer's next token.
        next: u64,
    },
    /// A numbered NO_MORE_PAGES for every buffer of a partitioned task.
    #[error(
        "NO_MORE_PAGES for every buffer of partitioned task {task} names an append_token, but each buffer ends at its own: finish each buffer with its own append_token, or send this one without"
    )]
    NumberedEndOfPartitioned {
        /// The task.
        task: TaskId,
    },
    /// Under `commit`, spilling the finished pages failed for now.
    #[error(
        "NO_MORE_PAGES for {} of task {task}: the buffer is finished, but writing its pages to storage failed ({failure}); retry",
        which(*.buffer)
    )]
    CommitSpillFailed {
        /// The task.
        task: TaskId,
        /// The buffer (`None`: every buffer).
        buffer: Option<u64>,
        /// What the store said to the spill that failed last.
        failure: StoreFailure,
    },
    /// A commit marker could not be written.
    #[error(
        "NO_MORE_PAGES for buffer {buffer} of task {task}: the buffer is finished, but its commit marker could not be written; retry: {failure}"
    )]
    MarkerWriteFailed {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// What the store said.
        failure: StoreFailure,
    },
    /// The commit manifest could not be written.
    #[error(
        "NO_MORE_PAGES for task {task}: every buffer is committed, but the task's commit manifest could not be written; retry: {failure}"
    )]
    ManifestWriteFailed {
        /// The task.
        task: TaskId,
        /// What the store said.
        failure: StoreFailure,
    },

    // --- DATA. ---
    /// A buffer of a finished open broadcast set that was never in it.
    #[error(
        "buffer {buffer} of broadcast task {task} is not part of its buffer set: the task finished (NO_MORE_PAGES closed the set, and every buffer in it was deleted)"
    )]
    NotInFinishedBroadcastSet {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
    },
    /// A buffer asked for after its broadcast set closed.
    #[error(
        "buffer {buffer} of broadcast task {task} is not part of its buffer set, which NO_MORE_PAGES closed before a consumer asked for it"
    )]
    NotInClosedBroadcastSet {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
    },
    /// DATA past token 0 of a buffer with no page.
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}, but that buffer has no page yet (expected token 0)"
    )]
    NoPageYet {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
    },
    /// A page whose object the core no longer knows (a broken invariant).
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}: a page's spooled object is no longer known"
    )]
    PageObjectUnknown {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
    },
    /// A page neither in memory nor in storage (a broken invariant).
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}: a page is neither in memory nor in storage"
    )]
    PageNowhere {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
    },

    // --- Forwarding and failover. ---
    /// A `remote` on a request the proxy does not carry.
    #[error("only DATA, ACK and DELETE may name a remote")]
    NotForwardable,
    /// A remote outside forward_allowed_peers.
    #[error(
        "remote {remote} is not in this binxd's forward_allowed_peers ({allowed}); nothing was sent to it"
    )]
    RemoteNotAllowed {
        /// The remote named.
        remote: String,
        /// The allow-list, as configured.
        allowed: String,
    },
    /// No reply from the remote.
    #[error("no reply from remote {remote} for buffer {buffer} of task {task}: {reason}; retry")]
    RemoteSilent {
        /// The remote (cut to 64 bytes).
        remote: String,
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// What the forwarder saw.
        reason: String,
    },
    /// A forwarded DATA of a buffer read from one process of the remote's
    /// binxd, when another process answers there now: the remote
    /// restarted, the buffer went with the earlier process, and storage
    /// has no commit marker of it. The new process is not asked, or its
    /// answer not passed on: it may hold a task of the same id again, whose
    /// pages would join those read (a buffer of two runs).
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}: remote {remote} restarted (process {was}, now {now}) after this buffer was read from it; the buffer went with the earlier process and storage has no commit marker of it; pages of the new process (another run of the task id) are never served for it"
    )]
    RemoteRunChanged {
        /// The remote (cut to 64 bytes).
        remote: String,
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// The process the buffer's earlier replies came from.
        was: String,
        /// The process that answered now.
        now: String,
    },
    /// As [`Refusal::RemoteRunChanged`], while whether storage has the
    /// buffer's commit marker is not known yet (it is looked for at most
    /// once per `spool_failover_after`, or could not be read): retry.
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}: remote {remote} restarted (process {was}, now {now}) after this buffer was read from it, and the buffer went with the earlier process; its commit marker is looked for in storage (at most once per spool_failover_after): retry"
    )]
    RemoteRestartedMarkerUnknown {
        /// The remote (cut to 64 bytes).
        remote: String,
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// The process the buffer's earlier replies came from.
        was: String,
        /// The process that answers now.
        now: String,
    },
    /// No reply from the remote to a DELETE_TASK.
    #[error(
        "no reply from remote {remote} for DELETE_TASK of task {task}: {reason}; retry, or delete the task's buffers one at a time (DELETE), which fail over to storage"
    )]
    RemoteSilentForTask {
        /// The remote (cut to 64 bytes).
        remote: String,
        /// The task.
        task: TaskId,
        /// What the forwarder saw.
        reason: String,
    },
    /// A token past a committed buffer's end.
    #[error(
        "token {token} of buffer {buffer} of task {task} is beyond its end {end} (commit marker)"
    )]
    BeyondMarkerEnd {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// The marker's end token.
        end: u64,
    },
    /// A commit marker with a hole.
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}, from storage: the commit marker has no segment for token {missing}"
    )]
    MarkerGap {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// The first token no segment holds.
        missing: u64,
    },
    /// A commit marker whose segments end before its end token.
    #[error(
        "DATA for buffer {buffer} of task {task} at token {token}, from storage: the commit marker covers tokens up to {covered} of {end}"
    )]
    MarkerShort {
        /// The task.
        task: TaskId,
        /// The buffer.
        buffer: u64,
        /// The token asked for.
        token: u64,
        /// Where its segments end.
        covered: u64,
        /// The marker's end token.
        end: u64,
    },

    // --- COMMITTED. ---
    /// COMMITTED on a binxd with no store.
    #[error(
        "COMMITTED for task {task}: this binxd has no spool store, so nothing is committed through it"
    )]
    CommittedWithoutStore {
        /// The task.
        task: TaskId,
    },
    /// A manifest listing more buffers than the limit.
    #[error(
        "COMMITTED for task {task}: its manifest lists {count} buffers, more than max_buffers_per_task ({limit})"
    )]
    ManifestTooLarge {
        /// The task.
        task: TaskId,
        /// Buffers listed.
        count: usize,
        /// max_buffers_per_task.
        limit: u64,
    },
    /// COMMITTED from past the last buffer.
    #[error("COMMITTED for task {task} from buffer {from}: the task has {count} buffers")]
    CommittedBeyondBuffers {
        /// The task.
        task: TaskId,
        /// The first buffer asked for.
        from: u64,
        /// The task's buffers.
        count: u64,
    },
    /// DELETE_TASK with `buffer_count` 0.
    #[error(
        "DELETE_TASK for task {task} names no buffer: buffer_count says how many, from buffer 0, are deleted"
    )]
    NoBuffersToDelete {
        /// The task.
        task: TaskId,
    },
    /// DELETE_TASK of more buffers than a task may have, or than it has.
    #[error("DELETE_TASK for task {task} names {buffers} buffers, but {why}: nothing was deleted")]
    DeleteTaskTooWide {
        /// The task.
        task: TaskId,
        /// Buffers named.
        buffers: u64,
        /// The limit it passed.
        why: String,
    },
    /// DELETE_TASK through a sidecar that reads some of the task's buffers
    /// from storage since their producer failed: only DELETEs of one buffer
    /// each release those.
    #[error(
        "DELETE_TASK for task {task} at {remote}: buffer {buffer} is served from storage here since that sidecar failed; delete the task's buffers one at a time (DELETE)"
    )]
    DeleteTaskFailingOver {
        /// The task.
        task: TaskId,
        /// The remote named.
        remote: String,
        /// A buffer failing over.
        buffer: u64,
    },
    /// The manifest cannot be read now.
    #[error(
        "COMMITTED for task {task}: its manifest cannot be read from storage now; retry: {why}"
    )]
    ManifestUnavailable {
        /// The task.
        task: TaskId,
        /// What the store said.
        why: String,
    },
    /// The manifest does not pass its checks.
    #[error("COMMITTED for task {task}: its manifest is not valid: {why}")]
    ManifestInvalid {
        /// The task.
        task: TaskId,
        /// What is wrong with it.
        why: String,
    },

    /// A request that reached a handler not meant for it (a broken
    /// invariant: `debug_assert!`ed where it is built).
    #[error("{0} reached the wrong handler")]
    Misrouted(&'static str),
}

impl Refusal {
    /// The reply status: BAD_REQUEST when sending the same again cannot
    /// work, BUSY when it may later, SERVER_ERROR when the data is gone or
    /// binxd failed, UNAUTHENTICATED, TIMEOUT for a silent remote.
    pub fn status(&self) -> Status {
        use Refusal::*;
        match self {
            HelloFirst | WrongSecret => Status::Unauthenticated,
            ConnectionRefused { status, .. } => *status,
            MemoryFullBehindWaiting
            | TooManyOutstanding { .. }
            | BufferFull { .. }
            | NoRoom { .. }
            | DurableWriteBusy { .. }
            | BehindUnapplied { .. }
            | CommitSpillFailed { .. }
            | MarkerWriteFailed { .. }
            | ManifestWriteFailed { .. }
            | ManifestUnavailable { .. } => Status::Busy,
            DurableWriteFailed { failure, .. } if failure.transient => Status::Busy,
            DurableWriteFailed { .. }
            | Aborted { .. }
            | ProducerOfDroppedTask { .. }
            | TaskAbandoned { .. }
            | BufferAbandoned { .. }
            | Draining { .. }
            | DurableWriteMoved { .. }
            | PageObjectUnknown { .. }
            | PageNowhere { .. }
            | MarkerGap { .. }
            | MarkerShort { .. }
            | RemoteRunChanged { .. }
            | ManifestTooLarge { .. }
            | ManifestInvalid { .. }
            | Misrouted(_) => Status::ServerError,
            RemoteSilent { .. }
            | RemoteSilentForTask { .. }
            | RemoteRestartedMarkerUnknown { .. } => Status::Timeout,
            UnknownMessageType { .. }
            | LocalOnly { .. }
            | RemoteOverTcp { .. }
            | RemoteNotForThisRequest { .. }
            | BadField(_)
            | AckAboveToken { .. }
            | UnknownBufferKind { .. }
            | BadSpoolPolicy { .. }
            | ShmAttachMisplaced(_)
            | DoesNotForward { .. }
            | EnqueueUnknownTask { .. }
            | NoMorePagesUnknownTask { .. }
            | AckUnknownTask { .. }
            | TaskNoLongerOpen { .. }
            | BufferBeyondCount { .. }
            | TooManyBuffers { .. }
            | TokenBelowMark { .. }
            | TokenBeyondNext { .. }
            | NeedsSpoolStore { .. }
            | CommitUnavailable { .. }
            | BufferCountOverLimit { .. }
            | AlreadyOpen { .. }
            | TaskIdReused { .. }
            | TooManyPages { .. }
            | BadPages { .. }
            | TaskFinished { .. }
            | BufferFinished { .. }
            | NeverFits { .. }
            | Misnumbered { .. }
            | NumberedEndOfPartitioned { .. }
            | NotInFinishedBroadcastSet { .. }
            | NotInClosedBroadcastSet { .. }
            | NoPageYet { .. }
            | NotForwardable
            | RemoteNotAllowed { .. }
            | BeyondMarkerEnd { .. }
            | CommittedWithoutStore { .. }
            | CommittedBeyondBuffers { .. }
            | NoBuffersToDelete { .. }
            | DeleteTaskTooWide { .. }
            | DeleteTaskFailingOver { .. } => Status::BadRequest,
        }
    }

    /// Whether `error` (a reply's text) is this refusal's: tests compare
    /// replies against the variant they expect.
    pub fn is(&self, status: i32, error: &str) -> bool {
        self.status() as i32 == status && crate::request::cap_error(self.to_string()) == error
    }
}

fn which(buffer: Option<u64>) -> String {
    buffer.map_or("every buffer".to_string(), |b| format!("buffer {b}"))
}

fn durable_write_failed(task: &TaskId, buffer: u64, failure: &StoreFailure) -> String {
    if failure.transient {
        format!(
            "ENQUEUE for buffer {buffer} of task {task} (policy always): writing to storage failed, nothing was stored; retry later: {failure}"
        )
    } else {
        // Asking again would fail the same way: the producer learns it now
        // instead of retrying until it gives up.
        format!(
            "ENQUEUE for buffer {buffer} of task {task} (policy always): the store refused the write, and retrying will not help; nothing was stored: {failure}"
        )
    }
}

fn misnumbered(
    what: &Mutation,
    task: &TaskId,
    buffer: Option<u64>,
    wanted: u64,
    next: u64,
) -> String {
    let what = match (what, buffer) {
        (Mutation::Enqueue, b) => format!(
            "ENQUEUE for buffer {} of task {task} names append_token {wanted}",
            b.unwrap_or(0)
        ),
        (Mutation::NoMorePages, Some(b)) => {
            format!("NO_MORE_PAGES for buffer {b} of task {task} names append_token {wanted}")
        }
        (Mutation::NoMorePages, None) => {
            format!("NO_MORE_PAGES for task {task} names append_token {wanted}")
        }
    };
    let why = if next < wanted {
        format!(
            "the buffer's next page gets token {next}: an earlier ENQUEUE of it was not applied; nothing was stored, resend from token {next}"
        )
    } else {
        format!(
            "the buffer's next page gets token {next}: tokens up to {next} are taken (an earlier copy of this request was applied, or the pages were numbered wrong); nothing was stored"
        )
    };
    format!("{what}, but {why}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> TaskId {
        TaskId::parse("q.0.0").expect("a valid task id")
    }

    #[test]
    fn busy_means_retry_and_bad_request_means_do_not() {
        let busy = Refusal::NoRoom {
            task: task(),
            buffer: 1,
            size: 10,
            used: 5,
            limit: 8,
            task_used: 0,
            task_limit: 8,
        };
        assert_eq!(busy.status(), Status::Busy);
        assert!(busy.to_string().contains("retry later"));
        let bad = Refusal::TooManyBuffers {
            task: task(),
            limit: 3,
        };
        assert_eq!(bad.status(), Status::BadRequest);
        assert_eq!(
            bad.to_string(),
            "task q.0.0 already has 3 buffers, the limit per task"
        );
    }

    #[test]
    fn a_durable_write_failure_is_busy_only_when_it_may_pass_later() {
        let failed = |failure| Refusal::DurableWriteFailed {
            task: task(),
            buffer: 2,
            failure,
        };
        let transient = failed(StoreFailure::transient("503"));
        let permanent = failed(StoreFailure::permanent("403"));
        assert_eq!(transient.status(), Status::Busy);
        assert_eq!(permanent.status(), Status::ServerError);
        assert!(transient.to_string().ends_with("retry later: 503"));
        assert!(permanent.to_string().contains("retrying will not help"));
    }

    #[test]
    fn a_misnumbered_request_says_where_to_resend_from() {
        let gap = Refusal::Misnumbered {
            what: Mutation::Enqueue,
            task: task(),
            buffer: Some(4),
            wanted: 9,
            next: 7,
        };
        assert_eq!(
            gap.to_string(),
            "ENQUEUE for buffer 4 of task q.0.0 names append_token 9, but the buffer's next page gets token 7: an earlier ENQUEUE of it was not applied; nothing was stored, resend from token 7"
        );
        let copy = Refusal::Misnumbered {
            what: Mutation::NoMorePages,
            task: task(),
            buffer: None,
            wanted: 3,
            next: 7,
        };
        assert!(
            copy.to_string()
                .starts_with("NO_MORE_PAGES for task q.0.0 names append_token 3, but")
        );
        assert!(copy.to_string().contains("tokens up to 7 are taken"));
    }

    #[test]
    fn is_matches_the_status_and_the_whole_text() {
        let r = Refusal::TaskFinished { task: task() };
        let text = r.to_string();
        assert!(r.is(Status::BadRequest as i32, &text));
        assert!(!r.is(Status::Busy as i32, &text));
        assert!(!r.is(Status::BadRequest as i32, &text[..text.len() - 1]));
    }
}
