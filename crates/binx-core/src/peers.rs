//! Which remotes a proxy consumer may forward to (docs/PROTOCOL.md section 4, "Local-only requests and `remote`"):
//! networks (CIDR) and host names, checked on the `remote` of a request
//! before any connection is made. A `remote` the list does not allow is
//! `BAD_REQUEST`, so a local client cannot make binxd connect (and send the
//! cluster's shared secret) to an address of its choosing.
//!
//! IP literals are matched against the networks; host names only against
//! the names (exact, or `*.suffix` for any name under a domain). A name is
//! never resolved to be checked against the networks: the operator who
//! lists a name trusts what DNS says of it, and nobody else's name gets in.

use std::fmt;
use std::net::IpAddr;

/// One network, `address/prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Network {
    address: IpAddr,
    prefix: u8,
}

impl Network {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.address, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

/// The remotes a proxy consumer may forward to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAllowList {
    networks: Vec<Network>,
    /// Lower-case names; a leading `*.` matches any name under the domain.
    names: Vec<String>,
    /// `*`: every remote (for tests and closed networks only).
    any: bool,
}

/// The default: this host only.
pub const LOOPBACK_PEERS: &str = "127.0.0.0/8,::1/128,localhost";

impl Default for PeerAllowList {
    fn default() -> Self {
        PeerAllowList::loopback()
    }
}

impl PeerAllowList {
    /// Loopback addresses and `localhost`.
    pub fn loopback() -> Self {
        LOOPBACK_PEERS
            .parse()
            .unwrap_or_else(|_| PeerAllowList::none())
    }

    /// No remote at all.
    pub fn none() -> Self {
        PeerAllowList {
            networks: Vec::new(),
            names: Vec::new(),
            any: false,
        }
    }

    /// Every remote.
    pub fn any() -> Self {
        PeerAllowList {
            any: true,
            ..PeerAllowList::none()
        }
    }

    /// Whether the (already validated) `host:port` may be forwarded to.
    pub fn allows(&self, remote: &str) -> bool {
        if self.any {
            return true;
        }
        let Some((host, _port)) = remote.rsplit_once(':') else {
            return false;
        };
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if let Ok(ip) = host.parse::<IpAddr>() {
            return self.networks.iter().any(|n| n.contains(ip));
        }
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.names.iter().any(|name| match name.strip_prefix("*.") {
            Some(domain) => host
                .strip_suffix(domain)
                .is_some_and(|sub| sub.len() > 1 && sub.ends_with('.')),
            None => *name == host,
        })
    }
}

impl std::str::FromStr for PeerAllowList {
    type Err = String;

    /// Comma-separated entries: `10.0.0.0/8`, `10.1.2.3` (a /32),
    /// `fd00::/8`, `binx.example.svc`, `*.pods.example`, or `*` alone for
    /// every remote. Empty allows none.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut list = PeerAllowList::none();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if entry == "*" {
                list.any = true;
                continue;
            }
            let (address, prefix) = match entry.split_once('/') {
                Some((a, p)) => (a, Some(p)),
                None => (entry, None),
            };
            let address = address
                .strip_prefix('[')
                .and_then(|a| a.strip_suffix(']'))
                .unwrap_or(address);
            if let Ok(ip) = address.parse::<IpAddr>() {
                let ip = ip.to_canonical();
                let max = if ip.is_ipv4() { 32 } else { 128 };
                let prefix = match prefix {
                    None => max,
                    Some(p) => p.parse::<u8>().ok().filter(|&p| p <= max).ok_or_else(|| {
                        format!("{entry:?}: the prefix length must be 0 to {max}")
                    })?,
                };
                list.networks.push(Network {
                    address: ip,
                    prefix,
                });
                continue;
            }
            if prefix.is_some() {
                return Err(format!(
                    "{entry:?} is not a network: write an address and a prefix length, e.g. 10.0.0.0/8"
                ));
            }
            let name = entry.trim_end_matches('.').to_ascii_lowercase();
            let bare = name.strip_prefix("*.").unwrap_or(&name);
            let valid = !bare.is_empty()
                && bare.len() <= 253
                && bare.split('.').all(|label| {
                    !label.is_empty()
                        && label.len() <= 63
                        && !label.starts_with('-')
                        && label
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                });
            if !valid {
                return Err(format!(
                    "{entry:?} is neither a network (10.0.0.0/8), an address, a host name nor *.domain"
                ));
            }
            list.names.push(name);
        }
        Ok(list)
    }
}

impl fmt::Display for PeerAllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if self.any {
            parts.push("*".into());
        }
        parts.extend(self.networks.iter().map(|n| n.to_string()));
        parts.extend(self.names.iter().cloned());
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_by_default() {
        let list = PeerAllowList::default();
        for ok in [
            "127.0.0.1:8091",
            "127.9.9.9:1",
            "[::1]:8091",
            "localhost:8091",
        ] {
            assert!(list.allows(ok), "{ok}");
        }
        for no in [
            "10.0.0.1:8091",
            "[::2]:8091",
            "example.com:80",
            "localhost.evil.com:1",
            "169.254.169.254:80",
        ] {
            assert!(!list.allows(no), "{no}");
        }
    }

    #[test]
    fn networks_names_and_domains() {
        let list: PeerAllowList = "10.244.0.0/16, fd00::/8, binx-0.binx.ns.svc, *.pods.example"
            .parse()
            .unwrap();
        assert!(list.allows("10.244.3.4:8091"));
        assert!(!list.allows("10.245.3.4:8091"));
        assert!(list.allows("[fd12::1]:8091"));
        assert!(list.allows("[::ffff:10.244.0.9]:8091"));
        assert!(list.allows("BINX-0.binx.ns.svc:8091"));
        assert!(list.allows("a.pods.example:8091"));
        assert!(list.allows("a.b.pods.example:8091"));
        assert!(!list.allows("pods.example:8091"));
        assert!(!list.allows("evilpods.example:8091"));
        assert!(!list.allows("binx-1.binx.ns.svc:8091"));
        assert_eq!(
            list.to_string(),
            "10.244.0.0/16,fd00::/8,binx-0.binx.ns.svc,*.pods.example"
        );
    }

    #[test]
    fn empty_allows_none_and_star_allows_all() {
        let none: PeerAllowList = "".parse().unwrap();
        assert!(!none.allows("127.0.0.1:1"));
        let all: PeerAllowList = "*".parse().unwrap();
        assert!(all.allows("203.0.113.9:1"));
        let zero: PeerAllowList = "0.0.0.0/0".parse().unwrap();
        assert!(zero.allows("203.0.113.9:1"));
        assert!(!zero.allows("[2001:db8::1]:1"));
    }

    #[test]
    fn bad_entries_are_named() {
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "a_b.example",
            "x/8",
            "-a.example",
            "*.",
        ] {
            let err = bad.parse::<PeerAllowList>().unwrap_err();
            assert!(err.contains(bad), "{err}");
        }
    }
}
