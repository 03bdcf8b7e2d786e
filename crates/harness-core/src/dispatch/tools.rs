//! What the model is offered: the tool surface of a step, and discovery results filtered to
//! what the session may call.

use std::collections::HashSet;

use harness_bus::listed_function_ids;
use harness_types::api::ExposeMode;
use harness_types::router::ToolSpec;
use serde_json::{json, Value};

use super::policy::Policy;
use crate::harness::{Harness, Result};
use crate::record::TurnRecord;

pub(crate) const AGENT_TRIGGER: &str = "agent_trigger";

/// The single tool of `agent_trigger` exposure.
pub(crate) fn agent_trigger_tool() -> ToolSpec {
    ToolSpec {
        name: AGENT_TRIGGER.into(),
        description: "Call a registered function by id. Discover functions with engine::functions::list and read one's \
                      request schema with engine::functions::info before the first call."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "function": {"type": "string", "description": "The function id, e.g. `weather::forecast`."},
                "description": {"type": "string", "minLength": 1, "maxLength": 120,
                                "description": "A short label of this action, shown to the user."},
                "payload": {"type": "object", "description": "The function's arguments: a JSON object, never a string."}
            },
            "required": ["function", "description"]
        }),
    }
}

impl Harness {
    /// The tools of one generation: none when the policy allows nothing; the `agent_trigger`
    /// tool; or (native) one tool per allowed registered function, sorted by id.
    pub(crate) async fn tool_surface(&self, rec: &TurnRecord) -> Result<Vec<ToolSpec>> {
        let policy = Policy::new(rec.options.functions.as_ref());
        if !policy.any() {
            return Ok(vec![]);
        }
        let expose = rec.options.expose();
        if expose == ExposeMode::AgentTrigger {
            return Ok(vec![agent_trigger_tool()]);
        }
        let list: Value = self.call("engine::functions::list", &json!({})).await?;
        let mut ids: Vec<String> = listed_function_ids(&list)
            .filter(|id| policy.allows(id))
            .map(str::to_string)
            .collect();
        ids.sort();
        ids.dedup();
        if ids.is_empty() {
            return Ok(vec![]);
        }
        let info: Value = self
            .call("engine::functions::info", &json!({"function_ids": ids}))
            .await?;
        let tools = info["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f.get("error").is_none())
            // A function that takes a model is never offered (see `wall.rs`).
            .filter(|f| {
                !super::wall::takes_a_model(
                    f["function_id"].as_str().unwrap_or_default(),
                    f.get("request_schema"),
                )
            })
            .filter_map(|f| {
                Some(ToolSpec {
                    name: f["function_id"].as_str()?.to_string(),
                    description: f["description"].as_str().unwrap_or_default().to_string(),
                    parameters: f
                        .get("request_schema")
                        .filter(|s| s.is_object())
                        .cloned()
                        .unwrap_or_else(|| json!({"type": "object"})),
                })
            })
            .collect();
        Ok(tools)
    }
}

impl Harness {
    /// [`filter_discovery`], with what a list names but does not describe: the ids whose
    /// request schema takes a model are looked up so they are dropped too.
    pub(crate) async fn filter_discovery(
        &self,
        function_id: &str,
        policy: &Policy,
        value: Value,
    ) -> Value {
        let mut generating = HashSet::new();
        if matches!(
            function_id,
            "engine::functions::list" | "engine::workers::info"
        ) {
            let ids: Vec<&str> = listed_function_ids(&value)
                .filter(|id| policy.allows(id))
                .collect();
            if !ids.is_empty() {
                let info: Value = self
                    .call("engine::functions::info", &json!({"function_ids": ids}))
                    .await
                    .unwrap_or(Value::Null);
                generating = info["functions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|f| {
                        let id = f["function_id"].as_str()?;
                        super::wall::takes_a_model(id, f.get("request_schema"))
                            .then(|| id.to_string())
                    })
                    .collect();
            }
        }
        filter_discovery(function_id, policy, &generating, value)
    }
}

/// Discovery answers show only what this session may call: `engine::functions::list` and
/// `engine::workers::info` drop the rest; `engine::functions::info` answers null for one id
/// and masks entries of a batch. Beyond
/// the policy, a function that takes a model is not callable (`generating` names those of a
/// list, whose entries carry no schema).
pub(crate) fn filter_discovery(
    function_id: &str,
    policy: &Policy,
    generating: &HashSet<String>,
    value: Value,
) -> Value {
    let callable = |f: &Value| {
        f["function_id"].as_str().is_some_and(|id| {
            policy.allows(id)
                && !generating.contains(id)
                && !super::wall::takes_a_model(id, f.get("request_schema"))
        })
    };
    match function_id {
        // A worker's own listing names its functions like the list does.
        "engine::functions::list" | "engine::workers::info" => {
            let mut value = value;
            if let Some(list) = value.get_mut("functions").and_then(Value::as_array_mut) {
                list.retain(callable);
            }
            value
        }
        "engine::functions::info" => {
            if let Some(list) = value.get("functions").and_then(Value::as_array) {
                let masked: Vec<Value> = list
                    .iter()
                    .map(|f| {
                        if callable(f) {
                            f.clone()
                        } else {
                            json!({"function_id": f["function_id"], "error": "not available"})
                        }
                    })
                    .collect();
                return json!({ "functions": masked });
            }
            if callable(&value) {
                value
            } else {
                Value::Null
            }
        }
        _ => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_types::api::FunctionPolicy;

    #[test]
    fn discovery_is_filtered_to_callable_ids() {
        let p = Policy::new(Some(&FunctionPolicy {
            allow: vec!["weather::*".into()],
            ..Default::default()
        }));
        let list =
            json!({"functions": [{"function_id": "weather::now"}, {"function_id": "shell::exec"}]});
        let none = HashSet::new();
        assert_eq!(
            filter_discovery("engine::functions::list", &p, &none, list),
            json!({"functions": [{"function_id": "weather::now"}]})
        );
        let one = json!({"function_id": "shell::exec", "request_schema": {}});
        assert_eq!(
            filter_discovery("engine::functions::info", &p, &none, one),
            Value::Null
        );
        let batch = json!({"functions": [{"function_id": "weather::now", "description": "d"}, {"function_id": "shell::exec"}]});
        assert_eq!(
            filter_discovery("engine::functions::info", &p, &none, batch),
            json!({"functions": [{"function_id": "weather::now", "description": "d"}, {"function_id": "shell::exec", "error": "not available"}]})
        );
        // A worker's listing names only what the session may call.
        let worker = json!({"name": "w", "functions": [{"function_id": "weather::now"}, {"function_id": "shell::exec"}]});
        assert_eq!(
            filter_discovery("engine::workers::info", &p, &none, worker),
            json!({"name": "w", "functions": [{"function_id": "weather::now"}]})
        );
    }

    #[test]
    fn a_function_that_takes_a_model_is_never_listed_or_described() {
        let p = Policy::new(Some(&FunctionPolicy {
            allow: vec!["*".into()],
            ..Default::default()
        }));
        let takes = json!({"type": "object", "properties": {"model": {}, "messages": {}}});
        let generating: HashSet<String> = ["weather::ai".to_string()].into();
        let list =
            json!({"functions": [{"function_id": "weather::now"}, {"function_id": "weather::ai"}]});
        assert_eq!(
            filter_discovery("engine::functions::list", &p, &generating, list),
            json!({"functions": [{"function_id": "weather::now"}]})
        );
        let one = json!({"function_id": "weather::ai", "request_schema": takes});
        assert_eq!(
            filter_discovery("engine::functions::info", &p, &HashSet::new(), one),
            Value::Null
        );
        let catalog = json!({"function_id": "router::models::get", "request_schema": {"properties": {"model": {}}}});
        assert_eq!(
            filter_discovery(
                "engine::functions::info",
                &p,
                &HashSet::new(),
                catalog.clone()
            ),
            catalog,
            "the catalog readers stay"
        );
    }
}
