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
    /// The socket could not be opened (nobody listens, no permission...).
    #[error("cannot connect to binx at {endpoint}: {source}")]
    Connect {
        /// The daemon dialled.
        endpoint: Endpoint,
        /// The system's error.
        source: io::Error,
    },
    /// Connecting took longer than `connect_timeout`.
    #[error("connecting to binx at {endpoint} took longer than {after:?}")]
    ConnectTimeout {
        /// The daemon dialled.
        endpoint: Endpoint,
        /// The connect timeout.
        after: Duration,
    },
    /// The daemon's preface was not one this client speaks.
    #[error("binx at {endpoint} refused the connection preface: {source}")]
    Preface {
        /// The daemon dialled.
        endpoint: Endpoint,
        /// What was wrong with the preface.
        source: PrefaceError,
    },
    /// The connection broke; requests in flight may or may not have been
    /// processed.
    #[error("connection to binx at {endpoint} was lost: {reason}")]
    ConnectionLost {
        /// The daemon of the connection.
        endpoint: Endpoint,
        /// Why it was lost.
        reason: String,
    },
    /// No reply within the request's wait plus `request_timeout`.
    #[error("{request} to binx at {endpoint} got no reply within {after:?}")]
    Timeout {
        /// The daemon asked.
        endpoint: Endpoint,
        /// The request, with its task, buffer and token.
        request: String,
        /// How long the client waited.
        after: Duration,
    },
    /// The daemon answered with an error status (or BUSY).
    #[error("{request} to binx at {endpoint} was refused with {}: {message}", status.name())]
    Refused {
        /// The daemon asked.
        endpoint: Endpoint,
        /// The request, with its task, buffer and token.
        request: String,
        /// The reply's status.
        status: Status,
        /// The reply's `error`.
        message: String,
    },
    /// The reply does not fit the request (wrong tokens, sizes or body).
    #[error("binx at {endpoint} broke the protocol on {request}: {detail}")]
    Protocol {
        /// The daemon asked.
        endpoint: Endpoint,
        /// The request, with its task, buffer and token.
        request: String,
        /// What did not fit.
        detail: String,
    },
    /// The request could not be encoded (it exceeds the frame limit).
    #[error("cannot send {request} to binx at {endpoint}: {source}")]
    Encode {
        /// The daemon it was for.
        endpoint: Endpoint,
        /// The request, with its task, buffer and token.
        request: String,
        /// Why it could not be encoded.
        source: FrameError,
    },
    /// A spooled segment could not be fetched, checked or decoded.
    #[error("{request}: spooled segment at {uri}: {detail}")]
    Spooled {
        /// The DATA request whose reply named the segment.
        request: String,
        /// Without its query (a presigned URL's signature is a credential).
        uri: String,
        /// What went wrong.
        detail: String,
    },
    /// A call cut into several requests failed after its first requests
    /// were stored: the caller must send the pages from `stored` on again,
    /// never all of them (that would duplicate the first `stored`).
    #[error(
        "{request}: the first {stored} of {total} pages were stored, then: {last} (never send the first {stored} again)"
    )]
    PartlyStored {
        /// The call, with its task and buffer.
        request: String,
        /// Pages stored for sure, from the first on.
        stored: usize,
        /// Pages of the call.
        total: usize,
        /// Why the rest failed (after a transport error, the pages of the
        /// request in flight may or may not have been stored as well).
        last: Box<ClientError>,
    },
    /// The daemon a buffer was being read from restarted after pages of it
    /// were read: the rest of the buffer went with the process (a producer
    /// that writes the task again on the new one writes another run, whose
    /// pages must not continue the first's).
    #[error(
        "{request}: binx at {endpoint} restarted (process instance {before}, now {now}) after the pages below token {token} were read from it: the rest of the buffer was lost with it"
    )]
    DaemonRestarted {
        /// The daemon read from.
        endpoint: Endpoint,
        /// The buffer read, with its task.
        request: String,
        /// The instance the pages came from.
        before: String,
        /// The instance that answers now.
        now: String,
        /// The next token the read expected.
        token: u64,
    },
    /// A source already failed; every later read gives this.
    #[error("the source of {request} already failed: {reason}")]
    SourceFailed {
        /// The buffer read, with its task.
        request: String,
        /// The first error, as it was reported.
        reason: String,
    },
    /// Retryable errors lasted the backoff's maximum error duration.
    #[error("gave up on {request} at {endpoint} after {after:?} of errors; last error: {last}")]
    GaveUp {
        /// The daemon asked.
        endpoint: Endpoint,
        /// The request, with its task, buffer and token.
        request: String,
        /// How long the errors lasted.
        after: Duration,
        /// The last of them.
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
