//! The set of configured servers: started, replaced and stopped as the configuration says.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use harness_bus::Bus;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::client::{Backoff, Server, ServerStatus};
use crate::config::ServerSpec;

struct Running {
    server: Arc<Server>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// Every configured MCP server, each supervised by its own task. Cheap to clone.
#[derive(Clone)]
pub struct McpHub {
    bus: Arc<dyn Bus>,
    backoff: Backoff,
    /// A std Mutex: held to insert or take entries, never across an await.
    servers: Arc<Mutex<BTreeMap<String, Running>>>,
}

impl McpHub {
    pub fn new(bus: Arc<dyn Bus>, backoff: Backoff) -> McpHub {
        McpHub {
            bus,
            backoff,
            servers: Arc::new(Mutex::new(BTreeMap::new())),
        }
    }

    /// Makes the running set match `specs`: a server no longer listed, or listed differently,
    /// is stopped (its tools unregistered) before its replacement starts; an unchanged one is
    /// left alone. Returns at once for new servers: they connect in the background, and one
    /// that fails to start is reported in the log and retried, never stopping the caller.
    pub async fn apply(&self, specs: Vec<ServerSpec>) {
        let wanted: BTreeMap<String, ServerSpec> =
            specs.into_iter().map(|s| (s.name.clone(), s)).collect();
        let stopping: Vec<Running> = {
            let mut servers = self.servers.lock().expect("mcp servers lock");
            let gone: Vec<String> = servers
                .iter()
                .filter(|(name, r)| wanted.get(*name) != Some(r.server.spec()))
                .map(|(name, _)| name.clone())
                .collect();
            gone.iter().filter_map(|n| servers.remove(n)).collect()
        };
        for r in stopping {
            r.stop.cancel();
            let _ = r.task.await;
        }
        let mut servers = self.servers.lock().expect("mcp servers lock");
        for (name, spec) in wanted {
            if servers.contains_key(&name) {
                continue;
            }
            let server = Server::new(spec, self.bus.clone(), self.backoff);
            let stop = CancellationToken::new();
            let task = tokio::spawn(server.clone().supervise(stop.clone()));
            servers.insert(name, Running { server, stop, task });
        }
    }

    /// Each server's state, by name.
    pub fn status(&self) -> Vec<ServerStatus> {
        let servers = self.servers.lock().expect("mcp servers lock");
        servers.values().map(|r| r.server.status()).collect()
    }

    /// Waits (at most `limit`) until every server has either listed its tools or failed an
    /// attempt to start, so a first message is not sent before the tools it may need exist.
    /// Answers whether all had settled.
    pub async fn settled(&self, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let done = self
                .status()
                .iter()
                .all(|s| (s.connected && s.listed) || s.last_error.is_some());
            if done {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
    }

    /// Stops every server (children closed, tools unregistered).
    pub async fn shutdown(&self) {
        self.apply(Vec::new()).await;
    }
}
