//! One connection per remote, shared by everything that talks to it.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::connection::{Connection, ConnectionOptions};
use crate::endpoint::Endpoint;

/// Hands out the single multiplexed connection of each endpoint.
#[derive(Debug, Default)]
pub struct ConnectionPool {
    options: ConnectionOptions,
    connections: Mutex<HashMap<Endpoint, Connection>>,
}

impl ConnectionPool {
    pub fn new(options: ConnectionOptions) -> Self {
        ConnectionPool {
            options,
            connections: Mutex::new(HashMap::new()),
        }
    }

    /// The connection to `endpoint`, created (unopened) on first use.
    pub fn get(&self, endpoint: &Endpoint) -> Connection {
        let mut map = self.connections.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(endpoint.clone())
            .or_insert_with(|| Connection::new(endpoint.clone(), self.options.clone()))
            .clone()
    }
}
