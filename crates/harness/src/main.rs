//! `harness`: a thin, durable agent turn loop in one binary.
//!
//! `serve` runs the embedded runtime and its HTTP API, `chat` is a terminal chat (in-process or
//! against a server), `call` calls any function on a running server, `bench` measures the loop.

mod bench_host;
mod chat;
mod client;
mod fixtures;
mod http;
mod runtime;
#[cfg(feature = "iii")]
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use harness_core::HarnessConfig;
use harness_store::Durability;

use crate::runtime::{default_data_dir, Runtime, RuntimeOptions};

#[derive(Parser)]
#[command(name = "harness", version, about = "A thin, durable agent turn loop.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    /// Context window assumed for models with no catalog entry, in tokens.
    #[arg(long)]
    context_window: Option<u64>,
    /// Loop configuration, a JSON object (`default_max_turns`, `max_result_bytes`,
    /// `call_reconciliation`, ...); flags given explicitly win.
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
}

impl RuntimeArgs {
    fn options(&self) -> Result<RuntimeOptions> {
        let mut config = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read config {}", path.display()))?;
                let value: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("config {}: not JSON", path.display()))?;
                harness_types::parse::parse_payload::<HarnessConfig>(value)
                    .map_err(|e| anyhow::anyhow!("config {}: {}", path.display(), e.message))?
            }
            None => HarnessConfig::default(),
        };
        if let Some(ms) = self.stream_coalesce_ms {
            config.stream_coalesce_ms = ms;
        }
        if let Some(tokens) = self.context_window {
            config.default_context_window = tokens;
        }
        Ok(RuntimeOptions {
            data_dir: self.data_dir.clone().unwrap_or_else(default_data_dir),
            script: self.script.clone(),
            durability: self.durability.into(),
            config,
            fixtures: self.fixtures.clone(),
            fixture_log: self.fixture_log.clone(),
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded runtime and the HTTP API until SIGINT/SIGTERM.
    Serve {
        #[arg(long, default_value = "127.0.0.1:3113")]
        listen: SocketAddr,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
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
        /// Send this one message, print the reply, and exit.
        #[arg(short = 'm', long = "message")]
        message: Option<String>,
        #[arg(long)]
        session: Option<String>,
        /// scripted, anthropic, openai, openai-responses, openai-compatible, ollama, llamacpp,
        /// vllm, lmstudio (default: the router config's, else whichever API key is set, else the
        /// scripted demo).
        #[arg(long)]
        provider: Option<String>,
        /// Default: the router config's, else the provider's catalog default (a local server's
        /// first listed model).
        #[arg(long)]
        model: Option<String>,
        /// Talk to a running server instead of an in-process runtime.
        #[arg(long)]
        url: Option<String>,
        /// Let the model call functions matching this glob (repeatable; default none: a plain
        /// chat).
        #[arg(long = "allow", value_name = "GLOB")]
        allow: Vec<String>,
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

async fn serve(listen: SocketAddr, args: RuntimeArgs) -> Result<()> {
    let opts = args.options()?;
    let data_dir = opts.data_dir.clone();
    let rt = Runtime::open(opts, args.approve.clone()).await?;
    let app = http::router(http::AppState {
        bus: rt.bus.clone(),
        sessions: rt.sessions.clone(),
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    eprintln!(
        "harness serving on http://{} (data dir {})",
        listener.local_addr()?,
        data_dir.display()
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    rt.shutdown().await;
    eprintln!("harness stopped; unfinished steps resume on the next start");
    Ok(())
}

fn main() {
    init_tracing();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve { listen, runtime } => serve(listen, runtime).await,
            Command::Call {
                function_id,
                json,
                url,
            } => client::call(&url, &function_id, json.as_deref()).await,
            Command::Chat {
                message,
                session,
                provider,
                model,
                url,
                allow,
                runtime,
            } => {
                chat::run(chat::ChatArgs {
                    message,
                    session,
                    provider,
                    model,
                    url,
                    allow,
                    approve: runtime.approve.clone(),
                    runtime: runtime.options()?,
                })
                .await
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
