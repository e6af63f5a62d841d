//! The numbers `binx stats`, `/v1/stats` and `/metrics` show: a snapshot
//! the exchange takes and the metrics module formats (neither imports the
//! other's workings).

use binx_core::CoreStats;
use binx_spool::SpoolStats;

/// Everything `binx stats` shows: the core's numbers plus the listeners'.
#[derive(Clone, Debug, Default)]
pub struct ExchangeStats {
    /// The core's numbers.
    pub manager: CoreStats,
    /// Shards of the exchange core (the `shards` setting).
    pub shards: u64,
    /// Threads of the async runtime the stats were taken on (binxd's
    /// `runtime_threads` setting, as the runtime really runs it).
    pub runtime_threads: u64,
    /// BinX connections open now.
    pub connections_open: u64,
    /// BinX connections accepted since start.
    pub connections_total: u64,
    /// BinX connections refused at the door since start (limits, uids).
    pub connections_refused: u64,
    /// BinX connections closed for sending no preface or HELLO in time, for
    /// idling past idle_timeout, or for making no room for their replies for
    /// write_stall_timeout.
    pub connections_timed_out: u64,
    /// HTTP exchange requests refused for a missing or invalid internal
    /// bearer token.
    pub http_unauthenticated: u64,
    /// HTTP exchange GETs answered without waiting for pages, because
    /// http_max_long_polls were waiting already (after up to 2 s waiting
    /// for one of them to end).
    pub http_long_polls_refused: u64,
    /// Times the HTTP listener stopped accepting because
    /// http_max_connections were open (new connections waited).
    pub http_connections_waited: u64,
    /// Connections moving their frames through shared memory now.
    pub shm_connections_open: u64,
    /// Connections that attached shared memory since start.
    pub shm_attached_total: u64,
    /// TLS connections since start whose records the kernel seals and
    /// opens (kernel TLS).
    pub tls_kernel_total: u64,
    /// TLS connections since start whose records rustls seals and opens.
    pub tls_rustls_total: u64,
    /// Connections closed for a malformed preface or frame since start.
    pub protocol_errors: u64,
    /// Bytes of receive buffers connections keep for reuse (outside
    /// `memory_used`: no page pins them), within a sixteenth of the memory
    /// limit (4-64 MiB) all together.
    pub receive_buffers_spare_bytes: u64,
    /// Bytes of room frames being received hold (only frames larger than a
    /// small receive buffer take room), within the same bound.
    pub receive_frames_bytes: u64,
    /// Bytes of BinX frames received, on every connection.
    pub bytes_received: u64,
    /// Bytes of BinX frames sent, on every connection.
    pub bytes_sent: u64,
    /// Replies with BAD_REQUEST, SERVER_ERROR or UNAUTHENTICATED, plus
    /// connections closed for a protocol error.
    pub errors: u64,
    /// Spooling counters; absent when no store is configured.
    pub spool: Option<SpoolStats>,
}
