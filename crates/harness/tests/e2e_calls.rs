//! Function calls under crashes, with real processes: every target runs at most once, and every
//! call the model made ends with exactly one result.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn send_body(session_id: &str, text: &str, allow: &[&str]) -> Value {
    json!({"session_id": session_id, "message": text, "model": "m", "provider": "scripted",
           "options": {"functions": {"allow": allow, "expose": "native"}}})
}

async fn wait_settled(server: &Server, session_id: &str) -> Value {
    wait_for("the turn to end", WAIT, || async {
        let s = server.status(session_id).await;
        (!s.is_null() && is_terminal(&s)).then_some(s)
    })
    .await
}

/// After a crash at `point`: no target ran twice, and every call in the session's transcript
/// has its one result. Returns the runs per target and the transcript.
async fn ran_once_and_closed(
    point: &str,
    server: &Server,
    fx: &Fixtures,
    sid: &str,
) -> (HashMap<String, usize>, Vec<Value>) {
    let ran = invocations(&fx.log());
    assert!(
        ran.values().all(|n| *n == 1),
        "{point}: a target ran twice: {ran:?}"
    );
    let entries = server.transcript(sid, false).await;
    assert_every_call_closed(&entries);
    (ran, entries)
}

/// A server whose model calls `slow::work` (it takes 10 s) on "do the work" and then says the
/// job was interrupted; `body` is sent, and the server is SIGKILLed while the call runs and
/// started again. Returns the server, the fixtures and the turn's id.
async fn killed_while_slow_work_runs(body: Value) -> (Server, Fixtures, String) {
    let fx = slow_work(10_000);
    let script = slow_work_script(vec![]);
    let extra = fx.args();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut server = Server::start(&script, &extra).await;
    let sent = server.ok("harness::send", body).await;
    let turn_id = sent["turn_id"].as_str().unwrap().to_string();
    wait_for("the fixture log to show the call", WAIT, || async {
        (invocations(&fx.log()).get("c1") == Some(&1)).then_some(())
    })
    .await;
    server.kill();
    server.restart().await;
    (server, fx, turn_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_the_target_runs_the_call_runs_once_and_is_closed_as_interrupted() {
    let (server, fx, turn_id) =
        killed_while_slow_work_runs(send_body("s_slow", "do the work", &["slow::*"])).await;
    let entries = server.completed_transcript("s_slow", &turn_id).await;
    let result = assert_slow_work_interrupted(&fx, &entries);
    assert!(
        text_of(result).contains("at most once"),
        "{}",
        text_of(result)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_every_step_boundary_of_a_five_call_turn() {
    let ids = ["a", "b", "c", "d", "e"];
    let fx = Fixtures::new(Value::Array(
        ids.iter()
            .map(|i| json!({"id": format!("f::{i}"), "response": {"ok": i}}))
            .collect(),
    ));
    let calls: Vec<Value> = ids
        .iter()
        .enumerate()
        .map(|(n, i)| json!({"type": "function_call", "id": format!("c{}", n + 1), "function_id": format!("f::{i}"), "arguments": {"n": n}}))
        .collect();
    let script = script(vec![
        json!({"match": {"last_user_text": "five"}, "content": calls}),
        text_gen(None, "all five done", 0, true),
    ]);
    let points = [
        "after_send_persisted:1",
        "after_assistant_appended:1",
        "after_call_triggered:1",
        "after_call_triggered:3",
        "after_call_target:2",
        "after_call_result_appended:4",
        "after_call_done:5",
        "after_advance_persisted:1",
        "after_assistant_appended:2",
        "after_finalize_persisted:1",
    ];
    for point in points {
        std::fs::remove_file(fx.log()).ok();
        let extra = fx.args();
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut server = Server::start(&script, &extra).await;
        let sid = "s_five";
        // The send itself may be cut by the failpoint: its answer does not matter.
        server
            .crash_at(
                point,
                "harness::send",
                send_body(sid, "run all five", &["f::*"]),
            )
            .await;
        let status = wait_settled(&server, sid).await;
        assert_eq!(status["status"], "completed", "{point}: {status}");
        let (ran, entries) = ran_once_and_closed(point, &server, &fx, sid).await;
        let users = user_texts(&entries).len();
        assert_eq!(users, 1, "{point}: one user message\n{}", render(&entries));
        let last = entries.last().unwrap();
        assert_eq!(
            (role_of(last), text_of(last).as_str()),
            (Some("assistant"), "all five done"),
            "{point}"
        );
        // Calls that ran and were closed normally carry the target's result.
        for e in entries
            .iter()
            .filter(|e| role_of(e) == Some("function_result"))
        {
            let id = e["message"]["function_call_id"].as_str().unwrap();
            if e["message"]["is_error"] == false {
                assert_eq!(
                    ran.get(id),
                    Some(&1),
                    "{point}: {id} has a result but never ran"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(0)).await;
    }
}

/// A release (`approval::decide` → `harness::function::resolve` execute) runs the target inline,
/// outside any queued step. A crash in the middle must still end with the call closed once and the
/// turn finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_while_a_released_call_runs_still_closes_it_once() {
    for point in [
        "after_call_triggered:1",
        "after_call_target:1",
        "after_call_done:1",
    ] {
        let (fx, mut server) = approved_write_server().await;
        let sid = "s_release";
        let sent = server
            .ok("harness::send", send_body(sid, "write it", &["fx::*"]))
            .await;
        let turn_id = sent["turn_id"].as_str().unwrap().to_string();
        let approval = server.first_approval(sid).await;
        // Arm the failpoint for the release only.
        server.crash_at(point, "approval::decide", json!({"approval_id": approval["approval_id"], "decision": "approve", "digest": approval["digest"]})).await;
        let status = server.wait_turn(sid, &turn_id).await;
        assert_eq!(status["status"], "completed", "{point}: {status}");
        let (ran, entries) = ran_once_and_closed(point, &server, &fx, sid).await;
        let result = entries
            .iter()
            .find(|e| role_of(e) == Some("function_result"))
            .unwrap();
        if ran.is_empty() {
            assert_eq!(
                result["message"]["details"]["error"], "interrupted",
                "{point}: {result}"
            );
        }
    }
}

/// `max_turns: 1` is one generation: a call that generation made and a crash interrupted is
/// closed as interrupted and the model still hears of it (one recovery generation), instead
/// of the turn ending on `max_turns` with nobody told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_call_with_max_turns_one_the_model_still_hears_of_it() {
    let mut body = send_body("s_one", "do the work", &["slow::*"]);
    body["options"]["max_turns"] = json!(1);
    let (server, fx, turn_id) = killed_while_slow_work_runs(body).await;
    let status = server.wait_turn("s_one", &turn_id).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["stop_reason"], Value::Null, "{status}");
    assert_eq!(status["result"], INTERRUPTED_REPLY, "{status}");
    assert_eq!(status["turn_count"], 1, "{status}");
    let entries = server.transcript("s_one", false).await;
    assert_slow_work_interrupted(&fx, &entries);
}
