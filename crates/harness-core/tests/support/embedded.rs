//! What every in-process loop test starts from: a store in a temporary directory, the embedded
//! bus over it, and the session store with `session::*` registered; then the loop itself. The
//! test crates of harness-approval and harness-router include this file by `#[path]`, so a
//! change to how the stack is opened is made once.

use std::sync::Arc;

use harness_bus::{Bus, EmbeddedBus};
use harness_core::{Harness, HarnessConfig};
use harness_session::SessionStore;
use harness_store::{Durability, Store};

pub struct Embedded {
    pub store: Store,
    pub bus: EmbeddedBus,
    pub shared: Arc<dyn Bus>,
    pub sessions: SessionStore,
    /// Holds the database; dropped last by whoever keeps it.
    pub dir: tempfile::TempDir,
}

pub async fn embedded() -> Embedded {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("t.db"), Durability::Normal).unwrap();
    let bus = EmbeddedBus::new(store.clone()).unwrap();
    let shared: Arc<dyn Bus> = Arc::new(bus.clone());
    let sessions = SessionStore::open(store.clone()).await.unwrap();
    harness_session::register(shared.as_ref(), &sessions);
    Embedded {
        store,
        bus,
        shared,
        sessions,
        dir,
    }
}

/// The loop's configuration in tests: frames are not coalesced, so a test sees each one.
pub fn config() -> HarnessConfig {
    HarnessConfig {
        stream_coalesce_ms: 0,
        ..HarnessConfig::default()
    }
}

/// The loop on `shared` with `config`, its functions registered, started.
pub async fn start_loop(shared: Arc<dyn Bus>, config: HarnessConfig) -> Harness {
    let harness = Harness::new(shared, config);
    harness_core::register(&harness);
    harness.start().await.unwrap();
    harness
}
