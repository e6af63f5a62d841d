//! An object store in memory that carries out the core's commands as
//! binx-spool does against a working store.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Bytes;

use super::Completion;
use crate::core::{Command, Manifest, MarkerPlan};
use crate::data::{DataPlan, Resolved};
use crate::objects::{CommitMarker, Durability, ObjectMeta};

/// What the core is told of a segment object `name` holding `pages` from
/// `first_token` on, stored as they are (no codec, no key).
pub fn segment_meta(name: String, first_token: u64, pages: &[Bytes]) -> ObjectMeta {
    ObjectMeta {
        store: 0,
        name,
        first_token,
        page_sizes: pages.iter().map(|p| p.len() as u64).collect(),
        stored_size: pages.iter().map(|p| p.len() as u64).sum(),
        codec: Default::default(),
        key: None,
        expires_at_unix_ms: 0,
    }
}

/// The marker a reader gets of `plan`, written by process `instance` of
/// `node` at `endpoint`: as an object of its own, or `folded` into its
/// task's manifest.
pub fn written_marker(
    plan: &MarkerPlan,
    (node, endpoint, instance): (&str, &str, Option<&str>),
    folded: bool,
) -> CommitMarker {
    CommitMarker {
        task_id: plan.task.to_string(),
        buffer_id: plan.buffer,
        end_token: plan.end_token,
        node: node.into(),
        endpoint: endpoint.into(),
        instance: instance.map(str::to_string),
        segments: plan.objects.iter().map(|o| (**o).clone()).collect(),
        shared: plan.shared,
        folded,
    }
}

/// A segment object and its pages.
#[derive(Clone, Debug)]
pub struct StoredObject {
    /// What the core was told of it.
    pub meta: ObjectMeta,
    /// Its pages.
    pub pages: Vec<Bytes>,
    /// Whether it was written to outlive its writer.
    pub durability: Durability,
}

/// Objects, commit markers and manifests, as one binxd (`node`, reached at
/// `endpoint`) writes them.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    /// The writer's node name (in object names, markers and manifests).
    pub node: String,
    /// host:port the writer is reached at.
    pub endpoint: String,
    /// Segment objects by name.
    pub objects: BTreeMap<String, StoredObject>,
    /// Commit markers by (task, buffer).
    pub markers: BTreeMap<(String, u64), CommitMarker>,
    /// Commit manifests by task.
    pub manifests: BTreeMap<String, Manifest>,
    /// The markers folded into the manifests by (task, buffer).
    pub folded: BTreeMap<(String, u64), CommitMarker>,
    /// Folded markers a consumer released (binx-spool's release records).
    pub released: BTreeSet<(String, u64)>,
    serial: u64,
}

impl MemoryStore {
    /// An empty store written by `node` at `endpoint`.
    pub fn new(node: &str, endpoint: &str) -> Self {
        MemoryStore {
            node: node.into(),
            endpoint: endpoint.into(),
            objects: BTreeMap::new(),
            markers: BTreeMap::new(),
            manifests: BTreeMap::new(),
            folded: BTreeMap::new(),
            released: BTreeSet::new(),
            serial: 0,
        }
    }

    /// Carries out `command`, which succeeds. A forward has no remote here:
    /// it fails as if the remote could not be reached.
    pub fn carry_out(&mut self, command: Command) -> Completion {
        match command {
            Command::WriteSegment {
                task,
                first_token,
                pages,
                durability,
                ..
            } => {
                self.serial += 1;
                let name = format!("{}-{}-{task}", self.node, self.serial);
                let meta = segment_meta(name, first_token, &pages);
                let object = StoredObject {
                    meta: meta.clone(),
                    pages,
                    durability,
                };
                self.objects.insert(meta.name.clone(), object);
                Completion::SegmentWritten(Ok(meta))
            }
            Command::WriteMarker(plan) => {
                let marker = written_marker(&plan, (&self.node, &self.endpoint, None), false);
                self.markers
                    .insert((plan.task.to_string(), plan.buffer), marker);
                Completion::MarkerWritten(Ok(()))
            }
            Command::DeleteObject(meta) => {
                self.objects.remove(&meta.name);
                Completion::ObjectDeleted(Ok(()))
            }
            Command::DeleteMarker { task, buffer } => {
                self.markers.remove(&(task.to_string(), buffer));
                Completion::MarkerDeleted(Ok(()))
            }
            Command::ReadMarker { task, buffer } => {
                Completion::MarkerRead(Ok(self.marker(task.as_str(), buffer)))
            }
            Command::ReleaseCommitted(marker) => {
                self.release(&marker);
                Completion::Released
            }
            Command::WriteManifest(plan) => {
                // A put replaces the manifest, and what it folded in.
                let task = plan.task.to_string();
                self.folded.retain(|(t, _), _| *t != task);
                for m in &plan.markers {
                    let marker = written_marker(m, (&self.node, &self.endpoint, None), true);
                    self.folded
                        .insert((plan.task.to_string(), m.buffer), marker);
                }
                let manifest = Manifest {
                    node: self.node.clone(),
                    endpoint: self.endpoint.clone(),
                    buffers: plan.buffers,
                };
                self.manifests.insert(plan.task.to_string(), manifest);
                Completion::ManifestWritten(Ok(()))
            }
            Command::ReadManifest { task } => {
                Completion::ManifestRead(Ok(self.manifests.get(task.as_str()).cloned()))
            }
            Command::DeleteManifest { task, .. } => {
                self.remove_manifest(task.as_str());
                Completion::ManifestDeleted(Ok(()))
            }
            Command::Forward { remote, .. } => {
                Completion::Forwarded(Err(format!("cannot connect to {remote}")))
            }
        }
    }

    /// A consumer finished a committed buffer: as binx-spool does, its
    /// marker goes, then the segments no other marker of the task lists
    /// (shared BROADCAST segments only once the task's manifest exists);
    /// the last marker of the task takes the manifest.
    pub fn release(&mut self, marker: &CommitMarker) {
        let key = (marker.task_id.clone(), marker.buffer_id);
        if marker.folded {
            self.released.insert(key);
        } else {
            self.markers.remove(&key);
        }
        let has_manifest = self.manifests.contains_key(marker.task_id.as_str());
        let markers_left = self.named().any(|((task, _), _)| *task == marker.task_id);
        if has_manifest && !markers_left {
            self.remove_manifest(&marker.task_id);
        }
        if marker.shared && !has_manifest {
            return;
        }
        for segment in &marker.segments {
            if self.named_by_marker(&segment.name).is_none() {
                self.objects.remove(&segment.name);
            }
        }
    }

    /// The marker that names object `name`, if one does.
    pub fn named_by_marker(&self, name: &str) -> Option<&(String, u64)> {
        self.named()
            .find(|(_, m)| m.segments.iter().any(|s| s.name == name))
            .map(|(k, _)| k)
    }

    /// The markers that name objects: their own, and the folded ones not
    /// released.
    fn named(&self) -> impl Iterator<Item = (&(String, u64), &CommitMarker)> {
        self.markers.iter().chain(
            self.folded
                .iter()
                .filter(|(k, _)| !self.released.contains(*k)),
        )
    }

    /// A buffer's marker as a reader finds it: its own, or the one folded
    /// into its task's manifest unless released.
    pub fn marker(&self, task: &str, buffer: u64) -> Option<CommitMarker> {
        let key = (task.to_string(), buffer);
        self.markers.get(&key).cloned().or_else(|| {
            (!self.released.contains(&key))
                .then(|| self.folded.get(&key).cloned())
                .flatten()
        })
    }

    /// A manifest goes, and the markers folded into it with it.
    fn remove_manifest(&mut self, task: &str) {
        self.manifests.remove(task);
        self.folded.retain(|(t, _), _| t != task);
        self.released.retain(|(t, _)| t != task);
    }

    /// What the objects a DATA plan names hold (a missing one is a failure
    /// not worth retrying).
    pub fn read(&self, plan: &DataPlan) -> Vec<Resolved> {
        plan.objects()
            .map(|(meta, _)| match self.objects.get(&meta.name) {
                Some(o) => Resolved::Pages(Arc::new(o.pages.clone())),
                None => Resolved::Failed {
                    error: format!("{} does not exist", meta.name),
                    retry: false,
                },
            })
            .collect()
    }
}
