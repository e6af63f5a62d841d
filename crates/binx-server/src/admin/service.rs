//! The admin gRPC service: routes each method path to a plain function of
//! the exchange, with tonic doing the gRPC framing. Written by hand instead
//! of generated, so no protoc is needed.

use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::server::{Grpc, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use super::messages::*;
use super::{DaemonControl, paths};
use crate::exchange::Exchange;
use binx_core::{TaskSnapshot, validate_task_id};

/// The admin service of one daemon. Clone is cheap (one `Arc`).
#[derive(Clone)]
pub struct AdminService {
    inner: Arc<Inner>,
}

struct Inner {
    exchange: Exchange,
    control: Arc<dyn DaemonControl>,
    /// When set, every call must carry `authorization: Bearer <token>`
    /// (the TCP admin port; the Unix socket relies on file permissions).
    token: Option<String>,
}

impl AdminService {
    pub fn new(exchange: Exchange, control: Arc<dyn DaemonControl>) -> Self {
        AdminService {
            inner: Arc::new(Inner {
                exchange,
                control,
                token: None,
            }),
        }
    }

    /// The same service, requiring a bearer token on every call.
    pub fn with_token(&self, token: Option<String>) -> Self {
        AdminService {
            inner: Arc::new(Inner {
                exchange: self.inner.exchange.clone(),
                control: self.inner.control.clone(),
                token,
            }),
        }
    }

    fn authorize<B>(&self, request: &http::Request<B>) -> Result<(), Status> {
        let Some(token) = &self.inner.token else {
            return Ok(());
        };
        let given = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(given)
                if crate::internal_auth::secret_matches(given.as_bytes(), token.as_bytes()) =>
            {
                Ok(())
            }
            Some(_) => Err(Status::unauthenticated("wrong admin token")),
            None => Err(Status::unauthenticated(
                "the admin port requires `authorization: Bearer <shared secret>`",
            )),
        }
    }

    fn list_tasks(&self, request: ListTasksRequest) -> Result<ListTasksReply, Status> {
        let tasks = self
            .inner
            .exchange
            .task_snapshots(&request.task_id_prefix)
            .into_iter()
            .map(task_info)
            .collect();
        Ok(ListTasksReply { tasks })
    }

    fn abort_task(&self, request: AbortTaskRequest) -> Result<AbortTaskReply, Status> {
        validate_task_id(&request.task_id).map_err(Status::invalid_argument)?;
        let reason = if request.reason.is_empty() {
            "aborted by an operator".to_string()
        } else {
            request.reason
        };
        match self
            .inner
            .exchange
            .abort_open_task(&request.task_id, &reason)
        {
            Some(freed_bytes) => Ok(AbortTaskReply { freed_bytes }),
            None => Err(Status::not_found(format!(
                "task {} is not open on this daemon",
                request.task_id
            ))),
        }
    }

    fn start_drain(&self, _: StartDrainRequest) -> Result<StartDrainReply, Status> {
        let already_draining = self.inner.exchange.is_draining();
        self.inner.control.start_drain();
        Ok(StartDrainReply {
            pages_held: self.inner.exchange.pages_held(),
            already_draining,
        })
    }

    fn set_log_level(&self, request: SetLogLevelRequest) -> Result<SetLogLevelReply, Status> {
        self.inner
            .control
            .set_log_level(&request.filter)
            .map(|previous| SetLogLevelReply { previous })
            .map_err(Status::invalid_argument)
    }

    fn get_stats(&self, _: GetStatsRequest) -> Result<GetStatsReply, Status> {
        let stats = self.inner.exchange.stats();
        let mut values = std::collections::BTreeMap::new();
        let json = serde_json::to_value(&stats)
            .map_err(|e| Status::internal(format!("cannot read the stats: {e}")))?;
        if let serde_json::Value::Object(fields) = json {
            for (key, value) in fields {
                if let Some(n) = value.as_u64() {
                    values.insert(key, n);
                } else if let serde_json::Value::Object(inner) = value {
                    // Nested groups (the spool's counters) as "spool_<name>".
                    for (name, value) in inner {
                        if let Some(n) = value.as_u64() {
                            values.insert(format!("{key}_{name}"), n);
                        }
                    }
                }
            }
        }
        Ok(GetStatsReply {
            values,
            requests: stats.manager.requests,
            draining: stats.manager.draining,
        })
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

/// One unary method as a tonic `UnaryService`.
struct Method<F>(F);

impl<Req, Res, F> UnaryService<Req> for Method<F>
where
    F: FnMut(Req) -> Result<Res, Status>,
{
    type Response = Res;
    type Future = Ready<Result<Response<Res>, Status>>;

    fn call(&mut self, request: Request<Req>) -> Self::Future {
        ready((self.0)(request.into_inner()).map(Response::new))
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, Infallible>> + Send>>;

/// Answers one unary call with `f`.
fn unary<B, Req, Res>(
    request: http::Request<B>,
    f: impl FnMut(Req) -> Result<Res, Status> + Send + 'static,
) -> BoxFuture<http::Response<Body>>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<BoxError> + Send,
    Req: prost::Message + Default + Send + 'static,
    Res: prost::Message + Send + 'static,
{
    Box::pin(async move {
        let mut grpc = Grpc::new(ProstCodec::<Res, Req>::default());
        Ok(grpc.unary(Method(f), request).await)
    })
}

impl<B> tower_service::Service<http::Request<B>> for AdminService
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if let Err(status) = self.authorize(&request) {
            return Box::pin(ready(Ok(status.into_http())));
        }
        let svc = self.clone();
        match request.uri().path() {
            paths::LIST_TASKS => unary(request, move |r| svc.list_tasks(r)),
            paths::ABORT_TASK => unary(request, move |r| svc.abort_task(r)),
            paths::START_DRAIN => unary(request, move |r| svc.start_drain(r)),
            paths::SET_LOG_LEVEL => unary(request, move |r| svc.set_log_level(r)),
            paths::GET_STATS => unary(request, move |r| svc.get_stats(r)),
            other => {
                let status = Status::unimplemented(format!("no admin method {other}"));
                Box::pin(ready(Ok(status.into_http())))
            }
        }
    }
}
