//! No secret of the harness reaches a model through `shell::exec`, in the real binary: a
//! scripted model allowed `shell::exec` reads `/proc` every way it can (the server's environ,
//! mem and fd, every process's environ and cmdline, pid 1, its own environment) while the
//! provider keys, the API token, a `GITHUB_PAT` and a variable of the operator's scrub list
//! hold marker values, and another process carries markers in its command line and
//! environment. No marker appears in a call's result, the transcript, the server's log, the
//! event stream or anything the server stored.
//!
//! And the output a command prints fits the result cap: the model sees the head and the tail
//! of both streams instead of an elided result.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

/// Every marker holds this, and nothing else in the run does.
const MARK: &str = "MARKER-";
const TOKEN: &str = "MARKER-token-41c7e";
const SECRETS: &[(&str, &str)] = &[
    ("ANTHROPIC_API_KEY", "MARKER-anthropic-9a1f"),
    ("OPENAI_API_KEY", "MARKER-openai-2b8e"),
    ("HARNESS_TOKEN", TOKEN),
    ("GITHUB_PAT", "MARKER-pat-77d3"),
    // Named by the operator's shell_exec_scrub_env, not by any credential pattern.
    ("CORP_VAULT_ADDR", "MARKER-operator-c3a0"),
];

/// A `harness serve` with the markers in its environment, on loopback with a token.
struct Served {
    proc: KillOnDrop,
    base: String,
    log: PathBuf,
    client: reqwest::Client,
}

impl Served {
    async fn start(dir: &Path, config: &Path, script: &Value) -> Served {
        std::fs::write(dir.join("script.json"), script.to_string()).unwrap();
        let log = dir.join("server.log");
        let port = free_port();
        let child = Command::new(BIN)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--script")
            .arg(dir.join("script.json"))
            .arg("--config")
            .arg(config)
            .envs(SECRETS.iter().copied())
            .env_remove("HARNESS_DATA_DIR")
            .stdin(Stdio::null())
            .stdout(Stdio::from(
                std::fs::File::create(dir.join("server.out")).unwrap(),
            ))
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .expect("spawn harness serve");
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        let served = Served {
            proc: KillOnDrop(child),
            base: format!("http://127.0.0.1:{port}"),
            log,
            client: reqwest::Client::builder()
                .default_headers(headers)
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        };
        let bound = format!("harness serving on http://127.0.0.1:{port}");
        let log = served.log.clone();
        wait_for("harness serve to listen", WAIT, || {
            let up = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains(&bound);
            async move { up.then_some(()) }
        })
        .await;
        served
    }

    async fn call(&self, function_id: &str, payload: Value) -> Value {
        let resp = self
            .client
            .post(format!("{}/v1/functions/{function_id}", self.base))
            .json(&payload)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body: Value = resp.json().await.unwrap();
        assert!(status.is_success(), "{function_id}: {status} {body}");
        body
    }

    async fn wait_turn(&self, session_id: &str, turn_id: &str) -> Value {
        process::wait_turn(turn_id, WAIT, || {
            self.call("harness::status", json!({ "session_id": session_id }))
        })
        .await
    }

    /// Every entry of the transcript, custom entries included.
    async fn transcript(&self, session_id: &str) -> Vec<Value> {
        process::transcript(session_id, true, |req| self.call("session::messages", req)).await
    }

    /// The session's event stream from its start, read until the turn's completion arrives.
    async fn events(&self, session_id: &str, turn_id: &str) -> String {
        let resp = self
            .client
            .get(format!("{}/v1/sessions/{session_id}/events", self.base))
            .header("accept", "text/event-stream")
            .timeout(WAIT)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.bytes_stream();
        let mut text = String::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        while !(text.contains("harness::turn-completed") && text.contains(turn_id)) {
            match tokio::time::timeout_at(deadline, body.next()).await {
                Ok(Some(Ok(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
                other => panic!("the event stream ended early ({other:?}):\n{text}"),
            }
        }
        text
    }
}

fn result_text(entry: &Value) -> String {
    entry["message"]["content"]
        .as_array()
        .map(|blocks| {
            blocks
                .iter()
                .filter_map(|b| b["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

/// Every file under `dir`, its bytes searched for `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut hits = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return hits;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            hits.extend(files_containing(&path, needle));
        } else if let Ok(bytes) = std::fs::read(&path) {
            if bytes.windows(needle.len()).any(|w| w == needle) {
                hits.push(path);
            }
        }
    }
    hits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_reads_no_secret_through_proc() {
    if !running_as_root() {
        println!("skipped: this test runs the harness as root, the case where /proc gave most away; not root here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let config = dir.path().join("harness.yaml");
    std::fs::write(&config, "shell_exec_scrub_env: [\"CORP_*\"]\n").unwrap();
    // Another process with a token on its command line and a secret in its environment.
    let other = KillOnDrop(
        Command::new("/bin/sh")
            .args(["-c", "sleep 300; :", "--token=MARKER-other-cmdline-5e2d"])
            .env("OTHER_SERVICE_PASSPHRASE", "MARKER-other-environ-0b19")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let attempts = [
        "cat /proc/$(cat server.pid)/environ",
        "tr '\\0' '\\n' < /proc/$(cat server.pid)/environ",
        "head -c 4096 /proc/$(cat server.pid)/mem",
        "ls -l /proc/$(cat server.pid)/fd/; cat /proc/$(cat server.pid)/fd/*",
        "ls /proc/$(cat server.pid)/root/",
        "cat /proc/$PPID/environ; echo ppid=$PPID",
        "for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done",
        "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done",
        "cat /proc/*/cmdline | tr '\\0' '\\n'",
        "tr '\\0' '\\n' < /proc/1/environ",
        "cat /proc/$(cat other.pid)/environ /proc/$(cat other.pid)/cmdline",
        "env",
        "ls /proc; ps -ef",
        "grep -E '^Cap' /proc/self/status",
    ];
    let calls: Vec<Value> = attempts
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"type": "function_call", "id": format!("c{i}"), "function_id": "shell::exec",
                   "arguments": {"command": c}})
        })
        .collect();
    let script = script(vec![
        json!({"match": {"last_user_text": "find the keys"}, "content": calls}),
        text_gen(None, "I looked everywhere.", 0, true),
    ]);
    let server = Served::start(dir.path(), &config, &script).await;
    std::fs::write(root.join("server.pid"), server.proc.0.id().to_string()).unwrap();
    std::fs::write(root.join("other.pid"), other.0.id().to_string()).unwrap();
    // The harness really holds the markers: its environ (readable here, by the test) has them.
    let environ = std::fs::read(format!("/proc/{}/environ", server.proc.0.id())).unwrap();
    assert!(String::from_utf8_lossy(&environ).contains(TOKEN));

    let sent = server
        .call(
            "harness::send",
            shell_send("s_secrets", "find the keys", &root),
        )
        .await;
    let turn_id = sent["turn_id"].as_str().unwrap().to_string();
    let events = server.events("s_secrets", &turn_id).await;
    let status = server.wait_turn("s_secrets", &turn_id).await;
    assert_eq!(status["status"], "completed", "{status}");

    let entries = server.transcript("s_secrets").await;
    let results: Vec<&Value> = entries
        .iter()
        .filter(|e| e["message"]["role"] == "function_result")
        .collect();
    assert_eq!(results.len(), attempts.len(), "{entries:?}");
    let mut env_ran = false;
    for r in &results {
        let text = result_text(r);
        assert!(
            !r.to_string().contains(MARK),
            "a marker reached a result: {r}"
        );
        let details = &r["message"]["details"];
        assert_eq!(details["confinement"]["pid_namespace"], true, "{r}");
        assert_eq!(details["confinement"]["capabilities"], "dropped", "{r}");
        if text.contains("PATH=") {
            env_ran = true;
        }
    }
    assert!(
        env_ran,
        "the commands ran (env printed its PATH): {results:?}"
    );
    // What the model was shown of a scan: its own processes only.
    let scan = results
        .iter()
        .find(|r| r["message"]["function_call_id"] == "c12")
        .map(|r| result_text(r))
        .expect("the result of the scan");
    assert!(scan.contains("ps -ef"), "{scan}");
    assert!(!scan.contains("harness"), "{scan}");

    let transcript = serde_json::to_string(&entries).unwrap();
    assert!(!transcript.contains(MARK), "a marker is in the transcript");
    assert!(!events.contains(MARK), "a marker is in the event stream");
    let log = std::fs::read_to_string(&server.log).unwrap_or_default()
        + &std::fs::read_to_string(dir.path().join("server.out")).unwrap_or_default();
    assert!(
        !log.contains(MARK),
        "a marker is in the server's log:\n{log}"
    );
    // Everything the server stored (the event log, the transcript, the WAL), byte for byte.
    drop(server);
    let stored = files_containing(&dir.path().join("data"), MARK.as_bytes());
    assert!(stored.is_empty(), "a marker was stored in {stored:?}");
    drop(other);
}

/// A command whose two streams together far exceed `max_result_bytes`: the model's result is
/// not elided, it shows the head and the tail of each stream and says what was cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_sees_both_ends_of_both_streams_under_the_result_cap() {
    let root = tempfile::tempdir().unwrap();
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("harness.yaml");
    std::fs::write(&config, "max_result_bytes: 6000\n").unwrap();
    let command = "echo OUT-HEAD; seq 1 40000; echo OUT-TAIL; \
                   (echo ERR-HEAD; seq 1 40000; echo ERR-TAIL) >&2";
    let script = script(vec![
        call_gen(
            "make noise",
            "n1",
            "shell::exec",
            json!({ "command": command }),
        ),
        text_gen(None, "noted", 0, true),
    ]);
    let server = Server::start(&script, &["--config", path_str(&config)]).await;
    let entries = server
        .completed_turn(shell_send("s_noise", "make noise", root.path()))
        .await;
    let result = result_of(&entries, "n1");
    let text = result_text(result);
    assert!(
        result["message"]["details"].get("result_capped").is_none(),
        "the loop elided the result: {result}"
    );
    for marker in ["OUT-HEAD", "OUT-TAIL", "ERR-HEAD", "ERR-TAIL"] {
        assert!(text.contains(marker), "{marker} missing from\n{text}");
    }
    assert!(text.contains("bytes of stdout cut here"), "{text}");
    assert!(text.contains("bytes of stderr cut here"), "{text}");
}
