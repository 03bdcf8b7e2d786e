//! The probe: a pass-through bus that times every sampled step and what the step awaits (see
//! the crate docs), and tells the bench when a turn has ended. Outside a sampled phase (the
//! throughput cells) it only counts steps and watches for turns' ends: its books would be
//! charged to the loop it measures.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use async_trait::async_trait;
use harness_bus::{
    Binding, Bus, BusError, BusWrite, CallContext, FunctionDef, Handler, HandlerFuture,
    LocalFuture, LocalHandler, LocalValue, QueueDef, StreamingCall, TriggerTypeDef,
};
use harness_core::{topics, TURN_QUEUE};
use serde_json::Value;
use tokio::sync::oneshot;

use crate::rig::TURN_TIMEOUT;

/// The step function the queue delivers.
const STEP_FN: &str = "harness::turn";

tokio::task_local! {
    /// Set while a step handler runs: where its store time is added up.
    static STEP: Arc<StepAcc>;
}

#[derive(Default)]
pub(crate) struct StepAcc {
    pub(crate) store_ns: AtomicU64,
    pub(crate) store_ops: AtomicU64,
    /// Per operation: (name, count, ns), store operations and timed loop calls alike. A list,
    /// searched: a step names a dozen operations, and hashing each name cost more.
    pub(crate) by_op: Mutex<Vec<(String, u64, u64)>>,
}

impl StepAcc {
    pub(crate) fn add(&self, op: &str, store: bool, ns: u64) {
        if store {
            self.store_ns.fetch_add(ns, Ordering::Relaxed);
            self.store_ops.fetch_add(1, Ordering::Relaxed);
        }
        // Charged to the step it measures: the name is copied only the first time it is seen.
        let mut by_op = lock(&self.by_op);
        match by_op.iter_mut().find(|(name, ..)| name == op) {
            Some((_, n, total)) => {
                *n += 1;
                *total += ns;
            }
            None => by_op.push((op.to_string(), 1, ns)),
        }
    }
}

pub(crate) struct StepSample {
    /// The turn the step belongs to (empty when the payload had none).
    pub(crate) turn_id: String,
    pub(crate) wall_ns: u64,
    pub(crate) store_ns: u64,
    pub(crate) store_ops: u64,
    pub(crate) by_op: HashMap<String, (u64, u64)>,
}

/// How a turn ended, as its `turn-completed` event said.
pub(crate) type Ended = std::result::Result<(), String>;

pub(crate) enum Slot {
    Ended(Ended),
    Waiting(oneshot::Sender<Ended>),
}

#[derive(Default)]
pub(crate) struct Probe {
    /// Record per-step samples (otherwise steps are only counted).
    pub(crate) sample_steps: AtomicBool,
    /// Stamp enqueues and compute handoffs.
    pub(crate) track_handoff: AtomicBool,
    pub(crate) steps: Mutex<Vec<StepSample>>,
    /// `turn_id:step` → when its enqueue returned.
    pub(crate) enqueued: Mutex<HashMap<String, Instant>>,
    /// Handoff samples (ns): into step 0 (from send) and into later steps.
    pub(crate) handoff_send_ns: Mutex<Vec<u64>>,
    pub(crate) handoff_step_ns: Mutex<Vec<u64>>,
    pub(crate) completions: Mutex<HashMap<String, Slot>>,
    /// Steps enqueued on `harness-turn` (counted before the enqueue) and step deliveries
    /// handled: how the bench sees the queue drain on iii, where its depth is not visible.
    pub(crate) steps_enqueued: AtomicU64,
    pub(crate) steps_handled: AtomicU64,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn step_key(payload: &Value) -> Option<(String, u64)> {
    let turn = payload.get("turn_id")?.as_str()?;
    let step = payload.get("step")?.as_u64()?;
    Some((format!("{turn}:{step}"), step))
}

impl Probe {
    pub(crate) fn completed(&self, payload: &Value) {
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

    pub(crate) async fn wait(&self, turn_id: &str) -> Result<()> {
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

    pub(crate) fn enqueued(&self, payload: &Value) {
        if !self.track_handoff.load(Ordering::Relaxed) {
            return;
        }
        if let Some((key, _)) = step_key(payload) {
            lock(&self.enqueued).insert(key, Instant::now());
        }
    }

    pub(crate) fn step_started(&self, payload: &Value, at: Instant) {
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

    pub(crate) fn step_finished(&self, sample: StepSample, skipped: bool) {
        if skipped {
            return;
        }
        if self.sample_steps.load(Ordering::Relaxed) {
            lock(&self.steps).push(sample);
        }
    }
}

/// Awaits an operation; inside a step, records its time (as store time when `store`).
pub(crate) async fn timed<T>(op: &str, store: bool, fut: impl Future<Output = T>) -> T {
    let t = Instant::now();
    let out = fut.await;
    let _ = STEP.try_with(|acc| acc.add(op, store, t.elapsed().as_nanos() as u64));
    out
}

/// An in-process handler whose calls are timed like [`ProbeBus::call`]'s.
pub(crate) struct TimedLocal {
    pub(crate) inner: Arc<dyn LocalHandler>,
    pub(crate) op: Arc<str>,
    pub(crate) store: bool,
}

impl LocalHandler for TimedLocal {
    fn call(&self, payload: LocalValue, ctx: CallContext) -> LocalFuture {
        let fut = self.inner.call(payload, ctx);
        if STEP.try_with(|_| ()).is_err() {
            // Outside a sampled step nothing would be recorded: no wrapper to pay for.
            return fut;
        }
        let (op, store) = (Arc::clone(&self.op), self.store);
        Box::pin(async move { timed(&op, store, fut).await })
    }
}

/// Awaits a store operation; inside a step, charges its time to the step's store time.
pub(crate) async fn store_op<T>(op: &str, fut: impl Future<Output = T>) -> T {
    timed(op, true, fut).await
}

pub(crate) fn is_store_function(function_id: &str) -> bool {
    function_id.starts_with("session::") || function_id.starts_with("state::")
}

/// The operations [`ProbeBus`] charges as store time (by the name it records them under).
pub(crate) fn is_store_op(op: &str) -> bool {
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
pub(crate) fn generic_scope(scope: &str) -> String {
    match session_at(scope) {
        Some(i) => format!("{}<session>", &scope[..i]),
        None => scope.to_string(),
    }
}

/// Where the session id of a scope like `harness_queue:s_<hex>` starts.
fn session_at(scope: &str) -> Option<usize> {
    let i = scope.rfind("s_")?;
    let id = &scope[i + 2..];
    (id.len() >= 8 && id.bytes().all(|b| b.is_ascii_alphanumeric())).then_some(i)
}

/// The breakdown's names of `state_list` calls, built once per scope shape: a step lists its
/// session's queue several times, and what the probe spends is charged to the step it measures.
#[derive(Default)]
pub(crate) struct ListNames {
    /// By the scope's prefix, for scopes that end in a session id.
    per_session: Mutex<HashMap<String, Arc<str>>>,
    /// By the whole scope, for the others.
    whole: Mutex<HashMap<String, Arc<str>>>,
}

impl ListNames {
    fn name(&self, scope: &str) -> Arc<str> {
        let (names, key) = match session_at(scope) {
            Some(i) => (&self.per_session, &scope[..i]),
            None => (&self.whole, scope),
        };
        let mut names = lock(names);
        if let Some(n) = names.get(key) {
            return Arc::clone(n);
        }
        let n: Arc<str> = format!("state_list {}", generic_scope(scope)).into();
        names.insert(key.to_string(), Arc::clone(&n));
        n
    }
}

pub(crate) struct StepHandler {
    inner: Arc<dyn Handler>,
    probe: Arc<Probe>,
}

impl Handler for StepHandler {
    fn call(&self, payload: Value, ctx: CallContext) -> HandlerFuture {
        let inner = self.inner.clone();
        let probe = self.probe.clone();
        Box::pin(async move {
            // The handoff ends as the handler starts; the step's own time starts after the
            // probe's bookkeeping, which is not the loop's.
            probe.step_started(&payload, Instant::now());
            if !probe.sample_steps.load(Ordering::Relaxed) {
                // Only counted: the throughput cells measure the loop, not the probe's books
                // (with no step scope, `timed` records nothing).
                let out = inner.call(payload, ctx).await;
                probe.steps_handled.fetch_add(1, Ordering::SeqCst);
                return out;
            }
            let turn_id = payload
                .get("turn_id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let acc = Arc::new(StepAcc {
                by_op: Mutex::new(Vec::with_capacity(16)),
                ..StepAcc::default()
            });
            let start = Instant::now();
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
                by_op: std::mem::take(&mut *lock(&acc.by_op))
                    .into_iter()
                    .map(|(op, n, ns)| (op, (n, ns)))
                    .collect(),
            };
            probe.step_finished(sample, skipped);
            probe.steps_handled.fetch_add(1, Ordering::SeqCst);
            out
        })
    }
}

/// A pass-through bus that measures (see the module docs).
pub(crate) struct ProbeBus {
    pub(crate) inner: Arc<dyn Bus>,
    pub(crate) probe: Arc<Probe>,
    pub(crate) list_names: ListNames,
}

#[async_trait]
impl Bus for ProbeBus {
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
            op: function_id.into(),
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
        let step = queue == TURN_QUEUE;
        // The payload is kept only while handoffs are stamped.
        let stamp =
            (step && self.probe.track_handoff.load(Ordering::Relaxed)).then(|| payload.clone());
        if step {
            self.probe.steps_enqueued.fetch_add(1, Ordering::SeqCst);
        }
        let out = store_op("enqueue", self.inner.enqueue(queue, function_id, payload)).await;
        if out.is_err() && step {
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
        // The step payloads are kept only while handoffs are stamped.
        let stamping = self.probe.track_handoff.load(Ordering::Relaxed);
        let mut n = 0;
        let mut steps: Vec<Value> = Vec::new();
        for w in &writes {
            if let BusWrite::Enqueue { queue, payload, .. } = w {
                if queue == TURN_QUEUE {
                    n += 1;
                    if stamping {
                        steps.push(payload.clone());
                    }
                }
            }
        }
        let completed: Vec<Value> = writes
            .iter()
            .filter_map(|w| match w {
                BusWrite::Publish { topic, payload, .. } if topic == topics::TURN_COMPLETED => {
                    Some(payload.clone())
                }
                _ => None,
            })
            .collect();
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

    async fn state_get_text(&self, scope: &str, key: &str) -> Result<Option<Arc<str>>, BusError> {
        store_op("state_get", self.inner.state_get_text(scope, key)).await
    }

    async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
        store_op("state_set", self.inner.state_set(scope, key, value)).await
    }

    async fn state_set_text(&self, scope: &str, key: &str, text: String) -> Result<(), BusError> {
        store_op("state_set", self.inner.state_set_text(scope, key, text)).await
    }

    async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
        store_op("state_delete", self.inner.state_delete(scope, key)).await
    }

    async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        store_op(&self.list_names.name(scope), self.inner.state_list(scope)).await
    }
}
