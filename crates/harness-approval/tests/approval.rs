//! The approval gate driven in-process: the real loop, the embedded bus, the scripted provider.

mod support;

use harness_approval::{approval_id, digest};
use harness_bus::Bus;
use harness_types::api::TurnStatus;
use harness_types::AgentMessage;
use serde_json::{json, Value};
use support::*;

fn args() -> Value {
    json!({"path": "/tmp/a", "text": "hi"})
}

fn one_call_script() -> Value {
    json!({"generations": [call_gen("write", "c1", "fs::write", args()), text_gen("written")]})
}

/// A runtime gating `fs::*`, a recording `fs::write`, one parked turn: `(rt, seen, sid, tid)`.
async fn parked() -> (Rt, Seen, String, String) {
    let rt = runtime(one_call_script(), &["fs::*"]).await;
    let seen = rt.target("fs::write");
    let (sid, tid) = rt.send(send_allowing("write it", None)).await;
    let s = rt.wait_status(&sid, TurnStatus::AwaitingFunctions).await;
    assert_eq!(s.pending_function_calls, vec!["c1".to_string()]);
    (rt, seen, sid, tid)
}

fn decide(a: &Value, decision: &str, reason: Option<&str>) -> Value {
    let mut v =
        json!({"approval_id": a["approval_id"], "decision": decision, "digest": a["digest"]});
    if let Some(r) = reason {
        v["reason"] = json!(r);
    }
    v
}

/// A second decision on the approval `a`, either way, is refused: it was already `how`.
async fn assert_decided_once(rt: &Rt, a: &Value, how: &str) {
    for decision in ["approve", "deny"] {
        let again = rt.err("approval::decide", decide(a, decision, None)).await;
        assert!(
            again.starts_with(&format!(
                "harness/invalid_request: approval_id: already decided ({how})"
            )),
            "{decision}: {again}"
        );
    }
}

/// Every function_call in the transcript has exactly one function_result.
fn assert_every_call_closed(rt: &Rt, sid: &str) {
    let entries = rt.entries(sid);
    let mut calls = vec![];
    let mut results = vec![];
    for e in &entries {
        match &e.message {
            Some(AgentMessage::Assistant(m)) => {
                for b in &m.content {
                    if let harness_types::message::ContentBlock::FunctionCall { id, .. } = b {
                        calls.push(id.clone());
                    }
                }
            }
            Some(AgentMessage::FunctionResult(r)) => results.push(r.function_call_id.clone()),
            _ => {}
        }
    }
    calls.sort();
    results.sort();
    assert_eq!(calls, results, "every call closed exactly once");
}

#[tokio::test]
async fn a_gated_call_is_held_recorded_and_listed_with_its_digest() {
    let (rt, seen, sid, tid) = parked().await;
    assert!(seen.lock().unwrap().is_empty(), "nothing runs while held");
    let pending = rt.pending(&sid).await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    let a = &pending[0];
    assert_eq!(a["approval_id"], json!(approval_id(&sid, &tid, "c1")));
    assert_eq!(a["session_id"], json!(sid));
    assert_eq!(a["turn_id"], json!(tid));
    assert_eq!(a["function_call_id"], "c1");
    assert_eq!(a["function_id"], "fs::write");
    assert_eq!(a["arguments"], args());
    assert_eq!(a["digest"], json!(digest("fs::write", &args())));
    assert_eq!(a["status"], "pending");
    assert!(a["created_at"].as_i64().unwrap() > 0);

    // Durable before the hold was answered: the record is in state.
    let stored = rt.stored(a).await;
    assert_eq!(stored["status"], "pending");

    // The unfiltered list has it; another session's list does not.
    let all = rt.ok("approval::list", json!({})).await;
    assert_eq!(all["approvals"].as_array().unwrap().len(), 1);
    let other = rt
        .ok("approval::list", json!({"session_id": "s_other"}))
        .await;
    assert_eq!(other["approvals"], json!([]));
}

#[tokio::test]
async fn approving_runs_the_target_once_with_the_exact_arguments_and_the_turn_completes() {
    let (rt, seen, sid, tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    let out = rt.ok("approval::decide", decide(&a, "approve", None)).await;
    assert_eq!(
        out,
        json!({"decided": true, "approval_id": a["approval_id"], "status": "approved", "resolved": true, "turn_resumed": true})
    );
    let s = rt.wait_terminal(&sid, &tid).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("written")));
    assert_eq!(*seen.lock().unwrap(), vec![args()], "ran once, as shown");

    let results = rt.results(&sid);
    assert_eq!(results.len(), 1);
    let (r, origin) = &results[0];
    assert!(!r.is_error);
    assert_eq!(
        origin.as_ref().unwrap()["approval_id"],
        a["approval_id"],
        "the approval is on the result's origin"
    );
    assert_every_call_closed(&rt, &sid);

    // Consumed once: a second decision, either way, is refused.
    assert_decided_once(&rt, &a, "approved").await;
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert!(rt.pending(&sid).await.is_empty());
    let stored = rt.stored(&a).await;
    assert_eq!(
        (stored["status"].clone(), stored["resolved"].clone()),
        (json!("approved"), json!(true))
    );
}

#[tokio::test]
async fn denying_delivers_the_denial_and_never_runs_the_target() {
    let (rt, seen, sid, tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    let out = rt
        .ok("approval::decide", decide(&a, "deny", Some("too risky")))
        .await;
    assert_eq!(out["status"], "denied");
    assert_eq!(
        (out["resolved"].clone(), out["turn_resumed"].clone()),
        (json!(true), json!(true))
    );
    let s = rt.wait_terminal(&sid, &tid).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert!(seen.lock().unwrap().is_empty(), "a denied call never runs");
    let results = rt.results(&sid);
    assert_eq!(results.len(), 1);
    let (r, _) = &results[0];
    assert!(r.is_error);
    assert_eq!(
        harness_types::message::joined_text(&r.content),
        "denied by the approver: too risky"
    );
    assert_eq!(r.details["error"], "approval_denied");
    assert_eq!(r.details["reason"], "too risky");
    assert_eq!(r.details["approval_id"], a["approval_id"]);
    assert_every_call_closed(&rt, &sid);
    assert_decided_once(&rt, &a, "denied").await;
}

#[tokio::test]
async fn a_decision_must_quote_the_digest_it_was_shown() {
    let (rt, seen, sid, tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    let mut wrong = decide(&a, "approve", None);
    wrong["digest"] = json!(digest(
        "fs::write",
        &json!({"path": "/etc/passwd", "text": "hi"})
    ));
    let e = rt.err("approval::decide", wrong).await;
    assert!(
        e.starts_with(
            "harness/invalid_request: digest: the arguments changed since they were shown"
        ),
        "{e}"
    );
    assert!(seen.lock().unwrap().is_empty());
    assert_eq!(
        rt.pending(&sid).await.len(),
        1,
        "still pending after a refusal"
    );
    rt.ok("approval::decide", decide(&a, "approve", None)).await;
    rt.wait_terminal(&sid, &tid).await;
    assert_eq!(*seen.lock().unwrap(), vec![args()]);
}

#[tokio::test]
async fn bad_decisions_name_the_field() {
    let (rt, _seen, sid, _tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    let cases = [
        (
            json!({"approval_id": "ap_nope", "decision": "approve", "digest": a["digest"]}),
            "harness/invalid_request: approval_id: no approval 'ap_nope'",
        ),
        (
            json!({"approval_id": "", "decision": "approve", "digest": a["digest"]}),
            "harness/invalid_request: approval_id: must not be empty",
        ),
        (
            json!({"approval_id": a["approval_id"], "decision": "approve", "digest": ""}),
            "harness/invalid_request: digest: must not be empty",
        ),
        (
            json!({"approval_id": a["approval_id"], "decision": "approve"}),
            "digest",
        ),
        (
            json!({"approval_id": a["approval_id"], "decision": "maybe", "digest": a["digest"]}),
            "harness/invalid_request: decision: unknown variant `maybe`",
        ),
        (
            json!({"approval_id": a["approval_id"], "decision": "approve", "digest": a["digest"], "colour": 1}),
            "colour",
        ),
        (
            json!([1]),
            "harness/invalid_request: payload: must be a JSON object",
        ),
    ];
    for (payload, want) in cases {
        let e = rt.err("approval::decide", payload.clone()).await;
        assert!(e.contains(want), "{payload}: {e}");
        assert!(e.starts_with("harness/invalid_request:"), "{payload}: {e}");
    }
    let e = rt.err("approval::list", json!({"session_id": ""})).await;
    assert!(e.contains("session_id: must not be empty"), "{e}");
    let e = rt.err("approval::list", json!({"sesion_id": "x"})).await;
    assert!(e.contains("sesion_id"), "{e}");
    assert_eq!(rt.pending(&sid).await.len(), 1, "nothing was consumed");
}

#[tokio::test]
async fn an_agent_cannot_decide_its_own_approvals() {
    let (rt, seen, sid, _tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    let e = rt
        .bus
        .call_with_metadata(
            "approval::decide",
            decide(&a, "approve", None),
            None,
            json!({"function_call_id": "c9", "session_id": sid}),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("decided by a person"), "{e}");
    assert!(seen.lock().unwrap().is_empty());
    assert_eq!(rt.pending(&sid).await.len(), 1);
    // Discovery does not offer the approval functions to models.
    let listed = rt.ok("engine::functions::list", json!({})).await;
    assert!(
        !listed.to_string().contains("approval::"),
        "approval::* are internal: {listed}"
    );
}

#[tokio::test]
async fn an_approval_expires_with_its_turn() {
    let (rt, seen, sid, tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    rt.ok("harness::stop", json!({"session_id": sid})).await;
    assert_eq!(
        rt.wait_terminal(&sid, &tid).await.status,
        TurnStatus::Cancelled
    );
    assert!(
        rt.pending(&sid).await.is_empty(),
        "an ended turn's approval is not listed"
    );
    let e = rt
        .err("approval::decide", decide(&a, "approve", None))
        .await;
    assert!(e.contains("approval_id: expired"), "{e}");
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn the_gate_is_idempotent_for_a_redelivered_call_and_rebinds_changed_arguments() {
    let rt = runtime(one_call_script(), &["fs::*"]).await;
    let payload = |arguments: Value| {
        json!({"point": "pre_trigger", "session_id": "s_x", "turn_id": "t_x", "step": 0, "depth": 0,
               "call": {"id": "c1", "function_id": "fs::write", "arguments": arguments}})
    };
    let id = approval_id("s_x", "t_x", "c1");
    let first = rt.ok("approval::gate", payload(args())).await;
    assert_eq!(
        first,
        json!({"decision": "hold", "annotations": {"approval_id": id}})
    );
    let stored = || async {
        rt.shared
            .state_get(harness_approval::SCOPE, &id)
            .await
            .unwrap()
            .unwrap()
    };
    let before = stored().await;
    // Key order differs, arguments are the same: the same record, untouched.
    let reordered: Value = serde_json::from_str(r#"{"text": "hi", "path": "/tmp/a"}"#).unwrap();
    assert_eq!(rt.ok("approval::gate", payload(reordered)).await, first);
    assert_eq!(stored().await, before);

    // Changed arguments: a fresh pending record; a decision quoting the old digest is refused.
    let changed = json!({"path": "/etc/passwd", "text": "hi"});
    assert_eq!(
        rt.ok("approval::gate", payload(changed.clone())).await["decision"],
        "hold"
    );
    let now = stored().await;
    assert_eq!(now["arguments"], changed);
    assert_eq!(now["digest"], json!(digest("fs::write", &changed)));
    let e = rt
        .err(
            "approval::decide",
            json!({"approval_id": id, "decision": "approve", "digest": before["digest"]}),
        )
        .await;
    assert!(
        e.contains("digest: the arguments changed since they were shown"),
        "{e}"
    );

    // A call outside a turn cannot wait for anyone.
    let mut outside = payload(args());
    outside["turn_id"] = json!("");
    let out = rt.ok("approval::gate", outside).await;
    assert_eq!(out["decision"], "deny");
    // Malformed input is an error (the loop treats a failing pre-trigger hook as a deny).
    let e = rt.err("approval::gate", json!({"session_id": "s"})).await;
    assert!(e.contains("call"), "{e}");
}

#[tokio::test]
async fn a_redelivered_gate_call_after_the_decision_gets_the_decision() {
    let (rt, _seen, sid, tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    rt.ok("approval::decide", decide(&a, "deny", Some("no")))
        .await;
    let payload = json!({"point": "pre_trigger", "session_id": sid, "turn_id": tid, "step": 0, "depth": 0,
                         "call": {"id": "c1", "function_id": "fs::write", "arguments": args()}});
    let out = rt.ok("approval::gate", payload).await;
    assert_eq!(out["decision"], "deny");
    assert_eq!(out["reason"], "denied by the approver: no");
}

#[tokio::test]
async fn the_gate_shows_what_earlier_hooks_rewrote_and_only_matching_calls_wait() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "both"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "fs::write", "arguments": args()},
            {"type": "function_call", "id": "c2", "function_id": "net::get", "arguments": {"url": "u"}},
            {"type": "function_call", "id": "c3", "function_id": "fs::delete", "arguments": {"path": "/tmp/b"}}]},
        text_gen("done")]});
    let rt = runtime(script, &["fs::*"]).await;
    let writes = rt.target("fs::write");
    let gets = rt.target("net::get");
    let deletes = rt.target("fs::delete");
    let rewritten = json!({"path": "/sandbox/a", "text": "hi"});
    let mutator = rt.hook(
        "sandbox::rewrite",
        json!({"decision": "continue", "mutations": {"arguments": rewritten}}),
    );
    rt.ok(
        "engine::register_trigger",
        json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "sandbox::rewrite",
               "config": {"functions": ["fs::write"]}}),
    )
    .await;
    let (sid, tid) = rt.send(send_allowing("both", None)).await;
    let s = rt.wait_status(&sid, TurnStatus::AwaitingFunctions).await;
    let mut open = s.pending_function_calls.clone();
    open.sort();
    assert_eq!(open, vec!["c1".to_string(), "c3".to_string()]);
    assert_eq!(gets.lock().unwrap().len(), 1, "net::get is not gated");

    let pending = rt.pending(&sid).await;
    assert_eq!(pending.len(), 2);
    let write = pending
        .iter()
        .find(|a| a["function_call_id"] == "c1")
        .unwrap();
    assert_eq!(
        write["arguments"], rewritten,
        "the gate shows the rewritten arguments"
    );
    let delete = pending
        .iter()
        .find(|a| a["function_call_id"] == "c3")
        .unwrap();

    let first = rt
        .ok("approval::decide", decide(write, "approve", None))
        .await;
    assert_eq!(
        (first["resolved"].clone(), first["turn_resumed"].clone()),
        (json!(true), json!(false))
    );
    let second = rt
        .ok("approval::decide", decide(delete, "deny", None))
        .await;
    assert_eq!(
        second["turn_resumed"], true,
        "the last settled call resumes the turn"
    );
    assert_eq!(
        rt.wait_terminal(&sid, &tid).await.status,
        TurnStatus::Completed
    );
    assert_eq!(
        *writes.lock().unwrap(),
        vec![rewritten],
        "ran once, as shown"
    );
    assert!(deletes.lock().unwrap().is_empty());
    assert_eq!(
        mutator.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "not re-run on release"
    );
    let denial = rt
        .results(&sid)
        .into_iter()
        .find(|(r, _)| r.function_call_id == "c3")
        .unwrap()
        .0;
    assert_eq!(
        harness_types::message::joined_text(&denial.content),
        "denied by the approver: no reason given"
    );
    assert_every_call_closed(&rt, &sid);
}

#[tokio::test]
async fn install_is_idempotent_and_follows_the_configured_globs() {
    let rt = runtime(one_call_script(), &["fs::*"]).await;
    let b = rt.gate_bindings().await;
    assert_eq!(b.len(), 1);
    assert_eq!(
        b[0].config,
        json!({"functions": ["fs::*"], "priority": harness_approval::GATE_PRIORITY})
    );
    let first_id = b[0].id.clone();

    harness_approval::install(rt.shared.clone(), vec!["fs::*".into()])
        .await
        .unwrap();
    let b = rt.gate_bindings().await;
    assert_eq!(b.len(), 1, "no duplicate");
    assert_eq!(b[0].id, first_id, "the same binding is kept");

    harness_approval::install(rt.shared.clone(), vec!["fs::*".into(), "net::*".into()])
        .await
        .unwrap();
    let b = rt.gate_bindings().await;
    assert_eq!(b.len(), 1, "replaced, not added");
    assert_ne!(b[0].id, first_id);
    assert_eq!(b[0].config["functions"], json!(["fs::*", "net::*"]));

    harness_approval::install(rt.shared.clone(), vec![])
        .await
        .unwrap();
    assert!(rt.gate_bindings().await.is_empty(), "no globs, no gate");
    // list / decide stay available for approvals left from an earlier run.
    assert_eq!(
        rt.ok("approval::list", json!({})).await,
        json!({"approvals": []})
    );

    let e = harness_approval::install(rt.shared.clone(), vec!["fs::*".into(), "[bad".into()])
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with("harness/invalid_request: functions[1]: invalid glob '[bad'"),
        "{e}"
    );
}

#[tokio::test]
async fn a_binding_left_from_an_earlier_run_is_replaced_without_a_gap() {
    // Without the gate the call runs; with it, it waits: after re-install the new globs apply.
    let rt = runtime(
        json!({"generations": [call_gen("write", "c1", "net::get", json!({"url": "u"})), text_gen("ok")]}),
        &["fs::*"],
    )
    .await;
    harness_approval::install(rt.shared.clone(), vec!["net::*".into()])
        .await
        .unwrap();
    let seen = rt.target("net::get");
    let (sid, _tid) = rt.send(send_allowing("write", None)).await;
    rt.wait_status(&sid, TurnStatus::AwaitingFunctions).await;
    assert!(seen.lock().unwrap().is_empty());
    assert_eq!(rt.pending(&sid).await[0]["function_id"], "net::get");
}

#[tokio::test]
async fn the_sweep_prunes_decided_approvals_and_fanout_marks_past_retention_only() {
    let rt = runtime(
        json!({"generations": [
            call_gen("^write it", "c1", "fs::write", args()),
            call_gen("^write again", "c2", "fs::write", args()),
            text_gen("written"),
        ]}),
        &["fs::*"],
    )
    .await;
    rt.target("fs::write");
    let (sid, tid) = rt.send(send_allowing("write it", None)).await;
    rt.wait_status(&sid, TurnStatus::AwaitingFunctions).await;
    // A binding on turn-completed makes the finalizer write a fan-out mark.
    rt.target("obs::seen");
    rt.ok(
        "engine::register_trigger",
        json!({"trigger_type": "harness::turn-completed", "function_id": "obs::seen", "config": {}}),
    )
    .await;
    let a = rt.pending(&sid).await.remove(0);
    rt.ok("approval::decide", decide(&a, "deny", None)).await;
    rt.wait_terminal(&sid, &tid).await;
    // A second turn parks on a new approval that nobody decides.
    let (sid2, _) = rt.send(send_allowing("write again", None)).await;
    rt.wait_status(&sid2, TurnStatus::AwaitingFunctions).await;
    let rows = |scope: &'static str| {
        let shared = rt.shared.clone();
        async move { shared.state_list(scope).await.unwrap().len() }
    };
    assert_eq!(rows("approvals").await, 2);
    assert_eq!(rows("harness_fanout").await, 1);

    // Within the retention window (the default day) the sweep keeps everything.
    rt.ok("harness::sweep-pending", json!({})).await;
    assert_eq!(rows("approvals").await, 2);
    assert_eq!(rows("harness_fanout").await, 1);

    // Past it, the decided approval and the mark go; the pending approval stays.
    rt.harness
        .reconfigure(harness_core::HarnessConfig {
            idem_ttl_secs: 0,
            stream_coalesce_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap();
    rt.ok("harness::sweep-pending", json!({})).await;
    assert_eq!(rows("harness_fanout").await, 0);
    let left = rt.shared.state_list("approvals").await.unwrap();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].1["status"], "pending");
    assert_eq!(left[0].1["session_id"], sid2);
}

/// The session's `approval::*` events, as `(topic, payload)` in log order.
fn approval_events(rt: &Rt, sid: &str) -> Vec<(String, Value)> {
    rt.store
        .events_after(sid, 0, 10_000)
        .unwrap()
        .into_iter()
        .filter(|e| e.topic.starts_with("approval::"))
        .map(|e| (e.topic, e.payload))
        .collect()
}

#[tokio::test]
async fn the_hold_and_the_decision_are_events_of_the_session_without_the_arguments() {
    let (rt, _seen, sid, tid) = parked().await;
    let a = rt.pending(&sid).await.remove(0);
    let events = approval_events(&rt, &sid);
    assert_eq!(events.len(), 1, "{events:?}");
    let (topic, p) = &events[0];
    assert_eq!(topic, harness_approval::REQUESTED);
    assert_eq!(
        *p,
        json!({"session_id": sid, "turn_id": tid, "approval_id": a["approval_id"],
               "function_call_id": "c1", "function_id": "fs::write",
               "digest": a["digest"], "status": "pending"})
    );
    // A redelivered gate call (same call, same arguments) records no second hold.
    rt.ok(
        harness_approval::GATE,
        json!({"session_id": sid, "turn_id": tid,
               "call": {"id": "c1", "function_id": "fs::write", "arguments": args()}}),
    )
    .await;
    assert_eq!(approval_events(&rt, &sid).len(), 1);

    rt.ok("approval::decide", decide(&a, "deny", Some("no")))
        .await;
    let events = approval_events(&rt, &sid);
    assert_eq!(events.len(), 2, "{events:?}");
    let (topic, p) = &events[1];
    assert_eq!(topic, harness_approval::DECIDED);
    assert_eq!(p["status"], "denied");
    assert_eq!(p["digest"], a["digest"]);
    assert!(
        p.get("arguments").is_none() && p.get("reason").is_none(),
        "{p}"
    );
    rt.wait_terminal(&sid, &tid).await;
}

// Digests and ids are stored with every approval and quoted back by the approver, so their bytes
// are pinned here to values computed outside Rust.
#[test]
fn stored_digests_and_ids_keep_their_bytes() {
    let args = json!({"path": "/a", "opts": {"y": [1, {"b": 2, "a": "é"}], "x": 1}});
    assert_eq!(
        digest("fs::write", &args),
        "sha256:c7a5fa421a9a26e4a3850a0ce5e47acc3bc1923f3fba66c895bb02cd0bcdfe35"
    );
    assert_eq!(
        approval_id("s1", "t1", "c1"),
        "ap_285997606117265010751e19933737ef"
    );
}
