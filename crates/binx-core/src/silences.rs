//! [`RemoteSilences`]: since when each remote a proxy consumer forwards to
//! has answered nothing at all, and when one was last seen to restart,
//! shared by the shards of one exchange.
//!
//! Failover is timed per buffer (`failover.rs`) and, for a remote
//! that answers nothing (a dead or stopped node), per remote: once it has
//! been silent for `failover_after`, a buffer that fails for the first
//! time is due for its commit marker at once, instead of each buffer of a
//! dead node waiting out `failover_after` of its own. A remote whose HELLO
//! replies name another process instance than before restarted: every
//! buffer its earlier process held is gone, and a buffer it cannot serve
//! is due for its marker at once too (once per buffer and restart). A
//! remote is one node whatever the task, and tasks live on different
//! shards, so both are shared. An answer while no remote is silent costs
//! one atomic load; while one is, a read lock; only a failure, or an answer
//! from a silent remote, takes the write lock. Likewise a NO_DATA while no
//! restart is remembered costs an atomic load, while one is a read lock;
//! an instance takes the write lock only when a shard sees another than
//! the last it saw from that remote. When storage is asked changes what failover costs, never what
//! is served: that is decided by the marker (only the node that wrote it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Since when each remote has answered nothing; cheap to clone (every
/// clone is the same map).
#[derive(Clone, Debug)]
pub struct RemoteSilences {
    inner: Arc<Runs>,
}

#[derive(Debug)]
struct Runs {
    /// Most remotes remembered (the daemon's `max_tracked_remotes`).
    max: usize,
    /// Entries in `runs`, kept under the write lock and read without it,
    /// so an answer while no remote is silent takes no lock at all.
    count: AtomicUsize,
    runs: RwLock<BTreeMap<Arc<str>, Silence>>,
    /// Entries of `restarts`, read without the lock.
    restart_count: AtomicUsize,
    identities: RwLock<Identities>,
}

/// Earlier instances remembered per remote: a late reply over a
/// connection to one of them is not another restart.
const EARLIER_INSTANCES: usize = 4;

/// An unbroken run of failed forwards to one remote, with no answer
/// from it since the first.
#[derive(Debug, Clone, Copy)]
struct Silence {
    /// The first failure of the run.
    since: Instant,
    /// The latest failure of the run.
    last: Instant,
}

/// The processes remotes said they are, and when one was seen to change.
#[derive(Debug, Default)]
struct Identities {
    /// remote -> its latest instance, then the earlier ones (latest first).
    instances: BTreeMap<Arc<str>, Vec<Arc<str>>>,
    /// remote -> when it was last seen to restart.
    restarts: BTreeMap<Arc<str>, Instant>,
}

impl RemoteSilences {
    /// No remote silent; at most `max` remembered.
    pub fn new(max: usize) -> Self {
        RemoteSilences {
            inner: Arc::new(Runs {
                max: max.max(1),
                count: AtomicUsize::new(0),
                runs: RwLock::new(BTreeMap::new()),
                restart_count: AtomicUsize::new(0),
                identities: RwLock::new(Identities::default()),
            }),
        }
    }

    // The map is consistent after every statement: a panic elsewhere while
    // holding it leaves nothing half done.
    fn read(&self) -> RwLockReadGuard<'_, BTreeMap<Arc<str>, Silence>> {
        self.inner
            .runs
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, BTreeMap<Arc<str>, Silence>> {
        self.inner
            .runs
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a forward to `remote` that failed at `now` with no answer;
    /// returns since when the remote has answered nothing (its first
    /// failure since it last answered). A failure more than `gap` after
    /// the run's latest (nothing asked of the remote meanwhile: it may have
    /// come back and gone again) starts the run over. When full of live
    /// runs, a new remote is not remembered: its buffers keep their own
    /// clocks.
    pub(crate) fn silent(&self, remote: &Arc<str>, now: Instant, gap: Duration) -> Instant {
        let mut runs = self.write();
        if let Some(run) = runs.get_mut(remote) {
            if now.saturating_duration_since(run.last) > gap {
                run.since = now;
            }
            run.last = run.last.max(now);
            return run.since;
        }
        if runs.len() >= self.inner.max {
            runs.retain(|_, run| now.saturating_duration_since(run.last) <= gap);
            self.inner.count.store(runs.len(), Ordering::Relaxed);
            if runs.len() >= self.inner.max {
                return now;
            }
        }
        runs.insert(
            remote.clone(),
            Silence {
                since: now,
                last: now,
            },
        );
        self.inner.count.store(runs.len(), Ordering::Relaxed);
        now
    }

    /// `remote` answered a forwarded request (whatever its status): it is
    /// not silent.
    pub(crate) fn answered(&self, remote: &str) {
        if self.inner.count.load(Ordering::Relaxed) == 0 || !self.read().contains_key(remote) {
            return;
        }
        let mut runs = self.write();
        if runs.remove(remote).is_some() {
            self.inner.count.store(runs.len(), Ordering::Relaxed);
        }
    }

    /// Forgets runs with no failure for `idle`, and restarts seen longer
    /// ago than that.
    pub(crate) fn expire(&self, now: Instant, idle: Duration) {
        if self.inner.restart_count.load(Ordering::Relaxed) > 0 {
            let mut identities = self.write_identities();
            identities
                .restarts
                .retain(|_, at| now.saturating_duration_since(*at) < idle);
            self.inner
                .restart_count
                .store(identities.restarts.len(), Ordering::Relaxed);
        }
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut runs = self.write();
        runs.retain(|_, run| now.saturating_duration_since(run.last) < idle);
        self.inner.count.store(runs.len(), Ordering::Relaxed);
    }

    fn write_identities(&self) -> RwLockWriteGuard<'_, Identities> {
        self.inner
            .identities
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `remote` answered over a connection whose HELLO reply named process
    /// `instance` (a shard calls this only for another instance than the
    /// last it saw from `remote`). Another instance than the latest remembered,
    /// and none of the few before it (a late reply over a connection to
    /// an earlier process), is a restart, seen at `now` (true). Bounded:
    /// when full, the maps start over, which only delays failover.
    pub(crate) fn instance_seen(
        &self,
        remote: &Arc<str>,
        instance: &Arc<str>,
        now: Instant,
    ) -> bool {
        let mut identities = self.write_identities();
        let max = self.inner.max;
        let restarted = match identities.instances.get_mut(remote) {
            Some(known) if known.contains(instance) => false,
            Some(known) => {
                known.insert(0, instance.clone());
                known.truncate(1 + EARLIER_INSTANCES);
                true
            }
            None => {
                if identities.instances.len() >= max {
                    identities.instances.clear();
                }
                identities
                    .instances
                    .insert(remote.clone(), vec![instance.clone()]);
                false
            }
        };
        if restarted {
            if identities.restarts.len() >= max && !identities.restarts.contains_key(remote) {
                identities.restarts.clear();
            }
            identities.restarts.insert(remote.clone(), now);
            self.inner
                .restart_count
                .store(identities.restarts.len(), Ordering::Relaxed);
        }
        restarted
    }

    /// When `remote` was last seen to restart (a new process instance at
    /// its address), if that is remembered. One atomic load while no
    /// restart is; a read lock while one is.
    pub(crate) fn restarted(&self, remote: &str) -> Option<Instant> {
        if self.inner.restart_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.inner
            .identities
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .restarts
            .get(remote)
            .copied()
    }

    /// Remotes remembered as silent.
    pub fn len(&self) -> usize {
        self.inner.count.load(Ordering::Relaxed)
    }

    /// Whether no remote is remembered as silent.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    /// Bounded: a full map of live runs remembers no new remote (whose
    /// buffers keep their own clocks) and never forgets a live run for it;
    /// runs past the gap make room.
    #[test]
    fn a_full_map_keeps_its_live_runs_and_makes_room_from_stale_ones() {
        let silences = RemoteSilences::new(2);
        let (a, b, c): (Arc<str>, Arc<str>, Arc<str>) = ("a:1".into(), "b:1".into(), "c:1".into());
        let t0 = Instant::now();
        let gap = 10 * SEC;
        assert_eq!(silences.silent(&a, t0, gap), t0);
        assert_eq!(silences.silent(&b, t0 + SEC, gap), t0 + SEC);
        assert_eq!(silences.silent(&c, t0 + 2 * SEC, gap), t0 + 2 * SEC);
        assert_eq!(silences.len(), 2);
        assert_eq!(
            silences.silent(&a, t0 + 3 * SEC, gap),
            t0,
            "a's run is kept"
        );
        // b's last failure is past the gap: c takes its place.
        assert_eq!(silences.silent(&c, t0 + 12 * SEC, gap), t0 + 12 * SEC);
        assert_eq!(silences.silent(&c, t0 + 13 * SEC, gap), t0 + 12 * SEC);
        assert_eq!(silences.len(), 2);
        silences.answered("c:1");
        silences.answered("nobody:1");
        assert_eq!(silences.len(), 1);
        silences.expire(t0 + 14 * SEC, 10 * SEC);
        assert!(silences.is_empty(), "a failed last 11 s ago");
    }

    /// Restarts: only a change of a remembered instance is one, and not a
    /// late reply from one of the few before it; the maps are bounded
    /// (full, they start over and forget, which only delays failover); a
    /// restart is forgotten once `idle` old.
    #[test]
    fn a_restart_is_a_changed_instance_and_the_maps_are_bounded() {
        let silences = RemoteSilences::new(2);
        let (a, b, c): (Arc<str>, Arc<str>, Arc<str>) = ("a:1".into(), "b:1".into(), "c:1".into());
        let [one, two, three]: [Arc<str>; 3] = ["one".into(), "two".into(), "three".into()];
        let t0 = Instant::now();
        assert!(!silences.instance_seen(&a, &one, t0), "first seen");
        assert!(!silences.instance_seen(&a, &one, t0), "the same");
        assert_eq!(silences.restarted("a:1"), None);
        assert!(silences.instance_seen(&a, &two, t0 + SEC));
        assert_eq!(silences.restarted("a:1"), Some(t0 + SEC));
        assert!(
            !silences.instance_seen(&a, &one, t0 + 2 * SEC),
            "a late reply from the earlier process"
        );
        assert_eq!(silences.restarted("a:1"), Some(t0 + SEC));
        assert!(!silences.instance_seen(&b, &one, t0), "another remote");
        assert_eq!(silences.restarted("b:1"), None);
        silences.expire(t0 + 5 * SEC, 10 * SEC);
        assert_eq!(silences.restarted("a:1"), Some(t0 + SEC), "5 s old");
        silences.expire(t0 + 11 * SEC, 10 * SEC);
        assert_eq!(silences.restarted("a:1"), None, "10 s old");
        assert_eq!(silences.inner.restart_count.load(Ordering::Relaxed), 0);
        assert!(silences.instance_seen(&a, &three, t0 + 12 * SEC));
        assert!(silences.instance_seen(&b, &two, t0 + 12 * SEC));
        assert_eq!(silences.inner.restart_count.load(Ordering::Relaxed), 2);
        // Full: a third remote starts the instances over.
        assert!(!silences.instance_seen(&c, &one, t0 + 13 * SEC));
        assert!(
            !silences.instance_seen(&a, &one, t0 + 14 * SEC),
            "forgotten"
        );
        assert_eq!(silences.inner.identities.read().unwrap().instances.len(), 2);
        // A third restart starts the restarts over.
        assert!(silences.instance_seen(&c, &two, t0 + 15 * SEC));
        assert_eq!(silences.restarted("c:1"), Some(t0 + 15 * SEC));
        assert_eq!(silences.restarted("b:1"), None);
        assert_eq!(silences.inner.restart_count.load(Ordering::Relaxed), 1);
    }
}
