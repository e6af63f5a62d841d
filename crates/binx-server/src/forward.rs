//! Proxy consumer (docs/PROTOCOL.md section 4, "Local-only requests and `remote`"): a DATA, ACK or DELETE that a
//! local client sends over the Unix socket with `remote` set is forwarded to
//! that remote sidecar. The core decides what is forwarded and what the
//! client gets back (including failover to storage); the connections to
//! remotes belong to whoever implements [`Forwarder`] (binxd uses
//! binx-client's pool).

use std::future::Future;
use std::pin::Pin;

use binx_proto::{BinReply, BinRequest, Frame};

/// A remote's reply, and what the remote said it is in its HELLO reply
/// (`node=` and `instance=` capabilities), when known.
#[derive(Debug)]
pub struct ForwardReply {
    /// The reply frame as the remote sent it; `None` when the request was
    /// withheld: the remote answers as another process than the one it
    /// was meant for ([`Forwarder::forward`]'s `instance`).
    pub frame: Option<Frame<BinReply>>,
    /// The remote's node name from its HELLO reply.
    pub node: Option<String>,
    /// The remote process's instance id from its HELLO reply: a change at
    /// the same address is a restart, which lost every buffer it held.
    pub instance: Option<std::sync::Arc<str>>,
}

/// The result of forwarding one request: the remote's reply, or why none came.
pub type Forwarded = Pin<Box<dyn Future<Output = Result<ForwardReply, String>> + Send>>;

/// Sends requests to remote sidecars.
pub trait Forwarder: Send + Sync + std::fmt::Debug {
    /// Sends `request` (its `remote` already cleared) to the sidecar at
    /// `remote` (`host:port`) and returns its reply, whatever its status;
    /// with `instance`, only to that process of the remote: a connection
    /// whose HELLO named another withholds it (no frame, that instance).
    fn forward(
        &self,
        remote: String,
        request: BinRequest,
        instance: Option<std::sync::Arc<str>>,
    ) -> Forwarded;
}
