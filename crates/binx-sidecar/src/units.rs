//! Byte sizes (`64MiB`, `1GB`, `4096`) and durations (`250ms`, `10s`, `5m`,
//! `1h 30m`) as people write them in config files, flags and environment
//! variables, parsed by maintained crates (`bytesize`, `humantime`) and
//! printed exactly, so `binxd --print-config` reads back to the same values.
//!
//! Convention (binx's own settings, bytesize's): `KiB`, `MiB`, `GiB`, `TiB`
//! are powers of 1024 and `kB`, `MB`, `GB`, `TB` powers of 1000, as SI and
//! IEC say. The HTTP exchange's `X-*-Max-Size` headers are read by another
//! parser, `binx_server::http::presto::parse_data_size`, which follows airlift
//! instead (there `MB` is 1024 x 1024), because Presto and Trino write them so.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let parsed: bytesize::ByteSize = s.trim().parse().map_err(|_| {
            format!("{s:?} is not a size: write a number with an optional unit, e.g. 4096, 64KiB, 16MiB, 1GiB or 1GB")
        })?;
        if parsed.0 == u64::MAX {
            // bytesize saturates; a size this large is a typo.
            return Err(format!("{s:?} is too large a size"));
        }
        Ok(ByteSize(parsed.0))
    }
}

impl fmt::Display for ByteSize {
    /// The largest IEC unit that divides the size exactly, else bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, factor) in [
            ("TiB", 1u64 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ] {
            if self.0 >= factor && self.0.is_multiple_of(factor) {
                return write!(f, "{}{unit}", self.0 / factor);
            }
        }
        write!(f, "{}B", self.0)
    }
}

/// A duration written with units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl FromStr for HumanDuration {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        // Lower case, as binx always read units: `5M` is five minutes
        // (humantime alone would read months), `10S` ten seconds.
        humantime::parse_duration(&s.trim().to_ascii_lowercase())
            .map(HumanDuration)
            .map_err(|e| {
                format!("{s:?} is not a duration ({e}): write a number with a unit, e.g. 250ms, 10s, 5m or 1h")
            })
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

/// A setting written as text and held parsed (a spool policy, a codec...):
/// serde and clap read it through `T`'s `FromStr`, so a bad value stops
/// binxd where it is read (the file, the variable or the flag), naming the
/// key, and nothing parses it again later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Text<T>(pub T);

impl<T: FromStr<Err = String>> FromStr for Text<T> {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.trim().parse().map(Text)
    }
}

impl<T: fmt::Display> fmt::Display for Text<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: fmt::Display> Serialize for Text<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de, T: FromStr<Err = String>> Deserialize<'de> for Text<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

macro_rules! string_serde {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                #[derive(Deserialize)]
                #[serde(untagged)]
                enum Raw {
                    Text(String),
                    Number(u64),
                }
                match Raw::deserialize(d)? {
                    Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
                    Raw::Number(n) => n.to_string().parse().map_err(serde::de::Error::custom),
                }
            }
        }
    };
}

string_serde!(ByteSize);
string_serde!(HumanDuration);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!("4096".parse(), Ok(ByteSize(4096)));
        assert_eq!("64KiB".parse(), Ok(ByteSize(64 << 10)));
        assert_eq!("1 gib".parse(), Ok(ByteSize(1 << 30)));
        assert_eq!("2MB".parse(), Ok(ByteSize(2_000_000)));
        assert_eq!("12b".parse(), Ok(ByteSize(12)));
        assert!("lots".parse::<ByteSize>().unwrap_err().contains("64KiB"));
        assert!("99999999999TiB".parse::<ByteSize>().is_err());
        assert!("-1".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(65600 << 10).to_string(), "65600KiB");
        assert_eq!(ByteSize(1 << 30).to_string(), "1GiB");
        assert_eq!(ByteSize(1000).to_string(), "1000B");
    }

    #[test]
    fn durations_parse_and_print() {
        assert_eq!(
            "250ms".parse(),
            Ok(HumanDuration(Duration::from_millis(250)))
        );
        assert_eq!("10s".parse(), Ok(HumanDuration(Duration::from_secs(10))));
        assert_eq!("5m".parse(), Ok(HumanDuration(Duration::from_secs(300))));
        assert_eq!("5M".parse(), Ok(HumanDuration(Duration::from_secs(300))));
        assert_eq!(
            "250MS".parse(),
            Ok(HumanDuration(Duration::from_millis(250)))
        );
        assert_eq!("1h".parse(), Ok(HumanDuration(Duration::from_secs(3600))));
        assert!("10".parse::<HumanDuration>().is_err());
        assert!("ms".parse::<HumanDuration>().is_err());
        assert_eq!(
            "1h 30m".parse(),
            Ok(HumanDuration(Duration::from_secs(5400)))
        );
        assert_eq!(HumanDuration(Duration::from_secs(600)).to_string(), "10m");
        assert_eq!(HumanDuration(Duration::ZERO).to_string(), "0s");
        for d in [Duration::from_millis(1500), Duration::from_micros(50)] {
            let text = HumanDuration(d).to_string();
            assert_eq!(text.parse(), Ok(HumanDuration(d)), "{text}");
        }
    }
}
