//! Spilling: moving pages from memory to storage under `overflow` (and what a drain must commit).

use super::*;

impl Core {
    pub(super) fn spill_written(
        &mut self,
        spill: Spill,
        result: Result<ObjectMeta, StoreFailure>,
        now: Instant,
    ) {
        let Spill {
            task: task_id,
            log,
            first_token,
            count,
            bytes,
            keep,
        } = spill;
        self.spills_in_flight -= 1;
        self.spill_bytes_in_flight -= bytes;
        if !keep {
            self.spill_bytes_freeing -= bytes;
            self.budget.spill(bytes, false);
        }
        let (object, failed) = match result {
            Ok(meta) => (Some(self.objects.insert(meta, task_id.clone())), false),
            Err(e) => {
                tracing::warn!(task = %task_id, token = first_token, error = %e, transient = e.transient, "spilling pages to storage failed; they stay in memory");
                self.last_spill_failure = Some(e);
                (None, true)
            }
        };
        if let Some(task) = self.tasks.get_mut(&task_id) {
            let before = task.memory();
            let referring =
                task.finish_spill(log, first_token, count, object, keep, &mut self.objects);
            let after = task.memory();
            self.account(before, after);
            if object.is_some() {
                self.stats.pages_spilled += referring;
            }
        }
        if let Some(id) = object
            && let Some(meta) = self.objects.collect(id)
        {
            // Every page was acknowledged while it was written.
            self.delete_objects(vec![meta]);
        }
        if failed {
            // Back off: no spill for a while; the age check wakes the core
            // then.
            let retry = now + SPILL_RETRY_AFTER;
            self.spill_retry_at = Some(retry);
            self.next_age_check = Some(retry);
        }
    }

    /// Starts the spills that are due: room for blocked ENQUEUEs of
    /// `overflow` tasks (the task's oldest pages held only in memory first),
    /// pages older than `spill_after`, and, while draining, what finished
    /// buffers still hold only in memory.
    pub(super) fn drive_spills(&mut self, now: Instant) {
        let Some(rules) = self.config.spool.clone() else {
            return;
        };
        let evicted = self.evict_for_room();
        while self.spills_in_flight < rules.spill_concurrency.max(1) {
            let Some((task_id, log, older_than, keep)) = self.pick_spill(now, &rules, evicted)
            else {
                break;
            };
            let Some(task) = self.tasks.get_mut(&task_id) else {
                break;
            };
            // A `commit` task's finished pages: its task-wide commit ends in
            // a manifest, which lets consumers' releases tell when a file
            // shared by several of its buffers is free (a drain's markers
            // of `overflow` tasks have none).
            let committing = keep && task.policy == SpoolPolicy::Commit;
            // Past the first write in flight, what they hold is bounded in
            // bytes too: many small writes (a commit's buffers) at once, a
            // large one alone (a run that does not fit waits for them).
            let room = match self.spills_in_flight {
                0 => u64::MAX,
                _ => rules
                    .spill_bytes_max
                    .saturating_sub(self.spill_bytes_in_flight),
            };
            let Some(run) = task.take_spill_run(
                log,
                rules.spill_target_bytes,
                rules.spill_max_bytes,
                older_than,
                room,
            ) else {
                break;
            };
            let bytes: u64 = run.pages.iter().map(|p| p.len() as u64).sum();
            self.spills_in_flight += 1;
            self.spill_bytes_in_flight += bytes;
            if !keep {
                self.spill_bytes_freeing += bytes;
                self.budget.spill(bytes, true);
            }
            self.new_op(
                OpKind::Spill(Spill {
                    task: task_id.clone(),
                    log,
                    first_token: run.first_token,
                    count: run.pages.len(),
                    bytes,
                    keep,
                }),
                Command::WriteSegment {
                    task: task_id,
                    first_token: run.first_token,
                    pages: run.pages,
                    durability: Durability::Overflow,
                    committing,
                },
            );
        }
    }

    /// The log holding the oldest memory-only page among the `overflow`
    /// tasks `keep` accepts (that arrived by `arrived_by`, when given):
    /// spilling oldest first frees what consumers will want last.
    fn oldest_overflow_pages(
        &self,
        keep: impl Fn(&Task) -> bool,
        arrived_by: Option<Instant>,
    ) -> Option<(TaskId, LogId)> {
        self.tasks
            .values()
            .filter(|t| t.policy.spills() && keep(t))
            .filter_map(|t| {
                t.oldest_spillable()
                    .map(|(log, seq, at)| (seq, at, &t.id, log))
            })
            .filter(|(_, at, ..)| arrived_by.is_none_or(|by| *at <= by))
            .min_by_key(|(seq, ..)| *seq)
            .map(|(_, _, id, log)| (id.clone(), log))
    }

    /// Pages in memory that are in storage too (a `commit` buffer's kept
    /// after its spill, an `always` ENQUEUE's) leave memory, with no write:
    /// a task's own when it waits for room under its own limit or is past
    /// three quarters of it; others', oldest first, for what ENQUEUEs here
    /// and in other shards miss of the daemon's room (less what spills
    /// under way will free), and while memory is past three quarters of
    /// its limit (as `pick_spill` spills ahead). They are read from storage
    /// after. True when memory was freed: the ENQUEUEs waiting try again
    /// before anything is spilled for them.
    pub(super) fn evict_for_room(&mut self) -> bool {
        let start = self.memory_used;
        let task_high = self.config.task_memory_limit / 4 * 3;
        let own: Vec<TaskId> = self
            .tasks
            .values()
            .filter(|t| t.stored_in_memory)
            .filter(|t| {
                t.memory() > task_high
                    || self
                        .room_wanted
                        .values()
                        .any(|(own, _)| own.as_ref() == Some(&t.id))
            })
            .map(|t| t.id.clone())
            .collect();
        for task_id in own {
            self.evict_stored_of(&task_id, None);
        }
        // What each ENQUEUE here missed when it tried (renewed when it tries
        // again, after this frees anything), less what spills under way
        // free for it; other shards' wants less what this shard freed for
        // them since they reported them.
        let here = self
            .room_missed_here()
            .saturating_sub(self.spill_bytes_freeing)
            + self.room_wanted_unspillable.values().sum::<u64>();
        let (reports, others) = self.missed_elsewhere();
        let high_water = self.config.memory_limit / 4 * 3;
        let high = |core: &Core| core.budget.unspilled() > high_water;
        let (mut for_here, mut for_others) = (0u64, 0u64);
        if here + others > 0 || high(self) {
            // One look at every log that holds such pages, oldest first.
            let mut logs: Vec<(u64, TaskId, LogId)> = Vec::new();
            for task in self.tasks.values_mut().filter(|t| t.stored_in_memory) {
                let id = task.id.clone();
                let found = task.stored_in_memory_logs();
                logs.extend(found.into_iter().map(|(log, seq)| (seq, id.clone(), log)));
            }
            logs.sort_unstable_by_key(|(seq, ..)| *seq);
            for (_, task_id, log) in logs {
                let missing = here.saturating_sub(for_here) + others.saturating_sub(for_others);
                if missing == 0 && !high(self) {
                    break;
                }
                let before = self.memory_used;
                self.evict_stored_of(&task_id, Some(log));
                let freed = before.saturating_sub(self.memory_used);
                let mine = freed.min(here.saturating_sub(for_here));
                for_here += mine;
                for_others += freed - mine;
            }
        }
        if for_others > 0 {
            self.evicted_for_others = match self.evicted_for_others {
                (seen, done) if seen == reports => (seen, done + for_others),
                _ => (reports, for_others),
            };
        }
        self.memory_used < start
    }

    /// What other shards' ENQUEUEs miss of the daemon's room as their
    /// shards last reported it, less what this shard freed for them since:
    /// (the count of reports then, the bytes).
    fn missed_elsewhere(&self) -> (u64, u64) {
        let (wanted, reports) = self.budget.evictable_wants();
        let own = self.reported_want.1 + self.reported_want.2;
        let elsewhere = wanted.saturating_sub(own);
        let left = match self.evicted_for_others {
            (seen, done) if seen == reports => elsewhere.saturating_sub(done),
            _ => elsewhere,
        };
        (reports, left)
    }

    /// Frees what `log` of the task (every log, with `None`) holds in
    /// memory and in storage too.
    fn evict_stored_of(&mut self, task_id: &TaskId, log: Option<LogId>) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        let before = task.memory();
        let pages = match log {
            Some(log) => task.evict_stored_log(log),
            None => task.evict_all_stored(),
        };
        let after = task.memory();
        self.account(before, after);
        let freed = before.saturating_sub(after);
        self.stats.bytes_evicted += freed;
        if pages > 0 {
            tracing::debug!(task = %task_id, pages, freed, "pages in storage too left memory for room");
        }
    }

    /// The next spill due, and whether its pages stay in memory once
    /// written. With `evicted` (pages left memory for room just now), none
    /// is started for room: the ENQUEUEs waiting try the room first.
    pub(super) fn pick_spill(
        &self,
        now: Instant,
        rules: &SpoolRules,
        evicted: bool,
    ) -> Option<(TaskId, LogId, Option<Instant>, bool)> {
        if self.spill_retry_at.is_some_and(|at| now < at) {
            return None;
        }
        let overflow = || self.tasks.values().filter(|t| t.policy.spills());
        let need: u64 = self.room_wanted.values().map(|(_, n)| n).sum();
        if !evicted && need > self.spill_bytes_freeing {
            for (own, _) in self.room_wanted.values() {
                let pick = match own {
                    Some(task_id) => self
                        .tasks
                        .get(task_id)
                        .and_then(|t| t.oldest_spillable().map(|(log, _, _)| (t.id.clone(), log))),
                    None => self.oldest_overflow_pages(|_| true, None),
                };
                if let Some((task, log)) = pick {
                    return Some((task, log, None, false));
                }
            }
        }
        // Other shards wait for room this shard's oldest pages can free.
        let (_, wanted) = self.budget.wants();
        let elsewhere = wanted.saturating_sub(self.reported_want.1);
        if !evicted
            && elsewhere > 0
            && need + elsewhere > self.spill_bytes_freeing
            && let Some((task, log)) = self.oldest_overflow_pages(|_| true, None)
        {
            return Some((task, log, None, false));
        }
        // Ahead of need: past three quarters of the memory limit (the
        // daemon's, or an overflow task's own), the oldest pages go to
        // storage while the producer keeps enqueuing, so room is there
        // before an ENQUEUE has to wait for it.
        let high_water = |limit: u64| limit / 4 * 3;
        let daemon_high = self.budget.unspilled() > high_water(self.config.memory_limit);
        let ahead = self.oldest_overflow_pages(
            |t| daemon_high || t.memory() > high_water(self.config.task_memory_limit),
            None,
        );
        if let Some((task, log)) = ahead {
            return Some((task, log, None, false));
        }
        if let Some(older) = now.checked_sub(rules.spill_after)
            && let Some((task, log)) = self.oldest_overflow_pages(|_| true, Some(older))
        {
            return Some((task, log, Some(older), false));
        }
        // Finished buffers of `commit` tasks (their NO_MORE_PAGES waits for
        // them), and while draining those of `overflow` tasks too. Their
        // pages stay in memory once written (`keep`), served from there
        // until room is wanted; so they do not count as freeing memory.
        for t in overflow().filter(|t| self.drain_spooling || t.policy == SpoolPolicy::Commit) {
            let mut logs = t.committable_logs();
            if t.broadcast_commit_waiting() {
                logs.push(LogId::Shared);
            }
            for log in logs {
                if !t.log_fully_spooled(log) {
                    // Only pages not yet spilling are taken again.
                    let spillable = match log {
                        LogId::Shared => t.shared.spillable_bytes() > 0,
                        LogId::Buffer(id) => t
                            .buffers
                            .get(&id)
                            .is_some_and(|b| b.log.spillable_bytes() > 0),
                    };
                    if spillable {
                        return Some((t.id.clone(), log, None, true));
                    }
                }
            }
        }
        None
    }
}
