//! The bench's own figures, each phase run on a tiny budget ([`Plan::tiny`]) on an in-process
//! runtime wired as the binary wires it (minus the tools no phase calls). The tests assert that
//! the numbers are sane and the report whole, never how fast anything is: the machine is shared.

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use async_trait::async_trait;
use harness_bus::{Bus, EmbeddedBus};
use harness_core::{Harness, TURN_QUEUE};
use harness_router::scripted::{Script, ScriptedProvider};
use harness_router::Router;
use harness_session::SessionStore;
use harness_store::Store;
use tokio::sync::{Mutex, MutexGuard};

use crate::host::{Host, Opened, RigSpec};
use crate::plan::Plan;
use crate::rig::{At, Mode};
use crate::stats::Percentiles;

mod phases;
mod report;
mod units;

/// Opens each phase's runtime in-process: store, embedded bus (wrapped in the probe), sessions,
/// context, the scripted router and the loop.
struct TestHost;

#[async_trait]
impl Host for TestHost {
    async fn open(&self, iii: Option<&str>, spec: RigSpec) -> Result<Opened> {
        if let Some(url) = iii {
            return Err(anyhow!(
                "the tests' host runs in-process only, not on {url}"
            ));
        }
        std::fs::create_dir_all(&spec.data_dir)?;
        let text = std::fs::read_to_string(&spec.script)
            .with_context(|| format!("cannot read {}", spec.script.display()))?;
        let script = Script::from_json(&text).map_err(|e| anyhow!("{e}"))?;
        let store = Store::open(&spec.data_dir.join("harness.db"), spec.durability)?;
        let bus = EmbeddedBus::new(store.clone()).map_err(|e| anyhow!("{e}"))?;
        let shared: Arc<dyn Bus> = (spec.layer)(Arc::new(bus.clone()));
        let sessions = SessionStore::open(store.clone())
            .await
            .map_err(|e| anyhow!("{e}"))?;
        harness_session::register(shared.as_ref(), &sessions);
        harness_session::register_transactional(&bus, &sessions);
        harness_context::register(shared.clone());
        let router = Router::new();
        router.add_provider(Arc::new(ScriptedProvider::new(script, shared.clone())));
        harness_router::register(shared.as_ref(), &router);
        let harness = Harness::new(shared, spec.config);
        harness_core::register(&harness);
        harness.start().await.map_err(|e| anyhow!("{e}"))?;
        // As the binary does: on the embedded bus itself, once the loop runs.
        if let Some(register) = &spec.register {
            register(&bus);
        }
        let depth = bus.clone();
        let closing = store.clone();
        Ok(Opened {
            harness,
            store: Some(store),
            queue_depth: Some(Box::new(move || depth.queues().depth(TURN_QUEUE))),
            close: Box::new(move || {
                Box::pin(async move {
                    bus.shutdown().await;
                    let _ = tokio::task::spawn_blocking(move || closing.close()).await;
                })
            }),
        })
    }

    fn check_iii(&self, url: &str) -> Result<()> {
        Err(anyhow!(
            "the tests' host runs in-process only, not on {url}"
        ))
    }
}

/// One phase at a time: the figures read the whole process (RSS, CPU time), which a phase
/// running beside would move.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// A test's turn at measuring: the others wait, and its phases' stores go in a directory of
/// its own.
struct Bench {
    _serial: MutexGuard<'static, ()>,
    dir: tempfile::TempDir,
    /// The phases' sizes: [`Plan::tiny`] unless the test asks for others.
    plan: Plan,
}

impl Bench {
    async fn new() -> Bench {
        Bench::with(Plan::tiny()).await
    }

    async fn with(plan: Plan) -> Bench {
        Bench {
            _serial: SERIAL.lock().await,
            dir: tempfile::tempdir().unwrap(),
            plan,
        }
    }

    /// Where the phases open their runtimes: in-process, in this test's directory.
    fn at(&self) -> At<'_> {
        At {
            mode: Mode::Embedded,
            base: self.dir.path(),
            host: &TestHost,
        }
    }

    /// Runs a phase (or every phase) at this test's sizes and in its directory; it must
    /// succeed.
    async fn run<T>(&self, phase: impl AsyncFnOnce(At<'_>, &Plan) -> Result<T>) -> T {
        phase(self.at(), &self.plan).await.unwrap()
    }
}

/// Asserts `x` is a finite number above zero, naming the figure.
fn positive(name: &str, x: f64) {
    assert!(
        x.is_finite() && x > 0.0,
        "{name} = {x}: not a finite positive number"
    );
}

/// Asserts a p50 is positive and no larger than its p99.
fn percentiles(name: &str, p: &Percentiles) {
    positive(&format!("{name} p50"), p.p50);
    assert!(p.p50 <= p.p99, "{name}: p50 {} above p99 {}", p.p50, p.p99);
}
