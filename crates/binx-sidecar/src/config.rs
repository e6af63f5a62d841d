//! binxd's configuration: built-in defaults, then a TOML file, then `BINX_*`
//! environment variables, then command-line flags; each layer overrides the
//! one before. Every key exists in all four forms: `memory_limit` in the
//! file is `BINX_MEMORY_LIMIT` and `--memory-limit`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use binx_server::{ConnectionConfig, CoreConfig, ListenConfig, SpoolPolicy, UdsAccess};
use serde::{Deserialize, Serialize};

use binx_core::objects::Codec;
use binx_spool::{Encryption, Retrieval, SpoolConfig, StoreOptions};

use crate::units::{ByteSize, HumanDuration, Text};
pub use binx_client::endpoint::{admin_uds_beside, default_uds_path};

/// The host name, made safe for object names (`binxd` when there is none).
fn host_name() -> String {
    let raw = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .unwrap_or_default();
    let cleaned: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(binx_spool::naming::MAX_NODE_NAME_LEN)
        .collect();
    let cleaned = cleaned.trim_matches('-').to_string();
    if cleaned.is_empty() {
        "binxd".into()
    } else {
        cleaned
    }
}

/// A group's id from its name (in /etc/group) or its number.
fn group_id(name: &str) -> anyhow::Result<u32> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").unwrap_or_default();
    groups
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(':');
            let group = fields.next()?;
            let gid = fields.nth(1)?.parse::<u32>().ok()?;
            (group == name).then_some(gid)
        })
        .next()
        .with_context(|| {
            format!("uds_group {name:?} is neither a number nor a group in /etc/group")
        })
}

/// `admin_uds_path`'s default: beside `uds_path`.
pub const ADMIN_UDS_AUTO: &str = "auto";

/// The value of keys whose default is worked out from other keys.
pub const AUTO: &str = "auto";

/// Most threads `runtime_threads` may ask for: more than any node has cores
/// buys only stacks and switches.
const MAX_RUNTIME_THREADS: u64 = 1024;

/// How binxd writes its log lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

macro_rules! config_keys {
    ($( $(#[doc = $doc:literal])* $key:ident : $ty:ty = $default:expr, env $env:literal; )*) => {
        /// The effective configuration.
        #[derive(Clone, Debug, Serialize)]
        pub struct Config {
            $( $(#[doc = $doc])* pub $key: $ty, )*
        }

        impl Default for Config {
            fn default() -> Self {
                Config { $( $key: $default, )* }
            }
        }

        /// The keys a TOML file may set; unknown keys are an error.
        #[derive(Debug, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct ConfigFile {
            $( $key: Option<$ty>, )*
        }

        /// Overrides from flags and `BINX_*` environment variables.
        #[derive(Clone, Debug, Default, clap::Args)]
        pub struct ConfigOverrides {
            $(
                $(#[doc = $doc])*
                #[arg(long, env = $env, value_name = stringify!($key), hide_env_values = true)]
                pub $key: Option<$ty>,
            )*
        }

        impl Config {
            fn apply_file(&mut self, file: ConfigFile) {
                $( if let Some(v) = file.$key { self.$key = v; } )*
            }

            fn apply_overrides(&mut self, o: &ConfigOverrides) {
                $( if let Some(v) = &o.$key { self.$key = v.clone(); } )*
            }

            /// Every key: (file key, environment variable, default, description).
            pub fn keys() -> Vec<(&'static str, &'static str, String, String)> {
                let d = Config::default();
                vec![ $( (
                    stringify!($key),
                    $env,
                    toml_value(&d.$key),
                    [$($doc),*].iter().map(|l| l.trim()).collect::<Vec<_>>().join(" "),
                ), )* ]
            }
        }
    };
}

/// What binxd runs with, loaded once by [`Config::load`]: every value
/// parsed, every file read (TLS material), every name looked up (the
/// socket's group), the spool and shared-memory geometry checked. A
/// setting that does not load stopped `load` with its key named.
pub struct Settings {
    /// The keys as given, for `--print-config` and plain values.
    pub config: Config,
    /// The exchange core's limits.
    pub core: CoreConfig,
    /// The BinX listeners: addresses, socket access, TLS, shared memory.
    pub listen: ListenConfig,
    /// The spool, unless `spool_stores` is empty.
    pub spool: Option<SpoolConfig>,
    /// The proxy consumer's forwarder, unless forwarding is off.
    pub forwarder: Option<std::sync::Arc<dyn binx_server::Forwarder>>,
    /// The admin socket, if any.
    pub admin_uds: Option<PathBuf>,
    /// The HTTP endpoint's limits.
    pub http_limits: binx_server::http::HttpLimits,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Neither the keys (shared_secret is one) nor TLS material.
        f.debug_struct("Settings")
            .field("name", &self.config.name)
            .field("spool", &self.spool.is_some())
            .field("forwarder", &self.forwarder.is_some())
            .finish_non_exhaustive()
    }
}

/// `key`'s value within `min..=max`, else an error that names the key.
fn within<T: PartialOrd + std::fmt::Display>(
    key: &str,
    value: T,
    min: T,
    max: T,
) -> anyhow::Result<()> {
    if value < min || value > max {
        bail!("{key} is {value}; it must be between {min} and {max}");
    }
    Ok(())
}

fn toml_value<T: Serialize>(value: &T) -> String {
    #[derive(Serialize)]
    struct One<'a, T: Serialize> {
        v: &'a T,
    }
    toml::to_string(&One { v: value })
        .map(|s| s.trim_start_matches("v = ").trim().to_string())
        .unwrap_or_default()
}

/// Longest `name` (bytes).
pub const MAX_NAME_LEN: usize = 256;

config_keys! {
    /// Name sent to clients in HELLO replies (at most 256 bytes).
    name: String = "binxd".into(), env "BINX_NAME";
    /// TCP address of the BinX listener for remote peers; empty disables it. In a pod, use `0.0.0.0:8091`.
    tcp_listen: String = format!("127.0.0.1:{}", binx_proto::DEFAULT_TCP_PORT), env "BINX_TCP_LISTEN";
    /// Unix socket path for local engines; empty disables it. In a pod, use `/var/run/binx/binx.sock`.
    uds_path: String = default_uds_path().display().to_string(), env "BINX_UDS_PATH";
    /// Permission bits of the Unix socket, in octal; connecting needs write permission.
    uds_mode: String = "0660".into(), env "BINX_UDS_MODE";
    /// Group of the Unix socket, a name or a number; empty keeps the group it is created with (the directory's when it is setgid, as a Kubernetes emptyDir with fsGroup is).
    uds_group: String = String::new(), env "BINX_UDS_GROUP";
    /// Uids that may use the Unix socket, comma-separated, checked with SO_PEERCRED; empty allows whoever the file permissions let in.
    uds_allowed_uids: String = String::new(), env "BINX_UDS_ALLOWED_UIDS";
    /// Unix socket of the admin gRPC service (mode 0600); "auto" puts it beside uds_path (binx.sock -> binx-admin.sock); empty disables it.
    admin_uds_path: String = ADMIN_UDS_AUTO.into(), env "BINX_ADMIN_UDS_PATH";
    /// TCP address of the admin gRPC service; empty (the default) disables it. Off loopback it requires shared_secret, sent as a bearer token.
    admin_listen: String = String::new(), env "BINX_ADMIN_LISTEN";
    /// TCP address of the HTTP endpoint (/healthz, /readyz, /metrics, /v1/stats); empty disables it.
    http_listen: String = "127.0.0.1:8090".into(), env "BINX_HTTP_LISTEN";
    /// PEM certificate chain of the BinX TCP listener; with tls_key, BinX over TCP is TLS only. Also presented to remotes when forwarding, if they ask.
    tls_cert: String = String::new(), env "BINX_TLS_CERT";
    /// PEM private key for tls_cert.
    tls_key: String = String::new(), env "BINX_TLS_KEY";
    /// PEM CA bundle peers' certificates are checked against: with it, the proxy consumer's connections to remotes use TLS; with tls_client_auth, clients of the TCP listener must present a certificate it signed.
    tls_ca: String = String::new(), env "BINX_TLS_CA";
    /// Mutual TLS: the TCP listener requires a client certificate signed by tls_ca.
    tls_client_auth: bool = false, env "BINX_TLS_CLIENT_AUTH";
    /// Kernel TLS: after each handshake of the TCP listener, the kernel seals and opens the connection's records where it offers that for the negotiated suite (the tls module); elsewhere rustls does, as with false.
    tls_kernel: bool = true, env "BINX_TLS_KERNEL";
    /// When set, every BinX TCP connection must start with a HELLO carrying it, and every HTTP exchange request (and /v1/stats) must carry an internal JWT signed with it, as Presto and Trino workers send (docs/SECURITY.md).
    shared_secret: String = String::new(), env "BINX_SHARED_SECRET";
    /// Bytes all tasks together may hold in memory for their pages: the receive buffers the pages pin and their bookkeeping count, not only the page bytes (`memory_used` in the stats; `page_bytes_held` is the pages alone). Objects read back from storage and forwarded replies are held besides, within budgets of a sixteenth of it each (1-32 MiB; `spool.read_bytes_held`, docs/SECURITY.md), and so are receive buffers kept for reuse and large frames being received (4-64 MiB each: `receive_buffers_spare_bytes`, `receive_frames_bytes`).
    memory_limit: ByteSize = ByteSize(1 << 30), env "BINX_MEMORY_LIMIT";
    /// Shards of the exchange core: each task lives on one (by a hash of its id), each shard has a lock of its own, and all share memory_limit. 0 (the default) takes one per core binxd may use; 1 puts every task behind one lock, as before 2026-11-27.
    shards: u64 = 0, env "BINX_SHARDS";
    /// Worker threads of binxd's async runtime (connections, timers, the core's requests), besides its main thread (which accepts connections) and the blocking threads that read and write files. 0 (the default) takes one per core binxd may use; tokio's TOKIO_WORKER_THREADS is not read. A sidecar beside an engine that keeps every core busy may take fewer: beside Trino on 2 cores, TPC-H under fault-tolerant execution cost 1 worker the same CPU as 2, at a quarter less peak RSS (BENCHMARKS.md).
    runtime_threads: u64 = 0, env "BINX_RUNTIME_THREADS";
    /// Bytes one task may hold in memory, counted as for memory_limit.
    task_memory_limit: ByteSize = ByteSize(256 << 20), env "BINX_TASK_MEMORY_LIMIT";
    /// Longest a request may wait (long-poll, ENQUEUE waiting for room), whatever it asks.
    max_wait: HumanDuration = HumanDuration(Duration::from_secs(10)), env "BINX_MAX_WAIT";
    /// Reply size for DATA requests that ask with max_size_bytes = 0.
    default_reply_size: ByteSize = ByteSize(1 << 20), env "BINX_DEFAULT_REPLY_SIZE";
    /// Largest frame accepted (the length field), 1KiB to 4GiB; a longer one closes its connection. HELLO says it (`max-frame-bytes=`): binx's clients (Rust, Java, the CLI, the C ABI) keep their ENQUEUEs within it and refuse a page no frame carries; a client that does not read HELLO may send up to 16MiB of pages a frame (binxd warns at start below 16MiB + 64KiB).
    max_frame_size: ByteSize = ByteSize(binx_proto::DEFAULT_MAX_FRAME_LENGTH as u64), env "BINX_MAX_FRAME_SIZE";
    /// On SIGTERM, SIGINT or `binx drain`, how long binxd keeps serving held pages to consumers before it stops (a second signal stops at once; the first signal after `binx drain` does not).
    drain_grace: HumanDuration = HumanDuration(Duration::from_secs(30)), env "BINX_DRAIN_GRACE";
    /// A buffer no consumer polled for this long is dropped (and logged); a committed one (policy always or commit) only loses its memory until spool_ttl, and no buffer of a committing task goes while its producer holds its connection.
    abandon_after: HumanDuration = HumanDuration(Duration::from_secs(600)), env "BINX_ABANDON_AFTER";
    /// Connections open at once (TCP and the Unix socket together; with a Unix socket, TCP may hold all but a quarter of them, at most 256, which are kept for it; TCP connections not yet authenticated are at most half of TCP's share, up to 256, the oldest closed for a new one past it); past it a new connection's first request is answered BUSY naming the limit, and it is closed.
    max_connections: u64 = 4096, env "BINX_MAX_CONNECTIONS";
    /// Requests that may wait at once on one connection; past it a request is answered BUSY at once, and the connection keeps being read.
    max_outstanding_requests: u64 = 1024, env "BINX_MAX_OUTSTANDING_REQUESTS";
    /// Buffers one task may have.
    max_buffers_per_task: u64 = 65_536, env "BINX_MAX_BUFFERS_PER_TASK";
    /// Pages one ENQUEUE may carry; past it the ENQUEUE is BAD_REQUEST and nothing of it is stored.
    max_pages_per_enqueue: u64 = 65_536, env "BINX_MAX_PAGES_PER_ENQUEUE";
    /// Pages one buffer (or a broadcast or arbitrary task's shared pages) may hold; past it an ENQUEUE waits for consumers as for memory (then BUSY). HELLO says it (`max-pages-per-buffer=`), so a producer whose consumers read only after it finished (the Trino plugin) fails at once past it. Each page costs bookkeeping (about 100 bytes, even when it is empty) against task_memory_limit: raising this needs that room too.
    max_pages_per_buffer: u64 = 1 << 20, env "BINX_MAX_PAGES_PER_BUFFER";
    /// Offer shared memory to Unix socket clients that ask for it (SHM_ATTACH): two sealed memfd regions per connection.
    shm_enabled: bool = true, env "BINX_SHM_ENABLED";
    /// Bytes of each shared memory region (one per direction per connection); memory is used as slots are first touched.
    shm_region_size: ByteSize = ByteSize(64 << 20), env "BINX_SHM_REGION_SIZE";
    /// Bytes of each slot of a region (a multiple of 4KiB); bytes of the BinX stream travel a slot at a time, and a reply that fits one slot is read by the client in place.
    shm_slot_size: ByteSize = ByteSize(1 << 20), env "BINX_SHM_SLOT_SIZE";
    /// Shared memory connections at once (each holds two regions of shm_region_size, touched as used); past it SHM_ATTACH is answered BUSY and the client keeps the Unix socket.
    shm_max_connections: u64 = 8, env "BINX_SHM_MAX_CONNECTIONS";
    /// How long binxd spins on an idle shared memory connection before it sleeps on its eventfd (0 sleeps at once).
    shm_spin: HumanDuration = HumanDuration(Duration::from_micros(50)), env "BINX_SHM_SPIN";
    /// TCP sockets (stripes) of the one connection to each remote sidecar when forwarding for local clients (proxy consumer): DATA goes round them, other requests by task; 0 disables forwarding. One TCP stream carried 1MiB pages of 8 exchanges at about a third of 8 plain sockets on a 2-core node, two at 0.8-0.9 (BENCHMARKS.md); more may help on nodes with more cores.
    forward_connections_per_remote: u64 = 2, env "BINX_FORWARD_CONNECTIONS_PER_REMOTE";
    /// Remotes the proxy consumer may forward to (and send shared_secret to), comma-separated: networks (10.244.0.0/16), addresses, host names, *.domain, or * for any. A request naming another remote is BAD_REQUEST and nothing connects. The Helm chart sets the pod network.
    forward_allowed_peers: String = binx_core::peers::LOOPBACK_PEERS.into(), env "BINX_FORWARD_ALLOWED_PEERS";
    /// Remote sidecars the proxy consumer keeps connections to at most; the least recently used is dropped past it, and one unused for 10 minutes is forgotten.
    forward_max_remotes: u64 = 1024, env "BINX_FORWARD_MAX_REMOTES";
    /// Time a BinX peer has to send its preface, and then (with shared_secret, on TCP) its HELLO; before its HELLO a peer may send frames of at most 16KiB.
    handshake_timeout: HumanDuration = HumanDuration(Duration::from_secs(10)), env "BINX_HANDSHAKE_TIMEOUT";
    /// A BinX connection with no request outstanding that sends nothing for this long is closed (clients reconnect on their next request); 0s never closes.
    idle_timeout: HumanDuration = HumanDuration(Duration::from_secs(300)), env "BINX_IDLE_TIMEOUT";
    /// A BinX connection whose replies cannot be written for this long (its peer made no room for them in the socket's buffers) is closed, freeing the replies (and the memory and read-budget room) it held. 0s never closes.
    write_stall_timeout: HumanDuration = HumanDuration(Duration::from_secs(60)), env "BINX_WRITE_STALL_TIMEOUT";
    /// A BinX frame larger than a small receive buffer (64KiB: in practice an ENQUEUE on the Unix socket) must arrive whole within this long of binxd taking room for it, else its connection is closed. Such frames are received within a budget all connections share (a sixteenth of memory_limit, 4-64MiB; a larger frame alone), so a peer stalled inside one gives its room back to the others; they wait for it at most this long, which is why it is short (a local frame arrives in milliseconds) and below clients' request timeouts (binx-client: 10s).
    frame_timeout: HumanDuration = HumanDuration(Duration::from_secs(5)), env "BINX_FRAME_TIMEOUT";
    /// HTTP connections open at once; at it, those that asked nothing for a second are closed, and new ones are not accepted until one closes (they wait in the listen backlog; never a 503, which fails an engine's query). binxd lowers it, if it must, so that HTTP never takes the file descriptors the BinX listeners need.
    http_max_connections: u64 = 1024, env "BINX_HTTP_MAX_CONNECTIONS";
    /// HTTP exchange GETs that may wait for pages at once (over all connections and HTTP/2 streams); past it a GET of a buffer with pages is answered at once, and one with nothing yet waits up to 2 s for one to end, then is answered with what is held (204 when nothing), so a client polls instead of holding memory in binxd, without spinning.
    http_max_long_polls: u64 = 4096, env "BINX_HTTP_MAX_LONG_POLLS";
    /// Time an HTTP client has to send a whole request head; it also bounds how long a keep-alive connection may wait between requests (the timer starts when the server waits for a head). Longer than the engines' exchange clients keep an idle connection (30 s), so they close it first and never send a request on one binxd is closing.
    http_header_read_timeout: HumanDuration = HumanDuration(Duration::from_secs(45)), env "BINX_HTTP_HEADER_READ_TIMEOUT";
    /// An HTTP connection that moves no byte for this long is closed, and so is one holding a response that made no progress for this long (an HTTP/2 client granting no window); it must exceed max_wait, the longest long-poll.
    http_idle_timeout: HumanDuration = HumanDuration(Duration::from_secs(60)), env "BINX_HTTP_IDLE_TIMEOUT";
    /// Spool policy of tasks that name none: off, overflow (pages that do not fit in memory, or that slow consumers leave for spool_overflow_age, go to storage) always (every page is in storage before ENQUEUE is answered) or commit (as overflow, and NO_MORE_PAGES is answered once the buffer's pages are in storage under a commit marker; they stay in memory too until room is wanted: the Trino exchange plugin's policy).
    default_spool_policy: Text<SpoolPolicy> = Text(SpoolPolicy::Off), env "BINX_DEFAULT_SPOOL_POLICY";
    /// Directory for binxd's files; "auto" is a "data" directory beside uds_path (or under the temp dir).
    data_dir: String = AUTO.into(), env "BINX_DATA_DIR";
    /// host:port under which other sidecars reach this one's BinX listener, written into commit markers: a proxy consumer serves a committed buffer from storage only to clients that name this address (or a remote that said in HELLO it is this node). "auto" is tcp_listen, or the host name with its port when tcp_listen is a wildcard address; the Helm chart sets the pod IP.
    advertise_address: String = AUTO.into(), env "BINX_ADVERTISE_ADDRESS";
    /// Spool store URLs, comma-separated (file:///dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, memory://); tasks are spread over them. "auto" is file://<data_dir>/spool; empty disables spooling.
    spool_stores: String = AUTO.into(), env "BINX_SPOOL_STORES";
    /// This daemon's name in spool object names (the pod name); "auto" is the host name. Must be unique in the cluster (two sidecars on one host need names of their own). A restart prunes the overflow objects its node name left, and a DELETE reaching it for a task it does not know releases committed output its node name wrote.
    spool_node_name: String = AUTO.into(), env "BINX_SPOOL_NODE_NAME";
    /// Size a segment of coalesced pages aims at first.
    spool_segment_target: ByteSize = ByteSize(8 << 20), env "BINX_SPOOL_SEGMENT_TARGET";
    /// Size segments grow to after a buffer's first; a larger page is an object of its own.
    spool_segment_max: ByteSize = ByteSize(16 << 20), env "BINX_SPOOL_SEGMENT_MAX";
    /// Compression of spooled segments: none, lz4 or zstd (clients that do not accept it are served inline).
    spool_codec: Text<Codec> = Text(Codec::None), env "BINX_SPOOL_CODEC";
    /// AES-256-GCM with a fresh key per segment, carried only in replies: auto (on for s3, gs and az stores), on or off.
    spool_encryption: Text<Encryption> = Text(Encryption::Auto), env "BINX_SPOOL_ENCRYPTION";
    /// Spooled objects older than this are pruned, whatever their state.
    spool_ttl: HumanDuration = HumanDuration(Duration::from_secs(12 * 3600)), env "BINX_SPOOL_TTL";
    /// storage: clients that accept spooled segments get presigned URLs (S3, GCS, Azure); proxy: binxd always reads objects and replies inline.
    spool_retrieval: Text<Retrieval> = Text(Retrieval::Storage), env "BINX_SPOOL_RETRIEVAL";
    /// Longest validity of a presigned URL.
    spool_presign_valid_for: HumanDuration = HumanDuration(Duration::from_secs(3600)), env "BINX_SPOOL_PRESIGN_VALID_FOR";
    /// Policy overflow: pages held longer than this go to storage even when memory has room.
    spool_overflow_age: HumanDuration = HumanDuration(Duration::from_secs(30)), env "BINX_SPOOL_OVERFLOW_AGE";
    /// Segment writes in flight at once (spills, and the last pages a commit writes), over all shards: each shard gets its share, at least one. 0 (auto): 16 a shard, at most 128 in all unless there are more shards (a commit of N buffers waits for N / that rounds of writes: on S3, of PUTs). At most 256 (each holds a connection or a blocking thread, two for a compressed or encrypted file:// segment; a file:// store's small plain segments are written 32 to a job). Whatever the count, past a shard's first write in flight the writes hold at most two spool_segment_max of pages over all shards (each shard its share), so many small writes (a commit's buffers) run at once and 16 MiB spills as before (two with one shard, one a shard with more).
    spool_spill_concurrency: u64 = 0, env "BINX_SPOOL_SPILL_CONCURRENCY";
    /// Policies always and commit: a PARTITIONED task's task-wide NO_MORE_PAGES writes its buffers' commit markers inside the task's manifest (format 2: one object instead of one a buffer). binxd builds from before format 2 (2026-11-30) cannot read it: while a cluster is upgraded from such builds, set false until every sidecar runs a newer one.
    spool_fold_markers: bool = true, env "BINX_SPOOL_FOLD_MARKERS";
    /// file:// stores: a policy commit task's small plain segments written at once to be committed (its task-wide NO_MORE_PAGES writes one a buffer) go into one file, each a byte range of it (named FILE@OFFSET in markers, which then have format 2, and manifests format 3): creating a file each is most of what a wide commit costs. binxd builds from before packing (2026-11-30) cannot read such markers: while a cluster is upgraded from such builds, set false until every sidecar runs a newer one (and for a spool_ttl before rolling a node back to one: its startup prune would take packs as leftovers).
    spool_pack_segments: bool = true, env "BINX_SPOOL_PACK_SEGMENTS";
    /// Policies always and commit, proxy consumer: once the producing binxd has not answered for this long, a committed buffer is read from storage (timed per remote: after that, its other buffers fail over at their first unanswered request; and at once, for ten times this long, after the remote was seen to restart).
    spool_failover_after: HumanDuration = HumanDuration(Duration::from_secs(30)), env "BINX_SPOOL_FAILOVER_AFTER";
    /// Longest one store request may take, retries included. A file:// store fails a file system job once it went this long without an answer: binxd's own segment and marker writes report each file and write call, so a large batch on a slow disk is waited for; a read, a delete, a manifest or release record, a listing step and the pruner's cleanup have this long in all. A hung network mount so fails the request (BUSY to a producer, a retryable error to a reader) instead of holding it for as long as the mount hangs; at most 64 such jobs a store stay unfinished, their threads stuck in the kernel (two for a sealed segment's), and past that a job fails without being started.
    spool_request_timeout: HumanDuration = HumanDuration(Duration::from_secs(10)), env "BINX_SPOOL_REQUEST_TIMEOUT";
    /// S3-compatible endpoint (e.g. http://minio:9000); requests are then path-style. Empty: AWS (or AWS_ENDPOINT).
    spool_s3_endpoint: String = String::new(), env "BINX_SPOOL_S3_ENDPOINT";
    /// S3 region; empty: AWS_REGION or AWS_DEFAULT_REGION.
    spool_s3_region: String = String::new(), env "BINX_SPOOL_S3_REGION";
    /// S3 access key id; empty: AWS_ACCESS_KEY_ID (or instance and web identity credentials).
    spool_s3_access_key_id: String = String::new(), env "BINX_SPOOL_S3_ACCESS_KEY_ID";
    /// S3 secret access key; empty: AWS_SECRET_ACCESS_KEY.
    spool_s3_secret_access_key: String = String::new(), env "BINX_SPOOL_S3_SECRET_ACCESS_KEY";
    /// Allow plain http:// store endpoints (test and in-cluster servers).
    spool_allow_http: bool = false, env "BINX_SPOOL_ALLOW_HTTP";
    /// Log format: text or json.
    log_format: LogFormat = LogFormat::Text, env "BINX_LOG_FORMAT";
    /// Log filter, e.g. info, debug, or binx_server=debug,info.
    log_level: String = "info".into(), env "BINX_LOG_LEVEL";
}

impl Config {
    /// Defaults, then `file` (if any), then `overrides`; checked for sense,
    /// then loaded once into what binxd runs with ([`Settings`]).
    pub fn load(file: Option<&Path>, overrides: &ConfigOverrides) -> anyhow::Result<Settings> {
        let mut config = Config::default();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the config file {}", path.display()))?;
            let parsed: ConfigFile = toml::from_str(&text)
                .with_context(|| format!("the config file {} is not valid", path.display()))?;
            config.apply_file(parsed);
        }
        config.apply_overrides(overrides);
        config.check()?;
        config.settings()
    }

    /// Builds every part once: a TLS file is read, a group looked up, the
    /// spool and shared-memory geometry checked here and nowhere else.
    fn settings(self) -> anyhow::Result<Settings> {
        let spool = self.spool_config()?;
        let client_tls = self.client_tls()?;
        Ok(Settings {
            core: self.core_config()?,
            listen: self.listen_config()?,
            forwarder: self.forwarder(client_tls)?,
            admin_uds: self.admin_uds(),
            http_limits: self.http_limits(),
            spool,
            config: self,
        })
    }

    fn check(&self) -> anyhow::Result<()> {
        // It goes into every HELLO reply, whose header clients cap.
        if self.name.len() > MAX_NAME_LEN {
            bail!(
                "name is {} bytes; it may be at most {MAX_NAME_LEN} (it goes into every HELLO reply)",
                self.name.len()
            );
        }
        if self.memory_limit.0 == 0 {
            bail!("memory_limit must be above 0");
        }
        if self.task_memory_limit.0 == 0 {
            bail!("task_memory_limit must be above 0");
        }
        if self.max_frame_size.0 < 1024 || self.max_frame_size.0 > u64::from(u32::MAX) {
            bail!(
                "max_frame_size is {}; it must be between 1KiB and 4GiB - 1",
                self.max_frame_size
            );
        }
        self.check_ranges()?;
        let policy = self.default_spool_policy.0;
        if policy != SpoolPolicy::Off && self.spool_stores.trim().is_empty() {
            bail!(
                "default_spool_policy is \"{policy}\", but spool_stores is empty; set a store or use \"off\""
            );
        }
        if !self.admin_listen.is_empty() && self.shared_secret.is_empty() {
            let loopback = self
                .admin_listen
                .parse::<std::net::SocketAddr>()
                .is_ok_and(|a| a.ip().is_loopback())
                || self.admin_listen.starts_with("localhost:");
            if !loopback {
                bail!(
                    "admin_listen {} is not a loopback address and shared_secret is empty: anyone who reaches it could abort tasks; set shared_secret or listen on 127.0.0.1",
                    self.admin_listen
                );
            }
        }
        if self.tcp_listen.is_empty() && self.uds_path.is_empty() {
            bail!("tcp_listen and uds_path are both empty: binxd would have nothing to serve");
        }
        Ok(())
    }

    /// Numbers and durations within what binxd can honour: each key out of
    /// its range is refused by name (a typo such as `1000000000` connections
    /// or a TTL of a century fails at start, not in production).
    fn check_ranges(&self) -> anyhow::Result<()> {
        const KIB: u64 = 1 << 10;
        const MIB: u64 = 1 << 20;
        const GIB: u64 = 1 << 30;
        let counts: [(&str, u64, u64, u64); 13] = [
            ("max_connections", self.max_connections, 1, 1 << 20),
            ("shm_max_connections", self.shm_max_connections, 1, 4096),
            (
                "max_outstanding_requests",
                self.max_outstanding_requests,
                1,
                1 << 16,
            ),
            (
                "max_buffers_per_task",
                self.max_buffers_per_task,
                1,
                1 << 20,
            ),
            (
                "max_pages_per_enqueue",
                self.max_pages_per_enqueue,
                1,
                1 << 20,
            ),
            (
                "max_pages_per_buffer",
                self.max_pages_per_buffer,
                1,
                1 << 26,
            ),
            (
                "forward_connections_per_remote",
                self.forward_connections_per_remote,
                0,
                64,
            ),
            ("forward_max_remotes", self.forward_max_remotes, 1, 1 << 16),
            ("shards", self.shards, 0, binx_core::MAX_SHARDS as u64),
            (
                "runtime_threads",
                self.runtime_threads,
                0,
                MAX_RUNTIME_THREADS,
            ),
            (
                "spool_spill_concurrency",
                self.spool_spill_concurrency,
                0,
                256,
            ),
            (
                "http_max_connections",
                self.http_max_connections,
                1,
                1 << 20,
            ),
            ("http_max_long_polls", self.http_max_long_polls, 0, 1 << 20),
        ];
        for (key, value, min, max) in counts {
            within(key, value, min, max)?;
        }
        let sizes: [(&str, ByteSize, u64, u64); 4] = [
            ("memory_limit", self.memory_limit, MIB, 1 << 40),
            (
                "task_memory_limit",
                self.task_memory_limit,
                64 * KIB,
                1 << 40,
            ),
            ("default_reply_size", self.default_reply_size, KIB, GIB),
            ("shm_region_size", self.shm_region_size, 64 * KIB, 4 * GIB),
        ];
        for (key, value, min, max) in sizes {
            within(key, value, ByteSize(min), ByteSize(max))?;
        }
        let secs = Duration::from_secs;
        let durations: [(&str, HumanDuration, Duration, Duration); 14] = [
            ("max_wait", self.max_wait, Duration::ZERO, secs(600)),
            (
                "drain_grace",
                self.drain_grace,
                Duration::ZERO,
                secs(24 * 3600),
            ),
            (
                "abandon_after",
                self.abandon_after,
                secs(1),
                secs(7 * 24 * 3600),
            ),
            (
                "handshake_timeout",
                self.handshake_timeout,
                Duration::from_millis(100),
                secs(600),
            ),
            (
                "idle_timeout",
                self.idle_timeout,
                Duration::ZERO,
                secs(7 * 24 * 3600),
            ),
            (
                "write_stall_timeout",
                self.write_stall_timeout,
                Duration::ZERO,
                secs(24 * 3600),
            ),
            (
                "frame_timeout",
                self.frame_timeout,
                Duration::from_millis(100),
                secs(3600),
            ),
            (
                "http_header_read_timeout",
                self.http_header_read_timeout,
                Duration::from_millis(100),
                secs(600),
            ),
            (
                "http_idle_timeout",
                self.http_idle_timeout,
                secs(1),
                secs(24 * 3600),
            ),
            ("spool_ttl", self.spool_ttl, secs(1), secs(30 * 24 * 3600)),
            (
                "spool_presign_valid_for",
                self.spool_presign_valid_for,
                secs(1),
                secs(7 * 24 * 3600),
            ),
            (
                "spool_overflow_age",
                self.spool_overflow_age,
                Duration::ZERO,
                secs(24 * 3600),
            ),
            (
                "spool_failover_after",
                self.spool_failover_after,
                Duration::ZERO,
                secs(24 * 3600),
            ),
            (
                "spool_request_timeout",
                self.spool_request_timeout,
                Duration::from_millis(100),
                secs(3600),
            ),
        ];
        for (key, value, min, max) in durations {
            within(key, value, HumanDuration(min), HumanDuration(max))?;
        }
        if !self.idle_timeout.0.is_zero() && self.idle_timeout.0 <= self.max_wait.0 {
            bail!(
                "idle_timeout ({}) must be longer than max_wait ({}), or 0s",
                self.idle_timeout,
                self.max_wait
            );
        }
        if self.http_idle_timeout.0 <= self.max_wait.0 {
            bail!(
                "http_idle_timeout ({}) must be longer than max_wait ({}), the longest long-poll",
                self.http_idle_timeout,
                self.max_wait
            );
        }
        self.forward_allowed()?;
        Ok(())
    }

    /// The remotes the proxy consumer may forward to.
    pub fn forward_allowed(&self) -> anyhow::Result<binx_core::PeerAllowList> {
        self.forward_allowed_peers
            .parse()
            .map_err(|e| anyhow::anyhow!("forward_allowed_peers: {e}"))
    }

    /// What the HTTP endpoint lets one client hold.
    fn http_limits(&self) -> binx_server::http::HttpLimits {
        binx_server::http::HttpLimits {
            max_connections: self.http_max_connections as usize,
            max_long_polls: self.http_max_long_polls as usize,
            header_read_timeout: self.http_header_read_timeout.0,
            idle_timeout: self.http_idle_timeout.0,
        }
    }

    /// The configuration as TOML, with the secrets hidden: a secret that is
    /// set is a comment (so the output, saved as a file, does not set it to
    /// a placeholder that would fail every peer's authentication).
    pub fn to_toml(&self) -> String {
        const HIDDEN: &str = "\u{1}hidden\u{1}";
        let mut shown = self.clone();
        for secret in [
            &mut shown.shared_secret,
            &mut shown.spool_s3_secret_access_key,
        ] {
            if !secret.is_empty() {
                *secret = HIDDEN.into();
            }
        }
        let text = match toml::to_string(&shown) {
            Ok(text) => text,
            Err(e) => return format!("# cannot render the config: {e}\n"),
        };
        let hidden = toml_value(&HIDDEN.to_string());
        text.lines()
            .map(|line| match line.strip_suffix(&format!(" = {hidden}")) {
                Some(key) => format!(
                    "# {key} is set (hidden); give it again in this file or with {} (a flag would show it in the process list)",
                    format_args!("BINX_{}", key.to_uppercase())
                ),
                None => line.to_string(),
            })
            .map(|line| line + "\n")
            .collect()
    }

    /// `BINX_*` environment variables binxd does not know (a misspelt
    /// key would otherwise be ignored without a word): each with why.
    /// Variables of binx's own scripts and tools are not listed.
    pub fn unknown_environment() -> Vec<String> {
        let known: Vec<&str> = Config::keys().iter().map(|(_, env, _, _)| *env).collect();
        let tools = [
            "BINX_CONFIG",
            "BINX_ADMIN",
            "BINX_BLESS",
            "BINX_BINXD",
            "BINX_BIN_DIR",
        ];
        let tool_prefixes = ["BINX_BENCH_", "BINX_TEST_", "BINX_VM_", "BINX_JAVA"];
        let mut unknown: Vec<String> = std::env::vars_os()
            .filter_map(|(name, _)| name.into_string().ok())
            .filter(|name| name.starts_with("BINX_"))
            .filter(|name| !known.contains(&name.as_str()) && !tools.contains(&name.as_str()))
            .filter(|name| !tool_prefixes.iter().any(|p| name.starts_with(p)))
            .collect();
        unknown.sort();
        unknown
    }

    /// Bytes of objects read back from storage binxd may hold, for the
    /// read cache and again for replies and read-aheads: a sixteenth of
    /// `memory_limit` each, between 1 MiB and 32 MiB (docs/SECURITY.md).
    fn read_back_bytes(&self) -> u64 {
        (self.memory_limit.0 / 16).clamp(1 << 20, 32 << 20)
    }

    /// Shards of the exchange core: `shards`, or with 0 one per core
    /// binxd may use (its CPU affinity), at most [`binx_core::MAX_SHARDS`].
    pub fn shard_count(&self) -> usize {
        let cores = || std::thread::available_parallelism().map_or(1, |n| n.get());
        match self.shards {
            0 => cores().min(binx_core::MAX_SHARDS),
            n => (n as usize).min(binx_core::MAX_SHARDS),
        }
    }

    /// Worker threads of the async runtime: `runtime_threads`, or with 0
    /// one per core binxd may use (its CPU affinity), at most 1024.
    pub fn runtime_thread_count(&self) -> usize {
        match self.runtime_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n as usize,
        }
        .min(MAX_RUNTIME_THREADS as usize)
    }

    /// The exchange core's limits (the spool's part is filled in from the
    /// spool itself when binxd opens it).
    fn core_config(&self) -> anyhow::Result<CoreConfig> {
        Ok(CoreConfig {
            max_stored_reply_size: self.read_back_bytes(),
            memory_limit: self.memory_limit.0,
            task_memory_limit: self.task_memory_limit.0,
            max_wait: self.max_wait.0,
            default_reply_size: self.default_reply_size.0,
            max_reply_size: (self.max_frame_size.0)
                .saturating_sub(64 << 10)
                .max(1 << 20),
            abandon_after: self.abandon_after.0,
            max_buffers_per_task: self.max_buffers_per_task,
            max_pages_per_enqueue: usize::try_from(self.max_pages_per_enqueue)
                .unwrap_or(usize::MAX),
            default_spool_policy: self.default_spool_policy.0,
            max_outstanding_per_connection: self.max_outstanding_requests as usize,
            max_pages_per_log: self.max_pages_per_buffer,
            forward_allowed_peers: self.forward_allowed()?,
            spool: Some(binx_core::config::SpoolRules {
                spill_after: self.spool_overflow_age.0,
                // At most 256 (checked with the other limits).
                spill_concurrency: usize::try_from(self.spool_spill_concurrency)
                    .unwrap_or(binx_core::config::AUTO_SPILL_CONCURRENCY),
                fold_markers: self.spool_fold_markers,
                ..Default::default()
            }),
            ..CoreConfig::default()
        })
    }

    /// Where binxd keeps its files.
    pub fn data_dir(&self) -> PathBuf {
        if self.data_dir != AUTO {
            return PathBuf::from(&self.data_dir);
        }
        let beside = Path::new(&self.uds_path)
            .parent()
            .filter(|_| !self.uds_path.is_empty());
        beside
            .map(Path::to_path_buf)
            .unwrap_or_else(|| std::env::temp_dir().join("binx"))
            .join("data")
    }

    /// The spool, or `None` when `spool_stores` is empty.
    fn spool_config(&self) -> anyhow::Result<Option<SpoolConfig>> {
        let stores: Vec<String> = match self.spool_stores.trim() {
            "" => return Ok(None),
            AUTO => vec![format!(
                "file://{}",
                self.data_dir().join("spool").display()
            )],
            list => list
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
        };
        let node_name = if self.spool_node_name == AUTO {
            host_name()
        } else {
            binx_spool::validate_node_name(&self.spool_node_name)
                .map_err(|e| anyhow::anyhow!("spool_node_name: {e}"))?;
            self.spool_node_name.clone()
        };
        if self.spool_segment_target.0 == 0
            || self.spool_segment_max.0 < self.spool_segment_target.0
        {
            bail!(
                "spool_segment_target ({}) must be above 0 and at most spool_segment_max ({})",
                self.spool_segment_target,
                self.spool_segment_max
            );
        }
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        Ok(Some(SpoolConfig {
            endpoint: self.advertised()?,
            stores,
            options: StoreOptions {
                s3_endpoint: non_empty(&self.spool_s3_endpoint),
                s3_region: non_empty(&self.spool_s3_region),
                s3_access_key_id: non_empty(&self.spool_s3_access_key_id),
                s3_secret_access_key: non_empty(&self.spool_s3_secret_access_key),
                allow_http: self.spool_allow_http,
                request_timeout: self.spool_request_timeout.0,
            },
            node_name,
            segment_target_bytes: self.spool_segment_target.0,
            segment_max_bytes: self.spool_segment_max.0,
            codec: self.spool_codec.0,
            encryption: self.spool_encryption.0,
            ttl: self.spool_ttl.0,
            retrieval: self.spool_retrieval.0,
            presign_valid_for: self.spool_presign_valid_for.0,
            failover_after: self.spool_failover_after.0,
            pack_segments: self.spool_pack_segments,
            read_cache_bytes: self.read_back_bytes(),
            read_budget_bytes: self.read_back_bytes(),
            // Keys in commit markers are wrapped with the cluster's secret.
            key_wrap: non_empty(&self.shared_secret).map(|s| binx_spool::KeyWrap::from_secret(&s)),
            ..SpoolConfig::default()
        }))
    }

    /// Where the admin socket goes, if anywhere.
    fn admin_uds(&self) -> Option<PathBuf> {
        match self.admin_uds_path.as_str() {
            "" => None,
            ADMIN_UDS_AUTO if self.uds_path.is_empty() => None,
            ADMIN_UDS_AUTO => Some(admin_uds_beside(Path::new(&self.uds_path))),
            path => Some(PathBuf::from(path)),
        }
    }

    /// Who may use the Unix socket, from `uds_mode`, `uds_group` and
    /// `uds_allowed_uids`.
    fn uds_access(&self) -> anyhow::Result<UdsAccess> {
        let digits = self.uds_mode.trim();
        let mode = u32::from_str_radix(digits.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .with_context(|| {
                format!("uds_mode is {digits:?}; it must be octal permission bits such as 0660")
            })?;
        let group = match self.uds_group.trim() {
            "" => None,
            name => Some(group_id(name)?),
        };
        let allowed_uids = self
            .uds_allowed_uids
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u32>().with_context(|| {
                    format!(
                        "uds_allowed_uids has {s:?}; it must list numeric uids, comma-separated"
                    )
                })
            })
            .collect::<anyhow::Result<Vec<u32>>>()?;
        Ok(UdsAccess {
            mode,
            group,
            allowed_uids,
        })
    }

    /// The TCP listener's TLS, when `tls_cert` and `tls_key` are set.
    fn server_tls(&self) -> anyhow::Result<Option<std::sync::Arc<rustls::ServerConfig>>> {
        match (self.tls_cert.is_empty(), self.tls_key.is_empty()) {
            (true, true) => {
                if self.tls_client_auth {
                    bail!("tls_client_auth is on, but tls_cert and tls_key are not set");
                }
                Ok(None)
            }
            (false, false) => {
                let client_ca = match (self.tls_client_auth, self.tls_ca.is_empty()) {
                    (false, _) => None,
                    (true, false) => Some(Path::new(&self.tls_ca)),
                    (true, true) => bail!("tls_client_auth is on, but tls_ca is not set"),
                };
                crate::tls::server_config(
                    Path::new(&self.tls_cert),
                    Path::new(&self.tls_key),
                    client_ca,
                )
                .map(Some)
            }
            _ => bail!("tls_cert and tls_key go together: set both, or neither"),
        }
    }

    /// TLS of the forwarder's connections to remotes, when `tls_ca` is set.
    fn client_tls(&self) -> anyhow::Result<Option<std::sync::Arc<rustls::ClientConfig>>> {
        if self.tls_ca.is_empty() {
            return Ok(None);
        }
        let identity = (!self.tls_cert.is_empty() && !self.tls_key.is_empty())
            .then(|| (Path::new(&self.tls_cert), Path::new(&self.tls_key)));
        Ok(Some(binx_client::tls::client_config(
            Path::new(&self.tls_ca),
            identity,
        )?))
    }

    /// The shared memory regions offered to Unix socket clients.
    fn shm_config(&self) -> anyhow::Result<binx_shm::ShmConfig> {
        let config = binx_shm::ShmConfig {
            region_size: usize::try_from(self.shm_region_size.0).unwrap_or(usize::MAX),
            slot_size: usize::try_from(self.shm_slot_size.0).unwrap_or(usize::MAX),
            spin: self.shm_spin.0,
        };
        binx_shm::Layout::new(config.region_size, config.slot_size).with_context(|| {
            format!(
                "shm_region_size {} and shm_slot_size {} do not make a region",
                self.shm_region_size, self.shm_slot_size
            )
        })?;
        if config.spin > Duration::from_millis(10) {
            bail!(
                "shm_spin is {}; at most 10ms, or a core burns while idle",
                self.shm_spin
            );
        }
        Ok(config)
    }

    /// The address other sidecars reach this one under, once the TCP
    /// listener bound `bound`: advertise_address, or (auto) the bound
    /// address, with the host name for a wildcard.
    pub fn advertised_for(&self, bound: Option<std::net::SocketAddr>) -> anyhow::Result<String> {
        if self.advertise_address != AUTO {
            return self.advertised();
        }
        let Some(bound) = bound else {
            return Ok(String::new());
        };
        Ok(if bound.ip().is_unspecified() {
            format!("{}:{}", host_name(), bound.port())
        } else {
            bound.to_string()
        })
    }

    /// The address other sidecars reach this one under (advertise_address).
    pub fn advertised(&self) -> anyhow::Result<String> {
        if self.advertise_address != AUTO {
            return binx_core::request::parse_remote(&self.advertise_address)
                .map_err(|e| anyhow::anyhow!("advertise_address: {e}"));
        }
        let Some((host, port)) = self.tcp_listen.rsplit_once(':') else {
            return Ok(String::new());
        };
        let wildcard = matches!(host, "0.0.0.0" | "[::]" | "::" | "");
        Ok(if wildcard {
            format!("{}:{port}", host_name())
        } else {
            self.tcp_listen.clone()
        })
    }

    /// The proxy consumer's forwarder, unless forwarding is off; a TLS
    /// setting that does not load is an error, never plain TCP.
    fn forwarder(
        &self,
        client_tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    ) -> anyhow::Result<Option<std::sync::Arc<dyn binx_server::Forwarder>>> {
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        if self.forward_connections_per_remote == 0 {
            return Ok(None);
        }
        Ok(Some(
            std::sync::Arc::new(crate::forwarder::PoolForwarder::new(
                self.forward_connections_per_remote as usize,
                self.forward_max_remotes as usize,
                non_empty(&self.shared_secret),
                client_tls,
            )) as std::sync::Arc<dyn binx_server::Forwarder>,
        ))
    }

    /// The listeners' configuration; any setting that does not load (a TLS
    /// file, the socket's group, the shared memory geometry) is an error
    /// that names its key, never a listener without it.
    fn listen_config(&self) -> anyhow::Result<ListenConfig> {
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        Ok(ListenConfig {
            tcp: non_empty(&self.tcp_listen),
            uds: non_empty(&self.uds_path).map(PathBuf::from),
            uds_access: self.uds_access()?,
            tls: self.server_tls()?,
            kernel_tls: self.tls_kernel,
            max_connections: self.max_connections as usize,
            connection: ConnectionConfig {
                shared_secret: non_empty(&self.shared_secret),
                max_frame_length: self.max_frame_size.0 as usize,
                max_outstanding_requests: self.max_outstanding_requests as usize,
                server_name: self.name.clone(),
                handshake_timeout: self.handshake_timeout.0,
                idle_timeout: (!self.idle_timeout.0.is_zero()).then_some(self.idle_timeout.0),
                write_stall_timeout: (!self.write_stall_timeout.0.is_zero())
                    .then_some(self.write_stall_timeout.0),
                frame_timeout: self.frame_timeout.0,
                shm: if self.shm_enabled {
                    Some(self.shm_config()?)
                } else {
                    None
                },
                shm_max_connections: self.shm_max_connections as usize,
            },
        })
    }
}

/// docs/CONFIG.md, generated from the key table so the reference cannot
/// drift from what binxd reads (a test compares the two).
pub fn reference_markdown() -> String {
    let temp = std::env::temp_dir().display().to_string();
    let mut out = String::from(
        "<!-- Generated from crates/binx-sidecar/src/config.rs by the test \
         config::tests::docs_config_md_is_the_generated_reference; \
         BINX_BLESS=1 cargo test -p binx-sidecar docs_config_md rewrites it. -->\n\n\
         # binxd configuration reference\n\n\
         binxd needs no configuration. Each key below can come from a TOML file \
         (`--config FILE` or `BINX_CONFIG`), from its environment variable, or from \
         its flag (the key with dashes: `--memory-limit 2GiB`). A later source \
         overrides an earlier one: the default, the file, the environment, the \
         flags. `binxd --print-config` prints the result as TOML (a secret that is \
         set as a comment: give it again); `binxd --list-config-keys` prints this \
         table as tab-separated text. An unknown key in the file stops binxd; an \
         unknown `BINX_*` variable is named in a warning at start. Every number \
         and duration has a range; one outside it stops binxd, naming the key.\n\n\
         Sizes are written like `4096`, `64KiB`, `16MiB`, `1GiB` or `1GB`. \
         Durations are written like `250ms`, `10s`, `5m` or `1h`. \
         Operations (how the settings fit together): [OPERATIONS.md](OPERATIONS.md).\n\n\
         | key | environment | default | meaning |\n|---|---|---|---|\n",
    );
    for (key, env, default, doc) in Config::keys() {
        // The default socket lies under the build machine's temp dir.
        let default = default.replace(&temp, "$TMPDIR");
        let doc = doc.replace('|', "\\|");
        out.push_str(&format!("| `{key}` | `{env}` | `{default}` | {doc} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docs_config_md_is_the_generated_reference() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/CONFIG.md");
        let generated = reference_markdown();
        if std::env::var_os("BINX_BLESS").is_some() {
            std::fs::write(&path, &generated).unwrap();
        }
        let written = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            written == generated,
            "docs/CONFIG.md is not the key table of config.rs: run BINX_BLESS=1 cargo test -p binx-sidecar docs_config_md"
        );
        // Every key is there, with its environment variable.
        for (key, env, _, _) in Config::keys() {
            assert!(written.contains(&format!("| `{key}` | `{env}` |")), "{key}");
        }
    }

    /// A config file in a directory of its own, removed when dropped.
    struct ConfigFile(std::path::PathBuf);

    impl ConfigFile {
        fn new(label: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("binx-{label}-test-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            ConfigFile(dir)
        }

        /// Loads `text` as binxd.toml, with no overrides.
        fn load(&self, text: &str) -> anyhow::Result<Settings> {
            let path = self.0.join("binxd.toml");
            std::fs::write(&path, text).unwrap();
            Config::load(Some(&path), &ConfigOverrides::default())
        }
    }

    impl Drop for ConfigFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn shards_default_to_the_cores_and_stay_within_their_range() {
        let file = ConfigFile::new("shards");
        let load = |text: &str| file.load(text);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(load("").unwrap().config.shard_count(), cores.min(256));
        assert_eq!(load("shards = 3\n").unwrap().config.shard_count(), 3);
        assert_eq!(load("shards = 256\n").unwrap().config.shard_count(), 256);
        let err = format!("{:#}", load("shards = 257\n").unwrap_err());
        assert!(
            err.contains("shards is 257; it must be between 0 and 256"),
            "{err}"
        );
    }

    #[test]
    fn runtime_threads_default_to_the_cores_and_stay_within_their_range() {
        let file = ConfigFile::new("runtime-threads");
        let load = |text: &str| file.load(text);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = |text: &str| load(text).unwrap().config.runtime_thread_count();
        assert_eq!(threads(""), cores);
        assert_eq!(threads("runtime_threads = 1\n"), 1);
        assert_eq!(threads("runtime_threads = 1024\n"), 1024);
        let err = format!("{:#}", load("runtime_threads = 1025\n").unwrap_err());
        assert!(
            err.contains("runtime_threads is 1025; it must be between 0 and 1024"),
            "{err}"
        );
    }

    #[test]
    fn spill_concurrency_is_auto_by_default_and_stays_within_its_range() {
        let file = ConfigFile::new("spills");
        let load = |text: &str| file.load(text);
        let spills = |text: &str| {
            let config = load(text).unwrap().config.core_config().unwrap();
            config.spool.unwrap().spill_concurrency
        };
        assert_eq!(spills(""), binx_core::config::AUTO_SPILL_CONCURRENCY);
        assert_eq!(spills("spool_spill_concurrency = 256\n"), 256);
        let err = format!("{:#}", load("spool_spill_concurrency = 257\n").unwrap_err());
        assert!(
            err.contains("spool_spill_concurrency is 257; it must be between 0 and 256"),
            "{err}"
        );
    }

    #[test]
    fn file_then_overrides_win_and_bad_values_are_named() {
        let dir = std::env::temp_dir().join(format!("binx-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("binxd.toml");
        std::fs::write(
            &path,
            "memory_limit = \"2GiB\"\nmax_wait = \"3s\"\nname = \"from-file\"\n",
        )
        .unwrap();
        let overrides = ConfigOverrides {
            name: Some("from-flag".into()),
            ..Default::default()
        };
        let config = Config::load(Some(&path), &overrides).unwrap().config;
        assert_eq!(config.memory_limit, ByteSize(2 << 30));
        assert_eq!(config.max_wait, HumanDuration(Duration::from_secs(3)));
        assert_eq!(config.name, "from-flag");
        assert_eq!(config.task_memory_limit, ByteSize(256 << 20));

        std::fs::write(&path, "memory_limt = 5\n").unwrap();
        let err = format!(
            "{:#}",
            Config::load(Some(&path), &ConfigOverrides::default()).unwrap_err()
        );
        assert!(err.contains("memory_limt"), "{err}");
        std::fs::write(&path, "memory_limit = \"much\"\n").unwrap();
        let err = format!(
            "{:#}",
            Config::load(Some(&path), &ConfigOverrides::default()).unwrap_err()
        );
        assert!(err.contains("is not a size"), "{err}");
        // Enum settings are parsed where they are read, naming the key and
        // the values that would do.
        for (text, key, hint) in [
            (
                "default_spool_policy = \"sometimes\"\n",
                "default_spool_policy",
                "overflow",
            ),
            ("spool_codec = \"gzip\"\n", "spool_codec", "lz4"),
            ("spool_encryption = \"maybe\"\n", "spool_encryption", "auto"),
            ("spool_retrieval = \"fax\"\n", "spool_retrieval", "proxy"),
            ("log_format = \"xml\"\n", "log_format", "json"),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = format!(
                "{:#}",
                Config::load(Some(&path), &ConfigOverrides::default()).unwrap_err()
            );
            assert!(err.contains(key) && err.contains(hint), "{text}: {err}");
        }
        std::fs::write(
            &path,
            "spool_codec = \"zstd\"\nlog_format = \"json\"\nspool_encryption = \"on\"\n",
        )
        .unwrap();
        let config = Config::load(Some(&path), &ConfigOverrides::default())
            .unwrap()
            .config;
        assert_eq!(config.spool_codec.0, Codec::Zstd);
        assert_eq!(config.log_format, LogFormat::Json);
        assert_eq!(config.spool_encryption.0, Encryption::On);
        // --print-config writes values that read back the same.
        std::fs::write(&path, config.to_toml()).unwrap();
        let again = Config::load(Some(&path), &ConfigOverrides::default())
            .unwrap()
            .config;
        assert_eq!(again.to_toml(), config.to_toml());
        // A secret that is set is a comment: the file read back has none
        // (not a placeholder every peer would refuse), and says how to give it.
        let overrides = ConfigOverrides {
            shared_secret: Some("s3cret".into()),
            ..Default::default()
        };
        let with_secret = Config::load(None, &overrides).unwrap().config;
        let text = with_secret.to_toml();
        assert!(!text.contains("s3cret"), "{text}");
        assert!(
            text.contains("# shared_secret is set (hidden); give it again in this file or with BINX_SHARED_SECRET"),
            "{text}"
        );
        std::fs::write(&path, &text).unwrap();
        let again = Config::load(Some(&path), &ConfigOverrides::default())
            .unwrap()
            .config;
        assert_eq!(again.shared_secret, "");
        // A name longer than a HELLO reply should carry is refused.
        let overrides = ConfigOverrides {
            name: Some("n".repeat(MAX_NAME_LEN + 1)),
            ..Default::default()
        };
        let err = format!("{:#}", Config::load(None, &overrides).unwrap_err());
        assert!(err.contains("name is 257 bytes"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_key_is_listed_with_its_environment_variable() {
        let keys = Config::keys();
        assert!(keys.len() >= 17);
        for (key, env, _, doc) in keys {
            assert_eq!(env, format!("BINX_{}", key.to_uppercase()));
            assert!(!doc.is_empty(), "{key} has no description");
        }
    }
}
