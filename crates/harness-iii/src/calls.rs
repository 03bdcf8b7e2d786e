//! Calls: every call this worker makes ([`IiiBus::invoke`], and [`Engine`] for the engine's own
//! functions), calls to its own functions run in-process, the serving of a call the engine
//! delivers, and the frames of streaming calls in both directions.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_bus::{BusError, CallContext, FrameSink, FunctionDef, StreamingCall};
use iii_sdk::protocol::TriggerRequest;
use iii_sdk::runtime::IIIConnectionState;
use iii_sdk::TriggerAction;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use crate::bus::{IiiBus, Inner, FRAMES_PREFIX};
use crate::codec::strip_decoration;
use crate::error::from_sdk;
use crate::options::SelfCalls;
use crate::registry::{held, own_registry_change};

pub(crate) const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);
/// A call not answered within this is logged (it is still awaited up to its timeout).
const SLOW_CALL: Duration = Duration::from_secs(10);
const FRAME_BATCH: usize = 256;
/// How long a batch of frames may take to reach the caller's frame sink.
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// The metadata key naming the frame sink of a streaming call.
const STREAM_KEY: &str = "harness_stream";
/// How long an [`Engine`] call may take: a state operation, a publish, a listing of bindings.
const ENGINE_CALL: Duration = Duration::from_secs(30);
/// How long a lookup made while starting or ensuring the queue (registry, configuration) may
/// take.
const LOOKUP_CALL: Duration = Duration::from_secs(10);

tokio::task_local! {
    /// Set while a queued call runs in `deliver`: lets `invoke` end the whole delivery on a
    /// lost link instead of failing one call of it.
    pub(crate) static DELIVERY: Arc<watch::Sender<bool>>;
}

/// The caller side of streaming calls: stream id → the channel of its frames, and the function
/// those frames arrive at.
pub(crate) struct Calls {
    pub(crate) frames_fn: String,
    pub(crate) streams: Mutex<HashMap<String, FrameSink>>,
}

impl Calls {
    pub(crate) fn new() -> Calls {
        Calls {
            frames_fn: format!("{FRAMES_PREFIX}{}", uuid::Uuid::new_v4().simple()),
            streams: Mutex::new(HashMap::new()),
        }
    }
}

/// A plain call to one of the engine's (or its workers') own functions, as this worker makes
/// it: each knows its function id, its payload and its timeout, so the wire shape of each
/// lives in one place.
pub(crate) enum Engine<'a> {
    /// `state::get {scope, key}`.
    StateGet { scope: &'a str, key: &'a str },
    /// `state::set {scope, key, value}`.
    StateSet {
        scope: &'a str,
        key: &'a str,
        value: Value,
    },
    /// `state::delete {scope, key}`.
    StateDelete { scope: &'a str, key: &'a str },
    /// `state::update` with a request built by `fence`.
    StateUpdate(Value),
    /// `state::list {scope}`.
    StateList { scope: &'a str },
    /// `engine::functions::info {function_id}`.
    FunctionInfo(&'a str),
    /// `engine::functions::list` (always with `include_internal: true` at the call sites: the
    /// engine hides functions registered with `metadata.internal` unless asked, and most of
    /// ours are internal).
    Functions(Value),
    /// `engine::triggers::list {include_internal: true}`.
    TriggerTypes,
    /// `engine::registered-triggers::list {trigger_type, include_internal: true}`: the bindings
    /// of one trigger type.
    BindingsOf(&'a str),
    /// `engine::registered-triggers::list` with another filter.
    RegisteredTriggers(Value),
    /// `configuration::get {id}`.
    Configuration(&'a str),
    /// The queue worker's `queue::define`.
    DefineQueue(Value),
    /// `iii::durable::publish {topic, data}`.
    Publish { topic: &'a str, data: Value },
}

impl Engine<'_> {
    fn parts(self) -> (&'static str, Value, Duration) {
        match self {
            Engine::StateGet { scope, key } => (
                "state::get",
                json!({"scope": scope, "key": key}),
                ENGINE_CALL,
            ),
            Engine::StateSet { scope, key, value } => (
                "state::set",
                json!({"scope": scope, "key": key, "value": value}),
                ENGINE_CALL,
            ),
            Engine::StateDelete { scope, key } => (
                "state::delete",
                json!({"scope": scope, "key": key}),
                ENGINE_CALL,
            ),
            Engine::StateUpdate(request) => ("state::update", request, ENGINE_CALL),
            Engine::StateList { scope } => ("state::list", json!({"scope": scope}), ENGINE_CALL),
            Engine::FunctionInfo(function_id) => (
                "engine::functions::info",
                json!({ "function_id": function_id }),
                LOOKUP_CALL,
            ),
            Engine::Functions(request) => ("engine::functions::list", request, LOOKUP_CALL),
            Engine::TriggerTypes => (
                "engine::triggers::list",
                json!({"include_internal": true}),
                LOOKUP_CALL,
            ),
            Engine::BindingsOf(trigger_type) => (
                "engine::registered-triggers::list",
                json!({"trigger_type": trigger_type, "include_internal": true}),
                ENGINE_CALL,
            ),
            Engine::RegisteredTriggers(request) => {
                ("engine::registered-triggers::list", request, LOOKUP_CALL)
            }
            Engine::Configuration(id) => ("configuration::get", json!({ "id": id }), LOOKUP_CALL),
            Engine::DefineQueue(request) => {
                (crate::provider::DEFINE_FUNCTION, request, ENGINE_CALL)
            }
            Engine::Publish { topic, data } => (
                "iii::durable::publish",
                json!({"topic": topic, "data": data}),
                ENGINE_CALL,
            ),
        }
    }
}

/// A call to one of this worker's own functions, run in-process (see `IiiBus::serves`).
struct LocalCall<'a> {
    function_id: &'a str,
    payload: Value,
    timeout: Duration,
    metadata: Option<Value>,
    /// A streaming caller's own channel.
    frames: Option<FrameSink>,
}

impl IiiBus {
    /// Makes one [`Engine`] call.
    pub(crate) async fn engine(&self, call: Engine<'_>) -> Result<Value, BusError> {
        let (function_id, payload, timeout) = call.parts();
        self.invoke(function_id, payload, Some(timeout), None, None)
            .await
    }

    // --- calls ------------------------------------------------------------------------------

    pub(crate) async fn invoke(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Option<Value>,
        action: Option<TriggerAction>,
    ) -> Result<Value, BusError> {
        let timeout = timeout.unwrap_or(DEFAULT_CALL_TIMEOUT);
        let ms = timeout.as_millis() as u64;
        if self.inner.link.closing.load(Ordering::SeqCst) {
            // A step still running on a bus that was shut down (the bench closes one per
            // phase): the SDK would drop the call without a word and wait out its timeout.
            if let Ok(lose) = DELIVERY.try_with(Arc::clone) {
                let _ = lose.send(true);
                return std::future::pending().await;
            }
            return Err(BusError::new(
                "not_connected",
                format!("{function_id}: this worker's link to the iii engine was shut down"),
            ));
        }
        // A plain call to a function this worker serves runs here: the engine would only route
        // it straight back (and now and then never answered such a call; docs/iii-engine.md).
        // Trigger actions (enqueue, void) keep going through the engine.
        if action.is_none() && self.serves(function_id) {
            return self
                .in_process(LocalCall {
                    function_id,
                    payload,
                    timeout,
                    metadata,
                    frames: None,
                })
                .await;
        }
        let mut lost = self.inner.link.disconnects.subscribe();
        lost.borrow_and_update();
        let delivery = DELIVERY.try_with(Arc::clone).ok();
        if action.is_none() && self.inner.local(function_id).is_some() {
            tracing::debug!(function = %function_id, self_calls = ?self.inner.opts.self_calls, "a call to this worker's own function goes through the engine");
        }
        let req = TriggerRequest {
            function_id: function_id.to_string(),
            payload,
            action,
            timeout_ms: Some(ms),
        };
        let call = async {
            let call = async {
                match metadata {
                    Some(m) => self.inner.client.trigger(req.metadata(m)).await,
                    None => self.inner.client.trigger(req).await,
                }
            };
            tokio::pin!(call);
            // An unanswered call is otherwise silent until its timeout (300 s by default):
            // say which one it is.
            tokio::select! {
                r = &mut call => r,
                _ = tokio::time::sleep(SLOW_CALL) => {
                    tracing::warn!(function = %function_id, "no answer from the iii engine after {} s; still waiting (timeout {ms} ms)", SLOW_CALL.as_secs());
                    call.await
                }
            }
        };
        if let Some(lose) = delivery {
            // Never hand the step an error it would act on (close the call as timed out, fail
            // the generation): the delivery is ended where it stands (see `deliver`).
            let result = tokio::select! {
                r = call => r,
                _ = lost.changed() => Err(iii_sdk::Error::NotConnected),
            };
            return match result {
                Err(iii_sdk::Error::NotConnected) => {
                    let _ = lose.send(true);
                    std::future::pending().await
                }
                r => r.map_err(|e| from_sdk(function_id, ms, e)),
            };
        }
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
            .local(function_id)
            .ok_or_else(|| BusError::function_not_found(function_id))?;
        let fut = local.handler.call(payload, ctx);
        match inner.rt.spawn(fut).await {
            Ok(r) => r,
            Err(_) => Err(BusError::internal(format!(
                "{function_id} panicked while handling the call"
            ))),
        }
    }

    /// Whether a call to `function_id` runs in-process (see the crate docs): this worker
    /// registered it, the engine lists it as this worker's (so it would route the call right
    /// back here), and the worker serves right now — link up and reconciled, not deposed, not
    /// closing, and a public function only once it is open and ready. Otherwise the call goes
    /// through the engine, which answers exactly as before (`function_not_found` for a function
    /// still held back, `harness/starting`, the answer of the worker that owns it, ...).
    pub(crate) fn serves(&self, function_id: &str) -> bool {
        let inner = &self.inner;
        if inner.opts.self_calls != SelfCalls::InProcess
            || inner.link.closing.load(Ordering::SeqCst)
            || *inner.link.deposed.borrow()
            || !*inner.link.settled.borrow()
        {
            return false;
        }
        let gated = {
            let registry = inner.registry();
            match registry.get(function_id) {
                Some(l) if registry.serves(function_id) => held(&l.def),
                _ => return false,
            }
        };
        if gated
            && !(inner.link.opened.load(Ordering::SeqCst)
                && inner.link.ready.load(Ordering::SeqCst))
        {
            return false;
        }
        inner.client.get_connection_state() == IIIConnectionState::Connected
    }

    /// [`IiiBus::call_in_process`] as the caller sees it: inside a delivery, as for a routed
    /// call, a lost link ends the delivery where it stands rather than handing the step an
    /// answer it would act on (see `invoke`).
    async fn in_process(&self, call: LocalCall<'_>) -> Result<Value, BusError> {
        let mut lost = self.inner.link.disconnects.subscribe();
        lost.borrow_and_update();
        let call = self.call_in_process(call);
        let Ok(lose) = DELIVERY.try_with(Arc::clone) else {
            return call.await;
        };
        tokio::select! {
            r = call => r,
            _ = lost.changed() => {
                let _ = lose.send(true);
                std::future::pending().await
            }
        }
    }

    /// A call to a function this worker serves, run in-process: the handler gets what the
    /// engine would have delivered (`serve`: the same payload without decoration, the same
    /// metadata, the same gate) and runs as a routed call's handler does, as its own task that
    /// outlives a caller who stopped waiting. The caller's side is a routed call's: the same
    /// timeout and error. A streaming call's frames go straight to the caller's channel.
    async fn call_in_process(&self, call: LocalCall<'_>) -> Result<Value, BusError> {
        let LocalCall {
            function_id,
            payload,
            timeout,
            metadata,
            frames,
        } = call;
        let gated = match self.inner.local(function_id) {
            Some(l) => held(&l.def),
            None => return Err(BusError::function_not_found(function_id)),
        };
        let serve = IiiBus::serve(&self.inner, function_id, gated, payload, metadata, frames);
        match tokio::time::timeout(timeout, serve).await {
            Ok(r) => r,
            Err(_) => Err(BusError::timeout(function_id, timeout.as_millis() as u64)),
        }
    }

    /// Serves one call of a function registered here, as the engine delivers it (payload and
    /// metadata as routed; a streaming caller's frames are forwarded to its frame sink) or
    /// in-process (`frames`: the caller's own channel).
    pub(crate) async fn serve(
        inner: &Arc<Inner>,
        function_id: &str,
        gated: bool,
        payload: Value,
        metadata: Option<Value>,
        frames: Option<FrameSink>,
    ) -> Result<Value, BusError> {
        if gated && !inner.link.ready.load(Ordering::SeqCst) {
            return Err(starting());
        }
        let payload = strip_decoration(payload);
        if own_registry_change(inner, &payload) {
            return Ok(json!({"ok": true}));
        }
        let mut metadata = metadata.map(strip_decoration).unwrap_or(Value::Null);
        let stream = metadata.as_object_mut().and_then(|m| m.remove(STREAM_KEY));
        let (frames, forwarder) = match (frames, stream) {
            (Some(sink), _) => (Some(sink), None),
            (None, Some(s)) => match (s["function_id"].as_str(), s["stream_id"].as_str()) {
                (Some(f), Some(id)) => {
                    let (sink, task) =
                        IiiBus::frame_forwarder(inner, f.to_string(), id.to_string());
                    (Some(sink), Some(task))
                }
                _ => (None, None),
            },
            (None, None) => (None, None),
        };
        let ctx = CallContext { frames, metadata };
        let result = IiiBus::run_local(inner, function_id, payload, ctx).await;
        // Every frame reaches the caller before the answer does.
        if let Some(task) = forwarder {
            let _ = task.await;
        }
        result
    }

    // --- streaming frames -------------------------------------------------------------------

    /// The caller's end: frames of every streaming call this process made arrive here.
    pub(crate) fn register_frames_sink(&self) {
        let weak = Arc::downgrade(&self.inner);
        let def = FunctionDef::new(
            self.inner.calls.frames_fn.clone(),
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
                    .calls
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
        self.add_function(def, Arc::new(handler));
    }

    /// The callee's end: a sink whose frames are sent, in order, to the caller's frame function.
    /// Returns the sink and the task that drains it (awaited before the call answers).
    fn frame_forwarder(
        inner: &Arc<Inner>,
        target: String,
        stream_id: String,
    ) -> (FrameSink, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Value>();
        let bus = IiiBus {
            inner: inner.clone(),
        };
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
                let payload = json!({"stream_id": stream_id, "seq": seq, "frames": batch});
                let sent = if bus.serves(&target) {
                    // This worker's own frame sink (a streaming call it made that went
                    // through the engine): no need to go out and back for the frames.
                    bus.call_in_process(LocalCall {
                        function_id: &target,
                        payload,
                        timeout: FRAME_TIMEOUT,
                        metadata: None,
                        frames: None,
                    })
                        .await
                        .map_err(|e| e.to_string())
                } else {
                    let req = TriggerRequest {
                        function_id: target.clone(),
                        payload,
                        action: None,
                        timeout_ms: Some(FRAME_TIMEOUT.as_millis() as u64),
                    };
                    bus.inner.client.trigger(req).await.map_err(|e| e.to_string())
                };
                match sent {
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

    // --- the Bus's calls ---------------------------------------------------------------------

    /// `Bus::call_streaming`.
    pub(crate) async fn stream_call(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<StreamingCall, BusError> {
        let (tx, rx) = mpsc::unbounded_channel();
        if self.serves(function_id) {
            // The handler's frames go straight into the caller's channel.
            let bus = self.clone();
            let function_id = function_id.to_string();
            let timeout = timeout.unwrap_or(DEFAULT_CALL_TIMEOUT);
            let result = Box::pin(async move {
                // A routed streaming call's metadata, once its frame sink is taken out.
                let metadata = Some(json!({}));
                bus.in_process(LocalCall {
                    function_id: &function_id,
                    payload,
                    timeout,
                    metadata,
                    frames: Some(tx),
                })
                .await
            });
            return Ok(StreamingCall { frames: rx, result });
        }
        let stream_id = uuid::Uuid::new_v4().simple().to_string();
        self.inner
            .calls
            .streams
            .lock()
            .expect("streams lock")
            .insert(stream_id.clone(), tx);
        let bus = self.clone();
        let function_id = function_id.to_string();
        let metadata = json!({STREAM_KEY: {"function_id": self.inner.calls.frames_fn, "stream_id": stream_id}});
        let result = Box::pin(async move {
            let r = bus
                .invoke(&function_id, payload, timeout, Some(metadata), None)
                .await;
            // The callee finished sending its frames before it answered: closing the channel
            // now loses nothing and ends the reader's loop.
            bus.inner
                .calls
                .streams
                .lock()
                .expect("streams lock")
                .remove(&stream_id);
            r
        });
        Ok(StreamingCall { frames: rx, result })
    }

    /// `Bus::call_void`.
    pub(crate) async fn fire(&self, function_id: &str, payload: Value) {
        if let Err(e) = self
            .invoke(function_id, payload, None, None, Some(TriggerAction::Void))
            .await
        {
            tracing::warn!(function = %function_id, "fire-and-forget call failed: {e}");
        }
    }
}

/// The answer of a public function while the worker cannot serve it yet.
pub(crate) fn starting() -> BusError {
    BusError::new(
        "harness/starting",
        "the harness worker is starting (ensuring its queue, siblings and bindings on the engine); retry shortly",
    )
}
