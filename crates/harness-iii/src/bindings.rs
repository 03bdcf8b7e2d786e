//! Bindings: the trigger types this worker owns, the bindings of them the engine forwards
//! here, and the bindings of other trigger types as the engine lists them.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use harness_bus::{Binding, BusError, TriggerTypeDef};
use iii_sdk::trigger::{TriggerConfig, TriggerHandler};
use iii_sdk::RegisterTriggerType;
use serde_json::{json, Value};

use crate::bus::{IiiBus, Inner};
use crate::calls::Engine;
use crate::codec::strip_decoration;

/// The trigger types this worker owns and their bindings, under one lock (`Inner::bindings`).
#[derive(Default)]
pub(crate) struct Bindings {
    trigger_types: HashMap<String, TriggerTypeDef>,
    /// Bindings of harness-owned trigger types, as forwarded by the engine.
    bindings: HashMap<String, Binding>,
}

impl Inner {
    fn bound(&self) -> std::sync::RwLockReadGuard<'_, Bindings> {
        self.bindings.read().expect("bindings lock")
    }

    fn bound_mut(&self) -> std::sync::RwLockWriteGuard<'_, Bindings> {
        self.bindings.write().expect("bindings lock")
    }
}

thread_local! {
    static CONFIG_SCHEMA: RefCell<Value> = const { RefCell::new(Value::Bool(true)) };
}

/// A schema type whose schema is whatever [`CONFIG_SCHEMA`] holds when the SDK asks: the SDK
/// takes a trigger type's config schema only from a type, ours are values.
struct DynSchema;

impl serde::Serialize for DynSchema {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_unit()
    }
}

impl schemars::JsonSchema for DynSchema {
    fn schema_name() -> String {
        "TriggerConfig".into()
    }
    fn is_referenceable() -> bool {
        false
    }
    fn json_schema(_gen: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        CONFIG_SCHEMA.with(|s| {
            let mut v = s.borrow().clone();
            if let Value::Object(m) = &mut v {
                m.remove("$schema");
            }
            serde_json::from_value(v).unwrap_or(schemars::schema::Schema::Bool(true))
        })
    }
}

/// Receives the engine's forwarding of bindings of one harness-owned trigger type.
struct BindingSink {
    inner: Weak<Inner>,
    trigger_type: String,
}

#[async_trait]
impl TriggerHandler for BindingSink {
    async fn register_trigger(&self, config: TriggerConfig) -> Result<(), iii_sdk::Error> {
        let Some(inner) = self.inner.upgrade() else {
            return Ok(());
        };
        let validate = inner
            .bound()
            .trigger_types
            .get(&self.trigger_type)
            .and_then(|t| t.validate.clone());
        let cfg = if config.config.is_null() {
            json!({})
        } else {
            config.config
        };
        if let Some(validate) = validate {
            validate(&cfg).map_err(|why| iii_sdk::Error::Remote {
                code: "harness/invalid_request".into(),
                message: format!("config: {why}"),
                stacktrace: None,
            })?;
        }
        let binding = Binding {
            id: config.id.clone(),
            trigger_type: self.trigger_type.clone(),
            function_id: config.function_id,
            config: cfg,
            metadata: strip_decoration(config.metadata.unwrap_or_else(|| json!({}))),
        };
        tracing::debug!(binding = %binding.id, trigger_type = %binding.trigger_type, function = %binding.function_id, "binding forwarded by the engine");
        inner.bound_mut().bindings.insert(config.id, binding);
        Ok(())
    }

    async fn unregister_trigger(&self, config: TriggerConfig) -> Result<(), iii_sdk::Error> {
        if let Some(inner) = self.inner.upgrade() {
            inner.bound_mut().bindings.remove(&config.id);
        }
        Ok(())
    }
}

impl IiiBus {
    /// Makes the bindings this worker acts on exactly the ones the engine still has.
    pub(crate) async fn reconcile_bindings(&self) -> Result<(), BusError> {
        let owned: Vec<String> = self.inner.bound().trigger_types.keys().cloned().collect();
        for trigger_type in owned {
            let listed = self.engine(Engine::BindingsOf(&trigger_type)).await?;
            let present: HashSet<String> = listed["registered_triggers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["trigger_type"] == json!(trigger_type))
                .filter_map(|t| t["id"].as_str().map(str::to_string))
                .collect();
            let mut bound = self.inner.bound_mut();
            let bindings = &mut bound.bindings;
            let before = bindings.len();
            bindings.retain(|id, b| b.trigger_type != trigger_type || present.contains(id));
            let forgotten = before - bindings.len();
            if forgotten > 0 {
                tracing::warn!(%trigger_type, forgotten, "the iii engine no longer has some bindings; forgotten here too");
            }
        }
        Ok(())
    }

    /// `Bus::register_trigger_type`.
    pub(crate) fn add_trigger_type(&self, def: TriggerTypeDef) {
        let id = def.id.clone();
        let fresh = self
            .inner
            .bound_mut()
            .trigger_types
            .insert(id.clone(), def.clone())
            .is_none();
        if !fresh {
            return;
        }
        let sink = BindingSink {
            inner: Arc::downgrade(&self.inner),
            trigger_type: id.clone(),
        };
        CONFIG_SCHEMA.with(|s| *s.borrow_mut() = def.config_schema.clone());
        #[allow(deprecated)]
        self.inner.client.register_trigger_type_without_warning(
            RegisterTriggerType::new(id, def.description.clone(), sink)
                .trigger_request_format::<DynSchema>(),
        );
    }

    /// `Bus::bindings`.
    pub(crate) async fn list_bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError> {
        let owned = self.inner.bound().trigger_types.contains_key(trigger_type);
        let mut out: Vec<Binding> = if owned {
            let bound = self.inner.bound();
            let bindings = &bound.bindings;
            bindings
                .values()
                .filter(|b| b.trigger_type == trigger_type)
                .cloned()
                .collect()
        } else {
            let listed = self.engine(Engine::BindingsOf(trigger_type)).await?;
            listed["registered_triggers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["trigger_type"] == json!(trigger_type))
                .map(|t| Binding {
                    id: t["id"].as_str().unwrap_or_default().to_string(),
                    trigger_type: trigger_type.to_string(),
                    function_id: t["function_id"].as_str().unwrap_or_default().to_string(),
                    config: t.get("config").cloned().unwrap_or_else(|| json!({})),
                    metadata: t.get("metadata").cloned().unwrap_or_else(|| json!({})),
                })
                .collect()
        };
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }
}
