//! Wiring the embedded runtime: store, bus, siblings and loop, in one process.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use harness_bus::{Bus, EmbeddedBus};
use harness_core::{Harness, HarnessConfig};
use harness_mcp::McpHub;
use harness_router::scripted::{Script, ScriptedProvider};
use harness_router::Router;
use harness_session::SessionStore;
use harness_store::{Durability, Store};

/// The demo script shipped inside the binary.
pub const DEMO_SCRIPT: &str = include_str!("../demo/script.json");

pub struct RuntimeOptions {
    pub data_dir: PathBuf,
    /// None = the bundled demo script.
    pub script: Option<PathBuf>,
    pub durability: Durability,
    pub config: HarnessConfig,
    /// Fixture functions to register (`--fixtures`), and where to log their invocations.
    pub fixtures: Option<PathBuf>,
    pub fixture_log: Option<PathBuf>,
    /// The loop configuration file (`--config`), kept out of the built-in tools' reach.
    pub config_file: Option<PathBuf>,
}

/// A running embedded runtime.
pub struct Runtime {
    pub bus: EmbeddedBus,
    /// The configured MCP servers (`mcp_servers`), connecting in the background.
    pub mcp: McpHub,
    pub harness: Harness,
    pub sessions: SessionStore,
    pub store: Store,
    /// The `/metrics` registry and the span exporter, if any.
    pub telemetry: harness_telemetry::Installed,
}

/// `--data-dir`, else `HARNESS_DATA_DIR`, else the per-user data directory.
pub fn default_data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HARNESS_DATA_DIR") {
        return PathBuf::from(dir);
    }
    dirs::data_local_dir()
        .unwrap_or_else(|| PathBuf::from("."))
        .join("harness")
}

/// The built-in tools (`fs::*`, `shell::exec`, `web::fetch`) with what they must never reach:
/// the data directory, every configuration file the harness reads, and the fixture files.
/// `web_fetch_allow_private` is read from the live configuration on every fetch.
fn tools(opts: &RuntimeOptions, harness: &Harness) -> harness_tools::Tools {
    let protected = protected_paths(opts);
    // The same paths can never be granted to a session (harness::filesystem::grant).
    harness.set_protected_paths(protected.clone());
    let live = harness.clone();
    let shell = harness.clone();
    let results = harness.clone();
    let limits = harness_tools::Limits {
        allow_private: Arc::new(move || live.config().web_fetch_allow_private),
        // shell::exec cuts its output to fit the loop's cap rather than be elided whole.
        max_result_bytes: Arc::new(move || results.config().result_cap()),
        shell_policy: Arc::new(move || {
            let config = shell.config();
            harness_tools::ShellPolicy {
                unconfined: config.shell_exec_unconfined,
                allow_network: config.shell_exec_allow_network,
                read_paths: config
                    .shell_exec_read_paths
                    .iter()
                    .map(|p| expand_home(p))
                    .collect(),
                scrub_env: config.shell_exec_scrub_env.clone(),
            }
        }),
        ..harness_tools::Limits::default()
    };
    harness_tools::Tools::new(protected, limits)
}

/// What no tool call and no filesystem grant may reach.
fn protected_paths(opts: &RuntimeOptions) -> Vec<PathBuf> {
    let mut protected = vec![opts.data_dir.clone()];
    protected.extend(opts.config_file.clone());
    protected.extend(opts.fixtures.clone());
    protected.extend(opts.fixture_log.clone());
    for var in [
        harness_router::providers::CONFIG_ENV,
        harness_router::providers::CATALOG_ENV,
    ] {
        protected.extend(std::env::var_os(var).map(PathBuf::from));
    }
    // The router's default configuration lives here, next to anything else of ours.
    protected.extend(dirs::config_dir().map(|d| d.join("harness")));
    protected
        .into_iter()
        .map(|p| std::path::absolute(&p).unwrap_or(p))
        .collect()
}

/// `~/rest` as a path in the user's home; anything else as written.
fn expand_home(p: &str) -> PathBuf {
    match (p.strip_prefix("~/"), dirs::home_dir()) {
        (Some(rest), Some(home)) => home.join(rest),
        _ => PathBuf::from(p),
    }
}

/// The directory's folder: `directory_path` (`~` expanded), else `directory/` in the data dir.
pub fn directory_path(config: &HarnessConfig, data_dir: &Path) -> PathBuf {
    match config.directory_path.as_deref() {
        Some(p) => expand_home(p),
        None => data_dir.join("directory"),
    }
}

fn load_script(path: Option<&Path>) -> Result<Script> {
    match path {
        Some(p) => Script::load(p).map_err(|e| anyhow::anyhow!("{e}")),
        None => Script::from_json(DEMO_SCRIPT).map_err(|e| anyhow::anyhow!("{e}")),
    }
}

/// Both runtimes' last steps once the siblings are registered on `bus`: telemetry (before
/// `start`, so the turns it redrives are traced and counted too), the `harness::*` surface, the
/// tools, the fixtures (after the tools: a fixture of the same id, for tests and demos, takes
/// their place), `approval::*` with the gate binding for `approve` (before `start`: a
/// redelivered step may meet the persisted binding), the loop, and last the MCP servers (a tool
/// list that arrives announces itself through `harness::on-functions-change`; this returns at
/// once, and a server that cannot start is logged and retried, never fatal).
async fn start_loop(
    harness: &Harness,
    bus: &Arc<dyn Bus>,
    opts: &RuntimeOptions,
    with: &Siblings,
    approve: Vec<String>,
    mcp_servers: Vec<harness_mcp::ServerSpec>,
) -> Result<(harness_telemetry::Installed, McpHub)> {
    let telemetry = crate::telemetry::install(harness, &opts.config)?;
    harness_core::register(harness);
    if with.tools {
        harness_tools::register(bus.as_ref(), &tools(opts, harness));
    }
    if let Some(path) = &opts.fixtures {
        crate::fixtures::register(bus.as_ref(), path, opts.fixture_log.as_ref())?;
    }
    if with.approval {
        harness_approval::install(harness.bus().clone(), approve)
            .await
            .map_err(|e| anyhow::anyhow!("--approve: {e}"))?;
    }
    harness.start().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let mcp = McpHub::new(harness.bus().clone(), Default::default());
    mcp.apply(mcp_servers).await;
    Ok((telemetry, mcp))
}

impl Runtime {
    /// `approve`: function globs held for a human approval (`--approve`; empty = none).
    pub async fn open(opts: RuntimeOptions, approve: Vec<String>) -> Result<Runtime> {
        Runtime::open_with(opts, approve, |bus| bus).await
    }

    /// [`Runtime::open`], with `layer` wrapped around the bus that the loop and every sibling
    /// use (`harness bench` puts its timing probe there).
    pub async fn open_layered(
        opts: RuntimeOptions,
        layer: impl FnOnce(Arc<dyn Bus>) -> Arc<dyn Bus>,
    ) -> Result<Runtime> {
        Runtime::open_with(opts, Vec::new(), layer).await
    }

    async fn open_with(
        opts: RuntimeOptions,
        approve: Vec<String>,
        layer: impl FnOnce(Arc<dyn Bus>) -> Arc<dyn Bus>,
    ) -> Result<Runtime> {
        std::fs::create_dir_all(&opts.data_dir)
            .with_context(|| format!("cannot create data dir {}", opts.data_dir.display()))?;
        let mcp_servers = crate::config::mcp_servers(&opts.config)?;
        let script = load_script(opts.script.as_deref())?;
        let store = Store::open(&opts.data_dir.join("harness.db"), opts.durability)
            .with_context(|| format!("cannot open the store in {}", opts.data_dir.display()))?;
        let bus = EmbeddedBus::new(store.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let shared: Arc<dyn Bus> = layer(Arc::new(bus.clone()));
        let sessions = SessionStore::open(store.clone())
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        harness_session::register(shared.as_ref(), &sessions);
        // So a step's batched writes (`Bus::commit`) that touch the transcript stay one commit.
        harness_session::register_transactional(&bus, &sessions);
        harness_context::register(shared.clone());
        harness_directory::register(
            shared.as_ref(),
            &harness_directory::Directory::new(directory_path(&opts.config, &opts.data_dir)),
        );
        let router = Router::new();
        router.add_provider(Arc::new(ScriptedProvider::new(script, shared.clone())));
        // Real providers from the environment / router config; the scripted one stays default.
        harness_router::register_from_env(&router).map_err(|e| anyhow::anyhow!("{e}"))?;
        harness_router::register(shared.as_ref(), &router);
        let config = opts.config.clone();
        let harness = Harness::new(shared.clone(), config);
        // Tools and approvals always (approvals left from an earlier run stay decidable).
        let (telemetry, mcp) = start_loop(
            &harness,
            &shared,
            &opts,
            &Siblings::ALL,
            approve,
            mcp_servers,
        )
        .await?;
        Ok(Runtime {
            bus,
            mcp,
            harness,
            sessions,
            store,
            telemetry,
        })
    }

    /// Stops taking steps; in-flight ones are left to redelivery on the next start. Closes the
    /// store last: its writer drains what was queued and empties the WAL, so a clean stop
    /// leaves the data directory holding what it stores (a later write answers `Closed`).
    pub async fn shutdown(&self) {
        self.mcp.shutdown().await;
        self.bus.shutdown().await;
        self.telemetry.shutdown().await;
        let store = self.store.clone();
        let _ = tokio::task::spawn_blocking(move || store.close()).await;
    }
}

// --- worker mode: the same runtime on a given bus (`harness worker`, `harness bench --iii`) ----

/// Which of our own siblings a runtime on a given bus registers (`harness worker --with`); the
/// rest is left to whatever the deployment runs on the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(not(feature = "iii"), allow(dead_code))]
pub struct Siblings {
    /// `session::*` (the transcript store, SQLite in the data dir).
    pub session: bool,
    /// `context::*`.
    pub context: bool,
    /// `router::*` (the scripted provider plus the providers the environment configures).
    pub router: bool,
    /// `approval::*` (and the `--approve` gate binding).
    pub approval: bool,
    /// The built-in tools: `fs::*`, `shell::exec`, `web::fetch` (run on the worker's machine).
    pub tools: bool,
    /// `directory::*` (agent profiles, skills, system prompts from `directory_path`).
    pub directory: bool,
}

#[cfg_attr(not(feature = "iii"), allow(dead_code))]
impl Siblings {
    pub const ALL: Siblings = Siblings {
        session: true,
        context: true,
        router: true,
        approval: true,
        tools: true,
        directory: true,
    };

    /// `session,context,router,approval,tools,directory` or `all` (comma-separated, repeatable).
    pub fn parse(items: &[String]) -> Result<Siblings> {
        let mut s = Siblings::default();
        for item in items.iter().flat_map(|i| i.split(',')).map(str::trim) {
            match item {
                "" => {}
                "all" => s = Siblings::ALL,
                "session" => s.session = true,
                "context" => s.context = true,
                "router" => s.router = true,
                "approval" => s.approval = true,
                "tools" => s.tools = true,
                "directory" => s.directory = true,
                other => anyhow::bail!(
                    "--with: unknown sibling '{other}' (expected session, context, router, approval, tools, directory or all)"
                ),
            }
        }
        Ok(s)
    }
}

/// [`Runtime::open_on_bus`] on an iii engine's bus, `shared` being it (or a layer around it),
/// then its public functions opened: only now can the worker serve `harness::send`, the queue
/// ensured and every sibling and internal function registered. Either failing shuts the
/// connection down.
#[cfg(feature = "iii")]
pub async fn open_on_iii(
    opts: RuntimeOptions,
    bus: &harness_iii::IiiBus,
    shared: Arc<dyn Bus>,
    with: Siblings,
    approve: Vec<String>,
) -> Result<BusRuntime> {
    let rt = match Runtime::open_on_bus(opts, shared, with, approve).await {
        Ok(rt) => rt,
        Err(e) => {
            bus.shutdown().await;
            return Err(e);
        }
    };
    if let Err(e) = bus.open().await {
        bus.shutdown().await;
        return Err(anyhow::anyhow!("{e}"));
    }
    Ok(rt)
}

/// A runtime on a bus it was given (not the embedded one). The fields are for callers that
/// inspect it (`harness bench --iii`).
#[allow(dead_code)]
pub struct BusRuntime {
    pub bus: Arc<dyn Bus>,
    pub harness: Harness,
    /// The transcript store, when `session` is one of the siblings.
    pub sessions: Option<SessionStore>,
    pub store: Option<Store>,
    /// The configured MCP servers (`mcp_servers`): their tools are registered on this bus, so
    /// on an engine they are functions of this worker.
    pub mcp: McpHub,
    pub telemetry: harness_telemetry::Installed,
}

#[cfg_attr(not(feature = "iii"), allow(dead_code))]
impl Runtime {
    /// Registers the `harness::*` surface, the chosen siblings and the fixtures on `bus`, then
    /// starts the loop (ensures the `harness-turn` queue, redrives running turns). The same
    /// wiring as [`Runtime::open`]; only the bus and the set of siblings differ.
    pub async fn open_on_bus(
        opts: RuntimeOptions,
        bus: Arc<dyn Bus>,
        with: Siblings,
        approve: Vec<String>,
    ) -> Result<BusRuntime> {
        // Checked before anything is registered: a bad entry stops the start, named.
        let mcp_servers = crate::config::mcp_servers(&opts.config)?;
        let (sessions, store) = if with.session {
            std::fs::create_dir_all(&opts.data_dir)
                .with_context(|| format!("cannot create data dir {}", opts.data_dir.display()))?;
            // Shared: a standby worker with `--with session` shares the serving worker's data
            // dir (and serves only once that one is gone); an embedded runtime is kept out.
            let store = Store::open_shared(&opts.data_dir.join("harness.db"), opts.durability)
                .with_context(|| format!("cannot open the store in {}", opts.data_dir.display()))?;
            let sessions = SessionStore::open(store.clone())
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            harness_session::register(bus.as_ref(), &sessions);
            (Some(sessions), Some(store))
        } else {
            (None, None)
        };
        if with.context {
            harness_context::register(bus.clone());
        }
        if with.directory {
            harness_directory::register(
                bus.as_ref(),
                &harness_directory::Directory::new(directory_path(&opts.config, &opts.data_dir)),
            );
        }
        if with.router {
            let script = load_script(opts.script.as_deref())?;
            let router = Router::new();
            router.add_provider(Arc::new(ScriptedProvider::new(script, bus.clone())));
            harness_router::register_from_env(&router).map_err(|e| anyhow::anyhow!("{e}"))?;
            harness_router::register(bus.as_ref(), &router);
        }
        let harness = Harness::new(bus.clone(), opts.config.clone());
        harness.set_protected_paths(protected_paths(&opts));
        let (telemetry, mcp) =
            start_loop(&harness, &bus, &opts, &with, approve, mcp_servers).await?;
        Ok(BusRuntime {
            bus,
            harness,
            sessions,
            store,
            telemetry,
            mcp,
        })
    }
}
