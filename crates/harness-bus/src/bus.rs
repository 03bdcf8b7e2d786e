//! The Bus trait and the types it speaks.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::error::BusError;
use crate::local::LocalHandler;

pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<Value, BusError>> + Send + 'static>>;

/// Where a streaming function writes its frames. Unbounded on purpose: a generation is bounded by
/// the model's output limit, and a slow reader must never make a provider connection stall.
pub type FrameSink = mpsc::UnboundedSender<Value>;

/// What a handler learns about the call besides its payload.
#[derive(Clone, Default)]
pub struct CallContext {
    /// Present when the caller asked for a streaming call.
    pub frames: Option<FrameSink>,
    /// Call metadata (on iii: the invocation's `metadata`). The loop puts the
    /// `function_call_id` here so an idempotent target can deduplicate.
    pub metadata: Value,
}

impl CallContext {
    /// Sends a frame if the caller is streaming; a reader that went away is not an error.
    pub fn frame(&self, frame: Value) {
        if let Some(sink) = &self.frames {
            let _ = sink.send(frame);
        }
    }
}

/// A function implementation.
pub trait Handler: Send + Sync + 'static {
    fn call(&self, payload: Value, ctx: CallContext) -> HandlerFuture;
}

impl<F, Fut> Handler for F
where
    F: Fn(Value, CallContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, BusError>> + Send + 'static,
{
    fn call(&self, payload: Value, ctx: CallContext) -> HandlerFuture {
        Box::pin((self)(payload, ctx))
    }
}

/// A function's public description: what `engine::functions::info` returns.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FunctionDef {
    pub function_id: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub request_schema: Option<Value>,
    #[serde(default)]
    pub response_schema: Option<Value>,
    /// `{"internal": true}` hides the function from default discovery.
    #[serde(default)]
    pub metadata: Value,
}

impl FunctionDef {
    pub fn new(function_id: impl Into<String>, description: impl Into<String>) -> Self {
        FunctionDef {
            function_id: function_id.into(),
            description: description.into(),
            request_schema: None,
            response_schema: None,
            metadata: json!({}),
        }
    }

    pub fn schemas(mut self, request: Value, response: Value) -> Self {
        self.request_schema = Some(request);
        self.response_schema = Some(response);
        self
    }

    pub fn internal(mut self) -> Self {
        self.metadata["internal"] = json!(true);
        self
    }

    pub fn is_internal(&self) -> bool {
        self.metadata.get("internal") == Some(&json!(true))
    }
}

/// Validates a binding's `config` for one trigger type; returns the reason it is rejected.
pub type ConfigValidator = Arc<dyn Fn(&Value) -> Result<(), String> + Send + Sync>;

/// A trigger type bindings can be made for (an event the harness emits, a hook point, cron).
#[derive(Clone)]
pub struct TriggerTypeDef {
    pub id: String,
    pub description: String,
    pub config_schema: Value,
    pub validate: Option<ConfigValidator>,
}

/// One binding of a trigger type to a function.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    pub id: String,
    pub trigger_type: String,
    pub function_id: String,
    #[serde(default)]
    pub config: Value,
    #[serde(default)]
    pub metadata: Value,
}

/// A durable FIFO queue: one message per group is in flight at a time, groups run in parallel.
#[derive(Clone, Debug)]
pub struct QueueDef {
    pub queue: String,
    /// The payload field whose value groups messages (`session_id` for `harness-turn`).
    pub message_group_field: String,
    pub concurrency: usize,
    pub max_retries: u32,
    pub backoff_ms: u64,
    /// A delivery not acked within this time is redelivered.
    pub visibility_timeout_ms: u64,
}

/// A call whose callee streams frames before it answers.
pub struct StreamingCall {
    pub frames: mpsc::UnboundedReceiver<Value>,
    pub result: HandlerFuture,
}

/// A write function's request still in its Rust type (see [`BusWrite::Typed`]).
#[derive(Clone)]
pub struct TypedRequest {
    request: Arc<dyn Any + Send + Sync>,
    to_value: fn(&(dyn Any + Send + Sync)) -> Result<Value, serde_json::Error>,
}

fn typed_to_value<T: Serialize + 'static>(
    request: &(dyn Any + Send + Sync),
) -> Result<Value, serde_json::Error> {
    match request.downcast_ref::<T>() {
        Some(request) => serde_json::to_value(request),
        None => unreachable!("a TypedRequest holds the type it was made with"),
    }
}

impl TypedRequest {
    pub fn new<T: Serialize + Send + Sync + 'static>(request: T) -> Self {
        TypedRequest {
            request: Arc::new(request),
            to_value: typed_to_value::<T>,
        }
    }

    /// The request as JSON: what a bus without a typed form of the function sends.
    pub fn to_value(&self) -> Result<Value, BusError> {
        (self.to_value)(self.request.as_ref()).map_err(|e| BusError::internal(e.to_string()))
    }

    /// The request, if it is a `T` (cloned only when this request was cloned); else itself.
    pub fn take<T: Clone + Send + Sync + 'static>(self) -> Result<T, Self> {
        let to_value = self.to_value;
        match self.request.downcast::<T>() {
            Ok(request) => Ok(Arc::try_unwrap(request).unwrap_or_else(|r| T::clone(&r))),
            Err(request) => Err(TypedRequest { request, to_value }),
        }
    }
}

impl std::fmt::Debug for TypedRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.to_value() {
            Ok(value) => write!(f, "{value}"),
            Err(e) => write!(f, "<unserialisable request: {e}>"),
        }
    }
}

/// Two requests are equal when they say the same thing on the wire.
impl PartialEq for TypedRequest {
    fn eq(&self, other: &Self) -> bool {
        matches!((self.to_value(), other.to_value()), (Ok(a), Ok(b)) if a == b)
    }
}

/// One write of a [`Bus::commit`] batch.
#[derive(Clone, Debug, PartialEq)]
pub enum BusWrite {
    /// A call of a function that only writes (a `session::*` write); its answer is returned.
    Call {
        function_id: String,
        payload: Value,
    },
    /// [`BusWrite::Call`] with the request still in its Rust type: an in-process bus whose
    /// in-transaction form of the function takes that type uses it as is (no JSON round trip);
    /// any other bus sends [`TypedRequest::to_value`].
    Typed {
        function_id: String,
        request: TypedRequest,
    },
    StateSet {
        scope: String,
        key: String,
        value: Value,
    },
    /// [`BusWrite::StateSet`] of a value its writer serialised itself (the turn record, from
    /// its struct): a bus that stores JSON text stores and caches it as it is, so neither the
    /// write nor a [`Bus::state_get_text`] of it builds a `Value` tree. It must be JSON text.
    StateSetText {
        scope: String,
        key: String,
        text: String,
    },
    StateDelete {
        scope: String,
        key: String,
    },
    Enqueue {
        queue: String,
        function_id: String,
        payload: Value,
    },
    Publish {
        topic: String,
        payload: Value,
        dedupe_key: Option<String>,
    },
}

/// Everything the loop needs from the world outside itself.
#[async_trait]
pub trait Bus: Send + Sync + 'static {
    /// Calls a function by id and waits for its answer (`timeout` None = the bus default): a
    /// call with no metadata.
    async fn call(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, BusError> {
        self.call_with_metadata(function_id, payload, timeout, Value::Null)
            .await
    }

    /// Calls a function that streams frames (`router::chat`); frames arrive on `frames` while
    /// `result` is pending.
    async fn call_streaming(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<StreamingCall, BusError>;

    /// A call carrying metadata for the callee (`function_call_id`, ...; `null` for none). The
    /// one call a bus implements: [`Bus::call`] is this with no metadata.
    async fn call_with_metadata(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Value,
    ) -> Result<Value, BusError>;

    /// Fire-and-forget call; failures are logged, never returned.
    async fn call_void(&self, function_id: &str, payload: Value);

    fn register_function(&self, def: FunctionDef, handler: Arc<dyn Handler>);

    /// Removes a function registered through this bus (a tool an MCP server stopped offering);
    /// true when it was there. A bus that cannot remove registrations keeps it and answers
    /// false, so a caller must also make the handler refuse once the function is gone.
    fn unregister_function(&self, function_id: &str) -> bool {
        let _ = function_id;
        false
    }

    /// Registers a function with, beside its JSON handler, an in-process handler taking the
    /// request's Rust type ([`crate::local`]). A bus that cannot call in-process (an engine)
    /// registers the JSON handler only.
    fn register_function_with_local(
        &self,
        def: FunctionDef,
        handler: Arc<dyn Handler>,
        local: Arc<dyn LocalHandler>,
    ) {
        let _ = local;
        self.register_function(def, handler);
    }

    /// The in-process handler of `function_id`, when the function registered on this bus has
    /// one; `None` means "call it with JSON".
    fn local_handler(&self, function_id: &str) -> Option<Arc<dyn LocalHandler>> {
        let _ = function_id;
        None
    }

    fn register_trigger_type(&self, def: TriggerTypeDef);

    /// The live bindings of a trigger type (rebuilt by the runtime after a restart).
    async fn bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError>;

    /// Ensures a queue exists and starts consuming it; fails loudly when it cannot be ensured.
    async fn define_queue(&self, def: QueueDef) -> Result<(), BusError>;

    /// Durably enqueues a call of `function_id` on `queue`.
    async fn enqueue(&self, queue: &str, function_id: &str, payload: Value)
        -> Result<(), BusError>;

    /// Appends an event to the bus's event log (what `GET /v1/sessions/{id}/events` serves). A
    /// repeated `dedupe_key` is a no-op, so a redelivered step can publish again safely.
    async fn publish(
        &self,
        topic: &str,
        payload: Value,
        dedupe_key: Option<String>,
    ) -> Result<(), BusError>;

    /// Resolves once every write issued through this bus so far is on stable storage. Where the
    /// backing store gives no such promise this is a no-op (documented per implementation).
    async fn barrier(&self) -> Result<(), BusError>;

    /// Applies `writes` in order and returns one answer per write (a call's answer, `null` for
    /// the others). A bus whose store has transactions applies the whole batch as one, all or
    /// nothing (the embedded bus: one commit, then one shared fsync at the next `barrier`). This
    /// default applies them one by one and stops at the first failure, leaving the earlier ones
    /// applied: exactly what the same calls made separately would do, so a caller's writes must
    /// stay idempotent either way.
    async fn commit(&self, writes: Vec<BusWrite>) -> Result<Vec<Value>, BusError> {
        commit_one_by_one(self, writes).await
    }

    // --- state, as the `state::*` functions -------------------------------------------------

    async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>, BusError> {
        let v = self
            .call("state::get", json!({"scope": scope, "key": key}), None)
            .await?;
        Ok(if v.is_null() { None } else { Some(v) })
    }

    /// [`Bus::state_get`] for a reader that only looks: a bus that keeps parsed values (the
    /// embedded store's cache) shares its copy instead of cloning it.
    async fn state_get_shared(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<Arc<Value>>, BusError> {
        Ok(self.state_get(scope, key).await?.map(Arc::new))
    }

    /// [`Bus::state_get`] as JSON text, for a reader that parses it into its own type: a bus
    /// that keeps the text (the embedded store) hands it over without building a `Value`.
    async fn state_get_text(&self, scope: &str, key: &str) -> Result<Option<Arc<str>>, BusError> {
        match self.state_get_shared(scope, key).await? {
            None => Ok(None),
            Some(v) => Ok(Some(to_text(&v)?.into())),
        }
    }

    /// [`Bus::state_set`] of a value already serialised as JSON text (see
    /// [`BusWrite::StateSetText`]).
    async fn state_set_text(&self, scope: &str, key: &str, text: String) -> Result<(), BusError> {
        self.state_set(scope, key, from_text(&text)?).await
    }

    async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
        self.call(
            "state::set",
            json!({"scope": scope, "key": key, "value": value}),
            None,
        )
        .await
        .map(|_| ())
    }

    async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
        self.call("state::delete", json!({"scope": scope, "key": key}), None)
            .await
            .map(|_| ())
    }

    /// Values of a scope, keys included as `{key, value}` pairs.
    async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        let v = self
            .call(
                "state::list",
                json!({"scope": scope, "with_keys": true}),
                None,
            )
            .await?;
        let items = v.as_array().cloned().unwrap_or_default();
        Ok(items
            .into_iter()
            .filter_map(|item| {
                let key = item.get("key")?.as_str()?.to_string();
                Some((key, item.get("value").cloned().unwrap_or(Value::Null)))
            })
            .collect())
    }
}

/// [`Bus::commit`]'s default: each write through its own bus method, in order, stopping at the
/// first failure.
pub async fn commit_one_by_one<B: Bus + ?Sized>(
    bus: &B,
    writes: Vec<BusWrite>,
) -> Result<Vec<Value>, BusError> {
    let mut out = Vec::with_capacity(writes.len());
    for w in writes {
        out.push(match w {
            BusWrite::Call {
                function_id,
                payload,
            } => bus.call(&function_id, payload, None).await?,
            BusWrite::Typed {
                function_id,
                request,
            } => bus.call(&function_id, request.to_value()?, None).await?,
            BusWrite::StateSet { scope, key, value } => {
                bus.state_set(&scope, &key, value).await?;
                Value::Null
            }
            BusWrite::StateSetText { scope, key, text } => {
                bus.state_set_text(&scope, &key, text).await?;
                Value::Null
            }
            BusWrite::StateDelete { scope, key } => {
                bus.state_delete(&scope, &key).await?;
                Value::Null
            }
            BusWrite::Enqueue {
                queue,
                function_id,
                payload,
            } => {
                bus.enqueue(&queue, &function_id, payload).await?;
                Value::Null
            }
            BusWrite::Publish {
                topic,
                payload,
                dedupe_key,
            } => {
                bus.publish(&topic, payload, dedupe_key).await?;
                Value::Null
            }
        });
    }
    Ok(out)
}

/// A value as the JSON text a store keeps.
pub(crate) fn to_text(value: &Value) -> Result<String, BusError> {
    serde_json::to_string(value).map_err(|e| BusError::internal(e.to_string()))
}

/// The value a [`BusWrite::StateSetText`] names, for a bus that stores values, not text.
fn from_text(text: &str) -> Result<Value, BusError> {
    serde_json::from_str(text)
        .map_err(|e| BusError::internal(format!("a state value is not JSON text: {e}")))
}
