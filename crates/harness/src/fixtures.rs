//! Fixture functions for tests and demos (`--fixtures FILE`, `--fixture-log FILE`).
//!
//! ```json
//! {"functions": [{"id": "demo::weather", "description": "...", "request_schema": {...},
//!   "response": {"temp_c": 21}, "delay_ms": 0, "is_error": false}]}
//! ```
//!
//! Every invocation is appended to the log as one JSON line `{function_id, arguments,
//! function_call_id, at}` and fsynced before the function answers, so a crash test can count
//! exactly how often a target ran.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FixtureFile {
    functions: Vec<Fixture>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Fixture {
    id: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    request_schema: Option<Value>,
    #[serde(default)]
    response: Value,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    is_error: bool,
}

/// The invocation log. A std Mutex: each append is one short blocking write + fsync, done on a
/// blocking thread.
#[derive(Clone)]
struct Log(Arc<Mutex<File>>);

impl Log {
    fn open(path: &Path) -> Result<Log> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open the fixture log {}", path.display()))?;
        Ok(Log(Arc::new(Mutex::new(file))))
    }

    async fn append(&self, line: Value) -> std::io::Result<()> {
        let log = self.0.clone();
        tokio::task::spawn_blocking(move || {
            let mut file = log.lock().expect("fixture log lock");
            // One write of the whole line: `writeln!` on an unbuffered file writes each piece
            // of the value's formatting by itself, and a test reading the log meanwhile saw
            // half a line.
            let mut text = line.to_string();
            text.push('\n');
            file.write_all(text.as_bytes())?;
            file.sync_data()
        })
        .await
        .map_err(std::io::Error::other)?
    }
}

fn answer(f: &Fixture, arguments: &Value) -> Value {
    if let Some(schema) = &f.request_schema {
        if let Ok(validator) = jsonschema::validator_for(schema) {
            let problems: Vec<String> = validator
                .iter_errors(arguments)
                .map(|e| format!("{} at '{}'", e, e.instance_path().as_str()))
                .collect();
            if !problems.is_empty() {
                return json!({"content": [{"type": "text", "text": format!("invalid_argument: {}", problems.join("; "))}], "is_error": true});
            }
        }
    }
    if !f.is_error {
        return f.response.clone();
    }
    let text = match &f.response {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    json!({"content": [{"type": "text", "text": text}], "is_error": true})
}

/// Registers the fixture functions of `path`; returns how many.
pub fn register(bus: &dyn Bus, path: &Path, log: Option<&PathBuf>) -> Result<usize> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read fixtures {}", path.display()))?;
    let file: FixtureFile = harness_types::parse::parse_payload(
        serde_json::from_str(&text).map_err(|e| anyhow!("fixtures: not JSON: {e}"))?,
    )
    .map_err(|e| anyhow!("fixtures: {}", e.message))?;
    let log = log.map(|p| Log::open(p)).transpose()?;
    for f in &file.functions {
        if f.id.is_empty() {
            return Err(anyhow!("fixtures: functions[].id must not be empty"));
        }
        let mut def = FunctionDef::new(f.id.clone(), f.description.clone());
        def.request_schema = f.request_schema.clone();
        let fixture = f.clone();
        let log = log.clone();
        let handler = move |arguments: Value, ctx: CallContext| {
            let fixture = fixture.clone();
            let log = log.clone();
            async move {
                if let Some(log) = &log {
                    let line = json!({
                        "function_id": fixture.id,
                        "arguments": arguments,
                        "function_call_id": ctx.metadata.get("function_call_id"),
                        "at": harness_types::now_ms(),
                    });
                    log.append(line)
                        .await
                        .map_err(|e| BusError::internal(format!("fixture log: {e}")))?;
                }
                if fixture.delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(fixture.delay_ms)).await;
                }
                Ok(answer(&fixture, &arguments))
            }
        };
        bus.register_function(def, Arc::new(handler) as Arc<dyn Handler>);
    }
    Ok(file.functions.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(is_error: bool) -> Fixture {
        Fixture {
            id: "t::f".into(),
            description: String::new(),
            request_schema: Some(
                json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
            ),
            response: json!({"ok": true}),
            delay_ms: 0,
            is_error,
        }
    }

    #[test]
    fn answers_validate_arguments_and_flag_errors() {
        assert_eq!(
            answer(&fixture(false), &json!({"n": 1})),
            json!({"ok": true})
        );
        let bad = answer(&fixture(false), &json!({"n": "1"}));
        assert_eq!(bad["is_error"], true);
        assert!(bad["content"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("invalid_argument:"));
        assert_eq!(answer(&fixture(true), &json!({"n": 1}))["is_error"], true);
    }
}
