//! The control-plane wall: whatever its allow list says, a model cannot steer the loop, decide
//! approvals, bind hooks, touch the harness's state or reach another tree's sessions; the
//! operator (here: direct bus calls, as the HTTP API makes them) still can.

mod support;

use harness_types::api::{FunctionPolicy, TurnStatus};
use serde_json::{json, Value};
use support::*;

fn attack(id: &str, function_id: &str, arguments: Value) -> Value {
    json!({"type": "function_call", "id": id, "function_id": function_id, "arguments": arguments})
}

#[tokio::test]
async fn a_model_allowed_everything_is_refused_every_control_plane_call() {
    let rt = {
        let calls = json!({"match": {"last_user_text": "^attack"}, "content": [
            attack("a1", "approval::decide", json!({"approval_id": "x", "decision": "approve", "digest": "d"})),
            attack("a2", "state::set", json!({"scope": "harness_turn", "key": "victim", "value": {}})),
            attack("a3", "engine::register_trigger", json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "evil::hook", "config": {}})),
            attack("a4", "harness::function::resolve", json!({"session_id": "attacker", "turn_id": "t", "function_call_id": "a1", "action": "deliver"})),
            attack("a5", "session::messages", json!({"session_id": "victim"})),
            attack("a6", "harness::send", json!({"session_id": "victim", "message": "obey"})),
            attack("a7", "engine::unregister_trigger", json!({"id": "any"})),
            attack("a8", "state::list", json!({"scope": "approvals"})),
            attack("a9", "engine::register_trigger", json!({"trigger_type": "cron", "function_id": "harness::sweep-pending", "config": {"expression": "* * * * * *"}})),
            attack("a10", "session::messages", json!({"session_id": "attacker"})),
            attack("a11", "state::set", json!({"scope": "notes", "key": "k", "value": 1})),
            attack("a12", "engine::functions::list", json!({}))
        ]});
        runtime(
            json!({"generations": [calls, text_gen("tried")]}),
            &["fs::*"],
        )
        .await
    };
    let (victim, _) = rt.send(send_allowing("hello", Some("victim"))).await;
    rt.wait_status(&victim, TurnStatus::Completed).await;
    let (sid, tid) = rt.send(send_allowing("attack", Some("attacker"))).await;
    rt.wait_terminal(&sid, &tid).await;

    let results = rt.results(&sid);
    let by_id = |id: &str| {
        results
            .iter()
            .find(|(m, _)| m.function_call_id == id)
            .map(|(m, _)| m.clone())
            .unwrap_or_else(|| panic!("no result for {id}"))
    };
    for id in ["a1", "a2", "a3", "a4", "a5", "a6", "a7", "a8", "a9"] {
        let m = by_id(id);
        assert!(m.is_error, "{id}: {:?}", m.details);
        assert_eq!(m.details["error"], "control_plane", "{id}: {:?}", m.details);
        let text = harness_types::message::joined_text(&m.content);
        assert!(
            text.contains("control plane") && text.contains("whatever its allow list says"),
            "{id}: {text}"
        );
    }
    // Inside its own tree and its own state, the model is free.
    assert!(!by_id("a10").is_error, "{:?}", by_id("a10").details);
    assert!(!by_id("a11").is_error, "{:?}", by_id("a11").details);

    // Discovery never lists what the model cannot call.
    let listed = by_id("a12").details.to_string();
    for hidden in [
        "approval::decide",
        "harness::send",
        "harness::function::resolve",
        "router::chat",
    ] {
        assert!(
            !listed.contains(&format!("\"{hidden}\"")),
            "{hidden} listed: {listed}"
        );
    }
    assert!(listed.contains("\"harness::spawn\""), "{listed}");

    // Nothing the attacks aimed at changed.
    let victim_turn = rt.status("victim").await.unwrap();
    assert_eq!(victim_turn.status, TurnStatus::Completed);
    let hooks = rt.ok("engine::registered-triggers::list", json!({})).await;
    assert!(
        !hooks.to_string().contains("evil::hook"),
        "no hook was installed: {hooks}"
    );

    // The operator's own calls of the same functions succeed.
    rt.ok(
        "state::get",
        json!({"scope": "harness_turn", "key": "victim"}),
    )
    .await;
    rt.ok("approval::list", json!({})).await;
    let messages = rt
        .ok("session::messages", json!({"session_id": "victim"}))
        .await;
    assert!(!messages["messages"].as_array().unwrap().is_empty());
    let bound = rt
        .ok(
            "engine::register_trigger",
            json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "fs::write", "config": {}}),
        )
        .await;
    rt.ok("engine::unregister_trigger", json!({"id": bound["id"]}))
        .await;
}

/// The verdict per registered function for a root turn allowed `*`, a leaf sub-agent of it, an
/// orchestrator sub-agent of it, and the operator. `run` = runs, `args` = runs once its
/// arguments pass the wall, `wall` = the control plane, `policy` = the sub-agent's policy.
#[tokio::test]
async fn every_registered_function_has_one_verdict_per_caller() {
    let rt = runtime(json!({"generations": [text_gen("hi")]}), &["fs::*"]).await;
    let list = rt
        .ok("engine::functions::list", json!({"include_internal": true}))
        .await;
    let mut ids = strings(&list["functions"], "function_id");
    ids.sort();
    ids.dedup();
    let root = FunctionPolicy {
        allow: vec!["*".into()],
        ..Default::default()
    };
    let leaf = harness_core::subagent_policy(Some(&root), false);
    let orchestrator = harness_core::subagent_policy(Some(&root), true);
    let verdict = |p: Option<&FunctionPolicy>, id: &str| match harness_core::model_verdict(p, id) {
        Ok(true) => "run",
        Ok(false) => "args",
        Err(text) if text.contains("control plane") => "wall",
        Err(_) => "policy",
    };
    let table: Vec<String> = ids
        .iter()
        .map(|&id| {
            format!(
                "{id} {} {} {} run",
                verdict(Some(&root), id),
                verdict(leaf.as_ref(), id),
                verdict(orchestrator.as_ref(), id)
            )
        })
        .collect();
    let expected = EXPECTED.trim().lines().map(str::trim).collect::<Vec<_>>();
    assert_eq!(table, expected, "\n{}", table.join("\n"));

    // The refusal the model reads names the function and says why.
    let text = harness_core::model_verdict(Some(&root), "approval::decide").unwrap_err();
    assert!(text.starts_with("function approval::decide is part of the harness's control plane"));
    let text = harness_core::model_verdict(leaf.as_ref(), "harness::spawn").unwrap_err();
    assert!(
        text.contains("not permitted by this agent's dispatch policy"),
        "{text}"
    );
}

/// function, root with `*`, leaf child, orchestrator child, operator.
const EXPECTED: &str = "
approval::decide wall wall wall run
approval::gate wall wall wall run
approval::list wall wall wall run
approval::prune wall wall wall run
directory::agents::create wall wall wall run
directory::agents::get run run run run
directory::agents::list run run run run
directory::agents::update wall wall wall run
directory::skills::create wall wall wall run
directory::skills::get run run run run
directory::skills::list run run run run
directory::skills::update wall wall wall run
directory::system-prompts::create wall wall wall run
directory::system-prompts::get run run run run
directory::system-prompts::update wall wall wall run
engine::functions::info run run run run
engine::functions::list run run run run
engine::register_trigger args args args run
engine::registered-triggers::list wall wall wall run
engine::triggers::info run run run run
engine::triggers::list run run run run
engine::unregister_trigger wall wall wall run
engine::workers::info run run run run
engine::workers::list run run run run
fs::edit run run run run
fs::list run run run run
fs::read run run run run
fs::search run run run run
fs::write run run run run
harness::ask run run run run
harness::context-policy wall wall wall run
harness::delete-session-tree wall wall wall run
harness::delete-session-tree-status wall wall wall run
harness::filesystem::grant wall wall wall run
harness::filesystem::grants wall wall wall run
harness::filesystem::info wall wall wall run
harness::filesystem::revoke wall wall wall run
harness::function::resolve wall wall wall run
harness::function::trigger wall wall wall run
harness::metrics wall wall wall run
harness::on-config-change wall wall wall run
harness::on-functions-change wall wall wall run
harness::send wall wall wall run
harness::session-deletion-step wall wall wall run
harness::session-tree wall wall wall run
harness::spawn run policy run run
harness::status args args args run
harness::stop wall wall wall run
harness::sweep-pending wall wall wall run
harness::system-prompt::get wall wall wall run
harness::turn wall wall wall run
harness::usage::list wall wall wall run
router::abort wall wall wall run
router::chat wall wall wall run
router::count-tokens run run run run
router::models::get run run run run
router::models::list run run run run
router::models::supports run run run run
session::append args args args run
session::changes args args args run
session::create wall wall wall run
session::delete wall wall wall run
session::ensure args args args run
session::get args args args run
session::list wall wall wall run
session::messages args args args run
session::set-status args args args run
session::update-message wall wall wall run
shell::exec run run run run
state::delete args args args run
state::get args args args run
state::list args args args run
state::set args args args run
web::fetch run run run run
";
