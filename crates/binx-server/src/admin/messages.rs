//! The admin service's messages, derived by hand with prost (no protoc).
//! The `.proto` they match is in docs/ADMIN.md.

use std::collections::BTreeMap;

/// `ListTasks`: every open task whose id starts with the prefix ("" for all).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListTasksRequest {
    #[prost(string, tag = "1")]
    pub task_id_prefix: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListTasksReply {
    #[prost(message, repeated, tag = "1")]
    pub tasks: Vec<TaskInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TaskInfo {
    #[prost(string, tag = "1")]
    pub task_id: String,
    /// "PARTITIONED", "BROADCAST" or "ARBITRARY".
    #[prost(string, tag = "2")]
    pub kind: String,
    /// "off", "overflow" or "always".
    #[prost(string, tag = "3")]
    pub spool_policy: String,
    /// Fixed number of buffers; 0 when buffers are added as consumers come.
    #[prost(uint64, tag = "4")]
    pub buffer_count: u64,
    #[prost(bool, tag = "5")]
    pub input_finished: bool,
    /// Bytes of pages held (a broadcast page counts once).
    #[prost(uint64, tag = "6")]
    pub memory_bytes: u64,
    #[prost(uint64, tag = "7")]
    pub idle_millis: u64,
    #[prost(message, repeated, tag = "8")]
    pub buffers: Vec<BufferInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BufferInfo {
    #[prost(uint64, tag = "1")]
    pub buffer_id: u64,
    /// "open", "finished", "complete" or "deleted".
    #[prost(string, tag = "2")]
    pub state: String,
    #[prost(uint64, tag = "3")]
    pub acknowledged_token: u64,
    #[prost(uint64, tag = "4")]
    pub next_token: u64,
    #[prost(uint64, tag = "5")]
    pub pages_held: u64,
    #[prost(uint64, tag = "6")]
    pub bytes_held: u64,
    /// Since a consumer last polled it.
    #[prost(uint64, tag = "7")]
    pub idle_millis: u64,
}

/// `AbortTask`: as a producer's ABORT_TASK; consumers see the reason.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AbortTaskRequest {
    #[prost(string, tag = "1")]
    pub task_id: String,
    #[prost(string, tag = "2")]
    pub reason: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AbortTaskReply {
    #[prost(uint64, tag = "1")]
    pub freed_bytes: u64,
}

/// `StartDrain`: what SIGTERM does (readiness false, no new tasks, serve
/// held pages, then stop).
#[derive(Clone, PartialEq, prost::Message)]
pub struct StartDrainRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StartDrainReply {
    /// Pages held when the drain started.
    #[prost(uint64, tag = "1")]
    pub pages_held: u64,
    #[prost(bool, tag = "2")]
    pub already_draining: bool,
}

/// `SetLogLevel`: a tracing filter such as "debug" or "info,binx_server=trace".
#[derive(Clone, PartialEq, prost::Message)]
pub struct SetLogLevelRequest {
    #[prost(string, tag = "1")]
    pub filter: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SetLogLevelReply {
    #[prost(string, tag = "1")]
    pub previous: String,
}

/// `GetStats`: the counters and gauges of `/v1/stats`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GetStatsRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetStatsReply {
    /// Every numeric counter and gauge by name (bytes, pages, connections...).
    #[prost(btree_map = "string, uint64", tag = "1")]
    pub values: BTreeMap<String, u64>,
    /// Replies by "TYPE STATUS", e.g. "DATA OK".
    #[prost(btree_map = "string, uint64", tag = "2")]
    pub requests: BTreeMap<String, u64>,
    #[prost(bool, tag = "3")]
    pub draining: bool,
}
