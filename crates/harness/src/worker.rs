//! `harness worker`: the loop as a worker of an iii engine (feature `iii`).
//!
//! Registers the `harness::*` surface on the engine through `iii-sdk`, plus our own siblings named
//! by `--with` (so a bare engine and one `harness worker --with all` is a complete stack), and
//! uses the engine's calls, state and queue. See the `harness-iii` crate for what holds there.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use clap::ValueEnum;
use harness_bus::Bus;
use harness_iii::{IiiBus, IiiOptions, QueueMode, SelfCalls};

use crate::runtime::{open_on_iii, Siblings};

#[derive(Clone, Copy, ValueEnum)]
pub enum QueueModeArg {
    /// The engine's queue (`engine::queue::enqueue`) when a queue provider is registered, else
    /// a standard topic queue with per-session serialisation in the worker.
    Auto,
    /// Always `TriggerAction::Enqueue` (declare `harness-turn` in the queue worker's config).
    Enqueue,
    /// A standard topic queue (`iii::durable::publish` + `durable:subscriber`).
    Topic,
    /// A FIFO topic queue: one global line, no parallelism across sessions.
    Fifo,
    /// FIFO topic shards: a session always on the same FIFO topic, shards in parallel.
    Shards,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum SelfCallsArg {
    /// A call to a function this worker serves runs in-process, straight to its handler.
    InProcess,
    /// Such calls go out to the engine and back, like any other call.
    Engine,
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    /// The engine's worker endpoint.
    #[arg(long, env = "III_URL", default_value = "ws://127.0.0.1:49134")]
    engine: String,
    /// Our own siblings to register on the engine too: session, context, router, approval, tools,
    /// directory, all (comma-separated or repeated). Without it the deployment's siblings are
    /// used.
    #[arg(long, value_name = "LIST")]
    with: Vec<String>,
    #[arg(long, value_enum, default_value = "auto")]
    queue_mode: QueueModeArg,
    /// FIFO topics of the turn queue on the shards route: how many sessions can run a step at
    /// once on this engine.
    #[arg(long, default_value = "8")]
    queue_shards: u32,
    /// Where the worker's calls to functions it serves itself (`--with` siblings, its frame
    /// sink, its fixtures) run. Trigger actions (enqueue, void) always go through the engine.
    #[arg(
        long,
        value_enum,
        env = "HARNESS_III_SELF_CALLS",
        default_value = "in-process"
    )]
    self_calls: SelfCallsArg,
    /// The worker name: the engine leases it to one live connection per namespace, so every
    /// harness worker on one engine needs its own (default: `harness-<host>-<pid>`).
    #[arg(long)]
    worker_name: Option<String>,
    /// Seconds to wait for the engine to accept the worker and list its functions.
    #[arg(long, default_value = "30")]
    connect_timeout: u64,
    /// Serve the Prometheus `GET /metrics` of this worker on this loopback address
    /// (`127.0.0.1:9464`).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    runtime: crate::RuntimeArgs,
}

/// A worker name no other harness worker on the engine has: the host and the process id.
fn default_worker_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "host".into());
    format!("harness-{host}-{}", std::process::id())
}

pub async fn run(args: WorkerArgs) -> Result<()> {
    let with = Siblings::parse(&args.with)?;
    let opts = args.runtime.options()?;
    let data_dir = opts.data_dir.clone();
    let mut iii = IiiOptions::new(args.engine.clone());
    iii.worker_name = args.worker_name.clone().unwrap_or_else(default_worker_name);
    iii.connect_timeout = Duration::from_secs(args.connect_timeout.max(1));
    iii.shards = args.queue_shards.max(1);
    iii.self_calls = match args.self_calls {
        SelfCallsArg::InProcess => SelfCalls::InProcess,
        SelfCallsArg::Engine => SelfCalls::Engine,
    };
    // The write-ahead copy lives beside the worker's store, so it outlives the process.
    std::fs::create_dir_all(&data_dir)
        .map_err(|e| anyhow::anyhow!("cannot create the data dir {}: {e}", data_dir.display()))?;
    iii.journal = Some(data_dir.join("iii-write-ahead.db"));
    iii.queue_mode = match args.queue_mode {
        QueueModeArg::Auto => QueueMode::Auto,
        QueueModeArg::Enqueue => QueueMode::Enqueue,
        QueueModeArg::Topic => QueueMode::Topic,
        QueueModeArg::Fifo => QueueMode::TopicFifo,
        QueueModeArg::Shards => QueueMode::Shards,
    };
    let bus = IiiBus::connect(iii).await?;
    let shared: Arc<dyn Bus> = Arc::new(bus.clone());
    let approve = args.runtime.approve.clone();
    let rt = open_on_iii(opts, &bus, shared.clone(), with, approve.clone()).await?;
    let metrics = match args.metrics_listen {
        Some(addr) => match crate::telemetry::serve_metrics(addr, rt.telemetry.clone()).await {
            Ok(task) => Some((
                task,
                crate::telemetry::refresh_gauges(shared.clone(), rt.telemetry.clone()),
            )),
            Err(e) => {
                bus.shutdown().await;
                return Err(e);
            }
        },
        None => None,
    };
    eprintln!(
        "harness worker registered on {} (with {:?}; data dir {})",
        args.engine,
        with,
        data_dir.display()
    );
    let mut reconnects = bus.reconnects();
    let mut deposed = bus.deposed();
    loop {
        tokio::select! {
            _ = crate::shutdown_signal() => break,
            _ = deposed.wait_for(|d| *d) => {
                bus.shutdown().await;
                anyhow::bail!(
                    "another harness worker took this worker's sessions over while its link to the engine was down; start it again to stand by"
                );
            }
            changed = reconnects.changed() => {
                if changed.is_err() {
                    break;
                }
                // The bus has reconciled with the engine (given back the state it lost,
                // dropped the bindings it forgot); the steps that were in flight were ended
                // with the link: redrive them (and re-bind the sweep and the registry
                // notice), and only then accept new work again.
                // The approval gate's binding is ours too: an engine restart forgot it, and
                // `--approve` must keep holding calls.
                if with.approval && !approve.is_empty() {
                    if let Err(e) = harness_approval::install(shared.clone(), approve.clone()).await {
                        tracing::error!("re-binding the approval gate after a reconnect failed: {e}");
                    }
                }
                if let Err(e) = rt.harness.start().await {
                    tracing::error!("redrive after a reconnect failed: {e}");
                }
                bus.set_ready(true);
            }
        }
    }
    // Servers stopped (children closed, their functions unregistered) while the link is up.
    rt.mcp.shutdown().await;
    bus.shutdown().await;
    if let Some((task, gauges)) = metrics {
        task.abort();
        gauges.abort();
    }
    rt.telemetry.shutdown().await;
    eprintln!("harness worker stopped; unfinished steps resume on the next start");
    Ok(())
}
