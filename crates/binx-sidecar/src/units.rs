//! Byte sizes (`64MiB`, `1GB`, `4096`) and durations (`250ms`, `10s`, `5m`)
//! as people write them in config files, flags and environment variables.
//!
//! Convention (binx's own settings): `KiB`, `MiB`, `GiB`, `TiB` are powers
//! of 1024 and `kB`, `MB`, `GB`, `TB` powers of 1000, as SI and IEC say.
//! The HTTP exchange's `X-*-Max-Size` headers are read by another parser,
//! `binx_server::presto::parse_data_size`, which follows airlift instead
//! (there `MB` is 1024 x 1024), because Presto and Trino write them so.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

const SIZE_UNITS: &[(&str, u64)] = &[
    ("tib", 1 << 40),
    ("gib", 1 << 30),
    ("mib", 1 << 20),
    ("kib", 1 << 10),
    ("tb", 1_000_000_000_000),
    ("gb", 1_000_000_000),
    ("mb", 1_000_000),
    ("kb", 1_000),
    ("b", 1),
];

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let text = s.trim();
        let lower = text.to_ascii_lowercase();
        let (number, unit) = match SIZE_UNITS.iter().find(|(u, _)| lower.ends_with(u)) {
            Some((u, factor)) => (&lower[..lower.len() - u.len()], *factor),
            None => (lower.as_str(), 1),
        };
        let value: u64 = number.trim().parse().map_err(|_| {
            format!("{s:?} is not a size: write a whole number with an optional unit, e.g. 4096, 64KiB, 16MiB, 1GiB or 1GB")
        })?;
        value
            .checked_mul(unit)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} is too large a size"))
    }
}

impl fmt::Display for ByteSize {
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

/// A human-readable rendering with one decimal, for progress output.
pub fn human_bytes(bytes: u64) -> String {
    let units = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, factor) in units {
        if bytes >= factor {
            return format!("{:.1} {unit}", bytes as f64 / factor as f64);
        }
    }
    format!("{bytes} B")
}

/// A span of time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

const DURATION_UNITS: &[(&str, u64)] = &[
    ("us", 1),
    ("ms", 1_000),
    ("s", 1_000_000),
    ("m", 60_000_000),
    ("h", 3_600_000_000),
];

impl FromStr for HumanDuration {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let text = s.trim().to_ascii_lowercase();
        let unit = ["us", "ms", "s", "m", "h"].into_iter().find(|u| {
            text.ends_with(u)
                && text[..text.len() - u.len()]
                    .chars()
                    .all(|c| c.is_ascii_digit())
                && text.len() > u.len()
        });
        let Some(unit) = unit else {
            return Err(format!(
                "{s:?} is not a duration: write a whole number with a unit, e.g. 250ms, 10s, 5m or 1h"
            ));
        };
        let factor = DURATION_UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .map_or(1, |(_, f)| *f);
        let value: u64 = text[..text.len() - unit.len()]
            .parse()
            .map_err(|_| format!("{s:?} is not a duration"))?;
        value
            .checked_mul(factor)
            .map(|micros| HumanDuration(Duration::from_micros(micros)))
            .ok_or_else(|| format!("{s:?} is too long a duration"))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let micros = self.0.as_micros();
        for (unit, factor) in DURATION_UNITS.iter().rev() {
            let factor = u128::from(*factor);
            if micros >= factor && micros.is_multiple_of(factor) {
                return write!(f, "{}{unit}", micros / factor);
            }
        }
        write!(f, "{micros}us")
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
        assert_eq!("1h".parse(), Ok(HumanDuration(Duration::from_secs(3600))));
        assert!("10".parse::<HumanDuration>().is_err());
        assert!("ms".parse::<HumanDuration>().is_err());
        assert!("1.5s".parse::<HumanDuration>().is_err());
        assert_eq!(HumanDuration(Duration::from_secs(600)).to_string(), "10m");
        assert_eq!(
            HumanDuration(Duration::from_millis(1500)).to_string(),
            "1500ms"
        );
    }
}
