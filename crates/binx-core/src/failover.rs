//! What a proxy consumer knows of the remotes it forwards to: which node
//! each remote said it is, which buffers a remote has failed to serve
//! since when, and since when a remote has answered nothing at all.
//! Bounded; forgotten when idle or deleted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::objects::CommitMarker;
use crate::task_id::TaskId;

/// Node names remembered per remote.
const NAMES_PER_REMOTE: usize = 4;

/// One buffer read through one remote.
pub(crate) type RemoteKey = (Arc<str>, TaskId, u64);

#[derive(Debug, Clone)]
pub(crate) enum RemoteState {
    /// Failing since `since` (no answer, or NO_DATA). `checked`: when
    /// storage was last asked for a commit marker, so it is asked at most
    /// once per `failover_after`.
    Failing {
        since: Instant,
        checked: Option<Instant>,
    },
    /// The producer lost this committed buffer: served from its marker
    /// until the consumer deletes it.
    Lost {
        marker: Arc<CommitMarker>,
        used: Instant,
    },
    /// A buffer served from its marker that the consumer deleted: a
    /// DELETE repeated (its reply was lost) is OK again, not a forward to
    /// the dead remote that times out.
    Released { at: Instant },
}

#[derive(Debug, Default)]
pub(crate) struct RemoteWatch {
    pub states: BTreeMap<RemoteKey, RemoteState>,
    /// remote -> the node names it gave in its HELLO replies, latest last
    /// (a pod restarted under another name at the same address still
    /// vouches for what it wrote before).
    pub identities: BTreeMap<Arc<str>, Vec<String>>,
    /// remote -> since when every request forwarded to it failed without
    /// an answer (a dead or stopped node). A buffer first asked of a remote
    /// that has been silent that long is due for failover at once, instead
    /// of each buffer of a dead node waiting out its own `failover_after`.
    pub silences: BTreeMap<Arc<str>, Silence>,
}

/// An unbroken run of forwards to one remote that got no answer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Silence {
    /// The first failure of the run.
    pub since: Instant,
    /// The latest failure of the run.
    pub last: Instant,
}

impl RemoteWatch {
    /// Makes room for one more state: forgets failures nobody retried for a
    /// while and markers nobody read; false when still full.
    pub(crate) fn make_room(&mut self, max: usize, now: Instant, stale: Duration) -> bool {
        if self.states.len() < max {
            return true;
        }
        self.states.retain(|_, state| match state {
            RemoteState::Failing { since, checked } => {
                now.saturating_duration_since(checked.unwrap_or(*since)) < stale
            }
            RemoteState::Lost { used, .. } => now.saturating_duration_since(*used) < stale,
            RemoteState::Released { at } => now.saturating_duration_since(*at) < stale,
        });
        self.states.len() < max
    }

    /// Remembers which node a remote is (bounded like the states).
    pub(crate) fn identify(&mut self, remote: &str, node: String, max: usize) {
        if let Some(known) = self.identities.get_mut(remote) {
            if known.last() != Some(&node) {
                known.retain(|n| *n != node);
                known.push(node);
                if known.len() > NAMES_PER_REMOTE {
                    known.remove(0);
                }
            }
            return;
        }
        if self.identities.len() >= max {
            // Identities are cheap to learn again on the next connection.
            self.identities.clear();
        }
        self.identities.insert(Arc::from(remote), vec![node]);
    }

    /// Whether `remote` has said it is (or was) `node`.
    pub(crate) fn vouches(&self, remote: &str, node: &str) -> bool {
        self.identities
            .get(remote)
            .is_some_and(|names| names.iter().any(|n| n == node))
    }

    /// Records a forward to `remote` that got no answer at `now`; returns
    /// since when the remote has answered nothing. A run with no failure
    /// seen for `gap` (nobody asked it meanwhile: it may have come back and
    /// gone again) starts over at `now`, so one old failure never makes a
    /// later one due at once.
    pub(crate) fn silent(
        &mut self,
        remote: &Arc<str>,
        now: Instant,
        gap: Duration,
        max: usize,
    ) -> Instant {
        if let Some(run) = self.silences.get_mut(remote) {
            if now.saturating_duration_since(run.last) > gap {
                run.since = now;
            }
            run.last = now;
            return run.since;
        }
        if self.silences.len() >= max {
            self.silences
                .retain(|_, run| now.saturating_duration_since(run.last) <= gap);
            if self.silences.len() >= max {
                // Only makes failover wait its per-buffer clock again.
                self.silences.clear();
            }
        }
        self.silences.insert(
            remote.clone(),
            Silence {
                since: now,
                last: now,
            },
        );
        now
    }

    /// `remote` answered a forwarded request (whatever its status): it is
    /// not silent.
    pub(crate) fn answered(&mut self, remote: &str) {
        self.silences.remove(remote);
    }

    /// Forgets states untouched for `idle`.
    pub(crate) fn expire(&mut self, now: Instant, idle: Duration) {
        self.silences
            .retain(|_, run| now.saturating_duration_since(run.last) < idle);
        self.states.retain(|_, state| match state {
            RemoteState::Failing { since, checked } => {
                now.saturating_duration_since(checked.unwrap_or(*since)) < idle
            }
            RemoteState::Lost { used, .. } => now.saturating_duration_since(*used) < idle,
            RemoteState::Released { at } => now.saturating_duration_since(*at) < idle,
        });
    }
}
