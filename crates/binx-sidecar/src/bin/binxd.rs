//! binxd: the binx exchange daemon. Runs with no configuration at all
//! (TCP 127.0.0.1:8091, a Unix socket under the temp dir, HTTP on
//! 127.0.0.1:8090, logs on stderr); see `binxd --help`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use binx_server::{BinxServer, Exchange};
use binx_sidecar::config::{Config, ConfigOverrides};
use binx_sidecar::http;
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
    #[command(flatten)]
    overrides: ConfigOverrides,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("binxd: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if args.list_config_keys {
        for (key, env, default, doc) in Config::keys() {
            println!("{key}\t{env}\t{default}\t{doc}");
        }
        return Ok(());
    }
    let config = Config::load(args.config.as_deref(), &args.overrides)?;
    if args.print_config {
        print!("{}", config.to_toml());
        return Ok(());
    }
    init_logging(&config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("binxd")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(config))
}

fn init_logging(config: &Config) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log_level)
        .with_context(|| format!("log_level {:?} is not a valid filter", config.log_level))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if config.log_format == "json" {
        builder.json().init();
    } else {
        builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
    Ok(())
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let exchange = Exchange::new(config.manager_config());
    let sweeper = exchange.spawn_sweeper();
    let server = BinxServer::bind(exchange.clone(), config.listen_config()).await?;
    let ready = Arc::new(AtomicBool::new(true));
    let http_task = if config.http_listen.is_empty() {
        None
    } else {
        let listener = tokio::net::TcpListener::bind(&config.http_listen)
            .await
            .with_context(|| format!("cannot listen for HTTP on {}", config.http_listen))?;
        let state = http::HttpState {
            exchange: exchange.clone(),
            ready: ready.clone(),
            instance_id: http::new_instance_id(),
        };
        Some(tokio::spawn(http::serve(listener, state)))
    };
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    tracing::info!(
        tcp = server.tcp_addr().map(|a| a.to_string()).unwrap_or_else(|| "off".into()),
        uds = server.uds_path().map(|p| p.display().to_string()).unwrap_or_else(|| "off".into()),
        http = if config.http_listen.is_empty() { "off" } else { config.http_listen.as_str() },
        memory_limit = %config.memory_limit,
        "binxd {} listening",
        env!("CARGO_PKG_VERSION")
    );
    let drain_exchange = exchange.clone();
    let grace = config.drain_grace.0;
    let stop_signal = async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
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
                _ = terminate.recv() => { tracing::warn!("second signal: stopping now with {} pages held", drain_exchange.pages_held()); return; }
                _ = interrupt.recv() => { tracing::warn!("second signal: stopping now with {} pages held", drain_exchange.pages_held()); return; }
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
    sweeper.abort();
    if let Some(task) = http_task {
        task.abort();
    }
    tracing::info!("binxd stopped");
    Ok(())
}
