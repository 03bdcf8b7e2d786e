//! Concurrency against the real binary: racing sends on one session, many sessions at once, and
//! the steps of one session running strictly one after another.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn id(v: &Value, field: &str) -> String {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} missing in {v}"))
        .to_string()
}

fn words(prefix: &str, n: usize) -> String {
    let mut s = prefix.to_string();
    for i in 0..n {
        s.push_str(&format!(" w{i}"));
    }
    s
}

/// Sends both texts to one session at the same moment (two tasks released by one barrier).
async fn send_pair(api: &Api, sid: &str, a: &str, b: &str) -> (Value, Value) {
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let spawn = |text: String| {
        let (api, sid, barrier) = (api.clone(), sid.to_string(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            api.send(Some(&sid), &text).await
        })
    };
    let (ta, tb) = (spawn(a.to_string()), spawn(b.to_string()));
    (ta.await.unwrap(), tb.await.unwrap())
}

/// Waits until the session's last entry is an assistant entry with some, not all, of `full`
/// streamed, and returns that entry.
async fn wait_streaming(api: &Api, sid: &str, full: &str) -> Value {
    let (api, sid, full) = (api.clone(), sid.to_string(), full.to_string());
    wait_for("an assistant entry that is streaming", WAIT, move || {
        let (api, sid, full) = (api.clone(), sid.clone(), full.clone());
        async move {
            let entries = api.transcript(&sid, false).await;
            let last = entries.last()?.clone();
            let text = text_of(&last);
            (role_of(&last) == Some("assistant") && !text.is_empty() && text != full)
                .then_some(last)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_to_one_session() {
    let long = words("long reply:", 40);
    let script = script(vec![
        text_gen(Some("^first$"), &long, 50, true),
        // The turn started by one of the two racing sends takes a while to even start streaming,
        // so the other send, sent at the same moment, finds it running.
        json!({"match": {"last_user_text": "^third"}, "delay_ms": 1500, "repeat": true,
               "content": [{"type": "text", "text": "reply to third"}]}),
        text_gen(None, "noted.", 0, true),
    ]);
    let server = Server::start(&script, &["--stream-coalesce-ms", "0"]).await;
    let api = server.api();

    // (1) Two sends while the first turn is streaming: both are merged into it.
    let first = server.send(None, "first").await;
    let (sid, t1) = (id(&first, "session_id"), id(&first, "turn_id"));
    wait_streaming(&api, &sid, &long).await;
    let (a, b) = send_pair(&api, &sid, "second A", "second B").await;
    for r in [&a, &b] {
        assert_eq!(r["turn_id"], json!(t1), "merged into the running turn: {r}");
        assert_eq!(r["merged"], true, "{r}");
        assert_eq!(r["session_id"], json!(sid));
    }
    let entries = server.completed_transcript(&sid, &t1).await;
    let users = user_texts(&entries);
    assert_eq!(
        users.len(),
        3,
        "every user message once:\n{}",
        render(&entries)
    );
    assert_eq!(users[0], "first");
    assert_eq!(
        users[1..].iter().cloned().collect::<HashSet<_>>(),
        HashSet::from(["second A".to_string(), "second B".to_string()])
    );
    assert_eq!(
        text_of(&entries[1]),
        long,
        "the interrupted reply streamed to its end"
    );
    assert_eq!(
        role_of(entries.last().unwrap()),
        Some("assistant"),
        "the steering got an answer"
    );
    assert_eq!(text_of(entries.last().unwrap()), "noted.");

    // (2) Two sends on the idle session at the same moment: one starts a turn, the other merges.
    let (a, b) = send_pair(&api, &sid, "third A", "third B").await;
    let started: Vec<&Value> = [&a, &b]
        .into_iter()
        .filter(|r| r.get("merged").is_none())
        .collect();
    let merged: Vec<&Value> = [&a, &b]
        .into_iter()
        .filter(|r| r["merged"] == true)
        .collect();
    assert_eq!(
        (started.len(), merged.len()),
        (1, 1),
        "one starts the turn, one merges: {a} / {b}"
    );
    let t2 = id(started[0], "turn_id");
    assert_ne!(t2, t1);
    assert_eq!(
        merged[0]["turn_id"],
        json!(t2),
        "merged into the turn the other one started"
    );
    let entries = server.completed_transcript(&sid, &t2).await;
    let users = user_texts(&entries);
    assert_eq!(users.len(), 5, "no message lost:\n{}", render(&entries));
    assert_eq!(
        users[3..].iter().cloned().collect::<HashSet<_>>(),
        HashSet::from(["third A".to_string(), "third B".to_string()])
    );
    assert_eq!(role_of(entries.last().unwrap()), Some("assistant"));

    // Exactly one non-terminal turn at a time, each started and completed once.
    let events = server
        .events(&sid, None)
        .await
        .until_turn_completed(&t2)
        .await;
    assert_eq!(check_turn_lifecycle(&events), vec![t1, t2]);
    check_entries_added_once(&events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_sessions_in_parallel() {
    let script = script(vec![text_gen(None, "hello back", 5, true)]);
    let server = Server::start(&script, &["--durability", "normal"]).await;
    let api = server.api();
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let api = api.clone();
            tokio::spawn(async move {
                let r = api.send(None, &format!("hello {i}")).await;
                (i, id(&r, "session_id"), id(&r, "turn_id"))
            })
        })
        .collect();
    let mut pending = Vec::new();
    for t in tasks {
        pending.push(t.await.unwrap());
    }
    let ids: HashSet<&String> = pending.iter().map(|(_, s, _)| s).collect();
    assert_eq!(ids.len(), 100, "100 distinct sessions");

    let deadline = Instant::now() + Duration::from_secs(120);
    let mut done = Vec::new();
    while !pending.is_empty() {
        assert!(
            Instant::now() < deadline,
            "{} sessions still not completed",
            pending.len()
        );
        let mut still = Vec::new();
        for (i, sid, tid) in pending {
            let status = server.status(&sid).await;
            assert_eq!(status["turn_id"], json!(tid));
            if is_terminal(&status) {
                assert_eq!(status["status"], "completed", "{status}");
                done.push((i, sid));
            } else {
                still.push((i, sid, tid));
            }
        }
        pending = still;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (i, sid) in done {
        let entries = server.transcript(&sid, false).await;
        assert_eq!(
            dialogue(&entries),
            vec![
                (Some("user"), format!("hello {i}")),
                (Some("assistant"), "hello back".to_string())
            ],
            "session {sid}"
        );
    }
}

/// Steering during streaming: every step of the turn starts after the previous one ended. The
/// transcript groups as `user+ assistant`, each assistant entry answering the last user entry
/// before it, and the stream writes of one assistant entry never interleave with another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_of_one_session_never_overlap() {
    let reply = |to: &str| words(&format!("reply to {to}:"), 30);
    let mut gens = Vec::new();
    for to in ["first", "steer 1", "steer 2a", "steer 2b"] {
        gens.push(text_gen(Some(&format!("^{to}$")), &reply(to), 40, true));
    }
    let server = Server::start(&script(gens), &["--stream-coalesce-ms", "0"]).await;
    let api = server.api();

    let first = server.send(None, "first").await;
    let sid = id(&first, "session_id");
    let mut turns = vec![id(&first, "turn_id")];
    let mut sent = vec!["first"];
    let a0 = wait_streaming(&api, &sid, &reply("first")).await;
    let r = server.send(Some(&sid), "steer 1").await;
    sent.push("steer 1");
    turns.push(id(&r, "turn_id"));
    // Wait for the next reply to be streaming, then steer twice.
    let api2 = api.clone();
    let sid2 = sid.clone();
    let a0_id = a0["entry_id"].clone();
    wait_for("the reply to steer 1 streaming", WAIT, move || {
        let (api, sid, a0_id) = (api2.clone(), sid2.clone(), a0_id.clone());
        async move {
            let entries = api.transcript(&sid, false).await;
            let last = entries.last()?;
            (role_of(last) == Some("assistant")
                && last["entry_id"] != a0_id
                && !text_of(last).is_empty())
            .then_some(())
        }
    })
    .await;
    for text in ["steer 2a", "steer 2b"] {
        let r = server.send(Some(&sid), text).await;
        sent.push(text);
        turns.push(id(&r, "turn_id"));
    }
    // Normally all three merge into the first turn; if the machine stalled long enough for a
    // turn to end first, the next send starts a new one. The checks below hold either way.
    turns.dedup();
    let last_turn = turns.last().unwrap().clone();
    let entries = server.completed_transcript(&sid, &last_turn).await;
    let shown = render(&entries);
    // Every message sent is there once, in the order sent.
    assert_eq!(user_texts(&entries), sent, "{shown}");
    // Groups of `user+ assistant`: each reply answers the last user message before it.
    let mut last_user: Option<String> = None;
    let mut replies = 0;
    for e in &entries {
        match role_of(e) {
            Some("user") => last_user = Some(text_of(e)),
            Some("assistant") => {
                let to = last_user.take().unwrap_or_else(|| {
                    panic!("an assistant entry with no new user entry before it:\n{shown}")
                });
                assert_eq!(text_of(e), reply(&to), "{shown}");
                replies += 1;
            }
            other => panic!("unexpected role {other:?}:\n{shown}"),
        }
    }
    assert!(
        last_user.is_none(),
        "the last user message got no reply:\n{shown}"
    );
    assert!(replies >= 3, "{shown}");

    // On the event stream, the writes of each assistant entry form one contiguous run.
    let events = server
        .events(&sid, None)
        .await
        .until_turn_completed(&last_turn)
        .await;
    assert_eq!(check_turn_lifecycle(&events), turns);
    check_entries_added_once(&events);
    let assistant_ids: HashSet<String> = entries
        .iter()
        .filter(|e| role_of(e) == Some("assistant"))
        .map(|e| e["entry_id"].as_str().unwrap().to_string())
        .collect();
    let mut runs: Vec<String> = Vec::new();
    for e in &events {
        if !e.topic().starts_with("session::message-") {
            continue;
        }
        let eid = e.payload()["entry_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if assistant_ids.contains(&eid) && runs.last() != Some(&eid) {
            assert!(
                !runs.contains(&eid),
                "writes of {eid} resumed after another reply's: {runs:?}"
            );
            runs.push(eid);
        }
    }
    assert_eq!(runs.len(), assistant_ids.len());
}
