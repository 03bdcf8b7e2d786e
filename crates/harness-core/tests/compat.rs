//! Request fields of the v1.0.6 reference and seed 000 that a client of the reference sends:
//! `options.mode` on send and spawn, spawn `display`, `options.max_children`; asserted on what
//! the router received, the sessions' metadata, the session tree and the turn events.

mod support;

use harness_types::api::{
    Mode, SendOptions, SessionTreeRequest, SpawnRequest, SystemPromptStrategy,
};
use serde_json::{json, Value};
use support::*;

/// The system prompt of every `router::chat` request of a session, in order.
fn prompts(rt: &Rt, session_id: &str) -> Vec<String> {
    rt.recorder
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.session_id.as_deref() == Some(session_id))
        .map(|r| r.system_prompt.clone().unwrap_or_default())
        .collect()
}

fn with_mode(
    message: &str,
    mode: Option<Mode>,
    session_id: Option<&str>,
) -> harness_types::api::SendRequest {
    let mut req = send(message);
    req.session_id = session_id.map(str::to_string);
    req.options = Some(SendOptions {
        mode,
        ..Default::default()
    });
    req
}

#[tokio::test]
async fn a_mode_heads_the_prompt_stays_with_the_session_and_agent_removes_it() {
    let rt = runtime(json!({"generations": [text(None, "ok", 0)]}), config()).await;
    let r = rt
        .harness
        .send(with_mode("plan the release", Some(Mode::Plan), None))
        .await
        .unwrap();
    let sid = r.session_id.clone();
    assert_eq!(
        rt.wait_terminal(&sid, &r.turn_id).await.result,
        Some(json!("ok"))
    );
    let first = prompts(&rt, &sid).remove(0);
    assert!(first.starts_with("Operating mode: plan."), "{first}");
    assert!(
        first.contains("You are an agent running inside harness"),
        "the identity follows the paragraph: {first}"
    );

    // Sticky: a send naming no prompt field keeps the mode.
    let r = rt
        .harness
        .send(with_mode("go on", None, Some(&sid)))
        .await
        .unwrap();
    rt.wait_terminal(&sid, &r.turn_id).await;
    assert_eq!(prompts(&rt, &sid)[1], first);

    // Naming another mode swaps only the paragraph; the rest of the prompt is the same bytes.
    let r = rt
        .harness
        .send(with_mode("what is it?", Some(Mode::Ask), Some(&sid)))
        .await
        .unwrap();
    rt.wait_terminal(&sid, &r.turn_id).await;
    let asked = prompts(&rt, &sid)[2].clone();
    assert!(asked.starts_with("Operating mode: ask."), "{asked}");
    assert!(!asked.contains("Operating mode: plan"), "{asked}");
    let tail = |p: &str| p.split_once("\n\n").unwrap().1.to_string();
    assert_eq!(tail(&asked), tail(&first));

    // `agent` is the ordinary loop: no paragraph at all.
    let r = rt
        .harness
        .send(with_mode("do it", Some(Mode::Agent), Some(&sid)))
        .await
        .unwrap();
    rt.wait_terminal(&sid, &r.turn_id).await;
    let agent = prompts(&rt, &sid)[3].clone();
    assert!(
        agent.starts_with("You are an agent running inside harness"),
        "{agent}"
    );
    assert_eq!(agent, tail(&first));
}

#[tokio::test]
async fn a_mode_with_a_disabled_prompt_is_refused_by_name() {
    let rt = runtime(json!({"generations": [text(None, "ok", 0)]}), config()).await;
    let mut req = with_mode("x", Some(Mode::Plan), None);
    req.options.as_mut().unwrap().system_prompt_strategy = Some(SystemPromptStrategy::Disabled);
    let e = rt.harness.send(req).await.unwrap_err();
    assert!(e.message.starts_with("options.mode:"), "{e}");

    // A session whose prompt is disabled cannot take a mode without naming a prompt again.
    let mut req = send("x");
    req.options = Some(SendOptions {
        system_prompt_strategy: Some(SystemPromptStrategy::Disabled),
        ..Default::default()
    });
    let r = rt.harness.send(req).await.unwrap();
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    let e = rt
        .harness
        .send(with_mode("y", Some(Mode::Ask), Some(&r.session_id)))
        .await
        .unwrap_err();
    assert!(e.message.starts_with("options.mode:"), "{e}");
}

fn spawn_req(task: &str, display: Value) -> SpawnRequest {
    serde_json::from_value(json!({
        "task": task, "model": "m", "provider": "scripted",
        "display": display,
        "options": {"mode": "plan"}
    }))
    .unwrap()
}

#[tokio::test]
async fn a_spawns_display_is_on_its_session_its_tree_node_and_its_events() {
    let rt = runtime(
        json!({"generations": [text(None, "found it", 0)]}),
        config(),
    )
    .await;
    let child = rt
        .harness
        .spawn(spawn_req(
            "find the flights",
            json!({"name": "  Flight finder ", "icon": "search", "color": "chartreuse"}),
        ))
        .await
        .unwrap();
    rt.wait_terminal(&child.child_session_id, &child.child_turn_id)
        .await;
    let want = json!({"name": "Flight finder", "icon": "search", "color": "neutral"});

    let meta = rt
        .sessions
        .get(&child.child_session_id)
        .unwrap()
        .expect("the child session");
    assert_eq!(meta.metadata["subagent_display"], want);
    assert_eq!(meta.title.as_deref(), Some("Flight finder"));

    let tree = rt
        .harness
        .session_tree(SessionTreeRequest {
            session_id: child.child_session_id.clone(),
        })
        .await
        .unwrap();
    assert_eq!(json!(tree.display), want);

    let events: Vec<(String, Value)> = rt.topics(&child.child_session_id);
    for topic in ["harness::turn-started", "harness::turn-completed"] {
        let (_, ev) = events
            .iter()
            .find(|(t, _)| t == topic)
            .unwrap_or_else(|| panic!("{topic} in {events:?}"));
        assert_eq!(ev["display"], want, "{topic}: {ev}");
    }
    // The spawn's mode reached the child's prompt.
    let p = prompts(&rt, &child.child_session_id).remove(0);
    assert!(p.starts_with("Operating mode: plan."), "{p}");
}

#[tokio::test]
async fn a_bad_display_is_refused_naming_the_field() {
    let rt = runtime(json!({"generations": [text(None, "ok", 0)]}), config()).await;
    let e = rt
        .harness
        .spawn(spawn_req("t", json!({"name": "   "})))
        .await
        .unwrap_err();
    assert!(e.message.starts_with("display.name:"), "{e}");
    let e = rt
        .harness
        .spawn(spawn_req("t", json!({"name": "x".repeat(49)})))
        .await
        .unwrap_err();
    assert!(e.message.starts_with("display.name:"), "{e}");
    // The icon's set is closed: the request does not parse, and the error names the field.
    let e = harness_types::parse::parse_payload::<SpawnRequest>(
        json!({"task": "t", "model": "m", "display": {"name": "n", "icon": "rocket"}}),
    )
    .unwrap_err();
    assert!(e.message.starts_with("display.icon:"), "{e}");
}

/// A model's spawn with `options.max_children: 1` gets a child that may start one sub-agent
/// of its own, not two.
#[tokio::test]
async fn max_children_limits_the_childs_own_fan_out() {
    let rt = runtime(
        json!({"generations": [
            spawn_gen("^lead", json!({"task": "delegate twice", "options": {"orchestrator": true, "max_children": 1, "detach": true}})),
            {"match": {"last_user_text": "^delegate twice"}, "content": [
                {"type": "function_call", "id": "a", "function_id": "harness::spawn", "arguments": {"task": "leaf one", "options": {"detach": true}}},
                {"type": "function_call", "id": "b", "function_id": "harness::spawn", "arguments": {"task": "leaf two", "options": {"detach": true}}}
            ]},
            text(None, "done", 0)
        ]}),
        config(),
    )
    .await;
    let r = rt.harness.send(orchestrating("lead")).await.unwrap();
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    let lead = rt
        .harness
        .session_tree(SessionTreeRequest {
            session_id: r.session_id.clone(),
        })
        .await
        .unwrap();
    let middle = &lead.children[0];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let results = loop {
        let results = rt.results(&middle.session_id);
        if results.len() >= 2 {
            break results;
        }
        assert!(std::time::Instant::now() < deadline, "{results:?}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    let refused: Vec<_> = results.iter().filter(|r| r.is_error).collect();
    assert_eq!(refused.len(), 1, "{results:?}");
    assert_eq!(
        refused[0].details["error"], "harness/spawn_fanout_exceeded",
        "{:?}",
        refused[0]
    );
}
