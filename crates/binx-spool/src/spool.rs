//! The spool of one daemon: its stores, how it writes and reads segment
//! objects, and their lifecycle (deletion when the last page is released,
//! TTL pruning, pruning what a crashed run left).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use binx_core::{CommitMarker, ManifestPlan, MarkerPlan, ObjectMeta};
use bytes::Bytes;

use crate::budget::{ReplyBudget, Reservation};
use serde::Serialize;
use thiserror::Error;

use crate::commit::{
    KeyWrap, MARKER_DIR, MAX_MANIFEST_BYTES, MAX_MANIFEST_NAME, MAX_MARKER_BYTES, ManifestFile,
    ManifestMarker, MarkerFile, MarkerSegment, is_commit_object, is_manifest, manifest_path,
    marker_path, release_record_of, release_record_path, releases,
};
use crate::file_jobs::{FileJobs, Progress};
use crate::manifest_cache::ManifestCache;
use crate::naming::{Durability, ObjectName, PackedName, object_of, validate_node_name};
use crate::segment::{
    Codec, SegmentError, SegmentLimits, decode_segment_shared, encode_segment_content, new_key,
    segment_crc,
};
use crate::store::{ObjectSize, SpoolStore, StoreError, StoreOptions};

/// Whether segments are encrypted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encryption {
    /// On for remote stores (S3, GCS, Azure), off for file and memory.
    Auto,
    /// Every segment is encrypted, whatever the store.
    On,
    /// No segment is encrypted.
    Off,
}

impl fmt::Display for Encryption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Encryption::Auto => "auto",
            Encryption::On => "on",
            Encryption::Off => "off",
        })
    }
}

impl FromStr for Encryption {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Encryption::Auto),
            "on" | "true" => Ok(Encryption::On),
            "off" | "false" => Ok(Encryption::Off),
            _ => Err(format!(
                "encryption {:?}: use auto, on or off",
                binx_proto::truncate(s, 64)
            )),
        }
    }
}

/// How consumers that accept spooled segments get them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retrieval {
    /// A presigned URL where the store can sign one; otherwise proxy.
    Storage,
    /// The serving sidecar always reads the object and replies inline.
    Proxy,
}

impl fmt::Display for Retrieval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Retrieval::Storage => "storage",
            Retrieval::Proxy => "proxy",
        })
    }
}

impl FromStr for Retrieval {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "storage" => Ok(Retrieval::Storage),
            "proxy" => Ok(Retrieval::Proxy),
            _ => Err(format!(
                "retrieval mode {:?}: use storage or proxy",
                binx_proto::truncate(s, 64)
            )),
        }
    }
}

/// How a daemon spools: where, how segments are sized, compressed and
/// encrypted, how long they live and how consumers get them.
#[derive(Clone, Debug)]
pub struct SpoolConfig {
    /// Base locations; tasks are spread over them by id.
    pub stores: Vec<String>,
    /// Settings and credentials for remote stores.
    pub options: StoreOptions,
    /// Goes into object names (the pod name in a cluster).
    pub node_name: String,
    /// host:port other sidecars reach this one under; written into commit
    /// markers (a proxy consumer serves a marker only for that remote).
    pub endpoint: String,
    /// Size a segment of coalesced pages aims at first ...
    pub segment_target_bytes: u64,
    /// ... and grows to; a larger page is an object of its own.
    pub segment_max_bytes: u64,
    /// Compression of segment bodies.
    pub codec: Codec,
    /// Whether segments are encrypted.
    pub encryption: Encryption,
    /// Objects older than this are pruned whatever their state.
    pub ttl: Duration,
    /// How consumers that accept spooled segments get them.
    pub retrieval: Retrieval,
    /// Longest validity of a presigned URL (never past the object's expiry).
    pub presign_valid_for: Duration,
    /// Decoded segments kept for proxy replies, in bytes.
    pub read_cache_bytes: u64,
    /// Bytes of objects read back that replies (and read-aheads) may hold
    /// at once, besides the cache: a DATA reading storage waits for room,
    /// then is `BUSY` (see [`Spool::reserve_reading`]).
    pub read_budget_bytes: u64,
    /// Object deletions in flight at most; beyond it the TTL pruner takes them.
    pub max_pending_deletes: usize,
    /// Wraps segment keys in commit markers (from the cluster's shared
    /// secret); without it, encrypted segments cannot be committed.
    pub key_wrap: Option<KeyWrap>,
    /// A consumer whose producer cannot be reached this long reads a
    /// committed buffer from storage.
    pub failover_after: Duration,
    /// Small segments of a task written at once to a `file://` store to
    /// be committed ([`SegmentWrite::pack`]: a task-wide commit writes one
    /// a buffer) go into one file, each a byte range of it
    /// ([`crate::naming::PackedName`]): creating files is most of what
    /// such a commit costs.
    pub pack_segments: bool,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            stores: Vec::new(),
            options: StoreOptions::default(),
            node_name: "binxd".into(),
            endpoint: String::new(),
            segment_target_bytes: 8 << 20,
            segment_max_bytes: 16 << 20,
            codec: Codec::None,
            encryption: Encryption::Auto,
            ttl: Duration::from_secs(12 * 3600),
            retrieval: Retrieval::Storage,
            presign_valid_for: Duration::from_secs(3600),
            read_cache_bytes: 64 << 20,
            read_budget_bytes: 64 << 20,
            max_pending_deletes: 100_000,
            key_wrap: None,
            failover_after: Duration::from_secs(30),
            pack_segments: true,
        }
    }
}

/// A spool operation that failed. Errors name the object concerned.
#[derive(Debug, Error)]
pub enum SpoolError {
    /// The spool cannot be opened as configured, or a commit marker or
    /// manifest cannot be written (e.g. an encrypted segment and no shared
    /// secret); the text says why.
    #[error("spool configuration: {0}")]
    Config(String),
    /// A store request failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A segment could not be built or read.
    #[error(transparent)]
    Segment(#[from] SegmentError),
    /// An object or file read back is not what was written.
    #[error("spool object {object}: {detail}")]
    Mismatch {
        /// The object's name, or the file's path.
        object: String,
        /// What is wrong with it.
        detail: String,
    },
    /// An object is gone and its name says it expired (`spool_ttl` after
    /// it was written): the pruner took it, and no retry brings it back.
    /// A marker may outlive the objects it lists by as long as its task
    /// took to commit after spilling them.
    #[error(
        "spool object {object} is gone: it expired at {expired_at_unix_ms} ms after the epoch (spool_ttl after it was written)"
    )]
    Expired {
        /// The object's name.
        object: String,
        /// When its name says it expired (unix milliseconds).
        expired_at_unix_ms: u64,
    },
    /// A local segment file could not be written (a full disk, an I/O
    /// error): the same write may work once room is freed.
    #[error("spool object {object}: cannot write: {source}")]
    LocalWrite {
        /// The file's path.
        object: String,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
}

impl SpoolError {
    /// Whether asking again later may work (the store could not be
    /// reached, refused or timed out; a local disk was full), rather than
    /// an object being missing or damaged, or the spool unable to take the
    /// write at all.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            SpoolError::Store(StoreError::Io { .. }) | SpoolError::LocalWrite { .. }
        )
    }
}

/// Counters shown by `binx stats` and `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    bytes_spooled: AtomicU64,
    objects_spooled: AtomicU64,
    bytes_read: AtomicU64,
    objects_read: AtomicU64,
    objects_read_ahead: AtomicU64,
    objects_packed: AtomicU64,
    objects_deleted: AtomicU64,
    objects_pruned: AtomicU64,
    errors: AtomicU64,
    stored_bytes_written: AtomicU64,
}

/// A snapshot of the spool counters.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SpoolStats {
    /// Page bytes and objects written to storage.
    pub bytes_spooled: u64,
    /// Objects written to storage (a packed segment counts as one).
    pub objects_spooled: u64,
    /// Of `objects_spooled`, segments written packed with others of their
    /// task, one file a pack.
    pub objects_packed: u64,
    /// Bytes of objects as stored (after compression and encryption).
    pub stored_bytes_written: u64,
    /// Page bytes and objects read back (proxy replies, failover).
    pub bytes_read: u64,
    /// Objects read back.
    pub objects_read: u64,
    /// Of `objects_read`, those read ahead of the DATA that needed them.
    pub objects_read_ahead: u64,
    /// Bytes of objects read back held now: the read cache and what
    /// replies and read-aheads reserved (outside `memory_used`).
    pub read_bytes_held: u64,
    /// Objects deleted because their pages were released.
    pub objects_deleted: u64,
    /// Objects deleted by the TTL or restart pruner.
    pub objects_pruned: u64,
    /// Failed writes, reads and deletions.
    pub errors: u64,
    /// Tasks with commit releases (consumers that finished a buffer from
    /// storage) under way or waiting: each task's go one at a time.
    pub release_tasks: u64,
    /// File system jobs of `file://` stores started and not finished now,
    /// those given up on whose thread is still stuck included (at most
    /// [`crate::file_jobs::FILE_JOBS_UNFINISHED`] a store).
    pub file_jobs_unfinished: u64,
    /// File system jobs given up on (the file system answered none of their
    /// calls for the store's timeout) or refused (every place of their
    /// store held by such jobs).
    pub file_jobs_given_up: u64,
}

/// Where a spooled segment may be fetched by a consumer.
#[derive(Clone, Debug)]
pub struct Presigned {
    /// The presigned GET URL of the object.
    pub url: String,
    /// When the URL stops working (unix milliseconds).
    pub expires_at_unix_ms: u64,
}

/// One daemon's spool.
#[derive(Debug)]
pub struct Spool {
    config: SpoolConfig,
    stores: Vec<SpoolStore>,
    serial: AtomicU64,
    /// The first serial of this run: names from it on are this run's own.
    first_serial: u64,
    counters: Counters,
    cache: Mutex<ReadCache>,
    /// Objects being read now, so a DATA that needs an object a read-ahead
    /// is fetching waits for it instead of reading it a second time.
    reading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Read-aheads at once; past it a read-ahead is skipped (each holds up
    /// to a segment in memory before the cache takes it).
    read_ahead_slots: tokio::sync::Semaphore,
    /// What replies and read-aheads hold of objects read back.
    read_budget: ReplyBudget,
    limits: SegmentLimits,
    /// host:port other sidecars reach this one under, written into markers
    /// and manifests: the configured one, or the address the TCP listener
    /// bound (known only once it bound).
    endpoint: Mutex<String>,
    /// This process's instance id, written into markers and manifests.
    instance: Mutex<Option<String>>,
    /// Manifests read back for their folded markers, for a few seconds.
    manifests: Mutex<ManifestCache>,
    /// The packs this run wrote, by (store, pack name), with the offsets
    /// of their segments the core has not deleted: the last one deleted
    /// takes the pack. A set, not a count, so a segment deleted twice
    /// never takes the pack from under the others.
    packs: Mutex<HashMap<(usize, String), HashSet<u64>>>,
    /// One task's releases go one at a time: each writes under the task's
    /// marker directory and then lists it, and many at once (a task of many
    /// buffers deleted together) listed a directory others were writing,
    /// which a store may fail (seen: 500s from an S3 server under load),
    /// leaving the segments to the TTL. A lock per task with releases under
    /// way (removed with its last one), so one task's slow store round trips
    /// never hold up another's.
    release_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Read-aheads in flight at most.
const READ_AHEADS: usize = 2;

/// One holder of an object's gate; the last one out removes it from the
/// map (also when a reader's future is dropped mid-read).
struct Gate<'a> {
    spool: &'a Spool,
    name: String,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl std::ops::Deref for Gate<'_> {
    type Target = tokio::sync::Mutex<()>;
    fn deref(&self) -> &Self::Target {
        &self.lock
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        // Under the map's lock (which every clone and drop takes): the map's
        // reference and ours are the last ones.
        let mut reading = self.spool.reading.lock().unwrap_or_else(|p| p.into_inner());
        if Arc::strong_count(&self.lock) <= 2
            && reading
                .get(&self.name)
                .is_some_and(|lock| Arc::ptr_eq(lock, &self.lock))
        {
            reading.remove(&self.name);
        }
    }
}

/// Recently decoded segments, for proxy replies that read one object in
/// several DATA requests.
#[derive(Debug, Default)]
struct ReadCache {
    entries: VecDeque<(CacheKey, Arc<Vec<Bytes>>, u64)>,
    bytes: u64,
}

/// What a cached object was read as: its store, name and first token.
#[derive(Debug)]
struct CacheKey {
    store: usize,
    name: String,
    first_token: u64,
    stored_size: u64,
    /// The key it was opened with: a marker that names the object with
    /// another key (or none) is not served the pages that key opened.
    key: Option<[u8; 32]>,
}

impl CacheKey {
    fn of(object: &ObjectMeta) -> CacheKey {
        CacheKey {
            store: object.store,
            name: object.name.clone(),
            first_token: object.first_token,
            stored_size: object.stored_size,
            key: object.key,
        }
    }

    /// Whether `object` is what was read as `pages`: the same object,
    /// tokens, stored size, key and page sizes.
    fn is(&self, object: &ObjectMeta, pages: &[Bytes]) -> bool {
        self.store == object.store
            && self.first_token == object.first_token
            && self.stored_size == object.stored_size
            && self.key == object.key
            && self.name == object.name
            && pages.len() == object.page_sizes.len()
            && pages
                .iter()
                .zip(&object.page_sizes)
                .all(|(page, &size)| page.len() as u64 == size)
    }
}

/// How old a put's staging file must be before the pruner takes it for one
/// a killed process cut short: no put of a marker or manifest takes this
/// long.
pub const CUT_PUT_AGE: Duration = Duration::from_secs(600);

/// Deletes, under a `file://` store's `dir`, the staging files object_store
/// writes a put of a marker, manifest or release record to before renaming
/// it (`<name>#<digits>`, [`is_commit_object`] of `<name>`) that are older
/// than [`CUT_PUT_AGE`]: left by a process killed mid-put, invisible to
/// listing (object_store hides them), so nothing else would ever delete
/// them. Only commit markers and manifests are put through object_store on
/// a local store (segments are staged as `.partial` files), so only the
/// commit directory is walked. Then every empty directory under it goes,
/// the commit directory too: a process killed after a put made its task's
/// directory and before it made the staging file, or after a delete took a
/// task's last file and before object_store's cleanup took the directory,
/// leaves one that nothing else would remove. That needs no age: a put that
/// finds its directory gone makes it again (object_store retries the
/// staging file's creation after making its parents), and a directory that
/// holds anything is never removed (`remove_dir` refuses it). Returns how
/// many files it deleted.
fn prune_cut_puts(dir: &std::path::Path, now: SystemTime) -> u64 {
    let root = dir.join(MARKER_DIR.trim_end_matches('/'));
    let mut pruned = 0;
    let mut pending = vec![root.clone()];
    // Every directory walked, each after its parent.
    let mut walked = Vec::new();
    while let Some(at) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&at) else {
            continue;
        };
        walked.push(at);
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let path = entry.path();
            if kind.is_dir() {
                pending.push(path);
                continue;
            }
            let name = entry.file_name();
            let cut =
                name.to_str()
                    .and_then(|n| n.rsplit_once('#'))
                    .is_some_and(|(base, suffix)| {
                        !base.is_empty()
                            && !suffix.is_empty()
                            && suffix.bytes().all(|b| b.is_ascii_digit())
                            // Staging a name binx writes: nothing else is
                            // binx's to delete.
                            && path
                                .parent()
                                .and_then(|p| p.strip_prefix(dir).ok())
                                .and_then(|p| p.to_str())
                                .is_some_and(|p| is_commit_object(&format!("{p}/{base}")))
                    });
            if !cut {
                continue;
            }
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|at| at + CUT_PUT_AGE <= now);
            if old && std::fs::remove_file(&path).is_ok() {
                tracing::info!(file = %path.display(), "pruned the staging file of a put cut short");
                pruned += 1;
            }
        }
    }
    // Children before their parents, so a directory that held only empty
    // directories goes too.
    for at in walked.iter().rev() {
        if std::fs::remove_dir(at).is_ok() {
            tracing::debug!(dir = %at.display(), "removed an empty commit directory");
        }
    }
    pruned
}

/// Where a segment file is written before it is renamed to `path` (so a
/// reader never sees half an object), and how a failed write is reported.
fn staging_for(
    path: &std::path::Path,
) -> (
    std::path::PathBuf,
    impl Fn(std::io::Error) -> SpoolError + Clone + Send + 'static,
) {
    let object = path.display().to_string();
    let io = move |e: std::io::Error| SpoolError::LocalWrite {
        object: object.clone(),
        source: e,
    };
    (path.with_extension("bxs.partial"), io)
}

/// Runs a job on a `file://` store's files as one of its `jobs`: one that
/// does not answer in time fails as a local write that may work later,
/// naming `object`, instead of holding its commit, read or pruner pass for
/// as long as the mount hangs. Without `jobs` it runs here.
async fn file_job<T, F>(
    jobs: Option<&FileJobs>,
    object: impl FnOnce() -> String,
    job: impl FnOnce(Progress) -> F,
) -> Result<T, SpoolError>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T, SpoolError>> + Send + 'static,
{
    let Some(jobs) = jobs else {
        return job(Progress::default()).await;
    };
    jobs.run(job).await.unwrap_or_else(|source| {
        Err(SpoolError::LocalWrite {
            object: object(),
            source,
        })
    })
}

/// Runs a file system call on the blocking pool: never on a reactor
/// thread, which a hung mount would take from every connection it serves.
async fn on_blocking_pool<T: Send + 'static>(
    call: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(call).await.unwrap_or_else(|e| {
        Err(std::io::Error::other(format!(
            "file system job failed: {e}"
        )))
    })
}

/// One operation's outcome (a marker's, a segment's), with its index among
/// those asked for.
type Outcome<T = ()> = (usize, Result<T, SpoolError>);

/// A job on the blocking pool over some of the items asked for (each with
/// its index among them), giving each one's outcome.
type LocalJob<I, T> = fn(Vec<(usize, I)>, &Progress) -> Vec<Outcome<T>>;

/// Markers (or small segments) written or deleted by one job on the
/// blocking pool: a task's are usually far fewer (one job, one hand-off), a
/// wide task's go in several jobs at once.
const MARKERS_A_JOB: usize = 128;

/// Bytes of small segments one job on the blocking pool writes at most:
/// beyond it, the next job runs beside it on another core.
const SEGMENT_BYTES_A_JOB: u64 = 4 << 20;

/// What a segment's file weighs in a job besides its bytes: at most 32
/// files a job (each a few file system round trips, slow on a network
/// file system), and the jobs of a wide commit run side by side.
const SEGMENT_FILE_WEIGHT: u64 = SEGMENT_BYTES_A_JOB / 32;

/// Whether a marker lists a packed segment: it then has a format of its
/// own (marker 2, manifest 3), which binxd builds from before packing
/// refuse by its number instead of failing to find the segment.
fn any_packed(segments: &[MarkerSegment]) -> bool {
    segments
        .iter()
        .any(|s| PackedName::parse(&s.name).is_some())
}

/// Bytes of segments one pack holds at most: a job's worth.
const PACK_BYTES: u64 = SEGMENT_BYTES_A_JOB;

/// Segments one pack holds at most.
const PACK_SEGMENTS: usize = MARKERS_A_JOB;

/// A small segment to write to a `file://` store, encoded (all but its
/// CRC trailer), with the object it is unless it is packed.
struct SmallSegment {
    /// Its index among the segments asked for.
    index: usize,
    task: String,
    durability: Durability,
    /// Whether it may share a pack with others of its task.
    pack: bool,
    /// Where it goes unless it is packed.
    path: std::path::PathBuf,
    content: Result<Vec<Bytes>, SegmentError>,
    meta: ObjectMeta,
}

impl SmallSegment {
    fn content_bytes(&self) -> u64 {
        self.content
            .as_ref()
            .map_or(0, |c| c.iter().map(|p| p.len() as u64).sum())
    }
}

/// The file several small segments of a task are packed into.
struct Pack {
    name: String,
    path: std::path::PathBuf,
    expires_at_unix_ms: u64,
}

/// Small segments written as one file: each alone, or a task's several
/// packed into one.
struct SmallFile {
    pack: Option<Pack>,
    segments: Vec<SmallSegment>,
    /// Bytes of their content.
    bytes: u64,
}

impl SmallFile {
    /// Writes the file (on a blocking thread) and gives each segment's
    /// outcome: a packed one is named after its pack and its offset in it,
    /// and sized as its range.
    fn write(self, progress: &Progress) -> Vec<Outcome<ObjectMeta>> {
        let Some(pack) = self.pack else {
            return self
                .segments
                .into_iter()
                .map(|s| {
                    let SmallSegment {
                        index,
                        path,
                        content,
                        mut meta,
                        ..
                    } = s;
                    let written = content
                        .map_err(SpoolError::from)
                        .and_then(|content| write_small_segment(&path, &content, progress))
                        .map(|size| {
                            meta.stored_size = size;
                            meta
                        });
                    (index, written)
                })
                .collect();
        };
        let mut outcomes = Vec::new();
        let mut placed = Vec::new();
        let mut pieces: Vec<Bytes> = Vec::new();
        let mut offset = 0u64;
        for segment in self.segments {
            let SmallSegment {
                index,
                content,
                mut meta,
                ..
            } = segment;
            let mut content = match content {
                Ok(content) => content,
                Err(e) => {
                    outcomes.push((index, Err(e.into())));
                    continue;
                }
            };
            content.push(crate::segment::segment_crc(&content));
            let size: u64 = content.iter().map(|p| p.len() as u64).sum();
            meta.name = PackedName::format(&pack.name, offset);
            meta.stored_size = size;
            meta.expires_at_unix_ms = pack.expires_at_unix_ms;
            offset += size;
            pieces.extend(content);
            placed.push((index, meta));
        }
        if placed.is_empty() {
            return outcomes;
        }
        match write_staged(&pack.path, &pieces, progress) {
            Ok(()) => outcomes.extend(placed.into_iter().map(|(i, meta)| (i, Ok(meta)))),
            Err(e) => outcomes.extend(placed.into_iter().map(|(i, _)| {
                let failed = SpoolError::LocalWrite {
                    object: pack.path.display().to_string(),
                    source: std::io::Error::new(e.kind(), e.to_string()),
                };
                (i, Err(failed))
            })),
        }
        outcomes
    }
}

/// Writes `pieces` into a staging file beside `path`, then renames it
/// into place, so a reader never sees half an object.
fn write_staged(
    path: &std::path::Path,
    pieces: &[Bytes],
    progress: &Progress,
) -> std::io::Result<()> {
    let (staging, _) = staging_for(path);
    let written = (|| {
        let mut file = std::fs::File::create(&staging)?;
        write_pieces(&mut file, pieces, &|e: std::io::Error| e, progress)?;
        std::fs::rename(&staging, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&staging);
    }
    written
}

/// The outcomes of `n` operations (on markers, on segments), given as
/// (index, outcome) in any order, in index order; one never given is a
/// failure naming `what` (none is).
fn in_order<T>(
    n: usize,
    outcomes: impl IntoIterator<Item = Outcome<T>>,
    what: &str,
) -> Vec<Result<T, SpoolError>> {
    let mut ordered: Vec<Option<Result<T, SpoolError>>> = (0..n).map(|_| None).collect();
    for (i, outcome) in outcomes {
        if let Some(slot) = ordered.get_mut(i) {
            *slot = Some(outcome);
        }
    }
    ordered
        .into_iter()
        .map(|outcome| {
            outcome.unwrap_or_else(|| Err(SpoolError::Config(format!("{what} was never started"))))
        })
        .collect()
}

/// Writes a small file (a commit marker) of a `file://` store as
/// object_store does: into a staging file beside it, `<path>#<n>` (the
/// first `n` free; what a kill leaves there [`prune_cut_puts`] removes),
/// then renamed into place, so a reader never sees half of one. Its
/// directory is made when missing, again if a cleanup of empty directories
/// took it meanwhile.
fn put_local_file(path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::{ErrorKind, Write};

    /// Staging names tried past those taken, and directories made again.
    const ATTEMPTS: u32 = 16;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut staging = path.as_os_str().to_os_string();
        staging.push(format!("#{attempt}"));
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&staging);
        let mut file = match opened {
            Ok(file) => file,
            Err(e) if attempt < ATTEMPTS && e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) if attempt < ATTEMPTS && e.kind() == ErrorKind::NotFound => {
                if let Some(dir) = path.parent() {
                    match std::fs::create_dir_all(dir) {
                        // A cleanup of empty directories took `commit/`
                        // between its making and the task's: again.
                        Err(e) if e.kind() == ErrorKind::NotFound => {}
                        other => other?,
                    }
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        // The staging file keeps its directory from being removed, so the
        // rename finds it.
        let written = file
            .write_all(data)
            .and_then(|()| std::fs::rename(&staging, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&staging);
        }
        return written;
    }
}

/// Segments up to this size are checksummed, written and renamed into
/// place in one job on the blocking pool: a hand-off costs more than their
/// CRC.
const CRC_BESIDE_WRITE_BYTES: u64 = 1 << 20;

/// Writes every piece of `content` to `file` with `writev` from the pieces
/// themselves, a step of `progress` a call.
fn write_pieces<E>(
    file: &mut std::fs::File,
    content: &[Bytes],
    io: &impl Fn(std::io::Error) -> E,
    progress: &Progress,
) -> Result<(), E> {
    use std::io::Write;

    let mut slices: Vec<std::io::IoSlice<'_>> =
        content.iter().map(|p| std::io::IoSlice::new(p)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = file.write_vectored(rest).map_err(io)?;
        progress.step();
        if n == 0 {
            return Err(io(std::io::ErrorKind::WriteZero.into()));
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Writes a segment's `content` (every piece but the CRC trailer) to a
/// local file with one `writev` from the pieces themselves; a large
/// segment's CRC is computed on another core meanwhile. The file is staged
/// and renamed into place, so a reader never sees half an object. Returns
/// the object's size.
async fn write_local_segment(
    path: std::path::PathBuf,
    content: Vec<Bytes>,
    progress: Progress,
) -> Result<u64, SpoolError> {
    use std::io::Write;

    let content_bytes: u64 = content.iter().map(|p| p.len() as u64).sum();
    if content_bytes <= CRC_BESIDE_WRITE_BYTES {
        let written =
            tokio::task::spawn_blocking(move || write_small_segment(&path, &content, &progress));
        return written
            .await
            .map_err(|e| SegmentError::Encode(format!("writer task failed: {e}")))?;
    }
    let (staging, io) = staging_for(&path);
    let io_for_finish = io.clone();
    let for_crc = content.clone();
    let crc = tokio::task::spawn_blocking(move || crate::segment::segment_crc(&for_crc));
    let (staging_for_write, io_for_write) = (staging.clone(), io.clone());
    let body = tokio::task::spawn_blocking(move || -> Result<std::fs::File, SpoolError> {
        let mut file = std::fs::File::create(&staging_for_write).map_err(&io_for_write)?;
        write_pieces(&mut file, &content, &io_for_write, &progress)?;
        Ok(file)
    });
    let crc = crc
        .await
        .map_err(|e| SegmentError::Encode(format!("checksum task failed: {e}")))?;
    let file = body
        .await
        .map_err(|e| SegmentError::Encode(format!("writer task failed: {e}")))?;
    on_blocking_pool(move || {
        let mut file = match file {
            Ok(file) => file,
            Err(e) => {
                let _ = std::fs::remove_file(&staging);
                return Ok(Err(e));
            }
        };
        let finish = (|| {
            file.write_all(&crc)?;
            let size = file.metadata()?.len();
            std::fs::rename(&staging, &path)?;
            Ok(size)
        })();
        Ok(finish.map_err(|e| {
            let _ = std::fs::remove_file(&staging);
            io(e)
        }))
    })
    .await
    .map_err(&io_for_finish)?
}

/// Writes a small segment's `content` (at most [`CRC_BESIDE_WRITE_BYTES`])
/// and its CRC to a staging file on this thread, and renames it into place.
/// Returns the object's size.
fn write_small_segment(
    path: &std::path::Path,
    content: &[Bytes],
    progress: &Progress,
) -> Result<u64, SpoolError> {
    let mut pieces = content.to_vec();
    pieces.push(crate::segment::segment_crc(content));
    write_staged(path, &pieces, progress).map_err(|source| SpoolError::LocalWrite {
        object: path.display().to_string(),
        source,
    })?;
    Ok(pieces.iter().map(|p| p.len() as u64).sum())
}

/// Writes an encrypted (or compressed) segment to a local file while it is
/// encoded: one thread seals chunk k+1 (and checksums it) while another
/// writes chunk k, so the seal and the write overlap instead of following
/// each other; at most `PIECES_IN_FLIGHT` sealed pieces wait between them.
/// Staged and renamed like [`write_local_segment`]. Returns the object's size.
async fn write_local_segment_sealing(
    path: std::path::PathBuf,
    first_token: u64,
    pages: Vec<Bytes>,
    codec: Codec,
    key: Option<[u8; 32]>,
    progress: Progress,
) -> Result<u64, SpoolError> {
    use std::io::Write;

    /// A chunk and its tag are two pieces: this lets the sealer run about
    /// two chunks ahead of the writer.
    const PIECES_IN_FLIGHT: usize = 4;
    let (sender, receiver) = std::sync::mpsc::sync_channel::<Bytes>(PIECES_IN_FLIGHT);
    let sealer = tokio::task::spawn_blocking(move || -> Result<(), SegmentError> {
        let stopped = |_| SegmentError::Encode("the segment writer stopped".into());
        let mut crc = crate::segment::SegmentCrc::default();
        crate::segment::encode_segment_pieces(first_token, &pages, codec, key.as_ref(), |piece| {
            crc.update(&piece);
            sender.send(piece).map_err(stopped)
        })?;
        sender.send(crc.trailer()).map_err(stopped)
    });
    let (staging, io) = staging_for(&path);
    let (staging_for_write, io_for_write) = (staging.clone(), io.clone());
    let writer = tokio::task::spawn_blocking(move || -> Result<u64, SpoolError> {
        let mut file = std::fs::File::create(&staging_for_write).map_err(&io_for_write)?;
        let mut size = 0u64;
        // Ends when the sealer drops its sender: finished or failed.
        for piece in receiver {
            file.write_all(&piece).map_err(&io_for_write)?;
            progress.step();
            size += piece.len() as u64;
        }
        Ok(size)
    });
    let sealed = sealer
        .await
        .map_err(|e| SegmentError::Encode(format!("encoder task failed: {e}")));
    let written = writer
        .await
        .map_err(|e| SegmentError::Encode(format!("writer task failed: {e}")));
    let result = match (sealed, written) {
        (Ok(Ok(())), Ok(Ok(size))) => Ok(size),
        // The writer's error first: the sealer then only saw it stop.
        (_, Ok(Err(e))) => Err(e),
        (_, Err(e)) | (Err(e), _) | (Ok(Err(e)), _) => Err(e.into()),
    };
    let placed = result.is_ok();
    let renamed = on_blocking_pool(move || {
        if placed {
            std::fs::rename(&staging, &path).inspect_err(|_| {
                let _ = std::fs::remove_file(&staging);
            })
        } else {
            let _ = std::fs::remove_file(&staging);
            Ok(())
        }
    })
    .await;
    let size = result?;
    renamed.map(|()| size).map_err(io)
}

/// A segment to write: what [`Spool::write`] takes, for
/// [`Spool::write_segments`].
#[derive(Debug, Clone)]
pub struct SegmentWrite {
    /// The task whose pages it holds (it decides the store).
    pub task: String,
    /// Token of its first page.
    pub first_token: u64,
    /// Its pages, in token order.
    pub pages: Vec<Bytes>,
    /// What its name says of how long it must last.
    pub durability: Durability,
    /// Whether it may be packed with others of its task written at once
    /// (a commit's: a marker will name it); see
    /// [`SpoolConfig::pack_segments`].
    pub pack: bool,
}

/// When the object a segment is in (its pack, if packed) expired, if its
/// name says it has by `now`.
fn expired_by_name(segment: &str, now: SystemTime) -> Option<u64> {
    ObjectName::parse(object_of(segment))
        .map(|name| name.expires_at_unix_ms)
        .filter(|&at| at <= unix_ms(now))
}

/// `t` in milliseconds since the Unix epoch (0 before it, saturating).
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Spool {
    /// Opens every configured store (creating `file://` directories).
    pub fn open(config: SpoolConfig) -> Result<Arc<Spool>, SpoolError> {
        // reqwest's rustls needs a process-wide crypto provider; installing
        // one a second time is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if config.stores.is_empty() {
            return Err(SpoolError::Config("no store URL configured".into()));
        }
        validate_node_name(&config.node_name).map_err(SpoolError::Config)?;
        if config.segment_target_bytes == 0
            || config.segment_max_bytes < config.segment_target_bytes
        {
            return Err(SpoolError::Config(format!(
                "segment sizes: the target ({}) must be above 0 and at most the maximum ({})",
                config.segment_target_bytes, config.segment_max_bytes
            )));
        }
        let stores = config
            .stores
            .iter()
            .map(|url| SpoolStore::from_url(url, &config.options))
            .collect::<Result<Vec<_>, _>>()?;
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed)
            .map_err(|e| SpoolError::Config(format!("no randomness: {e}")))?;
        // Serials start at random so two runs of one node never reuse a
        // name; half the range is left to count up in.
        let first_serial = u64::from_le_bytes(seed) >> 1;
        let read_budget = ReplyBudget::new(config.read_budget_bytes);
        Ok(Arc::new(Spool {
            endpoint: Mutex::new(config.endpoint.clone()),
            instance: Mutex::new(None),
            config,
            stores,
            serial: AtomicU64::new(first_serial),
            first_serial,
            counters: Counters::default(),
            cache: Mutex::new(ReadCache::default()),
            reading: Mutex::new(HashMap::new()),
            read_ahead_slots: tokio::sync::Semaphore::new(READ_AHEADS),
            read_budget,
            limits: SegmentLimits::default(),
            manifests: Mutex::new(ManifestCache::default()),
            packs: Mutex::new(HashMap::new()),
            release_locks: Mutex::new(HashMap::new()),
        }))
    }

    /// The configuration the spool was opened with.
    pub fn config(&self) -> &SpoolConfig {
        &self.config
    }

    /// The address written into markers and manifests from now on.
    pub fn set_endpoint(&self, endpoint: String) {
        *self.endpoint.lock().unwrap_or_else(|p| p.into_inner()) = endpoint;
    }

    /// The process instance (HELLO `instance=`) written into markers and
    /// manifests from now on.
    pub fn set_instance(&self, instance: String) {
        *self.instance.lock().unwrap_or_else(|p| p.into_inner()) = Some(instance);
    }

    /// The process instance markers and manifests name.
    fn instance(&self) -> Option<String> {
        self.instance
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The address markers and manifests name.
    pub fn endpoint(&self) -> String {
        self.endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Every store, in configured order; [`ObjectMeta::store`] indexes it.
    pub fn stores(&self) -> &[SpoolStore] {
        &self.stores
    }

    /// Whether a segment of `page_bytes` of `task_id` is one
    /// [`Spool::write_segments`] writes beside others in one job: a small
    /// one (at most 1 MiB), framed only (no codec, no encryption), for a
    /// `file://` store. Any other is written as [`Spool::write`] writes it.
    pub fn writes_together(&self, task_id: &str, page_bytes: u64) -> bool {
        let store = self.store_for(task_id);
        self.stores[store].local_dir().is_some()
            && self.config.codec == Codec::None
            && !self.encrypts(store)
            && page_bytes <= CRC_BESIDE_WRITE_BYTES
    }

    /// The store a task's objects go to: tasks are spread by id.
    pub fn store_for(&self, task_id: &str) -> usize {
        let hash = task_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        (hash % self.stores.len() as u64) as usize
    }

    /// The jobs of the first `file://` store, which batches of files
    /// (markers, small segments) run as: every batch is of one store in
    /// practice, several `file://` stores being unusual.
    fn first_file_jobs(&self) -> Option<&FileJobs> {
        self.stores.iter().find_map(SpoolStore::file_jobs)
    }

    fn encrypts(&self, store: usize) -> bool {
        match self.config.encryption {
            Encryption::On => true,
            Encryption::Off => false,
            Encryption::Auto => self.stores[store].kind().is_remote(),
        }
    }

    fn fail<T, E: Into<SpoolError>>(&self, r: Result<T, E>) -> Result<T, SpoolError> {
        r.map_err(|e| {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            e.into()
        })
    }

    /// Writes `pages` (tokens from `first_token`) as one object in the
    /// task's store.
    pub async fn write(
        &self,
        task_id: &str,
        first_token: u64,
        pages: Vec<Bytes>,
        durability: Durability,
    ) -> Result<ObjectMeta, SpoolError> {
        let meta = self.fail(self.new_object(task_id, first_token, &pages, durability))?;
        self.write_object(meta, pages).await
    }

    /// Writes several segments, each as [`Spool::write`] does, and gives
    /// each one's outcome in the order of `segments`. A task-wide
    /// NO_MORE_PAGES under spool policy `commit` asks for a segment for
    /// every buffer at once: the small ones of a `file://` store that need
    /// only framing are then written by a few jobs on the blocking pool
    /// (one hand-off between threads for many files, as for markers), a
    /// task's several into one file ([`SpoolConfig::pack_segments`]), the
    /// others each as [`Spool::write`] writes them, all concurrently.
    pub async fn write_segments(
        &self,
        segments: Vec<SegmentWrite>,
    ) -> Vec<Result<ObjectMeta, SpoolError>> {
        let n = segments.len();
        let mut failed = Vec::new();
        let mut small = Vec::new();
        let mut others = Vec::new();
        for (i, segment) in segments.into_iter().enumerate() {
            let SegmentWrite {
                task,
                first_token,
                pages,
                durability,
                pack,
            } = segment;
            let meta = match self.fail(self.new_object(&task, first_token, &pages, durability)) {
                Ok(meta) => meta,
                Err(e) => {
                    failed.push((i, Err(e)));
                    continue;
                }
            };
            let path = self.stores[meta.store].local_path(&meta.name);
            match path {
                Some(path) if self.writes_together(&task, meta.page_bytes()) => {
                    small.push(SmallSegment {
                        index: i,
                        task,
                        durability,
                        pack: pack && self.config.pack_segments,
                        path,
                        content: encode_segment_content(first_token, &pages, Codec::None, None),
                        meta,
                    });
                }
                _ => others.push(async move { (i, self.write_object(meta, pages).await) }),
            }
        }
        let others = futures_util::future::join_all(others);
        let files = self
            .small_files(small)
            .into_iter()
            .map(|file| (file.segments.first().map_or(0, |s| s.index), file))
            .collect();
        let small = self.local_jobs(
            files,
            "segment writer",
            |file| file.bytes + SEGMENT_FILE_WEIGHT,
            SEGMENT_BYTES_A_JOB,
            |files, progress| {
                files
                    .into_iter()
                    .flat_map(|(_, file)| file.write(progress))
                    .collect()
            },
        );
        let (others, small) = tokio::join!(others, small);
        let small: Vec<Outcome<ObjectMeta>> = small
            .into_iter()
            .map(|(i, written)| (i, written.map(|meta| self.count_written(meta))))
            .collect();
        self.remember_packs(&small);
        in_order(
            n,
            failed.into_iter().chain(others).chain(small),
            "a segment's write",
        )
    }

    /// The files small segments go to: a task's several that may be
    /// packed into packs of at most [`PACK_BYTES`] and [`PACK_SEGMENTS`],
    /// any other alone into its own object.
    fn small_files(&self, small: Vec<SmallSegment>) -> Vec<SmallFile> {
        let mut by_task: Vec<(String, Vec<SmallSegment>)> = Vec::new();
        for segment in small {
            let packs_with = by_task
                .iter_mut()
                .find(|(task, segments)| *task == segment.task && segments[0].pack);
            match packs_with {
                Some((_, segments)) if segment.pack => segments.push(segment),
                _ => by_task.push((segment.task.clone(), vec![segment])),
            }
        }
        let mut files = Vec::new();
        for (task, segments) in by_task {
            let mut chunk: Vec<SmallSegment> = Vec::new();
            let mut bytes = 0u64;
            for segment in segments {
                let size = segment.content_bytes();
                if !chunk.is_empty()
                    && (chunk.len() >= PACK_SEGMENTS || bytes.saturating_add(size) > PACK_BYTES)
                {
                    files.push(self.small_file(&task, std::mem::take(&mut chunk), bytes));
                    bytes = 0;
                }
                bytes = bytes.saturating_add(size);
                chunk.push(segment);
            }
            if !chunk.is_empty() {
                files.push(self.small_file(&task, chunk, bytes));
            }
        }
        files
    }

    /// One file of small segments of `task`: a pack when there are
    /// several (named as an object of its own, durable when one of them
    /// is, expiring with the first of them), or else the one's object.
    fn small_file(&self, task: &str, segments: Vec<SmallSegment>, bytes: u64) -> SmallFile {
        let store = self.store_for(task);
        let pack = (segments.len() > 1)
            .then(|| {
                let durable = segments.iter().any(|s| s.durability == Durability::Durable);
                let expires_at_unix_ms = segments
                    .iter()
                    .map(|s| s.meta.expires_at_unix_ms)
                    .min()
                    .unwrap_or_else(|| unix_ms(SystemTime::now() + self.config.ttl));
                let name = ObjectName {
                    expires_at_unix_ms,
                    node: self.config.node_name.clone(),
                    durability: if durable {
                        Durability::Durable
                    } else {
                        Durability::Overflow
                    },
                    serial: self.serial.fetch_add(1, Ordering::Relaxed),
                }
                .to_string();
                let path = self.stores[store].local_path(&name)?;
                Some(Pack {
                    name,
                    path,
                    expires_at_unix_ms,
                })
            })
            .flatten();
        SmallFile {
            pack,
            segments,
            bytes,
        }
    }

    /// Records the packs written among `written`, so that deleting the
    /// last of a pack's segments deletes the pack.
    fn remember_packs(&self, written: &[Outcome<ObjectMeta>]) {
        let mut packs = self.packs.lock().unwrap_or_else(|p| p.into_inner());
        for (_, outcome) in written {
            if let Ok(meta) = outcome
                && let Some(packed) = PackedName::parse(&meta.name)
            {
                packs
                    .entry((meta.store, packed.pack.to_string()))
                    .or_default()
                    .insert(packed.offset);
                self.counters.objects_packed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The object a segment of `pages` becomes: its store, name, key and
    /// page sizes; `stored_size` is known once it is written.
    fn new_object(
        &self,
        task_id: &str,
        first_token: u64,
        pages: &[Bytes],
        durability: Durability,
    ) -> Result<ObjectMeta, SpoolError> {
        let store = self.store_for(task_id);
        let key = if self.encrypts(store) {
            Some(new_key()?)
        } else {
            None
        };
        let expires_at_unix_ms = unix_ms(SystemTime::now() + self.config.ttl);
        let name = ObjectName {
            expires_at_unix_ms,
            node: self.config.node_name.clone(),
            durability,
            serial: self.serial.fetch_add(1, Ordering::Relaxed),
        }
        .to_string();
        Ok(ObjectMeta {
            store,
            name,
            first_token,
            page_sizes: pages.iter().map(|p| p.len() as u64).collect(),
            stored_size: 0,
            codec: self.config.codec,
            key,
            expires_at_unix_ms,
        })
    }

    /// Writes `pages` as the object `meta` names, and counts it.
    async fn write_object(
        &self,
        mut meta: ObjectMeta,
        pages: Vec<Bytes>,
    ) -> Result<ObjectMeta, SpoolError> {
        // Uncompressed and unencrypted, a segment only needs framing, and a
        // local one is written straight from the pages; any other is CPU
        // work, kept off the reactor threads, and a local one is written
        // while it is sealed.
        let (store, codec, key, first_token) = (meta.store, meta.codec, meta.key, meta.first_token);
        let framing_only = codec == Codec::None && key.is_none();
        let local = self.stores[store].local_path(&meta.name);
        let stored_size = match local {
            Some(path) if !framing_only => {
                let sealed = |progress| {
                    write_local_segment_sealing(path, first_token, pages, codec, key, progress)
                };
                file_job(self.stores[store].file_jobs(), || meta.name.clone(), sealed).await
            }
            local => {
                self.write_content(store, &meta.name, local, first_token, &pages, codec, key)
                    .await
            }
        };
        meta.stored_size = self.fail(stored_size)?;
        Ok(self.count_written(meta))
    }

    /// Counts a segment written.
    fn count_written(&self, meta: ObjectMeta) -> ObjectMeta {
        let c = &self.counters;
        c.bytes_spooled
            .fetch_add(meta.page_bytes(), Ordering::Relaxed);
        c.objects_spooled.fetch_add(1, Ordering::Relaxed);
        c.stored_bytes_written
            .fetch_add(meta.stored_size, Ordering::Relaxed);
        meta
    }

    /// Encodes a whole segment, then writes it: to a local file (`local`)
    /// with one `writev` beside its checksum, or to the store in parts.
    /// Returns the object's size.
    #[allow(clippy::too_many_arguments)]
    async fn write_content(
        &self,
        store: usize,
        name: &str,
        local: Option<std::path::PathBuf>,
        first_token: u64,
        pages: &[Bytes],
        codec: Codec,
        key: Option<[u8; 32]>,
    ) -> Result<u64, SpoolError> {
        let content = if codec == Codec::None && key.is_none() {
            encode_segment_content(first_token, pages, codec, None)
        } else {
            let pages = pages.to_vec();
            tokio::task::spawn_blocking(move || {
                encode_segment_content(first_token, &pages, codec, key.as_ref())
            })
            .await
            .map_err(|e| SegmentError::Encode(format!("encoder task failed: {e}")))
            .and_then(|r| r)
        };
        let mut content = content?;
        if let Some(path) = local {
            let written = |progress| write_local_segment(path, content, progress);
            return file_job(self.stores[store].file_jobs(), || name.to_string(), written).await;
        }
        let content_bytes: u64 = content.iter().map(|p| p.len() as u64).sum();
        let crc = if content_bytes < (256 << 10) {
            segment_crc(&content)
        } else {
            let for_crc = content.clone();
            tokio::task::spawn_blocking(move || segment_crc(&for_crc))
                .await
                .map_err(|e| SegmentError::Encode(format!("checksum task failed: {e}")))?
        };
        content.push(crc);
        self.stores[store].put_parts(name, content).await?;
        Ok(content_bytes + 4)
    }

    /// Writes the commit marker of a finished buffer: where it ends, the
    /// objects that hold its pages (in token order), and this node's name.
    pub async fn write_marker(&self, plan: &MarkerPlan) -> Result<(), SpoolError> {
        let (store, path, json) = self.encode_marker(plan)?;
        self.fail(self.stores[store].put(&path, json.into()).await)
    }

    /// Writes the commit markers of several finished buffers, each as
    /// [`Spool::write_marker`] does, and gives each one's outcome in the
    /// order of `plans`. A task-wide NO_MORE_PAGES asks for every buffer's
    /// marker at once; in a `file://` store they are then written in one
    /// job on the blocking pool, one hand-off between threads in all rather
    /// than one a marker (on busy cores the hand-offs cost more than the
    /// small files). Other stores take them concurrently.
    pub async fn write_markers(&self, plans: &[MarkerPlan]) -> Vec<Result<(), SpoolError>> {
        let mut failed = Vec::new();
        let mut local = Vec::new();
        let mut remote = Vec::new();
        for (i, plan) in plans.iter().enumerate() {
            match self.encode_marker(plan) {
                Err(e) => failed.push((i, Err(e))),
                Ok((store, path, json)) => match self.stores[store].local_dir() {
                    Some(dir) => local.push((i, (dir.join(&path), json))),
                    None => remote.push(async move {
                        (
                            i,
                            self.fail(self.stores[store].put(&path, json.into()).await),
                        )
                    }),
                },
            }
        }
        let remote = futures_util::future::join_all(remote);
        let local = self.local_jobs(
            local,
            "marker writer",
            |_| 1,
            MARKERS_A_JOB as u64,
            |markers, progress| {
                markers
                    .into_iter()
                    .map(|(i, (path, json))| {
                        let written =
                            put_local_file(&path, &json).map_err(|source| SpoolError::LocalWrite {
                                object: path.display().to_string(),
                                source,
                            });
                        progress.step();
                        (i, written)
                    })
                    .collect()
            },
        );
        let (remote, local) = tokio::join!(remote, local);
        in_order(
            plans.len(),
            failed.into_iter().chain(remote).chain(local),
            "a commit marker's write",
        )
    }

    /// Runs `job` over `items` (each with its index among the markers asked
    /// for) on the blocking pool: in one job for a task's few markers (one
    /// hand-off between threads), in several at once for a wide task's many
    /// (each a file system round trip, slow on a network file system). A
    /// job that fails to run fails each of its items, named. Every outcome
    /// is counted as [`Spool::fail`] counts.
    async fn local_jobs<I: Send + 'static, T: Send + 'static>(
        &self,
        items: Vec<(usize, I)>,
        what: &'static str,
        weight: fn(&I) -> u64,
        weight_a_job: u64,
        job: LocalJob<I, T>,
    ) -> Vec<Outcome<T>> {
        let mut jobs = Vec::new();
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            // At most MARKERS_A_JOB items and `weight_a_job` of weight a
            // job, and at least one.
            let mut chunk: Vec<(usize, I)> = Vec::new();
            let mut weighed = 0u64;
            while let Some(item) = items.next_if(|(_, item)| {
                chunk.is_empty()
                    || (chunk.len() < MARKERS_A_JOB
                        && weighed.saturating_add(weight(item)) <= weight_a_job)
            }) {
                weighed = weighed.saturating_add(weight(&item.1));
                chunk.push(item);
            }
            let indexes: Vec<usize> = chunk.iter().map(|(i, _)| *i).collect();
            let file_jobs = self.first_file_jobs();
            jobs.push(async move {
                let run =
                    |progress: Progress| tokio::task::spawn_blocking(move || job(chunk, &progress));
                let ran = match file_jobs {
                    None => Ok(run(Progress::default()).await),
                    Some(file_jobs) => file_jobs.run(run).await,
                };
                // Not a segment's encoding: the job that wrote or deleted
                // the files stopped, or did not answer in time; asking
                // again may work, as for any local write that failed.
                let (kind, why) = match ran {
                    Ok(Ok(done)) => return done,
                    Ok(Err(e)) => (std::io::ErrorKind::Other, format!("{what} failed: {e}")),
                    Err(e) => (e.kind(), e.to_string()),
                };
                indexes
                    .into_iter()
                    .map(|i| {
                        let failed = SpoolError::LocalWrite {
                            object: format!("item {i} of the {what}'s batch"),
                            source: std::io::Error::new(kind, why.clone()),
                        };
                        (i, Err(failed))
                    })
                    .collect::<Vec<_>>()
            });
        }
        futures_util::future::join_all(jobs)
            .await
            .into_iter()
            .flatten()
            .map(|(i, result)| (i, self.fail(result)))
            .collect()
    }

    /// A marker's store, path and JSON (its segments' keys wrapped, signed
    /// when the cluster has a secret).
    fn encode_marker(&self, plan: &MarkerPlan) -> Result<(usize, String, Vec<u8>), SpoolError> {
        let (task_id, buffer_id) = (plan.task.as_str(), plan.buffer);
        let segments = self.marker_segments(plan)?;
        let mut marker = MarkerFile {
            format: if any_packed(&segments) { 2 } else { 1 },
            task_id: task_id.to_string(),
            buffer_id,
            end_token: plan.end_token,
            node: self.config.node_name.clone(),
            endpoint: self.endpoint(),
            instance: self.instance(),
            segments,
            mac: None,
            shared: plan.shared,
        };
        if let Some(wrap) = &self.config.key_wrap {
            wrap.sign(&mut marker);
        }
        let json = serde_json::to_vec(&marker)
            .map_err(|e| SpoolError::Config(format!("cannot write a commit marker: {e}")))?;
        let path = marker_path(task_id, buffer_id);
        if json.len() as u64 > MAX_MARKER_BYTES {
            // Written, it would be refused by every reader: the buffer is
            // not committed (its producer is told) rather than seemingly so.
            return Err(self.mismatch(
                &path,
                format!(
                    "would be {} bytes ({} pages), more than a reader takes ({MAX_MARKER_BYTES}); the buffer has too many pages to commit",
                    json.len(),
                    marker.segments.iter().map(|s| s.page_sizes.len()).sum::<usize>()
                ),
            ));
        }
        Ok((self.store_for(task_id), path, json))
    }

    /// The segments a marker lists, each key wrapped with the shared secret.
    fn marker_segments(&self, plan: &MarkerPlan) -> Result<Vec<MarkerSegment>, SpoolError> {
        let (task_id, buffer_id) = (plan.task.as_str(), plan.buffer);
        let mut segments = Vec::with_capacity(plan.objects.len());
        for object in &plan.objects {
            let wrapped_key = match (&object.key, &self.config.key_wrap) {
                (None, _) => None,
                (Some(key), Some(wrap)) => Some(self.fail(wrap.wrap(key))?),
                (Some(_), None) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    return Err(SpoolError::Config(format!(
                        "commit marker of buffer {buffer_id} of task {task_id}: segment {} is encrypted and no shared_secret is set to wrap its key; set shared_secret on every binxd, or spool_encryption = \"off\"",
                        object.name
                    )));
                }
            };
            segments.push(MarkerSegment {
                store: object.store,
                name: object.name.clone(),
                first_token: object.first_token,
                page_sizes: object.page_sizes.clone(),
                stored_size: object.stored_size,
                wrapped_key,
            });
        }
        Ok(segments)
    }

    /// A file read back that is not what it should be: counted as an
    /// error, and named.
    fn mismatch(&self, path: &str, detail: String) -> SpoolError {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        SpoolError::Mismatch {
            object: path.to_string(),
            detail,
        }
    }

    /// Reads a small signed JSON file of a task (a commit marker or
    /// manifest), at most `max` bytes: `None` when there is none; one that
    /// does not parse as `T`, or whose signature does not check with this
    /// cluster's secret, is a mismatch and never served.
    async fn read_signed<T: serde::de::DeserializeOwned>(
        &self,
        task_id: &str,
        path: &str,
        max: u64,
        what: &str,
        signed: impl Fn(&KeyWrap, &[u8]) -> bool,
    ) -> Result<Option<T>, SpoolError> {
        let store = self.store_for(task_id);
        let data = match self.stores[store]
            .get_checked(path, ObjectSize::AtMost(max))
            .await
        {
            Ok(data) => data,
            Err(StoreError::NotFound { .. }) => return Ok(None),
            Err(e) => return self.fail(Err(e)),
        };
        // Before the parse: what a forger wrote is never parsed (a marker
        // of page sizes takes several times its bytes once parsed).
        if let Some(wrap) = &self.config.key_wrap
            && !signed(wrap, &data)
        {
            return Err(self.mismatch(
                path,
                "is not signed with this cluster's shared_secret (forged, altered, or written by a binxd with another secret); not served".into(),
            ));
        }
        let file: T = serde_json::from_slice(&data)
            .map_err(|e| self.mismatch(path, format!("not a {what}: {e}")))?;
        Ok(Some(file))
    }

    /// A marker (or, `manifest`, a manifest) read back, parsed only when it
    /// carries this cluster's MAC (or the cluster has no secret): `None`
    /// when it does not, or does not parse. For the paths that only spare
    /// objects on its strength, which keep everything on `None`: a forged
    /// file costs them a hash, not its parse.
    fn parse_if_signed<T: serde::de::DeserializeOwned>(
        &self,
        data: &[u8],
        manifest: bool,
    ) -> Option<T> {
        if let Some(wrap) = &self.config.key_wrap {
            let signed = if manifest {
                wrap.signed_manifest(data)
            } else {
                wrap.signed_marker(data)
            };
            if !signed {
                return None;
            }
        }
        serde_json::from_slice(data).ok()
    }

    /// The commit marker of a buffer, `None` when there is none (yet),
    /// with its segments' keys unwrapped: the buffer's own marker object,
    /// or else its entry in the task's manifest (format 2) unless a
    /// consumer recorded its release.
    pub async fn read_marker(
        &self,
        task_id: &str,
        buffer_id: u64,
    ) -> Result<Option<CommitMarker>, SpoolError> {
        let path = marker_path(task_id, buffer_id);
        let Some(marker) = self
            .read_signed::<MarkerFile>(task_id, &path, MAX_MARKER_BYTES, "commit marker", |w, m| {
                w.signed_marker(m)
            })
            .await?
        else {
            return self.folded_marker(task_id, buffer_id).await;
        };
        let mismatch = |detail: String| self.mismatch(&path, detail);
        if marker.format != 1 && marker.format != 2 {
            return Err(mismatch(format!(
                "has format {}, not 1 or 2",
                marker.format
            )));
        }
        if marker.task_id != task_id || marker.buffer_id != buffer_id {
            return Err(mismatch(format!(
                "names buffer {} of task {}",
                marker.buffer_id, marker.task_id
            )));
        }
        if let Some(why) = bad_instance(&marker.instance) {
            return Err(mismatch(why));
        }
        Ok(Some(CommitMarker {
            segments: self.marker_objects(&path, marker.segments)?,
            task_id: marker.task_id,
            buffer_id: marker.buffer_id,
            end_token: marker.end_token,
            node: marker.node,
            endpoint: marker.endpoint,
            instance: marker.instance,
            shared: marker.shared,
            folded: false,
        }))
    }

    /// A buffer's marker folded into its task's manifest, `None` when the
    /// manifest is not there, does not carry it, or a consumer released it.
    async fn folded_marker(
        &self,
        task_id: &str,
        buffer_id: u64,
    ) -> Result<Option<CommitMarker>, SpoolError> {
        let path = manifest_path(task_id);
        let now = std::time::Instant::now();
        let cached = self
            .manifests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(task_id, now);
        let manifest = match cached {
            Some(manifest) => manifest,
            None => {
                let Some(manifest) = self.read_manifest_file(task_id, u64::MAX).await? else {
                    return Ok(None);
                };
                let manifest = Arc::new(manifest);
                self.manifests
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .put(task_id, manifest.clone(), now);
                manifest
            }
        };
        let Ok(at) = manifest
            .markers
            .binary_search_by_key(&buffer_id, |m| m.buffer_id)
        else {
            return Ok(None);
        };
        // Released by a record of the manifest's process, or by one that
        // names none (written before records named it).
        let store = self.store_for(task_id);
        let mut records = vec![release_record_path(task_id, buffer_id, None)];
        if let Some(instance) = manifest.instance.as_deref() {
            records.insert(0, release_record_path(task_id, buffer_id, Some(instance)));
        }
        for record in records {
            match self.stores[store]
                .get_checked(&record, ObjectSize::AtMost(MAX_MANIFEST_NAME as u64))
                .await
            {
                Ok(_) => return Ok(None),
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return self.fail(Err(e)),
            }
        }
        let entry = &manifest.markers[at];
        // Checked on the way in: entries lie within `buffers`.
        let end_token = manifest.buffers[entry.buffer_id as usize][0];
        Ok(Some(CommitMarker {
            segments: self.marker_objects(&path, entry.segments.clone())?,
            task_id: manifest.task_id.clone(),
            buffer_id,
            end_token,
            node: manifest.node.clone(),
            endpoint: manifest.endpoint.clone(),
            instance: manifest.instance.clone(),
            shared: false,
            folded: true,
        }))
    }

    /// The objects a marker read back from `path` lists, their keys
    /// unwrapped; refused when one is in a store this binxd lacks or its
    /// key does not open with this binxd's secret.
    fn marker_objects(
        &self,
        path: &str,
        listed: Vec<MarkerSegment>,
    ) -> Result<Vec<ObjectMeta>, SpoolError> {
        let mismatch = |detail: String| self.mismatch(path, detail);
        let mut segments = Vec::with_capacity(listed.len());
        // Where the segments before this one start: each starts after the
        // last (review: segments out of order made a failover reply repeat
        // pages under later tokens).
        let mut previous_first = None::<u64>;
        for segment in listed {
            // Only names binx writes: a marker may never point a read or a
            // delete at another path or object.
            if ObjectName::parse(&segment.name).is_none()
                && PackedName::parse(&segment.name).is_none()
            {
                return Err(mismatch(format!(
                    "segment {:?} is not named as binx names its objects",
                    segment.name
                )));
            }
            let count = segment.page_sizes.len() as u64;
            if segment.first_token.checked_add(count).is_none()
                || previous_first.is_some_and(|p| segment.first_token <= p)
            {
                return Err(mismatch(format!(
                    "segment {} starts at token {} with {count} pages: segments must start in increasing token order and end below 2^64",
                    segment.name, segment.first_token
                )));
            }
            previous_first = Some(segment.first_token);
            if segment.store >= self.stores.len() {
                return Err(mismatch(format!(
                    "segment {} is in store {}, and this binxd has {}",
                    segment.name,
                    segment.store,
                    self.stores.len()
                )));
            }
            // No page is larger than a frame's u32 length can carry: a
            // marker that says so was not written by a binxd, and sums of
            // its sizes could overflow further on.
            if let Some(size) = segment
                .page_sizes
                .iter()
                .find(|&&size| size > u64::from(u32::MAX))
            {
                return Err(mismatch(format!(
                    "segment {} lists a page of {size} bytes, larger than any frame can carry",
                    segment.name
                )));
            }
            // No more than a reader takes, and no more stored bytes than a
            // writer makes of its pages: the object is read whole on the
            // strength of these numbers (review: a stored size of 20 GiB
            // had a failover read 20 GiB).
            let page_bytes: u64 = segment.page_sizes.iter().sum();
            let most_stored = binx_segment::max_stored_size(count, page_bytes);
            if count > u64::from(self.limits.max_pages)
                || page_bytes > self.limits.max_body_bytes
                || segment.stored_size > most_stored
            {
                return Err(mismatch(format!(
                    "segment {} lists {count} pages of {page_bytes} bytes stored in {} bytes; a reader takes at most {} pages and {} bytes, stored in at most {most_stored} bytes",
                    segment.name,
                    segment.stored_size,
                    self.limits.max_pages,
                    self.limits.max_body_bytes
                )));
            }
            let key = match (&segment.wrapped_key, &self.config.key_wrap) {
                (None, _) => None,
                (Some(wrapped), Some(wrap)) => Some(wrap.unwrap(wrapped).ok_or_else(|| {
                    mismatch(format!(
                        "the key of segment {} does not open with this binxd's shared_secret",
                        segment.name
                    ))
                })?),
                (Some(_), None) => {
                    return Err(mismatch(format!(
                        "segment {} is encrypted, and this binxd has no shared_secret to open its key",
                        segment.name
                    )));
                }
            };
            segments.push(ObjectMeta {
                store: segment.store,
                name: segment.name,
                first_token: segment.first_token,
                page_sizes: segment.page_sizes,
                stored_size: segment.stored_size,
                codec: Default::default(),
                key,
                expires_at_unix_ms: 0,
            });
        }
        Ok(segments)
    }

    /// Deletes a buffer's commit marker (its buffer was deleted or its task ended).
    pub async fn delete_marker(&self, task_id: &str, buffer_id: u64) -> Result<(), SpoolError> {
        let store = self.store_for(task_id);
        self.fail(
            self.stores[store]
                .delete(&marker_path(task_id, buffer_id))
                .await,
        )
    }

    /// Deletes several buffers' commit markers (a task that ends deletes
    /// all of its own at once), each as [`Spool::delete_marker`] does, and
    /// gives each one's outcome in the order of `markers`. In a `file://`
    /// store, one job on the blocking pool unlinks them, then removes each
    /// task directory they leave empty, and `commit/` when that leaves it
    /// empty (as object_store's cleanup does after a delete); other stores
    /// take them concurrently.
    pub async fn delete_markers(&self, markers: &[(&str, u64)]) -> Vec<Result<(), SpoolError>> {
        let mut local = Vec::new();
        let mut remote = Vec::new();
        for (i, &(task_id, buffer_id)) in markers.iter().enumerate() {
            let store = self.store_for(task_id);
            let path = marker_path(task_id, buffer_id);
            match self.stores[store].local_dir() {
                Some(dir) => local.push((i, (dir.to_path_buf(), dir.join(path)))),
                None => remote
                    .push(async move { (i, self.fail(self.stores[store].delete(&path).await)) }),
            }
        }
        let remote = futures_util::future::join_all(remote);
        let local = self.local_jobs(
            local,
            "marker deleter",
            |_| 1,
            MARKERS_A_JOB as u64,
            |markers, progress| {
                let mut dirs = std::collections::BTreeSet::new();
                let deleted: Vec<_> = markers
                    .into_iter()
                    .map(|(i, (root, path))| {
                        let result = match std::fs::remove_file(&path) {
                            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                                Err(SpoolError::LocalWrite {
                                    object: path.display().to_string(),
                                    source: e,
                                })
                            }
                            _ => {
                                if let Some(dir) = path.parent() {
                                    dirs.insert((root, dir.to_path_buf()));
                                }
                                Ok(())
                            }
                        };
                        progress.step();
                        (i, result)
                    })
                    .collect();
                // Refused while anything is left in it (the manifest, a marker
                // not deleted yet): the last deleter takes it. Then `commit/`
                // too when it is left empty, as object_store's cleanup does: a
                // put makes both again.
                for (root, dir) in dirs {
                    let mut at = Some(dir.as_path());
                    while let Some(dir) = at.filter(|d| d.starts_with(&root) && *d != root) {
                        if std::fs::remove_dir(dir).is_err() {
                            break;
                        }
                        at = dir.parent();
                    }
                }
                deleted
            },
        );
        let (remote, local) = tokio::join!(remote, local);
        in_order(
            markers.len(),
            remote.into_iter().chain(local),
            "a commit marker's delete",
        )
    }

    /// Writes a finished task's commit manifest (after its markers, or
    /// with them folded in: format 2): who serves it, and where each buffer
    /// ends and what it holds.
    pub async fn write_manifest(&self, plan: &ManifestPlan) -> Result<(), SpoolError> {
        let task_id = plan.task.as_str();
        let mut markers = Vec::with_capacity(plan.markers.len());
        for marker in &plan.markers {
            markers.push(ManifestMarker {
                buffer_id: marker.buffer,
                segments: self.marker_segments(marker)?,
            });
        }
        let mut manifest = ManifestFile {
            format: match markers.is_empty() {
                true => 1,
                false if markers.iter().any(|m| any_packed(&m.segments)) => 3,
                false => 2,
            },
            task_id: task_id.to_string(),
            node: self.config.node_name.clone(),
            endpoint: self.endpoint(),
            instance: self.instance(),
            buffers: plan
                .buffers
                .iter()
                .map(|&(end, bytes)| [end, bytes])
                .collect(),
            markers,
            mac: None,
        };
        if let Some(wrap) = &self.config.key_wrap {
            wrap.sign_manifest(&mut manifest);
        }
        let json = serde_json::to_vec(&manifest)
            .map_err(|e| SpoolError::Config(format!("cannot write a commit manifest: {e}")))?;
        let path = manifest_path(task_id);
        if json.len() as u64 > MAX_MANIFEST_BYTES {
            // The core folds only what fits (`folded_manifest_fits`).
            return Err(self.mismatch(
                &path,
                format!(
                    "would be {} bytes, more than a reader takes ({MAX_MANIFEST_BYTES})",
                    json.len()
                ),
            ));
        }
        let store = self.store_for(task_id);
        self.manifests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .forget(task_id);
        self.fail(self.stores[store].put(&path, json.into()).await)
    }

    /// A task's commit manifest, `None` when there is none; checked (its
    /// size, its MAC when the cluster has a secret, its format, its task
    /// id, its buffer count, the length of its node name and endpoint, and
    /// the endpoint's form) before anything of it is believed.
    pub async fn read_manifest(
        &self,
        task_id: &str,
        max_buffers: u64,
    ) -> Result<Option<binx_core::Manifest>, SpoolError> {
        Ok(self
            .read_manifest_file(task_id, max_buffers)
            .await?
            .map(|manifest| binx_core::Manifest {
                node: manifest.node,
                endpoint: manifest.endpoint,
                buffers: manifest.buffers.iter().map(|&[e, b]| (e, b)).collect(),
            }))
    }

    /// [`Spool::read_manifest`] as stored, with its folded markers (format
    /// 2) checked too: by increasing buffer id, each of a buffer the
    /// manifest lists.
    async fn read_manifest_file(
        &self,
        task_id: &str,
        max_buffers: u64,
    ) -> Result<Option<ManifestFile>, SpoolError> {
        let path = manifest_path(task_id);
        let Some(manifest) = self
            .read_signed::<ManifestFile>(
                task_id,
                &path,
                MAX_MANIFEST_BYTES,
                "commit manifest",
                |w, m| w.signed_manifest(m),
            )
            .await?
        else {
            return Ok(None);
        };
        let mismatch = |detail: String| self.mismatch(&path, detail);
        if manifest.task_id != task_id {
            return Err(mismatch(format!("names task {}", manifest.task_id)));
        }
        if manifest.buffers.len() as u64 > max_buffers {
            return Err(mismatch(format!(
                "lists {} buffers, more than max_buffers_per_task ({max_buffers})",
                manifest.buffers.len()
            )));
        }
        match (manifest.format, manifest.markers.is_empty()) {
            (1, true) | (2 | 3, false) => {}
            (1, false) => return Err(mismatch("has format 1 and markers in it".into())),
            (format, _) => return Err(mismatch(format!("has format {format}, not 1, 2 or 3"))),
        }
        let mut last = None;
        for marker in &manifest.markers {
            if last.is_some_and(|last| marker.buffer_id <= last)
                || marker.buffer_id >= manifest.buffers.len() as u64
            {
                return Err(mismatch(format!(
                    "carries a marker of buffer {} out of order or past its {} buffers",
                    marker.buffer_id,
                    manifest.buffers.len()
                )));
            }
            last = Some(marker.buffer_id);
        }
        if manifest.node.len() > MAX_MANIFEST_NAME || manifest.endpoint.len() > MAX_MANIFEST_NAME {
            return Err(mismatch(format!(
                "names a node or endpoint longer than {MAX_MANIFEST_NAME} bytes"
            )));
        }
        if let Some(why) = bad_instance(&manifest.instance) {
            return Err(mismatch(why));
        }
        // An empty endpoint: the binxd that wrote it had no TCP listener,
        // so only its own clients read the task.
        if !manifest.endpoint.is_empty()
            && binx_core::request::parse_remote(&manifest.endpoint).is_err()
        {
            return Err(mismatch(format!(
                "names endpoint {:?}, which is not host:port",
                binx_proto::truncate(&manifest.endpoint, 64)
            )));
        }
        Ok(Some(manifest))
    }

    /// Deletes a task's commit manifest (its task ended), and when
    /// markers were `folded` into it, the records of their release that
    /// consumers which found this producer gone wrote beside it (rare: one
    /// listing of the task's folder then). A record that cannot be deleted
    /// is left to the TTL pruner.
    pub async fn delete_manifest(&self, task_id: &str, folded: bool) -> Result<(), SpoolError> {
        self.manifests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .forget(task_id);
        let store = self.store_for(task_id);
        self.fail(self.stores[store].delete(&manifest_path(task_id)).await)?;
        if !folded {
            return Ok(());
        }
        let names = match self.stores[store]
            .list_under(&format!("{MARKER_DIR}{task_id}"))
            .await
        {
            Ok(names) => names,
            Err(e) => {
                self.count_error(
                    &e,
                    "could not list release records; the TTL pruner will delete them",
                );
                return Ok(());
            }
        };
        for (name, _) in names {
            if release_record_of(&name).is_some()
                && let Err(e) = self.stores[store].delete(&name).await
            {
                self.count_error(&e, "could not delete a release record; the TTL pruner will");
            }
        }
        Ok(())
    }

    /// A consumer finished a committed buffer from storage (its producer is
    /// gone): deletes the marker (records the release of one folded into
    /// the task's manifest), then the segments that no other marker of
    /// the task lists (BROADCAST buffers share segments). Whatever cannot
    /// be deleted now is left to the TTL pruner.
    pub async fn release_committed(&self, marker: &CommitMarker) {
        let task_id = marker.task_id.as_str();
        let lock = {
            let mut locks = self.release_locks.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(locks.entry(task_id.to_string()).or_default())
        };
        {
            let _one_at_a_time = lock.lock().await;
            self.release_committed_now(marker).await;
        }
        let mut locks = self.release_locks.lock().unwrap_or_else(|p| p.into_inner());
        // The map's and ours: no other release of the task holds or waits
        // for it (a clone is made only under this map's lock).
        if Arc::strong_count(&lock) == 2 {
            locks.remove(task_id);
        }
    }

    /// [`Spool::release_committed`], its task's turn come.
    async fn release_committed_now(&self, marker: &CommitMarker) {
        let task_id = &marker.task_id;
        let store = self.store_for(task_id);
        // What stands at the buffer's path may be another run's: a task id
        // opened again after a restart commits at the same path. Only the
        // commit this marker read is released; its segments (whose names
        // are its run's own) go either way.
        let ours = match self.read_marker(task_id, marker.buffer_id).await {
            Ok(Some(stored)) => same_commit(&stored, marker),
            Ok(None) => false,
            Err(e) => {
                return tracing::warn!(task = %task_id, buffer = marker.buffer_id, error = %e, "could not read back a commit marker to release it; the TTL pruner will");
            }
        };
        let gone = match (ours, marker.folded) {
            (false, _) => {
                tracing::info!(task = %task_id, buffer = marker.buffer_id, "the commit marker released is not there any more (another run of the task id committed the buffer since, or it was released): only its segments go");
                Ok(())
            }
            // Its entry stays in the manifest, which the other buffers'
            // readers need: a record says it names nothing any more.
            (true, true) => {
                let record =
                    release_record_path(task_id, marker.buffer_id, marker.instance.as_deref());
                self.fail(self.stores[store].put(&record, Bytes::new()).await)
            }
            (true, false) => self.delete_marker(task_id, marker.buffer_id).await,
        };
        if let Err(e) = gone {
            // The marker stays, so its segments must too: the TTL takes both.
            return tracing::warn!(error = %e, "could not delete a commit marker; the TTL pruner will");
        }
        // Segments another marker of the task still lists stay (BROADCAST
        // buffers share them: another buffer's reader, or the live
        // producer, may still read them); the last marker to go takes them.
        // Listed after our own marker is gone: of two consumers releasing
        // buffers that share segments, the later one sees neither marker.
        // Shared segments go only once the task's manifest says every
        // buffer was committed (task-wide NO_MORE_PAGES): before that, a
        // producer that is only cut off may still list them in markers it
        // has yet to write. The last marker to go takes the manifest too,
        // then the release records.
        let names = match self.stores[store]
            .list_under(&format!("{MARKER_DIR}{task_id}"))
            .await
        {
            Ok(names) => names,
            Err(e) => {
                return self.count_error(
                    &e,
                    "could not list commit markers; the TTL pruner will delete the segments",
                );
            }
        };
        let mut listed = std::collections::HashSet::new();
        let mut manifest = None;
        let mut records = Vec::new();
        let mut markers_left = 0usize;
        for (name, _) in names {
            if is_manifest(&name) {
                manifest = Some(name);
                continue;
            }
            if let Some((buffer, instance)) = release_record_of(&name) {
                let instance = instance.map(str::to_string);
                records.push((buffer, instance, name));
                continue;
            }
            markers_left += 1;
            let other = match self.stores[store]
                .get_checked(&name, ObjectSize::AtMost(MAX_MARKER_BYTES))
                .await
            {
                Ok(data) => self.parse_if_signed::<MarkerFile>(&data, false),
                Err(StoreError::NotFound { .. }) => continue,
                Err(e) => {
                    return self.count_error(
                        &e,
                        "could not read a commit marker; the TTL pruner will delete the segments",
                    );
                }
            };
            match other {
                Some(other) if other.task_id == *task_id => {
                    listed.extend(
                        other
                            .segments
                            .iter()
                            .map(|s| (s.store, object_of(&s.name).to_string())),
                    );
                }
                Some(_) => {}
                // Not ours to judge: keep everything it might list.
                None => return,
            }
        }
        // The markers folded into the manifest that no consumer released
        // still name their segments.
        let mut folded_left = 0usize;
        if manifest.is_some() {
            match self.read_manifest_file(task_id, u64::MAX).await {
                Ok(Some(file)) => {
                    // Records of another run's manifest release nothing
                    // of this one.
                    let released: std::collections::HashSet<u64> = records
                        .iter()
                        .filter(|(_, by, _)| releases(by.as_deref(), file.instance.as_deref()))
                        .map(|(buffer, _, _)| *buffer)
                        .collect();
                    for entry in file.markers {
                        if !released.contains(&entry.buffer_id) {
                            folded_left += 1;
                            listed.extend(
                                entry
                                    .segments
                                    .iter()
                                    .map(|s| (s.store, object_of(&s.name).to_string())),
                            );
                        }
                    }
                }
                Ok(None) => manifest = None,
                Err(e) => {
                    return tracing::warn!(task = %task_id, error = %e, "could not read a commit manifest; the TTL pruner will delete the segments");
                }
            }
        }
        if marker.shared && manifest.is_none() {
            return;
        }
        // A pack holds other buffers' segments, as a shared segment does:
        // it goes only once the manifest says every buffer was committed,
        // and with the last marker that lists a segment of it.
        let mut unlisted: Vec<(usize, String)> = marker
            .segments
            .iter()
            .filter(|segment| manifest.is_some() || PackedName::parse(&segment.name).is_none())
            .map(|segment| (segment.store, object_of(&segment.name).to_string()))
            .filter(|object| object.0 < self.stores.len() && !listed.contains(object))
            .collect();
        unlisted.sort_unstable();
        unlisted.dedup();
        self.delete_objects(
            unlisted,
            "could not delete a committed segment; the TTL pruner will",
        )
        .await;
        if markers_left > 0 || folded_left > 0 {
            return;
        }
        if manifest.is_some()
            && let Err(e) = self.delete_manifest(task_id, false).await
        {
            return tracing::warn!(task = %task_id, error = %e, "could not delete a commit manifest; the TTL pruner will");
        }
        // Release records mean nothing without their manifest.
        for (_, _, record) in records {
            if let Err(e) = self.stores[store].delete(&record).await {
                self.count_error(&e, "could not delete a release record; the TTL pruner will");
            }
        }
    }

    /// Reserves room in the read budget for a reply that reads `bytes` of
    /// objects back (a reply larger than the whole budget takes all of it),
    /// waiting at most `wait`; `None` when there was no room by then.
    pub async fn reserve_reading(&self, bytes: u64, wait: Duration) -> Option<Reservation> {
        self.read_budget.reserve(bytes, wait).await
    }

    /// Bytes of objects read back held now (cache and reservations).
    fn read_bytes_held(&self) -> u64 {
        let cached = self.cache.lock().unwrap_or_else(|p| p.into_inner()).bytes;
        self.read_budget.held_bytes() + cached
    }

    /// Reads an object back, checks it is the one described, and returns
    /// its pages (from a small cache when it was read just before, or by a
    /// read-ahead).
    pub async fn read(&self, object: &ObjectMeta) -> Result<Arc<Vec<Bytes>>, SpoolError> {
        if let Some(pages) = self.cached(object) {
            return Ok(pages);
        }
        let gate = self.gate(&object.name);
        let _one_reader = gate.lock().await;
        match self.cached(object) {
            Some(pages) => Ok(pages),
            None => {
                let loaded = match self.load(object).await {
                    Err(SpoolError::Store(StoreError::NotFound { .. }))
                        if let Some(expired_at_unix_ms) =
                            expired_by_name(&object.name, SystemTime::now()) =>
                    {
                        Err(SpoolError::Expired {
                            object: object.name.clone(),
                            expired_at_unix_ms,
                        })
                    }
                    other => other,
                };
                self.fail(loaded)
            }
        }
    }

    /// Reads an object into the read cache ahead of the DATA that will ask
    /// for it (the next object of a buffer a consumer is reading from
    /// storage), so reading it overlaps sending the pages before it. Does
    /// nothing when it is cached or being read, larger than half the cache
    /// (decoded), when the read budget has no room for it, or when `READ_AHEADS` are in flight already; a failure is only logged (it
    /// may have been deleted meanwhile) and the DATA that needs it reads it
    /// again and reports what is wrong.
    pub async fn read_ahead(&self, object: &ObjectMeta) {
        if self.cached(object).is_some() {
            return;
        }
        // Decoded, as the cache counts it (a compressed object is larger).
        let bytes = object.page_bytes().max(object.stored_size);
        if bytes > self.config.read_cache_bytes / 2 {
            return;
        }
        let Ok(_slot) = self.read_ahead_slots.try_acquire() else {
            return;
        };
        let Some(_room) = self.read_budget.try_reserve(bytes) else {
            return;
        };
        let gate = self.gate(&object.name);
        if let Ok(_one_reader) = gate.try_lock()
            && self.cached(object).is_none()
        {
            match self.load(object).await {
                Ok(_) => {
                    self.counters
                        .objects_read_ahead
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!(object = %object.name, error = %e, "read-ahead failed")
                }
            }
        }
    }

    /// The gate of object `name`: one reader at a time loads it.
    fn gate(&self, name: &str) -> Gate<'_> {
        let mut reading = self.reading.lock().unwrap_or_else(|p| p.into_inner());
        let lock = reading.entry(name.to_string()).or_default().clone();
        Gate {
            spool: self,
            name: name.to_string(),
            lock,
        }
    }

    /// Reads, checks and caches an object; errors are counted by the caller.
    async fn load(&self, object: &ObjectMeta) -> Result<Arc<Vec<Bytes>>, SpoolError> {
        let store = &self.stores[object.store];
        let data = match PackedName::parse(&object.name) {
            Some(packed) => {
                store
                    .get_range_checked(packed.pack, packed.offset, object.stored_size)
                    .await?
            }
            None => {
                store
                    .get_checked(&object.name, ObjectSize::Exactly(object.stored_size))
                    .await?
            }
        };
        let name = object.name.clone();
        let key = object.key;
        // No more than was written: a swapped object that would inflate
        // past it fails before it is decoded.
        let limits = SegmentLimits {
            max_pages: self
                .limits
                .max_pages
                .min(u32::try_from(object.page_sizes.len()).unwrap_or(u32::MAX)),
            max_body_bytes: self.limits.max_body_bytes.min(object.page_bytes()),
        };
        let decoded = tokio::task::spawn_blocking(move || {
            decode_segment_shared(&name, data, key.as_ref(), limits)
        })
        .await
        .map_err(|e| SegmentError::Encode(format!("decoder task failed: {e}")))
        .and_then(|r| r);
        let (first_token, pages) = decoded?;
        let sizes: Vec<u64> = pages.iter().map(|p| p.len() as u64).collect();
        if first_token != object.first_token || sizes != object.page_sizes {
            return Err(SpoolError::Mismatch {
                object: object.name.clone(),
                detail: format!(
                    "holds {} pages from token {first_token}, but {} pages from token {} were written",
                    sizes.len(),
                    object.page_sizes.len(),
                    object.first_token
                ),
            });
        }
        let bytes: u64 = sizes.iter().sum();
        self.counters.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.counters.objects_read.fetch_add(1, Ordering::Relaxed);
        let pages = Arc::new(pages);
        self.remember(object, pages.clone(), bytes);
        Ok(pages)
    }

    /// The pages of `object` if cached: the same name, store, first token,
    /// stored size, key and page sizes (what a marker read back says of an
    /// object is only believed where reading it checked the same; reviews:
    /// a name alone let a forged marker have cached pages served under
    /// other tokens, and a marker without the key be served pages its key
    /// had opened).
    fn cached(&self, object: &ObjectMeta) -> Option<Arc<Vec<Bytes>>> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entries
            .iter()
            .find(|(k, pages, _)| k.is(object, pages))
            .map(|(_, pages, _)| pages.clone())
    }

    fn remember(&self, object: &ObjectMeta, pages: Arc<Vec<Bytes>>, bytes: u64) {
        if bytes > self.config.read_cache_bytes {
            return;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        while cache.bytes + bytes > self.config.read_cache_bytes {
            match cache.entries.pop_front() {
                Some((_, _, b)) => cache.bytes -= b,
                None => break,
            }
        }
        cache.bytes += bytes;
        cache
            .entries
            .push_back((CacheKey::of(object), pages, bytes));
    }

    /// A presigned URL for the object, when retrieval mode and store allow.
    pub async fn presign(&self, object: &ObjectMeta) -> Result<Option<Presigned>, SpoolError> {
        // A packed segment is a range of its pack: a URL would serve all of it.
        if self.config.retrieval == Retrieval::Proxy || PackedName::parse(&object.name).is_some() {
            return Ok(None);
        }
        let now = unix_ms(SystemTime::now());
        let left = object.expires_at_unix_ms.saturating_sub(now);
        let valid_ms =
            left.min(u64::try_from(self.config.presign_valid_for.as_millis()).unwrap_or(u64::MAX));
        if valid_ms < 1000 {
            return Ok(None);
        }
        let url = self.fail(
            self.stores[object.store]
                .presign(&object.name, Duration::from_millis(valid_ms))
                .await,
        )?;
        Ok(url.map(|url| Presigned {
            url,
            expires_at_unix_ms: now + valid_ms,
        }))
    }

    /// Counts and logs a failure that has a fallback (the TTL pruner).
    fn count_error(&self, error: &dyn std::fmt::Display, what: &str) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %error, "{what}");
    }

    /// Deletes an object nothing refers to any more (the core decided).
    pub async fn delete(&self, object: &ObjectMeta) -> Result<(), SpoolError> {
        let store = self
            .stores
            .get(object.store)
            .ok_or_else(|| SpoolError::Mismatch {
                object: object.name.clone(),
                detail: format!("no store {}", object.store),
            })?;
        let name = match PackedName::parse(&object.name) {
            None => object.name.as_str(),
            Some(packed) => {
                let mut packs = self.packs.lock().unwrap_or_else(|p| p.into_inner());
                let key = (object.store, packed.pack.to_string());
                let last = packs.get_mut(&key).is_some_and(|live| {
                    live.remove(&packed.offset);
                    live.is_empty()
                });
                if last {
                    packs.remove(&key);
                }
                drop(packs);
                if !last {
                    // Other segments of the pack live; or it is not a pack
                    // this run wrote, and the last release of its task's
                    // manifest, or the TTL pruner, takes it.
                    self.counters
                        .objects_deleted
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                packed.pack
            }
        };
        self.fail(store.delete(name).await)?;
        self.counters
            .objects_deleted
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Deletes (store, name) objects, counting them; a failure is counted
    /// and logged as `what` (the TTL pruner takes the object later).
    async fn delete_objects(
        &self,
        objects: impl IntoIterator<Item = (usize, String)>,
        what: &str,
    ) -> u64 {
        let mut deleted = 0;
        for (store, name) in objects {
            match self.stores[store].delete(&name).await {
                Ok(()) => deleted += 1,
                Err(e) => self.count_error(&e, what),
            }
        }
        self.counters
            .objects_deleted
            .fetch_add(deleted, Ordering::Relaxed);
        deleted
    }

    /// Deletes, in every store, the objects past their expiry and (when
    /// `leftovers_of_this_node`) the overflow objects this node wrote
    /// before it started. Returns how many were deleted.
    pub async fn prune(&self, now: SystemTime, leftovers_of_this_node: bool) -> u64 {
        let now_ms = unix_ms(now);
        // A pack whose segments the core left to this pruner (its deletion
        // queue was full, or a marker could not be deleted) is never
        // emptied: forgotten once it expired, so the map stays bounded.
        self.packs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(_, pack), _| {
                ObjectName::parse(pack).is_some_and(|n| n.expires_at_unix_ms > now_ms)
            });
        let mut pruned = 0;
        // Objects a commit marker names (a drain committed overflow objects)
        // are not leftovers: consumers may still read them.
        let mut leftovers_of_this_node = leftovers_of_this_node;
        let committed = if leftovers_of_this_node {
            self.committed_objects().await.unwrap_or_else(|| {
                tracing::warn!("startup prune: commit markers could not all be read; no leftover is pruned this time (the TTL still applies)");
                leftovers_of_this_node = false;
                HashSet::new()
            })
        } else {
            HashSet::new()
        };
        for store in &self.stores {
            if let Some(dir) = store.local_dir().map(std::path::Path::to_path_buf) {
                let shown = dir.display().to_string();
                let job = move |_| async move {
                    Ok(
                        tokio::task::spawn_blocking(move || prune_cut_puts(&dir, now))
                            .await
                            .unwrap_or(0),
                    )
                };
                match file_job(store.file_jobs(), || shown, job).await {
                    Ok(n) => pruned += n,
                    Err(e) => self.count_error(
                        &e,
                        "spool pruner could not clean a store's commit directory",
                    ),
                }
            }
        }
        for (index, store) in self.stores.iter().enumerate() {
            use futures_util::StreamExt;
            let listing = match store.listing("") {
                Ok(listing) => listing,
                Err(e) => {
                    self.count_error(&e, "spool pruner could not list a store");
                    continue;
                }
            };
            let mut listing = std::pin::pin!(listing);
            while let Some(entry) = listing.next().await {
                let (name, written) = match entry {
                    Ok(entry) => entry,
                    Err(e) => {
                        self.count_error(&e, "spool pruner could not list a store");
                        break;
                    }
                };
                // A write cut short leaves `<name>.partial`: judged by its name.
                let base = name.strip_suffix(".partial").unwrap_or(&name);
                let (expired, leftover) = match ObjectName::parse(base) {
                    Some(parsed) => (
                        parsed.expires_at_unix_ms <= now_ms,
                        leftovers_of_this_node
                            && parsed.node == self.config.node_name
                            && parsed.durability == Durability::Overflow
                            && !self.wrote(parsed.serial)
                            && !committed.contains(&(index, base.to_string())),
                    ),
                    // Commit markers expire like the objects they list;
                    // nothing else under their directory is binx's.
                    None if is_commit_object(base) => (written + self.config.ttl <= now, false),
                    None => continue,
                };
                if !(expired || leftover) {
                    continue;
                }
                match store.delete(&name).await {
                    Ok(()) => {
                        pruned += 1;
                        tracing::info!(object = %name, store = %store.url(), expired, "pruned spool object");
                    }
                    Err(e) => self.count_error(&e, "spool pruner could not delete an object"),
                }
            }
        }
        self.counters
            .objects_pruned
            .fetch_add(pruned, Ordering::Relaxed);
        pruned
    }

    /// (store, name) of every object a commit marker names; `None` when a
    /// store or a marker cannot be read.
    async fn committed_objects(&self) -> Option<HashSet<(usize, String)>> {
        let mut out = HashSet::new();
        for store in &self.stores {
            let names = store.list_under(MARKER_DIR).await.ok()?;
            for (name, _) in names {
                if release_record_of(&name).is_some() {
                    continue;
                }
                let manifest = is_manifest(&name);
                let max = if manifest {
                    MAX_MANIFEST_BYTES
                } else {
                    MAX_MARKER_BYTES
                };
                let data = match store.get_checked(&name, ObjectSize::AtMost(max)).await {
                    Ok(data) => data,
                    Err(StoreError::NotFound { .. }) => continue,
                    Err(_) => return None,
                };
                // Only sparing rests on what is read here: a forged file
                // keeps objects, never deletes one.
                let segments = if manifest {
                    // Format 2 carries the task's markers too.
                    let file: ManifestFile = self.parse_if_signed(&data, true)?;
                    file.markers.into_iter().flat_map(|m| m.segments).collect()
                } else {
                    let marker: MarkerFile = self.parse_if_signed(&data, false)?;
                    marker.segments
                };
                out.extend(
                    segments
                        .into_iter()
                        .map(|s| (s.store, object_of(&s.name).to_string())),
                );
            }
        }
        Some(out)
    }

    /// Why policy `always` cannot be offered, if it cannot: its commit
    /// markers must carry the keys of encrypted segments, wrapped with the
    /// cluster's shared secret.
    pub fn always_refusal(&self) -> Option<String> {
        let encrypts = (0..self.stores.len()).any(|i| self.encrypts(i));
        (encrypts && self.config.key_wrap.is_none()).then(|| {
            "policy always needs shared_secret when segments are encrypted (commit markers carry their keys wrapped with it); set shared_secret on every binxd, or spool_encryption = \"off\"".to_string()
        })
    }

    /// Whether this run wrote the object with this serial.
    fn wrote(&self, serial: u64) -> bool {
        (self.first_serial..self.serial.load(Ordering::Relaxed)).contains(&serial)
    }

    /// Prunes expired objects every `period` until the task is aborted.
    pub fn spawn_pruner(self: &Arc<Self>, period: Duration) -> tokio::task::JoinHandle<()> {
        let spool = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                spool.prune(SystemTime::now(), false).await;
            }
        })
    }

    /// A snapshot of the spool's counters.
    pub fn stats(&self) -> SpoolStats {
        let c = &self.counters;
        SpoolStats {
            bytes_spooled: c.bytes_spooled.load(Ordering::Relaxed),
            objects_spooled: c.objects_spooled.load(Ordering::Relaxed),
            stored_bytes_written: c.stored_bytes_written.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            objects_read: c.objects_read.load(Ordering::Relaxed),
            objects_read_ahead: c.objects_read_ahead.load(Ordering::Relaxed),
            objects_packed: c.objects_packed.load(Ordering::Relaxed),
            read_bytes_held: self.read_bytes_held(),
            objects_deleted: c.objects_deleted.load(Ordering::Relaxed),
            objects_pruned: c.objects_pruned.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            release_tasks: self
                .release_locks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len() as u64,
            file_jobs_unfinished: self
                .stores
                .iter()
                .filter_map(SpoolStore::file_jobs)
                .map(|jobs| jobs.unfinished() as u64)
                .sum(),
            file_jobs_given_up: self
                .stores
                .iter()
                .filter_map(SpoolStore::file_jobs)
                .map(FileJobs::given_up)
                .sum(),
        }
    }

    /// Whether clients that accept spooled segments get presigned URLs:
    /// retrieval mode `storage` and stores that can sign (S3, GCS, Azure).
    pub fn presigns(&self) -> bool {
        self.config.retrieval == Retrieval::Storage
            && self.stores.iter().all(|s| s.kind().is_remote())
    }

    /// Whether `accept_encodings` lets a client decode this spool's objects.
    pub fn client_decodes(&self, accept_encodings: &[String]) -> bool {
        let codec = self.config.codec.name();
        codec == "none" || accept_encodings.iter().any(|e| e == codec)
    }
}

/// Whether `stored`, read back at a buffer's path, is the commit `read`
/// (read there earlier) rather than another run's: the same process, end
/// and segments (a run's segment names are its own).
fn same_commit(stored: &CommitMarker, read: &CommitMarker) -> bool {
    stored.folded == read.folded
        && stored.instance == read.instance
        && stored.end_token == read.end_token
        && stored.segments.len() == read.segments.len()
        && stored
            .segments
            .iter()
            .zip(&read.segments)
            .all(|(a, b)| a.store == b.store && a.name == b.name)
}

/// Why the process instance a marker or manifest names cannot be one
/// (they come from storage: hostile until checked).
fn bad_instance(instance: &Option<String>) -> Option<String> {
    let instance = instance.as_deref()?;
    (!binx_proto::is_instance_id(instance)).then(|| {
        format!(
            "names process instance {:?}, which is not 1 to 64 letters, digits and ._:-",
            binx_proto::truncate(instance, 64)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_transient_and_a_damaged_object_is_not() {
        let full = std::io::Error::from_raw_os_error(28);
        let (_, io) = staging_for(std::path::Path::new("/spool/a.bxs"));
        let write = io(full);
        assert!(write.is_transient(), "{write}");
        assert!(write.to_string().contains("cannot write"), "{write}");
        let damaged = SpoolError::Mismatch {
            object: "a".into(),
            detail: "CRC-32C does not match".into(),
        };
        assert!(!damaged.is_transient());
        assert!(!SpoolError::Config("no key".into()).is_transient());
    }

    /// Opens a FIFO's reading end without waiting, once, when dropped.
    struct ReleaseFifo(std::path::PathBuf);

    impl Drop for ReleaseFifo {
        fn drop(&mut self) {
            use std::os::unix::fs::OpenOptionsExt;
            // O_NONBLOCK, its value on Linux, where these tests run.
            const O_NONBLOCK: i32 = 0o4000;
            let _ = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(O_NONBLOCK)
                .open(&self.0);
        }
    }

    /// Each way binxd writes a segment file, into a file system that stops
    /// answering (the staging file is a FIFO nobody reads, so its open
    /// blocks in the kernel as on a hung network mount), fails as a
    /// transient local write naming the segment once the store's timeout
    /// passes; the stuck thread is let go after (a reader opens the FIFO).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn segment_writes_into_a_hung_file_system_fail_in_time() {
        let dir = std::env::temp_dir().join(format!("binx-spool-hung-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let limit = Duration::from_millis(300);
        let small = vec![Bytes::from(vec![1u8; 1000])];
        let large = vec![Bytes::from(vec![2u8; 3 << 20])];
        for (case, at) in [("small", 0), ("large", 1), ("sealed", 2)] {
            let path = dir.join(format!("{case}.bxs"));
            let (staging, _) = staging_for(&path);
            let made = std::process::Command::new("mkfifo")
                .arg(&staging)
                .status()
                .expect("mkfifo runs");
            assert!(made.success(), "{case}: mkfifo");
            // Should an assertion fail before the drain below, this lets the
            // stuck writer go still (its open returns, its write fails), or
            // the test's runtime would wait for its thread for ever.
            let _release = ReleaseFifo(staging.clone());
            let (small, large, to) = (small.clone(), large.clone(), path.clone());
            let job =
                move |progress| -> std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> {
                    match at {
                        0 => Box::pin(write_local_segment(to, small, progress)),
                        1 => Box::pin(write_local_segment(to, large, progress)),
                        _ => Box::pin(write_local_segment_sealing(
                            to,
                            0,
                            large,
                            Codec::None,
                            Some([7; 32]),
                            progress,
                        )),
                    }
                };
            let started = std::time::Instant::now();
            let jobs = FileJobs::new(limit, 4);
            let failed = file_job(Some(&jobs), || path.display().to_string(), job)
                .await
                .expect_err("a hung write fails");
            let took = started.elapsed();
            assert!(took >= limit && took < limit * 10, "{case}: {took:?}");
            assert_eq!(jobs.unfinished(), 1, "{case}: its thread is stuck");
            let text = failed.to_string();
            assert!(failed.is_transient(), "{case}: {text}");
            assert!(
                text.contains("did not answer for 300ms") && text.contains(&format!("{case}.bxs")),
                "{case}: {text}"
            );
            // Let the stuck writer go: it writes into the FIFO to its end.
            let fifo_path = staging.clone();
            let drained = std::thread::spawn(move || {
                let mut fifo = std::fs::File::open(&fifo_path).expect("open the FIFO");
                std::io::copy(&mut fifo, &mut std::io::sink()).expect("drain")
            });
            assert!(
                drained.join().expect("drained") > 0,
                "{case}: the writer went on"
            );
            // The job held its place while its thread was stuck, and gives
            // it back once the thread returns.
            assert!(jobs.all_finished().await, "{case}: the place comes back");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
