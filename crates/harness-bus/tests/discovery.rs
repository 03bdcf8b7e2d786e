//! The discovery loop the identity prompt teaches answers in embedded mode as on an engine:
//! `engine::functions::list` filtered by `prefix`, `search` and `worker`;
//! `engine::functions::info`; `engine::workers::list|info`; `engine::triggers::list|info`;
//! `engine::registered-triggers::list` in the engine's `registered_triggers` shape.

use std::sync::Arc;

use harness_bus::{Bus, CallContext, EmbeddedBus, FunctionDef, TriggerTypeDef};
use harness_store::{Durability, Store};
use serde_json::{json, Value};

fn open(dir: &std::path::Path) -> EmbeddedBus {
    let store = Store::open(&dir.join("b.db"), Durability::Normal).unwrap();
    let bus = EmbeddedBus::new(store).unwrap();
    for (id, description) in [
        ("weather::forecast", "Forecast for a city, by day"),
        ("weather::alerts", "Severe weather alerts"),
        ("session::messages", "A session's transcript"),
        ("fs::read", "Read a file under the turn's root"),
    ] {
        bus.register_function(
            FunctionDef::new(id, description),
            Arc::new(|_p: Value, _c: CallContext| async { Ok(json!(null)) }),
        );
    }
    bus.register_trigger_type(TriggerTypeDef {
        id: "weather::changed".into(),
        description: "The forecast changed".into(),
        config_schema: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        validate: None,
    });
    bus
}

/// Calls `function_id` as the operator does and returns its answer; these calls must succeed.
async fn ask(bus: &EmbeddedBus, function_id: &str, payload: Value) -> Value {
    bus.call(function_id, payload, None)
        .await
        .unwrap_or_else(|e| panic!("{function_id}: {e}"))
}

/// The string `field` of every element of the JSON array `list`, in order.
fn strings<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    let items = list
        .as_array()
        .unwrap_or_else(|| panic!("an array: {list}"));
    items.iter().map(|e| e[field].as_str().unwrap()).collect()
}

/// The ids of the functions an `engine::functions::list|info` answer names.
fn ids(answer: &Value) -> Vec<&str> {
    strings(&answer["functions"], "function_id")
}

#[tokio::test]
async fn functions_list_filters_by_prefix_search_and_worker() {
    let dir = tempfile::tempdir().unwrap();
    let bus = open(dir.path());
    let all = ask(&bus, "engine::functions::list", json!({})).await;
    assert!(ids(&all).contains(&"fs::read"), "{all}");
    let row = all["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["function_id"] == "session::messages")
        .unwrap();
    assert_eq!(row["worker_name"], "session-manager", "{row}");

    let by_prefix = ask(
        &bus,
        "engine::functions::list",
        json!({"prefix": "weather::"}),
    )
    .await;
    assert_eq!(ids(&by_prefix), ["weather::alerts", "weather::forecast"]);

    // Every word, in the id or the description, whatever its case.
    let searched = ask(
        &bus,
        "engine::functions::list",
        json!({"search": "FORECAST city"}),
    )
    .await;
    assert_eq!(ids(&searched), ["weather::forecast"]);
    let none = ask(
        &bus,
        "engine::functions::list",
        json!({"search": "forecast tide"}),
    )
    .await;
    assert!(ids(&none).is_empty(), "{none}");

    let by_worker = ask(&bus, "engine::functions::list", json!({"worker": "tools"})).await;
    assert_eq!(ids(&by_worker), ["fs::read"]);
}

#[tokio::test]
async fn workers_and_trigger_types_are_described() {
    let dir = tempfile::tempdir().unwrap();
    let bus = open(dir.path());
    let workers = ask(&bus, "engine::workers::list", json!({})).await;
    let weather = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == "weather")
        .unwrap_or_else(|| panic!("the weather worker in {workers}"));
    assert_eq!(weather["function_count"], 2);

    let info = ask(&bus, "engine::workers::info", json!({"name": "weather"})).await;
    assert_eq!(ids(&info), ["weather::alerts", "weather::forecast"]);
    assert_eq!(info["trigger_types"][0]["id"], "weather::changed", "{info}");
    let missing = bus
        .call("engine::workers::info", json!({"name": "tides"}), None)
        .await
        .unwrap_err();
    assert!(missing.to_string().contains("tides"), "{missing}");

    let triggers = ask(&bus, "engine::triggers::list", json!({})).await;
    let listed = strings(&triggers["triggers"], "id");
    assert!(listed.contains(&"weather::changed"), "{triggers}");
    assert!(listed.contains(&"cron"), "{triggers}");
    let one = ask(
        &bus,
        "engine::triggers::info",
        json!({"id": "weather::changed"}),
    )
    .await;
    assert_eq!(
        one["trigger_request_format"]["properties"]["city"]["type"],
        "string"
    );
    assert!(bus
        .call("engine::triggers::info", json!({"id": "nope"}), None)
        .await
        .is_err());
}

#[tokio::test]
async fn registered_triggers_are_listed_in_the_engines_shape() {
    let dir = tempfile::tempdir().unwrap();
    let bus = open(dir.path());
    let bound = ask(
        &bus,
        "engine::register_trigger",
        json!({"trigger_type": "weather::changed", "function_id": "weather::alerts",
                   "config": {"city": "Oslo"}}),
    )
    .await;
    let listed = ask(
        &bus,
        "engine::registered-triggers::list",
        json!({"function_id": "weather::alerts"}),
    )
    .await;
    let rows = listed["registered_triggers"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{listed}");
    assert_eq!(rows[0]["id"], bound["id"]);
    assert_eq!(rows[0]["config"]["city"], "Oslo");
    let other = ask(
        &bus,
        "engine::registered-triggers::list",
        json!({"function_id": "weather::forecast"}),
    )
    .await;
    assert!(other["registered_triggers"].as_array().unwrap().is_empty());
    let removed = ask(
        &bus,
        "engine::unregister_trigger",
        json!({"id": bound["id"]}),
    )
    .await;
    assert_eq!(removed["removed"], true);
}
