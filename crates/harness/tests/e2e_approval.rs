//! The approval gate with real processes: a held call survives SIGKILL of `serve`, approving it
//! after the restart runs the target exactly once, and `harness chat` asks y/n.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use common::*;
use serde_json::{json, Value};

/// A fixtures file with `fixture::write` and the path of its invocation log.
struct Fixtures {
    dir: tempfile::TempDir,
}

impl Fixtures {
    fn new() -> Fixtures {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("fixtures.json"),
            json!({"functions": [{"id": "fixture::write", "description": "Write a file.", "response": {"ok": true}}]})
                .to_string(),
        )
        .unwrap();
        Fixtures { dir }
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("invocations.jsonl")
    }

    /// `serve` flags: the fixtures, their log, and `extra`.
    fn args(&self, extra: &[&str]) -> Vec<String> {
        let mut v = vec![
            "--fixtures".to_string(),
            self.dir.path().join("fixtures.json").display().to_string(),
            "--fixture-log".to_string(),
            self.log().display().to_string(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    }
}

fn write_args(n: u32) -> Value {
    json!({"path": format!("/tmp/note-{n}.txt"), "text": "hello", "mode": {"append": false}})
}

fn call_gen(matcher: &str, id: &str, arguments: Value) -> Value {
    json!({"match": {"last_user_text": matcher},
           "content": [{"type": "function_call", "id": id, "function_id": "fixture::write", "arguments": arguments}]})
}

fn the_script() -> Value {
    script(vec![
        call_gen("^write it$", "c1", write_args(1)),
        call_gen("^write again$", "c2", write_args(2)),
        text_gen(None, "written", 0, true),
    ])
}

fn send_body(session_id: Option<&str>, text: &str) -> Value {
    let mut v = json!({"message": text, "model": "m", "provider": "scripted",
                       "options": {"functions": {"allow": ["fixture::*"]}}});
    if let Some(s) = session_id {
        v["session_id"] = json!(s);
    }
    v
}

fn ids(sent: &Value) -> (String, String) {
    (
        sent["session_id"].as_str().unwrap().to_string(),
        sent["turn_id"].as_str().unwrap().to_string(),
    )
}

async fn wait_parked(api: &Api, sid: &str, call: &str) -> Value {
    let (api, sid, call) = (api.clone(), sid.to_string(), call.to_string());
    wait_for("the turn to park on the held call", WAIT, move || {
        let (api, sid, call) = (api.clone(), sid.clone(), call.clone());
        async move {
            let s = api.status(&sid).await;
            (s["status"] == "awaiting_functions" && s["pending_function_calls"] == json!([call]))
                .then_some(s)
        }
    })
    .await
}

async fn pending(api: &Api, sid: &str) -> Vec<Value> {
    api.ok("approval::list", json!({ "session_id": sid })).await["approvals"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A server that holds every `fixture::*` call for approval, its model writing on "write it".
async fn gated_server() -> (Fixtures, Server) {
    let fx = Fixtures::new();
    let extra = fx.args(&["--approve", "fixture::*"]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(&the_script(), &extra).await;
    (fx, server)
}

/// [`gated_server`] with a turn parked on its held write `c1`: the session and the turn.
async fn parked_write() -> (Fixtures, Server, String, String) {
    let (fx, server) = gated_server().await;
    let (sid, tid) = ids(&server
        .ok("harness::send", send_body(None, "write it"))
        .await);
    wait_parked(&server.api(), &sid, "c1").await;
    (fx, server, sid, tid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_call_survives_sigkill_and_runs_exactly_once_after_approval() {
    let (fx, mut server, sid, tid) = parked_write().await;
    let before = pending(&server.api(), &sid).await;
    assert_eq!(before.len(), 1, "{before:?}");
    let a = before[0].clone();
    assert_eq!(
        (
            a["function_id"].clone(),
            a["function_call_id"].clone(),
            a["turn_id"].clone()
        ),
        (json!("fixture::write"), json!("c1"), json!(tid))
    );
    assert_eq!(a["arguments"], write_args(1));
    assert!(a["digest"].as_str().unwrap().starts_with("sha256:"), "{a}");
    assert!(
        logged_invocations(&fx.log()).is_empty(),
        "nothing ran while held"
    );

    server.kill();
    server.restart().await;

    // The hold survived: same approval, same digest, the turn still parked on it.
    let after = pending(&server.api(), &sid).await;
    assert_eq!(after, before, "the approval is still listed, unchanged");
    wait_parked(&server.api(), &sid, "c1").await;
    assert!(logged_invocations(&fx.log()).is_empty());

    // Bound to what was shown: another digest is refused and consumes nothing.
    let mut wrong =
        json!({"approval_id": a["approval_id"], "decision": "approve", "digest": "sha256:0"});
    let e = server.err("approval::decide", wrong.clone()).await;
    assert_eq!(
        (e.status, e.code.as_str()),
        (400, "harness/invalid_request")
    );
    assert!(
        e.message
            .starts_with("digest: the arguments changed since they were shown"),
        "{}",
        e.message
    );
    wrong["digest"] = a["digest"].clone();
    let out = server.ok("approval::decide", wrong.clone()).await;
    assert_eq!(
        out,
        json!({"decided": true, "approval_id": a["approval_id"], "status": "approved", "resolved": true, "turn_resumed": true})
    );
    let status = server.wait_turn(&sid, &tid).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["result"], "written");

    // Consumed once.
    let e = server.err("approval::decide", wrong).await;
    assert!(
        e.message
            .starts_with("approval_id: already decided (approved)"),
        "{}",
        e.message
    );
    assert!(pending(&server.api(), &sid).await.is_empty());

    let log = logged_invocations(&fx.log());
    assert_eq!(log.len(), 1, "the target ran exactly once: {log:?}");
    assert_eq!(log[0]["function_call_id"], "c1");
    assert_eq!(log[0]["function_id"], "fixture::write");
    assert_eq!(log[0]["arguments"], write_args(1));

    let entries = server.transcript(&sid, false).await;
    assert_every_call_closed(&entries);
    let r = result_of(&entries, "c1");
    assert_eq!(r["message"]["is_error"], false, "{r}");
    assert_eq!(r["origin"]["approval_id"], a["approval_id"], "{r}");

    server.assert_one_clean_turn(&sid, &tid).await;
}

/// A stop writes the results of the calls it closes in the same batch as the cancelled record:
/// killed after closing them and before that batch, nothing of the stop is on disk (the turn
/// still waits on its held call, no result without a terminal record); a second stop ends it
/// with one result per call and one turn-completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_killed_before_its_batch_leaves_nothing_half_written() {
    let (fx, mut server, sid, tid) = parked_write().await;

    server.kill();
    server.set_env("HARNESS_FAILPOINT", Some("after_calls_closed"));
    server.start_again().await;
    wait_parked(&server.api(), &sid, "c1").await;
    // The answer races the failpoint: it may never arrive.
    let _ = server
        .try_ok("harness::stop", json!({ "session_id": sid }))
        .await;
    server.wait_killed_at("after_calls_closed").await;

    server.set_env("HARNESS_FAILPOINT", None);
    server.start_again().await;
    wait_parked(&server.api(), &sid, "c1").await;
    let entries = server.transcript(&sid, false).await;
    assert!(
        !entries
            .iter()
            .any(|e| e["message"]["role"] == "function_result"),
        "no result was written without the cancelled record:\n{}",
        render(&entries)
    );

    let out = server
        .ok("harness::stop", json!({ "session_id": sid }))
        .await;
    assert_eq!(out["stopping"], true, "{out}");
    let status = server.wait_turn(&sid, &tid).await;
    assert_eq!(status["status"], "cancelled", "{status}");
    let entries = server.transcript(&sid, false).await;
    assert_every_call_closed(&entries);
    let r = result_of(&entries, "c1");
    assert_eq!(r["message"]["is_error"], true, "{r}");
    assert!(
        logged_invocations(&fx.log()).is_empty(),
        "the held call never ran"
    );
    server.assert_one_clean_turn(&sid, &tid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_without_approve_unbinds_the_gate_and_leftover_approvals_stay_decidable() {
    let (fx, mut server, sid, tid) = parked_write().await;
    let a = pending(&server.api(), &sid).await.remove(0);

    server.kill();
    let plain = fx.args(&[]);
    let plain: Vec<&str> = plain.iter().map(String::as_str).collect();
    server.set_extra(&plain);
    server.restart().await;

    assert_eq!(pending(&server.api(), &sid).await, vec![a.clone()]);
    let out = server
        .ok(
            "approval::decide",
            json!({"approval_id": a["approval_id"], "decision": "approve", "digest": a["digest"]}),
        )
        .await;
    assert_eq!(out["resolved"], true);
    assert_eq!(server.wait_turn(&sid, &tid).await["status"], "completed");

    // No gate any more: the next call runs at once (a stale binding would deny it instead).
    let (_, tid2) = ids(&server
        .ok("harness::send", send_body(Some(&sid), "write again"))
        .await);
    assert_eq!(server.wait_turn(&sid, &tid2).await["status"], "completed");
    let calls: Vec<String> = logged_invocations(&fx.log())
        .iter()
        .map(|v| v["function_call_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(calls, vec!["c1".to_string(), "c2".to_string()]);
    let entries = server.transcript(&sid, false).await;
    assert_every_call_closed(&entries);
    assert_eq!(result_of(&entries, "c2")["message"]["is_error"], false);
}

/// Runs `harness chat` against the server with `stdin` piped in; returns (code, stdout, stderr).
async fn chat(
    url: &str,
    session: Option<&str>,
    message: &str,
    stdin: &str,
) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "chat",
        "-m",
        message,
        "--url",
        url,
        "--provider",
        "scripted",
        "--model",
        "m",
    ])
    .args(["--allow", "fixture::*"]);
    if let Some(s) = session {
        cmd.args(["--session", s]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn harness chat");
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).unwrap();
    drop(input);
    let pid = child.id();
    let waited = tokio::time::timeout(
        WAIT,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    match waited {
        Ok(out) => outcome(out.unwrap().expect("wait for harness chat")),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("harness chat did not finish within {WAIT:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_chat_shows_the_approval_and_takes_y_or_n() {
    let (fx, server) = gated_server().await;
    let url = server.url();

    // y: the call runs once and the reply follows.
    let (code, out, err) = chat(&url, None, "write it", "y\n").await;
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert_contains_all(
        &out,
        &[
            "[approval needed] call c1 of fixture::write",
            "Approve? [y/N] ",
            "[approved]",
        ],
    );
    assert!(
        out.contains("\"path\": \"/tmp/note-1.txt\""),
        "the arguments are shown: {out}"
    );
    assert!(
        out.trim_end().ends_with("written"),
        "the reply follows: {out}"
    );
    let log = logged_invocations(&fx.log());
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0]["function_call_id"], "c1");
    assert_eq!(log[0]["arguments"], write_args(1));

    // n: the denial reaches the model, the target does not run.
    let sessions = server.ok("session::list", json!({})).await;
    let sessions = sessions["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    let sid = sessions[0]["session_id"].as_str().unwrap().to_string();
    let (code, out, err) = chat(&url, Some(&sid), "write again", "n\n").await;
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert_contains_all(
        &out,
        &["[approval needed] call c2 of fixture::write", "[denied]"],
    );
    assert_eq!(
        logged_invocations(&fx.log()).len(),
        1,
        "a denied call never runs"
    );
    let entries = server.transcript(&sid, false).await;
    assert_every_call_closed(&entries);
    let r = result_of(&entries, "c2");
    assert_eq!(r["message"]["is_error"], true);
    assert_eq!(text_of(r), "denied by the approver: denied in harness chat");
    assert!(pending(&server.api(), &sid).await.is_empty());
    let s = server.status(&sid).await;
    assert_eq!(s["status"], "completed", "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_chat_leaves_the_approval_pending_when_stdin_ends() {
    let (fx, server) = gated_server().await;
    let (code, out, err) = chat(&server.url(), None, "write it", "").await;
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("stays pending"), "{out}");
    let all = server.ok("approval::list", json!({})).await;
    let approvals = all["approvals"].as_array().unwrap();
    assert_eq!(approvals.len(), 1, "{all}");
    assert!(logged_invocations(&fx.log()).is_empty());
}
