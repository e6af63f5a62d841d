//! binx: put pages into a local binxd, get a buffer from any binxd, ping,
//! and operate a daemon through its admin service (stats, tasks, abort,
//! drain, log level).

#![forbid(unsafe_code)]

/// `println!` that ends the CLI quietly once stdout is closed (`binx tasks
/// | head -1`), where std's panics on the broken pipe; any other write
/// error (a full disk) is reported and fails the command.
macro_rules! println {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e);
        }
    }};
}

/// `print!` as [`println!`] here.
macro_rules! print {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e);
        }
    }};
}

/// Ends the CLI after stdout failed: quietly (0) when its reader went
/// away, else saying why (1).
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("binx: cannot write the output: {e}");
    std::process::exit(1);
}

pub mod bench;

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use binx_admin::AdminClient;
use binx_client::{
    Connection, ConnectionOptions, Endpoint, ExchangeSource, Producer, SourceConfig, TaskSpec,
};
use binx_client::{admin_uds_beside, default_uds_path};
use binx_proto::BufferKind;
use bytes::Bytes;
use bytesize::ByteSize;
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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
    /// Show a binxd's counters and gauges (admin service).
    Stats(StatsArgs),
    /// List a binxd's tasks and their buffers (admin service).
    Tasks(TasksArgs),
    /// Abort a task on a binxd; its consumers see the reason (admin service).
    Abort(AbortArgs),
    /// Start a drain, as SIGTERM does: readiness goes false, held pages are
    /// served, then binxd stops (admin service).
    Drain(AdminArgs),
    /// Change a binxd's log filter at run time, e.g. "debug" (admin service).
    LogLevel(LogLevelArgs),
    /// The BinX RFC micro-benchmark against a live binxd: BinX vs the HTTP
    /// exchange, one chunk per request, 1..128 exchanges in parallel.
    Bench(BenchArgs),
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// BinX TCP endpoint of the daemon to read from.
    #[arg(long, default_value = "127.0.0.1:8091")]
    remote: String,
    /// Its HTTP exchange (host:port); "" skips HTTP.
    #[arg(long, default_value = "127.0.0.1:8090")]
    http: String,
    /// Unix socket of the same daemon, to fill the chunks through (run on
    /// its host or pod). Not needed with --prefix.
    #[arg(long, env = "BINX_UDS_PATH", default_value_os_t = default_uds_path())]
    uds: PathBuf,
    /// Read tasks another `binx bench --fill-only` left, instead of filling.
    #[arg(long)]
    prefix: Option<String>,
    /// Fill the tasks, print their prefix, and leave them for readers elsewhere.
    #[arg(long)]
    fill_only: bool,
    /// Chunk sizes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "32B,1KiB,32KiB,1MiB,16MiB",
        value_parser = parse_size
    )]
    sizes: Vec<ByteSize>,
    /// Parallel exchanges.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    parallel: Vec<usize>,
    /// Chunks per buffer (the RFC: 128).
    #[arg(long, default_value_t = 128)]
    chunks: usize,
    /// At most this much held per chunk size (fewer chunks for large sizes).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    max_task_bytes: ByteSize,
    /// Time per case.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    time_per_case: Duration,
    /// TCP sockets (stripes) of the BinX connection read over; DATA of the
    /// parallel exchanges goes round them. 0 takes the client library's
    /// default: one per two cores, at least 1, at most 8.
    #[arg(long, default_value_t = 0)]
    connections: usize,
    #[arg(long, env = "BINX_SHARED_SECRET", hide_env_values = true)]
    auth_token: Option<String>,
}

/// How to reach a daemon's admin service.
#[derive(Debug, clap::Args)]
struct AdminArgs {
    /// Admin service: a Unix socket path, unix:///path, or http://host:port
    /// (default: binx-admin.sock beside the BinX socket).
    #[arg(long, env = "BINX_ADMIN")]
    admin: Option<String>,
    /// BinX socket whose admin socket is meant, when --admin is not given.
    #[arg(long, env = "BINX_UDS_PATH", default_value_os_t = default_uds_path())]
    uds: PathBuf,
    /// Shared secret, sent as a bearer token (the admin TCP port needs it).
    #[arg(long, env = "BINX_SHARED_SECRET", hide_env_values = true)]
    auth_token: Option<String>,
}

impl AdminArgs {
    async fn connect(&self) -> anyhow::Result<AdminClient> {
        let target = match &self.admin {
            Some(t) if t.contains("://") => t.clone(),
            Some(path) => format!("unix://{path}"),
            None => format!("unix://{}", admin_uds_beside(&self.uds).display()),
        };
        AdminClient::connect(&target, self.auth_token.clone())
            .await
            .with_context(|| "is binxd running, with its admin service on?".to_string())
    }
}

#[derive(Debug, clap::Args)]
struct TasksArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Only tasks whose id starts with this.
    #[arg(long, default_value = "")]
    prefix: String,
    /// One line per task, without its buffers.
    #[arg(long)]
    brief: bool,
}

#[derive(Debug, clap::Args)]
struct AbortArgs {
    #[command(flatten)]
    admin: AdminArgs,
    #[arg(long)]
    task: String,
    /// Reason the consumers will see.
    #[arg(long, default_value = "aborted by an operator")]
    reason: String,
}

#[derive(Debug, clap::Args)]
struct LogLevelArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// A tracing filter: "debug", "info,binx_server=trace", ...
    filter: String,
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
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    split_at: Option<ByteSize>,
    /// Leave the buffer open (no NO_MORE_PAGES) for more puts.
    #[arg(long)]
    keep_open: bool,
    /// Unix socket of the local binxd.
    #[arg(long, env = "BINX_UDS_PATH", default_value_os_t = default_uds_path())]
    uds: PathBuf,
    /// Progress on stderr: auto (when it is a terminal), always, never.
    #[arg(long, value_enum, default_value_t = When::Auto)]
    progress: When,
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
    #[arg(long, default_value = "32MiB", value_parser = parse_size)]
    budget: ByteSize,
    /// Give up after errors lasting this long.
    #[arg(long, default_value = "3m", value_parser = parse_duration)]
    max_error_duration: Duration,
    /// Progress on stderr: auto (when it is a terminal), always, never.
    #[arg(long, value_enum, default_value_t = When::Auto)]
    progress: When,
    #[command(flatten)]
    tls: TlsArgs,
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
    #[command(flatten)]
    tls: TlsArgs,
}

/// TLS to a binxd whose TCP listener uses it.
#[derive(Debug, clap::Args)]
struct TlsArgs {
    /// CA bundle (PEM) to check binxd's certificate against; turns TLS on.
    #[arg(long, env = "BINX_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Client certificate chain (PEM), for binxd with tls_client_auth.
    #[arg(long, env = "BINX_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Key of --tls-cert (PEM).
    #[arg(long, env = "BINX_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl TlsArgs {
    fn client_config(&self) -> anyhow::Result<Option<std::sync::Arc<rustls::ClientConfig>>> {
        let Some(ca) = &self.tls_ca else {
            anyhow::ensure!(
                self.tls_cert.is_none(),
                "--tls-cert needs --tls-ca (the CA binxd's certificate is checked against)"
            );
            return Ok(None);
        };
        let identity = self.tls_cert.as_deref().zip(self.tls_key.as_deref());
        Ok(Some(binx_client::tls::client_config(ca, identity)?))
    }
}

#[derive(Debug, clap::Args)]
struct StatsArgs {
    #[command(flatten)]
    admin: AdminArgs,
}

/// A size as binx's settings take it (bytesize: `KiB` is 1024, `kB` 1000);
/// a size too large to count is refused, not saturated.
fn parse_size(text: &str) -> Result<ByteSize, String> {
    match text.trim().parse::<ByteSize>() {
        Ok(size) if size.0 != u64::MAX => Ok(size),
        Ok(_) => Err(format!("{text:?} is too large a size")),
        Err(e) => Err(format!(
            "{text:?} is not a size ({e}): e.g. 4096, 64KiB, 16MiB"
        )),
    }
}

/// A duration as binx's settings take it: lower-cased, so `5M` is five
/// minutes, never months.
fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(&text.trim().to_ascii_lowercase())
        .map_err(|e| format!("{text:?} is not a duration ({e}): e.g. 250ms, 10s, 3m"))
}

/// Sizes as people read them: 1.5 MiB.
fn human_bytes(bytes: u64) -> String {
    ByteSize(bytes).display().iec().to_string()
}

/// Runs the `binx` command line with the process arguments.
pub fn main() {
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
            Command::Tasks(args) => tasks(args).await,
            Command::Abort(args) => abort(args).await,
            Command::Drain(args) => drain(args).await,
            Command::LogLevel(args) => log_level(args).await,
            Command::Bench(args) => bench(args).await,
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

/// A producer on the local binxd's socket. The client library retries a
/// refused connection for minutes (an engine outlives sidecar restarts); a
/// command typed by hand should say at once that nothing listens there.
fn local_producer(uds: &std::path::Path) -> anyhow::Result<Producer> {
    std::os::unix::net::UnixStream::connect(uds).with_context(|| {
        format!(
            "cannot connect to binxd on {} (is it running? --uds or BINX_UDS_PATH names its socket)",
            uds.display()
        )
    })?;
    Ok(Producer::unix(uds, ConnectionOptions::default()))
}

async fn put(args: PutArgs) -> anyhow::Result<()> {
    let producer = local_producer(&args.uds)?;
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
    // The total is known when every input is a regular file.
    let total = inputs
        .iter()
        .map(|i| {
            let path = i.as_ref()?;
            std::fs::metadata(path)
                .ok()
                .filter(|m| m.is_file())
                .map(|m| m.len())
        })
        .sum::<Option<u64>>();
    let mut progress = Progress::new(Progress::show(args.progress), total);
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
                progress.add(page.len() as u64);
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
    progress.finish();
    let pages = progress.pages;
    eprintln!(
        "put {pages} page{} ({}) into buffer {} of task {}{}",
        if pages == 1 { "" } else { "s" },
        human_bytes(progress.bytes),
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

/// A write of `binx get`'s output failed. Stdout's reader going away
/// (`binx get ... | head -c 100`) still fails the command, as any output it
/// cannot deliver does: the pages it read were taken from the buffer, and a
/// pipeline must not take a consumer that died for one that finished; the
/// error says how far the output got instead of a bare "Broken pipe".
fn output_failed(e: std::io::Error, args: &GetArgs, progress: &Progress) -> anyhow::Result<()> {
    progress.bar.finish_and_clear();
    if args.output.is_none() && e.kind() == std::io::ErrorKind::BrokenPipe {
        bail!(
            "the output was closed by its reader after {} pages ({}); buffer {} of task {} was not read to its end",
            progress.pages,
            human_bytes(progress.bytes),
            args.buffer,
            args.task
        );
    }
    Err(e).context("cannot write the output")
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
            max_error_duration: args.max_error_duration,
            ..Default::default()
        },
        tls: args.tls.client_config()?,
        // Its reply names the daemon's run: a read across a restart of the
        // daemon fails rather than go on with another run's pages.
        hello: true,
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
    let mut progress = Progress::new(Progress::show(args.progress), None);
    while let Some(page) = source.next_page().await.with_context(|| {
        format!(
            "cannot read buffer {} of task {} from {}",
            args.buffer, args.task, args.remote
        )
    })? {
        if let Err(e) = out.write_all(&page.data) {
            return output_failed(e, &args, &progress);
        }
        progress.add(page.data.len() as u64);
    }
    if let Err(e) = out.flush() {
        return output_failed(e, &args, &progress);
    }
    progress.finish();
    eprintln!(
        "got {} pages ({}) from buffer {} of task {} in {:.2?} ({})",
        progress.pages,
        human_bytes(progress.bytes),
        args.buffer,
        args.task,
        progress.start.elapsed(),
        progress.rate()
    );
    Ok(())
}

/// Progress on stderr (indicatif): bytes, pages, rate, and an ETA when the
/// total is known; hidden when not shown (piped, or `--progress never`).
/// The summary line is printed either way.
struct Progress {
    bar: ProgressBar,
    start: Instant,
    pages: u64,
    bytes: u64,
}

impl Progress {
    fn new(show: bool, total: Option<u64>) -> Self {
        let bar = if !show {
            ProgressBar::hidden()
        } else if let Some(total) = total {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "  {bar:30} {binary_bytes}/{binary_total_bytes}  {msg}  {binary_bytes_per_sec}  ETA {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        } else {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "  {spinner} {binary_bytes}  {msg}  {binary_bytes_per_sec}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar
        };
        Progress {
            bar,
            start: Instant::now(),
            pages: 0,
            bytes: 0,
        }
    }

    fn show(when: When) -> bool {
        match when {
            When::Always => true,
            When::Never => false,
            When::Auto => std::io::stderr().is_terminal(),
        }
    }

    fn rate(&self) -> String {
        let secs = self.start.elapsed().as_secs_f64().max(1e-6);
        format!("{}/s", human_bytes((self.bytes as f64 / secs) as u64))
    }

    fn add(&mut self, bytes: u64) {
        self.pages += 1;
        self.bytes += bytes;
        self.bar.inc(bytes);
        self.bar.set_message(format!("{} pages", self.pages));
    }

    /// Clears the bar; the caller prints its summary.
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

async fn ping(args: PingArgs) -> anyhow::Result<()> {
    let target = match &args.remote {
        Some(text) => endpoint(text)?,
        None => Endpoint::Unix(default_uds_path()),
    };
    let options = ConnectionOptions {
        auth_token: args.auth_token.clone(),
        tls: args.tls.client_config()?,
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
    let stats = args.admin.connect().await?.get_stats().await?;
    for (key, n) in &stats.values {
        // The daemon says which values are bytes or seconds.
        match stats.units.get(key).map(String::as_str) {
            Some("bytes") => println!("{key:<30} {n} ({})", human_bytes(*n)),
            Some("seconds") => println!("{key:<30} {n} s"),
            _ => println!("{key:<30} {n}"),
        }
    }
    println!("{:<30} {}", "draining", stats.draining);
    println!("requests:");
    for reply in &stats.replies {
        let key = format!("{} {}", reply.r#type, reply.status);
        println!("  {key:<28} {}", reply.count);
    }
    Ok(())
}

async fn tasks(args: TasksArgs) -> anyhow::Result<()> {
    let reply = args
        .admin
        .connect()
        .await?
        .list_tasks_reply(&args.prefix)
        .await?;
    let tasks = reply.tasks;
    if tasks.is_empty() && !reply.truncated {
        println!("no open tasks");
        return Ok(());
    }
    for t in &tasks {
        let count = if t.buffer_count == 0 {
            "open-ended".to_string()
        } else {
            t.buffer_count.to_string()
        };
        println!(
            "{}  {}  buffers {} ({count})  held {}  spool {}  input {}  idle {:.1}s",
            t.task_id,
            t.kind,
            t.buffers.len(),
            human_bytes(t.memory_bytes),
            t.spool_policy,
            if t.input_finished { "finished" } else { "open" },
            t.idle_millis as f64 / 1000.0,
        );
        if args.brief {
            continue;
        }
        for b in &t.buffers {
            println!(
                "  buffer {:<6} {:<9} acked {:<8} next {:<8} pages {:<6} {:>10}  idle {:.1}s",
                b.buffer_id,
                b.state,
                b.acknowledged_token,
                b.next_token,
                b.pages_held,
                human_bytes(b.bytes_held),
                b.idle_millis as f64 / 1000.0,
            );
        }
    }
    if reply.truncated {
        println!(
            "more tasks match than one listing holds ({} shown); narrow it with --prefix",
            tasks.len()
        );
    }
    Ok(())
}

async fn abort(args: AbortArgs) -> anyhow::Result<()> {
    let freed = args
        .admin
        .connect()
        .await?
        .abort_task(&args.task, &args.reason)
        .await?;
    println!("aborted task {}; freed {}", args.task, human_bytes(freed));
    Ok(())
}

async fn drain(args: AdminArgs) -> anyhow::Result<()> {
    let reply = args.connect().await?.start_drain().await?;
    if reply.already_draining {
        println!(
            "binxd was already draining; {} pages held",
            reply.pages_held
        );
    } else {
        println!(
            "drain started: readiness is false, no new tasks; binxd stops once its {} held pages are read",
            reply.pages_held
        );
    }
    Ok(())
}

async fn log_level(args: LogLevelArgs) -> anyhow::Result<()> {
    let previous = args
        .admin
        .connect()
        .await?
        .set_log_level(&args.filter)
        .await?;
    println!("log filter is now {:?} (was {previous:?})", args.filter);
    Ok(())
}

async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if args
        .parallel
        .iter()
        .any(|&p| p == 0 || p as u64 > bench::BUFFERS_PER_TASK / 4)
    {
        bail!(
            "--parallel values must be between 1 and {}",
            bench::BUFFERS_PER_TASK / 4
        );
    }
    // One chunk is one page of one ENQUEUE: at most what a frame carries.
    const MAX_CHUNK: u64 = 64 << 20;
    if args.sizes.iter().any(|s| s.0 == 0 || s.0 > MAX_CHUNK) {
        bail!("--sizes must be above 0 bytes and at most 64MiB (one page of one frame)");
    }
    if args.connections > binx_client::connection::MAX_STRIPES {
        bail!(
            "--connections must be between 0 (the client's default) and {}",
            binx_client::connection::MAX_STRIPES
        );
    }
    let plan = bench::BenchPlan {
        sizes: args.sizes.iter().map(|s| s.0 as usize).collect(),
        parallel: args.parallel.clone(),
        chunks: args.chunks,
        max_task_bytes: args.max_task_bytes.0,
        time_per_case: args.time_per_case,
    };
    // Only filling needs the local socket; a reader given --prefix reads by TCP.
    let (prefix, producer) = match &args.prefix {
        Some(prefix) => (prefix.clone(), None),
        None => {
            let producer = local_producer(&args.uds)?;
            let prefix = format!(
                "bench-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis())
                    .unwrap_or(0)
            );
            bench::fill(&producer, &prefix, &plan)
                .await
                .with_context(|| {
                    format!(
                        "filling through {} (is binxd running there?)",
                        args.uds.display()
                    )
                })?;
            (prefix, Some(producer))
        }
    };
    if args.fill_only {
        println!(
            "filled; read them elsewhere with: binx bench --prefix {prefix} --remote <this daemon's host:port> (same --sizes/--chunks/--max-task-bytes)"
        );
        return Ok(());
    }
    let remote = endpoint(&args.remote)?;
    let connection = Connection::new(
        remote.clone(),
        bench::binx_options(args.auth_token.clone(), args.connections),
    );
    let stripes = connection.stripes();
    let http = (!args.http.is_empty()).then(|| args.http.clone());
    let mut readers = bench::Readers::new(connection, http);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!(
        "reading from BinX {} over {stripes} connection(s), this client on {cores} core(s), and HTTP {} (tasks {prefix}.*)",
        args.remote,
        if args.http.is_empty() {
            "(skipped)"
        } else {
            &args.http
        }
    );
    let results = bench::run(&mut readers, &prefix, &plan, |r| {
        eprintln!(
            "  {:>8} x {:>3} chunks, {:>3} parallel: BinX {:>8.1} MB/s{}",
            ByteSize(r.size as u64).to_string(),
            r.chunks,
            r.parallel,
            r.binx / 1e6,
            r.http
                .map(|h| format!(", HTTP {:>8.1} MB/s, BinX/HTTP {:.2}", h / 1e6, r.binx / h))
                .unwrap_or_default()
        )
    })
    .await;
    if let Some(producer) = &producer {
        bench::clean(producer, &prefix, &plan).await;
    }
    let results = results?;
    println!("BinX over {stripes} connection(s); this client on {cores} core(s).\n");
    print!("{}", bench::table(&results));
    Ok(())
}
