//! Connections shared by everything that talks to the same remote.
//!
//! DESIGN.md: one multiplexed connection per remote. On fast links one TCP
//! stream can be the limit (on a 2-core loopback one stream moved 1 MiB
//! chunks at about 0.7x of 8 plain sockets, two streams at 0.8-1.2x; see
//! BENCHMARKS.md), so a pool may hold a few per remote and hand them out in
//! turn. The default stays one.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::connection::{Connection, ConnectionOptions};
use crate::endpoint::Endpoint;

/// Hands out the multiplexed connection(s) of each endpoint.
#[derive(Debug)]
pub struct ConnectionPool {
    options: ConnectionOptions,
    per_endpoint: usize,
    connections: Mutex<HashMap<Endpoint, (Vec<Connection>, usize)>>,
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
            connections: Mutex::new(HashMap::new()),
        }
    }

    /// A connection to `endpoint`, created (unopened) on first use; with
    /// several per endpoint, the next one in turn.
    pub fn get(&self, endpoint: &Endpoint) -> Connection {
        let mut map = self.connections.lock().unwrap_or_else(|p| p.into_inner());
        let (connections, next) = map.entry(endpoint.clone()).or_insert_with(|| {
            let all = (0..self.per_endpoint)
                .map(|_| Connection::new(endpoint.clone(), self.options.clone()))
                .collect();
            (all, 0)
        });
        let connection = connections[*next % connections.len()].clone();
        *next = next.wrapping_add(1);
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
}
