//! The turn loop, driven in-process by the scripted provider.

mod support;

use std::time::Duration;

use harness_core::HarnessConfig;
use harness_types::api::{FunctionPolicy, SendOptions, TurnStatus};
use harness_types::ErrorCode;
use serde_json::json;
use support::*;

#[tokio::test]
async fn a_text_turn_completes_with_one_user_and_one_assistant_entry() {
    let rt = runtime(
        json!({"generations": [text_gen("Hello back, friend.")]}),
        config(),
    )
    .await;
    let (r, s) = rt.run(send("hello")).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("Hello back, friend.")));
    assert_eq!(
        rt.messages(&r.session_id),
        vec![
            ("user".into(), "hello".into()),
            ("assistant".into(), "Hello back, friend.".into())
        ]
    );
    rt.completed_events(&r.session_id, &r.turn_id).await;
    let topics = rt.topics(&r.session_id);
    let count = |t: &str| topics.iter().filter(|(x, _)| x == t).count();
    assert_eq!(count("harness::turn-started"), 1);
    assert_eq!(count("harness::turn-completed"), 1);
    let done = topics
        .iter()
        .find(|(t, _)| t == "harness::turn-completed")
        .unwrap();
    assert_eq!(done.1["status"], "completed");
    assert_eq!(done.1["terminal"], true);
}

#[tokio::test]
async fn the_assistant_entry_id_is_deterministic() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let (r, _) = rt.run(send("hi")).await;
    let ids = rt.entry_ids(&r.session_id);
    assert!(
        ids.contains(&format!("e_{}_0_assistant", r.turn_id)),
        "{ids:?}"
    );
}

#[tokio::test]
async fn a_repeated_idempotency_key_appends_nothing() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let mut req = send("once");
    req.idempotency_key = Some("hook:42".into());
    let (a, _) = rt.run(req.clone()).await;
    let b = rt.send(req).await;
    assert_eq!(b.deduplicated, Some(true));
    assert_eq!(
        (b.session_id.clone(), b.turn_id.clone()),
        (a.session_id.clone(), a.turn_id.clone())
    );
    assert_eq!(
        rt.messages(&a.session_id)
            .iter()
            .filter(|(r, _)| r == "user")
            .count(),
        1
    );
    let ids = rt.entry_ids(&a.session_id);
    assert!(ids.contains(&"e_idem_hook~3A42".to_string()), "{ids:?}");
}

#[tokio::test]
async fn a_follow_up_send_inherits_the_model_and_a_new_session_needs_one() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let mut no_model = send("hi");
    no_model.model = None;
    let err = rt.harness.send(no_model.clone()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    assert!(err.message.starts_with("model:"), "{err}");
    let (a, _) = rt.run(send("hi")).await;
    no_model.session_id = Some(a.session_id.clone());
    let b = rt.send(no_model).await;
    assert_ne!(b.turn_id, a.turn_id);
    assert_eq!(
        rt.wait_terminal(&b.session_id, &b.turn_id).await.status,
        TurnStatus::Completed
    );
}

#[tokio::test]
async fn a_send_during_a_running_step_is_queued_and_steers_the_same_turn() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "first"}, "delay_ms": 2000, "content": [{"type": "text", "text": "answer one"}]},
        {"match": {"last_user_text": "second"}, "content": [{"type": "text", "text": "answer two"}]}
    ]});
    let rt = runtime(script, config()).await;
    let a = rt.send(send("first")).await;
    // Wait until the step is streaming (the assistant entry exists), then steer.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !rt
        .entries(&a.session_id)
        .iter()
        .any(|e| e.entry_id.ends_with("_0_assistant"))
    {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut second = send("second");
    second.session_id = Some(a.session_id.clone());
    let b = rt.send(second).await;
    assert_eq!(
        (b.merged, b.queued, b.turn_id.clone()),
        (Some(true), Some(true), a.turn_id.clone())
    );
    let s = rt.wait_terminal(&a.session_id, &a.turn_id).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.step, 1, "the steering message cost one more step");
    assert_eq!(
        rt.messages(&a.session_id),
        vec![
            ("user".into(), "first".into()),
            ("assistant".into(), "answer one".into()),
            ("user".into(), "second".into()),
            ("assistant".into(), "answer two".into()),
        ]
    );
}

#[tokio::test]
async fn stop_cancels_a_streaming_generation() {
    let script = json!({"generations": [{"chunk_delay_ms": 200, "content": [{"type": "text", "text": "a b c d e f g h i j k l m n o p"}]}]});
    let rt = runtime(script, config()).await;
    let r = rt.send(send("go")).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !rt
        .messages(&r.session_id)
        .iter()
        .any(|(role, t)| role == "assistant" && !t.is_empty())
    {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let out = rt.stop(&r.session_id).await;
    assert!(out.stopping);
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    let stopped = rt
        .entries(&r.session_id)
        .into_iter()
        .find(|e| e.entry_id == format!("e_{}_stopped", r.turn_id));
    assert_eq!(stopped.unwrap().custom.unwrap().data["reason"], "stopped");
    // A second stop has nothing to stop.
    let again = rt.stop(&r.session_id).await;
    assert!(!again.stopping);
    let completed: Vec<_> = rt
        .topics(&r.session_id)
        .into_iter()
        .filter(|(t, _)| t == "harness::turn-completed")
        .collect();
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0].1["status"], "cancelled");
}

#[tokio::test]
async fn a_transient_failure_after_partial_output_resumes_once() {
    let script = json!({"generations": [
        {"error": {"kind": "transient", "message": "upstream reset", "after_text": "Partial answer "}},
        {"content": [{"type": "text", "text": "Complete answer."}]}
    ]});
    let rt = runtime(script, config()).await;
    let (r, s) = rt.run(send("q")).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.transient_resumes, 1);
    assert_eq!(s.result, Some(json!("Complete answer.")));
    let ids = rt.entry_ids(&r.session_id);
    assert!(
        ids.contains(&format!("e_{}_transient_recovery_1_recovering", r.turn_id)),
        "{ids:?}"
    );
    assert!(
        ids.contains(&format!("e_{}_transient_recovery_1_recovered", r.turn_id)),
        "{ids:?}"
    );
    // The partial reply is kept in its own entry, and the recovery notice is no user message:
    // the transcript holds the user's message and the two replies only.
    let msgs = rt.messages(&r.session_id);
    let roles: Vec<&str> = msgs.iter().map(|(role, _)| role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "assistant"], "{msgs:?}");
    assert_eq!(msgs[1], ("assistant".into(), "Partial answer ".into()));
    let recovering = rt.entry(
        &r.session_id,
        &format!("e_{}_transient_recovery_1_recovering", r.turn_id),
    );
    assert!(recovering.message.is_none());
    let notice = recovering.custom.unwrap().data["notice"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(notice.contains("upstream reset"), "{notice}");
    // The resumed step carries the notice at its system prompt's tail, and after the cut reply
    // only a marker that says it is no message from the user.
    let seen = rt.recorder.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert!(!seen[0]
        .system_prompt
        .as_deref()
        .unwrap_or("")
        .contains(&notice));
    let resumed = &seen[1];
    assert!(
        resumed.system_prompt.as_deref().unwrap().ends_with(&notice),
        "{:?}",
        resumed.system_prompt
    );
    let texts: Vec<(String, String)> = resumed
        .messages
        .iter()
        .map(|m| {
            (
                m.role().to_string(),
                harness_types::message::joined_text(m.content()),
            )
        })
        .collect();
    assert_eq!(texts[0], ("user".into(), "q".into()));
    assert_eq!(texts[1], ("assistant".into(), "Partial answer ".into()));
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert_eq!(texts[2].0, "user");
    assert!(
        texts[2].1.contains("not a message from the user"),
        "{texts:?}"
    );
    assert!(
        texts.iter().all(|(_, t)| !t.contains("upstream reset")),
        "{texts:?}"
    );
}

#[tokio::test]
async fn the_recovery_notice_is_gone_from_the_next_turn() {
    let script = json!({"generations": [
        {"error": {"kind": "transient", "message": "upstream reset", "after_text": "Partial answer "}},
        {"content": [{"type": "text", "text": "Complete answer."}]},
        {"content": [{"type": "text", "text": "Second."}]}
    ]});
    let rt = runtime(script, config()).await;
    let (r, _) = rt.run(send("q")).await;
    let mut next = send("again");
    next.session_id = Some(r.session_id.clone());
    let r2 = rt.send(next).await;
    let s = rt.wait_terminal(&r.session_id, &r2.turn_id).await;
    assert_eq!(s.result, Some(json!("Second.")));
    let seen = rt.recorder.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    let later = &seen[2];
    assert_eq!(later.system_prompt, seen[0].system_prompt);
    let texts: Vec<String> = later
        .messages
        .iter()
        .map(|m| harness_types::message::joined_text(m.content()))
        .collect();
    assert!(
        texts
            .iter()
            .all(|t| !t.contains("harness") && !t.contains("upstream reset")),
        "{texts:?}"
    );
}

#[tokio::test]
async fn a_failure_with_no_output_fails_the_turn_without_spending_the_resume_budget() {
    let script =
        json!({"generations": [{"error": {"kind": "transient", "message": "503 from upstream"}}]});
    let rt = runtime(script, config()).await;
    let (r, s) = rt.run(send("q")).await;
    assert_eq!(s.status, TurnStatus::Failed);
    assert_eq!(s.transient_resumes, 0);
    assert_eq!(
        s.result_error.as_deref(),
        Some("The provider failed temporarily.")
    );
    let data = rt.error_record(&r);
    assert_eq!(data["phase"], "generation");
    assert_eq!(data["detail"], "503 from upstream");
    let done = rt.completed_events(&r.session_id, &r.turn_id).await;
    assert_eq!(done[0]["status"], "failed");
}

#[tokio::test]
async fn a_conversation_that_does_not_fit_fails_cleanly() {
    let cfg = HarnessConfig {
        default_context_window: 80,
        ..config()
    };
    let rt = runtime(json!({"generations": [text_gen("ok")]}), cfg).await;
    let (r, s) = rt.run(send(&"word ".repeat(400))).await;
    assert_eq!(s.status, TurnStatus::Failed);
    let data = rt.error_record(&r);
    assert_eq!(data["code"], "harness.context_overflow");
    assert!(data["detail"]
        .as_str()
        .unwrap()
        .starts_with("context/overflow:"));
}

#[tokio::test]
async fn calls_are_denied_without_a_policy_and_max_turns_ends_the_turn() {
    let script = json!({"generations": [
        {"repeat": true, "content": [{"type": "function_call", "id": "c1", "function_id": "files::delete", "arguments": {"path": "/"}}]}
    ]});
    let rt = runtime(script, config()).await;
    let mut req = send("clean up");
    req.options = Some(SendOptions {
        max_turns: Some(1),
        ..Default::default()
    });
    let (r, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.stop_reason.as_deref(), Some("max_turns"));
    assert_eq!(s.turn_count, 1);
    let results: Vec<_> = rt
        .entries(&r.session_id)
        .into_iter()
        .filter_map(|e| match e.message {
            Some(harness_types::AgentMessage::FunctionResult(f)) => Some(f),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 1, "the call is closed exactly once");
    assert!(results
        .iter()
        .all(|f| f.is_error && f.details["error"] == "policy_denied"));
    let notice = rt.entry(&r.session_id, &format!("e_{}_max_turns", r.turn_id));
    assert_eq!(
        notice.custom.unwrap().data["message"],
        "max_turns (1) reached; ending the turn."
    );
}

#[tokio::test]
async fn an_allowed_call_runs_once_and_its_result_reaches_the_model() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "add"}, "content": [{"type": "function_call", "id": "c1", "function_id": "math::add", "arguments": {"a": 2, "b": 3}}]},
        {"content": [{"type": "text", "text": "It is 5."}]}
    ]});
    let rt = runtime(script, config()).await;
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    use harness_bus::Bus;
    rt.bus.register_function(
        harness_bus::FunctionDef::new("math::add", "add two numbers"),
        std::sync::Arc::new(
            move |p: serde_json::Value, _ctx: harness_bus::CallContext| {
                let seen = seen.clone();
                async move {
                    seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok(json!({"sum": p["a"].as_i64().unwrap() + p["b"].as_i64().unwrap()}))
                }
            },
        ),
    );
    let mut req = send("add 2 and 3");
    req.options = Some(SendOptions {
        functions: Some(FunctionPolicy {
            allow: vec!["math::*".into()],
            ..Default::default()
        }),
        ..Default::default()
    });
    let (r, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("It is 5.")));
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    let msgs = rt.messages(&r.session_id);
    assert_eq!(msgs[2], ("function_result".into(), "{\"sum\":5}".into()));
}

#[tokio::test]
async fn a_step_that_finds_no_turn_record_ends_the_turn_as_a_clean_failure() {
    use harness_bus::Bus;
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let (r, _) = rt.run(send("hi")).await;
    // A store that lost recent writes: the record is gone while a step of a new turn is queued.
    rt.bus
        .state_delete("harness_turn", &r.session_id)
        .await
        .unwrap();
    rt.bus
        .enqueue(
            "harness-turn",
            "harness::turn",
            json!({"session_id": r.session_id, "turn_id": "t_lost", "step": 0}),
        )
        .await
        .unwrap();
    let s = rt.wait_terminal(&r.session_id, "t_lost").await;
    assert_eq!(s.status, TurnStatus::Failed);
    let err = rt.entry(&r.session_id, "e_t_lost_error");
    assert_eq!(err.custom.unwrap().data["code"], "harness.turn_record_lost");
    // The session goes on: the next send needs a model again and starts a fresh turn.
    let mut next = send("again");
    next.session_id = Some(r.session_id.clone());
    let (_, end) = rt.run(next).await;
    assert_eq!(end.status, TurnStatus::Completed);
}

#[tokio::test]
async fn a_config_change_applies_at_once_and_rebinds_the_sweep() {
    use harness_bus::Bus;
    // The default sweep expression, which the tests' own configuration replaces.
    let cfg = HarnessConfig {
        sweep_expression: HarnessConfig::default().sweep_expression,
        ..config()
    };
    let rt = runtime(json!({"generations": [text_gen("ok")]}), cfg).await;
    let sweeps = |b: Vec<harness_bus::Binding>| -> Vec<serde_json::Value> {
        b.into_iter()
            .filter(|b| b.function_id == "harness::sweep-pending")
            .map(|b| b.config["expression"].clone())
            .collect()
    };
    assert_eq!(
        sweeps(rt.bus.bindings("cron").await.unwrap()),
        vec![json!("0 * * * * *")]
    );
    rt.ok("harness::on-config-change",
            json!({"id": "harness", "config": {"max_result_bytes": 2048, "sweep_expression": "*/30 * * * * *"}})).await;
    assert_eq!(rt.harness.config().max_result_bytes, 2048);
    assert_eq!(
        sweeps(rt.bus.bindings("cron").await.unwrap()),
        vec![json!("*/30 * * * * *")]
    );
    let err = rt
        .bus
        .call(
            "harness::on-config-change",
            json!({"config": {"max_result_byte": 1}}),
            None,
        )
        .await
        .unwrap_err();
    assert!(
        err.message
            .starts_with("config.max_result_byte: unknown field `max_result_byte`"),
        "{}",
        err.message
    );
    assert_eq!(
        rt.harness.config().max_result_bytes,
        2048,
        "a bad config changes nothing"
    );
    // Without a config and without a configuration worker, it is an acknowledged no-op.
    let ok = rt
        .ok("harness::on-config-change", json!({"id": "harness"}))
        .await;
    assert_eq!(ok, json!({"ok": true}));
}

#[tokio::test]
async fn a_bad_field_is_refused_even_when_the_send_would_merge() {
    let script =
        json!({"generations": [{"delay_ms": 2000, "content": [{"type": "text", "text": "slow"}]}]});
    let rt = runtime(script, config()).await;
    let r = rt.send(send("first")).await;
    let mut bad = send("second");
    bad.session_id = Some(r.session_id.clone());
    bad.model = Some(String::new());
    let err = rt.harness.send(bad).await.unwrap_err();
    assert_eq!(err.message, "model: must not be empty");
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(
        rt.messages(&r.session_id)
            .iter()
            .filter(|(role, _)| role == "user")
            .count(),
        1
    );
}

#[tokio::test]
async fn a_send_that_cannot_schedule_its_turn_fails_it_with_an_error_record_and_turn_completed() {
    // Never started: the turn queue is not defined, so the first step cannot be enqueued.
    let rt = unstarted_runtime(json!({"generations": [text_gen("never")]}), config()).await;
    let mut req = send("hello");
    req.session_id = Some("s_unscheduled".into());
    let err = rt.harness.send(req).await.unwrap_err();
    assert!(err.to_string().contains("harness-turn"), "{err}");
    let s = rt.status("s_unscheduled").await.expect("a turn record");
    assert_eq!(s.status, TurnStatus::Failed);
    let turn_id = s.turn_id.clone().unwrap();
    let events = rt.completed_events("s_unscheduled", &turn_id).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["status"], "failed");
    rt.error_detail("s_unscheduled", "harness.turn_unschedulable", "scheduling");
    assert_eq!(
        rt.messages("s_unscheduled"),
        vec![("user".into(), "hello".into())],
        "the message is kept"
    );
}

#[tokio::test]
async fn a_binding_sees_one_turn_completed_when_a_finished_step_is_delivered_again() {
    use harness_bus::{Bus, CallContext, FunctionDef};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let rt = runtime(json!({"generations": [text_gen("done")]}), config()).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    rt.bus.register_function(
        FunctionDef::new("watch::done", "counts turn-completed"),
        Arc::new(move |_p: serde_json::Value, _ctx: CallContext| {
            count.fetch_add(1, Ordering::SeqCst);
            async { Ok(serde_json::Value::Null) }
        }),
    );
    rt.trigger(
        "harness::turn-completed",
        "watch::done",
        json!({}),
        json!({}),
    )
    .await;
    let (r, _) = rt.run(send("hello")).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while seen.load(Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the binding never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // What the queue does after a crash during the step that ended the turn (a recovery step):
    // the same step is delivered again and re-runs the terminal side effects.
    let payload = harness_types::api::TurnStepPayload {
        session_id: r.session_id.clone(),
        turn_id: r.turn_id.clone(),
        step: 0,
        message_preview: None,
        depth: 0,
    };
    let out = rt.harness.step(payload).await.unwrap();
    assert!(out.skipped);
    assert_eq!(
        rt.completed_events(&r.session_id, &r.turn_id).await.len(),
        1
    );
    // A second delivery would be a spawned call: absence is only observable by waiting a while.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "one turn-completed per turn"
    );
}

#[tokio::test]
async fn unknown_and_unsupported_fields_are_refused_by_name_never_dropped() {
    use harness_bus::Bus;
    let rt = runtime(json!({"generations": [text_gen("hi")]}), config()).await;
    let call = |payload: serde_json::Value| {
        let bus = rt.bus.clone();
        async move {
            bus.call("harness::send", payload, None)
                .await
                .unwrap_err()
                .to_string()
        }
    };
    let base = |options: serde_json::Value| json!({"message": "hi", "model": "m", "provider": "scripted", "options": options});
    let e = call(base(json!({"colour": "red"}))).await;
    assert!(e.contains("options") && e.contains("colour"), "{e}");
    let e = call(base(json!({"functions": {"alow": ["*"]}}))).await;
    assert!(
        e.contains("alow"),
        "a misspelt policy never silently denies all: {e}"
    );
    let e = call(json!({"message": "hi", "model": "m", "sesion_id": "s"})).await;
    assert!(e.contains("sesion_id"), "{e}");
    for field in ["skills", "agent"] {
        let e = call(base(json!({ field: 2 }))).await;
        assert!(
            e.contains(&format!("options.{field}")) && e.contains("invalid type"),
            "{field}: {e}"
        );
    }
    let e = call(base(json!({"filesystem_root": 2}))).await;
    assert!(e.contains("options.filesystem_root"), "{e}");
    let e = call(base(json!({"mode": "chat"}))).await;
    assert!(e.contains("options.mode") && e.contains("chat"), "{e}");
    let e = rt
        .bus
        .call(
            "harness::spawn",
            json!({"task": "t", "model": "m", "display": {"name": "x", "icon": "rocket"}}),
            None,
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("display.icon"), "{e}");
    // Nothing was started by any of them.
    rt.assert_no_sessions().await;
}

#[tokio::test]
async fn a_generation_that_would_exceed_the_token_budget_fails_before_the_provider_is_called() {
    let rt = runtime(json!({"generations": [text_gen("never")]}), config()).await;
    let mut req = send("hello");
    req.options = Some(SendOptions {
        max_total_tokens: Some(100),
        max_output_tokens: Some(500),
        ..Default::default()
    });
    let (r, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Failed);
    assert!(
        rt.recorder.seen.lock().unwrap().is_empty(),
        "no provider call"
    );
    let detail = rt.error_detail(&r.session_id, "harness.budget_exceeded", "budget_preflight");
    assert!(detail.starts_with("max_total_tokens:"), "{detail}");

    // A budget that fits lets the turn run.
    let mut req = send("hello");
    req.options = Some(SendOptions {
        max_total_tokens: Some(100_000),
        max_output_tokens: Some(500),
        ..Default::default()
    });
    let (_, end) = rt.run(req).await;
    assert_eq!(end.status, TurnStatus::Completed);
}

/// `session::create` of the id a send generated creates the session and then answers late (a
/// timeout, as over an engine): the retry is told the session already exists, which is its own
/// first attempt, so the send succeeds and the turn runs once in one session.
#[tokio::test]
async fn a_create_that_answered_late_is_not_retried_into_already_exists() {
    use harness_bus::Bus;
    let rt = replying("Hello back.").await;
    let sessions = rt.sessions.clone();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    rt.bus.register_function(
        harness_bus::FunctionDef::new("session::create", "creates, then answers late once"),
        std::sync::Arc::new(
            move |p: serde_json::Value, _ctx: harness_bus::CallContext| {
                let sessions = sessions.clone();
                let first = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
                async move {
                    let req = serde_json::from_value(p).expect("a create request");
                    let created = sessions.create(req).await;
                    if first {
                        return Err(harness_bus::BusError::timeout("session::create", 10));
                    }
                    created
                        .map(|r| serde_json::to_value(r).unwrap())
                        .map_err(|e| match e {
                            harness_session::SessionError::Harness(h) => {
                                harness_bus::BusError::new(h.code.as_str(), h.message)
                            }
                            other => harness_bus::BusError::internal(other.to_string()),
                        })
                }
            },
        ),
    );
    let r = rt
        .harness
        .send(send("hello"))
        .await
        .expect("the send succeeds");
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "retried once"
    );
    let done = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(done.status, TurnStatus::Completed);
    assert_eq!(
        rt.messages(&r.session_id),
        vec![
            ("user".to_string(), "hello".to_string()),
            ("assistant".to_string(), "Hello back.".to_string())
        ]
    );
}

#[tokio::test]
async fn a_text_turn_is_three_store_writes_send_step_and_ack() {
    // The embedded runtime's transactional session functions, as `harness serve` registers them;
    // no partial write of the streamed reply, however slow the machine.
    // Usage announcements write once at a milestone turn (the second turn is one); they are
    // counted by `usage.rs`'s own tests, not here.
    let config = HarnessConfig {
        stream_coalesce_ms: 60_000,
        usage_reporting: false,
        ..config()
    };
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config).await;
    harness_session::register_transactional(&rt.bus, &rt.sessions);
    let (first, _) = rt.run(send("hello")).await;
    let before = rt.writes_once_idle().await;
    let mut req = send("again");
    req.session_id = Some(first.session_id.clone());
    let (second, end) = rt.run(req).await;
    assert_eq!(end.status, TurnStatus::Completed);
    // The send's message, turn record and first step are one write; the step's start (status,
    // assistant entry), held while the model answers within `first_write_hold_ms`, is written
    // with its end; the queue acks the step.
    assert_eq!(rt.writes_once_idle().await - before, 3);
    assert_eq!(
        rt.messages(&second.session_id),
        vec![
            ("user".into(), "hello".into()),
            ("assistant".into(), "ok".into()),
            ("user".into(), "again".into()),
            ("assistant".into(), "ok".into())
        ]
    );
}

/// No partial writes, no usage announcements; the step's first write held for `hold_ms`.
fn holding(hold_ms: u64) -> HarnessConfig {
    HarnessConfig {
        stream_coalesce_ms: 60_000,
        usage_reporting: false,
        first_write_hold_ms: hold_ms,
        ..config()
    }
}

/// Waits until the model was asked `n` times.
async fn asked(rt: &Rt, n: usize) {
    until("the model is asked", || {
        rt.recorder.seen.lock().unwrap().len() >= n
    })
    .await;
}

/// Sends `text` to the running turn of `sid`, which queues it (lock-free).
async fn steer(rt: &Rt, sid: &str, text: &str) {
    let mut more = send(text);
    more.session_id = Some(sid.to_string());
    let steered = rt.send(more).await;
    assert_eq!((steered.merged, steered.queued), (Some(true), Some(true)));
}

/// The id of the entry whose message says `text`.
fn entry_saying(rt: &Rt, sid: &str, text: &str) -> String {
    rt.entries(sid)
        .into_iter()
        .find(|e| {
            e.message
                .as_ref()
                .is_some_and(|m| harness_types::message::joined_text(m.content()) == text)
        })
        .map(|e| e.entry_id)
        .unwrap_or_else(|| panic!("no entry says {text:?}"))
}

fn session_status(meta: &serde_json::Value) -> String {
    meta["meta"]["status"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn a_model_slower_than_the_hold_finds_the_step_start_written_while_it_answers() {
    let script = json!({"generations": [{"repeat": true, "delay_ms": 1500, "content": [{"type": "text", "text": "late"}]}]});
    let rt = runtime(script, holding(20)).await;
    harness_session::register_transactional(&rt.bus, &rt.sessions);
    let (first, _) = rt.run(send("hello")).await;
    let before = rt.writes_once_idle().await;
    let mut req = send("again");
    req.session_id = Some(first.session_id.clone());
    let r = rt.send(req).await;
    asked(&rt, 2).await;
    let sid = r.session_id.clone();
    let entry = format!("e_{}_0_assistant", r.turn_id);
    until("the assistant entry is written", || {
        rt.entry_ids(&sid).contains(&entry)
    })
    .await;
    let meta = rt.ok("session::get", json!({"session_id": sid})).await;
    assert_eq!(session_status(&meta), "working", "{meta}");
    let running = rt.status(&sid).await.unwrap();
    assert_eq!(
        running.status,
        TurnStatus::Running,
        "written before the answer"
    );
    let s = rt.wait_terminal(&sid, &r.turn_id).await;
    assert_eq!(s.result, Some(json!("late")));
    // The step's start and end are two writes again.
    assert_eq!(rt.writes_once_idle().await - before, 4);
}

/// The hold is a number of milliseconds an operator may set as large as it parses: the
/// largest one holds the write through the answer, it does not overflow the clock.
#[tokio::test]
async fn the_largest_hold_an_operator_can_set_holds_through_the_answer() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), holding(u64::MAX)).await;
    let (r, s) = rt.run(send("hello")).await;
    assert_eq!(
        (s.status, s.result),
        (TurnStatus::Completed, Some(json!("ok")))
    );
    assert_eq!(
        rt.messages(&r.session_id),
        vec![
            ("user".into(), "hello".into()),
            ("assistant".into(), "ok".into())
        ]
    );
}

#[tokio::test]
async fn a_stop_while_the_first_write_is_held_keeps_the_entry_ahead_of_what_the_end_writes() {
    // Held for the whole answer: nothing of the step is written before it ends.
    let script = json!({"generations": [
        {"match": {"last_user_text": "^first$"}, "repeat": true, "delay_ms": 30000, "content": [{"type": "text", "text": "never"}]}
    ]});
    let rt = runtime(script, holding(600_000)).await;
    let r = rt.send(send("first")).await;
    let sid = r.session_id.clone();
    asked(&rt, 1).await;
    let entry = format!("e_{}_0_assistant", r.turn_id);
    assert!(!rt.entry_ids(&sid).contains(&entry), "the start is held");
    // A steering message parks without the session lock while the write is held.
    steer(&rt, &sid, "and more").await;
    assert!(rt.stop(&sid).await.stopping);
    let s = rt.wait_terminal(&sid, &r.turn_id).await;
    assert_eq!(s.status, TurnStatus::Cancelled);
    // The held entry first, then the steering row the end delivered, then the stop notice.
    let ids = rt.entry_ids(&sid);
    let at = |id: &str| ids.iter().position(|e| e == id);
    let stopped = format!("e_{}_stopped", r.turn_id);
    let steering = entry_saying(&rt, &sid, "and more");
    assert!(at(&entry).is_some(), "{ids:?}");
    assert!(at(&entry) < at(&steering), "{ids:?}");
    assert!(at(&steering) < at(&stopped), "{ids:?}");
    let meta = rt.ok("session::get", json!({"session_id": sid})).await;
    assert_eq!(session_status(&meta), "done", "not left working: {meta}");
    let topics: Vec<String> = rt.topics(&sid).into_iter().map(|(t, _)| t).collect();
    let started = topics.iter().position(|t| t == "harness::turn-started");
    let completed = topics.iter().position(|t| t == "harness::turn-completed");
    assert!(started.is_some() && started < completed, "{topics:?}");
    assert_eq!(
        topics
            .iter()
            .filter(|t| *t == "harness::turn-completed")
            .count(),
        1
    );
}

/// A generation that fails with nothing streamed ends the turn at once: the steering message
/// that came meanwhile is delivered by the end's batch, which also carries the held start
/// (and then gets a turn of its own).
#[tokio::test]
async fn a_failed_answer_keeps_its_held_entry_ahead_of_the_steering_its_end_delivers() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "^first$"}, "repeat": true, "delay_ms": 300,
         "error": {"kind": "permanent", "message": "refused"}},
        {"match": {"last_user_text": "^and more$"}, "repeat": true, "content": [{"type": "text", "text": "ok"}]}
    ]});
    let rt = runtime(script, holding(600_000)).await;
    let r = rt.send(send("first")).await;
    let sid = r.session_id.clone();
    asked(&rt, 1).await;
    steer(&rt, &sid, "and more").await;
    let ended = rt.completed_events(&sid, &r.turn_id).await;
    assert_eq!(ended[0]["status"], "failed", "{ended:?}");
    let ids = rt.entry_ids(&sid);
    let at = |id: &str| ids.iter().position(|e| e == id);
    let entry = format!("e_{}_0_assistant", r.turn_id);
    let steering = entry_saying(&rt, &sid, "and more");
    assert!(at(&entry).is_some(), "{ids:?}");
    assert!(at(&entry) < at(&steering), "{ids:?}");
}

/// With `max_turns: 1` a reply the provider cut is still resumed: the resume finishes the one
/// generation the turn has, it is no second one.
#[tokio::test]
async fn a_cut_reply_is_resumed_within_max_turns_one() {
    let script = json!({"generations": [
        {"error": {"kind": "transient", "message": "upstream reset", "after_text": "Partial answer "}},
        {"content": [{"type": "text", "text": "Complete answer."}]}
    ]});
    let rt = runtime(script, config()).await;
    let mut req = send("q");
    req.options = Some(SendOptions {
        max_turns: Some(1),
        ..Default::default()
    });
    let (_, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.stop_reason, None);
    assert_eq!((s.turn_count, s.transient_resumes), (1, 1));
    assert_eq!(s.result, Some(json!("Complete answer.")));
    assert_eq!(rt.recorder.seen.lock().unwrap().len(), 2);
}
