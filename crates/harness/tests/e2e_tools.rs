//! The built-in tools in the real binary: a SIGKILL while `shell::exec` runs closes the call as
//! interrupted and never runs the command again; the turn goes on.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_shell_exec_runs_the_command_is_closed_as_interrupted_and_never_rerun() {
    let root = tempfile::tempdir().unwrap();
    let command = "echo started >> marker.txt; echo $$ > shell.pid; sleep 30; echo finished >> marker.txt";
    let script = script(vec![
        json!({"match": {"last_user_text": "run the job"},
               "content": [{"type": "function_call", "id": "c1", "function_id": "shell::exec",
                            "arguments": {"command": command, "timeout_ms": 60000}}]}),
        text_gen(None, "The command was interrupted; I will check before running it again.", 0, true),
    ]);
    let mut server = Server::start(&script, &[]).await;
    let sent = server
        .ok(
            "harness::send",
            json!({"session_id": "s_shell", "message": "run the job", "model": "m", "provider": "scripted",
                   "options": {"functions": {"allow": ["shell::exec"], "expose": "native"},
                               "filesystem_root": root.path()}}),
        )
        .await;
    let turn_id = sent["turn_id"].as_str().unwrap().to_string();
    let marker = root.path().join("marker.txt");
    wait_for("the command to start", WAIT, || {
        let marker = marker.clone();
        async move {
            std::fs::read_to_string(&marker)
                .ok()
                .filter(|s| s.contains("started"))
        }
    })
    .await;
    server.kill();
    server.restart().await;
    let status = server.wait_turn("s_shell", &turn_id).await;
    assert_eq!(status["status"], "completed", "{status}");
    let entries = server.transcript("s_shell", false).await;
    assert_every_call_closed(&entries);
    let results: Vec<_> = entries
        .iter()
        .filter(|e| e["message"]["role"] == "function_result")
        .collect();
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0]["message"]["is_error"], true);
    assert_eq!(results[0]["message"]["details"]["error"], "interrupted", "{}", results[0]);
    assert!(text_of(results[0]).contains("at most once"), "{}", text_of(results[0]));
    // The model answered after the interrupted call: the turn went on.
    assert!(entries.iter().any(|e| e["message"]["role"] == "assistant"
        && text_of(e).contains("interrupted; I will check")));
    // Run once: the restarted harness did not start the command again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "started\n");
    // The orphaned command of the killed process is ours to clean up.
    if let Ok(pid) = std::fs::read_to_string(root.path().join("shell.pid")) {
        if let Ok(pid) = pid.trim().parse::<i32>() {
            unsafe {
                libc::killpg(pid, libc::SIGKILL);
            }
        }
    }
}
