//! `harness bench`'s runtimes, opened with this binary's own wiring (see `harness_bench::Host`).

use std::sync::Arc;

use anyhow::Result;
use async_trait::async_trait;
use harness_bench::{Host, Opened, RigSpec};
use harness_core::TURN_QUEUE;

use crate::runtime::{Runtime, RuntimeOptions};

pub struct BinaryHost;

fn options(spec: &RigSpec) -> RuntimeOptions {
    RuntimeOptions {
        data_dir: spec.data_dir.clone(),
        script: Some(spec.script.clone()),
        durability: spec.durability,
        config: spec.config.clone(),
        fixtures: None,
        fixture_log: None,
        config_file: None,
    }
}

#[async_trait]
impl Host for BinaryHost {
    async fn open(&self, iii: Option<&str>, spec: RigSpec) -> Result<Opened> {
        match iii {
            None => {
                let opts = options(&spec);
                let rt = Arc::new(Runtime::open_layered(opts, spec.layer).await?);
                if let Some(register) = &spec.register {
                    register(&rt.bus);
                }
                let depth = rt.clone();
                let close = rt.clone();
                Ok(Opened {
                    harness: rt.harness.clone(),
                    store: Some(rt.store.clone()),
                    queue_depth: Some(Box::new(move || depth.bus.queues().depth(TURN_QUEUE))),
                    close: Box::new(move || {
                        Box::pin(async move {
                            close.shutdown().await;
                            close.store.close();
                        })
                    }),
                })
            }
            #[cfg(feature = "iii")]
            Some(url) => {
                use crate::runtime::{open_on_iii, Siblings};
                use anyhow::Context as _;
                let opts = options(&spec);
                let mut iii = harness_iii::IiiOptions::new(url);
                // Not `harness`: the engine leases a worker name to one live connection, and a
                // deployment's own `harness worker` may hold that one.
                iii.worker_name = "harness-bench".into();
                // Measuring must not wait for a deployment's worker to go away.
                iii.standby = false;
                // The route of the turn queue to measure (auto, shards, topic, fifo, enqueue).
                if let Ok(mode) = std::env::var("HARNESS_III_QUEUE_MODE") {
                    iii.queue_mode = mode.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
                }
                // Where calls to the bench's own functions run (in-process, engine).
                if let Ok(mode) = std::env::var("HARNESS_III_SELF_CALLS") {
                    iii.self_calls = mode.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
                }
                let bus = harness_iii::IiiBus::connect(iii)
                    .await
                    .with_context(|| format!("--iii {url}"))?;
                if let Some(register) = &spec.register {
                    // Before the loop starts, so the engine lists it from the first turn on.
                    register(&bus);
                }
                let shared = (spec.layer)(Arc::new(bus.clone()));
                let rt = open_on_iii(opts, &bus, shared, Siblings::ALL, Vec::new()).await?;
                Ok(Opened {
                    harness: rt.harness.clone(),
                    store: None,
                    queue_depth: None,
                    close: Box::new(move || {
                        Box::pin(async move {
                            bus.shutdown().await;
                            if let Some(store) = &rt.store {
                                store.close();
                            }
                        })
                    }),
                })
            }
            #[cfg(not(feature = "iii"))]
            Some(url) => Err(anyhow::anyhow!("{}", iii_not_built(url))),
        }
    }

    fn check_iii(&self, url: &str) -> Result<()> {
        if cfg!(feature = "iii") {
            Ok(())
        } else {
            Err(anyhow::anyhow!("{}", iii_not_built(url)))
        }
    }

    fn memory_release(&self) -> Option<fn()> {
        Some(crate::memory::collect_free_memory)
    }
}

/// The error of `--iii` in a build without the `iii` feature.
fn iii_not_built(url: &str) -> String {
    format!(
        "--iii {url}: this harness was built without iii support; rebuild with `cargo build --features iii` (or run `harness bench` without --iii to measure in-process)"
    )
}
