//! No secret reaches a `shell::exec` command: not through its environment, and not through
//! `/proc` (the harness's `environ`, `mem`, `fd/`; any other process's `environ` and
//! `cmdline`), whether the harness runs as root or not.
//!
//! The harness here is a helper: this test binary started again with marker credentials in
//! its environment (only a process's initial environment shows in `/proc/<pid>/environ`), once
//! as the current user and, when that is root, once as `nobody`. Beside it runs another process
//! with markers in its command line and environment.

mod support;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use harness_tools::{Limits, ShellPolicy};
use serde_json::Value;
use support::*;

/// The variables the helper's environment carries, each with a value nothing else holds.
const SECRETS: &[(&str, &str)] = &[
    ("ANTHROPIC_API_KEY", "MARK-anthropic-5f1c"),
    ("OPENAI_API_KEY", "MARK-openai-77e2"),
    ("HARNESS_TOKEN", "MARK-token-a9d0"),
    ("GITHUB_PAT", "MARK-pat-3b44"),
    ("ACME_DEPLOY_ID", "MARK-operator-c0de"),
    (
        "UPSTREAM_URL",
        "https://deploy:MARK-urlpass-91ab@git.example.org/r.git",
    ),
];
const OTHER_ARG: &str = "MARK-other-cmdline-0e7f";
const OTHER_ENV: &str = "MARK-other-environ-6d2a";
const HELPER: &str = "TOOLS_SECRETS_HELPER";

/// Every marker value contains this, and nothing else the commands print does.
const MARK: &str = "MARK-";

/// The other process: a shell that stays (so its command line keeps the marker) with a marker
/// in its environment. Killed on drop.
struct Other(Child);

impl Drop for Other {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn other_process() -> Other {
    Other(
        Command::new("/bin/sh")
            .args(["-c", "sleep 120; :", OTHER_ARG])
            .env("OTHER_PROCESS_SECRET", OTHER_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn the other process"),
    )
}

/// Runs the helper (this binary, only the helper test) as `uid`, returns its output.
fn run_helper(other: u32, uid: Option<u32>) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        "helper_as_the_harness",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env(HELPER, other.to_string())
    .envs(SECRETS.iter().copied())
    .env("TMPDIR", "/tmp");
    if let Some(uid) = uid {
        use std::os::unix::process::CommandExt;
        cmd.uid(uid).gid(uid).env("HOME", "/tmp");
    }
    let out = cmd.output().expect("run the helper");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "helper (uid {uid:?}) failed:\n{text}");
    assert!(
        text.contains("HELPER-CHECKED"),
        "the helper did not run its checks:\n{text}"
    );
    text
}

#[test]
fn no_secret_reaches_a_command_as_root_or_not() {
    let other = other_process();
    let out = run_helper(other.0.id(), None);
    println!("{out}");
    // SAFETY: geteuid only returns a number.
    if unsafe { libc::geteuid() } != 0 {
        println!("not root: the run as another, unprivileged uid is skipped");
        return;
    }
    assert!(out.contains("user_namespace=false"), "{out}");
    let out = run_helper(other.0.id(), Some(65534));
    println!("{out}");
    assert!(out.contains("user_namespace=true"), "{out}");
}

/// The harness of the test above: a no-op unless started by it.
#[tokio::test]
async fn helper_as_the_harness() {
    let Some(other) = std::env::var(HELPER).ok() else {
        return;
    };
    let me = std::process::id();
    let limits = Limits {
        shell_policy: Arc::new(|| ShellPolicy {
            scrub_env: vec!["ACME_*".into()],
            ..ShellPolicy::default()
        }),
        ..Limits::default()
    };
    let rig = Rig::with_limits(limits, |_| Vec::new());
    let run = |command: String| {
        let rig = &rig;
        async move {
            let r = rig.exec(&command).await;
            assert!(
                !r.to_string().contains(MARK),
                "a marker reached the command `{command}`: {r}"
            );
            r
        }
    };
    let out = |r: &Value| {
        format!(
            "{}{}",
            r["stdout"].as_str().unwrap_or(""),
            r["stderr"].as_str().unwrap_or("")
        )
    };

    // The harness: environment, memory, descriptors, signals.
    for command in [
        format!("cat /proc/{me}/environ"),
        format!("head -c 64 /proc/{me}/mem"),
        format!("ls -l /proc/{me}/fd/"),
        format!("kill -0 {me}"),
        format!("cat /proc/{other}/environ"),
        format!("cat /proc/{other}/cmdline"),
    ] {
        let r = run(command.clone()).await;
        assert_ne!(r["exit_code"], 0, "`{command}` worked: {r}");
    }
    // Every process it can see, and its parent.
    let r = run("for f in /proc/*/environ /proc/*/cmdline; do tr '\\0' '\\n' < $f; done; cat /proc/$PPID/environ /proc/1/environ; env".into()).await;
    assert!(
        out(&r).contains("PATH="),
        "its own environment is there: {r}"
    );
    // Only its own processes: sh (pid 1 of its namespace) and ls.
    let r = run("ls /proc".into()).await;
    let pids: Vec<u32> = r["stdout"]
        .as_str()
        .unwrap()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();
    assert!(
        !pids.is_empty() && pids.iter().all(|p| *p <= 3) && pids.len() <= 3,
        "{pids:?}"
    );
    // Ordinary commands that read /proc work.
    let r = run("ps -e -o pid=,comm=; cat /proc/self/status | head -1; head -1 /proc/cpuinfo; ls /proc/self/fd | head -1; readlink /proc/self".into()).await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert!(out(&r).contains("ps"), "{r}");
    assert!(out(&r).contains("Name:"), "{r}");
    if std::path::Path::new("/usr/bin/python3").exists() {
        let r = run(
            "/usr/bin/python3 -c 'import os; print(os.getpid(), len(os.listdir(\"/proc\")) > 0)'"
                .into(),
        )
        .await;
        assert_eq!(r["exit_code"], 0, "{r}");
        assert!(out(&r).contains("True"), "{r}");
    }
    // No capability is left, whoever runs the harness.
    let r = run("grep -E '^Cap(Eff|Prm|Bnd|Amb)' /proc/self/status".into()).await;
    for line in out(&r).lines() {
        assert!(line.ends_with("0000000000000000"), "{line}");
    }
    // The details name what the command kept and what was removed, never a value.
    let env = &r["env"];
    fn names(list: &Value) -> Vec<&str> {
        list.as_array()
            .expect("a list of names")
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect()
    }
    let (kept, removed) = (names(&env["kept"]), names(&env["removed"]));
    for (name, _) in SECRETS {
        assert!(removed.contains(name), "{name} not in {removed:?}");
        assert!(!kept.contains(name), "{name} in {kept:?}");
    }
    assert!(kept.contains(&"PATH"), "{kept:?}");
    let c = &r["confinement"];
    assert_eq!(c["pid_namespace"], true, "{c}");
    assert_eq!(c["capabilities"], "dropped", "{c}");
    println!(
        "HELPER-CHECKED uid={} user_namespace={}",
        unsafe { libc::geteuid() },
        c["user_namespace"]
    );
}
