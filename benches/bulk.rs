//! Bulk reads of one buffer, each case against a baseline from
//! the same run:
//!
//! - `bulk/<page>/raw`: the baseline, one plain TCP stream moving the same
//!   bytes the way iperf3 does (`-l 1M`): the sender writes 1 MiB at a time
//!   from a buffer it reuses, the receiver reads 1 MiB at a time into one.
//!   Both buffers stay in the CPU's caches.
//! - `bulk/<page>/raw-cold`: the same stream, but the sender writes the
//!   pages themselves (1 GiB, from memory, as binxd must) and the receiver
//!   reads into a 64 MiB region in turn (as a consumer holding its pages
//!   must): what the memory system allows one stream here.
//! - `bulk/<page>/binx-<reply>`: one buffer of `<page>` pages read to its end
//!   with `ExchangeSource` over TCP from binxd running as a separate process,
//!   asking for replies of up to `<reply>` (`default` is
//!   `SourceConfig::default()`), with DATA pipelined (the default); the
//!   buffer is filled over the Unix socket before the clock starts.
//! - `bulk/<page>/binx-unpipelined`: the default with one DATA at a time
//!   (`pipeline_depth` 1), as before pipelined DATA.
//! - `bulk/<page>/binx-one-stripe`: the default over one TCP socket, as
//!   before striped connections (the default spreads DATA over one socket
//!   per two cores, at most 8: on 2 cores the same as this).
//! - `bulk/<page>/tls-default`: the same through binxd's TLS listener
//!   (rustls; this kernel offers no kernel TLS), against `binx-default`.
//!
//! ```text
//! cargo bench --bench bulk          # 1 GiB per read, prints the ratio table
//! cargo test --bench bulk           # quick mode: 32 MiB, each case once
//! ```
//!
//! The table is printed and written to target/criterion/bulk-summary.md.

#[allow(dead_code)]
#[path = "../tests/e2e/common.rs"]
mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, ExchangeSource, SourceConfig, tls};
use bytes::Bytes;
use common::{Daemon, TempDir};
use criterion::{Criterion, SamplingMode, Throughput};
use rcgen::{CertificateParams, KeyPair};

const PAGE_SIZES: [usize; 2] = [128 << 10, 1 << 20];
/// Reply sizes asked for besides the default: 1 MiB was the default once.
const REPLY_SIZES: [u64; 3] = [1 << 20, 4 << 20, 16 << 20];

fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn total_bytes() -> usize {
    if full_run() { 1 << 30 } else { 32 << 20 }
}

fn label(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

/// The raw baseline: `total` bytes over one loopback TCP stream, 1 MiB per
/// write and per read.
fn raw_stream(total: usize, source: Option<Arc<Vec<u8>>>, receive_window: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let sender = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let chunk = vec![7u8; 1 << 20];
        let mut sent = 0;
        while sent < total {
            let n = (total - sent).min(chunk.len());
            let bytes = match &source {
                Some(source) => &source[sent..sent + n],
                None => &chunk[..n],
            };
            stream.write_all(bytes).expect("raw write");
            sent += n;
        }
    });
    let mut stream = TcpStream::connect(addr).expect("connect");
    let mut buffer = vec![0u8; receive_window];
    let start = Instant::now();
    let mut read = 0;
    while read < total {
        let at = read % receive_window;
        let end = (at + (1 << 20)).min(receive_window);
        let n = stream.read(&mut buffer[at..end]).expect("raw read");
        assert!(n > 0, "raw stream ended after {read} of {total} bytes");
        read += n;
    }
    let took = start.elapsed();
    sender.join().expect("sender");
    took
}

/// A CA and a certificate for 127.0.0.1 signed by it, as PEM files.
fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("params")
        .signed_by(&key, &ca, &ca_key)
        .expect("certificate");
    let files = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&files.0, ca.pem()).expect("write");
    std::fs::write(&files.1, cert.pem()).expect("write");
    std::fs::write(&files.2, key.serialize_pem()).expect("write");
    files
}

fn start_binxd(extra: &[&str]) -> Daemon {
    let mut flags = vec![
        "--memory-limit",
        "3GiB",
        "--task-memory-limit",
        "3GiB",
        "--default-spool-policy",
        "off",
        "--shm-enabled",
        "false",
    ];
    flags.extend_from_slice(extra);
    Daemon::start(&flags)
}

/// Fills one buffer of `task` with `pages` (not timed).
async fn fill(daemon: &Daemon, task: &str, pages: &[Bytes]) {
    let producer = daemon.producer(task, 1).await;
    let per_enqueue = (16 << 20) / pages[0].len();
    for batch in pages.chunks(per_enqueue.max(1)) {
        producer.enqueue(task, 0, batch).await.expect("ENQUEUE");
    }
    producer
        .no_more_pages(task, None)
        .await
        .expect("NO_MORE_PAGES");
}

/// Reads the buffer to its end; checks every page arrived in order.
async fn read(connection: Connection, task: &str, config: SourceConfig, pages: &[Bytes]) {
    let mut source = ExchangeSource::new(connection, task, 0, config);
    let mut n = 0;
    while let Some(page) = source.next_page().await.expect("next page") {
        assert_eq!(page.token, n as u64);
        assert_eq!(page.data.len(), pages[n].len());
        n += 1;
    }
    assert_eq!(n, pages.len(), "short read");
}

struct Target<'a> {
    daemon: &'a Daemon,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// The connection's sockets; `None` keeps the client's default.
    stripes: Option<usize>,
}

fn bulk(c: &mut Criterion, runtime: &tokio::runtime::Runtime, results: &mut Results) {
    let total = total_bytes();
    let dir = TempDir::new("bulk-pki");
    let (ca, cert, key) = certificates(&dir.0);
    let plain = start_binxd(&[]);
    let secure = start_binxd(&[
        "--tls-cert",
        cert.to_str().expect("path"),
        "--tls-key",
        key.to_str().expect("path"),
    ]);
    let client_tls = tls::client_config(&ca, None).expect("client TLS");
    let mut serial = 0u64;
    for page in PAGE_SIZES {
        let pages: Vec<Bytes> = (0..total / page)
            .map(|i| Bytes::from(vec![i as u8; page]))
            .collect();
        let mut group = c.benchmark_group(format!("bulk/{}", label(page as u64)));
        group.throughput(Throughput::Bytes(total as u64));
        group.sample_size(10);
        group.sampling_mode(SamplingMode::Flat);
        group.warm_up_time(Duration::from_millis(1));
        group.measurement_time(Duration::from_secs(1));

        let cold: Arc<Vec<u8>> = Arc::new(pages.concat());
        for (name, source, window) in [
            ("raw", None, 1 << 20),
            ("raw-cold", Some(cold.clone()), 64 << 20),
        ] {
            let case = format!("{}/{name}", label(page as u64));
            group.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let took = raw_stream(total, source.clone(), window);
                        results.sample(&case, took, total);
                        spent += took;
                    }
                    spent
                })
            });
        }
        drop(cold);

        let mut variants: Vec<(String, Target, SourceConfig)> = REPLY_SIZES
            .iter()
            .map(|&reply| {
                (
                    format!("binx-{}", label(reply)),
                    Target {
                        daemon: &plain,
                        tls: None,
                        stripes: None,
                    },
                    SourceConfig {
                        max_reply_size: reply,
                        ..SourceConfig::default()
                    },
                )
            })
            .collect();
        let depth = SourceConfig::default().pipeline_depth;
        for (name, tls, pipeline_depth, stripes) in [
            ("binx-default", None, depth, None),
            // One DATA at a time, as before pipelined DATA.
            ("binx-unpipelined", None, 1, None),
            // One socket, as before striped connections.
            ("binx-one-stripe", None, depth, Some(1)),
            ("tls-default", Some(client_tls.clone()), depth, None),
        ] {
            let daemon = if tls.is_some() { &secure } else { &plain };
            let config = SourceConfig {
                pipeline_depth,
                ..SourceConfig::default()
            };
            let target = Target {
                daemon,
                tls,
                stripes,
            };
            variants.push((name.into(), target, config));
        }
        for (name, target, config) in &variants {
            let case = format!("{}/{name}", label(page as u64));
            group.bench_function(name.as_str(), |b| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        serial += 1;
                        let task = format!("bulk-{serial}");
                        runtime.block_on(fill(target.daemon, &task, &pages));
                        let connection = Connection::new(
                            target.daemon.tcp_endpoint(),
                            ConnectionOptions {
                                tls: target.tls.clone(),
                                stripes: target
                                    .stripes
                                    .unwrap_or(ConnectionOptions::default().stripes),
                                ..ConnectionOptions::default()
                            },
                        );
                        let start = Instant::now();
                        runtime.block_on(read(connection, &task, config.clone(), &pages));
                        let took = start.elapsed();
                        results.sample(&case, took, total);
                        spent += took;
                    }
                    spent
                })
            });
        }
        group.finish();
    }
}

/// Seconds per read, by case.
#[derive(Default)]
struct Results(BTreeMap<String, (Vec<f64>, usize)>);

impl Results {
    fn sample(&mut self, case: &str, took: Duration, bytes: usize) {
        let entry = self
            .0
            .entry(case.to_string())
            .or_insert_with(|| (Vec::new(), bytes));
        entry.0.push(took.as_secs_f64());
    }

    fn median(&self, case: &str) -> Option<f64> {
        let (samples, _) = self.0.get(case)?;
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        sorted.get(sorted.len() / 2).copied()
    }

    fn table(&self) -> String {
        let mut out = String::from(
            "| page | case | MB/s (median) | / raw | / raw-cold | / binx-default |\n|---|---|---|---|---|---|\n",
        );
        for (case, (_, bytes)) in &self.0 {
            let Some((page, name)) = case.split_once('/') else {
                continue;
            };
            let Some(secs) = self.median(case) else {
                continue;
            };
            let ratio = |against: &str| {
                self.median(&format!("{page}/{against}"))
                    .filter(|_| against != name)
                    .map(|base| format!("{:.2}", base / secs))
                    .unwrap_or_default()
            };
            out.push_str(&format!(
                "| {page} | {name} | {:.0} | {} | {} | {} |\n",
                *bytes as f64 / secs / 1e6,
                ratio("raw"),
                ratio("raw-cold"),
                ratio("binx-default"),
            ));
        }
        out
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut criterion = Criterion::default().configure_from_args();
    let mut results = Results::default();
    bulk(&mut criterion, &runtime, &mut results);
    criterion.final_summary();
    let table = results.table();
    println!("\nBulk reads of one buffer (ratios are the figures):\n\n{table}");
    let _ = std::fs::create_dir_all("target/criterion");
    let _ = std::fs::write("target/criterion/bulk-summary.md", table);
}
