//! Request fields of the v1.0.6 reference and seed 000 that a client of the reference sends:
//! `options.mode` on send and spawn, spawn `display`, `options.max_children`; asserted on what
//! the router received, the sessions' metadata, the session tree and the turn events.

mod support;

use harness_bus::Bus;
use harness_types::api::{ExposeMode, Mode, SendOptions, SpawnRequest, SystemPromptStrategy};
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
    let rt = replying("ok").await;
    let r = rt
        .send(with_mode("plan the release", Some(Mode::Plan), None))
        .await;
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
    let r = rt.send(with_mode("go on", None, Some(&sid))).await;
    rt.wait_terminal(&sid, &r.turn_id).await;
    assert_eq!(prompts(&rt, &sid)[1], first);

    // Naming another mode swaps only the paragraph; the rest of the prompt is the same bytes.
    let r = rt
        .send(with_mode("what is it?", Some(Mode::Ask), Some(&sid)))
        .await;
    rt.wait_terminal(&sid, &r.turn_id).await;
    let asked = prompts(&rt, &sid)[2].clone();
    assert!(asked.starts_with("Operating mode: ask."), "{asked}");
    assert!(!asked.contains("Operating mode: plan"), "{asked}");
    let tail = |p: &str| p.split_once("\n\n").unwrap().1.to_string();
    assert_eq!(tail(&asked), tail(&first));

    // `agent` is the ordinary loop: no paragraph at all.
    let r = rt
        .send(with_mode("do it", Some(Mode::Agent), Some(&sid)))
        .await;
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
    let rt = replying("ok").await;
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
    let (r, _) = rt.run(req).await;
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
    let rt = replying("found it").await;
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

    let tree = rt.tree(&child.child_session_id).await;
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
    let rt = replying("ok").await;
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
    let (r, _) = rt.run(orchestrating("lead")).await;
    let lead = rt.tree(&r.session_id).await;
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

async fn status_of(rt: &Rt, session_id: &str, verbose: bool) -> Value {
    rt.ok(
        "harness::status",
        json!({"session_id": session_id, "verbose": verbose}),
    )
    .await
}

#[tokio::test]
async fn a_lean_status_truncates_a_long_result_and_a_verbose_one_does_not() {
    let long = "word ".repeat(200);
    let rt = runtime(
        json!({"generations": [text(Some("^long"), &long, 0), text(None, "short", 0)]}),
        config(),
    )
    .await;
    let (r, _) = rt.run(send("long please")).await;

    let lean = status_of(&rt, &r.session_id, false).await;
    let shown = lean["result"].as_str().unwrap();
    assert!(
        shown.ends_with(" …(truncated; use verbose: true for the full result)"),
        "{shown}"
    );
    assert!(long.starts_with(&shown[..600]));
    assert_eq!(lean["expects_wake"], false);
    assert!(lean["result_error"].is_null() && lean.get("result_error").is_some());
    assert!(lean.get("validation_retries").is_none(), "{lean}");
    // What the router was sent as the cache surface is what status names.
    let sent = rt.recorder.extras.lock().unwrap()[0].clone();
    assert_eq!(
        lean["context"]["prompt_surface_digest"],
        json!(sent.cache_intent.unwrap().surface_digest.unwrap())
    );

    let verbose = status_of(&rt, &r.session_id, true).await;
    assert_eq!(verbose["result"], json!(long));
    assert_eq!(verbose["validation_retries"], 0);
    assert_eq!(verbose["max_validation_retries"], 2);
    assert!(verbose["max_transient_resumes"].is_u64(), "{verbose}");

    // A short result is the same in both.
    let (r, _) = rt.run(send("brief")).await;
    assert_eq!(
        status_of(&rt, &r.session_id, false).await["result"],
        "short"
    );

    // No prompt, no sections: the fallback says why.
    let mut req = send("brief");
    req.options = Some(SendOptions {
        system_prompt_strategy: Some(SystemPromptStrategy::Disabled),
        ..Default::default()
    });
    let (r, _) = rt.run(req).await;
    let lean = status_of(&rt, &r.session_id, false).await;
    assert_eq!(
        lean["context"],
        json!({"prompt_sections_fallback": "no_stable_prefix"})
    );
    let done = rt.completed_events(&r.session_id, &r.turn_id).await;
    assert_eq!(done[0]["context"], lean["context"], "{:?}", done);
}

/// `harness::function::trigger` answers v1.0.6's pair: a held call the pending shape, a call
/// that ran the result shape with every field the reference requires.
#[tokio::test]
async fn function_trigger_answers_the_pending_shape_for_a_held_call() {
    let rt = replying("ok").await;
    rt.register("t::echo", None, |p| json!({"echo": p}));
    rt.bus.register_function(
        harness_bus::FunctionDef::new("guard::hold", "holds"),
        std::sync::Arc::new(|_p: Value, _c: harness_bus::CallContext| async {
            Ok(json!({"decision": "hold"}))
        }),
    );
    // A session whose policy allows the target.
    let req = allowing_as("hi", &["t::*"], ExposeMode::AgentTrigger);
    let (r, _) = rt.run(req).await;
    let call = |id: &str| json!({"session_id": r.session_id, "call": {"id": id, "function_id": "t::echo", "arguments": {"x": 1}}});
    let ran = rt.ok("harness::function::trigger", call("c1")).await;
    for field in [
        "content",
        "is_error",
        "details",
        "duration_ms",
        "function_call_id",
        "function_id",
    ] {
        assert!(ran.get(field).is_some(), "{field} in {ran}");
    }
    assert_eq!(ran["is_error"], false);
    assert_eq!(ran["details"]["echo"]["x"], 1);

    rt.bind("pre-trigger", "guard::hold", json!({"functions": ["t::*"]}))
        .await;
    let held = rt.ok("harness::function::trigger", call("c2")).await;
    assert_eq!(held["pending"], true, "{held}");
    assert_eq!(held["function_call_id"], "c2");
    assert!(
        held.get("pending_timeout_ms").is_some_and(Value::is_null),
        "a hook hold never expires: {held}"
    );
    assert!(held.get("content").is_none(), "{held}");
    // What a client typed from the reference parses.
    let parsed: harness_types::api::FunctionTriggerResponse = serde_json::from_value(held).unwrap();
    assert!(matches!(
        parsed,
        harness_types::api::FunctionTriggerResponse::Pending(_)
    ));
}

/// The operator writes the default prompt through the API; the next send freezes it (what the
/// router received says so), with no restart. A model calling the writer is refused by the
/// wall, whatever its allow list, and the file keeps the operator's text.
#[tokio::test]
async fn a_default_prompt_written_through_the_api_reaches_the_next_send_and_no_model_can_write_it()
{
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime(
        json!({"generations": [
            {"match": {"last_user_text": "^rewrite yourself"}, "content": [
                {"type": "function_call", "id": "w1", "function_id": "directory::system-prompts::update",
                 "arguments": {"name": "default", "content": "You obey the model."}}]},
            text(None, "ok", 0)
        ]}),
        config(),
    )
    .await;
    harness_directory::register(&rt.bus, &harness_directory::Directory::new(dir.path()));
    let out = rt
        .ok(
            "directory::system-prompts::create",
            json!({"name": "default", "content": "You are the house identity, v1."}),
        )
        .await;
    assert_eq!(out["created"], true);
    let (first, _) = rt.run(send("hello")).await;
    assert!(prompts(&rt, &first.session_id)[0].starts_with("You are the house identity, v1."));

    rt.ok("directory::system-prompts::update",
            json!({"name": "default", "body": "You are the house identity, v2.", "front_matter": {"description": "house"}})).await;
    let (second, _) = rt.run(send("hello again")).await;
    let p = prompts(&rt, &second.session_id).remove(0);
    assert!(p.starts_with("You are the house identity, v2."), "{p}");

    // A model allowed everything still cannot reach the writer.
    let req = allowing_as("rewrite yourself", &["*"], ExposeMode::AgentTrigger);
    let (r, _) = rt.run(req).await;
    let results = rt.results(&r.session_id);
    let refused = results
        .iter()
        .find(|f| f.function_call_id == "w1")
        .expect("the call got a result");
    assert!(refused.is_error, "{refused:?}");
    let text: String = refused
        .content
        .iter()
        .map(|b| serde_json::to_string(b).unwrap())
        .collect();
    assert!(text.contains("control plane"), "{text}");
    let on_disk = std::fs::read_to_string(dir.path().join("system-prompts/default.md")).unwrap();
    assert!(on_disk.contains("v2"), "{on_disk}");
    assert!(!on_disk.contains("obey"), "{on_disk}");
}

/// `reasoning: "lowest"`: the send answer says what it applied (from the model's catalog row),
/// a model without a row is refused, and naming an effort next to it is refused by name.
#[tokio::test]
async fn reasoning_lowest_is_reported_on_the_send_and_its_bad_combinations_refused() {
    let rt = replying("ok").await;
    let lowest = |model: &str, provider: &str| {
        let mut req = send("think little");
        req.model = Some(model.into());
        req.provider = Some(provider.into());
        req.options = Some(SendOptions {
            reasoning: Some("lowest".into()),
            ..Default::default()
        });
        req
    };
    // The scripted catalog row says the model thinks and lists no efforts: minimal.
    let r = rt.send(lowest("m", "scripted")).await;
    let applied = serde_json::to_value(r.reasoning.clone()).unwrap();
    assert_eq!(
        applied,
        json!({"thinking_level": "minimal", "reasoning_effort": null})
    );
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
    // A send that names no effort keeps it and reports nothing new.
    let again = rt.send(with_mode("more", None, Some(&r.session_id))).await;
    assert!(again.reasoning.is_none());

    let e = rt.harness.send(lowest("m", "nowhere")).await.unwrap_err();
    assert!(
        e.message.starts_with("options.reasoning:") && e.message.contains("no catalog row"),
        "{e}"
    );
    for (options, names) in [
        (
            json!({"reasoning": "lowest", "thinking_level": "high"}),
            "options.thinking_level",
        ),
        (
            json!({"reasoning": "lowest", "provider_options": {}}),
            "options.provider_options",
        ),
    ] {
        let e = rt
            .bus
            .call(
                "harness::send",
                json!({"message": "x", "model": "m", "provider": "scripted", "options": options}),
                None,
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("options.reasoning") && e.contains(names), "{e}");
    }
}

/// A call the judge repaired says so in its result, as a coerced one does: the model reads
/// which field was renamed, never a value.
#[tokio::test]
async fn the_judges_repair_is_noted_in_the_calls_result() {
    let rt = runtime(
        json!({"generations": [
            {"match": {"last_user_text": "^paint"}, "content": [
                {"type": "function_call", "id": "p1", "function_id": "paint::wall",
                 "arguments": {"colour": "teal"}}]},
            text(None, "painted", 0)
        ]}),
        config(),
    )
    .await;
    let painted = rt.register(
        "paint::wall",
        Some(
            json!({"type": "object", "properties": {"color": {"type": "string"}},
                    "required": ["color"], "additionalProperties": false}),
        ),
        |p| json!({"painted": p["color"]}),
    );
    rt.bus.register_function(
        harness_bus::FunctionDef::new("judge::evaluate", "test judge"),
        std::sync::Arc::new(|_p: Value, _c: harness_bus::CallContext| async {
            Ok(
                json!({"status": "ok", "results": {"reconcile": {"answers": {
                "q0": {"choice": "color", "probability": 0.99}}}}}),
            )
        }),
    );
    let req = allowing_as("paint it", &["paint::*"], ExposeMode::AgentTrigger);
    let (r, _) = rt.run(req).await;
    assert_eq!(painted.load(std::sync::atomic::Ordering::SeqCst), 1);
    let result = rt
        .results(&r.session_id)
        .into_iter()
        .find(|f| f.function_call_id == "p1")
        .unwrap();
    assert!(!result.is_error, "{result:?}");
    let text: Vec<String> = result
        .content
        .iter()
        .map(|b| serde_json::to_string(b).unwrap())
        .collect();
    let text = text.join(" ");
    assert!(text.contains("`/colour` was renamed to `color`"), "{text}");
    assert!(!text.contains("\"teal\" was"), "{text}");
}

/// A pre-generate binding's `inject_prompt` is a layer of the preview, after the runtime
/// context, and is what the step appends.
#[tokio::test]
async fn the_preview_shows_a_bindings_inject_prompt_as_the_step_sends_it() {
    let rt = replying("ok").await;
    rt.register("policy::house-rules", None, |_| json!({}));
    rt.bind_with(
        "pre-generate",
        "policy::house-rules",
        json!({}),
        json!({"inject_prompt": "House rule: answer in English."}),
    )
    .await;
    let (r, _) = rt.run(send("hi")).await;
    let preview = rt
        .ok(
            "harness::system-prompt::get",
            json!({"session_id": r.session_id}),
        )
        .await;
    let layers = preview["layers"].as_array().unwrap();
    let last = layers.last().unwrap();
    assert_eq!(last["kind"], "injected", "{preview}");
    assert_eq!(last["text"], "House rule: answer in English.");
    assert_eq!(layers[layers.len() - 2]["kind"], "runtime_context");
    // The composed preview is the prompt the router received.
    assert_eq!(
        preview["system_prompt"].as_str().unwrap(),
        prompts(&rt, &r.session_id)[0]
    );
}

/// A profile's preloaded contracts are frozen into the prompt; when one changes, goes away or
/// (unavailable at first) appears, every later step carries a tail notice naming exactly those
/// ids, while the frozen prompt stays byte for byte.
#[tokio::test]
async fn a_changed_preloaded_contract_is_named_in_a_tail_notice() {
    let dir = tempfile::tempdir().unwrap();
    let rt = replying("ok").await;
    harness_directory::register(&rt.bus, &harness_directory::Directory::new(dir.path()));
    rt.register(
        "t::echo",
        Some(json!({"type": "object", "properties": {"text": {"type": "string"}}})),
        |p| p,
    );
    rt.register("t::steady", None, |p| p);
    rt.ok("directory::agents::create",
            json!({"name": "echoer", "content": "---\nmodel: m\nprovider: scripted\nfunctions: [t::echo, t::later, t::steady]\n---\nEcho things."})).await;
    let mut req = send("first");
    req.model = None;
    req.provider = None;
    req.options = Some(SendOptions {
        agent: Some("echoer".into()),
        ..Default::default()
    });
    let r = rt.send(req).await;
    let sid = r.session_id.clone();
    rt.wait_terminal(&sid, &r.turn_id).await;
    let last_user_texts = |rt: &Rt| -> Vec<String> {
        let seen = rt.recorder.seen.lock().unwrap();
        let req = seen
            .iter()
            .rev()
            .find(|r| r.session_id.as_deref() == Some(sid.as_str()))
            .unwrap();
        req.messages
            .iter()
            .filter(|m| m.role() == "user")
            .map(|m| m.text())
            .collect()
    };
    assert!(
        !last_user_texts(&rt).iter().any(|t| t.contains("stale")),
        "nothing changed yet"
    );

    // t::echo's schema changes and t::later appears; t::steady stays as it was.
    rt.register(
        "t::echo",
        Some(json!({"type": "object", "properties": {"text": {"type": "string"}, "times": {"type": "integer"}}})),
        |p| p,
    );
    rt.register("t::later", None, |p| p);
    let r = rt.send(with_mode("again", None, Some(&sid))).await;
    rt.wait_terminal(&sid, &r.turn_id).await;
    let texts = last_user_texts(&rt);
    let notice = texts
        .iter()
        .find(|t| t.contains("Preloaded function contracts"))
        .unwrap_or_else(|| panic!("{texts:?}"));
    assert!(notice.contains("`t::echo` (changed)"), "{notice}");
    assert!(notice.contains("`t::later` (now available)"), "{notice}");
    assert!(!notice.contains("t::steady"), "{notice}");
    // The frozen prompt is the same bytes, and the notice is not in the transcript.
    let p = prompts(&rt, &sid);
    assert_eq!(p[0], p[1]);
    assert!(!rt
        .messages(&sid)
        .iter()
        .any(|(_, t)| t.contains("Preloaded")));
}

/// The skills index is frozen in the prompt (the cache prefix); when the catalog changes, the
/// session's next turn starts with one durable user-role correction, and the prompt stays.
#[tokio::test]
async fn a_changed_skills_catalog_arrives_as_one_durable_correction() {
    let dir = tempfile::tempdir().unwrap();
    let rt = replying("ok").await;
    harness_directory::register(&rt.bus, &harness_directory::Directory::new(dir.path()));
    let skill = |verb: &str, name: &str, description: &str| {
        let bus = rt.bus.clone();
        let (verb, name, description) =
            (verb.to_string(), name.to_string(), description.to_string());
        async move {
            bus.call(
                &format!("directory::skills::{verb}"),
                json!({"name": name, "body": "Steps.", "front_matter": {"name": name, "description": description}}),
                None,
            )
            .await
            .unwrap();
        }
    };
    skill("create", "style", "House style.").await;
    let r = rt.send(send("first")).await;
    let sid = r.session_id.clone();
    rt.wait_terminal(&sid, &r.turn_id).await;
    let corrections = |rt: &Rt| -> Vec<String> {
        rt.messages(&sid)
            .into_iter()
            .filter(|(role, t)| role == "user" && t.contains("skills catalog changed"))
            .map(|(_, t)| t)
            .collect()
    };
    // Nothing changed: a second turn gets no correction.
    let r = rt.send(with_mode("second", None, Some(&sid))).await;
    rt.wait_terminal(&sid, &r.turn_id).await;
    assert!(corrections(&rt).is_empty());

    skill("create", "deploy", "How to ship.").await;
    skill("update", "style", "House style, v2.").await;
    let r = rt.send(with_mode("third", None, Some(&sid))).await;
    rt.wait_terminal(&sid, &r.turn_id).await;
    let got = corrections(&rt);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(
        got[0].contains("added `deploy`: How to ship."),
        "{}",
        got[0]
    );
    assert!(
        got[0].contains("changed `style`: House style, v2."),
        "{}",
        got[0]
    );
    // Before the message it precedes, in the transcript and in what the model read.
    let texts: Vec<String> = rt.messages(&sid).into_iter().map(|(_, t)| t).collect();
    let at = texts.iter().position(|t| t == &got[0]).unwrap();
    assert_eq!(texts[at + 1], "third");
    let p = prompts(&rt, &sid);
    assert_eq!(p[0], p[2], "the frozen prompt is untouched");

    // Told once: the next turn has nothing new to correct.
    let r = rt.send(with_mode("fourth", None, Some(&sid))).await;
    rt.wait_terminal(&sid, &r.turn_id).await;
    assert_eq!(corrections(&rt).len(), 1);
}

/// A spawn called directly may name a display-only parent: the child is listed under it and
/// its events name it, so a binding filtered on that parent hears of it; and the spawn's
/// `options.max_output_tokens` caps the child's generations.
#[tokio::test]
async fn a_direct_spawns_display_parent_lists_the_child_and_names_it_on_its_events() {
    let rt = replying("ok").await;
    let (parent, _) = rt.run(send("host")).await;
    let heard = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Value>::new()));
    let log = heard.clone();
    rt.bus.register_function(
        harness_bus::FunctionDef::new("watch::children", "records events"),
        std::sync::Arc::new(move |p: Value, _c: harness_bus::CallContext| {
            log.lock().unwrap().push(p);
            async { Ok(json!({})) }
        }),
    );
    rt.trigger(
        "harness::turn-completed",
        "watch::children",
        json!({"parent_session_id": parent.session_id}),
        json!({}),
    )
    .await;
    let req: SpawnRequest = serde_json::from_value(json!({
        "task": "side job", "model": "m", "provider": "scripted",
        "parent_session_id": parent.session_id,
        "options": {"max_output_tokens": 123}
    }))
    .unwrap();
    let child = rt.harness.spawn(req).await.unwrap();
    rt.wait_terminal(&child.child_session_id, &child.child_turn_id)
        .await;

    let tree = rt.tree(&parent.session_id).await;
    assert_eq!(tree.children.len(), 1);
    assert_eq!(tree.children[0].session_id, child.child_session_id);
    let done = rt
        .completed_events(&child.child_session_id, &child.child_turn_id)
        .await;
    assert_eq!(done[0]["parent_session_id"], json!(parent.session_id));
    assert!(
        done[0].get("parent").is_none(),
        "no parent link: {}",
        done[0]
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while heard.lock().unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the binding heard nothing"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        heard.lock().unwrap()[0]["session_id"],
        json!(child.child_session_id)
    );
    let seen = rt.recorder.seen.lock().unwrap();
    let req = seen
        .iter()
        .find(|r| r.session_id.as_deref() == Some(child.child_session_id.as_str()))
        .unwrap();
    assert!(
        req.max_output_tokens.is_some_and(|m| m <= 123),
        "{:?}",
        req.max_output_tokens
    );
}
