//! What the bench needs from whoever wires the runtime: the binary opens each phase's loop with
//! its own wiring (embedded, or as a worker of an iii engine), so the bench measures exactly
//! what `harness serve` and `harness worker` run, without depending on the binary.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;
use harness_bus::Bus;
use harness_core::{Harness, HarnessConfig};
use harness_store::{Durability, Store};

/// Wraps the bus every sibling and the loop use (the bench's timing probe).
pub type Layer = Box<dyn FnOnce(Arc<dyn Bus>) -> Arc<dyn Bus> + Send>;
/// Registers phase-specific functions on the bus (before the loop starts on iii, where the
/// engine must list them from the first turn on).
pub type Register = Box<dyn Fn(&dyn Bus) + Send + Sync>;

/// One phase's runtime, in a fresh directory.
pub struct RigSpec {
    pub data_dir: PathBuf,
    /// The scripted provider's script.
    pub script: PathBuf,
    pub durability: Durability,
    pub config: HarnessConfig,
    pub register: Option<Register>,
    pub layer: Layer,
}

/// A runtime the host opened.
pub struct Opened {
    pub harness: Harness,
    /// The embedded store (None on iii: the engine holds the loop's state and queue).
    pub store: Option<Store>,
    /// Step messages not yet acked; None where the queue is not visible (iii).
    pub queue_depth: Option<Box<dyn Fn() -> usize + Send + Sync>>,
    /// Stops the runtime and closes its store.
    pub close: Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>,
}

#[async_trait]
pub trait Host: Send + Sync {
    /// Opens the loop with every sibling: in-process on the embedded bus (`iii` None), or as a
    /// worker of the iii engine at that URL (as `harness worker --with all`).
    async fn open(&self, iii: Option<&str>, spec: RigSpec) -> anyhow::Result<Opened>;

    /// Fails when this build cannot run on an iii engine (checked before any phase runs).
    fn check_iii(&self, url: &str) -> anyhow::Result<()>;

    /// What hands the memory the process's allocator keeps free back to the OS, on the thread
    /// that calls it, so that the RSS the idle-RAM phase reads is live memory, not what the
    /// allocator happened to keep (the binary's allocator holds freed pages per thread and
    /// only lets go of them on that thread's later activity, which an idle process has none
    /// of). The bench calls it on every runtime worker. None: nothing to do.
    fn memory_release(&self) -> Option<fn()> {
        None
    }
}
