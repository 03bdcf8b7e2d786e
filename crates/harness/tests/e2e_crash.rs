//! Crash recovery against the real binary: SIGKILL `harness serve` mid-turn, start it again on
//! the same data dir, and check that every turn completes once, with nothing lost or duplicated.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// 35 words: at 100 ms a word the stream takes about three and a half seconds.
const STORY: &str = "Once upon a time a small durable loop kept every word it was given, and when the \
power went out it simply woke up again, read its notes, and finished the story without repeating itself.";

/// The turn completed with exactly `user`'s message and one assistant message saying `reply`.
async fn assert_one_exchange(server: &Server, sid: &str, tid: &str, user: &str, reply: &str) {
    let entries = server.completed_transcript(sid, tid).await;
    assert_eq!(
        entries.len(),
        2,
        "one user and one assistant message:\n{}",
        render(&entries)
    );
    assert_eq!(
        (role_of(&entries[0]), text_of(&entries[0]).as_str()),
        (Some("user"), user)
    );
    assert_eq!(
        (role_of(&entries[1]), text_of(&entries[1]).as_str()),
        (Some("assistant"), reply)
    );
}

fn id(v: &Value, field: &str) -> String {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} missing in {v}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_during_streaming() {
    let script = script(vec![
        text_gen(Some("^marker$"), "marker reply", 0, true),
        // Not `repeat`: the provider's durable assignment is exercised by the replay.
        text_gen(None, STORY, 100, false),
    ]);
    let mut server = Server::start(&script, &["--stream-coalesce-ms", "0"]).await;
    let sent = server.send(None, "tell me a story").await;
    let (sid, tid) = (id(&sent, "session_id"), id(&sent, "turn_id"));

    // Wait until the assistant entry holds some of the story, not all of it.
    wait_partial(&server.api(), &sid, STORY, 1).await;
    assert_eq!(server.status(&sid).await["status"], "running");

    server.kill();
    server.restart().await;

    let status = server.wait_turn(&sid, &tid).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["result"], json!(STORY), "{status}");

    let entries = server.transcript(&sid, false).await;
    assert_eq!(
        entries.len(),
        2,
        "exactly one user and one assistant message:\n{}",
        render(&entries)
    );
    assert_eq!(role_of(&entries[0]), Some("user"));
    assert_eq!(text_of(&entries[0]), "tell me a story");
    assert_eq!(role_of(&entries[1]), Some("assistant"));
    assert_eq!(
        text_of(&entries[1]),
        STORY,
        "the replayed stream must end with the full text, once"
    );
    let all = server.transcript(&sid, true).await;
    assert!(
        all.iter().all(|e| e["custom"]["custom_type"] != "error"),
        "no error record for a recovered turn:\n{}",
        render(&all)
    );

    // A marker turn afterwards: a stale redelivery of the first turn could only publish before it.
    let marker = server.send(Some(&sid), "marker").await;
    let marker_tid = id(&marker, "turn_id");
    assert_ne!(marker_tid, tid);
    assert_eq!(
        server.wait_turn(&sid, &marker_tid).await["status"],
        "completed"
    );

    let events = server
        .events(&sid, None)
        .await
        .until_turn_completed(&marker_tid)
        .await;
    let turns = check_turn_lifecycle(&events);
    assert_eq!(turns, vec![tid.clone(), marker_tid.clone()]);
    let done = completions_of(&events, &tid);
    assert_eq!(
        done.len(),
        1,
        "exactly one turn-completed for the crashed turn"
    );
    assert_eq!(done[0].payload()["status"], "completed");
    assert_eq!(done[0].payload()["result"], json!(STORY));
    check_entries_added_once(&events);
    assert!(
        events.windows(2).all(|w| w[0].event_id() < w[1].event_id()),
        "event ids increase"
    );
}

/// Waits until the session's first assistant entry holds at least `min` bytes of `full`, not all
/// of it; returns that text.
async fn wait_partial(api: &Api, sid: &str, full: &'static str, min: usize) -> String {
    let (api, sid) = (api.clone(), sid.to_string());
    let partial = wait_for("a partially streamed assistant entry", WAIT, move || {
        let (api, sid) = (api.clone(), sid.clone());
        async move {
            let entries = api.transcript(&sid, false).await;
            let text = entries
                .iter()
                .find(|e| role_of(e) == Some("assistant"))
                .map(text_of)?;
            (text.len() >= min && text.len() < full.len()).then_some(text)
        }
    })
    .await;
    assert!(
        full.starts_with(&partial),
        "{partial:?} is not a prefix of {full:?}"
    );
    partial
}

/// The step replayed after a crash must send the model the context the original step sent:
/// the transcript before its own assistant entry, not its own half-streamed reply. Observable
/// through the scripted provider's usage, an estimate from the request's text: the same message
/// in a fresh session (no crash) must report the same input size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_step_sends_the_original_context() {
    let script = script(vec![
        text_gen(None, STORY, 100, false),
        // For the control session (the first generation is used up by then).
        text_gen(None, STORY, 0, true),
    ]);
    let mut server = Server::start(&script, &["--stream-coalesce-ms", "0"]).await;
    let sent = server.send(None, "tell me a story").await;
    let (sid, tid) = (id(&sent, "session_id"), id(&sent, "turn_id"));
    let partial = wait_partial(&server.api(), &sid, STORY, 40).await;
    server.kill();
    server.restart().await;
    assert_eq!(server.wait_turn(&sid, &tid).await["status"], "completed");
    let entries = server.transcript(&sid, false).await;
    assert_eq!(text_of(&entries[1]), STORY);

    let control = server.send(None, "tell me a story").await;
    let (csid, ctid) = (id(&control, "session_id"), id(&control, "turn_id"));
    assert_eq!(server.wait_turn(&csid, &ctid).await["status"], "completed");
    let centries = server.transcript(&csid, false).await;
    assert_eq!(text_of(&centries[1]), STORY);
    assert_eq!(
        entries[1]["message"]["usage"]["input"],
        centries[1]["message"]["usage"]["input"],
        "input tokens of the replayed step vs a step that never crashed (the partial reply at the kill was {partial:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_right_after_send() {
    let reply = "Short and durable answer.";
    let script = script(vec![text_gen(None, reply, 10, false)]);
    let mut server = Server::start(&script, &[]).await;
    let sent = server.send(None, "hello").await;
    let (sid, tid) = (id(&sent, "session_id"), id(&sent, "turn_id"));
    // The answer of `send` is durable: kill at once, and once more right after the first restart.
    server.kill();
    server.restart().await;
    server.kill();
    server.restart().await;

    assert_one_exchange(&server, &sid, &tid, "hello", reply).await;

    server.assert_one_clean_turn(&sid, &tid).await;
}

const SESSIONS: usize = 10;
const TURNS: usize = 5;

fn user_text(s: usize, k: usize) -> String {
    format!("s{s} m{k}")
}

fn reply_text(s: usize, k: usize) -> String {
    format!("reply to s{s} m{k}: alpha beta gamma delta epsilon zeta eta theta")
}

/// Ten sessions, five turns each, sent as fast as turns complete, with three SIGKILLs while
/// turns are in flight. Every turn must complete exactly once with the right texts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_turns_ten_sessions_under_kill() {
    let mut gens = vec![text_gen(Some("^marker$"), "marker reply", 0, true)];
    for s in 0..SESSIONS {
        for k in 0..TURNS {
            gens.push(text_gen(
                Some(&format!("^{}$", user_text(s, k))),
                &reply_text(s, k),
                40,
                true,
            ));
        }
    }
    let mut server = Server::start(
        &script(gens),
        &["--durability", "normal", "--stream-coalesce-ms", "0"],
    )
    .await;

    struct Sess {
        id: Option<String>,
        next: usize,
        in_flight: Option<String>,
        turns: Vec<String>,
    }
    let mut sessions: Vec<Sess> = (0..SESSIONS)
        .map(|_| Sess {
            id: None,
            next: 0,
            in_flight: None,
            turns: Vec::new(),
        })
        .collect();
    // Kill when this many turns have completed (turns of other sessions are then in flight).
    let kill_at = [6, 21, 37];
    let mut kills = 0;
    let mut completed = 0;
    let deadline = Instant::now() + Duration::from_secs(150);
    while completed < SESSIONS * TURNS {
        assert!(
            Instant::now() < deadline,
            "only {completed} of 50 turns completed in time"
        );
        for sess in sessions.iter_mut() {
            let Some(tid) = sess.in_flight.clone() else {
                continue;
            };
            let sid = sess.id.clone().unwrap();
            let status = server.status(&sid).await;
            assert_eq!(
                status["turn_id"],
                json!(tid),
                "the record belongs to the turn we started: {status}"
            );
            if is_terminal(&status) {
                assert_eq!(
                    status["status"],
                    "completed",
                    "{status}\n{}",
                    render(&server.transcript(&sid, true).await)
                );
                sess.in_flight = None;
                completed += 1;
            }
        }
        for (s, sess) in sessions.iter_mut().enumerate() {
            if sess.in_flight.is_none() && sess.next < TURNS {
                let sent = server
                    .send(sess.id.as_deref(), &user_text(s, sess.next))
                    .await;
                assert!(
                    sent.get("merged").is_none(),
                    "the previous turn had completed: {sent}"
                );
                let sid = id(&sent, "session_id");
                if let Some(known) = &sess.id {
                    assert_eq!(&sid, known);
                }
                sess.id = Some(sid);
                let tid = id(&sent, "turn_id");
                sess.turns.push(tid.clone());
                sess.in_flight = Some(tid);
                sess.next += 1;
            }
        }
        if kills < kill_at.len() && completed >= kill_at[kills] {
            if kills == 1 {
                // This time, kill while some reply is visibly half-streamed.
                let api = server.api();
                let in_flight: Vec<String> = sessions
                    .iter()
                    .filter(|s| s.in_flight.is_some())
                    .filter_map(|s| s.id.clone())
                    .collect();
                wait_for("a half-streamed reply", WAIT, move || {
                    let (api, in_flight) = (api.clone(), in_flight.clone());
                    async move {
                        for sid in &in_flight {
                            let entries = api.transcript(sid, false).await;
                            if let Some(last) =
                                entries.last().filter(|e| role_of(e) == Some("assistant"))
                            {
                                let text = text_of(last);
                                if !text.is_empty() && !text.ends_with("theta") {
                                    return Some(());
                                }
                            }
                        }
                        None
                    }
                })
                .await;
            }
            let in_flight = sessions.iter().filter(|s| s.in_flight.is_some()).count();
            eprintln!(
                "SIGKILL #{} with {completed} turns completed, {in_flight} in flight",
                kills + 1
            );
            server.kill();
            server.restart().await;
            kills += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(kills, kill_at.len());

    for (s, sess) in sessions.iter().enumerate() {
        let sid = sess.id.clone().unwrap();
        let entries = server.transcript(&sid, false).await;
        let expected: Vec<(String, String)> = (0..TURNS)
            .flat_map(|k| {
                [
                    ("user".to_string(), user_text(s, k)),
                    ("assistant".to_string(), reply_text(s, k)),
                ]
            })
            .collect();
        let got: Vec<(String, String)> = entries
            .iter()
            .map(|e| (role_of(e).unwrap_or("?").to_string(), text_of(e)))
            .collect();
        assert_eq!(got, expected, "session {s} ({sid}):\n{}", render(&entries));
        let ids: std::collections::HashSet<&str> = entries
            .iter()
            .filter_map(|e| e["entry_id"].as_str())
            .collect();
        assert_eq!(ids.len(), entries.len(), "entry ids are unique");
        let all = server.transcript(&sid, true).await;
        assert!(
            all.iter().all(|e| e["custom"]["custom_type"] != "error"),
            "no error records:\n{}",
            render(&all)
        );
    }

    // A marker turn per session closes the event log; then each turn started and completed once.
    let mut markers = Vec::new();
    for sess in &sessions {
        let sid = sess.id.clone().unwrap();
        markers.push(id(&server.send(Some(&sid), "marker").await, "turn_id"));
    }
    for (sess, marker) in sessions.iter().zip(&markers) {
        let sid = sess.id.clone().unwrap();
        assert_eq!(server.wait_turn(&sid, marker).await["status"], "completed");
        let events = server
            .events(&sid, None)
            .await
            .until_turn_completed(marker)
            .await;
        let mut expected = sess.turns.clone();
        expected.push(marker.clone());
        assert_eq!(check_turn_lifecycle(&events), expected, "session {sid}");
        for tid in &sess.turns {
            let done = completions_of(&events, tid);
            assert_eq!(done.len(), 1, "turn {tid}");
            assert_eq!(done[0].payload()["status"], "completed");
        }
        check_entries_added_once(&events);
    }
}

/// A steering message parked while a step streams survives a SIGKILL: after the restart it is
/// delivered to the transcript and answered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_with_steering_queued() {
    let long = "a long answer that takes a while to stream, word by word, so that a steering \
message can arrive in the middle of it and wait in the queue for the next step";
    let script = script(vec![
        // Not `repeat`: the replayed step gets the same generation, like a deterministic model.
        text_gen(Some("^start$"), long, 80, false),
        text_gen(Some("^steer$"), "steering received", 0, true),
    ]);
    let mut server = Server::start(&script, &["--stream-coalesce-ms", "0"]).await;
    let sent = server.send(None, "start").await;
    let (sid, tid) = (id(&sent, "session_id"), id(&sent, "turn_id"));
    // The first reply is streaming.
    wait_partial(&server.api(), &sid, long, 1).await;
    let steer = server.send(Some(&sid), "steer").await;
    assert_eq!(steer["merged"], true, "{steer}");
    assert_eq!(steer["turn_id"], json!(tid));
    server.kill();
    server.restart().await;

    let entries = server.completed_transcript(&sid, &tid).await;
    assert_eq!(
        dialogue(&entries),
        vec![
            (Some("user"), "start".to_string()),
            (Some("assistant"), long.to_string()),
            (Some("user"), "steer".to_string()),
            (Some("assistant"), "steering received".to_string()),
        ],
        "\n{}",
        render(&entries)
    );
    let status = server.status(&sid).await;
    assert_eq!(status["queued"], 0, "nothing left in the queue: {status}");
    server.assert_one_clean_turn(&sid, &tid).await;
}

/// An idempotency key still deduplicates after a SIGKILL: the retry gets the original ids and
/// appends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_send_across_a_crash() {
    let script = script(vec![text_gen(None, "once only", 10, true)]);
    let mut server = Server::start(&script, &[]).await;
    let req = json!({"message": "webhook", "model": "m", "provider": "scripted", "idempotency_key": "hook-1"});
    let first = server.ok("harness::send", req.clone()).await;
    let (sid, tid) = (id(&first, "session_id"), id(&first, "turn_id"));
    server.kill();
    server.restart().await;
    let again = server.ok("harness::send", req.clone()).await;
    assert_eq!(
        (id(&again, "session_id"), id(&again, "turn_id")),
        (sid.clone(), tid.clone())
    );
    assert_eq!(again["deduplicated"], true, "{again}");
    assert_eq!(server.wait_turn(&sid, &tid).await["status"], "completed");
    let again = server.ok("harness::send", req).await;
    assert_eq!(again["deduplicated"], true, "{again}");
    let entries = server.transcript(&sid, false).await;
    assert_eq!(
        dialogue(&entries),
        vec![
            (Some("user"), "webhook".to_string()),
            (Some("assistant"), "once only".to_string())
        ],
        "\n{}",
        render(&entries)
    );
}

/// The settled-call advance: a release (`approval::decide` → `harness::function::resolve`) runs
/// the held call, and its parked turn advances with its record and next step as one commit, one
/// store transaction. So the gap "record saved, step not yet queued" does not exist there: a
/// SIGKILL right after that commit (`after_advance_persisted`) leaves both on disk, and the
/// process started again runs the step once: the target ran once, the turn completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_right_after_a_released_call_advances_its_turn_leaves_the_step_queued() {
    let point = "after_advance_persisted:1";
    let (fx, mut server) = approved_write_server().await;
    let sid = "s_advance";
    let sent = server
        .ok(
            "harness::send",
            json!({"session_id": sid, "message": "write it", "model": "m", "provider": "scripted",
                   "options": {"functions": {"allow": ["fx::*"], "expose": "native"}}}),
        )
        .await;
    let tid = id(&sent, "turn_id");
    let approval = server.first_approval(sid).await;
    // Armed for the release only: the restart finds the turn parked, which advances nothing.
    server.kill();
    server.set_env("HARNESS_FAILPOINT", Some(point));
    server.start_again().await;
    let decide = json!({"approval_id": approval["approval_id"], "decision": "approve", "digest": approval["digest"]});
    let _ = server.try_ok("approval::decide", decide).await;
    server.wait_killed_at(point).await;

    // What the killed process left on disk.
    let (record, queued) = {
        let db = rusqlite::Connection::open(server.data_dir().join("harness.db")).unwrap();
        let record: String = db
            .query_row(
                // The newest version: the kv log's, else the row it was folded into.
                "SELECT value FROM (
                     SELECT value, id FROM kv_log WHERE scope = 'harness_turn' AND key = ?1
                     UNION ALL
                     SELECT value, 0 FROM kv WHERE scope = 'harness_turn' AND key = ?1)
                 ORDER BY id DESC LIMIT 1",
                [sid],
                |r| r.get(0),
            )
            .unwrap();
        let record: Value = serde_json::from_str(&record).unwrap();
        let mut rows = db
            .prepare("SELECT payload FROM queue_messages WHERE queue = 'harness-turn'")
            .unwrap();
        let queued: Vec<Value> = rows
            .query_map([], |r| r.get::<_, String>(0))
            .unwrap()
            .map(|p| serde_json::from_str(&p.unwrap()).unwrap())
            .collect();
        (record, queued)
    };
    assert_eq!(
        (record["status"].as_str(), record["turn_id"].as_str()),
        (Some("running"), Some(tid.as_str())),
        "the record advanced: {record}"
    );
    let step = record["step"].as_u64().unwrap();
    assert!(step >= 1, "past the step that parked: {record}");
    assert!(
        queued
            .iter()
            .any(|p| p["session_id"] == sid && p["step"].as_u64() == Some(step)),
        "the advanced step {step} is queued beside its record: {queued:?}"
    );

    server.set_env("HARNESS_FAILPOINT", None);
    server.start_again().await;
    let status = server.wait_turn(sid, &tid).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(
        invocations(&fx.log()),
        std::collections::HashMap::from([("c1".to_string(), 1)]),
        "the target ran exactly once"
    );
    let entries = server.transcript(sid, false).await;
    assert_every_call_closed(&entries);
    let answers: Vec<String> = entries
        .iter()
        .filter(|e| role_of(e) == Some("assistant"))
        .map(text_of)
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(answers, ["done writing"], "\n{}", render(&entries));
    server.assert_one_clean_turn(sid, &tid).await;
}

/// A step holds its first write (status, `turn-started`, the empty assistant entry) while the
/// model answers; with the hold longer than the answer, a kill in that window finds nothing of
/// the step written. The step runs again after the restart, and the turn ends once, with one
/// assistant message and one `turn-started`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_the_first_write_is_held_the_step_runs_again_once() {
    let reply = "Held, then written once.";
    let mut slow = text_gen(None, reply, 0, false);
    slow["delay_ms"] = json!(2500);
    let script = script(vec![slow]);
    let config = tempfile::tempdir().unwrap();
    let file = config.path().join("harness.yaml");
    std::fs::write(&file, "first_write_hold_ms: 600000\n").unwrap();
    let mut server = Server::start(&script, &["--config", file.to_str().unwrap()]).await;
    let sent = server.send(None, "hello").await;
    let (sid, tid) = (id(&sent, "session_id"), id(&sent, "turn_id"));
    // Well inside the model's delay: the step is waiting for the answer, its start held.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(server.status(&sid).await["status"], "running");
    let entries = server.transcript(&sid, true).await;
    assert_eq!(entries.len(), 1, "only the message:\n{}", render(&entries));

    server.kill();
    server.restart().await;

    assert_one_exchange(&server, &sid, &tid, "hello", reply).await;
    server.assert_one_clean_turn(&sid, &tid).await;
}
