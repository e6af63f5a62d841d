//! Loopback exchange, the BinX RFC's micro-benchmark: BinX against the
//! Presto-compatible HTTP exchange, a gRPC server-streaming service (tonic)
//! and a raw TCP baseline, same process, same run.
//!
//! Each exchange pulls one buffer of up to 128 chunks of one size (32 B,
//! 1 KiB, 32 KiB, 1 MiB, 16 MiB), one chunk per request as in the RFC, with
//! 1, 8, 32 and 128 exchanges in parallel (`BINX_BENCH_BATCH=1` adds runs
//! that ask for as many chunks as fit in 1 MiB per request). BinX runs the real
//! binx-server listener and the binx-client `Connection`: the exchanges
//! share two multiplexed TCP connections. The baseline moves the same bytes
//! as request/response over plain sockets: one connection per exchange; an
//! 8-byte request names the bytes wanted, and the server writes them from
//! memory. The HTTP exchange is binxd's own (`/v1/task/.../results/...`,
//! served by hyper over the same buffer manager), read by a hyper client
//! with one keep-alive connection per exchange, as Presto reads it. gRPC is
//! a tonic server-streaming call per buffer over the same buffer manager,
//! one message per chunk, every exchange on one HTTP/2 connection
//! (benches/support/grpc_pages.rs).
//!
//!     cargo bench --bench exchange            # full run (about 12 minutes)
//!     cargo test --bench exchange             # quick mode: each case once, small
//!
//! The BinX exchanges are spread over two sockets (one connection with two
//! stripes), as binxd's forwarder spreads them by default
//! (`forward_connections_per_remote`); `BINX_BENCH_CONNECTIONS=1` puts them
//! all on one. Beside the grid, 32 KiB and 128 KiB chunks are measured with
//! 64 exchanges in parallel (`WIRE_CASES`).
//!
//! At the end it prints a table of median throughput and the BinX/HTTP,
//! BinX/gRPC and BinX/raw ratios, writes it to
//! target/criterion/exchange-summary.md, and draws the ratios as heatmaps
//! in target/criterion/exchange-speedup.png (like the RFC's figure).

#[path = "support/grpc_pages.rs"]
mod grpc_pages;
#[path = "support/heatmap.rs"]
mod heatmap;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use binx_client::{ConnectionOptions, ConnectionPool, Endpoint};
use binx_proto::{ALL_BUFFERS, BinRequest, BufferKind, MessageType};
use binx_server::{BinxServer, CoreConfig, Exchange, ListenConfig};
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

type HttpSender = hyper::client::conn::http1::SendRequest<http_body_util::Empty<Bytes>>;

const SIZES: [usize; 5] = [32, 1 << 10, 32 << 10, 1 << 20, 16 << 20];
const PARALLEL: [usize; 4] = [1, 8, 32, 128];
/// Cases beside the grid above (not in the heatmap): the target of 2x
/// binxd's HTTP exchange is stated for 32-128 KiB chunks, 64 in parallel.
const WIRE_CASES: [(usize, usize); 2] = [(32 << 10, 64), (128 << 10, 64)];
const CHUNKS: usize = 128;
const BATCH: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    /// One chunk per request.
    One,
    /// As many chunks as fit in 1 MiB per request.
    Batch,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::One => "one-per-request",
            Mode::Batch => "up-to-1MiB",
        }
    }

    /// Chunks per reply.
    fn per_reply(self, size: usize) -> usize {
        match self {
            Mode::One => 1,
            Mode::Batch => (BATCH / size).max(1),
        }
    }
}

/// Whether criterion runs for real (`cargo bench`) or once per case (`cargo test`).
fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Modes measured: one chunk per request, plus batches when asked for.
fn modes() -> Vec<Mode> {
    if std::env::var_os("BINX_BENCH_BATCH").is_some_and(|v| v == "1") {
        vec![Mode::One, Mode::Batch]
    } else {
        vec![Mode::One]
    }
}

/// Every (chunk size, parallel exchanges) measured, by size: the grid of
/// `SIZES` x `PARALLEL` and the `WIRE_CASES`.
fn cases() -> BTreeMap<usize, Vec<usize>> {
    let mut cases: BTreeMap<usize, Vec<usize>> =
        SIZES.iter().map(|&s| (s, PARALLEL.to_vec())).collect();
    for (size, parallel) in WIRE_CASES {
        let list = cases.entry(size).or_default();
        list.push(parallel);
        list.sort_unstable();
        list.dedup();
    }
    cases
}

/// Bytes one iteration may move: 1 GiB in a full run, 32 MiB in quick mode.
fn cap() -> usize {
    if full_run() { 1 << 30 } else { 32 << 20 }
}

/// Chunks per buffer: 128, fewer where 128 chunks in every parallel buffer
/// would move more than `cap` bytes per iteration (the large chunks at high
/// parallelism; the table shows the count used).
fn chunks_per_buffer(size: usize, parallel: usize, cap: usize) -> usize {
    (cap / (size * parallel)).clamp(1, CHUNKS)
}

struct Bench {
    runtime: Runtime,
    exchange: Exchange,
    binx: ConnectionPool,
    binx_endpoint: Endpoint,
    raw: Arc<Vec<tokio::sync::Mutex<TcpStream>>>,
    http: Arc<Vec<tokio::sync::Mutex<HttpSender>>>,
    http_addr: String,
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
    chunks: BTreeMap<usize, Bytes>,
    next_task: AtomicU64,
}

type Key = (usize, usize, Mode, &'static str);

/// A keep-alive HTTP/1.1 connection to the exchange, as Presto keeps one.
async fn http_connect(addr: &str) -> HttpSender {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    sender
}

static RESULTS: Mutex<BTreeMap<Key, Vec<(f64, f64)>>> = Mutex::new(BTreeMap::new());

fn record(key: Key, bytes: u64, requests: u64, elapsed: Duration) {
    let secs = elapsed.as_secs_f64().max(1e-9);
    RESULTS
        .lock()
        .unwrap()
        .entry(key)
        .or_default()
        .push((bytes as f64 / secs, requests as f64 / secs));
}

impl Bench {
    fn new() -> Bench {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let exchange = Exchange::new(CoreConfig {
            memory_limit: u64::MAX / 4,
            task_memory_limit: u64::MAX / 4,
            ..CoreConfig::default()
        });
        let (binx_addr, raw_addr, http_addr, grpc_addr) = runtime.block_on(async {
            // Runs until the process ends.
            drop(exchange.spawn_driver());
            let server = BinxServer::bind(
                exchange.clone(),
                ListenConfig {
                    tcp: Some("127.0.0.1:0".into()),
                    uds: None,
                    max_connections: 1024,
                    ..ListenConfig::default()
                },
            )
            .await
            .unwrap();
            let binx_addr = server.tcp_addr().unwrap().to_string();
            tokio::spawn(server.run(std::future::pending()));
            let raw = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let raw_addr = raw.local_addr().unwrap().to_string();
            tokio::spawn(raw_server(raw));
            let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let http_addr = http.local_addr().unwrap().to_string();
            tokio::spawn(binx_server::http::serve(
                http,
                binx_server::http::HttpState::new(
                    exchange.clone(),
                    Arc::new(std::sync::atomic::AtomicBool::new(true)),
                    "bench".into(),
                    None,
                    // The bench keeps its keep-alive connections between
                    // cases: idle and head timers would only add reconnects.
                    binx_server::http::HttpLimits {
                        header_read_timeout: Duration::from_secs(3600),
                        idle_timeout: Duration::from_secs(3600),
                        ..Default::default()
                    },
                ),
            ));
            let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let grpc_addr = grpc.local_addr().unwrap().to_string();
            tokio::spawn(grpc_pages::serve(
                grpc,
                grpc_pages::PagesService {
                    exchange: exchange.clone(),
                },
            ));
            (binx_addr, raw_addr, http_addr, grpc_addr)
        });
        let grpc = runtime.block_on(grpc_pages::client(&grpc_addr));
        let per_endpoint = std::env::var("BINX_BENCH_CONNECTIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2);
        let binx = ConnectionPool::new(ConnectionOptions {
            stripes: per_endpoint,
            ..ConnectionOptions::default()
        });
        let binx_endpoint = Endpoint::Tcp(binx_addr);
        let raw = runtime.block_on(async {
            binx.get(&binx_endpoint).open_all().await.unwrap();
            for _ in 0..per_endpoint {
                binx.get(&binx_endpoint).ping().await.unwrap();
            }
            let mut streams = Vec::new();
            for _ in 0..*PARALLEL.iter().max().unwrap() {
                let s = TcpStream::connect(&raw_addr).await.unwrap();
                s.set_nodelay(true).unwrap();
                streams.push(tokio::sync::Mutex::new(s));
            }
            streams
        });
        let http = runtime.block_on(async {
            let mut senders = Vec::new();
            for _ in 0..*PARALLEL.iter().max().unwrap() {
                senders.push(tokio::sync::Mutex::new(http_connect(&http_addr).await));
            }
            senders
        });
        let chunks = cases()
            .into_keys()
            .map(|s| (s, Bytes::from(vec![0x5au8; s])))
            .collect();
        Bench {
            runtime,
            exchange,
            binx,
            binx_endpoint,
            raw: Arc::new(raw),
            http: Arc::new(http),
            http_addr,
            grpc,
            chunks,
            next_task: AtomicU64::new(0),
        }
    }

    fn local(&self, kind: MessageType, task: &str, buffer: u64) -> BinRequest {
        let mut r = BinRequest::new(kind);
        r.task_id = task.to_string();
        r.buffer_id = buffer;
        r
    }

    /// Fills `parallel` buffers of a new task with `chunks` chunks each (in
    /// memory, zero copy; not timed). Returns the task id.
    fn fill(&self, size: usize, parallel: usize, chunks: usize) -> String {
        let task = format!("bench.{}", self.next_task.fetch_add(1, Ordering::Relaxed));
        let mut open = self.local(MessageType::OpenTask, &task, 0);
        open.buffer_kind = BufferKind::Partitioned as i32;
        open.buffer_count = parallel as u64;
        self.exchange
            .try_handle_wire(&open, Bytes::new())
            .expect("answered at once");
        let chunk = self.chunks[&size].clone();
        for buffer in 0..parallel as u64 {
            for _ in 0..chunks {
                let mut r = self.local(MessageType::Enqueue, &task, buffer);
                r.page_sizes = vec![size as u64];
                self.exchange
                    .try_handle_wire(&r, chunk.clone())
                    .expect("answered at once");
            }
        }
        let finish = self.local(MessageType::NoMorePages, &task, ALL_BUFFERS);
        self.exchange
            .try_handle_wire(&finish, Bytes::new())
            .expect("answered at once");
        task
    }

    fn free(&self, task: &str, parallel: usize) {
        for buffer in 0..parallel as u64 {
            let r = self.local(MessageType::Delete, task, buffer);
            self.exchange
                .try_handle_wire(&r, Bytes::new())
                .expect("answered at once");
        }
    }

    /// Fills the buffers (not timed), then times `pull` run for every
    /// buffer at once, checks the bytes moved, and frees the buffers.
    fn timed_pulls<F, Fut>(
        &self,
        size: usize,
        parallel: usize,
        chunks: usize,
        what: &str,
        pull: F,
    ) -> (Duration, u64, u64)
    where
        F: Fn(String, usize) -> Fut,
        Fut: std::future::Future<Output = (u64, u64)> + Send + 'static,
    {
        let task = self.fill(size, parallel, chunks);
        let start = Instant::now();
        let (bytes, requests) = self.runtime.block_on(async {
            let pulls = (0..parallel)
                .map(|buffer| tokio::spawn(pull(task.clone(), buffer)))
                .collect();
            sum_pulls(pulls).await
        });
        let elapsed = start.elapsed();
        assert_eq!(
            bytes,
            (size * chunks * parallel) as u64,
            "{what} moved the wrong amount"
        );
        self.free(&task, parallel);
        (elapsed, bytes, requests)
    }

    /// One timed BinX transfer: every buffer pulled to its end in parallel.
    fn binx_once(
        &self,
        size: usize,
        parallel: usize,
        mode: Mode,
        chunks: usize,
    ) -> (Duration, u64, u64) {
        let max_size = (mode.per_reply(size) * size) as u64;
        self.timed_pulls(size, parallel, chunks, "BinX", |task, buffer| {
            let connection = self.binx.get(&self.binx_endpoint);
            async move {
                binx_cli::bench::pull_binx(&connection, &task, buffer as u64, max_size)
                    .await
                    .unwrap()
            }
        })
    }

    /// One timed transfer over the HTTP exchange.
    fn http_once(
        &self,
        size: usize,
        parallel: usize,
        mode: Mode,
        chunks: usize,
    ) -> (Duration, u64, u64) {
        let max_size = format!("{}B", mode.per_reply(size) * size);
        self.timed_pulls(size, parallel, chunks, "HTTP", |task, buffer| {
            let (http, max_size) = (self.http.clone(), max_size.clone());
            let addr = self.http_addr.clone();
            async move {
                let mut sender = http[buffer].lock().await;
                // binxd closes keep-alive connections left idle past
                // http_idle_timeout, as any server may: open another.
                if sender.is_closed() {
                    *sender = http_connect(&addr).await;
                }
                binx_cli::bench::pull_http(&mut sender, &task, buffer as u64, &max_size)
                    .await
                    .unwrap()
            }
        })
    }

    /// One timed transfer over gRPC: one streaming call per buffer.
    fn grpc_once(
        &self,
        size: usize,
        parallel: usize,
        _mode: Mode,
        chunks: usize,
    ) -> (Duration, u64, u64) {
        self.timed_pulls(size, parallel, chunks, "gRPC", |task, buffer| {
            grpc_pages::fetch(self.grpc.clone(), task, buffer as u64)
        })
    }

    /// One timed raw transfer of the same bytes in the same request sizes.
    fn raw_once(
        &self,
        size: usize,
        parallel: usize,
        mode: Mode,
        chunks: usize,
    ) -> (Duration, u64, u64) {
        let per_reply = mode.per_reply(size);
        let start = Instant::now();
        let (bytes, requests) = self.runtime.block_on(async {
            let mut pulls = Vec::new();
            for i in 0..parallel {
                let raw = self.raw.clone();
                pulls.push(tokio::spawn(async move {
                    let mut stream = raw[i].lock().await;
                    let mut buf = vec![0u8; per_reply.min(chunks) * size];
                    let (mut left, mut bytes, mut requests) = (chunks, 0u64, 0u64);
                    while left > 0 {
                        let n = per_reply.min(left);
                        let want = n * size;
                        stream
                            .write_all(&(want as u64).to_be_bytes())
                            .await
                            .unwrap();
                        stream.read_exact(&mut buf[..want]).await.unwrap();
                        left -= n;
                        bytes += want as u64;
                        requests += 1;
                    }
                    (bytes, requests)
                }));
            }
            sum_pulls(pulls).await
        });
        (start.elapsed(), bytes, requests)
    }
}

/// Adds up (bytes, requests) of parallel pulls.
async fn sum_pulls(pulls: Vec<tokio::task::JoinHandle<(u64, u64)>>) -> (u64, u64) {
    let mut totals = (0, 0);
    for pull in pulls {
        let (bytes, requests) = pull.await.unwrap();
        totals.0 += bytes;
        totals.1 += requests;
    }
    totals
}

/// Answers each 8-byte request (a byte count) with that many bytes.
async fn raw_server(listener: TcpListener) {
    let source = Bytes::from(vec![0x5au8; 16 << 20]);
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let source = source.clone();
        tokio::spawn(async move {
            let mut request = [0u8; 8];
            while stream.read_exact(&mut request).await.is_ok() {
                let n = (u64::from_be_bytes(request) as usize).min(source.len());
                if stream.write_all(&source[..n]).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// The contenders, in table order.
const CONTENDERS: [&str; 4] = ["binx", "http", "grpc", "raw"];

type Run = fn(&Bench, usize, usize, Mode, usize) -> (Duration, u64, u64);

fn run_of(name: &str) -> Run {
    match name {
        "binx" => Bench::binx_once,
        "http" => Bench::http_once,
        "grpc" => Bench::grpc_once,
        _ => Bench::raw_once,
    }
}

fn exchange(c: &mut Criterion, bench: &Bench) {
    let cap = cap();
    for mode in modes() {
        for (size, parallels) in cases() {
            let mut group = c.benchmark_group(format!("exchange/{}/{}B", mode.name(), size));
            group.sample_size(10);
            group.warm_up_time(Duration::from_millis(500));
            group.measurement_time(Duration::from_secs(3));
            for parallel in parallels {
                let chunks = chunks_per_buffer(size, parallel, cap);
                group.throughput(Throughput::Bytes((size * chunks * parallel) as u64));
                for name in CONTENDERS {
                    let run = run_of(name);
                    group.bench_with_input(
                        BenchmarkId::new(name, parallel),
                        &parallel,
                        |b, &parallel| {
                            b.iter_custom(|iters| {
                                let mut total = Duration::ZERO;
                                for _ in 0..iters {
                                    let (elapsed, bytes, requests) =
                                        run(bench, size, parallel, mode, chunks);
                                    record((size, parallel, mode, name), bytes, requests, elapsed);
                                    total += elapsed;
                                }
                                total
                            })
                        },
                    );
                }
            }
            group.finish();
        }
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

type Results = BTreeMap<Key, Vec<(f64, f64)>>;

/// Median (bytes/s, requests/s) of one case.
fn medians(results: &Results, key: Key) -> Option<(f64, f64)> {
    let v = results.get(&key)?;
    let bytes = median(&mut v.iter().map(|x| x.0).collect::<Vec<_>>());
    let reqs = median(&mut v.iter().map(|x| x.1).collect::<Vec<_>>());
    Some((bytes, reqs))
}

fn summary(results: &Results) -> String {
    let cap = cap();
    let mut out = String::from(
        "| chunk | parallel | chunks/buffer | mode | BinX MB/s | HTTP MB/s | gRPC MB/s | raw MB/s | BinX/HTTP | BinX/gRPC | BinX/raw | BinX req/s | HTTP req/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for mode in modes() {
        for (size, parallels) in cases() {
            for parallel in parallels {
                let m = |name| medians(results, (size, parallel, mode, name));
                let (Some(binx), Some(http), Some(grpc), Some(raw)) =
                    (m("binx"), m("http"), m("grpc"), m("raw"))
                else {
                    continue;
                };
                out += &format!(
                    "| {} | {parallel} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} |\n",
                    human(size),
                    chunks_per_buffer(size, parallel, cap),
                    mode.name(),
                    binx.0 / 1e6,
                    http.0 / 1e6,
                    grpc.0 / 1e6,
                    raw.0 / 1e6,
                    binx.0 / http.0,
                    binx.0 / grpc.0,
                    binx.0 / raw.0,
                    binx.1,
                    http.1,
                );
            }
        }
    }
    out
}

/// The RFC's figure: BinX's speedup per chunk size and parallelism, over
/// HTTP, gRPC and raw TCP, one chunk per request.
fn draw_heatmaps(results: &Results, path: &std::path::Path) -> std::io::Result<()> {
    let rows: Vec<String> = SIZES.iter().map(|&s| human(s)).collect();
    let cols: Vec<String> = PARALLEL.iter().map(|p| format!("P={p}")).collect();
    let ratio = |other: &'static str| -> Vec<Vec<Option<f64>>> {
        SIZES
            .iter()
            .map(|&size| {
                PARALLEL
                    .iter()
                    .map(|&p| {
                        let binx = medians(results, (size, p, Mode::One, "binx"))?;
                        let base = medians(results, (size, p, Mode::One, other))?;
                        Some(binx.0 / base.0)
                    })
                    .collect()
            })
            .collect()
    };
    let panels = [
        heatmap::Panel {
            title: "BinX / HTTP",
            rows: &rows,
            cols: &cols,
            values: ratio("http"),
        },
        heatmap::Panel {
            title: "BinX / gRPC",
            rows: &rows,
            cols: &cols,
            values: ratio("grpc"),
        },
        heatmap::Panel {
            title: "BinX / raw TCP",
            rows: &rows,
            cols: &cols,
            values: ratio("raw"),
        },
    ];
    heatmap::write_png(
        path,
        "Throughput ratio, one chunk per request, loopback (cargo bench --bench exchange)",
        &panels,
    )
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

fn main() {
    // The server here stands for binxd: malloc keeps freed page memory for
    // reuse as binxd's does at its default memory limit.
    binx_sidecar::allocator::retain_freed_memory(binx_sidecar::allocator::retained_for(1 << 30));
    let bench = Bench::new();
    let mut criterion = Criterion::default().configure_from_args();
    exchange(&mut criterion, &bench);
    criterion.final_summary();
    let results = RESULTS.lock().unwrap();
    let table = summary(&results);
    println!("\nMedian throughput per case (the ratios are the figures):\n\n{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/criterion");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("exchange-summary.md"), &table);
        let png = dir.join("exchange-speedup.png");
        match draw_heatmaps(&results, &png) {
            Ok(()) => println!("heatmap: {}", png.display()),
            Err(e) => eprintln!("cannot draw the heatmap {}: {e}", png.display()),
        }
    }
}
