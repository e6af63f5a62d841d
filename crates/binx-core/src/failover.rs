//! What a proxy consumer knows of the remotes it forwards to: which node
//! each remote said it is, and which buffers a remote has failed to serve
//! since when (since when a remote has answered nothing at all is in
//! [`crate::silences`], which the shards share). Bounded; forgotten when
//! idle or deleted.

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
    /// remote -> the process instance its latest HELLO reply named, as
    /// this shard last passed it on to [`crate::silences`] (which tells
    /// restarts), so an unchanged one costs no shared lock.
    pub instances: BTreeMap<Arc<str>, Arc<str>>,
    /// Buffers whose commit marker was read at once after their remote was
    /// seen to restart, and that restart: at most once per buffer and
    /// restart (a live buffer of the new process answers NO_DATA between
    /// its pages, and must not cost a storage read each time).
    pub restart_checks: BTreeMap<RemoteKey, Instant>,
    /// Buffers read through forwarding -> the remote's process instance
    /// whose DATA replies served them, and when one last did. A reply
    /// from another process is another run of the task id: the earlier
    /// process went with the buffer (docs/PROTOCOL.md section 7,
    /// "Failover").
    pub read_from: BTreeMap<RemoteKey, (Arc<str>, Instant)>,
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

    /// Remembers the instance `remote` named; false when it is the one
    /// remembered already (bounded like the states).
    pub(crate) fn instance_changed(
        &mut self,
        remote: &str,
        instance: &Arc<str>,
        max: usize,
    ) -> bool {
        if let Some(known) = self.instances.get_mut(remote) {
            if Arc::ptr_eq(known, instance) || **known == **instance {
                return false;
            }
            *known = instance.clone();
            return true;
        }
        if self.instances.len() >= max {
            self.instances.clear();
        }
        self.instances.insert(Arc::from(remote), instance.clone());
        true
    }

    /// Whether `remote` has said it is (or was) `node`.
    pub(crate) fn vouches(&self, remote: &str, node: &str) -> bool {
        self.identities
            .get(remote)
            .is_some_and(|names| names.iter().any(|n| n == node))
    }

    /// Whether a buffer of a remote seen to restart at `restarted` may
    /// have its marker read at once (not yet for this restart).
    pub(crate) fn restart_unchecked(&self, key: &RemoteKey, restarted: Instant) -> bool {
        self.restart_checks.get(key) != Some(&restarted)
    }

    /// Records that a buffer's marker was read at once after the restart
    /// seen at `restarted` (bounded like the states).
    pub(crate) fn restart_checked(&mut self, key: RemoteKey, restarted: Instant, max: usize) {
        if self.restart_checks.len() >= max && !self.restart_checks.contains_key(&key) {
            // Forgetting costs at most one more read per buffer.
            self.restart_checks.clear();
        }
        self.restart_checks.insert(key, restarted);
    }

    /// Records that process `instance` of the remote answered a DATA for
    /// the buffer `key`; `Err` with the process its earlier replies came
    /// from when that was another. Bounded like the states: when full,
    /// the half read from longest ago is forgotten (a buffer forgotten is
    /// read on unchecked, as from a remote that names no instance).
    pub(crate) fn read_from(
        &mut self,
        key: &RemoteKey,
        instance: &Arc<str>,
        now: Instant,
        max: usize,
    ) -> Result<(), Arc<str>> {
        if let Some((was, used)) = self.read_from.get_mut(key) {
            if **was != **instance {
                return Err(was.clone());
            }
            *used = now;
            return Ok(());
        }
        if max == 0 {
            return Ok(());
        }
        if self.read_from.len() >= max {
            let mut times: Vec<Instant> = self.read_from.values().map(|(_, t)| *t).collect();
            let middle = times.len() / 2;
            let (_, cut, _) = times.select_nth_unstable(middle);
            let cut = *cut;
            tracing::warn!(
                tracked = self.read_from.len(),
                "forgetting which remote process served the forwarded buffers read longest ago (max_tracked_remotes)"
            );
            self.read_from.retain(|_, (_, used)| *used > cut);
        }
        self.read_from.insert(key.clone(), (instance.clone(), now));
        Ok(())
    }

    /// The process the buffer `key` was read from, if remembered; a request
    /// for it keeps the record (`used`), so a reader that long-polls, or is
    /// told to retry, does not lose it.
    pub(crate) fn process_of(&mut self, key: &RemoteKey, now: Instant) -> Option<Arc<str>> {
        let (instance, used) = self.read_from.get_mut(key)?;
        *used = now;
        Some(instance.clone())
    }

    /// A buffer of `task` below `buffers` read from a process of `remote`,
    /// and that process.
    pub(crate) fn task_read_from(
        &self,
        remote: &Arc<str>,
        task: &TaskId,
        buffers: u64,
    ) -> Option<(u64, Arc<str>)> {
        let from: RemoteKey = (remote.clone(), task.clone(), 0);
        let to: RemoteKey = (remote.clone(), task.clone(), buffers);
        self.read_from
            .range(from..to)
            .next()
            .map(|((_, _, buffer), (instance, _))| (*buffer, instance.clone()))
    }

    /// Forgets which processes served the buffers of `task` below
    /// `buffers` at `remote` (deleted).
    pub(crate) fn forget_task(&mut self, remote: &Arc<str>, task: &TaskId, buffers: u64) {
        let from: RemoteKey = (remote.clone(), task.clone(), 0);
        let to: RemoteKey = (remote.clone(), task.clone(), buffers);
        let keys: Vec<RemoteKey> = self
            .read_from
            .range(from..to)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.read_from.remove(&key);
        }
    }

    /// Forgets states untouched for `idle`.
    pub(crate) fn expire(&mut self, now: Instant, idle: Duration) {
        self.read_from
            .retain(|_, (_, used)| now.saturating_duration_since(*used) < idle);
        self.restart_checks
            .retain(|_, at| now.saturating_duration_since(*at) < idle);
        self.states.retain(|_, state| match state {
            RemoteState::Failing { since, checked } => {
                now.saturating_duration_since(checked.unwrap_or(*since)) < idle
            }
            RemoteState::Lost { used, .. } => now.saturating_duration_since(*used) < idle,
            RemoteState::Released { at } => now.saturating_duration_since(*at) < idle,
        });
    }
}
