//! binxd's HTTP endpoint: the Presto-compatible exchange under `/v1/task/`
//! (binx_server::presto), `/healthz`, `/readyz` (false while stopping),
//! `/metrics` (Prometheus text) and `/v1/stats` (JSON, used by `binx stats`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use binx_server::presto::{self, HttpRequest};
use binx_server::{Exchange, ExchangeStats};
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// What the HTTP endpoint reports on.
#[derive(Clone, Debug)]
pub struct HttpState {
    pub exchange: Exchange,
    /// Cleared when binxd starts stopping, so load balancers stop sending.
    pub ready: Arc<AtomicBool>,
    /// Identifies this run of binxd to Presto clients.
    pub instance_id: String,
}

/// A new id for `X-Presto-Task-Instance-Id`: differs between runs.
pub fn new_instance_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("binxd-{:x}-{:x}", std::process::id(), nanos)
}

/// Pieces shorter than this are copied together (one write instead of many);
/// larger ones are sent from their own memory.
const COALESCE_BELOW: usize = 4096;

/// A response body sent as the pieces it already is: large pages are not
/// copied, runs of small ones are joined.
#[derive(Debug, Default)]
pub struct PiecesBody {
    pieces: VecDeque<Bytes>,
    remaining: u64,
}

impl PiecesBody {
    pub fn new(pieces: Vec<Bytes>) -> Self {
        let remaining = pieces.iter().map(|p| p.len() as u64).sum();
        let mut out = VecDeque::new();
        let mut small = bytes::BytesMut::new();
        for piece in pieces {
            if piece.len() < COALESCE_BELOW {
                small.extend_from_slice(&piece);
                continue;
            }
            if !small.is_empty() {
                out.push_back(small.split().freeze());
            }
            out.push_back(piece);
        }
        if !small.is_empty() {
            out.push_back(small.freeze());
        }
        PiecesBody {
            pieces: out,
            remaining,
        }
    }
}

impl Body for PiecesBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let piece = self.pieces.pop_front();
        if let Some(p) = &piece {
            self.remaining -= p.len() as u64;
        }
        Poll::Ready(piece.map(|p| Ok(Frame::data(p))))
    }

    fn is_end_stream(&self) -> bool {
        self.pieces.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// Serves HTTP on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, state: HttpState) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "HTTP accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // Replies are written whole; waiting for ACKs (Nagle) only adds delay.
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(&request, &state).await) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
}

fn text(status: StatusCode, content_type: &str, body: String) -> Response<PiecesBody> {
    let mut response = Response::new(PiecesBody::new(vec![Bytes::from(body)]));
    *response.status_mut() = status;
    if let Ok(value) = header::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

async fn route(request: &Request<Incoming>, state: &HttpState) -> Response<PiecesBody> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    if presto::is_exchange_path(request.uri().path()) {
        return exchange(request, state).await;
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            PLAIN,
            format!("{} is not allowed here; use GET\n", request.method()),
        );
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, PLAIN, "ok\n".into()),
        "/readyz" if state.ready.load(Ordering::Acquire) => {
            text(StatusCode::OK, PLAIN, "ready\n".into())
        }
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, PLAIN, "stopping\n".into()),
        "/metrics" => text(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            prometheus(&state.exchange.stats()),
        ),
        "/v1/stats" => match serde_json::to_string_pretty(&state.exchange.stats()) {
            Ok(json) => text(StatusCode::OK, "application/json", json + "\n"),
            Err(e) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                PLAIN,
                format!("cannot render stats: {e}\n"),
            ),
        },
        other => text(
            StatusCode::NOT_FOUND,
            PLAIN,
            format!(
                "no such path {other:?}; try /healthz, /readyz, /metrics, /v1/stats or /v1/task/...\n"
            ),
        ),
    }
}

/// The Presto-compatible exchange.
async fn exchange(request: &Request<Incoming>, state: &HttpState) -> Response<PiecesBody> {
    // A header value that is not printable text is refused by name.
    let header = |name: &'static str| match request.headers().get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(Some).map_err(|_| name),
    };
    let (max_size, max_wait) = match (header("X-Presto-Max-Size"), header("X-Presto-Max-Wait")) {
        (Ok(size), Ok(wait)) => (size, wait),
        (Err(name), _) | (_, Err(name)) => {
            return text(
                StatusCode::BAD_REQUEST,
                "text/plain; charset=utf-8",
                format!("{name} is not printable text\n"),
            );
        }
    };
    let reply = presto::serve(
        &state.exchange,
        &state.instance_id,
        HttpRequest {
            method: request.method().as_str(),
            path: request.uri().path(),
            max_size,
            max_wait,
        },
    )
    .await;
    let mut response = Response::new(PiecesBody::new(reply.body));
    *response.status_mut() =
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in reply.headers {
        if let Ok(value) = header::HeaderValue::from_str(&value) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// The stats in Prometheus text exposition format.
pub fn prometheus(stats: &ExchangeStats) -> String {
    let m = &stats.manager;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    };
    metric(
        "binx_memory_used_bytes",
        "gauge",
        "Bytes held for pages: the pages, the receive buffers they pin, and their bookkeeping.",
        m.memory_used,
    );
    metric(
        "binx_memory_pages_bytes",
        "gauge",
        "Bytes of the pages themselves held in memory (binx_memory_used_bytes also counts the receive buffers they pin and their bookkeeping).",
        m.page_bytes_held,
    );
    metric(
        "binx_memory_pending_bytes",
        "gauge",
        "Bytes of ENQUEUE bodies held while their requests wait (for room, for storage, behind earlier requests).",
        m.memory_pending,
    );
    metric(
        "binx_memory_high_water_bytes",
        "gauge",
        "Highest memory_used since start.",
        m.memory_high_water,
    );
    metric(
        "binx_memory_limit_bytes",
        "gauge",
        "Memory limit for all tasks.",
        m.memory_limit,
    );
    metric(
        "binx_task_memory_limit_bytes",
        "gauge",
        "Memory limit per task.",
        m.task_memory_limit,
    );
    metric("binx_tasks", "gauge", "Open tasks.", m.tasks);
    metric("binx_buffers", "gauge", "Buffers of open tasks.", m.buffers);
    metric(
        "binx_pages_buffered",
        "gauge",
        "Pages held.",
        m.pages_buffered,
    );
    metric(
        "binx_pages_enqueued_total",
        "counter",
        "Pages received from producers.",
        m.pages_enqueued,
    );
    metric(
        "binx_bytes_enqueued_total",
        "counter",
        "Bytes received from producers.",
        m.bytes_enqueued,
    );
    metric(
        "binx_pages_served_total",
        "counter",
        "Pages sent to consumers.",
        m.pages_served,
    );
    metric(
        "binx_bytes_served_total",
        "counter",
        "Bytes sent to consumers.",
        m.bytes_served,
    );
    metric(
        "binx_busy_replies_total",
        "counter",
        "ENQUEUE replies that said BUSY.",
        m.busy_replies,
    );
    metric(
        "binx_abandoned_buffers_total",
        "counter",
        "Buffers dropped for lack of polls.",
        m.abandoned_buffers,
    );
    metric(
        "binx_tasks_aborted_total",
        "counter",
        "Tasks aborted.",
        m.tasks_aborted,
    );
    metric(
        "binx_long_polls_waiting",
        "gauge",
        "Requests waiting for pages or room.",
        stats.long_polls_waiting,
    );
    metric(
        "binx_connections_open",
        "gauge",
        "Open BinX connections.",
        stats.connections_open,
    );
    metric(
        "binx_connections_total",
        "counter",
        "BinX connections accepted.",
        stats.connections_total,
    );
    metric(
        "binx_shm_connections_open",
        "gauge",
        "BinX connections using shared memory.",
        stats.shm_connections_open,
    );
    metric(
        "binx_shm_attached_total",
        "counter",
        "Unix socket connections that attached shared memory.",
        stats.shm_attached_total,
    );
    metric(
        "binx_connections_refused_total",
        "counter",
        "Connections closed at the limit.",
        stats.connections_refused,
    );
    metric(
        "binx_protocol_errors_total",
        "counter",
        "Connections closed for a protocol error.",
        stats.protocol_errors,
    );
    metric(
        "binx_errors_total",
        "counter",
        "Error replies (BAD_REQUEST, SERVER_ERROR, UNAUTHENTICATED) and protocol errors.",
        stats.errors,
    );
    metric(
        "binx_bytes_received_total",
        "counter",
        "Bytes of BinX frames received.",
        stats.bytes_received,
    );
    metric(
        "binx_bytes_sent_total",
        "counter",
        "Bytes of BinX frames sent.",
        stats.bytes_sent,
    );
    metric(
        "binx_backpressure_waits_total",
        "counter",
        "ENQUEUEs that waited for memory.",
        stats.backpressure_waits,
    );
    if let Some(spool) = &stats.spool {
        for (name, kind, help, value) in [
            (
                "binx_spool_bytes_total",
                "counter",
                "Page bytes written to spool storage.",
                spool.bytes_spooled,
            ),
            (
                "binx_spool_objects_total",
                "counter",
                "Segment objects written to spool storage.",
                spool.objects_spooled,
            ),
            (
                "binx_spool_stored_bytes_total",
                "counter",
                "Bytes of segment objects as stored (after compression and encryption).",
                spool.stored_bytes_written,
            ),
            (
                "binx_spool_read_bytes_total",
                "counter",
                "Page bytes read back from spool storage.",
                spool.bytes_read,
            ),
            (
                "binx_spool_read_objects_total",
                "counter",
                "Segment objects read back from spool storage.",
                spool.objects_read,
            ),
            (
                "binx_spool_deleted_objects_total",
                "counter",
                "Segment objects deleted once their pages were released.",
                spool.objects_deleted,
            ),
            (
                "binx_spool_pruned_objects_total",
                "counter",
                "Segment objects deleted by the TTL and restart pruner.",
                spool.objects_pruned,
            ),
            (
                "binx_spool_errors_total",
                "counter",
                "Failed spool writes, reads and deletions.",
                spool.errors,
            ),
            (
                "binx_spool_pending_deletes",
                "gauge",
                "Segment objects waiting to be deleted.",
                m.pending_deletes,
            ),
        ] {
            metric(name, kind, help, value);
        }
    }
    let _ = writeln!(
        out,
        "# HELP binx_requests_total Requests answered, by type and status.\n# TYPE binx_requests_total counter"
    );
    for (key, value) in &m.requests {
        let (kind, status) = key.split_once(' ').unwrap_or((key.as_str(), ""));
        let _ = writeln!(
            out,
            "binx_requests_total{{type=\"{kind}\",status=\"{status}\"}} {value}"
        );
    }
    out
}
