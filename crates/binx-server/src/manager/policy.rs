//! Per-task spool policy (DESIGN.md: off, overflow, always).

use std::fmt;
use std::str::FromStr;

/// When a task's pages go to object storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SpoolPolicy {
    /// Pages stay in memory; producers wait (then BUSY) when it is full.
    #[default]
    Off,
    /// Pages that do not fit in memory, or that slow consumers leave behind, are spooled.
    Overflow,
    /// Every page reaches storage before ENQUEUE is answered.
    Always,
}

impl FromStr for SpoolPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(SpoolPolicy::Off),
            "overflow" => Ok(SpoolPolicy::Overflow),
            "always" => Ok(SpoolPolicy::Always),
            other => Err(format!(
                "unknown spool policy {other:?}: expected \"off\", \"overflow\" or \"always\""
            )),
        }
    }
}

impl fmt::Display for SpoolPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpoolPolicy::Off => "off",
            SpoolPolicy::Overflow => "overflow",
            SpoolPolicy::Always => "always",
        })
    }
}
