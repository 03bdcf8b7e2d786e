//! Registration: the functions this worker registers, which of them wait for
//! [`IiiBus::open`], which of them the engine routes here (so their calls run in-process), and
//! what a registry-change notice from the engine says that is news.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use harness_bus::{BusError, FunctionDef, Handler};
use iii_sdk::RegisterFunction;
use serde_json::{json, Value};

use crate::bus::{IiiBus, Inner, FRAMES_PREFIX};
use crate::calls::Engine;
use crate::error::to_sdk;

/// How long a registration the engine does not list waits before it is sent again.
const REANNOUNCE: Duration = Duration::from_secs(1);

pub(crate) struct Local {
    pub(crate) def: FunctionDef,
    pub(crate) handler: Arc<dyn Handler>,
}

/// Everything registration knows, under one lock (`Inner::registry`).
#[derive(Default)]
pub(crate) struct Registry {
    /// The functions registered through this bus.
    local: HashMap<String, Arc<Local>>,
    /// Public functions registered before `open`, announced by it.
    held: Vec<String>,
    /// The functions registered here that the engine lists as this worker's (so it routes
    /// their calls here): refreshed whenever the worker reads the registry for its own
    /// functions, emptied when the link drops. See [`IiiBus::serves`].
    served: HashSet<String>,
    /// The functions of others, as of the last registry-change notice let through (see
    /// `own_registry_change`).
    foreign: Option<BTreeSet<String>>,
}

impl Registry {
    pub(crate) fn serves(&self, function_id: &str) -> bool {
        self.served.contains(function_id)
    }

    /// Forgets which functions the engine routes here (the link dropped: whatever it routes
    /// here after the reconnect is read again).
    pub(crate) fn forget_served(&mut self) {
        self.served.clear();
    }

    pub(crate) fn get(&self, function_id: &str) -> Option<&Arc<Local>> {
        self.local.get(function_id)
    }
}

impl Inner {
    pub(crate) fn registry(&self) -> RwLockReadGuard<'_, Registry> {
        self.registry.read().expect("registry lock")
    }

    pub(crate) fn registry_mut(&self) -> RwLockWriteGuard<'_, Registry> {
        self.registry.write().expect("registry lock")
    }

    /// The function registered here as `function_id`.
    pub(crate) fn local(&self, function_id: &str) -> Option<Arc<Local>> {
        self.registry().get(function_id).cloned()
    }
}

impl IiiBus {
    /// `Bus::register_function`: registers with the engine at once, or, for a public function
    /// before `open`, once the worker can serve it.
    pub(crate) fn add_function(&self, def: FunctionDef, handler: Arc<dyn Handler>) {
        let id = def.function_id.clone();
        {
            let mut registry = self.inner.registry_mut();
            let local = Arc::new(Local {
                def: def.clone(),
                handler,
            });
            if registry.local.insert(id.clone(), local).is_some() {
                // The engine already routes this id here; the new handler is picked up per call.
                return;
            }
            if held(&def) && !self.inner.link.opened.load(Ordering::SeqCst) {
                // Public until the worker can serve it: announced by `open`.
                registry.held.push(id);
                return;
            }
        }
        self.announce(&id, &def);
    }

    /// Announces the public functions held back until `open`.
    pub(crate) fn announce_held(&self) {
        let defs: Vec<(String, FunctionDef)> = {
            let mut registry = self.inner.registry_mut();
            let held = std::mem::take(&mut registry.held);
            held.into_iter()
                .filter_map(|id| registry.local.get(&id).map(|l| (id, l.def.clone())))
                .collect()
        };
        for (id, def) in defs {
            self.announce(&id, &def);
        }
    }

    /// Registers one local function with the engine (`registerfunction`).
    pub(crate) fn announce(&self, id: &str, def: &FunctionDef) {
        let id = id.to_string();
        let weak = Arc::downgrade(&self.inner);
        let fid = id.clone();
        let gated = held(def);
        let handler = move |payload: Value, metadata: Option<Value>| {
            let weak = weak.clone();
            let fid = fid.clone();
            async move {
                let inner = weak.upgrade().ok_or(iii_sdk::Error::NotConnected)?;
                IiiBus::serve(&inner, &fid, gated, payload, metadata, None)
                    .await
                    .map_err(to_sdk)
            }
        };
        let mut reg = RegisterFunction::new_async(handler).description(def.description.clone());
        if let Some(s) = def.request_schema.clone() {
            reg = reg.request_format(s);
        }
        if let Some(s) = def.response_schema.clone() {
            reg = reg.response_format(s);
        }
        if !def.metadata.is_null() {
            reg = reg.metadata(def.metadata.clone());
        }
        self.inner.client.register_function(id, reg);
    }

    /// Waits until every function registered here is listed by the engine (registration is
    /// fire-and-forget: a call racing it gets `function_not_found`).
    pub(crate) async fn wait_registered(&self) -> Result<(), BusError> {
        let deadline = tokio::time::Instant::now() + self.inner.opts.connect_timeout;
        let mut announce_again = tokio::time::Instant::now() + REANNOUNCE;
        loop {
            let listed = self
                .engine(Engine::Functions(json!({"include_internal": true})))
                .await?;
            self.note_served(&listed);
            let present: HashSet<String> = listed["functions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f["function_id"].as_str().map(str::to_string))
                .collect();
            let missing: Vec<(String, FunctionDef)> = {
                let registry = self.inner.registry();
                let mut missing: Vec<(String, FunctionDef)> = registry
                    .local
                    .iter()
                    .filter(|(id, _)| !present.contains(*id) && !registry.held.contains(*id))
                    .map(|(id, l)| (id.clone(), l.def.clone()))
                    .collect();
                missing.sort_by(|a, b| a.0.cmp(&b.0));
                missing
            };
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= announce_again {
                // The engine refuses a registration while another connection still holds the
                // id (`FUNCTION_NAMESPACE_CONFLICT`: a previous connection of this same worker
                // name it has not dropped yet) and nothing sends it again: send it again.
                tracing::debug!(
                    missing = missing.len(),
                    "registering the functions the engine does not list again"
                );
                for (id, def) in &missing {
                    self.announce(id, def);
                }
                announce_again = tokio::time::Instant::now() + REANNOUNCE;
            }
            if tokio::time::Instant::now() >= deadline {
                let ids: Vec<&str> = missing.iter().map(|(id, _)| id.as_str()).collect();
                return Err(BusError::new(
                    "registration_timeout",
                    format!(
                        "the engine does not list {} of this worker's functions: {}",
                        ids.len(),
                        ids.join(", ")
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the engine lists `function_id` (asked by its prefix).
    pub(crate) async fn engine_has_function(&self, function_id: &str) -> Result<bool, BusError> {
        let prefix = function_id
            .rsplit_once("::")
            .map(|(p, _)| format!("{p}::"))
            .unwrap_or_default();
        let listed = self
            .engine(Engine::Functions(
                json!({"prefix": prefix, "include_internal": true}),
            ))
            .await?;
        Ok(listed["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|f| f["function_id"] == json!(function_id)))
    }

    /// Takes an `engine::functions::list` answer as the set of this worker's functions the
    /// engine routes here (listed under this worker's name).
    pub(crate) fn note_served(&self, listed: &Value) {
        let name = self.inner.opts.worker_name.as_str();
        let mut registry = self.inner.registry_mut();
        let ours: HashSet<String> = listed["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["worker_name"].as_str() == Some(name))
            .filter_map(|f| f["function_id"].as_str())
            .filter(|id| registry.local.contains_key(*id))
            .map(str::to_string)
            .collect();
        registry.served = ours;
    }

    /// Takes the registry as it is now as the baseline of registry-change notices.
    pub(crate) async fn remember_foreign(&self) -> Result<(), BusError> {
        let listed = self
            .engine(Engine::Functions(json!({"include_internal": true})))
            .await?;
        let notice = json!({"event": "functions_changed", "functions": listed["functions"]});
        own_registry_change(&self.inner, &notice);
        Ok(())
    }

    /// Ids of the functions registered through this bus, sorted.
    pub fn local_function_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.inner.registry().local.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Every function registered here, with its schemas (what the engine was told).
    pub fn function_defs(&self) -> Vec<FunctionDef> {
        let registry = self.inner.registry();
        let mut defs: Vec<FunctionDef> = registry.local.values().map(|l| l.def.clone()).collect();
        defs.sort_by(|a, b| a.function_id.cmp(&b.function_id));
        defs
    }
}

/// True for an `engine::functions-available` notice (`{event: "functions_changed", functions:
/// [{function_id, ..}]}`) whose only changes are this worker's own registrations or another
/// harness worker's frame sink: the engine polls its registry every 5 s and announces whatever
/// changed, including what a (re)starting harness worker registered, which is no news to a
/// running turn. Every other notice passes and becomes the new baseline.
pub(crate) fn own_registry_change(inner: &Inner, payload: &Value) -> bool {
    // Every call this worker serves passes here: only the engine's notice takes the lock.
    if payload["event"] != json!("functions_changed") {
        return false;
    }
    let mut registry = inner.registry_mut();
    let Registry { local, foreign, .. } = &mut *registry;
    no_news(|id| local.contains_key(id), foreign, payload)
}

/// The decision of [`own_registry_change`]: `is_own` tells this worker's functions.
fn no_news(
    is_own: impl Fn(&str) -> bool,
    last: &mut Option<BTreeSet<String>>,
    payload: &Value,
) -> bool {
    if payload["event"] != json!("functions_changed") {
        return false;
    }
    let Some(functions) = payload["functions"].as_array() else {
        return false;
    };
    let foreign: BTreeSet<String> = functions
        .iter()
        .filter_map(|f| f["function_id"].as_str())
        .filter(|id| !is_own(id) && !id.starts_with(FRAMES_PREFIX))
        .map(str::to_string)
        .collect();
    let same = last.as_ref() == Some(&foreign);
    *last = Some(foreign);
    same
}

/// Public functions of the harness surface wait for [`IiiBus::open`]; internal ones (the queue's
/// delivery target, the frame sink, hook and cron targets) and siblings are needed to get there.
pub(crate) fn held(def: &FunctionDef) -> bool {
    def.function_id.starts_with("harness::") && !def.is_internal()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(ids: &[&str]) -> Value {
        json!({"event": "functions_changed", "functions": ids.iter().map(|id| json!({"function_id": id, "namespace": "default"})).collect::<Vec<_>>()})
    }

    #[test]
    fn a_registry_change_made_only_of_harness_registrations_is_no_news() {
        let own = |id: &str| id.starts_with("harness::") || id.starts_with("session::");
        let mut last = None;
        // The baseline taken at open.
        assert!(!no_news(own, &mut last, &notice(&["state::get", "f::a"])));
        // The worker (re)registered its own functions, another worker its frame sink.
        assert!(no_news(
            own,
            &mut last,
            &notice(&[
                "state::get",
                "f::a",
                "harness::send",
                "session::append",
                "harness::frames::0af3"
            ])
        ));
        // Someone else's function appeared: news, and the new baseline.
        assert!(!no_news(
            own,
            &mut last,
            &notice(&["state::get", "f::a", "f::b", "harness::send"])
        ));
        assert!(no_news(
            own,
            &mut last,
            &notice(&["state::get", "f::a", "f::b"])
        ));
        // One went away: news too.
        assert!(!no_news(own, &mut last, &notice(&["state::get", "f::b"])));
        // Anything that is not the engine's notice passes untouched.
        assert!(!no_news(own, &mut last, &json!({"session_id": "s"})));
    }
}
