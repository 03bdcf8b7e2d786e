//! `harness`: a thin, durable agent turn loop in one binary.
//!
//! `serve` runs the embedded runtime and its HTTP API, `chat` is a terminal chat (in-process or
//! against a server), `call` calls any function on a running server, `mcp` serves the harness as
//! an MCP server on stdio, `bench` measures the loop.

mod accept;
mod bench_host;
mod chat;
mod client;
mod config;
mod console;
mod fixtures;
mod http;
mod mcp;
mod memory;
mod runtime;
mod telemetry;
#[cfg(feature = "iii")]
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use harness_store::Durability;

use crate::runtime::{default_data_dir, Runtime, RuntimeOptions};

/// A step makes many small, short-lived allocations on several threads (messages, payloads,
/// store rows); the system allocator spent a sixth of the loop's CPU on them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "harness", version, about = "A thin, durable agent turn loop.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// API token: `serve` requires it on every request (and cannot bind a non-loopback address
    /// without one); `call` and `chat --url` send it as `Authorization: Bearer`.
    #[arg(long, global = true, env = "HARNESS_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum DurabilityArg {
    /// fsync at every durability point: survives power loss.
    Full,
    /// No fsync: survives a crash of the process, not a power loss. Faster.
    Normal,
}

impl From<DurabilityArg> for Durability {
    fn from(d: DurabilityArg) -> Self {
        match d {
            DurabilityArg::Full => Durability::Full,
            DurabilityArg::Normal => Durability::Normal,
        }
    }
}

#[derive(clap::Args, Clone)]
struct RuntimeArgs {
    /// Where the store lives (default: $HARNESS_DATA_DIR, else the per-user data directory).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Scripted-provider script (default: the bundled demo script).
    #[arg(long)]
    script: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "full")]
    durability: DurabilityArg,
    /// Minimum interval between streamed transcript writes, in ms (default 150).
    #[arg(long)]
    stream_coalesce_ms: Option<u64>,
    /// Context window, in tokens, of a model the catalog knows only by a catch-all row (any
    /// local model) or not at all; a server that reports its window is asked first.
    #[arg(long)]
    context_window: Option<u64>,
    /// Loop configuration file, YAML or JSON (`default_max_turns`, `max_result_bytes`, ...;
    /// `${ENV}` expanded). `serve` reloads it when it changes. `HARNESS_<KEY>` variables and
    /// flags win over it; `harness config show` tells where each value came from.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Register fixture functions from this JSON file (tests and demos).
    #[arg(long)]
    fixtures: Option<PathBuf>,
    /// Append every fixture invocation to this file (one fsynced JSON line each).
    #[arg(long, requires = "fixtures")]
    fixture_log: Option<PathBuf>,
    /// Hold calls of functions matching this glob until a person approves them (repeatable):
    /// `approval::list` / `approval::decide`, or y/n in `harness chat`.
    #[arg(long = "approve", value_name = "GLOB")]
    approve: Vec<String>,
    /// Export one OpenTelemetry trace per turn to this OTLP/HTTP receiver
    /// (`http://127.0.0.1:4318`); sets the config key `otel_endpoint`.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
}

impl RuntimeArgs {
    /// The configuration keys set by flags.
    fn config_flags(&self) -> config::Flags {
        let mut flags = config::Flags::new();
        if let Some(ms) = self.stream_coalesce_ms {
            flags.push(("stream_coalesce_ms", "stream-coalesce-ms", ms.into()));
        }
        if let Some(tokens) = self.context_window {
            flags.push(("default_context_window", "context-window", tokens.into()));
        }
        if let Some(url) = &self.otlp_endpoint {
            flags.push(("otel_endpoint", "otlp-endpoint", url.clone().into()));
        }
        flags
    }

    fn options(&self) -> Result<RuntimeOptions> {
        let effective = config::resolve(self.config.as_deref(), &self.config_flags())?;
        for warning in effective.inert_warnings() {
            eprintln!("harness: {warning}");
        }
        let config = effective.config;
        Ok(RuntimeOptions {
            data_dir: self.data_dir.clone().unwrap_or_else(default_data_dir),
            script: self.script.clone(),
            durability: self.durability.into(),
            config,
            fixtures: self.fixtures.clone(),
            fixture_log: self.fixture_log.clone(),
            config_file: self.config.clone(),
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded runtime and the HTTP API until SIGINT/SIGTERM.
    Serve {
        /// Any address other than loopback requires `--token`.
        #[arg(long, default_value = "127.0.0.1:3113")]
        listen: SocketAddr,
        /// Largest request body accepted, in bytes.
        #[arg(long, default_value_t = http::DEFAULT_MAX_BODY_BYTES)]
        max_body_bytes: usize,
        /// Event streams one client address may hold open at once.
        #[arg(long, default_value_t = http::DEFAULT_MAX_STREAMS_PER_CLIENT)]
        max_streams_per_client: usize,
        /// Connections one client address may hold open at once; past it a new one is
        /// answered 429 and closed.
        #[arg(long, default_value_t = accept::DEFAULT_MAX_CONNECTIONS_PER_CLIENT)]
        max_connections_per_client: usize,
        /// Time a client has to send a whole request head before its connection is closed, in ms.
        #[arg(long, default_value_t = accept::DEFAULT_HEADER_READ_TIMEOUT_MS)]
        header_read_timeout_ms: u64,
        /// Serve no web console at `/` (same as the config key `console: false`).
        #[arg(long)]
        no_console: bool,
        /// Serve no Prometheus `GET /metrics` (a 404, as any unknown route).
        #[arg(long)]
        no_metrics: bool,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Show the effective loop configuration, or validate a configuration file.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Call a function on a running server and print its JSON result.
    Call {
        function_id: String,
        /// The JSON payload (default `{}`).
        json: Option<String>,
        #[arg(long, default_value = "http://127.0.0.1:3113")]
        url: String,
    },
    /// A terminal chat that streams the reply as it arrives.
    Chat {
        #[command(flatten)]
        chat: chat::ChatArgs,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Serve the harness as an MCP server on stdin/stdout (tools: send, status, stop, answer,
    /// approvals_list, approvals_decide), for editors and other agents. In-process, or in front
    /// of a running server with --url.
    Mcp {
        /// Drive a running server instead of an in-process runtime.
        #[arg(long)]
        url: Option<String>,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Measure loop overhead, handoff latency, durable throughput and memory per idle session.
    Bench(harness_bench::BenchArgs),
    /// Run the loop as a worker of an iii engine: register `harness::*` (and the `--with`
    /// siblings) there and use the engine's calls, state and queue (feature `iii`).
    #[cfg(feature = "iii")]
    Worker(worker::WorkerArgs),
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print every key's effective value and where it came from (default, file, env, flag).
    Show {
        #[command(flatten)]
        runtime: RuntimeArgs,
        /// JSON: `{key: {value, source}}`.
        #[arg(long)]
        json: bool,
    },
    /// Check a configuration file: unknown keys, types, `${ENV}` references, the cron.
    Validate { file: PathBuf },
}

fn config_command(cmd: ConfigCommand) -> Result<()> {
    match cmd {
        ConfigCommand::Show { runtime, json } => {
            let effective = config::resolve(runtime.config.as_deref(), &runtime.config_flags())?;
            print!("{}", config::show(&effective, json)?);
            if json {
                println!();
            }
        }
        ConfigCommand::Validate { file } => {
            let keys = config::read_file(&file)?;
            println!("{}: ok ({} keys set)", file.display(), keys.len());
        }
    }
    Ok(())
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HARNESS_LOG")
        .unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

struct ServeArgs {
    listen: SocketAddr,
    token: Option<String>,
    max_body_bytes: usize,
    max_streams_per_client: usize,
    no_console: bool,
    no_metrics: bool,
    limits: accept::Limits,
}

async fn serve(s: ServeArgs, args: RuntimeArgs) -> Result<()> {
    let listen = s.listen;
    let guard = |addr| {
        http::Guard::new(
            addr,
            s.token.as_deref(),
            s.max_body_bytes,
            s.max_streams_per_client,
        )
    };
    // Refuse an unlocked public bind before anything is opened.
    guard(listen)?;
    let opts = args.options()?;
    let data_dir = opts.data_dir.clone();
    let console = opts.config.console && !s.no_console;
    let rt = Runtime::open(opts, args.approve.clone()).await?;
    let watcher = args.config.clone().map(|file| {
        config::watch(
            file,
            args.config_flags(),
            rt.harness.bus().clone(),
            rt.mcp.clone(),
        )
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    // The Host check needs the port actually bound (`--listen 127.0.0.1:0`).
    let app = http::router(http::AppState {
        bus: rt.bus.clone(),
        sessions: rt.sessions.clone(),
        guard: std::sync::Arc::new(guard(listener.local_addr()?)?),
        console,
        metrics: (!s.no_metrics).then(|| rt.telemetry.clone()),
    });
    let gauges = (!s.no_metrics)
        .then(|| telemetry::refresh_gauges(rt.harness.bus().clone(), rt.telemetry.clone()));
    eprintln!(
        "harness serving on http://{} (data dir {})",
        listener.local_addr()?,
        data_dir.display()
    );
    if harness_core::usage::enabled(rt.harness.config().usage_reporting) {
        eprintln!("usage announcements: local only (harness::usage::list), off with HARNESS_TELEMETRY_ENABLED=false");
    } else {
        eprintln!("usage announcements: off");
    }
    if console {
        // The token stays out of the log: the page reads it from the fragment, which no
        // request carries.
        let hint = if s.token.is_some() {
            " (append #token=<your token>)"
        } else {
            ""
        };
        eprintln!("console: http://{}/{hint}", listener.local_addr()?);
    }
    accept::serve(listener, app, s.limits, shutdown_signal()).await;
    if let Some(w) = watcher {
        w.abort();
    }
    if let Some(g) = gauges {
        g.abort();
    }
    rt.shutdown().await;
    eprintln!("harness stopped; unfinished steps resume on the next start");
    Ok(())
}

fn main() {
    init_tracing();
    memory::release_when_idle();
    let cli = Cli::parse();
    client::set_token(cli.token.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve {
                listen,
                max_body_bytes,
                max_streams_per_client,
                max_connections_per_client,
                header_read_timeout_ms,
                no_console,
                no_metrics,
                runtime,
            } => {
                let limits =
                    accept::Limits::new(header_read_timeout_ms, max_connections_per_client)?;
                let s = ServeArgs {
                    listen,
                    token: cli.token,
                    max_body_bytes,
                    max_streams_per_client,
                    no_console,
                    no_metrics,
                    limits,
                };
                serve(s, runtime).await
            }
            Command::Config(cmd) => config_command(cmd),
            Command::Call {
                function_id,
                json,
                url,
            } => client::call(&url, &function_id, json.as_deref()).await,
            Command::Chat { chat, runtime } => {
                chat::run(chat, runtime.options()?, runtime.approve.clone()).await
            }
            Command::Mcp { url, runtime } => {
                mcp::run(url, runtime.options()?, runtime.approve.clone()).await
            }
            Command::Bench(args) => harness_bench::run(args, &bench_host::BinaryHost).await,
            #[cfg(feature = "iii")]
            Command::Worker(args) => worker::run(args).await,
        }
    });
    if let Err(e) = result {
        eprintln!("harness: {e:#}");
        std::process::exit(1);
    }
}
