//! A client of the admin service, for the `binx` CLI and for tests.

use std::path::Path;
use std::time::Duration;

use http::uri::PathAndQuery;
use thiserror::Error;
use tonic::transport::{Channel, Endpoint};
use tonic_prost::ProstCodec;

use super::messages::*;
use super::paths;

/// An admin call that failed, naming the daemon it was sent to.
#[derive(Debug, Error)]
pub enum AdminError {
    #[error("bad admin address {target}: {reason}")]
    Address { target: String, reason: String },
    #[error("cannot reach the admin service at {target}: {source}")]
    Connect {
        target: String,
        source: tonic::transport::Error,
    },
    #[error("admin call {method} to {target} failed: {} ({:?})", status.message(), status.code())]
    Call {
        target: String,
        method: &'static str,
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

/// One connection to a daemon's admin service.
#[derive(Clone, Debug)]
pub struct AdminClient {
    grpc: tonic::client::Grpc<Channel>,
    target: String,
    token: Option<String>,
}

impl AdminClient {
    /// Connects to the admin Unix socket at `path`.
    pub async fn connect_unix(path: &Path) -> Result<Self, AdminError> {
        Self::connect(&format!("unix://{}", path.display()), None).await
    }

    /// Connects to `target`: `unix:///path/to/admin.sock` or `http://host:port`.
    /// `token` is sent as a bearer token (the TCP admin port's shared secret).
    pub async fn connect(target: &str, token: Option<String>) -> Result<Self, AdminError> {
        let endpoint = Endpoint::from_shared(target.to_string())
            .map_err(|e| AdminError::Address {
                target: target.to_string(),
                reason: e.to_string(),
            })?
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
            grpc: tonic::client::Grpc::new(channel),
            target: target.to_string(),
            token,
        })
    }

    async fn call<Req, Res>(
        &mut self,
        method: &'static str,
        path: &'static str,
        message: Req,
    ) -> Result<Res, AdminError>
    where
        Req: prost::Message + Send + Sync + 'static,
        Res: prost::Message + Default + Send + Sync + 'static,
    {
        let error = |target: &str, status| AdminError::Call {
            target: target.to_string(),
            method,
            status,
        };
        self.grpc
            .ready()
            .await
            .map_err(|e| error(&self.target, tonic::Status::unavailable(e.to_string())))?;
        let mut request = tonic::Request::new(message);
        if let Some(token) = &self.token {
            let value = format!("Bearer {token}").parse().map_err(|_| {
                error(
                    &self.target,
                    tonic::Status::invalid_argument("the admin token is not valid header text"),
                )
            })?;
            request.metadata_mut().insert("authorization", value);
        }
        self.grpc
            .unary(
                request,
                PathAndQuery::from_static(path),
                ProstCodec::<Req, Res>::default(),
            )
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| error(&self.target, status))
    }

    pub async fn list_tasks(&mut self, prefix: &str) -> Result<Vec<TaskInfo>, AdminError> {
        let request = ListTasksRequest {
            task_id_prefix: prefix.to_string(),
        };
        let reply: ListTasksReply = self.call("ListTasks", paths::LIST_TASKS, request).await?;
        Ok(reply.tasks)
    }

    pub async fn abort_task(&mut self, task_id: &str, reason: &str) -> Result<u64, AdminError> {
        let request = AbortTaskRequest {
            task_id: task_id.to_string(),
            reason: reason.to_string(),
        };
        let reply: AbortTaskReply = self.call("AbortTask", paths::ABORT_TASK, request).await?;
        Ok(reply.freed_bytes)
    }

    pub async fn start_drain(&mut self) -> Result<StartDrainReply, AdminError> {
        self.call("StartDrain", paths::START_DRAIN, StartDrainRequest {})
            .await
    }

    /// Sets the daemon's log filter; returns the previous one.
    pub async fn set_log_level(&mut self, filter: &str) -> Result<String, AdminError> {
        let request = SetLogLevelRequest {
            filter: filter.to_string(),
        };
        let reply: SetLogLevelReply = self
            .call("SetLogLevel", paths::SET_LOG_LEVEL, request)
            .await?;
        Ok(reply.previous)
    }

    pub async fn get_stats(&mut self) -> Result<GetStatsReply, AdminError> {
        self.call("GetStats", paths::GET_STATS, GetStatsRequest {})
            .await
    }
}
