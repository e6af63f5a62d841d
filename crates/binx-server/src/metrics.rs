//! Every metric binxd exports, defined once. [`STATS`] names each counter
//! and gauge (its `/v1/stats` key, its Prometheus name, help and unit);
//! `/metrics` (OpenMetrics text, encoded by `prometheus-client`), `/v1/stats`
//! (JSON) and the admin `GetStats` are all rendered from it and from the
//! typed reply counts, so they cannot drift apart. Request latency and
//! reply sizes are histograms by request type, fed without a lock
//! ([`crate::histogram`]) and encoded by `prometheus-client`.
//!
//! Why `prometheus-client` and not `metrics` + its exporter: it has no
//! global recorder (tests and benches run several exchanges in one
//! process), it encodes units and OpenMetrics' `# UNIT` lines, and its
//! `Collector` reads a snapshot at scrape time, which is how binxd's
//! numbers live (in the core, not in scattered atomics).

use std::fmt;
use std::time::Duration;

use binx_proto::{MessageType, Status};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, LabelSetEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::registry::{Registry, Unit};

use crate::histogram::{HistogramReading, HistogramsByType};
use crate::stats::ExchangeStats;

/// Whether a value only grows (a counter) or goes up and down (a gauge).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatKind {
    /// Only grows (exposed with `_total`).
    Counter,
    /// Goes up and down.
    Gauge,
}

/// What a value counts, as far as formatting it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatUnit {
    /// Bytes (`_bytes`).
    Bytes,
    /// Seconds (`_seconds`).
    Seconds,
    /// Pages, requests, connections...: a plain number.
    Count,
}

impl StatUnit {
    /// The unit's name as `GetStats` carries it ("" for a plain count).
    pub fn as_str(self) -> &'static str {
        match self {
            StatUnit::Bytes => "bytes",
            StatUnit::Seconds => "seconds",
            StatUnit::Count => "",
        }
    }

    fn prometheus(self) -> Option<&'static Unit> {
        match self {
            StatUnit::Bytes => Some(&Unit::Bytes),
            StatUnit::Seconds => Some(&Unit::Seconds),
            StatUnit::Count => None,
        }
    }
}

/// One counter or gauge.
pub struct StatDef {
    /// Its key in `/v1/stats` (inside `group` when set) and, as
    /// `group_key`, in `GetStats`.
    pub key: &'static str,
    /// The JSON object it sits in (`spool`), if any.
    pub group: Option<&'static str>,
    /// Its Prometheus name without the unit and `_total` suffixes, which
    /// the encoder adds (`binx_enqueued` + bytes + counter =
    /// `binx_enqueued_bytes_total`).
    pub name: &'static str,
    /// Its help text (`# HELP`).
    pub help: &'static str,
    /// What it counts.
    pub unit: StatUnit,
    /// Counter or gauge.
    pub kind: StatKind,
    /// Its value, or None when it does not apply (no spool configured).
    pub read: fn(&ExchangeStats) -> Option<u64>,
}

impl StatDef {
    /// The flat key `GetStats` uses: `spool_objects_spooled`, `tasks`.
    pub fn flat_key(&self) -> String {
        match self.group {
            Some(group) => format!("{group}_{}", self.key),
            None => self.key.to_string(),
        }
    }
}

macro_rules! stats {
    ($( $group:ident . $key:ident : $kind:ident $unit:ident $name:literal $help:literal = |$s:ident| $read:expr; )*) => {
        /// Every counter and gauge binxd exports.
        pub static STATS: &[StatDef] = &[
            $(StatDef {
                key: stringify!($key),
                group: stats!(@group $group),
                name: $name,
                help: $help,
                unit: StatUnit::$unit,
                kind: StatKind::$kind,
                read: |$s: &ExchangeStats| $read,
            },)*
        ];
    };
    (@group top) => { None };
    (@group $group:ident) => { Some(stringify!($group)) };
}

stats! {
    top.memory_used: Gauge Bytes "binx_memory_used"
        "Bytes held for pages: the pages, the receive buffers they pin, and their bookkeeping."
        = |s| Some(s.manager.memory_used);
    top.page_bytes_held: Gauge Bytes "binx_memory_pages"
        "Bytes of the pages themselves held in memory (binx_memory_used_bytes also counts the receive buffers they pin and their bookkeeping)."
        = |s| Some(s.manager.page_bytes_held);
    top.memory_pending: Gauge Bytes "binx_memory_pending"
        "Bytes of ENQUEUE bodies held while their requests wait (for room, for storage, behind earlier requests)."
        = |s| Some(s.manager.memory_pending);
    top.memory_high_water: Gauge Bytes "binx_memory_high_water"
        "Highest binx_memory_used_bytes since start."
        = |s| Some(s.manager.memory_high_water);
    top.memory_limit: Gauge Bytes "binx_memory_limit"
        "Memory limit for all tasks."
        = |s| Some(s.manager.memory_limit);
    top.task_memory_limit: Gauge Bytes "binx_task_memory_limit"
        "Memory limit per task."
        = |s| Some(s.manager.task_memory_limit);
    top.tasks: Gauge Count "binx_tasks" "Open tasks." = |s| Some(s.manager.tasks);
    top.buffers: Gauge Count "binx_buffers" "Buffers of open tasks." = |s| Some(s.manager.buffers);
    top.pages_buffered: Gauge Count "binx_pages_buffered" "Pages held." = |s| Some(s.manager.pages_buffered);
    top.pages_enqueued: Counter Count "binx_pages_enqueued"
        "Pages received from producers." = |s| Some(s.manager.pages_enqueued);
    top.bytes_enqueued: Counter Bytes "binx_enqueued"
        "Page bytes received from producers." = |s| Some(s.manager.bytes_enqueued);
    top.pages_dropped: Counter Count "binx_pages_dropped"
        "Pages dropped on arrival: their buffer was deleted or abandoned." = |s| Some(s.manager.pages_dropped);
    top.pages_served: Counter Count "binx_pages_served"
        "Pages sent to consumers." = |s| Some(s.manager.pages_served);
    top.bytes_served: Counter Bytes "binx_served"
        "Page bytes sent to consumers." = |s| Some(s.manager.bytes_served);
    top.pages_spilled: Counter Count "binx_pages_spilled"
        "Pages moved from memory to storage (policy overflow)." = |s| Some(s.manager.pages_spilled);
    top.spills_in_flight: Gauge Count "binx_spills_in_flight"
        "Spill writes in flight." = |s| Some(s.manager.spills_in_flight);
    top.busy_replies: Counter Count "binx_busy_replies"
        "ENQUEUE replies that said BUSY." = |s| Some(s.manager.busy_replies);
    top.backpressure_waits: Counter Count "binx_backpressure_waits"
        "ENQUEUEs that waited for memory (whether or not they then got BUSY)." = |s| Some(s.manager.backpressure_waits);
    top.abandoned_buffers: Counter Count "binx_abandoned_buffers"
        "Buffers dropped because no consumer polled them for abandon_after." = |s| Some(s.manager.abandoned_buffers);
    top.tasks_aborted: Counter Count "binx_tasks_aborted" "Tasks aborted." = |s| Some(s.manager.tasks_aborted);
    top.long_polls_waiting: Gauge Count "binx_long_polls_waiting"
        "Requests waiting for pages or room (long-polls, ENQUEUEs waiting for memory)." = |s| Some(s.manager.requests_waiting);
    top.objects_held: Gauge Count "binx_objects_held"
        "Spooled objects this daemon wrote that are still referenced." = |s| Some(s.manager.objects_held);
    top.pending_deletes: Gauge Count "binx_object_deletes_pending"
        "Object deletions asked for and not yet done." = |s| Some(s.manager.pending_deletes);
    top.deletes_left_to_ttl: Counter Count "binx_object_deletes_left_to_ttl"
        "Object deletions left to the TTL pruner (the deletion queue was full, a marker could not be deleted, or too many DELETEs of forgotten tasks waited for their marker to be read)." = |s| Some(s.manager.deletes_left_to_ttl);
    top.markers: Gauge Count "binx_commit_markers" "Commit markers held (written or being written)." = |s| Some(s.manager.markers);
    top.failover_replies: Counter Count "binx_failover_replies"
        "Proxy consumer: DATA replies served from a commit marker after the producing daemon went." = |s| Some(s.manager.failover_replies);
    top.forgotten_releases: Counter Count "binx_forgotten_releases"
        "Committed buffers of this node's run before a restart that a DELETE released from storage." = |s| Some(s.manager.forgotten_releases);
    top.remote_restarts: Counter Count "binx_remote_restarts"
        "Restarts of remotes the proxy consumer saw (another process instance at the same address); the committed buffers they held are read from storage at once." = |s| Some(s.manager.remote_restarts);
    top.forgotten_markers_read: Counter Count "binx_forgotten_markers_read"
        "Commit markers read for DELETEs of tasks this process does not know (at most 64 a second per shard)." = |s| Some(s.manager.forgotten_markers_read);
    top.bytes_evicted: Counter Bytes "binx_evicted"
        "Bytes of pages held in memory that were in storage too (a commit's, an always ENQUEUE's) and left memory, with no write, for room or unread for the abandon time; they are read from storage after." = |s| Some(s.manager.bytes_evicted);
    top.data_pipelined: Counter Count "binx_data_pipelined"
        "DATA requests pipelined behind another of their consumer (ack_token below page_token)." = |s| Some(s.manager.data_pipelined);
    top.append_token_refusals: Counter Count "binx_append_token_refusals"
        "ENQUEUE and NO_MORE_PAGES refused because their append_token was not the buffer's next token (sent behind one that was not applied, or repeating one that was)." = |s| Some(s.manager.append_token_refusals);
    top.forwards_refused: Counter Count "binx_forwards_refused"
        "Proxy consumer: requests refused because their remote is not in forward_allowed_peers." = |s| Some(s.manager.forwards_refused);
    top.forwarded_runs_refused: Counter Count "binx_forwarded_runs_refused"
        "Proxy consumer: DATA of a buffer read from one process of a remote that was not asked of (or not served from) the process answering there since it restarted: the buffer fails over to storage, or is refused; a task of the same id there is another run." = |s| Some(s.manager.forwarded_runs_refused);
    top.shards: Gauge Count "binx_shards"
        "Shards of the exchange core: each task lives on one, each has a lock of its own, all share the memory limit." = |s| Some(s.shards);
    top.runtime_threads: Gauge Count "binx_runtime_threads"
        "Threads of binxd's async runtime (the runtime_threads setting; 0 takes one per core binxd may use)." = |s| Some(s.runtime_threads);
    top.connections_open: Gauge Count "binx_connections_open" "Open BinX connections." = |s| Some(s.connections_open);
    top.connections_total: Counter Count "binx_connections" "BinX connections accepted." = |s| Some(s.connections_total);
    top.connections_refused: Counter Count "binx_connections_refused"
        "Connections closed at a connection limit." = |s| Some(s.connections_refused);
    top.connections_timed_out: Counter Count "binx_connections_timed_out"
        "BinX connections closed for sending no preface or HELLO in time, for idling past idle_timeout, or for making no room for their replies for write_stall_timeout." = |s| Some(s.connections_timed_out);
    top.shm_connections_open: Gauge Count "binx_shm_connections_open"
        "BinX connections using shared memory." = |s| Some(s.shm_connections_open);
    top.receive_buffers_spare_bytes: Gauge Bytes "binx_receive_buffers_spare"
        "Bytes of receive buffers BinX connections keep for reuse, all together (outside binx_memory_used_bytes: no page pins them); at most a sixteenth of the memory limit, 4-64 MiB." = |s| Some(s.receive_buffers_spare_bytes);
    top.receive_frames_bytes: Gauge Bytes "binx_receive_frames"
        "Bytes of room BinX frames larger than a small receive buffer hold while they arrive, all together (outside binx_memory_used_bytes); at most a sixteenth of the memory limit, 4-64 MiB (a larger frame is received alone)." = |s| Some(s.receive_frames_bytes);
    top.shm_attached_total: Counter Count "binx_shm_attached"
        "Unix socket connections that attached shared memory." = |s| Some(s.shm_attached_total);
    top.tls_kernel_total: Counter Count "binx_tls_kernel_connections"
        "TLS connections whose records the kernel seals and opens (kernel TLS)." = |s| Some(s.tls_kernel_total);
    top.tls_rustls_total: Counter Count "binx_tls_rustls_connections"
        "TLS connections rustls serves (kernel TLS off, not offered, or not for the negotiated suite)." = |s| Some(s.tls_rustls_total);
    top.http_unauthenticated: Counter Count "binx_http_unauthenticated"
        "HTTP exchange requests refused (401) for a missing or invalid internal bearer token." = |s| Some(s.http_unauthenticated);
    top.http_long_polls_refused: Counter Count "binx_http_long_polls_refused"
        "HTTP exchange GETs answered without waiting for pages because http_max_long_polls were waiting (each waited up to 2 s for a permit first)." = |s| Some(s.http_long_polls_refused);
    top.http_connections_waited: Counter Count "binx_http_connections_waited"
        "Times the HTTP listener stopped accepting because http_max_connections were open; new connections waited in the listen backlog." = |s| Some(s.http_connections_waited);
    top.protocol_errors: Counter Count "binx_protocol_errors"
        "Connections closed for a protocol error." = |s| Some(s.protocol_errors);
    top.errors: Counter Count "binx_errors"
        "Error replies (BAD_REQUEST, SERVER_ERROR, UNAUTHENTICATED) and protocol errors." = |s| Some(s.errors);
    top.bytes_received: Counter Bytes "binx_received"
        "Bytes of BinX frames received." = |s| Some(s.bytes_received);
    top.bytes_sent: Counter Bytes "binx_sent" "Bytes of BinX frames sent." = |s| Some(s.bytes_sent);
    spool.bytes_spooled: Counter Bytes "binx_spool_written"
        "Page bytes written to spool storage." = |s| s.spool.as_ref().map(|p| p.bytes_spooled);
    spool.objects_spooled: Counter Count "binx_spool_objects_written"
        "Segment objects written to spool storage." = |s| s.spool.as_ref().map(|p| p.objects_spooled);
    spool.stored_bytes_written: Counter Bytes "binx_spool_stored"
        "Bytes of segment objects as stored (after compression and encryption)." = |s| s.spool.as_ref().map(|p| p.stored_bytes_written);
    spool.bytes_read: Counter Bytes "binx_spool_read"
        "Page bytes read back from spool storage." = |s| s.spool.as_ref().map(|p| p.bytes_read);
    spool.objects_read: Counter Count "binx_spool_objects_read"
        "Segment objects read back from spool storage." = |s| s.spool.as_ref().map(|p| p.objects_read);
    spool.objects_read_ahead: Counter Count "binx_spool_objects_read_ahead"
        "Segment objects read back ahead of the DATA request that needed them (counted in binx_spool_objects_read too)." = |s| s.spool.as_ref().map(|p| p.objects_read_ahead);
    spool.objects_packed: Counter Count "binx_spool_objects_packed"
        "Segment objects written packed with others of their task into one file of a file:// store (counted in binx_spool_objects_written too)." = |s| s.spool.as_ref().map(|p| p.objects_packed);
    spool.read_bytes_held: Gauge Bytes "binx_spool_read_held"
        "Bytes of objects read back from spool storage held now: the read cache and what replies and read-aheads reserved of the read budget (outside binx_memory_used_bytes)." = |s| s.spool.as_ref().map(|p| p.read_bytes_held);
    spool.objects_deleted: Counter Count "binx_spool_objects_deleted"
        "Segment objects deleted once their pages were released." = |s| s.spool.as_ref().map(|p| p.objects_deleted);
    spool.objects_pruned: Counter Count "binx_spool_objects_pruned"
        "Segment objects deleted by the TTL and restart pruner." = |s| s.spool.as_ref().map(|p| p.objects_pruned);
    spool.errors: Counter Count "binx_spool_errors"
        "Failed spool writes, reads and deletions." = |s| s.spool.as_ref().map(|p| p.errors);
    spool.release_tasks: Gauge Count "binx_spool_release_tasks"
        "Tasks whose commit releases (consumers that finished a buffer from storage) are under way or waiting; each task's go one at a time." = |s| s.spool.as_ref().map(|p| p.release_tasks);
    spool.file_jobs_unfinished: Gauge Count "binx_spool_file_jobs_unfinished"
        "File system jobs of file:// stores started and not finished, those given up on whose thread is still stuck in the kernel included (at most 64 a store; past that, jobs fail without being started)." = |s| s.spool.as_ref().map(|p| p.file_jobs_unfinished);
    spool.file_jobs_given_up: Counter Count "binx_spool_file_jobs_given_up"
        "File system jobs of file:// stores given up on (the file system answered none of their calls for spool_request_timeout: a hung mount?) or refused (every place of their store held by such jobs)." = |s| s.spool.as_ref().map(|p| p.file_jobs_given_up);
}

/// The label of a request type: `DATA`, `ENQUEUE`, ..., or `UNKNOWN` for a
/// number outside the protocol.
pub fn type_label(kind: Option<MessageType>) -> &'static str {
    kind.map_or("UNKNOWN", MessageType::name)
}

/// The label of a reply status: `OK`, `BUSY`, ..., or `UNKNOWN`.
pub fn status_label(status: Option<Status>) -> &'static str {
    status.map_or("UNKNOWN", Status::name)
}

/// `binx_requests_total`'s labels: the request's type and its reply's status.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct RequestLabels {
    /// The request type (`None`: a number outside the protocol).
    pub kind: Option<MessageType>,
    /// The reply's status (`None`: a number outside the protocol).
    pub status: Option<Status>,
}

impl EncodeLabelSet for RequestLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), fmt::Error> {
        [
            ("type", type_label(self.kind)),
            ("status", status_label(self.status)),
        ]
        .encode(encoder)
    }
}

/// The histograms' label: the request's type.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct TypeLabel(pub MessageType);

impl EncodeLabelSet for TypeLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), fmt::Error> {
        [("type", self.0.name())].encode(encoder)
    }
}

/// The histograms, shared by every connection of one exchange.
#[derive(Debug)]
pub struct Histograms {
    request_seconds: HistogramsByType,
    reply_bytes: HistogramsByType,
}

impl Default for Histograms {
    fn default() -> Self {
        Histograms {
            // 100 us to about 26 s: a DATA long-poll waits up to max_wait.
            request_seconds: HistogramsByType::new(exponential_buckets(0.0001, 4.0, 10)),
            // 64 B to 1 GiB.
            reply_bytes: HistogramsByType::new(exponential_buckets(64.0, 4.0, 13)),
        }
    }
}

impl Histograms {
    /// One request of `kind` answered after `elapsed` with `body_bytes` of
    /// pages (or segment references) in its reply.
    pub fn observe(&self, kind: MessageType, elapsed: Duration, body_bytes: u64) {
        self.request_seconds.observe(kind, elapsed.as_secs_f64());
        self.reply_bytes.observe(kind, body_bytes as f64);
    }
}

/// One histogram family as read at a scrape, for the registry.
#[derive(Debug)]
struct HistogramFamily {
    name: &'static str,
    help: &'static str,
    unit: Unit,
    by_type: Vec<(MessageType, HistogramReading)>,
}

impl Collector for HistogramFamily {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let mut family = encoder.encode_descriptor(
            self.name,
            self.help,
            Some(&self.unit),
            MetricType::Histogram,
        )?;
        for (kind, (sum, count, buckets)) in &self.by_type {
            family
                .encode_family(&TypeLabel(*kind))?
                .encode_histogram::<NoLabelSet>(*sum, *count, buckets, None)?;
        }
        Ok(())
    }
}

/// The counters and gauges of one snapshot, for the registry.
#[derive(Debug)]
struct Snapshot(ExchangeStats);

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        for stat in STATS {
            let Some(value) = (stat.read)(&self.0) else {
                continue;
            };
            match stat.kind {
                StatKind::Counter => {
                    let counter = ConstCounter::new(value);
                    let metric = encoder.encode_descriptor(
                        stat.name,
                        stat.help,
                        stat.unit.prometheus(),
                        counter.metric_type(),
                    )?;
                    counter.encode(metric)?;
                }
                StatKind::Gauge => {
                    let gauge = ConstGauge::new(value);
                    let metric = encoder.encode_descriptor(
                        stat.name,
                        stat.help,
                        stat.unit.prometheus(),
                        gauge.metric_type(),
                    )?;
                    gauge.encode(metric)?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "binx_requests",
            "Requests answered, by type and reply status.",
            None,
            MetricType::Counter,
        )?;
        for count in &self.0.manager.requests {
            let labels = RequestLabels {
                kind: count.kind,
                status: count.status,
            };
            ConstCounter::new(count.count).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// `/metrics`: the snapshot and the histograms in the OpenMetrics text
/// format (`# UNIT` lines, `_total` counters, `# EOF`).
pub fn openmetrics(stats: ExchangeStats, histograms: &Histograms) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(stats)));
    registry.register_collector(Box::new(HistogramFamily {
        name: "binx_request_duration",
        help: "Time from a BinX request's arrival to its reply, by type (a DATA long-poll counts its wait).",
        unit: Unit::Seconds,
        by_type: histograms.request_seconds.read(),
    }));
    registry.register_collector(Box::new(HistogramFamily {
        name: "binx_reply_body",
        help: "Bytes of pages (or segment references) in BinX replies, by request type.",
        unit: Unit::Bytes,
        by_type: histograms.reply_bytes.read(),
    }));
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// The OpenMetrics content type `/metrics` is served with.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `/v1/stats`: every value by key (the spool's in a `spool` object), the
/// replies by `"TYPE STATUS"`, and whether the daemon drains.
pub fn stats_json(stats: &ExchangeStats) -> serde_json::Value {
    let mut top = serde_json::Map::new();
    for stat in STATS {
        let Some(value) = (stat.read)(stats) else {
            continue;
        };
        let target = match stat.group {
            None => &mut top,
            Some(group) => match top
                .entry(group)
                .or_insert_with(|| serde_json::Value::Object(Default::default()))
            {
                serde_json::Value::Object(inner) => inner,
                _ => continue,
            },
        };
        target.insert(stat.key.to_string(), value.into());
    }
    let requests: serde_json::Map<String, serde_json::Value> = stats
        .manager
        .requests
        .iter()
        .map(|c| {
            let key = format!("{} {}", type_label(c.kind), status_label(c.status));
            (key, c.count.into())
        })
        .collect();
    top.insert("requests".into(), requests.into());
    top.insert("draining".into(), stats.manager.draining.into());
    top.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_stat_has_one_key_and_one_name() {
        let mut keys = HashSet::new();
        let mut names = HashSet::new();
        for stat in STATS {
            assert!(
                keys.insert(stat.flat_key()),
                "key {} twice",
                stat.flat_key()
            );
            assert!(names.insert(stat.name), "name {} twice", stat.name);
            assert!(stat.name.starts_with("binx_"), "{}", stat.name);
            assert!(
                !stat.name.ends_with("_total") && !stat.name.ends_with("_bytes"),
                "{}: the encoder adds unit and _total",
                stat.name
            );
        }
    }

    #[test]
    fn the_exposition_has_units_totals_histograms_and_an_end() {
        let histograms = Histograms::default();
        histograms.observe(MessageType::Data, Duration::from_millis(3), 4096);
        let mut stats = ExchangeStats::default();
        stats.manager.bytes_enqueued = 12;
        stats.manager.requests.push(binx_core::ReplyCount {
            kind: Some(MessageType::Data),
            status: Some(Status::Ok),
            count: 7,
        });
        let text = openmetrics(stats.clone(), &histograms);
        assert!(
            text.contains("# UNIT binx_enqueued_bytes bytes\n"),
            "{text}"
        );
        assert!(text.contains("\nbinx_enqueued_bytes_total 12\n"), "{text}");
        assert!(
            text.contains("binx_requests_total{type=\"DATA\",status=\"OK\"} 7\n"),
            "{text}"
        );
        assert!(
            text.contains("binx_request_duration_seconds_count{type=\"DATA\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("binx_reply_body_bytes_bucket{le=\"4096.0\",type=\"DATA\"} 1\n")
                || text.contains("binx_reply_body_bytes_bucket{type=\"DATA\",le=\"4096.0\"} 1\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(
            !text.contains("binx_spool_"),
            "no spool, no spool metrics: {text}"
        );
        assert!(text.contains("binx_object_deletes_pending "), "{text}");
        let json = stats_json(&stats);
        assert_eq!(json["bytes_enqueued"], 12);
        assert_eq!(json["requests"]["DATA OK"], 7);
        assert!(json.get("spool").is_none());
    }
}
