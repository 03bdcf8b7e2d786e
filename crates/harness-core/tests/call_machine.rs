//! Rows of the call machine (and the turn rows around them) that the other suites do not take:
//! a stop while a target runs, a post-trigger hold and its release, a rewrite into the wall, a
//! stop of a parked turn with a done call, and the sweep following a waiting spawn.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use harness_bus::Bus;
use harness_types::api::{ResolveAction, TurnStatus};
use serde_json::{json, Value};
use support::*;

/// A runtime whose model answers "both" with two calls in one answer, `c1` of `x::{first}` and
/// `c2` of `x::{second}`, then says "ok"; each function answers "<name> ran". How often the
/// second ran.
async fn calling_both(first: &str, second: &str) -> (Rt, Arc<AtomicUsize>) {
    let call = |id: &str, name: &str| json!({"type": "function_call", "id": id, "function_id": format!("x::{name}"), "arguments": {}});
    let rt = runtime(
        json!({"generations": [
            {"match": {"last_user_text": "^both"}, "content": [call("c1", first), call("c2", second)]},
            text_gen("ok")
        ]}),
        config(),
    )
    .await;
    let answer = |name: &str| {
        let text = json!(format!("{name} ran"));
        move |_| text.clone()
    };
    rt.register(&format!("x::{first}"), None, answer(first));
    let runs = rt.register(&format!("x::{second}"), None, answer(second));
    (rt, runs)
}

#[tokio::test]
async fn a_stop_while_the_target_runs_cancels_the_call_then_the_turn() {
    let rt = calling("^work", "slow::op", "done").await;
    let entered = Arc::new(AtomicBool::new(false));
    let flag = entered.clone();
    rt.register_async("slow::op", None, move |_| {
        flag.store(true, Ordering::SeqCst);
        // Answers only when the dispatch timeout gives up on it: the stop comes first.
        std::future::pending::<Value>()
    });
    let r = rt.send(allowing("work", &["slow::*"])).await;
    until("the target runs", || entered.load(Ordering::SeqCst)).await;
    rt.stop(&r.session_id).await;
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    let text = rt.result_text(&r.session_id, "c1");
    assert!(text.contains("cancelled by a stop while it ran"), "{text}");
    assert_eq!(rt.results(&r.session_id).len(), 1, "one result, no second");
}

#[tokio::test]
async fn a_post_trigger_hold_keeps_the_result_and_its_release_appends_it_without_a_second_run() {
    let rt = runtime(
        json!({"generations": [call_gen("^write", "c1", "x::write", json!({"n": 1})), text_gen("written")]}),
        config(),
    )
    .await;
    let runs = rt.register("x::write", None, |_| json!("wrote 1 byte"));
    let held = rt.hook("review::hold", |_| json!({"decision": "hold"}));
    rt.bind("post-trigger", "review::hold", json!({})).await;
    let r = rt.send_parked(allowing("write", &["x::*"])).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the target ran before the hold"
    );
    assert!(
        rt.results(&r.session_id).is_empty(),
        "nothing appended while held"
    );

    let out = rt.resolve(&r, "c1", ResolveAction::Execute).await;
    assert!(out.resolved && out.turn_resumed, "{out:?}");
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a release never runs it again"
    );
    assert_eq!(held.lock().unwrap().len(), 1);
    let text = rt.result_text(&r.session_id, "c1");
    assert!(text.contains("wrote 1 byte"), "the kept result: {text}");
}

#[tokio::test]
async fn a_hook_rewrite_into_the_wall_is_refused_on_the_second_check_and_never_runs() {
    let rt = runtime(
        json!({"generations": [call_gen("^note", "c1", "state::get", json!({"scope": "notes", "key": "k"})), text_gen("ok")]}),
        config(),
    )
    .await;
    rt.hook("rewrite::scope", |p| {
        rewriting(p, "continue", "scope", json!("harness_turn"))
    });
    rt.bind("pre-trigger", "rewrite::scope", json!({})).await;
    let (r, s) = rt.run(allowing("note", &["state::*"])).await;
    assert_eq!(s.status, TurnStatus::Completed);
    let result = rt
        .results(&r.session_id)
        .into_iter()
        .find(|r| r.function_call_id == "c1")
        .unwrap();
    assert!(result.is_error);
    assert_eq!(result.details["error"], "control_plane", "{result:?}");
    assert!(
        serde_json::to_string(&result.content)
            .unwrap()
            .contains("belongs to the harness"),
        "{result:?}"
    );
}

#[tokio::test]
async fn a_stop_of_a_parked_turn_closes_the_held_call_and_leaves_the_done_one() {
    let (rt, guarded) = calling_both("free", "guarded").await;
    rt.hold_calls(json!({"functions": ["x::guarded"]})).await;
    let r = rt.send_parked(allowing("both", &["x::*"])).await;
    // Only a pending call can be resolved: not the done one, not one the answer never made.
    for call in ["c1", "c9"] {
        for action in [ResolveAction::Execute, ResolveAction::Deliver] {
            let out = rt.resolve(&r, call, action).await;
            assert!(!out.resolved, "{call} {action:?}: {out:?}");
        }
    }
    assert_eq!(rt.results(&r.session_id).len(), 1, "nothing delivered");
    rt.stop(&r.session_id).await;
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    assert!(rt.result_text(&r.session_id, "c1").contains("free ran"));
    let c2 = rt.result_text(&r.session_id, "c2");
    assert!(c2.contains("guard::hold held the call"), "{c2}");
    assert_eq!(guarded.load(Ordering::SeqCst), 0);
    assert_eq!(rt.results(&r.session_id).len(), 2, "one result per call");
}

#[tokio::test]
async fn the_sweep_follows_a_waiting_spawn_and_answers_it_once_its_child_is_lost() {
    let (rt, r, _) = parked_on_a_slow_child(json!({"task": "dig deep"}), "the child is gone").await;
    let parent = rt.status(&r.session_id).await.unwrap();
    assert_eq!(parent.pending_function_calls, vec!["s1".to_string()]);
    let parent_rec = rt.turn_record(&r.session_id).await.unwrap();
    let child_session = parent_rec["calls"]["s1"]["child_session_id"]
        .as_str()
        .unwrap()
        .to_string();

    // A waiting spawn has no target to execute: only a delivered result settles it.
    let out = rt.resolve(&r, "s1", ResolveAction::Execute).await;
    assert!(!out.resolved, "{out:?}");
    // The child still streams: the sweep reads it and leaves the call waiting.
    let swept = rt.sweep().await;
    assert_eq!(swept.resolved, 0);
    assert_eq!(
        rt.status(&r.session_id).await.unwrap().status,
        TurnStatus::AwaitingFunctions
    );

    // The child's record is lost (a store that drops recent writes): the sweep answers the
    // call with child_lost, and the parent goes on.
    rt.bus
        .state_delete(harness_core::TURN_SCOPE, &child_session)
        .await
        .unwrap();
    let swept = rt.sweep().await;
    assert_eq!(swept.resolved, 1);
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    let text = rt.result_text(&r.session_id, "s1");
    assert!(text.contains("child_lost"), "{text}");
}

#[tokio::test]
async fn a_legacy_result_wait_is_left_by_the_sweep_in_time_and_settled_only_by_a_delivery() {
    let rt = calling("^wait", "x::slow", "done").await;
    rt.register("x::slow", None, |_| json!("never used"));
    rt.hold_calls(json!({})).await;
    let r = rt.send_parked(allowing("wait", &["x::*"])).await;
    // An older version's parked call: pending, with neither a holder nor a child.
    let mut rec = rt.turn_record(&r.session_id).await.unwrap();
    rec["calls"]["c1"]["held_by"] = Value::Null;
    rec["calls"]["c1"]["pending_at"] = json!(harness_types::now_ms());
    rt.set_turn_record(&r.session_id, rec).await;

    let swept = rt.sweep().await;
    assert_eq!(swept.resolved, 0, "not past its timeout");
    let out = rt.resolve(&r, "c1", ResolveAction::Execute).await;
    assert!(!out.resolved, "nothing holds it, so nothing runs: {out:?}");
    let out = rt.resolve(&r, "c1", ResolveAction::Deliver).await;
    assert!(out.resolved && out.turn_resumed, "{out:?}");
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    let results = rt.results(&r.session_id);
    assert_eq!(results.len(), 1);
    assert!(!results[0].is_error, "the delivered (empty) result");
}

#[tokio::test]
async fn a_stop_between_two_calls_leaves_the_second_unrun_and_closes_it() {
    let (rt, second) = calling_both("first", "second").await;
    // After the first call ran, its post-trigger hook stops the turn and waits until the
    // stop has fired the turn's signal.
    let aborted = rt.watch_abort();
    rt.stopping_hook("stop::between", aborted.clone(), |_| true);
    rt.bind(
        "post-trigger",
        "stop::between",
        json!({"functions": ["x::first"]}),
    )
    .await;
    let (r, s) = rt.run(allowing("both", &["x::*"])).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    assert!(aborted.load(Ordering::SeqCst), "the stop fired");
    assert!(rt.result_text(&r.session_id, "c1").contains("first ran"));
    let c2 = rt.result_text(&r.session_id, "c2");
    assert!(
        c2.contains("was not run: the turn was stopped first"),
        "{c2}"
    );
    assert_eq!(second.load(Ordering::SeqCst), 0, "the second never ran");
}
