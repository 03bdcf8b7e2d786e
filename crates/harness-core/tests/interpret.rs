//! The interpreter batches a run's plain writes: a step's notices, its record and its next step
//! go to the store as one write, not one each.

mod support;

use harness_core::HarnessConfig;
use harness_types::api::TurnStatus;
use serde_json::json;
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
    // its start (status, event, assistant entry), its end (the cut answer with the recovery
    // notice, the record and the next step; then the terminal batch), its ack: 3 each.
    // Written one by one (before the interpreter), the cut step's answer, its notice and its
    // advance were three writes: 10 in all.
    assert_eq!(writes, 8, "{writes} store writes for a resumed turn");
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
    // The same first step either way. The second: with room, its start, its end and its
    // ack, plus the provider's assignment of the second generation (4); past `max_turns`,
    // the status, the notice and the terminal record as one batch, and its ack (2). Written
    // one by one (before the interpreter), the capped step's status and notice were two
    // writes of their own, and both turns wrote as much.
    assert_eq!(free - capped, 2, "capped {capped}, free {free}");
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
