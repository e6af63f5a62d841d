//! Client errors. Each names the endpoint and, where one is concerned, the
//! task, buffer and token.

use std::io;
use std::time::Duration;

use binx_proto::{FrameError, PrefaceError, Status};
use thiserror::Error;

use crate::endpoint::Endpoint;

/// What went wrong talking to a binx daemon.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot connect to binx at {endpoint}: {source}")]
    Connect {
        endpoint: Endpoint,
        source: io::Error,
    },
    #[error("connecting to binx at {endpoint} took longer than {after:?}")]
    ConnectTimeout { endpoint: Endpoint, after: Duration },
    #[error("binx at {endpoint} refused the connection preface: {source}")]
    Preface {
        endpoint: Endpoint,
        source: PrefaceError,
    },
    #[error("connection to binx at {endpoint} was lost: {reason}")]
    ConnectionLost { endpoint: Endpoint, reason: String },
    #[error("{request} to binx at {endpoint} got no reply within {after:?}")]
    Timeout {
        endpoint: Endpoint,
        request: String,
        after: Duration,
    },
    #[error("{request} to binx at {endpoint} was refused with {}: {message}", status.name())]
    Refused {
        endpoint: Endpoint,
        request: String,
        status: Status,
        message: String,
    },
    #[error("binx at {endpoint} broke the protocol on {request}: {detail}")]
    Protocol {
        endpoint: Endpoint,
        request: String,
        detail: String,
    },
    #[error("cannot send {request} to binx at {endpoint}: {source}")]
    Encode {
        endpoint: Endpoint,
        request: String,
        source: FrameError,
    },
    #[error("{request}: spooled segment at {uri}: {detail}")]
    Spooled {
        request: String,
        /// Without its query (a presigned URL's signature is a credential).
        uri: String,
        detail: String,
    },
    #[error("gave up on {request} at {endpoint} after {after:?} of errors; last error: {last}")]
    GaveUp {
        endpoint: Endpoint,
        request: String,
        after: Duration,
        last: Box<ClientError>,
    },
}

impl ClientError {
    /// Whether retrying the same request may succeed: transport trouble,
    /// BUSY, and TIMEOUT (a forwarding sidecar got no reply from the remote),
    /// not refusals.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Connect { .. }
            | ClientError::ConnectTimeout { .. }
            | ClientError::ConnectionLost { .. }
            | ClientError::Timeout { .. } => true,
            ClientError::Refused { status, .. } => matches!(status, Status::Busy | Status::Timeout),
            _ => false,
        }
    }

    /// The status the server replied with, when it refused.
    pub fn status(&self) -> Option<Status> {
        match self {
            ClientError::Refused { status, .. } => Some(*status),
            ClientError::GaveUp { last, .. } => last.status(),
            _ => None,
        }
    }
}
