use super::*;
use serde_json::json;

fn allowing(allow: &[&str]) -> FunctionPolicy {
    FunctionPolicy {
        allow: allow.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// A model allowed everything.
fn check_all(function_id: &str, arguments: &Value) -> Result<Reach, String> {
    check(Some(&allowing(&["*"])), function_id, arguments)
}

#[test]
fn the_operator_only_functions_are_walled_by_id() {
    for id in [
        "harness::send",
        "harness::turn",
        "harness::stop",
        "harness::function::resolve",
        "harness::function::trigger",
        "harness::sweep-pending",
        "harness::on-config-change",
        "harness::on-functions-change",
        "approval::decide",
        "approval::list",
        "engine::unregister_trigger",
        "engine::registered-triggers::list",
        "session::list",
        "session::create",
        "router::chat",
        "router::abort",
        // Every function that can generate: context assembly runs a summarizer generation,
        // the judge is a generation; a context function added later is walled until listed.
        "context::assemble",
        "context::compact",
        "judge::evaluate",
        "judge::anything",
        // Rewrites any entry in place.
        "session::update-message",
        // A model never rewrites its own identity, profiles or skills.
        "directory::system-prompts::create",
        "directory::system-prompts::update",
        "directory::agents::create",
        "directory::agents::update",
        "directory::skills::create",
        "directory::skills::update",
    ] {
        assert!(operator_only(id), "{id}");
        assert!(check_all(id, &json!({})).is_err(), "{id}");
    }
    for id in [
        "harness::spawn",
        "harness::ask",
        "engine::functions::list",
        "weather::now",
        "context::count-tokens",
        "router::models::get",
        "directory::system-prompts::get",
        "directory::skills::get",
        "directory::agents::list",
    ] {
        assert!(!operator_only(id), "{id}");
    }
}

#[test]
fn arguments_decide_the_rest() {
    let refused = |id: &str, args| check_all(id, &args).unwrap_err();
    assert!(
        refused("state::set", json!({"scope": "harness_turn", "key": "s"}))
            .contains("harness_turn")
    );
    assert!(
        refused("state::delete", json!({"scope": "harness_queue:s1"})).contains("harness_queue:s1")
    );
    assert!(refused("state::get", json!({"scope": "approvals"})).contains("approvals"));
    assert_eq!(
        check_all("state::set", &json!({"scope": "notes", "key": "k"})),
        Ok(Reach::Free)
    );
    assert!(refused(
        "engine::register_trigger",
        json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "x::y"})
    )
    .contains("harness::hook::pre-trigger"));
    for target in ["fs::write", "shell::exec"] {
        assert!(refused(
            "engine::register_trigger",
            json!({"trigger_type": "queue", "function_id": target, "config": {}})
        )
        .contains("filesystem root"));
    }
    assert!(refused(
        "engine::register_trigger",
        json!({"trigger_type": "queue", "function_id": "harness::sweep-pending"})
    )
    .contains("harness::sweep-pending"));
    assert_eq!(
        check_all(
            "engine::register_trigger",
            &json!({"trigger_type": "queue", "function_id": "my::wake"})
        ),
        Ok(Reach::Binding("my::wake".into()))
    );
    assert_eq!(
        check_all("session::messages", &json!({"session_id": "s9"})),
        Ok(Reach::Session("s9".into()))
    );
    assert_eq!(
        check_all("harness::status", &json!({"session_id": "s9"})),
        Ok(Reach::Session("s9".into()))
    );
    assert!(check_all("session::append", &json!({})).is_err());
}

/// A model's binding outlives nothing: no timer, no target outside its own policy or behind the
/// wall, none whose calls the wall would check by their arguments, none that generates.
#[test]
fn a_models_binding_passes_its_own_policy_and_the_wall() {
    let bind = |policy: &FunctionPolicy, trigger_type: &str, target: &str| {
        check(
            Some(policy),
            "engine::register_trigger",
            &json!({"trigger_type": trigger_type, "function_id": target, "config": {"expression": "* * * * * *"}}),
        )
    };
    let all = allowing(&["*"]);
    // A timer fires outside any turn: refused whatever the target.
    for target in ["my::wake", "engine::functions::list", "state::delete"] {
        let text = bind(&all, "cron", target).unwrap_err();
        assert!(
            text.contains("'cron' binding fires outside any turn"),
            "{text}"
        );
    }
    // The target must pass the model's own policy...
    let narrow = allowing(&["engine::register_trigger", "weather::*"]);
    assert_eq!(
        bind(&narrow, "queue", "weather::now"),
        Ok(Reach::Binding("weather::now".into()))
    );
    let text = bind(&narrow, "queue", "mail::send").unwrap_err();
    assert!(
        text.contains("'mail::send' is not permitted by this agent's dispatch policy"),
        "{text}"
    );
    let denied = FunctionPolicy {
        deny: vec!["weather::now".into()],
        ..narrow.clone()
    };
    assert!(bind(&denied, "queue", "weather::now").is_err());
    assert!(bind(&allowing(&[]), "queue", "weather::now").is_err());
    // ...and the wall, by id and by arguments.
    for target in [
        "router::chat",
        "context::assemble",
        "judge::evaluate",
        "session::update-message",
        "approval::decide",
        "engine::unregister_trigger",
        "engine::register_trigger",
        "state::delete",
        "state::set",
        "session::append",
        "harness::status",
        "harness::spawn",
    ] {
        let text = bind(&all, "queue", target).unwrap_err();
        assert!(
            text.contains(target) && text.contains("control plane"),
            "{target}: {text}"
        );
    }
}

/// Any function whose request takes a model or a provider is taken to generate, except the
/// catalog readers, the token counter and the loop's own spawn.
#[test]
fn a_request_that_takes_a_model_is_walled_unless_it_only_reads() {
    let with = |props: Value| json!({"type": "object", "properties": props});
    assert!(takes_a_model(
        "context::assemble",
        Some(&with(json!({"model": {}, "messages": {}})))
    ));
    assert!(takes_a_model(
        "images::draw",
        Some(&with(json!({"provider": {}, "prompt": {}})))
    ));
    assert!(!takes_a_model(
        "weather::now",
        Some(&with(json!({"city": {}})))
    ));
    assert!(!takes_a_model("weather::now", None));
    for id in READS_MODELS {
        assert!(
            !takes_a_model(id, Some(&with(json!({"model": {}, "provider": {}})))),
            "{id}"
        );
    }
    assert!(generates_refusal("images::draw").contains("takes a model or a provider"));
}
