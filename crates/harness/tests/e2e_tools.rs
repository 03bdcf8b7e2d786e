//! The built-in tools in the real binary: a SIGKILL while `shell::exec` runs closes the call as
//! interrupted and never runs the command again; the turn goes on.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_shell_exec_runs_the_command_is_closed_as_interrupted_and_never_rerun() {
    let root = tempfile::tempdir().unwrap();
    let command =
        "echo started >> marker.txt; echo $$ > shell.pid; sleep 30; echo finished >> marker.txt";
    let script = script(vec![
        json!({"match": {"last_user_text": "run the job"},
               "content": [{"type": "function_call", "id": "c1", "function_id": "shell::exec",
                            "arguments": {"command": command, "timeout_ms": 60000}}]}),
        text_gen(
            None,
            "The command was interrupted; I will check before running it again.",
            0,
            true,
        ),
    ]);
    let mut server = Server::start(&script, &[]).await;
    let (_, turn_id) = server
        .start_turn(shell_send("s_shell", "run the job", root.path()))
        .await;
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
    let entries = server.completed_transcript("s_shell", &turn_id).await;
    assert_every_call_closed(&entries);
    let results: Vec<_> = entries
        .iter()
        .filter(|e| e["message"]["role"] == "function_result")
        .collect();
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0]["message"]["is_error"], true);
    assert_eq!(
        results[0]["message"]["details"]["error"], "interrupted",
        "{}",
        results[0]
    );
    assert!(
        text_of(results[0]).contains("at most once"),
        "{}",
        text_of(results[0])
    );
    // The model answered after the interrupted call: the turn went on.
    assert!(entries
        .iter()
        .any(|e| e["message"]["role"] == "assistant"
            && text_of(e).contains("interrupted; I will check")));
    // Run once: the restarted harness did not start the command again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "started\n");
    // The orphaned command of the killed process is ours to clean up. It runs in its own PID
    // namespace (the pid it wrote means nothing here): its processes are those working in
    // this test's root.
    let root_dir = std::fs::canonicalize(root.path()).unwrap();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if std::fs::read_link(format!("/proc/{pid}/cwd")).ok().as_ref() == Some(&root_dir) {
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Runs the in-process `harness chat` in `cwd` (its filesystem root by default) with `stdin`.
fn local_chat(
    cwd: &std::path::Path,
    data: &std::path::Path,
    script: &std::path::Path,
    message: &str,
    stdin: &str,
) -> (i32, String, String) {
    let out = output_with_stdin(
        std::process::Command::new(BIN)
            .current_dir(cwd)
            .args([
                "chat",
                "-m",
                message,
                "--provider",
                "scripted",
                "--model",
                "m",
            ])
            .args([
                "--allow",
                "fs::*",
                "--data-dir",
                path_str(data),
                "--script",
                path_str(script),
            ])
            .env_remove("HARNESS_DATA_DIR"),
        stdin,
    );
    outcome(out)
}

/// A first-time user of `harness chat` is asked before a file changes: fs::write is held for
/// approval without any `--approve`, while a read runs at once.
#[test]
fn harness_chat_asks_before_a_mutating_tool_runs() {
    let work = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    std::fs::write(work.path().join("notes.txt"), "old notes\n").unwrap();
    let script_file = work
        .path()
        .join("..")
        .join(format!("script-{}.json", std::process::id()));
    let s = script(vec![
        json!({"match": {"last_user_text": "^read"}, "content": [
            {"type": "function_call", "id": "r1", "function_id": "fs::read", "arguments": {"path": "notes.txt"}}]}),
        json!({"match": {"last_user_text": "^write"}, "content": [
            {"type": "function_call", "id": "w1", "function_id": "fs::write", "arguments": {"path": "hello.txt", "content": "hi\n"}}]}),
        json!({"match": {"last_user_text": "^again"}, "content": [
            {"type": "function_call", "id": "w2", "function_id": "fs::write", "arguments": {"path": "hello.txt", "content": "hi\n"}}]}),
        text_gen(None, "ok", 0, true),
    ]);
    std::fs::write(&script_file, s.to_string()).unwrap();

    let (code, out, err) = local_chat(work.path(), data.path(), &script_file, "read the notes", "");
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        !out.contains("[approval needed]"),
        "reads are not held: {out}"
    );

    let (code, out, err) = local_chat(
        work.path(),
        data.path(),
        &script_file,
        "write a file",
        "n\n",
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert_contains_all(
        &out,
        &["[approval needed] call w1 of fs::write", "[denied]"],
    );
    assert!(
        !work.path().join("hello.txt").exists(),
        "a denied write changes nothing"
    );

    let (code, out, err) = local_chat(
        work.path(),
        data.path(),
        &script_file,
        "again, please",
        "y\n",
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("[approved]"), "{out}");
    assert_eq!(
        std::fs::read_to_string(work.path().join("hello.txt")).unwrap(),
        "hi\n"
    );
    std::fs::remove_file(&script_file).ok();
}

/// The running processes (not zombies) working in `dir`. A command runs in its own PID
/// namespace, so the pids it could write down are not the host's: its processes are found by
/// their working directory, the test's own root.
fn running_in(dir: &std::path::Path) -> Vec<(i32, String)> {
    let dir = std::fs::canonicalize(dir).unwrap();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if std::fs::read_link(format!("/proc/{pid}/cwd")).ok() != Some(dir.clone()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let state = stat.rsplit(')').next().unwrap_or("").trim_start();
        if state.starts_with('Z') || state.starts_with('X') {
            continue;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        found.push((pid, comm.trim().to_string()));
    }
    found
}

/// `harness::stop` while `shell::exec` runs: the command and everything it started are killed,
/// and the call is closed as cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_turn_kills_the_commands_whole_process_group() {
    let root = tempfile::tempdir().unwrap();
    let script = script(vec![
        json!({"match": {"last_user_text": "run the job"},
               "content": [{"type": "function_call", "id": "c1", "function_id": "shell::exec",
                            "arguments": {"command": "sleep 60 & wait"}}]}),
        text_gen(None, "stopped", 0, true),
    ]);
    let server = Server::start(&script, &[]).await;
    let (_, turn_id) = server
        .start_turn(shell_send("s_stop", "run the job", root.path()))
        .await;
    let dir = root.path().to_path_buf();
    let started = wait_for("the command to start", WAIT, || {
        let found = running_in(&dir);
        async move {
            found
                .iter()
                .any(|(_, comm)| comm == "sleep")
                .then_some(found)
        }
    })
    .await;
    assert!(started.len() >= 2, "the shell and its sleep: {started:?}");
    server
        .ok("harness::stop", json!({"session_id": "s_stop"}))
        .await;
    let status = server.wait_turn("s_stop", &turn_id).await;
    assert_eq!(status["status"], "cancelled", "{status}");
    wait_for("the whole group to be killed", WAIT, || {
        let left = running_in(&dir);
        async move { left.is_empty().then_some(()) }
    })
    .await;
    let entries = server.transcript("s_stop", false).await;
    assert_every_call_closed(&entries);
    let result = result_of(&entries, "c1");
    assert_eq!(
        result["message"]["details"]["error"], "cancelled",
        "{result}"
    );
}

/// A root that holds the harness's own data directory: the model reads its files but never the
/// store, and the directory is not even listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_around_the_data_directory_never_reaches_the_store() {
    let script = script(vec![
        json!({"match": {"last_user_text": "look around"}, "content": [
            {"type": "function_call", "id": "l1", "function_id": "fs::list", "arguments": {}},
            {"type": "function_call", "id": "r1", "function_id": "fs::read", "arguments": {"path": "data/harness.db"}},
            {"type": "function_call", "id": "r2", "function_id": "fs::read", "arguments": {"path": "script.json"}},
            {"type": "function_call", "id": "s1", "function_id": "fs::search", "arguments": {"pattern": "SQLite", "hidden": true}}
        ]}),
        text_gen(None, "looked", 0, true),
    ]);
    let server = Server::start(&script, &[]).await;
    let root = server.data_dir().parent().unwrap().to_path_buf();
    // Text under the data directory that the search would find if it looked there (the store
    // itself is binary, which a search skips anyway).
    std::fs::write(server.data_dir().join("notes.txt"), "SQLite notes\n").unwrap();
    let entries = server
        .completed_turn(
            json!({"session_id": "s_look", "message": "look around", "model": "m", "provider": "scripted",
                   "options": {"functions": {"allow": ["fs::*"], "expose": "native"},
                               "filesystem_root": root}}),
        )
        .await;
    let result = |id: &str| {
        entries
            .iter()
            .find(|e| e["message"]["function_call_id"] == id)
            .unwrap_or_else(|| panic!("no result for {id}"))
            .clone()
    };
    let listed = result("l1");
    assert_eq!(listed["message"]["is_error"], false, "{listed}");
    let names: Vec<&str> = listed["message"]["details"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"script.json"), "{names:?}");
    assert!(
        !names.contains(&"data"),
        "the data directory is not listed: {names:?}"
    );
    let store = result("r1");
    assert_eq!(store["message"]["is_error"], true);
    assert_eq!(
        store["message"]["details"]["error"]["code"], "tools/protected_path",
        "{store}"
    );
    assert_eq!(result("r2")["message"]["is_error"], false);
    let searched = result("s1");
    let matches = searched["message"]["details"]["matches"]
        .as_array()
        .unwrap();
    assert!(
        matches
            .iter()
            .all(|m| !m["path"].as_str().unwrap().starts_with("data")),
        "the store is never searched: {searched}"
    );
}

/// `shell::exec` in the real binary, with the data directory under the root: the command works
/// in the root but cannot read the store, write beside it or outside the root (Landlock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shell_command_never_reaches_the_store_even_under_its_root() {
    let command = "echo edited >> work/notes.txt; cat data/harness.db > work/stolen.bin; \
                   cp data/harness.db work/copy.bin; echo x > data/planted; \
                   echo x > ../escaped.txt; cat work/notes.txt";
    let script = script(vec![
        json!({"match": {"last_user_text": "run it"}, "content": [
            {"type": "function_call", "id": "x1", "function_id": "shell::exec", "arguments": {"command": command}}
        ]}),
        text_gen(None, "ran", 0, true),
    ]);
    let server = Server::start(&script, &[]).await;
    let root = server.data_dir().parent().unwrap().to_path_buf();
    std::fs::create_dir_all(root.join("work")).unwrap();
    std::fs::write(root.join("work/notes.txt"), "notes\n").unwrap();
    let entries = server
        .completed_turn(shell_send("s_sh", "run it", &root))
        .await;
    let result = entries
        .iter()
        .find(|e| e["message"]["function_call_id"] == "x1")
        .expect("a result for the call");
    let details = &result["message"]["details"];
    assert_eq!(details["confinement"]["kind"], "landlock", "{result}");
    assert_eq!(details["stdout"], "notes\nedited\n", "{result}");
    let stderr = details["stderr"].as_str().unwrap();
    assert!(stderr.contains("Permission denied"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(root.join("work/notes.txt")).unwrap(),
        "notes\nedited\n"
    );
    for stolen in ["work/stolen.bin", "work/copy.bin"] {
        let got = std::fs::read(root.join(stolen)).unwrap_or_default();
        assert!(
            got.is_empty(),
            "{stolen} holds {} bytes of the store",
            got.len()
        );
    }
    assert!(!server.data_dir().join("planted").exists());
    assert!(!root.parent().unwrap().join("escaped.txt").exists());
}
