//! The spool policy of a task (OPEN_TASK field 18), shared by the wire, the
//! client and the server so it is spelled and parsed in one place.

use std::fmt;
use std::str::FromStr;

/// When a task's pages go to object storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum SpoolPolicy {
    /// Pages stay in memory; producers wait (then BUSY) when it is full.
    #[default]
    Off,
    /// Pages that do not fit in memory, or that slow consumers leave behind, are spooled.
    Overflow,
    /// Every page reaches storage before ENQUEUE is answered.
    Always,
    /// Pages stay in memory (spooled as under `overflow` when memory is
    /// short); NO_MORE_PAGES writes what is left to storage and commits the
    /// buffer before it is answered: the durability point is the finish.
    /// What the commit wrote stays in memory too (its readers come after
    /// the finish) until room is wanted, when it leaves with no write.
    Commit,
}

impl SpoolPolicy {
    /// The name on the wire and in config.
    pub fn name(self) -> &'static str {
        match self {
            SpoolPolicy::Off => "off",
            SpoolPolicy::Overflow => "overflow",
            SpoolPolicy::Always => "always",
            SpoolPolicy::Commit => "commit",
        }
    }

    /// Pages may be spooled to make room, or because they aged.
    pub fn spills(self) -> bool {
        matches!(self, SpoolPolicy::Overflow | SpoolPolicy::Commit)
    }

    /// NO_MORE_PAGES commits the buffer (its pages in storage, a commit
    /// marker naming them) before it is answered.
    pub fn commits(self) -> bool {
        matches!(self, SpoolPolicy::Always | SpoolPolicy::Commit)
    }
}

impl FromStr for SpoolPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(SpoolPolicy::Off),
            "overflow" => Ok(SpoolPolicy::Overflow),
            "always" => Ok(SpoolPolicy::Always),
            "commit" => Ok(SpoolPolicy::Commit),
            other => Err(format!(
                "unknown spool policy {:?}: expected \"off\", \"overflow\", \"always\" or \"commit\"",
                truncate(other, 64)
            )),
        }
    }
}

impl fmt::Display for SpoolPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `id` is a process instance id as binxd names them (HELLO
/// `instance=`, commit markers): 1 to 64 letters, digits and `._:-`.
/// Anything else (a hostile peer's log line) is not taken as one.
pub fn is_instance_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

/// At most `max` bytes of `text`, cut at a character boundary: a hostile
/// value is never echoed whole.
pub fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_round_trip_and_unknown_ones_are_named_briefly() {
        for p in [
            SpoolPolicy::Off,
            SpoolPolicy::Overflow,
            SpoolPolicy::Always,
            SpoolPolicy::Commit,
        ] {
            assert_eq!(p.to_string().parse::<SpoolPolicy>(), Ok(p));
        }
        let long = "x".repeat(10_000);
        let err = long.parse::<SpoolPolicy>().unwrap_err();
        assert!(err.len() < 200, "{err}");
        assert_eq!(truncate("héllo", 2), "h");
    }
}
