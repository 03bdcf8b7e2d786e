//! A minimal in-test double of an iii engine's worker protocol (a test fixture, never a product
//! mode). Its answers to engine functions, and the frames it sends, are checked against what a
//! real engine answered (`recorded.json`, written by tests/iii_record.rs with the engine's
//! version): an engine function with no recorded shape is refused (`double/unrecorded`), an
//! answer or frame that differs from the engine's is refused or noted (`violations`). With
//! `III_BIN` set, [`Engine::start`] runs that engine binary instead (`real.rs`). What it models:
//!
//! - JSON text frames over a WebSocket, `type` tag: `workerregistered` on accept; from workers
//!   `registerfunction`, `unregisterfunction`, `registertriggertype`, `registertrigger`,
//!   `unregistertrigger`, `triggerregistrationresult`, `invokefunction` (with `invocation_id`:
//!   a result is routed back; without: fire-and-forget), `invocationresult`, `reattach`, `ping`.
//! - Routing: a call of a worker's function is sent to that worker as `invokefunction` with a
//!   fresh invocation id; its object payload gets `_caller_worker_id`. An unknown function fails
//!   with `function_not_found`; the calls in flight to a worker that disconnects fail with
//!   `invocation_stopped`.
//! - Built-ins: `engine::functions::list|info`, `engine::triggers::list`,
//!   `engine::register_trigger` / `engine::unregister_trigger` (durable, not owned by the
//!   caller), `engine::registered-triggers::list`, `engine::workers::register`, `state::get|set|
//!   delete|list` (list answers values without keys; no compare-and-swap),
//!   `iii::durable::publish {topic, data}`.
//! - Trigger types: a worker's `registertriggertype` makes it the provider; every binding of
//!   that type (from any worker or `engine::register_trigger`) is forwarded to it as
//!   `registertrigger`, replayed when the type is registered again, parked while no provider
//!   is connected. A worker's own `registertrigger` bindings are removed when it disconnects.
//! - `durable:subscriber {topic, queue_config}`: each published message is queued per
//!   (topic, function); consumers deliver with `concurrency` (1 for `fifo`), retry a failure
//!   with exponential backoff up to `maxRetries`, then dead-letter it. A job in flight when its
//!   worker dies fails (`invocation_stopped`) and is retried like any failure; nothing returns
//!   it to the queue otherwise. `cron` bindings are accepted and never fire.
//! - Every 5 s, like the engine: the state is flushed (what [`Engine::crash`] keeps; a test can
//!   hold the flush) and a changed registry is announced to `engine::functions-available`
//!   bindings. `crash` also forgets every binding (the engine keeps them in memory) and drops
//!   every connection.
//!
//! - With [`Engine::start_with_queue_worker`], the separately installed queue worker
//!   (`queue_worker.rs`): `queue::define`, its configuration entry, the enqueue action and
//!   grouped-FIFO delivery with in-place retries, in the shapes recorded from the real one.
//!   A delivery broken by [`Engine::crash`] fails like any other and is retried in place (the
//!   real one re-delivers it when `redeliver_on_engine_restart` is set).
//!
//! Not modelled: namespaces, RBAC, observe, channels, the worker-name lease.

#![allow(dead_code)]

pub mod queue_worker;
pub mod real;
pub mod worker;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_tungstenite::tungstenite::Message as Ws;

/// True when the engine listing `listed` holds, under `key`, an entry whose `field` is `value`
/// (`engine::functions::list`: "functions" and "function_id").
pub fn lists(listed: &Value, key: &str, field: &str, value: &str) -> bool {
    listed[key]
        .as_array()
        .into_iter()
        .flatten()
        .any(|e| e[field] == value)
}

/// An error answer: `{code, message}`.
#[derive(Clone, Debug, PartialEq)]
pub struct CallError {
    pub code: String,
    pub message: String,
}

impl CallError {
    fn new(code: &str, message: impl Into<String>) -> CallError {
        CallError {
            code: code.into(),
            message: message.into(),
        }
    }
}

type LocalFn = Arc<dyn Fn(Value) -> Result<Value, CallError> + Send + Sync>;

#[derive(Clone)]
struct Function {
    worker: String,
    def: Value,
}

#[derive(Clone)]
struct TriggerType {
    worker: Option<String>,
    def: Value,
}

#[derive(Clone, Debug)]
struct Trigger {
    id: String,
    trigger_type: String,
    function_id: String,
    config: Value,
    metadata: Value,
    /// The connection that registered it (None: `engine::register_trigger`, durable).
    owner: Option<String>,
}

struct WorkerConn {
    tx: mpsc::UnboundedSender<Ws>,
    name: Option<String>,
}

struct Job {
    data: Value,
    attempts: u32,
    not_before: Instant,
}

/// A topic queue of one subscribing function.
#[derive(Default)]
struct TopicQueue {
    jobs: VecDeque<Job>,
    in_flight: usize,
}

#[derive(Default)]
struct State {
    workers: HashMap<String, WorkerConn>,
    functions: HashMap<String, Function>,
    trigger_types: HashMap<String, TriggerType>,
    triggers: HashMap<String, Trigger>,
    /// Invocations sent to a worker: engine invocation id → (worker, reply).
    pending: HashMap<String, (String, oneshot::Sender<Result<Value, CallError>>)>,
    kv: HashMap<String, HashMap<String, Value>>,
    local: HashMap<String, LocalFn>,
    topics: HashMap<(String, String), TopicQueue>,
    dead_letters: Vec<(String, Value, CallError)>,
    /// Every frame received from workers, in order (for assertions).
    received: Vec<Value>,
    /// `(function_id, action type)` of every invocation a worker sent for a function that
    /// worker itself registered, in order (a call the worker could have made in-process).
    self_invocations: Vec<(String, String)>,
    trigger_results: Vec<Value>,
    /// Engine functions answered without (or against) a recorded shape.
    violations: Vec<String>,
    /// The state as last flushed: what survives `crash`.
    flushed: HashMap<String, HashMap<String, Value>>,
    flush_held: bool,
    /// The queue worker's model, when the double runs with one (`start_with_queue_worker`).
    queue_worker: Option<queue_worker::QueueWorker>,
}

struct Inner {
    state: Mutex<State>,
    changed: Notify,
    ids: AtomicU64,
}

/// The engine double. Cheap to clone; the server stops when the test ends.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
    pub url: String,
    /// Set when the tests run against a real engine (`III_BIN`): every call goes to it.
    real: Option<Arc<Real>>,
}

pub struct Real {
    pub engine: real::RealEngine,
    pub client: tokio::sync::RwLock<real::Client>,
    /// Test-side functions, offered again after an engine restart.
    locals: Mutex<Vec<(String, LocalFn)>>,
}

const BUILTIN_TRIGGER_TYPES: &[&str] = &[
    "cron",
    "durable:subscriber",
    "state",
    "subscribe",
    "engine::functions-available",
    "engine::workers-available",
];

impl Engine {
    /// The real engine named by `III_BIN` if there is one, else the double.
    pub async fn start() -> Engine {
        match real::engine_bin() {
            Some(bin) => {
                let engine = real::RealEngine::start(&bin).await;
                let client = real::Client::connect(&engine.url()).await.expect("connect");
                Engine {
                    inner: Arc::new(Inner {
                        state: Mutex::new(State::default()),
                        changed: Notify::new(),
                        ids: AtomicU64::new(0),
                    }),
                    url: engine.url(),
                    real: Some(Arc::new(Real {
                        engine,
                        client: tokio::sync::RwLock::new(client),
                        locals: Mutex::new(Vec::new()),
                    })),
                }
            }
            None => Engine::start_double().await,
        }
    }

    /// An engine with a queue provider: the real engine as [`Engine::start`] runs it (with the
    /// queue worker next to it when `III_QUEUE_BIN` names one), or the double with its model
    /// of the queue worker.
    pub async fn start_with_queue_worker() -> Engine {
        if real::engine_bin().is_some() {
            return Engine::start().await;
        }
        let e = Engine::start_double().await;
        e.lock().queue_worker = Some(queue_worker::QueueWorker::default());
        let runner = e.clone();
        tokio::spawn(async move { runner.run_queue_worker().await });
        e
    }

    /// The queue worker model's consumer: starts the deliveries `QueueWorker::next` hands out.
    async fn run_queue_worker(&self) {
        loop {
            let notified = self.inner.changed.notified();
            let starts = match self.lock().queue_worker.as_mut() {
                Some(q) => q.next(),
                None => return,
            };
            for (key, job, config) in starts {
                let e = self.clone();
                tokio::spawn(async move { e.deliver_queued(key, job, config).await });
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }

    /// One queued message: delivered, retried in place on failure, then dead-lettered.
    async fn deliver_queued(&self, key: (String, String), job: queue_worker::Job, config: Value) {
        let max_retries = config["max_retries"].as_u64().unwrap_or(3);
        let backoff = config["backoff_ms"].as_u64().unwrap_or(1000);
        let mut attempt = 0u64;
        loop {
            // Held while the target is not registered (a booting or restarting worker).
            while !self.lock().functions.contains_key(&job.function_id) {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            let r = self
                .dispatch(
                    &job.function_id,
                    job.data.clone(),
                    Some(queue_worker::QUEUE_WORKER_ID),
                    None,
                )
                .await;
            if r.is_ok() {
                break;
            }
            if attempt >= max_retries {
                if let Some(q) = self.lock().queue_worker.as_mut() {
                    q.dead_letters.push((key.0.clone(), job.data.clone()));
                }
                break;
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(backoff << (attempt - 1).min(16))).await;
        }
        if let Some(q) = self.lock().queue_worker.as_mut() {
            q.busy.remove(&key);
        }
        self.inner.changed.notify_waiters();
    }

    /// True when `engine::queue::enqueue` is offered (the queue worker runs).
    pub fn has_queue_worker(&self) -> bool {
        match &self.real {
            Some(r) => r.engine.has_queue_worker(),
            None => self.lock().queue_worker.is_some(),
        }
    }

    /// The real queue worker's log (empty on the double).
    pub fn queue_worker_log(&self) -> String {
        self.real
            .as_ref()
            .map(|r| r.engine.queue_log())
            .unwrap_or_default()
    }

    /// True when the tests run against a real engine.
    pub fn is_real(&self) -> bool {
        self.real.is_some()
    }

    /// The double, whatever the environment says (tests of the double itself).
    pub async fn start_double() -> Engine {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind engine");
        let url = format!("ws://{}", listener.local_addr().unwrap());
        let engine = Engine {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                changed: Notify::new(),
                ids: AtomicU64::new(0),
            }),
            url,
            real: None,
        };
        let e = engine.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let _ = tcp.set_nodelay(true);
                let e = e.clone();
                tokio::spawn(async move {
                    if let Ok(ws) = tokio_tungstenite::accept_async(tcp).await {
                        e.serve(ws).await;
                    }
                });
            }
        });
        let e = engine.clone();
        tokio::spawn(async move { e.run_queues().await });
        let e = engine.clone();
        tokio::spawn(async move { e.run_registry().await });
        engine
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh id in UUID form (the SDK parses invocation ids as UUIDs).
    fn fresh_id(&self) -> String {
        let n = self.inner.ids.fetch_add(1, Ordering::SeqCst);
        let salt = std::process::id() as u64;
        format!("{:08x}-0000-4000-8000-{:012x}", salt & 0xffff_ffff, n)
    }

    fn send_frame(&self, worker: &str, frame: Value) -> bool {
        if let Err(why) = message_matches_recorded(&frame) {
            self.lock().violations.push(why);
        }
        let st = self.lock();
        match st.workers.get(worker) {
            Some(w) => w.tx.send(Ws::Text(frame.to_string().into())).is_ok(),
            None => false,
        }
    }

    // --- connections ----------------------------------------------------------------------

    async fn serve(&self, ws: tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>) {
        let (mut sink, mut stream) = ws.split();
        let (tx, mut rx) = mpsc::unbounded_channel::<Ws>();
        let worker_id = self.fresh_id();
        self.lock().workers.insert(
            worker_id.clone(),
            WorkerConn {
                tx: tx.clone(),
                name: None,
            },
        );
        let _ = tx.send(Ws::Text(
            json!({"type": "workerregistered", "worker_id": worker_id, "reattach_token": format!("tok-{worker_id}")})
                .to_string()
                .into(),
        ));
        let writer = tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                let close = matches!(m, Ws::Close(_));
                if sink.send(m).await.is_err() || close {
                    break;
                }
            }
            let _ = sink.close().await;
        });
        while let Some(frame) = stream.next().await {
            let text = match frame {
                Ok(Ws::Text(t)) => t.to_string(),
                Ok(Ws::Binary(b)) => String::from_utf8_lossy(&b).into_owned(),
                Ok(Ws::Close(_)) | Err(_) => break,
                Ok(_) => continue,
            };
            let Ok(msg) = serde_json::from_str::<Value>(&text) else {
                continue;
            };
            if !self.lock().workers.contains_key(&worker_id) {
                break; // dropped by the test
            }
            self.lock().received.push(msg.clone());
            self.on_frame(&worker_id, msg);
        }
        writer.abort();
        self.disconnected(&worker_id);
    }

    fn disconnected(&self, worker_id: &str) {
        let mut unforward = Vec::new();
        {
            let mut st = self.lock();
            st.workers.remove(worker_id);
            st.functions.retain(|_, f| f.worker != worker_id);
            let owned: Vec<String> = st
                .triggers
                .values()
                .filter(|t| t.owner.as_deref() == Some(worker_id))
                .map(|t| t.id.clone())
                .collect();
            for id in owned {
                if let Some(t) = st.triggers.remove(&id) {
                    unforward.push(t);
                }
            }
            // Its trigger types lose their provider; their bindings wait for the next one.
            for tt in st.trigger_types.values_mut() {
                if tt.worker.as_deref() == Some(worker_id) {
                    tt.worker = None;
                }
            }
            let stopped: Vec<String> = st
                .pending
                .iter()
                .filter(|(_, (w, _))| w == worker_id)
                .map(|(id, _)| id.clone())
                .collect();
            for id in stopped {
                if let Some((_, reply)) = st.pending.remove(&id) {
                    let _ = reply.send(Err(CallError::new(
                        "invocation_stopped",
                        "the worker handling the invocation disconnected",
                    )));
                }
            }
        }
        for t in unforward {
            self.forward_unregister(&t);
        }
        self.inner.changed.notify_waiters();
    }

    fn on_frame(&self, worker_id: &str, msg: Value) {
        let kind = msg["type"].as_str().unwrap_or_default().to_string();
        match kind.as_str() {
            "registerfunction" => {
                let id = msg["id"].as_str().unwrap_or_default().to_string();
                // As the engine: a function id is leased to one live worker; another worker's
                // registration of it is refused (that one function, not the connection).
                let owner = self
                    .lock()
                    .functions
                    .get(&id)
                    .map(|f| f.worker.clone())
                    .filter(|w| w != worker_id);
                if let Some(owner) = owner {
                    self.send_frame(
                        worker_id,
                        json!({"type": "registrationrejected", "code": "FUNCTION_NAMESPACE_CONFLICT",
                            "namespace": "default", "function_id": id, "owner_worker_id": owner}),
                    );
                    return;
                }
                self.lock().functions.insert(
                    id,
                    Function {
                        worker: worker_id.to_string(),
                        def: msg,
                    },
                );
                self.inner.changed.notify_waiters();
            }
            "unregisterfunction" => {
                let id = msg["id"].as_str().unwrap_or_default();
                let mut st = self.lock();
                if st.functions.get(id).is_some_and(|f| f.worker == worker_id) {
                    st.functions.remove(id);
                }
            }
            "registertriggertype" => {
                let id = msg["id"].as_str().unwrap_or_default().to_string();
                let replay: Vec<Trigger> = {
                    let mut st = self.lock();
                    st.trigger_types.insert(
                        id.clone(),
                        TriggerType {
                            worker: Some(worker_id.to_string()),
                            def: msg,
                        },
                    );
                    st.triggers
                        .values()
                        .filter(|t| t.trigger_type == id)
                        .cloned()
                        .collect()
                };
                for t in replay {
                    self.forward_register(&t);
                }
                self.inner.changed.notify_waiters();
            }
            "registertrigger" => {
                let t = Trigger {
                    id: msg["id"].as_str().unwrap_or_default().to_string(),
                    trigger_type: msg["trigger_type"].as_str().unwrap_or_default().to_string(),
                    function_id: msg["function_id"].as_str().unwrap_or_default().to_string(),
                    config: msg.get("config").cloned().unwrap_or(Value::Null),
                    metadata: msg.get("metadata").cloned().unwrap_or(Value::Null),
                    owner: Some(worker_id.to_string()),
                };
                self.add_trigger(t);
            }
            "unregistertrigger" => {
                let id = msg["id"].as_str().unwrap_or_default();
                let removed = self.lock().triggers.remove(id);
                if let Some(t) = removed {
                    self.forward_unregister(&t);
                }
            }
            "triggerregistrationresult" => {
                self.lock().trigger_results.push(msg);
            }
            "invokefunction" => {
                let e = self.clone();
                let caller = worker_id.to_string();
                tokio::spawn(async move { e.on_invoke(caller, msg).await });
            }
            "invocationresult" => {
                let id = msg["invocation_id"].as_str().unwrap_or_default();
                let pending = self.lock().pending.remove(id);
                if let Some((_, reply)) = pending {
                    let r = match msg.get("error").filter(|e| !e.is_null()) {
                        Some(err) => Err(CallError::new(
                            err["code"].as_str().unwrap_or("invocation_failed"),
                            err["message"].as_str().unwrap_or_default(),
                        )),
                        None => Ok(msg.get("result").cloned().unwrap_or(Value::Null)),
                    };
                    let _ = reply.send(r);
                }
            }
            "ping" => {
                self.send_frame(worker_id, json!({"type": "pong"}));
            }
            _ => {} // reattach, pong, unknown: ignored
        }
    }

    async fn on_invoke(&self, caller: String, msg: Value) {
        let function_id = msg["function_id"].as_str().unwrap_or_default().to_string();
        let data = msg.get("data").cloned().unwrap_or(Value::Null);
        let metadata = msg.get("metadata").cloned().filter(|m| !m.is_null());
        let action = msg["action"]["type"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if function_id == "engine::workers::register" {
            if let Some(w) = self.lock().workers.get_mut(&caller) {
                w.name = data["name"].as_str().map(str::to_string);
            }
        }
        {
            let mut st = self.lock();
            if st
                .functions
                .get(&function_id)
                .is_some_and(|f| f.worker == caller)
            {
                st.self_invocations
                    .push((function_id.clone(), action.clone()));
            }
        }
        let result = if action == "enqueue" {
            let queue = msg["action"]["queue"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let r = match self.lock().queue_worker.as_mut() {
                Some(q) => q.enqueue(&queue, &function_id, data),
                // No queue provider (as on a default 0.23 engine build).
                None => Err(CallError::new(
                    "enqueue_error",
                    "engine::queue::enqueue not found: no queue worker is connected",
                )),
            };
            self.inner.changed.notify_waiters();
            match matches_recorded("(enqueue action)", &r) {
                Ok(()) => r,
                Err(why) => {
                    self.lock()
                        .violations
                        .push(format!("(enqueue action): {why}"));
                    r
                }
            }
        } else {
            self.dispatch(&function_id, data, Some(&caller), metadata)
                .await
        };
        let Some(invocation_id) = msg["invocation_id"].as_str() else {
            return; // fire-and-forget
        };
        let mut frame = json!({"type": "invocationresult", "invocation_id": invocation_id, "function_id": function_id});
        match result {
            Ok(v) => frame["result"] = v,
            Err(e) => frame["error"] = json!({"code": e.code, "message": e.message}),
        }
        self.send_frame(&caller, frame);
    }

    /// Runs a call: a built-in, a test-side function, or a worker's function (routed).
    async fn dispatch(
        &self,
        function_id: &str,
        data: Value,
        caller: Option<&str>,
        metadata: Option<Value>,
    ) -> Result<Value, CallError> {
        if let Some(r) = self.builtin(function_id, &data) {
            return self.conform(function_id, &data, r);
        }
        if is_engine_function(function_id) {
            // An engine function the double has no recorded shape for: the adapter must not
            // rely on it until it was recorded from a real engine (tests/iii_record.rs).
            let e = CallError::new(
                "double/unrecorded",
                format!("{function_id}: no shape recorded from a real engine (tests/iii_engine/recorded.json)"),
            );
            self.lock()
                .violations
                .push(format!("{function_id}: unrecorded"));
            return Err(e);
        }
        let local = self.lock().local.get(function_id).cloned();
        if let Some(f) = local {
            return f(data);
        }
        let owner = self
            .lock()
            .functions
            .get(function_id)
            .map(|f| f.worker.clone());
        let Some(owner) = owner else {
            return Err(CallError::new(
                "function_not_found",
                format!("Function '{function_id}' not found"),
            ));
        };
        let mut data = data;
        // A worker's call is decorated with its id; the engine's own deliveries (topic jobs,
        // notices) are not.
        if let (Value::Object(map), Some(caller)) = (&mut data, caller) {
            map.insert("_caller_worker_id".into(), json!(caller));
        }
        let invocation_id = self.fresh_id();
        let (tx, rx) = oneshot::channel();
        self.lock()
            .pending
            .insert(invocation_id.clone(), (owner.clone(), tx));
        let mut frame = json!({"type": "invokefunction", "invocation_id": invocation_id, "function_id": function_id, "data": data});
        if let Some(m) = metadata {
            frame["metadata"] = m;
        }
        if !self.send_frame(&owner, frame) {
            self.lock().pending.remove(&invocation_id);
            return Err(CallError::new("invocation_stopped", "the worker is gone"));
        }
        rx.await
            .unwrap_or_else(|_| Err(CallError::new("invocation_stopped", "dropped")))
    }

    fn builtin(&self, function_id: &str, data: &Value) -> Option<Result<Value, CallError>> {
        let bad = |why: &str| Err(CallError::new("deserialization_error", why.to_string()));
        let s = |v: &Value, k: &str| v[k].as_str().map(str::to_string);
        if self.lock().queue_worker.is_some() {
            match function_id {
                "queue::define" => {
                    let r = self.lock().queue_worker.as_mut().unwrap().define(data);
                    return Some(r);
                }
                "configuration::get" if data["id"] == "queue" => {
                    return Some(Ok(self
                        .lock()
                        .queue_worker
                        .as_ref()
                        .unwrap()
                        .configuration()));
                }
                _ => {}
            }
        }
        Some(match function_id {
            // Fire-and-forget: the engine never answers it.
            "engine::workers::register" => Ok(Value::Null),
            "engine::functions::list" => {
                let st = self.lock();
                let prefix = s(data, "prefix").unwrap_or_default();
                let internal = data["include_internal"] == json!(true);
                let mut fns: Vec<Value> = st
                    .functions
                    .iter()
                    .filter(|(id, _)| id.starts_with(&prefix))
                    .filter(|(_, f)| internal || f.def["metadata"]["internal"] != json!(true))
                    .map(|(id, f)| {
                        json!({"function_id": id, "description": f.def["description"], "namespace": "default",
                               "worker_name": st.workers.get(&f.worker).and_then(|w| w.name.clone())})
                    })
                    .collect();
                if st.queue_worker.is_some() {
                    for (id, description) in [
                        (
                            "engine::queue::enqueue",
                            "Internal provider for TriggerAction::Enqueue",
                        ),
                        (
                            "queue::define",
                            "Define and start a durable named function queue",
                        ),
                    ] {
                        if id.starts_with(&prefix) {
                            fns.push(json!({"function_id": id, "description": description,
                                "namespace": "default", "worker_name": "queue"}));
                        }
                    }
                }
                fns.sort_by(|a, b| a["function_id"].as_str().cmp(&b["function_id"].as_str()));
                Ok(json!({ "functions": fns }))
            }
            "engine::functions::info" => {
                let st = self.lock();
                let detail = |id: &str| {
                    st.functions.get(id).map(|f| {
                        // As the engine: the schemas and metadata only when registered.
                        let worker_name = st.workers.get(&f.worker).and_then(|w| w.name.clone()).unwrap_or_default();
                        let mut d = json!({"function_id": id, "namespace": "default", "worker_name": worker_name,
                            "description": f.def["description"], "registered_triggers": []});
                        for (from, to) in [("request_format", "request_schema"), ("response_format", "response_schema"), ("metadata", "metadata")] {
                            if let Some(v) = f.def.get(from).filter(|v| !v.is_null()) {
                                d[to] = v.clone();
                            }
                        }
                        d
                    })
                };
                match (s(data, "function_id"), data["function_ids"].as_array()) {
                    (Some(id), None) => detail(&id).ok_or_else(|| {
                        CallError::new("NOT_FOUND", format!("Function '{id}' not found"))
                    }),
                    (None, Some(ids)) if ids.len() <= 32 => Ok(json!({"functions": ids
                        .iter()
                        .map(|id| {
                            let id = id.as_str().unwrap_or_default();
                            detail(id).unwrap_or_else(|| json!({"function_id": id, "error": "not_found"}))
                        })
                        .collect::<Vec<_>>()})),
                    (None, Some(_)) => {
                        Err(CallError::new("INVALID_INPUT", "function_ids: at most 32"))
                    }
                    _ => Err(CallError::new(
                        "INVALID_INPUT",
                        "exactly one of function_id / function_ids must be set",
                    )),
                }
            }
            "engine::triggers::list" => {
                let st = self.lock();
                let mut types: Vec<Value> = BUILTIN_TRIGGER_TYPES
                    .iter()
                    .map(|t| json!({"id": t, "description": "built-in", "namespace": "default", "worker_name": "engine"}))
                    .collect();
                for (id, t) in &st.trigger_types {
                    let worker = t
                        .worker
                        .as_ref()
                        .and_then(|w| st.workers.get(w))
                        .and_then(|w| w.name.clone());
                    types.push(json!({"id": id, "description": t.def["description"], "namespace": "default",
                        "worker_name": worker.unwrap_or_default()}));
                }
                Ok(json!({ "triggers": types }))
            }
            "engine::register_trigger" => {
                let (Some(tt), Some(f)) = (s(data, "trigger_type"), s(data, "function_id")) else {
                    return Some(bad("missing field `trigger_type` or `function_id`"));
                };
                let t = Trigger {
                    id: self.fresh_id(),
                    trigger_type: tt,
                    function_id: f,
                    config: data.get("config").cloned().unwrap_or(Value::Null),
                    metadata: data.get("metadata").cloned().unwrap_or(Value::Null),
                    owner: None,
                };
                let id = t.id.clone();
                self.add_trigger(t);
                Ok(json!({ "id": id }))
            }
            "engine::unregister_trigger" => {
                let Some(id) = s(data, "id") else {
                    return Some(bad("missing field `id`"));
                };
                let removed = self.lock().triggers.remove(&id);
                if let Some(t) = &removed {
                    self.forward_unregister(t);
                }
                Ok(json!({"removed": removed.is_some()}))
            }
            "engine::registered-triggers::list" => {
                let st = self.lock();
                let tt = s(data, "trigger_type");
                let f = s(data, "function_id");
                let mut rows: Vec<Value> = st
                    .triggers
                    .values()
                    .filter(|t| tt.as_deref().is_none_or(|x| x == t.trigger_type))
                    .filter(|t| f.as_deref().is_none_or(|x| x == t.function_id))
                    .map(|t| json!({"id": t.id, "trigger_type": t.trigger_type, "function_id": t.function_id,
                        "worker_name": "", "config": t.config, "config_summary": t.config.to_string()}))
                    .collect();
                rows.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
                Ok(json!({ "registered_triggers": rows }))
            }
            "state::update" => {
                let (Some(scope), Some(key)) = (s(data, "scope"), s(data, "key")) else {
                    return Some(bad("missing field `scope` or `key`"));
                };
                let Some(ops) = data["ops"].as_array() else {
                    return Some(bad("missing field `ops`"));
                };
                let mut st = self.lock();
                let table = st.kv.entry(scope).or_default();
                let old = table.get(&key).cloned();
                let new = apply_update_ops(old.clone(), ops);
                table.insert(key, new.clone());
                Ok(json!({"old_value": old, "new_value": new}))
            }
            "state::get" | "state::set" | "state::delete" | "state::list" => {
                let Some(scope) = s(data, "scope") else {
                    return Some(bad("missing field `scope`"));
                };
                let mut st = self.lock();
                let table = st.kv.entry(scope).or_default();
                if function_id == "state::list" {
                    return Some(Ok(Value::Array(table.values().cloned().collect())));
                }
                let Some(key) = s(data, "key") else {
                    return Some(bad("missing field `key`"));
                };
                match function_id {
                    "state::get" => Ok(table.get(&key).cloned().unwrap_or(Value::Null)),
                    "state::set" => {
                        let value = data.get("value").cloned().unwrap_or(Value::Null);
                        let old = table.insert(key, value.clone());
                        Ok(json!({"old_value": old, "new_value": value}))
                    }
                    // The engine answers the removed value itself (null when there was none).
                    _ => Ok(table.remove(&key).unwrap_or(Value::Null)),
                }
            }
            // No configuration is stored in the double.
            "configuration::get" => Err(CallError::new(
                "NOT_FOUND",
                format!(
                    "configuration '{}' not found",
                    s(data, "id").unwrap_or_default()
                ),
            )),
            "iii::durable::publish" => {
                let Some(topic) = s(data, "topic") else {
                    return Some(bad("missing field `topic`"));
                };
                let payload = data.get("data").cloned().unwrap_or(Value::Null);
                let mut st = self.lock();
                let subscribers: Vec<String> = st
                    .triggers
                    .values()
                    .filter(|t| {
                        t.trigger_type == "durable:subscriber" && t.config["topic"] == json!(topic)
                    })
                    .map(|t| t.function_id.clone())
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect();
                for f in subscribers {
                    st.topics
                        .entry((topic.clone(), f))
                        .or_default()
                        .jobs
                        .push_back(Job {
                            data: payload.clone(),
                            attempts: 0,
                            not_before: Instant::now(),
                        });
                }
                drop(st);
                self.inner.changed.notify_waiters();
                Ok(Value::Null)
            }
            _ => return None,
        })
    }

    // --- triggers ---------------------------------------------------------------------------

    fn add_trigger(&self, t: Trigger) {
        let forward = {
            let mut st = self.lock();
            st.triggers.insert(t.id.clone(), t.clone());
            st.trigger_types
                .get(&t.trigger_type)
                .is_some_and(|tt| tt.worker.is_some())
        };
        if forward {
            self.forward_register(&t);
        }
        self.inner.changed.notify_waiters();
    }

    fn provider(&self, trigger_type: &str) -> Option<String> {
        self.lock()
            .trigger_types
            .get(trigger_type)
            .and_then(|t| t.worker.clone())
    }

    fn forward_register(&self, t: &Trigger) {
        if let Some(p) = self.provider(&t.trigger_type) {
            let mut frame = json!({"type": "registertrigger", "id": t.id, "trigger_type": t.trigger_type,
                "function_id": t.function_id, "config": t.config});
            if !t.metadata.is_null() {
                frame["metadata"] = t.metadata.clone();
            }
            self.send_frame(&p, frame);
        }
    }

    fn forward_unregister(&self, t: &Trigger) {
        if let Some(p) = self.provider(&t.trigger_type) {
            self.send_frame(
                &p,
                json!({"type": "unregistertrigger", "id": t.id, "trigger_type": t.trigger_type}),
            );
        }
    }

    // --- topic queues ---------------------------------------------------------------------------

    /// Delivers topic jobs to subscribers that have a binding, within their concurrency.
    async fn run_queues(&self) {
        loop {
            let notified = self.inner.changed.notified();
            let mut starts = Vec::new();
            {
                let mut st = self.lock();
                let configs: HashMap<(String, String), Value> = st
                    .triggers
                    .values()
                    .filter(|t| t.trigger_type == "durable:subscriber")
                    .map(|t| {
                        (
                            (
                                t.config["topic"].as_str().unwrap_or_default().to_string(),
                                t.function_id.clone(),
                            ),
                            t.config["queue_config"].clone(),
                        )
                    })
                    .collect();
                let now = Instant::now();
                for (key, q) in st.topics.iter_mut() {
                    let Some(cfg) = configs.get(key) else {
                        continue;
                    };
                    let limit = if cfg["type"] == "fifo" {
                        1
                    } else {
                        cfg["concurrency"].as_u64().unwrap_or(10).max(1) as usize
                    };
                    while q.in_flight < limit {
                        let ready = q.jobs.front().is_some_and(|j| j.not_before <= now);
                        if !ready {
                            break;
                        }
                        let job = q.jobs.pop_front().unwrap();
                        q.in_flight += 1;
                        starts.push((key.clone(), cfg.clone(), job));
                    }
                }
            }
            for (key, cfg, job) in starts {
                let e = self.clone();
                tokio::spawn(async move { e.deliver(key, cfg, job).await });
            }
            // Poll-based like the engine's consumer (100 ms), woken early by a publish.
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }

    async fn deliver(&self, key: (String, String), cfg: Value, mut job: Job) {
        let r = self.dispatch(&key.1, job.data.clone(), None, None).await;
        {
            let mut st = self.lock();
            if let Some(q) = st.topics.get_mut(&key) {
                q.in_flight -= 1;
            }
            if let Err(e) = r {
                job.attempts += 1;
                let max = cfg["maxRetries"].as_u64().unwrap_or(3) as u32;
                if job.attempts > max {
                    st.dead_letters.push((key.0.clone(), job.data, e));
                } else {
                    let base = cfg["backoffDelayMs"].as_u64().unwrap_or(1000);
                    let delay = base.saturating_mul(1 << (job.attempts - 1).min(10));
                    job.not_before = Instant::now() + Duration::from_millis(delay);
                    let q = st.topics.entry(key).or_default();
                    if cfg["type"] == "fifo" {
                        q.jobs.push_front(job);
                    } else {
                        q.jobs.push_back(job);
                    }
                }
            }
        }
        self.inner.changed.notify_waiters();
    }

    // --- the test's side ----------------------------------------------------------------------

    /// Calls a function as a client of the engine would (payload decorated like any routed one).
    pub async fn call(&self, function_id: &str, payload: Value) -> Result<Value, CallError> {
        if let Some(r) = &self.real {
            let client = r.client.read().await.clone();
            return client.call(function_id, payload).await;
        }
        let d = self.dispatch(function_id, payload, Some("test-client"), None);
        match tokio::time::timeout(Duration::from_secs(60), d).await {
            Ok(r) => r,
            Err(_) => Err(CallError::new(
                "timeout",
                format!("{function_id}: no answer in 60 s"),
            )),
        }
    }

    pub async fn ok(&self, function_id: &str, payload: Value) -> Value {
        match self.call(function_id, payload.clone()).await {
            Ok(v) => v,
            Err(e) => panic!("{function_id} {payload} failed: {}: {}", e.code, e.message),
        }
    }

    /// A test-side function (a hook, a target) the engine answers itself.
    pub fn register_local(
        &self,
        function_id: &str,
        f: impl Fn(Value) -> Result<Value, CallError> + Send + Sync + 'static,
    ) {
        if let Some(r) = &self.real {
            let f: LocalFn = Arc::new(f);
            r.locals
                .lock()
                .unwrap()
                .push((function_id.to_string(), f.clone()));
            r.client
                .try_read()
                .expect("client")
                .register(function_id, move |v| f(v));
            return;
        }
        self.lock()
            .local
            .insert(function_id.to_string(), Arc::new(f));
    }

    /// Waits until a function is registered by a worker.
    pub async fn wait_function(&self, function_id: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        if self.real.is_some() {
            loop {
                let listed = self
                    .call("engine::functions::list", json!({"include_internal": true}))
                    .await
                    .unwrap_or(Value::Null);
                if lists(&listed, "functions", "function_id", function_id) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "{function_id} was not registered within {timeout:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        loop {
            let notified = self.inner.changed.notified();
            if self.lock().functions.contains_key(function_id) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{function_id} was not registered within {timeout:?}"
            );
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }

    /// The `registerfunction` frames the engine holds, by id.
    pub fn functions(&self) -> HashMap<String, Value> {
        self.lock()
            .functions
            .iter()
            .map(|(k, f)| (k.clone(), f.def.clone()))
            .collect()
    }

    /// The `registertriggertype` frames the engine holds, by id.
    pub fn trigger_types(&self) -> HashMap<String, Value> {
        self.lock()
            .trigger_types
            .iter()
            .map(|(k, t)| (k.clone(), t.def.clone()))
            .collect()
    }

    /// Closes every connection of workers with this name (as a network failure would).
    pub fn drop_workers(&self, name: &str) -> usize {
        let ids: Vec<String> = {
            let st = self.lock();
            st.workers
                .iter()
                .filter(|(_, w)| w.name.as_deref() == Some(name))
                .map(|(id, _)| id.clone())
                .collect()
        };
        for id in &ids {
            let tx = self.lock().workers.get(id).map(|w| w.tx.clone());
            if let Some(tx) = tx {
                let _ = tx.send(Ws::Close(None));
            }
            self.disconnected(id);
        }
        ids.len()
    }

    /// The engine dies (SIGKILL) and comes back on its stores: the state written since its
    /// last flush is gone, and so is every binding made through `engine::register_trigger`
    /// (kept in memory only); every worker's link drops and reconnects. The double keeps what
    /// it last flushed (`flush`, every 5 s, like the engine's file store).
    pub async fn crash(&self) {
        if let Some(r) = &self.real {
            r.engine.restart().await;
            let client = real::Client::connect(&r.engine.url())
                .await
                .expect("reconnect");
            for (id, f) in r.locals.lock().unwrap().iter() {
                let f = f.clone();
                client.register(id, move |v| f(v));
            }
            *r.client.write().await = client;
            return;
        }
        let ids: Vec<String> = {
            let mut st = self.lock();
            st.kv = st.flushed.clone();
            st.triggers.clear();
            st.workers.keys().cloned().collect()
        };
        for id in &ids {
            let tx = self.lock().workers.get(id).map(|w| w.tx.clone());
            if let Some(tx) = tx {
                let _ = tx.send(Ws::Close(None));
            }
            self.disconnected(id);
        }
    }

    /// Makes the state durable now (the double's file-store flush).
    pub fn flush(&self) {
        let mut st = self.lock();
        st.flushed = st.kv.clone();
    }

    /// Stops the periodic flush, so a test controls what a crash keeps.
    pub fn hold_flush(&self) {
        self.lock().flush_held = true;
    }

    /// Every 5 s, as the engine: flushes the state, and announces a changed function registry
    /// to the bindings of `engine::functions-available` (`{event, functions}`).
    async fn run_registry(&self) {
        let mut last: Option<Vec<String>> = None;
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let (ids, notice, targets) = {
                let mut st = self.lock();
                if !st.flush_held {
                    st.flushed = st.kv.clone();
                }
                let mut ids: Vec<String> = st.functions.keys().cloned().collect();
                ids.sort();
                let functions: Vec<Value> = ids
                    .iter()
                    .map(|id| {
                        let f = &st.functions[id];
                        json!({"function_id": id, "namespace": "default", "description": f.def["description"],
                            "metadata": f.def.get("metadata").cloned().unwrap_or(Value::Null),
                            "worker_name": st.workers.get(&f.worker).and_then(|w| w.name.clone())})
                    })
                    .collect();
                let targets: Vec<String> = st
                    .triggers
                    .values()
                    .filter(|t| t.trigger_type == "engine::functions-available")
                    .map(|t| t.function_id.clone())
                    .collect();
                (
                    ids,
                    json!({"event": "functions_changed", "functions": functions}),
                    targets,
                )
            };
            if last.as_ref() == Some(&ids) {
                continue;
            }
            let first = last.is_none();
            last = Some(ids);
            if first {
                continue;
            }
            for f in targets {
                let e = self.clone();
                let notice = notice.clone();
                tokio::spawn(async move {
                    let _ = e.dispatch(&f, notice, None, None).await;
                });
            }
        }
    }

    pub fn connected_workers(&self, name: &str) -> usize {
        self.lock()
            .workers
            .values()
            .filter(|w| w.name.as_deref() == Some(name))
            .count()
    }

    /// Waits for the provider's `triggerregistrationresult` of binding `id`; returns it.
    pub async fn wait_trigger_result(&self, id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        if self.real.is_some() {
            // The provider's answer is not visible to a client of a real engine; the binding
            // being listed is.
            loop {
                let listed = self
                    .call(
                        "engine::registered-triggers::list",
                        json!({"include_internal": true}),
                    )
                    .await
                    .unwrap_or(Value::Null);
                if lists(&listed, "registered_triggers", "id", id) {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    return json!({"id": id, "error": null});
                }
                assert!(Instant::now() < deadline, "binding {id} not listed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        loop {
            let notified = self.inner.changed.notified();
            let found = self
                .lock()
                .trigger_results
                .iter()
                .rev()
                .find(|r| r["id"] == json!(id))
                .cloned();
            if let Some(r) = found {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "no triggerregistrationresult for {id} within {timeout:?}"
            );
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }

    pub fn received(&self) -> Vec<Value> {
        self.lock().received.clone()
    }

    /// `(function_id, action type)` of the invocations workers sent for their own functions,
    /// in order (action `""` for a plain call). Only the double sees them.
    pub fn self_invocations(&self) -> Vec<(String, String)> {
        self.lock().self_invocations.clone()
    }

    pub fn dead_letters(&self) -> usize {
        self.lock().dead_letters.len()
    }

    /// A state value as stored.
    pub async fn state(&self, scope: &str, key: &str) -> Option<Value> {
        if self.real.is_some() {
            let v = self
                .call("state::get", json!({"scope": scope, "key": key}))
                .await
                .expect("state::get");
            return (!v.is_null()).then_some(v);
        }
        self.lock().kv.get(scope).and_then(|t| t.get(key)).cloned()
    }

    /// Overwrites (or removes) a state value, as a lost write would leave it.
    pub async fn set_state(&self, scope: &str, key: &str, value: Option<Value>) {
        if self.real.is_some() {
            let r = match value {
                Some(v) => {
                    self.call(
                        "state::set",
                        json!({"scope": scope, "key": key, "value": v}),
                    )
                    .await
                }
                None => {
                    self.call("state::delete", json!({"scope": scope, "key": key}))
                        .await
                }
            };
            r.expect("state write");
            return;
        }
        let mut st = self.lock();
        let t = st.kv.entry(scope.to_string()).or_default();
        match value {
            Some(v) => {
                t.insert(key.to_string(), v);
            }
            None => {
                t.remove(key);
            }
        }
    }

    pub fn next_seq(&self) -> u64 {
        self.inner.ids.fetch_add(1, Ordering::SeqCst)
    }
}

// --- recorded shapes --------------------------------------------------------------------------

/// What a real engine answered (tests/iii_record.rs wrote it): the double's answers to engine
/// functions must have exactly these shapes.
pub fn recorded() -> &'static Value {
    static RECORDED: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    RECORDED.get_or_init(|| {
        serde_json::from_str(include_str!("recorded.json")).expect("recorded.json is JSON")
    })
}

/// The engine's `state::update` for the ops the adapter sends (`set`, `increment`, `remove`
/// at a top-level field, or `set` of the whole value with an empty path), applied in order to
/// the value or `{}` (as the engine's kv store: all under one lock, so the update is atomic).
fn apply_update_ops(old: Option<Value>, ops: &[Value]) -> Value {
    let mut current = old.unwrap_or_else(|| json!({}));
    for op in ops {
        let path = op["path"].as_str().unwrap_or_default().to_string();
        match (
            op["type"].as_str().unwrap_or_default(),
            current.as_object_mut(),
        ) {
            ("set", _) if path.is_empty() => current = op["value"].clone(),
            ("set", Some(map)) => {
                map.insert(path, op["value"].clone());
            }
            ("increment", Some(map)) => {
                let by = op["by"].as_i64().unwrap_or(0);
                let now = map.get(&path).and_then(Value::as_i64).unwrap_or(0);
                map.insert(path, json!(now + by));
            }
            ("remove", Some(map)) => {
                map.remove(&path);
            }
            _ => {}
        }
    }
    current
}

/// Functions the engine itself provides (the double answers them, never a worker).
pub fn is_engine_function(function_id: &str) -> bool {
    ["engine::", "state::", "iii::", "configuration::"]
        .iter()
        .any(|p| function_id.starts_with(p))
}

/// Keys whose values are the caller's data (or schemas), not the engine's structure.
const DATA_KEYS: &[&str] = &[
    "value",
    "old_value",
    "new_value",
    "config",
    "metadata",
    "data",
    "request_schema",
    "response_schema",
    "request_format",
    "response_format",
    "trigger_request_format",
    "description",
    "config_summary",
    "worker_name",
];

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Differences between an answer of the double and one recorded from the engine: the same
/// keys with the same kinds of values, recursively (array items against the recorded first
/// item); the caller's own data is compared by kind only.
pub fn shape_diff(at: &str, ours: &Value, theirs: &Value, out: &mut Vec<String>) {
    if kind(ours) != kind(theirs) {
        out.push(format!(
            "{at}: {} where the engine has {}",
            kind(ours),
            kind(theirs)
        ));
        return;
    }
    match (ours, theirs) {
        (Value::Object(a), Value::Object(b)) => {
            for k in a.keys().filter(|k| !b.contains_key(*k)) {
                out.push(format!("{at}.{k}: not in the engine's answer"));
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{at}.{k}: missing"));
            }
            for (k, v) in a {
                if let Some(w) = b.get(k) {
                    if DATA_KEYS.contains(&k.as_str()) {
                        continue;
                    }
                    shape_diff(&format!("{at}.{k}"), v, w, out);
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if !b.is_empty() => {
            // Items may differ among themselves (a found and a missing function): each of ours
            // must match one of the engine's.
            for (i, v) in a.iter().enumerate() {
                let mut closest: Option<Vec<String>> = None;
                for w in b {
                    let mut d = Vec::new();
                    shape_diff(&format!("{at}[{i}]"), v, w, &mut d);
                    if closest.as_ref().is_none_or(|c| d.len() < c.len()) {
                        closest = Some(d);
                    }
                }
                out.extend(closest.unwrap_or_default());
            }
        }
        _ => {}
    }
}

/// Whether an answer of the double matches one of the engine's recorded answers of that
/// function (`Err` when it matches none, with the closest differences).
pub fn matches_recorded(
    function_id: &str,
    answer: &Result<Value, CallError>,
) -> Result<(), String> {
    let Some(examples) = recorded()["functions"][function_id].as_array() else {
        return Err("unrecorded".into());
    };
    let mut best: Option<Vec<String>> = None;
    for ex in examples {
        let mut diff = Vec::new();
        match (answer, ex.get("response"), ex.get("error")) {
            (Ok(v), Some(r), _) => {
                // The caller's data answered as is (state::get): by kind only.
                if function_id == "state::get" && !r.is_null() {
                    if kind(v) != "null" && kind(v) != kind(r) {
                        diff.push(format!("{} where the engine has {}", kind(v), kind(r)));
                    }
                } else if function_id == "state::list" || function_id == "state::delete" {
                    // Stored values, as the caller wrote them: an array of them, or one (null
                    // when there was none).
                    let item = |x: &Value| x.as_array().and_then(|a| a.first()).map(kind);
                    let ok = match function_id {
                        "state::list" => {
                            kind(v) == "array"
                                && v.as_array()
                                    .unwrap()
                                    .iter()
                                    .all(|x| Some(kind(x)) == item(r))
                        }
                        _ => v.is_null() || kind(v) == kind(r) || r.is_null(),
                    };
                    if !ok {
                        diff.push(format!("{} where the engine has {}", kind(v), kind(r)));
                    }
                } else {
                    shape_diff("", v, r, &mut diff);
                }
            }
            (Err(e), _, Some(err)) => {
                if err["code"] != json!(e.code) {
                    diff.push(format!(
                        "error code {} where the engine has {}",
                        e.code, err["code"]
                    ));
                }
            }
            _ => diff.push("answer kind (result/error) differs".into()),
        }
        if diff.is_empty() {
            return Ok(());
        }
        if best.as_ref().is_none_or(|b| diff.len() < b.len()) {
            best = Some(diff);
        }
    }
    // An error with no recorded error of this function: the code cannot be checked.
    if answer.is_err() && !examples.iter().any(|e| e.get("error").is_some()) {
        return Ok(());
    }
    Err(best.unwrap_or_default().join("; "))
}

/// Whether a frame the double sends has the keys the engine's frame of that type has (the
/// recorded example's, plus the optional sidecars of the protocol: `metadata`, `traceparent`,
/// `baggage`, and `error` for `result`).
pub fn message_matches_recorded(frame: &Value) -> Result<(), String> {
    let kind = frame["type"].as_str().unwrap_or_default();
    let examples: Vec<&Value> = recorded()["messages"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| k.as_str() == kind || v["type"] == json!(kind))
        .map(|(_, v)| v)
        .collect();
    if examples.is_empty() {
        return match kind {
            "pong" => Ok(()),
            _ => Err(format!("message {kind}: unrecorded")),
        };
    }
    let known: std::collections::BTreeSet<&str> = examples
        .iter()
        .filter_map(|e| e.as_object())
        .flat_map(|o| o.keys().map(String::as_str))
        .chain(["metadata", "traceparent", "baggage", "error", "result"])
        .collect();
    let extra: Vec<&String> = frame
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .filter(|k| !known.contains(k.as_str()))
        .collect();
    if extra.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "message {kind}: keys {extra:?} are not in the engine's"
        ))
    }
}

impl Engine {
    /// Passes a built-in's answer only if it has a recorded engine shape.
    fn conform(
        &self,
        function_id: &str,
        _request: &Value,
        answer: Result<Value, CallError>,
    ) -> Result<Value, CallError> {
        if !is_engine_function(function_id) && !function_id.starts_with("queue::") {
            return answer;
        }
        match matches_recorded(function_id, &answer) {
            Ok(()) => answer,
            Err(why) => {
                self.lock().violations.push(format!("{function_id}: {why}"));
                Err(CallError::new(
                    "double/unrecorded",
                    format!(
                        "{function_id}: the double's answer has no recorded engine shape: {why}"
                    ),
                ))
            }
        }
    }

    /// Engine functions the double was asked for without a recorded shape, or answered
    /// differently from the engine.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }
}
