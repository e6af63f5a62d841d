//! Object names. The expiry time comes first, zero-padded, so a listing
//! (sorted by S3, GCS and Azure) shows expired objects first and a pruner
//! can tell them from the name alone, as Trino's spooling names do. Then the
//! node that wrote the object, so a restarted binxd can find what its
//! crashed predecessor left, and whether the object must outlive its writer.

use std::fmt;

/// Longest node name accepted in object names.
pub const MAX_NODE_NAME_LEN: usize = 64;

pub use binx_core::Durability;

/// The letter of a durability in object names.
fn letter(durability: Durability) -> char {
    match durability {
        Durability::Overflow => 'o',
        Durability::Durable => 'a',
    }
}

/// The parts of an object name `<expiry ms, 13 digits>-<node>-<o|a>-<serial hex>.bxs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectName {
    /// When the TTL pruner may delete the object (unix milliseconds).
    pub expires_at_unix_ms: u64,
    /// The spool node name of the binxd that wrote it.
    pub node: String,
    /// Whether it must outlive its writer (`a`) or not (`o`).
    pub durability: Durability,
    /// Counts up from a random start per run, so a node never reuses a
    /// name (16 hex digits in the name).
    pub serial: u64,
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:013}-{}-{}-{:016x}.bxs",
            self.expires_at_unix_ms,
            self.node,
            letter(self.durability),
            self.serial
        )
    }
}

impl ObjectName {
    /// Reads a name binx wrote; anything else is `None` (and left alone).
    pub fn parse(name: &str) -> Option<ObjectName> {
        let stem = name.strip_suffix(".bxs")?;
        let (expiry, rest) = stem.split_once('-')?;
        let (rest, serial) = rest.rsplit_once('-')?;
        let (node, letter) = rest.rsplit_once('-')?;
        if expiry.len() != 13 || validate_node_name(node).is_err() {
            return None;
        }
        let durability = match letter {
            "o" => Durability::Overflow,
            "a" => Durability::Durable,
            _ => return None,
        };
        Some(ObjectName {
            expires_at_unix_ms: expiry.parse().ok()?,
            node: node.to_string(),
            durability,
            serial: u64::from_str_radix(serial, 16).ok()?,
        })
    }
}

/// Node names go into object names: 1 to 64 of `A-Z a-z 0-9 . _`, and `-`
/// inside (not first or last).
pub fn validate_node_name(node: &str) -> Result<(), String> {
    if node.is_empty() || node.len() > MAX_NODE_NAME_LEN {
        return Err(format!(
            "node name {node:?} must be 1 to {MAX_NODE_NAME_LEN} characters"
        ));
    }
    if !node
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        || node.starts_with('-')
        || node.ends_with('-')
    {
        return Err(format!(
            "node name {node:?} may only hold A-Z, a-z, 0-9, '.', '_' and '-' (not first or last)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sort_by_expiry() {
        let a = ObjectName {
            expires_at_unix_ms: 999_999_999_999,
            node: "worker-1.pod".into(),
            durability: Durability::Durable,
            serial: 7,
        };
        let b = ObjectName {
            expires_at_unix_ms: 1_000_000_000_000,
            node: "a".into(),
            durability: Durability::Overflow,
            serial: u64::MAX,
        };
        assert_eq!(
            a.to_string(),
            "0999999999999-worker-1.pod-a-0000000000000007.bxs"
        );
        assert_eq!(ObjectName::parse(&a.to_string()), Some(a.clone()));
        assert_eq!(ObjectName::parse(&b.to_string()), Some(b.clone()));
        assert!(a.to_string() < b.to_string());
    }

    #[test]
    fn foreign_names_are_not_ours() {
        for name in [
            "notes.txt",
            "1-x-o-1.bxs",
            "0999999999999-x-q-1.bxs",
            "0999999999999-x-o-zz.bxs",
            "0999999999999--o-1.bxs",
            "0999999999999-../x-o-1.bxs",
        ] {
            assert_eq!(ObjectName::parse(name), None, "{name}");
        }
        assert!(validate_node_name("a/b").is_err());
        assert!(validate_node_name(&"x".repeat(65)).is_err());
        assert!(validate_node_name("pod-7").is_ok());
    }
}
