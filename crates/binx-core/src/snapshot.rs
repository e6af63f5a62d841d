//! What an operator sees of the tasks a daemon holds (the admin service's
//! list): plain copies of the core's state.

use std::time::{Duration, Instant};

use binx_proto::BufferKind;

use crate::task::{Buffer, Task};
use binx_proto::SpoolPolicy;

/// Where a buffer is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferState {
    /// The producer may still add pages.
    Open,
    /// NO_MORE_PAGES was received; pages remain to be read.
    Finished,
    /// Every page was read and acknowledged; the consumer may DELETE it.
    Complete,
    /// Deleted by its consumer.
    Deleted,
    /// Dropped: no consumer polled it for the abandon time.
    Abandoned,
}

impl BufferState {
    /// The state's name in stats and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            BufferState::Open => "open",
            BufferState::Finished => "finished",
            BufferState::Complete => "complete",
            BufferState::Deleted => "deleted",
            BufferState::Abandoned => "abandoned",
        }
    }
}

/// One buffer of a task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferSnapshot {
    /// The buffer's id within its task.
    pub buffer_id: u64,
    /// Where it is in its life.
    pub state: BufferState,
    /// Every page below this token was acknowledged.
    pub acknowledged_token: u64,
    /// Token the next produced page gets.
    pub next_token: u64,
    /// Pages it holds in memory.
    pub pages_held: u64,
    /// Bytes of the pages it holds in memory.
    pub bytes_held: u64,
    /// Time since a consumer last polled it.
    pub idle: Duration,
}

/// One task and its buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskSnapshot {
    /// The task's id.
    pub task_id: String,
    /// How its pages map to buffers.
    pub kind: BufferKind,
    /// Where its pages go besides memory.
    pub spool_policy: SpoolPolicy,
    /// Fixed number of buffers, or `None` when buffers are added as consumers come.
    pub buffer_count: Option<u64>,
    /// Task-wide NO_MORE_PAGES was received.
    pub input_finished: bool,
    /// Bytes of pages the task holds (a broadcast page counts once).
    pub memory: u64,
    /// Time since the task last changed.
    pub idle: Duration,
    /// Its buffers, by id.
    pub buffers: Vec<BufferSnapshot>,
}

impl TaskSnapshot {
    pub(crate) fn of(task_id: &str, task: &Task, now: Instant) -> Self {
        TaskSnapshot {
            task_id: task_id.to_string(),
            kind: task.kind,
            spool_policy: task.policy,
            buffer_count: task.fixed_count,
            input_finished: task.input_finished,
            memory: task.page_bytes,
            idle: now.saturating_duration_since(task.last_activity),
            buffers: task
                .buffers
                .iter()
                .map(|(&id, buffer)| buffer_snapshot(task, id, buffer, now))
                .collect(),
        }
    }
}

fn buffer_snapshot(task: &Task, buffer_id: u64, buffer: &Buffer, now: Instant) -> BufferSnapshot {
    let (acknowledged_token, next_token, pages_held, bytes_held) = match task.kind {
        BufferKind::Broadcast => {
            let next = task.shared.next();
            let from = buffer.cursor.max(task.shared.base());
            let sizes = task.shared.sizes(from, next, usize::MAX);
            (buffer.cursor, next, sizes.len() as u64, sizes.iter().sum())
        }
        _ => (
            buffer.log.base(),
            buffer.log.next(),
            buffer.log.len() as u64,
            buffer
                .log
                .iter()
                .filter(|p| p.body.is_some())
                .map(|p| p.size)
                .sum(),
        ),
    };
    let state = if let Some(gone) = buffer.gone {
        match gone {
            crate::task::BufferGone::Deleted => BufferState::Deleted,
            crate::task::BufferGone::Abandoned => BufferState::Abandoned,
        }
    } else {
        match buffer.end {
            None => BufferState::Open,
            Some(end) if acknowledged_token >= end => BufferState::Complete,
            Some(_) => BufferState::Finished,
        }
    };
    BufferSnapshot {
        buffer_id,
        state,
        acknowledged_token,
        next_token,
        pages_held,
        bytes_held,
        idle: now.saturating_duration_since(buffer.last_poll),
    }
}
