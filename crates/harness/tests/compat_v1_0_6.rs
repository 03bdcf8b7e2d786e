//! A client written against the v1.0.6 API reference works unchanged against `harness serve`:
//! the reference JSON is walked next to what the server itself publishes (`GET /v1/functions`
//! for the functions, `engine::triggers::list` for the trigger types), and every difference is
//! named. For each function and trigger type:
//!
//! - it exists;
//! - field by field (`schema_compat::compare`): every request property of the reference exists
//!   with a type we accept and is not required by us unless the reference requires it; every
//!   response property the reference requires is guaranteed by ours with a type its client reads;
//! - requests a client of the reference could send (`schema_compat::instances`: every property
//!   filled, each enum value and union variant used once) validate against our request schema.
//!
//! The test prints the count of differences (0 when it passes) and fails naming the first.

mod common;
mod schema_compat;

use std::collections::BTreeMap;

use common::*;
use schema_compat::{compare, instances, reference, refusal, Dir};
use serde_json::{json, Value};

/// Free strings of the reference whose values it documents in prose (`(property, values)`):
/// a client sends one of those, and ours takes them as an enum, refusing anything else by name.
const DOCUMENTED: &[(&str, &[&str])] = &[
    // "`deliver` (default) supplies the result; `execute` releases a hook-held call ..."
    ("action", &["deliver", "execute"]),
    // "Failure policy (default fail_closed for pre_*, fail_open for post_*)."
    ("on_error", &["fail_closed", "fail_open"]),
];

async fn published(server: &Server) -> (BTreeMap<String, Value>, BTreeMap<String, Value>) {
    let listed: Value = server
        .api()
        .client
        .get(format!("{}/v1/functions", server.url()))
        .send()
        .await
        .expect("GET /v1/functions")
        .json()
        .await
        .expect("GET /v1/functions answers JSON");
    let functions = listed["functions"]
        .as_array()
        .expect("functions[]")
        .iter()
        .map(|f| (f["function_id"].as_str().unwrap().to_string(), f.clone()))
        .collect();
    let triggers = server
        .ok("engine::triggers::list", json!({}))
        .await
        .get("triggers")
        .and_then(Value::as_array)
        .expect("engine::triggers::list answers triggers[] as an engine does")
        .iter()
        .map(|t| (t["id"].as_str().unwrap().to_string(), t.clone()))
        .collect();
    (functions, triggers)
}

fn differences(
    reference: &Value,
    functions: &BTreeMap<String, Value>,
    triggers: &BTreeMap<String, Value>,
) -> (Vec<String>, usize) {
    let mut problems = Vec::new();
    let mut requests = 0;
    let mut accepts = |what: &str, theirs: &Value, ours: &Value, problems: &mut Vec<String>| {
        for (i, example) in instances(theirs, DOCUMENTED).into_iter().enumerate() {
            requests += 1;
            if let Some(why) = refusal(ours, &example) {
                problems.push(format!(
                    "{what}: a reference request (instance {i}: {example}) is refused: {why}"
                ));
            }
        }
    };
    for f in reference["functions"].as_array().unwrap() {
        let name = f["name"].as_str().unwrap();
        let Some(ours) = functions.get(name) else {
            problems.push(format!("{name}: not in GET /v1/functions"));
            continue;
        };
        problems.extend(compare(
            &format!("{name} request"),
            Dir::Request,
            &f["request_schema"],
            &ours["request_schema"],
        ));
        problems.extend(compare(
            &format!("{name} response"),
            Dir::Response,
            &f["response_schema"],
            &ours["response_schema"],
        ));
        accepts(
            &format!("{name} request"),
            &f["request_schema"],
            &ours["request_schema"],
            &mut problems,
        );
    }
    for t in reference["triggers"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let Some(ours) = triggers.get(name) else {
            problems.push(format!(
                "{name}: trigger type not in engine::triggers::list"
            ));
            continue;
        };
        let config = &ours["trigger_request_format"];
        problems.extend(compare(
            &format!("{name} config"),
            Dir::Request,
            &t["invocation_schema"],
            config,
        ));
        accepts(
            &format!("{name} config"),
            &t["invocation_schema"],
            config,
            &mut problems,
        );
    }
    (problems, requests)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_surface_is_a_compatible_superset_of_v1_0_6() {
    let reference = reference();
    let server = Server::start(&script(vec![]), &[]).await;
    let (functions, triggers) = published(&server).await;
    let (problems, requests) = differences(&reference, &functions, &triggers);
    eprintln!(
        "v1.0.6 compatibility: {} functions, {} trigger types, {requests} reference requests; \
         {} differences",
        reference["functions"].as_array().unwrap().len(),
        reference["triggers"].as_array().unwrap().len(),
        problems.len()
    );
    for p in &problems {
        eprintln!("  {p}");
    }
    assert!(
        problems.is_empty(),
        "first difference: {}\n({} in all, listed above)",
        problems[0],
        problems.len()
    );
}

/// The walk itself: a function the server lost, a renamed field, a narrowed enum and a
/// response field made optional are each reported.
#[test]
fn the_walk_names_a_missing_function_a_renamed_field_and_a_narrowed_enum() {
    let reference = json!({
        "functions": [
            {"name": "a::b",
             "request_schema": {"type": "object", "properties": {
                 "x": {"type": "string"}, "m": {"enum": ["plan", "ask", "agent"], "type": "string"}}},
             "response_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
            {"name": "a::gone", "request_schema": {}, "response_schema": {}}
        ],
        "triggers": [{"name": "t::x", "invocation_schema": {"type": "object", "properties": {"p": {"type": "integer"}}}}]
    });
    let ours = |req: Value, resp: Value| -> BTreeMap<String, Value> {
        [(
            "a::b".to_string(),
            json!({"request_schema": req, "response_schema": resp}),
        )]
        .into()
    };
    let triggers: BTreeMap<String, Value> = [(
        "t::x".to_string(),
        json!({"trigger_request_format": {"type": "object", "properties": {"p": {"type": "integer"}}, "additionalProperties": false}}),
    )]
    .into();
    let good_req = json!({"type": "object", "properties": {
        "x": {"type": "string"}, "m": {"enum": ["plan", "ask", "agent"], "type": "string"}}});
    let good_resp =
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]});
    let (p, requests) = differences(
        &reference,
        &ours(good_req.clone(), good_resp.clone()),
        &triggers,
    );
    assert_eq!(p, vec!["a::gone: not in GET /v1/functions".to_string()]);
    assert!(requests >= 3, "one instance per enum value: {requests}");

    let renamed = json!({"type": "object", "properties": {
        "y": {"type": "string"}, "m": {"enum": ["plan", "ask", "agent"], "type": "string"}},
        "additionalProperties": false});
    let (p, _) = differences(&reference, &ours(renamed, good_resp.clone()), &triggers);
    assert!(
        p.iter().any(|p| p == "a::b request.x: missing in ours"),
        "{p:?}"
    );
    assert!(
        p.iter()
            .any(|p| p.contains("a::b request: a reference request") && p.contains("\"x\"")),
        "the instance with x is refused by additionalProperties: {p:?}"
    );

    let narrowed = json!({"type": "object", "properties": {
        "x": {"type": "string"}, "m": {"enum": ["agent"], "type": "string"}}});
    let (p, _) = differences(&reference, &ours(narrowed, good_resp), &triggers);
    assert!(
        p.iter()
            .any(|p| p.starts_with("a::b request.m: enum values")),
        "{p:?}"
    );
    assert_eq!(
        p.iter()
            .filter(|p| p.contains("a reference request"))
            .count(),
        2,
        "plan and ask refused: {p:?}"
    );

    let loose = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}});
    let (p, _) = differences(&reference, &ours(good_req, loose), &triggers);
    assert!(
        p.iter().any(
            |p| p == "a::b response.ok: required in the reference's response, optional in ours"
        ),
        "{p:?}"
    );
}
