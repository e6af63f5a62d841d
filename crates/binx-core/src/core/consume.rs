//! ACK and DELETE: consumers freeing pages and buffers, and deletions that come before their task.

use super::*;

impl Core {
    pub(super) fn ack(
        &mut self,
        request: &Request,
        key: &BufferKey,
        token: u64,
        now: Instant,
    ) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            if self.ended.get(task_id).is_some() {
                return Reply::new(request.reply(Status::Ok));
            }
            if token == 0 {
                // Remembered as a DELETE: the consumer has gone before the
                // producer came (docs/PROTOCOL.md section 4, "DELETE, ABORT_TASK
                // and abandoned buffers").
                self.remember_early_delete(task_id, buffer_id, now);
                return Reply::new(request.reply(Status::Ok));
            }
            return refused(
                request,
                Refusal::AckUnknownTask {
                    task: task_id.clone(),
                    buffer: buffer_id,
                    token,
                },
            );
        };
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return refused(request, e);
        }
        task.last_activity = now;
        if let Some(buffer) = task.buffers.get_mut(&buffer_id) {
            if buffer.gone.is_some() {
                return Reply::new(request.reply(Status::Ok));
            }
            buffer.last_poll = now;
        }
        let before = task.memory();
        let mut deletes = Vec::new();
        let result = task.ack(
            buffer_id,
            token,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let after = task.memory();
        self.account(before, after);
        self.delete_objects(deletes);
        match result {
            Ok(()) => Reply::new(request.reply(Status::Ok)),
            Err(e) => refused(request, token_error(e, task_id, buffer_id, token)),
        }
    }

    pub(super) fn remember_early_delete(&mut self, task_id: &TaskId, buffer_id: u64, now: Instant) {
        match self.early.get_mut(task_id) {
            Some(set) => {
                if set.len() < MAX_EARLY_DELETES_PER_TASK {
                    set.insert(buffer_id);
                }
            }
            None => self
                .early
                .insert(task_id.clone(), BTreeSet::from([buffer_id]), now),
        }
    }

    pub(super) fn delete(&mut self, request: &Request, key: &BufferKey, now: Instant) -> Reply {
        let (task_id, buffer_id) = (&key.task, key.buffer);
        let max_buffers = self.config.max_buffers_per_task;
        let Some(task) = self.tasks.get_mut(task_id) else {
            if self.ended.get(task_id).is_none() {
                self.remember_early_delete(task_id, buffer_id, now);
            }
            // Nothing is held, and DELETE is repeatable.
            return Reply::new(request.reply(Status::Ok));
        };
        if let Err(e) = check_buffer_id(task, buffer_id, max_buffers) {
            return refused(request, e);
        }
        task.last_activity = now;
        self.drop_buffer(task_id, buffer_id, BufferGone::Deleted, now);
        Reply::new(request.reply(Status::Ok))
    }

    /// Deletes or abandons a buffer: frees its pages, deletes its marker,
    /// and ends the task once nothing is left.
    pub(super) fn drop_buffer(
        &mut self,
        task_id: &TaskId,
        buffer_id: u64,
        how: BufferGone,
        now: Instant,
    ) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        let before = task.memory();
        let mut deletes = Vec::new();
        let had_marker = task.delete(
            buffer_id,
            how,
            now,
            &mut Sink {
                objects: &mut self.objects,
                deletes: &mut deletes,
            },
        );
        let after = task.memory();
        // Every buffer gone ends the task, unless its producer still holds
        // a connection: then it stays (its pages dropped as they come) until
        // the producer finishes or goes.
        let done = task.is_done() && (how == BufferGone::Deleted || task.producers.is_empty());
        self.account(before, after);
        self.delete_objects(deletes);
        if had_marker {
            self.release_marker(task_id, buffer_id);
        }
        self.dirty.push((task_id.clone(), None));
        if done {
            let how = self.tasks.get(task_id).map_or(Gone::Finished, finished);
            self.end_task(task_id, how, now);
        }
    }
}
