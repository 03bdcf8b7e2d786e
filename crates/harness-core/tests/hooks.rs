//! Hooks, holds and deferred calls, driven in-process.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_bus::Bus;
use harness_types::api::{ResolveAction, ResolveRequest, TurnStatus};
use harness_types::message::ContentBlock;
use serde_json::{json, Value};
use support::*;

/// `args` as a scoped target receives them: with the turn's root (here the configured default,
/// the working directory) stamped over whatever the model or a hook wrote.
fn stamped(mut args: Value) -> Value {
    let cwd = std::fs::canonicalize(std::env::current_dir().unwrap()).unwrap();
    args["fs_scope"] =
        json!({"root": cwd.display().to_string(), "grants": [], "boundary": "configured_roots"});
    args
}

/// Registers `fs::write`, which answers ok and records the arguments of each run.
fn recording_write(rt: &Rt) -> Arc<Mutex<Vec<Value>>> {
    let target = Arc::new(Mutex::new(Vec::new()));
    let got = target.clone();
    rt.register("fs::write", None, move |p| {
        got.lock().unwrap().push(p.clone());
        json!({"ok": true})
    });
    target
}

fn script_one_call() -> Value {
    json!({"generations": [call_gen("write", "c1", "fs::write", json!({"path": "/tmp/a", "text": "hi"})), text_gen("written")]})
}

#[tokio::test]
async fn a_hook_that_holds_and_rewrites_runs_the_target_once_with_the_rewrite_after_release() {
    let rt = runtime(script_one_call(), config()).await;
    let target = recording_write(&rt);
    let holder = rt.hook("guard::hold", |p| {
        let mut answer = rewriting(p, "hold", "path", json!("/sandbox/a"));
        answer["annotations"] = json!({"guard": "held"});
        answer
    });
    rt.bind(
        "pre-trigger",
        "guard::hold",
        json!({"functions": ["fs::*"]}),
    )
    .await;
    let r = rt.send_parked(allowing("write it", &["*"])).await;
    let s = rt.status(&r.session_id).await.unwrap();
    assert_eq!(s.pending_function_calls, vec!["c1".to_string()]);
    assert!(target.lock().unwrap().is_empty(), "nothing runs while held");

    let out = rt.resolve(&r, "c1", ResolveAction::Execute).await;
    assert!(out.resolved && out.turn_resumed);
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(
        *target.lock().unwrap(),
        vec![stamped(json!({"path": "/sandbox/a", "text": "hi"}))]
    );
    assert_eq!(
        holder.lock().unwrap().len(),
        1,
        "the holder is not re-run on release"
    );
    let entry = rt.entry(&r.session_id, &format!("e_{}_c1", r.turn_id));
    assert_eq!(
        entry.origin.unwrap()["guard"],
        "held",
        "annotations reach the origin"
    );

    // A second resolve is a no-op.
    let again = rt.resolve(&r, "c1", ResolveAction::Execute).await;
    assert!(!again.resolved && !again.turn_resumed);
    assert_eq!(target.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_holder_after_a_mutator_sees_the_mutation_and_the_release_skips_both() {
    let rt = runtime(script_one_call(), config()).await;
    let target = recording_write(&rt);
    let mutator = rt.hook("a::mutate", |p| {
        rewriting(p, "continue", "text", json!("HI"))
    });
    let holder = rt.hook("b::hold", |_| json!({"decision": "hold"}));
    rt.bind("pre-trigger", "b::hold", json!({"priority": 20}))
        .await;
    rt.bind("pre-trigger", "a::mutate", json!({"priority": 10}))
        .await;
    let r = rt.send_parked(allowing("write it", &["*"])).await;
    assert_eq!(
        mutator.lock().unwrap()[0]["call"]["arguments"]["text"],
        "hi",
        "the mutator saw the originals"
    );
    assert_eq!(
        holder.lock().unwrap()[0]["call"]["arguments"]["text"],
        "HI",
        "the holder saw the mutation"
    );
    let out = rt.resolve(&r, "c1", ResolveAction::Execute).await;
    assert!(out.resolved);
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(
        *target.lock().unwrap(),
        vec![stamped(json!({"path": "/tmp/a", "text": "HI"}))]
    );
    assert_eq!(holder.lock().unwrap().len(), 1);
    assert_eq!(
        mutator.lock().unwrap().len(),
        1,
        "hooks before the holder are not re-run either"
    );
}

#[tokio::test]
async fn deliver_settles_a_held_call_with_the_given_result() {
    let rt = runtime(script_one_call(), config()).await;
    let calls = rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.hold_calls(json!({})).await;
    let r = rt.send_parked(allowing("write it", &["*"])).await;
    let out = rt
        .harness
        .resolve(ResolveRequest {
            session_id: r.session_id.clone(),
            turn_id: r.turn_id.clone(),
            function_call_id: "c1".into(),
            action: None,
            content: Some(vec![ContentBlock::text("denied by the operator")]),
            is_error: Some(true),
            details: Some(json!({"error": "denied"})),
            fs_scope: None,
        })
        .await
        .unwrap();
    assert!(out.resolved && out.turn_resumed);
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    let result = &rt.results(&r.session_id)[0];
    assert!(result.is_error);
    assert_eq!(
        result.content,
        vec![ContentBlock::text("denied by the operator")]
    );
}

#[tokio::test]
async fn a_message_sent_while_parked_is_appended_and_steers_the_next_generation() {
    let rt = runtime(script_one_call(), config()).await;
    rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.hold_calls(json!({})).await;
    let r = rt.send_parked(allowing("write it", &["*"])).await;
    let mut steer = send("also add a footer");
    steer.session_id = Some(r.session_id.clone());
    let s = rt.send(steer).await;
    assert_eq!(
        (s.merged, s.queued, s.turn_id.clone()),
        (Some(true), None, r.turn_id.clone())
    );
    assert_eq!(
        rt.messages(&r.session_id).last().unwrap(),
        &("user".to_string(), "also add a footer".to_string())
    );
    rt.resolve(&r, "c1", ResolveAction::Execute).await;
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let last_user = seen[1].messages.iter().rev().find_map(|m| match m {
        harness_types::AgentMessage::User(u) => {
            Some(harness_types::message::joined_text(&u.content))
        }
        _ => None,
    });
    assert_eq!(last_user.as_deref(), Some("also add a footer"));
}

#[tokio::test]
async fn deny_at_each_point() {
    /// A turn run while the `point` hook denies it for `reason`.
    async fn denied_at(point: &str, reason: &'static str) -> (Rt, Value, TurnStatus) {
        let rt = runtime(json!({"generations": [text_gen("never")]}), config()).await;
        rt.hook(
            "policy::no",
            move |_| json!({"decision": "deny", "reason": reason}),
        );
        rt.bind(point, "policy::no", json!({})).await;
        let (r, s) = rt.run(send("hi")).await;
        let record = rt.error_record(&r);
        (rt, record, s.status)
    }

    let (rt, err, status) = denied_at("pre-turn", "quota exhausted").await;
    assert_eq!(status, TurnStatus::Failed);
    assert_eq!(err["code"], "harness.pre_turn_denied");
    assert_eq!(err["detail"], "pre_turn hook denied: quota exhausted");
    assert!(
        rt.recorder.seen.lock().unwrap().is_empty(),
        "no model spend"
    );

    let (_, err, _) = denied_at("pre-generate", "off hours").await;
    assert_eq!(err["code"], "harness.pre_generate_denied");

    // pre-trigger: the call gets a hook_denied result, the target never runs.
    let rt = runtime(script_one_call(), config()).await;
    let calls = rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.hook(
        "policy::no",
        |_| json!({"decision": "deny", "reason": "read-only day"}),
    );
    rt.bind("pre-trigger", "policy::no", json!({})).await;
    let (r, _) = rt.run(allowing("write it", &["*"])).await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    let result = &rt.results(&r.session_id)[0];
    assert_eq!(
        (result.is_error, result.details["error"].clone()),
        (true, json!("hook_denied"))
    );
    assert_eq!(result.details["message"], "read-only day");

    // post-trigger: a deny is ignored, a rewrite applies.
    let rt = runtime(script_one_call(), config()).await;
    let calls = rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.hook(
        "post::rewrite",
        |_| json!({"decision": "deny", "mutations": {"content": [{"type": "text", "text": "redacted"}]}}),
    );
    rt.bind("post-trigger", "post::rewrite", json!({})).await;
    let (r, _) = rt.run(allowing("write it", &["*"])).await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(
        rt.results(&r.session_id)[0].content,
        vec![ContentBlock::text("{\"ok\":true}")],
        "a post-trigger deny changes nothing"
    );
    let rt2 = runtime(script_one_call(), config()).await;
    rt2.register("fs::write", None, |_| json!({"ok": true}));
    rt2.hook(
        "post::rewrite",
        |_| json!({"mutations": {"content": [{"type": "text", "text": "redacted"}], "is_error": true}}),
    );
    rt2.bind("post-trigger", "post::rewrite", json!({})).await;
    let (r, _) = rt2.run(allowing("write it", &["*"])).await;
    let result = &rt2.results(&r.session_id)[0];
    assert_eq!(
        (result.content.clone(), result.is_error),
        (vec![ContentBlock::text("redacted")], true)
    );
}

/// The one-call runtime with `fs::write` (how often it ran) and `slow::hook`, a hook function
/// that answers after 5 s.
async fn with_a_slow_hook() -> (Rt, Arc<std::sync::atomic::AtomicUsize>) {
    let rt = runtime(script_one_call(), config()).await;
    let calls = rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.register_async("slow::hook", None, |_| async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Value::Null
    });
    (rt, calls)
}

#[tokio::test]
async fn slow_or_failing_hooks_fail_closed_before_and_open_after() {
    let (rt, calls) = with_a_slow_hook().await;
    rt.bind("pre-trigger", "slow::hook", json!({"timeout_ms": 50}))
        .await;
    let (r, _) = rt.run(allowing("write it", &["*"])).await;
    let result = &rt.results(&r.session_id)[0];
    assert_eq!(result.details["error"], "hook_denied");
    assert!(
        result.details["message"]
            .as_str()
            .unwrap()
            .contains("timed out after 50 ms"),
        "{}",
        result.details
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);

    // The same slow hook with fail_open is skipped.
    let (rt, calls) = with_a_slow_hook().await;
    rt.bind(
        "pre-trigger",
        "slow::hook",
        json!({"timeout_ms": 50, "on_error": "fail_open"}),
    )
    .await;
    rt.run(allowing("write it", &["*"])).await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);

    // A missing post-trigger hook function is skipped (fail_open by default).
    let rt = runtime(script_one_call(), config()).await;
    let calls = rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.bind("post-trigger", "nobody::home", json!({})).await;
    let (r, _) = rt.run(allowing("write it", &["*"])).await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(!rt.results(&r.session_id)[0].is_error);
}

#[tokio::test]
async fn pre_generate_extends_the_prompt_and_appends_messages() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    rt.hook("ctx::add", |p| {
        let prompt = format!(
            "{}\n\nToday is Sunday.",
            p["generate"]["system_prompt"].as_str().unwrap()
        );
        json!({"mutations": {"system_prompt": prompt,
                             "append_messages": [{"role": "user", "content": [{"type": "text", "text": "(reminder: be brief)"}], "timestamp": 1}]}})
    });
    let never = rt.hook("never::called", |_| json!({"decision": "deny"}));
    rt.bind("pre-generate", "ctx::add", json!({"priority": 1}))
        .await;
    rt.bind_with(
        "pre-generate",
        "never::called",
        json!({"priority": 2}),
        json!({"inject_prompt": "Answer in English."}),
    )
    .await;
    let (r, _) = rt.run(send("hi")).await;
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let prompt = seen[0].system_prompt.clone().unwrap();
    assert!(
        prompt.ends_with("Today is Sunday.\n\nAnswer in English."),
        "{prompt}"
    );
    assert!(
        never.lock().unwrap().is_empty(),
        "an inject_prompt binding is never invoked"
    );
    let last = seen[0].messages.last().unwrap();
    assert_eq!(last.text(), "(reminder: be brief)");
    assert_eq!(
        rt.messages(&r.session_id).len(),
        2,
        "appended messages are not persisted"
    );
}

#[tokio::test]
async fn the_sweep_expires_a_stale_pending_call_but_never_a_hold() {
    let rt = runtime(json!({"generations": [
        {"match": {"last_user_text": "write"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "fs::write", "arguments": {}},
            {"type": "function_call", "id": "c2", "function_id": "fs::write", "arguments": {"n": 2}}
        ]},
        text_gen("done")
    ]}), HarnessConfig { default_pending_timeout_ms: 1000, ..config() }).await;
    rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.hold_calls(json!({})).await;
    let r = rt.send_parked(allowing("write it", &["*"])).await;
    // Make c2 a legacy parked call (no holder) that has waited too long; c1 stays a hold.
    let mut rec = rt
        .bus
        .state_get("harness_turn", &r.session_id)
        .await
        .unwrap()
        .unwrap();
    rec["calls"]["c2"]["held_by"] = Value::Null;
    rec["calls"]["c2"]["pending_at"] = json!(harness_types::now_ms() - 60_000);
    rec["calls"]["c1"]["pending_at"] = json!(harness_types::now_ms() - 600_000_000);
    rt.bus
        .state_set("harness_turn", &r.session_id, rec)
        .await
        .unwrap();

    let out = rt.sweep().await;
    assert_eq!(out.resolved, 1);
    let results = rt.results(&r.session_id);
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].function_call_id, "c2");
    assert_eq!(results[0].details["error"], "pending_timeout");
    let s = rt.status(&r.session_id).await.unwrap();
    assert_eq!(
        s.status,
        TurnStatus::AwaitingFunctions,
        "the hold keeps the turn parked"
    );
    assert_eq!(s.pending_function_calls, vec!["c1".to_string()]);
    assert_eq!(rt.sweep().await.resolved, 0);
}

#[tokio::test]
async fn unknown_binding_fields_are_rejected_by_name() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let err = rt
        .bus
        .call(
            "engine::register_trigger",
            json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "x", "config": {"priorty": 1}}),
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, "harness/invalid_request");
    assert!(
        err.message.starts_with("config: unknown field `priorty`"),
        "{}",
        err.message
    );
}

use harness_core::HarnessConfig;

#[tokio::test]
async fn an_unknown_hook_decision_denies_before_the_target_and_is_skipped_after_it() {
    // A misspelt decision must not let the call through at pre-trigger (fail_closed)...
    for decision in ["Deny", "block"] {
        let rt = runtime(script_one_call(), config()).await;
        let calls = rt.register("fs::write", None, |_| json!({"ok": true}));
        rt.hook("odd::hook", move |_| json!({"decision": decision}));
        rt.bind("pre-trigger", "odd::hook", json!({})).await;
        let (r, _) = rt.run(allowing("write it", &["*"])).await;
        let result = &rt.results(&r.session_id)[0];
        assert_eq!(result.details["error"], "hook_denied", "{decision}");
        assert!(
            result.details["message"]
                .as_str()
                .unwrap()
                .contains(decision),
            "the refusal names what the hook answered: {}",
            result.details
        );
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "{decision}"
        );
    }
    // ...and is skipped after it (fail_open): the target's own result is appended.
    let rt = runtime(script_one_call(), config()).await;
    let calls = rt.register("fs::write", None, |_| json!({"ok": true}));
    rt.hook(
        "odd::hook",
        |_| json!({"decision": "block", "mutations": {"is_error": true}}),
    );
    rt.bind("post-trigger", "odd::hook", json!({})).await;
    let (r, _) = rt.run(allowing("write it", &["*"])).await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    let result = &rt.results(&r.session_id)[0];
    assert!(
        !result.is_error,
        "the broken hook's mutation is not applied"
    );
    assert_eq!(result.details, json!({"ok": true}));
}

#[tokio::test]
async fn a_post_turn_deny_reprompts_with_its_retry_prompt_then_the_result_completes() {
    let rt = runtime(
        json!({"generations": [
            {"match": {"last_user_text": "^summarize"}, "content": [{"type": "text", "text": "short"}]},
            {"match": {"last_user_text": "^Be longer"}, "content": [{"type": "text", "text": "a longer summary"}]}
        ]}),
        config(),
    )
    .await;
    let seen = rt.hook("gate::length", |p| {
        if p["result"].as_str().is_some_and(|r| r.len() < 10) {
            json!({"decision": "deny", "reason": "too short"})
        } else {
            json!({"decision": "continue"})
        }
    });
    rt.bind(
        "post-turn",
        "gate::length",
        json!({"retry_prompt": "Be longer: {reason} (you wrote '{value}')"}),
    )
    .await;
    let (r, s) = rt.run(send("summarize this")).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("a longer summary")));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0]["point"], "post_turn");
    assert_eq!(seen[0]["result"], "short");
    assert!(rt.messages(&r.session_id).contains(&(
        "user".to_string(),
        "Be longer: too short (you wrote 'short')".to_string()
    )));
}

/// Neither the model nor a pre-trigger hook can widen the root a scoped call runs in: the loop
/// stamps the turn's own before and after the chain.
#[tokio::test]
async fn a_model_or_a_hook_writing_fs_scope_cannot_widen_the_root() {
    let script = json!({"generations": [
        call_gen("write", "c1", "fs::write", json!({"path": "a", "text": "hi", "fs_scope": {"root": "/", "grants": ["/etc"], "boundary": "workspace"}})),
        text_gen("written")
    ]});
    let rt = runtime(script, config()).await;
    let target = recording_write(&rt);
    let seen = rt.hook("guard::widen", |p| {
        let scope = json!({"root": "/", "grants": [], "boundary": "workspace"});
        rewriting(p, "continue", "fs_scope", scope)
    });
    rt.bind(
        "pre-trigger",
        "guard::widen",
        json!({"functions": ["fs::*"]}),
    )
    .await;
    let (_, s) = rt.run(allowing("write it", &["*"])).await;
    assert_eq!(s.status, TurnStatus::Completed);
    // The hook already saw the turn's root, not the model's.
    assert_eq!(
        seen.lock().unwrap()[0]["call"]["arguments"],
        stamped(json!({"path": "a", "text": "hi"}))
    );
    assert_eq!(
        *target.lock().unwrap(),
        vec![stamped(json!({"path": "a", "text": "hi"}))]
    );
}

/// A pre-generate hook that appends more than the reserved slack: the first final count
/// overflows, the one reassembly reserves the difference (the context manager compacts to make
/// room), and the turn goes on; a hook that appends more than the whole window fails cleanly.
#[tokio::test]
async fn a_hook_that_outgrows_the_slack_gets_one_reassembly_then_a_clean_overflow() {
    let rt = runtime(
        json!({"generations": [
            {"match": {"last_user_text": "^Summarize the conversation below"}, "repeat": true,
             "content": [{"type": "text", "text": "SUMMARY: earlier turns sent long notes."}]},
            {"match": {"last_user_text": "^note"}, "repeat": true, "content": [{"type": "text", "text": "noted"}]}
        ]}),
        HarnessConfig {
            default_context_window: 6_000,
            ..config()
        },
    )
    .await;
    let bus: Arc<dyn harness_bus::Bus> = Arc::new(rt.bus.clone());
    harness_context::register(bus.clone());
    let mut session = None;
    for n in 0..4 {
        let mut req = send(&format!("note {n}: {}", "n".repeat(4_000)));
        req.session_id = session.clone();
        let (r, s) = rt.run(req).await;
        assert_eq!(s.status, TurnStatus::Completed, "{:?}", s.result_error);
        session = Some(r.session_id);
    }
    let size = Arc::new(std::sync::atomic::AtomicUsize::new(12_000));
    let appended = size.clone();
    rt.hook("ctx::big", move |_| {
        let n = appended.load(std::sync::atomic::Ordering::SeqCst);
        json!({"mutations": {"append_messages": [{"role": "user", "content": [{"type": "text", "text": format!("note from a hook: {}", "h".repeat(n))}], "timestamp": 1}]}})
    });
    rt.bind("pre-generate", "ctx::big", json!({})).await;
    let mut req = send("note 4: short");
    req.session_id = session.clone();
    let (_, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Completed, "{:?}", s.result_error);
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let last = seen.last().unwrap();
    assert!(last
        .messages
        .last()
        .unwrap()
        .text()
        .starts_with("note from a hook"));
    assert!(
        last.messages.iter().any(|m| m.text().contains("SUMMARY:")),
        "the reassembly compacted to make room"
    );
    // More than the whole window: the reassembly cannot help, and the turn fails cleanly.
    size.store(40_000, std::sync::atomic::Ordering::SeqCst);
    let mut req = send("note 5: short");
    req.session_id = session;
    let (r, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Failed);
    let error = rt
        .entries(&r.session_id)
        .into_iter()
        .filter_map(|e| e.custom)
        .rfind(|c| c.custom_type == "error")
        .unwrap();
    assert_eq!(
        error.data["code"], "harness.context_overflow",
        "{}",
        error.data
    );
    assert_eq!(error.data["phase"], "pre_generate", "{}", error.data);
}

/// A release may grant the held call extra roots for that call alone (`fs_scope.grants`); a
/// grant that is not an absolute existing directory, or one on a delivery, is refused by name.
#[tokio::test]
async fn a_release_grants_the_held_call_one_shot_roots() {
    let rt = runtime(script_one_call(), config()).await;
    let target = recording_write(&rt);
    rt.hold_calls(json!({"functions": ["fs::*"]})).await;
    let r = rt.send_parked(allowing("write it", &["*"])).await;
    let shared = tempfile::tempdir().unwrap();
    let shared_root = std::fs::canonicalize(shared.path())
        .unwrap()
        .display()
        .to_string();
    let release = |action: ResolveAction, grants: Vec<String>| ResolveRequest {
        session_id: r.session_id.clone(),
        turn_id: r.turn_id.clone(),
        function_call_id: "c1".into(),
        action: Some(action),
        content: None,
        is_error: None,
        details: None,
        fs_scope: Some(harness_types::api::ReleaseFsScope { grants }),
    };
    let e = rt
        .harness
        .resolve(release(ResolveAction::Execute, vec!["relative/dir".into()]))
        .await
        .unwrap_err();
    assert!(e.message.starts_with("fs_scope.grants[0]:"), "{e}");
    let e = rt
        .harness
        .resolve(release(ResolveAction::Deliver, vec![shared_root.clone()]))
        .await
        .unwrap_err();
    assert!(e.message.starts_with("fs_scope:"), "{e}");
    assert!(
        target.lock().unwrap().is_empty(),
        "nothing ran on a refusal"
    );

    let out = rt
        .harness
        .resolve(release(ResolveAction::Execute, vec![shared_root.clone()]))
        .await
        .unwrap();
    assert!(out.resolved);
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    let seen = target.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["fs_scope"]["grants"], json!([shared_root]));
}
