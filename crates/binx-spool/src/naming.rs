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

/// A segment packed with others of its task into one object (a "pack"):
/// named `<pack object name>@<byte offset>`, the segment being the
/// `stored_size` bytes of the pack from that offset, in the unchanged
/// segment format. A task-wide commit's many small segments of a
/// `file://` store are written so, one file instead of one a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedName<'a> {
    /// The pack object's name (an [`ObjectName`]).
    pub pack: &'a str,
    /// Where the segment starts in it.
    pub offset: u64,
}

impl<'a> PackedName<'a> {
    /// The name of the segment at `offset` of `pack`.
    pub fn format(pack: &str, offset: u64) -> String {
        format!("{pack}@{offset}")
    }

    /// Reads a packed segment's name; any other name (one binx wrote
    /// unpacked, or a foreign one) is `None`. The pack must be a name binx
    /// writes and the offset decimal digits, so a name read from a marker
    /// can never reach another path or object.
    pub fn parse(name: &'a str) -> Option<PackedName<'a>> {
        let (pack, offset) = name.rsplit_once('@')?;
        if offset.is_empty() || offset.len() > 20 || !offset.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        ObjectName::parse(pack)?;
        Some(PackedName {
            pack,
            offset: offset.parse().ok()?,
        })
    }
}

/// The object a segment's bytes are in: its pack when it is packed, or
/// else the object of its name.
pub fn object_of(name: &str) -> &str {
    PackedName::parse(name).map_or(name, |p| p.pack)
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
    fn packed_names_round_trip_and_name_only_their_pack() {
        let pack = "0999999999999-worker-1.pod-o-0000000000000007.bxs";
        let name = PackedName::format(pack, 4096);
        assert_eq!(name, format!("{pack}@4096"));
        assert_eq!(
            PackedName::parse(&name),
            Some(PackedName { pack, offset: 4096 })
        );
        assert_eq!(object_of(&name), pack);
        assert_eq!(object_of(pack), pack);
        assert_eq!(PackedName::parse(pack), None);
        for foreign in [
            format!("{pack}@"),
            format!("{pack}@-1"),
            format!("{pack}@+1"),
            format!("{pack}@1x"),
            format!("{pack}@99999999999999999999"),
            format!("{pack}@123456789012345678901"),
            "../x@1".to_string(),
            "commit/t/task.json@0".to_string(),
            format!("a/{pack}@0"),
        ] {
            assert_eq!(PackedName::parse(&foreign), None, "{foreign}");
            assert_eq!(object_of(&foreign), foreign, "{foreign}");
        }
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
