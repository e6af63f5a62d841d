//! OPEN_TASK and ABORT_TASK: a task's start and its abort, and the tombstones ended tasks leave.

use super::*;

impl Core {
    pub(super) fn open_task(&mut self, request: &Request, now: Instant) -> Reply {
        let Op::OpenTask {
            task: task_id,
            kind,
            buffer_count,
            policy,
        } = &request.op
        else {
            debug_assert!(false, "open_task is called for OPEN_TASK only");
            return refused(
                request,
                Refusal::Misrouted("a request other than OPEN_TASK"),
            );
        };
        let tid = || task_id.clone();
        let bad = |r: Refusal| refused(request, r);
        let policy = policy.unwrap_or(self.config.default_spool_policy);
        if policy != SpoolPolicy::Off && self.spool().is_none() {
            return bad(Refusal::NeedsSpoolStore {
                task: tid(),
                policy,
            });
        }
        if policy.commits()
            && let Some(why) = self.spool().and_then(|s| s.always_refusal.clone())
        {
            return bad(Refusal::CommitUnavailable { task: tid(), why });
        }
        if let Some(n) = buffer_count
            && *n > self.config.max_buffers_per_task
        {
            return bad(Refusal::BufferCountOverLimit {
                task: tid(),
                count: *n,
                limit: self.config.max_buffers_per_task,
            });
        }
        if let Some(task) = self.tasks.get(task_id) {
            if task.kind == *kind && task.fixed_count == *buffer_count && task.policy == policy {
                return Reply::new(request.reply(Status::Ok));
            }
            return bad(Refusal::AlreadyOpen {
                task: task_id.clone(),
                kind: task.kind,
                count: task.fixed_count.unwrap_or(0),
                policy: task.policy,
            });
        }
        if let Some(gone) = self.ended.get(task_id) {
            let how = match gone {
                Gone::Aborted(reason) => format!("was aborted ({reason})"),
                Gone::Finished | Gone::FinishedOpenBroadcast => "already finished".to_string(),
                Gone::Abandoned => "was dropped as abandoned".to_string(),
            };
            return bad(Refusal::TaskIdReused { task: tid(), how });
        }
        if self.draining {
            return bad(Refusal::Draining { task: tid() });
        }
        let early = self.early.remove(task_id).unwrap_or_default();
        let max_buffers = self.config.max_buffers_per_task;
        let task = Task::new(
            task_id.clone(),
            *kind,
            *buffer_count,
            policy,
            early,
            max_buffers,
            now,
        );
        let mem = task.memory();
        self.tasks.insert(task_id.clone(), task);
        self.account(0, mem);
        self.dirty.push((task_id.clone(), None));
        Reply::new(request.reply(Status::Ok))
    }

    /// Aborts a task (known or not yet opened: its consumers then see the
    /// reason).
    pub(super) fn abort(&mut self, task_id: &TaskId, reason: &str, now: Instant) {
        tracing::info!(task = %task_id, reason = %binx_proto::truncate(reason, 256), "task aborted");
        self.stats.tasks_aborted += 1;
        self.end_task(task_id, Gone::Aborted(reason.to_string()), now);
    }

    /// Aborts an open task for an operator; returns the bytes freed, or
    /// `None` when no such task is open (so a typo aborts nothing).
    pub fn abort_open_task(&mut self, task_id: &str, reason: &str, now: Instant) -> Option<u64> {
        let task = TaskId::parse(task_id).ok()?;
        self.tasks.contains_key(&task).then_some(())?;
        let before = self.memory_used;
        let reason = binx_proto::truncate(reason, crate::MAX_REASON_LEN);
        self.abort(
            &task,
            if reason.is_empty() {
                "aborted by an operator"
            } else {
                reason
            },
            now,
        );
        self.after(now);
        Some(before - self.memory_used)
    }

    /// Frees a task's pages and remembers how it ended.
    pub(super) fn end_task(&mut self, task_id: &TaskId, how: Gone, now: Instant) {
        if let Some(mut task) = self.tasks.remove(task_id) {
            for conn in &task.producers {
                if let Some(set) = self.producer_conns.get_mut(conn) {
                    set.remove(task_id);
                    if set.is_empty() {
                        self.producer_conns.remove(conn);
                    }
                }
            }
            if task.manifest {
                let folded = self.markers.folded_of(task_id);
                self.new_op(
                    OpKind::ManifestDelete {
                        task: task_id.clone(),
                    },
                    Command::DeleteManifest {
                        task: task_id.clone(),
                        folded,
                    },
                );
            }
            let before = task.memory();
            let mut deletes = Vec::new();
            let markers = task.clear(&mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            });
            let after = task.memory();
            // The task is gone: everything it held is released, and what
            // waited for room (its own ENQUEUEs too) looks again.
            self.account(before, after);
            self.account(after, 0);
            self.room_freed = true;
            self.delete_objects(deletes);
            for buffer in markers {
                self.release_marker(task_id, buffer);
            }
        }
        self.ended.insert(task_id.clone(), how, now);
        self.early.remove(task_id);
        self.dirty.push((task_id.clone(), None));
    }
}
