//! binxd, the binx exchange daemon: [`main`] is the whole binary. Runs with no configuration at all
//! (TCP 127.0.0.1:8091, a Unix socket under the temp dir, HTTP on
//! 127.0.0.1:8090, logs on stderr); see `binxd --help`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::{Config, ConfigOverrides, LogFormat, Settings};
use anyhow::Context;
use binx_server::admin::{self, AdminService, DaemonControl};
use binx_server::http;
use binx_server::internal_auth::InternalAuth;
use binx_server::{BinxServer, Exchange, ListenConfig};
use binx_spool::Spool;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

/// The binx exchange daemon: moves pages between query-engine workers.
///
/// Every setting can come from the config file, a BINX_* environment
/// variable, or a flag; later ones win. `binxd --print-config` shows the result.
#[derive(Debug, Parser)]
#[command(name = "binxd", version)]
struct Args {
    /// TOML config file.
    #[arg(long, env = "BINX_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// Print every configuration key with its variable and default, and exit.
    #[arg(long)]
    list_config_keys: bool,
    /// Once every listener is bound, write their addresses to FILE, one
    /// `name=value` line each (tcp, http, uds, admin, admin_tcp; "off" when
    /// disabled): a port given as 0 shows the one the system chose. For
    /// scripts and tests that start binxd and then connect to it.
    #[arg(long, value_name = "FILE")]
    ready_file: Option<PathBuf>,
    #[command(flatten)]
    overrides: ConfigOverrides,
}

/// Runs binxd with the process arguments; exits 1 with the error on failure.
pub fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("binxd: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    // Written, not println!: a closed pipe (`| head`) ends the listing
    // instead of panicking.
    use std::io::Write as _;
    if args.list_config_keys {
        let mut out = std::io::stdout().lock();
        for (key, env, default, doc) in Config::keys() {
            if writeln!(out, "{key}\t{env}\t{default}\t{doc}").is_err() {
                break;
            }
        }
        return Ok(());
    }
    let settings = Config::load(args.config.as_deref(), &args.overrides)?;
    if args.print_config {
        let _ = write!(std::io::stdout().lock(), "{}", settings.config.to_toml());
        return Ok(());
    }

    let log = init_logging(&settings.config)?;
    if settings.config.max_frame_size.0 < (16 << 20) + (64 << 10) {
        tracing::warn!(
            max_frame_size = %settings.config.max_frame_size,
            "max_frame_size is below 16MiB + 64KiB: binx's clients send ENQUEUEs within it (HELLO says it), and refuse a page larger than it; a client that does not read HELLO and sends a longer frame has its connection closed"
        );
    }
    for name in Config::unknown_environment() {
        tracing::warn!(
            variable = %name,
            "{name} is set but is no binxd setting, so it changes nothing (binxd --list-config-keys lists them)"
        );
    }
    // Before the runtime's threads start allocating.
    let retained = crate::allocator::retained_for(settings.core.memory_limit);
    let allocator_tuned = crate::allocator::retain_freed_memory(retained);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.config.runtime_thread_count())
        .enable_all()
        .thread_name("binxd")
        .build()
        .context("cannot start the async runtime")?;
    if allocator_tuned {
        tracing::debug!(retained, "malloc keeps freed heap for reuse");
    }
    let served = runtime.block_on(serve(settings, log, args.ready_file));
    // A thread stuck in the kernel on a hung spool mount would hold the
    // exit for as long as the mount hangs (dropping a runtime waits for
    // its blocking threads).
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    served
}

/// Replaces the log filter of the running subscriber.
type ReloadFilter = Box<dyn Fn(tracing_subscriber::EnvFilter) -> Result<(), String> + Send + Sync>;

/// The log filter in force and how to change it (the admin SetLogLevel call).
struct LogControl {
    current: Mutex<String>,
    reload: ReloadFilter,
}

fn init_logging(config: &Config) -> anyhow::Result<LogControl> {
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log_level)
        .with_context(|| format!("log_level {:?} is not a valid filter", config.log_level))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let reload: ReloadFilter = if config.log_format == LogFormat::Json {
        let builder = builder.json().with_filter_reloading();
        let handle = builder.reload_handle();
        builder.init();
        Box::new(move |f| handle.reload(f).map_err(|e| e.to_string()))
    } else {
        let builder = builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter_reloading();
        let handle = builder.reload_handle();
        builder.init();
        Box::new(move |f| handle.reload(f).map_err(|e| e.to_string()))
    };
    Ok(LogControl {
        current: Mutex::new(config.log_level.clone()),
        reload,
    })
}

/// Writes the bound addresses as `name=value` lines, whole or not at all
/// (a temporary file renamed into place), so a reader never sees half.
fn write_ready_file(file: &Path, bound: &[(&str, String)]) -> anyhow::Result<()> {
    let text: String = bound.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    let mut partial = file.as_os_str().to_owned();
    partial.push(".partial");
    std::fs::write(&partial, text)
        .and_then(|()| std::fs::rename(&partial, file))
        .with_context(|| format!("cannot write --ready-file {}", file.display()))
}

/// File descriptors kept free of both listeners: the spool, the admin
/// socket, logs, forwarded connections.
const FD_RESERVE: u64 = 256;

/// Raises the file descriptor limit to its hard maximum, then makes the
/// listeners fit in it: BinX connections first, HTTP gets what is left, so
/// a flood of HTTP connections never leaves BinX without descriptors.
fn fd_budget(listen: &mut ListenConfig, mut http: http::HttpLimits) -> http::HttpLimits {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            limit = raised;
        }
    }
    let Some(total) = limit.current else {
        return http;
    };
    let binx = listen.max_connections as u64;
    let budget = total.saturating_sub(FD_RESERVE);
    if binx + http.max_connections as u64 > budget {
        // HTTP yields first (down to 16), then BinX.
        let http_cap = budget.saturating_sub(binx).max(16);
        let binx_cap = budget.saturating_sub(http_cap).max(16);
        tracing::warn!(
            nofile = total,
            max_connections = binx_cap,
            http_max_connections = http_cap,
            "the file descriptor limit is below max_connections + http_max_connections + {FD_RESERVE}; lowered the connection limits to fit"
        );
        http.max_connections = http_cap as usize;
        listen.max_connections = listen.max_connections.min(binx_cap as usize);
    }
    http
}

/// What the admin service asks of the daemon itself.
struct Control {
    log: LogControl,
    exchange: Exchange,
    ready: Arc<AtomicBool>,
    drain: Arc<tokio::sync::Notify>,
}

impl DaemonControl for Control {
    fn start_drain(&self) {
        // Readiness and the task refusal take effect before the reply, as
        // for SIGTERM; the stop task then serves held pages and stops.
        self.ready.store(false, Ordering::Release);
        self.exchange.start_drain();
        // notify_one keeps the permit if the signal task is not waiting yet.
        self.drain.notify_one();
    }

    fn set_log_level(&self, filter: &str) -> Result<String, String> {
        let parsed = tracing_subscriber::EnvFilter::try_new(filter)
            .map_err(|e| format!("{filter:?} is not a valid log filter: {e}"))?;
        let mut current = self
            .log
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (self.log.reload)(parsed)?;
        tracing::info!(previous = %current, now = %filter, "log level changed");
        Ok(std::mem::replace(&mut *current, filter.to_string()))
    }
}

async fn serve(
    settings: Settings,
    log: LogControl,
    ready_file: Option<PathBuf>,
) -> anyhow::Result<()> {
    let Settings {
        config,
        core,
        mut listen,
        spool,
        forwarder,
        admin_uds,
        http_limits,
    } = settings;
    let spool = match spool {
        Some(spool_config) => {
            let spool = Spool::open(spool_config).context("cannot open the spool")?;
            if config.default_spool_policy.0.commits()
                && let Some(why) = spool.always_refusal()
            {
                anyhow::bail!(
                    "default_spool_policy is \"{}\", but {why}",
                    config.default_spool_policy.0
                );
            }
            tracing::info!(
                stores = %spool.stores().iter().map(|s| s.url()).collect::<Vec<_>>().join(","),
                node = %spool.config().node_name,
                "spool ready"
            );
            // What a crashed run of this node left, and what expired
            // meanwhile; in the background, so a slow store delays nothing.
            let startup = spool.clone();
            tokio::spawn(async move {
                let pruned = startup.prune(std::time::SystemTime::now(), true).await;
                tracing::info!(pruned, "startup prune of the spool done");
            });
            Some(spool)
        }
        None => None,
    };
    let spool_tasks: Vec<tokio::task::JoinHandle<()>> = match &spool {
        Some(spool) => vec![spool.spawn_pruner(config.spool_ttl.0.clamp(
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(300),
        ))],
        None => Vec::new(),
    };
    let exchange = Exchange::sharded(core, spool.clone(), config.shard_count());
    if let Some(forwarder) = forwarder {
        exchange.set_forwarder(forwarder);
    }
    let driver = exchange.spawn_driver();
    let ready = Arc::new(AtomicBool::new(true));
    let drain_requested = Arc::new(tokio::sync::Notify::new());
    let admin_service = AdminService::new(
        exchange.clone(),
        Arc::new(Control {
            log,
            exchange: exchange.clone(),
            ready: ready.clone(),
            drain: drain_requested.clone(),
        }),
    );
    // Admin servers stop when this is dropped (at the end of serve).
    let (admin_stop_tx, admin_stop) = tokio::sync::watch::channel(());
    let admin_stopped = move || {
        let mut rx = admin_stop.clone();
        async move {
            let _ = rx.changed().await;
        }
    };
    let mut admin_tasks = Vec::new();
    if let Some(path) = &admin_uds {
        let listener = admin::bind_admin_uds(path).await?;
        let service = admin_service.clone();
        let stopped = admin_stopped();
        admin_tasks.push(tokio::spawn(async move {
            if let Err(e) = admin::serve_unix(listener, service, stopped).await {
                tracing::error!(error = %e, "the admin socket stopped");
            }
        }));
    }
    let mut admin_tcp_addr = None;
    if !config.admin_listen.is_empty() {
        let listener = tokio::net::TcpListener::bind(&config.admin_listen)
            .await
            .with_context(|| format!("cannot listen for admin gRPC on {}", config.admin_listen))?;
        admin_tcp_addr = Some(listener.local_addr().context("the admin port's address")?);
        let token = (!config.shared_secret.is_empty()).then(|| config.shared_secret.clone());
        let service = admin_service.with_token(token);
        let idle = config.http_idle_timeout.0;
        let stopped = admin_stopped();
        admin_tasks.push(tokio::spawn(async move {
            if let Err(e) = admin::serve_tcp(listener, idle, service, stopped).await {
                tracing::error!(error = %e, "the admin port stopped");
            }
        }));
    }
    // After the admin socket, so a client that sees the BinX socket finds both.
    let http_limits = fd_budget(&mut listen, http_limits);
    let server = BinxServer::bind(exchange.clone(), listen).await?;
    // The address other sidecars reach this one under, with the port the
    // listener really bound (0 asks the system for one).
    exchange.set_advertised(config.advertised_for(server.tcp_addr())?);
    let mut http_addr = None;
    let http_task = if config.http_listen.is_empty() {
        None
    } else {
        let listener = tokio::net::TcpListener::bind(&config.http_listen)
            .await
            .with_context(|| format!("cannot listen for HTTP on {}", config.http_listen))?;
        http_addr = Some(listener.local_addr().context("the HTTP port's address")?);
        let state = http::HttpState::new(
            exchange.clone(),
            ready.clone(),
            exchange.instance().to_string(),
            (!config.shared_secret.is_empty())
                .then(|| InternalAuth::from_secret(&config.shared_secret)),
            http_limits,
        );
        Some(tokio::spawn(http::serve(listener, state)))
    };
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    let off = || "off".to_string();
    let bound = [
        ("tcp", server.tcp_addr().map_or_else(off, |a| a.to_string())),
        ("http", http_addr.map_or_else(off, |a| a.to_string())),
        (
            "uds",
            server
                .uds_path()
                .map_or_else(off, |p| p.display().to_string()),
        ),
        (
            "admin",
            admin_uds
                .as_ref()
                .map_or_else(off, |p| p.display().to_string()),
        ),
        (
            "admin_tcp",
            admin_tcp_addr.map_or_else(off, |a| a.to_string()),
        ),
    ];
    tracing::info!(
        tcp = %bound[0].1,
        http = %bound[1].1,
        uds = %bound[2].1,
        admin = %bound[3].1,
        admin_tcp = %bound[4].1,
        memory_limit = %config.memory_limit,
        shards = exchange.shards(),
        runtime_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "binxd {} listening",
        env!("CARGO_PKG_VERSION")
    );
    if let Some(file) = &ready_file {
        write_ready_file(file, &bound)?;
    }
    let drain_exchange = exchange.clone();
    let grace = config.drain_grace.0;
    let stop_signal = async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
            _ = drain_requested.notified() => "admin StartDrain",
        };
        // A drain started by the admin service (a Kubernetes preStop hook)
        // is followed by the kubelet's SIGTERM: that one is not a "second
        // signal", or every preStop drain would end at once.
        let mut signals_before_stop = if name == "admin StartDrain" { 2 } else { 1 };
        // Readiness first, so no new work is routed here; then serve what is
        // held until consumers have it, the grace ends, or a second signal.
        ready.store(false, Ordering::Release);
        drain_exchange.start_drain();
        let held = drain_exchange.pages_held();
        if held == 0 {
            tracing::info!("{name} received: no page is held; stopping");
            return;
        }
        tracing::info!(
            "{name} received: draining {held} held pages for up to {grace:?} (send it again to stop now)"
        );
        let deadline = tokio::time::Instant::now() + grace;
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
        loop {
            tokio::select! {
                signal = async { tokio::select! { _ = terminate.recv() => "SIGTERM", _ = interrupt.recv() => "SIGINT" } } => {
                    signals_before_stop -= 1;
                    if signals_before_stop == 0 {
                        tracing::warn!("{signal} during the drain: stopping now with {} pages held", drain_exchange.pages_held());
                        return;
                    }
                    tracing::info!("{signal} during a drain the admin service started: draining goes on (send it again to stop now)");
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!("drain grace of {grace:?} ended with {} pages held; stopping", drain_exchange.pages_held());
                    return;
                }
                _ = tick.tick() => {
                    if drain_exchange.pages_held() == 0 {
                        tracing::info!("drained: every held page was consumed; stopping");
                        return;
                    }
                }
            }
        }
    };
    server.run(stop_signal).await;
    drop(admin_stop_tx);
    for task in admin_tasks {
        // Open admin connections get a moment to finish; the socket file goes.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), task).await;
    }
    // Objects released during the drain get a moment to be deleted.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    while exchange.deletes_in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    driver.abort();
    for task in spool_tasks {
        task.abort();
    }
    if let Some(task) = http_task {
        task.abort();
    }
    tracing::info!("binxd stopped");
    Ok(())
}
