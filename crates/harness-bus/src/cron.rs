//! The `cron` trigger type of the embedded bus: a binding `{expression}` (6 fields, seconds
//! first, as on iii) calls its function at every matching second with `{scheduled_at}`.

use std::str::FromStr;

use chrono::Utc;
use croner::Cron;
use serde_json::{json, Value};

use crate::bus::{Binding, Bus, TriggerTypeDef};
use crate::embedded::EmbeddedBus;

pub(crate) const CRON: &str = "cron";

fn parse(config: &Value) -> Result<Cron, String> {
    let expression = config
        .get("expression")
        .and_then(Value::as_str)
        .ok_or("expression: required (a 6-field cron expression, seconds first)")?;
    Cron::from_str(expression)
        .map_err(|e| format!("expression: '{expression}' is not a cron expression: {e}"))
}

pub(crate) fn trigger_type() -> TriggerTypeDef {
    TriggerTypeDef {
        id: CRON.into(),
        description: "Call the bound function on a schedule: {expression: \"<sec> <min> <hour> <dom> <month> <dow>\"}.".into(),
        config_schema: json!({"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"], "additionalProperties": false}),
        validate: Some(std::sync::Arc::new(|config: &Value| {
            if let Some(extra) = config.as_object().and_then(|o| o.keys().find(|k| *k != "expression")) {
                return Err(format!("unknown field `{extra}`, expected `expression`"));
            }
            parse(config).map(|_| ())
        })),
    }
}

/// Runs the schedule of one binding until aborted.
pub(crate) fn spawn(bus: &EmbeddedBus, binding: &Binding) -> Option<tokio::task::AbortHandle> {
    let cron = parse(&binding.config).ok()?;
    let handle = tokio::runtime::Handle::try_current().ok()?;
    let bus = bus.clone();
    let function_id = binding.function_id.clone();
    let task = handle.spawn(async move {
        loop {
            let now = Utc::now();
            let Ok(next) = cron.find_next_occurrence(&now, false) else {
                return;
            };
            let wait = (next - now).to_std().unwrap_or_default();
            tokio::time::sleep(wait).await;
            bus.call_void(&function_id, json!({"scheduled_at": next.to_rfc3339()}))
                .await;
        }
    });
    Some(task.abort_handle())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn six_field_expressions_validate() {
        let v = trigger_type().validate.unwrap();
        assert!(v(&json!({"expression": "0 * * * * *"})).is_ok());
        assert!(v(&json!({"expression": "*/5 * * * * *"})).is_ok());
        assert!(v(&json!({"expression": "every minute"}))
            .unwrap_err()
            .starts_with("expression:"));
        assert!(v(&json!({})).is_err());
        assert!(v(&json!({"expression": "0 * * * * *", "tz": "x"}))
            .unwrap_err()
            .contains("tz"));
    }
}
