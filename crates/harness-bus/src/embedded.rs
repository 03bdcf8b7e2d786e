//! The embedded bus: in-process dispatch over a SQLite store.
//!
//! Functions live in a registry behind a std `RwLock` (reads on every call, writes only at
//! registration; no lock is ever held across an await). Bindings are persisted in the store so a
//! restarted server keeps them. Queues are the store's durable FIFO queues, consumed by calling
//! the queued function through this same registry.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use harness_store::{
    enqueue_text_in, insert_event_text_in, kv_delete_in, kv_put_cached_in, kv_put_text_cached_in,
    Connection, QueueConfig, QueueHandler, QueueMessage, Queues, Store, StoreError,
};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::bus::{
    to_text, Binding, Bus, BusWrite, CallContext, FunctionDef, Handler, QueueDef, StreamingCall,
    TriggerTypeDef, TypedRequest,
};
use crate::engine_functions;
use crate::error::BusError;
use crate::local::LocalHandler;

/// Scope of the persisted bindings in the state store.
pub(crate) const BINDINGS_SCOPE: &str = "engine_bindings";

const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The in-transaction form of a write function (see [`EmbeddedBus::register_transactional`]):
/// runs on the batch's connection; an `Err` rolls the whole batch back.
pub type TxHandler = Arc<dyn Fn(&Connection, Value) -> Result<Value, StoreError> + Send + Sync>;

/// What a prepared write answers: the function's answer and the id of the last event it
/// inserted, if any (so the batch wakes event subscribers without reading the log).
pub struct TxAnswer {
    pub answer: TxValue,
    pub event: Option<i64>,
}

/// A prepared write's answer: JSON already, or a typed answer turned into JSON on the caller's
/// thread once the batch is committed, so the single writer thread does not serialise answers.
pub enum TxValue {
    Ready(Value),
    Later(Box<dyn FnOnce() -> serde_json::Result<Value> + Send>),
}

impl TxValue {
    /// `answer`, serialised after the batch.
    pub fn later<T: serde::Serialize + Send + 'static>(answer: T) -> TxValue {
        TxValue::Later(Box::new(move || serde_json::to_value(answer)))
    }

    fn into_value(self) -> Result<Value, BusError> {
        match self {
            TxValue::Ready(v) => Ok(v),
            TxValue::Later(f) => f().map_err(|e| BusError::internal(e.to_string())),
        }
    }
}

/// A write prepared on the caller's thread, to run inside a batch on the writer thread. It may
/// run more than once (the store replays a batch's writes after another one failed), so it must
/// only touch the connection.
pub type TxWrite = Box<dyn FnMut(&Connection) -> Result<TxAnswer, StoreError> + Send>;

/// Turns a call's payload into a [`TxWrite`] (see [`EmbeddedBus::register_prepared`]): parsing,
/// validation and serialisation happen here, on the caller's thread, so the single writer
/// thread only runs SQL. An `Err` fails the batch before anything is written.
pub type TxPrepare = Arc<dyn Fn(Value) -> Result<TxWrite, StoreError> + Send + Sync>;

/// [`TxPrepare`] for a [`BusWrite::Typed`] request: no JSON on the way in. A request of a type
/// it does not take comes back (`Err(Ok(request))`) and goes the JSON way.
pub type TxPrepareTyped =
    Arc<dyn Fn(TypedRequest) -> Result<TxWrite, Result<TypedRequest, StoreError>> + Send + Sync>;

/// A write function's in-transaction form.
#[derive(Clone)]
enum TxForm {
    InWriter(TxHandler),
    Prepared(TxPrepare, Option<TxPrepareTyped>),
}

struct Registered {
    def: FunctionDef,
    handler: Arc<dyn Handler>,
    /// Registering again without one drops it, so a replacement is never bypassed.
    local: Option<Arc<dyn LocalHandler>>,
}

pub(crate) struct Inner {
    functions: RwLock<HashMap<String, Arc<Registered>>>,
    pub(crate) trigger_types: RwLock<HashMap<String, TriggerTypeDef>>,
    pub(crate) bindings: RwLock<HashMap<String, Binding>>,
    queue_groups: RwLock<HashMap<String, String>>,
    /// In-transaction forms of write functions, for [`Bus::commit`]. Same locking as
    /// `functions`: written at registration, read per batch, never held across an await.
    tx_functions: RwLock<HashMap<String, TxForm>>,
    pub(crate) store: Store,
    queues: Queues,
    /// Running `cron` schedules by binding id. A std Mutex: held only to insert or take.
    schedules: std::sync::Mutex<HashMap<String, tokio::task::AbortHandle>>,
}

/// The in-process bus. Cheap to clone.
#[derive(Clone)]
pub struct EmbeddedBus {
    pub(crate) inner: Arc<Inner>,
}

impl EmbeddedBus {
    /// A bus over `store`, with the `engine::*` and `state::*` functions registered and the
    /// persisted bindings loaded.
    pub fn new(store: Store) -> Result<EmbeddedBus, BusError> {
        let queues = Queues::new(store.clone());
        let bus = EmbeddedBus {
            inner: Arc::new(Inner {
                functions: RwLock::new(HashMap::new()),
                trigger_types: RwLock::new(HashMap::new()),
                bindings: RwLock::new(HashMap::new()),
                queue_groups: RwLock::new(HashMap::new()),
                tx_functions: RwLock::new(HashMap::new()),
                store,
                queues,
                schedules: std::sync::Mutex::new(HashMap::new()),
            }),
        };
        let persisted = bus.inner.store.kv_list(BINDINGS_SCOPE)?;
        {
            let mut bindings = bus.inner.bindings.write().expect("bindings lock");
            for (id, value) in persisted {
                match serde_json::from_value::<Binding>(value) {
                    Ok(b) => {
                        bindings.insert(id, b);
                    }
                    Err(e) => tracing::warn!(binding = %id, "skipping unreadable binding: {e}"),
                }
            }
        }
        engine_functions::register(&bus);
        bus.register_trigger_type(crate::cron::trigger_type());
        let crons: Vec<Binding> = {
            let bindings = bus.inner.bindings.read().expect("bindings lock");
            bindings
                .values()
                .filter(|b| b.trigger_type == crate::cron::CRON)
                .cloned()
                .collect()
        };
        for b in crons {
            bus.binding_added(&b);
        }
        Ok(bus)
    }

    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    pub fn queues(&self) -> &Queues {
        &self.inner.queues
    }

    /// Every registered function's description, sorted by id.
    pub fn function_defs(&self) -> Vec<FunctionDef> {
        let functions = self.inner.functions.read().expect("functions lock");
        let mut defs: Vec<FunctionDef> = functions.values().map(|r| r.def.clone()).collect();
        defs.sort_by(|a, b| a.function_id.cmp(&b.function_id));
        defs
    }

    /// `(id, description, internal)` of every registered function, sorted by id, without
    /// copying their schemas (discovery runs on every step of a native-exposure turn).
    pub fn function_summaries(&self) -> Vec<(String, String, bool)> {
        let functions = self.inner.functions.read().expect("functions lock");
        let mut out: Vec<(String, String, bool)> = functions
            .values()
            .map(|r| {
                (
                    r.def.function_id.clone(),
                    r.def.description.clone(),
                    r.def.is_internal(),
                )
            })
            .collect();
        out.sort();
        out
    }

    pub fn function_def(&self, function_id: &str) -> Option<FunctionDef> {
        let functions = self.inner.functions.read().expect("functions lock");
        functions.get(function_id).map(|r| r.def.clone())
    }

    pub fn trigger_type_ids(&self) -> Vec<(String, String, Value)> {
        let types = self.inner.trigger_types.read().expect("trigger types lock");
        let mut out: Vec<_> = types
            .values()
            .map(|t| (t.id.clone(), t.description.clone(), t.config_schema.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Starts what a new binding needs to fire (a `cron` schedule).
    pub(crate) fn binding_added(&self, b: &Binding) {
        if b.trigger_type == crate::cron::CRON {
            if let Some(handle) = crate::cron::spawn(self, b) {
                self.inner
                    .schedules
                    .lock()
                    .expect("schedules lock")
                    .insert(b.id.clone(), handle);
            }
        }
    }

    pub(crate) fn binding_removed(&self, id: &str) {
        if let Some(handle) = self
            .inner
            .schedules
            .lock()
            .expect("schedules lock")
            .remove(id)
        {
            handle.abort();
        }
    }

    /// Registers the in-transaction form of a write function already registered with
    /// `register_function`, so a [`Bus::commit`] batch that calls it stays one transaction. It
    /// must do exactly what the plain function does, minus what only runs after a commit (the
    /// batch wakes event subscribers itself).
    pub fn register_transactional(&self, function_id: &str, handler: TxHandler) {
        self.inner
            .tx_functions
            .write()
            .expect("tx functions lock")
            .insert(function_id.to_string(), TxForm::InWriter(handler));
    }

    /// [`EmbeddedBus::register_transactional`] in two halves: `prepare` runs on the caller's
    /// thread (parse, validate, serialise) and hands back the write the batch runs on the
    /// writer thread. The hot-path writes of the loop use this form, so the one writer thread
    /// that every session shares does nothing but SQL.
    pub fn register_prepared(&self, function_id: &str, prepare: TxPrepare) {
        self.inner
            .tx_functions
            .write()
            .expect("tx functions lock")
            .insert(function_id.to_string(), TxForm::Prepared(prepare, None));
    }

    /// [`EmbeddedBus::register_prepared`] that also takes [`BusWrite::Typed`] requests as they
    /// are; `prepare` serves `BusWrite::Call`s and typed requests of another type.
    pub fn register_prepared_typed(
        &self,
        function_id: &str,
        prepare: TxPrepare,
        typed: TxPrepareTyped,
    ) {
        self.inner
            .tx_functions
            .write()
            .expect("tx functions lock")
            .insert(
                function_id.to_string(),
                TxForm::Prepared(prepare, Some(typed)),
            );
    }

    /// The message group of a payload on `queue` (the queue's group field), or why not.
    fn queue_group(&self, queue: &str, payload: &Value) -> Result<String, BusError> {
        let group_field = {
            let groups = self.inner.queue_groups.read().expect("queue groups lock");
            groups.get(queue).cloned()
        }
        .ok_or_else(|| BusError::internal(format!("queue '{queue}' is not defined")))?;
        Ok(match payload.get(&group_field) {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        })
    }

    /// Stops consuming queues; in-flight steps are left to redelivery.
    pub async fn shutdown(&self) {
        for (_, handle) in self.inner.schedules.lock().expect("schedules lock").drain() {
            handle.abort();
        }
        self.inner.queues.shutdown().await;
    }

    fn insert(
        &self,
        def: FunctionDef,
        handler: Arc<dyn Handler>,
        local: Option<Arc<dyn LocalHandler>>,
    ) {
        let mut functions = self.inner.functions.write().expect("functions lock");
        functions.insert(
            def.function_id.clone(),
            Arc::new(Registered {
                def,
                handler,
                local,
            }),
        );
    }

    fn lookup(&self, function_id: &str) -> Result<Arc<Registered>, BusError> {
        let functions = self.inner.functions.read().expect("functions lock");
        functions
            .get(function_id)
            .cloned()
            .ok_or_else(|| BusError::function_not_found(function_id))
    }

    async fn invoke(
        &self,
        function_id: &str,
        payload: Value,
        ctx: CallContext,
        timeout: Option<Duration>,
    ) -> Result<Value, BusError> {
        let registered = self.lookup(function_id)?;
        let timeout = timeout.unwrap_or(DEFAULT_CALL_TIMEOUT);
        // A panicking handler must fail its call, not the caller's task.
        let fut = AssertUnwindSafe(registered.handler.call(payload, ctx)).catch_unwind();
        match tokio::time::timeout(timeout, fut).await {
            Err(_) => Err(BusError::timeout(function_id, timeout.as_millis() as u64)),
            Ok(Err(_panic)) => Err(BusError::internal(format!(
                "{function_id} panicked while handling the call"
            ))),
            Ok(Ok(result)) => result,
        }
    }
}

#[async_trait]
impl Bus for EmbeddedBus {
    async fn call_with_metadata(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Value,
    ) -> Result<Value, BusError> {
        let ctx = CallContext {
            frames: None,
            metadata,
        };
        self.invoke(function_id, payload, ctx, timeout).await
    }

    async fn call_streaming(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<StreamingCall, BusError> {
        self.lookup(function_id)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let bus = self.clone();
        let function_id = function_id.to_string();
        let result = Box::pin(async move {
            bus.invoke(
                &function_id,
                payload,
                CallContext {
                    frames: Some(tx),
                    metadata: Value::Null,
                },
                timeout,
            )
            .await
        });
        Ok(StreamingCall { frames: rx, result })
    }

    async fn call_void(&self, function_id: &str, payload: Value) {
        let bus = self.clone();
        let function_id = function_id.to_string();
        tokio::spawn(async move {
            if let Err(e) = bus.call(&function_id, payload, None).await {
                tracing::warn!(function = %function_id, "fire-and-forget call failed: {e}");
            }
        });
    }

    fn register_function(&self, def: FunctionDef, handler: Arc<dyn Handler>) {
        self.insert(def, handler, None);
    }

    fn register_function_with_local(
        &self,
        def: FunctionDef,
        handler: Arc<dyn Handler>,
        local: Arc<dyn LocalHandler>,
    ) {
        self.insert(def, handler, Some(local));
    }

    fn local_handler(&self, function_id: &str) -> Option<Arc<dyn LocalHandler>> {
        let functions = self.inner.functions.read().expect("functions lock");
        functions.get(function_id)?.local.clone()
    }

    fn unregister_function(&self, function_id: &str) -> bool {
        let mut functions = self.inner.functions.write().expect("functions lock");
        functions.remove(function_id).is_some()
    }

    fn register_trigger_type(&self, def: TriggerTypeDef) {
        let mut types = self
            .inner
            .trigger_types
            .write()
            .expect("trigger types lock");
        types.insert(def.id.clone(), def);
    }

    async fn bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError> {
        let bindings = self.inner.bindings.read().expect("bindings lock");
        let mut out: Vec<Binding> = bindings
            .values()
            .filter(|b| b.trigger_type == trigger_type)
            .cloned()
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn define_queue(&self, def: QueueDef) -> Result<(), BusError> {
        {
            let mut groups = self.inner.queue_groups.write().expect("queue groups lock");
            if groups.contains_key(&def.queue) {
                return Ok(());
            }
            groups.insert(def.queue.clone(), def.message_group_field.clone());
        }
        self.inner.queues.define(
            &def.queue,
            QueueConfig {
                concurrency: def.concurrency,
                max_retries: def.max_retries,
                backoff_ms: def.backoff_ms,
                visibility_timeout_ms: def.visibility_timeout_ms,
            },
        );
        let bus = self.clone();
        let visibility = Duration::from_millis(def.visibility_timeout_ms);
        let handler: QueueHandler = Arc::new(move |msg: QueueMessage| {
            let bus = bus.clone();
            Box::pin(async move {
                bus.invoke(
                    &msg.function_id,
                    msg.payload,
                    CallContext::default(),
                    Some(visibility),
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
            })
        });
        self.inner.queues.start(&def.queue, handler);
        Ok(())
    }

    async fn enqueue(
        &self,
        queue: &str,
        function_id: &str,
        payload: Value,
    ) -> Result<(), BusError> {
        let group = self.queue_group(queue, &payload)?;
        self.inner
            .queues
            .enqueue(queue, &group, function_id, &payload)
            .await?;
        Ok(())
    }

    async fn publish(
        &self,
        topic: &str,
        payload: Value,
        dedupe_key: Option<String>,
    ) -> Result<(), BusError> {
        let session_id = payload
            .get("session_id")
            .and_then(Value::as_str)
            .map(str::to_string);
        self.inner
            .store
            .append_event(
                session_id.as_deref(),
                topic,
                &payload,
                dedupe_key.as_deref(),
            )
            .await?;
        Ok(())
    }

    async fn barrier(&self) -> Result<(), BusError> {
        self.inner.store.barrier().await?;
        Ok(())
    }

    /// One store transaction for the whole batch (all or nothing), then the wake-ups that must
    /// follow a commit. A call without an in-transaction form makes the batch fall back to one
    /// write after another (the trait's default). Everything but the SQL (payload parsing and
    /// serialisation, queue groups) is done here, before the batch reaches the writer thread.
    async fn commit(&self, writes: Vec<BusWrite>) -> Result<Vec<Value>, BusError> {
        let forms: Vec<Option<TxForm>> = {
            let tx = self.inner.tx_functions.read().expect("tx functions lock");
            writes
                .iter()
                .map(|w| match w {
                    BusWrite::Call { function_id, .. } | BusWrite::Typed { function_id, .. } => {
                        tx.get(function_id).cloned()
                    }
                    _ => None,
                })
                .collect()
        };
        let unbatchable = writes.iter().zip(&forms).any(|(w, f)| {
            matches!(w, BusWrite::Call { .. } | BusWrite::Typed { .. }) && f.is_none()
        });
        if unbatchable {
            return crate::bus::commit_one_by_one(self, writes).await;
        }
        let mut queues: Vec<String> = Vec::new();
        let mut plan = Vec::with_capacity(writes.len());
        for (w, form) in writes.into_iter().zip(forms) {
            plan.push(match (w, form) {
                (BusWrite::Call { payload, .. }, Some(TxForm::InWriter(h))) => {
                    Planned::InWriter(h, payload)
                }
                (BusWrite::Call { payload, .. }, Some(TxForm::Prepared(prepare, _))) => {
                    Planned::Prepared(prepare(payload).map_err(tx_error)?)
                }
                (BusWrite::Typed { request, .. }, Some(TxForm::Prepared(prepare, typed))) => {
                    Planned::Prepared(prepare_typed(&prepare, typed.as_ref(), request)?)
                }
                (BusWrite::Typed { request, .. }, Some(TxForm::InWriter(h))) => {
                    Planned::InWriter(h, request.to_value()?)
                }
                (
                    BusWrite::Call { function_id, .. } | BusWrite::Typed { function_id, .. },
                    None,
                ) => {
                    return Err(BusError::internal(format!(
                        "commit: {function_id} lost its in-transaction form"
                    )))
                }
                (BusWrite::StateSet { scope, key, value }, _) => Planned::StateSet {
                    scope,
                    key,
                    text: to_text(&value)?,
                    value: Arc::new(value),
                },
                (BusWrite::StateSetText { scope, key, text }, _) => Planned::StateSetText {
                    scope,
                    key,
                    text: text.into(),
                },
                (BusWrite::StateDelete { scope, key }, _) => Planned::StateDelete { scope, key },
                (
                    BusWrite::Enqueue {
                        queue,
                        function_id,
                        payload,
                    },
                    _,
                ) => {
                    let group = self.queue_group(&queue, &payload)?;
                    if !queues.contains(&queue) {
                        queues.push(queue.clone());
                    }
                    Planned::Enqueue {
                        text: to_text(&payload)?,
                        queue,
                        group,
                        function_id,
                    }
                }
                (
                    BusWrite::Publish {
                        topic,
                        payload,
                        dedupe_key,
                    },
                    _,
                ) => Planned::Publish {
                    session_id: payload
                        .get("session_id")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    text: to_text(&payload)?,
                    topic,
                    dedupe_key,
                },
            });
        }
        let (out, events) = self
            .inner
            .store
            .write_replayable(move |conn| {
                let mut out = Vec::with_capacity(plan.len());
                let mut events = Events::None;
                for p in plan.iter_mut() {
                    out.push(p.run(conn, &mut events)?);
                }
                Ok((out, events))
            })
            .await
            .map_err(tx_error)?;
        // The rows are committed: a failed pickup is only logged, as in `Queues::enqueue` (the
        // next enqueue or restart rescans from the same watermark and finds them).
        for queue in queues {
            if let Err(e) = self.inner.queues.wake(&queue) {
                tracing::error!(queue = %queue, error = %e, "harness-bus: queue rescan failed after a batch");
            }
        }
        match events {
            Events::None => {}
            Events::Last(id) => self.inner.store.notify_event(id),
            Events::Unknown => self.inner.store.notify_events(),
        }
        out.into_iter().map(TxValue::into_value).collect()
    }

    // State goes straight to the store: the `state::*` functions stay registered for callers
    // by id, but the loop's own reads and writes skip the registry and the request envelope.

    async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>, BusError> {
        Ok(self.inner.store.kv_get(scope, key)?)
    }

    async fn state_get_shared(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<Arc<Value>>, BusError> {
        Ok(self.inner.store.kv_get_shared(scope, key)?)
    }

    async fn state_get_text(&self, scope: &str, key: &str) -> Result<Option<Arc<str>>, BusError> {
        Ok(self.inner.store.kv_get_text(scope, key)?)
    }

    async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
        self.inner.store.kv_put_through(scope, key, value).await?;
        Ok(())
    }

    async fn state_set_text(&self, scope: &str, key: &str, text: String) -> Result<(), BusError> {
        self.inner
            .store
            .kv_put_text_through(scope, key, text.into())
            .await?;
        Ok(())
    }

    async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
        self.inner.store.kv_delete(scope, key).await?;
        Ok(())
    }

    async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        Ok(self.inner.store.kv_list(scope)?)
    }
}

/// A typed request's write: through the typed form when it takes the request's type, else
/// through JSON as a `BusWrite::Call` would go.
fn prepare_typed(
    prepare: &TxPrepare,
    typed: Option<&TxPrepareTyped>,
    request: TypedRequest,
) -> Result<TxWrite, BusError> {
    let request = match typed {
        None => request,
        Some(typed) => match typed(request) {
            Ok(write) => return Ok(write),
            Err(Ok(untaken)) => untaken,
            Err(Err(e)) => return Err(tx_error(e)),
        },
    };
    prepare(request.to_value()?).map_err(tx_error)
}

/// One write of a [`Bus::commit`] batch, planned (and serialised) before the batch reaches the
/// writer thread, where it may run more than once (see `Store::write_replayable`).
enum Planned {
    InWriter(TxHandler, Value),
    Prepared(TxWrite),
    StateSet {
        scope: String,
        key: String,
        text: String,
        /// What `text` says, for the store's cache once the batch commits.
        value: Arc<Value>,
    },
    /// Cached as the text itself.
    StateSetText {
        scope: String,
        key: String,
        text: Arc<str>,
    },
    StateDelete {
        scope: String,
        key: String,
    },
    Enqueue {
        queue: String,
        group: String,
        function_id: String,
        text: String,
    },
    Publish {
        session_id: Option<String>,
        topic: String,
        text: String,
        dedupe_key: Option<String>,
    },
}

/// Which events a batch inserted, so that it wakes subscribers without reading the log.
#[derive(Clone, Copy)]
enum Events {
    None,
    Last(i64),
    /// A write that does not say (an in-writer handler may have inserted some).
    Unknown,
}

impl Events {
    fn inserted(&mut self, id: Option<i64>) {
        if let Some(id) = id {
            *self = match *self {
                Events::None => Events::Last(id),
                Events::Last(last) => Events::Last(last.max(id)),
                Events::Unknown => Events::Unknown,
            };
        }
    }
}

impl Planned {
    fn run(&mut self, conn: &Connection, events: &mut Events) -> Result<TxValue, StoreError> {
        Ok(TxValue::Ready(match self {
            Planned::InWriter(h, payload) => {
                *events = Events::Unknown;
                h(conn, payload.clone())?
            }
            Planned::Prepared(write) => {
                let answer = write(conn)?;
                events.inserted(answer.event);
                return Ok(answer.answer);
            }
            Planned::StateSet {
                scope,
                key,
                text,
                value,
            } => {
                kv_put_cached_in(conn, scope, key, text, value)?;
                Value::Null
            }
            Planned::StateSetText { scope, key, text } => {
                kv_put_text_cached_in(conn, scope, key, text)?;
                Value::Null
            }
            Planned::StateDelete { scope, key } => {
                kv_delete_in(conn, scope, key)?;
                Value::Null
            }
            Planned::Enqueue {
                queue,
                group,
                function_id,
                text,
            } => {
                enqueue_text_in(conn, queue, group, function_id, text)?;
                Value::Null
            }
            Planned::Publish {
                session_id,
                topic,
                text,
                dedupe_key,
            } => {
                let id = insert_event_text_in(
                    conn,
                    session_id.as_deref(),
                    topic,
                    text,
                    dedupe_key.as_deref(),
                )?;
                events.inserted(id);
                Value::Null
            }
        }))
    }
}

/// A transaction handler rejects with a typed `harness/<code>: …` text in
/// `StoreError::Invalid`; it keeps its code on the way out.
fn tx_error(e: StoreError) -> BusError {
    match e {
        StoreError::Invalid(text) => harness_types::HarnessError::from_wire(&text).into(),
        other => other.into(),
    }
}
