//! Where a binx daemon listens: `host:port` over TCP or a Unix socket path.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Where binxd puts its socket (and the CLI looks for it) when none is configured: `$TMPDIR/binx/binx.sock`.
pub fn default_uds_path() -> PathBuf {
    std::env::temp_dir().join("binx").join("binx.sock")
}

/// The admin socket beside a data socket: `dir/binx.sock` -> `dir/binx-admin.sock`.
pub fn admin_uds_beside(uds_path: &Path) -> PathBuf {
    let stem = uds_path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "binx".into());
    uds_path.with_file_name(format!("{stem}-admin.sock"))
}

/// A BinX listener address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    /// `host:port`.
    Tcp(String),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = String;

    /// Accepts `unix:///path`, `unix:/path`, `/path`, `tcp://host:port` and `host:port`.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s
            .strip_prefix("unix://")
            .or_else(|| s.strip_prefix("unix:"))
        {
            if path.is_empty() {
                return Err(format!("{s:?} names no socket path"));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if s.starts_with('/') || s.starts_with('.') {
            return Ok(Endpoint::Unix(PathBuf::from(s)));
        }
        let addr = s.strip_prefix("tcp://").unwrap_or(s);
        match addr.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(Endpoint::Tcp(addr.to_string()))
            }
            _ => Err(format!(
                "{s:?} is not an endpoint: expected host:port (e.g. 127.0.0.1:8091) or a Unix socket path (unix:///var/run/binx/binx.sock)"
            )),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(addr) => f.write_str(addr),
            Endpoint::Unix(path) => write!(f, "unix://{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_and_unix_forms() {
        assert_eq!(
            "127.0.0.1:8091".parse(),
            Ok(Endpoint::Tcp("127.0.0.1:8091".into()))
        );
        assert_eq!("tcp://h:1".parse(), Ok(Endpoint::Tcp("h:1".into())));
        assert_eq!("[::1]:80".parse(), Ok(Endpoint::Tcp("[::1]:80".into())));
        assert_eq!(
            "unix:///a/b.sock".parse(),
            Ok(Endpoint::Unix("/a/b.sock".into()))
        );
        assert_eq!("/a/b.sock".parse(), Ok(Endpoint::Unix("/a/b.sock".into())));
        assert!(
            "localhost"
                .parse::<Endpoint>()
                .unwrap_err()
                .contains("host:port")
        );
        assert!("h:99999".parse::<Endpoint>().is_err());
        assert!("unix://".parse::<Endpoint>().is_err());
    }
}
