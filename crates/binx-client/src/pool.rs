//! Connections shared by everything that talks to the same remote.
//!
//! DESIGN.md: one multiplexed connection per remote. On fast links one TCP
//! stream can be the limit, so that connection is a few sockets (its
//! stripes, [`ConnectionOptions::stripes`]); binxd's forwarder sets them
//! from `forward_connections_per_remote`.

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
    connection: Connection,
    used: Instant,
}

/// Hands out the multiplexed connection(s) of each endpoint; bounded in
/// endpoints, and forgets the ones left idle.
#[derive(Debug)]
pub struct ConnectionPool {
    options: ConnectionOptions,
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
    /// One connection per endpoint, made with `options`.
    pub fn new(options: ConnectionOptions) -> Self {
        ConnectionPool {
            options,
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

    /// The connection to `endpoint`, created (unopened) on first use.
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
            connection: Connection::new(endpoint.clone(), self.options.clone()),
            used: now,
        });
        entry.used = now;
        entry.connection.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_connection_per_endpoint_with_the_options_stripes() {
        let a: Endpoint = "127.0.0.1:1".parse().unwrap();
        let b: Endpoint = "127.0.0.1:2".parse().unwrap();
        let pool = ConnectionPool::new(ConnectionOptions {
            stripes: 3,
            ..ConnectionOptions::default()
        });
        assert!(pool.get(&a).same_as(&pool.get(&a)));
        assert!(!pool.get(&a).same_as(&pool.get(&b)));
        assert_eq!(pool.get(&a).stripes(), 3);
        let unix: Endpoint = "/tmp/binx.sock".parse().unwrap();
        assert_eq!(pool.get(&unix).stripes(), 1, "a Unix socket is one");
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
