//! Counters and gauges of the core, as `binx stats` and `/metrics` show them.

use binx_proto::{MessageType, Status};

/// A snapshot of what the core holds and has done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Bytes held for pages: the receive buffers they pin and their
    /// bookkeeping (what the process really retains for them).
    pub memory_used: u64,
    /// Bytes of the pages themselves held in memory (`memory_used` also
    /// counts the receive buffers they pin and their bookkeeping).
    pub page_bytes_held: u64,
    /// Highest `memory_used` since start.
    pub memory_high_water: u64,
    /// `memory_limit` as configured (bytes).
    pub memory_limit: u64,
    /// `task_memory_limit` as configured (bytes).
    pub task_memory_limit: u64,
    /// Bytes of request bodies held while their requests wait (for room,
    /// for storage, behind earlier requests of their connection).
    pub memory_pending: u64,
    /// Tasks held now.
    pub tasks: u64,
    /// Buffers held now.
    pub buffers: u64,
    /// Pages held in memory now.
    pub pages_buffered: u64,
    /// Pages accepted by ENQUEUE since start.
    pub pages_enqueued: u64,
    /// Bytes of the pages accepted by ENQUEUE since start.
    pub bytes_enqueued: u64,
    /// Pages dropped on arrival: their buffer was deleted or abandoned.
    pub pages_dropped: u64,
    /// Pages sent in DATA replies since start (a page sent again counts again).
    pub pages_served: u64,
    /// Bytes of the pages sent in DATA replies since start.
    pub bytes_served: u64,
    /// Pages moved from memory to storage (policy `overflow`).
    pub pages_spilled: u64,
    /// Spill writes in flight now.
    pub spills_in_flight: u64,
    /// ENQUEUE replies that said BUSY.
    pub busy_replies: u64,
    /// ENQUEUEs that had to wait for room (whether or not they then got BUSY).
    pub backpressure_waits: u64,
    /// Buffers dropped because no consumer polled them for `abandon_after`.
    pub abandoned_buffers: u64,
    /// Tasks ended by ABORT_TASK since start.
    pub tasks_aborted: u64,
    /// Requests waiting now (long-polls, ENQUEUEs waiting for room).
    pub requests_waiting: u64,
    /// Objects this daemon wrote that are still referenced.
    pub objects_held: u64,
    /// Object deletions asked for and not yet done.
    pub pending_deletes: u64,
    /// Object deletions left to the TTL pruner (the deletion queue was full,
    /// a marker could not be deleted, or too many DELETEs of forgotten
    /// tasks waited for their marker to be read).
    pub deletes_left_to_ttl: u64,
    /// Commit markers held (written or being written).
    pub markers: u64,
    /// Proxy consumer: DATA replies served from a commit marker.
    pub failover_replies: u64,
    /// Committed buffers of a run before a restart that a DELETE released
    /// (a task this process did not know, whose marker this node wrote).
    pub forgotten_releases: u64,
    /// Commit markers read (found or not) for DELETEs of tasks this process
    /// does not know.
    pub forgotten_markers_read: u64,
    /// Bytes of pages that were in storage too (a commit's, an `always`
    /// ENQUEUE's) and left memory, with no write: for room, or unread for
    /// the abandon time.
    pub bytes_evicted: u64,
    /// Proxy consumer: remotes seen to restart (another process instance
    /// in a HELLO reply at the same address); their buffers fail over at
    /// once for a while after.
    pub remote_restarts: u64,
    /// DATA requests pipelined behind another: their `ack_token` is below
    /// their `page_token` (docs/PROTOCOL.md section 8).
    pub data_pipelined: u64,
    /// ENQUEUE and NO_MORE_PAGES refused because their `append_token` was
    /// not the buffer's next token (docs/PROTOCOL.md section 9): sent
    /// behind one that was not applied, or repeating one that was.
    pub append_token_refusals: u64,
    /// Proxy consumer: requests refused because their remote is not in
    /// forward_allowed_peers.
    pub forwards_refused: u64,
    /// Proxy consumer: DATA of a buffer read from one process of a remote
    /// not sent to (or not served from) another process of it that answers
    /// now (a restart; a task of the same id there is another run).
    pub forwarded_runs_refused: u64,
    /// The daemon is stopping: no new task is accepted.
    pub draining: bool,
    /// Requests answered, by type and status (each pair once, in order).
    pub requests: Vec<ReplyCount>,
}

/// How many replies to one request type had one status. `None` stands for
/// a number outside the protocol's enums (a client's unknown type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyCount {
    /// The request type answered.
    pub kind: Option<MessageType>,
    /// The replies' status.
    pub status: Option<Status>,
    /// Replies since start.
    pub count: u64,
}

impl CoreStats {
    /// Adds another shard's figures: counts and gauges sum, the high water
    /// and the limits are the daemon's (every shard reports the same),
    /// draining is the daemon's too.
    pub fn add(&mut self, other: &CoreStats) {
        // Every field named, so a new one is added here or fails to build.
        let CoreStats {
            memory_used,
            page_bytes_held,
            memory_high_water,
            memory_limit,
            task_memory_limit,
            memory_pending,
            tasks,
            buffers,
            pages_buffered,
            pages_enqueued,
            bytes_enqueued,
            pages_dropped,
            pages_served,
            bytes_served,
            pages_spilled,
            spills_in_flight,
            busy_replies,
            backpressure_waits,
            abandoned_buffers,
            tasks_aborted,
            requests_waiting,
            objects_held,
            pending_deletes,
            deletes_left_to_ttl,
            markers,
            failover_replies,
            forgotten_releases,
            forgotten_markers_read,
            bytes_evicted,
            remote_restarts,
            data_pipelined,
            append_token_refusals,
            forwards_refused,
            forwarded_runs_refused,
            draining,
            requests,
        } = other;
        for (sum, add) in [
            (&mut self.memory_used, memory_used),
            (&mut self.page_bytes_held, page_bytes_held),
            (&mut self.memory_pending, memory_pending),
            (&mut self.tasks, tasks),
            (&mut self.buffers, buffers),
            (&mut self.pages_buffered, pages_buffered),
            (&mut self.pages_enqueued, pages_enqueued),
            (&mut self.bytes_enqueued, bytes_enqueued),
            (&mut self.pages_dropped, pages_dropped),
            (&mut self.pages_served, pages_served),
            (&mut self.bytes_served, bytes_served),
            (&mut self.pages_spilled, pages_spilled),
            (&mut self.spills_in_flight, spills_in_flight),
            (&mut self.busy_replies, busy_replies),
            (&mut self.backpressure_waits, backpressure_waits),
            (&mut self.abandoned_buffers, abandoned_buffers),
            (&mut self.tasks_aborted, tasks_aborted),
            (&mut self.requests_waiting, requests_waiting),
            (&mut self.objects_held, objects_held),
            (&mut self.pending_deletes, pending_deletes),
            (&mut self.deletes_left_to_ttl, deletes_left_to_ttl),
            (&mut self.markers, markers),
            (&mut self.failover_replies, failover_replies),
            (&mut self.forgotten_releases, forgotten_releases),
            (&mut self.forgotten_markers_read, forgotten_markers_read),
            (&mut self.bytes_evicted, bytes_evicted),
            (&mut self.remote_restarts, remote_restarts),
            (&mut self.data_pipelined, data_pipelined),
            (&mut self.append_token_refusals, append_token_refusals),
            (&mut self.forwards_refused, forwards_refused),
            (&mut self.forwarded_runs_refused, forwarded_runs_refused),
        ] {
            *sum += add;
        }
        self.memory_high_water = self.memory_high_water.max(*memory_high_water);
        self.memory_limit = self.memory_limit.max(*memory_limit);
        self.task_memory_limit = self.task_memory_limit.max(*task_memory_limit);
        self.draining |= draining;
        for count in requests {
            match self
                .requests
                .iter_mut()
                .find(|c| (c.kind, c.status) == (count.kind, count.status))
            {
                Some(same) => same.count += count.count,
                None => self.requests.push(*count),
            }
        }
    }
}
