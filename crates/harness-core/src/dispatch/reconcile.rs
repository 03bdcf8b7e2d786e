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

/// What a field at `pointer` (a JSON pointer into the arguments) expects, read from the schema.
fn expected(schema: &Value, pointer: &str) -> String {
    let mut at = schema;
    for seg in pointer.split('/').filter(|s| !s.is_empty()) {
        let next = at
            .get("properties")
            .and_then(|p| p.get(seg))
            .or_else(|| at.get("items").filter(|_| seg.parse::<usize>().is_ok()));
        match next {
            Some(n) => at = n,
            None => return "a value its schema accepts".into(),
        }
    }
    if let Some(options) = at.get("enum").and_then(Value::as_array) {
        let names: Vec<String> = options.iter().map(Value::to_string).collect();
        return format!("one of {}", names.join(", "));
    }
    match at.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" or "),
        _ => "a value its schema accepts".into(),
    }
}

/// Layer C: for arguments still off their schema after repair, one line per field naming what
/// it expects. Never quotes a value the model sent.
pub(crate) fn diagnose(schema: &Value, args: &Value) -> Vec<String> {
    use jsonschema::error::ValidationErrorKind;
    let Ok(validator) = jsonschema::validator_for(schema) else {
        return vec![];
    };
    let mut out: Vec<String> = Vec::new();
    for e in validator.iter_errors(args) {
        let path = e.instance_path().as_str().to_string();
        let shown = |p: &str| {
            if p.is_empty() {
                "/".to_string()
            } else {
                p.to_string()
            }
        };
        let line = match e.kind() {
            ValidationErrorKind::Required { property } => {
                let field = format!("{path}/{}", property.as_str().unwrap_or_default());
                format!("`{field}` is required ({})", expected(schema, &field))
            }
            ValidationErrorKind::AdditionalProperties { unexpected } => format!(
                "{} not accepted at `{}`",
                unexpected
                    .iter()
                    .map(|u| format!("`{u}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                shown(&path)
            ),
            _ => format!("`{}` expects {}", shown(&path), expected(schema, &path)),
        };
        if !out.contains(&line) {
            out.push(line);
        }
    }
    out
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

/// The note appended to the call's result for its repairs: the coercion's (a JSON string
/// parsed) and the judge's (a key renamed, a value replaced by an allowed one, a key dropped),
/// naming fields and never values, so the model learns the shape it should have sent.
pub(crate) fn note(changes: &[Change]) -> Option<String> {
    let parsed: Vec<String> = changes
        .iter()
        .filter(|c| c.kind == "parsed")
        .map(|c| format!("`{}` ({})", c.path, type_name(&c.to)))
        .collect();
    let judged: Vec<String> = changes
        .iter()
        .filter_map(|c| match c.kind.as_str() {
            "renamed" => Some(format!(
                "`{}` was renamed to `{}`",
                c.path,
                c.to.as_str().unwrap_or_default()
            )),
            "replaced" => Some(format!("`{}` was replaced by an allowed value", c.path)),
            "dropped" => Some(format!("`{}` was dropped", c.path)),
            _ => None,
        })
        .collect();
    let mut lines = Vec::new();
    if !parsed.is_empty() {
        lines.push(format!(
            "[harness] {} arrived as a JSON string and was parsed before dispatch.",
            parsed.join(", ")
        ));
    }
    if !judged.is_empty() {
        lines.push(format!(
            "[harness] The arguments did not match the function's schema and were repaired before dispatch: {}. Send them in this shape next time.",
            judged.join("; ")
        ));
    }
    (!lines.is_empty()).then(|| lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_diagnosis_names_fields_and_types_and_never_values() {
        let schema = serde_json::json!({"type": "object", "required": ["path", "mode"],
            "properties": {"path": {"type": "string"}, "count": {"type": "integer"},
                           "mode": {"enum": ["fast", "slow"]}},
            "additionalProperties": false});
        let lines = diagnose(
            &schema,
            &serde_json::json!({"path": 42, "count": "secret-value", "extra": true}),
        );
        assert!(
            lines.contains(&"`/path` expects string".to_string()),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"`/count` expects integer".to_string()),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"`/mode` is required (one of \"fast\", \"slow\")".to_string()),
            "{lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.contains("`extra` not accepted")),
            "{lines:?}"
        );
        assert!(!lines.concat().contains("secret-value"));
        assert!(diagnose(&schema, &serde_json::json!({"path": "a", "mode": "fast"})).is_empty());
    }
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
        let judged = vec![
            Change {
                path: "/colour".into(),
                kind: "renamed".into(),
                from: json!("colour"),
                to: json!("color"),
            },
            Change {
                path: "/mode".into(),
                kind: "replaced".into(),
                from: json!("secret-ish"),
                to: json!("fast"),
            },
            Change {
                path: "/extra".into(),
                kind: "dropped".into(),
                from: json!("value"),
                to: Value::Null,
            },
        ];
        let text = note(&judged).unwrap();
        assert!(
            text.contains("`/colour` was renamed to `color`")
                && text.contains("`/mode` was replaced by an allowed value")
                && text.contains("`/extra` was dropped"),
            "{text}"
        );
        assert!(
            !text.contains("secret-ish") && !text.contains("fast"),
            "no values: {text}"
        );
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

// --- Layer B: the judge -------------------------------------------------------------------

use jsonschema::error::ValidationErrorKind;
use serde_json::json;

/// Answers below this probability are not applied.
pub(crate) const JUDGE_MIN_PROBABILITY: f64 = 0.8;
/// State larger than this is not sent to the judge at all.
const JUDGE_MAX_STATE_BYTES: usize = 48 * 1024;
/// Strings longer than this are cut before the judge sees them.
const JUDGE_MAX_STRING: usize = 512;
/// Keys whose values the judge never sees.
const SECRET_KEYS: &[&str] = &[
    "password",
    "passwd",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "secret",
    "cookie",
    "credential",
    "private_key",
];

/// One thing the judge is asked about.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Issue {
    /// An unknown key while required keys are missing: which one was meant?
    Rename {
        at: String,
        unknown: String,
        missing: Vec<String>,
    },
    /// A value outside the enum: which allowed value was meant?
    Enum {
        path: String,
        value: Value,
        options: Vec<Value>,
    },
    /// Unknown keys and nothing missing: does dropping them keep the intent?
    Drop { at: String, keys: Vec<String> },
}

/// What the judge could settle for these arguments.
pub(crate) fn issues(schema: &Value, args: &Value) -> Vec<Issue> {
    let Ok(validator) = jsonschema::validator_for(schema) else {
        return vec![];
    };
    let mut unknown: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    let mut missing: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    let mut out = Vec::new();
    for e in validator.iter_errors(args) {
        let at = e.instance_path().as_str().to_string();
        match e.kind() {
            ValidationErrorKind::AdditionalProperties { unexpected } => unknown
                .entry(at)
                .or_default()
                .extend(unexpected.iter().cloned()),
            ValidationErrorKind::Required { property } => {
                if let Some(p) = property.as_str() {
                    missing.entry(at).or_default().push(p.to_string());
                }
            }
            ValidationErrorKind::Enum { options } => {
                let options: Vec<Value> = options
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .take(254)
                    .collect();
                out.push(Issue::Enum {
                    path: at,
                    value: e.instance().clone().into_owned(),
                    options,
                });
            }
            _ => {}
        }
    }
    for (at, keys) in unknown {
        match missing.get(&at).filter(|m| !m.is_empty()) {
            Some(m) => out.extend(keys.into_iter().map(|k| Issue::Rename {
                at: at.clone(),
                unknown: k,
                missing: m.clone(),
            })),
            None => out.push(Issue::Drop { at, keys }),
        }
    }
    out
}

/// The arguments as the judge may see them: secret-keyed values masked, long strings cut.
pub(crate) fn redact(value: &Value) -> Value {
    match value {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let lower = k.to_ascii_lowercase();
                    if SECRET_KEYS.iter().any(|s| lower.contains(s)) {
                        (k.clone(), json!("***"))
                    } else {
                        (k.clone(), redact(v))
                    }
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(redact).collect()),
        Value::String(s) if s.chars().count() > JUDGE_MAX_STRING => Value::String(format!(
            "{}…",
            s.chars().take(JUDGE_MAX_STRING).collect::<String>()
        )),
        other => other.clone(),
    }
}

/// The `judge::evaluate` request for these issues, or None when the state is too large.
pub(crate) fn judge_request(
    function_id: &str,
    intent: Option<&str>,
    schema: &Value,
    args: &Value,
    issues: &[Issue],
) -> Option<Value> {
    let mut questions = serde_json::Map::new();
    for (i, issue) in issues.iter().enumerate() {
        let q = match issue {
            Issue::Rename {
                at,
                unknown,
                missing,
            } => {
                let mut choices: Vec<Value> = missing.iter().map(|m| json!(m)).collect();
                choices.push(json!("none"));
                json!({"type": "choice", "instructions": format!("The call passed an unknown argument `{unknown}` at `{at}` while required arguments are missing. Which required argument did the caller mean?"), "criteria": choices})
            }
            Issue::Enum {
                path,
                value,
                options,
            } => {
                let mut choices = options.clone();
                choices.push(json!("none"));
                json!({"type": "choice", "instructions": format!("The value {value} at `{path}` is not one of the allowed values. Which allowed value did the caller mean?"), "criteria": choices})
            }
            Issue::Drop { at, keys } => {
                json!({"type": "noul", "instructions": format!("The call passed unknown arguments {keys:?} at `{at}`. Does dropping them keep the caller's intent?"), "criteria": "yes if the remaining arguments still express the request"})
            }
        };
        questions.insert(format!("q{i}"), q);
    }
    let state = json!({"function_id": function_id, "intent": intent, "schema": schema, "arguments": redact(args)});
    if state.to_string().len() > JUDGE_MAX_STATE_BYTES {
        return None;
    }
    Some(
        json!({"timeout_ms": 2000, "evaluations": [{"id": "reconcile", "state": state, "questions": questions}]}),
    )
}

fn confident(answer: &Value) -> bool {
    answer
        .get("probability")
        .or_else(|| answer.get("confidence"))
        .and_then(Value::as_f64)
        .is_some_and(|p| p >= JUDGE_MIN_PROBABILITY)
}

/// The value at JSON pointer `at` in `v` (`""`: `v` itself).
fn pointed<'a>(v: &'a mut Value, at: &str) -> Option<&'a mut Value> {
    if at.is_empty() {
        Some(v)
    } else {
        v.pointer_mut(at)
    }
}

fn child_path(at: &str, key: &str) -> String {
    format!("{at}/{}", key.replace('~', "~0").replace('/', "~1"))
}

/// Applies the judge's confident answers; the caller keeps the result only if it validates.
pub(crate) fn apply_judgement(
    args: &Value,
    issues: &[Issue],
    response: &Value,
) -> (Value, Vec<Change>) {
    let answers = &response["results"]["reconcile"]["answers"];
    let mut out = args.clone();
    let mut changes = Vec::new();
    for (i, issue) in issues.iter().enumerate() {
        let a = &answers[format!("q{i}")];
        if !confident(a) {
            continue;
        }
        match issue {
            Issue::Rename {
                at,
                unknown,
                missing,
            } => {
                let Some(choice) = a["choice"]
                    .as_str()
                    .filter(|c| missing.iter().any(|m| m == c))
                else {
                    continue;
                };
                let obj = pointed(&mut out, at);
                if let Some(Value::Object(map)) = obj {
                    if let Some(v) = map.remove(unknown) {
                        map.insert(choice.to_string(), v.clone());
                        changes.push(Change {
                            path: child_path(at, unknown),
                            kind: "renamed".into(),
                            from: json!(unknown),
                            to: json!(choice),
                        });
                    }
                }
            }
            Issue::Enum {
                path,
                value,
                options,
            } => {
                let choice = &a["choice"];
                if !options.contains(choice) {
                    continue;
                }
                let slot = pointed(&mut out, path);
                if let Some(slot) = slot {
                    *slot = choice.clone();
                    changes.push(Change {
                        path: path.clone(),
                        kind: "replaced".into(),
                        from: value.clone(),
                        to: choice.clone(),
                    });
                }
            }
            Issue::Drop { at, keys } => {
                if a["noul"].as_str() != Some("yes") && a["answer"].as_str() != Some("yes") {
                    continue;
                }
                let obj = pointed(&mut out, at);
                if let Some(Value::Object(map)) = obj {
                    for k in keys {
                        if let Some(v) = map.remove(k) {
                            changes.push(Change {
                                path: child_path(at, k),
                                kind: "dropped".into(),
                                from: v,
                                to: Value::Null,
                            });
                        }
                    }
                }
            }
        }
    }
    (out, changes)
}

#[cfg(test)]
mod judge_tests {
    use super::*;

    fn schema() -> Value {
        json!({"type": "object", "additionalProperties": false,
               "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}},
               "required": ["city"]})
    }

    #[test]
    fn finds_renames_enums_and_drops() {
        let found = issues(&schema(), &json!({"town": "Oslo", "unit": "kelvin"}));
        assert!(found.contains(&Issue::Rename {
            at: "".into(),
            unknown: "town".into(),
            missing: vec!["city".into()]
        }));
        assert!(found
            .iter()
            .any(|i| matches!(i, Issue::Enum { path, .. } if path == "/unit")));
        let found = issues(&schema(), &json!({"city": "Oslo", "verbose": true}));
        assert_eq!(
            found,
            vec![Issue::Drop {
                at: "".into(),
                keys: vec!["verbose".into()]
            }]
        );
    }

    #[test]
    fn secrets_are_masked_and_long_strings_cut() {
        let r = redact(
            &json!({"api_key": "sk-123", "nested": {"Authorization": "Bearer x"}, "body": "y".repeat(600)}),
        );
        assert_eq!(r["api_key"], "***");
        assert_eq!(r["nested"]["Authorization"], "***");
        assert_eq!(r["body"].as_str().unwrap().chars().count(), 513);
    }

    #[test]
    fn only_confident_valid_answers_apply() {
        let args = json!({"town": "Oslo", "unit": "kelvin"});
        let found = issues(&schema(), &args);
        let req = judge_request(
            "weather::now",
            Some("weather in Oslo"),
            &schema(),
            &args,
            &found,
        )
        .unwrap();
        assert_eq!(req["evaluations"][0]["id"], "reconcile");
        let q_rename = found
            .iter()
            .position(|i| matches!(i, Issue::Rename { .. }))
            .unwrap();
        let q_enum = found
            .iter()
            .position(|i| matches!(i, Issue::Enum { .. }))
            .unwrap();
        let response = json!({"status": "ok", "results": {"reconcile": {"answers": {
            format!("q{q_rename}"): {"type": "choice", "choice": "city", "probability": 0.95},
            format!("q{q_enum}"): {"type": "choice", "choice": "c", "probability": 0.5}
        }}}});
        let (out, changes) = apply_judgement(&args, &found, &response);
        assert_eq!(
            out,
            json!({"city": "Oslo", "unit": "kelvin"}),
            "the unsure enum answer is not applied"
        );
        assert_eq!(changes[0].kind, "renamed");
    }
}
