//! Limits and defaults of the core. Every resource the core holds has one.

use std::time::Duration;

use binx_proto::SpoolPolicy;

use crate::objects::Codec;
use crate::peers::PeerAllowList;

/// Limits and defaults of the exchange core.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Bytes all tasks together may hold in memory (pages, the receive
    /// buffers they pin and their bookkeeping).
    pub memory_limit: u64,
    /// Bytes one task may hold.
    pub task_memory_limit: u64,
    /// Cap on any request's `max_wait_micros`.
    pub max_wait: Duration,
    /// Reply size when a DATA asks with `max_size_bytes` = 0.
    pub default_reply_size: u64,
    /// Cap on `max_size_bytes` (a reply frame stays within the peer's
    /// frame limit).
    pub max_reply_size: u64,
    /// Bytes of stored objects one DATA reply may read back (the driver
    /// reads and decodes each object whole, outside the memory limit): a
    /// reply stops before the object that would pass it, after at least one
    /// page.
    pub max_stored_reply_size: u64,
    /// A buffer no consumer polled for this long is dropped (and reads as
    /// abandoned, never as complete).
    pub abandon_after: Duration,
    /// Buffers one task may have.
    pub max_buffers_per_task: u64,
    /// Pages one ENQUEUE may carry.
    pub max_pages_per_enqueue: usize,
    /// Pages one buffer (or a task's shared log) may hold; past it ENQUEUE
    /// waits for consumers like a full memory.
    pub max_pages_per_log: u64,
    /// Spool policy of tasks that do not name one.
    pub default_spool_policy: SpoolPolicy,
    /// Ended tasks and early DELETEs remembered, each (and for
    /// `abandon_after` at most).
    pub max_tombstones: usize,
    /// Requests one connection may have waiting at once; past it a request
    /// is BUSY at once.
    pub max_outstanding_per_connection: usize,
    /// Proxy consumer: (remote, task, buffer) failure records kept at most,
    /// and as many records of the process each forwarded buffer was read
    /// from.
    pub max_tracked_remotes: usize,
    /// Proxy consumer: the remotes requests may be forwarded to; any other
    /// `remote` is BAD_REQUEST before a connection is made.
    pub forward_allowed_peers: PeerAllowList,
    /// The spool, when one is configured.
    pub spool: Option<SpoolRules>,
}

/// `spill_concurrency` left for the I/O driver to choose.
pub const AUTO_SPILL_CONCURRENCY: usize = 0;

/// What the core must know of the spool to decide: sizes, ages, whether
/// replies may hand out URLs, failover timing.
#[derive(Clone, Debug)]
pub struct SpoolRules {
    /// Pages of one log spilled together aim at this size first ...
    pub spill_target_bytes: u64,
    /// ... and at this one after the log's first spill; also the largest
    /// object one durable ENQUEUE writes.
    pub spill_max_bytes: u64,
    /// Policy `overflow`: pages held longer than this spill even with room.
    pub spill_after: Duration,
    /// Spill writes in flight at once, over all shards (each shard gets
    /// its share, at least one). binx-server's exchange replaces
    /// [`AUTO_SPILL_CONCURRENCY`] with a figure for its shards.
    pub spill_concurrency: usize,
    /// Bytes of pages spill writes hold at once, over all shards (each
    /// shard gets its share): a write's pages stay in memory until it ends
    /// even if released meanwhile, and a codec or encryption adds an
    /// encoded copy. A shard with no write in flight starts one whatever
    /// its size.
    pub spill_bytes_max: u64,
    /// A PARTITIONED task's task-wide commit writes its markers in the
    /// manifest (format 2) rather than an object each; off while a cluster
    /// still has sidecars that read only format 1.
    pub fold_markers: bool,
    /// Why policy `always` is refused, when the spool cannot commit buffers.
    pub always_refusal: Option<String>,
    /// Clients that accept spooled segments get whole objects as URLs
    /// (retrieval `storage` and stores that presign).
    pub presigns: bool,
    /// The codec segments are written with.
    pub codec: Codec,
    /// A proxy consumer whose producer lost a committed buffer this long
    /// reads it from storage.
    pub failover_after: Duration,
    /// Object deletions in flight at once at most; past it an object is left
    /// to the TTL pruner (and counted).
    pub max_pending_deletes: usize,
    /// Objects live this long in storage (the pruner's TTL): a committed
    /// buffer is kept (readable from storage) until then, never dropped as
    /// abandoned sooner.
    pub ttl: Duration,
    /// The node name this binxd writes into its commit markers: a DELETE
    /// of a buffer of a task it does not know releases the buffer's
    /// committed output when this node wrote it (a run before a restart).
    pub node: String,
}

impl Default for SpoolRules {
    fn default() -> Self {
        SpoolRules {
            spill_target_bytes: 8 << 20,
            spill_max_bytes: 16 << 20,
            spill_after: Duration::from_secs(30),
            spill_concurrency: 2,
            spill_bytes_max: 32 << 20,
            fold_markers: true,
            always_refusal: None,
            presigns: false,
            codec: Codec::None,
            failover_after: Duration::from_secs(30),
            max_pending_deletes: 100_000,
            ttl: Duration::from_secs(12 * 3600),
            node: "binxd".into(),
        }
    }
}

impl CoreConfig {
    /// The limits of one of `shards` shards: what the daemon holds at most
    /// of things each shard counts for itself (tombstones, tracked remotes,
    /// spill writes, object deletions in flight) is shared evenly, at least
    /// one each unless none is allowed. The memory limit is not divided: the shards share it as a
    /// [`crate::MemoryBudget`].
    pub fn for_shard(&self, shards: usize) -> CoreConfig {
        let n = shards.max(1);
        // div_ceil keeps a nonzero limit nonzero, and 0 (none at all) 0.
        let share = |total: usize| total.div_ceil(n);
        let mut config = self.clone();
        config.max_tombstones = share(self.max_tombstones);
        config.max_tracked_remotes = share(self.max_tracked_remotes);
        if let Some(spool) = &mut config.spool {
            spool.spill_concurrency = share(spool.spill_concurrency);
            spool.spill_bytes_max = spool.spill_bytes_max.div_ceil(n as u64);
            spool.max_pending_deletes = share(spool.max_pending_deletes);
        }
        config
    }
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            memory_limit: 1 << 30,
            task_memory_limit: 256 << 20,
            max_wait: Duration::from_secs(10),
            default_reply_size: 1 << 20,
            max_reply_size: 64 << 20,
            max_stored_reply_size: u64::MAX,
            abandon_after: Duration::from_secs(600),
            max_buffers_per_task: 65_536,
            max_pages_per_enqueue: 65_536,
            max_pages_per_log: 1 << 20,
            default_spool_policy: SpoolPolicy::Off,
            max_tombstones: 100_000,
            max_outstanding_per_connection: 1024,
            max_tracked_remotes: 65_536,
            forward_allowed_peers: PeerAllowList::loopback(),
            spool: None,
        }
    }
}
