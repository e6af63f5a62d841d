//! Proxy consumer (PROTOCOL.md section 8): a DATA, ACK or DELETE that a
//! local client sends over the Unix socket with `remote` set is forwarded to
//! that remote sidecar, and the reply is passed back. This crate only
//! decides what may be forwarded and shapes the replies; the connections to
//! remotes belong to whoever implements [`Forwarder`] (binxd uses
//! binx-client's pool: one multiplexed connection per remote).

use std::future::Future;
use std::pin::Pin;

use binx_proto::{BinReply, BinRequest, Frame, MessageType, Status};

use crate::exchange::Exchange;
use crate::manager::Reply;

/// The result of forwarding one request: the remote's reply, or why none came.
pub type Forwarded = Pin<Box<dyn Future<Output = Result<Frame<BinReply>, String>> + Send>>;

/// Sends requests to remote sidecars.
pub trait Forwarder: Send + Sync + std::fmt::Debug {
    /// Sends `request` (its `remote` already cleared) to the sidecar at
    /// `remote` (`host:port`) and returns its reply, whatever its status.
    fn forward(&self, remote: String, request: BinRequest) -> Forwarded;
}

/// The refusal of a request that may not be forwarded, if it may not.
pub(crate) fn refusal(request: &BinRequest) -> Option<Reply> {
    match request.message_type() {
        Ok(MessageType::Data | MessageType::Ack | MessageType::Delete) => None,
        _ => Some(Reply::new(BinReply::error(
            request,
            Status::BadRequest,
            format!(
                "only DATA, ACK and DELETE may name a remote; this request (type {}) names {:?}",
                request.r#type, request.remote
            ),
        ))),
    }
}

/// Forwards `request` and shapes the reply for the local client: its own
/// request id, the remote's status and pages (not copied). When the remote
/// cannot be reached the reply is TIMEOUT, which clients retry like a lost
/// reply (DATA is exact per token). When the remote has not served a
/// buffer for the spool's `failover_after` (no answer, or NO_DATA) and the
/// buffer was committed to storage, the replies come from storage instead
/// ([`Exchange::failover`]).
pub(crate) async fn forward(
    forwarder: &dyn Forwarder,
    mut request: BinRequest,
    exchange: &Exchange,
) -> Reply {
    let remote = std::mem::take(&mut request.remote);
    let local_id = request.request_id;
    let original = request.clone();
    let with_local_id = |mut reply: Reply| {
        reply.header.request_id = local_id;
        reply
    };
    if let Some(reply) = exchange.lost_reply(&original, &remote).await {
        return with_local_id(reply);
    }
    match forwarder.forward(remote.clone(), request).await {
        Ok(frame) => {
            let no_data = frame.header.status == Status::NoData as i32
                && original.message_type() == Ok(MessageType::Data);
            if !no_data {
                exchange.remote_answered(&remote, &original);
            } else if let Some(reply) = exchange.failover(&original, &remote).await {
                return with_local_id(reply);
            }
            let mut header = frame.header;
            header.request_id = local_id;
            Reply {
                header,
                body: if frame.body.is_empty() {
                    Vec::new()
                } else {
                    vec![frame.body]
                },
            }
        }
        Err(reason) => {
            if let Some(reply) = exchange.failover(&original, &remote).await {
                return with_local_id(reply);
            }
            Reply::new(BinReply::error(
                &original,
                Status::Timeout,
                format!(
                    "no reply from remote {remote} for buffer {} of task {}: {reason}; retry",
                    original.buffer_id, original.task_id
                ),
            ))
        }
    }
}
