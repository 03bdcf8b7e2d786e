//! The end-to-end scenarios of the embedded mode, in iii mode: a real `harness worker --with all`
//! process against the in-test engine double (tests/iii_engine), which answers with the shapes
//! recorded from a real engine, or against a real engine binary when `III_BIN=/path/to/iii` is
//! set (then the engine crash is a real SIGKILL of it). Every call the test makes goes through
//! the engine, decorated with `_caller_worker_id` like any routed payload.
#![cfg(feature = "iii")]

mod iii_engine;
#[path = "common/iii_scenarios.rs"]
mod iii_scenarios;
#[path = "common/scripts.rs"]
mod scripts;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use iii_engine::worker::{Sessions, WorkerProc, WAIT};
use iii_engine::Engine;
use iii_scenarios::{assert_text_turn, start_slow_work, start_worker};
use scripts::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_turn_streams_through_the_engine() {
    let engine = Engine::start().await;
    // The worker's calls to its own router go through the engine here (by default they run
    // in-process: `the_workers_calls_to_its_own_functions_run_in_process`), so the streaming
    // path over the engine is what is tested.
    let _worker = WorkerProc::start(
        &engine,
        &script(vec![text_gen(None, "Hello from the iii side.", 5, true)]),
        &["--stream-coalesce-ms", "0", "--self-calls", "engine"],
    )
    .await;
    assert_text_turn(&engine, "s_text", "Hello from the iii side.").await;
    // The frames went caller ← callee through the engine, to the worker's frame sink (only
    // visible inside the double).
    if !engine.is_real() {
        // The frames went caller ← callee through the engine, to the worker's frame sink.
        let frames: Vec<Value> = engine
            .received()
            .into_iter()
            .filter(|m| {
                m["type"] == "invokefunction"
                    && m["function_id"]
                        .as_str()
                        .is_some_and(|f| f.starts_with("harness::frames::"))
            })
            .collect();
        assert!(
            !frames.is_empty(),
            "router::chat frames travel through the engine"
        );
        let kinds: Vec<String> = frames
            .iter()
            .flat_map(|m| m["data"]["frames"].as_array().cloned().unwrap_or_default())
            .filter_map(|f| f["type"].as_str().map(str::to_string))
            .collect();
        assert_eq!(kinds.last().map(String::as_str), Some("done"), "{kinds:?}");
        // The step ran on the engine's topic queue, through the delivery function.
        assert!(engine
            .received()
            .iter()
            .any(|m| m["type"] == "registertrigger"
                && m["trigger_type"] == "durable:subscriber"
                && m["config"]["topic"] == "harness-turn"));
    }
    // Bad input still names the field, through the engine's decoration.
    let err = engine
        .call(
            "harness::send",
            json!({"session_id": 5, "message": "x", "model": "m", "provider": "scripted"}),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, "harness/invalid_request", "{err:?}");
    assert!(err.message.contains("session_id"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_call_runs_exactly_once() {
    let engine = Engine::start().await;
    let fx = Fixtures::new(json!([{"id": "f::a", "description": "a", "response": {"ok": "a"}}]));
    let _worker = start_worker(
        &engine,
        &script(vec![
            call_gen("run a", "c1", "f::a", json!({"n": 1})),
            text_gen(None, "a is done", 0, true),
        ]),
        &fx,
        &[],
    )
    .await;
    let status = engine.send_and_wait("s_call", "run a", &["f::*"]).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(
        invocations(&fx.log()),
        HashMap::from([("c1".to_string(), 1)])
    );
    let entries = engine.transcript("s_call", false).await;
    assert_every_call_closed(&entries);
    let result = entries
        .iter()
        .find(|e| role_of(e) == Some("function_result"))
        .unwrap();
    assert_eq!(result["message"]["is_error"], false, "{result}");
    assert_eq!(text_of(entries.last().unwrap()), "a is done");
}

/// The log line of the worker's adapter for a call to one of its own functions that goes out to
/// the engine and back (debug level, which the test workers log).
const SELF_CALL_ROUTED: &str = "a call to this worker's own function goes through the engine";

/// A turn whose steps call the worker's own functions (`--with all`: the transcript store, the
/// context manager, the router and its frames, a fixture function the model calls): none of
/// those calls reaches the engine, and the turn completes. The double counts the invocations a
/// worker sends for its own functions; a real engine cannot, so there the worker's own account
/// (its log) is what is checked. Then the same worker with `--self-calls engine`: the same
/// calls do reach the engine (the counts above are not blind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_calls_to_its_own_functions_run_in_process() {
    let engine = Engine::start().await;
    let fx =
        Fixtures::new(json!([{"id": "f::own", "description": "own", "response": {"ok": "own"}}]));
    let mut worker = start_worker(
        &engine,
        &script(vec![
            call_gen("^run own$", "c1", "f::own", json!({"n": 1})),
            call_gen("^run own again$", "c2", "f::own", json!({"n": 2})),
            text_gen(None, "own is done", 2, true),
        ]),
        &fx,
        &["--stream-coalesce-ms", "0"],
    )
    .await;
    let own: Vec<String> = {
        let mut ids: Vec<String> = engine.functions().into_keys().collect();
        ids.retain(|id| {
            id.starts_with("session::")
                || id.starts_with("router::")
                || id.starts_with("context::")
                || id.starts_with("harness::frames::")
                || id == "f::own"
        });
        ids
    };
    if !engine.is_real() {
        assert!(own.iter().any(|id| id == "router::chat"), "{own:?}");
    }

    let turn = |session: &'static str, text: &'static str| {
        let engine = engine.clone();
        async move {
            let status = engine.send_and_wait(session, text, &["f::*"]).await;
            assert_eq!(status["status"], "completed", "{status}");
            assert_eq!(status["result"], "own is done", "{status}");
            let entries = engine.transcript(session, false).await;
            assert_every_call_closed(&entries);
            assert_eq!(
                text_of(entries.last().unwrap()),
                "own is done",
                "{}",
                render(&entries)
            );
        }
    };
    let routed_since = |from: usize| -> Vec<String> {
        engine.self_invocations()[from..]
            .iter()
            .filter(|(_, action)| action.is_empty())
            .map(|(id, _)| id.clone())
            .collect()
    };

    let (mark, log_at) = (engine.self_invocations().len(), worker.log().len());
    turn("s_own", "run own").await;
    assert_eq!(
        invocations(&fx.log()),
        HashMap::from([("c1".to_string(), 1)])
    );
    let log = worker.log();
    let routed_log: Vec<&str> = log[log_at..]
        .lines()
        .filter(|l| l.contains(SELF_CALL_ROUTED))
        .collect();
    assert!(routed_log.is_empty(), "{routed_log:#?}");
    if !engine.is_real() {
        let routed = routed_since(mark);
        assert!(routed.is_empty(), "reached the engine: {routed:?}");
    }

    // The same calls, made through the engine: the double sees them, the worker says so.
    worker.set_env("HARNESS_III_SELF_CALLS", Some("engine"));
    worker.restart().await;
    let (mark, log_at) = (engine.self_invocations().len(), worker.log().len());
    turn("s_own_routed", "run own again").await;
    assert_eq!(
        invocations(&fx.log()),
        HashMap::from([("c1".to_string(), 1), ("c2".to_string(), 1)])
    );
    let log = worker.log();
    let routed_log = log[log_at..]
        .lines()
        .filter(|l| l.contains(SELF_CALL_ROUTED))
        .count();
    assert!(routed_log > 0, "the worker logs its routed own calls");
    if !engine.is_real() {
        let routed = routed_since(mark);
        for id in ["session::append", "router::chat", "f::own"] {
            assert!(
                routed.iter().any(|r| r == id),
                "{id} not routed: {routed:?}"
            );
        }
        assert!(
            routed.iter().any(|r| r.starts_with("harness::frames::")),
            "{routed:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_call_the_call_runs_once_and_is_closed_as_interrupted() {
    let engine = Engine::start().await;
    iii_scenarios::killed_mid_call(&engine, "s_slow", &[], |_| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_call_runs_once_after_release() {
    let engine = Engine::start().await;
    let fx = Fixtures::new(
        json!([{"id": "fs::write", "description": "write", "response": {"ok": true}}]),
    );
    let _worker = start_worker(
        &engine,
        &script(vec![
            call_gen(
                "write it",
                "c1",
                "fs::write",
                json!({"path": "/tmp/a", "text": "hi"}),
            ),
            text_gen(None, "written", 0, true),
        ]),
        &fx,
        &[],
    )
    .await;
    // A hook that holds, bound through the engine: the engine forwards the binding to the
    // harness worker, which owns the hook trigger types.
    let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = held.clone();
    engine.register_local("guard::hold", move |p| {
        assert!(p["call"]["function_id"] == "fs::write", "{p}");
        h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(json!({"decision": "hold"}))
    });
    let bound = engine
        .ok(
            "engine::register_trigger",
            json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "guard::hold", "config": {"functions": ["fs::*"]}}),
        )
        .await;
    let id = bound["id"].as_str().unwrap();
    let ack = engine.wait_trigger_result(id, WAIT).await;
    assert!(
        ack["error"].is_null(),
        "the worker accepted the binding: {ack}"
    );

    let turn_id = engine.send("s_hold", "write it", &["fs::*"]).await;
    let s = engine.wait_status("s_hold", "awaiting_functions").await;
    assert_eq!(s["pending_function_calls"], json!(["c1"]), "{s}");
    assert!(invocations(&fx.log()).is_empty(), "nothing runs while held");

    let out = engine
        .ok(
            "harness::function::resolve",
            json!({"session_id": "s_hold", "turn_id": turn_id, "function_call_id": "c1", "action": "execute"}),
        )
        .await;
    assert_eq!(
        (out["resolved"].clone(), out["turn_resumed"].clone()),
        (json!(true), json!(true)),
        "{out}"
    );
    let status = engine.wait_turn("s_hold", &turn_id).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(
        invocations(&fx.log()),
        HashMap::from([("c1".to_string(), 1)])
    );
    assert_eq!(
        held.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the holder is not re-run"
    );
    assert_every_call_closed(&engine.transcript("s_hold", false).await);

    // Unbinding through the engine reaches the worker too: the next call runs without a hold.
    engine
        .ok("engine::unregister_trigger", json!({"id": id}))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_connection_replays_registrations_and_the_turn_completes_once() {
    const STORY: &str =
        "Once upon a time a durable loop lost its link to the engine, reconnected, \
        and finished the story without repeating itself.";
    let engine = Engine::start().await;
    let _worker = WorkerProc::start(
        &engine,
        &script(vec![
            text_gen(Some("^marker$"), "marker reply", 0, true),
            // `repeat`: the generation cut by the dropped link is asked again when the step
            // resumes.
            text_gen(None, STORY, 60, true),
        ]),
        &["--stream-coalesce-ms", "0"],
    )
    .await;
    let turn_id = engine.send("s_drop", "tell me a story", &[]).await;
    // Mid-stream: some of the story is in the transcript, not all of it.
    let deadline = Instant::now() + WAIT;
    loop {
        let entries = engine.transcript("s_drop", false).await;
        let partial = entries
            .iter()
            .find(|e| role_of(e) == Some("assistant"))
            .map(text_of)
            .unwrap_or_default();
        if !partial.is_empty() && partial.len() < STORY.len() {
            break;
        }
        assert!(Instant::now() < deadline, "no partial reply");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if engine.is_real() {
        // A real engine cannot drop one connection on request: it dies and comes back.
        engine.crash().await;
    } else {
        assert_eq!(engine.drop_workers("harness"), 1, "one harness connection");
    }
    // The SDK reconnects and replays its registrations; the engine failed the in-flight step
    // (invocation_stopped) and retries it; the worker redrives after the reconnect.
    engine.wait_function("harness::send", WAIT).await;
    let status = engine.wait_turn("s_drop", &turn_id).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["result"], json!(STORY));
    // The cut generation resumed as after a crash of the worker (asked again, never failed):
    // no assistant entry ended in an error, the user's message is there once, and the turn
    // ends with the whole story.
    assert!(
        !engine
            .transcript("s_drop", false)
            .await
            .iter()
            .any(|e| e["message"]["stop_reason"] == "error"),
        "a lost link never fails a generation"
    );
    let entries = engine.transcript("s_drop", false).await;
    let asked = entries
        .iter()
        .filter(|e| role_of(e) == Some("user") && text_of(e) == "tell me a story")
        .count();
    assert_eq!(asked, 1, "{}", render(&entries));
    assert_eq!(
        text_of(entries.last().unwrap()),
        STORY,
        "{}",
        render(&entries)
    );
    // A later turn works on the replayed registrations.
    let marker = engine.send_and_wait("s_drop", "marker", &[]).await;
    assert_eq!(marker["status"], "completed");
    if !engine.is_real() {
        assert_eq!(engine.connected_workers("harness"), 1);
    }
}

/// The engine's state is not durable for its last seconds (5 s flush): here the turn record of a
/// parked turn is lost. Releasing the held call must not run the target, and the session must
/// stay usable: a lost record costs the turn, never a side effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_turn_record_never_runs_a_held_call_and_the_session_recovers() {
    let engine = Engine::start().await;
    let fx = Fixtures::new(
        json!([{"id": "fs::write", "description": "write", "response": {"ok": true}}]),
    );
    let mut worker = start_worker(
        &engine,
        &script(vec![
            call_gen("write it", "c1", "fs::write", json!({"path": "/tmp/a"})),
            text_gen(None, "fresh start", 0, true),
        ]),
        &fx,
        &[],
    )
    .await;
    engine.register_local("guard::hold", |_| Ok(json!({"decision": "hold"})));
    let bound = engine
        .ok(
            "engine::register_trigger",
            json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "guard::hold", "config": {"functions": ["fs::*"]}}),
        )
        .await;
    engine
        .wait_trigger_result(bound["id"].as_str().unwrap(), WAIT)
        .await;
    let turn_id = engine.send("s_lost", "write it", &["fs::*"]).await;
    engine.wait_status("s_lost", "awaiting_functions").await;
    assert!(engine.state("harness_turn", "s_lost").await.is_some());

    // The engine dies before flushing: the record is gone; the worker restarts too, without
    // its write-ahead copy (a new machine, or the file lost with the old one), so nothing
    // can give the record back.
    engine.set_state("harness_turn", "s_lost", None).await;
    worker.kill();
    for file in [
        "iii-write-ahead.db",
        "iii-write-ahead.db-wal",
        "iii-write-ahead.db-shm",
    ] {
        let _ = std::fs::remove_file(worker.dir().join("data").join(file));
    }
    worker.restart().await;
    let out = engine
        .call(
            "harness::function::resolve",
            json!({"session_id": "s_lost", "turn_id": turn_id, "function_call_id": "c1", "action": "execute"}),
        )
        .await;
    if let Ok(v) = &out {
        assert_ne!(
            v["resolved"], true,
            "nothing to resolve without the record: {v}"
        );
    }
    assert!(
        invocations(&fx.log()).is_empty(),
        "the held target never ran"
    );

    // The session takes a new turn.
    engine
        .ok("engine::unregister_trigger", json!({"id": bound["id"]}))
        .await;
    let t2 = engine.send("s_lost", "start over", &[]).await;
    assert_ne!(t2, turn_id);
    let s = engine.wait_turn("s_lost", &t2).await;
    assert_eq!(s["status"], "completed", "{s}");
    assert!(invocations(&fx.log()).is_empty(), "no target ran at all");
}

/// The engine dies (SIGKILL) while a call runs, inside its 5 s flush window: the turn record
/// and the call's checkpoint it wrote last are gone from the restarted engine, and so is the
/// hook binding (the engine keeps bindings in memory). The worker gives the engine back what
/// it lost from its write-ahead copy, forgets the binding, and resumes the step as a crash
/// would: the turn completes, the call ran once and is closed once (as interrupted), the hook
/// ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_crash_inside_its_flush_window_loses_no_turn_and_runs_nothing_twice() {
    engine_crash_mid_call(FlushWindow::Inside).await;
}

/// The same crash once the engine has flushed everything the turn wrote before the call (its
/// flush runs every 5 s): the engine keeps the turn but still forgets the hook binding. The
/// turn completes, the call ran once and is closed once (as interrupted), the hook ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_crash_after_its_flush_loses_no_turn_and_runs_nothing_twice() {
    engine_crash_mid_call(FlushWindow::After).await;
}

/// When the engine dies relative to its last flush of the turn's writes.
#[derive(Clone, Copy, PartialEq)]
enum FlushWindow {
    /// Before any flush of the turn (the double's flush is held; a real engine is killed within
    /// its 5 s period).
    Inside,
    /// More than one flush period after the call started.
    After,
}

async fn engine_crash_mid_call(window: FlushWindow) {
    let engine = Engine::start().await;
    let delay_ms = match window {
        FlushWindow::Inside => {
            engine.hold_flush();
            4000
        }
        FlushWindow::After => 9000,
    };
    let fx = slow_work(delay_ms);
    let worker = start_worker(&engine, &slow_work_script(vec![]), &fx, &[]).await;
    let hooked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = hooked.clone();
    engine.register_local("guard::count", move |_| {
        h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(json!({"decision": "continue"}))
    });
    let bound = engine
        .ok(
            "engine::register_trigger",
            json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "guard::count", "config": {"functions": ["slow::*"]}}),
        )
        .await;
    engine
        .wait_trigger_result(bound["id"].as_str().unwrap(), WAIT)
        .await;
    // What a crash keeps: everything up to here, nothing of the turn.
    engine.flush();
    let turn_id = start_slow_work(&engine, &fx, "s_crash").await;
    if window == FlushWindow::After {
        // One flush period and a second: the engine flushed after the turn's last write.
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(invocations(&fx.log()).get("c1"), Some(&1), "still running");
    }
    let killed_at = Instant::now();
    engine.crash().await;
    eprintln!("engine killed and restarted in {:?}", killed_at.elapsed());
    let status = engine.wait_turn("s_crash", &turn_id).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(
        hooked.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the hook ran once (and its binding is gone with the engine's memory)"
    );
    let entries = engine.transcript("s_crash", false).await;
    assert_slow_work_interrupted(&fx, &entries);
    let restored = worker
        .log()
        .contains("written again from the write-ahead copy");
    eprintln!("write-ahead copy used after the engine crash: {restored}");
    if window == FlushWindow::After {
        // What the test is for: the engine had flushed the turn, so nothing had to be given back.
        assert!(!restored, "{}", worker.log());
    }
    if !engine.is_real() {
        let log = worker.log();
        if window == FlushWindow::Inside {
            // The double's flush was held: the turn survived through the write-ahead copy.
            assert!(
                log.contains("written again from the write-ahead copy"),
                "{log}"
            );
        }
        assert!(log.contains("no longer has some bindings"), "{log}");
    }
}

/// The worker and the engine die together (SIGKILL both) while a call runs, inside the
/// engine's flush window: the restarted engine has lost the turn record, and the worker's
/// memory is gone too. The restarted worker finds the write-ahead copy in its SQLite file
/// beside its store, gives the engine the turn back before anything runs, and the turn
/// completes: the call ran once and is closed once, as interrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_with_the_engine_gets_the_lost_turn_back_from_its_sqlite_copy() {
    let engine = Engine::start().await;
    engine.hold_flush();
    let fx = slow_work(4000);
    let mut worker = start_worker(&engine, &slow_work_script(vec![]), &fx, &[]).await;
    // What a crash keeps: everything up to here, nothing of the turn.
    engine.flush();
    let turn_id = start_slow_work(&engine, &fx, "s_both").await;
    worker.kill();
    engine.crash().await;
    if !engine.is_real() {
        assert_eq!(
            engine.state("harness_turn", "s_both").await,
            None,
            "the engine lost the turn record"
        );
    }
    worker.restart().await;
    let entries = engine.completed_transcript("s_both", &turn_id).await;
    assert_slow_work_interrupted(&fx, &entries);
    assert!(
        worker.dir().join("data/iii-write-ahead.db").exists(),
        "the copy is a file beside the store"
    );
    if !engine.is_real() {
        let log = worker.log();
        assert!(
            log.contains("written again from the write-ahead copy"),
            "{log}"
        );
    }
}

/// The public surface appears on the engine only once the worker can serve it: after the
/// turn queue's subscribers are bound and the siblings and internal functions are registered
/// (and listed: the worker asks with `include_internal`, as the engine hides internal ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_functions_are_registered_only_once_the_worker_can_serve_them() {
    let engine = Engine::start().await;
    let _worker = WorkerProc::start(
        &engine,
        &script(vec![text_gen(None, "ready", 0, true)]),
        &[],
    )
    .await;
    let status = engine.send_and_wait("s_ready", "hi", &[]).await;
    assert_eq!(status["status"], "completed", "{status}");
    if engine.is_real() {
        return; // the frames below are only visible inside the double
    }
    let frames = engine.received();
    let at = |f: &dyn Fn(&Value) -> bool| frames.iter().position(f);
    let public = at(&|m| m["type"] == "registerfunction" && m["id"] == "harness::send")
        .expect("harness::send registered");
    let last_subscriber = frames
        .iter()
        .rposition(|m| m["type"] == "registertrigger" && m["trigger_type"] == "durable:subscriber")
        .expect("the turn queue is bound");
    let internal = at(&|m| m["type"] == "registerfunction" && m["id"] == "harness::turn").unwrap();
    let sibling = at(&|m| m["type"] == "registerfunction" && m["id"] == "session::append").unwrap();
    assert!(
        last_subscriber < public && internal < public && sibling < public,
        "harness::send at frame {public}, queue bound at {last_subscriber}, harness::turn at {internal}, session::append at {sibling}"
    );
    assert!(
        engine.violations().is_empty(),
        "engine functions used without a recorded shape: {:?}",
        engine.violations()
    );
}

/// The double answers engine functions only with shapes recorded from a real engine: one
/// that was never recorded is refused (so an adapter relying on it fails its tests), and
/// every recorded answer of the double matches the engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_double_refuses_engine_functions_without_a_recorded_shape() {
    let engine = Engine::start_double().await;
    assert!(
        iii_engine::recorded()["engine_version"]
            .as_str()
            .is_some_and(|v| !v.is_empty()),
        "the recording names the engine version"
    );
    let err = engine
        .call("engine::workers::list", json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.code, "double/unrecorded", "{err:?}");
    assert_eq!(engine.violations().len(), 1, "{:?}", engine.violations());
    // Every recorded request, asked of the double, gets an answer of the engine's shape.
    let functions = iii_engine::recorded()["functions"].as_object().unwrap();
    for (function_id, examples) in functions {
        if !iii_engine::is_engine_function(function_id)
            || function_id == "engine::workers::register"
        {
            continue;
        }
        for ex in examples.as_array().unwrap() {
            let _ = engine.call(function_id, ex["request"].clone()).await;
        }
    }
    let violations: Vec<String> = engine.violations().into_iter().skip(1).collect();
    assert!(violations.is_empty(), "{violations:#?}");
}

/// `--queue-mode shards`: the turn queue is `concurrency` FIFO topics, a session always on the
/// same one, and turns still complete (several sessions at once, sharing shards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_fifo_shards_every_session_keeps_one_shard_and_its_turns_complete() {
    let engine = Engine::start().await;
    let _worker = WorkerProc::start(
        &engine,
        &script(vec![text_gen(None, "sharded", 0, true)]),
        &["--queue-mode", "shards", "--queue-shards", "2"],
    )
    .await;
    let mut turns = Vec::new();
    for i in 0..5 {
        let sid = format!("s_shard_{i}");
        let turn = engine.send(&sid, "hi", &[]).await;
        turns.push((sid, turn));
    }
    for (sid, turn) in &turns {
        let s = engine.wait_turn(sid, turn).await;
        assert_eq!(s["status"], "completed", "{s}");
    }
    if !engine.is_real() {
        let topics: std::collections::BTreeSet<String> = engine
            .received()
            .iter()
            .filter(|m| m["type"] == "registertrigger" && m["trigger_type"] == "durable:subscriber")
            .map(|m| {
                assert_eq!(m["config"]["queue_config"]["type"], "fifo", "{m}");
                m["config"]["topic"].as_str().unwrap().to_string()
            })
            .collect();
        // Both durable queues (steps, and session tree deletions) are sharded the same way.
        assert_eq!(
            topics,
            [
                "harness-session-deletion.0",
                "harness-session-deletion.1",
                "harness-turn.0",
                "harness-turn.1"
            ]
            .map(String::from)
            .into(),
        );
    }
}

/// The real MCP server of the harness-mcp tests (a bin of that package: `cargo build
/// --workspace --all-targets`, as CI does, builds it next to the harness binary).
fn mcp_fixture() -> std::path::PathBuf {
    let bin = std::path::Path::new(iii_engine::worker::BIN);
    let fixture = bin.with_file_name("harness-mcp-fixture");
    assert!(
        fixture.exists(),
        "{} is missing: build it with `cargo build -p harness-mcp --features fixture --bins` (the workspace build of all targets does)",
        fixture.display()
    );
    fixture
}

/// `harness worker` starts the configured MCP servers like `serve` does: their tools become
/// functions of the worker on the engine, with their schemas, and a turn calls one through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_serves_the_configured_mcp_servers_tools_through_the_engine() {
    let engine = Engine::start().await;
    let cfg_dir = tempfile::tempdir().unwrap();
    let config = cfg_dir.path().join("harness.json");
    std::fs::write(
        &config,
        json!({"mcp_servers": {"fx": {"command": mcp_fixture()}}}).to_string(),
    )
    .unwrap();
    let worker = WorkerProc::start(
        &engine,
        &script(vec![
            call_gen(
                "echo it",
                "m1",
                "mcp::fx::echo",
                json!({"text": "through the engine"}),
            ),
            text_gen(None, "echoed", 0, true),
        ]),
        &["--config", config.to_str().unwrap()],
    )
    .await;
    engine.wait_function("mcp::fx::echo", WAIT).await;
    if !engine.is_real() {
        let def = &engine.functions()["mcp::fx::echo"];
        assert_eq!(
            def["request_format"]["properties"]["text"]["type"], "string",
            "the tool's input schema is the function's request schema: {def}"
        );
    }
    let status = engine
        .send_and_wait("s_mcp", "echo it", &["mcp::fx::*"])
        .await;
    assert_eq!(status["status"], "completed", "{status}\n{}", worker.log());
    let entries = engine.transcript("s_mcp", false).await;
    assert_every_call_closed(&entries);
    let result = entries
        .iter()
        .find(|e| role_of(e) == Some("function_result"))
        .expect("a function result");
    assert_eq!(result["message"]["is_error"], false, "{result}");
    assert_eq!(text_of(result), "echo: through the engine", "{result}");
}
