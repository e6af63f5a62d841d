//! A coordinator deleting a task's output with one DELETE_TASK once its
//! consumers are done, as the Trino plugin does: through any sidecar,
//! forwarded to the producer's, asked again while unanswered. Half of them
//! first send one naming more buffers than a task may have, while the
//! consumers still read: refused whole, it must change nothing.

use super::*;

impl World {
    pub(super) fn deleter_tick(&mut self, d: usize) -> Check {
        let dl = &self.deleters[d];
        if dl.done || dl.in_flight.is_some() {
            return Ok(());
        }
        let pid = dl.task;
        let reading = self.consumers.iter().any(|c| {
            c.task == pid
                && !c.hostile
                && matches!(c.state, ConsumerState::Waiting | ConsumerState::Running)
        });
        let side = dl.side;
        let dl = &mut self.deleters[d];
        dl.tries += 1;
        if dl.tries > MAX_DELETER_TRIES {
            dl.done = true;
            return Ok(());
        }
        if self.sides[side].core.is_none() || (reading && !dl.too_wide) {
            self.after(Duration::from_secs(2), Ev::Tick(Actor::Deleter(d)));
            return Ok(());
        }
        let pr = &self.producers[pid];
        let mut r = BinRequest::new(MessageType::DeleteTask);
        r.task_id = pr.task_id.clone();
        r.buffer_count = pr.buffers;
        let dl = &mut self.deleters[d];
        if dl.too_wide {
            dl.too_wide = false;
            dl.too_wide_in_flight = true;
            r.buffer_count = CoreConfig::default().max_buffers_per_task + 1 + pr.buffers;
        }
        r.remote = dl.remote.clone().unwrap_or_default();
        dl.next_id += 1;
        r.request_id = dl.next_id;
        dl.in_flight = Some(r.request_id);
        let task = r.task_id.clone();
        let buffers = r.buffer_count;
        self.note(|| {
            format!("DELETE_TASK of buffers 0..{buffers} of task {task} via sidecar {side}")
        });
        self.send(Actor::Deleter(d), side, r, Bytes::new(), 0);
        Ok(())
    }

    pub(super) fn deleter_reply(&mut self, d: usize, reply: Option<Reply>) -> Check {
        let dl = &mut self.deleters[d];
        let Some(reply) = reply else {
            // The connection went with its sidecar: asked again.
            if dl.in_flight.take().is_some() {
                dl.too_wide_in_flight = false;
                self.after(Duration::from_secs(1), Ev::Tick(Actor::Deleter(d)));
            }
            return Ok(());
        };
        if dl.in_flight != Some(reply.header.request_id) {
            return Ok(());
        }
        dl.in_flight = None;
        let task = &self.producers[dl.task].task_id;
        if std::mem::take(&mut dl.too_wide_in_flight) {
            match reply.header.status_kind() {
                Status::BadRequest => dl.refused_too_wide = true,
                // Forwarded to a remote that did not answer, or was busy.
                Status::Timeout | Status::Busy => {}
                other => {
                    return Err(format!(
                        "a DELETE_TASK of task {task} naming more buffers than a task may have, through sidecar {}, was answered {}: {}",
                        dl.side,
                        other.name(),
                        reply.header.error
                    ));
                }
            }
            self.after(Duration::from_secs(1), Ev::Tick(Actor::Deleter(d)));
            return Ok(());
        }
        match reply.header.status_kind() {
            Status::Ok => {
                dl.done = true;
                dl.deleted = true;
            }
            // The remote did not answer, or was busy: asked again.
            Status::Timeout | Status::Busy => {
                self.after(Duration::from_secs(1), Ev::Tick(Actor::Deleter(d)));
            }
            // A buffer this sidecar serves from storage: the plugin deletes
            // buffer by buffer then; this deleter leaves it to the consumers.
            Status::BadRequest if reply.header.error.contains("served from storage here") => {
                dl.done = true;
            }
            other => {
                return Err(format!(
                    "DELETE_TASK of task {task} ({} buffers) through sidecar {} was answered {}: {}",
                    self.producers[dl.task].buffers,
                    dl.side,
                    other.name(),
                    reply.header.error
                ));
            }
        }
        Ok(())
    }
}
