//! Compaction under crashes, with real processes: SIGKILL `harness serve` after the summary was
//! written but before its record was persisted (and just after), start it again on the same
//! data dir, and check that no message was lost or duplicated and every turn completed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const TURNS: usize = 10;
const SESSION: &str = "s_long";

fn send_body(n: usize) -> Value {
    json!({"session_id": SESSION, "message": format!("turn {n}: read report {n}"), "model": "m", "provider": "scripted",
           "options": {"functions": {"allow": ["demo::*"], "expose": "native"}}})
}

fn long_script() -> Value {
    let mut generations = vec![text_gen(
        Some("^Summarize the conversation below"),
        "SUMMARY: reports were read one per turn.",
        0,
        true,
    )];
    for n in 0..TURNS {
        generations.push(call_gen(
            &format!("^turn {n}:"),
            &format!("call_{n}"),
            "demo::read",
            json!({"report": n}),
        ));
    }
    generations.push(text_gen(Some("^turn "), "read it", 0, true));
    script(generations)
}

/// Waits for the turn to end, starting the server again (without the failpoint) whenever it
/// has died. Answers whether it had to.
async fn settle(server: &mut Server, turn_id: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut restarted = false;
    loop {
        assert!(Instant::now() < deadline, "turn {turn_id} did not end");
        if server.exited() {
            server.set_env("HARNESS_FAILPOINT", None);
            server.start_again().await;
            restarted = true;
            continue;
        }
        // The failpoint may kill the server between the check above and this request.
        if let Some(s) = server
            .api()
            .try_ok("harness::status", json!({"session_id": SESSION}))
            .await
        {
            if s["turn_id"] == turn_id && is_terminal(&s) {
                assert_eq!(s["status"], "completed", "{s}");
                return restarted;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_around_the_compaction_record_loses_and_duplicates_nothing() {
    let fx = Fixtures::new(json!([{"id": "demo::read", "description": "reads a report",
        "response": {"body": "x".repeat(4_000)}}]));
    for point in [
        "before_compaction_appended:1",
        "after_compaction_appended:1",
    ] {
        std::fs::remove_file(fx.log()).ok();
        let mut extra = fx.args();
        extra.extend(["--context-window".into(), "8000".into()]);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut server = Server::start(&long_script(), &extra).await;
        server.kill();
        server.set_env("HARNESS_FAILPOINT", Some(point));
        server.start_again().await;
        let mut crashed = false;
        for n in 0..TURNS {
            let sent = server.ok("harness::send", send_body(n)).await;
            let turn_id = sent["turn_id"].as_str().unwrap().to_string();
            crashed |= settle(&mut server, &turn_id).await;
        }
        assert!(crashed, "{point}: the failpoint was never reached");

        let entries = server.transcript(SESSION, true).await;
        let users = user_texts(&entries);
        let expected: Vec<String> = (0..TURNS)
            .map(|n| format!("turn {n}: read report {n}"))
            .collect();
        assert_eq!(users, expected, "{point}:\n{}", render(&entries));
        let assistants = entries
            .iter()
            .filter(|e| role_of(e) == Some("assistant"))
            .count();
        assert_eq!(assistants, 2 * TURNS, "{point}:\n{}", render(&entries));
        assert_every_call_closed(&entries);
        let ran = invocations(&fx.log());
        assert_eq!(ran.len(), TURNS, "{point}: {ran:?}");
        assert!(ran.values().all(|n| *n == 1), "{point}: {ran:?}");
        let compactions: Vec<&Value> = entries
            .iter()
            .filter(|e| e["custom"]["custom_type"] == "compaction")
            .collect();
        assert!(!compactions.is_empty(), "{point}: no compaction");
        for c in &compactions {
            let anchor = c["custom"]["data"]["tail_start_entry_id"].as_str().unwrap();
            assert!(
                entries.iter().any(|e| e["entry_id"] == anchor),
                "{point}: anchor {anchor} is not an entry"
            );
            let id = c["entry_id"].as_str().unwrap();
            assert!(id.ends_with("_compaction"), "{id}");
        }
        server.kill();
    }
}
