//! A bus with the tools registered, and a scratch root to aim them at.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use harness_bus::{Bus, BusError, EmbeddedBus};
use harness_store::{Durability, Store};
use harness_tools::{Limits, Tools};
use serde_json::{json, Value};
use tempfile::TempDir;

pub struct Rig {
    pub bus: EmbeddedBus,
    /// Holds the store, the root, the data directory and an outside directory.
    pub dir: TempDir,
}

impl Rig {
    pub fn new() -> Rig {
        Rig::with_limits(Limits::default(), |_| Vec::new())
    }

    /// `protected` gets the rig's directory and returns the paths to protect.
    pub fn with_limits(limits: Limits, protected: impl FnOnce(&Path) -> Vec<PathBuf>) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        std::fs::create_dir_all(dir.path().join("outside")).unwrap();
        std::fs::write(dir.path().join("outside/secret.txt"), "TOP SECRET\n").unwrap();
        let store = Store::open(&dir.path().join("harness.db"), Durability::Normal).unwrap();
        let bus = EmbeddedBus::new(store).unwrap();
        let tools = Tools::new(protected(dir.path()), limits);
        harness_tools::register(&bus, &tools);
        Rig { bus, dir }
    }

    pub fn root(&self) -> PathBuf {
        std::fs::canonicalize(self.dir.path().join("root")).unwrap()
    }

    pub fn outside(&self) -> PathBuf {
        std::fs::canonicalize(self.dir.path().join("outside")).unwrap()
    }

    /// Calls `function_id` as the loop would after stamping the root.
    pub async fn call(&self, function_id: &str, mut args: Value) -> Result<Value, BusError> {
        args["fs_scope"] = json!({"root": self.root(), "grants": [], "boundary": "workspace"});
        self.bus.call(function_id, args, None).await
    }

    /// Calls `function_id` as the loop would after stamping the root and `grants`.
    pub async fn call_granted(
        &self,
        function_id: &str,
        mut args: Value,
        grants: &[PathBuf],
    ) -> Result<Value, BusError> {
        args["fs_scope"] = json!({"root": self.root(), "grants": grants, "boundary": "workspace"});
        self.bus.call(function_id, args, None).await
    }

    /// [`Rig::call_granted`], which the test expects to succeed.
    pub async fn ok_granted(&self, function_id: &str, args: Value, grants: &[PathBuf]) -> Value {
        match self.call_granted(function_id, args.clone(), grants).await {
            Ok(v) => v,
            Err(e) => panic!("{function_id} {args} granted {grants:?}: {e}"),
        }
    }

    /// `shell::exec` of `command` with nothing else set, which the test expects to succeed.
    pub async fn exec(&self, command: &str) -> Value {
        self.ok("shell::exec", json!({ "command": command })).await
    }

    pub async fn ok(&self, function_id: &str, args: Value) -> Value {
        match self.call(function_id, args.clone()).await {
            Ok(v) => v,
            Err(e) => panic!("{function_id} {args}: {e}"),
        }
    }

    pub async fn err(&self, function_id: &str, args: Value) -> BusError {
        match self.call(function_id, args.clone()).await {
            Ok(v) => panic!("{function_id} {args} should fail, got {v}"),
            Err(e) => e,
        }
    }
}

pub fn text(v: &Value) -> String {
    v["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

pub fn shared_bus(rig: &Rig) -> Arc<dyn Bus> {
    Arc::new(rig.bus.clone())
}

/// The string `field` of every element of the JSON array `list`, in order.
pub fn strings<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    let items = list
        .as_array()
        .unwrap_or_else(|| panic!("an array: {list}"));
    items.iter().map(|e| e[field].as_str().unwrap()).collect()
}
