//! Durable loop-step throughput: N sessions, each step = one write (state + the next step's
//! enqueue, in one transaction) + the queue ack (delete + barrier).
//!
//! `cargo run --release -p harness-store --example throughput -- [sessions] [seconds] [full|normal]`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use harness_store::{enqueue_in, kv_set_in, QueueConfig, Queues, Store};
use serde_json::json;

mod common {
    pub mod cli;
}
use common::cli;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (sessions, seconds, durability) = cli::parse();
    let dir = tempfile::tempdir_in(".").unwrap();
    let store = Store::open(&dir.path().join("bench.db"), durability).unwrap();
    let queues = Queues::new(store.clone());
    queues.define(
        "turn",
        QueueConfig {
            concurrency: sessions,
            ..QueueConfig::default()
        },
    );
    let steps = Arc::new(AtomicU64::new(0));
    {
        let (store, queues2, steps) = (store.clone(), queues.clone(), steps.clone());
        queues.start(
            "turn",
            Arc::new(move |m| {
                let (store, queues, steps) = (store.clone(), queues2.clone(), steps.clone());
                async move {
                    let step = m.payload["step"].as_u64().unwrap();
                    let group = m.group.clone();
                    store
                        .write(move |c| {
                            kv_set_in(c, &group, "state", &json!({ "step": step }))?;
                            enqueue_in(c, "turn", &group, "step", &json!({ "step": step + 1 }))
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    queues.wake("turn").map_err(|e| e.to_string())?;
                    steps.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
                .boxed()
            }),
        );
    }
    for s in 0..sessions {
        queues
            .enqueue("turn", &format!("s{s}"), "step", &json!({ "step": 0 }))
            .await
            .unwrap();
    }
    let (s0, t0) = (store.stats(), Instant::now());
    let n0 = steps.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let (s1, dt) = (store.stats(), t0.elapsed().as_secs_f64());
    let n = steps.load(Ordering::Relaxed) - n0;
    println!(
        "{durability:?} sessions={sessions}: {:.0} steps/s, {:.3} fsyncs/step, {:.1} writes/commit, {} fsyncs/s",
        n as f64 / dt,
        (s1.fsyncs - s0.fsyncs) as f64 / n as f64,
        (s1.writes - s0.writes) as f64 / (s1.commits - s0.commits).max(1) as f64,
        ((s1.fsyncs - s0.fsyncs) as f64 / dt) as u64,
    );
    queues.shutdown().await;
}
