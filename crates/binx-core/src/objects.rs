//! Spooled objects as the core sees them, and their lifetimes as explicit
//! reference counts: pages that live in an object, commit markers that name
//! it, and replies reading it each hold one. When the last goes, the core
//! asks for the object's deletion; nothing happens on `Drop`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::task_id::TaskId;

/// Compression of a segment's body (docs/PROTOCOL.md section 4, "Spooling").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Codec {
    /// Stored as is.
    #[default]
    None,
    /// LZ4, in the LZ4 frame format.
    Lz4,
    /// Zstandard.
    Zstd,
}

impl Codec {
    /// The name in config and `accept_encodings`.
    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }

    /// The codec byte of the segment header.
    pub fn byte(self) -> u8 {
        match self {
            Codec::None => 0,
            Codec::Lz4 => 1,
            Codec::Zstd => 2,
        }
    }

    /// The codec of a segment header's codec byte.
    pub fn from_byte(b: u8) -> Option<Codec> {
        match b {
            0 => Some(Codec::None),
            1 => Some(Codec::Lz4),
            2 => Some(Codec::Zstd),
            _ => None,
        }
    }

    /// The codec of a config or `accept_encodings` name.
    pub fn from_name(name: &str) -> Option<Codec> {
        match name {
            "none" => Some(Codec::None),
            "lz4" => Some(Codec::Lz4),
            "zstd" => Some(Codec::Zstd),
            _ => None,
        }
    }
}

impl std::str::FromStr for Codec {
    type Err = String;

    /// A codec name as config and `accept_encodings` write it.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Codec::None),
            "lz4" => Ok(Codec::Lz4),
            "zstd" => Ok(Codec::Zstd),
            _ => Err(format!(
                "codec {:?}: use none, lz4 or zstd",
                binx_proto::truncate(s, 64)
            )),
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a storage command failed, as the driver saw it: the core answers a
/// transient failure (the store unreachable, refusing or slow: the same
/// command may work later) differently from a permanent one (a missing or
/// damaged object, a store that cannot take the write).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct StoreFailure {
    /// Asking again later may work.
    pub transient: bool,
    /// What the store or the driver said.
    pub reason: String,
}

impl StoreFailure {
    /// The store could not serve the command now.
    pub fn transient(reason: impl Into<String>) -> Self {
        StoreFailure {
            transient: true,
            reason: reason.into(),
        }
    }

    /// The command will not succeed by asking again.
    pub fn permanent(reason: impl Into<String>) -> Self {
        StoreFailure {
            transient: false,
            reason: reason.into(),
        }
    }
}

/// Whether an object must outlive its writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Durability {
    /// Written to relieve memory (policy `overflow`): useless once its
    /// writer is gone, unless a commit marker names it.
    Overflow,
    /// Written under policy `always`: consumers read it after its writer is
    /// gone.
    Durable,
}

/// A segment object in storage: where it is and what it holds. The key is
/// carried only in replies, never stored in the clear.
#[derive(Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Index of the store among the spool's stores.
    pub store: usize,
    /// The object's name within its store.
    pub name: String,
    /// Token of its first page.
    pub first_token: u64,
    /// Size of each page it holds, in token order (bytes).
    pub page_sizes: Vec<u64>,
    /// Size of the object as stored (bytes, after compression and sealing).
    pub stored_size: u64,
    /// Compression of its body.
    pub codec: Codec,
    /// Its AES-256-GCM key, when it is encrypted.
    pub key: Option<[u8; 32]>,
    /// When the spool's TTL prunes it (unix milliseconds).
    pub expires_at_unix_ms: u64,
}

impl ObjectMeta {
    /// Bytes of pages it holds.
    pub fn page_bytes(&self) -> u64 {
        self.page_sizes.iter().sum()
    }
}

impl fmt::Debug for ObjectMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectMeta")
            .field("store", &self.store)
            .field("name", &self.name)
            .field("first_token", &self.first_token)
            .field("pages", &self.page_sizes.len())
            .field("stored_size", &self.stored_size)
            .field("encrypted", &self.key.is_some())
            .finish()
    }
}

/// A commit marker as read back from storage: a finished buffer whose pages
/// are all in the listed segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitMarker {
    /// The buffer's task.
    pub task_id: String,
    /// The finished buffer.
    pub buffer_id: u64,
    /// Token after the buffer's last page.
    pub end_token: u64,
    /// The node that wrote it (its spool node name).
    pub node: String,
    /// The host:port other sidecars reached that node under.
    pub endpoint: String,
    /// The process instance (HELLO `instance=`) of the binxd that wrote
    /// it, when it named one: a sidecar that read the buffer from one
    /// process serves only that process's marker (a task id opened again
    /// after a restart writes its marker at the same path).
    pub instance: Option<String>,
    /// In token order; together they hold every page below `end_token`
    /// (a shared one may hold pages at or past it too, which are not this
    /// buffer's).
    pub segments: Vec<ObjectMeta>,
    /// The segments hold pages of other buffers too (BROADCAST): a consumer
    /// that finishes this buffer from storage deletes the marker, then only
    /// the segments no other marker of the task lists, and only once the
    /// task's manifest shows every buffer committed (a producer that is only
    /// cut off may still name them in markers it has yet to write).
    pub shared: bool,
    /// Read from its task's manifest (format 2), which carries the markers
    /// of a task-wide commit, rather than from a marker object of its own:
    /// a consumer that finishes it from storage records its release beside
    /// the manifest, and the last release takes the manifest.
    pub folded: bool,
}

/// One object named by a commit marker the core asks to write.
pub type MarkerSegment = ObjectMeta;

/// Numbers objects this daemon wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ObjectId(pub u64);

#[derive(Debug)]
struct Entry {
    meta: Arc<ObjectMeta>,
    /// Pages (in memory or not) that live in it.
    pages: u64,
    /// Commit markers (written, or being written) that name it.
    markers: u32,
    /// Replies reading it now.
    leases: u32,
    /// A marker naming it could not be deleted: the object is left to the
    /// TTL pruner, never deleted here.
    ttl_only: bool,
    /// The task that wrote it (for operators and logs).
    #[allow(dead_code)]
    task: TaskId,
}

/// The objects this daemon wrote and still holds references to.
#[derive(Debug, Default)]
pub(crate) struct Objects {
    entries: BTreeMap<ObjectId, Entry>,
    next: u64,
}

impl Objects {
    /// Registers a written object with no references yet.
    pub(crate) fn insert(&mut self, meta: ObjectMeta, task: TaskId) -> ObjectId {
        self.next += 1;
        let id = ObjectId(self.next);
        self.entries.insert(
            id,
            Entry {
                meta: Arc::new(meta),
                pages: 0,
                markers: 0,
                leases: 0,
                ttl_only: false,
                task,
            },
        );
        id
    }

    pub(crate) fn meta(&self, id: ObjectId) -> Option<&Arc<ObjectMeta>> {
        self.entries.get(&id).map(|e| &e.meta)
    }

    pub(crate) fn add_pages(&mut self, id: ObjectId, n: u64) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.pages += n;
        }
    }

    pub(crate) fn add_marker(&mut self, id: ObjectId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.markers += 1;
        }
    }

    pub(crate) fn add_lease(&mut self, id: ObjectId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.leases += 1;
        }
    }

    /// Drops one page reference; the object, when that was the last reference.
    pub(crate) fn drop_page(&mut self, id: ObjectId) -> Option<Arc<ObjectMeta>> {
        let e = self.entries.get_mut(&id)?;
        e.pages = e.pages.saturating_sub(1);
        self.collect(id)
    }

    pub(crate) fn drop_marker(&mut self, id: ObjectId) -> Option<Arc<ObjectMeta>> {
        let e = self.entries.get_mut(&id)?;
        e.markers = e.markers.saturating_sub(1);
        self.collect(id)
    }

    pub(crate) fn drop_lease(&mut self, id: ObjectId) -> Option<Arc<ObjectMeta>> {
        let e = self.entries.get_mut(&id)?;
        e.leases = e.leases.saturating_sub(1);
        self.collect(id)
    }

    /// Drops a marker's reference without ever deleting the object: the
    /// marker may still be in storage, so the TTL pruner takes both.
    pub(crate) fn keep_for_ttl(&mut self, id: ObjectId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.markers = e.markers.saturating_sub(1);
            e.ttl_only = true;
        }
        self.collect(id);
    }

    /// Removes an object nothing refers to any more; returns it when it is
    /// to be deleted.
    pub(crate) fn collect(&mut self, id: ObjectId) -> Option<Arc<ObjectMeta>> {
        let e = self.entries.get(&id)?;
        if e.pages > 0 || e.markers > 0 || e.leases > 0 {
            return None;
        }
        let e = self.entries.remove(&id)?;
        (!e.ttl_only).then_some(e.meta)
    }

    /// Objects held (for stats and the simulation's checks).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every object with its reference counts (pages, markers, leases).
    pub(crate) fn counts(
        &self,
    ) -> impl Iterator<Item = (ObjectId, &ObjectMeta, u64, u32, u32)> + '_ {
        self.entries
            .iter()
            .map(|(&id, e)| (id, &*e.meta, e.pages, e.markers, e.leases))
    }
}
