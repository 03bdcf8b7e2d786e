//! Rows of the turn machine the other suites do not take: a stop while the model streams, a
//! message sent while a turn runs, the `max_turns` notice refused by a post-turn hook, a step
//! that fails on an unexpected error, and a settle that lands before the step that parked it.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_bus::{Bus, BusError, CallContext, EmbeddedBus, FunctionDef};
use harness_types::api::{ResolveAction, SendOptions, SendResponse, StopRequest, TurnStatus};
use serde_json::{json, Value};
use support::*;

/// A runtime whose model calls `x::f` (as `c1`) on "go", then answers `then`; how often
/// `x::f` ran.
async fn calling_f(then: &str) -> (Rt, Arc<AtomicUsize>) {
    let rt = calling("^go", "x::f", then).await;
    let runs = rt.register("x::f", None, |_| json!("ran"));
    (rt, runs)
}

/// [`calling_f`] with every call held: the turn parked on `c1`.
async fn parked_on_f(then: &str) -> (Rt, Arc<AtomicUsize>, SendResponse) {
    let (rt, runs) = calling_f(then).await;
    rt.hold_calls(json!({})).await;
    let r = rt.send_parked(allowing("go", &["x::*"])).await;
    (rt, runs, r)
}

/// A runtime whose model answers "talk" with `words` words, one every `delay_ms`; the send's
/// answer once the generation started.
async fn talking(words: usize, delay_ms: u64) -> (Rt, SendResponse) {
    let long = "word ".repeat(words);
    let rt = runtime(
        json!({"generations": [text(None, &long, delay_ms)]}),
        config(),
    )
    .await;
    let r = rt.send(send("talk")).await;
    until_generating(&rt).await;
    (rt, r)
}

/// Waits until the model was asked once.
async fn until_generating(rt: &Rt) {
    until("the generation started", || {
        !rt.recorder.seen.lock().unwrap().is_empty()
    })
    .await;
}

#[tokio::test]
async fn a_stop_while_the_model_streams_cancels_the_turn() {
    let (rt, r) = talking(400, 20).await;
    rt.harness
        .stop(StopRequest {
            session_id: r.session_id.clone(),
            turn_id: Some(r.turn_id.clone()),
        })
        .await
        .unwrap();
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
}

#[tokio::test]
async fn a_message_sent_while_the_model_streams_steers_the_same_turn() {
    let long = "word ".repeat(60);
    let rt = runtime(
        json!({"generations": [
            text(Some("^first"), &long, 20),
            text(Some("^second"), "heard the second", 0)
        ]}),
        config(),
    )
    .await;
    let a = rt.send(send("first")).await;
    until_generating(&rt).await;
    let mut second = send("second");
    second.session_id = Some(a.session_id.clone());
    let b = rt.send(second).await;
    assert_eq!(b.turn_id, a.turn_id, "the running turn takes it");
    let s = rt.wait_terminal(&a.session_id, &a.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("heard the second")));
}

#[tokio::test]
async fn the_max_turns_notice_refused_by_a_post_turn_hook_fails_the_turn_keeping_the_notice() {
    let (rt, _) = calling_f("never").await;
    rt.hook(
        "gate::never",
        |_| json!({"decision": "deny", "reason": "not good enough"}),
    );
    rt.bind("post-turn", "gate::never", json!({})).await;
    let mut req = allowing("go", &["x::*"]);
    req.options = Some(SendOptions {
        max_turns: Some(1),
        ..req.options.unwrap()
    });
    let (_, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Failed);
    let failure = s.failure.expect("a cause");
    assert_eq!(failure.code, "harness.output_contract_invalid");
    assert_eq!(rt.recorder.seen.lock().unwrap().len(), 1, "one generation");
}

#[tokio::test]
async fn a_step_delivered_again_while_its_turn_is_parked_changes_nothing() {
    let (rt, runs, r) = parked_on_f("finished").await;
    // The parked step, delivered again (a queue redelivers what was not acked in time); the
    // release's step comes after it in the session's FIFO.
    rt.enqueue_step(&r.session_id, &r.turn_id, 0).await;
    rt.until_queue_empty().await;
    assert_eq!(
        rt.status(&r.session_id).await.unwrap().status,
        TurnStatus::AwaitingFunctions,
        "still parked"
    );
    let out = rt.resolve(&r, "c1", ResolveAction::Execute).await;
    assert!(out.resolved);
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("finished")));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(rt.results(&r.session_id).len(), 1);
    assert_eq!(
        rt.recorder.seen.lock().unwrap().len(),
        2,
        "no extra generation"
    );
}

#[tokio::test]
async fn a_step_of_a_session_that_does_not_exist_is_dropped_without_a_trace() {
    let rt = runtime(json!({"generations": [text_gen("never")]}), config()).await;
    rt.bus
        .enqueue(
            harness_core::TURN_QUEUE,
            "harness::turn",
            json!({"session_id": "s_never_made", "turn_id": "t_x", "step": 3, "depth": 0}),
        )
        .await
        .unwrap();
    rt.until_queue_empty().await;
    assert!(
        rt.status("s_never_made").await.is_none(),
        "no turn was made up"
    );
    let record = rt.turn_record("s_never_made").await;
    assert_eq!(record, None);
    assert!(rt.recorder.seen.lock().unwrap().is_empty(), "no generation");
}

#[tokio::test]
async fn a_turn_record_lost_while_the_model_streams_is_not_written_back() {
    let (rt, r) = talking(100, 5).await;
    // A store that can lose recent writes (an iii engine's) dropped the record mid-stream.
    rt.bus
        .state_delete(harness_core::TURN_SCOPE, &r.session_id)
        .await
        .unwrap();
    rt.until_queue_empty().await;
    let record = rt.turn_record(&r.session_id).await;
    assert_eq!(record, None, "nothing rebuilt a record from the stream");
    assert_eq!(
        rt.recorder.seen.lock().unwrap().len(),
        1,
        "no second generation"
    );
}

#[tokio::test]
async fn a_running_record_marked_aborted_is_cancelled_by_its_next_step() {
    let (rt, _, r) = parked_on_f("finished").await;
    // What an earlier version could leave: the next step pending on a record marked aborted
    // but still running.
    let mut rec = rt.turn_record(&r.session_id).await.unwrap();
    rec["status"] = json!("running");
    rec["abort"] = json!(true);
    rec["step"] = json!(1);
    rt.set_turn_record(&r.session_id, rec).await;
    rt.enqueue_step(&r.session_id, &r.turn_id, 1).await;
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    assert_eq!(
        rt.recorder.seen.lock().unwrap().len(),
        1,
        "no generation after the abort"
    );
}

#[tokio::test]
async fn a_stop_landing_before_the_next_generation_cancels_without_asking_the_model() {
    let (rt, _) = calling_f("never").await;
    // Before the second generation, a pre-generate hook stops the turn and waits until the
    // stop has fired the turn's signal.
    let aborted = rt.watch_abort();
    rt.stopping_hook("stop::before", aborted.clone(), |p| p["step"] == 1);
    rt.bind("pre-generate", "stop::before", json!({})).await;
    let (_, s) = rt.run(allowing("go", &["x::*"])).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    assert!(aborted.load(Ordering::SeqCst), "the stop fired");
    assert_eq!(
        rt.recorder.seen.lock().unwrap().len(),
        1,
        "the model was not asked again"
    );
}

/// The turn record's status as stored, `None` without a record.
async fn stored_status(bus: &EmbeddedBus, session_id: &str) -> Option<String> {
    let rec = bus
        .state_get(harness_core::TURN_SCOPE, session_id)
        .await
        .unwrap()?;
    rec["status"].as_str().map(str::to_string)
}

/// Polls the stored record until its status is `want`, for at most `limit`.
async fn until_stored(bus: &EmbeddedBus, session_id: &str, want: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if stored_status(bus, session_id).await.as_deref() == Some(want) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

/// Registers `function_id` to answer `answer()` once the stored record of `session_id` is
/// cancelled (or `limit` passed); the flag it raises when called.
fn answering_once_cancelled(
    rt: &Rt,
    function_id: &str,
    session_id: &'static str,
    limit: Duration,
    answer: fn() -> Result<Value, BusError>,
) -> Arc<AtomicBool> {
    let called = Arc::new(AtomicBool::new(false));
    let seen = called.clone();
    let bus = rt.bus.clone();
    rt.bus.register_function(
        FunctionDef::new(function_id, "answers once the turn is cancelled"),
        Arc::new(move |_p: Value, _ctx: CallContext| {
            seen.store(true, Ordering::SeqCst);
            let bus = bus.clone();
            async move {
                until_stored(&bus, session_id, "cancelled", limit).await;
                answer()
            }
        }),
    );
    called
}

#[tokio::test]
async fn a_stop_of_a_session_without_a_turn_stops_nothing() {
    let rt = runtime(json!({"generations": [text_gen("never")]}), config()).await;
    let out = rt
        .harness
        .stop(StopRequest {
            session_id: "s_no_turn".into(),
            turn_id: None,
        })
        .await
        .unwrap();
    assert!(!out.stopping);
    assert_eq!(stored_status(&rt.bus, "s_no_turn").await, None);
}

#[tokio::test]
async fn a_step_failing_on_an_unexpected_error_fails_its_turn_with_the_cause() {
    let rt = runtime(json!({"generations": [text_gen("never")]}), config()).await;
    // The router call itself fails (not a generation the provider ended with an error): a bug
    // or a version mismatch, which no retry mends.
    rt.bus.register_function(
        FunctionDef::new("router::chat", "a broken router"),
        Arc::new(|_p: Value, _ctx: CallContext| async move {
            Err::<Value, _>(BusError::internal("the router broke"))
        }),
    );
    let (_, s) = rt.run(send("talk")).await;
    assert_eq!(s.status, TurnStatus::Failed);
    let failure = s.failure.expect("a cause");
    assert_eq!(failure.code, "harness.turn_internal");
    assert!(
        failure
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("the router broke")),
        "{failure:?}"
    );
}

#[tokio::test]
async fn an_error_of_a_step_whose_turn_a_stop_ended_leaves_the_turn_cancelled() {
    let rt = runtime(json!({"generations": [text_gen("never")]}), config()).await;
    // The router takes the request, and fails only once a stop has ended the turn.
    let entered = answering_once_cancelled(
        &rt,
        "router::chat",
        "s_late",
        Duration::from_secs(20),
        || Err(BusError::internal("the router broke after the stop")),
    );
    let mut req = send("talk");
    req.session_id = Some("s_late".into());
    let r = rt.send(req).await;
    until("the router took the request", || {
        entered.load(Ordering::SeqCst)
    })
    .await;
    let out = rt
        .harness
        .stop(StopRequest {
            session_id: r.session_id.clone(),
            turn_id: Some(r.turn_id.clone()),
        })
        .await
        .unwrap();
    assert!(out.stopping);
    rt.until_queue_empty().await;
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Cancelled, "the stop's outcome stands");
    assert!(s.failure.is_none(), "{:?}", s.failure);
    let errors = rt
        .entries(&r.session_id)
        .into_iter()
        .filter(|e| e.entry_id == harness_types::ids::error_entry(&r.turn_id))
        .count();
    assert_eq!(errors, 0, "no error record for the cancelled turn");
}

#[tokio::test]
async fn a_generation_the_signal_cut_before_the_stop_took_the_lock_cancels_the_turn() {
    let rt = runtime(
        json!({"generations": [call_gen("^go", "c1", "x::f", json!({}))]}),
        config(),
    )
    .await;
    let runs = rt.register("x::f", None, |_| json!("ran"));
    // The stop's first half is held in `router::abort` (after it fired the turn's signal) until
    // the turn has ended: the step, not the stop, takes the lock next.
    // Its limit is well within the stop's own wait for this call.
    let aborting = answering_once_cancelled(
        &rt,
        "router::abort",
        "s_cut",
        Duration::from_millis(1500),
        || Ok(json!({"aborted": false})),
    );
    // Once the answer is streamed (the lock is free), a post-generate hook stops the turn and
    // returns when the stop has fired the signal.
    rt.stopping_hook("stop::after", aborting.clone(), |_| true);
    rt.bind("post-generate", "stop::after", json!({})).await;
    let mut req = allowing("go", &["x::*"]);
    req.session_id = Some("s_cut".into());
    let (r, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    assert!(aborting.load(Ordering::SeqCst), "the stop fired");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the cut answer's call never ran"
    );
    // The call of the cut answer is closed as not run: no call is left without a result.
    let results = rt.results(&r.session_id);
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(results[0].is_error);
}

#[tokio::test]
async fn a_settle_before_the_redelivered_step_leaves_the_turn_to_that_step() {
    let (rt, runs, r) = parked_on_f("finished").await;
    // The step that parked acks its delivery after the record is visible: wait for that, so the
    // depth read below sees only what the resolve enqueues.
    rt.until_queue_empty().await;
    // What a crash mid-dispatch leaves: the hold saved on a record that is still running (the
    // step was cut before it parked), its step to be delivered again.
    let mut rec = rt.turn_record(&r.session_id).await.unwrap();
    rec["status"] = json!("running");
    rt.set_turn_record(&r.session_id, rec).await;
    let out = rt.resolve(&r, "c1", ResolveAction::Execute).await;
    assert!(out.resolved);
    assert!(!out.turn_resumed, "the step that runs the turn decides");
    assert_eq!(
        stored_status(&rt.bus, &r.session_id).await.as_deref(),
        Some("running")
    );
    assert_eq!(
        rt.bus.queues().depth(harness_core::TURN_QUEUE),
        0,
        "no step of its own"
    );
    rt.enqueue_step(&r.session_id, &r.turn_id, 0).await;
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("finished")));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(rt.results(&r.session_id).len(), 1);
    assert_eq!(rt.recorder.seen.lock().unwrap().len(), 2);
}
