//! Manifests read back for failover, kept a few seconds. After failover
//! each buffer of a task has its marker read once; a marker folded into the
//! task's manifest would otherwise cost a read of the whole manifest per
//! buffer, quadratic in the task's width.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::commit::ManifestFile;

/// How long a manifest read back is believed without reading it again: a
/// reader of one deleted meanwhile finds its objects gone (a failed read,
/// asked again), never other pages.
pub(crate) const KEPT_FOR: Duration = Duration::from_secs(10);

/// What the kept manifests hold at most (their estimated size in memory).
pub(crate) const MAX_BYTES: usize = 4 << 20;

/// The manifests read back last, oldest first.
#[derive(Debug, Default)]
pub(crate) struct ManifestCache {
    entries: VecDeque<Entry>,
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    task: String,
    at: Instant,
    bytes: usize,
    manifest: Arc<ManifestFile>,
}

impl ManifestCache {
    /// The manifest of `task` read back less than [`KEPT_FOR`] ago.
    pub(crate) fn get(&mut self, task: &str, now: Instant) -> Option<Arc<ManifestFile>> {
        while self.entries.front().is_some_and(|e| e.at + KEPT_FOR <= now) {
            self.pop_oldest();
        }
        self.entries
            .iter()
            .find(|e| e.task == task)
            .map(|e| e.manifest.clone())
    }

    /// Keeps `manifest`, read back (and checked) at `now`; the oldest go
    /// for room, and one larger than all the room is not kept.
    pub(crate) fn put(&mut self, task: &str, manifest: Arc<ManifestFile>, now: Instant) {
        self.forget(task);
        let bytes = size_in_memory(&manifest);
        if bytes > MAX_BYTES {
            return;
        }
        while self.bytes + bytes > MAX_BYTES {
            self.pop_oldest();
        }
        self.bytes += bytes;
        self.entries.push_back(Entry {
            task: task.to_string(),
            at: now,
            bytes,
            manifest,
        });
    }

    /// Drops what is kept of `task` (its manifest was written or deleted).
    pub(crate) fn forget(&mut self, task: &str) {
        let bytes = &mut self.bytes;
        self.entries.retain(|e| {
            let keep = e.task != task;
            if !keep {
                *bytes -= e.bytes;
            }
            keep
        });
    }

    fn pop_oldest(&mut self) {
        if let Some(e) = self.entries.pop_front() {
            self.bytes -= e.bytes;
        }
    }
}

/// About what a manifest takes in memory: its strings, sizes and entries.
fn size_in_memory(m: &ManifestFile) -> usize {
    let segments: usize = m
        .markers
        .iter()
        .flat_map(|e| &e.segments)
        .map(|s| {
            96 + s.name.len()
                + s.page_sizes.len() * 8
                + s.wrapped_key.as_ref().map_or(0, String::len)
        })
        .sum();
    256 + m.task_id.len()
        + m.node.len()
        + m.endpoint.len()
        + m.buffers.len() * 16
        + m.markers.len() * 32
        + segments
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::{ManifestMarker, MarkerSegment};

    fn manifest(task: &str, pages: usize) -> Arc<ManifestFile> {
        Arc::new(ManifestFile {
            format: 2,
            task_id: task.into(),
            node: "n".into(),
            endpoint: String::new(),
            instance: None,
            buffers: vec![[pages as u64, 0]],
            markers: vec![ManifestMarker {
                buffer_id: 0,
                segments: vec![MarkerSegment {
                    store: 0,
                    name: "s".into(),
                    first_token: 0,
                    page_sizes: vec![1; pages],
                    stored_size: 0,
                    wrapped_key: None,
                }],
            }],
            mac: None,
        })
    }

    #[test]
    fn kept_for_a_while_then_read_again() {
        let mut cache = ManifestCache::default();
        let t0 = Instant::now();
        cache.put("a", manifest("a", 1), t0);
        assert!(cache.get("a", t0 + KEPT_FOR / 2).is_some());
        assert!(cache.get("b", t0).is_none());
        assert!(cache.get("a", t0 + KEPT_FOR).is_none(), "expired");
        assert_eq!(cache.bytes, 0);
        cache.put("a", manifest("a", 1), t0);
        cache.forget("a");
        assert!(cache.get("a", t0).is_none(), "forgotten");
        assert_eq!(cache.bytes, 0);
    }

    #[test]
    fn holds_at_most_its_bytes_oldest_going_first() {
        let mut cache = ManifestCache::default();
        let t0 = Instant::now();
        // About 1.6 MiB each: two fit in 4 MiB, a third pushes out the first.
        let large = || manifest("x", 200_000);
        assert!(size_in_memory(&large()) > MAX_BYTES / 3);
        cache.put("a", large(), t0);
        cache.put("b", large(), t0);
        cache.put("c", large(), t0);
        assert!(cache.get("a", t0).is_none());
        assert!(cache.get("b", t0).is_some() && cache.get("c", t0).is_some());
        assert!(cache.bytes <= MAX_BYTES);
        cache.put("huge", manifest("huge", 600_000), t0);
        assert!(cache.get("huge", t0).is_none(), "larger than all the room");
        assert!(cache.get("c", t0).is_some(), "and it pushed nothing out");
    }
}
