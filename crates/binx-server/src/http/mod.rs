//! binxd's HTTP door, all of it in this module: the hyper server (connection
//! limits, idle and header timeouts, the internal bearer token), the routes,
//! and under `/v1/task/` the Presto- and Trino-compatible exchange
//! ([`presto`] maps it onto exchange requests, knowing no HTTP library);
//! also `/healthz`, `/readyz` (false while stopping), `/metrics`
//! (OpenMetrics text) and `/v1/stats` (JSON), both rendered by
//! [`crate::metrics`].

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::internal_auth::InternalAuth;
use crate::{Exchange, metrics};
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use presto::HttpRequest;
use response_watch::{ResponseWatch, Tracked};

pub mod presto;
mod response_watch;

/// What the HTTP endpoint reports on.
#[derive(Clone, Debug)]
pub struct HttpState {
    /// The exchange `/v1/task/...` serves and the metrics describe.
    pub exchange: Exchange,
    /// Cleared when binxd starts stopping, so load balancers stop sending.
    pub ready: Arc<AtomicBool>,
    /// Identifies this run of binxd to Presto clients.
    pub instance_id: String,
    /// With a shared secret: the keys `/v1/task/...` and `/v1/stats`
    /// requests must be signed with (docs/SECURITY.md).
    pub auth: Option<InternalAuth>,
    /// Connection, long-poll and timeout limits.
    pub limits: HttpLimits,
    /// Permits for GETs that wait (`HttpLimits::max_long_polls`).
    pub long_polls: Arc<Semaphore>,
}

impl HttpState {
    /// The state of one endpoint, with `limits.max_long_polls` long-poll
    /// permits.
    pub fn new(
        exchange: Exchange,
        ready: Arc<AtomicBool>,
        instance_id: String,
        auth: Option<InternalAuth>,
        limits: HttpLimits,
    ) -> Self {
        HttpState {
            exchange,
            ready,
            instance_id,
            auth,
            long_polls: Arc::new(Semaphore::new(limits.max_long_polls)),
            limits,
        }
    }
}

/// What one HTTP client may hold.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// Connections open at once; past it new ones wait to be accepted.
    pub max_connections: usize,
    /// Exchange GETs waiting for pages at once; past it a GET does not wait.
    pub max_long_polls: usize,
    /// Time a client has to send a whole request head (hyper starts the
    /// timer whenever it waits for one, so it also bounds keep-alive
    /// connections between requests).
    pub header_read_timeout: Duration,
    /// A connection that moves no byte for this long is closed (longer
    /// than any long-poll, which max_wait caps), and so is one holding a
    /// response that made no progress for as long.
    pub idle_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 1024,
            max_long_polls: 4096,
            header_read_timeout: Duration::from_secs(45),
            idle_timeout: Duration::from_secs(60),
        }
    }
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
    /// Set once the body is handed to its connection's watch.
    tracked: Option<Arc<Tracked>>,
}

impl PiecesBody {
    /// A body of `pieces` in order, runs of pieces under 4096 bytes joined
    /// into one.
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
            tracked: None,
        }
    }

    /// Ties the body and its pieces to `watch`, which then sees whether
    /// the response moves until hyper has dropped every piece.
    fn watched(mut self, watch: &ResponseWatch) -> Self {
        if self.pieces.is_empty() {
            return self;
        }
        let tracked = watch.track();
        for piece in self.pieces.iter_mut() {
            *piece = tracked.tie(std::mem::take(piece));
        }
        self.tracked = Some(tracked);
        self
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
            if let Some(tracked) = &self.tracked {
                tracked.progress();
            }
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
///
/// At `http_max_connections`, connections idle between requests (kept
/// alive, asking nothing for a second) are closed, as they would be by
/// their idle timeouts, and new connections are not accepted until one
/// closes: they wait in the listen backlog and are served then. Never a
/// 503: the engines' exchange clients fail the query on any status but
/// 200 and 204, while a connection that waits (or is closed between
/// requests and reopened) costs them only time; nor do kept-alive
/// connections lock out a health probe.
pub async fn serve(listener: TcpListener, state: HttpState) {
    let slots = Arc::new(Semaphore::new(state.limits.max_connections.max(1)));
    let shed = Arc::new(tokio::sync::Notify::new());
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                tracing::debug!(
                    limit = state.limits.max_connections,
                    "HTTP connections at http_max_connections; idle ones are closed, new ones wait to be accepted"
                );
                state.exchange.count_http_connections_waited();
                loop {
                    shed.notify_waiters();
                    tokio::select! {
                        slot = slots.clone().acquire_owned() => match slot {
                            Ok(slot) => break slot,
                            Err(_) => return,
                        },
                        () = tokio::time::sleep(SHED_AFTER) => {}
                    }
                }
            }
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, most likely: wait, do not spin.
                tracing::warn!(error = %e, "HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Replies are written whole; waiting for ACKs (Nagle) only adds delay.
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let shed = shed.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let limits = state.limits;
            let (stream, last_io) = IdleWatch::new(stream);
            let responses = ResponseWatch::default();
            let watch = responses.clone();
            // Requests in flight, and when one last began or ended: an
            // HTTP/2 client that only PINGs moves bytes but asks nothing.
            let requests = RequestWatch::new();
            let asked = requests.clone();
            // Set by a 401 on HTTP/2, whose connection otherwise outlives
            // it (HTTP/1.1 closes with `Connection: close`).
            let goaway = Arc::new(tokio::sync::Notify::new());
            let refused = goaway.clone();
            let service = service_fn(move |request| {
                let state = state.clone();
                let refused = refused.clone();
                let watch = watch.clone();
                let asked = asked.clone();
                async move {
                    let _asking = asked.begin();
                    let response = route(&request, &state, &refused).await;
                    Ok::<_, Infallible>(response.map(|body| body.watched(&watch)))
                }
            });
            // HTTP/1.1, or HTTP/2 with prior knowledge (h2c: Trino 480 and
            // later talk to workers so by default), told apart by the preface.
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                // Request heads are small; nothing unauthenticated grows a
                // read buffer past this.
                .max_buf_size(MAX_HTTP_READ_BUFFER);
            builder
                .http2()
                .timer(TokioTimer::new())
                .max_concurrent_streams(MAX_HTTP2_STREAMS)
                .max_header_list_size(MAX_HTTP2_HEADER_LIST);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            loop {
                tokio::select! {
                    result = connection.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!(error = %e, "HTTP connection ended with an error");
                        }
                        return;
                    }
                    () = last_io.idle_for(limits.idle_timeout) => {
                        tracing::debug!(%peer, "HTTP connection idle for {:?}; closing", limits.idle_timeout);
                    }
                    () = requests.none_for(limits.idle_timeout, &responses) => {
                        tracing::debug!(%peer, "HTTP connection sent no request for {:?}; closing", limits.idle_timeout);
                    }
                    () = responses.stalled_for(limits.idle_timeout) => {
                        tracing::debug!(%peer, "an HTTP response made no progress for {:?} (a client granting no window?); closing", limits.idle_timeout);
                    }
                    () = goaway.notified() => {
                        tracing::debug!(%peer, "HTTP/2 connection sent a request without a valid bearer token; closing");
                    }
                    () = shed.notified() => {
                        if !requests.quiet_for(SHED_AFTER, &responses) || !last_io.quiet_for(SHED_AFTER) {
                            continue;
                        }
                        tracing::debug!(%peer, "HTTP connection idle at http_max_connections; closing it for a new one");
                    }
                }
                break;
            }
            // Say so (HTTP/2 GOAWAY, after which the streams in flight
            // finish; HTTP/1.1 closes once no request is in flight), and
            // give up after a second either way.
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(1), connection).await;
        });
    }
}

/// At the connection limit: how long a connection must have asked nothing
/// (and sent nothing) to be closed for a new one, and how often the
/// listener looks again.
const SHED_AFTER: Duration = Duration::from_secs(1);

/// Largest read buffer of one HTTP connection (hyper's minimum is 8 KiB).
const MAX_HTTP_READ_BUFFER: usize = 64 * 1024;

/// Requests in flight on one HTTP/2 connection (each holds at most one
/// long-poll and one reply); Jetty's client opens another connection past
/// it.
const MAX_HTTP2_STREAMS: u32 = 64;

/// Largest HTTP/2 header list (a JWT and a few headers need under 2 KiB);
/// each waiting stream holds its request's headers.
const MAX_HTTP2_HEADER_LIST: u32 = 16 * 1024;

/// Longest a GET waits for a long-poll permit when `http_max_long_polls`
/// are taken (the engines' own servers wait 1-2 s before an empty answer).
const LONG_POLL_PERMIT_WAIT: Duration = Duration::from_secs(2);

/// The requests of one connection: how many are being answered, and when
/// one last began or was answered.
#[derive(Clone, Debug)]
struct RequestWatch {
    in_flight: Arc<AtomicU64>,
    last: LastIo,
}

/// One request being answered (dropped once its response head is out).
struct Asking(RequestWatch);

impl Drop for Asking {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.last.touch();
    }
}

impl RequestWatch {
    fn new() -> Self {
        RequestWatch {
            in_flight: Arc::new(AtomicU64::new(0)),
            last: LastIo {
                start: Instant::now(),
                millis: Arc::new(AtomicU64::new(0)),
            },
        }
    }

    fn begin(&self) -> Asking {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.last.touch();
        Asking(self.clone())
    }

    /// Whether no request is being answered, no response body is being
    /// sent, and none began or was answered for `quiet`.
    fn quiet_for(&self, quiet: Duration, responses: &ResponseWatch) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
            && responses.held() == 0
            && self.last.quiet_for(quiet)
    }

    /// Returns once no request was being answered, no response body was
    /// being sent, and none began or was answered for `idle`.
    async fn none_for(&self, idle: Duration, responses: &ResponseWatch) {
        loop {
            self.last.idle_for(idle).await;
            if self.in_flight.load(Ordering::Acquire) == 0 && responses.held() == 0 {
                return;
            }
            // Busy now: look again once it could have been quiet that long.
            self.last.touch();
        }
    }
}

/// When a connection last moved a byte, shared with its watchdog.
#[derive(Clone, Debug)]
struct LastIo {
    start: Instant,
    millis: Arc<AtomicU64>,
}

impl LastIo {
    fn touch(&self) {
        let now = self.start.elapsed().as_millis() as u64;
        self.millis.store(now, Ordering::Relaxed);
    }

    /// Whether no byte moved for `quiet`.
    fn quiet_for(&self, quiet: Duration) -> bool {
        let last = Duration::from_millis(self.millis.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last) >= quiet
    }

    /// Returns once no byte moved for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.millis.load(Ordering::Relaxed));
            let quiet = self.start.elapsed().saturating_sub(last);
            if quiet >= idle {
                return;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    }
}

/// A stream that records when it last moved a byte.
struct IdleWatch<S> {
    inner: S,
    last: LastIo,
}

impl<S> IdleWatch<S> {
    fn new(inner: S) -> (Self, LastIo) {
        let last = LastIo {
            start: Instant::now(),
            millis: Arc::new(AtomicU64::new(0)),
        };
        (
            IdleWatch {
                inner,
                last: last.clone(),
            },
            last,
        )
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleWatch<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.last.touch();
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleWatch<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.last.touch();
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.last.touch();
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
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

async fn route(
    request: &Request<Incoming>,
    state: &HttpState,
    goaway: &tokio::sync::Notify,
) -> Response<PiecesBody> {
    let path = request.uri().path();
    if (presto::is_exchange_path(path) || path == "/v1/stats")
        && let Some(refused) = unauthenticated(request, state)
    {
        if request.version() >= hyper::Version::HTTP_2 {
            goaway.notify_one();
        }
        return refused;
    }
    if presto::is_exchange_path(path) {
        return exchange(request, state).await;
    }
    let mut response = open_path(request, state);
    // With a secret set, a request without a valid token (a probe, a
    // scrape, a stranger) does not keep its connection: the connection
    // slots are for the engines' workers (a review found strangers could
    // hold every slot with a /healthz every few seconds).
    if state.auth.is_some() && !bearer_valid(request, state) {
        if request.version() >= hyper::Version::HTTP_2 {
            goaway.notify_one();
        } else {
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
    }
    response
}

/// Whether the request carries a valid internal bearer token (none is
/// needed without a shared secret).
fn bearer_valid(request: &Request<Incoming>, state: &HttpState) -> bool {
    let Some(auth) = state.auth.as_ref() else {
        return true;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let header = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok());
    auth.check_headers(header, now).is_ok()
}

/// The paths outside the exchange: probes, metrics, stats (checked for a
/// token by the caller), and 404 for the rest.
fn open_path(request: &Request<Incoming>, state: &HttpState) -> Response<PiecesBody> {
    const PLAIN: &str = "text/plain; charset=utf-8";
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
            metrics::OPENMETRICS_CONTENT_TYPE,
            metrics::openmetrics(state.exchange.stats(), state.exchange.histograms()),
        ),
        "/v1/stats" => {
            match serde_json::to_string_pretty(&metrics::stats_json(&state.exchange.stats())) {
                Ok(json) => text(StatusCode::OK, "application/json", json + "\n"),
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    PLAIN,
                    format!("cannot render stats: {e}\n"),
                ),
            }
        }
        other => text(
            StatusCode::NOT_FOUND,
            PLAIN,
            format!(
                "no such path {other:?}; try /healthz, /readyz, /metrics, /v1/stats or /v1/task/...\n"
            ),
        ),
    }
}

/// 401 with the reason, when a shared secret is set and the request does
/// not carry a valid internal bearer token.
fn unauthenticated(request: &Request<Incoming>, state: &HttpState) -> Option<Response<PiecesBody>> {
    let auth = state.auth.as_ref()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let header = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok());
    let error = auth.check_headers(header, now).err()?;
    state.exchange.count_http_unauthenticated();
    let mut response = text(
        StatusCode::UNAUTHORIZED,
        "text/plain; charset=utf-8",
        format!("{error}\n"),
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer realm=\"binx internal\""),
    );
    // A client without a token does not keep a connection slot (HTTP/2
    // has no such header; its connection stays for other streams).
    if request.version() < hyper::Version::HTTP_2 {
        response.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
    }
    Some(response)
}

/// The HTTP exchange, in the dialect of the engine that asks.
async fn exchange(request: &Request<Incoming>, state: &HttpState) -> Response<PiecesBody> {
    let dialect = presto::Dialect::of(request.headers().keys().map(|name| name.as_str()));
    let names = dialect.headers();
    // A header value that is not printable text is refused by name.
    let header = |name: &'static str| match request.headers().get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(Some).map_err(|_| name),
    };
    let (max_size, max_wait) = match (header(names.max_size), header(names.max_wait)) {
        (Ok(size), Ok(wait)) => (size, wait),
        (Err(name), _) | (_, Err(name)) => {
            return text(
                StatusCode::BAD_REQUEST,
                "text/plain; charset=utf-8",
                format!("{name} is not printable text\n"),
            );
        }
    };
    // A GET waits for pages only with a permit. Past the limit it is
    // answered at once when pages are held (a consumer draining a full
    // buffer is not slowed by those waiting on empty ones); otherwise it
    // waits for a permit as long as it would have waited for pages (at
    // most the engines' 1-2 s), long-polls if it gets one, and is answered
    // "nothing yet" (204) if not: the engines' clients ask again at once
    // after any answer, so an empty answer at once would have them spin.
    // Only a GET or HEAD of pages may wait; ACK and DELETE never do.
    let may_wait = matches!(*request.method(), Method::GET | Method::HEAD)
        && !request.uri().path().ends_with("/acknowledge");
    let head = request.method() == Method::HEAD;
    // The request as served: waiting as asked (HEAD only when asked to;
    // GET the engines' 1-2 s without a max-wait header), or not at all.
    let asked = |waits: bool| HttpRequest {
        method: request.method().as_str(),
        path: request.uri().path(),
        dialect,
        max_size,
        max_wait: if waits { max_wait } else { None },
        default_wait: if waits && !head {
            presto::engine_default_wait()
        } else {
            Duration::ZERO
        },
    };
    let mut permit = None;
    let mut answered = None;
    if may_wait {
        match state.long_polls.clone().try_acquire_owned() {
            Ok(got) => permit = Some(got),
            Err(_) => {
                let now = presto::serve(&state.exchange, &state.instance_id, asked(false)).await;
                if now.nothing_yet(dialect) {
                    let waiting = asked(true);
                    let wait = waiting
                        .max_wait
                        .and_then(|text| presto::parse_duration(text).ok())
                        .unwrap_or(waiting.default_wait)
                        .min(LONG_POLL_PERMIT_WAIT);
                    permit = tokio::time::timeout(wait, state.long_polls.clone().acquire_owned())
                        .await
                        .ok()
                        .and_then(Result::ok);
                    if permit.is_none() {
                        // What is held by now, without waiting.
                        state.exchange.count_http_long_poll_refused();
                        answered = Some(
                            presto::serve(&state.exchange, &state.instance_id, asked(false)).await,
                        );
                    }
                } else {
                    answered = Some(now);
                }
            }
        }
    }
    let reply = match answered {
        Some(reply) => reply,
        None => presto::serve(&state.exchange, &state.instance_id, asked(may_wait)).await,
    };
    drop(permit);
    let mut response = Response::new(PiecesBody::new(reply.body));
    *response.status_mut() =
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in reply.headers {
        match header::HeaderValue::from_str(&value) {
            Ok(value) => {
                response.headers_mut().insert(name, value);
            }
            // Every value binx makes is printable; a required header that
            // were not must not vanish silently.
            Err(_) => {
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain; charset=utf-8",
                    format!("cannot send header {name}: {value:?} is not printable\n"),
                );
            }
        }
    }
    response
}
