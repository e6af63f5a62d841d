//! `binx bench`: the RFC micro-benchmark against live daemons. Chunks go
//! into one BROADCAST task per chunk size (through a daemon's Unix socket),
//! then are pulled one chunk per request through BinX over TCP and through
//! the Presto HTTP exchange, 1..N exchanges in parallel, alternating the two
//! protocols so both see the same noise. Every iteration reads fresh buffer
//! ids of the same task, so the chunks are filled once and read many times.
//!
//! Across hosts: `--fill-only` on the serving pod leaves the tasks in place
//! and prints their prefix; `--prefix P` on the reading pod reads them.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use binx_client::{Connection, ConnectionOptions, Producer, TaskSpec};
use binx_proto::{BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// Buffers per task: each iteration uses `parallel` fresh ones.
pub const BUFFERS_PER_TASK: u64 = 65_536;

/// What to measure and where.
#[derive(Clone, Debug)]
pub struct BenchPlan {
    /// Chunk sizes in bytes, one task each.
    pub sizes: Vec<usize>,
    /// Numbers of exchanges pulled in parallel, one case each.
    pub parallel: Vec<usize>,
    /// Chunks per buffer (the RFC: 128), fewer where a task would hold more
    /// than `max_task_bytes`.
    pub chunks: usize,
    /// The most bytes one task may hold; larger sizes get fewer chunks.
    pub max_task_bytes: u64,
    /// Time spent per case (both protocols together); at least 3 iterations each.
    pub time_per_case: Duration,
}

impl BenchPlan {
    /// Chunks per buffer for chunks of `size` bytes: `chunks`, capped so the
    /// task holds at most `max_task_bytes`, and at least 1.
    pub fn chunks_for(&self, size: usize) -> usize {
        ((self.max_task_bytes / size.max(1) as u64) as usize).clamp(1, self.chunks.max(1))
    }
}

/// The task holding chunks of `size` under `prefix`.
pub fn task_id(prefix: &str, size: usize) -> String {
    format!("{prefix}.{size}")
}

/// Fills one BROADCAST task per chunk size through the local socket.
pub async fn fill(producer: &Producer, prefix: &str, plan: &BenchPlan) -> anyhow::Result<()> {
    for &size in &plan.sizes {
        let task = task_id(prefix, size);
        let spec = TaskSpec {
            kind: BufferKind::Broadcast,
            buffer_count: BUFFERS_PER_TASK,
            spool_policy: String::new(),
        };
        producer
            .open_task(&task, &spec)
            .await
            .with_context(|| format!("cannot open the bench task {task}"))?;
        let chunk = Bytes::from(vec![0xa5u8; size]);
        let per_batch = (producer.max_batch_bytes / 2 / size.max(1)).max(1);
        let mut left = plan.chunks_for(size);
        while left > 0 {
            let n = left.min(per_batch);
            let batch = vec![chunk.clone(); n];
            producer
                .enqueue(&task, 0, &batch)
                .await
                .with_context(|| format!("cannot fill the bench task {task}"))?;
            left -= n;
        }
        producer.no_more_pages(&task, None).await?;
    }
    Ok(())
}

/// Aborts the bench tasks (frees their memory at once).
pub async fn clean(producer: &Producer, prefix: &str, plan: &BenchPlan) {
    for &size in &plan.sizes {
        let _ = producer
            .abort(&task_id(prefix, size), "binx bench finished")
            .await;
    }
}

/// One measured case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Chunk size in bytes.
    pub size: usize,
    /// Exchanges pulled in parallel.
    pub parallel: usize,
    /// Chunks per buffer.
    pub chunks: usize,
    /// Median bytes per second of the iterations.
    pub binx: f64,
    /// Median bytes per second over the HTTP exchange, when it was measured.
    pub http: Option<f64>,
    /// BinX iterations measured (HTTP ran as many, or one fewer).
    pub iterations: usize,
}

/// Readers of the daemon under test.
pub struct Readers {
    /// The BinX connection to the daemon: over TCP its stripes carry the
    /// parallel exchanges' DATA in turn.
    pub binx: Connection,
    /// `host:port` of the HTTP exchange, when it is measured.
    pub http: Option<String>,
    http_pool: Vec<SendRequest<Empty<Bytes>>>,
}

impl Readers {
    /// Readers over `binx` and, when `http`
    /// (`host:port`) is given, over the HTTP exchange; HTTP connections are
    /// opened when a case needs them.
    pub fn new(binx: Connection, http: Option<String>) -> Self {
        Readers {
            binx,
            http,
            http_pool: Vec::new(),
        }
    }

    /// Keep-alive HTTP connections, one per parallel exchange (as Presto),
    /// fresh for each case: one left idle since an earlier case may be
    /// closed by binxd (`http_idle_timeout`) just as a request goes out on
    /// it, which the client only learns as "channel closed" (CI's quick
    /// run under load once did).
    async fn http_connections(&mut self, n: usize) -> anyhow::Result<()> {
        let Some(addr) = self.http.clone() else {
            return Ok(());
        };
        self.http_pool.clear();
        while self.http_pool.len() < n {
            let stream = tokio::net::TcpStream::connect(&addr)
                .await
                .with_context(|| format!("cannot connect to the HTTP exchange at {addr}"))?;
            stream.set_nodelay(true)?;
            let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .with_context(|| format!("HTTP handshake with {addr} failed"))?;
            tokio::spawn(connection);
            self.http_pool.push(sender);
        }
        Ok(())
    }
}

/// Counts which buffer ids of each task are used.
struct BufferIds {
    next: u64,
}

impl BufferIds {
    fn take(&mut self, n: usize) -> Option<std::ops::Range<u64>> {
        let end = self.next + n as u64;
        if end > BUFFERS_PER_TASK {
            return None;
        }
        let range = self.next..end;
        self.next = end;
        Some(range)
    }
}

/// Runs every case of the plan against tasks under `prefix`.
pub async fn run(
    readers: &mut Readers,
    prefix: &str,
    plan: &BenchPlan,
    mut progress: impl FnMut(&CaseResult),
) -> anyhow::Result<Vec<CaseResult>> {
    let mut results = Vec::new();
    for &size in &plan.sizes {
        let task = task_id(prefix, size);
        let mut ids = BufferIds { next: 0 };
        let chunks = plan.chunks_for(size);
        for &parallel in &plan.parallel {
            readers.http_connections(parallel).await?;
            let expected = (size as u64)
                .saturating_mul(chunks as u64)
                .saturating_mul(parallel as u64);
            let (mut binx, mut http) = (Vec::new(), Vec::new());
            let start = Instant::now();
            while binx.len() < 3 || start.elapsed() < plan.time_per_case {
                let Some(range) = ids.take(parallel) else {
                    break;
                };
                let (elapsed, bytes) = binx_iteration(&readers.binx, &task, range).await?;
                check_bytes("BinX", &task, bytes, expected)?;
                binx.push(bytes as f64 / elapsed.as_secs_f64().max(1e-9));
                if readers.http.is_some() {
                    let Some(range) = ids.take(parallel) else {
                        break;
                    };
                    let (elapsed, bytes) =
                        http_iteration(&mut readers.http_pool[..parallel], &task, range).await?;
                    check_bytes("HTTP", &task, bytes, expected)?;
                    http.push(bytes as f64 / elapsed.as_secs_f64().max(1e-9));
                }
            }
            if binx.is_empty() {
                bail!("task {task} ran out of buffer ids; fill it again (a new --prefix)");
            }
            let result = CaseResult {
                size,
                parallel,
                chunks,
                binx: median(&mut binx),
                http: (!http.is_empty()).then(|| median(&mut http)),
                iterations: binx.len(),
            };
            progress(&result);
            results.push(result);
        }
    }
    Ok(results)
}

fn check_bytes(what: &str, task: &str, got: u64, expected: u64) -> anyhow::Result<()> {
    if got != expected {
        bail!(
            "{what} read {got} bytes of task {task}, expected {expected}: was it filled with the same plan (--sizes, --chunks, --max-task-bytes)?"
        );
    }
    Ok(())
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// Pulls one buffer to its end over BinX, asking for up to `max_size`
/// bytes per request (1: one chunk per request); returns (bytes, requests).
pub async fn pull_binx(
    connection: &Connection,
    task: &str,
    buffer: u64,
    max_size: u64,
) -> anyhow::Result<(u64, u64)> {
    let (mut token, mut bytes, mut requests) = (0u64, 0u64, 0u64);
    loop {
        let mut r = BinRequest::new(MessageType::Data);
        r.task_id = task.to_string();
        r.buffer_id = buffer;
        r.page_token = token;
        r.max_size_bytes = max_size;
        let reply = connection.call(r, Vec::new()).await?;
        if reply.header.status_kind() != Status::Ok {
            bail!(
                "DATA for buffer {buffer} of task {task} at token {token}: {} {}",
                reply.header.status_kind().name(),
                reply.header.error
            );
        }
        requests += 1;
        bytes += reply.body.len() as u64;
        token = reply.header.page_next_token;
        if reply.header.buffer_complete {
            return Ok((bytes, requests));
        }
    }
}

/// Pulls one buffer to its end over the HTTP exchange with
/// `X-Presto-Max-Size: max_size` (`1B`: one chunk per request); returns
/// (bytes, requests).
pub async fn pull_http(
    sender: &mut SendRequest<Empty<Bytes>>,
    task: &str,
    buffer: u64,
    max_size: &str,
) -> anyhow::Result<(u64, u64)> {
    let (mut token, mut bytes, mut requests) = (0u64, 0u64, 0u64);
    loop {
        let path = format!("/v1/task/{task}/results/{buffer}/{token}");
        let response = send_http(sender, hyper::Method::GET, &path, max_size).await?;
        let status = response.status();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let next = header("X-Presto-Page-End-Sequence-Id");
        let complete = header("X-Presto-Buffer-Complete").as_deref() == Some("true");
        let body = response.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("GET {path}: {status} {}", String::from_utf8_lossy(&body));
        }
        requests += 1;
        bytes += body.len() as u64;
        token = next
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("GET {path}: no X-Presto-Page-End-Sequence-Id"))?;
        if complete {
            return Ok((bytes, requests));
        }
    }
}

async fn send_http(
    sender: &mut SendRequest<Empty<Bytes>>,
    method: hyper::Method,
    path: &str,
    max_size: &str,
) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "binx-bench")
        .header("X-Presto-Max-Size", max_size)
        .body(Empty::new())?;
    sender.ready().await?;
    Ok(sender.send_request(request).await?)
}

/// Pulls buffers `range` in parallel over BinX, one chunk per request, then
/// DELETEs them; returns (elapsed, bytes).
async fn binx_iteration(
    connection: &Connection,
    task: &str,
    range: std::ops::Range<u64>,
) -> anyhow::Result<(Duration, u64)> {
    let start = Instant::now();
    let pulls = range
        .clone()
        .map(|buffer| pull_binx(connection, task, buffer, 1));
    let totals = futures_util::future::try_join_all(pulls).await?;
    let elapsed = start.elapsed();
    for buffer in range {
        let mut r = BinRequest::new(MessageType::Delete);
        r.task_id = task.to_string();
        r.buffer_id = buffer;
        connection.call(r, Vec::new()).await?;
    }
    Ok((elapsed, totals.iter().map(|t| t.0).sum()))
}

/// The same over the HTTP exchange, one keep-alive connection per buffer.
async fn http_iteration(
    pool: &mut [SendRequest<Empty<Bytes>>],
    task: &str,
    range: std::ops::Range<u64>,
) -> anyhow::Result<(Duration, u64)> {
    let start = Instant::now();
    let pulls = pool
        .iter_mut()
        .zip(range.clone())
        .map(|(sender, buffer)| pull_http(sender, task, buffer, "1B"));
    let totals = futures_util::future::try_join_all(pulls).await?;
    let elapsed = start.elapsed();
    for (sender, buffer) in pool.iter_mut().zip(range) {
        let path = format!("/v1/task/{task}/results/{buffer}");
        let response = send_http(sender, hyper::Method::DELETE, &path, "1B").await?;
        let _ = response.into_body().collect().await;
    }
    Ok((elapsed, totals.iter().map(|t| t.0).sum()))
}

/// The report: one row per case, and the BinX/HTTP speedup.
pub fn table(results: &[CaseResult]) -> String {
    let mut out = String::from(
        "| chunk | parallel | chunks | BinX MB/s | HTTP MB/s | BinX/HTTP | iterations |\n|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let (http, ratio) = match r.http {
            Some(h) => (mb_per_s(h), format!("{:.2}", r.binx / h)),
            None => ("-".into(), "-".into()),
        };
        out += &format!(
            "| {} | {} | {} | {} | {http} | {ratio} | {} |\n",
            bytesize::ByteSize(r.size as u64),
            r.parallel,
            r.chunks,
            mb_per_s(r.binx),
            r.iterations
        );
    }
    out
}

/// 10^6 bytes per second, with a decimal below 10 so small chunks do not read as 0.
fn mb_per_s(bytes_per_second: f64) -> String {
    let mb = bytes_per_second / 1e6;
    if mb < 10.0 {
        format!("{mb:.1}")
    } else {
        format!("{mb:.0}")
    }
}

/// Options for the reading connection.
/// `stripes` 0 keeps the client's default.
pub fn binx_options(auth_token: Option<String>, stripes: usize) -> ConnectionOptions {
    let defaults = ConnectionOptions::default();
    ConnectionOptions {
        auth_token,
        stripes: if stripes == 0 {
            defaults.stripes
        } else {
            stripes
        },
        ..defaults
    }
}
