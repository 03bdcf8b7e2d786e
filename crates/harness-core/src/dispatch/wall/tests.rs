use super::*;
use serde_json::json;

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
    ] {
        assert!(operator_only(id), "{id}");
        assert!(check(id, &json!({})).is_err(), "{id}");
    }
    for id in [
        "harness::spawn",
        "harness::ask",
        "engine::functions::list",
        "weather::now",
    ] {
        assert!(!operator_only(id), "{id}");
    }
}

#[test]
fn arguments_decide_the_rest() {
    let refused = |id: &str, args| check(id, &args).unwrap_err();
    assert!(
        refused("state::set", json!({"scope": "harness_turn", "key": "s"}))
            .contains("harness_turn")
    );
    assert!(
        refused("state::delete", json!({"scope": "harness_queue:s1"})).contains("harness_queue:s1")
    );
    assert!(refused("state::get", json!({"scope": "approvals"})).contains("approvals"));
    assert_eq!(
        check("state::set", &json!({"scope": "notes", "key": "k"})),
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
            json!({"trigger_type": "cron", "function_id": target, "config": {}})
        )
        .contains("filesystem root"));
    }
    assert!(refused(
        "engine::register_trigger",
        json!({"trigger_type": "cron", "function_id": "harness::sweep-pending"})
    )
    .contains("harness::sweep-pending"));
    assert_eq!(
        check(
            "engine::register_trigger",
            &json!({"trigger_type": "cron", "function_id": "my::wake"})
        ),
        Ok(Reach::Free)
    );
    assert_eq!(
        check("session::messages", &json!({"session_id": "s9"})),
        Ok(Reach::Session("s9".into()))
    );
    assert_eq!(
        check("harness::status", &json!({"session_id": "s9"})),
        Ok(Reach::Session("s9".into()))
    );
    assert!(check("session::append", &json!({})).is_err());
}
