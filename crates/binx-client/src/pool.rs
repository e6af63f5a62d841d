//! Connections shared by everything that talks to the same remote.
//!
//! DESIGN.md: one multiplexed connection per remote. On fast links one TCP
//! stream can be the limit (on a 2-core loopback one stream moved 1 MiB
//! chunks at about 0.7x of 8 plain sockets, two streams at 0.8-1.2x; see
//! BENCHMARKS.md), so a pool may hold a few per remote and hand them out in
//! turn, request by request. A client's own pool defaults to one; binxd's
//! forwarder holds `forward_connections_per_remote` (2 by default). Spreading
//! requests is safe because a consumer sends its next request only after the
//! reply to the last, and producers never go through a pool.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::connection::{Connection, ConnectionOptions};
use crate::endpoint::Endpoint;

/// Endpoints a pool keeps connections to at most, by default: past it the
/// least recently used is forgotten (its connections close once their
/// last request is answered).
pub const DEFAULT_MAX_ENDPOINTS: usize = 1024;

/// An endpoint unused this long is forgotten.
pub const DEFAULT_ENDPOINT_IDLE: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct Entry {
    connections: Vec<Connection>,
    next: usize,
    used: Instant,
}

/// Hands out the multiplexed connection(s) of each endpoint; bounded in
/// endpoints, and forgets the ones left idle.
#[derive(Debug)]
pub struct ConnectionPool {
    options: ConnectionOptions,
    per_endpoint: usize,
    max_endpoints: usize,
    idle: Duration,
    connections: Mutex<HashMap<Endpoint, Entry>>,
}

impl Default for ConnectionPool {
    fn default() -> Self {
        ConnectionPool::new(ConnectionOptions::default())
    }
}

impl ConnectionPool {
    /// One connection per endpoint.
    pub fn new(options: ConnectionOptions) -> Self {
        ConnectionPool::with_connections_per_endpoint(options, 1)
    }

    /// `per_endpoint` connections per endpoint (at least one), used in turn.
    pub fn with_connections_per_endpoint(options: ConnectionOptions, per_endpoint: usize) -> Self {
        ConnectionPool {
            options,
            per_endpoint: per_endpoint.max(1),
            max_endpoints: DEFAULT_MAX_ENDPOINTS,
            idle: DEFAULT_ENDPOINT_IDLE,
            connections: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps at most `max_endpoints` endpoints, and forgets one unused for
    /// `idle`.
    pub fn with_limits(mut self, max_endpoints: usize, idle: Duration) -> Self {
        self.max_endpoints = max_endpoints.max(1);
        self.idle = idle;
        self
    }

    /// Endpoints held now.
    pub fn endpoints(&self) -> usize {
        self.connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// A connection to `endpoint`, created (unopened) on first use; with
    /// several per endpoint, the next one in turn.
    pub fn get(&self, endpoint: &Endpoint) -> Connection {
        let now = Instant::now();
        let mut map = self.connections.lock().unwrap_or_else(|p| p.into_inner());
        if !map.contains_key(endpoint) {
            let idle = self.idle;
            map.retain(|_, e| now.saturating_duration_since(e.used) < idle);
            if map.len() >= self.max_endpoints
                && let Some(oldest) = map
                    .iter()
                    .min_by_key(|(_, e)| e.used)
                    .map(|(k, _)| k.clone())
            {
                map.remove(&oldest);
            }
        }
        let entry = map.entry(endpoint.clone()).or_insert_with(|| Entry {
            connections: (0..self.per_endpoint)
                .map(|_| Connection::new(endpoint.clone(), self.options.clone()))
                .collect(),
            next: 0,
            used: now,
        });
        entry.used = now;
        let connection = entry.connections[entry.next % entry.connections.len()].clone();
        entry.next = entry.next.wrapping_add(1);
        connection
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_connection_per_endpoint_by_default_and_turns_with_several() {
        let a: Endpoint = "127.0.0.1:1".parse().unwrap();
        let b: Endpoint = "127.0.0.1:2".parse().unwrap();
        let pool = ConnectionPool::default();
        assert!(pool.get(&a).same_as(&pool.get(&a)));
        assert!(!pool.get(&a).same_as(&pool.get(&b)));
        let pool = ConnectionPool::with_connections_per_endpoint(ConnectionOptions::default(), 2);
        let (first, second, third) = (pool.get(&a), pool.get(&a), pool.get(&a));
        assert!(!first.same_as(&second));
        assert!(first.same_as(&third));
    }

    #[test]
    fn endpoints_are_bounded_and_forgotten_when_idle() {
        let pool = ConnectionPool::default().with_limits(2, Duration::from_secs(3600));
        let ep = |port: u16| -> Endpoint { format!("127.0.0.1:{port}").parse().unwrap() };
        let first = pool.get(&ep(1));
        pool.get(&ep(2));
        pool.get(&ep(1));
        pool.get(&ep(3));
        assert_eq!(pool.endpoints(), 2);
        // 2 was the least recently used: 1 is kept.
        assert!(pool.get(&ep(1)).same_as(&first));
        let pool = ConnectionPool::default().with_limits(10, Duration::ZERO);
        pool.get(&ep(1));
        pool.get(&ep(2));
        assert_eq!(pool.endpoints(), 1);
    }
}
