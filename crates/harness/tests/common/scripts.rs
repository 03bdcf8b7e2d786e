//! Scripts, fixture functions and transcript checks shared by the end-to-end tests of both
//! modes (embedded `serve` and `worker` on the engine double). Pure helpers: no process here.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// A `harness::send` body for a scripted model that may call `shell::exec` (native) inside
/// `root`.
pub fn shell_send(session_id: &str, message: &str, root: &Path) -> Value {
    json!({"session_id": session_id, "message": message, "model": "m", "provider": "scripted",
           "options": {"functions": {"allow": ["shell::exec"], "expose": "native"},
                       "filesystem_root": root}})
}

/// One text generation of a scripted-provider script.
pub fn text_gen(matcher: Option<&str>, text: &str, chunk_delay_ms: u64, repeat: bool) -> Value {
    let mut g = json!({
        "chunk_delay_ms": chunk_delay_ms,
        "content": [{"type": "text", "text": text}],
        "repeat": repeat,
    });
    if let Some(m) = matcher {
        g["match"] = json!({ "last_user_text": m });
    }
    g
}

/// One generation that calls a function when the last user text matches.
pub fn call_gen(matcher: &str, id: &str, function_id: &str, arguments: Value) -> Value {
    json!({"match": {"last_user_text": matcher},
           "content": [{"type": "function_call", "id": id, "function_id": function_id, "arguments": arguments}]})
}

/// The weather model of the telemetry tests, with known token counts: on "check the weather…"
/// it calls `fx::forecast` (call `c1`) for `city` (42 tokens in, 7 out); then `others` as
/// scripted; any other generation answers `reply` (61 in, 9 out).
pub fn weather_script(city: &str, others: Vec<Value>, reply: &str) -> Value {
    let mut generations = vec![json!({"match": {"last_user_text": "^check the weather"},
           "usage": {"input": 42, "output": 7},
           "content": [{"type": "function_call", "id": "c1", "function_id": "fx::forecast",
                        "arguments": {"city": city}}]})];
    generations.extend(others);
    generations.push(json!({"usage": {"input": 61, "output": 9}, "repeat": true,
                            "content": [{"type": "text", "text": reply}]}));
    script(generations)
}

/// What the model of [`slow_work_script`] says once it heard its call was interrupted.
pub const INTERRUPTED_REPLY: &str = "The job was interrupted; I will check before retrying.";

/// The fixture function `slow::work`, answering after `delay_ms`: long enough for a test to kill
/// a process while the call runs.
pub fn slow_work(delay_ms: u64) -> Fixtures {
    Fixtures::new(json!([{"id": "slow::work", "description": "takes a while",
                          "response": {"done": true}, "delay_ms": delay_ms}]))
}

/// A model that answers `before` as scripted, calls `slow::work` (call `c1`) on "do the work",
/// and then says [`INTERRUPTED_REPLY`].
pub fn slow_work_script(mut before: Vec<Value>) -> Value {
    before.push(call_gen(
        "do the work",
        "c1",
        "slow::work",
        json!({"job": 1}),
    ));
    before.push(text_gen(None, INTERRUPTED_REPLY, 0, true));
    script(before)
}

pub fn script(generations: Vec<Value>) -> Value {
    json!({ "generations": generations })
}

/// A fixtures file and the path of its invocation log, in their own temp dir.
pub struct Fixtures {
    dir: tempfile::TempDir,
}

impl Fixtures {
    pub fn new(functions: Value) -> Fixtures {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("fixtures.json"),
            json!({ "functions": functions }).to_string(),
        )
        .unwrap();
        Fixtures { dir }
    }

    pub fn file(&self) -> PathBuf {
        self.dir.path().join("fixtures.json")
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join("invocations.jsonl")
    }

    /// `--fixtures FILE --fixture-log LOG`.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--fixtures".into(),
            self.file().display().to_string(),
            "--fixture-log".into(),
            self.log().display().to_string(),
        ]
    }
}

/// The `slow::work` call of [`slow_work_script`] ran exactly once and the transcript closes it
/// with its one result, an error that says the call was interrupted: that result.
pub fn assert_slow_work_interrupted<'a>(fx: &Fixtures, entries: &'a [Value]) -> &'a Value {
    assert_eq!(
        invocations(&fx.log()),
        HashMap::from([("c1".to_string(), 1)]),
        "the target ran exactly once"
    );
    assert_every_call_closed(entries);
    let results: Vec<&Value> = entries
        .iter()
        .filter(|e| role_of(e) == Some("function_result"))
        .collect();
    assert_eq!(results.len(), 1, "{}", render(entries));
    let result = results[0];
    assert_eq!(result["message"]["is_error"], true, "{result}");
    assert_eq!(
        result["message"]["details"]["error"], "interrupted",
        "{result}"
    );
    result
}

/// The invocations logged so far, one JSON value per line of the fixture log. A last line not
/// ended yet is still being written (or was cut by a kill): it is not an invocation logged.
pub fn logged_invocations(log: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture log line is JSON"))
        .collect()
}

/// Invocations logged so far, by function_call_id.
pub fn invocations(log: &Path) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for v in logged_invocations(log) {
        *out.entry(v["function_call_id"].as_str().unwrap_or("?").to_string())
            .or_insert(0) += 1;
    }
    out
}

/// The transcript entry holding the result of call `call`.
pub fn result_of<'a>(entries: &'a [Value], call: &str) -> &'a Value {
    entries
        .iter()
        .find(|e| role_of(e) == Some("function_result") && e["message"]["function_call_id"] == call)
        .unwrap_or_else(|| panic!("no result for {call}:\n{}", render(entries)))
}

/// `(role, text)` of every entry, for comparing a whole transcript at once.
pub fn dialogue(entries: &[Value]) -> Vec<(Option<&str>, String)> {
    entries.iter().map(|e| (role_of(e), text_of(e))).collect()
}

/// The texts of the user messages, oldest first.
pub fn user_texts(entries: &[Value]) -> Vec<String> {
    entries
        .iter()
        .filter(|e| role_of(e) == Some("user"))
        .map(text_of)
        .collect()
}

/// The joined text blocks of an entry's message.
pub fn text_of(entry: &Value) -> String {
    entry["message"]["content"]
        .as_array()
        .map(|blocks| {
            blocks
                .iter()
                .filter(|b| b["type"] == "text")
                .filter_map(|b| b["text"].as_str())
                .collect::<String>()
        })
        .unwrap_or_default()
}

pub fn role_of(entry: &Value) -> Option<&str> {
    entry["message"]["role"].as_str()
}

/// `role: text` lines of the message entries, for readable assertion failures.
pub fn render(entries: &[Value]) -> String {
    entries
        .iter()
        .map(|e| match role_of(e) {
            Some(r) => format!("  [{}] {r}: {:?}", e["seq"], text_of(e)),
            None => format!(
                "  [{}] custom {}: {}",
                e["seq"], e["custom"]["custom_type"], e["custom"]["data"]
            ),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every function_call in the transcript has exactly one function_result, and no result is
/// without its call.
pub fn assert_every_call_closed(entries: &[Value]) {
    let mut calls = Vec::new();
    let mut results: HashMap<String, usize> = HashMap::new();
    for e in entries {
        for b in e["message"]["content"].as_array().into_iter().flatten() {
            if b["type"] == "function_call" {
                calls.push(b["id"].as_str().unwrap().to_string());
            }
        }
        if role_of(e) == Some("function_result") {
            *results
                .entry(
                    e["message"]["function_call_id"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                )
                .or_insert(0) += 1;
        }
    }
    for c in &calls {
        assert_eq!(
            results.get(c),
            Some(&1),
            "call {c} must have exactly one result; transcript:\n{}",
            render(entries)
        );
    }
    assert_eq!(
        results.len(),
        calls.len(),
        "no result without a call; transcript:\n{}",
        render(entries)
    );
}
