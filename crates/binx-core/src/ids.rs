//! Identifiers the core and its drivers exchange.

/// One request, numbered by the driver (unique among requests not yet
/// answered): the core answers it by this number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// One client connection, numbered by the driver: ENQUEUE and NO_MORE_PAGES
/// of a connection take effect in the order sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// One command the core asked for; its completion names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// The objects a [`crate::DataPlan`] reads, kept from deletion until the
/// driver calls [`crate::Core::plan_finished`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);
