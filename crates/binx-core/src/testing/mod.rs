//! What tests drive the core with (feature `testing`): the vocabulary of
//! storage completions ([`Completion`]), an object store in memory that
//! answers commands as binx-spool does ([`MemoryStore`]), the door's view of
//! a core ([`CoreFacts`]), and a driver that ties them to a core with a
//! clock the test moves ([`MemoryDriver`]).
//!
//! The unit tests and the property tests run on [`MemoryDriver`]; the
//! simulation, which adds latency, faults, partitions and crashes, submits
//! through the same door with [`CoreFacts`] and hands the core its storage
//! results as [`Completion`]s.

mod completion;
mod driver;
mod store;

pub use completion::Completion;
pub use driver::{MemoryDriver, door_config};
pub use store::{MemoryStore, StoredObject, segment_meta, written_marker};

use crate::core::Core;
use crate::door::ExchangeFacts;

/// The door's questions, answered from a core (as binxd's exchange does).
#[derive(Clone, Copy, Debug)]
pub struct CoreFacts {
    /// The core's memory limit is reached.
    pub memory_full: bool,
    /// A forwarder stands behind the core.
    pub forwards: bool,
    /// What HELLO replies list.
    pub capabilities: &'static [&'static str],
}

impl CoreFacts {
    /// The facts of `core` now; `forwards` as configured.
    pub fn of(core: &Core, forwards: bool) -> Self {
        CoreFacts {
            memory_full: core.memory_full(),
            forwards,
            capabilities: &[],
        }
    }
}

impl ExchangeFacts for CoreFacts {
    fn memory_full(&self) -> bool {
        self.memory_full
    }

    fn forwards(&self) -> bool {
        self.forwards
    }

    fn capabilities(&self) -> Vec<String> {
        self.capabilities.iter().map(|c| c.to_string()).collect()
    }
}
