//! Drain: no new task; finished `overflow` buffers committed so consumers can finish from storage.

use super::*;

impl Core {
    /// Stops accepting new tasks (existing ones go on); with a store, the
    /// pages of finished `overflow` buffers held only in memory are spooled
    /// and committed, so consumers can finish from storage once this daemon
    /// is gone. False when a drain had already started.
    pub fn start_drain(&mut self, now: Instant) -> bool {
        if std::mem::replace(&mut self.draining, true) {
            return false;
        }
        match self.spool() {
            Some(rules) if rules.always_refusal.is_none() => self.drain_spooling = true,
            Some(rules) => {
                tracing::warn!(
                    "draining: held pages are not spooled, as their buffers could not be committed: {}",
                    rules.always_refusal.clone().unwrap_or_default()
                );
            }
            None => {}
        }
        self.after(now);
        true
    }

    /// While draining: once nothing is left to spill, commits every log
    /// that is fully in storage.
    pub(super) fn drive_drain(&mut self, now: Instant) {
        // After a failed spill, the spills resume when the pause ends: the
        // drain waits for them rather than committing without them.
        if !self.drain_spooling
            || self.spills_in_flight > 0
            || self.spill_retry_at.is_some_and(|at| now < at)
        {
            return;
        }
        self.drain_spooling = false;
        let ids: Vec<TaskId> = self
            .tasks
            .values()
            .filter(|t| t.policy.spills())
            .map(|t| t.id.clone())
            .collect();
        let mut committed = 0usize;
        for task_id in ids {
            let plans = match self.tasks.get_mut(&task_id) {
                Some(task) => task.drain_commit_plans(now),
                None => continue,
            };
            for (buffer, end, objects) in plans {
                self.commit(&task_id, buffer, end, objects, None);
                committed += 1;
            }
        }
        if committed > 0 {
            tracing::info!(
                buffers_committed = committed,
                "draining: unacknowledged pages of finished buffers are in storage under commit markers; their consumers can finish from there"
            );
        }
    }

    /// Whether [`Core::start_drain`] was called: new tasks are refused.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Object deletions asked for and not yet done.
    pub fn deletes_in_flight(&self) -> u64 {
        self.deletes_in_flight as u64
    }

    /// Pages held by all tasks: what stopping now would lose.
    pub fn pages_held(&self) -> u64 {
        self.tasks.values().map(Task::pages_held).sum()
    }
}
