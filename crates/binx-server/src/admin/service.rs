//! The admin gRPC service: the trait binx-admin generates from
//! docs/admin.proto, answered from the exchange; a bearer token checked
//! before any method runs when the service listens on TCP.

use std::sync::Arc;

use binx_admin::admin_server::{Admin, AdminServer};
use binx_admin::*;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::DaemonControl;
use crate::exchange::Exchange;
use crate::metrics;
use binx_core::{TaskSnapshot, validate_task_id};

/// The admin service of one daemon, ready to serve. Clone is cheap.
#[derive(Clone)]
pub struct AdminService {
    handler: Arc<AdminHandler>,
    /// When set, every call must carry `authorization: Bearer <token>`
    /// (the TCP admin port; the Unix socket relies on file permissions).
    token: Option<Arc<str>>,
}

/// The generated server with the token check in front of it.
pub type AdminRoutes = InterceptedService<AdminServer<AdminHandler>, TokenCheck>;

impl AdminService {
    /// The admin service over `exchange`; `control` drains and stops the daemon.
    pub fn new(exchange: Exchange, control: Arc<dyn DaemonControl>) -> Self {
        AdminService {
            handler: Arc::new(AdminHandler { exchange, control }),
            token: None,
        }
    }

    /// The same service, requiring a bearer token on every call.
    pub fn with_token(&self, token: Option<String>) -> Self {
        AdminService {
            handler: self.handler.clone(),
            token: token.map(Arc::from),
        }
    }

    /// The tonic service to serve: method routing and message framing are
    /// generated; the token is checked before a request body is read.
    pub fn routes(&self) -> AdminRoutes {
        let server = AdminServer::from_arc(self.handler.clone())
            .max_decoding_message_size(MAX_ADMIN_MESSAGE)
            .max_encoding_message_size(MAX_ADMIN_REPLY);
        InterceptedService::new(server, TokenCheck(self.token.clone()))
    }
}

/// A request to the admin service is a task-id prefix, a reason or a log
/// filter: a few KiB at most.
const MAX_ADMIN_MESSAGE: usize = 64 * 1024;
/// ListTasks on a busy daemon can be large, but stays bounded.
const MAX_ADMIN_REPLY: usize = 64 * 1024 * 1024;

/// Tasks and buffers one ListTasks takes from the shards at most (each
/// counts one): the largest task (`max_buffers_per_task` at most 2^20)
/// and then some. Past it, or past `LISTED_BYTES` encoded, the reply says
/// `truncated`, and a narrower prefix lists the rest.
const LISTED_TASKS_AND_BUFFERS: usize = (1 << 20) + (1 << 18);

/// Encoded bytes of the tasks one ListTasks lists at most, within
/// `MAX_ADMIN_REPLY` (and what the admin client reads).
const LISTED_BYTES: usize = 48 << 20;

/// Checks `authorization: Bearer <token>` in constant time, when a token
/// is set.
#[derive(Clone)]
pub struct TokenCheck(Option<Arc<str>>);

impl Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        // On TCP, the connection learns whether it asked with the token:
        // it is kept only while it does (admin/port.rs).
        let peer = request
            .extensions()
            .get::<super::port::AdminPeer>()
            .cloned();
        let Some(token) = &self.0 else {
            if let Some(peer) = peer {
                peer.asked.asked();
            }
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let verdict = match given {
            Some(given)
                if crate::internal_auth::secret_matches(given.as_bytes(), token.as_bytes()) =>
            {
                Ok(request)
            }
            Some(_) => Err(Status::unauthenticated("wrong admin token")),
            None => Err(Status::unauthenticated(
                "the admin port requires `authorization: Bearer <shared secret>`",
            )),
        };
        if let Some(peer) = peer {
            match verdict {
                Ok(_) => peer.asked.asked(),
                Err(_) => {
                    tracing::debug!(peer = ?peer.tcp.remote_addr(), "admin request refused for its token; closing its connection");
                    peer.asked.refused();
                }
            }
        }
        verdict
    }
}

/// Answers each admin method from the exchange and the daemon's controls.
pub struct AdminHandler {
    exchange: Exchange,
    control: Arc<dyn DaemonControl>,
}

#[tonic::async_trait]
impl Admin for AdminHandler {
    async fn list_tasks(
        &self,
        request: Request<ListTasksRequest>,
    ) -> Result<Response<ListTasksReply>, Status> {
        self.list_tasks(request.into_inner()).map(Response::new)
    }

    async fn abort_task(
        &self,
        request: Request<AbortTaskRequest>,
    ) -> Result<Response<AbortTaskReply>, Status> {
        self.abort_task(request.into_inner()).map(Response::new)
    }

    async fn start_drain(
        &self,
        request: Request<StartDrainRequest>,
    ) -> Result<Response<StartDrainReply>, Status> {
        self.start_drain(request.into_inner()).map(Response::new)
    }

    async fn set_log_level(
        &self,
        request: Request<SetLogLevelRequest>,
    ) -> Result<Response<SetLogLevelReply>, Status> {
        self.set_log_level(request.into_inner()).map(Response::new)
    }

    async fn get_stats(
        &self,
        request: Request<GetStatsRequest>,
    ) -> Result<Response<GetStatsReply>, Status> {
        self.get_stats(request.into_inner()).map(Response::new)
    }
}

impl AdminHandler {
    fn list_tasks(&self, request: ListTasksRequest) -> Result<ListTasksReply, Status> {
        let (snapshots, mut truncated) = self
            .exchange
            .task_snapshots(&request.task_id_prefix, LISTED_TASKS_AND_BUFFERS);
        // Counted as encoded (ids of up to 256 bytes, large tokens), so the
        // reply always fits what is sent and read.
        let mut bytes = 0;
        let mut tasks = Vec::new();
        for snapshot in snapshots {
            let info = task_info(snapshot);
            let size = prost::Message::encoded_len(&info) + 16;
            if bytes + size > LISTED_BYTES {
                truncated = true;
                break;
            }
            bytes += size;
            tasks.push(info);
        }
        Ok(ListTasksReply { tasks, truncated })
    }

    fn abort_task(&self, request: AbortTaskRequest) -> Result<AbortTaskReply, Status> {
        validate_task_id(&request.task_id).map_err(Status::invalid_argument)?;
        let reason = if request.reason.is_empty() {
            "aborted by an operator".to_string()
        } else {
            request.reason
        };
        match self.exchange.abort_open_task(&request.task_id, &reason) {
            Some(freed_bytes) => Ok(AbortTaskReply { freed_bytes }),
            None => Err(Status::not_found(format!(
                "task {} is not open on this daemon",
                request.task_id
            ))),
        }
    }

    fn start_drain(&self, _: StartDrainRequest) -> Result<StartDrainReply, Status> {
        let already_draining = self.exchange.is_draining();
        self.control.start_drain();
        Ok(StartDrainReply {
            pages_held: self.exchange.pages_held(),
            already_draining,
        })
    }

    fn set_log_level(&self, request: SetLogLevelRequest) -> Result<SetLogLevelReply, Status> {
        self.control
            .set_log_level(&request.filter)
            .map(|previous| SetLogLevelReply { previous })
            .map_err(Status::invalid_argument)
    }

    fn get_stats(&self, _: GetStatsRequest) -> Result<GetStatsReply, Status> {
        let stats = self.exchange.stats();
        let mut reply = GetStatsReply {
            draining: stats.manager.draining,
            ..Default::default()
        };
        for stat in metrics::STATS {
            let Some(value) = (stat.read)(&stats) else {
                continue;
            };
            let key = stat.flat_key();
            if stat.unit != metrics::StatUnit::Count {
                reply
                    .units
                    .insert(key.clone(), stat.unit.as_str().to_string());
            }
            reply.values.insert(key, value);
        }
        reply.replies = stats
            .manager
            .requests
            .iter()
            .map(|c| ReplyCount {
                r#type: metrics::type_label(c.kind).to_string(),
                status: metrics::status_label(c.status).to_string(),
                count: c.count,
            })
            .collect();
        Ok(reply)
    }
}

fn task_info(task: TaskSnapshot) -> TaskInfo {
    TaskInfo {
        task_id: task.task_id,
        kind: task.kind.name().to_string(),
        spool_policy: task.spool_policy.to_string(),
        buffer_count: task.buffer_count.unwrap_or(0),
        input_finished: task.input_finished,
        memory_bytes: task.memory,
        idle_millis: task.idle.as_millis() as u64,
        buffers: task
            .buffers
            .into_iter()
            .map(|b| BufferInfo {
                buffer_id: b.buffer_id,
                state: b.state.as_str().to_string(),
                acknowledged_token: b.acknowledged_token,
                next_token: b.next_token,
                pages_held: b.pages_held,
                bytes_held: b.bytes_held,
                idle_millis: b.idle.as_millis() as u64,
            })
            .collect(),
    }
}
