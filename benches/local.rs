//! Engine to sidecar on one machine: plain Unix socket frames, shared memory
//! (docs/PROTOCOL.md section 6), and a tonic gRPC server-streaming service
//! over the same kind of Unix socket (the Arrow Flight shared-memory
//! prototype's baseline), same buffer manager, same run.
//!
//! The sidecar (the real binx-server listener, with shared memory on) runs on
//! a runtime of its own with one thread, the engine (binx-client) on
//! another, so each has a core, as two processes would.
//!
//! - Throughput: the engine reads a buffer of 128 KiB pages (32 MiB) or 32 B
//!   pages (4096) to its end with `ExchangeSource` (gRPC: one Fetch call,
//!   one message per page).
//! - Round trip: one DATA request for one page and its reply (gRPC: one
//!   Fetch call of a one-page buffer), timed one by one for p50 and p99.
//!
//! Commands:
//!
//!     cargo bench --bench local          # full run, prints the table
//!     cargo test --bench local           # quick mode: each case once, small
//!     BINX_BENCH_PIPELINE_DEPTH=1 cargo bench --bench local   # one DATA at a time
//!
//! The table (MB/s, p50, p99, and the shared memory / UDS and shared memory
//! / gRPC ratios) is printed and written to target/criterion/local-summary.md.

#[path = "support/grpc_pages.rs"]
mod grpc_pages;
#[path = "support/pipeline.rs"]
mod pipeline;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, Endpoint, ExchangeSource};
use binx_proto::{ALL_BUFFERS, BinRequest, BufferKind, MessageType};
use binx_server::{BinxServer, ConnectionConfig, CoreConfig, Exchange, ListenConfig};
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use tokio::runtime::Runtime;

const SIZES: [usize; 2] = [128 << 10, 32];
const TRANSPORTS: [&str; 3] = ["uds", "shm", "grpc"];
/// Round trips also through shared memory without spinning: every message
/// wakes a sleeping thread on the other core through its eventfd, which
/// measures what a wake-up costs here.
const LATENCY_TRANSPORTS: [&str; 4] = ["uds", "shm", "shm-park", "grpc"];

fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Bytes per throughput iteration.
fn buffer_bytes() -> usize {
    if full_run() { 32 << 20 } else { 1 << 20 }
}

fn pages_per_buffer(size: usize) -> usize {
    (buffer_bytes() / size).clamp(16, 4096)
}

/// A case: transport and page size.
type Case = (&'static str, usize);

/// MB/s samples per case.
static THROUGHPUT: Mutex<BTreeMap<Case, Vec<f64>>> = Mutex::new(BTreeMap::new());
/// (p50, p99) in microseconds per case.
static LATENCY: Mutex<BTreeMap<Case, (f64, f64)>> = Mutex::new(BTreeMap::new());

struct Bench {
    sidecar: Runtime,
    engine: Runtime,
    exchange: Exchange,
    uds: Connection,
    shm: Connection,
    /// Shared memory with `spin` 0 on both sides, to its own listener.
    park: Connection,
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
    pages: BTreeMap<usize, Bytes>,
    next_task: AtomicU64,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn runtime(name: &str) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

impl Bench {
    fn new() -> Bench {
        let dir =
            TempDir(std::env::temp_dir().join(format!("binx-bench-local-{}", std::process::id())));
        std::fs::create_dir_all(&dir.0).unwrap();
        let socket = dir.0.join("binx.sock");
        let grpc_socket = dir.0.join("grpc.sock");
        let park_socket = dir.0.join("park.sock");
        let sidecar = runtime("sidecar");
        let engine = runtime("engine");
        let exchange = Exchange::new(CoreConfig {
            memory_limit: u64::MAX / 4,
            task_memory_limit: u64::MAX / 4,
            ..CoreConfig::default()
        });
        sidecar.block_on(async {
            // Runs until the process ends.
            drop(exchange.spawn_driver());
            for (path, spin) in [
                (&socket, binx_shm::ShmConfig::default().spin),
                (&park_socket, Duration::ZERO),
            ] {
                let server = BinxServer::bind(
                    exchange.clone(),
                    ListenConfig {
                        tcp: None,
                        uds: Some(path.clone()),
                        max_connections: 64,
                        connection: ConnectionConfig {
                            shm: Some(binx_shm::ShmConfig {
                                spin,
                                slot_size: std::env::var("BINX_BENCH_SHM_SLOT")
                                    .ok()
                                    .and_then(|s| s.parse().ok())
                                    .unwrap_or(binx_shm::ShmConfig::default().slot_size),
                                ..binx_shm::ShmConfig::default()
                            }),
                            ..ConnectionConfig::default()
                        },
                        ..ListenConfig::default()
                    },
                )
                .await
                .unwrap();
                tokio::spawn(server.run(std::future::pending()));
            }
            let grpc = tokio::net::UnixListener::bind(&grpc_socket).unwrap();
            tokio::spawn(grpc_pages::serve_unix(
                grpc,
                grpc_pages::PagesService {
                    exchange: exchange.clone(),
                },
            ));
        });
        let endpoint = Endpoint::Unix(socket);
        let uds = Connection::new(endpoint.clone(), ConnectionOptions::default());
        let shm = Connection::new(
            endpoint,
            ConnectionOptions {
                shared_memory: true,
                ..ConnectionOptions::default()
            },
        );
        let park = Connection::new(
            Endpoint::Unix(park_socket),
            ConnectionOptions {
                shared_memory: true,
                shm_spin: Duration::ZERO,
                ..ConnectionOptions::default()
            },
        );
        let grpc = engine.block_on(async {
            uds.ping().await.unwrap();
            shm.ping().await.unwrap();
            park.ping().await.unwrap();
            grpc_pages::client_unix(&grpc_socket).await
        });
        Bench {
            sidecar,
            engine,
            exchange,
            uds,
            shm,
            park,
            grpc,
            pages: SIZES
                .iter()
                .map(|&s| (s, Bytes::from(vec![0x5au8; s])))
                .collect(),
            next_task: AtomicU64::new(0),
            _dir: dir,
        }
    }

    fn request(kind: MessageType, task: &str, buffer: u64) -> BinRequest {
        let mut r = BinRequest::new(kind);
        r.task_id = task.to_string();
        r.buffer_id = buffer;
        r
    }

    /// A new one-buffer task holding `count` pages of `size` (in memory;
    /// not timed). The sidecar frees the pages as they are acknowledged,
    /// within the timed read, as binxd does (malloc giving the heap back:
    /// up to a third of the sidecar thread's time in a profile, for every
    /// transport alike).
    fn fill(&self, size: usize, count: usize) -> String {
        let task = format!("local.{}", self.next_task.fetch_add(1, Ordering::Relaxed));
        let mut open = Bench::request(MessageType::OpenTask, &task, 0);
        open.buffer_kind = BufferKind::Partitioned as i32;
        open.buffer_count = 1;
        self.exchange
            .try_handle_wire(&open, Bytes::new())
            .expect("answered at once");
        let page = self.pages[&size].clone();
        // Each page distinct memory, arriving as an engine sends them: in
        // ENQUEUEs of about 1 MiB. (One 32 MiB body would be mapped and
        // unmapped by malloc on its own; its munmap, when the last page is
        // acknowledged, cost the sidecar thread nearly as much as copying
        // the pages.)
        let per_enqueue = ((1 << 20) / size).clamp(1, count);
        let mut left = count;
        while left > 0 {
            let n = per_enqueue.min(left);
            let mut enqueue = Bench::request(MessageType::Enqueue, &task, 0);
            enqueue.page_sizes = vec![size as u64; n];
            self.exchange
                .try_handle_wire(&enqueue, Bytes::from(page.repeat(n)))
                .expect("answered at once");
            left -= n;
        }
        let finish = Bench::request(MessageType::NoMorePages, &task, ALL_BUFFERS);
        self.exchange
            .try_handle_wire(&finish, Bytes::new())
            .expect("answered at once");
        task
    }

    fn connection(&self, transport: &str) -> &Connection {
        match transport {
            "shm" => &self.shm,
            "shm-park" => &self.park,
            _ => &self.uds,
        }
    }

    /// Runs `work` as a task on the engine's runtime, beside the
    /// connection's own tasks, as an engine on tokio would (not on the
    /// bench's main thread, which would add a thread hop per reply).
    fn on_engine<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        self.engine
            .block_on(self.engine.spawn(work))
            .expect("engine task")
    }

    /// Reads a whole buffer; returns the bytes read.
    fn read_buffer(&self, transport: &str, task: String) -> u64 {
        if transport == "grpc" {
            let grpc = self.grpc.clone();
            return self.on_engine(async move { grpc_pages::fetch(grpc, task, 0).await.0 });
        }
        let connection = self.connection(transport).clone();
        self.on_engine(async move {
            let mut source = ExchangeSource::new(connection, &task, 0, pipeline::source_config());
            let mut bytes = 0;
            while let Some(page) = source.next_page().await.expect("source") {
                bytes += page.data.len() as u64;
            }
            bytes
        })
    }

    /// Times `rounds` single-page round trips; returns (p50, p99) in µs.
    fn round_trips(&self, transport: &str, size: usize, rounds: usize) -> (f64, f64) {
        let mut samples = Vec::with_capacity(rounds);
        if transport == "grpc" {
            for _ in 0..rounds {
                let task = self.fill(size, 1);
                let grpc = self.grpc.clone();
                let (bytes, elapsed) = self.on_engine(async move {
                    let start = Instant::now();
                    let (bytes, _) = grpc_pages::fetch(grpc, task, 0).await;
                    (bytes, start.elapsed())
                });
                samples.push(elapsed);
                assert_eq!(bytes, size as u64);
            }
        } else {
            let task = self.fill(size, rounds);
            let connection = self.connection(transport).clone();
            samples = self.on_engine(async move {
                let mut samples = Vec::with_capacity(rounds);
                for token in 0..rounds as u64 {
                    let mut data = Bench::request(MessageType::Data, &task, 0);
                    data.page_token = token;
                    data.max_size_bytes = size as u64;
                    let start = Instant::now();
                    let reply = connection.request(data, Vec::new()).await.unwrap();
                    samples.push(start.elapsed());
                    assert_eq!(reply.body.len(), size);
                }
                samples
            });
        }
        samples.sort();
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
        (at(0.50), at(0.99))
    }
}

fn throughput(c: &mut Criterion, bench: &Bench) {
    let mut group = c.benchmark_group("local_throughput");
    if !full_run() {
        group.sample_size(10);
    }
    for size in SIZES {
        let count = pages_per_buffer(size);
        group.throughput(Throughput::Bytes((size * count) as u64));
        for transport in TRANSPORTS {
            group.bench_function(BenchmarkId::new(transport, size), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let task = bench.fill(size, count);
                        let start = Instant::now();
                        let bytes = bench.read_buffer(transport, task);
                        let elapsed = start.elapsed();
                        assert_eq!(bytes, (size * count) as u64, "{transport} lost bytes");
                        total += elapsed;
                        THROUGHPUT
                            .lock()
                            .unwrap()
                            .entry((transport, size))
                            .or_default()
                            .push(bytes as f64 / elapsed.as_secs_f64() / 1e6);
                    }
                    total
                });
            });
        }
    }
    group.finish();
}

fn latency(bench: &Bench) {
    // BINX_BENCH_LATENCY=0 leaves it out (to profile the throughput cases).
    if std::env::var("BINX_BENCH_LATENCY").as_deref() == Ok("0") {
        return;
    }
    let rounds = if full_run() { 5000 } else { 20 };
    for size in SIZES {
        for transport in LATENCY_TRANSPORTS {
            // Warm up the connection and the slots first.
            bench.round_trips(transport, size, rounds.min(100));
            let p = bench.round_trips(transport, size, rounds);
            LATENCY.lock().unwrap().insert((transport, size), p);
        }
    }
}

fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

fn summary() -> String {
    let throughput = THROUGHPUT.lock().unwrap();
    let latency = LATENCY.lock().unwrap();
    let mbps =
        |t: &'static str, size: usize| throughput.get(&(t, size)).map(|s| median(s)).unwrap_or(0.0);
    let mut out = String::from(
        "| page | transport | MB/s (median) | round trip p50 µs | p99 µs |\n|---|---|---|---|---|\n",
    );
    for size in SIZES {
        for transport in LATENCY_TRANSPORTS {
            let (p50, p99) = latency.get(&(transport, size)).copied().unwrap_or_default();
            let rate = mbps(transport, size);
            let rate = if rate > 0.0 {
                format!("{rate:.0}")
            } else {
                "-".to_string()
            };
            out.push_str(&format!(
                "| {size} B | {transport} | {rate} | {p50:.1} | {p99:.1} |\n"
            ));
        }
    }
    out.push_str(
        "\n| page | shm / uds MB/s | shm / grpc MB/s | shm p50 / uds p50 | two wake-ups (shm-park p50 - shm p50) |\n|---|---|---|---|---|\n",
    );
    for size in SIZES {
        let p50 = |t: &'static str| latency.get(&(t, size)).map(|l| l.0).unwrap_or(0.0);
        out.push_str(&format!(
            "| {size} B | {:.2} | {:.2} | {:.2} | {:.1} µs |\n",
            mbps("shm", size) / mbps("uds", size),
            mbps("shm", size) / mbps("grpc", size),
            p50("shm") / p50("uds"),
            p50("shm-park") - p50("shm"),
        ));
    }
    out
}

fn main() {
    // The sidecar here stands for binxd: malloc keeps freed page memory for
    // reuse as binxd's does at its default memory limit.
    binx_sidecar::allocator::retain_freed_memory(binx_sidecar::allocator::retained_for(1 << 30));
    let bench = Bench::new();
    let mut criterion = Criterion::default().configure_from_args();
    throughput(&mut criterion, &bench);
    latency(&bench);
    criterion.final_summary();
    let table = summary();
    println!("\nEngine to sidecar on this machine (ratios in the second table):\n\n{table}");
    let _ = std::fs::create_dir_all("target/criterion");
    let _ = std::fs::write("target/criterion/local-summary.md", &table);
    drop(bench.sidecar);
}
