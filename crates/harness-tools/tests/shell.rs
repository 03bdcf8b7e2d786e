//! `shell::exec`: runs in the root, in its own process group (killed whole on a timeout and
//! when the call is abandoned), with no credential in its environment.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use harness_tools::Limits;
use serde_json::json;
use support::*;

/// Whether a process still runs (a zombie waiting for its reaper has finished running).
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
    }
}

async fn wait_gone(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while running(pid) {
        assert!(Instant::now() < deadline, "process {pid} outlived the call");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn read_pid(path: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if let Ok(pid) = s.trim().parse() {
                return pid;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no pid file at {}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn runs_in_the_root_with_exit_code_and_output() {
    let rig = Rig::new();
    std::fs::create_dir_all(rig.root().join("sub")).unwrap();
    let r = rig
        .ok(
            "shell::exec",
            json!({"command": "pwd; echo oops >&2; exit 3", "cwd": "sub"}),
        )
        .await;
    assert_eq!(r["exit_code"], 3);
    assert_eq!(r["is_error"], true);
    assert_eq!(
        r["stdout"],
        format!("{}\n", rig.root().join("sub").display())
    );
    assert_eq!(r["stderr"], "oops\n");
    let r = rig
        .ok(
            "shell::exec",
            json!({"argv": ["printf", "%s-%s", "a b", "c"]}),
        )
        .await;
    assert_eq!(r["stdout"], "a b-c");
    assert_eq!(r["exit_code"], 0);
    assert_eq!(r["is_error"], false);
    let r = rig
        .ok("shell::exec", json!({"command": "cat", "stdin": "fed in"}))
        .await;
    assert_eq!(r["stdout"], "fed in");
}

#[tokio::test]
async fn bad_requests_are_refused_by_field() {
    let rig = Rig::new();
    let e = rig
        .err(
            "shell::exec",
            json!({"command": "pwd", "cwd": "../outside"}),
        )
        .await;
    assert_eq!(e.code, "tools/outside_root", "{e}");
    let e = rig
        .err("shell::exec", json!({"command": "pwd", "cwd": "/"}))
        .await;
    assert_eq!(e.code, "tools/outside_root", "{e}");
    let e = rig
        .err(
            "shell::exec",
            json!({"command": "env", "env": {"OPENAI_API_KEY": "x"}}),
        )
        .await;
    assert!(e.message.starts_with("env.OPENAI_API_KEY:"), "{e}");
    let e = rig
        .err("shell::exec", json!({"command": "a", "argv": ["b"]}))
        .await;
    assert!(e.message.starts_with("argv:"), "{e}");
    let e = rig.err("shell::exec", json!({})).await;
    assert!(e.message.starts_with("command:"), "{e}");
    let e = rig
        .err("shell::exec", json!({"command": "true", "shell": "bash"}))
        .await;
    assert!(e.message.contains("shell"), "{e}");
}

#[tokio::test]
async fn output_is_capped() {
    let limits = Limits {
        exec_max_output_bytes: 1000,
        ..Limits::default()
    };
    let rig = Rig::with_limits(limits, |_| Vec::new());
    let r = rig
        .ok(
            "shell::exec",
            json!({"command": "head -c 50000 /dev/zero | tr '\\0' x"}),
        )
        .await;
    assert_eq!(r["stdout"].as_str().unwrap().len(), 1000);
    assert_eq!(r["stdout_truncated_bytes"], 49000);
    assert!(
        text(&r).contains("49000 more bytes of stdout"),
        "{}",
        text(&r)
    );
}

#[tokio::test]
async fn a_timeout_kills_the_whole_process_group() {
    let rig = Rig::new();
    let pidfile = rig.root().join("grandchild.pid");
    // The grandchild ignores the shell's end: only a signal to the group reaches it.
    let started = Instant::now();
    let r = rig
        .ok(
            "shell::exec",
            json!({"command": "sleep 60 & echo $! > grandchild.pid; wait", "timeout_ms": 500}),
        )
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "returned at the timeout"
    );
    assert_eq!(r["timed_out"], true, "{r}");
    assert_eq!(r["is_error"], true);
    let pid = read_pid(&pidfile).await;
    wait_gone(pid).await;
}

#[tokio::test]
async fn a_background_process_does_not_outlive_a_finished_command() {
    let rig = Rig::new();
    let r = rig
        .ok(
            "shell::exec",
            json!({"command": "sleep 60 >/dev/null 2>&1 & echo $! > bg.pid"}),
        )
        .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    wait_gone(read_pid(&rig.root().join("bg.pid")).await).await;
}

/// A stopped turn abandons the call (the loop stops awaiting it): the group dies with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_call_kills_the_whole_process_group() {
    let rig = Rig::new();
    let bus = shared_bus(&rig);
    let stamp = json!({"root": rig.root(), "grants": [], "boundary": "workspace"});
    let call = tokio::spawn(async move {
        bus.call(
            "shell::exec",
            json!({"command": "sleep 60 & echo $! > g.pid; echo $$ > sh.pid; wait", "fs_scope": stamp}),
            None,
        )
        .await
    });
    let grandchild = read_pid(&rig.root().join("g.pid")).await;
    let shell = read_pid(&rig.root().join("sh.pid")).await;
    assert!(running(grandchild) && running(shell));
    call.abort();
    let _ = call.await;
    wait_gone(shell).await;
    wait_gone(grandchild).await;
}

#[tokio::test]
async fn no_credential_reaches_the_command() {
    // No other test of this binary reads these variables.
    let secrets = [
        ("ANTHROPIC_API_KEY", "sk-ant-canary-1"),
        ("OPENAI_API_KEY", "sk-openai-canary-2"),
        ("OPENAI_COMPATIBLE_API_KEY", "canary-3"),
        ("MY_ANTHROPIC_KEY", "canary-4"),
        ("HARNESS_TOKEN", "canary-5"),
        ("HARNESS_DATA_DIR", "/canary-6"),
        ("GITHUB_TOKEN", "canary-7"),
        ("AWS_SECRET_ACCESS_KEY", "canary-8"),
        ("DB_PASSWORD", "canary-9"),
        ("client_secret", "canary-10"),
    ];
    for (k, v) in secrets {
        std::env::set_var(k, v);
    }
    std::env::set_var("HARNESS_TEST_HARMLESS_LOOKING", "canary-11");
    std::env::set_var("TOOLS_TEST_PLAIN", "visible");
    let rig = Rig::new();
    let r = rig
        .ok(
            "shell::exec",
            json!({"command": "env; cat /proc/self/environ | tr '\\0' '\\n'"}),
        )
        .await;
    let out = r["stdout"].as_str().unwrap();
    for (k, v) in secrets {
        assert!(!out.contains(v), "{k} reached the command");
        assert!(!out.contains(&format!("{k}=")), "{k} reached the command");
    }
    assert!(!out.contains("canary-11"));
    assert!(
        out.contains("TOOLS_TEST_PLAIN=visible"),
        "ordinary variables pass: {out}"
    );
    assert!(out.contains("PATH="), "{out}");
    // The command's own extra variables pass too.
    let r = rig
        .ok(
            "shell::exec",
            json!({"command": "echo $GREETING", "env": {"GREETING": "hi"}}),
        )
        .await;
    assert_eq!(r["stdout"], "hi\n");
}
