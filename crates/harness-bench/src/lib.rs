//! `harness bench`: measures the embedded loop in-process, with the scripted provider at zero
//! latency, and prints a table (or, with `--json`, one JSON object on stdout; progress goes to
//! stderr). Every figure is printed beside the same run's physical reference (`reference.rs`:
//! one fsync and one bare SQLite commit in the bench directory), so each reads as a ratio that
//! means the same on any machine.
//!
//! The binary stays the owner of the wiring: it passes a [`Host`] that opens each phase's
//! runtime exactly as `harness serve` (or `harness worker`, with `--iii`) would. Every phase
//! opens a fresh runtime in its own temporary directory (under `--dir`, default the system temp
//! dir; fsync numbers are only meaningful on a real disk), with the bus wrapped in a
//! [`ProbeBus`]: a pass-through that
//!
//! * times every `harness::turn` delivery (one step) from handler start to handler end;
//! * inside a step, adds up the time spent awaiting the store: `session::*` and `state::*` calls,
//!   `state_*`, `enqueue`, `publish` and `barrier` (found through a task-local set by the step's
//!   handler, so concurrent sends are never charged to a step);
//! * stamps when a step's `enqueue` returned, so the next delivery of that `(turn, step)` can
//!   compute its handoff latency;
//! * wakes the bench when a `harness::turn-completed` event has been committed.
//!
//! Methods, per metric:
//!
//! * **Loop overhead per step** (`overhead_us_*`): concurrency 1, fsync off, one text turn (one
//!   step) at a time; per step, handler wall time minus the time spent awaiting the store as
//!   above. What remains is the loop's own work: JSON (de)serialisation, context assembly, the
//!   router and scripted provider (which answer instantly), stream accumulation, locking, task
//!   hops. The store's part (its own serialisation included) is reported next to it
//!   (`store_us_p50`, `store_ops_per_step`), as is the whole step (`step_us_*`). The durable
//!   write itself (the ack's fsync) happens after the handler returns and is never in either.
//! * **Handoff** (`handoff_us_*`): turns whose script always calls a function the deny-by-default
//!   policy refuses (a new call id every step, so every step really closes one refused call),
//!   capped with `max_turns`, so each turn is 9 steps; per step ≥ 1, from the
//!   moment the previous step's `enqueue` of it returned to the moment its handler starts. That
//!   includes the previous step's return, its queue ack (a commit and, with fsync on, the fsync
//!   the queue waits for before it releases the session's next message) and two task spawns.
//!   Measured with fsync on (`handoff_us_*`, the default durability) and off
//!   (`handoff_nofsync_us_*`); `send_handoff_us_p50` is send's enqueue → step 0.
//! * **Durable steps/s** (`steps_per_sec`): C sessions each running text turns back to back (send,
//!   wait for `turn-completed`, send again; a new session every 20 turns so transcripts stay
//!   short) for a fixed time after a short warm-up; steps/s = completed one-step turns / elapsed.
//!   The send (which persists the message and fsyncs before it answers) is part of every step.
//! * **fsyncs per text step** (`fsyncs_per_text_step`): concurrency 1, fsync on; per turn, the
//!   store's fsync counter between `send` returning and the queue being idle again (the step and
//!   its ack); the send's own fsyncs are `fsyncs_per_send`. `fsyncs_per_step` gives fsyncs /
//!   steps of each fsync-on throughput cell, sends included (group commit shares them), and
//!   `store_commits_per_step` the store's transactions, write ops and WAL pages (frames) per
//!   step of the same cells: how well the single writer groups the steps' writes and what they
//!   cost it in pages. `store_writer` gives, per cell, the share of wall time the one writer
//!   thread was busy with batches (`busy`, near 1 means it is the bound) and, within that, in
//!   its own catch-up checkpoints (`checkpoint`), which stall every session's writes (all null
//!   on iii).
//! * **Function-call step** (`call_*`, `fsyncs_per_function_step`): an in-process no-op function
//!   `bench::noop` is registered on the runtime's bus and turns are sent with
//!   `functions: {allow: ["bench::*"], expose: "native"}, max_turns: 8`, against a script whose
//!   repeated generation calls it under a per-step id (`c_{request_id}`): each turn is 8 steps
//!   that each run one call, plus the step that ends the turn on `max_turns` (left out). Fsync
//!   off, concurrency 1, a new session per call turn; after each call turn the same runtime runs
//!   8 text turns (sessions of 20 turns, as above), the *paired* text steps, so both kinds are
//!   measured on the same database, interleaved in time.
//!   `call_step_us_*` is the whole step (handler wall time) of the steps that ran one call;
//!   `call_target_us_p50` is the time the step spent awaiting the `bench::noop` bus call (the
//!   target, as the loop sees it: the embedded bus's lookup and timeout included).
//!   `call_overhead_us_p50` = p50(call step − its target time) − p50(paired text step): what one
//!   call adds to a step beyond the target (policy, hooks, the `triggered` checkpoint and its
//!   barrier, the result append, the `done` checkpoint, advancing instead of finalizing). The
//!   probe's per-operation timings split it: `call_overhead_loop_us_p50` compares the steps with
//!   the store's time also taken out (p50(call − target − store) − p50(text − store)), and
//!   `call_breakdown` lists every operation's calls and mean µs per call step next to the paired
//!   text step's. A difference of medians, so the parts need not add up exactly.
//!   `fsyncs_per_function_step`: a fresh fsync-on runtime alternates turns of 8 and of 2 call
//!   steps; per turn, the store's fsync counter from `send` returning (its own fsyncs excluded)
//!   to the queue being idle and the WAL synced; the per-step figure is the slope
//!   (mean(8-step turns) − mean(2-step turns)) / 6, so the step that ends the turn and anything
//!   else paid once per turn cancel out. `fsyncs_per_function_turn` is the 8-call turn's total
//!   (its final step included); `call_step_fsync_us_p50` the whole call step with fsync on.
//! * **Router latency** (`router_*`): `harness_router::bench::frame_latency`, a local
//!   Anthropic-format SSE server on 127.0.0.1 and the Anthropic adapter pointed at it. Per frame:
//!   from the server handing an event's bytes to the socket to the parsed frame coming out of the
//!   router's frame channel, one event in flight (`router_frame_us_*`; the target applies to its
//!   p50, socket included); the same ping-pong on a raw `TcpStream` (`router_socket_us_*`) and
//!   the difference of the medians (`router_frame_added_us_p50`). Per request
//!   (`router_request_us_*`): `Router::chat` → the server has read the request, plus the
//!   server's last byte → the ack.
//! * **Long sessions** (`long_session_step_ratio`): concurrency 1, fsync off; text steps
//!   alternating between sessions of ~10 entries and of ~1,000 (filled with `session::append`,
//!   each stepped once before measuring, as a live conversation is); p50 of the whole step on
//!   the long sessions over p50 on the short ones (`long_session_overhead_ratio`: the same with
//!   the store's time taken out).
//! * **iii mode** (`--iii URL`, feature `iii` of the binary): the host opens every phase's
//!   runtime with the binary's `Runtime::open_on_bus` on an `IiiBus` connected to URL (worker name `harness-bench`), with
//!   every sibling registered (as `harness worker --with all`; their SQLite in the phase's
//!   temporary directory) and the same probe wrapped around the bus; `bench::noop` is registered
//!   on the engine too, so call steps go through it. The queue's drain is seen as steps enqueued
//!   = steps handled (the engine's depth is not visible). The fsync figures and the empty-commit
//!   yardstick are null there (the engine gives no durability point; see [`III_NOTES`]); the
//!   rest is measured the same way, so the two reports compare key by key.
//! * **RAM per idle session** (`idle_session_bytes`): fsync off; N sessions with one completed
//!   turn each (64 at a time); resident set (`VmRSS`) after minus before, divided by N. Each
//!   read follows the allocators' release of their free pages (the host's, on every runtime
//!   worker, and `malloc_trim`): without it the figure moved by a third run to run with what
//!   mimalloc's threads happened to keep. It includes SQLite's page caches growing with the
//!   database (`idle_sqlite_heap_*_bytes`); `idle_session_marginal_bytes` is the slope over the
//!   second half only. An explicit `--idle-sessions N` is measured whole (cap 12 ms a session).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use async_trait::async_trait;
use harness_bus::{
    Binding, Bus, BusError, BusWrite, CallContext, FunctionDef, Handler, HandlerFuture,
    LocalFuture, LocalHandler, LocalValue, QueueDef, StreamingCall, TriggerTypeDef,
};
use harness_core::{topics, Harness, HarnessConfig, TURN_QUEUE};
use harness_router::bench::{FrameLatencyOptions, FrameLatencyReport};
use harness_store::Durability;
use harness_types::api::{ExposeMode, FunctionPolicy, SendOptions, SendRequest};
use serde_json::{json, Map, Value};
use tokio::sync::oneshot;

pub use host::{Host, Opened, RigSpec};

mod host;
mod reference;

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// A shorter run (under 30 s).
    #[arg(long)]
    pub quick: bool,
    /// Run every phase on an iii engine (its worker URL, e.g. ws://127.0.0.1:49134) instead of
    /// the embedded bus: the loop and all its siblings register on it as `harness worker --with
    /// all` would. Needs a build with `--features iii`.
    #[arg(long, value_name = "URL")]
    pub iii: Option<String>,
    /// Where the temporary stores go (default: the system temp dir). Use a real disk: fsync on
    /// tmpfs costs nothing.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Sessions for the idle-RAM measurement (default 10000; 2000 with --quick).
    #[arg(long)]
    pub idle_sessions: Option<usize>,
    /// Measured seconds per throughput cell (default 5; 1.2 with --quick).
    #[arg(long)]
    pub cell_secs: Option<f64>,
}

/// The step function the queue delivers.
const STEP_FN: &str = "harness::turn";
/// Longest a bench turn may take before the bench gives up.
const TURN_TIMEOUT: Duration = Duration::from_secs(60);
/// Throughput workers start a new session after this many turns (keeps transcripts short).
const TURNS_PER_SESSION: u32 = 20;
/// `max_turns` of a handoff turn: 8 generations + the step that ends the turn = 9 steps.
const HANDOFF_MAX_TURNS: u32 = 8;
/// Sends in flight while filling the idle sessions.
const IDLE_FILL_CONCURRENCY: usize = 64;
const CONCURRENCIES: [usize; 3] = [1, 10, 200];
/// Entries of the short and the long sessions of the long-session phase (before its turns).
const SHORT_ENTRIES: usize = 10;
const LONG_ENTRIES: usize = 1_000;
/// Sessions of each length the long-session phase alternates over.
const LONG_PHASE_SESSIONS: usize = 4;

const TEXT_SCRIPT: &str =
    r#"{"generations": [{"repeat": true, "content": [{"type": "text", "text": "ok"}]}]}"#;
/// The no-op function the function-call phase allows (and the handoff phase's policy refuses).
const NOOP_FN: &str = "bench::noop";
/// What a call turn sends; any other message gets the text generation.
const CALL_MESSAGE: &str = "call";
/// A call turn's every generation calls `bench::noop` under a new id (`{request_id}` is the
/// step's request id), so every step runs (or refuses) one call: the turn advances until
/// `max_turns`. Other messages get "ok", as in [`TEXT_SCRIPT`].
const CALL_SCRIPT: &str = r#"{"generations": [
  {"match": {"last_user_text": "^call$"}, "repeat": true, "content": [{"type": "function_call", "id": "c_{request_id}", "function_id": "bench::noop", "arguments": {}}]},
  {"repeat": true, "content": [{"type": "text", "text": "ok"}]}]}"#;
/// `max_turns` of a function-call turn: 8 steps that each run one call + the step that ends it.
const FUNCTION_MAX_TURNS: u32 = 8;
/// The shorter turns of the fsync measurement (per-step fsyncs = the slope between the two).
const FUNCTION_SHORT_MAX_TURNS: u32 = 2;
/// Longest the router measurement may take before the bench gives up.
const ROUTER_TIMEOUT: Duration = Duration::from_secs(60);

/// Phase sizes.
struct Plan {
    idle_sessions: usize,
    idle_cap: Duration,
    overhead_steps: usize,
    overhead_cap: Duration,
    store_writes: usize,
    handoff_turns: usize,
    handoff_cap: Duration,
    fsync_turns: usize,
    fsync_cap: Duration,
    /// Call steps sampled (fsync off) and the time cap of that part.
    function_steps: usize,
    function_cap: Duration,
    /// Turns of each length for the fsyncs per function step, and the time cap of that part.
    function_fsync_turns: usize,
    function_fsync_cap: Duration,
    router: FrameLatencyOptions,
    cell_warmup: Duration,
    cell: Duration,
    /// Measured turns on each of the short and the long sessions, and the time cap.
    long_turns: usize,
    long_cap: Duration,
}

impl Plan {
    fn new(args: &BenchArgs) -> Plan {
        let mut p = if args.quick {
            Plan {
                idle_sessions: 2_000,
                idle_cap: Duration::from_secs(6),
                overhead_steps: 300,
                overhead_cap: Duration::from_secs(3),
                store_writes: 300,
                handoff_turns: 30,
                handoff_cap: Duration::from_secs(2),
                fsync_turns: 60,
                fsync_cap: Duration::from_secs(2),
                function_steps: 160,
                function_cap: Duration::from_secs(3),
                function_fsync_turns: 8,
                function_fsync_cap: Duration::from_secs(2),
                router: FrameLatencyOptions {
                    frames: 300,
                    warmup: 50,
                    requests: 20,
                },
                cell_warmup: Duration::from_millis(200),
                cell: Duration::from_millis(1200),
                long_turns: 40,
                long_cap: Duration::from_secs(4),
            }
        } else {
            Plan {
                idle_sessions: 10_000,
                idle_cap: Duration::from_secs(60),
                overhead_steps: 3_000,
                overhead_cap: Duration::from_secs(20),
                store_writes: 2_000,
                handoff_turns: 200,
                handoff_cap: Duration::from_secs(10),
                fsync_turns: 500,
                fsync_cap: Duration::from_secs(10),
                function_steps: 2_000,
                function_cap: Duration::from_secs(20),
                function_fsync_turns: 40,
                function_fsync_cap: Duration::from_secs(10),
                router: FrameLatencyOptions::default(),
                cell_warmup: Duration::from_millis(500),
                cell: Duration::from_secs(5),
                long_turns: 300,
                long_cap: Duration::from_secs(20),
            }
        };
        if let Some(n) = args.idle_sessions {
            p.idle_sessions = n.max(2);
            // A count asked for is measured whole: a busy machine fills 10,000 sessions in
            // 20-40 s, and a figure over a tenth of them is not the figure asked for.
            p.idle_cap = p.idle_cap.max(Duration::from_millis(12 * n as u64));
        }
        if let Some(s) = args.cell_secs {
            p.cell = Duration::from_secs_f64(s.max(0.1));
        }
        p
    }
}

// --- the probe ---------------------------------------------------------------------------------

tokio::task_local! {
    /// Set while a step handler runs: where its store time is added up.
    static STEP: Arc<StepAcc>;
}

#[derive(Default)]
struct StepAcc {
    store_ns: AtomicU64,
    store_ops: AtomicU64,
    /// Per operation: (count, ns), store operations and timed loop calls alike.
    by_op: Mutex<HashMap<String, (u64, u64)>>,
}

impl StepAcc {
    fn add(&self, op: &str, store: bool, ns: u64) {
        if store {
            self.store_ns.fetch_add(ns, Ordering::Relaxed);
            self.store_ops.fetch_add(1, Ordering::Relaxed);
        }
        let mut by_op = lock(&self.by_op);
        let e = by_op.entry(op.to_string()).or_default();
        e.0 += 1;
        e.1 += ns;
    }
}

struct StepSample {
    /// The turn the step belongs to (empty when the payload had none).
    turn_id: String,
    wall_ns: u64,
    store_ns: u64,
    store_ops: u64,
    by_op: HashMap<String, (u64, u64)>,
}

/// How a turn ended, as its `turn-completed` event said.
type Ended = std::result::Result<(), String>;

enum Slot {
    Ended(Ended),
    Waiting(oneshot::Sender<Ended>),
}

#[derive(Default)]
struct Probe {
    /// Record per-step samples (otherwise steps are only counted).
    sample_steps: AtomicBool,
    /// Stamp enqueues and compute handoffs.
    track_handoff: AtomicBool,
    steps: Mutex<Vec<StepSample>>,
    /// `turn_id:step` → when its enqueue returned.
    enqueued: Mutex<HashMap<String, Instant>>,
    /// Handoff samples (ns): into step 0 (from send) and into later steps.
    handoff_send_ns: Mutex<Vec<u64>>,
    handoff_step_ns: Mutex<Vec<u64>>,
    completions: Mutex<HashMap<String, Slot>>,
    /// Steps enqueued on `harness-turn` (counted before the enqueue) and step deliveries
    /// handled: how the bench sees the queue drain on iii, where its depth is not visible.
    steps_enqueued: AtomicU64,
    steps_handled: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn step_key(payload: &Value) -> Option<(String, u64)> {
    let turn = payload.get("turn_id")?.as_str()?;
    let step = payload.get("step")?.as_u64()?;
    Some((format!("{turn}:{step}"), step))
}

impl Probe {
    fn completed(&self, payload: &Value) {
        let Some(turn_id) = payload.get("turn_id").and_then(Value::as_str) else {
            return;
        };
        let ended = match payload.get("status").and_then(Value::as_str) {
            Some("completed") => Ok(()),
            other => Err(format!(
                "turn {turn_id} ended {}: {}",
                other.unwrap_or("?"),
                payload
                    .get("result_error")
                    .and_then(Value::as_str)
                    .unwrap_or("(no error text)")
            )),
        };
        let mut map = lock(&self.completions);
        match map.remove(turn_id) {
            Some(Slot::Waiting(tx)) => {
                let _ = tx.send(ended);
            }
            _ => {
                map.insert(turn_id.to_string(), Slot::Ended(ended));
            }
        }
    }

    async fn wait(&self, turn_id: &str) -> Result<()> {
        let rx = {
            let mut map = lock(&self.completions);
            match map.remove(turn_id) {
                Some(Slot::Ended(ended)) => return ended.map_err(|e| anyhow!(e)),
                _ => {
                    let (tx, rx) = oneshot::channel();
                    map.insert(turn_id.to_string(), Slot::Waiting(tx));
                    rx
                }
            }
        };
        match tokio::time::timeout(TURN_TIMEOUT, rx).await {
            Ok(Ok(ended)) => ended.map_err(|e| anyhow!(e)),
            Ok(Err(_)) => bail!("turn {turn_id}: completion waiter dropped"),
            Err(_) => bail!(
                "turn {turn_id} did not complete within {} s",
                TURN_TIMEOUT.as_secs()
            ),
        }
    }

    fn enqueued(&self, payload: &Value) {
        if !self.track_handoff.load(Ordering::Relaxed) {
            return;
        }
        if let Some((key, _)) = step_key(payload) {
            lock(&self.enqueued).insert(key, Instant::now());
        }
    }

    fn step_started(&self, payload: &Value, at: Instant) {
        if !self.track_handoff.load(Ordering::Relaxed) {
            return;
        }
        let Some((key, step)) = step_key(payload) else {
            return;
        };
        let Some(from) = lock(&self.enqueued).remove(&key) else {
            return;
        };
        let ns = at.saturating_duration_since(from).as_nanos() as u64;
        if step == 0 {
            lock(&self.handoff_send_ns).push(ns);
        } else {
            lock(&self.handoff_step_ns).push(ns);
        }
    }

    fn step_finished(&self, sample: StepSample, skipped: bool) {
        if skipped {
            return;
        }
        if self.sample_steps.load(Ordering::Relaxed) {
            lock(&self.steps).push(sample);
        }
    }
}

/// Awaits an operation; inside a step, records its time (as store time when `store`).
async fn timed<T>(op: &str, store: bool, fut: impl Future<Output = T>) -> T {
    let t = Instant::now();
    let out = fut.await;
    let _ = STEP.try_with(|acc| acc.add(op, store, t.elapsed().as_nanos() as u64));
    out
}

/// An in-process handler whose calls are timed like [`ProbeBus::call`]'s.
struct TimedLocal {
    inner: Arc<dyn LocalHandler>,
    op: String,
    store: bool,
}

impl LocalHandler for TimedLocal {
    fn call(&self, payload: LocalValue, ctx: CallContext) -> LocalFuture {
        let fut = self.inner.call(payload, ctx);
        let (op, store) = (self.op.clone(), self.store);
        Box::pin(async move { timed(&op, store, fut).await })
    }
}

/// Awaits a store operation; inside a step, charges its time to the step's store time.
async fn store_op<T>(op: &str, fut: impl Future<Output = T>) -> T {
    timed(op, true, fut).await
}

fn is_store_function(function_id: &str) -> bool {
    function_id.starts_with("session::") || function_id.starts_with("state::")
}

/// The operations [`ProbeBus`] charges as store time (by the name it records them under).
fn is_store_op(op: &str) -> bool {
    is_store_function(op)
        || matches!(
            op,
            "enqueue"
                | "publish"
                | "barrier"
                | "commit"
                | "state_get"
                | "state_set"
                | "state_delete"
        )
        || op.starts_with("state_list")
}

/// A scope with the session id in it (`harness_queue:s_<hex>`) named generically, so the
/// breakdown groups one operation instead of listing every session.
fn generic_scope(scope: &str) -> String {
    match scope.rfind("s_") {
        Some(i)
            if scope[i + 2..].len() >= 8
                && scope[i + 2..].bytes().all(|b| b.is_ascii_alphanumeric()) =>
        {
            format!("{}<session>", &scope[..i])
        }
        _ => scope.to_string(),
    }
}

fn breakdown_json(rows: &[(String, f64, f64)]) -> Value {
    rows.iter()
        .map(|(op, n, us)| {
            (
                op.clone(),
                json!({"per_step": round1(*n), "us_per_step": round1(*us)}),
            )
        })
        .collect::<Map<String, Value>>()
        .into()
}

/// Wraps the step handler: timing, store-time accounting, handoff stamps.
struct StepHandler {
    inner: Arc<dyn Handler>,
    probe: Arc<Probe>,
}

impl Handler for StepHandler {
    fn call(&self, payload: Value, ctx: CallContext) -> HandlerFuture {
        let inner = self.inner.clone();
        let probe = self.probe.clone();
        Box::pin(async move {
            let start = Instant::now();
            probe.step_started(&payload, start);
            let turn_id = payload
                .get("turn_id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let acc = Arc::new(StepAcc::default());
            let out = STEP.scope(acc.clone(), inner.call(payload, ctx)).await;
            let wall_ns = start.elapsed().as_nanos() as u64;
            let skipped = match &out {
                Ok(v) => v.get("skipped").and_then(Value::as_bool).unwrap_or(false),
                Err(_) => true,
            };
            let sample = StepSample {
                turn_id,
                wall_ns,
                store_ns: acc.store_ns.load(Ordering::Relaxed),
                store_ops: acc.store_ops.load(Ordering::Relaxed),
                by_op: std::mem::take(&mut *lock(&acc.by_op)),
            };
            probe.step_finished(sample, skipped);
            probe.steps_handled.fetch_add(1, Ordering::SeqCst);
            out
        })
    }
}

/// A pass-through bus that measures (see the module docs).
struct ProbeBus {
    inner: Arc<dyn Bus>,
    probe: Arc<Probe>,
}

#[async_trait]
impl Bus for ProbeBus {
    async fn call(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, BusError> {
        let store = is_store_function(function_id);
        timed(
            function_id,
            store,
            self.inner.call(function_id, payload, timeout),
        )
        .await
    }

    async fn call_with_metadata(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Value,
    ) -> Result<Value, BusError> {
        let store = is_store_function(function_id);
        timed(
            function_id,
            store,
            self.inner
                .call_with_metadata(function_id, payload, timeout, metadata),
        )
        .await
    }

    async fn call_streaming(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<StreamingCall, BusError> {
        let t = Instant::now();
        let mut call = self
            .inner
            .call_streaming(function_id, payload, timeout)
            .await?;
        // Time until the answer (the frames are consumed meanwhile, by the same step).
        if let Ok(acc) = STEP.try_with(Arc::clone) {
            let result = call.result;
            let op = function_id.to_string();
            call.result = Box::pin(async move {
                let out = result.await;
                acc.add(&op, false, t.elapsed().as_nanos() as u64);
                out
            });
        }
        Ok(call)
    }

    async fn call_void(&self, function_id: &str, payload: Value) {
        self.inner.call_void(function_id, payload).await
    }

    fn register_function(&self, def: FunctionDef, handler: Arc<dyn Handler>) {
        let handler: Arc<dyn Handler> = if def.function_id == STEP_FN {
            Arc::new(StepHandler {
                inner: handler,
                probe: self.probe.clone(),
            })
        } else {
            handler
        };
        self.inner.register_function(def, handler)
    }

    fn unregister_function(&self, function_id: &str) -> bool {
        self.inner.unregister_function(function_id)
    }

    fn register_function_with_local(
        &self,
        def: FunctionDef,
        handler: Arc<dyn Handler>,
        local: Arc<dyn LocalHandler>,
    ) {
        self.inner.register_function_with_local(def, handler, local)
    }

    fn local_handler(&self, function_id: &str) -> Option<Arc<dyn LocalHandler>> {
        let inner = self.inner.local_handler(function_id)?;
        Some(Arc::new(TimedLocal {
            inner,
            op: function_id.to_string(),
            store: is_store_function(function_id),
        }))
    }

    fn register_trigger_type(&self, def: TriggerTypeDef) {
        self.inner.register_trigger_type(def)
    }

    async fn bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError> {
        self.inner.bindings(trigger_type).await
    }

    async fn define_queue(&self, def: QueueDef) -> Result<(), BusError> {
        self.inner.define_queue(def).await
    }

    async fn enqueue(
        &self,
        queue: &str,
        function_id: &str,
        payload: Value,
    ) -> Result<(), BusError> {
        let stamp = (queue == TURN_QUEUE).then(|| payload.clone());
        if stamp.is_some() {
            self.probe.steps_enqueued.fetch_add(1, Ordering::SeqCst);
        }
        let out = store_op("enqueue", self.inner.enqueue(queue, function_id, payload)).await;
        if out.is_err() && stamp.is_some() {
            self.probe.steps_enqueued.fetch_sub(1, Ordering::SeqCst);
        }
        out?;
        if let Some(p) = stamp {
            self.probe.enqueued(&p);
        }
        Ok(())
    }

    async fn publish(
        &self,
        topic: &str,
        payload: Value,
        dedupe_key: Option<String>,
    ) -> Result<(), BusError> {
        let completed = (topic == topics::TURN_COMPLETED).then(|| payload.clone());
        store_op("publish", self.inner.publish(topic, payload, dedupe_key)).await?;
        if let Some(p) = completed {
            self.probe.completed(&p);
        }
        Ok(())
    }

    async fn barrier(&self) -> Result<(), BusError> {
        store_op("barrier", self.inner.barrier()).await
    }

    async fn commit(&self, writes: Vec<BusWrite>) -> Result<Vec<Value>, BusError> {
        // A batch is one store operation; its step enqueues and completions are seen as the
        // one-by-one `enqueue` and `publish` above see theirs.
        let steps: Vec<Value> = writes
            .iter()
            .filter_map(|w| match w {
                BusWrite::Enqueue { queue, payload, .. } if queue == TURN_QUEUE => {
                    Some(payload.clone())
                }
                _ => None,
            })
            .collect();
        let completed: Vec<Value> = writes
            .iter()
            .filter_map(|w| match w {
                BusWrite::Publish { topic, payload, .. } if topic == topics::TURN_COMPLETED => {
                    Some(payload.clone())
                }
                _ => None,
            })
            .collect();
        let n = steps.len() as u64;
        self.probe.steps_enqueued.fetch_add(n, Ordering::SeqCst);
        let out = store_op("commit", self.inner.commit(writes)).await;
        if out.is_err() {
            self.probe.steps_enqueued.fetch_sub(n, Ordering::SeqCst);
        }
        let out = out?;
        for p in &steps {
            self.probe.enqueued(p);
        }
        for p in &completed {
            self.probe.completed(p);
        }
        Ok(out)
    }

    async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>, BusError> {
        store_op("state_get", self.inner.state_get(scope, key)).await
    }

    async fn state_get_shared(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<Arc<Value>>, BusError> {
        store_op("state_get", self.inner.state_get_shared(scope, key)).await
    }

    async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
        store_op("state_set", self.inner.state_set(scope, key, value)).await
    }

    async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
        store_op("state_delete", self.inner.state_delete(scope, key)).await
    }

    async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        store_op(
            &format!("state_list {}", generic_scope(scope)),
            self.inner.state_list(scope),
        )
        .await
    }
}

// --- a runtime in a temporary directory ---------------------------------------------------------

/// Removes the directory when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(base: &Path) -> Result<TempDir> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            "harness-bench-{}-{}-{nanos:x}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = base.join(name);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[derive(Clone, Copy)]
enum ScriptKind {
    Text,
    Calls,
}

/// Where a phase's runtime runs: the embedded bus (in-process), or an iii engine.
#[derive(Clone, Copy)]
enum Mode<'a> {
    Embedded,
    /// The engine's worker URL (`--iii`).
    Iii(&'a str),
}

impl Mode<'_> {
    fn is_iii(&self) -> bool {
        matches!(self, Mode::Iii(_))
    }
}

/// Where a phase opens its runtime: the mode and the directory of its temporary stores.
#[derive(Clone, Copy)]
struct At<'a> {
    mode: Mode<'a>,
    base: &'a Path,
    /// Opens the runtimes (the binary's wiring, embedded or on iii).
    host: &'a dyn Host,
}

struct Rig {
    harness: Harness,
    opened: Opened,
    probe: Arc<Probe>,
    _dir: TempDir,
}

/// Registers the in-process no-op target of the function-call phases.
fn register_noop(bus: &dyn Bus) {
    // In-process and instant: what a call costs beyond its target is what is measured.
    bus.register_function(
        FunctionDef::new(NOOP_FN, "harness bench: answers {\"ok\": true} at once"),
        Arc::new(|_p: Value, _ctx: CallContext| async {
            Ok::<Value, BusError>(json!({"ok": true}))
        }),
    );
}

impl Rig {
    async fn open(at: At<'_>, script: ScriptKind, durability: Durability) -> Result<Rig> {
        let dir = TempDir::new(at.base)?;
        let script_path = dir.0.join("bench-script.json");
        let text = match script {
            ScriptKind::Text => TEXT_SCRIPT,
            ScriptKind::Calls => CALL_SCRIPT,
        };
        std::fs::write(&script_path, text)
            .with_context(|| format!("cannot write {}", script_path.display()))?;
        let probe = Arc::new(Probe::default());
        let layer_probe = probe.clone();
        let spec = RigSpec {
            data_dir: dir.0.join("data"),
            script: script_path,
            durability,
            config: HarnessConfig::default(),
            register: matches!(script, ScriptKind::Calls)
                .then(|| Box::new(|bus: &dyn Bus| register_noop(bus)) as host::Register),
            layer: Box::new(move |inner| {
                Arc::new(ProbeBus {
                    inner,
                    probe: layer_probe,
                }) as Arc<dyn Bus>
            }),
        };
        let iii = match at.mode {
            Mode::Embedded => None,
            Mode::Iii(url) => Some(url),
        };
        let opened = at.host.open(iii, spec).await?;
        Ok(Rig {
            harness: opened.harness.clone(),
            opened,
            probe,
            _dir: dir,
        })
    }

    fn driver(&self) -> Driver {
        Driver {
            harness: self.harness.clone(),
            probe: self.probe.clone(),
        }
    }

    /// The store's fsync counter; None on iii (the engine holds the loop's state and queue and
    /// gives no durability point, so there is nothing comparable to count).
    fn fsyncs(&self) -> Option<u64> {
        self.store().map(|s| s.stats().fsyncs)
    }

    /// The embedded store (None on iii).
    fn store(&self) -> Option<&harness_store::Store> {
        self.opened.store.as_ref()
    }

    /// Waits until every step message is acked (its fsync included). On iii: until every step
    /// enqueued on `harness-turn` has been handled (the engine's queue depth is not visible).
    async fn queue_idle(&self) -> Result<()> {
        let deadline = Instant::now() + TURN_TIMEOUT;
        loop {
            let busy = match &self.opened.queue_depth {
                Some(depth) => depth() > 0,
                None => {
                    self.probe.steps_handled.load(Ordering::SeqCst)
                        < self.probe.steps_enqueued.load(Ordering::SeqCst)
                }
            };
            if !busy {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the step queue did not drain within {} s",
                    TURN_TIMEOUT.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
    }

    /// [`Rig::queue_idle`], then a barrier: the last ack's fsync (which runs beside the next
    /// step, off the handoff) has finished, so the fsync counter is settled. Costs no fsync when
    /// everything committed is already synced. (On iii only the queue wait.)
    async fn settle(&self) -> Result<()> {
        self.queue_idle().await?;
        match self.store() {
            Some(store) => store
                .barrier()
                .await
                .map_err(|e| anyhow!("store barrier: {e}")),
            None => Ok(()),
        }
    }

    async fn close(self) {
        (self.opened.close)().await;
    }
}

/// What a worker task needs to run turns.
#[derive(Clone)]
struct Driver {
    harness: Harness,
    probe: Arc<Probe>,
}

impl Driver {
    async fn send(
        &self,
        session: Option<String>,
        options: Option<SendOptions>,
    ) -> Result<(String, String)> {
        self.send_message(session, "hi", options).await
    }

    async fn send_message(
        &self,
        session: Option<String>,
        message: &str,
        options: Option<SendOptions>,
    ) -> Result<(String, String)> {
        let new = session.is_none();
        let resp = self
            .harness
            .send(SendRequest {
                session_id: session,
                message: json!(message),
                model: new.then(|| "bench".to_string()),
                provider: new.then(|| "scripted".to_string()),
                options,
                ..SendRequest::default()
            })
            .await
            .map_err(|e| anyhow!("harness::send failed: {e}"))?;
        Ok((resp.session_id, resp.turn_id))
    }

    /// One turn, start to `turn-completed`; returns the session id.
    async fn turn(&self, session: Option<String>, options: Option<SendOptions>) -> Result<String> {
        let (session_id, turn_id) = self.send(session, options).await?;
        self.probe.wait(&turn_id).await?;
        Ok(session_id)
    }

    /// A call turn ([`CALL_MESSAGE`]) in a new session, start to `turn-completed`; returns the
    /// turn id.
    async fn call_turn(&self, options: Option<SendOptions>) -> Result<String> {
        let (_, turn_id) = self.send_message(None, CALL_MESSAGE, options).await?;
        self.probe.wait(&turn_id).await?;
        Ok(turn_id)
    }

    /// Text turns back to back until `deadline` (or `max_turns`); returns the turns completed.
    async fn text_loop(&self, deadline: Instant, max_turns: u64) -> Result<u64> {
        let mut session = None;
        let mut in_session = 0;
        let mut done = 0;
        while done < max_turns && Instant::now() < deadline {
            let id = self.turn(session.take(), None).await?;
            done += 1;
            in_session += 1;
            if in_session < TURNS_PER_SESSION {
                session = Some(id);
            } else {
                in_session = 0;
            }
        }
        Ok(done)
    }
}

/// Runs `n` text-loop workers until `deadline`; returns the turns they completed.
async fn run_workers(d: &Driver, n: usize, deadline: Instant, max_turns_each: u64) -> Result<u64> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let d = d.clone();
        tasks.spawn(async move { d.text_loop(deadline, max_turns_each).await });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r.context("bench worker panicked")??;
    }
    Ok(total)
}

// --- measurements ---------------------------------------------------------------------------------

fn percentile_us(sorted_ns: &[u64], q: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ns.len() - 1) as f64 * q).round() as usize;
    sorted_ns[i.min(sorted_ns.len() - 1)] as f64 / 1000.0
}

/// Per operation over `samples`: (calls per step, mean µs per step).
fn op_means(samples: &[StepSample]) -> HashMap<String, (f64, f64)> {
    let mut by_op: HashMap<String, (u64, u64)> = HashMap::new();
    for s in samples {
        for (op, (n, ns)) in &s.by_op {
            let e = by_op.entry(op.clone()).or_default();
            e.0 += n;
            e.1 += ns;
        }
    }
    let count = samples.len().max(1) as f64;
    by_op
        .into_iter()
        .map(|(op, (n, ns))| (op, (n as f64 / count, ns as f64 / 1000.0 / count)))
        .collect()
}

/// p50 of `f` over `samples`, in µs.
fn p50_of(samples: &[StepSample], f: impl Fn(&StepSample) -> u64) -> f64 {
    percentile_us(&sorted(samples.iter().map(f).collect()), 0.5)
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

/// CPU time of the whole process (every thread, user + system) in µs, from /proc/self/stat
/// (clock ticks, assumed 100 Hz as on every mainstream Linux); 0 where unavailable.
fn cpu_time_us() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) * 10_000
}

/// Resident set size in bytes (Linux; None elsewhere).
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Hands freed heap back to the OS, so RSS tracks live memory rather than allocator caches.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_heap() {
    extern "C" {
        fn malloc_trim(pad: usize) -> std::os::raw::c_int;
    }
    // SAFETY: malloc_trim only releases free memory of glibc's own arenas; no pointer is passed.
    unsafe {
        malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_heap() {}

/// Runs the host's memory release on every worker of the runtime (each frees what its own
/// thread holds): one task per worker, held at a barrier until all of them ran, so no worker
/// runs two.
async fn release_free_memory(host: &dyn Host) {
    let Some(release) = host.memory_release() else {
        return;
    };
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    let barrier = Arc::new(std::sync::Barrier::new(workers));
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                release();
                barrier.wait();
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    release();
}

async fn settled_rss(host: &dyn Host) -> u64 {
    tokio::time::sleep(Duration::from_millis(100)).await;
    release_free_memory(host).await;
    trim_heap();
    rss_bytes().unwrap_or(0)
}

struct IdleRam {
    sessions: usize,
    bytes_per_session: f64,
    marginal_bytes: f64,
    rss_before: u64,
    rss_after: u64,
    /// SQLite's own heap (every connection's page cache, statements, schema) at the same two
    /// moments: the share of the RSS the store's connections hold.
    sqlite_before: i64,
    sqlite_after: i64,
}

/// Fills `n` sessions (one completed turn each, 64 in flight) until done or `cap` runs out.
async fn fill_sessions(d: &Driver, n: usize, cap: Duration) -> Result<usize> {
    let deadline = Instant::now() + cap;
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..IDLE_FILL_CONCURRENCY.min(n) {
        let d = d.clone();
        let next = next.clone();
        tasks.spawn(async move {
            let mut made = 0usize;
            while (next.fetch_add(1, Ordering::Relaxed) as usize) < n && Instant::now() < deadline {
                d.turn(None, None).await?;
                made += 1;
            }
            anyhow::Ok(made)
        });
    }
    let mut made = 0;
    while let Some(r) = tasks.join_next().await {
        made += r.context("bench worker panicked")??;
    }
    Ok(made)
}

async fn idle_ram(at: At<'_>, plan: &Plan) -> Result<IdleRam> {
    progress(&format!(
        "RAM per idle session ({} sessions, fsync off)",
        plan.idle_sessions
    ));
    let rig = Rig::open(at, ScriptKind::Text, Durability::Normal).await?;
    let d = rig.driver();
    // Warm-up: the runtime's fixed costs (threads, connections, statement caches) land before the baseline.
    fill_sessions(&d, 100, Duration::from_secs(2)).await?;
    rig.queue_idle().await?;
    let rss_before = settled_rss(at.host).await;
    let sqlite_before = harness_store::Store::sqlite_heap_bytes();
    let cap_end = Instant::now() + plan.idle_cap;
    let half = plan.idle_sessions / 2;
    let made_half = fill_sessions(&d, half, plan.idle_cap).await?;
    rig.queue_idle().await?;
    let rss_half = settled_rss(at.host).await;
    let left = cap_end.saturating_duration_since(Instant::now());
    let made_rest = fill_sessions(&d, plan.idle_sessions - half, left).await?;
    rig.queue_idle().await?;
    let rss_after = settled_rss(at.host).await;
    let sqlite_after = harness_store::Store::sqlite_heap_bytes();
    let sessions = made_half + made_rest;
    if sessions < plan.idle_sessions {
        progress(&format!("  time cap reached: measured {sessions} sessions"));
    }
    let per = |delta: i64, n: usize| {
        if n == 0 {
            0.0
        } else {
            (delta.max(0) as f64) / n as f64
        }
    };
    let out = IdleRam {
        sessions,
        bytes_per_session: per(rss_after as i64 - rss_before as i64, sessions),
        marginal_bytes: per(rss_after as i64 - rss_half as i64, made_rest),
        rss_before,
        rss_after,
        sqlite_before,
        sqlite_after,
    };
    rig.close().await;
    Ok(out)
}

struct Overhead {
    steps: usize,
    overhead_p50: f64,
    overhead_p99: f64,
    step_p50: f64,
    step_p99: f64,
    store_p50: f64,
    store_ops_per_step: f64,
    /// One empty commit of the embedded store (None on iii: the loop's store is the engine).
    store_write_p50: Option<f64>,
    store_write_idle_p50: Option<f64>,
    /// Process CPU time (all threads) per turn of the measured run, send and ack included.
    cpu_per_turn_us: f64,
    /// Wall time per turn of the measured run (send → turn-completed, back to back).
    wall_per_turn_us: f64,
    /// Per operation: calls per step and mean µs per step, slowest first; store operations
    /// (subtracted from the overhead) and timed loop calls (part of it) apart.
    store_breakdown: Vec<(String, f64, f64)>,
    loop_breakdown: Vec<(String, f64, f64)>,
}

async fn overhead(at: At<'_>, plan: &Plan) -> Result<Overhead> {
    progress(&format!(
        "loop overhead per step ({} text steps, concurrency 1, fsync off)",
        plan.overhead_steps
    ));
    let rig = Rig::open(at, ScriptKind::Text, Durability::Normal).await?;
    let d = rig.driver();
    d.text_loop(Instant::now() + plan.overhead_cap, 50).await?;
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(true, Ordering::Relaxed);
    let (cpu0, t0) = (cpu_time_us(), Instant::now());
    let turns = d
        .text_loop(
            Instant::now() + plan.overhead_cap,
            plan.overhead_steps as u64,
        )
        .await?;
    let (cpu1, run_wall) = (cpu_time_us(), t0.elapsed());
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(false, Ordering::Relaxed);
    let samples = std::mem::take(&mut *lock(&rig.probe.steps));
    if samples.is_empty() {
        bail!("no step was measured");
    }
    let over = sorted(
        samples
            .iter()
            .map(|s| s.wall_ns.saturating_sub(s.store_ns))
            .collect(),
    );
    let wall = sorted(samples.iter().map(|s| s.wall_ns).collect());
    let store = sorted(samples.iter().map(|s| s.store_ns).collect());
    let ops: u64 = samples.iter().map(|s| s.store_ops).sum();
    let (mut store_breakdown, mut loop_breakdown) = (Vec::new(), Vec::new());
    for (op, (n, us)) in op_means(&samples) {
        let row = (op.clone(), n, us);
        if is_store_op(&op) {
            store_breakdown.push(row);
        } else {
            loop_breakdown.push(row);
        }
    }
    store_breakdown.sort_by(|a, b| b.2.total_cmp(&a.2));
    loop_breakdown.sort_by(|a, b| b.2.total_cmp(&a.2));
    // One empty commit, as a yardstick for the store's part (embedded only).
    let (store_write_p50, store_write_idle_p50) = match rig.store() {
        Some(store) => {
            let (writes, idle_writes) = store_writes(store, plan.store_writes).await?;
            (
                Some(percentile_us(&writes, 0.5)),
                Some(percentile_us(&idle_writes, 0.5)),
            )
        }
        None => (None, None),
    };
    let out = Overhead {
        steps: samples.len(),
        overhead_p50: percentile_us(&over, 0.5),
        overhead_p99: percentile_us(&over, 0.99),
        step_p50: percentile_us(&wall, 0.5),
        step_p99: percentile_us(&wall, 0.99),
        store_p50: percentile_us(&store, 0.5),
        store_ops_per_step: ops as f64 / samples.len() as f64,
        store_write_p50,
        store_write_idle_p50,
        cpu_per_turn_us: cpu1.saturating_sub(cpu0) as f64 / turns.max(1) as f64,
        wall_per_turn_us: run_wall.as_secs_f64() * 1e6 / turns.max(1) as f64,
        store_breakdown,
        loop_breakdown,
    };
    rig.close().await;
    Ok(out)
}

/// `n` empty commits back to back, then `n / 4` after 1 ms of idleness each (the writer thread
/// and the waiting worker are parked and must be woken, as between the store calls of a step);
/// sorted ns.
async fn store_writes(store: &harness_store::Store, n: usize) -> Result<(Vec<u64>, Vec<u64>)> {
    let mut writes = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        store
            .write(|_| Ok(()))
            .await
            .map_err(|e| anyhow!("store write: {e}"))?;
        writes.push(t.elapsed().as_nanos() as u64);
    }
    let mut idle_writes = Vec::with_capacity(n / 4);
    for _ in 0..n / 4 {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let t = Instant::now();
        store
            .write(|_| Ok(()))
            .await
            .map_err(|e| anyhow!("store write: {e}"))?;
        idle_writes.push(t.elapsed().as_nanos() as u64);
    }
    Ok((sorted(writes), sorted(idle_writes)))
}

struct Handoff {
    samples: usize,
    p50: f64,
    p99: f64,
    send_p50: f64,
}

async fn handoff(at: At<'_>, plan: &Plan, durability: Durability) -> Result<Handoff> {
    let label = if durability == Durability::Full {
        "on"
    } else {
        "off"
    };
    progress(&format!(
        "step→step handoff ({} turns of {} steps, fsync {label})",
        plan.handoff_turns,
        HANDOFF_MAX_TURNS + 1
    ));
    let rig = Rig::open(at, ScriptKind::Calls, durability).await?;
    let d = rig.driver();
    let options = || {
        Some(SendOptions {
            max_turns: Some(HANDOFF_MAX_TURNS),
            ..SendOptions::default()
        })
    };
    for _ in 0..3 {
        d.call_turn(options()).await?;
    }
    rig.queue_idle().await?;
    rig.probe.track_handoff.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + plan.handoff_cap;
    for _ in 0..plan.handoff_turns {
        if Instant::now() > deadline {
            break;
        }
        d.call_turn(options()).await?;
    }
    rig.queue_idle().await?;
    rig.probe.track_handoff.store(false, Ordering::Relaxed);
    let steps = sorted(std::mem::take(&mut *lock(&rig.probe.handoff_step_ns)));
    let sends = sorted(std::mem::take(&mut *lock(&rig.probe.handoff_send_ns)));
    if steps.is_empty() {
        bail!("no step→step handoff was measured (did the turns run more than one step?)");
    }
    let out = Handoff {
        samples: steps.len(),
        p50: percentile_us(&steps, 0.5),
        p99: percentile_us(&steps, 0.99),
        send_p50: percentile_us(&sends, 0.5),
    };
    rig.close().await;
    Ok(out)
}

struct Fsyncs {
    turns: usize,
    per_step: f64,
    per_send: f64,
}

async fn fsyncs(at: At<'_>, plan: &Plan) -> Result<Fsyncs> {
    progress(&format!(
        "fsyncs per text step ({} turns, concurrency 1, fsync on)",
        plan.fsync_turns
    ));
    let rig = Rig::open(at, ScriptKind::Text, Durability::Full).await?;
    let d = rig.driver();
    d.text_loop(Instant::now() + plan.fsync_cap, 10).await?;
    rig.queue_idle().await?;
    let (mut in_send, mut in_step, mut turns) = (0u64, 0u64, 0usize);
    let mut session: Option<String> = None;
    let deadline = Instant::now() + plan.fsync_cap;
    while turns < plan.fsync_turns && Instant::now() < deadline {
        let s0 = rig.fsyncs().unwrap_or(0);
        let (sid, turn_id) = d.send(session.take(), None).await?;
        let s1 = rig.fsyncs().unwrap_or(0);
        d.probe.wait(&turn_id).await?;
        rig.queue_idle().await?;
        let s2 = rig.fsyncs().unwrap_or(0);
        in_send += s1 - s0;
        in_step += s2 - s1;
        turns += 1;
        if turns % TURNS_PER_SESSION as usize != 0 {
            session = Some(sid);
        }
    }
    rig.close().await;
    let n = turns.max(1) as f64;
    Ok(Fsyncs {
        turns,
        per_step: in_step as f64 / n,
        per_send: in_send as f64 / n,
    })
}

/// One operation of the call-step breakdown: calls and mean µs per call step, and the same per
/// paired text step.
struct OpRow {
    op: String,
    store: bool,
    call_n: f64,
    call_us: f64,
    text_n: f64,
    text_us: f64,
}

struct Calls {
    /// Call steps and paired text steps measured (fsync off).
    steps: usize,
    text_steps: usize,
    step_p50: f64,
    step_p99: f64,
    target_p50: f64,
    /// p50 of (call step − its target time).
    net_p50: f64,
    text_step_p50: f64,
    /// p50 of (step − target − store) for call steps, (step − store) for text steps.
    loop_p50: f64,
    text_loop_p50: f64,
    store_p50: f64,
    text_store_p50: f64,
    store_ops_per_step: f64,
    text_store_ops_per_step: f64,
    /// Slowest (by the call step's mean) first.
    breakdown: Vec<OpRow>,
    /// Whole call step with fsync on.
    fsync_step_p50: f64,
    /// None on iii (no fsync counter: see [`Rig::fsyncs`]).
    fsyncs_per_step: Option<f64>,
    fsyncs_per_turn: Option<f64>,
    /// Turns of each length in the fsync measurement.
    fsync_turns: usize,
}

impl Calls {
    /// What one call adds to a step beyond its target: p50(call step − target) − p50(text step).
    fn overhead_p50(&self) -> f64 {
        self.net_p50 - self.text_step_p50
    }

    /// The same with the store's time also taken out of both.
    fn overhead_loop_p50(&self) -> f64 {
        self.loop_p50 - self.text_loop_p50
    }
}

fn function_options(max_turns: u32) -> Option<SendOptions> {
    Some(SendOptions {
        max_turns: Some(max_turns),
        functions: Some(FunctionPolicy {
            allow: vec!["bench::*".into()],
            deny: vec![],
            expose: ExposeMode::Native,
        }),
        ..SendOptions::default()
    })
}

/// ns the step spent awaiting `bench::noop`, and how many calls of it the step made.
fn target_of(s: &StepSample) -> (u64, u64) {
    s.by_op
        .get(NOOP_FN)
        .map(|(n, ns)| (*ns, *n))
        .unwrap_or((0, 0))
}

async fn function_calls(at: At<'_>, plan: &Plan) -> Result<Calls> {
    let n = FUNCTION_MAX_TURNS as usize;
    progress(&format!(
        "function-call steps ({} call steps in turns of {n} calls + paired text steps, concurrency 1, fsync off)",
        plan.function_steps
    ));
    let rig = Rig::open(at, ScriptKind::Calls, Durability::Normal).await?;
    let d = rig.driver();
    d.call_turn(function_options(FUNCTION_MAX_TURNS)).await?;
    d.text_loop(Instant::now() + plan.function_cap, 20).await?;
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(true, Ordering::Relaxed);
    let (mut call_turns, mut text_turns) = (HashSet::new(), HashSet::new());
    let (mut text_session, mut in_session) = (None, 0);
    let deadline = Instant::now() + plan.function_cap;
    while call_turns.len() * n < plan.function_steps && Instant::now() < deadline {
        call_turns.insert(d.call_turn(function_options(FUNCTION_MAX_TURNS)).await?);
        for _ in 0..n {
            let (sid, turn_id) = d.send(text_session.take(), None).await?;
            d.probe.wait(&turn_id).await?;
            text_turns.insert(turn_id);
            in_session += 1;
            if in_session < TURNS_PER_SESSION {
                text_session = Some(sid);
            } else {
                in_session = 0;
            }
        }
    }
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(false, Ordering::Relaxed);
    let samples = std::mem::take(&mut *lock(&rig.probe.steps));
    rig.close().await;
    // The steps that ran exactly one call (not the step that ends the turn on max_turns), and
    // the paired text steps.
    let (calls, text): (Vec<StepSample>, Vec<StepSample>) = samples
        .into_iter()
        .filter(|s| {
            (call_turns.contains(&s.turn_id) && target_of(s).1 == 1)
                || text_turns.contains(&s.turn_id)
        })
        .partition(|s| call_turns.contains(&s.turn_id));
    if calls.is_empty() || text.is_empty() {
        bail!(
            "no function-call step was measured ({} call steps, {} text steps): did {NOOP_FN} run?",
            calls.len(),
            text.len()
        );
    }
    let wall = sorted(calls.iter().map(|s| s.wall_ns).collect());
    let ops = |v: &[StepSample]| {
        v.iter().map(|s| s.store_ops).sum::<u64>() as f64 / v.len().max(1) as f64
    };
    let (call_ops, text_ops) = (op_means(&calls), op_means(&text));
    let mut breakdown: Vec<OpRow> = call_ops
        .keys()
        .chain(text_ops.keys())
        .collect::<HashSet<_>>()
        .into_iter()
        .map(|op| {
            let (call_n, call_us) = call_ops.get(op).copied().unwrap_or_default();
            let (text_n, text_us) = text_ops.get(op).copied().unwrap_or_default();
            OpRow {
                op: op.clone(),
                store: is_store_op(op),
                call_n,
                call_us,
                text_n,
                text_us,
            }
        })
        .collect();
    breakdown.sort_by(|a, b| b.call_us.total_cmp(&a.call_us));
    let mut out = Calls {
        steps: calls.len(),
        text_steps: text.len(),
        step_p50: percentile_us(&wall, 0.5),
        step_p99: percentile_us(&wall, 0.99),
        target_p50: p50_of(&calls, |s| target_of(s).0),
        net_p50: p50_of(&calls, |s| s.wall_ns.saturating_sub(target_of(s).0)),
        text_step_p50: p50_of(&text, |s| s.wall_ns),
        loop_p50: p50_of(&calls, |s| {
            s.wall_ns
                .saturating_sub(target_of(s).0)
                .saturating_sub(s.store_ns)
        }),
        text_loop_p50: p50_of(&text, |s| s.wall_ns.saturating_sub(s.store_ns)),
        store_p50: p50_of(&calls, |s| s.store_ns),
        text_store_p50: p50_of(&text, |s| s.store_ns),
        store_ops_per_step: ops(&calls),
        text_store_ops_per_step: ops(&text),
        breakdown,
        fsync_step_p50: 0.0,
        fsyncs_per_step: None,
        fsyncs_per_turn: None,
        fsync_turns: 0,
    };

    progress(&format!(
        "fsyncs per function step ({} turns each of {FUNCTION_MAX_TURNS} and {FUNCTION_SHORT_MAX_TURNS} calls, concurrency 1, fsync on)",
        plan.function_fsync_turns
    ));
    let rig = Rig::open(at, ScriptKind::Calls, Durability::Full).await?;
    let d = rig.driver();
    for len in [FUNCTION_MAX_TURNS, FUNCTION_SHORT_MAX_TURNS] {
        d.call_turn(function_options(len)).await?;
    }
    rig.settle().await?;
    rig.probe.sample_steps.store(true, Ordering::Relaxed);
    // Per length: (turns, fsyncs after the send).
    let mut totals = [(0usize, 0u64); 2];
    let mut fsync_turns = HashSet::new();
    let deadline = Instant::now() + plan.function_fsync_cap;
    while totals.iter().any(|t| t.0 < plan.function_fsync_turns) && Instant::now() < deadline {
        for (i, len) in [FUNCTION_MAX_TURNS, FUNCTION_SHORT_MAX_TURNS]
            .into_iter()
            .enumerate()
        {
            let (_, turn_id) = d
                .send_message(None, CALL_MESSAGE, function_options(len))
                .await?;
            // The send has fsynced before it answered: counting starts here.
            let s1 = rig.fsyncs();
            d.probe.wait(&turn_id).await?;
            rig.settle().await?;
            totals[i].0 += 1;
            if let (Some(s1), Some(s2)) = (s1, rig.fsyncs()) {
                totals[i].1 += s2 - s1;
            }
            fsync_turns.insert(turn_id);
        }
    }
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(false, Ordering::Relaxed);
    let samples = std::mem::take(&mut *lock(&rig.probe.steps));
    rig.close().await;
    let mean = |(turns, fsyncs): (usize, u64)| fsyncs as f64 / turns.max(1) as f64;
    let (long, short) = (mean(totals[0]), mean(totals[1]));
    if !at.mode.is_iii() {
        out.fsyncs_per_turn = Some(long);
        out.fsyncs_per_step =
            Some((long - short) / (FUNCTION_MAX_TURNS - FUNCTION_SHORT_MAX_TURNS) as f64);
    }
    out.fsync_turns = totals[0].0.min(totals[1].0);
    let fsync_calls: Vec<StepSample> = samples
        .into_iter()
        .filter(|s| fsync_turns.contains(&s.turn_id) && target_of(s).1 == 1)
        .collect();
    out.fsync_step_p50 = p50_of(&fsync_calls, |s| s.wall_ns);
    Ok(out)
}

struct LongSession {
    samples: usize,
    short_step_p50: f64,
    long_step_p50: f64,
    short_overhead_p50: f64,
    long_overhead_p50: f64,
    /// `context::assemble` as the step awaits it, p50 µs: 10-entry, 1,000-entry, and 1,000-entry
    /// sessions whose history a compaction record already summarizes.
    short_assemble_p50: f64,
    long_assemble_p50: f64,
    summarized_assemble_p50: f64,
}

impl LongSession {
    /// Assembly on a summarized 1,000-entry session over assembly on a 10-entry one (p50s).
    fn summarized_assemble_ratio(&self) -> f64 {
        if self.short_assemble_p50 > 0.0 {
            self.summarized_assemble_p50 / self.short_assemble_p50
        } else {
            0.0
        }
    }

    /// Whole step on a 1,000-entry session over the same on a 10-entry one (p50s).
    fn step_ratio(&self) -> f64 {
        if self.short_step_p50 > 0.0 {
            self.long_step_p50 / self.short_step_p50
        } else {
            0.0
        }
    }

    fn overhead_ratio(&self) -> f64 {
        if self.short_overhead_p50 > 0.0 {
            self.long_overhead_p50 / self.short_overhead_p50
        } else {
            0.0
        }
    }
}

/// Appends user messages until the session has `entries` entries.
async fn fill_transcript(d: &Driver, session_id: &str, from: usize, entries: usize) -> Result<()> {
    for i in from..entries {
        d.harness
            .bus()
            .call(
                "session::append",
                json!({"session_id": session_id, "message": {"role": "user", "content": [{"type": "text", "text": format!("earlier message {i}")}], "timestamp": 1}}),
                None,
            )
            .await
            .map_err(|e| anyhow!("session::append: {e}"))?;
    }
    Ok(())
}

/// Writes a compaction record whose tail anchor keeps the last `keep` entries, as the loop does
/// after summarizing the rest.
async fn summarize_transcript(d: &Driver, session_id: &str, keep: usize) -> Result<()> {
    let mut entries: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = d
            .harness
            .bus()
            .call(
                "session::messages",
                json!({"session_id": session_id, "include_custom": false, "limit": 500, "cursor": cursor}),
                None,
            )
            .await
            .map_err(|e| anyhow!("session::messages: {e}"))?;
        entries.extend(page["messages"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let anchor = match entries.len().checked_sub(keep).and_then(|i| entries.get(i)) {
        Some(e) => e["entry_id"].as_str().unwrap_or_default().to_string(),
        None => bail!("the session has fewer than {keep} entries to keep"),
    };
    d.harness
        .bus()
        .call(
            "session::append",
            json!({"session_id": session_id, "entry_id": format!("e_bench_{session_id}_compaction_{}", entries.len()),
                   "custom": {"custom_type": "compaction", "data": {
                       "summary": "The user sent a thousand short numbered messages; nothing else happened.",
                       "tail_start_entry_id": anchor, "summarized_head_tokens": 6000}}}),
            None,
        )
        .await
        .map_err(|e| anyhow!("session::append: {e}"))?;
    Ok(())
}

/// Text steps on sessions of [`SHORT_ENTRIES`] and of [`LONG_ENTRIES`] entries, alternating
/// (concurrency 1, fsync off, each session already stepped once, as in a live conversation).
async fn long_session(at: At<'_>, plan: &Plan) -> Result<LongSession> {
    progress(&format!(
        "long sessions ({} steps on {SHORT_ENTRIES}-entry and on {LONG_ENTRIES}-entry sessions, fsync off)",
        plan.long_turns
    ));
    let rig = Rig::open(at, ScriptKind::Text, Durability::Normal).await?;
    let d = rig.driver();
    let (mut short, mut long, mut summarized) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..LONG_PHASE_SESSIONS {
        let sid = d.turn(None, None).await?;
        fill_transcript(&d, &sid, 2, LONG_ENTRIES - 2).await?;
        summarize_transcript(&d, &sid, SHORT_ENTRIES - 2).await?;
        d.turn(Some(sid.clone()), None).await?;
        summarized.push(sid);
    }
    for i in 0..2 * LONG_PHASE_SESSIONS {
        let sid = d.turn(None, None).await?;
        // A turn leaves 2 entries (the message and the answer); the next one adds 2 more.
        let target = if i % 2 == 0 {
            SHORT_ENTRIES
        } else {
            LONG_ENTRIES
        } - 2;
        fill_transcript(&d, &sid, 2, target).await?;
        d.turn(Some(sid.clone()), None).await?;
        if i % 2 == 0 {
            short.push(sid);
        } else {
            long.push(sid);
        }
    }
    rig.queue_idle().await?;
    let mut long_turns = HashSet::new();
    let mut summarized_turns = HashSet::new();
    rig.probe.sample_steps.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + plan.long_cap;
    let mut done = 0;
    while done < plan.long_turns && Instant::now() < deadline {
        let i = done % LONG_PHASE_SESSIONS;
        // Short sessions are swapped for fresh ones as they grow, so they stay near 10 entries.
        if done > 0 && i == 0 && done % (4 * LONG_PHASE_SESSIONS) == 0 {
            rig.probe.sample_steps.store(false, Ordering::Relaxed);
            for sid in short.iter_mut() {
                let fresh = d.turn(None, None).await?;
                fill_transcript(&d, &fresh, 2, SHORT_ENTRIES - 2).await?;
                d.turn(Some(fresh.clone()), None).await?;
                *sid = fresh;
            }
            // The summarized sessions are summarized again, so their window stays the last
            // few entries instead of growing with every measured turn.
            for sid in &summarized {
                summarize_transcript(&d, sid, SHORT_ENTRIES - 2).await?;
                d.turn(Some(sid.clone()), None).await?;
            }
            rig.queue_idle().await?;
            rig.probe.sample_steps.store(true, Ordering::Relaxed);
        }
        d.turn(Some(short[i].clone()), None).await?;
        let (_, turn_id) = d.send(Some(long[i].clone()), None).await?;
        d.probe.wait(&turn_id).await?;
        long_turns.insert(turn_id);
        let (_, turn_id) = d.send(Some(summarized[i].clone()), None).await?;
        d.probe.wait(&turn_id).await?;
        summarized_turns.insert(turn_id);
        done += 1;
    }
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(false, Ordering::Relaxed);
    let samples = std::mem::take(&mut *lock(&rig.probe.steps));
    rig.close().await;
    let (summarized_s, rest): (Vec<&StepSample>, Vec<&StepSample>) = samples
        .iter()
        .filter(|s| !s.turn_id.is_empty())
        .partition(|s| summarized_turns.contains(&s.turn_id));
    let (long_s, short_s): (Vec<&StepSample>, Vec<&StepSample>) = rest
        .into_iter()
        .partition(|s| long_turns.contains(&s.turn_id));
    let assemble = |v: &[&StepSample]| {
        percentile_us(
            &sorted(
                v.iter()
                    .filter_map(|s| s.by_op.get("context::assemble").map(|(_, ns)| *ns))
                    .collect(),
            ),
            0.5,
        )
    };
    if long_s.is_empty() || short_s.is_empty() {
        bail!("the long-session phase measured no step");
    }
    let wall =
        |v: &[&StepSample]| percentile_us(&sorted(v.iter().map(|s| s.wall_ns).collect()), 0.5);
    let over = |v: &[&StepSample]| {
        percentile_us(
            &sorted(
                v.iter()
                    .map(|s| s.wall_ns.saturating_sub(s.store_ns))
                    .collect(),
            ),
            0.5,
        )
    };
    Ok(LongSession {
        samples: long_s.len(),
        short_step_p50: wall(&short_s),
        long_step_p50: wall(&long_s),
        short_overhead_p50: over(&short_s),
        long_overhead_p50: over(&long_s),
        short_assemble_p50: assemble(&short_s),
        long_assemble_p50: assemble(&long_s),
        summarized_assemble_p50: assemble(&summarized_s),
    })
}

async fn router_latency(plan: &Plan) -> Result<FrameLatencyReport> {
    progress(&format!(
        "router latency ({} frames, {} requests over a local SSE server)",
        plan.router.frames, plan.router.requests
    ));
    match tokio::time::timeout(
        ROUTER_TIMEOUT,
        harness_router::bench::frame_latency(plan.router.clone()),
    )
    .await
    {
        Ok(report) => report.context("router frame latency"),
        Err(_) => bail!(
            "the router measurement did not finish within {} s",
            ROUTER_TIMEOUT.as_secs()
        ),
    }
}

struct Cell {
    concurrency: usize,
    fsync: bool,
    steps: u64,
    secs: f64,
    /// None on iii.
    fsyncs: Option<u64>,
    /// What the store's writer did during the cell (None on iii).
    store: Option<StoreDelta>,
    cpu_us: u64,
}

/// The difference of two [`harness_store::StoreStats`]: transactions committed and write ops
/// run in them (how well the writer groups the steps' writes), WAL pages written, and the
/// writer's busy time and the part of it in its own checkpoints.
struct StoreDelta {
    commits: u64,
    writes: u64,
    wal_frames: u64,
    busy_ns: u64,
    checkpoint_ns: u64,
    /// The WAL pages by the table or index they belong to (None if the count failed).
    by_table: Option<harness_store::WalPages>,
}

impl StoreDelta {
    fn between(s0: harness_store::StoreStats, s1: harness_store::StoreStats) -> StoreDelta {
        StoreDelta {
            by_table: None,
            commits: s1.commits - s0.commits,
            writes: s1.writes - s0.writes,
            wal_frames: s1.wal_frames - s0.wal_frames,
            busy_ns: s1.writer_busy_ns - s0.writer_busy_ns,
            checkpoint_ns: s1.writer_checkpoint_ns - s0.writer_checkpoint_ns,
        }
    }
}

impl Cell {
    fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.steps as f64 / self.secs
        } else {
            0.0
        }
    }
}

async fn throughput(at: At<'_>, plan: &Plan, concurrency: usize, fsync: bool) -> Result<Cell> {
    progress(&format!(
        "durable steps/s at {concurrency} sessions, fsync {} ({:.1} s)",
        if fsync { "on" } else { "off" },
        plan.cell.as_secs_f64()
    ));
    let durability = if fsync {
        Durability::Full
    } else {
        Durability::Normal
    };
    let rig = Rig::open(at, ScriptKind::Text, durability).await?;
    let d = rig.driver();
    run_workers(&d, concurrency, Instant::now() + plan.cell_warmup, u64::MAX).await?;
    rig.queue_idle().await?;
    let f0 = rig.fsyncs();
    if let Some(store) = rig.store() {
        store.record_wal_pages(true);
    }
    let s0 = rig.store().map(|s| s.stats());
    let cpu0 = cpu_time_us();
    let start = Instant::now();
    let steps = run_workers(&d, concurrency, start + plan.cell, u64::MAX).await?;
    let secs = start.elapsed().as_secs_f64();
    let cpu_us = cpu_time_us().saturating_sub(cpu0);
    // Before the queue drains, so the writer's busy time covers the same span as `secs`.
    let s1 = rig.store().map(|s| s.stats());
    let by_table = rig.store().and_then(|s| {
        let pages = s.wal_pages_by_table();
        s.record_wal_pages(false);
        pages
            .map_err(|e| progress(&format!("  WAL pages by table: {e}")))
            .ok()
    });
    rig.queue_idle().await?;
    let fsyncs = rig.fsyncs().zip(f0).map(|(f1, f0)| f1 - f0);
    let store = s0.zip(s1).map(|(s0, s1)| StoreDelta {
        by_table,
        ..StoreDelta::between(s0, s1)
    });
    rig.close().await;
    Ok(Cell {
        concurrency,
        fsync,
        steps,
        secs,
        fsyncs,
        store,
        cpu_us,
    })
}

// --- the report ---------------------------------------------------------------------------------

/// The filesystem type of the mount holding `path` (from /proc/self/mounts).
fn fs_type(path: &Path) -> Option<String> {
    let path = path.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, mount, fstype) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(mount)
                .then(|| (mount.len(), fstype.to_string()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, t)| t)
}

struct Target {
    key: &'static str,
    label: &'static str,
    /// None where the figure does not apply (fsync counts on iii).
    value: Option<f64>,
    unit: &'static str,
    target: &'static str,
    met: Option<bool>,
}

impl Target {
    fn new(
        key: &'static str,
        label: &'static str,
        value: Option<f64>,
        unit: &'static str,
        target: &'static str,
        met: impl Fn(f64) -> bool,
    ) -> Target {
        Target {
            key,
            label,
            value,
            unit,
            target,
            met: value.map(met),
        }
    }
}

/// A figure that may not apply in this mode: a number, or null.
fn opt(x: Option<f64>, round: fn(f64) -> f64) -> Value {
    x.map(|v| json!(round(v))).unwrap_or(Value::Null)
}

/// What the iii mode reports differently, said in the report.
const III_NOTES: &[&str] = &[
    "iii mode: every phase runs the loop and all its siblings (as `harness worker --with all`, worker name harness-bench) on an iii engine connection; calls, state, the step queue and events go through the engine",
    "fsync counts (fsyncs_per_*, fsync_turns), store commit counts and the writer's time (store_commits_per_step, store_writer) and the empty-commit yardstick (store_write_*) are null: the engine holds the loop's state and queue and gives no durability point, so there is no fsync or commit to count",
    "fsync on/off (handoff, steps/s, call_step_fsync) only switches the siblings' own SQLite (transcripts, in a temporary dir); the engine's durability is whatever it is configured with",
    "store time (store_*, overhead) is time awaiting session::*, state::*, enqueue, publish and barrier through the engine; barrier reads back the state written since the last one",
    "idle_session_bytes is this process only (loop, siblings, transcripts); the engine's memory for the sessions is not included",
    "router_* does not involve the bus: the same measurement as in-process",
];

/// Runs the bench; `host` opens each phase's runtime (the binary's own wiring).
pub async fn run(args: BenchArgs, host: &dyn Host) -> Result<()> {
    if let Some(url) = &args.iii {
        host.check_iii(url)?;
    }
    let mode = match &args.iii {
        Some(url) => Mode::Iii(url),
        None => Mode::Embedded,
    };
    let plan = Plan::new(&args);
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).with_context(|| format!("cannot create {}", base.display()))?;
    let fs = fs_type(&base).unwrap_or_else(|| "unknown".into());
    if fs == "tmpfs" || fs == "ramfs" {
        eprintln!(
            "bench: warning: {} is on {fs}: fsync costs nothing there; use --dir on a real disk",
            base.display()
        );
    }
    if let Mode::Iii(url) = mode {
        progress(&format!("iii mode: every phase connects to {url}"));
    }
    let at = At {
        mode,
        base: &base,
        host,
    };
    let started = Instant::now();

    progress("physical reference (fsync and bare SQLite commits in the bench directory)");
    let reference = reference::measure(&base)?;
    // Each phase's headline as soon as it is measured: on an iii engine a later phase can
    // fail (an engine call never answered) and the report is printed only at the end.
    let ram = idle_ram(at, &plan).await?;
    progress(&format!(
        "  = {:.0} B per idle session ({} sessions)",
        ram.bytes_per_session, ram.sessions
    ));
    let over = overhead(at, &plan).await?;
    progress(&format!(
        "  = loop overhead p50 {:.2} ms p99 {:.2} ms; whole step p50 {:.2} ms p99 {:.2} ms",
        over.overhead_p50 / 1e3,
        over.overhead_p99 / 1e3,
        over.step_p50 / 1e3,
        over.step_p99 / 1e3
    ));
    let hand = handoff(at, &plan, Durability::Full).await?;
    progress(&format!(
        "  = step→step handoff p50 {:.2} ms p99 {:.2} ms; send→step 0 p50 {:.2} ms ({} samples)",
        hand.p50 / 1e3,
        hand.p99 / 1e3,
        hand.send_p50 / 1e3,
        hand.samples
    ));
    let hand_nofsync = handoff(at, &plan, Durability::Normal).await?;
    progress(&format!(
        "  = step→step handoff p50 {:.2} ms p99 {:.2} ms; send→step 0 p50 {:.2} ms ({} samples)",
        hand_nofsync.p50 / 1e3,
        hand_nofsync.p99 / 1e3,
        hand_nofsync.send_p50 / 1e3,
        hand_nofsync.samples
    ));
    // Nothing to count on iii (see `Rig::fsyncs`).
    let fs_steps = match mode {
        Mode::Embedded => Some(fsyncs(at, &plan).await?),
        Mode::Iii(_) => None,
    };
    let calls = function_calls(at, &plan).await?;
    let long = long_session(at, &plan).await?;
    let router = router_latency(&plan).await?;
    let mut cells = Vec::new();
    for c in CONCURRENCIES {
        for fsync in [true, false] {
            cells.push(throughput(at, &plan, c, fsync).await?);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();

    let rate = |c: usize, fsync: bool| {
        cells
            .iter()
            .find(|x| x.concurrency == c && x.fsync == fsync)
            .map(Cell::rate)
            .unwrap_or(0.0)
    };
    let cpu = |c: usize, fsync: bool| {
        cells
            .iter()
            .find(|x| x.concurrency == c && x.fsync == fsync)
            .map(|x| x.cpu_us as f64 / x.steps.max(1) as f64)
            .unwrap_or(0.0)
    };
    let mut steps_per_sec = Map::new();
    let mut cpu_per_step = Map::new();
    let mut fsyncs_per_step = Map::new();
    let mut commits_per_step = Map::new();
    let mut store_writer = Map::new();
    for c in CONCURRENCIES {
        steps_per_sec.insert(
            c.to_string(),
            json!({"fsync": rate(c, true).round(), "nofsync": rate(c, false).round()}),
        );
        cpu_per_step.insert(
            c.to_string(),
            json!({"fsync": cpu(c, true).round(), "nofsync": cpu(c, false).round()}),
        );
        if let Some(cell) = cells.iter().find(|x| x.concurrency == c && x.fsync) {
            fsyncs_per_step.insert(
                c.to_string(),
                opt(
                    cell.fsyncs.map(|f| f as f64 / cell.steps.max(1) as f64),
                    round3,
                ),
            );
            let per_step = |n: u64| json!(round3(n as f64 / cell.steps.max(1) as f64));
            commits_per_step.insert(
                c.to_string(),
                cell.store
                    .as_ref()
                    .map(|d| {
                        let by_table = d.by_table.as_ref();
                        let frame_bytes = by_table.map_or(0, |t| t.frame_bytes);
                        let tables: serde_json::Map<String, Value> = by_table
                            .map(|t| {
                                t.by_table
                                    .iter()
                                    .map(|(name, n)| (name.clone(), per_step(*n)))
                                    .collect()
                            })
                            .unwrap_or_default();
                        json!({
                            "commits": per_step(d.commits),
                            "writes": per_step(d.writes),
                            "wal_pages": per_step(d.wal_frames),
                            "wal_bytes": by_table.map(|_| per_step(d.wal_frames * frame_bytes)),
                            "wal_pages_by_table": by_table.map(|_| Value::Object(tables)),
                        })
                    })
                    .unwrap_or(Value::Null),
            );
            let share = |ns: u64| json!(round3(ns as f64 / 1e9 / cell.secs.max(1e-9)));
            store_writer.insert(
                c.to_string(),
                cell.store
                    .as_ref()
                    .map(
                        |d| json!({"busy": share(d.busy_ns), "checkpoint": share(d.checkpoint_ns)}),
                    )
                    .unwrap_or(Value::Null),
            );
        }
    }

    let fsyncs_per_text_step = fs_steps.as_ref().map(|f| f.per_step);
    // Through an engine a handoff is an enqueue and a delivery, two hops away: its own target.
    let handoff_target = if mode.is_iii() {
        ("≤ 5000 µs", 5000.0)
    } else {
        ("≤ 1000 µs", 1000.0)
    };
    let targets = [
        Target::new(
            "overhead_us_p50",
            "loop overhead per step, p50",
            Some(over.overhead_p50),
            "µs",
            "≤ 150 µs",
            |v| v <= 150.0,
        ),
        Target::new(
            "handoff_us_p50",
            "step→step handoff, p50 (fsync on)",
            Some(hand.p50),
            "µs",
            handoff_target.0,
            |v| v <= handoff_target.1,
        ),
        Target::new(
            "steps_per_sec.200.fsync",
            "durable steps/s, 200 sessions, fsync on",
            Some(rate(200, true)),
            "/s",
            "≥ 10000 /s",
            |v| v >= 10_000.0,
        ),
        Target::new(
            "fsyncs_per_text_step",
            "fsyncs per text step",
            fsyncs_per_text_step,
            "",
            "≤ 1",
            |v| v <= 1.0,
        ),
        Target::new(
            "fsyncs_per_function_step",
            "fsyncs per function step",
            calls.fsyncs_per_step,
            "",
            "≤ 2",
            |v| v <= 2.0,
        ),
        Target::new(
            "router_frame_us_p50",
            "router, socket bytes → frame in the loop, p50",
            Some(router.per_frame_us.p50),
            "µs",
            "≤ 50 µs",
            |v| v <= 50.0,
        ),
        Target::new(
            "long_session_step_ratio",
            "step on a 1,000-entry session vs a 10-entry one, p50",
            Some(long.step_ratio()),
            "×",
            "≤ 1.5 ×",
            |v| v <= 1.5,
        ),
        Target::new(
            "idle_session_bytes",
            "RAM per idle session",
            Some(ram.bytes_per_session),
            "B",
            "≤ 4096 B",
            |v| v <= 4096.0,
        ),
    ];

    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let report = json!({
        "mode": if mode.is_iii() { "iii" } else { "in-process" },
        "engine": match mode { Mode::Iii(url) => json!(url), Mode::Embedded => Value::Null },
        "notes": if mode.is_iii() { json!(III_NOTES) } else { json!([]) },
        "build": build,
        "quick": args.quick,
        "cores": cores,
        "data_fs": fs,
        "elapsed_s": round1(elapsed),
        "overhead_us_p50": round1(over.overhead_p50),
        "overhead_us_p99": round1(over.overhead_p99),
        "step_us_p50": round1(over.step_p50),
        "step_us_p99": round1(over.step_p99),
        "store_us_p50": round1(over.store_p50),
        "store_ops_per_step": round1(over.store_ops_per_step),
        "store_write_us_p50": opt(over.store_write_p50, round1),
        "store_write_idle_us_p50": opt(over.store_write_idle_p50, round1),
        "overhead_steps": over.steps,
        "store_breakdown": breakdown_json(&over.store_breakdown),
        "loop_breakdown": breakdown_json(&over.loop_breakdown),
        "handoff_us_p50": round1(hand.p50),
        "handoff_us_p99": round1(hand.p99),
        "handoff_nofsync_us_p50": round1(hand_nofsync.p50),
        "handoff_nofsync_us_p99": round1(hand_nofsync.p99),
        "send_handoff_us_p50": round1(hand.send_p50),
        "handoff_samples": hand.samples,
        "steps_per_sec": steps_per_sec,
        "cpu_us_per_step": cpu_per_step,
        "turn_us_c1": over.wall_per_turn_us.round(),
        "turn_cpu_us_c1": over.cpu_per_turn_us.round(),
        "fsyncs_per_text_step": opt(fsyncs_per_text_step, round3),
        "fsyncs_per_send": opt(fs_steps.as_ref().map(|f| f.per_send), round3),
        "fsyncs_per_step": fsyncs_per_step,
        "store_commits_per_step": commits_per_step,
        "store_writer": store_writer,
        "fsync_turns": fs_steps.as_ref().map(|f| f.turns),
    });
    let calls_json = json!({
        "call_step_us_p50": round1(calls.step_p50),
        "call_step_us_p99": round1(calls.step_p99),
        "call_overhead_us_p50": round1(calls.overhead_p50()),
        "call_overhead_loop_us_p50": round1(calls.overhead_loop_p50()),
        "call_target_us_p50": round1(calls.target_p50),
        "call_text_step_us_p50": round1(calls.text_step_p50),
        "call_store_us_p50": round1(calls.store_p50),
        "call_text_store_us_p50": round1(calls.text_store_p50),
        "call_store_ops_per_step": round1(calls.store_ops_per_step),
        "call_text_store_ops_per_step": round1(calls.text_store_ops_per_step),
        "call_steps": calls.steps,
        "call_text_steps": calls.text_steps,
        "call_step_fsync_us_p50": round1(calls.fsync_step_p50),
        "call_breakdown": calls.breakdown.iter().map(|r| (r.op.clone(), json!({
            "store": r.store,
            "per_step": round1(r.call_n),
            "us_per_step": round1(r.call_us),
            "text_per_step": round1(r.text_n),
            "text_us_per_step": round1(r.text_us),
        }))).collect::<Map<String, Value>>(),
        "fsyncs_per_function_step": opt(calls.fsyncs_per_step, round3),
        "fsyncs_per_function_turn": opt(calls.fsyncs_per_turn, round3),
        "function_fsync_turns": calls.fsyncs_per_turn.map(|_| calls.fsync_turns),
    });
    let router_json = json!({
        "router_frame_us_p50": round1(router.per_frame_us.p50),
        "router_frame_us_p99": round1(router.per_frame_us.p99),
        "router_frame_added_us_p50": round1(router.added_per_frame_p50_us),
        "router_socket_us_p50": round1(router.socket_baseline_us.p50),
        "router_socket_us_p99": round1(router.socket_baseline_us.p99),
        "router_request_us_p50": round1(router.per_request_us.p50),
        "router_request_us_p99": round1(router.per_request_us.p99),
        "router_frames": router.per_frame_us.samples,
        "router_requests": router.per_request_us.samples,
        "router_latency": serde_json::to_value(&router)?,
    });
    // Every time against what SQLite alone needs for one commit without its fsync (CPU), or
    // against one fsync (disk); rates against one fsync after another. Same run, same directory.
    let per = |x: f64, reference: f64| if reference > 0.0 { x / reference } else { 0.0 };
    let commit = reference.commit_nosync_us;
    let fsync_us = reference.fsync_us;
    let rate_vs_fsync = |r: f64| r * fsync_us / 1e6;
    let ratios: Vec<(&str, f64)> = vec![
        (
            "overhead_us_p50_per_sqlite_commit",
            per(over.overhead_p50, commit),
        ),
        ("step_us_p50_per_sqlite_commit", per(over.step_p50, commit)),
        (
            "store_us_p50_per_sqlite_commit",
            per(over.store_p50, commit),
        ),
        (
            "store_write_us_p50_per_sqlite_commit",
            per(over.store_write_p50.unwrap_or(0.0), commit),
        ),
        (
            "turn_cpu_us_c1_per_sqlite_commit",
            per(over.cpu_per_turn_us, commit),
        ),
        ("handoff_us_p50_per_fsync", per(hand.p50, fsync_us)),
        (
            "handoff_nofsync_us_p50_per_sqlite_commit",
            per(hand_nofsync.p50, commit),
        ),
        (
            "call_step_us_p50_per_sqlite_commit",
            per(calls.step_p50, commit),
        ),
        (
            "call_step_fsync_us_p50_per_fsync",
            per(calls.fsync_step_p50, fsync_us),
        ),
        (
            "steps_per_sec_1_fsync_per_fsync_rate",
            rate_vs_fsync(rate(1, true)),
        ),
        (
            "steps_per_sec_10_fsync_per_fsync_rate",
            rate_vs_fsync(rate(10, true)),
        ),
        (
            "steps_per_sec_200_fsync_per_fsync_rate",
            rate_vs_fsync(rate(200, true)),
        ),
        (
            "long_session_step_us_p50_per_sqlite_commit",
            per(long.long_step_p50, commit),
        ),
    ];
    let more = json!({
        "long_session_step_ratio": round3(long.step_ratio()),
        "long_session_overhead_ratio": round3(long.overhead_ratio()),
        "long_session_step_us_p50": round1(long.long_step_p50),
        "short_session_step_us_p50": round1(long.short_step_p50),
        "long_session_overhead_us_p50": round1(long.long_overhead_p50),
        "short_session_overhead_us_p50": round1(long.short_overhead_p50),
        "long_session_samples": long.samples,
        "assemble_us_p50_10": round1(long.short_assemble_p50),
        "assemble_us_p50_1000": round1(long.long_assemble_p50),
        "assemble_us_p50_1000_summarized": round1(long.summarized_assemble_p50),
        "assemble_summarized_ratio": round3(long.summarized_assemble_ratio()),
        "reference": {
            "fsync_us_p50": round1(reference.fsync_us),
            "sqlite_commit_us_p50": round1(reference.commit_us),
            "sqlite_commit_nosync_us_p50": round1(reference.commit_nosync_us),
            "serial_fsyncs_per_sec": reference.serial_fsyncs_per_sec().round(),
        },
        "ratios": ratios.iter().map(|(k, v)| (k.to_string(), json!(round3(*v)))).collect::<Map<String, Value>>(),
        "idle_session_bytes": ram.bytes_per_session.round(),
        "idle_session_marginal_bytes": ram.marginal_bytes.round(),
        "idle_sessions": ram.sessions,
        "idle_rss_before_bytes": ram.rss_before,
        "idle_rss_after_bytes": ram.rss_after,
        "idle_sqlite_heap_before_bytes": ram.sqlite_before,
        "idle_sqlite_heap_after_bytes": ram.sqlite_after,
        "targets_met": targets.iter().map(|t| (t.key.to_string(), json!(t.met))).collect::<Map<String, Value>>(),
        "method": {
            "overhead": "concurrency 1, fsync off, text steps: step handler wall time minus time awaiting the store (session::*, state::*, enqueue, publish, barrier)",
            "handoff": "9-step turns (denied function call until max_turns): previous step's enqueue returned -> next step's handler start; includes the queue ack and, with fsync on, its fsync",
            "steps_per_sec": "C sessions, each send -> turn-completed -> send (new session every 20 turns); one text turn = one step; the send is included",
            "fsyncs_per_text_step": "concurrency 1, fsync on: fsyncs between send returning and the queue being idle, per turn; the send's own are fsyncs_per_send",
            "call_step": "concurrency 1, fsync off: turns of max_turns 8 whose every generation calls the in-process no-op bench::noop (allow bench::*, expose native, a new call id per step); whole step time of the steps that ran one call (the step ending the turn on max_turns left out)",
            "call_overhead": "p50(call step - time awaiting the bench::noop bus call) - p50(paired text step: text turns run by the same runtime right after each call turn); call_overhead_loop_us_p50 takes the store's time out of both as well; call_breakdown: per-operation calls and mean us per call step vs per paired text step",
            "fsyncs_per_function_step": "fresh runtime, fsync on: turns of 8 and of 2 call steps alternate; fsyncs from send returning to the queue idle and the WAL synced, per turn; (mean 8-call turn - mean 2-call turn) / 6, so the final max_turns step and per-turn costs cancel; fsyncs_per_function_turn is the 8-call turn's total",
            "router": "harness_router::bench::frame_latency: local Anthropic-format SSE server; per frame: server writes an event's bytes -> parsed frame out of the router's frame channel, one event in flight (target on its p50, socket included); router_socket_*: the same on a raw TcpStream; router_frame_added_us_p50 = difference of medians; per request: Router::chat -> request read by the server, plus the server's last byte -> the ack",
            "idle_session_bytes": "fsync off: (VmRSS after - before) / sessions with one completed turn each; each VmRSS read after the allocator's free pages went back to the OS (mimalloc collected on every runtime worker, malloc_trim for SQLite's heap); idle_sqlite_heap_*: SQLite's own heap at the same moments",
            "long_session_step_ratio": "concurrency 1, fsync off: text steps alternating between sessions of ~10 entries and of ~1,000 (user messages appended through session::append, each session stepped before measuring); p50 whole step on the long sessions / p50 on the short ones; long_session_overhead_ratio the same with store time taken out",
            "assemble": "the long-session phase's steps: the context::assemble bus call as the step awaits it (in-process: the typed call, nothing serialized; on an engine: request and answer serialisation included), p50 per step; on sessions of ~10 entries, of ~1,000, and of ~1,000 whose head a compaction record (written through session::append, as the loop writes it) already summarizes, keeping the last 8 entries; assemble_summarized_ratio = summarized / 10-entry",
            "reference": "same run, bench directory: fsync_us_p50 = fdatasync after a 4 KiB append; sqlite_commit_us_p50 = one small INSERT committed by bare SQLite (WAL, synchronous=FULL: it fsyncs); sqlite_commit_nosync_us_p50 = the same with synchronous=OFF (its CPU cost); ratios: times per bare commit (CPU) or per fsync (disk), steps/s times the fsync time (steps per fsync's worth of time)",
        },
    });
    let mut report = report;
    for part in [calls_json, router_json, more] {
        if let (Some(obj), Value::Object(part)) = (report.as_object_mut(), part) {
            obj.extend(part);
        }
    }

    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }

    let mut rows: Vec<(String, String, String, String)> = Vec::new();
    let us = |x: f64| format!("{x:.1} µs");
    let na = || "n/a".to_string();
    for t in &targets {
        let value = match (t.value, t.unit) {
            (None, _) => na(),
            (Some(v), "µs") => us(v),
            (Some(v), "/s") => format!("{v:.0} /s"),
            (Some(v), "B") => format!("{v:.0} B"),
            (Some(v), "×") => format!("{v:.2} ×"),
            (Some(v), _) => format!("{v:.3}"),
        };
        rows.push((
            t.label.into(),
            value,
            t.target.into(),
            match t.met {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "n/a",
            }
            .into(),
        ));
    }
    let info = |rows: &mut Vec<(String, String, String, String)>, label: String, value: String| {
        rows.push((label, value, String::new(), String::new()));
    };
    info(
        &mut rows,
        "loop overhead per step, p99".into(),
        us(over.overhead_p99),
    );
    info(
        &mut rows,
        "whole step (store included), p50 / p99".into(),
        format!("{} / {}", us(over.step_p50), us(over.step_p99)),
    );
    info(
        &mut rows,
        "store time per step, p50 (ops per step)".into(),
        format!("{} ({:.1})", us(over.store_p50), over.store_ops_per_step),
    );
    info(
        &mut rows,
        "one empty store commit, p50 (back to back / after 1 ms idle)".into(),
        match (over.store_write_p50, over.store_write_idle_p50) {
            (Some(a), Some(b)) => format!("{} / {}", us(a), us(b)),
            _ => na(),
        },
    );
    info(
        &mut rows,
        "step→step handoff, p99 (fsync on)".into(),
        us(hand.p99),
    );
    info(
        &mut rows,
        "step→step handoff, p50 / p99 (fsync off)".into(),
        format!("{} / {}", us(hand_nofsync.p50), us(hand_nofsync.p99)),
    );
    info(
        &mut rows,
        "send → step 0 handoff, p50 (fsync on)".into(),
        us(hand.send_p50),
    );
    info(
        &mut rows,
        "one turn at concurrency 1: wall / process CPU (fsync off)".into(),
        format!(
            "{} / {}",
            us(over.wall_per_turn_us),
            us(over.cpu_per_turn_us)
        ),
    );
    for c in CONCURRENCIES {
        info(
            &mut rows,
            format!("durable steps/s, {c} sessions (fsync on / off)"),
            format!("{:.0} / {:.0}", rate(c, true), rate(c, false)),
        );
    }
    for c in CONCURRENCIES {
        info(
            &mut rows,
            format!("process CPU per step, {c} sessions (fsync on / off)"),
            format!("{} / {}", us(cpu(c, true)), us(cpu(c, false))),
        );
    }
    info(
        &mut rows,
        format!(
            "function-call step, whole, p50 / p99 (fsync off, {FUNCTION_MAX_TURNS} calls a turn)"
        ),
        format!("{} / {}", us(calls.step_p50), us(calls.step_p99)),
    );
    info(
        &mut rows,
        "overhead per call excl. target, p50 (vs paired text step)".into(),
        format!(
            "{} ({} − {})",
            us(calls.overhead_p50()),
            us(calls.net_p50),
            us(calls.text_step_p50)
        ),
    );
    info(
        &mut rows,
        "  of it outside the store, p50 (call − target − store vs text − store)".into(),
        us(calls.overhead_loop_p50()),
    );
    info(
        &mut rows,
        "  store per step, p50 (ops): call step / text step".into(),
        format!(
            "{} ({:.1}) / {} ({:.1})",
            us(calls.store_p50),
            calls.store_ops_per_step,
            us(calls.text_store_p50),
            calls.text_store_ops_per_step
        ),
    );
    info(
        &mut rows,
        format!("time in the target ({NOOP_FN} bus call), p50"),
        us(calls.target_p50),
    );
    info(
        &mut rows,
        "function-call step, whole, p50 (fsync on)".into(),
        us(calls.fsync_step_p50),
    );
    info(
        &mut rows,
        format!(
            "fsyncs per function turn ({FUNCTION_MAX_TURNS} calls + final step, send excluded)"
        ),
        calls
            .fsyncs_per_turn
            .map(|v| format!("{v:.3}"))
            .unwrap_or_else(na),
    );
    info(
        &mut rows,
        "router, socket bytes → frame, p99".into(),
        us(router.per_frame_us.p99),
    );
    info(
        &mut rows,
        "raw socket baseline per frame, p50 / p99".into(),
        format!(
            "{} / {}",
            us(router.socket_baseline_us.p50),
            us(router.socket_baseline_us.p99)
        ),
    );
    info(
        &mut rows,
        "router added per frame over the raw socket, p50".into(),
        us(router.added_per_frame_p50_us),
    );
    info(
        &mut rows,
        "router per request (request out + ack back), p50 / p99".into(),
        format!(
            "{} / {}",
            us(router.per_request_us.p50),
            us(router.per_request_us.p99)
        ),
    );
    info(
        &mut rows,
        "fsyncs per send".into(),
        fs_steps
            .as_ref()
            .map(|f| format!("{:.3}", f.per_send))
            .unwrap_or_else(na),
    );
    // One row per concurrency of a per-cell figure; null (on iii) reads n/a.
    let per_cell = |rows: &mut Vec<(String, String, String, String)>,
                    figures: &Map<String, Value>,
                    label: &dyn Fn(usize) -> String,
                    show: &dyn Fn(&Value) -> String| {
        for c in CONCURRENCIES {
            if let Some(v) = figures.get(&c.to_string()) {
                info(rows, label(c), if v.is_null() { na() } else { show(v) });
            }
        }
    };
    per_cell(
        &mut rows,
        &fsyncs_per_step,
        &|c| format!("fsyncs per step incl. send, {c} sessions"),
        &|v| v.to_string(),
    );
    per_cell(
        &mut rows,
        &commits_per_step,
        &|c| {
            format!("store commits / write ops / WAL pages per step incl. send, {c} sessions (fsync on)")
        },
        &|v| format!("{} / {} / {}", v["commits"], v["writes"], v["wal_pages"]),
    );
    per_cell(
        &mut rows,
        &commits_per_step,
        &|c| format!("WAL bytes per step and its pages by table or index, {c} sessions (fsync on)"),
        &|v| {
            let tables = v["wal_pages_by_table"]
                .as_object()
                .map(|t| {
                    t.iter()
                        .map(|(name, n)| format!("{name} {n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            format!("{} B: {tables}", v["wal_bytes"])
        },
    );
    per_cell(
        &mut rows,
        &store_writer,
        &|c| {
            format!("store writer busy / in its own checkpoints, share of wall time, {c} sessions (fsync on)")
        },
        &|v| format!("{} / {}", v["busy"], v["checkpoint"]),
    );
    info(
        &mut rows,
        format!(
            "RAM per idle session, marginal (2nd half of {})",
            ram.sessions
        ),
        format!("{:.0} B", ram.marginal_bytes),
    );
    // The reference column: what each figure is worth in this run's physical units.
    let times = |x: f64, unit: &str, reference: f64| {
        if reference > 0.0 {
            format!("{:.1} × {unit}", x / reference)
        } else {
            na()
        }
    };
    let mut vs: HashMap<String, String> = HashMap::new();
    vs.insert(
        "loop overhead per step, p50".into(),
        times(over.overhead_p50, "commit", commit),
    );
    vs.insert(
        "loop overhead per step, p99".into(),
        times(over.overhead_p99, "commit", commit),
    );
    vs.insert(
        "step→step handoff, p50 (fsync on)".into(),
        times(hand.p50, "fsync", fsync_us),
    );
    vs.insert(
        "step→step handoff, p99 (fsync on)".into(),
        times(hand.p99, "fsync", fsync_us),
    );
    vs.insert(
        "durable steps/s, 200 sessions, fsync on".into(),
        format!("{:.1} per fsync time", rate_vs_fsync(rate(200, true))),
    );
    vs.insert(
        "whole step (store included), p50 / p99".into(),
        times(over.step_p50, "commit", commit),
    );
    vs.insert(
        "store time per step, p50 (ops per step)".into(),
        times(over.store_p50, "commit", commit),
    );
    vs.insert(
        "one empty store commit, p50 (back to back / after 1 ms idle)".into(),
        times(over.store_write_p50.unwrap_or(0.0), "commit", commit),
    );
    vs.insert(
        "step→step handoff, p50 / p99 (fsync off)".into(),
        times(hand_nofsync.p50, "commit", commit),
    );
    vs.insert(
        "one turn at concurrency 1: wall / process CPU (fsync off)".into(),
        times(over.cpu_per_turn_us, "commit (CPU)", commit),
    );
    for c in CONCURRENCIES {
        vs.insert(
            format!("durable steps/s, {c} sessions (fsync on / off)"),
            format!("{:.1} per fsync time", rate_vs_fsync(rate(c, true))),
        );
    }
    vs.insert(
        format!(
            "function-call step, whole, p50 / p99 (fsync off, {FUNCTION_MAX_TURNS} calls a turn)"
        ),
        times(calls.step_p50, "commit", commit),
    );
    vs.insert(
        "function-call step, whole, p50 (fsync on)".into(),
        times(calls.fsync_step_p50, "fsync", fsync_us),
    );
    vs.insert(
        "step on a 1,000-entry session vs a 10-entry one, p50".into(),
        format!("{} / {}", us(long.long_step_p50), us(long.short_step_p50)),
    );
    info(
        &mut rows,
        "  the same, store time taken out".into(),
        format!("{:.2} ×", long.overhead_ratio()),
    );
    let rows: Vec<(String, String, String, String, String)> = rows
        .into_iter()
        .map(|(label, value, target, met)| {
            let r = vs.get(&label).cloned().unwrap_or_default();
            (label, value, target, met, r)
        })
        .collect();
    let widths = rows.iter().fold((6, 5, 6), |(a, b, c), r| {
        (
            a.max(r.0.chars().count()),
            b.max(r.1.chars().count()),
            c.max(r.2.chars().count()),
        )
    });
    let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
    let where_ = match mode {
        Mode::Embedded => format!("in-process, store on {fs}"),
        Mode::Iii(url) => {
            format!("iii engine at {url} (loop + all siblings as its worker; their SQLite on {fs})")
        }
    };
    println!(
        "harness bench: {where_}, scripted provider at zero latency, {build} build, {cores} cores, {:.0} s{}",
        elapsed,
        if args.quick { " (--quick)" } else { "" }
    );
    if mode.is_iii() {
        for note in III_NOTES {
            println!("  note: {note}");
        }
    }
    println!();
    println!(
        "physical reference (this run, {}): fsync {} p50; bare SQLite commit {} with its fsync, {} without (the \"commit\" below)",
        base.display(),
        us(reference.fsync_us),
        us(reference.commit_us),
        us(reference.commit_nosync_us)
    );
    println!();
    println!(
        "{}  {}  {}  met  vs reference",
        pad("metric", widths.0),
        pad("value", widths.1),
        pad("target", widths.2)
    );
    println!("{}", "-".repeat(widths.0 + widths.1 + widths.2 + 24));
    for (label, value, target, met, r) in &rows {
        println!(
            "{}  {}  {}  {}  {r}",
            pad(label, widths.0),
            pad(value, widths.1),
            pad(target, widths.2),
            pad(met, 3)
        );
    }
    println!();
    println!("where a step's time goes (concurrency 1, fsync off; mean per step):");
    for (title, rows) in [
        (
            "store (subtracted from the overhead)",
            &over.store_breakdown,
        ),
        (
            "timed loop calls (part of the overhead)",
            &over.loop_breakdown,
        ),
    ] {
        println!("  {title}:");
        for (op, n, us) in rows {
            println!("    {}  {n:>4.1} calls  {us:>8.1} µs", pad(op, 36));
        }
    }
    println!();
    println!(
        "where a function-call step's time goes (fsync off; mean per step; paired text step beside it):"
    );
    for r in &calls.breakdown {
        println!(
            "    {}  {:>4.1} calls  {:>8.1} µs   text step: {:>4.1} calls  {:>8.1} µs{}",
            pad(&r.op, 36),
            r.call_n,
            r.call_us,
            r.text_n,
            r.text_us,
            if r.store {
                "  (store)"
            } else if r.op == NOOP_FN {
                "  (target)"
            } else {
                ""
            }
        );
    }
    println!();
    println!(
        "overhead: concurrency 1, fsync off; step handler time minus time awaiting the store."
    );
    println!("handoff: previous step's enqueue → next step's start, in 9-step turns; includes the queue ack (and its fsync).");
    println!("function call: {NOOP_FN} (in-process no-op) at every step of max_turns {FUNCTION_MAX_TURNS} turns; overhead = p50(call step − target) − p50(text steps run alongside).");
    println!("fsyncs per function step: (fsyncs of a {FUNCTION_MAX_TURNS}-call turn − of a {FUNCTION_SHORT_MAX_TURNS}-call turn) / {}, sends excluded.", FUNCTION_MAX_TURNS - FUNCTION_SHORT_MAX_TURNS);
    println!("router: local Anthropic-format SSE server; server writes an event → parsed frame out of the router, one in flight; baseline: a raw TcpStream.");
    println!("steps/s: one text turn = one step, send included; a new session every {TURNS_PER_SESSION} turns.");
    println!("idle RAM: VmRSS delta (after malloc_trim) over sessions with one completed turn each; includes SQLite page caches.");
    Ok(())
}
