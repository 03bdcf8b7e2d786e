//! `shell::exec`: runs in the root, in its own process group (killed whole on a timeout and
//! when the call is abandoned), with no credential in its environment.

mod support;

use std::time::{Duration, Instant};

use harness_tools::Limits;
use serde_json::{json, Value};
use support::*;

/// The host pids of running processes whose command line contains `marker`. A command runs in
/// its own PID namespace, so the pids it could report are not the host's: its processes are
/// found by a marker in their arguments instead.
fn running_with(marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if !String::from_utf8_lossy(&cmdline).contains(marker) {
            continue;
        }
        // A zombie waiting for its reaper has finished running.
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = state.rsplit(')').next().unwrap_or("").trim_start();
        if !state.starts_with('Z') && !state.starts_with('X') && !state.is_empty() {
            found.push(pid);
        }
    }
    found
}

async fn wait_gone(marker: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = running_with(marker);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "processes {left:?} ({marker}) outlived the call"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_running(marker: &str, at_least: usize) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = running_with(marker);
        if found.len() >= at_least {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "{at_least} processes with {marker} never ran (found {found:?})"
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
    for cwd in ["../outside", "/"] {
        let e = rig
            .err("shell::exec", json!({"command": "pwd", "cwd": cwd}))
            .await;
        assert_eq!(e.code, "tools/outside_root", "{cwd}: {e}");
    }
    // Each refusal starts with the field it is about.
    for (args, field) in [
        (
            json!({"command": "env", "env": {"OPENAI_API_KEY": "x"}}),
            "env.OPENAI_API_KEY:",
        ),
        (json!({"command": "a", "argv": ["b"]}), "argv:"),
        (json!({}), "command:"),
    ] {
        let e = rig.err("shell::exec", args).await;
        assert!(e.message.starts_with(field), "{e}");
    }
    let e = rig
        .err("shell::exec", json!({"command": "true", "shell": "bash"}))
        .await;
    assert!(e.message.contains("shell"), "{e}");
}

/// `shell::exec` of `command` with its captured output capped at `cap` bytes.
async fn exec_capped(cap: usize, command: &str) -> Value {
    let limits = Limits {
        exec_max_output_bytes: cap,
        ..Limits::default()
    };
    exec_under(limits, command).await
}

/// `shell::exec` of `command` in a rig with `limits`.
async fn exec_under(limits: Limits, command: &str) -> Value {
    let rig = Rig::with_limits(limits, |_| Vec::new());
    rig.exec(command).await
}

#[tokio::test]
async fn output_is_capped() {
    let r = exec_capped(1000, "head -c 50000 /dev/zero | tr '\\0' x").await;
    assert_eq!(r["stdout_truncated_bytes"], 49000);
    let shown = r["stdout"].as_str().unwrap();
    assert_eq!(shown.matches('x').count(), 1000, "{shown}");
    assert!(
        text(&r).contains("[... 49000 bytes of stdout cut here (bytes 500 to 49500 of 50000); the first 500 and the last 500 bytes are shown ...]"),
        "{}",
        text(&r)
    );
}

/// The start of a run and its end (where the errors are) both survive the capture cap.
#[tokio::test]
async fn the_capture_keeps_the_head_and_the_tail() {
    let r = exec_capped(200, "echo FIRST-LINE; seq 1 5000; echo LAST-LINE; echo ERR-START >&2; seq 1 3000 >&2; echo ERR-END >&2").await;
    let t = text(&r);
    for marker in ["FIRST-LINE", "LAST-LINE", "ERR-START", "ERR-END"] {
        assert!(t.contains(marker), "{marker} missing from\n{t}");
    }
    assert!(t.contains("bytes of stdout cut here"), "{t}");
    assert!(t.contains("bytes of stderr cut here"), "{t}");
}

/// Both streams too big for `max_result_bytes` together: each is cut in its middle so that the
/// whole result fits (the loop would elide it whole otherwise), head and tail of each shown.
#[tokio::test]
async fn the_whole_result_fits_max_result_bytes() {
    for max in [1024usize, 4096, 20_000] {
        let limits = Limits {
            max_result_bytes: std::sync::Arc::new(move || max),
            ..Limits::default()
        };
        // Quotes and control characters cost more once escaped: the fit measures, not guesses.
        let r = exec_under(limits, "echo OUT-HEAD; for i in $(seq 1 3000); do printf '\"q\\t%s\"\\n' $i; done; echo OUT-TAIL; echo ERR-HEAD >&2; seq 1 20000 >&2; echo ERR-TAIL >&2").await;
        let size = serde_json::to_string(&r["content"]).unwrap().len()
            + serde_json::to_string(&r).unwrap().len();
        assert!(size <= max, "{size} bytes exceed {max}: {r}");
        let t = text(&r);
        if max >= 4096 {
            for marker in ["OUT-HEAD", "OUT-TAIL", "ERR-HEAD", "ERR-TAIL"] {
                assert!(t.contains(marker), "{max}: {marker} missing from\n{t}");
            }
        }
        // Where and how much, even when the cap leaves room for no output at all.
        assert!(t.contains("bytes of stdout cut"), "{t}");
        assert!(t.contains("bytes of stderr cut"), "{t}");
        assert_eq!(r["exit_code"], 0);
        let cut = r["stderr_truncated_bytes"].as_u64().unwrap();
        assert!(cut > 0, "{r}");
    }
}

#[tokio::test]
async fn a_timeout_kills_the_whole_process_group() {
    let rig = Rig::new();
    // The grandchild ignores the shell's end: only a signal to the group reaches it.
    let started = Instant::now();
    let r = rig
        .ok(
            "shell::exec",
            json!({"command": "sleep 6101.25 & wait", "timeout_ms": 500}),
        )
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "returned at the timeout"
    );
    assert_eq!(r["timed_out"], true, "{r}");
    assert_eq!(r["is_error"], true);
    wait_gone("6101.25").await;
}

#[tokio::test]
async fn a_background_process_does_not_outlive_a_finished_command() {
    let rig = Rig::new();
    let r = rig
        .exec("sleep 6102.25 >/dev/null 2>&1 & echo started")
        .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["stdout"], "started\n");
    wait_gone("6102.25").await;
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
            json!({"command": "sleep 6103.25 & wait", "fs_scope": stamp}),
            None,
        )
        .await
    });
    // The shell (its command line holds the marker) and the sleep.
    wait_running("6103.25", 2).await;
    call.abort();
    let _ = call.await;
    wait_gone("6103.25").await;
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
        .exec("env; cat /proc/self/environ | tr '\\0' '\\n'")
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
