//! Argument reconciliation before dispatch (fail-open: anything unsure dispatches as written).
//!
//! Layer A, `coerce`: for each schema violation whose value is a string holding JSON of another
//! type, the parsed value is substituted — only if that path's violation then disappears — for
//! up to four passes (nested stringification). Lossless by construction.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Passes of the coerce layer (each pass can unwrap one level of nested stringification).
const COERCE_PASSES: usize = 4;

/// One repair, as recorded in the entry origin (`reconciled`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// JSON pointer into the arguments.
    pub path: String,
    /// `parsed` | `renamed` | `replaced` | `dropped`.
    pub kind: String,
    pub from: Value,
    pub to: Value,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Violations as `(instance path, offending value)`; None when the schema itself is unusable.
pub(crate) fn violations(schema: &Value, args: &Value) -> Option<Vec<(String, Value)>> {
    let validator = jsonschema::validator_for(schema).ok()?;
    Some(
        validator
            .iter_errors(args)
            .map(|e| {
                (
                    e.instance_path().as_str().to_string(),
                    e.instance().clone().into_owned(),
                )
            })
            .collect(),
    )
}

/// Layer A. Returns the repaired arguments and what changed (empty when nothing did).
pub(crate) fn coerce(schema: &Value, args: &Value) -> (Value, Vec<Change>) {
    let mut current = args.clone();
    let mut changes = Vec::new();
    for _ in 0..COERCE_PASSES {
        let Some(errors) = violations(schema, &current) else {
            break;
        };
        let mut changed = false;
        for (path, value) in errors {
            let Value::String(text) = &value else {
                continue;
            };
            let Ok(parsed) = serde_json::from_str::<Value>(text) else {
                continue;
            };
            if parsed.is_string() {
                continue;
            }
            let mut candidate = current.clone();
            let slot = if path.is_empty() {
                Some(&mut candidate)
            } else {
                candidate.pointer_mut(&path)
            };
            let Some(slot) = slot else { continue };
            *slot = parsed.clone();
            let gone_at_path =
                violations(schema, &candidate).is_some_and(|v| !v.iter().any(|(p, _)| p == &path));
            if gone_at_path {
                changes.push(Change {
                    path: if path.is_empty() { "/".into() } else { path },
                    kind: "parsed".into(),
                    from: value.clone(),
                    to: parsed,
                });
                current = candidate;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    (current, changes)
}

/// The note appended to the call's result for lossless repairs.
pub(crate) fn note(changes: &[Change]) -> Option<String> {
    let parsed: Vec<String> = changes
        .iter()
        .filter(|c| c.kind == "parsed")
        .map(|c| format!("`{}` ({})", c.path, type_name(&c.to)))
        .collect();
    if parsed.is_empty() {
        return None;
    }
    Some(format!(
        "[harness] {} arrived as a JSON string and was parsed before dispatch.",
        parsed.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "items": {"type": "array", "items": {"type": "integer"}},
            "opts": {"type": "object", "properties": {"deep": {"type": "object"}}},
            "count": {"type": "integer"},
            "name": {"type": "string"}
        }, "required": ["items"]})
    }

    #[test]
    fn stringified_json_the_schema_rejects_is_parsed() {
        let (args, changes) = coerce(
            &schema(),
            &json!({"items": "[1, 2, 3]", "count": "4", "name": "[not parsed]"}),
        );
        assert_eq!(
            args,
            json!({"items": [1, 2, 3], "count": 4, "name": "[not parsed]"})
        );
        let paths: Vec<&str> = changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, vec!["/items", "/count"]);
        assert_eq!(note(&changes).unwrap(), "[harness] `/items` (array), `/count` (number) arrived as a JSON string and was parsed before dispatch.");
    }

    #[test]
    fn nested_stringification_unwraps_over_passes() {
        let inner = json!({"deep": "{\"a\": 1}"}).to_string();
        let (args, changes) = coerce(&schema(), &json!({"items": [], "opts": inner}));
        assert_eq!(args["opts"], json!({"deep": {"a": 1}}));
        assert_eq!(changes.len(), 2);
    }

    #[test]
    fn valid_or_unfixable_arguments_are_left_alone() {
        let valid = json!({"items": [1]});
        assert_eq!(coerce(&schema(), &valid), (valid.clone(), vec![]));
        let unfixable = json!({"items": "not json"});
        assert_eq!(coerce(&schema(), &unfixable).1, vec![]);
        // A string that parses to the wrong type is not substituted.
        let wrong = json!({"items": "{\"a\": 1}", "count": "\"5\""});
        let (out, changes) = coerce(&schema(), &wrong);
        assert_eq!(out, wrong);
        assert!(changes.is_empty());
    }
}
