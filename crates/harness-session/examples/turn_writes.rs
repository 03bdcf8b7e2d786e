//! The store side of a durable text turn, without the loop: N sessions each run turns back to
//! back, every turn issuing the store operations `harness bench` counts for a one-step text turn
//! (the send's reads and writes, the queued step's reads, two batches, the assistant's append and
//! final update, the queue ack and its fsync), through the same embedded bus, session functions
//! and queue the loop uses. Prints turns/s, process CPU per turn and the store writer thread's
//! CPU per turn, so a change to the store can be measured on its own.
//!
//! `cargo run --release -p harness-session --example turn_writes -- [sessions] [seconds] [full|normal]`

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness_bus::{Bus, BusWrite, EmbeddedBus, QueueDef};
use harness_session::SessionStore;
use harness_store::Store;
use serde_json::{json, Value};
use tokio::sync::oneshot;

// The store benchmarks' command line, shared with harness-store's `throughput`.
#[path = "../../harness-store/examples/common/cli.rs"]
mod cli;

const TURN_SCOPE: &str = "harness_turn";
const QUEUE: &str = "bench-turn";
/// A new session every this many turns (as `harness bench` does), so transcripts stay short.
const TURNS_PER_SESSION: u64 = 20;

/// A turn record of the size the loop writes (its options carry the system prompt).
fn record(session_id: &str, turn_id: &str, status: &str) -> Value {
    json!({
        "turn_id": turn_id, "session_id": session_id, "status": status, "step": 0,
        "turn_count": 1, "depth": 0, "message_preview": "hi", "abort": false,
        "watermark_entry_id": format!("e_{turn_id}_user"),
        "options": {"model": "bench", "provider": "scripted",
            "system_prompt": "You are an agent running inside harness, a durable agent loop. You act by calling functions registered on the engine; the registry is the truth, trust it over memory.\n\nTo use a capability: list, info, call.\n1. List: engine::functions::list (narrow it with `prefix`) shows the functions you may call.\n2. Info: engine::functions::info { function_id } returns one function's request schema; read it before the first call.\n3. Call: call the function with a JSON object matching that schema (an object, never a string of JSON).\n\nOnly functions your dispatch policy allows will run; when none are allowed, answer directly. Be concise.",
            "max_turns": 16, "output": {"type": "text"}, "max_validation_retries": 2,
            "max_transient_resumes": 1, "filesystem": {"root": "/tmp", "boundary": "configured_roots"},
            "prompt_shape": {"base_len": 628, "stable_len": 628}},
        "calls": {}, "transient_resumes": 0, "functions_generation": 1, "validation_retries": 0,
        "created_at": 1_796_109_659_110_i64, "updated_at": 1_796_109_659_309_i64
    })
}

fn user_message(text: &str) -> Value {
    json!({"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1})
}

fn assistant_message() -> Value {
    json!({"role": "assistant", "content": [], "provider": "scripted", "model": "bench",
           "stop_reason": "end", "timestamp": 1})
}

type Waiters = Arc<Mutex<HashMap<String, oneshot::Sender<()>>>>;

/// Each session's change mark, as the loop's transcript cache keeps it.
static MARKS: std::sync::LazyLock<Mutex<HashMap<String, i64>>> =
    std::sync::LazyLock::new(Mutex::default);

/// Wall time awaited per kind of store call, summed over every session (`TIMES=1` prints it).
static TIMES: Mutex<Vec<(&'static str, f64, u64)>> = Mutex::new(Vec::new());

async fn timed<T>(name: &'static str, f: impl std::future::Future<Output = T>) -> T {
    let t = Instant::now();
    let out = f.await;
    let us = t.elapsed().as_secs_f64() * 1e6;
    let mut times = TIMES.lock().expect("times");
    match times.iter_mut().find(|(n, _, _)| *n == name) {
        Some(row) => {
            row.1 += us;
            row.2 += 1;
        }
        None => times.push((name, us, 1)),
    }
    out
}

async fn step(bus: Arc<EmbeddedBus>, payload: Value) -> Result<(), String> {
    let sid = payload["session_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let turn = payload["turn_id"].as_str().unwrap_or_default().to_string();
    let e = |e: harness_bus::BusError| e.to_string();
    timed("step state_get", bus.state_get(TURN_SCOPE, &sid))
        .await
        .map_err(e)?;
    let queue_scope = format!("harness_queue:{sid}");
    bus.state_list(&queue_scope).await.map_err(e)?;
    // As the loop's transcript cache does: only what changed since the step's last read.
    let after = MARKS.lock().expect("marks").get(&sid).copied();
    let changes = timed(
        "step changes",
        bus.call(
            "session::changes",
            json!({"session_id": sid, "after": after}),
            None,
        ),
    )
    .await
    .map_err(e)?;
    if let Some(mark) = changes["mark"].as_i64() {
        MARKS.lock().expect("marks").insert(sid.clone(), mark);
    }
    timed("step commit1", bus.commit(vec![
        BusWrite::Call {
            function_id: "session::set-status".into(),
            payload: json!({"session_id": sid, "status": "working", "reason": "preparing context"}),
        },
        BusWrite::Publish {
            topic: "harness::turn-started".into(),
            payload: json!({"session_id": sid, "turn_id": turn, "timestamp": 1, "depth": 0}),
            dedupe_key: Some(format!("harness::turn-started:{turn}")),
        },
    ]))
    .await
    .map_err(e)?;
    let assistant = format!("e_{turn}_0_assistant");
    timed(
        "step append",
        bus.call(
            "session::append",
            json!({"session_id": sid, "entry_id": assistant, "message": assistant_message(),
               "origin": {"turn_id": turn, "step": 0}}),
            None,
        ),
    )
    .await
    .map_err(e)?;
    bus.state_list(&queue_scope).await.map_err(e)?;
    timed(
        "step update",
        bus.call(
            "session::update-message",
            json!({"session_id": sid, "entry_id": assistant,
               "content": [{"type": "text", "text": "The answer, streamed in full."}],
               "usage": {"input": 192, "output": 8, "cost_usd": 0.0}, "stop_reason": "end"}),
            None,
        ),
    )
    .await
    .map_err(e)?;
    bus.state_get(TURN_SCOPE, &sid).await.map_err(e)?;
    bus.state_list(&queue_scope).await.map_err(e)?;
    timed(
        "step commit2",
        bus.commit(vec![
            BusWrite::StateSet {
                scope: TURN_SCOPE.into(),
                key: sid.clone(),
                value: record(&sid, &turn, "completed"),
            },
            BusWrite::Call {
                function_id: "session::set-status".into(),
                payload: json!({"session_id": sid, "status": "done"}),
            },
            BusWrite::Publish {
                topic: "harness::turn-completed".into(),
                payload: json!({"session_id": sid, "turn_id": turn, "status": "completed",
                            "terminal": true, "timestamp": 1, "result": "ok"}),
                dedupe_key: Some(format!("harness::turn-completed:{turn}")),
            },
        ]),
    )
    .await
    .map_err(e)?;
    bus.state_list(&queue_scope).await.map_err(e)?;
    Ok(())
}

async fn send(bus: &EmbeddedBus, sid: &str, n: u64) -> Result<(), harness_bus::BusError> {
    let turn = format!("t_{sid}_{n}");
    timed("send state_get", bus.state_get(TURN_SCOPE, sid)).await?;
    timed(
        "send ensure",
        bus.call("session::ensure", json!({"session_id": sid}), None),
    )
    .await?;
    timed(
        "send append",
        bus.call(
            "session::append",
            json!({"session_id": sid, "entry_id": format!("e_{turn}_user"),
               "message": user_message("hi"), "origin": {"turn_id": turn}}),
            None,
        ),
    )
    .await?;
    timed(
        "send state_set",
        bus.state_set(TURN_SCOPE, sid, record(sid, &turn, "running")),
    )
    .await?;
    timed(
        "send enqueue",
        bus.enqueue(
            QUEUE,
            "bench::step",
            json!({"session_id": sid, "turn_id": turn, "step": 0}),
        ),
    )
    .await?;
    timed("send barrier", bus.barrier()).await
}

/// CPU seconds of this process and of its store writer thread.
fn cpu() -> (f64, f64) {
    let tick = 100.0; // USER_HZ on Linux
    let fields = |text: &str| -> f64 {
        let rest = text.rsplit(')').next().unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ut: f64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0.0);
        let st: f64 = f.get(12).and_then(|s| s.parse().ok()).unwrap_or(0.0);
        (ut + st) / tick
    };
    let process = std::fs::read_to_string("/proc/self/stat")
        .map(|t| fields(&t))
        .unwrap_or(0.0);
    let mut writer = 0.0;
    if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
        for task in dir.flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() == "harness-store-w" {
                writer += std::fs::read_to_string(task.path().join("stat"))
                    .map(|t| fields(&t))
                    .unwrap_or(0.0);
            }
        }
    }
    (process, writer)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (sessions, seconds, durability) = cli::parse();
    let dir = tempfile::tempdir_in(".").expect("temp dir");
    let store = Store::open(&dir.path().join("harness.db"), durability).expect("store");
    let bus = Arc::new(EmbeddedBus::new(store.clone()).expect("bus"));
    let sessions_store = SessionStore::open(store.clone()).await.expect("sessions");
    harness_session::register(bus.as_ref(), &sessions_store);
    harness_session::register_transactional(&bus, &sessions_store);
    let waiters: Waiters = Arc::default();
    {
        let (b, w) = (bus.clone(), waiters.clone());
        bus.register_function(
            harness_bus::FunctionDef::new("bench::step", "one text step's store work"),
            Arc::new(move |payload: Value, _ctx| {
                let (bus, waiters) = (b.clone(), w.clone());
                async move {
                    let sid = payload["session_id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    timed("step handler", step(bus, payload))
                        .await
                        .map_err(harness_bus::BusError::internal)?;
                    if let Some(tx) = waiters.lock().expect("waiters").remove(&sid) {
                        let _ = tx.send(());
                    }
                    Ok(Value::Null)
                }
            }),
        );
    }
    bus.define_queue(QueueDef {
        queue: QUEUE.into(),
        message_group_field: "session_id".into(),
        concurrency: 256,
        max_retries: 3,
        backoff_ms: 100,
        visibility_timeout_ms: 60_000,
    })
    .await
    .expect("queue");

    let turns = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for s in 0..sessions {
        let (bus, waiters, turns, stop) =
            (bus.clone(), waiters.clone(), turns.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let sid = format!("s{s}_{}", n / TURNS_PER_SESSION);
                let (tx, rx) = oneshot::channel();
                waiters.lock().expect("waiters").insert(sid.clone(), tx);
                send(&bus, &sid, n).await.expect("send");
                if timed(
                    "wait step done",
                    tokio::time::timeout(Duration::from_secs(30), rx),
                )
                .await
                .is_err()
                {
                    panic!("turn {n} of {sid} never finished");
                }
                n += 1;
                turns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (n0, c0, t0, s0) = (
        turns.load(std::sync::atomic::Ordering::Relaxed),
        cpu(),
        Instant::now(),
        store.stats(),
    );
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let (n1, c1, dt, s1) = (
        turns.load(std::sync::atomic::Ordering::Relaxed),
        cpu(),
        t0.elapsed().as_secs_f64(),
        store.stats(),
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = (n1 - n0).max(1) as f64;
    println!(
        "{durability:?} sessions={sessions}: {:.0} turns/s, cpu {:.0} us/turn, writer {:.0} us/turn, {:.1} writes/commit, {:.3} fsyncs/turn",
        n / dt,
        (c1.0 - c0.0) * 1e6 / n,
        (c1.1 - c0.1) * 1e6 / n,
        (s1.writes - s0.writes) as f64 / (s1.commits - s0.commits).max(1) as f64,
        (s1.fsyncs - s0.fsyncs) as f64 / n,
    );
    if std::env::var_os("TIMES").is_some() {
        for (name, us, n) in TIMES.lock().expect("times").iter() {
            println!("  {name:>16}: {:8.0} us mean over {n}", us / *n as f64);
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    bus.shutdown().await;
    store.close();
}
