//! binx: put pages into a local binxd, get a buffer from any binxd, ping,
//! and read a daemon's stats.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use binx_client::{
    Connection, ConnectionOptions, Endpoint, ExchangeSource, Producer, SourceConfig, TaskSpec,
};
use binx_proto::BufferKind;
use binx_sidecar::config::default_uds_path;
use binx_sidecar::units::{ByteSize, HumanDuration, human_bytes};
use bytes::Bytes;
use clap::{Parser, Subcommand, ValueEnum};

/// Command-line tool for binx exchange daemons.
#[derive(Debug, Parser)]
#[command(name = "binx", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Put pages from files (one page per file) or stdin into a buffer of the local binxd.
    Put(PutArgs),
    /// Read a buffer from a binxd to stdout or a file.
    Get(GetArgs),
    /// Measure round trips to a binxd.
    Ping(PingArgs),
    /// Show a binxd's counters and gauges.
    Stats(StatsArgs),
}

#[derive(Debug, clap::Args)]
struct PutArgs {
    /// Task to put the pages into; it is opened if it does not exist yet.
    #[arg(long)]
    task: String,
    /// Buffer that receives the pages.
    #[arg(long, default_value_t = 0)]
    buffer: u64,
    /// Number of buffers when the task is opened (0: open-ended).
    #[arg(long, default_value_t = 1)]
    buffers: u64,
    /// Buffer kind when the task is opened.
    #[arg(long, value_enum, default_value_t = Kind::Partitioned)]
    kind: Kind,
    /// Split the input into pages of this size instead of one page per file.
    #[arg(long, value_name = "SIZE")]
    split_at: Option<ByteSize>,
    /// Leave the buffer open (no NO_MORE_PAGES) for more puts.
    #[arg(long)]
    keep_open: bool,
    /// Unix socket of the local binxd.
    #[arg(long, env = "BINX_UDS_PATH", default_value_os_t = default_uds_path())]
    uds: PathBuf,
    /// Files to read; none or "-" reads stdin.
    files: Vec<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Kind {
    Partitioned,
    Broadcast,
    Arbitrary,
}

impl From<Kind> for BufferKind {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Partitioned => BufferKind::Partitioned,
            Kind::Broadcast => BufferKind::Broadcast,
            Kind::Arbitrary => BufferKind::Arbitrary,
        }
    }
}

#[derive(Debug, clap::Args)]
struct GetArgs {
    /// binxd to read from: host:port, or a Unix socket path.
    #[arg(long, default_value = "127.0.0.1:8091")]
    remote: String,
    #[arg(long)]
    task: String,
    #[arg(long, default_value_t = 0)]
    buffer: u64,
    /// Write the pages here instead of stdout.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Shared secret, when the daemon requires one.
    #[arg(long, env = "BINX_SHARED_SECRET", hide_env_values = true)]
    auth_token: Option<String>,
    /// Memory the reader may hold ahead of the output.
    #[arg(long, default_value = "32MiB")]
    budget: ByteSize,
    /// Give up after errors lasting this long.
    #[arg(long, default_value = "3m")]
    max_error_duration: HumanDuration,
    /// Progress on stderr: auto (when it is a terminal), always, never.
    #[arg(long, value_enum, default_value_t = When::Auto)]
    progress: When,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum When {
    Auto,
    Always,
    Never,
}

#[derive(Debug, clap::Args)]
struct PingArgs {
    /// binxd to ping: host:port, or a Unix socket path (default: the local socket).
    #[arg(long)]
    remote: Option<String>,
    /// Number of pings.
    #[arg(short, long, default_value_t = 5)]
    count: u32,
    #[arg(long, env = "BINX_SHARED_SECRET", hide_env_values = true)]
    auth_token: Option<String>,
}

#[derive(Debug, clap::Args)]
struct StatsArgs {
    /// binxd's HTTP endpoint.
    #[arg(long, default_value = "127.0.0.1:8090")]
    http: String,
    /// Print the raw JSON.
    #[arg(long)]
    json: bool,
}

fn main() {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("binx: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Put(args) => put(args).await,
            Command::Get(args) => get(args).await,
            Command::Ping(args) => ping(args).await,
            Command::Stats(args) => stats(args).await,
        }
    });
    if let Err(e) = result {
        eprintln!("binx: {e:#}");
        std::process::exit(1);
    }
}

fn endpoint(text: &str) -> anyhow::Result<Endpoint> {
    text.parse::<Endpoint>().map_err(anyhow::Error::msg)
}

async fn put(args: PutArgs) -> anyhow::Result<()> {
    let producer = Producer::unix(&args.uds, ConnectionOptions::default());
    let spec = TaskSpec {
        kind: args.kind.into(),
        buffer_count: args.buffers,
        spool_policy: String::new(),
    };
    producer
        .open_task(&args.task, &spec)
        .await
        .with_context(|| {
            format!(
                "cannot open task {} (is binxd running on {}?)",
                args.task,
                args.uds.display()
            )
        })?;
    let max_page = producer.max_batch_bytes;
    if let Some(split) = args.split_at
        && (split.0 == 0 || split.0 as usize > max_page)
    {
        bail!(
            "--split-at {split} must be between 1 byte and the largest page, {}",
            ByteSize(max_page as u64)
        );
    }
    let inputs: Vec<Option<PathBuf>> = if args.files.is_empty() {
        vec![None]
    } else {
        args.files
            .iter()
            .map(|f| (f.as_os_str() != "-").then(|| f.clone()))
            .collect()
    };
    let (mut pages, mut bytes) = (0u64, 0u64);
    let mut batch: Vec<Bytes> = Vec::new();
    let mut batch_bytes = 0usize;
    for input in inputs {
        let name = input
            .as_ref()
            .map_or_else(|| "stdin".to_string(), |p| p.display().to_string());
        let mut reader: Box<dyn Read> = match &input {
            Some(path) => {
                Box::new(std::fs::File::open(path).with_context(|| format!("cannot open {name}"))?)
            }
            None => Box::new(std::io::stdin().lock()),
        };
        let page_size = args.split_at.map_or(max_page, |s| s.0 as usize);
        loop {
            let page = read_up_to(
                &mut reader,
                page_size + usize::from(args.split_at.is_none()),
            )
            .with_context(|| format!("cannot read {name}"))?;
            if args.split_at.is_none() && page.len() > max_page {
                bail!(
                    "{name} is larger than the largest page ({}); use --split-at to cut it into pages",
                    ByteSize(max_page as u64)
                );
            }
            let last = page.len() < page_size || args.split_at.is_none();
            if !page.is_empty() || args.split_at.is_none() {
                pages += 1;
                bytes += page.len() as u64;
                batch_bytes += page.len();
                batch.push(Bytes::from(page));
            }
            if batch_bytes >= max_page / 2 {
                producer.enqueue(&args.task, args.buffer, &batch).await?;
                batch.clear();
                batch_bytes = 0;
            }
            if last {
                break;
            }
        }
    }
    producer.enqueue(&args.task, args.buffer, &batch).await?;
    if !args.keep_open {
        producer
            .no_more_pages(&args.task, Some(args.buffer))
            .await?;
    }
    eprintln!(
        "put {pages} page{} ({}) into buffer {} of task {}{}",
        if pages == 1 { "" } else { "s" },
        human_bytes(bytes),
        args.buffer,
        args.task,
        if args.keep_open {
            "; the buffer stays open"
        } else {
            "; the buffer is finished"
        }
    );
    Ok(())
}

/// Reads until `limit` bytes or end of input.
fn read_up_to(reader: &mut dyn Read, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    reader.take(limit as u64).read_to_end(&mut out)?;
    Ok(out)
}

async fn get(args: GetArgs) -> anyhow::Result<()> {
    let options = ConnectionOptions {
        auth_token: args.auth_token.clone(),
        backoff: binx_client::BackoffConfig {
            max_error_duration: args.max_error_duration.0,
            ..Default::default()
        },
        ..Default::default()
    };
    let connection = Connection::new(endpoint(&args.remote)?, options);
    let config = SourceConfig {
        memory_budget: args.budget.0,
        ..SourceConfig::default()
    };
    let mut source = ExchangeSource::new(connection, args.task.clone(), args.buffer, config);
    let mut out: Box<dyn Write> = match &args.output {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let show = match args.progress {
        When::Always => true,
        When::Never => false,
        When::Auto => std::io::stderr().is_terminal(),
    };
    let mut progress = Progress::new(show);
    while let Some(page) = source.next_page().await.with_context(|| {
        format!(
            "cannot read buffer {} of task {} from {}",
            args.buffer, args.task, args.remote
        )
    })? {
        out.write_all(&page.data)
            .context("cannot write the output")?;
        progress.add(page.data.len() as u64);
    }
    out.flush().context("cannot write the output")?;
    progress.finish(&args.task, args.buffer);
    Ok(())
}

/// A one-line progress display on stderr, redrawn at most ten times a second.
struct Progress {
    show: bool,
    start: Instant,
    last_draw: Instant,
    pages: u64,
    bytes: u64,
}

impl Progress {
    fn new(show: bool) -> Self {
        let now = Instant::now();
        Progress {
            show,
            start: now,
            last_draw: now,
            pages: 0,
            bytes: 0,
        }
    }

    fn rate(&self) -> String {
        let secs = self.start.elapsed().as_secs_f64().max(1e-6);
        format!("{}/s", human_bytes((self.bytes as f64 / secs) as u64))
    }

    fn add(&mut self, bytes: u64) {
        self.pages += 1;
        self.bytes += bytes;
        if self.show && self.last_draw.elapsed() >= Duration::from_millis(100) {
            self.last_draw = Instant::now();
            eprint!(
                "\r\x1b[2K  {} pages  {}  {}",
                self.pages,
                human_bytes(self.bytes),
                self.rate()
            );
        }
    }

    fn finish(&self, task: &str, buffer: u64) {
        if self.show {
            eprint!("\r\x1b[2K");
        }
        eprintln!(
            "got {} pages ({}) from buffer {buffer} of task {task} in {:.2?} ({})",
            self.pages,
            human_bytes(self.bytes),
            self.start.elapsed(),
            self.rate()
        );
    }
}

async fn ping(args: PingArgs) -> anyhow::Result<()> {
    let target = match &args.remote {
        Some(text) => endpoint(text)?,
        None => Endpoint::Unix(default_uds_path()),
    };
    let options = ConnectionOptions {
        auth_token: args.auth_token.clone(),
        ..Default::default()
    };
    let connection = Connection::new(target.clone(), options);
    // The first round trip includes connecting; report it apart.
    let connect = connection
        .ping()
        .await
        .with_context(|| format!("cannot ping binxd at {target}"))?;
    println!(
        "connected to {target} (connect + first ping {:.1?})",
        connect
    );
    let mut times = Vec::new();
    for i in 0..args.count {
        let rtt = connection.ping().await?;
        println!("ping {}: {:.1?}", i + 1, rtt);
        times.push(rtt);
    }
    if !times.is_empty() {
        times.sort();
        let sum: Duration = times.iter().sum();
        println!(
            "{} pings: min {:.1?}, median {:.1?}, mean {:.1?}, max {:.1?}",
            times.len(),
            times[0],
            times[times.len() / 2],
            sum / times.len() as u32,
            times[times.len() - 1]
        );
    }
    Ok(())
}

async fn stats(args: StatsArgs) -> anyhow::Result<()> {
    let (status, body) = binx_sidecar::http::get(&args.http, "/v1/stats").await?;
    if !status.is_success() {
        bail!(
            "binxd at {} answered {status}: {}",
            args.http,
            String::from_utf8_lossy(&body).trim()
        );
    }
    if args.json {
        std::io::stdout().write_all(&body)?;
        return Ok(());
    }
    let value: serde_json::Value =
        serde_json::from_slice(&body).context("binxd's stats are not valid JSON")?;
    let Some(fields) = value.as_object() else {
        bail!("binxd's stats are not a JSON object");
    };
    for (key, v) in fields {
        match v {
            serde_json::Value::Object(map) => {
                println!("{key}:");
                for (k, v) in map {
                    println!("  {k:<28} {v}");
                }
            }
            v if key.ends_with("memory_used")
                || key.ends_with("limit")
                || key.starts_with("bytes_")
                || key.ends_with("high_water") =>
            {
                let n = v.as_u64().unwrap_or(0);
                println!("{key:<30} {n} ({})", human_bytes(n));
            }
            v => println!("{key:<30} {v}"),
        }
    }
    Ok(())
}
