//! Commit markers this daemon writes, and the references they hold. An
//! object a marker names is never deleted before the marker is: a marker's
//! deletion is asked only after its write finished, and its objects are
//! released only once the deletion succeeded. A marker folded into its
//! task's manifest is deleted with the manifest: its objects are released
//! once the manifest's deletion succeeded.

use std::collections::BTreeMap;

use crate::ids::{OpId, Ticket};
use crate::objects::ObjectId;
use crate::task_id::TaskId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MarkerState {
    Writing(OpId),
    Written,
    Deleting(OpId),
    /// Folded into its task's manifest, and its buffer went: its objects
    /// stay until the manifest is deleted (which names them until then).
    Released,
}

#[derive(Debug)]
pub(crate) struct MarkerEntry {
    pub objects: Vec<ObjectId>,
    pub state: MarkerState,
    /// The buffer went while the marker was being written: delete it after.
    pub delete_after_write: bool,
    /// NO_MORE_PAGES requests waiting for this write.
    pub waiters: Vec<Ticket>,
    /// In the task's manifest (written by the manifest's op, deleted with
    /// it), not an object of its own.
    pub folded: bool,
}

/// Markers by (task, buffer).
#[derive(Debug, Default)]
pub(crate) struct Markers {
    pub entries: BTreeMap<(TaskId, u64), MarkerEntry>,
}

impl Markers {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether markers of `task` are folded into its manifest.
    pub(crate) fn folded_of(&self, task: &TaskId) -> bool {
        self.entries
            .range((task.clone(), 0)..=(task.clone(), u64::MAX))
            .any(|(_, e)| e.folded)
    }
}
