//! The MCP client against a real server process (the fixture this crate builds with rmcp):
//! tools listed with their schemas, called through scripted turns under the policy, a tool
//! list change picked up, a SIGKILLed server reconnected, calls during an outage failing
//! cleanly, and a server that cannot start leaving the harness running.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_bus::{Bus, CallContext, EmbeddedBus, FunctionDef};
use harness_mcp::McpHub;
use harness_types::api::TurnStatus;
use harness_types::message::{joined_text, ContentBlock};
use serde_json::{json, Value};
use support::*;

/// Runs one turn of `script` on `text`, with `allow` as the policy, once the `fx` fixture server
/// is connected; the turn must complete. The runtime and the session.
async fn completed_turn_with_fx(script: Value, text: &str, allow: &[&str]) -> (Rt, String) {
    let rt = runtime(script, vec![fixture("fx", &[])]).await;
    rt.connected("fx").await;
    let (sid, s) = rt.run_turn(send(text, allow)).await;
    assert_eq!(s.status, TurnStatus::Completed);
    (rt, sid)
}

#[tokio::test]
async fn tools_are_registered_with_their_schemas_and_sanitized_names() {
    let rt = saying_hi(vec![fixture("fx", &[])]).await;
    let s = rt.connected("fx").await;
    assert_eq!(
        s.functions,
        vec![
            "mcp::fx::add",
            "mcp::fx::add_tool",
            "mcp::fx::echo",
            "mcp::fx::media",
            "mcp::fx::spawn_sleeper",
            "mcp::fx::weird_name_tool"
        ]
    );
    assert!(s.pid.is_some());
    let info = rt
        .call(
            "engine::functions::info",
            json!({"function_id": "mcp::fx::add"}),
        )
        .await;
    assert_eq!(info["description"], "Add two integers.");
    assert_eq!(
        info["request_schema"],
        json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})
    );
    assert_eq!(
        info["metadata"]["mcp"],
        json!({"server": "fx", "tool": "add"})
    );
    // The sanitized id calls the tool under its own name.
    let weird = rt.call("mcp::fx::weird_name_tool", json!({})).await;
    assert_eq!(
        weird,
        json!({"content": [{"type": "text", "text": "weird ok"}], "is_error": false})
    );
}

#[tokio::test]
async fn a_scripted_turn_calls_mcp_tools_and_reads_text_structured_and_image_results() {
    let script = json!({"generations": [
        call_gen("^go", vec![
            ("c1", "mcp::fx::add", json!({"a": 2, "b": 3})),
            ("c2", "mcp::fx::media", json!({})),
            ("c3", "mcp::fx::echo", json!({"text": 7}))
        ]),
        text_gen("done")
    ]});
    let (rt, sid) = completed_turn_with_fx(script, "go", &["mcp::*"]).await;

    let add = rt.result(&sid, "c1");
    assert!(!add.is_error, "{:?}", add.details);
    assert_eq!(joined_text(&add.content), "5");
    assert_eq!(add.details["structured_content"], json!({"sum": 5}));

    let media = rt.result(&sid, "c2");
    assert!(!media.is_error);
    assert!(
        matches!(&media.content[0], ContentBlock::Image { mime, .. } if mime == "image/png"),
        "{:?}",
        media.content
    );
    assert_eq!(
        media.content[1],
        ContentBlock::text("resource <file:///notes.txt>:\na note")
    );

    // The server refused the arguments (a protocol error): the model reads why.
    let echo = rt.result(&sid, "c3");
    assert!(echo.is_error);
    let text = joined_text(&echo.content);
    assert!(
        text.contains("mcp server 'fx': tool 'echo' failed")
            && text.contains("text must be a string"),
        "{text}"
    );
}

#[tokio::test]
async fn mcp_tools_are_denied_unless_the_policy_allows_them() {
    let script = json!({"generations": [
        call_gen("^try", vec![("c1", "mcp::fx::add_tool", json!({"name": "sneaky"}))]),
        text_gen("tried")
    ]});
    let (rt, sid) = completed_turn_with_fx(script, "try", &["fs::*"]).await;
    let r = rt.result(&sid, "c1");
    assert!(r.is_error);
    assert_eq!(r.details["error"], "policy_denied", "{:?}", r.details);
    // Had it reached the server, the server would now offer `sneaky`.
    let listed = rt.call("mcp::fx::add", json!({"a": 1, "b": 1})).await;
    assert_eq!(listed["is_error"], false);
    assert!(!rt
        .server("fx")
        .functions
        .iter()
        .any(|f| f.contains("sneaky")));
}

#[tokio::test]
async fn a_tool_list_change_is_registered_and_announces_a_functions_change() {
    // A bare bus with a recording `harness::on-functions-change`, to see the announcement.
    let dir = tempfile::tempdir().unwrap();
    let store =
        harness_store::Store::open(&dir.path().join("t.db"), harness_store::Durability::Normal)
            .unwrap();
    let bus = EmbeddedBus::new(store).unwrap();
    let changes = Arc::new(AtomicUsize::new(0));
    let seen = changes.clone();
    bus.register_function(
        FunctionDef::new("harness::on-functions-change", "recording"),
        Arc::new(move |_p: Value, _c: CallContext| {
            seen.fetch_add(1, Ordering::SeqCst);
            async move { Ok(json!({"ok": true})) }
        }),
    );
    let shared: Arc<dyn Bus> = Arc::new(bus.clone());
    let hub = McpHub::new(shared, FAST);
    hub.apply(vec![fixture("fx", &[])]).await;
    eventually("the first tool list", || {
        bus.function_def("mcp::fx::echo").map(|_| ())
    })
    .await;
    let before = eventually("the first announcement", || {
        Some(changes.load(Ordering::SeqCst)).filter(|n| *n >= 1)
    })
    .await;
    assert!(bus.function_def("mcp::fx::late").is_none());

    let added = bus
        .call("mcp::fx::add_tool", json!({"name": "late"}), None)
        .await
        .unwrap();
    assert_eq!(added["content"][0]["text"], "added late");
    eventually("mcp::fx::late registered", || {
        bus.function_def("mcp::fx::late")
    })
    .await;
    eventually("a second announcement", || {
        Some(()).filter(|_| changes.load(Ordering::SeqCst) > before)
    })
    .await;
    let late = bus.call("mcp::fx::late", json!({}), None).await.unwrap();
    assert_eq!(late["content"][0]["text"], "late ok");

    // Stopping the server takes its tools off the bus.
    hub.shutdown().await;
    assert!(bus.function_def("mcp::fx::echo").is_none());
    assert!(bus.function_def("mcp::fx::late").is_none());
}

#[tokio::test]
async fn a_sigkilled_server_is_restarted_and_the_next_turn_calls_it() {
    let script = json!({"generations": [
        call_gen("^echo", vec![("c1", "mcp::fx::echo", json!({"text": "again"}))]),
        text_gen("ok")
    ]});
    let rt = runtime(script, vec![fixture("fx", &[])]).await;
    let first = rt.connected("fx").await;
    let pid = first.pid.unwrap();
    sigkill(pid);
    let second = eventually("a reconnect", || {
        Some(rt.server("fx")).filter(|s| s.connected && s.connections == 2)
    })
    .await;
    assert_ne!(second.pid, Some(pid), "a new process");
    let (sid, s) = rt.run_turn(send("echo", &["mcp::fx::*"])).await;
    assert_eq!(s.status, TurnStatus::Completed);
    let r = rt.result(&sid, "c1");
    assert!(!r.is_error, "{:?}", r.content);
    assert_eq!(joined_text(&r.content), "echo: again");
}

#[tokio::test]
async fn calls_during_an_outage_fail_at_once_and_work_after_the_reconnect() {
    let dir = tempfile::tempdir().unwrap();
    let block = dir.path().join("down");
    let spec = fixture("fx", &[("FIXTURE_FAIL_IF_EXISTS", block.to_str().unwrap())]);
    let rt = saying_hi(vec![spec]).await;
    let pid = rt.connected("fx").await.pid.unwrap();
    std::fs::write(&block, "").unwrap();
    sigkill(pid);
    eventually("the outage seen", || {
        Some(rt.server("fx")).filter(|s| !s.connected && s.last_error.is_some())
    })
    .await;
    let started = Instant::now();
    let r = rt.call("mcp::fx::echo", json!({"text": "x"})).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no waiting for the server"
    );
    assert_eq!(r["is_error"], true, "{r}");
    let text = r["content"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("mcp server 'fx' is not connected"),
        "{text}"
    );
    assert!(text.contains("reconnecting"), "{text}");
    // The tools stay offered while the server is away.
    assert!(rt.function_ids().contains(&"mcp::fx::echo".to_string()));

    std::fs::remove_file(&block).unwrap();
    eventually("the reconnect", || {
        Some(rt.server("fx")).filter(|s| s.connected && s.connections == 2)
    })
    .await;
    let r = rt.call("mcp::fx::echo", json!({"text": "x"})).await;
    assert_eq!(r["content"][0]["text"], "echo: x", "{r}");
}

#[tokio::test]
async fn a_server_that_cannot_start_is_reported_and_the_harness_runs_on() {
    let mut broken = fixture("broken", &[]);
    broken.transport = harness_mcp::Transport::Stdio {
        command: "/nonexistent/mcp-server".into(),
        args: vec![],
        env: Default::default(),
        cwd: None,
    };
    let rt = runtime(
        json!({"generations": [text_gen("still here")]}),
        vec![broken, fixture("fx", &[])],
    )
    .await;
    rt.connected("fx").await;
    let b = rt.failed("broken").await;
    assert!(!b.connected);
    assert_eq!(b.connections, 0);
    let e = b.last_error.unwrap();
    assert!(
        e.starts_with("mcp server 'broken' did not start: cannot run '/nonexistent/mcp-server'"),
        "{e}"
    );
    let (_, s) = rt.run_turn(send("hello", &["mcp::*"])).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("still here")));
}

/// A process's state letter from /proc (`Z` = exited, not yet reaped); None when gone.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim().chars().next()
}

#[tokio::test]
async fn stopping_a_server_stops_what_it_started() {
    let rt = saying_hi(vec![fixture("fx", &[])]).await;
    rt.connected("fx").await;
    let r = rt.call("mcp::fx::spawn_sleeper", json!({})).await;
    let pid: u32 = r["content"][0]["text"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        proc_state(pid).map(|c| c != 'Z'),
        Some(true),
        "the sleeper runs"
    );
    rt.hub.shutdown().await;
    eventually("the sleeper gone with the server's process group", || {
        Some(()).filter(|_| matches!(proc_state(pid), None | Some('Z')))
    })
    .await;
}

#[tokio::test]
async fn a_harness_mcp_server_is_refused_so_no_model_reaches_its_control_tools() {
    let rt = saying_hi(vec![
        fixture("self", &[("FIXTURE_NAME", "harness")]),
        fixture("fx", &[]),
    ])
    .await;
    rt.connected("fx").await;
    let s = rt.failed("self").await;
    assert!(!s.connected);
    assert!(s.functions.is_empty());
    let e = s.last_error.unwrap();
    assert!(
        e.starts_with("mcp server 'self' refused: it is a harness MCP server"),
        "{e}"
    );
    assert!(!rt
        .function_ids()
        .iter()
        .any(|f| f.starts_with("mcp::self::")));
    // Refused for good: not started again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(rt.server("self").connections, 0);
}

/// What a configuration reload does: added servers start, unchanged ones keep their process,
/// changed ones restart, removed ones stop and their functions go.
#[tokio::test]
async fn applying_a_new_server_list_starts_keeps_restarts_and_stops_servers() {
    let rt = saying_hi(vec![fixture("fx", &[])]).await;
    let fx = rt.connected("fx").await;
    rt.hub
        .apply(vec![fixture("fx", &[]), fixture("fy", &[])])
        .await;
    let fy_before = rt.connected("fy").await;
    assert_eq!(rt.server("fx").pid, fx.pid, "unchanged: not restarted");
    assert!(rt.function_ids().contains(&"mcp::fy::echo".to_string()));

    rt.hub.apply(vec![fixture("fy", &[("CHANGED", "1")])]).await;
    let fy = eventually("fy restarted", || {
        Some(rt.server("fy"))
            .filter(|s| s.connected && !s.functions.is_empty() && s.pid != fy_before.pid)
    })
    .await;
    assert_eq!(fy.connections, 1, "a changed server is a new one");
    assert!(rt.hub.status().iter().all(|s| s.name != "fx"));
    let ids = rt.function_ids();
    assert!(!ids.iter().any(|f| f.starts_with("mcp::fx::")), "{ids:?}");
    assert!(ids.contains(&"mcp::fy::echo".to_string()));
}

/// `settled` returns once each server has listed its tools (they are registered by then) or
/// failed to start; it never waits out its limit for a server that cannot start.
#[tokio::test]
async fn settled_waits_for_tool_lists_or_failures() {
    let dir = tempfile::tempdir().unwrap();
    let block = dir.path().join("down");
    std::fs::write(&block, "").unwrap();
    let good = fixture("fx", &[]);
    let bad = fixture(
        "bad",
        &[("FIXTURE_FAIL_IF_EXISTS", block.to_str().unwrap())],
    );
    let rt = saying_hi(vec![good, bad]).await;
    let started = Instant::now();
    assert!(rt.hub.settled(Duration::from_secs(30)).await);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let fx = rt.server("fx");
    assert!(fx.connected && fx.listed, "{fx:?}");
    assert!(rt.function_ids().contains(&"mcp::fx::echo".to_string()));
    let bad = rt.server("bad");
    assert!(!bad.connected && bad.last_error.is_some(), "{bad:?}");
}
