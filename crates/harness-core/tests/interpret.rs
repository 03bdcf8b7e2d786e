//! The interpreter batches a run's plain writes: a step's notices, its record and its next step
//! go to the store as one write, not one each.

mod support;

use harness_core::HarnessConfig;
use harness_types::api::TurnStatus;
use refusing::Refusing;
use serde_json::{json, Value};
use support::*;

/// After one turn on another session: what starting the runtime writes is not counted.
async fn warmed(rt: &Rt) -> u64 {
    let r = rt.harness.send(send("warm up")).await.unwrap();
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    rt.writes_once_idle().await
}

/// No partial writes of a streamed reply, no usage announcements: only the loop's own writes.
fn quiet() -> HarnessConfig {
    HarnessConfig {
        stream_coalesce_ms: 60_000,
        usage_reporting: false,
        ..config()
    }
}

#[tokio::test]
async fn a_reply_the_provider_cut_is_resumed_with_its_notice_record_and_step_in_one_write() {
    // Stateless (`repeat`): the resumed request ends on the resume marker, not on "q", so the
    // script needs no durable assignment (which would be a store write of the provider's).
    let script = json!({"generations": [
        {"repeat": true, "match": {"last_user_text": "^q$"},
         "error": {"kind": "transient", "message": "upstream reset", "after_text": "Partial answer "}},
        {"repeat": true, "content": [{"type": "text", "text": "Complete answer."}]}
    ]});
    let rt = runtime(script, quiet()).await;
    harness_session::register_transactional(&rt.bus, &rt.sessions);
    let before = warmed(&rt).await;
    let r = rt.harness.send(send("q")).await.unwrap();
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!((s.status, s.transient_resumes), (TurnStatus::Completed, 1));
    let writes = rt.writes_once_idle().await - before;
    // The new session: 1. The send (message, record, first step): 1. Each of the two steps:
    // its start (status, event, assistant entry) held back and written with its end (the cut
    // answer with the recovery notice, the record and the next step; then the terminal
    // batch), its ack: 2 each. Written one by one (before the interpreter), the cut step's
    // answer, its notice and its advance were three writes, and each step's start one more:
    // 10 in all.
    assert_eq!(writes, 6, "{writes} store writes for a resumed turn");
    let recovering = rt
        .entries(&r.session_id)
        .into_iter()
        .filter(|e| {
            e.custom
                .as_ref()
                .is_some_and(|c| c.data["status"] == "recovering")
        })
        .count();
    assert_eq!(recovering, 1, "the notice is written, once");
}

/// The store writes of a turn whose first step calls a function and whose second step is
/// allowed (`max_turns: 2`) or not (`max_turns: 1`).
async fn turn_writes(max_turns: u32) -> (u64, harness_types::api::StatusReport) {
    // Used once each (a durable assignment per generation: one write of the provider's).
    let script = json!({"generations": [
        call_gen("go", "c1", "t::f", json!({})),
        {"content": [{"type": "text", "text": "done"}]}
    ]});
    let rt = runtime(script, quiet()).await;
    harness_session::register_transactional(&rt.bus, &rt.sessions);
    rt.register("t::f", None, |_| json!({"ok": true}));
    let before = rt.writes_once_idle().await;
    let mut req = allowing_as("go", &["t::*"], harness_types::api::ExposeMode::Native);
    req.options.as_mut().unwrap().max_turns = Some(max_turns);
    let r = rt.harness.send(req).await.unwrap();
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    (rt.writes_once_idle().await - before, s)
}

#[tokio::test]
async fn a_step_past_max_turns_writes_its_notice_with_the_terminal_record() {
    let (capped, s) = turn_writes(1).await;
    assert_eq!(s.stop_reason.as_deref(), Some("max_turns"));
    let (free, s) = turn_writes(2).await;
    assert_eq!(
        (s.status, s.result),
        (TurnStatus::Completed, Some(json!("done")))
    );
    // The same first step either way. The second: with room, its start (held back) and end
    // as one batch and its ack, plus the provider's assignment of the second generation (3);
    // past `max_turns`, the status, the notice and the terminal record as one batch, and its
    // ack (2). Written one by one (before the interpreter), the capped step's status and
    // notice were two writes of their own, and both turns wrote as much.
    assert_eq!(free - capped, 1, "capped {capped}, free {free}");
}

/// The store writes of a turn whose one call waits for the test; `steer` sends a message while
/// it runs.
async fn steered_writes(steer: bool) -> u64 {
    // Each used once, in order, either way (one assignment write of the provider's each).
    let script = json!({"generations": [
        call_gen("start", "c1", "job::wait", json!({})),
        {"content": [{"type": "text", "text": "done"}]}
    ]});
    let rt = runtime(script, quiet()).await;
    harness_session::register_transactional(&rt.bus, &rt.sessions);
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    {
        let (gate, started) = (gate.clone(), started.clone());
        rt.register_async("job::wait", None, move |_| {
            let (gate, started) = (gate.clone(), started.clone());
            async move {
                started.notify_one();
                gate.notified().await;
                json!({"finished": true})
            }
        });
    }
    let before = rt.writes_once_idle().await;
    let req = allowing_as("start", &["job::*"], harness_types::api::ExposeMode::Native);
    let r = rt.harness.send(req).await.unwrap();
    started.notified().await;
    if steer {
        let mut more = send("and one more thing");
        more.session_id = Some(r.session_id.clone());
        let answer = rt.harness.send(more).await.unwrap();
        assert_eq!(answer.queued, Some(true));
    }
    gate.notify_one();
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    rt.writes_once_idle().await - before
}

#[tokio::test]
async fn a_steering_message_is_delivered_with_the_removal_of_its_row_in_one_write() {
    let plain = steered_writes(false).await;
    let steered = steered_writes(true).await;
    // Parking the message is its row and the `message-queued` event (2); the next step's
    // drain appends it and removes the row in one write (1). One by one, the drain was two.
    assert_eq!(steered - plain, 3, "plain {plain}, steered {steered}");
}

/// The embedded bus, with the first `refuse` commits that queue a turn's step refused (as a
/// busy disk or a restarting engine would), and the reads of each hook chain counted.
mod refusing {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use harness_bus::local::LocalHandler;
    use harness_bus::{
        Binding, Bus, BusError, BusWrite, FunctionDef, Handler, QueueDef, StreamingCall,
        TriggerTypeDef,
    };
    use serde_json::Value;

    pub struct Refusing {
        pub inner: Arc<dyn Bus>,
        pub refuse: AtomicUsize,
        pub refused: AtomicUsize,
        /// Reads of the bindings of each hook point, by point.
        pub hook_reads: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    }

    impl Refusing {
        pub fn over(inner: Arc<dyn Bus>) -> Refusing {
            Refusing {
                inner,
                refuse: AtomicUsize::new(0),
                refused: AtomicUsize::new(0),
                hook_reads: Default::default(),
            }
        }

        pub fn count(n: &AtomicUsize) -> usize {
            n.load(Ordering::SeqCst)
        }
    }

    #[async_trait::async_trait]
    impl Bus for Refusing {
        async fn call_with_metadata(
            &self,
            function_id: &str,
            payload: Value,
            timeout: Option<Duration>,
            metadata: Value,
        ) -> Result<Value, BusError> {
            self.inner
                .call_with_metadata(function_id, payload, timeout, metadata)
                .await
        }
        async fn call_streaming(
            &self,
            function_id: &str,
            payload: Value,
            timeout: Option<Duration>,
        ) -> Result<StreamingCall, BusError> {
            self.inner
                .call_streaming(function_id, payload, timeout)
                .await
        }
        async fn call_void(&self, function_id: &str, payload: Value) {
            self.inner.call_void(function_id, payload).await
        }
        fn register_function(&self, def: FunctionDef, handler: Arc<dyn Handler>) {
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
            self.inner.local_handler(function_id)
        }
        fn register_trigger_type(&self, def: TriggerTypeDef) {
            self.inner.register_trigger_type(def)
        }
        async fn bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError> {
            if let Some(point) = trigger_type.strip_prefix("harness::hook::") {
                *self
                    .hook_reads
                    .lock()
                    .unwrap()
                    .entry(point.to_string())
                    .or_default() += 1;
            }
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
            self.inner.enqueue(queue, function_id, payload).await
        }
        async fn publish(
            &self,
            topic: &str,
            payload: Value,
            dedupe_key: Option<String>,
        ) -> Result<(), BusError> {
            self.inner.publish(topic, payload, dedupe_key).await
        }
        async fn barrier(&self) -> Result<(), BusError> {
            self.inner.barrier().await
        }
        async fn commit(&self, writes: Vec<BusWrite>) -> Result<Vec<Value>, BusError> {
            let schedules = writes.iter().any(|w| {
                matches!(w, BusWrite::Enqueue { queue, .. } if queue == harness_core::TURN_QUEUE)
            });
            let refuse = schedules
                && self
                    .refuse
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
            if refuse {
                self.refused.fetch_add(1, Ordering::SeqCst);
                return Err(BusError::internal("refused by the test"));
            }
            self.inner.commit(writes).await
        }
        async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>, BusError> {
            self.inner.state_get(scope, key).await
        }
        async fn state_get_shared(
            &self,
            scope: &str,
            key: &str,
        ) -> Result<Option<Arc<Value>>, BusError> {
            self.inner.state_get_shared(scope, key).await
        }
        async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
            self.inner.state_set(scope, key, value).await
        }
        async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
            self.inner.state_delete(scope, key).await
        }
        async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
            self.inner.state_list(scope).await
        }
    }
}

/// A loop over [`Refusing`] whose model calls `t::f` (held by a pre-trigger hook) on "go" (and
/// once more on "second", for a turn of another session), then answers "done"; a hook that lets everything pass is bound before the turn, before and after
/// each generation and after the turn. Answers the loop, the bus it runs on, the runs of `t::f`,
/// and the store (kept open).
async fn held_call_loop() -> (
    harness_core::Harness,
    std::sync::Arc<Refusing>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    support::embedded::Embedded,
) {
    use harness_bus::Bus;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let e = support::embedded::embedded().await;
    let script = json!({"generations": [
        call_gen("go", "c1", "t::f", json!({})),
        call_gen("^second$", "c1", "t::f", json!({})),
        text_gen("done"),
        text_gen("done"),
    ]});
    let router = harness_router::Router::new();
    router.add_provider(Arc::new(support::embedded::scripted(&script, &e.shared)));
    harness_router::register(e.shared.as_ref(), &router);
    let ran = Arc::new(AtomicUsize::new(0));
    let runs = ran.clone();
    let answer = |v: Value| {
        move |_p: Value, _ctx: harness_bus::CallContext| {
            let v = v.clone();
            async move { Ok(v) }
        }
    };
    e.bus.register_function(
        harness_bus::FunctionDef::new("t::f", "counts its runs"),
        Arc::new(move |_p: Value, _ctx: harness_bus::CallContext| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok(json!({"ok": true})) }
        }),
    );
    let bus = Arc::new(Refusing::over(e.shared.clone()));
    let harness = support::embedded::start_loop(bus.clone(), config()).await;
    // Bound once the loop has registered the hook points: `guard::hold` holds every call,
    // `guard::pass` lets everything else pass.
    for (id, decision) in [("guard::hold", "hold"), ("guard::pass", "continue")] {
        e.bus.register_function(
            harness_bus::FunctionDef::new(id, "test hook"),
            Arc::new(answer(json!({ "decision": decision }))),
        );
    }
    for (id, point) in [
        ("guard::hold", "pre-trigger"),
        ("guard::pass", "pre-turn"),
        ("guard::pass", "pre-generate"),
        ("guard::pass", "post-generate"),
        ("guard::pass", "post-turn"),
    ] {
        e.bus
            .call(
                "engine::register_trigger",
                json!({"trigger_type": format!("harness::hook::{point}"), "function_id": id, "config": {}}),
                None,
            )
            .await
            .unwrap();
    }
    (harness, bus, ran, e)
}

/// A turn of [`held_call_loop`] parked on its held call, released with the commits of its
/// advance refused `refusals` times: the loop, its bus, the runs of `t::f`, the store, the
/// send's answer and the release's.
async fn released_with_refusals(
    refusals: usize,
) -> (
    harness_core::Harness,
    std::sync::Arc<Refusing>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    support::embedded::Embedded,
    harness_types::api::SendResponse,
    Result<harness_types::api::ResolveResponse, harness_types::HarnessError>,
) {
    let (harness, bus, ran, e) = held_call_loop().await;
    let (r, out) = release_refused(&harness, &bus, "go", refusals).await;
    (harness, bus, ran, e, r, out)
}

/// A new session's turn on `harness` (its message `text`) parked on its held call, then released with the commits of its
/// advance refused `refusals` times: the send's answer and the release's.
async fn release_refused(
    harness: &harness_core::Harness,
    bus: &Refusing,
    text: &str,
    refusals: usize,
) -> (
    harness_types::api::SendResponse,
    Result<harness_types::api::ResolveResponse, harness_types::HarnessError>,
) {
    let r = harness
        .send(allowing_as(
            text,
            &["t::*"],
            harness_types::api::ExposeMode::Native,
        ))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !support::embedded::status(harness, &r.session_id)
        .await
        .is_some_and(|s| s.status == TurnStatus::AwaitingFunctions)
    {
        assert!(std::time::Instant::now() < deadline, "never parked");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    bus.refuse
        .store(refusals, std::sync::atomic::Ordering::SeqCst);
    let out = harness
        .resolve(harness_types::api::ResolveRequest {
            session_id: r.session_id.clone(),
            turn_id: r.turn_id.clone(),
            function_call_id: "c1".into(),
            action: Some(harness_types::api::ResolveAction::Execute),
            content: None,
            is_error: None,
            details: None,
            fs_scope: None,
        })
        .await;
    (r, out)
}

/// The released turn runs on to its end with the target's answer, and the target ran once
/// however many times the advance after it was refused.
async fn completes_having_run_the_target_once(
    harness: &harness_core::Harness,
    r: &harness_types::api::SendResponse,
    ran: &std::sync::atomic::AtomicUsize,
) {
    let s = support::embedded::wait_turn_end(harness, &r.session_id, &r.turn_id).await;
    assert_eq!(
        (s.status, s.result),
        (TurnStatus::Completed, Some(json!("done")))
    );
    let runs = ran.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(runs, 1, "the target ran once");
}

#[tokio::test]
async fn a_released_call_whose_advance_is_refused_twice_still_runs_the_turn_on() {
    // Refused twice, written on the third try.
    let (harness, bus, ran, _e, r, out) = released_with_refusals(2).await;
    let out = out.unwrap();
    assert!(out.resolved && out.turn_resumed, "{out:?}");
    assert_eq!(Refusing::count(&bus.refused), 2);
    completes_having_run_the_target_once(&harness, &r, &ran).await;
}

#[tokio::test]
async fn a_settled_turn_refused_past_the_retries_runs_on_at_the_next_sweep() {
    let (harness, bus, ran, _e, r, out) = released_with_refusals(6).await;
    assert!(out.is_err(), "every try refused: {out:?}");
    assert_eq!(Refusing::count(&bus.refused), 6);
    let s = support::embedded::status(&harness, &r.session_id)
        .await
        .unwrap();
    assert_eq!(s.status, TurnStatus::AwaitingFunctions, "still parked");
    harness
        .sweep_pending(harness_types::api::SweepRequest { scheduled_at: None })
        .await
        .unwrap();
    completes_having_run_the_target_once(&harness, &r, &ran).await;
}

/// While the store refuses writes, one sweep pays the retries for one settled turn, not for
/// each: the others wait for the next sweep, which runs every one of them on.
#[tokio::test]
async fn a_sweep_stops_running_settled_turns_on_once_the_store_refuses() {
    let (harness, bus, ran, _e, a, out) = released_with_refusals(6).await;
    assert!(out.is_err(), "every try refused: {out:?}");
    let (b, out) = release_refused(&harness, &bus, "second", 6).await;
    assert!(out.is_err(), "every try refused: {out:?}");
    assert_eq!(Refusing::count(&bus.refused), 12);
    // Enough refusals for one turn's retries: a sweep that tried the second turn too would
    // write its advance.
    bus.refuse.store(6, std::sync::atomic::Ordering::SeqCst);
    let sweep = || harness.sweep_pending(harness_types::api::SweepRequest { scheduled_at: None });
    sweep().await.unwrap();
    assert_eq!(Refusing::count(&bus.refused), 18);
    for r in [&a, &b] {
        let s = support::embedded::status(&harness, &r.session_id)
            .await
            .unwrap();
        assert_eq!(s.status, TurnStatus::AwaitingFunctions, "still parked");
    }
    sweep().await.unwrap();
    for r in [&a, &b] {
        let s = support::embedded::wait_turn_end(&harness, &r.session_id, &r.turn_id).await;
        assert_eq!(
            (s.status, s.result),
            (TurnStatus::Completed, Some(json!("done")))
        );
    }
    assert_eq!(
        ran.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "each target ran once"
    );
}

#[tokio::test]
async fn a_one_step_turn_reads_each_hook_chain_it_runs_once() {
    let (harness, bus, _ran, _e) = held_call_loop().await;
    // No call: one step, whose start, generation (before and after) and end each pass one
    // bound hook.
    let r = harness.send(send("hello")).await.unwrap();
    let s = support::embedded::wait_turn_end(&harness, &r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    let reads = bus.hook_reads.lock().unwrap().clone();
    for point in ["pre-turn", "pre-generate", "post-generate", "post-turn"] {
        assert_eq!(reads.get(point), Some(&1), "{point}: {reads:?}");
    }
}
