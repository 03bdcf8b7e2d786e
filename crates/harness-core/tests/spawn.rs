//! Sub-agents: waiting and detached spawns, guards, the stop cascade, direct spawns.

mod support;

use std::time::Duration;

use harness_core::HarnessConfig;
use harness_types::api::{ExposeMode, FunctionPolicy, TurnStatus};
use serde_json::{json, Value};
use support::*;

#[tokio::test]
async fn a_spawn_waits_for_the_child_and_gets_its_result() {
    let (rt, r) = trip_with_one_child().await;
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("Booked: AB123")));
    assert_eq!(s.children.len(), 1);
    let child = &s.children[0];
    assert_eq!(child.function_call_id, "s1");
    let result = &rt.results(&r.session_id)[0];
    assert_eq!(result.content[0].as_text(), Some("Flight AB123 at 9:00"));
    assert!(!result.is_error);
    // The child: its own session, linked to the call, one level deeper, walled.
    let cs = rt.status(&child.session_id).await.unwrap();
    assert_eq!((cs.status, cs.depth), (TurnStatus::Completed, 1));
    let meta = rt.sessions.get(&child.session_id).unwrap().unwrap();
    assert_eq!(meta.metadata["parent_session_id"], json!(r.session_id));
    assert_eq!(meta.metadata["function_call_id"], "s1");
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let child_req = seen
        .iter()
        .find(|q| q.session_id.as_deref() == Some(child.session_id.as_str()))
        .unwrap();
    assert!(
        child_req.tools.is_empty() || child_req.tools.iter().all(|t| t.name != "harness::spawn"),
        "a leaf cannot spawn"
    );
}

#[tokio::test]
async fn a_detached_spawn_answers_with_the_child_ids_at_once() {
    let rt = runtime(
        json!({"generations": [
            spawn_gen("^start", json!({"task": "background job", "options": {"detach": true}})),
            text(Some("^background job"), "job done", 100),
            text(None, "started it", 0)
        ]}),
        config(),
    )
    .await;
    let (r, s) = rt.run(orchestrating("start it")).await;
    assert_eq!(s.result, Some(json!("started it")));
    let result = &rt.results(&r.session_id)[0];
    assert_eq!(result.details["detached"], true);
    let child_session = result.details["child_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let child_turn = result.details["child_turn_id"]
        .as_str()
        .unwrap()
        .to_string();
    let cs = rt.wait_terminal(&child_session, &child_turn).await;
    assert_eq!(cs.result, Some(json!("job done")));
    assert_eq!(
        rt.results(&r.session_id).len(),
        1,
        "a detached child's end adds nothing to the parent"
    );
}

/// A turn whose model spawns with `arguments` under `config`: the runtime, the session and the
/// spawn's result (every guard answers the model instead of failing the turn).
async fn spawn_answered(
    config: HarnessConfig,
    arguments: Value,
) -> (Rt, String, harness_types::message::FunctionResultMessage) {
    let rt = runtime(
        json!({"generations": [spawn_gen("^go", arguments), text(None, "ok", 0)]}),
        config,
    )
    .await;
    let (r, _) = rt.run(orchestrating("go")).await;
    let result = rt.results(&r.session_id).remove(0);
    (rt, r.session_id, result)
}

#[tokio::test]
async fn guards_answer_the_model_instead_of_spawning() {
    let deep = HarnessConfig {
        max_depth: 0,
        ..config()
    };
    let (rt, sid, result) = spawn_answered(deep, json!({"task": "sub"})).await;
    assert!(result.is_error);
    assert_eq!(result.details["error"], "harness/spawn_depth_exceeded");
    assert_eq!(rt.status(&sid).await.unwrap().children.len(), 0);

    let wide = HarnessConfig {
        max_children: 0,
        ..config()
    };
    let (_, _, result) = spawn_answered(wide, json!({"task": "sub"})).await;
    assert_eq!(result.details["error"], "harness/spawn_fanout_exceeded");

    let (_, _, result) = spawn_answered(config(), json!({"tsak": "typo"})).await;
    assert_eq!(result.details["error"], "harness/invalid_request");
    assert!(
        result.content[0]
            .as_text()
            .unwrap()
            .contains("task: missing field"),
        "{:?}",
        result.content
    );
}

#[tokio::test]
async fn stopping_the_parent_stops_the_child() {
    let (rt, r, child) = parked_on_a_slow_child(json!({"task": "dig deep"}), "never").await;
    let out = rt.stop(&r.session_id).await;
    assert!(out.stopping);
    assert_eq!(
        rt.wait_terminal(&r.session_id, &r.turn_id).await.status,
        TurnStatus::Cancelled
    );
    assert_eq!(
        rt.wait_terminal(&child.session_id, &child.turn_id)
            .await
            .status,
        TurnStatus::Cancelled
    );
}

/// `harness::spawn` called directly (over the bus, as a caller outside any turn) with the task
/// "hello" and no policy.
async fn spawn_hello(rt: &Rt) -> harness_types::api::SpawnResponse {
    let out = rt
        .ok(
            "harness::spawn",
            json!({"task": "hello", "model": "m", "provider": "scripted"}),
        )
        .await;
    serde_json::from_value(out).unwrap()
}

#[tokio::test]
async fn a_direct_spawn_starts_a_child_with_exactly_the_policy_it_names() {
    let rt = replying("child says hi").await;
    let err = rt.harness.spawn(spawning("hello")).await.unwrap_err();
    assert!(err.message.starts_with("model:"), "{err}");
    let out = spawn_hello(&rt).await;
    let s = rt
        .wait_terminal(&out.child_session_id, &out.child_turn_id)
        .await;
    assert_eq!(
        (s.status, s.result),
        (TurnStatus::Completed, Some(json!("child says hi")))
    );
    let seen = rt.recorder.seen.lock().unwrap().clone();
    assert!(seen[0].tools.is_empty(), "no policy named: deny all");
}

#[tokio::test]
async fn a_direct_spawn_naming_no_policy_gets_the_configured_baseline_walled() {
    let rt = runtime(
        json!({"generations": [text(None, "child says hi", 0)]}),
        HarnessConfig {
            default_functions: Some(FunctionPolicy {
                allow: vec!["math::*".into(), "harness::spawn".into()],
                deny: vec![],
                expose: ExposeMode::Native,
            }),
            ..config()
        },
    )
    .await;
    rt.register("math::add", None, |_| json!(3));
    let out = spawn_hello(&rt).await;
    rt.wait_terminal(&out.child_session_id, &out.child_turn_id)
        .await;
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let tools: Vec<&str> = seen[0].tools.iter().map(|t| t.name.as_str()).collect();
    // The baseline's spawn is walled off: a child that is no orchestrator is a leaf.
    assert_eq!(tools, ["math::add"], "the baseline, walled");
}

#[tokio::test]
async fn stop_closes_every_open_call_of_a_turn_parked_on_two_children_and_a_hold() {
    use harness_bus::{Bus, CallContext, FunctionDef};
    use std::sync::Arc;
    let calls = json!({"match": {"last_user_text": "^fan out"}, "content": [
        {"type": "function_call", "id": "s1", "function_id": "harness::spawn", "arguments": {"task": "dig one"}},
        {"type": "function_call", "id": "s2", "function_id": "harness::spawn", "arguments": {"task": "dig two"}},
        {"type": "function_call", "id": "w1", "function_id": "fs::write", "arguments": {"path": "a"}}
    ]});
    let rt = runtime(
        json!({"generations": [
            calls,
            text(Some("^dig"), "a b c d e f g h i j k l m n o p q r s t", 200),
            text(None, "never", 0)
        ]}),
        config(),
    )
    .await;
    let runs = rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.bus.register_function(
        FunctionDef::new("gate::hold", "holds every write"),
        Arc::new(|_p: Value, _ctx: CallContext| async { Ok(json!({"decision": "hold"})) }),
    );
    rt.bind("pre-trigger", "gate::hold", json!({"functions": ["fs::*"]}))
        .await;
    let mut req = orchestrating("fan out");
    req.options
        .as_mut()
        .unwrap()
        .functions
        .as_mut()
        .unwrap()
        .allow = vec!["harness::spawn".into(), "fs::write".into()];
    let r = rt.send(req).await;
    rt.wait_status(&r.session_id, TurnStatus::AwaitingFunctions)
        .await;
    let before = rt.status(&r.session_id).await.unwrap();
    assert_eq!(before.pending_function_calls.len(), 3, "{before:?}");
    let children = before.children.clone();
    assert_eq!(children.len(), 2);

    let out = rt.stop(&r.session_id).await;
    assert!(out.stopping);
    let after = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(after.status, TurnStatus::Cancelled);
    assert!(after.pending_function_calls.is_empty(), "{after:?}");
    assert_eq!(after.children.len(), 2, "the children stay known");
    let results = rt.results(&r.session_id);
    let mut answered: Vec<&str> = results
        .iter()
        .map(|m| m.function_call_id.as_str())
        .collect();
    answered.sort();
    assert_eq!(
        answered,
        ["s1", "s2", "w1"],
        "every function call has its result"
    );
    for m in &results {
        assert!(m.is_error);
        assert_eq!(m.details["error"], "cancelled", "{:?}", m.details);
    }
    let held = results.iter().find(|m| m.function_call_id == "w1").unwrap();
    let text = harness_types::message::joined_text(&held.content);
    assert!(
        text.contains("was not run"),
        "a held call never ran: {text}"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
    for child in children {
        assert_eq!(
            rt.wait_terminal(&child.session_id, &child.turn_id)
                .await
                .status,
            TurnStatus::Cancelled
        );
    }
    // The children's late answers find the calls closed and change nothing.
    assert_eq!(rt.results(&r.session_id).len(), 3);
}

#[tokio::test]
async fn a_spawn_past_its_pending_timeout_resumes_the_parent_once_and_stops_the_child() {
    let (rt, r, child) = parked_on_a_slow_child(
        json!({"task": "dig deep", "options": {"pending_timeout_ms": 1}}),
        "gave up waiting",
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = rt.harness.sweep_pending(Default::default()).await.unwrap();
        if out.resolved > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the sweep never timed the spawn out"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let done = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(done.status, TurnStatus::Completed);
    assert_eq!(done.result, Some(json!("gave up waiting")));
    let results = rt.results(&r.session_id);
    assert_eq!(results.len(), 1);
    assert!(results[0].is_error);
    assert_eq!(results[0].details["error"], "pending_timeout");
    assert_eq!(
        rt.wait_terminal(&child.session_id, &child.turn_id)
            .await
            .status,
        TurnStatus::Cancelled
    );
    // Another sweep finds nothing left to settle.
    assert_eq!(
        rt.harness
            .sweep_pending(Default::default())
            .await
            .unwrap()
            .resolved,
        0
    );
    assert_eq!(rt.results(&r.session_id).len(), 1);
}

#[tokio::test]
async fn a_turn_may_reuse_only_its_own_tree() {
    let spawn = |id: &str, session: &str| {
        json!({"type": "function_call", "id": id, "function_id": "harness::spawn",
               "arguments": {"task": "side job", "session_id": session, "options": {"detach": true}}})
    };
    let rt = runtime(
        json!({"generations": [
            {"match": {"last_user_text": "^reuse"}, "content": [
                spawn("foreign", "x_top"),
                spawn("fresh", "kid"),
                spawn("again", "kid"),
                spawn("own", "p_sess")
            ]},
            text(Some("^side job"), "done", 0),
            text(Some("^hello"), "hi", 0),
            text(None, "all spawned", 0)
        ]}),
        config(),
    )
    .await;
    // An unrelated top-level session.
    let mut other = send("hello");
    other.session_id = Some("x_top".into());
    let o = rt.send(other).await;
    rt.wait_terminal("x_top", &o.turn_id).await;

    let mut req = orchestrating("reuse test");
    req.session_id = Some("p_sess".into());
    let r = rt.send(req).await;
    rt.wait_terminal("p_sess", &r.turn_id).await;
    let results = rt.results("p_sess");
    let by_id = |id: &str| results.iter().find(|m| m.function_call_id == id).unwrap();
    let foreign = by_id("foreign");
    assert!(foreign.is_error);
    let text_of = |m: &harness_types::message::FunctionResultMessage| {
        harness_types::message::joined_text(&m.content)
    };
    assert!(
        text_of(foreign).contains("session 'x_top' is a top-level session of its own"),
        "{}",
        text_of(foreign)
    );
    assert!(!by_id("fresh").is_error);
    assert_eq!(by_id("fresh").details["reused"], false);
    let again = by_id("again");
    assert!(!again.is_error, "{}", text_of(again));
    assert_eq!(again.details["reused"], true);
    assert_eq!(again.details["child_session_id"], "kid");
    let own = by_id("own");
    assert!(!own.is_error, "{}", text_of(own));
    assert!(text_of(own).contains("merged into this session's own turn"));
    // The foreign session was left alone.
    assert_eq!(
        rt.messages("x_top"),
        vec![
            ("user".into(), "hello".into()),
            ("assistant".into(), "hi".into())
        ]
    );
}

#[tokio::test]
async fn the_session_tree_and_its_metrics_follow_the_parent_links() {
    let (rt, r) = trip_with_one_child().await;
    let tree = rt.tree(&r.session_id).await;
    assert_eq!(tree.session_id, r.session_id);
    assert_eq!(tree.turn_status, Some(TurnStatus::Completed));
    assert_eq!(tree.children.len(), 1);
    let child = &tree.children[0];
    assert_eq!(child.depth, 1);
    assert_eq!(
        child.parent_session_id.as_deref(),
        Some(r.session_id.as_str())
    );
    assert!(child.children.is_empty());

    let m = rt
        .harness
        .metrics(harness_types::api::MetricsRequest {
            root_session_id: r.session_id.clone(),
        })
        .await
        .unwrap();
    assert!(m.complete);
    assert_eq!(m.totals.sessions, 2);
    // The parent: the spawn call and the final answer; the child: one answer.
    assert_eq!(m.totals.counters.turns, 3);
    assert_eq!(m.totals.counters.function_calls, 1);
    assert_eq!(m.totals.counters.function_call_errors, 0);
    assert_eq!(m.by_session.len(), 2);
    assert_eq!(m.by_session[1].depth, 1);

    let e = rt
        .harness
        .metrics(harness_types::api::MetricsRequest {
            root_session_id: "nobody".into(),
        })
        .await
        .unwrap_err();
    assert!(e.to_string().contains("session_id: unknown session"), "{e}");
}
