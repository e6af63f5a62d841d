//! A client of the admin service, for the `binx` CLI and for tests: the
//! generated client over one channel, with the daemon's address in every
//! error and the bearer token on every call.

use std::path::Path;
use std::time::Duration;

use thiserror::Error;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::admin_client::AdminClient as GeneratedClient;
use crate::*;

/// An admin call that failed, naming the daemon it was sent to.
#[derive(Debug, Error)]
pub enum AdminError {
    /// The address or the token could not be made into a request.
    #[error("bad admin address {target}: {reason}")]
    Address {
        /// The admin address as given (`unix://…` or `http://host:port`).
        target: String,
        /// Why it was refused.
        reason: String,
    },
    /// No connection could be made to the admin service.
    #[error("cannot reach the admin service at {target}: {source}")]
    Connect {
        /// The admin address dialled.
        target: String,
        /// The transport's error.
        source: tonic::transport::Error,
    },
    /// The daemon answered a call with an error status.
    #[error("admin call {method} to {target} failed: {} ({:?})", status.message(), status.code())]
    Call {
        /// The admin address the call went to.
        target: String,
        /// The gRPC method called, e.g. `"ListTasks"`.
        method: &'static str,
        /// The status the daemon answered.
        status: tonic::Status,
    },
}

impl AdminError {
    /// The gRPC status of a call that reached the daemon.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            AdminError::Call { status, .. } => Some(status),
            _ => None,
        }
    }
}

/// Adds `authorization: Bearer <token>` to every call (the TCP admin
/// port's shared secret); nothing when there is no token.
#[derive(Clone, Debug)]
struct BearerToken(Option<AsciiMetadataValue>);

impl Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// One connection to a daemon's admin service.
#[derive(Clone, Debug)]
pub struct AdminClient {
    grpc: GeneratedClient<InterceptedService<Channel, BearerToken>>,
    target: String,
}

impl AdminClient {
    /// Connects to the admin Unix socket at `path`.
    pub async fn connect_unix(path: &Path) -> Result<Self, AdminError> {
        Self::connect(&format!("unix://{}", path.display()), None).await
    }

    /// Connects to `target`: `unix:///path/to/admin.sock` or `http://host:port`.
    /// `token` is sent as a bearer token (the TCP admin port's shared secret).
    pub async fn connect(target: &str, token: Option<String>) -> Result<Self, AdminError> {
        let address_error = |reason: String| AdminError::Address {
            target: target.to_string(),
            reason,
        };
        let token = token
            .map(|t| {
                format!("Bearer {t}")
                    .parse::<AsciiMetadataValue>()
                    .map_err(|_| address_error("the admin token is not valid header text".into()))
            })
            .transpose()?;
        let endpoint = Endpoint::from_shared(target.to_string())
            .map_err(|e| address_error(e.to_string()))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(30));
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| AdminError::Connect {
                target: target.to_string(),
                source,
            })?;
        Ok(AdminClient {
            // ListTasks of a busy daemon may be large: the server allows
            // replies up to 64 MiB, so the client reads that much.
            grpc: GeneratedClient::with_interceptor(channel, BearerToken(token))
                .max_decoding_message_size(64 << 20),
            target: target.to_string(),
        })
    }

    fn failed(&self, method: &'static str) -> impl FnOnce(tonic::Status) -> AdminError + '_ {
        move |status| AdminError::Call {
            target: self.target.clone(),
            method,
            status,
        }
    }

    /// Every open task whose id starts with `prefix` ("" for all), as far
    /// as one reply lists them ([`AdminClient::list_tasks_reply`] says
    /// whether more matched).
    pub async fn list_tasks(&mut self, prefix: &str) -> Result<Vec<TaskInfo>, AdminError> {
        Ok(self.list_tasks_reply(prefix).await?.tasks)
    }

    /// The open tasks whose id starts with `prefix` that one reply lists
    /// (about 1.3 million tasks and buffers), and whether more matched.
    pub async fn list_tasks_reply(&mut self, prefix: &str) -> Result<ListTasksReply, AdminError> {
        let request = ListTasksRequest {
            task_id_prefix: prefix.to_string(),
        };
        match self.grpc.list_tasks(request).await {
            Ok(reply) => Ok(reply.into_inner()),
            Err(status) => Err(self.failed("ListTasks")(status)),
        }
    }

    /// Aborts an open task as its producer would; returns the bytes freed.
    pub async fn abort_task(&mut self, task_id: &str, reason: &str) -> Result<u64, AdminError> {
        let request = AbortTaskRequest {
            task_id: task_id.to_string(),
            reason: reason.to_string(),
        };
        match self.grpc.abort_task(request).await {
            Ok(reply) => Ok(reply.into_inner().freed_bytes),
            Err(status) => Err(self.failed("AbortTask")(status)),
        }
    }

    /// Starts the drain SIGTERM starts.
    pub async fn start_drain(&mut self) -> Result<StartDrainReply, AdminError> {
        match self.grpc.start_drain(StartDrainRequest {}).await {
            Ok(reply) => Ok(reply.into_inner()),
            Err(status) => Err(self.failed("StartDrain")(status)),
        }
    }

    /// Sets the daemon's log filter; returns the previous one.
    pub async fn set_log_level(&mut self, filter: &str) -> Result<String, AdminError> {
        let request = SetLogLevelRequest {
            filter: filter.to_string(),
        };
        match self.grpc.set_log_level(request).await {
            Ok(reply) => Ok(reply.into_inner().previous),
            Err(status) => Err(self.failed("SetLogLevel")(status)),
        }
    }

    /// The daemon's metrics, as `/v1/stats` shows them.
    pub async fn get_stats(&mut self) -> Result<GetStatsReply, AdminError> {
        match self.grpc.get_stats(GetStatsRequest {}).await {
            Ok(reply) => Ok(reply.into_inner()),
            Err(status) => Err(self.failed("GetStats")(status)),
        }
    }
}
