//! Counters and gauges of the buffer manager, as `binx stats` shows them.

use serde::Serialize;

/// A snapshot of what the buffer manager holds and has done.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ManagerStats {
    /// Bytes of pages held now.
    pub memory_used: u64,
    /// Highest `memory_used` since start.
    pub memory_high_water: u64,
    pub memory_limit: u64,
    pub task_memory_limit: u64,
    pub tasks: u64,
    pub buffers: u64,
    pub pages_buffered: u64,
    pub pages_enqueued: u64,
    pub bytes_enqueued: u64,
    pub pages_served: u64,
    pub bytes_served: u64,
    /// Pages moved from memory to storage (policy `overflow`).
    pub pages_spilled: u64,
    /// ENQUEUE replies that said BUSY after waiting for room.
    pub busy_replies: u64,
    /// Buffers dropped because no consumer polled them for `abandon_after`.
    pub abandoned_buffers: u64,
    pub tasks_aborted: u64,
    /// The daemon is stopping: no new task is accepted.
    pub draining: bool,
    /// Requests answered, by type and status, as `"DATA OK"`.
    pub requests: std::collections::BTreeMap<String, u64>,
}
