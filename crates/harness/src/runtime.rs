//! Wiring the embedded runtime: store, bus, siblings and loop, in one process.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use harness_bus::{Bus, EmbeddedBus};
use harness_core::{Harness, HarnessConfig};
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
}

/// A running embedded runtime.
pub struct Runtime {
    pub bus: EmbeddedBus,
    pub harness: Harness,
    pub sessions: SessionStore,
    pub store: Store,
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

fn load_script(path: Option<&Path>) -> Result<Script> {
    match path {
        Some(p) => Script::load(p).map_err(|e| anyhow::anyhow!("{e}")),
        None => Script::from_json(DEMO_SCRIPT).map_err(|e| anyhow::anyhow!("{e}")),
    }
}

impl Runtime {
    pub async fn open(opts: RuntimeOptions) -> Result<Runtime> {
        Runtime::open_layered(opts, |bus| bus).await
    }

    /// [`Runtime::open`], with `layer` wrapped around the bus that the loop and every sibling
    /// use (`harness bench` puts its timing probe there).
    pub async fn open_layered(
        opts: RuntimeOptions,
        layer: impl FnOnce(Arc<dyn Bus>) -> Arc<dyn Bus>,
    ) -> Result<Runtime> {
        std::fs::create_dir_all(&opts.data_dir)
            .with_context(|| format!("cannot create data dir {}", opts.data_dir.display()))?;
        let script = load_script(opts.script.as_deref())?;
        let store = Store::open(&opts.data_dir.join("harness.db"), opts.durability)
            .with_context(|| format!("cannot open the store in {}", opts.data_dir.display()))?;
        let bus = EmbeddedBus::new(store.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let shared: Arc<dyn Bus> = layer(Arc::new(bus.clone()));
        let sessions = SessionStore::open(store.clone())
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        harness_session::register(shared.as_ref(), &sessions);
        harness_context::register(shared.as_ref());
        let router = Router::new();
        router.add_provider(Arc::new(ScriptedProvider::new(script, shared.clone())));
        harness_router::register(shared.as_ref(), &router);
        if let Some(path) = &opts.fixtures {
            crate::fixtures::register(shared.as_ref(), path, opts.fixture_log.as_ref())?;
        }
        let harness = Harness::new(shared, opts.config);
        harness_core::register(&harness);
        harness.start().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Runtime {
            bus,
            harness,
            sessions,
            store,
        })
    }

    /// Stops taking steps; in-flight ones are left to redelivery on the next start.
    pub async fn shutdown(&self) {
        self.bus.shutdown().await;
    }
}
