//! Tasks that ended, remembered for a while so late requests get the right
//! answer (complete, or the abort reason) instead of waiting for a task that
//! will never come. Bounded in count and age.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Gone {
    Finished,
    Aborted(String),
}

#[derive(Debug)]
pub(crate) struct Tombstones {
    by_id: HashMap<String, (Gone, Instant)>,
    order: VecDeque<(String, Instant)>,
    max: usize,
    keep: Duration,
}

impl Tombstones {
    pub fn new(max: usize, keep: Duration) -> Self {
        Tombstones {
            by_id: HashMap::new(),
            order: VecDeque::new(),
            max: max.max(1),
            keep,
        }
    }

    pub fn get(&self, id: &str) -> Option<&Gone> {
        self.by_id.get(id).map(|(gone, _)| gone)
    }

    pub fn insert(&mut self, id: String, gone: Gone, now: Instant) {
        self.by_id.insert(id.clone(), (gone, now));
        self.order.push_back((id, now));
        while self.by_id.len() > self.max {
            self.pop_oldest();
        }
    }

    /// Forgets entries older than the keep time.
    pub fn expire(&mut self, now: Instant) {
        while let Some((_, at)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.keep {
                break;
            }
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((id, at)) = self.order.pop_front()
            && self.by_id.get(&id).is_some_and(|(_, t)| *t == at)
        {
            self.by_id.remove(&id);
        }
    }
}
