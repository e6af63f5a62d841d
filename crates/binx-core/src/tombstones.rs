//! What the core remembers of things that are gone, so late requests get the
//! right answer instead of waiting for something that will never come: tasks
//! that ended (finished, aborted, abandoned) and buffers deleted before their
//! task was opened. Bounded in count and age; a repeated entry takes no
//! extra room.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use crate::task_id::TaskId;

/// How a task ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Gone {
    /// Every buffer was deleted by its consumer.
    Finished,
    /// Like `Finished`, for a broadcast task whose buffers came as
    /// consumers asked: a buffer asked for now was never part of its set
    /// (and would miss every page), so it is not reported complete.
    FinishedOpenBroadcast,
    /// An ABORT_TASK, with its reason (capped).
    Aborted(String),
    /// Dropped because nobody touched it (or one of its buffers) for the
    /// abandon time: never reported complete.
    Abandoned,
}

#[derive(Debug)]
struct Entry<V> {
    value: V,
    generation: u64,
}

/// A map whose entries expire by age and, past a count, oldest first.
#[derive(Debug)]
pub(crate) struct Expiring<V> {
    by_id: BTreeMap<TaskId, Entry<V>>,
    order: VecDeque<(TaskId, u64, Instant)>,
    max: usize,
    keep: Duration,
    generation: u64,
}

impl<V> Expiring<V> {
    pub(crate) fn new(max: usize, keep: Duration) -> Self {
        Expiring {
            by_id: BTreeMap::new(),
            order: VecDeque::new(),
            max: max.max(1),
            keep,
            generation: 0,
        }
    }

    pub(crate) fn get<Q>(&self, id: &Q) -> Option<&V>
    where
        TaskId: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.by_id.get(id).map(|e| &e.value)
    }

    pub(crate) fn get_mut<Q>(&mut self, id: &Q) -> Option<&mut V>
    where
        TaskId: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.by_id.get_mut(id).map(|e| &mut e.value)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Inserts or replaces; a replaced entry keeps its place in the order
    /// (and so expires with its first insertion).
    pub(crate) fn insert(&mut self, id: TaskId, value: V, now: Instant) {
        if let Some(entry) = self.by_id.get_mut(&id) {
            entry.value = value;
            return;
        }
        self.generation += 1;
        self.order.push_back((id.clone(), self.generation, now));
        self.by_id.insert(
            id,
            Entry {
                value,
                generation: self.generation,
            },
        );
        while self.by_id.len() > self.max {
            self.pop_oldest();
        }
    }

    pub(crate) fn remove<Q>(&mut self, id: &Q) -> Option<V>
    where
        TaskId: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.by_id.remove(id).map(|e| e.value)
    }

    /// Forgets entries older than the keep time.
    pub(crate) fn expire(&mut self, now: Instant) {
        while let Some((_, _, at)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.keep {
                break;
            }
            self.pop_oldest();
        }
        // Entries removed by id leave stale order records behind; drop them
        // when they dominate, so the order never outgrows the map by much.
        if self.order.len() > 2 * self.by_id.len() + 64 {
            let by_id = &self.by_id;
            self.order
                .retain(|(id, g, _)| by_id.get(id).is_some_and(|e| e.generation == *g));
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((id, generation, _)) = self.order.pop_front()
            && self
                .by_id
                .get(&id)
                .is_some_and(|e| e.generation == generation)
        {
            self.by_id.remove(&id);
        }
    }
}

/// Ended tasks.
pub(crate) type Ended = Expiring<Gone>;

/// Buffers deleted (or acknowledged at token 0) before their task opened.
pub(crate) type EarlyDeletes = Expiring<EarlyDeleted>;

/// Buffers remembered per task at most in an early DELETE record, one by
/// one (a DELETE_TASK's range takes one number, whatever its length).
pub(crate) const MAX_EARLY_DELETES_PER_TASK: usize = 4096;

/// The buffers of a task deleted before it opened: every one below
/// `below` (DELETE_TASK), and those in `ids` (DELETE, ACK at token 0).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct EarlyDeleted {
    /// Buffers `0..below` are deleted.
    pub below: u64,
    /// Buffers deleted one by one (at most [`MAX_EARLY_DELETES_PER_TASK`]).
    pub ids: BTreeSet<u64>,
    /// Those of `ids` only an ACK at token 0 named: a DELETE of one still
    /// reads its commit marker (an ACK never releases committed output; a
    /// consumer may go on to read it from storage).
    pub acked: BTreeSet<u64>,
}

impl EarlyDeleted {
    /// Whether buffer `id` was deleted.
    pub(crate) fn contains(&self, id: u64) -> bool {
        id < self.below || self.ids.contains(&id)
    }

    /// Whether a DELETE (or DELETE_TASK) named buffer `id`: its commit
    /// marker was looked at then, if this node has a spool.
    pub(crate) fn deleted_by_delete(&self, id: u64) -> bool {
        self.contains(id) && !self.acked.contains(&id)
    }

    /// Remembers buffer `id`, deleted by a DELETE, while fewer than the
    /// bound are.
    pub(crate) fn insert(&mut self, id: u64) {
        self.acked.remove(&id);
        if !self.contains(id) && self.ids.len() < MAX_EARLY_DELETES_PER_TASK {
            self.ids.insert(id);
        }
    }

    /// Remembers buffer `id`, named by an ACK at token 0, while fewer than
    /// the bound are.
    pub(crate) fn insert_acked(&mut self, id: u64) {
        if !self.contains(id) && self.ids.len() < MAX_EARLY_DELETES_PER_TASK {
            self.ids.insert(id);
            self.acked.insert(id);
        }
    }

    /// Remembers buffers `0..below`, deleted by a DELETE_TASK; the ones
    /// below it need no entry.
    pub(crate) fn insert_below(&mut self, below: u64) {
        if below > self.below {
            self.below = below;
            self.ids = self.ids.split_off(&below);
            self.acked = self.acked.split_off(&below);
        }
    }

    /// Every buffer remembered, in order (those below `below` first).
    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.below).chain(self.ids.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> TaskId {
        TaskId::parse(s).unwrap()
    }

    /// Buffers deleted one by one and as ranges: the range takes what is
    /// below it, and the record lists every buffer once, in order.
    #[test]
    fn an_early_delete_record_keeps_ranges_as_one_number() {
        let mut early = EarlyDeleted::default();
        for id in [9, 3, 40, 3] {
            early.insert(id);
        }
        assert_eq!(early.iter().collect::<Vec<_>>(), [3, 9, 40]);
        early.insert_below(10);
        assert_eq!(early.ids.len(), 1, "3 and 9 are in the range");
        early.insert(5);
        early.insert_below(4);
        assert_eq!(
            early.iter().collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 40]
        );
        assert!(early.contains(0) && early.contains(9) && early.contains(40));
        assert!(!early.contains(10) && !early.contains(41));
        for id in 100..100 + MAX_EARLY_DELETES_PER_TASK as u64 {
            early.insert(id);
        }
        assert_eq!(early.ids.len(), MAX_EARLY_DELETES_PER_TASK, "bounded");
        assert!(early.contains(40));
        early.insert_below(1_000_000);
        assert!(early.ids.is_empty() && early.contains(999_999));
    }

    /// A buffer an ACK at token 0 named is deleted, but not by a DELETE
    /// until one names it (alone or in a range); it takes the bound's room
    /// as any other.
    #[test]
    fn an_ack_at_token_0_is_a_delete_that_read_no_marker() {
        let mut early = EarlyDeleted::default();
        early.insert_acked(7);
        early.insert_acked(20);
        assert!(early.contains(7) && !early.deleted_by_delete(7));
        early.insert(7);
        assert!(early.deleted_by_delete(7), "the DELETE after it");
        early.insert_acked(7);
        assert!(
            early.deleted_by_delete(7),
            "an ACK after a DELETE changes nothing"
        );
        early.insert(3);
        early.insert_acked(3);
        assert!(early.deleted_by_delete(3));
        assert!(!early.deleted_by_delete(20));
        early.insert_below(21);
        assert!(early.deleted_by_delete(20), "the range named it");
        assert!(early.acked.is_empty() && early.ids.is_empty());
        early.insert_acked(30);
        for id in 100..100 + MAX_EARLY_DELETES_PER_TASK as u64 {
            early.insert_acked(id);
        }
        assert_eq!(early.ids.len(), MAX_EARLY_DELETES_PER_TASK, "bounded");
        assert!(early.acked.len() <= early.ids.len());
        assert!(!early.contains(100 + MAX_EARLY_DELETES_PER_TASK as u64 - 1));
    }

    #[test]
    fn bounded_in_count_and_age_and_repeats_take_no_room() {
        let t0 = Instant::now();
        let mut ended: Ended = Expiring::new(2, Duration::from_secs(10));
        for _ in 0..1000 {
            ended.insert(id("a"), Gone::Aborted("x".into()), t0);
        }
        assert_eq!(ended.order.len(), 1);
        ended.insert(id("b"), Gone::Finished, t0);
        ended.insert(id("c"), Gone::Abandoned, t0);
        assert_eq!(ended.get("a"), None);
        assert_eq!(ended.get("c"), Some(&Gone::Abandoned));
        ended.expire(t0 + Duration::from_secs(10));
        assert_eq!(ended.len(), 0);
    }
}
