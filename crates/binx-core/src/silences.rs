//! [`RemoteSilences`]: since when each remote a proxy consumer forwards to
//! has answered nothing at all, shared by the shards of one exchange.
//!
//! Failover is timed per buffer ([`crate::failover`]) and, for a remote
//! that answers nothing (a dead or stopped node), per remote: once it has
//! been silent for `failover_after`, a buffer that fails for the first
//! time is due for its commit marker at once, instead of each buffer of a
//! dead node waiting out `failover_after` of its own. A remote is one
//! node whatever the task, and tasks live on different shards, so the
//! silences are shared: a lock taken only when a forward fails, or when a
//! remote answers while some remote is silent (an atomic count says
//! whether any is). Healthy forwarding never takes it. When storage is
//! asked changes what failover costs, never what is served: that is
//! decided by the marker (only the node that wrote it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Since when each remote has answered nothing; cheap to clone (every
/// clone is the same map).
#[derive(Clone, Debug, Default)]
pub struct RemoteSilences {
    inner: Arc<Runs>,
}

#[derive(Debug, Default)]
struct Runs {
    /// Entries in `runs`: read without the lock, so an answer while no
    /// remote is silent costs one atomic load.
    count: AtomicUsize,
    runs: Mutex<BTreeMap<Arc<str>, Silence>>,
}

/// An unbroken run of forwards to one remote that got no answer.
#[derive(Debug, Clone, Copy)]
struct Silence {
    /// When the first request of the run that got no answer went out.
    since: Instant,
    /// The latest failure of the run.
    last: Instant,
}

impl RemoteSilences {
    /// No remote silent.
    pub fn new() -> Self {
        RemoteSilences::default()
    }

    fn runs(&self) -> MutexGuard<'_, BTreeMap<Arc<str>, Silence>> {
        // The map is consistent after every statement: a panic elsewhere
        // while holding it leaves nothing half done.
        self.inner
            .runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a forward to `remote`, sent at `sent`, that got no answer
    /// by `now`; returns since when the remote has answered nothing. A
    /// request sent more than `gap` after the run's latest failure (nobody
    /// asked the remote meanwhile: it may have come back and gone again)
    /// starts the run over. At most `max` remotes are remembered.
    pub(crate) fn silent(
        &self,
        remote: &Arc<str>,
        sent: Instant,
        now: Instant,
        gap: Duration,
        max: usize,
    ) -> Instant {
        let mut runs = self.runs();
        if let Some(run) = runs.get_mut(remote) {
            if sent.saturating_duration_since(run.last) > gap {
                run.since = sent;
            } else {
                run.since = run.since.min(sent);
            }
            run.last = run.last.max(now);
            return run.since;
        }
        if runs.len() >= max.max(1) {
            runs.retain(|_, run| now.saturating_duration_since(run.last) <= gap);
            if runs.len() >= max.max(1) {
                // Only makes failover wait its per-buffer clock again.
                runs.clear();
            }
        }
        runs.insert(
            remote.clone(),
            Silence {
                since: sent,
                last: now,
            },
        );
        self.inner.count.store(runs.len(), Ordering::Relaxed);
        sent
    }

    /// `remote` answered a forwarded request (whatever its status): it is
    /// not silent.
    pub(crate) fn answered(&self, remote: &str) {
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut runs = self.runs();
        if runs.remove(remote).is_some() {
            self.inner.count.store(runs.len(), Ordering::Relaxed);
        }
    }

    /// Forgets runs with no failure for `idle`.
    pub(crate) fn expire(&self, now: Instant, idle: Duration) {
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut runs = self.runs();
        runs.retain(|_, run| now.saturating_duration_since(run.last) < idle);
        self.inner.count.store(runs.len(), Ordering::Relaxed);
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
