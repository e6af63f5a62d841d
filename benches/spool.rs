//! Spooling benchmarks, each against a baseline in the same run:
//!
//! - `spool_write/<store>/<variant>`: writing 16 MiB of pages (64 KiB each,
//!   half random and half zeros, so codecs have work) as one segment object
//!   with `Spool::write`, for each codec with encryption off and on, next to
//!   `put`: a plain object_store put of the same bytes, already concatenated,
//!   to the same store. Stores: `file://` in a temp directory and a real S3
//!   protocol server (s3s over s3s-fs) in this process.
//! - `exchange_spool/<mode>`: 64 MiB through a binx exchange in this process
//!   (producer on the Unix socket, then an `ExchangeSource` over TCP),
//!   `memory` with room for everything against `overflow` with a memory
//!   limit of a quarter of it, so three quarters go through the file store.
//! - `commit_finish/<variant>`: how long a task-wide NO_MORE_PAGES under
//!   policy `commit` takes (8 buffers of 10 pages of 10 KB: a Trino task
//!   attempt's `finish()`), against writing the same bytes as 8 files and
//!   a commit file in this process (`files`, Trino's filesystem exchange).
//! - `commit_finish_s3/<variant>`: the same for a task of 50 buffers of one
//!   4 KiB page (a TPC-H sf1 task's shape) into the S3 server, binxd's
//!   default of segment writes at once against 4 a shard.
//!
//! ```text
//! cargo bench --bench spool        # full run, prints the ratio table
//! cargo test --bench spool         # quick mode: each case once, small
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, Endpoint, ExchangeSource, Producer, TaskSpec};
use binx_proto::BufferKind;
use binx_server::{BinxServer, CoreConfig, Exchange, ListenConfig};
use binx_spool::{Codec, Durability, Encryption, Spool, SpoolConfig, SpoolStore, StoreOptions};
use bytes::Bytes;
use criterion::{Criterion, Throughput};

/// What `tests/e2e/s3.rs` needs from the e2e helpers.
mod common {
    use std::path::PathBuf;

    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub(crate) fn new(label: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "binx-bench-{label}-{}-{}",
                std::process::id(),
                fastrand::u64(..)
            ));
            std::fs::create_dir_all(&dir).expect("temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[path = "support/pipeline.rs"]
mod pipeline;
#[allow(dead_code)]
#[path = "../tests/e2e/s3.rs"]
mod s3;

use common::TempDir;

/// Median seconds per case, for the ratio table.
static RESULTS: Mutex<BTreeMap<String, (f64, u64)>> = Mutex::new(BTreeMap::new());

fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn record(case: &str, samples: &mut [f64], bytes: u64) {
    samples.sort_by(f64::total_cmp);
    if let Some(median) = samples.get(samples.len() / 2) {
        RESULTS
            .lock()
            .unwrap()
            .insert(case.to_string(), (*median, bytes));
    }
}

fn pages(total: usize, size: usize) -> Vec<Bytes> {
    let mut rng = fastrand::Rng::with_seed(7);
    (0..total / size)
        .map(|_| {
            let mut page = vec![0u8; size];
            rng.fill(&mut page[..size / 2]);
            Bytes::from(page)
        })
        .collect()
}

fn spool_for(
    url: &str,
    options: &StoreOptions,
    codec: Codec,
    encryption: Encryption,
) -> Arc<Spool> {
    Spool::open(SpoolConfig {
        stores: vec![url.to_string()],
        options: options.clone(),
        node_name: "bench".into(),
        codec,
        encryption,
        segment_max_bytes: 64 << 20,
        ..SpoolConfig::default()
    })
    .unwrap()
}

/// A client's options for the bench's S3 server.
fn s3_options(s3: &s3::S3Server) -> StoreOptions {
    StoreOptions {
        s3_endpoint: Some(format!("http://{}", s3.addr)),
        s3_region: Some("us-east-1".into()),
        s3_access_key_id: Some(s3::ACCESS_KEY.into()),
        s3_secret_access_key: Some(s3::SECRET_KEY.into()),
        allow_http: true,
        request_timeout: Duration::from_secs(30),
    }
}

fn spool_write(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let total = if full_run() { 16 << 20 } else { 2 << 20 };
    let pages = pages(total, 64 << 10);
    let joined: Bytes = pages.concat().into();
    let dir = TempDir::new("spool");
    let s3 = s3::S3Server::start();
    let s3_options = s3_options(&s3);
    let stores = [
        (
            "file",
            format!("file://{}", dir.0.display()),
            StoreOptions::default(),
        ),
        ("s3", format!("s3://{}/bench", s3::BUCKET), s3_options),
    ];
    let variants = [
        ("none", Codec::None, Encryption::Off),
        ("lz4", Codec::Lz4, Encryption::Off),
        ("zstd", Codec::Zstd, Encryption::Off),
        ("none+aes", Codec::None, Encryption::On),
        ("lz4+aes", Codec::Lz4, Encryption::On),
    ];
    for (store_name, url, options) in &stores {
        let mut group = c.benchmark_group(format!("spool_write/{store_name}"));
        group.throughput(Throughput::Bytes(total as u64));
        group.sample_size(10);
        let store = SpoolStore::from_url(url, options).unwrap();
        let case = format!("spool_write/{store_name}/put");
        let mut samples = Vec::new();
        group.bench_function("put", |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for i in 0..iters {
                    let name = format!("put-{i}");
                    let start = Instant::now();
                    runtime.block_on(store.put(&name, joined.clone())).unwrap();
                    let took = start.elapsed();
                    spent += took;
                    samples.push(took.as_secs_f64());
                    runtime.block_on(store.delete(&name)).unwrap();
                }
                spent
            })
        });
        record(&case, &mut samples, total as u64);
        for (variant, codec, encryption) in variants {
            let spool = spool_for(url, options, codec, encryption);
            let case = format!("spool_write/{store_name}/{variant}");
            let mut samples = Vec::new();
            group.bench_function(variant, |b| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let batch = pages.clone();
                        let start = Instant::now();
                        let object = runtime
                            .block_on(spool.write("bench", 0, batch, Durability::Overflow))
                            .unwrap();
                        let took = start.elapsed();
                        spent += took;
                        samples.push(took.as_secs_f64());
                        runtime.block_on(spool.delete(&object)).unwrap();
                    }
                    spent
                })
            });
            record(&case, &mut samples, total as u64);
        }
        group.finish();
    }
}

/// One exchange: every page produced over the Unix socket, then read to the
/// end over TCP.
async fn exchange_once(
    uds: &std::path::Path,
    tcp: &str,
    task: &str,
    policy: &str,
    pages: &[Bytes],
) {
    let producer = Producer::new(Connection::new(
        Endpoint::Unix(uds.to_path_buf()),
        ConnectionOptions::default(),
    ));
    producer
        .open_task(
            task,
            &TaskSpec {
                kind: BufferKind::Partitioned,
                buffer_count: 1,
                spool_policy: policy.into(),
            },
        )
        .await
        .unwrap();
    for batch in pages.chunks(16) {
        producer.enqueue(task, 0, batch).await.unwrap();
    }
    producer.no_more_pages(task, Some(0)).await.unwrap();
    let mut source = ExchangeSource::new(
        Connection::new(Endpoint::Tcp(tcp.to_string()), ConnectionOptions::default()),
        task,
        0,
        pipeline::source_config(),
    );
    let mut n = 0;
    while let Some(page) = source.next_page().await.unwrap() {
        assert_eq!(page.data.len(), pages[n].len());
        n += 1;
    }
    assert_eq!(n, pages.len());
}

fn exchange_spool(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let total: usize = if full_run() { 64 << 20 } else { 8 << 20 };
    let pages = pages(total, 64 << 10);
    let mut group = c.benchmark_group("exchange_spool");
    group.throughput(Throughput::Bytes(total as u64));
    group.sample_size(10);
    for (mode, limit) in [("memory", 4 * total as u64), ("overflow", total as u64 / 4)] {
        let dir = TempDir::new("exchange");
        let spool = spool_for(
            &format!("file://{}", dir.0.join("spool").display()),
            &StoreOptions::default(),
            Codec::None,
            Encryption::Off,
        );
        let exchange = Exchange::with_spool(
            CoreConfig {
                memory_limit: limit,
                task_memory_limit: limit,
                ..CoreConfig::default()
            },
            Some(spool.clone()),
        );
        let uds: PathBuf = dir.0.join("binx.sock");
        let tcp = runtime.block_on(async {
            // Both run until the process ends.
            drop(exchange.spawn_driver());
            let server = BinxServer::bind(
                exchange.clone(),
                ListenConfig {
                    tcp: Some("127.0.0.1:0".into()),
                    uds: Some(uds.clone()),
                    max_connections: 64,
                    ..ListenConfig::default()
                },
            )
            .await
            .unwrap();
            let tcp = server.tcp_addr().unwrap().to_string();
            tokio::spawn(server.run(std::future::pending()));
            tcp
        });
        let case = format!("exchange_spool/{mode}");
        let mut samples = Vec::new();
        let mut serial = 0u64;
        let policy = if mode == "memory" { "off" } else { "overflow" };
        group.bench_function(mode, |b| {
            b.iter_custom(|iters| {
                timed_runs(iters, &mut serial, &mut samples, |serial| {
                    let task = format!("{mode}-{serial}");
                    let start = Instant::now();
                    runtime.block_on(exchange_once(&uds, &tcp, &task, policy, &pages));
                    start.elapsed()
                })
            })
        });
        let measured = !samples.is_empty();
        record(&case, &mut samples, total as u64);
        if mode == "overflow" && measured {
            let spilled = exchange.stats().manager.pages_spilled;
            assert!(spilled > 0, "the overflow runs spilled nothing");
        }
    }
    group.finish();
}

/// Buffers, pages per buffer and page size of one `commit_finish` task:
/// a Trino task attempt's output on TPC-H at sf1 is of this order.
const COMMIT_BUFFERS: usize = 8;
const COMMIT_PAGES: usize = 10;
const COMMIT_PAGE_BYTES: usize = 10_000;

/// What the filesystem exchange does when a sink finishes: each
/// partition's pages into a file of its own, then a commit file; in this
/// process, on one blocking thread, into the same kind of directory.
fn finish_as_files(dir: &std::path::Path, pages: &[Bytes]) {
    use std::io::Write;
    std::fs::create_dir_all(dir).unwrap();
    for p in 0..COMMIT_BUFFERS {
        let mut file = std::fs::File::create(dir.join(format!("{p}.data"))).unwrap();
        for page in pages {
            file.write_all(page).unwrap();
        }
    }
    std::fs::write(dir.join("committed"), b"").unwrap();
}

/// `commit_finish/<variant>`: the time from a task's last ENQUEUE reply to
/// the OK of its task-wide NO_MORE_PAGES under policy `commit` (every
/// buffer's pages written, its marker, the task's manifest), which a Trino
/// sink's `finish()` waits for; against writing the same bytes as files in
/// this process (`files`), as Trino's filesystem exchange does. The
/// exchange has binxd's shards and, for this machine, its default of
/// segment writes in flight (`binxd`: 16 a shard since 2026-11-30, 4
/// before), or one a shard
/// (`one-write-a-shard`, binxd's default before 2026-11-29).
fn commit_finish(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let pages = pages(COMMIT_PAGES * COMMIT_PAGE_BYTES, COMMIT_PAGE_BYTES);
    let total = (COMMIT_BUFFERS * COMMIT_PAGES * COMMIT_PAGE_BYTES) as u64;
    let mut group = c.benchmark_group("commit_finish");
    group.throughput(Throughput::Bytes(total));
    group.sample_size(if full_run() { 50 } else { 10 });
    let dir = TempDir::new("commit");
    let mut samples = Vec::new();
    let mut serial = 0u64;
    group.bench_function("files", |b| {
        b.iter_custom(|iters| {
            timed_runs(iters, &mut serial, &mut samples, |serial| {
                let attempt = dir.0.join(format!("files-{serial}"));
                let batch = pages.clone();
                let start = Instant::now();
                let written = attempt.clone();
                let write = runtime.spawn_blocking(move || finish_as_files(&written, &batch));
                runtime.block_on(write).unwrap();
                let took = start.elapsed();
                std::fs::remove_dir_all(&attempt).unwrap();
                took
            })
        })
    });
    record("commit_finish/files", &mut samples, total);
    let shards = std::thread::available_parallelism().map_or(1, |n| n.get());
    let task = CommitShape {
        buffers: COMMIT_BUFFERS,
        pages: pages.clone(),
    };
    let variants = [
        ("binxd", binx_core::config::AUTO_SPILL_CONCURRENCY),
        ("one-write-a-shard", shards),
    ];
    commit_variants(
        "commit_finish",
        &mut group,
        runtime,
        &dir,
        &variants,
        &task,
        |variant| {
            let url = format!("file://{}", dir.0.join(variant).display());
            (url, StoreOptions::default())
        },
    );
    group.finish();
}

/// Buffers of a `commit_finish_s3` task: Trino's default output partition
/// count under fault-tolerant execution, and the width of a TPC-H sf1
/// task's output (each buffer a page of 4 KiB).
const WIDE_COMMIT_BUFFERS: usize = 50;

/// `commit_finish_s3/<variant>`: the same NO_MORE_PAGES for a task of 50
/// buffers of one 4 KiB page each (a TPC-H sf1 task's shape), into an S3
/// store (s3s on loopback: each PUT is a round trip), where the segment
/// writes a shard starts at once decide how many round trips a commit
/// waits for: binxd's default (`binxd`) against 4 a shard
/// (`four-writes-a-shard`, the default before 2026-11-30).
fn commit_finish_s3(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let page = pages(4096, 4096);
    let total = (WIDE_COMMIT_BUFFERS * 4096) as u64;
    let mut group = c.benchmark_group("commit_finish_s3");
    group.throughput(Throughput::Bytes(total));
    group.sample_size(if full_run() { 30 } else { 10 });
    let dir = TempDir::new("commit-s3");
    let s3 = s3::S3Server::start();
    let shards = std::thread::available_parallelism().map_or(1, |n| n.get());
    let task = CommitShape {
        buffers: WIDE_COMMIT_BUFFERS,
        pages: page,
    };
    let variants = [
        ("binxd", binx_core::config::AUTO_SPILL_CONCURRENCY),
        ("four-writes-a-shard", 4 * shards),
    ];
    commit_variants(
        "commit_finish_s3",
        &mut group,
        runtime,
        &dir,
        &variants,
        &task,
        |variant| (format!("s3://{}/{variant}", s3::BUCKET), s3_options(&s3)),
    );
    group.finish();
}

/// Each variant (a name and its segment writes at once) of a commit group:
/// measured over a spool on `store(variant)` (its URL and options) and
/// recorded as `<group>/<variant>`.
fn commit_variants(
    name: &str,
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    runtime: &tokio::runtime::Runtime,
    dir: &TempDir,
    variants: &[(&str, usize)],
    task: &CommitShape,
    store: impl Fn(&str) -> (String, StoreOptions),
) {
    let total: u64 = task.pages.iter().map(|p| p.len() as u64).sum::<u64>() * task.buffers as u64;
    for &(variant, spill_concurrency) in variants {
        let (url, options) = store(variant);
        let spool = spool_for(&url, &options, Codec::None, Encryption::Off);
        let mut samples =
            measure_commit(group, runtime, dir, variant, spool, spill_concurrency, task);
        record(&format!("{name}/{variant}"), &mut samples, total);
    }
}

/// Criterion's `iters` runs of `one`, each given the next of a serial that
/// counts up over the whole case and timed by what it returns (kept in
/// `samples` for the ratio table); their sum.
fn timed_runs(
    iters: u64,
    serial: &mut u64,
    samples: &mut Vec<f64>,
    mut one: impl FnMut(u64) -> Duration,
) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..iters {
        *serial += 1;
        let took = one(*serial);
        spent += took;
        samples.push(took.as_secs_f64());
    }
    spent
}

/// What one measured commit writes: every buffer gets `pages`.
struct CommitShape {
    buffers: usize,
    pages: Vec<Bytes>,
}

/// Times a task-wide NO_MORE_PAGES under policy `commit` of `task`, on an
/// exchange with binxd's shards over `spool` (its segment writes at once
/// `spill_concurrency`), through a real Unix socket: one sample a task.
fn measure_commit(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    runtime: &tokio::runtime::Runtime,
    dir: &TempDir,
    variant: &str,
    spool: Arc<Spool>,
    spill_concurrency: usize,
    task: &CommitShape,
) -> Vec<f64> {
    let shards = std::thread::available_parallelism().map_or(1, |n| n.get());
    let exchange = Exchange::sharded(
        CoreConfig {
            spool: Some(binx_core::config::SpoolRules {
                spill_concurrency,
                ..Default::default()
            }),
            ..CoreConfig::default()
        },
        Some(spool),
        shards,
    );
    let uds: PathBuf = dir.0.join(format!("{variant}.sock"));
    runtime.block_on(async {
        drop(exchange.spawn_driver());
        let server = BinxServer::bind(
            exchange.clone(),
            ListenConfig {
                uds: Some(uds.clone()),
                max_connections: 64,
                ..ListenConfig::default()
            },
        )
        .await
        .unwrap();
        tokio::spawn(server.run(std::future::pending()));
    });
    let producer = Producer::new(Connection::new(
        Endpoint::Unix(uds.clone()),
        ConnectionOptions::default(),
    ));
    let mut samples = Vec::new();
    let mut serial = 0u64;
    group.bench_function(variant, |b| {
        b.iter_custom(|iters| {
            timed_runs(iters, &mut serial, &mut samples, |serial| {
                let id = format!("{variant}-{serial}");
                runtime.block_on(async {
                    producer
                        .open_task(
                            &id,
                            &TaskSpec {
                                kind: BufferKind::Partitioned,
                                buffer_count: task.buffers as u64,
                                spool_policy: "commit".into(),
                            },
                        )
                        .await
                        .unwrap();
                    for buffer in 0..task.buffers as u64 {
                        producer.enqueue(&id, buffer, &task.pages).await.unwrap();
                    }
                    let start = Instant::now();
                    producer.no_more_pages(&id, None).await.unwrap();
                    let took = start.elapsed();
                    producer.abort(&id, "measured").await.unwrap();
                    took
                })
            })
        })
    });
    samples
}

fn summary() -> String {
    let results = RESULTS.lock().unwrap();
    let mut out = String::from("| case | MB/s | ratio | against |\n|---|---|---|---|\n");
    for (case, (secs, bytes)) in results.iter() {
        let mbps = *bytes as f64 / secs / 1e6;
        let (base, against) = match case.rsplit_once('/') {
            Some((group, _)) if group.starts_with("spool_write") => {
                (format!("{group}/put"), "plain put")
            }
            Some(("exchange_spool", _)) => ("exchange_spool/memory".to_string(), "memory only"),
            Some(("commit_finish", _)) => ("commit_finish/files".to_string(), "files in process"),
            Some(("commit_finish_s3", _)) => (
                "commit_finish_s3/four-writes-a-shard".to_string(),
                "4 writes a shard",
            ),
            _ => (case.clone(), ""),
        };
        let ratio = results
            .get(&base)
            .map(|(base_secs, _)| format!("{:.2}", base_secs / secs))
            .unwrap_or_default();
        out.push_str(&format!("| {case} | {mbps:.0} | {ratio} | {against} |\n"));
    }
    out
}

fn main() {
    // The spool and exchange here stand for binxd's: malloc keeps freed
    // memory for reuse as binxd's does at its default memory limit.
    binx_sidecar::allocator::retain_freed_memory(binx_sidecar::allocator::retained_for(1 << 30));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut criterion = Criterion::default().configure_from_args();
    spool_write(&mut criterion, &runtime);
    exchange_spool(&mut criterion, &runtime);
    commit_finish(&mut criterion, &runtime);
    commit_finish_s3(&mut criterion, &runtime);
    criterion.final_summary();
    println!(
        "\nMedian throughput per case (the ratios are the figures):\n\n{}",
        summary()
    );
}
