//! The 8-byte connection preface both sides send before any frame.

use thiserror::Error;

/// Bytes in a preface: `BINX`, major, minor, two reserved zero bytes.
pub const PREFACE_LEN: usize = 8;

const MAGIC: &[u8; 4] = b"BINX";

/// A protocol version announced at connection start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preface {
    /// Peers must share it.
    pub major: u8,
    /// Additions within a major version; either side may be newer.
    pub minor: u8,
}

/// Why a received preface was refused.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum PrefaceError {
    /// The first four bytes are not `BINX`: not a BinX peer.
    #[error("connection preface does not start with \"BINX\" (got {0:02x?}): not a BinX peer")]
    BadMagic([u8; 4]),
    /// The reserved bytes are not zero.
    #[error("connection preface has non-zero reserved bytes {0:02x?}")]
    BadReserved([u8; 2]),
    /// The peer speaks another major version.
    #[error("peer speaks BinX major version {theirs}, this side speaks {ours}")]
    MajorMismatch {
        /// This side's major version.
        ours: u8,
        /// The peer's.
        theirs: u8,
    },
}

impl Preface {
    /// The version this implementation speaks.
    pub const CURRENT: Preface = Preface { major: 1, minor: 2 };

    /// The preface as it goes on the wire.
    pub fn encode(self) -> [u8; PREFACE_LEN] {
        [
            MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], self.major, self.minor, 0, 0,
        ]
    }

    /// Parses a received preface; any version parses if the magic is right.
    pub fn decode(bytes: &[u8; PREFACE_LEN]) -> Result<Preface, PrefaceError> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if &magic != MAGIC {
            return Err(PrefaceError::BadMagic(magic));
        }
        if bytes[6] != 0 || bytes[7] != 0 {
            return Err(PrefaceError::BadReserved([bytes[6], bytes[7]]));
        }
        Ok(Preface {
            major: bytes[4],
            minor: bytes[5],
        })
    }

    /// Parses a received preface and checks that its major version is ours.
    pub fn decode_compatible(bytes: &[u8; PREFACE_LEN]) -> Result<Preface, PrefaceError> {
        let theirs = Preface::decode(bytes)?;
        if theirs.major != Preface::CURRENT.major {
            return Err(PrefaceError::MajorMismatch {
                ours: Preface::CURRENT.major,
                theirs: theirs.major,
            });
        }
        Ok(theirs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_preface_is_binx_1_1() {
        assert_eq!(&Preface::CURRENT.encode(), b"BINX\x01\x02\x00\x00");
        assert_eq!(
            Preface::decode_compatible(&Preface::CURRENT.encode()),
            Ok(Preface::CURRENT)
        );
    }

    #[test]
    fn wrong_magic_reserved_and_major_are_refused() {
        assert!(matches!(
            Preface::decode(b"GET / HT"),
            Err(PrefaceError::BadMagic(_))
        ));
        assert!(matches!(
            Preface::decode(b"BINX\x01\x00\x00\x01"),
            Err(PrefaceError::BadReserved(_))
        ));
        assert_eq!(
            Preface::decode_compatible(b"BINX\x02\x00\x00\x00"),
            Err(PrefaceError::MajorMismatch { ours: 1, theirs: 2 })
        );
        // Older and newer minor versions are compatible.
        assert!(Preface::decode_compatible(b"BINX\x01\x00\x00\x00").is_ok());
        assert!(Preface::decode_compatible(b"BINX\x01\x07\x00\x00").is_ok());
    }
}
