//! The configuration file against the real binary: every key of the spec loads (YAML, `${ENV}`
//! expanded), an unknown key names itself, `config show` tells where each value came from, and
//! an edit of the file changes the next turn of a running server, while a bad edit is refused
//! and the running configuration kept.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    assert_contains_all, outcome, path_str, run_cli, script, Server, Sessions, BIN, WAIT,
};
use serde_json::{json, Value};

/// Every key of behaviour spec §10 (and the seed README), each away from its default.
const EVERY_KEY: &str = r#"
default_max_turns: 7
default_pending_timeout_ms: 60000
max_depth: 2
max_children: 4
max_validation_retries: 1
max_transient_resumes: 2
max_result_bytes: 65536
prompt_cache_sections: false
call_reconciliation: coerce
idem_ttl_secs: 3600
session_timeout_ms: 5000
context_timeout_ms: 100000
router_timeout_ms: 300000
dispatch_timeout_ms: 120000
stream_coalesce_ms: 50
sweep_expression: "0 */5 * * * *"
default_functions:
  allow: ["fixture::*"]
  deny: ["fixture::danger"]
default_filesystem_root: "off"
projects_file_path: ${CONFIG_TEST_HOME}/projects.json
directory_path: ${CONFIG_TEST_HOME}/directory
mcp_servers: {}
# Beyond §10: knobs of this implementation.
default_context_window: 100000
web_fetch_allow_private: true
queue_concurrency: 16
step_visibility_timeout_ms: 600000
first_write_hold_ms: 0
"#;

fn cli_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for key in [
        "HARNESS_MAX_DEPTH",
        "HARNESS_DEFAULT_MAX_TURNS",
        "OTEL_SDK_DISABLED",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    ] {
        cmd.env_remove(key);
    }
    outcome(cmd.envs(env.iter().copied()).output().unwrap())
}

/// Runs the CLI as [`cli_env`] does; it must exit 0. Returns its stdout.
fn cli_ok(args: &[&str], env: &[(&str, &str)]) -> String {
    let (rc, out, err) = cli_env(args, env);
    assert_eq!(rc, 0, "harness {args:?}: {err}");
    out
}

#[test]
fn a_file_with_every_key_loads_and_show_names_each_source() {
    let (dir, file) = config_file("harness.yaml", EVERY_KEY);
    let env = [("CONFIG_TEST_HOME", "/srv/h")];
    let out = cli_ok(&["config", "validate", path_str(&file)], &env);
    assert!(out.contains("ok (26 keys set)"), "{out}");
    // Without the variable the reference is named.
    let (rc, _, err) = cli_env(&["config", "validate", path_str(&file)], &[]);
    assert_eq!(rc, 1);
    assert!(
        err.contains("harness/invalid_config: projects_file_path: ${CONFIG_TEST_HOME}"),
        "{err}"
    );
    let env = [("CONFIG_TEST_HOME", "/srv/h"), ("HARNESS_MAX_DEPTH", "5")];
    let out = cli_ok(
        &[
            "config",
            "show",
            "--json",
            "--config",
            path_str(&file),
            "--stream-coalesce-ms",
            "0",
        ],
        &env,
    );
    let shown: Value = serde_json::from_str(&out).unwrap();
    let file_source = format!("file {}", file.display());
    assert_eq!(
        shown["default_max_turns"],
        json!({"value": 7, "source": file_source})
    );
    assert_eq!(shown["projects_file_path"]["value"], "/srv/h/projects.json");
    assert_eq!(
        shown["default_functions"]["value"]["deny"],
        json!(["fixture::danger"])
    );
    assert_eq!(shown["default_filesystem_root"]["value"], "off");
    assert_eq!(shown["web_fetch_allow_private"]["value"], true);
    assert_eq!(
        shown["max_depth"],
        json!({"value": 5, "source": "env HARNESS_MAX_DEPTH"})
    );
    assert_eq!(
        shown["stream_coalesce_ms"],
        json!({"value": 0, "source": "flag --stream-coalesce-ms"})
    );
    // Every key of the file is shown as coming from it, except the two overridden above.
    let from_file = shown
        .as_object()
        .unwrap()
        .values()
        .filter(|v| v["source"] == json!(file_source))
        .count();
    assert_eq!(from_file, 24);
    // A runtime started on it says which keys it does not act on yet.
    let data = dir.path().join("data");
    let (rc, _, err) = cli_env(
        &[
            "chat",
            "-m",
            "hello",
            "--data-dir",
            path_str(&data),
            "--config",
            path_str(&file),
        ],
        &[("CONFIG_TEST_HOME", "/srv/h")],
    );
    assert_eq!(rc, 0, "{err}");
    assert!(!err.contains("max_validation_retries"), "{err}");
    assert!(
        !err.contains("default_functions is accepted but not acted on"),
        "the parentless-spawn baseline is acted on: {err}"
    );
    assert!(
        !err.contains("config: default_filesystem_root is accepted but not acted on"),
        "{err}"
    );
    assert!(
        err.contains("config: projects_file_path is accepted but not acted on"),
        "{err}"
    );
    // Without a file, each key shows its shipped default.
    let out = cli_ok(&["config", "show"], &[]);
    assert_contains_all(
        &out,
        &[
            "default_max_turns: 16  # default",
            "max_validation_retries: 2  # default",
            "idem_ttl_secs: 86400  # default",
            "context_timeout_ms: 320000  # default",
            "default_filesystem_root: null  # default",
            "web_fetch_allow_private: false  # default",
            "projects_file_path: \"~/.iii/data/harness/projects.json\"  # default, not acted on yet",
            "sweep_expression: \"0 * * * * *\"  # default",
        ],
    );
}

#[test]
fn an_unknown_key_names_itself() {
    let (dir, file) = config_file("harness.json", r#"{"default_max_turns": 3, "max_dept": 2}"#);
    let (rc, _, err) = run_cli(&["config", "validate", path_str(&file)]);
    assert_eq!(rc, 1);
    assert!(
        err.contains("harness/invalid_config: max_dept: unknown key"),
        "{err}"
    );
    // A server will not start on it either.
    let (rc, _, err) = run_cli(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        path_str(&dir.path().join("data")),
        "--config",
        path_str(&file),
    ]);
    assert_eq!(rc, 1);
    assert!(err.contains("max_dept: unknown key"), "{err}");
    // A wrong type names the key too.
    std::fs::write(&file, "max_children: many\n").unwrap();
    let (_, _, err) = run_cli(&["config", "validate", path_str(&file)]);
    assert!(
        err.contains("harness/invalid_config: max_children: invalid type"),
        "{err}"
    );
}

/// Runs a new session's turn to its end; returns its `max_turns (N) reached` note, if any.
async fn max_turns_note(server: &Server) -> Option<String> {
    let sent = server.send(None, "go").await;
    let sid = sent["session_id"].as_str().unwrap();
    server
        .wait_turn(sid, sent["turn_id"].as_str().unwrap())
        .await;
    server
        .transcript(sid, true)
        .await
        .iter()
        .map(Value::to_string)
        .find(|e| e.contains("reached; ending the turn"))
        .and_then(|e| {
            let at = e.find("max_turns (")?;
            Some(e[at..].split(')').next()?.to_string() + ")")
        })
}

/// A configuration file `name` holding `content`, in a temporary directory that lives as long
/// as the returned guard.
fn config_file(name: &str, content: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(name);
    std::fs::write(&file, content).unwrap();
    (dir, file)
}

/// A `harness serve` of `model` reading `harness.yaml`, which holds `config`; the file's
/// directory (a guard) and path come back with it, for the tests that edit it.
async fn serve_with_config(config: &str, model: &Value) -> (tempfile::TempDir, PathBuf, Server) {
    let (dir, file) = config_file("harness.yaml", config);
    let server = Server::start(model, &["--config", path_str(&file)]).await;
    (dir, file, server)
}

/// Waits until the server log mentions `what` `n` times.
async fn wait_log(server: &Server, what: &str, n: usize) {
    let deadline = Instant::now() + WAIT;
    while server.log().matches(what).count() < n {
        assert!(
            Instant::now() < deadline,
            "log never said {what:?} {n} times:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn editing_the_file_changes_the_next_turn_without_a_restart() {
    // A model that calls a function at every step: only max_turns ends its turn.
    let model = script(vec![json!({
        "repeat": true,
        "content": [{"type": "function_call", "id": "c_{request_id}", "function_id": "fixture::none", "arguments": {}}]
    })]);
    let (_dir, file, server) = serve_with_config("default_max_turns: 1\n", &model).await;
    assert_eq!(
        max_turns_note(&server).await.as_deref(),
        Some("max_turns (1)")
    );
    for (edit, logged, times, cap) in [
        ("default_max_turns: 3\n", "reloaded", 1, "max_turns (3)"),
        // A bad edit is refused with its key named; the running configuration stays.
        (
            "default_max_turns: 2\nmax_turn: 9\n",
            "max_turn: unknown key",
            1,
            "max_turns (3)",
        ),
        // Fixing it applies the fix.
        ("default_max_turns: 2\n", "reloaded", 2, "max_turns (2)"),
    ] {
        std::fs::write(&file, edit).unwrap();
        wait_log(&server, logged, times).await;
        assert_eq!(
            max_turns_note(&server).await.as_deref(),
            Some(cap),
            "after writing {edit:?}"
        );
    }
    assert!(server.log().contains("keeping the running configuration"));
}

#[tokio::test]
async fn idempotency_keys_expire_after_idem_ttl_secs_and_the_sweep_prunes_them() {
    let model = script(vec![common::text_gen(None, "ok", 0, true)]);
    let (_dir, _, server) = serve_with_config("idem_ttl_secs: 1\n", &model).await;
    let api = server.api();
    let send = |key: &'static str| {
        let api = api.clone();
        async move {
            api.ok(
                "harness::send",
                json!({"message": "hi", "model": "m", "provider": "scripted", "idempotency_key": key}),
            )
            .await
        }
    };
    let first = send("k1").await;
    let again = send("k1").await;
    assert_eq!(again["deduplicated"], true, "{again}");
    assert_eq!(again["session_id"], first["session_id"]);
    // Once the TTL has passed the key is fresh again: a new send, not the old answer.
    let fresh = common::wait_for("k1 to expire", WAIT, || {
        let send = send("k1");
        async move {
            let r = send.await;
            (r["deduplicated"] != true).then_some(r)
        }
    })
    .await;
    assert_ne!(fresh["session_id"], first["session_id"]);
    // And the sweep deletes expired rows.
    send("k2").await;
    let row = api
        .ok("state::get", json!({"scope": "harness_idem", "key": "k2"}))
        .await;
    assert!(
        !row.is_null() && !row.get("value").is_some_and(Value::is_null),
        "{row}"
    );
    common::wait_for("k2 to be pruned", WAIT, || {
        let api = api.clone();
        async move {
            api.ok("harness::sweep-pending", json!({})).await;
            let row = api
                .ok("state::get", json!({"scope": "harness_idem", "key": "k2"}))
                .await;
            let gone = row.is_null() || row.get("value").is_some_and(Value::is_null);
            gone.then_some(())
        }
    })
    .await;
}

/// The README's configuration block lists every key with its real default.
#[test]
fn the_readme_block_is_every_key_at_its_default() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    // The configuration block, among the README's YAML blocks (the worker's engine config is one).
    let block = readme
        .split("```yaml\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|b| b.contains("default_max_turns:"))
        .expect("the configuration's yaml block in README.md");
    let (_dir, file) = config_file("readme.yaml", block);
    cli_ok(&["config", "validate", path_str(&file)], &[]);
    let (_, shown, _) = cli_env(
        &["config", "show", "--json", "--config", path_str(&file)],
        &[],
    );
    let (_, defaults, _) = cli_env(&["config", "show", "--json"], &[]);
    let shown: Value = serde_json::from_str(&shown).unwrap();
    let defaults: Value = serde_json::from_str(&defaults).unwrap();
    let shown = shown.as_object().unwrap();
    assert_eq!(shown.len(), defaults.as_object().unwrap().len());
    for (key, d) in defaults.as_object().unwrap() {
        assert_eq!(shown[key]["value"], d["value"], "README default of {key}");
        assert!(
            shown[key]["source"].as_str().unwrap().starts_with("file "),
            "{key} missing from README"
        );
    }
}

#[tokio::test]
async fn max_validation_retries_from_the_file_bounds_the_nudges_of_the_next_turn() {
    // A model that never answers with JSON.
    let model = script(vec![common::text_gen(None, "not json", 0, true)]);
    let (_dir, file, server) = serve_with_config("max_validation_retries: 0\n", &model).await;
    let api = server.api();
    let nudges = |api: common::Api| async move {
        let (sid, turn_id) = api
            .start_turn(
                json!({"message": "go", "model": "m", "provider": "scripted",
                               "options": {"output": {"type": "json"}}}),
            )
            .await;
        let status = api.wait_turn(&sid, &turn_id).await;
        assert_eq!(status["status"], "failed", "{status}");
        api.transcript(&sid, true)
            .await
            .iter()
            .filter(|e| e.to_string().contains("previous result was not accepted"))
            .count()
    };
    assert_eq!(nudges(api.clone()).await, 0);
    std::fs::write(&file, "max_validation_retries: 2\n").unwrap();
    wait_log(&server, "reloaded", 1).await;
    assert_eq!(nudges(api).await, 2);
}

/// The sandbox keys of `shell::exec` are listed with their defaults and take a file's values.
#[test]
fn config_show_lists_the_shell_sandbox_keys() {
    let out = cli_ok(&["config", "show"], &[]);
    assert_contains_all(
        &out,
        &[
            "shell_exec_unconfined: false  # default",
            "shell_exec_allow_network: false  # default",
            "shell_exec_read_paths: []  # default",
        ],
    );
    let (_dir, file) = config_file(
        "harness.yaml",
        "shell_exec_unconfined: true\nshell_exec_allow_network: true\nshell_exec_read_paths: [\"~/.cargo\"]\n",
    );
    let out = cli_ok(&["config", "show", "--config", path_str(&file)], &[]);
    assert!(out.contains("shell_exec_unconfined: true  # file"), "{out}");
    assert!(
        out.contains("shell_exec_allow_network: true  # file"),
        "{out}"
    );
    assert!(out.contains("~/.cargo"), "{out}");
    let (rc, _, err) = cli_env(
        &["config", "show"],
        &[("HARNESS_SHELL_EXEC_UNCONFINED", "yes")],
    );
    assert_ne!(rc, 0);
    assert!(err.contains("shell_exec_unconfined"), "{err}");
}

/// The standard `OTEL_*` variables win over `otel_endpoint`, so `config show` names the endpoint
/// export will really use and the variable it came from; `OTEL_SDK_DISABLED` says none is used.
#[test]
fn config_show_names_the_otlp_endpoint_in_force_and_its_variable() {
    let out = cli_ok(
        &["config", "show"],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")],
    );
    assert!(
        out.contains(
            "otel_endpoint: \"http://127.0.0.1:4318/v1/traces\"  # env OTEL_EXPORTER_OTLP_ENDPOINT"
        ),
        "{out}"
    );
    let out = cli_ok(
        &["config", "show"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
            ("OTEL_SDK_DISABLED", "true"),
        ],
    );
    assert!(
        out.contains("otel_endpoint: null  # env OTEL_SDK_DISABLED=true"),
        "{out}"
    );
    let (_, out, _) = cli_env(&["config", "show"], &[]);
    assert!(out.contains("otel_endpoint: null  # default"), "{out}");
}
