//! Output contracts: a turn whose options ask for `{type: "json", schema?}` ends only on a value
//! that parses and validates.
//!
//! The contract reaches the model one of two ways, chosen once per turn: provider-native
//! structured output where the catalog says the model supports it (the request carries
//! `response_format: {type: "json", schema?}`, each provider adapter maps it to its API's form,
//! and the answer's text is the value), or the synthetic `submit_result` tool (its parameters are
//! the schema; the loop answers the call itself, it is never dispatched to the bus). A value that
//! does not validate gets a nudge naming the violations and another generation, up to
//! `max_validation_retries`; then the turn fails with `harness.output_contract_invalid`, the raw
//! value kept as its result.

use harness_types::api::OutputContract;
use harness_types::router::ToolSpec;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::texts;

/// The synthetic tool of the fallback mode.
pub const SUBMIT_RESULT: &str = "submit_result";

/// Nudges after which an invalid result fails the turn, unless the send says otherwise.
pub const DEFAULT_MAX_VALIDATION_RETRIES: u32 = 2;

/// How the contract reaches the model, chosen at the turn's first generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputMode {
    /// The provider constrains the answer; its text is the value.
    Native,
    /// The model calls `submit_result` with the value as its arguments.
    SubmitResult,
}

/// A `submit_result` call of a step, as the loop answered it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Submitted {
    pub step: u64,
    /// The arguments, as submitted.
    pub value: Value,
    /// Why they were not accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The schema of a JSON contract (`Some(None)`: any JSON value); `None` for text.
pub fn json_contract(contract: &OutputContract) -> Option<Option<&Value>> {
    match contract {
        OutputContract::Text => None,
        OutputContract::Json { schema } => Some(schema.as_ref()),
    }
}

pub fn submit_result_tool(schema: Option<&Value>) -> ToolSpec {
    ToolSpec {
        name: SUBMIT_RESULT.into(),
        description: texts::SUBMIT_RESULT_DESCRIPTION.into(),
        parameters: schema.cloned().unwrap_or_else(|| json!({"type": "object"})),
    }
}

pub fn response_format(schema: Option<&Value>) -> Value {
    let mut v = json!({"type": "json"});
    if let Some(s) = schema {
        v["schema"] = s.clone();
    }
    v
}

/// Checks a value against the contract's schema: the first ten violations, or an invalid schema.
pub fn validate(schema: Option<&Value>, value: &Value) -> Result<(), String> {
    let Some(schema) = schema else {
        return Ok(());
    };
    let validator = jsonschema::validator_for(schema)
        .map_err(|e| texts::contract_schema_invalid(&e.to_string()))?;
    let errors: Vec<String> = validator
        .iter_errors(value)
        .take(10)
        .map(|e| {
            let at = e.instance_path().as_str().to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("{at}: {e}")
            }
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(texts::result_schema_failed(&errors.join("; ")))
    }
}

/// The value of a native-mode answer: its trimmed text as JSON (a fenced block is unwrapped).
pub fn parse_text(text: &str) -> Result<Value, String> {
    let t = text.trim();
    let t = t
        .strip_prefix("```json")
        .or_else(|| t.strip_prefix("```"))
        .and_then(|r| r.strip_suffix("```"))
        .map(str::trim)
        .unwrap_or(t);
    serde_json::from_str(t).map_err(|e| texts::result_not_json(&e.to_string()))
}

/// The step's result under the contract: the submitted value (fallback), or the answer's text
/// parsed (native); `Err` carries why it was refused and the raw value, kept if the turn fails.
pub fn verdict(rec: &crate::record::TurnRecord, text: &str) -> Result<Value, (String, Value)> {
    let schema = json_contract(&rec.options.output).flatten();
    if let Some(s) = rec.submitted.as_ref().filter(|s| s.step == rec.step) {
        return match &s.error {
            None => Ok(s.value.clone()),
            Some(e) => Err((e.clone(), s.value.clone())),
        };
    }
    if rec.output_mode != Some(OutputMode::Native) {
        return Err((texts::NO_SUBMIT.to_string(), json!(text)));
    }
    parse_text(text)
        .and_then(|v| validate(schema, &v).map(|()| v))
        .map_err(|e| (e, json!(text)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_parsed_and_validated_with_named_violations() {
        let schema = json!({"type": "object", "required": ["city"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}});
        assert_eq!(
            parse_text(" {\"city\": \"Oslo\"} ").unwrap(),
            json!({"city": "Oslo"})
        );
        assert_eq!(
            parse_text("```json\n{\"city\": \"Oslo\"}\n```").unwrap(),
            json!({"city": "Oslo"})
        );
        assert!(parse_text("Oslo")
            .unwrap_err()
            .starts_with("result is not valid JSON"));
        assert!(validate(Some(&schema), &json!({"city": "Oslo", "days": 2})).is_ok());
        let e = validate(Some(&schema), &json!({"days": "two"})).unwrap_err();
        assert!(e.starts_with("result failed schema validation: "), "{e}");
        assert!(e.contains("city") && e.contains("/days"), "{e}");
        assert!(validate(None, &json!(3)).is_ok());
        assert!(validate(Some(&json!({"type": 5})), &json!(1))
            .unwrap_err()
            .contains("schema is invalid"));
    }
}
