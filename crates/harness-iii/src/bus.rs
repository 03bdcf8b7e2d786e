//! [`IiiBus`]: the Bus over one `iii-sdk` worker connection.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use harness_bus::{
    Binding, Bus, BusError, CallContext, FrameSink, FunctionDef, Handler, QueueDef, StreamingCall,
    TriggerTypeDef,
};
use iii_sdk::protocol::{RegisterTriggerInput, TriggerRequest};
use iii_sdk::runtime::{IIIConnectionState, WorkerMetadata};
use iii_sdk::trigger::{TriggerConfig, TriggerHandler};
use iii_sdk::{IIIClient, InitOptions, RegisterFunction, RegisterTriggerType, TriggerAction};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Mutex as AsyncMutex};

use crate::codec::{strip_decoration, unwrap_state, wrap_state};
use crate::error::{from_sdk, to_sdk, IiiError};

/// The internal function every queued call is delivered to (see the crate docs).
pub const DELIVER_FUNCTION: &str = "harness::queue::deliver";
/// Prefix of the per-process frame sink function (`harness::frames::<instance>`).
pub const FRAMES_PREFIX: &str = "harness::frames::";
/// The metadata key naming the frame sink of a streaming call.
const STREAM_KEY: &str = "harness_stream";
/// State scope of the dedupe rows of published events.
const PUBLISHED_SCOPE: &str = "harness_published";

const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);
const FRAME_BATCH: usize = 256;

/// How the `harness-turn` queue is realised on the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMode {
    /// `engine::queue::enqueue` when a queue provider is registered, else a standard topic.
    Auto,
    /// `TriggerAction::Enqueue` (the queue must be declared in the queue worker's config as
    /// `fifo` with `message_group_field` set to the queue's group field).
    Enqueue,
    /// Topic queue, `standard` subscriber with the queue's concurrency (groups serialised here).
    Topic,
    /// Topic queue, `fifo` subscriber: one global line (prefetch 1).
    TopicFifo,
}

/// Where and how to connect.
#[derive(Clone, Debug)]
pub struct IiiOptions {
    pub url: String,
    /// The worker name the engine leases to one live connection per namespace.
    pub worker_name: String,
    /// How long to wait for the engine to accept the worker, and for its own registrations to
    /// become visible before the queue is bound.
    pub connect_timeout: Duration,
    pub queue_mode: QueueMode,
}

impl IiiOptions {
    pub fn new(url: impl Into<String>) -> IiiOptions {
        IiiOptions {
            url: url.into(),
            worker_name: "harness".into(),
            connect_timeout: Duration::from_secs(30),
            queue_mode: QueueMode::Auto,
        }
    }
}

struct Local {
    def: FunctionDef,
    handler: Arc<dyn Handler>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Enqueue,
    Topic,
}

struct QueueRoute {
    route: Route,
    group_field: String,
    visibility: Duration,
}

struct Inner {
    client: IIIClient,
    opts: IiiOptions,
    /// The runtime the handlers run on (the SDK's connection thread only relays).
    rt: tokio::runtime::Handle,
    local: RwLock<HashMap<String, Arc<Local>>>,
    trigger_types: RwLock<HashMap<String, TriggerTypeDef>>,
    /// Bindings of harness-owned trigger types, as forwarded by the engine.
    bindings: RwLock<HashMap<String, Binding>>,
    /// Caller side of streaming calls: stream id → the channel of its frames.
    streams: Mutex<HashMap<String, FrameSink>>,
    frames_fn: String,
    queues: RwLock<HashMap<String, QueueRoute>>,
    groups: Mutex<HashMap<String, Weak<AsyncMutex<()>>>>,
    reconnects: watch::Sender<u64>,
    /// Counts lost links: a call in flight when the link drops never gets its answer (the SDK
    /// keeps waiting until its timeout), so it fails at once instead.
    disconnects: watch::Sender<u64>,
    /// State written since the last barrier, `(scope, key)` → (sequence, value as stored), so
    /// the barrier can read it back.
    written: Mutex<HashMap<(String, String), (u64, Value)>>,
    write_seq: std::sync::atomic::AtomicU64,
    /// State writes sent to the engine whose answer is not back yet, per `(scope, key)`: the
    /// engine may already hold such a value while `written` does not know it yet, so a barrier
    /// reading that key back must not call the difference a loss.
    writing: Mutex<HashMap<(String, String), usize>>,
    /// While barriers run: the writes recorded after their snapshots were taken. Another task's
    /// barrier may drain a newer write of a key from `written` before this one reads the key
    /// back; this log still tells the newer write from a loss.
    recent: Mutex<Recent>,
}

#[derive(Default)]
struct Recent {
    /// Per running barrier: the lowest sequence in its snapshot.
    floors: Vec<u64>,
    /// `(sequence, (scope, key))` of writes recorded while a barrier ran.
    log: Vec<(u64, (String, String))>,
}

/// The Bus over an iii engine. Cheap to clone.
#[derive(Clone)]
pub struct IiiBus {
    inner: Arc<Inner>,
}

impl IiiBus {
    /// Connects a worker to the engine and waits until the engine accepted it. Must be called
    /// inside a tokio runtime: handlers run on it.
    pub async fn connect(opts: IiiOptions) -> Result<IiiBus, IiiError> {
        let metadata = WorkerMetadata {
            name: opts.worker_name.clone(),
            description: Some("harness: the durable agent turn loop (harness::*)".into()),
            ..WorkerMetadata::default()
        };
        let client = iii_sdk::register_worker(
            &opts.url,
            InitOptions {
                metadata: Some(metadata),
                ..InitOptions::default()
            },
        );
        if let Err(e) = client.wait_until_registered(opts.connect_timeout).await {
            client.shutdown_async().await;
            return Err(IiiError::Connect {
                url: opts.url.clone(),
                why: e.to_string(),
            });
        }
        let (reconnects, _) = watch::channel(0);
        let (disconnects, _) = watch::channel(0);
        let bus = IiiBus {
            inner: Arc::new(Inner {
                client,
                rt: tokio::runtime::Handle::current(),
                local: RwLock::new(HashMap::new()),
                trigger_types: RwLock::new(HashMap::new()),
                bindings: RwLock::new(HashMap::new()),
                streams: Mutex::new(HashMap::new()),
                frames_fn: format!("{FRAMES_PREFIX}{}", uuid::Uuid::new_v4().simple()),
                queues: RwLock::new(HashMap::new()),
                groups: Mutex::new(HashMap::new()),
                reconnects,
                disconnects,
                written: Mutex::new(HashMap::new()),
                write_seq: std::sync::atomic::AtomicU64::new(0),
                writing: Mutex::new(HashMap::new()),
                recent: Mutex::new(Recent::default()),
                opts,
            }),
        };
        bus.register_frames_sink();
        bus.register_deliver();
        bus.watch_connection();
        Ok(bus)
    }

    /// The engine URL this bus is connected to.
    pub fn url(&self) -> &str {
        &self.inner.opts.url
    }

    /// Counts the reconnects of the worker connection. After one, the engine has failed the
    /// invocations that were in flight (`invocation_stopped`); the caller should redrive
    /// (`Harness::start` is idempotent and re-enqueues the current step of running turns).
    pub fn reconnects(&self) -> watch::Receiver<u64> {
        self.inner.reconnects.subscribe()
    }

    /// Closes the worker connection (registrations vanish from the engine).
    pub async fn shutdown(&self) {
        self.inner.client.shutdown_async().await;
    }

    /// Ids of the functions registered through this bus, sorted.
    pub fn local_function_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .inner
            .local
            .read()
            .expect("local lock")
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    fn watch_connection(&self) {
        let weak = Arc::downgrade(&self.inner);
        self.inner.rt.spawn(async move {
            let mut was_connected = true;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Some(inner) = weak.upgrade() else { return };
                let connected =
                    inner.client.get_connection_state() == IIIConnectionState::Connected;
                if connected && !was_connected {
                    tracing::warn!(url = %inner.opts.url, "reconnected to the iii engine; registrations were replayed");
                    inner.reconnects.send_modify(|n| *n += 1);
                }
                if !connected && was_connected {
                    tracing::warn!(url = %inner.opts.url, "lost the link to the iii engine; failing the calls in flight");
                    inner.disconnects.send_modify(|n| *n += 1);
                }
                was_connected = connected;
            }
        });
    }

    // --- calls ------------------------------------------------------------------------------

    async fn invoke(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Option<Value>,
        action: Option<TriggerAction>,
    ) -> Result<Value, BusError> {
        let timeout = timeout.unwrap_or(DEFAULT_CALL_TIMEOUT);
        let ms = timeout.as_millis() as u64;
        let req = TriggerRequest {
            function_id: function_id.to_string(),
            payload,
            action,
            timeout_ms: Some(ms),
        };
        let mut lost = self.inner.disconnects.subscribe();
        lost.borrow_and_update();
        let call = async {
            match metadata {
                Some(m) => self.inner.client.trigger(req.metadata(m)).await,
                None => self.inner.client.trigger(req).await,
            }
        };
        tokio::select! {
            result = call => result.map_err(|e| from_sdk(function_id, ms, e)),
            // The answer is lost with the link: the outcome is unknown, as after a timeout (which
            // the loop treats as transient).
            _ = lost.changed() => Err(BusError::new(
                "timeout",
                format!("{function_id}: the link to the iii engine dropped during the call; its outcome is unknown"),
            )),
        }
    }

    /// Runs a function registered here, in-process, on the bus's runtime (a panic fails the
    /// call, not the caller).
    async fn run_local(
        inner: &Arc<Inner>,
        function_id: &str,
        payload: Value,
        ctx: CallContext,
    ) -> Result<Value, BusError> {
        let local = inner
            .local
            .read()
            .expect("local lock")
            .get(function_id)
            .cloned()
            .ok_or_else(|| BusError::function_not_found(function_id))?;
        let fut = local.handler.call(payload, ctx);
        match inner.rt.spawn(fut).await {
            Ok(r) => r,
            Err(_) => Err(BusError::internal(format!(
                "{function_id} panicked while handling the call"
            ))),
        }
    }

    // --- streaming frames -------------------------------------------------------------------

    /// The caller's end: frames of every streaming call this process made arrive here.
    fn register_frames_sink(&self) {
        let weak = Arc::downgrade(&self.inner);
        let def = FunctionDef::new(
            self.inner.frames_fn.clone(),
            "Internal: receives the streamed frames of this harness worker's streaming calls ({stream_id, seq, frames}).",
        )
        .internal();
        let handler = move |payload: Value, _ctx: CallContext| {
            let weak = weak.clone();
            async move {
                let Some(inner) = weak.upgrade() else {
                    return Ok(json!({"accepted": false}));
                };
                let stream_id = payload["stream_id"].as_str().unwrap_or_default();
                let sink = inner
                    .streams
                    .lock()
                    .expect("streams lock")
                    .get(stream_id)
                    .cloned();
                let Some(sink) = sink else {
                    return Ok(json!({"accepted": false}));
                };
                for frame in payload["frames"].as_array().cloned().unwrap_or_default() {
                    let _ = sink.send(frame);
                }
                Ok(json!({"accepted": true}))
            }
        };
        self.register_function(def, Arc::new(handler));
    }

    /// The callee's end: a sink whose frames are sent, in order, to the caller's frame function.
    /// Returns the sink and the task that drains it (awaited before the call answers).
    fn frame_forwarder(
        inner: &Arc<Inner>,
        target: String,
        stream_id: String,
    ) -> (FrameSink, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Value>();
        let client = inner.client.clone();
        let task = inner.rt.spawn(async move {
            let mut seq: u64 = 0;
            let mut alive = true;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < FRAME_BATCH {
                    match rx.try_recv() {
                        Ok(f) => batch.push(f),
                        Err(_) => break,
                    }
                }
                if !alive {
                    continue;
                }
                let req = TriggerRequest {
                    function_id: target.clone(),
                    payload: json!({"stream_id": stream_id, "seq": seq, "frames": batch}),
                    action: None,
                    timeout_ms: Some(30_000),
                };
                match client.trigger(req).await {
                    Ok(v) if v["accepted"] == json!(false) => alive = false,
                    Ok(_) => seq += 1,
                    Err(e) => {
                        tracing::warn!(%target, "frame sink unreachable, dropping the rest of the stream: {e}");
                        alive = false;
                    }
                }
            }
        });
        (tx, task)
    }

    // --- queues -----------------------------------------------------------------------------

    fn group_lock(&self, key: &str) -> Arc<AsyncMutex<()>> {
        let mut groups = self.inner.groups.lock().expect("groups lock");
        if let Some(l) = groups.get(key).and_then(Weak::upgrade) {
            return l;
        }
        let l = Arc::new(AsyncMutex::new(()));
        groups.insert(key.to_string(), Arc::downgrade(&l));
        if groups.len() > 1024 && groups.len().is_power_of_two() {
            groups.retain(|_, w| w.strong_count() > 0);
        }
        l
    }

    /// `harness::queue::deliver`: runs one queued call under its group's lock.
    fn register_deliver(&self) {
        let me = Arc::downgrade(&self.inner);
        let def = FunctionDef::new(
            DELIVER_FUNCTION,
            "Internal: delivery target of the harness queues ({queue, function_id, payload}); runs the call under its group's lock.",
        )
        .internal();
        let handler = move |envelope: Value, _ctx: CallContext| {
            let me = me.clone();
            async move {
                let inner = me.upgrade().ok_or_else(|| {
                    BusError::new("not_connected", "the harness bus is shutting down")
                })?;
                let bus = IiiBus { inner };
                bus.deliver(envelope).await
            }
        };
        self.register_function(def, Arc::new(handler));
    }

    async fn deliver(&self, envelope: Value) -> Result<Value, BusError> {
        let queue = envelope["queue"].as_str().unwrap_or_default().to_string();
        let function_id = envelope["function_id"]
            .as_str()
            .ok_or_else(|| BusError::new("harness/invalid_request", "function_id: required"))?
            .to_string();
        let payload = envelope.get("payload").cloned().unwrap_or(Value::Null);
        let (group_field, visibility) = {
            let queues = self.inner.queues.read().expect("queues lock");
            match queues.get(&queue) {
                Some(q) => (q.group_field.clone(), q.visibility),
                None => (String::new(), DEFAULT_CALL_TIMEOUT),
            }
        };
        let group = match payload.get(&group_field) {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        let lock = self.group_lock(&format!("{queue}\u{0}{group}"));
        let _held = lock.lock().await;
        let is_local = self
            .inner
            .local
            .read()
            .expect("local lock")
            .contains_key(&function_id);
        let run = async {
            if is_local {
                Self::run_local(&self.inner, &function_id, payload, CallContext::default()).await
            } else {
                self.invoke(&function_id, payload, Some(visibility), None, None)
                    .await
            }
        };
        match tokio::time::timeout(visibility, run).await {
            Ok(r) => r.map(|_| json!({"ok": true})),
            Err(_) => Err(BusError::timeout(
                &function_id,
                visibility.as_millis() as u64,
            )),
        }
    }

    /// Waits until every function registered here is listed by the engine (registration is
    /// fire-and-forget: a call racing it gets `function_not_found`).
    async fn wait_registered(&self) -> Result<(), BusError> {
        let deadline = tokio::time::Instant::now() + self.inner.opts.connect_timeout;
        loop {
            let listed = self
                .invoke(
                    "engine::functions::list",
                    json!({}),
                    Some(Duration::from_secs(10)),
                    None,
                    None,
                )
                .await?;
            let present: std::collections::HashSet<String> = listed["functions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f["function_id"].as_str().map(str::to_string))
                .collect();
            let missing: Vec<String> = self
                .local_function_ids()
                .into_iter()
                .filter(|id| !present.contains(id))
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BusError::new(
                    "registration_timeout",
                    format!(
                        "the engine does not list {} of this worker's functions: {}",
                        missing.len(),
                        missing.join(", ")
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn engine_has_function(&self, function_id: &str) -> Result<bool, BusError> {
        let prefix = function_id
            .rsplit_once("::")
            .map(|(p, _)| format!("{p}::"))
            .unwrap_or_default();
        let listed = self
            .invoke(
                "engine::functions::list",
                json!({"prefix": prefix, "include_internal": true}),
                Some(Duration::from_secs(10)),
                None,
                None,
            )
            .await?;
        Ok(listed["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|f| f["function_id"] == json!(function_id)))
    }

    async fn bind_topic(&self, def: &QueueDef, fifo: bool) -> Result<(), BusError> {
        let types = self
            .invoke(
                "engine::triggers::list",
                json!({"include_internal": true}),
                Some(Duration::from_secs(10)),
                None,
                None,
            )
            .await?;
        let has_subscriber = types["trigger_types"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["id"] == json!("durable:subscriber"));
        if !has_subscriber {
            return Err(BusError::new(
                "harness/dependency",
                "the engine offers neither engine::queue::enqueue nor the durable:subscriber trigger type",
            ));
        }
        let queue_config = json!({
            "type": if fifo { "fifo" } else { "standard" },
            "maxRetries": def.max_retries,
            "concurrency": if fifo { 1 } else { def.concurrency.max(1) },
            "visibilityTimeout": def.visibility_timeout_ms,
            "backoffType": "exponential",
            "backoffDelayMs": def.backoff_ms,
        });
        #[allow(deprecated)]
        self.inner
            .client
            .register_trigger(RegisterTriggerInput::new(
                "durable:subscriber",
                DELIVER_FUNCTION,
                json!({"topic": def.queue, "queue_config": queue_config}),
            ))
            .map_err(|e| from_sdk("durable:subscriber", 0, e))?;
        // Registration is fire-and-forget: confirm the engine holds the binding.
        let deadline = tokio::time::Instant::now() + self.inner.opts.connect_timeout;
        loop {
            let listed = self
                .invoke(
                    "engine::registered-triggers::list",
                    json!({"trigger_type": "durable:subscriber", "function_id": DELIVER_FUNCTION}),
                    Some(Duration::from_secs(10)),
                    None,
                    None,
                )
                .await?;
            let bound = listed["registered_triggers"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| {
                    t["function_id"] == json!(DELIVER_FUNCTION)
                        && t["config"]["topic"] == json!(def.queue)
                });
            if bound {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BusError::new(
                    "harness/dependency",
                    format!(
                        "the durable:subscriber binding of topic '{}' did not appear on the engine",
                        def.queue
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// --- harness-owned trigger types -----------------------------------------------------------

thread_local! {
    static CONFIG_SCHEMA: RefCell<Value> = const { RefCell::new(Value::Bool(true)) };
}

/// A schema type whose schema is whatever [`CONFIG_SCHEMA`] holds when the SDK asks: the SDK
/// takes a trigger type's config schema only from a type, ours are values.
struct DynSchema;

impl serde::Serialize for DynSchema {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_unit()
    }
}

impl schemars::JsonSchema for DynSchema {
    fn schema_name() -> String {
        "TriggerConfig".into()
    }
    fn is_referenceable() -> bool {
        false
    }
    fn json_schema(_gen: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        CONFIG_SCHEMA.with(|s| {
            let mut v = s.borrow().clone();
            if let Value::Object(m) = &mut v {
                m.remove("$schema");
            }
            serde_json::from_value(v).unwrap_or(schemars::schema::Schema::Bool(true))
        })
    }
}

/// Receives the engine's forwarding of bindings of one harness-owned trigger type.
struct BindingSink {
    inner: Weak<Inner>,
    trigger_type: String,
}

#[async_trait]
impl TriggerHandler for BindingSink {
    async fn register_trigger(&self, config: TriggerConfig) -> Result<(), iii_sdk::Error> {
        let Some(inner) = self.inner.upgrade() else {
            return Ok(());
        };
        let validate = inner
            .trigger_types
            .read()
            .expect("trigger types lock")
            .get(&self.trigger_type)
            .and_then(|t| t.validate.clone());
        let cfg = if config.config.is_null() {
            json!({})
        } else {
            config.config
        };
        if let Some(validate) = validate {
            validate(&cfg).map_err(|why| iii_sdk::Error::Remote {
                code: "harness/invalid_request".into(),
                message: format!("config: {why}"),
                stacktrace: None,
            })?;
        }
        let binding = Binding {
            id: config.id.clone(),
            trigger_type: self.trigger_type.clone(),
            function_id: config.function_id,
            config: cfg,
            metadata: strip_decoration(config.metadata.unwrap_or_else(|| json!({}))),
        };
        tracing::debug!(binding = %binding.id, trigger_type = %binding.trigger_type, function = %binding.function_id, "binding forwarded by the engine");
        inner
            .bindings
            .write()
            .expect("bindings lock")
            .insert(config.id, binding);
        Ok(())
    }

    async fn unregister_trigger(&self, config: TriggerConfig) -> Result<(), iii_sdk::Error> {
        if let Some(inner) = self.inner.upgrade() {
            inner
                .bindings
                .write()
                .expect("bindings lock")
                .remove(&config.id);
        }
        Ok(())
    }
}

// --- the Bus -------------------------------------------------------------------------------

#[async_trait]
impl Bus for IiiBus {
    async fn call(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, BusError> {
        self.invoke(function_id, payload, timeout, None, None).await
    }

    async fn call_with_metadata(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Value,
    ) -> Result<Value, BusError> {
        let metadata = (!metadata.is_null()).then_some(metadata);
        self.invoke(function_id, payload, timeout, metadata, None)
            .await
    }

    async fn call_streaming(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<StreamingCall, BusError> {
        let stream_id = uuid::Uuid::new_v4().simple().to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        self.inner
            .streams
            .lock()
            .expect("streams lock")
            .insert(stream_id.clone(), tx);
        let bus = self.clone();
        let function_id = function_id.to_string();
        let metadata =
            json!({STREAM_KEY: {"function_id": self.inner.frames_fn, "stream_id": stream_id}});
        let result = Box::pin(async move {
            let r = bus
                .invoke(&function_id, payload, timeout, Some(metadata), None)
                .await;
            // The callee finished sending its frames before it answered: closing the channel
            // now loses nothing and ends the reader's loop.
            bus.inner
                .streams
                .lock()
                .expect("streams lock")
                .remove(&stream_id);
            r
        });
        Ok(StreamingCall { frames: rx, result })
    }

    async fn call_void(&self, function_id: &str, payload: Value) {
        if let Err(e) = self
            .invoke(function_id, payload, None, None, Some(TriggerAction::Void))
            .await
        {
            tracing::warn!(function = %function_id, "fire-and-forget call failed: {e}");
        }
    }

    fn register_function(&self, def: FunctionDef, handler: Arc<dyn Handler>) {
        let id = def.function_id.clone();
        let replaced = self
            .inner
            .local
            .write()
            .expect("local lock")
            .insert(
                id.clone(),
                Arc::new(Local {
                    def: def.clone(),
                    handler,
                }),
            )
            .is_some();
        if replaced {
            // The engine already routes this id here; the new handler is picked up per call.
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        let fid = id.clone();
        let handler = move |payload: Value, metadata: Option<Value>| {
            let weak = weak.clone();
            let fid = fid.clone();
            async move {
                let inner = weak.upgrade().ok_or(iii_sdk::Error::NotConnected)?;
                let payload = strip_decoration(payload);
                let mut metadata = metadata.map(strip_decoration).unwrap_or(Value::Null);
                let stream = metadata.as_object_mut().and_then(|m| m.remove(STREAM_KEY));
                let (frames, forwarder) = match stream {
                    Some(s) => match (s["function_id"].as_str(), s["stream_id"].as_str()) {
                        (Some(f), Some(id)) => {
                            let (sink, task) =
                                IiiBus::frame_forwarder(&inner, f.to_string(), id.to_string());
                            (Some(sink), Some(task))
                        }
                        _ => (None, None),
                    },
                    None => (None, None),
                };
                let ctx = CallContext { frames, metadata };
                let result = IiiBus::run_local(&inner, &fid, payload, ctx).await;
                // Every frame reaches the caller before the answer does.
                if let Some(task) = forwarder {
                    let _ = task.await;
                }
                result.map_err(to_sdk)
            }
        };
        let mut reg = RegisterFunction::new_async(handler).description(def.description.clone());
        if let Some(s) = def.request_schema.clone() {
            reg = reg.request_format(s);
        }
        if let Some(s) = def.response_schema.clone() {
            reg = reg.response_format(s);
        }
        if !def.metadata.is_null() {
            reg = reg.metadata(def.metadata.clone());
        }
        self.inner.client.register_function(id, reg);
    }

    fn register_trigger_type(&self, def: TriggerTypeDef) {
        let id = def.id.clone();
        let fresh = self
            .inner
            .trigger_types
            .write()
            .expect("trigger types lock")
            .insert(id.clone(), def.clone())
            .is_none();
        if !fresh {
            return;
        }
        let sink = BindingSink {
            inner: Arc::downgrade(&self.inner),
            trigger_type: id.clone(),
        };
        CONFIG_SCHEMA.with(|s| *s.borrow_mut() = def.config_schema.clone());
        #[allow(deprecated)]
        self.inner.client.register_trigger_type_without_warning(
            RegisterTriggerType::new(id, def.description.clone(), sink)
                .trigger_request_format::<DynSchema>(),
        );
    }

    async fn bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError> {
        let owned = self
            .inner
            .trigger_types
            .read()
            .expect("trigger types lock")
            .contains_key(trigger_type);
        let mut out: Vec<Binding> = if owned {
            let bindings = self.inner.bindings.read().expect("bindings lock");
            bindings
                .values()
                .filter(|b| b.trigger_type == trigger_type)
                .cloned()
                .collect()
        } else {
            let listed = self
                .invoke(
                    "engine::registered-triggers::list",
                    json!({"trigger_type": trigger_type, "include_internal": true}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            listed["registered_triggers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["trigger_type"] == json!(trigger_type))
                .map(|t| Binding {
                    id: t["id"].as_str().unwrap_or_default().to_string(),
                    trigger_type: trigger_type.to_string(),
                    function_id: t["function_id"].as_str().unwrap_or_default().to_string(),
                    config: t.get("config").cloned().unwrap_or_else(|| json!({})),
                    metadata: t.get("metadata").cloned().unwrap_or_else(|| json!({})),
                })
                .collect()
        };
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn define_queue(&self, def: QueueDef) -> Result<(), BusError> {
        if self
            .inner
            .queues
            .read()
            .expect("queues lock")
            .contains_key(&def.queue)
        {
            return Ok(());
        }
        // Consumers first: the engine must route to every function of this worker before a step
        // can be delivered.
        self.wait_registered().await?;
        let route = match self.inner.opts.queue_mode {
            QueueMode::Enqueue => Route::Enqueue,
            QueueMode::Topic | QueueMode::TopicFifo => Route::Topic,
            QueueMode::Auto => {
                if self.engine_has_function("engine::queue::enqueue").await? {
                    Route::Enqueue
                } else {
                    Route::Topic
                }
            }
        };
        if route == Route::Topic {
            self.bind_topic(&def, self.inner.opts.queue_mode == QueueMode::TopicFifo)
                .await?;
        }
        tracing::info!(queue = %def.queue, ?route, "queue ensured on the iii engine");
        self.inner.queues.write().expect("queues lock").insert(
            def.queue.clone(),
            QueueRoute {
                route,
                group_field: def.message_group_field.clone(),
                visibility: Duration::from_millis(def.visibility_timeout_ms.max(1000)),
            },
        );
        Ok(())
    }

    async fn enqueue(
        &self,
        queue: &str,
        function_id: &str,
        payload: Value,
    ) -> Result<(), BusError> {
        let (route, group_field) = {
            let queues = self.inner.queues.read().expect("queues lock");
            let q = queues
                .get(queue)
                .ok_or_else(|| BusError::internal(format!("queue '{queue}' is not defined")))?;
            (q.route, q.group_field.clone())
        };
        let mut envelope = json!({"queue": queue, "function_id": function_id});
        if let Some(g) = payload.get(&group_field) {
            envelope[group_field.as_str()] = g.clone();
        }
        envelope["payload"] = payload;
        match route {
            Route::Topic => self
                .invoke(
                    "iii::durable::publish",
                    json!({"topic": queue, "data": envelope}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await
                .map(|_| ()),
            Route::Enqueue => self
                .invoke(
                    DELIVER_FUNCTION,
                    envelope,
                    Some(Duration::from_secs(30)),
                    None,
                    Some(TriggerAction::Enqueue {
                        queue: queue.to_string(),
                    }),
                )
                .await
                .map(|_| ()),
        }
    }

    async fn publish(
        &self,
        topic: &str,
        payload: Value,
        dedupe_key: Option<String>,
    ) -> Result<(), BusError> {
        if let Some(key) = dedupe_key {
            let out = self
                .invoke(
                    "state::set",
                    json!({"scope": PUBLISHED_SCOPE, "key": key, "value": {"topic": topic, "at": now_ms()}}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            if !out["old_value"].is_null() {
                return Ok(());
            }
        }
        self.invoke(
            "iii::durable::publish",
            json!({"topic": topic, "data": payload}),
            Some(Duration::from_secs(30)),
            None,
            None,
        )
        .await
        .map(|_| ())
    }

    /// The engine offers no durability point (its file store flushes every 5 s), so this
    /// cannot make anything durable. What it does: read back every state value written through
    /// this bus since the last barrier and fail (`harness/state`) if the engine no longer holds
    /// it, so a checkpoint lost before the side effect (an engine restart between the write and
    /// the dispatch) stops the dispatch. See the crate docs for what remains.
    async fn barrier(&self) -> Result<(), BusError> {
        let (snapshot, _running) = {
            let mut w = self.inner.written.lock().expect("written lock");
            let snapshot: Vec<((String, String), (u64, Value))> = w.drain().collect();
            let floor = snapshot
                .iter()
                .map(|(_, (s, _))| *s)
                .min()
                .unwrap_or(u64::MAX);
            self.inner
                .recent
                .lock()
                .expect("recent lock")
                .floors
                .push(floor);
            (
                snapshot,
                BarrierRunning {
                    inner: self.inner.clone(),
                    floor,
                },
            )
        };
        for ((scope, key), (seq, value)) in snapshot {
            let stored = self
                .invoke(
                    "state::get",
                    json!({"scope": scope, "key": key}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            if strip_decoration(stored) == value {
                continue;
            }
            // A newer write of the same key (another task), recorded or still in flight, is not
            // a loss (the newer one is checked by a later barrier).
            let id = (scope.clone(), key.clone());
            let newer = self
                .inner
                .written
                .lock()
                .expect("written lock")
                .get(&id)
                .is_some_and(|(s, _)| *s > seq)
                || self
                    .inner
                    .writing
                    .lock()
                    .expect("writing lock")
                    .contains_key(&id)
                || self
                    .inner
                    .recent
                    .lock()
                    .expect("recent lock")
                    .log
                    .iter()
                    .any(|(s, k)| *s > seq && *k == id);
            if !newer {
                return Err(BusError::new(
                    "harness/state",
                    format!("state {scope}/{key}: the engine lost a write before the durability point (did it restart?)"),
                ));
            }
        }
        Ok(())
    }

    async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>, BusError> {
        let v = self
            .invoke(
                "state::get",
                json!({"scope": scope, "key": key}),
                Some(Duration::from_secs(30)),
                None,
                None,
            )
            .await?;
        if v.is_null() {
            return Ok(None);
        }
        Ok(Some(unwrap_state(v).1))
    }

    async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
        let stored = wrap_state(key, value);
        let _writing = self.writing(scope, key);
        self.invoke(
            "state::set",
            json!({"scope": scope, "key": key, "value": stored}),
            Some(Duration::from_secs(30)),
            None,
            None,
        )
        .await?;
        self.record_write(scope, key, stored);
        Ok(())
    }

    async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
        let _writing = self.writing(scope, key);
        self.invoke(
            "state::delete",
            json!({"scope": scope, "key": key}),
            Some(Duration::from_secs(30)),
            None,
            None,
        )
        .await?;
        self.record_write(scope, key, Value::Null);
        Ok(())
    }

    async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        let v = self
            .invoke(
                "state::list",
                json!({"scope": scope}),
                Some(Duration::from_secs(30)),
                None,
                None,
            )
            .await?;
        let mut out = Vec::new();
        for item in v.as_array().cloned().unwrap_or_default() {
            match unwrap_state(item) {
                (Some(k), v) => out.push((k, v)),
                (None, _) => tracing::warn!(scope, "skipping a state value stored without its key"),
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A barrier in progress (see `Inner::recent`); dropping it prunes the log.
struct BarrierRunning {
    inner: Arc<Inner>,
    floor: u64,
}

impl Drop for BarrierRunning {
    fn drop(&mut self) {
        let mut r = self.inner.recent.lock().expect("recent lock");
        if let Some(i) = r.floors.iter().position(|f| *f == self.floor) {
            r.floors.swap_remove(i);
        }
        match r.floors.iter().min().copied() {
            None => r.log.clear(),
            Some(min) => r.log.retain(|(s, _)| *s > min),
        }
    }
}

/// Marks a state write in flight until dropped (see `Inner::writing`).
struct Writing {
    inner: Arc<Inner>,
    id: (String, String),
}

impl Drop for Writing {
    fn drop(&mut self) {
        let mut w = self.inner.writing.lock().expect("writing lock");
        if let Some(n) = w.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                w.remove(&self.id);
            }
        }
    }
}

impl IiiBus {
    /// Marks a write of `(scope, key)` in flight; dropped after it was recorded (or failed).
    fn writing(&self, scope: &str, key: &str) -> Writing {
        let id = (scope.to_string(), key.to_string());
        *self
            .inner
            .writing
            .lock()
            .expect("writing lock")
            .entry(id.clone())
            .or_insert(0) += 1;
        Writing {
            inner: self.inner.clone(),
            id,
        }
    }

    fn record_write(&self, scope: &str, key: &str, stored: Value) {
        let seq = self
            .inner
            .write_seq
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let id = (scope.to_string(), key.to_string());
        self.inner
            .written
            .lock()
            .expect("written lock")
            .insert(id.clone(), (seq, stored));
        let mut r = self.inner.recent.lock().expect("recent lock");
        if !r.floors.is_empty() {
            r.log.push((seq, id));
        }
    }

    /// Every function registered here, with its schemas (what the engine was told).
    pub fn function_defs(&self) -> Vec<FunctionDef> {
        let local = self.inner.local.read().expect("local lock");
        let mut defs: Vec<FunctionDef> = local.values().map(|l| l.def.clone()).collect();
        defs.sort_by(|a, b| a.function_id.cmp(&b.function_id));
        defs
    }
}
