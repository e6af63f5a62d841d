//! binxd's proxy consumer: forwards requests that name a `remote` over
//! binx-client's pool (one multiplexed connection per remote, over
//! `forward_connections_per_remote` sockets).

use binx_client::{Called, ConnectionOptions, ConnectionPool, Endpoint};
use binx_proto::BinRequest;
use binx_server::{ForwardReply, Forwarded, Forwarder};

/// Forwards over pooled client connections.
#[derive(Debug)]
pub struct PoolForwarder {
    pool: ConnectionPool,
}

impl PoolForwarder {
    /// `per_remote` sockets (stripes) to each remote; HELLO with `auth_token` when
    /// the remotes require the cluster's shared secret; TLS with `tls` when
    /// the remotes listen with it.
    pub fn new(
        per_remote: usize,
        max_remotes: usize,
        auth_token: Option<String>,
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    ) -> Self {
        let options = ConnectionOptions {
            auth_token,
            // The HELLO reply names the remote's node, which failover checks
            // commit markers against.
            hello: true,
            tls,
            client_name: format!("binxd-forwarder/{}", env!("CARGO_PKG_VERSION")),
            stripes: per_remote,
            ..ConnectionOptions::default()
        };
        PoolForwarder {
            pool: ConnectionPool::new(options)
                .with_limits(max_remotes, binx_client::pool::DEFAULT_ENDPOINT_IDLE),
        }
    }
}

impl Forwarder for PoolForwarder {
    fn forward(
        &self,
        remote: String,
        request: BinRequest,
        instance: Option<std::sync::Arc<str>>,
    ) -> Forwarded {
        let endpoint = match remote.parse::<Endpoint>() {
            Ok(endpoint @ Endpoint::Tcp(_)) => endpoint,
            Ok(Endpoint::Unix(_)) | Err(_) => {
                return Box::pin(async move { Err(format!("remote {remote:?} is not host:port")) });
            }
        };
        let connection = self.pool.get(&endpoint);
        Box::pin(async move {
            let called = connection
                .call_if_instance(request, Vec::new(), instance.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            let node = connection.server_identity().node;
            // The instance of the socket the request went over (or was
            // withheld on), not the stripe that said HELLO last.
            Ok(match called {
                Called::Replied { frame, instance } => ForwardReply {
                    frame: Some(*frame),
                    node,
                    instance,
                },
                Called::Withheld { instance } => ForwardReply {
                    frame: None,
                    node,
                    instance: Some(instance),
                },
            })
        })
    }
}
