//! An in-process runtime for loop tests: embedded bus, sessions, scripted router, the loop.

#![allow(dead_code)] // each test binary uses a different part of it

// By path, so the file resolves the same when this file is a test target of its own.
#[path = "support/embedded.rs"]
pub mod embedded;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_bus::EmbeddedBus;
use harness_core::{Harness, HarnessConfig};
use harness_router::scripted::ScriptedProvider;
use harness_router::Router;
use harness_session::SessionStore;
use harness_store::Store;
use harness_types::api::{ExposeMode, FunctionPolicy, SendOptions, SendRequest, StatusReport};
use harness_types::session::Entry;
use serde_json::{json, Value};

#[allow(unused_imports)] // each test binary uses a different part of it
pub use embedded::{call_gen, config, text_gen};
use embedded::{embedded, scripted};

pub struct Rt {
    pub harness: Harness,
    pub sessions: SessionStore,
    pub store: Store,
    pub bus: EmbeddedBus,
    pub recorder: Arc<Recorder>,
    _dir: tempfile::TempDir,
}

/// Records every `router::chat` request before the scripted provider answers it.
pub struct Recorder {
    inner: ScriptedProvider,
    pub seen: std::sync::Mutex<Vec<harness_types::router::ChatRequest>>,
    /// The fields beyond `ChatRequest` each request carried (prompt sections, cache intent).
    pub extras: std::sync::Mutex<Vec<harness_router::ChatExtras>>,
}

#[async_trait::async_trait]
impl harness_router::Provider for Recorder {
    fn id(&self) -> &str {
        "scripted"
    }

    async fn chat(
        &self,
        req: harness_types::router::ChatRequest,
        out: harness_router::FrameWriter,
        cancel: tokio_util::sync::CancellationToken,
    ) -> harness_types::router::ChatAck {
        self.seen.lock().unwrap().push(req.clone());
        self.extras
            .lock()
            .unwrap()
            .push(out.context().extras.clone());
        self.inner.chat(req, out, cancel).await
    }
}

/// A runtime whose model calls `function_id` (as `c1`, no arguments) on a user text matching
/// `matcher`, then answers `then`.
pub async fn calling(matcher: &str, function_id: &str, then: &str) -> Rt {
    runtime(
        json!({"generations": [call_gen(matcher, "c1", function_id, json!({})), text_gen(then)]}),
        config(),
    )
    .await
}

/// What a hook that rewrites the call a hook payload names answers: `decision`, with the
/// call's arguments and `key` set to `value` as the mutation.
pub fn rewriting(payload: &Value, decision: &str, key: &str, value: Value) -> Value {
    let mut args = payload["call"]["arguments"].clone();
    args[key] = value;
    json!({"decision": decision, "mutations": {"arguments": args}})
}

/// The string `field` of every element of the JSON array `list`, in order.
pub fn strings<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    let items = list
        .as_array()
        .unwrap_or_else(|| panic!("an array: {list}"));
    items.iter().map(|e| e[field].as_str().unwrap()).collect()
}

/// A runtime whose model answers every request with `reply`.
pub async fn replying(reply: &str) -> Rt {
    runtime(json!({"generations": [text(None, reply, 0)]}), config()).await
}

pub async fn runtime(script: Value, config: HarnessConfig) -> Rt {
    runtime_with(script, config, true).await
}

/// A runtime whose loop was never started (`start` defines the turn queue): every enqueue of a
/// step fails.
pub async fn unstarted_runtime(script: Value, config: HarnessConfig) -> Rt {
    runtime_with(script, config, false).await
}

async fn runtime_with(script: Value, config: HarnessConfig, start: bool) -> Rt {
    let e = embedded().await;
    let recorder = Arc::new(Recorder {
        inner: scripted(&script, &e.shared),
        seen: Default::default(),
        extras: Default::default(),
    });
    let router = Router::new();
    router.add_provider(recorder.clone());
    harness_router::register(e.shared.as_ref(), &router);
    let harness = Harness::new(e.shared, config);
    harness_core::register(&harness);
    if start {
        harness.start().await.unwrap();
    }
    Rt {
        harness,
        sessions: e.sessions,
        store: e.store,
        bus: e.bus,
        recorder,
        _dir: e.dir,
    }
}

/// [`send`] with the functions matching `allow` offered as native tools.
pub fn allowing(text: &str, allow: &[&str]) -> SendRequest {
    allowing_as(text, allow, ExposeMode::Native)
}

/// [`send`] with the functions matching `allow` offered as `expose` says.
pub fn allowing_as(text: &str, allow: &[&str], expose: ExposeMode) -> SendRequest {
    let mut req = send(text);
    req.options = Some(SendOptions {
        functions: Some(FunctionPolicy {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: vec![],
            expose,
        }),
        ..Default::default()
    });
    req
}

pub fn send(message: &str) -> SendRequest {
    SendRequest {
        message: json!(message),
        model: Some("m".into()),
        provider: Some("scripted".into()),
        ..Default::default()
    }
}

/// A generation that spawns a sub-agent with `arguments` when the last user text matches.
pub fn spawn_gen(matcher: &str, arguments: Value) -> Value {
    json!({"match": {"last_user_text": matcher},
           "content": [{"type": "function_call", "id": "s1", "function_id": "harness::spawn", "arguments": arguments}]})
}

/// A repeating text generation, streamed a chunk every `chunk_delay_ms`.
pub fn text(matcher: Option<&str>, text: &str, chunk_delay_ms: u64) -> Value {
    let mut g = json!({"repeat": true, "chunk_delay_ms": chunk_delay_ms, "content": [{"type": "text", "text": text}]});
    if let Some(m) = matcher {
        g["match"] = json!({ "last_user_text": m });
    }
    g
}

/// A send whose turn may spawn sub-agents (native tools).
pub fn orchestrating(message: &str) -> SendRequest {
    let mut req = send(message);
    req.options = Some(harness_types::api::SendOptions {
        functions: Some(harness_types::api::FunctionPolicy {
            allow: vec!["harness::spawn".into()],
            deny: vec![],
            expose: harness_types::api::ExposeMode::Native,
        }),
        ..Default::default()
    });
    req
}

/// A parent parked on the child it spawned with `arguments`; the child streams its answer
/// slowly (20 words, one every 200 ms), and the parent ends by saying `last`.
pub async fn parked_on_a_slow_child(
    arguments: Value,
    last: &str,
) -> (
    Rt,
    harness_types::api::SendResponse,
    harness_types::api::ChildRef,
) {
    let rt = runtime(
        json!({"generations": [
            spawn_gen("^research", arguments),
            text(Some("^dig deep"), "a b c d e f g h i j k l m n o p q r s t", 200),
            text(None, last, 0)
        ]}),
        config(),
    )
    .await;
    let r = rt.send_parked(orchestrating("research it")).await;
    let child = rt.status(&r.session_id).await.unwrap().children[0].clone();
    (rt, r, child)
}

/// A runtime where a turn planned a trip through one sub-agent, both finished: the parent's
/// send answer (its session has one child).
pub async fn trip_with_one_child() -> (Rt, harness_types::api::SendResponse) {
    let rt = runtime(
        json!({"generations": [
            spawn_gen("^plan the trip", json!({"task": "find flights to Oslo"})),
            text(Some("^find flights"), "Flight AB123 at 9:00", 0),
            text(None, "Booked: AB123", 0)
        ]}),
        config(),
    )
    .await;
    let (r, _) = rt.run(orchestrating("plan the trip")).await;
    (rt, r)
}

/// Waits (with a deadline) until `done` holds.
pub async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Rt {
    /// `harness::send`, which the test expects to be accepted.
    pub async fn send(&self, req: SendRequest) -> harness_types::api::SendResponse {
        self.harness.send(req).await.unwrap()
    }

    /// `harness::stop` of the session's current turn, which the test expects to be accepted.
    pub async fn stop(&self, session_id: &str) -> harness_types::api::StopResponse {
        self.harness
            .stop(harness_types::api::StopRequest {
                session_id: session_id.into(),
                turn_id: None,
            })
            .await
            .unwrap()
    }

    /// [`Rt::send`], then waits for the turn to end: the send's answer and the final status.
    pub async fn run(&self, req: SendRequest) -> (harness_types::api::SendResponse, StatusReport) {
        let r = self.send(req).await;
        let s = self.wait_terminal(&r.session_id, &r.turn_id).await;
        (r, s)
    }

    pub async fn status(&self, session_id: &str) -> Option<StatusReport> {
        embedded::status(&self.harness, session_id).await
    }

    /// Waits (with a deadline) until the session's turn `turn_id` is terminal.
    pub async fn wait_terminal(&self, session_id: &str, turn_id: &str) -> StatusReport {
        let s = embedded::wait_turn_end(&self.harness, session_id, turn_id).await;
        // The terminal side effects (records, event) follow the terminal write.
        self.completed_events(session_id, turn_id).await;
        s
    }

    /// Waits (with a deadline) for the turn's `harness::turn-completed`, which is published just
    /// after the terminal record is written; returns every such event of the session.
    pub async fn completed_events(&self, session_id: &str, turn_id: &str) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let events: Vec<Value> = self
                .topics(session_id)
                .into_iter()
                .filter(|(t, p)| t == "harness::turn-completed" && p["turn_id"] == turn_id)
                .map(|(_, p)| p)
                .collect();
            if !events.is_empty() {
                return events;
            }
            assert!(Instant::now() < deadline, "no turn-completed for {turn_id}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Registers an in-process function that counts its calls.
    pub fn register<F>(&self, id: &str, schema: Option<Value>, f: F) -> Arc<AtomicUsize>
    where
        F: Fn(Value) -> Value + Send + Sync + 'static,
    {
        self.register_async(id, schema, move |p| std::future::ready(f(p)))
    }

    /// [`Rt::register`] with an answer that is awaited: a test that holds a call open waits
    /// there without blocking a runtime thread (a sync handler that sleeps would stall the
    /// current-thread runtime the test itself runs on).
    pub fn register_async<F, Fut>(&self, id: &str, schema: Option<Value>, f: F) -> Arc<AtomicUsize>
    where
        F: Fn(Value) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Value> + Send + 'static,
    {
        use harness_bus::Bus;
        let count = Arc::new(AtomicUsize::new(0));
        let seen = count.clone();
        let f = Arc::new(f);
        let mut def = harness_bus::FunctionDef::new(id, "test function");
        def.request_schema = schema;
        self.bus.register_function(
            def,
            Arc::new(move |p: Value, _ctx: harness_bus::CallContext| {
                seen.fetch_add(1, Ordering::SeqCst);
                let out = f(p);
                async move { Ok(out.await) }
            }),
        );
        count
    }

    /// The function_result messages of a session.
    pub fn results(&self, session_id: &str) -> Vec<harness_types::message::FunctionResultMessage> {
        self.entries(session_id)
            .into_iter()
            .filter_map(|e| match e.message {
                Some(harness_types::AgentMessage::FunctionResult(f)) => Some(f),
                _ => None,
            })
            .collect()
    }

    pub fn entries(&self, session_id: &str) -> Vec<Entry> {
        self.sessions.all_entries(session_id, true).unwrap()
    }

    /// The ids of the session's entries, in order: what a test names to find a step's record.
    pub fn entry_ids(&self, session_id: &str) -> Vec<String> {
        self.entries(session_id)
            .into_iter()
            .map(|e| e.entry_id)
            .collect()
    }

    /// Calls `function_id` on the bus as the operator does; the call must succeed.
    pub async fn ok(&self, function_id: &str, payload: Value) -> Value {
        use harness_bus::Bus;
        self.bus
            .call(function_id, payload, None)
            .await
            .unwrap_or_else(|e| panic!("{function_id}: {e}"))
    }

    /// Calls `function_id` on the bus as the operator does; the call must fail. Its error as
    /// the harness words it (`harness/<code>: <message>`).
    pub async fn refused(&self, function_id: &str, payload: Value) -> String {
        use harness_bus::Bus;
        match self.bus.call(function_id, payload, None).await {
            Ok(v) => panic!("{function_id} should fail, answered {v}"),
            Err(e) => e.into_harness().to_string(),
        }
    }

    /// The session tree below `session_id`, as `harness::session-tree` answers it.
    pub async fn tree(&self, session_id: &str) -> harness_types::api::SessionTreeNode {
        self.harness
            .session_tree(harness_types::api::SessionTreeRequest {
                session_id: session_id.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("session tree of {session_id}: {e}"))
    }

    /// The data of the error record the turn of `r` ended with (`code`, `phase`, `detail`).
    pub fn error_record(&self, r: &harness_types::api::SendResponse) -> Value {
        let entry = self.entry(&r.session_id, &format!("e_{}_error", r.turn_id));
        entry
            .custom
            .unwrap_or_else(|| panic!("e_{}_error is no custom record", r.turn_id))
            .data
    }

    /// The entry `entry_id` of the session.
    pub fn entry(&self, session_id: &str, entry_id: &str) -> Entry {
        self.entries(session_id)
            .into_iter()
            .find(|e| e.entry_id == entry_id)
            .unwrap_or_else(|| panic!("no entry {entry_id} in {session_id}"))
    }

    /// Deletes the session tree of `session_id` and waits until the deletion completed.
    pub async fn delete_tree(&self, session_id: &str) {
        use harness_types::api::{DeleteTreeRequest, DeleteTreeStatusRequest, DeletionStatus};
        let op = self
            .harness
            .delete_session_tree(DeleteTreeRequest {
                session_id: session_id.into(),
                attempt: None,
            })
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = self
                .harness
                .delete_session_tree_status(DeleteTreeStatusRequest {
                    operation_id: op.operation_id.clone(),
                })
                .await
                .unwrap();
            if s.status != DeletionStatus::Deleting {
                assert_eq!(s.status, DeletionStatus::Completed, "{s:?}");
                return;
            }
            assert!(Instant::now() < deadline, "deletion never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// No session exists (nothing a refused request could have started).
    pub async fn assert_no_sessions(&self) {
        use harness_bus::Bus;
        let listed = self
            .bus
            .call("session::list", json!({}), None)
            .await
            .unwrap();
        assert_eq!(
            listed["sessions"].as_array().map(Vec::len),
            Some(0),
            "{listed}"
        );
    }

    /// Registers the hook function `id`, which records every payload it gets and answers
    /// `answer(payload)`; the record.
    pub fn hook<F>(&self, id: &str, answer: F) -> Arc<std::sync::Mutex<Vec<Value>>>
    where
        F: Fn(&Value) -> Value + Send + Sync + 'static,
    {
        use harness_bus::Bus;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let answer = Arc::new(answer);
        self.bus.register_function(
            harness_bus::FunctionDef::new(id, "test hook"),
            Arc::new(move |p: Value, _ctx: harness_bus::CallContext| {
                log.lock().unwrap().push(p.clone());
                let out = answer(&p);
                async move { Ok(out) }
            }),
        );
        seen
    }

    /// Binds `function_id` to the hook point `point` (`pre-trigger`, `post-generate`, …).
    pub async fn bind(&self, point: &str, function_id: &str, config: Value) {
        self.bind_with(point, function_id, config, json!({})).await
    }

    /// [`Rt::bind`] with the binding's `metadata` (an `inject_prompt`, …).
    pub async fn bind_with(&self, point: &str, function_id: &str, config: Value, metadata: Value) {
        let trigger_type = format!("harness::hook::{point}");
        self.trigger(&trigger_type, function_id, config, metadata)
            .await
    }

    /// Binds `function_id` to the trigger type `trigger_type` through `engine::register_trigger`.
    pub async fn trigger(
        &self,
        trigger_type: &str,
        function_id: &str,
        config: Value,
        metadata: Value,
    ) {
        use harness_bus::Bus;
        self.bus
            .call(
                "engine::register_trigger",
                json!({"trigger_type": trigger_type, "function_id": function_id, "config": config, "metadata": metadata}),
                None,
            )
            .await
            .unwrap();
    }

    /// Binds `guard::hold` to `pre-trigger`: every call `config` selects is held before its
    /// target runs, until a resolve settles it.
    pub async fn hold_calls(&self, config: Value) {
        self.hook("guard::hold", |_| json!({"decision": "hold"}));
        self.bind("pre-trigger", "guard::hold", config).await;
    }

    /// [`Rt::send`], then waits until the turn is parked on its calls.
    pub async fn send_parked(&self, req: SendRequest) -> harness_types::api::SendResponse {
        let r = self.send(req).await;
        self.wait_status(
            &r.session_id,
            harness_types::api::TurnStatus::AwaitingFunctions,
        )
        .await;
        r
    }

    /// Registers `router::abort` to raise the returned flag. A stop calls it right after it
    /// fired the turn's signal, so a raised flag means the signal has fired.
    pub fn watch_abort(&self) -> Arc<AtomicBool> {
        use harness_bus::Bus;
        let aborted = Arc::new(AtomicBool::new(false));
        let seen = aborted.clone();
        self.bus.register_function(
            harness_bus::FunctionDef::new("router::abort", "test abort"),
            Arc::new(move |_p: Value, _ctx: harness_bus::CallContext| {
                seen.store(true, Ordering::SeqCst);
                async move { Ok(json!({"aborted": false})) }
            }),
        );
        aborted
    }

    /// Registers the hook function `id`: for a payload `when` accepts, it stops the payload's
    /// session and answers `continue` once `fired` is raised (10 s at most). The stop runs in a
    /// task of its own, since it waits for the step this hook is part of.
    pub fn stopping_hook(&self, id: &str, fired: Arc<AtomicBool>, when: fn(&Value) -> bool) {
        use harness_bus::Bus;
        let harness = self.harness.clone();
        self.bus.register_function(
            harness_bus::FunctionDef::new(id, "test hook"),
            Arc::new(move |p: Value, _ctx: harness_bus::CallContext| {
                let harness = harness.clone();
                let fired = fired.clone();
                async move {
                    if when(&p) {
                        let session_id = p["session_id"].as_str().unwrap_or_default().to_string();
                        tokio::spawn(async move {
                            let _ = harness
                                .stop(harness_types::api::StopRequest {
                                    session_id,
                                    turn_id: None,
                                })
                                .await;
                        });
                        let deadline = Instant::now() + Duration::from_secs(10);
                        while !fired.load(Ordering::SeqCst) && Instant::now() < deadline {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                    Ok(json!({"decision": "continue"}))
                }
            }),
        );
    }

    /// Waits (with a deadline) until the session's current turn has `status`.
    pub async fn wait_status(&self, session_id: &str, status: harness_types::api::TurnStatus) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self
            .status(session_id)
            .await
            .is_some_and(|s| s.status == status)
        {
            assert!(Instant::now() < deadline, "never {status:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// `harness::resolve` of the call `call` of `r`'s turn with `action`.
    pub async fn resolve(
        &self,
        r: &harness_types::api::SendResponse,
        call: &str,
        action: harness_types::api::ResolveAction,
    ) -> harness_types::api::ResolveResponse {
        self.harness
            .resolve(harness_types::api::ResolveRequest {
                session_id: r.session_id.clone(),
                turn_id: r.turn_id.clone(),
                function_call_id: call.into(),
                action: Some(action),
                content: None,
                is_error: None,
                details: None,
                fs_scope: None,
            })
            .await
            .unwrap()
    }

    /// The content of the result of call `call`, as JSON text.
    pub fn result_text(&self, session_id: &str, call: &str) -> String {
        let r = self
            .results(session_id)
            .into_iter()
            .find(|r| r.function_call_id == call)
            .unwrap_or_else(|| panic!("no result for {call}"));
        serde_json::to_string(&r.content).unwrap()
    }

    /// The session's turn record as stored; `None` without one.
    pub async fn turn_record(&self, session_id: &str) -> Option<Value> {
        use harness_bus::Bus;
        self.bus
            .state_get(harness_core::TURN_SCOPE, session_id)
            .await
            .unwrap()
    }

    /// Overwrites the session's turn record (what an older version or a crash could leave).
    pub async fn set_turn_record(&self, session_id: &str, record: Value) {
        use harness_bus::Bus;
        self.bus
            .state_set(harness_core::TURN_SCOPE, session_id, record)
            .await
            .unwrap();
    }

    /// Enqueues step `step` of the turn, as the loop (or a queue's redelivery) would.
    pub async fn enqueue_step(&self, session_id: &str, turn_id: &str, step: u64) {
        use harness_bus::Bus;
        self.bus
            .enqueue(
                harness_core::TURN_QUEUE,
                "harness::turn",
                json!({"session_id": session_id, "turn_id": turn_id, "step": step, "depth": 0}),
            )
            .await
            .unwrap();
    }

    /// Waits (with a deadline) until the turn queue holds nothing.
    pub async fn until_queue_empty(&self) {
        until("the turn queue emptied", || {
            self.bus.queues().depth(harness_core::TURN_QUEUE) == 0
        })
        .await;
    }

    /// The store's write count once the turn queue is empty (a step's ack is the last write
    /// of a turn).
    pub async fn writes_once_idle(&self) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let queued: i64 = self
                .store
                .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM queue_messages", [], |r| r.get(0))?))
                .unwrap();
            if queued == 0 {
                return self.store.stats().writes;
            }
            assert!(Instant::now() < deadline, "the queue never emptied");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Checks that the session's first error record (a failed turn writes one) names `code` and
    /// `phase`; its detail.
    pub fn error_detail(&self, session_id: &str, code: &str, phase: &str) -> String {
        let error = self
            .entries(session_id)
            .into_iter()
            .find_map(|e| e.custom.filter(|c| c.custom_type == "error"))
            .unwrap_or_else(|| panic!("no error record in {session_id}"))
            .data;
        assert_eq!(
            (&error["code"], &error["phase"]),
            (&json!(code), &json!(phase))
        );
        error["detail"].as_str().unwrap_or_default().to_string()
    }

    /// `harness::sweep_pending` with the default request.
    pub async fn sweep(&self) -> harness_types::api::SweepResponse {
        self.harness
            .sweep_pending(harness_types::api::SweepRequest::default())
            .await
            .unwrap()
    }

    /// `(role, text)` of every message entry.
    pub fn messages(&self, session_id: &str) -> Vec<(String, String)> {
        self.entries(session_id)
            .into_iter()
            .filter_map(|e| e.message.map(|m| (m.role().to_string(), m.text())))
            .collect()
    }

    pub fn topics(&self, session_id: &str) -> Vec<(String, Value)> {
        self.store
            .events_after(session_id, 0, 10_000)
            .unwrap()
            .into_iter()
            .map(|r| (r.topic, r.payload))
            .collect()
    }
}

/// A direct spawn of `task` that names nothing else: each test sets the one field it is about.
pub fn spawning(task: &str) -> harness_types::api::SpawnRequest {
    harness_types::api::SpawnRequest {
        task: json!(task),
        model: None,
        provider: None,
        session_id: None,
        options: None,
        agent: None,
        display: None,
        parent_session_id: None,
    }
}
