//! The `harness::*` surface a `harness worker --with all` registers on an engine (what the engine
//! double received: `registerfunction` request/response formats, `registertriggertype` config
//! formats) is a compatible superset of the v1.0.6 API reference, field by field.
//!
//! Compatible: every function and trigger of the reference exists; every property of a
//! reference schema exists in ours with a compatible type (resolving `$ref`/`definitions`,
//! `allOf` wrappers, `oneOf`/`anyOf` variants, array items, nested objects); a request of ours
//! requires nothing the reference leaves optional; a response of ours guarantees every field the
//! reference requires. Extra optional fields are fine. Deliberate differences are in `ALLOWED`.
#![cfg(feature = "iii")]

mod iii_engine;
mod schema_compat;

use std::time::Duration;

use iii_engine::worker::WorkerProc;
use iii_engine::Engine;
use schema_compat::{Dir, REFERENCE};
use serde_json::{json, Value};

/// Deliberate differences: `(problem prefix, why)`.
const ALLOWED: &[(&str, &str)] = &[];

/// Reference functions not (yet) registered by the loop. The test fails when one of them is
/// registered (remove it here then), and lists them in its output.
const NOT_YET: &[&str] = &[];

/// The shared comparison, minus the deliberate differences.
fn compare(name: &str, dir: Dir, r: &Value, o: &Value) -> Vec<String> {
    schema_compat::compare(name, dir, r, o)
        .into_iter()
        .filter(|p| !ALLOWED.iter().any(|(prefix, _)| p.starts_with(prefix)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registered_surface_is_a_compatible_superset_of_v1_0_6() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(REFERENCE).expect("read the v1.0.6 API reference"),
    )
    .expect("the reference is JSON");
    let engine = Engine::start_double().await;
    let _worker = WorkerProc::start(&engine, &json!({"generations": []}), &[]).await;
    // Registration is fire-and-forget: wait for every function the reference names (those not
    // expected yet excepted) before taking the snapshot.
    for f in reference["functions"].as_array().unwrap() {
        let name = f["name"].as_str().unwrap();
        if !NOT_YET.contains(&name) {
            engine.wait_function(name, Duration::from_secs(60)).await;
        }
    }
    let functions = engine.functions();
    let trigger_types = engine.trigger_types();

    let mut problems = Vec::new();
    let mut compared = 0;
    let mut not_yet = Vec::new();
    for f in reference["functions"].as_array().unwrap() {
        let name = f["name"].as_str().unwrap();
        let Some(ours) = functions.get(name) else {
            if NOT_YET.contains(&name) {
                not_yet.push(name.to_string());
            } else {
                problems.push(format!("{name}: not registered on the engine"));
            }
            continue;
        };
        assert!(
            !NOT_YET.contains(&name),
            "{name} is registered now: remove it from NOT_YET"
        );
        compared += 1;
        problems.extend(compare(
            &format!("{name} request"),
            Dir::Request,
            &f["request_schema"],
            &ours["request_format"],
        ));
        problems.extend(compare(
            &format!("{name} response"),
            Dir::Response,
            &f["response_schema"],
            &ours["response_format"],
        ));
    }
    for t in reference["triggers"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let Some(ours) = trigger_types.get(name) else {
            problems.push(format!("{name}: trigger type not registered on the engine"));
            continue;
        };
        compared += 1;
        problems.extend(compare(
            &format!("{name} config"),
            Dir::Request,
            &t["invocation_schema"],
            &ours["trigger_request_format"],
        ));
    }
    eprintln!(
        "compared {compared} functions and triggers; not yet registered by the loop: {not_yet:?}"
    );
    assert!(
        problems.is_empty(),
        "{} incompatibilities:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_comparison_catches_removed_renamed_and_narrowed_fields() {
    let r = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": ["integer", "null"]}}, "required": ["a"]});
    let same = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": ["number", "null"]}, "c": {"type": "string"}}, "required": ["a"]});
    assert!(compare("x", Dir::Request, &r, &same).is_empty());
    let renamed = json!({"type": "object", "properties": {"a": {"type": "string"}, "bb": {"type": ["integer", "null"]}}, "required": ["a"]});
    assert_eq!(compare("x", Dir::Request, &r, &renamed).len(), 1);
    let narrowed = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]});
    assert_eq!(
        compare("x", Dir::Request, &r, &narrowed).len(),
        2,
        "{:?}",
        compare("x", Dir::Request, &r, &narrowed)
    );
    let via_ref = json!({"definitions": {"A": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/definitions/A"}, "b": {"allOf": [{"$ref": "#/definitions/A"}]}}, "required": ["a"]});
    assert_eq!(
        compare("x", Dir::Request, &r, &via_ref),
        vec![
            "x.b: type {\"integer\", \"null\"} in the reference, {\"string\"} in ours".to_string()
        ]
    );
    let resp_r =
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]});
    let resp_o = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}});
    assert_eq!(compare("y", Dir::Response, &resp_r, &resp_o).len(), 1);
}
