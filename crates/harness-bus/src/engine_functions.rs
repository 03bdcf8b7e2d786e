//! The engine's own functions on the embedded bus: discovery (`engine::functions::*`), trigger
//! bindings (`engine::register_trigger`, ...) and state (`state::*`), with the same ids and shapes
//! as on an iii engine.

use std::sync::Arc;

use harness_types::parse::parse_payload;
use harness_types::HarnessError;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::bus::{Binding, Bus, CallContext, FunctionDef, Handler};
use crate::embedded::{EmbeddedBus, BINDINGS_SCOPE};
use crate::error::BusError;

fn reg<F, Fut>(bus: &EmbeddedBus, def: FunctionDef, f: F)
where
    F: Fn(EmbeddedBus, Value) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Value, BusError>> + Send + 'static,
{
    let me = bus.clone();
    let handler = move |payload: Value, _ctx: CallContext| f(me.clone(), payload);
    bus.register_function(def, Arc::new(handler) as Arc<dyn Handler>);
}

#[derive(Deserialize)]
struct ListRequest {
    #[serde(default)]
    prefix: Option<String>,
    /// Case-insensitive words, each found in the id or the description.
    #[serde(default)]
    search: Option<String>,
    #[serde(default)]
    worker: Option<String>,
    #[serde(default)]
    include_internal: bool,
}

#[derive(Deserialize)]
struct InfoRequest {
    #[serde(default)]
    function_id: Option<String>,
    #[serde(default)]
    function_ids: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct WorkerInfoRequest {
    name: String,
}

#[derive(Deserialize)]
struct TriggerInfoRequest {
    id: String,
}

#[derive(Deserialize)]
struct RegisterTriggerRequest {
    trigger_type: String,
    function_id: String,
    #[serde(default)]
    config: Value,
    #[serde(default)]
    metadata: Value,
}

#[derive(Deserialize)]
struct IdRequest {
    id: String,
}

#[derive(Deserialize)]
struct TriggersListRequest {
    #[serde(default)]
    trigger_type: Option<String>,
    #[serde(default)]
    function_id: Option<String>,
}

#[derive(Deserialize)]
struct StateKey {
    scope: String,
    key: String,
}

#[derive(Deserialize)]
struct StateSet {
    scope: String,
    key: String,
    value: Value,
}

#[derive(Deserialize)]
struct StateList {
    scope: String,
    #[serde(default)]
    with_keys: bool,
}

/// The function ids an `engine::functions::list` (or `engine::workers::info`) answer names, in
/// its order; an answer of another shape names none.
pub fn listed_function_ids(list: &Value) -> impl Iterator<Item = &str> {
    list["functions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["function_id"].as_str())
}

/// The worker an embedded function belongs to, named as the iii deployment names the worker
/// that registers it, so the discovery loop the identity prompt teaches (list, filter by
/// `worker`, `engine::workers::info`) reads the same in both modes.
pub(crate) fn worker_of(id: &str) -> &str {
    let ns = id.split("::").next().unwrap_or(id);
    match ns {
        "engine" | "state" | "cron" => "engine",
        "session" => "session-manager",
        "context" => "context-manager",
        "router" => "llm-router",
        "fs" | "shell" | "web" => "tools",
        _ => ns,
    }
}

fn info_of(def: &FunctionDef) -> Value {
    json!({
        "function_id": def.function_id,
        "description": def.description,
        "namespace": "default",
        "worker_name": worker_of(&def.function_id),
        "request_schema": def.request_schema,
        "response_schema": def.response_schema,
        "metadata": def.metadata,
    })
}

/// Whether every word of `search` is in the id or the description (case-insensitive).
fn matches_search(search: &str, id: &str, description: &str) -> bool {
    let hay = format!("{id} {description}").to_lowercase();
    search
        .split_whitespace()
        .all(|w| hay.contains(&w.to_lowercase()))
}

fn trigger_info(id: &str, description: &str, schema: &Value) -> Value {
    json!({
        "id": id,
        "description": description,
        "namespace": "default",
        "worker_name": worker_of(id),
        // The config a binding of this type takes: what `registertriggertype` carries on an
        // engine as `trigger_request_format`.
        "trigger_request_format": schema,
    })
}

fn object(properties: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": properties, "required": required})
}

pub(crate) fn register(bus: &EmbeddedBus) {
    reg(
        bus,
        FunctionDef::new(
            "engine::functions::list",
            "List registered functions: filter by id prefix, by words of the id or description \
             (search), by worker name; internal ones only with include_internal.",
        )
        .schemas(
            object(
                json!({
                    "prefix": {"type": ["string", "null"], "description": "Function id prefix, e.g. `fs::`."},
                    "search": {"type": ["string", "null"], "description": "Words that must all appear in the id or description (case-insensitive)."},
                    "worker": {"type": ["string", "null"], "description": "Only the functions of this worker (see engine::workers::list)."},
                    "include_internal": {"type": ["boolean", "null"]}
                }),
                &[],
            ),
            object(json!({"functions": {"type": "array", "items": object(json!({
                "function_id": {"type": "string"}, "description": {"type": "string"},
                "namespace": {"type": "string"}, "worker_name": {"type": "string"}}),
                &["function_id", "description", "worker_name"])}}), &["functions"]),
        ),
        |bus, payload| async move {
            let req: ListRequest = parse_payload(payload)?;
            let functions: Vec<Value> = bus
                .function_summaries()
                .into_iter()
                .filter(|(_, _, internal)| req.include_internal || !internal)
                .filter(|(id, _, _)| req.prefix.as_deref().is_none_or(|p| id.starts_with(p)))
                .filter(|(id, _, _)| req.worker.as_deref().is_none_or(|w| worker_of(id) == w))
                .filter(|(id, d, _)| {
                    req.search
                        .as_deref()
                        .is_none_or(|s| matches_search(s, id, d))
                })
                .map(|(id, description, _)| {
                    json!({"function_id": id, "description": description, "namespace": "default",
                           "worker_name": worker_of(&id)})
                })
                .collect();
            Ok(json!({ "functions": functions }))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::functions::info",
            "Describe one function (function_id) or several (function_ids), schemas included.",
        )
        .schemas(
            object(
                json!({
                    "function_id": {"type": ["string", "null"]},
                    "function_ids": {"type": ["array", "null"], "items": {"type": "string"}}
                }),
                &[],
            ),
            json!({"type": ["object", "null"]}),
        ),
        |bus, payload| async move {
            let req: InfoRequest = parse_payload(payload)?;
            if let Some(ids) = req.function_ids {
                let items: Vec<Value> = ids
                    .iter()
                    .map(|id| match bus.function_def(id) {
                        Some(def) => info_of(&def),
                        None => json!({"function_id": id, "error": "not available"}),
                    })
                    .collect();
                return Ok(json!({ "functions": items }));
            }
            let id = req.function_id.ok_or_else(|| {
                HarnessError::invalid_field("function_id", "required (or function_ids)")
            })?;
            Ok(bus
                .function_def(&id)
                .map(|d| info_of(&d))
                .unwrap_or(Value::Null))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::register_trigger",
            "Bind a trigger type to a function; the binding persists across restarts.",
        ),
        |bus, payload| async move {
            let req: RegisterTriggerRequest = parse_payload(payload)?;
            let validate = {
                let types = bus.inner.trigger_types.read().expect("trigger types lock");
                let t = types.get(&req.trigger_type).ok_or_else(|| {
                    HarnessError::invalid_field(
                        "trigger_type",
                        format!("unknown trigger type '{}'", req.trigger_type),
                    )
                })?;
                t.validate.clone()
            };
            let config = if req.config.is_null() {
                json!({})
            } else {
                req.config
            };
            if let Some(validate) = validate {
                validate(&config).map_err(|why| HarnessError::invalid_field("config", why))?;
            }
            let binding = Binding {
                id: format!("trg_{}", uuid::Uuid::new_v4().simple()),
                trigger_type: req.trigger_type,
                function_id: req.function_id,
                config,
                metadata: if req.metadata.is_null() {
                    json!({})
                } else {
                    req.metadata
                },
            };
            let value =
                serde_json::to_value(&binding).map_err(|e| BusError::internal(e.to_string()))?;
            bus.store()
                .kv_set(BINDINGS_SCOPE, &binding.id, &value)
                .await?;
            bus.inner
                .bindings
                .write()
                .expect("bindings lock")
                .insert(binding.id.clone(), binding.clone());
            bus.binding_added(&binding);
            Ok(json!({ "id": binding.id }))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::unregister_trigger",
            "Remove a trigger binding by id.",
        ),
        |bus, payload| async move {
            let req: IdRequest = parse_payload(payload)?;
            let removed = bus
                .inner
                .bindings
                .write()
                .expect("bindings lock")
                .remove(&req.id)
                .is_some();
            bus.store().kv_delete(BINDINGS_SCOPE, &req.id).await?;
            bus.binding_removed(&req.id);
            Ok(json!({ "removed": removed, "ok": removed }))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::registered-triggers::list",
            "Every trigger binding, optionally of one trigger type.",
        ),
        |bus, payload| async move {
            let req: TriggersListRequest = parse_payload(payload)?;
            let all: Vec<Binding> = {
                let bindings = bus.inner.bindings.read().expect("bindings lock");
                bindings
                    .values()
                    .filter(|b| {
                        req.trigger_type
                            .as_deref()
                            .is_none_or(|t| t == b.trigger_type)
                            && req
                                .function_id
                                .as_deref()
                                .is_none_or(|f| f == b.function_id)
                    })
                    .cloned()
                    .collect()
            };
            let mut all = all;
            all.sort_by(|a, b| a.id.cmp(&b.id));
            // An engine answers `registered_triggers` with a worker and a summary per row;
            // `triggers` stays for the callers written against the earlier embedded answer.
            let rows: Vec<Value> = all
                .iter()
                .map(|b| {
                    json!({"id": b.id, "trigger_type": b.trigger_type, "function_id": b.function_id,
                           "config": b.config, "config_summary": b.config.to_string(),
                           "metadata": b.metadata, "worker_name": worker_of(&b.function_id)})
                })
                .collect();
            Ok(json!({ "registered_triggers": rows, "triggers": all }))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::triggers::list",
            "Trigger types a binding may name, with the config each takes.",
        ),
        |bus, _payload| async move {
            let types: Vec<Value> = bus
                .trigger_type_ids()
                .into_iter()
                .map(|(id, description, schema)| trigger_info(&id, &description, &schema))
                .collect();
            Ok(json!({ "triggers": types }))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::triggers::info",
            "One trigger type (id) with the config schema its bindings take.",
        )
        .schemas(
            object(json!({"id": {"type": "string"}}), &["id"]),
            json!({"type": "object"}),
        ),
        |bus, payload| async move {
            let req: TriggerInfoRequest = parse_payload(payload)?;
            bus.trigger_type_ids()
                .into_iter()
                .find(|(id, _, _)| *id == req.id)
                .map(|(id, description, schema)| trigger_info(&id, &description, &schema))
                .ok_or_else(|| {
                    HarnessError::not_found(format!("id: no trigger type '{}'", req.id)).into()
                })
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::workers::list",
            "The workers whose functions this process serves, with how many each has.",
        ),
        |bus, _payload| async move {
            let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
            for (id, _, _) in bus.function_summaries() {
                *counts.entry(worker_of(&id).to_string()).or_default() += 1;
            }
            let workers: Vec<Value> = counts
                .into_iter()
                .map(|(name, n)| json!({"name": name, "status": "connected", "function_count": n}))
                .collect();
            Ok(json!({ "workers": workers }))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "engine::workers::info",
            "One worker (name): its functions and the trigger types it registered.",
        )
        .schemas(
            object(json!({"name": {"type": "string"}}), &["name"]),
            json!({"type": "object"}),
        ),
        |bus, payload| async move {
            let req: WorkerInfoRequest = parse_payload(payload)?;
            let functions: Vec<Value> = bus
                .function_summaries()
                .into_iter()
                .filter(|(id, _, _)| worker_of(id) == req.name)
                .map(|(id, description, internal)| {
                    json!({"function_id": id, "description": description, "internal": internal})
                })
                .collect();
            let triggers: Vec<Value> = bus
                .trigger_type_ids()
                .into_iter()
                .filter(|(id, _, _)| worker_of(id) == req.name)
                .map(|(id, description, _)| json!({"id": id, "description": description}))
                .collect();
            if functions.is_empty() && triggers.is_empty() {
                return Err(
                    HarnessError::not_found(format!("name: no worker '{}'", req.name)).into(),
                );
            }
            Ok(
                json!({"name": req.name, "status": "connected", "functions": functions,
                      "trigger_types": triggers}),
            )
        },
    );
    reg(
        bus,
        FunctionDef::new("state::get", "Read a state value; null when absent."),
        |bus, payload| async move {
            let req: StateKey = parse_payload(payload)?;
            Ok(bus
                .store()
                .kv_get(&req.scope, &req.key)?
                .unwrap_or(Value::Null))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "state::set",
            "Write a state value; returns the old and new values.",
        ),
        |bus, payload| async move {
            let req: StateSet = parse_payload(payload)?;
            let old = bus.store().kv_set(&req.scope, &req.key, &req.value).await?;
            Ok(json!({"old_value": old, "new_value": req.value}))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "state::delete",
            "Delete a state value; returns the old value.",
        ),
        |bus, payload| async move {
            let req: StateKey = parse_payload(payload)?;
            let old = bus.store().kv_delete(&req.scope, &req.key).await?;
            Ok(json!({ "old_value": old }))
        },
    );
    reg(
        bus,
        FunctionDef::new(
            "state::list",
            "Values of a scope (with_keys: true gives {key, value} pairs).",
        ),
        |bus, payload| async move {
            let req: StateList = parse_payload(payload)?;
            let rows = bus.store().kv_list(&req.scope)?;
            let items: Vec<Value> = rows
                .into_iter()
                .map(|(k, v)| {
                    if req.with_keys {
                        json!({"key": k, "value": v})
                    } else {
                        v
                    }
                })
                .collect();
            Ok(Value::Array(items))
        },
    );
}
